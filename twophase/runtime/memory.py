"""The caching, stream-ordered ``MemoryPool`` and its ``Block`` (CuPy's design: 512-byte rounding, best fit
with split and merge, per-stream reuse, a limit, and free-cached-and-retry-once on out of memory, then once more
after waiting for the pending stream-ordered frees)."""

from __future__ import annotations

import bisect
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from ..config import check_byte_limit, int_value
from ..errors import InvalidStateError, OutOfMemoryError, ParamError, refuse_pickle
from ..layout import align
from . import forking
from .stream import Stream, check_stream, on_worker

if TYPE_CHECKING:
    from .device import Device
    from .stream import _Queue

_log = logging.getLogger("twophase")

__all__ = ["MemoryPool", "Block", "Segment", "ALIGNMENT", "round_size"]

ALIGNMENT = 512
SMALL_REQUEST = 1 << 20  # requests up to 1 MiB are split out of 2 MiB segments
SMALL_SEGMENT = 2 << 20
TRIM_SLACK = 32 << 20  # a miss trims the cache first when it holds more than what is allocated plus this
POLICIES = ("huge_first", "normal_only")


def round_size(nbytes: int) -> int:
    """Pool granularity: at least 512 bytes, multiples of 512 (a 0-byte request still gets a block)."""
    return max(ALIGNMENT, align(nbytes, ALIGNMENT))


def segment_size(rounded: int) -> int:
    """Size of the segment reserved for a request: small ones share 2 MiB, large ones round to 2 MiB."""
    if rounded <= SMALL_REQUEST:
        return SMALL_SEGMENT
    return align(rounded, SMALL_SEGMENT)


@dataclass(eq=False)
class Segment:
    """One reservation from the backend: ``address`` is aligned to at least 512 bytes."""

    address: int
    size: int
    huge: bool
    policy: str
    memory: Any  # backend object (a uint8 numpy array on the CPU, None on the NULL backend)


class Block:
    """A piece of a segment. Allocated blocks are handed out; free ones wait in the pool for reuse.

    A block remembers the last stream task that used it (``_stream``/``_seq``) so that host reads
    and cross-stream reuse wait exactly as long as needed. ``exports`` is set while DLPack consumers hold
    the memory (:meth:`export`): a free then waits for the last of them.
    """

    __slots__ = (
        "pool",
        "segment",
        "offset",
        "size",
        "requested",
        "allocated",
        "freed",
        "data",
        "prev",
        "next",
        "_stream",
        "_seq",
        "free_queue",
        "free_seq",
        "tag",
        "exports",
        "__weakref__",
    )

    def __init__(self, pool: MemoryPool, segment: Segment, offset: int, size: int) -> None:
        self.pool = pool
        self.segment = segment
        self.offset = offset
        self.size = size
        self.requested = 0
        self.allocated = False
        self.freed = False
        self.data: Any = None
        self.prev: Block | None = None
        self.next: Block | None = None
        self._stream: Stream | None = None
        self._seq = 0
        # a free block's stream order: the queue of the stream it waits for (not the stream, which a free-list
        # node must not keep alive: a dead thread's default stream and its worker thread would live on)
        self.free_queue: _Queue | None = None
        self.free_seq = 0
        self.tag: Any = None  # set by observers (sanitizer: where it was allocated)
        self.exports: _Exports | None = None

    @property
    def address(self) -> int:
        return self.segment.address + self.offset

    def __reduce__(self) -> Any:
        refuse_pickle(self, "pickle a Tensor (its data travels) or make the block in the receiving process")

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "free"
        return f"Block(0x{self.address:x}, {self.size} B, {state})"

    def check_memory(self, desc: Any) -> None:
        """Raise if the block has no memory to view as ``desc`` (a pool block always has)."""

    def mark_use(self, stream: Stream, seq: int) -> None:
        """Record that task ``seq`` of ``stream`` uses this block."""
        self._stream = stream
        self._seq = seq

    def in_use(self) -> bool:
        """Whether the last stream task that used this block (``mark_use``) has not completed yet."""
        s = self._stream
        return s is not None and s._q.done < self._seq

    def wait(self) -> None:
        """Block the host until the last task that used this block has completed."""
        s = self._stream
        if s is not None:
            s._wait_for(self._seq)

    def free(self, stream: Stream | None = None) -> None:
        """Return the block to its pool; with ``stream`` the memory is reused only in that stream's order.

        Without a stream it is reused once the last stream task that used it (``mark_use``) has completed: only
        that task is known, so a block used on several streams needs the stream of its last use, or a sync.
        While exported (:meth:`export`) the block only counts as freed: it goes back when the last consumer lets go.
        """
        self.pool.free(self, stream)

    def export(self, holder: object) -> None:
        """Keep the memory out of the pool until ``holder`` (the array a DLPack consumer holds) is collected.

        The DLPack contract: the producer keeps exported memory alive until the consumer's deleter runs.
        """
        with _EXPORT_LOCK:
            if not self.allocated or self.freed:
                raise InvalidStateError("tensor's block was freed", op="__dlpack__", arg="tensor", got=self)
            if self.exports is None:
                self.exports = _Exports()
            self.exports.count += 1
        weakref.finalize(holder, self._release_export)

    def _free_exported(self, stream: Stream | None) -> None:
        """``free`` of an exported block: remember the stream; the last export's release frees it."""
        with _EXPORT_LOCK:
            ex = self.exports
            if ex is not None:
                if ex.freed:
                    raise InvalidStateError(
                        "block is not allocated from this pool (double free?)", op="free", arg="block", got=self
                    )
                ex.freed, ex.stream = True, stream
                self.freed = True  # no new use (views, launches, exports) from here on
                return
        self.pool.free(self, stream)  # the last export was released meanwhile

    def _release_export(self) -> None:
        """A consumer let go of an export; after the last one a free that waited is done, in its stream order."""
        with _EXPORT_LOCK:
            ex = self.exports
            assert ex is not None
            ex.count -= 1
            if ex.count:
                return
            self.exports = None
            if not ex.freed:
                return
        self.pool.free_when_safe(self, ex.stream)

    def _ready(self, stream: Stream | None) -> bool:
        fq = self.free_queue
        return fq is None or (stream is not None and fq is stream._work_q) or fq.done >= self.free_seq


