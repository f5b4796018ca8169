"""Softmax and log-softmax over the last axis of a (rows, length) view, on vectorized loops.

A row (or a block of a long row) takes three passes while it sits in cache: its max (``llvm.maximum``,
NaN-propagating, vectorizes as a reduction), ``exp(x - max)`` stored (``vmath.exp_shifted``, no reassociation,
so the range reduction stays exact), and the float64 sum of what was stored (reassociated: vectorized). The max
pass of the next row (or block) runs inside this one's exp loop: its memory traffic then overlaps the exps'
arithmetic instead of leaving the core idle. A last pass writes the result: ``out = exps * (1/sum)`` (softmax) or
``out = (x - max) - log(sum)`` (log-softmax). Rows of up to ``PIPELINED_MAX`` elements keep their exps in scratch
rows, in L1; longer ones store them into out (log-softmax in place: into a scratch row). Long rows are split in
blocks (of 8 KiB, small enough that the next block, read for its max, is still in L1 for its exps; softmax in
place goes by steps of ``IN_PLACE_STEP`` elements, ``_partials``) whose float64 ``(max, sum)`` partials live in
the workspace and are merged per row: ``M = max_b m_b``, ``S = sum_b s_b * exp(m_b - M)``; block b is then
scaled by ``exp(m_b - M) / S`` (softmax) or rewritten as ``(x - M) - log S`` (log-softmax).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import InternalError, Status
from ...layout import align, line_array
from ...runtime.fanout import launcher, run_parts, split_range
from . import jit as _jit
from . import vmath as vm
from .half import cast_copy
from .jit import by_density, entry, row_of, rows_dense, rows_only, wide_vectors

SOFTMAX, LOG_SOFTMAX = 0, 1
LOG_SOFTMAX_IN_OUT = 2  # log-softmax whose out does not overlap x: its exps go to out, as softmax's do
Kernel = Callable[[Callable[..., Any]], Any]
jit: Kernel = _jit.jit  # the numba decorators, typed (jit.py leaves them untyped)
# per-row helpers, inlined into each kernel (a call per row costs more than a short row's work)
jit_inline: Kernel = _jit.jit_inline


@jit_inline
def _max(x: Any) -> float:
    """max of a non-empty 1-d view, NaN if any is NaN; in x's dtype, widened at the end."""
    m = x[0]
    for i in range(1, x.shape[0]):
        m = vm.maximum(m, x[i])
    return float(m)


@jit_inline
def _scaled(src: Any, out: Any, c: float) -> None:
    """out = src * c in out's precision (float32 data: one float32 multiply per element, no widening); src may be
    out itself."""
    cc = out.dtype.type(c)
    for i in range(out.shape[0]):
        out[i] = src[i] * cc


@jit_inline
def _shift(x: Any, out: Any, m: float, c: float) -> None:
    """out = (x - m) - c in x's precision."""
    mm, cc = x.dtype.type(m), x.dtype.type(c)
    for i in range(x.shape[0]):
        out[i] = (x[i] - mm) - cc


@jit_inline
def _exp_store_max(x: Any, out: Any, m: float, y: Any) -> float:
    """out = exp(x - m), and the max of y (as ``_max``) read in the same loop: y is the next block (of split
    rows; its length may differ), streamed from memory while this one's exps keep the core busy. In place (out is
    x): ``_exp_in_place_max``. Whole rows: ``_exp_store_max_row``."""
    if x.ctypes.data == out.ctypes.data:
        return float(_exp_in_place_max(x, m, y))
    nx, ny = x.shape[0], y.shape[0]
    both = min(nx, ny)
    mx = _exp_store_max_row(x[:both], out[:both], m, y[:both], True)
    for i in range(both, nx):
        out[i] = vm.exp_shifted(x[i], m)
    for i in range(both, ny):
        mx = vm.maximum(mx, y[i])
    return float(mx)


