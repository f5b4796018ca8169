"""twophase: an operator runtime built on the two-phase (get_workspace_size, then execute) contract."""

from . import ops
from .config import set_launch_blocking
from .errors import (
    InternalError,
    InvalidStateError,
    KernelError,
    OutOfMemoryError,
    ParamError,
    RuntimeFailure,
    Status,
    TwoPhaseError,
    WorkspaceTooSmallError,
    recent_error_message,
)
from .executor import ExecState, Executor
from .invoke import PlannedCall, invoke_two_phase
from .op import Attr, Op, OpDef, Plan, get_op, register, registry
from .runtime import Block, Device, Event, MemoryPool, Stream, device
from .tensor import DType, Format, Tensor, TensorDesc

__version__ = "0.1.0"

__all__ = [
    "ops", "set_launch_blocking",
    "InternalError", "InvalidStateError", "KernelError", "OutOfMemoryError", "ParamError", "RuntimeFailure",
    "Status", "TwoPhaseError", "WorkspaceTooSmallError", "recent_error_message",
    "ExecState", "Executor", "PlannedCall", "invoke_two_phase",
    "Attr", "Op", "OpDef", "Plan", "get_op", "register", "registry",
    "Block", "Device", "Event", "MemoryPool", "Stream", "device",
    "DType", "Format", "Tensor", "TensorDesc",
]
