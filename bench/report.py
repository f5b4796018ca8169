"""``make bench``'s report: run every benchmark module in one process, echo its output, and write
``bench/results/report.md`` (machine, ISA, versions, ``OPENBLAS_*`` settings, the OpenBLAS state in force and the
commit measured in the header, each module's tables) with PNG plots of the ratio columns (matplotlib, the ``bench``
extra; the report is written without plots when it is missing), coloured by the direction each header states."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import io
import os
import platform
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import cpu_model, git_state, isa, openblas_state

RESULTS = Path(__file__).resolve().parent / "results"


class _Tee(io.TextIOBase):
    """Writes to the real stdout and keeps a copy."""

    def __init__(self, real: Any) -> None:
        self.real, self.buf = real, io.StringIO()

    def write(self, s: str) -> int:
        self.real.write(s)
        self.real.flush()
        return self.buf.write(s)

    def flush(self) -> None:
        self.real.flush()


def _version(mod: str) -> str:
    try:
        return str(importlib.import_module(mod).__version__)
    except Exception:  # noqa: BLE001 - optional packages
        return "not installed"


# named in every header, set or not: the BLAS settings the ratios depend on most
ALWAYS_SHOWN = ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY")


def machine_header() -> list[str]:
    """Machine and ISA, versions, the commit measured, thread and BLAS settings (the environment's and the
    OpenBLAS state twophase leaves in force), and the load average when the suite started."""
    shown = [f"{k}={os.environ.get(k, '(unset)')}" for k in ALWAYS_SHOWN]
    others = [
        f"{k}={v}"
        for k, v in sorted(os.environ.items())
        if k.startswith(("OPENBLAS_", "OMP_", "MKL_", "NUMBA_")) and k not in ALWAYS_SHOWN
    ]
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return [
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}",
        f"- machine: {cpu_model()}, {isa()}, {os.cpu_count()} cpus, {platform.system()} {platform.release()}",
        f"- code: {git_state()}; later commits are unmeasured",
        f"- python {platform.python_version()}; numpy {_version('numpy')}; numba {_version('numba')}; "
        f"torch {_version('torch')}; onnxruntime {_version('onnxruntime')}; twophase {_version('twophase')}",
        "- environment: " + ", ".join(shown + (others or ["no other OPENBLAS_* / OMP_* / MKL_* / NUMBA_* variable"])),
        f"- {openblas_state()}",
        f"- load average at start: {', '.join(f'{x:.2f}' for x in load) if load else 'n/a'} "
        "(other processes share the cpus: ratios are measured side by side, absolute times drift)",
    ]


_NOT_HEADING = re.compile(r"^#+\s*uptime:")  # bench_ops2's load lines start with '#' but are no headings


def _as_markdown(text: str) -> list[str]:
    """Markdown table rows, ``-`` lines and ``#`` headings (made level 3) as they are; every other run of lines
    (``# uptime:`` ones included) in a code block."""
    out: list[str] = []
    block: list[str] = []

    def flush() -> None:
        if any(b.strip() for b in block):
            out.extend(["```", *block, "```"])
        block.clear()

    for line in text.splitlines():
        if line.startswith("|") or line.startswith("- ") or (line.startswith("#") and not _NOT_HEADING.match(line)):
            flush()
            out.append(re.sub(r"^#+ ", "### ", line) if line.startswith("#") else line)
        elif not line.strip():
            flush()
            out.append("")
        else:
            block.append(line)
    flush()
    return out


def _tables(text: str) -> list[list[list[str]]]:
    """The markdown tables in ``text`` as rows of cells (header first, separator dropped)."""
    tables: list[list[list[str]]] = []
    cur: list[list[str]] = []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):
                cur.append(cells)
        elif cur:
            tables.append(cur)
            cur = []
    return tables


def _float(s: str) -> float | None:
    try:
        return float(s.rstrip("x"))
    except ValueError:
        return None


_DIRECTION = re.compile(r"\(\s*([<>])\s*1\b")


def direction(head: str) -> str | None:
    """The direction a ratio header states: "<" for "(< 1: ... faster)", ">" for "(> 1: ... faster)", else None."""
    m = _DIRECTION.search(head)
    return m.group(1) if m else None


