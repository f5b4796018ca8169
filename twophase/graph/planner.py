"""The graph memory planner: buffers with a size and a first / last use in, arena offsets out.

Pure functions of metadata (no device, no tensors), so tests can drive them with synthetic node lists.
Two buffers may share arena bytes only when their lifetimes ``[first, last]`` (inclusive node indices)
do not intersect. The lower bound of any placement is the *peak*: the largest sum of the sizes of the
buffers live at one node. The planner tries a few placements and keeps the smallest arena:

- ``two-ended``: when at most two buffers are ever live at once (a chain, and chains with one long-lived
  buffer) the conflict graph is 2-colourable; one colour sits at offset 0, the other against the top of an
  arena of exactly ``peak`` bytes. Optimal.
- ``by-size``: largest buffer first, each at the lowest offset free of the buffers already placed that
  overlap it in time (TFLite's greedy-by-size).
- ``by-first-use``: the same placement rule in the order the buffers appear (a linear scan).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..layout import align

__all__ = ["Buffer", "ArenaPlan", "liveness", "plan_arena", "peak_bytes"]

DEFAULT_ALIGNMENT = 512  # the pool's granularity: an arena slot is aligned like a pool block


@dataclass(frozen=True)
class Buffer:
    """A buffer to place: ``size`` bytes live from node ``first`` to node ``last`` (inclusive)."""

    size: int
    first: int
    last: int


@dataclass(frozen=True)
class ArenaPlan:
    """Where each buffer sits: ``offsets[i]`` for buffer ``i``; ``size`` is the arena's byte count.

    ``naive`` is what the buffers would take allocated one by one (each rounded to the alignment);
    ``peak`` is the largest live byte count at one node (no placement can beat it).
    """

    offsets: tuple[int, ...]
    size: int
    naive: int
    peak: int
    strategy: str
    alignment: int


def liveness(uses: Sequence[Iterable[int]], keep: Iterable[int] = ()) -> dict[int, tuple[int, int]]:
    """``{buffer: (first, last)}`` from an ordered node list (``uses[i]``: the buffers node ``i`` touches).

    Buffers in ``keep`` stay live to the last node (graph outputs the caller reads after a replay).
    """
    spans: dict[int, tuple[int, int]] = {}
    for i, node in enumerate(uses):
        for b in node:
            first = spans.get(b, (i, i))[0]
            spans[b] = (first, i)
    end = max(len(uses) - 1, 0)
    for b in keep:
        spans[b] = (spans.get(b, (end, end))[0], end)
    return spans


def _sizes(buffers: Sequence[Buffer], alignment: int) -> list[int]:
    return [align(b.size, alignment) if b.size else 0 for b in buffers]


def peak_bytes(buffers: Sequence[Buffer], alignment: int = DEFAULT_ALIGNMENT) -> int:
    """The largest sum of aligned sizes live at one node (a sweep over first / last uses)."""
    events: list[tuple[int, int, int]] = []
    for b, s in zip(buffers, _sizes(buffers, alignment)):
        events.append((b.first, 0, s))  # starts sort before ends at the same node: both are live there
        events.append((b.last, 1, -s))
    events.sort()
    live = peak = 0
    for _, _, d in events:
        live += d
        peak = max(peak, live)
    return peak


def _overlap(a: Buffer, b: Buffer) -> bool:
    return a.first <= b.last and b.first <= a.last


def _first_fit(order: Sequence[int], buffers: Sequence[Buffer], sizes: Sequence[int]) -> list[int]:
    """Place buffers in ``order``, each at the lowest offset clear of the placed buffers it overlaps in time."""
    offsets = [0] * len(buffers)
    placed: list[int] = []
    for i in order:
        s, b = sizes[i], buffers[i]
        if s == 0:
            continue
        busy = sorted((offsets[j], offsets[j] + sizes[j]) for j in placed if _overlap(b, buffers[j]))
        at = 0
        for lo, hi in busy:
            if at + s <= lo:
                break
            at = max(at, hi)
        offsets[i] = at
        placed.append(i)
    return offsets


def _two_ended(buffers: Sequence[Buffer], sizes: Sequence[int], peak: int) -> list[int] | None:
    """Optimal placement when at most two non-empty buffers are live at any node; None otherwise."""
    order = sorted((i for i in range(len(buffers)) if sizes[i]), key=lambda i: (buffers[i].first, buffers[i].last))
    colour: dict[int, int] = {}
    live: list[int] = []
    for i in order:
        live = [j for j in live if buffers[j].last >= buffers[i].first]
        if len(live) > 1:
            return None
        colour[i] = 1 - colour[live[0]] if live else 0
        live.append(i)
    return [0 if colour.get(i, 0) == 0 else peak - sizes[i] for i in range(len(buffers))]


def _arena(offsets: Sequence[int], sizes: Sequence[int]) -> int:
    return max((o + s for o, s in zip(offsets, sizes)), default=0)


def plan_arena(buffers: Sequence[Buffer], alignment: int = DEFAULT_ALIGNMENT) -> ArenaPlan:
    """Offsets in one arena for ``buffers`` such that buffers live at the same node never overlap.

    Every offset is a multiple of ``alignment`` and every buffer (its size rounded up to ``alignment``)
    fits in the arena. Zero-byte buffers get offset 0 and no space.
    """
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    for b in buffers:
        if b.size < 0 or b.first < 0 or b.last < b.first:
            raise ValueError(f"invalid buffer {b}: need size >= 0 and 0 <= first <= last")
    sizes = _sizes(buffers, alignment)
    naive = sum(sizes)
    peak = peak_bytes(buffers, alignment)
    n = range(len(buffers))
    candidates: list[tuple[str, list[int]]] = []
    two = _two_ended(buffers, sizes, peak)
    if two is not None:
        candidates.append(("two-ended", two))
    else:
        by_size = sorted(n, key=lambda i: (-sizes[i], -(buffers[i].last - buffers[i].first), i))
        candidates.append(("by-size", _first_fit(by_size, buffers, sizes)))
        by_first = sorted(n, key=lambda i: (buffers[i].first, -sizes[i], i))
        candidates.append(("by-first-use", _first_fit(by_first, buffers, sizes)))
    name, offsets = min(candidates, key=lambda c: _arena(c[1], sizes))
    return ArenaPlan(tuple(offsets), _arena(offsets, sizes), naive, peak, name, alignment)
