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
    with pytest.raises(ValueError, match="speculator_candidate_selection"):
        ServerConfig.from_env_and_args([], {"SPECULATOR_CANDIDATE_SELECTION": "best"})
    selection = ServerConfig.from_env_and_args([], {"SPECULATOR_CANDIDATE_SELECTION": "joint"})
    assert selection.speculator_candidate_selection == "joint"
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
