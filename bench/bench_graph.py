"""Graph capture and replay (issue 7): per-op cost of replaying a graph of 100 tiny ops vs issuing the same
ops through explicit executors, vs the one-shot API, vs torch eager; and the arena the planner makes for a
transformer encoder block vs the one-by-one sum of its allocations. Every way is checked to compute what eager
does before it is timed; each ratio is the median over rounds of two times taken in the same round.

Run: ``.venv/bin/python -m bench.bench_graph``
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

import twophase as tp

from .common import header, interleaved_times, round_ratio

N_OPS = 100
REPS = 20  # sequences per timed call (one synchronize per call)
SIZE = 16  # elements per tensor: tiny ops, so per-op overhead is what is measured
KINDS = ("add", "mul", "sub", "relu", "neg")


def _sequence(dev: tp.Device, s: tp.Stream) -> tuple[tp.Tensor, list[tp.Tensor]]:
    rng = np.random.default_rng(0)
    x = dev.tensor(rng.standard_normal(SIZE).astype(np.float32), stream=s)
    ws = [dev.tensor((1 + 0.01 * rng.standard_normal(SIZE)).astype(np.float32), stream=s) for _ in range(N_OPS)]
    s.synchronize()
    return x, ws


def _one_shot(x: tp.Tensor, ws: list[tp.Tensor], s: tp.Stream, free: bool) -> tp.Tensor:
    """The 100 ops through the one-shot API; with ``free`` each intermediate is returned to the pool in stream
    order once its consumer is enqueued (what torch's refcounting does for its tensors)."""
    h = x
    for i in range(N_OPS):
        k = KINDS[i % len(KINDS)]
        nh = getattr(tp, k)(h, ws[i], stream=s) if k in ("add", "mul", "sub") else getattr(tp, k)(h, stream=s)
        if free and h is not x:
            h.free(s)
        h = nh
    return h


def per_op_costs() -> list[str]:
    """Per-op cost of graph replay, explicit executors, the one-shot API and torch eager on a 100-op chain."""
    dev = tp.device("cpu")
    s = dev.stream()
    x, ws = _sequence(dev, s)

    # explicit executors: phase 1 once, repeatable executors over preallocated tensors
    calls: list[tuple[Any, Any]] = []
    h, outs = x, []
    for i in range(N_OPS):
        k = KINDS[i % len(KINDS)]
        out = dev.empty((SIZE,))
        args = (h, ws[i]) if k in ("add", "mul", "sub") else (h,)
        _, ex = getattr(tp.ops, k).get_workspace_size(*args, out=out)
        ex.set_repeatable()
        calls.append((getattr(tp.ops, k), ex))
        outs.append(out)
        h = out

    with tp.capture(s) as g:
        g.input("x", x)
        g.output("y", _one_shot(x, ws, s, free=False))
    g.instantiate()

    eager = _one_shot(x, ws, s, free=True).numpy()
    if not np.array_equal(g.replay(s)["y"].numpy(), eager):
        raise AssertionError("graph replay's result differs from eager's")
    for op, ex in calls:
        op(None, 0, ex, s)
    if not np.array_equal(outs[-1].numpy(), eager):
        raise AssertionError("the explicit executors' result differs from eager's")

    def replay() -> None:
        for _ in range(REPS):
            g.replay(s)
        s.synchronize()

    def explicit() -> None:
        for _ in range(REPS):
            for op, ex in calls:
                op(None, 0, ex, s)
        s.synchronize()

    def one_shot() -> None:
        for _ in range(REPS):
            _one_shot(x, ws, s, free=True).free(s)
        s.synchronize()

    fns: dict[str, Callable[[], object]] = {
        "graph replay": replay,
        "explicit executors (phase 2 only)": explicit,
        "one-shot API": one_shot,
    }
    torch = _torch()
    if torch is not None:
        tx = torch.from_numpy(x.numpy())
        tws = [torch.from_numpy(w.numpy()) for w in ws]
        fmap = {"add": torch.add, "mul": torch.mul, "sub": torch.sub}

        def torch_eager() -> None:
            for _ in range(REPS):
                h = tx
                for i in range(N_OPS):
                    k = KINDS[i % len(KINDS)]
                    h = fmap[k](h, tws[i]) if k in fmap else (torch.relu(h) if k == "relu" else torch.neg(h))

        fns["torch eager"] = torch_eager
        h = tx
        for i in range(N_OPS):
            k = KINDS[i % len(KINDS)]
            h = fmap[k](h, tws[i]) if k in fmap else (torch.relu(h) if k == "relu" else torch.neg(h))
        if not np.array_equal(h.numpy(), eager):
            raise AssertionError("torch eager's result differs from twophase's (the chain is compared bit for bit)")
    times = interleaved_times(fns, 5, rounds=9)
    per = {k: statistics.median(v) / (REPS * N_OPS) for k, v in times.items()}
    lines = [
        f"## Per-op cost: {N_OPS} tiny ops ({SIZE}-element float32 add/mul/sub/relu/neg), {REPS} sequences "
        "per synchronize",
        "| way | per op | ratio this way / torch eager (< 1: this way faster) | target |",
        "|---|---|---|---|",
    ]
    for k, v in per.items():
        ratio = f"{round_ratio(times, k, 'torch eager'):.2f}" if "torch eager" in times else "n/a"
        target = "<= 1.0 (moonshot 0.5)" if k == "graph replay" else ""
        lines.append(f"| {k} | {v * 1e9:.0f} ns | {ratio} | {target} |")
    r_explicit = round_ratio(times, "graph replay", "explicit executors (phase 2 only)")
    lines.append(
        f"(graph replay / explicit executors, median of the rounds' ratios: {r_explicit:.2f}; < 1: replay faster)"
    )
    if torch is None:
        lines.append("(torch not installed: `pip install torch==2.13.0` for the comparison)")
    else:
        lines.append("(checked before timing: replay, explicit executors and torch equal eager bit for bit)")
    m = g.memory
    lines.append(f"(this graph: {len(g)} nodes, arena {m.arena_bytes} B vs {m.naive_bytes} B one by one)")
    g.destroy()
    for _, ex in calls:
        ex.destroy()
    s.close()
    return lines


def host_cost() -> list[str]:
    """Replay vs phase 2 on the NULL device: the host side alone (nothing runs)."""
    dev = tp.device("null")
    s = dev.stream()
    x = dev.empty((SIZE,))
    ws = [dev.empty((SIZE,)) for _ in range(N_OPS)]
    calls = []
    h = x
    for i in range(N_OPS):
        k = KINDS[i % len(KINDS)]
        out = dev.empty((SIZE,))
        _, ex = getattr(tp.ops, k).get_workspace_size(*((h, ws[i]) if k in ("add", "mul", "sub") else (h,)), out=out)
        ex.set_repeatable()
        calls.append((getattr(tp.ops, k), ex))
        h = out
    with tp.capture(s) as g:
        _one_shot(x, ws, s, free=False)
    g.instantiate()

    def replay() -> None:
        for _ in range(REPS):
            g.replay(s)

    def explicit() -> None:
        for _ in range(REPS):
            for op, ex in calls:
                op(None, 0, ex, s)

    times = interleaved_times({"graph replay": replay, "explicit executors": explicit}, 20, rounds=9)
    g.destroy()
    for _, ex in calls:
        ex.destroy()
    per = {k: statistics.median(v) / (REPS * N_OPS) for k, v in times.items()}
    return [
        "## Host cost per op on the NULL device (no kernel runs)",
        "| way | per op | ratio this way / explicit executors (< 1: this way faster) |",
        "|---|---|---|",
        f"| explicit executors | {per['explicit executors'] * 1e9:.0f} ns | 1.00 |",
        f"| graph replay | {per['graph replay'] * 1e9:.0f} ns | "
        f"{round_ratio(times, 'graph replay', 'explicit executors'):.3f} |",
    ]


def _encoder(dev: tp.Device, s: tp.Stream, b: int = 4, t: int = 64, d: int = 128, h: int = 4) -> Any:
    """A pre-norm transformer encoder block from the library's ops; returns block(x) and its input."""
    rng = np.random.default_rng(1)

    def p(*shape: int) -> tp.Tensor:
        return dev.tensor((rng.standard_normal(shape) * 0.1).astype(np.float32), stream=s)

    w = {k: (p(d, d), p(d)) for k in "qkvo"}
    w1, b1, w2, b2 = p(4 * d, d), p(4 * d), p(d, 4 * d), p(d)
    gam, bet = [p(d) for _ in range(2)], [p(d) for _ in range(2)]
    eps = dev.tensor(np.full((1,), 1e-5, np.float32), stream=s)

    def ln(x: tp.Tensor, i: int) -> tp.Tensor:
        if "layer_norm" in tp.registry:
            return tp.layer_norm(x, gam[i], bet[i], normalized_shape=(d,), stream=s)[0]  # type: ignore[no-any-return]
        mu = tp.reduce_mean(x, dims=(-1,), keep_dims=True, stream=s)
        xc = tp.sub(x, mu, stream=s)
        r = tp.rsqrt(
            tp.add(tp.reduce_mean(tp.mul(xc, xc, stream=s), dims=(-1,), keep_dims=True, stream=s), eps, stream=s),
            stream=s,
        )
        return tp.add(tp.mul(tp.mul(xc, r, stream=s), gam[i], stream=s), bet[i], stream=s)  # type: ignore[no-any-return]

    def heads(y: tp.Tensor) -> tp.Tensor:
        return tp.permute(y.strided((b, t, h, d // h), (t * d, d, d // h, 1)), dims=(0, 2, 1, 3), stream=s)  # type: ignore[no-any-return]

    def block(x: tp.Tensor) -> tp.Tensor:
        hh = ln(x, 0)
        q, k, v = (heads(tp.linear(hh, *w[n], stream=s)) for n in "qkv")
        a = tp.permute(tp.scaled_dot_product_attention(q, k, v, stream=s), dims=(0, 2, 1, 3), stream=s)
        x = tp.add(x, tp.linear(a.strided((b, t, d), (t * d, d, 1)), *w["o"], stream=s), stream=s)
        m = tp.linear(tp.gelu(tp.linear(ln(x, 1), w1, b1, stream=s), stream=s), w2, b2, stream=s)
        return tp.add(x, m, stream=s)  # type: ignore[no-any-return]

    return block, p(b, t, d)


def arena_ratio() -> list[str]:
    dev = tp.device("cpu")
    s = dev.stream()
    block, x = _encoder(dev, s)
    s.synchronize()
    eager = block(x).numpy()
    with tp.capture(s) as g:
        g.input("x", x)
        g.output("y", block(x))
    g.instantiate()
    same = np.array_equal(g.replay(s)["y"].numpy(), eager)
    if not same:
        raise AssertionError("the encoder block's graph replay differs from eager")
    m = g.memory
    g.destroy()
    s.close()
    ln = "layer_norm op" if "layer_norm" in tp.registry else "composite layer norm"
    return [
        f"## Arena vs one-by-one allocations: transformer encoder block (4x64x128, 4 heads, {ln})",
        "| nodes | intermediates | workspaces | one by one | peak live | arena | arena / one by one | target |",
        "|---|---|---|---|---|---|---|---|",
        f"| {len(g)} | {m.intermediates} | {m.workspaces} | {m.naive_bytes / 1024:.0f} KiB | "
        f"{m.peak_bytes / 1024:.0f} KiB | {m.arena_bytes / 1024:.0f} KiB | {m.ratio:.3f} | <= 0.5 |",
        f"(planner strategy: {m.strategy}; replay equals eager bit for bit: {same})",
    ]


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def main() -> None:
    print(header("twophase graph capture / replay benchmark (bench/bench_graph.py)"))
    for section in (per_op_costs, host_cost, arena_ratio):
        print()
        print("\n".join(section()))


if __name__ == "__main__":
    main()