@jit_inline
def _exp_store_max_row(x: Any, out: Any, m: float, y: Any, apart: bool) -> float:
    """``_exp_store_max`` for y as long as x (the next of a matrix's rows), in one loop (without the loops for the
    longer one's remainder, short rows ran 2-7% faster; /tmp/w48/fb.py of the forty-eighth session). ``apart``
    (a constant): out is not x (a scratch row, or out of an op not in place), and the in-place test is left out:
    with it, the pipelined order with its exps in scratch ran 1.3x slower (softmax, rows of 32 and 64, two
    threads: 8.3 and 5.8 ms against 6.2 and 4.5; /tmp/w48/sc6.py)."""
    if not apart and x.ctypes.data == out.ctypes.data:
        return float(_exp_in_place_max(x, m, y))
    mx = y[0]
    for i in range(x.shape[0]):
        out[i] = vm.exp_shifted(x[i], m)
        mx = vm.maximum(mx, y[i])
    return float(mx)


@jit_inline
def _exp_in_place_max(x: Any, m: float, y: Any) -> float:
    """``_exp_store_max`` with out = x, in two loops: with y's max in the loop storing into x, LLVM does not
    vectorize it where y is a row of x's array (it cannot bound the distance between a store to one row and a load
    from another; with x and y of different arrays it checks they do not overlap, and vectorizes). In-place
    softmax of 4096 x 4096 float32, two threads: 26.2 ms in the one loop, against 4.3 out of place."""
    for i in range(x.shape[0]):
        x[i] = vm.exp_shifted(x[i], m)
    return float(_max(y))


IN_PLACE_STEP = 8192  # elements of a step of in-place softmax's split rows (``_partials``)

# Whole rows take one of three orders by their length; speed-ups over the pipelined order alone, two threads
# through the op on 16 M float32 elements (/tmp/w47/ab.py of the forty-seventh session):
PIPELINED_MAX = 256  # longer rows are each finished at once (softmax 384: 1.20x, 1024: 1.25, 4096: 1.08)
GROUPED_MAX = 48  # log-softmax rows up to this long take their logs by groups (16: 1.65x, 32: 1.24, 48: 1.13;
# rows of 64 were no faster, 0.99-1.0x, and stay pipelined)
GROUP_FLOATS = 1024  # elements of a group of such rows (at most GROUP_ROWS rows)
GROUP_ROWS = 64

# Tried and left out (AMD Zen 3, 9-15 interleaved rounds in one process: through the op on two threads, or for the
# grouped logs the rows kernel alone on one thread; /tmp/w63/smab.py, lsab.py, logg.py of the sixty-third session;
# the streaming kernels written then are not kept):
# - non-temporal stores for the results, as layer / RMS norm's 'rows_streaming' (which ran 1.26x faster than its
#   plain rows at 4096 x 4096 in the same session): softmax 0.91x at 262144 x 64 and 0.92x at 4096 x 4096, log-softmax
#   0.84x and 0.98x, log-softmax's split rows 1.02x; softmax's split rows, their exps then recomputed for the write,
#   0.62x. On one thread at 4096 x 4096 softmax took 10.7 ms plain and 11.6 streamed, layer norm 9.3 and 7.6
#   (smab1.py): the exps bound softmax, not memory.
# - log-softmax's rows of 64 run 1.13-1.17x softmax's time, the difference the libm log a row (with s - 1 in its
#   place, for timing only: 0.95x). The log inlined (``vmath.log``: a division and 11 dependent steps) ran 1.3x
#   softmax's time; the logs of 4, 8 or 16 rows at a time in one vector loop, each row finished a group later,
#   1.1-1.3x slower than the call; finishing rows two behind instead of one, no faster. ``logf`` of float32(s) would
#   cost the accuracy of the results near 0 (log s near 0 where one element dominates a row).


