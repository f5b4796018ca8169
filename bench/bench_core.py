"""Core contract costs (issues 2 and 3): phase 1 vs phase 2, phase-2 enqueue vs a bare ``np.add``,
executor-cache hit vs miss, one-shot call vs torch eager, what the counters cost on the hot path, and what the
wake-up gates of the helper threads and the stream worker save on a launch and sync. Every ratio
is the median over rounds of the two times taken in the same round; each ratio header states its direction.

Run: ``.venv/bin/python -m bench.bench_core``
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import twophase as tp
from twophase import config
from twophase.runtime import fanout, spin

from .common import LOWER_FASTER, header, interleaved_times, median_ratio, parked, round_ratio


def contract_costs() -> list[str]:
    """Phase 1 (cache off and on) against phase 2's enqueue, and phase 2 against a bare ``np.add``."""
    dev = tp.device("cpu")
    s = dev.stream()
    rng = np.random.default_rng(0)
    x = dev.tensor(rng.standard_normal((64, 1024), dtype=np.float32), stream=s)
    y = dev.empty((64, 1024))
    size, ex = tp.ops.softmax.get_workspace_size(x, dim=-1, out=y)
    ex.set_repeatable()
    ws = dev.malloc(size, stream=s)

    def phase1(cache: bool) -> Callable[[], None]:
        def run() -> None:
            _, e = tp.ops.softmax.get_workspace_size(x, dim=-1, out=y)
            e.destroy()

        def timed() -> float:
            config.set_cache_enabled(cache)
            try:
                t0 = time.perf_counter()
                for _ in range(500):
                    run()
                return (time.perf_counter() - t0) / 500
            finally:
                config.set_cache_enabled(True)

        return timed  # type: ignore[return-value]

    def phase2() -> float:
        return parked(s, lambda: tp.ops.softmax(ws, size, ex, s), 2000)

    miss = phase1(False)
    hit = phase1(True)
    r_miss, t_p2, t_miss = median_ratio(phase2, miss)  # type: ignore[arg-type]
    r_hit, _, t_hit = median_ratio(phase2, hit)  # type: ignore[arg-type]
    # t2 / (t2 + t1) = r / (1 + r) for r = t2 / t1, monotonic in r: over an odd number of rounds (7) the median
    # of the rounds' shares is this
    share_miss = r_miss / (1 + r_miss)
    share_hit = r_hit / (1 + r_hit)

    a = dev.tensor(np.ones(8, np.float32), stream=s)
    b = dev.tensor(np.ones(8, np.float32), stream=s)
    c = dev.empty((8,))
    n_add, ex_add = tp.ops.add.get_workspace_size(a, b, out=c)
    ex_add.set_repeatable()
    A, B, C = np.ones(8, np.float32), np.ones(8, np.float32), np.empty(8, np.float32)

    def bare() -> float:
        t0 = time.perf_counter()
        for _ in range(2000):
            np.add(A, B, out=C)
        return (time.perf_counter() - t0) / 2000

    r_enq, t_enq, t_bare = median_ratio(lambda: parked(s, lambda: tp.ops.add(None, 0, ex_add, s), 2000), bare)

    def through() -> float:
        t0 = time.perf_counter()
        for _ in range(2000):
            tp.ops.add(None, 0, ex_add, s)
        s.synchronize()
        return (time.perf_counter() - t0) / 2000

    r_thr, t_thr, _ = median_ratio(through, bare)
    ex.destroy()
    ex_add.destroy()
    ws.free(s)
    return [
        "## Phase 1 vs phase 2 (softmax 64x1024 float32, cpu)",
        "| measure | time | share (median of the rounds') | target |",
        "|---|---|---|---|",
        f"| phase 1, full (cache off) | {t_miss * 1e6:.2f} us | | |",
        f"| phase 1, executor-cache hit | {t_hit * 1e6:.2f} us | | |",
        f"| phase 2 host cost (enqueue) | {t_p2 * 1e6:.2f} us | | |",
        f"| phase 2 / (phase 1 full + phase 2) | | {share_miss:.3f} | <= 0.10 |",
        f"| phase 2 / (phase 1 hit + phase 2) | | {share_hit:.3f} | (info) |",
        "",
        "## Phase-2 enqueue vs bare np.add(a, b, out=c) on 8-element float32 arrays",
        f"| measure | time | ratio twophase / np.add ({LOWER_FASTER}) | target |",
        "|---|---|---|---|",
        f"| bare np.add(out=) | {t_bare * 1e9:.0f} ns | 1.00 | |",
        f"| phase 2 enqueue (worker parked) | {t_enq * 1e9:.0f} ns | {r_enq:.2f} | <= 4 |",
        f"| phase 2 + kernel, throughput to sync | {t_thr * 1e9:.0f} ns | {r_thr:.2f} | (info) |",
    ]


