"""Put a host array on the CPU device in a chosen memory layout (dense, strided, transposed, reversed, padded)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import numpy as np
from hypothesis import strategies as st
from numba.core.dispatcher import Dispatcher

from twophase import device
from twophase.tensor import Tensor
from twophase.testing.checked import view_of

LAYOUTS = ("dense", "strided", "transposed", "reversed", "padded")


def on_device(a: np.ndarray[Any, Any], layout: str = "dense") -> Tensor:
    """A device tensor holding ``a`` whose desc has the layout's strides (and offset for negative strides)."""
    dev = device("cpu")
    a = np.asarray(a)
    if layout == "dense" or a.ndim == 0:
        t = dev.tensor(a)
        t.synchronize()  # the copy-in runs on the default stream; run_checked uses its own
        return t
    if layout == "strided":
        base = np.zeros(a.shape[:-1] + (2 * a.shape[-1] + 1,), a.dtype)
        view = base[..., 1::2]
    elif layout == "transposed":
        base = np.zeros(a.shape[::-1], a.dtype)
        view = base.T
    elif layout == "padded":  # the leading part of each row of a wider array: dense rows, the whole not
        base = np.zeros(a.shape[:-1] + (a.shape[-1] + 3,), a.dtype)
        view = base[..., 1 : a.shape[-1] + 1]
    else:
        base = np.zeros(a.shape, a.dtype)
        view = base[::-1]
    view[...] = a
    t = dev.tensor(base)
    t.synchronize()
    return view_of(t, base, view)


def shapes(min_dims: int = 0, max_dims: int = 4, max_side: int = 7) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes with 0-size and size-1 dims."""
    return st.lists(st.integers(0, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


def random(
    shape: tuple[int, ...], dtype: Any, rng: np.random.Generator, positive: bool = False
) -> np.ndarray[Any, Any]:
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.random(shape) < 0.5
    if dt.kind == "i":
        return rng.integers(-9, 10, shape).astype(dt)
    x = rng.standard_normal(shape) * 3
    return (np.abs(x) + 0.1 if positive else x).astype(dt)


POISON_BITS = {  # signalling NaNs:
    np.float16: np.uint16(0x7D01),
    np.float32: np.uint32(0x7FA0_0001),
    np.float64: np.uint64(0x7FF4_0000_0000_0001),
}
# no arithmetic result has these bits (operations quiet a signalling NaN), so one left in an output was never written


def dense_at(base: np.ndarray[Any, Any], shape: tuple[int, ...], offset: int) -> tuple[Tensor, Tensor]:
    """(whole, view): a device copy of the 1-D ``base`` and a dense tensor of ``shape`` ``offset`` elements into it
    (any element alignment: the pool's blocks start 512-byte aligned)."""
    whole = device("cpu").tensor(base)
    whole.synchronize()
    strides = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
    return whole, whole.strided(shape, strides, offset)


def specializations() -> int:
    """How many specializations the process's numba kernels hold, compiled or loaded from numba's cache: a kernel
    whose code does not depend on its operands' layout should add none for another layout."""
    return sum(len(d.overloads) for d in gc.get_objects() if issubclass(type(d), Dispatcher))  # not a weak proxy's


@contextlib.contextmanager
def compiles_nothing() -> Iterator[None]:
    """Asserts that the block adds no specialization to the process's numba kernels (``specializations``)."""
    before = specializations()
    yield
    assert specializations() == before
