"""``make bench``: run every benchmark module of the suite in turn and write ``bench/results/report.md``."""

from bench.report import run_suite

MODULES = ("bench.bench_core", "bench.bench_ops1", "bench.bench_ops2", "bench.bench_graph", "bench.bench_minilm",
           "bench.bench_sanitizer")

run_suite(MODULES)
