"""Counters, always on and cheap: per op and per device. Phase 2 counts nothing: an executor's
``launches`` goes up on the stream worker once its task has run; everything else is counted in phase 1,
at executor release, or derived when a snapshot is taken (exact once the streams are synchronized)."""

from __future__ import annotations

import json
import weakref
from typing import TYPE_CHECKING, Any

from .errors import ParamError

if TYPE_CHECKING:
    from .executor import Executor

__all__ = ["OpCounters", "snapshot", "report", "reset", "bucket", "means", "us"]


def bucket(n: int) -> int:
    """Power-of-two histogram bucket: 0 for 0, else the smallest power of two >= n."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


class OpCounters:
    """Counters of one op. ``live`` holds the executors not yet released (weakly)."""

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
        self.phase1 = self.hits = self.misses = 0
        self.created = self.destroyed = self.retired_launches = 0
        self.reuse: dict[int, int] = {}
        self.workspace: dict[int, int] = {}
        self.max_workspace = 0
        self.phase1_time = self.phase2_time = self.kernel_time = 0.0
        self.kernel_count = self.phase2_timed = self.phase1_timed = 0
        # executors still alive carry into the new period, so that created == destroyed + live + dropped holds
        for ex in list(self.live):
            ex.launches = 0
            self.on_create(ex)

    def on_create(self, ex: Executor) -> None:
        self.created += 1
        self.live.add(ex)
        n = ex.workspace_size
        b = bucket(n)
        self.workspace[b] = self.workspace.get(b, 0) + 1
        if n > self.max_workspace:
            self.max_workspace = n

    def on_release(self, ex: Executor) -> None:
        n = ex.phase2_calls
        self.destroyed += 1
        self.retired_launches += n
        b = bucket(n)
        self.reuse[b] = self.reuse.get(b, 0) + 1
        self.live.discard(ex)

    def as_dict(self) -> dict[str, Any]:
        live = list(self.live)
        reuse = dict(self.reuse)
        for ex in live:
            b = bucket(ex.launches)
            reuse[b] = reuse.get(b, 0) + 1
        return {
            "phase1_calls": self.phase1,
            "cache_hits": self.hits,
            "cache_misses": self.misses,
            "phase2_calls": self.retired_launches + sum(ex.launches for ex in live),
            "executors_created": self.created,
            "executors_destroyed": self.destroyed,
            "executors_live": len(live),
            "executors_dropped": self.created - self.destroyed - len(live),  # collected without release
            "max_workspace_bytes": self.max_workspace,
            "reuse_histogram": {str(k): v for k, v in sorted(reuse.items())},
            "workspace_histogram": {str(k): v for k, v in sorted(self.workspace.items())},
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

    for op in registry.values():
        op.counters.reset()
    for dev in _DEVICES.values():
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
