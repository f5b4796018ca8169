"""Direct ``cblas_?gemm`` calls into numpy's own OpenBLAS, for the one thing ``np.matmul`` cannot say:
``C = alpha * A @ B + beta * C``.

A linear layer's bias then costs one write of ``C`` (the bias copied in) instead of a full read-modify-write pass
after the GEMM (OpenBLAS zero-fills ``C`` for ``beta == 0`` anyway). The functions are found by their ILP64
symbol names in the OpenBLAS that numpy's wheels bundle, and checked once against ``np.matmul``; with any other
BLAS build ``gemm_for`` returns None and callers keep ``np.matmul`` plus a separate epilogue.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ...runtime import forking
from ...runtime.fanout import run_parts

__all__ = ["gemm_for", "fused_gemm", "serial_calls", "run_blas_parts"]

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
_SYMBOLS = {
    np.dtype(np.float32): ("scipy_cblas_sgemm64_", "cblas_sgemm64_"),
    np.dtype(np.float64): ("scipy_cblas_dgemm64_", "cblas_dgemm64_"),
}

Gemm = Callable[..., None]


def _libraries() -> list[str]:
    """numpy's bundled BLAS libraries (wheel layout: ``numpy.libs`` next to the package)."""
    root = os.path.dirname(os.path.dirname(np.__file__))
    return sorted(glob.glob(os.path.join(root, "numpy.libs", "*openblas*.so*")))


@functools.cache
def gemm_for(dtype: Any) -> Gemm | None:
    """The ILP64 ``cblas_?gemm`` of numpy's OpenBLAS for ``dtype`` (float32 / float64), or None."""
    dt = np.dtype(dtype)
    if dt not in _SYMBOLS:
        return None
    scalar = ctypes.c_float if dt == np.float32 else ctypes.c_double
    i64, ptr, enum = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    for name in _SYMBOLS[dt]:
        found = _functions(name)
        if found is None:
            continue
        fn = found[0]
        fn.argtypes = [enum, enum, enum, i64, i64, i64, scalar, ptr, i64, ptr, i64, scalar, ptr, i64]
        fn.restype = None
        if _agrees(fn, dt):
            return fn  # type: ignore[no-any-return]
    return None


def _functions(*names: str) -> tuple[Any, ...] | None:
    """The named functions of the first of numpy's BLAS libraries that has all of them, or None."""
    for path in _libraries():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        fns = tuple(getattr(lib, name, None) for name in names)
        if all(fn is not None for fn in fns):
            return fns
    return None


@functools.cache
def _thread_count_calls() -> tuple[Any, Any] | None:
    """(get, set) of the thread count of numpy's OpenBLAS, or None."""
    found = _functions("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_")
    if found is None:
        return None
    get, put = found
    get.restype = ctypes.c_int
    put.argtypes = [ctypes.c_int]
    return get, put


_serial_lock = forking.lock()
_serial_depth = 0
_serial_saved = 0


@forking.on_fork
def _not_serial() -> None:
    """In a forked child no part runs inside ``serial_calls`` (their threads did not come along): BLAS's thread
    count back to what it was before them."""
    global _serial_depth
    if _serial_depth:
        _serial_depth = 0
        calls = _thread_count_calls()
        if calls is not None:
            calls[1](_serial_saved)


@contextlib.contextmanager
def serial_calls() -> Iterator[None]:
    """BLAS calls run on their calling thread while inside: for launches whose parts, on helper threads, each
    call BLAS (two parts each starting OpenBLAS's threads would fight over the same cores). The count is
    process-wide in OpenBLAS: the first launch in sets it to 1, the last one out restores it; a GEMM of
    someone else's that starts meanwhile runs on one thread (slower, never wrong)."""
    global _serial_depth, _serial_saved
    calls = _thread_count_calls()
    if calls is None:
        yield
        return
    get, put = calls
    with _serial_lock:
        if _serial_depth == 0:
            _serial_saved = get()
            put(1)
        _serial_depth += 1
    try:
        yield
    finally:
        with _serial_lock:
            _serial_depth -= 1
            if _serial_depth == 0:
                put(_serial_saved)


def run_blas_parts(parts: Sequence[Callable[[], Any]]) -> None:
    """Parts that each call BLAS: a single one runs as it is (OpenBLAS threads it), several run on helper
    threads with one BLAS thread each (``serial_calls``)."""
    if len(parts) == 1:
        parts[0]()
        return
    with serial_calls():
        run_parts(parts)


def _agrees(fn: Any, dt: np.dtype[Any]) -> bool:
    """One small transposed-B call with alpha and beta, compared with numpy (a wrong binding shows here)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 4)).astype(dt)
    b = rng.standard_normal((5, 4)).astype(dt)  # used as b.T
    c = rng.standard_normal((3, 5)).astype(dt)
    want = 2.0 * (a.astype(np.float64) @ b.T.astype(np.float64)) + 0.5 * c
    fn(ROW_MAJOR, NO_TRANS, TRANS, 3, 5, 4, 2.0, a.ctypes.data, 4, b.ctypes.data, 4, 0.5, c.ctypes.data, 5)
    return bool(np.allclose(c, want, rtol=1e-5, atol=1e-5))


def _operand(m: Any) -> tuple[int, int] | None:
    """(transpose flag, leading dimension) of a 2-D operand BLAS can read in place, else None."""
    item = m.itemsize
    s0, s1 = m.strides
    rows, cols = m.shape
    if s1 == item and s0 % item == 0 and s0 // item >= max(1, cols):
        return NO_TRANS, s0 // item
    if s0 == item and s1 % item == 0 and s1 // item >= max(1, rows):
        return TRANS, s1 // item
    return None


def fused_gemm(a: Any, b: Any, o: Any, out: Any, c: Any, alpha: float, beta: float) -> Callable[[Any], None] | None:
    """A launch for ``out = alpha * (a @ b) + beta * c`` as ``out[...] = c`` then one GEMM with ``beta`` into ``o``
    (``o``: ``out``'s memory as the (M, N) matrix of the 2-D product ``a @ b``); None when it does not apply
    (no BLAS binding, a layout BLAS cannot take, ``c`` overlapping ``out``, an empty product, ``alpha == 0``:
    BLAS would skip the product, whose inf / NaN must still propagate)."""
    fn = gemm_for(o.dtype)
    if fn is None or c is None or beta == 0 or alpha == 0 or a.ndim != 2 or b.ndim != 2 or o.ndim != 2:
        return None
    if a.dtype != o.dtype or b.dtype != o.dtype or min(a.shape + b.shape) == 0:
        return None
    if c is not out and np.shares_memory(c, out):
        return None
    ta, tb, to = _operand(a), _operand(b), _operand(o)
    if ta is None or tb is None or to is None or to[0] != NO_TRANS:
        return None
    m, k = a.shape
    n = b.shape[1]
    args = (
        ROW_MAJOR,
        ta[0],
        tb[0],
        m,
        n,
        k,
        alpha,
        a.ctypes.data,
        ta[1],
        b.ctypes.data,
        tb[1],
        beta,
        o.ctypes.data,
        to[1],
    )

    def launch(_: Any, _owners: tuple[Any, ...] = (a, b, o)) -> None:  # the views own the memory args points at
        if c is not out:
            np.copyto(out, c)
        fn(*args)

    return launch
