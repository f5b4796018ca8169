"""Guard zones and poisoned fresh memory: while the sanitizer is on, every pool block is a ``GuardedBlock``
that sits ``GUARD`` bytes inside a larger pool allocation whose head and tail hold canary bytes.

``MemoryPool.malloc`` / ``free`` and ``Device.empty`` / ``empty_like`` are swapped for the guarded versions
only while the sanitizer is on (the plain methods carry no check). ``free`` stays swapped after the sanitizer
is turned off until every guarded block has been returned, so the pool never sees an inner block.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..config import int_value
from ..errors import InvalidStateError
from ..graph.replay import ARENA_GUARDS
from ..runtime import forking
from ..runtime.device import Device
from ..runtime.memory import Block, MemoryPool
from ..runtime.stream import CONTROL, Stream
from .report import GuardError, where

GUARD = 512  # bytes before and after each block (keeps the 512-byte alignment of the data)
CANARY = 0xFD  # guard bytes ("no man's land")
FRESH = 0xCD  # fresh workspace / raw memory; float tensors are filled with NaN instead
FILL_LABEL = "the sanitizer's fresh-memory fill"

_plain_malloc = MemoryPool.malloc
_plain_free = MemoryPool.free
_plain_empty = Device.empty
_plain_empty_like = Device.empty_like

_live: dict[int, GuardedBlock] = {}  # id -> block: guarded blocks not yet freed (what the leak report lists)
_lock = forking.lock()
_state = {"malloc": False, "free": False, "generation": 0}


class GuardedBlock(Block):
    """A block handed out by the sanitizing pool: ``outer`` is the pool's real block (guard + data + guard).

    ``uses`` maps a stream queue to ``(seq, label, writes)`` of the latest task on it that uses the block,
    ``writes`` to ``(seq, label)`` of the latest one that writes it (a later read must not hide a pending write).
    """

    __slots__ = ("outer", "raw", "uses", "writes", "created", "generation", "fill", "fill_seq")

    def __init__(self, outer: Block, nbytes: int) -> None:
        super().__init__(outer.pool, outer.segment, outer.offset + GUARD, nbytes)
        self.outer: Block | None = outer
        self.raw: Any = outer.data  # guard + data + guard: kept for the checks after a launch that ends past the free
        self.uses: dict[Any, tuple[int, str, bool]] = {}
        self.writes: dict[Any, tuple[int, str]] = {}
        self.created = where()
        self.generation = 0
        self.fill: Stream | None = None  # the stream the fresh-memory fill was ordered on, if any
        self.fill_seq = 0  # its task there (the poison of a new tensor's block comes after the fill)
        self.allocated = True
        self.requested = nbytes
        if outer.data is not None:
            self.data = outer.data[GUARD : GUARD + nbytes]

    def wait(self) -> None:
        """A host read waits for the sanitizer's fill and poison too (they are not the block's marked use: the
        pool's ordering stays what it is without the sanitizer)."""
        super().wait()
        fill = self.fill
        if fill is not None and fill._q.done < self.fill_seq:
            fill._q.wait_for(self.fill_seq, raise_errors=False)


def _fill_raw(arg: tuple[Any, int]) -> None:
    raw, n = arg
    raw[:GUARD] = CANARY
    raw[GUARD : GUARD + n] = FRESH
    raw[GUARD + n : GUARD + n + GUARD] = CANARY


def _ordered(blk: GuardedBlock, stream: Stream | None, fn: Any, arg: Any) -> None:
    """Run ``fn(arg)`` now when nothing may still use the memory, else in ``stream`` order (a reused block)."""
    if stream is not None and stream._q.submitted > stream._q.done:
        seq = stream._enqueue(fn, arg, CONTROL)
        blk.fill = stream
        blk.uses[stream._q] = (seq, FILL_LABEL, True)
        blk.writes[stream._q] = (seq, FILL_LABEL)
        blk.fill_seq = seq
    else:
        fn(arg)


def guarded_malloc(pool: MemoryPool, nbytes: int, stream: Stream | None = None, policy: str = "huge_first") -> Block:
    n = int_value(nbytes)
    if n is None or n < 0:
        return _plain_malloc(pool, nbytes, stream, policy)  # raises the plain error
    nbytes = n
    outer = _plain_malloc(pool, nbytes + 2 * GUARD, stream, policy)
    blk = GuardedBlock(outer, nbytes)
    blk.generation = _state["generation"]
    if outer.data is not None:
        _ordered(blk, stream, _fill_raw, (outer.data, nbytes))
    with _lock:
        _live[id(blk)] = blk
    return blk


