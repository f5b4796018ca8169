"""The one-shot API generated from the registry: results vs float64 numpy for add / softmax / reduce_sum,
with and without ``out=``, host arrays as inputs, streams, and cleanup when a call fails."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import twophase
from twophase import ops
from twophase.ops.elementwise import BINARY

_shapes = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)
_float = st.sampled_from(["float32", "float64"])
_tol = {"float32": dict(rtol=2e-5, atol=1e-5), "float64": dict(rtol=1e-10, atol=1e-10)}


def _softmax_ref(a, dim):
    a = np.asarray(a, np.float64)
    e = np.exp(a - a.max(axis=dim, keepdims=True))
    return e / e.sum(axis=dim, keepdims=True)


@settings(max_examples=30, deadline=None)
@given(
    shape=_shapes, dtype=_float, use_out=st.booleans(), alpha=st.sampled_from([1, 2, -0.5]), seed=st.integers(0, 2**31)
)
def test_add_matches_numpy(shape, dtype, use_out, alpha, seed):
    dev = twophase.device("cpu")
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)
    x, y = dev.tensor(a), dev.tensor(b)
    out = dev.empty(shape, dtype) if use_out else None
    r = twophase.add(x, y, alpha=alpha, out=out)
    if use_out:
        assert r is out
    assert r.shape == shape and r.dtype.value == dtype
    np.testing.assert_allclose(r.numpy(), a.astype(np.float64) + alpha * b.astype(np.float64), **_tol[dtype])


@settings(max_examples=30, deadline=None)
@given(shape=_shapes, dtype=_float, use_out=st.booleans(), data=st.data())
def test_softmax_matches_numpy(shape, dtype, use_out, data):
    dev = twophase.device("cpu")
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    a = np.random.default_rng(data.draw(st.integers(0, 2**31))).standard_normal(shape).astype(dtype) * 3
    x = dev.tensor(a)
    out = dev.empty(shape, dtype) if use_out else None
    r = twophase.softmax(x, dim=dim, out=out)
    if use_out:
        assert r is out
    np.testing.assert_allclose(r.numpy(), _softmax_ref(a, dim), **_tol[dtype])


@settings(max_examples=30, deadline=None)
@given(
    shape=_shapes,
    dtype=st.sampled_from(["float32", "float64", "int32", "int64"]),
    use_out=st.booleans(),
    keep=st.booleans(),
    data=st.data(),
)
def test_reduce_sum_matches_numpy(shape, dtype, use_out, keep, data):
    dev = twophase.device("cpu")
    dims = tuple(sorted(data.draw(st.sets(st.integers(0, len(shape) - 1), max_size=len(shape)))))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    a = rng.standard_normal(shape) if dtype.startswith("float") else rng.integers(-100, 100, shape)
    a = a.astype(dtype)
    want = np.sum(a.astype(np.float64), axis=dims if dims else None, keepdims=keep)
    out_dtype = dtype if dtype.startswith("float") else "int64"
    out = dev.empty(np.shape(want), out_dtype) if use_out else None
    r = twophase.reduce_sum(dev.tensor(a), dims=dims, keep_dims=keep, out=out)
    if use_out:
        assert r is out
    assert r.shape == np.shape(want)
    tol = _tol.get(dtype, dict(rtol=0, atol=0))
    np.testing.assert_allclose(r.numpy(), want, **tol)


def test_host_arrays_are_accepted_as_inputs(rng):
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    np.testing.assert_allclose(twophase.add(a, b).numpy(), a + b)
    np.testing.assert_allclose(twophase.reduce_sum(a.tolist(), dims=0).numpy(), a.sum(0), rtol=1e-10)


def test_long_rows_use_a_workspace_and_stay_right(dev, rng):
    a = rng.standard_normal((2, 40000))
    _, ex = ops.softmax.get_workspace_size(dev.tensor(a).desc)
    assert ex.workspace_size > 0
    ex.destroy()
    np.testing.assert_allclose(twophase.softmax(dev.tensor(a)).numpy(), _softmax_ref(a, -1), rtol=1e-10)
    np.testing.assert_allclose(twophase.reduce_sum(dev.tensor(a), dims=1).numpy(), a.sum(1), rtol=1e-10)


def test_one_shot_runs_on_the_given_stream(dev, stream, gate, rng):
    a = rng.standard_normal((4, 4))
    x = dev.tensor(a, stream=stream)
    ev = gate(stream)
    r = twophase.softmax(x, dim=0, stream=stream)
    assert not stream.query()  # queued behind the gate: the call returned without waiting
    ev.set()
    np.testing.assert_allclose(r.numpy(), _softmax_ref(a, 0), rtol=1e-10)


def test_one_shot_is_generated_from_the_registry():
    assert twophase.softmax is twophase.one_shot(ops.softmax)
    assert set(twophase.functions()) == set(twophase.registry)
    assert {"add", "softmax", "reduce_sum"} <= set(dir(twophase))
    with pytest.raises(AttributeError):
        twophase.no_such_op  # noqa: B018


def test_failed_call_leaves_no_live_executor_or_allocation(dev, rng):
    x = dev.tensor(rng.standard_normal((2, 3)))
    wrong_out = dev.empty((3, 2), "float64")
    wrong_y = dev.tensor(rng.standard_normal((5, 7)))
    dev.synchronize()
    before_live = len(ops.add.counters.live)
    before_alloc = dev.pool.stats()["allocated_bytes"]
    with pytest.raises(twophase.ParamError):
        twophase.add(x, x, out=wrong_out)  # wrong out shape: refused in phase 1
    with pytest.raises(twophase.ParamError):
        twophase.add(x, wrong_y)  # shapes do not broadcast
    dev.synchronize()
    assert len(ops.add.counters.live) == before_live
    assert dev.pool.stats()["allocated_bytes"] == before_alloc
    for t in (x, wrong_out, wrong_y):
        t.free()


def test_host_inputs_copied_in_are_freed_after_the_call(dev, rng):
    """The copies of host inputs are the call's own: freed in stream order, on success and on every error path."""
    x = dev.tensor(rng.standard_normal((64, 64)).astype(np.float32))
    out = dev.empty((64, 64), "float32")
    w = dev.tensor(rng.standard_normal((3, 2)).astype(np.float32))
    host = rng.standard_normal((64, 64)).astype(np.float32)
    dev.synchronize()
    before = dev.pool.stats()["allocated_bytes"]
    for _ in range(3):
        twophase.add(host, x, out=out)
        twophase.add(x, np.float32(2), out=out)
        with pytest.raises(twophase.ParamError):
            twophase.matmul(host, np.ones((3, 3), np.float32))  # refused in phase 1
    dev.synchronize()
    np.testing.assert_allclose(out.numpy(), x.numpy() + 2)
    live = len(ops.embedding.counters.live)
    twophase.set_launch_blocking(True)
    try:
        with pytest.raises(twophase.ParamError, match="indices"):
            twophase.embedding(w, np.array([5]))  # the kernel's error, raised by the blocking launch
    finally:
        twophase.set_launch_blocking(False)
    dev.synchronize()
    assert dev.pool.stats()["allocated_bytes"] == before
    assert len(ops.embedding.counters.live) == live  # its executor destroyed too
    for t in (x, out, w):
        t.free()


