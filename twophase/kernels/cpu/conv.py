"""conv2d launches on logical NCHW views (an NHWC tensor is passed transposed): 1x1 as GEMM, im2col into the
workspace tiled over output rows + GEMM, and a direct kernel (depthwise, or no workspace)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic
from numpy.lib.stride_tricks import as_strided

from ...layout import align, spread_stride
from ...runtime.fanout import fanout_parts, launcher, run_parts, split_range, workspace_launcher
from . import conv_phases, gemm
from . import jit as _jit
from .blas import run_blas_parts
from .jit import any_layout, by_density, copy_even, entry, host_has, pairs_of, row_of, rows_dense, rows_only, span_of

Launch = Callable[[Any], None]
Kernel = Callable[[Callable[..., Any]], Any]
jit: Kernel = _jit.jit  # the numba decorators, typed (jit.py leaves them untyped)
jit_inline: Kernel = _jit.jit_inline
PARALLEL_MIN = 1 << 20  # unfolded elements from which im2col's rows are cut into ranges for helper threads
# a strided direct kernel's multiply-adds count double towards PARALLEL_MIN: it ran ~2.5x slower per multiply-add
# than stride 1 (one thread, depthwise 3x3: 1 x 24 x 56^2 s1 0.68 M in 43 us, 1 x 128 x 56^2 s2 0.9 M in 143 us),
# and a helper starts 25-35 us after the launch here, so two parts pay from ~70 us of work (the s2 case: 108 us in
# two parts; the s1 one: 53 us; /tmp/w/dw.py of the ninth session)
STRIDED_WEIGHT = 2
# the 3x3 depthwise kernel runs ~0.04 ns per multiply-add at step 1 and ~0.11 at step 2 on one thread (1 x 256 x
# 28^2 s1 in 70 us, 1 x 128 x 56^2 s2 in 100 us: /tmp/w/dw3.py of the tenth session); through the op, two parts
# lost at 70-90 us of work and were even at ~120 (/tmp/w/dwop.py): they start from ~115 us
DW3X3_PARALLEL_MIN = 3 << 20
# planes up to this many elements take the depthwise kernel's masked flat loop, whose two masks (made in phase 1)
# are a byte per element; a larger plane's rows are long enough that fixing their edges row by row costs little
SAME3_MAX_PLANE = 1 << 16
DW3X3_STRIDED_WEIGHT = 3


@jit
def ow_range(off: int, sw: int, width: int, ow_n: int) -> tuple[int, int]:
    """Output columns whose input column ow*sw + off lies in [0, width), as [lo, hi) with lo <= hi <= ow_n (lo
    clamped: with padding wider than the window, no column may lie inside)."""
    lo = min(ow_n, max(0, (-off + sw - 1) // sw))
    hi = min(ow_n, (width - 1 - off) // sw + 1) if width - 1 - off >= 0 else 0
    return lo, max(hi, lo)


@jit_inline
def _bounds(off: int, step: int, size: int, n: int) -> Any:
    """``ow_range``, its step-1 form (3x3 stride-1 layers) compiled apart with the step a constant: no division
    per unfolded row."""
    return ow_range(off, 1, size, n) if step == 1 else ow_range(off, step, size, n)


@jit_inline
def _copy_span(dst: Any, d0: Any, src: Any, s0: Any, step: Any, n: Any) -> None:
    """dst[d0 + u] = src[s0 + u * step] for u < n, all unsigned."""
    if step == 1:
        for u in range(n):
            dst[d0 + u] = src[s0 + u]
    else:
        for u in range(n):
            dst[d0 + u] = src[s0 + u * step]


@jit_inline
def _zero(row: Any, a: Any, b: Any) -> None:
    """row[j] = 0 for a <= j < b."""
    for j in range(a, b):
        row[j] = 0


@jit_inline
def _plane_flat(p: Any) -> bool:
    """Whether a plane's rows lie back to back (row stride = row length)."""
    return bool(p.strides[0] == p.shape[1] * p.itemsize)


STEPS = (1, 2)  # column steps compiled in as constants; any other is read from ``geo`` (key 0)


def by_density_and_step(make: Callable[[bool, int], Any]) -> dict[tuple[bool, int], Any]:
    """A kernel's variants by (dense rows, column step: one of ``STEPS`` or 0), each made with both as closure
    constants (``jit.by_density``); phase 1 picks one with ``step_key``, so only it compiles."""
    return {(dense, step): make(dense, step) for dense in (True, False) for step in (0, *STEPS)}


def step_key(sw: int) -> int:
    """The ``by_density_and_step`` key of column step ``sw``."""
    return sw if sw in STEPS else 0


def _im2col_kernel(dense: bool, fixed_step: int) -> Any:
    PAIRS = dense and fixed_step == 2  # noqa: N806  (closure constant: the other variants compile no pair path)

    @rows_only("x")
    @jit
    def im2col(x: Any, n0: int, c0: int, oh0: int, geo: Any, cols: Any, k0: int, k1: int, kbase: int) -> None:
        """cols[k - kbase, (i*rows + r)*OW + ow] = x[n0 + i, c0 + c, (oh0 + r)*sh - ph + kh*dh, ow*sw - pw + kw*dw]
        (0 in the padding; k = (c*KH + kh)*KW + kw) for ``geo[9]`` images i and the unfolded rows ``k0 <= k < k1``
        (a range per helper thread, or a k block of a tile when ``kbase`` = k0); ``geo`` = (KH, KW, sh, sw, ph,
        pw, dh, dw, OW, images). Rows of x and cols typed
        dense when ``dense``; the column step a compile-time constant when ``fixed_step``. Step 2 copies a row's
        every other element by masked vector steps (``jit.copy_even``). (A step-1 unfold with OW = W over planes
        whose rows lie back to back is ``conv_phases.unfold_plane``'s: phase 1 picks it, ``flat``.)"""
        kh_n, kw_n, sh, sw, ph, pw = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
        dh, dw, ow_n, nn = geo[6], geo[7], geo[8], geo[9]
        height, width = x.shape[2], x.shape[3]
        rows = cols.shape[1] // (ow_n * nn)
        step = np.uint64(fixed_step if fixed_step else sw)
        c, kh, kw = conv_phases.tap_of(k0, kh_n, kw_n)  # stepped below without a division per k
        for k in range(k0, k1):
            off = kw * dw - pw
            lo, hi = _bounds(off, sw, width, ow_n)
            ih0 = oh0 * sh - ph + kh * dh  # the input row of output row 0
            r_lo, r_hi = _bounds(ih0, sh, height, rows)  # output rows whose input row is inside the image
            crow = row_of(cols, k - kbase, dense)
            for i in range(nn):
                plane = x[n0 + i, c0 + c]
                base = i * rows * ow_n
                _zero(crow, base, base + r_lo * ow_n)
                _zero(crow, base + r_hi * ow_n, base + rows * ow_n)
                if r_lo >= r_hi:
                    continue
                for r in range(r_lo, r_hi):
                    ih = ih0 + r * sh
                    d = base + r * ow_n
                    _zero(crow, d, d + lo)
                    _zero(crow, d + hi, d + ow_n)
                    xr = row_of(plane, ih, dense)
                    e = lo * sw + off  # the first column read
                    if PAIRS:  # masked vector steps (a 7- or 14-wide row is one): numba's loop ran scalar
                        copy_even(crow, d + lo, xr, e, hi - lo)
                    elif hi - lo >= 8:  # unsigned indices: no wrap-around selects, so the copy vectorizes
                        _copy_span(crow, np.uint64(d + lo), xr, np.uint64(e), step, np.uint64(hi - lo))
                    else:  # a short row (7-wide maps): the plain loop, faster than the vector loop's entry checks
                        for ow in range(lo, hi):
                            crow[d + ow] = xr[ow * sw + off]
            c, kh, kw = conv_phases.next_tap(c, kh, kw, kh_n, kw_n)

    return im2col


IM2COL = by_density_and_step(_im2col_kernel)


@jit_inline
def _tap(xp: Any, op: Any, wv: Any, lo: Any, s0: Any, cnt: Any, u_sw: Any, kh: int, geo: Any, dense: bool) -> None:
    """One kernel tap on one plane: op[oh, lo + u] += wv * xp[ih, s0 + u * sw] for every output row whose input
    row ih is inside the image; rows typed dense when ``dense`` (a constant at each call: ``jit.row_of``)."""
    sh, ph, dh = geo[2], geo[4], geo[6]
    height = xp.shape[0]
    for oh in range(op.shape[0]):
        ih = oh * sh - ph + kh * dh
        if ih < 0 or ih >= height:
            continue
        orow = row_of(op, oh, dense)
        xrow = row_of(xp, ih, dense)
        for u in range(cnt):
            orow[lo + u] += wv * xrow[s0 + u * u_sw]


