"""Reductions over any set of dims, as multi-level block trees whose partials live in the workspace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import ParamError
from ..kernels.cpu.reduce import build_tree
from ..layout import align, as_matrix, merge_dims
from ..op import Attr, OpDef, Plan, register
from ..tensor import DType, TensorDesc
from .checks import NUMERIC, as_bool, as_dims, check_dtype, need, norm_dims

BLOCK = 4096  # elements summed by one task of a level
PARALLEL_MIN = 1 << 20  # elements below which one thread does the whole level


@dataclass(frozen=True)
class ReduceTiling:
    """A reduction as a (kept K, reduced R) matrix summed block by block, level by level.

    ``levels`` are the partial counts per row after each non-final level and ``offsets`` their byte
    offsets in the workspace; ``pack`` means the input is first copied densely to ``pack_offset``.
    """

    kept: int
    reduced: int
    block: int
    levels: tuple[int, ...]
    offsets: tuple[int, ...]
    pack: bool
    pack_offset: int
    parallel: bool
    workspace: int


def tree_levels(reduced: int, block: int) -> tuple[int, ...]:
    """Partial counts per row after each level that is not the last: ceil(n / block) while n > block."""
    levels = []
    n = reduced
    while n > block:
        n = -(-n // block)
        levels.append(n)
    return tuple(levels)


def reduce_dims(op: str, x: TensorDesc, dims: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(reduced dims, kept dims); an empty ``dims`` reduces every dim."""
    red = norm_dims(op, "dims", dims, x.ndim) if dims else tuple(range(x.ndim))
    if x.ndim == 0:
        red = ()
    return red, tuple(i for i in range(x.ndim) if i not in red)


def reduced_desc(x: TensorDesc, red: tuple[int, ...], keep_dims: bool, dtype: DType) -> TensorDesc:
    shape = tuple(1 if i in red else n for i, n in enumerate(x.shape)) if keep_dims \
        else tuple(n for i, n in enumerate(x.shape) if i not in red)
    return TensorDesc(shape, dtype)


def _prod(v: list[int]) -> int:
    out = 1
    for n in v:
        out *= n
    return out


def plan_tree(x: TensorDesc, red: tuple[int, ...], kept: tuple[int, ...], acc_bytes: int, pack_bytes: int,
              block: int = BLOCK) -> ReduceTiling:
    """Tiling and exact workspace of a tree reduction of ``x`` over ``red``.

    workspace = sum over levels of align64(K * n_level * acc_bytes), plus align64(K * R * pack_bytes) when
    the input cannot be viewed as a (K, R) matrix or is float16 (the kernels read float32).
    """
    k_rows = _prod([x.shape[i] for i in kept])
    r = _prod([x.shape[i] for i in red])
    levels = tree_levels(r, block)
    offsets, off = [], 0
    for n in levels:
        offsets.append(off)
        off += align(k_rows * n * acc_bytes)
    pack = x.dtype is DType.float16 or (
        merge_dims([x.shape[i] for i in kept], [x.strides[i] for i in kept]) is None
        or merge_dims([x.shape[i] for i in red], [x.strides[i] for i in red]) is None)
    pack = pack and k_rows * r > 0
    pack_offset = off
    if pack:
        off += align(k_rows * r * pack_bytes)
    return ReduceTiling(k_rows, r, block, levels, tuple(offsets), pack, pack_offset,
                        k_rows * r >= PARALLEL_MIN, off)


def check_vector_out(op: str, out: TensorDesc) -> None:
    """Reduction outputs are written as a (K,) vector: a strided ``out`` must still walk with one stride."""
    if merge_dims(out.shape, out.strides) is None:
        raise ParamError(op=op, arg="out", expected="an output whose dims merge into one strided vector",
                         got=out)


def source_view(x: Any, red: tuple[int, ...], kept: tuple[int, ...], pack: bool) -> Any:
    """What the tree launch reads: the (K, R) matrix view, or the (kept, reduced)-permuted input to pack."""
    if pack:
        return x.transpose(kept + red)
    m = as_matrix(x, kept, red)
    assert m is not None, "plan_tree said the input is a matrix view"
    return m


def out_column(out: Any) -> Any:
    """The (K, 1) view of a reduction output."""
    m = as_matrix(out, tuple(range(out.ndim)), ())
    assert m is not None, "check_vector_out accepted it"
    return m


def _sum_dtype(x: TensorDesc) -> DType:
    return x.dtype if x.dtype.is_float else DType.int64


def _infer_sum(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
    x = need("reduce_sum", "x", ins[0])
    check_dtype("reduce_sum", "x", x, NUMERIC + (DType.bool,))
    red, _ = reduce_dims("reduce_sum", x, attrs["dims"])
    return (reduced_desc(x, red, attrs["keep_dims"], _sum_dtype(x)),)


def _select_sum(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
    x = ins[0]
    check_vector_out("reduce_sum", outs[0])
    red, kept = reduce_dims("reduce_sum", x, attrs["dims"])
    pack_bytes = 4 if x.dtype is DType.float16 else x.dtype.itemsize
    t = plan_tree(x, red, kept, 8, pack_bytes)
    return Plan("tree_parallel" if t.parallel else "tree", t, t.workspace)


def _build_sum(plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]) -> Callable[[Any], None]:
    x, out = ins[0], outs[0]
    t: ReduceTiling = plan.tiling
    red = norm_dims("reduce_sum", "dims", attrs["dims"], x.ndim) if attrs["dims"] else tuple(range(x.ndim))
    kept = tuple(i for i in range(x.ndim) if i not in red)
    acc = np.dtype(np.float64) if out.dtype.kind == "f" else np.dtype(np.int64)
    pack_dt = np.dtype(np.float32) if x.dtype == np.float16 else x.dtype
    return build_tree(source_view(x, red, kept, t.pack), out_column(out), t, pack_dt, acc)


reduce_sum = register(OpDef(
    name="reduce_sum",
    inputs=("x",),
    attrs=(Attr("dims", as_dims, (), "dims to reduce; () reduces all"),
           Attr("keep_dims", as_bool, False, "keep reduced dims as size 1")),
    dtypes=NUMERIC + (DType.bool,),
    infer=_infer_sum,
    select=_select_sum,
    kernels={"cpu": _build_sum},
    implementations=("tree", "tree_parallel"),
    workspace_formula="K*8*sum(levels) + [K*R*itemsize if packed]; levels = ceil(R/4096), ... while > 4096",
    doc=("Sum over ``dims`` as a block tree: level i sums blocks of 4096 into partials (float64 / int64) in "
         "the workspace, the last level writes ``out``. Workspace: sum over non-final levels of "
         "align64(K * n_i * 8) with n_1 = ceil(R / 4096), n_(i+1) = ceil(n_i / 4096) while n_i > 4096 "
         "(0 when R <= 4096), plus align64(K * R * itemsize) when the input must be packed "
         "(its kept or reduced dims do not merge into one stride, or float16)."),
    reference=lambda x, dims=(), keep_dims=False: np.sum(
        np.asarray(x, np.float64), axis=tuple(dims) if dims else None, keepdims=keep_dims),
))
