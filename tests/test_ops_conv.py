"""conv2d: gemm_1x1, im2col (tiled under the workspace limit), im2col_parts, winograd, im2col_tiles and direct vs a
float64 reference, NCHW and NHWC."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from threads import num_threads

from twophase import Format, TensorDesc, clear_cache, device, one_shot, plan
from twophase.errors import ParamError
from twophase.kernels.cpu import conv as conv_kernels
from twophase.kernels.cpu import conv_implicit, gemm, winograd4
from twophase.kernels.cpu.conv import parts_areas, parts_units
from twophase.kernels.cpu.conv_tiles import available as tiles_available
from twophase.layout import align, spread_stride
from twophase.ops import conv as conv_op
from twophase.ops import conv2d
from twophase.ops.conv import SPLIT_K_MIN, grid_kblock, reference, tile_rows, tiles_grid
from twophase.ops.selection import forced
from twophase.runtime.fanout import split_range
from twophase.testing import run_checked


def _check(r: Any, ref: np.ndarray) -> None:
    assert r.guards_intact, "kernel wrote outside its workspace"
    assert r.unwritten == (0,)
    if r.workspace_size:
        assert r.workspace_size - 64 < r.touched <= r.workspace_size  # the reported size is what is used
    else:
        assert r.touched == 0
    np.testing.assert_allclose(r.outputs[0], ref, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(ref).max())))


def _x(rng: np.random.Generator, shape: tuple[int, ...], nhwc: bool) -> Any:
    x = (rng.standard_normal(shape) + 0.2).astype(np.float32)
    return x.transpose(0, 2, 3, 1).copy() if nhwc else x


def _input(x: np.ndarray, nhwc: bool) -> Any:
    return device("cpu").tensor(x, format=Format.NHWC) if nhwc else x


def _run(impl: str, x: Any, w: Any, b: Any, limit: int | None = None, **attrs: Any) -> Any:
    with forced(impl):
        return run_checked(conv2d, x, w, b, workspace_limit=limit, **attrs)


def _case(
    seed: int,
    n: int,
    cg: int,
    ocg: int,
    groups: int,
    h: int,
    w: int,
    k: tuple[int, int],
    stride: tuple[int, int],
    pad: tuple[int, int],
    dil: tuple[int, int],
    bias: bool,
    nhwc: bool,
) -> tuple[Any, Any, Any, dict[str, Any], np.ndarray] | None:
    """A random convolution (input, weight, bias, attributes) and its reference output; None when the window
    does not fit the padded input."""
    rng = np.random.default_rng(seed)
    c, oc = cg * groups, ocg * groups
    if (h + 2 * pad[0] - dil[0] * (k[0] - 1) - 1) < 0 or (w + 2 * pad[1] - dil[1] * (k[1] - 1) - 1) < 0:
        return None
    x = _x(rng, (n, c, h, w), nhwc)
    wt = (rng.standard_normal((oc, cg) + k) + 0.1).astype(np.float32)
    b = rng.standard_normal(oc).astype(np.float32) if bias else None
    attrs = dict(stride=stride, padding=pad, dilation=dil, groups=groups)
    return x, wt, b, attrs, reference(x, wt, b, nhwc=nhwc, **attrs)


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 2),
    cg=st.integers(1, 3),
    ocg=st.integers(1, 3),
    groups=st.integers(1, 2),
    h=st.integers(3, 9),
    w=st.integers(3, 9),
    k=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    stride=st.tuples(st.integers(1, 3), st.integers(1, 2)),
    pad=st.tuples(st.integers(0, 2), st.integers(0, 1)),
    dil=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    bias=st.booleans(),
    nhwc=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_conv2d_matches_reference_for_every_implementation(
    n: int,
    cg: int,
    ocg: int,
    groups: int,
    h: int,
    w: int,
    k: tuple[int, int],
    stride: tuple[int, int],
    pad: tuple[int, int],
    dil: tuple[int, int],
    bias: bool,
    nhwc: bool,
    seed: int,
) -> None:
    case = _case(seed, n, cg, ocg, groups, h, w, k, stride, pad, dil, bias, nhwc)
    if case is None:
        return
    x, wt, b, attrs, ref = case
    full = _run("im2col", _input(x, nhwc), wt, b, **attrs)
    _check(full, ref)
    assert full.tiling.tile_rows == ref.shape[1 if nhwc else 2]
    one_row = full.workspace_size // full.tiling.tile_rows + 64
    tiled = _run("im2col", _input(x, nhwc), wt, b, limit=one_row, **attrs)  # tiles of one or a few rows
    assert tiled.workspace_size <= one_row
    _check(tiled, ref)
    _check(_run("direct", _input(x, nhwc), wt, b, **attrs), ref)
    if k == (1, 1) and stride == (1, 1) and pad == (0, 0):
        _check(_run("gemm_1x1", _input(x, nhwc), wt, b, **attrs), ref)
    if k == (3, 3) and stride == (1, 1) and dil == (1, 1) and groups == 1:
        _check(_run("winograd", _input(x, nhwc), wt, b, **attrs), ref)
        _check(_run("winograd4", _input(x, nhwc), wt, b, **attrs), ref)
    if groups == 1 and not nhwc and tiles_available(np.float32):
        _check(_run("im2col_tiles", _input(x, nhwc), wt, b, **attrs), ref)
        if max(stride) <= 2 and conv_implicit.available(np.float32):
            implicit = _run("implicit", x, wt, b, **attrs)
            _check(implicit, ref)
            least = replace(implicit.tiling, chunk=1, kblock=k[0] * k[1])  # chunks of one row of one channel
            one = _implicit_workspace(*ref.shape[2:], k, stride, pad, dil, least)
            smallest = _run("implicit", x, wt, b, limit=one, **attrs)
            assert smallest.workspace_size <= one
            _check(smallest, ref)


@pytest.mark.parametrize("n, c, hw, oc", [(2, 0, 16, 4), (2, 3, 16, 0), (1, 0, 32, 4), (1, 3, 32, 0), (0, 3, 32, 4)])
def test_conv2d_3x3_with_an_empty_batch_or_channel_dim_is_not_planned_as_winograd(
    rng: np.random.Generator, n: int, c: int, hw: int, oc: int
) -> None:
    """A 3x3 stride-1 conv on a map large enough for winograd, with no input channels (out = bias), no output
    channels or no images: winograd's kernels split an empty channel range and failed at sync (IndexError)."""
    x = rng.standard_normal((n, c, hw, hw)).astype(np.float32)
    w = rng.standard_normal((oc, c, 3, 3)).astype(np.float32)
    b = rng.standard_normal(oc).astype(np.float32)
    r = run_checked(conv2d, x, w, b, padding=1)
    assert "winograd" not in r.implementation and r.guards_intact and r.unwritten == (0,)
    want = np.broadcast_to(b[None, :, None, None], (n, oc, hw, hw)) if c == 0 else reference(x, w, b, padding=1)
    assert r.outputs[0].shape == (n, oc, hw, hw)
    np.testing.assert_allclose(r.outputs[0], want, rtol=1e-6)


def test_conv2d_1x1_runs_as_gemm_without_workspace(rng: np.random.Generator) -> None:
    x, w = _x(rng, (2, 6, 5, 4), False), rng.standard_normal((8, 3, 1, 1)).astype(np.float32)
    r = run_checked(conv2d, x, w, None, groups=2)
    assert (r.implementation, r.workspace_size) == ("gemm_1x1", 0)
    _check(r, reference(x, w, groups=2))


def test_conv2d_depthwise_picks_the_direct_kernel(rng: np.random.Generator) -> None:
    x, w = _x(rng, (1, 4, 7, 7), False), rng.standard_normal((8, 1, 3, 3)).astype(np.float32)
    r = run_checked(conv2d, x, w, None, groups=4, padding=1)
    assert (r.implementation, r.workspace_size) == ("direct", 0)
    _check(r, reference(x, w, groups=4, padding=1))