def bar_colours(head: str, vals: Sequence[float]) -> list[str]:
    """Green where the row is faster than the header's reference by its stated direction (twophase faster, for
    a twophase row), red where slower, grey at exactly 1 or when the header states no direction."""
    d = direction(head)
    if d is None:
        return ["tab:gray"] * len(vals)
    return ["tab:gray" if v == 1 else "tab:green" if (v < 1) == (d == "<") else "tab:red" for v in vals]


def ratio_columns(head: Sequence[str]) -> list[int]:
    """The columns that hold ratios (their header says "ratio"; shares, times and sizes are not plotted)."""
    return [i for i, h in enumerate(head) if "ratio" in h.lower()]


def plot_ratios(title: str, table: list[list[str]], path: Path) -> bool:
    """One horizontal bar chart per ratio column of ``table`` (log scale, a line at 1.0, colours by the header's
    direction); False when nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    head, rows = table[0], table[1:]
    cols = ratio_columns(head)
    series = []
    for i in cols:
        pts = [(" / ".join(r[:2]), _float(r[i])) for r in rows if i < len(r)]
        pts = [(label, v) for label, v in pts if v is not None and v > 0]
        if pts:
            series.append((head[i], pts))
    if not series:
        return False
    n = max(len(p) for _, p in series)
    fig, axes = plt.subplots(1, len(series), figsize=(6 * len(series), 0.32 * n + 1.5), squeeze=False)
    for ax, (name, pts) in zip(axes[0], series):
        labels, vals = zip(*pts)
        ax.barh(range(len(vals)), vals, color=bar_colours(name, vals))
        ax.set_yticks(range(len(vals)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_title(name, fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run_suite(modules: Sequence[str], out_dir: Path = RESULTS) -> Path:
    """Run each module's ``main()`` (echoing its output), then write ``report.md`` and the plots; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    head = machine_header()
    sections: list[tuple[str, str, Any]] = []
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            note = f"(skipped: module {name} not found)"
            print(f"\n{note}")
            sections.append((name, note, None))
            continue
        print()
        tee = _Tee(sys.stdout)
        with contextlib.redirect_stdout(tee):
            result = mod.main()
        sections.append((name, tee.buf.getvalue(), result))
    try:
        import matplotlib  # noqa: F401

        can_plot = True
    except ImportError:
        can_plot = False
    lines = [
        "# twophase benchmark report",
        "",
        "Written by `make bench` (`python -m bench`); every ratio is measured "
        "side by side in one process, runs interleaved, the order rotating between rounds. Timings that compare "
        "libraries (or ways of calling one) start after a pause in which the other libraries' spinning worker "
        "threads go idle (20 ms, then until no other thread of the process runs, at most 0.25 s: numpy's "
        "OpenBLAS spins ~0.1 s after a threaded GEMM) and one untimed call (`bench.common.settle`); the "
        "twophase-only microbenchmarks timed by `bench.common.median_ratio` (bench_core's phase-1/phase-2, "
        "cache and counter rows, bench_sanitizer) "
        'start after the pause alone, each timing being hundreds of calls; bench_minilm\'s "after idle" line '
        "has a longer pause and no untimed call, on purpose.",
        "",
        "Ratios do not all read the same way: each ratio header states its direction, e.g. "
        "`twophase / torch (< 1: twophase faster)` or `reference / twophase (> 1: twophase faster)`. In the "
        "plots a bar is green where the row is faster than the header's reference by that direction (for a "
        "twophase row: twophase faster), red where slower, grey at 1 or where no direction is stated.",
        "",
        *head,
        "",
    ]
    if not can_plot:
        lines += ["(matplotlib not installed: no plots; `pip install -e '.[bench]'`)", ""]
    for name, text, _result in sections:
        short = name.rsplit(".", 1)[-1]
        lines += [f"## {short}", ""]
        lines += _as_markdown(text)
        if can_plot:
            for k, table in enumerate(_tables(text)):
                png = out_dir / f"{short}_{k}.png"
                if plot_ratios(f"{short}: table {k + 1}", table, png):
                    lines += ["", f"![{short} table {k + 1}]({png.name})"]
        lines.append("")
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"\nreport written to {path}")
    return path
