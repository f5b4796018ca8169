"""What a process forked from one that used twophase redoes before it runs anything: only the forking thread
comes along into the child, so the stream workers and fan-out helpers are gone, and a lock one of them (or any
other thread) held at the fork would stay held for ever. Each module hands its locks and its per-process state
here; the child re-initialises them (``os.register_at_fork``), much as CPython's own ``threading`` and
``logging`` do.

Data a thread was changing at the fork (a task's output, a pool's free list mid-update) is as the fork caught
it: the child reports the tasks it lost (``stream._Queue.after_fork``), nothing more can be known.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["lock", "locks_of", "on_fork", "reinit", "rlock", "track"]


class _Forkable(Protocol):
    def after_fork(self) -> None: ...


_LOCKS: list[Any] = []  # module-level locks, unlocked anew in the child
_HOOKS: list[Callable[[], None]] = []  # module-level state reset in the child, in registration order
_OBJECTS: weakref.WeakSet[Any] = weakref.WeakSet()  # live objects whose after_fork() runs in the child
_HELD: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()  # live objects: lock attributes


def lock() -> threading.Lock:
    """A module-level lock that a forked child finds unlocked."""
    made = threading.Lock()
    _LOCKS.append(made)
    return made


def rlock() -> threading.RLock:
    """A module-level reentrant lock that a forked child finds unlocked."""
    made = threading.RLock()
    _LOCKS.append(made)
    return made


def on_fork(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn`` in a forked child, after the locks are unlocked (a decorator)."""
    _HOOKS.append(fn)
    return fn


def track(obj: _Forkable) -> None:
    """Call ``obj.after_fork()`` in a forked child while ``obj`` lives (after the hooks)."""
    _OBJECTS.add(obj)


def locks_of(obj: Any, *names: str) -> None:
    """Unlock ``obj``'s locks (the attributes ``names``) in a forked child while ``obj`` lives."""
    _HELD[obj] = names


def reinit(lk: Any) -> None:
    """Unlock ``lk`` (a Lock or RLock some thread of the parent may have held) in the child."""
    lk._at_fork_reinit()


def _after_fork_in_child() -> None:
    for lk in _LOCKS:
        reinit(lk)
    for obj, names in list(_HELD.items()):
        for name in names:
            reinit(getattr(obj, name))
    for fn in _HOOKS:
        fn()
    for obj in list(_OBJECTS):
        obj.after_fork()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
