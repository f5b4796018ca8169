"""Softmax over one dim: rows tiled for cache, long rows split into blocks with partials in the workspace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..kernels.cpu.softmax import build_softmax
from ..layout import align, as_matrix, merge_dims
from ..op import Attr, OpDef, Plan, register
from ..tensor import DType, TensorDesc
from .checks import FLOATS, as_int, check_dtype, need, norm_dim

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
