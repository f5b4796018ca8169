"""Group norm over an (N, G, R, S) view: a group of L = C/G channels x their spatial elements as R rows of S
(R = 1 when they walk memory with one stride; R > 1 for a crop of a wider image).

A group that fits in cache takes three passes: its float64 sum (mean), the float64 sums of deviations and of
squared deviations (variance, no cancellation; the first sum corrects the mean's rounding:
``vmath.corrected_moments``), then ``out = (x - mean) * rstd * w[c] + b[c]`` channel by channel. A huge group
is split into blocks whose Welford partials ``(count, mean, M2)`` live in the workspace and are merged per
group with Chan's formula: for partials a and b, ``n = n_a + n_b``, ``d = mean_b - mean_a``,
``mean = mean_a + d * n_b / n``, ``M2 = M2_a + M2_b + d^2 * n_a * n_b / n``; variance = M2 / L.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ...runtime.fanout import bound, fanout_parts, launcher, run_parts, split_range, workspace_launcher
from . import jit as _jit
from . import vmath as vm
from .half import cast_copy
from .jit import by_density, entry, row_of, rows_dense, rows_only
from .norm import FANOUT_MIN, _affine

Kernel = Callable[[Callable[..., Any]], Any]
jit: Kernel = _jit.jit  # the numba decorators, typed (jit.py leaves them untyped)
jit_reduce: Kernel = _jit.jit_reduce
jit_inline: Kernel = _jit.jit_inline
SHORT_ROW = 512  # rows shorter than this are summed column-wise (see _block_stats)


@jit
def _write(
    x: Any, out: Any, lo: int, hi: int, base: int, n_sp: int, c0: int, w: Any, b: Any, mu: float, r: float
) -> None:
    """Elements [lo, hi) of one row of a group, whose element 0 is the group's element ``base``: channel
    c0 + (base + i) // n_sp, a contiguous run per channel."""
    i = lo
    while i < hi:
        c = (base + i) // n_sp
        e = min(hi, (c + 1) * n_sp - base)
        _affine(x[i:e], out[i:e], mu, r * w[c0 + c], float(b[c0 + c]))
        i = e


@jit_inline
def _block_stats(xg: Any, r0: int, r1: int, e0: int, e1: int, dense: bool) -> tuple[float, float]:
    """(mean, M2) of elements [e0, e1) of rows [r0, r1) of one group's (R, S) view: a float64 sum, then the
    squared deviations (no cancellation). Many short rows (a crop of a wider image) add up column-wise in a
    float64 row first: a short row's own sum would end in a serial scalar tail longer than its vector part."""
    n = e1 - e0
    if r1 - r0 > 1 and n < SHORT_ROW:
        acc = np.zeros(n)
        for r in range(r0, r1):
            row = row_of(xg, r, dense)[e0:e1]
            for i in range(n):
                acc[i] += row[i]
        count = (r1 - r0) * n
        mu = vm.fsum(acc) / count
        acc[:] = 0.0
        dev = np.zeros(n)
        for r in range(r0, r1):
            row = row_of(xg, r, dense)[e0:e1]
            for i in range(n):
                d = row[i] - mu
                dev[i] += d
                acc[i] += d * d
        return vm.corrected_moments(count, mu, vm.fsum(dev), vm.fsum(acc))
    s = 0.0
    for r in range(r0, r1):
        s += vm.fsum(row_of(xg, r, dense)[e0:e1])
    count = (r1 - r0) * n
    mu = s / count
    c = 0.0
    q = 0.0
    for r in range(r0, r1):
        cr, qr = vm.deviation_sums(row_of(xg, r, dense)[e0:e1], mu)
        c += cr
        q += qr
    return vm.corrected_moments(count, mu, c, q)


