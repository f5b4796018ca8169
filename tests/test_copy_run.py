"""``jit.copy_run``: a run of adjacent elements copied by ``llvm.memcpy``, exactly that run, for each dtype."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import pytest

from twophase.kernels.cpu.jit import copy_run


@numba.njit(nogil=True)
def _copy(dst: Any, d0: int, src: Any, s0: int, n: int) -> None:
    copy_run(dst, d0, src, s0, n)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.uint8])
@pytest.mark.parametrize("d0, s0, n", [(0, 0, 0), (3, 5, 1), (1, 2, 49), (7, 0, 196), (0, 11, 300)])
def test_copy_run_copies_exactly_the_run(rng: np.random.Generator, dtype: Any, d0: int, s0: int, n: int) -> None:
    src = rng.integers(1, 255, s0 + n + 9).astype(dtype)  # 1-254: 7 is one value among them, 0 none
    if dtype != np.uint8:
        src = src * dtype(1.5) if np.issubdtype(dtype, np.floating) else src * 3
    dst = np.full(d0 + n + 9, 7, dtype)
    _copy(dst, d0, src, s0, n)
    expected = np.full_like(dst, 7)
    expected[d0 : d0 + n] = src[s0 : s0 + n]
    np.testing.assert_array_equal(dst, expected)  # the run, bit for bit, and nothing before or after it


def test_copy_run_refuses_mismatched_dtypes() -> None:
    with pytest.raises(numba.TypingError):
        _copy(np.zeros(4, np.float32), 0, np.zeros(4, np.float64), 0, 2)
