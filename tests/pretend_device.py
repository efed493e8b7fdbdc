"""A stand-in for CUDA that computes real values on the CPU and counts what crosses to the host.

Under `PretendDevice`, tensors on `meta` hold real CPU tensors (`_OnDevice`), so a model, the
sampler and the drafter on `meta` run their steps to the end with real values, while torch's own
dispatcher is watched for every way data moves between the pretend device and the host:

- reads (each one, on CUDA, waits for the device): a copy to the host (`.cpu()`, `.to("cpu")`,
  `copy_` into a host tensor), `.item()`, `.tolist()`, truth and number conversions, and the
  operations whose output size depends on the values (`nonzero`, `masked_select`, `unique`,
  indexing with a boolean mask, ...: on CUDA they read the size back);
- pageable writes: a copy of host memory onto the device that was not pinned first
  (`torch.tensor(..., device=)`, `.to(device)` of a host tensor that is not pinned): on CUDA the
  copy waits for the device. Pinned memory is what `Tensor.pin_memory()` or
  `torch.empty(..., pin_memory=True)` returned (this CPU build has no pinned allocator, so
  these are marked here); `engine.host_copy` pins for `meta` as it does for CUDA while the
  stand-in is active.

As on CUDA, an operation that mixes a device tensor with a host tensor of one or more dimensions
raises, and so do `.numpy()` and `.data_ptr()` of a device tensor (host code cannot read it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import engine.host_copy

aten = torch.ops.aten

_SIZE_FROM_VALUES = {
    aten.nonzero.default, aten.masked_select.default, aten.unique_consecutive.default,
    aten._unique2.default, aten.unique_dim.default, aten.repeat_interleave.Tensor,
    aten.argwhere.default,
}  # fmt: skip
_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__"}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


class _OnDevice(torch.Tensor):
    """A tensor on the pretend device (`meta`) holding its values in `elem`, a CPU tensor."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> _OnDevice:
        t = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, device="meta", requires_grad=elem.requires_grad,
        )  # fmt: skip
        t.elem = elem
        return t

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError(f"{func} on the pretend device outside PretendDevice")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"OnDevice({self.elem!r})"


def _is_meta(device: object) -> bool:
    return device is not None and torch.device(device).type == "meta"  # type: ignore[call-overload]


def _masks(func: Any, args: Any) -> bool:
    """Whether `func` indexes with a boolean mask (its output size is the mask's count)."""
    if func not in _INDEXING:
        return False
    indices = args[1] if len(args) > 1 else []
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    )


def _target_device(func: Any, args: Any, kwargs: dict[str, Any]) -> torch.device | None:
    """Where an `aten.to` / `aten._to_copy` call puts its result (None: where it is)."""
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    for x in args[1:2]:
        if isinstance(x, torch.device | str):
            return torch.device(x)
        if isinstance(x, torch.Tensor):
            return x.device
    return None


class PretendDevice(TorchDispatchMode):
    """Active as a context (`pretend_device()`): `reads` and `pageable_writes` name each
    read and each unpinned write, in order, while `counting` is true."""

    def __init__(self) -> None:
        super().__init__()
        self.counting = False
        self.reads: list[str] = []
        self.pageable_writes: list[str] = []
        self._pinned: list[torch.Tensor] = []  # kept alive: their storages are the pinned ones

    def pin(self, host: torch.Tensor) -> torch.Tensor:
        self._pinned.append(host)
        return host

    def _is_pinned(self, host: torch.Tensor) -> bool:
        ptr = host.untyped_storage().data_ptr()
        return any(p.untyped_storage().data_ptr() == ptr for p in self._pinned)

    def read(self, what: str) -> None:
        if self.counting:
            self.reads.append(what)

    def write(self, host: torch.Tensor | None, what: str) -> None:
        if self.counting and (host is None or not self._is_pinned(host)):
            self.pageable_writes.append(what)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        on_device = [x for x in leaves if isinstance(x, _OnDevice)]
        device_kwarg = kwargs.get("device")
        if func.overloadpacket in (aten.to, aten._to_copy):
            src, target = args[0], _target_device(func, args, kwargs)
            if isinstance(src, _OnDevice) and target is not None and target.type != "meta":
                self.read(f"copy to the host ({func})")
                return func(src.elem, *args[1:], **kwargs)
            if not isinstance(src, _OnDevice) and target is not None and target.type == "meta":
                self.write(src, f"copy to the device ({func})")
                device_kwarg = target
        elif func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(src, _OnDevice) and not isinstance(dst, _OnDevice):
                self.read("copy_ into a host tensor")
                dst.copy_(src.elem)
                return dst
            if isinstance(dst, _OnDevice) and not isinstance(src, _OnDevice):
                self.write(src, "copy_ from a host tensor")
                dst.elem.copy_(src)
                return dst
        elif on_device and func is aten._local_scalar_dense.default:
            self.read("item")
        elif on_device and (func in _SIZE_FROM_VALUES or _masks(func, args)):
            self.read(str(func))
        elif on_device and func is not aten._has_compatible_shallow_copy_type.default:
            host = [
                x for x in leaves
                if isinstance(x, torch.Tensor) and not isinstance(x, _OnDevice) and x.dim() > 0
            ]  # fmt: skip
            if host:
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, found at least two devices"
                    f" ({func}: meta and cpu)"
                )
        creates = _is_meta(device_kwarg)

        def unwrap(x: object) -> object:
            if isinstance(x, _OnDevice):
                return x.elem
            if isinstance(x, torch.device) and x.type == "meta":
                return torch.device("cpu")
            if isinstance(x, str) and x == "meta":
                return "cpu"
            return x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if not (on_device or creates):
            return out
        by_elem = {id(x.elem): x for x in on_device}

        def wrap(x: object) -> object:
            if isinstance(x, torch.Tensor):
                same = by_elem.get(id(x))
                return _OnDevice(x) if same is None else same
            return x

        return tree_map(wrap, out)


class _HostCalls(TorchFunctionMode):
    """The Python-level ways to the host that never reach the dispatcher as one operation."""

    def __init__(self, device: PretendDevice) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if args and isinstance(args[0], _OnDevice):
            if name in _READS:
                self.device.read(name)
                return getattr(args[0].elem, name)(*args[1:], **kwargs)
            if name in ("data_ptr", "numpy"):
                raise TypeError(f"{name}() of a device tensor: the host cannot read it")
        if name == "pin_memory" and args and not isinstance(args[0], _OnDevice):
            return self.device.pin(args[0].clone())
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
            return self.device.pin(func(*args, **kwargs))
        if name in ("tensor", "as_tensor", "asarray") and _is_meta(kwargs.get("device")):
            host = func(*args, **{**kwargs, "device": "cpu"})
            return host.to("meta")  # a pageable write: `host` was not pinned
        return func(*args, **kwargs)


@contextmanager
def pretend_device() -> Iterator[PretendDevice]:
    """Tensors made on `meta` meanwhile are on the pretend device (see the module); everything
    runs in inference mode, as the engine's steps do."""
    device = PretendDevice()
    old = engine.host_copy.PINNED_DEVICE_TYPES
    engine.host_copy.PINNED_DEVICE_TYPES = old | {"meta"}
    try:
        with torch.inference_mode(), device, _HostCalls(device):
            yield device
    finally:
        engine.host_copy.PINNED_DEVICE_TYPES = old


def counted(device: PretendDevice, run: Callable[[], Any]) -> Any:
    """`run()` with `device` counting its reads and pageable writes from nothing."""
    device.reads.clear()
    device.pageable_writes.clear()
    device.counting = True
    try:
        return run()
    finally:
        device.counting = False
