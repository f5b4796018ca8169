"""The IR span reductions (kernels/cpu/span_ir.py): whole steps summed in float64 or maxed / minned, the rest
left to the caller."""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twophase.kernels.cpu.span_ir import (
    BULK,
    bulk_column_extrema,
    bulk_column_sums,
    bulk_extremum,
    bulk_first,
    bulk_moments,
    bulk_sum,
)


@numba.njit
def _sum(v: Any, lo: int, n: int, zero: float = 0.0) -> tuple[float, int]:
    return bulk_sum(v, lo, n, zero)  # type: ignore[no-any-return]


@numba.njit
def _int_sum(v: Any, lo: int, n: int) -> tuple[int, int]:
    return bulk_sum(v, lo, n, np.int64(0))  # type: ignore[no-any-return]


@numba.njit
def _moments(v: Any, lo: int, n: int, shift: float) -> tuple[float, float, int]:
    return bulk_moments(v, lo, n, shift)  # type: ignore[no-any-return]


def _data(rng: np.random.Generator, size: int, dtype: Any) -> np.ndarray:
    return (rng.standard_normal(size) * 100 + 3).astype(dtype)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 300),
    lo=st.integers(0, 17),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_bulk_sum_covers_whole_steps(n: int, lo: int, dtype: Any, seed: int) -> None:
    v = _data(np.random.default_rng(seed), lo + n + 40, dtype)  # elements past the span: must not be summed
    got, done = _sum(v, lo, n)
    assert done == n - n % BULK
    want = math.fsum(v[lo : lo + done].astype(np.float64))
    assert got == pytest.approx(want, rel=1e-13, abs=1e-9)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bulk_sum_long_span_with_offsets(dtype: Any) -> None:
    """Long spans (many steps: every accumulator and the prefetch distance in play) at unaligned starts."""
    rng = np.random.default_rng(5)
    v = _data(rng, 70000, dtype)
    for lo, n in ((0, 65536), (1, 65535), (7, 40000), (3, 4096 + 31)):
        got, done = _sum(v, lo, n, 1000.0)  # added to the sum so far
        assert done == n - n % BULK
        assert got == pytest.approx(1000.0 + math.fsum(v[lo : lo + done].astype(np.float64)), rel=1e-13)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "special, want", [([np.nan], "nan"), ([np.inf], "inf"), ([np.inf, -np.inf], "nan"), ([-np.inf], "-inf")]
)
def test_bulk_sum_propagates_nan_and_inf(dtype: Any, special: list[float], want: str) -> None:
    for where in (0, 13, 55):  # in the first step, inside a vector, in the last step (the -inf 40 on)
        v = _data(np.random.default_rng(1), 96, dtype)
        v[where : where + len(special) * 40 : 40] = special
        got, done = _sum(v, 0, 96)
        assert done == 96
        assert str(got) == want, (where, got)


def test_bulk_sum_leaves_other_spans_to_the_caller() -> None:
    """Integer data, a strided view and a float32 accumulator get no bulk: 0 done, the zero unchanged."""
    ints = np.arange(100, dtype=np.int32)
    assert _int_sum(ints, 0, 100) == (0, 0)
    strided = _data(np.random.default_rng(2), 200, np.float32)[::2]
    assert _sum(strided, 0, 100) == (0.0, 0)

    @numba.njit
    def narrow(v: Any) -> tuple[Any, int]:
        return bulk_sum(v, 0, v.shape[0], np.float32(0))  # type: ignore[no-any-return]

    assert narrow(np.ones(64, np.float32)) == (0.0, 0)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 300),
    lo=st.integers(0, 9),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_bulk_moments_sums_shifted_values_and_squares(n: int, lo: int, dtype: Any, seed: int) -> None:
    v = _data(np.random.default_rng(seed), lo + n + 40, dtype)
    shift = float(v[lo])
    s, q, done = _moments(v, lo, n, shift)
    assert done == n - n % BULK
    y = v[lo : lo + done].astype(np.float64) - shift
    assert s == pytest.approx(math.fsum(y), rel=1e-12, abs=1e-8)
    assert q == pytest.approx(math.fsum(y * y), rel=1e-12, abs=1e-8)
    assert _moments(v[::2], 0, min(n, v[::2].shape[0]), shift) == (0.0, 0.0, 0)


