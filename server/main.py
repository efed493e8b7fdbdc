"""`specserve` / `text-generation-launcher`: configuration -> engine thread -> gRPC + HTTP.

Startup order (TGIS's): load the model, check it answers (a one-token generation), start gRPC
and log ``gRPC server started on port N``, then HTTP and ``HTTP server started on port M``.
Both serve on one event loop: gRPC's `fmaas.GenerationService` and the HTTP port's
OpenAI-compatible API (`server.openai`) share one `RequestRunner`, so MAX_CONCURRENT_REQUESTS
counts the requests of both.
The gRPC port serves TLS (or mTLS) when configured, the standard `grpc.health.v1.Health`
service (SERVING once the model answered, NOT_SERVING from the start of a shutdown) and server
reflection. SIGTERM/SIGINT: stop accepting RPCs, give in-flight ones `shutdown_grace_s` to finish,
cancel the rest, stop the engine (and the other tensor-parallel ranks, NUM_SHARD > 1) and exit 0.
A tensor-parallel rank that dies or hangs stops the server at once, exit code 1, the error
naming the rank.

Both ports are bound exclusively (gRPC without SO_REUSEPORT, so a second server on the same
GRPC_PORT cannot share it). They are checked before the model loads, and bound for real after:
a port in use ends start-up with one error line naming the port and its variable, exit code 1,
after stopping whatever had started.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
import prometheus_client
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from transformers import PreTrainedTokenizerBase

from engine.builder import build_engine, load_tokenizer
from engine.config import EngineConfig, SpeculativeConfig
from engine.model_runner import ModelRunner
from server.cli import json_output_requested, log_level, parse_launcher, termination_log_path
from server.config import ServerConfig
from server.decode_guard import RequestDecodeGuard
from server.engine_worker import EngineWorker
from server.grpc_server import GenerationServicer
from server.http_server import HttpLimits, HttpServer
from server.logs import setup_logging, write_termination_log
from server.metrics import ServerMetrics
from server.model_files import model_path, resolved_max_sequence_length, with_resolved_models
from server.openai.app import build_app
from server.openai.context import ApiContext
from server.pb import generation_pb2, generation_pb2_grpc
from server.ports import add_grpc_port, bind_http, check_port_free
from server.prefix_store import PrefixStore
from server.request_runner import RequestRunner
from server.tls import server_credentials
from server.tracing import start_tracing
from server.validation import Limits

logger = logging.getLogger("specserve")

_HEALTH_PROBE_TIMEOUT_S = 60.0
GIL_SWITCH_INTERVAL_S = 0.0005
"""The server process's GIL switch interval (Python's default: 5 ms), set once by `main` before
anything starts; nothing else in the server sets it. Every torch op of an engine step releases
the GIL and takes it back; while the event loop's thread holds it, the engine thread waits up to
one interval for it, hundreds of times per step, so under load the default interval slows
decoding; `make bench-gil` measures decode with each interval beside a busy Python thread."""
GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name


_SETTLE_TIMEOUT_S = 2.0


async def _settle(timeout: float) -> None:
    """Let the loop's other tasks finish, up to `timeout` s. grpc's stop returns once it has
    cancelled the calls still running after the grace period, but their tasks end a few loop
    turns later; asyncio.run would cancel them instead, and grpc logs a CancelledError
    traceback for each."""
    current = asyncio.current_task()
    others = [t for t in asyncio.all_tasks() if t is not current]
    if others:
        await asyncio.wait(others, timeout=timeout)


def engine_config(config: ServerConfig, max_sequence_length: int) -> EngineConfig:
    """The engine's share of the server's configuration."""
    speculative = None
    if config.speculator_path is not None:
        speculative = SpeculativeConfig(
            path=Path(config.speculator_path),
            n_predict=config.speculator_n_predict,
            top_k_tokens_per_head=config.speculator_top_k_tokens_per_head,
            n_candidates=config.speculator_n_candidates,
            candidate_selection=config.speculator_candidate_selection,
            max_batch_size=config.speculator_max_batch_size,
            adaptive=config.speculator_adaptive,
        )
    return EngineConfig(
        model_path=model_path(config),
        dtype=config.dtype,
        quantization=config.quantize,
        device=config.device,
        max_num_seqs=config.max_batch_size,
        max_num_batched_tokens=config.max_batched_tokens,
        max_model_len=max_sequence_length,
        num_kv_blocks=config.kv_cache_blocks,
        kv_cache_memory_mb=config.kv_cache_memory_mb,
        memory_fraction=config.cuda_process_memory_fraction,
        flash_attention=config.flash_attention,
        cuda_graphs=not config.no_cuda_graphs,
        kernel_plan=config.kernel_plan,
        enable_prefix_caching=config.prefix_caching,
        speculative=speculative,
        tensor_parallel_size=config.num_shard,
        master_addr=config.master_addr,
        master_port=config.master_port,
        shard_timeout_s=config.shard_timeout_s,
    )


def resolve_models(config: ServerConfig) -> ServerConfig:
    """`config` with its model (and speculator) names resolved to local paths, once, logged:
    a path, a prepared model, or a Hub id at REVISION in the local HF cache (never
    downloaded). ModelNotFoundError (an OSError) names every place looked at."""
    resolved = with_resolved_models(config)
    if resolved.model_name != config.model_name:
        logger.info("model %s: %s", config.model_name, resolved.model_name)
    if resolved.speculator_path != config.speculator_path:
        logger.info("speculator %s: %s", config.speculator_path, resolved.speculator_path)
    return resolved


def prefix_store(
    config: ServerConfig, runner: ModelRunner, metrics: ServerMetrics, max_seq_len: int
) -> PrefixStore | None:
    """The prompt store of PREFIX_STORE_PATH (None when unset), for the runner's model:
    prefixes of up to half of `max_seq_len` virtual tokens (TGIS's MAX_PROMPT_PREFIX_LENGTH
    default), counted in `metrics`."""
    if config.prefix_store_path is None:
        return None
    logger.info(
        "prompt prefixes from %s (cache of %d MiB)",
        config.prefix_store_path,
        config.prompt_cache_size_mb,
    )
    return PrefixStore(
        config.prefix_store_path,
        runner.config.hidden_size,
        runner.dtype,
        runner.device,
        max(1, max_seq_len // 2),
        config.prompt_cache_size_mb,
        on_load=metrics.prompt_load_duration.observe,
        on_failure=metrics.prompt_load_failure.inc,
    )


async def serve(config: ServerConfig) -> None:
    """Run the server until SIGTERM or SIGINT."""
    model_id = config.model_name
    config = resolve_models(config)
    credentials = server_credentials(config)
    check_port_free(config.grpc_port, "gRPC", "GRPC_PORT")
    check_port_free(config.port, "HTTP", "PORT")
    max_seq_len = resolved_max_sequence_length(config)
    tokenizer = load_tokenizer(model_path(config))
    engine = build_engine(engine_config(config, max_seq_len), tokenizer)
    if engine.max_model_len < max_seq_len:
        logger.warning(
            "max_sequence_length %d lowered to %d, the engine's limit for this model",
            max_seq_len,
            engine.max_model_len,
        )
        max_seq_len = engine.max_model_len
    max_new_tokens = config.effective_max_new_tokens(max_seq_len)
    if max_new_tokens < config.max_new_tokens:
        logger.warning(
            "max_new_tokens %d lowered to %d (max_sequence_length - 1)",
            config.max_new_tokens,
            max_new_tokens,
        )
    backend = engine.runner.backend
    logger.info(
        "attention: %s on a paged KV cache of %d-token blocks (always paged; FLASH_ATTENTION=%s, "
        "PAGED_ATTENTION=%s)",
        backend.name,
        backend.block_size,
        str(config.flash_attention).lower(),
        str(config.paged_attention).lower(),
    )
    if config.flash_attention and backend.name != "flash-attn":
        logger.warning(
            "FLASH_ATTENTION=true but flash-attn is not usable on device %s: using %s",
            config.device,
            backend.name,
        )
    num_blocks = engine.num_kv_blocks
    metrics = ServerMetrics(max_seq_len, max_new_tokens, config.max_batch_size)
    metrics.kv_cache_blocks_total.set(num_blocks)
    metrics.kv_cache_blocks_used.set(0)
    stop = _Stop(asyncio.get_running_loop())
    engine.runner.watch(stop.fail)
    worker = EngineWorker(engine, metrics)
    worker.start()
    try:
        await _serve_with(
            config, model_id, worker, tokenizer, metrics, credentials, max_seq_len, stop
        )
    finally:
        worker.stop(timeout=10.0)
        engine.close()


class _Stop:
    """When to stop serving: a signal (`set`), or a failure the server cannot serve through
    (`fail`, from any thread: a tensor-parallel rank died), which makes `serve` raise."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()
        self.failure: str | None = None

    def set(self) -> None:
        self.event.set()

    def fail(self, message: str) -> None:
        def record() -> None:
            self.failure = self.failure or message
            self.event.set()

        self.loop.call_soon_threadsafe(record)

    def check(self) -> None:
        """RuntimeError with the failure's message, if there was one."""
        if self.failure is not None:
            raise RuntimeError(self.failure)


