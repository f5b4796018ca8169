"""The opaque ``Executor`` that phase 1 returns and phase 2 consumes."""

from __future__ import annotations

import contextlib
import enum
import itertools
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .config import int_value
from .errors import InvalidStateError, ParamError, PlanMismatchError, refuse_pickle
from .tensor import Tensor, TensorDesc

if TYPE_CHECKING:
    from .op import Op, Plan
    from .runtime.memory import Block

__all__ = ["Executor", "ExecState"]

_ids = itertools.count(1)
_repeatables: weakref.WeakSet[Executor] = weakref.WeakSet()
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_CONTEXTLIB = contextlib.__file__


def _caller_outside_package() -> str:
    """``file:line`` of the nearest frame outside the twophase package (where the user planned it); ``contextlib``'s
    frames are skipped too (``PlanCache.lease`` plans from inside a ``contextmanager``)."""
    f = sys._getframe(1)
    while f is not None and (f.f_code.co_filename.startswith(_PACKAGE_DIR) or f.f_code.co_filename == _CONTEXTLIB):
        f = f.f_back  # type: ignore[assignment]
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "<unknown>"


def live_repeatable() -> list[Executor]:
    """Repeatable executors that were never destroyed (what the leak report lists)."""
    return [ex for ex in list(_repeatables) if ex._state is ExecState.READY]


class ExecState(enum.Enum):
    READY = "ready"
    CONSUMED = "consumed"
    DESTROYED = "destroyed"


Launch = Callable[[Any], None]


