"""Tree reductions over a (kept, reduced) matrix view: each level sums blocks into partials."""

from __future__ import annotations

from typing import Any, Callable

import numba
import numpy as np

from .jit import entry, jit_reduce, jit_reduce_par


@jit_reduce
def _sum_block(x: Any, k: int, lo: int, hi: int, zero: Any) -> Any:
    acc = zero
    for i in range(lo, hi):
        acc += x[k, i]
    return acc


@jit_reduce
def sum_level(x: Any, block: int, zero: Any, out: Any) -> None:
    """out[k, j] = sum of x[k, j*block:(j+1)*block] (accumulated in the type of ``zero``)."""
    n_rows, n = x.shape
    nb = out.shape[1]
    for t in range(n_rows * nb):
        k = t // nb
        j = t - k * nb
        out[k, j] = _sum_block(x, k, j * block, min(n, (j + 1) * block), zero)


@jit_reduce_par
def sum_level_par(x: Any, block: int, zero: Any, out: Any) -> None:
    """Parallel ``sum_level`` over blocks."""
    n_rows, n = x.shape
    nb = out.shape[1]
    for t in numba.prange(n_rows * nb):
        k = t // nb
        j = t - k * nb
        out[k, j] = _sum_block(x, k, j * block, min(n, (j + 1) * block), zero)


def build_tree(src: Any, out2d: Any, tiling: Any, pack_dtype: Any, acc: Any,
               level_kernel: Any = None, scalar: Any = None) -> Callable[[Any], None]:
    """A launch that runs the levels of block sums from the input to ``out2d`` (K, 1).

    ``src`` is the (K, R) matrix view of the input, or, when ``tiling.pack``, the input with its axes
    permuted (kept, reduced), which the launch first copies densely into the workspace as ``pack_dtype``.
    The workspace also holds each level's partials (``acc`` dtype). ``level_kernel(x, block, scalar, out)``
    combines blocks (default: sums, ``scalar`` the zero of ``acc``; ``max_level``: ``scalar`` +1 max / -1 min).
    """
    k_rows, r = tiling.kept, tiling.reduced
    block = tiling.block
    zero = acc.type(0) if scalar is None else scalar
    kern = level_kernel or (sum_level_par if tiling.parallel else sum_level)
    levels = tiling.levels
    offsets = tiling.offsets
    if r == 0:
        return lambda _: out2d.fill(0)  # type: ignore[no-any-return]
    if k_rows == 0:
        return lambda _: None
    # compile every level's signature now (phase 1), never in phase 2
    steps = []
    prev = np.empty((1, 1), pack_dtype) if tiling.pack else src
    for n in levels:
        dst = np.empty((1, n), acc)
        steps.append(entry(kern, prev, block, zero, dst))
        prev = dst
    stage = getattr(tiling, "stage_offset", -1)
    final_out = np.empty((1, 1), acc) if stage >= 0 else out2d
    final = entry(kern, prev, block, zero, final_out)

    pack, pack_offset, pack_bytes = tiling.pack, tiling.pack_offset, k_rows * r * pack_dtype.itemsize

    def launch(ws: Any) -> None:
        x = src
        if pack:
            area = ws[pack_offset:pack_offset + pack_bytes].view(pack_dtype)
            np.copyto(area.reshape(src.shape), src, casting="unsafe")
            x = area.reshape(k_rows, r)
        for n, off, step in zip(levels, offsets, steps):
            dst = ws[off:off + k_rows * n * acc.itemsize].view(acc).reshape(k_rows, n)
            step(x, block, zero, dst)
            x = dst
        if stage >= 0:
            wide = ws[stage:stage + k_rows * acc.itemsize].view(acc).reshape(k_rows, 1)
            final(x, block, zero, wide)
            np.copyto(out2d, wide, casting="unsafe")
        else:
            final(x, block, zero, out2d)
    return launch


@jit_reduce
def _max_block(x: Any, k: int, lo: int, hi: int, sign: Any) -> Any:
    """max (sign > 0) or min (sign < 0) of a non-empty block of row k; NaN wins."""
    m = x[k, lo]
    if sign > 0:
        for i in range(lo + 1, hi):
            v = x[k, i]
            m = v if (v > m or v != v) else m
    else:
        for i in range(lo + 1, hi):
            v = x[k, i]
            m = v if (v < m or v != v) else m
    return m


@jit_reduce
def max_level(x: Any, block: int, sign: Any, out: Any) -> None:
    """out[k, j] = max (sign 1) or min (sign -1) of x[k, j*block:(j+1)*block]."""
    n_rows, n = x.shape
    nb = out.shape[1]
    for t in range(n_rows * nb):
        k = t // nb
        j = t - k * nb
        out[k, j] = _max_block(x, k, j * block, min(n, (j + 1) * block), sign)


@jit_reduce_par
def max_level_par(x: Any, block: int, sign: Any, out: Any) -> None:
    n_rows, n = x.shape
    nb = out.shape[1]
    for t in numba.prange(n_rows * nb):
        k = t // nb
        j = t - k * nb
        out[k, j] = _max_block(x, k, j * block, min(n, (j + 1) * block), sign)
