"""A captured graph: nodes recorded by ``capture``, planned into one arena by ``instantiate``, and
enqueued whole, as one stream task, by ``replay``."""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..config import int_value
from ..errors import (
    CaptureError,
    InvalidStateError,
    KernelError,
    ParamError,
    PlanMismatchError,
    TwoPhaseError,
    refuse_pickle,
)
from ..executor import Executor
from ..layout import relation
from ..runtime.device import NO_WORKSPACE
from ..runtime.memory import Block
from ..runtime.stream import CONTROL, TASK_LISTENERS, Event, Stream, check_stream, describe_owner
from ..tensor import Tensor, TensorDesc
from .planner import DEFAULT_ALIGNMENT, ArenaPlan, Buffer, liveness, plan_arena
from .virtual import VirtualBlock

__all__ = ["Graph", "GraphMemory"]


class _Node:
    """One recorded launch: what phase 1 decided, and the operands bound at the time of the launch."""

    __slots__ = ("op", "plan", "attrs", "input_descs", "output_descs", "workspace_size", "operands")

    def __init__(self, ex: Executor, operands: tuple[Any, ...]) -> None:
        self.op = ex.op
        self.plan = ex.plan
        self.attrs = ex.attrs
        self.input_descs = ex.input_descs
        self.output_descs = ex.output_descs
        self.workspace_size = ex.workspace_size
        self.operands = operands


class _Binding:
    """A named input or output: the tensor declared at capture, the one bound now, and the operands it feeds."""

    __slots__ = ("name", "kind", "desc", "default", "current", "key", "uses", "straddled")

    def __init__(self, name: str, kind: str, tensor: Tensor, key: Any) -> None:
        self.name = name
        self.kind = kind
        self.desc = tensor.desc
        self.default = tensor
        self.current = tensor
        self.key = key  # the external Block, or the virtual id
        self.uses: list[tuple[int, int, TensorDesc]] = []  # (node, operand slot, operand desc)
        self.straddled = False  # an operand reads across the named view's edge: it cannot be rebound


# check(graph, stream) before every replay is enqueued, after its rebinding; may raise to refuse it (the sanitizer's)
REPLAY_CHECKS: list[Callable[[Graph, Stream], None]] = []

# Guard bytes around every buffer of an arena instantiated now ("bytes" 0: none), their fill and the check that
# raises when they were overwritten: the sanitizer sets them while it is on (an intermediate overrunning into its
# neighbour in the arena is reported at the node that wrote it).
ARENA_GUARDS: dict[str, Any] = {"bytes": 0, "fill": 0, "check": None}


class _ArenaGuards:
    """Guard bytes around the arena buffers each node writes (its outputs, its workspace): written just before the
    node runs and checked just after. A buffer's space is reused once it is dead, so its guards are its own only
    while it lives."""

    __slots__ = ("raw", "per_node", "bytes", "fill", "check", "graph")

    def __init__(self, raw: Any, per_node: list[list[tuple[str, int, int]]], graph: Graph) -> None:
        self.raw = raw
        self.per_node = per_node
        self.bytes, self.fill, self.check = ARENA_GUARDS["bytes"], ARENA_GUARDS["fill"], ARENA_GUARDS["check"]
        self.graph = graph

    def before(self, i: int) -> None:
        g, raw = self.bytes, self.raw
        for _, off, size in self.per_node[i]:
            raw[off - g : off] = self.fill
            raw[off + size : off + size + g] = self.fill

    def after(self, i: int) -> None:
        if self.per_node[i]:
            self.check(self.raw, self.per_node[i], self.graph)


@dataclass(frozen=True)
class GraphMemory:
    """What the planner did: ``arena_bytes`` hold every intermediate and workspace of the graph;
    ``naive_bytes`` is what the same buffers take allocated one by one (pool granularity);
    ``peak_bytes`` is the most bytes live at one node (no arena can be smaller)."""

    arena_bytes: int
    naive_bytes: int
    peak_bytes: int
    intermediates: int
    workspaces: int
    strategy: str

    @property
    def ratio(self) -> float:
        """arena / one-by-one (1.0 when there is nothing to place)."""
        return self.arena_bytes / self.naive_bytes if self.naive_bytes else 1.0


