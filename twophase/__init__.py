"""twophase: an operator runtime built on the two-phase (get_workspace_size, then execute) contract.

Every registered op is also a one-shot function here: ``twophase.softmax(x, dim=-1)``.
"""

from typing import Any

from . import logger as _logger  # noqa: F401  (configures the twophase logger and the exit leak report)
from . import ops, sanitizer, stats
from .cache import cache_info, clear_cache
from .config import (
    set_cache_enabled,
    set_cache_limit,
    set_deterministic,
    set_helper_spin,
    set_launch_blocking,
    set_log_level,
    set_num_threads,
    set_sanitize,
    set_workspace_limit,
    settings,
)
from .errors import (
    CaptureError,
    InternalError,
    InvalidStateError,
    KernelError,
    OutOfMemoryError,
    ParamError,
    PlanMismatchError,
    RuntimeFailure,
    Status,
    TwoPhaseError,
    WorkspaceTooSmallError,
    recent_error_message,
)
from .executor import ExecState, Executor
from .functional import functions, one_shot
from .graph import Graph, capture
from .interop import from_dlpack
from .invoke import PlannedCall, invoke_two_phase, plan
from .logger import leak_report
from .op import Attr, Op, OpDef, Plan, get_op, register, registry
from .plan_cache import PlanCache
from .profile import profile
from .runtime import Block, Device, Event, MemoryPool, Stream, device
from .tensor import DType, Format, Tensor, TensorDesc

__version__ = "0.1.0"

__all__ = [
    "ops",
    "sanitizer",
    "stats",
    "cache_info",
    "clear_cache",
    "set_sanitize",
    "set_num_threads",
    "set_helper_spin",
    "set_cache_enabled",
    "set_cache_limit",
    "set_deterministic",
    "set_launch_blocking",
    "set_log_level",
    "set_workspace_limit",
    "settings",
    "InternalError",
    "InvalidStateError",
    "KernelError",
    "OutOfMemoryError",
    "ParamError",
    "RuntimeFailure",
    "Status",
    "TwoPhaseError",
    "WorkspaceTooSmallError",
    "recent_error_message",
    "CaptureError",
    "PlanMismatchError",
    "capture",
    "Graph",
    "ExecState",
    "Executor",
    "functions",
    "one_shot",
    "from_dlpack",
    "PlannedCall",
    "invoke_two_phase",
    "plan",
    "leak_report",
    "Attr",
    "Op",
    "OpDef",
    "Plan",
    "get_op",
    "register",
    "registry",
    "PlanCache",
    "profile",
    "Block",
    "Device",
    "Event",
    "MemoryPool",
    "Stream",
    "device",
    "DType",
    "Format",
    "Tensor",
    "TensorDesc",
]


def __getattr__(name: str) -> Any:
    """One-shot functions for every registered op (generated from the registry, not written per op)."""
    op = registry.get(name)
    if op is None:
        raise AttributeError(f"module 'twophase' has no attribute '{name}'")
    return one_shot(op)


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(registry))
