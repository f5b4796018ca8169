"""Streams (in-order task queues served by a worker thread) and events.

A task is ``(fn, arg, owner)``; the worker calls ``fn(arg)``. ``owner`` names the work in error
messages: an executor, a label, or ``CONTROL`` for the runtime's own markers, which always run.

A worker that runs out of tasks spins briefly for the next one, and a host thread in ``synchronize`` spins
briefly for the work to end, both without the GIL, before they block (``SYNC_SPIN_US``): a thread woken from a
block starts tens of microseconds late on a VM, twice per launch + synchronize.

Tasks run with numpy's floating-point warnings off (``np.errstate(all="ignore")``): a kernel's overflow, division
by zero or invalid operation gives inf / NaN as IEEE says, as the numba kernels do, without a ``RuntimeWarning``
from whichever numpy call the launch happens to make.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import config
from ..errors import InvalidStateError, KernelError, ParamError, TwoPhaseError, refuse_pickle
from . import forking
from .fanout import BUSY
from .spin import count_and_wait, spin_until_reached

if TYPE_CHECKING:
    from .device import Device

__all__ = ["Stream", "Event", "CONTROL", "QueueRecords", "running_queue", "on_worker", "check_stream"]

CONTROL = "<control>"
_NEVER = 1 << 62  # wake_at when no host thread waits: no seq reaches it
# microseconds a stream's worker that ran out of tasks spins for the next one, and a host thread waiting for a
# stream spins for its work to end (on the count the worker publishes as it runs out of tasks; not while a launch
# runs parts on helper threads: ``fanout.BUSY``), before they block; never more than the helpers' spin
# (``config.set_helper_spin``; 0: no spin). Both spins run without the GIL. Each of the two wake-ups of a launch +
# synchronize took ~50 us on a 2-vCPU VM: a gelu of 64 elements 104 us against 3 us launch-blocking, 19 us with
# the spins (/tmp/w29/rt.py of the twenty-ninth session). Launch + synchronize against the commit before, six
# alternating processes (/tmp/w29/procab2.py): a 16-element op 19-26 us against 22-211 (median ~135), a one-part
# gelu of 64 x 1536 92-131 us against 105-406 (~210); two-part gelu and conv2d launches unchanged (the worker
# does not spin after those), 100 tiny ops queued then one synchronize 2.6-3.4 us an op against 2.8-3.4.
SYNC_SPIN_US = 100.0


def _spin_us() -> float:
    """Microseconds the worker and a synchronizing host thread spin (``SYNC_SPIN_US``, capped by the setting)."""
    return min(float(config.settings.helper_spin_us), SYNC_SPIN_US)


# Called on the worker after each task as cb(stream_name, owner, t0, t1, seq). Shared by every stream
# (profiler, sanitizer); run_one checks it for emptiness only, so an empty list costs nothing.
TASK_LISTENERS: list[Callable[[str, Any, float, float, int], None]] = []
# Held while a stream's ``_q`` / ``_enqueue`` are switched: launch-blocking mode, capture begin and end.
SWITCH_LOCK = forking.lock()
_running = threading.local()


def running_queue() -> Any:
    """For a task listener: the queue whose task the calling thread runs (set only while listeners exist)."""
    return getattr(_running, "q", None)


def on_worker() -> bool:
    """Whether the calling thread is a stream's worker: a task there must not block on work that may be queued
    after it (the pool's out-of-memory wait for pending frees)."""
    return bool(getattr(_running, "worker", False))


class QueueRecords:
    """Records kept per stream queue (weakly: they go with the queue), under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        forking.locks_of(self, "_lock")  # a stream worker may hold it at a fork
        self._by_queue: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()

    def forget(self, q: Any) -> None:
        """Drop every record of ``q`` (its stream was closed)."""
        with self._lock:
            self._by_queue.pop(q, None)

    def clear(self) -> None:
        with self._lock:
            self._by_queue.clear()


def _count(owner: Any) -> None:
    """An executor's launch count goes up when its task has run (on the worker: nothing on the enqueue path)."""
    if type(owner) is not str:
        try:
            owner.launches += 1
        except AttributeError:
            pass


def describe_owner(owner: Any) -> str:
    """How a failed task is named: ``op 'softmax' (executor #3, implementation 'rows')``."""
    describe = getattr(owner, "describe", None)
    return describe() if describe is not None else str(owner)


def task_failure(exc: BaseException, owner: Any, where: str, tail: str = "") -> KernelError:
    """The KernelError reporting ``exc``, raised by the task of ``owner``: where, the exception, then ``tail``."""
    op = getattr(getattr(owner, "op", None), "name", None)
    return KernelError(f"{where}: {type(exc).__name__}: {exc}{tail}", op=op)


class DroppedFailures:
    """Failures left on streams their callers dropped, kept for the device's next ``synchronize`` (as CUDA's device
    sync reports an error of any of its streams): taken from a queue when its worker stops, or when the device
    drains it, whichever comes first (under one lock: never both)."""

    __slots__ = ("lock", "failures", "__weakref__")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.failures: list[TwoPhaseError] = []
        forking.locks_of(self, "lock")  # a stream worker may hold it at a fork

    def take(self, q: _Queue) -> None:
        """Move ``q``'s pending failure, as its stream's sync would have raised it, into the list."""
        with self.lock:
            if q.error is None:
                return
            try:
                q.raise_pending(q.submitted)
            except TwoPhaseError as exc:  # what raise_pending raises: kept to be raised by the device's sync
                exc.add_note_line("the stream was dropped by its caller: reported by Device.synchronize")
                self.failures.append(exc)

    def raise_first(self) -> None:
        """Raise the first failure kept (the others named in its notes), and forget them all."""
        with self.lock:
            found, self.failures = self.failures, []
        if not found:
            return
        first = found[0]
        for other in found[1:]:
            first.add_note_line(f"also failed on another dropped stream: {type(other).__name__}: {other}")
        raise first


class _Queue:
    """The state shared by a stream and its worker; the worker holds only this, so streams can be collected."""

    def __init__(self, name: str, blocking: bool) -> None:
        self.name = name
        self.tasks: collections.deque[tuple[Callable[[Any], Any], Any, Any, int]] = collections.deque()
        self.submitted = 0
        self.done = 0
        self._new_signals()
        # while the worker spins for the next task (``spinning``), an enqueue counts into ``posted``; as it runs out of
        # tasks the worker publishes ``done`` into ``finished`` from compiled code, once it has let go of the GIL
        self.posted = np.zeros(1, np.int64)
        self.finished = np.zeros(1, np.int64)
        self.gate = np.zeros(1, np.int64)  # ``posted`` as a host thread began to spin without the GIL
        self.error: tuple[BaseException, Any, int] | None = None
        self.dropped = 0
        self.closed = False
        self.thread: threading.Thread | None = None
        self.current: Any = None  # owner of the task being run (for observers)
        self.listeners = TASK_LISTENERS
        self.dropped_failures: DroppedFailures | None = None  # where a failure goes if the stream is dropped
        self.inline_tls = threading.local()  # inline tasks running on each thread (nested ones do not wait)
        self.enqueue = self.enqueue_inline if blocking else self.enqueue_async
        forking.track(self)

    def _new_signals(self) -> None:
        """The locks, the condition and the flags threads signal each other with, none held and nobody waiting."""
        self.lock = threading.Lock()
        self.cond = threading.Condition(threading.Lock())
        self.waiting: list[int] = []  # the seqs host threads wait for (under cond)
        self.wake_at = _NEVER  # min(waiting): a finished task notifies only from there on
        self.idle = False
        self.wake = threading.Lock()
        self.wake.acquire()
        self.spinning = False

    def after_fork(self) -> None:
        """In a forked child, where of the parent's threads only the forking one runs: the locks anew and no
        waiter; the tasks that were running (on the worker, or inline on another thread) never end here, so the
        first of them fails, reported at the next sync, and the later ones are dropped, as after any failure;
        the worker, if there was one, starts again for the tasks still queued. (A task that forks runs on in the
        child, on the forking thread, which goes on serving the queue as before.)"""
        self._new_signals()
        if getattr(self.inline_tls, "depth", 0) or (
            self.thread is not None and self.thread is threading.current_thread()
        ):
            return  # the forking thread is running one of this queue's tasks: it goes on with the queue
        queued = next((task[3] for task in self.tasks if task[0] is not None), self.submitted + 1)
        lost = queued - 1 - self.done
        if lost > 0:
            if self.error is None:
                exc = InvalidStateError(
                    f"the process forked while {lost} task(s) of stream '{self.name}' were running: in this child "
                    "they never finish and their outputs hold whatever the fork caught",
                    op="stream",
                    arg="stream",
                )
                self.error = (exc, self.current if self.current is not None else "a task", self.done + 1)
                lost -= 1
            self.dropped += lost
            self.done = queued - 1
        self.current = None
        self.finished[0] = self.done  # what the new worker has published (``serve``)
        if self.thread is not None:
            self.thread = None
            if self.tasks or not self.closed:
                self.start()

    def start(self) -> None:
        """Start the worker thread."""
        count_and_wait(np.zeros(1, np.int64), 0, 0, self.posted, -1, 0)  # compiled (or loaded) here, not by the
        spin_until_reached(self.finished, 0, 0, BUSY)  # worker while it holds the GIL
        self.thread = threading.Thread(target=self.serve, name=f"twophase-{self.name}", daemon=True)
        self.thread.start()

    # ---- producer side
    def enqueue_async(self, fn: Callable[[Any], Any], arg: Any, owner: Any) -> int:
        with self.lock:
            seq = self.submitted = self.submitted + 1
            self.tasks.append((fn, arg, owner, seq))
            if self.spinning:
                self.posted[0] += 1
        if self.idle:
            self.idle = False
            try:
                self.wake.release()
            except RuntimeError:
                pass
        return seq

    def enqueue_null(self, fn: Callable[[Any], Any], arg: Any, owner: Any) -> int:
        """NULL backend: count the task as done at once; run only the runtime's markers and callbacks (a failure
        is reported at the next sync, as on any stream)."""
        seq = self.submitted = self.done = self.submitted + 1
        if type(owner) is str:  # the runtime's markers and callbacks (CONTROL is one)
            self.run_one(fn, arg, owner, seq)
        else:
            _count(owner)
        return seq

    def enqueue_inline(self, fn: Callable[[Any], Any], arg: Any, owner: Any) -> int:
        if self.thread is not None and self.thread is threading.current_thread():
            # a task on the worker (queued before the switch to launch blocking) enqueuing on its own stream:
            # queued behind the tasks already there, as before the switch; run inline it would wait for itself
            return self.enqueue_async(fn, arg, owner)
        with self.lock:
            seq = self.submitted = self.submitted + 1
        tls = self.inline_tls
        depth = getattr(tls, "depth", 0)
        if self.done < seq - 1 and not depth:  # tasks queued before a switch to launch blocking run first, in
            self.wait_for(seq - 1, raise_errors=False)  # order (not from inside an inline task: it runs nested)
        tls.depth = depth + 1
        try:
            with np.errstate(all="ignore"):
                self.run_one(fn, arg, owner, seq)  # outside the lock: a callback may enqueue on this stream
        finally:
            tls.depth = depth
            # a nested task (enqueued by an inline task on this stream) ends inside the task that enqueued it:
            # only the outermost one publishes, the last seq run within it, once it has ended itself
            last = max(seq, getattr(tls, "last", 0))
            if depth:
                tls.last = last
            else:
                tls.last = 0
                if last > self.done:
                    self.done = last
                if last >= self.wake_at:
                    with self.cond:
                        self.cond.notify_all()
        self.raise_pending(seq)
        return seq

    def run_one(self, fn: Callable[[Any], Any], arg: Any, owner: Any, seq: int) -> None:
        if self.error is not None and owner is not CONTROL:
            self.dropped += 1
            return
        self.current = owner
        listeners = self.listeners
        try:
            if listeners:
                outer = getattr(_running, "q", None)  # a blocking stream's task may run another's inline
                _running.q = self
                try:
                    t0 = time.perf_counter()
                    try:
                        fn(arg)
                    except BaseException as failed:
                        self._tell_listeners(owner, t0, seq, failed)
                        raise
                    self._tell_listeners(owner, t0, seq, None)
                finally:
                    _running.q = outer
            else:
                fn(arg)
        except BaseException as exc:  # noqa: BLE001 - any failure is reported at the next sync
            self.error = (exc, owner, seq)
        else:
            _count(owner)
        finally:
            self.current = None

    def _tell_listeners(self, owner: Any, t0: float, seq: int, failed: BaseException | None) -> None:
        """The listeners after a task, also one that raised (``failed``): what one of them finds (the sanitizer: a
        guard zone the kernel overwrote) is the task's failure, caused by the kernel's own error if it had one."""
        t1 = time.perf_counter()
        for cb in tuple(self.listeners):  # another thread may remove one meanwhile: none is skipped
            try:
                cb(self.name, owner, t0, t1, seq)
            except BaseException as found:  # noqa: BLE001 - reported in place of the kernel's own error
                if failed is None:
                    raise
                raise found from failed

    # ---- worker side
    def serve(self) -> None:
        np.seterr(all="ignore")  # this thread's numpy error state (the module docstring says why)
        _running.worker = True
        tasks = self.tasks
        published, fanned = int(self.finished[0]), int(BUSY[1])  # finished: nonzero in a forked child
        while True:
            try:
                fn, arg, owner, seq = tasks.popleft()
            except IndexError:
                # out of tasks: publish the done count and spin for the next task (an enqueue made after
                # ``spinning`` is set counts into ``posted``; one made before is in ``tasks``), then block
                self.spinning = True
                seen = int(self.posted[0])
                if not tasks:
                    count, published = self.done - published, self.done
                    quiet = int(BUSY[1]) == fanned  # no launch ran parts on helpers since the last spin
                    count_and_wait(self.finished, 0, count, self.posted, seen, _spin_us() if quiet else 0.0, self.gate)
                    fanned = int(BUSY[1])
                self.spinning = False
                if tasks:
                    continue
                self.idle = True
                if tasks:
                    self.idle = False
                    continue
                self.wake.acquire()
                continue
            if fn is None:  # shut down: closed (its failure was raised) or dropped (the device's sync raises it)
                if self.dropped_failures is not None:
                    self.dropped_failures.take(self)
                return
            if self.done < seq - 1:  # an inline task (launch blocking was on) is still running: it goes first
                self.block_until(seq - 1)
            self.run_one(fn, arg, owner, seq)
            del fn, arg, owner  # not kept alive until the next task: a launch's views would pin their memory
            self.done = seq
            if seq >= self.wake_at:
                with self.cond:
                    self.cond.notify_all()

    # ---- synchronization
    def wait_for(self, seq: int, raise_errors: bool = True) -> None:
        if self.done < seq and not self._spun_for(seq):
            self.refuse_own_task()
            self.block_until(seq)
        if raise_errors:
            self.raise_pending(seq)

    def block_until(self, seq: int) -> None:
        """Block until task ``seq`` has run (``wait_for`` without its checks)."""
        with self.cond:  # the worker reads wake_at after setting done: one of the two sees the other's write
            waiting = self.waiting
            waiting.append(seq)
            self.wake_at = min(waiting)
            try:
                while self.done < seq:
                    self.cond.wait(0.05)
            finally:
                waiting.remove(seq)
                self.wake_at = min(waiting, default=_NEVER)

    def in_own_task(self) -> bool:
        """Whether the calling thread runs one of this queue's tasks (on the worker, or inline)."""
        return threading.current_thread() is self.thread or bool(getattr(self.inline_tls, "depth", 0))

    def refuse_own_task(self) -> None:
        """Raise if the calling thread runs one of this queue's tasks: a wait there for the queue's work would
        wait for that task itself and never end (CUDA refuses it from a host callback: cudaErrorNotPermitted)."""
        if self.in_own_task():
            raise InvalidStateError(
                f"called from a task (a callback) of stream '{self.name}': synchronizing that stream "
                "(Stream.synchronize or close, Event.synchronize, Device.synchronize) or reading its tensors on "
                "the host (Tensor.numpy) there would wait for the callback itself and never return; do it from "
                "another thread once the callback has run, or enqueue what follows on the stream (launch_callback)",
                op="synchronize",
                arg="stream",
            )

    def _spun_for(self, seq: int) -> bool:
        """Whether a spin (not on the worker itself, which publishes the count) saw task ``seq`` done."""
        return (
            self.thread is not None
            and threading.current_thread() is not self.thread
            and spin_until_reached(self.finished, seq, _spin_us(), BUSY, self.gate, int(self.posted[0]))
        )

    def drain(self) -> None:
        """Wait for every task enqueued so far without raising: a failure stays pending for the next sync."""
        self.wait_for(self.submitted, raise_errors=False)

    @property
    def inline(self) -> bool:
        return self.enqueue == self.enqueue_inline

    def set_inline(self, inline: bool) -> None:
        """Run later tasks inline on the enqueuing thread, or on the worker (started if need be); either kind
        waits for the tasks enqueued before it (each task carries its seq), so the switch needs no drain."""
        if self.closed:
            return
        self.enqueue = self.enqueue_inline if inline else self.enqueue_async
        if not inline and self.thread is None:
            self.start()

    def raise_pending(self, seq: int) -> None:
        err = self.error
        if err is None or err[2] > seq:
            return
        exc, owner, _ = err
        self.error = None
        dropped, self.dropped = self.dropped, 0
        who = "a wait_event" if owner is CONTROL else describe_owner(owner)  # the only control task that raises
        where = f"{who} failed on stream '{self.name}'"
        tail = f"{dropped} later task(s) were dropped" if dropped else "no later task was dropped"
        if isinstance(exc, TwoPhaseError):
            exc.add_note_line(f"{where}; {tail}")
            raise exc
        raise task_failure(exc, owner, where, f"; {tail}") from exc

    def enqueue_closed(self, fn: Callable[[Any], Any], arg: Any, owner: Any) -> int:
        raise InvalidStateError(f"stream '{self.name}' is closed: it takes no more work", op="stream", arg="stream")

    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            self.enqueue = self.enqueue_closed
            if self.thread is not None:
                self.tasks.append((None, None, None, 0))  # type: ignore[arg-type]
                self.posted[0] += 1
                try:
                    self.wake.release()
                except RuntimeError:
                    pass


class Stream:
    """An in-order queue of device work. Made by ``dev.stream()``; every asynchronous call takes one."""

    __slots__ = ("device", "name", "_q", "_enqueue", "__weakref__", "_finalizer")

    device: Device
    name: str
    _q: _Queue
    _enqueue: Callable[[Callable[[Any], Any], Any, Any], int]
    _finalizer: Any

    _ids = 0

    def __init__(self, *_: Any, **__: Any) -> None:
        raise TypeError("Streams are made by a device: use dev.stream()")

    @classmethod
    def _make(cls, device: Device, name: str | None, blocking: bool, worker: bool) -> Stream:
        self = object.__new__(cls)
        Stream._ids += 1
        self.device = device
        self.name = name or f"{device.name}:{Stream._ids}"
        self._q = _Queue(self.name, blocking)
        if worker and not blocking:
            self._q.start()
        self._enqueue = self._q.enqueue
        self._finalizer = weakref.finalize(self, self._q.shutdown)
        return self

    def __reduce__(self) -> Any:
        refuse_pickle(self, "make a stream in the receiving process with dev.stream()")

    def __repr__(self) -> str:
        return f"Stream('{self.name}', pending={self._q.submitted - self._q.done})"

    @property
    def _work_q(self) -> _Queue:
        """The queue the stream's work runs on: during a capture ``_q`` is the capture's stand-in, whose tasks
        never run (and count as done once the capture ends); what must wait for real work keeps this one."""
        q = self._q
        return q if type(q) is _Queue else q._real  # type: ignore[attr-defined]  # the stand-in

    @property
    def _submitted(self) -> int:
        return self._q.submitted

    @property
    def _done(self) -> int:
        return self._q.done

    @property
    def blocking(self) -> bool:
        return self._q.inline

    def _set_blocking(self, blocking: bool) -> None:
        """Switch launch-blocking mode (used by the ``TWOPHASE_LAUNCH_BLOCKING`` setter); never raises a pending
        failure, which stays for the next sync. A captured stream's queue (a stand-in passing these calls to the
        real one) switches now and its launches use the new mode once the capture ends."""
        if not self.device.runs_kernels:
            return
        with SWITCH_LOCK:
            q = self._q
            q.set_inline(blocking or not type(self.device).has_worker)
            self._enqueue = q.enqueue  # during a capture: the stand-in's, which records

    def _wait_for(self, seq: int) -> None:
        self._q.wait_for(seq)

    def synchronize(self) -> None:
        """Wait for every task enqueued so far; raise the first failure among them (then the stream is usable)."""
        q = self._q
        q.wait_for(q.submitted)

    def query(self) -> bool:
        """True when every task enqueued so far has completed."""
        q = self._q
        return q.done >= q.submitted

    def record_event(self, timing: bool = True) -> Event:
        """An event that completes when the work enqueued so far has; it records the time it completed."""
        ev = Event._make(self)
        ev.seq = self._enqueue(_mark_time if timing else _mark, ev, CONTROL)
        return ev

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait until ``event`` has completed (no host block)."""
        if not isinstance(event, Event):
            raise ParamError(op="Stream.wait_event", arg="event", expected="a twophase Event", got=event)
        if event.stream is self:
            return
        self._enqueue(_wait_other, event, CONTROL)

    def launch_callback(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` on the stream's worker once the work enqueued before it has completed."""
        if not callable(fn):
            raise ParamError(op="Stream.launch_callback", arg="fn", expected="a callable", got=fn)
        self._enqueue(_call, fn, f"callback {getattr(fn, '__qualname__', fn)!s}")

    def close(self) -> None:
        """Finish pending work and stop the worker thread; later launches raise ``InvalidStateError``. A pending
        failure is raised, and the stream is closed all the same. Refused, leaving it open, from its own tasks."""
        self._work_q.refuse_own_task()
        try:
            self.synchronize()
        finally:
            self._finalizer()
            self._enqueue = self._q.enqueue

    @property
    def closed(self) -> bool:
        return self._q.closed


def _mark(ev: Event) -> None:
    """An event's task: it keeps the failure pending on its stream as it completes, for the streams that wait for
    it (``_wait_other``) after a synchronize of its own stream has raised and cleared that failure."""
    ev.failure = ev.stream._work_q.error


def _mark_time(ev: Event) -> None:
    ev.time = time.perf_counter()
    _mark(ev)


def _wait_other(ev: Event) -> None:
    """A wait_event task: wait for ``ev``, and take on a failure pending on its stream up to it. The work after
    the wait reads what the failed task (or those dropped after it) should have written: without this it ran on
    memory nobody wrote, and its stream synced clean. The other stream keeps its own error for its own sync."""
    q = ev.stream._q
    q.wait_for(ev.seq, raise_errors=False)
    err = q.error
    if err is None or err[2] > ev.seq:  # a failure after the event hides none before it (ev.failure's seq <= ev.seq)
        err = ev.failure
    if err is not None:
        exc, owner, _ = err
        where = f"{describe_owner(owner)} failed on stream '{q.name}', which this stream waited for (wait_event)"
        raise task_failure(exc, owner, where) from exc


def _call(fn: Callable[[], Any]) -> None:
    fn()


class Event:
    """A marker in a stream: ``query``, ``synchronize`` and ``elapsed_time`` between two events."""

    __slots__ = ("stream", "seq", "time", "failure")

    stream: Stream
    seq: int
    time: float | None
    failure: tuple[BaseException, Any, int] | None  # pending on the stream as the event completed

    def __init__(self, *_: Any, **__: Any) -> None:
        raise TypeError("Events are made by a stream: use stream.record_event()")

    @classmethod
    def _make(cls, stream: Stream) -> Event:
        self = object.__new__(cls)
        self.stream = stream
        self.seq = 0
        self.time = None
        self.failure = None
        return self

    def __reduce__(self) -> Any:
        refuse_pickle(self, "make an Event in the receiving process with stream.record_event()")

    def __repr__(self) -> str:
        return f"Event(stream='{self.stream.name}', seq={self.seq}, done={self.query()})"

    def query(self) -> bool:
        return self.stream._q.done >= self.seq

    def synchronize(self) -> None:
        self.stream._q.wait_for(self.seq)

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from this event to ``end`` (both must have completed with timing)."""
        if not isinstance(end, Event):
            raise ParamError(op="Event.elapsed_time", arg="end", expected="a twophase Event", got=end)
        for ev, which in ((self, "start"), (end, "end")):
            if not ev.query():
                raise InvalidStateError("event has not completed", op="Event.elapsed_time", arg=which)
            if ev.time is None:
                raise InvalidStateError("event was recorded without timing", op="Event.elapsed_time", arg=which)
        assert self.time is not None and end.time is not None
        return (end.time - self.time) * 1e3


def check_stream(
    stream: object, op: str, arg: str = "stream", device: Device | None = None, open_: bool = True
) -> Stream:
    """``stream`` if it is a twophase Stream (of ``device``, when given; open, unless ``open_`` is False), else
    the ParamError / InvalidStateError naming ``op`` and ``arg``: checked before anything is allocated or
    changed, so a bad stream leaves no state behind."""
    if not isinstance(stream, Stream):
        raise ParamError(op=op, arg=arg, expected="a twophase Stream", got=type(stream).__name__)
    if device is not None and stream.device is not device:
        raise ParamError(
            op=op,
            arg=arg,
            expected=f"a stream of device {device.name}",
            got=f"'{stream.name}' of device {stream.device.name}",
        )
    if open_ and stream.closed:
        raise InvalidStateError(f"stream '{stream.name}' is closed: it takes no more work", op=op, arg=arg)
    return stream
