"""Graph capture and replay: what a capture refuses, replay == eager bit for bit (under the sanitizer),
rebinding inputs and outputs by name, mismatch errors, counters and trace, lifecycle."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import twophase as tp
from twophase import CaptureError, InvalidStateError, KernelError, ParamError, PlanMismatchError
from twophase.graph import VirtualBlock
from twophase.op import Op

try:
    from twophase import sanitizer
except ImportError:  # pragma: no cover - the sanitizer lands with issue 6
    sanitizer = None


def _sanitized() -> contextlib.AbstractContextManager[Any]:
    return sanitizer.sanitize() if sanitizer is not None else contextlib.nullcontext()


def _f32(rng: np.random.Generator, *shape: int, scale: float = 0.3) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.fixture(autouse=True)
def _destroy_graphs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every graph a test captures is destroyed at teardown, whatever the test did with it."""
    made: list[tp.Graph] = []
    real = tp.capture

    @contextlib.contextmanager
    def tracked(stream: tp.Stream, name: str | None = None) -> Iterator[tp.Graph]:
        with real(stream, name) as g:
            made.append(g)
            yield g

    monkeypatch.setattr(tp, "capture", tracked)
    yield
    for g in made:
        if g.state == "instantiated" and g._owner == threading.get_ident():
            g.destroy()


# ---------------------------------------------------------------- blocks built from the library's ops
class MLP:
    """linear -> gelu -> linear, plus the residual: the MLP block of a transformer."""

    def __init__(self, dev: tp.Device, s: tp.Stream, rng: np.random.Generator, d: int = 32) -> None:
        self.s = s
        self.w1, self.b1 = dev.tensor(_f32(rng, 4 * d, d), stream=s), dev.tensor(_f32(rng, 4 * d), stream=s)
        self.w2, self.b2 = dev.tensor(_f32(rng, d, 4 * d), stream=s), dev.tensor(_f32(rng, d), stream=s)

    def __call__(self, x: tp.Tensor) -> tp.Tensor:
        s = self.s
        h = tp.gelu(tp.linear(x, self.w1, self.b1, stream=s), stream=s)
        return tp.add(x, tp.linear(h, self.w2, self.b2, stream=s), stream=s)


