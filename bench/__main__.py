"""``make bench``: run every benchmark module of the suite in turn."""

import importlib

MODULES = ("bench.bench_core", "bench.bench_ops1", "bench.bench_ops2", "bench.bench_graph")

for name in MODULES:
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        continue
    print()
    mod.main()
