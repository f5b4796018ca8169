"""Where threads run (runtime.placement), and the fan-out keeping its helpers off the launching thread's CPU while
a launch runs (fanout._Helpers.unstack): checked by the affinity each thread has inside its part, never by time."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import twophase
from twophase.runtime import fanout, placement
from twophase.runtime.fanout import run_parts

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cpus = pytest.mark.skipif(
    len(CPUS) < 2 or placement.current_cpu() == placement.UNKNOWN, reason="needs two CPUs and sched_getcpu"
)


def in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a new thread (its affinity is its own: pinning it leaves pytest's thread alone); its result,
    or its error raised here."""
    out: list[Any] = []

    def body() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001  (re-raised below)
            out.append(("err", exc))

    th = threading.Thread(target=body)
    th.start()
    th.join(30)
    assert out, "the thread did not finish"
    kind, value = out[0]
    if kind == "err":
        raise value
    return value


@needs_two_cpus
def test_current_cpu_is_one_the_thread_may_run_on() -> None:
    def pinned(cpu: int) -> int:
        os.sched_setaffinity(0, {cpu})
        return placement.current_cpu()

    for cpu in CPUS[:2]:
        assert in_thread(lambda cpu=cpu: pinned(cpu)) == cpu  # type: ignore[misc]


@needs_two_cpus
def test_narrowed_keeps_a_thread_off_the_cpus_and_restore_gives_its_affinity_back() -> None:
    a, b = CPUS[:2]
    ready, go = threading.Event(), threading.Event()
    seen: list[tuple[int, set[int]]] = []

    def body() -> None:
        os.sched_setaffinity(0, {a, b})
        ready.set()
        go.wait(10)
        seen.append((placement.current_cpu(), os.sched_getaffinity(0)))

    th = threading.Thread(target=body)
    th.start()
    ready.wait(10)
    tid = th.native_id
    assert tid is not None
    mask = placement.narrowed(tid, {a})
    assert mask == {a, b}
    assert os.sched_getaffinity(tid) == {b}
    go.set()
    th.join(10)
    assert seen == [(b, {b})]  # it ran where it was sent
    assert placement.narrowed(tid, {a}) is None  # a thread that ended: nothing to change


@needs_two_cpus
def test_narrowed_changes_nothing_that_would_leave_no_cpu_or_does_not_apply() -> None:
    a, b = CPUS[:2]

    def check() -> tuple[Any, ...]:
        tid = threading.get_native_id()
        os.sched_setaffinity(0, {a})
        alone = placement.narrowed(tid, {a}), os.sched_getaffinity(0)
        elsewhere = placement.narrowed(tid, {b}), os.sched_getaffinity(0)
        return alone + elsewhere

    assert in_thread(check) == (None, {a}, None, {a})


@pytest.fixture
def two_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Launches in two parts on two threads, with helpers of their own (so one helper, whatever earlier tests
    started); yields its native id once it runs."""
    monkeypatch.setattr(twophase.settings, "num_threads", 2)
    monkeypatch.setattr(fanout, "_helpers", fanout._Helpers())
    barrier = threading.Barrier(2, timeout=10)
    run_parts([barrier.wait, barrier.wait])  # the helper ran one: it has set its id
    assert fanout._helpers.count == 1 and fanout._helpers.tids[0]
    yield fanout._helpers.tids


def published(cpu: int) -> bool:
    """Whether the helper publishes ``cpu`` within a second (it does as it goes back to wait)."""
    for _ in range(1000):
        if fanout._helpers.waits[0][0] == cpu:
            return True
        threading.Event().wait(0.001)
    return False


def launch_from(cpu: int) -> list[tuple[str, set[int], int]]:
    """Launch two parts from a thread pinned to ``cpu``; each part waits for the other (so each thread runs
    one) and records (thread name, its affinity, its CPU)."""
    barrier = threading.Barrier(2, timeout=10)
    seen: list[tuple[str, set[int], int]] = []

    def part() -> None:
        barrier.wait()
        seen.append((threading.current_thread().name, os.sched_getaffinity(0), placement.current_cpu()))

    def launch() -> None:
        os.sched_setaffinity(0, {cpu})
        run_parts([part, part])

    in_thread(launch)
    return seen


@needs_two_cpus
@pytest.mark.parametrize(("spin_us", "home"), [(200_000, 0), (0, 0), (0, 1)], ids=["spinning", "asleep", "asleep-away"])
def test_a_helper_on_the_launching_threads_cpu_or_asleep_runs_its_part_elsewhere_then_gets_its_affinity_back(
    two_threads: list[int], spin_us: int, home: int
) -> None:
    """The helper published the launching thread's CPU as it began to spin, or it sleeps (spin 0; wherever it
    last ran: the kernel picks where it wakes): it runs its part kept off the launching thread's CPU, and has its
    own affinity again once the launch returns."""
    a, b = CPUS[:2]
    (tid,) = two_threads
    old = twophase.settings.helper_spin_us
    twophase.set_helper_spin(spin_us)
    try:
        os.sched_setaffinity(tid, {CPUS[home]})
        launch_from(a)  # the helper runs its part there, then spins (or blocks) there and publishes it
        assert published(CPUS[home])
        os.sched_setaffinity(tid, {a, b})  # a runnable thread whose affinity still holds its CPU stays on it
        seen = launch_from(a)
    finally:
        twophase.set_helper_spin(old)
    helper = [(mask, cpu) for name, mask, cpu in seen if name.startswith("twophase-fanout-")]
    assert helper == [({b}, b)]
    assert [(mask, cpu) for name, mask, cpu in seen if not name.startswith("twophase-fanout-")] == [({a}, a)]
    assert os.sched_getaffinity(tid) == {a, b}
    assert fanout._helpers.masks == [None]


@needs_two_cpus
def test_a_helper_spinning_on_a_cpu_of_its_own_is_left_alone(
    two_threads: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = CPUS[:2]
    (tid,) = two_threads
    calls: list[Any] = []
    real = placement.narrowed
    monkeypatch.setattr(placement, "narrowed", lambda *args: calls.append(args) or real(*args))
    old = twophase.settings.helper_spin_us
    twophase.set_helper_spin(200_000)
    try:
        os.sched_setaffinity(tid, {b})
        launch_from(a)  # the helper now spins on b
        assert published(b)
        os.sched_setaffinity(tid, {a, b})  # it stays on b; narrowed, it would see {b}
        calls.clear()
        seen = launch_from(a)
    finally:
        twophase.set_helper_spin(old)
    assert calls == []
    assert sorted((sorted(mask), name.startswith("twophase-fanout-")) for name, mask, _ in seen) == [
        ([a], False),
        ([a, b], True),
    ]
