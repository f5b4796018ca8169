"""Row normalizations over a (rows, n) view: layer norm and RMS norm, each row kept in cache, row ranges on
helper threads."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numba
import numpy as np

from ...runtime.fanout import fanout_parts, launcher, run_parts, split_range, workspace_launcher
from . import jit as _jit
from .half import cast_copy
from .jit import FAST, by_density, entry, row_of, rows_dense, rows_only, wide_vectors
from .span_ir import span_moments, span_sum
from .streaming import LINE_BYTES, VECTOR_BYTES, aligned_head, element_aligned, sfence, store_normalized
from .vmath import corrected_moments, deviation_sums

Kernel = Callable[[Callable[..., Any]], Any]
jit: Kernel = _jit.jit  # the numba decorators, typed (jit.py leaves them untyped)
jit_inline: Kernel = _jit.jit_inline

kern = numba.njit(nogil=True, cache=True, error_model="numpy", fastmath=FAST | {"reassoc"})
FANOUT_MIN = 1 << 19  # elements from which the rows are cut into ranges for helper threads
# Rows shorter than this rank 'rows_streaming' first (``ops.normalization``) only when they are whole cache lines
# (row bytes a multiple of 64), and stream only where the bound output starts on a line (``build_norm``): a row's
# scalar head and tail would share lines with its non-temporal stores, which cost whole-line flushes. Zen 5 EPYC,
# 262144 x 64 float32, two threads: streamed 3.1 ms on a 64-byte aligned output, 7.6-11.5 ms on one 16 bytes off,
# plain 3.7-3.9 either way; rows of 1028 and 4100 elements (not whole lines) streamed faster than plain all the same
# (/tmp/w42/normab3.py of the forty-second session).
SHORT_ROW_BYTES = 4096


WEIGHT, BIAS = 1, 2  # the affine terms a row's write applies (``terms``): ``* w``, ``+ b``
AFFINE = WEIGHT | BIAS


def _layer_norm_kernel(dense: bool, stream: bool = False, terms: int = AFFINE) -> Any:
    @rows_only("x", "out")
    @kern
    def layer_norm_rows(x: Any, w: Any, b: Any, eps: float, rms: bool, out: Any, mean: Any, rstd: Any) -> None:
        """Per row: mean (0 for RMS), rstd = 1/sqrt(mean((x - mean)^2) + eps), out = (x - mean) * rstd * w + b
        in the data's precision (but x - mean in float64). Sums in float64: float32 data takes the sum and the
        sum of squares of y = x - x[0] in one pass (var = E[y^2] - E[y]^2: shifted by a sample, the cancellation
        is ~1e-16 * (E[y] / std)^2, not (mean / std)^2), float64 data two passes (the centred sum of squares,
        corrected: ``vmath.corrected_moments``);
        RMS sums x^2 (nothing cancels). Rows typed dense when
        ``dense`` (``jit.by_density``), so the loops vectorize when the matrix itself is not (rows of a wider
        array). With ``stream`` (dense rows, unit-stride w and b) the rows are written with non-temporal stores
        (``streaming.store_normalized``). ``terms`` (``WEIGHT`` | ``BIAS``, a closure constant): the affine terms
        applied; an absent one is never read (a weight and a bias as long as a 2^18-element row are 2 MiB more to
        read per row, through the cache the row needs)."""
        wide_vectors()
        for k in range(x.shape[0]):
            mu, r = _norm_row(row_of(x, k, dense), w, b, eps, rms, row_of(out, k, dense), stream, terms)
            mean[k] = mu
            rstd[k] = r
        if stream:
            sfence()

    return layer_norm_rows


@numba.njit(nogil=True, cache=True, error_model="numpy", fastmath=FAST | {"reassoc"}, inline="always")
def _norm_row(x: Any, w: Any, b: Any, eps: float, rms: bool, out: Any, stream: bool, terms: int) -> tuple[float, float]:
    """One row of ``layer_norm_rows``: writes it (whole vectors with non-temporal stores when ``stream``, a
    constant at the call), returns (mean, rstd)."""
    n = x.shape[0]
    if rms or x.itemsize <= 4:
        shift = 0.0 if rms else np.float64(x[0])
        s, q = span_moments(x, 0, n, shift)
        d = s / n
        mu = 0.0 if rms else shift + d
        var = q / n if rms else max(q / n - d * d, 0.0)
    else:
        s = span_sum(x, 0, n, 0.0)
        c, q = deviation_sums(x, s / n)
        mu, q = corrected_moments(n, s / n, c, q)
        var = q / n
    r = 1.0 / math.sqrt(var + eps)
    rr = x.dtype.type(r)
    first, last = 0, 0
    if stream:  # a scalar head up to out's first aligned vector, the vectors, then the scalar tail
        lanes = VECTOR_BYTES // out.itemsize
        first = aligned_head(out, n, VECTOR_BYTES)
        last = first + (n - first) // lanes * lanes
        for i in range(first, last, lanes):
            store_normalized(out, x, w, b, i, mu, r, terms)
    _write(x, w, b, mu, rr, out, 0, first, terms)
    _write(x, w, b, mu, rr, out, last, n, terms)
    return mu, r


@numba.njit(nogil=True, cache=True, error_model="numpy", fastmath=FAST | {"reassoc"}, inline="always")
def _write(x: Any, w: Any, b: Any, mu: float, rr: Any, out: Any, lo: int, hi: int, terms: int) -> None:
    """``out[lo:hi]`` of a normalized row: x - mean in float64 (exact for float32 x), rounded once (accurate when
    rstd is large), times rstd, then times the weight and plus the bias where ``terms`` says (one loop each)."""
    t = x.dtype.type
    if terms == AFFINE:
        for i in range(lo, hi):
            out[i] = t(np.float64(x[i]) - mu) * rr * w[i] + b[i]
    elif terms == WEIGHT:
        for i in range(lo, hi):
            out[i] = t(np.float64(x[i]) - mu) * rr * w[i]
    elif terms == BIAS:
        for i in range(lo, hi):
            out[i] = t(np.float64(x[i]) - mu) * rr + b[i]
    else:
        for i in range(lo, hi):
            out[i] = t(np.float64(x[i]) - mu) * rr


TERMS = range(AFFINE + 1)
LAYER_NORM_ROWS = {terms: by_density(functools.partial(_layer_norm_kernel, terms=terms)) for terms in TERMS}
LAYER_NORM_ROWS_STREAMING = {terms: _layer_norm_kernel(True, stream=True, terms=terms) for terms in TERMS}


def build_norm(
    src: Any,
    dst: Any,
    w: Any,
    b: Any,
    mean: Any,
    rstd: Any,
    eps: float,
    rms: bool,
    pack: bool,
    compute: Any,
    stream: bool = False,
) -> Callable[[Any], None]:
    """Launch over (K, N) views, or through a dense ``compute`` copy of the rows in the workspace when ``pack``;
    ``stream``: rows written with non-temporal stores, where every row of ``src`` and ``dst`` is dense, ``w`` / ``b``
    have unit stride and rows shorter than ``SHORT_ROW_BYTES`` start on cache lines (else the plain kernel).
    ``w`` / ``b`` None: absent, the kernel applies no such term (it is given ones / zeros made here, which it does
    not read)."""
    k, n = (src.shape[0], src.shape[1]) if not pack else (mean.size, src.size // max(mean.size, 1))
    terms = (WEIGHT if w is not None else 0) | (BIAS if b is not None else 0)
    w = np.ones(n, compute) if w is None else w
    b = np.zeros(n, compute) if b is None else b
    if k * n == 0:

        def empty(_: Any) -> None:
            mean.fill(0.0 if rms else np.nan)  # RMS norm's mean output is 0 by definition; a mean of nothing NaN
            rstd.fill(np.nan)

        return empty
    sample = np.empty((1, 1), compute) if pack else src
    stream = (
        stream
        and not pack
        and rows_dense(src, dst)
        and all(v.strides[0] == v.itemsize for v in (w, b))
        and element_aligned(dst)
        and (
            n * dst.itemsize >= SHORT_ROW_BYTES
            or (dst.ctypes.data % LINE_BYTES == 0 and dst.strides[0] % LINE_BYTES == 0)
        )
    )
    kernel = LAYER_NORM_ROWS_STREAMING[terms] if stream else LAYER_NORM_ROWS[terms][pack or rows_dense(src, dst)]
    fn = entry(kernel, sample, w, b, eps, rms, sample if pack else dst, mean, rstd)
    ranges = split_range(k, fanout_parts() if k * n >= FANOUT_MIN else 1)

    def parts(x: Any, out: Any) -> list[Callable[[], None]]:
        return [
            functools.partial(fn, x[lo:hi], w, b, eps, rms, out[lo:hi], mean[lo:hi], rstd[lo:hi]) for lo, hi in ranges
        ]

    if not pack:
        return launcher(parts(src, dst))
    nbytes = k * n * compute.itemsize

    def launch(ws: Any) -> None:
        area = ws[:nbytes].view(compute)
        cast_copy(area.reshape(src.shape), src)
        m = area.reshape(k, n)
        run_parts(parts(m, m))
        cast_copy(dst, area.reshape(dst.shape))

    return launch


# ---- batch norm (inference): out = (x - mean[c]) * w[c] / sqrt(var[c] + eps) + b[c] over an (N, C, R, S) view
@jit_inline  # inlined: called per row, and short rows cost less than a call
def _affine(x: Any, out: Any, mu: float, a: float, b: float) -> None:
    for i in range(x.shape[0]):
        out[i] = (x[i] - mu) * a + b


@jit_inline
def _affine_rows(x: Any, out: Any, mu: float, a: float, b: float, dense: bool) -> None:
    """_affine on every row of the (R, S) plane: ``dense`` (a constant at each call) types the rows dense."""
    for r in range(x.shape[0]):
        _affine(row_of(x, r, dense), row_of(out, r, dense), mu, a, b)


def _batch_norm_planes_kernel(dense: bool) -> Any:
    """One fused pass over the (n, c) planes k0 <= t < k1 (t = n * C + c) of an (N, C, R, S) view, R rows of S
    elements each (R > 1: a crop of a wider image), vectorized along the rows (typed dense when ``dense``, a
    closure constant: ``jit.by_density``)."""

    @rows_only("x", "out")
    @jit
    def batch_norm_planes(x: Any, mean: Any, var: Any, w: Any, b: Any, eps: float, out: Any, k0: int, k1: int) -> None:
        n_ch = x.shape[1]
        for t in range(k0, k1):
            k = t // n_ch
            c = t - k * n_ch
            a = w[c] / math.sqrt(var[c] + eps)
            _affine_rows(x[k, c], out[k, c], float(mean[c]), a, float(b[c]), dense)

    return batch_norm_planes


def _batch_norm_rows_kernel(dense: bool) -> Any:
    """One fused pass over the rows k0 <= k < k1 of an (N, C) input, vectorized over the channels, each
    channel's w / sqrt(var + eps) worked out once per call; rows typed dense when ``dense``."""

    @rows_only("x", "out")
    @jit
    def batch_norm_rows(x: Any, mean: Any, var: Any, w: Any, b: Any, eps: float, out: Any, k0: int, k1: int) -> None:
        n_ch = x.shape[1]
        scale = np.empty(n_ch)
        for c in range(n_ch):
            scale[c] = w[c] / math.sqrt(var[c] + eps)
        for k in range(k0, k1):
            xr, orow = row_of(x, k, dense), row_of(out, k, dense)
            for c in range(n_ch):
                orow[c] = (xr[c] - mean[c]) * scale[c] + b[c]

    return batch_norm_rows


