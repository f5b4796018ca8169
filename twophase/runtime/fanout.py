"""Fan a kernel's parts out to helper threads that sleep when idle.

A launch planned in phase 1 as ``P`` independent parts (row ranges, head groups: closures over precomputed
views) runs them with :func:`run_parts`: the calling thread (a stream worker) and up to ``P - 1`` helpers claim
parts until none is left. Between launches a helper spins for the next one for ``settings.helper_spin_us``
(500 us by default, yielding its core to any other runnable thread every 20 us), then blocks on a queue: unlike
OpenMP or OpenBLAS workers, which spin for milliseconds, it soon leaves the cores that BLAS, another stream or
another library needs (why it spins at all: ``config.set_helper_spin``). Each part calls a serial ``nogil``
numba kernel or a numpy / BLAS routine that releases the GIL, so the parts run in parallel. While a launch runs,
helpers found on the launching thread's CPU (or asleep) are kept off it (``_Helpers.unstack``,
``runtime.placement``).
"""

from __future__ import annotations

import functools
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import config
from ..layout import same_view
from . import forking, placement
from .spin import count_and_wait, spin_until_total

__all__ = ["BUSY", "bound", "fanout_parts", "launcher", "pieces", "run_parts", "split_range", "workspace_launcher"]

Part = Callable[[], None]


# [launches running parts on helper threads now, such launches so far]: a host thread waiting for a stream spins
# only while the first is 0, and a stream's worker spins for its next task only when the second has not moved
# since its last spin (``stream.SYNC_SPIN_US``): the helpers spin after such a launch, and one more spinning
# thread would take the core the host thread needs (gelu of 128 x 1536 in two parts, launch + synchronize:
# 1.3x the time with both spinning, /tmp/w29/procab.py of the twenty-ninth session)
BUSY = np.zeros(2, np.int64)
_busy_lock = forking.lock()
DETERMINISTIC_PARTS = 8  # parts of every parallel kernel under set_deterministic(True), whatever the machine


def fanout_parts() -> int:
    """How many parts a parallel kernel is cut into: the threads that run them (:func:`worker_threads`), or
    ``DETERMINISTIC_PARTS`` under ``set_deterministic(True)``: the cut decides which sums meet in which order, so
    bitwise-reproducible results need one cut on every machine and thread setting (the threads still claim the
    parts one at a time)."""
    return DETERMINISTIC_PARTS if config.settings.deterministic else worker_threads()


def worker_threads() -> int:
    """Threads that run a launch's parts: the ``num_threads`` setting, else the CPUs this process may run on."""
    n = config.settings.num_threads
    return n if n > 0 else _cpus()