class Encoder:
    """A pre-norm transformer encoder block from the library's ops: layer norm (the registered op when it has
    landed, else reduce_mean / sub / mul / rsqrt / add), q / k / v projections, heads as strided views +
    permute, scaled_dot_product_attention, output projection, residual, layer norm, MLP, residual."""

    def __init__(
        self,
        dev: tp.Device,
        s: tp.Stream,
        rng: np.random.Generator,
        b: int = 2,
        t: int = 16,
        d: int = 32,
        h: int = 4,
        fused_ln: bool | None = None,
    ) -> None:
        self.s, self.shape, self.h = s, (b, t, d), h
        self.w = {k: dev.tensor(_f32(rng, d, d), stream=s) for k in "qkvo"}
        self.bias = {k: dev.tensor(_f32(rng, d), stream=s) for k in "qkvo"}
        self.g = [dev.tensor(1 + _f32(rng, d), stream=s) for _ in range(2)]
        self.beta = [dev.tensor(_f32(rng, d), stream=s) for _ in range(2)]
        self.eps = dev.tensor(np.full((1,), 1e-5, np.float32), stream=s)
        self.mlp = MLP(dev, s, rng, d)
        self.fused_ln = ("layer_norm" in tp.registry) if fused_ln is None else fused_ln

    def ln(self, x: tp.Tensor, i: int) -> tp.Tensor:
        s = self.s
        if self.fused_ln:
            out = tp.layer_norm(x, self.g[i], self.beta[i], normalized_shape=(self.shape[2],), stream=s)
            return out[0]  # type: ignore[no-any-return]
        mu = tp.reduce_mean(x, dims=(-1,), keep_dims=True, stream=s)
        xc = tp.sub(x, mu, stream=s)
        var = tp.reduce_mean(tp.mul(xc, xc, stream=s), dims=(-1,), keep_dims=True, stream=s)
        r = tp.rsqrt(tp.add(var, self.eps, stream=s), stream=s)
        return tp.add(tp.mul(tp.mul(xc, r, stream=s), self.g[i], stream=s), self.beta[i], stream=s)

    def heads(self, y: tp.Tensor) -> tp.Tensor:
        b, t, d = self.shape
        v = y.strided((b, t, self.h, d // self.h), (t * d, d, d // self.h, 1))
        return tp.permute(v, dims=(0, 2, 1, 3), stream=self.s)

    def __call__(self, x: tp.Tensor) -> tp.Tensor:
        s, (b, t, d) = self.s, self.shape
        h = self.ln(x, 0)
        q, k, v = (self.heads(tp.linear(h, self.w[n], self.bias[n], stream=s)) for n in "qkv")
        a = tp.permute(tp.scaled_dot_product_attention(q, k, v, stream=s), dims=(0, 2, 1, 3), stream=s)
        a = a.strided((b, t, d), (t * d, d, 1))
        x = tp.add(x, tp.linear(a, self.w["o"], self.bias["o"], stream=s), stream=s)
        return self.mlp(self.ln(x, 1))


def _capture_block(s: tp.Stream, block: Callable[[tp.Tensor], tp.Tensor], x: tp.Tensor) -> tp.Graph:
    with tp.capture(s) as g:
        g.input("x", x)
        g.output("y", block(x))  # intermediates die with the block's frame: the planner may reuse them
    return g


# ---------------------------------------------------------------- replay == eager, bit for bit
def _fused_encoder(dev: tp.Device, s: tp.Stream, rng: np.random.Generator) -> Encoder:
    if "layer_norm" not in tp.registry:
        pytest.skip("upgrades when the layer_norm op lands")
    return Encoder(dev, s, rng, fused_ln=True)


@pytest.mark.parametrize(
    "make",
    [MLP, lambda *a: Encoder(*a, fused_ln=False), _fused_encoder],
    ids=["mlp", "encoder-composite-ln", "encoder-layer-norm-op"],
)
def test_replay_equals_eager_bit_for_bit_under_the_sanitizer(
    make: Any, dev: tp.Device, stream: tp.Stream, rng: np.random.Generator
) -> None:
    with _sanitized():
        block = make(dev, stream, rng)
        x = dev.tensor(_f32(rng, 2, 16, 32, scale=1.0), stream=stream)
        stream.synchronize()
        eager = block(x).numpy()
        g = _capture_block(stream, block, x)
        with g.instantiate():
            arena = f"0x{g._arena.address:x}"
            for _ in range(3):
                out = g.replay(stream)["y"].numpy()
                assert np.array_equal(out, eager)
            x2 = dev.tensor(_f32(rng, 2, 16, 32, scale=1.0), stream=stream)
            stream.synchronize()
            assert np.array_equal(g.replay(stream, x=x2)["y"].numpy(), block(x2).numpy())
            assert np.array_equal(g.replay(stream)["y"].numpy(), eager)  # x left out: the captured x again
        if sanitizer is not None:
            assert not [lk for lk in sanitizer.report(warn=False) if arena in lk.what]  # destroy freed the arena


def test_transformer_block_arena_is_at_most_half_the_one_by_one_sum(
    dev: tp.Device, stream: tp.Stream, rng: np.random.Generator
) -> None:
    block = Encoder(dev, stream, rng)
    x = dev.tensor(_f32(rng, 2, 16, 32), stream=stream)
    stream.synchronize()
    with _capture_block(stream, block, x).instantiate() as g:
        m = g.memory
        assert m.intermediates >= 10
        assert m.peak_bytes <= m.arena_bytes <= 0.5 * m.naive_bytes


def test_explicit_executors_and_plan_calls_are_captured(
    dev: tp.Device, stream: tp.Stream, rng: np.random.Generator
) -> None:
    s = stream
    x = dev.tensor(_f32(rng, 64, 700), stream=s)
    y = dev.empty((64, 700))
    size, ex = tp.ops.softmax.get_workspace_size(x, dim=-1, out=y)
    ex.set_repeatable()
    ws = dev.malloc(size, stream=s)
    z = dev.empty((64,))
    with tp.plan("reduce_sum", y, dims=(1,), out=z, stream=s) as call:
        s.synchronize()
        tp.ops.softmax(ws, size, ex, s)
        call()
        s.synchronize()
        eager_y, eager_z = y.numpy(), z.numpy()
        y.view()[...] = 0
        z.view()[...] = 0
        with tp.capture(s) as g:
            tp.ops.softmax(ws, size, ex, s)  # explicit phase 2
            call()  # a plan call
            w = tp.mul(z, z, stream=s)  # a one-shot call on the captured output
            g.output("w", w)
        assert g.ops == ["softmax", "reduce_sum", "mul"]
        assert y.view().sum() == 0 and z.view().sum() == 0  # recorded, not run
        g.instantiate()
        out = g.replay(s)
        s.synchronize()
        assert np.array_equal(y.numpy(), eager_y) and np.array_equal(z.numpy(), eager_z)
        assert np.array_equal(out["w"].numpy(), eager_z * eager_z)
        tp.ops.softmax(ws, size, ex, s)  # the captured executors still work eagerly
        call()
        s.synchronize()
    ws.free(s)
    ex.destroy()


def test_a_workspace_op_gets_its_workspace_from_the_arena(
    dev: tp.Device, stream: tp.Stream, rng: np.random.Generator
) -> None:
    x = dev.tensor(_f32(rng, 4, 40000), stream=stream)  # long rows: softmax splits them, partials in workspace
    stream.synchronize()
    eager = tp.softmax(tp.add(x, x, stream=stream), dim=-1, stream=stream).numpy()
    with tp.capture(stream) as g:
        g.output("y", tp.softmax(tp.add(x, x, stream=stream), dim=-1, stream=stream))
    g.instantiate()
    assert g.memory.workspaces == 1
    assert np.array_equal(g.replay(stream)["y"].numpy(), eager)


def test_tensors_still_referenced_stay_valid_and_dropped_ones_share_memory(
    dev: tp.Device, stream: tp.Stream, rng: np.random.Generator
) -> None:
    x = dev.tensor(_f32(rng, 256), stream=stream)
    stream.synchronize()
    with tp.capture(stream) as g:
        kept = tp.add(x, x, stream=stream)  # referenced after the capture: readable after replays
        h = kept
        for _ in range(6):
            h = tp.mul(h, x, stream=stream)  # the chain's intermediates are dropped at once
        last = h
        del h
    g.instantiate()
    assert isinstance(kept.block, VirtualBlock) and not kept.block.virtual
    g.replay(stream)
    xs = x.numpy()
    assert np.array_equal(kept.numpy(), xs + xs)
    ref = xs + xs
    for _ in range(6):
        ref = ref * xs
    assert np.array_equal(last.numpy(), ref)
    m = g.memory
    assert m.arena_bytes < m.naive_bytes  # 1 KiB each: kept + two chain slots at most, not 7 slots


# ---------------------------------------------------------------- rebinding and mismatches
def test_rebinding_inputs_and_caller_outputs(dev: tp.Device, stream: tp.Stream, rng: np.random.Generator) -> None:
    a, b = dev.tensor(_f32(rng, 8, 8), stream=stream), dev.tensor(_f32(rng, 8, 8), stream=stream)
    a2, b2 = dev.tensor(_f32(rng, 8, 8), stream=stream), dev.tensor(_f32(rng, 8, 8), stream=stream)
    mine = dev.empty((8, 8))
    stream.synchronize()

    def f(u: tp.Tensor, v: tp.Tensor) -> tp.Tensor:
        return tp.relu(tp.sub(tp.mul(u, v, stream=stream), v, stream=stream), stream=stream)

    with tp.capture(stream) as g:
        g.input("a", a)
        g.input("b", b)
        y = g.output("y", f(a, b))
    g.instantiate()
    steps = g._steps
    out = g.replay(stream)
    assert out["y"] is y and g._steps is steps  # nothing rebound: the prebuilt launches as they are
    ref = lambda u, v: np.maximum(u * v - v, 0)  # noqa: E731
    an, bn, a2n, b2n = a.numpy(), b.numpy(), a2.numpy(), b2.numpy()
    assert np.array_equal(y.numpy(), ref(an, bn))
    out = g.replay(stream, a=a2)
    assert np.array_equal(out["y"].numpy(), ref(a2n, bn))
    assert g._steps[1][0] is steps[1][0] and g._steps[0][0] is not steps[0][0]  # only the node reading 'a'
    out = g.replay(stream, a=a2, b=b2, y=mine)
    assert out["y"] is mine
    assert np.array_equal(mine.numpy(), ref(a2n, b2n))
    before = y.numpy()
    g.replay(stream, b=b2)  # 'a' and 'y' back to the captured tensors
    assert np.array_equal(y.numpy(), ref(an, b2n)) and not np.array_equal(y.numpy(), before)
    g.replay(stream)
    assert np.array_equal(y.numpy(), ref(an, bn)) and g.inputs == {"a": a, "b": b}


def test_mismatched_desc_raises_plan_mismatch_showing_both_descs(dev: tp.Device, stream: tp.Stream) -> None:
    x = dev.tensor(np.ones((4, 8), np.float32), stream=stream)
    stream.synchronize()
    with tp.capture(stream) as g:
        g.input("x", x)
        g.output("y", tp.neg(x, stream=stream))
    g.instantiate()
    for bad in (dev.empty((8, 4)), dev.empty((4, 8), np.float64), x.transpose().transpose().strided((4, 8), (1, 4))):
        with pytest.raises(PlanMismatchError) as info:
            g.replay(stream, x=bad)
        assert isinstance(info.value, ParamError)
        assert repr(x.desc) in str(info.value) and repr(bad.desc) in str(info.value)
        assert info.value.expected == x.desc and info.value.got == bad.desc
    with pytest.raises(PlanMismatchError):
        g.replay(stream, y=dev.empty((4, 9)))
    with pytest.raises(ParamError, match="unknown name"):
        g.replay(stream, z=x)
    with pytest.raises(ParamError, match="a Tensor"):
        g.replay(stream, x=np.ones((4, 8), np.float32))
    with pytest.raises(ParamError, match="stream"):
        g.replay(tp.device("null").stream())
    assert np.array_equal(g.replay(stream)["y"].numpy(), -np.ones((4, 8), np.float32))


def test_a_refused_replay_changes_nothing(dev: tp.Device, stream: tp.Stream, gate: Any) -> None:
    """A replay refused on another stream does not order that stream after the last replay nor become the graph's
    stream; one refused while rebinding (a freed tensor) leaves every node bound as before."""
    x = dev.tensor(np.ones((4, 8), np.float32), stream=stream)
    x2 = dev.tensor(np.full((4, 8), 2, np.float32), stream=stream)
    stream.synchronize()
    with tp.capture(stream) as g:
        g.input("x", x)
        g.output("y", tp.neg(tp.exp(x, stream=stream), stream=stream))
    g.instantiate()
    other = dev.stream()
    ev = gate(stream)
    g.replay(stream)  # pending behind the gate
    with pytest.raises(PlanMismatchError):
        g.replay(other, x=dev.empty((8, 4)))
    assert g._last_stream is stream  # else the next replay on stream would wait for other forever
    ev.set()
    np.testing.assert_allclose(g.replay(stream)["y"].numpy(), -np.e * np.ones((4, 8)), rtol=1e-6)
    assert other.query()  # nothing was enqueued there
    gone = dev.tensor(np.zeros((4, 8), np.float32), stream=stream)
    gone.free(stream)
    stream.synchronize()
    with pytest.raises(tp.InvalidStateError, match="freed"):
        g.replay(stream, x=gone)
    np.testing.assert_allclose(g.replay(stream, x=x2)["y"].numpy(), -np.exp(2) * np.ones((4, 8)), rtol=1e-6)
    np.testing.assert_allclose(g.replay(stream)["y"].numpy(), -np.e * np.ones((4, 8)), rtol=1e-6)
    g.destroy()
    other.close()


def test_declarations_are_checked(dev: tp.Device, stream: tp.Stream) -> None:
    x = dev.tensor(np.ones(4, np.float32), stream=stream)
    stream.synchronize()
    with tp.capture(stream) as g:
        y = tp.neg(x, stream=stream)
        with pytest.raises(CaptureError, match="before the capture"):
            g.input("y", y)
        g.input("x", x)
        with pytest.raises(ParamError, match="already"):
            g.input("x", x)
        with pytest.raises(ParamError, match="memory of input 'x'"):
            g.output("x_again", x)
        with pytest.raises(ParamError, match="identifier"):
            g.output("not a name", y)
    g.instantiate()
    with pytest.raises(InvalidStateError):
        g.output("late", y)


# ---------------------------------------------------------------- what a capture refuses
def test_capture_errors(dev: tp.Device, stream: tp.Stream) -> None:
    other = dev.stream()
    x = dev.tensor(np.ones((4, 4), np.float32), stream=stream)
    stream.synchronize()
    with tp.capture(stream) as g:
        y = tp.add(x, x, stream=stream)
        refused: dict[str, Callable[[], Any]] = {
            "host read of a captured tensor": y.numpy,
            "array protocol": lambda: np.asarray(y),
            "view": y.view,
            "host read of an input": x.numpy,
            "synchronize": stream.synchronize,
            "device synchronize": dev.synchronize,
            "one-shot on another stream": lambda: tp.add(x, x, stream=other),
            "one-shot on the default stream": lambda: tp.add(x, x),
            "event": stream.record_event,
            "callback": lambda: stream.launch_callback(lambda: None),
            "copy-in": lambda: dev.tensor(np.ones(3, np.float32), stream=stream),
            "nested capture": lambda: tp.capture(other).__enter__(),
        }
        for what, fn in refused.items():
            with pytest.raises(CaptureError):
                fn()
            assert issubclass(CaptureError, InvalidStateError), what
        size, ex = tp.ops.neg.get_workspace_size(x, out=dev.empty((4, 4)))
        with pytest.raises(CaptureError, match="while this thread captures"):
            tp.ops.neg(None, size, ex, other)  # explicit phase 2 on another stream
        ex.destroy()
    assert g.ops == ["add"] and g.state == "captured"
    with pytest.raises(InvalidStateError, match="instantiate"):
        g.replay(stream)
    g.instantiate()
    with pytest.raises(InvalidStateError):
        g.instantiate()
    other.close()


def test_capture_of_a_stream_another_thread_captures_is_refused(dev: tp.Device, stream: tp.Stream) -> None:
    entered, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with tp.capture(stream):
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    entered.wait(10)
    try:
        with pytest.raises(CaptureError, match="another thread"):
            tp.capture(stream).__enter__()
        with pytest.raises(CaptureError, match="another thread"):
            tp.neg(dev.empty((2,)), stream=stream)
    finally:
        leave.set()
        t.join()


def test_malloc_inside_a_capture_checks_its_arguments_as_outside(dev: tp.Device, stream: tp.Stream) -> None:
    """The capture's virtual allocator refused numpy byte counts and took any policy or stream; it now takes what
    the pool takes and refuses what the pool refuses."""
    bad: list[dict[str, Any]] = [dict(nbytes=-1), dict(nbytes=2.0), dict(nbytes=True), dict(policy="bogus")]
    bad.append(dict(stream="junk"))

    def all_refused() -> None:
        for kw in bad:
            args = dict(nbytes=64, stream=stream) | kw
            with pytest.raises(ParamError) as e:
                dev.malloc(args.pop("nbytes"), **args)
            assert e.value.op == "malloc" and e.value.arg == next(iter(kw))

    with tp.capture(stream) as g:
        blk = dev.malloc(np.int64(64), stream=stream)
        assert blk.size >= 64
        all_refused()
        blk.free(stream)
    g.destroy()
    all_refused()


def test_everything_is_plain_again_after_a_capture(dev: tp.Device, stream: tp.Stream) -> None:
    plain_build = Op._build_launch
    plain_call = Op.__call__
    x = dev.tensor(np.arange(4, dtype=np.float32), stream=stream)
    with pytest.raises(RuntimeError):
        with tp.capture(stream) as g:
            tp.neg(x, stream=stream)
            raise RuntimeError("the capture block failed")
    assert g.state == "failed"
    with pytest.raises(InvalidStateError):
        g.instantiate()
    assert Op._build_launch is plain_build and Op.__call__ is plain_call
    assert "malloc" not in vars(dev.pool) and "_array_view" not in vars(dev)
    assert stream._enqueue == stream._q.enqueue and type(stream._q).__name__ == "_Queue"
    assert np.array_equal(tp.neg(x, stream=stream).numpy(), -np.arange(4, dtype=np.float32))


def test_failing_node_is_named_at_the_next_sync(dev: tp.Device, stream: tp.Stream) -> None:
    w = dev.tensor(np.ones((4, 3), np.float32), stream=stream)
    idx = dev.tensor(np.array([0, 1], np.int64), stream=stream)
    bad = dev.tensor(np.array([0, 9], np.int64), stream=stream)
    stream.synchronize()
    with tp.capture(stream) as g:
        g.input("idx", idx)
        g.output("y", tp.neg(tp.embedding(w, idx, stream=stream), stream=stream))
    g.instantiate()
    g.replay(stream, idx=bad)
    with pytest.raises(KernelError, match="node 0 .'embedding'. of graph"):
        stream.synchronize()
    assert np.array_equal(g.replay(stream)["y"].numpy(), -np.ones((2, 3), np.float32))


# ---------------------------------------------------------------- counters, trace, streams, lifecycle
def test_counters_count_node_launches_and_trace_nests_nodes_in_the_replay(dev: tp.Device, stream: tp.Stream) -> None:
    x = dev.tensor(np.ones(16, np.float32), stream=stream)
    stream.synchronize()
    with tp.capture(stream) as g:
        g.output("y", tp.sqrt(tp.abs(tp.neg(x, stream=stream), stream=stream), stream=stream))
    g.instantiate()
    before = tp.stats.snapshot()["ops"]["abs"]["phase2_calls"]
    with tp.profile() as prof:
        for _ in range(3):
            g.replay(stream)
    assert tp.stats.snapshot()["ops"]["abs"]["phase2_calls"] == before + 3
    kernels = [e for e in prof.trace()["traceEvents"] if e.get("cat") == "kernel"]
    replays = [e for e in kernels if e["name"] == str(g)]
    nodes = [e for e in kernels if e["name"] in ("neg", "abs", "sqrt")]
    assert len(replays) == 3 and len(nodes) == 9
    for r in replays:
        inside = [e for e in nodes if r["ts"] <= e["ts"] and e["ts"] + e["dur"] <= r["ts"] + r["dur"] + 1e-3]
        assert [e["name"] for e in inside] == ["neg", "abs", "sqrt"]
        assert all(e["tid"] == r["tid"] for e in inside)


def test_replay_on_another_stream_waits_for_the_previous_replay(
    dev: tp.Device, stream: tp.Stream, gate: Callable[[tp.Stream], threading.Event]
) -> None:
    other = dev.stream()
    x = dev.tensor(np.ones(8, np.float32), stream=stream)
    stream.synchronize()
    with tp.capture(stream) as g:
        y = g.output("y", tp.add(x, x, stream=stream))
    g.instantiate()
    open_ = gate(stream)
    g.replay(stream)
    g.replay(other)
    assert not other.query()  # ordered after the gated replay: they share the arena
    open_.set()
    other.synchronize()
    assert np.array_equal(y.numpy(), np.full(8, 2, np.float32))
    g.destroy()
    other.close()


def test_null_device_capture_and_replay_run_no_kernel() -> None:
    dev = tp.device("null")
    s = dev.stream()
    a, b = dev.empty((32,)), dev.empty((32,))
    with tp.capture(s) as g:
        g.input("a", a)
        g.output("y", tp.mul(tp.add(a, b, stream=s), b, stream=s))
    with g.instantiate():
        for _ in range(3):
            g.replay(s, a=dev.empty((32,)))
        assert g.replays == 3


def test_destroy_frees_the_arena_and_the_executors(dev: tp.Device, stream: tp.Stream) -> None:
    x = dev.tensor(np.ones(1000, np.float32), stream=stream)
    stream.synchronize()
    live0 = tp.ops.exp.counters.as_dict()["executors_live"]
    allocated0 = dev.pool.stats()["allocated_bytes"]
    with tp.capture(stream) as g:
        y = g.output("y", tp.exp(tp.exp(x, stream=stream), stream=stream))
    g.instantiate()
    assert dev.pool.stats()["allocated_bytes"] > allocated0
    assert tp.ops.exp.counters.as_dict()["executors_live"] == live0 + 2
    g.replay(stream)
    g.destroy()
    assert dev.pool.stats()["allocated_bytes"] == allocated0
    assert tp.ops.exp.counters.as_dict()["executors_live"] == live0
    assert y.block.freed
    with pytest.raises(InvalidStateError):
        g.destroy()
    with pytest.raises(InvalidStateError):
        g.replay(stream)


def test_replay_from_another_thread_is_refused(dev: tp.Device, stream: tp.Stream) -> None:
    x = dev.tensor(np.ones(4, np.float32), stream=stream)
    stream.synchronize()
    with tp.capture(stream) as g:
        tp.neg(x, stream=stream)
    g.instantiate()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            g.replay(stream)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], InvalidStateError)


