"""Stream capture: launches on the captured stream are recorded as graph nodes instead of running.

For the capture's duration, and only then, a few entry points are swapped for recording versions, so the
plain (non-capturing) phase-2 and enqueue paths carry no check at all:

- the stream's ``_enqueue`` (what phase 2 calls) records executor launches and refuses anything else (copies,
  events, callbacks); its queue ``_q`` is a stand-in whose ``wait_for`` refuses waits from the capturing
  thread (``synchronize``, host reads of tensors the capture used);
- the device pool's ``malloc`` hands the capturing thread *virtual* blocks: no memory until the graph is
  instantiated, where each becomes a slice of the arena (``VirtualBlock``);
- ``Op._build_launch`` defers the launch of an executor bound to a virtual tensor (there is nothing to view
  yet; a view of a virtual tensor, during the capture or after it, is refused by ``VirtualBlock.check_memory``);
- a phase-2 hook refuses launches from the capturing thread on any other stream.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .. import hooks
from ..errors import CaptureError, InvalidStateError
from ..executor import Executor
from ..op import Op
from ..runtime import forking
from ..runtime.memory import Block, check_malloc
from ..runtime.stream import SWITCH_LOCK, Stream, check_stream
from .replay import Graph
from .virtual import VirtualBlock

__all__ = ["capture", "capturing"]

_active: dict[int, Graph] = {}  # capturing thread -> its graph
_lock = forking.lock()
_shared: dict[str, Any] = {"n": 0}  # swaps shared by every capture: Op._build_launch, the phase-2 hook
_taps: dict[int, list[Any]] = {}  # id(device) -> [count, restore functions]


def capturing() -> Graph | None:
    """The graph the calling thread is capturing into, if any."""
    return _active.get(threading.get_ident())


@contextlib.contextmanager
def capture(stream: Stream, name: str | None = None) -> Iterator[Graph]:
    """Record the launches issued on ``stream`` by this thread into a :class:`~twophase.graph.Graph`.

    Explicit phase 2 calls, ``plan`` calls and one-shot calls on ``stream`` are recorded, not executed.
    Tensors allocated from the device's pool by this thread during the capture are virtual until
    ``graph.instantiate()``. A launch on another stream, a synchronization of ``stream``, or a host read of
    a tensor the capture uses raises :class:`~twophase.CaptureError`. Name the graph's inputs and outputs
    with ``graph.input(name, tensor)`` / ``graph.output(name, tensor)``.
    """
    check_stream(stream, "capture")
    tid = threading.get_ident()
    with _lock:
        if tid in _active:
            raise CaptureError(
                "captures do not nest",
                op="capture",
                arg="stream",
                expected="no capture active on this thread",
                got=f"capturing {_active[tid]}",
            )
        if any(g.stream is stream for g in _active.values()):
            raise CaptureError(
                "stream is already being captured by another thread", op="capture", arg="stream", got=stream.name
            )
        graph = Graph._new(stream, name, tid)
        restore = _begin(graph)
        _active[tid] = graph
    failed = True
    try:
        yield graph
        failed = False
    finally:
        with _lock:
            del _active[tid]
            for fn in reversed(restore):
                fn()
        graph._end_capture(failed)


# ---- the swaps
def _swap(obj: Any, attr: str, new: Any) -> Callable[[], None]:
    """Set an instance attribute; the returned function puts back what was there (or removes it)."""
    had = attr in getattr(obj, "__dict__", {}) or (hasattr(type(obj), "__slots__") and attr in type(obj).__slots__)
    old = getattr(obj, attr)
    setattr(obj, attr, new)

    def restore() -> None:
        if had:
            setattr(obj, attr, old)
        else:
            delattr(obj, attr)

    return restore


class _CaptureQueue:
    """What ``stream._q`` is while the stream is captured: enqueues record, waits from the capturing thread
    raise. ``submitted`` stays at the last real task, so whatever reads ``submitted + 1`` as the seq of the
    task it is about to enqueue (the sanitizer, the profiler) gets a seq of this queue, which counts as done
    once the capture ends (nothing of it will ever run). Everything else is the real queue's."""

    def __init__(self, graph: Graph, real: Any) -> None:
        self._real = real
        self._graph = graph
        self._capturing = True
        self.name = real.name
        self.submitted = real.submitted
        self.enqueue = graph._record

    @property
    def done(self) -> int:
        return self._real.done if self._capturing else self.submitted + 1  # type: ignore[no-any-return]

    def wait_for(self, seq: int, raise_errors: bool = True) -> None:
        if threading.get_ident() == self._graph._thread:
            raise CaptureError(
                f"stream '{self.name}' is being captured: no synchronization or host read of its "
                "work until the capture ends",
                op="capture",
                arg="stream",
            )
        self._real.wait_for(seq, raise_errors)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _begin(graph: Graph) -> list[Callable[[], None]]:
    stream = graph.stream
    cq = _CaptureQueue(graph, stream._q)
    with SWITCH_LOCK:
        restore_q = _swap(stream, "_q", cq)
        stream._enqueue = graph._record

    def end() -> None:
        cq._capturing = False
        with SWITCH_LOCK:
            restore_q()
            stream._enqueue = stream._q.enqueue  # not the one saved: launch blocking may have switched meanwhile

    restore = [end]
    restore.append(_tap_device(graph.device))
    restore.append(_share())
    return restore


