"""scaled_dot_product_attention's ``fused`` implementation: per helper thread one compiled loop over query tiles,
no Python between them.

A tile of ``tq`` queries of one head against every key it sees: ``S^T = K @ (scale * Q)^T`` (keys x queries,
``gemm.gemm_tile`` with k's rows broadcast, any strides, and the tile's scaled queries packed as the panel), a softmax
down the columns of S^T (each key row's loop runs across the tile's queries, so it vectorizes however few keys there
are), then ``out = P @ V`` with P read as S^T transposed (the register-blocked GEMM broadcasts its left operand at any
strides), normalized by the column sums. Past ``keys_max()`` keys (``BK_MAX``; ``BK_MAX_YMM`` on the 8-lane kernels), or
where the workspace limit leaves no room for every key, the keys run in blocks with an online softmax (the column maxima
move from block to block, and what the sums and out rows hold so far is rescaled). Causal tiles run only the keys up to
their last query (top-left aligned, as PyTorch). A mask is added to (additive) or applied on (bool) each key row of S^T:
a key-padding mask (the same row for every query) as one value per key row, its tiles running only the keys up to the
last one their head keeps; any other mask one load per score, across its rows (the op ranks that case after the
materialized form). A query with no key left gives a row of 0. Each part (helper thread) takes a share of the tiles
balanced by their work (causal tiles grow with their queries, ``shares``) and has its own area of the workspace
(``area_floats``).

Against the materialized implementation (the whole score matrix, batched GEMMs, a fused row pass), both forced through
the op, two threads, 9 interleaved rounds, AMD Zen 4 (/tmp/w54/sdr.py of the fifty-fourth session), t(materialized) /
t(fused): (2, 8, 1024, 64) 1.10, (32, 4, 64, 16) 1.14, (1, 12, 512, 64) 1.06, (8, 12, 128, 32) 1.05, (1, 12, 128, 32)
1.01-1.03, (1, 1, 2048, 128) 0.99, (4, 4, 32, 32) 0.99; causal (1, 12, 512, 64) 1.36-1.41, (8, 12, 128, 32) 1.07, (1,
12, 128, 32) 1.11; in 1/48 of the workspace at (1, 12, 512, 64). (Measured before the queries were packed through a
column view and the maxima taken four key rows a pass, changes timed on Zen 3 only.)

On AMD Zen 3 (AVX2, the 8-lane kernels; /tmp/w57/fc.py of the fifty-seventh session): causal (1, 12, 512, 64) 1.21, (8,
12, 128, 32) 1.05-1.07, (1, 12, 128, 32) 1.14; not causal (8, 12, 128, 32) 0.94-0.98, (1, 12, 512, 64) 0.89-0.98
(``ops.attention`` ranks them by that).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ...runtime.fanout import run_parts, workspace_launcher
from . import gemm
from . import jit as _jit
from . import vmath as vm
from .attention import ADDITIVE, BOOL, NONE, is_key_padding, mask_arg
from .jit import any_layout, entry, row_of, rows_only, wide_vectors

jit: Callable[[Callable[..., Any]], Any] = _jit.jit

TQ_MAX = 64  # queries per tile at most: a 64-wide panel of the score GEMM (wider ran no faster)
LOWEST = float(-np.finfo(np.float32).max)  # where column maxima start: a fully masked column's stays finite
BK_MAX = 512  # keys per block at most: as fast as whole rows of 1024-4096 keys (blocks of 256: 0.96x), in less area
# on the 8-lane kernels: 64 keys, whose block of S^T stays in L1 (AMD Zen 3, one thread, 11 interleaved rounds,
# /tmp/w57/cmp.py of the fifty-seventh session, t(64) / t(bk): (1, 12, 512, 64) 0.90 at 256, 0.96 at 128, 1.01 at
# 96, 0.95 at 32; (1, 8, 1024, 64) 0.86 at 512, 0.92 at 128; (8, 12, 128, 32) 1.01 at 128)
BK_MAX_YMM = 64


def row_width(tq: int) -> int:
    """Floats per row of a tile's packed queries and scores: the columns the score GEMM's panels read and write
    for ``tq`` queries (an 8-wide ymm panel up to 8, else whole 16-wide vectors)."""
    return 8 if tq <= 8 else -(-tq // gemm.LANES) * gemm.LANES


def area_floats(keys: int, d: int, tq: int, bk: int) -> int:
    """Floats of one part's area: S^T of a key block (``bk`` of the ``keys`` x width), the packed queries
    (D x width), the tile's column maxima and sums, and with more than one block the block's maxima (2 or 3 x
    width), width = ``row_width(tq)``."""
    return (min(bk, keys) + d + (2 if bk >= keys else 3)) * row_width(tq)


def on_zmm() -> bool:
    """Whether the tiles' GEMMs run on the AVX-512 kernels (else on the 8-lane ones, ``gemm.gemm_tile_ymm``)."""
    return gemm.available()