@functools.cache
def _cpus() -> int:
    """The CPUs this process may run on, read once: ``run_parts`` asks at every launch, and the affinity syscall
    costs ~0.5 us (an affinity changed later is not seen; ``set_num_threads`` is)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def split_range(n: int, parts: int, grain: int = 1) -> list[tuple[int, int]]:
    """``[0, n)`` cut into at most ``parts`` contiguous, non-empty ranges of nearly equal size, each at least
    ``grain`` long (fewer ranges when ``n`` is small)."""
    count = max(1, min(parts, n // max(grain, 1)))
    bounds = [n * i // count for i in range(count + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(count) if bounds[i + 1] > bounds[i]]


def pieces(out: Any, operands: tuple[Any, ...], parts: int, grain: int) -> list[tuple[Any, ...]]:
    """``(out piece, operand pieces...)`` cut along the first axis of ``out`` long enough for ``parts``
    ranges; an operand broadcast along that axis (missing, or of size 1) is passed whole. One piece, the arrays
    themselves, when ``out`` is small or an operand overlaps ``out`` other than as the same view (numpy buffers
    such overlaps within one call, and pieces would break that)."""
    whole = [(out, *operands)]
    if parts < 2 or out.size < 2 * grain:
        return whole
    for a in operands:
        if np.may_share_memory(a, out) and not same_view(a, out):
            return whole
    axis = next((i for i, n in enumerate(out.shape) if n >= parts), None)
    if axis is None:
        return whole
    inner = out.size // out.shape[axis]
    ranges = split_range(out.shape[axis], parts, max(1, grain // max(inner, 1)))

    def cut(a: Any, lo: int, hi: int) -> Any:
        ax = axis - (out.ndim - a.ndim)
        if ax < 0 or a.shape[ax] == 1:
            return a
        return a[(slice(None),) * ax + (slice(lo, hi),)]

    return [(cut(out, lo, hi), *(cut(a, lo, hi) for a in operands)) for lo, hi in ranges]


class _Job:
    """One launch's parts, claimed one at a time by whichever thread is free.

    Two counts of finished parts: ``left``, counted down under the lock as each part ends (it releases ``done``
    for a caller that blocks), and ``finished``, one slot per thread (0: the caller, i: helper i), which a
    helper adds to from compiled code as it goes back to spinning (``count_and_wait``). The caller spins on
    ``finished``: it then sees the helpers' parts done only once they no longer hold the GIL, so it never has
    to sleep until a helper lets go of it."""

    __slots__ = ("parts", "claim", "left", "lock", "done", "error", "finished")

    def __init__(self, parts: Sequence[Part], threads: int) -> None:
        self.parts = parts
        self.claim = itertools.count()
        self.left = np.array([len(parts)], np.int64)
        self.lock = threading.Lock()
        self.done = threading.Lock()  # held until the last part is done, released by whoever finishes it (an Event
        self.done.acquire()  # costs ~4 us more to make: it is a Condition over a lock, in Python)
        self.error: BaseException | None = None
        self.finished = np.zeros(threads, np.int64)

    def work(self, gate: np.ndarray[Any, Any] | None = None, ticket: int = 0) -> int:
        """Claim and run parts until none is left; how many this thread ran. ``gate[0]`` is raised to ``ticket``
        just before the first part runs."""
        n = len(self.parts)
        ran = 0
        while (i := next(self.claim)) < n:
            if gate is not None:
                if gate[0] < ticket:
                    gate[0] = ticket
                gate = None
            try:
                self.parts[i]()
            except BaseException as exc:  # noqa: BLE001  (re-raised on the launching thread)
                if self.error is None:
                    self.error = exc
            ran += 1
            with self.lock:
                left = int(self.left[0]) - 1
                if left == 0:
                    self.done.release()
                self.left[0] = left
        return ran


class _Helpers:
    """Daemon threads taking jobs from one queue; started on first use, one fewer than the parts asked for."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.posted = np.zeros(1, np.int64)  # jobs put so far: a helper spins on it before it blocks
        self.gate = np.zeros(1, np.int64)  # posted count whose launching thread is entering its own part
        self.count = 0
        self.lock = threading.Lock()
        # per helper (slot - 1): its native thread id once it runs; (the CPU it saw itself on as it began to spin
        # for a launch, when that spin ends: after that it is as good as asleep, on its way to block), published
        # as one tuple so that a reader never pairs one spin's CPU with another's end; and its affinity while
        # ``unstack`` keeps it off the launching thread's CPU
        self.tids: list[int] = []
        self.waits: list[tuple[int, float]] = []
        self.masks: list[set[int] | None] = []

    def ensure(self, n: int) -> None:
        if self.count >= n:
            return
        # the spins compiled (or loaded from the cache) here, not by a helper while it holds the GIL
        count_and_wait(np.zeros(1, np.int64), 0, 0, self.posted, -1, 0)
        spin_until_total(np.zeros(1, np.int64), 0)
        with self.lock:
            while self.count < n:
                self.count += 1
                self.tids.append(0)
                self.waits.append((placement.UNKNOWN, 0.0))
                self.masks.append(None)
                threading.Thread(
                    target=self._loop, args=(self.count,), name=f"twophase-fanout-{self.count - 1}", daemon=True
                ).start()

    def post(self, job: _Job, n: int) -> int:
        """Queue ``job`` for ``n`` helpers; the posted count, the caller's ticket for the gate."""
        for _ in range(n):
            self.jobs.put(job)
        self.posted[0] += n
        return int(self.posted[0])

    def unstack(self) -> list[int]:
        """Keep off the calling thread's CPU (and off one another's) each helper that spins there or that sleeps
        (the kernel picks where it wakes, for the job and again for the GIL), until :meth:`restack`: a runnable
        helper moves at once (``runtime.placement``). The slots narrowed; none when every helper spins on a CPU
        of its own (the check costs ~0.4 us), or where the CPU cannot be known."""
        here = placement.current_cpu()
        if here == placement.UNKNOWN:
            return []
        now = time.perf_counter()
        taken = {here}
        stacked = []
        for i, (cpu, until) in enumerate(self.waits):
            if until > now and cpu not in taken:
                taken.add(cpu)
            else:
                stacked.append(i)
        moved = []
        if stacked:
            with self.lock:
                for i in stacked:
                    tid = self.tids[i]
                    if tid and self.masks[i] is None and (mask := placement.narrowed(tid, taken)) is not None:
                        self.masks[i] = mask
                        moved.append(i)
        return moved

    def restack(self, slots: list[int]) -> None:
        """Give the helpers :meth:`unstack` narrowed their affinity back."""
        with self.lock:
            for i in slots:
                mask, self.masks[i] = self.masks[i], None
                if mask is not None:
                    placement.restore(self.tids[i], mask)

    def _loop(self, slot: int) -> None:
        """Take jobs for ever: the next one from the queue, else spin until one is posted, else block; the parts
        it ran of a job are counted into the job's ``finished[slot]`` as it takes the next or starts to wait.
        Parts run with numpy's floating-point warnings off, as stream tasks do (``runtime.stream``)."""
        np.seterr(all="ignore")
        self.tids[slot - 1] = threading.get_native_id()
        nothing = np.zeros(slot + 1, np.int64)
        finished, ran = nothing, 0
        while True:
            seen = int(self.posted[0])
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                spin = config.settings.helper_spin_us
                self.waits[slot - 1] = (placement.current_cpu(), time.perf_counter() + spin * 1e-6)
                changed = count_and_wait(finished, slot, ran, self.posted, seen, spin, self.gate)
                finished, ran = nothing, 0
                if changed:
                    continue
                job = self.jobs.get()
            else:
                count_and_wait(finished, slot, ran, self.posted, seen, 0)
            ran = job.work()
            # a job made before this helper started has no slot for it: its caller falls back on ``left``
            finished = job.finished if slot < job.finished.size else nothing
            del job  # its parts' views would pin their memory while this helper waits for the next job


