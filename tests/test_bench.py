"""The benchmark suite's own machinery (no timing is asserted): plot colours follow each ratio header's direction,
report formatting, the header's provenance, round rotation, and the same-result checks that run before timing."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

common = pytest.importorskip("bench.common")
report = pytest.importorskip("bench.report")


def test_bar_colours_follow_the_direction_each_header_states() -> None:
    vals = [3.0, 0.33, 1.0]
    assert report.bar_colours("ratio reference / twophase (> 1: twophase faster)", vals) == [
        "tab:green",
        "tab:red",
        "tab:gray",
    ]
    assert report.bar_colours("ratio twophase / torch (< 1: twophase faster)", vals) == [
        "tab:red",
        "tab:green",
        "tab:gray",
    ]
    assert report.bar_colours("ratio / ref", vals) == ["tab:gray"] * 3  # no direction stated: no verdict drawn


def test_only_ratio_columns_are_plotted() -> None:
    assert report.ratio_columns(["measure", "time", "share (median of the rounds')", "target"]) == []
    assert report.ratio_columns(["op", "miss", "hit", "ratio hit / miss (< 1: the hit faster)"]) == [3]


def test_uptime_lines_stay_out_of_the_headings() -> None:
    md = report._as_markdown("# bench_ops2: title\n# uptime: 10:00 up 1 day\n| a | ratio |\n")
    assert md[0] == "### bench_ops2: title"
    assert "### uptime" not in "\n".join(md) and "# uptime: 10:00 up 1 day" in md


def test_the_report_names_the_code_the_machine_and_a_skipped_module(tmp_path: Path, monkeypatch: Any) -> None:
    mod = type(sys)("fake_bench_ops")
    mod.main = lambda: print(
        "| case | ratio reference / twophase (> 1: twophase faster) |\n| --- | --- |\n"  # type: ignore
        "| a | 2.00 |"
    )
    monkeypatch.setitem(sys.modules, "fake_bench_ops", mod)
    text = report.run_suite(["fake_bench_ops", "no_such_bench_module"], tmp_path).read_text()
    assert "- code: commit " in text or "- code: commit: n/a" in text
    assert "ISA " in text and "thread timeout" in text and "numpy's baselines run with it" in text
    assert "(skipped: module no_such_bench_module not found)" in text
    assert "each ratio header states its direction" in text


def test_header_names_the_processor_and_the_openblas_state() -> None:
    head = common.header("t")
    assert common.cpu_model() in head and "ISA " in head and "numpy's OpenBLAS" in head


def test_the_pause_waits_for_a_spinning_thread_and_not_for_a_sleeping_one() -> None:
    stop = threading.Event()
    ended: list[float] = []

    def spin(seconds: float) -> None:
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end and not stop.is_set():
            pass
        ended.append(time.perf_counter())

    spinner = threading.Thread(target=spin, args=(common.SETTLE_S * 4,))
    spinner.start()
    common.pause()
    returned = time.perf_counter()
    spinner.join()
    assert returned >= ended[0]  # not before the spinner stopped
    sleeper = threading.Thread(target=stop.wait)
    sleeper.start()
    try:
        time.sleep(common.SETTLE_S)  # until it blocks
        t0 = time.perf_counter()
        common.pause()
        assert time.perf_counter() - t0 < common.SETTLE_MAX_S  # a blocked thread does not hold it up
    finally:
        stop.set()
        sleeper.join()


def test_each_round_starts_one_side_later() -> None:
    order: list[str] = []
    common.interleaved_times({k: (lambda k=k: order.append(k)) for k in "abc"}, 1, 3)
    # per side: the settle's untimed call, then one timed call
    assert "".join(order) == "aabbcc" + "bbccaa" + "ccaabb"


def test_assert_same_passes_float32_noise_and_refuses_real_differences() -> None:
    want = np.linspace(-3, 3, 64, dtype=np.float32)
    common.assert_same("close", want * np.float32(1 + 1e-6), want)
    with pytest.raises(AssertionError, match="max abs error"):
        common.assert_same("off", want + np.float32(0.01), want)
    with pytest.raises(AssertionError, match="shapes differ"):
        common.assert_same("shape", want[:-1], want)
    with pytest.raises(AssertionError, match="values differ"):
        common.assert_same("ints", np.array([1, 2]), np.array([1, 3]))
    with pytest.raises(AssertionError, match="NaN"):
        common.assert_same("nan", np.array([np.nan, 1.0]), np.array([0.0, 1.0]))


def test_ops2_rows_refuse_sides_that_disagree_before_timing() -> None:
    ops2 = pytest.importorskip("bench.bench_ops2")
    timed: list[int] = []
    side = ops2.Ours(timed.append, ops2._Control(), lambda: np.zeros(4, np.float32), ops2._nothing)
    with pytest.raises(AssertionError, match="twophase vs ref"):
        ops2.row("case", side, lambda: np.ones(4, np.float32), "ref")
    assert timed == [1]  # the one untimed run the check reads, nothing timed


def test_ops1_torch_out_variants_equal_the_functional_forms() -> None:
    torch = pytest.importorskip("torch")
    ops1 = pytest.importorskip("bench.bench_ops1")
    t = torch.from_numpy(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32))
    for name, (*_, (functional, out_variant)) in ops1.CASES.items():
        want = functional(t)
        if out_variant is None:
            assert name in ("layer_norm", "rms_norm")  # printed as 'allocates'
            continue
        got = torch.empty_like(want)
        out_variant(t, got)
        assert torch.equal(got, want), name


def test_ops1_add_floor_note_compares_5x_naive_with_one_read_of_the_input() -> None:
    ops1 = pytest.importorskip("bench.bench_ops1")
    calls = ops1.CALLS
    # per call: ours 3 ms, reduce_sum's read 2.5 ms, naive 9 ms (its ratio, as the table scales it: 3)
    t = {"ours": calls * 3e-3, "floor": calls * 2.5e-3}
    r = {"naive": 3.0, "floor": 2.5 / 3}
    note = ops1._floor_note((4, 8), t, r)
    assert note.startswith("add 4x8: 5x naive numpy means 1.80 ms a call;"), note
    assert "reading the input once takes 2.50 ms" in note and note.endswith("ours takes 1.20x that read"), note


def test_minilm_gemm_floor_counts_every_linear_weight_and_both_attention_products() -> None:
    """The GEMM work the MiniLM report's floor line divides by the best GEMM rate: 2 x tokens x the weights of
    the 6 layers' linears (counted from their shapes here), plus q @ k^T and P @ v of every head."""
    from types import SimpleNamespace

    from bench.bench_minilm import best_gemm_rate, gemm_flops

    cfg = SimpleNamespace(hidden=384, intermediate=1536, layers=6, heads=12, head_dim=32)
    weights = [(3 * 384, 384), (384, 384), (1536, 384), (384, 1536)] * 6
    linears, attention = gemm_flops(cfg, 8, 128)
    assert linears == 2 * 8 * 128 * sum(o * i for o, i in weights)
    assert attention == 6 * 2 * (2 * 8 * 12 * 128 * 128 * 32)
    assert np.isfinite(best_gemm_rate(size=64, tries=2))  # a rate, whatever this machine's speed


def test_ops2_ratio_cells_give_the_median_and_the_middle_half_of_the_rounds() -> None:
    ops2 = pytest.importorskip("bench.bench_ops2")
    # 11 rounds, out of order: median 1.0, first and third quartiles (inclusive) 0.9 and 1.1
    ratios = [1.1, 0.5, 1.0, 0.9, 2.0, 0.95, 1.05, 0.9, 1.1, 1.2, 0.8]
    assert ops2.ratio_cells(ratios) == "1.00 | 0.90-1.10"
    assert ops2.ratio_cells([0.8, 1.2]) == "1.00 | 0.90-1.10"  # two rounds: the quartiles interpolate
