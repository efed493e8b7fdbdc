"""A model's checkpoint targets for GPTQ: each float `<layer>.weight` target whose destination
is a GPTQ `QuantLinear` becomes the four tensors GPTQ stores instead (`engine.quant.gptq`), read
in the slices this rank holds:

- a column-parallel part (rows `source_rows` of W) reads those output columns of qweight and
  scales, the matching words of qzeros (the slice must start and end on a word), and all of
  g_idx;
- a row-parallel layer (columns `source_cols` of W) reads those input rows of qweight (on a
  word) and of g_idx, and every group's scales and zeros (the layer keeps the groups it holds).

A target's constant `scale` multiplies the scales (W = scales * (q - z) is linear in them).
GPTQ writers that give every layer a bias (AutoGPTQ stores zeros where the model has none) are
read too: such a `<layer>.bias` is optional and must be zero.
"""

from __future__ import annotations

import math

import torch

from engine.layers.quant_linear import GptqSink, QuantLinear
from engine.models.loader import WeightTarget
from engine.quant.scheme import QuantScheme


class ZeroBias:
    """An optional bias the model does not have: accepted only when all zeros."""

    def load_rows(self, row_offset: int, tensor: torch.Tensor) -> None:
        if bool(tensor.any()):
            raise ValueError("a non-zero bias where the model has none")


class Undeclared:
    """Checkpoint tensors the quantization config does not declare: refused, saying why."""

    def __init__(self, why: str) -> None:
        self.why = why

    def load_rows(self, row_offset: int, tensor: torch.Tensor) -> None:
        raise ValueError(self.why)


def undeclared_head(scheme: QuantScheme, vocab: int, hidden: int) -> dict[str, WeightTarget]:
    """Targets that refuse a quantized LM head's tensors (of `scheme`'s shapes) in a checkpoint
    whose config does not declare `lm_head` true."""
    pack = 32 // scheme.bits
    groups = 1 if scheme.group_size == -1 else math.ceil(hidden / scheme.group_size)
    sink = Undeclared(f"a quantized LM head, but {scheme.source} does not declare 'lm_head' true")
    shapes = {
        "qweight": (hidden // pack, vocab),
        "qzeros": (groups, math.ceil(vocab / pack)),
        "scales": (groups, vocab),
        "g_idx": (hidden,),
    }
    return {f"lm_head.{f}": WeightTarget(sink, 0, s, optional=True) for f, s in shapes.items()}


def _word_range(span: tuple[int, int], pack: int, what: str, total: int) -> tuple[int, int]:
    """The packed words holding values [start, end) of `total`; the last word of the tensor
    may be partly filled (a vocabulary that is no multiple of `pack`)."""
    if span[0] % pack or (span[1] % pack and span[1] != total):
        raise ValueError(
            f"{what} [{span[0]}, {span[1]}) of this rank do not start and end on a packed "
            f"word of {pack} values: the GPTQ layer cannot be split over these ranks"
        )
    return span[0] // pack, math.ceil(span[1] / pack)


def gptq_targets(targets: dict[str, WeightTarget]) -> dict[str, WeightTarget]:
    """`targets` with every GPTQ layer's `.weight` replaced by its four tensors (see the module
    docstring). ValueError naming the layer when this rank's slice cannot be read."""
    result: dict[str, WeightTarget] = {}
    for name, target in targets.items():
        layer = target.dest
        if not (isinstance(layer, QuantLinear) and layer.scheme.method == "gptq"):
            result[name] = target
            continue
        base = name.removesuffix(".weight")
        bits, group_size = layer.scheme.bits, layer.scheme.group_size
        pack = 32 // bits
        out_total, in_total = target.shape
        groups = 1 if group_size == -1 else math.ceil(in_total / group_size)
        words_out = math.ceil(out_total / pack)

        def sink(field: str, layer: QuantLinear = layer, at: int = target.row_offset) -> GptqSink:
            return layer.gptq_sink(at, field)

        try:
            if target.source_cols is None:  # the whole input; these output rows
                rows = target.source_rows
                words = (
                    None
                    if rows is None
                    else _word_range(rows, pack, f"{base} output rows", out_total)
                )
                result |= {
                    f"{base}.qweight": WeightTarget(
                        sink("qweight"), 0, (in_total // pack, out_total), source_cols=rows
                    ),
                    f"{base}.qzeros": WeightTarget(
                        sink("qzeros"), 0, (groups, words_out), source_cols=words
                    ),
                    f"{base}.scales": WeightTarget(
                        sink("scales"), 0, (groups, out_total), target.scale, source_cols=rows
                    ),
                    f"{base}.g_idx": WeightTarget(sink("g_idx"), 0, (in_total,)),
                }
            else:  # row-parallel: these input columns; every output row
                cols = target.source_cols
                words = _word_range(cols, pack, f"{base} input columns", in_total)
                result |= {
                    f"{base}.qweight": WeightTarget(
                        sink("qweight"), 0, (in_total // pack, out_total), source_rows=words
                    ),
                    f"{base}.qzeros": WeightTarget(sink("qzeros"), 0, (groups, words_out)),
                    f"{base}.scales": WeightTarget(
                        sink("scales"), 0, (groups, out_total), target.scale
                    ),
                    f"{base}.g_idx": WeightTarget(sink("g_idx"), 0, (in_total,), source_rows=cols),
                }
        except ValueError as e:
            raise ValueError(f"{e} (layer {base})") from e
        if f"{base}.bias" not in targets:
            result[f"{base}.bias"] = WeightTarget(ZeroBias(), 0, (out_total,), optional=True)
    return result
