"""The shape-matrix harness: run every case of an op under the sanitizer against its float64 reference, twice
(random sync points across several streams, then launch-blocking), and require both runs to match the
reference and each other."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import config, sanitizer
from ..errors import ParamError, TwoPhaseError
from ..functional import one_shot
from ..op import REQUIRED, Op, get_op, registry
from ..runtime.device import Device, device
from ..runtime.stream import Stream
from ..tensor import DType, Tensor
from .cases import GENERATORS, Case, Layout, generic_cases
from .checked import GAP_PATTERN, changed_inputs, in_place_inputs

__all__ = ["shape_matrix", "run_case", "run_matrix", "MatrixResult", "CaseResult", "format_table", "TOLERANCE"]

TOLERANCE = {DType.float16: (2e-2, 2e-3), DType.float32: (2e-4, 1e-6), DType.float64: (1e-9, 1e-12)}
LONG_N = 2_000_003  # "N up to a few million" (a prime); CI passes a smaller one


def shape_matrix(
    op: Op | str, dtypes: Iterable[Any] | None = None, seed: int = 0, long_n: int = LONG_N
) -> list[tuple[DType, Case]] | None:
    """The cases of ``op`` for each dtype (default: float32 if the op takes it, else its first dtype).

    ``None`` when the harness cannot drive the op (required attributes and no case generator).
    """
    op = get_op(op) if isinstance(op, str) else op
    spec = op.spec
    dts = (
        [DType.of(d) for d in dtypes]
        if dtypes is not None
        else [DType.float32 if DType.float32 in spec.dtypes or not spec.dtypes else spec.dtypes[0]]
    )
    dts = [d for d in dts if not spec.dtypes or d in spec.dtypes]
    gen = GENERATORS.get(op.name)
    if gen is None and any(a.default is REQUIRED for a in spec.attrs):
        return None
    rng = np.random.default_rng(seed)
    out = []
    for d in dts:
        cases = (
            gen(rng, d, long_n)
            if gen is not None
            else generic_cases(op.name, sum(not n.endswith("?") for n in spec.inputs), rng, d, long_n)
        )
        out += [(d, c) for c in cases]
    return out


@dataclass
class CaseResult:
    label: str
    ok: bool
    error: float = 0.0  # largest |out - ref| / (1 + |ref|) over both runs
    rejected: bool = False  # phase 1 refused the generic case (a valid answer, not a pass)
    message: str = ""


@dataclass
class MatrixResult:
    op: str
    cases: int = 0
    passed: int = 0
    failed: int = 0
    rejected: int = 0
    largest_error: float = 0.0
    worst_case: str = ""
    skipped: str = ""
    failures: list[str] = field(default_factory=list)
    note: str = ""  # what the run could not check (no reference: the values were not compared)


def _tensor(dev: Device, x: Any, s: Stream, keep: list[Tensor]) -> Any:
    if x is None:
        return None
    if isinstance(x, Layout):
        a = np.asarray(x.array)
        if x.kind == "transposed":
            base = dev.tensor(np.ascontiguousarray(np.swapaxes(a, -1, -2)), stream=s)
            keep.append(base)
            return base.transpose(-2, -1)
        n = a.shape[-1]
        st = list(base_strides := _dense_strides(a.shape[:-1] + (2 * n,)))
        if x.kind == "step":
            big = np.zeros(a.shape[:-1] + (2 * n,), a.dtype)
            big[..., ::2] = a
            base = dev.tensor(big, stream=s)
            keep.append(base)
            st[-1] = 2
            return base.strided(a.shape, st, 0)
        base = dev.tensor(np.ascontiguousarray(a[..., ::-1]), stream=s)  # negative strides
        keep.append(base)
        st = list(_dense_strides(a.shape))
        st[-1] = -1
        del base_strides
        return base.strided(a.shape, st, n - 1)
    t = dev.tensor(np.asarray(x), stream=s)
    keep.append(t)
    return t


def _step_outputs(
    op: Op, dev: Device, ins: list[Any], attrs: dict[str, Any], s: Stream, keep: list[Tensor]
) -> tuple[list[Tensor], list[Tensor]]:
    """(the outputs, their buffers): each output a view of every other element along its last dim of a buffer
    twice as long (a 0-d output: the first of two elements), the buffer filled with GAP_PATTERN bytes."""
    _, ex = op.get_workspace_size(*ins, **attrs)
    descs = ex.output_descs
    ex.destroy()
    outs, bases = [], []
    for d in descs:
        shape = d.shape[:-1] + (2 * d.shape[-1],) if d.shape else (2,)
        fill = np.full(int(np.prod(shape)) * d.dtype.itemsize, GAP_PATTERN, np.uint8)
        base = dev.tensor(fill.view(d.dtype.np).reshape(shape), stream=s)
        keep.append(base)
        st = list(_dense_strides(shape))
        if st:
            st[-1] = 2
        outs.append(base.strided(d.shape, st[: len(d.shape)], 0))
        bases.append(base)
    return outs, bases


def _gap_bytes_written(base: Tensor, ndim: int) -> int:
    """Bytes between the elements of a ``_step_outputs`` output that no longer hold GAP_PATTERN."""
    a = base.numpy()
    gaps = a[..., 1::2] if ndim else a[1:]
    return int((np.frombuffer(np.ascontiguousarray(gaps).tobytes(), np.uint8) != GAP_PATTERN).sum())


def _dense_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


def _host(x: Any, dtype_in: bool = True) -> Any:
    if x is None:
        return None
    a = np.asarray(x.array if isinstance(x, Layout) else x)
    return a.astype(np.float64) if a.dtype.kind == "f" else a


def _execute(
    op: Op, case: Case, dev: Device, streams: list[Stream], rng: np.random.Generator | None
) -> tuple[list[Any], list[str]]:
    """Run the case's calls; with ``rng``, on random streams with random synchronization points. Returns the
    outputs of each call and what the op changed that it must not (``"input 'x' of call 0"``: only an input bound
    in place to an output may change; the bytes between the elements of a call's ``out="step"`` outputs never)."""
    f = one_shot(op)
    keep: list[tuple[Tensor, Stream]] = []
    results: list[tuple[Any, ...]] = []
    given_in: list[tuple[list[Any], list[Any]]] = []  # per call: the host inputs and the tensors made of them
    strided: list[tuple[int, list[tuple[Tensor, int]]]] = []  # per call with strided outputs: their buffers
    try:
        for call in case.calls:
            s = streams[int(rng.integers(len(streams)))] if rng is not None else streams[0]
            mine: list[Tensor] = []
            ins = [_tensor(dev, x, s, mine) for x in call.inputs]
            keep += [(t, s) for t in mine]
            if call.out == "step":
                mine = []
                given, bases = _step_outputs(op, dev, ins, call.attrs, s, mine)
                keep += [(t, s) for t in mine]
                f(*ins, out=given[0] if len(given) == 1 else tuple(given), stream=s, **call.attrs)
                ys = tuple(given)
                strided.append((len(results), [(b, len(t.shape)) for b, t in zip(bases, given)]))
            else:
                y = f(*ins, stream=s, **call.attrs)
                ys = y if isinstance(y, tuple) else (y,)
                keep += [(t, s) for t in ys]
            results.append(ys)
            given_in.append((list(call.inputs), ins))
            if rng is not None and rng.random() < 0.4:
                other = streams[int(rng.integers(len(streams)))]
                if rng.random() < 0.5:
                    other.synchronize()
                else:
                    other.wait_event(s.record_event())
        outs = [tuple(t.numpy() for t in ys) for ys in results]
        for s in streams:
            s.synchronize()  # every launch has read its inputs
        changed = []
        for k, ((hosts, ins), ys) in enumerate(zip(given_in, results)):
            views = [t.view() if isinstance(t, Tensor) else None for t in ins]
            before = [
                None
                if x is None or v is None
                # as copied in (a Python scalar took the tensors' dtype)
                else np.asarray(x.array if isinstance(x, Layout) else x, dtype=v.dtype).tobytes(order="C")
                for x, v in zip(hosts, views)
            ]
            skip = in_place_inputs(op, views, [t.view() for t in ys if isinstance(t, Tensor)])
            changed += [
                f"input '{op.input_name(i, len(ins))}' of call {k}" for i in changed_inputs(before, views, skip)
            ]
        for k, bufs in strided:
            changed += [
                f"{n} byte(s) between the elements of strided output {i} of call {k}"
                for i, (b, nd) in enumerate(bufs)
                if (n := _gap_bytes_written(b, nd))
            ]
        return outs, changed
    finally:
        for s in streams:
            try:
                s.synchronize()
            except TwoPhaseError:
                pass
        for t, s in keep:
            if not t.block.freed:
                t.free(s)


def _error(out: np.ndarray[Any, Any], ref: Any) -> tuple[float, bool]:
    ref = np.asarray(ref)
    if out.shape != ref.shape:
        return math.inf, False
    if out.size == 0:
        return 0.0, True
    if out.dtype.kind not in "fc":
        same = np.array_equal(out, ref.astype(out.dtype) if ref.dtype.kind != "f" else ref)
        return (0.0 if same else math.inf), bool(same)
    o, r = out.astype(np.float64), ref.astype(np.float64)
    nan_o, nan_r = np.isnan(o), np.isnan(r)
    if (nan_o != nan_r).any():
        return math.inf, False
    inf_r = np.isinf(r)
    if (o[inf_r] != r[inf_r]).any():  # an infinite reference is matched exactly (its sign too): no tolerance
        return math.inf, False
    fin = np.isfinite(r)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(o[fin] - r[fin])  # inf where the output is infinite and the reference finite: fails below
    err = float((d / (1.0 + np.abs(r[fin]))).max(initial=0.0))
    rtol, atol = TOLERANCE.get(DType.of(out.dtype), (1e-4, 1e-6))
    return _worse(0.0, err), bool((d <= atol + rtol * np.abs(r[fin])).all())


def _worse(a: float, b: float) -> float:
    """The larger error of the two; an error that is NaN (not measurable) counts as infinite, never as 0."""
    a = math.inf if math.isnan(a) else a
    b = math.inf if math.isnan(b) else b
    return max(a, b)


def run_case(op: Op, dtype: DType, case: Case, seed: int = 0, n_streams: int = 3, generic: bool = False) -> CaseResult:
    """Both runs of one case under the sanitizer, compared with the reference and with each other."""
    dev = device("cpu")
    label = f"{dtype.value} {case.label}"
    streams = [dev.stream(f"matrix-{i}") for i in range(n_streams)]
    try:
        with sanitizer.sanitize():
            try:
                a, changed_a = _execute(op, case, dev, streams, np.random.default_rng(seed))
                was = config.settings.launch_blocking
                config.set_launch_blocking(True)
                try:
                    b, changed_b = _execute(op, case, dev, streams[:1], None)
                finally:
                    config.set_launch_blocking(was)
            except ParamError as exc:
                if generic and not exc.__class__.__name__.startswith(("Stale", "Workspace")):
                    return CaseResult(label, True, rejected=True, message=str(exc))
                return CaseResult(label, False, math.inf, message=f"{type(exc).__name__}: {exc}")
            except TwoPhaseError as exc:
                return CaseResult(label, False, math.inf, message=f"{type(exc).__name__}: {exc}")
            except Exception as exc:  # noqa: BLE001 - not a project exception: a bug of the op
                return CaseResult(label, False, math.inf, message=f"non-project exception {type(exc).__name__}: {exc}")
    finally:
        for s in streams:
            s.close()
    worst, ok, msg = 0.0, True, ""
    ref_fn: Callable[..., Any] | None = op.spec.reference
    for call, ra, rb in zip(case.calls, a, b):
        refs: Any = None
        if ref_fn is not None:
            try:
                refs = ref_fn(*(_host(x) for x in call.inputs), **op._attrs(call.attrs))
            except Exception as exc:  # noqa: BLE001 - a bug of the reference: this case fails, the run goes on
                return CaseResult(
                    label,
                    False,
                    math.inf,
                    message=f"the reference of op '{op.name}' raised {type(exc).__name__}: {exc}",
                )
            refs = tuple(refs) if isinstance(refs, (tuple, list)) else (refs,)
            if len(refs) != len(ra):
                return CaseResult(
                    label,
                    False,
                    math.inf,
                    message=f"the reference of op '{op.name}' returned "
                    f"{len(refs)} output(s), expected {len(ra)} (one per output of the op)",
                )
        for i, (oa, ob) in enumerate(zip(ra, rb)):
            for name, o, r in (("async run", oa, None if refs is None else refs[i]), ("launch-blocking run", ob, oa)):
                if r is None:
                    continue
                e, good = _error(o, r)
                worst = _worse(worst, e)
                if not good and ok:
                    ok, msg = (
                        False,
                        f"{name} output {i} differs (error {e:.3g}) "
                        + ("from the reference" if name == "async run" else "from the async run"),
                    )
            if refs is not None:
                worst = _worse(worst, _error(ob, refs[i])[0])
    changed = list(dict.fromkeys(changed_a + changed_b))
    if changed:
        what = (
            f"op '{op.name}' changed its {', '.join(changed)} (only an input bound in place to an output may "
            "change, and no byte between an output's elements)"
        )
        ok, msg = False, (f"{msg}; {what}" if msg else what)
    return CaseResult(label, ok, worst, message=msg)


def run_matrix(
    op: Op | str,
    dtypes: Iterable[Any] | None = None,
    seed: int = 0,
    long_n: int = LONG_N,
    progress: Callable[[], None] | None = None,
) -> MatrixResult:
    """Every case of ``op``; the sanitizer must report nothing, including no leak at the end."""
    op = get_op(op) if isinstance(op, str) else op
    res = MatrixResult(op.name)
    cases = shape_matrix(op, dtypes, seed, long_n)
    if cases is None:
        res.skipped = "skipped (no case generator)"
        return res
    if not cases and op.spec.dtypes:
        res.skipped = f"skipped (takes none of the dtypes asked for; it takes {[d.value for d in op.spec.dtypes]})"
        return res
    if op.spec.reference is None:
        res.note = "values not compared: the op registers no reference"
    generic = op.name not in GENERATORS
    with sanitizer.sanitize():
        token = sanitizer.mark()
        for i, (dt, case) in enumerate(cases):
            r = run_case(op, dt, case, seed + i, generic=generic)
            res.cases += 1
            if r.rejected:
                res.rejected += 1
            elif r.ok:
                res.passed += 1
            else:
                res.failed += 1
                res.failures.append(f"{r.label}: {r.message}")
            error = _worse(0.0, r.error)  # a NaN error is not dropped: it counts as infinite
            if error >= res.largest_error and not r.rejected:
                res.largest_error, res.worst_case = error, r.label
            if progress is not None:
                progress()
        leaks = sanitizer.report(since=token, warn=False)
    if leaks:
        res.failed += 1
        res.failures += [str(lk) for lk in leaks]
    if res.cases and res.rejected == res.cases:
        res.skipped = "skipped (no case generator; every generic case rejected)"
    return res


def format_table(results: list[MatrixResult]) -> str:
    head = f"{'op':<30}{'cases':>6}{'passed':>8}{'failed':>8}{'rejected':>9}{'largest error':>15}  worst case"
    lines = [head, "-" * len(head)]
    for r in results:
        if r.skipped:
            lines.append(f"{r.op:<30}{r.cases:>6}{'-':>8}{'-':>8}{'-':>9}{'-':>15}  {r.skipped}")
            continue
        lines.append(
            f"{r.op:<30}{r.cases:>6}{r.passed:>8}{r.failed:>8}{r.rejected:>9}{r.largest_error:>15.3g}  "
            f"{r.worst_case}{'  (' + r.note + ')' if r.note else ''}"
        )
    return "\n".join(lines)


def all_ops() -> list[str]:
    return sorted(registry)


def progress_bar(total: int, file: Any = None) -> Callable[[str], Callable[[], None]]:
    """A progress bar on a terminal (nothing otherwise): ``bar(label)`` returns the tick of one item."""
    file = file or sys.stderr
    tty = hasattr(file, "isatty") and file.isatty()
    done = [0]

    def for_label(label: str) -> Callable[[], None]:
        def tick() -> None:
            done[0] += 1
            if tty:
                width = 30
                fill = int(width * done[0] / max(total, 1))
                file.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done[0]}/{total} {label:<30.30}")
                if done[0] >= total:
                    file.write("\r" + " " * (width + 45) + "\r")
                file.flush()

        return tick

    return for_label