def test_graphs_are_made_by_capture() -> None:
    with pytest.raises(TypeError, match="capture"):
        tp.Graph()
    with pytest.raises(ParamError):
        tp.capture("not a stream").__enter__()  # type: ignore[arg-type]


def test_launch_blocking_switched_by_another_thread_mid_capture_applies_when_it_ends(
    dev: tp.Device, stream: tp.Stream
) -> None:
    """The capture goes on recording; once it ends the stream runs its tasks inline, as the setting says."""
    x = dev.tensor(np.ones((8, 8), np.float32), stream=stream)
    stream.synchronize()
    recorded, go = threading.Event(), threading.Event()
    graphs: list[tp.Graph] = []
    errors: list[BaseException] = []

    def capture() -> None:
        try:
            with tp.capture(stream) as g:
                tp.relu(x, stream=stream)
                recorded.set()
                go.wait(30)
                tp.relu(x, stream=stream)
            graphs.append(g)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)
            recorded.set()

    t = threading.Thread(target=capture)
    t.start()
    recorded.wait(30)
    try:
        tp.set_launch_blocking(True)
        go.set()
        t.join(30)
        assert errors == [] and len(graphs[0]) == 2
        assert tp.settings.launch_blocking and stream.blocking
        ran_on: list[int] = []
        stream.launch_callback(lambda: ran_on.append(threading.get_ident()))
        assert ran_on == [threading.get_ident()]
    finally:
        go.set()
        tp.set_launch_blocking(False)
    assert not stream.blocking


