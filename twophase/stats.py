"""Counters, always on and cheap: per op and per device. Phase 2 counts nothing: an executor's
``launches`` goes up on the stream worker once its task has run; everything else is counted in phase 1,
at executor release, or derived when a snapshot is taken (exact once the streams are synchronized).

Threads count into the same counters without a lock: every update is one read-modify-write of an attribute
or a list item with no call in between (``c.created += 1``, ``c.workspace[i] += 1``), which the GIL never
interrupts, so concurrent updates add up exactly. A snapshot or a reset reads the executors still live
through one copy of their set made in C (``list(set)``), never by iterating it while other threads add or
remove executors."""

from __future__ import annotations

import json
import threading
import weakref
from typing import TYPE_CHECKING, Any

from .errors import ParamError

if TYPE_CHECKING:
    from .executor import Executor

__all__ = ["OpCounters", "snapshot", "report", "reset", "bucket", "means", "us"]


def bucket(n: int) -> int:
    """Power-of-two histogram bucket: 0 for 0, else the smallest power of two >= n."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


# A histogram is a list of counts, one slot per bucket: slot 0 for bucket 0, slot k + 1 for bucket 2**k
# (slot ``(n - 1).bit_length() + 1`` for n > 0). Counting is ``hist[slot] += 1``: no dict.get() call between
# the read and the write, where a thread switch would lose the other thread's count.
_SLOTS = 66  # buckets 0, 1, 2, 4, ..., 2**64; a larger one grows the list (_count_slow)
_grow_lock = threading.Lock()
_retiring_lock = threading.Lock()  # guards every OpCounters.retiring (rarely taken: see on_release)


def _slot(n: int) -> int:
    """The histogram slot of ``n``: that of its bucket (``bucket(n)``)."""
    return (n - 1).bit_length() + 1 if n > 0 else 0


def _slot_bucket(i: int) -> int:
    return 0 if i == 0 else 1 << (i - 1)


def _count_in(hist: list[int], n: int) -> None:
    """One more ``n`` in histogram ``hist``."""
    i = _slot(n)
    try:
        hist[i] += 1
    except IndexError:
        _count_slow(hist, i)


def _count_slow(hist: list[int], i: int) -> None:
    """``hist[i] += 1`` for a slot past the end of ``hist`` (a bucket above 2**64): the list grows first."""
    with _grow_lock:
        if len(hist) <= i:
            hist.extend([0] * (i + 1 - len(hist)))
        hist[i] += 1


def _histogram(hist: list[int]) -> dict[str, int]:
    return {str(_slot_bucket(i)): v for i, v in enumerate(hist) if v}


class OpCounters:
    """Counters of one op. ``live`` holds the executors not yet released (weakly); ``reuse`` and ``workspace``
    are histograms, lists of counts indexed by bucket slot (see ``_SLOTS``)."""

    __slots__ = (
        "phase1",
        "hits",
        "misses",
        "created",
        "destroyed",
        "retired_launches",
        "reuse",
        "workspace",
        "max_workspace",
        "live",
        "retiring",
        "phase1_time",
        "phase2_time",
        "kernel_time",
        "kernel_count",
        "phase2_timed",
        "phase1_timed",
    )

    def __init__(self) -> None:
        self.live: weakref.WeakSet[Executor] = weakref.WeakSet()
        self.reset()

    def reset(self) -> None:
        with _retiring_lock:
            self.retiring: list[tuple[Executor, Any, int]] = []
        self.phase1 = self.hits = self.misses = 0
        self.created = self.destroyed = self.retired_launches = 0
        self.reuse: list[int] = [0] * _SLOTS
        self.workspace: list[int] = [0] * _SLOTS
        self.max_workspace = 0
        self.phase1_time = self.phase2_time = self.kernel_time = 0.0
        self.kernel_count = self.phase2_timed = self.phase1_timed = 0
        # executors still alive carry into the new period, so that created == destroyed + live + dropped holds
        for ex in self.live_executors():
            ex.launches = 0
            self.on_create(ex)

    def live_executors(self) -> list[Executor]:
        """The executors not yet released, from one copy of the set of their references made in C: iterating the
        WeakSet itself raises (set changed size during iteration) if another thread adds or removes one meanwhile."""
        refs: list[weakref.ref[Executor]] = list(self.live.data)  # type: ignore[attr-defined]
        return [ex for ex in (r() for r in refs) if ex is not None]

    def on_create(self, ex: Executor) -> None:
        self.created += 1
        self.live.add(ex)
        n = ex.workspace_size
        _count_in(self.workspace, n)
        if n > self.max_workspace:
            self.max_workspace = n

    def on_release(self, ex: Executor) -> None:
        self.destroyed += 1
        self.live.discard(ex)
        if ex._repeatable:  # destroyed with launches still queued (close(sync=False)): counted once they ran
            for b in ex._blocks:
                s = b._stream
                if s is not None and b.in_use():
                    with _retiring_lock:
                        self.retiring.append((ex, s._q, b._seq))
                    self._settle()
                    return
        self._retire(ex.phase2_calls)

    def _retire(self, n: int) -> None:
        self.retired_launches += n
        _count_in(self.reuse, n)

    def _settle(self) -> list[Executor]:
        """Retire the destroyed executors whose queued launches have all run; returns those still waiting."""
        with _retiring_lock:
            done = [r for r in self.retiring if r[1].done >= r[2]]
            if done:
                self.retiring = [r for r in self.retiring if r[1].done < r[2]]
            waiting = [r[0] for r in self.retiring]
        for ex, _, _ in done:
            self._retire(ex.launches)
        return waiting

    def as_dict(self) -> dict[str, Any]:
        live = self.live_executors()
        counting = live + self._settle()  # a retiring executor's launches so far count as a live one's
        reuse = list(self.reuse)  # copies made in C: other threads go on counting meanwhile
        workspace = list(self.workspace)
        for ex in counting:
            n = ex.launches
            i = _slot(n)
            if i >= len(reuse):
                reuse.extend([0] * (i + 1 - len(reuse)))
            reuse[i] += 1
        return {
            "phase1_calls": self.phase1,
            "cache_hits": self.hits,
            "cache_misses": self.misses,
            "phase2_calls": self.retired_launches + sum(ex.launches for ex in counting),
            "executors_created": self.created,
            "executors_destroyed": self.destroyed,
            "executors_live": len(live),
            "executors_dropped": self.created - self.destroyed - len(live),  # collected without release
            "max_workspace_bytes": self.max_workspace,
            "reuse_histogram": _histogram(reuse),
            "workspace_histogram": _histogram(workspace),
            "phase1_time_s": self.phase1_time,
            "phase1_timed_calls": self.phase1_timed,
            "phase2_time_s": self.phase2_time,
            "phase2_timed_calls": self.phase2_timed,
            "kernel_time_s": self.kernel_time,
            "kernel_count": self.kernel_count,
        }


def snapshot() -> dict[str, Any]:
    """Every counter as plain JSON-serialisable data: ``{"ops": {name: {...}}, "devices": {name: pool stats}}``."""
    from .op import registry
    from .runtime.device import _DEVICES

    ops = {
        name: op.counters.as_dict()
        for name, op in sorted(registry.items())
        if op.counters.phase1 or op.counters.live or op.counters.created or op.counters.destroyed
    }
    devices = {name: dev.pool.stats() for name, dev in sorted(_DEVICES.items())}
    data = {"ops": ops, "devices": devices}
    json.dumps(data)  # guarantee: plain data only
    return data


def reset() -> None:
    """Zero every op counter and the pools' peak watermarks (a launch still pending is counted after it)."""
    from .op import registry
    from .runtime.device import _DEVICES

    for op in list(registry.values()):  # copies: another thread may register an op or open a device meanwhile
        op.counters.reset()
    for dev in list(_DEVICES.values()):
        dev.pool.reset_peak()


