"""add, reduce_sum and softmax against float64 numpy references on random shapes, layouts and dtypes, with
poisoned outputs and a guarded workspace; and their workspace sizes against the documented formulas."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twophase import TensorDesc, ops
from twophase.kernels.cpu.reduce import build_tree
from twophase.ops.reduce import plan_tree, source_view
from twophase.testing import run_checked
from twophase.testing.checked import view_of

FIXTURES = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
TOL = {"float16": (2e-3, 2e-3), "float32": (2e-6, 1e-6), "float64": (1e-12, 1e-12)}
LAYOUTS = ("contiguous", "strided", "transposed")


def align64(n: int) -> int:
    return -(-n // 64) * 64


def merges(shape, strides) -> bool:
    """Whether dims walk memory with one stride (size-1 dims ignored): the test's own copy of the rule."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    if any(n == 0 for n, _ in dims):
        return True
    return all(s == dims[i + 1][1] * dims[i + 1][0] for i, (n, s) in enumerate(dims[:-1]))


def reduce_workspace(shape, strides, red, itemsize, f16=False) -> int:
    """reduce_sum's docstring: align64(K * n_i * 8) per non-final level, + align64(K * R * itemsize) if packed,
    + align64(K * 8) for a float16 output's float64 stage."""
    kept = [i for i in range(len(shape)) if i not in red]
    k = math.prod(shape[i] for i in kept)
    r = math.prod(shape[i] for i in red)
    ws, n = 0, r
    while n > 4096:
        n = -(-n // 4096)
        ws += align64(k * n * 8)
    packed = (
        f16
        or not merges([shape[i] for i in kept], [strides[i] for i in kept])
        or not merges([shape[i] for i in red], [strides[i] for i in red])
    )
    if packed and k * r:
        ws += align64(k * r * (4 if f16 else itemsize))
    if f16 and k * r:
        ws += align64(k * 8)
    return ws


def softmax_workspace(shape, strides, dim, itemsize, f16=False, out_strides=None) -> int:
    """softmax's docstring: align64(K * ceil(N/B) * 16) when N > 32768, B = 8192/c, + align64(K*N*c) if packed
    (c = 4 for float16, else itemsize)."""
    kept = [i for i in range(len(shape)) if i != dim]
    n = shape[dim] if shape else 1
    k = math.prod(shape[i] for i in kept)
    ws = align64(k * -(-n // (8192 // (4 if f16 else itemsize))) * 16) if n > 32768 else 0
    out_strides = out_strides or strides
    packed = (
        f16
        or not merges([shape[i] for i in kept], [strides[i] for i in kept])
        or not merges([shape[i] for i in kept], [out_strides[i] for i in kept])
    )
    if packed and k * n:
        ws += align64(k * n * (4 if f16 else itemsize))
    return ws


def on_device(dev, stream, a: np.ndarray, layout: str):
    """A device tensor equal to ``a``: dense, every other element of a wider buffer, or a transposed buffer."""
    if layout == "contiguous" or a.ndim == 0:
        return dev.tensor(a, stream=stream)
    if layout == "strided":
        base = np.zeros(a.shape[:-1] + (2 * a.shape[-1] + 1,), a.dtype)
        view = base[..., 1::2]
    else:
        base = np.zeros(a.shape[::-1], a.dtype)
        view = base.T
    view[...] = a
    return view_of(dev.tensor(base, stream=stream), base, view)


def random_array(rng, shape, dtype):
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype.startswith("int"):
        return rng.integers(-50, 50, shape).astype(dtype)
    return (rng.standard_normal(shape) * 3).astype(dtype)


def check(run, ref, dtype, ws_expected=None):
    assert run.guards_intact
    assert run.unwritten == (int(np.isnan(ref).sum()),)
    got = run.outputs[0]
    rtol, atol = TOL.get(dtype or str(got.dtype), (0, 0))
    np.testing.assert_allclose(got.astype(np.float64), ref, rtol=rtol, atol=atol * max(1.0, np.abs(ref).max(initial=0)))
    if ws_expected is not None:
        assert run.workspace_size == ws_expected
    assert run.touched <= run.workspace_size
    if run.workspace_size:
        assert run.touched > run.workspace_size - 64  # the documented workspace is used, not just reserved


# ---------------------------------------------------------------- add
@st.composite
def broadcast_pair(draw):
    out = draw(st.lists(st.integers(0, 5), min_size=0, max_size=4))

    def operand():
        nd = draw(st.integers(0, len(out)))
        return tuple(1 if draw(st.booleans()) else n for n in out[len(out) - nd :])

    return operand(), operand()


@settings(max_examples=60, **FIXTURES)
@given(
    shapes=broadcast_pair(),
    dtypes=st.sampled_from(
        [
            ("float32", "float32"),
            ("float64", "float32"),
            ("int32", "int64"),
            ("int32", "float32"),
            ("float64", "float64"),
        ]
    ),
    layouts=st.tuples(st.sampled_from(LAYOUTS), st.sampled_from(LAYOUTS)),
    alpha=st.sampled_from([1, 2, -3]),
)
def test_add_matches_numpy_with_broadcasting_promotion_and_layouts(dev, stream, shapes, dtypes, layouts, alpha):
    rng = np.random.default_rng(len(shapes[0]) * 7 + len(shapes[1]))
    a, b = (random_array(rng, s, d) for s, d in zip(shapes, dtypes))
    x, y = (on_device(dev, stream, arr, lay) for arr, lay in zip((a, b), layouts))
    run = run_checked(ops.add, x, y, stream=stream, alpha=alpha)
    ref = a.astype(np.float64) + alpha * b.astype(np.float64)
    assert run.outputs[0].shape == np.broadcast_shapes(a.shape, b.shape)
    assert run.outputs[0].dtype == np.result_type(a.dtype, b.dtype)
    # float32 tolerance when an operand is float32 (see the xfail below for the scaled float64 case)
    check(run, ref, "float32" if "float32" in dtypes else None, ws_expected=0)


def test_add_scaled_computes_in_the_promoted_dtype(dev, stream, rng):
    a, b = rng.standard_normal(1000), rng.standard_normal(1000).astype(np.float32)
    run = run_checked(ops.add, a, b, stream=stream, alpha=3)
    np.testing.assert_allclose(run.outputs[0], a + 3 * b.astype(np.float64), rtol=1e-13)


@pytest.mark.parametrize("alpha", [1, 2.5])
def test_add_in_place_into_its_own_input(dev, stream, rng, alpha):
    a, b = rng.standard_normal((4, 6)), rng.standard_normal(6)
    x, y = dev.tensor(a, stream=stream), dev.tensor(b, stream=stream)
    size, ex = ops.add.get_workspace_size(x, y, out=x, alpha=alpha)
    ops.add(None, size, ex, stream)
    np.testing.assert_allclose(x.numpy(), a + alpha * b, rtol=1e-12)


# ---------------------------------------------------------------- reduce_sum
@st.composite
def reduce_case(draw):
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=1, max_size=4)))
    n = len(shape)
    dims = tuple(draw(st.lists(st.integers(-n, n - 1), max_size=n, unique_by=lambda d: d % n)))
    return shape, dims


