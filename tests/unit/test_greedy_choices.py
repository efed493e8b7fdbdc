"""The sampler's plain-greedy fast path against its general path: the same tokens and errors."""

from __future__ import annotations

import torch

from engine.sampling.logits_processor import process_eos
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import greedy_choices, is_plain_greedy, sample_with_details


def test_plain_greedy_params() -> None:
    assert is_plain_greedy(SamplingParams(max_new_tokens=4, min_new_tokens=2))
    assert not is_plain_greedy(SamplingParams(max_new_tokens=4, temperature=0.7))
    assert not is_plain_greedy(SamplingParams(max_new_tokens=4, repetition_penalty=1.2))
    assert not is_plain_greedy(SamplingParams(max_new_tokens=4, logprobs=True))
    assert not is_plain_greedy(SamplingParams(max_new_tokens=4, length_penalty=(2, 1.1)))


def test_same_tokens_and_errors_as_the_general_path() -> None:
    g = torch.Generator().manual_seed(0)
    vocab, eos = 300, frozenset({2, 7})
    logits = torch.randn(10, vocab, generator=g)  # [M, vocab]
    logits[0, 2] = logits[0].max()  # a masked EOS ties the maximum at a lower id
    logits[1, 7] = 50.0  # EOS would win, but is masked in this row
    logits[2, 7] = 50.0  # EOS wins: not masked here
    logits[3, 11] = float("nan")
    logits[4, 5] = float("inf")
    logits[5, 7] = float("inf")  # +inf on a masked EOS id: masked first, so no error
    logits[6, 40] = logits[6, 20] = logits[6].max() + 1  # a tie: the lower id
    logits[7] = float("-inf")
    logits[8, 2] = float("nan")  # NaN on a masked EOS id: masked first, so no error
    logits[9, 7] = float("nan")  # NaN on an EOS id that is not masked here: an error
    before = logits.clone()
    generated = [0, 1, 5, 0, 0, 1, 0, 0, 2, 4]  # tokens the row's request generated before it
    params = [SamplingParams(max_new_tokens=10, min_new_tokens=3)] * len(generated)
    masked = [eos if n < 3 else frozenset() for n in generated]
    fast = greedy_choices(logits, masked)
    assert torch.equal(logits.nan_to_num(), before.nan_to_num())  # not modified
    processed = process_eos(logits, params, generated, [eos] * len(generated))
    n = len(generated)
    ref = sample_with_details(processed, params, [None] * n, [0] * n, [()] * n)
    assert fast.token_ids == ref.token_ids
    assert fast.errors == ref.errors
    assert fast.details == ref.details == [None] * n
    assert fast.token_ids[1] not in eos and fast.token_ids[2] == 7 and fast.token_ids[6] == 20
    assert fast.token_ids[0] != 2 and fast.token_ids[8] not in eos
    assert fast.errors[3] and fast.errors[4] and fast.errors[5] is None
    assert fast.errors[8] is None and fast.errors[9]
