"""specserve's inference engine: paged-attention Llama, batching, speculation.

`from engine import LLM` is the offline API. Imports are lazy so that the scheduler and the KV
manager load without torch or transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm import LLM, GenerationOutput
    from engine.sampling.params import SamplingParams

__all__ = ["LLM", "GenerationOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "GenerationOutput"):
        from engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from engine.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
