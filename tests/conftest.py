"""Shared fixtures of the core runtime tests: the CPU device, a fresh stream, a seeded rng, a stream gate."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import twophase
from twophase.kernels.cpu import gemm, jit, numba_cache

# every kernel entry point checks that arrays compiled as C-contiguous are C-contiguous at each call
jit.CHECK_LAYOUT = True

_TESTS = Path(__file__).parent
# test kernels inline vmath: their numba cache goes stale with the kernels' sources, as the package's own does
numba_cache.drop_if_stale(
    numba_cache.cache_dir(_TESTS / "conftest.py"), numba_cache.source_digest(Path(numba_cache.__file__).parent, _TESTS)
)


@pytest.fixture
def dev() -> twophase.Device:
    return twophase.device("cpu")


@pytest.fixture
def stream(dev: twophase.Device):
    s = dev.stream()
    yield s
    try:
        s.close()
    except twophase.TwoPhaseError:
        pass


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240229)


@pytest.fixture
def gate() -> Callable[[twophase.Stream], threading.Event]:
    """``gate(s)`` blocks stream ``s`` with a callback waiting on a returned Event; every Event is set at teardown."""
    events: list[threading.Event] = []

    def block(s: twophase.Stream) -> threading.Event:
        ev = threading.Event()
        events.append(ev)
        s.launch_callback(lambda: ev.wait(30))
        return ev

    yield block
    for ev in events:
        ev.set()


@pytest.fixture
def microkernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The register-blocked float32 GEMM on, for the tests of the paths built on it (linear, im2col_tiles, SDPA's
    head products): as it is on a CPU with AVX-512; forced on one with only AVX2 and FMA, where LLVM lowers its
    16-float vectors to pairs of 8-float ones (slower than BLAS there, so phase 1 leaves it off, but the same
    code and results), so that CI on either kind of machine checks it; skipped elsewhere. The executor cache is
    emptied around the test: plans made with the other setting must not be reused."""
    if not gemm.available():
        if not gemm.ymm_available():
            pytest.skip("the register-blocked GEMM needs AVX2 and FMA at least (AVX-512 to be picked)")
        monkeypatch.setattr(gemm, "available", lambda: True)
    twophase.clear_cache()
    yield
    twophase.clear_cache()


@pytest.fixture
def ymm_heads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The 8-lane kernels (``gemm.gemm_f32_heads_ymm`` for SDPA's head products, and the rules that rank
    conv2d's implicit GEMM by them), as phase 1 picks them on a CPU with AVX2 and FMA but not AVX-512; on one
    with AVX-512 (which has AVX2 too) by turning the 16-lane kernel off; skipped elsewhere. The executor cache is
    emptied around the test, as for ``microkernel``."""
    if not gemm.ymm_available():
        pytest.skip("the 8-lane GEMM kernels need AVX2 and FMA")
    monkeypatch.setattr(gemm, "available", lambda: False)
    twophase.clear_cache()
    yield
    twophase.clear_cache()


@pytest.fixture
def fresh_cache():
    """Executor cache on with the default limit, emptied, counters zeroed; settings restored afterwards."""
    enabled, limit = twophase.settings.cache_enabled, twophase.settings.cache_limit
    try:
        twophase.set_cache_enabled(True)
        twophase.set_cache_limit(10000)
        twophase.clear_cache()
        twophase.stats.reset()
        yield
    finally:
        twophase.set_cache_enabled(enabled)
        twophase.set_cache_limit(limit)
        twophase.clear_cache()
        twophase.stats.reset()
