"""Test helpers: checked runs (poisoned outputs, guarded workspace), the shape-matrix harness and phase-1 fuzzing."""

from .checked import CheckedRun, guarded_workspace, run_checked
from .matrix import MatrixResult, format_table, run_matrix, shape_matrix

__all__ = [
    "CheckedRun",
    "guarded_workspace",
    "run_checked",
    "shape_matrix",
    "run_matrix",
    "MatrixResult",
    "format_table",
]
