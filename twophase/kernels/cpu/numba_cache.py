"""Keep numba's on-disk cache honest: drop it when any kernel source changes, and write it one process at a time.

numba keys a cached kernel on its own file's timestamp only, but our kernels inline functions from other
modules (``vmath``, ``jit``, ``layout``), so editing those would leave stale machine code in the cache
(numba issue #1833). A digest of every kernel source, stored next to the cache, decides instead. The cache is
where numba puts it: beside the sources, under ``NUMBA_CACHE_DIR`` when that is set, or in a user-wide folder when
the package's own folder is read-only.

numba saves a kernel's new specialization by reading the kernel's index, naming a data file after the ones it
lists, then writing the index and the data file. Two processes that compile two specializations of one kernel at
once (pytest-xdist workers on a fresh cache, or an application's worker processes) can both take the same name:
the index then maps one specialization to the other's machine code, and every later process that loads it runs
the wrong code (a kernel compiled for contiguous rows reading strided ones: wrong results, not an error).
``guard_saves`` makes those saves take an exclusive lock on a file in the cache folder (``flock``, where there
is one).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from numba.core import caching

try:
    import fcntl
except ImportError:  # not on a POSIX system: saves go unlocked, as numba leaves them
    fcntl = None  # type: ignore[assignment]

__all__ = ["cache_dir", "source_digest", "drop_if_stale", "guard_saves"]

_STAMP = "twophase-kernels.digest"
_LOCK = "twophase-kernels.lock"
_GUARDED: set[str] = set()  # the cache folders whose saves take the lock (their real paths)


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


def guard_saves(folder: Path) -> None:
    """From now on, numba's saves of cache entries into ``folder`` (by this process) hold an exclusive ``flock`` on
    its lock file while they read the index, name the data file and write both, so that processes doing the same
    cannot interleave (module docstring). Loads need no lock: numba writes each file whole, by a rename."""
    _GUARDED.add(os.path.realpath(folder))
    _install_guard()


@functools.cache
def _install_guard() -> None:
    cls: Any = caching.IndexDataCacheFile
    plain: Any = cls.save

    @functools.wraps(plain)
    def save(self: Any, key: Any, data: Any) -> None:
        folder = self._cache_path
        if os.path.realpath(folder) not in _GUARDED:
            plain(self, key, data)
            return
        with _locked(Path(folder) / _LOCK):
            plain(self, key, data)

    cls.save = save


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created if need be) while the block runs; none where the folder is
    read-only or the system has no ``flock`` (numba then saves as it would)."""
    if fcntl is None:
        yield
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
