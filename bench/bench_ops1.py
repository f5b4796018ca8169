"""Operator library I: each kernel side by side with np.copyto of the same bytes, naive numpy and torch (if
installed), on float32 4096x4096, 64x262144 and 262144x64. Prints a ratio table (higher is better for us)."""

from __future__ import annotations

import os
import sys
import time
from math import erf
from typing import Any, Callable

import numpy as np

from twophase import device, ops

try:
    import torch
except ImportError:  # optional
    torch = None

SHAPES = [(4096, 4096), (64, 262144), (262144, 64)]
REPS = 5


def best(fn: Callable[[], Any], reps: int = REPS) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def ours(op: Any, ins: list[Any], **attrs: Any) -> float:
    dev = device("cpu")
    s = dev.stream()
    size, ex = op.get_workspace_size(*ins, **attrs)
    for i, d in enumerate(ex.output_descs):
        ex.set_output(i, dev.empty_like(d))
    ex.set_repeatable()
    ws = dev.malloc(size, stream=s)

    def run() -> None:
        for _ in range(3):
            op(ws, size, ex, s)
        s.synchronize()
    t = best(run) / 3
    ws.free(s)
    ex.destroy()
    return t


_verf = np.vectorize(erf, otypes=[np.float32])
CASES: dict[str, tuple[Callable[..., Any], dict[str, Any], Callable[..., Any], Any]] = {
    # name: (op, attrs, naive numpy, torch)
    "softmax": (ops.softmax, {"dim": -1}, lambda x: np.exp(x - x.max(-1, keepdims=True)) / np.exp(
        x - x.max(-1, keepdims=True)).sum(-1, keepdims=True), lambda t, o: torch.softmax(t, -1)),
    "log_softmax": (ops.log_softmax, {"dim": -1}, lambda x: (x - x.max(-1, keepdims=True)) - np.log(np.exp(
        x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)), lambda t, o: torch.log_softmax(t, -1)),
    "layer_norm": (ops.layer_norm, {}, lambda x: (x - x.mean(-1, keepdims=True)) / np.sqrt(
        x.var(-1, keepdims=True) + 1e-5), lambda t, o: torch.nn.functional.layer_norm(t, t.shape[-1:])),
    "rms_norm": (ops.rms_norm, {}, lambda x: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6),
                 lambda t, o: torch.nn.functional.rms_norm(t, t.shape[-1:])),
    "gelu": (ops.gelu, {}, lambda x: 0.5 * x * (1 + _verf(x / np.float32(np.sqrt(2)))),
             lambda t, o: torch.nn.functional.gelu(t)),
    "silu": (ops.silu, {}, lambda x: x / (1 + np.exp(-x)), lambda t, o: torch.nn.functional.silu(t)),
    "add": (ops.add, {}, lambda x: x + x, lambda t, o: torch.add(t, t, out=o)),
    "reduce_sum": (ops.reduce_sum, {"dims": (-1,)}, lambda x: x.sum(-1), lambda t, o: t.sum(-1)),
    "reduce_max": (ops.reduce_max, {"dims": (-1,)}, lambda x: x.max(-1), lambda t, o: t.amax(-1)),
}


def main() -> None:
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}  cpus={os.cpu_count()}  "
          f"torch={'%s' % torch.__version__ if torch else 'not installed'}")
    print("ratios: copyto = t(np.copyto of the output bytes; for reductions too: np.copyto of the input, which also writes) / t(ours); "
          "naive = t(numpy) / t(ours); torch = t(torch) / t(ours)")
    print(f"{'kernel':<11} {'shape':<12} {'ours ms':>8} {'copyto':>7} {'naive':>7} {'torch':>7}")
    dev = device("cpu")
    rng = np.random.default_rng(0)
    for shape in SHAPES:
        x = rng.standard_normal(shape).astype(np.float32)
        xt = dev.tensor(x)
        xt.synchronize()
        dst = np.empty_like(x)
        t_copy = best(lambda: np.copyto(dst, x))
        for name, (op, attrs, naive, tfn) in CASES.items():
            if sys.argv[1:] and name not in sys.argv[1:]:  # `python -m bench.bench_ops1 softmax log_softmax`
                continue
            if name in ("layer_norm", "rms_norm"):
                attrs = {"normalized_shape": (shape[-1],)}
            ins = [xt, xt] if name == "add" else [xt]
            t = ours(op, ins, **attrs)
            if name == "gelu":  # scalar erf per element: time 1/64 of the rows
                part = x[: max(1, shape[0] // 64)]
                t_naive = best(lambda: naive(part), 1) * shape[0] / part.shape[0]
            else:
                t_naive = best(lambda: naive(x), 1)
            t_torch = float("nan")
            if torch is not None:
                tx, to = torch.from_numpy(x), torch.empty(shape)
                t_torch = best(lambda: tfn(tx, to))
            print(f"{name:<11} {'x'.join(map(str, shape)):<12} {t * 1e3:8.2f} {t_copy / t:7.2f} {t_naive / t:7.2f} "
                  f"{t_torch / t:7.2f}")


if __name__ == "__main__":
    main()
