"""Shared benchmark helpers: interleaved A/B timing (the machines drift, so ratios are taken per round)."""

from __future__ import annotations

import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def header(title: str) -> str:
    """Machine, versions and the OpenBLAS settings in force (never changed by the suite)."""
    import numba
    lines = [
        f"# {title}",
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus; python "
        f"{platform.python_version()}; numpy {np.__version__}; numba {numba.__version__}",
        f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')} "
        f"OPENBLAS_L2_SIZE={os.environ.get('OPENBLAS_L2_SIZE', '(unset)')}",
    ]
    return "\n".join(lines)


SETTLE_S = 0.02  # longer than libgomp's spin after a parallel region on these machines (measured: 3-10 ms)


def settle(fn: Callable[[], object]) -> None:
    """Start a timing from the same state for every library: a pause in which other libraries' idle workers
    stop spinning (torch's OpenMP and ONNX Runtime's pools spin for milliseconds after each call, on the cores
    the next library needs), then one untimed call of ``fn`` that wakes its own workers."""
    time.sleep(SETTLE_S)
    fn()


def per_call(fn: Callable[[], object], n: int) -> float:
    """Seconds per call of ``fn`` over ``n`` calls."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def _round_robin(fns: dict[str, Callable[[], object]], n: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each function in each round, each timing ``settle``d first."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            settle(fn)
            times[k].append(per_call(fn, n))
    return times


def interleaved(fns: dict[str, Callable[[], object]], n: int, rounds: int = 7) -> dict[str, float]:
    """Median seconds per call of each function, measured round-robin so drift hits all alike."""
    return {k: statistics.median(v) for k, v in _round_robin(fns, n, rounds).items()}


def interleaved_ratios(fns: dict[str, Callable[[], object]], ref: str, n: int,
                       rounds: int = 7) -> tuple[dict[str, float], dict[str, float]]:
    """(median seconds per call, median over rounds of t(fn) / t(ref) within the same round) of each function,
    measured round-robin: a ratio pairs times taken moments apart, so drift between rounds cancels."""
    times = _round_robin(fns, n, rounds)
    ratios = {k: statistics.median(a / b for a, b in zip(v, times[ref], strict=True)) for k, v in times.items()}
    return {k: statistics.median(v) for k, v in times.items()}, ratios


def median_ratio(a: Callable[[], float], b: Callable[[], float], rounds: int = 7) -> tuple[float, float, float]:
    """Median over rounds of a()/b(), where each call returns one measured time: (ratio, a, b)."""
    ra, rb, rr = [], [], []
    for _ in range(rounds):
        ta, tb = a(), b()
        ra.append(ta)
        rb.append(tb)
        rr.append(ta / tb)
    return statistics.median(rr), statistics.median(ra), statistics.median(rb)


def parked(stream: Any, fn: Callable[[], object], n: int) -> float:
    """Seconds per ``fn`` call while ``stream``'s worker is parked, so only the host side (the enqueue) is
    timed; the queued work runs afterwards."""
    gate = threading.Event()
    stream.launch_callback(gate.wait)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n
    gate.set()
    stream.synchronize()
    return dt
