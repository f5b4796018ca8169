"""The ``twophase`` logger (stdlib logging; level from ``TWOPHASE_LOG_LEVEL``) and the exit-time leak report."""

from __future__ import annotations

import atexit
import logging
import sys
from typing import Any

from .config import settings
from .executor import live_repeatable


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at emit time (test runners swap it and close the old one)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


logger = logging.getLogger("twophase")
logger.setLevel(settings.log_level)
if not logger.handlers:
    _handler = _StderrHandler()
    _handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
    logger.addHandler(_handler)
    logger.propagate = False


def leak_report() -> list[str]:
    """Log (warning) and return one line per repeatable executor that was never destroyed."""
    lines = [f"leaked {ex.describe()} created at {ex.origin}, {ex.launches} launch(es)" for ex in live_repeatable()]
    for line in lines:
        logger.warning(line)
    return lines


atexit.register(leak_report)
