"""conv2d launches on logical NCHW views (an NHWC tensor is passed transposed): 1x1 as GEMM, im2col into the
workspace tiled over output rows + GEMM, and a direct kernel (depthwise, or no workspace)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numpy.lib.stride_tricks import as_strided

from .jit import FAST, entry, jit, jit_par

Launch = Callable[[Any], None]
jit_inline = numba.njit(nogil=True, cache=True, fastmath=FAST, error_model="numpy", inline="always")
PARALLEL_MIN = 1 << 20  # unfolded elements from which im2col runs on numba's threads


@jit
def _ow_range(off: int, sw: int, width: int, ow_n: int) -> tuple[int, int]:
    """Output columns whose input column ow*sw + off lies in [0, width)."""
    lo = max(0, (-off + sw - 1) // sw)
    hi = min(ow_n, (width - 1 - off) // sw + 1) if width - 1 - off >= 0 else 0
    return lo, max(hi, lo)


def _im2col(x: Any, n0: int, c0: int, oh0: int, geo: Any, cols: Any, k: int) -> None:
    """Row ``k`` of the unfolded input (see ``im2col``)."""
    kh_n, kw_n, sh, sw, ph, pw, dh, dw, ow_n = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5], geo[6], geo[7], geo[8]
    height, width = x.shape[2], x.shape[3]
    nn = geo[9]
    rows = cols.shape[1] // (ow_n * nn)
    kk = kh_n * kw_n
    c = k // kk
    kh = (k - c * kk) // kw_n
    kw = k - c * kk - kh * kw_n
    off = kw * dw - pw
    lo, hi = _ow_range(off, sw, width, ow_n)
    for i in range(nn):
        for r in range(rows):
            ih = (oh0 + r) * sh - ph + kh * dh
            base = (i * rows + r) * ow_n
            if ih < 0 or ih >= height:
                for ow in range(ow_n):
                    cols[k, base + ow] = 0
                continue
            for ow in range(lo):
                cols[k, base + ow] = 0
            if sw == 1:
                for ow in range(lo, hi):
                    cols[k, base + ow] = x[n0 + i, c0 + c, ih, ow + off]
            else:
                for ow in range(lo, hi):
                    cols[k, base + ow] = x[n0 + i, c0 + c, ih, ow * sw + off]
            for ow in range(hi, ow_n):
                cols[k, base + ow] = 0


_im2col_inl = jit_inline(_im2col)


@jit_par
def im2col_par(x: Any, n0: int, c0: int, oh0: int, geo: Any, cols: Any) -> None:
    """``im2col`` parallel over the rows of ``cols``."""
    for k in numba.prange(cols.shape[0]):
        _im2col_inl(x, n0, c0, oh0, geo, cols, k)


@jit
def im2col(x: Any, n0: int, c0: int, oh0: int, geo: Any, cols: Any) -> None:
    """cols[(c*KH + kh)*KW + kw, (i*rows + r)*OW + ow] = x[n0 + i, c0 + c, (oh0 + r)*sh - ph + kh*dh,
    ow*sw - pw + kw*dw] (0 in the padding) for ``geo[9]`` images i; ``geo`` = (KH, KW, sh, sw, ph, pw, dh, dw,
    OW, images)."""
    for k in range(cols.shape[0]):
        _im2col_inl(x, n0, c0, oh0, geo, cols, k)


@jit_par
def conv_direct(x: Any, w: Any, bias: Any, has_bias: bool, out: Any, geo: Any, groups: int) -> None:
    """out[n, oc] = bias[oc] + sum over its group's channels and the kernel window (``geo`` as im2col's)."""
    sh, sw, ph, pw, dh, dw = geo[2], geo[3], geo[4], geo[5], geo[6], geo[7]
    n_n, _, height, width = x.shape
    oc_n, cg_n, kh_n, kw_n = w.shape
    oh_n, ow_n = out.shape[2], out.shape[3]
    ocg = oc_n // groups
    for t in numba.prange(n_n * oc_n):
        n = t // oc_n
        oc = t - n * oc_n
        g = oc // ocg
        b0 = bias[oc] if has_bias else 0.0
        for oh in range(oh_n):
            for ow in range(ow_n):
                out[n, oc, oh, ow] = b0
        for cg in range(cg_n):
            c = g * cg_n + cg
            for kh in range(kh_n):
                for kw in range(kw_n):
                    wv = w[oc, cg, kh, kw]
                    off = kw * dw - pw
                    lo, hi = _ow_range(off, sw, width, ow_n)
                    for oh in range(oh_n):
                        ih = oh * sh - ph + kh * dh
                        if ih < 0 or ih >= height:
                            continue
                        for ow in range(lo, hi):
                            out[n, oc, oh, ow] += wv * x[n, c, ih, ow * sw + off]


def _geo(t: Any, images: int = 1) -> Any:
    return np.array([t.kh, t.kw, t.sh, t.sw, t.ph, t.pw, t.dh, t.dw, t.ow, images], np.int64)


def build_direct(t: Any, x: Any, w: Any, bias: Any, out: Any) -> Launch:
    """Direct convolution, workspace 0; x and out are logical NCHW views."""
    b = bias if bias is not None else np.zeros(1, x.dtype)
    geo = _geo(t)
    k = entry(conv_direct, x, w, b, bias is not None, out, geo, t.groups)
    has = bias is not None
    return lambda _: k(x, w, b, has, out, geo, t.groups)


def _mat(a: Any, shape: tuple[int, ...], strides: tuple[int, ...]) -> Any:
    return as_strided(a, shape, tuple(s * a.itemsize for s in strides))


def _wmat(t: Any, w: Any, g: int) -> Any:
    """Weight rows of group g as an (OCg, Cg*KH*KW) matrix (its dims merge: checked in phase 1)."""
    wg = w[g * t.ocg:(g + 1) * t.ocg]
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
        xg, og = x[:, g * t.cg:], out[:, g * t.ocg:]
        if t.orient == "cm":
            a, bm = wm, _mat(xg, (t.n, t.cg, hw), (sx[0], sx[1], sx[3]))
            o = _mat(og, (t.n, t.ocg, hw), (so[0], so[1], so[3]))
            bv = None if bias is None else bias[g * t.ocg:(g + 1) * t.ocg, None]
        else:
            a, bm = _mat(xg, (t.n * hw, t.cg), (sx[3], sx[1])), wm.T
            o = _mat(og, (t.n * hw, t.ocg), (so[3], so[1]))
            bv = None if bias is None else bias[g * t.ocg:(g + 1) * t.ocg]
        calls.append((a, bm, o, bv))

    def launch(_: Any) -> None:
        for a, bm, o, bv in calls:
            np.matmul(a, bm, out=o)
            if bv is not None:
                np.add(o, bv, out=o)
    return launch


def build_im2col(t: Any, x: Any, w: Any, bias: Any, out: Any) -> Launch:
    """Per tile (``t.tile_n`` whole images, or ``t.tile_rows`` output rows of one image) and group: unfold into
    the workspace, one GEMM into out (or into the workspace's second area when the tile's output columns do
    not form one BLAS matrix in out, then one copy that adds the bias)."""
    dt = x.dtype
    item = dt.itemsize
    so = [s // item for s in out.strides]
    cm = t.orient == "cm"
    kc, ow = t.kc, t.ow
    tn = t.tile_n
    staged = t.out_offset > 0
    steps = []
    for n0 in range(0, t.n, tn):
        nn = min(tn, t.n - n0)
        for g in range(t.groups):
            wm = _wmat(t, w, g)
            bias_g = None if bias is None else bias[g * t.ocg:(g + 1) * t.ocg]
            bv = None if bias_g is None else (bias_g[:, None] if cm else bias_g)
            for oh0 in range(0, t.oh, t.tile_rows):
                rows = min(t.tile_rows, t.oh - oh0)
                blk = out[n0:n0 + nn, g * t.ocg:(g + 1) * t.ocg, oh0:oh0 + rows]
                p = nn * rows * ow
                if staged:  # out's images are not one matrix: GEMM into the workspace, then copy (+ bias)
                    o = _mat(blk, (nn, t.ocg, rows * ow), (so[0], so[1], so[3])) if cm else blk.transpose(0, 2, 3, 1)
                    bb = None if bias_g is None else (bias_g[None, :, None] if cm else bias_g)
                    steps.append((n0, nn, g * t.cg, oh0, p, wm, o, bb, True))
                else:  # one image, or pixel-major images that merge into one run of rows
                    o = _mat(blk, (t.ocg, p), (so[1], so[3])) if cm else _mat(blk, (p, t.ocg), (so[3], so[1]))
                    steps.append((n0, nn, g * t.cg, oh0, p, wm, o, bv, False))
    par = kc * tn * t.tile_rows * ow >= PARALLEL_MIN
    kern = im2col_par if par else im2col
    sample = np.empty((2, 2), dt)  # C-contiguous cols (channel-major) or a transposed view (pixel-major)
    k_im2col = entry(kern, x, 0, 0, 0, _geo(t), sample if cm else sample.T)
    geos = {nn: _geo(t, nn) for nn in {min(tn, t.n - n0) for n0 in range(0, t.n, tn)}}
    o_off = t.out_offset
    ocg = t.ocg

    def launch(ws: Any) -> None:
        for n0, nn, c0, oh0, p, wm, o, bv, stage in steps:
            area = ws[:kc * p * item].view(dt)
            geo = geos[nn]
            if cm:
                cols = area.reshape(kc, p)
                k_im2col(x, n0, c0, oh0, geo, cols)
                res = ws[o_off:o_off + ocg * p * item].view(dt).reshape(ocg, p) if stage else o
                np.matmul(wm, cols, out=res)
            else:
                cols = area.reshape(p, kc)
                k_im2col(x, n0, c0, oh0, geo, cols.T)
                res = ws[o_off:o_off + ocg * p * item].view(dt).reshape(p, ocg) if stage else o
                np.matmul(cols, wm.T, out=res)
            if stage:
                src = res.reshape(ocg, nn, p // nn).transpose(1, 0, 2) if cm else res.reshape(o.shape)
                if bv is None:
                    np.copyto(o, src)
                else:
                    np.add(src, bv, out=o)
            elif bv is not None:
                np.add(o, bv, out=o)
    return launch