class Executor:
    """A planned op call: op, chosen implementation, frozen tiling, operand descs, workspace size,
    bound tensors and the prebuilt launch.

    Single-use (phase 2 consumes it) unless :meth:`set_repeatable` is called before its first phase 2.
    Belongs to the thread that made it.
    """

    __slots__ = (
        "op",
        "plan",
        "attrs",
        "input_descs",
        "output_descs",
        "workspace_size",
        "id",
        "_tensors",
        "_launch",
        "_gate",
        "_state",
        "_repeatable",
        "_owner",
        "_blocks",
        "_private",
        "launches",
        "device",
        "origin",
        "__weakref__",
    )

    op: Op
    plan: Plan
    attrs: dict[str, Any]
    input_descs: tuple[TensorDesc | None, ...]
    output_descs: tuple[TensorDesc, ...]
    workspace_size: int
    id: int
    _tensors: list[Tensor | None]
    _launch: Launch | None
    _gate: Op | None
    _state: ExecState
    _repeatable: bool
    _owner: int
    _blocks: tuple[Block, ...]
    _private: dict[str, Any] | None  # state a private launch keeps across rebinding (``op.PRIVATE_STATE``)
    launches: int
    device: Any
    origin: Any

    def __init__(self, *_: Any, **__: Any) -> None:
        raise TypeError("Executors are made by phase 1: use twophase.ops.NAME.get_workspace_size(...)")

    @classmethod
    def _make(
        cls,
        op: Op,
        plan: Plan,
        attrs: dict[str, Any],
        input_descs: tuple[TensorDesc | None, ...],
        output_descs: tuple[TensorDesc, ...],
    ) -> Executor:
        self = object.__new__(cls)
        self.op = op
        self.plan = plan
        self.attrs = attrs
        self.input_descs = input_descs
        self.output_descs = output_descs
        self.workspace_size = plan.workspace_size
        self.id = next(_ids)
        self._tensors = [None] * (len(input_descs) + len(output_descs))
        self._launch = None
        self._gate = None  # the op while ready and fully bound: phase 2's one-compare check
        self._state = ExecState.READY
        self._repeatable = False
        self._owner = threading.get_ident()
        self._blocks = ()
        self._private = None
        self.launches = 0
        self.device = None
        self.origin = None  # where it was planned (recorded for repeatable executors)
        return self

    # ---- introspection
    @property
    def implementation(self) -> str:
        return self.plan.implementation

    @property
    def tiling(self) -> Any:
        return self.plan.tiling

    @property
    def state(self) -> ExecState:
        return self._state

    @property
    def phase2_calls(self) -> int:
        """Phase-2 calls made: 1 for a consumed single-use executor (phase 2 released it before its task ran),
        else ``launches``, which the stream worker counts as each task completes."""
        return 1 if self._state is ExecState.CONSUMED else self.launches

    @property
    def repeatable(self) -> bool:
        return self._repeatable

    @property
    def inputs(self) -> tuple[Tensor | None, ...]:
        return tuple(self._tensors[: len(self.input_descs)])

    @property
    def outputs(self) -> tuple[Tensor | None, ...]:
        return tuple(self._tensors[len(self.input_descs) :])

    def describe(self) -> str:
        return f"op '{self.op.name}' (executor #{self.id}, implementation '{self.plan.implementation}')"

    def __reduce__(self) -> Any:
        refuse_pickle(self, "run phase 1 (get_workspace_size) in the receiving process")

    def __repr__(self) -> str:
        return (
            f"Executor(#{self.id}, op={self.op.name}, impl={self.plan.implementation}, "
            f"workspace={self.workspace_size}, state={self._state.value})"
        )

    # ---- lifecycle
    def _check_owner(self, what: str) -> None:
        if self._owner != threading.get_ident():
            raise InvalidStateError(
                f"{self.describe()} belongs to another thread",
                op=self.op.name,
                arg="executor",
                expected="use from the thread that planned it",
                got=f"{what} from thread {threading.current_thread().name}",
            )

    def _check_ready(self, what: str) -> None:
        self._check_owner(what)
        if self._state is not ExecState.READY:
            hint = (
                "; call set_repeatable() before the first phase 2 to reuse it"
                if self._state is ExecState.CONSUMED
                else ""
            )
            raise InvalidStateError(
                f"{self.describe()} is {self._state.value}{hint}",
                op=self.op.name,
                arg="executor",
                expected="a ready executor",
                got=f"{what} on it",
            )

    def set_repeatable(self) -> Executor:
        """Allow any number of phase 2 calls until :meth:`destroy` (must precede the first phase 2)."""
        self._check_ready("set_repeatable")
        if self.launches:
            raise InvalidStateError("set_repeatable() must precede the first phase 2", op=self.op.name, arg="executor")
        self._repeatable = True
        self.origin = _caller_outside_package()
        _repeatables.add(self)
        return self

    def destroy(self) -> None:
        """Release the executor. A consumed single-use executor is already released: destroying it raises."""
        self._check_owner("destroy")
        if self._state is not ExecState.READY:
            raise InvalidStateError(
                f"{self.describe()} is {self._state.value}: nothing to destroy (a double free in C)",
                op=self.op.name,
                arg="executor",
            )
        self._release(ExecState.DESTROYED)

    def _release(self, state: ExecState) -> None:
        self._state = state
        self._launch = None
        self._gate = None
        self.op._on_release(self)  # reads _blocks: the counters wait for launches still queued
        self._tensors = [None] * len(self._tensors)
        self._blocks = ()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._state is ExecState.READY:
            self.destroy()

    # ---- binding
    def set_input(self, index: int, tensor: Tensor) -> None:
        """Rebind input ``index`` to another tensor with the same desc (no re-planning)."""
        self._check_ready("set_input")
        self._check_operand(index, tensor, self.input_descs, "input")
        self._bind_many({index: tensor})

    def set_output(self, index: int, tensor: Tensor) -> None:
        """Rebind output ``index`` to another tensor with the same desc (no re-planning)."""
        self._check_ready("set_output")
        self._check_operand(index, tensor, self.output_descs, "output")
        self._bind_many({len(self.input_descs) + index: tensor})

    def rebind(self, inputs: Iterable[Tensor | None] = (), outputs: Iterable[Tensor | None] = ()) -> None:
        """Rebind inputs and outputs by position (``None`` keeps one) as one binding: two tensors can swap roles
        (ping-pong buffers), which ``set_input`` and ``set_output`` refuse one at a time (each step's output
        overlaps the other's still-bound input)."""
        self._check_ready("rebind")
        for arg, given in (("inputs", inputs), ("outputs", outputs)):
            if not isinstance(given, Iterable) or isinstance(given, Tensor):
                raise ParamError(
                    op=self.op.name,
                    arg=arg,
                    expected="a sequence of Tensors (None keeps one)",
                    got=type(given).__name__,
                )
        self._rebind(enumerate(inputs), outputs)

    def _rebind(self, inputs: Iterable[tuple[int, Tensor | None]], outputs: Iterable[Tensor | None]) -> None:
        """``rebind`` with the inputs given as (index, tensor) pairs; nothing changes when nothing differs."""
        tensors, n = self._tensors, len(self.input_descs)
        changes: dict[int, Tensor] = {}
        for i, t in inputs:
            if t is not None and (type(i) is not int or not 0 <= i < n or t is not tensors[i]):
                self._check_operand(i, t, self.input_descs, "input")
                changes[i] = t
        for i, t in enumerate(outputs):
            if t is not None and (i >= len(self.output_descs) or t is not tensors[n + i]):
                self._check_operand(i, t, self.output_descs, "output")
                changes[n + i] = t
        if changes:
            self._bind_many(changes)

    def _check_operand(self, index: int, tensor: Tensor, descs: tuple[TensorDesc | None, ...], kind: str) -> None:
        """Refuse an index out of range or a tensor not of the planned desc."""
        if int_value(index) is None or not 0 <= index < len(descs):
            raise ParamError(op=self.op.name, arg=f"{kind} index", expected=f"0..{len(descs) - 1}", got=index)
        if not isinstance(tensor, Tensor):
            raise ParamError(op=self.op.name, arg=f"{kind} {index}", expected="a Tensor", got=type(tensor).__name__)
        if tensor.desc != descs[index]:
            raise PlanMismatchError(
                "rebinding needs a tensor of the planned desc (plan again for a new shape)",
                op=self.op.name,
                arg=f"{kind} {index}",
                expected=descs[index],
                got=tensor.desc,
            )

    def _operand_name(self, i: int) -> str:
        """Operand slot ``i`` (inputs, then outputs) as errors name it: ``x``, ``out``, ``out[1]``."""
        n_in, n_out = len(self.input_descs), len(self.output_descs)
        if i < n_in:
            return self.op.input_name(i, n_in)
        return "out" if n_out == 1 else f"out[{i - n_in}]"

    def _bind_new_outputs(self, dev: Any, stream: Any) -> list[Tensor]:
        """Allocate a tensor of the planned desc (its strides and offset too: the plan was made for them) from
        ``dev``'s pool for every unbound output and bind them all at once; returns the new tensors (freed again in
        ``stream`` order if binding fails)."""
        n_in = len(self.input_descs)
        new: dict[int, Tensor] = {}
        try:
            for i, (t, d) in enumerate(zip(self.outputs, self.output_descs)):
                if t is None:
                    new[n_in + i] = dev.empty_like(d, stream)  # an out-of-memory on a later one frees these
            if new:
                self._bind_many(new)
        except BaseException:
            for t in new.values():
                t.free(stream)
            raise
        return list(new.values())

    def _bind_many(self, tensors: dict[int, Tensor]) -> None:
        """Bind operands and build the launch once all are bound; a refused binding (another device, a launch
        the op refuses) leaves the previous binding and launch as they were."""
        if self._state is not ExecState.READY:  # a destroyed executor is never re-armed
            self._check_ready("rebind")
        dev = self.device
        for i, t in tensors.items():
            if dev is not None and t.device is not dev:
                raise ParamError(
                    op=self.op.name, arg=self._operand_name(i), expected=f"a tensor on {dev.name}", got=t.device.name
                )
            dev = t.device
        saved = (self.device, list(self._tensors), self._launch, self._gate)
        for i, t in tensors.items():
            self.device = t.device
            self._tensors[i] = t
        self._launch = None
        self._gate = None
        if all(t is not None for t, d in zip(self._tensors, self.input_descs + self.output_descs) if d is not None):
            try:
                launch = self.op._build_launch(self)
            except BaseException:
                self.device, self._tensors, self._launch, self._gate = saved
                raise
            self._launch = launch
            self._blocks = tuple({id(t.block): t.block for t in self._tensors if t is not None}.values())
            self._gate = self.op
