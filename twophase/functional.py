"""The one-shot functional API, generated from the registry: ``twophase.softmax(x, dim=-1)``.

Each call runs phase 1 through the executor cache, allocates missing outputs and the workspace from the
pool, enqueues phase 2 on ``stream`` (the device's default stream of the calling thread otherwise) and
frees the workspace in stream order. It returns at once with the output tensor(s).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import ParamError
from .executor import ExecState
from .op import Op, registry
from .runtime.device import placement
from .runtime.stream import Stream
from .tensor import Tensor

__all__ = ["one_shot", "functions"]

_made: dict[Op, Callable[..., Any]] = {}


def one_shot(op: Op) -> Callable[..., Any]:
    """The functional form of ``op``: ``f(*inputs, out=None, stream=None, **attrs) -> Tensor | tuple``."""
    fn = _made.get(op)
    if fn is not None:
        return fn
    multi = len(op.spec.outputs) > 1 or op.spec.outputs[0].endswith("*")

    def call(*inputs: Any, out: Any = None, stream: Stream | None = None, **attrs: Any) -> Any:
        dev, s = placement(inputs, stream)
        copies: list[Tensor] = []  # host inputs copied in: the caller has no handle, so they are freed here
        try:
            ins = tuple(x if x is None or isinstance(x, Tensor) else _to_device(op, dev, x, s, copies)
                        for x in inputs)
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
    call.__doc__ = f"One-shot ``{op.name}``: phase 1 (cached), workspace from the pool, phase 2 on ``stream``.\n\n" \
        + (op.spec.doc or "")
    _made[op] = call
    return call


def _to_device(op: Op, dev: Any, x: Any, stream: Stream, copies: list[Tensor]) -> Tensor:
    """``x`` (an array-like or a scalar) copied to ``dev`` on ``stream``, recorded in ``copies``."""
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError):
        raise ParamError(op=op.name, arg="input", expected="a Tensor or an array-like", got=type(x).__name__) from None
    if arr.dtype == object:
        raise ParamError(op=op.name, arg="input", expected="a Tensor or a numeric array-like",
                         got=f"{type(x).__name__} of Python objects" if arr.ndim else type(x).__name__)
    try:
        t: Tensor = dev.tensor(arr, stream=stream)
    except ParamError as e:  # the device's own words: which dtypes it holds
        raise ParamError(op=op.name, arg="input", expected=e.expected, got=e.got) from None
    copies.append(t)
    return t


def functions() -> dict[str, Callable[..., Any]]:
    """Every registered op's one-shot function, by name."""
    return {name: one_shot(op) for name, op in registry.items()}
