"""Elementwise ops against float64 numpy references: broadcasting, promotion, layouts, poisoned outputs."""

from __future__ import annotations

import contextlib
import decimal
import re
from typing import Any
from unittest import mock

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_layouts import LAYOUTS, POISON_BITS, dense_at, on_device, random, shapes
from threads import num_threads

import twophase
from twophase import DType, TensorDesc, device, functions, ops
from twophase.errors import KernelError, ParamError
from twophase.kernels.cpu import elementwise as elementwise_kernels
from twophase.kernels.cpu import half, streaming
from twophase.kernels.cpu.elementwise import IN_PLACE, KERNELS, SHORT_ROW, STAGE, _rows_call, function_for
from twophase.kernels.cpu.jit import FAST
from twophase.ops import elementwise as elementwise_ops
from twophase.ops.elementwise import BINARY, COMPARE, UNARY, unary_reference, weak_scalar
from twophase.ops.selection import forced
from twophase.testing import run_checked

TOL = {np.float16: 2e-3, np.float32: 2e-6, np.float64: 1e-12}


def check_close(got: np.ndarray[Any, Any], ref: np.ndarray[Any, Any], dtype: Any) -> None:
    assert got.shape == np.shape(ref)
    if np.dtype(got.dtype).kind in "biu":
        np.testing.assert_array_equal(got, ref)
        return
    tol = TOL[np.dtype(dtype).type] if np.dtype(dtype).kind == "f" else 1e-12
    np.testing.assert_allclose(got.astype(np.float64), ref, rtol=tol, atol=tol)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(BINARY)),
    shape=shapes(1, 3),
    bcast=st.integers(0, 2),
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from([np.float32, np.float64, np.int32]),
    seed=st.integers(0, 2**31),
)
def test_binary_matches_numpy_reference_with_broadcasting(
    name: str, shape: tuple[int, ...], bcast: int, layout: str, dtype: Any, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    other_shape = shape[bcast:] if bcast < len(shape) else ()
    other_shape = tuple(1 if i % 2 else n for i, n in enumerate(other_shape))
    x = random(shape, dtype, rng, positive=name == "pow")
    y = random(other_shape, dtype, rng, positive=name in ("div", "pow"))
    if name == "pow" and np.dtype(dtype).kind == "i":
        y = np.abs(y) % 3
    attrs: dict[str, Any] = {"alpha": 2} if name in ("add", "sub") else {}
    r = run_checked(getattr(ops, name), on_device(x, layout), y, **attrs)
    ref = BINARY[name][1](x.astype(np.float64) if dtype != np.int32 else x, y, **attrs)
    assert r.unwritten == (int(np.isnan(ref).sum()),) and r.workspace_size == 0 and r.inputs_changed == ()
    check_close(r.outputs[0], ref, r.outputs[0].dtype)


@pytest.mark.parametrize("name", sorted(COMPARE))
def test_comparisons_give_bool_and_match_numpy(name: str) -> None:
    rng = np.random.default_rng(1)
    x = rng.integers(0, 3, (4, 5)).astype(np.float32)
    y = rng.integers(0, 3, (5,)).astype(np.int32)
    r = run_checked(getattr(ops, name), on_device(x, "transposed"), y)
    assert r.outputs[0].dtype == np.bool_
    np.testing.assert_array_equal(r.outputs[0], COMPARE[name](x, y))


def test_type_promotion_follows_numpy() -> None:
    x = np.ones((2, 3), np.float16)
    assert run_checked(ops.mul, x, np.ones(3, np.float32)).outputs[0].dtype == np.float32
    assert run_checked(ops.add, np.ones(3, np.int32), np.ones(3, np.int64)).outputs[0].dtype == np.int64
    assert run_checked(ops.div, np.ones(3, np.int32), np.full(3, 2, np.int32)).outputs[0].dtype == np.float64


def test_where_broadcasts_cond_x_y() -> None:
    rng = np.random.default_rng(2)
    cond = rng.random((3, 1, 4)) < 0.5
    x, y = rng.standard_normal((5, 4)).astype(np.float32), np.float64(-1.0) * np.ones((1, 4))
    r = run_checked(ops.where, cond, on_device(x, "reversed"), y)
    np.testing.assert_array_equal(r.outputs[0], np.where(cond, x, y))
    assert r.outputs[0].dtype == np.float64 and r.unwritten == (0,) and r.inputs_changed == ()


DOMAIN_POSITIVE = {"log", "sqrt", "rsqrt"}


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(UNARY)),
    shape=shapes(0, 3, 9),
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from([np.float32, np.float64, np.float16]),
    approx=st.sampled_from(["none", "tanh"]),
    seed=st.integers(0, 2**31),
)
def test_unary_matches_float64_reference_in_any_layout(
    name: str, shape: tuple[int, ...], layout: str, dtype: Any, approx: str, seed: int
) -> None:
    x = random(shape, dtype, np.random.default_rng(seed), positive=name in DOMAIN_POSITIVE)
    attrs: dict[str, Any] = {"approximate": approx} if name == "gelu" else {}
    op = getattr(ops, name)
    r = run_checked(op, on_device(x, layout if x.ndim else "dense"), **attrs)
    ref = op.spec.reference(x.astype(np.float64), **attrs)
    assert r.unwritten == (0,) and r.guards_intact and r.inputs_changed == ()
    assert r.touched <= r.workspace_size
    if dtype == np.float16 and name in ("exp", "tanh", "gelu") and x.size:
        assert r.implementation == "packed" and r.workspace_size >= x.size * 4
    check_close(r.outputs[0], ref.astype(dtype).astype(np.float64) if dtype == np.float16 else ref, dtype)


