"""Run one op call under test conditions: outputs poisoned before the run, the workspace surrounded by
guard bytes and filled with a pattern, the bytes of an output's buffer that are not its elements (the gaps of a
strided ``out=``, the slack after a fresh output) filled with a sentinel, so tests can assert every output element
was written, nothing was written outside the workspace and the outputs' elements, how far into the workspace the
kernel wrote, and that the inputs were left as they were."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..executor import ExecState, Executor
from ..layout import bytes_of, overlaps
from ..op import Op
from ..runtime.device import Device, device
from ..runtime.memory import Block
from ..runtime.stream import Stream
from ..tensor import Tensor

GUARD = 512
PATTERN = 0xCD
GAP_PATTERN = 0xA5  # the bytes of an output's buffer outside every input and output element


@dataclass
class CheckedRun:
    outputs: tuple[np.ndarray[Any, Any], ...]
    workspace_size: int
    implementation: str
    tiling: Any
    touched: int  # one past the highest workspace byte that the kernel changed (0 if none)
    guards_intact: bool  # False if the kernel wrote a workspace guard zone or a byte of gap_bytes_written
    unwritten: tuple[int, ...]  # per output: elements still holding the poison
    inputs_changed: tuple[int, ...]  # positions of inputs whose values changed (an input run in place is not checked)
    # per output: bytes of its buffer (its memory block) that belong to no input or output element and that the
    # kernel changed, e.g. the gaps between the elements of a strided ``out=`` (a buffer shared by several outputs
    # is counted at the first of them)
    gap_bytes_written: tuple[int, ...] = ()


def guarded_workspace(dev: Device, size: int, stream: Stream) -> tuple[Block, Block]:
    """(outer block, inner block): the inner block's memory sits between two guard zones of GUARD bytes."""
    outer = dev.malloc(size + 2 * GUARD, stream=stream)
    outer.data[:] = PATTERN
    inner = Block(outer.pool, outer.segment, outer.offset + GUARD, size)
    inner.allocated = True
    inner.requested = size
    # a view of one byte cut to ``size``: an empty slice of the guard's end would start at the block's start
    inner.data = outer.data[GUARD : GUARD + max(size, 1)][:size]
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


class _Gaps:
    """The bytes of the outputs' blocks that hold no element of an output or input: filled with GAP_PATTERN
    before the run, checked after it, then given their old bytes back (a caller's ``out=`` may be a view of a
    buffer whose other bytes it still uses)."""

    def __init__(self, outs: Sequence[Tensor], ins: Sequence[Any]) -> None:
        self.blocks: list[tuple[int, Block, np.ndarray[Any, Any], np.ndarray[Any, Any]]] = []
        seen: set[int] = set()
        for k, t in enumerate(outs):
            b = t.block
            if id(b) in seen or b.data is None:
                continue
            seen.add(id(b))
            data = np.asarray(b.data)
            mask = np.zeros(data.shape[0], np.bool_)
            for u in (*outs, *ins):
                if isinstance(u, Tensor) and u.block is b:
                    bytes_of(mask, u.desc)[...] = True
            gap = np.flatnonzero(~mask)
            if gap.size:
                self.blocks.append((k, b, gap, data[gap].copy()))
        for _, b, gap, _ in self.blocks:
            np.asarray(b.data)[gap] = GAP_PATTERN

    def written(self, n_outputs: int) -> tuple[int, ...]:
        counts = [0] * n_outputs
        for k, b, gap, _ in self.blocks:
            counts[k] += int((np.asarray(b.data)[gap] != GAP_PATTERN).sum())
        return tuple(counts)

    def restore(self) -> None:
        for _, b, gap, old in self.blocks:
            if not b.freed and b.data is not None:
                np.asarray(b.data)[gap] = old
        self.blocks = []


def in_place_inputs(
    op: Op, inputs: Sequence[np.ndarray[Any, Any] | None], outputs: Sequence[np.ndarray[Any, Any] | None]
) -> frozenset[int]:
    """The inputs (by position) that the op may write: those its ``aliases`` allow and that share memory with an
    output (the call runs in place). Every other input must keep its values."""
    allowed = op.spec.aliases
    return frozenset(
        i
        for i, x in enumerate(inputs)
        if x is not None
        and (allowed == "any" or (isinstance(allowed, tuple) and i in allowed))
        and any(o is not None and overlaps(x, o) for o in outputs)
    )


def changed_inputs(
    before: Sequence[bytes | None], inputs: Sequence[np.ndarray[Any, Any] | None], skip: frozenset[int] = frozenset()
) -> tuple[int, ...]:
    """The positions of inputs whose bytes differ from ``before`` (their C-order bytes: bitwise, so a NaN left a
    NaN is unchanged and -0.0 for 0.0 is a change), ``skip`` aside."""
    return tuple(
        i
        for i, (b, x) in enumerate(zip(before, inputs))
        if b is not None and x is not None and i not in skip and x.tobytes(order="C") != b
    )


