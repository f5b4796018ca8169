"""conv2d by Winograd F(4x4, 3x3), float32: 36 GEMMs of (OC, C) x (C, tiles) on 6x6 input tiles 4 apart.

Against F(2x2, 3x3) (``conv.build_winograd``: 16 GEMMs, one per 4x4 tile element) it does 36 / 16 / 4 = 0.56x
the multiply-adds and moves 2.25 / 4 of the transformed input and output per pixel, but its transforms take
more arithmetic and a map's rows hold a quarter as many tiles. So the transforms' loops run over a band of tile
rows at once, flat: each row of tiles is stored ``TW + 1`` tiles long (the last one a dummy, computed from the
row's end and the next row's start and never written to ``out``), so tile (ty, tx) of a band sits at
``ty * (TW + 1) + tx`` in every scratch row, V and M, and the loops see unit strides over a band's whole width.

Transforms (Lavin and Gray): V = B^T d B, U = G g G^T, out = A^T M A, with
B^T = [[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0], [0, -2, -1, 2, 1, 0],
[0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]], G = [[1/4, 0, 0], [-1/6, -1/6, -1/6], [-1/6, 1/6, -1/6],
[1/24, 1/12, 1/6], [1/24, -1/12, 1/6], [0, 0, 1]], A^T = [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0],
[0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]]. Float32 only: its constants are float32 (a float64 convolution
keeps F(2x2, 3x3), whose constants are exact).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ...layout import align, spread_stride
from ...runtime.fanout import run_parts, split_range
from . import jit as _jit
from .blas import run_blas_parts
from .conv import matrices, spread_rows
from .jit import entry, wide_vectors

__all__ = ["MATS", "BAND_TILES", "geometry", "workspace", "build_winograd4"]

Launch = Callable[[Any], None]
jit: Callable[[Callable[..., Any]], Any] = _jit.jit
jit_inline: Callable[[Callable[..., Any]], Any] = _jit.jit_inline

MATS = 36  # transformed matrices: one per element of a 6x6 tile
BAND_TILES = 256  # tiles (dummies included) a band of tile rows holds at least, unless the map is smaller
_SCRATCH_IN, _SCRATCH_OUT, _SCRATCH_W = 24, 28, 18  # scratch rows of the input, output and weight transforms
_F2, _F4, _F5, _F8 = np.float32(2.0), np.float32(4.0), np.float32(5.0), np.float32(8.0)
_G0, _G6, _G12, _G24 = np.float32(0.25), np.float32(1 / 6), np.float32(1 / 12), np.float32(1 / 24)


def geometry(oh: int, ow: int) -> tuple[int, int, int]:
    """(tile rows TH, tile columns TW, tile rows per band) of an OH x OW output map."""
    th_n, tw_n = (oh + 3) // 4, (ow + 3) // 4
    return th_n, tw_n, max(1, min(th_n, -(-BAND_TILES // (tw_n + 1))))


def _areas(oc: int, c: int, nt: int, tr: int, band: int, parts: int) -> tuple[int, int, int, int, int, int]:
    """Byte sizes: spread strides of U, V, M rows, then one part's input, output and weight scratch rows."""
    su, sv, sm = (spread_stride(n * 4, MATS) for n in (oc * c, c * nt, oc * nt))
    return (su, sv, sm, align(_SCRATCH_IN * (band * tr + 1) * 4), align(_SCRATCH_OUT * band * tr * 4),
            align(_SCRATCH_W * c * 4))


def workspace(oc: int, c: int, oh: int, ow: int, images: int, parts: int) -> int:
    """36 * (spread36(OC*C*4) + spread36(C*NT*4) + spread36(OC*NT*4)) + P * (align64(24*(B*(TW+1) + 1)*4) +
    align64(28*B*(TW+1)*4) + align64(18*C*4)), NT = images * TH * (TW + 1) tiles per round, B = tile rows per
    band, P = parts."""
    th_n, tw_n, band = geometry(oh, ow)
    tr = tw_n + 1
    su, sv, sm, si, so, sw = _areas(oc, c, images * th_n * tr, tr, band, parts)
    return MATS * (su + sv + sm) + parts * (si + so + sw)


@jit_inline
def _g(a0: Any, a1: Any, a2: Any) -> tuple[Any, Any, Any, Any, Any, Any]:
    """G (a0, a1, a2)."""
    s = a0 + a2
    return (_G0 * a0, -(s + a1) * _G6, -(s - a1) * _G6, a0 * _G24 + a1 * _G12 + a2 * _G6,
            a0 * _G24 - a1 * _G12 + a2 * _G6, a2)


