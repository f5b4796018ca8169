"""The classic traps of the two-phase contract, one test each, named for the trap."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import twophase
from twophase import ExecState, TensorDesc, ops
from twophase.runtime.memory import MemoryPool


def test_reading_output_before_synchronize_is_not_guaranteed(dev, stream, gate, rng):
    a = rng.standard_normal((16, 32)).astype(np.float32)
    x, out = dev.tensor(a, stream=stream), dev.empty((16, 32))
    stream.synchronize()
    out.view()[...] = -1.0
    size, ex = ops.softmax.get_workspace_size(x, out=out)
    ev = gate(stream)
    try:
        ops.softmax(None, size, ex, stream)  # returns at once: the work is only enqueued
        assert (out.view() == -1.0).all()  # a raw read now sees the old contents
    finally:
        ev.set()
    stream.synchronize()
    e = np.exp(a.astype(np.float64) - a.max(1, keepdims=True))
    np.testing.assert_allclose(out.view(), e / e.sum(1, keepdims=True), rtol=2e-6)


def test_reusing_a_single_use_executor_raises(dev, stream):
    x = dev.tensor(np.ones(3, np.float32), stream=stream)
    size, ex = ops.add.get_workspace_size(x, x, out=dev.empty((3,)))
    ops.add(None, size, ex, stream)
    with pytest.raises(twophase.InvalidStateError, match="set_repeatable"):
        ops.add(None, size, ex, stream)
    stream.synchronize()


def test_destroying_a_consumed_executor_is_a_double_free(dev, stream):
    x = dev.tensor(np.ones(3, np.float32), stream=stream)
    size, ex = ops.add.get_workspace_size(x, x, out=dev.empty((3,)))
    ops.add(None, size, ex, stream)
    with pytest.raises(twophase.InvalidStateError, match="double free"):
        ex.destroy()
    stream.synchronize()


def test_workspace_size_from_another_plan_is_rejected(dev, stream, rng):
    small, _ = ops.reduce_sum.get_workspace_size(TensorDesc((2, 5000)), dims=(1,))
    x = dev.tensor(rng.standard_normal((200, 5000)), stream=stream)
    size, ex = ops.reduce_sum.get_workspace_size(x, dims=(1,), out=dev.empty((200,), "float64"))
    assert small < size
    ws = dev.malloc(small)
    with pytest.raises(twophase.WorkspaceTooSmallError):
        ops.reduce_sum(ws, small, ex, stream)
    assert ex.state is ExecState.READY
    ws.free()
    ex.destroy()


def test_zero_workspace_still_accepts_a_minimal_block(dev, stream):
    x = dev.tensor(np.arange(4, dtype=np.float32), stream=stream)
    out = dev.empty((4,))
    size, ex = ops.add.get_workspace_size(x, x, out=out)
    assert size == 0
    ws = dev.malloc(size)
    assert ws.size > 0
    ops.add(ws, size, ex, stream)
    ws.free(stream)
    np.testing.assert_array_equal(out.numpy(), [0, 2, 4, 6])


def test_rebinding_to_another_shape_needs_a_new_phase1(dev, stream):
    x = dev.tensor(np.ones((2, 3), np.float32), stream=stream)
    _, ex = ops.softmax.get_workspace_size(x, out=dev.empty((2, 3)))
    with pytest.raises(twophase.ParamError, match="plan again"):
        ex.set_input(0, dev.tensor(np.ones((2, 4), np.float32), stream=stream))
    ex.destroy()


def test_set_repeatable_after_the_first_launch_is_too_late(dev, stream):
    x = dev.tensor(np.ones(3, np.float32), stream=stream)
    size, ex = ops.add.get_workspace_size(x, x, out=dev.empty((3,)))
    ops.add(None, size, ex, stream)
    with pytest.raises(twophase.InvalidStateError):
        ex.set_repeatable()
    stream.synchronize()


def test_executor_shared_with_another_thread_is_refused(dev, stream):
    x = dev.tensor(np.ones(3, np.float32), stream=stream)
    size, ex = ops.add.get_workspace_size(x, x, out=dev.empty((3,)))
    errors = []
    t = threading.Thread(
        target=lambda: errors.append(pytest.raises(twophase.InvalidStateError, ops.add, None, size, ex, stream))
    )
    t.start()
    t.join()
    assert len(errors) == 1 and ex.state is ExecState.READY
    ex.destroy()


def test_a_block_reused_in_its_streams_order_then_freed_without_a_stream_still_waits(dev, gate):
    """``ws.free(stream)`` lets the same stream reuse the memory at once, in order; freed again without a stream,
    the pool keeps it from other streams until the pending task it was reused after has run (the pool knows that
    task: it let another stream take the memory, as if the caller's claim that it was idle were true).

    On a private pool over the device's memory: in the device's own pool, an 8 KiB block another test freed on a
    stream that has since gone idle is an equally good fit, and which one comes back depended on timing."""
    pool = MemoryPool(dev._reserve, dev._release, dev._segment_view, name="footgun pool")
    s, other = dev.stream(), dev.stream()
    ev = gate(s)
    try:
        ws = pool.malloc(8192, stream=s)
        addr = ws.address
        s.launch_callback(lambda: None)
        ws.free(s)
        safe = pool.malloc(8192, stream=other)
        assert safe.address != addr
        again = pool.malloc(8192, stream=s)  # same stream: in order, reusable at once
        assert again.address == addr
        again.free()  # no stream: the task it was reused after is still pending on s
        kept = pool.malloc(8192, stream=other)
        assert kept.address != addr
        for b in (safe, kept):
            b.free()
    finally:
        ev.set()
    s.synchronize()
    pool.empty_cache()


def test_host_array_may_be_reused_right_after_copy_in(dev, stream, gate):
    a = np.arange(6, dtype=np.float32)
    ev = gate(stream)
    try:
        t = dev.tensor(a, stream=stream)  # the copy is still queued
        a[:] = -1
    finally:
        ev.set()
    np.testing.assert_array_equal(t.numpy(), np.arange(6, dtype=np.float32))


def test_kernel_errors_surface_at_sync_not_at_launch(dev, stream):
    x = dev.tensor(np.ones(3, np.float32), stream=stream)
    size, ex = ops.add.get_workspace_size(x, x, out=dev.empty((3,)))
    ex._launch = lambda _: 1 / 0
    ops.add(None, size, ex, stream)  # no error here
    with pytest.raises(twophase.KernelError, match=f"executor #{ex.id}"):
        stream.synchronize()


def test_executor_left_ready_leaks_unless_destroyed_or_used_with_with(dev, stream):
    with ops.softmax.get_workspace_size(TensorDesc((2, 3)))[1] as ex:
        assert ex.state is ExecState.READY
    assert ex.state is ExecState.DESTROYED
    with pytest.raises(twophase.InvalidStateError):
        ex.destroy()


def test_out_aliasing_an_input_is_computed_from_the_old_values(dev, stream, rng):
    a, b = rng.standard_normal(8), rng.standard_normal(8)
    x, y = dev.tensor(a, stream=stream), dev.tensor(b, stream=stream)
    size, ex = ops.add.get_workspace_size(x, y, out=y, alpha=-2)
    ops.add(None, size, ex, stream)
    np.testing.assert_allclose(y.numpy(), a - 2 * b, rtol=1e-12)
