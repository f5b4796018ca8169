"""Counters: a scripted sequence of calls gives exact counts, and the counters add up (phase 1 = hits +
misses, created = destroyed + live, histograms sum to the executors, phase 2 = launches); report / reset."""

from __future__ import annotations

import gc
import io
import json

import numpy as np
import pytest

import twophase
from twophase import ops


def _adds_up(c):
    assert c["phase1_calls"] == c["cache_hits"] + c["cache_misses"]
    assert c["executors_created"] == c["executors_destroyed"] + c["executors_live"] + c["executors_dropped"]
    assert sum(c["reuse_histogram"].values()) == c["executors_created"] - c["executors_dropped"]
    assert sum(c["workspace_histogram"].values()) == c["executors_created"]
    weighted = sum(int(k) for k, v in c["reuse_histogram"].items() for _ in range(v))
    assert c["phase2_calls"] <= weighted  # buckets are powers of two >= the launches


def test_scripted_sequence_gives_exact_counts(fresh_cache, dev, stream, rng):
    a = rng.standard_normal((4, 6))
    for _ in range(3):
        twophase.add(dev.tensor(a), dev.tensor(a))  # 1 miss, 2 hits, 3 single launches
    with twophase.plan("softmax", dev.tensor(a), dim=1, stream=stream) as call:
        for _ in range(4):
            call()  # 1 executor, 4 launches
    _, ex = ops.reduce_sum.get_workspace_size(dev.tensor(rng.standard_normal((2, 5000))), dims=1)
    ex.destroy()  # planned, never launched
    _, live = ops.reduce_sum.get_workspace_size(dev.tensor(a), dims=0, out=dev.empty((6,), "float64"))
    live.set_repeatable()
    ops.reduce_sum(dev.malloc(live.workspace_size), live.workspace_size, live, stream)
    stream.synchronize()

    snap = twophase.stats.snapshot()
    json.dumps(snap)
    add, sm, rs = snap["ops"]["add"], snap["ops"]["softmax"], snap["ops"]["reduce_sum"]
    assert (add["phase1_calls"], add["cache_hits"], add["cache_misses"], add["phase2_calls"]) == (3, 2, 1, 3)
    assert (add["executors_created"], add["executors_destroyed"], add["executors_live"]) == (3, 3, 0)
    assert add["reuse_histogram"] == {"1": 3} and add["workspace_histogram"] == {"0": 3}
    assert (sm["phase1_calls"], sm["phase2_calls"], sm["executors_created"]) == (1, 4, 1)
    assert sm["reuse_histogram"] == {"4": 1}
    assert (rs["phase1_calls"], rs["cache_misses"], rs["phase2_calls"]) == (2, 2, 1)
    assert (rs["executors_created"], rs["executors_destroyed"], rs["executors_live"]) == (2, 1, 1)
    assert rs["reuse_histogram"] == {"0": 1, "1": 1}
    assert rs["workspace_histogram"] == {"0": 1, "64": 1}  # align64(2 * ceil(5000/4096) * 8) = 64
    for c in (add, sm, rs):
        _adds_up(c)
    assert snap["devices"]["cpu"]["peak_allocated_bytes"] >= snap["devices"]["cpu"]["allocated_bytes"]
    live.destroy()
    rs = twophase.stats.snapshot()["ops"]["reduce_sum"]
    assert (rs["executors_destroyed"], rs["executors_live"]) == (2, 0)
    _adds_up(rs)


def test_counters_add_up_after_reset_with_a_live_executor(fresh_cache, dev, stream, rng):
    x = dev.tensor(rng.standard_normal((3, 3)), stream=stream)
    call = twophase.plan("softmax", x, stream=stream)
    call()
    stream.synchronize()  # launches are counted as they complete: one still pending would land after the reset
    twophase.stats.reset()
    call()
    call.close()
    c = twophase.stats.snapshot()["ops"]["softmax"]
    assert c["phase2_calls"] == 1
    _adds_up(c)


def test_reset_zeroes_the_counters(fresh_cache, dev, rng):
    twophase.softmax(dev.tensor(rng.standard_normal((2, 2))))
    assert ops.softmax.counters.phase1 == 1
    twophase.stats.reset()
    assert "softmax" not in twophase.stats.snapshot()["ops"]


