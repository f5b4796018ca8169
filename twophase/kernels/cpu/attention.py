"""Scaled dot-product attention launches. Fully masked rows give 0, never NaN.

* ``build_rows`` (materialized and tiled): per tile of whole score rows (a block of batch entries, of heads, or
  of queries of one head), one batched GEMM ``S = q @ k^T`` into the workspace, one fused numba pass over
  the rows (scale, mask, max, exp, sum, normalize, in place) and one batched GEMM ``out = P @ v`` (float32
  heads by the register-blocked kernel, ``_products``, else BLAS); a large tile is cut into parts (batch
  entries, heads or query rows) run by helper threads, each part with its own GEMMs and row pass (those that
  call BLAS on one BLAS thread each), a part of many heads in chunks of heads whose scores stay in the core's L2
  (``HEAD_CHUNK_BYTES``); causal rows go through both GEMMs in blocks of ``causal_block()`` queries,
  each with only the keys it can see (the masked half of the scores is never multiplied). With a key-padding
  mask (one mask row for every query), a tile runs only the keys up to the last one the mask keeps for some
  (batch entry, head) of the tile, rounded up to ``KEY_GRAIN`` (exactly those keys, and no mask at all, when
  every row of the tile keeps the same ones: a bool mask), and never reads the keys after them. NaN or
  inf in the k / v row of a key that every query masks therefore reaches the output only when that key lies
  within a tile's extent (PyTorch's CPU attention always propagates it). The materialized form is the single
  tile holding every score.
* ``build_online``: query tiles against key tiles with an online softmax (the workspace holds one tile only);
  with a key-padding mask, each head runs only the keys up to its last kept one, as ``build_rows``' tiles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ...runtime.fanout import fanout_parts, run_parts, split_range, workspace_launcher
from . import gemm, vmath
from . import jit as _jit
from .blas import run_blas_parts
from .jit import any_layout, entry, wide_vectors

Launch = Callable[[Any], None]
Kernel = Callable[[Callable[..., Any]], Any]
jit: Kernel = _jit.jit  # the numba decorators, typed (jit.py leaves them untyped)
jit_inline: Kernel = _jit.jit_inline

NONE, ADDITIVE, BOOL = 0, 1, 2
QK_CHUNK = 128  # keys per score GEMM call (measured: 4 calls of N=128 beat one of N=512 with threaded BLAS)
FANOUT_MIN = 1 << 16  # score elements per tile from which it is cut into parts for helper threads
# query rows per GEMM of a causal part, each block against only the keys it can see. Measured (causal SDPA, ms) on
# the AMD EPYC with AVX2 (heads on the 8-lane kernel or BLAS) with blocks of 16 / 32 / 48 / 64 / 128 rows / one
# block: (1, 12, 512, 64) 4.0 / 3.8 / 4.1 / 4.1-4.4 / 4.4-4.9 / 5.9-6.2; (1, 12, 256, 64) 1.33 / 1.15 / 1.12 / 1.22 /
# 1.39 / 1.59; (8, 12, 128, 32) 1.69 / 1.60 / 1.61 / 1.71-1.76 / 1.81 / 1.82. Where float32 heads run on the AVX-512
# kernel (an Intel Xeon, the twenty-third session, /tmp/w23/cblock.py, 21 interleaved rounds), 64 against 32:
# (1, 12, 512, 64) 3.97 against 6.00 ms, (1, 12, 256, 64) 1.71 against 2.05, (8, 12, 128, 32) 2.62 against 3.11
# (a first run of 16 / 32 / 64 / 128 / one block: 8.0 / 5.8 / 5.4 / 5.5 / 7.2 at (1, 12, 512, 64)).
CAUSAL_BLOCK = 32
CAUSAL_BLOCK_WIDE = 64
CAUSAL_EXP_STEP = 16  # a causal row's exps run to a multiple of this many keys (then its keys past the end are 0)


def _heads_on_zmm(dtype: Any) -> bool:
    """Whether the heads' products of this dtype run on the AVX-512 kernel (``gemm.gemm_f32_heads``)."""
    return np.dtype(dtype) == np.float32 and gemm.available()


def causal_block(dtype: Any) -> int:
    """Query rows per causal block: ``CAUSAL_BLOCK_WIDE`` where the heads' products run on the AVX-512 kernel
    (float32 on a CPU that has it), else ``CAUSAL_BLOCK``."""
    return CAUSAL_BLOCK_WIDE if _heads_on_zmm(dtype) else CAUSAL_BLOCK


