"""Instrumentation points for the profiler, the sanitizer and friends.

When no hook is installed, ``Op.get_workspace_size`` and ``Op.__call__`` are the plain functions: the
hot path carries no check at all. Installing a hook swaps in an instrumented entry point that runs every
installed hook; removing the last one swaps the plain function back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import ParamError
from .executor import ExecState
from .graph.replay import REPLAY_CHECKS
from .op import Op
from .runtime.stream import TASK_LISTENERS

__all__ = [
    "Phase2Hook",
    "Phase1Hook",
    "add_phase1_hook",
    "add_phase2_hook",
    "remove_hook",
    "add_task_listener",
    "remove_task_listener",
    "add_replay_check",
    "remove_replay_check",
]

# before(op, workspace, workspace_size, executor, stream) may raise to refuse the launch;
# after(op, workspace, workspace_size, executor, stream, t0, t1) runs once it is enqueued.
Phase2Hook = tuple[Callable[..., None] | None, Callable[..., None] | None]
# after(op, inputs, kwargs, (workspace_size, executor), t0, t1)
Phase1Hook = Callable[..., None]

_plain_phase1 = Op.get_workspace_size
_plain_phase2 = Op.__call__
_phase1_hooks: list[Phase1Hook] = []
_phase2_before: list[Callable[..., None]] = []
_phase2_after: list[Callable[..., None]] = []
# held while a hook list changes and the entry points are swapped to match: two threads adding and removing
# hooks at once (the sanitizer and a profile) could otherwise leave the plain entry points with a hook installed
_lock = threading.Lock()


def _phase1(self: Op, *inputs: Any, **kwargs: Any) -> Any:
    t0 = time.perf_counter()
    result = _plain_phase1(self, *inputs, **kwargs)
    t1 = time.perf_counter()
    try:
        for hook in tuple(_phase1_hooks):
            hook(self, inputs, kwargs, result, t0, t1)
    except BaseException:
        if result[1].state is ExecState.READY:  # the caller never gets the executor: release it
            result[1].destroy()
        raise
    return result


def _phase2(self: Op, workspace: Any, workspace_size: int, executor: Any, stream: Any) -> None:
    for before in tuple(_phase2_before):
        before(self, workspace, workspace_size, executor, stream)
    t0 = time.perf_counter()
    _plain_phase2(self, workspace, workspace_size, executor, stream)
    t1 = time.perf_counter()
    for after in tuple(_phase2_after):
        after(self, workspace, workspace_size, executor, stream, t0, t1)


def _swap() -> None:
    Op.get_workspace_size = _phase1 if _phase1_hooks else _plain_phase1  # type: ignore[method-assign]
    Op.__call__ = _phase2 if (_phase2_before or _phase2_after) else _plain_phase2  # type: ignore[method-assign]


def add_phase1_hook(after: Phase1Hook) -> Any:
    """Run ``after(op, inputs, kwargs, result, t0, t1)`` after every phase 1; returns a handle."""
    with _lock:
        _phase1_hooks.append(after)
        _swap()
    return ("phase1", after)


def add_phase2_hook(before: Callable[..., None] | None = None, after: Callable[..., None] | None = None) -> Any:
    """Run ``before(op, ws, size, ex, stream)`` before and ``after(..., t0, t1)`` after every phase 2."""
    with _lock:
        if before is not None:
            _phase2_before.append(before)
        if after is not None:
            _phase2_after.append(after)
        _swap()
    return ("phase2", before, after)


def remove_hook(handle: Any) -> None:
    """Remove a hook installed by ``add_phase1_hook`` / ``add_phase2_hook``."""
    with _lock:
        try:
            if handle[0] == "phase1":
                _phase1_hooks.remove(handle[1])
            else:
                if handle[1] is not None:
                    _phase2_before.remove(handle[1])
                if handle[2] is not None:
                    _phase2_after.remove(handle[2])
        except (ValueError, TypeError, IndexError):
            raise ParamError(
                op="remove_hook", arg="handle", expected="a handle of an installed hook", got=handle
            ) from None
        finally:
            _swap()


def add_replay_check(check: Callable[[Any, Any], None]) -> None:
    """Run ``check(graph, stream)`` before every graph replay is enqueued; it may raise to refuse the replay."""
    REPLAY_CHECKS.append(check)


def remove_replay_check(check: Callable[[Any, Any], None]) -> None:
    REPLAY_CHECKS.remove(check)


def add_task_listener(fn: Callable[[str, Any, float, float, int], None]) -> None:
    """Call ``fn(stream_name, owner, t0, t1, seq)`` on the worker after every stream task."""
    TASK_LISTENERS.append(fn)


def remove_task_listener(fn: Callable[[str, Any, float, float, int], None]) -> None:
    TASK_LISTENERS.remove(fn)
