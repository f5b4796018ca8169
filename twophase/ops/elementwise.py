"""Elementwise ops, generated from tables: binary (broadcasting, numpy type promotion), comparisons, where,
unary (vectorized math kernels for the transcendental ones) and cast."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ParamError
from ..kernels.cpu import half, streaming
from ..kernels.cpu.elementwise import FANOUT_MIN, build_unary
from ..layout import align, broadcast_shape, merge_dims, same_view
from ..op import Attr, Op, OpDef, Plan, register
from ..runtime.fanout import fanout_parts, launcher, pieces
from ..tensor import DType, Format, TensorDesc
from .checks import FLOATS, NUMERIC, as_scalar, cast_scalar, check_dtype, choice, need
from .selection import Candidate, choose

__all__ = ["BINARY", "COMPARE", "UNARY", "unary_reference", "weak_scalar"]

Builder = Callable[[Plan, dict[str, Any], tuple[Any, ...], tuple[Any, ...]], Callable[[Any], None]]
INTS = (DType.int32, DType.int64)
WITH_BOOL = NUMERIC + (DType.bool,)


def _zero_plan(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
    return Plan("ufunc", None, 0)


def _promote(op: str, descs: list[tuple[str, TensorDesc]], allowed: tuple[DType, ...]) -> tuple[tuple[int, ...], DType]:
    for arg, d in descs:
        check_dtype(op, arg, d, allowed)
    shape = broadcast_shape(*(d.shape for _, d in descs))
    if shape is None:
        raise ParamError(
            op=op,
            arg=descs[-1][0],
            expected=f"a shape that broadcasts with {descs[0][1].shape}",
            got=descs[-1][1].shape,
        )
    return shape, DType.of(np.result_type(*(d.dtype.np for _, d in descs)))


def _common_format(*descs: TensorDesc) -> Format:
    """The operands' format tag when they all carry the same one, else ND (a layout the result may not have)."""
    f = descs[0].format
    return f if all(d.format is f for d in descs[1:]) else Format.ND


# ---- binary arithmetic
BINARY: dict[str, tuple[Any, Any]] = {  # name: (ufunc, float64 reference)
    "add": (np.add, lambda x, other, alpha=1: np.add(x, np.multiply(other, alpha))),
    "sub": (np.subtract, lambda x, other, alpha=1: np.subtract(x, np.multiply(other, alpha))),
    "mul": (np.multiply, lambda x, other: np.multiply(x, other)),
    "div": (np.true_divide, lambda x, other: np.true_divide(x, other)),
    "maximum": (np.maximum, lambda x, other: np.maximum(x, other)),
    "minimum": (np.minimum, lambda x, other: np.minimum(x, other)),
    "pow": (np.power, lambda x, other: np.power(x, other)),
}


