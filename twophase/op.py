"""The op protocol (spec, check/infer, select, kernels per backend), the registry and the two phases."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from threading import Lock
from threading import get_ident as _get_ident
from typing import Any

import numpy as np

from .cache import thread_cache
from .config import check_byte_limit, settings
from .errors import InternalError, InvalidStateError, ParamError, Status, WorkspaceTooSmallError, refuse_pickle
from .executor import ExecState, Executor
from .layout import apart, byte_range, overlaps, same_view, self_overlapping
from .runtime import forking
from .runtime.device import NO_WORKSPACE
from .runtime.memory import RELEASE_LISTENERS, Block
from .runtime.stream import Stream, check_stream
from .stats import OpCounters
from .tensor import DType, Format, Tensor, TensorDesc

_log = logging.getLogger("twophase")

# Anything outside the call's metadata that restricts planning in the current context (e.g. a test forcing
# implementations); part of every executor-cache key, so a restricted plan is never served elsewhere.
planning_scope: ContextVar[Any] = ContextVar("twophase_planning_scope", default=None)

__all__ = ["Attr", "OpDef", "Op", "Plan", "REQUIRED", "register", "registry", "get_op"]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()

Infer = Callable[[tuple[TensorDesc | None, ...], dict[str, Any]], tuple[TensorDesc, ...]]
Select = Callable[[tuple[TensorDesc | None, ...], tuple[TensorDesc, ...], dict[str, Any], "int | None"], "Plan"]
Builder = Callable[["Plan", dict[str, Any], tuple[Any, ...], tuple[Any, ...]], Callable[[Any], None]]


@dataclass(frozen=True)
class Attr:
    """An op attribute: ``convert`` normalises a value to its canonical type or raises ``ParamError``."""

    name: str
    convert: Callable[[Any], Any]
    default: Any = REQUIRED
    doc: str = ""


@dataclass(frozen=True)
class Plan:
    """Phase 1's decision: the implementation, its frozen tiling and the exact workspace size in bytes."""

    implementation: str
    tiling: Any
    workspace_size: int


@dataclass(frozen=True)
class OpDef:
    """Everything that defines an op; one module per op family registers these.

    ``inputs`` names ending in ``?`` are optional (``None`` allowed); a last name ending in ``*`` takes any
    number (at least one) of remaining inputs. An ``outputs`` of one name ending in ``*`` means ``infer``
    decides how many outputs there are (the one-shot API then returns a tuple). ``infer`` validates and returns
    the output descs; ``select`` returns a :class:`Plan`; ``kernels`` maps a backend kind to a builder
    ``(plan, attrs, input_views, output_views) -> launch(workspace_bytes)``, called once per binding.
    ``aliases``: the inputs an output may be exactly (same memory, shape and strides: the kernel runs in place),
    or ``"any"`` for any overlap (numpy's ufunc semantics); binding refuses every other overlap of an output with
    an input or with another output (``ParamError``: the kernel would read what it already overwrote).
    ``promotes``: the inputs whose dtypes promote together; a Python scalar passed for one of them to the
    one-shot API takes their dtype (a weak scalar, as in numpy 2 and torch).
    """

    name: str
    inputs: tuple[str, ...]
    infer: Infer
    select: Select
    kernels: Mapping[str, Builder]
    outputs: tuple[str, ...] = ("out",)
    attrs: tuple[Attr, ...] = ()
    dtypes: tuple[DType, ...] = ()
    implementations: tuple[str, ...] = ()
    workspace_formula: str = "0"
    version: int = 1
    doc: str = ""
    reference: Callable[..., Any] | None = field(default=None, compare=False)
    aliases: tuple[int, ...] | str = ()
    promotes: tuple[int, ...] = ()

    def __reduce_ex__(self, protocol: Any) -> Any:
        """A registered op's definition pickles by name: its functions are local to the module that made them."""
        op = registry.get(self.name)
        if op is not None and op.spec is self:
            return (_registered_spec, (self.name,))
        return object.__reduce_ex__(self, protocol)


def effective_limit(op: str, limit: Any) -> int | None:
    """The limit in force: ``limit`` when given, else the ``TWOPHASE_WORKSPACE_LIMIT`` setting (None = unlimited)."""
    if limit is None:
        return settings.workspace_limit  # checked when it was set
    return check_byte_limit(limit, op, "workspace_limit")


def planning_flags(limit: int | None) -> tuple[Any, ...]:
    """What phase 1 reads besides the operands and attributes (part of every key of planned work)."""
    return (settings.deterministic, settings.num_threads, limit, planning_scope.get())


