"""Lifetime tracking: where each executor was planned, consumed and destroyed, which stream tasks use which
blocks, which streams waited for which. The checks of phase 2, free, destroy, rebinding and host reads.

Everything here is installed by swapping class attributes (and ``twophase.hooks``) only while the sanitizer
is on; ``uninstall`` puts the plain functions back.
"""

from __future__ import annotations

import collections
import re
import sys
import threading
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import hooks
from ..config import int_value
from ..executor import ExecState, Executor
from ..graph.capture import _CaptureQueue
from ..graph.replay import Graph, node_operands
from ..graph.virtual import VirtualBlock
from ..op import Op
from ..runtime import forking
from ..runtime.device import _copy_task
from ..runtime.memory import Block
from ..runtime.stream import Event, QueueRecords, Stream, _Queue, running_queue
from ..tensor import Tensor
from . import guards
from .guards import GuardedBlock
from .report import (
    ConstantOperandError,
    ExecutorMisuseError,
    Leak,
    ReadBeforeReadyError,
    StaleExecutorError,
    UseAfterFreeError,
    WorkspaceContractError,
    first_frame,
    stack_text,
    where,
)


@dataclass
class ExRecord:
    """What the sanitizer knows of one executor."""

    describe: str
    created: Any
    thread: str
    generation: int
    state: ExecState = ExecState.READY
    released_at: Any = None
    last: dict[Any, int] = field(default_factory=dict)  # stream queue -> seq of its latest launch there
    ref: Any = field(default=None, repr=False)
    constants: dict[int, tuple[Any, int]] = field(default_factory=dict)  # input -> (its block, checksum)


@dataclass
class Launch:
    """One enqueued phase 2: checked by the task listener after the kernel ran."""

    op_name: str
    describe: str
    blocks: list[tuple[GuardedBlock, str]]

    def __str__(self) -> str:
        return self.describe


class LaunchRecords(QueueRecords):
    """The launches not yet checked, per queue and executor in launch order, each with the lowest seq its task can
    have: ``submitted + 1`` read before the enqueue, which another thread may pass on a shared stream, so a record
    is matched by its executor, not by that seq. An executor launches from its own thread only, one launch after
    the other: each record's lowest seq is above the seq of the task of the record before it. So when the task of
    seq ``s`` runs, a record followed by one whose lowest seq is ``<= s`` belongs to an earlier task that failed
    or was dropped (never seen by a listener), and the first record left is this task's."""

    def __init__(self) -> None:
        super().__init__()  # per queue: id(executor) -> its LaunchList
        self._puts = 0

    def put(self, q: Any, owner: Any, lo: int, launch: Launch) -> tuple[int, Launch]:
        entry = (lo, launch)
        with self._lock:
            recs = self._by_queue.setdefault(q, {})
            lst = recs.get(id(owner))
            if lst is None or lst.owner() is not owner:  # none yet, or the list of a collected executor
                lst = recs[id(owner)] = LaunchList(weakref.ref(owner))
            entries, done = lst.entries, q.done
            while len(entries) > 1 and entries[1][0] <= done:  # their tasks have completed (or were dropped)
                entries.popleft()
            entries.append(entry)
            self._puts += 1
            if self._puts % PRUNE_EVERY == 0:  # amortized: the lists of collected executors
                for key in [k for k, v in recs.items() if v.owner() is None]:
                    del recs[key]
        return entry

    def pop(self, q: Any, owner: Any, seq: int) -> Launch | None:
        if q is None:
            return None
        with self._lock:
            lst: LaunchList | None = self._by_queue.get(q, {}).get(id(owner))
            if lst is None or lst.owner() is not owner:
                return None
            entries = lst.entries
            while len(entries) > 1 and entries[1][0] <= seq:
                entries.popleft()
            if entries and entries[0][0] <= seq:
                return entries.popleft()[1]
            return None

    def discard(self, q: Any, owner: Any, entry: tuple[int, Launch]) -> None:
        """Drop the record of a launch that was refused after it was put."""
        with self._lock:
            lst = self._by_queue.get(q, {}).get(id(owner))
            if lst is not None and lst.owner() is owner:
                try:
                    lst.entries.remove(entry)
                except ValueError:
                    pass


@dataclass
class LaunchList:
    owner: Any  # a weak reference to the executor
    entries: collections.deque[tuple[int, Launch]] = field(default_factory=collections.deque)


