"""Ratio table for matmul, conv2d and SDPA vs numpy / torch, measured side by side in one process.

Run: ``.venv/bin/python -m bench.bench_ops2``. ratio = reference time / twophase time (> 1: twophase faster),
the median over rounds that time twophase and the reference back to back (the machines drift, so each round's
ratio is taken from times measured together); the ms columns are the medians of each side. Every timing starts
``settle``d: after a pause in which the other library's spinning workers go idle, and one untimed call. Before
timing, each row checks that both sides compute the same result. twophase's outputs and workspace are allocated
once (phase 1, outside the timing) while torch eager allocates its outputs every call (``F.conv2d`` and the others
have no ``out=``); numpy.matmul writes into a preallocated ``out=`` like twophase. Each row frees what it allocated.
"""

from __future__ import annotations

import functools
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

import twophase.ops as ops
from bench.common import HIGHER_FASTER, assert_same, header, releaser, settle
from twophase.runtime.device import device

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # torch is optional
    torch = None  # type: ignore[assignment]

REPS_MIN_S = 0.3


Loop = Callable[[int], None]


ROUNDS = 11  # 7 until the sixty-fifth session: rows of the same code then swung 0.85-1.24 from run to run
SHORT_ROUNDS = 13  # for calls under SHORT_S: a 0.2 ms GEMM's rounds swing 0.6-1.7x when the shared cores are busy
SHORT_S = 0.5e-3


def _per_call(fn: Loop, reps: int) -> float:
    settle(lambda: fn(1))
    t0 = time.perf_counter()
    fn(reps)
    return (time.perf_counter() - t0) / reps


def _reps(fn: Loop) -> int:
    t0 = time.perf_counter()
    fn(1)
    dt = time.perf_counter() - t0
    return max(1, min(200, int(REPS_MIN_S / 5 / max(dt, 1e-6))))


def _loop(fn: Callable[[], Any]) -> Loop:
    def run(n: int) -> None:
        for _ in range(n):
            fn()

    return run


class Ours(NamedTuple):
    """A row's measured side: its loop, the executor (or a stand-in), its first output as a host array after a
    run, and the release of everything it allocated (workspace, inputs, outputs, stream)."""

    run: Loop
    ex: Any
    output: Callable[[], Any]
    release: Callable[[], None]


def twophase_call(op: Any, arrays: list[Any], limit: int | None = None, **attrs: Any) -> Ours:
    """A phase-2 loop body (repeatable executor, pool workspace, one stream), the executor, output, release."""
    dev = device("cpu")
    stream = dev.stream()
    tensors = [dev.tensor(a, stream=stream) for a in arrays if a is not None]
    it = iter(tensors)
    args = [None if a is None else next(it) for a in arrays]
    stream.synchronize()
    size, ex = op.get_workspace_size(*args, workspace_limit=limit, **attrs)
    ex.set_repeatable()
    outs = [dev.empty_like(d) for d in ex.output_descs]
    for i, t in enumerate(outs):
        ex.set_output(i, t)
    ws = dev.malloc(size)

    def run(n: int) -> None:
        for _ in range(n):
            op(ws, size, ex, stream)
        stream.synchronize()

    return Ours(run, ex, outs[0].numpy, releaser(stream, ws, tensors + outs))


def ratio_cells(ratios: list[float]) -> str:
    """A row's last two cells: the median of its rounds' ratios, and their middle half (first to third
    quartile), which shows whether a ratio's distance from 1 is more than the scatter between rounds."""
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return f"{statistics.median(ratios):.2f} | {q1:.2f}-{q3:.2f}"


def row(name: str, side: Ours, ref_call: Callable[[], Any] | None, ref_name: str) -> str:
    """One table row: phase 2 in a loop then one synchronize, against the reference called as many times,
    interleaved over ``ROUNDS`` rounds (median ratio and the middle half of the rounds' ratios), once both are
    checked to compute the same result; the row's allocations are freed after it."""
    ours, ex = side.run, side.ex
    ours(1)
    if ref_call is not None:
        assert_same(f"{name}: twophase vs {ref_name}", side.output(), np.asarray(ref_call()))
    reps = _reps(ours)
    rounds = SHORT_ROUNDS if REPS_MIN_S / 5 / reps < SHORT_S else ROUNDS
    if ref_call is None:
        t = statistics.median(_per_call(ours, reps) for _ in range(rounds))
        ex.destroy()
        side.release()
        return f"| {name} | {ex.implementation} | {ex.workspace_size} | {t * 1e3:.3f} | {ref_name}: n/a | n/a | n/a |"
    ref = _loop(ref_call)
    ref(1)
    t_ours, t_ref, ratios = [], [], []
    for i in range(rounds):
        if i % 2 == 0:  # alternate which side goes first
            to = _per_call(ours, reps)
            tr = _per_call(ref, reps)
        else:
            tr = _per_call(ref, reps)
            to = _per_call(ours, reps)
        t_ours.append(to)
        t_ref.append(tr)
        ratios.append(tr / to)
    ex.destroy()
    side.release()
    return (
        f"| {name} | {ex.implementation} | {ex.workspace_size} | {statistics.median(t_ours) * 1e3:.3f} | "
        f"{ref_name} {statistics.median(t_ref) * 1e3:.3f} | {ratio_cells(ratios)} |"
    )


