"""Row kernels on rows of a wider array (each row dense, the matrix not): their loops take such rows typed dense
(a view, never a copy), so the results must be right and every output element written, the output rows padded
too, with shapes of several rows and widths that are not multiples of a vector."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
import pytest
from ops_layouts import compiles_nothing, on_device

from twophase import ops
from twophase.kernels.cpu.jit import entry, rows_only
from twophase.layout import as_rows, rows_split
from twophase.ops.selection import forced
from twophase.testing import run_checked
from twophase.testing.checked import view_of

SHAPES = [(33, 129), (3, 11, 70), (97, 13)]  # rows of 13: staged in batches of whole rows (elementwise.SHORT_ROW)
LONG = (3, 40000)  # softmax splits rows this long into blocks (ops.normalization.LONG_ROW)
ROW_OPS: dict[str, tuple[Any, dict[str, Any]]] = {
    "softmax": (ops.softmax, {"dim": -1}),
    "log_softmax": (ops.log_softmax, {"dim": -1}),
    "gelu": (ops.gelu, {}),
    "exp": (ops.exp, {}),
    "silu": (ops.silu, {}),
}
REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "argmax", "var")


def _x(shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    return (np.random.default_rng(len(shape)).standard_normal(shape) * 2).astype(np.float32)


@pytest.mark.parametrize("shape", [*SHAPES, LONG])
@pytest.mark.parametrize("name", sorted(ROW_OPS))
@pytest.mark.parametrize("where", ["input", "output", "both"])
def test_row_ops_on_padded_rows(name: str, shape: tuple[int, ...], where: str) -> None:
    op, attrs = ROW_OPS[name]
    x = _x(shape)
    xin = on_device(x, "padded") if where != "output" else on_device(x)
    out = on_device(np.zeros(shape, np.float32), "padded") if where != "input" else None
    r = run_checked(op, xin, out=out, **attrs)
    assert r.unwritten == (0,) and r.inputs_changed == ()
    np.testing.assert_allclose(r.outputs[0], op.spec.reference(x.astype(np.float64), **attrs), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", [*sorted(ROW_OPS), "layer_norm"])
def test_padded_and_contiguous_rows_share_one_compiled_kernel(name: str) -> None:
    """The row kernels take dense rows through ``row_of``, whatever the matrix's layout type: one specialization
    serves a contiguous matrix and one whose rows are padded, in and out (each another compile before, seconds
    each, at a user's first call too). The layouts run after the contiguous one add none."""
    x = _x((33, 129))
    if name == "layer_norm":
        w, b = _x((2, 129))

        def run(xin: Any, out: Any) -> Any:
            return run_checked(ops.layer_norm, xin, w, b, normalized_shape=(129,), out=out)

    else:
        op, attrs = ROW_OPS[name]

        def run(xin: Any, out: Any) -> Any:
            return run_checked(op, xin, out=out, **attrs)

    def padded_out() -> Any:
        out = on_device(np.zeros(x.shape, np.float32), "padded")
        if name != "layer_norm":
            return out
        return (out, *(on_device(np.zeros((33, 1), np.float32)) for _ in range(2)))

    _compiled_once(run, x, padded_out)


def _compiled_once(
    run: Callable[[Any, Any], Any], x: np.ndarray[Any, Any], padded_out: Callable[[], Any]
) -> np.ndarray[Any, Any]:
    """``run(x, out)`` on a contiguous x and its own output, then on a padded x, into a padded output
    (``padded_out()``), and both: the same bits each time, and no kernel compiled after the first run. Returns
    the first output."""
    want = run(on_device(x), None).outputs[0]
    padded = on_device(x, "padded")
    with compiles_nothing():
        for xin, out in ((padded, None), (on_device(x), padded_out()), (padded, padded_out())):
            r = run(xin, out)
            assert all(u == 0 for u in r.unwritten)
            np.testing.assert_array_equal(r.outputs[0], want)  # the same code: the same bits
    return want  # type: ignore[no-any-return]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rms", [False, True])
def test_norms_on_padded_rows(shape: tuple[int, ...], rms: bool) -> None:
    x = _x(shape)
    n = shape[-1]
    rng = np.random.default_rng(3)
    w, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    outs = (
        on_device(np.zeros(shape, np.float32), "padded"),
        *(on_device(np.zeros(shape[:-1] + (1,), np.float32)) for _ in range(2)),
    )  # out, mean, rstd
    if rms:
        r = run_checked(ops.rms_norm, on_device(x, "padded"), w, out=outs, normalized_shape=(n,))
        want = ops.rms_norm.spec.reference(x.astype(np.float64), w, normalized_shape=(n,))
    else:
        r = run_checked(ops.layer_norm, on_device(x, "padded"), w, b, out=outs, normalized_shape=(n,))
        want = ops.layer_norm.spec.reference(x.astype(np.float64), w, b, normalized_shape=(n,))
    want = want[0] if isinstance(want, tuple) else want
    assert all(u == 0 for u in r.unwritten) and r.inputs_changed == ()
    np.testing.assert_allclose(r.outputs[0], want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", REDUCTIONS)
def test_reductions_of_padded_rows(name: str, shape: tuple[int, ...]) -> None:
    op = getattr(ops, name)
    x = _x(shape)
    attrs: dict[str, Any] = {"dim": -1} if name == "argmax" else {"dims": (-1,)}
    r = run_checked(op, on_device(x, "padded"), **attrs)
    assert r.inputs_changed == ()
    want = op.spec.reference(x.astype(np.float64) if name != "argmax" else x, **attrs)
    np.testing.assert_allclose(r.outputs[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", REDUCTIONS)
@pytest.mark.parametrize("shape, dim", [((5, 9000), -1), ((300, 70), 0)])
def test_reductions_are_compiled_once_for_any_layout(name: str, shape: tuple[int, ...], dim: int) -> None:
    """The level kernels read their input, the data or the partials, through ``row_of`` only: one specialization
    serves a contiguous input, a padded one and the partials of the next level (rows of 9000: two levels; dim 0:
    the column-wise kernels). The output is a new 1-D array each run: contiguous whatever the input's layout."""
    op = getattr(ops, name)
    attrs: dict[str, Any] = {"dim": dim} if name == "argmax" else {"dims": (dim,)}
    _compiled_once(lambda xin, out: run_checked(op, xin, **attrs), _x(shape), lambda: None)


@pytest.mark.parametrize("name", ["reduce_sum", "reduce_max", "reduce_min"])
@pytest.mark.parametrize("shape, dims", [((300, 70), (0,)), ((3, 110, 70), (0, 1))])
def test_column_reductions_of_padded_rows(name: str, shape: tuple[int, ...], dims: tuple[int, ...]) -> None:
    """Reductions over the leading dims walk the rows (the kept columns vectorized) of a padded matrix."""
    op = getattr(ops, name)
    x = _x(shape)
    r = run_checked(op, on_device(x, "padded"), dims=dims)
    assert r.unwritten == (0,) and r.inputs_changed == ()
    np.testing.assert_allclose(r.outputs[0], op.spec.reference(x.astype(np.float64), dims=dims), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape", [(2, 5, 7, 9), (3, 4, 21), (2, 3, 1, 17)])
@pytest.mark.parametrize("where", ["input", "output", "both"])
def test_batch_norm_on_image_crops(shape: tuple[int, ...], where: str) -> None:
    """An (N, C, H, W) crop of a wider image runs row by row in place, not through a packed copy."""
    x = _x(shape)
    c = shape[1]
    rng = np.random.default_rng(5)
    mean, w, b = (rng.standard_normal(c).astype(np.float32) for _ in range(3))
    var = rng.uniform(0.5, 2.0, c).astype(np.float32)
    xin = on_device(x, "padded") if where != "output" else on_device(x)
    out = on_device(np.zeros(shape, np.float32), "padded") if where != "input" else None
    r = run_checked(ops.batch_norm, xin, mean, var, w, b, out=out)
    assert r.implementation == "channels" and r.workspace_size == 0
    assert r.unwritten == (0,) and r.inputs_changed == ()
    np.testing.assert_allclose(
        r.outputs[0], ops.batch_norm.spec.reference(x.astype(np.float64), mean, var, w, b), rtol=2e-5, atol=2e-5
    )


def test_rows_split() -> None:
    """Where dims split into evenly spaced rows of one stride: the longest row, for every operand at once."""
    a = np.zeros((4, 6, 8), np.float32)
    crop = a[:, :, :5]
    assert rows_split(a.shape, a.strides) == 0  # dense: one row of everything
    assert rows_split(crop.shape, crop.strides) == 2  # 24 rows of 5
    assert rows_split(crop.shape, crop.strides, np.zeros((4, 6, 5), np.float32).strides) == 2
    assert as_rows(crop, 0, 2).shape == (24, 5)
    assert np.shares_memory(as_rows(crop, 0, 2), a)
    b = np.zeros((4, 6, 8, 10), np.float32)[:, ::2, :, :5]  # every other plane of a crop: 3 strides, not 2
    assert rows_split(b.shape, b.strides) is None
    assert rows_split((), ()) == 0


@pytest.mark.parametrize("groups, stride", [(6, 1), (6, 2), (2, 1)])
@pytest.mark.parametrize("where", ["input", "output", "both"])
def test_direct_conv_on_image_crops(groups: int, stride: int, where: str) -> None:
    """The direct convolution (depthwise, or no workspace) reads and writes crops of wider images row by row."""
    x = _x((2, 6, 9, 13))
    w = np.random.default_rng(7).standard_normal((6, 6 // groups, 3, 3)).astype(np.float32)
    attrs = {"stride": stride, "padding": 1, "groups": groups}
    want = ops.conv2d.spec.reference(x.astype(np.float64), w.astype(np.float64), None, **attrs)
    xin = on_device(x, "padded") if where != "output" else on_device(x)
    out = on_device(np.zeros(want.shape, np.float32), "padded") if where != "input" else None
    r = run_checked(ops.conv2d, xin, w, None, out=out, workspace_limit=0, **attrs)
    assert r.implementation == "direct" and r.unwritten == (0,) and r.inputs_changed == ()
    np.testing.assert_allclose(r.outputs[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(2, 6, 7, 9), (2, 4, 300, 120)])  # groups of 126, and of 72000: in blocks
def test_group_norm_is_compiled_once_for_any_layout(shape: tuple[int, ...]) -> None:
    """Group norm reads and writes its groups' rows through ``row_of`` only: image crops in and out run the
    kernel compiled for contiguous images (each layout was another compile of 3-5 s before)."""
    x = _x(shape) + 3
    rng = np.random.default_rng(9)
    w, b = rng.standard_normal(shape[1]).astype(np.float32), rng.standard_normal(shape[1]).astype(np.float32)
    _compiled_once(
        lambda xin, out: run_checked(ops.group_norm, xin, w, b, out=out, num_groups=2),
        x,
        lambda: on_device(np.zeros(shape, np.float32), "padded"),
    )


@pytest.mark.parametrize("name", ["max_pool2d", "avg_pool2d", "batch_norm", "batch_norm_rows"])
def test_pools_and_batch_norm_are_compiled_once_for_any_layout(name: str) -> None:
    """Pools and batch norm read and write their planes' rows (or an (N, C) input's rows) through ``row_of``
    only: crops of wider images in and out run the kernels compiled for contiguous ones."""
    x = _x((2, 6, 9, 13) if name != "batch_norm_rows" else (7, 6))  # (N, C): rows of channels
    rng = np.random.default_rng(5)
    stats = [rng.standard_normal(6).astype(np.float32) for _ in range(3)]
    var = rng.uniform(0.5, 2.0, 6).astype(np.float32)
    oshape = (2, 6, 5, 7) if name.endswith("pool2d") else x.shape

    def run(xin: Any, out: Any) -> Any:
        if name.endswith("pool2d"):
            return run_checked(getattr(ops, name), xin, out=out, kernel_size=3, stride=2, padding=1)
        return run_checked(ops.batch_norm, xin, stats[0], var, stats[1], stats[2], out=out)

    want = _compiled_once(run, x, lambda: on_device(np.zeros(oshape, np.float32), "padded"))
    x64 = x.astype(np.float64)
    if name.endswith("pool2d"):
        ref = getattr(ops, name).spec.reference(x64, kernel_size=3, stride=2, padding=1)
    else:
        ref = ops.batch_norm.spec.reference(x64, stats[0], var, stats[1], stats[2])
    np.testing.assert_allclose(want, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.usefixtures("microkernel")  # im2col_tiles and implicit run on the register-blocked GEMMs
@pytest.mark.parametrize(
    "impl, stride, groups",
    [("im2col_tiles", 1, 1), ("im2col_tiles", 2, 1), ("im2col", 2, 1), ("implicit", 2, 1), ("direct", 1, 2)],
)
def test_conv_is_compiled_once_for_any_layout(impl: str, stride: int, groups: int) -> None:
    """The unfolding convolutions read the input by rows (``row_of``) or planes (``span_of``) and write the
    output's planes through pointers, the direct one by rows: a crop of wider images in, a channel slice of a
    wider output out, run the kernels compiled for contiguous ones (each layout was another compile of up to 8 s
    before)."""
    x = _x((2, 8, 9, 13))
    w = np.random.default_rng(7).standard_normal((16, 8 // groups, 3, 3)).astype(np.float32)
    attrs = {"stride": stride, "padding": 1, "groups": groups}
    ref = ops.conv2d.spec.reference(x.astype(np.float64), w.astype(np.float64), None, **attrs)

    def run(xin: Any, out: Any) -> Any:
        with forced(impl):
            r = run_checked(ops.conv2d, xin, w, None, out=out, **attrs)
        assert r.implementation == impl
        return r

    def channel_slice() -> Any:
        wide = np.zeros((2, 20, *ref.shape[2:]), np.float32)
        return view_of(on_device(wide), wide, wide[:, 2:18])

    np.testing.assert_allclose(_compiled_once(run, x, channel_slice), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "shape, groups, where",
    [
        *(((2, 6, 7, 9), 3, where) for where in ("input", "output", "both")),
        ((2, 6, 5), 2, "both"),
        ((2, 4, 300, 120), 2, "input"),
    ],
)
def test_group_norm_on_image_crops(shape: tuple[int, ...], groups: int, where: str) -> None:
    """A crop of a wider image is normalized row by row in place (not packed); a huge group (L = 72000) in
    blocks of whole rows whose Welford partials merge."""
    x = _x(shape) + 3  # an offset mean
    c = shape[1]
    rng = np.random.default_rng(9)
    w, b = rng.standard_normal(c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    xin = on_device(x, "padded") if where != "output" else on_device(x)
    out = on_device(np.zeros(shape, np.float32), "padded") if where != "input" else None
    r = run_checked(ops.group_norm, xin, w, b, out=out, num_groups=groups)
    huge = c // groups * math.prod(shape[2:]) > 65536
    assert r.implementation == ("split_groups" if huge else "groups")
    assert r.unwritten == (0,) and r.inputs_changed == ()
    np.testing.assert_allclose(
        r.outputs[0], ops.group_norm.spec.reference(x.astype(np.float64), w, b, num_groups=groups), rtol=2e-5, atol=2e-5
    )


@pytest.mark.parametrize(
    "name, attrs",
    [
        ("max_pool2d", {"kernel_size": 3, "stride": 2, "padding": 1}),
        ("avg_pool2d", {"kernel_size": 3, "stride": 1, "padding": 1}),
        ("avg_pool2d", {"kernel_size": 2, "stride": 2, "count_include_pad": False}),
    ],
)
@pytest.mark.parametrize("where", ["input", "output", "both"])
def test_pools_on_image_crops(name: str, attrs: dict[str, Any], where: str) -> None:
    op = getattr(ops, name)
    x = _x((2, 3, 11, 13))
    want = op.spec.reference(x.astype(np.float64), **attrs)
    xin = on_device(x, "padded") if where != "output" else on_device(x)
    out = on_device(np.zeros(want.shape, np.float32), "padded") if where != "input" else None
    r = run_checked(op, xin, out=out, **attrs)
    assert r.unwritten == (0,) and r.inputs_changed == ()
    np.testing.assert_allclose(r.outputs[0], want, rtol=1e-5, atol=1e-5)


@rows_only("x")
@numba.njit(nogil=True)
def _first_row_sum(x: Any, y: Any) -> float:
    return float(x[0].sum() + y[0].sum())


def test_rows_only_parameters_are_typed_any_layout_whatever_the_sample() -> None:
    """``entry`` types a ``rows_only`` parameter 'A' for a contiguous sample too (one compile for every layout),
    the kernel's other arrays by their sample; the returned entry runs views of either kind; a name the kernel
    lacks is refused when it is marked."""
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    fn = entry(_first_row_sum, a, a)
    (sig,) = _first_row_sum.signatures
    assert (sig[0].layout, sig[1].layout) == ("A", "C")
    assert fn(a[:, ::2], a) == 0 + 2 + 0 + 1 + 2
    with pytest.raises(ValueError):
        rows_only("z")(_first_row_sum)
