"""Planted faults: one deliberately buggy caller or kernel per sanitizer check, each detected with a clear message."""

from __future__ import annotations

import ctypes
import gc
import threading
import time
import warnings
from typing import Any

import numpy as np
import pytest

import twophase as tp
from twophase import sanitizer
from twophase.op import Op, OpDef, Plan
from twophase.tensor import TensorDesc


@pytest.fixture
def san():
    """The sanitizer on for the test; the test itself must leave no leak behind."""
    with sanitizer.sanitize():
        sanitizer.reset()
        token = sanitizer.mark()
        yield sanitizer
        tp.device("cpu").synchronize()
        gc.collect()
        leaks = sanitizer.report(since=token, warn=False)
    sanitizer.reset()
    assert leaks == [], "\n".join(map(str, leaks))


@pytest.fixture
def s(san):
    st = tp.device("cpu").stream()
    yield st
    try:
        st.synchronize()
    except tp.TwoPhaseError:
        pass


def _scribbler(ws_bytes: int, past_end: int = 0, before: int = 0) -> Op:
    """A buggy op (not registered): its kernel copies x to out and writes ``past_end`` bytes past its workspace
    (through the raw address, as a C kernel would) and ``before`` bytes before it."""

    def infer(ins: Any, attrs: Any) -> Any:
        return (ins[0],)

    def select(ins: Any, outs: Any, attrs: Any, limit: Any) -> Plan:
        return Plan("scribble", None, ws_bytes)

    def build(plan: Plan, attrs: Any, ins: Any, outs: Any) -> Any:
        x, out = ins[0], outs[0]

        def launch(ws: Any) -> None:
            out[...] = x
            addr = ws.ctypes.data
            if past_end:
                ctypes.memset(addr + ws_bytes, 0x11, past_end)
            if before:
                ctypes.memset(addr - before, 0x22, before)

        return launch

    return Op(
        OpDef(name="scribble", inputs=("x",), infer=infer, select=select, kernels={"cpu": build}, reference=lambda x: x)
    )


def _run(op: Op, x: tp.Tensor, s: tp.Stream) -> tp.Tensor:
    size, ex = op.get_workspace_size(x)
    y = x.device.empty_like(ex.output_descs[0], s)
    ex.set_output(0, y)
    ws = x.device.malloc(size, stream=s)
    op(ws, size, ex, s)
    ws.free(s)
    return y


# ---- 1. guard zones
def test_kernel_writing_past_its_workspace_raises_at_next_sync_naming_op_and_bytes(s):
    dev = tp.device("cpu")
    x = dev.tensor(np.ones(8, np.float32), stream=s)
    y = _run(_scribbler(100, past_end=13), x, s)
    with pytest.raises(sanitizer.GuardError) as e:
        s.synchronize()
    msg = str(e.value)
    assert "13 byte(s) past the end" in msg and "workspace" in msg
    assert "op 'scribble'" in msg and "implementation 'scribble'" in msg and "executor #" in msg
    assert e.value.status == tp.Status.ERR_RUNTIME_SANITIZER
    s.synchronize()  # the stream works again
    for t in (x, y):
        t.free(s)


def test_kernel_writing_before_its_workspace_is_reported(s):
    dev = tp.device("cpu")
    x = dev.tensor(np.ones(4, np.float32), stream=s)
    y = _run(_scribbler(64, before=5), x, s)
    with pytest.raises(sanitizer.GuardError, match="5 byte\\(s\\) before the start"):
        s.synchronize()
    x.free(s)
    y.free(s)


def test_kernel_within_its_workspace_is_not_reported(s):
    dev = tp.device("cpu")
    x = dev.tensor(np.arange(5, dtype=np.float32), stream=s)
    y = _run(_scribbler(64), x, s)
    np.testing.assert_array_equal(y.numpy(), np.arange(5))
    x.free(s)
    y.free(s)


# ---- 2. poisoned fresh memory
def test_fresh_float_tensor_is_nan_and_fresh_workspace_is_0xcd(san):
    dev = tp.device("cpu")
    t = dev.empty((3, 5), tp.DType.float32)
    assert np.isnan(t.numpy()).all()
    i = dev.empty((4,), tp.DType.int32)
    assert (i.numpy().view(np.uint8) == 0xCD).all()
    ws = dev.malloc(100)
    assert (ws.data == 0xCD).all() and ws.size == 100
    for b in (t, i, ws):
        b.free()


def test_kernel_that_reads_its_output_before_writing_it_gives_nan(s):
    def build(plan: Plan, attrs: Any, ins: Any, outs: Any) -> Any:
        x, out = ins[0], outs[0]
        return lambda ws: np.add(out, x, out=out)  # bug: accumulates into uninitialised memory

    op = Op(
        OpDef(
            name="accumulate",
            inputs=("x",),
            infer=lambda ins, a: (ins[0],),
            select=lambda *a: Plan("acc", None, 0),
            kernels={"cpu": build},
        )
    )
    dev = tp.device("cpu")
    x = dev.tensor(np.ones(6, np.float32), stream=s)
    y = _run(op, x, s)
    assert np.isnan(y.numpy()).all()
    x.free(s)
    y.free(s)


# ---- 3. size contract
def test_phase2_with_another_workspace_size_names_both_sizes_and_the_planning_site(s):
    dev = tp.device("cpu")
    x = dev.tensor(np.ones(1 << 20, np.float32), stream=s)
    size, ex = tp.ops.reduce_sum.get_workspace_size(x)
    assert size > 0
    ex._bind_many({1: dev.empty_like(ex.output_descs[0], s)})
    ws = dev.malloc(size - 4, stream=s)
    with pytest.raises(sanitizer.WorkspaceContractError) as e:
        tp.ops.reduce_sum(ws, size - 4, ex, s)
    assert f"phase 1 returned workspace size {size}" in str(e.value) and f"workspace_size {size - 4}" in str(e.value)
    assert "test_sanitizer.py" in str(e.value)  # where the executor was planned
    with pytest.raises(tp.WorkspaceTooSmallError, match=f"a workspace block of {size - 4} bytes"):
        tp.ops.reduce_sum(ws, size, ex, s)
    y = ex.outputs[0]
    ex.destroy()
    ws.free(s)
    x.free(s)
    y.free(s)


