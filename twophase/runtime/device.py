"""The device protocol shared by every backend: pool, streams, tensor factories. Backends override hooks."""

from __future__ import annotations

import threading
import weakref
from typing import Any, ClassVar

import numpy as np

from .. import config
from ..errors import CaptureError, ParamError
from ..tensor import DType, Format, Tensor, TensorDesc
from . import forking
from .memory import Block, MemoryPool, Segment
from .stream import DroppedFailures, Stream, _Queue, check_stream

# what a launch gets as its workspace when phase 1 asked for none: empty bytes, so a kernel's
# ``ws[offset:offset + 0]`` views stay valid (a launch must not have to test for None)
NO_WORKSPACE: np.ndarray[Any, Any] = np.empty(0, np.uint8)

__all__ = ["Device", "device", "placement", "register_backend"]


class Device:
    """A device: its caching memory pool, its streams and tensor factories.

    Backends subclass this in ``runtime/ops_<name>.py`` and override ``_reserve``, ``_release``,
    ``_segment_view``, ``_array_view`` and ``_copyin`` only.
    """

    kind: ClassVar[str] = "base"
    runs_kernels: ClassVar[bool] = True
    has_worker: ClassVar[bool] = True

    def __init__(self, name: str) -> None:
        self.name = name
        self.pool = MemoryPool(self._reserve, self._release, self._segment_view, name=f"{name} pool", device=self)
        self._streams: weakref.WeakSet[Stream] = weakref.WeakSet()
        # every stream's queue, which outlives a dropped stream while its worker runs the work left on it
        self._queues: weakref.WeakSet[_Queue] = weakref.WeakSet()
        self._dropped_failures = DroppedFailures()
        self._local = threading.local()
        config.on_change("launch_blocking", self._apply_launch_blocking)

    def __reduce__(self) -> Any:
        """Pickled by name: the receiving process gets its own device of that name (one per name)."""
        return device, (self.name,)

    def __repr__(self) -> str:
        return f"Device('{self.name}')"

    # ---- backend hooks
    def _reserve(self, nbytes: int, policy: str) -> Segment:
        raise NotImplementedError

    def _release(self, segment: Segment) -> None:
        raise NotImplementedError

    def _segment_view(self, segment: Segment, offset: int, size: int) -> Any:
        raise NotImplementedError

    def _array_view(self, block: Block, desc: TensorDesc) -> np.ndarray[Any, Any]:
        raise NotImplementedError

    def _copyin(self, dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
        raise NotImplementedError

    # ---- streams
    def stream(self, name: str | None = None) -> Stream:
        """A new in-order stream with its own worker."""
        s = Stream._make(self, name, config.settings.launch_blocking, self.has_worker)
        self._streams.add(s)
        self._queues.add(s._q)
        s._q.dropped_failures = self._dropped_failures
        return s

    @property
    def default_stream(self) -> Stream:
        """The calling thread's default stream (one per thread, like CUDA's per-thread default stream)."""
        s: Stream | None = getattr(self._local, "stream", None)
        if s is None or s.closed:  # a closed default stream is replaced, not handed out for good
            s = self.stream(f"{self.name}:default:{threading.current_thread().name}")
            self._local.stream = s
        return s

    def _open_streams(self) -> list[Stream]:
        return [s for s in list(self._streams) if not s.closed]

    def synchronize(self) -> None:
        """Wait for every stream of this device and for work left on dropped or closed ones; then raise the first
        failure: of an open stream (as its own sync would), else one left on a stream its caller dropped (the
        others named in its notes). Refused from a stream's own task, before any wait."""
        queues = list(self._queues)
        for q in queues:
            q.refuse_own_task()
        for s in self._open_streams():
            s.synchronize()
        for q in queues:
            if q.closed:
                q.drain()
                self._dropped_failures.take(q)  # a closed stream's own sync already raised (and cleared) its own
        self._dropped_failures.raise_first()

    def _drain(self) -> None:
        """Wait for every stream's work without raising its errors: they stay for the caller's own sync."""
        for q in list(self._queues):
            q.drain()

    def _apply_launch_blocking(self, value: object) -> None:
        for s in self._open_streams():
            s._set_blocking(bool(value))

    # ---- memory
    def malloc(self, nbytes: int, policy: str = "huge_first", stream: Stream | None = None) -> Block:
        """A block from the caching pool (``nbytes == 0`` still gives a valid minimal block)."""
        return self.pool.malloc(nbytes, stream, policy)

    def empty(
        self, shape: Any, dtype: Any = DType.float32, format: Format = Format.ND, stream: Stream | None = None
    ) -> Tensor:
        """An uninitialised dense tensor from the pool."""
        desc = TensorDesc(shape, dtype, None, 0, format)
        return Tensor._make(desc, self.pool.malloc(desc.nbytes, stream), self, checked=False)

    def empty_like(self, desc: TensorDesc, stream: Stream | None = None) -> Tensor:
        """An uninitialised tensor of exactly ``desc`` (strides and offset too, on a block that spans them): what
        an executor planned for that desc can be bound to."""
        if not isinstance(desc, TensorDesc):
            raise ParamError(
                op="Device.empty_like", arg="desc", expected="a TensorDesc (tensor.desc)", got=type(desc).__name__
            )
        if desc.offset or not desc.is_contiguous:
            return Tensor._make(desc, self.pool.malloc(desc.byte_span()[1], stream), self)
        return Tensor._make(desc, self.pool.malloc(desc.nbytes, stream), self, checked=False)

    def tensor(self, array: Any, stream: Stream | None = None, format: Format = Format.ND, dtype: Any = None) -> Tensor:
        """Copy a host array in, in ``stream`` order (the default stream when omitted)."""
        stream = self.default_stream if stream is None else check_stream(stream, "Device.tensor", device=self)
        np_dtype = None if dtype is None else DType.of(dtype).np
        try:
            src = np.asarray(array, dtype=np_dtype)
        except (ValueError, TypeError, OverflowError) as e:
            raise ParamError(
                op="Device.tensor",
                arg="array",
                expected="an array-like of numbers" + ("" if dtype is None else f" fitting {dtype}"),
                got=f"{type(array).__name__} ({e})",
            ) from None
        if src.dtype not in _SUPPORTED:
            raise ParamError(
                op="Device.tensor", arg="array", expected=f"dtype in {sorted(_SUPPORTED_NAMES)}", got=str(src.dtype)
            )
        src = np.array(src, copy=True, order="C")  # the host may reuse its array before the copy runs
        t = self.empty(src.shape, src.dtype, format, stream)
        if self.runs_kernels and src.size:
            # the destination view is made now (not a host read): a stream-ordered free may follow before it runs
            try:
                dst = self._array_view(t.block, t.desc)
            except CaptureError:
                t.free(stream)
                raise CaptureError(
                    "a host array cannot be copied in during a capture (the graph's memory does not exist yet)",
                    op="Device.tensor",
                    arg="array",
                    expected="a tensor made before the capture",
                    got=t.desc,
                ) from None
            try:
                seq = stream._enqueue(_copy_task, (self, dst, src), "copy-in")
            except BaseException:  # refused (a capture by another thread) or an earlier failure raised inline:
                t.free()  # the copy ran (and raised) or was never queued
                raise
            t.block.mark_use(stream, seq)
        return t

    def from_array(self, array: np.ndarray[Any, Any]) -> Tensor:
        """Alias of :meth:`tensor` on the default stream."""
        return self.tensor(array)


def _copy_task(arg: tuple[Device, np.ndarray[Any, Any], np.ndarray[Any, Any]]) -> None:
    dev, dst, src = arg
    dev._copyin(dst, src)


_SUPPORTED = {d.np for d in DType}
_SUPPORTED_NAMES = {d.value for d in DType}
_BACKENDS: dict[str, type[Device]] = {}
_DEVICES: dict[str, Device] = {}
_lock = forking.lock()


def placement(inputs: Any, stream: Stream | None, op: str = "call") -> tuple[Device, Stream]:
    """Where a call of ``op`` runs: ``stream``'s device and ``stream`` (checked: a Stream, open); else the first
    Tensor input's device (or the default device) and that device's default stream for the calling thread."""
    if stream is not None:
        check_stream(stream, op)
        for x in inputs:
            if isinstance(x, Tensor) and x.device is not stream.device:
                raise ParamError(
                    op=op,
                    arg="stream",
                    expected=f"a stream of {x.device.name}, the inputs' device",
                    got=f"a stream of {stream.device.name}",
                )
        return stream.device, stream
    dev = next((x.device for x in inputs if isinstance(x, Tensor)), None) or device()
    return dev, dev.default_stream


def register_backend(name: str, cls: type[Device]) -> None:
    """Make ``twophase.device(name)`` create ``cls``."""
    _BACKENDS[name] = cls


def device(name: str = "cpu") -> Device:
    """The device named ``name`` (``"cpu"``, the default, or ``"null"``); one instance per name."""
    dev = _DEVICES.get(name)
    if dev is None:
        with _lock:
            dev = _DEVICES.get(name)
            if dev is None:
                cls = _BACKENDS.get(name)
                if cls is None:
                    raise ParamError(op="device", arg="name", expected=f"one of {sorted(_BACKENDS)}", got=name)
                dev = cls(name)
                _DEVICES[name] = dev
    return dev
