"""GPTQ checkpoint tensors -> `QuantizedWeight`.

A GPTQ linear layer W [out, in] is stored as four tensors (AutoGPTQ's layout, which transformers
and GPTQModel write too), with pack = 32 / bits values per int32, the lowest bits first:

    qweight  int32 [in / pack, out]      unsigned q; row r holds input rows r*pack .. r*pack+pack-1
    qzeros   int32 [groups, out / pack]  unsigned zero points, packed along the output columns
    scales   fp16  [groups, out]
    g_idx    int32 [in]                  the group of each input column

    W[o, i] = scales[g, o] * (q[i, o] - z[g, o]),  g = g_idx[i]

where z is the stored zero plus one in the "gptq" checkpoint format and the stored zero in
"gptq_v2". Act-order (desc_act) checkpoints number the groups in the order GPTQ visited the
columns, so g_idx is not sorted; sorting the columns by g_idx (`perm`) makes every group
contiguous again, which is `QuantizedWeight`'s form (`group_order`).

A fused layer (q, k, v; gate, up) concatenates its parts along the output rows: their g_idx must
be equal (GPTQ derives act-order from the layer's input, which the parts share). A rank of a
row-parallel layer holds a slice of the input columns and the groups found there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.quant.weights import QuantizedWeight, pack_int4


def unpack_columns(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, C * pack]: value j of word [r, c] is column c * pack + j."""
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((packed.unsqueeze(2) >> shifts) & mask).reshape(packed.shape[0], -1)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> int32 [R * pack, C]: value j of word [r, c] is row r * pack + j."""
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((packed.unsqueeze(1) >> shifts.view(1, -1, 1)) & mask).reshape(-1, packed.shape[1])


@dataclass
class GptqPart:
    """One checkpoint layer (or this rank's slice of it) in signed, row-major form."""

    q: torch.Tensor  # int8 [out, in]: q - 2**(bits-1)
    scales: torch.Tensor  # float32 [out, groups]
    zeros: torch.Tensor  # int8 [out, groups]: z - 2**(bits-1)
    g_idx: torch.Tensor  # int64 [in]


def read_part(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    *,
    bits: int,
    zeros_minus_one: bool,
) -> GptqPart:
    """The four tensors of one layer (shapes already checked against the model) -> `GptqPart`.
    ValueError naming the field for values out of range."""
    half = 1 << (bits - 1)
    q = (unpack_rows(qweight.to(torch.int32), bits) - half).t().to(torch.int8).contiguous()
    z = unpack_columns(qzeros.to(torch.int32), bits)[:, : scales.shape[1]]  # a last word's pad
    z = z + (1 if zeros_minus_one else 0) - half
    if int(z.min()) < -128 or int(z.max()) > 127:
        raise ValueError(
            f"qzeros: a zero point of {int(z.max()) + half} does not fit {bits} bits "
            "(is checkpoint_format right?)"
        )
    groups = scales.shape[0]
    g = g_idx.to(torch.int64)
    if g.numel() and (int(g.min()) < 0 or int(g.max()) >= groups):
        raise ValueError(f"g_idx: group indices must be in [0, {groups}), got {int(g.max())}")
    if not bool(torch.isfinite(scales).all()):
        raise ValueError("scales: not all finite")
    return GptqPart(
        q=q,
        scales=scales.to(torch.float32).t().contiguous(),
        zeros=z.to(torch.int8).t().contiguous(),
        g_idx=g,
    )


MIN_GROUP_COLUMNS = 16
"""The fewest input columns a stored group may have (see `group_order`)."""


def group_order(g_idx: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, int]:
    """For the input columns' groups `g_idx` [n] (checkpoint numbering): (perm, the checkpoint
    group of each stored group, columns per stored group). perm (None when the identity) sorts
    the columns by group. Groups of unequal sizes here (a last group cut short, as GPTQ makes
    when the group size does not divide the input; a group split between tensor-parallel
    ranks) are stored as groups of the greatest common divisor of their sizes, each repeating
    its checkpoint group's scale and zero: the same weight. ValueError when that would be fewer
    than MIN_GROUP_COLUMNS columns (act-order groups scattered over ranks)."""
    n = g_idx.numel()
    present, counts = torch.unique(g_idx, sorted=True, return_counts=True)
    size = math.gcd(*counts.tolist())
    if size < min(n, MIN_GROUP_COLUMNS):
        raise ValueError(
            f"g_idx: the {present.numel()} groups in these {n} input columns have "
            f"{int(counts.min())} to {int(counts.max())} columns each, which no group size of "
            f"{MIN_GROUP_COLUMNS} columns or more divides (an act-order checkpoint split along "
            "its input over tensor-parallel ranks scatters its groups)"
        )
    stored = present.repeat_interleave(counts // size)
    perm = torch.sort(g_idx, stable=True).indices
    if bool((perm == torch.arange(n)).all()):
        return None, stored, size
    return perm, stored, size


def assemble(parts: list[GptqPart], bits: int) -> QuantizedWeight:
    """Concatenate a layer's parts along the output rows into one `QuantizedWeight`.
    ValueError when the parts' g_idx differ or the groups are not whole (`group_order`)."""
    g_idx = parts[0].g_idx
    for k, part in enumerate(parts[1:], start=1):
        if not torch.equal(part.g_idx, g_idx):
            raise ValueError(
                f"g_idx: fused part {k} has another column order than part 0; a fused layer "
                "needs one g_idx for all its parts"
            )
    perm, stored, size = group_order(g_idx)
    q = torch.cat([p.q for p in parts])
    if perm is not None:
        q = q[:, perm]
    scales = torch.cat([p.scales[:, stored] for p in parts])
    zeros = torch.cat([p.zeros[:, stored] for p in parts])
    return QuantizedWeight(
        bits=bits,
        group_size=size,
        qweight=pack_int4(q) if bits == 4 else q.contiguous(),
        scales=scales.contiguous(),
        zeros=None if not bool(zeros.any()) else zeros.contiguous(),
        perm=perm,
    )