@jit_inline
def _row_exps(x: Any, e: Any, k: int, m: float, dense: bool, apart: bool) -> tuple[float, float]:
    """Row k's exps (shifted by its max m) stored into e, and the max of row k + 1 read in the same loop (the
    last row re-reads itself: in cache, its max unused): (the next row's max, the sum of row k's exps, NaN for a
    row all -inf, as ``_partials``). ``apart``: e is a scratch row (``_exp_store_max_row``)."""
    shift = m if m != -np.inf else 0.0
    nxt = k + 1 if k + 1 < x.shape[0] else k
    m_next = _exp_store_max_row(row_of(x, k, dense), e, shift, row_of(x, nxt, dense), apart)
    s = vm.fsum(e)
    return m_next, (np.nan if m == -np.inf else s)


PIPELINED, AT_ONCE, GROUPED = 0, 1, 2  # the whole-rows orders (``row_order``)


def row_order(mode: int, n: int) -> int:
    """The order of whole rows of ``n`` elements (the constants above), chosen in phase 1: one kernel per order,
    so a launch compiles only its own (the three inlined in one kernel took 4.5x as long to compile)."""
    if mode != SOFTMAX and n <= GROUPED_MAX:
        return GROUPED
    if n <= PIPELINED_MAX:
        return PIPELINED
    return AT_ONCE


def packed_scratch_len(n: int, split: int, block: int) -> int:
    """Elements of the scratch row that each part of a packed log-softmax (run in place in the pack) takes from the
    workspace: a block of split rows, or a row finished at once; 0 for shorter rows, whose scratch rows are made at
    binding (``scratch_rows``, at most ``PIPELINED_MAX`` elements each)."""
    if split > 1:
        return block
    return n if n > PIPELINED_MAX else 0


def scratch_rows(mode: int, n: int, split: int) -> int:
    """Scratch rows a part's kernel takes: the short rows' orders keep their exps in scratch (softmax pipelined: two,
    row k's and row k - 1's), in-place log-softmax finished at once or split one."""
    if n <= PIPELINED_MAX and split == 1:
        return 2 if mode == SOFTMAX else 1
    return 1 if mode == LOG_SOFTMAX else 0


@jit_inline
def _rows_at_once(x: Any, out: Any, mode: int, tmp: Any, dense: bool) -> None:
    """Each row finished at once, while it is in L1; its exps go to out, where the row's lines are then at hand for
    the finish (log-softmax in place: to the scratch row ``tmp``, of length N). Rows of 4096 ran 1.3-1.4x slower
    with their exps in scratch (/tmp/w48/sc8.py)."""
    m = _max(row_of(x, 0, dense))
    for k in range(x.shape[0]):
        e = tmp if mode == LOG_SOFTMAX else row_of(out, k, dense)
        m_next, s = _row_exps(x, e, k, m, dense, mode != SOFTMAX)  # only softmax's exps may go to x itself
        ok = row_of(out, k, dense)
        _finish_from(row_of(x, k, dense), ok, ok, m, (1.0 / s if mode == SOFTMAX else math.log(s)), mode)
        m = m_next


@jit_inline
def _finish_from(x: Any, e: Any, out: Any, m: float, c: float, mode: int) -> None:
    """A row's result from its exps e (a scratch row, or out itself): out = e * c (softmax, c = 1/sum) or
    out = (x - m) - c (log-softmax, c = log sum, e unused)."""
    if mode == SOFTMAX:
        _scaled(e, out, c)
    else:
        _shift(x, out, m, c)


