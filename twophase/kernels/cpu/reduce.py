"""Tree reductions over a (kept K, reduced R) matrix: each level combines blocks of ``block`` into partials.

Two loop orders compute the same partials (same levels, same workspace):

- ``rows``: the reduced elements of a row are contiguous (or strided): a task reduces one block of one row with a
  vectorized span loop (several accumulators: ``reassoc`` sums in float64, ``llvm.maximum`` / ``smax`` for max).
- ``cols``: the *kept* dim is the contiguous one (a reduction over an outer dim): the matrix is walked as (R, K)
  rows, and a task adds a block of rows into a vector of K-chunk accumulators (cache-friendly, vectorized over K).
  Its partials are stored transposed, (n, K), which is again a ``cols`` input for the next level.

Argmax partials are (value, index) pairs; var partials are (count, mean, M2) triples merged with Chan et al.'s
pairwise formula.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba
import numpy as np

from ...runtime.fanout import fanout_parts, run_parts, split_range
from .half import cast_copy
from .jit import REDUCE, by_density, entry, row_of, rows_dense, rows_only, span_of, wide_vectors
from .jit import jit_reduce as _jit_reduce
from .span_ir import bulk_column_extrema, bulk_column_sums, bulk_extremum, bulk_first, span_moments, span_sum
from .vmath import corrected_moments, deviation_sums
from .vmath import maximum as vmax
from .vmath import minimum as vmin

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def _typed(deco: Any) -> Callable[[_Fn], _Fn]:
    """A numba decorator typed as keeping the function's signature (mypy --strict)."""
    return cast(Callable[[_Fn], _Fn], deco)


jit_reduce = _typed(_jit_reduce)
# helpers inlined into each level kernel (a call per row costs more than a short row's work)
jit_inline = _typed(numba.njit(nogil=True, cache=True, error_model="numpy", fastmath=REDUCE, inline="always"))

# spans from which argmax finds its max's first position by a search that stops at the hit (span_ir.bulk_first):
# on shorter ones the branch that ends it mispredicts more than the whole span costs to scan without branches
# (262144 rows of 64 floats: 1.5x slower searched, one thread, /tmp/w25/ab.py)
FIRST_SEARCH_MIN = 256
KC = 4096  # kept columns per task of a ``cols`` level (16 KiB of float32 rows: the prefetcher runs across pages)


# ---------------------------------------------------------------- spans (1-D)
# Spans take a whole row ``v`` (``x[k]`` keeps a C-contiguous matrix's layout; a slice would type as 'A', whose
# unknown stride blocks vectorization) and the bounds [lo, hi). Indices are unsigned: a signed index gets numba's
# negative-index wrap-around select, which turns the vector loads into gathers (6x slower).
@jit_inline
def _max_span(v: Any, lo: int, hi: int, sign: Any) -> Any:
    """max (sign > 0) or min (sign < 0) of a non-empty span; NaN wins."""
    m, done = bulk_extremum(v, lo, hi - lo, sign, v[lo])
    base = np.uint64(lo + done)
    if sign > 0:
        for i in range(np.uint64(hi - lo - done)):
            m = vmax(m, v[base + i])
    else:
        for i in range(np.uint64(hi - lo - done)):
            m = vmin(m, v[base + i])
    return m


@jit_inline
def _argmax_span(v: Any, lo: int, hi: int) -> tuple[Any, Any]:
    """(max, index of its first occurrence) of a non-empty span; the first NaN wins (numpy's argmax)."""
    m = _max_span(v, lo, hi, 1)
    found, done = bulk_first(v, lo, hi - lo, m) if hi - lo >= FIRST_SEARCH_MIN else (0, 0)
    if found < done:
        return m, np.int64(lo + found)
    base = np.uint64(lo)
    nan = m != m
    n = np.int32(hi - lo)  # a span is at most one block (ops.reduce.BLOCK): int32 offsets, twice int64's lanes
    first = n  # a min-reduction of the matching offsets: vectorizes (a search with an early exit does not)
    for i in range(np.uint64(done), np.uint64(n)):
        e = v[base + i]
        hit = (e != e) if nan else (e == m)
        first = vmin(first, np.int32(i) if hit else n)
    return m, np.int64(lo) + np.int64(first)


