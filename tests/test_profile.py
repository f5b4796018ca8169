"""``twophase.profile(path)``: the Chrome trace is valid JSON with host spans (both phases), per-stream kernel
spans, pool counter events and enqueue -> kernel flows; kernel spans nest inside the run's time range."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import twophase
from twophase import Op


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
    assert len(starts) == 1 and ends == set()
    saved = [e for e in prof.trace()["traceEvents"] if e.get("cat") == "flow"]
    assert saved == []  # the trace leaves out an arrow that never ended (viewers reject a start without end)
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
