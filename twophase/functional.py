"""The one-shot functional API, generated from the registry: ``twophase.softmax(x, dim=-1)``.

Each call runs phase 1 through the executor cache, allocates missing outputs and the workspace from the
pool, enqueues phase 2 on ``stream`` (the device's default stream of the calling thread otherwise) and
frees the workspace in stream order. It returns at once with the output tensor(s).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import CaptureError, ParamError
from .executor import ExecState
from .op import Op, registry
from .ops.elementwise import weak_scalar
from .runtime.device import placement
from .runtime.stream import Stream
from .tensor import Tensor

__all__ = ["one_shot", "functions"]

_made: dict[Op, Callable[..., Any]] = {}


def one_shot(op: Op) -> Callable[..., Any]:
    """The functional form of ``op``: ``f(*inputs, out=None, stream=None, **attrs) -> Tensor | tuple``."""
    if not isinstance(op, Op):
        raise ParamError(op="one_shot", arg="op", expected="an Op (twophase.ops.NAME)", got=type(op).__name__)
    fn = _made.get(op)
    if fn is not None:
        return fn
    multi = len(op.spec.outputs) > 1 or op.spec.outputs[0].endswith("*")

    def call(*inputs: Any, out: Any = None, stream: Stream | None = None, **attrs: Any) -> Any:
        dev, s = placement(inputs, stream, op.name)
        copies: list[Tensor] = []  # host inputs copied in: the caller has no handle, so they are freed here
        try:
            ins = inputs
            for x in inputs:
                if x is not None and not isinstance(x, Tensor):
                    ins = _inputs_to_device(op, dev, inputs, s, copies)
                    break
            size, ex = op.get_workspace_size(*ins, out=out, **attrs)
            new: list[Tensor] = []
            try:
                new = ex._bind_new_outputs(dev, s)
                ws = dev.malloc(size, stream=s) if size else None
            except BaseException:
                for t in new:
                    t.free(s)
                if ex.state is ExecState.READY:
                    ex.destroy()
                raise
            outs = ex.outputs
            try:
                op(ws, size, ex, s)
            except BaseException:
                for t in new:
                    t.free(s)
                if ex.state is ExecState.READY:  # refused, or raised by a blocking launch before its release
                    ex.destroy()
                raise
            finally:
                if ws is not None:
                    ws.free(s)
        finally:
            for t in copies:
                t.free(s)  # in stream order: after the launch that reads it
        return tuple(outs) if multi else outs[0]

    call.__name__ = call.__qualname__ = op.name
    call.__doc__ = f"One-shot ``{op.name}``: phase 1 (cached), workspace from the pool, phase 2 on ``stream``.\n\n" + (
        op.spec.doc or ""
    )
    _made[op] = call
    return call


def _inputs_to_device(
    op: Op, dev: Any, inputs: tuple[Any, ...], stream: Stream, copies: list[Tensor]
) -> tuple[Any, ...]:
    """``inputs`` with every host input copied to ``dev``; a Python scalar among the op's promoted inputs takes
    their dtype (numpy 2's and torch's weak scalars: ``add(float16 x, 2.0)`` is float16)."""
    promotes = op.spec.promotes
    ins = []
    for i, x in enumerate(inputs):
        if x is None or isinstance(x, Tensor):
            ins.append(x)
            continue
        dtype = _weak_dtype(op, i, inputs) if i in promotes and _is_python_scalar(x) else None
        if dtype is not None:  # out-of-range ints in comparisons, negative int exponents of pow (before phase 1)
            x, dtype = weak_scalar(op.name, op.input_name(i, len(inputs)), x, dtype)
        ins.append(_to_device(op, dev, x, stream, copies, dtype, op.input_name(i, len(inputs))))
    return tuple(ins)


def _is_python_scalar(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, np.generic)  # numpy scalars keep their dtype


def _weak_dtype(op: Op, i: int, inputs: tuple[Any, ...]) -> np.dtype[Any] | None:
    """The dtype Python scalar ``inputs[i]`` takes beside the op's other promoted inputs (None: none is typed)."""
    strong = []
    for j in op.spec.promotes:
        x = inputs[j] if j < len(inputs) else None
        if j == i or x is None or _is_python_scalar(x):
            continue
        try:
            strong.append(x.dtype.np if isinstance(x, Tensor) else np.asarray(x).dtype)
        except (TypeError, ValueError):
            return None  # not an array-like: _to_device names it
    return np.result_type(*strong, inputs[i]) if strong else None


def _to_device(
    op: Op,
    dev: Any,
    x: Any,
    stream: Stream,
    copies: list[Tensor],
    dtype: np.dtype[Any] | None = None,
    arg: str = "input",
) -> Tensor:
    """``x`` (an array-like or a scalar) copied to ``dev`` on ``stream``, recorded in ``copies``."""
    try:
        with np.errstate(over="ignore"):  # a weak float past the dtype's range is inf, as in numpy's arithmetic
            arr = np.asarray(x, dtype=dtype)
    except OverflowError:
        raise ParamError(op=op.name, arg=arg, expected=f"a value that fits {dtype}", got=x) from None
    except (TypeError, ValueError):
        raise ParamError(op=op.name, arg=arg, expected="a Tensor or an array-like", got=type(x).__name__) from None
    if arr.dtype == object:
        raise ParamError(
            op=op.name,
            arg=arg,
            expected="a Tensor or a numeric array-like",
            got=f"{type(x).__name__} of Python objects" if arr.ndim else type(x).__name__,
        )
    try:
        t: Tensor = dev.tensor(arr, stream=stream)
    except ParamError as e:  # the device's own words: which dtypes it holds
        raise ParamError(op=op.name, arg=arg, expected=e.expected, got=e.got) from None
    except CaptureError:  # its copy-in would be captured into memory that exists only once the graph does
        raise CaptureError(
            "a host input cannot be copied in during a capture",
            op=op.name,
            arg=arg,
            expected="a device tensor made before the capture (Device.tensor)",
            got=f"{type(x).__name__} {arr.dtype}{list(arr.shape)}",
        ) from None
    copies.append(t)
    return t


def functions() -> dict[str, Callable[..., Any]]:
    """Every registered op's one-shot function, by name."""
    return {name: one_shot(op) for name, op in registry.items()}
