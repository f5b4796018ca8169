"""matmul (numpy semantics), linear (weight stored (out, in)) and baddbmm (beta * c + alpha * a @ b).

Phase 1 turns every operand into a batch of matrices (1-D operands promoted as numpy does) and ranks the
implementations: one folded GEMM when the second operand is shared across the batch, a loop of folded GEMMs
over the remaining batch dims, BLAS on the views as they are, and BLAS on operands packed into the workspace
when their strides are not BLAS-compatible (negative, or no unit stride).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import ParamError
from ..kernels.cpu import gemm
from ..kernels.cpu.elementwise import ACTIVATIONS
from ..kernels.cpu.matmul import build_in_place_addend, build_matmul
from ..layout import align, broadcast_shape, merge_dims, same_view
from ..op import Attr, OpDef, Plan, register
from ..runtime.fanout import fanout_parts, split_range
from ..tensor import DType, TensorDesc
from .checks import as_float, check_dtype, choice, need
from .elementwise import unary_reference
from .selection import Candidate, choose

MM_DTYPES = (DType.float32, DType.float64)
IMPLEMENTATIONS = ("microkernel", "gemm_folded", "batch_loop", "blas", "packed")
# microkernel (kernels/cpu/gemm.py) where it measured faster than numpy's OpenBLAS (bench/bench_ops2.py): float32,
# 3 to MICRO_MAX_ROWS rows, columns by gemm.columns_fit. With k blocks of 256 (gemm.KC) an Intel Xeon ran large
# products slower than OpenBLAS (/tmp/w28/big.py of the twenty-eighth session: 1024^3 0.87-0.97x, 4096 x 1024 x
# 1024 0.90x), and the kernel stopped at 512 rows (2048 for a b of at most 2.5 MiB). With blocks of 512, forced
# against blas through the op, two threads, 11 interleaved rounds, two runs (AMD Zen 4, /tmp/w50/mmimpl.py of the
# fiftieth session), it is as fast or faster on every shape measured: 1024^3 1.05 / 1.05x, 2048^3 1.02 / 1.02x,
# 4096 x 1024 x 1024 1.01 / 1.06x, 1024 x 4096 x 1024 1.13 / 1.04x, 2048 x 384 x 1536 1.05 / 1.05x, 600 x 1000 x
# 1000 1.04x, 8192 x 256 x 256 1.12x, 2048 x 1024 x 4096 1.01x, 1.01-1.15x on nine others
MICRO_MAX_ROWS = 8192
MICRO_MIN_ROWS = 3  # one or two rows: OpenBLAS's GEMV-like kernels are faster (1 x 384 x 1536: 36 against 70 us)
MICRO_PART_FLOPS = 6_000_000  # below this a GEMM runs as one part (4 x 384 x 1536: 60 us in one, 70 in two)


@dataclass(frozen=True)
class Spec:
    """A matmul operand as a batch of matrices, strides in elements.

    ``shape``/``strides``: its own promoted shape; ``bshape``/``bstrides``: batch broadcast to the output's
    (stride 0 where broadcast); ``rows_stride``/``folded_rows``: the batch dims from the fold point merged
    with the rows (None when they do not merge).
    """

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    bshape: tuple[int, ...]
    bstrides: tuple[int, ...]
    rows_stride: int | None = None
    folded_rows: int = 0


@dataclass(frozen=True)
class MatmulTiling:
    """Operand specs; ``fold``: batch dims ``[0, fold)`` are looped, the rest folded into the rows (-1: none);
    ``pack``/``offsets``: which of (a, b, out) are packed into the workspace, and where."""

    a: Spec
    b: Spec
    out: Spec
    fold: int
    pack: tuple[bool, bool, bool]
    offsets: tuple[int, int, int]
    workspace: int
    parts: tuple[tuple[int, int, int, int], ...] = ()  # microkernel: (i0, i1, j0, j1) blocks of out, one per part
    panels: bool = False  # microkernel: each part packs b's panels into its workspace area, align64(panel_bytes(K))


def _blas2d(s_row: int, s_col: int, cols: int) -> bool:
    """numpy's ``is_blasable2d``: unit column stride, row stride at least the row length."""
    return s_col == 1 and s_row >= max(cols, 1)


def matrix_ok(shape: tuple[int, ...], strides: tuple[int, ...], out: bool = False) -> bool:
    """Whether BLAS can take the matrices as they are (row- or column-major; the output row-major only)."""
    r, c = shape[-2:]
    sr, sc = strides[-2:]
    return _blas2d(sr, sc, c) or (not out and _blas2d(sc, sr, r))