class _Exports:
    """The DLPack exports of a block still held by consumers, and the free that waits for them."""

    __slots__ = ("count", "freed", "stream")

    def __init__(self) -> None:
        self.count = 0
        self.freed = False
        self.stream: Stream | None = None


_EXPORT_LOCK = forking.rlock()  # reentrant: a finalizer may run in a collection inside the locked code


# Called as fn(pool) after every allocation and free, by any pool (the profiler's counter track).
POOL_LISTENERS: list[Callable[[MemoryPool], None]] = []
# Called as fn() after ``empty_cache`` gave segments back to the backend, outside the pool's lock: holders of views
# (the ops' launch memos) drop them, since a view keeps its segment's memory mapped.
RELEASE_LISTENERS: list[Callable[[], None]] = []


class _Observer:
    """Hooks the sanitizer and stats attach to a pool: on_alloc(block), on_free(block, stream)."""

    on_alloc: Callable[[Block], None] | None = None
    on_free: Callable[[Block, Any], None] | None = None


def check_malloc(nbytes: object, stream: object, policy: object) -> int:
    """``malloc``'s arguments checked (every allocator's: the pool's and a capture's virtual one); the byte count
    as an int (numpy ints too, as every other byte count the library takes)."""
    n = nbytes if type(nbytes) is int else int_value(nbytes)  # an ABC isinstance costs ~0.3 us: plain ints first
    if n is None or n < 0:
        raise ParamError(op="malloc", arg="nbytes", expected="an int >= 0", got=nbytes)
    if policy not in POLICIES:
        raise ParamError(op="malloc", arg="policy", expected=f"one of {POLICIES}", got=policy)
    if stream is not None and type(stream) is not Stream:
        check_stream(stream, "malloc", open_=False)
    return n


def _refuse_other_device(stream: Stream, pool: MemoryPool, op: str) -> NoReturn:
    """The ParamError for a stream of another device than ``pool``'s: its order says nothing about this memory."""
    raise ParamError(
        op=op,
        arg="stream",
        expected=f"a stream of device {pool.device.name if pool.device is not None else '?'}",
        got=f"'{stream.name}' of device {stream.device.name}",
    )


