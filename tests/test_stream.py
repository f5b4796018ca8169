"""Streams: order, query, events, cross-stream waits, callbacks, errors at sync, launch blocking, NULL device."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest
from threads import ran_without_hanging

import twophase
from twophase import Event, Stream, TensorDesc, ops


def test_stream_and_event_constructors_name_the_factory():
    with pytest.raises(TypeError, match="dev.stream"):
        Stream()
    with pytest.raises(TypeError, match="record_event"):
        Event()


def test_tasks_run_in_enqueue_order_on_the_worker_thread(stream):
    seen = []
    for i in range(50):
        stream.launch_callback(lambda i=i: seen.append((i, threading.get_ident())))
    stream.synchronize()
    assert [i for i, _ in seen] == list(range(50))
    assert {tid for _, tid in seen} != {threading.get_ident()}


def test_query_is_false_while_work_is_pending_and_true_after(stream, gate):
    assert stream.query()
    ev = gate(stream)
    try:
        assert not stream.query()
    finally:
        ev.set()
    stream.synchronize()
    assert stream.query()


def test_event_completes_after_the_work_before_it(stream, gate):
    ev = gate(stream)
    try:
        done = []
        stream.launch_callback(lambda: done.append(1))
        e = stream.record_event()
        assert not e.query()
    finally:
        ev.set()
    e.synchronize()
    assert e.query() and done == [1]


class _CountingCondition(threading.Condition):
    """A Condition that counts its notify_all calls: how often the worker wakes the threads waiting on a stream."""

    def __init__(self) -> None:
        super().__init__(threading.Lock())
        self.notified = 0

    def notify_all(self) -> None:
        self.notified += 1
        super().notify_all()


def _waiting_on(s, wait, waiters=1):
    """Run ``wait`` on a thread once nothing is pending on ``s``'s worker yet; return the thread once it waits."""
    t = threading.Thread(target=wait, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while len(s._q.waiting) < waiters and time.monotonic() < deadline:
        time.sleep(0.001)
    assert len(s._q.waiting) == waiters, "the waiting thread never registered"
    return t


def test_the_worker_wakes_a_waiting_host_thread_once_at_the_awaited_task(stream, gate):
    # A wake per finished task costs a blocked thread's wake-up (tens of microseconds, a core) on every launch of
    # a loop that ends in one synchronize: the waiter is woken only by the task it waits for.
    q = stream._q
    counting = q.cond = _CountingCondition()
    first = gate(stream)
    done = []
    for i in range(20):
        stream.launch_callback(lambda i=i: done.append(i))
    ev = stream.record_event()
    second = gate(stream)
    for i in range(20, 30):
        stream.launch_callback(lambda i=i: done.append(i))
    waiter = _waiting_on(stream, ev.synchronize)
    first.set()
    waiter.join(10)
    assert not waiter.is_alive() and done == list(range(20)) and ev.query()
    assert counting.notified == 1, "woken by tasks before the event"
    syncer = _waiting_on(stream, stream.synchronize)
    second.set()
    syncer.join(10)
    assert not syncer.is_alive() and done == list(range(30))
    assert counting.notified == 2, "woken by tasks before the last one"
    assert q.waiting == []


def test_elapsed_time_between_completed_events(stream):
    a = stream.record_event()
    stream.launch_callback(lambda: sum(range(1000)))
    b = stream.record_event()
    b.synchronize()
    assert a.elapsed_time(b) >= 0.0


def test_elapsed_time_refuses_pending_or_untimed_events(stream, gate):
    a = stream.record_event(timing=False)
    stream.synchronize()
    b = stream.record_event()
    stream.synchronize()
    with pytest.raises(twophase.InvalidStateError, match="without timing"):
        a.elapsed_time(b)
    ev = gate(stream)
    try:
        c = stream.record_event()
        with pytest.raises(twophase.InvalidStateError, match="not completed"):
            b.elapsed_time(c)
    finally:
        ev.set()
    with pytest.raises(twophase.ParamError):
        b.elapsed_time("later")


def test_wait_event_orders_work_across_streams(dev, gate):
    s1, s2 = dev.stream(), dev.stream()
    order = []
    ev = gate(s1)
    try:
        s1.launch_callback(lambda: order.append("s1"))
        e = s1.record_event()
        s2.wait_event(e)
        s2.launch_callback(lambda: order.append("s2"))
        assert not s2.query()  # s2 waits for s1, which is blocked
        assert order == []
    finally:
        ev.set()
    s2.synchronize()
    assert order == ["s1", "s2"]
    with pytest.raises(twophase.ParamError, match="wait_event"):
        s2.wait_event(None)


def test_a_stream_waiting_on_a_failed_one_takes_on_its_failure(dev):
    """Work ordered after a failed task by wait_event reads what that task (or those dropped after it) should have
    written: the waiting stream's sync raises it too (it computed on unwritten memory and synced clean). An event
    recorded before the failure passes nothing on; the failed stream keeps its own error; both stay usable."""
    a, b = dev.stream(), dev.stream()
    w = dev.tensor(np.ones((4, 2), np.float32), stream=a)
    bad = dev.tensor(np.array([0, 99], np.int64), stream=a)
    x = dev.tensor(np.full(8, 5.0, np.float32), stream=a)
    before = a.record_event()
    twophase.embedding(w, bad, stream=a).free(a)  # fails on a's worker
    y = twophase.add(x, 1.0, stream=a)  # dropped: y is never written
    b.wait_event(before)
    b.synchronize()  # ordered before the failure: nothing to take on
    b.wait_event(a.record_event())
    z = twophase.mul(y, 2.0, stream=b)
    with pytest.raises(twophase.KernelError, match=r"embedding.*failed on stream .*which this stream waited for") as e:
        b.synchronize()
    assert e.value.op == "embedding" and isinstance(e.value.__cause__, twophase.ParamError)
    assert "a wait_event failed on stream" in str(e.value)
    with pytest.raises(twophase.ParamError, match="indices"):
        a.synchronize()
    again = twophase.mul(x, 2.0, stream=b)
    np.testing.assert_array_equal(again.numpy(), np.full(8, 10.0, np.float32))
    for t in (w, bad, x, y, z, again):
        t.free()


def test_a_stream_waiting_on_a_failed_one_takes_it_on_after_the_failed_stream_synced(dev, gate):
    """The failed stream's own synchronize raises and clears its failure; a stream whose wait for an event after
    that failure runs later still takes it on (the event kept it), rather than running on unwritten memory."""
    a, b = dev.stream(), dev.stream()
    opened = gate(b)  # b's wait task runs after a's sync
    a.launch_callback(lambda: 1 / 0)
    ev = a.record_event()
    b.wait_event(ev)
    ran: list[str] = []
    b.launch_callback(lambda: ran.append("consumer"))
    with pytest.raises(twophase.KernelError, match="ZeroDivisionError"):
        a.synchronize()
    opened.set()
    with pytest.raises(twophase.KernelError, match="which this stream waited for"):
        b.synchronize()
    assert ran == []  # dropped after the failed wait
    b.wait_event(a.record_event())  # an event after the reported failure passes nothing on
    b.launch_callback(lambda: ran.append("later"))
    b.synchronize()
    assert ran == ["later"]


def test_launch_callback_runs_after_prior_work_and_rejects_non_callables(dev, stream, rng):
    a = rng.standard_normal(1000)
    x = dev.tensor(a, stream=stream)
    got = []
    stream.launch_callback(lambda: got.append(x.view().sum()))  # the copy-in has completed when it runs
    stream.synchronize()
    assert got == [pytest.approx(a.sum())]
    with pytest.raises(twophase.ParamError, match="fn"):
        stream.launch_callback(42)


def _failing_add(dev, stream):
    x = dev.tensor(np.ones(4, np.float32), stream=stream)
    _, ex = ops.add.get_workspace_size(x, x, out=dev.empty((4,)))

    def launch(_):
        raise FloatingPointError("kernel blew up")

    ex._launch = launch
    return ex


def test_task_failure_is_raised_at_next_sync_naming_op_and_executor_with_dropped_count(dev, stream):
    ex = _failing_add(dev, stream)
    ran = []
    ops.add(None, 0, ex, stream)  # enqueue does not raise
    for _ in range(3):
        stream.launch_callback(lambda: ran.append(1))
    with pytest.raises(twophase.KernelError) as info:
        stream.synchronize()
    msg = str(info.value)
    assert "op 'add'" in msg and f"executor #{ex.id}" in msg and "kernel blew up" in msg
    assert "3 later task(s) were dropped" in msg
    assert info.value.op == "add" and isinstance(info.value.__cause__, FloatingPointError)
    assert ran == []


def test_stream_is_usable_after_a_reported_failure(stream):
    stream.launch_callback(lambda: 1 / 0)
    with pytest.raises(twophase.KernelError, match="ZeroDivisionError"):
        stream.synchronize()
    ran = []
    stream.launch_callback(lambda: ran.append(1))
    stream.synchronize()  # does not raise again
    assert ran == [1]


def test_event_synchronize_raises_a_failure_before_the_event(stream):
    stream.launch_callback(lambda: 1 / 0)
    e = stream.record_event()
    with pytest.raises(twophase.KernelError):
        e.synchronize()
    assert e.query()


def test_tensor_numpy_raises_the_failure_of_work_on_it(dev, stream):
    ex = _failing_add(dev, stream)
    out = ex.outputs[0]
    ops.add(None, 0, ex, stream)
    with pytest.raises(twophase.KernelError, match="op 'add'"):
        out.numpy()


def test_launch_blocking_runs_tasks_inline_on_the_caller_thread(dev):
    s = dev.stream()
    twophase.set_launch_blocking(True)
    try:
        assert s.blocking
        where = []
        s.launch_callback(lambda: where.append(threading.get_ident()))
        assert where == [threading.get_ident()]  # ran before launch_callback returned
        fresh = dev.stream()
        fresh.launch_callback(lambda: where.append(threading.get_ident()))
        assert where[-1] == threading.get_ident()
        with pytest.raises(twophase.KernelError, match="ZeroDivisionError"):
            s.launch_callback(lambda: 1 / 0)  # the failure surfaces at once
    finally:
        twophase.set_launch_blocking(False)
    assert not s.blocking and not fresh.blocking
    where.clear()
    fresh.launch_callback(lambda: where.append(threading.get_ident()))
    fresh.synchronize()
    assert where and where[0] != threading.get_ident()


def test_a_single_use_executor_is_spent_by_a_failed_blocking_launch_and_kept_by_a_refused_one(dev):
    """Launch blocking: a launch that ran and failed spends a single-use executor, as an async launch once queued
    (it stayed READY with its gate cleared: the next phase 2 reported 'unbound operand(s) []', and set_input
    re-armed it). A stream that refuses the task (closed) leaves the executor as it was."""
    s = dev.stream()
    w = dev.tensor(np.ones((4, 2), np.float32), stream=s)
    idx = dev.tensor(np.array([0, 99], np.int64), stream=s)
    s.synchronize()
    twophase.set_launch_blocking(True)
    try:
        size, ex = ops.embedding.get_workspace_size(w, idx)
        out = dev.empty(ex.output_descs[0].shape)
        ex.set_output(0, out)
        with pytest.raises(twophase.ParamError, match="embedding"):
            ops.embedding(None, size, ex, s)
        assert ex.state is twophase.ExecState.CONSUMED
        with pytest.raises(twophase.InvalidStateError, match="consumed"):
            ops.embedding(None, size, ex, s)
        with pytest.raises(twophase.InvalidStateError):
            ex.set_input(1, idx)
    finally:
        twophase.set_launch_blocking(False)
    closed = dev.stream()
    closed.close()
    x = dev.tensor(np.ones(4, np.float32), stream=s)
    y = dev.empty((4,))
    _, ex = ops.neg.get_workspace_size(x, out=y)
    with pytest.raises(twophase.InvalidStateError, match="closed"):
        ops.neg(None, 0, ex, closed)
    assert ex.state is twophase.ExecState.READY
    ops.neg(None, 0, ex, s)  # still usable, once
    assert ex.state is twophase.ExecState.CONSUMED
    np.testing.assert_array_equal(y.numpy(), -np.ones(4, np.float32))


def test_launch_blocking_environment_variable_is_read_at_import():
    code = (
        "import threading, twophase as tp; s = tp.device('cpu').stream(); w = [];"
        "s.launch_callback(lambda: w.append(threading.get_ident()));"
        "print(s.blocking, w == [threading.get_ident()])"
    )
    env = dict(os.environ, TWOPHASE_LAUNCH_BLOCKING="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


def test_null_device_allocates_and_enqueues_but_runs_no_kernel():
    null = twophase.device("null")
    assert twophase.device("null") is null
    s = null.stream()
    before = null.pool.stats()["alloc_count"]
    x = null.tensor(np.ones((64, 64), np.float32), stream=s)
    y = null.empty((64, 64))
    assert null.pool.stats()["alloc_count"] == before + 2 and x.block.address % 512 == 0
    size, ex = ops.softmax.get_workspace_size(x, out=y)
    ex._launch = lambda _: (_ for _ in ()).throw(AssertionError("ran a kernel"))
    submitted = s._submitted
    ops.softmax(null.malloc(size), size, ex, s)
    assert s._submitted == submitted + 1
    s.synchronize()  # nothing ran, so nothing failed
    with pytest.raises(twophase.InvalidStateError, match="NULL"):
        y.numpy()


def test_null_device_phase1_plans_like_the_cpu():
    null = twophase.device("null")
    x = null.empty((4, 40000))
    size, ex = ops.softmax.get_workspace_size(x, out=null.empty((4, 40000)))
    ref_size, ref = ops.softmax.get_workspace_size(TensorDesc((4, 40000)))
    assert size == ref_size > 0 and ex.implementation == ref.implementation
    ex.destroy()
    ref.destroy()


def test_unknown_device_name_is_a_param_error():
    with pytest.raises(twophase.ParamError, match="device"):
        twophase.device("tpu")


def test_concurrent_producers_keep_each_threads_order_and_lose_no_task(stream):
    seen = []

    def producer(tag):
        for i in range(300):
            stream.launch_callback(lambda i=i: seen.append((tag, i)))

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    waiter = threading.Thread(target=stream.synchronize, daemon=True)
    waiter.start()
    waiter.join(60)  # a hang guard (a lost wake-up would block forever), not a timing check
    assert not waiter.is_alive()
    assert len(seen) == 1200
    for k in range(4):
        assert [i for tag, i in seen if tag == k] == list(range(300))


def test_a_closed_stream_takes_no_work_and_device_wide_calls_skip_it(dev):
    """A closed stream still referenced: a launch on it raises (it used to queue work no worker would run, and
    the next synchronize hung); changing a setting and synchronizing the device pass it by."""
    s = dev.stream()
    s.launch_callback(lambda: None)
    s.close()
    assert s.closed
    with pytest.raises(twophase.InvalidStateError, match="closed"):
        s.launch_callback(lambda: None)
    old = twophase.settings.num_threads
    try:
        twophase.set_num_threads(old + 1)  # enqueues the new count on every open stream's worker
    finally:
        twophase.set_num_threads(old)
    waiter = threading.Thread(target=dev.synchronize, daemon=True)
    waiter.start()
    waiter.join(60)  # a hang guard, not a timing check
    assert not waiter.is_alive()
    assert s._submitted == s._done


@pytest.mark.parametrize("mode", ["worker", "helpers", "inline"])
def test_launches_give_ieee_results_without_numpy_warnings(dev, mode):
    """Division by zero, overflow and 0 * inf in launches that call numpy: inf / NaN as IEEE says, and no
    RuntimeWarning. Warnings are errors here, so one raised on the worker, a helper thread or the caller's thread
    (launch blocking) would fail the launch, and the sync would raise it; the caller's own error state is kept."""
    import warnings

    from threads import num_threads

    n = 700_001 if mode == "helpers" else 7  # the binary kernel cuts 2^18 elements and more into parts
    a = np.tile(np.array([1.0, -1.0, 0.0, 3e38, np.inf, 2.0, 5.0], np.float32), -(-n // 7))[:n]
    b = np.tile(np.array([0.0, 0.0, 0.0, 10.0, 0.0, np.nan, 1.0], np.float32), -(-n // 7))[:n]
    s = dev.stream()
    if mode == "inline":
        twophase.set_launch_blocking(True)
    try:
        with warnings.catch_warnings(), num_threads(3):
            warnings.simplefilter("error")
            x, y = dev.tensor(a, stream=s), dev.tensor(b, stream=s)
            q, p = twophase.div(x, y, stream=s), twophase.mul(x, y, stream=s)
            s.synchronize()
            with np.errstate(all="ignore"):
                want_q, want_p = a / b, a * b
            np.testing.assert_array_equal(q.numpy(), want_q)
            np.testing.assert_array_equal(p.numpy(), want_p)
            assert np.isinf(want_q[0]) and np.isnan(want_q[2]) and np.isinf(want_p[3]) and np.isnan(want_p[4])
    finally:
        twophase.set_launch_blocking(False)
    assert np.geterr()["divide"] == "warn"  # this thread's numpy state is untouched


def test_switching_launch_blocking_leaves_a_pending_failure_for_the_next_sync(dev, stream):
    """The switch waits for every stream without raising: a failure does not stop it half-way (the setting
    changed, some streams switched) but stays for its own stream's sync."""
    others = [dev.stream() for _ in range(2)]
    stream.launch_callback(lambda: 1 / 0)
    try:
        twophase.set_launch_blocking(True)
        assert stream.blocking and all(s.blocking for s in others)
    finally:
        twophase.set_launch_blocking(False)
    assert not stream.blocking and not any(s.blocking for s in others)
    with pytest.raises(twophase.KernelError, match="ZeroDivisionError"):
        stream.synchronize()
    for s in others:
        s.close()


def test_a_failing_setting_listener_puts_the_setting_and_every_stream_back(dev, stream, monkeypatch):
    from twophase import config

    def refuse(value):
        if value:
            raise RuntimeError("refused")

    try:
        with monkeypatch.context() as m:
            m.setitem(config._listeners, "launch_blocking", [*config._listeners["launch_blocking"], refuse])
            with pytest.raises(RuntimeError, match="refused"):
                twophase.set_launch_blocking(True)  # the device's listener has switched its streams by then
            assert not twophase.settings.launch_blocking and not stream.blocking
    finally:
        twophase.set_launch_blocking(False)


def test_a_switch_to_launch_blocking_keeps_the_tasks_queued_before_it_first(dev, gate):
    """Another thread can enqueue between set_launch_blocking's drain and its switch: the task it queued is still
    on the worker when the next one runs inline, which ran first (wrong results under a toggling thread)."""
    s = dev.stream()
    order: list[int] = []
    opened = gate(s)
    s.launch_callback(lambda: order.append(1))  # queued on the worker, behind the gate
    q = s._q
    q.set_inline(True)  # what _set_blocking does once it has drained, as if the enqueue above had come after
    s._enqueue = q.enqueue
    threading.Timer(0.05, opened.set).start()
    s.launch_callback(lambda: order.append(2))  # inline: waits for task 1
    assert order == [1, 2]
    q.set_inline(False)
    s._enqueue = q.enqueue
    s.synchronize()


def test_a_switch_off_launch_blocking_keeps_a_running_inline_task_first(dev):
    """An inline task still running on one thread when launch blocking goes off: the worker runs the next task
    only after it."""
    s = dev.stream()
    q = s._q
    q.set_inline(True)
    s._enqueue = q.enqueue
    order: list[int] = []
    started, release = threading.Event(), threading.Event()

    def slow() -> None:
        started.set()
        release.wait(5)
        order.append(1)

    t = threading.Thread(target=lambda: s.launch_callback(slow))
    t.start()
    started.wait(5)
    q.set_inline(False)
    s._enqueue = q.enqueue
    s.launch_callback(lambda: order.append(2))  # to the worker, while task 1 runs inline on t
    threading.Timer(0.05, release.set).start()
    t.join(5)
    deadline = time.monotonic() + 5  # bounded: the broken order also miscounted done, and a sync never returned
    while q.done < q.submitted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert order == [1, 2] and q.done == q.submitted


def test_a_nested_inline_task_does_not_complete_the_task_that_enqueued_it(dev):
    """Under launch blocking a task enqueuing on its own stream runs that task nested; when the nested one ends the
    outer is still running: query and synchronize on other threads must not see the stream done."""
    s = dev.stream()
    q = s._q
    q.set_inline(True)
    s._enqueue = q.enqueue
    inside, release, finished = threading.Event(), threading.Event(), []

    def outer() -> None:
        s.launch_callback(lambda: None)  # nested: runs inline within this task
        inside.set()
        release.wait(5)
        finished.append(1)

    t = threading.Thread(target=lambda: s.launch_callback(outer))
    t.start()
    try:
        assert inside.wait(5)
        assert not s.query() and q.done == 0  # both tasks published only once the outer one ends
        synced: list[bool] = []
        waiter = threading.Thread(target=lambda: (s.synchronize(), synced.append(bool(finished))))
        waiter.start()
        time.sleep(0.05)
        assert synced == []
    finally:
        release.set()
        t.join(5)
    waiter.join(5)
    assert synced == [True] and q.done == q.submitted == 2
    q.set_inline(False)
    s._enqueue = q.enqueue
    s.close()


def test_a_task_on_the_worker_enqueuing_on_its_stream_after_a_switch_to_launch_blocking(dev, gate):
    """A callback running on the worker when launch blocking goes on, enqueuing on its own stream: the task is
    queued behind it, as before the switch (run inline, it waited for the callback running it: a deadlock)."""
    s = dev.stream()
    opened = gate(s)
    order: list[str] = []

    def cb() -> None:
        s.launch_callback(lambda: order.append("inner"))
        order.append("outer")

    s.launch_callback(cb)
    q = s._q
    try:
        q.set_inline(True)  # what set_launch_blocking does (its drain would wait for the gate)
        s._enqueue = q.enqueue
        opened.set()
        deadline = time.monotonic() + 5
        while q.done < q.submitted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert order == ["outer", "inner"] and q.done == q.submitted == 3
    finally:
        q.set_inline(False)
        s._enqueue = q.enqueue
    s.close()


def test_one_op_launched_from_many_threads_at_once(dev):
    """Every thread's launches share the op's memo of built launches: an eviction by one thread between another's
    lookup and its LRU move was a KeyError out of the one-shot call."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            st = dev.stream()
            a = dev.tensor(np.full((4, 16), float(k), np.float32), stream=st)
            ys = [dev.empty((4, 16), stream=st) for _ in range(3)]
            for i in range(150):
                twophase.add(a, a, out=ys[i % 3], stream=st)
            st.synchronize()
            assert all((y.numpy() == 2 * k).all() for y in ys)
        except BaseException as e:  # noqa: BLE001  (asserted below)
            errors.append(e)

    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:3]


@pytest.mark.parametrize("spin_us", [0, 500])
def test_a_synchronize_after_each_launch_returns_after_its_task_and_raises_its_failure(stream, spin_us):
    """launch + synchronize in a loop, with the worker and the host spinning (500: the default) or blocking at
    once (0): every synchronize returns after its task ran, and a failing task is raised by the synchronize
    after it, whichever path the host took."""
    old = twophase.settings.helper_spin_us
    twophase.set_helper_spin(spin_us)
    try:
        seen: list[int] = []
        for i in range(300):
            if i % 50 == 49:
                stream.launch_callback(lambda: 1 / 0)
                with pytest.raises(twophase.KernelError, match="ZeroDivisionError"):
                    stream.synchronize()
                continue
            stream.launch_callback(lambda i=i: (time.sleep(0.0002 * (i % 3)), seen.append(i)))
            stream.synchronize()
            assert seen[-1] == i
        q = stream._q
        assert q.finished[0] <= q.done == q.submitted  # what the worker published never runs ahead of what ran
    finally:
        twophase.set_helper_spin(old)


def test_a_stream_closed_while_its_worker_spins_for_work_stops_its_worker(dev):
    """Closing right after a synchronize, while the worker spins for its next task: the thread ends."""
    s = dev.stream()
    s.launch_callback(lambda: None)
    s.synchronize()
    worker = s._q.thread
    s.close()
    worker.join(60)  # a hang guard, not a timing check
    assert not worker.is_alive()


def test_a_worker_does_not_spin_after_a_launch_on_helper_threads(dev, monkeypatch):
    """After a launch whose parts ran on helpers (which spin for the next launch themselves), the worker blocks
    at once instead of spinning for its next task, so the host thread keeps a core; after one that did not, it
    spins for the configured time."""
    from twophase.runtime import fanout
    from twophase.runtime import stream as stream_mod

    spins: dict[int, float] = {}  # tasks done when the worker ran out of tasks: how long it spun
    real = stream_mod.count_and_wait
    s = dev.stream()
    q = s._q

    gates = []

    def record(slots, slot, count, counter, value, us, *gate):
        if slots is q.finished:
            spins[q.done] = us
            gates.extend(gate)
        return real(slots, slot, count, counter, value, us, *gate)

    monkeypatch.setattr(stream_mod, "count_and_wait", record)
    first = q.submitted + 1
    try:
        s.launch_callback(lambda: fanout.run_parts([lambda: None, lambda: None]))
        s.synchronize()
        s.launch_callback(lambda: None)
        s.synchronize()
    finally:
        s.close()
    assert spins[first] == 0.0  # after the fan-out: blocked at once
    assert spins[first + 1] == stream_mod._spin_us() > 0  # after a plain task: spun
    assert gates and all(g is q.gate for g in gates)  # the gate a synchronizing host thread opens (test below)


def test_a_synchronizing_host_thread_opens_the_workers_gate_at_the_tasks_posted(stream, gate):
    """A host thread that spins for a task (no GIL held) sets the stream's gate to the tasks posted so far: a
    worker that saw a new task waits only until then for the GIL (``spin.count_and_wait``)."""
    q = stream._q
    stream.launch_callback(lambda: None)
    stream.synchronize()  # the worker started
    opened = gate(stream)
    for _ in range(3):
        stream.launch_callback(lambda: None)
    q.gate[0] = -1  # no count posted is negative

    def open_once_blocked() -> None:  # the host spins before it blocks: once it waits, it has spun
        deadline = time.monotonic() + 30
        while not q.waiting and time.monotonic() < deadline:
            time.sleep(0.0005)
        opened.set()

    threading.Thread(target=open_once_blocked, daemon=True).start()
    stream.synchronize()
    assert q.gate[0] == q.posted[0] >= 0


def test_a_task_listener_removed_while_the_listeners_run_skips_no_other(stream):
    """A listener that removes itself (a profiler or sanitizer turned off as a task ends) left the next one
    uncalled for that task: the worker iterated the list being changed."""
    from twophase import hooks

    seen: list[str] = []

    def once(*_: object) -> None:
        seen.append("once")
        hooks.remove_task_listener(once)

    def always(*_: object) -> None:
        seen.append("always")

    hooks.add_task_listener(once)
    hooks.add_task_listener(always)
    try:
        stream.launch_callback(lambda: None)
        stream.synchronize()
    finally:
        hooks.remove_task_listener(always)
    assert seen == ["once", "always"]


def test_wait_event_takes_on_the_failure_before_the_event_even_when_the_stream_failed_again_after_it() -> None:
    dev = twophase.device("cpu")
    a, b = dev.stream(), dev.stream()
    a.launch_callback(lambda: 1 / 0)  # fails before the event
    ev = a.record_event()
    with pytest.raises(twophase.KernelError):
        a.synchronize()  # raises and clears a's own failure; the event keeps it
    a.launch_callback(lambda: [][1])  # a fails again, after the event
    a._q.drain()
    ran: list[int] = []
    b.wait_event(ev)
    b.launch_callback(lambda: ran.append(1))
    with pytest.raises(twophase.KernelError, match="ZeroDivisionError|division"):
        b.synchronize()
    assert ran == []  # the work after the wait read memory the failed task never wrote: dropped
    with pytest.raises(twophase.KernelError):
        a.synchronize()
    a.close()
    b.close()


def test_close_raises_a_pending_failure_and_closes_the_stream_all_the_same() -> None:
    s = twophase.device("cpu").stream()
    s.launch_callback(lambda: 1 / 0)
    with pytest.raises(twophase.KernelError):
        s.close()
    assert s.closed
    s._q.thread.join(5)  # the worker stops on its own once told to
    assert not s._q.thread.is_alive()
    with pytest.raises(twophase.InvalidStateError, match="closed"):
        s.launch_callback(lambda: None)


def _own_stream_wait(call, dev, s):
    """What a callback on ``s`` calls to wait for ``s``'s own work (``call`` names the public entry point)."""
    if call == "Stream.synchronize":
        s.synchronize()
    elif call == "Device.synchronize":
        dev.synchronize()
    elif call == "Stream.close":
        s.close()
    elif call == "Event.synchronize":
        s.record_event().synchronize()
    else:
        dev.tensor(np.ones(3, np.float32), stream=s).numpy()  # its copy-in is queued after the callback


@pytest.mark.parametrize("blocking", [False, True])
@pytest.mark.parametrize(
    "call", ["Stream.synchronize", "Device.synchronize", "Stream.close", "Event.synchronize", "Tensor.numpy"]
)
def test_a_callback_waiting_for_its_own_stream_is_refused_and_reported_at_the_next_sync(dev, call, blocking):
    """The worker waited for itself (launch blocking: the caller's thread for the inline task it runs) for ever;
    CUDA refuses such a call from a host callback (cudaErrorNotPermitted). Raised in the callback, the refusal is
    the stream's failure at the next sync (at the launch, blocking), and the stream stays open and usable."""
    s = dev.stream()
    reached, raised = [], []

    def cb():
        _own_stream_wait(call, dev, s)
        reached.append(call)

    def launch_and_sync():
        try:
            s.launch_callback(cb)
            s.synchronize()
        except twophase.InvalidStateError as e:
            raised.append(e)

    assert ran_without_hanging(s, launch_and_sync, blocking), f"{call} in a callback of its own stream hung"
    assert reached == [] and len(raised) == 1
    assert re.search(r"\(a callback\) of stream '.+': .*never return.*failed on stream", str(raised[0]))
    assert not s.closed
    s.launch_callback(lambda: reached.append("after"))
    s.synchronize()
    assert reached == ["after"]
    s.close()


@pytest.mark.parametrize("blocking", [False, True])
def test_a_callback_may_wait_for_another_stream(dev, blocking):
    s, other = dev.stream(), dev.stream()
    seen = []

    def cb():
        x = dev.tensor(np.arange(3, dtype=np.float32), stream=other)
        other.record_event().synchronize()
        other.synchronize()
        seen.append(x.numpy().tolist())

    assert ran_without_hanging(s, lambda: (s.launch_callback(cb), s.synchronize()), blocking)
    assert seen == [[0.0, 1.0, 2.0]]
    s.close()
    other.close()


def test_device_synchronize_waits_for_the_work_left_on_a_dropped_stream(dev):
    """Device.synchronize skipped a stream the caller had dropped (the device held it weakly) while its worker
    still ran the work queued on it: the caller read outputs not yet written. The stream itself still goes."""
    gate, ran, seen_at_return = threading.Event(), [], []
    s = dev.stream()
    q, ref = s._q, weakref.ref(s)
    s.launch_callback(lambda: gate.wait(30))  # stands in for longer work queued before
    s.launch_callback(lambda: ran.append(1))
    del s
    gc.collect()
    assert ref() is None  # a dropped stream with work left is not kept alive
    t = threading.Thread(target=lambda: (dev.synchronize(), seen_at_return.append(list(ran))), daemon=True)
    try:
        t.start()
        deadline = time.monotonic() + 10
        while not q.waiting and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        gate.set()
    t.join(30)  # a hang guard, not a timing check
    assert not t.is_alive() and seen_at_return == [[1]]


def test_a_dropped_stream_whose_work_has_run_is_collected_with_its_queue(dev):
    s = dev.stream()
    s.launch_callback(lambda: None)
    worker, stream_ref, queue_ref = s._q.thread, weakref.ref(s), weakref.ref(s._q)
    del s
    gc.collect()
    dev.synchronize()
    worker.join(30)  # the worker stops once its stream is gone and its work done
    gc.collect()
    assert not worker.is_alive() and stream_ref() is None and queue_ref() is None


def _fail() -> None:
    raise ValueError("boom")


def test_device_synchronize_raises_a_failure_left_on_a_stream_the_caller_dropped(dev):
    """A failed callback on a stream dropped unsynced (its worker done and its queue collected) was lost: the device's
    sync now raises it once, as its stream's sync would have, with a note saying why it surfaces there."""
    s = dev.stream()
    s.launch_callback(_fail)
    s.launch_callback(lambda: None)  # dropped after the failure
    worker, stream_ref = s._q.thread, weakref.ref(s)
    del s
    gc.collect()
    worker.join(30)
    assert not worker.is_alive() and stream_ref() is None  # the stream is gone, its worker stopped
    with pytest.raises(twophase.KernelError, match="_fail.*ValueError: boom.*1 later task") as info:
        dev.synchronize()
    assert "dropped by its caller" in str(info.value)
    dev.synchronize()  # raised once


def test_device_synchronize_waits_then_raises_failures_of_dropped_streams_still_running(dev):
    """Two dropped streams, one still running its work when the device's sync starts: both are waited for; the first
    failure is raised, the other named in its notes."""
    gate = threading.Event()
    a, b = dev.stream(), dev.stream()
    a.launch_callback(_fail)
    b.launch_callback(lambda: gate.wait(30))
    b.launch_callback(lambda: 1 / 0)
    del a, b
    gc.collect()
    threading.Timer(0.05, gate.set).start()
    with pytest.raises(twophase.KernelError) as info:
        dev.synchronize()
    text = str(info.value)
    assert "ValueError: boom" in text and "ZeroDivisionError" in text, text
    assert gate.is_set()
    dev.synchronize()


def test_a_null_device_callback_failure_is_reported_at_the_next_sync():
    """On the NULL device a raising callback propagated its raw exception out of launch_callback."""
    s = twophase.device("null").stream()
    s.launch_callback(lambda: 1 / 0)
    ran = []
    s.launch_callback(lambda: ran.append(1))  # dropped after the failure, as on any stream
    with pytest.raises(twophase.KernelError, match="callback .* failed on stream .*ZeroDivisionError.*1 later task"):
        s.synchronize()
    s.launch_callback(lambda: ran.append(2))
    s.synchronize()
    assert ran == [2]
