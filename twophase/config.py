"""Run-time settings: each ``TWOPHASE_*`` environment variable is read once here and has a Python setter."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["settings", "on_change", "set_launch_blocking", "set_cache_limit", "set_cache_enabled",
           "set_deterministic", "set_workspace_limit", "set_log_level", "set_sanitize", "set_num_threads",
           "set_helper_spin"]


def _env_flag(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() not in ("0", "false", "no", "off")


def _env_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return int(raw)


HELPER_SPIN_US = 500  # see set_helper_spin


@dataclass
class Settings:
    """Current values; change them through the setters so that listeners (streams, caches) follow."""

    launch_blocking: bool = field(default_factory=lambda: _env_flag("TWOPHASE_LAUNCH_BLOCKING"))
    cache_limit: int = field(default_factory=lambda: _env_int("TWOPHASE_CACHE_LIMIT", 10000) or 0)
    cache_enabled: bool = field(default_factory=lambda: not _env_flag("TWOPHASE_DISABLE_CACHE"))
    deterministic: bool = field(default_factory=lambda: _env_flag("TWOPHASE_DETERMINISTIC"))
    workspace_limit: int | None = field(default_factory=lambda: _env_int("TWOPHASE_WORKSPACE_LIMIT", None))
    num_threads: int = field(default_factory=lambda: _env_int("TWOPHASE_NUM_THREADS", 0) or 0)  # 0: automatic
    helper_spin_us: int = field(default_factory=lambda: _env_int("TWOPHASE_HELPER_SPIN_US", HELPER_SPIN_US) or 0)
    log_level: str = field(default_factory=lambda: os.environ.get("TWOPHASE_LOG_LEVEL", "WARNING").upper())
    sanitize: bool = field(default_factory=lambda: _env_flag("TWOPHASE_SANITIZE"))


settings = Settings()
_listeners: dict[str, list[Callable[[object], None]]] = {}


def on_change(name: str, fn: Callable[[object], None]) -> None:
    """Call ``fn(new_value)`` whenever setting ``name`` changes."""
    _listeners.setdefault(name, []).append(fn)


def _set(name: str, value: object) -> None:
    """Change a setting and tell its listeners. If one raises, the old value is put back and told to all of them
    again (listeners are idempotent), so the setting and what follows it (streams, say) agree."""
    old = getattr(settings, name)
    setattr(settings, name, value)
    try:
        for fn in _listeners.get(name, ()):
            fn(value)
    except BaseException:
        setattr(settings, name, old)
        for fn in _listeners.get(name, ()):
            fn(old)
        raise


def set_launch_blocking(enabled: bool) -> None:
    """Run every task inline on the caller's thread (``TWOPHASE_LAUNCH_BLOCKING=1``); affects existing streams."""
    _set("launch_blocking", bool(enabled))


def set_cache_limit(entries: int) -> None:
    """Capacity of each thread's executor cache (``TWOPHASE_CACHE_LIMIT``, default 10000); LRU beyond it."""
    if entries < 0:
        raise ValueError("cache limit must be >= 0")
    _set("cache_limit", int(entries))


def set_cache_enabled(enabled: bool) -> None:
    """Turn the executor cache on or off (``TWOPHASE_DISABLE_CACHE=1`` turns it off)."""
    _set("cache_enabled", bool(enabled))


def set_deterministic(enabled: bool) -> None:
    """Ask for bitwise-reproducible kernels (``TWOPHASE_DETERMINISTIC=1``); part of every cache key."""
    _set("deterministic", bool(enabled))


def set_workspace_limit(nbytes: int | None) -> None:
    """Default ``workspace_limit`` of every phase 1 (``TWOPHASE_WORKSPACE_LIMIT``; None = unlimited)."""
    _set("workspace_limit", None if nbytes is None else int(nbytes))


def set_num_threads(n: int) -> None:
    """Parts a large kernel is cut into for helper threads (``TWOPHASE_NUM_THREADS``); 0, the default, is
    automatic: the CPUs this process may run on (``runtime.fanout.fanout_parts``)."""
    if int(n) < 0:
        raise ValueError("num_threads must be >= 0 (0: automatic)")
    _set("num_threads", int(n))


def set_helper_spin(us: int) -> None:
    """Microseconds a helper thread spins for the next parallel launch before it blocks
    (``TWOPHASE_HELPER_SPIN_US``, default ``HELPER_SPIN_US``; 0: block at once). The spin yields its core to any
    other runnable thread every 20 us. Why: on VMs whose kernel packs sleeping threads onto one vCPU (seen on
    these machines: ``sched_vcpu_pack``), helpers that block after every part are woken onto the launching
    thread's vCPU after an idle gap and the kernels run at one-thread speed for as long as the calls keep
    coming; a helper that stays runnable between launches is moved to the idle vCPU within a few ms."""
    if int(us) < 0:
        raise ValueError("helper spin must be >= 0 microseconds (0: no spin)")
    _set("helper_spin_us", int(us))


def set_log_level(level: str | int) -> None:
    """Level of the ``twophase`` logger (``TWOPHASE_LOG_LEVEL``: DEBUG, INFO, WARNING, ...)."""
    name = logging.getLevelName(level) if isinstance(level, int) else str(level).upper()
    _set("log_level", name)
    logging.getLogger("twophase").setLevel(name)


def set_sanitize(enabled: bool) -> None:
    """Turn the contract sanitizer on or off (``TWOPHASE_SANITIZE=1``); see ``twophase.sanitizer``."""
    _set("sanitize", bool(enabled))