def cache_costs() -> list[str]:
    """Phase 1 on an executor-cache hit against the same call with the cache off, per op."""
    dev = tp.device("cpu")
    rng = np.random.default_rng(1)
    x = dev.tensor(rng.standard_normal((64, 1024), dtype=np.float32))
    y = dev.tensor(rng.standard_normal((64, 1024), dtype=np.float32))
    cases: dict[str, Callable[[], Any]] = {
        "add 64x1024": lambda: tp.ops.add.get_workspace_size(x, y, alpha=2),
        "reduce_sum 64x1024 dims=(1,)": lambda: tp.ops.reduce_sum.get_workspace_size(x, dims=(1,)),
        "softmax 64x1024": lambda: tp.ops.softmax.get_workspace_size(x, dim=-1),
    }
    for name in ("matmul", "conv2d", "scaled_dot_product_attention", "layer_norm"):
        if name in tp.registry:
            extra = _extra_case(name, dev, rng)
            if extra is not None:
                cases[f"{name} {extra[0]}"] = extra[1]
    lines = [
        "## Executor cache: phase 1 on a hit vs a miss (cache off)",
        "| op | miss | hit | ratio hit / miss (< 1: the hit faster) |",
        "|---|---|---|---|",
    ]
    for name, fn in cases.items():

        def run(fn: Callable[[], Any] = fn) -> None:
            fn()[1].destroy()

        def timed(cache: bool, run: Callable[[], None] = run) -> float:
            config.set_cache_enabled(cache)
            try:
                t0 = time.perf_counter()
                for _ in range(300):
                    run()
                return (time.perf_counter() - t0) / 300
            finally:
                config.set_cache_enabled(True)

        run()
        ratio, t_hit, t_miss = median_ratio(lambda: timed(True), lambda: timed(False))
        lines.append(f"| {name} | {t_miss * 1e6:.1f} us | {t_hit * 1e6:.1f} us | {ratio:.2f} |")
    return lines


def _extra_case(name: str, dev: tp.Device, rng: np.random.Generator) -> tuple[str, Callable[[], Any]] | None:
    """(shape label, phase-1 call) of a heavier op for the cache table, or None when phase 1 refuses it."""
    try:
        if name == "matmul":
            a = dev.tensor(rng.standard_normal((64, 384), dtype=np.float32))
            b = dev.tensor(rng.standard_normal((384, 384), dtype=np.float32))
            return "128x384x384", lambda: tp.ops.matmul.get_workspace_size(a, b)
        if name == "conv2d":
            x = dev.tensor(rng.standard_normal((1, 64, 56, 56), dtype=np.float32))
            w = dev.tensor(rng.standard_normal((64, 64, 3, 3), dtype=np.float32))
            return "1x64x56x56 k3", lambda: tp.ops.conv2d.get_workspace_size(x, w, padding=1)
        if name == "scaled_dot_product_attention":
            q = dev.tensor(rng.standard_normal((8, 12, 128, 32), dtype=np.float32))
            return "8x12x128x32", lambda: tp.ops.scaled_dot_product_attention.get_workspace_size(q, q, q)
        if name == "layer_norm":
            x = dev.tensor(rng.standard_normal((64, 384), dtype=np.float32))
            g = dev.tensor(np.ones(384, np.float32))
            return "128x384", lambda: tp.ops.layer_norm.get_workspace_size(x, g, g, normalized_shape=(384,))
    except tp.TwoPhaseError:
        return None
    return None


