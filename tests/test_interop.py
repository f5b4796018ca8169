"""Interop: ``Tensor.__array__`` synchronizes first; ``__dlpack__`` / ``__dlpack_device__``;
``twophase.from_dlpack`` wraps numpy arrays (any strides) and torch CPU tensors without copying."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import twophase


def test_array_protocol_waits_for_pending_work(dev, stream, gate, rng):
    a = rng.standard_normal((64, 64))
    x = dev.tensor(a, stream=stream)
    out = dev.tensor(np.full((64, 64), np.nan), stream=stream)
    ev = gate(stream)
    twophase.softmax(x, dim=1, out=out, stream=stream)
    opener = threading.Timer(0.05, ev.set)  # opens the gate while np.asarray is (or should be) waiting
    opener.start()
    try:
        got = np.asarray(out)
    finally:
        ev.set()
        opener.join()
    e = np.exp(a - a.max(1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(1, keepdims=True), rtol=1e-10)
    assert np.asarray(out, dtype=np.float32).dtype == np.float32


def test_dlpack_export_shares_memory_and_names_the_cpu(dev, stream, rng):
    a = rng.standard_normal((3, 4))
    t = twophase.add(dev.tensor(a, stream=stream), dev.tensor(a, stream=stream), stream=stream)
    assert t.__dlpack_device__() == (1, 0)
    view = np.from_dlpack(t)  # waits for the add first
    np.testing.assert_allclose(view, 2 * a)
    twophase.add(t, t, out=t, stream=stream)
    stream.synchronize()
    np.testing.assert_allclose(view, 4 * a)  # same memory, no copy


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple), data=st.data())
def test_from_dlpack_wraps_numpy_views_without_copying(shape, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    base = rng.standard_normal(tuple(2 * n for n in shape))
    steps = data.draw(st.tuples(*[st.sampled_from([1, 2, -1, -2]) for _ in shape]))
    view = base[tuple(slice(None, None, s) for s in steps)][tuple(slice(0, n) for n in shape)]
    if data.draw(st.booleans()) and view.ndim >= 2:
        view = view.swapaxes(0, 1)
    t = twophase.from_dlpack(view)
    assert t.shape == view.shape and t.dtype.value == "float64"
    np.testing.assert_array_equal(t.numpy(), view)
    r = twophase.reduce_sum(t, dims=()).numpy()
    np.testing.assert_allclose(r, view.sum(), rtol=1e-10, atol=1e-10)
    before = view.copy()
    twophase.add(t, t, out=t)  # writes through the tensor land in the numpy array
    t.synchronize()
    np.testing.assert_allclose(view, 2 * before)


def test_from_dlpack_writes_are_visible_in_the_array(rng):
    a = rng.standard_normal((5, 6)).astype(np.float32)
    orig = a.copy()
    t = twophase.from_dlpack(a)
    twophase.softmax(t, dim=1, out=t)
    t.synchronize()
    e = np.exp(orig.astype(np.float64))
    np.testing.assert_allclose(a, e / e.sum(1, keepdims=True), rtol=2e-6)


def test_from_dlpack_refuses_what_it_cannot_wrap():
    with pytest.raises(twophase.ParamError, match="from_dlpack"):
        twophase.from_dlpack([1, 2, 3])
    with pytest.raises(twophase.ParamError, match="dtype"):
        twophase.from_dlpack(np.zeros(3, np.complex128) + 1j)


def test_from_dlpack_wraps_torch_cpu_tensors_without_copying(rng):
    torch = pytest.importorskip("torch")
    a = torch.from_numpy(rng.standard_normal((4, 5)))
    ref = a.clone()
    t = twophase.from_dlpack(a)
    assert t.shape == (4, 5)
    twophase.add(t, t, alpha=3, out=t)
    t.synchronize()
    assert torch.allclose(a, ref * 4)
    tt = twophase.from_dlpack(a.t())  # a strided torch view
    np.testing.assert_allclose(twophase.reduce_sum(tt, dims=1).numpy(), (ref * 4).t().sum(1).numpy(), rtol=1e-10)
    back = torch.from_dlpack(twophase.softmax(t, dim=0))
    np.testing.assert_allclose(back.numpy(), torch.softmax(ref * 4, dim=0).numpy(), rtol=1e-10)
