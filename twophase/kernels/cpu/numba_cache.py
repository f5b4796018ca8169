"""Keep numba's on-disk cache honest: drop it when any kernel source changes.

numba keys a cached kernel on its own file's timestamp only, but our kernels inline functions from other
modules (``vmath``, ``jit``, ``layout``), so editing those would leave stale machine code in the cache
(numba issue #1833). A digest of every kernel source, stored next to the cache, decides instead. The cache is
where numba puts it: beside the sources, under ``NUMBA_CACHE_DIR`` when that is set, or in a user-wide folder when
the package's own folder is read-only.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from numba.core import caching

__all__ = ["cache_dir", "source_digest", "drop_if_stale"]

_STAMP = "twophase-kernels.digest"


def source_digest(*dirs: Path) -> str:
    """sha256 of the ``*.py`` files of ``dirs`` (names and contents, in a fixed order)."""
    h = hashlib.sha256()
    for d in dirs:
        for p in sorted(d.glob("*.py")):
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def cache_dir(source: Path) -> Path:
    """The folder numba caches the kernels of the module file ``source`` in, as its own cache locators choose
    (the first that applies, as numba tries them); the ``__pycache__`` beside it when none does."""
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)  # public from numba 0.60
    for locator in getattr(impl, "_locator_classes", ()):
        try:
            found = locator.from_function(cache_dir, str(source))
        except (OSError, AttributeError, TypeError):  # a locator of another numba version: ask the next one
            continue
        if found is not None:
            return Path(found.get_cache_path())
    return source.parent / "__pycache__"


def drop_if_stale(folder: Path, digest: str) -> bool:
    """Delete the numba cache files (``*.nbi``, ``*.nbc``) in ``folder`` unless its stamp equals ``digest``;
    then write the stamp. Returns whether anything was dropped. A read-only tree is left as it is (numba then
    caches elsewhere or not at all)."""
    stamp = folder / _STAMP
    try:
        if stamp.read_text() == digest:
            return False
    except OSError:
        pass
    dropped = False
    try:
        for f in (*folder.glob("*.nbi"), *folder.glob("*.nbc")):
            f.unlink(missing_ok=True)
            dropped = True
        folder.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_suffix(f".{hashlib.sha256(digest.encode()).hexdigest()[:8]}.tmp")
        tmp.write_text(digest)
        tmp.replace(stamp)  # atomic: a concurrent reader sees the old stamp or the new one
    except OSError:
        pass
    return dropped
