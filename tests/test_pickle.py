"""Pickling (multiprocessing, joblib, copy): a Tensor travels as its data, a Device by name; what lives only in
the process that made it (streams, events, executors, graphs, blocks, pools) refuses with InvalidStateError
instead of a bare "cannot pickle '_thread.lock' object"."""

from __future__ import annotations

import copy
import pickle
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import twophase as tp
from twophase.tensor import Format


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
    dtype=st.sampled_from([np.float32, np.float64, np.float16, np.int32, np.int64, np.bool_]),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_tensor_pickles_as_its_data_on_its_device(shape: list[int], dtype: Any, seed: int) -> None:
    dev = tp.device("cpu")
    data = (np.random.default_rng(seed).standard_normal(shape) * 100).astype(dtype)
    t = dev.tensor(data)
    back = pickle.loads(pickle.dumps(t))
    assert back is not t and back.device is dev and back.block is not t.block
    assert back.shape == t.shape and back.dtype == t.dtype
    np.testing.assert_array_equal(back.numpy(), data)


def test_a_view_arrives_dense_and_a_format_is_kept(dev: tp.Device, rng: np.random.Generator) -> None:
    data = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    nhwc = dev.tensor(data, format=Format.NHWC)
    back = pickle.loads(pickle.dumps(nhwc))
    assert back.desc.format is Format.NHWC and back.desc == nhwc.desc
    np.testing.assert_array_equal(back.numpy(), data)
    view = dev.tensor(data[0, 0]).transpose()
    back = pickle.loads(pickle.dumps(view))
    assert back.desc.is_contiguous and back.desc.strides == (4, 1) and view.desc.strides == (1, 5)
    np.testing.assert_array_equal(back.numpy(), data[0, 0].T)


def test_pickling_waits_for_the_work_that_writes_the_tensor(
    dev: tp.Device, stream: tp.Stream, rng: np.random.Generator, gate: Callable[[tp.Stream], threading.Event]
) -> None:
    xs = rng.standard_normal(1000).astype(np.float32)
    x = dev.tensor(xs, stream=stream)
    opened = gate(stream)
    y = tp.tanh(x, stream=stream)  # queued behind the gate
    threading.Timer(0.05, opened.set).start()
    back = pickle.loads(pickle.dumps(y))
    np.testing.assert_allclose(back.numpy(), np.tanh(xs.astype(np.float64)), rtol=1e-6, atol=1e-6)


def test_a_device_pickles_by_name() -> None:
    for name in ("cpu", "null"):
        dev = tp.device(name)
        assert pickle.loads(pickle.dumps(dev)) is dev and copy.deepcopy(dev) is dev


def test_what_lives_in_its_process_refuses_pickling_with_the_way_out(dev: tp.Device, stream: tp.Stream) -> None:
    x = dev.tensor(np.ones(4, np.float32), stream=stream)
    _, ex = tp.ops.relu.get_workspace_size(x)
    block = dev.malloc(64, stream=stream)
    with tp.capture(stream) as graph:
        graph.input("x", x)
        graph.output("y", tp.relu(x, stream=stream))
    things = {
        "stream": (stream, "dev.stream()"),
        "event": (stream.record_event(), "record_event()"),
        "executor": (ex, "get_workspace_size"),
        "graph": (graph, "capture the graph again"),
        "block": (block, "pickle a Tensor"),
        "memorypool": (dev.pool, "pools of its own devices"),
    }
    try:
        for arg, (obj, way_out) in things.items():
            for attempt in (pickle.dumps, copy.copy):
                with pytest.raises(tp.InvalidStateError) as err:
                    attempt(obj)
                assert err.value.arg == arg and err.value.op == "pickle" and way_out in str(err.value)
    finally:
        ex.destroy()
        graph.destroy()
        block.free(stream)
    stream.synchronize()  # nothing left broken by the refusals


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
    dtype=st.sampled_from(["float32", "float64", "int64", "bool"]),
    offset=st.integers(0, 9),
)
def test_a_tensor_desc_pickles_and_copies_as_itself(shape: list[int], dtype: str, offset: int) -> None:
    """A desc is plain immutable metadata (a cache key, an attribute of saved plans): it pickles and copies; its
    ``__setattr__`` refusal made all three raise AttributeError."""
    strides = [s + 1 for s in range(len(shape))]
    d = tp.TensorDesc(tuple(shape), dtype, strides, offset)
    back = pickle.loads(pickle.dumps(d))
    assert back == d and hash(back) == hash(d) and back.strides == tuple(strides) and back.offset == offset
    assert copy.copy(d) is d and copy.deepcopy({"x": d})["x"] is d


def test_a_registered_op_pickles_by_name_and_a_planned_call_refuses(dev: tp.Device) -> None:
    """An op (and its definition) is found by name in the receiving process; a planned call holds a workspace and
    an executor and is refused, copy.copy included (a copy double-freed the workspace at the second close)."""
    for op in (tp.ops.softmax, tp.ops.conv2d):
        assert pickle.loads(pickle.dumps(op)) is op and copy.deepcopy(op) is op
        assert pickle.loads(pickle.dumps(op.spec)) is op.spec
    x = dev.tensor(np.ones(4, np.float32))
    with tp.plan("exp", x) as call:
        for attempt in (pickle.dumps, copy.copy, copy.deepcopy):
            with pytest.raises(tp.InvalidStateError, match="plan the call again") as err:
                attempt(call)
            assert err.value.arg == "plannedcall"
        np.testing.assert_allclose(call().numpy(), np.exp(1.0), rtol=1e-6)
    x.free()
