"""``jit.copy_run``: a run of adjacent elements copied by ``llvm.memcpy``, exactly that run, for each dtype;
``jit.copy_even``: every other element of a run, ``jit.copy_phases``: a row's even and odd elements to two places
in one pass, and ``jit.copy_where``: a run with the elements a mask drops written 0, all by masked vector loads that
read nothing else."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twophase.kernels.cpu import jit
from twophase.kernels.cpu.jit import copy_even, copy_phases, copy_run, copy_where


@numba.njit(nogil=True)
def _copy(dst: Any, d0: int, src: Any, s0: int, n: int) -> None:
    copy_run(dst, d0, src, s0, n)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.uint8])
@pytest.mark.parametrize("d0, s0, n", [(0, 0, 0), (3, 5, 1), (1, 2, 49), (7, 0, 196), (0, 11, 300)])
def test_copy_run_copies_exactly_the_run(rng: np.random.Generator, dtype: Any, d0: int, s0: int, n: int) -> None:
    src = rng.integers(1, 255, s0 + n + 9).astype(dtype)  # 1-254: 7 is one value among them, 0 none
    if dtype != np.uint8:
        src = src * dtype(1.5) if np.issubdtype(dtype, np.floating) else src * 3
    dst = np.full(d0 + n + 9, 7, dtype)
    _copy(dst, d0, src, s0, n)
    expected = np.full_like(dst, 7)
    expected[d0 : d0 + n] = src[s0 : s0 + n]
    np.testing.assert_array_equal(dst, expected)  # the run, bit for bit, and nothing before or after it


def test_copy_run_refuses_mismatched_dtypes() -> None:
    with pytest.raises(numba.TypingError):
        _copy(np.zeros(4, np.float32), 0, np.zeros(4, np.float64), 0, 2)


@numba.njit(nogil=True)
def _evens(dst: Any, d0: int, src: Any, s0: int, n: int) -> None:
    copy_even(dst, d0, src, s0, n)


def _any_bits(seed: int, dtype: Any, n: int) -> tuple[Any, Any]:
    """(n random values of ``dtype`` drawn as bits, NaN payloads and infinities included; the bits' dtype)."""
    bits = np.uint32 if dtype == np.float32 else np.uint64
    raw = np.random.default_rng(seed).integers(0, np.iinfo(bits).max, n, dtype=bits, endpoint=True)
    return raw.view(dtype), bits


def _check_run(dst: Any, d0: int, run: Any, bits: Any) -> None:
    """``dst`` holds ``run`` from ``d0`` on, bit for bit, and 7 everywhere else."""
    expected = np.full_like(dst, 7)
    expected[d0 : d0 + run.size] = run
    np.testing.assert_array_equal(dst.view(bits), expected.view(bits))


# a run's arguments: every length around the 64-byte step (16 float32, 8 float64), at any element offsets
_RUNS = dict(
    dtype=st.sampled_from([np.float32, np.float64]), d0=st.integers(0, 20), s0=st.integers(0, 20), n=st.integers(0, 70)
)


@settings(max_examples=60, deadline=None)
@given(**_RUNS)
def test_copy_even_copies_every_other_element_exactly(dtype: Any, d0: int, s0: int, n: int) -> None:
    """Every length around the 64-byte step (16 float32, 8 float64), bit for bit (NaN payloads included), and
    nothing written before or after the run."""
    src, bits = _any_bits(n * 1000 + s0 * 31 + d0, dtype, s0 + 2 * n + 3)
    dst = np.full(d0 + n + 17, 7, dtype)
    _evens(dst, d0, src, s0, n)
    _check_run(dst, d0, src[s0 : s0 + 2 * n : 2], bits)


@numba.njit(nogil=True)
def _phases(dst: Any, d0: int, d1: int, src: Any) -> None:
    copy_phases(dst, d0, src, 0, (src.size + 1) // 2, d1, src.size // 2)


@settings(max_examples=60, deadline=None)
@given(dtype=_RUNS["dtype"], d0=st.integers(0, 20), gap=st.integers(0, 40), width=st.integers(0, 140))
def test_copy_phases_splits_a_row_into_its_even_and_odd_elements(dtype: Any, d0: int, gap: int, width: int) -> None:
    """A row of every width around two 64-byte steps: its even elements from d0, its odd ones from d0 + ceil(width
    / 2) + gap, bit for bit (NaN payloads included), and nothing written before, between or after them."""
    src, bits = _any_bits(width * 1000 + gap * 31 + d0, dtype, width)
    evens, odds = src[0::2], src[1::2]
    d1 = d0 + evens.size + gap
    dst = np.full(d1 + odds.size + 17, 7, dtype)
    _phases(dst, d0, d1, src)
    expected = np.full_like(dst, 7)
    expected[d0 : d0 + evens.size] = evens
    expected[d1 : d1 + odds.size] = odds
    np.testing.assert_array_equal(dst.view(bits), expected.view(bits))


@numba.njit(nogil=True)
def _where(dst: Any, d0: int, src: Any, s0: int, n: int, keep: Any, k0: int) -> None:
    copy_where(dst, d0, src, s0, n, keep, k0)


@settings(max_examples=60, deadline=None)
@given(**_RUNS, k0=st.integers(0, 5))
def test_copy_where_copies_the_kept_elements_and_zeroes_the_rest(dtype: Any, d0: int, s0: int, k0: int, n: int) -> None:
    """Every length around the 64-byte step, bit for bit where kept (NaN payloads included), +0.0 where not,
    nothing written before or after the run."""
    src, bits = _any_bits(n * 1000 + s0 * 31 + d0 * 7 + k0, dtype, s0 + n + 3)
    keep = np.random.default_rng(n + 5 * k0).random(k0 + n + 4) < 0.6
    dst = np.full(d0 + n + 17, 7, dtype)
    _where(dst, d0, src, s0, n, keep, k0)
    _check_run(dst, d0, np.where(keep[k0 : k0 + n], src[s0 : s0 + n], dtype(0)), bits)


_GUARD_PAGE = """
import ctypes, mmap, sys
import numba, numpy as np
from twophase.kernels.cpu.jit import copy_even, copy_phases, copy_where

@numba.njit
def evens(dst, src, s0, n):
    copy_even(dst, 0, src, s0, n)

@numba.njit
def phases(dst, src, w):
    copy_phases(dst, 0, src, 0, (w + 1) // 2, (w + 1) // 2, w // 2)

page = mmap.PAGESIZE
buf = mmap.mmap(-1, 2 * page)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
for dtype in (np.float32, np.float64):
    src = np.frombuffer(buf, dtype, page // np.dtype(dtype).itemsize)  # the first page, the second unreadable
    src[:] = np.arange(src.size)
    if dtype == np.float32:
        assert libc.mprotect(addr + page, page, 0) == 0  # PROT_NONE
    for n in (1, 5, 8, 15, 16, 17, 33):
        dst = np.zeros(n, dtype)
        s0 = src.size - (2 * n - 1)  # the last element read is the page's last
        evens(dst, src, s0, n)
        assert (dst == src[s0::2]).all(), (dtype, n)
    for w in (1, 2, 5, 16, 31, 32, 33, 64, 67):  # a row whose last element is the page's last
        row = src[src.size - w :]
        dst = np.zeros(w, dtype)
        phases(dst, row, w)
        assert (dst == np.concatenate([row[0::2], row[1::2]])).all(), (dtype, w)
@numba.njit
def where(dst, src, s0, n, keep):
    copy_where(dst, 0, src, s0, n, keep, 0)

for dtype in (np.float32, np.float64):  # a run ending at the page's last element; one ending past it, masked
    src = np.frombuffer(buf, dtype, page // np.dtype(dtype).itemsize)
    src[:] = np.arange(src.size)
    for n in (1, 5, 8, 15, 16, 17, 33):
        dst = np.full(n + 3, 7, dtype)
        where(dst, src, src.size - n, n, np.ones(n, np.bool_))
        assert (dst[:n] == src[-n:]).all() and (dst[n:] == 7).all(), (dtype, n)
        keep = np.ones(n + 3, np.bool_)
        keep[n:] = False
        where(dst, src, src.size - n, n + 3, keep)
        assert (dst[:n] == src[-n:]).all() and (dst[n:] == 0).all(), (dtype, n)
print("ok")
"""


def test_copy_even_copy_phases_and_copy_where_read_nothing_past_their_last_element() -> None:
    """The masked loads touch only the elements read: a run ending at the last element before an unreadable page,
    or running past it where the mask drops the elements, copies (a full-width load would fault: run in a child
    process, where a crash is a failure, not a lost run)."""
    done = subprocess.run([sys.executable, "-c", _GUARD_PAGE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


_MASKED_STORE = re.compile(r"vmaskmovp[sd]\s+%\w+,\s*%\w+,\s*\S*\(")  # AT&T: the memory operand last


@pytest.mark.parametrize("piecewise", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_last_line_of_each_length_in_pieces_or_masked(
    piecewise: bool, dtype: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every run length from 0 to three 64-byte lines, so the last step stores each count of lanes, both in the
    pieces taken where ``SLOW_MASKED_STORES`` (CPUs without AVX-512) and by a masked store: ``copy_even``,
    ``copy_phases`` and ``copy_where`` bit for bit, nothing written outside their runs. In pieces, the compiled
    code has no masked store (a microcoded vmaskmovps on AMD's AVX2 CPUs)."""
    monkeypatch.setattr(jit, "SLOW_MASKED_STORES", piecewise)

    @numba.njit(nogil=True)  # compiled here, under the flag set above
    def evens(dst: Any, d0: int, src: Any, s0: int, n: int) -> None:
        copy_even(dst, d0, src, s0, n)

    @numba.njit(nogil=True)
    def phases(dst: Any, d0: int, d1: int, src: Any) -> None:
        copy_phases(dst, d0, src, 0, (src.size + 1) // 2, d1, src.size // 2)

    @numba.njit(nogil=True)
    def where(dst: Any, d0: int, src: Any, s0: int, n: int, keep: Any, k0: int) -> None:
        copy_where(dst, d0, src, s0, n, keep, k0)

    lanes = 64 // np.dtype(dtype).itemsize
    for n in range(3 * lanes + 1):
        for d0 in (0, 3):
            src, bits = _any_bits(n * 7 + d0, dtype, 2 * n + 5)
            dst = np.full(d0 + n + 17, 7, dtype)
            evens(dst, d0, src, 1, n)
            _check_run(dst, d0, src[1 : 1 + 2 * n : 2], bits)
            keep = np.random.default_rng(n).integers(0, 2, n + 2).astype(np.bool_)
            dst = np.full(d0 + n + 17, 7, dtype)
            where(dst, d0, src, 2, n, keep, 1)
            _check_run(dst, d0, np.where(keep[1 : n + 1], src[2 : n + 2], dtype(0)), bits)
            row = src[: 2 * n + 1 - d0 % 2]  # widths of both parities
            evens_, odds = row[0::2], row[1::2]
            dst = np.full(d0 + row.size + 20, 7, dtype)
            phases(dst, d0, d0 + evens_.size + 2, row)
            expected = np.full_like(dst, 7)
            expected[d0 : d0 + evens_.size] = evens_
            expected[d0 + evens_.size + 2 : d0 + evens_.size + 2 + odds.size] = odds
            np.testing.assert_array_equal(dst.view(bits), expected.view(bits))
    if piecewise:
        for fn in (evens, phases, where):
            assert not _MASKED_STORE.search("\n".join(fn.inspect_asm().values())), fn.__name__
