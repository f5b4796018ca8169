"""Run-time settings: each ``TWOPHASE_*`` environment variable is read once here and has a Python setter."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["settings", "set_launch_blocking", "on_change"]


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


@dataclass
class Settings:
    """Current values; change them through the setters so that listeners (streams, caches) follow."""

    launch_blocking: bool = field(default_factory=lambda: _env_flag("TWOPHASE_LAUNCH_BLOCKING"))


settings = Settings()
_listeners: dict[str, list[Callable[[object], None]]] = {}


def on_change(name: str, fn: Callable[[object], None]) -> None:
    """Call ``fn(new_value)`` whenever setting ``name`` changes."""
    _listeners.setdefault(name, []).append(fn)


def _set(name: str, value: object) -> None:
    setattr(settings, name, value)
    for fn in _listeners.get(name, ()):
        fn(value)


def set_launch_blocking(enabled: bool) -> None:
    """Run every task inline on the caller's thread (``TWOPHASE_LAUNCH_BLOCKING=1``); affects existing streams."""
    _set("launch_blocking", bool(enabled))
