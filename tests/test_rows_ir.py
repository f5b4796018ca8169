"""rows_ir: constant linear maps between float32 rows and 4-way (de)interleaves, against numpy, every element
outside what they must write left alone (poisoned with NaN)."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from twophase.kernels.cpu.rows_ir import deinterleave4, interleave4, linear_map

_M = ((4, 0, -5, 0, 1, 0), (0, -4, -4, 1, 1, 0), (0, 2.5, -1, -2, 1, 0), (0, 0, 0, 0, 0, 0))  # 0, 1, -1, others
_SHIFTS = (0, 0, 1, 0, 2, 0)
_map = linear_map(_M, _SHIFTS)


@numba.njit
def _run_map(outs: Any, ins: Any, n: int, addend: float) -> None:
    a = np.empty(10, np.int64)
    for j in range(4):
        a[j] = outs[j].ctypes.data
    for i in range(6):
        a[4 + i] = ins[i].ctypes.data
    _map(a, n, np.float32(addend))


@numba.njit
def _run_de(a: Any, n: int, rows: int, s_step: int, d_step: int) -> None:
    deinterleave4(a, n, rows, s_step, d_step)


@numba.njit
def _run_inter(a: Any, n: int, rows: int, s_step: int, d_step: int) -> None:
    interleave4(a, n, rows, s_step, d_step)


def _addresses(four: Any, one: Any) -> Any:
    return np.array([r.ctypes.data for r in four] + [one.ctypes.data], np.int64)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 70), addend=st.sampled_from([0.0, 0.5, -3.0]), seed=st.integers(0, 2**31))
def test_linear_map_matches_numpy_and_writes_exactly_n(n: int, addend: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ins = rng.standard_normal((6, n + 3)).astype(np.float32)
    outs = np.full((4, n + 17), np.nan, np.float32)
    _run_map(outs, ins, n, addend)
    shifted = np.stack([ins[i, s : s + n] for i, s in enumerate(_SHIFTS)]).astype(np.float64)
    want = np.asarray(_M, np.float64) @ shifted + addend
    np.testing.assert_allclose(outs[:, :n], want, rtol=1e-6, atol=1e-5)
    assert np.isnan(outs[:, n:]).all()


def test_linear_map_in_place() -> None:
    """Outputs may be the inputs' rows (winograd4's B^T down in place): each step reads before it writes."""
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((6, 40)).astype(np.float32)
    want = np.asarray(_M, np.float64)[:, :6] @ np.stack([rows[i, s : s + 37] for i, s in enumerate(_SHIFTS)])
    _run_map(rows[:4], rows.copy(), 37, 0.0)  # distinct input copy, then check against the same map
    np.testing.assert_allclose(rows[:4, :37], want, rtol=1e-6, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 40), rows=st.integers(0, 4), gap=st.integers(0, 9), seed=st.integers(0, 2**31))
def test_deinterleave4_rows(n: int, rows: int, gap: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    s_step, d_step = 4 * n + gap, n + gap
    src = rng.standard_normal(max(1, rows * s_step + 64)).astype(np.float32)
    p = np.full((4, max(1, rows * d_step + 20)), np.nan, np.float32)
    _run_de(_addresses(p, src), n, rows, s_step, d_step)
    written = np.zeros(p.shape, bool)
    for i in range(rows):
        for r in range(4):
            np.testing.assert_array_equal(
                p[r, i * d_step : i * d_step + n], src[i * s_step + r : i * s_step + 4 * n : 4]
            )
            written[r, i * d_step : i * d_step + n] = True
    assert np.isnan(p[~written]).all()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 40), rows=st.integers(0, 4), gap=st.integers(0, 9), seed=st.integers(0, 2**31))
def test_interleave4_rows(n: int, rows: int, gap: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    s_step, d_step = n + gap, 4 * n + gap
    q = rng.standard_normal((4, max(1, rows * s_step + 20))).astype(np.float32)
    dst = np.full(max(1, rows * d_step + 64), np.nan, np.float32)
    _run_inter(_addresses(q, dst), n, rows, s_step, d_step)
    written = np.zeros(dst.shape, bool)
    for i in range(rows):
        got = dst[i * d_step : i * d_step + 4 * n].reshape(n, 4)
        np.testing.assert_array_equal(got, q[:, i * s_step : i * s_step + n].T)
        written[i * d_step : i * d_step + 4 * n] = True
    assert np.isnan(dst[~written]).all()
