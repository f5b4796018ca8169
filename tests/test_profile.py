"""``twophase.profile(path)``: the Chrome trace is valid JSON with host spans (both phases), per-stream kernel
spans, pool counter events and enqueue -> kernel flows; kernel spans nest inside the run's time range."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

import twophase
from twophase import Op, hooks
from twophase.profile import _listen, _on_pool_change
from twophase.runtime.memory import POOL_LISTENERS
from twophase.runtime.stream import TASK_LISTENERS


def _run(dev, stream, rng):
    a = rng.standard_normal((8, 5000))
    x = dev.tensor(a, stream=stream)
    r1 = twophase.softmax(x, dim=1, stream=stream)
    r2 = twophase.reduce_sum(x, dims=1, stream=stream)
    r3 = twophase.add(x, x, stream=stream)
    return a, r1, r2, r3


def test_trace_is_valid_json_with_host_stream_and_counter_events(tmp_path, dev, stream, rng):
    path = tmp_path / "trace.json"
    with twophase.profile(path) as prof:
        a, r1, r2, r3 = _run(dev, stream, rng)
    t_end = prof.us(time.perf_counter())
    np.testing.assert_allclose(r2.numpy(), a.sum(1), rtol=1e-10, atol=1e-10)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    host = [e for e in events if e.get("cat") in ("phase1", "phase2")]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    counters = [e for e in events if e.get("ph") == "C"]
    names = {e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    for op in ("softmax", "reduce_sum", "add"):
        assert f"phase1 {op}" in {e["name"] for e in host}
        assert f"phase2 {op}" in {e["name"] for e in host}
        assert op in {e["name"] for e in kernels}
    assert any(n == f"stream {stream.name}" for n in names)
    assert any(n.startswith("host ") for n in names)
    assert counters and all({"allocated", "reserved"} <= set(e["args"]) for e in counters)
    for e in host + kernels:
        assert e["ph"] == "X" and e["dur"] >= 0 and isinstance(e["ts"], (int, float))
    # the run's time range: from the first host span to the end of the profiled block
    start = min(e["ts"] for e in host)
    for k in kernels:
        assert start <= k["ts"] and k["ts"] + k["dur"] <= t_end
        launches = [h for h in host if h["name"] == f"phase2 {k['name']}"]
        if launches:
            assert k["ts"] >= min(h["ts"] for h in launches)  # a kernel never starts before its launch


def test_every_kernel_gets_a_flow_from_its_launch(tmp_path, dev, stream, gate, rng):
    path = tmp_path / "trace.json"
    with twophase.profile(path):
        ev = gate(stream)  # kernels wait: flows are registered before they run
        _run(dev, stream, rng)
        ev.set()
    events = json.loads(path.read_text())["traceEvents"]
    starts = {e["id"] for e in events if e.get("cat") == "flow" and e["ph"] == "s"}
    ends = {e["id"] for e in events if e.get("cat") == "flow" and e["ph"] == "f"}
    assert len(starts) == 3 and starts == ends
    spans = [e for e in events if e.get("cat") == "phase2"]
    f_ts = {e["id"]: e["ts"] for e in events if e.get("cat") == "flow" and e["ph"] == "f"}
    for e in events:
        if e.get("cat") == "flow" and e["ph"] == "s":
            assert any(h["ts"] <= e["ts"] <= h["ts"] + h["dur"] for h in spans)  # leaves its phase 2 span
            assert f_ts[e["id"]] >= e["ts"]  # and points forward in time


def test_launch_blocking_kernels_still_get_their_flow(tmp_path, dev, rng):
    """With launch blocking the kernel runs inside phase 2, before the host span is recorded."""
    old = twophase.settings.launch_blocking
    twophase.set_launch_blocking(True)
    s = dev.stream()
    try:
        path = tmp_path / "trace.json"
        with twophase.profile(path):
            _run(dev, s, rng)
        events = json.loads(path.read_text())["traceEvents"]
        starts = {e["id"] for e in events if e.get("cat") == "flow" and e["ph"] == "s"}
        ends = {e["id"] for e in events if e.get("cat") == "flow" and e["ph"] == "f"}
        assert len(starts) == 3 and starts == ends
    finally:
        twophase.set_launch_blocking(old)
        s.close()


def test_profiling_fills_phase_and_kernel_times_in_the_counters(dev, stream, rng):
    twophase.stats.reset()
    try:
        with twophase.profile():
            _run(dev, stream, rng)
        c = twophase.stats.snapshot()["ops"]["softmax"]
        assert c["phase1_timed_calls"] == 1 and c["phase2_timed_calls"] == 1 and c["kernel_count"] == 1
        assert c["kernel_time_s"] > 0
    finally:
        twophase.stats.reset()


def test_profile_restores_the_plain_entry_points_even_on_error(dev, stream):
    plain1, plain2 = Op.get_workspace_size, Op.__call__
    with pytest.raises(ZeroDivisionError):
        with twophase.profile():
            assert Op.__call__ is not plain2
            1 / 0  # noqa: B018
    assert Op.get_workspace_size is plain1 and Op.__call__ is plain2


def test_a_kernel_error_inside_the_block_is_raised_by_the_callers_sync(stream):
    """The profiler waits for the streams on exit without consuming their errors."""

    def boom() -> None:
        raise ValueError("kernel failed")

    with twophase.profile():
        stream.launch_callback(boom)
    with pytest.raises(twophase.KernelError, match="kernel failed"):
        stream.synchronize()
    stream.synchronize()  # raised once; the stream is usable again


def _flows(prof):
    """Ids of the flows started and of those ended."""
    flows = [e for e in prof.events if e.get("cat") == "flow"]
    return {e["id"] for e in flows if e["ph"] == "s"}, {e["id"] for e in flows if e["ph"] == "f"}


def test_streams_sharing_a_name_each_end_their_own_flows(dev, gate):
    """Two launches with the same seq on two streams named alike: each kernel ends its own launch's flow."""
    twins = [dev.stream("twin"), dev.stream("twin")]
    xs = [dev.tensor(np.ones(4), stream=s) for s in twins]
    with twophase.profile() as prof:
        opened = [gate(s) for s in twins]  # both flows are registered before either kernel runs
        ys = [twophase.neg(x, stream=s) for x, s in zip(xs, twins)]
        assert twins[0]._submitted == twins[1]._submitted
        for ev in opened:
            ev.set()
    starts, ends = _flows(prof)
    assert len(starts) == 2 and ends == starts
    for s, y in zip(twins, ys):
        np.testing.assert_array_equal(y.numpy(), -np.ones(4))
        s.close()