@jit_inline
def _rows_pipelined(x: Any, out: Any, mode: int, tmp: Any, dense: bool) -> None:
    """Row k - 1's result is written before row k's sum, so that no row waits on its own sum and division (short
    rows: 0.83 -> 0.62 ns/element single-threaded). The exps go to scratch rows, which stay in L1 (softmax: row
    k's to ``tmp[k % 2]``), and out is written once: with them in out, whose lines each exp loop's stores had to
    bring in first, rows of 64 ran 1.1-1.25x slower, rows of 32 1.5x (/tmp/w48/sc6.py, sc7.py)."""
    nk = x.shape[0]
    ring = 1 if mode == SOFTMAX else 0  # row k's exps in tmp[k & ring]
    m = _max(row_of(x, 0, dense))
    pm = pc = 0.0  # row k - 1's max and its factor (softmax) or shift (log-softmax)
    for k in range(nk):
        m_next, s = _row_exps(x, tmp[k & ring], k, m, dense, True)
        if k > 0:
            _finish_from(row_of(x, k - 1, dense), tmp[(k - 1) & ring], row_of(out, k - 1, dense), pm, pc, mode)
        pm, pc = m, (1.0 / s if mode == SOFTMAX else math.log(s))
        m = m_next
    _finish_from(row_of(x, nk - 1, dense), tmp[(nk - 1) & ring], row_of(out, nk - 1, dense), pm, pc, mode)


