"""Unary elementwise kernels over (rows, cols) views, using the vectorizable math of ``vmath``."""

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

CODES = {"exp": 0, "log": 1, "tanh": 2, "sigmoid": 3, "silu": 4, "gelu_erf": 5, "gelu_tanh": 6, "rsqrt": 7}
CHUNK = 16384  # elements per parallel task
PARALLEL_MIN = 1 << 16


@kern
def _run(code: int, x: Any, out: Any, k: int, lo: int, hi: int) -> None:
    if code == 0:
        for i in range(lo, hi):
            out[k, i] = vm.exp(x[k, i])
    elif code == 1:
        for i in range(lo, hi):
            out[k, i] = vm.log(x[k, i])
    elif code == 2:
        for i in range(lo, hi):
            out[k, i] = vm.tanh(x[k, i])
    elif code == 3:
        for i in range(lo, hi):
            out[k, i] = vm.sigmoid(x[k, i])
    elif code == 4:
        for i in range(lo, hi):
            out[k, i] = vm.silu(x[k, i])
    elif code == 5:
        for i in range(lo, hi):
            out[k, i] = vm.gelu_erf(x[k, i])
    elif code == 6:
        for i in range(lo, hi):
            out[k, i] = vm.gelu_tanh(x[k, i])
    else:
        for i in range(lo, hi):
            out[k, i] = vm.rsqrt(x[k, i])


@kern
def unary_rows(code: int, x: Any, out: Any, chunk: int) -> None:
    for k in range(x.shape[0]):
        _run(code, x, out, k, 0, x.shape[1])


@kern_par
def unary_rows_par(code: int, x: Any, out: Any, chunk: int) -> None:
    n_rows, n = x.shape
    nc = (n + chunk - 1) // chunk
    for t in numba.prange(n_rows * nc):
        k = t // nc
        j = t - k * nc
        _run(code, x, out, k, j * chunk, min(n, (j + 1) * chunk))


def matrix2d(a: Any) -> Any:
    """``a`` as a (prod of leading dims, last dim) view, or None when the leading dims do not merge."""
    if a.ndim == 0:
        return a.reshape(1, 1)
    return as_matrix(a, tuple(range(a.ndim - 1)), (a.ndim - 1,))


def pack_bytes(numel: int, itemsize: int, needs_pack: bool) -> int:
    return align(numel * itemsize) if needs_pack else 0


def build_unary(name: str, x: Any, out: Any, pack: bool, compute: Any) -> Callable[[Any], None]:
    """Launch for ``out = f(x)``: directly on (rows, cols) views, or through a dense ``compute``-dtype copy in the
    workspace when ``pack`` (float16, or dims that do not merge)."""
    code = CODES[name]
    if x.size == 0:
        return lambda _: None
    par = x.size >= PARALLEL_MIN
    kernel = unary_rows_par if par else unary_rows
    if not pack:
        xm, om = matrix2d(x), matrix2d(out)
        fn = entry(kernel, code, xm, om, CHUNK)
        return lambda _: fn(code, xm, om, CHUNK)
    sample = np.empty((1, 1), compute)
    fn = entry(kernel, code, sample, sample, CHUNK)
    n, nbytes = x.size, x.size * compute.itemsize

    def launch(ws: Any) -> None:
        area = ws[:nbytes].view(compute)
        np.copyto(area.reshape(x.shape), x, casting="unsafe")
        m = area.reshape(1, n)
        fn(code, m, m, CHUNK)
        np.copyto(out, area.reshape(out.shape), casting="unsafe")
    return launch
