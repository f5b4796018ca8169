"""im2col_tiles' unfold of a stride-2 convolution through the input's phases.

A stride-2 window reads every other input column, and an unfolded row of a 14-wide output map is 14 short,
strided copies, each costing more than the elements it moves. Split first (``split``): each dense input row goes
to its row phase ``a`` = row % 2 as two column phases ``b`` (its even and odd elements, ``jit.copy_phases``), each
stored ``OW`` wide. Then output (r, ow) of tap (kh, kw) reads phase (a, b) at (r + dr, ow + dc), with
``a = (kh - ph) % 2, dr = (kh - ph - a) // 2`` (``b``, ``dc`` alike along the columns): one flat run per
unfolded row of the tile (``unfold``), the columns that wrap around a phase row (``ow + dc`` outside
``[0, OW)``: padding) masked to 0 (``jit.copy_where`` loads only the kept ones), the output rows outside the
image zeroed. The phase rows beyond the image are never read.

A stride-1 window over a map it leaves as wide (a "same" padding) needs no split: the input planes are their one
phase, and ``unfold_plane`` copies each unfolded row as one masked run of its plane.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import jit as _jit
from .jit import copy_phases, copy_run, copy_where, prefetch_l2, row_of, rows_only, span_of

jit_inline: Callable[[Callable[..., Any]], Any] = _jit.jit_inline

# floats before and after a phase area's planes: a run of a tap whose columns start (end) in the padding starts
# (ends) up to ceil(padding / 2) floats before (past) its plane, on lanes copy_where never loads; the trailing
# guard is zeroed by ``split``, so the whole area is written
GUARD = 16


def usable(t: Any, rows_dense: bool) -> bool:
    """Whether the phases serve the convolution of tiling ``t``: stride 2, no dilation, a window of 2 or more in
    each dim (a 1x1 window reads one phase of the four: the split would cost more than it saves, 0.73x measured
    on 8 x 64->128 56x56), dense input rows, column phases no wider than the output (``ceil(W / 2) <= OW``, so that
    a phase row stored ``OW`` wide holds all of it) and column offsets within the guards."""
    sh, sw, dh, dw, w, ow, ph, pw, kw = t.sh, t.sw, t.dh, t.dw, t.w, t.ow, t.ph, t.pw, t.kw
    return (
        (sh, sw, dh, dw) == (2, 2, 1, 1)
        and min(t.kh, kw) >= 2
        and rows_dense
        and (w + 1) // 2 <= ow
        and pw <= 2 * GUARD
        and kw - 1 - pw <= 2 * GUARD
        and ph >= 0
    )


@jit_inline
def offsets(pad: int, k: int) -> tuple[int, int]:
    """(least, greatest) phase offset ``(i - pad) // 2`` of the window positions ``0 <= i < k``."""
    return (-pad) // 2, (k - 1 - pad) // 2


@jit_inline
def plane_rows(chunk: int, ph: int, kh: int) -> int:
    """Phase rows a tile of ``chunk`` output rows reads: its rows shifted by every row offset."""
    lo, hi = offsets(ph, kh)
    return int(chunk + hi - lo)


