"""The test harness itself: run_checked frees what it allocates (on error paths too) and flags an op that changes
its inputs; run_matrix fails such an op's cases, and a reference with the wrong number of outputs fails its cases
instead of aborting the run."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import twophase as tp
from twophase.cli import main
from twophase.errors import TwoPhaseError
from twophase.op import Op, OpDef, Plan
from twophase.testing import run_checked, run_matrix


@contextlib.contextmanager
def _registered(
    name: str,
    kernel: Callable[[Any, Any], None],
    n_inputs: int = 1,
    n_outputs: int = 1,
    reference: Any = None,
    aliases: tuple[int, ...] = (),
) -> Iterator[Op]:
    """A planted float32 op ``kernel(input_views, output_views)`` in the registry for the block (each test uses
    its own name: one-shot functions are cached per op)."""

    def infer(ins: Any, attrs: Any) -> tuple[tp.TensorDesc, ...]:
        return (tp.TensorDesc(ins[0].shape, ins[0].dtype),) * n_outputs

    op = tp.register(
        OpDef(
            name=name,
            inputs=tuple(f"x{i}" for i in range(n_inputs)),
            outputs=tuple(f"out{i}" for i in range(n_outputs)),
            dtypes=(tp.DType.float32,),
            infer=infer,
            select=lambda ins, outs, attrs, limit: Plan("planted", None, 0),
            implementations=("planted",),
            kernels={"cpu": lambda plan, attrs, ins, outs: lambda _: kernel(ins, outs)},
            reference=reference,
            aliases=aliases,
        )
    )
    try:
        yield op
    finally:
        del tp.registry[name]


def _clobber_first(x: Any) -> None:
    """Write into the caller's memory of ``x`` (a no-op on an empty or non-contiguous view)."""
    flat = x.reshape(-1)
    if flat.size and np.shares_memory(flat, x):
        flat[0] = 12345.0


