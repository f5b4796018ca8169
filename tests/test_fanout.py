"""Helper-thread fan-out (runtime.fanout), numpy's OpenBLAS left as the environment sets it and run on one
thread inside parts (blas.serial_calls), and the ops whose launches are cut into parts, checked in 3 parts
against float64 references with poisoned outputs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_layouts import on_device

import twophase
from twophase import ops
from twophase.kernels.cpu import attention as attention_kernels
from twophase.kernels.cpu import blas
from twophase.kernels.cpu import conv as conv_kernels
from twophase.kernels.cpu import elementwise as elementwise_kernels
from twophase.kernels.cpu import groupnorm as groupnorm_kernels
from twophase.kernels.cpu import norm as norm_kernels
from twophase.kernels.cpu import reduce as reduce_kernels
from twophase.ops.attention import reference as sdpa_reference
from twophase.ops.conv import reference as conv_reference
from twophase.ops.selection import forced
from twophase.runtime import fanout as fanout_module
from twophase.runtime.device import device
from twophase.runtime.fanout import fanout_parts, run_parts, split_range, workspace_launcher
from twophase.testing import run_checked


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 5000), parts=st.integers(1, 9), grain=st.integers(1, 700))
def test_split_range_covers_the_range_in_even_pieces(n: int, parts: int, grain: int) -> None:
    ranges = split_range(n, parts, grain)
    if n == 0:
        assert ranges == []
        return
    assert 1 <= len(ranges) <= parts
    assert [lo for lo, _ in ranges] == [0] + [hi for _, hi in ranges[:-1]]  # contiguous
    if n:
        assert ranges[-1][1] == n
        sizes = [hi - lo for lo, hi in ranges]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
        assert len(ranges) == 1 or min(sizes) >= grain


def test_parts_run_once_each_and_at_the_same_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three parts on three threads (``num_threads``), each waiting for the others at a barrier: they only finish
    if they run concurrently."""
    from twophase import config

    monkeypatch.setattr(config.settings, "num_threads", 3)
    barrier = threading.Barrier(3, timeout=10)
    seen: list[int] = []
    lock = threading.Lock()

    def part(i: int) -> None:
        barrier.wait()
        with lock:
            seen.append(i)

    run_parts([lambda i=i: part(i) for i in range(3)])  # type: ignore[misc]
    assert sorted(seen) == [0, 1, 2]


def test_no_parts_is_nothing_to_do() -> None:
    run_parts([])


def test_a_failing_part_raises_after_every_part_has_finished() -> None:
    done: list[int] = []

    def slow(i: int) -> None:
        time.sleep(0.05)
        done.append(i)

    def bad() -> None:
        raise ValueError("part failed")

    with pytest.raises(ValueError, match="part failed"):
        run_parts([bad, lambda: slow(1), lambda: slow(2)])
    assert sorted(done) == [1, 2]  # nothing still writing when the error reaches the caller


def test_spin_sees_the_slots_reach_their_total_and_gives_up_on_one_they_do_not() -> None:
    from twophase.runtime.spin import count_and_wait, spin_until_total

    slots = np.zeros(3, np.int64)
    assert spin_until_total(slots, 0)
    assert not spin_until_total(slots, 1)  # bounded: returns False instead of hanging
    posted = np.zeros(1, np.int64)

    def count_in(slot: int, parts: int) -> None:
        time.sleep(0.001 * slot)
        count_and_wait(slots, slot, parts, posted, 0, 0)  # us = 0: count only, no wait

    threads = [threading.Thread(target=count_in, args=(i, i + 1)) for i in (1, 2)]
    for th in threads:
        th.start()
    slots[0] += 2
    seen = any(spin_until_total(slots, 7) for _ in range(10_000))  # each spin ~100 us; the threads need ~2 ms
    for th in threads:
        th.join(10)
    assert seen and slots.tolist() == [2, 2, 3]
    assert not spin_until_total(slots, 6)  # an exact total: more than asked is not it


def test_count_and_wait_counts_then_sees_a_change_and_gives_up_on_none() -> None:
    from twophase.runtime.spin import count_and_wait

    slots, counter = np.zeros(2, np.int64), np.zeros(1, np.int64)
    assert count_and_wait(slots, 1, 4, counter, 1, 1000)  # already different
    assert not count_and_wait(slots, 1, 1, counter, 0, 2000)  # bounded: returns False instead of hanging
    assert slots.tolist() == [0, 5]  # counted either way

    def bump() -> None:
        time.sleep(0.002)
        counter[0] = 7

    th = threading.Thread(target=bump)
    th.start()
    seen = any(count_and_wait(slots, 0, 0, counter, 0, 1000) for _ in range(10_000))  # the thread needs ~2 ms
    th.join(10)
    assert seen and counter[0] == 7


