"""Test helpers: run an op with poisoned outputs and a guarded, poisoned workspace, and check both."""

from .checked import CheckedRun, guarded_workspace, run_checked

__all__ = ["CheckedRun", "guarded_workspace", "run_checked"]
