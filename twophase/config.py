"""Run-time settings: each ``TWOPHASE_*`` environment variable is read once here and has a Python setter; both go
through one validator per setting, so a value the setter refuses makes ``import twophase`` raise a ParamError."""

from __future__ import annotations

import logging
import numbers
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from .errors import ParamError

__all__ = [
    "settings",
    "on_change",
    "set_launch_blocking",
    "set_cache_limit",
    "set_cache_enabled",
    "set_deterministic",
    "set_workspace_limit",
    "set_log_level",
    "set_sanitize",
    "set_num_threads",
    "set_helper_spin",
]


_ENV = "environment"  # the ``op`` of errors about a TWOPHASE_* variable; validators then parse text
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_T = TypeVar("_T")


def _bad(op: str, arg: str, expected: str, got: object) -> ParamError:
    """The error for a refused value; text is quoted so that ``'5'`` and ``5`` read apart, and None is shown."""
    return ParamError(op=op, arg=arg, expected=expected, got=repr(got) if got is None or isinstance(got, str) else got)


def _flag(value: object, op: str, arg: str) -> bool:
    """A bool; from the environment 1/0/true/false/yes/no/on/off (any case). Why not truthiness: 'no' is truthy."""
    if op == _ENV and isinstance(value, str) and value.lower() in _TRUE + _FALSE:
        return value.lower() in _TRUE
    if isinstance(value, bool):
        return value
    raise _bad(op, arg, "one of 1/0/true/false/yes/no/on/off" if op == _ENV else "a bool", value)


def int_value(v: object) -> int | None:
    """``v`` as an int when it is an integer, Python's or numpy's, and not a bool; else None (2.7 must not become
    2, nor True 1)."""
    return int(v) if isinstance(v, numbers.Integral) and not isinstance(v, bool) else None


def _count(value: object, op: str, arg: str, expected: str, most: int | None = None) -> int:
    """An int >= 0 (at most ``most``; bools and floats refused: 2.7 must not become 2); from the environment a
    base-10 integer."""
    v = value
    if op == _ENV and isinstance(value, str):
        if not (value.isascii() and value.isdigit()):  # int() would also take '+3' and '1_000'
            raise _bad(op, arg, expected, value)
        v = int(value, 10)
    n = int_value(v)
    if n is None or n < 0 or (most is not None and n > most):
        raise _bad(op, arg, expected, value)
    return n


def _cache_limit(value: object, op: str, arg: str) -> int:
    return _count(value, op, arg, "an int >= 0 (entries; 0 caches nothing)")


MAX_THREADS = 1024  # parts a launch may be cut into (2**70 was taken, and every parallel op failed after)
MAX_SPIN_US = 1_000_000  # helper spin, microseconds (2**70 was taken, and killed the helper threads)


def _num_threads(value: object, op: str, arg: str) -> int:
    return _count(value, op, arg, f"an int in [0, {MAX_THREADS}] (parts; 0 is automatic)", MAX_THREADS)


def _helper_spin(value: object, op: str, arg: str) -> int:
    return _count(
        value, op, arg, f"an int in [0, {MAX_SPIN_US}] (helper spin in microseconds; 0 blocks at once)", MAX_SPIN_US
    )


def check_byte_limit(value: object, op: str, arg: str) -> int | None:
    """Bytes, or None (the variable unset) for no limit."""
    unlimited = "unset" if op == _ENV else "None"
    return None if value is None else _count(value, op, arg, f"{unlimited} (unlimited) or an int >= 0 (bytes)")


def _log_level(value: object, op: str, arg: str) -> str | int:
    """A level name logging knows (any case) or an int >= 0; kept as the name when the level has a standard one,
    so that ``settings.log_level`` reads ``'DEBUG'`` whichever way it was set."""
    names = logging.getLevelNamesMapping()
    v = value
    if op == _ENV and isinstance(value, str) and value.isascii() and value.isdigit():
        v = int(value)
    if isinstance(v, str) and v.upper() in names:
        return logging.getLevelName(names[v.upper()])  # the standard name: "warn" reads "WARNING", as 30 does
    n = int_value(v)
    if n is not None and n >= 0:
        name = logging.getLevelName(n)
        return name if name in names else n
    raise _bad(op, arg, f"a level name ({', '.join(names)}) or an int >= 0", value)


def _env(var: str, check: Callable[[object, str, str], _T], default: _T) -> _T:
    """``var`` checked as its setter checks it; unset or blank gives ``default``, a bad value a ParamError."""
    raw = os.environ.get(var, "").strip()
    return default if raw == "" else check(raw, _ENV, var)


HELPER_SPIN_US = 500  # see set_helper_spin
LOG_LEVEL: str | int = "WARNING"  # default of set_log_level


