"""Attribute converters and operand checks shared by the op families (they raise ``ParamError``)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..config import int_value
from ..errors import ParamError
from ..tensor import DType, TensorDesc

FLOATS = (DType.float16, DType.float32, DType.float64)
NUMERIC = FLOATS + (DType.int32, DType.int64)


def _expects(text: str) -> Callable[[Callable[[Any], Any]], Callable[[Any], Any]]:
    def deco(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        fn.expects = text  # type: ignore[attr-defined]
        return fn

    return deco


@_expects("an int")
def as_int(v: Any) -> int:
    n = int_value(v)
    if n is None:
        raise TypeError(v)
    return n


@_expects("a real number")
def as_float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(v)
    return float(v)


@_expects("a finite real number")
def as_finite(v: Any) -> float:
    f: float = as_float(v)
    if not math.isfinite(f):
        raise ValueError(v)
    return f


@_expects("a number (int, float or bool)")
def as_scalar(v: Any) -> int | float | bool:
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    raise TypeError(v)


@_expects("a bool")
def as_bool(v: Any) -> bool:
    """A bool, numpy's too (``np.True_``, as ``as_scalar`` reads it), or a Python int 0 / 1; numpy ints, floats and
    strings are refused."""
    if isinstance(v, np.bool_):
        return bool(v)
    if not isinstance(v, (bool, int)) or v not in (0, 1):
        raise TypeError(v)
    return bool(v)


@_expects("an int or a sequence of ints")
def as_dims(v: Any) -> tuple[int, ...]:
    n = int_value(v)
    if n is not None:
        return (n,)
    if isinstance(v, (str, bytes)) or not isinstance(v, Iterable):
        raise TypeError(v)
    return tuple(as_int(x) for x in v)


def optional(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A converter that also accepts None."""

    def conv(v: Any) -> Any:
        return None if v is None else convert(v)

    conv.expects = f"None or {getattr(convert, 'expects', 'a value')}"  # type: ignore[attr-defined]
    return conv


def choice(*options: Any) -> Callable[[Any], Any]:
    """A converter that accepts exactly one of ``options``."""

    def conv(v: Any) -> Any:
        if v not in options:
            raise ValueError(v)
        return v

    conv.expects = f"one of {options}"  # type: ignore[attr-defined]
    return conv


def check_dtype(op: str, arg: str, desc: TensorDesc, allowed: Iterable[DType]) -> None:
    allowed = tuple(allowed)
    if desc.dtype not in allowed:
        raise ParamError(op=op, arg=arg, expected=f"dtype in {[d.value for d in allowed]}", got=desc.dtype.value)


def norm_dim(op: str, arg: str, dim: int, ndim: int) -> int:
    """A dim in ``[-ndim, ndim)`` as a non-negative index (a 0-d tensor takes 0 and -1, as one of shape (1,))."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise ParamError(op=op, arg=arg, expected=f"a dim in [{-n}, {n})", got=dim)
    return dim % n


def norm_dims(op: str, arg: str, dims: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    """Sorted unique non-negative dims of a reduction; repeated dims are an error, and so is any dim of a 0-d
    tensor (numpy's AxisError: it has no dim to reduce; ``()`` reduces all dims)."""
    if ndim == 0 and dims:
        raise ParamError(
            op=op, arg=arg, expected="no dims: any dim is out of range for a 0-d tensor (() reduces all dims)", got=dims
        )
    out = tuple(sorted(norm_dim(op, arg, d, ndim) for d in dims))
    if len(set(out)) != len(out):
        raise ParamError(op=op, arg=arg, expected="distinct dims", got=dims)
    return out


def need(op: str, arg: str, desc: TensorDesc | None) -> TensorDesc:
    """The desc of a required operand (``ParamError`` with the nullptr status if it is missing)."""
    if desc is None:
        from ..errors import Status

        raise ParamError(op=op, arg=arg, expected="a tensor", got="None", status=Status.ERR_PARAM_NULLPTR)
    return desc


def cast_scalar(op: str, arg: str, value: float, dtype: DType) -> float:
    """``value`` as it is written into ``dtype`` (an int dtype truncates a float toward 0, as numpy's cast), or
    ParamError where numpy would raise only in the kernel, at sync, or silently wrap: NaN, inf or out of range for
    an int dtype, other than 0 / 1 for bool, past float64's range; a float dtype overflows to inf as numpy."""
    if dtype is DType.bool:
        if value in (0, 1):
            return bool(value)
        expected = "0 or 1"
    elif dtype.is_float:
        try:
            float(value)  # only an int can fail (OverflowError); the value itself is kept for numpy to round
            return value
        except OverflowError:
            expected = "a number within float64's range"
    else:
        info = np.iinfo(dtype.np)
        n = int(value) if not isinstance(value, float) or math.isfinite(value) else None
        if n is not None and info.min <= n <= info.max:
            return n
        what = "a finite number whose integer part is" if isinstance(value, float) else "an int"
        expected = f"{what} in [{info.min}, {info.max}] ({dtype.value})"
    raise ParamError(op=op, arg=arg, expected=expected, got=value)