@numba.njit
def _extremum(v: Any, lo: int, n: int, sign: int, m: Any) -> tuple[Any, int]:
    return bulk_extremum(v, lo, n, sign, m)  # type: ignore[no-any-return]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 300),
    lo=st.integers(0, 17),
    dtype=st.sampled_from([np.float32, np.float64]),
    sign=st.sampled_from([1, -1]),
    seed=st.integers(0, 2**32 - 1),
)
def test_bulk_extremum_covers_whole_steps(n: int, lo: int, dtype: Any, sign: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    v = _data(rng, lo + n + 40, dtype)
    v[lo + n :] = 1e6 * sign  # past the span: would win if read
    m0 = dtype(rng.standard_normal() * 100)
    got, done = _extremum(v, lo, n, sign, m0)
    assert done == n - n % BULK
    pick = np.max if sign > 0 else np.min
    assert got == pick(np.append(v[lo : lo + done], m0))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("sign", [1, -1])
def test_bulk_extremum_nan_wins_and_infinities_count(dtype: Any, sign: int) -> None:
    for where in (0, 17, 63):
        v = _data(np.random.default_rng(3), 64, dtype)
        v[where] = np.nan
        got, _ = _extremum(v, 0, 64, sign, dtype(0))
        assert np.isnan(got), where
        v[where] = np.inf * sign
        assert _extremum(v, 0, 64, sign, dtype(0))[0] == np.inf * sign
        v[where] = -np.inf * sign
        assert _extremum(v, 0, 64, sign, dtype(0))[0] == (np.max if sign > 0 else np.min)(np.append(v, 0))
    v = _data(np.random.default_rng(4), 64, dtype)
    assert np.isnan(_extremum(v, 0, 64, sign, dtype(np.nan))[0])  # a NaN carried in stays


def test_bulk_extremum_leaves_integers_and_strided_spans_to_the_caller() -> None:
    ints = np.arange(100, dtype=np.int32)
    assert _extremum(ints, 0, 100, 1, np.int32(-5)) == (-5, 0)
    strided = _data(np.random.default_rng(2), 200, np.float32)[::2]
    assert _extremum(strided, 0, 100, -1, np.float32(7)) == (7, 0)


@numba.njit
def _first(v: Any, lo: int, n: int, m: Any) -> tuple[int, int]:
    return bulk_first(v, lo, n, m)  # type: ignore[no-any-return]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 300),
    lo=st.integers(0, 17),
    dtype=st.sampled_from([np.float32, np.float64]),
    hits=st.lists(st.integers(0, 299), max_size=3),
    nan=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_bulk_first_finds_the_first_match_in_whole_steps(
    n: int, lo: int, dtype: Any, hits: list[int], nan: bool, seed: int
) -> None:
    v = _data(np.random.default_rng(seed), lo + 340, dtype)
    target = dtype(np.nan) if nan else dtype(1e9)
    for h in hits:
        v[lo + h] = target  # past the span too: must not be found there
    found, done = _first(v, lo, n, target)
    assert done == n - n % BULK
    inside = [h for h in hits if h < done]
    assert found == (min(inside) if inside else done)
    if not nan and n > 0:  # an ordinary value of the span is found at its first position
        k = n // 2
        want = int(np.flatnonzero(v[lo : lo + done] == v[lo + k])[0]) if k < done else done
        assert _first(v, lo, n, v[lo + k]) == (want, done)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bulk_first_matches_a_nan_only_when_looking_for_one(dtype: Any) -> None:
    v = _data(np.random.default_rng(6), 96, dtype)
    v[[3, 70]] = np.nan
    v[40] = 7.5
    assert _first(v, 0, 96, dtype(7.5)) == (40, 96)
    assert _first(v, 0, 96, dtype(np.nan)) == (3, 96)
    assert _first(v, 4, 92, dtype(np.nan)) == (64, 64)  # two whole steps from 4: the NaN at 70 lies beyond them
    assert _first(v, 10, 64, dtype(np.nan)) == (60, 64)
    assert _first(v, 4, 64, dtype(-1e30)) == (64, 64)


def test_bulk_first_leaves_strided_spans_to_the_caller() -> None:
    strided = np.zeros(200, np.float32)[::2]
    assert _first(strided, 0, 100, np.float32(0)) == (0, 0)


@numba.njit
def _columns(v: Any, lo: int, rows: int, width: int, acc: Any) -> bool:
    return bulk_column_sums(v, lo, rows, width, acc)  # type: ignore[no-any-return]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("vectors", [1, 2, 4, 8])
def test_bulk_column_sums_adds_each_columns_sum(dtype: Any, vectors: int) -> None:
    width = vectors * 64 // np.dtype(dtype).itemsize
    rng = np.random.default_rng(vectors)
    for rows, lo in ((0, 0), (1, 3), (7, 0), (1000, 5)):
        v = _data(rng, lo + (rows + 300) * width, dtype)  # rows past the block: must not be added
        acc = rng.standard_normal(width)
        start = acc.copy()
        assert _columns(v, lo, rows, width, acc)
        block = v[lo : lo + rows * width].reshape(rows, width).astype(np.float64)
        np.testing.assert_allclose(acc, start + block.sum(axis=0), rtol=1e-13, atol=1e-9)


def test_bulk_column_sums_leaves_other_widths_and_data_to_the_caller() -> None:
    acc = np.ones(64)
    v = np.ones(6400, np.float32)
    for width in (8, 48, 63, 256):
        assert not _columns(v, 0, 10, width, acc)
    assert not _columns(v[::2], 0, 10, 16, acc)
    assert not _columns(np.ones(640, np.int32), 0, 10, 16, np.ones(16, np.int64))
    assert (acc == 1).all()


@numba.njit
def _column_extrema(v: Any, lo: int, rows: int, width: int, sign: int, acc: Any) -> bool:
    return bulk_column_extrema(v, lo, rows, width, sign, acc)  # type: ignore[no-any-return]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("vectors", [1, 2, 4, 8])
@pytest.mark.parametrize("sign", [1, -1])
def test_bulk_column_extrema_per_column_with_nans(dtype: Any, vectors: int, sign: int) -> None:
    width = vectors * 64 // np.dtype(dtype).itemsize
    rng = np.random.default_rng(vectors + 10 * (sign > 0))
    pick = np.max if sign > 0 else np.min
    for rows, lo in ((0, 0), (1, 3), (9, 0), (700, 5)):
        v = _data(rng, lo + (rows + 300) * width, dtype)
        v[lo + rows * width :] = 1e6 * sign  # rows past the block: would win if read
        block = v[lo : lo + rows * width].reshape(rows, width)
        if rows:
            block[rows // 2, 3] = np.nan  # column 3 becomes NaN
        acc = _data(rng, width, dtype)
        acc[5] = np.nan  # a NaN already in acc stays
        start = acc.copy()
        assert _column_extrema(v, lo, rows, width, sign, acc)
        with np.errstate(invalid="ignore"):
            want = pick(np.vstack([start[None], block]), axis=0)  # numpy's max / min: NaN wins
        np.testing.assert_array_equal(acc, want)


def test_bulk_column_extrema_leaves_other_widths_to_the_caller() -> None:
    acc = np.ones(64, np.float32)
    v = np.zeros(6400, np.float32)
    assert not _column_extrema(v, 0, 10, 48, 1, acc) and not _column_extrema(v, 0, 10, 16, 1, np.ones(16))
    assert (acc == 1).all()