def with_strides(dev: Device, a: Any, stream: Stream) -> Tensor:
    """A device copy of the host array ``a`` in ``a``'s own layout: a buffer spanning its elements, with the
    same strides (negative ones included) and the gaps between them zero; a dense copy where the layout cannot be
    kept (a zero stride, an empty array, strides that are not whole elements). A test that hands ``run_checked``
    a transposed or strided numpy view then tests that layout, not a dense copy of it."""
    a = np.asarray(a)
    item = a.itemsize
    dense = a.flags.c_contiguous or a.size == 0 or any(st == 0 or st % item for st in a.strides)
    if dense:
        return dev.tensor(a, stream=stream)
    first = sum(st * (n - 1) for st, n in zip(a.strides, a.shape, strict=True) if st < 0) // item
    span = 1 + sum(abs(st) * (n - 1) for st, n in zip(a.strides, a.shape, strict=True)) // item
    buf = np.zeros(span, a.dtype)
    view = np.lib.stride_tricks.as_strided(buf[-first:], a.shape, a.strides)
    view[...] = a
    return view_of(dev.tensor(buf, stream=stream), buf, view)


def view_of(t: Tensor, base: Any, view: Any) -> Tensor:
    """The tensor of ``t`` (a device copy of the host array ``base``) that ``view``, a numpy view into ``base``,
    is: its shape, its strides and its offset in elements."""
    item = base.itemsize
    offset = (view.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // item
    return t.strided(view.shape, tuple(st // item for st in view.strides), offset)


def run_checked(op: Op, *inputs: Any, stream: Stream | None = None, out: Any = None, **attrs: Any) -> CheckedRun:
    """Phase 1 on the given inputs (numpy arrays are copied to the device in their own layout: ``with_strides``;
    Tensors used as they are),
    poisoned outputs, a guarded workspace, phase 2, synchronize, then report what was written.

    Float outputs are poisoned with NaN: ``unwritten`` counts NaNs left, so compare it with the NaNs the
    reference has. An output bound in place to an input is not poisoned (the kernel reads it). The rest of each
    output's buffer (the gaps of a strided ``out=``, padding after a fresh output), less the elements of the inputs
    and outputs, holds a sentinel during the run: ``gap_bytes_written`` counts the bytes the kernel changed there
    (``guards_intact`` is False then), and the old bytes are put back afterwards. Everything this
    call allocates (input copies, outputs, workspace) is freed again in stream order, on error paths too, and an
    executor that phase 2 did not consume is destroyed.
    """
    dev = device("cpu")
    stream = stream or dev.stream()
    owned: list[Tensor] = []  # the input copies and new outputs: freed in stream order on every path
    ex: Executor | None = None
    outer: Block | None = None
    gaps: _Gaps | None = None
    try:
        tensors: list[Any] = []
        for x in inputs:
            if x is not None and not isinstance(x, Tensor):
                x = with_strides(dev, x, stream)
                owned.append(x)
            tensors.append(x)
        stream.synchronize()
        given_out = out if isinstance(out, (tuple, list)) else (out,)
        for t in (*tensors, *given_out):
            if isinstance(t, Tensor):
                t.synchronize()  # tensors made on another stream may still be copying in
        size, ex = op.get_workspace_size(*tensors, out=out, **attrs)
        owned += ex._bind_new_outputs(dev, stream)
        in_views = [t.view() if isinstance(t, Tensor) else None for t in tensors]
        outs = [t for t in ex.outputs if t is not None]
        in_place = in_place_inputs(op, in_views, [t.view() for t in outs])
        before = [None if v is None or i in in_place else v.tobytes(order="C") for i, v in enumerate(in_views)]
        for t in outs:
            if not any(v is not None and overlaps(t.view(), v) for v in in_views):
                _poison(t)
        outer, inner = guarded_workspace(dev, size, stream)
        gaps = _Gaps(outs, tensors)
        op(inner, size, ex, stream)
        stream.synchronize()
        raw = outer.data
        gap_written = gaps.written(len(outs))
        guards = bool((raw[:GUARD] == PATTERN).all() and (raw[GUARD + size : GUARD + size + GUARD] == PATTERN).all())
        guards = guards and not any(gap_written)
        changed = np.nonzero(raw[GUARD : GUARD + size] != PATTERN)[0]
        touched = int(changed[-1]) + 1 if changed.size else 0
        result = tuple(np.array(t.view(), copy=True) for t in outs)
        return CheckedRun(
            result,
            size,
            ex.implementation,
            ex.tiling,
            touched,
            guards,
            tuple(_unwritten(t) for t in outs),
            changed_inputs(before, in_views, in_place),
            gap_written,
        )
    finally:
        if gaps is not None:
            try:
                stream.synchronize()  # no launch still writes the buffers (an error path)
            except Exception:  # noqa: BLE001,S110 - the error already raised is the one to report
                pass
            gaps.restore()
        if ex is not None and ex.state is ExecState.READY:  # phase 2 refused it, or never reached
            ex.destroy()
        if outer is not None:
            outer.free(stream)
        for t in owned:
            t.free(stream)  # in stream order: after the launch that uses it
