"""The rules a `ServerConfig` must satisfy, each broken one a ValueError naming the field."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config import CANDIDATE_SELECTIONS, DTYPES

if TYPE_CHECKING:
    from server.config import ServerConfig


def check_config(config: ServerConfig) -> None:
    """ValueError naming the first field (or pair of fields) of `config` out of its range."""
    if not config.model_name:
        raise ValueError("model_name must not be empty")
    if config.dtype is not None and config.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {config.dtype!r}")
    if config.max_sequence_length is not None and config.max_sequence_length < 2:
        raise ValueError(f"max_sequence_length must be >= 2, got {config.max_sequence_length}")
    for name in ("max_new_tokens", "max_batch_size", "max_batched_tokens", "num_shard"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")
    if config.prompt_cache_size_mb < 0:
        raise ValueError(f"prompt_cache_size_mb must be >= 0, got {config.prompt_cache_size_mb}")
    if config.max_concurrent_requests < 1:
        raise ValueError(
            f"max_concurrent_requests must be >= 1, got {config.max_concurrent_requests}"
        )
    if config.max_batched_tokens < config.max_batch_size:
        raise ValueError(
            f"max_batched_tokens ({config.max_batched_tokens}) must be >= max_batch_size "
            f"({config.max_batch_size})"
        )
    if config.max_response_bytes < 1024:
        raise ValueError(f"max_response_bytes must be >= 1024, got {config.max_response_bytes}")
    if config.kv_cache_blocks is not None and config.kv_cache_blocks < 2:
        raise ValueError(f"kv_cache_blocks must be >= 2, got {config.kv_cache_blocks}")
    if config.kv_cache_memory_mb is not None and config.kv_cache_memory_mb < 1:
        raise ValueError(f"kv_cache_memory_mb must be >= 1, got {config.kv_cache_memory_mb}")
    if not 0 < config.cuda_process_memory_fraction <= 1:
        raise ValueError(
            "cuda_process_memory_fraction must be in (0, 1], got "
            f"{config.cuda_process_memory_fraction}"
        )
    for name in ("grpc_port", "port"):
        if not 0 <= getattr(config, name) <= 65535:
            raise ValueError(f"{name} must be in [0, 65535], got {getattr(config, name)}")
    if config.shard_timeout_s <= 0:
        raise ValueError(f"shard_timeout_s must be > 0, got {config.shard_timeout_s}")
    if config.shutdown_grace_s < 0:
        raise ValueError(f"shutdown_grace_s must be >= 0, got {config.shutdown_grace_s}")
    for name in ("speculator_n_predict", "speculator_n_candidates"):
        if getattr(config, name) is not None and getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")
    if config.speculator_max_batch_size < 0:
        raise ValueError(
            f"speculator_max_batch_size must be >= 0, got {config.speculator_max_batch_size}"
        )
    parse_top_k(config.speculator_top_k_tokens_per_head)
    if config.speculator_candidate_selection not in CANDIDATE_SELECTIONS:
        raise ValueError(
            "speculator_candidate_selection must be coverage or joint, got "
            f"{config.speculator_candidate_selection!r}"
        )
    if (config.tls_cert_path is None) != (config.tls_key_path is None):
        raise ValueError("tls: must provide both cert and key")
    if config.tls_client_ca_cert_path is not None and config.tls_cert_path is None:
        raise ValueError("tls: cannot provide client ca cert without keypair")


def parse_top_k(raw: str | None) -> tuple[int, ...] | None:
    """A comma list of tokens per head ("5,3,2") as integers; None for None or blank;
    ValueError when it is not a list of positive integers."""
    if raw is None or not raw.strip():
        return None
    try:
        values = tuple(int(v) for v in raw.replace(" ", "").split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(
            f"speculator_top_k_tokens_per_head must be a comma list of positive integers, "
            f"got {raw!r}"
        )
    return values