def test_count_and_wait_with_a_gate_sees_the_change_whether_the_gate_opened_or_not() -> None:
    """The gate only shortens the wait after a change: open or shut, the change is seen and the count made."""
    from twophase.runtime.spin import count_and_wait

    slots, counter = np.zeros(1, np.int64), np.array([5], np.int64)
    opened, shut = np.array([5], np.int64), np.array([4], np.int64)
    assert count_and_wait(slots, 0, 2, counter, 0, 1000, opened)
    assert count_and_wait(slots, 0, 3, counter, 0, 1000, shut)  # bounded by the settle, not stuck on the gate
    assert not count_and_wait(slots, 0, 1, counter, 5, 2000, opened)  # no change: gives up all the same
    assert slots.tolist() == [6] and opened.tolist() == [5] and shut.tolist() == [4]  # gates only read


def test_a_launching_thread_raises_the_gate_to_its_ticket_just_before_its_first_part() -> None:
    """``_Job.work`` opens the helpers' gate (``count_and_wait``) once, as it claims its first part, and never
    lowers a gate a later launch raised higher."""
    gate = np.array([3], np.int64)
    seen: list[int] = []
    job = fanout_module._Job([lambda: seen.append(int(gate[0])), lambda: seen.append(int(gate[0]))], 1)
    assert job.work(gate, 7) == 2
    assert seen == [7, 7] and gate.tolist() == [7]
    gate[0] = 9
    job = fanout_module._Job([lambda: seen.append(int(gate[0]))], 1)
    assert job.work(gate, 8) == 1 and seen[-1] == 9 and gate.tolist() == [9]
    job = fanout_module._Job([], 1)
    gate[0] = 0
    assert job.work(gate, 5) == 0 and gate.tolist() == [0]  # no part claimed: the gate stays shut


def test_run_parts_opens_the_gate_to_the_count_of_jobs_posted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch's ticket is the posted count once its jobs went in: the part the launching thread runs sees the
    gate at exactly that count (a helper spinning on ``posted`` waits for the gate to reach what it saw)."""
    monkeypatch.setattr(twophase.settings, "num_threads", 2)
    helpers = fanout_module._helpers
    me = threading.get_ident()
    seen: list[tuple[int, int]] = []

    def part() -> None:
        if threading.get_ident() == me:
            seen.append((int(helpers.gate[0]), int(helpers.posted[0])))

    for _ in range(50):  # the caller runs a part in nearly every launch; one is enough
        fanout_module.run_parts([part, part])
        if seen:
            break
    assert seen and all(gate == posted > 0 for gate, posted in seen)


def test_parts_of_helpers_without_a_slot_in_the_job_are_waited_for_all_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A helper started after a job was made has no slot in it (its count goes nowhere): the caller's spin on
    the slots then never sees the total, and it waits on the parts' own count instead, returning only once every
    part has run."""
    made = fanout_module._Job

    def slotless(parts: Any, threads: int) -> Any:
        return made(parts, 1)  # the caller's slot only

    monkeypatch.setattr(fanout_module, "_Job", slotless)
    ran: list[int] = []

    def part(i: int) -> None:
        time.sleep(0.02)
        ran.append(i)

    monkeypatch.setattr(twophase.settings, "num_threads", 2)
    for _ in range(3):
        ran.clear()
        run_parts([lambda: part(0), lambda: part(1)])
        assert sorted(ran) == [0, 1]


@pytest.mark.parametrize("spin_us", [0, 500, 200_000])
def test_helpers_take_parts_whether_they_block_or_spin_between_launches(spin_us: int) -> None:
    """A helper spinning for the next launch (``set_helper_spin``) or blocked on the queue takes a part of
    it, and every part runs exactly once over back-to-back launches."""
    old = twophase.settings.helper_spin_us
    twophase.set_helper_spin(spin_us)
    try:
        for _ in range(3):
            names: list[str] = []

            def part(names: list[str] = names) -> None:
                names.append(threading.current_thread().name)
                time.sleep(0.05)  # the other part is claimed meanwhile

            posted = int(fanout_module._helpers.posted[0])
            run_parts([part, part])
            assert len(names) == 2 and any(n.startswith("twophase-fanout-") for n in names)
            assert int(fanout_module._helpers.posted[0]) == posted + 1
        counts = [0] * 5
        for _ in range(200):
            run_parts([lambda i=i: counts.__setitem__(i, counts[i] + 1) for i in range(5)])  # type: ignore[misc]
        assert counts == [200] * 5
    finally:
        twophase.set_helper_spin(old)
    with pytest.raises(ValueError, match="helper spin"):
        twophase.set_helper_spin(-1)


