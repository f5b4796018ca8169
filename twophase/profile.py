"""Profiling: host times of both phases, kernel times measured on stream workers, and a Chrome trace
(open it in Perfetto). Off by default; it installs hooks (``twophase.hooks``), so when it is off the hot
path carries no check at all."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from . import hooks
from .errors import ParamError
from .op import Op
from .runtime import forking
from .runtime.device import _DEVICES
from .runtime.memory import POOL_LISTENERS, MemoryPool
from .runtime.stream import CONTROL, Stream, TaskRecords, running_queue

__all__ = ["profile", "Profiler"]

_active: list[Profiler] = []


class Profiler:
    """Collects trace events while active; ``save(path)`` writes Chrome trace JSON."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        forking.locks_of(self, "_lock")  # a stream worker may hold it at a fork
        self._flow = itertools.count(1)
        self._pending_flows: TaskRecords[int] = TaskRecords()
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
        self._threads.setdefault(tid, threading.current_thread().name)
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

    def enqueue(self, stream: Stream, seq: int) -> dict[str, Any]:
        """The start of the arrow to task ``seq``'s kernel, registered now (the kernel may run before phase 2
        returns) and written by :meth:`launched` once phase 2 has enqueued it (a refused one draws none)."""
        fid = next(self._flow)
        self._pending_flows.put(stream._q, seq, fid)
        return {"name": "launch", "cat": "flow", "ph": "s", "id": fid, "pid": 1, "tid": threading.get_ident()}

    def launched(self, start: dict[str, Any]) -> None:
        with self._lock:
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
        fid = self._pending_flows.pop(running_queue(), seq)
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
        for tid, name in self._threads.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": f"host {name}"}})
        for tid, name in list(self._streams.values()):
            meta.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": f"stream {name}"}})
        with self._lock:  # an arrow whose kernel never ran (it failed, or is still queued) has no end: left out
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
    q = stream._q
    if getattr(q, "_capturing", False):  # recorded into a graph, never run as such: no arrow
        _flow_starts.evs = []
        return
    _flow_starts.evs = [(p, p.enqueue(stream, q.submitted + 1)) for p in _active]


def _phase2_done(op: Op, workspace: Any, size: int, executor: Any, stream: Stream, t0: float, t1: float) -> None:
    c = op.counters
    c.phase2_time += t1 - t0
    c.phase2_timed += 1
    for p in _active:
        p.host_span(f"phase2 {op.name}", "phase2", t0, t1, {"executor": executor.id, "stream": stream.name})
    for p, ev in getattr(_flow_starts, "evs", ()):
        ev["ts"] = p.us(t0)  # start the arrow inside the phase 2 span it was launched from
        p.launched(ev)
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
    if path is not None:
        check_trace_path(path)
    prof = Profiler()
    if not _active:
        _enable()
    _active.append(prof)
    try:
        yield prof
    finally:
        for dev in list(_DEVICES.values()):
            dev._drain()  # a kernel's error stays pending for the caller's own sync
        _active.remove(prof)
        if not _active:
            _disable()
        if path is not None:
            prof.save(path)