BATCH_NORM_PLANES = by_density(_batch_norm_planes_kernel)
BATCH_NORM_ROWS = by_density(_batch_norm_rows_kernel)


def _batch_norm_parts(x: Any, out: Any, params: tuple[Any, ...], eps: float, parts: int) -> list[Callable[[], None]]:
    """The parts of a batch norm of the (N, C, R, S) view ``x`` into ``out``: ranges of the N rows of C channels
    when R * S == 1, else of the N * C planes. Compiled here (phase 1) for these arrays' types."""
    n, c, r, s = x.shape
    if r * s == 1:
        x, out = x[:, :, 0, 0], out[:, :, 0, 0]
        kernel, tasks = BATCH_NORM_ROWS[rows_dense(x, out)], n
    else:
        kernel, tasks = BATCH_NORM_PLANES[rows_dense(x, out)], n * c
    fn = entry(kernel, x, *params, eps, out, 0, 0)
    return [functools.partial(fn, x, *params, eps, out, lo, hi) for lo, hi in split_range(tasks, parts)]


def build_batch_norm(
    src: Any, dst: Any, params: tuple[Any, ...], eps: float, pack: bool, compute: Any, p_offset: int, p_stride: int
) -> Callable[[Any], None]:
    """Launch over (N, C, R, S) views ``src`` / ``dst``; when ``pack`` (float16, or spatial dims that do not
    split into evenly spaced rows) they are the N-d operands, copied through a dense ``compute`` area at the
    start of the workspace, and the four (C,) parameters (mean, var, weight, bias) through ``compute`` vectors
    at ``p_offset + i * p_stride``. Ranges of rows or planes go to helper threads from ``FANOUT_MIN``
    elements."""
    if src.size == 0:
        return lambda _: None
    parts = fanout_parts() if src.size >= FANOUT_MIN else 1
    if not pack:
        return launcher(_batch_norm_parts(src, dst, params, eps, parts))
    n_ch = src.shape[1]
    shape4 = (src.shape[0], n_ch, 1, src.size // max(src.shape[0] * n_ch, 1))
    nbytes, pbytes = src.size * compute.itemsize, n_ch * compute.itemsize
    sample = np.empty((1, 1, 1, 1 if shape4[3] == 1 else 2), compute)  # typed as the workspace's views
    _batch_norm_parts(sample, sample, (np.empty(1, compute),) * len(params), eps, parts)  # compiled now

    def bind(ws: Any) -> Callable[[], None]:
        area = ws[:nbytes].view(compute)
        vectors = tuple(
            ws[p_offset + i * p_stride : p_offset + i * p_stride + pbytes].view(compute) for i in range(len(params))
        )
        a4 = area.reshape(shape4)
        calls = _batch_norm_parts(a4, a4, vectors, eps, parts)

        def work() -> None:
            cast_copy(area.reshape(src.shape), src)
            for v, p in zip(vectors, params):
                cast_copy(v, p)
            run_parts(calls)
            cast_copy(dst, area.reshape(src.shape))

        return work

    return workspace_launcher(bind)
