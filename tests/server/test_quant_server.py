"""The server's start-up path with quantized weights: a GPTQ folder served without QUANTIZE is
detected and answers Generate; a value the server does not serve, QUANTIZE=gptq on a float
checkpoint and a corrupt GPTQ tensor each end start-up (exit code 2 for the invalid setting, 1
for the checkpoints) with one error line naming what is wrong."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from safetensors.torch import load_file, save_file

from engine.paths import model_path
from server.pb import generation_pb2 as pb
from server.pb import generation_pb2_grpc
from tests.reference import require_model
from tools.gptq_writer import GptqOptions, write_gptq
from tools.server_process import ServerProcess

TINY = "tiny-llama-gqa-tied"


def _gptq(tmp_path: Path) -> Path:
    return write_gptq(require_model(model_path(TINY)), tmp_path / "gptq", GptqOptions(4, 32))


def test_gptq_folder_is_detected_and_served(tmp_path: Path) -> None:
    folder = _gptq(tmp_path)
    env = {"KV_CACHE_BLOCKS": "64", "MAX_SEQUENCE_LENGTH": "256"}
    with ServerProcess(folder, env=env, log_path=tmp_path / "server.log") as server:
        with grpc.insecure_channel(server.grpc_target) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            request = pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text="Hello")],
                params=pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=4)),
            )
            (response,) = stub.Generate(request, timeout=120).responses
        log = server.log_text()
    assert response.generated_token_count == 4
    assert "quantization gptq 4-bit group 32 sym (gptq)" in log


def _float(tmp_path: Path) -> Path:
    folder = tmp_path / "float"
    shutil.copytree(require_model(model_path(TINY)), folder)
    return folder


def _corrupt(tmp_path: Path) -> Path:
    folder = _gptq(tmp_path)
    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    name = "model.layers.0.self_attn.q_proj.qweight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})
    return folder


CASES: dict[str, tuple[Callable[[Path], Path], dict[str, str], int, str]] = {
    # case: (checkpoint, env, exit code: 2 for an invalid configuration, the error's words)
    "bitsandbytes": (
        _float, {"QUANTIZE": "bitsandbytes"}, 2,
        "invalid configuration: quantize must be one of gptq, int8, got 'bitsandbytes'",
    ),
    "gptq-on-float": (
        _float, {"QUANTIZE": "gptq"}, 1, "QUANTIZE=gptq does not match the checkpoint"
    ),
    "corrupt-qweight": (
        _corrupt, {}, 1, "tensor 'model.layers.0.self_attn.q_proj.qweight' has shape"
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_bad_quantization_stops_start_up(case: str, tmp_path: Path) -> None:
    make, env, code, message = CASES[case]
    server = ServerProcess(make(tmp_path), env=env, log_path=tmp_path / "server.log")
    assert server.run_to_exit() == code, server.log_tail()
    assert message in server.log_text(), server.log_tail()
