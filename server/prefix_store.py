"""TGIS's prompt store (PREFIX_STORE_PATH): prompt-tuning prefixes by `prefix_id`, loaded on
first use into an LRU cache bounded by PROMPT_CACHE_SIZE_MB, with TGIS's messages.

An id resolves inside the store as TGIS's `prompt_cache.py` does: a PEFT prompt-tuning folder
`<id>/` (`adapter_model.safetensors`, else `adapter_model.bin`, holding `prompt_embeddings`),
else `<id>/decoder.pt`, else `<id>.pt` (a [virtual tokens, hidden] tensor saved by torch.save).
Ids may contain letters, digits, `_`, `-` and `/` only, and must stay inside the store (no
absolute paths). Symbolic links are followed only while they stay inside the store: a file
whose real path is outside it, or that is not a regular file (a FIFO, a device, a directory),
is refused with the message of an unknown id. A loaded prefix is checked (2-D, 1 to
`max_length` rows, the model's hidden size, finite in the model's dtype), converted to the
model's dtype and device, and keyed by a hash of its content for the engine's prefix caching.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

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
        self.root = None if root is None else Path(os.path.realpath(root))
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
        except _OutsideStore as e:
            logger.warning("prompt prefix %s refused: %s", prefix_id, e)
            raise prefix_lookup_error(prefix_id, prefix_not_found_reason(prefix_id)) from e
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
            content = self._content(folder / name)
            if content is not None:
                state = (
                    load_safetensors(content)
                    if name.endswith(".safetensors")
                    else torch.load(io.BytesIO(content), map_location="cpu", weights_only=True)
                )
                if not isinstance(state, dict) or "prompt_embeddings" not in state:
                    raise ValueError(f"{name} holds no prompt_embeddings")
                return state["prompt_embeddings"]
        for path in (folder / "decoder.pt", folder.with_name(folder.name + ".pt")):
            content = self._content(path)
            if content is not None:
                return torch.load(io.BytesIO(content), map_location="cpu", weights_only=True)
        return None

    def _content(self, path: Path) -> bytes | None:
        """The bytes of the store's file at `path`; None when nothing is there. Raises
        `_OutsideStore` when its real path (every link followed) leaves the store or it is not
        a regular file: it is opened without following a last link and without waiting for a
        writer, and checked once open."""
        if not os.path.lexists(path):  # False too for a name the system refuses (too long, say)
            return None
        assert self.root is not None
        real = os.path.realpath(path)
        if not real.startswith(str(self.root) + os.sep):
            raise _OutsideStore(f"{path} resolves to {real}, outside the store {self.root}")
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(real, flags)
        except (FileNotFoundError, NotADirectoryError) as e:  # a broken link
            raise _OutsideStore(f"{path} leads to no file: {e}") from e
        except OSError as e:
            if e.errno != errno.ELOOP:  # ELOOP: a link put in after the path was resolved
                raise
            raise _OutsideStore(f"{path} changed into a link: {e}") from e
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise _OutsideStore(f"{path} is not a regular file")
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "rb") as f:
            return f.read()

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


class _OutsideStore(Exception):
    """A store path that leads outside the store or to something other than a regular file."""


def _cache_bytes(t: torch.Tensor) -> int:
    """`t`'s bytes rounded up to 512, as TGIS counts a cached prompt."""
    raw = t.element_size() * t.nelement()
    return -(-raw // 512) * 512
