"""CPU kernels (numba ``nogil`` / numpy); each builder takes tiling and views and returns a launch."""

from pathlib import Path

from .numba_cache import cache_dir, drop_if_stale, guard_saves, source_digest

_HERE = Path(__file__).parent
_CACHE = cache_dir(_HERE / "jit.py")
drop_if_stale(_CACHE, source_digest(_HERE))
guard_saves(_CACHE)