class _Control:
    """Stands in for the executor of a control row, which times numpy against itself: the ratio it reads is the
    table's noise floor (the machine's drift between the two sides of a round), not a cost of twophase."""

    implementation = "control"
    workspace_size = 0

    def destroy(self) -> None:
        pass


def bench_matmul(rng: Any) -> list[str]:
    out = []
    for m, k, n in ((1024, 1024, 1024), (128, 384, 384), (128, 384, 1536), (128, 1536, 384)):
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        o1, o2 = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
        control = Ours(
            _loop(functools.partial(np.matmul, a, b, out=o1)), _Control(), functools.partial(np.asarray, o1), _nothing
        )
        out.append(
            row(
                f"matmul {m}x{k}x{n} numpy against numpy",
                control,
                functools.partial(np.matmul, a, b, out=o2),
                "numpy.matmul",
            )
        )
        for label, limit in (("", None), (" a reversed", None)):
            if label:
                a_in = np.ascontiguousarray(a[::-1])
                o = np.empty((m, n), np.float32)
                av = a_in[::-1]
                ref = lambda av=av, b=b, o=o: np.matmul(av, b, out=o)  # noqa: E731
                out.append(row(f"matmul {m}x{k}x{n}{label}", _reversed_matmul(a_in, b), ref, "numpy.matmul"))
                continue
            o = np.empty((m, n), np.float32)
            out.append(
                row(
                    f"matmul {m}x{k}x{n}",
                    twophase_call(ops.matmul, [a, b], limit),
                    functools.partial(np.matmul, a, b, out=o),
                    "numpy.matmul",
                )
            )
    return out


def _nothing() -> None:
    """The release of a row that allocated nothing in the pool."""


def _reversed_matmul(a_rev_storage: Any, b: Any) -> Ours:
    """matmul on a row-reversed view (negative row stride): BLAS cannot take it, so phase 1 packs it into the
    workspace, or (float32, up to 512 rows) the microkernel reads it in place."""
    dev = device("cpu")
    stream = dev.stream()
    ta = dev.tensor(a_rev_storage, stream=stream)
    m, k = a_rev_storage.shape
    view = ta.strided((m, k), (-k, 1), offset=(m - 1) * k)
    tb = dev.tensor(b, stream=stream)
    stream.synchronize()
    size, ex = ops.matmul.get_workspace_size(view, tb)
    ex.set_repeatable()
    o = dev.empty_like(ex.output_descs[0])
    ex.set_output(0, o)
    ws = dev.malloc(size)

    def run(n: int) -> None:
        for _ in range(n):
            ops.matmul(ws, size, ex, stream)
        stream.synchronize()

    return Ours(run, ex, o.numpy, releaser(stream, ws, [ta, tb, o]))


RESNET18 = (
    (64, 56, 64, 3, 1, 1),
    (64, 56, 128, 3, 2, 1),
    (128, 28, 128, 3, 1, 1),
    (128, 28, 256, 3, 2, 1),
    (256, 14, 256, 3, 1, 1),
    (256, 14, 512, 3, 2, 1),
    (512, 7, 512, 3, 1, 1),
    (64, 56, 128, 1, 2, 0),
    (3, 224, 64, 7, 2, 3),
)


def bench_conv(rng: Any, batches: tuple[int, ...]) -> list[str]:
    out = []
    for nb in batches:
        for c, hw, oc, k, s, p in RESNET18:
            x = rng.standard_normal((nb, c, hw, hw)).astype(np.float32)
            w = (rng.standard_normal((oc, c, k, k)) * 0.05).astype(np.float32)
            ref = None
            if torch is not None:
                xt, wt = torch.from_numpy(x), torch.from_numpy(w)
                ref = lambda xt=xt, wt=wt, s=s, p=p: F.conv2d(xt, wt, None, s, p)  # noqa: E731
            name = f"conv2d n{nb} {c}->{oc} {hw}x{hw} k{k} s{s}"
            variants = [("", None, False), (" tight", 1 << 18, False)]
            if k == 3 and s == 1:  # where winograd runs: its weights transformed once per binding
                variants.append((" constant_weight", None, True))
            for label, limit, cw in variants:
                side = twophase_call(ops.conv2d, [x, w, None], limit, stride=s, padding=p, constant_weight=cw)
                out.append(row(name + label, side, ref, "torch"))
    return out