async def _serve_with(
    config: ServerConfig,
    model_id: str,
    worker: EngineWorker,
    tokenizer: PreTrainedTokenizerBase,
    metrics: ServerMetrics,
    credentials: grpc.ServerCredentials | None,
    max_seq_len: int,
    stop: _Stop,
) -> None:
    """`serve` once the engine thread runs: probe it, bind both ports, serve until a signal
    (draining requests) or a failure (at once, raising RuntimeError), and stop what started (in
    reverse order) however this ends. The HTTP API serves the model as `model_id`."""
    probe_prompt = list(tokenizer("liveness")["input_ids"]) or [0]
    loop = asyncio.get_running_loop()
    if not await loop.run_in_executor(None, worker.probe, probe_prompt, _HEALTH_PROBE_TIMEOUT_S):
        await asyncio.sleep(0)  # a failure reported meanwhile explains the probe's
        stop.check()
        raise RuntimeError("the model did not answer the startup probe")

    def health() -> bool:
        return worker.healthy or worker.probe(probe_prompt, _HEALTH_PROBE_TIMEOUT_S)

    tracer = None
    if config.otlp_endpoint:
        tracer = start_tracing(config.otlp_endpoint, config.otlp_service_name)
        logger.info("tracing: OTLP spans to %s", config.otlp_endpoint)
    runner = RequestRunner(
        worker,
        tokenizer,
        Limits(max_seq_len, config.effective_max_new_tokens(max_seq_len)),
        metrics,
        config.max_concurrent_requests,
        default_include_stop_seqs=config.default_include_stop_seqs,
        output_special_tokens=config.output_special_tokens,
        tracer=tracer,
        prefixes=prefix_store(config, worker.engine.runner, metrics, max_seq_len),
    )
    servicer = GenerationServicer(runner, config.max_response_bytes)
    api = ApiContext(runner, model_id, int(worker.engine.runner.config.vocab_size))
    app = build_app(health, metrics, api, config.http_max_body_bytes)
    http_limits = HttpLimits(
        config.http_header_timeout_s, config.http_body_timeout_s, config.http_max_connections
    )
    server = grpc.aio.server(
        interceptors=[RequestDecodeGuard()], options=[("grpc.so_reuseport", 0)]
    )
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in ("", GENERATION_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (GENERATION_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), server
    )
    http: HttpServer | None = None
    started = False
    try:
        grpc_port = add_grpc_port(server, config.grpc_port, credentials)
        http = bind_http(config.port, app, http_limits)
        if credentials is not None:
            logger.info(
                "gRPC TLS enabled%s",
                ": client certificates required (mTLS)" if config.tls_client_ca_cert_path else "",
            )
            logger.info("HTTP on PORT (/health, /metrics, /v1) stays plaintext")
        await server.start()
        started = True
        logger.info("gRPC server started on port %d", grpc_port)
        await http.start()
        logger.info("HTTP server started on port %d", http.port)

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.event.wait()
        stop.check()
        logger.info("shutting down: up to %.1f s for in-flight requests", config.shutdown_grace_s)
        await health_servicer.enter_graceful_shutdown()
        grace = config.shutdown_grace_s
        await asyncio.gather(server.stop(grace), http.stop(grace))
        await _settle(_SETTLE_TIMEOUT_S)
    finally:
        if started:
            await server.stop(None)  # at once; a no-op after the graceful stop
        if http is not None:
            await http.stop()
        servicer.close()
        if tracer is not None:
            tracer.shutdown()
    logger.info("shutdown complete")


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the process exit code: 2 for an invalid configuration, 1
    for any other fatal error. Either's message also goes to the termination log
    (`server.cli.termination_log_path`), as TGIS's launcher writes its panics there."""
    setup_logging(log_level(), json_output_requested(argv))
    prometheus_client.disable_created_metrics()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    termination_log, create_log = termination_log_path()
    try:
        launch = parse_launcher(argv)
    except ValueError as e:
        message = f"invalid configuration: {e}"
        logger.error("%s", message)
        write_termination_log(message, termination_log, create_log)
        return 2
    config = launch.config
    logger.info("configuration: %s", config.describe())
    for warning in launch.warnings:
        logger.warning("%s", warning)
    try:
        asyncio.run(serve(config))
    except (ValueError, RuntimeError, OSError) as e:
        logger.error("%s", e)
        write_termination_log(str(e), termination_log, create_log)
        return 1
    except Exception as e:
        logger.exception("fatal error")
        write_termination_log(f"{type(e).__name__}: {e}", termination_log, create_log)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
