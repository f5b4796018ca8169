"""Profiling: host times of both phases, kernel times measured on stream workers, and a Chrome trace
(open it in Perfetto). Off by default; it installs hooks (``twophase.hooks``), so when it is off the hot
path carries no check at all.

``profile()`` blocks may nest and may run at once on several threads: each one records every launch of the
process while it is active. The hooks are installed as the first block is entered and removed as the last
one is left (the active profilers count them, under a lock)."""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from . import hooks
from .errors import ParamError
from .op import Op
from .runtime import forking
from .runtime.device import _DEVICES
from .runtime.memory import POOL_LISTENERS, MemoryPool
from .runtime.stream import CONTROL, Stream, running_queue

__all__ = ["profile", "Profiler"]

# The active profilers, replaced (never changed in place) under _state_lock: the hooks iterate whichever tuple
# they read, while another thread enters or leaves a profile.
_active: tuple[Profiler, ...] = ()
_state_lock = threading.Lock()


class _Flow:
    """An arrow registered by the launch of an executor on a queue, before the launch: its id and the range of
    seqs its task may have, ``lo`` (the queue's next seq before the launch) to ``hi`` (its last seq once phase 2
    returned; None until then, and for a launch that was refused)."""

    __slots__ = ("fid", "lo", "hi")

    def __init__(self, fid: int, lo: int) -> None:
        self.fid = fid
        self.lo = lo
        self.hi: int | None = None


