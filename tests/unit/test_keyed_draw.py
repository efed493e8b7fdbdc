"""Keyed draws (`engine.sampling.keyed_draw`): a function of (seed, position) alone, and
distributed as softmax(scores) (Pearson's chi-square against the exact probabilities)."""

from __future__ import annotations

import torch

from engine.sampling.keyed_draw import keyed_sample, keyed_uniform, row_keys

CHI2_DF7_P01 = 18.475  # chi-square critical value, 7 degrees of freedom, p = 0.01
NUM_DRAWS = 20_000


def chi_square(token_ids: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(token_ids, minlength=probs.numel()).double()
    expected = probs.double() * token_ids.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_draws_follow_the_softmax() -> None:
    scores = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    rows = scores.expand(NUM_DRAWS, -1)
    drawn = keyed_sample(rows, list(range(NUM_DRAWS)), [17] * NUM_DRAWS)
    assert chi_square(drawn, scores.softmax(-1)) < CHI2_DF7_P01
    by_position = keyed_sample(rows, [5] * NUM_DRAWS, list(range(NUM_DRAWS)))
    assert chi_square(by_position, scores.softmax(-1)) < CHI2_DF7_P01


def test_the_test_detects_a_biased_sampler() -> None:
    """Uniform noise in place of Gumbel noise: the chi-square test rejects it."""
    scores = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    keys = row_keys(list(range(NUM_DRAWS)), [17] * NUM_DRAWS, torch.device("cpu"))
    drawn = (scores + keyed_uniform(keys, 8)).argmax(-1)
    assert chi_square(drawn, scores.softmax(-1)) > CHI2_DF7_P01


def test_draws_depend_on_seed_and_position_only() -> None:
    """The same (seed, position) gives the same token whatever the batch; filtered tokens
    (-inf) are never drawn; 64-bit seeds differing only in their high half differ."""
    torch.manual_seed(0)
    scores = torch.randn(6, 1000)
    scores[:, ::2] = float("-inf")
    seeds = [3, 3, 2**40 + 3, 7, 2**64 - 1, 0]
    positions = [10, 11, 10, 10, 99, 0]
    batch = keyed_sample(scores, seeds, positions)
    alone = [int(keyed_sample(scores[i : i + 1], seeds[i : i + 1], positions[i : i + 1])[0])
             for i in range(6)]  # fmt: skip
    assert batch.tolist() == alone
    assert all(t % 2 == 1 for t in alone)
    keys = row_keys(seeds, positions, torch.device("cpu")).tolist()
    assert len({keys[0], keys[1], keys[2], keys[3]}) == 4


def test_cpu_hash_equals_the_int64_hash() -> None:
    """The CPU's uint32 hash gives the int64 tensor hash's uniforms (the one other devices run),
    at any ids."""
    from engine.sampling.keyed_draw import _mix, uniform_at

    seeds = [0, 1, 2**32 - 1, 2**63 + 12345, 987654321987]
    keys = row_keys(seeds, [0, 7, 2**31, 5, 99], torch.device("cpu"))
    ids = torch.randint(0, 2**20, (len(seeds), 300), generator=torch.Generator().manual_seed(1))
    bits = _mix(_mix(keys[:, None] ^ ids) ^ keys[:, None]) >> 9
    assert torch.equal(uniform_at(keys, ids), (bits.float() + 0.5) / float(1 << 23))


def test_draw_at_the_tokens_that_can_win() -> None:
    """`keyed_sample_rows` (noise only where a token can still win) draws `keyed_sample`'s
    tokens, over peaked and flat rows of a wide vocabulary and rows with filtered tokens."""
    from engine.sampling.keyed_draw import keyed_sample_rows

    g = torch.Generator().manual_seed(2)
    scores = (
        torch.randn(24, 49152, generator=g) * torch.tensor([0.1, 1.0, 4.0, 12.0]).repeat(6)[:, None]
    )
    scores[::5, 1000:] = float("-inf")
    seeds, positions = list(range(24)), [7 * i for i in range(24)]
    keys = row_keys(seeds, positions, torch.device("cpu"))
    peaked = [i for i in range(24) if i % 4 >= 2]  # noise at few tokens of each row
    for rows in (peaked, list(range(24))):
        drawn = keyed_sample_rows(scores[rows], keys[rows])
        assert (
            drawn.tolist()
            == keyed_sample(
                scores[rows], [seeds[i] for i in rows], [positions[i] for i in rows]
            ).tolist()
        )
        assert len(set(drawn.tolist())) > len(rows) * 3 // 4
