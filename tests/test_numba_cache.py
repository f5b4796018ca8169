"""numba's on-disk cache is dropped when any kernel source changes (numba only watches each kernel's own file)."""

from __future__ import annotations

import gc
import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from numba.core.caching import FunctionCache
from numba.core.dispatcher import Dispatcher

from twophase.kernels.cpu import numba_cache


def _fake_cache(d: Path) -> list[Path]:
    files = [d / "vmath.exp-10.py311.nbi", d / "vmath.exp-10.py311.1.nbc", d / "keep.pyc"]
    for f in files:
        f.write_bytes(b"x")
    return files


def test_cache_files_are_dropped_when_the_digest_changes_and_kept_while_it_holds(tmp_path: Path) -> None:
    nbi, nbc, pyc = _fake_cache(tmp_path)
    assert numba_cache.drop_if_stale(tmp_path, "a")  # no stamp yet: drop
    assert not nbi.exists() and not nbc.exists() and pyc.exists()
    _fake_cache(tmp_path)
    assert not numba_cache.drop_if_stale(tmp_path, "a")
    assert nbi.exists() and nbc.exists()
    assert numba_cache.drop_if_stale(tmp_path, "b")
    assert not nbi.exists() and pyc.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.pyc", "twophase-kernels.digest"]


def test_digest_follows_every_source_file(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    before = numba_cache.source_digest(tmp_path)
    assert numba_cache.source_digest(tmp_path) == before
    (tmp_path / "b.py").write_text("y = 3\n")
    changed = numba_cache.source_digest(tmp_path)
    assert changed != before
    (tmp_path / "c.py").write_text("")
    assert numba_cache.source_digest(tmp_path) != changed


def test_the_package_stamp_matches_its_sources() -> None:
    here = Path(numba_cache.__file__).parent
    stamp = numba_cache.cache_dir(here / "jit.py") / "twophase-kernels.digest"
    assert stamp.read_text() == numba_cache.source_digest(here)


def test_a_cache_under_numba_cache_dir_is_dropped_when_stale_too(tmp_path: Path) -> None:
    """With ``NUMBA_CACHE_DIR`` set, numba caches the kernels there (a folder per source folder): the stamp and
    the drop follow it."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    show = (
        "from pathlib import Path; from twophase.kernels.cpu import numba_cache as c; "
        "print(c.cache_dir(Path(c.__file__).parent / 'jit.py'))"
    )

    def folder() -> Path:
        run = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True, check=True)
        return Path(run.stdout.strip())

    d = folder()
    here = Path(numba_cache.__file__).parent
    assert d.parent == tmp_path and d.name.startswith("cpu_")
    assert (d / "twophase-kernels.digest").read_text() == numba_cache.source_digest(here)
    (d / "twophase-kernels.digest").write_text("an older source")
    stale = _fake_cache(d)
    assert folder() == d
    assert not stale[0].exists() and not stale[1].exists()
    assert (d / "twophase-kernels.digest").read_text() == numba_cache.source_digest(here)


def _kernels() -> list[Any]:
    """Every numba kernel of the package cached on disk (not the functions numba wraps an overload's
    implementation in: those are compiled into their caller)."""
    import twophase.kernels.cpu as kernels

    for m in pkgutil.iter_modules(kernels.__path__):
        importlib.import_module(f"{kernels.__name__}.{m.name}")
    # type(), not isinstance(): the heap holds weak proxies, and isinstance() on a dead one raises ReferenceError
    return [
        o
        for o in gc.get_objects()
        if issubclass(type(o), Dispatcher)
        and o.py_func.__module__.startswith("twophase.")
        and isinstance(getattr(o, "_cache", None), FunctionCache)
    ]


def test_kernels_close_over_plain_constants_only() -> None:
    """numba keys a cached kernel on a pickle of its closure, and a kernel pickles with a per-process id: a kernel
    closing over another kernel would be compiled again in every process (``jit.variant_call`` is the way)."""
    made = _kernels()
    assert len(made) > 100
    bad = {
        (k.py_func.__qualname__, type(c.cell_contents).__name__)
        for k in made
        for c in k.py_func.__closure__ or ()
        if not isinstance(c.cell_contents, int | float | str | bool | None)
    }
    assert not bad


def test_a_unary_kernel_compiled_in_one_process_loads_in_the_next(tmp_path: Path) -> None:
    """End to end, with an empty cache folder: the second process finds the kernel (and its span loop) there and
    saves nothing."""
    script = (
        "import numpy as np; from twophase.kernels.cpu.elementwise import _rows_call; "
        "x = np.ones((3, 40), np.float32); _rows_call('gelu_erf_f32', x, np.empty_like(x))()"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "NUMBA_DEBUG_CACHE": "1"}
    runs = [
        subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        for _ in range(2)
    ]
    assert "data saved" in runs[0].stdout
    assert "data loaded" in runs[1].stdout and "data saved" not in runs[1].stdout, runs[1].stdout
