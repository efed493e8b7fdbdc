"""Torch dtype names as TGIS's DTYPE_STR gives them, mapped to the engine's dtypes."""

from __future__ import annotations

DTYPE_ALIASES = {
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "f16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "f32": "float32",
}
"""Torch dtype names (and their usual short forms) -> the engine's dtype. TGIS passes DTYPE_STR to
torch; `int8` (bitsandbytes 8-bit weights) is accepted by `canonical_dtype` as "no dtype"."""
INT8_DTYPE = "int8"


def canonical_dtype(name: str | None) -> str | None:
    """The engine dtype (float16, bfloat16 or float32) of a torch dtype name such as ``half``,
    ``torch.bfloat16`` or ``FP32`` (case-insensitive); None for None and for ``int8``, which the
    caller reports as not supported. ValueError for any other name."""
    if name is None:
        return None
    key = name.strip().lower().removeprefix("torch.")
    if key == INT8_DTYPE:
        return None
    if key not in DTYPE_ALIASES:
        raise ValueError(
            f"dtype must be a torch floating dtype name ({', '.join(DTYPE_ALIASES)}), got {name!r}"
        )
    return DTYPE_ALIASES[key]
