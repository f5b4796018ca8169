"""Zero-copy interop: wrap host arrays (numpy, torch CPU tensors, anything with ``__dlpack__``) as Tensors."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from .errors import InvalidStateError, ParamError
from .runtime.device import Device, device
from .runtime.memory import Block, Segment
from .tensor import DType, Tensor, TensorDesc

__all__ = ["from_dlpack"]


class _External:
    """Stands in for a ``MemoryPool`` for memory the library does not own: free only forgets it."""

    name = "external"

    def free(self, blk: Block, stream: Any = None) -> None:
        if not blk.allocated:  # as the pool: a second free is a bug in the caller
            raise InvalidStateError("block is not allocated (double free?)", op="free", arg="block", got=blk)
        blk.allocated = False
        blk.freed = True
        blk.data = None


_EXTERNAL = _External()


def from_dlpack(obj: Any, dev: Device | None = None) -> Tensor:
    """A Tensor over ``obj``'s memory, without copying (``obj`` must live on the host and be writable).

    A twophase Tensor gives a Tensor on its own block, so reads still wait for the work queued on it.
    Read-only memory is refused: ops write their outputs in place, and DLPack cannot say "read-only".
    """
    if dev is not None and not isinstance(dev, Device):
        raise ParamError(
            op="from_dlpack",
            arg="dev",
            expected="None or a twophase Device (twophase.device())",
            got=type(dev).__name__,
        )
    if isinstance(obj, Tensor):
        return _same_block(obj, dev)
    try:
        arr = obj if isinstance(obj, np.ndarray) else np.from_dlpack(obj)
    except (TypeError, ValueError, AttributeError, BufferError, RuntimeError) as exc:  # no __dlpack__: AttributeError
        raise ParamError(
            op="from_dlpack", arg="obj", expected="a host array exporting DLPack", got=f"{type(obj).__name__} ({exc})"
        ) from None
    if not arr.flags.writeable:
        raise ParamError(
            op="from_dlpack",
            arg="obj",
            expected="writable memory (ops write into their tensors)",
            got=f"a read-only {type(obj).__name__}",
        )
    try:
        dtype = DType.of(arr.dtype)
    except ParamError:
        raise ParamError(
            op="from_dlpack", arg="obj", expected=f"dtype in {[d.value for d in DType]}", got=str(arr.dtype)
        ) from None
    item = arr.itemsize
    if any(s % item for s in arr.strides):
        raise ParamError(
            op="from_dlpack", arg="obj", expected="strides that are multiples of the item size", got=arr.strides
        )
    strides = tuple(s // item for s in arr.strides)
    base = arr.ctypes.data
    lo = hi = 0
    for n, s in zip(arr.shape, strides):
        if n > 0:
            lo, hi = (lo + (n - 1) * s, hi) if s < 0 else (lo, hi + (n - 1) * s)
    nbytes = (hi - lo + 1) * item if arr.size else 0
    start = base + lo * item
    if nbytes:
        raw = (ctypes.c_uint8 * nbytes).from_address(start)
        mem = np.frombuffer(raw, np.uint8)  # type: ignore[call-overload]
    else:
        mem = np.empty(0, np.uint8)
    seg = Segment(start, nbytes, False, "external", (mem, arr))  # keeps the exporter alive
    blk = Block(_EXTERNAL, seg, 0, nbytes)  # type: ignore[arg-type]
    blk.allocated = True
    blk.data = mem
    desc = TensorDesc(arr.shape, dtype, strides, -lo)
    return Tensor._make(desc, blk, dev or device())


def _same_block(t: Tensor, dev: Device | None) -> Tensor:
    """``t``'s desc on ``t``'s block: the pending-work tracking is the block's, so stream order holds."""
    if dev is not None and dev is not t.device:
        raise ParamError(op="from_dlpack", arg="dev", expected=f"None or the tensor's device {t.device.name}", got=dev)
    if t.block.freed:
        raise InvalidStateError("tensor's block was freed", op="from_dlpack", arg="obj", got=t.desc)
    return Tensor._make(t.desc, t.block, t.device)