def over_limit(op: str, workspace: int, implementation: str, limit: int | None) -> ParamError:
    """The error of a phase 1 whose smallest workspace (``implementation``'s) exceeds ``limit``."""
    return ParamError(
        "no implementation fits the workspace limit",
        op=op,
        arg="workspace_limit",
        expected=f"at least {workspace} bytes ({implementation})",
        got=limit,
    )


def _noop(_: Any) -> None:
    pass


def _typed(v: Any) -> Any:
    """An attribute value as a key part: its type, the types of tuple / list elements (``(1.0,) == (1,)``),
    and the sign of float zeros (``-0.0 == 0.0`` with equal hashes)."""
    t = type(v)
    if t is tuple or t is list:
        return (t, tuple(_typed(e) for e in v))
    if isinstance(v, (float, np.floating)) and v == 0.0:  # numpy's float32 / float16 zeros too
        return (t, v, bool(np.signbit(v)))
    return (t, v)


class Op:
    """A registered op: ``get_workspace_size(...)`` is phase 1, calling the op is phase 2."""

    def __init__(self, spec: OpDef) -> None:
        self.spec = spec
        self.name = spec.name
        self._n_inputs = len(spec.inputs)
        self._variadic = bool(spec.inputs) and spec.inputs[-1].endswith("*")
        self._required = tuple(not n.endswith("?") for n in spec.inputs)
        self._attr_names = frozenset(a.name for a in spec.attrs)
        self.counters = OpCounters()
        self._launches: OrderedDict[Any, tuple[Plan, Callable[[Any], None]]] = OrderedDict()
        self._launch_lock = Lock()
        forking.locks_of(self, "_launch_lock")
        self.__doc__ = spec.doc

    def __repr__(self) -> str:
        return f"<op {self.name}>"

    def __reduce__(self) -> Any:
        """A registered op pickles by name (the receiving process has its own registry)."""
        if registry.get(self.name) is not self:
            refuse_pickle(self, "register the op in the receiving process and look it up by name")
        return (get_op, (self.name,))

    # ---- phase 1
    def get_workspace_size(
        self, *inputs: Any, out: Any = None, workspace_limit: int | None = None, **attrs: Any
    ) -> tuple[int, Executor]:
        """Phase 1: validate, infer outputs, select an implementation and tiling; metadata only.

        Returns ``(workspace_size, executor)``. Inputs and ``out`` may be Tensors or TensorDescs.
        Planning results are cached per thread by metadata (never addresses): a repeated call with the
        same descs and attributes skips check / infer / select.
        """
        in_descs, bound = self._input_descs(inputs)
        outs = None if out is None else (tuple(out) if isinstance(out, (tuple, list)) else (out,))
        limit = effective_limit(self.name, workspace_limit)
        counters = self.counters
        cache = thread_cache()
        key = entry = None
        if cache is not None:
            key = self._key(in_descs, outs, limit, attrs, bound)
            if key is not None:
                entry = cache.get(key)
        hit = entry is not None
        if entry is None:
            entry = self._plan(in_descs, outs, limit, attrs)  # refused calls count nowhere
        plan, norm, out_descs = entry
        if outs is not None:
            for i, g in enumerate(outs):
                if isinstance(g, Tensor):
                    bound[len(in_descs) + i] = g
        ex = Executor._make(self, plan, norm, in_descs, out_descs)
        if bound:
            ex._bind_many(bound)  # refused (an out overlapping an input, ...): no executor was made
        if not hit and key is not None:
            cache.put(key, entry)  # type: ignore[union-attr]  # after binding: a refused call is not cached either
        if hit:
            counters.hits += 1
        else:
            counters.misses += 1
        counters.phase1 += 1
        counters.on_create(ex)
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug(
                "phase1 %s %s: inputs %s outputs %s implementation %s tiling %s workspace %d bytes",
                self.name,
                "cache hit" if hit else "cache miss",
                in_descs,
                out_descs,
                plan.implementation,
                plan.tiling,
                plan.workspace_size,
            )
        return plan.workspace_size, ex

    def _key(
        self,
        in_descs: tuple[TensorDesc | None, ...],
        outs: tuple[Any, ...] | None,
        limit: int | None,
        attrs: dict[str, Any],
        bound: dict[int, Tensor],
    ) -> Any:
        """The executor-cache key: op and versions, device, flags, every desc and the typed attributes."""
        out_key = None if outs is None else tuple(g.desc if isinstance(g, Tensor) else g for g in outs)
        dev = next(iter(bound.values())).device.name if bound else None
        try:
            flags = planning_flags(limit)
            key = (
                self,
                self.spec.version,
                _registry_version[0],
                dev,
                flags,
                in_descs,
                out_key,
                tuple((k, _typed(v)) for k, v in attrs.items()),
            )
            hash(key)
        except TypeError:  # an unhashable attribute value (a list of dims): key on the normalised form
            try:
                norm = self._attrs(attrs)
                key = (
                    self,
                    self.spec.version,
                    _registry_version[0],
                    dev,
                    flags,
                    in_descs,
                    out_key,
                    tuple((k, _typed(v)) for k, v in norm.items()),
                )
                hash(key)
            except TypeError:
                return None
        return key

    def _plan(
        self,
        in_descs: tuple[TensorDesc | None, ...],
        outs: tuple[Any, ...] | None,
        limit: int | None,
        attrs: dict[str, Any],
    ) -> tuple[Plan, dict[str, Any], tuple[TensorDesc, ...]]:
        """check, infer, select: the part of phase 1 that the cache skips."""
        norm = self._attrs(attrs)
        out_descs = self.spec.infer(in_descs, norm)
        if outs is not None:
            out_descs = self._out_descs(outs, out_descs)
        plan = self.spec.select(in_descs, out_descs, norm, limit)
        if plan.workspace_size < 0:
            raise InternalError("negative workspace size", op=self.name, status=Status.ERR_INNER_TILING)
        if limit is not None and plan.workspace_size > limit:  # an op with one way to run (or none that fits)
            raise over_limit(self.name, plan.workspace_size, plan.implementation, limit)
        return plan, norm, out_descs

    def _input_descs(self, inputs: Sequence[Any]) -> tuple[tuple[TensorDesc | None, ...], dict[int, Tensor]]:
        names = self._input_names(len(inputs))
        if names is None:
            want = (
                f"at least {self._n_inputs} inputs {self.spec.inputs}"
                if self._variadic
                else f"{self._n_inputs} inputs {self.spec.inputs}"
            )
            raise ParamError(op=self.name, arg="inputs", expected=want, got=f"{len(inputs)}")
        descs: list[TensorDesc | None] = []
        bound: dict[int, Tensor] = {}
        for i, name in enumerate(names):
            x = inputs[i] if i < len(inputs) else None
            if isinstance(x, Tensor):
                bound[i] = x
                descs.append(x.desc)
            elif isinstance(x, TensorDesc):
                descs.append(x)
            elif x is None and name.endswith("?"):
                descs.append(None)
            elif x is None:
                raise ParamError(
                    op=self.name,
                    arg=name.rstrip("*"),
                    expected="a Tensor or TensorDesc",
                    got="None",
                    status=Status.ERR_PARAM_NULLPTR,
                )
            else:
                raise ParamError(
                    op=self.name, arg=name.rstrip("?*"), expected="a Tensor or TensorDesc", got=type(x).__name__
                )
        return tuple(descs), bound

    def _input_names(self, given: int) -> list[str] | None:
        """One name per operand slot for ``given`` positional inputs, or None when the count is wrong.

        A last input named ``xs*`` is variadic: it takes every remaining input (at least one), as ``xs[i]``.
        """
        spec = self.spec
        if self._variadic:
            fixed = list(spec.inputs[:-1])
            if given < len(fixed) + 1 or given < sum(self._required):
                return None
            base = spec.inputs[-1].rstrip("*")
            return fixed + [f"{base}[{i}]*" for i in range(given - len(fixed))]
        if given > self._n_inputs or given < sum(self._required):
            return None
        return list(spec.inputs)

    def input_name(self, i: int, given: int) -> str:
        """Input ``i`` of a call with ``given`` inputs as errors name it (``xs[2]`` for the third variadic one)."""
        names = self._input_names(given)
        return names[i].rstrip("?*") if names is not None and i < len(names) else f"input {i}"

    def _attrs(self, attrs: dict[str, Any]) -> dict[str, Any]:
        unknown = set(attrs) - self._attr_names
        if unknown:
            raise ParamError(
                op=self.name,
                arg=sorted(unknown)[0],
                expected=f"one of the attributes {sorted(self._attr_names)}",
                got="unknown attribute",
            )
        norm: dict[str, Any] = {}
        for a in self.spec.attrs:
            if a.name in attrs:
                v = attrs[a.name]
            elif a.default is REQUIRED:
                raise ParamError(op=self.name, arg=a.name, expected="a value (required attribute)", got="nothing")
            else:
                v = a.default
            try:
                norm[a.name] = a.convert(v)
            except ParamError as e:
                raise ParamError(op=self.name, arg=a.name, expected=e.expected, got=v) from None
            except (TypeError, ValueError, OverflowError):
                raise ParamError(
                    op=self.name, arg=a.name, expected=getattr(a.convert, "expects", "valid value"), got=v
                ) from None
        return norm

    def _out_descs(self, given: tuple[Any, ...], inferred: tuple[TensorDesc, ...]) -> tuple[TensorDesc, ...]:
        """The descs of ``out=``: each must have the inferred shape and dtype, and no format tag contradicting
        the inferred one (an ND out takes any layout: the caller reads it as the plain array it is)."""
        if len(given) != len(inferred):
            raise ParamError(op=self.name, arg="out", expected=f"{len(inferred)} output(s)", got=len(given))
        descs = []
        for i, (g, want) in enumerate(zip(given, inferred)):
            d = g.desc if isinstance(g, Tensor) else g
            if not isinstance(d, TensorDesc):
                raise ParamError(op=self.name, arg="out", expected="a Tensor or TensorDesc", got=type(g).__name__)
            arg = f"out[{i}]" if len(given) > 1 else "out"
            if d.shape != want.shape or d.dtype is not want.dtype:
                raise ParamError(
                    op=self.name,
                    arg=arg,
                    expected=f"shape {want.shape} dtype {want.dtype.value}",
                    got=f"shape {d.shape} dtype {d.dtype.value}",
                )
            if d.format is not want.format and d.format is not Format.ND and want.format is not Format.ND:
                raise ParamError(
                    op=self.name,
                    arg=arg,
                    expected=f"format {want.format.value} (or ND)",
                    got=f"format {d.format.value}",
                )
            descs.append(d)
        return tuple(descs)

    def _build_launch(self, ex: Executor) -> Callable[[Any], None]:
        dev = ex.device
        if not dev.runs_kernels:
            return _noop
        builder = self.spec.kernels.get(dev.kind)
        if builder is None:
            raise InternalError(
                op=self.name,
                arg="device",
                expected=f"a kernel for one of {sorted(self.spec.kernels)}",
                got=dev.kind,
                status=Status.ERR_INNER_KERNEL_NOT_FOUND,
            )
        # The same plan over the same memory (address and desc of every operand) yields the same launch:
        # a launch's views keep their memory mapped, so an address cannot be reused for other memory. A tiling
        # whose ``private_launch`` is true (state kept between launches: conv2d's transformed constant weights)
        # gets a launch of its own per binding: memory freed and refilled at the same address must not find it.
        # Its builder finds, in attrs[PRIVATE_STATE], the executor's own dict (kept across rebinding) and the
        # blocks of the operands now bound, so that it can tell a rebound operand from the same one.
        private = getattr(ex.plan.tiling, "private_launch", False)  # then no key: the memo is not asked
        operands: list[tuple[int, TensorDesc] | None] = []
        for t in ex._tensors:
            if t is None:
                operands.append(None)
                continue
            if t.block.freed:
                raise InvalidStateError("tensor's block was freed", op=self.name, arg="operand", got=t.desc)
            operands.append((t.block.segment.address + t.block.offset, t.desc))
        key = None if private else (id(ex.plan), dev.kind, tuple(operands))
        memo = self._launches  # shared by every thread that runs the op (each OrderedDict call is atomic)
        hit = None if key is None else memo.get(key)
        if hit is not None:
            try:
                memo.move_to_end(key)
            except KeyError:  # another thread evicted it between the get and the move: the launch is still good
                pass
            return hit[1]
        n = len(ex.input_descs)
        views = [t.view() if t is not None else None for t in ex._tensors]
        for j, o in enumerate(views[n:]):
            if o is not None and self_overlapping(o):
                raise ParamError(
                    op=self.name,
                    arg="out" if len(views) - n == 1 else f"out {j}",
                    expected="an output whose elements are each their own memory",
                    got=f"a view with strides {o.strides} (elements share memory)",
                )
        if self.spec.aliases != "any":
            self._check_overlap(views, n, operands)
        attrs = ex.attrs
        if key is None:
            if ex._private is None:
                ex._private = {}
            attrs = {**attrs, PRIVATE_STATE: (ex._private, tuple(None if t is None else t.block for t in ex._tensors))}
        launch = builder(ex.plan, attrs, tuple(views[:n]), tuple(views[n:]))
        if key is None:
            return launch
        with self._launch_lock:  # the length check and the evictions together
            memo[key] = (ex.plan, launch)  # the plan is kept so that its id stays unique
            while len(memo) > LAUNCH_MEMO:
                memo.popitem(last=False)
        return launch

    def _check_overlap(self, views: list[Any], n: int, operands: list[tuple[int, TensorDesc] | None]) -> None:
        """Refuse an output that overlaps an input (other than as the same view, where ``aliases`` allows it) or
        another output. Operands whose byte ranges (``operands``: address, desc) are apart are passed over in
        Python: numpy's overlap test lets go of the GIL, and a stream worker waiting for it then holds up the host
        thread (one-shot calls: ~20 us a test while kernels run)."""
        names = [self.input_name(i, n) for i in range(n)] + [f"out {j}" for j in range(len(views) - n)]
        in_place = self.spec.aliases if isinstance(self.spec.aliases, tuple) else ()
        ranges = [None if op is None else byte_range(*op) for op in operands]
        for j in range(n, len(views)):
            o = views[j]
            if o is None:
                continue
            for i, v in enumerate(views[:j]):
                if (
                    v is None
                    or apart(ranges[i], ranges[j])
                    or (i < n and i in in_place and same_view(o, v))
                    or not overlaps(o, v)
                ):
                    continue
                allowed = [self.spec.inputs[k].rstrip("?*") for k in in_place if k < len(self.spec.inputs)]
                expected = (
                    (f"memory apart from every input, or exactly the {' or '.join(allowed)} view (in place)")
                    if allowed
                    else "memory apart from every input and output"
                )
                raise ParamError(
                    op=self.name,
                    arg=names[j] if len(views) - n > 1 else "out",
                    expected=expected,
                    got=f"memory overlapping {names[i]}",
                )

    def _on_release(self, ex: Executor) -> None:
        self.counters.on_release(ex)
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("destroy %s after %d launch(es)", ex.describe(), ex.phase2_calls)

    # ---- phase 2
    def __call__(self, workspace: Block | None, workspace_size: int, executor: Executor, stream: Stream) -> None:
        """Phase 2: check the executor and workspace in O(1), then enqueue the prebuilt launch on ``stream``."""
        ex = executor
        try:
            if ex._gate is not self or ex._owner != _get_ident():
                self._refuse(ex)
        except AttributeError:
            self._refuse(ex)
        try:
            if (
                workspace_size != ex.workspace_size
                or stream.device is not ex.device
                or (workspace_size and workspace is None)
                or (
                    workspace is not None
                    and (
                        workspace.requested < workspace_size  # what malloc was asked for, not the pool's rounding
                        or not workspace.allocated
                        or (workspace.data is None and ex.device.runs_kernels)
                    )
                )
            ):
                self._refuse_workspace(workspace, workspace_size, ex, stream)
        except AttributeError:  # not a Stream / Block: diagnosed off the hot path
            self._refuse_types(workspace, stream)
            raise
        if not ex._repeatable:
            ex._gate = None
        try:
            seq = stream._enqueue(ex._launch, NO_WORKSPACE if workspace is None else workspace.data, ex)  # type: ignore[arg-type]
        except BaseException:
            self._enqueue_failed(ex, stream)
            raise
        for b in ex._blocks:  # Block.mark_use, inlined on the hot path
            b._stream = stream
            b._seq = seq
        if workspace is not None:  # the same: a free() without a stream then waits for this launch
            workspace._stream = stream
            workspace._seq = seq
        if ex._gate is None:
            ex._release(ExecState.CONSUMED)  # single-use: phase 2 consumed it

    def _enqueue_failed(self, ex: Executor, stream: Stream) -> None:
        """A single-use executor whose enqueue raised: spent if its launch ran (launch blocking: its failure raised
        inline), as an async launch is once queued; else (a closed stream, a capture's refusal) as it was."""
        if ex._repeatable or ex._state is not ExecState.READY or ex._gate is not None:
            return
        if stream._enqueue == stream._q.enqueue_inline:
            ex._release(ExecState.CONSUMED)
        else:
            ex._gate = self

    def _refuse(self, ex: Any) -> None:
        if not isinstance(ex, Executor):
            raise ParamError(op=self.name, arg="executor", expected="an Executor from phase 1", got=type(ex).__name__)
        if ex.op is not self:
            raise ParamError(op=self.name, arg="executor", expected=f"an executor of '{self.name}'", got=ex.describe())
        ex._check_ready("phase 2")
        missing = [
            i for i, t in enumerate(ex._tensors) if t is None and (ex.input_descs + ex.output_descs)[i] is not None
        ]
        raise InvalidStateError(
            "operands are not bound; bind them with set_input / set_output",
            op=self.name,
            arg="executor",
            expected="every operand bound",
            got=f"unbound operand(s) {missing}",
        )

    def _refuse_types(self, workspace: object, stream: object) -> None:
        check_stream(stream, self.name)
        if workspace is not None and not isinstance(workspace, Block):
            raise ParamError(
                op=self.name,
                arg="workspace",
                expected="None or a twophase Block (dev.malloc)",
                got=type(workspace).__name__,
            )

    def _refuse_workspace(self, workspace: Block | None, size: int, ex: Executor, stream: Stream) -> None:
        if stream.device is not ex.device:
            raise ParamError(
                op=self.name,
                arg="stream",
                got=f"a stream of {stream.device.name}",
                expected=f"a stream of {ex.device.name}, the executor's device",
            )
        if size != ex.workspace_size:
            raise WorkspaceTooSmallError(
                "workspace_size differs from phase 1's",
                op=self.name,
                arg="workspace_size",
                expected=ex.workspace_size,
                got=size,
            )
        if workspace is not None and not workspace.allocated:
            raise InvalidStateError(
                "the workspace block was freed",
                op=self.name,
                arg="workspace",
                expected="an allocated block",
                got=f"a freed block of {workspace.requested} bytes",
            )
        if workspace is not None and workspace.data is None and ex.device.runs_kernels and workspace.requested >= size:
            raise ParamError(
                op=self.name,
                arg="workspace",
                expected=f"a block of {ex.device.name}'s memory",
                got="a block without memory (from another device's pool)",
            )
        raise WorkspaceTooSmallError(
            op=self.name,
            arg="workspace",
            expected=f"a block of at least {size} bytes",
            got="None" if workspace is None else _block_bytes(workspace),
        )


