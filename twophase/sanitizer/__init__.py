"""The contract sanitizer: turns the classic two-phase failures into clear errors.

Enable it with ``TWOPHASE_SANITIZE=1``, ``twophase.sanitizer.enable()`` or ``with twophase.sanitizer.sanitize():``.
While it is on:

1. every pool block sits between guard zones, verified after each kernel (``GuardError`` at the next sync), and
   every buffer in the arena of a graph instantiated meanwhile too, verified after the node that writes it;
2. fresh blocks are filled with 0xCD, fresh float tensors with NaN;
3. a phase-2 workspace size or block other than phase 1's is reported with where the executor was planned;
4. freeing a block that a pending task on another stream uses, without events ordering them (directly or through
   a chain of streams), raises;
5. host access to a tensor (``view()``, ``numpy()``, ``__array__``, DLPack) while a pending task writes it raises;
6. phase 2 twice on a single-use executor, destroy of a consumed one, destroy while its launch is pending and
   use from another thread raise ``ExecutorMisuseError`` with where it was planned and released;
7. :func:`report` (and the exit handler) lists executors and blocks still alive with their creation stacks;
8. binding a tensor of another shape or stride to a planned executor raises ``StaleExecutorError``;
9. an operand a plan keeps constant (conv2d's ``constant_weight``: its transformed weight, made at the binding's
   first launch) is checksummed after each launch: data changed while bound is ``ConstantOperandError`` at the
   next sync.

When it is off nothing of this is installed: phase 2, the stream's enqueue and the pool are the plain functions.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

from .. import config, logger
from ..errors import ParamError, SanitizerError
from . import guards, tracking
from .report import (
    ConstantOperandError,
    ExecutorMisuseError,
    GuardError,
    Leak,
    LeakWarning,
    ReadBeforeReadyError,
    SanitizerWarning,
    StaleExecutorError,
    UseAfterFreeError,
    WorkspaceContractError,
)

__all__ = [
    "enable",
    "disable",
    "is_enabled",
    "sanitize",
    "report",
    "mark",
    "reset",
    "Leak",
    "SanitizerError",
    "GuardError",
    "WorkspaceContractError",
    "UseAfterFreeError",
    "ReadBeforeReadyError",
    "ExecutorMisuseError",
    "StaleExecutorError",
    "ConstantOperandError",
    "SanitizerWarning",
    "LeakWarning",
    "GUARD",
]

GUARD = guards.GUARD
_log = logging.getLogger("twophase")
_installed = [False]
_atexit = [False]


def _apply(value: object) -> None:
    if value and not _installed[0]:
        guards.install()
        tracking.install()
        _installed[0] = True
        if not _atexit[0]:
            logger.EXIT_REPORTS.append(_exit_report)  # after models still open are closed
            _atexit[0] = True
    elif not value and _installed[0]:
        tracking.uninstall()
        guards.uninstall()
        _installed[0] = False


def enable() -> None:
    """Turn the sanitizer on (same as ``twophase.config.set_sanitize(True)``)."""
    config.set_sanitize(True)


def disable() -> None:
    """Turn the sanitizer off: the plain phase 1 / phase 2 / pool functions are back."""
    config.set_sanitize(False)


def is_enabled() -> bool:
    return _installed[0]


@contextlib.contextmanager
def sanitize() -> Iterator[None]:
    """Sanitize the block; restores the previous state on exit."""
    was = is_enabled()
    enable()
    try:
        yield
    finally:
        if was:
            enable()
        else:
            disable()


def mark() -> int:
    """A token: ``report(since=token)`` lists only what was created after it."""
    guards._state["generation"] += 1
    return guards._state["generation"]


def report(since: int = 0, warn: bool = True, raise_on_leak: bool = False) -> list[Leak]:
    """Executors never destroyed and blocks never freed (created at or after ``since``), with creation stacks.

    Each leak is warned as a :class:`LeakWarning` (``warn=False`` to only return them); with ``raise_on_leak`` a
    :class:`SanitizerError` lists them all.
    """
    if config.int_value(since) is None:
        raise ParamError(op="sanitizer.report", arg="since", expected="an int (a mark())", got=since)
    for name, flag in (("warn", warn), ("raise_on_leak", raise_on_leak)):
        if not isinstance(flag, bool):
            raise ParamError(op="sanitizer.report", arg=name, expected="a bool", got=flag)
    leaks = tracking.leaked_executors(since)
    leaks += [
        Leak("block", f"of {b.size} bytes at 0x{b.address:x}", b.created, b.generation)
        for b in guards.live_blocks()
        if b.generation >= since
    ]
    if warn:
        for lk in leaks:
            warnings.warn(str(lk), LeakWarning, stacklevel=2)
    if raise_on_leak and leaks:
        err = SanitizerError(f"{len(leaks)} leak(s):\n" + "\n".join(str(lk) for lk in leaks), arg="leaks")
        err.check = "leak"
        raise err
    return leaks


def reset() -> None:
    """Forget recorded leaks of collected executors and pending launch records (tests)."""
    tracking.reset()


def _exit_report() -> None:
    if not _installed[0]:
        return
    for lk in report(warn=False):
        _log.warning("sanitizer: %s", lk)


config.on_change("sanitize", _apply)
if config.settings.sanitize:
    _apply(True)