def tile_channels(kc: int, kblock: int, taps: int) -> int:
    """The most input channels one of im2col_tiles' k blocks (``kblock`` unfolded rows from 0 on, of ``kc``)
    reaches, ``taps`` = KH * KW unfolded rows per channel."""
    return max((min(kc, k0 + kblock) - 1) // taps - k0 // taps + 1 for k0 in range(0, kc, kblock))


def area_floats(t: Any, chunk: int, channels: int) -> int:
    """Floats of one phase area for tiles of ``chunk`` output rows and ``channels`` input channels: the guards
    and 4 phase planes of ``plane_rows`` x OW per channel, a multiple of 16 (what follows stays 64-byte
    aligned)."""
    planes = channels * 4 * plane_rows(chunk, t.ph, t.kh) * t.ow
    return int(-(-(2 * GUARD + planes) // 16) * 16)


def masks(t: Any, chunk: int) -> Any:
    """``m[dc - least, p]``: whether output pixel p of a tile (p = r * OW + ow) reads inside its phase row at column
    offset dc, for every column offset of the window."""
    lo, hi = offsets(t.pw, t.kw)
    return _column_masks(chunk, t.ow, range(lo, hi + 1))


def plane_masks(t: Any, chunk: int) -> Any:
    """``m[kw, p]``: whether output pixel p of a tile reads inside its input row at window column kw (offset
    ``kw * dw - pw``), for ``unfold_plane``."""
    return _column_masks(chunk, t.ow, [kw * t.dw - t.pw for kw in range(t.kw)])


def _column_masks(chunk: int, ow: int, column_offsets: Any) -> Any:
    """One row per column offset dc: whether pixel p of ``chunk`` rows of ``ow`` reads column p % ow + dc inside
    [0, ow)."""
    col = np.arange(chunk * ow) % ow
    return np.stack([(col + dc >= 0) & (col + dc < ow) for dc in column_offsets])


def plane_usable(t: Any, rows_dense: bool, row_stride: int) -> bool:
    """Whether a channel-major unfold (im2col_tiles, im2col, im2col_parts) reads the input planes themselves as
    their one phase (``unfold_plane``):
    stride 1, an output as wide as the input (a "same" padding: each output row reads a whole input row shifted by
    the tap's column offset) and dense rows lying back to back (``row_stride``, in elements, = W)."""
    return (t.sh, t.sw) == (1, 1) and t.ow == t.w and rows_dense and (row_stride == t.w or t.h == 1)


@jit_inline
def tap_of(k: int, kh_n: int, kw_n: int) -> tuple[int, int, int]:
    """(channel, kernel row, kernel column) of unfolded row k = (c*KH + kh)*KW + kw."""
    kk = kh_n * kw_n
    c = k // kk
    kh = (k - c * kk) // kw_n
    return c, kh, k - c * kk - kh * kw_n


@jit_inline
def next_tap(c: int, kh: int, kw: int, kh_n: int, kw_n: int) -> tuple[int, int, int]:
    """``tap_of`` the next unfolded row, without a division."""
    kw += 1
    if kw == kw_n:
        kw = 0
        kh += 1
        if kh == kh_n:
            kh = 0
            c += 1
    return c, kh, kw


# input channels ahead whose rows ``split`` prefetches into L2. A tile's split is the first to read the input, from
# L3 or memory, in runs of one channel's rows (a few KiB) that the hardware prefetchers barely start on: with the
# split skipped (wrong results), 8 x 64->128 56^2 s2 ran 10% faster, though the split alone on a hot input takes
# 0.25 of its 1 ms. Through the op, forced im2col_tiles, AMD Zen 4 (/tmp/w67/ab.py of the sixty-seventh session),
# t(no prefetch) / t(4 ahead): one thread, 15 interleaved rounds, 8 x 64->128 56^2 s2 1.035x, 8 x 128->256 28^2
# s2 1.017x, 8 x 256->512 14^2 s2 0.99x; two threads, 11 rounds, 1.01-1.04x, 1.00-1.01x, 0.99x, 1 x 128->256 s2
# 0.98-1.00x, 1 x 64->128 s2 0.99x. A first prototype's run (9 rounds) put 1, 2, 4 and 8 ahead at 0.97-1.07x.
# Prefetching the next tile's input rows all at once before a tile's GEMM instead gained nothing (1.01x, 0.99x:
# the prefetches wait on each other, and the GEMM's tile and weights push the lines out of L2 before the split).
SPLIT_AHEAD = 4


@jit_inline
def prefetch_rows(plane: Any, first: int, last: int) -> None:
    """Prefetch rows ``first <= r < last`` of the 2-D ``plane`` (dense rows) into L2, a line at a time."""
    size = plane.shape[1] * plane.itemsize
    for r in range(first, last):
        at = row_of(plane, r, True).ctypes.data
        for off in range(0, size, 64):
            prefetch_l2(at + off)
        prefetch_l2(at + size - 1)  # the row's last line when the row does not start one


@jit_inline
def split(x: Any, n: int, c0: int, c1: int, i_base: int, prows: int, ow_n: int, buf: Any) -> None:
    """buf[GUARD + (((c - c0)*2 + a)*2 + b)*prows*OW + (i - i_base)*OW + j] = x[n, c, 2i + a, 2j + b] (0 for
    columns past the row) for channels ``c0 <= c < c1`` and the phase rows ``i_base <= i < i_base + prows``
    inside the image; the area's last ``GUARD`` floats 0. Starting a channel, it prefetches the rows it reads of
    the channel ``SPLIT_AHEAD`` on into L2 (``prefetch_rows``)."""
    height, width = x.shape[2], x.shape[3]
    evens, odds = (width + 1) // 2, width // 2  # a row's elements in its column phases 0 and 1
    plane = prows * ow_n
    first, last = max(0, 2 * i_base), min(height, 2 * (i_base + prows))  # the input rows the phase rows read
    for j in range(buf.size - GUARD, buf.size):  # never read unmasked; written so the whole area is touched
        buf[j] = 0.0
    for c in range(c0, c1):
        if c + SPLIT_AHEAD < c1:
            prefetch_rows(x[n, c + SPLIT_AHEAD], first, last)
        xp = x[n, c]
        for a in range(2):
            rows_in = (height - a + 1) // 2
            for i in range(max(0, i_base), min(rows_in, i_base + prows)):
                xr = row_of(xp, 2 * i + a, True)
                at = GUARD + ((c - c0) * 2 + a) * 2 * plane + (i - i_base) * ow_n
                copy_phases(buf, at, xr, 0, evens, at + plane, odds)
                for j in range(at + evens, at + ow_n):
                    buf[j] = 0.0
                for j in range(at + plane + odds, at + plane + ow_n):
                    buf[j] = 0.0


@jit_inline
def unfold(
    buf: Any,
    tile: Any,
    geo: Any,
    height: int,
    oh0: int,
    nr: int,
    prows: int,
    c0: int,
    k0: int,
    k1: int,
    m: Any,
    kbase: int,
    images: int,
    share: int,
) -> None:
    """tile[k - kbase, (i*nr + r)*OW + ow] = the unfolded input of image i, output row oh0 + r, column ow, for
    ``k0 <= k < k1`` and ``images`` images, read from the phases ``split`` put in ``buf`` (image i's from float
    ``i * share`` on) for channels from ``c0`` (of the k's group) and ``prows`` phase rows from oh0's least row
    offset; ``m`` the column masks (``masks``). Each row's tap is worked out once for all the images."""
    kh_n, kw_n, ph, pw, ow_n = geo[0], geo[1], geo[4], geo[5], geo[8]
    dr_lo = (-ph) // 2
    dc_lo = (-pw) // 2
    plane = prows * ow_n
    c, kh, kw = tap_of(k0, kh_n, kw_n)
    end = nr * ow_n
    for k in range(k0, k1):
        a = (kh - ph) & 1
        dr = (kh - ph - a) >> 1
        b = (kw - pw) & 1
        dc = (kw - pw - b) >> 1
        rows_in = (height - a + 1) // 2
        lo = min(nr, max(0, -(oh0 + dr))) * ow_n
        hi = max(lo, min(nr, rows_in - oh0 - dr) * ow_n)
        crow = row_of(tile, k - kbase, True)
        src = GUARD + (((c - c0) * 2 + a) * 2 + b) * plane + (dr - dr_lo) * ow_n + dc + lo
        keep = row_of(m, dc - dc_lo, True)  # (a bare view: m[...] would take a reference per row)
        for i in range(images):
            d = i * end
            for p in range(d, d + lo):
                crow[p] = 0.0
            for p in range(d + hi, d + end):
                crow[p] = 0.0
            if dc == 0:
                copy_run(crow, d + lo, buf, src + i * share, hi - lo)
            else:
                copy_where(crow, d + lo, buf, src + i * share, hi - lo, keep, lo)
        c, kh, kw = next_tap(c, kh, kw, kh_n, kw_n)


@jit_inline
def unfold_plane(
    img: Any, c0: int, tile: Any, d0: int, geo: Any, oh0: int, nr: int, k0: int, k1: int, m: Any, kbase: int
) -> None:
    """tile[k - kbase, d0 + r*OW + ow] = img[c0 + c, oh0 + r + kh*dh - ph, ow + kw*dw - pw] (0 outside the image)
    for ``k0 <= k < k1``, k = (c*KH + kh)*KW + kw, OW = W and the planes' rows back to back (``plane_usable``): one
    flat run of the plane per unfolded row, the columns that wrap around an input row (padding) masked to 0 by
    ``m[kw]`` (``plane_masks``; ``copy_where`` loads only the kept ones), the output rows outside the image
    zeroed. Measured against the flat copy with scalar zeroing per output row that ``conv.im2col`` had before
    (one thread, all unfolded rows of one image, /tmp/w45/unf2.py of the forty-fifth session): 512 x 7^2 199 -> 68
    us, 256 x 14^2 129 -> 67 us."""
    kh_n, kw_n, ph, pw, dh, dw, ow_n = geo[0], geo[1], geo[4], geo[5], geo[6], geo[7], geo[8]
    height = img.shape[1]
    size = height * ow_n
    end = nr * ow_n
    c, kh, kw = tap_of(k0, kh_n, kw_n)
    at = c
    plane = span_of(img[c0 + c], 0, size)
    for k in range(k0, k1):
        if c != at:
            at = c
            plane = span_of(img[c0 + c], 0, size)
        dr = kh * dh - ph
        dc = kw * dw - pw
        lo = min(nr, max(0, -(oh0 + dr))) * ow_n
        hi = max(lo, min(nr, height - oh0 - dr) * ow_n)
        crow = row_of(tile, k - kbase, True)
        for p in range(d0, d0 + lo):
            crow[p] = 0.0
        for p in range(d0 + hi, d0 + end):
            crow[p] = 0.0
        if hi > lo:
            src = (oh0 + dr) * ow_n + dc + lo
            if dc == 0:
                copy_run(crow, d0 + lo, plane, src, hi - lo)
            else:
                copy_where(crow, d0 + lo, plane, src, hi - lo, row_of(m, kw, True), lo)
        c, kh, kw = next_tap(c, kh, kw, kh_n, kw_n)


@rows_only("x")
@_jit.jit
def unfold_planes(
    x: Any, n0: int, nn: int, c0: int, oh0: int, nr: int, geo: Any, m: Any, cols: Any, k0: int, k1: int, kbase: int
) -> None:
    """cols[k - kbase, (i*nr + r)*OW + ow] = ``unfold_plane`` of image n0 + i from channel c0 (the group's first),
    output rows oh0 + r, for ``k0 <= k < k1`` and ``nn`` images (im2col's tile, a k range per helper thread; or
    a k block of im2col_tiles' tile of several images, ``kbase`` = k0)."""
    for i in range(nn):
        unfold_plane(x[n0 + i], c0, cols, i * nr * geo[8], geo, oh0, nr, k0, k1, m, kbase)


STEP_ROWS = 64  # unfolded rows per step of ``unfold_images`` (whole channels): the rows it writes stay in L2


def step_channels(taps: int, channels: int) -> int:
    """Input channels per step of ``unfold_images``: whole channels of ``taps`` = KH * KW unfolded rows each, up
    to STEP_ROWS rows (at least one channel), at most the group's ``channels``."""
    return min(channels, max(1, STEP_ROWS // taps))


def images_area_floats(t: Any, rows: int, images: int) -> int:
    """Floats of one ``unfold_images`` range's phase area: a step's phase area (``area_floats``) per image."""
    return images * area_floats(t, rows, step_channels(t.kh * t.kw, t.cg))


@rows_only("x")
@_jit.jit
def unfold_images(
    x: Any,
    n0: int,
    nn: int,
    cg0: int,
    oh0: int,
    nr: int,
    geo: Any,
    buf: Any,
    m: Any,
    cols: Any,
    k0: int,
    k1: int,
    kbase: int,
) -> None:
    """cols[k - kbase, (i*nr + r)*OW + ow] = the unfolded input of image n0 + i, output row oh0 + r, column ow
    (channel cg0 + k // (KH*KW), the group's first plus k's), for ``k0 <= k < k1`` and ``nn`` images (im2col's
    tiles, a k range per helper thread; or a k block of im2col_tiles' tile of several images, ``kbase`` = k0). In
    steps of ``step_channels`` whole channels: ``split`` each image's into its
    share of ``buf``, then ``unfold`` the step's rows of all the images (they stay in L2)."""
    kk = geo[0] * geo[1]
    prows = plane_rows(nr, geo[4], geo[0])
    dr_lo = (-geo[4]) // 2
    cpk = max(1, STEP_ROWS // kk)
    share = buf.size // nn
    for cs in range(k0 // kk, (k1 - 1) // kk + 1, cpk):
        lo, hi = max(k0, cs * kk), min(k1, (cs + cpk) * kk)
        c0, c1 = lo // kk, (hi - 1) // kk + 1
        for i in range(nn):
            split(x, n0 + i, cg0 + c0, cg0 + c1, oh0 + dr_lo, prows, geo[8], buf[i * share : (i + 1) * share])
        unfold(buf, cols, geo, x.shape[2], oh0, nr, prows, c0, lo, hi, m, kbase, nn, share)