def _binary_infer(name: str) -> Callable[[tuple[TensorDesc | None, ...], dict[str, Any]], tuple[TensorDesc, ...]]:
    def infer(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
        x, other = need(name, "x", ins[0]), need(name, "other", ins[1])
        shape, dtype = _promote(name, [("x", x), ("other", other)], NUMERIC)
        if name == "div" and not dtype.is_float:
            dtype = DType.float64  # true division of integers (numpy's rule)
        if "alpha" in attrs:
            if not dtype.is_float and isinstance(attrs["alpha"], float):
                raise ParamError(op=name, arg="alpha", expected="an int for integer operands", got=attrs["alpha"])
            cast_scalar(name, "alpha", attrs["alpha"], dtype)  # 2**40 for int32: numpy raises only at sync
        return (TensorDesc(shape, dtype, format=_common_format(x, other)),)

    return infer


def _streaming_select(name: str) -> Any:
    """Phase 1 of add / sub / mul / div: 'streaming' (non-temporal stores, ``kernels/cpu/streaming.py``) where the
    operands and the output are dense, of one float dtype and one shape (``alpha`` 1), ranked first from outputs of
    ``streaming.stream_threshold()`` bytes; 'half' (``kernels/cpu/half.py``) first for such float16 ones where the
    CPU converts float16; numpy's 'ufunc' otherwise, and first below that size."""

    def select(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
        out = outs[0]
        ufunc = Candidate("ufunc", None, 0)
        same = attrs.get("alpha", 1) == 1 and all(d.shape == out.shape and d.dtype is out.dtype for d in ins)
        if same and out.dtype is DType.float16 and half.available() and all(d.is_contiguous for d in (out, *ins)):
            return choose(name, [Candidate("half", None, 0), ufunc], limit)
        if not (same and streaming.offered(out, *ins)):
            return choose(name, [ufunc], limit)
        return choose(name, streaming.ranked(Candidate("streaming", None, 0), ufunc, out.nbytes), limit)

    return select


def _build_flat(impl: str, name: str, x: Any, y: Any, out: Any) -> Callable[[Any], None] | None:
    """The 'streaming' or 'half' launch, in one part per helper thread from ``FANOUT_MIN`` elements; None where the
    bound memory cannot take it (``streaming.takes``, in place into x or y allowed; numpy then buffers an
    overlapping output)."""
    if not streaming.takes((x, y), out, in_place=True):
        return None
    parts = fanout_parts() if out.size >= FANOUT_MIN else 1
    if impl == "half":
        return half.binary_launch(name, x, y, out, parts, FANOUT_MIN // 2)
    return streaming.flat_launch(streaming.KERNELS[name], (x, y), out, parts, FANOUT_MIN // 2)


def _binary_build(ufunc: Any, name: str = "") -> Builder:
    """The launch of a binary op: numpy's ``ufunc`` in parts, or op ``name``'s 'streaming' kernel where planned."""

    def build(plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]) -> Callable[[Any], None]:
        x, y = ins
        out = outs[0]
        if plan.implementation in ("streaming", "half"):
            launch = _build_flat(plan.implementation, name, x, y, out)
            if launch is not None:
                return launch
        alpha = attrs.get("alpha", 1)
        if out.dtype.kind == "f":
            alpha = float(alpha)  # an int past int64 (checked in phase 1) is an object array to numpy < 2.4
        if alpha != 1 and np.shares_memory(out, x):
            scratch = np.empty(np.broadcast_shapes(y.shape, out.shape), out.dtype)  # in-place case, made at bind

            def scaled_inplace(_: Any) -> None:
                np.multiply(y, alpha, out=scratch, dtype=scratch.dtype)  # alpha * other in the promoted dtype
                ufunc(x, scratch, out=out)

            return scaled_inplace

        def scaled(o: Any, a: Any, b: Any) -> None:
            np.multiply(b, alpha, out=o, dtype=o.dtype)  # in the promoted dtype, not other's
            ufunc(a, o, out=o)

        parts = fanout_parts() if out.size >= FANOUT_MIN else 1
        cut = pieces(out, (x, y), parts, FANOUT_MIN // 2)
        if alpha == 1:
            return launcher([functools.partial(ufunc, a, b, out=o) for o, a, b in cut])
        return launcher([functools.partial(scaled, o, a, b) for o, a, b in cut])

    return build


def _register_binary() -> None:
    for name, (ufunc, ref) in BINARY.items():
        scaled = name in ("add", "sub")
        register(
            OpDef(
                name=name,
                inputs=("x", "other"),
                attrs=(Attr("alpha", as_scalar, 1, "scale of other"),) if scaled else (),
                dtypes=NUMERIC,
                infer=_binary_infer(name),
                select=_streaming_select(name) if name in streaming.CODES else _zero_plan,
                kernels={"cpu": _binary_build(ufunc, name)},
                implementations=("ufunc", "streaming", "half") if name in streaming.CODES else ("ufunc",),
                workspace_formula="0",
                aliases="any",
                promotes=(0, 1),
                doc=(
                    f"out = {name}(x, {'alpha * ' if scaled else ''}other) with numpy broadcasting and type promotion "
                    f"(dtypes {[d.value for d in NUMERIC]}). Workspace: 0 bytes."
                    + (
                        " Implementations: 'ufunc' (numpy's); 'streaming' (vector stores that bypass the cache) where "
                        "operands and output are dense float32 / float64 of one shape (alpha 1), ranked first from "
                        "outputs of the last-level cache's size (at most 64 MiB); 'half' (float16 converted by the "
                        "CPU's F16C instructions, computed in float32 and rounded once, as numpy's float16 loops do) "
                        "where they are dense float16 of one shape (alpha 1), ranked first."
                        if name in streaming.CODES
                        else ""
                    )
                ),
                reference=ref,
            )
        )


# ---- comparisons (bool out)
COMPARE: dict[str, Any] = {
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
}


def _register_compare() -> None:
    for name, ufunc in COMPARE.items():

        def infer(
            ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any], name: str = name
        ) -> tuple[TensorDesc, ...]:
            x, other = need(name, "x", ins[0]), need(name, "other", ins[1])
            shape, _ = _promote(name, [("x", x), ("other", other)], WITH_BOOL)
            return (TensorDesc(shape, DType.bool, format=_common_format(x, other)),)

        register(
            OpDef(
                name=name,
                inputs=("x", "other"),
                dtypes=WITH_BOOL,
                infer=infer,
                select=_zero_plan,
                kernels={"cpu": _binary_build(ufunc)},
                implementations=("ufunc",),
                workspace_formula="0",
                aliases="any",
                promotes=(0, 1),
                doc=f"Elementwise {name} with broadcasting; bool out. Workspace: 0 bytes.",
                reference=lambda x, other, f=ufunc: f(x, other),
            )
        )


# ---- Python scalars given to the one-shot API
def weak_scalar(op: str, arg: str, value: Any, dtype: np.dtype[Any]) -> tuple[Any, np.dtype[Any]]:
    """(value, dtype) that the one-shot API copies in for Python scalar ``value`` passed as input ``arg`` of ``op``
    beside operands of ``dtype`` (its weak dtype, numpy 2's rule); ``(value, dtype)`` itself but for two cases:

    - a comparison with an int outside an integer ``dtype``'s range gives numpy 2's answer, as if with the exact
      value: the scalar is copied in as float64 +inf or -inf, beyond every value of the operand (``lt(int32 x,
      2**40)`` all True, ``eq`` all False). Other ops still refuse such an int (it does not fit ``dtype``);
    - ``pow`` of integers with a negative int exponent is refused here, before phase 1 (numpy raised its "Integers
      to negative integer powers are not allowed" only in the kernel, a KernelError at sync; a tensor exponent with
      negative values still fails there, with that message)."""
    if dtype.kind not in "iu" or not isinstance(value, int):
        return value, dtype
    if op in COMPARE:
        info = np.iinfo(dtype)
        if not info.min <= value <= info.max:
            return (math.inf if value > 0 else -math.inf), np.dtype(np.float64)
    elif op == "pow" and arg == "other" and value < 0:
        raise ParamError(
            op=op,
            arg=arg,
            expected=f"an exponent >= 0 for integer operands ({dtype}): integers to negative integer powers are "
            "not allowed",
            got=value,
        )
    return value, dtype


# ---- where
def _infer_where(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
    cond, x, y = need("where", "cond", ins[0]), need("where", "x", ins[1]), need("where", "y", ins[2])
    check_dtype("where", "cond", cond, (DType.bool,))
    shape, dtype = _promote("where", [("x", x), ("y", y)], WITH_BOOL)
    full = broadcast_shape(cond.shape, shape)
    if full is None:
        raise ParamError(op="where", arg="cond", expected=f"a shape that broadcasts with {shape}", got=cond.shape)
    return (TensorDesc(full, dtype, format=_common_format(cond, x, y)),)


def _build_where(
    plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]
) -> Callable[[Any], None]:
    cond, x, y = ins
    out = outs[0]
    if same_view(out, x):

        def keep_x(_: Any) -> None:  # out is x (in place): y only where cond is false
            np.copyto(out, y, casting="unsafe", where=np.logical_not(cond))

        return keep_x

    fill = half.copier(out, y)  # a no-op where out is y (in place)

    def launch(_: Any) -> None:
        fill()
        np.copyto(out, x, casting="unsafe", where=cond)

    return launch


register(
    OpDef(
        name="where",
        inputs=("cond", "x", "y"),
        dtypes=WITH_BOOL,
        infer=_infer_where,
        select=_zero_plan,
        kernels={"cpu": _build_where},
        implementations=("ufunc",),
        workspace_formula="0",
        aliases=(1, 2),
        promotes=(1, 2),
        doc="out = x where cond else y, broadcasting all three; out dtype promotes x and y. Workspace: 0 bytes.",
        reference=lambda cond, x, y: np.where(cond, x, y),
    )
)


# ---- unary
UNARY: dict[str, tuple[str, Any, tuple[DType, ...], Callable[..., Any] | None]] = {
    # name: (kind, ufunc or vmath kernel name, dtypes, float64 reference)
    "neg": ("ufunc", np.negative, NUMERIC, np.negative),
    "abs": ("ufunc", np.abs, NUMERIC, np.abs),
    "sqrt": ("ufunc", np.sqrt, FLOATS, np.sqrt),
    "relu": ("ufunc", lambda x, out: np.maximum(x, x.dtype.type(0), out=out), NUMERIC, lambda x: np.maximum(x, 0)),
    "exp": ("vmath", "exp", FLOATS, np.exp),
    "log": ("vmath", "log", FLOATS, np.log),
    "tanh": ("vmath", "tanh", FLOATS, np.tanh),
    "sigmoid": ("vmath", "sigmoid", FLOATS, lambda x: 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))),
    "silu": ("vmath", "silu", FLOATS, lambda x: x / (1.0 + np.exp(-np.asarray(x, np.float64)))),
    "rsqrt": ("vmath", "rsqrt", FLOATS, lambda x: 1.0 / np.sqrt(x)),
    "gelu": ("vmath", None, FLOATS, None),  # kernel and reference depend on ``approximate``
}


def _gelu_reference(x: Any, approximate: str = "none") -> Any:
    """float64 gelu in forms without cancellation for negative x: x/2 erfc(-x/sqrt 2) and x sigmoid(2u)."""
    from math import erfc

    x = np.asarray(x, np.float64)
    if approximate == "tanh":
        u = np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)
        with np.errstate(over="ignore"):
            return x / (1.0 + np.exp(-2.0 * u))
    return 0.5 * x * np.vectorize(erfc, otypes=[np.float64])(-x / np.sqrt(2.0))


