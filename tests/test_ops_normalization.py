"""softmax, log_softmax, layer_norm, rms_norm, batch_norm and group_norm against float64 numpy references, with
poisoned outputs, a guarded workspace, and workspace sizes against the documented formulas."""

from __future__ import annotations

import math
import re
import warnings
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
from twophase import DType, TensorDesc, device, ops
from twophase.errors import ParamError
from twophase.kernels.cpu import norm as norm_kernels
from twophase.kernels.cpu import streaming
from twophase.kernels.cpu.softmax import GROUP_ROWS, GROUPED_MAX, LOG_SOFTMAX, PIPELINED_MAX, SOFTMAX, build_softmax
from twophase.layout import line_array
from twophase.ops.normalization import SoftmaxTiling
from twophase.ops.selection import forced
from twophase.runtime.fanout import fanout_parts
from twophase.testing import run_checked

TOL = {np.float16: 3e-3, np.float32: 2e-5, np.float64: 1e-10}
DTYPES = [np.float32, np.float64, np.float16]


def align64(n: int) -> int:
    return -(-n // 64) * 64


def merges(shape: Any, strides: Any) -> bool:
    """The test's own copy of the rule: dims walk memory with one stride (size-1 dims ignored)."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    if any(n == 0 for n, _ in dims):
        return True
    return all(s == dims[i + 1][1] * dims[i + 1][0] for i, (_, s) in enumerate(dims[:-1]))


def compute_size(dtype: Any) -> int:
    return 4 if np.dtype(dtype) == np.float16 else np.dtype(dtype).itemsize


def check(r: Any, ref: Any, dtype: Any, ws: int | None = None) -> None:
    """Every output written (NaN only where the reference has NaN), values close, the workspace as documented
    and used up to its last 64-byte line, nothing written outside it."""
    ref = np.asarray(ref)
    assert r.guards_intact
    assert r.unwritten == (int(np.isnan(ref).sum()),)
    tol = TOL[dtype]
    np.testing.assert_allclose(r.outputs[0].astype(np.float64), ref, rtol=tol, atol=tol)
    if ws is not None:
        assert r.workspace_size == ws
    assert r.touched <= r.workspace_size
    if r.workspace_size:
        assert r.touched > r.workspace_size - 64


# ---------------------------------------------------------------- softmax / log_softmax
def softmax_ws(shape: Any, strides: Any, dim: int, dtype: Any, log: bool = False) -> int:
    """The ops' doc: [packed log, N > 256: T*align64(L*c) scratch] + align64(K*ceil(N/B)*16) if N > 32768,
    B = 8192/c; + align64(K*N*c) if packed."""
    kept = [i for i in range(len(shape)) if i != dim]
    n = shape[dim] if shape else 1
    k = math.prod(shape[i] for i in kept)
    split = n > 32768
    rows = fanout_parts() if k * n >= 1 << 20 else 1
    f16 = np.dtype(dtype) == np.float16
    packed = (f16 or not merges([shape[i] for i in kept], [strides[i] for i in kept])) and k * n > 0
    block = 8192 // compute_size(dtype)
    ws = rows * align64((block if split else n) * compute_size(dtype)) if log and packed and n > 256 else 0
    ws += align64(k * -(-n // block) * 16) if split else 0
    if packed:
        ws += align64(k * n * compute_size(dtype))
    return ws


@st.composite
def softmax_case(draw: Any) -> tuple[tuple[int, ...], int]:
    shape = draw(shapes(min_dims=1, max_dims=3, max_side=6))
    return shape, draw(st.integers(-len(shape), len(shape) - 1))


@settings(max_examples=40, deadline=None)
@given(case=softmax_case(), layout=st.sampled_from(LAYOUTS), dtype=st.sampled_from(DTYPES), log=st.booleans())
def test_softmax_and_log_softmax_match_reference(case: Any, layout: str, dtype: Any, log: bool) -> None:
    shape, dim = case
    rng = np.random.default_rng(sum(shape) + 7 * (dim % len(shape)))
    a = random(shape, dtype, rng)
    x = on_device(a, layout)
    op = ops.log_softmax if log else ops.softmax
    r = run_checked(op, x, dim=dim)
    assert r.outputs[0].dtype == np.dtype(dtype) and r.outputs[0].shape == shape
    check(r, op.spec.reference(a, dim), dtype, softmax_ws(shape, x.desc.strides, dim % len(shape), dtype, log))


@pytest.mark.parametrize(
    "shape, dim, layout, dtype",
    [
        ((2, 40000), -1, "dense", np.float32),  # split rows, one row per task
        ((1, 70001), 1, "strided", np.float64),  # split, strided row (inner stride 2)
        ((40000, 3), 0, "dense", np.float64),  # long dim not last: strided rows
        ((2, 33000), -1, "transposed", np.float32),  # packed + split
        ((3, 32769), -1, "dense", np.float16),  # packed float16 + split
        ((160000, 7), -1, "reversed", np.float32),  # many short rows, parallel, negative row stride
    ],
)
@pytest.mark.parametrize("log", [False, True])
def test_long_and_many_rows_use_the_documented_workspace(
    shape: Any, dim: int, layout: str, dtype: Any, log: bool
) -> None:
    a = random(shape, dtype, np.random.default_rng(shape[0]))
    x = on_device(a, layout)
    op = ops.log_softmax if log else ops.softmax
    r = run_checked(op, x, dim=dim)
    check(r, op.spec.reference(a, dim), dtype, softmax_ws(shape, x.desc.strides, dim % 2, dtype, log))
    n = shape[dim]
    assert r.implementation == ("split_rows" if n > 32768 else "rows_parallel")


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("by_rows", [True, False])
@pytest.mark.parametrize("mode", [SOFTMAX, LOG_SOFTMAX])
def test_split_kernels_merge_block_partials(by_rows: bool, mode: int, parts: int) -> None:
    """Both split launches (row ranges, block ranges) in one or several parts on small blocks, with a block that
    is all -inf (merges as nothing), a row of -inf (NaN, as the reference) and a row with a NaN."""
    rng = np.random.default_rng(3)
    wide = np.zeros((4, 60))
    x = wide[:, :53]  # rows with a gap: the same kernel signature as a strided float64 long row
    x[...] = rng.standard_normal((4, 53)) * 30
    x[0, 16:40] = -np.inf
    x[2, :] = -np.inf
    x[3, 20] = np.nan
    block = 16
    split = -(-53 // block)
    scratch = parts * block * 8 if mode == LOG_SOFTMAX else 0  # one float64 block row per part, first
    t = SoftmaxTiling(
        4,
        53,
        split,
        block,
        False,
        0,
        True,
        scratch + 4 * split * 16,
        by_rows,
        parts,
        0,
        block if mode == LOG_SOFTMAX else 0,
        scratch,
    )
    out = np.full((4, 53), np.nan)
    ws = np.full(t.workspace, 0xCD, np.uint8)
    build_softmax(x, out, t, mode)(ws)
    ref = (ops.log_softmax if mode == LOG_SOFTMAX else ops.softmax).spec.reference(x, -1)
    with np.errstate(invalid="ignore"):
        np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    assert np.isnan(out[2]).all() and np.isnan(out[3]).all() and not np.isnan(out[[0, 1]]).any()


@pytest.mark.parametrize(
    "n", [1, 5, GROUPED_MAX, GROUPED_MAX + 1, PIPELINED_MAX, PIPELINED_MAX + 1, 1100]
)  # each whole-rows order: log-softmax's groups, the pipelined rows, rows finished at once, at their limits
@pytest.mark.parametrize("layout", ["dense", "padded", "strided", "reversed"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("log", [False, True])
def test_whole_rows_orders_match_reference(n: int, layout: str, dtype: Any, log: bool) -> None:
    """Rows of every order's limits, more than two groups of the shortest (a short last group), among them a row
    all -inf and a row with a NaN (both NaN, as the reference) and a row of wide range, every output written."""
    k = 2 * GROUP_ROWS + 5
    a = np.random.default_rng(n).standard_normal((k, n)).astype(dtype)
    a[3] = -np.inf
    a[k - 1, n // 2] = np.nan
    a[GROUP_ROWS] *= 300
    op = ops.log_softmax if log else ops.softmax
    r = run_checked(op, on_device(a, layout), dim=-1)
    check(r, op.spec.reference(a, -1), dtype)


@pytest.mark.parametrize("n", [33, 100, 300])  # log-softmax's groups, the pipelined rows, rows finished at once
@pytest.mark.parametrize("log", [False, True])
def test_packed_rows_in_parts_match_reference(n: int, log: bool) -> None:
    """float16 rows packed in the workspace and run in place there by helper-thread parts: short rows with their
    scratch rows made at binding, longer ones with the parts' scratch rows first in the workspace (log-softmax)."""
    k = (1 << 20) // n + 7
    a = np.random.default_rng(n).standard_normal((k, n)).astype(np.float16)
    op = ops.log_softmax if log else ops.softmax
    r = run_checked(op, a, dim=-1)
    check(r, op.spec.reference(a, -1), np.float16, softmax_ws(a.shape, (n, 1), 1, np.float16, log))


def test_softmax_and_log_softmax_extremes() -> None:
    a = np.array([[1000.0, -1000.0, 0.0], [np.nan, 1.0, 2.0], [-np.inf, 0.0, 0.0], [-np.inf] * 3], np.float32)
    s = run_checked(ops.softmax, a, dim=-1).outputs[0]
    ls = run_checked(ops.log_softmax, a, dim=-1).outputs[0]
    np.testing.assert_allclose(s[0], [1.0, 0.0, 0.0], atol=1e-7)
    np.testing.assert_allclose(ls[0], [0.0, -2000.0, -1000.0], rtol=1e-7)
    assert np.isnan(s[1]).all() and np.isnan(ls[1]).all() and np.isnan(s[3]).all() and np.isnan(ls[3]).all()
    np.testing.assert_allclose(s[2], [0.0, 0.5, 0.5], atol=1e-7)
    np.testing.assert_allclose(ls[2], [-np.inf, -np.log(2), -np.log(2)], rtol=1e-7)


# whole rows, split rows (softmax's by steps of 4 blocks: (2, 50001) ends on a step of one; (3, 400000) shares its
# blocks out to the parts, whose ranges meet within a step), in parts, short rows in parts (each part's scratch row
# on lines of its own)
@pytest.mark.parametrize(
    "shape", [(5, 300), (3, 40000), (2, 50001), (3, 400000), (1024, 1100), (65536, 33), (16384, 100)]
)
@pytest.mark.parametrize("op", [ops.softmax, ops.log_softmax])
def test_in_place_into_its_own_input(dev: Any, stream: Any, op: Any, shape: tuple[int, int]) -> None:
    a = np.random.default_rng(1).standard_normal(shape)
    x = dev.tensor(a, stream=stream)
    size, ex = op.get_workspace_size(x, out=x, dim=-1)
    ws = dev.malloc(size, stream=stream) if size else None
    op(ws, size, ex, stream)
    stream.synchronize()
    np.testing.assert_allclose(x.numpy(), op.spec.reference(a, -1), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("op", [ops.softmax, ops.log_softmax])
def test_in_place_split_rows_with_inf_and_nan_spans(dev: Any, stream: Any, op: Any) -> None:
    """Split rows in place with -inf over a whole step of softmax's (8192 elements) and over part of one, and a row
    with a NaN: the steps' partials merge as the blocks' would."""
    a = np.random.default_rng(2).standard_normal((4, 70000)).astype(np.float32)
    a[0, 8192:16384] = -np.inf  # one whole step
    a[1, 10000:30000] = -np.inf  # parts of two steps and the whole of another
    a[2, 60000] = np.nan
    a[3, :] = -np.inf
    x = dev.tensor(a, stream=stream)
    size, ex = op.get_workspace_size(x, out=x, dim=-1)
    ws = dev.malloc(size, stream=stream) if size else None
    op(ws, size, ex, stream)
    stream.synchronize()
    got, ref = x.numpy(), op.spec.reference(a, -1)
    assert np.isnan(got[2:]).all() and np.isnan(ref[2:]).all()
    np.testing.assert_allclose(got[:2], ref[:2], rtol=2e-6, atol=1e-12)
    assert np.array_equal(np.isneginf(got[:2]), np.isneginf(ref[:2]))
    if ws is not None:
        ws.free()


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(0, 70), min_size=1, max_size=3),
    dtype=st.sampled_from([np.float16, np.float32, np.float64, np.uint8]),
)
def test_line_array_owns_its_lines(shape: list[int], dtype: Any) -> None:
    """line_array: C-contiguous, on a 64-byte boundary, and the rest of its last line padding that no other
    array's bytes use (parts' scratch rows written at once by helper threads never share a line)."""
    arrays = [line_array(shape, dtype) for _ in range(4)]
    lines = []
    for a in arrays:
        assert a.shape == tuple(shape) and a.dtype == np.dtype(dtype) and a.flags.c_contiguous
        if not a.nbytes:  # (no bytes: no lines)
            continue
        assert a.ctypes.data % 64 == 0
        end = a.ctypes.data + align64(a.nbytes)
        raw = a.base
        while raw.base is not None:  # the uint8 buffer it was cut from covers the padded lines
            raw = raw.base
        assert raw.ctypes.data <= a.ctypes.data and end <= raw.ctypes.data + raw.nbytes
        lines.append((a.ctypes.data, end))
    lines.sort()
    assert all(prev[1] <= nxt[0] for prev, nxt in zip(lines, lines[1:], strict=False))