def _tap_device(dev: Any) -> Callable[[], None]:
    """Virtual allocations for capturing threads (one tap per device)."""
    key = id(dev)
    tap = _taps.get(key)
    if tap is None:
        pool = dev.pool
        orig_malloc = pool.malloc

        def malloc(nbytes: int, stream: Any = None, policy: str = "huge_first") -> Block:
            g = _active.get(threading.get_ident())
            if g is None or g.device is not dev:
                return orig_malloc(nbytes, stream, policy)  # type: ignore[no-any-return]
            return g._virtual_block(check_malloc(nbytes, stream, policy))

        tap = _taps[key] = [0, [_swap(pool, "malloc", malloc)]]
    tap[0] += 1

    def release() -> None:
        tap[0] -= 1
        if tap[0] == 0:
            for fn in reversed(tap[1]):
                fn()
            del _taps[key]

    return release


def _share() -> Callable[[], None]:
    """``Op._build_launch`` deferring for virtual operands and the other-stream check, while any capture runs."""
    if _shared["n"] == 0:
        plain = Op._build_launch

        def build_launch(op: Op, ex: Executor) -> Callable[[Any], None]:
            deferred = False
            for t in ex._tensors:
                if t is not None and type(t.block) is VirtualBlock and t.block.virtual:
                    if t.block.freed:  # as the plain build refuses it: the capture freed it already
                        raise InvalidStateError("tensor's block was freed", op=op.name, arg="operand", got=t.desc)
                    deferred = True
            return _deferred if deferred else plain(op, ex)

        Op._build_launch = build_launch  # type: ignore[method-assign, assignment]
        _shared["plain"] = plain
        _shared["hook"] = hooks.add_phase2_hook(before=_check_stream, after=_put_marks_back)
    _shared["n"] += 1

    def release() -> None:
        _shared["n"] -= 1
        if _shared["n"] == 0:
            Op._build_launch = _shared.pop("plain")  # type: ignore[method-assign]
            hooks.remove_hook(_shared.pop("hook"))

    return release


def _deferred(_: Any) -> None:
    raise CaptureError(
        "this executor is bound to tensors of a captured graph: its launch exists only in the "
        "instantiated graph (replay the graph, or bind real tensors)",
        op="phase 2",
        arg="executor",
    )


_marks = threading.local()  # (block, stream, seq) of a captured launch's blocks as they were before its phase 2


def _check_stream(op: Op, workspace: Any, size: int, executor: Any, stream: Any) -> None:
    g = _active.get(threading.get_ident())
    _marks.saved = None
    if g is not None and stream is g.stream:  # phase 2 marks the blocks with the capture's stand-in seq
        blocks = (*getattr(executor, "_blocks", ()), *((workspace,) if isinstance(workspace, Block) else ()))
        _marks.saved = (g, [(b, b._stream, b._seq) for b in blocks if not (type(b) is VirtualBlock and b.virtual)])
    if g is not None and stream is not g.stream:
        name = getattr(stream, "name", stream)
        raise CaptureError(
            f"launch on stream '{name}' while this thread captures stream '{g.stream.name}' "
            "(pass stream= the captured stream)",
            op=op.name,
            arg="stream",
            expected=g.stream.name,
            got=name,
        )


def _put_marks_back(op: Op, workspace: Any, size: int, executor: Any, stream: Any, t0: float, t1: float) -> None:
    """After a captured phase 2: its blocks' last use is again what it was before. The capture's mark (a seq of
    work before the capture, done or nearly) hid a real pending use, for the whole capture, from host reads, frees
    without a stream and another capture saving it as the block's own."""
    saved = getattr(_marks, "saved", None)
    if saved is None:
        return
    _marks.saved = None
    g, marks = saved
    for b, last, seq in marks:
        if b._stream is g.stream and b._seq == g._seq0:  # still the capture's mark
            b._stream, b._seq = last, seq