class Profiler:
    """Collects trace events while active; ``save(path)`` writes Chrome trace JSON."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        forking.locks_of(self, "_lock")  # a stream worker may hold it at a fork
        self._flow = itertools.count(1)
        # (queue, executor), both weakly -> the flows of its launches whose kernels have not run, oldest first
        self._pending_flows: dict[tuple[weakref.ref[Any], weakref.ref[Any]], collections.deque[_Flow]] = {}
        self._prune_at = 64  # entries from which a new one first drops those of collected executors or queues
        self._started: set[int] = set()  # flows whose start is written and whose end is not
        self._early: dict[int, dict[str, Any]] = {}  # ends of flows whose kernel ran before their start was written
        self._streams: dict[Any, tuple[int, str]] = {}  # stream queue -> (track id, track name)
        self._threads: dict[int, str] = {}

    def us(self, t: float) -> float:
        return (t - self.t0) * 1e6

    def _emit(self, ev: dict[str, Any]) -> None:
        with self._lock:
            self.events.append(ev)

    def host_span(self, name: str, cat: str, t0: float, t1: float, args: dict[str, Any]) -> None:
        tid = threading.get_ident()
        if tid not in self._threads:
            with self._lock:  # trace() reads it under the lock
                self._threads[tid] = threading.current_thread().name
        self._emit(
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "ts": self.us(t0),
                "dur": self.us(t1) - self.us(t0),
                "pid": 1,
                "tid": tid,
                "args": args,
            }
        )

    def enqueue(self, stream: Stream, executor: Any) -> tuple[dict[str, Any], _Flow]:
        """The start of the arrow to the kernel of this launch of ``executor``, registered now (the kernel may
        run before phase 2 returns) and written by :meth:`launched` once phase 2 has enqueued it (a refused one
        draws none).

        Its seq is not known until the stream has enqueued the task, and another thread launching on the same
        stream may take the next one first: the arrow is tied to the executor and its kernel finds it by its
        owner and its true seq (:meth:`kernel`). An executor is launched only by the thread that owns it, one
        launch after the other, and its kernels run in that order on one stream."""
        q = stream._q
        flow = _Flow(next(self._flow), q.submitted + 1)
        key = (weakref.ref(q), weakref.ref(executor))
        with self._lock:
            flows = self._pending_flows.get(key)
            if flows is None:
                if len(self._pending_flows) >= self._prune_at:
                    self._prune_flows()
                flows = self._pending_flows[key] = collections.deque()
            if flows and flows[-1].hi is None:
                flows.pop()  # the executor's last launch was refused: phase 2 never returned
            while flows and flows[0].hi is not None and flows[0].hi <= q.done:
                flows.popleft()  # launches whose task completed without running its kernel (dropped, failed)
            flows.append(flow)
        start = {"name": "launch", "cat": "flow", "ph": "s", "id": flow.fid, "pid": 1, "tid": threading.get_ident()}
        return start, flow

    def _prune_flows(self) -> None:
        """Drop the pending flows of executors or queues since collected (their kernels never ran: dropped after a
        failure); such an entry is never looked up again. Under the lock; amortized by doubling the threshold."""
        pending = self._pending_flows
        for key in [k for k in pending if k[0]() is None or k[1]() is None]:
            del pending[key]
        self._prune_at = max(64, 2 * len(pending))

    def launched(self, start: dict[str, Any], flow: _Flow, last_seq: int) -> None:
        """Phase 2 returned: the launch's task has a seq up to ``last_seq`` (the stream's last one)."""
        with self._lock:
            flow.hi = last_seq
            self.events.append(start)
            end = self._early.pop(start["id"], None)
            if end is not None:
                self.events.append(end)
            else:
                self._started.add(start["id"])

    def _track(self, stream_name: str) -> int:
        q = running_queue()
        with self._lock:
            track = self._streams.get(q)
            if track is None:  # one track per stream, even where two streams share a name
                same = sum(1 for _, name in self._streams.values() if name.split(" #")[0] == stream_name)
                track = self._streams[q] = (
                    1_000_000 + len(self._streams),
                    f"{stream_name} #{same + 1}" if same else stream_name,
                )
        return track[0]

    def kernel(self, stream_name: str, owner: Any, t0: float, t1: float, seq: int) -> None:
        tid = self._track(stream_name)
        op = getattr(owner, "op", None)
        name = op.name if op is not None else ("marker" if owner is CONTROL else str(owner))
        args = {"executor": owner.id, "implementation": owner.plan.implementation} if op is not None else {}
        self._emit(
            {
                "name": name,
                "cat": "kernel",
                "ph": "X",
                "ts": self.us(t0),
                "dur": self.us(t1) - self.us(t0),
                "pid": 1,
                "tid": tid,
                "args": args,
            }
        )
        fid = self._flow_of(owner, seq) if op is not None else None
        if fid is not None:
            end = {
                "name": "launch",
                "cat": "flow",
                "ph": "f",
                "bp": "e",
                "id": fid,
                "ts": self.us(t0),
                "pid": 1,
                "tid": tid,
            }
            with self._lock:
                if fid in self._started:
                    self._started.discard(fid)
                    self.events.append(end)
                else:
                    self._early[fid] = end

    def _flow_of(self, executor: Any, seq: int) -> int | None:
        """The id of the arrow of the launch of ``executor`` whose task ``seq`` on the running queue is (None if
        it has none: launched before the profile, or captured)."""
        q = running_queue()
        if q is None:
            return None
        key = (weakref.ref(q), weakref.ref(executor))
        with self._lock:
            flows = self._pending_flows.get(key)
            if not flows:
                return None
            fid = None
            while flows:
                head = flows[0]
                # its phase 2 still running (the kernel ran before it returned) or its task not before seq: the
                # launch of task seq, unless that one came before the profile (lo > seq: no arrow)
                if (len(flows) == 1) if head.hi is None else head.hi >= seq:
                    if head.lo <= seq:
                        fid = flows.popleft().fid
                    break
                # an earlier launch whose kernel never ran: its task came before seq (hi < seq), or it was
                # refused (hi None, and a later launch of the executor came after it)
                flows.popleft()
            if not flows:
                del self._pending_flows[key]
            return fid

    def pool(self, pool: MemoryPool) -> None:
        st = pool.stats()
        self._emit(
            {
                "name": pool.name,
                "ph": "C",
                "ts": self.us(time.perf_counter()),
                "pid": 1,
                "args": {"allocated": st["allocated_bytes"], "reserved": st["reserved_bytes"]},
            }
        )

    def trace(self) -> dict[str, Any]:
        meta: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "twophase"}}]
        with self._lock:  # an arrow whose kernel never ran (it failed, or is still queued) has no end: left out
            for tid, name in self._threads.items():
                meta.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": f"host {name}"}})
            for tid, name in self._streams.values():
                meta.append(
                    {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": f"stream {name}"}}
                )
            events = [e for e in self.events if e.get("ph") != "s" or e["id"] not in self._started]
            return {"traceEvents": meta + events, "displayTimeUnit": "ms"}

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            json.dump(self.trace(), f)


def _phase1_done(op: Op, inputs: Any, kwargs: Any, result: Any, t0: float, t1: float) -> None:
    op.counters.phase1_time += t1 - t0
    op.counters.phase1_timed += 1
    for p in _active:
        p.host_span(
            f"phase1 {op.name}", "phase1", t0, t1, {"workspace": result[0], "implementation": result[1].implementation}
        )


_flow_starts = threading.local()


def _phase2_start(op: Op, workspace: Any, size: int, executor: Any, stream: Stream) -> None:
    # the flow is registered before the launch: the kernel may finish before phase 2 returns (launch
    # blocking runs it inline, a fast worker may too) and it looks its flow up when it finishes
    q = getattr(stream, "_q", None)
    if (
        q is None
        or getattr(q, "_capturing", False)  # recorded into a graph, never run as such: no arrow
        or getattr(executor, "_owner", None) != threading.get_ident()  # refused: not this thread's executor
    ):
        _flow_starts.evs = []
        return
    _flow_starts.evs = [(p, *p.enqueue(stream, executor)) for p in _active]


def _phase2_done(op: Op, workspace: Any, size: int, executor: Any, stream: Stream, t0: float, t1: float) -> None:
    c = op.counters
    c.phase2_time += t1 - t0
    c.phase2_timed += 1
    for p in _active:
        p.host_span(f"phase2 {op.name}", "phase2", t0, t1, {"executor": executor.id, "stream": stream.name})
    evs = getattr(_flow_starts, "evs", ())
    if evs:
        last_seq = stream._q.submitted  # read after the enqueue: at least this launch's seq
        for p, ev, flow in evs:
            ev["ts"] = p.us(t0)  # start the arrow inside the phase 2 span it was launched from
            p.launched(ev, flow, last_seq)
    _flow_starts.evs = []


def _listen(name: str, owner: Any, t0: float, t1: float, seq: int) -> None:
    for p in _active:
        p.kernel(name, owner, t0, t1, seq)
    op = getattr(owner, "op", None)
    if op is not None:  # once per kernel, however many profiles are active
        c = op.counters
        c.kernel_time += t1 - t0
        c.kernel_count += 1


def _on_pool_change(pool: MemoryPool) -> None:
    for p in _active:
        p.pool(pool)


_handles: list[Any] = []


def _enable() -> None:
    _handles.append(hooks.add_phase1_hook(_phase1_done))
    _handles.append(hooks.add_phase2_hook(before=_phase2_start, after=_phase2_done))
    hooks.add_task_listener(_listen)
    POOL_LISTENERS.append(_on_pool_change)


def _disable() -> None:
    while _handles:
        hooks.remove_hook(_handles.pop())
    hooks.remove_task_listener(_listen)
    POOL_LISTENERS.remove(_on_pool_change)


def check_trace_path(path: object) -> None:
    """ParamError unless ``path`` names a file that can be written (it is created, empty)."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ParamError(op="profile", arg="path", expected="None or a file name (str or os.PathLike)", got=path)
    try:
        with open(path, "w") as f:  # a byte written and flushed: a file that opens but cannot be written (a full
            f.write("{")  # disk, /dev/full) fails now, not when the trace is saved after the run
            f.flush()
        with open(path, "w"):
            pass
    except OSError as e:
        raise ParamError(
            op="profile",
            arg="path",
            expected="a file that can be written",
            got=f"{os.fspath(path)!r} ({e.strerror or e})",
        ) from None


@contextlib.contextmanager
def profile(path: str | os.PathLike[str] | None = None) -> Iterator[Profiler]:
    """Profile the block: per-op phase times and kernel times in the counters, and (with ``path``) a Chrome
    trace with host spans, per-stream kernel spans, enqueue→kernel flow arrows and a pool counter track.
    Streams are synchronized on exit so every kernel span is recorded. ``path`` is checked before the block
    runs (a path that cannot be written lost the whole profile at the end)."""
    global _active
    if path is not None:
        check_trace_path(path)
    prof = Profiler()
    with _state_lock:  # another thread may enter or leave a profile at once: one of them installs the hooks
        if not _active:
            _enable()
        _active = (*_active, prof)
    try:
        yield prof
    finally:
        for dev in list(_DEVICES.values()):
            dev._drain()  # a kernel's error stays pending for the caller's own sync
        with _state_lock:
            _active = tuple(p for p in _active if p is not prof)
            if not _active:
                _disable()
        if path is not None:
            prof.save(path)