@jit_inline
def _moments_span(v: Any, lo: int, hi: int) -> tuple[float, float, float]:
    """(count, mean, M2) of a span. float32 (and narrower) data: one pass of float64 sums of y = x - x[lo] and y^2,
    M2 = q - s^2 / n (shifted by a sample, the sums cancel by ~(mean(y) / std)^2 only, not (mean / std)^2; no pass
    waits for the mean); float64 data: two passes, the second corrected (``vmath.corrected_moments``; the span is
    one block: it stays in cache)."""
    n = hi - lo
    if v.itemsize <= 4:
        shift = np.float64(v[lo]) if n > 0 else 0.0
        s, q = span_moments(v, lo, n, shift)
        d = s / n if n > 0 else 0.0
        return float(n), shift + d, max(q - s * d, 0.0)
    s = span_sum(v, lo, n, 0.0)
    mean = s / n if n > 0 else 0.0
    c, q = deviation_sums(v[lo:hi], mean)
    mean, m2 = corrected_moments(n, mean, c, q)
    return float(n), mean, m2


# Row k of x as a span's ``v``: typed dense when ``dense`` (``jit.row_of``, a closure constant of each level kernel:
# ``jit.by_density``); a C-contiguous matrix's rows are dense, and so are the rows of a wider array's slice, whose
# loops ran 8-16x slower typed strided.
@jit_inline
def _sum_row(x: Any, k: int, lo: int, hi: int, zero: Any, dense: bool) -> Any:
    return span_sum(row_of(x, k, dense), lo, hi - lo, zero)


@jit_inline
def _max_row(x: Any, k: int, lo: int, hi: int, sign: Any, dense: bool) -> Any:
    return _max_span(row_of(x, k, dense), lo, hi, sign)


@jit_inline
def _argmax_row(x: Any, k: int, lo: int, hi: int, dense: bool) -> tuple[Any, Any]:
    return _argmax_span(row_of(x, k, dense), lo, hi)


@jit_inline
def _moments_row(x: Any, k: int, lo: int, hi: int, dense: bool) -> tuple[float, float, float]:
    return _moments_span(row_of(x, k, dense), lo, hi)


@jit_inline
def _chan(na: float, ma: float, qa: float, nb: float, mb: float, qb: float) -> tuple[float, float, float]:
    """Merge two (count, mean, M2) partials (Chan, Golub and LeVeque). An empty side returns the other as it is:
    its d^2 term (times a count of 0) was NaN where d^2 overflows, on float64 means beyond ~1e154."""
    if na == 0.0:
        return nb, mb, qb
    if nb == 0.0:
        return na, ma, qa
    n = na + nb
    d = mb - ma
    return n, ma + d * (nb / n), qa + qb + d * d * (na * nb / n)


# ---------------------------------------------------------------- rows levels: x (K, n) -> out (K, nb)
@jit_inline
def _next(k: int, j: int, nb: int) -> tuple[int, int]:
    """The task after (row k, block j): tasks walk (k, j) without a division each (a short row's task is a few
    ns of work; an int64 division is ~10)."""
    j += 1
    return (k + 1, 0) if j == nb else (k, j)


def _level_kernel(kind: str, dense: bool) -> Any:
    total = kind == "sum"  # a closure constant: the other branch folds away

    @rows_only("x")
    @jit_reduce
    def level(x: Any, block: int, scalar: Any, out: Any, t0: int, t1: int) -> None:
        """out[k, j] = the sum (``scalar``: the zero of the accumulator's type) or the max (``scalar`` 1) / min
        (-1) of x[k, j*block:(j+1)*block], for the tasks ``t0 <= t = k * nb + j < t1`` (a range of them per
        helper thread; all of them on one)."""
        wide_vectors()
        nb = out.shape[1]
        k, j = t0 // nb, t0 % nb
        for _ in range(t0, t1):
            lo, hi = j * block, min(x.shape[1], (j + 1) * block)
            if total:
                out[k, j] = _sum_row(x, k, lo, hi, scalar, dense)
            else:
                out[k, j] = _max_row(x, k, lo, hi, scalar, dense)
            k, j = _next(k, j, nb)

    return level


