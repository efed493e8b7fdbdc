from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.paths import default_model_path, model_path
from tools.prepare_models import TINY_MODELS

torch.manual_seed(0)


def _require(path: Path) -> Path:
    if not (path / "config.json").is_file():
        pytest.fail(f"{path} is missing: run `make models` first")
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _require(default_model_path())


@pytest.fixture(scope="session", params=TINY_MODELS)
def tiny_path(request: pytest.FixtureRequest) -> Path:
    return _require(model_path(request.param))