def test_launch_blocking_switched_by_the_capturing_thread_keeps_the_capture(dev: tp.Device, stream: tp.Stream) -> None:
    x = dev.tensor(np.ones((8, 8), np.float32), stream=stream)
    try:
        with tp.capture(stream) as g:
            tp.relu(x, stream=stream)
            tp.set_launch_blocking(True)
            assert stream.blocking
            tp.relu(x, stream=stream)
        assert len(g) == 2 and tp.settings.launch_blocking and stream.blocking
    finally:
        tp.set_launch_blocking(False)
    assert not stream.blocking


def test_rebinding_one_view_of_a_block_leaves_its_other_views(dev: tp.Device, stream: tp.Stream) -> None:
    """Inputs are named by their view, not their whole block: rebinding a leaves b (the block's other half) alone,
    and b may be named too."""
    big = dev.tensor(np.arange(8, dtype=np.float32), stream=stream)
    a, b = big.strided((4,), (1,), 0), big.strided((4,), (1,), 4)
    stream.synchronize()
    with tp.capture(stream) as g:
        g.input("a", a)
        g.input("b", b)
        g.output("y", tp.mul(a, b, stream=stream))
    g.instantiate()
    np.testing.assert_array_equal(g.replay(stream)["y"].numpy(), np.arange(4) * np.arange(4, 8))
    big2 = dev.tensor(np.array([10, 20, 30, 40, -1, -2, -3, -4], np.float32), stream=stream)
    a2 = big2.strided((4,), (1,), 0)
    np.testing.assert_array_equal(g.replay(stream, a=a2)["y"].numpy(), np.array([10, 20, 30, 40]) * np.arange(4, 8))
    b2 = big2.strided((4,), (1,), 4)
    np.testing.assert_array_equal(g.replay(stream, b=b2)["y"].numpy(), np.arange(4) * -np.arange(1, 5))
    g.destroy()
    with tp.capture(stream) as g2:
        g2.input("a", a)
        with pytest.raises(ParamError, match="memory not named yet"):
            g2.input("whole", big)  # overlaps a
        g2.output("y", tp.mul(big, big, stream=stream))  # reads across a's edge
    g2.instantiate()
    with pytest.raises(ParamError, match="across its edge"):
        g2.replay(stream, a=a2)
    g2.destroy()