ONE_SHOT_CALLS = 100  # calls per timed block; twophase's block ends with a synchronize, so its kernels count


def one_shot_vs_torch() -> list[str]:
    """The one-shot API's cost per call, its kernels included, against torch eager on the same tiny add. Each
    output is freed (in stream order) as the caller of a loop must (a dropped tensor keeps its block), and as torch
    frees its own when the reference goes: the loop used to drop them, so every call took a new block at a new
    address and rebuilt its launch (28-32 us against 16 us freed, /tmp/w40/os.py of the fortieth session)."""
    dev = tp.device("cpu")
    a = dev.tensor(np.ones(16, np.float32))
    b = dev.tensor(np.ones(16, np.float32))
    s = dev.default_stream
    s.synchronize()

    def one_shot() -> None:
        for _ in range(ONE_SHOT_CALLS):
            tp.add(a, b, stream=s).free(s)
        s.synchronize()

    fns: dict[str, Callable[[], object]] = {"twophase.add (one-shot, output freed; a sync per 100 calls)": one_shot}
    try:
        import torch

        ta, tb = torch.ones(16), torch.ones(16)
        tout = torch.empty(16)

        def eager() -> None:
            for _ in range(ONE_SHOT_CALLS):
                torch.add(ta, tb)

        def out() -> None:
            for _ in range(ONE_SHOT_CALLS):
                torch.add(ta, tb, out=tout)

        fns["torch.add (eager)"] = eager
        fns["torch.add(out=)"] = out
        got = tp.add(a, b, stream=s).numpy()
        if not np.array_equal(got, torch.add(ta, tb).numpy()):
            raise AssertionError("one-shot: twophase.add and torch.add disagree")
    except ImportError:
        torch = None  # type: ignore[assignment]
    times = interleaved_times(fns, 20, 7)
    s.synchronize()
    lines = [
        "## One-shot call cost (16-element float32 add; blocks of 100 calls, twophase's ending in a sync)",
        "| call | time | ratio this row / torch eager (< 1: this row faster) |",
        "|---|---|---|",
    ]
    base = "torch.add (eager)"
    for k, v in times.items():
        t = statistics.median(v) / ONE_SHOT_CALLS
        ratio = f"{round_ratio(times, k, base):.2f}" if base in times else "n/a"
        lines.append(f"| {k} | {t * 1e6:.2f} us | {ratio} |")
    if torch is None:
        lines.append("(torch not installed: `pip install torch==2.13.0` for the comparison)")
    return lines


def _counter_row(name: str) -> str:
    """Phase 2 of a repeatable add, N calls then a sync (the worker's kernel and its launch count included),
    with the launch counting as shipped vs. swapped for a no-op."""
    import twophase.runtime.stream as stream_mod

    counting = stream_mod._count
    op = tp.ops.add
    dev = tp.device(name)
    s = dev.stream()
    a, b, c = dev.empty((8,)), dev.empty((8,)), dev.empty((8,))
    _, ex = op.get_workspace_size(a, b, out=c)
    ex.set_repeatable()

    def run(count: Callable[[Any], None]) -> float:
        setattr(stream_mod, "_count", count)  # noqa: B010  (swapped for the timing, restored after)
        try:
            t0 = time.perf_counter()
            for _ in range(5000):
                op(None, 0, ex, s)
            s.synchronize()
            return (time.perf_counter() - t0) / 5000
        finally:
            stream_mod._count = counting

    ratio, with_, without = median_ratio(lambda: run(counting), lambda: run(lambda _: None), rounds=15)
    ex.destroy()
    return f"| {name} | {without * 1e9:.0f} ns | {with_ * 1e9:.0f} ns | {ratio:.3f} | <= 1.05 |"