def bench_pool_depthwise(rng: Any) -> list[str]:
    """Beyond the issue's table: ResNet's stem max pool and its avg twin, and MobileNet-style 3x3 depthwise
    convolutions (the direct kernel), batch 1 and 8, against torch."""
    out = []
    for nb in (1, 8):
        x = rng.standard_normal((nb, 64, 112, 112)).astype(np.float32)
        xt = torch.from_numpy(x) if torch is not None else None
        for name in ("max_pool2d", "avg_pool2d"):
            op, fn = getattr(ops, name), name
            side = twophase_call(op, [x], kernel_size=3, stride=2, padding=1)
            ref: Callable[[], Any] | None = None if xt is None else functools.partial(getattr(F, fn), xt, 3, 2, 1)
            out.append(row(f"{name} n{nb} 64x112x112 k3 s2", side, ref, "torch"))
        for c, hw, s in ((64, 56, 1), (128, 56, 2), (256, 28, 1)):
            x = rng.standard_normal((nb, c, hw, hw)).astype(np.float32)
            w = rng.standard_normal((c, 1, 3, 3)).astype(np.float32)
            side = twophase_call(ops.conv2d, [x, w, None], stride=s, padding=1, groups=c)
            ref = None
            if torch is not None:
                ref = functools.partial(F.conv2d, torch.from_numpy(x), torch.from_numpy(w), None, s, 1, 1, c)
            out.append(row(f"conv2d depthwise n{nb} {c} {hw}x{hw} k3 s{s}", side, ref, "torch"))
    return out


def bench_sdpa(rng: Any) -> list[str]:
    out = []
    for shape in ((8, 12, 128, 32), (1, 12, 512, 64)):
        q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
        ref = None
        if torch is not None:
            qt, kt, vt = (torch.from_numpy(a) for a in (q, k, v))
            ref = lambda qt=qt, kt=kt, vt=vt: F.scaled_dot_product_attention(qt, kt, vt)  # noqa: E731
        for label, limit in (("", None), (" tight", 1 << 16)):
            for causal in (False, True):
                side = twophase_call(ops.scaled_dot_product_attention, [q, k, v, None], limit, is_causal=causal)
                r = ref
                if torch is not None and causal:
                    r = lambda qt=qt, kt=kt, vt=vt: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)  # noqa: E731
                out.append(row(f"sdpa {shape}{' causal' if causal else ''}{label}", side, r, "torch"))
    return out


def main() -> None:
    rng = np.random.default_rng(0)
    core = os.environ.get("OPENBLAS_CORETYPE", "unset")
    tv = torch.__version__ if torch is not None else "not installed"
    threads = torch.get_num_threads() if torch is not None else "n/a"
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "unset")
    print(header("bench_ops2: matmul, conv2d, SDPA and pools vs numpy / torch (bench/bench_ops2.py)"))
    print(
        f"OPENBLAS_CORETYPE={core} OPENBLAS_NUM_THREADS={blas}; numpy {np.__version__}; torch {tv} "
        f"(threads {threads}); cpus {os.cpu_count()}; float32; ms per call (median of {ROUNDS} interleaved rounds, "
        f"{SHORT_ROUNDS} for calls under {SHORT_S * 1e3:g} ms), "
        "ratio = median of the rounds' ratios, middle half = their first to third quartile; "
        "tight = workspace_limit 256 KiB (conv2d) / 64 KiB (sdpa); "
        "constant_weight = conv2d's constant_weight=True (winograd's transformed weights kept by the executor "
        "after its first launch, not remade per call)"
    )
    print(
        "What is timed: twophase's phase 2 only, into outputs and a workspace planned and allocated once (phase 1, "
        "untimed); torch eager allocates its outputs on every call (F.conv2d, the pools and SDPA have no out=), "
        "so its time includes that allocation and the first touch of the fresh pages (by page faults per call: "
        "~49 MB for conv2d n8 3->64 224x224 k7, 6-8 MB for the n8 pools and 64->64 convs); numpy.matmul "
        "writes into a preallocated out= like twophase. Each row first checks that both "
        "sides compute the same result (float32: max error <= 1e-4 x the largest output)."
    )
    print(f"# uptime: {_uptime()}")
    print(
        f"| case | implementation | workspace (B) | twophase ms | reference ms | ratio reference / twophase "
        f"({HIGHER_FASTER}) | middle half of the rounds |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    sections: list[Callable[[], list[str]]] = [
        functools.partial(bench_matmul, rng),
        functools.partial(bench_conv, rng, (1, 8)),
        functools.partial(bench_sdpa, rng),
        functools.partial(bench_pool_depthwise, rng),
    ]
    for section in sections:
        for line in section():
            print(line, flush=True)
    print(f"# uptime: {_uptime()}")


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "n/a"


if __name__ == "__main__":
    main()