# ---- 4. use after free across streams
def test_freeing_a_workspace_another_stream_still_uses_names_both_streams_and_the_op(s, gate):
    dev = tp.device("cpu")
    other = dev.stream("other")
    x = dev.tensor(np.ones(1 << 20, np.float32), stream=other)
    size, ex = tp.ops.reduce_sum.get_workspace_size(x)
    y = dev.empty_like(ex.output_descs[0], other)
    ex.set_output(0, y)
    ws = dev.malloc(size, stream=other)
    opened = gate(other)  # keep 'other' busy: the launch is pending
    tp.ops.reduce_sum(ws, size, ex, other)
    with pytest.raises(sanitizer.UseAfterFreeError) as e:
        ws.free(s)
    msg = str(e.value)
    assert f"stream '{s.name}'" in msg and "stream 'other'" in msg and "op 'reduce_sum'" in msg
    opened.set()
    other.synchronize()
    ws.free(s)  # fine once the task completed
    x.free(s)
    y.free(s)


def test_free_ordered_by_an_event_is_not_reported(s, gate):
    dev = tp.device("cpu")
    other = dev.stream("other2")
    x = dev.tensor(np.ones(64, np.float32), stream=other)
    other.synchronize()  # (a stream-ordered free before the copy-in ran trips Tensor.view's freed check)
    opened = gate(other)
    y = tp.neg(x, stream=other)
    s.wait_event(other.record_event())
    x.free(s)  # ordered: s runs after 'other' reached the event
    opened.set()
    other.synchronize()
    s.synchronize()
    y.free(other)


def test_free_ordered_through_a_chain_of_events_is_not_reported_and_a_wait_after_the_event_orders_nothing(s, gate):
    """s waits for b's event, b had waited for a's relu: s is ordered after the relu. A wait b makes only after
    the event s waited for orders nothing for s."""
    dev = tp.device("cpu")
    a, b = dev.stream("chain a"), dev.stream("chain b")
    x = dev.tensor(np.ones(64, np.float32), stream=a)
    a.synchronize()
    opened = gate(a)
    y = tp.relu(x, stream=a)
    b.wait_event(a.record_event())
    s.wait_event(b.record_event())
    x.free(s)  # ordered through b
    z = tp.neg(y, stream=a)
    late = b.record_event()
    b.wait_event(a.record_event())  # after the event s waits for below: not an ordering of s after neg
    s.wait_event(late)
    with pytest.raises(sanitizer.UseAfterFreeError, match="op 'neg'"):
        y.free(s)
    opened.set()
    for st in (a, b, s):
        st.synchronize()
    y.free(s)
    z.free(s)


def test_the_wait_log_keeps_only_pending_waits(san, gate):
    """Two streams waiting on each other's events for good (a pipeline): the log of orderings kept every wait,
    growing by one per wait with each wait scanning it all; waits whose task has completed are dropped, and a
    free ordered by a pending wait is still not reported."""
    from twophase.sanitizer import tracking

    dev = tp.device("cpu")
    a, b = dev.stream("ping"), dev.stream("pong")
    for i in range(1000):
        b.wait_event(a.record_event())
        a.wait_event(b.record_event())
        if i % 50 == 49:
            a.synchronize()
            b.synchronize()
    assert max(len(tracking._wait_log.get(q, ())) for q in (a._q, b._q)) <= 2 * tracking.PRUNE_EVERY
    x = dev.tensor(np.ones(64, np.float32), stream=a)
    a.synchronize()
    opened = gate(a)
    y = tp.relu(x, stream=a)
    b.wait_event(a.record_event())
    x.free(b)  # ordered by a pending wait: kept
    opened.set()
    a.synchronize()
    b.synchronize()
    y.free(a)


def test_a_host_free_while_work_on_one_stream_uses_the_tensor_is_not_reported(s, gate):
    """The README's own pattern: ``free()`` returns the block once the work using it has run (the pool waits for
    its last use). The sanitizer reported it whenever that work was still queued."""
    dev = tp.device("cpu")
    opened = gate(s)
    x = dev.tensor(np.ones(4096, np.float32), stream=s)  # pending copy-in
    y = tp.mul(x, 2.0, stream=s)  # pending: reads x
    x.free()
    z = dev.tensor(np.full(4096, 7.0, np.float32), stream=dev.stream())  # must not get x's memory yet
    opened.set()
    np.testing.assert_array_equal(y.numpy(), 2.0)
    np.testing.assert_array_equal(z.numpy(), 7.0)
    y.free(s)
    z.free()


def test_a_host_free_while_two_streams_use_the_tensor_is_reported(s, gate):
    """The pool knows one last use: a pending use on another stream than the marked one is a use after free."""
    dev = tp.device("cpu")
    x = dev.tensor(np.ones(16, np.float32), stream=s)
    s.synchronize()
    s2 = dev.stream()
    opened, opened2 = gate(s), gate(s2)
    y = tp.mul(x, 2.0, stream=s)
    y2 = tp.mul(x, 3.0, stream=s2)  # x's mark is now s2's task: s's read is unknown to the pool
    with pytest.raises(sanitizer.UseAfterFreeError, match="the host"):
        x.free()
    opened.set()
    opened2.set()
    s.synchronize()
    s2.synchronize()
    x.free()
    y.free()
    y2.free()