def test_an_output_fed_back_as_the_next_input_is_refused(dev: tp.Device, stream: tp.Stream) -> None:
    """A replay overwrites its arena while it reads its inputs: feeding an arena output back in would read
    intermediates; a copy of it is fine."""
    h0 = dev.tensor(np.arange(4, dtype=np.float32), stream=stream)
    stream.synchronize()
    with tp.capture(stream) as g:
        g.input("h", h0)
        t = tp.mul(h0, h0, stream=stream)
        t = tp.add(t, t, stream=stream)
        g.output("y", tp.add(t, h0, stream=stream))  # 2 h^2 + h
    g.instantiate()
    y1 = g.replay(stream)["y"]
    with pytest.raises(ParamError, match="own arena"):
        g.replay(stream, h=y1)
    h1 = tp.contiguous(y1, stream=stream)  # outside the arena
    a = y1.numpy()
    np.testing.assert_array_equal(g.replay(stream, h=h1)["y"].numpy(), 2 * a * a + a)
    g.destroy()
    h1.free(stream)


def test_a_host_input_inside_a_capture_is_refused_by_name_and_leaves_nothing_allocated(dev, stream, rng):
    a = rng.standard_normal(8).astype(np.float32)
    x = dev.tensor(a, stream=stream)
    with tp.capture(stream) as g:
        g.input("x", x)
        with pytest.raises(CaptureError, match="copied in during a capture") as e:
            tp.add(x, 2.0, stream=stream)
        assert e.value.op == "add" and e.value.arg == "other"
        with pytest.raises(CaptureError, match="copied in during a capture"):
            dev.tensor(a, stream=stream)
        assert all(g._vfreed)  # the copies' virtual blocks were given back
        g.output("y", tp.mul(x, x, stream=stream))
    g.instantiate()
    try:
        np.testing.assert_allclose(g.replay(stream)["y"].numpy(), a.astype(np.float64) ** 2, rtol=1e-6)
    finally:
        g.destroy()
        x.free(stream)


def test_a_tensor_freed_during_a_capture_waits_for_the_real_work_on_its_stream(dev, gate):
    """A free on the captured stream recorded the capture's stand-in queue, which counts as done once the capture
    ends: another stream got the memory while the real work that reads it was still queued (wrong results)."""
    s, s2 = dev.stream(), dev.stream()
    x = dev.tensor(np.ones(4096, np.float32), stream=s)
    s.synchronize()
    opened = gate(s)
    y = tp.mul(x, 2.0, stream=s)  # pending: reads x
    with tp.capture(s) as g:
        x.free(s)  # freed in s's order, while s is captured
        g.input("y", y)
        g.output("z", tp.exp(y, stream=s))
    j = dev.tensor(np.full(4096, 1e3, np.float32), stream=s2)  # another stream, the same size, right away
    s2.synchronize()
    opened.set()
    np.testing.assert_array_equal(y.numpy(), 2.0)
    for t, st in ((j, s2), (y, s)):
        t.free(st)
    g.destroy()


# ---------------------------------------------------------------- found by a bug hunt (session 35)
def _exp_graph(x: tp.Tensor, s: tp.Stream) -> tp.Graph:
    """An instantiated graph of ``y = exp(x)`` with input ``x`` and output ``y`` named."""
    with tp.capture(s) as g:
        g.input("x", x)
        g.output("y", tp.exp(x, stream=s))
    return g.instantiate()


def test_the_first_replay_on_another_stream_waits_for_the_capture_streams_work(dev, gate, rng):
    """The arena is allocated in the capture stream's order: it may be a block that stream's pending work still
    writes. A first replay on another stream was not ordered after that work, which then overwrote its result."""
    s, o = dev.stream(), dev.stream()
    a = _f32(rng, 1 << 14)
    x = dev.tensor(a, stream=s)
    s.synchronize()
    opened = gate(s)
    t = dev.empty((1 << 14,))
    tp.neg(x, out=t, stream=s)  # pending on s: writes t's block
    t.free(s)  # reusable in s's order at once: the arena gets it
    g = _exp_graph(x, s)
    assert g._arena.address == t.block.address  # the case under test: the arena is t's memory
    y = g.replay(o)["y"]
    threading.Timer(0.2, opened.set).start()  # the replay must wait for it
    o.synchronize()
    s.synchronize()
    np.testing.assert_allclose(y.numpy(), np.exp(a.astype(np.float64)), rtol=1e-6)
    g.destroy()
    x.free(s)


