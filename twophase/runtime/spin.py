"""Short spins, without the GIL, until a counter in memory reaches zero or changes.

:func:`~twophase.runtime.fanout.run_parts` uses it for the last parts of a launch, which other threads are
finishing: waking a thread blocked on a lock took 25-40 us on these machines (measured after a 0.5 ms
GEMM part), a spin sees the counter change at once. The spin runs in a ``nogil`` numba loop so the finishing
thread can take the GIL to count its part down; it gives up after about :data:`SPIN_US` microseconds, and the
caller then blocks as before. Helper threads wait for the next launch with :func:`spin_while_equal` on the
count of jobs posted, yielding their core every :data:`YIELD_US` (``fanout._Helpers``).
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

__all__ = ["SPIN_US", "spin_until_zero", "spin_while_equal"]

SPIN_US = 100.0
YIELD_US = 20.0
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
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return sig, codegen


_load_acquire: Any = intrinsic(_load_acquire_typing)
_pause: Any = intrinsic(_pause_typing)


def _yield_typing(typingctx: Any) -> Any:
    """libc's ``sched_yield()``: let another runnable thread of this core run (declared by name, resolved in
    the process at load, so the kernel stays cacheable, unlike a ctypes call)."""
    sig = types.int32()

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        return builder.call(fn, [])
    return sig, codegen


_yield: Any = intrinsic(_yield_typing)


@numba.njit(nogil=True, cache=True)
def _spin(counter: Any, value: int, until_equal: bool, limit: int, every: int) -> bool:
    """Spin at most ``limit`` times until ``counter[0] == value`` (``until_equal``) or ``!= value``, yielding the
    core every ``every`` spins; True when that happened."""
    addr = counter.ctypes.data  # read here: from Python, ``ctypes.data`` costs ~1 us a call
    left = every
    for _ in range(limit):
        if (_load_acquire(addr) == value) == until_equal:
            return True
        _pause()
        left -= 1
        if left == 0:
            _yield()
            left = every
    last: int = _load_acquire(addr)
    return (last == value) == until_equal


@functools.cache
def _iterations() -> int:
    """Spin iterations in about SPIN_US microseconds (timed once on a counter that stays non-zero)."""
    counter = np.ones(1, np.int64)
    n = 20_000
    _spin(counter, 0, True, 10, n + 1)  # compile (or load from the cache) outside the timing
    t0 = time.perf_counter()
    _spin(counter, 0, True, n, n + 1)
    per = max((time.perf_counter() - t0) / n, 1e-10)
    return max(1, int(SPIN_US * 1e-6 / per))


def spin_until_zero(counter: np.ndarray[Any, Any]) -> bool:
    """Spin until ``counter[0]`` (an int64 array another thread counts down) is 0, for at most about SPIN_US
    microseconds; True when it reached 0."""
    n = _iterations()
    return bool(_spin(counter, 0, True, n, n + 1))  # no yield: the parts end within microseconds


def spin_while_equal(counter: np.ndarray[Any, Any], value: int, us: float) -> bool:
    """Spin while ``counter[0]`` equals ``value``, for at most about ``us`` microseconds, giving the core to any
    other runnable thread (``sched_yield``) every :data:`YIELD_US`; True when it changed."""
    per_us = _iterations() / SPIN_US
    return bool(_spin(counter, value, False, max(1, int(per_us * us)), max(1, int(per_us * YIELD_US))))