# ---- 5. read before ready
def test_host_view_of_a_tensor_a_pending_task_writes_raises(s, gate):
    dev = tp.device("cpu")
    x = dev.tensor(np.ones(32, np.float32), stream=s)
    s.synchronize()
    opened = gate(s)
    y = tp.exp(x, stream=s)
    with pytest.raises(sanitizer.ReadBeforeReadyError) as e:
        y.view()
    assert "op 'exp'" in str(e.value) and f"stream '{s.name}'" in str(e.value)
    opened.set()
    np.testing.assert_allclose(y.numpy(), np.e, rtol=1e-6)  # numpy() waits: fine
    x.free(s)
    y.free(s)


def test_a_pending_write_is_not_hidden_by_a_later_read_of_the_tensor(s, gate):
    dev = tp.device("cpu")
    x = dev.tensor(np.ones((4, 4), np.float32), stream=s)
    s.synchronize()
    opened = gate(s)
    y = tp.softmax(x, stream=s)  # writes y
    z = tp.relu(y, stream=s)  # reads y: a later use on the same stream
    with pytest.raises(sanitizer.ReadBeforeReadyError, match="op 'softmax'"):
        y.view()
    opened.set()
    np.testing.assert_allclose(z.numpy(), 0.25, rtol=1e-6)
    for t in (x, y, z):
        t.free(s)


def test_array_and_dlpack_of_a_tensor_written_on_another_stream_raise(s, gate):
    dev = tp.device("cpu")
    other = dev.stream("writer")
    x = dev.tensor(np.ones(8, np.float32), stream=other)
    other.synchronize()
    opened = gate(other)
    y = dev.empty((8,))
    tp.ops.neg.get_workspace_size(x, out=y)[1].destroy()
    tp.neg(x, out=y, stream=other)
    y.block.mark_use(s, s.record_event().seq)  # a later use on another stream: numpy() waits for that one only
    with pytest.raises(sanitizer.ReadBeforeReadyError):
        np.asarray(y)
    with pytest.raises(sanitizer.ReadBeforeReadyError):
        np.from_dlpack(y)
    opened.set()
    other.synchronize()
    np.testing.assert_array_equal(np.asarray(y), -1)
    x.free(other)
    y.free(other)


# ---- 6. executor misuse
def test_phase2_twice_on_a_single_use_executor_says_where_it_was_consumed(s):
    dev = tp.device("cpu")
    x = dev.tensor(np.ones(4, np.float32), stream=s)
    y = dev.empty((4,))
    _, ex = tp.ops.relu.get_workspace_size(x, out=y)
    tp.ops.relu(None, 0, ex, s)
    with pytest.raises(sanitizer.ExecutorMisuseError) as e:
        tp.ops.relu(None, 0, ex, s)
    assert "consumed single-use executor" in str(e.value) and "consumed at" in str(e.value)
    assert isinstance(e.value, tp.InvalidStateError) and e.value.status == tp.Status.ERR_PARAM_INVALID_STATE
    with pytest.raises(sanitizer.ExecutorMisuseError, match="destroy of a consumed"):
        ex.destroy()
    s.synchronize()
    x.free(s)
    y.free(s)


def test_destroy_while_the_last_launch_is_pending_raises(s, gate):
    dev = tp.device("cpu")
    x = dev.tensor(np.ones(4, np.float32), stream=s)
    y = dev.empty((4,))
    _, ex = tp.ops.relu.get_workspace_size(x, out=y)
    ex.set_repeatable()
    opened = gate(s)
    tp.ops.relu(None, 0, ex, s)
    with pytest.raises(sanitizer.ExecutorMisuseError, match="while its last launch .* is pending"):
        ex.destroy()
    opened.set()
    s.synchronize()
    ex.destroy()
    x.free(s)
    y.free(s)


def test_phase2_from_another_thread_names_both_threads(s):
    dev = tp.device("cpu")
    x = dev.tensor(np.ones(4, np.float32), stream=s)
    y = dev.empty((4,))
    _, ex = tp.ops.relu.get_workspace_size(x, out=y)
    errors: list[BaseException] = []

    def other() -> None:
        try:
            tp.ops.relu(None, 0, ex, s)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    th = threading.Thread(target=other, name="intruder")
    th.start()
    th.join()
    assert isinstance(errors[0], sanitizer.ExecutorMisuseError)
    assert "thread 'intruder'" in str(errors[0]) and "planned on thread 'MainThread'" in str(errors[0])
    ex.destroy()
    s.synchronize()
    x.free(s)
    y.free(s)


# ---- 7. leaks
def test_report_lists_leaked_executors_and_blocks_with_their_creation_stack(san):
    token = san.mark()
    dev = tp.device("cpu")
    _, ex = tp.ops.relu.get_workspace_size(TensorDesc((3,)))  # never destroyed
    blk = dev.malloc(1000)  # never freed

    def dropped() -> None:
        tp.ops.neg.get_workspace_size(TensorDesc((5,)))  # dropped without destroy: memory creep in C

    dropped()
    gc.collect()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        leaks = san.report(since=token)
    kinds = sorted(lk.kind for lk in leaks)
    assert kinds == ["block", "executor", "executor"]
    text = "\n".join(str(lk) for lk in leaks)
    assert "op 'relu'" in text and "op 'neg'" in text and "garbage-collected without destroy" in text
    assert "of 1000 bytes" in text and "test_sanitizer.py" in text and "in dropped" in text
    assert all(issubclass(x.category, sanitizer.LeakWarning) for x in w) and len(w) == 3
    with pytest.raises(sanitizer.SanitizerError, match="3 leak"):
        san.report(since=token, warn=False, raise_on_leak=True)
    ex.destroy()
    blk.free()
    san.reset()
    assert san.report(since=token, warn=False) == []


