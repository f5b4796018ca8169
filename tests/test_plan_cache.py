"""``plan()`` / ``PlannedCall`` and ``PlanCache``: hits rebind buffers, leases block eviction, the entry and
byte caps hold, an evicted plan's workspace is freed only after its stream's work is done, owner thread."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import twophase
from twophase import ExecState, PlanCache, ops

# reduce_sum over R > 4096 elements per row has a nonzero workspace: align64(K * ceil(R/4096) * 8)
_R = 5000


def _ws_input(dev, rng, rows, stream):
    a = rng.standard_normal((rows, _R))
    return a, dev.tensor(a, stream=stream)


def test_plan_runs_many_times_and_rebinds_inputs(dev, stream, rng):
    a1, a2 = rng.standard_normal((3, 8)), rng.standard_normal((3, 8))
    x1, x2 = dev.tensor(a1, stream=stream), dev.tensor(a2, stream=stream)
    with twophase.plan("softmax", x1, dim=1, stream=stream) as call:
        r1 = call().numpy()
        r2 = call(x2).numpy()
        assert call.executor.launches == 2 and call.executor.repeatable
    assert call.executor.state is ExecState.DESTROYED
    np.testing.assert_allclose(r1, np.exp(a1) / np.exp(a1).sum(1, keepdims=True), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(r2, np.exp(a2) / np.exp(a2).sum(1, keepdims=True), rtol=1e-10, atol=1e-10)


def test_plan_closes_on_exception(dev, stream, rng):
    x = dev.tensor(rng.standard_normal((2, 3)), stream=stream)
    with pytest.raises(RuntimeError):
        with twophase.plan(ops.softmax, x, stream=stream) as call:
            call()
            raise RuntimeError("boom")
    assert call.workspace is None and call.executor.state is ExecState.DESTROYED


def test_hit_reuses_the_plan_with_the_new_buffers(dev, stream, rng):
    pc = PlanCache()
    results = []
    for _ in range(3):
        a, b = rng.standard_normal((4, 5)), rng.standard_normal((4, 5))
        with pc.lease("add", dev.tensor(a, stream=stream), dev.tensor(b, stream=stream), stream=stream) as call:
            results.append((call().numpy(), a + b))
    assert pc.info()["hits"] == 2 and pc.info()["misses"] == 1 and len(pc) == 1
    for got, want in results:
        np.testing.assert_allclose(got, want)
    pc.clear()
    assert len(pc) == 0


def test_ping_pong_buffers_swap_roles_in_plan_and_plan_cache(dev, stream, rng):
    """a -> b, then b -> a: the call rebinds input and output together (one at a time, each step overlapped the
    other's old binding and the swap was refused)."""
    xs, ws = rng.standard_normal((4, 8)), rng.standard_normal((8, 8)) / 8
    w = dev.tensor(ws, stream=stream)
    a, b = dev.tensor(xs, stream=stream), dev.empty((4, 8), "float64")
    with twophase.plan("matmul", a, w, out=b, stream=stream) as call:
        call()
        call(b, w, out=a)
        with pytest.raises(twophase.ParamError, match="input index"):
            call(b, w, a)  # a third input (a's memory is the bound output: it was passed over)
    np.testing.assert_allclose(a.numpy(), xs @ ws @ ws, rtol=1e-12)
    a2, b2 = dev.tensor(xs, stream=stream), dev.empty((4, 8), "float64")
    pc = PlanCache()
    with pc.lease("matmul", a2, w, out=b2, stream=stream) as call:
        call()
    with pc.lease("matmul", b2, w, out=a2, stream=stream) as call:
        call()
    assert pc.info()["hits"] == 1
    np.testing.assert_allclose(a2.numpy(), xs @ ws @ ws, rtol=1e-12)
    pc.clear()
    for t in (w, a, b, a2, b2):
        t.free(stream)


@pytest.mark.parametrize("op", ["exp", "softmax"])
def test_a_cached_calls_own_output_fed_back_as_input_gets_another_entry(dev, stream, rng, op):
    """Chaining y = f(x), z = f(y) through the cache: the entry whose output y is would run f on y in place (z is y,
    and y changed under the caller); the cache serves another entry instead."""
    xs = rng.standard_normal((4, 8))
    x = dev.tensor(xs, stream=stream)
    pc = PlanCache()
    with pc.lease(op, x, stream=stream) as call:
        y = call()
    first = y.numpy().copy()
    with pc.lease(op, y, stream=stream) as call:
        z = call()
    assert z.block is not y.block and pc.info()["misses"] == 2
    np.testing.assert_array_equal(y.numpy(), first)
    f = np.exp if op == "exp" else (lambda v: np.exp(v) / np.exp(v).sum(-1, keepdims=True))
    np.testing.assert_allclose(first, f(xs), rtol=1e-12)
    np.testing.assert_allclose(z.numpy(), f(f(xs)), rtol=1e-12)
    with pc.lease(op, x, stream=stream) as call:  # an input apart from both outputs: a hit
        call()
    assert pc.info()["hits"] == 1
    pc.clear()
    x.free(stream)


def test_hit_rebinds_a_given_out(dev, stream, rng):
    pc = PlanCache()
    for _ in range(2):
        a = rng.standard_normal((3, _R))
        out = dev.empty((3,), "float64")
        with pc.lease("reduce_sum", dev.tensor(a, stream=stream), out=out, dims=1, stream=stream) as call:
            assert call() is out
            np.testing.assert_allclose(out.numpy(), a.sum(1), rtol=1e-10, atol=1e-10)
    assert pc.info()["hits"] == 1
    pc.clear()


def test_entry_cap_holds_when_nothing_is_leased(dev, stream, rng):
    pc = PlanCache(max_entries=2)
    for rows in (1, 2, 3, 4):
        _, x = _ws_input(dev, rng, rows, stream)
        with pc.lease("reduce_sum", x, dims=1, stream=stream) as call:
            call()
        stream.synchronize()
        assert len(pc) <= 2
    assert pc.info()["evictions"] == 2
    pc.clear()


@settings(max_examples=15, deadline=None)
@given(rows=st.lists(st.integers(1, 40), min_size=1, max_size=8), cap_rows=st.integers(1, 60))
def test_bytes_cap_holds(rows, cap_rows):
    dev = twophase.device("cpu")
    s = dev.stream()
    rng = np.random.default_rng(len(rows) * 100 + cap_rows)
    cap = cap_rows * 512  # a plan holds a workspace block (align64(rows * 2 * 8)) and its output's, 512 B each
    pc = PlanCache(max_entries=100, max_bytes=cap)
    try:
        for n in rows:
            a, x = _ws_input(dev, rng, n, s)
            with pc.lease("reduce_sum", x, dims=1, stream=s) as call:
                assert call.workspace_size > 0
                got = call().numpy()  # an owned output lives as long as the entry
            np.testing.assert_allclose(got, a.sum(1), rtol=1e-10, atol=1e-10)
            s.synchronize()
            pc._evict()  # nothing pending any more
            info = pc.info()
            assert info["bytes"] <= cap or info["size"] == 0
            assert info["bytes"] == sum(e.call.held_bytes for e in pc._entries.values())
    finally:
        pc.clear()
        s.close()


def test_leased_entries_are_not_evicted(dev, stream, rng):
    pc = PlanCache(max_entries=1)
    _, x1 = _ws_input(dev, rng, 1, stream)
    _, x2 = _ws_input(dev, rng, 2, stream)
    c1 = pc.acquire("reduce_sum", x1, dims=1, stream=stream)
    c2 = pc.acquire("reduce_sum", x2, dims=1, stream=stream)
    assert len(pc) == 2 and pc.info()["evictions"] == 0  # over the cap, but both leased
    assert c1.workspace is not None and c1.executor.state is ExecState.READY
    c1()
    pc.release(c1)
    stream.synchronize()
    pc.release(c2)  # now c1 is free and done: the cap is enforced again
    assert len(pc) == 1 and pc.info()["evictions"] == 1
    assert c1.workspace is None and c1.executor.state is ExecState.DESTROYED
    pc.clear()


def test_release_without_lease_raises(dev, stream, rng):
    pc = PlanCache()
    call = pc.acquire("softmax", dev.tensor(rng.standard_normal((2, 2)), stream=stream), stream=stream)
    pc.release(call)
    with pytest.raises(twophase.InvalidStateError):
        pc.release(call)
    pc.clear()


def test_entry_with_pending_stream_work_is_not_evicted(dev, stream, gate, rng):
    pc = PlanCache(max_entries=1)
    a1, x1 = _ws_input(dev, rng, 2, stream)
    ev = gate(stream)
    with pc.lease("reduce_sum", x1, dims=1, stream=stream) as c1:
        r1 = c1()
    _, x2 = _ws_input(dev, rng, 3, stream)
    with pc.lease("reduce_sum", x2, dims=1, stream=stream):
        pass
    # c1's kernel is still queued behind the gate: its plan and workspace must survive
    assert c1.workspace is not None and c1.executor.state is ExecState.READY
    assert len(pc) == 1  # the cap held by evicting the idle newer entry instead
    ev.set()
    stream.synchronize()
    np.testing.assert_allclose(r1.numpy(), a1.sum(1), rtol=1e-10, atol=1e-10)
    pc.clear()
    assert c1.workspace is None and c1.executor.state is ExecState.DESTROYED


def test_evicted_workspace_is_not_reused_by_another_stream_before_its_work_is_done(dev, stream, gate, rng):
    """The workspace returns to the pool in stream order: another stream cannot get it while work is queued."""
    other = dev.stream()
    try:
        pc = PlanCache(max_entries=1)
        a1, x1 = _ws_input(dev, rng, 2, stream)
        r1 = dev.empty((2,), "float64")
        ev = gate(stream)
        with pc.lease("reduce_sum", x1, out=r1, dims=1, stream=stream) as c1:
            c1()
            ws = c1.workspace
        addr, size = ws.address, ws.size
        c1.close(sync=False)  # what eviction does
        pc.clear()
        taken = [dev.malloc(size, stream=other) for _ in range(4)]
        assert all(b.address != addr for b in taken)
        ev.set()
        stream.synchronize()
        np.testing.assert_allclose(r1.numpy(), a1.sum(1), rtol=1e-10, atol=1e-10)
        for b in taken:
            b.free()
    finally:
        other.close()


def test_plan_cache_belongs_to_its_thread(dev, stream, rng):
    """acquire, release and clear from another thread are refused before anything changes."""
    pc = PlanCache(max_entries=1)
    x = dev.tensor(rng.standard_normal((2, 2)), stream=stream)
    first, second = pc.acquire("softmax", x), pc.acquire("relu", x)  # over the cap while both are leased
    errors = []

    def other():
        for call in (lambda: pc.acquire("softmax", x), lambda: pc.release(first), pc.clear):
            try:
                call()
            except twophase.InvalidStateError as e:
                errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 3 and all("belongs to the thread" in str(e) for e in errors)
    assert pc.info()["leased"] == 2 and first.executor.state is twophase.ExecState.READY
    pc.release(first)  # evicts it, on its own thread
    pc.release(second)
    pc.clear()
    assert len(pc) == 0 and first.executor.state is twophase.ExecState.DESTROYED
    x.free(stream)


@pytest.mark.parametrize(
    "kwargs", [{"max_entries": 0}, {"max_entries": 2.5}, {"max_entries": True}, {"max_bytes": -1}, {"max_bytes": 1.5}]
)
def test_bad_caps_are_refused(kwargs):
    with pytest.raises(twophase.ParamError):
        PlanCache(**kwargs)


def test_leases_are_exclusive_two_holders_get_distinct_calls_on_their_own_buffers():
    dev = twophase.device()
    rng = np.random.default_rng(7)
    a = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal((3, 4)).astype(np.float32)
    cache = twophase.PlanCache(max_entries=8)
    ta, tb = dev.tensor(a), dev.tensor(b)
    first = cache.acquire("softmax", ta, dim=-1)
    second = cache.acquire("softmax", tb, dim=-1)
    assert first is not second
    ya, yb = first(), second()
    np.testing.assert_allclose(ya.numpy(), np.exp(a) / np.exp(a).sum(-1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(yb.numpy(), np.exp(b) / np.exp(b).sum(-1, keepdims=True), rtol=1e-5)
    cache.release(first)
    third = cache.acquire("softmax", tb, dim=-1)
    assert third is first  # an idle entry of the same metadata is reused
    cache.release(second)
    cache.release(third)
    assert cache.info()["leased"] == 0
    cache.clear()
    assert len(cache) == 0


def test_a_plan_made_before_set_workspace_limit_is_not_served_after(dev, stream):
    """The global limit is part of the key, as in phase 1: a cached 'packed' plan needs 128 bytes, over limit 0."""
    a = dev.tensor(np.ones((6, 8), np.float32), stream=stream).strided((6, 4), (8, 2))
    b = dev.tensor(np.ones((4, 3), np.float32), stream=stream)
    pc = PlanCache()
    try:
        with pc.lease("matmul", a, b, stream=stream) as c:
            assert (c.executor.implementation, c.workspace_size) == ("packed", 128)
        twophase.set_workspace_limit(0)
        with pytest.raises(twophase.ParamError, match="at least 128 bytes"):
            pc.acquire("matmul", a, b, stream=stream)
        twophase.set_workspace_limit(None)
        with pc.lease("matmul", a, b, stream=stream) as c:
            assert c.workspace_size == 128
        assert (pc.hits, pc.misses) == (1, 2)
    finally:
        twophase.set_workspace_limit(None)
        pc.clear()


def test_bytes_cap_counts_the_outputs_a_cached_call_allocated():
    """A softmax's workspace is 0: the byte cap counted only workspaces, so 64 cached calls each holding a
    64 KiB output kept 4 MiB under a 256 KiB cap (a server's distinct shapes held gigabytes)."""
    dev = twophase.device("cpu")
    s = dev.stream()
    pc = PlanCache(max_entries=256, max_bytes=256 << 10)
    dev.synchronize()
    before = dev.pool.stats()["allocated_bytes"]
    try:
        for n in range(64):
            x = dev.tensor(np.ones((16, 1024 + n), np.float32), stream=s)
            with pc.lease("softmax", x, dim=-1, stream=s) as call:
                assert call.workspace_size == 0 and call.held_bytes >= 16 * 1024 * 4
                call()
            s.synchronize()
            x.free()
            pc._evict()
            info = pc.info()
            assert info["bytes"] <= 256 << 10 or info["size"] == 1
            assert dev.pool.stats()["allocated_bytes"] - before == info["bytes"]  # all it holds is counted
        assert pc.evictions > 0
    finally:
        pc.clear()
        s.close()


def test_an_unhashable_attribute_with_a_workspace_limit_is_cached(dev, stream, rng):
    """dims given as a numpy array and a workspace_limit: the key's fallback refused 'workspace_limit' as an
    unknown attribute (tp.plan took the same call)."""
    a = rng.standard_normal((8, 100))
    x = dev.tensor(a, stream=stream)
    pc = PlanCache()
    for _ in range(2):
        with pc.lease("reduce_sum", x, dims=np.array([1]), workspace_limit=1 << 20, stream=stream) as c:
            np.testing.assert_allclose(c().numpy(), a.sum(1), rtol=1e-12)
    assert (pc.hits, pc.misses) == (1, 1)
    pc.clear()
    x.free(stream)


def test_a_lease_closed_by_its_holder_is_never_served_again_and_a_destroyed_executor_is_never_rebound() -> None:
    dev = twophase.device("cpu")
    pc = PlanCache()
    x1, y1 = dev.tensor(np.ones(4, np.float32)), dev.empty((4,))
    x2, y2 = dev.tensor(np.full(4, 2, np.float32)), dev.empty((4,))
    with pc.acquire("exp", x1, out=y1) as call:  # PlannedCall's own __exit__ closes it
        call()
    assert call.executor.state is ExecState.DESTROYED
    pc.release(call)
    assert len(pc) == 0 and pc.evictions == 0  # dropped at release, not evicted
    c2 = pc.acquire("exp", x2, out=y2)
    assert c2 is not call and c2.executor.state is ExecState.READY
    c2()
    np.testing.assert_allclose(y2.numpy(), np.exp(2.0), rtol=1e-6)
    with pytest.raises(twophase.InvalidStateError, match="destroyed"):
        call.executor._rebind([(0, x2)], [y2])  # the hit path's rebind checks the state
    assert call.executor._gate is None
    pc.release(c2)
    pc.clear()
    for t in (x1, y1, x2, y2):
        t.free()


def test_a_hit_binds_the_entrys_own_output_back_not_a_previous_holders(dev, stream, rng):
    """A holder's ``call(out=y1)`` rebinds the entry's output; the next holder (no ``out``) must get the entry's own
    output, never y1, which its owner still reads."""
    a1, a2 = rng.standard_normal(16), rng.standard_normal(16)
    x1, x2 = dev.tensor(a1, stream=stream), dev.tensor(a2, stream=stream)
    y1 = dev.empty((16,), "float64", stream=stream)
    pc = PlanCache()
    with pc.lease("exp", x1, stream=stream) as c1:
        own = c1.outputs[0]
        assert c1(x1, out=y1) is y1
    with pc.lease("exp", x2, stream=stream) as c2:
        assert c2 is c1 and c2.outputs[0] is own
        r = c2()
        assert r is own
    np.testing.assert_allclose(y1.numpy(), np.exp(a1), rtol=1e-12)  # untouched by the second holder
    np.testing.assert_allclose(r.numpy(), np.exp(a2), rtol=1e-12)
    assert (pc.hits, pc.misses) == (1, 1)
    pc.clear()
    for t in (x1, x2, y1):
        t.free(stream)


def test_an_entry_planned_on_the_callers_out_is_not_served_to_a_caller_asking_for_a_new_output(dev, stream):
    """``out=y1`` (a tensor) and ``out=y1.desc`` (allocate one of this desc) share the metadata key: the entry
    holding y1 has no output of its own, so the second caller gets a new plan, not y1."""
    x = dev.tensor(np.ones(4, np.float32), stream=stream)
    y1 = dev.empty((4,), stream=stream)
    pc = PlanCache()
    with pc.lease("exp", x, out=y1, stream=stream) as c1:
        c1()
    with pc.lease("exp", x, out=y1.desc, stream=stream) as c2:
        assert c2 is not c1 and c2() is not y1
    with pc.lease("exp", x, out=y1, stream=stream) as c3:  # a caller passing a tensor is served either
        assert c3 in (c1, c2) and c3() is y1
    assert (pc.hits, pc.misses) == (1, 2)
    pc.clear()
    x.free(stream)
    y1.free(stream)


def test_a_holder_freeing_the_output_it_was_given_drops_the_entry_and_nothing_leaks(dev, stream, rng):
    """Freeing a returned output (as one frees any tensor one gets) made the entry fail every later acquire,
    counted as hits, and left its executor alive after clear(); closing a PlannedCall whose own output the
    caller freed raised a double free and leaked the executor."""
    from twophase.executor import live_repeatable

    a = rng.standard_normal(8)
    x = dev.tensor(a, stream=stream)
    pc = PlanCache()
    with pc.lease("exp", x, stream=stream) as c1:
        y = c1()
    stream.synchronize()
    y.free(stream)
    for _ in range(2):
        with pc.lease("exp", x, stream=stream) as c:
            np.testing.assert_allclose(c().numpy(), np.exp(a), rtol=1e-12)
    assert c1.executor.state is ExecState.DESTROYED and c is not c1
    assert (pc.hits, pc.misses, len(pc), pc.evictions) == (1, 2, 1, 0)
    with pc.lease("exp", x, stream=stream) as c:
        c().free(stream)  # freed while leased: dropped at release
    assert len(pc) == 0 and c.executor.state is ExecState.DESTROYED
    call = twophase.plan("exp", x, stream=stream)
    call().free(stream)
    call.close()
    assert call.executor.state is ExecState.DESTROYED
    assert not [e for e in live_repeatable() if e.op.name == "exp"]
    x.free(stream)


def test_a_leased_plan_records_where_the_caller_leased_it(dev, stream):
    """The leak report names where a plan was made: for ``pc.lease`` that was contextlib.py, the frame of the
    ``contextmanager`` that planned it."""
    x = dev.tensor(np.ones(4, np.float32), stream=stream)
    pc = PlanCache()
    with pc.lease("exp", x, stream=stream) as c:
        line = c.executor.origin
    assert line.startswith(f"{__file__}:"), line
    pc.clear()
    x.free(stream)
