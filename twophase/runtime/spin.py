"""A short spin, without the GIL, until a counter in memory reaches zero.

:func:`~twophase.runtime.fanout.run_parts` uses it for the last parts of a launch, which other threads are
finishing: waking a thread blocked on an ``Event`` took 25-40 us on these machines (measured after a 0.5 ms
GEMM part), a spin sees the counter change at once. The spin runs in a ``nogil`` numba loop so the finishing
thread can take the GIL to count its part down; it gives up after about :data:`SPIN_US` microseconds, and the
caller then blocks as before.
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

__all__ = ["SPIN_US", "spin_until_zero"]

SPIN_US = 100.0
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


@numba.njit(nogil=True, cache=True)
def _spin(counter: Any, limit: int) -> bool:
    addr = counter.ctypes.data  # read here: from Python, ``ctypes.data`` costs ~1 us a call
    for _ in range(limit):
        if _load_acquire(addr) == 0:
            return True
        _pause()
    last: int = _load_acquire(addr)
    return last == 0


@functools.cache
def _iterations() -> int:
    """Spin iterations in about SPIN_US microseconds (timed once on a counter that stays non-zero)."""
    counter = np.ones(1, np.int64)
    n = 20_000
    _spin(counter, 10)  # compile (or load from the cache) outside the timing
    t0 = time.perf_counter()
    _spin(counter, n)
    per = max((time.perf_counter() - t0) / n, 1e-10)
    return max(1, int(SPIN_US * 1e-6 / per))


def spin_until_zero(counter: np.ndarray[Any, Any]) -> bool:
    """Spin until ``counter[0]`` (an int64 array another thread counts down) is 0, for at most about SPIN_US
    microseconds; True when it reached 0."""
    return bool(_spin(counter, _iterations()))