@jit_inline
def _rows_grouped(x: Any, out: Any, tmp: Any, dense: bool) -> None:
    """Log-softmax rows by groups of up to ``GROUP_FLOATS`` elements: each row's exps (into the scratch row
    ``tmp``) and sum, then the group's logs in one vectorized loop (``vmath.log``; a scalar log a row cost short
    rows more than their exps), then the group's results, its rows still in L1."""
    n = x.shape[1]
    nk = x.shape[0]
    g = min(GROUP_ROWS, max(1, GROUP_FLOATS // n))
    ms = np.empty(GROUP_ROWS)
    cs = np.empty(GROUP_ROWS)
    m = _max(row_of(x, 0, dense))
    for g0 in range(0, nk, g):
        g1 = min(g0 + g, nk)
        for k in range(g0, g1):
            ms[k - g0] = m
            m, s = _row_exps(x, tmp, k, m, dense, True)
            cs[k - g0] = s
        for j in range(g1 - g0):
            cs[j] = vm.log(cs[j])
        for k in range(g0, g1):
            _shift(row_of(x, k, dense), row_of(out, k, dense), ms[k - g0], cs[k - g0])


def _rows_kernel(mode: int, order: int, dense: bool) -> Any:
    """The whole-rows kernel of ``mode`` in ``order`` (``row_order``). In every order row k + 1's max is taken in
    row k's exp loop, so that its memory traffic overlaps row k's arithmetic. ``scratch``: the part's
    ``scratch_rows`` (a (R, N) array; its rows, not slices of it: a slice types as 'A', whose loops vectorize
    worse). ``dense``: rows taken as dense vectors (``jit.row_of``)."""

    @rows_only("x", "out")
    @jit
    def rows(x: Any, out: Any, scratch: Any) -> None:
        wide_vectors()
        if x.shape[0] == 0 or x.shape[1] == 0:
            return
        if order == PIPELINED:  # closure constants: numba prunes the other branches before typing them
            _rows_pipelined(x, out, mode, scratch, dense)
        elif order == GROUPED:
            _rows_grouped(x, out, scratch[0], dense)
        else:
            _rows_at_once(x, out, mode, scratch[0], dense)

    return rows


def rows_key(mode: int, n: int) -> tuple[int, int]:
    """The ``ROWS`` key of whole rows of ``n`` elements: (mode, order), log-softmax in place or not one mode where
    the exps go to scratch anyway (every order but at once)."""
    order = row_order(mode, n)
    return (LOG_SOFTMAX if mode == LOG_SOFTMAX_IN_OUT and order != AT_ONCE else mode), order


ROWS = {
    key: by_density(functools.partial(_rows_kernel, *key))
    for key in (
        (SOFTMAX, PIPELINED),
        (SOFTMAX, AT_ONCE),
        (LOG_SOFTMAX, PIPELINED),
        (LOG_SOFTMAX, GROUPED),
        (LOG_SOFTMAX, AT_ONCE),
        (LOG_SOFTMAX_IN_OUT, AT_ONCE),
    )
}  # by ``rows_key``


@jit_inline
def _merge(part: Any, k: int, mode: int) -> None:
    """Merge row k's block partials (m_b, s_b): M = max m_b, S = sum s_b exp(m_b - M); then rewrite each
    block's slot with what its write needs: (exp(m_b - M) / S, S) for softmax, (M, log S) for log-softmax."""
    nb = part.shape[1]
    big = -np.inf
    for b in range(nb):
        big = vm.maximum(big, part[k, b, 0])
    s = 0.0
    for b in range(nb):
        s += part[k, b, 1] * math.exp(part[k, b, 0] - big)
    ls = math.log(s)
    for b in range(nb):
        if mode == SOFTMAX:
            part[k, b, 0] = math.exp(part[k, b, 0] - big) / s
            part[k, b, 1] = s
        else:
            part[k, b, 0] = big
            part[k, b, 1] = ls


@jit_inline
def _step_end(t: int, t1: int, nb: int, step: int) -> int:
    """End of the step of up to ``step`` blocks from block t: within t1 and within t's row."""
    return min(t + step, t1, (t // nb + 1) * nb)


@jit_inline
def _blocks(x: Any, block: int, t: int, u: int, nb: int, dense: bool) -> Any:
    """Blocks ``t <= b < u`` (of one row) of the row-major (row, block) task list, as one view."""
    k, j = t // nb, t % nb
    return row_of(x, k, dense)[j * block : min(x.shape[1], (j + u - t) * block)]


@jit_inline
def _partials(
    x: Any, out: Any, tmp: Any, block: int, part: Any, mode: int, t0: int, t1: int, step: int, dense: bool
) -> None:
    """(m, s) of blocks ``t0 <= t < t1`` of the row-major (row, block) task list into ``part``: m the block's max,
    s the sum of exp(x - m) stored into out (softmax, log-softmax not in place) or the scratch ``tmp``. The blocks
    go by steps of up to ``step`` blocks (1 but for softmax in place: there the exps go to x, and float32 steps of 2048
    elements ran 1.1-1.15x slower than of 8192; /tmp/w49/pkip.py): a step's blocks all take its max, the first
    its sum, the others 0, which merges as the step's (m, s) would. Step u's max is read in step u - 1's exp
    loop. An all -inf step shifts by 0 (its exps are 0, s = 0) so that it merges as nothing; a whole row of -inf
    still gives NaN. ``dense``: rows taken as dense vectors (``jit.row_of``)."""
    if t0 >= t1:
        return
    nb = part.shape[1]
    t, u = t0, _step_end(t0, t1, nb, step)
    m_next = _max(_blocks(x, block, t, u, nb, dense))
    while t < t1:
        k, j = t // nb, t % nb
        xb = _blocks(x, block, t, u, nb, dense)
        e = tmp[: xb.shape[0]] if mode == LOG_SOFTMAX else _blocks(out, block, t, u, nb, dense)
        m = m_next
        v = _step_end(u, t1, nb, step)
        y = _blocks(x, block, u, v, nb, dense) if u < t1 else xb  # the last step re-reads itself
        m_next = _exp_store_max(xb, e, m if m != -np.inf else 0.0, y)
        part[k, j, 1] = vm.fsum(e)
        for b in range(j, j + u - t):
            part[k, b, 0] = m
            if b > j:
                part[k, b, 1] = 0.0
        t, u = u, v


@jit_inline
def _write(x: Any, out: Any, block: int, part: Any, k: int, j: int, mode: int, dense: bool) -> None:
    lo, hi = j * block, min(x.shape[1], (j + 1) * block)
    if mode == SOFTMAX:
        ob = row_of(out, k, dense)[lo:hi]
        _scaled(ob, ob, part[k, j, 0])
    else:
        _shift(row_of(x, k, dense)[lo:hi], row_of(out, k, dense)[lo:hi], part[k, j, 0], part[k, j, 1])


def _split_rows_kernel(dense: bool) -> Any:
    @rows_only("x", "out")
    @jit
    def split_rows(x: Any, out: Any, block: int, part: Any, mode: int, step: int, scratch: Any) -> None:
        """Long rows, one after the other: a row's block partials, their merge, its writes (the row stays in
        L2 / L3 between the passes)."""
        _split_rows(x, out, block, part, mode, step, scratch[0], dense)

    return split_rows


@jit_inline
def _split_rows(x: Any, out: Any, block: int, part: Any, mode: int, step: int, tmp: Any, dense: bool) -> None:
    nb = part.shape[1]
    for k in range(x.shape[0]):
        _partials(x, out, tmp, block, part, mode, k * nb, (k + 1) * nb, step, dense)
        _merge(part, k, mode)
        for j in range(nb):
            _write(x, out, block, part, k, j, mode, dense)


def _split_partials_kernel(dense: bool) -> Any:
    @rows_only("x", "out")
    @jit
    def split_partials(
        x: Any, out: Any, block: int, part: Any, mode: int, t0: int, t1: int, step: int, scratch: Any
    ) -> None:
        """Blocks ``t0 <= t < t1`` of the row-major (row, block) task list: their partials (fewer long rows than
        helper threads: the blocks are shared out instead of the rows)."""
        _partials(x, out, scratch[0], block, part, mode, t0, t1, step, dense)

    return split_partials


@jit
def split_merge(part: Any, mode: int) -> None:
    for k in range(part.shape[0]):
        _merge(part, k, mode)


def _split_writes_kernel(dense: bool) -> Any:
    @rows_only("x", "out")
    @jit
    def split_writes(x: Any, out: Any, block: int, part: Any, mode: int, t0: int, t1: int) -> None:
        nb = part.shape[1]
        for t in range(t0, t1):
            _write(x, out, block, part, t // nb, t % nb, mode, dense)

    return split_writes


SPLIT_ROWS = by_density(_split_rows_kernel)
SPLIT_PARTIALS = by_density(_split_partials_kernel)
SPLIT_WRITES = by_density(_split_writes_kernel)


def build_softmax(src: Any, dst: Any, tiling: Any, mode: int = SOFTMAX) -> Callable[[Any], None]:
    """Launch for (log-)softmax of ``src`` into ``dst`` (both (K, N) views, or permuted N-d views when packed):
    ``tiling.threads`` parts (row ranges, or block ranges when long rows are fewer than the parts) for helper
    threads, each with its own scratch rows (``scratch_rows``)."""
    t = tiling
    if t.rows * t.length == 0:
        return lambda _: None
    compute_dt = np.dtype(np.float32) if t.pack and src.dtype == np.float16 else src.dtype
    sample = np.empty((1, 1), compute_dt) if t.pack else src
    out_sample = sample if t.pack else dst
    k, n, split, block = t.rows, t.length, t.split, t.block
    row = block if split > 1 else n
    if mode == LOG_SOFTMAX and t.pack and (t.scratch_len < packed_scratch_len(n, split, block) or t.threads < 1):
        raise InternalError(
            "packed log-softmax tiling lacks its per-part scratch rows",
            op="log_softmax",
            status=Status.ERR_INNER_TILING,
        )
    in_place = t.pack or np.may_share_memory(src, dst)  # packed: in place in the pack
    step = max(1, IN_PLACE_STEP // block) if mode == SOFTMAX and in_place else 1  # ``_partials``' steps
    if mode == LOG_SOFTMAX and not in_place:
        mode = LOG_SOFTMAX_IN_OUT  # x survives: rows finished at once put their exps in out, whose lines they bring in
    # per part, its scratch rows (a (R, L) array): a zero-size stand-in where the exps go to out; else made here, at
    # binding, once, or (packed log-softmax rows finished at once or split) in the workspace. Each part's on cache
    # lines of its own: the helper threads write their rows at once (in-place log-softmax of 16 M float32 elements in
    # rows of 32, two threads, the two rows of one 16-byte-aligned array: 28.4 and 17.2 ms; on lines of their own
    # 13.5 and 13.2; rows of 64 ran 8.8-9.1 ms either way; /tmp/w46/lsip.py of the forty-sixth session, two runs)
    rows_needed = scratch_rows(mode, n, split)
    own: list[Any] = [np.empty((1, 0), compute_dt)] * t.threads
    if rows_needed and not t.scratch_len:
        own = [line_array((rows_needed, row), compute_dt) for _ in range(t.threads)]
    part_sample = np.empty((1, 1, 2), np.float64)
    dense = rows_dense(sample, out_sample)
    if split == 1:
        fn = entry(ROWS[rows_key(mode, n)][dense], sample, out_sample, own[0])
    elif t.by_rows:
        fn = entry(SPLIT_ROWS[dense], sample, out_sample, block, part_sample, mode, 1, own[0])
    else:
        f_part = entry(SPLIT_PARTIALS[dense], sample, out_sample, block, part_sample, mode, 0, 0, 1, own[0])
        f_merge = entry(split_merge, part_sample, mode)
        f_write = entry(SPLIT_WRITES[dense], sample, out_sample, block, part_sample, mode, 0, 0)
    by_rows = split == 1 or t.by_rows
    ranges = split_range(k if by_rows else k * split, t.threads)
    pack_bytes = k * n * compute_dt.itemsize
    scratch_stride = align(t.scratch_len * compute_dt.itemsize)  # packed: each part's row on lines of its own

    def row_parts(x: Any, out: Any, scratch: list[Any]) -> list[Callable[[], None]]:
        return [functools.partial(fn, x[lo:hi], out[lo:hi], scratch[i]) for i, (lo, hi) in enumerate(ranges)]

    if split == 1 and not t.pack:  # whole rows in place in the operands: every part is fixed here, in phase 1
        return launcher(row_parts(src, dst, own))

    def run(x: Any, out: Any, scratch: list[Any], ws: Any) -> None:
        if split == 1:
            run_parts(row_parts(x, out, scratch))
            return
        part = ws[t.part_offset : t.part_offset + k * split * 16].view(np.float64).reshape(k, split, 2)
        if len(ranges) == 1 and by_rows:  # one part of whole rows: no views to cut
            fn(x, out, block, part, mode, step, scratch[0])
            return
        if by_rows:
            run_parts(
                [
                    functools.partial(fn, x[lo:hi], out[lo:hi], block, part[lo:hi], mode, step, scratch[i])
                    for i, (lo, hi) in enumerate(ranges)
                ]
            )
            return
        run_parts(
            [
                functools.partial(f_part, x, out, block, part, mode, lo, hi, step, scratch[i])
                for i, (lo, hi) in enumerate(ranges)
            ]
        )
        f_merge(part, mode)
        run_parts([functools.partial(f_write, x, out, block, part, mode, lo, hi) for lo, hi in ranges])

    def launch(ws: Any) -> None:
        if t.pack:
            area = ws[t.pack_offset : t.pack_offset + pack_bytes].view(compute_dt)
            cast_copy(area.reshape(src.shape), src)
            x = out = area.reshape(k, n)
        else:
            x, out = src, dst
        if t.scratch_len:
            at = t.scratch_offset
            rows_bytes = t.scratch_len * compute_dt.itemsize
            scratch = [
                ws[at + i * scratch_stride : at + i * scratch_stride + rows_bytes].view(compute_dt).reshape(1, -1)
                for i in range(t.threads)
            ]
        else:
            scratch = own
        run(x, out, scratch, ws)
        if t.pack:
            cast_copy(dst, out.reshape(dst.shape))

    return launch
