"""CPU kernels (numba ``nogil`` / numpy); each builder takes tiling and views and returns a launch."""

from pathlib import Path

from .numba_cache import cache_dir, drop_if_stale, source_digest

_HERE = Path(__file__).parent
drop_if_stale(cache_dir(_HERE / "jit.py"), source_digest(_HERE))
