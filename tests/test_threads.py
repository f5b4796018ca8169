"""Thread ownership: executors and executor caches belong to the thread that made them; four threads running
one-shot calls concurrently each get correct results."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import twophase
from twophase import TensorDesc, ops
from twophase.cache import thread_cache


def _in_thread(fn):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return box


def _softmax(a, dim):
    e = np.exp(a - a.max(axis=dim, keepdims=True))
    return e / e.sum(axis=dim, keepdims=True)


def test_four_threads_running_one_shot_calls_each_get_correct_results():
    dev = twophase.device("cpu")
    barrier = threading.Barrier(4)

    def worker(k):
        rng = np.random.default_rng(1000 + k)
        barrier.wait()
        bad = []
        for i in range(40):
            shape = (3 + (i + k) % 4, 50 + 7 * k)  # shared shapes: every thread hits its own cache entries
            a, b = rng.standard_normal(shape), rng.standard_normal(shape)
            x, y = dev.tensor(a), dev.tensor(b)
            s, r, p = twophase.add(x, y, alpha=k + 1), twophase.reduce_sum(x, dims=1), twophase.softmax(y, dim=0)
            for got, want in ((s, a + (k + 1) * b), (r, a.sum(1)), (p, _softmax(b, 0))):
                if not np.allclose(got.numpy(), want, rtol=1e-10, atol=1e-10):
                    bad.append((i, got.numpy(), want))
        return bad, twophase.cache_info()["size"]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(worker, range(4)))
    for bad, size in results:
        assert bad == []
        assert size == 12  # 4 shapes x 3 ops, in this thread's own cache


def test_each_thread_has_its_own_executor_cache():
    twophase.clear_cache()
    _, ex = ops.softmax.get_workspace_size(TensorDesc((7, 3), "float32"))
    ex.destroy()
    mine = thread_cache()
    box = _in_thread(lambda: (thread_cache(), twophase.cache_info()["size"], thread_cache().owner))
    other, size, owner = box["value"]
    assert other is not mine and size == 0 and owner != threading.get_ident()
    assert mine.owner == threading.get_ident() and len(mine) == 1


def test_executor_made_in_one_thread_is_refused_in_another(dev, stream, rng):
    x = dev.tensor(rng.standard_normal((2, 3)), stream=stream)
    size, ex = ops.softmax.get_workspace_size(x, out=dev.empty((2, 3), "float64"))
    box = _in_thread(lambda: ops.softmax(None, size, ex, dev.default_stream))
    assert isinstance(box.get("error"), twophase.InvalidStateError) and "thread" in str(box["error"])
    box = _in_thread(ex.destroy)
    assert isinstance(box.get("error"), twophase.InvalidStateError)
    assert ex.state is twophase.ExecState.READY  # still ours: it runs here
    ops.softmax(None, size, ex, stream)
    stream.synchronize()
    assert ex.state is twophase.ExecState.CONSUMED


def test_planned_call_cannot_run_in_another_thread(dev, stream, rng):
    x = dev.tensor(rng.standard_normal((2, 3)), stream=stream)
    with twophase.plan("softmax", x, stream=stream) as call:
        box = _in_thread(call)
        assert isinstance(box.get("error"), twophase.InvalidStateError)
        a = call().numpy()
    np.testing.assert_allclose(a, _softmax(x.numpy(), -1), rtol=1e-10)


@pytest.mark.parametrize("op", ["add", "softmax", "reduce_sum"])
def test_threads_use_their_own_default_stream(op, rng):
    dev = twophase.device("cpu")
    a = rng.standard_normal((3, 3))
    box = _in_thread(lambda: (getattr(twophase, op)(*([a, a] if op == "add" else [a])).numpy(), dev.default_stream))
    value, their_stream = box["value"]
    assert their_stream is not dev.default_stream
    want = {"add": a + a, "softmax": _softmax(a, -1), "reduce_sum": a.sum()}[op]
    np.testing.assert_allclose(value, want, rtol=1e-10)
