"""The NULL backend: allocates and enqueues but runs no kernel, to test and measure host-side cost alone."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from ..errors import InvalidStateError
from ..tensor import TensorDesc
from .device import Device, register_backend
from .memory import Block, Segment


class NullDevice(Device):
    """Addresses without memory; streams complete tasks as soon as they are enqueued (runtime markers run)."""

    kind = "null"
    runs_kernels = False
    has_worker = False

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._next_address = itertools.count(1 << 32, 1 << 32)

    def stream(self, name: str | None = None) -> Any:
        s = super().stream(name)
        q = s._q
        q.enqueue = q.enqueue_null
        s._enqueue = q.enqueue
        return s

    def _reserve(self, nbytes: int, policy: str) -> Segment:
        return Segment(next(self._next_address), nbytes, False, policy, None)

    def _release(self, segment: Segment) -> None:
        pass

    def _segment_view(self, segment: Segment, offset: int, size: int) -> Any:
        return None

    def _array_view(self, block: Block, desc: TensorDesc) -> np.ndarray[Any, Any]:
        block.check_memory(desc)
        raise InvalidStateError("the NULL device holds no data", op="Tensor.view", arg="tensor", got=desc)

    def _copyin(self, dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
        pass


register_backend("null", NullDevice)