@settings(max_examples=60, **FIXTURES)
@given(
    case=reduce_case(),
    keep=st.booleans(),
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from(["float32", "float64", "int32", "bool"]),
)
def test_reduce_sum_matches_numpy_on_random_shapes_dims_and_layouts(dev, stream, case, keep, layout, dtype):
    shape, dims = case
    rng = np.random.default_rng(sum(shape) + 10 * len(dims))
    a = random_array(rng, shape, dtype)
    x = on_device(dev, stream, a, layout)
    run = run_checked(ops.reduce_sum, x, stream=stream, dims=dims, keep_dims=keep)
    ref = np.sum(a.astype(np.float64), axis=tuple(dims) if dims else None, keepdims=keep)
    red = tuple(sorted(d % len(shape) for d in dims)) if dims else tuple(range(len(shape)))
    ws = reduce_workspace(shape, x.desc.strides, red, a.dtype.itemsize, f16=dtype == "float16")
    assert run.outputs[0].dtype == (np.int64 if dtype in ("int32", "bool") else np.dtype(dtype))
    check(run, ref, dtype, ws_expected=ws)


def test_reduce_sum_float16_matches_numpy(dev, stream, rng):
    a = rng.standard_normal((4, 6)).astype(np.float16)
    run = run_checked(ops.reduce_sum, a, stream=stream, dims=(1,))
    check(run, a.astype(np.float64).sum(1), "float16", ws_expected=reduce_workspace((4, 6), (6, 1), (1,), 2, f16=True))