def test_a_part_finishing_while_the_caller_spins_is_seen_and_its_error_raised() -> None:
    """The caller's part is quick, the helper's slow (beyond the spin): the caller falls back to blocking, and
    the helper's result and error still reach it."""
    done: list[int] = []

    def slow_fail() -> None:
        time.sleep(0.02)
        done.append(1)
        raise KeyError("late part")

    for _ in range(3):
        done.clear()
        with pytest.raises(KeyError, match="late part"):
            run_parts([lambda: done.append(0), slow_fail])
        assert sorted(done) == [0, 1]


def test_launches_from_several_threads_share_the_helpers() -> None:
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def launch(t: int) -> None:
        out = [0] * 6
        try:
            for _ in range(50):
                run_parts([lambda i=i: out.__setitem__(i, out[i] + 1) for i in range(6)])  # type: ignore[misc]
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        results[t] = out

    threads = [threading.Thread(target=launch, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors
    assert results == {t: [50] * 6 for t in range(4)}


def test_parts_follow_the_num_threads_setting() -> None:
    old = twophase.settings.num_threads
    try:
        twophase.set_num_threads(5)
        assert fanout_parts() == 5
        twophase.set_num_threads(0)
        assert fanout_parts() == len(os.sched_getaffinity(0))
    finally:
        twophase.set_num_threads(old)


# ---- numpy's OpenBLAS
_TIMEOUT = """
import ctypes, os, numpy as np
from twophase.kernels.cpu import blas
fn = blas._functions("openblas_thread_timeout")[0]
fn.restype = ctypes.c_int
a = np.ones((512, 512), np.float32)
a @ a  # OpenBLAS's workers started with the timeout of this process's environment
before = fn()
import twophase
twophase.device("cpu")
a @ a
print(before, fn(), os.environ.get("OPENBLAS_THREAD_TIMEOUT", "unset"))
"""


@pytest.mark.parametrize("value", [None, "4", "28"])
def test_the_cpu_device_leaves_openblas_thread_timeout_alone(value: str | None) -> None:
    """twophase no longer shortens OpenBLAS's spin: with its workers put to sleep after every call, a GEMM after
    30 ms or more of idle took 10-12 ms instead of 0.6 on these VMs (their scheduler woke the worker onto the
    caller's vCPU); what the environment sets, or OpenBLAS's default, stays in force."""
    if blas._functions("openblas_thread_timeout") is None:
        pytest.skip("numpy is not linked to its bundled OpenBLAS")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT")}
    if value is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = value
    out = subprocess.run(
        [sys.executable, "-c", _TIMEOUT], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    before, after, var = out.stdout.split()
    assert after == before, out.stdout
    assert var == (value or "unset")
    if value is not None:
        assert int(after) == int(value)


def test_serial_calls_runs_blas_on_one_thread_and_restores_the_count() -> None:
    calls = blas._thread_count_calls()
    if calls is None:
        pytest.skip("numpy is not linked to its bundled OpenBLAS")
    get, _ = calls
    before = get()
    seen: list[int] = []
    gate = threading.Barrier(2, timeout=10)

    def nested() -> None:
        with blas.serial_calls():
            gate.wait()  # both launches inside at once
            seen.append(get())
            gate.wait()

    with blas.serial_calls():
        th = threading.Thread(target=nested)
        th.start()
        gate.wait()
        seen.append(get())
        gate.wait()
        th.join()
        seen.append(get())  # the other launch left: still 1 while this one is inside
    assert seen == [1, 1, 1]
    assert get() == before


# ---- ops whose launches are cut into parts: 3 parts, whatever the machine
@pytest.fixture
def three_parts() -> Iterator[None]:
    old = twophase.settings.num_threads
    twophase.set_num_threads(3)
    try:
        yield
    finally:
        twophase.set_num_threads(old)


def _spy_on_parts(monkeypatch: pytest.MonkeyPatch, *modules: Any) -> list[int]:
    """The part counts of every ``run_parts`` call the ``modules`` make (the parts still run)."""
    launched: list[int] = []

    def spy(parts: Any) -> None:
        launched.append(len(parts))
        run_parts(parts)

    for module in modules:
        monkeypatch.setattr(module, "run_parts", spy)
    return launched


def _close(r: Any, ref: Any, rtol: float) -> None:
    assert r.unwritten[0] == int(np.isnan(ref).sum())
    np.testing.assert_allclose(r.outputs[0].astype(np.float64), ref, rtol=rtol, atol=rtol)


@pytest.mark.parametrize(
    "shape, layout, dtype",
    [
        ((1031, 517), "dense", np.float32),  # flat: column ranges of one row
        ((3, 200003), "strided", np.float32),  # rows >= parts
        ((2, 150001), "strided", np.float64),  # fewer rows than parts: column ranges of every row
        ((700, 401), "transposed", np.float16),  # packed
    ],
)
@pytest.mark.parametrize("name", ["gelu", "silu", "exp"])
def test_unary_in_parts(three_parts: None, shape: Any, layout: str, dtype: Any, name: str) -> None:
    rng = np.random.default_rng(len(name) + shape[0])
    a = (rng.standard_normal(shape) * (1 if name == "exp" else 3)).astype(dtype)  # exp: within float16's range
    op = getattr(ops, name)
    r = run_checked(op, on_device(a, layout))
    tol = 2e-3 if dtype == np.float16 else 1e-6
    _close(r, op.spec.reference(a.astype(np.float64)), tol)


@pytest.mark.parametrize(
    "name, rows, parts",
    [
        ("gelu", 128, 3),  # MiniLM's FFN activation, 128 x 1536: ~120 us on one thread, so cut
        ("exp", 128, 1),  # the same elements of the cheapest function (~60 us): one part
        ("tanh", 64, 3),  # 98 k elements of a function costing 5x exp_f32
        ("gelu", 64, 1),
    ],
)
def test_unary_parts_follow_the_functions_cost(
    three_parts: None, monkeypatch: pytest.MonkeyPatch, name: str, rows: int, parts: int
) -> None:
    """A unary launch is cut into parts from ``fanout_elements`` of its function: fewer elements for a costly
    function than for a cheap one; the parts' result is still the reference."""
    built: list[int] = []

    def spy(calls: Any) -> Any:
        built.append(len(calls))
        return fanout_module.launcher(calls)

    monkeypatch.setattr(elementwise_kernels, "launcher", spy)
    assert elementwise_kernels.fanout_elements("exp_f32") > 2 * elementwise_kernels.fanout_elements("gelu_erf_f32")
    a = np.random.default_rng(rows).standard_normal((rows, 1536)).astype(np.float32)
    op = getattr(ops, name)
    with forced("vector"):
        r = run_checked(op, a)
    assert built == [parts]
    _close(r, op.spec.reference(a.astype(np.float64)), 1e-6)


@pytest.mark.parametrize(
    "x_shape, y_shape",
    [
        ((777, 513), (777, 513)),
        ((777, 513), (513,)),  # y broadcast along the cut axis
        ((1, 600, 700), (600, 1)),  # cut along axis 1; y broadcast along axis 2
        ((3, 1, 90001), (3, 4, 1)),
    ],
)
@pytest.mark.parametrize("alpha", [1, 2.5])
def test_binary_in_parts(three_parts: None, x_shape: Any, y_shape: Any, alpha: float) -> None:
    rng = np.random.default_rng(sum(x_shape))
    x = rng.standard_normal(x_shape).astype(np.float32)
    y = rng.standard_normal(y_shape).astype(np.float32)
    r = run_checked(ops.add, x, y, alpha=alpha)
    _close(r, x.astype(np.float64) + alpha * y.astype(np.float64), 1e-6)


def test_binary_in_place_in_parts(three_parts: None) -> None:
    dev = device("cpu")
    s = dev.stream()
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((2, 800, 400)).astype(np.float32)
    x, y = dev.tensor(a, stream=s), dev.tensor(b, stream=s)
    twophase.mul(x, y, out=x, stream=s)
    s.synchronize()
    np.testing.assert_allclose(x.numpy(), a.astype(np.float64) * b, rtol=1e-6)


@pytest.mark.parametrize(
    "shape, dim, layout",
    [
        ((2100, 513), -1, "dense"),  # whole rows, row ranges
        ((3, 7, 50001), -1, "dense"),  # split rows, 21 rows: row ranges
        ((2, 600001), -1, "strided"),  # split rows, fewer than the parts: block ranges
        ((1100, 1001), 0, "dense"),  # over dim 0: strided rows
    ],
)
@pytest.mark.parametrize("log", [False, True])
def test_softmax_in_parts(three_parts: None, shape: Any, dim: int, layout: str, log: bool) -> None:
    rng = np.random.default_rng(shape[-1])
    a = (rng.standard_normal(shape) * 4).astype(np.float32)
    op = ops.log_softmax if log else ops.softmax
    r = run_checked(op, on_device(a, layout), dim=dim)
    assert r.tiling.threads == 3
    _close(r, op.spec.reference(a, dim), 2e-5 if log else 1e-6)


@pytest.mark.parametrize("rms", [False, True])
def test_layer_norm_in_parts(three_parts: None, rms: bool) -> None:
    rng = np.random.default_rng(5)
    a = rng.standard_normal((1601, 384)).astype(np.float32) * 2 + 1
    w = rng.standard_normal(384).astype(np.float32)
    b = rng.standard_normal(384).astype(np.float32)
    if rms:
        r = run_checked(ops.rms_norm, a, w, normalized_shape=(384,))
    else:
        r = run_checked(ops.layer_norm, a, w, b, normalized_shape=(384,), eps=1e-5)
    y, mu, rstd = ops.layer_norm.spec.reference(
        a, w, None if rms else b, normalized_shape=(384,), eps=1e-6 if rms else 1e-5, rms=rms
    )
    assert r.unwritten == (0, 0, 0)
    for got, want in zip(r.outputs, (y, mu, rstd)):
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-4, atol=1e-4)


# cut along batch, heads (C-contiguous parts; parts of several batch entries, which are not), query rows
@pytest.mark.parametrize(
    "b, h, lq, lk", [(4, 2, 100, 90), (1, 5, 120, 130), (2, 5, 85, 90), (1, 1, 300, 257), (2, 1, 200, 190)]
)
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "additive"])
def test_sdpa_in_parts(
    three_parts: None, monkeypatch: pytest.MonkeyPatch, b: int, h: int, lq: int, lk: int, mask: str
) -> None:
    # parts whose products call BLAS run through blas.run_blas_parts, those all by the kernel straight away
    launched = _spy_on_parts(monkeypatch, blas, attention_kernels)
    rng = np.random.default_rng(lq + lk)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((b, h, lq, 16), (b, h, lk, 16), (b, h, lk, 8)))
    m: Any = None
    if mask == "bool":
        m = rng.random((b, 1, lq, lk)) > 0.3
        m[..., 0, :] = False  # a fully masked row: zeros
    elif mask == "additive":
        m = rng.standard_normal((lq, lk)).astype(np.float32)
    causal = mask == "causal"
    r = run_checked(ops.scaled_dot_product_attention, q, k, v, m, is_causal=causal)
    assert r.implementation == "materialized"
    assert launched == [3]
    ref = sdpa_reference(q, k, v, m, is_causal=causal)
    assert r.unwritten == (0,) and r.guards_intact
    np.testing.assert_allclose(r.outputs[0], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "shape, dims",
    [
        ((1500, 1000), (1,)),  # rows: one block per row, ranges of rows
        ((2, 700001), (1,)),  # two rows of 171 blocks (two levels): ranges of (row, block) tasks
        ((300001, 5), (0,)),  # cols: 74 blocks of rows, one chunk of kept columns
        ((8500, 200), (0,)),  # cols: 3 blocks of rows
        ((3000, 1000), (0,)),  # cols: one block of rows, cut into 3 chunks of kept columns (384, 384, 232)
        ((3, 400, 1000), ()),  # everything: one row of blocks
    ],
)
@pytest.mark.parametrize("name", ["reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "argmax", "var"])
def test_reductions_in_parts(
    three_parts: None, monkeypatch: pytest.MonkeyPatch, shape: Any, dims: Any, name: str
) -> None:
    launched = _spy_on_parts(monkeypatch, reduce_kernels)
    if name == "argmax" and len(dims) != 1:  # argmax takes one dim
        dims = (len(shape) - 1,)
    rng = np.random.default_rng(shape[0])
    a = (rng.standard_normal(shape) + 0.5).astype(np.float32)
    attrs: dict[str, Any] = {"dim": dims[0]} if name == "argmax" else {"dims": dims}
    op = getattr(ops, name)
    r = run_checked(op, a, **attrs)
    ref = op.spec.reference(a, **attrs)
    assert 3 in launched  # the first level, at least, ran in three ranges of tasks
    assert r.unwritten[0] == 0 if r.outputs[0].dtype.kind == "f" else True
    if name == "argmax":
        np.testing.assert_array_equal(r.outputs[0], ref)
    else:
        np.testing.assert_allclose(r.outputs[0], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_conv2d_im2col_rows_in_parts(three_parts: None, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    launched = _spy_on_parts(monkeypatch, conv_kernels)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 32, 60, 61)).astype(np.float32)
    w = (rng.standard_normal((8, 32, 3, 3)) * 0.1).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    xin: Any = x
    if layout == "NHWC":  # the same logical NCHW tensor, stored channels-last
        xin = device("cpu").tensor(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), format=twophase.Format.NHWC)
        xin.synchronize()
    with forced("im2col"):
        r = run_checked(ops.conv2d, xin, w, b, stride=1, padding=1)
    assert r.implementation == "im2col" and 3 in launched
    ref = conv_reference(x, w, b, stride=1, padding=1)
    assert r.unwritten == (0,)
    got = r.outputs[0]
    np.testing.assert_allclose(got.transpose(0, 3, 1, 2) if got.shape != ref.shape else got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "x_shape, oc, limit, rounds",
    [
        ((3, 48, 47, 48), 40, None, 1),  # 3 images in one round
        ((3, 48, 47, 48), 40, 5 << 20, 2),  # rounds of 2 images, then 1
    ],
)
def test_conv2d_winograd4_in_parts(
    three_parts: None,
    monkeypatch: pytest.MonkeyPatch,
    x_shape: tuple[int, ...],
    oc: int,
    limit: int | None,
    rounds: int,
) -> None:
    """Every round of whole images in three hand-offs of three parts: the input transform (with U in the first)
    in channel ranges, the 36 GEMMs in batch ranges, the output transform in channel ranges."""
    launched = _spy_on_parts(monkeypatch, conv_kernels)  # the rounds run through conv.winograd_launch
    gemms = _spy_on_parts(monkeypatch, blas)
    r = _winograd_in_parts("winograd4", x_shape, oc, limit)
    assert -(-x_shape[0] // r.tiling.chunk) == rounds
    assert launched == [3, 3] * rounds and gemms == [3] * rounds


def _winograd_in_parts(impl: str, x_shape: tuple[int, ...], oc: int, limit: int | None) -> Any:
    """A 3x3 padded conv2d forced to ``impl`` (in three parts), checked against the reference; its run."""
    rng = np.random.default_rng(10)
    x = rng.standard_normal(x_shape).astype(np.float32)  # odd sizes: clipped edge tiles
    w = (rng.standard_normal((oc, x_shape[1], 3, 3)) * 0.1).astype(np.float32)
    b = rng.standard_normal(oc).astype(np.float32)
    with forced(impl):
        r = run_checked(ops.conv2d, x, w, b, stride=1, padding=1, workspace_limit=limit)
    assert r.implementation == impl and r.tiling.parts == 3
    assert r.guards_intact and r.workspace_size - 64 < r.touched <= r.workspace_size and r.unwritten == (0,)
    np.testing.assert_allclose(r.outputs[0], conv_reference(x, w, b, stride=1, padding=1), rtol=1e-4, atol=1e-4)
    return r


@pytest.mark.parametrize(
    "x_shape, oc, limit, rounds",
    [
        ((4, 48, 47, 48), 40, None, 1),  # 2304 tiles in one round
        ((4, 48, 47, 48), 40, 4 << 20, 4),  # rounds of a few hundred tiles, the last one short
        ((1, 176, 21, 22), 176, None, 1),  # 121 tiles, many channels
    ],
)
def test_conv2d_winograd_in_parts(
    three_parts: None,
    monkeypatch: pytest.MonkeyPatch,
    x_shape: tuple[int, ...],
    oc: int,
    limit: int | None,
    rounds: int,
) -> None:
    """Every round in three hand-offs of three parts: the input transform (with U in the first) in channel
    ranges, the GEMMs in batch ranges, the output transform in channel ranges."""
    launched = _spy_on_parts(monkeypatch, conv_kernels)
    gemms = _spy_on_parts(monkeypatch, blas)  # the GEMM parts run through blas.run_blas_parts
    r = _winograd_in_parts("winograd", x_shape, oc, limit)
    n, h, w_ = x_shape[0], x_shape[2], x_shape[3]
    tiles, chunk = n * ((h + 1) // 2) * ((w_ + 1) // 2), r.tiling.chunk
    sizes = [min(chunk, tiles - t0) for t0 in range(0, tiles, chunk)]
    assert len(sizes) == rounds
    assert launched == [3, 3] * len(sizes) and gemms == [3] * len(sizes)


@pytest.mark.parametrize("groups, stride, nhwc", [(24, 1, False), (24, 2, True), (3, 1, False)])
def test_conv2d_direct_planes_in_parts(
    three_parts: None, monkeypatch: pytest.MonkeyPatch, groups: int, stride: int, nhwc: bool
) -> None:
    """Depthwise (and grouped) direct convolution in three ranges of (image, output channel) planes; odd sizes and
    padding put the row copies' first and last columns at the edges."""
    launched = _spy_on_parts(monkeypatch, fanout_module)  # the launch is fanout.launcher's
    rng = np.random.default_rng(11)
    # enough multiply-adds to be cut into parts: 2^20 for the general kernel, 3 x 2^20 for the 3x3 depthwise one
    # (strided ones count 3 times)
    h, w_ = ((89, 87) if groups == 24 else (61, 59)) if stride == 1 else (121, 119)
    x = rng.standard_normal((2, 24, h, w_)).astype(np.float32)
    w = rng.standard_normal((48, 24 // groups, 3, 3)).astype(np.float32)
    b = rng.standard_normal(48).astype(np.float32)
    xin: Any = x
    if nhwc:
        xin = device("cpu").tensor(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), format=twophase.Format.NHWC)
        xin.synchronize()
    with forced("direct"):
        r = run_checked(ops.conv2d, xin, w, b, stride=stride, padding=1, groups=groups)
    assert r.implementation == "direct" and launched == [3]
    ref = conv_reference(x, w, b, stride=stride, padding=1, groups=groups)
    got = r.outputs[0]
    assert r.unwritten == (0,)
    np.testing.assert_allclose(got.transpose(0, 3, 1, 2) if got.shape != ref.shape else got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "name, attrs",
    [
        ("max_pool2d", {"kernel_size": 3, "stride": 2, "padding": 1}),
        (
            "max_pool2d",
            {"kernel_size": (3, 2), "stride": (1, 2), "padding": (1, 1), "dilation": (2, 1), "ceil_mode": True},
        ),
        ("avg_pool2d", {"kernel_size": 3, "stride": 2, "padding": 1, "count_include_pad": False}),
        ("adaptive_avg_pool2d", {"output_size": (7, 5)}),
    ],
)
def test_pooling_planes_in_parts(
    three_parts: None, monkeypatch: pytest.MonkeyPatch, name: str, attrs: dict[str, Any]
) -> None:
    launched = _spy_on_parts(monkeypatch, fanout_module)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 40, 113, 111)).astype(np.float32)
    x[1, 7, 50, 60] = np.nan  # one window's max is NaN
    op = getattr(ops, name)
    r = run_checked(op, x, **attrs)
    ref = op.spec.reference(x, **attrs)
    assert launched == [3] and r.unwritten[0] == int(np.isnan(ref).sum())
    np.testing.assert_allclose(r.outputs[0], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "shape, layout, dtype, impl, launches",
    [
        ((5000, 130), "dense", np.float32, "channels", [3]),  # (N, C): ranges of rows
        ((3, 40, 70, 80), "dense", np.float32, "channels", [3]),  # ranges of (n, c) planes
        ((2, 30, 90, 101), "padded", np.float64, "channels", [3]),  # planes as rows of a wider image
        ((2, 30, 90, 101), "strided", np.float32, "channels", [3]),  # rows whose elements are not adjacent
        # float16: the copies into the float32 pack and back run in parts too (half.cast_copy)
        ((4, 30, 75, 80), "dense", np.float16, "channels_packed", [3, 3, 3]),
        ((3, 20, 40, 30, 20), "transposed", np.float32, "channels_packed", [3]),  # 3 spatial dims in no rows
    ],
)
def test_batch_norm_in_parts(
    three_parts: None,
    monkeypatch: pytest.MonkeyPatch,
    shape: Any,
    layout: str,
    dtype: Any,
    impl: str,
    launches: list[int],
) -> None:
    launched = _spy_on_parts(monkeypatch, fanout_module, norm_kernels)  # fanout.launcher's launch, or the packed one
    rng = np.random.default_rng(shape[-1])
    c = shape[1]
    a = (rng.standard_normal(shape) * 2 + 1).astype(dtype)
    mean, w, b = (rng.standard_normal(c).astype(dtype) for _ in range(3))
    var = (rng.random(c) + 0.5).astype(dtype)
    r = run_checked(ops.batch_norm, on_device(a, layout), mean, var, w, b)
    assert r.implementation == impl and launched == launches
    _close(r, ops.batch_norm.spec.reference(a, mean, var, w, b), 2e-3 if dtype == np.float16 else 1e-5)


@pytest.mark.parametrize(
    "shape, groups, layout, dtype, impl, launches",
    [
        ((6, 32, 60, 60), 8, "dense", np.float32, "groups", [3]),  # 48 groups: ranges of groups
        ((2, 24, 110, 101), 6, "padded", np.float64, "groups", [3]),  # groups as rows of a wider image
        ((2, 8, 200, 200), 2, "dense", np.float32, "split_groups", [3, 3]),  # blocks' partials, merge, blocks' writes
        ((2, 8, 200, 203), 2, "strided", np.float32, "split_groups", [3, 3]),
        ((3, 16, 110, 110), 4, "dense", np.float16, "groups_packed", [3, 3, 3]),  # the float16 copies in parts
    ],
)
def test_group_norm_in_parts(
    three_parts: None,
    monkeypatch: pytest.MonkeyPatch,
    shape: Any,
    groups: int,
    layout: str,
    dtype: Any,
    impl: str,
    launches: list[int],
) -> None:
    launched = _spy_on_parts(monkeypatch, fanout_module, groupnorm_kernels)  # fanout.launcher's launch, or the others
    rng = np.random.default_rng(shape[-1] + groups)
    c = shape[1]
    a = (rng.standard_normal(shape) * 2 + 1).astype(dtype)
    w, b = (rng.standard_normal(c).astype(dtype) for _ in range(2))
    r = run_checked(ops.group_norm, on_device(a, layout), w, b, num_groups=groups)
    assert r.implementation == impl and launched == launches
    _close(r, ops.group_norm.spec.reference(a, w, b, num_groups=groups), 2e-3 if dtype == np.float16 else 1e-5)


def test_workspace_launcher_binds_once_per_workspace() -> None:
    """Views of the workspace are made on the first launch on it and again only when the workspace changes."""
    bound: list[int] = []
    ran: list[int] = []

    def bind(ws: Any) -> Any:
        bound.append(ws.ctypes.data)
        view = ws[:8].view(np.float64)
        return lambda: ran.append(int(view[0]))

    launch = workspace_launcher(bind)
    a, b = np.full(4, 7.0), np.full(4, 9.0)
    for ws in (a, a, a, b, b, a):
        launch(ws.view(np.uint8))
    assert ran == [7, 7, 7, 9, 9, 7]
    assert bound == [a.ctypes.data, b.ctypes.data, a.ctypes.data]
    launch(a.view(np.uint8)[:16])  # same address, other size: bound again
    assert len(bound) == 4 and ran[-1] == 7


def test_parts_outnumbering_the_threads_all_run_on_the_threads_there_are() -> None:
    from twophase import config
    from twophase.runtime.fanout import run_parts

    ran: list[tuple[str, int]] = []
    saved = config.settings.num_threads
    try:
        config.set_num_threads(1)

        def part(i: int) -> None:
            time.sleep(0.01)  # long enough for an idle helper to claim a part, were one posted
            ran.append((threading.current_thread().name, i))

        run_parts([lambda i=i: part(i) for i in range(5)])
    finally:
        config.set_num_threads(saved)
    assert sorted(i for _, i in ran) == [0, 1, 2, 3, 4]
    assert {name for name, _ in ran} == {threading.current_thread().name}  # one thread: no helper


def test_deterministic_results_do_not_depend_on_the_thread_count() -> None:
    """Under set_deterministic(True) every parallel kernel is cut into the same parts whatever the threads, so
    winograd conv2d and SDPA (whose parts' sums meet in cut-dependent order) give the same bits."""
    import hashlib

    from twophase import config

    dev = twophase.device("cpu")
    rng = np.random.default_rng(0)
    x = dev.tensor(rng.standard_normal((2, 16, 32, 32)).astype(np.float32))
    w = dev.tensor(rng.standard_normal((32, 16, 3, 3)).astype(np.float32))
    q, k, v = (dev.tensor(rng.standard_normal((2, 4, 256, 64)).astype(np.float32)) for _ in range(3))
    saved = (config.settings.deterministic, config.settings.num_threads)
    seen: dict[str, set[str]] = {"conv2d": set(), "sdpa": set()}
    try:
        config.set_deterministic(True)
        for threads in (1, 2, 3):
            config.set_num_threads(threads)
            for name, t in (
                ("conv2d", twophase.conv2d(x, w, padding=(1, 1))),
                ("sdpa", twophase.scaled_dot_product_attention(q, k, v)),
            ):
                seen[name].add(hashlib.sha1(t.numpy().tobytes()).hexdigest())
                t.free()
    finally:
        config.set_deterministic(saved[0])
        config.set_num_threads(saved[1])
    assert all(len(h) == 1 for h in seen.values()), seen


def test_busy_counts_launches_on_helpers_and_is_zero_again_after_a_failing_part() -> None:
    """``BUSY`` = [launches running parts on helpers now, such launches so far]: a one-part launch is not
    counted, nor several parts on one thread; a launch of several on two threads is, and the count of those
    running goes back to 0 when a part raises."""
    import twophase
    from twophase.runtime.fanout import BUSY

    old = twophase.settings.num_threads
    try:
        twophase.set_num_threads(1)
        before = int(BUSY[1])
        run_parts([lambda: None])
        run_parts([lambda: None, lambda: None])
        assert BUSY.tolist() == [0, before]
        twophase.set_num_threads(2)
        seen: list[int] = []

        def bad() -> None:
            seen.append(int(BUSY[0]))
            raise ValueError("part failed")

        with pytest.raises(ValueError, match="part failed"):
            run_parts([bad, lambda: seen.append(int(BUSY[0]))])
        assert seen == [1, 1] and BUSY.tolist() == [0, before + 1]
    finally:
        twophase.set_num_threads(old)


def test_spin_until_reached_sees_the_count_gives_up_when_told_and_is_bounded() -> None:
    from twophase.runtime.spin import spin_until_reached

    counter, unless = np.zeros(1, np.int64), np.zeros(1, np.int64)
    assert spin_until_reached(counter, 0, 0, unless)
    assert not spin_until_reached(counter, 1, 2000, unless)  # bounded: returns False instead of hanging

    def bump() -> None:
        time.sleep(0.002)
        counter[0] = 3

    th = threading.Thread(target=bump)
    th.start()
    seen = any(spin_until_reached(counter, 2, 1000, unless) for _ in range(10_000))  # the thread needs ~2 ms
    th.join(10)
    assert seen
    unless[0] = 1  # told to stop: gives up at once, long before its 60 s budget
    waiter = threading.Thread(target=spin_until_reached, args=(counter, 4, 60e6, unless), daemon=True)
    waiter.start()
    waiter.join(30)  # a hang guard, not a timing check
    assert not waiter.is_alive()
    gate = np.zeros(1, np.int64)
    assert spin_until_reached(counter, 0, 0, unless, gate, 11) and gate.tolist() == [11]  # set even when done
    assert not spin_until_reached(counter, 9, 0, unless, gate, 12) and gate.tolist() == [12]