# ---------------------------------------------------------------- cols levels: x (n, K) -> out (nb, K)
@jit_inline
def _whole_rows_packed(x: Any, w: int) -> bool:
    """Whether a task's chunk of ``w`` columns is x's whole rows and they lie back to back (x's memory is then one
    span, which ``span_ir``'s column intrinsics walk a row at a time)."""
    return bool(w == x.shape[1] and x.strides[0] == x.shape[1] * x.itemsize)


@jit_inline
def _sum_cols_task(x: Any, block: int, zero: Any, out: Any, kc: int, t: int, dense: bool) -> None:
    n, kk = x.shape
    nk = (kk + kc - 1) // kc
    j = t // nk
    c0 = (t - j * nk) * kc
    w = min(kk, c0 + kc) - c0
    acc = np.full(w, zero)
    u0 = np.uint64(c0)  # unsigned indices: no negative-index wrap-around select in the inner loop
    r, end = j * block, min(n, (j + 1) * block)
    if dense and _whole_rows_packed(x, w):  # narrow rows back to back: accumulators in registers
        if bulk_column_sums(span_of(x, 0, n * kk), r * kk, end - r, kk, acc):
            r = end
    while r + 4 <= end:  # four rows per pass over acc: a quarter of the accumulator traffic
        r0, r1, r2, r3 = row_of(x, r, dense), row_of(x, r + 1, dense), row_of(x, r + 2, dense), row_of(x, r + 3, dense)
        for c in range(np.uint64(w)):
            k = u0 + c
            acc[c] += (zero + r0[k] + r1[k]) + (zero + r2[k] + r3[k])
        r += 4
    for rr in range(r, end):
        row = row_of(x, rr, dense)
        for c in range(np.uint64(w)):
            acc[c] += row[u0 + c]
    dst = out[j]
    for c in range(w):
        dst[c0 + c] = acc[c]


def _sum_cols_kernel(dense: bool) -> Any:
    @rows_only("x")
    @jit_reduce
    def sum_cols(x: Any, block: int, zero: Any, out: Any, kc: int, t0: int, t1: int) -> None:
        """out[j, :] = sum of rows x[j*block:(j+1)*block, :] (vectorized along the contiguous kept dim), tasks
        t0 <= t = j * nk + chunk < t1 (nk chunks of ``kc`` kept columns); rows typed dense when ``dense``."""
        for t in range(t0, t1):
            _sum_cols_task(x, block, zero, out, kc, t, dense)

    return sum_cols


@jit_inline
def _max_cols_task(x: Any, block: int, sign: Any, out: Any, kc: int, t: int, dense: bool) -> None:
    n, kk = x.shape
    nk = (kk + kc - 1) // kc
    j = t // nk
    c0 = (t - j * nk) * kc
    w = min(kk, c0 + kc) - c0
    acc = row_of(x, j * block, dense)[c0 : c0 + w].copy()  # (x[j * block, ...] would copy by x's layout type)
    u0 = np.uint64(c0)
    last = min(n, (j + 1) * block) - 1
    if dense and _whole_rows_packed(x, w):  # narrow rows back to back: accumulators in registers
        if bulk_column_extrema(span_of(x, 0, n * kk), (j * block + 1) * kk, last - j * block, kk, sign, acc):
            last = j * block  # nothing left for the loop
    for r in range(j * block + 1, last + 1, 4):  # four rows per pass over acc, as in sums; the last pass repeats
        r0, r1 = row_of(x, r, dense), row_of(x, min(r + 1, last), dense)  # the last rows again: max is idempotent
        r2, r3 = row_of(x, min(r + 2, last), dense), row_of(x, min(r + 3, last), dense)
        if sign > 0:
            for c in range(np.uint64(w)):
                k = u0 + c
                acc[c] = vmax(acc[c], vmax(vmax(r0[k], r1[k]), vmax(r2[k], r3[k])))
        else:
            for c in range(np.uint64(w)):
                k = u0 + c
                acc[c] = vmin(acc[c], vmin(vmin(r0[k], r1[k]), vmin(r2[k], r3[k])))
    dst = out[j]
    for c in range(w):
        dst[c0 + c] = acc[c]