# ---- 8. stale executor after a shape change
def test_rebinding_a_tensor_of_another_shape_or_stride_shows_both_descs(s):
    dev = tp.device("cpu")
    x = dev.tensor(np.ones((4, 6), np.float32), stream=s)
    _, ex = tp.ops.neg.get_workspace_size(x)
    ex.set_repeatable()
    bigger = dev.tensor(np.ones((4, 7), np.float32), stream=s)
    with pytest.raises(sanitizer.StaleExecutorError) as e:
        ex.set_input(0, bigger)
    assert "TensorDesc((4, 6), float32)" in str(e.value) and "TensorDesc((4, 7), float32)" in str(e.value)
    base = dev.tensor(np.ones((6, 4), np.float32), stream=s)
    with pytest.raises(sanitizer.StaleExecutorError, match="strides=\\(1, 4\\)"):
        ex.set_input(0, base.transpose())
    with pytest.raises(sanitizer.StaleExecutorError, match="argument 'x'") as e:
        ex._bind_many({0: bigger})
    assert isinstance(e.value, tp.PlanMismatchError)  # what the plain runtime raises for the same mistake
    ex.destroy()
    s.synchronize()
    for t in (x, bigger, base):
        t.free(s)


# ---- off: nothing installed
def test_off_means_the_plain_functions_are_back():
    from twophase import hooks
    from twophase.runtime.memory import MemoryPool
    from twophase.sanitizer import guards

    with sanitizer.sanitize():
        assert tp.Op.__call__ is not hooks._plain_phase2
        others = guards.live_blocks()  # guarded blocks other test files left allocated keep free swapped
        b = tp.device("cpu").malloc(10)
    assert sanitizer.is_enabled() is False
    assert tp.Op.__call__ is hooks._plain_phase2 and tp.Op.get_workspace_size is hooks._plain_phase1
    assert MemoryPool.malloc is guards._plain_malloc
    assert MemoryPool.free is guards.guarded_free  # until the last guarded block is back
    b.free()
    assert MemoryPool.free is (guards.guarded_free if others else guards._plain_free)
    assert tp.Tensor.view.__module__ == "twophase.tensor"


def test_env_and_setter_turn_it_on_and_off():
    tp.set_sanitize(True)
    try:
        assert sanitizer.is_enabled() and tp.settings.sanitize
    finally:
        tp.set_sanitize(False)
    assert not sanitizer.is_enabled()


def test_graph_replay_with_a_freed_captured_tensor_names_the_graph(s):
    """A replay uses every tensor it was captured with: a freed weight is refused before anything runs, and an
    input rebound for the replay may have its old tensor freed."""
    dev = tp.device("cpu")
    x = dev.tensor(np.ones((4, 8), np.float32), stream=s)
    w = dev.tensor(np.ones((5, 8), np.float32), stream=s)
    with tp.capture(s) as g:
        g.input("x", x)
        g.output("y", tp.linear(x, w, stream=s))
    g.instantiate()
    x2 = dev.tensor(np.full((4, 8), 2, np.float32), stream=s)
    x.free(s)
    for _ in range(2):
        np.testing.assert_array_equal(g.replay(s, x=x2)["y"].numpy(), np.full((4, 5), 16))  # the new x only
    w.free(s)
    with pytest.raises(sanitizer.UseAfterFreeError, match=f"{g.name} replayed .* already freed"):
        g.replay(s, x=x2)  # no launch is rebuilt: the replay's own check refuses the weight
    g.destroy()
    x2.free(s)


# ---- launch records follow the stream's queue, not its name
def _raiser() -> Op:
    """A buggy op (not registered): its kernel raises."""

    def build(plan: Plan, attrs: Any, ins: Any, outs: Any) -> Any:
        def launch(ws: Any) -> None:
            raise ZeroDivisionError("planted")

        return launch

    return Op(
        OpDef(
            name="raiser",
            inputs=("x",),
            infer=lambda ins, attrs: (ins[0],),
            select=lambda ins, outs, attrs, limit: Plan("raise", None, 0),
            kernels={"cpu": build},
        )
    )


def test_a_new_stream_with_an_old_name_is_not_blamed_for_a_launch_that_failed_there(san):
    """The failed launch's record must not be found by the task with its seq on a later stream of that name:
    it would check the old blocks' guard zones, now inside memory the new stream's tensor was given."""
    dev = tp.device("cpu")
    old = dev.stream("reused")
    x = dev.tensor(np.ones(16, np.float32), stream=old)
    y = _run(_raiser(), x, old)
    with pytest.raises(tp.KernelError, match="planted"):
        old.synchronize()
    x.free(old)
    y.free(old)
    seq = old._submitted
    old.close()
    new = dev.stream("reused")
    a = dev.tensor(np.ones(1000, np.float32), stream=new)  # the memory of x and y, guard zones included
    while new._submitted <= seq:
        new.record_event()  # tasks with the seqs of the old stream's
    new.synchronize()
    np.testing.assert_array_equal(a.numpy(), np.ones(1000))
    a.free(new)
    new.close()


def test_two_streams_of_one_name_each_check_their_own_launches(san, gate):
    """Launches with the same seq on two live streams named alike: each kernel's guard zones are checked."""
    dev = tp.device("cpu")
    streams = [dev.stream("twin"), dev.stream("twin")]
    xs = [dev.tensor(np.ones(8, np.float32), stream=st) for st in streams]
    for st in streams:
        st.synchronize()
    opened = [gate(st) for st in streams]  # both wait: the records of both launches exist at once
    bad = _run(_scribbler(64, past_end=7), xs[0], streams[0])
    good = _run(_scribbler(64), xs[1], streams[1])
    assert streams[0]._submitted == streams[1]._submitted
    opened[1].set()
    streams[1].synchronize()
    opened[0].set()
    with pytest.raises(sanitizer.GuardError, match="7 byte\\(s\\) past the end"):
        streams[0].synchronize()
    for st, ts in zip(streams, ((xs[0], bad), (xs[1], good))):
        for t in ts:
            t.free(st)
        st.close()