def test_a_refused_or_failed_replay_on_another_stream_keeps_the_graphs_stream_order(dev, stream, rng):
    """The graph took the new stream as its last one before the enqueue: after a replay refused (the stream is
    being captured) or failed at launch (launch blocking), the next replay waited for a sequence number of the
    wrong stream and hung."""
    a = _f32(rng, 64)
    x = dev.tensor(a, stream=stream)
    g = _exp_graph(x, stream)
    for _ in range(4):
        g.replay(stream)
    other = dev.stream()
    with tp.capture(other):
        with pytest.raises(CaptureError):
            g.replay(other)
    assert g._last_stream is stream
    np.testing.assert_allclose(g.replay(stream)["y"].numpy(), np.exp(a.astype(np.float64)), rtol=1e-6)

    table = dev.tensor(_f32(rng, 4, 3), stream=stream)
    idx = dev.tensor(np.array([0, 3], np.int64), stream=stream)
    with tp.capture(stream) as g2:
        g2.input("idx", idx)
        g2.output("y", tp.embedding(table, idx, stream=stream))
    g2.instantiate()
    for _ in range(3):
        g2.replay(stream)
    bad = dev.tensor(np.array([0, 9], np.int64), stream=stream)
    stream.synchronize()
    b = dev.stream()
    tp.set_launch_blocking(True)
    try:
        with pytest.raises(tp.TwoPhaseError):
            g2.replay(b, idx=bad)
    finally:
        tp.set_launch_blocking(False)
    assert g2._last_stream is stream
    y = g2.replay(stream, idx=idx)["y"]
    np.testing.assert_array_equal(y.numpy(), table.numpy()[[0, 3]])
    g2.destroy()
    for t in (x, table, idx, bad):
        t.free(stream)


def test_ending_a_capture_keeps_another_threads_newer_use_of_a_tensor(dev, gate, rng):
    """The capture put back the use mark a captured tensor had before it, erasing a write another thread queued on
    another stream meanwhile: a host read of the tensor returned before that write ran."""
    s, t = dev.stream(), dev.stream()
    src_a = _f32(rng, 1024)
    w = dev.tensor(np.zeros(1024, np.float32), stream=s)
    src = dev.tensor(src_a, stream=t)
    s.synchronize()
    t.synchronize()
    opened = gate(t)
    with tp.capture(s) as g:
        g.input("w", w)
        g.output("y", tp.exp(w, stream=s))
        th = threading.Thread(target=lambda: tp.neg(src, out=w, stream=t))
        th.start()
        th.join()
    threading.Timer(0.2, opened.set).start()
    np.testing.assert_array_equal(w.numpy(), -src_a)  # waits for t's write
    g.destroy()
    w.free(t)
    src.free(t)


def test_a_plan_cache_used_inside_a_capture_serves_nothing_to_eager_callers(dev, stream, rng):
    """A planned call made during a capture holds the graph's virtual blocks: cached, it was served to eager
    callers afterwards (a KernelError, or results written into the graph's own output)."""
    a1, a2 = _f32(rng, 4, 8), _f32(rng, 4, 8)
    u1, u2 = dev.tensor(a1, stream=stream), dev.tensor(a2, stream=stream)
    pc = tp.PlanCache()
    with tp.capture(stream) as g:
        g.input("u", u1)
        with pc.lease("add", u1, u1, stream=stream) as call:
            g.output("y", call())
    assert len(pc) == 0
    g.instantiate()
    y = g.replay(stream)["y"]
    np.testing.assert_allclose(y.numpy(), 2.0 * a1, rtol=1e-6)
    with pc.lease("add", u2, u2, stream=stream) as call:
        r = call()
        assert r is not y and type(r.block) is not VirtualBlock
        np.testing.assert_allclose(r.numpy(), 2.0 * a2, rtol=1e-6)
    np.testing.assert_allclose(y.numpy(), 2.0 * a1, rtol=1e-6)
    stream.synchronize()
    pc.clear()
    g.destroy()
    u1.free(stream)
    u2.free(stream)


def test_a_failed_instantiate_leaves_no_executor_and_no_tensor_on_the_freed_arena(dev, stream, rng):
    """An overlapping ``out=`` is refused only when instantiate binds it: the executor whose binding failed stayed
    live, and the caller's captured tensors kept pointing into the arena just freed (reading someone else's data)."""
    x = dev.tensor(_f32(rng, 64), stream=stream)
    live = tp.ops.exp.counters.as_dict()["executors_live"]
    with tp.capture(stream) as g:
        h = tp.neg(x, stream=stream)
        tp.exp(h.strided((32,), (1,), 0), out=h.strided((32,), (1,), 16), stream=stream)
    with pytest.raises(ParamError, match="overlapping") as e:
        g.instantiate()
    assert e.value.__notes__ == [f"refused at instantiate: node 1 ('exp') of {g.describe()}"]
    assert tp.ops.exp.counters.as_dict()["executors_live"] == live
    assert h.block.virtual
    z = dev.tensor(np.full(64, 9.0, np.float32), stream=stream)
    with pytest.raises(CaptureError, match="no memory"):
        h.numpy()
    g.destroy()
    for t in (x, z):
        t.free(stream)


def test_a_captured_tensor_used_before_instantiate_raises_a_capture_error(dev, stream, rng):
    """Views of virtual tensors were refused only while the capture ran; after it, a TypeError from numpy."""
    x = dev.tensor(_f32(rng, 16), stream=stream)
    with tp.capture(stream) as g:
        g.input("x", x)
        y = g.output("y", tp.exp(x, stream=stream))
    for use in (lambda: tp.neg(y, stream=stream), y.view):
        with pytest.raises(CaptureError, match="no memory until the graph is instantiated"):
            use()
    g.instantiate()
    np.testing.assert_allclose(g.replay(stream)["y"].numpy(), np.exp(x.numpy().astype(np.float64)), rtol=1e-6)
    g.destroy()
    x.free(stream)


def test_a_dlpack_export_of_a_graph_output_keeps_the_arena_after_destroy(dev, stream, rng):
    a = _f32(rng, 4096)
    x = dev.tensor(a, stream=stream)
    g = _exp_graph(x, stream)
    held = np.from_dlpack(g.replay(stream)["y"])
    g.destroy()
    other = dev.tensor(np.full(4096, -123.0, np.float32), stream=stream)
    stream.synchronize()
    np.testing.assert_allclose(held, np.exp(a.astype(np.float64)), rtol=1e-6)
    del held
    other.free(stream)
    x.free(stream)


