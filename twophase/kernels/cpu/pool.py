"""Pooling kernels on logical NCHW views (NHWC passed transposed), parallel over (N, C); no workspace."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
import numpy as np

from .jit import FAST, entry

Launch = Callable[[Any], None]
jit_par = numba.njit(nogil=True, cache=True, parallel=True, fastmath=FAST)


@jit_par
def max_pool(x: Any, out: Any, geo: Any) -> None:
    """Max over each window (``geo`` = KH, KW, sh, sw, ph, pw, dh, dw); NaN propagates."""
    kh_n, kw_n, sh, sw, ph, pw, dh, dw = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5], geo[6], geo[7]
    n_n, c_n, height, width = x.shape
    oh_n, ow_n = out.shape[2], out.shape[3]
    for t in numba.prange(n_n * c_n):
        n = t // c_n
        c = t - n * c_n
        for oh in range(oh_n):
            for ow in range(ow_n):
                m = -np.inf
                for kh in range(kh_n):
                    ih = oh * sh - ph + kh * dh
                    if ih < 0 or ih >= height:
                        continue
                    for kw in range(kw_n):
                        iw = ow * sw - pw + kw * dw
                        if 0 <= iw < width:
                            v = x[n, c, ih, iw]
                            if v > m or v != v:
                                m = v
                out[n, c, oh, ow] = m


@jit_par
def avg_pool(x: Any, out: Any, geo: Any, include_pad: bool) -> None:
    """Mean over each window, PyTorch's divisor (window clipped to the padded input, or to the input)."""
    kh_n, kw_n, sh, sw, ph, pw = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
    n_n, c_n, height, width = x.shape
    oh_n, ow_n = out.shape[2], out.shape[3]
    for t in numba.prange(n_n * c_n):
        n = t // c_n
        c = t - n * c_n
        for oh in range(oh_n):
            h0 = oh * sh - ph
            h1 = min(h0 + kh_n, height + ph)
            hs, he = max(h0, 0), min(h1, height)
            for ow in range(ow_n):
                w0 = ow * sw - pw
                w1 = min(w0 + kw_n, width + pw)
                ws, we = max(w0, 0), min(w1, width)
                s = 0.0
                for ih in range(hs, he):
                    for iw in range(ws, we):
                        s += x[n, c, ih, iw]
                div = (h1 - h0) * (w1 - w0) if include_pad else (he - hs) * (we - ws)
                out[n, c, oh, ow] = s / div if div > 0 else 0.0


@jit_par
def adaptive_avg_pool(x: Any, out: Any) -> None:
    """Mean over rows [floor(i*H/OH), ceil((i+1)*H/OH)) and likewise for columns."""
    n_n, c_n, height, width = x.shape
    oh_n, ow_n = out.shape[2], out.shape[3]
    for t in numba.prange(n_n * c_n):
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
    """The launch of pooling ``kind`` (max / avg / adaptive_avg) of ``x`` into ``out`` (logical NCHW views)."""
    if out.size == 0:
        return lambda _: None
    g = np.array(geo, np.int64)
    if kind == "max":
        k = entry(max_pool, x, out, g)
        return lambda _: k(x, out, g)
    if kind == "avg":
        k = entry(avg_pool, x, out, g, include_pad)
        return lambda _: k(x, out, g, include_pad)
    k = entry(adaptive_avg_pool, x, out)
    return lambda _: k(x, out)
