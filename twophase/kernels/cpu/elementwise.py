"""Unary elementwise kernels: one specialised numba kernel per math function, made from one template.

``KERNELS[name]`` holds the kernels of ``vmath.<name>`` (or, for float32 data, of ``vmath.<name>_f32`` where that
exists). Each kernel's inner loop runs over a 1-D contiguous span (``x[k, lo:hi]``) with the function known at compile
time, so LLVM inlines it and vectorizes the loop (packed ``zmm``/``ymm`` math; ``tests/test_ops_elementwise.py``
checks the assembly). The op picks the kernel in phase 1 by the function's name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
import numpy as np

from ...layout import align, as_matrix
from . import vmath as vm
from .jit import FAST, entry

# error_model="numpy": no ZeroDivisionError branch in divisions, so the loops vectorize
kern = numba.njit(nogil=True, cache=True, fastmath=FAST, error_model="numpy")
kern_par = numba.njit(nogil=True, cache=True, fastmath=FAST, error_model="numpy", parallel=True)

FUNCS = ("exp", "log", "tanh", "sigmoid", "silu", "gelu_erf", "gelu_tanh", "rsqrt",
         "sigmoid_f32", "silu_f32", "gelu_erf_f32")
CODES = {name: i for i, name in enumerate(FUNCS)}
# functions with a float32-arithmetic variant: those whose exp argument is exact in float32 (gelu_tanh's 2u is not:
# its rounding, amplified by exp, would cost ~|2u| ulp, so it stays in float64)
F32 = frozenset(n[:-4] for n in FUNCS if n.endswith("_f32"))
CHUNK = 16384  # elements per parallel task
PARALLEL_MIN = 1 << 16


@numba.njit(nogil=True, cache=True, fastmath=FAST, error_model="numpy", inline="always")
def _apply(code: int, v: Any) -> Any:
    """vmath function number ``code`` of ``v``: ``code`` is a compile-time constant in every kernel, so only one
    branch survives (the kernels are specialised; nothing is selected per element)."""
    if code == 0:
        return vm.exp(v)
    if code == 1:
        return vm.log(v)
    if code == 2:
        return vm.tanh(v)
    if code == 3:
        return vm.sigmoid(v)
    if code == 4:
        return vm.silu(v)
    if code == 5:
        return vm.gelu_erf(v)
    if code == 6:
        return vm.gelu_tanh(v)
    if code == 7:
        return vm.rsqrt(v)
    if code == 8:
        return vm.sigmoid_f32(v)
    if code == 9:
        return vm.silu_f32(v)
    return vm.gelu_erf_f32(v)


def _specialise(code: int) -> tuple[Any, Any, Any]:
    """(span, rows, rows_par) kernels of function ``code``: the one loop, written once; ``code`` is a closure
    constant (numba freezes it, and caches each specialisation under its value)."""

    @kern
    def span(x: Any, out: Any) -> None:
        for i in range(x.shape[0]):
            out[i] = _apply(code, x[i])

    @kern
    def rows(x: Any, out: Any, chunk: int) -> None:
        for k in range(x.shape[0]):
            span(x[k], out[k])

    @kern_par
    def rows_par(x: Any, out: Any, chunk: int) -> None:
        n_rows, n = x.shape
        nc = (n + chunk - 1) // chunk
        for t in numba.prange(n_rows * nc):
            k = t // nc
            lo = (t - k * nc) * chunk
            hi = min(n, lo + chunk)
            span(x[k, lo:hi], out[k, lo:hi])

    return span, rows, rows_par


KERNELS: dict[str, tuple[Any, Any, Any]] = {name: _specialise(CODES[name]) for name in FUNCS}


def function_for(name: str, compute: Any) -> str:
    """The vmath function used for ``name`` on data computed in ``compute`` (float32: the float32 variant)."""
    return name + "_f32" if np.dtype(compute) == np.float32 and name in F32 else name


def matrix2d(a: Any) -> Any:
    """``a`` as a (prod of leading dims, last dim) view, or None when the leading dims do not merge."""
    if a.ndim == 0:
        return a.reshape(1, 1)
    return as_matrix(a, tuple(range(a.ndim - 1)), (a.ndim - 1,))


def flat2d(a: Any) -> Any:
    """A C-contiguous array as one (1, size) row (the parallel kernel splits it into chunks), else ``matrix2d``."""
    return a.reshape(1, a.size) if a.flags.c_contiguous else matrix2d(a)


def pack_bytes(numel: int, itemsize: int, needs_pack: bool) -> int:
    return align(numel * itemsize) if needs_pack else 0


def build_unary(name: str, x: Any, out: Any, pack: bool, compute: Any) -> Callable[[Any], None]:
    """Launch for ``out = f(x)``: directly on (rows, cols) views, or through a dense ``compute``-dtype copy in the
    workspace when ``pack`` (float16, or dims that do not merge). The kernel is chosen and compiled here (phase 1)."""
    if x.size == 0:
        return lambda _: None
    _, rows, rows_par = KERNELS[function_for(name, compute)]
    kernel = rows_par if x.size >= PARALLEL_MIN else rows
    if not pack:
        both = x.flags.c_contiguous and out.flags.c_contiguous
        xm, om = (flat2d(x), flat2d(out)) if both else (matrix2d(x), matrix2d(out))
        fn = entry(kernel, xm, om, CHUNK)
        return lambda _: fn(xm, om, CHUNK)
    sample = np.empty((1, 1), compute)
    fn = entry(kernel, sample, sample, CHUNK)
    n, nbytes = x.size, x.size * compute.itemsize

    def launch(ws: Any) -> None:
        area = ws[:nbytes].view(compute)
        np.copyto(area.reshape(x.shape), x, casting="unsafe")
        m = area.reshape(1, n)
        fn(m, m, CHUNK)
        np.copyto(out, area.reshape(out.shape), casting="unsafe")
    return launch
