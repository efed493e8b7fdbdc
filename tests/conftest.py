from __future__ import annotations

import os

# Triton reads TRITON_INTERPRET when it is first imported, which happens here already
# (transformers imports torch._dynamo, which imports triton): without a GPU its kernels run on
# CPU tensors in the interpreter. Set TRITON_INTERPRET=0 to run them compiled on CUDA.
os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest
import torch

from engine.paths import default_model_path, model_path
from tests.reference import require_model
from tools.prepare_models import TINY_MODELS

torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return require_model(default_model_path())


@pytest.fixture(scope="session", params=TINY_MODELS)
def tiny_path(request: pytest.FixtureRequest) -> Path:
    return require_model(model_path(request.param))
