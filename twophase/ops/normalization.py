"""Softmax / log-softmax over one dim (rows tiled for cache, long rows split into blocks with partials in
the workspace), layer_norm, rms_norm, batch_norm (inference) and group_norm."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ParamError
from ..kernels.cpu import streaming
from ..kernels.cpu.half import cast_copy
from ..kernels.cpu.jit import entry
from ..kernels.cpu.norm import AFFINE, LAYER_NORM_ROWS, SHORT_ROW_BYTES, build_norm
from ..kernels.cpu.softmax import LOG_SOFTMAX, SOFTMAX, build_softmax, packed_scratch_len
from ..layout import align, as_matrix, as_rows, merge_dims, rows_split
from ..op import Attr, OpDef, Plan, register
from ..runtime.fanout import fanout_parts
from ..tensor import DType, TensorDesc
from .checks import FLOATS, as_dims, as_finite, as_int, check_dtype, need, norm_dim
from .reduce import check_vector_out
from .selection import Candidate, choose

LONG_ROW = 32768  # rows longer than this are split across blocks
SPLIT_BYTES = 8192  # bytes per block of a split row (2048 float32 elements): block t + 1, read for its max in block
# t's exp loop, is still in L1 for its own. Two threads, new/old (/tmp/w49/pkb.py, pkbd.py of the forty-ninth
# session): float32 blocks of 8192 elements ran 1.08-1.18x slower on rows of 262144 and 1.3x on rows of 41943;
# float64 blocks of 2048 elements 1.04-1.12x slower than of 1024
PARALLEL_MIN = 1 << 20  # elements below which one thread does all rows (handing parts to helpers costs ~50 us)


@dataclass(frozen=True)
class SoftmaxTiling:
    """Softmax as ``rows`` x ``length``; ``split`` blocks of ``block`` elements per row (1 = whole rows).
    ``threads`` parts for helper threads (1 below ``PARALLEL_MIN`` elements), each a range of rows, or (split
    rows, not ``by_rows``: fewer rows than parts share out evenly) a range of blocks."""

    rows: int
    length: int
    split: int
    block: int
    pack: bool
    pack_offset: int
    parallel: bool
    workspace: int
    by_rows: bool = True
    threads: int = 1  # parts, each with its own scratch row
    scratch_offset: int = 0  # packed log-softmax: one scratch row (N > 256, or a block when split) per part
    scratch_len: int = 0
    part_offset: int = 0  # where the split rows' (max, sum) partials start


def plan_softmax(
    x: TensorDesc, out: TensorDesc, dim: int, threads: int | None = None, log: bool = False, split_rows: bool = True
) -> SoftmaxTiling:
    """Tiling and exact workspace of (log-)softmax of ``x`` over ``dim`` (K rows of length N).

    workspace, in this order: for packed log-softmax only, T * align64(L * c) of scratch, one row of L = N
    elements when N > 256 (B when split; none for shorter rows, whose scratch rows are made at binding) per
    part (T = the helper threads' part count from 2^20 elements, else 1); then align64(K * ceil(N / B) * 16)
    when N > 32768 (a float64 (max, sum) per block of B = 8192 / c elements); then align64(K * N * c) when the
    operands are packed (float16, or other dims that do not merge into one stride); c = 4 for float16 (computed in
    float32), else the dtype's itemsize. ``split_rows=False`` keeps long rows whole (no partials: slower once a row
    leaves the cache, for a tighter workspace limit).
    """
    kept = [i for i in range(x.ndim) if i != dim]
    n = x.shape[dim] if x.ndim else 1
    k = 1
    for i in kept:
        k *= x.shape[i]
    item = 4 if x.dtype is DType.float16 else x.dtype.itemsize
    block = SPLIT_BYTES // item
    split = -(-n // block) if n > LONG_ROW and split_rows else 1
    parallel = k * n >= PARALLEL_MIN
    threads = (threads or fanout_parts()) if parallel else 1

    def mergeable(d: TensorDesc) -> bool:
        return merge_dims([d.shape[i] for i in kept], [d.strides[i] for i in kept]) is not None

    pack = (x.dtype is DType.float16 or not mergeable(x) or not mergeable(out)) and k * n > 0
    # packed log-softmax runs in place in the pack: rows finished at once or split need scratch rows for their exps
    # (first in the workspace; shorter rows' are made at binding)
    scratch_len = packed_scratch_len(n, split, block) if log and pack else 0
    ws = threads * align(scratch_len * item)  # each part's row on cache lines of its own
    part_offset = ws
    if split > 1:
        ws += align(k * split * 16)
    pack_offset = ws
    if pack:
        ws += align(k * n * item)
    by_rows = k >= 4 * threads or k % threads == 0  # else row ranges would be uneven: share out blocks
    return SoftmaxTiling(
        k, n, split, block, pack, pack_offset, parallel, ws, by_rows, threads, 0, scratch_len, part_offset
    )


def _softmax_infer(name: str) -> Any:
    def infer(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
        x = need(name, "x", ins[0])
        check_dtype(name, "x", x, FLOATS)
        norm_dim(name, "dim", attrs["dim"], x.ndim)
        return (TensorDesc(x.shape, x.dtype),)

    return infer


def _softmax_select(log: bool) -> Any:
    name = "log_softmax" if log else "softmax"

    def select(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
        x = ins[0]
        dim = norm_dim(name, "dim", attrs["dim"], x.ndim)
        cands = []
        for split_rows in (True, False):  # long rows split (fastest), else whole (no partials in the workspace)
            t = plan_softmax(x, outs[0], dim, log=log, split_rows=split_rows)
            impl = "split_rows" if t.split > 1 else ("rows_parallel" if t.parallel else "rows")
            cands.append(Candidate(impl, t, t.workspace))
            if t.split == 1:
                break
        return choose(name, cands, limit)

    return select


def _views(a: Any, dim: int, pack: bool) -> Any:
    if a.ndim == 0:
        a = a.reshape(1)
        dim = 0
    kept = tuple(i for i in range(a.ndim) if i != dim)
    if pack:
        return a.transpose(kept + (dim,))
    m = as_matrix(a, kept, (dim,))
    assert m is not None, "plan_softmax said it merges"
    return m


def _softmax_build(mode: int) -> Any:
    def build(plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]) -> Callable[[Any], None]:
        x, out = ins[0], outs[0]
        dim = attrs["dim"] % max(x.ndim, 1)
        t: SoftmaxTiling = plan.tiling
        return build_softmax(_views(x, dim, t.pack), _views(out, dim, t.pack), t, mode)

    return build


def _reference(x: Any, dim: int = -1) -> Any:
    x = np.asarray(x, np.float64)
    with np.errstate(all="ignore"):  # NaN / inf rows give NaN, as the kernels do
        m = np.max(x, axis=dim, keepdims=True) if x.size else x
        e = np.exp(x - m)
        return e / np.sum(e, axis=dim, keepdims=True)


def _log_reference(x: Any, dim: int = -1) -> Any:
    x = np.asarray(x, np.float64)
    with np.errstate(all="ignore"):
        m = np.max(x, axis=dim, keepdims=True) if x.size else x
        y = x - m
        return y - np.log(np.sum(np.exp(y), axis=dim, keepdims=True))


SOFTMAX_FORMULA = (
    "align64(K*ceil(N/B)*16) if N > 32768 else 0, B = 8192/c; + align64(K*N*c) if packed; c = 4 for float16, "
    "else itemsize"
)
LOG_SOFTMAX_FORMULA = SOFTMAX_FORMULA + (
    "; + T*align64(L*c) scratch if packed and N > 256, L = N (B if split), T = parts (helper threads) from 2^20 "
    "elements, else 1"
)
_SOFTMAX_DOC = (
    "{what} over ``dim`` (K rows of length N; dtypes float32, float64, float16 computed in float32). Rows of "
    "length N <= 32768 run whole, in cache (max; exp(x - max) stored and summed in float64; {last}) with "
    "workspace 0; longer rows are split into ceil(N/B) blocks of B = 8192/c elements (2048 for float32 and "
    "float16, 1024 for float64) whose float64 (max, sum) partials take align64(K * ceil(N/B) * 16) bytes of "
    "workspace and are merged per row (M = max m_b, "
    "S = sum s_b exp(m_b - M)). float16 operands, or operands whose other dims do not merge into one stride, "
    "are packed: + align64(K * N * c) bytes, c = 4 for float16 (computed in float32), else the dtype's itemsize. "
    "Workspace: " + SOFTMAX_FORMULA + "."
)

softmax = register(
    OpDef(
        name="softmax",
        inputs=("x",),
        attrs=(Attr("dim", as_int, -1, "the dim normalised over"),),
        dtypes=FLOATS,
        infer=_softmax_infer("softmax"),
        select=_softmax_select(log=False),
        kernels={"cpu": _softmax_build(SOFTMAX)},
        implementations=("rows", "rows_parallel", "split_rows"),
        aliases=(0,),
        workspace_formula=SOFTMAX_FORMULA,
        doc=_SOFTMAX_DOC.format(what="Softmax exp(x - max) / sum", last="scaled by 1/sum"),
        reference=_reference,
    )
)
log_softmax = register(
    OpDef(
        name="log_softmax",
        inputs=("x",),
        attrs=(Attr("dim", as_int, -1, "the dim normalised over"),),
        dtypes=FLOATS,
        infer=_softmax_infer("log_softmax"),
        select=_softmax_select(log=True),
        kernels={"cpu": _softmax_build(LOG_SOFTMAX)},
        implementations=("rows", "rows_parallel", "split_rows"),
        aliases=(0,),
        workspace_formula=LOG_SOFTMAX_FORMULA,
        doc=_SOFTMAX_DOC.format(
            what="Log-softmax (x - max) - log(sum exp(x - max))", last="written as (x - max) - log(sum)"
        ).replace("Workspace: " + SOFTMAX_FORMULA + ".", "")
        + "Log-softmax sums its exponentials in out (rewritten afterwards) where rows are longer than 256 "
        "elements; packed, where it runs in place in the pack, it takes scratch before the rest of its workspace "
        "instead: one row of L = N elements (B when split) per part run by a helper thread (T = the part count "
        "at planning from 2^20 elements, else 1), each on cache lines of its own. Called in place (out is x) "
        "unpacked, it keeps such rows from binding time, as do rows of up to 256 elements (both ops), whose "
        "exponentials stay in scratch rows in L1. "
        "Workspace: " + LOG_SOFTMAX_FORMULA + ".",
        reference=_log_reference,
    )
)


# ---- layer_norm / rms_norm
def _norm_shape(v: Any) -> tuple[int, ...]:
    dims: tuple[int, ...] = as_dims(v)
    return dims


_norm_shape.expects = "an int or a sequence of ints"  # type: ignore[attr-defined]


def _norm_infer(name: str) -> Any:
    def infer(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
        x = need(name, "x", ins[0])
        check_dtype(name, "x", x, FLOATS)
        ns = attrs["normalized_shape"]
        if not ns or x.shape[x.ndim - len(ns) :] != ns or len(ns) > x.ndim:
            raise ParamError(op=name, arg="normalized_shape", expected=f"trailing dims of {x.shape}", got=ns)
        for arg, d in zip(("weight", "bias"), ins[1:]):
            if d is not None and (d.shape != ns or d.dtype is not x.dtype):
                raise ParamError(
                    op=name,
                    arg=arg,
                    expected=f"shape {ns} dtype {x.dtype.value}",
                    got=f"shape {d.shape} dtype {d.dtype.value}",
                )
        stat = TensorDesc(
            x.shape[: x.ndim - len(ns)] + (1,) * len(ns), DType.float32 if x.dtype is DType.float16 else x.dtype
        )
        return (TensorDesc(x.shape, x.dtype), stat, stat)

    return infer


def _norm_pack(x: TensorDesc, out: TensorDesc, ws: tuple[TensorDesc | None, ...], nd: int) -> bool:
    def rows_ok(d: TensorDesc) -> bool:
        return all(
            merge_dims(list(s), list(t)) is not None
            for s, t in (
                (d.shape[: d.ndim - nd], d.strides[: d.ndim - nd]),
                (d.shape[d.ndim - nd :], d.strides[d.ndim - nd :]),
            )
        )

    return (
        x.dtype is DType.float16
        or not rows_ok(x)
        or not rows_ok(out)
        or any(w is not None and merge_dims(w.shape, w.strides) is None for w in ws)
    )


def _norm_select(name: str) -> Callable[[Any, Any, dict[str, Any], int | None], Plan]:
    def select(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
        for arg, stat in (("mean", outs[1]), ("rstd", outs[2])):  # written as (K,) vectors (a TypeError at bind)
            if stat is not None:
                check_vector_out(name, stat, arg)
        return _norm_plan(name, ins, outs, attrs, limit)

    return select


def _norm_plan(name: str, ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
    """'rows_packed' where the rows must be copied (float16, dims that do not merge); else 'rows', and
    'rows_streaming' (rows written with non-temporal stores, ``kernels/cpu/streaming.py``) where x, the output and
    weight / bias are dense float32 / float64, ranked first from outputs of ``streaming.stream_threshold()`` bytes
    whose rows are whole cache lines or at least ``norm.SHORT_ROW_BYTES``. Tiling: (pack, x area bytes, weight
    vector bytes, streaming)."""
    x = ins[0]
    nd = len(attrs["normalized_shape"])
    n = 1
    for s in attrs["normalized_shape"]:
        n *= s
    pack = x.numel > 0 and _norm_pack(x, outs[0], ins[1:], nd)
    item = 4 if x.dtype is DType.float16 else x.dtype.itemsize
    areas = (align(x.numel * item), align(n * item))
    if pack:
        return choose(name, [Candidate("rows_packed", (True, *areas, False), areas[0] + 2 * areas[1])], limit)
    rows = Candidate("rows", (False, *areas, False), 0)
    if not streaming.offered(x, *ins[1:], outs[0]):
        return choose(name, [rows], limit)
    stream = Candidate("rows_streaming", (False, *areas, True), 0)
    if n * item < SHORT_ROW_BYTES and n * item % streaming.LINE_BYTES:
        return choose(name, [rows, stream], limit)
    return choose(name, streaming.ranked(stream, rows, outs[0].nbytes), limit)


def _norm_build(rms: bool) -> Any:
    def build(plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]) -> Callable[[Any], None]:
        x, w, b = ins[0], ins[1], ins[2] if len(ins) > 2 else None
        out, mean, rstd = outs
        nd = len(attrs["normalized_shape"])
        pack, x_bytes, w_bytes, stream = plan.tiling
        compute = np.dtype(np.float32) if x.dtype == np.float16 else x.dtype
        n = int(np.prod(attrs["normalized_shape"]))
        lead, trail = tuple(range(x.ndim - nd)), tuple(range(x.ndim - nd, x.ndim))
        mean1 = as_matrix(mean, tuple(range(mean.ndim)), ())[:, 0]  # type: ignore[index]
        rstd1 = as_matrix(rstd, tuple(range(rstd.ndim)), ())[:, 0]  # type: ignore[index]
        if not pack:
            wv = None if w is None else as_matrix(w, (), tuple(range(w.ndim)))[0]  # type: ignore[index]
            bv = None if b is None else as_matrix(b, (), tuple(range(b.ndim)))[0]  # type: ignore[index]
            return build_norm(
                as_matrix(x, lead, trail),
                as_matrix(out, lead, trail),
                wv,
                bv,
                mean1,
                rstd1,
                attrs["eps"],
                rms,
                False,
                compute,
                stream,
            )
        inner = build_norm(x, out, None, None, mean1, rstd1, attrs["eps"], rms, True, compute)
        if w is None and b is None:
            return inner
        k = x.size // max(n, 1)
        rows = np.empty((1, 1), compute)  # x, out: ``rows_only``, so the specialization build_norm compiles
        ones, zeros = np.ones(n, compute), np.zeros(n, compute)  # constants for an absent weight or bias
        fn = entry(LAYER_NORM_ROWS[AFFINE][True], rows, ones, zeros, attrs["eps"], rms, rows, mean1, rstd1)

        def launch(ws: Any) -> None:
            area = ws[: x.size * compute.itemsize].view(compute)
            wv = ws[x_bytes : x_bytes + n * compute.itemsize].view(compute)
            bv = ws[x_bytes + w_bytes : x_bytes + w_bytes + n * compute.itemsize].view(compute)
            np.copyto(wv, ones if w is None else w.reshape(-1))
            np.copyto(bv, zeros if b is None else b.reshape(-1))
            cast_copy(area.reshape(x.shape), x)
            m = area.reshape(k, n)
            fn(m, wv, bv, attrs["eps"], rms, m, mean1, rstd1)
            cast_copy(out, area.reshape(out.shape))

        return launch if x.size else inner

    return build


def _ln_reference(
    x: Any, weight: Any = None, bias: Any = None, normalized_shape: Any = (), eps: float = 1e-5, rms: bool = False
) -> tuple[Any, Any, Any]:
    x = np.asarray(x, np.float64)
    axes = tuple(range(x.ndim - len(tuple(normalized_shape)), x.ndim))
    mu = np.zeros_like(x.sum(axis=axes, keepdims=True)) if rms else x.mean(axis=axes, keepdims=True)
    r = 1.0 / np.sqrt(((x - mu) ** 2).mean(axis=axes, keepdims=True) + eps)
    y = (x - mu) * r * (1.0 if weight is None else weight) + (0.0 if bias is None else bias)
    return y, mu, r


_LN_FORMULA = "0, or align64(numel*c) + 2*align64(N*c) when packed (c = 4 for float16, else itemsize)"
_STREAMING_DOC = (
    "'rows_streaming' writes the rows with vector stores that bypass the cache, for dense float32 / "
    "float64 operands; ranked first from outputs of the last-level cache's size (at most 64 MiB)."
)
register(
    OpDef(
        name="layer_norm",
        inputs=("x", "weight?", "bias?"),
        outputs=("out", "mean", "rstd"),
        attrs=(Attr("normalized_shape", _norm_shape), Attr("eps", as_finite, 1e-5)),
        dtypes=FLOATS,
        infer=_norm_infer("layer_norm"),
        select=_norm_select("layer_norm"),
        kernels={"cpu": _norm_build(False)},
        implementations=("rows", "rows_streaming", "rows_packed"),
        workspace_formula=_LN_FORMULA,
        doc=(
            "Layer norm over the trailing ``normalized_shape`` dims, row ranges on helper threads (float32 rows: "
            "sum and sum of squares of x - x[0] in one float64 pass (shifted by a sample: no cancellation from a "
            "large mean), then the write; float64 rows: sum, then squared deviations "
            "with their sum correcting the mean's rounding (a row of one value gives 0), write; each row in cache); "
            "mean / rstd outputs have the reduced dims as 1 "
            f"(float32 for float16). Workspace: {_LN_FORMULA} (float16, or dims that do not merge). " + _STREAMING_DOC
        ),
        reference=_ln_reference,
    )
)
register(
    OpDef(
        name="rms_norm",
        inputs=("x", "weight?"),
        outputs=("out", "mean", "rstd"),
        attrs=(Attr("normalized_shape", _norm_shape), Attr("eps", as_finite, 1e-6)),
        dtypes=FLOATS,
        infer=_norm_infer("rms_norm"),
        select=_norm_select("rms_norm"),
        kernels={"cpu": _norm_build(True)},
        implementations=("rows", "rows_streaming", "rows_packed"),
        workspace_formula=_LN_FORMULA,
        doc=(
            "RMS norm: out = x / sqrt(mean(x^2) + eps) * weight over the trailing ``normalized_shape`` dims; "
            f"the mean output is 0, rstd is 1/rms. Workspace: {_LN_FORMULA}. " + _STREAMING_DOC
        ),
        reference=lambda x, weight=None, normalized_shape=(), eps=1e-6: _ln_reference(
            x, weight, None, normalized_shape, eps, rms=True
        ),
    )
)


# ---- batch_norm (inference) / group_norm over channel dim 1
def _channel_infer(name: str, params: tuple[str, ...]) -> Any:
    def infer(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
        x = need(name, "x", ins[0])
        check_dtype(name, "x", x, FLOATS)
        if x.ndim < 2:
            raise ParamError(op=name, arg="x", expected="at least 2 dims (N, C, ...)", got=f"shape {x.shape}")
        c = x.shape[1]
        for arg, d in zip(params, ins[1:]):
            if arg in ("running_mean", "running_var"):
                d = need(name, arg, d)
            if d is not None and (d.shape != (c,) or d.dtype is not x.dtype):
                raise ParamError(
                    op=name,
                    arg=arg,
                    expected=f"shape {(c,)} dtype {x.dtype.value}",
                    got=f"shape {d.shape} dtype {d.dtype.value}",
                )
        if name == "group_norm":
            g = attrs["num_groups"]
            if g < 1 or c % g:
                raise ParamError(op=name, arg="num_groups", expected=f"a positive divisor of C = {c}", got=g)
        return (TensorDesc(x.shape, x.dtype),)

    return infer


def _compute(dt: DType) -> Any:
    return np.dtype(np.float32) if dt is DType.float16 else dt.np


def _bn_select(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
    x, out = ins[0], outs[0]
    k = rows_split(x.shape[2:], x.strides[2:], out.strides[2:])
    pack = x.numel > 0 and (x.dtype is DType.float16 or k is None)
    c = _compute(x.dtype).itemsize
    area, pvec = align(x.numel * c), align(x.shape[1] * c)
    return Plan("channels_packed" if pack else "channels", (pack, area, pvec, k), area + 4 * pvec if pack else 0)


def _bn_build(plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]) -> Callable[[Any], None]:
    from ..kernels.cpu.norm import build_batch_norm

    x, mean, var, w, b = (tuple(ins) + (None, None))[:5]
    pack, area, pvec, k = plan.tiling
    c = x.shape[1]
    w = np.ones(c, x.dtype) if w is None else w  # constants for absent weight / bias, made at bind
    b = np.zeros(c, x.dtype) if b is None else b
    if pack:
        return build_batch_norm(
            x, outs[0], (mean, var, w, b), attrs["eps"], True, _compute(DType.of(x.dtype)), area, pvec
        )
    return build_batch_norm(
        as_rows(x, 2, k), as_rows(outs[0], 2, k), (mean, var, w, b), attrs["eps"], False, x.dtype, 0, 0
    )


def _bn_reference(
    x: Any, running_mean: Any, running_var: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5
) -> Any:
    x = np.asarray(x, np.float64)
    shape = (1, -1) + (1,) * (x.ndim - 2)

    def p(v: Any, default: float) -> Any:
        return default if v is None else np.asarray(v, np.float64).reshape(shape)

    return (x - p(running_mean, 0.0)) / np.sqrt(p(running_var, 1.0) + eps) * p(weight, 1.0) + p(bias, 0.0)


_BN_FORMULA = "0, or align64(numel*c) + 4*align64(C*c) when packed (c = 4 for float16, else itemsize)"
register(
    OpDef(
        name="batch_norm",
        inputs=("x", "running_mean", "running_var", "weight?", "bias?"),
        attrs=(Attr("eps", as_finite, 1e-5),),
        dtypes=FLOATS,
        infer=_channel_infer("batch_norm", ("running_mean", "running_var", "weight", "bias")),
        select=_bn_select,
        kernels={"cpu": _bn_build},
        implementations=("channels", "channels_packed"),
        workspace_formula=_BN_FORMULA,
        doc=(
            "Batch norm for inference over channel dim 1 of an (N, C, ...) tensor (NC, NCL, NCHW, ...): "
            "out = (x - running_mean[c]) * weight[c] / sqrt(running_var[c] + eps) + bias[c] in one fused pass "
            "(parallel over (n, c) planes, vectorized along the plane or, for a crop of a wider image, along its "
            "rows; over rows of C channels when there is no spatial dim). dtypes float32, float64, float16 "
            f"(computed in float32). Workspace: {_BN_FORMULA}; packed = float16, or spatial dims that do not split "
            "into evenly spaced rows (x, the four parameters)."
        ),
        reference=_bn_reference,
    )
)


LONG_GROUP = 65536  # groups longer than this (C/G * S elements) are split across blocks
GROUP_BLOCK = 16384


@dataclass(frozen=True)
class GroupNormTiling:
    groups: int
    n_sp: int
    split: int
    block: int
    pack: bool
    pack_offset: int
    param_offset: int
    param_stride: int
    workspace: int
    rows_at: int | None  # layout.rows_split of a group's dims (None when packed)


def _group_dims(d: Any, groups: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and strides of one (n, group) slice of ``d``: (C/G, *spatial)."""
    return (d.shape[1] // groups, *d.shape[2:]), (d.strides[1], *d.strides[2:])


def plan_group_norm(x: TensorDesc, out: TensorDesc, groups: int) -> GroupNormTiling:
    """A group is L = C/G * S elements, as R rows of S' (``layout.rows_split`` of its dims: R = 1 when they walk
    memory with one stride). workspace = align64(N*G*B*24) when L > 65536, B blocks (of 16384 elements when
    R = 1, else of max(1, 16384 // S') whole rows) with a Welford (count, mean, M2) float64 partial each, else 0;
    + align64(numel*c) + 2*align64(C*c) when packed (float16, or group dims that split into no evenly spaced
    rows), c = 4 for float16 else itemsize."""
    n, c = x.shape[0], x.shape[1]
    n_sp = 1
    for s in x.shape[2:]:
        n_sp *= s
    length = c // groups * n_sp
    shape, xs = _group_dims(x, groups)
    k = rows_split(shape, xs, _group_dims(out, groups)[1])
    pack = x.numel > 0 and (x.dtype is DType.float16 or k is None)
    n_r = 1 if pack or k is None else math.prod(shape[:k])
    block = GROUP_BLOCK if n_r == 1 else max(1, GROUP_BLOCK // max(1, length // n_r))
    split = -(-(length if n_r == 1 else n_r) // block) if length > LONG_GROUP else 1
    ws = align(n * groups * split * 24) if split > 1 and x.numel else 0
    item = _compute(x.dtype).itemsize
    pack_offset = ws
    param_offset = pvec = 0
    if pack:
        param_offset = ws + align(x.numel * item)
        pvec = align(c * item)
        ws = param_offset + 2 * pvec
    return GroupNormTiling(groups, n_sp, split, block, pack, pack_offset, param_offset, pvec, ws, k)


def _gn_select(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
    t = plan_group_norm(ins[0], outs[0], attrs["num_groups"])
    return Plan(("split_groups" if t.split > 1 else "groups") + ("_packed" if t.pack else ""), t, t.workspace)


def _gn_build(plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]) -> Callable[[Any], None]:
    from ..kernels.cpu.groupnorm import build_group_norm

    x, w, b = (tuple(ins) + (None, None))[:3]
    t: GroupNormTiling = plan.tiling
    c = x.shape[1]
    w = np.ones(c, x.dtype) if w is None else w
    b = np.zeros(c, x.dtype) if b is None else b
    compute = _compute(DType.of(x.dtype))
    if t.pack:
        return build_group_norm(x, outs[0], w, b, t, attrs["eps"], compute)
    return build_group_norm(_grouped_rows(x, t), _grouped_rows(outs[0], t), w, b, t, attrs["eps"], compute)


def _grouped_rows(a: Any, t: GroupNormTiling) -> Any:
    """The (N, G, R, S) view of an (N, C, ...) array: group dims (C/G, ...) as rows (``t.rows_at``)."""
    n, c = a.shape[0], a.shape[1]
    assert t.rows_at is not None, "plan_group_norm packs groups that split into no rows"
    return as_rows(a.reshape((n, t.groups, c // t.groups, *a.shape[2:]), copy=False), 2, t.rows_at)


def _gn_reference(x: Any, weight: Any = None, bias: Any = None, num_groups: int = 1, eps: float = 1e-5) -> Any:
    x = np.asarray(x, np.float64)
    n, c = x.shape[0], x.shape[1]
    if x.size == 0:
        return x.copy()
    g = x.reshape(n, num_groups, -1)
    mu = g.mean(axis=2, keepdims=True)
    var = ((g - mu) ** 2).mean(axis=2, keepdims=True)
    y = ((g - mu) / np.sqrt(var + eps)).reshape(x.shape)
    shape = (1, c) + (1,) * (x.ndim - 2)
    return y * (1.0 if weight is None else np.asarray(weight, np.float64).reshape(shape)) + (
        0.0 if bias is None else np.asarray(bias, np.float64).reshape(shape)
    )


_GN_FORMULA = (
    "align64(N*G*B*24) if L = C/G*S > 65536 else 0, B = ceil(L/16384) blocks (ceil(R / max(1, 16384 // "
    "S')) blocks of whole rows when a group splits into R > 1 rows of S'); + align64(numel*c) + "
    "2*align64(C*c) when packed (c = 4 for float16, else itemsize)"
)
register(
    OpDef(
        name="group_norm",
        inputs=("x", "weight?", "bias?"),
        attrs=(Attr("num_groups", as_int), Attr("eps", as_finite, 1e-5)),
        dtypes=FLOATS,
        infer=_channel_infer("group_norm", ("weight", "bias")),
        select=_gn_select,
        kernels={"cpu": _gn_build},
        implementations=("groups", "split_groups", "groups_packed", "split_groups_packed"),
        workspace_formula=_GN_FORMULA,
        doc=(
            "Group norm of an (N, C, ...) tensor: channels split into ``num_groups`` groups of L = C/G * S "
            "elements; per (n, group) mean and variance in float64 (sum, then squared deviations and their sum, which "
            "corrects the mean's rounding: two passes over the group in cache), "
            "out = (x - mean) / sqrt(var + eps) * weight[c] + bias[c]; a crop of a wider image "
            "(group dims that split into R evenly spaced rows) row by row, not packed. Groups of L > 65536 "
            "are split into blocks of 16384 elements (or of whole rows) whose Welford partials (count, mean, M2) "
            "take 24 bytes each and merge "
            "per group (Chan: n = na + nb, d = mb - ma, mean = ma + d*nb/n, M2 = M2a + M2b + d^2*na*nb/n; "
            f"var = M2 / L). dtypes float32, float64, float16 (computed in float32). Workspace: {_GN_FORMULA}."
        ),
        reference=_gn_reference,
    )
)
