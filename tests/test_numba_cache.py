"""numba's on-disk cache is dropped when any kernel source changes (numba only watches each kernel's own file)."""

from __future__ import annotations

from pathlib import Path

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
    stamp = here / "__pycache__" / "twophase-kernels.digest"
    assert stamp.read_text() == numba_cache.source_digest(here)
