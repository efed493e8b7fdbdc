"""The offline API takes any of SamplingParams' fields, as a whole `params` or by keyword."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine import LLM
from engine.paths import model_path
from engine.sampling.params import SamplingParams
from tests.reference import chat_prompt_ids, require_model

MODEL = "tiny-llama-gqa-tied"


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(require_model(model_path(MODEL)), dtype="float32", max_num_tokens=2048) as llm:
        yield llm


def test_generate_takes_every_sampling_field(llm: LLM) -> None:
    path = model_path(MODEL)
    prompt = list(chat_prompt_ids(path)[0])
    greedy = llm.generate([prompt], 12)[0].token_ids  # greedy: test_llama checks it
    k = next(k for k in range(2, 12) if greedy[k] not in greedy[:k])
    stop = (greedy[k],)
    by_keyword = llm.generate([prompt], 12, stop_token_ids=stop)[0]
    assert by_keyword.token_ids == greedy[: k + 1] and by_keyword.finish_reason == "EOS_TOKEN"
    params = SamplingParams(max_new_tokens=12, stop_token_ids=stop)
    assert llm.generate([prompt], params=params)[0].token_ids == greedy[: k + 1]
    later = llm.generate([prompt], params=params, min_new_tokens=k + 2)[0].token_ids
    assert later[: k + 2] == greedy[: k + 2]  # the stop token does not stop before k + 2
    assert len(llm.generate([prompt], 3, params=params)[0].token_ids) == min(3, k + 1)
    with pytest.raises(TypeError):
        llm.generate([prompt], bogus=1)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate([prompt], temperature=0.5, top_p=0.0)
