"""Softmax and log-softmax over the last axis of a (rows, length) view, on vectorized loops.

A row (or a block of a long row) takes three passes while it sits in cache: its max (``llvm.maximum``,
NaN-propagating, vectorizes as a reduction), ``exp(x - max)`` stored into ``out`` (``vmath.exp_shifted``, no
reassociation, so the range reduction stays exact), and the float64 sum of what was stored (reassociated:
vectorized). A last pass writes the result: ``out *= 1/sum`` (softmax) or ``out = (x - max) - log(sum)``
(log-softmax). Long rows are split in blocks whose float64 ``(max, sum)`` partials live in the workspace and
are merged per row: ``M = max_b m_b``, ``S = sum_b s_b * exp(m_b - M)``; block b is then scaled by
``exp(m_b - M) / S`` (softmax) or rewritten as ``(x - M) - log S`` (log-softmax).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numba
import numpy as np

from ...errors import InternalError, Status
from ...runtime.fanout import run_parts, split_range
from . import jit as _jit
from . import vmath as vm
from .jit import entry

SOFTMAX, LOG_SOFTMAX = 0, 1
Kernel = Callable[[Callable[..., Any]], Any]
jit: Kernel = _jit.jit  # the numba decorators, typed (jit.py leaves them untyped)
# per-row helpers, inlined into each kernel (a call per row costs more than a short row's work)
jit_inline: Kernel = numba.njit(nogil=True, cache=True, error_model="numpy", fastmath=_jit.FAST, inline="always")


@jit_inline
def _max(x: Any) -> float:
    """max of a non-empty 1-d view, NaN if any is NaN; in x's dtype, widened at the end."""
    m = x[0]
    for i in range(1, x.shape[0]):
        m = vm.maximum(m, x[i])
    return float(m)


@jit_inline
def _exp_store(x: Any, out: Any, m: float) -> None:
    for i in range(x.shape[0]):
        out[i] = vm.exp_shifted(x[i], m)


@jit_inline
def _stats(x: Any, out: Any) -> tuple[float, float]:
    """(m, s) of a 1-d view with out = exp(x - m) and s its sum. An all -inf block shifts by 0 (its exps are
    0, s = 0) so that it merges as nothing; a whole row of -inf still gives NaN."""
    m = _max(x)
    _exp_store(x, out, m if m != -np.inf else 0.0)
    return m, vm.fsum(out)


@jit_inline
def _scale(out: Any, c: float) -> None:
    for i in range(out.shape[0]):
        out[i] = out[i] * c


@jit_inline
def _shift(x: Any, out: Any, m: float, c: float) -> None:
    for i in range(x.shape[0]):
        out[i] = (x[i] - m) - c


@jit_inline
def _block_stats(x: Any, out: Any, tmp: Any, mode: int) -> Any:
    """softmax keeps its exps in ``out`` (scaled later); log-softmax sums them in the scratch ``tmp`` so that
    ``x`` survives when it is ``out`` (packed, or an in-place call)."""
    if mode == SOFTMAX:
        return _stats(x, out)
    return _stats(x, tmp[:x.shape[0]])


@jit_inline
def _row(x: Any, out: Any, tmp: Any, mode: int) -> None:
    m, s = _block_stats(x, out, tmp, mode)
    if m == -np.inf:
        s = np.nan  # every element -inf: exp(x - max) is NaN, as in the reference
    if mode == SOFTMAX:
        _scale(out, 1.0 / s)
    else:
        _shift(x, out, m, math.log(s))


@jit
def rows(x: Any, out: Any, mode: int, scratch: Any) -> None:
    """Whole rows, one after the other (log-softmax sums in the scratch row)."""
    tmp = scratch[0]
    for k in range(x.shape[0]):
        _row(x[k], out[k], tmp, mode)


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
def _partial(x: Any, out: Any, tmp: Any, block: int, part: Any, k: int, j: int, mode: int) -> None:
    lo, hi = j * block, min(x.shape[1], (j + 1) * block)
    part[k, j, 0], part[k, j, 1] = _block_stats(x[k, lo:hi], out[k, lo:hi], tmp, mode)


@jit_inline
def _write(x: Any, out: Any, block: int, part: Any, k: int, j: int, mode: int) -> None:
    lo, hi = j * block, min(x.shape[1], (j + 1) * block)
    if mode == SOFTMAX:
        _scale(out[k, lo:hi], part[k, j, 0])
    else:
        _shift(x[k, lo:hi], out[k, lo:hi], part[k, j, 0], part[k, j, 1])


@jit
def split_rows(x: Any, out: Any, block: int, part: Any, mode: int, scratch: Any) -> None:
    """Long rows, one after the other: a row's block partials, their merge, its writes (the row stays in L2 /
    L3 between the passes)."""
    tmp = scratch[0]
    nb = part.shape[1]
    for k in range(x.shape[0]):
        for j in range(nb):
            _partial(x, out, tmp, block, part, k, j, mode)
        _merge(part, k, mode)
        for j in range(nb):
            _write(x, out, block, part, k, j, mode)


