"""conv2d by Winograd F(4x4, 3x3), float32: 36 GEMMs of (OC, C) x (C, tiles) on 6x6 input tiles 4 apart.

Against F(2x2, 3x3) (``conv.build_winograd``: 16 GEMMs, one per 4x4 tile element) it does 36 / 16 / 4 = 0.56x
the multiply-adds and moves 2.25 / 4 of the transformed input and output per pixel, but its transforms take
more arithmetic and a map's rows hold a quarter as many tiles. So the transforms' loops run over a band of tile
rows at once, flat: each row of tiles is stored ``TW + 1`` tiles long (the last one a dummy, computed from the
row's end and the next row's start and never written to ``out``), so tile (ty, tx) of a band sits at
``ty * (TW + 1) + tx`` in every scratch row, V and M, and the loops see unit strides over a band's whole width.

Transforms (Lavin and Gray): V = B^T d B, U = G g G^T, out = A^T M A, with the matrices ``_BT``, ``_G`` and
``_AT`` below, each step a ``rows_ir.linear_map`` over whole scratch rows. The input transform takes
its 6x6 patches' column phases from the plane split once into 4 x 4 phases (``_split_plane``) when x's rows
are dense and 4-aligned (``flat_phases``), else row by row (``_phases``). Float32 only: its constants are
float32 (a float64 convolution keeps F(2x2, 3x3), whose constants are exact).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ...layout import align, spread_stride
from ...runtime.fanout import split_range
from . import jit as _jit
from .conv import KeptWeights, Round, gemm_parts, matrices, micro_gemm_parts, spread_rows, weight_rows, winograd_launch
from .jit import entry
from .rows_ir import deinterleave4, interleave4, linear_map

__all__ = ["MATS", "BAND_TILES", "geometry", "workspace", "build_winograd4"]

Launch = Callable[[Any], None]
jit: Callable[[Callable[..., Any]], Any] = _jit.jit
jit_inline: Callable[[Callable[..., Any]], Any] = _jit.jit_inline

MATS = 36  # transformed matrices: one per element of a 6x6 tile
BAND_TILES = 256  # tiles (dummies included) a band of tile rows holds at least, unless the map is smaller
_SCRATCH_IN, _SCRATCH_OUT, _SCRATCH_W = 24, 28, 27  # scratch rows of the input, output and weight transforms
_PLANES = 16  # a plane split into 4 column x 4 row phases


def geometry(oh: int, ow: int) -> tuple[int, int, int]:
    """(tile rows TH, tile columns TW, tile rows per band) of an OH x OW output map."""
    th_n, tw_n = (oh + 3) // 4, (ow + 3) // 4
    return th_n, tw_n, max(1, min(th_n, -(-BAND_TILES // (tw_n + 1))))


def _areas(oc: int, c: int, nt: int, th_n: int, tr: int, band: int, flat: bool) -> tuple[int, ...]:
    """Byte sizes: spread strides of U, V, M rows, then one part's input, output, weight and (``flat``)
    split-plane scratch rows."""
    su, sv, sm = (spread_stride(n * 4, MATS) for n in (oc * c, c * nt, oc * nt))
    return (
        su,
        sv,
        sm,
        align(_SCRATCH_IN * (band * tr + 1) * 4),
        align(_SCRATCH_OUT * band * tr * 4),
        align(_SCRATCH_W * c * 4),
        align(_PLANES * (th_n + 2) * tr * 4) if flat else 0,
    )


def workspace(oc: int, c: int, oh: int, ow: int, images: int, parts: int, flat: bool, own_weights: bool = False) -> int:
    """36 * (spread36(OC*C*4) + spread36(C*NT*4) + spread36(OC*NT*4)) + P * (align64(24*(B*(TW+1) + 1)*4) +
    align64(28*B*(TW+1)*4) + align64(27*C*4) [+ align64(16*(TH+2)*(TW+1)*4) when ``flat``]), NT = images * TH
    * (TW + 1) tiles per round, B = tile rows per band, P = parts; without the weights' term (the first) when
    ``own_weights``: the binding keeps them."""
    th_n, tw_n, band = geometry(oh, ow)
    tr = tw_n + 1
    su, sv, sm, *scratch = _areas(oc, c, images * th_n * tr, th_n, tr, band, flat)
    return MATS * ((0 if own_weights else su) + sv + sm) + parts * sum(scratch)


@jit_inline
def _row_at(a: Any, row: int, col: int) -> Any:
    """The address of a[row, col] (a 2-D float32 array with unit column stride)."""
    return a.ctypes.data + row * a.strides[0] + col * 4


_BT = (
    (4, 0, -5, 0, 1, 0),
    (0, -4, -4, 1, 1, 0),
    (0, 4, -4, -1, 1, 0),
    (0, -2, -1, 2, 1, 0),
    (0, 2, -1, -2, 1, 0),
    (0, 4, 0, -5, 0, 1),
)
_AT = ((1, 1, 1, 1, 1, 0), (0, 1, -1, 2, -2, 0), (0, 1, 1, 4, 4, 0), (0, 1, -1, 8, -8, 1))
_down_bt = linear_map(_BT)  # B^T down a tile's 6 rows (in place, or from the split plane), or B across
_by_at = linear_map(_AT)  # A^T, down or (with the bias as addend) across
_G = (
    (0.25, 0, 0),
    (-1 / 6, -1 / 6, -1 / 6),
    (-1 / 6, 1 / 6, -1 / 6),
    (1 / 24, 1 / 12, 1 / 6),
    (1 / 24, -1 / 12, 1 / 6),
    (0, 0, 1),
)
_by_g = linear_map(_G)  # G down the kernel's rows, then across its columns


@jit
def winograd4_weights(w: Any, u: Any, oc0: int, oc1: int, tmp: Any) -> None:
    """u[6*i + j, oc*C + c] = (G g G^T)[i, j] for g = w[oc, c], output channels ``oc0 <= oc < oc1``; ``tmp``
    (27, C) scratch: the 9 taps of every c in rows, G down the kernel's rows (18 rows), then G across into u."""
    c_n = w.shape[1]
    addr = np.empty(9, np.int64)
    for oc in range(oc0, oc1):
        for c in range(c_n):
            for k in range(9):
                tmp[k, c] = w[oc, c, k // 3, k % 3]
        for kw in range(3):  # tmp[9 + 3*i + kw] = (G g)[i, kw]
            for i in range(6):
                addr[i] = _row_at(tmp, 9 + 3 * i + kw, 0)
            for kh in range(3):
                addr[6 + kh] = _row_at(tmp, 3 * kh + kw, 0)
            _by_g(addr, c_n, np.float32(0.0))
        for i in range(6):
            for j in range(6):
                addr[j] = _row_at(u, 6 * i + j, oc * c_n)
            for kw in range(3):
                addr[6 + kw] = _row_at(tmp, 9 + 3 * i + kw, 0)
            _by_g(addr, c_n, np.float32(0.0))


@jit_inline
def _phases(x: Any, n: int, c: int, yy: int, pw: int, s: Any, i: int, o: int, tr: int, addr: Any) -> None:
    """s[4*i + r, o + q] = d[4*q + r] for q < ``tr``, d = the row x[n, c, yy] shifted right by ``pw`` and zero
    padded: the path for rows that are strided or not 4-aligned. It measured ~60-75 ns a 56-wide row, where its
    split alone took ~5 ns and its edges alone ~8 (a cause not found: ``_split_plane`` avoids the per-row path)."""
    width = x.shape[3]
    lo = min((pw + 3) // 4, tr)  # q in [lo, hi): all four columns 4q + r - pw inside [0, width)
    hi = max(lo, min(tr, (width + pw) // 4))
    if hi > lo and x.strides[3] == 4:
        for r in range(4):
            addr[r] = s.ctypes.data + (4 * i + r) * s.strides[0] + (o + lo) * 4
        addr[4] = x.ctypes.data + n * x.strides[0] + c * x.strides[1] + yy * x.strides[2] + (4 * lo - pw) * 4
        deinterleave4(addr, hi - lo, 1, 0, 0)
    else:
        for q in range(lo, hi):
            for r in range(4):
                s[4 * i + r, o + q] = x[n, c, yy, 4 * q + r - pw]
    for e in range(lo + tr - hi):  # the padded edges: q < lo, then q >= hi
        q = e if e < lo else hi + e - lo
        for r in range(4):
            ce = 4 * q + r - pw
            s[4 * i + r, o + q] = x[n, c, yy, ce] if 0 <= ce < width else 0.0


def flat_phases(w: int, ph: int, pw: int, tw_n: int, dense: bool) -> bool:
    """Whether the input transform can split whole rows of x into column phases (``winograd4_input``'s flat
    path): dense rows whose width is a multiple of 4, paddings up to 4, and their groups of 4 columns (with the
    padding in front) no more than the tiles of a row."""
    return dense and w % 4 == 0 and ph <= 4 and pw <= 4 and (w + pw + 3) // 4 <= tw_n + 1


@jit_inline
def _split_plane(x: Any, n: int, c: int, ph: int, pw: int, tr: int, pp: Any, addr: Any) -> None:
    """pp[4*(X % 4) + Y % 4, (Y // 4)*TR + X // 4] = x[n, c, yy, col] for X = col + pw, Y = yy + ph: the
    padded plane in 4 column phases x 4 row phases (the padding is never written: zero from the kernel's
    start). Each row split by ``deinterleave4``, its column phase r going to X phase (r + pw) % 4."""
    height = x.shape[2]
    step = x.strides[2] // 4
    for rho in range(4):  # the rows of one row phase: yy = yy0, yy0 + 4, ..., each a group row further in pp
        yy0 = (rho - ph) % 4
        if yy0 >= height:
            continue
        big = (yy0 + ph) // 4
        for r in range(4):
            addr[r] = _row_at(pp, 4 * ((r + pw) % 4) + rho, big * tr + (r + pw) // 4)
        addr[4] = x.ctypes.data + n * x.strides[0] + c * x.strides[1] + yy0 * x.strides[2]
        deinterleave4(addr, x.shape[3] // 4, (height - yy0 + 3) // 4, 4 * step, tr)


@jit
def winograd4_input(x: Any, v: Any, n0: int, nt: int, geo: Any, s: Any, pp: Any, c0: int, c1: int) -> None:
    """v[6*i + j, c*nt + (n - n0)*TH*TR + ty*TR + tx] = (B^T d B)[i, j] for the 6x6 input patch d at rows
    4*ty - ph .., columns 4*tx - pw .. of x[n, c] (zero padded), for the ``nt // (TH*TR)`` images from ``n0``
    and channels ``c0 <= c < c1``; TR = TW + 1 (tx = TW: the dummy tile); ``geo`` = (ph, pw, TH, TW, band,
    flat). ``s`` (24, band*TR + 1) scratch: per band, the 6 input rows of each tile row in 4 column phases, B^T
    down them, then B across each tile's 6 columns. With ``flat`` (``flat_phases``) the phases come from ``pp``
    (16, (TH + 2)*TR), each plane split once (``_split_plane``), and B^T runs on them straight into ``s``."""
    ph, pw, th_n, tw_n, band, flat = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
    tr = tw_n + 1
    height = x.shape[2]
    per_img = th_n * tr
    addr = np.empty(12, np.int64)
    if flat:
        pp[:] = 0.0
    for c in range(c0, c1):
        for n in range(n0, n0 + nt // per_img):
            if flat:
                _split_plane(x, n, c, ph, pw, tr, pp, addr)
            for ty0 in range(0, th_n, band):
                ty1 = min(th_n, ty0 + band)
                length = (ty1 - ty0) * tr
                if flat:  # B^T down rows k of the tile rows: Y = 4*ty + k, in pp's row phase k % 4
                    for r in range(4):
                        for i in range(6):
                            addr[i] = _row_at(s, 4 * i + r, 0)
                        for k in range(6):
                            addr[6 + k] = _row_at(pp, 4 * r + k % 4, (ty0 + k // 4) * tr)
                        _down_bt(addr, length + 1, np.float32(0.0))
                else:
                    for i in range(6):
                        for ty in range(ty0, ty1):
                            yy = 4 * ty - ph + i
                            o = (ty - ty0) * tr
                            if 0 <= yy < height:
                                _phases(x, n, c, yy, pw, s, i, o, tr, addr)
                            else:
                                for r in range(4):
                                    for q in range(tr):
                                        s[4 * i + r, o + q] = 0.0
                        s[4 * i, length] = 0.0  # read by the band's last (dummy) tile
                        s[4 * i + 1, length] = 0.0
                    for r in range(4):  # B^T down the 6 rows, each column phase, in place
                        for i in range(6):
                            addr[i] = addr[6 + i] = _row_at(s, 4 * i + r, 0)
                        _down_bt(addr, length, np.float32(0.0))
                at = c * nt + ((n - n0) * th_n + ty0) * tr
                for i in range(6):  # B across: tile q's column j is phase j % 4 of group q + j // 4
                    for j in range(6):
                        addr[j] = _row_at(v, 6 * i + j, at)
                        addr[6 + j] = _row_at(s, 4 * i + j % 4, j // 4)
                    _down_bt(addr, length, np.float32(0.0))


@jit
def winograd4_output(
    m: Any, bias: Any, has_bias: bool, out: Any, n0: int, nt: int, geo: Any, s: Any, oc0: int, oc1: int
) -> None:
    """out[n, oc, 4*ty + a, 4*tx + b] = (A^T M A)[a, b] + bias[oc] (clipped at the map's edges) for the tiles of
    m[6*i + j, oc*nt + ...] (laid out as ``winograd4_input``'s v), output channels ``oc0 <= oc < oc1``; ``s``
    (28, band*TR) scratch: per band, A^T down each column of the tiles, A across into 4 rows of output columns
    (bias added), then into out's rows."""
    th_n, tw_n, band = geo[2], geo[3], geo[4]
    tr = tw_n + 1
    oh_n, ow_n = out.shape[2], out.shape[3]
    whole = ow_n // 4  # tiles whose 4 output columns are all inside
    addr = np.empty(10, np.int64)
    for oc in range(oc0, oc1):
        b0 = np.float32(bias[oc]) if has_bias else np.float32(0.0)
        for n in range(n0, n0 + nt // (th_n * tr)):
            for ty0 in range(0, th_n, band):
                ty1 = min(th_n, ty0 + band)
                length = (ty1 - ty0) * tr
                at = oc * nt + ((n - n0) * th_n + ty0) * tr
                for j in range(6):  # A^T down column j of the tiles
                    for a in range(4):
                        addr[a] = _row_at(s, 6 * a + j, 0)
                    for i in range(6):
                        addr[4 + i] = _row_at(m, 6 * i + j, at)
                    _by_at(addr, length, np.float32(0.0))
                for a in range(4):  # A across output row a of the tiles, + bias, then into out's rows
                    for q in range(4):
                        addr[q] = _row_at(s, 24 + q, 0)
                    for j in range(6):
                        addr[4 + j] = _row_at(s, 6 * a + j, 0)
                    _by_at(addr, length, b0)
                    rows = max(0, min(ty1, (oh_n - a + 3) // 4) - ty0)  # rows 4*ty + a inside the map
                    if out.strides[3] == 4:  # the whole tiles' columns of all those rows
                        for q in range(4):
                            addr[q] = _row_at(s, 24 + q, 0)
                        addr[4] = (
                            out.ctypes.data + n * out.strides[0] + oc * out.strides[1] + (4 * ty0 + a) * out.strides[2]
                        )
                        interleave4(addr, whole, rows, tr, 4 * (out.strides[2] // 4))
                    for ty in range(ty0, ty0 + rows):
                        y = 4 * ty + a
                        o = (ty - ty0) * tr
                        if out.strides[3] != 4:
                            for k in range(whole):
                                for q in range(4):
                                    out[n, oc, y, 4 * k + q] = s[24 + q, o + k]
                        for col in range(4 * whole, ow_n):
                            out[n, oc, y, col] = s[24 + col - 4 * whole, o + whole]


def build_winograd4(
    t: Any, x: Any, w: Any, bias: Any, out: Any, keep: Callable[[int, int, np.dtype[Any]], KeptWeights]
) -> Launch:
    """Transformed weights U (36, OC, C) (kept by the binding with ``t.own_weights``: transformed by its first
    launch only; ``keep`` gives them, as ``conv.build_winograd``'s), per round of ``t.chunk`` images the transformed
    input V (36, C, NT) and M = U @ V (36, OC, NT) in the workspace, then the output transform (+ bias); the
    transforms' scratch rows (a set per part) follow. With ``t.parts`` > 1 the weight and input transforms run as
    channel ranges in one hand-off, the 36 GEMMs as batch ranges (one BLAS thread each, or the float32 microkernel
    for the round widths ``t.micro`` gives blocks for) and the output transform as channel ranges, on helper
    threads."""
    th_n, tw_n, band = geometry(t.oh, t.ow)
    tr = tw_n + 1
    chunk, parts = t.chunk, t.parts
    nt = chunk * th_n * tr
    flat = t.flat
    geo = np.array([t.ph, t.pw, th_n, tw_n, band, flat], np.int64)
    dt = x.dtype
    b = bias if bias is not None else np.zeros(1, dt)
    has = bias is not None
    su, sv, sm, si_b, so_b, sw_b, sp_b = _areas(t.oc, t.c, nt, th_n, tr, band, flat)
    kept = keep(MATS, su, dt) if t.own_weights else None
    o_v = 0 if kept is not None else MATS * su
    o_m = o_v + MATS * sv
    o_s = o_m + MATS * sm  # per part: input, output, weight and split-plane scratch, each on lines of its own
    per_part = si_b + so_b + sw_b + sp_b
    s2 = np.empty((1, 1), dt)
    c_ranges, oc_ranges, k_ranges = split_range(t.c, parts), split_range(t.oc, parts), split_range(MATS, parts)
    k_w = entry(winograd4_weights, w, s2, 0, 0, s2)
    k_in = entry(winograd4_input, x, s2, 0, 0, geo, s2, s2, 0, 0)
    k_out = entry(winograd4_output, s2, b, has, out, 0, 0, geo, s2, 0, 0)
    rounds_at = [(n0, min(chunk, t.n - n0) * th_n * tr) for n0 in range(0, t.n, chunk)]
    c, oc = t.c, t.oc
    micro = {width for width, blocks in t.micro if blocks}  # round widths whose GEMMs take the microkernel

    def scratch(ws: Any, i: int, at: int, rows: int, cols: int) -> Any:
        start = o_s + i * per_part + at
        return ws[start : start + rows * cols * 4].view(dt).reshape(rows, cols)

    def rounds(ws: Any) -> list[Round]:
        u = weight_rows(ws, kept, su, dt, MATS)
        v, m = spread_rows(ws, o_v, sv, dt, MATS), spread_rows(ws, o_m, sm, dt, MATS)
        s_in = [scratch(ws, i, 0, _SCRATCH_IN, band * tr + 1) for i in range(parts)]
        s_out = [scratch(ws, i, si_b, _SCRATCH_OUT, band * tr) for i in range(parts)]
        s_w = [scratch(ws, i, si_b + so_b, _SCRATCH_W, c) for i in range(parts)]
        s_p = [scratch(ws, i, si_b + so_b + sw_b, _PLANES, (th_n + 2) * tr if flat else 0) for i in range(parts)]
        return [
            (
                [
                    functools.partial(transform_in, u, v, n0, cnt, r == 0, s_in[i], s_w[i], s_p[i], i)
                    for i in range(parts)
                ],
                (micro_gemm_parts if cnt in micro else gemm_parts)(
                    matrices(u, oc, c), matrices(v, c, cnt), matrices(m, oc, cnt), k_ranges
                ),
                [functools.partial(k_out, m, b, has, out, n0, cnt, geo, s_out[i], *oc_ranges[i]) for i in range(parts)],
            )
            for r, (n0, cnt) in enumerate(rounds_at)
        ]

    def transform_in(u: Any, v: Any, n0: int, cnt: int, first: bool, s_in: Any, s_w: Any, s_p: Any, i: int) -> None:
        """Part i of the weight transform (first round only, unless kept from an earlier launch: its output
        channels) and of the input transform (its input channels)."""
        if first and (kept is None or not kept.ready):
            k_w(w, u, *oc_ranges[i], s_w)
        k_in(x, v, n0, cnt, geo, s_in, s_p, *c_ranges[i])

    return winograd_launch(rounds, kept)
