"""Tree reductions (sum, mean, max, min) against float64 numpy over dims, layouts and long extents."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_layouts import LAYOUTS, on_device, random, shapes

from twophase import ops
from twophase.errors import ParamError
from twophase.ops.reduce import tree_levels
from twophase.testing import run_checked

NAMES = ["reduce_sum", "reduce_mean", "reduce_max", "reduce_min"]


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    shape=shapes(1, 4, 6),
    layout=st.sampled_from(LAYOUTS),
    keep=st.booleans(),
    dtype=st.sampled_from([np.float32, np.float64, np.int32, np.float16]),
    data=st.data(),
)
def test_reduction_matches_float64_reference(
    name: str, shape: tuple[int, ...], layout: str, keep: bool, dtype: Any, data: Any
) -> None:
    if name == "reduce_mean" and dtype == np.int32:
        dtype = np.float64
    dims = tuple(data.draw(st.sets(st.integers(-len(shape), len(shape) - 1), max_size=len(shape))))
    red = {d % len(shape) for d in dims} if dims else set(range(len(shape)))
    if name in ("reduce_max", "reduce_min") and any(shape[d] == 0 for d in red):
        shape = tuple(max(n, 1) for n in shape)
    if len({d % len(shape) for d in dims}) != len(dims):
        dims = tuple({d % len(shape) for d in dims})
    x = random(shape, dtype, np.random.default_rng(len(shape)))
    op = getattr(ops, name)
    r = run_checked(op, on_device(x, layout), dims=dims, keep_dims=keep)
    ref = op.spec.reference(x, dims=dims, keep_dims=keep)
    assert r.guards_intact and r.unwritten == (int(np.isnan(ref).sum()),) and r.touched <= r.workspace_size
    tol = {np.float16: 2e-3, np.float32: 1e-5, np.float64: 1e-12, np.int32: 0}[dtype]
    np.testing.assert_allclose(r.outputs[0].astype(np.float64), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "name,n",
    [("reduce_sum", 17_000_000), ("reduce_mean", 300_000), ("reduce_max", 17_000_000), ("reduce_min", 300_000)],
)
def test_long_extent_uses_multi_level_tree_with_partials_in_workspace(name: str, n: int) -> None:
    x = np.random.default_rng(5).standard_normal((2, n // 2)).astype(np.float32).reshape(1, -1)
    r = run_checked(getattr(ops, name), x, dims=(1,))
    levels = tree_levels(n, 4096)
    assert len(levels) == (2 if n > 4096**2 else 1) and r.tiling.levels == levels
    assert r.implementation == ("tree_parallel" if n >= 1 << 20 else "tree")
    assert r.workspace_size > 0 and r.touched > 0 and r.guards_intact
    np.testing.assert_allclose(r.outputs[0], getattr(ops, name).spec.reference(x, dims=(1,)), rtol=1e-5)


def test_max_min_propagate_nan() -> None:
    x = np.arange(20.0).reshape(2, 10)
    x[1, 3] = np.nan
    for name in ("reduce_max", "reduce_min"):
        got = run_checked(getattr(ops, name), x, dims=(1,)).outputs[0]
        assert not np.isnan(got[0]) and np.isnan(got[1])


@pytest.mark.parametrize(
    "call,arg",
    [
        (lambda: ops.reduce_max.get_workspace_size(on_device(np.ones((2, 0))), dims=(1,)), "dims"),
        (lambda: ops.reduce_mean.get_workspace_size(on_device(np.ones(3, np.int32))), "x"),
        (lambda: ops.reduce_min.get_workspace_size(on_device(np.ones((2, 3))), dims=(0, -2)), "dims"),
        (lambda: ops.reduce_max.get_workspace_size(on_device(np.ones((2, 3))), dims=(2,)), "dims"),
    ],
)
def test_bad_inputs_raise_param_error_naming_the_argument(call: Any, arg: str) -> None:
    with pytest.raises(ParamError) as e:
        call()
    assert e.value.arg == arg


@pytest.mark.parametrize("name", NAMES + ["argmax", "var"])
def test_keep_dims_takes_numpy_bools_and_refuses_other_non_bools(name: str) -> None:
    """np.True_ / np.False_ (numpy comparisons and masks give them) are bools, as numpy's keepdims takes them (they
    were refused); numpy ints, floats, strings and ints other than 0 / 1 stay refused, naming keep_dims."""
    op = getattr(ops, name)
    x = random((3, 4, 5), np.float64, np.random.default_rng(12))
    dims: dict[str, Any] = {"dim": 1} if name == "argmax" else {"dims": (0, 2)}
    kept, dropped = ((3, 1, 5), (3, 5)) if name == "argmax" else ((1, 4, 1), (4,))
    for keep in (np.True_, np.False_):
        r = run_checked(op, on_device(x, "transposed"), keep_dims=keep, **dims)
        ref = op.spec.reference(x, keep_dims=bool(keep), **dims)
        assert r.outputs[0].shape == ref.shape == (kept if keep else dropped) and r.unwritten == (0,)
        np.testing.assert_allclose(r.outputs[0].astype(np.float64), ref, rtol=1e-12, atol=1e-12)
    for bad in (np.int64(1), np.float64(1.0), 1.0, 2, "True", None):
        with pytest.raises(ParamError) as e:
            op.get_workspace_size(on_device(x), keep_dims=bad, **dims)
        assert e.value.op == name and e.value.arg == "keep_dims" and e.value.expected == "a bool"


# ---------------------------------------------------------------- argmax, var and the tree's workspace formulas
def _align64(n: int) -> int:
    return (n + 63) // 64 * 64


def _levels(r: int, block: int) -> list[int]:
    out, n = [], r
    while n > block:
        n = -(-n // block)
        out.append(n)
    return out


def _merges(shape: tuple[int, ...], strides: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    d = [(n, s) for n, s in zip((shape[i] for i in dims), (strides[i] for i in dims)) if n != 1]
    return all(d[i][1] == d[i + 1][1] * d[i + 1][0] for i in range(len(d) - 1))


def documented_workspace(name: str, x: Any, red: tuple[int, ...], block: int = 4096) -> int:
    """The workspace formula of each op's doc, computed independently from the tensor desc."""
    shape, strides, dt = x.desc.shape, x.desc.strides, x.desc.dtype.np
    kept = tuple(i for i in range(len(shape)) if i not in red)
    k_rows = int(np.prod([shape[i] for i in kept], dtype=np.int64))
    r = int(np.prod([shape[i] for i in red], dtype=np.int64))
    if k_rows * r == 0:
        return 0
    f16 = dt == np.float16
    v = 4 if f16 else np.dtype(dt).itemsize
    packed = f16 or not _merges(shape, strides, kept) or not _merges(shape, strides, red)
    ws = 0
    for n in _levels(r, block):
        ws += (
            _align64(k_rows * n * v) + _align64(k_rows * n * 8)
            if name == "argmax"
            else _align64(k_rows * n * (8 if name == "reduce_mean" else 24))
        )
    if name == "var" and _levels(r, block):  # a one-block row goes straight to out
        ws += _align64(k_rows * 24)
    if packed:
        ws += _align64(k_rows * r * v)
    if (name == "var" and f16) or (name == "reduce_mean" and dt in (np.float16, np.float32)):  # the float64 stage
        ws += _align64(k_rows * 8)
    return ws