@jit
def winograd4_weights(w: Any, u: Any, oc0: int, oc1: int, tmp: Any) -> None:
    """u[6*i + j, oc*C + c] = (G g G^T)[i, j] for g = w[oc, c], output channels ``oc0 <= oc < oc1``; ``tmp``
    (18, C) scratch (G down the kernel's columns for every c, then G across: loops over c)."""
    wide_vectors()
    c_n = w.shape[1]
    for oc in range(oc0, oc1):
        at = oc * c_n
        for kw in range(3):
            for c in range(c_n):
                tmp[kw, c], tmp[3 + kw, c], tmp[6 + kw, c], tmp[9 + kw, c], tmp[12 + kw, c], tmp[15 + kw, c] = \
                    _g(w[oc, c, 0, kw], w[oc, c, 1, kw], w[oc, c, 2, kw])
        for i in range(6):
            t0, t1, t2 = tmp[3 * i], tmp[3 * i + 1], tmp[3 * i + 2]
            u0, u1, u2, u3, u4, u5 = u[6 * i], u[6 * i + 1], u[6 * i + 2], u[6 * i + 3], u[6 * i + 4], u[6 * i + 5]
            for c in range(c_n):
                u0[at + c], u1[at + c], u2[at + c], u3[at + c], u4[at + c], u5[at + c] = _g(t0[c], t1[c], t2[c])


@jit_inline
def _bt(d0: Any, d1: Any, d2: Any, d3: Any, d4: Any, d5: Any) -> tuple[Any, Any, Any, Any, Any, Any]:
    """B^T (d0 .. d5)."""
    a = d4 - _F4 * d2
    b = d3 - _F4 * d1
    c = d4 - d2
    e = _F2 * (d3 - d1)
    return _F4 * d0 - _F5 * d2 + d4, a + b, a - b, c + e, c - e, _F4 * d1 - _F5 * d3 + d5


@jit_inline
def _at(m0: Any, m1: Any, m2: Any, m3: Any, m4: Any, m5: Any) -> tuple[Any, Any, Any, Any]:
    """A^T (m0 .. m5)."""
    a = m1 + m2
    b = m1 - m2
    c = m3 + m4
    d = m3 - m4
    return m0 + a + c, b + _F2 * d, a + _F4 * c, b + _F8 * d + m5