_helpers = _Helpers()


@forking.on_fork
def _new_helpers() -> None:
    """In a forked child no helper came along, nor any launch running parts on them: the next launch that wants
    helpers starts them anew."""
    global _helpers
    _helpers = _Helpers()
    BUSY[0] = 0


def run_parts(parts: Sequence[Part]) -> None:
    """Run every part, on the calling thread and on helpers (``worker_threads()`` threads at most: parts must not
    wait for one another), and return when all are done; the first error a part raised is raised here (the other
    parts still run to the end, so no kernel is left writing)."""
    if len(parts) <= 1:
        for part in parts:
            part()
        return
    helpers = min(len(parts), worker_threads()) - 1  # more parts than threads: each thread claims several
    if helpers == 0:  # one thread: the caller runs every part
        job = _Job(parts, 1)
        job.work()
    else:
        _helpers.ensure(helpers)
        job = _Job(parts, _helpers.count + 1)
        with _busy_lock:
            BUSY[0] += 1
            BUSY[1] += 1
        moved = _helpers.unstack()
        try:
            ticket = _helpers.post(job, helpers)
            job.finished[0] = job.work(_helpers.gate, ticket)
            # the other parts are ending on helpers: a blocked wait wakes 25-90 us late
            if not spin_until_total(job.finished, len(parts)) and job.left[0]:
                job.done.acquire()
        finally:
            if moved:
                _helpers.restack(moved)
            with _busy_lock:
                BUSY[0] -= 1
    if job.error is not None:
        raise job.error


def bound(calls: Sequence[Part]) -> Part:
    """Parts as one call: the one part itself, else :func:`run_parts` over them."""
    return calls[0] if len(calls) == 1 else functools.partial(run_parts, calls)


def launcher(calls: Sequence[Part]) -> Callable[[Any], None]:
    """The phase-2 launch of parts made in phase 1 (:func:`bound`); it takes the workspace and ignores it."""
    call = bound(calls)
    return lambda _: call()


def workspace_launcher(bind: Callable[[Any], Callable[[], None]]) -> Callable[[Any], None]:
    """The phase-2 launch of work that needs views of the workspace: ``bind(ws)`` makes them and returns the
    bound work, which runs. It is made again only when the workspace changes (address or size): a repeatable
    executor or a graph replay launches on the same one every time, and binding costs Python per launch. The
    memo is one (key, work) tuple, replaced whole, so a launch never pairs one workspace's key with another's
    work."""
    memo: list[tuple[tuple[int, int], Callable[[], None]] | None] = [None]

    def launch(ws: Any) -> None:
        key = (ws.ctypes.data, ws.nbytes)
        held = memo[0]
        if held is None or held[0] != key:
            held = memo[0] = (key, bind(ws))
        held[1]()

    return launch