def _poker(target: str, nbytes: int) -> Op:
    """A buggy op (``poke_past_input`` / ``poke_past_output``): copies x to out, then writes ``nbytes`` past the end
    of its input or its output through the raw address, as a C kernel would."""

    def build(plan: Plan, attrs: Any, ins: Any, outs: Any) -> Any:
        x, out = ins[0], outs[0]
        victim = x if target == "input" else out

        def launch(ws: Any) -> None:
            out[...] = x
            ctypes.memset(victim.ctypes.data + victim.nbytes, 0x11, nbytes)

        return launch

    return Op(
        OpDef(
            name=f"poke_past_{target}",
            inputs=("x",),
            infer=lambda ins, attrs: (ins[0],),
            select=lambda ins, outs, attrs, limit: Plan("poke", None, 0),
            kernels={"cpu": build},
        )
    )


def test_a_graph_replay_verifies_the_guard_zones_of_its_nodes_operands(s):
    """A kernel writing past its input is caught in a replay as in an eager launch, naming the node's op."""
    op = _poker("input", 4)
    dev = tp.device("cpu")
    x = dev.tensor(np.ones(20, np.float32), stream=s)
    with tp.capture(s) as g:
        g.input("x", x)
        size, ex = op.get_workspace_size(x)
        y = dev.empty_like(ex.output_descs[0], s)
        ex.set_output(0, y)
        op(None, size, ex, s)
        g.output("y", y)
    g.instantiate()
    try:
        g.replay(s)
        with pytest.raises(tp.KernelError, match="poke_past_input") as e:
            s.synchronize()
        assert "past the end" in str(e.value) and "input 0" in str(e.value)
    finally:
        g.destroy()
        x.free(s)


def test_an_executor_destroyed_while_the_sanitizer_was_off_is_not_reported_as_leaked(san):
    dev = tp.device("cpu")
    x = dev.tensor(np.ones(8, np.float32))
    _, ex = tp.ops.relu.get_workspace_size(x)  # recorded by the sanitizer
    _, leaked = tp.ops.relu.get_workspace_size(x)
    tp.set_sanitize(False)
    ex.destroy()
    tp.set_sanitize(True)
    del ex
    gc.collect()
    found = [str(lk) for lk in sanitizer.report(warn=False)]
    assert len([f for f in found if "relu" in f]) == 1  # the one never destroyed
    leaked.destroy()
    x.free()


def test_sanitize_block_restores_an_earlier_on_state():
    with sanitizer.sanitize():
        with sanitizer.sanitize():
            sanitizer.disable()
        assert sanitizer.is_enabled()
    assert not sanitizer.is_enabled()


def test_an_intermediate_overrunning_into_its_arena_neighbour_is_reported_after_the_replay(s):
    """Intermediates share one arena; under the sanitizer each gets guard bytes, written before the node that
    writes it and checked after that node."""
    op = _poker("output", 8)
    dev = tp.device("cpu")
    a = np.arange(20, dtype=np.float32)
    x = dev.tensor(a, stream=s)
    with tp.capture(s) as g:
        g.input("x", x)
        size, ex = op.get_workspace_size(x)
        mid = dev.empty_like(ex.output_descs[0], s)  # an intermediate: in the arena after instantiate
        ex.set_output(0, mid)
        op(None, size, ex, s)
        g.output("y", tp.neg(mid, stream=s))
        mid.free(s)
    g.instantiate()
    try:
        g.replay(s)
        with pytest.raises(tp.KernelError, match="past the end of intermediate") as e:
            s.synchronize()
        assert "node 0 ('poke_past_output')" in str(e.value) and g.name in str(e.value)
        g.replay(s)
        with pytest.raises(tp.KernelError, match="past the end"):  # again: the guards are written before each run
            s.synchronize()
    finally:
        g.destroy()
        x.free(s)


def test_a_replay_that_stays_inside_its_buffers_reports_nothing(s, rng):
    dev = tp.device("cpu")
    a = rng.standard_normal((16, 33)).astype(np.float32)
    x = dev.tensor(a, stream=s)
    with tp.capture(s) as g:
        g.input("x", x)
        h = tp.softmax(tp.relu(x, stream=s), dim=-1, stream=s)
        g.output("y", tp.reduce_sum(tp.exp(h, stream=s), dims=(1,), stream=s))
    g.instantiate()
    try:
        assert g._guards is not None and sum(map(len, g._guards.per_node)) >= 4  # relu, softmax, exp, reduce_sum
        for _ in range(3):
            y = g.replay(s)["y"].numpy()
        e = np.exp(np.maximum(a.astype(np.float64), 0))
        np.testing.assert_allclose(y, np.exp(e / e.sum(-1, keepdims=True)).sum(1), rtol=1e-5)
    finally:
        g.destroy()
        x.free(s)


def _free_node(pool: Any, address: int) -> Any:
    """The pool's free-list node holding ``address``."""
    return next(b for *_, b in pool._free if b.address <= address < b.address + b.size)


def test_a_host_free_after_the_sanitizer_was_turned_off_waits_for_the_pending_launch(gate):
    """A block allocated under the sanitizer and freed from the host after it was turned off: phase 2 marked the
    inner (guarded) block, so the pool's block must get that mark, else its memory is reused under the kernel."""
    dev = tp.device("cpu")
    s = dev.stream("freed after off")
    x = dev.tensor(np.ones(4096, np.float32), stream=s)
    with sanitizer.sanitize():
        y = dev.empty((4096,), stream=s)
        outer = y.block.outer
    s.synchronize()
    opened = gate(s)
    tp.neg(x, out=y, stream=s)  # pending: writes y
    y.free()
    assert not _free_node(dev.pool, outer.address)._ready(None)  # not for the host before neg has run
    opened.set()
    s.synchronize()
    assert _free_node(dev.pool, outer.address)._ready(None)
    x.free(s)


