"""Softmax over the last axis of a (rows, length) view: whole rows per task, or long rows split in blocks
whose (max, sum) partials live in the workspace."""

from __future__ import annotations

import math
from typing import Any, Callable

import numba
import numpy as np

from .jit import entry, jit, jit_reduce


@jit_reduce
def _row_max(x: Any, k: int, lo: int, hi: int) -> float:
    m = -np.inf
    for i in range(lo, hi):
        v = x[k, i]
        if v > m or v != v:
            m = v
    return m


@jit_reduce
def _exp_sum(x: Any, k: int, lo: int, hi: int, m: float, out: Any, store: bool) -> float:
    s = 0.0
    for i in range(lo, hi):
        e = math.exp(x[k, i] - m)
        if store:
            out[k, i] = e
        s += e
    return s


@jit
def _softmax_row(x: Any, out: Any, k: int) -> None:
    n = x.shape[1]
    m = _row_max(x, k, 0, n)
    s = _exp_sum(x, k, 0, n, m, out, True)
    inv = 1.0 / s
    for i in range(n):
        out[k, i] = out[k, i] * inv


@jit
def softmax_rows(x: Any, out: Any) -> None:
    for k in range(x.shape[0]):
        _softmax_row(x, out, k)


@numba.njit(nogil=True, cache=True, parallel=True, fastmath={"contract", "arcp", "nsz"})
def softmax_rows_par(x: Any, out: Any) -> None:
    for k in numba.prange(x.shape[0]):
        _softmax_row(x, out, k)


@numba.njit(nogil=True, cache=True, parallel=True, fastmath={"contract", "arcp", "nsz", "reassoc"})
def softmax_partials(x: Any, block: int, part: Any) -> None:
    """part[k, j] = (max, sum exp(x - max)) of block j of row k."""
    n_rows, n = x.shape
    nb = part.shape[1]
    for t in numba.prange(n_rows * nb):
        k = t // nb
        j = t - k * nb
        lo = j * block
        hi = min(n, lo + block)
        m = _row_max(x, k, lo, hi)
        part[k, j, 0] = m
        part[k, j, 1] = _exp_sum(x, k, lo, hi, m, x, False)


@numba.njit(nogil=True, cache=True, parallel=True, fastmath={"contract", "arcp", "nsz"})
def softmax_from_partials(x: Any, block: int, part: Any, out: Any) -> None:
    """Merge each row's partials into (max, sum), then write exp(x - max) / sum block by block."""
    n_rows, n = x.shape
    nb = part.shape[1]
    for t in numba.prange(n_rows * nb):
        k = t // nb
        j = t - k * nb
        m = -np.inf
        for b in range(nb):
            if part[k, b, 0] > m or part[k, b, 0] != part[k, b, 0]:
                m = part[k, b, 0]
        s = 0.0
        for b in range(nb):
            s += part[k, b, 1] * math.exp(part[k, b, 0] - m)
        inv = 1.0 / s
        for i in range(j * block, min(n, (j + 1) * block)):
            out[k, i] = math.exp(x[k, i] - m) * inv


def build_softmax(src: Any, dst: Any, tiling: Any) -> Callable[[Any], None]:
    """Launch for softmax of ``src`` into ``dst`` (both (K, N) views, or permuted N-d views when packed)."""
    t = tiling
    if t.rows * t.length == 0:
        return lambda _: None
    compute_dt = np.dtype(np.float32) if t.pack and src.dtype == np.float16 else src.dtype
    sample = np.empty((1, 1), compute_dt) if t.pack else src
    out_sample = sample if t.pack else dst
    if t.split > 1:
        part_sample = np.empty((1, 1, 2), np.float64)
        k_part = entry(softmax_partials, sample, t.block, part_sample)
        k_write = entry(softmax_from_partials, sample, t.block, part_sample, out_sample)
    else:
        k_rows = entry(softmax_rows_par if t.parallel else softmax_rows, sample, out_sample)
    k, n, split, block = t.rows, t.length, t.split, t.block
    pack_bytes = k * n * compute_dt.itemsize

    def launch(ws: Any) -> None:
        if t.pack:
            area = ws[t.pack_offset:t.pack_offset + pack_bytes].view(compute_dt)
            np.copyto(area.reshape(src.shape), src, casting="unsafe")
            x = out = area.reshape(k, n)
        else:
            x, out = src, dst
        if split > 1:
            part = ws[:k * split * 16].view(np.float64).reshape(k, split, 2)
            k_part(x, block, part)
            k_write(x, block, part, out)
        else:
            k_rows(x, out)
        if t.pack:
            np.copyto(dst, out.reshape(dst.shape), casting="unsafe")
    return launch
