"""Where threads run: the CPU the calling thread is on, and threads kept off some CPUs for a moment.

Why: on VMs whose kernel packs threads onto few vCPUs (these machines: ``/proc/sys/kernel/sched_vcpu_pack``) a
stream's worker woken for a launch can land on the vCPU where a helper spins for that launch, and a helper woken
from sleep onto the launching thread's vCPU. Neither is moved to an idle vCPU before the scheduler balances
(~4 ms, a tick), so the launch runs at one-thread speed: 14-27 % of the launches of reduce_sum over 4096 x 4096
in two parts of ~1.4 ms ran both parts on the launching thread, every one with the helper on its vCPU
(/tmp/w42/rs8.py of the forty-second session). Narrowing a thread's affinity moves a runnable thread at once,
and places a sleeping one when it is woken; restoring it moves nothing back.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable

__all__ = ["UNKNOWN", "current_cpu", "narrowed", "restore"]

UNKNOWN = -1  # the CPU where no ``sched_getcpu`` tells it


def _getcpu() -> Callable[[], int] | None:
    """libc's ``sched_getcpu`` (~0.1 us through ctypes), or None where there is none."""
    try:
        fn = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return fn


_sched_getcpu = _getcpu() if hasattr(os, "sched_setaffinity") else None


def current_cpu() -> int:
    """The CPU the calling thread runs on now (it may move the next moment), else ``UNKNOWN``."""
    return _sched_getcpu() if _sched_getcpu is not None else UNKNOWN


def narrowed(tid: int, avoid: Iterable[int]) -> set[int] | None:
    """Keep thread ``tid`` (a native id) off the CPUs in ``avoid``: its affinity before, for :func:`restore`,
    or None where nothing changed (no CPU would be left to it, it has none of them, or the call failed: a
    thread that ended). Only called where ``current_cpu`` knows the CPU, so where affinities exist."""
    try:
        mask = os.sched_getaffinity(tid)
        rest = mask.difference(avoid)
        if not rest or rest == mask:
            return None
        os.sched_setaffinity(tid, rest)
    except OSError:
        return None
    return mask


def restore(tid: int, mask: set[int]) -> None:
    """Give thread ``tid`` back the affinity :func:`narrowed` returned; a thread that ended is left alone."""
    try:
        os.sched_setaffinity(tid, mask)
    except OSError:
        pass