_records: dict[int, ExRecord] = {}
_collected: list[Leak] = []  # executors garbage-collected while still ready (never destroyed)
_launches = LaunchRecords()
# per queue, its waits: (its own seq at the wait, the queue waited for, the seq waited for), each raising what
# it had waited for on that queue before
_wait_log: weakref.WeakKeyDictionary[Any, list[tuple[int, Any, int]]] = weakref.WeakKeyDictionary()
PRUNE_EVERY = 64  # waits between prunings of a queue's log (amortized: a pruning scans the whole log)
_lock = forking.lock()
_tl = threading.local()

_plain: dict[str, Any] = {
    "release": Executor._release,
    "destroy": Executor.destroy,
    "check_operand": Executor._check_operand,
    "bind_many": Executor._bind_many,
    "view": Tensor.view,
    "wait_event": Stream.wait_event,
    "mark_use": Block.mark_use,
    "close": Stream.close,
}
_REPLAY_CODE = Graph.replay.__code__
_INTERNAL_VIEW_CALLERS = {Op._build_launch.__code__, _copy_task.__code__}
_handles: list[Any] = []


def record_of(ex: Any) -> ExRecord | None:
    return _records.get(id(ex))


def _origin(ex: Any) -> str:
    rec = record_of(ex)
    if rec is None:
        return "planned before the sanitizer was enabled"
    return f"planned on thread '{rec.thread}' at\n{stack_text(rec.created)}"


def _on_collect(key: int, _ref: Any) -> None:
    with _lock:
        rec = _records.pop(key, None)
    if rec is not None and rec.state is ExecState.READY and _handles:  # off: its release was not seen
        _collected.append(
            Leak("executor", f"{rec.describe} (garbage-collected without destroy)", rec.created, rec.generation)
        )


# ---- phase 1: where each executor came from
def _phase1_done(op: Op, inputs: Any, kwargs: Any, result: Any, t0: float, t1: float) -> None:
    ex = result[1]
    rec = ExRecord(ex.describe(), where(), threading.current_thread().name, guards._state["generation"])
    key = id(ex)
    rec.ref = weakref.ref(ex, lambda r, k=key: _on_collect(k, r))  # type: ignore[misc]
    with _lock:
        _records[key] = rec


def _replay_before(graph: Any, stream: Stream) -> None:
    """A replay reads and writes every tensor it was captured (or is now rebound) with: none may be freed. Which
    of them it writes (its arena, the outputs of its nodes) is kept for the uses the replay then marks."""
    written = {id(graph._arena)}
    for ex in graph._execs:
        n_in = len(ex.input_descs)
        written.update(id(t.block) for t in ex._tensors[n_in:] if t is not None)
    _tl.replay = (weakref.ref(graph), written)  # weak: a thread's last replay must not keep its graph alive
    for blk in graph._mark_blocks:
        if blk.freed or (type(blk) is GuardedBlock and not blk.allocated):
            raise UseAfterFreeError(
                f"{graph.name} replayed on stream '{stream.name}' with a captured tensor in a "
                f"block of {blk.size} bytes at 0x{blk.address:x} that was already freed "
                "(rebind it with replay(name=tensor) or capture again)",
                op=graph.name,
                arg="tensor",
            )