def keys_max() -> int:
    """Keys per block at most: ``BK_MAX`` on the AVX-512 kernels, ``BK_MAX_YMM`` on the 8-lane ones."""
    return BK_MAX if on_zmm() else BK_MAX_YMM


def available(dtype: Any, dv: int, v_strides: tuple[int, ...], out_strides: tuple[int, ...]) -> bool:
    """Whether the fused tiles can run: float32 on a CPU with the register-blocked GEMM (AVX-512, or AVX2 and
    FMA), value rows of whole 16-float vectors (the GEMM reads b's rows to the next 16) whose elements are adjacent
    in v and out, rows at positive strides (``v_strides``, ``out_strides`` in elements)."""
    return (
        np.dtype(dtype) == np.float32
        and gemm.blocked_available()
        and dv > 0
        and dv % gemm.LANES == 0
        and v_strides[-1] == 1
        and out_strides[-1] == 1
        and v_strides[-2] > 0
        and out_strides[-2] > 0
    )


@rows_only("q", "k", "v", "out")  # read through pointers, strides and dense rows
@jit
def fused_tiles(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    area: Any,
    tiles: Any,
    t0: int,
    t1: int,
    tq: int,
    width: int,
    bk: int,
    scale: float,
    causal: bool,
    mask: Any,
    kind: int,
    padding: bool,
) -> None:
    """out[b, h, q0:q0 + n] for the tiles ``tiles[t0:t1]`` (rows (b, h, q0)), ``tq`` queries each, in the
    float32 ``area`` (``area_floats``; ``width`` = ``row_width(tq)``), key blocks of ``bk`` keys: per block
    S^T = K @ (scale Q)^T, a softmax down its columns (causal: key j masked for the queries before it), out += P @ V;
    from the second block on, the column maxima move and what out and the sums hold so far is rescaled (an online
    softmax); at the end each row is divided by its column's sum (0 for a query with no key: its output row is 0).
    ``mask`` (B, H, Lq, Lk)-indexable at any strides, ``kind`` NONE / BOOL / ADDITIVE, or TRANSPOSED: mask[0, 0] is
    the additive mask of every head as dense (Lk, Lq) rows (``transpose_mask``); ``padding``: the same mask row for
    every query, and a tile then runs only the keys up to the last one its head's row keeps."""
    wide_vectors()
    nq, d = q.shape[2], q.shape[3]
    nk, dv = k.shape[2], v.shape[3]
    st = area[: bk * width].reshape(bk, width)
    qt = area[bk * width : (bk + d) * width].reshape(d, width)
    colmax = area[(bk + d) * width : (bk + d + 1) * width]
    colsum = area[(bk + d + 1) * width : (bk + d + 2) * width]
    blockmax = area[(bk + d + 2) * width : (bk + d + 3) * width]  # only with more than one block
    sc = np.float32(scale)
    lowest = np.float32(LOWEST)  # the maxima start here, not at -inf: a fully masked column stays finite
    item = 4
    mb = mask[0, 0]
    for ti in range(t0, t1):
        b, h, q0 = tiles[ti, 0], tiles[ti, 1], tiles[ti, 2]
        n = min(tq, nq - q0)
        kend = min(nk, q0 + n) if causal else nk
        kh, ob, vb = k[b, h], out[b, h], v[b, h]
        if kind == BOOL or kind == ADDITIVE:
            mb = mask[b, h]
            if padding:
                last = 0
                for j in range(kend - 1, -1, -1):
                    if (mb[q0, j] != 0) if kind == BOOL else (mb[q0, j] != -np.inf):
                        last = j + 1
                        break
                kend = last
        if kend == 0:  # every key masked: rows of 0 (as the row pass gives them)
            for i in range(n):
                orow = row_of(ob, q0 + i, True)
                for c in range(dv):
                    orow[c] = 0.0
            continue
        qb = q[b, h]
        for dd in range(d):  # (through a column view: q indexed per element took 9% of the tiles' time)
            row = row_of(qt, dd, True)
            col = qb[q0 : q0 + n, dd]
            for i in range(n):
                row[i] = col[i] * sc
            for i in range(n, width):
                row[i] = 0.0
        for j0 in range(0, kend, bk):
            m = min(bk, kend - j0)
            # all ``width`` columns: those past n are 0 (the packed zeros), so the whole area is written
            gemm.host_gemm_tile(
                kh.ctypes.data + j0 * kh.strides[0],
                kh.strides[0] // item,
                kh.strides[1] // item,
                qt.ctypes.data,
                width,
                st.ctypes.data,
                width,
                d,
                m,
                width,
                0,
                0,
                0,
            )
            mx = colmax if j0 == 0 else blockmax
            for i in range(width):
                mx[i] = lowest
            for jj in range(m if causal or kind != NONE else 0):  # the masks first, then the maxima
                j = j0 + jj
                row = row_of(st, jj, True)
                if causal and j > q0:  # queries q0 .. j - 1 come before key j
                    for i in range(min(n, j - q0)):
                        row[i] = -np.inf
                if kind == BOOL:
                    if padding:
                        if not mb[q0, j]:
                            for i in range(n):
                                row[i] = -np.inf
                    else:
                        for i in range(n):
                            if not mb[q0 + i, j]:
                                row[i] = -np.inf
                elif kind == ADDITIVE:
                    if padding:
                        add = mb[q0, j]
                        for i in range(n):
                            row[i] += add
                    else:
                        for i in range(n):
                            row[i] += mb[q0 + i, j]
                elif kind == TRANSPOSED:
                    mrow = row_of(mb, j, True)[q0:]  # (indexed from 0: mrow[q0 + i] checks for wraparound, 5x slower)
                    for i in range(n):
                        row[i] += mrow[i]
            for jj in range(0, m, 4):  # four key rows a pass over mx (the last repeats rows: max is idempotent)
                r0, r1 = row_of(st, jj, True), row_of(st, min(jj + 1, m - 1), True)
                r2, r3 = row_of(st, min(jj + 2, m - 1), True), row_of(st, min(jj + 3, m - 1), True)
                for i in range(n):
                    top = vm.maximum(vm.maximum(r0[i], r1[i]), vm.maximum(r2[i], r3[i]))
                    mx[i] = vm.maximum_stored(mx[i], top)
            if j0 == 0:
                for i in range(width):
                    colsum[i] = 0.0
            else:  # the maxima move to cover the block; what the earlier blocks gave is rescaled to them
                for i in range(n):
                    top = vm.maximum_stored(colmax[i], blockmax[i])
                    alpha = vm.exp_nonpos_f32(colmax[i] - top)
                    colmax[i] = top
                    colsum[i] *= alpha
                    orow = row_of(ob, q0 + i, True)
                    for c in range(dv):
                        orow[c] *= alpha
            for jj in range(m):
                row = row_of(st, jj, True)
                for i in range(n):
                    e = vm.exp_nonpos_f32(row[i] - colmax[i])
                    row[i] = e
                    colsum[i] += e
            gemm.host_gemm_tile(
                st.ctypes.data,
                1,
                width,
                vb.ctypes.data + j0 * vb.strides[0],
                vb.strides[0] // item,
                ob.ctypes.data + q0 * ob.strides[0],
                ob.strides[0] // item,
                m,
                n,
                dv,
                0 if j0 == 0 else 1,
                0,
                0,
            )
        for i in range(n):
            inv = np.float32(1.0) / colsum[i] if colsum[i] > 0 else np.float32(0.0)
            orow = row_of(ob, q0 + i, True)
            for c in range(dv):
                orow[c] *= inv


