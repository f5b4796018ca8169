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


# two variants of one kernel, told apart by a closure constant only (as ``jit.by_density_and_step`` makes them):
# numba keeps them in one index, under keys of the same signature
_KERNEL = """import numba


def make(step):
    @numba.njit(cache=True)
    def total(x):
        s = 0.0
        for i in range(0, x.size, step):
            s += x[i]
        return s

    return total


TOTALS = {1: make(1), 2: make(2)}
"""

# Saves the variant of ``total`` for step ``argv[2]`` into the cache of the module in folder ``argv[1]``, its
# save's steps ordered against the other process's through marker files, as two processes whose compiles end
# together can interleave them: both read the index before either writes it, step 1 writes its index first, step 2
# then its index and data file, step 1 its data file last. Each wait gives up after ``patience`` seconds: long
# unguarded (the order must happen), short with ``guard_saves`` on that cache folder (``argv[3]`` == "1"), where
# the lock holds one process before it reads the index until the other's save is done.
_SAVER = """import sys, time
from pathlib import Path
from numba.core import caching
from twophase.kernels.cpu import numba_cache
folder = Path(sys.argv[1])
sys.path.insert(0, str(folder))
step, guard = int(sys.argv[2]), sys.argv[3] == "1"
if guard:
    numba_cache.guard_saves(numba_cache.cache_dir(folder / "kmod.py"))
patience = 2.0 if guard else 60.0

def mark(name):
    (folder / name).touch()

def wait(name):
    end = time.time() + patience
    while not (folder / name).exists() and time.time() < end:
        time.sleep(0.01)

cls = caching.IndexDataCacheFile
save_index, save_data = cls._save_index, cls._save_data

def ordered_index(self, overloads):
    mark(f"read{step}")
    wait(f"read{3 - step}")
    if step == 2:
        wait("index1")
    save_index(self, overloads)
    mark(f"index{step}")

def ordered_data(self, name, data):
    if step == 1:
        wait("data2")
    save_data(self, name, data)
    mark(f"data{step}")

cls._save_index, cls._save_data = ordered_index, ordered_data
import numpy as np
import kmod
print(kmod.TOTALS[step](np.arange(10.0)))
"""


def test_concurrent_saves_of_two_kernel_variants_keep_the_cache_consistent(tmp_path: Path) -> None:
    """Two processes save two variants of one kernel (same signature, another closure constant) at once,
    interleaved as above. Unguarded (numba's own saves), the index ends up mapping one variant's key to the other's
    machine code, which a later process loads and runs: a wrong sum, no error. With ``guard_saves`` the second
    save waits for the first: each variant is found with its own code."""
    loader = (
        "import sys; sys.path.insert(0, sys.argv[1]); import numpy as np, kmod; "
        "print(kmod.TOTALS[1](np.arange(10.0)), kmod.TOTALS[2](np.arange(10.0)))"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    got = {}
    for guard in ("0", "1"):
        folder = tmp_path / guard
        folder.mkdir()
        (folder / "kmod.py").write_text(_KERNEL)
        savers = [
            subprocess.Popen(
                [sys.executable, "-c", _SAVER, str(folder), step, guard], env=env, stdout=subprocess.PIPE, text=True
            )
            for step in ("1", "2")
        ]
        outs = [p.communicate(timeout=120)[0].split() for p in savers]
        assert [p.returncode for p in savers] == [0, 0]
        assert outs == [["45.0"], ["20.0"]]  # each right in the process that compiled it
        run = subprocess.run(
            [sys.executable, "-c", loader, str(folder)], env=env, capture_output=True, text=True, check=True
        )
        got[guard] = run.stdout.split()
    assert got["1"] == ["45.0", "20.0"]
    assert got["0"] != ["45.0", "20.0"], "the forced interleaving no longer corrupts numba's own saves"
