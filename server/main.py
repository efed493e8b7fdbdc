"""`specserve` / `text-generation-launcher`: configuration -> engine thread -> gRPC + HTTP.

Startup order (TGIS's): load the model, check it answers (a one-token generation), start gRPC
and log ``gRPC server started on port N``, then HTTP and ``HTTP server started on port M``.
SIGTERM/SIGINT: stop accepting RPCs, give in-flight ones `shutdown_grace_s` to finish, cancel
the rest, stop the engine and exit 0.
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
from transformers import AutoTokenizer

from engine.config import ServerConfig
from engine.engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.scheduler import SchedulerConfig
from server.grpc_server import EngineWorker, GenerationServicer
from server.http_server import HttpServer
from server.metrics import ServerMetrics
from server.pb import generation_pb2_grpc
from server.validation import Limits

logger = logging.getLogger("specserve")

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_HEALTH_PROBE_TIMEOUT_S = 60.0


def _num_kv_blocks(config: ServerConfig, block_size: int) -> int:
    """`kv_cache_blocks`, else as many blocks as `kv_cache_memory_mb` holds."""
    if config.kv_cache_blocks is not None:
        return config.kv_cache_blocks
    from engine.models.llama import LlamaConfig

    cfg = LlamaConfig.from_folder(config.model_path)
    dtype = config.dtype or "float32"
    block_bytes = 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim
    return max(2, config.kv_cache_memory_mb * 2**20 // (block_bytes * _DTYPE_BYTES[dtype]))


async def serve(config: ServerConfig) -> None:
    """Run the server until SIGTERM or SIGINT."""
    from engine.attention import select_backend

    max_seq_len = config.resolved_max_sequence_length()
    max_new_tokens = config.effective_max_new_tokens(max_seq_len)
    if max_new_tokens < config.max_new_tokens:
        logger.warning(
            "max_new_tokens %d lowered to %d (max_sequence_length - 1)",
            config.max_new_tokens,
            max_new_tokens,
        )
    backend = select_backend(config.device)
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
    engine = LLMEngine(runner, scheduler_config, frozenset(eos_ids))
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
    grpc_port = server.add_insecure_port(f"0.0.0.0:{config.grpc_port}")
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
