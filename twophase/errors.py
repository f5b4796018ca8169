"""Status codes and the exception hierarchy (aclnn's code classes: 161xxx caller, 361xxx runtime, 561xxx internal)."""

from __future__ import annotations

import enum
import threading
from typing import Any, NoReturn

__all__ = [
    "Status",
    "TwoPhaseError",
    "ParamError",
    "RuntimeFailure",
    "InternalError",
    "WorkspaceTooSmallError",
    "InvalidStateError",
    "OutOfMemoryError",
    "KernelError",
    "SanitizerError",
    "recent_error_message",
]


class Status(enum.IntEnum):
    """Status codes; the leading digit says whose fault it is (1 caller, 3 runtime, 5 library)."""

    SUCCESS = 0
    ERR_PARAM_NULLPTR = 161001
    ERR_PARAM_INVALID = 161002
    ERR_PARAM_INVALID_STATE = 161003
    ERR_RUNTIME_ERROR = 361001
    ERR_RUNTIME_OUT_OF_MEMORY = 361002
    ERR_RUNTIME_KERNEL_FAILED = 361003
    ERR_RUNTIME_SANITIZER = 361004
    ERR_INNER = 561000
    ERR_INNER_INFERSHAPE = 561001
    ERR_INNER_TILING = 561002
    ERR_INNER_KERNEL_NOT_FOUND = 561003


_recent = threading.local()


def recent_error_message() -> str:
    """Return and clear the calling thread's last error message ("" if none), like ``aclGetRecentErrMsg``."""
    msg: str = getattr(_recent, "msg", "")
    _recent.msg = ""
    return msg


def _fmt(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


class TwoPhaseError(Exception):
    """Base of every error the library raises; ``status`` is a :class:`Status`.

    The message reads ``[status] op: argument 'arg': expected ..., got ...`` with the parts that are known.
    """

    default_status = Status.ERR_INNER

    def __init__(
        self,
        message: str = "",
        *,
        op: str | None = None,
        arg: str | None = None,
        expected: Any = None,
        got: Any = None,
        status: Status | None = None,
    ) -> None:
        self.status = Status(status if status is not None else self.default_status)
        self.op = op
        self.arg = arg
        self.expected = expected
        self.got = got
        parts = []
        if op:
            parts.append(f"{op}:")
        if arg:
            parts.append(f"argument '{arg}':")
        if message:
            parts.append(message)
        if expected is not None:
            parts.append(f"expected {_fmt(expected)}" + ("," if got is not None else ""))
        if got is not None:
            parts.append(f"got {_fmt(got)}")
        self.message = f"[{int(self.status)}] " + " ".join(parts)
        super().__init__(self.message)
        _recent.msg = self.message

    def add_note_line(self, line: str) -> None:
        """Append context (e.g. where a failed task was enqueued) to the message."""
        self.message = f"{self.message}; {line}"
        self.args = (self.message,)
        _recent.msg = self.message


class ParamError(TwoPhaseError, ValueError):
    """The caller passed something the op cannot accept."""

    default_status = Status.ERR_PARAM_INVALID


class WorkspaceTooSmallError(ParamError):
    """Phase 2 got a workspace size or block that does not match phase 1's answer."""

    default_status = Status.ERR_PARAM_INVALID


class InvalidStateError(TwoPhaseError, RuntimeError):
    """An object was used out of its lifecycle order (consumed executor, double destroy, wrong thread)."""

    default_status = Status.ERR_PARAM_INVALID_STATE


def refuse_pickle(obj: object, instead: str) -> NoReturn:
    """``__reduce__`` of what lives only in the process that made it (threads, device memory, plans)."""
    name = type(obj).__name__
    raise InvalidStateError(
        f"this {name} belongs to the process that made it (its threads, memory or plans): it "
        f"cannot be pickled or copied; {instead}",
        op="pickle",
        arg=name.lower(),
    )


class CaptureError(InvalidStateError):
    """Something a stream capture cannot record (a host read, a synchronization, another stream's launch)."""


class PlanMismatchError(ParamError):
    """A tensor given to a planned call or a graph replay does not have the planned desc."""


class RuntimeFailure(TwoPhaseError, RuntimeError):
    """The runtime failed (device, stream or kernel failure)."""

    default_status = Status.ERR_RUNTIME_ERROR


class KernelError(RuntimeFailure):
    """A kernel raised while running on a stream; raised at the next synchronization point."""

    default_status = Status.ERR_RUNTIME_KERNEL_FAILED


class SanitizerError(RuntimeFailure):
    """A two-phase contract violation caught by ``twophase.sanitizer`` (guard overwrite, use after free, ...).

    ``check`` names the sanitizer check that fired; subclasses in ``twophase.sanitizer`` also derive from the
    error the plain runtime raises for the same mistake, with that error's status.
    """

    default_status = Status.ERR_RUNTIME_SANITIZER
    check = "sanitizer"


class OutOfMemoryError(RuntimeFailure, MemoryError):
    """The memory pool could not satisfy a request even after emptying its cache."""

    default_status = Status.ERR_RUNTIME_OUT_OF_MEMORY


class InternalError(TwoPhaseError):
    """A bug or missing piece inside the library (tiling failure, kernel not found)."""

    default_status = Status.ERR_INNER