def test_the_flow_of_a_failed_launch_does_not_end_on_a_later_stream_of_the_same_name(dev):
    def build(plan, attrs, ins, outs):
        def launch(ws):
            raise ZeroDivisionError("planted")

        return launch

    raiser = Op(
        twophase.OpDef(
            name="raiser",
            inputs=("x",),
            infer=lambda ins, attrs: (ins[0],),
            select=lambda ins, outs, attrs, limit: twophase.Plan("raise", None, 0),
            kernels={"cpu": build},
        )
    )
    with twophase.profile() as prof:
        old = dev.stream("reused")
        x = dev.tensor(np.ones(4, np.float32), stream=old)
        size, ex = raiser.get_workspace_size(x)
        ex.set_output(0, dev.empty_like(ex.output_descs[0], old))
        raiser(None, size, ex, old)
        with pytest.raises(twophase.KernelError, match="planted"):
            old.synchronize()
        new = dev.stream("reused")
        while new._submitted <= old._submitted:
            new.record_event()  # markers with the seqs of the old stream's tasks
        new.synchronize()
    starts, ends = _flows(prof)
    assert len(starts) == 1 and ends == starts  # the failed kernel ran: it ends its own launch's flow
    kernel = next(e for e in prof.events if e.get("cat") == "kernel" and e["name"] == "raiser")
    end = next(e for e in prof.events if e.get("cat") == "flow" and e["ph"] == "f")
    markers = {e["tid"] for e in prof.events if e.get("cat") == "kernel" and e["name"] == "marker"}
    assert end["tid"] == kernel["tid"] and kernel["tid"] not in markers  # on the old stream's track, not the new
    saved = [e for e in prof.trace()["traceEvents"] if e.get("cat") == "flow"]
    assert len(saved) == 2
    old.close()
    new.close()


def test_a_refused_launch_and_captured_launches_draw_no_arrow(dev, stream, rng):
    x = dev.tensor(rng.standard_normal((8, 5000)).astype(np.float32), stream=stream)
    with twophase.profile() as prof:
        size, ex = twophase.ops.reduce_sum.get_workspace_size(x, dims=1)
        out = dev.empty_like(ex.output_descs[0], stream)
        ex.set_output(0, out)
        assert size > 0
        with pytest.raises(twophase.WorkspaceTooSmallError):
            twophase.ops.reduce_sum(None, size, ex, stream)
        ex.destroy()
        out.free(stream)
        with twophase.capture(stream) as g:
            g.input("x", x)
            g.output("y", twophase.exp(twophase.neg(x, stream=stream), stream=stream))
        g.instantiate()
        g.replay(stream)
        y = twophase.relu(x, stream=stream)  # one eager launch: one arrow
        stream.synchronize()
    starts, ends = _flows(prof)
    assert len(starts) == 1 and ends == starts
    g.destroy()
    for t in (x, y):
        t.free(stream)


