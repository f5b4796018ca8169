"""Shape and data movement ops against numpy, over layouts; embedding's out-of-range index at sync."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_layouts import LAYOUTS, on_device, random, shapes

import twophase as tp
from twophase import DType, TensorDesc, device, ops
from twophase.errors import ParamError
from twophase.testing import run_checked


def all_written(r: Any) -> None:
    assert r.guards_intact and all(u == 0 for u in r.unwritten) and r.inputs_changed == ()


@settings(max_examples=40, deadline=None)
@given(
    shape=shapes(1, 4),
    layout=st.sampled_from(LAYOUTS),
    data=st.data(),
    dtype=st.sampled_from([np.float32, np.int64, np.float16]),
)
def test_contiguous_permute_transpose_slice_match_numpy(
    shape: tuple[int, ...], layout: str, data: Any, dtype: Any
) -> None:
    x = random(shape, dtype, np.random.default_rng(0))
    t = on_device(x, layout)
    r = run_checked(ops.contiguous, t)
    all_written(r)
    np.testing.assert_array_equal(r.outputs[0], x)
    perm = tuple(data.draw(st.permutations(range(len(shape)))))
    np.testing.assert_array_equal(run_checked(ops.permute, t, dims=perm).outputs[0], np.transpose(x, perm))
    a, b = data.draw(st.integers(-len(shape), len(shape) - 1)), data.draw(st.integers(-len(shape), len(shape) - 1))
    np.testing.assert_array_equal(run_checked(ops.transpose, t, dim0=a, dim1=b).outputs[0], np.swapaxes(x, a, b))
    dim = data.draw(st.integers(0, len(shape) - 1))
    bound = st.one_of(st.none(), st.integers(-9, 9))
    start, end = data.draw(bound), data.draw(bound)
    step = data.draw(st.integers(-3, 3).filter(bool))
    r = run_checked(ops.slice, t, dim=dim, start=start, end=end, step=step)
    np.testing.assert_array_equal(r.outputs[0], ops.slice.spec.reference(x, dim=dim, start=start, end=end, step=step))


@settings(max_examples=30, deadline=None)
@given(shape=shapes(1, 3, 5), n=st.integers(1, 4), layout=st.sampled_from(LAYOUTS), data=st.data())
def test_concat_then_split_roundtrip(shape: tuple[int, ...], n: int, layout: str, data: Any) -> None:
    dim = data.draw(st.integers(0, len(shape) - 1))
    rng = np.random.default_rng(n)
    parts = [
        random(shape[:dim] + (data.draw(st.integers(0, 3)),) + shape[dim + 1 :], np.float32, rng) for _ in range(n)
    ]
    r = run_checked(ops.concat, *[on_device(p, layout) for p in parts], dim=dim)
    all_written(r)
    joined = np.concatenate(parts, axis=dim)
    np.testing.assert_array_equal(r.outputs[0], joined)
    s = run_checked(ops.split, on_device(joined, layout), sizes=[p.shape[dim] for p in parts], dim=dim)
    assert len(s.outputs) == n
    for got, want in zip(s.outputs, parts):
        np.testing.assert_array_equal(got, want)


def test_split_by_chunk_size_makes_a_smaller_last_part() -> None:
    x = np.arange(10.0)
    out = run_checked(ops.split, x, sizes=4).outputs
    assert [o.tolist() for o in out] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_split_refuses_more_parts_than_it_can_list_before_listing_them() -> None:
    """A chunk size that cuts a dim into more than ``MAX_SPLIT_PARTS`` outputs is a ParamError in phase 1, found
    from the count (a fuzzed 2^40-long dim in chunks of 2 once hung phase 1 building the list)."""
    from twophase import DType, TensorDesc
    from twophase.ops.shape import MAX_SPLIT_PARTS

    with pytest.raises(ParamError) as e:
        ops.split.get_workspace_size(TensorDesc((1 << 40, 2), DType.int8), sizes=2)
    assert e.value.arg == "sizes" and str(MAX_SPLIT_PARTS) in str(e.value)
    _, ex = ops.split.get_workspace_size(TensorDesc((MAX_SPLIT_PARTS, 2), DType.int8), sizes=1)
    assert len(ex.output_descs) == MAX_SPLIT_PARTS
    ex.destroy()


def test_transpose_of_a_0d_tensor_is_the_tensor() -> None:
    """As torch: dims 0 / -1 of a 0-d tensor are accepted and swapping them changes nothing."""
    r = run_checked(ops.transpose, np.float32(2.5), dim0=-1, dim1=0)
    assert r.outputs[0].shape == () and float(r.outputs[0]) == 2.5


@settings(max_examples=30, deadline=None)
@given(shape=shapes(1, 3, 5), layout=st.sampled_from(LAYOUTS), data=st.data())
def test_pad_constant_matches_numpy_and_writes_every_element(shape: tuple[int, ...], layout: str, data: Any) -> None:
    pads = tuple(
        data.draw(st.lists(st.integers(0, 3), min_size=0, max_size=2 * len(shape)).filter(lambda p: len(p) % 2 == 0))
    )
    x = random(shape, np.float64, np.random.default_rng(1))
    r = run_checked(ops.pad, on_device(x, layout), pads=pads, value=2.5)
    all_written(r)
    np.testing.assert_array_equal(r.outputs[0], ops.pad.spec.reference(x, pads, 2.5))


@pytest.mark.parametrize("idx_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("layout", ["dense", "transposed", "reversed"])
def test_embedding_gathers_rows(idx_dtype: Any, layout: str) -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((11, 5)).astype(np.float32)
    idx = rng.integers(0, 11, (3, 4)).astype(idx_dtype)
    r = run_checked(ops.embedding, on_device(w, "strided"), on_device(idx, layout))
    all_written(r)
    np.testing.assert_array_equal(r.outputs[0], w[idx])
    if layout == "transposed":
        assert r.implementation == "packed_indices" and r.workspace_size == -(-12 * idx.itemsize // 64) * 64


@pytest.mark.parametrize("bad", [11, -1])
def test_embedding_out_of_range_index_raises_param_error_at_sync_and_stream_recovers(bad: int) -> None:
    dev = device("cpu")
    s = dev.stream()
    w = dev.tensor(np.ones((11, 3), np.float32), stream=s)
    idx = dev.tensor(np.array([1, bad, 2], np.int64), stream=s)
    size, ex = ops.embedding.get_workspace_size(w, idx)
    out = dev.empty((3, 3), np.float32)
    ex.set_output(0, out)
    ws = dev.malloc(size, stream=s)
    ops.embedding(ws, size, ex, s)
    with pytest.raises(ParamError) as e:
        s.synchronize()
    assert e.value.op == "embedding" and e.value.arg == "indices" and str(bad) in str(e.value)
    assert "executor" in str(e.value)
    good = run_checked(ops.embedding, w, dev.tensor(np.array([10, 0], np.int32), stream=s), stream=s)
    np.testing.assert_array_equal(good.outputs[0], np.ones((2, 3), np.float32))
    ws.free(s)


@pytest.mark.parametrize(
    "call,arg",
    [
        (lambda: ops.permute.get_workspace_size(on_device(np.ones((2, 3))), dims=(0, 0)), "dims"),
        (lambda: ops.concat.get_workspace_size(on_device(np.ones((2, 3))), on_device(np.ones((3, 3))), dim=1), "xs[1]"),
        (
            lambda: ops.concat.get_workspace_size(on_device(np.ones((2, 3))), on_device(np.ones((2, 3), np.float32))),
            "xs[1]",
        ),
        (lambda: ops.split.get_workspace_size(on_device(np.ones(5)), sizes=(2, 2)), "sizes"),
        (lambda: ops.slice.get_workspace_size(on_device(np.ones(5)), step=0), "step"),
        (lambda: ops.slice.get_workspace_size(on_device(np.ones(5)), dim=1), "dim"),
        (lambda: ops.pad.get_workspace_size(on_device(np.ones(5)), pads=(1,)), "pads"),
        (lambda: ops.pad.get_workspace_size(on_device(np.ones(5)), pads=(1, -1)), "pads"),
        (lambda: ops.embedding.get_workspace_size(on_device(np.ones((3, 2))), on_device(np.ones(2))), "indices"),
        (lambda: ops.embedding.get_workspace_size(on_device(np.ones(3)), on_device(np.ones(2, np.int32))), "weight"),
    ],
)
def test_bad_inputs_raise_param_error_naming_the_argument(call: Any, arg: str) -> None:
    with pytest.raises(ParamError) as e:
        call()
    assert e.value.arg == arg


@pytest.mark.parametrize("sizes", [1, (0,), ()])
def test_split_of_a_0d_tensor_is_a_param_error_in_phase_1(sizes: Any) -> None:
    """A 0-d tensor has no dim to split: refused in phase 1 naming x (the kernel divided by ndim 0)."""
    with pytest.raises(ParamError) as e:
        ops.split.get_workspace_size(TensorDesc((), DType.float32), sizes=sizes)
    assert e.value.op == "split" and e.value.arg == "x"


def test_split_takes_a_numpy_integer_as_a_chunk_size() -> None:
    """np.int64(2) is a chunk size like the int 2 (it was read as the list (2,)); a bool is neither."""
    x = np.arange(5.0)
    for sizes in (np.int64(2), np.int32(2), [np.int64(2), np.int32(2), 1]):
        got = [o.tolist() for o in run_checked(ops.split, x, sizes=sizes).outputs]
        assert got == [[0, 1], [2, 3], [4]]
        assert [p.tolist() for p in ops.split.spec.reference(x, sizes)] == got
    with pytest.raises(ParamError) as e:
        ops.split.get_workspace_size(TensorDesc((5,), DType.float32), sizes=True)
    assert e.value.arg == "sizes"


def test_pad_of_a_0d_tensor_without_pads_is_a_copy() -> None:
    r = run_checked(ops.pad, np.float32(2.5), pads=())
    assert r.outputs[0].shape == () and float(r.outputs[0]) == 2.5


def test_pad_value_is_written_as_numpy_writes_it() -> None:
    """Ints exactly (a float went through float64: 2**62 + 1 became 2**62), a float truncated toward 0 into an int
    dtype, a bool into bool, and a float16 overflow to inf: each as np.pad."""
    cases = [
        (np.int64, 2**62 + 1),
        (np.int64, -(2**63)),
        (np.int64, 2**63 - 1),
        (np.uint8, 255),
        (np.int32, -2.5),
        (np.bool_, True),
        (np.bool_, 0.0),
        (np.float16, 1e6),
        (np.float64, 2**62 + 1),
        (np.float32, np.False_),  # numpy's bool scalar is a bool (it was refused)
        (np.int32, np.True_),
    ]
    for dtype, value in cases:
        x = np.ones(2, dtype)
        with np.errstate(over="ignore"):
            got = tp.pad(x, pads=(1, 2), value=value).numpy()
            want = np.pad(x, (1, 2), constant_values=value)
        assert got.dtype == want.dtype and got.tolist() == want.tolist(), (dtype, value)


@pytest.mark.parametrize(
    "dtype,value",
    [
        (DType.int32, float("nan")),
        (DType.int32, float("inf")),
        (DType.int32, 1e20),
        (DType.int32, 2**31),
        (DType.int64, 2**63),
        (DType.int64, -(2**63) - 1),
        (DType.uint8, -1),
        (DType.int8, 128),
        (DType.bool, 2),
        (DType.bool, float("nan")),
        (DType.bool, 0.5),
        pytest.param(DType.float32, 2**1100, id="float32-2**1100"),
    ],
)
def test_pad_value_the_dtype_cannot_hold_is_a_param_error_in_phase_1(dtype: DType, value: Any) -> None:
    """numpy raised these only in the kernel (a KernelError at sync) or wrapped them; bool takes 0 or 1."""
    with pytest.raises(ParamError) as e:
        ops.pad.get_workspace_size(TensorDesc((1,), dtype), pads=(1, 1), value=value)
    assert e.value.op == "pad" and e.value.arg == "value"


@pytest.mark.parametrize("layout", ["dense", "strided", "transposed"])
def test_embedding_of_a_float16_table_copies_its_bits(layout: str) -> None:
    """float16 is an allowed weight dtype, but numba has none: binding the gather raised NotImplementedError."""
    w = np.array([[0.5, -0.0, np.inf], [1e-7, -2.0, 65504.0]], np.float16)
    idx = np.array([[1, 0], [0, 1]], np.int64)
    got = run_checked(ops.embedding, on_device(w, layout), idx).outputs[0]
    assert got.dtype == np.float16 and got.tobytes() == w[idx].tobytes()


@pytest.mark.parametrize("dtype", ["int8", "uint8", "bool"])
def test_embedding_refuses_tables_of_dtypes_it_does_not_list(dtype: str) -> None:
    dev = device("cpu")
    w = dev.tensor(np.ones((4, 3), dtype=dtype))
    assert DType(dtype) not in ops.embedding.spec.dtypes
    with pytest.raises(ParamError) as e:
        ops.embedding.get_workspace_size(w, dev.tensor(np.array([0, 1])))
    assert e.value.arg == "weight"


def test_an_output_overlapping_a_variadic_input_names_that_input() -> None:
    dev = device("cpu")
    out = dev.tensor(np.zeros((6, 3), np.float32))
    xs = [dev.tensor(np.ones((2, 3), np.float32)) for _ in range(2)] + [out.strided((2, 3), (3, 1), 0)]
    with pytest.raises(ParamError, match=r"overlapping xs\[2\]"):
        ops.concat.get_workspace_size(*xs, dim=0, out=out)


def test_a_zero_element_out_with_zero_strides_is_accepted() -> None:
    """numpy gives 0-size arrays zero strides: such an out= was refused as 'elements share memory'."""
    dev = device("cpu")
    x, y, buf = dev.tensor(np.ones((2, 0, 3), np.float32)), dev.tensor(np.ones((2, 3), np.float32)), dev.empty((8,))
    for strides in ((0, 0, 0), (3, 3, 1)):
        assert tp.contiguous(x, out=buf.strided((2, 0, 3), strides)).shape == (2, 0, 3)
    with pytest.raises(ParamError, match="share memory"):  # a broadcast out with elements still is refused
        tp.contiguous(y, out=buf.strided((2, 3), (0, 1)))
    for t in (x, y, buf):
        t.free()


def test_cast_to_a_missing_dtype_is_refused() -> None:
    """np.dtype(None) is float64: cast(x, dtype=None) cast to float64."""
    with pytest.raises(ParamError) as e:
        tp.cast(np.ones(3, np.float32), dtype=None)
    assert e.value.op == "cast" and e.value.arg == "dtype"
