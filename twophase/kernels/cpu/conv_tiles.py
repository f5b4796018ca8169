"""conv2d as im2col tiles fed straight to the register-blocked GEMM (``gemm.host_gemm_tile``: ``gemm_tile``, or
``gemm_tile_ymm`` on AVX2): each part unfolds a tile (a k block of the unfolded rows x a few output rows' pixels, or
up to ``tile_n`` whole small images' pixels) into its own slice of the workspace, small enough to stay in L2, and
multiplies the weight's k block by it into ``out`` (a tile of several images into the part's stage, copied into each
image's output after its last k block: their pixels fill the GEMM's panels better than one 7x7 image's 49). The
unfolded input is never written whole: the workspace is one tile per part whatever the batch and image size, and the
GEMM reads the tile back from cache."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ...layout import align
from ...runtime.fanout import run_parts, workspace_launcher
from . import conv_phases, gemm
from . import jit as _jit
from .conv import IM2COL, _geo, _wmat, step_key
from .jit import entry, row_of, rows_dense, rows_only, variant_call

Launch = Callable[[Any], None]
jit: Callable[[Callable[..., Any]], Any] = _jit.jit


_im2col = variant_call(tuple(IM2COL.values()))


@_jit.jit_inline
def add_bias(out: Any, n: int, i0: int, i1: int, bias: Any, j0: int, j1: int) -> None:
    """out[n, i, j0:j1] += bias[i] for the output channels ``i0 <= i < i1`` of a channel-major out (N, OC, OH*OW)
    whose pixels are dense (``channel_major_operands``): a tile's or chunk's pixels, added while they are in cache.
    Rows as bare views (``row_of``): ``out[n, i]`` would take a reference on out per row."""
    img = out[n]
    for i in range(i0, i1):
        orow = row_of(img, i, True)
        b0 = bias[i]
        for j in range(j0, j1):
            orow[j] += b0


def _conv_kernel(variant: int, dense: bool, step: int) -> Any:
    # closure constants: the other variants compile neither the phase path nor the plane path
    PHASES = dense and step == 2  # noqa: N806
    PLANES = dense and step == 1  # noqa: N806

    @rows_only("x", "out")
    @jit
    def conv_tiles(
        x: Any,
        w: Any,
        bias: Any,
        has_bias: bool,
        out: Any,
        geos: Any,
        tile: Any,
        kc: int,
        rows: int,
        r0: int,
        r1: int,
        i0: int,
        i1: int,
        k_lo: int,
        k_hi: int,
        phases: Any,
        masks: Any,
        planes: bool,
        images: int,
        stage: Any,
    ) -> None:
        """out[n, i, oh*OW + ow] = sum_k w[i, k] * unfolded(n)[k, oh*OW + ow] (+ bias[i]) over the unfolded rows
        ``k_lo <= k < k_hi``, for the rows ``i0 <= i < i1`` and the output rows ``r0 <= r < r1`` of all images
        stacked (r = n*OH + oh): per tile of ``rows`` output rows of one image and k block of ``kc`` unfolded rows
        (from ``k_lo`` on), ``conv.im2col`` into the tile
        (or, given a phase area ``phases``, ``conv_phases.split`` then ``conv_phases.unfold`` with the column
        masks ``masks``; with ``planes``, ``conv_phases.unfold_plane`` with them), then ``gemm.gemm_tile`` into
        out (the part's first k block stores, the later ones add). With ``images`` > 1 (tiles of whole images), a
        tile takes up to that many whole images (``conv_phases.unfold_images`` or ``unfold_planes`` with phases or
        planes); the GEMM of a tile of several goes to ``stage`` (its rows ``i0 <= i < i1``), then one copy per
        row and image into out adds the bias. ``geos[g]``: the geometry (``conv._geo``) of g images."""
        item = 4
        geo = geos[1]
        ow_n = geo[8]
        oh_n = out.shape[2] // ow_n
        lda, sak = w.strides[0] // item, w.strides[1] // item
        ldt, ldc = tile.strides[0] // item, out.strides[1] // item
        pt = tile.ctypes.data
        taps = geo[0] * geo[1]
        prows = conv_phases.plane_rows(rows, geo[4], geo[0])
        dr_lo = (-geo[4]) // 2
        r = r0
        while r < r1:
            n = r // oh_n
            oh0 = r - n * oh_n
            nr = min(rows, oh_n - oh0, r1 - r)
            g = max(1, min(images, (r1 - r) // oh_n)) if oh0 == 0 else 1  # whole images from r
            width = g * nr * ow_n
            if g > 1:
                pc, ldo = stage.ctypes.data, stage.strides[0] // item
            else:
                pc, ldo = out[n].ctypes.data + (i0 * ldc + oh0 * ow_n) * item, ldc
            for k0 in range(k_lo, k_hi, kc):
                kl = min(kc, k_hi - k0)
                if PHASES and phases.size and images > 1:
                    conv_phases.unfold_images(x, n, g, 0, oh0, nr, geos[g], phases, masks, tile, k0, k0 + kl, k0)
                elif PHASES and phases.size:
                    c0 = k0 // taps
                    c1 = (k0 + kl - 1) // taps + 1
                    conv_phases.split(x, n, c0, c1, oh0 + dr_lo, prows, ow_n, phases)
                    conv_phases.unfold(phases, tile, geo, x.shape[2], oh0, nr, prows, c0, k0, k0 + kl, masks, k0, 1, 0)
                elif PLANES and planes:
                    conv_phases.unfold_planes(x, n, g, 0, oh0, nr, geo, masks, tile, k0, k0 + kl, k0)
                else:
                    _im2col(variant, x, n, 0, oh0, geos[g], tile[:kl, :width], k0, k0 + kl, k0)
                if k0 == k_lo:  # the masked panel reads the tile's columns up to the next 16: keep them finite
                    read = -(-width // gemm.LANES) * gemm.LANES  # (within ldt: the widest tile's, rounded alike)
                    for kk in range(kl):  # (the first k block is the deepest; the unfold never writes them)
                        trow = row_of(tile, kk, True)
                        for j in range(width, read):
                            trow[j] = 0.0
                gemm.host_gemm_tile(
                    w.ctypes.data + (i0 * lda + k0 * sak) * item,
                    lda,
                    sak,
                    pt,
                    ldt,
                    pc,
                    ldo,
                    kl,
                    i1 - i0,
                    width,
                    k0 - k_lo,
                    0,
                    0,
                )
            if g > 1:
                pixels = nr * ow_n
                for q in range(g):
                    img = out[n + q]
                    for i in range(i0, i1):
                        srow = row_of(stage, i - i0, True)
                        orow = row_of(img, i, True)
                        b0 = bias[i] if has_bias else np.float32(0.0)
                        for j in range(pixels):
                            orow[j] = srow[q * pixels + j] + b0
            elif has_bias:
                add_bias(out, n, i0, i1, bias, oh0 * ow_n, oh0 * ow_n + width)
            r += g * nr

    return conv_tiles


CONV_TILES = {key: _conv_kernel(i, *key) for i, key in enumerate(IM2COL)}  # i: the key's variant in _im2col
_NO_PHASES = np.zeros(0, np.float32)
_NO_MASKS = np.zeros((1, 1), np.bool_)
_NO_STAGE = np.zeros((1, 1), np.float32)


def build_im2col_tiles(t: Any, x: Any, w: Any, bias: Any, out: Any) -> Launch:
    """The launch of ``len(t.grid)`` parts: part i takes the output block ``t.grid[i]`` (output rows of all images
    stacked, output channels, unfolded rows) with its own tile in the workspace, ``t.kblock`` unfolded rows by the
    columns of the widest tile any part runs (``tile_columns``), after the parts' phase areas when ``t.phases``
    (``conv_phases``); ``t.flat``: the unfold reads the input planes as their one phase (``unfold_plane``). With
    ``t.tile_n`` > 1, tiles of up to that many whole images, whose GEMM goes to the part's stage area after the
    tiles (``stage_bytes``: its output channels), then into out. A part whose unfolded rows start past 0 sums
    into a partial output of its own, after the tiles and stages (``partial_bytes``), which the launch adds into
    out once every part is done."""
    item = x.itemsize
    o3, wmat, b, has = channel_major_operands(t, x, w, bias, out)
    images = t.tile_n
    geos = np.stack([_geo(t, g) for g in range(images + 1)])
    shape = (t.kblock, tile_columns(t))
    size = tile_stride(*shape, item)
    area = phase_floats(t) * item
    if t.phases:
        masks = conv_phases.masks(t, t.chunk)
    elif t.flat:
        masks = conv_phases.plane_masks(t, t.chunk)
    else:
        masks = _NO_MASKS
    sample = np.empty(1 if t.phases else 0, x.dtype)
    kernel = CONV_TILES[rows_dense(x), step_key(t.sw)]
    blank = np.empty(shape, x.dtype)
    rest = (geos, blank, 0, 0, 0, 0, 0, 0, 0, 0, sample, masks, t.flat, images, blank)
    # x and out are ``rows_only``: one compile for every layout, the parts' partial outputs (dense) included
    k = entry(kernel, x, wmat, b, has, o3, *rest)
    sums_shape = (t.n, t.oc, t.oh * t.ow)
    dt, grid, kb, rows, flat = x.dtype, t.grid, t.kblock, t.chunk, t.flat
    tiles_at = len(grid) * area
    stages = [stage_bytes(t, block, item) for block in grid]
    stage_at = list(itertools.accumulate(stages, initial=tiles_at + len(grid) * size))  # each part's, then the end
    sums_at = stage_at[-1]
    sum_stride, sum_bytes = partial_bytes(t, item), math.prod(sums_shape) * item

    def bind(ws: Any) -> Callable[[], None]:
        """The parts' calls on the workspace ``ws`` (their tile, phase area, stage and partial output views), made
        once per workspace (``workspace_launcher``), not on every launch."""
        parts = []
        sums: list[Any] = []
        for i, block in enumerate(grid):
            tile = ws[tiles_at + i * size : tiles_at + (i + 1) * size].view(dt).reshape(shape)
            phases = ws[i * area : (i + 1) * area].view(dt) if area else _NO_PHASES
            at = stage_at[i]
            stage = ws[at : at + stages[i]].view(dt).reshape(-1, shape[1]) if stages[i] else _NO_STAGE
            dst, with_bias = o3, has
            if block[4]:  # unfolded rows past 0: into a partial output
                at = sums_at + len(sums) * sum_stride
                dst, with_bias = ws[at : at + sum_bytes].view(dt).reshape(sums_shape), False
                sums.append(dst)
            parts.append(
                functools.partial(
                    k, x, wmat, b, with_bias, dst, geos, tile, kb, rows, *block, phases, masks, flat, images, stage
                )
            )

        def run() -> None:
            run_parts(parts)
            for dst in sums:
                np.add(o3, dst, out=o3)

        return run

    return workspace_launcher(bind)


def channel_major_operands(t: Any, x: Any, w: Any, bias: Any, out: Any) -> tuple[Any, Any, Any, bool]:
    """What a channel-major GEMM kernel of tiling ``t`` takes: out as (N, OC, OH*OW) (its planes dense), the weight
    as its (OC, KC) matrix, the bias (a dummy one when None) and whether there is one."""
    item = x.itemsize
    so = [s // item for s in out.strides]
    o3 = as_strided(out, (t.n, t.oc, t.oh * t.ow), (so[0] * item, so[1] * item, item))
    has = bias is not None
    return o3, _wmat(t, w, 0), bias if has else np.zeros(1, x.dtype), has


def tile_columns(t: Any) -> int:
    """Columns of each part's tile: ``t.tile_n`` whole images' pixels (when more than one), else the widest tile's
    (``widest_tile``), rounded up to 16 (``tile_width``)."""
    if t.tile_n > 1:
        return tile_width(t.tile_n * t.oh, t.ow)
    return tile_width(widest_tile(t.grid, t.chunk, t.oh), t.ow)


def phase_floats(t: Any) -> int:
    """Floats of each part's phase area: with ``t.phases``, a k block's channels of one image
    (``conv_phases.area_floats``), or, for tiles of several images, ``conv_phases.unfold_images``' steps of
    ``t.tile_n`` images (``images_area_floats``); else 0."""
    if not t.phases:
        return 0
    if t.tile_n > 1:
        return int(conv_phases.images_area_floats(t, t.chunk, t.tile_n))
    ranges = [k1 - k0 for *_, k0, k1 in t.grid] or [t.kc]  # (each part's k range starts a channel)
    channels = max(conv_phases.tile_channels(n, t.kblock, t.kh * t.kw) for n in ranges)
    return int(conv_phases.area_floats(t, t.chunk, channels))


def stage_bytes(t: Any, block: Any, item: int) -> int:
    """Bytes of the stage of the part of ``t.grid`` entry ``block``: for tiles of several images, its output
    channels by ``tile_columns`` (whole 64-byte lines); else 0. Each part's is its own size, so that the last one
    ends where its GEMM's last row does."""
    if t.tile_n <= 1:
        return 0
    return int((block[3] - block[2]) * tile_columns(t) * item)


def workspace_bytes(t: Any, item: int) -> int:
    """The workspace of tiling ``t``: per part a phase area (``phase_floats``) and a tile (``tile_columns``), then
    each part's stage (``stage_bytes``), then a partial output per part whose unfolded rows start past 0."""
    per_part = phase_floats(t) * item + tile_stride(t.kblock, tile_columns(t), item)
    stages = sum(stage_bytes(t, block, item) for block in t.grid)
    return len(t.grid) * per_part + stages + partial_parts(t.grid) * partial_bytes(t, item)


def widest_tile(grid: Any, rows: int, oh: int) -> int:
    """Output rows of the widest tile the parts of ``grid`` run: tiles of up to ``rows`` rows, cut at each image's
    last row and at the part's (``conv_tiles``' loop). A tile's columns are sized by it (``tile_width``): a part
    whose tiles are all shorter than ``rows`` touches no more, and the workspace is what is touched."""
    most = 0
    for r0, r1, *_ in grid:
        r = r0
        while r < r1 and most < rows:
            nr = min(rows, oh - r % oh, r1 - r)
            most = max(most, nr)
            r += nr
    return most


def partial_parts(grid: Any) -> int:
    """Parts of ``grid`` whose unfolded rows start past 0: each sums into a partial output of its own."""
    return sum(1 for block in grid if block[4] > 0)


def partial_bytes(t: Any, item: int) -> int:
    """Bytes of one partial output in the workspace: N * OC * OH * OW elements, on 64-byte lines."""
    return align(t.n * t.oc * t.oh * t.ow * item)


def tile_width(rows: int, ow: int) -> int:
    """Columns of a tile of ``rows`` output rows: their pixels rounded up to 16 (the GEMM's masked last panel
    reads its b rows 16 wide)."""
    return -(-rows * ow // gemm.LANES) * gemm.LANES


def tile_stride(kblock: int, width: int, item: int) -> int:
    """Bytes of one part's tile in the workspace (a multiple of 64 for float32: ``width`` is one of 16)."""
    return kblock * width * item


# Where the time goes on AMD Zen 4 (sixty-seventh session, /tmp/w67): with the unfold and split skipped (wrong
# results), the tiles' GEMM alone ran 0.97-0.98x torch's whole convolution on 8 x 128->256 28^2 s2 and 256->512 14^2
# s2 (two threads, 7 rounds; 1.15x on 64->128 56^2 s2, whose split was then 10% of the time): in place it runs ~106
# GFLOP/s a core, against 110-115 for the same tiles hot in L2 (gt.py) and torch's ~108 for its whole convolution.
# A direct convolution on phase planes (the input broadcast, the weights' [tap][c][oc] rows the vector operand, one
# gemm_tile per tap over the planes into a pixel-major stage, then transposed into out; direct.py) was prototyped:
# its GEMMs alone ran 96-103 GFLOP/s on one thread on 8 x 64->128 and 128->256 s2, 84-93 on 256->512 (torch
# 92-106), and its split and transposition as written took the whole to 71-88: not built.
# the tiles' GEMM (``gemm.host_gemm_tile``) on AVX2 too: the 8-lane kernels. Forced through the op against im2col_parts
# / im2col (OpenBLAS), two threads, 11 interleaved rounds, AMD Zen 3 (/tmp/w57/ctab.py of the fifty-seventh session),
# torch / ours: stem 3->64 224^2 k7 s2 1.51 against 1.34, 128->256 28^2 s2 1.17 against 0.90, 64->128 56^2 s2 0.93
# against 0.83, 256->512 14^2 s2 1.18 against 1.09, 512->512 7^2 1.30 against 1.10 (im2col), n8 64->128 56^2 s2 0.87
# against 0.79; at 256 KiB 0.65-1.54 against 0.36-0.70
def available(dtype: Any) -> bool:
    """Whether the tiles can run: float32 on a CPU with the register-blocked GEMM (AVX-512, or AVX2 and FMA)."""
    return np.dtype(dtype) == np.float32 and gemm.blocked_available()