def _direct_kernel(dense: bool) -> Any:
    @rows_only("x", "out")
    @jit
    def conv_direct(
        x: Any, w: Any, bias: Any, has_bias: bool, out: Any, geo: Any, groups: int, t0: int, t1: int
    ) -> None:
        """out[n, oc] = bias[oc] + sum over its group's channels and the kernel window (``geo`` as im2col's), for
        the (image, output channel) planes t0 <= t = n * OC + oc < t1 (a range per helper thread). Each kernel
        tap adds a shifted input row to an output row, indexed unsigned (no wrap-around select: the row loop
        vectorizes), the rows typed dense when ``dense`` (a closure constant: ``jit.by_density``)."""
        sw, pw, dw = geo[3], geo[5], geo[7]
        width = x.shape[3]
        oc_n, cg_n, kh_n, kw_n = w.shape
        ow_n = out.shape[3]
        ocg = oc_n // groups
        u_sw = np.uint64(sw)
        for t in range(t0, t1):
            n = t // oc_n
            oc = t - n * oc_n
            g = oc // ocg
            b0 = bias[oc] if has_bias else 0.0
            op = out[n, oc]
            for oh in range(op.shape[0]):  # by rows (row_of): the same code for out of any layout type
                orow = row_of(op, oh, dense)
                for j in range(ow_n):
                    orow[j] = b0
            for cg in range(cg_n):
                xp = x[n, g * cg_n + cg]
                for kh in range(kh_n):
                    for kw in range(kw_n):
                        wv = w[oc, cg, kh, kw]
                        off = kw * dw - pw
                        lo, hi = ow_range(off, sw, width, ow_n)
                        s0, cnt = np.uint64(lo * sw + off), np.uint64(hi - lo)
                        _tap(xp, op, wv, np.uint64(lo), s0, cnt, u_sw, kh, geo, dense)

    return conv_direct


CONV_DIRECT = by_density(_direct_kernel)


VEC = np.uint64(16)  # outputs per vector step of the 3x3 kernel's row loop (a float32 zmm register)


@jit_inline
def _window3(r0: Any, r1: Any, r2: Any, k: Any, wt: Any, b0: Any) -> Any:
    """A 3x3 window whose rows are r0, r1, r2 from column k (unsigned), weights ``wt`` row-major, plus b0."""
    one, two = np.uint64(1), np.uint64(2)
    return (
        b0
        + wt[0] * r0[k]
        + wt[1] * r0[k + one]
        + wt[2] * r0[k + two]
        + wt[3] * r1[k]
        + wt[4] * r1[k + one]
        + wt[5] * r1[k + two]
        + wt[6] * r2[k]
        + wt[7] * r2[k + one]
        + wt[8] * r2[k + two]
    )


@jit_inline
def _span3(o: Any, o0: Any, r0: Any, r1: Any, r2: Any, s0: Any, step: Any, cnt: Any, wt: Any, b0: Any) -> None:
    """o[o0 + u] = _window3(r0, r1, r2, s0 + u * step) for u < cnt (all unsigned); the tail as one more full vector
    overlapping outputs already written (a short scalar loop otherwise: 6 of a 54-wide row took half its time)."""
    main = cnt - cnt % VEC
    for u in range(main):
        o[o0 + u] = _window3(r0, r1, r2, s0 + u * step, wt, b0)
    if main < cnt:
        base = cnt - VEC if cnt >= VEC else main
        for u in range(VEC if cnt >= VEC else cnt - main):
            o[o0 + base + u] = _window3(r0, r1, r2, s0 + (base + u) * step, wt, b0)


@jit_inline
def _pairs3(q0: Any, q1: Any, q2: Any, m: Any, wt: Any, b0: Any) -> Any:
    """``_window3`` at the odd element of pair m of rows given as element pairs (``jit.pairs_of``): pair m's odd
    element, then both of pair m + 1. (From pair m's even element instead, LLVM reads the odd-only pair with
    gathers: an interleaved group with a gap at its end needs a scalar epilogue; one with a gap at its start
    does not.)"""
    one = np.uint64(1)
    a0, c0, a1, c1, a2, c2 = q0[m], q0[m + one], q1[m], q1[m + one], q2[m], q2[m + one]
    return (
        b0
        + wt[0] * a0.imag
        + wt[1] * c0.real
        + wt[2] * c0.imag
        + wt[3] * a1.imag
        + wt[4] * c1.real
        + wt[5] * c1.imag
        + wt[6] * a2.imag
        + wt[7] * c2.real
        + wt[8] * c2.imag
    )


@jit_inline
def _edge3(r0: Any, r1: Any, r2: Any, c0: int, width: int, wt: Any, b0: Any) -> Any:
    """``_window3`` from column c0 where some of its columns lie in the padding (skipped)."""
    acc = b0
    for kw in range(3):
        c = c0 + kw
        if 0 <= c < width:
            acc += wt[kw] * r0[c] + wt[3 + kw] * r1[c] + wt[6 + kw] * r2[c]
    return acc


@jit_inline
def _left3(r0: Any, r1: Any, r2: Any, wt: Any, b0: Any) -> Any:
    """``_window3`` from column -1 (padding 1: the window's first column in the padding), rows of 2+ columns."""
    return b0 + wt[1] * r0[0] + wt[2] * r0[1] + wt[4] * r1[0] + wt[5] * r1[1] + wt[7] * r2[0] + wt[8] * r2[1]


@jit_inline
def _right3(r0: Any, r1: Any, r2: Any, e: int, wt: Any, b0: Any) -> Any:
    """``_window3`` from column e - 1 of rows whose last column is e (the window's last column in the padding)."""
    return (
        b0 + wt[0] * r0[e - 1] + wt[1] * r0[e] + wt[3] * r1[e - 1] + wt[4] * r1[e] + wt[6] * r2[e - 1] + wt[7] * r2[e]
    )


@jit_inline
def _same3(xp: Any, op: Any, height: int, width: int, wt: Any, b0: Any, inner_l: Any, inner_r: Any) -> None:
    """A whole "same" 3x3 plane (stride 1, padding 1, height and width >= 3) given as flat dense spans ``xp`` and
    ``op``: every inner row in one loop over the flat index q, whose left and right columns read a
    neighbouring row's edge element, which the masks ``inner_l[q]`` (q's column is not the first) and
    ``inner_r[q]`` (not the last) select away; the first and last rows in their own loops (two input rows),
    then the six windows whose flat neighbours lie outside the plane. No per-row work: a 28-wide plane's row
    edges cost as much as its vector loop when fixed row by row."""
    u_w, one, z = np.uint64(width), np.uint64(1), op.dtype.type(0)
    w0, w1, w2, w3, w4, w5, w6, w7, w8 = wt
    last = (height - 1) * width  # the last row's first element
    for qi in range(width + 1, last - 1):
        q = np.uint64(qi)
        left = w0 * xp[q - u_w - one] + w3 * xp[q - one] + w6 * xp[q + u_w - one]
        right = w2 * xp[q - u_w + one] + w5 * xp[q + one] + w8 * xp[q + u_w + one]
        acc = b0 + w1 * xp[q - u_w] + w4 * xp[q] + w7 * xp[q + u_w]
        acc += left if inner_l[q] else z  # a select, not a multiply by 0: inf and NaN must not leak across
        acc += right if inner_r[q] else z
        op[q] = acc
    for qi in range(1, width - 1):
        q = np.uint64(qi)
        op[q] = (
            b0
            + w3 * xp[q - one]
            + w4 * xp[q]
            + w5 * xp[q + one]
            + w6 * xp[q + u_w - one]
            + w7 * xp[q + u_w]
            + w8 * xp[q + u_w + one]
        )
    for qi in range(last + 1, last + width - 1):
        q = np.uint64(qi)
        op[q] = (
            b0
            + w0 * xp[q - u_w - one]
            + w1 * xp[q - u_w]
            + w2 * xp[q - u_w + one]
            + w3 * xp[q - one]
            + w4 * xp[q]
            + w5 * xp[q + one]
        )
    e = width - 1
    op[0] = b0 + w4 * xp[0] + w5 * xp[1] + w7 * xp[width] + w8 * xp[width + 1]
    op[e] = b0 + w3 * xp[e - 1] + w4 * xp[e] + w6 * xp[e + width - 1] + w7 * xp[e + width]
    op[last] = b0 + w1 * xp[last - width] + w2 * xp[last - width + 1] + w4 * xp[last] + w5 * xp[last + 1]
    f = last + e
    op[f] = b0 + w0 * xp[f - width - 1] + w1 * xp[f - width] + w3 * xp[f - 1] + w4 * xp[f]
    q0 = width  # the second row's first window and the last but one row's last window
    op[q0] = (
        b0
        + w1 * xp[q0 - width]
        + w2 * xp[q0 - width + 1]
        + w4 * xp[q0]
        + w5 * xp[q0 + 1]
        + w7 * xp[q0 + width]
        + w8 * xp[q0 + width + 1]
    )
    q1 = last - 1
    op[q1] = (
        b0
        + w0 * xp[q1 - width - 1]
        + w1 * xp[q1 - width]
        + w3 * xp[q1 - 1]
        + w4 * xp[q1]
        + w6 * xp[q1 + width - 1]
        + w7 * xp[q1 + width]
    )


