"""Case generators for the shape-matrix harness, keyed by op name.

An op with no generator here gets generic elementwise-shaped cases built from its input count and dtypes
(``generic_cases``). Ops whose inputs need special values or related shapes register a generator with
``@cases_for("name", ...)``: ``gen(rng, dtype, long_n) -> list[Case]``. Op modules may register their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..tensor import DType

__all__ = ["Call", "Case", "Layout", "GENERATORS", "cases_for", "generic_cases", "values", "SIGNED"]


@dataclass(frozen=True)
class Layout:
    """An input given in a non-contiguous layout: ``kind`` is ``"transposed"``, ``"step"`` or ``"negative"``."""

    array: Any
    kind: str


@dataclass
class Call:
    inputs: tuple[Any, ...]  # numpy arrays, Layouts or None
    attrs: dict[str, Any] = field(default_factory=dict)
    # "step": every output is passed as ``out=``, a view of every other element (along its last dim) of a buffer
    # twice as long; the bytes between the elements must keep the harness's sentinel. None: new dense outputs
    out: str | None = None


@dataclass
class Case:
    """One matrix case: one call, or a sequence of consecutive calls whose shapes change."""

    label: str
    calls: list[Call]


Generator = Callable[[np.random.Generator, DType, int], list[Case]]
GENERATORS: dict[str, Generator] = {}
SIGNED: set[str] = {
    "abs",
    "neg",
    "relu",
    "tanh",
    "sigmoid",
    "gelu",
    "silu",
    "exp",
    "add",
    "sub",
    "mul",
    "maximum",
    "minimum",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "softmax",
    "reduce_sum",
    "reduce_mean",
    "reduce_max",
    "reduce_min",
}


def cases_for(*names: str) -> Callable[[Generator], Generator]:
    """Register ``gen`` as the case generator of the named ops."""

    def deco(gen: Generator) -> Generator:
        for n in names:
            GENERATORS[n] = gen
        return gen

    return deco


def values(rng: np.random.Generator, shape: tuple[int, ...], dtype: DType, signed: bool = False) -> Any:
    """Random values that every op of the library accepts: floats in [0.5, 2) (and negated half the time when
    ``signed``), small positive ints, random bools."""
    if dtype is DType.bool:
        return rng.random(shape) < 0.5
    if dtype.is_float:
        v = rng.uniform(0.5, 2.0, shape)
        if signed:
            v = np.where(rng.random(shape) < 0.5, -v, v)
        return np.asarray(v, dtype.np)
    return np.asarray(rng.integers(1, 6, shape), dtype.np)


def _one(label: str, *inputs: Any, **attrs: Any) -> Case:
    return Case(label, [Call(tuple(inputs), attrs)])


def generic_cases(name: str, n_inputs: int, rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    """Elementwise-shaped cases for an op of ``n_inputs`` same-dtype inputs and default attributes."""
    signed = name in SIGNED

    def v(shape: tuple[int, ...]) -> Any:
        return values(rng, shape, dtype, signed)

    def same(label: str, shape: tuple[int, ...]) -> Case:
        return _one(label, *(v(shape) for _ in range(n_inputs)))

    cases = [
        same("empty (0,)", (0,)),
        same("empty (0, 3)", (0, 3)),
        same("one element (1,)", (1,)),
        same("scalar ()", ()),
        same("prime (13, 17)", (13, 17)),
        same("odd (3, 5, 7)", (3, 5, 7)),
        same(f"long (1, {long_n})", (1, long_n)),
        same(f"long ({long_n}, 1)", (long_n, 1)),
    ]
    if n_inputs >= 2:
        for a, b in (((3, 1), (1, 4)), ((5,), (2, 5)), ((), (3,)), ((2, 1, 4), (3, 1)), ((1, long_n), (2, 1))):
            rest = [v(b) for _ in range(n_inputs - 1)]
            cases.append(_one(f"broadcast {a} x {b}", v(a), *rest))
    for kind in ("transposed", "step", "negative"):
        shape = (6, 5) if kind == "transposed" else (4, 9)
        cases.append(_one(f"{kind} {shape}", Layout(v(shape), kind), *(v(shape) for _ in range(n_inputs - 1))))
    cases.append(Case("step out (4, 9)", [Call(tuple(v((4, 9)) for _ in range(n_inputs)), out="step")]))
    seq = [(5,), (9,), (5,), (2, 7), (1,), (2, 7)]
    cases.append(Case(f"sequence {seq}", [Call(tuple(v(s) for _ in range(n_inputs))) for s in seq]))
    return cases


# ---- ops whose inputs need special values or related shapes
@cases_for("cast")
def _cast(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    out = []
    for to in (DType.float32, DType.int32, DType.float64):
        for c in generic_cases("cast", 1, rng, dtype, long_n):
            for call in c.calls:
                call.attrs["dtype"] = to
            out.append(Case(f"{c.label} -> {to.value}", c.calls))
    return out


@cases_for("where")
def _where(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    def w(shape_c: Any, shape: Any) -> tuple[Any, ...]:
        return (rng.random(shape_c) < 0.5, values(rng, shape, dtype, True), values(rng, shape, dtype, True))

    cases = [
        _one(f"{sc} {s}", *w(sc, s))
        for sc, s in (((0,), (0,)), ((1,), (1,)), ((13, 17), (13, 17)), ((3, 1), (1, 4)), ((1, long_n), (1, long_n)))
    ]
    c, x, y = w((6, 5), (6, 5))
    cases.append(_one("transposed x", c, Layout(x, "transposed"), y))
    cases.append(Case("sequence", [Call(w(s, s)) for s in ((5,), (7,), (5,), (2, 3))]))
    return cases


@cases_for("embedding")
def _embedding(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    def e(rows: int, dim: int, idx_shape: tuple[int, ...]) -> tuple[Any, Any]:
        return values(rng, (rows, dim), dtype, True), rng.integers(0, rows, idx_shape).astype(np.int64)

    cases = [
        _one(f"{r}x{d} idx {s}", *e(r, d, s))
        for r, d, s in ((1, 1, (1,)), (7, 3, (0,)), (13, 17, (5, 3)), (5, 4, (min(long_n, 100000),)))
    ]
    cases.append(Case("sequence", [Call(e(r, d, s)) for r, d, s in ((4, 3, (2,)), (9, 3, (5,)), (4, 3, (2,)))]))
    return cases


def _mm(rng: np.random.Generator, dtype: DType, *shapes: tuple[int, ...]) -> tuple[Any, ...]:
    return tuple(values(rng, s, dtype, True) for s in shapes)


@cases_for("matmul")
def _matmul(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    k = min(long_n, 1 << 16)
    shapes = [
        ((1, 1), (1, 1)),
        ((0, 3), (3, 4)),
        ((7, 13), (13, 5)),
        ((2, 3, 5), (5, 4)),
        ((1, k), (k, 1)),
        ((2, 1, 5, 3), (4, 3, 2)),
    ]
    cases = [_one(f"{a} @ {b}", *_mm(rng, dtype, a, b)) for a, b in shapes]
    a, b = _mm(rng, dtype, (5, 6), (6, 4))
    cases.append(_one("transposed a", Layout(a, "transposed"), b))
    cases.append(_one("step b", a, Layout(b, "step")))
    cases.append(Case("sequence", [Call(_mm(rng, dtype, (m, 3), (3, n))) for m, n in ((2, 2), (5, 7), (2, 2))]))
    return cases


@cases_for("linear")
def _linear(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    cases = [
        _one(
            f"x {x} w {w} bias {b is not None}",
            *_mm(rng, dtype, x, w),
            None if b is None else values(rng, b, dtype, True),
        )
        for x, w, b in (
            ((1, 1), (1, 1), None),
            ((7, 13), (5, 13), (5,)),
            ((2, 3, 4), (6, 4), (6,)),
            ((0, 4), (3, 4), (3,)),
        )
    ]
    cases.append(Case("sequence", [Call(_mm(rng, dtype, (m, 3), (4, 3))) for m in (2, 9, 2)]))
    return cases


@cases_for("baddbmm")
def _baddbmm(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    return [
        _one(f"b{b} {m}x{k}x{n}", *_mm(rng, dtype, (b, m, n), (b, m, k), (b, k, n)), beta=0.5, alpha=2.0)
        for b, m, k, n in ((1, 1, 1, 1), (2, 7, 13, 5), (3, 4, 1, 6))
    ]


@cases_for("conv2d")
def _conv2d(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    out = []
    for n, c, h, w, o, kh, kw, attrs in (
        (1, 1, 1, 1, 1, 1, 1, {}),
        (2, 3, 7, 9, 4, 3, 3, {"padding": (1, 1)}),
        (1, 4, 8, 8, 6, 1, 1, {}),
        (1, 2, 11, 13, 3, 3, 2, {"stride": (2, 1)}),
        (1, 4, 9, 9, 4, 3, 3, {"groups": 2, "dilation": (2, 2)}),
    ):
        g = int(attrs.get("groups", 1))  # type: ignore[call-overload]
        x, wt, b = _mm(rng, dtype, (n, c, h, w), (o, c // g, kh, kw), (o,))
        out.append(_one(f"x {(n, c, h, w)} w {(o, c // g, kh, kw)} {attrs}", x, wt, b, **attrs))
    return out


@cases_for("max_pool2d", "avg_pool2d")
def _pool(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    return [
        _one(f"{s} k{k} {a}", values(rng, s, dtype, True), kernel_size=k, **a)
        for s, k, a in (
            ((1, 1, 1, 1), (1, 1), {}),
            ((2, 3, 7, 9), (2, 2), {}),
            ((1, 2, 13, 11), (3, 3), {"stride": (2, 2), "padding": (1, 1)}),
            ((1, 1, 8, 8), (3, 3), {"ceil_mode": True, "stride": (2, 2)}),
        )
    ]


@cases_for("adaptive_avg_pool2d")
def _adaptive(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    return [
        _one(f"{s} -> {o}", values(rng, s, dtype, True), output_size=o)
        for s, o in (((1, 1, 1, 1), (1, 1)), ((2, 3, 7, 9), (3, 4)), ((1, 2, 13, 11), (1, 1)))
    ]


@cases_for("scaled_dot_product_attention")
def _sdpa(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    out = []
    for b, h, lq, lk, d, causal in (
        (1, 1, 1, 1, 1, False),
        (2, 3, 7, 13, 5, False),
        (1, 2, 9, 9, 4, True),
        (1, 1, 17, 33, 8, False),
    ):
        q, k, v = _mm(rng, dtype, (b, h, lq, d), (b, h, lk, d), (b, h, lk, d))
        out.append(_one(f"q {(b, h, lq, d)} k {(b, h, lk, d)} causal={causal}", q, k, v, is_causal=causal))
    q, k, v = _mm(rng, dtype, (1, 2, 5, 4), (1, 2, 6, 4), (1, 2, 6, 4))
    out.append(_one("bool mask", q, k, v, rng.random((5, 6)) < 0.8))
    return out


@cases_for("pad")
def _pad(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    return [
        _one(f"{s} pads {p}", values(rng, s, dtype), pads=p, value=1)
        for s, p in (((1,), (1, 2)), ((0, 3), (1, 1)), ((7, 13), (0, 3, 2, 1)), ((4, 9), (2, 0)))
    ]


@cases_for("permute")
def _permute(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    return [
        _one(f"{s} dims {d}", values(rng, s, dtype), dims=d)
        for s, d in (((1,), (0,)), ((0, 3), (1, 0)), ((3, 5, 7), (2, 0, 1)), ((1, long_n), (1, 0)))
    ] + [_one("transposed input", Layout(values(rng, (6, 5), dtype), "transposed"), dims=(1, 0))]


@cases_for("split")
def _split(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    return [
        _one(f"{s} sizes {z} dim {d}", values(rng, s, dtype), sizes=z, dim=d)
        for s, z, d in (((2,), (1, 1), 0), ((7, 13), (3, 4), 0), ((5, 13), (6, 7), 1), ((0, 4), (0, 0), 0))
    ]


@cases_for("concat")
def _concat(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    return [
        _one(f"{a} + {b} dim {d}", values(rng, a, dtype), values(rng, b, dtype), dim=d)
        for a, b, d in (((1,), (1,), 0), ((0, 3), (2, 3), 0), ((7, 13), (7, 4), 1), ((3, 5), (0, 5), 0))
    ]


@cases_for("reduce_sum", "reduce_mean", "reduce_max", "reduce_min")
def _reduce(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    out = generic_cases("reduce_sum", 1, rng, dtype, long_n)
    out = [c for c in out if not (c.label.startswith("empty") and True)]  # empty max/min is an error, sum not
    for s, d, k in (((13, 17), (1,), False), ((3, 5, 7), (0, 2), True), ((long_n, 2), (0,), False)):
        out.append(_one(f"{s} dims {d} keep {k}", values(rng, s, dtype, True), dims=d, keep_dims=k))
    return out


@cases_for("softmax")
def _softmax(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    out = generic_cases("softmax", 1, rng, dtype, long_n)
    out += [_one(f"{s} dim {d}", values(rng, s, dtype, True), dim=d) for s, d in (((13, 17), 0), ((3, 5, 7), 1))]
    return out


@cases_for("layer_norm")
def _row_norm(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    """Rows normalised over trailing dims, with and without the affine inputs (rms_norm has no bias)."""

    def c(label: str, shape: tuple[int, ...], ns: tuple[int, ...], affine: bool, layout: str | None = None) -> Case:
        x = values(rng, shape, dtype, True)
        xs = Layout(x, layout) if layout else x
        if not affine:
            return _one(label, xs, normalized_shape=ns)
        w, b = values(rng, ns, dtype, True), values(rng, ns, dtype, True)
        return _one(label, xs, w, b, normalized_shape=ns)

    cases = [
        c("one row (1, 1)", (1, 1), (1,), True),
        c("empty rows (0, 5)", (0, 5), (5,), True),
        c("prime (13, 17)", (13, 17), (17,), True),
        c("plain (13, 17)", (13, 17), (17,), False),
        c("two dims (3, 5, 7)", (3, 5, 7), (5, 7), True),
        c(f"long row (2, {long_n})", (2, long_n), (long_n,), True),
        c(f"many rows ({long_n}, 3)", (long_n, 3), (3,), True),
        c("transposed (6, 5)", (6, 5), (5,), True, "transposed"),
        c("negative (4, 9)", (4, 9), (9,), True, "negative"),
    ]
    cases.append(
        Case(
            "sequence",
            [
                Call((values(rng, s, dtype, True),), {"normalized_shape": s[-1:]})
                for s in ((3, 5), (2, 9), (3, 5), (1, 2, 9))
            ],
        )
    )
    return cases


@cases_for("rms_norm")
def _rms_norm(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    out = []
    for case in _row_norm(rng, dtype, long_n):
        for call in case.calls:
            call.inputs = call.inputs[:2]  # x and weight: rms_norm has no bias
        out.append(case)
    return out


@cases_for("group_norm")
def _group_norm(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    def c(shape: tuple[int, ...], groups: int, affine: bool) -> Case:
        x = values(rng, shape, dtype, True)
        if not affine:
            return _one(f"{shape} groups {groups}", x, num_groups=groups)
        w, b = values(rng, (shape[1],), dtype, True), values(rng, (shape[1],), dtype, True)
        return _one(f"{shape} groups {groups} affine", x, w, b, num_groups=groups)

    return [
        c((1, 1), 1, False),
        c((2, 6, 5), 3, True),
        c((3, 4, 7, 5), 2, True),
        c((2, 8, 9), 8, False),
        c((1, 4, max(long_n // 4, 1)), 2, True),
    ]


@cases_for("argmax")
def _argmax(rng: np.random.Generator, dtype: DType, long_n: int) -> list[Case]:
    def c(label: str, shape: tuple[int, ...], dim: int, keep: bool = False, layout: str | None = None) -> Case:
        distinct = (rng.permutation(int(np.prod(shape))) + 1).reshape(shape)  # no ties: one right answer
        x = np.asarray(np.sign(values(rng, shape, dtype, True)) * distinct, dtype.np)
        return _one(label, Layout(x, layout) if layout else x, dim=dim, keep_dims=keep)

    return [
        c("one element (1,)", (1,), 0),
        c("prime (13, 17) dim 1", (13, 17), 1),
        c("prime (13, 17) dim 0 keep", (13, 17), 0, True),
        c("three dims (3, 5, 7) dim 1", (3, 5, 7), 1),
        c(f"long (1, {long_n})", (1, long_n), 1),
        c(f"long ({long_n}, 2) dim 0", (long_n, 2), 0),
        c("transposed (6, 5)", (6, 5), 1, layout="transposed"),
        c("negative (4, 9)", (4, 9), 1, layout="negative"),
    ]
