"""Virtual blocks: what the pool hands a capturing thread. A size and no memory until the graph is
instantiated; then a slice of the graph's arena, so every tensor made on it reads the arena."""

from __future__ import annotations

from typing import Any

from ..errors import CaptureError, InvalidStateError
from ..runtime.memory import Block, Segment, round_size

__all__ = ["VirtualBlock", "GraphNotInstantiated"]


class GraphNotInstantiated:
    """The ``data`` of a virtual block: not a buffer, so any attempt to view it fails loudly."""

    def __repr__(self) -> str:
        return "<memory of a captured graph that is not instantiated>"


_NO_MEMORY = GraphNotInstantiated()
_NO_SEGMENT = Segment(0, 0, False, "virtual", None)


class VirtualBlock(Block):
    """A pool block handed out during a capture: a size and no memory until ``Graph.instantiate`` places it
    in the arena (then it is a slice of the arena, and every tensor made on it reads the arena)."""

    __slots__ = ("graph", "vid", "virtual", "arena")

    graph: Any
    vid: int
    virtual: bool
    arena: Block | None

    def __init__(self, pool: Any, graph: Any, vid: int, nbytes: int) -> None:
        super().__init__(pool, _NO_SEGMENT, 0, round_size(nbytes))
        self.requested = nbytes
        self.allocated = True
        self.data = _NO_MEMORY
        self.graph = graph
        self.vid = vid
        self.virtual = True
        self.arena = None

    def __repr__(self) -> str:
        if self.virtual:
            return f"VirtualBlock(#{self.vid} of {self.graph}, {self.size} B)"
        return f"VirtualBlock(#{self.vid} of {self.graph}, 0x{self.address:x}, {self.size} B)"

    def _materialize(self, arena: Block, offset: int) -> None:
        self.segment = arena.segment
        self.offset = arena.offset + offset
        self.data = None if arena.data is None else arena.data[offset : offset + self.size]
        self.virtual = False
        self.arena = arena

    def _dematerialize(self) -> None:
        """Undo :meth:`_materialize` (an instantiate that failed frees its arena)."""
        self.segment, self.offset, self.data = _NO_SEGMENT, 0, _NO_MEMORY
        self.virtual = True
        self.arena = None

    def export(self, holder: object) -> None:
        """A DLPack export pins the graph's arena: ``graph.destroy()`` frees it only once consumers let go."""
        self.check_memory(None)
        arena = self.arena
        if arena is None or not self.allocated or self.freed:
            raise InvalidStateError("tensor's block was freed", op="__dlpack__", arg="tensor", got=self)
        arena.export(holder)

    def check_memory(self, desc: Any, op: str = "Tensor.view") -> None:
        if not self.virtual:
            return
        state = self.graph.state
        if self.freed or state not in ("capturing", "captured"):
            raise InvalidStateError(  # freed by the capture, never used by a node, or its capture failed
                f"a tensor allocated inside the capture of {self.graph} "
                + (
                    "was freed there"
                    if self.freed
                    else "has no memory: the capture failed"
                    if state == "failed"
                    else "has no memory: the graph was destroyed before it was instantiated"
                    if state == "destroyed"
                    else "that no node of it used has no memory"
                ),
                op=op,
                arg="tensor",
                got=desc,
            )
        raise CaptureError(
            f"a tensor allocated inside the capture of {self.graph} has no memory until the graph is instantiated"
            " (then read it after a replay)",
            op=op,
            arg="tensor",
            got=desc,
        )

    def wait(self) -> None:
        self.check_memory(None, "Tensor.numpy")
        super().wait()

    def free(self, stream: Any = None) -> None:
        """During the capture: the tensor's last use has passed (its arena bytes may be reused). Afterwards
        its memory belongs to the graph's arena, released by ``graph.destroy()``."""
        if not self.allocated:
            raise CaptureError("block of a captured graph freed twice", op="free", arg="block", got=self)
        self.allocated = False
        self.freed = True
        self.graph._on_virtual_free(self.vid)
