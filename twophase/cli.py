"""The ``twophase`` command line: ``twophase ops`` lists the registered ops from the registry."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twophase", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ops", help="list every registered op")
    args = parser.parse_args(argv)
    if args.command == "ops":
        print(catalogue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