@jit
def split_partials(x: Any, out: Any, block: int, part: Any, mode: int, t0: int, t1: int, scratch: Any) -> None:
    """Blocks ``t0 <= t < t1`` of the row-major (row, block) task list: their partials (fewer long rows than
    helper threads: the blocks are shared out instead of the rows)."""
    tmp = scratch[0]
    nb = part.shape[1]
    for t in range(t0, t1):
        _partial(x, out, tmp, block, part, t // nb, t % nb, mode)


@jit
def split_merge(part: Any, mode: int) -> None:
    for k in range(part.shape[0]):
        _merge(part, k, mode)


@jit
def split_writes(x: Any, out: Any, block: int, part: Any, mode: int, t0: int, t1: int) -> None:
    nb = part.shape[1]
    for t in range(t0, t1):
        _write(x, out, block, part, t // nb, t % nb, mode)


def build_softmax(src: Any, dst: Any, tiling: Any, mode: int = SOFTMAX) -> Callable[[Any], None]:
    """Launch for (log-)softmax of ``src`` into ``dst`` (both (K, N) views, or permuted N-d views when packed):
    ``tiling.threads`` parts (row ranges, or block ranges when long rows are fewer than the parts) for helper
    threads, each with its own scratch row."""
    t = tiling
    if t.rows * t.length == 0:
        return lambda _: None
    compute_dt = np.dtype(np.float32) if t.pack and src.dtype == np.float16 else src.dtype
    sample = np.empty((1, 1), compute_dt) if t.pack else src
    out_sample = sample if t.pack else dst
    k, n, split, block = t.rows, t.length, t.split, t.block
    if mode == LOG_SOFTMAX and (t.scratch_len < (block if split > 1 else n) or t.threads < 1):
        raise InternalError("log-softmax tiling lacks its per-part scratch rows", op="log_softmax",
                            status=Status.ERR_INNER_TILING)
    no_scratch = np.empty((t.threads, 0), compute_dt)  # softmax keeps its exps in out: zero-size stand-ins
    part_sample = np.empty((1, 1, 2), np.float64)
    if split == 1:
        fn = entry(rows, sample, out_sample, mode, no_scratch)
    elif t.by_rows:
        fn = entry(split_rows, sample, out_sample, block, part_sample, mode, no_scratch)
    else:
        f_part = entry(split_partials, sample, out_sample, block, part_sample, mode, 0, 0, no_scratch)
        f_merge = entry(split_merge, part_sample, mode)
        f_write = entry(split_writes, sample, out_sample, block, part_sample, mode, 0, 0)
    by_rows = split == 1 or t.by_rows
    ranges = split_range(k if by_rows else k * split, t.threads)
    pack_bytes = k * n * compute_dt.itemsize
    scratch_bytes = t.threads * t.scratch_len * compute_dt.itemsize

    def run(x: Any, out: Any, scratch: Any, ws: Any) -> None:
        if len(ranges) == 1 and by_rows:  # one part of whole rows: no views to cut
            if split == 1:
                fn(x, out, mode, scratch)
            else:
                fn(x, out, block, ws[t.part_offset:t.part_offset + k * split * 16].view(np.float64).reshape(
                    k, split, 2), mode, scratch)
            return
        if split == 1:
            run_parts([functools.partial(fn, x[lo:hi], out[lo:hi], mode, scratch[i:i + 1])
                       for i, (lo, hi) in enumerate(ranges)])
            return
        part = ws[t.part_offset:t.part_offset + k * split * 16].view(np.float64).reshape(k, split, 2)
        if by_rows:
            run_parts([functools.partial(fn, x[lo:hi], out[lo:hi], block, part[lo:hi], mode, scratch[i:i + 1])
                       for i, (lo, hi) in enumerate(ranges)])
            return
        run_parts([functools.partial(f_part, x, out, block, part, mode, lo, hi, scratch[i:i + 1])
                   for i, (lo, hi) in enumerate(ranges)])
        f_merge(part, mode)
        run_parts([functools.partial(f_write, x, out, block, part, mode, lo, hi) for lo, hi in ranges])

    def launch(ws: Any) -> None:
        if t.pack:
            area = ws[t.pack_offset:t.pack_offset + pack_bytes].view(compute_dt)
            np.copyto(area.reshape(src.shape), src, casting="unsafe")
            x = out = area.reshape(k, n)
        else:
            x, out = src, dst
        if t.scratch_len:
            area = ws[t.scratch_offset:t.scratch_offset + scratch_bytes].view(compute_dt)
            scratch = area.reshape(t.threads, t.scratch_len)
        else:
            scratch = no_scratch
        run(x, out, scratch, ws)
        if t.pack:
            np.copyto(dst, out.reshape(dst.shape), casting="unsafe")
    return launch