TRANSPOSED = 3  # ``fused_tiles``' mask kind: a transposed additive copy (``transpose_mask``)


@jit
def transpose_mask(m: Any, mt: Any, kind: int) -> None:
    """mt[j, i] = m[i, j] as an additive mask (bool: 0 where kept, -inf where masked), in 16 x 16 blocks: the rows of
    mt are the key rows of S^T, so each score then reads its mask value from a dense row. (Slices indexed from 0:
    512 x 512 float32 in 0.15-0.18 ms, against 0.39-0.43 with indices that numba checks for wraparound.)"""
    nq, nk = m.shape
    for j0 in range(0, nk, 16):
        for i0 in range(0, nq, 16):
            ie = min(nq, i0 + 16)
            for j in range(j0, min(nk, j0 + 16)):
                row = row_of(mt, j, True)[i0:ie]
                col = m[i0:ie, j]
                if kind == BOOL:
                    for i in range(ie - i0):
                        row[i] = 0.0 if col[i] else -np.inf
                else:
                    for i in range(ie - i0):
                        row[i] = col[i]


def shares(nb: int, nh: int, nq: int, nk: int, tq: int, causal: bool, parts: int) -> tuple[Any, list[int]]:
    """The tiles (rows (b, h, q0)) ordered part by part, and where each part's run starts (``parts`` + 1 bounds):
    each tile, the most work first (its queries x the keys it sees), goes to the part with the least work so far,
    so that a causal head's late tiles, which see the most keys, do not all fall to one part."""
    tiles = [(b, h, q0) for b in range(nb) for h in range(nh) for q0 in range(0, nq, tq)]
    work = [min(tq, nq - q0) * (min(nk, q0 + tq) if causal else nk) for _, _, q0 in tiles]
    load = [0] * parts
    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]
    for i in sorted(range(len(tiles)), key=lambda i: -work[i]):  # (stable: equal work keeps the tiles' order)
        p = load.index(min(load))
        load[p] += work[i]
        runs[p].append(tiles[i])
    bounds = [0]
    for run in runs:
        bounds.append(bounds[-1] + len(run))
    return np.array([t for run in runs for t in sorted(run)], np.int64).reshape(-1, 3), bounds


