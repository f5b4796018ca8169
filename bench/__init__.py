"""The benchmark suite: each module prints ratios measured side by side in one process.

The suite's processes run numpy's OpenBLAS with ``OPENBLAS_THREAD_TIMEOUT=4`` unless it is set already (read when
numpy loads, so before any module imports it): its workers then sleep as soon as a GEMM ends, instead of spinning
~0.1 s into the next side's timing (torch, ONNX Runtime, twophase's helpers), which the 20 ms settle before each
timing does not outlast. twophase itself leaves OpenBLAS at its default; bench_minilm's ``openblas_spin`` variant
measures that. Only when run (``python -m bench...``: argv[0] is ``-m`` while this package loads), not when a
test imports a module, so that the environment of the tests' subprocesses stays as it was."""

import os
import sys

if sys.argv[:1] == ["-m"]:
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
