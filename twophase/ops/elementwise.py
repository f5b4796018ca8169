"""Elementwise ops with numpy broadcasting and type promotion."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import ParamError
from ..layout import broadcast_shape
from ..op import Attr, OpDef, Plan, register
from ..tensor import DType, TensorDesc
from .checks import NUMERIC, as_scalar, check_dtype, need


def _infer_add(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
    x, other = need("add", "x", ins[0]), need("add", "other", ins[1])
    check_dtype("add", "x", x, NUMERIC)
    check_dtype("add", "other", other, NUMERIC)
    shape = broadcast_shape(x.shape, other.shape)
    if shape is None:
        raise ParamError(op="add", arg="other", expected=f"a shape that broadcasts with {x.shape}", got=other.shape)
    dtype = DType.of(np.result_type(x.dtype.np, other.dtype.np))
    if not dtype.is_float and isinstance(attrs["alpha"], float):
        raise ParamError(op="add", arg="alpha", expected="an int for integer operands", got=attrs["alpha"])
    return (TensorDesc(shape, dtype),)


def _select_add(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
    return Plan("ufunc" if attrs["alpha"] == 1 else "ufunc_scaled", None, 0)


def _build_add(plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]) -> Callable[[Any], None]:
    x, y = ins
    out = outs[0]
    alpha = attrs["alpha"]
    if alpha == 1:
        return lambda _: np.add(x, y, out=out)  # type: ignore[no-any-return]
    if np.shares_memory(out, x):
        scratch = np.empty(np.broadcast_shapes(y.shape, out.shape), out.dtype)  # in-place case only

        def scaled_inplace(_: Any) -> None:
            np.multiply(y, alpha, out=scratch)
            np.add(x, scratch, out=out)
        return scaled_inplace

    def scaled(_: Any) -> None:
        np.multiply(y, alpha, out=out)
        np.add(x, out, out=out)
    return scaled


add = register(OpDef(
    name="add",
    inputs=("x", "other"),
    attrs=(Attr("alpha", as_scalar, 1, "scale of other"),),
    dtypes=NUMERIC,
    infer=_infer_add,
    select=_select_add,
    kernels={"cpu": _build_add},
    implementations=("ufunc", "ufunc_scaled"),
    workspace_formula="0",
    doc="out = x + alpha * other, with numpy broadcasting and type promotion. Workspace: 0 bytes.",
    reference=lambda x, other, alpha=1: np.add(x, np.multiply(other, alpha)),
))
