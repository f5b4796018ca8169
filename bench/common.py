"""Shared benchmark helpers: interleaved A/B timing (the machines drift, so ratios are taken per round), the
header every module prints (machine, ISA, versions, the OpenBLAS state in force, the commit measured) and the
check that both sides of a row compute the same result."""

from __future__ import annotations

import ctypes
import os
import platform
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

# the direction every ratio header states, so a reader (and report.py's plot colours) knows which way is faster
LOWER_FASTER = "< 1: twophase faster"
HIGHER_FASTER = "> 1: twophase faster"


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (key -> value), empty where there is no such file."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The processor's name from /proc/cpuinfo (``platform.processor()`` is empty on Linux), with its family and
    model numbers and the CPU LLVM tunes numba's kernels for: a VM may name only the vendor ("AMD EPYC"), while
    Zen 4 (family 25) runs a 512-bit FMA as two 256-bit halves and Zen 5 (family 26) at once, which moves every
    ratio against libraries that pick their kernels by CPU."""
    fields = _cpuinfo()
    name = fields.get("model name") or platform.processor() or platform.machine()
    ids = [f"{k} {fields[k]}" for k in ("cpu family", "model") if k in fields]
    return f"{name} ({'; '.join([*ids, f'LLVM {_llvm_cpu()}'])})"


def _llvm_cpu() -> str:
    """The host CPU name LLVM (numba's compiler) detects, or "unknown"."""
    try:
        import llvmlite.binding as llvm

        return str(llvm.get_host_cpu_name())
    except (ImportError, RuntimeError):
        return "unknown"


def isa() -> str:
    """The vector ISA the kernels can use (AVX-512 or not decides implementations such as the microkernel)."""
    fields = _cpuinfo()
    if not fields:
        return "ISA unknown"
    flags = fields.get("flags", "").split()
    have = [f for f in ("avx512f", "avx2", "fma") if f in flags]
    return "ISA " + ("+".join(have) if have else "no avx2") + ("" if "avx512f" in flags else " (no avx512f)")


def git_state() -> str:
    """The commit measured, and whether the tree differs from it (bench/results/ not counted)."""
    try:
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", ".", ":(exclude)bench/results"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "commit: n/a (not a git checkout)"
    if not changed:
        return f"commit {rev} (clean tree)"
    return (
        f"commit {rev} + uncommitted changes ({len(changed)} paths differ from it, bench/results/ not counted: "
        "the figures describe the working tree, not the commit alone)"
    )


def _blas_call(names: tuple[str, ...], restype: Any) -> Any:
    """The first of ``names`` found in numpy's OpenBLAS, called with no arguments; None when none is there."""
    from twophase.kernels.cpu import blas

    for name in names:
        found = blas._functions(name)
        if found is not None:
            fn = found[0]
            fn.restype = restype
            return fn()
    return None


def openblas_state() -> str:
    """numpy's OpenBLAS as it runs in this process (numpy's baselines and twophase's BLAS calls alike): its core,
    threads, and the thread timeout read from the library."""
    import twophase as tp

    tp.device("cpu")
    timeout = _blas_call(("openblas_thread_timeout",), ctypes.c_int)
    threads = _blas_call(
        ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads"), ctypes.c_int
    )
    core = _blas_call(
        ("scipy_openblas_get_corename64_", "openblas_get_corename64_", "openblas_get_corename"), ctypes.c_char_p
    )
    if timeout is None and threads is None and core is None:
        return "numpy's OpenBLAS: state not readable (not numpy's bundled OpenBLAS)"
    by_user = [v for v in ("OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT") if v in os.environ]
    who = (
        f"as {by_user[0]}={os.environ[by_user[0]]} sets it; OpenBLAS's default, which twophase leaves in force, is 28"
        if by_user
        else "0 = OpenBLAS's default, 28"
        if timeout == 0
        else ""
    )
    return (
        f"numpy's OpenBLAS in force (after twophase.device('cpu'); numpy's baselines run with it): core "
        f"{core.decode() if core else 'n/a'}, {threads if threads is not None else 'n/a'} threads, thread "
        f"timeout {timeout if timeout is not None else 'n/a'} (idle workers spin 2^timeout cycles; {who})"
    )


def header(title: str) -> str:
    """Machine, ISA, versions, the OPENBLAS_* variables and the OpenBLAS state in force, and the commit
    measured."""
    import numba

    lines = [
        f"# {title}",
        f"machine: {platform.machine()} {cpu_model()}, {isa()}, {os.cpu_count()} cpus; python "
        f"{platform.python_version()}; numpy {np.__version__}; numba {numba.__version__}; {git_state()}",
        f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')} "
        f"OPENBLAS_L2_SIZE={os.environ.get('OPENBLAS_L2_SIZE', '(unset)')} "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(unset)')}; {openblas_state()}",
    ]
    return "\n".join(lines)


SETTLE_S = 0.02  # longer than libgomp's spin after a parallel region on these machines (measured: 3-10 ms)
# numpy's OpenBLAS at its default timeout spins 2^28 cycles (~0.1 s) after a threaded GEMM: a settle waits for
# such a thread up to this long in all
SETTLE_MAX_S = 0.25
_POLL_S = 0.002


def others_running() -> bool:
    """Whether a thread of this process other than the caller is running or runnable (state R in
    /proc/self/task: a worker spinning for its next job, sched_yield or not); False where /proc cannot say."""
    me = str(threading.get_native_id())
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended
        if state == "R":
            return True
    return False


def pause() -> None:
    """The pause before a timing: ``SETTLE_S``, and then as long as another thread of the process still runs
    (at most ``SETTLE_MAX_S`` in all), so that no library's idle workers spin into the next one's timing."""
    t0 = time.perf_counter()
    time.sleep(SETTLE_S)
    while others_running() and time.perf_counter() - t0 < SETTLE_MAX_S:
        time.sleep(_POLL_S)


def settle(fn: Callable[[], object]) -> None:
    """Start a timing from the same state for every library: a pause in which other libraries' idle workers
    stop spinning (torch's OpenMP and ONNX Runtime's pools spin for milliseconds after each call, numpy's
    OpenBLAS ~0.1 s, on the cores the next library needs), then one untimed call of ``fn`` that wakes its own
    workers."""
    pause()
    fn()


def per_call(fn: Callable[[], object], n: int) -> float:
    """Seconds per call of ``fn`` over ``n`` calls."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def rotated(names: list[str], r: int) -> list[str]:
    """``names`` starting at the ``r``-th (mod len): round ``r``'s order, so no side always follows the same one."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def interleaved_times(fns: dict[str, Callable[[], object]], n: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each function in each round, each timing ``settle``d first; the functions run
    round-robin, each round starting one function later."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        for k in rotated(list(fns), r):
            settle(fns[k])
            times[k].append(per_call(fns[k], n))
    return times


def round_ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of t(a) / t(b) taken in the same round."""
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


def interleaved(fns: dict[str, Callable[[], object]], n: int, rounds: int = 7) -> dict[str, float]:
    """Median seconds per call of each function, measured round-robin so drift hits all alike."""
    return {k: statistics.median(v) for k, v in interleaved_times(fns, n, rounds).items()}


def interleaved_ratios(
    fns: dict[str, Callable[[], object]], ref: str, n: int, rounds: int = 7
) -> tuple[dict[str, float], dict[str, float]]:
    """(median seconds per call, median over rounds of t(fn) / t(ref) within the same round) of each function,
    measured round-robin: a ratio pairs times taken moments apart, so drift between rounds cancels."""
    times = interleaved_times(fns, n, rounds)
    return {k: statistics.median(v) for k, v in times.items()}, {k: round_ratio(times, k, ref) for k in times}


def median_ratio(a: Callable[[], float], b: Callable[[], float], rounds: int = 7) -> tuple[float, float, float]:
    """Median over rounds of a()/b(), where each call returns one measured time: (ratio, a, b). Each call
    starts after the ``settle`` pause (no untimed call: each already runs hundreds of calls), and the two
    alternate which goes first."""
    ra, rb, rr = [], [], []
    for r in range(rounds):
        got: dict[int, float] = {}
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            pause()
            got[i] = (a, b)[i]()
        ra.append(got[0])
        rb.append(got[1])
        rr.append(got[0] / got[1])
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


def assert_same(what: str, got: Any, want: Any, rel: float = 1e-4) -> None:
    """Raise unless ``got`` equals ``want`` (same shape; integers exactly, floats within ``rel`` times the
    largest magnitude of ``want``): a row whose two sides compute different things times nothing comparable."""
    g, w = np.asarray(got), np.asarray(want)
    if g.shape != w.shape:
        raise AssertionError(f"{what}: shapes differ, {g.shape} vs {w.shape}")
    if g.dtype.kind in "iub" and w.dtype.kind in "iub":
        if not np.array_equal(g, w):
            raise AssertionError(f"{what}: {int(np.count_nonzero(g != w))} of {g.size} values differ")
        return
    g64, w64 = g.astype(np.float64), w.astype(np.float64)
    fin = np.isfinite(w64)
    if not (np.array_equal(g64[~fin], w64[~fin], equal_nan=True) and np.isfinite(g64[fin]).all()):
        raise AssertionError(f"{what}: NaN / inf values differ")
    scale = float(np.max(np.abs(w64[fin]))) if fin.any() else 0.0
    err = float(np.max(np.abs(g64[fin] - w64[fin]))) if fin.any() else 0.0
    if err > rel * max(scale, float(np.finfo(np.float32).tiny)):
        raise AssertionError(f"{what}: max abs error {err:.3g} exceeds {rel:g} x max |reference| {scale:.3g}")


def releaser(stream: Any, ws: Any, tensors: list[Any], ex: Any = None) -> Callable[[], None]:
    """What frees a row's twophase side: destroys ``ex``, frees ``ws`` and ``tensors`` in ``stream``'s order and
    closes the stream, so a row's pool memory is not held through the rest of the suite."""

    def release() -> None:
        stream.synchronize()
        if ex is not None:
            ex.destroy()
        ws.free(stream)
        for t in tensors:
            t.free(stream)
        stream.close()

    return release