def counter_cost() -> list[str]:
    """Phase 2 itself counts nothing; an executor's launch count goes up on the stream worker once its task ran.
    Measured end to end (enqueue, kernel, count) because the worker shares the GIL with the caller. (The NULL
    device counts inline at enqueue, where no worker runs; it is not measured here.)"""
    return [
        "## Counters on the hot path (5000 phase-2 calls of a repeatable add + sync, median of 15 rounds)",
        "| device | without counting | with counting | ratio with / without (< 1: counting faster) | target |",
        "|---|---|---|---|---|",
        _counter_row("cpu"),
    ]


def _gate_row(name: str, launch: Callable[[], None], s: tp.Stream, n: int) -> str:
    """Launch + synchronize ``n`` times with the gates as shipped against the same with them shut (a thread that
    saw a launch waits the whole ``SETTLE_US`` before taking the GIL, as before the gates)."""
    shipped = spin.GATE_US

    def timed(gate_us: float) -> float:
        spin.GATE_US = gate_us
        try:
            t0 = time.perf_counter()
            for _ in range(n):
                launch()
                s.synchronize()
            return (time.perf_counter() - t0) / n
        finally:
            spin.GATE_US = shipped

    launch()
    s.synchronize()
    ratio, t_on, t_off = median_ratio(lambda: timed(shipped), lambda: timed(spin.SETTLE_US), rounds=9)
    return f"| {name} | {t_off * 1e6:.1f} us | {t_on * 1e6:.1f} us | {ratio:.2f} |"


def gate_costs() -> list[str]:
    """A helper (fan-out) or the stream worker that sees a launch waits for the launching or synchronizing thread
    to let go of the GIL before it takes it (``spin.count_and_wait``): with the gate it waits ``GATE_US`` after
    that thread opened it, without, the whole ``SETTLE_US``."""
    dev = tp.device("cpu")
    s = dev.stream()
    rng = np.random.default_rng(2)
    x = dev.tensor(rng.standard_normal((4, 16), dtype=np.float32), stream=s)
    y = dev.empty((4, 16))
    n_g, ex_g = tp.ops.gelu.get_workspace_size(x, out=y)
    ex_g.set_repeatable()
    ws_g = dev.malloc(n_g, stream=s) if n_g else None
    old = config.settings.num_threads
    config.set_num_threads(2)
    try:
        a = dev.tensor(rng.standard_normal((64, 384), dtype=np.float32), stream=s)
        b = dev.tensor(rng.standard_normal((384, 192), dtype=np.float32), stream=s)
        c = dev.empty((64, 192))
        n_m, ex_m = tp.ops.matmul.get_workspace_size(a, b, out=c)
        ex_m.set_repeatable()
        ws_m = dev.malloc(n_m, stream=s) if n_m else None
        before = int(fanout.BUSY[1])
        tp.ops.matmul(ws_m, n_m, ex_m, s)
        s.synchronize()
        split = int(fanout.BUSY[1]) > before
        rows = [_gate_row("gelu 4x16, launch + sync (stream gate)", lambda: tp.ops.gelu(ws_g, n_g, ex_g, s), s, 2000)]
        if split:
            rows.append(
                _gate_row(
                    "matmul 64x384 @ 384x192 in 2 parts, launch + sync (both gates)",
                    lambda: tp.ops.matmul(ws_m, n_m, ex_m, s),
                    s,
                    500,
                )
            )
        else:
            rows.append("| matmul 64x384 @ 384x192: not cut into parts on this machine (1 core?) | | | |")
        for ex, ws in ((ex_g, ws_g), (ex_m, ws_m)):
            ex.destroy()
            if ws is not None:
                ws.free(s)
    finally:
        config.set_num_threads(old)
    return [
        f"## Wake-up gates: launch + sync with the gates (GATE_US = {spin.GATE_US:g} us) vs shut "
        f"(SETTLE_US = {spin.SETTLE_US:g} us), median of 9 rounds",
        "| case | gates shut | gates | ratio gates / shut (< 1: the gates faster) |",
        "|---|---|---|---|",
        *rows,
    ]


def main() -> None:
    print(header("twophase core benchmark (bench/bench_core.py)"))
    for section in (contract_costs, cache_costs, one_shot_vs_torch, counter_cost, gate_costs):
        print()
        print("\n".join(section()))


if __name__ == "__main__":
    main()
