"""Reductions over any set of dims, as multi-level block trees whose partials live in the workspace."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ParamError
from ..kernels.cpu.reduce import build_argmax, build_tree, build_var
from ..layout import align, as_matrix, merge_dims
from ..op import REQUIRED, Attr, OpDef, Plan, register
from ..tensor import DType, TensorDesc
from .checks import FLOATS, NUMERIC, as_bool, as_dims, as_float, as_int, check_dtype, need, norm_dim, norm_dims

BLOCK = 4096  # elements summed by one task of a level
PARALLEL_MIN = 1 << 20  # elements below which one thread does the whole level


@dataclass(frozen=True)
class ReduceTiling:
    """A reduction as a (kept K, reduced R) matrix combined block by block, level by level.

    ``levels`` are the partial counts per row after each non-final level and ``offsets`` their byte
    offsets in the workspace (``part_offsets``: one offset per partial array of the level, e.g. argmax's values
    and indices); ``pack`` means the input is first copied densely to ``pack_offset``. ``orient`` is ``rows``
    (the reduced elements of a row are walked) or ``cols`` (the kept dim is the contiguous one: blocks of rows
    are added into vectors of partials).
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
    stage_offset: int = -1  # >= 0: the last level writes K accumulators here, then they are cast into out
    orient: str = "rows"
    part_offsets: tuple[tuple[int, ...], ...] = ()
    final_offset: int = -1  # >= 0: the last level's K partials (var's final (count, mean, M2) triples)


