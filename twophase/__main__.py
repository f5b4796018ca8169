"""``python -m twophase``: the ``twophase`` command line (``twophase/cli.py``)."""

import sys

from .cli import main

sys.exit(main())
