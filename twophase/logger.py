"""The ``twophase`` logger (stdlib logging; level from ``TWOPHASE_LOG_LEVEL``) and the exit-time leak report."""

from __future__ import annotations

import atexit
import logging
import sys
import weakref
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


_closed_at_exit: weakref.WeakSet[Any] = weakref.WeakSet()


def close_at_exit(owner: Any) -> None:
    """Have ``owner.close()`` run at interpreter exit, before the leak report, if ``owner`` is still alive then.
    For the library's own objects that hold repeatable executors on the user's behalf (a MiniLM's cached programs
    and graphs): left open, they release them as a file closes, rather than filling the report with executors the
    user never made. ``owner.busy()`` says whether work of its is still queued: then it is not closed (closing
    would wait for that work, and exit must not hang on it). A close that is skipped or fails (a model of another
    thread) is logged, and its executors are reported."""
    _closed_at_exit.add(owner)


# Run at exit after the owners above are closed, before the leak report (the sanitizer's report): registered
# with atexit themselves, they would run first (last registered, first run) and report the owners' executors.
EXIT_REPORTS: list[Any] = []


def _at_exit() -> None:
    for owner in list(_closed_at_exit):
        name = type(owner).__name__
        try:
            if owner.busy():
                logger.warning("%s left open with work still queued at exit: not closed", name)
                continue
            owner.close()
        except Exception as e:  # noqa: BLE001 - at exit: say what could not be closed, then report its leaks
            logger.warning("could not close %s at exit: %s", name, e)
    for report in EXIT_REPORTS:
        report()
    leak_report()


atexit.register(_at_exit)
