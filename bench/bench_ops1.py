"""Operator library I: each kernel side by side with np.copyto of the same bytes, naive numpy and torch (if
installed), on float32 4096x4096, 64x262144 and 262144x64. Prints a ratio table, t(baseline) / t(ours) (> 1:
twophase faster).

Every row is timed in interleaved rounds (``bench.common.interleaved_ratios``: ours, the baselines, ours, ...,
the order rotating), and each ratio is the median over rounds of the two times taken in the same round, so machine
drift and load hit both sides alike. Like ours, torch writes into an output allocated once (its ``out=``
variants), except for layer_norm and rms_norm, which have none that does: those rows say so. Before timing, each
row checks that ours, naive numpy and torch compute the same result. add's rows are followed by the least time
any add can take, reading its input once, measured in the same rounds (``_floor_note``): naive numpy's ``x + x``
is one pass too, so 5x naive can be below it. ``python -m bench.bench_ops1 gelu silu`` runs only the named kernels.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from math import erf
from typing import Any

import numpy as np

from bench.common import HIGHER_FASTER, assert_same, interleaved_ratios, releaser
from twophase import device, ops

try:
    import torch
except ImportError:  # optional
    torch = None  # type: ignore[assignment]

SHAPES = [(4096, 4096), (64, 262144), (262144, 64)]
CALLS, ROUNDS = 3, 7  # calls per timing, interleaved rounds (median of the per-round ratios)
REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_sum0", "reduce_max0", "argmax", "var")

_verf = np.vectorize(erf, otypes=[np.float32])
# torch's side of a row: (the functional form, what the table times: the out= variant writing into an output
# allocated once, or None where torch has no such variant and the functional form, allocating, is timed)
TorchCall = tuple[Callable[[Any], Any], Callable[[Any, Any], Any] | None]
# aten.native_layer_norm.out exists but allocates its result and copies it into out0 (one 64 MiB output's page
# faults per call, measured), and rms_norm has no out overload in torch 2.13: those two rows time the allocating call
ALLOCATING = "allocates"
CASES: dict[str, tuple[Callable[..., Any], dict[str, Any], Callable[..., Any], TorchCall]] = {
    # name: (op, attrs, naive numpy, torch)
    "softmax": (
        ops.softmax,
        {"dim": -1},
        lambda x: np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True),
        (lambda t: torch.softmax(t, -1), lambda t, o: torch._softmax(t, -1, False, out=o)),
    ),
    "log_softmax": (
        ops.log_softmax,
        {"dim": -1},
        lambda x: (x - x.max(-1, keepdims=True)) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)),
        (lambda t: torch.log_softmax(t, -1), lambda t, o: torch._log_softmax(t, -1, False, out=o)),
    ),
    "layer_norm": (
        ops.layer_norm,
        {},
        lambda x: (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5),
        (lambda t: torch.nn.functional.layer_norm(t, t.shape[-1:]), None),
    ),
    "rms_norm": (
        ops.rms_norm,
        {},
        lambda x: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6),
        (lambda t: torch.nn.functional.rms_norm(t, t.shape[-1:]), None),
    ),
    "gelu": (
        ops.gelu,
        {},
        lambda x: 0.5 * x * (1 + _verf(x / np.float32(np.sqrt(2)))),
        (lambda t: torch.nn.functional.gelu(t), lambda t, o: torch._C._nn.gelu(t, out=o)),  # type: ignore[call-arg]
    ),
    "silu": (
        ops.silu,
        {},
        lambda x: x / (1 + np.exp(-x)),
        (lambda t: torch.nn.functional.silu(t), lambda t, o: torch._C._nn.silu(t, out=o)),  # type: ignore[call-arg]
    ),
    "add": (ops.add, {}, lambda x: x + x, (lambda t: torch.add(t, t), lambda t, o: torch.add(t, t, out=o))),
    "reduce_sum": (
        ops.reduce_sum,
        {"dims": (-1,)},
        lambda x: x.sum(-1),
        (lambda t: t.sum(-1), lambda t, o: torch.sum(t, -1, out=o)),
    ),
    "reduce_max": (
        ops.reduce_max,
        {"dims": (-1,)},
        lambda x: x.max(-1),
        (lambda t: t.amax(-1), lambda t, o: torch.amax(t, -1, out=o)),
    ),
    "reduce_min": (
        ops.reduce_min,
        {"dims": (-1,)},
        lambda x: x.min(-1),
        (lambda t: t.amin(-1), lambda t, o: torch.amin(t, -1, out=o)),
    ),
    "reduce_sum0": (
        ops.reduce_sum,
        {"dims": (0,)},
        lambda x: x.sum(0),
        (lambda t: t.sum(0), lambda t, o: torch.sum(t, 0, out=o)),
    ),
    "reduce_max0": (
        ops.reduce_max,
        {"dims": (0,)},
        lambda x: x.max(0),
        (lambda t: t.amax(0), lambda t, o: torch.amax(t, 0, out=o)),
    ),
    "argmax": (
        ops.argmax,
        {"dim": -1},
        lambda x: x.argmax(-1),
        (lambda t: t.argmax(-1), lambda t, o: torch.argmax(t, -1, out=o)),
    ),
    "var": (
        ops.var,
        {"dims": (-1,)},
        lambda x: x.var(-1, ddof=1),
        (lambda t: t.var(-1), lambda t, o: torch.var(t, -1, out=o)),
    ),
}


def ours(op: Any, ins: list[Any], **attrs: Any) -> tuple[Callable[[], None], Callable[[], None], list[Any]]:
    """(run: CALLS launches then a synchronize, release: frees the workspace and outputs, the outputs): phase 1
    and every allocation once, outside the timing."""
    dev = device("cpu")
    s = dev.stream()
    size, ex = op.get_workspace_size(*ins, **attrs)
    outs = [dev.empty_like(d) for d in ex.output_descs]
    for i, o in enumerate(outs):
        ex.set_output(i, o)
    ex.set_repeatable()
    ws = dev.malloc(size, stream=s)

    def run() -> None:
        for _ in range(CALLS):
            op(ws, size, ex, s)
        s.synchronize()

    return run, releaser(s, ws, outs, ex), outs


def _repeat(fn: Callable[..., Any], *args: Any) -> None:
    """CALLS calls of ``fn(*args)``: one timing of a baseline, as ``ours``' run is CALLS launches."""
    for _ in range(CALLS):
        fn(*args)


