"""Sampling draws keyed by (seed, position) instead of by how many draws came before.

The token a sampled request gets at sequence position n is a function of the processed scores
at n, the request's seed and n alone: `keyed_sample` takes the argmax of scores plus Gumbel
noise, whose uniform draws are a counter-based hash of (seed, n, token id). So a token computed
at a node of a draft tree equals the token a plain step would have drawn there, and verifying
sampled requests' drafts by exact match gives exactly plain sampling's tokens (the distribution
is exact: Gumbel-max picks token i with probability softmax(scores)[i]).

The hash works on int64 tensors holding 32-bit values (products of a 32-bit value and a 31-bit
constant stay below 2**63), so it runs batched on any device with the same results.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels.selection import columns_at_least, top_candidates

_MASK32 = 0xFFFFFFFF
_MUL1 = 0x7FEB352D
_MUL2 = 0x2C1B3C6D
_GOLDEN = 0x1E3779B9


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply rounds) over values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    return x ^ (x >> 15)


def row_keys(seeds: list[int], positions: list[int], device: torch.device) -> torch.Tensor:
    """[M] int64 32-bit keys of (seed, position) pairs; seeds are unsigned 64-bit."""
    parts = [
        [s & _MASK32, (s >> 32) & _MASK32, p & _MASK32]
        for s, p in zip(seeds, positions, strict=True)
    ]
    return keys_of(torch.tensor(parts, dtype=torch.int64, device=device).reshape(-1, 3))


def key_parts(seed: int, position: int) -> tuple[int, int, int]:
    """The three 32-bit values `keys_of` reads for one (seed, position) pair."""
    return seed & _MASK32, (seed >> 32) & _MASK32, position & _MASK32


def keys_of(parts: torch.Tensor) -> torch.Tensor:
    """[M, 3] int64 `key_parts` (seed's low and high 32 bits, position) -> [M] int64 keys."""
    if parts.device.type == "cpu":  # numpy's uint32 arithmetic: the same values, fewer calls
        lo, hi, pos = parts.numpy().astype(np.uint32).T
        host = _mix32(_mix32(_mix32(lo ^ np.uint32(_GOLDEN)) ^ hi) ^ pos)
        return torch.from_numpy(host.astype(np.int64))
    lo, hi, pos = parts.unbind(1)
    key = _mix(lo ^ _GOLDEN)
    key = _mix(key ^ hi)
    return _mix(key ^ pos)


def _mix32(x: np.ndarray) -> np.ndarray:
    """`_mix` in uint32 arithmetic (wrapping products, logical shifts), in place."""
    for shift, mul in ((16, _MUL1), (15, _MUL2), (16, _MUL1)):
        x ^= x >> np.uint32(shift)
        x *= np.uint32(mul)
    x ^= x >> np.uint32(15)
    return x


def uniform_at(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[M] keys, [M, C] int64 token ids -> [M, C] float32 uniforms in (0, 1): for each row, the
    uniforms `keyed_uniform` gives at those ids. On a CPU the hash runs in numpy's uint32
    arithmetic (the same values, a quarter of the bytes, on the calling thread)."""
    if keys.device.type == "cpu":
        k = keys.numpy().astype(np.uint32)[:, None]
        x = _mix32(k ^ token_ids.numpy().astype(np.uint32))
        x ^= k
        host = (_mix32(x) >> np.uint32(9)).astype(np.float32)
        return torch.from_numpy((host + np.float32(0.5)) / np.float32(1 << 23))
    bits = _mix(_mix(keys[:, None] ^ token_ids) ^ keys[:, None]) >> 9
    return (bits.float() + 0.5) / float(1 << 23)  # 23 bits: 1 - 2**-24 is a float32 below 1


def keyed_uniform(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[M] keys -> [M, vocab] float32 uniforms in (0, 1), one per (key, token id)."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    return uniform_at(keys, ids[None, :])


def keyed_gumbel(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[M] keys -> [M, vocab] float32 standard Gumbel noise, one per (key, token id)."""
    return -torch.log(-torch.log(keyed_uniform(keys, vocab_size)))


def keyed_sample(
    scores: torch.Tensor,  # [M, vocab] processed scores (-inf where filtered out)
    seeds: list[int],  # [M]
    positions: list[int],  # [M]: the sequence position of the token being drawn
) -> torch.Tensor:  # [M] int64 token ids, on the scores' device
    """One draw per row from softmax(scores), keyed by (seed, position)."""
    keys = row_keys(seeds, positions, scores.device)
    gumbel = keyed_gumbel(keys, scores.shape[-1])
    return (scores.float() + gumbel).argmax(dim=-1)


def keyed_sample_at(
    scores: torch.Tensor,  # [M, C] processed scores of C tokens per row (-inf: filtered out)
    token_ids: torch.Tensor,  # [M, C] int64: the tokens those scores are of
    keys: torch.Tensor,  # [M] `keys_of` the rows' (seed, position)
) -> torch.Tensor:  # [M] int64 indices into the C columns
    """`keyed_sample` where every token outside `token_ids` is filtered out: the same draw
    (ties in score + noise aside), with noise computed at the C tokens only."""
    gumbel = -torch.log(-torch.log(uniform_at(keys, token_ids)))
    return (scores.float() + gumbel).argmax(dim=-1)


GUMBEL_MAX = 17.0
"""Above the largest noise `uniform_at` can give: -log(-log(1 - 2**-24)) = 16.64."""


LEADERS = 32
"""Tokens of a row whose noise `keyed_sample_rows` computes first, to bound what can win."""


def keyed_sample_rows(
    scores: torch.Tensor,  # [M, vocab] processed scores, every token a candidate
    keys: torch.Tensor,  # [M] `keys_of` the rows' (seed, position)
) -> torch.Tensor:  # [M] int64 token ids
    """`keyed_sample` with `keys`. On a CPU the noise is computed only at the tokens that can
    win: a token scoring s can reach at most s + `GUMBEL_MAX`, and the winner reaches at least
    the largest score plus noise among the row's `LEADERS` best tokens."""
    every = torch.arange(scores.shape[-1], device=scores.device).expand_as(scores)
    if scores.device.type != "cpu":
        return keyed_sample_at(scores, every, keys)
    leaders = min(LEADERS, scores.shape[-1])
    values, ids = top_candidates(scores, leaders) or scores.topk(leaders, -1)
    noise = -torch.log(-torch.log(uniform_at(keys, ids)))
    reached = (values + noise).amax(-1, keepdim=True)  # [M, 1]: no winner stays below it
    # below reached - 16.64 no token can win; the float32 threshold is within 0.125 of
    # reached - 17 where |reached| < 2**20, else -inf (every token)
    threshold = (reached[:, 0].double() - GUMBEL_MAX).float()
    threshold = torch.where(threshold.abs() < 2.0**20, threshold, -torch.inf)
    # flat rows, where more than a quarter of the tokens can win: the whole rows cost less
    found = columns_at_least(scores, threshold, scores.numel() // 4)
    if found is None:
        return keyed_sample_at(scores, every, keys)
    rows, cols = found  # row-major order
    noise = -torch.log(-torch.log(uniform_at(keys[rows], cols[:, None])))[:, 0]
    values = scores[rows, cols] + noise  # [N]
    most = torch.full_like(scores[:, 0], -torch.inf).scatter_reduce_(0, rows, values, "amax")
    first = values == most[rows]  # ties: the lowest id, as `argmax` takes the first
    return torch.zeros_like(ids[:, 0]).scatter_reduce_(
        0, rows[first], cols[first], "amin", include_self=False
    )
