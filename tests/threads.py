"""Thread helpers of the tests: a block run with twophase cut into a given number of parts (``set_num_threads``),
and a stream's callback run from another thread that a hang cannot stall."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import twophase


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    old = twophase.settings.num_threads
    twophase.set_num_threads(n)
    try:
        yield
    finally:
        twophase.set_num_threads(old)


def ran_without_hanging(stream: twophase.Stream, body: Callable[[], object], blocking: bool) -> bool:
    """Run ``body`` (it launches on ``stream`` and syncs) on a thread, with launch blocking on or off, and wait 30 s
    at most (a hang guard, not a timing check); False if it hung, after letting the stream's waits loose (they poll
    ``done``), or every later ``Device.synchronize`` would hang too."""
    twophase.set_launch_blocking(blocking)
    try:
        t = threading.Thread(target=body, daemon=True)
        t.start()
        t.join(30)
    finally:
        twophase.set_launch_blocking(False)
    if t.is_alive():
        stream._q.done = stream._q.submitted
        return False
    return True