def build_fused(
    q: Any, k: Any, v: Any, out: Any, mask: Any, kind: str, causal: bool, scale: float, t: Any
) -> Callable[[Any], None]:
    """The launch of ``t.parts`` parts of ``fused_tiles`` on tiles of ``t.block_q`` queries (``shares``), part i in
    the workspace's i-th area of ``t.area`` bytes; zeros when there are no keys. ``mask``: None, or bool / additive
    (``kind``) broadcast to (B, H, Lq, Lk), read at each launch: a key-padding mask (one row for every query) for
    the keys each head keeps; with ``t.mask_t`` >= 0 (a mask shared by every head), copied transposed to that offset
    of the workspace first (``transpose_mask``)."""
    nb, nh, nq, d = q.shape
    nk = k.shape[2]
    if nk == 0:
        return lambda _: out.fill(0)
    tiles, bounds = shares(nb, nh, nq, nk, t.block_q, causal, t.parts)
    keys = min(nk, nq) if causal else nk
    bk = min(t.block_k, keys)
    floats = area_floats(keys, d, t.block_q, bk)
    sample = np.empty(floats, np.float32)
    mask, mkind = mask_arg(mask, kind, np.float32)
    padding = is_key_padding(mask, mkind, nq)
    msample = mask if mkind == NONE else any_layout(np.float32 if t.mask_t >= 0 else mask.dtype, 4)
    kernel = entry(fused_tiles, q, k, v, out, sample, tiles, 0, 1, 1, 8, 1, 0.0, False, msample, 0, False)
    width = row_width(t.block_q)
    parts, stride = t.parts, t.area
    flip = None
    if t.mask_t >= 0:
        src = mask[0, 0]
        flip = entry(transpose_mask, any_layout(mask.dtype, 2), np.empty((1, 1), np.float32), 0)

    def bind(ws: Any) -> Callable[[], None]:
        """The parts' calls on their areas of ``ws``, made once per workspace (after the mask's transposed copy)."""
        mt, mk = mask, mkind
        if flip is not None:
            mt = ws[t.mask_t : t.mask_t + nk * nq * 4].view(np.float32).reshape(1, 1, nk, nq)
            mk = TRANSPOSED
        calls = [
            functools.partial(
                kernel,
                q,
                k,
                v,
                out,
                ws[i * stride : i * stride + floats * 4].view(np.float32),
                tiles,
                bounds[i],
                bounds[i + 1],
                t.block_q,
                width,
                bk,
                scale,
                causal,
                mt,
                mk,
                padding and flip is None,
            )
            for i in range(parts)
        ]
        if flip is None:
            return functools.partial(run_parts, calls)
        copy = functools.partial(flip, src, mt[0, 0], mkind)

        def run() -> None:
            copy()
            run_parts(calls)

        return run

    return workspace_launcher(bind)
