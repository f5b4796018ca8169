"""``make demo``: all-MiniLM-L6-v2 sentence embeddings end to end (one-shot, repeatable executors, captured
graph), the similarity matrix, the per-op counters, the phase-1 / phase-2 amortisation, the pool watermark and
the graph arena, and a Chrome trace; then the softmax section (plan once, run phase 2 many times)."""

from __future__ import annotations

import time

import numpy as np

import twophase as tp


def softmax_section(rows: int = 256, cols: int = 4096, runs: int = 200) -> int:
    """Plan softmax once, run phase 2 ``runs`` times, check against numpy; print phase-1 / phase-2 times."""
    dev = tp.device("cpu")
    stream = dev.stream()
    rng = np.random.default_rng(0)
    host = rng.standard_normal((rows, cols), dtype=np.float32) * 4
    x = dev.tensor(host, stream=stream)
    y = dev.empty((rows, cols), tp.DType.float32)

    t0 = time.perf_counter()
    size, ex = tp.ops.softmax.get_workspace_size(x, dim=-1, out=y)
    t1 = time.perf_counter()
    first_plan = t1 - t0  # includes compiling (or loading) the kernel
    ex.destroy()
    tp.clear_cache()
    n_plan = 200
    t0 = time.perf_counter()
    for _ in range(n_plan):
        size, ex = tp.ops.softmax.get_workspace_size(x, dim=-1, out=y)
        ex.destroy()
    t1 = time.perf_counter()
    phase1_hit = (t1 - t0) / n_plan

    size, ex = tp.ops.softmax.get_workspace_size(x, dim=-1, out=y)
    ex.set_repeatable()
    ws = dev.malloc(size, stream=stream)
    t0 = time.perf_counter()
    for _ in range(runs):
        tp.ops.softmax(ws, size, ex, stream)
    t1 = time.perf_counter()
    stream.synchronize()
    t2 = time.perf_counter()
    phase2 = (t1 - t0) / runs
    kernel = (t2 - t0) / runs

    ref = host.astype(np.float64)
    ref = np.exp(ref - ref.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    err = float(np.abs(y.numpy() - ref).max())
    ws.free(stream)
    ex.destroy()

    print(f"softmax {rows}x{cols} float32, implementation '{ex.implementation}', workspace {size} bytes")
    print(f"  max |error| vs float64 numpy: {err:.2e}  ({'ok' if err < 1e-6 else 'WRONG'})")
    print(f"  phase 1, first call (incl. kernel compile/load): {first_plan * 1e3:9.2f} ms")
    print(f"  phase 1, executor-cache hit:                    {phase1_hit * 1e6:9.2f} us")
    print(f"  phase 2, host enqueue per call ({runs} calls):    {phase2 * 1e6:9.2f} us")
    print(f"  stream throughput per call (enqueue to sync):   {kernel * 1e6:9.2f} us")
    print(f"  phase-2 share of (phase 1 + phase 2):           {phase2 / (phase1_hit + phase2):9.3f}")
    return 0 if err < 1e-6 else 1


def main() -> int:
    """The MiniLM demo (when the model package is installed), then the softmax section."""
    from .models import minilm_demo

    rc = minilm_demo.main()
    print()
    print("== softmax: plan once, phase 2 many times")
    rc2 = softmax_section()
    return rc or rc2


if __name__ == "__main__":
    raise SystemExit(main())
