"""cast_copy: float16 <-> float32 copies on the conversion instructions, bit for bit numpy's (NaN payloads aside)."""

from __future__ import annotations

from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from threads import num_threads

from twophase.kernels.cpu import half
from twophase.kernels.cpu.half import FANOUT_ELEMENTS, MIN_ELEMENTS, cast_copy

needs_f16c = pytest.mark.skipif(not half.available(), reason="no F16C: cast_copy is numpy's copy")

# float32 values around float16's edges: its largest finite, the rounding boundary to inf, subnormals and the
# smallest one's halfway points, exact ties (round to even), signed zeros, infinities
EDGES = np.array(
    [
        65504.0,
        65519.0,
        65520.0,
        -65520.0,
        2.0**-14,
        2.0**-24,
        2.0**-25,
        1.5 * 2.0**-25,
        3 * 2.0**-25,
        1.0 + 2.0**-11,
        1.0 + 3 * 2.0**-11,
        0.0,
        -0.0,
        np.inf,
        -np.inf,
        1e-8,
        -1e-30,
        3.0e38,
    ],
    np.float32,
)


def _values(rng: np.random.Generator, size: int) -> np.ndarray[Any, Any]:
    """float32 values over float16's whole range and beyond, every edge included, a NaN among them."""
    v = (rng.standard_normal(size) * 10.0 ** rng.integers(-9, 6, size)).astype(np.float32)
    v[: min(size, EDGES.size)] = EDGES[: min(size, EDGES.size)]
    if size > EDGES.size:
        v[EDGES.size] = np.nan
    return rng.permutation(v)


def _as_half(v: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    with np.errstate(over="ignore"):  # beyond float16's range: inf
        return v.astype(np.float16)


def _same_bits(got: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
    """``got`` bitwise numpy's conversion of ``src`` where that is not NaN, NaN where it is."""
    with np.errstate(over="ignore"):  # float32 beyond float16's range: inf, as ours
        want = src.astype(got.dtype)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    bits = np.uint16 if want.dtype == np.float16 else np.uint32
    assert np.array_equal(got[~nan].view(bits), want[~nan].view(bits))


@needs_f16c
@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    data=st.data(),
    up=st.booleans(),
)
def test_cast_copy_matches_numpy_on_any_strides(shape: list[int], data: Any, up: bool) -> None:
    """Views of any strides (reversed, every other element, transposed), 1-D to 4-D, both directions: the
    destination, poisoned first, holds numpy's conversion of every element."""
    rng = np.random.default_rng(len(shape) * 1000 + sum(shape))
    big = [2 * s for s in shape]
    base = _values(rng, int(np.prod(big))).reshape(big)
    if up:
        base = _as_half(base)
    steps = data.draw(st.lists(st.sampled_from([1, 2, -1, -2]), min_size=len(shape), max_size=len(shape)))
    src = base[tuple(slice(None, None, k) for k in steps)][tuple(slice(0, s) for s in shape)]
    order = data.draw(st.permutations(range(len(shape))))
    src = src.transpose(order)
    dst = np.full(src.shape, np.nan, np.float32 if up else np.float16)
    with mock.patch.object(half, "MIN_ELEMENTS", 1):  # small arrays through the kernel too
        cast_copy(dst, src)
    _same_bits(dst, src)


@needs_f16c
@pytest.mark.parametrize("shape", [(1, FANOUT_ELEMENTS + 37), (3, FANOUT_ELEMENTS // 2), (700, 701)])
@pytest.mark.parametrize("up", [True, False])
def test_cast_copy_in_parts(shape: tuple[int, int], up: bool) -> None:
    """From FANOUT_ELEMENTS elements the copy runs in parts: of rows, of columns where the rows are fewer than the
    parts (one long row), of rows (three rows, and a transposed view); every element written."""
    rng = np.random.default_rng(shape[0])
    src = _values(rng, shape[0] * shape[1]).reshape(shape)
    if up:
        src = _as_half(src)
    if shape[0] == 700:
        src = src.T
    dst = np.full(src.shape, np.nan, np.float32 if up else np.float16)
    with num_threads(2):
        cast_copy(dst, src)
    _same_bits(dst, src)


def test_cast_copy_leaves_other_cases_to_numpy() -> None:
    """Other dtype pairs, broadcasting, overlapping memory and small copies go to np.copyto unchanged."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 100))
    out = np.empty((64, 100), np.float16)
    cast_copy(out, x)  # float64 -> float16
    np.testing.assert_array_equal(out, x.astype(np.float16))
    row = rng.standard_normal(100).astype(np.float16)
    wide = np.empty((64, 100), np.float32)
    cast_copy(wide, row)  # broadcast
    np.testing.assert_array_equal(wide, np.broadcast_to(row.astype(np.float32), (64, 100)))
    small = rng.standard_normal(MIN_ELEMENTS - 1).astype(np.float32)
    out16 = np.empty(small.shape, np.float16)
    cast_copy(out16, small)
    _same_bits(out16, small)
    buf = rng.standard_normal(2 * MIN_ELEMENTS).astype(np.float32)
    as16 = buf.view(np.float16)[: buf.size]  # shares buf's first half
    want = buf.copy()
    with np.errstate(over="ignore"):
        cast_copy(as16, buf)  # numpy buffers an overlapping copy
    _same_bits(as16, want)
