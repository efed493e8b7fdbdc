"""Which quantization a model is served with: the `QUANTIZE` value asked for, reconciled with what
the checkpoint declares.

A GPTQ checkpoint declares itself in `quantize_config.json` (AutoGPTQ, GPTQModel) or in
config.json's `quantization_config` (transformers), with `quant_method` "gptq"; both are read, and
where both exist they must agree. `checkpoint_format` "gptq" (AutoGPTQ's and transformers'
default, also written by GPTQModel when asked for it) stores each zero point minus one;
"gptq_v2" (GPTQModel's internal format) stores it as is. A float checkpoint declares nothing.

Rules (`resolve_scheme`): unset QUANTIZE serves what the checkpoint declares; QUANTIZE=gptq needs
a GPTQ checkpoint; QUANTIZE=int8 needs a float one (quantized at load); any other declared
method is refused. Every refusal is a `CheckpointError` naming the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import QUANTIZATIONS
from engine.models.loader import CheckpointError
from engine.quant.weights import SUPPORTED_BITS

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
"""GPTQ zero-point conventions: "gptq" stores zero - 1, "gptq_v2" stores zero."""


@dataclass(frozen=True)
class QuantScheme:
    """How the decoder layers' linear weights are stored. `method` "int8": a float checkpoint
    quantized at load (8 bits, one scale per output row, symmetric). `method` "gptq": the
    checkpoint's own integers (`bits`, `group_size` input columns per scale, -1: one group;
    `sym`: no zero points declared; `desc_act`: act-order, g_idx permutes the groups;
    `lm_head`: the LM head is quantized too, with the same settings, and the embedding table is
    the checkpoint's float `model.embed_tokens.weight` even where the config ties them)."""

    method: str
    bits: int = 8
    group_size: int = -1
    sym: bool = True
    desc_act: bool = False
    checkpoint_format: str = "gptq"
    lm_head: bool = False
    source: str = ""  # the file the scheme was read from (for messages)

    @property
    def zeros_minus_one(self) -> bool:
        """Whether stored zero points are the zero minus one (the "gptq" format)."""
        return self.checkpoint_format == "gptq"

    def describe(self) -> str:
        if self.method == "int8":
            return "int8 (quantized at load, per output channel)"
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        zeros = "sym" if self.sym else "asym"
        order = ", act-order" if self.desc_act else ""
        head = ", LM head quantized" if self.lm_head else ""
        return f"gptq {self.bits}-bit {group} {zeros}{order}{head} ({self.checkpoint_format})"


def _declared(folder: Path) -> tuple[Path, dict[str, Any]] | None:
    """(file, its quantization dict) the checkpoint declares, or None for a float checkpoint."""
    found: list[tuple[Path, dict[str, Any]]] = []
    qc_file = folder / "quantize_config.json"
    if qc_file.is_file():
        try:
            found.append((qc_file, dict(json.loads(qc_file.read_text()))))
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{qc_file}: unreadable ({e})") from e
    cfg_file = folder / "config.json"
    if cfg_file.is_file():
        try:
            cfg = json.loads(cfg_file.read_text())
        except ValueError as e:
            raise CheckpointError(f"{cfg_file}: unreadable ({e})") from e
        qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
        if qc is not None:
            if not isinstance(qc, dict):
                raise CheckpointError(f"{cfg_file}: quantization_config is not an object")
            found.append((cfg_file, qc))
    if not found:
        return None
    if len(found) == 2:
        (f1, a), (f2, b) = found
        for key in ("bits", "group_size", "desc_act", "sym", "checkpoint_format", "lm_head"):
            if key in a and key in b and a[key] != b[key]:
                raise CheckpointError(
                    f"{f1} and {f2} disagree on '{key}' ({a[key]!r} against {b[key]!r})"
                )
        found[0][1].update({k: v for k, v in b.items() if k not in a})
    return found[0]


def _field(source: Path, qc: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = qc.get(key, default)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise CheckpointError(f"{source}: '{key}' must be an integer, got {value!r}")
    if kind is bool and not isinstance(value, bool):
        raise CheckpointError(f"{source}: '{key}' must be true or false, got {value!r}")
    return value


def checkpoint_scheme(folder: Path) -> QuantScheme | None:
    """The quantization the checkpoint in `folder` declares (None: a float checkpoint).
    CheckpointError, naming the file and the field, for a method or setting not served."""
    declared = _declared(folder)
    if declared is None:
        return None
    source, qc = declared
    method = str(qc.get("quant_method", "gptq")).lower()  # AutoGPTQ's older files omit it
    if method != "gptq":
        raise CheckpointError(
            f"{source}: quant_method '{method}' is not supported (supported: gptq checkpoints, "
            "or a float checkpoint with QUANTIZE=int8)"
        )
    bits = _field(source, qc, "bits", int, None)
    if bits not in SUPPORTED_BITS:
        raise CheckpointError(
            f"{source}: bits {bits!r} is not supported (supported: "
            f"{', '.join(map(str, SUPPORTED_BITS))})"
        )
    group_size = _field(source, qc, "group_size", int, -1)
    if group_size != -1 and group_size <= 0:
        raise CheckpointError(f"{source}: group_size must be -1 or positive, got {group_size}")
    fmt = str(qc.get("checkpoint_format", "gptq"))
    if fmt not in CHECKPOINT_FORMATS:
        raise CheckpointError(
            f"{source}: checkpoint_format '{fmt}' is not supported "
            f"(supported: {', '.join(CHECKPOINT_FORMATS)})"
        )
    return QuantScheme(
        method="gptq",
        bits=bits,
        group_size=group_size,
        sym=_field(source, qc, "sym", bool, True),
        desc_act=_field(source, qc, "desc_act", bool, False),
        checkpoint_format=fmt,
        lm_head=_field(source, qc, "lm_head", bool, False),
        source=str(source),
    )


def resolve_scheme(requested: str | None, folder: Path) -> QuantScheme | None:
    """The scheme to serve `folder` with under QUANTIZE=`requested` (None: unset); see the
    module docstring. CheckpointError naming both when they disagree."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise ValueError(
            f"QUANTIZE={requested} is not supported (supported: {', '.join(QUANTIZATIONS)})"
        )
    declared = checkpoint_scheme(folder)
    if declared is not None:
        if requested not in (None, declared.method):
            raise CheckpointError(
                f"QUANTIZE={requested} does not match the checkpoint: {declared.source} "
                f"declares quant_method '{declared.method}'"
            )
        return declared
    if requested == "gptq":
        raise CheckpointError(
            f"QUANTIZE=gptq does not match the checkpoint: {folder} is a float checkpoint (no "
            "quantize_config.json, no quantization_config in config.json)"
        )
    return QuantScheme(method="int8", source=str(folder)) if requested == "int8" else None
