"""The benchmark suite: each module prints ratios measured side by side in one process."""