def tree_levels(reduced: int, block: int) -> tuple[int, ...]:
    """Partial counts per row after each level that is not the last: ceil(n / block) while n > block."""
    levels = []
    n = reduced
    while n > block:
        n = -(-n // block)
        levels.append(n)
    return tuple(levels)


def reduce_dims(op: str, x: TensorDesc, dims: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(reduced dims, kept dims); an empty ``dims`` reduces every dim (a 0-d tensor takes no other)."""
    red = norm_dims(op, "dims", dims, x.ndim) if dims else tuple(range(x.ndim))
    return red, tuple(i for i in range(x.ndim) if i not in red)


def reduced_desc(x: TensorDesc, red: tuple[int, ...], keep_dims: bool, dtype: DType) -> TensorDesc:
    shape = (
        tuple(1 if i in red else n for i, n in enumerate(x.shape))
        if keep_dims
        else tuple(n for i, n in enumerate(x.shape) if i not in red)
    )
    return TensorDesc(shape, dtype)


def _prod(v: list[int]) -> int:
    out = 1
    for n in v:
        out *= n
    return out


def plan_tree(
    x: TensorDesc,
    red: tuple[int, ...],
    kept: tuple[int, ...],
    acc_bytes: int | tuple[int, ...],
    pack_bytes: int,
    block: int | None = None,
    stage: bool = False,
    final: bool = False,
    cols: bool = True,
    stage_bytes: int | None = None,
) -> ReduceTiling:
    """Tiling and exact workspace of a tree reduction of ``x`` over ``red``.

    workspace = sum over levels and over partial arrays (``acc_bytes``: the bytes per partial of each array) of
    align64(K * n_level * bytes), plus align64(K * sum(acc_bytes)) when ``final`` and R > ``block`` (the last
    level's partials too), plus align64(K * R * pack_bytes) when the input cannot be viewed as a (K, R) matrix
    or is float16 (the kernels read float32), plus align64(K * stage_bytes) when ``stage`` (a float16 output: the
    last level writes wide values there first; ``stage_bytes`` defaults to sum(acc_bytes)).
    ``block`` defaults to the module's ``BLOCK`` (tests make it small for deep trees).
    """
    block = BLOCK if block is None else block
    parts = (acc_bytes,) if isinstance(acc_bytes, int) else tuple(acc_bytes)
    k_rows = _prod([x.shape[i] for i in kept])
    r = _prod([x.shape[i] for i in red])
    levels = tree_levels(r, block)
    offsets, part_offsets, off = [], [], 0
    for n in levels:
        offsets.append(off)
        here = []
        for b in parts:
            here.append(off)
            off += align(k_rows * n * b)
        part_offsets.append(tuple(here))
    final_offset = -1
    if final and levels and k_rows * r > 0:
        final_offset = off
        off += align(k_rows * sum(parts))
    mk = merge_dims([x.shape[i] for i in kept], [x.strides[i] for i in kept])
    mr = merge_dims([x.shape[i] for i in red], [x.strides[i] for i in red])
    pack = x.dtype is DType.float16 or mk is None or mr is None
    pack = pack and k_rows * r > 0
    pack_offset = off
    if pack:
        off += align(k_rows * r * pack_bytes)
    stage_offset = -1
    if stage and k_rows * r > 0:
        stage_offset = off
        off += align(k_rows * (stage_bytes if stage_bytes is not None else sum(parts)))
    orient = "rows"
    if cols and not pack and mk is not None and mr is not None and mk[1] == 1 and mr[1] != 1 and k_rows > 1 and r > 1:
        orient = "cols"  # a reduction over outer dims: add rows into vectors of partials
    return ReduceTiling(
        k_rows,
        r,
        block,
        levels,
        tuple(offsets),
        pack,
        pack_offset,
        k_rows * r >= PARALLEL_MIN,
        off,
        stage_offset,
        orient,
        tuple(part_offsets),
        final_offset,
    )


def check_vector_out(op: str, out: TensorDesc, arg: str = "out") -> None:
    """Reduction outputs (and the norms' mean / rstd) are written as a (K,) vector: a strided output must still
    walk with one stride."""
    if merge_dims(out.shape, out.strides) is None:
        raise ParamError(op=op, arg=arg, expected="an output whose dims merge into one strided vector", got=out)


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


_LEVELS = (
    "n_1 = ceil(R/4096), n_(i+1) = ceil(n_i/4096) while n_i > 4096 (no level when R <= 4096); "
    "p = itemsize, 4 for float16 (packed as float32)"
)


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
    t = plan_tree(x, red, kept, 8, pack_bytes, block=BLOCK, stage=x.dtype is DType.float16)
    return Plan("tree_parallel" if t.parallel else "tree", t, t.workspace)


def _build_sum(plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]) -> Callable[[Any], None]:
    x, out = ins[0], outs[0]
    t: ReduceTiling = plan.tiling
    red, kept = _reduce_parts("reduce_sum", x, attrs)
    acc = np.dtype(np.float64) if out.dtype.kind == "f" else np.dtype(np.int64)
    pack_dt = np.dtype(np.float32) if x.dtype == np.float16 else x.dtype
    return build_tree(source_view(x, red, kept, t.pack), out_column(out), t, pack_dt, acc)


reduce_sum = register(
    OpDef(
        name="reduce_sum",
        inputs=("x",),
        attrs=(
            Attr("dims", as_dims, (), "dims to reduce; () reduces all"),
            Attr("keep_dims", as_bool, False, "keep reduced dims as size 1"),
        ),
        dtypes=NUMERIC + (DType.bool,),
        infer=_infer_sum,
        select=_select_sum,
        kernels={"cpu": _build_sum},
        implementations=("tree", "tree_parallel"),
        workspace_formula=(
            "sum over levels of align64(K*n_i*8) + [align64(K*R*p) if packed] + [align64(K*8) if float16]; " + _LEVELS
        ),
        doc=(
            "Sum over ``dims`` as a block tree: level i sums blocks of 4096 into partials (float64 / int64) in "
            "the workspace, the last level writes ``out``. Workspace: sum over non-final levels of "
            "align64(K * n_i * 8) with n_1 = ceil(R / 4096), n_(i+1) = ceil(n_i / 4096) while n_i > 4096 "
            "(0 when R <= 4096), plus align64(K * R * p) when the input must be packed (its kept or reduced dims do "
            "not merge into one stride, or float16; p = itemsize, 4 for float16, packed as float32), plus "
            "align64(K * 8) for float16 "
            "(the last level's float64 results, then cast into out)."
        ),
        reference=lambda x, dims=(), keep_dims=False: np.sum(
            np.asarray(x, np.float64), axis=tuple(dims) if dims else None, keepdims=keep_dims
        ),
    )
)


# ---- mean, max, min: the same tree, another combine
def _reduce_parts(name: str, x: Any, attrs: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``reduce_dims`` of the array ``x`` (at build time)."""
    return reduce_dims(name, x, attrs["dims"])


_NUMPY_REDUCTIONS = {"reduce_mean": np.mean, "reduce_max": np.max, "reduce_min": np.min}  # their float64 references


def _make_reduce(name: str, dtypes: tuple[DType, ...], kind: str) -> None:
    def infer(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
        x = need(name, "x", ins[0])
        check_dtype(name, "x", x, dtypes)
        red, _ = reduce_dims(name, x, attrs["dims"])
        if kind == "max" and any(x.shape[i] == 0 for i in red):
            raise ParamError(
                op=name,
                arg="dims",
                expected="reduced dims of size > 0 (no identity for max/min)",
                got=tuple(x.shape[i] for i in red),
            )
        return (reduced_desc(x, red, attrs["keep_dims"], x.dtype),)

    def select(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
        x = ins[0]
        check_vector_out(name, outs[0])
        red, kept = reduce_dims(name, x, attrs["dims"])
        pack_bytes = 4 if x.dtype is DType.float16 else x.dtype.itemsize
        acc_bytes = 8 if kind == "mean" else pack_bytes
        # a mean is scaled in float64 before the cast: float32 too goes through the stage area
        stage = x.dtype is DType.float16 or (kind == "mean" and x.dtype is DType.float32)
        t = plan_tree(x, red, kept, acc_bytes, pack_bytes, block=BLOCK, stage=stage)
        return Plan("tree_parallel" if t.parallel else "tree", t, t.workspace)

    def build(plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]) -> Callable[[Any], None]:
        x, out = ins[0], outs[0]
        t: ReduceTiling = plan.tiling
        red, kept = _reduce_parts(name, x, attrs)
        pack_dt = np.dtype(np.float32) if x.dtype == np.float16 else x.dtype
        col = out_column(out)
        src = source_view(x, red, kept, t.pack)
        if kind == "mean":
            inv = 1.0 / t.reduced if t.reduced else np.nan
            return build_tree(src, col, t, pack_dt, np.dtype(np.float64), scale=inv)
        return build_tree(src, col, t, pack_dt, pack_dt, "max", pack_dt.type(1 if name == "reduce_max" else -1))

    what = {
        "mean": "mean (float64 partial sums, scaled by 1/R in float64, then cast)",
        "max": name[7:] + " (NaN propagates)",
    }[kind]
    formula = (
        "sum over levels of align64(K*n_i*acc) + [align64(K*R*p) if packed] + "
        f"[align64(K*acc) if {'float16 or float32' if kind == 'mean' else 'float16'}]; {_LEVELS}; "
        f"acc = {8 if kind == 'mean' else 'p'}"
    )
    register(
        OpDef(
            name=name,
            inputs=("x",),
            dtypes=dtypes,
            infer=infer,
            select=select,
            kernels={"cpu": build},
            attrs=(
                Attr("dims", as_dims, (), "dims to reduce; () reduces all"),
                Attr("keep_dims", as_bool, False, "keep reduced dims as size 1"),
            ),
            implementations=("tree", "tree_parallel"),
            workspace_formula=formula,
            doc=(
                f"The {what} over ``dims`` as the block tree of reduce_sum. Workspace: {formula} "
                "(packed: dims that do not merge into a (K, R) view, or float16, copied densely first)."
            ),
            reference=lambda x, dims=(), keep_dims=False, f=_NUMPY_REDUCTIONS[name]: f(
                np.asarray(x, np.float64), axis=tuple(dims) if dims else None, keepdims=keep_dims
            ),
        )
    )


_make_reduce("reduce_mean", FLOATS, "mean")
_make_reduce("reduce_max", NUMERIC, "max")
_make_reduce("reduce_min", NUMERIC, "max")


# ---- argmax: (value, index) partials
def _argmax_dims(x: TensorDesc, dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    d = norm_dim("argmax", "dim", dim, x.ndim)
    red = (d,) if x.ndim else ()
    return red, tuple(i for i in range(x.ndim) if i not in red)


def _infer_argmax(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
    x = need("argmax", "x", ins[0])
    check_dtype("argmax", "x", x, NUMERIC)
    red, _ = _argmax_dims(x, attrs["dim"])
    if any(x.shape[i] == 0 for i in red):
        raise ParamError(
            op="argmax",
            arg="dim",
            expected="a dim of size > 0 (argmax of an empty sequence)",
            got=f"dim {attrs['dim']} of shape {x.shape}",
        )
    return (reduced_desc(x, red, attrs["keep_dims"], DType.int64),)


def _argmax_value_bytes(x: TensorDesc) -> int:
    return 4 if x.dtype is DType.float16 else x.dtype.itemsize


def _select_argmax(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
    x = ins[0]
    check_vector_out("argmax", outs[0])
    red, kept = _argmax_dims(x, attrs["dim"])
    vb = _argmax_value_bytes(x)
    t = plan_tree(x, red, kept, (vb, 8), vb, block=BLOCK, cols=False)
    return Plan("tree_parallel" if t.parallel else "tree", t, t.workspace)


def _build_argmax(
    plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]
) -> Callable[[Any], None]:
    x, out = ins[0], outs[0]
    t: ReduceTiling = plan.tiling
    d = attrs["dim"] % max(x.ndim, 1)
    red = (d,) if x.ndim else ()
    kept = tuple(i for i in range(x.ndim) if i not in red)
    value_dt = np.dtype(np.float32) if x.dtype == np.float16 else x.dtype
    return build_argmax(source_view(x, red, kept, t.pack), out_column(out), t, value_dt)


_ARGMAX_WS = (
    "sum over levels of align64(K*n_i*v) + align64(K*n_i*8), plus align64(K*R*v) when packed; "
    "v = itemsize (4 for float16), n_1 = ceil(R/4096), n_(i+1) = ceil(n_i/4096) while n_i > 4096"
)

argmax = register(
    OpDef(
        name="argmax",
        inputs=("x",),
        attrs=(
            Attr("dim", as_int, REQUIRED, "the dim to search"),
            Attr("keep_dims", as_bool, False, "keep the dim as size 1"),
        ),
        dtypes=NUMERIC,
        infer=_infer_argmax,
        select=_select_argmax,
        kernels={"cpu": _build_argmax},
        implementations=("tree", "tree_parallel"),
        workspace_formula=_ARGMAX_WS,
        doc=(
            "Index (int64) of the first maximum along ``dim``; NaN counts as the maximum (numpy's argmax). A block "
            "tree: level 1 writes (max, index) of every block of 4096 to the workspace, later levels reduce those "
            "pairs, the last writes ``out``. Workspace: " + _ARGMAX_WS + " (packed: the other dims do not merge into "
            "one stride, or float16, whose values are compared in float32). An empty ``dim`` is a ParamError."
        ),
        reference=lambda x, dim, keep_dims=False: np.argmax(
            np.asarray(x, np.float64), axis=dim if np.ndim(x) else None, keepdims=keep_dims
        ),
    )
)


# ---- var: Welford (count, mean, M2) partials, merged pairwise with Chan et al.'s formula
def _as_correction(v: Any) -> float:
    c = float(as_float(v))
    if not (c >= 0.0 and math.isfinite(c)):
        raise ValueError(v)
    return c


_as_correction.expects = "a finite real number >= 0"  # type: ignore[attr-defined]


def _infer_var(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
    x = need("var", "x", ins[0])
    check_dtype("var", "x", x, FLOATS)
    red, _ = reduce_dims("var", x, attrs["dims"])
    return (reduced_desc(x, red, attrs["keep_dims"], x.dtype),)


def _select_var(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
    x = ins[0]
    check_vector_out("var", outs[0])
    red, kept = reduce_dims("var", x, attrs["dims"])
    pack_bytes = 4 if x.dtype is DType.float16 else x.dtype.itemsize
    t = plan_tree(
        x, red, kept, 24, pack_bytes, block=BLOCK, stage=x.dtype is DType.float16, final=True, cols=False, stage_bytes=8
    )
    return Plan("tree_parallel" if t.parallel else "tree", t, t.workspace)


def _build_var(plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]) -> Callable[[Any], None]:
    x, out = ins[0], outs[0]
    t: ReduceTiling = plan.tiling
    red, kept = _reduce_parts("var", x, attrs)
    pack_dt = np.dtype(np.float32) if x.dtype == np.float16 else x.dtype
    return build_var(source_view(x, red, kept, t.pack), out_column(out), t, pack_dt, attrs["correction"])


_VAR_WS = (
    "sum over levels of align64(K*n_i*24) + [align64(K*24) if R > 4096] + [align64(K*R*p) if packed] + "
    "[align64(K*8) if float16]; " + _LEVELS
)

var = register(
    OpDef(
        name="var",
        inputs=("x",),
        attrs=(
            Attr("dims", as_dims, (), "dims to reduce; () reduces all"),
            Attr("correction", _as_correction, 1, "divide M2 by max(N - correction, 0) (1: unbiased)"),
            Attr("keep_dims", as_bool, False, "keep reduced dims as size 1"),
        ),
        dtypes=FLOATS,
        infer=_infer_var,
        select=_select_var,
        kernels={"cpu": _build_var},
        implementations=("tree", "tree_parallel"),
        workspace_formula=_VAR_WS,
        doc=(
            "Variance over ``dims``: M2 / max(N - correction, 0) (numpy's ddof rule: 0/0 is NaN, an empty "
            "reduction NaN). A block tree: level 1 writes the (count, mean, M2) float64 triple of every block of 4096 "
            "(float32: one pass of float64 sums of y = x - x_0 and y^2, x_0 the block's first element, so a large mean "
            "does not cancel; float64: two passes, the second's sum of deviations correcting the mean's rounding; the "
            "block is in cache), later levels "
            "merge triples pairwise with Chan et al.'s formula, the last level's triples go to a final area, then the "
            "division writes ``out``; rows of R <= 4096 go straight from their moments to ``out``. Workspace: "
            + _VAR_WS
            + " (24 bytes per triple; packed: dims that do not merge into a (K, R) view, or float16)."
        ),
        reference=lambda x, dims=(), correction=1, keep_dims=False: np.var(
            np.asarray(x, np.float64), axis=tuple(dims) if dims else None, ddof=correction, keepdims=keep_dims
        ),
    )
)