def _check(name: str, shape: tuple[int, ...], got: Any, naive: Any, torch_out: Any, torch_ref: Any) -> None:
    """Raise unless ours, naive numpy and torch (its timed call against its functional form) agree, so no row
    times two different computations. ``naive`` may cover only the leading rows (gelu's scalar erf)."""
    label = f"{name} {'x'.join(map(str, shape))}"
    if torch_out is not None:
        assert_same(f"{label}: torch's out= variant vs its functional form", torch_out, torch_ref, rel=0)
        assert_same(f"{label}: ours vs torch", got, torch_out)
    assert_same(f"{label}: ours vs naive numpy", got[: len(naive)] if got.ndim else got, naive)


def table() -> None:
    """The ratio table in this process's environment."""
    print(
        f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}  "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}  cpus={os.cpu_count()}  "
        f"torch={torch.__version__ if torch else 'not installed'}"
    )
    print(
        f"ratios t(baseline) / t(ours) ({HIGHER_FASTER}), medians over interleaved rounds of the two times "
        "taken in the same round; 'ours ms' and 'copyto ms' are the medians of each side's own times (the baseline "
        "itself moves between processes and runs of this shared host); copyto = t(np.copyto of the output "
        "bytes; for reductions: of the input, which also writes) / t(ours); read = t(one SIMD pass that only "
        "reads the input: np.max of its int32 view) / t(ours), reductions only; naive = t(numpy) / t(ours); "
        "torch = t(torch) / t(ours). Ours writes into outputs allocated once (phase 1); so does torch (its out= "
        "variants: 'torch call' out=), except where 'torch call' reads 'allocates': layer_norm and rms_norm have "
        "no out= variant that writes in place, so torch's time there includes allocating and page-faulting "
        "fresh 64 MiB buffers every call (layer_norm: its output; rms_norm: its output and one temporary, by "
        "their page faults). Each row is checked before timing: ours, naive and torch agree."
    )
    print(
        f"{'kernel':<11} {'shape':<12} {'ours ms':>8} {'copyto ms':>9} {'copyto':>7} {'read':>7} {'naive':>7} "
        f"{'torch':>7}  torch call  (ratios > 1: twophase faster)"
    )
    dev = device("cpu")
    rng = np.random.default_rng(0)
    notes: list[str] = []
    for shape in SHAPES:
        x = rng.standard_normal(shape).astype(np.float32)
        xi = x.view(np.int32).reshape(-1)
        xt = dev.tensor(x)
        xt.synchronize()
        dst = np.empty_like(x)
        for name, (op, attrs, naive, tfn) in CASES.items():
            if sys.argv[1:] and name not in sys.argv[1:]:  # `python -m bench.bench_ops1 softmax log_softmax`
                continue
            if name in ("layer_norm", "rms_norm"):
                attrs = {"normalized_shape": (shape[-1],)}
            run, release, outs = ours(op, [xt, xt] if name == "add" else [xt], **attrs)

            def copy(dst: Any = dst, x: Any = x) -> None:
                for _ in range(CALLS):
                    np.copyto(dst, x)

            def read(xi: Any = xi) -> None:
                for _ in range(CALLS):
                    np.max(xi)

            fns: dict[str, Callable[[], Any]] = {"ours": run, "copyto": copy}
            if name in REDUCTIONS:
                fns["read"] = read
            floor_release = None
            if name == "add":  # the fastest read of x measured here: add's floor (``_floor_note``)
                fns["floor"], floor_release, _ = ours(ops.reduce_sum, [xt], dims=(-1,))
            call = "n/a"
            to = t_ref = None
            if torch is not None:
                functional, out_variant = tfn
                tx = torch.from_numpy(x)
                ref_t = functional(tx)
                t_ref = ref_t.numpy()
                if out_variant is None:
                    call = ALLOCATING
                    fns["torch"] = functools.partial(_repeat, functional, tx)
                    to = t_ref
                else:
                    call = "out="
                    tout = torch.empty_like(ref_t)
                    out_variant(tx, tout)
                    to = tout.numpy()
                    fns["torch"] = functools.partial(_repeat, out_variant, tx, tout)
            if name == "gelu":  # scalar erf per element: time 1/64 of the rows, scaled
                part = x[: max(1, shape[0] // 64)]
                scale = shape[0] / part.shape[0]
                fns["naive"] = functools.partial(naive, part)
                want = naive(part)
            else:
                scale = 1.0
                fns["naive"] = functools.partial(naive, x)
                want = naive(x)
            run()
            _check(name, shape, outs[0].numpy(), want, to, t_ref)
            want = to = t_ref = ref_t = None  # the checked copies (up to 64 MiB each) are not kept through the timing
            t, r = interleaved_ratios(fns, "ours", 1, rounds=ROUNDS)
            release()
            r["naive"] *= scale * CALLS  # one naive call stands for CALLS calls, like the others
            nan = float("nan")
            print(
                f"{name:<11} {'x'.join(map(str, shape)):<12} {t['ours'] / CALLS * 1e3:8.2f} "
                f"{t['copyto'] / CALLS * 1e3:9.2f} {r['copyto']:7.2f} {r.get('read', nan):7.2f} {r['naive']:7.2f} "
                f"{r.get('torch', nan):7.2f}  {call}"
            )
            if floor_release is not None:
                floor_release()
                notes.append(_floor_note(shape, t, r))
    for note in notes:
        print(note)


def _floor_note(shape: tuple[int, ...], t: dict[str, float], r: dict[str, float]) -> str:
    """add's row against the least time any add can take: reading its input once, timed as twophase's reduce_sum
    over it (two threads; the fastest read of the input this table measures) in the same rounds. Where 5x naive
    numpy (``x + x``, itself one pass) asks for less than that, the target is below the memory's speed."""
    floor = t["floor"] / CALLS
    naive = t["ours"] / CALLS * r["naive"]  # the naive time per call the row's ratio stands for
    return (
        f"add {'x'.join(map(str, shape))}: 5x naive numpy means {naive / 5 * 1e3:.2f} ms a call; reading the "
        f"input once takes {floor * 1e3:.2f} ms (twophase reduce_sum, same rounds), and add also writes the output: "
        f"ours takes {1 / r['floor']:.2f}x that read"
    )


def _wider(shape: tuple[int, ...], pad: int, seed: int) -> tuple[Any, Any]:
    """(dense, view) device tensors of the same random float32 values: ``view`` is the leading part of each
    last-dim row of a ``pad`` elements wider array (dense rows, the whole not one stride)."""
    dev = device("cpu")
    wide = np.random.default_rng(seed).standard_normal((*shape[:-1], shape[-1] + pad)).astype(np.float32)
    dense_t = dev.tensor(np.ascontiguousarray(wide[..., : shape[-1]]))
    view_t = dev.tensor(wide).strided(shape, tuple(st // wide.itemsize for st in wide.strides), 0)
    dense_t.synchronize()
    view_t.synchronize()
    return dense_t, view_t


def _layout_cost(op: Any, dense_ins: list[Any], other_ins: list[Any], attrs: dict[str, Any]) -> tuple[float, float]:
    """(ms per call on the dense inputs, t(other) / t(dense)): both launch loops timed in interleaved rounds,
    after checking that both compute the same result."""
    run_d, rel_d, out_d = ours(op, dense_ins, **attrs)
    run_o, rel_o, out_o = ours(op, other_ins, **attrs)
    run_d()
    run_o()
    for a, b in zip(out_o, out_d, strict=True):
        assert_same(f"{op.name}: strided vs dense input", a.numpy(), b.numpy())
    t, r = interleaved_ratios({"other": run_o, "dense": run_d}, "other", 1, rounds=ROUNDS)
    rel_d()
    rel_o()
    return t["dense"] / CALLS * 1e3, 1 / r["dense"]


PADDED = (4096, 1024)  # rows of a (4096, 1024 + PAD) array
PAD = 76


def padded_table() -> None:
    """Each row kernel on the rows of a wider array (every row dense, the matrix not) against the same rows
    dense, side by side: the kernels take such rows typed dense, so the ratio should stay near 1 (it was 4-16
    when they ran typed strided)."""
    print(
        f"\nrows of a wider array: {PADDED[0]}x{PADDED[1]} float32 viewed in a {PADDED[0]}x{PADDED[1] + PAD} "
        "one, against the same rows dense; t(padded) / t(dense), median of interleaved rounds (< 1: padded faster; "
        "1 = no cost)"
    )
    print(f"{'kernel':<12} {'dense ms':>9} {'padded/dense':>13}  (< 1: padded faster)")
    dense_t, padded_t = _wider(PADDED, PAD, 1)
    for name, (op, attrs, _naive, _tfn) in CASES.items():
        if name == "add" or (sys.argv[1:] and name not in sys.argv[1:]):
            continue
        if name in ("layer_norm", "rms_norm"):
            attrs = {"normalized_shape": (PADDED[1],)}
        ms, ratio = _layout_cost(op, [dense_t], [padded_t], attrs)
        print(f"{name:<12} {ms:9.3f} {ratio:13.2f}")


CROP, CROP_PAD = (8, 64, 56, 56), 8  # NCHW images whose rows are the leading 56 of 64-wide ones
CROP_OPS: dict[str, tuple[Any, dict[str, Any], int]] = {
    # name: (op, attrs, extra per-channel (C,) inputs); rows of W = 56 floats each
    "batch_norm": (ops.batch_norm, {}, 4),
    "group_norm": (ops.group_norm, {"num_groups": 8}, 2),
    "max_pool2d": (ops.max_pool2d, {"kernel_size": 3, "stride": 2, "padding": 1}, 0),
    "avg_pool2d": (ops.avg_pool2d, {"kernel_size": 3, "stride": 2, "padding": 1}, 0),
    "gelu": (ops.gelu, {}, 0),
    "softmax": (ops.softmax, {"dim": -1}, 0),
    "layer_norm": (ops.layer_norm, {"normalized_shape": (CROP[3],)}, 0),
    "reduce_sum": (ops.reduce_sum, {"dims": (2, 3)}, 0),
}


def crop_table() -> None:
    """Image ops on an NCHW crop of wider images (dense rows of 56, planes and images not one stride) against
    the same images dense: the kernels walk such planes row by row in place; the ops that still pack the
    input first (reductions over dims that do not merge) show the cost of that copy."""
    n, c, h, w = CROP
    print(
        f"\ncrops of wider images: {n}x{c}x{h}x{w} float32 viewed in {n}x{c}x{h}x{w + CROP_PAD}, against the same "
        "images dense; t(crop) / t(dense), median of interleaved rounds (< 1: crop faster; 1 = no cost)"
    )
    print(f"{'op':<12} {'impl (crop)':<16} {'ws (crop)':>10} {'dense ms':>9} {'crop/dense':>11}  (< 1: crop faster)")
    dense_t, crop_t = _wider(CROP, CROP_PAD, 2)
    dev = device("cpu")
    params = [dev.tensor(np.random.default_rng(3).uniform(0.5, 1.5, c).astype(np.float32)) for _ in range(4)]
    params[-1].synchronize()
    for name, (op, attrs, extra) in CROP_OPS.items():
        if sys.argv[1:] and name not in sys.argv[1:]:
            continue
        size, ex = op.get_workspace_size(crop_t, *params[:extra], **attrs)
        impl = ex.implementation
        ex.destroy()
        ms, ratio = _layout_cost(op, [dense_t, *params[:extra]], [crop_t, *params[:extra]], attrs)
        print(f"{name:<12} {impl:<16} {size:>10} {ms:9.3f} {ratio:11.2f}")


def main() -> None:
    """The table as the environment stands, then (unless ``TWOPHASE_BENCH_VARIANTS=0`` or the policy is already
    set) again in a subprocess with ``OMP_WAIT_POLICY=PASSIVE``, where torch's OpenMP threads sleep when idle
    (twophase's kernels use no OpenMP threads)."""
    table()
    if "OMP_WAIT_POLICY" not in os.environ:  # once, not again in the variant
        padded_table()
        crop_table()
    if os.environ.get("TWOPHASE_BENCH_VARIANTS", "1") == "0" or "OMP_WAIT_POLICY" in os.environ:
        return
    import subprocess

    print("\nthe same with OMP_WAIT_POLICY=PASSIVE (torch's OpenMP threads sleep when idle):")
    out = subprocess.run(
        [sys.executable, "-m", "bench.bench_ops1", *sys.argv[1:]],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
        check=False,
    )
    print(out.stdout.rstrip() if out.returncode == 0 else f"variant failed:\n{out.stderr[-2000:]}")


if __name__ == "__main__":
    main()