def check_workspace(r: Any, expected: int) -> None:
    assert r.guards_intact and r.workspace_size == expected
    assert r.touched <= r.workspace_size and (expected == 0 or r.touched > expected - 64)


@settings(max_examples=50, deadline=None)
@given(
    shape=shapes(1, 4, 6),
    layout=st.sampled_from(LAYOUTS),
    keep=st.booleans(),
    dtype=st.sampled_from([np.float32, np.float64, np.int32, np.int64, np.float16]),
    nans=st.booleans(),
    data=st.data(),
)
def test_argmax_matches_numpy_first_index_nan_wins(
    shape: tuple[int, ...], layout: str, keep: bool, dtype: Any, nans: bool, data: Any
) -> None:
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    shape = tuple(max(n, 1) if i == dim % len(shape) else n for i, n in enumerate(shape))
    rng = np.random.default_rng(sum(shape) + len(shape))
    x = random(shape, dtype, rng)
    if np.dtype(dtype).kind == "f":
        x = np.round(x).astype(dtype)  # ties: the first index must win
        if nans and x.size:
            x.reshape(-1)[rng.integers(0, x.size, 1 + x.size // 5)] = np.nan
    t = on_device(x, layout)
    r = run_checked(ops.argmax, t, dim=dim, keep_dims=keep)
    ref = np.argmax(x, axis=dim, keepdims=keep)
    assert r.outputs[0].dtype == np.int64
    np.testing.assert_array_equal(r.outputs[0], ref)
    check_workspace(r, documented_workspace("argmax", t, (dim % len(shape),)))


@settings(max_examples=50, deadline=None)
@given(
    shape=shapes(1, 4, 6),
    layout=st.sampled_from(LAYOUTS),
    keep=st.booleans(),
    dtype=st.sampled_from([np.float32, np.float64, np.float16]),
    correction=st.sampled_from([0, 1, 2, 0.5]),
    data=st.data(),
)
def test_var_matches_float64_numpy(
    shape: tuple[int, ...], layout: str, keep: bool, dtype: Any, correction: float, data: Any
) -> None:
    dims = tuple(
        data.draw(
            st.lists(st.integers(-len(shape), len(shape) - 1), max_size=len(shape), unique_by=lambda d: d % len(shape))
        )
    )
    x = random(shape, dtype, np.random.default_rng(len(shape))) + np.asarray(100, dtype)  # an offset: no cancellation
    t = on_device(x, layout)
    r = run_checked(ops.var, t, dims=dims, correction=correction, keep_dims=keep)
    with np.errstate(all="ignore"):
        ref = np.var(x.astype(np.float64), axis=tuple(dims) if dims else None, ddof=correction, keepdims=keep)
    assert r.outputs[0].dtype == dtype and r.unwritten == (int(np.isnan(ref).sum()),)
    tol = {np.float16: 2e-3, np.float32: 1e-5, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(
        r.outputs[0].astype(np.float64),
        ref.astype(dtype).astype(np.float64) if dtype == np.float16 else ref,
        rtol=tol,
        atol=tol,
    )
    red = tuple(sorted(d % len(shape) for d in dims)) if dims else tuple(range(len(shape)))
    check_workspace(r, documented_workspace("var", t, red))


@pytest.fixture
def small_blocks(monkeypatch: Any) -> Any:
    """Blocks of 4 elements: small inputs make trees of several levels (the plan cache is cleared around it)."""
    import twophase.ops.reduce as reduce_mod
    from twophase.cache import clear_cache

    clear_cache()
    monkeypatch.setattr(reduce_mod, "BLOCK", 4)
    yield 4
    clear_cache()


@pytest.mark.parametrize(
    "shape,layout", [((3, 1000), "dense"), ((3, 1000), "reversed"), ((2, 301), "transposed"), ((2, 77), "strided")]
)
def test_multi_level_argmax_and_var_with_small_blocks(small_blocks: int, shape: tuple[int, ...], layout: str) -> None:
    rng = np.random.default_rng(7)
    x = np.round(rng.standard_normal(shape) * 4).astype(np.float32)
    x[0, shape[1] // 2] = 50.0
    x[0, shape[1] - 3] = 50.0  # a tie in another block: the first index wins
    t = on_device(x, layout)
    r = run_checked(ops.argmax, t, dim=1)
    assert len(r.tiling.levels) >= 3 and r.tiling.block == 4
    np.testing.assert_array_equal(r.outputs[0], np.argmax(x, axis=1))
    check_workspace(r, documented_workspace("argmax", t, (1,), block=4))
    v = run_checked(ops.var, t, dims=(1,), correction=1)
    np.testing.assert_allclose(v.outputs[0], np.var(x.astype(np.float64), axis=1, ddof=1), rtol=1e-6)
    check_workspace(v, documented_workspace("var", t, (1,), block=4))
    x[1, 5] = np.nan
    r = run_checked(ops.argmax, on_device(x, layout), dim=1)
    assert r.outputs[0][1] == 5


@pytest.mark.parametrize("name", NAMES)
def test_multi_level_sum_max_in_both_loop_orders_with_small_blocks(small_blocks: int, name: str) -> None:
    x = np.random.default_rng(8).standard_normal((1001, 37)).astype(np.float32)
    op = getattr(ops, name)
    for dims in ((0,), (1,)):
        r = run_checked(op, x, dims=dims)
        assert r.tiling.orient == ("cols" if dims == (0,) else "rows")
        assert len(r.tiling.levels) == len(_levels(x.shape[dims[0]], 4))
        np.testing.assert_allclose(r.outputs[0], op.spec.reference(x, dims=dims), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_argmax_first_index_on_rows_long_enough_to_search(dtype: Any, layout: str) -> None:
    """Rows of 255-5000 elements (the search for the max's first position from FIRST_SEARCH_MIN on), rounded so
    that the max repeats, some with NaNs (the first NaN wins) and a max in the last, partial step."""
    rng = np.random.default_rng(11)
    for n in (255, 256, 300, 1000, 5000):
        x = np.round(rng.standard_normal((6, n)) * 2).astype(dtype)
        x[1, -1] = 50.0  # in the tail after the whole steps
        x[2, [n // 3, n - 2]] = np.nan
        x[3, [7, n // 2]] = 60.0
        x[4, :] = -1.0
        r = run_checked(ops.argmax, on_device(x, layout), dim=1)
        np.testing.assert_array_equal(r.outputs[0], np.argmax(x, axis=1), err_msg=f"n={n}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("width", [8, 16, 32, 40, 64, 128])
def test_sums_over_the_leading_dim_of_narrow_rows(dtype: Any, width: int) -> None:
    """Column sums, maxima and minima of narrow rows lying back to back (accumulated in registers where the width
    is 1, 2, 4 or 8 64-byte vectors), over several blocks and levels; sums against float64, a NaN column."""
    x = np.random.default_rng(width).standard_normal((9000, width)).astype(dtype) + 1
    for op in (ops.reduce_sum, ops.reduce_mean):
        r = run_checked(op, x, dims=(0,))
        np.testing.assert_allclose(r.outputs[0], op.spec.reference(x.astype(np.float64), dims=(0,)), rtol=1e-6)
    x[4500, 1] = np.nan  # that column's max and min are NaN
    x[7000, 2] = 99.0
    x[100, 3] = -99.0
    for op, pick in ((ops.reduce_max, np.max), (ops.reduce_min, np.min)):
        r = run_checked(op, x, dims=(0,))
        np.testing.assert_array_equal(r.outputs[0], pick(x, axis=0))


def test_long_reductions_and_many_short_rows() -> None:
    rng = np.random.default_rng(9)
    long = rng.standard_normal((2, 600_000)).astype(np.float32)
    long[1, 450_001] = 9.0
    r = run_checked(ops.argmax, long, dim=1)
    assert r.tiling.levels == (147,) and r.implementation == "tree_parallel"
    np.testing.assert_array_equal(r.outputs[0], np.argmax(long, axis=1))
    v = run_checked(ops.var, long, dims=(1,), correction=0)
    np.testing.assert_allclose(v.outputs[0], np.var(long.astype(np.float64), axis=1), rtol=1e-6)
    short = rng.standard_normal((400_000, 3))
    r = run_checked(ops.argmax, short, dim=-1, keep_dims=True)
    np.testing.assert_array_equal(r.outputs[0], np.argmax(short, axis=-1, keepdims=True))
    v = run_checked(ops.var, short, dims=(1,))
    np.testing.assert_allclose(v.outputs[0], np.var(short, axis=1, ddof=1), rtol=1e-12)
    cols = rng.standard_normal((300_000, 5)).astype(np.float32)
    for name in NAMES:
        op = getattr(ops, name)
        r = run_checked(op, cols, dims=(0,))
        assert r.tiling.orient == "cols" and r.implementation == "tree_parallel"
        np.testing.assert_allclose(r.outputs[0], op.spec.reference(cols, dims=(0,)), rtol=1e-5)


def test_float32_sum_at_least_as_accurate_as_numpy() -> None:
    x = (np.random.default_rng(10).random(3_000_000) * 1000 + 1e4).astype(np.float32)
    exact = float(np.sum(x.astype(np.float64)))
    ours = float(run_checked(ops.reduce_sum, x).outputs[0])
    assert abs(ours - exact) <= abs(float(np.sum(x)) - exact) + abs(exact) * 2**-24


def test_var_degenerate_counts_follow_numpy_ddof() -> None:
    x = np.array([[1.0, 3.0], [2.0, 2.0]])
    got = run_checked(ops.var, x, dims=(1,), correction=2).outputs[0]
    assert np.isinf(got[0]) and np.isnan(got[1])  # M2 / 0 and 0 / 0
    assert np.isnan(run_checked(ops.var, np.zeros((3, 0)), dims=(1,)).outputs[0]).all()
    assert run_checked(ops.argmax, np.float64(3.0), dim=0).outputs[0] == 0


@pytest.mark.parametrize(
    "call,arg",
    [
        (lambda: ops.argmax.get_workspace_size(on_device(np.ones((2, 0))), dim=1), "dim"),
        (lambda: ops.argmax.get_workspace_size(on_device(np.ones((2, 3))), dim=2), "dim"),
        (lambda: ops.argmax.get_workspace_size(on_device(np.ones((2, 3)))), "dim"),
        (lambda: ops.argmax.get_workspace_size(on_device(np.ones(3, bool)), dim=0), "x"),
        (lambda: ops.var.get_workspace_size(on_device(np.ones((2, 3))), correction=-1), "correction"),
        (lambda: ops.var.get_workspace_size(on_device(np.ones((2, 3))), correction=float("nan")), "correction"),
        (lambda: ops.var.get_workspace_size(on_device(np.ones((2, 3))), correction="1"), "correction"),
        (lambda: ops.var.get_workspace_size(on_device(np.ones(3, np.int32))), "x"),
        (lambda: ops.var.get_workspace_size(on_device(np.ones((2, 3))), dims=(1, -1)), "dims"),
    ],
)
def test_argmax_var_bad_inputs_raise_param_error(call: Any, arg: str) -> None:
    with pytest.raises(ParamError) as e:
        call()
    assert e.value.arg == arg


# ---------------------------------------------------------------- large means, float16 / float32 means, 0-d inputs
LARGE_MEAN_CASES = [
    ((4096,), (), "dense"),
    ((3, 1000), (1,), "padded"),
    ((2, 300_000), (1,), "dense"),
    ((5000, 3), (0,), "dense"),
    ((7, 11, 13), (0, 2), "transposed"),
    ((9, 5000), (1,), "reversed"),
]


@pytest.mark.parametrize("mean", [1e6, 1e7])
@pytest.mark.parametrize("shape,dims,layout", LARGE_MEAN_CASES)
def test_float32_var_of_large_mean_data_does_not_cancel(
    shape: tuple[int, ...], dims: tuple[int, ...], layout: str, mean: float
) -> None:
    """Unit spread on a mean of 1e7: sums of x and x^2 cancel (var was off by 30%); shifted by a sample they do
    not. Rows of one block, split rows merged over levels, strided and packed inputs."""
    x = (mean + np.random.default_rng(len(shape)).standard_normal(shape)).astype(np.float32)
    r = run_checked(ops.var, on_device(x, layout), dims=dims)
    want = np.var(x.astype(np.float64), axis=dims or None, ddof=1)
    np.testing.assert_allclose(r.outputs[0], want, rtol=1e-6)


def test_float32_var_of_large_mean_data_merged_over_deep_trees(small_blocks: int) -> None:
    x = (1e7 + np.random.default_rng(4).standard_normal((3, 1000))).astype(np.float32)
    for layout in ("dense", "strided"):
        r = run_checked(ops.var, on_device(x, layout), dims=(1,), correction=0)
        assert len(r.tiling.levels) >= 3
        np.testing.assert_allclose(r.outputs[0], np.var(x.astype(np.float64), axis=1), rtol=1e-6)


@pytest.mark.parametrize("n", [4096, 5000, 300_000])
def test_float64_var_of_rows_of_one_large_value(n: int) -> None:
    """float64 rows of one value: the plain second pass summed the squares of the mean's rounding (var of 4096 x
    1e30 was 6.4e30, numpy's 2e28, the truth 0); corrected it is 0 within a block and ~1e-48 of value^2 when
    blocks merge."""
    x = np.full((3, n), 1e30)
    x[1], x[2] = 1.7e9, -3.3
    r = run_checked(ops.var, x, dims=(1,))
    assert np.all(r.outputs[0] <= 1e-40 * x[:, 0] ** 2)
    if n <= 4096:
        np.testing.assert_array_equal(r.outputs[0], 0.0)


@pytest.mark.parametrize("n", [4, 5000, 300_000])
def test_float64_var_of_huge_values(n: int) -> None:
    """Finite float64 data near the range's top, within one block and merged over blocks: squared deviations that
    overflow give inf, as numpy's (the correction c^2 / n overflowed too: inf - inf gave NaN), and a mean of 1e155
    with a spread of 1e151 gives its finite variance (merging the first block into the empty partial gave
    0 * inf = NaN)."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal((3, n)) * 1e200
    x[0, :4] = 1e200, -1e200, 3e199, 0.0  # a mean's rounding residue c of ~1e184: c^2 overflows
    x[1] = 1e155 + rng.standard_normal(n) * 1e151
    x[2] = rng.standard_normal(n)
    r = run_checked(ops.var, x, dims=(1,))
    with np.errstate(over="ignore", invalid="ignore"):
        want = np.var(x, axis=1, ddof=1)
    assert np.isposinf(want[0]) and np.isposinf(r.outputs[0][0])
    assert np.all(np.isfinite(want[1:]))
    np.testing.assert_allclose(r.outputs[0][1:], want[1:], rtol=1e-10)


@pytest.mark.parametrize(
    "shape,dims,layout",
    [
        ((100,), (), "dense"),
        ((3, 5000, 7), (1,), "dense"),
        ((3, 5000, 7), (0, 2), "strided"),
        ((9000, 4), (0,), "dense"),
        ((4, 9000), (1,), "transposed"),
        ((2, 300_000), (), "dense"),
    ],
)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_mean_near_the_dtype_max_does_not_overflow(
    shape: tuple[int, ...], dims: tuple[int, ...], layout: str, dtype: Any
) -> None:
    """The float64 sum is scaled by 1/R before the cast: a mean overflows only where the mean itself does (the sum
    was cast first: 100 x 1000.0 in float16 gave inf, as did 2 x 3e38 in float32)."""
    big = float(np.finfo(dtype).max)
    x = (np.random.default_rng(11).uniform(0.5, 1.0, shape) * big).astype(dtype)
    t = on_device(x, layout)
    r = run_checked(ops.reduce_mean, t, dims=dims)
    want = np.mean(x.astype(np.float64), axis=dims or None)
    check_workspace(r, documented_workspace("reduce_mean", t, dims or tuple(range(len(shape)))))
    assert np.all(np.isfinite(r.outputs[0]))
    np.testing.assert_allclose(r.outputs[0].astype(np.float64), want, rtol={np.float16: 1e-3, np.float32: 1e-6}[dtype])


@pytest.mark.parametrize("name", NAMES + ["var"])
def test_reductions_of_a_0d_tensor(name: str) -> None:
    """dims=() reduces every dim of a 0-d tensor (its value; var's 0/0); any explicit dim is out of range, as in
    numpy (it raised IndexError from the layout code)."""
    op = getattr(ops, name)
    x = np.float32(3.0)
    for keep in (False, True):
        got = run_checked(op, x, keep_dims=keep).outputs[0]
        assert got.shape == () and np.array_equal(got, np.float32(np.nan if name == "var" else 3.0), equal_nan=True)
    for dims in (0, -1, (0,), (1,)):
        with pytest.raises(ParamError) as e:
            op.get_workspace_size(on_device(np.asarray(x)), dims=dims)
        assert e.value.op == name and e.value.arg == "dims" and "0-d" in str(e.value.expected)


def test_argmax_of_a_0d_tensor_takes_dim_0_or_minus_1() -> None:
    """argmax's dim is required: a 0-d tensor is searched as one of shape (1,) (the reference's rule)."""
    for dim in (0, -1):
        assert run_checked(ops.argmax, np.float32(3.0), dim=dim).outputs[0] == 0
    for dim in (1, -2):
        with pytest.raises(ParamError) as e:
            ops.argmax.get_workspace_size(on_device(np.asarray(np.float32(3.0))), dim=dim)
        assert e.value.arg == "dim" and e.value.expected == "a dim in [-1, 1)"