# a part's scores beyond this many bytes are made and used in chunks of heads (``_head_chunks``; Zen 3's L2 size).
# Measured against whole parts (/tmp/w21/chunk_ab.py of the twenty-first session, interleaved in one process):
# (8, 12, 128, 32), parts of 48 heads, 0.99-1.07x as fast over four runs; (1, 12, 512, 64), one head a chunk,
# 1.07-1.09x over two.
# Chunks of 256 KiB also cut MiniLM's parts of 6 heads (384 KiB of scores), which then ran 0.96-0.98x as fast.
# One head cut further into chunks of query rows (scores, softmax and P @ v per chunk, 256 or 128 KiB of scores)
# ran (1, 12, 512, 64) 0.99x and 1.00x as fast (AMD Zen 3, two threads, 15 interleaved rounds, /tmp/w66/rcab.py of
# the sixty-sixth session), though the row pass alone ran 1.09-1.16x faster on 256 KiB blocks than on 12 MiB.
HEAD_CHUNK_BYTES = 1 << 19
KEY_GRAIN = 16  # a padded tile's keys are rounded up to this: fewer bound variants, GEMM widths the kernels take


def is_key_padding(mask: Any, kind: int, nq: int) -> bool:
    """Whether ``mask`` (broadcast to (B, H, Lq, Lk)) is a key-padding mask, the same row for every query: then
    each launch runs only the keys it keeps (masks and is_causal never come together)."""
    return kind != NONE and (mask.strides[2] == 0 or nq == 1)


def _padding_rows(rows: Any) -> Any:
    """A tile's key-padding mask rows ((batch entries, heads, keys), a view of the mask) with its broadcast
    (stride-0) batch or head axis cut to one entry, so that each launch reads every distinct row once."""
    return rows[tuple(slice(0, 1) if rows.strides[a] == 0 else slice(None) for a in range(2))]