def test_report_lists_each_called_op_with_its_counts(fresh_cache, dev, rng):
    for _ in range(2):
        twophase.reduce_sum(dev.tensor(rng.standard_normal((3, 3))), dims=1)
    buf = io.StringIO()
    text = twophase.stats.report(file=buf)
    assert buf.getvalue().strip() == text.strip()
    line = next(ln for ln in text.splitlines() if ln.startswith("reduce_sum"))
    assert line.split()[1:4] == ["2", "1", "1"]  # phase1, hits, misses
    assert "device cpu" in text

    assert line.split()[7] == "-"  # kernel time: nothing was profiled, so nothing to show (not a 0.0)


def test_refused_phase1_calls_count_nowhere_and_dropped_executors_are_counted(fresh_cache, dev, rng):
    x = dev.tensor(rng.standard_normal((2, 3)))
    for bad in ({"dim": 5}, {"workspace_limit": -1}):
        with pytest.raises(twophase.ParamError):
            ops.softmax.get_workspace_size(x, **bad)
    with pytest.raises(twophase.ParamError):
        ops.softmax.get_workspace_size("not a tensor")
    c = twophase.stats.snapshot()["ops"].get("softmax")
    assert c is None or (c["phase1_calls"], c["cache_misses"]) == (0, 0)
    a = dev.tensor(np.ones((8, 8), np.float32))
    for _ in range(2):  # refused at binding (out overlaps an input): it counted a created, then dropped, executor
        with pytest.raises(twophase.ParamError):
            ops.matmul.get_workspace_size(a, a, out=a)
    gc.collect()
    c = twophase.stats.snapshot()["ops"].get("matmul")
    assert c is None or (c["phase1_calls"], c["executors_created"], c["executors_dropped"]) == (0, 0, 0)
    _, ex = ops.matmul.get_workspace_size(a, a)
    ex.destroy()
    c = twophase.stats.snapshot()["ops"]["matmul"]  # the refusals were counted as a miss and a hit
    assert (c["phase1_calls"], c["cache_hits"], c["cache_misses"]) == (1, 0, 1)
    _, ex = ops.softmax.get_workspace_size(x)
    del ex  # dropped without phase 2 or destroy
    gc.collect()
    c = twophase.stats.snapshot()["ops"]["softmax"]
    assert (c["phase1_calls"], c["executors_created"], c["executors_live"], c["executors_dropped"]) == (1, 1, 0, 1)
    _adds_up(c)


def test_max_workspace_is_the_largest_in_bytes_not_its_bucket(fresh_cache, dev, rng):
    x = dev.tensor(np.ones((3, 300000)))
    size, ex = ops.reduce_sum.get_workspace_size(x, dims=1)
    ex.destroy()
    c = twophase.stats.snapshot()["ops"]["reduce_sum"]
    assert size == 1792 and c["workspace_histogram"] == {"2048": 1}
    assert c["max_workspace_bytes"] == size and twophase.stats.means(c)[3] == size


def test_a_dropped_graph_replay_counts_no_launch(fresh_cache, dev, stream, rng):
    """A replay whose task never runs (an earlier task on the stream failed) launches none of its nodes."""
    x = dev.tensor(rng.standard_normal(8), stream=stream)
    with twophase.capture(stream) as g:
        g.input("x", x)
        g.output("y", twophase.exp(x, stream=stream))
    g.instantiate()
    g.replay(stream)
    stream.synchronize()

    def fail() -> None:
        raise ZeroDivisionError("planted")

    stream.launch_callback(fail)
    g.replay(stream)
    with pytest.raises(twophase.KernelError, match="planted"):
        stream.synchronize()
    assert twophase.stats.snapshot()["ops"]["exp"]["phase2_calls"] == 2  # the capture's own, and one replay
    np.testing.assert_allclose(g.replay(stream)["y"].numpy(), np.exp(x.numpy()))
    assert twophase.stats.snapshot()["ops"]["exp"]["phase2_calls"] == 3
    g.destroy()
    x.free(stream)