def test_a_stream_free_does_not_block_the_host_on_the_fresh_memory_fill(san):
    """The fill of a block allocated in the order of a busy stream is the sanitizer's own task: a free on another
    stream, ordered after it by an event or not, returns at once; the memory is reused only after the fill."""
    dev = tp.device("cpu")
    a, b, c = dev.stream("fill a"), dev.stream("fill b"), dev.stream("fill c")
    opened = threading.Event()
    a.launch_callback(lambda: opened.wait(30))
    y = dev.empty((1024,), stream=a)
    z = dev.empty((1024,), stream=a)
    b.wait_event(a.record_event())
    timer = threading.Timer(2.0, opened.set)
    timer.start()
    try:
        t0 = time.perf_counter()
        y.free(b)  # ordered after the fill by the event
        z.free(c)  # not ordered: c's later work waits for the fill
        took = time.perf_counter() - t0
        for blk in (y.block, z.block):
            assert not _free_node(dev.pool, blk.outer.address)._ready(None)
    finally:
        opened.set()
        timer.cancel()
    for st in (a, b, c):
        st.synchronize()
    assert took < 1.0
    assert _free_node(dev.pool, y.block.outer.address)._ready(None)


def test_destroy_while_a_launch_on_another_stream_is_pending_raises(s, gate):
    dev = tp.device("cpu")
    a = dev.stream("launch a")
    x = dev.tensor(np.ones(4, np.float32), stream=s)
    y1, y2 = dev.empty((4,), stream=s), dev.empty((4,), stream=s)
    s.synchronize()
    _, ex = tp.ops.relu.get_workspace_size(x, out=y1)
    ex.set_repeatable()
    opened = gate(a)
    tp.ops.relu(None, 0, ex, a)  # pending on a
    ex.set_output(0, y2)
    tp.ops.relu(None, 0, ex, s)  # completes on s
    s.synchronize()
    with pytest.raises(sanitizer.ExecutorMisuseError, match="task .* on stream 'launch a'.* is pending"):
        ex.destroy()
    opened.set()
    a.synchronize()
    ex.destroy()
    for t in (x, y1, y2):
        t.free(s)


def test_host_view_of_a_graph_input_a_pending_replay_only_reads_is_allowed(s, gate):
    dev = tp.device("cpu")
    x = dev.tensor(np.ones((4, 8), np.float32), stream=s)
    out = dev.empty((4, 8), stream=s)
    with tp.capture(s) as g:
        g.input("x", x)
        g.output("y", tp.relu(x, out=out, stream=s))
    g.instantiate()
    try:
        s.synchronize()
        opened = gate(s)
        g.replay(s)
        np.testing.assert_array_equal(x.view(), 1)  # only read by the replay, as by an eager launch
        with pytest.raises(sanitizer.ReadBeforeReadyError, match="graph"):
            out.view()  # written by it
        opened.set()
        s.synchronize()
        np.testing.assert_array_equal(out.view(), 1)
    finally:
        g.destroy()
        x.free(s)
        out.free(s)


def test_a_launch_whose_seq_another_thread_took_is_still_checked(s):
    """Another thread's task enqueued on the shared stream between the sanitizer's check and the launch's enqueue
    (here a hook enqueuing a callback): the launch's record and uses must still be those of the launch's task."""
    from twophase import hooks

    dev = tp.device("cpu")
    x = dev.tensor(np.ones(8, np.float32), stream=s)
    op = _scribbler(64, past_end=4)
    size, ex = op.get_workspace_size(x)
    y = dev.empty_like(ex.output_descs[0], s)
    ex.set_output(0, y)
    ws = dev.malloc(size, stream=s)
    s.synchronize()
    opened = threading.Event()
    handle = hooks.add_phase2_hook(before=lambda *a: s.launch_callback(lambda: opened.wait(30)))
    try:
        op(ws, size, ex, s)
    finally:
        hooks.remove_hook(handle)
    opened.set()
    assert y.block.writes[s._q][0] == s._q.submitted  # the launch's own task, not the callback before it
    with pytest.raises(sanitizer.GuardError, match="4 byte"):
        s.synchronize()
    s.synchronize()
    ws.free(s)
    x.free(s)
    y.free(s)


def test_a_host_free_of_a_use_an_event_orders_before_the_marked_one_is_not_reported(s, gate):
    """The pool waits for the marked (last) use on B; A's pending use comes before it by an event: no use after
    free (it was reported, with advice meaningless for a free from the host)."""
    dev = tp.device("cpu")
    b = dev.stream()
    x = dev.tensor(np.ones((64, 64), np.float32), stream=s)
    s.synchronize()
    opened = gate(s)
    y = tp.relu(x, stream=s)
    b.wait_event(s.record_event())
    z = tp.relu(x, stream=b)  # the marked use
    x.free()
    opened.set()
    np.testing.assert_array_equal(z.numpy(), 1.0)
    y.free(s)
    z.free(b)
    s.synchronize()
    b.close()


def test_a_host_free_in_a_callback_does_not_wait_for_its_own_streams_later_fill(s, gate):
    """A free from A's callback of a block whose sanitizer fill is queued on A behind it, while its last use is
    pending on B: the free waited on A's later task from A's own worker, a deadlock."""
    dev = tp.device("cpu")
    b = dev.stream()
    box: dict[str, Any] = {}

    def free_x() -> None:
        box["x"].free()
        box["freed"] = True

    opened = gate(s)
    s.launch_callback(free_x)
    box["x"] = x = dev.empty((256,), stream=s)  # its fresh-memory fill is queued on s after the callback
    opened_b = gate(b)
    y = tp.relu(x, stream=b)  # the last use: pending on b
    opened.set()
    threading.Timer(0.3, opened_b.set).start()
    done = threading.Thread(target=s.synchronize, daemon=True)
    done.start()
    done.join(10)
    assert not done.is_alive() and box.get("freed")
    b.synchronize()
    y.free(b)
    b.close()


