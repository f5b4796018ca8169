"""Row normalizations over a (rows, n) view: layer norm and RMS norm, one row per task, kept in cache."""

from __future__ import annotations

import math
from typing import Any, Callable

import numba
import numpy as np

from .jit import FAST, entry

kern_par = numba.njit(nogil=True, cache=True, parallel=True, error_model="numpy", fastmath=FAST | {"reassoc"})


@kern_par
def layer_norm_rows(x: Any, w: Any, b: Any, eps: float, rms: bool, out: Any, mean: Any, rstd: Any) -> None:
    """Per row: mean (0 for RMS), rstd = 1/sqrt(mean((x - mean)^2) + eps), out = (x - mean) * rstd * w + b."""
    n = x.shape[1]
    for k in numba.prange(x.shape[0]):
        mu = 0.0
        if not rms:
            s = 0.0
            for i in range(n):
                s += x[k, i]
            mu = s / n
        v = 0.0
        for i in range(n):
            d = x[k, i] - mu
            v += d * d
        r = 1.0 / math.sqrt(v / n + eps)
        for i in range(n):
            out[k, i] = (x[k, i] - mu) * r * w[i] + b[i]
        mean[k] = mu
        rstd[k] = r


def build_norm(src: Any, dst: Any, w: Any, b: Any, mean: Any, rstd: Any, eps: float, rms: bool,
               pack: bool, compute: Any) -> Callable[[Any], None]:
    """Launch over (K, N) views, or through a dense ``compute`` copy of the rows in the workspace when ``pack``."""
    k, n = (src.shape[0], src.shape[1]) if not pack else (mean.size, src.size // max(mean.size, 1))
    if k * n == 0:
        return lambda _: (mean.fill(np.nan), rstd.fill(np.nan))  # type: ignore[func-returns-value]
    sample = np.empty((1, 1), compute) if pack else src
    fn = entry(layer_norm_rows, sample, w, b, eps, rms, sample if pack else dst, mean, rstd)
    if not pack:
        return lambda _: fn(src, w, b, eps, rms, dst, mean, rstd)  # type: ignore[no-any-return]
    nbytes = k * n * compute.itemsize

    def launch(ws: Any) -> None:
        area = ws[:nbytes].view(compute)
        np.copyto(area.reshape(src.shape), src, casting="unsafe")
        m = area.reshape(k, n)
        fn(m, w, b, eps, rms, m, mean, rstd)
        np.copyto(dst, area.reshape(dst.shape), casting="unsafe")
    return launch