@dataclass
class Settings:
    """Current values; change them through the setters so that listeners (streams, caches) follow."""

    launch_blocking: bool = field(default_factory=lambda: _env("TWOPHASE_LAUNCH_BLOCKING", _flag, False))
    cache_limit: int = field(default_factory=lambda: _env("TWOPHASE_CACHE_LIMIT", _cache_limit, 10000))
    cache_enabled: bool = field(default_factory=lambda: not _env("TWOPHASE_DISABLE_CACHE", _flag, False))
    deterministic: bool = field(default_factory=lambda: _env("TWOPHASE_DETERMINISTIC", _flag, False))
    workspace_limit: int | None = field(
        default_factory=lambda: _env("TWOPHASE_WORKSPACE_LIMIT", check_byte_limit, None)
    )
    num_threads: int = field(default_factory=lambda: _env("TWOPHASE_NUM_THREADS", _num_threads, 0))  # 0: automatic
    helper_spin_us: int = field(default_factory=lambda: _env("TWOPHASE_HELPER_SPIN_US", _helper_spin, HELPER_SPIN_US))
    log_level: str | int = field(default_factory=lambda: _env("TWOPHASE_LOG_LEVEL", _log_level, LOG_LEVEL))
    sanitize: bool = field(default_factory=lambda: _env("TWOPHASE_SANITIZE", _flag, False))


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
    _set("launch_blocking", _flag(enabled, "set_launch_blocking", "enabled"))


def set_cache_limit(entries: int) -> None:
    """Capacity of each thread's executor cache (``TWOPHASE_CACHE_LIMIT``, default 10000); LRU beyond it, 0 caches
    nothing. A lower limit holds for each thread from its next phase 1 or ``cache_info`` on: its cache trims itself."""
    _set("cache_limit", _cache_limit(entries, "set_cache_limit", "entries"))


def set_cache_enabled(enabled: bool) -> None:
    """Turn the executor cache on or off (``TWOPHASE_DISABLE_CACHE=1`` turns it off)."""
    _set("cache_enabled", _flag(enabled, "set_cache_enabled", "enabled"))


def set_deterministic(enabled: bool) -> None:
    """Ask for bitwise-reproducible kernels (``TWOPHASE_DETERMINISTIC=1``); part of every cache key."""
    _set("deterministic", _flag(enabled, "set_deterministic", "enabled"))


def set_workspace_limit(nbytes: int | None) -> None:
    """Default ``workspace_limit`` of every phase 1 (``TWOPHASE_WORKSPACE_LIMIT``; None = unlimited)."""
    _set("workspace_limit", check_byte_limit(nbytes, "set_workspace_limit", "nbytes"))


def set_num_threads(n: int) -> None:
    """Parts a large kernel is cut into for helper threads (``TWOPHASE_NUM_THREADS``); 0, the default, is
    automatic: the CPUs this process may run on (``runtime.fanout.fanout_parts``)."""
    _set("num_threads", _num_threads(n, "set_num_threads", "n"))


def set_helper_spin(us: int) -> None:
    """Microseconds a helper thread spins for the next parallel launch before it blocks
    (``TWOPHASE_HELPER_SPIN_US``, default ``HELPER_SPIN_US``; 0: block at once). The spin yields its core to any
    other runnable thread every 20 us. Why: on VMs whose kernel packs sleeping threads onto one vCPU (seen on
    these machines: ``sched_vcpu_pack``), helpers that blocked after every part were woken onto the launching
    thread's vCPU after an idle gap, and the kernels ran at one-thread speed for as long as the calls kept
    coming. A launch now keeps a sleeping helper, and one spinning on its CPU, off that CPU
    (``runtime.placement``); the spin still saves the helper's wake-up (43 us median on a 2-vCPU Xeon VM,
    ``runtime.spin``) on launches that follow closely.

    It also caps the shorter spins of a stream's worker waiting for its next task and of a host thread in
    ``synchronize`` (``stream.SYNC_SPIN_US``, 100 us), which save the two thread wake-ups of a launch +
    synchronize; 0 turns every spin off."""
    _set("helper_spin_us", _helper_spin(us, "set_helper_spin", "us"))


def set_log_level(level: str | int) -> None:
    """Level of the ``twophase`` logger (``TWOPHASE_LOG_LEVEL``): a name (DEBUG, INFO, WARNING, ..., any case) or
    an int; checked before anything is stored, so a refused level leaves the setting and the logger as they were."""
    checked = _log_level(level, "set_log_level", "level")
    _set("log_level", checked)
    logging.getLogger("twophase").setLevel(checked)


def set_sanitize(enabled: bool) -> None:
    """Turn the contract sanitizer on or off (``TWOPHASE_SANITIZE=1``); see ``twophase.sanitizer``."""
    _set("sanitize", _flag(enabled, "set_sanitize", "enabled"))