class Graph:
    """A captured sequence of launches. Made by ``twophase.capture(stream)``.

    Lifecycle: capture → ``input``/``output`` declarations → ``instantiate()`` → ``replay(stream, **tensors)``
    any number of times → ``destroy()`` (or ``with graph:``). Belongs to the thread that captured it.
    """

    _ids = itertools.count(1)

    id: int
    name: str
    stream: Stream
    device: Any
    replays: int
    _thread: int
    _owner: int
    _state: str
    _seq0: int
    _nodes: list[_Node]
    _vsizes: list[int]
    _vrefs: list[weakref.ref[VirtualBlock]]
    _escaped: tuple[weakref.ref[VirtualBlock], ...]  # the tensors on the arena the caller can still reach
    _vfreed: list[bool]
    _bindings: dict[str, _Binding]
    _steps: list[tuple[Any, Any, int, tuple[Tensor | None, ...]]] | None
    _execs: tuple[Executor, ...]
    _arena: Block | None
    _guards: _ArenaGuards | None  # the sanitizer's guard bytes between arena buffers, if it was on at instantiate
    _internal: set[int]
    _mark_blocks: tuple[Block, ...]
    _rebound: set[str]
    _outputs: dict[str, Tensor]
    _last_stream: Stream | None
    _last_seq: int
    _plan: ArenaPlan | None

    def __init__(self, *_: Any, **__: Any) -> None:
        raise TypeError("Graphs are made by a capture: use `with twophase.capture(stream) as graph:`")

    @classmethod
    def _new(cls, stream: Stream, name: str | None, thread: int) -> Graph:
        self = object.__new__(cls)
        self.id = next(Graph._ids)
        self.name = name or f"graph#{self.id}"
        self.stream = stream
        self.device = stream.device
        self._thread = thread
        self._state = "capturing"
        self._seq0 = stream._q.submitted
        self._owner = thread
        self._nodes = []
        self._vsizes = []
        self._vrefs = []
        self._escaped = ()
        self._vfreed = []
        self._bindings = {}
        self._steps = None
        self._execs = ()
        self._arena = None
        self._guards = None
        self._internal = set()
        self._mark_blocks = ()
        self._rebound = set()
        self._outputs = {}
        self._last_stream = None
        self._last_seq = 0
        self._plan = None
        self.replays = 0
        return self

    # ---- introspection
    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def ops(self) -> list[str]:
        """The op of each node, in launch order."""
        return [n.op.name for n in self._nodes]

    @property
    def state(self) -> str:
        """``capturing``, ``captured``, ``failed`` (the capture block raised), ``instantiated`` or ``destroyed``."""
        return self._state

    @property
    def inputs(self) -> dict[str, Tensor]:
        return {n: b.current for n, b in self._bindings.items() if b.kind == "input"}

    @property
    def outputs(self) -> dict[str, Tensor]:
        return {n: b.current for n, b in self._bindings.items() if b.kind == "output"}

    @property
    def memory(self) -> GraphMemory:
        """The planner's report (after ``instantiate``)."""
        p = self._plan
        if p is None:
            raise InvalidStateError(
                f"{self} is {self._state}: the arena is planned by instantiate()", op="Graph.memory", arg="graph"
            )
        n_ws = sum(1 for n in self._nodes if n.workspace_size)
        return GraphMemory(p.size, p.naive, p.peak, len(p.offsets) - n_ws, n_ws, p.strategy)

    def describe(self) -> str:
        return f"graph '{self.name}' ({len(self._nodes)} nodes)"

    def __str__(self) -> str:
        return f"graph '{self.name}'"

    def __reduce__(self) -> Any:
        refuse_pickle(self, "capture the graph again in the receiving process")

    def __repr__(self) -> str:
        return f"Graph('{self.name}', {len(self._nodes)} nodes, {self._state})"

    # ---- capture side (called through the swapped entry points)
    def _record(self, fn: Any, arg: Any, owner: Any) -> int:
        if threading.get_ident() != self._thread:
            raise CaptureError(
                f"stream '{self.stream.name}' is being captured by another thread",
                op="capture",
                arg="stream",
                got=describe_owner(owner),
            )
        if not isinstance(owner, Executor):
            what = "an event record / wait" if owner is CONTROL else describe_owner(owner)
            raise CaptureError(
                f"{what} cannot be captured into {self}: a graph records op "
                "launches only (create input tensors before the capture; no events, callbacks or "
                "graph replays inside it)",
                op="capture",
                arg="stream",
            )
        operands: list[Any] = []
        for t in owner._tensors:
            if t is None:
                operands.append(None)
                continue
            b = t.block
            if type(b) is VirtualBlock and b.virtual:
                if b.graph is not self:
                    raise CaptureError(
                        f"{owner.describe()} uses a tensor of another capture ({b.graph})",
                        op=owner.op.name,
                        arg="operand",
                    )
                operands.append((t.desc, b.vid))
            else:  # phase 2 marks it with this seq: the capture's phase-2 hook puts its mark back
                operands.append((t.desc, b))
        self._nodes.append(_Node(owner, tuple(operands)))
        return self._seq0  # nothing ran: waits on this seq are waits on the work before the capture

    def _virtual_block(self, nbytes: int) -> VirtualBlock:
        vb = VirtualBlock(self.device.pool, self, len(self._vsizes), nbytes)
        self._vsizes.append(nbytes)
        self._vrefs.append(weakref.ref(vb))
        self._vfreed.append(False)
        return vb

    def _on_virtual_free(self, vid: int) -> None:
        if vid < len(self._vfreed):
            self._vfreed[vid] = True

    def _end_capture(self, failed: bool) -> None:
        self._state = "failed" if failed else "captured"

    # ---- names
    def input(self, name: str, tensor: Tensor) -> Tensor:
        """Name an external input (a tensor made before the capture); ``replay(name=other)`` rebinds it."""
        self._declare(name, tensor, "input")
        return tensor

    def output(self, name: str, tensor: Tensor) -> Tensor:
        """Name an output: a tensor the capture allocated (arena-backed after ``instantiate``, valid until the
        next replay) or an external one; ``replay(name=buffer)`` writes into a caller-provided buffer instead."""
        self._declare(name, tensor, "output")
        return tensor

    def _declare(self, name: str, tensor: Tensor, kind: str) -> None:
        if self._state not in ("capturing", "captured"):
            raise InvalidStateError(
                f"{self} is {self._state}: declare inputs and outputs before instantiate()",
                op=f"Graph.{kind}",
                arg="name",
                got=name,
            )
        if not isinstance(name, str) or not name.isidentifier():
            raise ParamError(op=f"Graph.{kind}", arg="name", expected="an identifier (a keyword of replay)", got=name)
        if name in self._bindings:
            raise ParamError(
                op=f"Graph.{kind}",
                arg="name",
                expected="a new name",
                got=f"'{name}' (already the {self._bindings[name].kind} {self._bindings[name].desc})",
            )
        if not isinstance(tensor, Tensor):
            raise ParamError(op=f"Graph.{kind}", arg=name, expected="a Tensor", got=type(tensor).__name__)
        if tensor.device is not self.device:
            raise ParamError(
                op=f"Graph.{kind}", arg=name, expected=f"a tensor on {self.device.name}", got=tensor.device.name
            )
        b = tensor.block
        vb = b if isinstance(b, VirtualBlock) and b.virtual else None
        if vb is not None and (kind == "input" or vb.graph is not self):
            raise CaptureError(
                "an input must be a tensor made before the capture"
                if kind == "input"
                else f"the tensor belongs to another capture ({vb.graph})",
                op=f"Graph.{kind}",
                arg=name,
            )
        key: Any = b if vb is None else vb.vid
        for other in self._bindings.values():
            # vids compare by value, blocks by identity; views of one block may be named apart if they are disjoint
            if other.key == key and (vb is not None or relation(other.desc, tensor.desc) != "apart"):
                raise ParamError(
                    op=f"Graph.{kind}",
                    arg=name,
                    expected="memory not named yet",
                    got=f"the memory of {other.kind} '{other.name}'",
                )
        self._bindings[name] = _Binding(name, kind, tensor, key)

    # ---- instantiation
    def _writers(self, kind: str, k: int) -> list[int]:
        """The nodes that write arena buffer ``k``: the node of a workspace, the nodes with intermediate ``k`` as
        an output."""
        if kind == "w":
            return [k]
        return [
            i
            for i, n in enumerate(self._nodes)
            if any(op is not None and op[1] == k for op in n.operands[len(n.input_descs) :])
        ]

    def _buffer_label(self, kind: str, k: int) -> str:
        """An arena buffer as error messages name it."""
        return f"the workspace of node {k}" if kind == "w" else f"intermediate #{k}"

    def instantiate(self, alignment: int = DEFAULT_ALIGNMENT) -> Graph:
        """Plan every intermediate and workspace into one arena, allocate it, and build each node's launch.

        Intermediates are placed by liveness; tensors allocated by the capture and still referenced now
        (or declared outputs) stay live to the end of the graph, so they can be read after a replay.
        Inputs, external outputs and weights stay where they are. Returns the graph.
        """
        if self._state != "captured":
            raise InvalidStateError(
                f"{self} is {self._state}",
                op="Graph.instantiate",
                arg="graph",
                expected="a finished capture (instantiate once)",
                got=self._state,
            )
        if threading.get_ident() != self._thread:
            raise InvalidStateError(f"{self} belongs to another thread", op="Graph.instantiate", arg="graph")
        if int_value(alignment) is None or alignment < 1 or alignment & (alignment - 1):
            raise ParamError(op="Graph.instantiate", arg="alignment", expected="a power of two (bytes)", got=alignment)
        nodes = self._nodes
        uses = [[op[1] for op in n.operands if op is not None and type(op[1]) is int] for n in nodes]
        keep = {b.key for b in self._bindings.values() if type(b.key) is int}
        keep.update(vid for vid, ref in enumerate(self._vrefs) if ref() is not None and not self._vfreed[vid])
        used = {v for u in uses for v in u}
        keep = {v for v in keep if v in used or any(b.key == v for b in self._bindings.values())}
        spans = liveness(uses, keep)
        guard = ARENA_GUARDS["bytes"]
        keys: list[tuple[str, int]] = [("v", v) for v in sorted(spans)]
        buffers = [Buffer(self._vsizes[v] + 2 * guard, *spans[v]) for v in sorted(spans)]
        for i, n in enumerate(nodes):
            if n.workspace_size:
                keys.append(("w", i))
                buffers.append(Buffer(n.workspace_size + 2 * guard, i, i))
        plan = plan_arena(buffers, alignment)
        pool = self.device.pool
        arena = pool.malloc(plan.size, stream=self.stream)
        if type(arena) is VirtualBlock:  # this thread captures another graph: the pool gave a block of it
            arena.free()
            raise CaptureError(
                f"{self} cannot be instantiated while this thread captures {arena.graph} (its allocations are "
                "virtual): instantiate before or after that capture",
                op="Graph.instantiate",
                arg="graph",
            )
        execs: list[Executor] = []
        zones: list[list[tuple[str, int, int]]] = [[] for _ in nodes]  # per node: the guarded buffers it writes
        named = {
            b.key: nb
            for b in self._bindings.values()
            if type(b.key) is int and isinstance(nb := b.default.block, VirtualBlock)
        }
        blocks: dict[int, VirtualBlock] = {}
        revived = [vb for vb in named.values() if vb.freed]  # freed during the capture, kept: freed again on failure
        for kept in revived:
            kept.allocated, kept.freed = True, False
        try:
            ws: dict[int, Any] = {}
            for (kind, k), off in zip(keys, plan.offsets):
                off += guard
                if guard:
                    size = self._vsizes[k] if kind == "v" else nodes[k].workspace_size
                    for i in self._writers(kind, k):
                        zones[i].append((self._buffer_label(kind, k), off, size))
                if kind == "v":
                    # a named output stays the caller's tensor, even if its block was freed during the capture
                    vb: VirtualBlock | None = named.get(k) or self._vrefs[k]()
                    if vb is None or vb.freed:
                        vb = VirtualBlock(pool, self, k, self._vsizes[k])
                        self._internal.add(id(vb))
                    blocks[k] = vb
                    vb._materialize(arena, off)
                else:
                    ws[k] = None if arena.data is None else arena.data[off : off + nodes[k].workspace_size]
            for i, n in enumerate(nodes):
                try:
                    execs.append(self._clone(n, blocks))
                except TwoPhaseError as e:  # refused only now (an out= overlapping an input): say which launch
                    e.add_note(f"refused at instantiate: node {i} ('{n.op.name}') of {self.describe()}")
                    raise
        except BaseException:  # the graph stays captured: its tensors go back to having no memory
            for ex in execs:
                ex.destroy()
            for vb in blocks.values():
                vb._dematerialize()
            for kept in revived:
                kept.allocated, kept.freed = False, True
            arena.free(self.stream)
            raise
        self._arena = arena
        self._guards = _ArenaGuards(arena.data, zones, self) if guard and arena.data is not None else None
        self._plan = plan
        self._execs = tuple(execs)
        self._steps = [(ex._launch, ws.get(i, NO_WORKSPACE), i, tuple(ex._tensors)) for i, ex in enumerate(execs)]
        for b in self._bindings.values():
            # the operands on the named memory (a vid, or the Block) that meet the named view's bytes; one that
            # also reads or writes bytes outside it (the whole of a named view's intermediate) forbids rebinding
            met = [
                (i, s, op[0], relation(b.desc, op[0]))
                for i, n in enumerate(nodes)
                for s, op in enumerate(n.operands)
                if op is not None and op[1] == b.key
            ]
            b.uses = [(i, s, d) for i, s, d, r in met if r != "apart"]
            b.straddled = any(r == "straddles" for *_, r in met)
            if b.kind == "output":
                self._outputs[b.name] = b.current
        self._refresh_marks()
        # the tensors on the arena the caller can still reach: an eager op on another stream reading one must be
        # done before a replay overwrites it (or destroy frees it)
        self._escaped = tuple(r for r in self._vrefs if (vb := r()) is not None and not vb.virtual)
        self._owner = threading.get_ident()
        self._last_stream, self._last_seq = self.stream, self.stream._q.submitted  # the arena's stream order
        self._state = "instantiated"
        return self

    def _clone(self, node: _Node, blocks: dict[int, VirtualBlock]) -> Executor:
        """A repeatable executor of the node's plan bound to arena / external tensors (no phase 1 again)."""
        op, dev = node.op, self.device
        ex = Executor._make(op, node.plan, node.attrs, node.input_descs, node.output_descs)
        op.counters.on_create(ex)
        ex.set_repeatable()
        try:
            bind = {
                s: Tensor._make(o[0], blocks[o[1]] if type(o[1]) is int else o[1], dev)
                for s, o in enumerate(node.operands)
                if o is not None
            }
            ex._bind_many(bind)
        except BaseException:  # refused (an output overlapping an input): only phase 2's binding could tell
            ex.destroy()
            raise
        return ex

    def _refresh_marks(self) -> None:
        marks: dict[int, Block] = {id(self._arena): self._arena}  # type: ignore[dict-item]
        for ex in self._execs:
            for b in ex._blocks:
                if id(b) not in self._internal:
                    marks[id(b)] = b
        self._mark_blocks = tuple(marks.values())

    # ---- replay
    def replay(self, stream: Stream, /, **tensors: Tensor) -> dict[str, Tensor]:
        """Enqueue every node on ``stream`` as one task; returns the outputs by name (a new dict each time).

        Keywords rebind named inputs / outputs to tensors of the same desc (``PlanMismatchError`` otherwise)
        for this replay; a name left out is bound to the tensor declared at capture. Only the launches
        that read a rebound tensor are rebuilt. Arena-backed outputs are valid until the next replay.
        """
        steps = self._steps
        if steps is None or threading.get_ident() != self._owner:
            self._refuse_replay()
        switch = stream is not self._last_stream or stream is None
        if switch:
            check_stream(stream, "Graph.replay", device=self.device)
        if tensors or self._rebound:
            self._apply(tensors)
            steps = self._steps
        for check in REPLAY_CHECKS:
            check(self, stream)
        if switch:  # only once nothing can refuse the replay: a refused one leaves the graph as it was
            self._order_after_last(stream)
        if self._escaped:
            self._after_outside_uses(stream)
        seq = stream._enqueue(_run_graph, (steps, self, stream._q, self._execs), self)
        for b in self._mark_blocks:
            b.mark_use(stream, seq)  # host reads wait for the replay (and the sanitizer sees the use)
        self._last_stream, self._last_seq = stream, seq  # not before: a refused or failed enqueue keeps the order
        self.replays += 1
        return dict(self._outputs)  # the caller's: a later replay with other bindings must not change it

    def _refuse_replay(self) -> None:
        if self._state != "instantiated":
            hint = "; call instantiate() first" if self._state == "captured" else ""
            raise InvalidStateError(
                f"{self} is {self._state}{hint}",
                op="Graph.replay",
                arg="graph",
                expected="an instantiated graph",
                got=self._state,
            )
        raise InvalidStateError(
            f"{self} belongs to the thread that instantiated it",
            op="Graph.replay",
            arg="graph",
            got=f"replay from thread {threading.current_thread().name}",
        )

    def _order_after_last(self, stream: Stream) -> None:
        """Order a new stream after the previous replay, or after the capture stream's work up to
        ``instantiate`` (the arena was allocated in that stream's order)."""
        if self._last_stream is not None:
            _order_after(stream, self._last_stream, self._last_seq)

    def _apply(self, tensors: dict[str, Tensor]) -> None:
        changes: dict[int, dict[int, Tensor]] = {}
        for name, t in tensors.items():
            b = self._bindings.get(name)
            if b is None:
                raise ParamError(
                    op="Graph.replay",
                    arg=name,
                    expected=f"one of the names {sorted(self._bindings)}",
                    got="an unknown name",
                )
            if not isinstance(t, Tensor):
                raise ParamError(op="Graph.replay", arg=name, expected="a Tensor", got=type(t).__name__)
            if t.desc != b.desc:
                raise PlanMismatchError(
                    f"{b.kind} '{name}' needs a tensor of the captured desc (capture again for another shape)",
                    op="Graph.replay",
                    arg=name,
                    expected=b.desc,
                    got=t.desc,
                )
            if t.device is not self.device:
                raise ParamError(
                    op="Graph.replay", arg=name, expected=f"a tensor on {self.device.name}", got=t.device.name
                )
            t.block.check_memory(t.desc)  # a tensor of a capture running now (its launch would be deferred)
            if t.block is b.current.block:
                continue
            if (type(t.block) is VirtualBlock and t.block.graph is self) or t.block is self._arena:
                raise ParamError(
                    op="Graph.replay",
                    arg=name,
                    got="a tensor in this graph's own arena",
                    expected="a tensor outside this graph's arena (copy an output of the graph before "
                    "feeding it back: the replay overwrites it while reading)",
                )
            if b.straddled:
                raise ParamError(
                    op="Graph.replay",
                    arg=name,
                    got="a rebinding",
                    expected=f"{b.kind} '{name}' as captured: an operand reads or writes across its edge "
                    "(name the whole tensor instead)",
                )
        current: dict[str, Tensor] = {}
        for name, b in self._bindings.items():
            t = current[name] = tensors.get(name, b.default)
            if t.block is not b.current.block:
                for i, s, d in b.uses:
                    changes.setdefault(i, {})[s] = t if d == t.desc else Tensor._make(d, t.block, t.device)
        if changes:
            steps = list(self._steps)  # type: ignore[arg-type]  # copy: enqueued replays keep their launches
            done: list[tuple[Executor, dict[int, Tensor]]] = []
            try:
                for i, slots in changes.items():
                    ex = self._execs[i]
                    old = {s: prev for s in slots if (prev := ex._tensors[s]) is not None}
                    ex._bind_many(slots)
                    done.append((ex, old))
                    steps[i] = (ex._launch, steps[i][1], i, tuple(ex._tensors))
            except BaseException:  # a refused rebinding (a freed tensor): the nodes rebound so far go back
                for ex, old in reversed(done):
                    ex._bind_many(old)
                raise
            self._steps = steps
        for name, b in self._bindings.items():
            b.current = current[name]
        self._rebound = {n for n, b in self._bindings.items() if b.current.block is not b.default.block}
        for n, b in self._bindings.items():
            if b.kind == "output":
                self._outputs[n] = b.current
        if changes:
            self._refresh_marks()

    # ---- release
    def destroy(self) -> None:
        """Synchronize the last replay's stream, free the arena, destroy the node executors."""
        if self._state == "destroyed":
            raise InvalidStateError(f"{self} is already destroyed", op="Graph.destroy", arg="graph")
        if self._state == "capturing":
            raise CaptureError(f"{self} is still capturing", op="Graph.destroy", arg="graph")
        owner = self._owner if self._state == "instantiated" else self._thread
        if threading.get_ident() != owner:  # refused before anything changes: its executors are that thread's
            raise InvalidStateError(
                f"{self} belongs to another thread",
                op="Graph.destroy",
                arg="graph",
                got=f"destroy from thread {threading.current_thread().name}",
            )
        last = self._last_stream
        if last is not None and last._q is not last._work_q and last._q._graph._thread == owner:  # type: ignore[attr-defined]
            raise CaptureError(  # refused before anything changes: its last replay may still be queued
                f"{self}'s last replay stream '{last.name}' is being captured by this thread: end that capture first",
                op="Graph.destroy",
                arg="graph",
            )
        try:
            if last is not None:
                last.synchronize()
        finally:
            self._release()

    def _release(self) -> None:
        self._state = "destroyed"
        self._steps = None
        if self._arena is not None:
            stream = self._last_stream or self.stream
            self._after_outside_uses(stream)
            self._arena.free(stream)
            self._arena = None
        for ex in self._execs:
            ex.destroy()
        for ref in self._vrefs:
            vb = ref()
            if vb is not None and not vb.virtual:
                vb.allocated = False
                vb.freed = True
                vb.data = vb.arena = None  # a tensor the caller keeps must not keep the arena mapped
        for b in self._bindings.values():
            b.current._view = b.default._view = None
        self._execs = ()
        self._mark_blocks = ()
        self._bindings.clear()
        self._outputs = {}

    def _after_outside_uses(self, stream: Stream) -> None:
        """Order ``stream`` (where the next replay runs, or the arena is freed) after pending uses of the graph's
        tensors on other streams (an eager op reading an output): they mark the tensor's virtual block, which
        neither the replay order nor the arena's free can see."""
        for ref in self._escaped:
            vb = ref()
            if vb is not None and vb._stream is not None and vb._stream is not stream and not vb._stream.closed:
                _order_after(stream, vb._stream, vb._seq)

    def __enter__(self) -> Graph:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._state not in ("destroyed", "capturing"):
            self.destroy()

    def _node_error(self, i: int, exc: BaseException) -> KernelError:
        name = self._nodes[i].op.name if 0 <= i < len(self._nodes) else "?"
        return KernelError(f"node {i} ('{name}') of {self.describe()}: {type(exc).__name__}: {exc}", op=name)


