"""`specserve` / `text-generation-launcher`: configuration -> engine thread -> gRPC + HTTP.

Startup order (TGIS's): load the model, check it answers (a one-token generation), start gRPC
and log ``gRPC server started on port N``, then HTTP and ``HTTP server started on port M``.
The gRPC port serves TLS (or mTLS) when configured, the standard `grpc.health.v1.Health`
service (SERVING once the model answered, NOT_SERVING from the start of a shutdown) and server
reflection. SIGTERM/SIGINT: stop accepting RPCs, give in-flight ones `shutdown_grace_s` to finish,
cancel the rest, stop the engine and exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

import grpc
import prometheus_client
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from transformers import AutoTokenizer

from engine.core import LLMEngine
from engine.model_runner import ModelRunner
from engine.scheduler import SchedulerConfig
from engine.spec_decode.policy import SpeculationPolicy
from engine.spec_decode.proposer import MLPProposer
from server.config import ServerConfig
from server.engine_worker import EngineWorker
from server.grpc_server import GenerationServicer
from server.http_server import HttpServer
from server.metrics import ServerMetrics
from server.pb import generation_pb2, generation_pb2_grpc
from server.tls import server_credentials
from server.validation import Limits

logger = logging.getLogger("specserve")

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_HEALTH_PROBE_TIMEOUT_S = 60.0
GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name


def _num_kv_blocks(config: ServerConfig, block_size: int) -> int:
    """`kv_cache_blocks`, else as many blocks as `kv_cache_memory_mb` holds."""
    if config.kv_cache_blocks is not None:
        return config.kv_cache_blocks
    from engine.models.llama import LlamaConfig

    cfg = LlamaConfig.from_folder(config.model_path)
    dtype = config.dtype or "float32"
    block_bytes = 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim
    return max(2, config.kv_cache_memory_mb * 2**20 // (block_bytes * _DTYPE_BYTES[dtype]))


def _load_proposer(config: ServerConfig, runner: ModelRunner) -> MLPProposer | None:
    """The speculator at SPECULATOR_PATH as a proposer with the configured tree, or None."""
    if config.speculator_path is None:
        return None
    from engine.spec_decode.loader import load_speculator

    speculator = load_speculator(
        config.speculator_path,
        hidden_size=runner.config.hidden_size,
        vocab_size=runner.config.vocab_size,
        dtype=runner.dtype,
        device=runner.device,
        n_predict=config.speculator_n_predict,
    )
    proposer = MLPProposer(
        speculator,
        config.speculator_top_k(),
        config.speculator_n_candidates,
        config.speculator_candidate_selection,
    )
    logger.info(
        "speculator %s: %d heads drafting from %d tokens, top-k per head %s, %d candidates by "
        "%s, up to batch size %d",
        config.speculator_path,
        speculator.config.n_predict,
        speculator.num_draft_tokens,
        list(proposer.top_k_tokens_per_head),
        proposer.n_candidates,
        proposer.selection,
        config.speculator_max_batch_size,
    )
    return proposer


async def serve(config: ServerConfig) -> None:
    """Run the server until SIGTERM or SIGINT."""
    from engine.attention import select_backend
    from engine.kernels.cpu import load_cpu_kernels

    credentials = server_credentials(config)
    max_seq_len = config.resolved_max_sequence_length()
    max_new_tokens = config.effective_max_new_tokens(max_seq_len)
    if max_new_tokens < config.max_new_tokens:
        logger.warning(
            "max_new_tokens %d lowered to %d (max_sequence_length - 1)",
            config.max_new_tokens,
            max_new_tokens,
        )
    cpu_fp32 = config.device == "cpu" and (config.dtype or "float32") == "float32"
    backend = select_backend(config.device, kernels=load_cpu_kernels() if cpu_fp32 else None)
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
    num_blocks = _num_kv_blocks(config, backend.block_size)
    if num_blocks * backend.block_size < max_seq_len:
        raise ValueError(
            f"the KV cache ({num_blocks} blocks of {backend.block_size} tokens) cannot hold one "
            f"request of max_sequence_length {max_seq_len}: raise kv_cache_blocks or "
            "kv_cache_memory_mb, or lower max_sequence_length"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(config.model_path))
    runner = ModelRunner(
        config.model_path,
        num_blocks=num_blocks,
        dtype=config.dtype,
        device=config.device,
        backend=backend,
    )
    eos_ids = set(runner.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    scheduler_config = SchedulerConfig(
        max_num_seqs=config.max_batch_size,
        max_num_batched_tokens=config.max_batched_tokens,
        max_model_len=max_seq_len,
    )
    proposer = _load_proposer(config, runner)
    policy = None
    if proposer is not None and config.speculator_adaptive:
        policy = SpeculationPolicy(proposer.num_candidates)
    engine = LLMEngine(
        runner,
        scheduler_config,
        frozenset(eos_ids),
        proposer,
        config.speculator_max_batch_size,
        policy,
        config.prefix_caching,
    )
    metrics = ServerMetrics(max_seq_len, max_new_tokens, config.max_batch_size)
    metrics.kv_cache_blocks_total.set(num_blocks)
    metrics.kv_cache_blocks_used.set(0)
    worker = EngineWorker(engine, metrics)
    worker.start()
    probe_prompt = list(tokenizer("liveness")["input_ids"]) or [0]
    loop = asyncio.get_running_loop()
    if not await loop.run_in_executor(None, worker.probe, probe_prompt, _HEALTH_PROBE_TIMEOUT_S):
        raise RuntimeError("the model did not answer the startup probe")

    def health() -> bool:
        return worker.healthy or worker.probe(probe_prompt, _HEALTH_PROBE_TIMEOUT_S)

    servicer = GenerationServicer(
        worker,
        tokenizer,
        Limits(max_seq_len, max_new_tokens),
        metrics,
        config.max_concurrent_requests,
        default_include_stop_seqs=config.default_include_stop_seqs,
        output_special_tokens=config.output_special_tokens,
    )
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in ("", GENERATION_SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (GENERATION_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), server
    )
    address = f"0.0.0.0:{config.grpc_port}"
    if credentials is None:
        grpc_port = server.add_insecure_port(address)
    else:
        grpc_port = server.add_secure_port(address, credentials)
        logger.info(
            "gRPC TLS enabled%s",
            ": client certificates required (mTLS)" if config.tls_client_ca_cert_path else "",
        )
    await server.start()
    logger.info("gRPC server started on port %d", grpc_port)
    http = HttpServer("0.0.0.0", config.port, health, metrics)
    http.start()
    logger.info("HTTP server started on port %d", http.port)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("shutting down: up to %.1f s for in-flight requests", config.shutdown_grace_s)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(config.shutdown_grace_s)
    http.stop()
    worker.stop(timeout=10.0)
    logger.info("shutdown complete")


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the process exit code."""
    logging.basicConfig(
        level=os.environ.get("LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    prometheus_client.disable_created_metrics()
    try:
        config = ServerConfig.from_env_and_args(argv)
    except ValueError as e:
        logger.error("invalid configuration: %s", e)
        return 2
    logger.info("configuration: %s", config.describe())
    try:
        asyncio.run(serve(config))
    except (ValueError, RuntimeError, OSError) as e:
        logger.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