def means(c: dict[str, Any]) -> tuple[float | None, float | None, float | None, int]:
    """(phase-1 us, phase-2 us, kernel us) per timed call (None: nothing was timed, as outside ``profile()``)
    and the largest workspace in bytes of one op's snapshot."""
    p1 = c["phase1_time_s"] / c["phase1_timed_calls"] * 1e6 if c["phase1_timed_calls"] else None
    p2 = c["phase2_time_s"] / c["phase2_timed_calls"] * 1e6 if c["phase2_timed_calls"] else None
    k = c["kernel_time_s"] / c["kernel_count"] * 1e6 if c["kernel_count"] else None
    return p1, p2, k, c["max_workspace_bytes"]


def us(t: float | None, width: int, digits: int = 1) -> str:
    """A mean time for a table column: '-' where nothing was timed (a 0.0 would read as measured)."""
    return f"{'-':>{width}}" if t is None else f"{t:>{width}.{digits}f}"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def report(file: Any = None) -> str:
    """Print (and return) a table of the per-op counters and the pool watermarks (to ``file``, default stdout)."""
    if file is not None and not callable(getattr(file, "write", None)):
        raise ParamError(
            op="stats.report", arg="file", expected="None or a text file (with write())", got=type(file).__name__
        )
    snap = snapshot()
    head = (
        f"{'op':<28}{'phase1':>8}{'hits':>8}{'miss':>6}{'phase2':>9}{'live':>6}"
        f"{'p1 us':>9}{'p2 us':>8}{'kern us':>9}  max workspace"
    )
    lines = [head, "-" * len(head)]
    for name, c in snap["ops"].items():
        p1, p2, k, ws = means(c)
        lines.append(
            f"{name:<28}{c['phase1_calls']:>8}{c['cache_hits']:>8}{c['cache_misses']:>6}"
            f"{c['phase2_calls']:>9}{c['executors_live']:>6}{us(p1, 9)}{us(p2, 8, 2)}{us(k, 9)}  "
            f"{_fmt_bytes(ws)}"
        )
    for name, p in snap["devices"].items():
        lines.append(
            f"device {name}: allocated {_fmt_bytes(p['allocated_bytes'])}, reserved "
            f"{_fmt_bytes(p['reserved_bytes'])}, peak allocated {_fmt_bytes(p['peak_allocated_bytes'])}, "
            f"peak reserved {_fmt_bytes(p['peak_reserved_bytes'])}"
        )
    text = "\n".join(lines)
    print(text, file=file)
    return text
