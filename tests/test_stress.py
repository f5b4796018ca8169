"""Stress and soak: threads of one-shot calls checked against the reference, a 200,000-call soak over 1,000 shapes
with the executor cache capped at 256, and a kernel that fails in the middle of a sequence."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import twophase as tp
from twophase import config
from twophase.op import Op, OpDef, Plan


def _live_executors() -> int:
    return sum(len(op.counters.live) for op in tp.registry.values())


@pytest.mark.slow
def test_four_threads_of_2000_one_shot_calls_give_no_wrong_result_and_leave_no_residue() -> None:
    dev = tp.device("cpu")
    dev.synchronize()
    base_exec, base_alloc = _live_executors(), dev.pool.stats()["allocated_bytes"]
    wrong: list[str] = []

    def worker(k: int) -> None:
        rng = np.random.default_rng(k)
        s = dev.default_stream
        for i in range(2000):
            n = 1 + (i // 3) % 17  # the shape changes every few calls
            x = rng.standard_normal((n, 3)).astype(np.float32)
            tx = dev.tensor(x, stream=s)
            y = tp.add(tx, tx, stream=s) if i % 2 else tp.relu(tx, stream=s)
            got = y.numpy()
            want = x + x if i % 2 else np.maximum(x, 0)
            if not np.array_equal(got, want):
                wrong.append(f"thread {k} call {i}")
            tx.free(s)
            y.free(s)
        s.synchronize()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    assert _live_executors() == base_exec
    assert dev.pool.stats()["allocated_bytes"] == base_alloc


@pytest.mark.slow
def test_soak_200k_calls_over_1000_shapes_with_the_cache_capped_at_256() -> None:
    dev = tp.device("null")
    s = dev.stream()
    old = config.settings.cache_limit
    config.set_cache_limit(256)
    tp.clear_cache()
    f = tp.one_shot(tp.ops.neg)
    peak_live = 0
    try:
        descs = [dev.empty((1 + i,), tp.DType.float32) for i in range(1000)]
        reserved0 = dev.pool.stats()["reserved_bytes"]
        for i in range(200_000):
            y = f(descs[(i * 7919) % 1000], stream=s)
            y.free(s)
            if i % 1000 == 0:
                peak_live = max(peak_live, _live_executors())
                assert tp.cache_info()["size"] <= 256
        st = dev.pool.stats()
        assert peak_live <= 256
        assert tp.cache_info()["size"] <= 256
        # every output fits in one 2 MiB segment next to the inputs: reserved memory must not creep
        assert st["reserved_bytes"] <= reserved0 + (2 << 20), st
        for t in descs:
            t.free()
    finally:
        config.set_cache_limit(old)


def test_a_kernel_failing_mid_sequence_surfaces_at_sync_and_the_stream_recovers() -> None:
    calls = [0]

    def build(plan: Plan, attrs: Any, ins: Any, outs: Any) -> Any:
        x, out = ins[0], outs[0]

        def launch(ws: Any) -> None:
            calls[0] += 1
            if calls[0] == 3:
                raise FloatingPointError("injected fault")
            np.negative(x, out=out)

        return launch

    op = Op(
        OpDef(
            name="flaky_stress",
            inputs=("x",),
            infer=lambda i, a: (tp.TensorDesc(i[0].shape, i[0].dtype),),
            select=lambda *a: Plan("flaky", None, 256),
            kernels={"cpu": build},
        )
    )
    dev = tp.device("cpu")
    s = dev.stream()
    with tp.sanitizer.sanitize():
        token = tp.sanitizer.mark()
        x = dev.tensor(np.ones(8, np.float32), stream=s)
        outs = []
        for _ in range(5):
            size, ex = op.get_workspace_size(x)
            y = dev.empty_like(ex.output_descs[0], s)
            ex.set_output(0, y)
            ws = dev.malloc(size, stream=s)
            op(ws, size, ex, s)
            ws.free(s)
            outs.append(y)
        with pytest.raises(tp.KernelError, match="op 'flaky_stress'.*injected fault.*2 later task"):
            s.synchronize()
        y = tp.neg(x, stream=s)  # the stream works again
        np.testing.assert_array_equal(y.numpy(), -1)
        for t in (x, y, *outs):
            t.free(s)
        s.synchronize()
        assert tp.sanitizer.report(since=token, warn=False) == []
    assert len(op.counters.live) == 0