def _max_cols_kernel(dense: bool) -> Any:
    @rows_only("x")
    @jit_reduce
    def max_cols(x: Any, block: int, sign: Any, out: Any, kc: int, t0: int, t1: int) -> None:
        for t in range(t0, t1):
            _max_cols_task(x, block, sign, out, kc, t, dense)

    return max_cols


# level kernels by kind, each by density (``jit.by_density``: phase 1 picks with ``jit.rows_dense``); the
# ``cols`` twins run a reduction over a leading dim on the transposed views
LEVELS = {kind: by_density(functools.partial(_level_kernel, kind)) for kind in ("sum", "max")}
COLS = {"sum": by_density(_sum_cols_kernel), "max": by_density(_max_cols_kernel)}
LEVEL_PARALLEL_MIN = 1 << 18  # elements read by a level below which it runs on one thread (handing parts to
# helper threads costs ~50 us: more than a small level's work)


def level_fans(tiling: Any, counts: tuple[int, ...]) -> list[int]:
    """Parts of each level reading ``counts[i]`` elements per row: the helper threads' count where the tiling
    is parallel and the level reads at least LEVEL_PARALLEL_MIN elements, else 1."""
    parts = fanout_parts() if tiling.parallel else 1
    return [parts if tiling.kept * n >= LEVEL_PARALLEL_MIN else 1 for n in counts]