@jit_inline
def _block_write(
    xg: Any,
    og: Any,
    r0: int,
    r1: int,
    e0: int,
    e1: int,
    n_sp: int,
    c0: int,
    w: Any,
    b: Any,
    mu: float,
    rs: float,
    dense: bool,
) -> None:
    n = xg.shape[1]
    if e0 == 0 and e1 == n and n_sp % n == 0:  # whole rows, each in one channel: no channel-run search a row
        for r in range(r0, r1):
            c = c0 + r * n // n_sp
            _affine(row_of(xg, r, dense), row_of(og, r, dense), mu, rs * w[c], float(b[c]))
        return
    for r in range(r0, r1):
        _write(row_of(xg, r, dense), row_of(og, r, dense), e0, e1, r * n, n_sp, c0, w, b, mu, rs)


@jit_inline
def _group(x: Any, w: Any, b: Any, n_sp: int, eps: float, out: Any, t: int, dense: bool) -> None:
    """Group t = k * G + j whole: sum, squared deviations, write (the group stays in cache)."""
    n, g, n_r, n_s = x.shape
    k = t // g
    j = t - k * g
    xg, og = x[k, j], out[k, j]
    mu, q = _block_stats(xg, 0, n_r, 0, n_s, dense)
    rs = 1.0 / math.sqrt(q / (n_r * n_s) + eps)
    _block_write(xg, og, 0, n_r, 0, n_s, n_sp, j * (n_r * n_s // n_sp), w, b, mu, rs, dense)


def _rows_kernel(dense: bool) -> Any:
    """Whole groups t0 <= t < t1 of an (N, G, R, S) view (R > 1: a crop of a wider image, row by row);
    ``dense`` (a closure constant: one variant compiled per kernel) says the rows' elements are adjacent."""

    @rows_only("x", "out")
    @jit
    def group_norm_rows(x: Any, w: Any, b: Any, n_sp: int, eps: float, out: Any, t0: int, t1: int) -> None:
        for t in range(t0, t1):
            _group(x, w, b, n_sp, eps, out, t, dense)

    return group_norm_rows


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


@jit_inline
def _block_of(n_r: int, n_s: int, block: int, j: int) -> tuple[int, int, int, int]:
    """Block j of a group: ``block`` elements of its one row (R == 1), else ``block`` whole rows."""
    if n_r == 1:
        return 0, 1, j * block, min(n_s, (j + 1) * block)
    return j * block, min(n_r, (j + 1) * block), 0, n_s


@jit_inline
def _split_pass(
    x: Any, w: Any, b: Any, n_sp: int, block: int, part: Any, out: Any, t: int, write: bool, dense: bool
) -> None:
    """Block task t: its Welford partial (count, mean, M2), or (``write``) its output from the merged stats."""
    n, g, n_r, n_s = x.shape
    nb = part.shape[1]
    row = t // nb
    j = t - row * nb
    k, gi = row // g, row - (row // g) * g
    r0, r1, e0, e1 = _block_of(n_r, n_s, block, j)
    if write:
        _block_write(
            x[k, gi],
            out[k, gi],
            r0,
            r1,
            e0,
            e1,
            n_sp,
            gi * (n_r * n_s // n_sp),
            w,
            b,
            part[row, j, 0],
            part[row, j, 1],
            dense,
        )
    else:
        mu, q = _block_stats(x[k, gi], r0, r1, e0, e1, dense)
        part[row, j, 0] = (r1 - r0) * (e1 - e0)
        part[row, j, 1] = mu
        part[row, j, 2] = q


@jit
def merge_partials(part: Any, length: int, eps: float) -> None:
    """Every group's block partials folded (``_merge``): between the blocks' two passes, on one thread (a few
    flops per block)."""
    for t in range(part.shape[0]):
        _merge(part, t, length, eps)


def _split_kernel(dense: bool) -> Any:
    """Huge groups: block tasks t0 <= t < t1, each its Welford partial or (``write``, once the groups are merged)
    its output; ``dense`` as in ``_rows_kernel``."""

    @rows_only("x", "out")
    @jit
    def group_norm_blocks(
        x: Any, w: Any, b: Any, n_sp: int, block: int, part: Any, out: Any, t0: int, t1: int, write: bool
    ) -> None:
        for t in range(t0, t1):
            _split_pass(x, w, b, n_sp, block, part, out, t, write, dense)

    return group_norm_blocks


GROUP_ROWS = by_density(_rows_kernel)
GROUP_SPLIT = by_density(_split_kernel)


def build_group_norm(
    src: Any, dst: Any, w: Any, b: Any, tiling: Any, eps: float, compute: Any
) -> Callable[[Any], None]:
    """Launch over (N, G, R, S) views, or (``tiling.pack``) through dense ``compute`` copies of the N-d ``src``
    and of ``w`` / ``b`` in the workspace. ``tiling``: groups, n_sp, split, block, pack, pack_offset,
    param_offset."""
    t = tiling
    if src.size == 0:
        return lambda _: None
    n = src.shape[0]
    shape4 = (n, t.groups, 1, src.size // (n * t.groups))
    if t.pack:
        sample = out_sample = np.empty((1, 1, 1, 1), compute)  # x, out: ``rows_only``
        p_sample = np.empty(1, compute)
    else:
        sample, out_sample, p_sample = src, dst, w
    part_sample = np.empty((1, 1, 3), np.float64)
    dense = t.pack or rows_dense(src, dst)
    rows = n * t.groups
    parts = fanout_parts() if src.size >= FANOUT_MIN else 1
    if t.split > 1:
        fn = entry(
            GROUP_SPLIT[dense],
            sample,
            p_sample,
            p_sample if t.pack else b,
            t.n_sp,
            t.block,
            part_sample,
            out_sample,
            0,
            0,
            False,
        )
        merge = entry(merge_partials, part_sample, 0, eps)
        blocks = split_range(rows * t.split, parts)
        length = src.size // rows

        def kernel(x: Any, wv: Any, bv: Any, out: Any, ws: Any) -> Callable[[], None]:
            part = ws[: rows * t.split * 24].view(np.float64).reshape(rows, t.split, 3)
            stats, writes = (
                [functools.partial(fn, x, wv, bv, t.n_sp, t.block, part, out, lo, hi, write) for lo, hi in blocks]
                for write in (False, True)
            )

            def two_passes() -> None:
                run_parts(stats)
                merge(part, length, eps)
                run_parts(writes)

            return two_passes
    else:
        fn = entry(GROUP_ROWS[dense], sample, p_sample, p_sample if t.pack else b, t.n_sp, eps, out_sample, 0, 0)
        groups = split_range(rows, parts)

        def calls(x: Any, wv: Any, bv: Any, out: Any) -> list[Callable[[], None]]:
            return [functools.partial(fn, x, wv, bv, t.n_sp, eps, out, lo, hi) for lo, hi in groups]

        if not t.pack:  # the views are fixed and no workspace is used: the parts are made here
            return launcher(calls(src, w, b, dst))

        def kernel(x: Any, wv: Any, bv: Any, out: Any, ws: Any) -> Callable[[], None]:
            return bound(calls(x, wv, bv, out))

    if not t.pack:
        return workspace_launcher(lambda ws: kernel(src, w, b, dst, ws))
    nbytes, pbytes = src.size * compute.itemsize, w.size * compute.itemsize

    def bind(ws: Any) -> Callable[[], None]:
        area = ws[t.pack_offset : t.pack_offset + nbytes].view(compute).reshape(src.shape)
        wv = ws[t.param_offset : t.param_offset + pbytes].view(compute)
        bv = ws[t.param_offset + t.param_stride : t.param_offset + t.param_stride + pbytes].view(compute)
        a4 = area.reshape(shape4)
        run = kernel(a4, wv, bv, a4, ws)

        def work() -> None:
            cast_copy(area, src)
            cast_copy(wv, w)
            cast_copy(bv, b)
            run()
            cast_copy(dst, area)

        return work

    return workspace_launcher(bind)
