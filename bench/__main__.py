"""``make bench``: run every benchmark module of the suite in turn and write ``bench/results/report.md`` (or
``report.md`` in the folder given as the one argument, for a run on another kind of machine)."""

import sys
from pathlib import Path

from bench.report import RESULTS, run_suite

MODULES = (
    "bench.bench_core",
    "bench.bench_ops1",
    "bench.bench_ops2",
    "bench.bench_graph",
    "bench.bench_minilm",
    "bench.bench_sanitizer",
)

USAGE = "usage: python -m bench [RESULTS_DIR [bench_ops1 kernel names...]]  (default folder: bench/results)"

if len(sys.argv) > 1 and sys.argv[1].startswith("-"):
    # an option is no folder: `python -m bench --help` must not run the suite into a folder named '--help'
    print(USAGE, file=sys.stderr if sys.argv[1] not in ("-h", "--help") else sys.stdout)
    sys.exit(0 if sys.argv[1] in ("-h", "--help") else 2)
# taken off argv: the modules read what follows as their own case filters (bench_ops1's kernel names)
run_suite(MODULES, Path(sys.argv.pop(1)) if len(sys.argv) > 1 else RESULTS)