def _block_bytes(b: Block) -> str:
    """A workspace block's size as a refusal names it: the bytes asked of malloc, and the pool's rounding."""
    return f"{b.requested} bytes" + (f" (rounded up to {b.size} by the pool)" if b.size != b.requested else "")


PRIVATE_STATE = "_private_state"  # the attrs key of a private launch's builder: (executor's dict, operand blocks)

# launches remembered per op (LRU), keyed by plan and operand memory: at least the distinct launches of one op in a
# model's forward (MiniLM: 24 linears; BERT-base: 72), or a cycle longer than the memo misses on every call. At 16
# the one-shot MiniLM 1x128 forward rebuilt all 24 linear launches each time: its host side took 12-14 ms instead
# of 3-5, and the forward 35-37 ms instead of 23-28 (alternating processes, /tmp/w32/o12.py, thirty-second session)
LAUNCH_MEMO = 256

registry: dict[str, Op] = {}
_registry_version = [0]


def _forget_launches() -> None:
    """Drop every op's memoised launches (a pool released memory): their views would keep it mapped. They die
    outside the op's lock: a view dropped may run a finalizer (a DLPack export's) that frees into a pool."""
    for op in list(registry.values()):
        with op._launch_lock:
            dropped = list(op._launches.values())
            op._launches.clear()
        del dropped


RELEASE_LISTENERS.append(_forget_launches)


def register(spec: OpDef) -> Op:
    """Add an op to the registry (``twophase.ops.NAME`` and the one-shot API pick it up)."""
    if not isinstance(spec, OpDef):
        raise ParamError(op="register", arg="spec", expected="an OpDef", got=type(spec).__name__)
    if spec.name in registry:
        raise InternalError(f"op '{spec.name}' registered twice", op=spec.name)
    op = Op(spec)
    registry[spec.name] = op
    _registry_version[0] += 1
    return op


def get_op(name: str) -> Op:
    try:
        return registry[name]
    except (KeyError, TypeError):
        raise ParamError(op="get_op", arg="name", expected=f"one of {sorted(registry)}", got=name) from None


def _registered_spec(name: str) -> OpDef:
    return get_op(name).spec


def as_op(op: object, fn: str) -> Op:
    """``op`` itself, or the registered op of that name; else a ParamError naming ``fn``'s ``op`` argument."""
    if isinstance(op, Op):
        return op
    if isinstance(op, str):
        return get_op(op)
    raise ParamError(op=fn, arg="op", expected="an Op or the name of a registered op", got=type(op).__name__)
