"""Devices, memory pool, streams and events."""

from . import ops_cpu, ops_null  # noqa: F401  (register the backends)
from .device import Device, device
from .memory import Block, MemoryPool
from .stream import Event, Stream

__all__ = ["Device", "device", "Block", "MemoryPool", "Event", "Stream"]
