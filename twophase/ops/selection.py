"""Algorithm selection under a workspace limit: candidates ranked by expected speed, the first that fits wins.

Pure functions of metadata (tests call them directly), plus :func:`forced`, a test hook that restricts which
implementations phase 1 may pick.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from ..errors import ParamError
from ..op import Plan, effective_limit, over_limit, planning_scope

__all__ = ["Candidate", "choose", "effective_limit", "forced"]

log = logging.getLogger("twophase")
_only: ContextVar[frozenset[str] | None] = ContextVar("twophase_forced_implementations", default=None)


@dataclass(frozen=True)
class Candidate:
    """One way to run an op call: implementation name, its frozen tiling and its exact workspace in bytes."""

    implementation: str
    tiling: Any
    workspace: int


@contextlib.contextmanager
def forced(*implementations: str) -> Iterator[None]:
    """Test hook: inside the block, phase 1 only considers the named implementations (still ranked).

    The restriction is part of the executor-cache key (``op.planning_scope``), so plans made inside the block
    are never served outside it, nor the other way round.
    """
    only = frozenset(implementations)
    token = _only.set(only)
    scope = planning_scope.set(("forced", only))
    try:
        yield
    finally:
        planning_scope.reset(scope)
        _only.reset(token)


def choose(op: str, candidates: Sequence[Candidate], limit: Any = None) -> Plan:
    """The first candidate (ranked fastest first) whose workspace fits ``limit``, as a :class:`Plan`.

    Raises ``ParamError`` (arg ``workspace_limit``) naming the smallest workspace that would work when none
    fits, and (arg ``implementation``) when :func:`forced` leaves no candidate.
    """
    lim = effective_limit(op, limit)
    only = _only.get()
    pool = list(candidates)
    if only is not None:
        pool = [c for c in candidates if c.implementation in only]
        if not pool:
            raise ParamError(
                op=op,
                arg="implementation",
                expected=f"one of {[c.implementation for c in candidates]}",
                got=f"forced {sorted(only)}",
            )
    for c in pool:
        if lim is None or c.workspace <= lim:
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "%s: implementation %s, workspace %d bytes (limit %s), tiling %r",
                    op,
                    c.implementation,
                    c.workspace,
                    lim,
                    c.tiling,
                )
            return Plan(c.implementation, c.tiling, c.workspace)
    smallest = min(pool, key=lambda c: c.workspace)
    raise over_limit(op, smallest.workspace, smallest.implementation, lim)