@pytest.mark.parametrize(
    "bad, words",
    [(np.array([1], np.int16), "dtype in"), ([1, None], "numeric array-like"), ([[1], [1, 2]], "array-like")],
)
def test_host_inputs_the_device_cannot_hold_are_named(bad, words):
    with pytest.raises(twophase.ParamError, match=words) as e:
        twophase.exp(bad)
    assert "exp" in str(e.value) and e.value.arg == "x"


@pytest.mark.parametrize("dtype", ["float16", "float32", "int32", "int64"])
@pytest.mark.parametrize("scalar", [2, 2.5, True])
def test_python_scalars_take_the_dtype_of_the_other_operand(dev, rng, dtype, scalar):
    """Weak scalars, as numpy 2 and torch: a Python number beside a tensor does not widen it (numpy scalars do)."""
    a = (rng.standard_normal(16) * 10).astype(dtype)
    x = dev.tensor(a)
    for got, want in (
        (twophase.add(x, scalar), a + scalar),
        (twophase.mul(scalar, x), scalar * a),
        (twophase.maximum(x, scalar), np.maximum(a, scalar)),
    ):
        assert got.dtype.value == want.dtype.name  # numpy 2's result: float16 + 2.5 is float16, int32 + 2.5 float64
        np.testing.assert_array_equal(got.numpy(), want)
    cond = rng.standard_normal(16) > 0
    w = twophase.where(cond, x, scalar)
    assert w.dtype.value == np.where(cond, a, scalar).dtype.name
    assert twophase.lt(x, scalar).numpy().tolist() == (a < scalar).tolist()
    assert twophase.add(x, np.float64(2)).dtype.value == np.result_type(a, np.float64).name  # a numpy scalar is typed
    assert twophase.add(2.0, 3).dtype.value == "float64"  # no typed operand: numpy's default dtypes