# ---- phase 2: the checks, then the uses it makes
def _phase2_before(op: Op, ws: Any, size: int, ex: Any, stream: Stream) -> None:
    if not isinstance(ex, Executor) or not isinstance(stream, Stream):
        return  # the plain phase 2 reports these
    rec = record_of(ex)
    if ex._owner != threading.get_ident():
        raise ExecutorMisuseError(
            f"{ex.describe()} belongs to another thread: used from thread "
            f"'{threading.current_thread().name}', {_origin(ex)}",
            op=op.name,
            arg="executor",
        )
    if ex._state is not ExecState.READY:
        how = (
            "phase 2 on a consumed single-use executor (call set_repeatable() before the first phase 2 to reuse it)"
            if ex._state is ExecState.CONSUMED
            else "phase 2 on a destroyed executor"
        )
        when = stack_text(rec.released_at) if rec is not None else "    <unknown>"
        raise ExecutorMisuseError(
            f"{how}: {ex.describe()}, {_origin(ex)}\n  {ex._state.value} at\n{when}", op=op.name, arg="executor"
        )
    if size != ex.workspace_size or (size and (ws is None or getattr(ws, "requested", 0) < size)):
        got = (
            f"workspace_size {size}"
            if size != ex.workspace_size
            else ("no workspace" if ws is None else f"a workspace block of {getattr(ws, 'requested', 0)} bytes")
        )
        raise WorkspaceContractError(
            f"phase 1 returned workspace size {ex.workspace_size} for {ex.describe()}, "
            f"phase 2 got {got}; the executor was {_origin(ex)}",
            op=op.name,
            arg="workspace",
            expected=ex.workspace_size,
            got=got,
        )
    if ex._gate is not op:
        return  # unbound operands: the plain phase 2 reports it
    n_in = len(ex.input_descs)
    seq = stream._q.submitted + 1
    blocks: list[tuple[GuardedBlock, str]] = []
    uses: list[tuple[GuardedBlock, bool]] = []
    label = f"{ex.describe()} (launched at {first_frame(where())})"
    descs = ex.input_descs + ex.output_descs
    for i, t in enumerate(ex._tensors):
        if t is None:
            continue
        role = _role(i, n_in)
        if t.desc != descs[i]:
            raise StaleExecutorError(
                f"{role} of {ex.describe()} is bound to a tensor of another desc",
                op=op.name,
                arg=role,
                expected=descs[i],
                got=t.desc,
            )
        blk = t.block
        if blk.freed or (type(blk) is GuardedBlock and not blk.allocated):
            raise UseAfterFreeError(
                f"{ex.describe()} launched on stream '{stream.name}' with its {role} in a block that was already freed",
                op=op.name,
                arg=role,
            )
        if type(blk) is GuardedBlock:
            uses.append((blk, i >= n_in))
            blocks.append((blk, role))
        elif type(blk) is VirtualBlock and type(blk.arena) is GuardedBlock:  # a graph's tensor: its arena's use
            uses.append((blk.arena, i >= n_in))  # (host reads of it check the arena's, as ``_view`` maps it)
    if type(ws) is GuardedBlock:
        if not ws.allocated:
            raise UseAfterFreeError(
                f"{ex.describe()} launched on stream '{stream.name}' with a workspace that was already freed",
                op=op.name,
                arg="workspace",
            )
        uses.append((ws, True))
        blocks.append((ws, "workspace"))
    stale = getattr(_tl, "tentative", None)
    if stale is not None:  # the previous launch of this thread was refused after our check
        _launches.discard(stale[0], stale[7], stale[6])
    q = stream._q
    entry = _launches.put(q, ex, seq, Launch(op.name, ex.describe(), blocks))  # before the enqueue: the kernel
    _tl.tentative = (q, rec, stream, seq, label, uses, entry, ex)  # may run first


def _phase2_after(op: Op, ws: Any, size: int, ex: Any, stream: Stream, t0: float, t1: float) -> None:
    """The launch was enqueued: record the uses it makes."""
    pending = getattr(_tl, "tentative", None)
    if pending is None:
        return
    _tl.tentative = None
    q, rec, stream, seq, label, uses, _, ex = pending
    seq = _seq_of(q, ex, seq)
    for blk, writes in uses:
        _use(blk, stream, seq, label, writes)
    q = stream._q
    if rec is not None and not isinstance(q, _CaptureQueue):  # a captured launch never runs there (a clone replays)
        last = {lq: ls for lq, ls in rec.last.items() if lq.done < ls and lq is not q}  # pending ones only
        last[q] = seq
        rec.last = last


def _seq_of(q: Any, owner: Any, lo: int) -> int:
    """The seq of the task just enqueued on ``q`` for ``owner``, ``lo`` or more (``lo`` when no other thread
    enqueued on the stream meanwhile). When the worker already took the task, ``lo``: a bound that can only make
    the use look complete early (never a false report)."""
    hi = q.submitted
    if hi <= lo or type(q) is not _Queue:  # alone on the stream; or a capture's stand-in, whose seqs never run
        return lo
    for task in reversed(list(q.tasks)):  # list(): copied at once, while the worker may pop
        if task[2] is owner and lo <= task[3] <= hi:
            return int(task[3])
    return lo