def promote(d: TensorDesc, role: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """numpy's 1-D promotion: ``a`` (K,) -> (1, K), ``b`` (K,) -> (K, 1), with strides BLAS accepts."""
    if d.ndim >= 2:
        return d.shape, d.strides
    (n,), (s,) = d.shape, d.strides
    fake = max(n, 1) * max(abs(s), 1)
    return ((1, n), (fake, s)) if role == "a" else ((n, 1), (s, fake))


def out_spec(d: TensorDesc, a_1d: bool, b_1d: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The output as batch + (M, N): dims removed by 1-D operands put back with size 1."""
    shape, strides = list(d.shape), list(d.strides)
    if b_1d:
        shape.append(1)
        strides.append(1)
    if a_1d:
        n = shape[-1]
        shape.insert(len(shape) - 1, 1)
        strides.insert(len(strides) - 1, max(n, 1) * max(abs(strides[-1]), 1))
    return tuple(shape), tuple(strides)


def _broadcast(shape: tuple[int, ...], strides: tuple[int, ...], batch: tuple[int, ...]) -> Spec:
    nb, own = len(batch), len(shape) - 2
    bstr = [0] * (nb - own) + [s if n != 1 else 0 for n, s in zip(shape[:-2], strides[:-2])]
    return Spec(shape, strides, batch + shape[-2:], tuple(bstr) + strides[-2:])


def _fold(s: Spec, g: int) -> Spec | None:
    """``s`` with batch dims ``[g, nb)`` merged into its rows, or None when they do not merge."""
    nb = len(s.bshape) - 2
    m = merge_dims(s.bshape[g : nb + 1], s.bstrides[g : nb + 1])
    if m is None:
        return None
    rows, stride = m
    if rows <= 1:
        stride = max(s.bshape[-1], 1) * max(abs(s.bstrides[-1]), 1)
    return Spec(s.shape, s.strides, s.bshape, s.bstrides, stride, rows)


def _fold_point(a: Spec, b: Spec, out: Spec) -> tuple[int, Spec, Spec] | None:
    """Smallest g such that ``b`` is broadcast over batch dims [g, nb) and ``a``/``out`` fold there, BLAS-ready."""
    nb = len(out.bshape) - 2
    g = nb
    while g > 0 and (b.bstrides[g - 1] == 0 or out.bshape[g - 1] == 1):
        g -= 1
    for gg in range(g, nb + 1):
        fa, fo = _fold(a, gg), _fold(out, gg)
        if fa is None or fo is None:
            continue
        if fa.rows_stride is None or fo.rows_stride is None:
            return None
        if matrix_ok((fa.folded_rows, a.shape[-1]), (fa.rows_stride, a.strides[-1])) and matrix_ok(
            (fo.folded_rows, out.shape[-1]), (fo.rows_stride, out.strides[-1]), out=True
        ):
            return gg, fa, fo
        return None
    return None


def plan_matmul(
    op: str,
    a: tuple[tuple[int, ...], tuple[int, ...]],
    b: tuple[tuple[int, ...], tuple[int, ...]],
    out: tuple[tuple[int, ...], tuple[int, ...]],
    itemsize: int,
    limit: Any,
    b_offset: int = 0,
) -> Plan:
    """Rank the implementations for promoted operand (shape, strides) pairs and pick under ``limit``; ``b_offset``:
    b's offset in elements (whether its rows are 64-byte aligned decides the microkernel's panel copies).

    Workspace: 0 for microkernel, gemm_folded, batch_loop and blas; packed: align64(numel * itemsize) for each packed
    operand of (a, b, out) (those whose matrices BLAS cannot take; a and b when all can).
    """
    batch = out[0][:-2]
    sa, sb, so = (_broadcast(x[0], x[1], batch) for x in (a, b, out))
    a_ok, b_ok, o_ok = matrix_ok(*a), matrix_ok(*b), matrix_ok(*out, out=True)
    cands: list[Candidate] = []
    fold = _fold_point(sa, sb, so) if b_ok else None
    no_pack = (False, False, False)
    if fold is not None:
        g, fa, fo = fold
        folded = math.prod(batch[g:])
        if g == 0 and len(batch) > 0 and folded > 1:
            cands.append(Candidate("gemm_folded", MatmulTiling(fa, sb, fo, 0, no_pack, (0, 0, 0), 0), 0))
        elif 0 < g and folded > 1:
            cands.append(Candidate("batch_loop", MatmulTiling(fa, sb, fo, g, no_pack, (0, 0, 0), 0), 0))
    # the microkernel reads a with any strides (negative ones too): one 2-D product, or a batch folded into rows
    ma, mo = (
        (fold[1], fold[2])
        if fold is not None and fold[0] == 0
        else (_fold(sa, 0), _fold(so, 0))
        if not batch and o_ok
        else (None, None)
    )
    if ma is not None and mo is not None and itemsize == 4:
        micro = _micro_parts(ma.folded_rows, sb.shape[-2], sb.shape[-1], sb.strides[-1])
        if micro:
            plain = MatmulTiling(ma, sb, mo, 0, no_pack, (0, 0, 0), 0, micro)
            cands.insert(0, Candidate("microkernel", plain, 0))
            rows = min(i1 - i0 for i0, i1, _, _ in micro)
            if gemm.packs_panels(rows, sb.strides[-2], b_offset):  # under a tighter limit: unpacked
                panels = len(micro) * align(gemm.panel_bytes(sb.shape[-2]))
                cands.insert(0, Candidate("microkernel", replace(plain, workspace=panels, panels=True), panels))
    if a_ok and b_ok and o_ok:
        cands.append(Candidate("blas", MatmulTiling(sa, sb, so, -1, no_pack, (0, 0, 0), 0), 0))
    pack = (not a_ok, not b_ok, not o_ok)
    if not any(pack):
        pack = (True, True, False)
    offsets, off = [], 0
    for (shape, _), p in zip((a, b, out), pack):
        offsets.append(off)
        off += align(math.prod(shape) * itemsize) if p else 0
    cands.append(Candidate("packed", MatmulTiling(sa, sb, so, -1, pack, tuple(offsets), off), off))  # type: ignore[arg-type]
    return choose(op, cands, limit)


def _micro_parts(m: int, k: int, n: int, b_col_stride: int) -> tuple[tuple[int, int, int, int], ...]:
    """The blocks of out the float32 microkernel's parts compute, or () where it does not apply: ``b`` (one
    matrix, shared by the whole folded batch) needs unit column stride, the CPU AVX-512. Columns split at
    32-column panels (so every part is at least 32 wide and needs no scalar tail), or rows (always, when there
    are fewer panels than parts): of the two, the split whose slowest part has less work (``_slowest_part``).
    Not where the last, overlapping 16-column panel would make more than a tenth of the work, nor past
    ``MICRO_MAX_ROWS`` rows (the most measured)."""
    if (
        not gemm.available()
        or b_col_stride != 1
        or not MICRO_MIN_ROWS <= m <= MICRO_MAX_ROWS
        or not gemm.columns_fit(n)
        or k == 0
    ):
        return ()
    parts = fanout_parts() if 2 * m * n * k >= MICRO_PART_FLOPS else 1
    by_rows = tuple((i0, i1, 0, n) for i0, i1 in gemm.row_ranges(m, parts))
    panels = n // gemm.NR  # the last part takes the columns after the last full panel
    if panels < parts:
        return by_rows
    cuts = split_range(panels, parts)
    by_columns = tuple((0, m, j0 * gemm.NR, n if j1 == panels else j1 * gemm.NR) for j0, j1 in cuts)
    return by_rows if _slowest_part(by_rows) < _slowest_part(by_columns) else by_columns


def _slowest_part(parts: tuple[tuple[int, int, int, int], ...]) -> int:
    """The most work one of ``parts`` does: whole MR-row blocks times ``gemm.columns_computed`` of its columns.
    Columns split at panels leave the tail's panel to the last part; rows split evenly, each over every column.
    The lesser maximum picked the faster split in every case measured side by side (/tmp/w40/split.py: rows for
    512 x 2304 x 392, 446 against 425 GFLOP/s, and 512 x 1152 x 100, 177 against 166; columns for 128 x 384 x
    1152, 336 against 228, and 128 x 576 x 6272, 432 against 374)."""
    return max(-(-(i1 - i0) // gemm.MR) * gemm.MR * gemm.columns_computed(j1 - j0) for i0, i1, j0, j1 in parts)


# ---- shape inference shared by the three ops
def _mm_out(op: str, a: TensorDesc, b: TensorDesc, a_arg: str = "a", b_arg: str = "b") -> TensorDesc:
    check_dtype(op, a_arg, a, MM_DTYPES)
    check_dtype(op, b_arg, b, MM_DTYPES)
    if b.dtype is not a.dtype:
        raise ParamError(op=op, arg=b_arg, expected=f"dtype {a.dtype.value} (same as {a_arg})", got=b.dtype.value)
    for name, d in ((a_arg, a), (b_arg, b)):
        if d.ndim == 0:
            raise ParamError(op=op, arg=name, expected="at least 1 dim", got=d.shape)
    (ash, _), (bsh, _) = promote(a, "a"), promote(b, "b")
    if ash[-1] != bsh[-2]:
        raise ParamError(op=op, arg=b_arg, expected=f"{ash[-1]} rows (the columns of {a_arg} {a.shape})", got=b.shape)
    batch = broadcast_shape(ash[:-2], bsh[:-2])
    if batch is None:
        raise ParamError(op=op, arg=b_arg, expected=f"batch dims that broadcast with {a.shape[:-2]}", got=b.shape)
    shape = batch + ((ash[-2],) if a.ndim > 1 else ()) + ((bsh[-1],) if b.ndim > 1 else ())
    return TensorDesc(shape, a.dtype)


def _check_addend(op: str, arg: str, c: TensorDesc, out: TensorDesc) -> None:
    check_dtype(op, arg, c, (out.dtype,))
    if broadcast_shape(c.shape, out.shape) != out.shape:
        raise ParamError(op=op, arg=arg, expected=f"a shape that broadcasts to {out.shape}", got=c.shape)


def _weight_t(w: TensorDesc) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (w.shape[1], w.shape[0]), (w.strides[1], w.strides[0])


# ---- matmul
def _infer_matmul(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
    return (_mm_out("matmul", need("matmul", "a", ins[0]), need("matmul", "b", ins[1])),)


def _product_select(op: str, first: int) -> Callable[[Any, Any, dict[str, Any], int | None], Plan]:
    """Phase 1 of an op whose product's operands a, b are its inputs ``first`` and ``first + 1``."""

    def select(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
        a, b = ins[first], ins[first + 1]
        return plan_matmul(
            op,
            promote(a, "a"),
            promote(b, "b"),
            out_spec(outs[0], a.ndim == 1, b.ndim == 1),
            a.dtype.itemsize,
            limit,
            b.offset,
        )

    return select


def _build_matmul(
    plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]
) -> Callable[[Any], None]:
    return build_matmul(plan.tiling, plan.implementation, ins[0], ins[1], outs[0])


