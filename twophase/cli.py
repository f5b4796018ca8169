"""The ``twophase`` command line: ``twophase ops`` lists the registered ops from the registry;
``twophase embed "sentence" ...`` embeds sentences with all-MiniLM-L6-v2 and prints their cosine similarities."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from typing import Any

from .errors import TwoPhaseError
from .op import REQUIRED, registry


def catalogue() -> str:
    """Every registered op with inputs, attributes, dtypes, implementations and workspace formula."""
    lines = []
    for name in sorted(registry):
        spec = registry[name].spec
        attrs = ", ".join(a.name if a.default is REQUIRED else f"{a.name}={a.default!r}" for a in spec.attrs)
        lines.append(f"{name}({', '.join(spec.inputs)}{'; ' + attrs if attrs else ''}) -> {', '.join(spec.outputs)}")
        lines.append(f"    dtypes:          {', '.join(d.value for d in spec.dtypes) or 'see doc'}")
        lines.append(f"    implementations: {', '.join(spec.implementations) or 'default'}")
        lines.append(f"    workspace:       {spec.workspace_formula}")
    return "\n".join(lines)


SHOWN_CHARS = 72


def shown(sentence: str) -> str:
    """A sentence as one table line: whitespace runs made one space, cut to ``SHOWN_CHARS`` with an ellipsis."""
    flat = " ".join(sentence.split())
    return flat if len(flat) <= SHOWN_CHARS else flat[: SHOWN_CHARS - 1] + "\u2026"


def similarity_table(sentences: Sequence[str], emb: Any) -> str:
    """Each embedding's norm and the cosine similarity matrix, sentences numbered."""
    from .models.minilm import cosine_matrix

    sim = cosine_matrix(emb)
    lines = [
        f"[{i}] norm {float((e.astype('float64') ** 2).sum()) ** 0.5:.6f}  {shown(s)}"
        for i, (s, e) in enumerate(zip(sentences, emb))
    ]
    lines.append("cosine similarity:")
    lines.append("     " + "".join(f"{f'[{j}]':>8}" for j in range(len(sentences))))
    for i, row in enumerate(sim):
        lines.append(f"{f'[{i}]':<5}" + "".join(f"{v:8.4f}" for v in row))
    return "\n".join(lines)


def embed(sentences: Sequence[str], mode: str, trace: str | None, stats: bool) -> int:
    """``twophase embed``: embed ``sentences`` in one batch and print norms and similarities."""
    from . import stats as stats_mod
    from .models.minilm import MiniLM
    from .profile import check_trace_path, profile

    if trace is not None:
        check_trace_path(trace)  # a path that cannot be written fails now, not after the run
    with MiniLM() as model:
        ctx = profile(trace) if trace is not None else contextlib.nullcontext()
        with ctx:
            emb = model.encode(list(sentences), mode=mode)
        print(similarity_table(sentences, emb))
        if trace is not None:
            print(f"trace written to {trace} (open it in https://ui.perfetto.dev)")
        if stats:
            stats_mod.report()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twophase", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ops", help="list every registered op")
    from .testing import check_cli

    check_cli.add_parser(sub)
    emb = sub.add_parser("embed", help="sentence embeddings (all-MiniLM-L6-v2) and their cosine similarities")
    emb.add_argument("sentences", nargs="+", help="the sentences, one argument each")
    emb.add_argument(
        "--mode",
        choices=("graph", "planned", "oneshot"),
        default="graph",
        help="captured graph replay (default), repeatable executors, or the one-shot API",
    )
    emb.add_argument("--trace", metavar="FILE", help="write a Chrome trace of the run to FILE")
    emb.add_argument("--stats", action="store_true", help="print the per-op counters table")
    args = parser.parse_args(argv)
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:  # a sentence the console cannot encode is escaped, not a traceback after the run
        reconfigure(errors="backslashreplace")
    if args.command == "check":
        return check_cli.run(args)
    if args.command == "ops":
        print(catalogue())
    elif args.command == "embed":
        if args.trace == "":
            parser.error("--trace needs a file name")
        try:
            return embed(args.sentences, args.mode, args.trace, args.stats)
        except (OSError, NotImplementedError, TwoPhaseError) as e:  # a path, the model package, a sentence
            print(f"twophase embed: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
