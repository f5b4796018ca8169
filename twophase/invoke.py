"""Helpers that run the two phases with the release order the contract requires, on every path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import ParamError, refuse_pickle
from .executor import ExecState, Executor
from .op import Op, as_op
from .runtime.device import placement
from .runtime.memory import Block
from .runtime.stream import Stream
from .tensor import Tensor

__all__ = ["invoke_two_phase", "PlannedCall", "plan"]


def invoke_two_phase(
    get_size: Callable[[], tuple[int, Executor]],
    execute: Callable[[Block, int, Executor, Stream], None],
    stream: Stream,
    sync: bool = True,
) -> Executor:
    """Phase 1, workspace from the pool, phase 2, optional sync, then release workspace and executor.

    ``get_size`` is e.g. ``lambda: ops.softmax.get_workspace_size(x, dim=-1, out=y)`` and ``execute`` the op.
    The workspace is freed in stream order (safe without ``sync``); the executor is destroyed if phase 2
    did not consume it. Returns the executor (consumed or destroyed).
    """
    size, ex = get_size()
    try:
        ws = stream.device.malloc(size, stream=stream)
    except BaseException:
        _discard(ex)
        raise
    try:
        execute(ws, size, ex, stream)
        if sync:
            stream.synchronize()
    finally:
        ws.free(stream)
        _discard(ex)
    return ex


def _discard(ex: Executor) -> None:
    if ex.state is ExecState.READY:
        ex.destroy()


class PlannedCall:
    """A repeatable executor that owns its workspace (and the outputs it allocated): phase 1 done once.

    Calling it enqueues phase 2, optionally rebinding inputs (``call(x2)``) or outputs (``out=``) to
    tensors of the planned descs. ``with`` (or :meth:`close`) synchronizes, frees the workspace and
    destroys the executor, also on exceptions.
    """

    def __init__(self, op: Op | str, stream: Stream | None, *inputs: Any, **kwargs: Any) -> None:
        self.op = as_op(op, "plan")
        dev, self.stream = placement(inputs, stream, self.op.name)
        self.workspace_size, self.executor = self.op.get_workspace_size(*inputs, **kwargs)
        self.workspace: Block | None = None
        self._owned: list[Tensor] = []
        self._home: tuple[Tensor | None, ...] = ()
        self._own_outputs = False
        try:
            self.executor.set_repeatable()
            self._owned = self.executor._bind_new_outputs(dev, self.stream)
            # per output, the tensor this call allocated for it (None: the caller's): what a PlanCache hit binds back
            self._home = tuple(t if any(t is o for o in self._owned) else None for t in self.executor.outputs)
            self._own_outputs = all(t is not None for t in self._home)  # serves a caller that passes no out
            self.workspace = dev.malloc(self.workspace_size, stream=self.stream)
        except BaseException:
            self._free_owned()
            _discard(self.executor)
            raise

    @property
    def outputs(self) -> tuple[Tensor | None, ...]:
        return self.executor.outputs

    def __call__(self, *inputs: Tensor | None, out: Any = None) -> Any:
        """Phase 2 (after rebinding any tensors given); returns the output tensor(s)."""
        ex = self.executor
        if out is not None:
            outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            if len(outs) != len(ex.output_descs):
                raise ParamError(
                    op=self.op.name, arg="out", expected=f"{len(ex.output_descs)} output tensor(s)", got=f"{len(outs)}"
                )
            ex.rebind(inputs, outs)
        elif inputs:
            if len(inputs) > len(ex.input_descs):
                ex.rebind(inputs)  # raises: the index of the first extra one
            bound = ex._tensors  # the same tensors again (the usual call) rebind nothing: checked here, without
            for i, t in enumerate(inputs):  # rebind's calls (1.38 against 0.99 us a call(x, x) of a 64x64 add)
                if t is not bound[i] and t is not None:
                    ex.rebind(inputs)
                    break
        ws, s = self.workspace, self.stream
        self.op(ws, self.workspace_size, ex, s)
        if ws is not None:
            ws.mark_use(s, s._q.submitted)  # what pending() reads: the launch that uses the workspace
        outs = ex.outputs
        return outs[0] if len(outs) == 1 else outs

    def outputs_freed(self) -> bool:
        """Whether the caller freed an output this call allocated (it can no longer run)."""
        for t in self._owned:
            if t.block.freed:
                return True
        return False

    def owns(self, tensors: dict[int, Tensor]) -> bool:
        """Whether any of ``tensors`` is (a view of) an output this call allocated itself."""
        return any(t.block is o.block for t in tensors.values() for o in self._owned)

    @property
    def held_bytes(self) -> int:
        """Pool bytes the call holds: its workspace block and the blocks of the outputs it allocated."""
        ws = self.workspace
        return (0 if ws is None else ws.size) + sum(t.block.size for t in self._owned)

    def pending(self) -> bool:
        """True while enqueued work that uses the workspace has not completed."""
        ws = self.workspace
        return ws is not None and ws.in_use()

    def _free_owned(self) -> None:
        owned, self._owned = self._owned, []
        for t in owned:
            if not t.block.freed:  # the caller may have freed one already
                t.free(self.stream)

    def close(self, sync: bool = True) -> None:
        """Free the workspace and owned outputs in stream order and destroy the executor (idempotent)."""
        if self.workspace is None:
            return
        try:
            if sync:
                self.stream.synchronize()
        finally:
            ws, self.workspace = self.workspace, None
            try:
                ws.free(self.stream)
                self._free_owned()
            finally:
                _discard(self.executor)

    def __enter__(self) -> PlannedCall:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce__(self) -> Any:
        refuse_pickle(self, "plan the call again in the receiving process")

    def __repr__(self) -> str:
        return f"PlannedCall({self.executor!r}, workspace={self.workspace_size})"


def plan(op: Op | str, *inputs: Any, out: Any = None, stream: Stream | None = None, **attrs: Any) -> PlannedCall:
    """Phase 1 plus the workspace, once: returns a repeatable :class:`PlannedCall` (call it to run phase 2)."""
    return PlannedCall(op, stream, *inputs, out=out, **attrs)
