"""conv2d as an implicit GEMM: no unfolded input. Each part copies a chunk of output rows' input, per k block of
whole channels, into zero-padded phase planes in its slice of the workspace (for stride s, s x s planes per
channel: phase (a, b) holds the input rows a, a + s, ... and columns b, b + s, ..., so every window of a stride-s
convolution reads a stride-1 run), and the register-blocked GEMM reads each unfolded row straight from them:
unfolded row k = (channel, kh, kw) of output row r is the run of OW floats at a fixed offset (``offsets``) past
the plane row of r, and ``gemm.host_gemm_table`` (``gemm_table``; ``gemm_table_ymm`` without AVX-512) takes those
offsets as a table. One GEMM per output row (its OW pixels are one run of every plane row and one run of out), so
nothing is staged: the GEMM writes out.

What it saves over im2col_tiles is the unfold, which writes KH * KW floats per input float and feeds each only
2 x OC flops: most of the cost beyond the GEMM where the input has few channels and big maps (ResNet's stem:
3 -> 64, 224^2, 7x7 stride 2, 147 unfolded rows of 12544 pixels)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ...runtime.fanout import run_parts, workspace_launcher
from . import gemm
from . import jit as _jit
from .conv_tiles import add_bias, channel_major_operands
from .jit import copy_phases, copy_run, entry, row_of, rows_only

Launch = Callable[[Any], None]
jit: Callable[[Callable[..., Any]], Any] = _jit.jit

# floats after a part's planes: a masked last panel reads a b row up to the next multiple of 16 columns, at most
# 15 floats past the last plane (``planes_floats``); zeroed every launch, so the whole area is written
GUARD = 16

# Where AVX2 runs the stem (3 -> 64, 224^2, 7x7 stride 2, one image), two other ways to cut its time were built and
# measured against im2col_tiles, through the op, interleaved in one process, and left out (AMD EPYC Zen 3, /tmp/w64
# of the sixty-fourth session):
# - Winograd F(3x3, 4x4) on the 2 x 2 input phases (12 channels of 4x4 sub-kernels; 36 GEMMs of 64 x 12 by
#   12 x tiles): relative error 1.9e-6 against the direct sum's 4.6e-7. Its GEMMs took 1.1-1.45 ms against the
#   im2col GEMM's 2.8, but its transforms took 1.6-2.0 ms more. One thread 1.05-1.19x as fast as the op (bands
#   of 4-13 tile rows); two threads 0.92-1.01x;
# - a 4 x 24 microkernel for the stem's GEMM (64 x 147 by 147 x 768): 0.99-1.01x the 6 x 16 one.
# Where output rows are narrow (ResNet's stride-2 layers, OW 28 down to 7), a variant that ran one GEMM over a chunk's
# output rows at once was built and measured, left out (the sixty-sixth session, /tmp/w66/ab.py): the planes' rows
# read as one run across the chunk (PW columns an output row, its PW - OW past the row computed and dropped), the
# GEMM into a stage, then copied into out with the bias; k blocks of up to 640 rows. Forced, through the op, two
# threads, 15 interleaved rounds, AMD Zen 3, t(im2col_tiles) / t(staged implicit): 8 x 64->128 56^2 s2 0.76x,
# 1 x 0.78x, 8 x 128->256 28^2 s2 0.77x, 1 x 0.86x, 8 x 256->512 14^2 s2 0.72x, 1 x 0.68x, 8 x 64^2 56^2 0.84x,
# 1 x 256^2 14^2 0.79x. Its b rows lie across the planes (576 rows of a 16-column panel touch up to 1152 lines),
# where im2col_tiles' panel rows are one stride apart in a dense tile.
# The 6 x 16 microkernel ran at 92-100 GFLOP/s with its operands in L1 and at 60-85 on the stem's tiles; the
# same L1 loop (k = 256) ran at 92 in one process and at 73 in another.


def available(dtype: Any) -> bool:
    """Whether the implicit GEMM can run: float32 on a CPU with AVX-512 or with AVX2 and FMA (its table GEMM,
    ``gemm.host_gemm_table``: 16-float panels, or 8-float ones where the 16-float IR would spill: that ran the stem
    at 0.40x torch on AVX2)."""
    return np.dtype(dtype) == np.float32 and gemm.blocked_available()


def usable(t: Any, rows_dense: bool) -> bool:
    """Whether the implicit GEMM serves tiling ``t``: one group, a channel-major NCHW output, strides 1 or 2 (the
    phase split copies a row's phases with ``copy_run`` / ``copy_phases``), dense input rows, and something to
    compute (channels, pixels)."""
    return (
        t.groups == 1
        and t.orient == "cm"
        and not t.nhwc
        and t.sh in (1, 2)
        and t.sw in (1, 2)
        and rows_dense
        and min(t.n, t.c, t.oc, t.oh, t.ow) > 0
    )


def row_offsets(k: int, d: int, p: int, s: int) -> tuple[int, int]:
    """(least, greatest) phase-row offset ``(i*d - p) // s`` over the window positions ``0 <= i < k``: output row r
    reads phase rows r + least ... r + greatest of its phase."""
    offs = [(i * d - p) // s for i in range(k)]
    return min(offs), max(offs)


def planes_shape(t: Any, chunk: int) -> tuple[int, int]:
    """(PR, PW): rows and columns of each plane for chunks of ``chunk`` output rows, the chunk's rows and OW
    columns plus the window's reach."""
    lo, hi = row_offsets(t.kh, t.dh, t.ph, t.sh)
    clo, chi = row_offsets(t.kw, t.dw, t.pw, t.sw)
    return chunk + hi - lo, t.ow + chi - clo


def geometry(t: Any, chunk: int, channels: int) -> np.ndarray:
    """The kernel's int64 geometry for chunks of ``chunk`` output rows and k blocks of ``channels`` channels:
    (sh, sw, ph, pw, dh, dw, KH, KW, OH, OW, least row offset, least column offset, PR, PW, chunk, channels)."""
    lo, clo = row_offsets(t.kh, t.dh, t.ph, t.sh)[0], row_offsets(t.kw, t.dw, t.pw, t.sw)[0]
    pr, pw = planes_shape(t, chunk)
    return np.array(
        [t.sh, t.sw, t.ph, t.pw, t.dh, t.dw, t.kh, t.kw, t.oh, t.ow, lo, clo, pr, pw, chunk, channels], np.int64
    )


def planes_floats(t: Any, chunk: int, channels: int) -> int:
    """Floats of one part's planes: ``channels`` x sh x sw planes of PR x PW, then ``GUARD``, a multiple of 16."""
    pr, pw = planes_shape(t, chunk)
    return int(-(-(channels * t.sh * t.sw * pr * pw + GUARD) // 16) * 16)


def most_rows(t: Any, channels: int, floats: int) -> int:
    """The most output rows (at most OH) a chunk takes with planes (``planes_floats``) of at most ``floats``
    floats; 1 when even one row's take more."""
    reach, pw = planes_shape(t, 0)
    return int(max(1, min(t.oh, (floats // 16 * 16 - GUARD) // (channels * t.sh * t.sw * pw) - reach)))


def workspace_bytes(t: Any, item: int) -> int:
    """The workspace of tiling ``t``: one part's planes (``planes_floats`` for ``t.chunk`` rows and ``t.kblock``
    / (KH * KW) channels) per part of ``t.grid``."""
    return len(t.grid) * planes_floats(t, t.chunk, t.kblock // (t.kh * t.kw)) * item


def offsets(t: Any, chunk: int, channels: int) -> np.ndarray:
    """``table[k]``: where unfolded row k = (c, kh, kw) of a k block's first output row starts in the planes,
    for the block's ``channels`` channels (c relative to its first): plane (c, a, b) of the row's phases, at its
    row offset less the least and column offset less the least."""
    g = geometry(t, chunk, channels)
    lo, clo, pr, pw = (int(v) for v in g[10:14])
    table = np.zeros(channels * t.kh * t.kw + gemm.TABLE_AHEAD, np.int64)  # (the microkernel reads ahead)
    k = 0
    for c in range(channels):
        for kh in range(t.kh):
            a, dr = (kh * t.dh - t.ph) % t.sh, (kh * t.dh - t.ph) // t.sh
            for kw in range(t.kw):
                b, dc = (kw * t.dw - t.pw) % t.sw, (kw * t.dw - t.pw) // t.sw
                table[k] = ((c * t.sh + a) * t.sw + b) * pr * pw + (dr - lo) * pw + dc - clo
                k += 1
    return table


@_jit.jit_inline
def fill(x: Any, n: int, c0: int, c1: int, oh0: int, rows: int, geo: Any, planes: Any) -> None:
    """planes[(((c - c0)*sh + a)*sw + b)*PR*PW + q*PW + p] = x[n, c, (oh0 + lo + q)*sh + a, (clo + p)*sw + b] (0
    outside the image) for channels ``c0 <= c < c1`` and the ``rows`` plane rows q a chunk reads; then the guard
    after the area zeroed."""
    sh, sw, lo, clo, pr, pw = geo[0], geo[1], geo[10], geo[11], geo[12], geo[13]
    height, width = x.shape[2], x.shape[3]
    plane = pr * pw
    first = -clo  # the plane column of input column 0 (clo <= 0: the padding is not negative)
    counts = (
        (min(pw - first, (width + 1) // 2), min(pw - first, width // 2)) if sw == 2 else (min(pw - first, width), 0)
    )
    for c in range(c0, c1):
        xp = x[n, c]
        for a in range(sh):
            for q in range(rows):
                ih = (oh0 + lo + q) * sh + a
                at = (((c - c0) * sh + a) * sw) * plane + q * pw
                if ih < 0 or ih >= height:
                    for b in range(sw):
                        for p in range(at + b * plane, at + b * plane + pw):
                            planes[p] = 0.0
                    continue
                xr = row_of(xp, ih, True)
                if sw == 2:
                    copy_phases(planes, at + first, xr, 0, counts[0], at + plane + first, counts[1])
                else:
                    copy_run(planes, at + first, xr, 0, counts[0])
                for b in range(sw):
                    base = at + b * plane
                    for p in range(base, base + first):
                        planes[p] = 0.0
                    for p in range(base + first + counts[b], base + pw):
                        planes[p] = 0.0
    for p in range(planes.size - GUARD, planes.size):
        planes[p] = 0.0


@rows_only("x", "out")
@jit
def conv_implicit(
    x: Any,
    w: Any,
    bias: Any,
    has_bias: bool,
    out: Any,
    planes: Any,
    table: Any,
    geo: Any,
    r0: int,
    r1: int,
    i0: int,
    i1: int,
) -> None:
    """out[n, i, oh*OW + ow] = sum_k w[i, k] * unfolded(n)[k, oh*OW + ow] (+ bias[i]) for the rows ``i0 <= i <
    i1`` and the output rows ``r0 <= r < r1`` of all images stacked (r = n*OH + oh): per chunk of output rows of
    one image and k block of whole channels, ``fill`` the planes, then one ``gemm.gemm_table`` per output row
    (the first k block stores, the later ones add); the bias added to the chunk's rows after its last block."""
    item = 4
    oh_n, ow_n, pr, pw, chunk, channels = geo[8], geo[9], geo[12], geo[13], geo[14], geo[15]
    hi_lo = pr - chunk  # plane rows a chunk reads beyond its own count
    taps = geo[6] * geo[7]
    nc = x.shape[1]
    lda, sak = w.strides[0] // item, w.strides[1] // item
    ldc = out.strides[1] // item
    pp, pt = planes.ctypes.data, table.ctypes.data
    r = r0
    while r < r1:
        n = r // oh_n
        oh0 = r - n * oh_n
        nr = min(chunk, oh_n - oh0, r1 - r)
        po = out[n].ctypes.data
        for c0 in range(0, nc, channels):
            c1 = min(nc, c0 + channels)
            fill(x, n, c0, c1, oh0, nr + hi_lo, geo, planes)
            pa = w.ctypes.data + (i0 * lda + c0 * taps * sak) * item
            for rr in range(nr):
                pc = po + (i0 * ldc + (oh0 + rr) * ow_n) * item
                gemm.host_gemm_table(
                    pa, lda, sak, pp + rr * pw * item, pt, pc, ldc, (c1 - c0) * taps, i1 - i0, ow_n, 1 if c0 > 0 else 0
                )
        if has_bias:
            add_bias(out, n, i0, i1, bias, oh0 * ow_n, (oh0 + nr) * ow_n)
        r += nr


def build_implicit(t: Any, x: Any, w: Any, bias: Any, out: Any) -> Launch:
    """The launch of ``len(t.grid)`` parts: part i computes the output block ``t.grid[i]`` (output rows of all
    images stacked, output channels) with its own planes in the workspace (``workspace_bytes``)."""
    item = x.itemsize
    o3, wmat, b, has = channel_major_operands(t, x, w, bias, out)
    channels = t.kblock // (t.kh * t.kw)
    geo = geometry(t, t.chunk, channels)
    table = offsets(t, t.chunk, channels)
    floats = planes_floats(t, t.chunk, channels)
    dt, grid = x.dtype, t.grid
    k = entry(conv_implicit, x, wmat, b, has, o3, np.empty(floats, dt), table, geo, 0, 0, 0, 0)

    def bind(ws: Any) -> Callable[[], None]:
        """The parts' calls on the workspace ``ws`` (their planes), made once per workspace."""
        parts = []
        for i, (r0, r1, i0, i1, _, _) in enumerate(grid):
            planes = ws[i * floats * item : (i + 1) * floats * item].view(dt)
            parts.append(functools.partial(k, x, wmat, b, has, o3, planes, table, geo, r0, r1, i0, i1))
        return functools.partial(run_parts, parts)

    return workspace_launcher(bind)
