"""Run one op call under test conditions: outputs poisoned before the run, the workspace surrounded by
guard bytes and filled with a pattern, so tests can assert every output element was written, nothing
was written outside the workspace, and how far into the workspace the kernel wrote."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..op import Op
from ..runtime.device import Device, device
from ..runtime.memory import Block
from ..runtime.stream import Stream
from ..tensor import Tensor

GUARD = 512
PATTERN = 0xCD


@dataclass
class CheckedRun:
    outputs: tuple[np.ndarray[Any, Any], ...]
    workspace_size: int
    implementation: str
    tiling: Any
    touched: int  # one past the highest workspace byte that the kernel changed (0 if none)
    guards_intact: bool
    unwritten: tuple[int, ...]  # per output: elements still holding the poison


def guarded_workspace(dev: Device, size: int, stream: Stream) -> tuple[Block, Block]:
    """(outer block, inner block): the inner block's memory sits between two guard zones of GUARD bytes."""
    outer = dev.malloc(size + 2 * GUARD, stream=stream)
    outer.data[:] = PATTERN
    inner = Block(outer.pool, outer.segment, outer.offset + GUARD, size)
    inner.allocated = True
    inner.data = outer.data[GUARD:GUARD + size]
    return outer, inner


def _poison(t: Tensor) -> None:
    v = t.view()
    if v.dtype.kind == "f":
        v[...] = np.nan
    elif v.dtype.kind == "b":
        v[...] = True
    else:
        v[...] = np.iinfo(v.dtype).min + 7


def _unwritten(t: Tensor) -> int:
    v = t.view()
    if v.dtype.kind == "f":
        return int(np.isnan(v).sum())
    return 0  # integer / bool outputs cannot be told apart from a legitimately equal value


def run_checked(op: Op, *inputs: Any, stream: Stream | None = None, out: Any = None, **attrs: Any) -> CheckedRun:
    """Phase 1 on the given inputs (numpy arrays are copied to the device, Tensors used as they are),
    poisoned outputs, a guarded workspace, phase 2, synchronize, then report what was written.

    Float outputs are poisoned with NaN: ``unwritten`` counts NaNs left, so compare it with the NaNs the
    reference has.
    """
    dev = device("cpu")
    stream = stream or dev.stream()
    tensors = [x if (isinstance(x, Tensor) or x is None) else dev.tensor(np.asarray(x), stream=stream)
               for x in inputs]
    stream.synchronize()
    given_out = out if isinstance(out, (tuple, list)) else (out,)
    for t in (*tensors, *given_out):
        if isinstance(t, Tensor):
            t.synchronize()  # tensors made on another stream may still be copying in
    size, ex = op.get_workspace_size(*tensors, out=out, **attrs)
    ex._bind_new_outputs(dev, stream)
    outs = [t for t in ex.outputs if t is not None]
    for t in outs:
        _poison(t)
    outer, inner = guarded_workspace(dev, size, stream)
    try:
        op(inner, size, ex, stream)
        stream.synchronize()
        raw = outer.data
        guards = bool((raw[:GUARD] == PATTERN).all() and (raw[GUARD + size:GUARD + size + GUARD] == PATTERN).all())
        changed = np.nonzero(raw[GUARD:GUARD + size] != PATTERN)[0]
        touched = int(changed[-1]) + 1 if changed.size else 0
        result = tuple(np.array(t.view(), copy=True) for t in outs)
        return CheckedRun(result, size, ex.implementation, ex.tiling, touched, guards,
                          tuple(_unwritten(t) for t in outs))
    finally:
        outer.free(stream)
