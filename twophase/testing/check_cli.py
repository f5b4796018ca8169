"""``twophase check [OP ...]``: the shape matrix of ops under the sanitizer, as a table; ``--fuzz N`` adds N random
phase-1 calls. Wired into ``twophase/cli.py`` by ``add_parser`` / ``run``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..op import registry
from ..tensor import DType

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    chk = sub.add_parser("check", help="run the shape matrix of ops under the sanitizer (all ops by default)")
    chk.add_argument("ops", nargs="*", metavar="OP", help="op names (default: every registered op)")
    chk.add_argument("--seed", type=int, default=0, help="seed of the cases and the random sync points")
    chk.add_argument("--seeds", type=int, default=1, help="how many seeds to run (seed, seed+1, ...)")
    chk.add_argument("--dtypes", default=None, help="comma-separated dtypes, or 'all' (default: float32)")
    chk.add_argument("--long-n", type=int, default=None, help="N of the 1xN / Nx1 cases (default 2000003)")
    chk.add_argument("--fuzz", type=int, default=0, metavar="N", help="also make N random phase-1 calls")
    chk.add_argument("-v", "--verbose", action="store_true", help="print every failure")


def run(args: argparse.Namespace) -> int:
    """A table of op, cases, passed, failed, largest error, worst case; exit status 1 on any failure, 2 on a usage
    error or when nothing was checked."""
    from .fuzz import fuzz_phase1
    from .matrix import LONG_N, format_table, progress_bar, run_matrix, shape_matrix

    unknown = [n for n in args.ops if n not in registry]
    if unknown:
        return _usage(f"unknown op(s): {', '.join(unknown)}")
    if args.dtypes not in (None, "all"):
        items = args.dtypes.split(",")
        if not all(items):
            return _usage(f"--dtypes takes comma-separated dtype names, got an empty one in {args.dtypes!r}")
        bad = [d for d in items if d not in {t.value for t in DType}]
        if bad:
            return _usage(f"unknown dtype(s): {', '.join(bad)} (known: {', '.join(t.value for t in DType)})")
    if args.long_n is not None and args.long_n < 1 or args.seeds < 1 or args.fuzz < 0 or args.seed < 0:
        return _usage("--long-n and --seeds take an int >= 1, --seed and --fuzz an int >= 0")
    names = args.ops or sorted(registry)
    long_n = args.long_n or LONG_N
    results = []
    failed = 0
    for seed in range(args.seed, args.seed + args.seeds):
        plan = {}
        for n in names:
            dtypes = (
                [d.value for d in registry[n].spec.dtypes]
                if args.dtypes == "all"
                else (args.dtypes.split(",") if args.dtypes else None)
            )
            cases = shape_matrix(n, dtypes, seed, long_n)
            plan[n] = (dtypes, len(cases) if cases else 0)
        bar = progress_bar(sum(c for _, c in plan.values()))
        for n in names:
            r = run_matrix(n, plan[n][0], seed, long_n, progress=bar(n))
            results.append(r)
            failed += r.failed
    print(format_table(results))
    if not any(r.cases for r in results) and not args.fuzz:
        return _usage("nothing was checked: no op has a case for these dtypes")
    for r in results:
        for f in r.failures[: None if args.verbose else 3]:
            print(f"FAIL {r.op}: {f}")
    if args.fuzz:
        tick = progress_bar(args.fuzz)("phase-1 fuzz")
        fz = fuzz_phase1(args.fuzz, args.seed, progress=tick)
        print(
            f"phase-1 fuzz: {fz.calls} calls, {fz.accepted} accepted, {fz.rejected} rejected with project errors, "
            f"{len(fz.bad)} bad, slowest {fz.slowest * 1e3:.1f} ms"
        )
        for b in fz.bad[: None if args.verbose else 10]:
            print(f"FUZZ {b}")
        failed += len(fz.bad)
    return 1 if failed else 0


def _usage(message: str) -> int:
    print(f"twophase check: {message}", file=sys.stderr)
    return 2
