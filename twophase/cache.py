"""The built-in executor cache (what CANN does inside every aclnn call): per thread, LRU, keyed by
metadata only. A hit skips check / infer / select / tiling and reuses the planned result."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from . import config

__all__ = ["ExecutorCache", "thread_cache", "cache_info", "clear_cache"]


class ExecutorCache:
    """LRU map from a phase-1 key to ``(plan, attrs, output descs)``; owned by one thread. It trims itself to the
    ``cache_limit`` setting at every get / put (and ``cache_info``): a lowered limit holds from the owner's next
    call on, without another thread touching it."""

    def __init__(self) -> None:
        self.entries: OrderedDict[Any, Any] = OrderedDict()
        self.evictions = 0
        self.owner = threading.get_ident()

    def get(self, key: Any) -> Any:
        self._trim()
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    @property
    def limit(self) -> int:
        return config.settings.cache_limit

    def put(self, key: Any, value: Any) -> None:
        if config.settings.cache_limit > 0:
            self.entries[key] = value
        self._trim()

    def _trim(self) -> None:
        """Evict least recently used entries down to the limit in force (all of them at limit 0)."""
        limit = config.settings.cache_limit
        while len(self.entries) > limit:
            self.entries.popitem(last=False)
            self.evictions += 1

    def __len__(self) -> int:
        return len(self.entries)


_local = threading.local()


def thread_cache() -> ExecutorCache | None:
    """The calling thread's cache, or None when caching is disabled."""
    if not config.settings.cache_enabled:
        return None
    c: ExecutorCache | None = getattr(_local, "cache", None)
    if c is None:
        c = _local.cache = ExecutorCache()
    return c


def cache_info() -> dict[str, int]:
    """Size, limit and evictions of the calling thread's executor cache (trimmed to the limit first)."""
    c = thread_cache()
    if c is None:
        return {"size": 0, "limit": 0, "evictions": 0, "enabled": 0}
    c._trim()
    return {"size": len(c), "limit": c.limit, "evictions": c.evictions, "enabled": 1}


def clear_cache() -> None:
    """Drop every entry of the calling thread's executor cache and zero its eviction count, so ``cache_info`` reads
    as for a new cache (the per-op hit / miss counters are ``twophase.stats``'s: ``stats.reset()``)."""
    c = getattr(_local, "cache", None)
    if c is not None:
        c.entries.clear()
        c.evictions = 0
