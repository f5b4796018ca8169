"""Run a block of a test with twophase cut into a given number of parts (``set_num_threads``), restored after."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import twophase


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    old = twophase.settings.num_threads
    twophase.set_num_threads(n)
    try:
        yield
    finally:
        twophase.set_num_threads(old)
