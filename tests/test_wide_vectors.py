"""``jit.wide_vectors``: the calling function, and only it, is compiled for 512-bit vectors."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import pytest

from twophase.kernels.cpu.jit import FAST, host_has, wide_vectors

_k = numba.njit(nogil=True, error_model="numpy", fastmath=FAST)
_ATTR = '"prefer-vector-width"="512"'


@_k
def _wide(x: Any, out: Any) -> None:
    wide_vectors()
    for i in range(x.shape[0]):
        out[i] = x[i] * x[i] + 1.5


@_k
def _plain(x: Any, out: Any) -> None:
    for i in range(x.shape[0]):
        out[i] = x[i] * x[i] + 1.5


def _run(fn: Any, x: Any) -> Any:
    out = np.full_like(x, np.nan)
    fn(x, out)
    return out


def test_wide_vectors_marks_the_calling_function_only(rng: np.random.Generator) -> None:
    x = rng.standard_normal(1000).astype(np.float32)
    np.testing.assert_array_equal(_run(_wide, x), _run(_plain, x))
    np.testing.assert_allclose(_run(_wide, x), x.astype(np.float64) ** 2 + 1.5, rtol=1e-6)
    wide_ir = _wide.inspect_llvm(_wide.signatures[0])
    plain_ir = _plain.inspect_llvm(_plain.signatures[0])
    assert _ATTR in wide_ir
    assert _ATTR not in plain_ir


@pytest.mark.skipif(not host_has("avx512f"), reason="needs a CPU with AVX-512")
def test_wide_vectors_loop_runs_on_zmm_registers(rng: np.random.Generator) -> None:
    _run(_wide, rng.standard_normal(64).astype(np.float32))
    asm = _wide.inspect_asm(_wide.signatures[0])
    assert "zmm" in asm
