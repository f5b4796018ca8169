"""Phase-2 cost with the sanitizer off vs the plain entry point (issue 6): the sanitizer installs itself by
swapping class attributes only while on, so "off" must cost nothing. Rounds are interleaved (alternating which side
goes first, each after the settle pause); every ratio is the median of the rounds' ratios and says its direction.

Run: ``.venv/bin/python -m bench.bench_sanitizer``
"""

from __future__ import annotations

from typing import Any

import numpy as np

import twophase as tp
from twophase import hooks, sanitizer
from twophase.op import Op

from .common import header, median_ratio, parked, pause

N = 20000


def main() -> None:
    """Time phase 2 plain, with the sanitizer off after on/off, with a no-op hook, and with the sanitizer on."""
    print(header("sanitizer: phase-2 cost, sanitizer off vs the plain (hook-free) phase 2"))
    dev = tp.device("cpu")
    s = dev.stream()
    x = dev.tensor(np.ones(8, np.float32), stream=s)
    y = dev.empty((8,))
    size, ex = tp.ops.relu.get_workspace_size(x, out=y)
    ex.set_repeatable()
    plain: Any = hooks._plain_phase2
    op = tp.ops.relu

    def build_plain() -> float:  # the hook-free phase 2 (what a build without the sanitizer runs)
        setattr(Op, "__call__", plain)  # noqa: B010  (what sanitizer off restores)
        return parked(s, lambda: op(None, size, ex, s), N)

    def off() -> float:  # the entry point after the sanitizer was turned on and off again (untimed)
        with sanitizer.sanitize():
            pass
        return parked(s, lambda: op(None, size, ex, s), N)

    def noop_hook() -> float:  # for comparison: what any installed phase-2 hook costs
        h = hooks.add_phase2_hook(before=lambda *a: None)
        try:
            return parked(s, lambda: op(None, size, ex, s), N)
        finally:
            hooks.remove_hook(h)

    with sanitizer.sanitize():
        pass
    assert tp.Op.__call__ is plain, "sanitizer off must restore the plain phase 2"
    ratio, t_off, t_plain = median_ratio(off, build_plain, rounds=9)
    print(f"phase 2 (relu, 8 floats, worker parked), {N} calls x 9 interleaved rounds")
    print(f"  plain phase 2 (no hooks):      {t_plain * 1e9:8.0f} ns/call")
    print(f"  sanitizer off (after on/off):  {t_off * 1e9:8.0f} ns/call")
    print(f"  ratio off / plain:             {ratio:8.3f}  (< 1: off faster; 1 = no cost; target <= 1.03)")
    r_hook, t_hook, _ = median_ratio(noop_hook, build_plain, rounds=5)
    print(
        f"  a no-op phase-2 hook installed:{t_hook * 1e9:8.0f} ns/call (ratio hook / plain {r_hook:.3f}, "
        "< 1: hooked faster; above 1 is why off swaps it out)"
    )
    pause()  # paused like the timings above
    with sanitizer.sanitize():
        t_on = parked(s, lambda: op(None, size, ex, s), 2000)
    print(f"  sanitizer on (for reference):  {t_on * 1e9:8.0f} ns/call")
    s.synchronize()
    ex.destroy()
    x.free(s)
    y.free(s)


if __name__ == "__main__":
    main()