class MemoryPool:
    """Caching allocator of one device; thread-safe. Backends provide ``reserve(nbytes, policy)``/``release``."""

    def __init__(
        self,
        reserve: Callable[[int, str], Segment],
        release: Callable[[Segment], None],
        make_data: Callable[[Segment, int, int], Any],
        name: str = "pool",
        device: Device | None = None,
    ) -> None:
        self._reserve = reserve
        self._release = release
        self._make_data = make_data
        self.name = name
        self.device = device  # the device whose streams order this memory (None: any stream, a standalone pool)
        self._lock = threading.RLock()
        forking.locks_of(self, "_lock")  # a stream worker may hold it at a fork
        self._deferred: list[tuple[Block, Stream | None]] = []  # frees from finalizers that ran inside the lock
        self._free: list[tuple[int, int, int, Block]] = []  # (size, address, id, block), sorted
        self._segments: list[Segment] = []
        self._limit: int | None = None
        self.observer = _Observer()
        self._allocated = 0
        self._requested = 0
        self._reserved = 0
        self._peak_allocated = 0
        self._peak_reserved = 0
        self._huge_reserved = 0
        self._n_alloc = 0
        self._n_free = 0
        self._n_hits = 0
        self._n_segments = 0
        self._n_oom_retries = 0
        self._n_trims = 0
        self._released = False  # segments released whose views the RELEASE_LISTENERS have not dropped yet

    def __reduce__(self) -> Any:
        refuse_pickle(self, "each process has the pools of its own devices")

    # ---- configuration
    def set_limit(self, nbytes: int | None) -> None:
        """Cap reserved bytes (``None`` removes the cap). Does not shrink what is already reserved."""
        self._limit = check_byte_limit(nbytes, "MemoryPool.set_limit", "nbytes")

    def get_limit(self) -> int | None:
        return self._limit

    # ---- allocation
    def malloc(self, nbytes: int, stream: Stream | None = None, policy: str = "huge_first") -> Block:
        """A block of at least ``nbytes`` (512-byte aligned); reuses cached memory that is ready for ``stream``."""
        nbytes = check_malloc(nbytes, stream, policy)
        if stream is not None and stream.device is not self.device and self.device is not None:
            _refuse_other_device(stream, self, "malloc")
        size = round_size(nbytes)
        if self._deferred:
            self._free_deferred()
        try:
            try:
                with self._lock:
                    block = self._take(size, nbytes, stream, policy)
            except OutOfMemoryError:
                if not self._await_pending_frees(stream):
                    raise
                with self._lock:
                    block = self._take(size, nbytes, stream, policy)
        finally:
            if self._released:  # segments released by a trim or the out-of-memory retry (raised or not)
                self._notify_released()
        if block.data is None:
            block.data = self._make_data(block.segment, block.offset, block.size)
        obs = self.observer
        if obs.on_alloc is not None:
            obs.on_alloc(block)
        if POOL_LISTENERS:
            for fn in POOL_LISTENERS:
                fn(self)
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug(
                "malloc %s: requested %d bytes, granted %d bytes at 0x%x", self.name, nbytes, block.size, block.address
            )
        return block

    def _take(self, size: int, nbytes: int, stream: Stream | None, policy: str) -> Block:
        """``malloc``'s block (under the lock): cached and ready for ``stream``, else new; out of memory raises."""
        block = self._take_cached(size, stream, policy)
        if block is None and self._reserved - self._allocated > self._allocated + TRIM_SLACK:
            block = self._trim_and_take(size, stream, policy)
        if block is None:
            block = self._take_new(size, nbytes, policy)
        else:
            self._n_hits += 1
        block.allocated = True
        block.freed = False
        block.requested = nbytes
        fq = block.free_queue
        if fq is not None and fq.done < block.free_seq:  # taken in its own stream's order, its free pending:
            block._stream, block._seq = stream, block.free_seq  # a host free or read waits for that task
        else:
            block._stream, block._seq = None, 0
        block.free_queue = None
        self._allocated += block.size
        self._requested += nbytes
        self._n_alloc += 1
        if self._allocated > self._peak_allocated:
            self._peak_allocated = self._allocated
        return block

    def _await_pending_frees(self, stream: Stream | None) -> bool:
        """On out of memory, wait outside the lock for the frees still pending, as CUDA's allocator syncs; False if
        none was waited for. Never from a stream's worker, nor for the caller's own stream: deadlock-free."""
        if on_worker():
            return False
        pending: dict[_Queue, int] = {}
        with self._lock:
            for _, _, _, blk in self._free:
                fq = blk.free_queue
                if fq is not None and not blk._ready(stream):
                    pending[fq] = max(pending.get(fq, 0), blk.free_seq)
        waited = False
        for q, seq in pending.items():
            if not q.in_own_task():
                q.wait_for(seq, raise_errors=False)
                waited = True
        return waited

    def _take_cached(self, size: int, stream: Stream | None, policy: str) -> Block | None:
        free = self._free
        i = bisect.bisect_left(free, (size, -1, -1))
        while i < len(free):
            blk = free[i][3]
            if blk._ready(stream) and (policy == "huge_first" or not blk.segment.huge):
                del free[i]
                self._split(blk, size)
                return blk
            i += 1
        return None

    def _trim_and_take(self, size: int, stream: Stream | None, policy: str) -> Block | None:
        """A miss while the cache holds more than is allocated: its free blocks did not fit (requests that
        drift in size leave a segment per size), so merge what is ready, release wholly free segments, and look
        again before reserving more. Without it reserved memory grew to 7x the allocated under drifting sizes."""
        self._n_trims += 1
        self._empty_cache_locked()
        return self._take_cached(size, stream, policy)

    def _take_new(self, size: int, requested: int, policy: str) -> Block:
        seg_size = segment_size(size)
        seg = self._try_reserve(seg_size, policy)
        if seg is None:
            self._n_oom_retries += 1
            self._empty_cache_locked()
            seg = self._try_reserve(seg_size, policy)
        if seg is None:
            raise OutOfMemoryError(
                f"cannot allocate {requested} bytes ({seg_size} to reserve); reserved {self._reserved}, "
                f"allocated {self._allocated}, limit {self._limit}",
                op="malloc",
                arg="nbytes",
            )
        self._segments.append(seg)
        self._reserved += seg.size
        self._huge_reserved += seg.size if seg.huge else 0
        self._n_segments += 1
        self._peak_reserved = max(self._peak_reserved, self._reserved)
        blk = Block(self, seg, 0, seg.size)
        self._split(blk, size)
        return blk

    def _try_reserve(self, seg_size: int, policy: str) -> Segment | None:
        if self._limit is not None and self._reserved + seg_size > self._limit:
            return None
        try:
            return self._reserve(seg_size, policy)
        except MemoryError:
            return None

    def _split(self, blk: Block, size: int) -> None:
        rest = blk.size - size
        if rest < ALIGNMENT:
            return
        tail = Block(self, blk.segment, blk.offset + size, rest)
        tail.free_queue, tail.free_seq = blk.free_queue, blk.free_seq
        tail.prev, tail.next = blk, blk.next
        if blk.next is not None:
            blk.next.prev = tail
        blk.next = tail
        blk.size = size
        blk.data = None
        self._insert_free(tail)

    def _insert_free(self, blk: Block) -> None:
        bisect.insort(self._free, (blk.size, blk.address, id(blk), blk))

    def _remove_free(self, blk: Block) -> None:
        key = (blk.size, blk.address, id(blk), blk)
        i = bisect.bisect_left(self._free, key[:3])
        if i < len(self._free) and self._free[i][3] is blk:
            del self._free[i]

    # ---- release
    def free(self, blk: Block, stream: Stream | None = None) -> None:
        """Return ``blk``; with ``stream`` it becomes reusable by other streams only after that stream's
        work enqueued so far has completed. An exported block (``Block.export``) only counts as freed until its
        last DLPack consumer lets go."""
        if self._left_to_consumers(blk, stream):
            return
        if self._deferred:
            self._free_deferred()
        hook = self.observer.on_free
        if hook is not None:
            hook(blk, stream)
        with self._lock:
            if blk.pool is not self or not blk.allocated:
                raise InvalidStateError(
                    "block is not allocated from this pool (double free?)", op="free", arg="block", got=blk
                )
            blk.allocated = False
            blk.freed = True
            self._allocated -= blk.size
            self._requested -= blk.requested
            self._n_free += 1
            last = blk._stream
            if stream is not None and stream._submitted > stream._done:
                blk.free_queue, blk.free_seq = stream._work_q, stream._submitted
            elif stream is None and last is not None and last._done < blk._seq:
                blk.free_queue, blk.free_seq = last._work_q, blk._seq  # in use: reusable after that task
            else:
                blk.free_queue, blk.free_seq = None, 0
            self._insert_free(self._merge(self._retire(blk)))
        if POOL_LISTENERS:
            for fn in POOL_LISTENERS:
                fn(self)

    def _left_to_consumers(self, blk: Block, stream: Stream | None) -> bool:
        """``free``'s argument checks, made before anything changes (a bad stream lost the block); True when the
        free is left to ``blk``'s DLPack consumers (exported, it only counts as freed until the last lets go)."""
        if not isinstance(blk, Block):
            raise ParamError(op="free", arg="block", expected="a twophase Block", got=type(blk).__name__)
        if stream is not None:
            if type(stream) is not Stream:
                check_stream(stream, "free", open_=False)
            if stream.device is not self.device and self.device is not None:
                _refuse_other_device(stream, self, "free")
        if blk.exports is not None and blk.pool is self:
            blk._free_exported(stream)
            return True
        return False

    def _retire(self, blk: Block) -> Block:
        """A fresh free-list node in ``blk``'s place: the caller's handle stays freed for good, so a second
        ``free`` of it raises instead of freeing whoever was handed the memory next."""
        node = Block(self, blk.segment, blk.offset, blk.size)
        node.free_queue, node.free_seq, node.data = blk.free_queue, blk.free_seq, blk.data
        blk.data = None  # the freed handle (its tensor may live on) must not keep the segment mapped
        node.prev, node.next = blk.prev, blk.next
        if blk.prev is not None:
            blk.prev.next = node
        if blk.next is not None:
            blk.next.prev = node
        blk.prev = blk.next = None
        return node

    def free_when_safe(self, blk: Block, stream: Stream | None) -> None:
        """``free`` from a finalizer (a DLPack consumer let go), which the garbage collector may run on a thread
        inside this pool's lock, mid-operation: then the free waits for the pool's next malloc or free."""
        if self._lock._is_owned():  # type: ignore[attr-defined]  # CPython's RLock: held by this thread
            self._deferred.append((blk, stream))
        else:
            self.free(blk, stream)

    def _free_deferred(self) -> None:
        while self._deferred:
            try:
                blk, stream = self._deferred.pop()
            except IndexError:  # another thread took the last one
                return
            self.free(blk, stream)

    @staticmethod
    def _mergeable(a: Block, b: Block) -> bool:
        return a.free_queue is b.free_queue or (a._ready(None) and b._ready(None))

    def _merge(self, blk: Block) -> Block:
        for nb in (blk.prev, blk.next):
            if nb is None or nb.allocated or not self._mergeable(blk, nb):
                continue
            self._remove_free(nb)
            first, second = (nb, blk) if nb is blk.prev else (blk, nb)
            queue = first.free_queue if first.free_queue is second.free_queue else None
            seq = max(first.free_seq, second.free_seq) if queue is not None else 0
            first.size += second.size
            first.next = second.next
            if second.next is not None:
                second.next.prev = first
            first.data = None
            first.free_queue, first.free_seq = queue, seq
            blk = first
        return blk

    def empty_cache(self) -> int:
        """Release every segment that is wholly free and ready; returns the bytes released."""
        with self._lock:
            released = self._empty_cache_locked()
        if self._released:
            self._notify_released()
        return released

    def _notify_released(self) -> None:
        """Tell ``RELEASE_LISTENERS`` that segments were released (outside the lock): their views of them go."""
        self._released = False
        for fn in RELEASE_LISTENERS:
            fn()

    def _coalesce_ready(self) -> None:
        """Merge free neighbours whose stream-ordered frees have completed since they were freed
        (a block freed while its stream was busy could not merge then)."""
        merged = True
        while merged:
            merged = False
            for _, _, _, blk in list(self._free):
                if not self._is_listed(blk) or not blk._ready(None):
                    continue
                if any(nb is not None and not nb.allocated and nb._ready(None) for nb in (blk.prev, blk.next)):
                    self._remove_free(blk)
                    blk.free_queue, blk.free_seq = None, 0
                    self._insert_free(self._merge(blk))
                    merged = True

    def _is_listed(self, blk: Block) -> bool:
        i = bisect.bisect_left(self._free, (blk.size, blk.address, id(blk)))
        return i < len(self._free) and self._free[i][3] is blk

    def _empty_cache_locked(self) -> int:
        self._coalesce_ready()
        released = 0
        keep = []
        for seg in self._segments:
            blk = next((e[3] for e in self._free if e[3].segment is seg), None)
            if blk is not None and blk.size == seg.size and blk._ready(None):
                self._remove_free(blk)
                self._release(seg)
                released += seg.size
                self._released = True
                self._reserved -= seg.size
                self._huge_reserved -= seg.size if seg.huge else 0
            else:
                keep.append(seg)
        self._segments = keep
        return released

    # ---- introspection
    def stats(self) -> dict[str, int | None]:
        """Byte and count statistics (plain ints, JSON-serialisable)."""
        with self._lock:
            return {
                "allocated_bytes": self._allocated,
                "requested_bytes": self._requested,
                "reserved_bytes": self._reserved,
                "huge_page_reserved_bytes": self._huge_reserved,
                "cached_bytes": self._reserved - self._allocated,
                "peak_allocated_bytes": self._peak_allocated,
                "peak_reserved_bytes": self._peak_reserved,
                "limit_bytes": self._limit,
                "segments": len(self._segments),
                "segments_reserved_total": self._n_segments,
                "free_blocks": len(self._free),
                "alloc_count": self._n_alloc,
                "free_count": self._n_free,
                "cache_hits": self._n_hits,
                "oom_retries": self._n_oom_retries,
                "cache_trims": self._n_trims,
            }

    def reset_peak(self) -> None:
        with self._lock:
            self._peak_allocated = self._allocated
            self._peak_reserved = self._reserved