def _order_after(stream: Stream, other: Stream, seq: int) -> None:
    """``stream``'s later work waits for task ``seq`` of ``other`` (nothing to wait for once it is done)."""
    if other._q.done < seq:
        ev = Event._make(other)
        ev.seq = seq
        stream.wait_event(ev)


_node = threading.local()  # (executor, operands) of the graph node whose task listeners run on this thread


def node_operands(ex: Executor) -> Sequence[Tensor | None]:
    """For a task listener called for graph node ``ex``: its operands in the replay that ran (a later replay
    queued meanwhile may have rebound ``ex`` already); otherwise ``ex``'s own."""
    cur = getattr(_node, "cur", None)
    return cur[1] if cur is not None and cur[0] is ex else ex._tensors


def _run_graph(
    arg: tuple[list[tuple[Any, Any, int, tuple[Tensor | None, ...]]], Graph, Any, tuple[Executor, ...]],
) -> None:
    """The replay task: every prebuilt launch in order; per-node spans for task listeners (the profiler). The
    executors come with the task: a graph destroyed meanwhile has none left."""
    steps, graph, q, execs = arg
    guards = graph._guards
    i = -1
    try:
        if TASK_LISTENERS or guards is not None:
            seq, perf = q.done + 1, time.perf_counter
            try:
                for launch, ws, i, operands in steps:
                    if guards is not None:
                        guards.before(i)
                    t0 = perf()
                    launch(ws)
                    t1 = perf()
                    if guards is not None:
                        guards.after(i)
                    _node.cur = (execs[i], operands)
                    for cb in tuple(TASK_LISTENERS):
                        cb(q.name, execs[i], t0, t1, seq)
            finally:
                _node.cur = None
        else:
            for launch, ws, i, _ in steps:  # noqa: B007  (i names the failing node)
                launch(ws)
    except BaseException as exc:
        for _, _, j, _ in steps:  # the nodes that ran count as launched; a dropped replay counts nothing
            if j == i:
                break
            execs[j].launches += 1
        raise graph._node_error(i, exc) from exc
    for ex in execs:  # as a stream worker counts an eager launch: once its task has run
        ex.launches += 1
