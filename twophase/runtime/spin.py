"""Short spins, without the GIL, on counters in memory that other threads change.

:func:`~twophase.runtime.fanout.run_parts` spins for the parts of a launch that helper threads are finishing:
waking a thread blocked on a lock took 25-40 us on earlier machines and 43 us median (90 us p90) on a 2-vCPU
Xeon VM, a spin sees the count at once. A helper counts its parts from compiled code
(:func:`count_and_wait`) as it goes back to spinning for the next launch on the count of jobs posted, so the
launching thread sees them done only when the helper no longer holds the GIL, and never sleeps waiting for
it. The spins run in ``nogil`` numba loops, give up after a bounded time (the caller then blocks as before)
and yield the core every :data:`YIELD_US` while waiting for a launch (``fanout._Helpers``). A thread that saw
a launch waits a little longer before it takes the GIL, until the launching thread has opened a gate (a counter
it sets as it lets go of the GIL), so that it does not sleep on a GIL that is about to be released.
"""

from __future__ import annotations

import functools
import platform
import time
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

__all__ = ["GATE_US", "SETTLE_US", "SPIN_US", "count_and_wait", "spin_until_reached", "spin_until_total"]

SPIN_US = 100.0
YIELD_US = 20.0
# spins a helper waits once it saw a launch posted, before it returns to Python for the GIL: the launching thread
# holds the GIL ~10 us more (claiming its part, numba's dispatch), and a thread that finds the GIL taken sleeps
# until it is signalled (a wake-up took 43 us median, 90 us p90, on the twenty-second session's 2-vCPU Xeon VM).
# Two 128x384x192 GEMM parts: the helper started 26-30 us after the launch with it, 50-69 us without
# (/tmp/w22/par4.py).
SETTLE_US = 15.0
# A gate shortens that wait (``fanout.run_parts``): the launching thread raises it just before it calls its own
# part, whose entry then lets go of the GIL within ~1-2 us, so a helper waits GATE_US after it opens (SETTLE_US
# in all at most). Two ~32 us GEMM parts: the helper started 17-19 us after the launch against 26-27 with the
# settle alone (/tmp/w30/tl.py, alternating processes, thirtieth session). ``bench.bench_core`` (gates section)
# times launch + sync with and without: a 4x16 gelu on a stream 0.49-0.55 of the time with the gates shut, a
# 64x384x192 matmul in 2 parts 0.98-1.01 (the ~8 us lost in the noise of ~120 us).
GATE_US = 2.0
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _load_acquire_typing(typingctx: Any, addr: Any) -> Any:
    """The int64 at address ``addr``, read with acquire ordering (never hoisted out of the loop)."""
    sig = types.int64(types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


def _pause_typing(typingctx: Any) -> Any:
    """x86's ``pause`` (the spin-wait hint: less power, no memory-order mis-speculation on exit); elsewhere
    nothing."""
    sig = types.void()

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        if _X86:
            fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause"
            )
            builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