def _use(blk: GuardedBlock, stream: Stream, seq: int, label: str, writes: bool) -> None:
    q = stream._q
    uses = blk.uses
    if len(uses) >= PRUNE_USES:  # a long-lived tensor (a weight) used on many streams: completed uses go, or
        for u, (s, _, _) in list(uses.items()):  # they kept every stream's queue alive and every check scanned them
            if u.done >= s:
                del uses[u]
                blk.writes.pop(u, None)
    uses[q] = (seq, label, writes)
    if writes:
        blk.writes[q] = (seq, label)


PRUNE_USES = 8  # recorded uses of a block past which the completed ones are dropped


def _after_task(stream_name: str, owner: Any, t0: float, t1: float, seq: int) -> None:
    """On the worker after each task: verify the guard zones of every block the launch used."""
    launch = _launches.pop(running_queue(), owner, seq)
    if launch is None:
        launch = _replayed(owner)
        if launch is None:
            return
    for blk, role in launch.blocks:
        guards.verify(blk, role, launch)
    _check_constants(owner)


def _check_constants(ex: Any) -> None:
    """Check 9, after a launch of ``ex`` (on the worker): the inputs its plan keeps constant (the tiling's
    ``constant_inputs``) hold the data of the binding's first launch (a CRC-32 of their bytes); a binding to another
    block is checksummed anew."""
    indices = getattr(getattr(getattr(ex, "plan", None), "tiling", None), "constant_inputs", ())
    rec = record_of(ex) if indices else None
    if rec is None:
        return
    for i in indices:
        t = ex._tensors[i]
        if t is None:
            continue
        if t.block.freed:
            continue  # check 4 reports that
        # the device's view, not Tensor.view (check 5 would take this worker's read for the host's)
        digest = zlib.crc32(np.ascontiguousarray(t.device._array_view(t.block, t.desc)).tobytes())
        seen = rec.constants.get(i)
        if seen is None or seen[0] is not t.block:  # a binding to other memory: its own first launch (as the kernel)
            rec.constants[i] = (t.block, digest)
        elif seen[1] != digest:
            name = ex.op.input_name(i, len(ex.input_descs))
            raise ConstantOperandError(
                f"the {name} of {ex.describe()} changed while bound, though planned constant: its launches use "
                f"what the binding's first launch read; bind the call to the new data (it is then read anew), or "
                f"plan it without the constant promise; the executor was {_origin(ex)}",
                op=ex.op.name,
                arg=name,
            )


def _role(i: int, n_in: int) -> str:
    """Operand ``i`` of an executor with ``n_in`` inputs, as reports name it."""
    return f"input {i}" if i < n_in else f"output {i - n_in}"


def _replayed(owner: Any) -> Launch | None:
    """What a graph replay's node (its executor) or the whole replay (its graph: the arena) used, to verify:
    a replay is one stream task, reported to the listeners once per node and once at its end."""
    used: list[tuple[Any, str]]
    if isinstance(owner, Executor):
        n_in = len(owner.input_descs)
        used = [(t.block, _role(i, n_in)) for i, t in enumerate(node_operands(owner)) if t is not None]
        what, name = f"{owner.describe()} (a node of a graph replay)", owner.op.name
    else:
        used, what, name = [(getattr(owner, "_arena", None), "graph arena")], f"a replay of {owner}", str(owner)
    blocks = [(b, role) for b, role in used if type(b) is GuardedBlock and b.allocated]
    return Launch(name, what, blocks) if blocks else None


# ---- executors: release, destroy, rebinding
def _release(self: Executor, state: ExecState) -> None:
    _plain["release"](self, state)
    rec = record_of(self)
    if rec is not None:
        rec.state = state
        rec.released_at = where()


def _destroy(self: Executor) -> None:
    rec = record_of(self)
    if self._owner != threading.get_ident():
        raise ExecutorMisuseError(
            f"{self.describe()} belongs to another thread: destroy from thread "
            f"'{threading.current_thread().name}', {_origin(self)}",
            op=self.op.name,
            arg="executor",
        )
    if self._state is not ExecState.READY:
        what = (
            "a consumed single-use executor (phase 2 already released it)"
            if self._state is ExecState.CONSUMED
            else "an executor destroyed before (double destroy)"
        )
        when = stack_text(rec.released_at) if rec is not None else "    <unknown>"
        raise ExecutorMisuseError(
            f"destroy of {what}: {self.describe()}, {_origin(self)}\n  {self._state.value} at\n{when}",
            op=self.op.name,
            arg="executor",
        )
    pending = [(q, seq) for q, seq in list(rec.last.items()) if q.done < seq] if rec is not None else []
    if pending:
        q, seq = pending[0]
        raise ExecutorMisuseError(
            f"destroy of {self.describe()} while its last launch (task {seq} on stream "
            f"'{q.name}', {q.done} done) is pending; synchronize the stream first",
            op=self.op.name,
            arg="executor",
        )
    _plain["destroy"](self)