@pytest.mark.parametrize(
    "hw, stride, pad",
    [
        ((7, 7), (1, 1), (1, 1)),  # "same" 3x3: each plane as one masked flat loop
        ((3, 40), (1, 1), (1, 1)),  # one inner row, longer than a vector step
        ((3, 3), (1, 1), (1, 1)),  # the smallest plane of the flat loop: one inner window
        ((33, 4), (1, 1), (1, 1)),  # rows narrower than a vector: its lanes span several rows' edges
        ((2, 9), (1, 1), (1, 1)),  # two rows: the row loop, both window rows at the ends in the padding
        ((21, 19), (2, 2), (1, 1)),  # stride 2, odd sizes: the last row's window reads a padding row
        ((20, 18), (2, 2), (1, 1)),  # stride 2: windows read as element pairs
        ((7, 41), (2, 2), (2, 2)),  # the first inner window at column 0: it alone from the float rows
        ((6, 40), (2, 2), (0, 0)),
        ((11, 37), (3, 3), (2, 2)),  # any other step, padding wider than one column
        ((9, 21), (2, 1), (0, 1)),  # row and column steps differ
        ((12, 5), (1, 2), (1, 0)),
        ((2, 2), (1, 1), (1, 1)),  # smaller than the window: every column an edge
        ((5, 19), (1, 1), (0, 0)),  # no padding: no edge column
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_conv2d_depthwise_3x3_kernel(
    hw: tuple[int, int], stride: tuple[int, int], pad: tuple[int, int], dtype: Any
) -> None:
    """The 3x3 depthwise kernel (nine taps per output written once, vector tails overlapping, edge columns on
    their own, "same" padding as one flat loop) against the reference, with bias and a depth multiplier of 2;
    NHWC input takes its strided-rows variant."""
    rng = np.random.default_rng(sum(hw) + stride[0])
    c = 3
    x = (rng.standard_normal((2, c) + hw) + 0.2).astype(dtype)
    w = rng.standard_normal((2 * c, 1, 3, 3)).astype(dtype)
    b = rng.standard_normal(2 * c).astype(dtype)
    attrs = dict(stride=stride, padding=pad, groups=c)
    for nhwc in (False, True):
        xin = x.transpose(0, 2, 3, 1).copy() if nhwc else x
        r = run_checked(conv2d, _input(xin, nhwc), w, b, **attrs)
        assert (r.implementation, r.workspace_size) == ("direct", 0)
        _check(r, reference(xin, w, b, nhwc=nhwc, **attrs))


def test_conv2d_depthwise_binding_allocates_nothing_the_size_of_a_large_plane() -> None:
    """The masked flat loop's masks are a byte per plane element, made when the launch is built (with an int64
    temporary): only planes up to ``SAME3_MAX_PLANE`` take it, so building a larger plane's launch allocates
    nothing of its size."""
    import tracemalloc

    from twophase.kernels.cpu.conv import SAME3_MAX_PLANE

    side = 300
    assert side * side > SAME3_MAX_PLANE
    dev = device("cpu")
    x, w = dev.tensor(np.ones((1, 2, side, side), np.float32)), dev.tensor(np.ones((2, 1, 3, 3), np.float32))
    out = dev.tensor(np.zeros((1, 2, side, side), np.float32), format=Format.NCHW)
    small = dev.tensor(np.ones((1, 2, 8, 8), np.float32))
    for t in (x, out, small):
        t.synchronize()
    _, warm = conv2d.get_workspace_size(small, w, None, padding=1, groups=2)  # the kernel compiled (or loaded)
    warm.set_output(0, dev.empty_like(warm.output_descs[0]))
    warm.destroy()
    tracemalloc.start()
    try:
        _, ex = conv2d.get_workspace_size(x, w, None, padding=1, groups=2)
        ex.set_output(0, out)  # binds the launch
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ex.implementation == "direct"
    ex.destroy()
    assert peak < side * side, f"building the launch allocated {peak} bytes"  # the masks alone: 2 * side^2


def test_conv2d_depthwise_same_keeps_inf_and_nan_in_their_windows() -> None:
    """The flat "same" loop reads each row's first and last columns for the neighbouring row's edge windows and
    selects them away: an inf or NaN there must reach only the windows that hold it, never the row beside it
    (a multiply by a 0 mask would give NaN)."""
    rng = np.random.default_rng(5)
    c, h, wd = 2, 6, 21
    x = rng.standard_normal((1, c, h, wd)).astype(np.float32)
    x[0, 0, 2, wd - 1], x[0, 0, 3, 10], x[0, 1, 4, 0] = np.inf, -np.inf, np.nan
    w = rng.standard_normal((c, 1, 3, 3)).astype(np.float32)
    r = run_checked(conv2d, x, w, None, padding=1, groups=c)
    assert r.implementation == "direct"
    ref = reference(x, w, padding=1, groups=c)
    np.testing.assert_array_equal(np.isfinite(r.outputs[0]), np.isfinite(ref))
    assert np.isfinite(r.outputs[0][0, 0, 1:4, 0]).all() and np.isfinite(r.outputs[0][0, 1, 3:6, wd - 1]).all()
    finite = np.isfinite(ref)
    np.testing.assert_allclose(r.outputs[0][finite], ref[finite], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "shape, k, stride, pad, dil",
    [
        ((7, 9), (3, 3), (1, 1), (1, 1), (1, 1)),  # "same": a plane's inner rows as one flat copy
        ((6, 8), (3, 5), (1, 1), (2, 2), (1, 1)),  # flat, two wrapped columns a side
        ((5, 6), (3, 3), (1, 1), (2, 2), (1, 2)),  # flat with dilation
        ((9, 20), (3, 3), (2, 2), (1, 1), (1, 1)),  # step 2: rows read as element pairs
        ((8, 19), (3, 3), (2, 2), (0, 0), (1, 1)),  # step 2 from column 0 (read apart from the pairs), odd width
        ((7, 23), (1, 1), (2, 2), (0, 0), (1, 1)),  # 1x1 stride 2
        ((7, 40), (2, 7), (1, 3), (1, 3), (1, 1)),  # another step; rows of 8 or more outputs
        ((3, 1), (2, 3), (1, 1), (2, 2), (1, 2)),  # padding wider than the window: whole tiles and columns in it
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_conv2d_im2col_unfold_paths(
    shape: tuple[int, int],
    k: tuple[int, int],
    stride: tuple[int, int],
    pad: tuple[int, int],
    dil: tuple[int, int],
    dtype: Any,
) -> None:
    """Each path of the unfold (flat planes, element pairs, strided or short rows, rows or columns wholly in the
    padding) against the reference: NCHW (dense rows) and NHWC (strided), whole images and tiles of one row; and
    the direct kernel on the same cases."""
    rng = np.random.default_rng(shape[1] + stride[1])
    x = (rng.standard_normal((2, 3) + shape) + 0.2).astype(dtype)
    w = rng.standard_normal((4, 3) + k).astype(dtype)
    b = rng.standard_normal(4).astype(dtype)
    attrs = dict(stride=stride, padding=pad, dilation=dil)
    for nhwc in (False, True):
        xin = x.transpose(0, 2, 3, 1).copy() if nhwc else x
        ref = reference(xin, w, b, nhwc=nhwc, **attrs)
        ow = ref.shape[2 if nhwc else 3]
        for limit in (None, align(3 * k[0] * k[1] * ow * x.itemsize)):  # whole images, tiles of one output row
            with forced("im2col"):
                r = run_checked(conv2d, _input(xin, nhwc), w, b, workspace_limit=limit, **attrs)
            assert r.implementation == "im2col" and (limit is None or r.tiling.tile_rows == 1)
            assert r.tiling.flat == (not nhwc and stride == (1, 1) and ow == shape[1])  # planes read in place
            _check(r, ref)
        _check(_run("direct", _input(xin, nhwc), w, b, **attrs), ref)


def test_conv2d_im2col_tiles_fit_workspace_limit(rng: np.random.Generator) -> None:
    x, w = _x(rng, (1, 3, 12, 10), False), rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    per_row = 3 * 3 * 3 * 10 * 4  # C*KH*KW * OW * itemsize
    ref = reference(x, w, padding=1)
    with forced("im2col", "direct"):  # im2col_tiles would rank first on this CPU
        full = run_checked(conv2d, x, w, None, padding=1)
    assert (full.implementation, full.workspace_size) == ("im2col", align(per_row * 12))
    cases = ((align(per_row * 12) - 1, 11), (align(per_row * 5), 5), (align(per_row * 5) - 1, 4), (align(per_row), 1))
    for limit, rows in cases:
        with forced("im2col", "direct"):
            r = run_checked(conv2d, x, w, None, padding=1, workspace_limit=limit)
        assert (r.implementation, r.tiling.tile_rows, r.workspace_size) == ("im2col", rows, align(per_row * rows))
        assert r.workspace_size <= limit
        _check(r, ref)
    with forced("im2col", "direct"):  # not even one row: direct
        r = run_checked(conv2d, x, w, None, padding=1, workspace_limit=per_row - 1)
    assert (r.implementation, r.workspace_size) == ("direct", 0)
    _check(r, ref)


@pytest.mark.parametrize("nhwc", [False, True])
def test_conv2d_im2col_unfolds_whole_images_per_tile(rng: np.random.Generator, nhwc: bool) -> None:
    n, c, oc, h, w = 3, 4, 5, 6, 7
    x, wt = _x(rng, (n, c, h, w), nhwc), rng.standard_normal((oc, c, 3, 3)).astype(np.float32)
    b = rng.standard_normal(oc).astype(np.float32)
    ref = reference(x, wt, b, padding=1, nhwc=nhwc)
    per_img, out_img = c * 9 * h * w * 4, oc * h * w * 4  # unfolded input and GEMM result of one image

    def size(tn: int) -> int:  # NCHW: several images' GEMM result is staged in the workspace
        return align(per_img * tn) + (align(out_img * tn) if tn > 1 and not nhwc else 0)

    for limit, tn in ((None, 3), (size(3), 3), (size(3) - 1, 2), (size(2) - 1, 1)):
        with forced("im2col", "direct"):  # 36 output tiles: winograd would rank first
            r = run_checked(conv2d, _input(x, nhwc), wt, b, padding=1, workspace_limit=limit)
        assert (r.implementation, r.tiling.tile_n, r.tiling.tile_rows, r.workspace_size) == ("im2col", tn, h, size(tn))
        assert (r.tiling.out_offset > 0) == (tn > 1 and not nhwc)
        _check(r, ref)


def _phase_area(rows: int, channels: int, k: int, pad: int, ow: int) -> int:
    """Bytes of one phase area (float32): the guards and 4 planes of (rows + the window's row offsets) x OW per
    channel, in multiples of 16 floats."""
    prows = rows + (k - 1 - pad) // 2 - (-pad) // 2
    return -(-(32 + 4 * channels * prows * ow) // 16) * 16 * 4


@pytest.mark.parametrize("nhwc", [False, True])
def test_conv2d_im2col_stride_2_through_phases(rng: np.random.Generator, nhwc: bool) -> None:
    """im2col with stride 2 on dense NCHW rows: each unfold range (one per helper thread from 2^20 unfolded
    elements) gets a phase area, a step's channels per image, after the unfolded images and the staged result; a
    limit without room for them
    keeps the same tiles without phases, one for a row of outputs (too few elements for two ranges) takes one
    phase area for that row. NHWC (strided rows) never does."""
    n, c, oc, side = 2, 128, 24, 64
    x, wt = _x(rng, (n, c, side, side), nhwc), rng.standard_normal((oc, c, 3, 3)).astype(np.float32)
    b = rng.standard_normal(oc).astype(np.float32)
    attrs = dict(stride=2, padding=1)
    ref = reference(x, wt, b, nhwc=nhwc, **attrs)
    kc, ow = c * 9, side // 2
    with num_threads(2), forced("im2col", "direct"):
        r = run_checked(conv2d, _input(x, nhwc), wt, b, **attrs)
        t = r.tiling
        _check(r, ref)
        assert t.phases == (not nhwc)
        if nhwc:
            return
        assert t.parts == 2 and t.phase_offset == align(kc * t.tile_n * t.oh * ow * 4) + (
            align(oc * t.tile_n * t.oh * ow * 4) if t.staged else 0
        )
        step = 64 // 9  # channels per step: whole channels, up to 64 unfolded rows
        assert r.workspace_size == t.phase_offset + 2 * t.tile_n * _phase_area(t.oh, step, 3, 1, ow)
        plain = run_checked(conv2d, x, wt, b, workspace_limit=r.workspace_size - 1, **attrs)
        assert (plain.tiling.phases, plain.tiling.tile_n, plain.workspace_size) == (False, t.tile_n, t.phase_offset)
        _check(plain, ref)
        one_row = align(kc * ow * 4) + _phase_area(1, step, 3, 1, ow)
        row = run_checked(conv2d, x, wt, b, workspace_limit=one_row, **attrs)
        assert (row.tiling.phases, row.tiling.tile_rows, row.tiling.parts, row.workspace_size) == (True, 1, 1, one_row)
        _check(row, ref)


@pytest.mark.parametrize("side, nhwc, tn", [(22, False, 2), (23, False, 1), (23, True, 2)])
def test_conv2d_im2col_takes_wide_nchw_images_one_at_a_time(
    rng: np.random.Generator, side: int, nhwc: bool, tn: int
) -> None:
    """An NCHW image of 512 output pixels or more (23 x 23 = 529; 22 x 22 = 484 is fewer) is one GEMM straight into
    out: no staged result to copy. Pixel-major images still merge into one GEMM, which stages nothing."""
    x = _x(rng, (2, 3, side, side), nhwc)
    wt, b = rng.standard_normal((4, 3, 3, 3)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    with forced("im2col", "direct"):
        r = run_checked(conv2d, _input(x, nhwc), wt, b, padding=1)
    assert (r.implementation, r.tiling.tile_n, r.tiling.out_offset) == (
        "im2col",
        tn,
        0 if nhwc or tn == 1 else align(3 * 9 * side * side * 4 * tn),
    )
    _check(r, reference(x, wt, b, padding=1, nhwc=nhwc))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_conv2d_winograd_chunks_fit_workspace_limit(rng: np.random.Generator, dtype: Any) -> None:
    n, c, oc, h, w = 2, 3, 4, 7, 6
    x = _x(rng, (n, c, h, w), False).astype(dtype)
    wt, b = rng.standard_normal((oc, c, 3, 3)).astype(dtype), rng.standard_normal(oc).astype(dtype)
    ref = reference(x, wt, b, padding=1)
    item = np.dtype(dtype).itemsize
    tiles = n * 4 * 3  # 2x2 output tiles: ceil(7/2) * ceil(6/2) per image

    def size(chunk: int) -> int:  # transformed weights, transformed input tiles, GEMM result (16 matrices each,
        # spread_stride apart), one part's scratch rows (a small problem: one part)
        return (
            16 * (spread_stride(oc * c * item) + spread_stride(c * chunk * item) + spread_stride(oc * chunk * item))
            + align(8 * (3 + 1) * item)
            + align(8 * 3 * item)
        )  # 3 tiles per row (OW 6)

    def most(limit: int) -> int:  # the most tiles per round that fit (strides grow in 64-byte steps)
        return max(k for k in range(1, tiles + 1) if size(k) <= limit)

    assert most(size(1)) < most(size(5)) < tiles
    for limit, chunk in ((None, tiles), (size(tiles), tiles), (size(5), most(size(5))), (size(1), most(size(1)))):
        r = _run("winograd", x, wt, b, limit=limit, padding=1)
        assert (r.tiling.chunk, r.workspace_size) == (chunk, size(chunk))
        _check(r, ref)
        if dtype == np.float64:
            np.testing.assert_allclose(r.outputs[0], ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ParamError):
        _run("winograd", x, wt, b, limit=size(1) - 1, padding=1)


@pytest.mark.parametrize(
    ("n", "c", "oc", "h", "w", "pad", "nhwc", "flat"),
    [
        (1, 3, 5, 9, 11, (1, 1), False, False),  # clipped last tile row and column
        (3, 7, 4, 13, 30, (2, 1), False, False),  # bands of tile rows, 3 images, asymmetric padding
        (2, 5, 6, 33, 17, (1, 2), True, False),  # NHWC: strided rows
        (1, 8, 8, 70, 71, (1, 1), False, False),  # several bands (19 tiles a row: 14 rows a band)
        (2, 3, 2, 3, 4, (0, 5), False, False),  # padding wider than a tile: whole tiles of zeros
        (1, 2, 3, 1, 1, (1, 1), False, False),
        (2, 3, 4, 17, 28, (1, 1), False, True),  # whole planes split into phases: ResNet's padding
        (1, 5, 3, 12, 8, (2, 2), False, True),
        (1, 4, 4, 9, 8, (0, 0), False, True),
        (2, 4, 5, 20, 20, (4, 3), False, True),  # the most padding the split planes take
        (1, 4, 5, 20, 20, (1, 5), False, False),
        (1, 8, 8, 70, 72, (1, 1), False, True),  # several bands
        (2, 3, 4, 16, 28, (1, 1), True, False),  # NHWC: rows not dense
    ],
)
def test_conv2d_winograd4_matches_reference(
    rng: np.random.Generator, n: int, c: int, oc: int, h: int, w: int, pad: tuple[int, int], nhwc: bool, flat: bool
) -> None:
    x = _x(rng, (n, c, h, w), nhwc)
    wt, b = rng.standard_normal((oc, c, 3, 3)).astype(np.float32), rng.standard_normal(oc).astype(np.float32)
    r = _run("winograd4", _input(x, nhwc), wt, b, padding=pad)
    assert r.implementation == "winograd4" and r.tiling.chunk == n and r.tiling.flat == flat
    _check(r, reference(x, wt, b, padding=pad, nhwc=nhwc))


def test_conv2d_winograd4_rounds_of_whole_images_fit_workspace_limit(rng: np.random.Generator) -> None:
    n, c, oc, h, w = 3, 3, 4, 10, 29
    x = _x(rng, (n, c, h, w), False)
    wt, b = rng.standard_normal((oc, c, 3, 3)).astype(np.float32), rng.standard_normal(oc).astype(np.float32)
    ref = reference(x, wt, b, padding=1)
    th, tr = 3, 9  # ceil(10/4) tile rows, ceil(29/4) + 1 tiles a row (the last a dummy); one band of 3 rows

    def size(images: int, planes: bool = False, tr: int = tr) -> int:  # U, V, M (36 matrices each,
        # spread_stride apart), one part's scratch rows (and the split planes: 16 rows of TH + 2 tile rows)
        nt = images * th * tr
        return (
            36 * sum(spread_stride(e * 4, 36) for e in (oc * c, c * nt, oc * nt))
            + align(24 * (th * tr + 1) * 4)
            + align(28 * th * tr * 4)
            + align(27 * c * 4)
            + (align(16 * (th + 2) * tr * 4) if planes else 0)
        )

    assert winograd4.geometry(h, w) == (th, tr - 1, th)
    for limit, images in ((None, 3), (size(3), 3), (size(3) - 1, 2), (size(2) - 1, 1), (size(1), 1)):
        r = _run("winograd4", x, wt, b, limit=limit, padding=1)
        assert (r.tiling.chunk, r.tiling.flat, r.workspace_size) == (images, False, size(images))
        _check(r, ref)
    with pytest.raises(ParamError) as e:
        _run("winograd4", x, wt, b, limit=size(1) - 1, padding=1)
    assert e.value.arg == "workspace_limit" and str(size(1)) in str(e.value)  # names the smallest that works
    x4 = np.ascontiguousarray(x[:, :, :, :28])  # 28 columns: whole planes split into phases, 7 + 1 tiles a row
    r = _run("winograd4", x4, wt, b, limit=size(2, True, 8), padding=1)
    assert (r.tiling.chunk, r.tiling.flat, r.workspace_size) == (2, True, size(2, True, 8))
    _check(r, reference(x4, wt, b, padding=1))


WINOGRADS = [("winograd", np.float32, 16), ("winograd", np.float64, 16), ("winograd4", np.float32, 36)]


@pytest.mark.parametrize(("impl", "dtype", "mats"), WINOGRADS)
def test_conv2d_constant_weight_keeps_the_transformed_weights_out_of_the_workspace(
    rng: np.random.Generator, impl: str, dtype: Any, mats: int
) -> None:
    """With ``constant_weight`` the workspace loses exactly the transformed weights' area (the binding keeps them)
    and the kernel stays inside the rest; the result is the reference's."""
    x = _x(rng, (2, 5, 11, 13), False).astype(dtype)
    wt, b = rng.standard_normal((6, 5, 3, 3)).astype(dtype), rng.standard_normal(6).astype(dtype)
    plain = _run(impl, x, wt, b, padding=1)
    kept = _run(impl, x, wt, b, padding=1, constant_weight=True)
    assert kept.implementation == impl and kept.tiling.own_weights and not plain.tiling.own_weights
    assert plain.workspace_size - kept.workspace_size == mats * spread_stride(6 * 5 * np.dtype(dtype).itemsize, mats)
    _check(kept, reference(x, wt, b, padding=1))


@pytest.mark.parametrize(("impl", "dtype", "mats"), WINOGRADS)
def test_conv2d_constant_weight_transforms_the_weight_once_per_binding(impl: str, dtype: Any, mats: int) -> None:
    """A bound executor transforms its weight at its first launch only: later launches follow new input data, in
    place or in other input tensors (a rebinding of x keeps the transform), but a weight changed in place is not
    seen (the contract ``constant_weight`` states), until the call is bound to another weight tensor."""
    rng = np.random.default_rng(11)
    dev = device("cpu")
    s = dev.stream()
    xs = [_x(rng, (2, 4, 9, 10), False).astype(dtype) for _ in range(3)]
    w1, w2 = (rng.standard_normal((3, 4, 3, 3)).astype(dtype) for _ in range(2))
    x, w, w_other = dev.tensor(xs[0], stream=s), dev.tensor(w1, stream=s), dev.tensor(w2, stream=s)
    with forced(impl):
        call = plan(conv2d, x, w, None, stream=s, padding=1, constant_weight=True)
    tol = {"rtol": 1e-4, "atol": 1e-3} if dtype == np.float32 else {"rtol": 1e-10, "atol": 1e-10}
    np.testing.assert_allclose(call().numpy(), reference(xs[0], w1, padding=1), **tol)
    w.view()[...] = w2  # in place: the kept transform of w1 still serves
    x.view()[...] = xs[1]
    np.testing.assert_allclose(call().numpy(), reference(xs[1], w1, padding=1), **tol)
    others = [dev.tensor(xi, stream=s) for xi in xs]
    for xi, t in zip(xs, others):  # other input tensors: rebound, and still the transform of w1
        np.testing.assert_allclose(call(t).numpy(), reference(xi, w1, padding=1), **tol)
    np.testing.assert_allclose(call(x, w_other).numpy(), reference(xs[1], w2, padding=1), **tol)  # rebound weight
    call.close()
    for t in [x, w, w_other, *others]:
        t.free(s)
    s.close()


def test_conv2d_constant_weight_launch_is_never_shared_with_another_executor(rng: np.random.Generator) -> None:
    """Two executors of one plan over the same memory share a launch (the op's launch cache), except with
    ``constant_weight``: the second, bound after the weight's memory got other data, transforms that data."""
    dev = device("cpu")
    s = dev.stream()
    x = dev.tensor(_x(rng, (2, 4, 9, 10), False), stream=s)
    w1, w2 = (rng.standard_normal((3, 4, 3, 3)).astype(np.float32) for _ in range(2))
    w, y = dev.tensor(w1, stream=s), dev.empty((2, 3, 9, 10), stream=s)
    for want in (w1, w2):
        w.view()[...] = want
        with forced("winograd"):
            size, ex = conv2d.get_workspace_size(x, w, None, out=y, padding=1, constant_weight=True)
        ws = dev.malloc(size, stream=s)
        conv2d(ws, size, ex, s)  # a single-use executor: consumed here
        np.testing.assert_allclose(y.numpy(), reference(x.numpy(), want, padding=1), rtol=1e-4, atol=1e-3)
        ws.free(s)
    s.close()


def test_conv2d_winograd4_is_float32_only(rng: np.random.Generator) -> None:
    """Its transforms' constants (1/6, 1/12, 1/24) are float32: a float64 convolution keeps winograd."""
    x, wt = _x(rng, (1, 2, 40, 40), False).astype(np.float64), rng.standard_normal((3, 2, 3, 3))
    with pytest.raises(ParamError) as e:
        _run("winograd4", x, wt, None, padding=1)
    assert e.value.arg == "implementation"
    assert _run("winograd", x, wt, None, padding=1).implementation == "winograd"


@pytest.mark.parametrize(
    ("shape", "first"),
    [
        ((1, 4, 28, 28), True),  # 7 tile columns (4x4 output tiles), 49 tiles
        ((6, 4, 28, 24), False),  # 6 tile columns
        ((1, 4, 16, 28), False),  # 4 x 7 = 28 tiles
        ((1, 4, 20, 28), True),  # 5 x 7 = 35 tiles
    ],
)
def test_conv2d_winograd4_ranks_first_from_7_tile_columns_and_32_tiles(shape: tuple[int, ...], first: bool) -> None:
    dev = device("cpu")
    x, w = dev.tensor(np.ones(shape, np.float32)), dev.tensor(np.ones((8, 4, 3, 3), np.float32))
    _, ex = conv2d.get_workspace_size(x, w, padding=1)
    with forced("winograd", "winograd4"):
        _, both = conv2d.get_workspace_size(x, w, padding=1)
    try:
        assert both.implementation == ("winograd4" if first else "winograd")
        if first:
            assert ex.implementation == "winograd4"
    finally:
        ex.destroy()
        both.destroy()


def test_conv2d_float64_nhwc_output_keeps_the_format(rng: np.random.Generator) -> None:
    x = _x(rng, (2, 4, 6, 5), True).astype(np.float64)
    w = rng.standard_normal((6, 4, 3, 2))
    size, ex = conv2d.get_workspace_size(_input(x, True), device("cpu").tensor(w), stride=2)
    assert ex.output_descs[0].format is Format.NHWC and ex.output_descs[0].shape == (2, 2, 2, 6)
    assert ex.tiling.orient == "pm"
    ex.destroy()
    r = run_checked(conv2d, _input(x, True), w, None, stride=2)
    np.testing.assert_allclose(r.outputs[0], reference(x, w, stride=2, nhwc=True), rtol=1e-12)


@pytest.mark.parametrize("oc", [16, 12])
def test_conv2d_nhwc_input_with_an_untagged_out(rng: np.random.Generator, oc: int) -> None:
    """An untagged ``out=`` of an NHWC conv is NHWC (the kernels view it by the input's format): phase 1 read its
    strides as NCHW, and with OC == OW planned a channel-major im2col_tiles that left most of it unwritten."""
    dev = device("cpu")
    x = rng.standard_normal((1, 16, 16, 16)).astype(np.float32)
    w = rng.standard_normal((oc, 16, 5, 5)).astype(np.float32)
    ref = reference(x.astype(np.float64), w.astype(np.float64), padding=2).transpose(0, 2, 3, 1)
    xt = dev.tensor(np.ascontiguousarray(x.transpose(0, 2, 3, 1)), format=Format.NHWC)
    out = dev.tensor(np.full(ref.shape, np.nan, np.float32))
    assert out.desc.format is Format.ND
    one_shot(conv2d)(xt, w, padding=2, out=out)
    got = out.numpy()
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3)
    for t in (xt, out):
        t.free()


@pytest.mark.parametrize(
    "w_shape,attrs,arg",
    [
        ((4, 3, 3, 3), {"groups": 2}, "groups"),
        ((4, 2, 3, 3), {}, "weight"),
        ((4, 3, 9, 3), {}, "x"),
        ((4, 3, 3, 3), {"stride": 0}, "stride"),
        ((4, 3, 3, 3), {"padding": (1, 2, 3)}, "padding"),
        ((4, 3, 0, 3), {}, "weight"),
        ((4, 3, 3, 0), {"padding": 1}, "weight"),
        ((4, 3, 3, 3), {"stride": 2**63}, "stride"),  # was numpy's OverflowError when the launch was built
        ((4, 3, 3, 3), {"dilation": (1, 2**40)}, "dilation"),
    ],
)
def test_conv2d_rejects_bad_arguments(w_shape: tuple[int, ...], attrs: dict[str, Any], arg: str) -> None:
    dev = device("cpu")
    with pytest.raises(ParamError) as e:
        conv2d.get_workspace_size(
            dev.tensor(np.ones((1, 3, 5, 5), np.float32)), dev.tensor(np.ones(w_shape, np.float32)), **attrs
        )
    assert e.value.op == "conv2d" and e.value.arg == arg


def test_conv2d_refuses_an_nhwc_tagged_weight() -> None:
    """An NHWC tag on a weight claims (OC, KH, KW, C/groups); conv2d reads weights as (OC, C/groups, KH, KW)."""
    dev = device("cpu")
    x = dev.tensor(np.ones((1, 3, 5, 5), np.float32))
    with pytest.raises(ParamError, match="untagged") as e:
        conv2d.get_workspace_size(x, dev.tensor(np.ones((4, 3, 3, 3), np.float32), format=Format.NHWC))
    assert e.value.arg == "weight"
    for fmt in (Format.ND, Format.NCHW):
        size, ex = conv2d.get_workspace_size(x, dev.tensor(np.ones((4, 3, 3, 3), np.float32), format=fmt))
        ex.destroy()


@pytest.mark.parametrize(
    ("shape", "first"),
    [
        ((1, 4, 10, 10), False),
        ((1, 4, 2, 62), False),
        ((1, 4, 2, 63), True),
        ((2, 4, 7, 7), True),
        ((1, 4, 11, 11), True),
    ],
)
def test_conv2d_winograd_ranks_first_from_32_tiles(shape: tuple[int, ...], first: bool) -> None:
    dev = device("cpu")  # 2x2 output tiles: 25, 31, 32, 2 * 16, 36
    x, w = dev.tensor(np.ones(shape, np.float32)), dev.tensor(np.ones((8, 4, 3, 3), np.float32))
    with forced("winograd", "im2col", "direct"):
        _, ex = conv2d.get_workspace_size(x, w, padding=1)
    assert ex.implementation == ("winograd" if first else "im2col")
    ex.destroy()


@pytest.fixture(params=[False, True], ids=["full_width_fma", "half_width_fma"])
def half_width(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[bool]:
    """Plans as on a host whose zmm FMA takes one pass (an Intel Xeon) or two (AMD Zen 4): ``gemm.half_width_fma``,
    so both are tested on either; the executor cache emptied around the test (its plans carry the other's choice)."""
    monkeypatch.setattr(gemm, "half_width_fma", lambda: request.param)
    clear_cache()
    yield request.param
    clear_cache()


@pytest.mark.parametrize(
    ("shape", "constant", "order", "order_half"),
    [
        # 49 2x2 tiles of 4 -> 8 channels: after the tiles
        ((1, 4, 13, 13), False, ("im2col_tiles", "winograd", "im2col"), None),
        # 98 tiles, but narrow (``WINOGRAD_FIRST``): after the tiles
        ((2, 4, 13, 13), False, ("im2col_tiles", "winograd", "im2col"), None),
        # 16 tiles: last; 49 pixels fill 0.77 of the panels (0.875 where a zmm FMA is two passes: the tiles first)
        ((1, 4, 7, 7), False, ("im2col", "im2col_tiles", "winograd"), ("im2col_tiles", "im2col", "winograd")),
        # 32 tiles: just ahead of im2col, after the tiles when those rank ahead of it
        ((2, 4, 7, 7), False, ("winograd", "im2col", "im2col_tiles"), ("im2col_tiles", "winograd", "im2col")),
        ((1, 4, 13, 13), True, ("winograd", "im2col_tiles", "im2col"), None),  # constant weights: first from 32 tiles
        ((1, 4, 7, 7), True, ("im2col", "im2col_tiles", "winograd"), ("im2col_tiles", "im2col", "winograd")),
    ],
)
def test_conv2d_winograd_ranks_just_ahead_of_im2col_below_its_first_tiles(
    half_width: bool,
    shape: tuple[int, ...],
    constant: bool,
    order: tuple[str, ...],
    order_half: tuple[str, ...] | None,
) -> None:
    if not tiles_available(np.float32):
        pytest.skip("im2col_tiles needs the register-blocked GEMM (AVX-512)")
    dev = device("cpu")
    x, w = dev.tensor(np.ones(shape, np.float32)), dev.tensor(np.ones((8, 4, 3, 3), np.float32))
    want = order_half if half_width and order_half else order
    for k in range(len(want)):  # the first of the rest is chosen: the ranking, one step at a time
        with forced(*want[k:]):
            _, ex = conv2d.get_workspace_size(x, w, padding=1, constant_weight=constant)
        assert ex.implementation == want[k]
        ex.destroy()


@pytest.mark.parametrize(
    ("n", "c", "oc", "first"),
    [
        (1, 256, 256, "fused"),  # 49 tiles, 256 channels: first where the weight transform is fused (from 32)
        (1, 256, 512, "fused"),
        (1, 512, 512, "fused"),
        (1, 128, 256, "never"),  # 128-255 channels: the fusion does not move them
        (2, 256, 256, "always"),  # 98 tiles, 256 channels: first from 64
        (2, 256, 512, "always"),
        (2, 128, 128, "never"),  # 128-255 channels: first from 196 tiles
        (4, 128, 128, "always"),
        (4, 256, 128, "always"),  # the lesser of C and OC counts
        (4, 128, 512, "always"),
        (8, 64, 64, "never"),  # 392 tiles of 64 channels: never first
        (8, 256, 64, "never"),
        (8, 64, 256, "never"),
    ],
)
def test_conv2d_winograd_ranks_first_by_channels_and_tiles(
    half_width: bool, n: int, c: int, oc: int, first: str
) -> None:
    """On 14x14 maps (49 2x2 tiles an image), where the tiles rank ahead of im2col on any host: winograd first from
    the tiles ``WINOGRAD_FIRST`` gives the lesser of its channel counts, or from ``WINOGRAD_MIN_TILES`` with
    ``WINOGRAD_FUSED_FIRST`` channels where its weight transform is fused (the zmm kernels) on a host whose zmm
    FMA takes two passes, else after the tiles."""
    if not tiles_available(np.float32):
        pytest.skip("im2col_tiles needs the register-blocked GEMM (AVX-512)")
    dev = device("cpu")
    x, w = dev.empty((n, c, 14, 14), np.float32), dev.empty((oc, c, 3, 3), np.float32)
    with forced("winograd", "im2col_tiles", "im2col"):
        _, ex = conv2d.get_workspace_size(x, w, padding=1)
    fused_first = first == "fused" and half_width and gemm.available()
    assert ex.implementation == ("winograd" if first == "always" or fused_first else "im2col_tiles")
    if fused_first:
        assert ex.tiling.fused_rows == conv_op.WINO_FUSED_ROWS
    ex.destroy()


@given(st.integers(0, 1 << 22), st.integers(1, 64))
@settings(max_examples=200, deadline=None)
def test_spread_stride_puts_blocks_on_distinct_sets(nbytes: int, count: int) -> None:
    s = spread_stride(nbytes, count)
    assert s >= nbytes and s % 64 == 0 and s - align(nbytes) < 64 * 64
    assert len({k * s % 4096 for k in range(count)}) == count


def test_spread_stride_moves_power_of_two_blocks_apart() -> None:
    assert spread_stride(1 << 18) == (1 << 18) + 64
    assert spread_stride(200) == 256  # already spread: just aligned
    with pytest.raises(ValueError):
        spread_stride(64, 65)


needs_tiles = pytest.mark.usefixtures("microkernel")  # im2col_tiles runs on the register-blocked GEMM


@needs_tiles
@pytest.mark.parametrize(
    "n, c, oc, hw, k, stride, pad, dil, threads",
    [
        (1, 64, 40, (15, 15), (3, 3), (2, 2), (1, 1), (1, 1), 2),  # 8x8 outputs: input channels split, 2 x 288 rows
        (1, 61, 24, (7, 7), (3, 3), (1, 1), (1, 1), (1, 1), 2),  # planes, input channels split 30 / 31
        (1, 90, 20, (6, 6), (3, 3), (1, 1), (1, 1), (1, 1), 3),  # 36 pixels, 3 parts of 30 input channels
        (1, 5, 50, (9, 9), (3, 3), (1, 1), (1, 1), (1, 1), 2),  # 81 pixels, 45 unfolded rows: output channels split
        (3, 7, 20, (11, 13), (3, 3), (2, 2), (1, 1), (1, 1), 2),  # parts' output rows cross images; 7-pixel rows
        (2, 3, 33, (30, 31), (7, 7), (2, 2), (3, 3), (1, 1), 3),  # stem-like: 16-pixel rows, 3 parts
        (1, 60, 17, (10, 10), (3, 3), (1, 1), (2, 2), (2, 2), 1),  # dilation, one part, 540 rows in 2 k blocks
        (2, 6, 9, (12, 12), (1, 1), (2, 2), (0, 0), (1, 1), 5),  # 1x1 stride 2, 5 parts
        (1, 4, 70, (8, 40), (2, 5), (3, 3), (0, 2), (1, 1), 2),  # another column step
        (2, 9, 21, (13, 17), (5, 3), (2, 2), (2, 1), (1, 1), 2),  # phases: row offsets -1..1, column -1..0
        (1, 3, 8, (64, 64), (3, 3), (2, 2), (1, 1), (1, 1), 2),  # phases of tiles of 8 of an image's 32 rows
        (1, 5, 18, (16, 16), (3, 3), (2, 2), (0, 0), (1, 1), 2),  # ceil(W/2) > OW: no phases
        (1, 3, 8, (64, 40), (3, 3), (1, 1), (1, 1), (1, 1), 2),  # planes: tiles of 12 of an image's 64 rows
        (2, 4, 10, (10, 17), (3, 5), (1, 1), (1, 2), (1, 1), 3),  # planes: column offsets -2..2, 3 parts
        (1, 6, 12, (7, 7), (5, 5), (1, 1), (4, 4), (2, 2), 2),  # planes: offsets -4..4 on a 7-wide map
        (1, 6, 12, (9, 9), (3, 3), (1, 1), (0, 0), (1, 1), 2),  # stride 1, OW < W: no planes
    ],
)
def test_conv2d_im2col_tiles(
    n: int,
    c: int,
    oc: int,
    hw: tuple[int, int],
    k: tuple[int, int],
    stride: tuple[int, int],
    pad: tuple[int, int],
    dil: tuple[int, int],
    threads: int,
    rng: np.random.Generator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tiles with masked 16-column tails, several k blocks, parts over output rows (across images) or output
    channels, stride 2 through the input's phases where they hold a whole phase row: every output written once
    with the bias, the workspace exactly the parts' phase areas and tiles (the tiles last, their padding columns
    zeroed, so all of it is touched), nothing past it. Tiles of at most 256 pixels, so that these small images
    take several (the default budget: ``test_conv2d_im2col_tiles_budget``), k blocks of at most ``TILE_K`` rows
    (deeper ones: ``test_conv2d_im2col_tiles_deeper_k_blocks_only_where_the_limit_leaves_tiles_whole``)."""
    monkeypatch.setattr(conv_op, "TILE_K_WHOLE", conv_op.TILE_K)
    x = _x(rng, (n, c) + hw, False)
    w = (rng.standard_normal((oc, c) + k) * 0.2).astype(np.float32)
    b = rng.standard_normal(oc).astype(np.float32)
    attrs = dict(stride=stride, padding=pad, dilation=dil)
    ref = reference(x, w, b, **attrs)
    taps = k[0] * k[1]
    kc = c * taps
    oh, ow = ((hw[i] + 2 * pad[i] - dil[i] * (k[i] - 1) - 1) // stride[i] + 1 for i in (0, 1))
    grid = tiles_grid(n, oh, ow, oc, threads, kc, taps)
    kblock = grid_kblock(grid, kc)
    monkeypatch.setattr(conv_op, "TILE_FLOATS", 256 * kblock)
    with num_threads(threads):
        r = _run("im2col_tiles", x, w, b, **attrs)
    t = r.tiling
    assert t.kblock == kblock and t.chunk == tile_rows(t.oh, t.ow, 256)
    assert t.grid == grid and t.parts == len(t.grid)
    phases = stride == (2, 2) and dil == (1, 1) and min(k) >= 2 and (hw[1] + 1) // 2 <= t.ow
    assert t.phases == phases
    assert t.flat == (stride == (1, 1) and t.ow == hw[1])  # the unfold reads the planes in place
    blocks = [(k0, min(k1, k0 + t.kblock)) for *_, lo, k1 in t.grid for k0 in range(lo, k1, t.kblock)]
    channels = max(len({kk // taps for kk in range(k0, k1)}) for k0, k1 in blocks)
    plane = (t.chunk + (k[0] - 1 - pad[0]) // 2 - (-pad[0]) // 2) * t.ow
    area = -(-(32 + 4 * channels * plane) // 16) * 16 if phases else 0
    # a tile's columns: its widest tile's pixels up to the next 16, where a part's image segment (its rows of one
    # image) holds tiles of chunk rows, the last one shorter
    segments = [min(b, (i + 1) * t.oh) - max(a, i * t.oh) for a, b, *_ in t.grid for i in range(n)]
    widest = max(min(t.chunk, length) for length in segments)
    sums = sum(1 for *_, k0, _ in t.grid if k0 > 0) * -(-n * oc * t.oh * t.ow * 4 // 64) * 64  # partial outputs
    assert r.workspace_size == t.parts * (t.kblock * -(-widest * t.ow // 16) * 16 + area) * 4 + sums
    _check(r, ref)


@needs_tiles
def test_conv2d_im2col_tiles_splits_output_channels_where_partials_do_not_fit(rng: np.random.Generator) -> None:
    """Two parts over one 7x7 image's 64 input channels need a partial output of 512 x 49 floats (98 KiB) besides
    their tiles; under a limit below that, they split the output channels instead (both unfolding every tile)."""
    x = _x(rng, (1, 64, 7, 7), False)
    w = (rng.standard_normal((512, 64, 3, 3)) * 0.2).astype(np.float32)
    attrs = dict(stride=(1, 1), padding=(1, 1))
    ref = reference(x, w, None, **attrs)
    with num_threads(2):
        free = _run("im2col_tiles", x, w, None, **attrs)
        tight = _run("im2col_tiles", x, w, None, 512 * 49 * 4, **attrs)
    assert [k for *_, k0, k1 in free.tiling.grid for k in (k0, k1)] == [0, 288, 288, 576]
    assert free.workspace_size > 512 * 49 * 4
    assert {(k0, k1) for *_, k0, k1 in tight.tiling.grid} == {(0, 576)}
    assert [(i0, i1) for _, _, i0, i1, _, _ in tight.tiling.grid] == list(gemm.row_ranges(512, 2))
    assert tight.workspace_size <= 512 * 49 * 4
    _check(free, ref)
    _check(tight, ref)


@needs_tiles
def test_conv2d_im2col_tiles_splits_output_channels_for_larger_tiles(rng: np.random.Generator) -> None:
    """Under 256 KiB, two parts over one 14x14 image's 256 input channels would share the limit with a partial
    output of 256 x 196 floats and fit tiles of one output row only (two rows: 2 x 384 unfolded rows x 32 columns
    + the partial, over the limit); split by output channels instead, each part's tiles take 4 rows. Unlimited,
    the tiles are as large either way and the input channels stay split."""
    x = _x(rng, (1, 256, 14, 14), False)
    w = (rng.standard_normal((256, 256, 3, 3)) * 0.05).astype(np.float32)
    b = rng.standard_normal(256).astype(np.float32)
    attrs = dict(stride=(1, 1), padding=(1, 1))
    ref = reference(x, w, b, **attrs)
    limit = 256 * 1024
    assert 2 * 384 * 32 * 4 + align(256 * 196 * 4) > limit  # the input channels' split: tiles of one row at most
    with num_threads(2):
        free = _run("im2col_tiles", x, w, b, **attrs)
        tight = _run("im2col_tiles", x, w, b, limit, **attrs)
    assert [(k0, k1) for *_, k0, k1 in free.tiling.grid] == [(0, 1152), (1152, 2304)]
    assert [(k0, k1) for *_, k0, k1 in tight.tiling.grid] == [(0, 2304)] * 2
    assert [(i0, i1) for _, _, i0, i1, _, _ in tight.tiling.grid] == list(gemm.row_ranges(256, 2))
    assert tight.tiling.chunk == 4 and tight.workspace_size <= limit
    _check(free, ref)
    _check(tight, ref)


@pytest.mark.parametrize(
    "n, oh, ow, oc, parts, c, taps, split",
    [
        (1, 28, 28, 128, 2, 64, 9, "rows"),  # 392 pixels a part
        (3, 5, 7, 64, 2, 64, 9, "rows"),  # 105 pixels in all, but 52 and 53 a part: too few; input channels
        (1, 14, 14, 256, 2, 256, 9, "k"),  # 98 pixels a part: 128 input channels (1152 unfolded rows) each
        (1, 7, 7, 512, 3, 91, 9, "k"),  # 819 unfolded rows: whole channels, 30-31 a part (>= 256 rows each)
        (1, 7, 7, 512, 2, 11, 49, "oc"),  # 539 unfolded rows, but 5 of the 11 channels are 245 rows: not split
        (1, 9, 9, 50, 2, 5, 9, "oc"),  # 45 unfolded rows: too few to split, output channels instead
        (1, 7, 7, 8, 2, 5, 9, "rows"),  # neither splits: output rows after all
    ],
)
def test_tiles_grid_splits(n: int, oh: int, ow: int, oc: int, parts: int, c: int, taps: int, split: str) -> None:
    """Parts over output rows where each gets 128 pixels, else over whole input channels (each part >= SPLIT_K_MIN
    unfolded rows), else over output channels; the blocks cover the output and the unfolded rows exactly."""
    kc = c * taps
    grid = tiles_grid(n, oh, ow, oc, parts, kc, taps)
    if split == "rows" and n * oh * ow < parts * 128:
        split = "k" if c // parts * taps >= SPLIT_K_MIN else "rows"
    rows = {(r0, r1) for r0, r1, *_ in grid}
    chans = {(i0, i1) for _, _, i0, i1, _, _ in grid}
    ks = sorted((k0, k1) for *_, k0, k1 in grid)
    if split == "rows":
        assert chans == {(0, oc)} and ks == [(0, kc)] * len(grid) and sum(r1 - r0 for r0, r1 in rows) == n * oh
    elif split == "k":
        assert len(grid) == parts and rows == {(0, n * oh)} and chans == {(0, oc)}
        assert ks[0][0] == 0 and ks[-1][1] == kc and all(a[1] == b[0] for a, b in zip(ks, ks[1:], strict=False))
        assert all(k0 % taps == 0 and k1 - k0 >= SPLIT_K_MIN for k0, k1 in ks)
    else:
        assert rows == {(0, n * oh)} and ks == [(0, kc)] * len(grid)
        assert sum(i1 - i0 for i0, i1 in chans) == oc and len(chans) == parts


@needs_tiles
@pytest.mark.parametrize("c, stride", [(64, 2), (128, 1)])
def test_conv2d_im2col_tiles_deeper_k_blocks_only_where_the_limit_leaves_tiles_whole(
    c: int, stride: int, rng: np.random.Generator
) -> None:
    """k blocks of up to ``TILE_K_WHOLE`` unfolded rows (64 x 9 = 576 whole, 128 x 9 = 1152 in two of 576) where the
    tiles fit the limit as wide as unlimited; under a limit that would make them narrower, blocks of up to
    ``TILE_K`` (288, 384) and tiles as wide as fit. Correct either way, every byte reported touched."""
    x = _x(rng, (1, c, 24, 24), False)
    w = (rng.standard_normal((20, c, 3, 3)) * 0.1).astype(np.float32)
    b = rng.standard_normal(20).astype(np.float32)
    attrs = dict(stride=stride, padding=1)
    ref = reference(x, w, b, **attrs)
    kc = c * 9
    with num_threads(1):
        whole = _run("im2col_tiles", x, w, b, **attrs)
        assert whole.tiling.kblock == 576 and whole.tiling.grid == ((0, whole.tiling.oh, 0, 20, 0, kc),)
        _check(whole, ref)
        at_limit = _run("im2col_tiles", x, w, b, limit=whole.workspace_size, **attrs)
        assert at_limit.tiling == whole.tiling
        tight = _run("im2col_tiles", x, w, b, limit=whole.workspace_size - 1, **attrs)
    t = tight.tiling
    assert t.kblock == {576: 288, 1152: 384}[kc] and tight.workspace_size < whole.workspace_size
    assert t.chunk * t.ow * t.kblock <= conv_op.TILE_FLOATS
    _check(tight, ref)


@needs_tiles
@pytest.mark.parametrize(
    ("c", "hw", "k", "stride", "pad", "chunk"),
    [
        (3, (64, 64), (7, 7), (2, 2), (3, 3), (27, 27)),  # 147-row k blocks: 891 pixels, 27 of 32 rows 32 wide
        (3, (40, 200), (7, 7), (2, 2), (3, 3), (8, 8)),  # 100-wide output rows: 8 of them (800 pixels), 3 tiles
        # 576 rows in one k block (``TILE_K_WHOLE``): 227 pixels, 7 rows of 30; 4 where a zmm FMA is two passes
        (64, (30, 30), (3, 3), (1, 1), (1, 1), (7, 4)),
    ],
)
def test_conv2d_im2col_tiles_budget(
    half_width: bool,
    c: int,
    hw: tuple[int, int],
    k: tuple[int, int],
    stride: tuple[int, int],
    pad: tuple[int, int],
    chunk: tuple[int, int],
    rng: np.random.Generator,
) -> None:
    """A tile holds up to ``TILE_FLOATS`` floats: the fewer unfolded rows a k block has, the more output rows a tile
    takes (a stem's 147 rows: 891 pixels, where 256 used to be the most), and the workspace follows; the rows are
    the count that wastes the least of the GEMM's panels (``tile_rows``), which depends on the host's FMA width."""
    x = _x(rng, (1, c) + hw, False)
    w = (rng.standard_normal((16, c) + k) * 0.2).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    attrs = dict(stride=stride, padding=pad)
    ref = reference(x, w, b, **attrs)
    with num_threads(1):
        r = _run("im2col_tiles", x, w, b, **attrs)
    t = r.tiling
    assert t.chunk == chunk[half_width] == tile_rows(t.oh, t.ow, conv_op.TILE_FLOATS // t.kblock)
    assert t.chunk * t.ow * t.kblock <= conv_op.TILE_FLOATS
    assert r.workspace_size >= t.kblock * t.chunk * t.ow * 4  # one tile (the phases' area after it)
    _check(r, ref)


@needs_tiles
@pytest.mark.parametrize(
    "n, c, oc, hw, k, stride, pad, threads, most, images, bias",
    [
        (8, 16, 24, (14, 14), 3, 2, 1, 2, 256, 4, True),  # 7x7 outputs, phases: 4 images a part, one tile each
        (7, 16, 24, (7, 7), 3, 1, 1, 2, 256, 3, True),  # planes; parts of 25 and 24 rows: 3 whole images, a crop
        (3, 5, 20, (6, 6), 3, 1, 0, 1, 256, 3, False),  # row-by-row unfold (OW < W), one part of 3 images
        (6, 5, 18, (16, 16), 3, 2, 0, 2, 256, 3, True),  # stride 2, ceil(W/2) > OW: no phases, 3 images a part
        (4, 64, 40, (7, 7), 3, 1, 1, 2, 256, 4, True),  # input channels split: partial outputs of 4-image tiles
        (4, 6, 48, (5, 5), 3, 1, 1, 2, 256, 4, True),  # output channels split: stages of 24 rows
        (4, 6, 34, (5, 5), 3, 1, 1, 2, 256, 4, True),  # split 18 / 16: the last stage ends with its last row
        (2, 52, 34, (5, 5), 3, 2, 1, 2, 256, 2, False),  # the same through the phases
        (10, 7, 12, (5, 5), 3, 1, 1, 1, 256, 4, True),  # at most TILE_IMAGES: tiles of 4, 4 and 2 images
        (8, 16, 24, (14, 14), 3, 2, 1, 2, 120, 2, False),  # 120 pixels a tile: 2 images, twice a part
    ],
)
def test_conv2d_im2col_tiles_of_several_images(
    n: int,
    c: int,
    oc: int,
    hw: tuple[int, int],
    k: int,
    stride: int,
    pad: int,
    threads: int,
    most: int,
    images: int,
    bias: bool,
    rng: np.random.Generator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tiles of whole images take as many as a part's rows hold (up to the tile's pixels and ``TILE_IMAGES``):
    one GEMM into the part's stage, then copied into each image's output with the bias; crops of an image in a
    part's range go straight to out. Every output is written once and checked; the workspace is the parts' phase
    areas, tiles and stages (then the partial outputs), all touched, nothing past it."""
    x = _x(rng, (n, c) + hw, False)
    w = (rng.standard_normal((oc, c, k, k)) * 0.2).astype(np.float32)
    b = rng.standard_normal(oc).astype(np.float32) if bias else None
    attrs = dict(stride=stride, padding=pad)
    ref = reference(x, w, b, **attrs)
    oh, ow = ((hw[i] + 2 * pad - k) // stride + 1 for i in (0, 1))
    kc = c * k * k
    grid = tiles_grid(n, oh, ow, oc, threads, kc, k * k)
    kblock = grid_kblock(grid, kc)
    monkeypatch.setattr(conv_op, "TILE_FLOATS", most * kblock)
    with num_threads(threads):
        r = _run("im2col_tiles", x, w, b, **attrs)
    t = r.tiling
    assert (t.chunk, t.tile_n, t.grid) == (oh, images, grid)
    width = -(-images * oh * ow // 16) * 16
    stages = sum(i1 - i0 for _, _, i0, i1, _, _ in grid) * width  # each part's own output channels
    steps = min(c, max(1, 64 // (k * k)))  # unfold_images' channels a step
    area = images * -(-(32 + 4 * steps * (oh + (k - 1 - pad) // 2 - (-pad) // 2) * ow) // 16) * 16 if t.phases else 0
    sums = sum(1 for *_, k0, _ in grid if k0 > 0) * -(-n * oc * oh * ow * 4 // 64) * 64
    assert r.workspace_size == (t.parts * (t.kblock * width + area) + stages) * 4 + sums
    _check(r, ref)


@needs_tiles
@pytest.mark.parametrize("half_width", [False, True])
@pytest.mark.parametrize("side", [44, 46])
def test_conv2d_im2col_tiles_wide_images_one_a_tile(
    side: int, half_width: bool, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole images of ``IM2COL_WIDE_IMAGE`` pixels or more take one image a tile (the GEMM writes out, no stage),
    however many the tile's pixels would hold; smaller ones up to ``TILE_IMAGES``: 4 images of 1x1 stride 2, whose
    output is 22^2 = 484 or 23^2 = 529 pixels. Whether or not a zmm FMA is two passes (``half_width``): there
    ``tile_rows`` alone prefers 21 rows of 22 (``conv._tile_choices``)."""
    monkeypatch.setattr(gemm, "half_width_fma", lambda: half_width)
    clear_cache()  # plans made under the other width must not be reused
    x = _x(rng, (4, 8, side, side), False)
    w = rng.standard_normal((16, 8, 1, 1)).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    attrs = dict(stride=2, padding=0)
    with num_threads(1):
        r = _run("im2col_tiles", x, w, b, **attrs)
    clear_cache()
    pixels = (side // 2) ** 2
    assert r.tiling.chunk == side // 2
    assert r.tiling.tile_n == (1 if pixels >= conv_op.IM2COL_WIDE_IMAGE else conv_op.TILE_IMAGES)
    _check(r, reference(x, w, b, **attrs))


@needs_tiles
def test_conv2d_im2col_tiles_whole_images_that_do_not_fit_leave_the_row_count(
    rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a zmm FMA is two passes, 4 images of 22^2 a tile rank ahead of ``tile_rows``' 21 rows; under a limit
    that no tile of 2 or more whole images fits, the tiles are of those 21 rows (14.8 KB), not one whole image of 22
    (15.9 KB, more columns wasted), though both fit."""
    monkeypatch.setattr(gemm, "half_width_fma", lambda: True)
    clear_cache()
    x = _x(rng, (4, 8, 44, 44), False)
    w = rng.standard_normal((16, 8, 1, 1)).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    attrs = dict(stride=2, padding=0)
    with num_threads(1):
        r = _run("im2col_tiles", x, w, b, 20000, **attrs)
    clear_cache()
    assert (r.tiling.chunk, r.tiling.tile_n) == (21, 1)
    assert r.workspace_size == 8 * 464 * 4
    _check(r, reference(x, w, b, **attrs))


@needs_tiles
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 9),
    c=st.integers(1, 40),
    oc=st.integers(1, 30),
    h=st.integers(2, 9),
    k=st.sampled_from([1, 2, 3]),
    stride=st.integers(1, 2),
    threads=st.integers(1, 3),
    most=st.sampled_from([16, 50, 100, 256]),
    seed=st.integers(0, 2**31),
)
def test_conv2d_im2col_tiles_of_any_images_and_parts(
    n: int,
    c: int,
    oc: int,
    h: int,
    k: int,
    stride: int,
    threads: int,
    most: int,
    seed: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Any batch, parts and tile budget: the parts' ranges of output rows start and end anywhere in an image, and
    each tile is whole images (up to ``tile_n``) or rows of one; every output written once, as the reference."""
    rng = np.random.default_rng(seed)
    x = _x(rng, (n, c, h, h + 1), False)
    w = (rng.standard_normal((oc, c, k, k)) * 0.2).astype(np.float32)
    b = rng.standard_normal(oc).astype(np.float32)
    attrs = dict(stride=stride, padding=k // 2)
    oh, ow = ((size + 2 * (k // 2) - k) // stride + 1 for size in (h, h + 1))
    kblock = grid_kblock(tiles_grid(n, oh, ow, oc, threads, c * k * k, k * k), c * k * k)
    monkeypatch.setattr(conv_op, "TILE_FLOATS", most * kblock)
    clear_cache()
    with num_threads(threads):
        r = _run("im2col_tiles", x, w, b, **attrs)
    assert r.tiling.tile_n == 1 or r.tiling.chunk == oh
    _check(r, reference(x, w, b, **attrs))


@needs_tiles
def test_conv2d_im2col_tiles_strided_input_and_limits(rng: np.random.Generator) -> None:
    """An input whose rows are not dense (every other column of a wider array) takes the row-by-row unfold, no
    phases. A dense one takes the phases; a limit just below them drops the phases and keeps the tiles' width, lower
    ones take one image a tile, then fewer output rows, and one below a tile of one output row leaves the tiles
    out."""
    wide = _x(rng, (2, 6, 14, 30), False)
    xt = wide[:, :, :, ::2]  # run_checked keeps a numpy view's strides
    x = np.ascontiguousarray(xt)
    w = rng.standard_normal((24, 6, 3, 3)).astype(np.float32)
    attrs = dict(stride=(2, 2), padding=(1, 1))
    ref = reference(x, w, None, **attrs)
    with num_threads(2):
        strided = _run("im2col_tiles", xt, w, None, **attrs)
        assert not strided.tiling.phases
        _check(strided, ref)
        full = _run("im2col_tiles", x, w, None, **attrs)
        assert full.tiling.phases
        _check(full, ref)
        tiles = _run("im2col_tiles", x, w, None, limit=full.workspace_size - 1, **attrs)
        assert not tiles.tiling.phases and tiles.tiling.chunk == full.tiling.chunk
        assert tiles.workspace_size == strided.workspace_size < full.workspace_size
        _check(tiles, ref)
        assert full.tiling.tile_n == tiles.tiling.tile_n == 2  # each part holds both images' output rows
        narrow = tiles
        while narrow.tiling.chunk == full.tiling.chunk:  # lower limits: one image a tile, then fewer rows
            smaller = _run("im2col_tiles", x, w, None, limit=narrow.workspace_size - 1, **attrs)
            assert smaller.workspace_size < narrow.workspace_size
            assert smaller.tiling.tile_n == 1 or smaller.tiling.chunk == full.tiling.chunk
            _check(smaller, ref)
            narrow = smaller
        assert narrow.tiling.tile_n == 1
        one_row = 2 * 54 * 16 * 4  # 2 parts x 54 unfolded rows x one 8-pixel output row padded to 16
        with pytest.raises(ParamError):
            _run("im2col_tiles", x, w, None, limit=one_row - 1, **attrs)


@needs_tiles
def test_conv2d_im2col_tiles_planes_in_place_only_when_flat(rng: np.random.Generator) -> None:
    """The stride-1 unfold reads the input planes in place where their rows lie back to back, also in a channel
    slice of a wider tensor; a crop of wider rows, or rows not dense, take the row-by-row unfold. Each is checked
    against the reference."""
    wide = _x(rng, (2, 10, 11, 26), False)
    w = rng.standard_normal((24, 6, 3, 3)).astype(np.float32)
    b = rng.standard_normal(24).astype(np.float32)
    cases = [
        (np.ascontiguousarray(wide[:, :6, :, :13]), True),
        (wide[:, 2:8], True),  # planes of 11 x 26 floats, channels 286 apart: still each one flat run
        (wide[:, :6, :, :13], False),  # rows 26 apart: a crop
        (wide[:, :6, :, ::2], False),  # rows not dense
    ]
    with num_threads(2):
        for x, flat in cases:
            r = _run("im2col_tiles", x, w, b, stride=1, padding=1)
            assert r.tiling.flat == flat
            _check(r, reference(np.ascontiguousarray(x), w, b, stride=1, padding=1))


@needs_tiles
@pytest.mark.parametrize(
    "shape, k, stride, first",
    [
        ((1, 64, 56, 56), 3, 2, True),  # 28x28 outputs: 4-row tiles of 112 pixels fill 7 panels
        ((1, 128, 28, 28), 3, 2, True),  # 14x14 outputs: 196 pixels of 208 columns' work (a last panel of 16)
        ((1, 256, 14, 14), 3, 2, True),  # 7x7 outputs: 49 pixels of 64 (or 56) columns' work, but one image of 58 M
        # two images, each part half the input channels of both: tiles of two images, 98 pixels of 112 columns' work
        ((2, 256, 14, 14), 3, 2, True),
        # one image of 225 K multiply-adds: 49 pixels of 56 columns' work where a zmm FMA is two passes (0.875: the
        # tiles first), else 64 (im2col first)
        ((1, 16, 14, 14), 3, 2, None),
        ((1, 8, 5, 5), 3, 2, False),  # 3x3 outputs: 9 of 16 columns, 10 K multiply-adds: im2col + BLAS ranks first
        ((1, 64, 56, 56), 1, 2, True),
    ],
)
def test_conv2d_im2col_tiles_rank(
    half_width: bool, shape: tuple[int, ...], k: int, stride: int, first: bool | None
) -> None:
    oc = 2 * shape[1]
    x = device("cpu").empty(shape, np.float32)
    w = device("cpu").empty((oc, shape[1], k, k), np.float32)
    _, ex = conv2d.get_workspace_size(x, w, None, stride=stride, padding=k // 2)
    assert (ex.implementation == "im2col_tiles") == (half_width if first is None else first)
    ex.destroy()


def _implicit_workspace(
    oh: int, ow: int, k: tuple[int, int], stride: tuple[int, int], pad: tuple[int, int], dil: tuple[int, int], t: Any
) -> int:
    """The implicit GEMM's workspace by its formula: per part, the planes of a k block's channels (sh x sw each, of
    chunk + the window's row reach rows by OW + its column reach) and 16 guard floats, a multiple of 16 floats."""
    reach = []  # phase rows (columns) a window reaches beyond its output row's (column's)
    for i in (0, 1):
        offs = [(j * dil[i] - pad[i]) // stride[i] for j in range(k[i])]
        reach.append(max(offs) - min(offs))
    channels = t.kblock // (k[0] * k[1])
    floats = channels * stride[0] * stride[1] * (t.chunk + reach[0]) * (ow + reach[1]) + 16
    return len(t.grid) * -(-floats // 16) * 16 * 4


@needs_tiles
@pytest.mark.parametrize(
    "n, c, oc, hw, k, stride, pad, dil, threads, budget, bias",
    [
        (1, 3, 8, (32, 32), (7, 7), (2, 2), (3, 3), (1, 1), 2, 1 << 16, True),  # a stem: 4 phases a channel
        (3, 5, 7, (11, 13), (3, 3), (2, 1), (1, 0), (1, 2), 2, 600, False),  # short chunks, parts split images
        (1, 70, 13, (9, 9), (3, 3), (2, 2), (1, 1), (1, 1), 1, 1 << 16, True),  # k blocks of 56 and 14 channels
        (2, 4, 20, (7, 40), (2, 5), (1, 1), (0, 2), (1, 1), 3, 300, True),  # 3 parts, a wide window, 1 phase
        (2, 6, 9, (12, 12), (3, 3), (1, 1), (2, 2), (2, 2), 2, 1 << 16, False),  # dilated
        (1, 2, 70, (6, 150), (3, 3), (1, 2), (1, 1), (1, 1), 2, 1 << 16, True),  # 75 columns: a 64 and a masked 16
    ],
)
def test_conv2d_implicit(
    n: int,
    c: int,
    oc: int,
    hw: tuple[int, int],
    k: tuple[int, int],
    stride: tuple[int, int],
    pad: tuple[int, int],
    dil: tuple[int, int],
    threads: int,
    budget: int,
    bias: bool,
    rng: np.random.Generator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The implicit GEMM: parts over the output rows of all images stacked, chunks of the most output rows whose
    planes fit ``IMPLICIT_FLOATS``, k blocks of whole channels (at most 512 unfolded rows); each output row one GEMM
    reading its unfolded rows from the planes by offset. Every output written once and checked; the workspace is
    the formula's, all touched, nothing past it."""
    x = _x(rng, (n, c) + hw, False)
    w = (rng.standard_normal((oc, c) + k) * 0.2).astype(np.float32)
    b = rng.standard_normal(oc).astype(np.float32) if bias else None
    attrs = dict(stride=stride, padding=pad, dilation=dil)
    ref = reference(x, w, b, **attrs)
    oh, ow = ref.shape[2:]
    monkeypatch.setattr(conv_op, "IMPLICIT_FLOATS", budget)
    with num_threads(threads):
        r = _run("implicit", x, w, b, **attrs)
    t = r.tiling
    taps = k[0] * k[1]
    assert t.kblock == min(c, 512 // taps) * taps
    assert [(r0, r1) for r0, r1, *_ in t.grid] == [(r0, r1) for r0, r1 in split_range(n * oh, threads)]
    assert 1 <= t.chunk <= oh
    assert r.workspace_size == _implicit_workspace(oh, ow, k, stride, pad, dil, t)
    if t.chunk > 1:  # the most rows within the budget (one row whatever it is)
        assert r.workspace_size // len(t.grid) <= budget * 4
    _check(r, ref)


@needs_tiles
def test_conv2d_implicit_fits_workspace_limit(rng: np.random.Generator) -> None:
    """Lower limits take chunks of fewer output rows, then k blocks of fewer channels; one below a row of one
    channel leaves the implicit GEMM out."""
    x = _x(rng, (2, 9, 20, 24), False)
    w = rng.standard_normal((12, 9, 3, 3)).astype(np.float32)
    b = rng.standard_normal(12).astype(np.float32)
    attrs = dict(stride=2, padding=1)
    ref = reference(x, w, b, **attrs)
    with num_threads(2):
        r = _run("implicit", x, w, b, **attrs)
        seen = [(r.tiling.kblock, r.tiling.chunk)]
        _check(r, ref)
        while (r.tiling.kblock, r.tiling.chunk) != (9, 1):
            smaller = _run("implicit", x, w, b, limit=r.workspace_size - 1, **attrs)
            assert smaller.workspace_size < r.workspace_size
            assert smaller.tiling.kblock <= r.tiling.kblock
            _check(smaller, ref)
            r = smaller
            seen.append((r.tiling.kblock, r.tiling.chunk))
        assert seen[0] == (81, 10) and seen[-1] == (9, 1) and len(seen) > 4
        one = 2 * -(-(4 * 2 * 13 + 16) // 16) * 16 * 4  # 2 parts x one channel's 4 planes of 2 rows x 13 columns
        assert r.workspace_size == one
        with pytest.raises(ParamError):
            _run("implicit", x, w, b, limit=one - 1, **attrs)


@needs_tiles
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 4),
    c=st.integers(1, 12),
    oc=st.integers(1, 20),
    h=st.integers(1, 12),
    w=st.integers(1, 40),
    k=st.tuples(st.integers(1, 5), st.integers(1, 5)),
    stride=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    pad=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    dil=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    threads=st.integers(1, 3),
    budget=st.sampled_from([64, 500, 1 << 16]),
    seed=st.integers(0, 2**31),
)
def test_conv2d_implicit_any_geometry(
    n: int,
    c: int,
    oc: int,
    h: int,
    w: int,
    k: tuple[int, int],
    stride: tuple[int, int],
    pad: tuple[int, int],
    dil: tuple[int, int],
    threads: int,
    budget: int,
    seed: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Any window, stride 1 or 2 per dim, padding and dilation, batch, parts and chunk budget: the planes' reach
    and the offsets cover every tap, padding read as 0; every output written once, as the reference."""
    case = _case(seed, n, c, oc, 1, h, w, k, stride, pad, dil, True, False)
    if case is None:
        return
    x, wt, b, attrs, ref = case
    monkeypatch.setattr(conv_op, "IMPLICIT_FLOATS", budget)
    clear_cache()
    with num_threads(threads):
        r = _run("implicit", x, wt, b, **attrs)
    assert r.workspace_size == _implicit_workspace(*ref.shape[2:], k, stride, pad, dil, r.tiling)
    _check(r, ref)


@needs_tiles
def test_conv2d_implicit_reads_views_with_dense_rows(rng: np.random.Generator) -> None:
    """The planes are copied from the input's rows where they lie: a channel slice, a crop of wider rows or of
    fewer rows of a wider tensor, each checked at stride 1 and 2; rows not dense leave the implicit GEMM out."""
    wide = _x(rng, (2, 10, 13, 30), False)
    w = rng.standard_normal((9, 6, 3, 3)).astype(np.float32)
    b = rng.standard_normal(9).astype(np.float32)
    with num_threads(2):
        for x in (wide[:, 2:8], wide[:, 2:8, :, 3:20], wide[:, 2:8, 1:12]):
            for stride in (1, 2):
                r = _run("implicit", x, w, b, stride=stride, padding=1)
                _check(r, reference(np.ascontiguousarray(x), w, b, stride=stride, padding=1))
        with pytest.raises(ParamError, match="implementation"):
            _run("implicit", wide[:, 2:8, :, ::2], w, b, stride=1, padding=1)


@needs_tiles
@pytest.mark.parametrize(
    "shape, oc, k, stride, want",
    [
        ((1, 3, 224, 224), 64, 7, 2, "implicit"),  # ResNet's stem: 112-pixel rows, 147 unfolded rows
        ((2, 16, 112, 112), 32, 3, 2, "implicit"),  # 56-pixel rows: one 56-column panel on Zen 4, else 0.875
        ((1, 64, 56, 56), 128, 3, 2, "im2col_tiles"),  # 28-pixel rows: a masked 32-column panel each
        ((1, 64, 112, 112), 128, 1, 2, "im2col_tiles"),  # a 1x1 window reads one of the four phases
        ((1, 64, 56, 56), 64, 3, 1, "winograd4"),
    ],
)
def test_conv2d_implicit_rank(
    half_width: bool, shape: tuple[int, ...], oc: int, k: int, stride: int, want: str
) -> None:
    x = device("cpu").empty(shape, np.float32)
    w = device("cpu").empty((oc, shape[1], k, k), np.float32)
    _, ex = conv2d.get_workspace_size(x, w, None, stride=stride, padding=k // 2)
    if shape[1] == 16 and not half_width:
        want = "im2col_tiles"
    assert ex.implementation == want
    ex.destroy()


@pytest.mark.usefixtures("ymm_heads")  # the 8-lane kernels, as phase 1 has them on AVX2
@pytest.mark.parametrize(
    "shape, oc, k, stride, want",
    [
        ((1, 3, 224, 224), 64, 7, 2, "implicit"),  # ResNet's stem
        ((1, 32, 64, 64), 32, 5, 1, "implicit"),  # 32 channels: still first
        ((1, 64, 224, 224), 64, 3, 2, "im2col_tiles"),  # 112-pixel rows, but 64 channels
        ((1, 64, 56, 56), 128, 3, 2, "im2col_tiles"),
    ],
)
def test_conv2d_implicit_rank_on_8_lanes(shape: tuple[int, ...], oc: int, k: int, stride: int, want: str) -> None:
    """On the 8-lane kernels the implicit GEMM ranks first only for inputs of ``IMPLICIT_YMM_MAX_C`` channels or
    fewer, and last otherwise: a limit that im2col_tiles fits still takes im2col_tiles."""
    x = device("cpu").empty(shape, np.float32)
    w = device("cpu").empty((oc, shape[1], k, k), np.float32)
    for limit in (None, 256 << 10):
        _, ex = conv2d.get_workspace_size(x, w, None, stride=stride, padding=k // 2, workspace_limit=limit)
        assert ex.implementation == want, limit
        ex.destroy()


@needs_tiles
@pytest.mark.parametrize("impl", ["im2col_tiles", "implicit"])
def test_conv2d_im2col_tiles_into_a_channel_slice(dev: Any, rng: np.random.Generator, impl: str) -> None:
    """The output a range of channels of a wider NCHW tensor (a concat target): written through its image and
    channel strides, the channels around it untouched."""
    x = _x(rng, (2, 8, 13, 13), False)
    w = rng.standard_normal((40, 8, 3, 3)).astype(np.float32)
    b = rng.standard_normal(40).astype(np.float32)
    big = dev.tensor(np.full((2, 45, 7, 7), 7.0, np.float32))
    out = big.strided((2, 40, 7, 7), (45 * 49, 49, 7, 1), 2 * 49)
    with forced(impl):
        r = run_checked(conv2d, x, w, b, out=out, stride=2, padding=1)
    assert r.implementation == impl
    full = big.numpy()
    np.testing.assert_allclose(full[:, 2:42], reference(x, w, b, stride=2, padding=1), rtol=1e-4, atol=1e-4)
    assert (full[:, :2] == 7.0).all() and (full[:, 42:] == 7.0).all()


@contextlib.contextmanager
def _parts_on_small_maps() -> Iterator[None]:
    """im2col_parts' thresholds (map size, work in all and per unit) off, so the small maps of a test take it."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("PARTS_MIN_PIXELS", "PARTS_MIN_MACS", "PARTS_MIN_UNIT_MACS"):
            mp.setattr(conv_op, name, 0)
        yield


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 3),
    cg=st.integers(1, 3),
    ocg=st.integers(1, 4),
    groups=st.integers(1, 2),
    h=st.integers(3, 12),
    w=st.integers(3, 12),
    k=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    stride=st.tuples(st.integers(1, 3), st.integers(1, 2)),
    pad=st.tuples(st.integers(0, 2), st.integers(0, 1)),
    dil=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    bias=st.booleans(),
    nhwc=st.booleans(),
    threads=st.integers(2, 5),
    one_row=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_conv2d_im2col_parts(
    n: int,
    cg: int,
    ocg: int,
    groups: int,
    h: int,
    w: int,
    k: tuple[int, int],
    stride: tuple[int, int],
    pad: tuple[int, int],
    dil: tuple[int, int],
    bias: bool,
    nhwc: bool,
    threads: int,
    one_row: bool,
    seed: int,
) -> None:
    """Parts over the stacked output rows of all (image, group) planes, runs cut at plane boundaries, each part
    its own unfold area and one-thread GEMM: every output written once (with the bias), NCHW and NHWC, and the
    workspace exactly the parts' areas, each sized for its longest run (so the last byte is used); a limit of
    one row per part narrows the runs to one row."""
    case = _case(seed, n, cg, ocg, groups, h, w, k, stride, pad, dil, bias, nhwc)
    if case is None:
        return
    x, wt, b, attrs, ref = case
    oh, ow = ref.shape[1:3] if nhwc else ref.shape[2:]
    parts = min(threads, n * groups * oh)
    if parts < 2:  # one output row in all: nothing to share
        with _parts_on_small_maps(), num_threads(threads), pytest.raises(ParamError, match="implementation"):
            _run("im2col_parts", _input(x, nhwc), wt, b, **attrs)
        return
    limit = parts * align(cg * k[0] * k[1] * ow * 4) if one_row else None
    with _parts_on_small_maps(), num_threads(threads):
        r = _run("im2col_parts", _input(x, nhwc), wt, b, limit=limit, **attrs)
    t = r.tiling
    assert (r.implementation, t.parts) == ("im2col_parts", parts)
    assert nhwc or t.flat == (stride == (1, 1) and ow == w)  # NCHW "same" stride 1: planes read in place
    longest = [max(u[3] for u in units) for units in parts_units(t)]
    assert t.tile_rows == max(longest)
    kc = cg * k[0] * k[1]
    if one_row:  # two rows only where their area rounds up to the same cache lines as one
        assert r.workspace_size <= limit and (t.tile_rows == 1 or align(kc * 2 * ow * 4) == align(kc * ow * 4))
    assert r.workspace_size == sum(align(kc * rows * ow * 4) for rows in longest)
    _check(r, ref)


@pytest.mark.parametrize(
    "n, groups, oh, rows, parts",
    [
        (1, 1, 112, 18, 2),  # the stem: 56 rows a part, in runs of 14 (not 18, 18, 18, 2)
        (3, 2, 7, 3, 4),  # 42 stacked rows: ranges cross planes, each piece cut on its own
        (8, 1, 28, 28, 2),  # whole images: 4 a part
        (1, 1, 5, 5, 5),  # a row a part
    ],
)
def test_parts_units_cover_every_output_row_once(n: int, groups: int, oh: int, rows: int, parts: int) -> None:
    """im2col_parts' units: each (image, group, row) exactly once, a part's units contiguous in stacked order,
    the parts' row counts at most one apart, no run longer than tile_rows or crossing a plane, and the runs of a
    plane's piece at most one row apart."""
    t = conv_op.ConvTiling(
        n, 1, oh, 4, groups, oh, 4, 1, 1, 1, 1, 0, 0, 1, 1, groups, 1, 1, 1, 1, "cm", rows, False, parts=parts
    )
    units = parts_units(t)
    assert len(units) == parts
    stacked = [((u[0] * groups + u[1]) * oh + u[2], u[3]) for part in units for u in part]
    at = 0
    for start, length in stacked:
        assert start == at and 1 <= length <= rows and (start % oh) + length <= oh
        at += length
    assert at == n * groups * oh
    sizes = [sum(u[3] for u in part) for part in units]
    assert max(sizes) - min(sizes) <= 1
    if (n, groups, oh, rows, parts) == (1, 1, 112, 18, 2):
        assert [u[3] for u in units[0]] == [14] * 4
    assert parts_areas(t, units, 4)[-1] == sum(align(max(u[3] for u in part) * 4 * 4) for part in units)


@pytest.mark.parametrize(
    "shape, w_shape, attrs, threads, limit, impl",
    [
        ((8, 64, 56, 56), (128, 64, 3, 3), dict(stride=2, padding=1), 2, None, "im2col_parts"),
        ((1, 3, 224, 224), (64, 3, 7, 7), dict(stride=2, padding=3), 2, None, "im2col_parts"),  # the stem
        ((8, 64, 56, 56), (128, 64, 3, 3), dict(stride=2, padding=1), 1, None, "im2col"),  # no helper thread
        ((1, 64, 56, 56), (128, 64, 1, 1), dict(stride=2), 2, None, "im2col"),  # 6.4 M multiply-adds in all
        ((8, 256, 28, 28), (512, 256, 3, 3), dict(stride=2, padding=1), 2, None, "im2col"),  # 14x14 maps
        ((1, 3, 224, 224), (64, 3, 7, 7), dict(stride=2, padding=3), 2, 1 << 18, "im2col"),  # 1 M a one-row run
    ],
)
def test_conv2d_im2col_parts_rank(
    shape: tuple[int, ...], w_shape: tuple[int, ...], attrs: dict[str, Any], threads: int, limit: int | None, impl: str
) -> None:
    """im2col_parts ranks ahead of im2col with helper threads, maps of 512 pixels or more and enough work in all
    and per run; else im2col."""
    dev = device("cpu")
    x, w = dev.empty(shape, np.float32), dev.empty(w_shape, np.float32)
    with num_threads(threads), forced("im2col_parts", "im2col", "direct"):
        _, ex = conv2d.get_workspace_size(x, w, None, workspace_limit=limit, **attrs)
    assert ex.implementation == impl
    ex.destroy()


@pytest.mark.parametrize("impl", ["im2col", "direct", None])
def test_conv2d_without_input_channels_gives_the_bias(impl: str | None) -> None:
    """C = 0: an empty sum, so the bias alone, through the one-shot API (a zero-size workspace is no workspace)."""
    import twophase

    dev = device("cpu")
    x, w = dev.tensor(np.ones((2, 0, 5, 5), np.float32)), dev.tensor(np.ones((6, 0, 3, 3), np.float32))
    bias = dev.tensor(np.arange(1, 7, dtype=np.float32))
    with forced(impl) if impl else _nothing():
        y = twophase.conv2d(x, w, bias, padding=1).numpy()
    assert y.shape == (2, 6, 5, 5)
    np.testing.assert_array_equal(y, np.broadcast_to(np.arange(1, 7, dtype=np.float32)[:, None, None], y.shape))


def _nothing() -> Any:
    import contextlib

    return contextlib.nullcontext()


def test_conv2d_phase1_stays_cheap_for_a_huge_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Phase 1 listed every output row of im2col_parts' units: a padding of 2**22 took seconds and 2**24 ran out
    of memory, though phase 1 reads metadata only. It now lists at most PARTS_MAX_UNITS units."""
    listed: list[int] = []
    real = conv_op.parts_units

    def counting(t: Any) -> Any:
        units = real(t)
        listed.append(sum(len(p) for p in units))
        return units

    monkeypatch.setattr(conv_op, "parts_units", counting)
    x, w = TensorDesc((1, 3, 5, 5), np.float32), TensorDesc((2, 3, 3, 3), np.float32)
    with num_threads(2):
        for padding in (2**10, 2**18):
            size, ex = conv2d.get_workspace_size(x, w, padding=padding)
            assert ex.output_descs[0].shape == (1, 2, 2 * padding + 3, 2 * padding + 3)
            ex.destroy()
    assert listed and max(listed) <= conv_op.PARTS_MAX_UNITS


@pytest.mark.skipif(not gemm.available(), reason="the float32 microkernel needs AVX-512")
@pytest.mark.parametrize(
    "n, cg, ocg, groups, hw, stride, bias, limit_rows",
    [
        (1, 8, 16, 1, 12, 1, True, None),  # one image: the GEMM writes out's pixels in place, bias after
        (3, 6, 8, 1, 9, 2, False, None),  # several images: the result is staged, then copied
        (2, 4, 5, 2, 10, 1, True, None),  # groups: one GEMM per group, rows of that group's weights
        (1, 8, 16, 1, 12, 1, False, 5),  # a limit: tiles of 5 output rows (60 pixels), the last of 2 (24: BLAS)
    ],
)
def test_im2col_runs_its_gemms_on_the_microkernel_where_phase1_planned_it(
    n: int,
    cg: int,
    ocg: int,
    groups: int,
    hw: int,
    stride: int,
    bias: bool,
    limit_rows: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """im2col's float32 channel-major GEMMs take the register-blocked microkernel for the tile widths phase 1
    gave parts for (``tiling.micro``), BLAS for the others; every tile is checked against the reference."""
    case = _case(7, n, cg, ocg, groups, hw, hw, (3, 3), (stride, stride), (1, 1), (1, 1), bias, False)
    assert case is not None
    x, wt, b, attrs, ref = case
    limit = None
    if limit_rows is not None:
        limit = cg * groups * 9 * ref.shape[3] * 4 * limit_rows
    blas_tiles = []
    plain = conv_kernels._tile_gemm
    monkeypatch.setattr(conv_kernels, "_tile_gemm", lambda *a: (blas_tiles.append(a[1].shape[1]), plain(*a)))
    r = _run("im2col", x, wt, b, limit=limit, **attrs)
    _check(r, ref)
    assert blas_tiles == ([] if limit_rows is None else [(hw % limit_rows) * hw])  # the rest ran on the microkernel
    micro = dict(r.tiling.micro)
    assert micro and any(micro.values())
    if limit_rows is not None:
        assert r.tiling.tile_rows == limit_rows and set(micro) == {limit_rows * hw, (hw % limit_rows) * hw}
        assert micro[(hw % limit_rows) * hw] == () and micro[limit_rows * hw] != ()  # 24 columns: no full panel
    f64 = _run(
        "im2col", x.astype(np.float64), wt.astype(np.float64), None if b is None else b.astype(np.float64), **attrs
    )
    assert f64.tiling.micro == ()  # float64: BLAS
    _check(f64, ref)


@pytest.mark.skipif(not gemm.available(), reason="the float32 microkernel needs AVX-512")
@pytest.mark.parametrize("limit_tiles", [None, 48])
def test_winograd_runs_its_gemms_on_the_microkernel_where_phase1_planned_it(
    limit_tiles: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F(2x2, 3x3)'s 16 GEMMs per round take the float32 microkernel for the round widths ``tiling.micro`` gives
    blocks for, BLAS for the others (a last round of 24 tiles has no full panel); one round of all the tiles fuses
    the weight transform with its GEMMs instead (``fused_rows``). Checked against the reference with guard bytes
    around the workspace."""
    case = _case(11, 2, 6, 8, 1, 11, 12, (3, 3), (1, 1), (1, 1), (1, 1), True, False)
    assert case is not None
    x, wt, b, attrs, ref = case
    tiles = 2 * 6 * 6
    limit = None
    if limit_tiles is not None:
        limit = conv_op.winograd_workspace(8, 6, limit_tiles, 4, 12, 1)
    blas_rounds = []
    plain = conv_kernels.gemm_parts
    monkeypatch.setattr(
        conv_kernels, "gemm_parts", lambda u, v, m, r: (blas_rounds.append(v.shape[2]), plain(u, v, m, r))[1]
    )
    r = _run("winograd", x, wt, b, limit=limit, **attrs)
    _check(r, ref)
    chunk = r.tiling.chunk
    assert chunk == (tiles if limit_tiles is None else limit_tiles)
    micro = dict(r.tiling.micro)
    if limit_tiles is None:  # one round: the fused kernel's GEMMs (gemm_tile), ``micro`` unused
        assert r.tiling.fused_rows > 0 and micro == {} and blas_rounds == []
    else:
        assert micro[chunk] == ((0, 8, 0, chunk),)
        assert micro[tiles % chunk] == () and blas_rounds == [tiles % chunk]  # 72 = 48 + 24


@pytest.mark.usefixtures("microkernel")
@pytest.mark.parametrize(
    ("threads", "most_rows", "oc", "nhwc", "rows"),
    [
        (1, 48, 100, False, 48),  # one part: blocks of 48, 48 and 4 output channels
        (3, 48, 100, False, 34),  # three parts of 34, 33, 33 channels: a block each
        (3, 12, 100, True, 12),  # blocks of 12 and a tail in each part; NHWC
        (2, 6, 7, False, 4),  # parts of 4 and 3 channels
    ],
)
def test_conv2d_winograd_one_round_transforms_the_weights_block_by_block_before_their_gemms(
    threads: int,
    most_rows: int,
    oc: int,
    nhwc: bool,
    rows: int,
    rng: np.random.Generator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One float32 round on the zmm kernels, weights not kept: no U in the workspace, each part transforms
    ``fused_rows`` output channels at a time (at most its share) into scratch of its own before their 16 GEMMs; the
    workspace is exactly that (``winograd_workspace``), smaller than with U whole where the blocks are, and the
    result the reference's."""
    monkeypatch.setattr(conv_op, "WINO_FUSED_ROWS", most_rows)
    monkeypatch.setattr(conv_kernels, "PARALLEL_MIN", 1)  # parts for helper threads even on this small problem
    n, c, h, w = 2, 9, 12, 11
    tiles = n * 6 * 6
    x = _x(rng, (n, c, h, w), nhwc)
    wt, b = rng.standard_normal((oc, c, 3, 3)).astype(np.float32), rng.standard_normal(oc).astype(np.float32)
    with num_threads(threads):
        r = _run("winograd", _input(x, nhwc), wt, b, padding=1)
    t = r.tiling
    parts = min(threads, oc, c, 16)
    assert (t.chunk, t.parts, t.fused_rows, t.own_weights) == (tiles, parts, rows, False)
    assert r.workspace_size == conv_op.winograd_workspace(oc, c, tiles, 4, w, parts, fused_rows=rows)
    if parts * rows < oc:  # blocks of fewer channels than U's
        assert r.workspace_size < conv_op.winograd_workspace(oc, c, tiles, 4, w, parts)
    _check(r, reference(x, wt, b, padding=1, nhwc=nhwc))


@pytest.mark.usefixtures("microkernel")
@pytest.mark.parametrize("why", ["constant_weight", "float64", "tiles", "limit", "no_microkernel"])
def test_conv2d_winograd_transforms_all_of_u_first_where_it_does_not_fuse(
    why: str, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept weights, float64, more than ``WINO_FUSED_MAX_TILES`` tiles, a limit that only rounds of fewer tiles fit
    or a CPU without the zmm kernels (``gemm.available``): U whole in the workspace (or kept by the binding),
    transformed before the GEMMs, and the same results."""
    n, c, oc, h, w = 2, 5, 8, 12, 12
    if why == "no_microkernel":
        monkeypatch.setattr(gemm, "available", lambda: False)
    tiles = n * (h // 2) * (w // 2)
    dtype = np.float64 if why == "float64" else np.float32
    item = np.dtype(dtype).itemsize
    x = _x(rng, (n, c, h, w), False).astype(dtype)
    wt, b = rng.standard_normal((oc, c, 3, 3)).astype(dtype), rng.standard_normal(oc).astype(dtype)
    attrs: dict[str, Any] = {"padding": 1}
    limit, chunk = None, tiles
    if why == "constant_weight":
        attrs["constant_weight"] = True
    if why == "tiles":
        monkeypatch.setattr(conv_op, "WINO_FUSED_MAX_TILES", tiles - 1)
    if why == "limit":
        chunk = 40
        limit = conv_op.winograd_workspace(oc, c, chunk, item, w)
        assert limit < conv_op.winograd_workspace(oc, c, tiles, item, w, fused_rows=oc)
    r = _run("winograd", x, wt, b, limit=limit, **attrs)
    t = r.tiling
    assert (t.chunk, t.fused_rows, t.own_weights) == (chunk, 0, why == "constant_weight")
    assert r.workspace_size == conv_op.winograd_workspace(oc, c, chunk, item, w, 1, why == "constant_weight")
    _check(r, reference(x, wt, b, **attrs))


@pytest.mark.usefixtures("microkernel")
@pytest.mark.parametrize("nt", [40, 45, 49])
def test_wino_fused_gemms_against_the_transformed_weights_matmul(nt: int, rng: np.random.Generator) -> None:
    """The kernel alone, over the output channels of one part (oc0 > 0, a tail block): M's rows of that range equal
    U @ V with U from ``wino_weights``, every other row of M untouched, the scratch rows no wider than ``rows``
    channels' weights. V lies in a larger buffer as in the workspace (``gemm_tile`` may read its rows up to the
    next multiple of 16 columns), the floats past it NaN: none of them reaches M."""
    oc, c, rows, (oc0, oc1) = 20, 7, 6, (5, 18)
    w = rng.standard_normal((oc, c, 3, 3)).astype(np.float32)
    u = np.empty((16, oc * c), np.float32)
    conv_kernels.wino_weights(w, u, 0, oc)
    area = np.full(16 * c * nt + 16, np.nan, np.float32)
    v = area[: 16 * c * nt].reshape(16, c, nt)
    v[:] = rng.standard_normal((16, c, nt))
    m = np.full((16, oc, nt), np.nan, np.float32)
    us = np.full((16, rows * c + 16), np.nan, np.float32)
    conv_kernels.wino_fused_gemms(w, us, conv_kernels.matrices(us, rows, c), v, m, oc0, oc1, rows)
    want = np.einsum("koc,kct->kot", u.reshape(16, oc, c).astype(np.float64), v.astype(np.float64))
    np.testing.assert_allclose(m[:, oc0:oc1], want[:, oc0:oc1], rtol=1e-5, atol=1e-5)
    assert np.isnan(m[:, :oc0]).all() and np.isnan(m[:, oc1:]).all()
    assert np.isnan(us[:, rows * c :]).all()


@pytest.mark.skipif(not gemm.available(), reason="the float32 microkernel needs AVX-512")
def test_winograd4_runs_its_gemms_on_the_microkernel_where_phase1_planned_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """F(4x4, 3x3)'s 36 GEMMs per round of images take the float32 microkernel where ``tiling.micro`` says."""
    case = _case(12, 3, 5, 7, 1, 14, 17, (3, 3), (1, 1), (1, 1), (1, 1), True, False)
    assert case is not None
    x, wt, b, attrs, ref = case
    blas_rounds = []
    plain = winograd4.gemm_parts
    monkeypatch.setattr(
        winograd4, "gemm_parts", lambda u, v, m, r: (blas_rounds.append(v.shape[2]), plain(u, v, m, r))[1]
    )
    r = _run("winograd4", x, wt, b, **attrs)
    _check(r, ref)
    th_n, tw_n, _ = winograd4.geometry(14, 17)
    width = 3 * th_n * (tw_n + 1)  # all three images in one round
    assert r.tiling.chunk == 3 and dict(r.tiling.micro) == {width: ((0, 7, 0, width),)} and blas_rounds == []


@pytest.mark.parametrize("oc, c", [(1, 1), (3, 7), (5, 13), (16, 16), (7, 40)])
@pytest.mark.parametrize("dense", [True, False])
def test_wino_weights_against_g_g_gt(oc: int, c: int, dense: bool, rng: np.random.Generator) -> None:
    """The weight transform (16 pairs at a time where the weight is dense float32, the rest pair by pair) against
    G g G^T in float64, over two ranges of output channels as helper threads take them: every element of u written
    once, nothing past OC*C of a row touched, inf taps carried through."""
    g = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
    big = rng.standard_normal((oc, 2 * c, 3, 3)).astype(np.float32)
    w = big[:, ::2] if not dense else np.ascontiguousarray(big[:, ::2])
    want = np.einsum("ia,ocab,jb->ijoc", g, w.astype(np.float64), g).reshape(16, oc * c)
    w[0, 0, 1, 1] = np.inf  # the centre tap reaches the outputs (i, j) with i, j in {1, 2}: k = 5, 6, 9, 10
    u = np.full((16, oc * c + 20), np.nan, np.float32)
    for lo, hi in split_range(oc, 2):
        conv_kernels.wino_weights(w, u, lo, hi)
    centre = [5, 6, 9, 10]
    assert np.isinf(u[centre, 0]).all()
    np.testing.assert_allclose(np.delete(u[:, 0], centre), np.delete(want[:, 0], centre), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(u[:, 1 : oc * c], want[:, 1:], rtol=1e-6, atol=1e-6)
    assert np.isnan(u[:, oc * c :]).all()
