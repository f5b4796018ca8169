"""Graph capture and replay: record launches once, plan their memory into one arena, replay as one task.

```python
with twophase.capture(stream) as g:
    g.input("x", x)                                  # x: made before the capture, rebindable by name
    g.output("y", twophase.relu(twophase.add(x, w, stream=stream), stream=stream))
g.instantiate()                                     # liveness-planned arena; g.memory reports it
out = g.replay(stream, x=x2)["y"]                   # one task; y valid until the next replay
g.destroy()
```
"""

from .capture import capture, capturing
from .planner import ArenaPlan, Buffer, liveness, peak_bytes, plan_arena
from .replay import Graph, GraphMemory
from .virtual import VirtualBlock

__all__ = [
    "capture",
    "capturing",
    "Graph",
    "GraphMemory",
    "ArenaPlan",
    "Buffer",
    "liveness",
    "peak_bytes",
    "plan_arena",
    "VirtualBlock",
]
