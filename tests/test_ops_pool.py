"""max_pool2d, avg_pool2d and adaptive_avg_pool2d vs float64 references (PyTorch's output sizes and divisors)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twophase import Format, device
from twophase.errors import ParamError
from twophase.ops import adaptive_avg_pool2d, avg_pool2d, max_pool2d
from twophase.ops.pool import _ref_adaptive, _ref_avg, _ref_max
from twophase.testing import run_checked


def _check(r: Any, ref: np.ndarray) -> None:
    assert r.guards_intact and r.workspace_size == 0 and r.touched == 0 and r.inputs_changed == ()
    assert r.unwritten == (int(np.isnan(ref).sum()),)
    np.testing.assert_allclose(r.outputs[0], ref, rtol=1e-5, atol=1e-6)


window = dict(
    k=st.tuples(st.integers(1, 4), st.integers(1, 3)),
    s=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    ceil=st.booleans(),
    h=st.integers(4, 10),
    w=st.integers(4, 9),
    seed=st.integers(0, 2**31),
)


@settings(max_examples=20, deadline=None)
@given(**window, dil=st.tuples(st.integers(1, 2), st.integers(1, 2)), data=st.data())
def test_max_pool2d_matches_reference(
    k: Any, s: Any, ceil: bool, h: int, w: int, seed: int, dil: Any, data: Any
) -> None:
    rng = np.random.default_rng(seed)
    pad = (data.draw(st.integers(0, k[0] // 2)), data.draw(st.integers(0, k[1] // 2)))
    x = rng.standard_normal((2, 3, h, w)).astype(np.float32)
    attrs = dict(kernel_size=k, stride=s, padding=pad, dilation=dil, ceil_mode=ceil)
    if h + 2 * pad[0] < dil[0] * (k[0] - 1) + 1 or w + 2 * pad[1] < dil[1] * (k[1] - 1) + 1:
        return
    _check(run_checked(max_pool2d, x, **attrs), _ref_max(x, **attrs))


@settings(max_examples=20, deadline=None)
@given(**window, include_pad=st.booleans(), data=st.data())
def test_avg_pool2d_matches_reference(
    k: Any, s: Any, ceil: bool, h: int, w: int, seed: int, include_pad: bool, data: Any
) -> None:
    rng = np.random.default_rng(seed)
    pad = (data.draw(st.integers(0, k[0] // 2)), data.draw(st.integers(0, k[1] // 2)))
    x = rng.standard_normal((2, 3, h, w)).astype(np.float32)
    attrs = dict(kernel_size=k, stride=s, padding=pad, ceil_mode=ceil, count_include_pad=include_pad)
    _check(run_checked(avg_pool2d, x, **attrs), _ref_avg(x, **attrs))


@pytest.mark.parametrize("out_size", [(1, 1), (3, 2), (7, 5), (4, 9)])
def test_adaptive_avg_pool2d_matches_reference(rng: np.random.Generator, out_size: tuple[int, int]) -> None:
    x = rng.standard_normal((2, 3, 7, 9)).astype(np.float32)
    _check(run_checked(adaptive_avg_pool2d, x, output_size=out_size), _ref_adaptive(x, out_size))


def test_max_pool2d_propagates_nan(rng: np.random.Generator) -> None:
    x = rng.standard_normal((1, 1, 4, 4)).astype(np.float32)
    x[0, 0, 1, 1] = np.nan
    r = run_checked(max_pool2d, x, kernel_size=2)
    assert np.isnan(r.outputs[0][0, 0, 0, 0]) and not np.isnan(r.outputs[0][0, 0, 1:, 1:]).any()


def test_pooling_nhwc_matches_nchw(rng: np.random.Generator) -> None:
    x = rng.standard_normal((2, 3, 6, 5)).astype(np.float32)
    xt = device("cpu").tensor(x.transpose(0, 2, 3, 1).copy(), format=Format.NHWC)
    r = run_checked(avg_pool2d, xt, kernel_size=3, stride=2, padding=1, ceil_mode=True)
    ref = _ref_avg(x, 3, 2, 1, True)
    np.testing.assert_allclose(r.outputs[0], ref.transpose(0, 2, 3, 1), rtol=1e-5)
    r = run_checked(max_pool2d, xt, kernel_size=2)
    np.testing.assert_allclose(r.outputs[0], _ref_max(x, 2).transpose(0, 2, 3, 1))


@pytest.mark.parametrize(
    "op,attrs,arg",
    [
        (max_pool2d, {"kernel_size": 2, "padding": 2}, "padding"),
        (max_pool2d, {"kernel_size": 0}, "kernel_size"),
        (avg_pool2d, {"kernel_size": 9}, "x"),
        (adaptive_avg_pool2d, {"output_size": 0}, "output_size"),
        (max_pool2d, {"kernel_size": 2, "stride": 2**63}, "stride"),  # was numpy's OverflowError at the launch
        (avg_pool2d, {"kernel_size": 2, "stride": (1, 2**64)}, "stride"),
    ],
)
def test_pooling_rejects_bad_arguments(op: Any, attrs: dict[str, Any], arg: str) -> None:
    with pytest.raises(ParamError) as e:
        op.get_workspace_size(device("cpu").tensor(np.ones((1, 2, 5, 5), np.float32)), **attrs)
    assert e.value.arg == arg