def test_host_view_of_an_arena_output_while_a_replay_is_pending_raises(s, gate):
    """An output in the graph's arena is a view of a virtual block, not of the guarded arena: its host reads were
    never checked, so a view during a pending replay read the previous replay's values unreported."""
    dev = tp.device("cpu")
    x = dev.tensor(np.ones((4, 8), np.float32), stream=s)
    with tp.capture(s) as g:
        g.input("x", x)
        y = g.output("y", tp.exp(x, stream=s))
    g.instantiate()
    try:
        g.replay(s)
        s.synchronize()
        opened = gate(s)
        g.replay(s)
        with pytest.raises(sanitizer.ReadBeforeReadyError, match="graph"):
            y.view()
        opened.set()
        np.testing.assert_allclose(y.numpy(), np.e, rtol=1e-6)
    finally:
        g.destroy()
        x.free(s)


def test_a_free_with_a_bad_stream_changes_nothing_under_the_sanitizer(san):
    """Refused before anything changes, as without the sanitizer (it had handed the memory back already)."""
    dev = tp.device("cpu")
    b = dev.malloc(4096)
    for bad in ("s", 3):
        with pytest.raises(tp.ParamError, match="free: argument 'stream'"):
            b.free(bad)  # type: ignore[arg-type]
        assert b.allocated and not b.freed
    b.free()


def test_a_bad_rebinding_index_is_the_executors_param_error_under_the_sanitizer(san):
    x = tp.device("cpu").tensor(np.ones((2, 4), np.float32))
    _, ex = tp.ops.softmax.get_workspace_size(x, dim=-1)
    for index in (None, "0", 0.5, True):
        with pytest.raises(tp.ParamError, match="input index"):
            ex.set_input(index, x)  # type: ignore[arg-type]
    ex.set_input(np.int64(0), x)
    ex.destroy()
    x.free()


def test_a_numpy_int_byte_count_gets_a_guarded_block(san):
    b = tp.device("cpu").malloc(np.int64(100))
    assert type(b).__name__ == "GuardedBlock" and b.size == 100
    b.free()


def test_a_dlpack_export_keeps_its_memory_after_free_under_the_sanitizer(san, s):
    """The consumer's memory is not handed out again until it lets go (it was, at once: a later tensor's data
    showed through the consumer's array)."""
    dev = tp.device("cpu")
    x = dev.tensor(np.arange(1024, dtype=np.float32), stream=s)
    held = np.from_dlpack(x)
    x.free(s)
    others = [dev.tensor(np.full(1024, -1.0, np.float32), stream=s) for _ in range(4)]
    s.synchronize()
    np.testing.assert_array_equal(held, np.arange(1024))
    del held
    gc.collect()
    for t in others:
        t.free(s)


def test_an_executor_launched_in_a_capture_may_be_destroyed_there(san, s):
    """A captured launch never runs on the stream (the graph replays its own clone of the executor): destroying
    the executor inside the capture is no destroy of a pending launch (a PlanCache's lease inside a capture did)."""
    dev = tp.device("cpu")
    x = dev.tensor(np.arange(8, dtype=np.float32), stream=s)
    with tp.capture(s) as g:
        _, ex = tp.ops.relu.get_workspace_size(x)
        ex.set_repeatable()
        y = dev.empty((8,), stream=s)
        ex.set_output(0, y)
        tp.ops.relu(None, 0, ex, s)
        ex.destroy()
        g.output("y", y)
    g.instantiate()
    np.testing.assert_array_equal(g.replay(s)["y"].numpy(), np.arange(8))
    g.destroy()
    x.free(s)


def test_numpy_of_a_fresh_tensor_on_a_busy_stream_waits_for_the_sanitizers_fill(s):
    """The fill of a new block is ordered on a busy stream: it set no mark on the block, so numpy() (which waits for
    the mark) did not wait and raised ReadBeforeReadyError about the sanitizer's own fill."""
    opened = threading.Event()
    s.launch_callback(lambda: opened.wait(30))
    t = tp.device("cpu").empty((16,), stream=s)
    threading.Timer(0.1, opened.set).start()
    assert np.isnan(t.numpy()).all()  # waited for the fill (the poison)
    t.free()


def test_a_long_lived_tensor_does_not_keep_the_uses_of_completed_streams(san):
    """A weight used on many streams, each closed after: the block kept every stream's queue (and scanned them all
    at each check); completed uses are dropped."""
    dev = tp.device("cpu")
    w = dev.tensor(np.ones(64, np.float32))
    dev.synchronize()
    for _ in range(40):
        st = dev.stream()
        tp.relu(w, stream=st).free(st)
        st.close()
    assert len(w.block.uses) <= 8
    w.free()


def test_an_error_names_the_op_of_the_use_it_reports_not_a_piece_of_its_label(s):
    from twophase.sanitizer.tracking import _op_of

    assert _op_of("op 'softmax' (executor #3, implementation 'rows')") == "softmax"
    assert _op_of("the sanitizer's fresh-memory fill") is None
    assert _op_of("a replay of graph 'g'") is None