def _add_release_typing(typingctx: Any, addr: Any, value: Any) -> Any:
    """Add ``value`` to the int64 at address ``addr``, stored with release ordering (what this thread wrote
    before is visible to a thread that reads the sum with acquire ordering). Not atomic: one writer per slot."""
    sig = types.void(types.int64, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        old = builder.load_atomic(ptr, "monotonic", 8)
        builder.store_atomic(builder.add(old, args[1]), ptr, "release", 8)
        return context.get_dummy_value()

    return sig, codegen


def _store_seq_typing(typingctx: Any, addr: Any, value: Any) -> Any:
    """Store ``value`` at the int64 at address ``addr``, sequentially consistent (not sunk below later loads)."""
    sig = types.void(types.int64, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        builder.store_atomic(args[1], ptr, "seq_cst", 8)
        return context.get_dummy_value()

    return sig, codegen


_load_acquire: Any = intrinsic(_load_acquire_typing)
_store_seq: Any = intrinsic(_store_seq_typing)
_add_release: Any = intrinsic(_add_release_typing)
_pause: Any = intrinsic(_pause_typing)


def _yield_typing(typingctx: Any) -> Any:
    """libc's ``sched_yield()``: let another runnable thread of this core run (declared by name, resolved in
    the process at load, so the kernel stays cacheable, unlike a ctypes call)."""
    sig = types.int32()

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield"
        )
        return builder.call(fn, [])

    return sig, codegen


_yield: Any = intrinsic(_yield_typing)


@numba.njit(nogil=True, cache=True, inline="always")
def _breathe(left: int, every: int) -> int:
    """One spin's pause, and the core yielded when ``left`` (spins to the next yield) runs out; the new ``left``."""
    _pause()
    left -= 1
    if left == 0:
        _yield()
        left = every
    return left


@numba.njit(nogil=True, cache=True)
def _spin(counter: Any, value: int, limit: int, every: int) -> bool:
    """Spin at most ``limit`` times while ``counter[0] == value``, yielding the core every ``every`` spins; True
    when it changed."""
    addr = counter.ctypes.data  # read here: from Python, ``ctypes.data`` costs ~1 us a call
    left = every
    for _ in range(limit):
        if _load_acquire(addr) != value:
            return True
        left = _breathe(left, every)
    last: int = _load_acquire(addr)
    return last != value


@numba.njit(nogil=True, cache=True)
def _count_and_wait(
    slots: Any,
    slot: int,
    count: int,
    counter: Any,
    value: int,
    limit: int,
    every: int,
    settle: int,
    gate: Any,
    after: int,
) -> bool:
    """``slots[slot] += count`` (release), then ``_spin`` while ``counter[0] == value``; once it changed, pause
    until ``gate[0]`` reaches ``counter[0]``, then ``after`` more, ``settle`` pauses in all at most. True when it
    changed."""
    _add_release(slots.ctypes.data + slot * 8, count)
    changed = _spin(counter, value, limit, every)
    if changed:
        posted, opened = counter.ctypes.data, gate.ctypes.data
        n = 0
        while n < settle and _load_acquire(opened) < _load_acquire(posted):
            _pause()
            n += 1
        for _ in range(min(after, settle - n)):
            _pause()
    return changed


@numba.njit(nogil=True, cache=True)
def _spin_reach(counter: Any, target: int, unless: Any, limit: int, every: int, gate: Any, opened: int) -> bool:
    """Set ``gate[0] = opened``, then spin at most ``limit`` times while ``counter[0] < target`` and
    ``unless[0] == 0``, yielding the core every ``every`` spins; True when it reached ``target``."""
    addr, stop = counter.ctypes.data, unless.ctypes.data
    _store_seq(gate.ctypes.data, opened)
    left = every
    for _ in range(limit):
        if _load_acquire(addr) >= target:
            return True
        if _load_acquire(stop) != 0:
            break
        left = _breathe(left, every)
    last: int = _load_acquire(addr)
    return last >= target


@numba.njit(nogil=True, cache=True)
def _spin_total(slots: Any, total: int, limit: int) -> bool:
    """Spin at most ``limit`` times until the slots sum to ``total``; True when they did."""
    base = slots.ctypes.data
    for _ in range(limit + 1):
        s = 0
        for i in range(slots.size):
            s += _load_acquire(base + i * 8)
        if s == total:
            return True
        _pause()
    return False


@functools.cache
def _iterations() -> int:
    """Spin iterations in about SPIN_US microseconds (timed once on a counter that does not change)."""
    counter = np.ones(1, np.int64)
    n = 20_000
    _spin(counter, 1, 10, n + 1)  # compile (or load from the cache) outside the timing
    t0 = time.perf_counter()
    _spin(counter, 1, n, n + 1)
    per = max((time.perf_counter() - t0) / n, 1e-10)
    return max(1, int(SPIN_US * 1e-6 / per))


_SHUT = np.zeros(1, np.int64)  # a gate that never opens: the whole SETTLE_US
_SCRATCH = np.zeros(1, np.int64)  # a gate nobody waits on


def count_and_wait(
    slots: np.ndarray[Any, Any],
    slot: int,
    count: int,
    counter: np.ndarray[Any, Any],
    value: int,
    us: float,
    gate: np.ndarray[Any, Any] = _SHUT,
) -> bool:
    """Add ``count`` to ``slots[slot]`` (int64; this thread its only writer) from compiled code, so a thread
    spinning on the slots (:func:`spin_until_total`) sees it only once this one no longer holds the GIL; then
    spin while ``counter[0] == value`` for at most ``us`` microseconds (0: count only), yielding the core every
    ``YIELD_US``; once it changed, ``GATE_US`` more after ``gate[0]`` reaches ``counter[0]``, ``SETTLE_US`` in all at
    most (the default gate never opens: the whole ``SETTLE_US``). True when it changed."""
    per_us = _iterations() / SPIN_US
    return bool(
        _count_and_wait(
            slots,
            slot,
            count,
            counter,
            value,
            int(per_us * us),
            max(1, int(per_us * YIELD_US)),
            int(per_us * SETTLE_US),
            gate,
            int(per_us * GATE_US),
        )
    )


def spin_until_total(slots: np.ndarray[Any, Any], total: int) -> bool:
    """Spin until the int64 ``slots`` (counted by :func:`count_and_wait`) sum to ``total``, for at most about
    SPIN_US microseconds; True when they did."""
    return bool(_spin_total(slots, total, _iterations()))


def spin_until_reached(
    counter: np.ndarray[Any, Any],
    target: int,
    us: float,
    unless: np.ndarray[Any, Any],
    gate: np.ndarray[Any, Any] | None = None,
    opened: int = 0,
) -> bool:
    """Spin while the int64 ``counter[0]`` (counted by :func:`count_and_wait`) is below ``target`` and the int64
    ``unless[0]`` is 0, for at most ``us`` microseconds, yielding the core every ``YIELD_US``; True when it
    reached ``target``. ``gate[0]`` is set to ``opened`` first, from compiled code, once this thread has let go of
    the GIL (the gate of a :func:`count_and_wait`)."""
    per_us = _iterations() / SPIN_US
    return bool(
        _spin_reach(
            counter,
            target,
            unless,
            int(per_us * us),
            max(1, int(per_us * YIELD_US)),
            _SCRATCH if gate is None else gate,
            opened,
        )
    )