def _padded_keys(rows: Any, kind: int, kend: int) -> tuple[int, bool]:
    """(keys, exact): the keys a tile runs under a key-padding mask. ``exact`` when every row of ``rows``
    (..., keys) keeps the same leading keys and nothing else (bool masks only): the tile then runs just those,
    with no mask at all. Otherwise up to the last key that some row keeps (bool True, additive above -inf),
    rounded up to ``KEY_GRAIN``, with the mask; at least one key (a tile whose rows are all masked still goes
    through the softmax, which gives them 0), at most ``kend``."""
    keep = rows if kind == BOOL else rows != -np.inf
    live = keep.any(axis=tuple(range(rows.ndim - 1)))
    kept = int(live.size - np.argmax(live[::-1])) if live.any() else 0
    if kind == BOOL and kept and keep[..., :kept].all():
        return kept, True
    return min(kend, max(1, -(-kept // KEY_GRAIN) * KEY_GRAIN)), False


class _Tile(NamedTuple):
    """One tile of ``build_rows``, fixed in phase 1: its (batch, heads, queries, keys) shape, its k^T copy's shape
    (the keys its head group's last tile sees), its q / k^T / v / out views, how it packs k^T / v (0: its group's
    first tile did; 1: before its parts; 2: each part its heads), the axis its parts are cut along, the parts'
    plans, and on a padded group's first tile the group's key-padding mask rows (else None)."""

    shape: tuple[int, int, int, int]
    kshape: tuple[int, int, int, int]
    q: Any
    kt: Any
    v: Any
    out: Any
    pack_kv: int
    axis: int
    plans: list[Any]
    rows: Any


def _blocks(nq: int, q0: int, kend: int, causal: bool, rows: int) -> tuple[tuple[int, int, int], ...]:
    """(first row, end row, keys) of a part's query blocks: ``nq`` rows from query ``q0`` against ``kend`` keys;
    causal rows in blocks of ``rows`` (``causal_block``), each against the keys up to its last query (the keys
    after a row's own it gets as 0s from the row pass), else one block of every row and key."""
    if not causal or nq <= rows:
        return ((0, nq, kend),)
    return tuple((a, min(nq, a + rows), min(kend, q0 + min(nq, a + rows))) for a in range(0, nq, rows))


@jit
def softmax_rows(s: Any, mask: Any, kind: int, causal: bool, q0: int, scale: float, lowest: float, tiny: float) -> None:
    """Rows of ``s`` (nb, nh, nq, nk; query rows from ``q0``, keys from 0) become softmax(scale * s + mask), 0
    where masked or (``causal``) after the query. Each (b, h) block of ``s`` must be a dense matrix (the
    workspace's always are, however a tile is cut into parts); ``mask`` is (nb, nh, nq, nk)-indexable, any
    strides (unused when ``kind`` is NONE)."""
    nb, nh = s.shape[0], s.shape[1]
    if s.size and (s.strides[3] != s.itemsize or s.strides[2] != s.shape[3] * s.itemsize):
        raise ValueError("softmax_rows: the score blocks are not dense")
    wide_vectors()
    for b in range(nb):
        for h in range(nh):
            _head_rows(s, mask, kind, causal, q0, scale, lowest, tiny, b, h)


@jit_inline
def _scale_add_max(row: Any, mrow: Any, kend: int, sc: Any, m: Any) -> Any:
    """row[j] = row[j] * sc + mrow[j] for j < kend, in place; the max of ``m`` and those values."""
    for j in range(kend):
        x = row[j] * sc + mrow[j]
        row[j] = x
        m = vmath.maximum(m, x)
    return m


@jit_inline
def _head_rows(
    s: Any, mask: Any, kind: int, causal: bool, q0: int, scale: float, lowest: float, tiny: float, b: int, h: int
) -> None:
    """The rows of one (batch, head) block in s's precision: scale and mask fused with the max, the exps in a
    second pass, their float64 sum (``vmath.fsum``: reassociated there, never in the exp's range reduction) in a
    third, normalize in a fourth; keys past a causal row's end become 0."""
    nq, nk = s.shape[2], s.shape[3]
    ft = s.dtype.type
    sc = ft(scale)
    ninf = ft(-np.inf)
    # the dense block typed as a C matrix (no copy: softmax_rows checked it is dense), so that the row loops
    # vectorize when s itself is typed strided (a part cut after a dim > 1: 4.6 against 0.65 ns per score)
    block = np.ascontiguousarray(s[b, h])
    if kind == NONE:
        _paired_rows(block, causal, q0, sc, ft(lowest), tiny)
        return
    unit = kind == ADDITIVE and mask.strides[3] == mask.itemsize
    for i in range(nq):
        row = block[i]
        kend = min(nk, q0 + i + 1) if causal else nk
        m = ft(lowest)  # a fully masked row keeps max -FLT_MAX: its exps are 0, not NaN
        if kind == ADDITIVE:
            # a mask row of unit stride typed contiguous (no copy: checked): the row pass ran 1.15-1.5x faster
            # (/tmp/w18/rowpass.py of the eighteenth session); a bool row gained nothing from it
            if unit:
                m = _scale_add_max(row, np.ascontiguousarray(mask[b, h, i]), kend, sc, m)
            else:
                m = _scale_add_max(row, mask[b, h, i], kend, sc, m)
        elif kind == BOOL:
            brow = mask[b, h, i]
            for j in range(kend):
                x = row[j] * sc if brow[j] else ninf
                row[j] = x
                m = vmath.maximum(m, x)
        else:
            m = _scaled_max(row[:kend], sc, m)
        if kind == NONE:
            _exps(row[:kend], m)
        else:  # masked scores are -inf: their exps skip the underflow
            for j in range(kend):
                row[j] = vmath.exp_shifted_masked(row[j], m)
        _normalize(row[:kend], tiny)
        for j in range(kend, nk):
            row[j] = 0.0


@jit_inline
def _paired_rows(block: Any, causal: bool, q0: int, sc: Any, lowest: Any, tiny: float) -> None:
    """``_head_rows`` for a block with no mask, bit for bit, two rows at a time: both rows' exps in one loop, so
    that a short row's exp loop does not wait out its own latency (128-key rows: 1.01 against 1.15 ns a score on
    one thread, /tmp/w21/pairs.py of the twenty-first session; 512 keys: 0.98 against 1.04). ``causal``: row i
    keeps the keys up to query q0 + i; the pair's exps run to a whole number of vectors past the second row's
    end (their extra values then set to 0 with the rest), so no row ends in a scalar exp loop: the causal row
    pass ran 1.11-1.51x faster than row by row, causal SDPA (8, 12, 128, 32) 1.12-1.15x and (1, 12, 512, 64)
    1.02-1.06x (same bits; /tmp/w26/rowsab.py, sdpa_ab.py of the twenty-sixth session)."""
    nq, nk = block.shape
    for i in range(0, nq - 1, 2):
        r0, r1 = block[i], block[i + 1]
        k0, k1 = (min(nk, q0 + i + 1), min(nk, q0 + i + 2)) if causal else (nk, nk)
        m0 = _scaled_max(r0[:k0], sc, lowest)
        m1 = _scaled_max(r1[:k1], sc, lowest)
        for j in range(min(nk, -(-k1 // CAUSAL_EXP_STEP) * CAUSAL_EXP_STEP)):
            r0[j] = vmath.exp_shifted(r0[j], m0)
            r1[j] = vmath.exp_shifted(r1[j], m1)
        for j in range(k0, nk):
            r0[j] = 0.0
        for j in range(k1, nk):
            r1[j] = 0.0
        _normalize(r0[:k0], tiny)
        _normalize(r1[:k1], tiny)
    if nq % 2:
        last = block[nq - 1]
        kend = min(nk, q0 + nq) if causal else nk
        _exps(last[:kend], _scaled_max(last[:kend], sc, lowest))
        _normalize(last[:kend], tiny)
        for j in range(kend, nk):
            last[j] = 0.0


@jit_inline
def _scaled_max(row: Any, sc: Any, lowest: Any) -> Any:
    """row *= sc in place; the max of ``lowest`` and the scaled values."""
    m = lowest
    for j in range(row.shape[0]):
        x = row[j] * sc
        row[j] = x
        m = vmath.maximum(m, x)
    return m


@jit_inline
def _exps(row: Any, m: Any) -> None:
    """row = exp(row - m) in place (row <= m)."""
    for j in range(row.shape[0]):
        row[j] = vmath.exp_shifted(row[j], m)


# Normalizing the rows of P @ v instead of P's (Dv products a row instead of Lk; the rows' inverse sums kept in a
# workspace area after the scores) was built and measured, left out (/tmp/w66/defab.py, defer.diff of the
# sixty-sixth session; AMD Zen 3, two threads, 21 interleaved rounds, two runs): t(here) / t(deferred)
# (1, 12, 512, 64) 0.98 and 1.02x, (8, 12, 128, 32) 0.99 and 1.00x. A row pass with neither the sum nor the
# normalization (wrong results: the most any change to them could gain) ran 1.035x and 1.055x (nonorm.py).
@jit_inline
def _normalize(row: Any, tiny: float) -> None:
    """row /= its float64 sum (reassociated in ``vmath.fsum``, never in the exps); a sum of 0 (every exp
    underflowed) gives 0s: 0 * (1 / tiny)."""
    inv = row.dtype.type(1.0 / max(vmath.fsum(row), tiny))
    for j in range(row.shape[0]):
        row[j] = row[j] * inv


Product = Callable[[Any, Any, Any], None]


def _blas_product(a: Any, b: Any, out: Any) -> None:
    np.matmul(a, b, out=out)


# Measured and left out (/tmp/w65/full*.py, opab.py of the sixty-fifth session, AMD Zen 3): k^T and v packed
# panel-major for the 8-lane kernel (16-column panels of k x 16 floats, so that no b row 2 KiB from the next shares
# its L1 set). One thread, a part's 6 heads of (512, 64): 1.16-1.21x as fast on numpy's buffers (4 KiB pages), but
# 1.03x on huge pages, which the pool's workspace has; through the op 0.97-1.05x on two threads (four runs), 1.02-1.05x
# on one. On huge pages the heads' GEMMs already ran at 84-91 GFLOP/s a core (peak ~101).
def _products(dtype: Any) -> Callable[[Any, Any, Any], Product]:
    """``pick(a, b, out)``: the function that computes ``out = a @ b`` for these 4-D stacks of heads, chosen once
    when a launch binds its views: the register-blocked float32 kernel where its rules hold, else
    ``_blas_product`` (np.matmul). With AVX-512, ``gemm.gemm_f32_heads`` (12-17% faster than OpenBLAS per head
    from 128 x 128 x 64 on, equal at 128 x 128 x 32); with AVX2 and FMA only, ``gemm.gemm_f32_heads_ymm`` (8-lane
    panels, from 8 columns; one thread, per head: 18-19 against OpenBLAS's 22-23 us at 128 x 32 x 128 and 128 x
    128 x 32, /tmp/w17/g8.py of the seventeenth session)."""
    if np.dtype(dtype) != np.float32 or not gemm.blocked_available():
        return lambda a, b, out: _blas_product
    strided = any_layout(np.float32, 4)  # compiled once: it takes every layout
    if _heads_on_zmm(dtype):
        kernel, fits = gemm.gemm_f32_heads, gemm.columns_fit
    else:
        kernel, fits = gemm.gemm_f32_heads_ymm, lambda n: n >= gemm.YMM
    heads: Product = entry(kernel, strided, strided, strided)

    def pick(a: Any, b: Any, out: Any) -> Product:
        by_kernel = b.strides[-1] == 4 and out.strides[-1] == 4 and fits(out.shape[-1]) and a.shape[-1] > 0
        return heads if by_kernel else _blas_product

    return pick


def _finfo(dtype: Any) -> tuple[float, float]:
    fi = np.finfo(dtype)
    return float(-fi.max), float(fi.tiny)


def mask_arg(mask: Any, kind: str, dtype: Any) -> tuple[Any, int]:
    """The mask as the kernels take it and its kind code: a (1, 1, 1, 1) zeros stand-in (never read) for "none"."""
    if kind == "none":
        return np.zeros((1, 1, 1, 1), dtype), NONE
    return mask, (BOOL if kind == "bool" else ADDITIVE)


def _cuts(shape: tuple[int, int, int, int], parts: int) -> tuple[int, list[tuple[int, int]]]:
    """How a (batch, heads, queries, keys) tile is cut for helper threads: along batch entries when there are
    enough, else heads, else query rows; (axis, ranges)."""
    for axis in range(3):
        if shape[axis] >= parts:
            return axis, split_range(shape[axis], parts)
    return 2, split_range(shape[2], parts)


def _cut(a: Any, axis: int, lo: int, hi: int) -> Any:
    return None if a is None else a[(slice(None),) * axis + (slice(lo, hi),)]


def _head_chunks(shape: tuple[int, ...], item: int, axis: int) -> list[tuple[int, int, int, int]]:
    """A part's (batch, head) blocks in the order it runs them, as (first batch entry, end, first head, end): all
    at once when its scores (``shape``) fit ``HEAD_CHUNK_BYTES`` or it is a part of query rows (``axis`` 2), else
    chunks of one batch entry's heads whose scores fit (at least one head), so that each chunk's scores are
    made, normalized and multiplied by v while they are in the core's L2."""
    pb, ph, sq, nk = shape
    per_head = sq * nk * item
    if axis == 2 or pb * ph * per_head <= HEAD_CHUNK_BYTES:
        return [(0, pb, 0, ph)]
    c = max(1, HEAD_CHUNK_BYTES // max(per_head, 1))
    return [(b, b + 1, h, min(ph, h + c)) for b in range(pb) for h in range(0, ph, c)]


def _heads(a: Any, cut: tuple[int, int, int, int]) -> Any:
    """``a[b0:b1, h0:h1]`` of a 4-D view, ``cut`` = (b0, b1, h0, h1)."""
    return a[cut[0] : cut[1], cut[2] : cut[3]]


def _part(axis: int, lo: int, hi: int, views: tuple[Any, ...]) -> tuple[Any, ...]:
    """One part's views of a tile, ``[lo:hi]`` along ``axis``: (q, k^T, v, out, scores, packed q, packed out);
    None stays None, and a query-row part (axis 2) shares the keys and values whole."""
    q, kt, v, *rest = views
    shared = axis == 2
    return (
        _cut(q, axis, lo, hi),
        kt if shared else _cut(kt, axis, lo, hi),
        v if shared else _cut(v, axis, lo, hi),
        *(_cut(a, axis, lo, hi) for a in rest),
    )


def build_rows(q: Any, k: Any, v: Any, out: Any, mask: Any, kind: str, causal: bool, scale: float, t: Any) -> Launch:
    """Tiles of ``t.block_b`` batch entries x ``t.block_h`` heads x ``t.block_q`` queries, every key (only the
    keys a causal tile can see, or a padded tile's kept ones): k^T (and v when packed) copied into the workspace,
    then per part of the tile (its batch entries, heads or query rows cut for helper threads from ``FANOUT_MIN``
    score elements) q packed when needed, S there, the fused row pass, out = P @ v (through the workspace when
    out is packed)."""
    nb, nh, nq, d = q.shape
    nk, dv = k.shape[2], v.shape[3]
    dt = q.dtype
    if nk == 0:
        return lambda _: out.fill(0)
    lowest, tiny = _finfo(dt)
    marr, mkind = mask_arg(mask, kind, dt)
    # a key-padding mask: each launch reads which keys a tile's rows keep, and the tile runs only those (its row
    # pass then compiled for masks of any layout, since the tile's mask is cut to them)
    padding = is_key_padding(marr, mkind, nq)
    kt = k.swapaxes(-1, -2)
    tb, th, tq = t.block_b, t.block_h, t.block_q
    o_s, o_k, o_q, o_v, o_o = t.offsets
    item = dt.itemsize
    parts = fanout_parts()
    strided = any_layout(dt, 4)  # the row pass is compiled for any score layout ('A')
    pick = _products(dt)
    block_rows = causal_block(dt)
    steps = []
    for b0 in range(0, nb, tb):
        for h0 in range(0, nh, th):
            for q0 in range(0, nq, tq):
                sb, sh, sq = min(tb, nb - b0), min(th, nh - h0), min(tq, nq - q0)
                kend = min(nk, q0 + sq) if causal else nk
                idx = (slice(b0, b0 + sb), slice(h0, h0 + sh))
                qi = (*idx, slice(q0, q0 + sq))
                mv = marr[(*qi, slice(0, kend))] if mkind != NONE else marr
                kk = min(nk, nq) if causal else nk  # the keys the group's last tile sees
                shape = (sb, sh, sq, kend)
                axis, ranges = _cuts(shape, parts) if sb * sh * sq * kend >= FANOUT_MIN else (0, [(0, sb)])
                # per part, fixed in phase 1: its mask view and its row pass, compiled for that mask's type (a
                # part's scores are not C-contiguous when a dim before the cut axis is > 1: the pass takes each
                # head's dense block as a matrix of its own),
                # and its first query and query blocks
                plans = []
                for lo, hi in ranges:
                    pm = _cut(mv, axis, lo, hi) if mkind != NONE else marr
                    pq0, pnq = (q0 + lo, hi - lo) if axis == 2 else (q0, sq)
                    typed = any_layout(pm.dtype, 4) if padding else pm
                    plans.append(
                        (
                            lo,
                            hi,
                            pm,
                            entry(softmax_rows, strided, typed, 0, False, 0, 0.0, 0.0, 0.0),
                            pq0,
                            _blocks(pnq, pq0, kend, causal, block_rows),
                        )
                    )
                # the group's k^T / v copies: made by the parts when they own whole heads, else before them
                pack_kv = 0 if q0 else (2 if axis != 2 and len(plans) > 1 else 1)
                steps.append(
                    _Tile(
                        shape,
                        (sb, sh, d, kk),
                        q[qi],
                        kt[(*idx, slice(None), slice(0, kk))],
                        v[(*idx, slice(0, kk))],
                        out[qi],
                        pack_kv,
                        axis,
                        plans,
                        _padding_rows(mv[:, :, 0]) if padding and pack_kv else None,
                    )
                )

    def area(ws: Any, off: int, shape: tuple[int, ...]) -> Any:
        n = shape[0] * shape[1] * shape[2] * shape[3]
        return ws[off : off + n * item].view(dt).reshape(shape)

    def products(
        qv: Any, ktp: Any, vt: Any, s: Any, dst: Any, chunk: int, blocks: tuple[tuple[int, int, int], ...]
    ) -> tuple[list[tuple[Any, Any, Any]], ...]:
        """A part's GEMMs as (a, b, out) views: S = q @ k^T in key chunks, per query block; out = P @ v (each
        given its function by ``pick`` when bound)."""
        whole = len(blocks) == 1
        first, second = [], []
        for a, b, kb in blocks:
            qa, sa = (qv, s) if whole else (qv[..., a:b, :], s[..., a:b, :])
            first += [
                (qa, ktp[..., j0 : min(kb, j0 + chunk)], sa[..., j0 : min(kb, j0 + chunk)])
                for j0 in range(0, kb, chunk)
            ]
            if not whole:
                second.append((s[..., a:b, :kb], vt[..., :kb, :], dst[..., a:b, :]))
        return first, [(s, vt, dst)] if whole else second

    def piece(packs: tuple[tuple[Any, Any], ...], steps: list[Step], unpack: tuple[tuple[Any, Any], ...]) -> None:
        """One part of a tile: ``packs``, (workspace, source) copies of its own keys / values (made here so that
        parts pack in parallel and GEMM from a warm cache) and of q when packed; then per chunk of its heads
        (``steps``) the score GEMMs, the row pass (compiled for its mask) and the output GEMMs; ``unpack``: the
        output copied out of the workspace."""
        for dst, src in packs:
            np.copyto(dst, src)
        for first, rows, second in steps:
            for f, a, b, o in first:
                f(a, b, o)
            rows()
            for f, a, b, o in second:
                f(a, b, o)
        for dst, src in unpack:
            np.copyto(dst, src)

    Bound = tuple[list[tuple[Any, Any]], list[Callable[[], None]], bool]
    Step = tuple[list[tuple[Product, Any, Any, Any]], Callable[[], None], list[tuple[Product, Any, Any, Any]]]

    def bind_tile(ws: Any, step: _Tile, keys: int, kind: int) -> Bound:
        """One tile on the workspace ``ws``, running its first ``keys`` keys (its ``kend``: all of them) with a
        mask of ``kind`` (NONE: the rows keep exactly those keys): the k^T / v copies made before its parts, its
        parts, and whether they call BLAS. Every area is laid out
        from the tile's own shape, so a later query tile of a group finds the keys its first tile packed (a
        padded group's tiles all run the same keys: the mask row is the same for every query)."""
        shape, kshape, qv, ktv, vv, ov, pack_kv, axis, plans, _ = step
        sb, sh, sq, kend = shape
        if keys < kend:
            shape, kshape = (sb, sh, sq, keys), (sb, sh, d, keys)
            ktv, vv = ktv[..., :keys], vv[..., :keys, :]
            plans = [
                (lo, hi, pm[..., :keys], rows, pq0, tuple((a, b, min(kb, keys)) for a, b, kb in blocks))
                for lo, hi, pm, rows, pq0, blocks in plans
            ]
            kend = keys
        ktp = area(ws, o_k, kshape) if o_k >= 0 else ktv
        vp = area(ws, o_v, (sb, sh, kshape[3], dv)) if o_v >= 0 else None
        packs: list[tuple[Any, Any]] = []  # k^T / v for the whole head group (causal: the keys its last
        before: list[tuple[Any, Any]] = []  # tile sees); 1: copied before the parts, 2: each part its heads
        if pack_kv:
            packs = [(dst, src) for dst, src, off in ((ktp, ktv, o_k), (vp, vv, o_v)) if off >= 0]
            if pack_kv == 1:
                before, packs = packs, []
        s = area(ws, o_s, shape)
        qp = area(ws, o_q, (sb, sh, sq, d)) if o_q >= 0 else None
        op = area(ws, o_o, (sb, sh, sq, dv)) if o_o >= 0 else None
        views = (qv, ktp[..., :kend], (vv if vp is None else vp)[..., :kend, :], ov, s, qp, op)
        # one part: its score GEMM in key chunks (a wide-N, small-K GEMM threads badly in OpenBLAS); several:
        # each part's GEMMs on one BLAS thread, all keys at once
        chunk = QK_CHUNK if len(plans) == 1 else kend
        calls: list[Callable[[], None]] = []
        blas = False
        for lo, hi, pm, rows, pq0, blocks in plans:
            pq, pk, pv, po, ps, pqp, pop = _part(axis, lo, hi, views)
            own = tuple((_cut(dst, axis, lo, hi), _cut(src, axis, lo, hi)) for dst, src in packs)
            if pqp is not None:
                own, pq = (*own, (pqp, pq)), pqp
            steps: list[Step] = []
            for cut in _head_chunks(ps.shape, item, axis):
                cq, ck, cv, cs, cd = (_heads(x, cut) for x in (pq, pk, pv, ps, po if pop is None else pop))
                first, second = ([(pick(*g), *g) for g in gs] for gs in products(cq, ck, cv, cs, cd, chunk, blocks))
                blas = blas or any(g[0] is _blas_product for g in first + second)
                cm = pm if kind == NONE else _heads(pm, cut)
                steps.append((first, functools.partial(rows, cs, cm, kind, causal, pq0, scale, lowest, tiny), second))
            calls.append(functools.partial(piece, own, steps, () if pop is None else ((po, pop),)))
        return before, calls, blas

    def tiles(ws: Any, bound: list[Bound], padded: dict[tuple[int, int, bool], Bound]) -> None:
        """Each tile in turn; a padded tile that runs fewer keys than it has, or whose rows all keep the same
        ones (run without the mask), runs a variant bound to them (made at its first use on this workspace,
        then kept in ``padded``)."""
        keys, exact = nk, False
        for i, (step, tile) in enumerate(zip(steps, bound)):
            if step.rows is not None:  # a padded head group's first tile: the group's query tiles run these keys
                keys, exact = _padded_keys(step.rows, mkind, step.shape[3])
            if keys < step.shape[3] or exact:
                key = (i, keys, exact)
                tile = padded.get(key) or padded.setdefault(key, bind_tile(ws, step, keys, NONE if exact else mkind))
            before, calls, blas = tile
            for dst, src in before:
                np.copyto(dst, src)
            if blas:
                run_blas_parts(calls)  # each part's GEMMs on one BLAS thread
            else:
                run_parts(calls)

    def bind(ws: Any) -> Callable[[], None]:
        return functools.partial(tiles, ws, [bind_tile(ws, step, step.shape[3], mkind) for step in steps], {})

    # bound again only when the workspace changes: binding costs ~60-90 us of Python
    return workspace_launcher(bind)


# ---- online softmax over key tiles (the workspace holds one bq x bk tile)
@jit
def mask_bool(s: Any, keep: Any) -> None:
    """s[b, h, i, j] = -inf where not keep[b, h, i, j] (``keep`` broadcast to ``s``'s shape)."""
    nb, nh, nq, nk = s.shape
    for b in range(nb):
        for h in range(nh):
            for i in range(nq):
                for j in range(nk):
                    if not keep[b, h, i, j]:
                        s[b, h, i, j] = -np.inf


@jit
def mask_causal(s: Any, q0: int, k0: int) -> None:
    """s[..., i, j] = -inf where key k0 + j comes after query q0 + i (top-left aligned, as PyTorch)."""
    nb, nh, nq, nk = s.shape
    for b in range(nb):
        for h in range(nh):
            for i in range(nq):
                for j in range(max(q0 + i + 1 - k0, 0), nk):
                    s[b, h, i, j] = -np.inf


class _Masker:
    """Applies scale and the mask to a score block (4-D, C-contiguous) whose rows / cols start at q0 / k0."""

    def __init__(self, dtype: Any, scale: float, mask: Any, kind: str, causal: bool) -> None:
        self.scale, self.mask, self.kind, self.causal = scale, mask, kind, causal
        sample = np.empty((1, 1, 1, 1), dtype)
        self.k_causal: Any = entry(mask_causal, sample, 0, 0) if causal else None
        # typed for any layout: a tile's mask is a view, C-contiguous or not whatever the whole mask is
        self.k_bool: Any = entry(mask_bool, sample, any_layout(np.bool_, 4)) if kind == "bool" else None

    def __call__(self, s: Any, b: Any, h: Any, q0: int, nq: int, k0: int, nk: int) -> None:
        np.multiply(s, self.scale, out=s)
        if self.kind == "additive":
            np.add(s, self.mask[b, h, q0 : q0 + nq, k0 : k0 + nk], out=s)
        elif self.kind == "bool":
            self.k_bool(s, self.mask[b, h, q0 : q0 + nq, k0 : k0 + nk])
        if self.causal and k0 + nk - 1 > q0:
            self.k_causal(s, q0, k0)


def build_online(q: Any, k: Any, v: Any, out: Any, mask: Any, kind: str, causal: bool, scale: float, t: Any) -> Launch:
    """Per (batch, head, query tile): scores of one key tile at a time, running max / sum (online softmax),
    the output tile accumulating in place."""
    nb, nh, nq, _ = q.shape
    nk, dv = k.shape[2], v.shape[3]
    dt = q.dtype
    bq, bk = t.block_q, t.block_k
    masker = _Masker(dt, scale, mask, kind, causal)
    lowest, tiny = _finfo(dt)
    item = dt.itemsize
    offs = t.offsets  # scores, pv, m, m_new, alpha, l, rowsum
    online = t.online
    if nk == 0:
        return lambda _: out.fill(0)

    def vec(ws: Any, i: int, n: int) -> Any:
        return ws[offs[i] : offs[i] + n * item].view(dt)

    mkind = mask_arg(mask, kind, dt)[1]
    padding = is_key_padding(mask, mkind, nq)  # as build_rows: the keys kept, per head (per batch entry when
    per_head = padding and mask.strides[1] != 0  # every head shares its row)

    def launch(ws: Any) -> None:
        for b in range(nb):
            keys = _padded_keys(mask[b, 0, 0], mkind, nk)[0] if padding else nk
            for h in range(nh):
                if per_head:
                    keys = _padded_keys(mask[b, h, 0], mkind, nk)[0]
                for q0 in range(0, nq, bq):
                    n_q = min(bq, nq - q0)
                    kend = min(keys, q0 + n_q) if causal else keys
                    qt, ot = q[b, h, q0 : q0 + n_q], out[b, h, q0 : q0 + n_q]
                    m, msum = vec(ws, 2, n_q), vec(ws, 5, n_q)
                    m.fill(-np.inf)
                    msum.fill(0)
                    ot.fill(0)
                    for k0 in range(0, kend, bk):
                        n_k = min(bk, kend - k0)
                        s = ws[: n_q * n_k * item].view(dt).reshape(1, 1, n_q, n_k)
                        np.matmul(qt, k[b, h, k0 : k0 + n_k].T, out=s[0, 0])
                        masker(s, slice(b, b + 1), slice(h, h + 1), q0, n_q, k0, n_k)
                        s2 = s[0, 0]
                        m_new, alpha, rs = vec(ws, 3, n_q), vec(ws, 4, n_q), vec(ws, 6, n_q)
                        if not online:  # the keys fit one tile: plain softmax, P @ V straight into out
                            np.max(s2, axis=1, out=m)
                            np.maximum(m, lowest, out=m)
                            np.subtract(s2, m[:, None], out=s2)
                            np.exp(s2, out=s2)
                            np.sum(s2, axis=1, out=msum)
                            np.matmul(s2, v[b, h, k0 : k0 + n_k], out=ot)
                            continue
                        np.max(s2, axis=1, out=m_new)
                        np.maximum(m_new, m, out=m_new)
                        np.maximum(m_new, lowest, out=m_new)
                        np.subtract(m, m_new, out=alpha)
                        np.exp(alpha, out=alpha)
                        np.subtract(s2, m_new[:, None], out=s2)
                        np.exp(s2, out=s2)
                        np.sum(s2, axis=1, out=rs)
                        np.multiply(msum, alpha, out=msum)
                        np.add(msum, rs, out=msum)
                        pv = ws[offs[1] : offs[1] + n_q * dv * item].view(dt).reshape(n_q, dv)
                        np.matmul(s2, v[b, h, k0 : k0 + n_k], out=pv)
                        np.multiply(ot, alpha[:, None], out=ot)
                        np.add(ot, pv, out=ot)
                        np.copyto(m, m_new)
                    np.maximum(msum, tiny, out=msum)
                    np.divide(ot, msum[:, None], out=ot)

    return launch
