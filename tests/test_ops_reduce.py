"""Tree reductions (sum, mean, max, min) against float64 numpy over dims, layouts and long extents."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_layouts import LAYOUTS, on_device, random, shapes

from twophase import ops
from twophase.errors import ParamError
from twophase.ops.reduce import tree_levels
from twophase.testing import run_checked

NAMES = ["reduce_sum", "reduce_mean", "reduce_max", "reduce_min"]


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(NAMES), shape=shapes(1, 4, 6), layout=st.sampled_from(LAYOUTS), keep=st.booleans(),
       dtype=st.sampled_from([np.float32, np.float64, np.int32, np.float16]), data=st.data())
def test_reduction_matches_float64_reference(name: str, shape: tuple[int, ...], layout: str, keep: bool, dtype: Any,
                                             data: Any) -> None:
    if name == "reduce_mean" and dtype == np.int32:
        dtype = np.float64
    dims = tuple(data.draw(st.sets(st.integers(-len(shape), len(shape) - 1), max_size=len(shape))))
    red = {d % len(shape) for d in dims} if dims else set(range(len(shape)))
    if name in ("reduce_max", "reduce_min") and any(shape[d] == 0 for d in red):
        shape = tuple(max(n, 1) for n in shape)
    if len({d % len(shape) for d in dims}) != len(dims):
        dims = tuple({d % len(shape) for d in dims})
    x = random(shape, dtype, np.random.default_rng(len(shape)))
    op = getattr(ops, name)
    r = run_checked(op, on_device(x, layout), dims=dims, keep_dims=keep)
    ref = op.spec.reference(x, dims=dims, keep_dims=keep)
    assert r.guards_intact and r.unwritten == (int(np.isnan(ref).sum()),) and r.touched <= r.workspace_size
    tol = {np.float16: 2e-3, np.float32: 1e-5, np.float64: 1e-12, np.int32: 0}[dtype]
    np.testing.assert_allclose(r.outputs[0].astype(np.float64), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("name,n", [("reduce_sum", 17_000_000), ("reduce_mean", 300_000), ("reduce_max", 17_000_000),
                                    ("reduce_min", 300_000)])
def test_long_extent_uses_multi_level_tree_with_partials_in_workspace(name: str, n: int) -> None:
    x = np.random.default_rng(5).standard_normal((2, n // 2)).astype(np.float32).reshape(1, -1)
    r = run_checked(getattr(ops, name), x, dims=(1,))
    levels = tree_levels(n, 4096)
    assert len(levels) == (2 if n > 4096 ** 2 else 1) and r.tiling.levels == levels
    assert r.implementation == ("tree_parallel" if n >= 1 << 20 else "tree")
    assert r.workspace_size > 0 and r.touched > 0 and r.guards_intact
    np.testing.assert_allclose(r.outputs[0], getattr(ops, name).spec.reference(x, dims=(1,)), rtol=1e-5)


def test_max_min_propagate_nan() -> None:
    x = np.arange(20.0).reshape(2, 10)
    x[1, 3] = np.nan
    for name in ("reduce_max", "reduce_min"):
        got = run_checked(getattr(ops, name), x, dims=(1,)).outputs[0]
        assert not np.isnan(got[0]) and np.isnan(got[1])


@pytest.mark.parametrize("call,arg", [
    (lambda: ops.reduce_max.get_workspace_size(on_device(np.ones((2, 0))), dims=(1,)), "dims"),
    (lambda: ops.reduce_mean.get_workspace_size(on_device(np.ones(3, np.int32))), "x"),
    (lambda: ops.reduce_min.get_workspace_size(on_device(np.ones((2, 3))), dims=(0, -2)), "dims"),
    (lambda: ops.reduce_max.get_workspace_size(on_device(np.ones((2, 3))), dims=(2,)), "dims"),
])
def test_bad_inputs_raise_param_error_naming_the_argument(call: Any, arg: str) -> None:
    with pytest.raises(ParamError) as e:
        call()
    assert e.value.arg == arg
