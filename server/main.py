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
from pathlib import Path

import grpc
import prometheus_client
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from engine.builder import build_engine, load_tokenizer
from engine.config import EngineConfig, SpeculativeConfig
from server.config import ServerConfig
from server.engine_worker import EngineWorker
from server.grpc_server import GenerationServicer
from server.http_server import HttpServer
from server.metrics import ServerMetrics
from server.pb import generation_pb2, generation_pb2_grpc
from server.tls import server_credentials
from server.validation import Limits

logger = logging.getLogger("specserve")

_HEALTH_PROBE_TIMEOUT_S = 60.0
GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name


def engine_config(config: ServerConfig, max_sequence_length: int) -> EngineConfig:
    """The engine's share of the server's configuration."""
    speculative = None
    if config.speculator_path is not None:
        speculative = SpeculativeConfig(
            path=Path(config.speculator_path),
            n_predict=config.speculator_n_predict,
            top_k_tokens_per_head=config.speculator_top_k(),
            n_candidates=config.speculator_n_candidates,
            candidate_selection=config.speculator_candidate_selection,
            max_batch_size=config.speculator_max_batch_size,
            adaptive=config.speculator_adaptive,
        )
    return EngineConfig(
        model_path=config.model_path,
        dtype=config.dtype,
        device=config.device,
        max_num_seqs=config.max_batch_size,
        max_num_batched_tokens=config.max_batched_tokens,
        max_model_len=max_sequence_length,
        num_kv_blocks=config.kv_cache_blocks,
        kv_cache_memory_mb=config.kv_cache_memory_mb,
        enable_prefix_caching=config.prefix_caching,
        speculative=speculative,
    )


async def serve(config: ServerConfig) -> None:
    """Run the server until SIGTERM or SIGINT."""
    credentials = server_credentials(config)
    max_seq_len = config.resolved_max_sequence_length()
    max_new_tokens = config.effective_max_new_tokens(max_seq_len)
    if max_new_tokens < config.max_new_tokens:
        logger.warning(
            "max_new_tokens %d lowered to %d (max_sequence_length - 1)",
            config.max_new_tokens,
            max_new_tokens,
        )
    tokenizer = load_tokenizer(config.model_path)
    engine = build_engine(engine_config(config, max_seq_len), tokenizer)
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
    num_blocks = engine.kv.num_blocks
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