def guarded_free(pool: MemoryPool, blk: Block, stream: Stream | None = None) -> None:
    if type(blk) is not GuardedBlock:
        _plain_free(pool, blk, stream)
        return
    if pool._left_to_consumers(blk, stream):  # freed (through here) when the last DLPack consumer lets go
        return
    if blk.pool is not pool or not blk.allocated or blk.outer is None:  # outer stays set for later guard checks
        raise InvalidStateError("block is not allocated from this pool (double free?)", op="free", arg="block", got=blk)
    from .tracking import check_free

    outer = blk.outer
    uses, writes = dict(blk.uses), dict(blk.writes)
    fill = _order_fill(blk, stream)
    try:
        check_free(blk, stream)  # use after free across streams (raises)
    except BaseException:
        blk.uses, blk.writes = uses, writes  # the block stays allocated: its fill is still a use
        raise
    damage: GuardError | None = None
    if not any(q.done < seq for q, (seq, _, _) in uses.items()):  # the fill's too: canaries not written yet
        try:
            verify(blk, "freed block", None)
        except GuardError as e:  # reported once the block is freed: raised before, it leaked the block
            damage = e
    _hand_mark(blk, outer, fill)
    blk.allocated = False
    blk.freed = True
    with _lock:
        _live.pop(id(blk), None)
    _plain_free(pool, outer, stream)
    if not _state["free"] and not _live:
        MemoryPool.free = _plain_free  # type: ignore[method-assign]
    if damage is not None:
        raise damage


def _order_fill(blk: GuardedBlock, stream: Stream | None) -> tuple[Stream, int] | None:
    """Order the reuse of ``blk``'s memory after the sanitizer's own fresh-memory fill if it is still pending, without
    blocking the host where the pool's stream order can express it; the fill's use is then dropped from ``blk.uses``
    (it is no use of the caller's). Returns ``(stream, seq)`` of a pending fill a host free must wait for."""
    from .tracking import _waited

    for q, (seq, label, _) in list(blk.uses.items()):
        if label != FILL_LABEL or q.done >= seq:
            continue
        if stream is None:
            if blk.fill is not None and blk.fill._q is q:  # the pool waits for it as it would for a last use
                del blk.uses[q]
                blk.writes.pop(q, None)
                return blk.fill, seq
        elif stream._q is q or stream._work_q is q or _waited(stream._q, q) >= seq:
            del blk.uses[q]  # the freeing stream is ordered after the fill: reuse in its order comes later
            blk.writes.pop(q, None)
            continue
        elif stream._q is stream._work_q and not stream.closed:  # not during a capture
            stream._enqueue(_await, (q, seq), CONTROL)  # the freeing stream's later work (and so the reuse of
            del blk.uses[q]  # the memory in its order) waits for the fill: no host block
            blk.writes.pop(q, None)
            continue
        q.wait_for(seq, raise_errors=False)  # our own fill must not land in memory handed out again
    return None


def _await(arg: tuple[Any, int]) -> None:
    q, seq = arg
    q.wait_for(seq, raise_errors=False)  # a failure there is that stream's to report


def _hand_mark(blk: GuardedBlock, outer: Block, fill: tuple[Stream, int] | None) -> None:
    """Give the pool's block ``outer`` the last use recorded on ``blk`` (phase 2 and ``mark_use`` mark the inner
    block), so that a free without a stream reuses the memory only after that use; and the pending fill, if any."""
    last, seq = blk._stream, blk._seq
    if fill is not None:
        if last is None or last._done >= seq:
            last, seq = fill
        elif last._work_q is not fill[0]._work_q:  # two pending uses: the pool knows one, so the last use's
            if last._q is last._work_q and not last.closed:  # stream waits for the fill too, and that is the mark
                seq = last._enqueue(_await, (fill[0]._q, fill[1]), CONTROL)
            else:  # (never from the fill stream's own worker: a free in its callback takes the branch above)
                fill[0]._q.wait_for(fill[1], raise_errors=False)
        else:
            seq = max(seq, fill[1])
    outer._stream, outer._seq = last, seq