def _check_operand(self: Executor, index: int, tensor: Tensor, descs: Any, kind: str) -> None:
    if (
        isinstance(tensor, Tensor)
        and int_value(index) is not None
        and 0 <= index < len(descs)
        and self._state is ExecState.READY
        and tensor.desc != descs[index]
    ):
        raise StaleExecutorError(
            f"stale executor: {self.describe()} was planned for {kind} {index} = "
            f"{descs[index]!r}, rebinding gave {tensor.desc!r} (another shape or stride: plan "
            f"again); the executor was {_origin(self)}",
            op=self.op.name,
            arg=f"{kind} {index}",
            expected=descs[index],
            got=tensor.desc,
        )
    _plain["check_operand"](self, index, tensor, descs, kind)


def _bind_many(self: Executor, tensors: dict[int, Tensor]) -> None:
    descs = self.input_descs + self.output_descs
    for i, t in tensors.items():
        if isinstance(t, Tensor) and 0 <= i < len(descs) and t.desc != descs[i]:
            raise StaleExecutorError(
                f"stale executor: {self.describe()} was planned for {self._operand_name(i)} = "
                f"{descs[i]!r}, binding gave {t.desc!r}",
                op=self.op.name,
                arg=self._operand_name(i),
                expected=descs[i],
                got=t.desc,
            )
    _plain["bind_many"](self, tensors)


# ---- blocks: free, host reads, copy-in uses, stream ordering
def check_free(blk: GuardedBlock, stream: Stream | None) -> None:
    """Refuse to free ``blk`` while a not-yet-completed task on another stream uses it without ordering. A free
    from the host is reused after the block's last marked use: only a pending use that use is not ordered after
    (one on another stream) is refused."""
    mark = blk._stream
    for q, (seq, label, _) in list(blk.uses.items()):
        if q.done >= seq:
            continue
        if stream is not None:
            sq = stream._q
            if sq is q or stream._work_q is q or _waited(sq, q) >= seq:  # a capture's free: its real queue
                continue
        elif mark is not None and (
            (mark._q is q or mark._work_q is q) and seq <= blk._seq or _waited(mark._q, q, blk._seq) >= seq
        ):
            continue  # the pool waits for the marked use, and this one comes before it (its stream, or an event)
        side = "the host (no stream)" if stream is None else f"stream '{stream.name}'"
        raise UseAfterFreeError(
            f"block of {blk.size} bytes at 0x{blk.address:x} freed on {side} while task {seq} on stream "
            f"'{q.name}' ({q.done} done), {label}, still uses it; record an event on '{q.name}' and make the "
            f"freeing stream wait for it (or synchronize) before freeing; the block was allocated at\n"
            f"{stack_text(blk.created)}",
            op=_op_of(label),
            arg="block",
        )


def _op_of(label: str) -> str | None:
    """The op a use's label names (``op 'softmax' (executor #3, ...)``), None for other uses (a fill, a copy)."""
    m = re.search(r"\bop '([^']+)'", label)
    return m.group(1) if m else None


def _view(self: Tensor) -> Any:
    blk = self.block
    if type(blk) is VirtualBlock and blk.arena is not None:  # a graph's tensor: its arena's replays write it
        blk = blk.arena
    if type(blk) is GuardedBlock and blk.uses and not _internal(sys._getframe(1)):
        running = running_queue()  # a task (a callback) reading: its own queue's later tasks write after it
        for q, (seq, label) in list(blk.writes.items()):
            if q.done < seq and q is not running:
                raise ReadBeforeReadyError(
                    f"host access to {self.desc!r} while task {seq} on stream '{q.name}' ({q.done} done), {label}, "
                    "still writes it; synchronize the stream (or use numpy(), which waits) first",
                    op=_op_of(label),
                    arg="tensor",
                )
    return _plain["view"](self)


