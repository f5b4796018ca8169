"""A process forked after twophase ran (multiprocessing's default start method on Linux): in the child the
parent's streams, helper threads and locks work again, and a task that was running at the fork fails clearly
instead of hanging the next synchronize (runtime.forking)."""

from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import twophase
from twophase.runtime import fanout

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")

CHILD_LIMIT_S = 60.0  # a hang guard: the child needs well under a second


def in_child(body: Callable[[], Any]) -> Any:
    """What ``body()`` returns in a forked child (pickled through a pipe); its exception re-raised here as an
    AssertionError with the child's traceback; a child still running after ``CHILD_LIMIT_S`` is killed (a hang)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(r)
        try:
            payload = pickle.dumps(("ok", body()))
        except BaseException:  # noqa: BLE001  (reported to the parent)
            payload = pickle.dumps(("error", traceback.format_exc()))
        with os.fdopen(w, "wb") as out:
            out.write(payload)
        os._exit(0)
    os.close(w)
    chunks: list[bytes] = []
    deadline = time.monotonic() + CHILD_LIMIT_S
    with os.fdopen(r, "rb") as src:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([src], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError(f"the forked child hung for {CHILD_LIMIT_S:.0f} s")
            chunk = os.read(src.fileno(), 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    kind, value = pickle.loads(b"".join(chunks))
    if kind == "error":
        raise AssertionError(f"in the forked child:\n{value}")
    return value


@pytest.mark.usefixtures("microkernel")  # matmul in parts on the helpers (with only AVX2, BLAS's threads run it)
def test_a_child_runs_ops_on_the_parents_streams_helpers_and_tensors(
    dev: twophase.Device, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(twophase.settings, "num_threads", 2)
    s = dev.stream()
    xs = rng.standard_normal(1000).astype(np.float32)
    a_np = rng.standard_normal((256, 384)).astype(np.float32)
    b_np = rng.standard_normal((384, 512)).astype(np.float32)
    x, a, b = dev.tensor(xs, stream=s), dev.tensor(a_np, stream=s), dev.tensor(b_np, stream=s)
    before = int(fanout.BUSY[1])
    np.testing.assert_array_equal(twophase.relu(x, stream=s).numpy(), np.maximum(xs, 0))
    twophase.matmul(a, b, stream=s).numpy()
    assert int(fanout.BUSY[1]) > before and fanout._helpers.count > 0  # the worker and helpers exist

    def child() -> tuple[Any, ...]:
        on_parent = twophase.relu(x, stream=s).numpy()  # the parent's stream: its worker starts again
        busy = int(fanout.BUSY[1])
        product = twophase.matmul(a, b, stream=s).numpy()  # in parts: the helpers start again
        fresh = dev.stream()
        on_fresh = twophase.tanh(dev.tensor(xs, stream=fresh), stream=fresh).numpy()
        fresh.close()
        helpers = sum(th.name.startswith("twophase-fanout") for th in threading.enumerate())
        return on_parent, product, int(fanout.BUSY[1]) - busy, helpers, on_fresh

    on_parent, product, fanned, helpers, on_fresh = in_child(child)
    np.testing.assert_array_equal(on_parent, np.maximum(xs, 0))
    want = a_np.astype(np.float64) @ b_np.astype(np.float64)
    np.testing.assert_allclose(product, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert fanned == 1 and helpers >= 1  # the child's matmul ran on helper threads the child started
    np.testing.assert_allclose(on_fresh, np.tanh(xs.astype(np.float64)), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(twophase.relu(x, stream=s).numpy(), np.maximum(xs, 0))  # the parent carries on
    s.close()


def test_a_task_running_at_the_fork_fails_in_the_child_and_the_stream_recovers(
    dev: twophase.Device, rng: np.random.Generator, gate: Callable[[twophase.Stream], threading.Event]
) -> None:
    s = dev.stream()
    xs = rng.standard_normal(64).astype(np.float32)
    x = dev.tensor(xs, stream=s)
    s.synchronize()
    opened = gate(s)  # the worker blocks in this task across the fork
    queued = twophase.relu(x, stream=s)  # queued behind it
    time.sleep(0.05)

    def child() -> tuple[str, str, Any]:
        with pytest.raises(twophase.InvalidStateError) as err:
            s.synchronize()  # without the fork handling: never returns
        again = twophase.relu(x, stream=s).numpy()
        return str(err.value), "\n".join(getattr(err.value, "__notes__", [])), again

    message, notes, again = in_child(child)
    assert "forked while 1 task(s)" in message and "1 later task(s) were dropped" in message + notes
    np.testing.assert_array_equal(again, np.maximum(xs, 0))
    opened.set()
    np.testing.assert_array_equal(queued.numpy(), np.maximum(xs, 0))  # in the parent the task simply ends
    s.close()


def test_locks_other_threads_held_at_the_fork_are_free_in_the_child(dev: twophase.Device) -> None:
    """The memory pool's lock (a stream worker takes it to free blocks), the device registry's lock, an op's
    launch-memo lock (taken when a launch is built) and the device's lock of dropped streams' failures (a worker
    takes it as it stops), held by another thread of the parent across the fork."""
    device_module = sys.modules["twophase.runtime.device"]  # the package exports a function of that name
    relu = sys.modules["twophase.op"].registry["relu"]
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with dev.pool._lock, device_module._lock, relu._launch_lock, dev._dropped_failures.lock:
            held.set()
            release.wait(CHILD_LIMIT_S)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(30)
    try:

        def child() -> list[float]:
            block = dev.malloc(4096)  # the pool's lock
            block.free()
            device_module._DEVICES.pop("null", None)  # (the child's own registry) made again: under the lock
            assert twophase.device("null").name == "null"
            x = dev.tensor(np.arange(-1, 2, dtype=np.float32))
            dev.synchronize()  # the failures of dropped streams: under their lock
            return twophase.relu(x).numpy().tolist()  # a launch on new memory: built, memoised under the lock

        assert in_child(child) == [0.0, 0.0, 1.0]
    finally:
        release.set()
        holder.join(30)
    assert not holder.is_alive()


@pytest.mark.parametrize("blocking", [False, True], ids=["on-the-worker", "launch-blocking"])
def test_a_task_that_forks_goes_on_serving_its_stream_in_the_child(
    dev: twophase.Device, blocking: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host callback that forks: in the child the forking thread is in the middle of that task (on the stream's
    worker, or inline under launch blocking); the task is not lost and no second worker starts."""
    monkeypatch.setattr(twophase.settings, "launch_blocking", blocking)
    s = dev.stream()
    statuses: list[int] = []

    def fork_here() -> None:
        q = s._q
        pid = os.fork()
        if pid == 0:
            workers = sum(th.name == f"twophase-{s.name}" for th in threading.enumerate())
            mine = q.thread is threading.current_thread() if not blocking else q.thread is None
            os._exit(0 if q.error is None and mine and workers == (0 if blocking else 1) else 1)
        statuses.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))

    s.launch_callback(fork_here)
    s.synchronize()
    assert statuses == [0] and s.blocking == blocking
    s.close()
