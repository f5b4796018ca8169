"""TensorDesc (immutable, hashable, validated) and Tensor (a desc bound to a block, made by a device)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import twophase
from twophase import DType, Format, Tensor, TensorDesc

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)
dtypes = st.sampled_from(list(DType))


@settings(max_examples=50, deadline=None)
@given(shape=shapes, dtype=dtypes)
def test_equal_descs_are_equal_and_hash_alike(shape, dtype):
    a, b = TensorDesc(shape, dtype), TensorDesc(list(shape), dtype.np)
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert a.numel == int(np.prod(shape)) and a.nbytes == a.numel * dtype.itemsize


def test_descs_differing_in_any_field_are_unequal():
    base = TensorDesc((2, 3), "float32")
    others = [
        TensorDesc((3, 2)),
        TensorDesc((2, 3), "float64"),
        TensorDesc((2, 3), strides=(1, 2)),
        TensorDesc((2, 3), offset=1),
        base.with_(format=Format.ND, offset=2),
    ]
    for o in others:
        assert o != base


def test_desc_is_immutable():
    d = TensorDesc((2, 3))
    with pytest.raises(AttributeError):
        d.shape = (3, 2)
    with pytest.raises(AttributeError):
        del d.shape
    assert d.shape == (2, 3)


def test_desc_rejects_bad_fields_with_param_error():
    with pytest.raises(twophase.ParamError, match="shape"):
        TensorDesc((2, -1))
    with pytest.raises(twophase.ParamError, match="strides"):
        TensorDesc((2, 3), strides=(1,))
    with pytest.raises(twophase.ParamError, match="format"):
        TensorDesc((2, 3), format=Format.NCHW)
    with pytest.raises(twophase.ParamError, match="dtype"):
        TensorDesc((2,), "complex64")
    with pytest.raises(twophase.ParamError, match="offset"):
        TensorDesc((2,), offset=-1)


def test_contiguous_strides_and_span():
    d = TensorDesc((2, 3, 4))
    assert d.strides == (12, 4, 1) and d.is_contiguous and d.span() == (0, 24)
    t = TensorDesc((3, 2), strides=(1, 3), offset=2)
    assert not t.is_contiguous and t.span() == (2, 8)
    assert TensorDesc((0, 3)).span() == (0, 0)
    assert TensorDesc((4,), strides=(-1,), offset=3).span() == (0, 4)


def test_tensor_constructor_names_the_factory():
    with pytest.raises(TypeError, match="dev.tensor"):
        Tensor()


def test_tensor_roundtrip_and_host_copy_is_taken_at_once(dev, stream, rng):
    a = rng.standard_normal((5, 7)).astype(np.float32)
    t = dev.tensor(a, stream=stream)
    a[:] = 0  # the host may reuse its array right after the call
    assert t.numpy().any()
    assert t.desc == TensorDesc((5, 7), "float32")


def test_tensor_rejects_desc_outside_its_block(dev):
    t = dev.empty((4,), "float32")
    with pytest.raises(twophase.ParamError, match="block"):
        t.strided((4,), (1,), offset=200)


def test_transpose_is_a_strided_view_of_the_same_memory(dev, stream, rng):
    a = rng.standard_normal((3, 4))
    t = dev.tensor(a, stream=stream)
    tt = t.transpose()
    assert tt.block is t.block and not tt.desc.is_contiguous
    np.testing.assert_array_equal(tt.numpy(), a.T)


def test_view_of_freed_tensor_raises_invalid_state(dev):
    t = dev.empty((4,))
    t.free()
    with pytest.raises(twophase.InvalidStateError):
        t.view()


def test_a_freed_tensor_stays_freed_when_its_memory_is_handed_out_again(dev, rng):
    n = (14 << 20) // 4  # a size of its own: the next malloc of it reuses this memory
    t = dev.tensor(rng.standard_normal(n).astype(np.float32))
    addr = t.block.address
    t.free()
    u = dev.tensor(rng.standard_normal(n).astype(np.float32))
    try:
        assert u.block.address == addr
        with pytest.raises(twophase.InvalidStateError, match="freed"):
            t.view()
        with pytest.raises(twophase.InvalidStateError, match="freed"):
            twophase.add(t, t, out=u)
        with pytest.raises(twophase.InvalidStateError, match="double free"):
            t.free()
        assert u.block.allocated
    finally:
        u.free()


def test_free_of_an_exported_tensor_waits_for_the_consumer_then_keeps_stream_order(dev, stream, gate):
    t = dev.tensor(np.ones(256, np.float32), stream=stream)
    capsule = t.__dlpack__()  # never consumed: its destructor is the consumer's release
    blk, size, before = t.block, t.block.size, dev.pool.stats()
    t.free(stream)
    assert blk.allocated and blk.exports is not None and dev.pool.stats() == before
    opened = gate(stream)  # the stream is still busy when the consumer lets go
    del capsule
    assert not blk.allocated and blk.exports is None
    assert blk.free_queue is stream._q  # reusable by other streams only after the stream's work
    stats = dev.pool.stats()
    assert stats["allocated_bytes"] == before["allocated_bytes"] - size
    assert stats["free_count"] == before["free_count"] + 1
    opened.set()
    with pytest.raises(twophase.InvalidStateError, match="double free"):
        t.free(stream)


def test_the_pools_own_free_of_an_exported_block_waits_for_the_consumer(dev, stream):
    """``MemoryPool.free`` defers like ``Block.free``: it handed an exported block straight out again, under a
    consumer still reading it."""
    t = dev.tensor(np.arange(256, dtype=np.float32), stream=stream)
    held = np.from_dlpack(t)
    blk, size, before = t.block, t.block.size, dev.pool.stats()
    dev.pool.free(blk, stream)
    assert blk.allocated and blk.freed and dev.pool.stats() == before
    other = dev.tensor(np.full(256, -1.0, np.float32), stream=stream)
    stream.synchronize()
    assert other.block.address != blk.address
    np.testing.assert_array_equal(held, np.arange(256))
    with pytest.raises(twophase.InvalidStateError, match="double free"):
        dev.pool.free(blk, stream)
    del held
    assert (
        not blk.allocated and dev.pool.stats()["allocated_bytes"] == before["allocated_bytes"] + other.block.size - size
    )
    other.free()


def test_an_unfreed_export_leaves_the_block_as_it_was(dev):
    t = dev.tensor(np.arange(4, dtype=np.float32))
    a = np.from_dlpack(t)
    np.testing.assert_array_equal(a, np.arange(4))
    assert t.block.exports is not None and t.block.exports.count == 1
    del a
    assert t.block.exports is None and t.block.allocated
    before, size = dev.pool.stats()["allocated_bytes"], t.block.size
    t.free()
    assert dev.pool.stats()["allocated_bytes"] == before - size  # no export left: freed at once
    with pytest.raises(twophase.InvalidStateError):
        t.__dlpack__()


def test_an_export_released_inside_the_pools_lock_frees_at_the_next_pool_call(dev):
    """The garbage collector may run a consumer's release on a thread that holds the pool's lock, mid-operation:
    the free then waits for the pool's next malloc or free instead of re-entering it."""
    t = dev.tensor(np.ones(256, np.float32))
    capsule = t.__dlpack__()
    blk, size = t.block, t.block.size
    t.free()
    before = dev.pool.stats()["allocated_bytes"]
    with dev.pool._lock:  # as a collection inside a pool operation would
        del capsule
        assert blk.allocated and dev.pool._deferred == [(blk, None)]
    assert dev.pool.stats()["allocated_bytes"] == before  # not yet
    dev.malloc(16).free()
    assert not blk.allocated and dev.pool._deferred == []
    assert dev.pool.stats()["allocated_bytes"] == before - size