def same3_masks(height: int, width: int) -> tuple[Any, Any]:
    """``_same3``'s masks for a height x width plane: whether each flat index's column is not the first, and
    not the last (made in phase 1; a vector loop cannot take q % width cheaply)."""
    col = np.arange(height * width) % width
    return col != 0, col != width - 1


def _dw3x3_kernel(dense: bool, fixed_step: int) -> Any:
    FLAT = dense and fixed_step == 1  # noqa: N806  (closure constants: the other variants compile neither path)
    PAIRS = dense and fixed_step == 2  # noqa: N806

    @rows_only("x", "out")
    @jit
    def conv_dw3x3(
        x: Any,
        w: Any,
        bias: Any,
        has_bias: bool,
        out: Any,
        geo: Any,
        groups: int,
        t0: int,
        t1: int,
        inner_l: Any,
        inner_r: Any,
    ) -> None:
        """``conv_direct`` for 3x3 windows of one input channel each (depthwise), dilation 1: each output row is
        written once with its nine taps (``conv_direct`` reads and writes it once per tap). The column step is
        a compile-time constant when ``fixed_step``, else ``geo``'s. With dense planes, "same" padding at step 1
        runs each plane as ``_same3`` (``inner_l`` / ``inner_r``: its masks, ``same3_masks``); step 2 reads the
        rows as element pairs (no gathers). A window row in the padding reads a row of zeros, so rows at the
        top and bottom take the same loops as the others."""
        sh, sw, ph, pw = geo[2], geo[3], geo[4], geo[5]
        height, width = x.shape[2], x.shape[3]
        oc_n = w.shape[0]
        oh_n, ow_n = out.shape[2], out.shape[3]
        ocg = oc_n // groups
        step = np.uint64(fixed_step if fixed_step else sw)
        lo = ow_range(-pw, sw, width, ow_n)[0]  # columns [lo, hi): the whole window inside the image
        hi = max(lo, ow_range(2 - pw, sw, width, ow_n)[1])
        u_lo, cnt, s0 = np.uint64(lo), np.uint64(hi - lo), np.uint64(lo * sw - pw)
        same = pw == 1 and width >= 2 and ow_n == width  # "same" columns: edges 0 and W - 1, one window each
        flat = (
            FLAT
            and same
            and sh == 1
            and ph == 1
            and height >= 3
            and width >= 3
            and oh_n == height
            and inner_l.shape[0] == height * width
        )
        left1 = pw == 1 and width >= 2 and lo == 1  # column 0's window starts at -1 and reads columns 0 and 1
        # step 2, dense rows: the windows read as element pairs from the column before the first window's (a
        # window starting at column 0 is left to the float rows); pair u + 1's odd element is the last one
        # window u reads, so no pair reaches past the inner columns
        skip = 1 if lo * sw - pw == 0 and hi > lo else 0
        first = lo * sw - pw + 2 * skip - 1
        pair_cnt = np.uint64(hi - lo - skip)
        n_pairs = hi - lo - skip + 1
        zeros = np.zeros((1, width + 2), x.dtype)  # the input row of a window row in the padding
        for t in range(t0, t1):
            n = t // oc_n
            oc = t - n * oc_n
            xp = x[n, oc // ocg]
            op = out[n, oc]
            b0 = bias[oc] if has_bias else op.dtype.type(0)
            wt = (
                w[oc, 0, 0, 0],
                w[oc, 0, 0, 1],
                w[oc, 0, 0, 2],
                w[oc, 0, 1, 0],
                w[oc, 0, 1, 1],
                w[oc, 0, 1, 2],
                w[oc, 0, 2, 0],
                w[oc, 0, 2, 1],
                w[oc, 0, 2, 2],
            )
            if flat and _plane_flat(xp) and _plane_flat(op):
                _same3(
                    span_of(xp, 0, height * width),
                    span_of(op, 0, height * width),
                    height,
                    width,
                    wt,
                    b0,
                    inner_l,
                    inner_r,
                )
                continue
            for oh in range(oh_n):
                i0 = oh * sh - ph
                orow = row_of(op, oh, dense)
                r0 = row_of(xp, i0, dense) if 0 <= i0 < height else row_of(zeros, 0, dense)
                r1 = row_of(xp, i0 + 1, dense) if 0 <= i0 + 1 < height else row_of(zeros, 0, dense)
                r2 = row_of(xp, i0 + 2, dense) if 0 <= i0 + 2 < height else row_of(zeros, 0, dense)
                if PAIRS:
                    if skip:
                        orow[lo] = _window3(r0, r1, r2, s0, wt, b0)
                    if pair_cnt:
                        q0 = (
                            pairs_of(xp, i0, first, n_pairs) if 0 <= i0 < height else pairs_of(zeros, 0, first, n_pairs)
                        )
                        q1 = (
                            pairs_of(xp, i0 + 1, first, n_pairs)
                            if 0 <= i0 + 1 < height
                            else pairs_of(zeros, 0, first, n_pairs)
                        )
                        q2 = (
                            pairs_of(xp, i0 + 2, first, n_pairs)
                            if 0 <= i0 + 2 < height
                            else pairs_of(zeros, 0, first, n_pairs)
                        )
                        o0 = np.uint64(lo + skip)
                        for u in range(pair_cnt):  # a plain loop: the vector-step tail of _span3 unrolls
                            orow[o0 + u] = _pairs3(q0, q1, q2, u, wt, b0)  # into scalar shuffles here
                else:
                    _span3(orow, u_lo, r0, r1, r2, s0, step, cnt, wt, b0)
                if same:  # "same" padding 1 on 2+ columns: the two edge windows lack one column each
                    orow[0] = _left3(r0, r1, r2, wt, b0)
                    orow[width - 1] = _right3(r0, r1, r2, width - 1, wt, b0)
                    continue
                j0 = 0
                if left1:
                    orow[0] = _left3(r0, r1, r2, wt, b0)
                    j0 = 1
                for j in range(j0, lo):
                    orow[j] = _edge3(r0, r1, r2, j * sw - pw, width, wt, b0)
                for j in range(hi, ow_n):
                    orow[j] = _edge3(r0, r1, r2, j * sw - pw, width, wt, b0)

    return conv_dw3x3


CONV_DW3X3 = by_density_and_step(_dw3x3_kernel)


def _geo(t: Any, images: int = 1) -> Any:
    return np.array([t.kh, t.kw, t.sh, t.sw, t.ph, t.pw, t.dh, t.dw, t.ow, images], np.int64)


def build_direct(t: Any, x: Any, w: Any, bias: Any, out: Any) -> Launch:
    """Direct convolution, workspace 0; x and out are logical NCHW views; ranges of (image, output channel)
    planes on helper threads when the multiply-adds (weighted when strided) reach the kernel's threshold."""
    b = bias if bias is not None else np.zeros(1, x.dtype)
    geo = _geo(t)
    dense = rows_dense(x, out)
    has = bias is not None
    if t.cg == 1 and (t.kh, t.kw, t.dh, t.dw) == (3, 3, 1, 1):
        same = (
            (t.sh, t.sw, t.ph, t.pw, t.oh, t.ow) == (1, 1, 1, 1, t.h, t.w)
            and min(t.h, t.w) >= 3
            and t.h * t.w <= SAME3_MAX_PLANE
        )
        masks = same3_masks(t.h, t.w) if same and dense else (np.zeros(0, np.bool_),) * 2
        k = entry(CONV_DW3X3[dense, step_key(t.sw)], x, w, b, has, out, geo, t.groups, 0, 0, *masks)
        extra: tuple[Any, ...] = masks
        least, weight = DW3X3_PARALLEL_MIN, DW3X3_STRIDED_WEIGHT
    else:
        k = entry(CONV_DIRECT[dense], x, w, b, has, out, geo, t.groups, 0, 0)
        extra = ()
        least, weight = PARALLEL_MIN, STRIDED_WEIGHT
    planes = t.n * t.oc
    work = planes * t.cg * t.kh * t.kw * t.oh * t.ow
    work *= weight if (t.sh, t.sw) != (1, 1) else 1
    ranges = split_range(planes, fanout_parts() if work >= least else 1)
    return launcher([functools.partial(k, x, w, b, has, out, geo, t.groups, lo, hi, *extra) for lo, hi in ranges])


def _mat(a: Any, shape: tuple[int, ...], strides: tuple[int, ...]) -> Any:
    return as_strided(a, shape, tuple(s * a.itemsize for s in strides))


def _wmat(t: Any, w: Any, g: int) -> Any:
    """Weight rows of group g as an (OCg, Cg*KH*KW) matrix (its dims merge: checked in phase 1)."""
    wg = w[g * t.ocg : (g + 1) * t.ocg]
    return _mat(wg, (t.ocg, t.kc), (w.strides[0] // w.itemsize, t.w_kstride))


def build_gemm_1x1(t: Any, x: Any, w: Any, bias: Any, out: Any) -> Launch:
    """1x1 stride-1 convolution as GEMM per group: channel-major (NCHW out) or pixel-major (NHWC out)."""
    item = x.itemsize
    sx = [s // item for s in x.strides]
    so = [s // item for s in out.strides]
    hw = t.h * t.w
    calls = []
    for g in range(t.groups):
        wm = _wmat(t, w, g)
        xg, og = x[:, g * t.cg :], out[:, g * t.ocg :]
        if t.orient == "cm":
            a, bm = wm, _mat(xg, (t.n, t.cg, hw), (sx[0], sx[1], sx[3]))
            o = _mat(og, (t.n, t.ocg, hw), (so[0], so[1], so[3]))
            bv = None if bias is None else bias[g * t.ocg : (g + 1) * t.ocg, None]
        else:
            a, bm = _mat(xg, (t.n * hw, t.cg), (sx[3], sx[1])), wm.T
            o = _mat(og, (t.n * hw, t.ocg), (so[3], so[1]))
            bv = None if bias is None else bias[g * t.ocg : (g + 1) * t.ocg]
        calls.append((a, bm, o, bv))

    def launch(_: Any) -> None:
        for a, bm, o, bv in calls:
            np.matmul(a, bm, out=o)
            if bv is not None:
                np.add(o, bv, out=o)

    return launch


def _out_matrix(blk: Any, p: int, ocg: int, so: list[int], cm: bool) -> Any:
    """A tile's block of out (images x group channels x output rows, whose pixels merge) as the GEMM's result:
    (OCg, pixels) channel-major, (pixels, OCg) pixel-major."""
    return _mat(blk, (ocg, p), (so[1], so[3])) if cm else _mat(blk, (p, ocg), (so[3], so[1]))


def _tile_gemm(wm: Any, cols: Any, res: Any, cm: bool) -> None:
    """res = W @ cols (channel-major) or its transpose cols^T @ W^T (pixel-major), cols the (KC, pixels) unfold."""
    if cm:
        np.matmul(wm, cols, out=res)
    else:
        np.matmul(cols.T, wm.T, out=res)


def _cols(area: Any, kc: int, p: int, cm: bool) -> Any:
    """The (KC, pixels) unfold in a workspace area: C-contiguous (channel-major), else a transposed (pixels, KC)
    matrix, so the pixel-major GEMM reads its rows."""
    return area.reshape(kc, p) if cm else area.reshape(p, kc).T


def _unfold_kernel(t: Any, x: Any) -> Any:
    """The compiled im2col variant for these operands (dense rows, column step) and the tiling's orientation."""
    sample = np.empty((2, 2), x.dtype)  # C-contiguous cols (channel-major) or a transposed view (pixel-major)
    cm = t.orient == "cm"
    kernel = IM2COL[cm and rows_dense(x), step_key(t.sw)]
    return entry(kernel, x, 0, 0, 0, _geo(t), sample if cm else sample.T, 0, 0, 0)


def _plane_unfold(t: Any, x: Any) -> tuple[Any, Any]:
    """The compiled ``conv_phases.unfold_planes`` for these operands and its column masks for tiles of
    ``t.tile_rows`` output rows: the unfold of a tiling with ``flat``."""
    masks = conv_phases.plane_masks(t, t.tile_rows)
    cols = np.empty((2, 2), x.dtype)
    return entry(conv_phases.unfold_planes, x, 0, 1, 0, 0, 1, _geo(t), masks, cols, 0, 0, 0), masks


def _out_matrix_area(ws: Any, off: int, ocg: int, p: int, dt: Any, cm: bool) -> Any:
    """The staged GEMM result in the workspace's second area: (OCg, pixels) or (pixels, OCg)."""
    area = ws[off : off + ocg * p * dt.itemsize].view(dt)
    return area.reshape(ocg, p) if cm else area.reshape(p, ocg)


def _group_bias(bias: Any, g: int, ocg: int, cm: bool) -> Any:
    """Group g's bias, shaped to add to its GEMM result: a column (channel-major) or a row (pixel-major); None
    without bias."""
    if bias is None:
        return None
    bg = bias[g * ocg : (g + 1) * ocg]
    return bg[:, None] if cm else bg


_NO_PACK = np.zeros(0, np.float32)
_NO_BIAS = np.zeros(1, np.float32)


def _plain_gemm() -> Callable[[Any, Any, Any, int, int, int, int], None]:
    """``(a, b, c, i0, i1, j0, j1)``: ``c[i0:i1, j0:j1] = a[i0:i1] @ b[:, j0:j1]`` by the register-blocked float32
    GEMM (no bias, b read in place)."""
    fn = gemm.gemm_f32_entry()
    return lambda a, b, c, i0, i1, j0, j1: fn(a, b, c, _NO_BIAS, False, i0, i1, j0, j1, _NO_PACK)


def _micro_gemm(wm: Any, parts: tuple[tuple[int, int, int, int], ...]) -> Callable[[Any, Any], None] | None:
    """``(cols, res) -> res = wm @ cols`` by the register-blocked float32 GEMM, one call per part of ``parts``
    (blocks of res), on helper threads; None for no parts."""
    if not parts:
        return None
    mm = _plain_gemm()

    def run(cols: Any, res: Any) -> None:
        run_parts([functools.partial(mm, wm, cols, res, *p) for p in parts])

    return run


def build_im2col(t: Any, x: Any, w: Any, bias: Any, out: Any) -> Launch:
    """Per tile (``t.tile_n`` whole images, or ``t.tile_rows`` output rows of one image) and group: unfold into
    the workspace, one GEMM into out (or into the workspace's second area when the tile's output columns do
    not form one BLAS matrix in out, then one copy that adds the bias). The GEMM is the float32 microkernel's
    for a tile width ``t.micro`` gives parts for (phase 1 decided), else BLAS."""
    dt = x.dtype
    item = dt.itemsize
    so = [s // item for s in out.strides]
    cm = t.orient == "cm"
    kc, ow = t.kc, t.ow
    tn = t.tile_n
    staged = t.staged
    steps = []
    for n0 in range(0, t.n, tn):
        nn = min(tn, t.n - n0)
        for g in range(t.groups):
            wm = _wmat(t, w, g)
            bias_g = None if bias is None else bias[g * t.ocg : (g + 1) * t.ocg]
            bv = _group_bias(bias, g, t.ocg, cm)
            for oh0 in range(0, t.oh, t.tile_rows):
                rows = min(t.tile_rows, t.oh - oh0)
                blk = out[n0 : n0 + nn, g * t.ocg : (g + 1) * t.ocg, oh0 : oh0 + rows]
                p = nn * rows * ow
                if staged:  # out's images are not one matrix: GEMM into the workspace, then copy (+ bias)
                    o = _mat(blk, (nn, t.ocg, rows * ow), (so[0], so[1], so[3])) if cm else blk.transpose(0, 2, 3, 1)
                    bb = None if bias_g is None else (bias_g[None, :, None] if cm else bias_g)
                    steps.append((n0, nn, g * t.cg, oh0, p, wm, o, bb, True))
                else:  # one image, or pixel-major images that merge into one run of rows
                    steps.append((n0, nn, g * t.cg, oh0, p, wm, _out_matrix(blk, p, t.ocg, so, cm), bv, False))
    ranges = split_range(kc, t.parts)
    if t.phases:  # each range through its own phase area (``conv_phases``)
        area = conv_phases.images_area_floats(t, t.tile_rows, tn) * item
        areas = [(t.phase_offset + i * area, t.phase_offset + (i + 1) * area) for i in range(len(ranges))]
        masks = conv_phases.masks(t, t.tile_rows)
        sample, geo = np.empty((2, 2), dt), _geo(t)
        k_im2col = entry(conv_phases.unfold_images, x, 0, 1, 0, 0, 1, geo, sample[0], masks, sample, 0, 0, 0)
    elif t.flat:  # each range reads the input planes in place
        k_im2col, masks = _plane_unfold(t, x)
    else:
        k_im2col = _unfold_kernel(t, x)

    def unfold(n0: int, c0: int, oh0: int, geo: Any, cols: Any, ws: Any) -> None:
        if t.phases or t.flat:  # kernels over whole images from (n0, oh0): this tile's images and rows
            rows = min(t.tile_rows, t.oh - oh0)
            nn = cols.shape[1] // (rows * ow)
            head = (x, n0, nn, c0, oh0, rows, geo)
            if t.flat:
                calls = [functools.partial(k_im2col, *head, masks, cols, lo, hi, 0) for lo, hi in ranges]
            else:
                calls = [
                    functools.partial(k_im2col, *head, ws[a:b].view(dt), masks, cols, lo, hi, 0)
                    for (lo, hi), (a, b) in zip(ranges, areas)
                ]
            run_parts(calls)
            return
        run_parts([functools.partial(k_im2col, x, n0, c0, oh0, geo, cols, lo, hi, 0) for lo, hi in ranges])

    geos = {nn: _geo(t, nn) for nn in {min(tn, t.n - n0) for n0 in range(0, t.n, tn)}}
    o_off = t.out_offset
    ocg = t.ocg
    micro = dict(t.micro)
    gemms = [_micro_gemm(s[5], micro.get(s[4], ())) for s in steps]

    def launch(ws: Any) -> None:
        for (n0, nn, c0, oh0, p, wm, o, bv, stage), mk in zip(steps, gemms):
            cols = _cols(ws[: kc * p * item].view(dt), kc, p, cm)
            unfold(n0, c0, oh0, geos[nn], cols, ws)
            res = _out_matrix_area(ws, o_off, ocg, p, dt, cm) if stage else o
            if mk is None:
                _tile_gemm(wm, cols, res, cm)
            else:
                mk(cols, res)
            if stage:
                src = res.reshape(ocg, nn, p // nn).transpose(1, 0, 2) if cm else res.reshape(o.shape)
                if bv is None:
                    np.copyto(o, src)
                else:
                    np.add(src, bv, out=o)
            elif bv is not None:
                np.add(o, bv, out=o)

    return launch


def unfold_parts(t: Any) -> int:
    """Ranges of unfolded rows ``build_im2col`` cuts its unfold into, one per helper thread: the fan-out count
    from ``PARALLEL_MIN`` unfolded elements per tile, else 1 (phase 1 decides: a range may own a phase area)."""
    return fanout_parts() if t.kc * t.tile_n * t.tile_rows * t.ow >= PARALLEL_MIN else 1


def parts_units(t: Any) -> list[list[tuple[int, int, int, int]]]:
    """im2col_parts' work: per part, its (image, group, first output row, rows) units. The output rows of all
    (image, group) planes, stacked, are cut into ``t.parts`` contiguous ranges of nearly equal size; each range
    is cut at plane boundaries, and each piece into nearly equal runs of at most ``t.tile_rows`` rows."""
    out = []
    for lo, hi in split_range(t.n * t.groups * t.oh, t.parts):
        units = []
        while lo < hi:
            plane, r0 = divmod(lo, t.oh)
            end = min(hi, (plane + 1) * t.oh)
            pieces = -(-(end - lo) // t.tile_rows)
            for a, b in split_range(end - lo, pieces):
                units.append((plane // t.groups, plane % t.groups, r0 + a, b - a))
            lo = end
        out.append(units)
    return out


def parts_areas(t: Any, units: list[list[tuple[int, int, int, int]]], item: int) -> list[int]:
    """Workspace offsets of im2col_parts' unfold areas, one per part sized for its longest run, and the end of
    the last one: the workspace size."""
    offsets = [0]
    for part in units:
        offsets.append(offsets[-1] + align(t.kc * max(r for *_, r in part) * t.ow * item))
    return offsets


def build_im2col_parts(t: Any, x: Any, w: Any, bias: Any, out: Any) -> Launch:
    """im2col over ranges of output rows, one per part on the helper threads: each part unfolds its units into
    its own workspace area and multiplies them there with a one-thread GEMM (``run_blas_parts``), straight into
    out, adding the bias per unit. The unfold stays in the cache of the thread that reads it, and no thread
    waits on another between the unfold and the GEMM."""
    dt = x.dtype
    item = dt.itemsize
    so = [s // item for s in out.strides]
    cm = t.orient == "cm"
    kc, ow, ocg = t.kc, t.ow, t.ocg
    geo = _geo(t)
    if t.flat:  # the input planes read in place
        k_planes, masks = _plane_unfold(t, x)

        def unfold(n0: int, c0: int, oh0: int, rows: int, cols: Any) -> Callable[[], None]:
            return functools.partial(k_planes, x, n0, 1, c0, oh0, rows, geo, masks, cols, 0, kc, 0)
    else:
        k_im2col = _unfold_kernel(t, x)

        def unfold(n0: int, c0: int, oh0: int, rows: int, cols: Any) -> Callable[[], None]:
            return functools.partial(k_im2col, x, n0, c0, oh0, geo, cols, 0, kc, 0)

    wms = [_wmat(t, w, g) for g in range(t.groups)]
    bvs = [_group_bias(bias, g, ocg, cm) for g in range(t.groups)]
    units = parts_units(t)
    offsets = parts_areas(t, units, item)

    def bind(ws: Any) -> Callable[[], None]:
        parts = []
        for part, at in zip(units, offsets):
            work = []
            for n0, g, oh0, rows in part:
                p = rows * ow
                cols = _cols(ws[at : at + kc * p * item].view(dt), kc, p, cm)
                o = _out_matrix(out[n0 : n0 + 1, g * ocg : (g + 1) * ocg, oh0 : oh0 + rows], p, ocg, so, cm)
                work.append((unfold(n0, g * t.cg, oh0, rows, cols), cols, wms[g], o, bvs[g]))
            parts.append(functools.partial(_run_units, work, cm))
        return functools.partial(run_blas_parts, parts)

    return workspace_launcher(bind)


def _run_units(work: list[tuple[Any, ...]], cm: bool) -> None:
    """One im2col_parts part: each unit unfolded (its unfold bound when the workspace was), multiplied into out,
    its bias added."""
    for unfold, cols, wm, o, bv in work:
        unfold()
        _tile_gemm(wm, cols, o, cm)
        if bv is not None:
            np.add(o, bv, out=o)


# ---- Winograd F(2x2, 3x3): 3x3, stride 1, dilation 1, one group; 16 GEMMs of (OC, C) x (C, tiles)
# U, V and M are each held as 16 rows of a C-contiguous 2-d buffer (row k: matrix k flattened, rows
# ``spread_stride`` apart), so the transforms' inner loops see unit strides and vectorize.
@jit_inline
def _wino_w_row(u: Any, i: int, at: int, a0: float, a1: float, a2: float) -> None:
    u[4 * i, at] = a0
    u[4 * i + 1, at] = 0.5 * (a0 + a1 + a2)
    u[4 * i + 2, at] = 0.5 * (a0 - a1 + a2)
    u[4 * i + 3, at] = a2


def _wino_weight_blocks_typing(typingctx: Any, w: Any, u: Any, su: Any, at: Any, blocks: Any) -> Any:
    """``wino_weights`` for ``blocks`` runs of 16 (oc, c) pairs from flat pair ``at`` on (pair p's taps the 9 floats
    from float 9p of the float32 weight at address ``w``; output k of pair p at float ``k * su + p`` of ``u``), as
    vectors: the 16 pairs' 144 floats in one load, each tap's 16 picked by a shuffle, the sums in the scalar form's
    precisions (float32 where it adds float32, float64 after its 0.5 *), 16 stores of 16 floats."""
    sig = types.void(types.int64, types.int64, types.int64, types.int64, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        w_addr, u_addr, su_n, at0, count = args
        i32, i64 = ir.IntType(32), ir.IntType(64)
        f32, f64 = ir.FloatType(), ir.DoubleType()
        wide, v32, v64 = ir.VectorType(f32, 144), ir.VectorType(f32, 16), ir.VectorType(f64, 16)
        wp, up = builder.inttoptr(w_addr, f32.as_pointer()), builder.inttoptr(u_addr, f32.as_pointer())
        half = ir.Constant(v64, [0.5] * 16)

        def widen(x: Any) -> Any:
            return builder.fpext(x, v64) if x.type == v32 else x

        def out_row(a0: Any, a1: Any, a2: Any) -> list[Any]:
            # _wino_w_row: a0, 0.5 * (a0 + a1 + a2), 0.5 * (a0 - a1 + a2), a2, its sums in its arguments' type
            plus = builder.fadd(builder.fadd(a0, a1), a2)
            minus = builder.fadd(builder.fsub(a0, a1), a2)
            return [a0, builder.fmul(half, widen(plus)), builder.fmul(half, widen(minus)), a2]

        with cgutils.for_range(builder, count) as loop:
            at = builder.add(at0, builder.mul(loop.index, ir.Constant(i64, 16)))
            src = builder.gep(wp, [builder.mul(at, ir.Constant(i64, 9))])
            taps = builder.load(builder.bitcast(src, wide.as_pointer()), align=4)
            g = [
                builder.shuffle_vector(
                    taps, ir.Constant(wide, None), ir.Constant(ir.VectorType(i32, 16), [t + 9 * p for p in range(16)])
                )
                for t in range(9)
            ]
            col = [out_row(g[j], g[3 + j], g[6 + j])[1:3] for j in range(3)]  # G's middle rows, per tap column
            rows = [(g[0], g[1], g[2]), tuple(c[0] for c in col), tuple(c[1] for c in col), (g[6], g[7], g[8])]
            for i, (a0, a1, a2) in enumerate(rows):
                for j, val in enumerate(out_row(a0, a1, a2)):
                    dst = builder.gep(up, [builder.add(builder.mul(ir.Constant(i64, 4 * i + j), su_n), at)])
                    x = builder.fptrunc(val, v32) if val.type == v64 else val
                    builder.store(x, builder.bitcast(dst, v32.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


_wino_weight_blocks: Any = intrinsic(_wino_weight_blocks_typing)
# where the weight transform goes 16 pairs at a time: measured on AVX-512 only (AMD Zen 4; there the 144-float
# load and its shuffles are 9 zmm loads and permutes); elsewhere pair by pair, as before
WINO_WEIGHT_BLOCKS = host_has("avx512f")


@jit
def wino_weights(w: Any, u: Any, oc0: int, oc1: int) -> None:
    """u[4*i + j, oc*C + c] = (G g G^T)[i, j] for g = w[oc, c], G = [[1, 0, 0], [.5, .5, .5], [.5, -.5, .5],
    [0, 0, 1]], output channels ``oc0 <= oc < oc1`` (a range per helper thread). A dense float32 weight goes 16
    (oc, c) pairs at a time (``_wino_weight_blocks``, the same bits; ``WINO_WEIGHT_BLOCKS``), the rest pair by
    pair: each pair reads its 9 taps 9 floats from the next pair's and writes one float to each of 16 rows of u,
    which LLVM left scalar (16 store streams that may alias w). One thread, AMD Zen 4 (/tmp/w67/ww.py, ww2.py of
    the sixty-seventh session): 512 x 512 x 3 x 3 1.27-1.31 against 1.90-2.00 ms (0.41 ms to fill u's 16 MiB),
    256 x 256 0.16 against 0.40; through the op, 11 interleaved rounds, 8 x 512^2 7^2 (winograd) 1.04x faster on
    two threads, 1.03x on one, 8 x 256^2 14^2 1.00x and 1.01x."""
    c_n = w.shape[1]
    p = oc0 * c_n  # the first pair left to the scalar loop
    if WINO_WEIGHT_BLOCKS and w.itemsize == 4 and u.itemsize == 4 and u.strides[1] == 4 and w.flags.c_contiguous:
        blocks = (oc1 * c_n - p) // 16
        _wino_weight_blocks(w.ctypes.data, u.ctypes.data, u.strides[0] // 4, p, blocks)
        p += 16 * blocks
    for oc in range(p // c_n if c_n else oc1, oc1):
        for c in range(max(0, p - oc * c_n), c_n):
            at = oc * c_n + c
            g00, g01, g02 = w[oc, c, 0, 0], w[oc, c, 0, 1], w[oc, c, 0, 2]
            g10, g11, g12 = w[oc, c, 1, 0], w[oc, c, 1, 1], w[oc, c, 1, 2]
            g20, g21, g22 = w[oc, c, 2, 0], w[oc, c, 2, 1], w[oc, c, 2, 2]
            _wino_w_row(u, 0, at, g00, g01, g02)
            _wino_w_row(u, 1, at, 0.5 * (g00 + g10 + g20), 0.5 * (g01 + g11 + g21), 0.5 * (g02 + g12 + g22))
            _wino_w_row(u, 2, at, 0.5 * (g00 - g10 + g20), 0.5 * (g01 - g11 + g21), 0.5 * (g02 - g12 + g22))
            _wino_w_row(u, 3, at, g20, g21, g22)


# wino_fused_gemms: output channels a part transforms at a time (a multiple of gemm.MR; 16 * 48 * C floats of
# scratch, 1.5 MiB at C = 512), and the most tiles of a round it takes: each block of rows reads all of V again,
# so the wider V, the less the fusion saves. AMD Zen 4, two threads, forced winograd, 9-15 interleaved rounds
# against the unfused code (/tmp/w68/abf.py, ab.py of the sixty-eighth session), t(unfused) / t(fused): 2 x 512^2
# 7^2 (32 tiles) 1.17x, 4 x 512^2 7^2 (64) 1.13x, 8 x 512^2 7^2 (128) 1.06-1.12x (one thread 1.06x), 1 x 256^2
# 14^2 (49) 1.02x, 2 x 256^2 14^2 (98) 1.04x, 1 x 512^2 14^2 (49) 1.00x; past 128 tiles: 4 x 256^2 14^2 (196)
# 1.00x, 16 x 512^2 7^2 (256) 0.98x, 8 x 256^2 14^2 (392) 0.98-1.02x, 8 x 128^2 28^2 (1568) 0.91x. Rows 24, 36
# and 96 ran within 2.5% of 48 on 8 x 512^2 7^2 (11 rounds, fab2.py), workspace 10.0, 10.8 and 14.7 against
# 11.5 MiB (25.2 unfused). Its GEMMs on gemm_tile instead of gemm_f32 (sixty-ninth session): the 16 GEMMs of a
# 48-channel block over 49 tiles ran 92-100 GFLOP/s against 73-83 (one thread, /tmp/w69/fz.py), and through the op
# 0.99-1.02x as fast at 32-128 tiles (two threads, 13 rounds, /tmp/w69/bo2.py)
WINO_FUSED_ROWS = 48
WINO_FUSED_MAX_TILES = 128


@jit
def wino_fused_gemms(w: Any, us: Any, um: Any, v: Any, m: Any, oc0: int, oc1: int, rows: int) -> None:
    """M[k, oc] = U[k, oc] @ V[k] for output channels ``oc0 <= oc < oc1``, ``rows`` at a time: their weights
    transformed (``wino_weights``) into the part's own 16 scratch rows ``us`` (``um``: the same memory as 16
    (rows, C) matrices), then their 16 GEMMs on the register-blocked kernel (``gemm.gemm_tile``, V's rows read in
    place) while those weights are still in cache. U never goes through memory whole: written, then read back by
    the GEMMs, its 16 * OC * C floats did (16 MiB at 512 -> 512). ``gemm_tile`` reads V's rows up to the next
    multiple of 16 columns: past the last matrix's last row lie M's rows (``build_winograd``)."""
    nt, c = v.shape[2], v.shape[1]
    item = 4
    ldu, ldv, ldm = um.strides[1] // item, v.strides[1] // item, m.strides[1] // item
    for b0 in range(oc0, oc1, rows):
        nb = min(oc1, b0 + rows) - b0
        wino_weights(w[b0 : b0 + nb], us, 0, nb)
        for k in range(16):
            pm = m[k].ctypes.data + b0 * ldm * item
            gemm.gemm_tile(um[k].ctypes.data, ldu, 1, v[k].ctypes.data, ldv, pm, ldm, c, nb, nt, 0, 0, 0)


@jit_inline
def _tile_run(t: int, end: int, per_img: int, tw_n: int) -> tuple[int, int, int, int]:
    """(image, tile row, first and past-last tile column) of the run of tiles from tile t that stays in one row of
    tiles and before ``end``."""
    n = t // per_img
    r = t - n * per_img
    ty = r // tw_n
    tx0 = r - ty * tw_n
    return n, ty, tx0, min(tw_n, tx0 + end - t)


@jit_inline
def _deinterleave(x: Any, n: int, c: int, yy: int, pw: int, ev: Any, od: Any) -> None:
    """ev[j] = d[2j], od[j] = d[2j + 1] for the input row d = x[n, c, yy, . - pw] zero padded."""
    width = x.shape[3]
    nj = ev.shape[0]
    row = x[n, c, yy]
    lo = min((pw + 1) // 2, nj)  # j in [lo, hi): both columns 2j - pw and 2j + 1 - pw inside [0, width)
    hi = max(lo, min(nj, (width + pw) // 2))
    u_lo, base, one, two = np.uint64(lo), np.uint64(2 * lo - pw), np.uint64(1), np.uint64(2)
    for u in range(np.uint64(hi - lo)):  # unsigned indices: no wrap-around select (3x faster here)
        ev[u_lo + u] = row[base + two * u]
        od[u_lo + u] = row[base + two * u + one]
    for e in range(lo + nj - hi):  # the padded edges: j < lo, then j >= hi
        j = e if e < lo else hi + e - lo
        ce = 2 * j - pw
        ev[j] = row[ce] if 0 <= ce < width else 0.0
        od[j] = row[ce + 1] if 0 <= ce + 1 < width else 0.0


@jit_inline
def _wino_input(x: Any, v: Any, c: int, t0: int, nt: int, geo: Any, ev: Any, od: Any) -> None:
    """Tiles t0 .. t0 + nt of channel c, a row of tiles at a time: the 4 padded input rows split into even and
    odd columns, B^T down the columns, then B across each tile's 4 columns (unit strides throughout)."""
    ph, pw, th_n, tw_n = geo[0], geo[1], geo[2], geo[3]
    height = x.shape[2]
    per_img = th_n * tw_n
    nj = ev.shape[1]
    end = t0 + nt
    t = t0
    while t < end:
        n, ty, tx0, tx1 = _tile_run(t, end, per_img, tw_n)
        for i in range(4):
            yy = 2 * ty - ph + i
            if yy < 0 or yy >= height:
                for j in range(nj):
                    ev[i, j] = 0.0
                    od[i, j] = 0.0
            else:
                _deinterleave(x, n, c, yy, pw, ev[i], od[i])
        for a in (ev, od):  # B^T d: (d0 - d2, d1 + d2, d2 - d1, d1 - d3)
            for j in range(nj):
                d0, d1, d2, d3 = a[0, j], a[1, j], a[2, j], a[3, j]
                a[0, j], a[1, j], a[2, j], a[3, j] = d0 - d2, d1 + d2, d2 - d1, d1 - d3
        u_at, u_tx0, one = np.uint64(c * nt + t - t0), np.uint64(tx0), np.uint64(1)
        for i in range(4):
            e_i, o_i = ev[i], od[i]
            v0, v1, v2, v3 = v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]
            for u in range(np.uint64(tx1 - tx0)):
                k, d = u_tx0 + u, u_at + u
                a0, a1, a2, a3 = e_i[k], o_i[k], e_i[k + one], o_i[k + one]
                v0[d] = a0 - a2
                v1[d] = a1 + a2
                v2[d] = a2 - a1
                v3[d] = a1 - a3
        t += tx1 - tx0


@jit
def wino_input(x: Any, v: Any, t0: int, nt: int, geo: Any, scratch: Any, c0: int, c1: int) -> None:
    """v[4*i + j, c*nt + t - t0] = (B^T d B)[i, j] for the 4x4 input patch d of tile t (zero padded), channels
    ``c0 <= c < c1`` (a range per helper thread); ``geo`` = (ph, pw, tiles per column, tiles per row);
    ``scratch`` (8, tiles per row + 1), this part's rows in the workspace (even then odd columns of 4 input
    rows)."""
    for c in range(c0, c1):
        _wino_input(x, v, c, t0, nt, geo, scratch[:4], scratch[4:])


@jit_inline
def _wino_output(m: Any, bias: Any, has_bias: bool, out: Any, oc: int, t0: int, nt: int, geo: Any, s: Any) -> None:
    """Tiles of output channel oc, a row of tiles at a time: A^T down the 4 rows (vectorized over the tiles),
    then A across, + bias, into out's 2x2 blocks (clipped at the edges)."""
    th_n, tw_n = geo[2], geo[3]
    oh_n, ow_n = out.shape[2], out.shape[3]
    per_img = th_n * tw_n
    b0 = bias[oc] if has_bias else 0.0
    end = t0 + nt
    t = t0
    while t < end:
        n, ty, tx0, tx1 = _tile_run(t, end, per_img, tw_n)
        u_at, u_tx0, one, two = np.uint64(oc * nt + t - t0), np.uint64(tx0), np.uint64(1), np.uint64(2)
        for j in range(4):  # A^T m: (m0 + m1 + m2, m1 - m2 - m3) per column j of each tile (unsigned indices)
            m0, m1, m2, m3 = m[j], m[4 + j], m[8 + j], m[12 + j]
            s0, s1 = s[j], s[4 + j]
            for u in range(np.uint64(tx1 - tx0)):
                k, d = u_tx0 + u, u_at + u
                a0, a1, a2, a3 = m0[d], m1[d], m2[d], m3[d]
                s0[k] = a0 + a1 + a2
                s1[k] = a1 - a2 - a3
        whole = min(tx1, ow_n // 2)  # tiles whose two output columns are both inside
        for i in range(2):
            y = 2 * ty + i
            if y >= oh_n:
                continue
            orow = out[n, oc, y]
            r0, r1, r2, r3 = s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]
            for u in range(np.uint64(max(whole - tx0, 0))):
                k = u_tx0 + u
                a0, a1, a2, a3 = r0[k], r1[k], r2[k], r3[k]
                orow[two * k] = a0 + a1 + a2 + b0
                orow[two * k + one] = a1 - a2 - a3 + b0
            for tx in range(max(whole, tx0), tx1):
                out[n, oc, y, 2 * tx] = s[4 * i, tx] + s[4 * i + 1, tx] + s[4 * i + 2, tx] + b0
        t += tx1 - tx0


@jit
def wino_output(
    m: Any, bias: Any, has_bias: bool, out: Any, t0: int, nt: int, geo: Any, scratch: Any, oc0: int, oc1: int
) -> None:
    """out's 2x2 block of tile t = A^T m A + bias, m[4*i + j, oc*nt + t - t0], A^T = [[1, 1, 1, 0],
    [0, 1, -1, -1]], output channels ``oc0 <= oc < oc1``; ``scratch`` (8, tiles per row), this part's rows in the
    workspace."""
    for oc in range(oc0, oc1):
        _wino_output(m, bias, has_bias, out, oc, t0, nt, geo, scratch)


def spread_rows(ws: Any, offset: int, stride: int, dt: np.dtype[Any], count: int = 16) -> Any:
    """The ``count`` rows, ``stride`` bytes apart (``spread_stride``), that hold a winograd's U, V or M: a
    C-contiguous (count, .)."""
    return ws[offset : offset + count * stride].view(dt).reshape(count, stride // dt.itemsize)


def matrices(rows: Any, r: int, c: int) -> Any:
    """The same memory as one (r, c) matrix per row, for the GEMMs."""
    return as_strided(rows, (rows.shape[0], r, c), (rows.strides[0], c * rows.itemsize, rows.itemsize))


def winograd_parts(oc: int, c: int, tiles: int, count: int = 16) -> int:
    """Helper-thread parts of a winograd launch with ``count`` transformed matrices (phase 1: the workspace holds
    a scratch row set per part): the fan-out count for large problems, at most the channel counts (every part
    then has channels to do)."""
    if count * (oc * c + (c + oc) * tiles) < PARALLEL_MIN:
        return 1
    return max(1, min(fanout_parts(), oc, c, count))


Part = Callable[[], None]
Round = tuple[list[Part], list[Part], list[Part]]


def gemm_parts(u: Any, v: Any, m: Any, ranges: list[tuple[int, int]]) -> list[Part]:
    """A winograd round's batched GEMMs M = U @ V (one matrix per transformed tile element) in batch ranges."""
    return [functools.partial(np.matmul, u[lo:hi], v[lo:hi], out=m[lo:hi]) for lo, hi in ranges]


def micro_gemm_parts(u: Any, v: Any, m: Any, ranges: list[tuple[int, int]]) -> list[Part]:
    """``gemm_parts`` by the register-blocked float32 GEMM: each part multiplies its range of the matrices."""
    mm = _plain_gemm()
    rows, cols = u.shape[1], v.shape[2]

    def run(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            mm(u[i], v[i], m[i], 0, rows, 0, cols)

    return [functools.partial(run, lo, hi) for lo, hi in ranges]


class KeptWeights:
    """A winograd's transformed weights kept by one binding of an executor planned with ``constant_weight``: made
    at binding (memory the binding owns, not the workspace), written by the first launch that completes, read by
    every later one (``ready``). ``rows``: the ``count`` matrices' rows, ``stride`` bytes apart, 64-byte aligned."""

    __slots__ = ("rows", "ready")

    def __init__(self, count: int, stride: int, dt: np.dtype[Any]) -> None:
        raw = np.empty(count * stride + 64, np.uint8)
        start = -raw.ctypes.data % 64
        self.rows = spread_rows(raw[start : start + count * stride], 0, stride, dt, count)
        self.ready = False


def kept_weights(store: dict[str, Any] | None, weight: Any, count: int, stride: int, dt: np.dtype[Any]) -> KeptWeights:
    """The binding's ``KeptWeights``: those in the executor's ``store`` while it stays bound to the same ``weight``
    block (a rebinding of its input or output keeps them, already transformed), else new ones, kept there."""
    held = None if store is None else store.get("kept_weights")
    if held is not None and held[0] is weight:  # one executor: one plan, so the same count, stride and dtype
        kept: KeptWeights = held[1]
        return kept
    kept = KeptWeights(count, stride, dt)
    if store is not None:
        store["kept_weights"] = (weight, kept)
    return kept


def weight_rows(ws: Any, kept: KeptWeights | None, stride: int, dt: np.dtype[Any], count: int) -> Any:
    """U's rows: the kept weights', else the workspace's first area."""
    return kept.rows if kept is not None else spread_rows(ws, 0, stride, dt, count)


def winograd_launch(rounds: Callable[[Any], list[Round]], kept: KeptWeights | None = None) -> Launch:
    """The phase-2 launch of a winograd (F(2x2, 3x3) or ``winograd4``'s F(4x4, 3x3)): per round, the transform
    parts, the GEMM parts (one BLAS thread each) and the output transform parts, each set a hand-off to the
    helper threads. ``rounds(ws)`` binds them to the workspace's views, again only when the workspace changes
    (``workspace_launcher``), so a repeated launch builds no views or partials. ``kept``: weights transformed once,
    ready from the end of the first launch that completes."""

    def bind(ws: Any) -> Part:
        steps = rounds(ws)

        def run() -> None:
            for transforms, gemms, outputs in steps:
                run_parts(transforms)
                run_blas_parts(gemms)
                run_parts(outputs)
            if kept is not None:
                kept.ready = True

        return run

    return workspace_launcher(bind)


def build_winograd(
    t: Any, x: Any, w: Any, bias: Any, out: Any, keep: Callable[[int, int, np.dtype[Any]], KeptWeights]
) -> Launch:
    """Transformed weights U (16, OC, C) (kept by the binding instead with ``t.own_weights``: transformed by its
    first launch only; ``keep(count, stride, dtype)`` gives them, ``kept_weights`` from the executor's store),
    per round of ``t.chunk`` 2x2 output tiles the transformed input V (16, C, chunk) and M =
    U @ V (16, OC, chunk) in the workspace, then the output transform (+ bias); the
    transforms' scratch rows (a set per part) are in the workspace too (no allocation in the launch). The 16
    matrices of U, V and M lie ``spread_stride`` apart (the transforms write or read all 16 at once). The GEMMs
    of a round whose width ``t.micro`` gives blocks for run on the float32 microkernel, else on BLAS. With
    ``t.parts`` > 1 the weight and input transforms run as channel ranges, the 16 GEMMs as batch ranges (one BLAS
    thread each) and the output transform as channel ranges, on helper threads. (Tile ranges, each part doing
    its own transforms and GEMM columns in one hand-off, measured 10-20% slower on ResNet-18 shapes.) With
    ``t.fused_rows`` (one round): no U in the workspace; the GEMMs run as output-channel ranges, each part
    transforming its weights ``t.fused_rows`` channels at a time into scratch of its own (``wino_fused_gemms``)."""
    dt = x.dtype
    item = dt.itemsize
    th_n, tw_n = (t.oh + 1) // 2, (t.ow + 1) // 2
    tiles = t.n * th_n * tw_n
    chunk, parts, rows = t.chunk, t.parts, t.fused_rows
    geo = np.array([t.ph, t.pw, th_n, tw_n], np.int64)
    b = bias if bias is not None else np.zeros(1, dt)
    has = bias is not None
    su, sv, sm = (spread_stride(n * item) for n in (t.oc * t.c, t.c * chunk, t.oc * chunk))
    sf = spread_stride(rows * t.c * item) if rows else 0  # fused: a part's scratch row, ``rows`` channels' weights
    kept = keep(16, su, dt) if t.own_weights else None
    o_v = 16 * parts * sf if rows else (0 if kept is not None else 16 * su)  # where V starts: after U or the scratch
    o_m = o_v + 16 * sv
    o_si = o_m + 16 * sm  # per-part scratch rows of the two transforms, on lines of their own (no false sharing)
    si_b, so_b = align(8 * (tw_n + 1) * item), align(8 * tw_n * item)
    o_so = o_si + parts * si_b
    s2 = np.empty((1, 1), dt)
    c_ranges, oc_ranges, k_ranges = split_range(t.c, parts), split_range(t.oc, parts), split_range(16, parts)
    k_w = entry(wino_weights, w, s2, 0, 0)
    k_in = entry(wino_input, x, s2, 0, 0, geo, s2, 0, 0)
    k_out = entry(wino_output, s2, b, has, out, 0, 0, geo, s2, 0, 0)
    if rows:
        mats = any_layout(dt, 3)
        k_fused = entry(wino_fused_gemms, w, s2, mats, mats, mats, 0, 0, 0)
    rounds_at = [(t0, min(chunk, tiles - t0)) for t0 in range(0, tiles, chunk)]
    c, oc = t.c, t.oc
    micro = {width for width, blocks in t.micro if blocks}  # round widths whose GEMMs take the microkernel

    def rounds(ws: Any) -> list[Round]:
        u = None if rows else weight_rows(ws, kept, su, dt, 16)
        v, m = spread_rows(ws, o_v, sv, dt), spread_rows(ws, o_m, sm, dt)
        s_in = [
            ws[o_si + i * si_b : o_si + i * si_b + 8 * (tw_n + 1) * item].view(dt).reshape(8, tw_n + 1)
            for i in range(parts)
        ]
        s_out = [
            ws[o_so + i * so_b : o_so + i * so_b + 8 * tw_n * item].view(dt).reshape(8, tw_n) for i in range(parts)
        ]

        def gemms(nt: int) -> list[Part]:
            vm, mm = matrices(v, c, nt), matrices(m, oc, nt)
            if rows:  # the one round: weights transformed by the GEMM parts, into their scratch
                us = [spread_rows(ws, i * 16 * sf, sf, dt) for i in range(parts)]
                return [
                    functools.partial(k_fused, w, us[i], matrices(us[i], rows, c), vm, mm, *oc_ranges[i], rows)
                    for i in range(parts)
                ]
            return (micro_gemm_parts if nt in micro else gemm_parts)(matrices(u, oc, c), vm, mm, k_ranges)

        return [
            (
                [functools.partial(transform_in, u, v, t0, nt, r == 0 and not rows, s_in[i], i) for i in range(parts)],
                gemms(nt),
                [functools.partial(k_out, m, b, has, out, t0, nt, geo, s_out[i], *oc_ranges[i]) for i in range(parts)],
            )
            for r, (t0, nt) in enumerate(rounds_at)
        ]

    def transform_in(u: Any, v: Any, t0: int, nt: int, first: bool, scratch: Any, i: int) -> None:
        """Part i of the weight transform (first round only, unless kept from an earlier launch: its output
        channels) and of the input transform (its input channels)."""
        if first and (kept is None or not kept.ready):
            k_w(w, u, *oc_ranges[i])
        k_in(x, v, t0, nt, geo, scratch, *c_ranges[i])

    return winograd_launch(rounds, kept)