def test_rebinding_follows_elements_not_byte_spans(dev, stream, rng):
    """An operand of the named tensor's block was taken as a use of the named view when its byte span lay inside
    the view's, even sharing no element (odd columns against even ones); and a named view of an arena
    intermediate whose node writes all of it was rebound, writing the whole intermediate into the caller's
    buffer."""
    b1, b2 = _f32(rng, 8, 8), _f32(rng, 8, 8)
    big, big2 = dev.tensor(b1, stream=stream), dev.tensor(b2, stream=stream)
    even, odd = big.strided((8, 4), (8, 2), 0), big.strided((8, 3), (8, 2), 1)
    with tp.capture(stream) as g:
        g.input("a", even)
        g.output("ya", tp.neg(even, stream=stream))
        g.output("yodd", tp.neg(odd, stream=stream))
    g.instantiate()
    out = g.replay(stream, a=big2.strided((8, 4), (8, 2), 0))
    np.testing.assert_array_equal(out["ya"].numpy(), -b2[:, 0::2])
    np.testing.assert_array_equal(out["yodd"].numpy(), -b1[:, 1:7:2])
    g.destroy()

    with tp.capture(stream) as g2:
        g2.input("x", big)
        z = tp.neg(big, stream=stream)
        g2.output("y", z.strided((8, 2), (8, 1), 0))
    g2.instantiate()
    buf = dev.tensor(b2, stream=stream)
    with pytest.raises(ParamError, match="across its edge"):
        g2.replay(stream, y=buf.strided((8, 2), (8, 1), 0))
    np.testing.assert_array_equal(buf.numpy(), b2)
    np.testing.assert_array_equal(g2.replay(stream)["y"].numpy(), -b1[:, :2])
    g2.destroy()
    for t in (big, big2, buf):
        t.free(stream)


def test_each_replay_returns_its_own_outputs_dict(dev, stream, rng):
    """replay() returned one dict, updated in place by the next replay: the outputs of a replay into the caller's
    buffer were replaced by the arena's when the next replay used the default binding."""
    a = _f32(rng, 16)
    x = dev.tensor(a, stream=stream)
    g = _exp_graph(x, stream)
    mine = dev.empty((16,))
    first = g.replay(stream, y=mine)
    second = g.replay(stream)
    assert first["y"] is mine and second["y"] is not mine
    np.testing.assert_allclose(first["y"].numpy(), np.exp(a.astype(np.float64)), rtol=1e-6)
    g.destroy()
    for t in (x, mine):
        t.free(stream)


def test_destroy_waits_for_an_eager_op_still_reading_a_graph_output(dev, gate, rng):
    """The arena was freed at destroy while an op queued on another stream still read an output: its use marks the
    output's virtual block, which the arena's free did not see."""
    s, other = dev.stream(), dev.stream()
    a = _f32(rng, 64, 64)
    x = dev.tensor(a, stream=s)
    with tp.capture(s) as g:
        g.input("x", x)
        g.output("y", tp.neg(x, stream=s))
    g.instantiate()
    y = g.replay(s)["y"]
    s.synchronize()
    opened = gate(other)
    z = tp.exp(y, stream=other)
    g.destroy()
    junk = dev.tensor(np.full((64, 64), 1e30, np.float32), stream=s)  # may take the arena's memory
    threading.Timer(0.3, opened.set).start()
    s.synchronize()  # the copy-in waits for the read on `other` now
    np.testing.assert_allclose(z.numpy(), np.exp(-a.astype(np.float64)), rtol=1e-6)
    for t, st in ((z, other), (junk, s), (x, s)):
        t.free(st)


def test_a_capture_refuses_what_eager_code_refuses(dev, stream, rng):
    """A freed intermediate used again inside the capture was recorded (eager code: InvalidStateError); a replay of
    another graph bound to a tensor of the running capture was accepted and failed at sync; instantiate inside
    another capture raised numpy's TypeError (its arena was a virtual block of that capture)."""
    x = dev.tensor(_f32(rng, 4, 8), stream=stream)
    with tp.capture(stream) as g1:
        g1.input("x", x)
        g1.output("y", tp.exp(x, stream=stream))
    with tp.capture(stream) as g2:
        h = tp.relu(x, stream=stream)
        v = h.strided((8, 4), (1, 8), 0)
        h.free(stream)
        for t in (h, v):
            with pytest.raises(InvalidStateError, match="freed"):
                tp.neg(t, stream=stream)
        never = dev.empty((4, 8))  # allocated in the capture, used by no node
        with pytest.raises(CaptureError, match="cannot be instantiated while this thread captures"):
            g1.instantiate()
        g2.output("z", tp.neg(x, stream=stream))
    assert g2.ops == ["relu", "neg"]
    g2.instantiate()
    for t, why in ((h, "was freed there"), (never, "that no node of it used has no memory")):
        with pytest.raises(InvalidStateError, match=why):
            t.numpy()  # it said "no memory yet: read it after graph.instantiate()", already done
    g1.instantiate()
    other = dev.stream()
    with tp.capture(stream) as g3:
        h3 = tp.neg(x, stream=stream)
        with pytest.raises(CaptureError, match="no memory until the graph is instantiated"):
            g1.replay(other, x=h3)
        g3.output("w", h3)
    other.synchronize()  # nothing failed there
    np.testing.assert_allclose(g1.replay(other)["y"].numpy(), np.exp(x.numpy().astype(np.float64)), rtol=1e-6)
    for g in (g1, g2, g3):
        g.destroy()
    x.free(stream)


def test_a_failed_instantiate_leaves_a_named_output_freed_in_the_capture_freed(dev, stream, rng):
    x = dev.tensor(_f32(rng, 64), stream=stream)
    with tp.capture(stream) as g:
        y = g.output("y", tp.neg(x, stream=stream))
        y.free(stream)
        h = tp.neg(x, stream=stream)
        tp.exp(h.strided((32,), (1,), 0), out=h.strided((32,), (1,), 16), stream=stream)
    with pytest.raises(ParamError, match="overlapping"):
        g.instantiate()
    with pytest.raises(CaptureError, match="freed twice"):
        y.free(stream)
    g.destroy()
    x.free(stream)


def test_rebinding_an_input_while_earlier_replays_are_queued_under_the_sanitizer(
    dev: tp.Device, stream: tp.Stream, rng: np.random.Generator
) -> None:
    """The pipelined pattern: a fresh input each replay, no sync between. Each queued replay's nodes were checked
    against the executors' newest binding (the next replay's input, whose canary fill was still queued behind):
    a false GuardError at sync that dropped the later replays. The replay checks the operands it ran with."""
    x = tp.device("cpu").tensor(_f32(rng, 8, 8), stream=stream)
    stream.synchronize()
    with _sanitized():
        with tp.capture(stream) as g:
            g.input("x", x)
            h = tp.softmax(x, dim=-1, stream=stream)
            for _ in range(10):
                h = tp.tanh(h, stream=stream)
            g.output("y", h)
        g.instantiate()
        xs, ins, outs = [], [], []
        for _ in range(6):
            xa = _f32(rng, 8, 8)
            x2 = dev.tensor(xa, stream=stream)
            y = dev.empty((8, 8), "float32", stream=stream)
            g.replay(stream, x=x2, y=y)
            xs.append(xa)
            ins.append(x2)
            outs.append(y)
        stream.synchronize()
        for xa, y in zip(xs, outs):
            want = np.exp(xa - xa.max(-1, keepdims=True))
            want = want / want.sum(-1, keepdims=True)
            for _ in range(10):
                want = np.tanh(want)
            np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-6)
        g.destroy()
        for t in (*ins, *outs):
            t.free()


