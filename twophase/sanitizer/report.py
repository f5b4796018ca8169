"""What the sanitizer raises and warns, and how it names where things came from."""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass

from ..errors import InvalidStateError, PlanMismatchError, SanitizerError, Status, WorkspaceTooSmallError

__all__ = [
    "SanitizerError",
    "GuardError",
    "UseAfterFreeError",
    "ReadBeforeReadyError",
    "ExecutorMisuseError",
    "WorkspaceContractError",
    "StaleExecutorError",
    "SanitizerWarning",
    "LeakWarning",
    "Leak",
    "where",
    "stack_text",
]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TESTING_DIR = os.path.join(_PACKAGE_DIR, "testing")
STACK_DEPTH = 8


def where() -> traceback.StackSummary:
    """The caller's stack outside the twophase package (innermost last), at most ``STACK_DEPTH`` frames."""
    f = sys._getframe(1)
    while (
        f is not None
        and f.f_code.co_filename.startswith(_PACKAGE_DIR)
        and not f.f_code.co_filename.startswith(_TESTING_DIR)
    ):
        f = f.f_back  # type: ignore[assignment]
    if f is None:
        return traceback.StackSummary.from_list([])
    return traceback.extract_stack(f, limit=STACK_DEPTH)


def stack_text(stack: traceback.StackSummary | None, indent: str = "    ") -> str:
    if not stack:
        return f"{indent}<unknown>"
    return "\n".join(f"{indent}{fr.filename}:{fr.lineno} in {fr.name}" for fr in reversed(stack))


def first_frame(stack: traceback.StackSummary | None) -> str:
    if not stack:
        return "<unknown>"
    fr = stack[-1]
    return f"{fr.filename}:{fr.lineno}"


class GuardError(SanitizerError):
    """A kernel wrote into the guard zone before or after a workspace or tensor block (check 1)."""

    check = "guard"


class WorkspaceContractError(SanitizerError, WorkspaceTooSmallError):
    """Phase 2 got a workspace size or block other than phase 1's answer (check 3)."""

    default_status = Status.ERR_PARAM_INVALID
    check = "workspace"


class UseAfterFreeError(SanitizerError):
    """A block was freed while a task on another stream that uses it had not completed (check 4)."""

    check = "use-after-free"


class ReadBeforeReadyError(SanitizerError):
    """The host read a tensor while a pending task writes it (check 5)."""

    check = "read-before-ready"


class ExecutorMisuseError(SanitizerError, InvalidStateError):
    """An executor used out of its lifecycle or from another thread (check 6)."""

    default_status = Status.ERR_PARAM_INVALID_STATE
    check = "executor"


class StaleExecutorError(SanitizerError, PlanMismatchError):
    """A tensor of another shape or stride bound to a planned executor (check 8)."""

    default_status = Status.ERR_PARAM_INVALID
    check = "stale-executor"


class ConstantOperandError(SanitizerError):
    """An operand an executor was planned to keep constant (conv2d's ``constant_weight``) changed while bound
    (check 9): its launches ran on what the first one read."""

    check = "constant-operand"


class SanitizerWarning(RuntimeWarning):
    """A report that is not fatal; ``status`` is the status code it would carry as an error."""

    status = Status.ERR_RUNTIME_SANITIZER


class LeakWarning(SanitizerWarning):
    """Executors or blocks still alive at ``twophase.sanitizer.report()`` or at exit (check 7)."""


@dataclass(frozen=True)
class Leak:
    """One leaked resource: ``kind`` is ``"executor"`` or ``"block"``."""

    kind: str
    what: str
    created: traceback.StackSummary | None
    generation: int = 0

    def __str__(self) -> str:
        return f"leaked {self.kind} {self.what}, created at\n{stack_text(self.created)}"
