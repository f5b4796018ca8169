"""The CPU backend: memory is anonymous mmap (huge pages where allowed), streams are worker threads."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from ..tensor import TensorDesc
from .device import Device, register_backend
from .memory import Block, Segment

HUGE_PAGE = 2 << 20


class CpuDevice(Device):
    """Host memory as device memory; kernels are numba / numpy functions run on stream workers."""

    kind = "cpu"

    def _reserve(self, nbytes: int, policy: str) -> Segment:
        huge = policy == "huge_first" and nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE")
        pad = HUGE_PAGE if huge else 0  # over-reserve so the segment can start on a 2 MiB boundary
        try:
            mm = mmap.mmap(-1, nbytes + pad, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, OverflowError) as exc:  # OverflowError: past what mmap's size (ssize_t) can say
            raise MemoryError(str(exc)) from exc
        raw = np.frombuffer(mm, dtype=np.uint8)
        base = raw.ctypes.data
        start = (-base) % HUGE_PAGE if huge else 0
        if huge:
            try:
                mm.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
            except OSError:
                huge = False
        return Segment(base + start, nbytes, huge, policy, raw[start : start + nbytes])

    def _release(self, segment: Segment) -> None:
        segment.memory = None  # the mmap is unmapped when the last view of it is gone

    def _segment_view(self, segment: Segment, offset: int, size: int) -> Any:
        return segment.memory[offset : offset + size]

    def _array_view(self, block: Block, desc: TensorDesc) -> np.ndarray[Any, Any]:
        item = desc.dtype.itemsize
        try:
            return np.ndarray(
                desc.shape,
                desc.dtype.np,
                buffer=block.data,
                offset=desc.offset * item,
                strides=tuple(s * item for s in desc.strides),
            )
        except TypeError:  # not a buffer: a block without memory (a captured graph's, before instantiate)
            block.check_memory(desc)
            raise

    def _copyin(self, dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
        np.copyto(dst, src)


register_backend("cpu", CpuDevice)