WS_DOC = (
    f"microkernel: P * align64(min({gemm.KC}, K) * {gemm.NR} * 4) (P parts, each packing b's panels of "
    f"{gemm.NR} columns, K rows of b) when every part has {gemm.PACK_MIN_ROWS} rows or more, b's rows are not "
    "all 64-byte aligned (row stride or offset not a multiple of 16 floats), the host is not an AMD Zen (where b is "
    "read in place: faster there) and the limit allows, else 0; "
    "gemm_folded, batch_loop, blas: 0 bytes; packed: align64(numel(a) * itemsize) if a is packed + "
    "align64(numel(b) * itemsize) if b is packed + align64(numel(out) * itemsize) if out is packed"
)

matmul = register(
    OpDef(
        name="matmul",
        inputs=("a", "b"),
        dtypes=MM_DTYPES,
        infer=_infer_matmul,
        select=_product_select("matmul", 0),
        kernels={"cpu": _build_matmul},
        implementations=IMPLEMENTATIONS,
        workspace_formula=WS_DOC,
        doc=(
            "a @ b with numpy semantics (1-D promotion, broadcast batch dims), float32 / float64. Implementations, "
            "fastest first: microkernel (float32, b one matrix with unit column stride, "
            f"{MICRO_MIN_ROWS}-{MICRO_MAX_ROWS} folded rows, a with any strides, at least {gemm.MIN_COLS} columns: "
            "a register-blocked GEMM reading a in place, and b in place or, from "
            f"{gemm.PACK_MIN_ROWS} rows when its rows are not 64-byte aligned (not on AMD Zen), its column panels "
            "copied contiguous; "
            "bias fused, column panels split over the cores), gemm_folded (b shared "
            "by the whole batch: one GEMM over batch*M rows, workspace 0), batch_loop (one folded GEMM per index of "
            "the batch dims b varies over, workspace 0), blas (np.matmul on "
            "the views, workspace 0, when every matrix has a unit stride), packed (operands BLAS cannot take copied "
            "densely into the workspace: align64(numel * itemsize) per packed operand)."
        ),
        reference=lambda a, b: np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64)),
    )
)