def test_streams_sharing_a_name_get_a_track_each(dev, rng):
    twins = [dev.stream("twin track"), dev.stream("twin track")]
    x = dev.tensor(rng.standard_normal(16), stream=twins[0])
    twins[0].synchronize()
    with twophase.profile() as prof:
        ys = [twophase.neg(x, stream=s) for s in twins]
        for s in twins:
            s.synchronize()
    tracks = {e["tid"] for e in prof.events if e.get("cat") == "kernel" and e["name"] == "neg"}
    names = [
        m["args"]["name"] for m in prof.trace()["traceEvents"] if m.get("name") == "thread_name" and m["tid"] in tracks
    ]
    assert len(tracks) == 2 and sorted(names) == ["stream twin track", "stream twin track #2"]
    for s, y in zip(twins, ys):
        y.free(s)
        s.close()


def test_nested_profiles_count_each_kernel_once(dev, stream, rng):
    x = dev.tensor(rng.standard_normal(16), stream=stream)
    c = twophase.ops.neg.counters
    before = c.kernel_count
    with twophase.profile() as outer:
        with twophase.profile() as inner:
            ys = [twophase.neg(x, stream=stream) for _ in range(3)]
            stream.synchronize()
    assert c.kernel_count - before == 3
    for prof in (outer, inner):
        assert sum(1 for e in prof.events if e.get("cat") == "kernel" and e["name"] == "neg") == 3
    for y in ys:
        y.free(stream)


def _in_threads(*fns):
    """Run each of ``fns`` on a thread of its own (named A, B, ...); the first exception raised is raised here."""
    errors = []

    def run(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,), name="AB"[i]) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    return threads


def test_profiles_entered_by_two_threads_at_once_leave_nothing_installed(monkeypatch, dev):
    """Both threads pass the profiler's 'none active yet' check before either has installed its hooks (a
    barrier inside hook installation holds the first, unless the second cannot get that far): afterwards no
    hook or listener is left, and a kernel run outside any profile counts no kernel time."""
    plain1, plain2 = Op.get_workspace_size, Op.__call__
    both_installing = threading.Barrier(2)
    add_phase1_hook = hooks.add_phase1_hook

    def installing(after):
        try:
            both_installing.wait(timeout=0.5)
        except threading.BrokenBarrierError:
            pass  # the other thread waits for this one to finish installing: as it should
        return add_phase1_hook(after)

    monkeypatch.setattr(hooks, "add_phase1_hook", installing)
    both_inside = threading.Barrier(2)
    first_left = threading.Event()

    def first():
        with twophase.profile():
            both_inside.wait(5)
        first_left.set()

    def second():
        with twophase.profile():
            both_inside.wait(5)
            assert first_left.wait(5)

    _in_threads(first, second)
    try:
        assert _listen not in TASK_LISTENERS
        assert _on_pool_change not in POOL_LISTENERS
        assert Op.get_workspace_size is plain1 and Op.__call__ is plain2
        x = dev.tensor(np.ones(4))
        before = twophase.ops.neg.counters.kernel_count
        twophase.neg(x).numpy()
        assert twophase.ops.neg.counters.kernel_count == before
    finally:  # what a failure left installed, removed: the later tests would see twice the events
        for listeners, fn in ((TASK_LISTENERS, _listen), (POOL_LISTENERS, _on_pool_change)):
            while fn in listeners:
                listeners.remove(fn)
        Op.get_workspace_size, Op.__call__ = plain1, plain2


