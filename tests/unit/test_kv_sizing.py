"""KV pool sizing: explicit sizes win; on CUDA the pool gets the memory fraction of
the device minus the profiled peak. Device memory is injected (figures of 80 GB and 141 GB
devices); the model is Llama-2-13B's config, as `docker run` with the model card would load."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from engine.config import DEFAULT_MEMORY_FRACTION, EngineConfig
from engine.kv_sizing import (
    CPU_KV_CACHE_MEMORY_MB,
    DeviceMemory,
    check_pool,
    kv_block_bytes,
    kv_pool_blocks,
)
from engine.model_runner import resolve_dtype
from engine.models.llama import LlamaConfig
from server.config import ServerConfig
from server.main import engine_config
from server.model_files import resolved_max_sequence_length

LLAMA_2_13B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "num_key_value_heads": 40,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
GiB = 2**30
WEIGHTS = int(24.2 * GiB)  # Llama-2-13B in float16
ACTIVATIONS = 2 * GiB
"""A generous peak for a 2048-token step of the 13B model: its float32 logits for every row take
250 MiB, the MLP's three [2048, 13824] half-precision buffers 162 MiB."""
NON_TORCH = 1 * GiB  # CUDA context and library workspaces


def device(total_gb: float) -> DeviceMemory:
    return DeviceMemory(int(total_gb * 1e9), WEIGHTS + ACTIVATIONS, NON_TORCH)


def test_llama_13b_block_bytes() -> None:
    config = LlamaConfig.from_dict(LLAMA_2_13B)
    assert kv_block_bytes(config, 16, torch.float16) == 16 * 800 * 1024  # 800 KiB per token


@pytest.mark.parametrize(("total_gb", "min_tokens"), [(80, 45_000), (141, 100_000)])
def test_pool_from_device_memory(total_gb: float, min_tokens: int) -> None:
    config = LlamaConfig.from_dict(LLAMA_2_13B)
    block_bytes = kv_block_bytes(config, 16, torch.float16)
    engine = EngineConfig(Path("/models/llama-13b"), device="cuda")
    num_blocks, how = kv_pool_blocks(
        engine, block_bytes, 16, lambda: device(total_gb), on_cuda=True
    )
    budget = total_gb * 1e9 * DEFAULT_MEMORY_FRACTION - WEIGHTS - ACTIVATIONS - NON_TORCH
    assert num_blocks == int(budget // block_bytes)
    assert num_blocks * 16 >= min_tokens
    assert how.startswith(f"memory fraction {DEFAULT_MEMORY_FRACTION:g} of ")


def test_explicit_sizes_win_and_cpu_keeps_its_default() -> None:
    block_bytes = 4096

    def never() -> DeviceMemory:
        raise AssertionError("profiled although the size was given")

    def blocks(**kwargs: object) -> int:
        config = EngineConfig(Path("m"), device="cuda", **kwargs)  # type: ignore[arg-type]
        return kv_pool_blocks(config, block_bytes, 16, never, on_cuda=True)[0]

    assert blocks(num_kv_blocks=7) == 7
    assert blocks(kv_cache_tokens=33) == 4  # ceil(33 / 16) + 1
    assert blocks(kv_cache_memory_mb=1) == 2**20 // block_bytes
    cpu = kv_pool_blocks(EngineConfig(Path("m")), block_bytes, 16, never, on_cuda=False)
    assert cpu == (CPU_KV_CACHE_MEMORY_MB * 2**20 // block_bytes, "kv_cache_memory_mb 512")


def test_too_little_memory_names_numbers_and_variables() -> None:
    with pytest.raises(ValueError) as info:
        check_pool(200, 16, 4096, "memory fraction 0.9 of 40.0 GiB")
    message = str(info.value)
    assert "200 blocks of 16 tokens = 3200 tokens" in message
    assert "max_sequence_length 4096" in message
    for name in ("kv_cache_blocks", "kv_cache_memory_mb", "CUDA_PROCESS_MEMORY_FRACTION"):
        assert name in message


def test_model_card_command_passes_start_up_checks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The model card's `docker run ... -e MODEL_NAME=... -e FLASH_ATTENTION=true
    -e PAGED_ATTENTION=true -e DTYPE_STR=float16 IMAGE` (the image sets DEVICE=cuda) on an
    H200 (141 GB): the switches are accepted, and the server's settings become an engine
    config whose dtype, block size and pool hold 4096-token requests; the start-up lines are
    logged."""
    folder = tmp_path / "llama-13b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_2_13B))
    env = {"MODEL_NAME": str(folder), "FLASH_ATTENTION": "true", "PAGED_ATTENTION": "true"}
    server = ServerConfig.from_env_and_args(
        ["-c", "0.9"], {**env, "DTYPE_STR": "float16", "DEVICE": "cuda"}
    )
    assert server.flash_attention and server.paged_attention
    max_seq_len = resolved_max_sequence_length(server)
    config = engine_config(server, max_seq_len)
    assert config.flash_attention  # flash-attn where usable, else the Triton kernel
    model = LlamaConfig.from_folder(folder)
    dtype = resolve_dtype(config.dtype, model.torch_dtype, config.device)
    block_bytes = kv_block_bytes(model, 16, dtype)
    with caplog.at_level(logging.INFO):
        num_blocks, how = kv_pool_blocks(config, block_bytes, 16, lambda: device(141), True)
        logging.getLogger("test").info(check_pool(num_blocks, 16, max_seq_len, how))
    line = caplog.records[-1].getMessage()
    print(line)
    assert (dtype, max_seq_len, config.memory_fraction) == (torch.float16, 4096, 0.9)
    assert "requests of max_sequence_length 4096" in line
    assert num_blocks * 16 // 4096 >= 24