def verify(blk: GuardedBlock, role: str, launch: Any) -> None:
    """Raise ``GuardError`` when a guard zone of ``blk`` was overwritten (and restore it for later checks)."""
    raw = blk.raw
    if blk.outer is None or raw is None:
        return
    n = blk.size
    damage = _overrun(raw, GUARD, n)
    if damage:
        who = "a kernel" if launch is None else launch
        raise GuardError(
            f"{who} wrote {damage} of its {role} ({n} bytes at 0x{blk.address:x})",
            arg=role,
            op=getattr(launch, "op_name", None),
        )


def _overrun(raw: Any, off: int, size: int) -> str:
    """What was written over the ``GUARD`` canary bytes on each side of ``raw[off:off + size]`` ("" when nothing),
    the canaries restored for later checks."""
    head, tail = raw[off - GUARD : off], raw[off + size : off + size + GUARD]
    if (head == CANARY).all() and (tail == CANARY).all():
        return ""
    bad_tail, bad_head = np.flatnonzero(tail != CANARY), np.flatnonzero(head != CANARY)
    head[:] = CANARY
    tail[:] = CANARY
    parts = []
    if bad_tail.size:
        parts.append(f"{int(bad_tail[-1]) + 1} byte(s) past the end")
    if bad_head.size:
        parts.append(f"{GUARD - int(bad_head[0])} byte(s) before the start")
    return " and ".join(parts)


def _poison_nan(arg: tuple[Any, Any]) -> None:
    data, dt = arg
    data.view(dt)[...] = np.nan


def guarded_empty(
    dev: Device, shape: Any, dtype: Any = None, format: Any = None, stream: Stream | None = None, **kw: Any
) -> Any:
    args = {k: v for k, v in (("dtype", dtype), ("format", format)) if v is not None}
    t = _plain_empty(dev, shape, stream=stream, **args, **kw)
    _poison_tensor(t, stream)
    return t


def guarded_empty_like(dev: Device, desc: Any, stream: Stream | None = None) -> Any:
    t = _plain_empty_like(dev, desc, stream)
    _poison_tensor(t, stream)
    return t


def _poison_tensor(t: Any, stream: Stream | None) -> None:
    blk = t.block
    if type(blk) is GuardedBlock and blk.data is not None and t.dtype.is_float and blk.size:
        if blk.size % t.dtype.itemsize == 0 and blk.fill is None:
            _poison_nan((blk.data, t.dtype.np))
        elif blk.fill is not None:
            _ordered(blk, blk.fill, _poison_nan, (blk.data, t.dtype.np))


def verify_zones(raw: Any, zones: Any, owner: Any) -> None:
    """Raise ``GuardError`` when a guard zone between the buffers of a graph's arena was overwritten (and restore
    it): ``zones`` are (buffer, offset, size) with ``GUARD`` canary bytes on each side."""
    for label, off, size in zones:
        damage = _overrun(raw, off, size)
        if damage:
            raise GuardError(f"a kernel wrote {damage} of {label} ({size} bytes in the arena of {owner})", arg="arena")


def install() -> None:
    _state["generation"] += 1
    ARENA_GUARDS.update(bytes=GUARD, fill=CANARY, check=verify_zones)
    MemoryPool.malloc = guarded_malloc  # type: ignore[method-assign,assignment]
    MemoryPool.free = guarded_free  # type: ignore[method-assign,assignment]
    Device.empty = guarded_empty  # type: ignore[method-assign,assignment]
    Device.empty_like = guarded_empty_like  # type: ignore[method-assign,assignment]
    _state["malloc"] = _state["free"] = True


def uninstall() -> None:
    ARENA_GUARDS.update(bytes=0, fill=0, check=None)
    MemoryPool.malloc = _plain_malloc  # type: ignore[method-assign]
    Device.empty = _plain_empty  # type: ignore[method-assign]
    Device.empty_like = _plain_empty_like  # type: ignore[method-assign]
    _state["malloc"] = _state["free"] = False
    with _lock:
        if not _live:
            MemoryPool.free = _plain_free  # type: ignore[method-assign]


def live_blocks() -> list[GuardedBlock]:
    with _lock:
        return list(_live.values())