@jit_inline
def _phases(row: Any, width: int, pw: int, s: Any, i: int, o: int, tr: int) -> None:
    """s[4*i + r, o + q] = d[4*q + r] for q < ``tr``, d = ``row`` shifted right by ``pw`` and zero padded."""
    p0, p1, p2, p3 = s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]
    lo = min((pw + 3) // 4, tr)  # q in [lo, hi): all four columns 4q + r - pw inside [0, width)
    hi = max(lo, min(tr, (width + pw) // 4))
    base, at, one, two, three, four = (np.uint64(4 * lo - pw), np.uint64(o + lo), np.uint64(1), np.uint64(2),
                                       np.uint64(3), np.uint64(4))
    for u in range(np.uint64(hi - lo)):  # unsigned indices: no wrap-around selects
        src = base + four * u
        p0[at + u] = row[src]
        p1[at + u] = row[src + one]
        p2[at + u] = row[src + two]
        p3[at + u] = row[src + three]
    for e in range(lo + tr - hi):  # the padded edges: q < lo, then q >= hi
        q = e if e < lo else hi + e - lo
        for r in range(4):
            ce = 4 * q + r - pw
            s[4 * i + r, o + q] = row[ce] if 0 <= ce < width else 0.0


@jit
def winograd4_input(x: Any, v: Any, n0: int, nt: int, geo: Any, s: Any, c0: int, c1: int) -> None:
    """v[6*i + j, c*nt + (n - n0)*TH*TR + ty*TR + tx] = (B^T d B)[i, j] for the 6x6 input patch d at rows
    4*ty - ph .., columns 4*tx - pw .. of x[n, c] (zero padded), for the ``nt // (TH*TR)`` images from ``n0``
    and channels ``c0 <= c < c1``; TR = TW + 1 (tx = TW: the dummy tile); ``geo`` = (ph, pw, TH, TW, band);
    ``s`` (24, band*TR + 1) scratch: per band, the 6 input rows of each tile row split into 4 column phases,
    B^T down them, then B across each tile's 6 columns."""
    wide_vectors()
    ph, pw, th_n, tw_n, band = geo[0], geo[1], geo[2], geo[3], geo[4]
    tr = tw_n + 1
    height, width = x.shape[2], x.shape[3]
    per_img = th_n * tr
    one = np.uint64(1)
    for c in range(c0, c1):
        for n in range(n0, n0 + nt // per_img):
            for ty0 in range(0, th_n, band):
                ty1 = min(th_n, ty0 + band)
                length = (ty1 - ty0) * tr
                for i in range(6):
                    for ty in range(ty0, ty1):
                        yy = 4 * ty - ph + i
                        o = (ty - ty0) * tr
                        if 0 <= yy < height:
                            _phases(x[n, c, yy], width, pw, s, i, o, tr)
                        else:
                            for r in range(4):
                                for q in range(tr):
                                    s[4 * i + r, o + q] = 0.0
                    s[4 * i, length] = 0.0  # read by the band's last (dummy) tile
                    s[4 * i + 1, length] = 0.0
                for r in range(4):  # B^T down the 6 rows, each column phase
                    a0, a1, a2, a3, a4, a5 = s[r], s[4 + r], s[8 + r], s[12 + r], s[16 + r], s[20 + r]
                    for q in range(length):
                        a0[q], a1[q], a2[q], a3[q], a4[q], a5[q] = _bt(a0[q], a1[q], a2[q], a3[q], a4[q], a5[q])
                at = np.uint64(c * nt + ((n - n0) * th_n + ty0) * tr)
                for i in range(6):  # B across: tile k's columns are phases 0-3 at k, then phases 0-1 at k + 1
                    p0, p1, p2, p3 = s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]
                    v0, v1, v2, v3, v4, v5 = v[6 * i], v[6 * i + 1], v[6 * i + 2], v[6 * i + 3], v[6 * i + 4], \
                        v[6 * i + 5]
                    for k in range(np.uint64(length)):
                        d = at + k
                        v0[d], v1[d], v2[d], v3[d], v4[d], v5[d] = _bt(p0[k], p1[k], p2[k], p3[k], p0[k + one],
                                                                       p1[k + one])


@jit
def winograd4_output(m: Any, bias: Any, has_bias: bool, out: Any, n0: int, nt: int, geo: Any, s: Any, oc0: int,
                     oc1: int) -> None:
    """out[n, oc, 4*ty + a, 4*tx + b] = (A^T M A)[a, b] + bias[oc] (clipped at the map's edges) for the tiles of
    m[6*i + j, oc*nt + ...] (laid out as ``winograd4_input``'s v), output channels ``oc0 <= oc < oc1``; ``s``
    (28, band*TR) scratch: per band, A^T down each column of the tiles, A across into 4 rows of output columns
    (bias added), then into out's rows."""
    wide_vectors()
    th_n, tw_n, band = geo[2], geo[3], geo[4]
    tr = tw_n + 1
    oh_n, ow_n = out.shape[2], out.shape[3]
    whole = ow_n // 4  # tiles whose 4 output columns are all inside
    for oc in range(oc0, oc1):
        b0 = bias[oc] if has_bias else np.float32(0.0)
        for n in range(n0, n0 + nt // (th_n * tr)):
            for ty0 in range(0, th_n, band):
                ty1 = min(th_n, ty0 + band)
                length = (ty1 - ty0) * tr
                at = np.uint64(oc * nt + ((n - n0) * th_n + ty0) * tr)
                for j in range(6):
                    m0, m1, m2, m3, m4, m5 = m[j], m[6 + j], m[12 + j], m[18 + j], m[24 + j], m[30 + j]
                    s0, s1, s2, s3 = s[j], s[6 + j], s[12 + j], s[18 + j]
                    for k in range(np.uint64(length)):
                        d = at + k
                        s0[k], s1[k], s2[k], s3[k] = _at(m0[d], m1[d], m2[d], m3[d], m4[d], m5[d])
                o0, o1, o2, o3 = s[24], s[25], s[26], s[27]
                for a in range(4):
                    r0, r1, r2, r3, r4, r5 = s[6 * a], s[6 * a + 1], s[6 * a + 2], s[6 * a + 3], s[6 * a + 4], \
                        s[6 * a + 5]
                    for k in range(length):
                        e0, e1, e2, e3 = _at(r0[k], r1[k], r2[k], r3[k], r4[k], r5[k])
                        o0[k], o1[k], o2[k], o3[k] = e0 + b0, e1 + b0, e2 + b0, e3 + b0
                    for ty in range(ty0, min(ty1, (oh_n - a + 3) // 4)):  # rows 4*ty + a inside the map
                        orow = out[n, oc, 4 * ty + a]
                        o = (ty - ty0) * tr
                        for k in range(whole):
                            orow[4 * k] = o0[o + k]
                            orow[4 * k + 1] = o1[o + k]
                            orow[4 * k + 2] = o2[o + k]
                            orow[4 * k + 3] = o3[o + k]
                        for col in range(4 * whole, ow_n):
                            orow[col] = s[24 + col - 4 * whole, o + whole]


def build_winograd4(t: Any, x: Any, w: Any, bias: Any, out: Any) -> Launch:
    """Transformed weights U (36, OC, C), per round of ``t.chunk`` images the transformed input V (36, C, NT) and
    M = U @ V (36, OC, NT) in the workspace, then the output transform (+ bias); the transforms' scratch rows (a
    set per part) follow. With ``t.parts`` > 1 the weight and input transforms run as channel ranges in one
    hand-off, the 36 GEMMs as batch ranges (one BLAS thread each) and the output transform as channel ranges, on
    helper threads."""
    th_n, tw_n, band = geometry(t.oh, t.ow)
    tr = tw_n + 1
    chunk, parts = t.chunk, t.parts
    nt = chunk * th_n * tr
    geo = np.array([t.ph, t.pw, th_n, tw_n, band], np.int64)
    dt = x.dtype
    b = bias if bias is not None else np.zeros(1, dt)
    has = bias is not None
    su, sv, sm, si_b, so_b, sw_b = _areas(t.oc, t.c, nt, tr, band, parts)
    o_v = MATS * su
    o_m = o_v + MATS * sv
    o_s = o_m + MATS * sm  # per part: input, output, weight scratch, each on lines of its own
    per_part = si_b + so_b + sw_b
    s2 = np.empty((1, 1), dt)
    c_ranges, oc_ranges, k_ranges = split_range(t.c, parts), split_range(t.oc, parts), split_range(MATS, parts)
    k_w = entry(winograd4_weights, w, s2, 0, 0, s2)
    k_in = entry(winograd4_input, x, s2, 0, 0, geo, s2, 0, 0)
    k_out = entry(winograd4_output, s2, b, has, out, 0, 0, geo, s2, 0, 0)
    rounds = [(n0, min(chunk, t.n - n0) * th_n * tr) for n0 in range(0, t.n, chunk)]
    c, oc = t.c, t.oc

    def scratch(ws: Any, i: int, at: int, rows: int, cols: int) -> Any:
        start = o_s + i * per_part + at
        return ws[start:start + rows * cols * 4].view(dt).reshape(rows, cols)

    def launch(ws: Any) -> None:
        u = spread_rows(ws, 0, su, dt, MATS)
        v, m = spread_rows(ws, o_v, sv, dt, MATS), spread_rows(ws, o_m, sm, dt, MATS)
        s_in = [scratch(ws, i, 0, _SCRATCH_IN, band * tr + 1) for i in range(parts)]
        s_out = [scratch(ws, i, si_b, _SCRATCH_OUT, band * tr) for i in range(parts)]
        s_w = [scratch(ws, i, si_b + so_b, _SCRATCH_W, c) for i in range(parts)]
        u_mats = matrices(u, oc, c)
        for r, (n0, cnt) in enumerate(rounds):
            v_mats, m_mats = matrices(v, c, cnt), matrices(m, oc, cnt)
            run_parts([functools.partial(transform_in, u, v, n0, cnt, r == 0, s_in[i], s_w[i], i)
                       for i in range(parts)])
            run_blas_parts([functools.partial(np.matmul, u_mats[lo:hi], v_mats[lo:hi], out=m_mats[lo:hi])
                            for lo, hi in k_ranges])
            run_parts([functools.partial(k_out, m, b, has, out, n0, cnt, geo, s_out[i], *oc_ranges[i])
                       for i in range(parts)])

    def transform_in(u: Any, v: Any, n0: int, cnt: int, first: bool, s_in: Any, s_w: Any, i: int) -> None:
        """Part i of the weight transform (first round only: its output channels) and of the input transform
        (its input channels)."""
        if first:
            k_w(w, u, *oc_ranges[i], s_w)
        k_in(x, v, n0, cnt, geo, s_in, *c_ranges[i])
    return launch