def test_threads_launching_on_a_shared_stream_each_get_the_arrow_to_their_own_kernel(dev, gate):
    """Two threads register their launches on one stream before either enqueues (a hook holds them): the
    arrows used to be keyed by the seq each guessed (the same one), so one kernel got the other's arrow and
    the other none. Each arrow must leave its own phase 2 span and end on the kernel of that launch."""
    s = dev.stream("shared")
    x = dev.tensor(np.ones(64, np.float32), stream=s)
    s.synchronize()
    both_registered = threading.Barrier(2)
    a_launched = threading.Event()

    def hold(op, ws, size, ex, stream):
        if threading.current_thread().name in "AB":
            both_registered.wait(5)  # the profiler's hook ran first, for both launches
            if threading.current_thread().name == "B":
                assert a_launched.wait(5)  # A enqueues first, then B

    def launched(op, ws, size, ex, stream, t0, t1):
        if threading.current_thread().name == "A":
            a_launched.set()

    with twophase.profile() as prof:
        handle = hooks.add_phase2_hook(before=hold, after=launched)
        try:
            opened = gate(s)  # neither kernel runs before both launches returned
            ys = {}
            threads = _in_threads(
                lambda: ys.setdefault("A", twophase.neg(x, stream=s)),
                lambda: ys.setdefault("B", twophase.exp(x, stream=s)),
            )
            opened.set()
            s.synchronize()
        finally:
            hooks.remove_hook(handle)
    events = prof.trace()["traceEvents"]
    spans = [e for e in events if e.get("cat") == "phase2"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    ends = {e["id"]: e for e in events if e.get("cat") == "flow" and e["ph"] == "f"}
    drawn = {}
    for start in (e for e in events if e.get("cat") == "flow" and e["ph"] == "s"):
        (span,) = [h for h in spans if h["tid"] == start["tid"] and h["ts"] <= start["ts"] <= h["ts"] + h["dur"]]
        end = ends[start["id"]]
        (kernel,) = [k for k in kernels if k["tid"] == end["tid"] and k["ts"] == end["ts"]]
        drawn[span["name"]] = kernel["name"]
        assert span["tid"] == threads["AB".index("A" if span["name"] == "phase2 neg" else "B")].ident
    assert drawn == {"phase2 neg": "neg", "phase2 exp": "exp"}
    np.testing.assert_array_equal(ys["A"].numpy(), -np.ones(64))
    s.close()


def test_refused_and_earlier_launches_of_an_executor_do_not_take_the_arrow_of_a_later_one(dev, gate, rng):
    """A repeatable executor: a launch from before the profile still queued, a launch refused inside it, then
    two launches: two arrows, each ending on the kernel of its own launch (the last two kernels)."""
    s = dev.stream()
    x = dev.tensor(rng.standard_normal((4, 8)), stream=s)
    with twophase.plan("softmax", x, dim=1, stream=s) as call:
        opened = gate(s)
        call()  # before the profile: no arrow
        with twophase.profile() as prof:
            ex = call.executor
            with pytest.raises(twophase.ParamError):
                twophase.ops.softmax(None, ex.workspace_size + 64, ex, s)  # refused: the wrong workspace size
            call()
            call()
            opened.set()
            s.synchronize()
    events = prof.trace()["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and e["name"] == "softmax"), key=lambda e: e["ts"])
    starts = sorted((e for e in events if e.get("cat") == "flow" and e["ph"] == "s"), key=lambda e: e["ts"])
    ends = {e["id"]: e["ts"] for e in events if e.get("cat") == "flow" and e["ph"] == "f"}
    assert len(kernels) == 3 and len(starts) == 2 and set(ends) == {e["id"] for e in starts}
    assert [ends[e["id"]] for e in starts] == [k["ts"] for k in kernels[1:]]
    s.close()


def test_flows_of_launches_whose_kernels_never_ran_go_with_their_executors(dev):
    """Each launch dropped after a failure left its executor's entry of pending flows for the rest of the profile
    (500 one-shot calls: 500 entries); entries of collected executors are dropped as new ones come."""
    import gc
    import time

    s = dev.stream()
    x = dev.tensor(np.ones(4, np.float32), stream=s)
    with twophase.profile() as prof:
        s.launch_callback(lambda: 1 / 0)
        for i in range(500):
            twophase.relu(x, stream=s).free(s)  # dropped after the failure: the kernel never runs
            if i % 50 == 49:  # let the worker drop what is queued (and the collector take those executors), so
                # the prunes on the way find them dead whatever the machine's load (the worker lagged under CI)
                while s._q.done < s._q.submitted:
                    time.sleep(0.001)
                gc.collect()
        with pytest.raises(twophase.KernelError):
            s.synchronize()
        gc.collect()
        assert len(prof._pending_flows) < 500  # pruned on the way (one entry per call, before)
        twophase.relu(x, stream=s).free(s)
        s.synchronize()
        with prof._lock:
            prof._prune_flows()
        assert len(prof._pending_flows) == 0  # the dead ones pruned, the last launch's flow ended by its kernel
    x.free(s)
    s.close()