def test_destroy_while_this_thread_captures_the_last_replays_stream_changes_nothing(
    dev: tp.Device, stream: tp.Stream, gate: Callable[[tp.Stream], threading.Event]
) -> None:
    """destroy cannot synchronize the stream this thread is capturing: it raised, but had already freed the arena
    and destroyed the executors under the replay still queued (which then failed under a task listener)."""
    x = dev.tensor(np.arange(16, dtype=np.float32), stream=stream)
    stream.synchronize()
    with tp.capture(stream) as g1:
        g1.input("x", x)
        g1.output("y", tp.neg(x, stream=stream))
    g1.instantiate()
    opened = gate(stream)
    with tp.profile():
        y = g1.replay(stream)["y"]
        with tp.capture(stream) as g2:
            tp.exp(x, stream=stream)
            with pytest.raises(CaptureError, match="being captured by this thread"):
                g1.destroy()
            assert g1.state == "instantiated"
        opened.set()
        stream.synchronize()
    np.testing.assert_array_equal(y.numpy(), -np.arange(16, dtype=np.float32))
    g2.destroy()
    g1.destroy()
    assert g1.state == "destroyed"
    x.free()


def test_a_tensor_of_a_failed_capture_says_the_capture_failed(dev: tp.Device, stream: tp.Stream) -> None:
    x = dev.tensor(np.ones((4, 4), np.float32), stream=stream)
    w = dev.tensor(np.ones((3, 5), np.float32), stream=stream)
    stream.synchronize()
    with pytest.raises(ParamError):
        with tp.capture(stream) as g:
            h = tp.relu(x, stream=stream)  # a node uses h
            tp.matmul(h, w, stream=stream)  # refused: the capture fails
    assert g.state == "failed"
    with pytest.raises(InvalidStateError, match="the capture failed"):
        h.numpy()
    g.destroy()
    x.free()
    w.free()


def test_a_destroyed_graphs_output_kept_by_the_caller_does_not_keep_the_arena_mapped(
    dev: tp.Device, stream: tp.Stream
) -> None:
    import gc
    import weakref

    if tp.settings.sanitize:
        pytest.skip("the sanitizer keeps a freed block's guarded view for its later checks")
    with tp.capture(stream) as g:
        e = dev.empty((1 << 21,), stream=stream)  # 8 MiB: an arena with a segment of its own
        g.output("y", tp.neg(e, out=e, stream=stream))
        del e
    g.instantiate()
    y = g.replay(stream)["y"]
    tp.reduce_sum(y, dims=(0,), stream=stream).free(stream)  # an eager op on y: a cached view of it
    y.numpy()
    arena = weakref.ref(g._arena.segment.memory.base)
    g.destroy()
    dev.pool.empty_cache()
    gc.collect()
    assert y.block.freed and arena() is None


def test_a_captured_launch_leaves_the_marks_of_its_real_blocks_as_they_were(
    dev: tp.Device, stream: tp.Stream, gate: Callable[[tp.Stream], threading.Event]
) -> None:
    """A captured phase 2 marked its blocks with the capture's seq (work before the capture): x's pending write
    on another stream t was hidden from a host read during the capture, and from a second capture that saved the
    mark as x's own and put it back; a workspace used by a captured launch kept the mark for good, so a free
    without a stream handed it out while a launch on t still used it."""
    t = dev.stream()
    src = dev.tensor(np.arange(64, dtype=np.float32), stream=t)
    x = dev.tensor(np.zeros(64, np.float32), stream=t)
    im = dev.tensor(np.ones((1, 2, 8, 8), np.float32), stream=t)
    k = dev.tensor(np.ones((2, 2, 3, 3), np.float32), stream=t)
    t.synchronize()
    size, ex = tp.ops.conv2d.get_workspace_size(im, k)
    (conv_out,) = ex._bind_new_outputs(dev, t)
    ws = dev.malloc(size, stream=t)
    opened = gate(t)
    tp.neg(src, out=x, stream=t)  # pending write of x on t
    tp.ops.conv2d(ws, size, ex, t)  # pending use of ws on t
    before = {"x": (x.block._stream, x.block._seq), "ws": (ws._stream, ws._seq)}
    read: list[float] = []
    with tp.capture(stream) as g:
        g.output("y", tp.exp(x, stream=stream))
        _, ex2 = tp.ops.conv2d.get_workspace_size(im, k)
        g.output("z", ex2._bind_new_outputs(dev, stream)[0])
        tp.ops.conv2d(ws, size, ex2, stream)
        assert (x.block._stream, x.block._seq) == before["x"]
        reader = threading.Thread(target=lambda: read.append(float(x.numpy()[1])))
        reader.start()
        reader.join(0.2)
        assert read == []  # waits for t's write
    assert (x.block._stream, x.block._seq) == before["x"] and (ws._stream, ws._seq) == before["ws"]
    addr = ws.address
    ws.free()
    other = dev.malloc(size)
    assert other.address != addr  # ws still in use on t
    opened.set()
    reader.join(5)
    assert read == [-1.0]
    t.synchronize()
    other.free()
    conv_out.free()
    g.destroy()
    for a in (src, x, im, k):
        a.free()


def test_a_replay_waits_for_an_eager_read_of_an_arena_output_on_another_stream(
    dev: tp.Device, stream: tp.Stream, gate: Callable[[tp.Stream], threading.Event]
) -> None:
    """y = replay on a; z = contiguous(y) on a; replay on b. The replay on b waited only for a's replay, not for
    the read after it: it overwrote y's arena bytes before the read ran (z held the second replay's result)."""
    a, b = stream, dev.stream()
    x1 = dev.tensor(np.arange(64, dtype=np.float32), stream=a)
    x2 = dev.tensor(np.full(64, 100.0, np.float32), stream=a)
    a.synchronize()
    with tp.capture(a) as g:
        g.input("x", x1)
        g.output("y", tp.neg(x1, stream=a))
    g.instantiate()
    y = g.replay(a, x=x1)["y"]
    opened = gate(a)  # the read of y waits behind it
    z = tp.contiguous(y, stream=a)
    threading.Timer(0.1, opened.set).start()
    g.replay(b, x=x2)
    b.synchronize()
    np.testing.assert_array_equal(z.numpy(), -np.arange(64, dtype=np.float32))
    np.testing.assert_array_equal(y.numpy(), np.full(64, -100.0, np.float32))
    g.destroy()
    for t in (x1, x2, z):
        t.free()