def level_tasks(out: Any, cols: bool, kc: int = KC) -> int:
    """Tasks of a level writing ``out``: (row, block) pairs, or for ``cols`` (block, chunk of ``kc`` kept
    columns)."""
    return int(out.shape[0] * (-(-out.shape[1] // kc) if cols else out.shape[1]))


def cols_chunk(kept: int, parts: int) -> int:
    """Kept columns per ``cols`` task: KC, or fewer (a multiple of 64) when KC would leave helper threads without
    a chunk (a 4096 x 4096 reduction over dim 0 is one block of rows: its chunks are its only tasks)."""
    if kept >= parts * KC:
        return KC
    return max(64, -(-kept // (parts * 64)) * 64)


def run_level(fn: Any, parts: int, tasks: int, *args: Any) -> None:
    """One level ``fn(*args, t0, t1)`` (its entry, compiled in phase 1): all tasks at once, or ``parts`` ranges
    of them on helper threads (every range a contiguous run of rows, or of blocks when rows are few)."""
    if parts == 1 or tasks < 2:
        fn(*args, 0, tasks)
        return
    run_parts([functools.partial(fn, *args, lo, hi) for lo, hi in split_range(tasks, parts)])


def build_tree(
    src: Any,
    out2d: Any,
    tiling: Any,
    pack_dtype: Any,
    acc: Any,
    kind: str = "sum",
    scalar: Any = None,
    scale: float | None = None,
) -> Callable[[Any], None]:
    """A launch that runs the levels of block reductions from the input to ``out2d`` (K, 1).

    ``src`` is the (K, R) matrix view of the input, or, when ``tiling.pack``, the input with its axes
    permuted (kept, reduced), which the launch first copies densely into the workspace as ``pack_dtype``.
    The workspace also holds each level's partials (``acc`` dtype). The ``kind`` of level kernel combines blocks
    ("sum": ``scalar`` the zero of ``acc``; "max": ``scalar`` +1 max / -1 min); ``tiling.orient == "cols"`` runs
    its ``cols`` twin on the transposed views. ``scale`` (a mean's 1/R) multiplies the results while they are
    still ``acc`` values (in the stage area when there is one), so a mean overflows only where the mean does.
    """
    k_rows, r = tiling.kept, tiling.reduced
    block = tiling.block
    zero = acc.type(0) if scalar is None else scalar
    cols = getattr(tiling, "orient", "rows") == "cols" and not tiling.pack
    kern = (COLS if cols else LEVELS)[kind]
    levels = tiling.levels
    offsets = tiling.offsets
    if r == 0:
        return lambda _: out2d.fill(0 if scale is None else 0.0 * scale)  # the empty sum, scaled
    if k_rows == 0:
        return lambda _: None
    first = src.T if cols else src
    dst_out = out2d.T if cols else out2d

    def shaped(n: int) -> tuple[int, int]:
        return (n, k_rows) if cols else (k_rows, n)

    # compile every level's signature now (phase 1), never in phase 2; the level kernels' x is ``rows_only``, so
    # one specialization serves the data in any layout and the partials
    fans = level_fans(tiling, (r,) + levels)
    extra = (cols_chunk(k_rows, max(fans)),) if cols else ()  # cols kernels take their chunk width
    steps = []
    prev = np.empty((1, 1), pack_dtype) if tiling.pack else first
    for n in levels:
        dst = np.empty(shaped(n), acc)
        steps.append(entry(kern[rows_dense(prev)], prev, block, zero, dst, *extra, 0, 0))
        prev = dst  # partials in the workspace: dense rows
    stage = getattr(tiling, "stage_offset", -1)
    final_out = np.empty(shaped(1), acc) if stage >= 0 else dst_out
    final = entry(kern[rows_dense(prev)], prev, block, zero, final_out, *extra, 0, 0)

    pack, pack_offset, pack_bytes = tiling.pack, tiling.pack_offset, k_rows * r * pack_dtype.itemsize

    def launch(ws: Any) -> None:
        x = first
        if pack:
            area = ws[pack_offset : pack_offset + pack_bytes].view(pack_dtype)
            cast_copy(area.reshape(src.shape), src)
            x = area.reshape(k_rows, r)
        for n, off, step, parts in zip(levels, offsets, steps, fans):
            dst = ws[off : off + k_rows * n * acc.itemsize].view(acc).reshape(shaped(n))
            run_level(step, parts, level_tasks(dst, cols, *extra), x, block, zero, dst, *extra)
            x = dst
        last = fans[-1], level_tasks(final_out, cols, *extra)
        if stage >= 0:
            wide = ws[stage : stage + k_rows * acc.itemsize].view(acc).reshape(shaped(1))
            run_level(final, *last, x, block, zero, wide, *extra)
            if scale is None:
                cast_copy(dst_out, wide)
            else:
                np.multiply(wide, scale, out=dst_out, casting="unsafe")
        else:
            run_level(final, *last, x, block, zero, dst_out, *extra)
            if scale is not None:
                np.multiply(dst_out, scale, out=dst_out)

    return launch


# ---------------------------------------------------------------- argmax: (value, index) partials
@jit_inline
def _argmax_block(x: Any, idx: Any, block: int, out_v: Any, out_i: Any, k: int, j: int, dense: bool) -> None:
    """Block j of row k: the first max and its index (``idx`` None-like when x is the data: positions are indices)."""
    lo = j * block
    m, p = _argmax_row(x, k, lo, min(x.shape[1], lo + block), dense)
    out_v[k, j] = m
    out_i[k, j] = p if idx.shape[1] == 0 else idx[k, p]


def _argmax_level_kernel(dense: bool) -> Any:
    @rows_only("x")
    @jit_reduce
    def argmax_level(x: Any, idx: Any, block: int, out_v: Any, out_i: Any, t0: int, t1: int) -> None:
        """(out_v, out_i)[k, j] = first max of x[k, block j] and its index (positions, or ``idx`` of the
        partials), tasks t0 <= t = k * nb + j < t1."""
        wide_vectors()
        if out_v.shape[1] == 1 and idx.shape[1] == 0:  # one block per row of the data (short rows): the lean loop
            for k in range(t0, t1):
                out_v[k, 0], out_i[k, 0] = _argmax_row(x, k, 0, x.shape[1], dense)
            return
        nb = out_v.shape[1]
        k, j = t0 // nb, t0 % nb
        for _ in range(t0, t1):
            _argmax_block(x, idx, block, out_v, out_i, k, j, dense)
            k, j = _next(k, j, nb)

    return argmax_level


ARGMAX_LEVEL = by_density(_argmax_level_kernel)


def build_argmax(src: Any, out2d: Any, tiling: Any, value_dtype: Any) -> Callable[[Any], None]:
    """Launch of the argmax tree: level partials are (value, int64 index) arrays at ``tiling.part_offsets``;
    the last level writes indices into ``out2d`` (K, 1) int64 (its values go to a scratch made here, in phase 1)."""
    k_rows, r, block = tiling.kept, tiling.reduced, tiling.block
    if k_rows == 0:
        return lambda _: None
    fans = level_fans(tiling, (r,) + tiling.levels)
    no_idx = np.empty((1, 0), np.int64)
    steps = []
    prev_v = np.empty((1, 1), value_dtype) if tiling.pack else src
    prev_i = no_idx
    for n in tiling.levels:
        dv, di = np.empty((1, n), value_dtype), np.empty((1, n), np.int64)
        steps.append(entry(ARGMAX_LEVEL[rows_dense(prev_v)], prev_v, prev_i, block, dv, di, 0, 0))
        prev_v, prev_i = dv, di
    final_v = np.empty((k_rows, 1), value_dtype)  # the maxima themselves are not an output
    final = entry(ARGMAX_LEVEL[rows_dense(prev_v)], prev_v, prev_i, block, final_v, out2d, 0, 0)
    pack, pack_offset, pack_bytes = tiling.pack, tiling.pack_offset, k_rows * r * value_dtype.itemsize
    parts = tiling.part_offsets

    def launch(ws: Any) -> None:
        x, idx = src, no_idx
        if pack:
            area = ws[pack_offset : pack_offset + pack_bytes].view(value_dtype)
            cast_copy(area.reshape(src.shape), src)
            x = area.reshape(k_rows, r)
        for n, (ov, oi), step, p in zip(tiling.levels, parts, steps, fans):
            dv = ws[ov : ov + k_rows * n * value_dtype.itemsize].view(value_dtype).reshape(k_rows, n)
            di = ws[oi : oi + k_rows * n * 8].view(np.int64).reshape(k_rows, n)
            run_level(step, p, level_tasks(dv, False), x, idx, block, dv, di)
            x, idx = dv, di
        run_level(final, fans[-1], k_rows, x, idx, block, final_v, out2d)

    return launch


# ---------------------------------------------------------------- var: (count, mean, M2) partials
def _moments_level_kernel(dense: bool) -> Any:
    @rows_only("x")
    @jit_reduce
    def moments_level(x: Any, block: int, out: Any, t0: int, t1: int) -> None:
        """out[k, j] = (count, mean, M2) of the data block x[k, j*block:(j+1)*block], tasks t0 <= t < t1."""
        nb = out.shape[1]
        k, j = t0 // nb, t0 % nb
        for _ in range(t0, t1):
            lo, hi = j * block, min(x.shape[1], (j + 1) * block)
            out[k, j, 0], out[k, j, 1], out[k, j, 2] = _moments_row(x, k, lo, hi, dense)
            k, j = _next(k, j, nb)

    return moments_level


@jit_reduce
def merge_level(p: Any, block: int, out: Any, t0: int, t1: int) -> None:
    """out[k, j] = the Chan merge of the (count, mean, M2) partials p[k, j*block:(j+1)*block], tasks
    t0 <= t < t1."""
    nb = out.shape[1]
    k, j = t0 // nb, t0 % nb
    for _ in range(t0, t1):
        n, mean, m2 = 0.0, 0.0, 0.0
        for i in range(j * block, min(p.shape[1], (j + 1) * block)):
            n, mean, m2 = _chan(n, mean, m2, p[k, i, 0], p[k, i, 1], p[k, i, 2])
        out[k, j, 0], out[k, j, 1], out[k, j, 2] = n, mean, m2
        k, j = _next(k, j, nb)


@jit_reduce
def var_final(p: Any, correction: float, out: Any) -> None:
    """out[k, 0] = M2 / max(count - correction, 0) of each row's single merged partial (numpy's ddof rule)."""
    for k in range(p.shape[0]):
        out[k, 0] = _var_of(p[k, 0, 0], p[k, 0, 2], correction)


@jit_inline
def _var_of(n: float, m2: float, correction: float) -> float:
    """M2 / max(count - correction, 0) (numpy's ddof rule)."""
    d = n - correction
    return m2 / (d if d > 0.0 else 0.0)


def _var_rows_kernel(dense: bool) -> Any:
    @rows_only("x")
    @jit_reduce
    def var_rows(x: Any, correction: float, out: Any, t0: int, t1: int) -> None:
        """out[k, 0] = the variance of row k (one block: no partials), rows t0 <= k < t1."""
        for k in range(t0, t1):
            n, _, m2 = _moments_row(x, k, 0, x.shape[1], dense)
            out[k, 0] = _var_of(n, m2, correction)

    return var_rows


MOMENTS_LEVEL = by_density(_moments_level_kernel)
VAR_ROWS = by_density(_var_rows_kernel)


def build_var(src: Any, out2d: Any, tiling: Any, pack_dtype: Any, correction: float) -> Callable[[Any], None]:
    """Launch of the var tree: every level writes (count, mean, M2) float64 triples, (K, n, 3), to the workspace
    (the last level too, to a final (K, 1, 3) area), then ``var_final`` divides into ``out2d`` (through the stage
    area for float16). Rows of one block (R <= block) go straight to ``out2d`` (``var_rows``)."""
    k_rows, r, block = tiling.kept, tiling.reduced, tiling.block
    if k_rows == 0:
        return lambda _: None
    if r == 0:
        return lambda _: out2d.fill(np.nan)
    x_t = np.empty((1, 1), pack_dtype) if tiling.pack else src
    fans = level_fans(tiling, (r,) + tiling.levels)
    stage = tiling.stage_offset
    wide_t = np.empty((1, 1)) if stage >= 0 else out2d
    pack, pack_offset, pack_bytes = tiling.pack, tiling.pack_offset, k_rows * r * pack_dtype.itemsize
    corr = float(correction)

    def source(ws: Any) -> Any:
        if not pack:
            return src
        area = ws[pack_offset : pack_offset + pack_bytes].view(pack_dtype)
        cast_copy(area.reshape(src.shape), src)
        return area.reshape(k_rows, r)

    def finish(ws: Any, write: Callable[[Any], None]) -> None:
        if stage >= 0:
            wide = ws[stage : stage + k_rows * 8].view(np.float64).reshape(k_rows, 1)
            write(wide)
            cast_copy(out2d, wide)
        else:
            write(out2d)

    if not tiling.levels:
        direct = entry(VAR_ROWS[rows_dense(x_t)], x_t, corr, wide_t, 0, 0)

        def launch_rows(ws: Any) -> None:
            x = source(ws)
            finish(ws, lambda dst: run_level(direct, fans[0], k_rows, x, corr, dst))

        return launch_rows
    counts = tiling.levels + (1,)
    p_t = np.empty((1, 1, 3))
    steps = [entry(MOMENTS_LEVEL[rows_dense(x_t)], x_t, block, p_t, 0, 0)] + [
        entry(merge_level, p_t, block, p_t, 0, 0)
    ] * len(tiling.levels)
    fin = entry(var_final, p_t, corr, wide_t)
    offs = tiling.offsets + (tiling.final_offset,)

    def launch(ws: Any) -> None:
        x = source(ws)
        for n, off, step, parts in zip(counts, offs, steps, fans):
            dst = ws[off : off + k_rows * n * 24].view(np.float64).reshape(k_rows, n, 3)
            run_level(step, parts, k_rows * n, x, block, dst)
            x = dst
        finish(ws, lambda dst: fin(x, corr, dst))

    return launch
