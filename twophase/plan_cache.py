"""``PlanCache``: planned calls (executor + workspace) reused by metadata, leased, LRU-bounded by entry
count and by the pool bytes they hold (workspaces and the outputs they allocated). An entry is never evicted
while leased or while its stream still has pending work that uses its workspace."""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from .config import check_byte_limit
from .errors import InvalidStateError, ParamError
from .graph.capture import capturing
from .invoke import PlannedCall
from .op import Op, as_op, effective_limit
from .runtime.device import placement
from .runtime.stream import Stream
from .tensor import Tensor

__all__ = ["PlanCache"]


class _Entry:
    __slots__ = ("call", "key", "leases", "nbytes")

    def __init__(self, call: PlannedCall, key: Any) -> None:
        self.call = call
        self.key = key
        self.leases = 0  # 0 or 1: a planned call is leased to one holder at a time
        self.nbytes = call.held_bytes  # counted against max_bytes (fixed at planning: outputs are not re-made)


class PlanCache:
    """A per-thread cache of :class:`PlannedCall` objects.

    ``acquire(op, *inputs, stream=..., **attrs)`` returns a leased planned call bound to ``inputs`` (a hit
    rebinds them; a miss plans); ``release(call)`` ends the lease; ``lease(...)`` does both around a block.
    Leases are exclusive: while one holder has a planned call, an acquire with the same metadata gets
    another one, so two holders never run on each other's buffers.
    """

    def __init__(self, max_entries: int = 256, max_bytes: int | None = None) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ParamError(op="PlanCache", arg="max_entries", expected="an int >= 1", got=max_entries)
        self.max_entries = max_entries
        self.max_bytes = check_byte_limit(max_bytes, "PlanCache", "max_bytes")
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # by id(call), in LRU order
        self._by_meta: dict[Any, list[_Entry]] = {}  # (metadata key, stream) -> its planned calls
        self.hits = self.misses = self.evictions = 0
        self.bytes = 0
        self._owner = threading.get_ident()

    def __len__(self) -> int:
        return len(self._entries)

    def _check_owner(self) -> None:
        if threading.get_ident() != self._owner:
            raise InvalidStateError("a PlanCache belongs to the thread that made it", op="PlanCache", arg="thread")

    def acquire(
        self, op: Op | str, *inputs: Any, out: Any = None, stream: Stream | None = None, **attrs: Any
    ) -> PlannedCall:
        """A leased planned call for these operands' metadata, bound to these tensors."""
        self._check_owner()
        o = as_op(op, "PlanCache.acquire")
        in_descs, bound = o._input_descs(inputs)
        outs = None if out is None else (tuple(out) if isinstance(out, (tuple, list)) else (out,))
        _, s = placement(inputs, stream, o.name)
        # the limit in force, as phase 1 keys it: a plan made before set_workspace_limit() must not be served after
        # inside a capture nothing is cached either way: a call planned now holds virtual blocks of the graph, and
        # a cached one's workspace would be recorded into the graph while the cache may free it later
        asked = attrs.pop("workspace_limit", None)  # keyed as ``limit``, not as an attribute
        limit = effective_limit(o.name, asked)
        meta = None if capturing() is not None else o._key(in_descs, outs, limit, attrs, bound)
        key = (meta, s)
        entry = None if meta is None else self._idle_entry(key, bound, outs)
        if entry is not None:
            call = entry.call
            # the caller's tensors, and the call's own outputs where it passed none: a previous holder's
            # ``call(out=y)`` must not leave y bound for the next holder to write into
            home = call._home
            call.executor._rebind(
                bound.items(), home if outs is None else [g if isinstance(g, Tensor) else h for g, h in zip(outs, home)]
            )
            self.hits += 1
            self._entries.move_to_end(id(call))
            entry.leases = 1
            return call
        self.misses += 1
        call = PlannedCall(o, s, *inputs, out=out, workspace_limit=asked, **attrs)
        entry = _Entry(call, key)
        entry.leases = 1  # leased before evicting: the new entry itself may be over the byte cap
        if meta is not None:
            self._entries[id(call)] = entry
            self._by_meta.setdefault(key, []).append(entry)
            self.bytes += entry.nbytes
            self._evict()
        return call

    def _idle_entry(self, key: Any, bound: dict[int, Tensor], outs: tuple[Any, ...] | None) -> _Entry | None:
        """An idle entry of ``key`` that can serve these operands: leases are exclusive; not one whose own output
        is among the inputs (bound as its input too, the op would run on it in place); and one with an output of
        its own wherever the caller passes no tensor. An entry whose own output the caller freed is dropped."""
        found = None
        freed: list[_Entry] = []
        for e in self._by_meta.get(key, ()):
            call = e.call
            if e.leases or call.workspace is None:
                continue
            if call.outputs_freed():
                freed.append(e)
            elif (
                call._own_outputs
                if outs is None
                else all(h is not None or isinstance(g, Tensor) for g, h in zip(outs, call._home))
            ) and not call.owns(bound):
                found = e
                break
        for e in freed:
            self._drop(id(e.call), e, evicted=False)
        return found

    def release(self, call: PlannedCall) -> None:
        """End the lease of ``call`` (an uncached call is closed in stream order)."""
        self._check_owner()
        if not isinstance(call, PlannedCall):
            raise ParamError(
                op="PlanCache.release", arg="call", expected="a PlannedCall from acquire()", got=type(call).__name__
            )
        entry = self._entries.get(id(call))
        if entry is None or entry.call is not call:
            call.close(sync=False)
            return
        if entry.leases <= 0:
            raise InvalidStateError("release without a lease", op="PlanCache.release", arg="call")
        entry.leases = 0
        if call.workspace is None or call.outputs_freed():  # closed, or its output freed, by its holder
            self._drop(id(call), entry, evicted=False)
        self._evict()

    @contextlib.contextmanager
    def lease(self, op: Op | str, *inputs: Any, **kwargs: Any) -> Iterator[PlannedCall]:
        call = self.acquire(op, *inputs, **kwargs)
        try:
            yield call
        finally:
            self.release(call)

    def _evictable(self, entry: _Entry) -> bool:
        return entry.leases == 0 and not entry.call.pending()

    def _over(self) -> bool:
        return len(self._entries) > self.max_entries or (self.max_bytes is not None and self.bytes > self.max_bytes)

    def _evict(self) -> None:
        if not self._over():
            return
        for token in list(self._entries):
            if not self._over():
                break
            entry = self._entries[token]
            if self._evictable(entry):
                self._drop(token, entry)

    def _drop(self, token: int, entry: _Entry, evicted: bool = True) -> None:
        del self._entries[token]
        same = self._by_meta[entry.key]
        same.remove(entry)
        if not same:
            del self._by_meta[entry.key]
        self.bytes -= entry.nbytes
        self.evictions += evicted
        entry.call.close(sync=False)  # its stream has no pending work on it: freed at once

    def clear(self) -> None:
        """Close every entry that is neither leased nor pending."""
        self._check_owner()
        for token, entry in list(self._entries.items()):
            if self._evictable(entry):
                self._drop(token, entry)

    def info(self) -> dict[str, int | None]:
        return {
            "size": len(self._entries),
            "bytes": self.bytes,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "max_entries": self.max_entries,
            "max_bytes": self.max_bytes,
            "leased": sum(1 for e in self._entries.values() if e.leases),
        }

    def show_info(self) -> str:
        """Print (and return) size, bytes, hits and misses."""
        i = self.info()
        text = (
            f"PlanCache: {i['size']}/{i['max_entries']} plans, {i['bytes']} bytes held"
            f" (cap {i['max_bytes']}), hits {i['hits']}, misses {i['misses']}, evictions {i['evictions']},"
            f" leased {i['leased']}"
        )
        print(text)
        return text
