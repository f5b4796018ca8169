"""The MiniLM part of ``make demo``: embed sentences three ways, print the similarities, the per-op counters,
the phase-1 / phase-2 amortisation, the pool watermark and the graph arena, and write a Chrome trace."""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import twophase as tp

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
]
TRACE = "trace_minilm.json"


def _timed(fn: Callable[[], Any], sync: Callable[[], None], runs: int) -> float:
    """Median wall seconds of ``fn`` + ``sync`` over ``runs`` runs."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def counters_table(impls: dict[str, set[str]]) -> str:
    """Per op: phase-1 / phase-2 calls and mean host times, cache hits / misses, workspace, implementation."""
    snap = tp.stats.snapshot()["ops"]
    head = (
        f"{'op':<29}{'p1 calls':>9}{'p1 us':>8}{'hits':>7}{'miss':>6}{'p2 calls':>9}{'p2 us':>7}"
        f"{'kern us':>9}{'ws max B':>10}  implementation"
    )
    lines = [head, "-" * len(head)]
    for name, c in snap.items():
        p1, p2, k, ws = tp.stats.means(c)
        lines.append(
            f"{name:<29}{c['phase1_calls']:>9}{tp.stats.us(p1, 8)}{c['cache_hits']:>7}{c['cache_misses']:>6}"
            f"{c['phase2_calls']:>9}{tp.stats.us(p2, 7)}{tp.stats.us(k, 9)}{ws:>10}  "
            f"{', '.join(sorted(impls.get(name, ())))}"
        )
    return "\n".join(lines)


def main(trace: str = TRACE, runs: int = 5) -> int:
    from .minilm import INSTALL_HINT, MiniLM, cosine_matrix, host_costs, model_dir

    if model_dir() is None:
        print(f"== MiniLM demo skipped: the model package is not installed ({INSTALL_HINT})")
        return 0
    from ..cli import similarity_table

    has_graph = hasattr(tp, "capture")
    t0 = time.perf_counter()
    model = MiniLM()
    load_s = time.perf_counter() - t0
    with model:
        batch = model.tokenize(SENTENCES)
        cfg = model.config
        print(f"== all-MiniLM-L6-v2 from {model.path}")
        print(
            f"   {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, intermediate {cfg.intermediate}; "
            f"{model.parameter_bytes / 2**20:.1f} MiB of float32 parameters, loaded in {load_s:.2f} s; "
            f"batch {batch.shape[0]} x {batch.shape[1]} tokens"
        )

        # warm up (kernel compilation, BLAS threads), plan and capture, then time each mode
        t0 = time.perf_counter()
        ref = model.run(batch, "oneshot")
        first_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.run(batch, "planned")
        plan_s = time.perf_counter() - t0
        modes = ["oneshot", "planned"] + (["graph"] if has_graph else [])
        capture_s = 0.0
        if has_graph:
            t0 = time.perf_counter()
            model.graph(batch)
            capture_s = time.perf_counter() - t0
        outs = {m: model.run(batch, m) for m in modes}
        wall = {m: _timed(functools.partial(model.run, batch, m), lambda: None, runs) for m in modes}

        print()
        print(similarity_table(SENTENCES, outs[modes[-1]]))
        print(
            "max |difference| between modes: "
            + ", ".join(f"{m} vs oneshot {float(np.abs(outs[m] - ref).max()):.1e}" for m in modes[1:])
        )
        sim = cosine_matrix(outs[modes[-1]])
        ok = bool(np.allclose(np.diag(sim), 1.0, atol=1e-5)) and all(
            float(np.abs(outs[m] - ref).max()) < 1e-4 for m in modes
        )

        # one profiled forward per mode: counters (phase-1 / phase-2 / kernel times) and the trace
        tp.stats.reset()
        with tp.profile(trace):
            for m in modes:
                model.run(batch, m)
        snap = tp.stats.snapshot()
        impls: dict[str, set[str]] = {}
        for c in model.program(batch).calls:
            impls.setdefault(c.op.name, set()).add(c.executor.implementation)
        print()
        print(f"== per-op counters (one profiled forward each: {', '.join(modes)})")
        print(counters_table(impls))

        ops = snap["ops"].values()
        n_ops = len(model.program(batch).calls)
        p1 = sum(c["phase1_time_s"] for c in ops)  # the one-shot forward's phase 1 (cache hits)
        p1_calls = sum(c["phase1_timed_calls"] for c in ops)
        p2 = sum(c["phase2_time_s"] for c in ops) / max(sum(c["phase2_timed_calls"] for c in ops), 1) * n_ops
        print()
        print("== amortisation")
        print(f"   {n_ops} op launches per forward; first forward (compiles kernels) {first_s * 1e3:.0f} ms")
        print(
            f"   phase 1 per forward (executor-cache hits): {p1 / max(p1_calls, 1) * n_ops * 1e3:8.2f} ms  "
            f"({p1 / max(p1_calls, 1) * 1e6:.1f} us per op)"
        )
        print(f"   phase 2 per forward (host enqueue):         {p2 * 1e3:8.2f} ms  ({p2 / n_ops * 1e6:.1f} us per op)")
        print(
            f"   phase-1 / phase-2 ratio:                    {p1 / max(p1_calls, 1) * n_ops / p2:8.1f}x  "
            "(what planning once saves per forward, on the host)"
        )
        print(
            f"   planning the program (phase 1 x {n_ops}, workspaces, outputs): {plan_s * 1e3:.0f} ms"
            + (f"; capturing + instantiating the graph: {capture_s * 1e3:.0f} ms" if has_graph else "")
        )
        host = host_costs(model, batch)
        print(
            "   host cost per forward on the null device (phases run, no kernels), median: "
            + ", ".join(f"{m} {v * 1e3:.3f} ms" for m, v in host.items())
            + f"; one-shot / repeatable executors = {host['oneshot'] / host['planned']:.0f}x"
        )
        print(
            "   wall per forward, median of "
            + str(runs)
            + ": "
            + ", ".join(f"{m} {wall[m] * 1e3:.1f} ms" for m in modes)
        )

        pool = model.dev.pool.stats()
        prog = model.program(batch)
        print()
        print("== memory")
        print(
            f"   pool: peak allocated {_mib(pool['peak_allocated_bytes'])}, peak reserved "
            f"{_mib(pool['peak_reserved_bytes'])} (parameters {_mib(model.parameter_bytes)})"
        )
        print(f"   repeatable executors: {_mib(prog.arena_bytes)} held (every output and workspace its own block)")
        if has_graph:
            gm = model.graph(batch).graph.memory
            print(
                f"   graph arena: {_mib(gm.arena_bytes)} for {gm.intermediates} intermediates and {gm.workspaces} "
                f"workspaces (one by one: {_mib(gm.naive_bytes)}; ratio {gm.ratio:.3f}; strategy {gm.strategy})"
            )
        else:
            print("   graph arena: n/a (twophase.capture not in this build)")
        print(f"   trace: {os.path.abspath(trace)} (open it in https://ui.perfetto.dev)")
    print("MiniLM demo: " + ("ok" if ok else "WRONG"))
    return 0 if ok else 1


def _mib(n: Any) -> str:
    return f"{(n or 0) / 2**20:.1f} MiB"


if __name__ == "__main__":
    raise SystemExit(main())