def _internal(f: Any) -> bool:
    """True when the view is taken by the runtime itself (building a launch, a copy task), not read by the host."""
    for _ in range(2):
        if f is None:
            return False
        if f.f_code in _INTERNAL_VIEW_CALLERS:
            return True
        f = f.f_back
    return False


def _mark_use(self: Block, stream: Stream, seq: int) -> None:
    _plain["mark_use"](self, stream, seq)
    if type(self) is GuardedBlock:
        writes, label = True, "a copy or marked use"
        caller = sys._getframe(1)
        if caller.f_code is _REPLAY_CODE:  # a graph replay's mark: it writes only its arena and its nodes' outputs
            graph = caller.f_locals.get("self")
            label = f"a replay of {graph}"
            replay = getattr(_tl, "replay", None)
            if replay is not None and replay[0]() is graph:  # what its check found just before the enqueue
                writes = id(self) in replay[1]
        _use(self, stream, seq, label, writes)


def _close(self: Stream) -> None:
    _plain["close"](self)
    _launches.forget(self._q)  # what is left are the launches that failed or were dropped


def _wait_event(self: Stream, event: Event) -> None:
    """Record the ordering a wait makes, through chains too: waiting for an event of ``r`` also orders this
    stream after whatever ``r`` had waited for before that event (``_wait_log``: where each wait sits in ``r``)."""
    _plain["wait_event"](self, event)
    if isinstance(event, Event) and event.stream is not self:
        with _lock:
            here, r = self._q.submitted, event.stream._q
            got = {r: event.seq}
            for at, q, seq in _wait_log.get(r, ()):
                if at <= event.seq and seq > got.get(q, 0):
                    got[q] = seq
            got.pop(self._q, None)
            log = _wait_log.setdefault(self._q, [])
            if len(log) % PRUNE_EVERY == PRUNE_EVERY - 1:  # a completed task needs no ordering: the log keeps
                log[:] = [e for e in log if e[1].done < e[2]]  # pending waits only (it kept every wait for good)
            for q, seq in got.items():
                if seq > _waited(self._q, q) and q.done < seq:
                    log.append((here, q, seq))


def _waited(waiter: Any, q: Any, before: int | None = None) -> int:
    """The last seq of queue ``q`` that queue ``waiter``'s later tasks (with ``before``: its task ``before``) are
    ordered after (0: none)."""
    return next(
        (seq for own, on, seq in reversed(_wait_log.get(waiter, ())) if on is q and (before is None or own < before)),
        0,
    )


_PATCHES = (
    (Executor, "_release", _release),
    (Executor, "destroy", _destroy),
    (Executor, "_check_operand", _check_operand),
    (Executor, "_bind_many", _bind_many),
    (Tensor, "view", _view),
    (Stream, "wait_event", _wait_event),
    (Block, "mark_use", _mark_use),
    (Stream, "close", _close),
)
_PLAIN_NAMES = ("release", "destroy", "check_operand", "bind_many", "view", "wait_event", "mark_use", "close")


def install() -> None:
    with _lock:
        recs = list(_records.values())
    for rec in recs:  # executors released while the sanitizer was off
        ex = rec.ref() if rec.ref is not None else None
        if ex is not None:
            rec.state = ex._state
    for cls, name, fn in _PATCHES:
        setattr(cls, name, fn)
    _handles.append(hooks.add_phase1_hook(_phase1_done))
    _handles.append(hooks.add_phase2_hook(before=_phase2_before, after=_phase2_after))
    hooks.add_task_listener(_after_task)
    hooks.add_replay_check(_replay_before)


def uninstall() -> None:
    for (cls, name, _), key in zip(_PATCHES, _PLAIN_NAMES):
        setattr(cls, name, _plain[key])
    while _handles:
        hooks.remove_hook(_handles.pop())
    hooks.remove_task_listener(_after_task)
    hooks.remove_replay_check(_replay_before)


def leaked_executors(since: int = 0) -> list[Leak]:
    out = [lk for lk in _collected if lk.generation >= since]
    with _lock:
        recs = list(_records.values())
    for rec in recs:
        ex = rec.ref() if rec.ref is not None else None
        if ex is not None and ex._state is ExecState.READY and rec.generation >= since:
            out.append(Leak("executor", ex.describe(), rec.created))
    return out


def reset() -> None:
    with _lock:
        _collected.clear()
    _launches.clear()
