"""Group norm over an (N, G, L) view (L = C/G channels x S spatial elements of one group, one stride).

A group that fits in cache takes three passes: its float64 sum (mean), the float64 sum of squared deviations
(variance, no cancellation), then ``out = (x - mean) * rstd * w[c] + b[c]`` channel by channel. A huge group
is split into blocks whose Welford partials ``(count, mean, M2)`` live in the workspace and are merged per
group with Chan's formula: for partials a and b, ``n = n_a + n_b``, ``d = mean_b - mean_a``,
``mean = mean_a + d * n_b / n``, ``M2 = M2_a + M2_b + d^2 * n_a * n_b / n``; variance = M2 / L.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numba
import numpy as np

from . import jit as _jit
from . import vmath as vm
from .jit import entry
from .norm import _affine

Kernel = Callable[[Callable[..., Any]], Any]
jit: Kernel = _jit.jit  # the numba decorators, typed (jit.py leaves them untyped)
jit_par: Kernel = _jit.jit_par
jit_reduce: Kernel = _jit.jit_reduce


@jit_reduce
def _sq_dev(x: Any, mu: float) -> float:
    s = 0.0
    for i in range(x.shape[0]):
        d = x[i] - mu
        s += d * d
    return s


@jit
def _write(x: Any, out: Any, lo: int, hi: int, n_sp: int, c0: int, w: Any, b: Any, mu: float, r: float) -> None:
    """Elements [lo, hi) of one group row: channel c0 + i // n_sp, a contiguous run per channel."""
    i = lo
    while i < hi:
        c = i // n_sp
        e = min(hi, (c + 1) * n_sp)
        _affine(x[i:e], out[i:e], mu, r * w[c0 + c], float(b[c0 + c]))
        i = e


@jit_par
def group_norm_rows(x: Any, w: Any, b: Any, n_sp: int, eps: float, out: Any) -> None:
    """Whole groups, one per task: sum, squared deviations, write (the group stays in cache)."""
    n, g, length = x.shape
    cg = length // n_sp
    for t in numba.prange(n * g):
        k = t // g
        j = t - k * g
        row, orow = x[k, j], out[k, j]
        mu = vm.fsum(row) / length
        r = 1.0 / math.sqrt(_sq_dev(row, mu) / length + eps)
        _write(row, orow, 0, length, n_sp, j * cg, w, b, mu, r)


@jit
def _merge(part: Any, t: int, length: int, eps: float) -> None:
    """Fold group t's block partials (count, mean, M2) with Chan's formula; every slot gets (mean, rstd)."""
    na, ma, m2 = part[t, 0, 0], part[t, 0, 1], part[t, 0, 2]
    for j in range(1, part.shape[1]):
        nb, mb = part[t, j, 0], part[t, j, 1]
        nn = na + nb
        d = mb - ma
        ma = ma + d * (nb / nn)
        m2 = m2 + part[t, j, 2] + d * d * (na * nb / nn)
        na = nn
    r = 1.0 / math.sqrt(m2 / length + eps)
    for j in range(part.shape[1]):
        part[t, j, 0] = ma
        part[t, j, 1] = r
        part[t, j, 2] = na


@jit_par
def group_norm_split(x: Any, w: Any, b: Any, n_sp: int, eps: float, block: int, part: Any, out: Any) -> None:
    """Huge groups: every block is a task (Welford partials), groups merge, every block writes."""
    n, g, length = x.shape
    cg = length // n_sp
    nb = part.shape[1]
    for t in numba.prange(n * g * nb):
        row = t // nb
        j = t - row * nb
        lo, hi = j * block, min(length, (j + 1) * block)
        seg = x[row // g, row % g, lo:hi]
        mu = vm.fsum(seg) / (hi - lo)
        part[row, j, 0] = hi - lo
        part[row, j, 1] = mu
        part[row, j, 2] = _sq_dev(seg, mu)
    for row in numba.prange(n * g):
        _merge(part, row, length, eps)
    for t in numba.prange(n * g * nb):
        row = t // nb
        j = t - row * nb
        k, gi = row // g, row % g
        lo, hi = j * block, min(length, (j + 1) * block)
        _write(x[k, gi], out[k, gi], lo, hi, n_sp, gi * cg, w, b, part[row, j, 0], part[row, j, 1])


def build_group_norm(src: Any, dst: Any, w: Any, b: Any, tiling: Any, eps: float,
                     compute: Any) -> Callable[[Any], None]:
    """Launch over (N, G, L) views, or (``tiling.pack``) through dense ``compute`` copies of the N-d ``src`` and
    of ``w`` / ``b`` in the workspace. ``tiling``: groups, n_sp, split, block, pack, pack_offset, param_offset."""
    t = tiling
    if src.size == 0:
        return lambda _: None
    n = src.shape[0]
    shape3 = (n, t.groups, src.size // (n * t.groups))
    if t.pack:
        sample, p_sample = np.empty((1, 1, 1), compute), np.empty(1, compute)
    else:
        sample, p_sample = src, w
    part_sample = np.empty((1, 1, 3), np.float64)
    if t.split > 1:
        fn = entry(group_norm_split, sample, p_sample, p_sample if t.pack else b, t.n_sp, eps, t.block,
                   part_sample, sample if t.pack else dst)
    else:
        fn = entry(group_norm_rows, sample, p_sample, p_sample if t.pack else b, t.n_sp, eps,
                   sample if t.pack else dst)
    rows = n * t.groups

    def run(x: Any, wv: Any, bv: Any, out: Any, ws: Any) -> None:
        if t.split > 1:
            fn(x, wv, bv, t.n_sp, eps, t.block, ws[:rows * t.split * 24].view(np.float64).reshape(rows, t.split, 3),
               out)
        else:
            fn(x, wv, bv, t.n_sp, eps, out)
    if not t.pack:
        return lambda ws: run(src, w, b, dst, ws)
    nbytes, pbytes = src.size * compute.itemsize, w.size * compute.itemsize

    def launch(ws: Any) -> None:
        area = ws[t.pack_offset:t.pack_offset + nbytes].view(compute).reshape(src.shape)
        np.copyto(area, src, casting="unsafe")
        wv = ws[t.param_offset:t.param_offset + pbytes].view(compute)
        bv = ws[t.param_offset + t.param_stride:t.param_offset + t.param_stride + pbytes].view(compute)
        np.copyto(wv, w, casting="unsafe")
        np.copyto(bv, b, casting="unsafe")
        a3 = area.reshape(shape3)
        run(a3, wv, bv, a3, ws)
        np.copyto(dst, area, casting="unsafe")
    return launch
