"""TGIS's prompt store (PREFIX_STORE_PATH): prompt-tuning prefixes by `prefix_id`, loaded on
first use into an LRU cache bounded by PROMPT_CACHE_SIZE_MB, with TGIS's messages.

An id resolves inside the store as TGIS's `prompt_cache.py` does: a PEFT prompt-tuning folder
`<id>/` (`adapter_model.safetensors`, else `adapter_model.bin`, holding `prompt_embeddings`),
else `<id>/decoder.pt`, else `<id>.pt` (a [virtual tokens, hidden] tensor saved by torch.save).
Ids may contain letters, digits, `_`, `-` and `/` only, and must stay inside the store (no
absolute paths). A loaded prefix is checked (2-D, 1 to `max_length` rows, the model's hidden
size, finite in the model's dtype), converted to the model's dtype and device, and keyed by a
hash of its content for the engine's prefix caching.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file as load_safetensors

from engine.request import PromptPrefix
from server.messages import ValidationError, prefix_lookup_error, prefix_not_found_reason

logger = logging.getLogger(__name__)

VALID_PREFIX_ID = re.compile(r"[/\w\-]+")
_PEFT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class PrefixStore:
    """Loads prefixes from `root` and keeps the most recently used ones while their tensors
    total at most `cache_size_mb` MiB (TGIS's count: each tensor's bytes rounded up to 512).
    `get` is thread-safe; two threads missing the same id may both load it (the first to finish
    is kept). Without a `root` every id is not found.

    `on_load(seconds)` is called after each load from disk, `on_failure()` after each failed
    lookup (TGIS's `tgi_prompt_load_duration` and `tgi_prompt_load_failure`).
    """

    def __init__(
        self,
        root: str | Path | None,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_length: int,
        cache_size_mb: int,
        on_load: Callable[[float], None] = lambda seconds: None,
        on_failure: Callable[[], None] = lambda: None,
    ) -> None:
        self.root = None if root is None else Path(os.path.abspath(root))
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.max_length = max_length
        self.cache_bytes = cache_size_mb * 1024 * 1024
        self.on_load = on_load
        self.on_failure = on_failure
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, PromptPrefix] = OrderedDict()  # oldest use first
        self._cached_bytes = 0

    @property
    def cached_ids(self) -> list[str]:
        """The cached ids, least recently used first."""
        with self._lock:
            return list(self._cache)

    def get(self, prefix_id: str) -> PromptPrefix:
        """The prefix `prefix_id`, from the cache or loaded. Raises ValidationError with TGIS's
        message (``can't retrieve prompt prefix with id '<id>': <reason>``) when it is unknown,
        invalid or too large for the cache."""
        with self._lock:
            prefix = self._cache.get(prefix_id)
            if prefix is not None:
                self._cache.move_to_end(prefix_id)
                return prefix
        try:
            start = time.perf_counter()
            prefix = PromptPrefix.of(self._load(prefix_id))
            self.on_load(time.perf_counter() - start)
            return self._add(prefix_id, prefix)
        except ValidationError:
            self.on_failure()
            raise

    def _add(self, prefix_id: str, prefix: PromptPrefix) -> PromptPrefix:
        size = _cache_bytes(prefix.embeds)
        if size > self.cache_bytes:
            raise prefix_lookup_error(
                prefix_id, f"Prefix ID object {prefix_id} exceeds the allowed cache size"
            )
        with self._lock:
            cached = self._cache.get(prefix_id)
            if cached is not None:
                self._cache.move_to_end(prefix_id)
                return cached
            while self._cached_bytes + size > self.cache_bytes:
                evicted_id, evicted = self._cache.popitem(last=False)
                self._cached_bytes -= _cache_bytes(evicted.embeds)
                logger.info("prompt prefix %s evicted from the prompt cache", evicted_id)
            self._cache[prefix_id] = prefix
            self._cached_bytes += size
        logger.info(
            "prompt prefix %s loaded: %d virtual tokens, %d bytes",
            prefix_id,
            prefix.num_tokens,
            size,
        )
        return prefix

    def _load(self, prefix_id: str) -> torch.Tensor:  # [virtual tokens, hidden], model dtype
        if not VALID_PREFIX_ID.fullmatch(prefix_id):
            raise prefix_lookup_error(
                prefix_id,
                f"Invalid prefix id {prefix_id}, must contain only alphanumeric, _ and - and /",
            )
        if self.root is None:
            raise prefix_lookup_error(prefix_id, prefix_not_found_reason(prefix_id))
        folder = self.root / prefix_id
        if not os.path.normpath(folder).startswith(str(self.root) + os.sep):
            raise prefix_lookup_error(prefix_id, f"Invalid prefix id {prefix_id}")
        try:
            data = self._read(folder)
        except Exception as e:  # any unreadable file: its details stay in the server's log
            logger.warning("prompt prefix %s could not be read: %s", prefix_id, e)
            raise prefix_lookup_error(prefix_id, "Invalid prefix embedding tensor") from e
        if data is None:
            raise prefix_lookup_error(prefix_id, prefix_not_found_reason(prefix_id))
        try:
            return self._check(data).to(self.device)
        except ValueError as e:
            raise prefix_lookup_error(prefix_id, str(e)) from e

    def _read(self, folder: Path) -> Any:
        """The tensor (or other object) the store holds for `folder`, None when none."""
        for name in _PEFT_FILES:
            path = folder / name
            if _is_file(path):
                state = (
                    load_safetensors(path, device="cpu")
                    if name.endswith(".safetensors")
                    else torch.load(path, map_location="cpu", weights_only=True)
                )
                if not isinstance(state, dict) or "prompt_embeddings" not in state:
                    raise ValueError(f"{name} holds no prompt_embeddings")
                return state["prompt_embeddings"]
        for path in (folder / "decoder.pt", folder.with_name(folder.name + ".pt")):
            if _is_file(path):
                return torch.load(path, map_location="cpu", weights_only=True)
        return None

    def _check(self, prefix: Any) -> torch.Tensor:
        """`prefix` in the model's dtype; ValueError with TGIS's message when it is not a
        usable [virtual tokens, hidden] tensor."""
        if not isinstance(prefix, torch.Tensor) or prefix.dim() != 2:
            raise ValueError("Invalid prefix embedding tensor")
        if prefix.shape[0] == 0 or prefix.shape[0] > self.max_length:
            raise ValueError(f"Invalid prefix embedding length of {prefix.shape[0]}")
        if prefix.shape[1] != self.hidden_size:
            raise ValueError(
                f"Prefix embedding tensor dim {prefix.shape[1]} does not match model "
                f"({self.hidden_size})"
            )
        converted = prefix.to(self.dtype)
        if not bool(converted.isfinite().all()):
            if not bool(prefix.isfinite().all()):
                raise ValueError("Prefix contains non-finite elements")
            raise ValueError(
                "Prefix contains non-finite elements after conversion from "
                f"{prefix.dtype} to {self.dtype}"
            )
        return converted


def _is_file(path: Path) -> bool:
    """Whether `path` is a file; False for a name the file system refuses (too long, say)."""
    try:
        return path.is_file()
    except OSError:
        return False


def _cache_bytes(t: torch.Tensor) -> int:
    """`t`'s bytes rounded up to 512, as TGIS counts a cached prompt."""
    raw = t.element_size() * t.nelement()
    return -(-raw // 512) * 512
