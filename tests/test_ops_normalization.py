"""layer_norm / rms_norm (and the existing softmax) against float64 numpy references."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_layouts import LAYOUTS, on_device, random

from twophase import ops
from twophase.errors import ParamError
from twophase.testing import run_checked

TOL = {np.float16: 3e-3, np.float32: 2e-5, np.float64: 1e-10}


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.integers(1, 5), min_size=0, max_size=2), n=st.integers(1, 70), layout=st.sampled_from(LAYOUTS),
       dtype=st.sampled_from([np.float32, np.float64, np.float16]), rms=st.booleans(), affine=st.booleans())
def test_layer_and_rms_norm_match_reference(rows: list[int], n: int, layout: str, dtype: Any, rms: bool,
                                            affine: bool) -> None:
    rng = np.random.default_rng(n)
    x = random(tuple(rows) + (n,), dtype, rng) + 1.5
    w, b = random((n,), dtype, rng), random((n,), dtype, rng)
    op = ops.rms_norm if rms else ops.layer_norm
    args = ([w] if rms else [w, b]) if affine else []
    r = run_checked(op, on_device(x, layout if x.ndim > 1 else "dense"), *args, normalized_shape=(n,))
    ref = op.spec.reference(x, *args, normalized_shape=(n,))
    assert r.guards_intact and r.unwritten == (0, 0, 0) and r.touched <= r.workspace_size
    for got, want in zip(r.outputs, ref):
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=TOL[dtype], atol=TOL[dtype] * 4)


def test_softmax_long_rows_split_with_partials_short_rows_workspace_zero() -> None:
    x = np.random.default_rng(0).standard_normal((2, 40000)).astype(np.float32)
    r = run_checked(ops.softmax, x)
    assert r.implementation == "split_rows" and r.workspace_size > 0 and r.touched > 0
    np.testing.assert_allclose(r.outputs[0], ops.softmax.spec.reference(x, -1), rtol=1e-5, atol=1e-12)
    assert run_checked(ops.softmax, x[:, :100]).workspace_size == 0


@pytest.mark.parametrize("call,arg", [
    (lambda: ops.layer_norm.get_workspace_size(on_device(np.ones((2, 3))), normalized_shape=(4,)),
     "normalized_shape"),
    (lambda: ops.layer_norm.get_workspace_size(on_device(np.ones((2, 3))), on_device(np.ones(2)),
                                               normalized_shape=(3,)), "weight"),
    (lambda: ops.rms_norm.get_workspace_size(on_device(np.ones((2, 3), np.int32)), normalized_shape=(3,)), "x"),
])
def test_bad_inputs_raise_param_error_naming_the_argument(call: Any, arg: str) -> None:
    with pytest.raises(ParamError) as e:
        call()
    assert e.value.arg == arg
