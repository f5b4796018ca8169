"""Softmax over one dim: rows tiled for cache, long rows split into blocks with partials in the workspace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import ParamError
from ..kernels.cpu.jit import entry
from ..kernels.cpu.norm import build_norm
from ..kernels.cpu.softmax import build_softmax
from ..layout import align, as_matrix, merge_dims
from ..op import Attr, OpDef, Plan, register
from ..tensor import DType, TensorDesc
from .checks import FLOATS, as_dims, as_float, as_int, check_dtype, need, norm_dim

LONG_ROW = 32768  # rows longer than this are split across blocks
SPLIT_BLOCK = 8192  # elements per block of a split row
PARALLEL_MIN = 1 << 18  # elements below which one thread does all rows


@dataclass(frozen=True)
class SoftmaxTiling:
    """Softmax as ``rows`` x ``length``; ``split`` blocks of ``block`` elements per row (1 = whole rows)."""

    rows: int
    length: int
    split: int
    block: int
    pack: bool
    pack_offset: int
    parallel: bool
    workspace: int


def plan_softmax(x: TensorDesc, out: TensorDesc, dim: int) -> SoftmaxTiling:
    """Tiling and exact workspace of softmax of ``x`` over ``dim``.

    workspace = align64(K * nb * 16) when N > 32768 (nb = ceil(N / 8192) blocks, a float64 (max, sum)
    each), else 0; plus align64(K * N * 4 or itemsize) when the operands must be packed (float16, or
    dims that do not merge into a (K, N) view).
    """
    kept = [i for i in range(x.ndim) if i != dim]
    n = x.shape[dim] if x.ndim else 1
    k = 1
    for i in kept:
        k *= x.shape[i]
    split = -(-n // SPLIT_BLOCK) if n > LONG_ROW else 1
    ws = align(k * split * 16) if split > 1 else 0

    def mergeable(d: TensorDesc) -> bool:
        return merge_dims([d.shape[i] for i in kept], [d.strides[i] for i in kept]) is not None
    pack = (x.dtype is DType.float16 or not mergeable(x) or not mergeable(out)) and k * n > 0
    pack_offset = ws
    if pack:
        ws += align(k * n * (4 if x.dtype is DType.float16 else x.dtype.itemsize))
    return SoftmaxTiling(k, n, split, SPLIT_BLOCK, pack, pack_offset, k * n >= PARALLEL_MIN, ws)


def _infer(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
    x = need("softmax", "x", ins[0])
    check_dtype("softmax", "x", x, FLOATS)
    norm_dim("softmax", "dim", attrs["dim"], x.ndim)
    return (TensorDesc(x.shape, x.dtype),)


def _select(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
    x = ins[0]
    t = plan_softmax(x, outs[0], norm_dim("softmax", "dim", attrs["dim"], x.ndim))
    impl = "split_rows" if t.split > 1 else ("rows_parallel" if t.parallel else "rows")
    return Plan(impl, t, t.workspace)


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


def _build(plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]) -> Callable[[Any], None]:
    x, out = ins[0], outs[0]
    dim = attrs["dim"] % max(x.ndim, 1)
    t: SoftmaxTiling = plan.tiling
    return build_softmax(_views(x, dim, t.pack), _views(out, dim, t.pack), t)


def _reference(x: Any, dim: int) -> Any:
    x = np.asarray(x, np.float64)
    m = np.max(x, axis=dim, keepdims=True) if x.size else x
    e = np.exp(x - m)
    return e / np.sum(e, axis=dim, keepdims=True)


softmax = register(OpDef(
    name="softmax",
    inputs=("x",),
    attrs=(Attr("dim", as_int, -1, "the dim normalised over"),),
    dtypes=FLOATS,
    infer=_infer,
    select=_select,
    kernels={"cpu": _build},
    implementations=("rows", "rows_parallel", "split_rows"),
    workspace_formula="align64(K*ceil(N/8192)*16) if N > 32768 else 0; + align64(K*N*4) if packed",
    doc=("Softmax over ``dim``. Rows of length N <= 32768 run whole (max, exp-sum, scale) with workspace 0; "
         "longer rows are split into ceil(N/8192) blocks whose float64 (max, sum) partials take "
         "align64(K * ceil(N/8192) * 16) bytes of workspace and are merged per row. float16 operands, or "
         "operands whose other dims do not merge into one stride, are packed: + align64(K * N * 4) bytes."),
    reference=_reference,
))


# ---- layer_norm / rms_norm
def _norm_shape(v: Any) -> tuple[int, ...]:
    return as_dims(v)


_norm_shape.expects = "an int or a sequence of ints"  # type: ignore[attr-defined]


def _norm_infer(name: str) -> Any:
    def infer(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
        x = need(name, "x", ins[0])
        check_dtype(name, "x", x, FLOATS)
        ns = attrs["normalized_shape"]
        if not ns or x.shape[x.ndim - len(ns):] != ns or len(ns) > x.ndim:
            raise ParamError(op=name, arg="normalized_shape", expected=f"trailing dims of {x.shape}", got=ns)
        for arg, d in zip(("weight", "bias"), ins[1:]):
            if d is not None and (d.shape != ns or d.dtype is not x.dtype):
                raise ParamError(op=name, arg=arg, expected=f"shape {ns} dtype {x.dtype.value}",
                                 got=f"shape {d.shape} dtype {d.dtype.value}")
        stat = TensorDesc(x.shape[:x.ndim - len(ns)] + (1,) * len(ns),
                          DType.float32 if x.dtype is DType.float16 else x.dtype)
        return (TensorDesc(x.shape, x.dtype), stat, stat)
    return infer


def _norm_pack(x: TensorDesc, out: TensorDesc, ws: tuple[TensorDesc | None, ...], nd: int) -> bool:
    def rows_ok(d: TensorDesc) -> bool:
        return all(merge_dims(list(s), list(t)) is not None for s, t in
                   ((d.shape[:d.ndim - nd], d.strides[:d.ndim - nd]), (d.shape[d.ndim - nd:], d.strides[d.ndim - nd:])))
    return x.dtype is DType.float16 or not rows_ok(x) or not rows_ok(out) or any(
        w is not None and merge_dims(w.shape, w.strides) is None for w in ws)


def _norm_select(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
    x = ins[0]
    nd = len(attrs["normalized_shape"])
    n = 1
    for s in attrs["normalized_shape"]:
        n *= s
    pack = x.numel > 0 and _norm_pack(x, outs[0], ins[1:], nd)
    item = 4 if x.dtype is DType.float16 else x.dtype.itemsize
    ws = align(x.numel * item) + 2 * align(n * item) if pack else 0
    return Plan("rows_packed" if pack else "rows", (pack, align(x.numel * item), align(n * item)), ws)


def _norm_build(rms: bool) -> Any:
    def build(plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]) -> Callable[[Any], None]:
        x, w, b = ins[0], ins[1], ins[2] if len(ins) > 2 else None
        out, mean, rstd = outs
        nd = len(attrs["normalized_shape"])
        pack, x_bytes, w_bytes = plan.tiling
        compute = np.dtype(np.float32) if x.dtype == np.float16 else x.dtype
        n = int(np.prod(attrs["normalized_shape"]))
        lead, trail = tuple(range(x.ndim - nd)), tuple(range(x.ndim - nd, x.ndim))
        mean1 = as_matrix(mean, tuple(range(mean.ndim)), ())[:, 0]  # type: ignore[index]
        rstd1 = as_matrix(rstd, tuple(range(rstd.ndim)), ())[:, 0]  # type: ignore[index]
        ones, zeros = np.ones(n, compute), np.zeros(n, compute)  # constants for absent weight / bias, made at bind
        if not pack:
            wv = ones if w is None else as_matrix(w, (), tuple(range(w.ndim)))[0]  # type: ignore[index]
            bv = zeros if b is None else as_matrix(b, (), tuple(range(b.ndim)))[0]  # type: ignore[index]
            return build_norm(as_matrix(x, lead, trail), as_matrix(out, lead, trail), wv, bv, mean1, rstd1,
                              attrs["eps"], rms, False, compute)
        inner = build_norm(x, out, ones, zeros, mean1, rstd1, attrs["eps"], rms, True, compute)
        if w is None and b is None:
            return inner
        k = x.size // max(n, 1)
        rows = np.empty((1, 1), compute)
        from ..kernels.cpu.norm import layer_norm_rows
        fn = entry(layer_norm_rows, rows, ones, zeros, attrs["eps"], rms, rows, mean1, rstd1)

        def launch(ws: Any) -> None:
            area = ws[:x.size * compute.itemsize].view(compute)
            wv = ws[x_bytes:x_bytes + n * compute.itemsize].view(compute)
            bv = ws[x_bytes + w_bytes:x_bytes + w_bytes + n * compute.itemsize].view(compute)
            np.copyto(wv, ones if w is None else w.reshape(-1))
            np.copyto(bv, zeros if b is None else b.reshape(-1))
            np.copyto(area.reshape(x.shape), x, casting="unsafe")
            m = area.reshape(k, n)
            fn(m, wv, bv, attrs["eps"], rms, m, mean1, rstd1)
            np.copyto(out, area.reshape(out.shape), casting="unsafe")
        return launch if x.size else inner
    return build


def _ln_reference(x: Any, weight: Any = None, bias: Any = None, normalized_shape: Any = (), eps: float = 1e-5,
                  rms: bool = False) -> tuple[Any, Any, Any]:
    x = np.asarray(x, np.float64)
    axes = tuple(range(x.ndim - len(tuple(normalized_shape)), x.ndim))
    mu = np.zeros_like(x.sum(axis=axes, keepdims=True)) if rms else x.mean(axis=axes, keepdims=True)
    r = 1.0 / np.sqrt(((x - mu) ** 2).mean(axis=axes, keepdims=True) + eps)
    y = (x - mu) * r * (1.0 if weight is None else weight) + (0.0 if bias is None else bias)
    return y, mu, r


_LN_FORMULA = "0, or align64(numel*c) + 2*align64(N*c) when packed (c = 4 for float16, else itemsize)"
register(OpDef(
    name="layer_norm", inputs=("x", "weight?", "bias?"), outputs=("out", "mean", "rstd"),
    attrs=(Attr("normalized_shape", _norm_shape), Attr("eps", as_float, 1e-5)),
    dtypes=FLOATS, infer=_norm_infer("layer_norm"), select=_norm_select, kernels={"cpu": _norm_build(False)},
    implementations=("rows", "rows_packed"), workspace_formula=_LN_FORMULA,
    doc=("Layer norm over the trailing ``normalized_shape`` dims, one row per parallel task (sum, squared "
         "deviations, write: three passes over a row in cache); mean / rstd outputs have the reduced dims as 1 "
         f"(float32 for float16). Workspace: {_LN_FORMULA} (float16, or dims that do not merge)."),
    reference=_ln_reference))
register(OpDef(
    name="rms_norm", inputs=("x", "weight?"), outputs=("out", "mean", "rstd"),
    attrs=(Attr("normalized_shape", _norm_shape), Attr("eps", as_float, 1e-6)),
    dtypes=FLOATS, infer=_norm_infer("rms_norm"), select=_norm_select, kernels={"cpu": _norm_build(True)},
    implementations=("rows", "rows_packed"), workspace_formula=_LN_FORMULA,
    doc=("RMS norm: out = x / sqrt(mean(x^2) + eps) * weight over the trailing ``normalized_shape`` dims; "
         f"the mean output is 0, rstd is 1/rms. Workspace: {_LN_FORMULA}."),
    reference=lambda x, weight=None, normalized_shape=(), eps=1e-6: _ln_reference(x, weight, None, normalized_shape,
                                                                                   eps, rms=True)))