def test_a_callback_reading_a_tensor_another_stream_still_writes_is_reported(san):
    """Host code in a stream callback runs on that stream's worker: every twophase worker thread was exempt, so a
    read racing another stream's pending write went unseen. A callback ordered after the write reads cleanly."""
    dev = tp.device("cpu")
    a, b = dev.stream(), dev.stream()
    x = dev.tensor(np.ones(64, np.float32), stream=a)
    a.synchronize()
    y = dev.empty((64,), stream=a)
    opened = threading.Event()
    a.launch_callback(lambda: opened.wait(30))
    tp.relu(x, out=y, stream=a)  # pending write of y on a
    got: list[Any] = []

    def read() -> None:
        try:
            got.append(float(y.view()[0]))
        except sanitizer.ReadBeforeReadyError as e:
            got.append(e)

    b.launch_callback(read)  # b never waited for a
    b.synchronize()
    assert isinstance(got[0], sanitizer.ReadBeforeReadyError) and got[0].op == "relu"
    opened.set()
    b.wait_event(a.record_event())
    b.launch_callback(read)
    b.synchronize()
    assert got[1] == 1.0
    a.synchronize()
    x.free()
    y.free()


def test_a_host_read_of_a_graph_output_an_eager_op_still_writes_is_reported(san):
    """An eager op's pending write of a graph's arena-backed output went unrecorded (only pool blocks were): the
    host read it mid-write. Ordered after it (a sync), the read is clean."""
    dev = tp.device("cpu")
    s, a, c = dev.stream(), dev.stream(), dev.stream()
    x = dev.tensor(np.ones((8, 16), np.float32), stream=s)
    s.synchronize()
    with tp.capture(s) as g:
        g.input("x", x)
        g.output("y", tp.relu(x, stream=s))
    g.instantiate()
    y = g.replay(a)["y"]
    a.synchronize()
    opened = threading.Event()
    c.launch_callback(lambda: opened.wait(30))
    tp.add(y, 1.0, out=y, stream=c)  # pending write of y on c
    with pytest.raises(sanitizer.ReadBeforeReadyError, match="add"):
        y.view()
    opened.set()
    c.synchronize()
    np.testing.assert_array_equal(y.numpy(), np.full((8, 16), 2.0, np.float32))
    g.destroy()
    x.free()


def test_a_guard_zone_found_damaged_at_free_is_reported_after_the_block_is_freed(san):
    """A free that finds a guard zone overwritten raised before freeing: the block leaked (and the leak report
    blamed the caller). The GuardError comes after the free."""
    import ctypes

    dev = tp.device("cpu")
    s = dev.stream()
    x = dev.tensor(np.ones(64, np.float32), stream=s)
    y = tp.relu(x, stream=s)
    s.synchronize()
    ctypes.memset(y.block.data.ctypes.data + y.block.size, 0x11, 4)  # the host, past the end: no task to blame
    x.free(s)
    with pytest.raises(sanitizer.GuardError, match="past the end"):
        y.free(s)
    s.synchronize()
    assert y.block.freed and not y.block.allocated


def test_a_kernel_that_overruns_then_fails_is_reported_for_the_overrun_caused_by_its_failure(san):
    """The guard zones of a task that raised were not verified: its KernelError hid the overrun, which the next
    task on the block (or the free) was then blamed for. Verified as after any task, the overrun is the failure,
    its cause the kernel's own error."""
    import ctypes

    dev = tp.device("cpu")
    s = dev.stream()
    x = dev.tensor(np.ones(64, np.float32), stream=s)
    size, ex = tp.ops.relu.get_workspace_size(x)
    y = dev.empty_like(ex.output_descs[0], s)
    ex.set_output(0, y)
    plain, yb = ex._launch, y.block

    def overrun_then_fail(ws: Any) -> None:
        plain(ws)
        ctypes.memset(yb.data.ctypes.data + yb.size, 0x11, 4)
        raise RuntimeError("kernel failed after the overrun")

    ex._launch = overrun_then_fail
    tp.ops.relu(None, size, ex, s)
    with pytest.raises(sanitizer.GuardError, match="past the end of its output 0") as e:
        s.synchronize()
    assert "op 'relu'" in str(e.value) and isinstance(e.value.__cause__, RuntimeError)
    x.free(s)
    y.free(s)  # the zone was restored when the overrun was reported: the free finds nothing more
    s.synchronize()
    assert y.block.freed and not y.block.allocated


# ---- 9. constant operands
def test_a_constant_weight_changed_while_bound_is_reported_at_the_next_sync(s):
    """conv2d planned with ``constant_weight`` keeps the weight transform of its first launch: a weight written in
    place afterwards is ``ConstantOperandError`` at the next sync, naming the weight and where the executor was
    planned. Rebound to another weight tensor, the call is checked against that one; without the promise,
    changing the weight is fine."""
    from twophase.ops.selection import forced

    dev = tp.device("cpu")
    rng = np.random.default_rng(4)
    x = dev.tensor(rng.standard_normal((1, 4, 9, 10)).astype(np.float32), stream=s)
    w, other = (dev.tensor(rng.standard_normal((3, 4, 3, 3)).astype(np.float32), stream=s) for _ in range(2))
    with forced("winograd"):
        call = tp.plan(tp.ops.conv2d, x, w, None, stream=s, padding=1, constant_weight=True)
        plain = tp.plan(tp.ops.conv2d, x, w, None, stream=s, padding=1)
    call()
    plain()
    s.synchronize()
    w.view()[0, 0, 0, 0] += 1.0  # in place, after the launches that read it
    plain()
    s.synchronize()  # no promise made: fine
    call()
    with pytest.raises(sanitizer.ConstantOperandError, match="weight of op 'conv2d'.*changed while bound") as e:
        s.synchronize()
    assert e.value.arg == "weight" and "test_sanitizer.py" in str(e.value)
    call(x, other)  # another binding: its own transform, checked against its own first launch
    call()
    s.synchronize()
    call.close()
    plain.close()
    for t in (x, w, other):
        t.free(s)
