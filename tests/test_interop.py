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


def test_array_protocol_refuses_copy_false_and_copies_otherwise(dev, stream, rng):
    """numpy 2's ``copy=False`` promises a view: returning a copy silently lost the caller's writes."""
    a = rng.standard_normal(8)
    t = dev.tensor(a, stream=stream)
    with pytest.raises(twophase.ParamError, match="argument 'copy'.*from_dlpack") as err:
        np.asarray(t, copy=False)
    assert isinstance(err.value, ValueError)  # what numpy's protocol documents
    for copy in (None, True):
        got = np.array(t, dtype=np.float32, copy=copy)
        got[0] = 99.0
        assert got.dtype == np.float32 and np.allclose(got[1:], a[1:]) and t.numpy()[0] == a[0]
    t.free(stream)


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


def test_from_dlpack_refuses_read_only_memory(dev):
    buf = b"\x00" * 16  # immutable: ops must never write into it
    with pytest.raises(twophase.ParamError, match="read-only") as e:
        twophase.from_dlpack(np.frombuffer(buf, np.float32))
    assert e.value.arg == "obj"
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(twophase.ParamError, match="read-only"):
        twophase.exp(dev.tensor(np.ones(4, np.float32)), out=twophase.from_dlpack(ro))
    assert buf == b"\x00" * 16 and not ro.any()


def test_dlpack_export_keeps_the_memory_until_the_consumer_lets_go(dev, stream):
    """t.free() (or closing the planned call that owns it) while torch holds the memory: no reuse under torch."""
    torch = pytest.importorskip("torch")
    x = dev.tensor(np.zeros(1024, np.float32), stream=stream)
    with twophase.plan("exp", x, stream=stream) as call:
        held = torch.from_dlpack(call())
    before = dev.pool.stats()
    y = twophase.exp(x, stream=stream)
    held2 = torch.from_dlpack(y)
    y.free(stream)
    assert dev.pool.stats()["allocated_bytes"] == before["allocated_bytes"] + y.block.size  # not freed yet
    with pytest.raises(twophase.InvalidStateError, match="double free"):
        y.free(stream)
    with pytest.raises(twophase.InvalidStateError):
        y.numpy()
    others = [twophase.add(x, x, stream=stream) for _ in range(4)]  # same size: would take the freed blocks
    stream.synchronize()
    addresses = {o.view().ctypes.data for o in others}
    assert held.data_ptr() not in addresses and held2.data_ptr() not in addresses
    assert torch.equal(held, torch.ones(1024)) and torch.equal(held2, torch.ones(1024))
    del held2  # the consumer's deleter runs: the free that waited happens now
    after = dev.pool.stats()
    assert after["allocated_bytes"] == before["allocated_bytes"] + sum(o.block.size for o in others)
    assert after["free_count"] == before["free_count"] + 1
    assert y.block.exports is None and not y.block.allocated
    del held
    for o in others:
        o.free(stream)


def test_from_dlpack_of_a_tensor_shares_its_block_so_reads_wait_for_its_stream(dev, stream, gate):
    y = dev.tensor(np.zeros(64, np.float32), stream=stream)
    z = twophase.from_dlpack(y)
    opened = gate(stream)
    twophase.exp(y, out=y, stream=stream)  # y = 1, pending behind the gate
    opener = threading.Timer(0.05, opened.set)
    opener.start()
    try:
        got = z.numpy()
    finally:
        opened.set()
        opener.join()
    np.testing.assert_array_equal(got, 1)  # not the 0 it held before the pending exp
    assert z.block is y.block and z.desc == y.desc and z.device is y.device
    with pytest.raises(twophase.ParamError, match="dev"):
        twophase.from_dlpack(y, twophase.device("null"))


def test_dlpack_stream_is_the_consumers_and_must_be_none_or_a_stream_of_the_device(dev, stream, gate):
    x = dev.tensor(np.zeros(8, np.float32), stream=stream)
    for bad in (1, -1, twophase.device("null").stream()):
        with pytest.raises(twophase.ParamError, match="stream") as e:
            x.__dlpack__(stream=bad)
        assert e.value.arg == "stream"
    opened = gate(stream)
    twophase.exp(x, out=x, stream=stream)
    opener = threading.Timer(0.05, opened.set)
    opener.start()
    try:
        got = np.from_dlpack(_Exporter(x, dev.stream()))  # the producer makes the data ready for that stream
    finally:
        opened.set()
        opener.join()
    np.testing.assert_array_equal(got, 1)


class _Exporter:
    """A producer handing on ``t``'s export with a consumer stream."""

    def __init__(self, t, stream):
        self.t, self.stream = t, stream

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        return self.t.__dlpack__(stream=self.stream, **{k: v for k, v in kwargs.items() if k != "stream"})


class _BadProducer:
    def __init__(self, result):
        self.result = result

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, **kwargs):
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


@pytest.mark.parametrize("result", [ValueError("producer refuses"), 42], ids=["raises", "non_capsule"])
def test_from_dlpack_turns_a_producers_failure_into_a_param_error(result):
    with pytest.raises(twophase.ParamError, match="from_dlpack") as e:
        twophase.from_dlpack(_BadProducer(result))
    assert e.value.arg == "obj"
