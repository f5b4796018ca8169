"""Helpers that run the two phases with the release order the contract requires, on every path."""

from __future__ import annotations

from typing import Any, Callable

from .executor import ExecState, Executor
from .runtime.memory import Block
from .runtime.stream import Stream

__all__ = ["invoke_two_phase", "PlannedCall"]


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
    """A planned, repeatable executor with its own workspace; ``with`` releases both in order.

    >>> with PlannedCall(ops.softmax, stream, x, dim=-1, out=y) as call:
    ...     call()          # phase 2 only
    ...     call()

    On exit: synchronize the stream, free the workspace, destroy the executor (also on exceptions).
    """

    def __init__(self, op: Any, stream: Stream, *inputs: Any, **kwargs: Any) -> None:
        self.op = op
        self.stream = stream
        self.workspace_size, self.executor = op.get_workspace_size(*inputs, **kwargs)
        try:
            self.executor.set_repeatable()
            self.workspace: Block | None = stream.device.malloc(self.workspace_size, stream=stream)
        except BaseException:
            _discard(self.executor)
            raise

    def __call__(self) -> None:
        self.op(self.workspace, self.workspace_size, self.executor, self.stream)

    def close(self) -> None:
        """Synchronize, free the workspace, destroy the executor (idempotent)."""
        if self.workspace is None:
            return
        try:
            self.stream.synchronize()
        finally:
            self.workspace.free(self.stream)
            self.workspace = None
            _discard(self.executor)

    def __enter__(self) -> PlannedCall:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
