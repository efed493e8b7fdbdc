"""The server's incremental detokenizer on the tiny test model's tokenizer (no server process)."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from engine.paths import model_path
from server.output_tracker import IncrementalDetokenizer

MODEL = "tiny-llama-gqa-tied"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(model_path(MODEL)))


def test_incremental_detokenizer_is_utf8_safe(tokenizer: Any) -> None:
    text = " naïve café 😀🎉 日本語 done"
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, tokenizer("Say:")["input_ids"], True)
    deltas = [detok.add(t) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)
