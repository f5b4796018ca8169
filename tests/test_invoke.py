"""invoke_two_phase and PlannedCall: the release order synchronize -> free workspace -> destroy, on every path."""

from __future__ import annotations

import numpy as np
import pytest

import twophase
from twophase import ExecState, PlannedCall, TensorDesc, invoke_two_phase, ops


def _reduce_inputs(dev, stream, rng, rows=8):
    a = rng.standard_normal((rows, 5000))
    return a, dev.tensor(a, stream=stream), dev.empty((rows,), "float64")


def test_invoke_two_phase_runs_and_releases_workspace_and_executor(dev, stream, rng):
    a, x, out = _reduce_inputs(dev, stream, rng)
    stream.synchronize()
    before = dev.pool.stats()["allocated_bytes"]
    ex = invoke_two_phase(lambda: ops.reduce_sum.get_workspace_size(x, dims=(1,), out=out), ops.reduce_sum, stream)
    assert ex.state is ExecState.CONSUMED and ex.workspace_size > 0
    assert dev.pool.stats()["allocated_bytes"] == before
    np.testing.assert_allclose(out.numpy(), a.sum(1), rtol=1e-12)


@pytest.mark.parametrize("failure", ["before_enqueue", "wrong_size"])
def test_invoke_two_phase_releases_everything_when_phase2_raises(dev, stream, rng, failure):
    _, x, out = _reduce_inputs(dev, stream, rng)
    stream.synchronize()
    before = dev.pool.stats()
    seen = []

    def execute(ws, size, ex, s):
        seen.append(ex)
        if failure == "before_enqueue":
            raise KeyError("caller bug")
        ops.reduce_sum(ws, size - 64, ex, s)

    with pytest.raises((KeyError, twophase.WorkspaceTooSmallError)):
        invoke_two_phase(lambda: ops.reduce_sum.get_workspace_size(x, dims=(1,), out=out), execute, stream)
    after = dev.pool.stats()
    assert after["allocated_bytes"] == before["allocated_bytes"]
    assert after["free_count"] == before["free_count"] + 1
    assert seen[0].state is ExecState.DESTROYED


def test_invoke_two_phase_releases_executor_when_phase2_fails_on_the_stream(dev, stream, rng):
    _, x, out = _reduce_inputs(dev, stream, rng)
    stream.synchronize()
    before = dev.pool.stats()["allocated_bytes"]

    def get_size():
        size, ex = ops.reduce_sum.get_workspace_size(x, dims=(1,), out=out)
        ex._launch = lambda _: 1 / 0
        return size, ex

    with pytest.raises(twophase.KernelError, match="reduce_sum"):
        invoke_two_phase(get_size, ops.reduce_sum, stream)
    assert dev.pool.stats()["allocated_bytes"] == before


def test_invoke_two_phase_destroys_the_executor_when_the_workspace_cannot_be_had():
    null = twophase.device("null")
    s = null.stream()
    seen = []

    def get_size():
        size, ex = ops.softmax.get_workspace_size(TensorDesc((1 << 12, 1 << 16), "float16"))
        seen.append(ex)
        return size, ex

    null.pool.set_limit(null.pool.stats()["reserved_bytes"])
    try:
        with pytest.raises(twophase.OutOfMemoryError):
            invoke_two_phase(get_size, ops.softmax, s)
    finally:
        null.pool.set_limit(None)
    assert seen[0].state is ExecState.DESTROYED


def test_invoke_two_phase_without_sync_frees_the_workspace_in_stream_order(dev, rng, gate):
    s, other = dev.stream(), dev.stream()
    a = rng.standard_normal((8, 5000))
    x, out = dev.tensor(a, stream=s), dev.empty((8,), "float64")
    used = []

    def execute(ws, size, ex, st):
        used.append(ws)
        ops.reduce_sum(ws, size, ex, st)

    ev = gate(s)
    try:
        invoke_two_phase(lambda: ops.reduce_sum.get_workspace_size(x, dims=(1,), out=out), execute, s, sync=False)
        assert not s.query()
        taken = dev.malloc(used[0].size, stream=other)
        assert taken.address != used[0].address  # still in use by s's pending reduction
        taken.free()
    finally:
        ev.set()
    np.testing.assert_allclose(out.numpy(), a.sum(1), rtol=1e-12)


def test_planned_call_repeats_phase2_and_releases_on_exit(dev, stream, rng):
    a, x, out = _reduce_inputs(dev, stream, rng)
    stream.synchronize()
    before = dev.pool.stats()["allocated_bytes"]
    with PlannedCall(ops.reduce_sum, stream, x, dims=(1,), out=out) as call:
        assert dev.pool.stats()["allocated_bytes"] > before
        call()
        call()
        ex = call.executor
        stream.synchronize()  # launches are counted as the tasks run
        assert ex.launches == 2 and ex.state is ExecState.READY
    assert ex.state is ExecState.DESTROYED and call.workspace is None
    assert dev.pool.stats()["allocated_bytes"] == before
    np.testing.assert_allclose(out.numpy(), a.sum(1), rtol=1e-12)
    call.close()  # idempotent


def test_planned_call_releases_on_exceptions(dev, stream, rng):
    _, x, out = _reduce_inputs(dev, stream, rng)
    stream.synchronize()
    before = dev.pool.stats()["allocated_bytes"]
    with pytest.raises(RuntimeError, match="user code"):
        with PlannedCall(ops.reduce_sum, stream, x, dims=(1,), out=out) as call:
            call()
            raise RuntimeError("user code")
    assert call.executor.state is ExecState.DESTROYED
    assert dev.pool.stats()["allocated_bytes"] == before
    assert stream.query()  # exit synchronized before freeing


def test_planned_call_releases_when_the_stream_reports_a_failure(dev, stream, rng):
    _, x, out = _reduce_inputs(dev, stream, rng)
    stream.synchronize()
    before = dev.pool.stats()["allocated_bytes"]
    with pytest.raises(twophase.KernelError):
        with PlannedCall(ops.reduce_sum, stream, x, dims=(1,), out=out) as call:
            call.executor._launch = lambda _: 1 / 0
            call()
    assert call.executor.state is ExecState.DESTROYED
    assert dev.pool.stats()["allocated_bytes"] == before


def test_planned_call_phase1_errors_leave_nothing_allocated(dev, stream):
    before = dev.pool.stats()["alloc_count"]
    with pytest.raises(twophase.ParamError, match="reduce_sum"):
        PlannedCall(ops.reduce_sum, stream, TensorDesc((2, 3)), dims=(5,))
    assert dev.pool.stats()["alloc_count"] == before


def test_planned_call_reports_pending_work_until_it_completes(dev, stream, rng, gate):
    _, x, out = _reduce_inputs(dev, stream, rng)
    stream.synchronize()
    with PlannedCall(ops.reduce_sum, stream, x, dims=(1,), out=out) as call:
        ev = gate(stream)
        try:
            call()
            assert call.pending()
        finally:
            ev.set()
        stream.synchronize()
        assert not call.pending()