@pytest.mark.parametrize(
    "shape, dims, layout",
    [
        ((3, 5000), (1,), "contiguous"),  # one level of partials
        ((2, 20000), (-1,), "strided"),  # one level, strided rows
        ((5, 4097), (1,), "transposed"),  # packed + one level
        ((256, 5000), (1,), "contiguous"),  # parallel tree
        ((9000,), (), "contiguous"),
    ],
)
def test_reduce_sum_long_rows_use_the_documented_workspace(dev, stream, rng, shape, dims, layout):
    a = rng.standard_normal(shape).astype(np.float32)
    x = on_device(dev, stream, a, layout)
    run = run_checked(ops.reduce_sum, x, stream=stream, dims=dims)
    red = tuple(d % len(shape) for d in dims) if dims else tuple(range(len(shape)))
    ws = reduce_workspace(shape, x.desc.strides, red, 4)
    assert ws > 0
    check(run, np.sum(a.astype(np.float64), axis=red), "float32", ws_expected=ws)


def test_reduce_sum_workspace_grows_with_the_reduced_length():
    sizes = []
    for r in (4096, 4097, 4096 * 4096, 4096 * 4096 + 1, 10**8):
        size, ex = ops.reduce_sum.get_workspace_size(TensorDesc((3, r)), dims=(1,))
        assert size == reduce_workspace((3, r), (r, 1), (1,), 4)
        sizes.append(size)
        ex.destroy()
    assert sizes[0] == 0 and sizes == sorted(sizes) and sizes[3] > sizes[2]
    # two levels for R > 4096^2: ceil(R/4096) then ceil(that/4096) partials per row
    n1 = -(-(4096 * 4096 + 1) // 4096)
    assert sizes[3] == align64(3 * n1 * 8) + align64(3 * 2 * 8)


def test_multi_level_tree_matches_numpy(rng):
    """The level loop with a tiny block, so several levels run on small data."""
    a = rng.standard_normal((3, 1000))
    x = TensorDesc(a.shape, "float64")
    t = plan_tree(x, (1,), (0,), 8, 8, block=4)
    assert len(t.levels) == 4 and t.levels == (250, 63, 16, 4)
    out = np.full((3, 1), np.nan)
    ws = np.full(t.workspace, 0xCD, np.uint8)
    build_tree(source_view(a, (1,), (0,), t.pack), out, t, np.dtype(np.float64), np.dtype(np.float64))(ws)
    np.testing.assert_allclose(out[:, 0], a.sum(1), rtol=1e-12)


def test_reduce_sum_of_empty_tensors(dev, stream):
    run = run_checked(ops.reduce_sum, np.zeros((0, 4), np.float32), stream=stream, dims=(0,))
    assert run.outputs[0].shape == (4,) and not run.outputs[0].any() and run.unwritten == (0,)
    run = run_checked(ops.reduce_sum, np.zeros((3, 0), np.float32), stream=stream, dims=(0,))
    assert run.outputs[0].shape == (0,) and run.workspace_size == 0


# ---------------------------------------------------------------- softmax
def softmax_ref(a, dim):
    a = a.astype(np.float64)
    if a.ndim == 0:
        return np.ones_like(a)
    e = np.exp(a - a.max(axis=dim, keepdims=True)) if a.size else a
    return e / e.sum(axis=dim, keepdims=True) if a.size else a


@st.composite
def softmax_case(draw):
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=4)))
    return shape, draw(st.integers(-len(shape), len(shape) - 1))