def unary_reference(name: str) -> Callable[[Any], Any]:
    """The float64 reference of unary op ``name``, or of an activation named as the kernels name it
    (``gelu_erf``, ``gelu_tanh``)."""
    if name in ("gelu", "gelu_erf"):
        return _gelu_reference
    if name == "gelu_tanh":
        return lambda x: _gelu_reference(x, "tanh")
    ref: Callable[[Any], Any] | None = UNARY[name][3]
    assert ref is not None, f"{name} has no reference"
    return ref


def unary_needs_pack(x: TensorDesc, out: TensorDesc) -> bool:
    """float16 computes through a float32 workspace copy; so do layouts whose leading dims do not merge."""

    def ok(d: TensorDesc) -> bool:
        return d.ndim == 0 or merge_dims(d.shape[:-1], d.strides[:-1]) is not None

    return x.numel > 0 and (x.dtype is DType.float16 or not ok(x) or not ok(out))


def _unary_infer(name: str, dtypes: tuple[DType, ...]) -> Any:
    def infer(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
        x = need(name, "x", ins[0])
        check_dtype(name, "x", x, dtypes)
        return (TensorDesc(x.shape, x.dtype, format=x.format),)

    return infer


def _vmath_select(name: str) -> Any:
    """Phase 1 of a vector-math unary op: 'packed' where ``unary_needs_pack``; else 'vector', and
    'vector_streaming' (non-temporal stores, ``kernels/cpu/streaming.py``) where x and the output are dense float32
    / float64, ranked first from outputs of ``streaming.stream_threshold()`` bytes."""

    def select(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
        x, out = ins[0], outs[0]
        if unary_needs_pack(x, out):
            return Plan("packed", True, align(x.numel * max(4, x.dtype.itemsize)))
        vector = Candidate("vector", False, 0)
        if not streaming.offered(out, x):
            return choose(name, [vector], limit)
        return choose(name, streaming.ranked(Candidate("vector_streaming", False, 0), vector, out.nbytes), limit)

    return select


def _vmath_build(kname: str | None) -> Builder:
    def build(plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]) -> Callable[[Any], None]:
        name = kname or ("gelu_tanh" if attrs["approximate"] == "tanh" else "gelu_erf")
        x = ins[0]
        compute = np.dtype(np.float32) if x.dtype == np.float16 else x.dtype
        return build_unary(name, x, outs[0], plan.tiling, compute, plan.implementation == "vector_streaming")

    return build


def _ufunc_build(fn: Any) -> Builder:
    """numpy's ``fn`` in parts on helper threads from ``FANOUT_MIN`` elements, as the binary ops (one call was one
    thread: relu of 4096 x 4096 float32 ran at 0.6x np.copyto's bandwidth)."""

    def build(plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]) -> Callable[[Any], None]:
        x, out = ins[0], outs[0]
        parts = fanout_parts() if out.size >= FANOUT_MIN else 1
        return launcher([functools.partial(fn, a, out=o) for o, a in pieces(out, (x,), parts, FANOUT_MIN // 2)])

    return build


_STREAM_DOC = (
    "Implementations: 'vector' (vectorized loops), 'vector_streaming' (the same with stores that bypass the "
    "cache, ranked first for dense float32 / float64 outputs from the last-level cache's size), 'packed'."
)
_PACK_DOC = "0, or align64(numel * max(4, itemsize)) when packed (float16, or leading dims that do not merge)"


def _register_unary() -> None:
    for name, (kind, impl, dtypes, ref) in UNARY.items():
        vm = kind == "vmath"
        register(
            OpDef(
                name=name,
                inputs=("x",),
                dtypes=dtypes,
                infer=_unary_infer(name, dtypes),
                attrs=(Attr("approximate", choice("none", "tanh"), "none", "'none' (erf) or 'tanh'"),)
                if name == "gelu"
                else (),
                select=_vmath_select(name) if vm else _zero_plan,
                kernels={"cpu": _vmath_build(impl) if vm else _ufunc_build(impl)},
                implementations=("vector", "vector_streaming", "packed") if vm else ("ufunc",),
                workspace_formula=_PACK_DOC if vm else "0",
                aliases=(0,),
                doc=(
                    f"Elementwise {name} (dtypes {[d.value for d in dtypes]}). Workspace: "
                    + (_PACK_DOC + "; float16 is computed in float32. " + _STREAM_DOC if vm else "0 bytes.")
                    + (
                        f" {name}(-inf) is NaN (-inf x 0), as in torch, not the limit -0."
                        if name in ("gelu", "silu")
                        else ""
                    )
                ),
                reference=ref if ref is not None else _gelu_reference,
            )
        )


# ---- cast
def _as_dtype(v: Any) -> DType:
    return DType.of(v)


_as_dtype.expects = f"a dtype in {[d.value for d in DType]}"  # type: ignore[attr-defined]


def _infer_cast(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
    x = need("cast", "x", ins[0])
    return (TensorDesc(x.shape, attrs["dtype"], format=x.format),)


def _build_cast(
    plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]
) -> Callable[[Any], None]:
    x, out = ins[0], outs[0]
    call = half.copier(out, x)
    return lambda _: call()


_register_binary()
_register_compare()
_register_unary()
cast: Op = register(
    OpDef(
        name="cast",
        inputs=("x",),
        attrs=(Attr("dtype", _as_dtype, doc="target dtype"),),
        dtypes=tuple(DType),
        infer=_infer_cast,
        select=_zero_plan,
        kernels={"cpu": _build_cast},
        implementations=("ufunc",),
        workspace_formula="0",
        aliases=(0,),
        doc="out = x converted to ``dtype`` (numpy's unsafe casting: floats truncate toward 0). Workspace: 0 bytes.",
        reference=lambda x, dtype: np.asarray(x).astype(DType.of(dtype).np),
    )
)
