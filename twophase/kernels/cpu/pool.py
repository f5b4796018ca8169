"""Pooling kernels on logical NCHW views (NHWC passed transposed); ranges of (N, C) planes on helper threads;
no workspace."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ...runtime.fanout import fanout_parts, launcher, split_range
from . import vmath as vm
from .conv import ow_range
from .jit import by_density, entry, jit_inline, row_of, rows_dense, rows_only
from .jit import jit as _jit

Launch = Callable[[Any], None]
jit: Callable[[Callable[..., Any]], Any] = _jit
PARALLEL_MIN = 1 << 20  # window elements read from which the planes are cut into ranges for helper threads


@jit_inline
def _max_plane(xp: Any, op: Any, geo: Any, dense: bool) -> None:
    kh_n, kw_n, sh, sw, ph, pw, dh, dw = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5], geo[6], geo[7]
    height, width = xp.shape
    ow_n = op.shape[1]
    u_sw = np.uint64(sw)
    for oh in range(op.shape[0]):
        orow = row_of(op, oh, dense)
        for ow in range(ow_n):
            orow[ow] = -np.inf
        for kh in range(kh_n):
            ih = oh * sh - ph + kh * dh
            if ih < 0 or ih >= height:
                continue
            xrow = row_of(xp, ih, dense)
            for kw in range(kw_n):
                off = kw * dw - pw
                lo, hi = ow_range(off, sw, width, ow_n)
                dst = orow[lo:]
                s0 = np.uint64(lo * sw + off)
                for u in range(np.uint64(hi - lo)):
                    dst[u] = vm.maximum(dst[u], xrow[s0 + u * u_sw])


def _max_pool_kernel(dense: bool) -> Any:
    @rows_only("x", "out")
    @jit
    def max_pool(x: Any, out: Any, geo: Any, t0: int, t1: int) -> None:
        """Max over each window (``geo`` = KH, KW, sh, sw, ph, pw, dh, dw), planes t0 <= t = n * C + c < t1; NaN
        propagates. Each window tap takes the max of an output row with a shifted input row (unsigned indices:
        the row loop vectorizes; rows typed dense when ``dense``, a closure constant: ``jit.by_density``)."""
        c_n = x.shape[1]
        for t in range(t0, t1):
            n = t // c_n
            c = t - n * c_n
            _max_plane(x[n, c], out[n, c], geo, dense)

    return max_pool


@jit_inline
def _avg_plane(xp: Any, op: Any, geo: Any, include_pad: bool, dense: bool) -> None:
    kh_n, kw_n, sh, sw, ph, pw = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
    height, width = xp.shape
    ow_n = op.shape[1]
    u_sw = np.uint64(sw)
    for oh in range(op.shape[0]):
        h0 = oh * sh - ph
        h1 = min(h0 + kh_n, height + ph)
        hs, he = max(h0, 0), min(h1, height)
        orow = row_of(op, oh, dense)
        for ow in range(ow_n):
            orow[ow] = 0.0
        for ih in range(hs, he):
            xrow = row_of(xp, ih, dense)
            for kw in range(kw_n):
                off = kw - pw
                lo, hi = ow_range(off, sw, width, ow_n)
                dst = orow[lo:]
                s0 = np.uint64(lo * sw + off)
                for u in range(np.uint64(hi - lo)):
                    dst[u] += xrow[s0 + u * u_sw]
        for ow in range(ow_n):
            w0 = ow * sw - pw
            w1 = min(w0 + kw_n, width + pw)
            ws, we = max(w0, 0), min(w1, width)
            div = (h1 - h0) * (w1 - w0) if include_pad else (he - hs) * (we - ws)
            orow[ow] = orow[ow] / div if div > 0 else 0.0


def _avg_pool_kernel(dense: bool) -> Any:
    @rows_only("x", "out")
    @jit
    def avg_pool(x: Any, out: Any, geo: Any, include_pad: bool, t0: int, t1: int) -> None:
        """Mean over each window, PyTorch's divisor (window clipped to the padded input, or to the input),
        planes t0 <= t < t1. Each window tap adds a shifted input row into the output row (unsigned indices:
        the row loop vectorizes; rows typed dense when ``dense``), then the row is divided element by element."""
        c_n = x.shape[1]
        for t in range(t0, t1):
            n = t // c_n
            c = t - n * c_n
            _avg_plane(x[n, c], out[n, c], geo, include_pad, dense)

    return avg_pool


MAX_POOL = by_density(_max_pool_kernel)
AVG_POOL = by_density(_avg_pool_kernel)


@jit
def adaptive_avg_pool(x: Any, out: Any, t0: int, t1: int) -> None:
    """Mean over rows [floor(i*H/OH), ceil((i+1)*H/OH)) and likewise for columns, planes t0 <= t < t1."""
    c_n, height, width = x.shape[1], x.shape[2], x.shape[3]
    oh_n, ow_n = out.shape[2], out.shape[3]
    for t in range(t0, t1):
        n = t // c_n
        c = t - n * c_n
        for oh in range(oh_n):
            hs = (oh * height) // oh_n
            he = -((-(oh + 1) * height) // oh_n)
            for ow in range(ow_n):
                ws = (ow * width) // ow_n
                we = -((-(ow + 1) * width) // ow_n)
                s = 0.0
                for ih in range(hs, he):
                    for iw in range(ws, we):
                        s += x[n, c, ih, iw]
                out[n, c, oh, ow] = s / ((he - hs) * (we - ws))


def build_pool(kind: str, x: Any, out: Any, geo: tuple[int, ...], include_pad: bool) -> Launch:
    """The launch of pooling ``kind`` (max / avg / adaptive) of ``x`` into ``out`` (logical NCHW views): ranges
    of (N, C) planes on helper threads when the windows read at least PARALLEL_MIN elements."""
    if out.size == 0:
        return lambda _: None
    g = np.array(geo, np.int64)
    planes = out.shape[0] * out.shape[1]
    if kind in ("max", "avg"):
        window = geo[0] * geo[1]
    else:  # adaptive: the largest window
        window = -(-x.shape[2] // out.shape[2]) * -(-x.shape[3] // out.shape[3])
    ranges = split_range(planes, fanout_parts() if out.size * window >= PARALLEL_MIN else 1)
    if kind == "max":
        k = entry(MAX_POOL[rows_dense(x, out)], x, out, g, 0, 0)
        return launcher([functools.partial(k, x, out, g, lo, hi) for lo, hi in ranges])
    if kind == "avg":
        k = entry(AVG_POOL[rows_dense(x, out)], x, out, g, include_pad, 0, 0)
        return launcher([functools.partial(k, x, out, g, include_pad, lo, hi) for lo, hi in ranges])
    k = entry(adaptive_avg_pool, x, out, 0, 0)
    return launcher([functools.partial(k, x, out, lo, hi) for lo, hi in ranges])