@settings(max_examples=60, **FIXTURES)
@given(case=softmax_case(), layout=st.sampled_from(LAYOUTS), dtype=st.sampled_from(["float32", "float64", "float16"]))
def test_softmax_matches_numpy_on_random_shapes_dims_and_layouts(dev, stream, case, layout, dtype):
    shape, dim = case
    rng = np.random.default_rng(sum(shape) + dim % len(shape))
    a = random_array(rng, shape, dtype)
    x = on_device(dev, stream, a, layout)
    run = run_checked(ops.softmax, x, stream=stream, dim=dim)
    ws = softmax_workspace(
        shape,
        x.desc.strides,
        dim % len(shape),
        a.dtype.itemsize,
        f16=dtype == "float16",
        out_strides=TensorDesc(shape).strides,
    )
    assert run.outputs[0].dtype == np.dtype(dtype)
    check(run, softmax_ref(a, dim), dtype, ws_expected=ws)


@pytest.mark.parametrize(
    "shape, dim, layout, dtype",
    [
        ((3, 40000), -1, "contiguous", "float32"),  # split rows: partials in the workspace
        ((2, 70001), 1, "strided", "float64"),  # split, strided rows
        ((40000, 2), 0, "contiguous", "float32"),  # long dim not last: strided rows
        ((2, 33000), -1, "transposed", "float32"),  # packed + split
        ((600, 500), -1, "contiguous", "float32"),  # parallel rows
        ((4, 32768), -1, "contiguous", "float16"),  # longest unsplit row, packed for float16
    ],
)
def test_softmax_long_rows_use_the_documented_workspace(dev, stream, rng, shape, dim, layout, dtype):
    a = random_array(rng, shape, dtype)
    x = on_device(dev, stream, a, layout)
    run = run_checked(ops.softmax, x, stream=stream, dim=dim)
    ws = softmax_workspace(
        shape, x.desc.strides, dim % 2, a.dtype.itemsize, f16=dtype == "float16", out_strides=TensorDesc(shape).strides
    )
    check(run, softmax_ref(a, dim), dtype, ws_expected=ws)
    assert run.implementation == ("split_rows" if shape[dim] > 32768 else run.implementation)


def test_softmax_workspace_grows_with_the_row_length():
    sizes = []
    for n in (32768, 32769, 65536, 10**6):
        size, ex = ops.softmax.get_workspace_size(TensorDesc((5, n)))
        assert size == align64(5 * -(-n // 2048) * 16) * (n > 32768)
        sizes.append(size)
        ex.destroy()
    assert sizes[0] == 0 and sizes == sorted(sizes) and sizes[-1] > sizes[1]


def test_softmax_handles_extremes_and_nan(dev, stream):
    a = np.array([[1000.0, -1000.0, 0.0], [np.nan, 1.0, 2.0], [-np.inf, 0.0, 0.0]], np.float32)
    run = run_checked(ops.softmax, a, stream=stream, dim=-1)
    np.testing.assert_allclose(run.outputs[0][0], [1.0, 0.0, 0.0], atol=1e-7)
    assert np.isnan(run.outputs[0][1]).all()
    np.testing.assert_allclose(run.outputs[0][2], [0.0, 0.5, 0.5], atol=1e-7)


def test_softmax_op_doc_formula_matches_a_packed_float64_workspace():
    x = TensorDesc((4, 3, 5), "float64", strides=(1, 20, 4))  # kept dims (0, 1) do not merge
    size, ex = ops.softmax.get_workspace_size(x, dim=-1)
    ex.destroy()
    assert ex.tiling.pack
    assert size == align64(4 * 3 * 5 * 8)  # what the op's doc / workspace_formula promise: float64 packs 8 bytes
    assert "c = 4 for float16, else itemsize" in ops.softmax.spec.workspace_formula


def test_run_checked_waits_for_inputs_still_pending_on_another_stream(dev, stream, rng, gate):
    other = dev.stream()
    a = rng.standard_normal((4, 8))
    ev = gate(other)
    x = dev.tensor(a, stream=other)  # its copy-in waits behind the gate
    threading.Timer(0.2, ev.set).start()
    run = run_checked(ops.softmax, x, stream=stream, dim=-1)
    check(run, softmax_ref(a, -1), "float64")