# ---- linear
def _infer_linear(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
    x, w, bias = need("linear", "x", ins[0]), need("linear", "weight", ins[1]), ins[2]
    if w.ndim != 2:
        raise ParamError(op="linear", arg="weight", expected="2 dims (out_features, in_features)", got=w.shape)
    wt = TensorDesc(*_weight_t(w)[:1], dtype=w.dtype)
    out = _mm_out("linear", x, wt, "x", "weight")
    if bias is not None:
        if bias.ndim != 1 or bias.shape[0] != w.shape[0]:
            raise ParamError(op="linear", arg="bias", expected=f"shape ({w.shape[0]},)", got=bias.shape)
        _check_addend("linear", "bias", bias, out)
    return (out,)


def _select_linear(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
    x, w = ins[0], ins[1]
    return plan_matmul(
        "linear",
        promote(x, "a"),
        _weight_t(w),
        out_spec(outs[0], x.ndim == 1, False),
        x.dtype.itemsize,
        limit,
        w.offset,
    )


def _build_linear(
    plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]
) -> Callable[[Any], None]:
    x, w, bias = ins
    return build_matmul(
        plan.tiling,
        plan.implementation,
        x,
        w.T,
        outs[0],
        None if bias is None else (bias, 1.0, 1.0),
        attrs["activation"],
    )


def _ref_linear(x: Any, weight: Any, bias: Any = None, activation: str = "none") -> Any:
    y = np.asarray(x, np.float64) @ np.asarray(weight, np.float64).T
    y = y if bias is None else y + np.asarray(bias, np.float64)
    return y if activation == "none" else unary_reference(activation)(y)


linear = register(
    OpDef(
        name="linear",
        inputs=("x", "weight", "bias?"),
        dtypes=MM_DTYPES,
        infer=_infer_linear,
        select=_select_linear,
        kernels={"cpu": _build_linear},
        implementations=IMPLEMENTATIONS,
        workspace_formula=WS_DOC,
        attrs=(
            Attr(
                "activation",
                choice(*ACTIVATIONS),
                "none",
                "applied to the result: 'none', 'relu', 'gelu' (erf), 'gelu_tanh' or 'silu'",
            ),
        ),
        doc=(
            "act(x @ weight.T + bias) with weight stored (out_features, in_features) as in PyTorch; x's leading dims "
            "fold into one GEMM (microkernel when weight is stored (in, out), i.e. weight.T has unit column stride, "
            "else gemm_folded / blas). Same implementations and workspace as matmul (b = weight.T, a view). The "
            "microkernel applies the activation to each part's block as soon as it is computed, while it is in "
            "cache; the others in one pass after the GEMM."
        ),
        reference=_ref_linear,
    )
)


# ---- baddbmm
def _infer_baddbmm(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
    c = need("baddbmm", "c", ins[0])
    out = _mm_out("baddbmm", need("baddbmm", "a", ins[1]), need("baddbmm", "b", ins[2]))
    _check_addend("baddbmm", "c", c, out)
    return (out,)


def _build_baddbmm(
    plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]
) -> Callable[[Any], None]:
    c, a, b = ins
    out, alpha, beta = outs[0], attrs["alpha"], attrs["beta"]
    if beta != 0 and same_view(out, c):  # in place: the product must not overwrite c before it is read
        launch = build_in_place_addend(a, b, out, alpha, beta)
        if launch is None and a.shape[-1] == 0:  # K = 0: no product (BLAS gets none), the result is beta * c

            def launch(_: Any) -> None:
                np.multiply(out, beta, out=out)

        if launch is None:
            raise ParamError(
                op="baddbmm",
                arg="out",
                expected="memory apart from c, or c itself with float32 / "
                "float64 operands BLAS can read as they are and alpha != 0",
                got="c itself",
            )
        return launch
    return build_matmul(plan.tiling, plan.implementation, a, b, out, (c, alpha, beta))


def _ref_baddbmm(c: Any, a: Any, b: Any, beta: float = 1.0, alpha: float = 1.0) -> Any:
    p = alpha * np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64))
    return p if beta == 0 else p + beta * np.asarray(c, np.float64)


baddbmm = register(
    OpDef(
        name="baddbmm",
        inputs=("c", "a", "b"),
        attrs=(
            Attr("beta", as_float, 1.0, "scale of c (0 ignores c, NaN included)"),
            Attr("alpha", as_float, 1.0, "scale of a @ b"),
        ),
        dtypes=MM_DTYPES,
        infer=_infer_baddbmm,
        select=_product_select("baddbmm", 1),
        kernels={"cpu": _build_baddbmm},
        implementations=IMPLEMENTATIONS,
        workspace_formula=WS_DOC,
        doc=(
            "beta * c + alpha * (a @ b), a @ b with matmul's semantics and c broadcast to the result. The scaling "
            "runs in place on the output. Same implementations and workspace as matmul."
        ),
        reference=_ref_baddbmm,
        aliases=(0,),
    )
)