def test_softmax_workspace_grows_with_the_row_length() -> None:
    for n in (32768, 32769, 10**6):
        for op in (ops.softmax, ops.log_softmax):
            size, ex = op.get_workspace_size(TensorDesc((5, n)))
            assert size == softmax_ws((5, n), (n, 1), 1, np.float32, op is ops.log_softmax)
            assert size >= align64(5 * -(-n // 2048) * 16) * (n > 32768)
            ex.destroy()


# ---------------------------------------------------------------- layer_norm / rms_norm
TERMS = ("none", "weight", "bias", "both")  # the affine terms given (each a kernel variant that reads only those)


def affine_args(terms: str, n: int, dtype: Any, rng: Any, rms: bool) -> list[Any]:
    """(weight, bias) positional arguments for ``terms``, None for an absent one; RMS norm takes a weight only
    ("bias" then gives none, "both" the weight)."""
    w = random((n,), dtype, rng) if terms in ("weight", "both") else None
    b = random((n,), dtype, rng) if terms in ("bias", "both") else None
    if rms:
        return [] if w is None else [w]
    return [] if w is None and b is None else [w, b]


@settings(max_examples=30, deadline=None)
@given(
    rows=st.lists(st.integers(1, 5), min_size=0, max_size=2),
    n=st.integers(1, 70),
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from(DTYPES),
    rms=st.booleans(),
    terms=st.sampled_from(TERMS),
)
def test_layer_and_rms_norm_match_reference(
    rows: list[int], n: int, layout: str, dtype: Any, rms: bool, terms: str
) -> None:
    rng = np.random.default_rng(n)
    x = random(tuple(rows) + (n,), dtype, rng) + 1.5
    op = ops.rms_norm if rms else ops.layer_norm
    args = affine_args(terms, n, dtype, rng, rms)
    r = run_checked(op, on_device(x, layout if x.ndim > 1 else "dense"), *args, normalized_shape=(n,))
    ref = op.spec.reference(x, *args, normalized_shape=(n,))
    assert r.guards_intact and r.unwritten == (0, 0, 0) and r.touched <= r.workspace_size
    for got, want in zip(r.outputs, ref):
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=TOL[dtype], atol=TOL[dtype] * 4)


@pytest.mark.parametrize("impl", ["rows", "rows_streaming"])
@pytest.mark.parametrize("terms", TERMS)
@pytest.mark.parametrize("rms", [False, True])
def test_each_affine_term_is_applied_by_its_kernel_variant(terms: str, impl: str, rms: bool) -> None:
    """Every combination of weight and bias (each its own kernel variant, which reads only the terms given), on
    both row kernels: rows of 67 (a scalar head and tail around the streaming vectors) against the reference."""
    if impl == "rows_streaming" and not streaming.AVAILABLE:
        pytest.skip("streaming stores are x86 only")
    rng = np.random.default_rng(5)
    x = random((6, 67), np.float32, rng) + 1.5
    op = ops.rms_norm if rms else ops.layer_norm
    args = affine_args(terms, 67, np.float32, rng, rms)
    with forced(impl):
        r = run_checked(op, on_device(x), *args, normalized_shape=(67,))
    assert r.implementation == impl and r.unwritten == (0, 0, 0)
    want = op.spec.reference(x, *args, normalized_shape=(67,))[0]
    np.testing.assert_allclose(r.outputs[0].astype(np.float64), want, rtol=TOL[np.float32], atol=TOL[np.float32] * 4)


@pytest.mark.parametrize("mean", [1e6, 1e7])
@pytest.mark.parametrize(
    "shape, layout",
    [
        ((3, 100), "dense"),
        ((1, 4096), "dense"),
        ((2, 300_000), "dense"),
        ((5, 77), "padded"),
        ((6, 5, 7), "transposed"),
    ],
)
def test_layer_norm_of_large_mean_rows_does_not_cancel(shape: Any, layout: str, mean: float) -> None:
    """float32 rows of unit spread on a mean of 1e7: the one-pass sums of x and x^2 cancelled (rstd off by up to
    5x on long rows); shifted by the row's first element they do not. Dense, strided-row and packed layouts."""
    x = (mean + np.random.default_rng(len(shape)).standard_normal(shape)).astype(np.float32)
    n = shape[-1]
    r = run_checked(ops.layer_norm, on_device(x, layout), normalized_shape=(n,))
    out, mu, rstd = ops.layer_norm.spec.reference(x, normalized_shape=(n,))
    np.testing.assert_allclose(r.outputs[2], rstd, rtol=1e-6)
    np.testing.assert_allclose(r.outputs[1], mu, rtol=1e-7)
    np.testing.assert_allclose(r.outputs[0], out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value", [1.7e9, 7.7e20, 1e30])
@pytest.mark.parametrize("n, layout", [(768, "dense"), (4096, "dense"), (5000, "padded")])
def test_float64_norms_of_rows_of_one_large_value_are_zero(value: float, n: int, layout: str) -> None:
    """float64 rows of one value (a constant feature, a timestamp column): the mean's rounding left every
    deviation at ~30 ulp of the value, so with eps = 1e-12 layer_norm and group_norm gave +-1 instead of 0; the
    corrected two-pass moments give the value back as the mean and 0 out, whatever the row's length."""
    x = np.full((2, n), value)
    x[1] = -value / 3
    r = run_checked(ops.layer_norm, on_device(x, layout), normalized_shape=(n,), eps=1e-12)
    np.testing.assert_array_equal(r.outputs[0], 0.0)
    np.testing.assert_array_equal(r.outputs[1].ravel(), x[:, 0])
    g = run_checked(
        ops.group_norm,
        on_device(x.reshape(2, 4, n // 4) if n % 4 == 0 else x.reshape(2, 1, n), "dense"),
        num_groups=1,
        eps=1e-12,
    )
    np.testing.assert_array_equal(g.outputs[0], 0.0)


def test_group_norm_of_huge_groups_of_one_large_value_is_zero() -> None:
    """The split path (block partials merged in the workspace), columns summed row-wise (many short rows of a
    crop), and a group of one value: out is 0 on every path."""
    big = np.full((1, 1, 100000), 7.7e20)
    r = run_checked(ops.group_norm, big, num_groups=1, eps=1e-12)
    assert r.implementation == "split_groups"
    np.testing.assert_array_equal(r.outputs[0], 0.0)
    crop = np.full((2, 4, 64, 100), 7.7e20)[..., :30]  # rows of 30 elements: the column-wise sums
    np.testing.assert_array_equal(run_checked(ops.group_norm, crop, num_groups=2, eps=1e-12).outputs[0], 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [ops.layer_norm, ops.rms_norm])
def test_norms_of_empty_rows_follow_the_reference(op: Any, dtype: Any) -> None:
    """Rows of no elements: rms_norm's mean output is 0 (as documented; it was NaN), layer_norm's mean NaN, both
    rstd NaN."""
    x = np.zeros((2, 0), dtype)
    r = run_checked(op, x, normalized_shape=(0,))
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's mean of an empty slice
        want = op.spec.reference(x, normalized_shape=(0,))
    assert r.outputs[0].shape == (2, 0)
    for got, ref in zip(r.outputs[1:], want[1:]):
        np.testing.assert_array_equal(got, ref)  # NaN where the reference has NaN


# ---------------------------------------------------------------- batch_norm / group_norm
def channel_case(min_dims: int = 2) -> Any:
    return st.tuples(
        st.integers(0, 3),
        st.integers(1, 3),
        st.integers(1, 3),
        st.lists(st.integers(0, 5), min_size=min_dims - 2, max_size=2),
    )


def row_split(shape: Any, strides: Any) -> int | None:
    """The test's own copy of the rule: the first k at which dims split into evenly spaced rows of one stride."""
    for k in range(len(shape) + 1):
        if merges(shape[k:], strides[k:]) and merges(shape[:k], strides[:k]):
            return k
    return None


def bn_ws(shape: Any, strides: Any, dtype: Any) -> int:
    """batch_norm's doc: align64(numel*c) + 4*align64(C*c) when packed (float16, or spatial dims that split into
    no evenly spaced rows)."""
    numel, c = math.prod(shape), compute_size(dtype)
    packed = np.dtype(dtype) == np.float16 or row_split(shape[2:], strides[2:]) is None
    return align64(numel * c) + 4 * align64(shape[1] * c) if packed and numel else 0


def gn_ws(shape: Any, strides: Any, dtype: Any, groups: int) -> int:
    """group_norm's doc: align64(N*G*B*24) if L > 65536, B = ceil(L/16384) blocks, or for a group that splits
    into R > 1 rows of S, ceil(R / max(1, 16384 // S)); + align64(numel*c) + 2*align64(C*c) when packed (float16,
    or the group's dims split into no evenly spaced rows)."""
    numel, c = math.prod(shape), compute_size(dtype)
    length = shape[1] // groups * math.prod(shape[2:])
    gshape, gstrides = (shape[1] // groups, *shape[2:]), (strides[1], *strides[2:])
    k = row_split(gshape, gstrides)
    packed = np.dtype(dtype) == np.float16 or k is None
    rows = 1 if packed else math.prod(gshape[:k])
    blocks = -(-length // 16384) if rows == 1 else -(-rows // max(1, 16384 // (length // rows)))
    ws = align64(shape[0] * groups * blocks * 24) if length > 65536 and numel else 0
    if packed and numel:
        ws += align64(numel * c) + 2 * align64(shape[1] * c)
    return ws


@settings(max_examples=30, deadline=None)
@given(case=channel_case(), layout=st.sampled_from(LAYOUTS), dtype=st.sampled_from(DTYPES), affine=st.booleans())
def test_batch_norm_matches_reference(case: Any, layout: str, dtype: Any, affine: bool) -> None:
    n, c, _, sp = case
    shape = (n, c, *sp)
    rng = np.random.default_rng(sum(shape))
    a = random(shape, dtype, rng)
    mean, var = random((c,), dtype, rng), random((c,), dtype, rng, positive=True)
    params = [random((c,), dtype, rng), random((c,), dtype, rng)] if affine else []
    x = on_device(a, layout)
    r = run_checked(ops.batch_norm, x, mean, var, *params, eps=1e-3)
    check(r, ops.batch_norm.spec.reference(a, mean, var, *params, eps=1e-3), dtype, bn_ws(shape, x.desc.strides, dtype))


@settings(max_examples=30, deadline=None)
@given(case=channel_case(), layout=st.sampled_from(LAYOUTS), dtype=st.sampled_from(DTYPES), affine=st.booleans())
def test_group_norm_matches_reference(case: Any, layout: str, dtype: Any, affine: bool) -> None:
    n, groups, cg, sp = case
    shape = (n, groups * cg, *sp)
    rng = np.random.default_rng(sum(shape))
    a = random(shape, dtype, rng)
    params = [random((shape[1],), dtype, rng), random((shape[1],), dtype, rng)] if affine else []
    x = on_device(a, layout)
    r = run_checked(ops.group_norm, x, *params, num_groups=groups)
    check(
        r,
        ops.group_norm.spec.reference(a, *params, num_groups=groups),
        dtype,
        gn_ws(shape, x.desc.strides, dtype, groups),
    )


@pytest.mark.parametrize(
    "shape, groups, layout, dtype",
    [
        ((2, 4, 300, 300), 2, "dense", np.float32),  # L = 180000: split, Welford partials
        ((1, 2, 70001), 1, "transposed", np.float32),  # split + packed
        ((3, 70000, 1), 1, "dense", np.float16),  # split + packed float16
    ],
)
def test_group_norm_huge_groups_merge_welford_partials(shape: Any, groups: int, layout: str, dtype: Any) -> None:
    rng = np.random.default_rng(5)
    a = (random(shape, dtype, rng) + 40).astype(dtype)  # an offset mean: the merge must not cancel
    w, b = random((shape[1],), dtype, rng), random((shape[1],), dtype, rng)
    x = on_device(a, layout)
    r = run_checked(ops.group_norm, x, w, b, num_groups=groups)
    assert r.implementation.startswith("split_groups")
    check(
        r, ops.group_norm.spec.reference(a, w, b, num_groups=groups), dtype, gn_ws(shape, x.desc.strides, dtype, groups)
    )


def test_group_norm_welford_merge_keeps_float64_variance() -> None:
    """A huge offset and a tiny spread: naive sum-of-squares variance would cancel to garbage."""
    rng = np.random.default_rng(6)
    a = 1e6 + rng.standard_normal((1, 1, 100000)) * 1e-3
    r = run_checked(ops.group_norm, a, num_groups=1)
    assert r.implementation == "split_groups"
    np.testing.assert_allclose(r.outputs[0], ops.group_norm.spec.reference(a, num_groups=1), rtol=1e-7, atol=1e-7)


def test_batch_and_group_norm_on_large_nchw() -> None:
    rng = np.random.default_rng(8)
    a = rng.standard_normal((4, 16, 33, 35)).astype(np.float32)
    m, v = rng.standard_normal(16).astype(np.float32), rng.random(16).astype(np.float32) + 0.5
    check(run_checked(ops.batch_norm, a, m, v), ops.batch_norm.spec.reference(a, m, v), np.float32, 0)
    check(run_checked(ops.group_norm, a, num_groups=4), ops.group_norm.spec.reference(a, num_groups=4), np.float32, 0)


# ---------------------------------------------------------------- op definitions and bad inputs
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "layer_norm", "rms_norm", "batch_norm", "group_norm"])
def test_op_definitions_document_the_workspace(name: str) -> None:
    spec = getattr(ops, name).spec
    assert spec.reference is not None and spec.implementations and len(spec.dtypes) == 3
    assert spec.workspace_formula in spec.doc


def d(shape: Any, dtype: str = "float32") -> TensorDesc:
    return TensorDesc(shape, dtype)


@pytest.mark.parametrize(
    "call, arg, expected",
    [
        (lambda: ops.log_softmax.get_workspace_size(d((2, 3), "int32")), "x", "float32"),
        (lambda: ops.softmax.get_workspace_size(d((2, 3)), dim=2), "dim", "[-2, 2)"),
        (lambda: ops.log_softmax.get_workspace_size(d((2, 3)), dim=1.5), "dim", "int"),
        (lambda: ops.batch_norm.get_workspace_size(d((2, 3, 4)), d((4,)), d((3,))), "running_mean", "(3,)"),
        (lambda: ops.batch_norm.get_workspace_size(d((2, 3)), d((3,)), d((3,), "float64")), "running_var", "float32"),
        (lambda: ops.batch_norm.get_workspace_size(d((3,)), d((3,)), d((3,))), "x", "2 dims"),
        (lambda: ops.batch_norm.get_workspace_size(d((2, 3)), d((3,))), "inputs", "5 inputs"),
        (lambda: ops.group_norm.get_workspace_size(d((2, 6, 4)), num_groups=4), "num_groups", "divisor"),
        (lambda: ops.group_norm.get_workspace_size(d((2, 6, 4)), num_groups=0), "num_groups", "divisor"),
        (lambda: ops.group_norm.get_workspace_size(d((2, 6)), d((6,), "float16"), num_groups=2), "weight", "float32"),
        (lambda: ops.group_norm.get_workspace_size(d((2, 6), "int64"), num_groups=2), "x", "float16"),
        (lambda: ops.group_norm.get_workspace_size(d((2, 6))), "num_groups", "required"),
        (lambda: ops.layer_norm.get_workspace_size(d((2, 3)), normalized_shape=(4,)), "normalized_shape", "trailing"),
        (lambda: ops.layer_norm.get_workspace_size(d((2, 3)), d((2,)), normalized_shape=(3,)), "weight", "(3,)"),
        (lambda: ops.rms_norm.get_workspace_size(d((2, 3), "int32"), normalized_shape=(3,)), "x", "float64"),
        (
            lambda: ops.layer_norm.get_workspace_size(d((2, 3)), normalized_shape=(3,), eps=float("nan")),
            "eps",
            "finite",
        ),
        (lambda: ops.rms_norm.get_workspace_size(d((2, 3)), normalized_shape=(3,), eps=float("inf")), "eps", "finite"),
        (lambda: ops.group_norm.get_workspace_size(d((2, 6)), num_groups=2, eps=float("nan")), "eps", "finite"),
        (lambda: ops.batch_norm.get_workspace_size(d((2, 3)), d((3,)), d((3,)), eps=float("-inf")), "eps", "finite"),
    ],
)
def test_bad_inputs_raise_param_error_naming_the_argument(call: Any, arg: str, expected: str) -> None:
    with pytest.raises(ParamError) as e:
        call()
    assert e.value.arg == arg
    assert expected in str(e.value.expected)


@pytest.mark.parametrize("op", [ops.layer_norm, ops.rms_norm])
@pytest.mark.parametrize("which", [1, 2])
def test_norm_statistics_outputs_whose_dims_do_not_merge_are_refused_in_phase_1(op: Any, which: int) -> None:
    """mean / rstd are written as (K,) vectors: a transposed (2, 3, 1) view was a raw TypeError while binding
    (found by a views audit, /tmp/audit15); refused as reduce_mean refuses the same view."""
    from twophase import device

    dev = device("cpu")
    x = dev.tensor(np.ones((2, 3, 4), np.float32))
    outs: list[Any] = [dev.empty((2, 3, 4)), dev.empty((2, 3, 1)), dev.empty((2, 3, 1))]
    odd = dev.empty((6,))
    outs[which] = odd.strided((2, 3, 1), (1, 2, 1), 0)
    with pytest.raises(ParamError, match=f"argument '{('mean', 'rstd')[which - 1]}'.*merge into one strided"):
        op.get_workspace_size(x, out=tuple(outs), normalized_shape=(4,))
    for t in (x, odd, *outs[:which], *outs[which + 1 :]):
        t.free()


# ---------------------------------------------------------------- layer_norm / rms_norm with streaming stores
@pytest.mark.skipif(not streaming.AVAILABLE, reason="streaming stores are x86 only")
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 9),
    n=st.integers(1, 70),
    offsets=st.tuples(st.integers(0, 9), st.integers(0, 9)),
    dtype=st.sampled_from([np.float32, np.float64]),
    rms=st.booleans(),
    terms=st.sampled_from(TERMS),
    parts=st.integers(1, 3),
)
def test_streaming_norm_rows_match_the_reference_at_any_alignment(
    rows: int, n: int, offsets: tuple[int, int], dtype: Any, rms: bool, terms: str, parts: int
) -> None:
    """Rows of any length starting at any element offset (each row's scalar head runs up to its first 32-byte
    boundary): every output element is written (a signalling-NaN poison is gone), nothing around the output is, the
    values match the float64 reference, and within a few ulp the 'rows' kernel's."""
    dev = device("cpu")
    rng = np.random.default_rng(n * 100 + rows)
    x = random((rows, n), dtype, rng) + 1.5
    op = ops.rms_norm if rms else ops.layer_norm
    params = affine_args(terms, n, dtype, rng, rms)
    bx = np.zeros(rows * n + 9, dtype)
    bx[offsets[0] : offsets[0] + rows * n] = x.reshape(-1)
    poison = np.full(rows * n, POISON_BITS[dtype]).view(dtype)
    bout = np.full(rows * n + 9, 7.0, dtype)
    bout[offsets[1] : offsets[1] + rows * n] = poison
    (_, tx), (whole, tout) = (dense_at(a, (rows, n), o) for a, o in zip((bx, bout), offsets))
    tp = [None if p is None else dev.tensor(p) for p in params]
    with forced("rows_streaming"), num_threads(parts), mock.patch.object(norm_kernels, "FANOUT_MIN", 1):
        _, first = op.get_workspace_size(tx.desc, *(None if t is None else t.desc for t in tp), normalized_shape=(n,))
        first.destroy()
        stats = [dev.empty_like(d) for d in first.output_descs[1:]]
        size, ex = op.get_workspace_size(tx, *tp, out=(tout, *stats), normalized_shape=(n,))
    assert ex.implementation == "rows_streaming" and size == 0
    op(None, 0, ex, dev.default_stream)
    out = whole.numpy()
    written = out[offsets[1] : offsets[1] + rows * n]
    assert not (written.view(POISON_BITS[dtype].dtype) == POISON_BITS[dtype]).any()
    assert (np.delete(out, np.arange(offsets[1], offsets[1] + rows * n)) == 7.0).all()
    want = op.spec.reference(x, *params, normalized_shape=(n,))[0]
    np.testing.assert_allclose(written.reshape(rows, n).astype(np.float64), want, rtol=TOL[dtype], atol=TOL[dtype] * 4)
    with forced("rows"):
        plain = getattr(twophase, op.name)(dev.tensor(x), *tp, normalized_shape=(n,))[0]
    np.testing.assert_allclose(
        written.reshape(rows, n), plain.numpy(), rtol=4 * np.finfo(dtype).eps, atol=4 * np.finfo(dtype).eps
    )


def test_streaming_norms_are_ranked_first_only_for_outputs_as_large_as_the_last_level_cache() -> None:
    """Phase 1 on descs alone: from ``stream_threshold()`` on 'rows_streaming', below it 'rows'; never for float16
    (packed), a strided weight, or rows that are not dense; rows shorter than ``norm.SHORT_ROW_BYTES`` only when
    they are whole cache lines (else offered second)."""
    llc = streaming.stream_threshold()
    n = 1024
    big, small = TensorDesc((llc // 4 // n, n), DType.float32), TensorDesc((llc // 4 // n - 1, n), DType.float32)
    w = TensorDesc((n,), DType.float32)

    def impl(*descs: TensorDesc | None, op: Any = ops.layer_norm) -> str:
        _, ex = op.get_workspace_size(*descs, normalized_shape=(n,))
        ex.destroy()
        return ex.implementation

    want = "rows_streaming" if streaming.AVAILABLE else "rows"
    assert impl(big, w, w) == impl(big, w, op=ops.rms_norm) == impl(big) == want
    assert impl(small, w, w) == "rows"
    cases = {
        "strided weight": (big, TensorDesc((n,), DType.float32, strides=(2,))),
        "strided rows": (TensorDesc((llc // 4 // n, n), DType.float32, strides=(2 * n, 1)),),
    }
    for case, descs in cases.items():
        assert impl(*descs) == "rows", case
        with forced("rows_streaming"), pytest.raises(ParamError) as err:
            impl(*descs)
        assert err.value.arg == "implementation", case
    assert impl(TensorDesc((llc // 2 // n, n), DType.float16)) == "rows_packed"
    for short, first in ((64, want), (63, "rows")):  # 256 bytes, whole lines; 252 bytes
        rows = TensorDesc((llc // 4 // short + 1, short), DType.float32)
        for op in (ops.layer_norm, ops.rms_norm):
            _, ex = op.get_workspace_size(rows, normalized_shape=(short,))
            ex.destroy()
            assert ex.implementation == first, (op.name, short)
            if streaming.AVAILABLE:
                with forced("rows_streaming"):
                    _, ex = op.get_workspace_size(rows, normalized_shape=(short,))
                ex.destroy()
                assert ex.implementation == "rows_streaming", op.name


@pytest.mark.skipif(not streaming.AVAILABLE, reason="streaming stores are x86 only")
@pytest.mark.parametrize("offset, n, streams", [(0, 64, True), (4, 64, False), (16, 64, True), (4, 1028, True)])
def test_short_rows_stream_only_from_cache_lines(offset: int, n: int, streams: bool) -> None:
    """'rows_streaming' binds its streaming kernel to rows shorter than ``norm.SHORT_ROW_BYTES`` only where each
    output row starts on a 64-byte line (an output 16 elements into a 512-byte aligned block does; 4 elements in
    does not: the plain kernel then runs); longer rows stream anyway. The result is the reference either way."""
    dev = device("cpu")
    rows = 5
    x = random((rows, n), np.float32, np.random.default_rng(n)) + 1.5
    bout = np.zeros(rows * n + 16, np.float32)
    tx = dev.tensor(x)
    whole, tout = dense_at(bout, (rows, n), offset)
    stats = [dev.empty((rows, 1), DType.float32), dev.empty((rows, 1), DType.float32)]
    with forced("rows_streaming"), mock.patch.object(norm_kernels, "entry", wraps=norm_kernels.entry) as made:
        size, ex = ops.layer_norm.get_workspace_size(tx, out=(tout, *stats), normalized_shape=(n,))
        ops.layer_norm(None, size, ex, dev.default_stream)
    kernels = [c.args[0] for c in made.call_args_list]
    assert (norm_kernels.LAYER_NORM_ROWS_STREAMING[0] in kernels) == streams
    got = whole.numpy()[offset : offset + rows * n].reshape(rows, n)
    want = ops.layer_norm.spec.reference(x, normalized_shape=(n,))[0]
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=TOL[np.float32], atol=TOL[np.float32] * 4)


@pytest.mark.skipif(not streaming.AVAILABLE, reason="streaming stores are x86 only")
def test_streaming_norm_kernel_stores_whole_vectors_past_the_cache() -> None:
    """The 'rows_streaming' kernel, recompiled uncached (cached code has no assembly), writes rows with aligned
    non-temporal vector stores, then an sfence. Typed as phase 1 compiles it: x and out of any layout."""
    kernel = norm_kernels.LAYER_NORM_ROWS_STREAMING[norm_kernels.AFFINE]
    fresh = numba.njit(nogil=True, error_model="numpy", fastmath=norm_kernels.FAST | {"reassoc"})(kernel.py_func)
    m = numba.types.Array(numba.float32, 2, "A")
    v = numba.types.Array(numba.float32, 1, "C")
    sig = (m, v, v, numba.float64, numba.boolean, m, v, v)
    fresh.compile(sig)
    asm = fresh.inspect_asm(sig)
    assert re.search(r"vmovntps\s+%ymm", asm) and "sfence" in asm
