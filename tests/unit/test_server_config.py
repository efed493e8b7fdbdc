"""ServerConfig from environment variables and launcher flags (no server process)."""

from __future__ import annotations

import pytest

from server.config import ServerConfig


def test_server_config_env_and_flags() -> None:
    env = {"MAX_BATCH_SIZE": "4", "DTYPE_STR": "float32", "OUTPUT_SPECIAL_TOKENS": "off"}
    config = ServerConfig.from_env_and_args(["--max-batch-size", "6", "--grpc-port", "9"], env)
    assert (config.max_batch_size, config.grpc_port, config.port) == (6, 9, 3000)
    assert config.dtype == "float32" and config.output_special_tokens is False
    assert ServerConfig.from_env_and_args([], {"OUTPUT_SPECIAL_TOKENS": "1"}).output_special_tokens
    launcher = [
        "--num-shard",
        "1",
        "--dtype-str",
        "float16",
        "-p",
        "1",
        "--max-waiting-tokens",
        "9",
    ]
    config = ServerConfig.from_env_and_args(launcher, {})
    assert (config.dtype, config.port) == ("float16", 1)
    with pytest.raises(ValueError, match="max_batch_size"):
        ServerConfig.from_env_and_args([], {"MAX_BATCH_SIZE": "0"})
    with pytest.raises(ValueError, match="speculator_candidate_selection must be one of nodes, "):
        ServerConfig.from_env_and_args([], {"SPECULATOR_CANDIDATE_SELECTION": "best"})
    assert ServerConfig().speculator_candidate_selection == "nodes"
    for name in ("nodes", "coverage", "joint"):
        selection = ServerConfig.from_env_and_args([], {"SPECULATOR_CANDIDATE_SELECTION": name})
        assert selection.speculator_candidate_selection == name
    with pytest.raises(ValueError, match="dtype"):
        ServerConfig.from_env_and_args([], {"DTYPE": "float16", "DTYPE_STR": "float32"})


@pytest.mark.parametrize(
    ("value", "expected"), [("true", True), ("1", True), ("off", False), ("False", False)]
)
def test_attention_switches_parse_booleans(value: str, expected: bool) -> None:
    config = ServerConfig.from_env_and_args([], {"FLASH_ATTENTION": value})
    assert config.flash_attention is expected
    config = ServerConfig.from_env_and_args(["--paged-attention", value], {})
    assert config.paged_attention is expected
    with pytest.raises(ValueError, match="flash_attention: invalid value 'yes please'"):
        ServerConfig.from_env_and_args([], {"FLASH_ATTENTION": "yes please"})


def test_max_response_bytes() -> None:
    assert ServerConfig.from_env_and_args([], {}).max_response_bytes == 4 * 1024 * 1024 - 65536
    config = ServerConfig.from_env_and_args([], {"MAX_RESPONSE_BYTES": "1048576"})
    assert config.max_response_bytes == 1048576
    with pytest.raises(ValueError, match="max_response_bytes must be >= 1024"):
        ServerConfig.from_env_and_args(["--max-response-bytes", "100"], {})


def test_cuda_graphs_switch() -> None:
    assert ServerConfig.from_env_and_args([], {}).no_cuda_graphs is False
    assert ServerConfig.from_env_and_args(["--no-cuda-graphs"], {}).no_cuda_graphs is True
    assert ServerConfig.from_env_and_args([], {"NO_CUDA_GRAPHS": "1"}).no_cuda_graphs is True
    assert ServerConfig.from_env_and_args([], {"NO_CUDA_GRAPHS": "false"}).no_cuda_graphs is False


def test_engine_rules_name_the_server_settings() -> None:
    """The engine's rules (here its token budget and a field's bounds) refuse a server setting
    at start-up under the server's name."""
    with pytest.raises(ValueError) as info:
        ServerConfig.from_env_and_args(["--max-batch-size", "8"], {"MAX_BATCHED_TOKENS": "4"})
    assert str(info.value) == (
        "max_batched_tokens (4) must be >= max_batch_size (8) so that every running request "
        "gets a token each step"
    )
    with pytest.raises(ValueError, match=r"^kv_cache_blocks must be >= 2, got 1$"):
        ServerConfig.from_env_and_args([], {"KV_CACHE_MANAGER_NUM_GPU_BLOCKS": "1"})


def test_top_k_tokens_per_head() -> None:
    env = {"SPECULATOR_THRESHES": "5, 3,2"}
    assert ServerConfig.from_env_and_args([], env).speculator_top_k_tokens_per_head == (5, 3, 2)
    assert ServerConfig.from_env_and_args([], {}).speculator_top_k_tokens_per_head is None
    with pytest.raises(ValueError, match="invalid value '5,x' from SPECULATOR_THRESHES: expected"):
        ServerConfig.from_env_and_args([], {"SPECULATOR_THRESHES": "5,x"})
    with pytest.raises(ValueError, match=r"list of values >= 1, got \(2, 0\)$"):
        ServerConfig.from_env_and_args(["--speculator-top-k-tokens-per-head", "2,0"], {})


@pytest.mark.parametrize("name", ["CUDA_PROCESS_MEMORY_FRACTION", "SHARD_TIMEOUT_SECONDS"])
def test_nan_is_out_of_every_range(name: str) -> None:
    with pytest.raises(ValueError, match=r" must be .*, got nan$"):
        ServerConfig.from_env_and_args([], {name: "nan"})