def test_a_python_int_that_does_not_fit_the_operand_dtype_is_refused(dev):
    x = dev.tensor(np.arange(4, dtype=np.int32))
    with pytest.raises(twophase.ParamError, match="fits int32") as e:
        twophase.add(x, 2**40)
    assert e.value.arg == "other"


def test_every_op_is_its_one_shot_function_on_the_package():
    """No submodule or other name of the package hides an op (``twophase.log`` was the logging module)."""
    shadowed = {name for name, op in twophase.registry.items() if getattr(twophase, name) is not twophase.one_shot(op)}
    assert not shadowed
    np.testing.assert_allclose(twophase.log(np.array([1.0, np.e])).numpy(), [0.0, 1.0])


def test_no_submodule_of_ops_is_named_as_an_op():
    """``twophase.ops.<op>`` is the Op at run time, but a type checker resolves a submodule of that name first
    (``twophase.ops.matmul`` was the module holding matmul: ``get_workspace_size`` failed mypy there)."""
    import pkgutil

    submodules = {m.name for m in pkgutil.iter_modules(ops.__path__)}
    assert not submodules & set(twophase.registry)
    assert all(isinstance(getattr(ops, name), twophase.Op) for name in twophase.registry)


@pytest.mark.parametrize("name", sorted(BINARY))
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
def test_every_binary_op_with_a_python_scalar_matches_numpy_2(dev, name, dtype):
    """dtype and values of ``op(x, s)`` and ``op(s, x)`` as numpy 2 gives them (weak Python scalars)."""
    ufunc = BINARY[name][0]
    a = np.arange(1, 7).astype(dtype)
    x = dev.tensor(a)
    for scalar in (2, 2.5, True):
        for args, nargs in (((x, scalar), (a, scalar)), ((scalar, x), (scalar, a))):
            with np.errstate(all="ignore"):
                want = ufunc(*nargs)
            got = getattr(twophase, name)(*args).numpy()
            assert got.dtype == want.dtype, (name, dtype, scalar)
            np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-3, equal_nan=True)


def test_out_given_as_a_strided_desc_gets_a_tensor_of_that_layout(dev, rng):
    """``out=`` a column-major TensorDesc: the plan was made for those strides, the output allocated for it was
    dense (matmul's packed path wrote it as column-major: every element wrong)."""
    from twophase.tensor import TensorDesc

    s = dev.stream()
    a_np = rng.standard_normal((64, 48)).astype(np.float32)
    b_np = rng.standard_normal((48, 40)).astype(np.float32)
    a, b = dev.tensor(a_np, stream=s), dev.tensor(b_np, stream=s)
    od = TensorDesc((64, 40), "float32", (1, 64))
    y = twophase.matmul(a, b, out=od, stream=s)
    assert y.desc == od
    np.testing.assert_allclose(y.numpy(), a_np.astype(np.float64) @ b_np, rtol=1e-4, atol=1e-4)
    with twophase.plan("matmul", a, b, out=TensorDesc((64, 40), "float32", (80, 2), 1), stream=s) as call:
        z = call()
        assert z.desc == call.executor.output_descs[0]
        np.testing.assert_allclose(z.numpy(), a_np.astype(np.float64) @ b_np, rtol=1e-4, atol=1e-4)
    for t in (y, a, b):
        t.free(s)
    s.close()