@pytest.mark.parametrize("layout", ["strided", "transposed", "reversed"])
@pytest.mark.parametrize("name", ["gelu", "silu", "exp", "tanh"])
def test_unary_on_strided_rows_longer_than_the_stage_buffer(name: str, layout: str) -> None:
    """Rows without unit stride go through a dense buffer STAGE elements at a time: rows of 2 * STAGE + 37
    elements cross two chunk boundaries and end in a partial chunk; every element written, each to its own."""
    x = random((3, 2 * STAGE + 37), np.float32, np.random.default_rng(7))
    op = getattr(ops, name)
    r = run_checked(op, on_device(x, layout))
    assert r.unwritten == (0,) and r.implementation == "vector"
    check_close(r.outputs[0], op.spec.reference(x.astype(np.float64)), np.float32)


def test_in_place_kernel_on_strided_rows_touches_only_its_elements() -> None:
    """The in-place kernel for rows without unit stride (staged through the dense buffer) writes every element
    of the view, and none of the elements between them."""
    base = random((3, 2 * (STAGE + 37)), np.float32, np.random.default_rng(8))
    want = base.copy()
    want[:, ::2] = ops.silu.spec.reference(base[:, ::2].astype(np.float64))
    IN_PLACE["silu_f32"][False](base[:, ::2])
    np.testing.assert_array_equal(base[:, 1::2], want[:, 1::2])
    np.testing.assert_allclose(base[:, ::2], want[:, ::2], rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("width", [1, 13, SHORT_ROW - 1])
def test_in_place_kernel_on_short_dense_rows_touches_only_its_elements(width: int) -> None:
    """Dense rows shorter than SHORT_ROW, of a wider array, are staged a batch of whole rows at a time (97 rows:
    full batches and a partial last one): every element of the view computed in place, none between the rows."""
    base = random((97, width + 7), np.float32, np.random.default_rng(width))
    want = base.copy()
    want[:, :width] = ops.silu.spec.reference(base[:, :width].astype(np.float64))
    IN_PLACE["silu_f32"][True](base[:, :width])
    np.testing.assert_array_equal(base[:, width:], want[:, width:])
    np.testing.assert_allclose(base[:, :width], want[:, :width], rtol=2e-6, atol=1e-30)


def test_long_vector_runs_parallel_blocks_and_stays_exact() -> None:
    x = np.random.default_rng(3).standard_normal(300_001).astype(np.float32) * 10
    r = run_checked(ops.silu, x)
    np.testing.assert_allclose(r.outputs[0], ops.silu.spec.reference(x.astype(np.float64)), rtol=3e-7, atol=1e-30)


def test_integer_unaries_and_cast() -> None:
    x = np.array([[-3, 4], [0, -1]], np.int32)
    np.testing.assert_array_equal(run_checked(ops.relu, x).outputs[0], np.maximum(x, 0))
    np.testing.assert_array_equal(run_checked(ops.abs, on_device(x, "transposed")).outputs[0], np.abs(x))
    f = np.array([1.7, -2.5, 3.0])
    got = run_checked(ops.cast, on_device(f, "strided"), dtype="int64").outputs[0]
    assert got.dtype == np.int64 and got.tolist() == [1, -2, 3]
    assert run_checked(ops.cast, f, dtype=np.float16).outputs[0].dtype == np.float16


@pytest.mark.parametrize(
    "call,arg",
    [
        (lambda: ops.exp.get_workspace_size(on_device(np.ones(3, np.int32))), "x"),
        (lambda: ops.add.get_workspace_size(on_device(np.ones(3)), on_device(np.ones(4))), "other"),
        (
            lambda: ops.add.get_workspace_size(
                on_device(np.ones(3, np.int32)), on_device(np.ones(3, np.int32)), alpha=0.5
            ),
            "alpha",
        ),
        (lambda: ops.mul.get_workspace_size(on_device(np.ones(3, bool)), on_device(np.ones(3))), "x"),
        (
            lambda: ops.where.get_workspace_size(on_device(np.ones(3)), on_device(np.ones(3)), on_device(np.ones(3))),
            "cond",
        ),
        (lambda: ops.gelu.get_workspace_size(on_device(np.ones(3)), approximate="fast"), "approximate"),
        (lambda: ops.cast.get_workspace_size(on_device(np.ones(3)), dtype="complex64"), "dtype"),
        (lambda: ops.sub.get_workspace_size(None, on_device(np.ones(3))), "x"),
    ],
)
def test_bad_inputs_raise_param_error_naming_the_argument(call: Any, arg: str) -> None:
    with pytest.raises(ParamError) as e:
        call()
    assert e.value.arg == arg


def test_unsupported_dtype_message_names_supported_dtypes() -> None:
    with pytest.raises(ParamError, match="float32"):
        ops.tanh.get_workspace_size(on_device(np.ones(3, np.int64)))


PACKED_FMA = re.compile(r"vfmadd\w+p[sd]\s+%[yz]mm")


@pytest.mark.parametrize(
    "name,dtype", [("silu_f32", np.float32), ("gelu_erf_f32", np.float32), ("exp_f32", np.float32), ("exp", np.float64)]
)
def test_unary_kernel_inner_loop_is_vectorized(name: str, dtype: Any) -> None:
    """The specialised dense-rows kernel, recompiled uncached (cached code has no assembly), uses packed FMAs, typed
    as phase 1 compiles it: matrices of any layout ('A'; its rows are bare contiguous views)."""
    rows = KERNELS[name][True]
    fresh = numba.njit(nogil=True, fastmath=FAST, error_model="numpy")(rows.py_func)
    arr = numba.types.Array(numba.from_dtype(np.dtype(dtype)), 2, "A")
    fresh.compile((arr, arr))
    assert PACKED_FMA.search(fresh.inspect_asm((arr, arr)))


@pytest.mark.parametrize("name,dtype", [("gelu_erf_f32", np.float32)])  # one: each case compiles uncached (~6 s)
def test_in_place_unary_kernel_is_vectorized(name: str, dtype: Any) -> None:
    """The in-place rows kernel (``IN_PLACE``: out is x) uses packed FMAs; the two-array kernel given one array
    twice falls to LLVM's scalar loop (its overlap check fails), 6 ns against 0.6 per gelu element. Typed as
    phase 1 compiles it: any layout."""
    rows = IN_PLACE[name][True]
    fresh = numba.njit(nogil=True, fastmath=FAST, error_model="numpy")(rows.py_func)
    arr = numba.types.Array(numba.from_dtype(np.dtype(dtype)), 2, "A")
    fresh.compile((arr,))
    assert PACKED_FMA.search(fresh.inspect_asm((arr,)))
    m = np.ones((2, 40), dtype)
    assert _rows_call(name, m, m).args == (m,)  # one view in and out: the in-place kernel, one argument
    assert len(_rows_call(name, m, m.copy()).args) == 2


@pytest.mark.parametrize(
    "name,dtype", [("gelu", np.float32), ("gelu", np.float16), ("silu", np.float32), ("exp", np.float64)]
)
def test_unary_in_place_matches_the_reference(name: str, dtype: Any) -> None:
    """out = x (one tensor) on the in-place kernel, directly (float32 / float64, in three parts) or through the
    float32 workspace copy (float16)."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 4099)) * 2).astype(dtype)
    ref = unary_reference(name)(x.astype(np.float64))
    dev = device("cpu")
    t = dev.tensor(x)
    with num_threads(3):
        functions()[name](t, out=t)
    got = t.numpy().astype(np.float64)
    tol = 2e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)


def test_float32_data_uses_the_float32_kernels() -> None:
    assert function_for("gelu_erf", np.float32) == "gelu_erf_f32"
    assert function_for("gelu_erf", np.float64) == "gelu_erf" and function_for("exp", np.float32) == "exp_f32"
    assert function_for("tanh", np.float32) == "tanh"  # no float32 variant: computed in float64


@pytest.mark.parametrize("name", ["gelu", "silu", "sigmoid", "exp"])
def test_float32_unary_within_a_few_ulp_of_float64_reference(name: str) -> None:
    x = np.concatenate([np.linspace(-20, 20, 200_001), [0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30]]).astype(np.float32)
    op = getattr(ops, name)
    variants: list[dict[str, Any]] = [{}, {"approximate": "tanh"}] if name == "gelu" else [{}]
    for attrs in variants:
        got = run_checked(op, x, **attrs).outputs[0].astype(np.float64)
        ref = op.spec.reference(x.astype(np.float64), **attrs)
        ok = np.abs(ref) > 1e-30
        assert np.max(np.abs(got[ok] - ref[ok]) / np.abs(ref[ok])) < 8 * 2.0**-24


def test_unary_special_values() -> None:
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)
    with np.errstate(all="ignore"):
        for name in ("gelu", "silu", "sigmoid"):
            for dt in (np.float32, np.float64):
                got = run_checked(getattr(ops, name), x.astype(dt)).outputs[0]
                ref = getattr(ops, name).spec.reference(x.astype(np.float64))
                np.testing.assert_array_equal(got, ref.astype(dt), err_msg=f"{name} {dt}")


_PI_50 = decimal.Decimal("3.14159265358979323846264338327950288419716939937510")


def _gelu_tail_exact(x: float) -> float:
    """x Phi(x) for x <= -10, to 50 digits, correctly rounded to float64 (denormals included): x/2 erfc(t) with
    t = -x/sqrt 2 exact and erfc(t) = exp(-t^2) / sqrt(pi) / (t + (1/2)/(t + 1/(t + (3/2)/(t + ...)))), Laplace's
    continued fraction, whose 400 terms converge far past 50 digits from t = 7."""
    with decimal.localcontext() as ctx:
        ctx.prec = 50
        d = decimal.Decimal(x)
        t = -d / decimal.Decimal(2).sqrt()
        f = t
        for k in range(400, 0, -1):
            f = t + decimal.Decimal(k) / 2 / f
        return float(d / 2 * (-(t * t)).exp() / _PI_50.sqrt() / f)


def test_float64_gelu_accurate_in_the_tail_down_to_its_underflow() -> None:
    """float64 gelu (erf form) for x in [-38.7, -10]: results from 1e-24 down through the denormals to 0 (from
    x = -38.6). Normal results within 2e-15 relative (erfc's tail fit stopped at t = 26, x = -36.8: 0.6-3 % off
    beyond; exp(-x^2/2) from a rounded x/sqrt 2, up to 1.5e-13 before), denormal ones within 2 units of 2^-1074."""
    rng = np.random.default_rng(11)
    edges = [-36.7, -36.8, -37.0, -37.5, -38.0, -38.5, -38.55, -38.6, -38.7]
    x = np.concatenate([rng.uniform(-38.7, -10.0, 400), np.linspace(-38.7, -36.0, 101), edges])
    ref = np.array([_gelu_tail_exact(v) for v in x])
    tiny = float(np.finfo(np.float64).tiny)
    assert (ref < -tiny).sum() > 300 and ((ref < 0) & (ref > -tiny)).sum() > 10 and (ref == 0).sum() > 3
    r = run_checked(ops.gelu, x, approximate="none")
    got = r.outputs[0]
    assert r.unwritten == (0,) and got.dtype == np.float64
    normal = np.abs(ref) >= tiny
    rel = np.abs(got[normal] - ref[normal]) / np.abs(ref[normal])
    assert rel.max() <= 2e-15, f"max relative error {rel.max():.3g} at x = {x[normal][rel.argmax()]}"
    assert np.abs(got[~normal] - ref[~normal]).max() <= 2 * 2.0**-1074
    assert np.all(np.signbit(got[ref < 0]))


@pytest.mark.parametrize("name", ["add", "sub"])
@pytest.mark.parametrize(
    "dtype,bad,edge",
    [
        (np.int32, 2**40, -(2**31)),
        (np.int32, -(2**31) - 1, 2**31 - 1),
        (np.int64, 2**63, 2**63 - 1),
        (np.int64, -(2**63) - 1, -(2**63)),
        pytest.param(np.float32, 2**1100, 2**100, id="float32-2**1100-2**100"),
    ],
)
def test_alpha_the_promoted_dtype_cannot_hold_is_a_param_error_in_phase_1(
    name: str, dtype: Any, bad: int, edge: int
) -> None:
    """numpy raised an out-of-range int alpha (or one past float64's range) only in the kernel, a KernelError at
    sync; the range's own ends still run."""
    from twophase import DType, TensorDesc

    desc = TensorDesc((2,), DType.of(dtype))
    with pytest.raises(ParamError) as e:
        getattr(ops, name).get_workspace_size(desc, desc, alpha=bad)
    assert e.value.op == name and e.value.arg == "alpha"
    x, y = np.array([0, 1], dtype), np.array([1, 0], dtype)
    got = run_checked(getattr(ops, name), x, y, alpha=edge).outputs[0]
    np.testing.assert_array_equal(got, BINARY[name][0](x, np.multiply(y, edge, dtype=dtype)))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_integer_pow_with_a_negative_int_exponent_is_refused_in_phase_1(dev: Any, stream: Any, dtype: Any) -> None:
    """numpy's "Integers to negative integer powers are not allowed" came from the kernel, a KernelError at sync:
    a negative Python int exponent of integer operands is a ParamError at the call, naming pow's other. Exponents
    0 and 3, negative bases and a negative float exponent (a float64 result) still run, every element written; a
    tensor exponent with negative values still fails at sync, with numpy's message."""
    rng = np.random.default_rng(14)
    a = random((4, 5), dtype, rng)
    x = dev.tensor(a, stream=stream)
    for e in (-1, -2, -(2**40)):
        with pytest.raises(ParamError) as info:
            twophase.pow(x, e, stream=stream)
        assert info.value.op == "pow" and info.value.arg == "other" and info.value.got == e
        assert "negative integer powers" in str(info.value.expected)
    sentinel = np.iinfo(dtype).min + 7
    for e in (0, 3):
        out = dev.tensor(np.full(a.shape, sentinel, dtype), stream=stream)
        twophase.pow(x, e, out=out, stream=stream)
        stream.synchronize()
        np.testing.assert_array_equal(out.numpy(), np.power(a, e))
    pos = np.abs(a) + 1
    out = dev.tensor(np.full(a.shape, np.nan), stream=stream)
    twophase.pow(dev.tensor(pos, stream=stream), -1.5, out=out, stream=stream)
    stream.synchronize()
    np.testing.assert_allclose(out.numpy(), np.power(pos.astype(np.float64), -1.5), rtol=1e-15)
    exponent = dev.tensor(np.where(rng.random(a.shape) < 0.5, -1, 2).astype(dtype), stream=stream)
    twophase.pow(x, exponent, stream=stream)
    with pytest.raises(KernelError, match="Integers to negative integer powers are not allowed"):
        stream.synchronize()


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_comparison_with_an_int_outside_the_dtype_range_gives_numpy_2s_answer(dev: Any, dtype: Any) -> None:
    """numpy 2 compares an integer array with a Python int its dtype cannot hold as with the exact value (all True
    or all False); the one-shot API refused it ('a value that fits int32'). Either side, both signs, just past the
    range and far past int64, into an out= poisoned with the opposite answer. Arithmetic with such an int is still
    refused, and an int within the range keeps the operand's dtype (the usual path)."""
    info = np.iinfo(dtype)
    rng = np.random.default_rng(15)
    a = np.concatenate([rng.integers(info.min, info.max, 40, dtype=dtype, endpoint=True), [info.min, info.max, 0]])
    a = a.astype(dtype)
    x = dev.tensor(a)
    fns = functions()
    for s in (int(info.max) + 1, int(info.min) - 1, 2**70, -(2**70)):
        for name, ufunc in COMPARE.items():
            for args, ref in (((x, s), ufunc(a, s)), ((s, x), ufunc(s, a))):
                assert ref.all() or not ref.any()
                out = dev.tensor(~ref)
                fns[name](*args, out=out)
                np.testing.assert_array_equal(out.numpy(), ref, err_msg=f"{name}{args[:1]} {s}")
        for name in ("add", "mul", "maximum", "pow"):
            with pytest.raises(ParamError) as e:
                fns[name](x, s)
            assert e.value.op == name and e.value.arg == "other"
            assert ("negative" if name == "pow" and s < 0 else "fits") in str(e.value.expected)
    assert weak_scalar("lt", "other", int(info.max), np.dtype(dtype)) == (int(info.max), np.dtype(dtype))
    np.testing.assert_array_equal(fns["le"](x, int(info.max) - 1).numpy(), a <= info.max - 1)


# ---------------------------------------------------------------- outputs overlapping inputs
def test_where_in_place_into_x_or_y(dev: Any) -> None:
    cond = np.array([True, False, True, False])
    xs, ys = np.array([1.0, 2, 3, 4], np.float32), np.array([10.0, 20, 30, 40], np.float32)
    for into in ("x", "y"):
        x, y = dev.tensor(xs), dev.tensor(ys)
        out = x if into == "x" else y
        twophase.where(cond, x, y, out=out)
        np.testing.assert_array_equal(out.numpy(), np.where(cond, xs, ys))


@pytest.mark.parametrize(
    "case", ["unary_transposed", "unary_shifted", "softmax_transposed", "where_cond", "cast_shifted"]
)
def test_an_output_overlapping_an_input_other_than_in_place_is_refused(dev: Any, case: str) -> None:
    """The kernel would read what it already wrote: refused when the tensors are bound, naming out and the input."""
    a = dev.tensor(np.arange(16, dtype=np.float32).reshape(4, 4))
    flat = dev.tensor(np.arange(9, dtype=np.float32))
    with pytest.raises(ParamError, match="overlapping") as e:
        if case == "unary_transposed":
            twophase.exp(a, out=a.transpose())
        elif case == "unary_shifted":
            twophase.tanh(flat.strided((8,), (1,), 0), out=flat.strided((8,), (1,), 1))
        elif case == "softmax_transposed":
            twophase.softmax(a, dim=1, out=a.transpose())
        elif case == "where_cond":
            m = dev.tensor(np.array([True, False]))
            twophase.where(m, np.array([True, True]), np.array([False, False]), out=m)
        else:
            twophase.cast(flat.strided((8,), (1,), 0), dtype="float32", out=flat.strided((8,), (1,), 1))
    assert e.value.arg == "out"
    np.testing.assert_array_equal(a.numpy(), np.arange(16).reshape(4, 4))  # nothing ran
    np.testing.assert_array_equal(flat.numpy(), np.arange(9))


def test_binary_ops_take_any_overlap_as_numpy_does(dev: Any) -> None:
    base = np.arange(9, dtype=np.float32)
    t = dev.tensor(base)
    twophase.add(t.strided((8,), (1,), 0), t.strided((8,), (1,), 1), out=t.strided((8,), (1,), 1))
    want = base.copy()
    np.add(want[:8], want[1:], out=want[1:])
    np.testing.assert_array_equal(t.numpy(), want)


def test_interleaved_disjoint_views_are_not_an_overlap(dev: Any) -> None:
    t = dev.tensor(np.arange(8, dtype=np.float32))
    twophase.exp(t.strided((4,), (2,), 0), out=t.strided((4,), (2,), 1))  # even elements into the odd ones
    np.testing.assert_allclose(t.numpy()[1::2], np.exp(np.arange(0, 8, 2)), rtol=1e-6)


# ---------------------------------------------------------------- format tags
def test_elementwise_results_keep_the_format_tag_their_operands_agree_on(dev: Any) -> None:
    fm = twophase.Format
    a = dev.tensor(np.ones((1, 2, 3, 4), np.float32), format=fm.NHWC)
    b = dev.tensor(np.ones((1, 2, 3, 4), np.float32), format=fm.NHWC)
    plain = dev.tensor(np.ones((1, 2, 3, 4), np.float32))
    for r in (
        twophase.relu(a),
        twophase.exp(a),
        twophase.cast(a, dtype="float64"),
        twophase.add(a, b),
        twophase.lt(a, b),
        twophase.where(twophase.lt(a, b), a, b),
    ):
        assert r.desc.format is fm.NHWC, r.desc
    assert twophase.add(a, plain).desc.format is fm.ND  # operands disagree: no layout to claim
    assert twophase.where(twophase.lt(plain, plain), a, b).desc.format is fm.ND


def test_nhwc_conv_relu_pool_pools_the_spatial_dims(dev: Any) -> None:
    """relu dropped NHWC: the pool then took the (8, 8, 4) tail as (C, H, W) and pooled W and C."""
    rng = np.random.default_rng(0)
    xn = rng.standard_normal((2, 6, 8, 8)).astype(np.float32)
    x = dev.tensor(np.ascontiguousarray(xn.transpose(0, 2, 3, 1)), format=twophase.Format.NHWC)
    w = dev.tensor(rng.standard_normal((4, 6, 3, 3)).astype(np.float32))
    ref = twophase.max_pool2d(
        twophase.relu(twophase.conv2d(dev.tensor(xn), w, None, padding=(1, 1))), kernel_size=(2, 2)
    ).numpy()  # NCHW (2, 4, 4, 4)
    p = twophase.max_pool2d(twophase.relu(twophase.conv2d(x, w, None, padding=(1, 1))), kernel_size=(2, 2))
    assert p.desc.format is twophase.Format.NHWC and p.shape == (2, 4, 4, 4)
    np.testing.assert_allclose(p.numpy(), ref.transpose(0, 2, 3, 1), rtol=1e-5, atol=1e-5)


def test_an_out_whose_format_tag_contradicts_the_result_is_refused(dev: Any) -> None:
    fm = twophase.Format
    rng = np.random.default_rng(1)
    xn = rng.standard_normal((2, 6, 8, 8)).astype(np.float32)
    nchw = dev.tensor(xn, format=fm.NCHW)
    nhwc = dev.tensor(np.ascontiguousarray(xn.transpose(0, 2, 3, 1)), format=fm.NHWC)
    w = dev.tensor(rng.standard_normal((4, 6, 3, 3)).astype(np.float32))
    cases = [
        lambda: twophase.conv2d(nchw, w, None, padding=(1, 1), out=dev.empty((2, 4, 8, 8), format=fm.NHWC)),
        lambda: twophase.max_pool2d(nhwc, kernel_size=(2, 2), out=dev.empty((2, 4, 4, 6), format=fm.NCHW)),
        lambda: twophase.relu(nhwc, out=dev.empty((2, 8, 8, 6), format=fm.NCHW)),
    ]
    for call in cases:
        with pytest.raises(ParamError, match="format") as e:
            call()
        assert e.value.arg == "out"
    o = twophase.relu(nhwc, out=dev.empty((2, 8, 8, 6)))  # an ND out takes any layout, and stays ND
    assert o.desc.format is fm.ND
    np.testing.assert_array_equal(o.numpy(), np.maximum(xn.transpose(0, 2, 3, 1), 0))


# ---------------------------------------------------------------- streaming stores (add / sub / mul / div)
STREAMING = sorted(streaming.CODES)
SLACK = 17  # elements around each operand: any offset of 0..SLACK, and room after


def _placed(
    dtype: Any, shape: tuple[int, ...], offsets: tuple[int, ...], seed: int, special: list[float]
) -> tuple[list[Any], list[Any], Any, Any]:
    """(inputs, their tensors, the output's whole buffer, the output): random data laced with ``special`` values
    (and 0, -0, the smallest subnormal) for all but the last offset, each dense tensor that many elements into a
    buffer of its own; the output poisoned, the rest of its buffer 7.0 (``_check_written``)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    pool = np.array([*special, -0.0, 0.0, np.finfo(dtype).smallest_subnormal], dtype)
    inputs = [
        np.where(rng.random(n) < 0.1, rng.choice(pool, n), rng.standard_normal(n) * 3).astype(dtype)
        for _ in offsets[:-1]
    ]
    tensors = []
    for data, off in zip(inputs, offsets):
        buf = np.zeros(n + SLACK, dtype)
        buf[off : off + n] = data
        tensors.append(dense_at(buf, shape, off)[1])
    bout = np.full(n + SLACK, 7.0, dtype)
    bout[offsets[-1] : offsets[-1] + n] = np.full(n, POISON_BITS[dtype]).view(dtype)
    whole, out = dense_at(bout, shape, offsets[-1])
    return inputs, tensors, whole, out


def _check_written(whole: Any, offset: int, want: Any) -> None:
    """Every element of the output (``offset`` into ``whole``) written and equal to ``want`` bit for bit (NaN where
    it has NaN), nothing around it."""
    out = whole.numpy()  # waits for the launch
    n = want.size
    written = out[offset : offset + n]
    assert not (written.view(POISON_BITS[want.dtype.type].dtype) == POISON_BITS[want.dtype.type]).any()
    np.testing.assert_array_equal(written, want)
    assert (np.delete(out, np.arange(offset, offset + n)) == 7.0).all()


def _at_any_alignment(names: list[str], operands: int) -> Any:
    """The streaming kernels' cases (x86 only): an op of ``names``, float32 / float64, 1-3 dims of 1-50, each of
    ``operands`` (the output last) 0..SLACK elements into its buffer, one to three parts, a seed."""
    cases = given(
        name=st.sampled_from(names),
        dtype=st.sampled_from([np.float32, np.float64]),
        shape=st.lists(st.integers(1, 50), min_size=1, max_size=3).map(tuple),
        offsets=st.tuples(*[st.integers(0, SLACK)] * operands),
        parts=st.integers(1, 3),
        seed=st.integers(0, 2**31),
    )
    skip = pytest.mark.skipif(not streaming.AVAILABLE, reason="streaming stores are x86 only")
    return lambda test: skip(settings(max_examples=60, deadline=None)(cases(test)))


@_at_any_alignment(STREAMING, 3)
def test_streaming_binary_is_bitwise_numpy_at_any_alignment(
    name: str, dtype: Any, shape: tuple[int, ...], offsets: tuple[int, int, int], parts: int, seed: int
) -> None:
    """Operands and output start at any element offset (the kernel's scalar head runs up to the output's first
    32-byte boundary), cut into one to three parts; every element is written, nothing around the output is, and
    the result is numpy's bit for bit (NaN where numpy has NaN), inf, -0 and subnormals included."""
    placed = _placed(dtype, shape, offsets, seed, [np.nan, np.inf, -np.inf])
    _check_binary("streaming", True, name, placed, offsets[2], parts)


def _check_binary(impl: str, force: bool, name: str, placed: Any, out_offset: int, parts: int) -> None:
    """Op ``name`` on ``_placed`` operands in ``parts`` parts takes ``impl`` (``force``: forced to) with workspace
    0, and writes numpy's result into every element of the output (``out_offset`` into its buffer) and nothing
    around it."""
    (x, y), (tx, ty), whole, tout = placed
    op = getattr(ops, name)
    with forced(impl) if force else contextlib.nullcontext(), num_threads(parts):
        with mock.patch.object(elementwise_ops, "FANOUT_MIN", 8):
            size, ex = op.get_workspace_size(tx, ty, out=tout)
    assert ex.implementation == impl and size == 0
    op(None, 0, ex, device("cpu").default_stream)
    with np.errstate(all="ignore"):
        want = BINARY[name][0](x, y)
    _check_written(whole, out_offset, want)


def test_stream_threshold_is_the_last_level_cache_at_most_64_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    for llc, want in ((260 << 20, 64 << 20), (64 << 20, 64 << 20), (32 << 20, 32 << 20), (1 << 20, 1 << 20)):
        monkeypatch.setattr(streaming, "last_level_cache_bytes", lambda llc=llc: llc)
        assert streaming.stream_threshold() == want


def test_streaming_is_ranked_first_only_for_outputs_as_large_as_the_last_level_cache() -> None:
    """Phase 1 on descs alone (nothing is allocated): from ``stream_threshold()`` on (the LLC's size, at most 64
    MiB), 'streaming'; below it numpy's ufunc, whose stores leave the result cached for the next op; never where
    the kernel does not apply."""
    llc = streaming.stream_threshold()
    big = TensorDesc((llc // 4,), DType.float32)
    small = TensorDesc((llc // 4 - 128,), DType.float32)

    def impl(*descs: TensorDesc, name: str = "add", **attrs: Any) -> str:
        _, ex = getattr(ops, name).get_workspace_size(*descs, **attrs)
        ex.destroy()
        return ex.implementation

    want = "streaming" if streaming.AVAILABLE else "ufunc"
    assert [impl(big, big, name=n) for n in STREAMING] == [want] * 4
    assert impl(TensorDesc((llc // 8,), DType.float64), TensorDesc((llc // 8,), DType.float64)) == want
    assert impl(small, small) == "ufunc"
    half16 = TensorDesc((llc // 2,), DType.float16)
    assert impl(half16, half16) == ("half" if half.available() else "ufunc")  # (test_half_binary_...)
    cases = {
        "alpha": (big, big),
        "broadcast": (big, TensorDesc((1,), DType.float32)),
        "float16 alpha": (half16, half16),
        "int32": (TensorDesc((llc // 4,), DType.int32),) * 2,
        "promoted": (big, TensorDesc((llc // 4,), DType.float64)),
        "strided": (TensorDesc((llc // 4,), DType.float32, strides=(2,)), big),
    }
    for case, descs in cases.items():
        attrs = {"alpha": 2.0} if "alpha" in case else {}
        assert impl(*descs, **attrs) == "ufunc", case
        with forced("streaming"), pytest.raises(ParamError) as err:
            impl(*descs, **attrs)
        assert err.value.arg == "implementation", case


@pytest.mark.skipif(not half.available(), reason="no F16C: float16 arithmetic is numpy's")
@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(STREAMING),
    shape=st.lists(st.integers(1, 50), min_size=1, max_size=3).map(tuple),
    offsets=st.tuples(*[st.integers(0, SLACK)] * 3),
    parts=st.integers(1, 3),
    seed=st.integers(0, 2**31),
)
def test_half_binary_is_numpys_float16_arithmetic(
    name: str, shape: tuple[int, ...], offsets: tuple[int, int, int], parts: int, seed: int
) -> None:
    """Dense float16 operands of one shape take 'half' (converted by the CPU, computed in float32, rounded once):
    numpy's result for every element (its float16 loops round the same way), NaN, inf, the largest finite, -0 and
    subnormals included, at any offsets, in one to three parts; every element written, nothing around it."""
    placed = _placed(np.float16, shape, offsets, seed, [np.nan, np.inf, -np.inf, 65504.0])
    _check_binary("half", False, name, placed, offsets[2], parts)  # ranked first: not forced


@pytest.mark.skipif(not streaming.AVAILABLE, reason="streaming stores are x86 only")
@pytest.mark.parametrize("case", ["x", "other", "shifted"])
def test_streaming_output_in_place_or_overlapping_is_numpys_result(dev: Any, case: str) -> None:
    """``out`` as an input's own view runs the streaming kernel in place; ``out`` one element past ``x`` (numpy
    buffers that overlap) runs numpy's ufunc under the same plan, with numpy's result."""
    rng = np.random.default_rng(3)
    base = rng.standard_normal(1001).astype(np.float32)
    other = rng.standard_normal(1000).astype(np.float32)
    t = dev.tensor(base)
    to = dev.tensor(other)
    x = t.strided((1000,), (1,), 0)
    out = {"x": x, "other": to, "shifted": t.strided((1000,), (1,), 1)}[case]
    want = base.copy()
    w_other = other.copy()
    np.subtract(want[:1000], w_other, out={"x": want[:1000], "other": w_other, "shifted": want[1:]}[case])
    with forced("streaming"):
        got = twophase.sub(x, to, out=out)
    assert got is out
    np.testing.assert_array_equal(t.numpy(), want)
    np.testing.assert_array_equal(to.numpy(), w_other)


@pytest.mark.skipif(not streaming.AVAILABLE, reason="streaming stores are x86 only")
@pytest.mark.parametrize("dtype,store", [(np.float32, "vmovntps"), (np.float64, "vmovntpd")])
def test_streaming_kernels_store_whole_vectors_past_the_cache(dtype: Any, store: str) -> None:
    """The arithmetic kernels, recompiled uncached (cached code has no assembly), store with aligned non-temporal
    vector stores (what the implementation is for), then an sfence."""
    arr = numba.types.Array(numba.from_dtype(np.dtype(dtype)), 1, "C")
    for name in STREAMING:
        fresh = numba.njit(nogil=True, error_model="numpy")(streaming.KERNELS[name].py_func)
        fresh.compile((arr, arr, arr))
        asm = fresh.inspect_asm((arr, arr, arr))
        assert re.search(rf"{store}\s+%ymm", asm) and "sfence" in asm, name


VMATH_UNARY = sorted(n for n, spec in UNARY.items() if spec[0] == "vmath")


@_at_any_alignment(VMATH_UNARY, 2)
def test_streaming_unary_is_the_vector_kernels_result_at_any_alignment(
    name: str, dtype: Any, shape: tuple[int, ...], offsets: tuple[int, int], parts: int, seed: int
) -> None:
    """'vector_streaming' with x and the output at any element offset (the scalar head runs up to the output's
    first 64-byte boundary, the tail after the last whole line), cut into one to three parts: every element is
    written, nothing around the output is, and the result is the 'vector' kernel's bit for bit (the same function
    per element), special values included."""
    dev = device("cpu")
    (x,), (tx,), whole, tout = _placed(dtype, shape, offsets, seed, [np.nan, np.inf, -np.inf, 30.0, -30.0])
    op = getattr(ops, name)
    with forced("vector_streaming"), num_threads(parts), mock.patch.object(elementwise_kernels, "FANOUT_NS", 1.0):
        size, ex = op.get_workspace_size(tx, out=tout)
    assert ex.implementation == "vector_streaming" and size == 0
    op(None, 0, ex, dev.default_stream)
    with forced("vector"):
        want = functions()[name](dev.tensor(x.reshape(shape))).numpy().reshape(-1)
    _check_written(whole, offsets[1], want)


def test_streaming_unary_is_ranked_first_only_for_large_dense_float_outputs() -> None:
    """Phase 1 on descs alone: 'vector_streaming' from ``stream_threshold()`` output bytes, 'vector' below; never
    for float16 (packed) or strided operands, where forcing it is a ``ParamError``."""
    llc = streaming.stream_threshold()
    big = TensorDesc((llc // 4,), DType.float32)

    def impl(*descs: TensorDesc, name: str = "gelu") -> str:
        _, ex = getattr(ops, name).get_workspace_size(*descs)
        ex.destroy()
        return ex.implementation

    want = "vector_streaming" if streaming.AVAILABLE else "vector"
    assert [impl(big, name=n) for n in VMATH_UNARY] == [want] * len(VMATH_UNARY)
    assert impl(TensorDesc((llc // 8,), DType.float64)) == want
    assert impl(TensorDesc((llc // 4 - 16,), DType.float32)) == "vector"
    assert impl(TensorDesc((llc // 2,), DType.float16)) == "packed"
    strided = TensorDesc((llc // 4,), DType.float32, strides=(2,))
    assert impl(strided) == "vector"
    with forced("vector_streaming"), pytest.raises(ParamError) as err:
        impl(strided)
    assert err.value.arg == "implementation"


@pytest.mark.skipif(not streaming.AVAILABLE, reason="streaming stores are x86 only")
def test_streaming_unary_in_place_takes_the_in_place_vector_kernel(dev: Any) -> None:
    """Planned 'vector_streaming', an out that is x itself runs the in-place vector kernel (a streaming loop over
    one array twice would fail LLVM's overlap check and run scalar) and gives the reference; an out overlapping x
    otherwise is refused when the call is bound."""
    rng = np.random.default_rng(5)
    base = rng.standard_normal(1001).astype(np.float32)
    t = dev.tensor(base)
    x = t.strided((1000,), (1,), 0)
    with forced("vector_streaming"):
        got = twophase.silu(x, out=x)
        with pytest.raises(ParamError) as err:
            twophase.silu(x, out=t.strided((1000,), (1,), 1))
    assert got is x and err.value.arg == "out"
    want = base.copy()
    want[:1000] = unary_reference("silu")(base[:1000].astype(np.float64))
    np.testing.assert_allclose(t.numpy(), want, rtol=1e-6, atol=1e-7)
    m, other = np.ones(4096, np.float32), np.ones(4096, np.float32)
    with mock.patch.object(elementwise_kernels, "STREAMING", {}):  # any use of a streaming kernel: KeyError
        elementwise_kernels.build_unary("silu", m, m, False, np.dtype(np.float32), stream=True)
        with pytest.raises(KeyError):
            elementwise_kernels.build_unary("silu", m, other, False, np.dtype(np.float32), stream=True)


@pytest.mark.skipif(not streaming.AVAILABLE, reason="streaming stores are x86 only")
@pytest.mark.parametrize("name,dtype,store", [("silu_f32", np.float32, "vmovntps"), ("exp", np.float64, "vmovntpd")])
def test_streaming_unary_kernel_stores_whole_vectors_past_the_cache(name: str, dtype: Any, store: str) -> None:
    """The streaming unary kernel, recompiled uncached, computes with packed FMAs and stores them with aligned
    non-temporal vector stores (the loop vectorizer widened ``put_streaming``), then an sfence."""
    fresh = numba.njit(nogil=True, fastmath=FAST, error_model="numpy")(elementwise_kernels.STREAMING[name].py_func)
    arr = numba.types.Array(numba.from_dtype(np.dtype(dtype)), 1, "C")
    fresh.compile((arr, arr))
    asm = fresh.inspect_asm((arr, arr))
    assert PACKED_FMA.search(asm) and re.search(rf"{store}\s+%[yz]mm", asm) and "sfence" in asm


UFUNC_UNARY = sorted(n for n, spec in UNARY.items() if spec[0] == "ufunc")


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(UFUNC_UNARY),
    shape=st.lists(st.integers(1, 30), min_size=1, max_size=3).map(tuple),
    in_place=st.booleans(),
    parts=st.integers(2, 3),
    seed=st.integers(0, 2**31),
)
def test_numpy_unary_ops_in_parts_write_every_element(
    name: str, shape: tuple[int, ...], in_place: bool, parts: int, seed: int
) -> None:
    """neg / abs / sqrt / relu run as numpy calls on pieces of the output, one per helper thread (one call was one
    thread: relu of 4096 x 4096 ran at 0.6x np.copyto); every element written, in place too."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape) * 3
    if name == "sqrt":
        a = np.abs(a)
    op = getattr(ops, name)
    cut: list[int] = []
    plain = elementwise_ops.launcher
    op._launches.clear()  # bound launches are memoised by plan and addresses: this one is built here
    with (
        num_threads(parts),
        mock.patch.object(elementwise_ops, "FANOUT_MIN", 8),
        mock.patch.object(elementwise_ops, "launcher", lambda calls: (cut.append(len(calls)), plain(calls))[1]),
    ):
        if in_place:
            t = device("cpu").tensor(a)
            getattr(twophase, name)(t, out=t)
            got = t.numpy()
        else:
            r = run_checked(op, a)
            assert r.unwritten == (0,)
            got = r.outputs[0]
    np.testing.assert_array_equal(got, UNARY[name][3](a))
    axis = next((n for n in shape if n >= parts), None)  # pieces cut the first axis that has a row per part
    assert len(cut) == 1 and (cut[0] > 1) == (a.size >= 8 and axis is not None) and cut[0] <= parts
