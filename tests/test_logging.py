"""Debug logging under the ``twophase`` logger: every phase 1 (op, shapes, dtypes, implementation, tiling,
workspace size, cache hit or miss), every workspace allocation (requested vs granted bytes), every executor
destroy; the level setter; the leak report of repeatable executors that were never destroyed."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

import twophase
from twophase import ops
from twophase.executor import live_repeatable


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def debug_log():
    """DEBUG level on the ``twophase`` logger with a capturing handler; level and handlers restored after."""
    logger = logging.getLogger("twophase")
    old_level, old_setting = logger.level, twophase.settings.log_level
    h = _Records()
    logger.addHandler(h)
    try:
        twophase.set_log_level("DEBUG")
        twophase.clear_cache()
        yield h.lines
    finally:
        logger.removeHandler(h)
        twophase.set_log_level(old_setting)
        logger.setLevel(old_level)


def test_phase1_lines_name_op_shapes_dtypes_implementation_tiling_workspace_and_hit(debug_log, dev, rng):
    a = rng.standard_normal((3, 5000)).astype(np.float32)
    for _ in range(2):
        twophase.reduce_sum(dev.tensor(a), dims=1)
    p1 = [ln for ln in debug_log if ln.startswith("phase1 reduce_sum")]
    assert len(p1) == 2
    assert "cache miss" in p1[0] and "cache hit" in p1[1]
    for ln in p1:
        assert "(3, 5000)" in ln and "float32" in ln and "(3,)" in ln
        assert "implementation tree" in ln
        assert "ReduceTiling(" in ln and "levels=(2,)" in ln
        assert "workspace 64 bytes" in ln  # align64(3 * 2 * 8)


def test_workspace_allocation_lines_give_requested_and_granted_bytes(debug_log, dev, rng):
    x = dev.tensor(rng.standard_normal((3, 5000)))
    debug_log.clear()
    twophase.reduce_sum(x, dims=1)
    allocs = [re.search(r"requested (\d+) bytes, granted (\d+) bytes", ln) for ln in debug_log]
    pairs = [(int(m.group(1)), int(m.group(2))) for m in allocs if m]
    assert (64, 512) in pairs  # the workspace
    assert all(granted >= requested for requested, granted in pairs)


def test_destroy_lines_name_the_executor(debug_log, dev, rng):
    _, ex = ops.softmax.get_workspace_size(dev.tensor(rng.standard_normal((2, 2))))
    ex.destroy()
    twophase.softmax(dev.tensor(rng.standard_normal((2, 2))))  # consumed by phase 2: released too
    lines = [ln for ln in debug_log if ln.startswith("destroy")]
    assert any(f"executor #{ex.id}," in ln and "after 0 launch(es)" in ln for ln in lines)
    assert any("after 1 launch(es)" in ln and "softmax" in ln for ln in lines)


def test_nothing_is_logged_at_warning_level(dev, rng):
    logger = logging.getLogger("twophase")
    h = _Records()
    logger.addHandler(h)
    old = twophase.settings.log_level
    try:
        twophase.set_log_level(logging.WARNING)
        assert twophase.settings.log_level == "WARNING" and logger.level == logging.WARNING
        twophase.softmax(dev.tensor(rng.standard_normal((2, 2))))
        assert h.lines == []
    finally:
        logger.removeHandler(h)
        twophase.set_log_level(old)


def test_leak_report_lists_a_deliberately_leaked_repeatable_executor(dev, stream, rng):
    x = dev.tensor(rng.standard_normal((2, 3)), stream=stream)
    call = twophase.plan("softmax", x, stream=stream)  # never closed below until the report is taken
    call()
    stream.synchronize()
    logger = logging.getLogger("twophase")
    h = _Records()
    logger.addHandler(h)
    try:
        lines = twophase.leak_report()
    finally:
        logger.removeHandler(h)
    mine = [ln for ln in lines if f"executor #{call.executor.id}," in ln]
    assert len(mine) == 1
    assert "softmax" in mine[0] and "test_logging.py" in mine[0] and "1 launch(es)" in mine[0]
    assert mine[0] in h.lines  # also logged as a warning
    call.close()
    assert call.executor not in live_repeatable()
    assert not any(f"executor #{call.executor.id}," in ln for ln in twophase.leak_report())
