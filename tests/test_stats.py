"""Counters: a scripted sequence of calls gives exact counts, and the counters add up (phase 1 = hits +
misses, created = destroyed + live, histograms sum to the executors, phase 2 = launches); report / reset."""

from __future__ import annotations

import gc
import io
import json
import sys
import threading

import numpy as np
import pytest

import twophase
from twophase import ops
from twophase.stats import OpCounters, bucket


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


@pytest.fixture
def switch_often():
    """Threads switch every microsecond (not every 5 ms): a race between two bytecodes shows within a few calls."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def _run_threads(n, fn):
    """``fn(i)`` on ``n`` threads started together; the first exception any of them raised is raised here."""
    barrier = threading.Barrier(n)
    errors = []

    def run(i):
        try:
            barrier.wait()
            fn(i)
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_snapshot_and_reset_while_other_threads_plan_and_release(fresh_cache, dev, switch_often):
    """Other threads adding and removing live executors while a snapshot (or a reset) reads them: it used to
    raise 'Set changed size during iteration' (the WeakSet of live executors was iterated in Python)."""
    x = dev.tensor(np.ones((2, 2), np.float32))
    held = [ops.relu.get_workspace_size(x)[1] for _ in range(3000)]  # a long set to read: a switch lands inside
    stop = threading.Event()

    def read_or_churn(i):
        if i == 0:
            try:
                for k in range(40):
                    if k % 8 == 7:
                        twophase.stats.reset()
                    else:
                        snap = twophase.stats.snapshot()
                        assert snap["ops"]["relu"]["executors_live"] >= len(held)
            finally:
                stop.set()
            return
        while not stop.is_set():  # plan a batch, then release it: the set's size keeps changing
            batch = [ops.relu.get_workspace_size(x)[1] for _ in range(20)]
            for ex in batch:
                ex.destroy()

    try:
        _run_threads(3, read_or_churn)
        twophase.stats.reset()  # counts straddling a reset that ran while other threads counted are not exact
    finally:
        for ex in held:
            ex.destroy()
    c = twophase.stats.snapshot()["ops"]["relu"]
    assert (c["executors_created"], c["executors_destroyed"], c["executors_live"]) == (len(held), len(held), 0)
    assert c["reuse_histogram"] == {"0": len(held)}
    _adds_up(c)


class _StubExecutor:
    """What the counters read of an executor."""

    def __init__(self, workspace_size, phase2_calls):
        self.workspace_size = workspace_size
        self.phase2_calls = phase2_calls
        self.launches = 0
        self._repeatable = False  # single-use: nothing left queued at release
        self._blocks = ()


def test_counts_of_threads_counting_at_once_add_up_exactly(switch_often):
    """Four threads recording executors into one op's counters at once: every histogram count lands (a dict
    read-modify-write with a get() call between the read and the write lost some)."""
    counters = OpCounters()
    n, rounds, per_round = 4, 3, 50000  # one round loses counts almost always: three, all but surely
    per_thread = rounds * per_round
    stubs = [_StubExecutor(100, 3), _StubExecutor(100, 3), _StubExecutor(5000, 0), _StubExecutor(0, 1)]

    def record(i):
        ex = stubs[i]
        for _ in range(per_round):
            counters.on_create(ex)
            counters.on_release(ex)

    for _ in range(rounds):
        _run_threads(n, record)
    c = counters.as_dict()
    assert (c["executors_created"], c["executors_destroyed"], c["executors_live"]) == (n * per_thread,) * 2 + (0,)
    assert c["workspace_histogram"] == {"0": per_thread, "128": 2 * per_thread, "8192": per_thread}
    assert c["reuse_histogram"] == {"0": per_thread, "1": per_thread, "4": 2 * per_thread}
    assert c["phase2_calls"] == 7 * per_thread and c["max_workspace_bytes"] == 5000
    _adds_up(c)


def test_histogram_buckets_match_bucket_even_past_two_to_the_64(dev):
    counters = OpCounters()
    sizes = [0, 1, 2, 3, 4, 5, 1000, 1024, 1025, 2**40, 2**64, 2**64 + 1, 2**70 - 3]
    for n in sizes:
        ex = _StubExecutor(n, n)
        counters.on_create(ex)
        counters.on_release(ex)
    c = counters.as_dict()
    want: dict[str, int] = {}
    for n in sorted(sizes):
        want[str(bucket(n))] = want.get(str(bucket(n)), 0) + 1
    assert c["workspace_histogram"] == want and c["reuse_histogram"] == want
    assert list(c["workspace_histogram"]) == sorted(want, key=int)  # in bucket order


def test_a_plan_closed_without_sync_counts_the_launches_still_queued(dev, gate):
    """``close(sync=False)`` destroys the executor while its launches wait on the stream; the counters read its
    launch count at release, so the ones run later were lost (phase2_calls 0 after 20 launches, once synced)."""
    s = dev.stream()
    twophase.stats.reset()
    x = dev.tensor(np.ones((16, 16), np.float32), stream=s)
    open_ = gate(s)
    call = twophase.plan("exp", x, stream=s)
    for _ in range(20):
        call()
    call.close(sync=False)
    c = twophase.stats.snapshot()["ops"]["exp"]
    assert c["phase2_calls"] == 0 and c["executors_live"] == 0 and c["executors_destroyed"] == 1
    open_.set()
    s.synchronize()
    c = twophase.stats.snapshot()["ops"]["exp"]
    assert c["phase2_calls"] == 20 and c["reuse_histogram"] == {"32": 1}
    assert c["executors_live"] == 0 and c["executors_dropped"] == 0
    assert twophase.stats.snapshot()["ops"]["exp"]["phase2_calls"] == 20  # retired once, not again
    x.free(s)
    s.close()


def test_a_phase1_refused_at_binding_is_neither_counted_nor_cached(dev):
    """An out overlapping its input is refused after planning: the plan was cached all the same, so the next
    identical call counted a hit with no miss ever recorded."""
    twophase.stats.reset()
    twophase.clear_cache()
    x = dev.tensor(np.ones((8, 8), np.float32))
    with pytest.raises(twophase.ParamError, match="overlapping"):
        ops.softmax.get_workspace_size(x, dim=-1, out=x.transpose())
    assert twophase.cache_info()["size"] == 0 and "softmax" not in twophase.stats.snapshot()["ops"]
    y = dev.empty((8, 8))
    _, ex = ops.softmax.get_workspace_size(x, dim=-1, out=y.transpose())
    ex.destroy()
    c = twophase.stats.snapshot()["ops"]["softmax"]
    assert (c["phase1_calls"], c["cache_hits"], c["cache_misses"]) == (1, 0, 1)
    x.free()
    y.free()


def test_a_raising_phase1_hook_destroys_the_executor_phase1_made(dev):
    from twophase import hooks

    twophase.stats.reset()
    x = dev.tensor(np.ones(4, np.float32))

    def bad(*_a):
        raise RuntimeError("hook failed")

    h = hooks.add_phase1_hook(bad)
    try:
        with pytest.raises(RuntimeError, match="hook failed"):
            twophase.exp(x)
    finally:
        hooks.remove_hook(h)
    gc.collect()
    c = twophase.stats.snapshot()["ops"]["exp"]
    assert (c["executors_created"], c["executors_destroyed"], c["executors_dropped"]) == (1, 1, 0)
    with pytest.raises(twophase.ParamError, match="remove_hook: argument 'handle'"):
        hooks.remove_hook(h)  # a second removal: the project's error, not list.remove's ValueError
    assert twophase.exp(x).numpy()[0] == pytest.approx(np.e)  # the entry points were restored
    x.free()