def _random(*shape: int, seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _allocated() -> int:
    gc.collect()
    return int(tp.device().pool.stats()["allocated_bytes"] or 0)


# ---- D5: run_checked frees everything it allocates


def test_run_checked_leaves_nothing_allocated_after_success_and_failures() -> None:
    """Input copies, outputs and workspace go back to the pool, also when phase 1 refuses, phase 2 refuses (a
    closed stream) or the kernel fails; an executor phase 2 did not consume is destroyed."""
    dev = tp.device()
    x = _random(128, 64)
    kept = dev.tensor(x)  # a caller's tensor: used as it is, not freed
    kept.synchronize()
    before = _allocated()
    for _ in range(3):
        r = run_checked(tp.ops.softmax, x, dim=-1)
        e = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
        np.testing.assert_allclose(r.outputs[0], e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)
    assert _allocated() == before
    run_checked(tp.ops.add, kept, x)
    with pytest.raises(TwoPhaseError):  # phase 1 refuses: the input copies made so far are freed
        run_checked(tp.ops.add, x, np.ones((3, 5), np.float32))
    closed = dev.stream()
    closed.close()
    op = tp.ops.neg
    destroyed = op.counters.destroyed
    with pytest.raises(TwoPhaseError):  # phase 2 refuses the closed stream
        run_checked(op, kept, stream=closed)
    assert op.counters.destroyed == destroyed + 1  # the executor phase 2 refused is destroyed

    def fail(ins: Any, outs: Any) -> None:
        raise RuntimeError("planted kernel failure")

    with _registered("harness_failing_kernel", fail) as bad, pytest.raises(TwoPhaseError):
        run_checked(bad, x)  # phase 2 fails in the kernel
    assert _allocated() == before
    np.testing.assert_array_equal(kept.numpy(), x)


def test_run_checked_reports_no_leak_to_the_sanitizer() -> None:
    with tp.sanitizer.sanitize():
        token = tp.sanitizer.mark()
        r = run_checked(tp.ops.relu, _random(64, 64, seed=1))
        gc.collect()
        assert tp.sanitizer.report(since=token, warn=False) == []
    assert r.inputs_changed == () and r.unwritten == (0,)


# ---- D9: an op must leave its inputs as they were, unless an output is bound to them in place


def test_run_checked_flags_an_input_the_kernel_writes() -> None:
    def copy_and_clobber(ins: Any, outs: Any) -> None:
        np.copyto(outs[0], ins[0])
        _clobber_first(ins[0])

    x = _random(4, 5, seed=2)
    with _registered("harness_writes_input", copy_and_clobber) as op:
        r = run_checked(op, x)
        t = tp.device().tensor(x)
        r_tensor = run_checked(op, t)
    np.testing.assert_array_equal(r.outputs[0], x)  # the outputs are right: only the input check catches it
    assert r.unwritten == (0,) and r.guards_intact
    assert r.inputs_changed == (0,) and r_tensor.inputs_changed == (0,)
    assert t.numpy()[0, 0] == 12345.0
    t.free()
    assert run_checked(tp.ops.mul, x, _random(5, seed=3)).inputs_changed == ()


def test_run_checked_skips_only_the_input_an_output_is_bound_to_in_place() -> None:
    dev = tp.device()
    x = _random(6, 7, seed=4)
    t = dev.tensor(x)
    r = run_checked(tp.ops.relu, t, out=t)  # in place: the input is the output (not poisoned, not checked)
    np.testing.assert_array_equal(r.outputs[0], np.maximum(x, 0))
    assert r.inputs_changed == () and r.unwritten == (0,)
    t.free()

    def add_into_first_and_clobber_second(ins: Any, outs: Any) -> None:
        np.add(ins[0], ins[1], out=outs[0])
        _clobber_first(ins[1])

    def write_first(ins: Any, outs: Any) -> None:
        np.add(ins[0], ins[1], out=outs[0])
        _clobber_first(ins[0])

    def write_second(ins: Any, outs: Any) -> None:
        np.add(ins[0], ins[1], out=outs[0])
        _clobber_first(ins[1])

    y = _random(6, 7, seed=5)
    with _registered("harness_in_place_add", write_second, n_inputs=2, aliases=(0,)) as op:
        a, b = dev.tensor(x), dev.tensor(y)
        r = run_checked(op, a, b, out=a)  # input 0 is written in place; input 1 must not change
        assert r.inputs_changed == (1,)
        np.testing.assert_allclose(r.outputs[0], x.astype(np.float64) + y, rtol=1e-6)
        a.free()
        b.free()
    with _registered("harness_aliasable_writes_input", write_first, n_inputs=2, aliases=(0,)) as op2:
        # the op may run in place, but here its output is memory of its own: input 0 must keep its values
        assert run_checked(op2, x, y).inputs_changed == (0,)


def test_run_matrix_fails_the_cases_of_an_op_that_writes_its_input() -> None:
    def copy_and_clobber(ins: Any, outs: Any) -> None:
        np.copyto(outs[0], ins[0])
        _clobber_first(ins[0])

    name = "harness_matrix_writes_input"
    with _registered(name, copy_and_clobber, reference=lambda x: np.array(x, np.float64)):
        r = run_matrix(name, long_n=257)
    assert r.failed > 0 and r.largest_error == 0.0  # the values are right
    assert any(f"op '{name}' changed its input 'x0' of call 0" in f for f in r.failures), r.failures
    assert not any("empty" in f for f in r.failures)  # nothing to write in an empty input


# ---- D8: a reference with the wrong number of outputs fails its cases, and the run goes on


def test_a_reference_with_too_few_outputs_fails_the_cases_and_check_goes_on(capsys: pytest.CaptureFixture[str]) -> None:
    def two_copies(ins: Any, outs: Any) -> None:
        np.copyto(outs[0], ins[0])
        np.copyto(outs[1], ins[0])

    name = "harness_two_outputs_one_reference"
    with _registered(name, two_copies, n_outputs=2, reference=lambda x: np.array(x, np.float64)):
        r = run_matrix(name, long_n=257)
        assert r.cases > 0 and r.failed == r.cases and r.passed == 0
        assert f"the reference of op '{name}' returned 1 output(s), expected 2" in r.failures[0]
        assert main(["check", name, "neg", "--long-n", "257"]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {name}" in out and "\nneg " in out and "FAIL neg" not in out


def test_a_reference_that_raises_fails_the_cases() -> None:
    def bad_reference(x: Any) -> Any:
        raise ValueError("planted reference bug")

    name = "harness_reference_raises"
    with _registered(name, lambda ins, outs: np.copyto(outs[0], ins[0]), reference=bad_reference):
        r = run_matrix(name, long_n=257)
    assert r.cases > 0 and r.failed == r.cases
    assert f"the reference of op '{name}' raised ValueError: planted reference bug" in r.failures[0]


# ---- an infinite reference is matched exactly: a wrong infinity (or a finite value for one) fails


def test_error_matches_infinite_references_exactly() -> None:
    from twophase.testing.matrix import _error

    ref = np.array([np.inf, -np.inf, np.nan, 1.0])
    assert _error(np.array([np.inf, -np.inf, np.nan, 1.0], np.float32), ref) == (0.0, True)
    for wrong in ([0.0, -np.inf, np.nan, 1.0], [-np.inf, -np.inf, np.nan, 1.0], [np.inf, 3e38, np.nan, 1.0]):
        err, ok = _error(np.array(wrong, np.float32), ref)
        assert not ok and err == np.inf, wrong
    err, ok = _error(np.array([np.inf, 1.0], np.float32), np.array([5.0, 1.0]))  # infinite where finite
    assert not ok and err == np.inf


def test_run_matrix_fails_an_op_that_gets_infinities_wrong() -> None:
    from twophase.testing.cases import GENERATORS, Call, Case

    def bad_reciprocal(ins: Any, outs: Any) -> None:
        with np.errstate(divide="ignore"):
            r = 1.0 / ins[0]
        r[np.isposinf(r)] = 0.0  # +inf becomes 0 ...
        r[-1] = -np.inf if ins[0][-1] == 0 else r[-1]  # ... and the last one the wrong infinity
        np.copyto(outs[0], r)

    name = "harness_wrong_infinities"
    GENERATORS[name] = lambda rng, dtype, long_n: [
        Case("zeros inside", [Call((np.array([0.0, 2.0, 4.0, 0.0], np.float32),))])
    ]
    try:
        with (
            _registered(name, bad_reciprocal, reference=lambda x: np.divide(1.0, x, where=True)),
            np.errstate(divide="ignore"),
        ):
            r = run_matrix(name, long_n=257)
    finally:
        del GENERATORS[name]
    assert r.cases == 1 and r.failed == 1 and r.passed == 0, r
    assert r.largest_error == np.inf and "differs (error inf) from the reference" in r.failures[0]


# ---- the bytes between the elements of a strided output (and after a fresh one) must keep their values


def _gap_writer(ins: Any, outs: Any) -> None:
    """The right values, after a dense store over twice the output's elements (as a kernel that assumes a dense
    output would do): on a step-2 output it zeroes the bytes between the elements."""
    import ctypes

    out = outs[0]
    if not out.flags.c_contiguous and out.size:
        ctypes.memset(out.ctypes.data, 0, 2 * out.size * out.itemsize)
    np.negative(ins[0], out=out)


def test_run_checked_flags_a_kernel_that_writes_between_the_elements_of_a_strided_out() -> None:
    dev = tp.device()
    base = dev.tensor(np.full(16, 5.0, np.float32))
    base.synchronize()
    out = base.strided((8,), (2,), 0)  # every other element of base
    x = np.arange(8, dtype=np.float32)
    with _registered("harness_gap_writer", _gap_writer, reference=lambda x: -x) as op:
        r = run_checked(op, x, out=out)
    np.testing.assert_array_equal(r.outputs[0], -x)  # the values are right: only the gap check catches it
    assert r.unwritten == (0,) and r.inputs_changed == ()
    assert not r.guards_intact and r.gap_bytes_written == (8 * 4,)
    np.testing.assert_array_equal(base.numpy()[1::2], 5.0)  # the caller's bytes between the elements are back
    good = run_checked(tp.ops.neg, x, out=out)
    assert good.guards_intact and good.gap_bytes_written == (0,)
    np.testing.assert_array_equal(base.numpy(), np.stack([-x, np.full(8, 5.0, np.float32)], 1).reshape(-1))
    base.free()
    fresh = run_checked(tp.ops.neg, x)  # a new dense output: the slack of its block is guarded too
    assert fresh.guards_intact and fresh.gap_bytes_written == (0,)


def test_run_matrix_fails_an_op_that_writes_between_the_elements_of_a_strided_output() -> None:
    name = "harness_matrix_gap_writer"
    with _registered(name, _gap_writer, reference=lambda x: -np.asarray(x, np.float64)):
        r = run_matrix(name, long_n=257)
    assert r.failed == 1 and r.largest_error == 0.0, r.failures  # the values are right
    assert "step out" in r.failures[0] and "between the elements of strided output 0 of call 0" in r.failures[0]
    with _registered("harness_matrix_neg", lambda ins, outs: np.negative(ins[0], out=outs[0]), reference=np.negative):
        ok = run_matrix("harness_matrix_neg", long_n=257)
        labels = [c.label for _, c in tp.testing.shape_matrix("harness_matrix_neg", long_n=257) or []]
    assert ok.failed == 0 and ok.passed == ok.cases and "step out (4, 9)" in labels  # a right op passes it


@pytest.mark.parametrize("size", [0, 64])
def test_a_guarded_workspace_starts_after_its_leading_guard_even_when_empty(size: int) -> None:
    """An empty slice starts where its base does: a zero-byte workspace pointed at the block's start, before the
    leading guard zone, so a kernel writing just before its workspace went unseen."""
    from twophase.testing.checked import GUARD, guarded_workspace

    dev = tp.device("cpu")
    s = dev.stream()
    outer, inner = guarded_workspace(dev, size, s)
    try:
        assert inner.data.ctypes.data == outer.data.ctypes.data + GUARD and inner.data.size == size
    finally:
        outer.free()


@pytest.mark.parametrize(
    "view",
    [
        lambda a: a.T,  # transposed
        lambda a: a[:, ::2],  # strided
        lambda a: a[::-1, ::-3],  # reversed, both dims
        lambda a: a[1:, 2:5],  # a window: dense rows, the whole not
    ],
)
def test_run_checked_keeps_a_numpy_inputs_layout(view: Callable[[Any], Any]) -> None:
    """run_checked puts a numpy view on the device with the view's own strides (a test of a transposed input
    tests a transposed input, not a dense copy of it), the values exact; broadcast (zero-stride) views are
    copied dense."""
    from twophase.testing.checked import with_strides

    dev = tp.device("cpu")
    a = view(np.arange(60, dtype=np.float32).reshape(6, 10))
    t = with_strides(dev, a, dev.default_stream)
    t.synchronize()
    assert t.desc.strides == tuple(s // 4 for s in a.strides)
    np.testing.assert_array_equal(t.numpy(), a)
    r = run_checked(tp.ops.exp, a)
    np.testing.assert_allclose(r.outputs[0], np.exp(a.astype(np.float64)), rtol=1e-6)
    t.free()
    b = with_strides(dev, np.broadcast_to(np.arange(3, dtype=np.float32), (4, 3)), dev.default_stream)
    b.synchronize()
    assert b.desc.strides == (3, 1)
    b.free()
