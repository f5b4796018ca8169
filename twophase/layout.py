"""Pure functions of shapes and strides: merging dims into views, broadcasting, permutations."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .tensor import TensorDesc

__all__ = [
    "merge_dims",
    "rows_split",
    "as_rows",
    "as_matrix",
    "matrix2d",
    "flat2d",
    "broadcast_shape",
    "align",
    "line_array",
    "spread_stride",
]


def merge_dims(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, int] | None:
    """Collapse a group of dims into one ``(size, stride)`` if they walk memory with one stride, else None.

    Size-1 dims are ignored; an empty group is ``(1, 0)``; a group with a 0-size dim is ``(0, 0)``.
    """
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    if any(n == 0 for n, _ in dims):
        return 0, 0
    if not dims:
        return 1, 0
    size, stride = dims[-1]
    for n, s in reversed(dims[:-1]):
        if s != stride * size:
            return None
        size *= n
    return size, stride


def rows_split(shape: Sequence[int], *strides: Sequence[int]) -> int | None:
    """Where ``shape`` splits into rows: the smallest k such that, for every strides, dims ``k..`` walk memory with
    one stride (a row) and dims ``..k`` do too (the rows, evenly spaced); None when no k does. Dims that do not
    merge into one (a crop of a wider image, a slice of a fused projection) so need not be packed: kernels go
    row by row, each row dense when its last stride is the itemsize."""
    for k in range(len(shape) + 1):
        if all(
            merge_dims(shape[k:], st[k:]) is not None and merge_dims(shape[:k], st[:k]) is not None for st in strides
        ):
            return k
    return None


def as_rows(a: np.ndarray[Any, Any], lead: int, k: int) -> np.ndarray[Any, Any]:
    """The zero-copy view ``(*a.shape[:lead], R, S)`` of ``a``: dims ``lead..lead+k`` as R rows, the rest as rows
    of S elements (``k`` from ``rows_split`` of the dims after ``lead``)."""
    tail = a.shape[lead:]
    r = int(np.prod(tail[:k], dtype=np.int64))
    return a.reshape(a.shape[:lead] + (r, int(np.prod(tail[k:], dtype=np.int64))), copy=False)


def as_matrix(a: np.ndarray[Any, Any], rows: Sequence[int], cols: Sequence[int]) -> np.ndarray[Any, Any] | None:
    """A zero-copy ``(prod rows, prod cols)`` view of ``a`` with axes ``rows`` then ``cols``, or None."""
    shp = a.shape
    r = c = 1
    for i in rows:
        r *= shp[i]
    for i in cols:
        c *= shp[i]
    try:
        return a.transpose(tuple(rows) + tuple(cols)).reshape((r, c), copy=False)
    except ValueError:
        return None


def matrix2d(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any] | None:
    """``a`` as a (prod of leading dims, last dim) view, or None when the leading dims do not merge."""
    if a.ndim == 0:
        return a.reshape(1, 1)
    return as_matrix(a, tuple(range(a.ndim - 1)), (a.ndim - 1,))


def flat2d(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any] | None:
    """A C-contiguous array as one (1, size) row (a parallel kernel cuts it anywhere), else ``matrix2d``."""
    return a.reshape(1, a.size) if a.flags.c_contiguous else matrix2d(a)


def broadcast_shape(*shapes: Sequence[int]) -> tuple[int, ...] | None:
    """numpy's broadcast result shape, or None when the shapes do not broadcast."""
    ndim = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(ndim):
        dim = 1
        for s in shapes:
            j = i - (ndim - len(s))
            if j < 0 or s[j] == 1:
                continue
            if dim != 1 and s[j] != dim:
                return None
            dim = s[j]
        out.append(dim)
    return tuple(out)


def align(nbytes: int, to: int = 64) -> int:
    """Round ``nbytes`` up to a multiple of ``to`` (workspace sub-buffers start on cache lines)."""
    return (nbytes + to - 1) // to * to


def line_array(shape: Sequence[int], dtype: Any) -> np.ndarray[Any, Any]:
    """A C-contiguous array on cache lines of its own: it starts on a 64-byte boundary and the rest of its last
    line is padding, so no other array's bytes share its lines (scratch rows of parts that threads write at once:
    rows sharing a line would pass it from core to core at every store)."""
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    raw = np.empty(align(nbytes) + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out: np.ndarray[Any, Any] = raw[start : start + nbytes].view(dt).reshape(shape)
    return out


def spread_stride(nbytes: int, count: int = 16) -> int:
    """The byte stride (>= ``nbytes``, a multiple of 64) at which ``count`` consecutive blocks start on distinct
    cache lines modulo 4 KiB, so distinct L1 sets: blocks a power of two apart would put their ``count`` streams
    in one set, and a loop writing all of them at once would evict itself (7x slower winograd transforms)."""
    if not 1 <= count <= 64:
        raise ValueError(f"count {count} outside 1..64")
    stride = align(nbytes)
    while len({k * stride % 4096 for k in range(count)}) < count:
        stride += 64
    return stride


def same_view(a: Any, b: Any) -> bool:
    """Whether two arrays are the same view: same address, shape, strides and dtype (an op runs in place)."""
    return bool(a.ctypes.data == b.ctypes.data and a.shape == b.shape and a.strides == b.strides and a.dtype == b.dtype)


def byte_range(address: int, desc: TensorDesc) -> tuple[int, int]:
    """The bytes ``[first, past-last)`` that ``desc`` touches in a buffer at ``address``."""
    lo, hi = desc.byte_span()
    return address + lo, address + hi


def apart(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    """Whether two byte ranges (``byte_range``, ``TensorDesc.byte_span``) are known not to meet; None (no
    operand) is not known apart."""
    return a is not None and b is not None and (a[1] <= b[0] or b[1] <= a[0])


def overlaps(a: Any, b: Any) -> bool:
    """Whether two arrays share memory: interleaved but disjoint views (even and odd columns) do not; a pair too
    hard to decide within a small work bound counts as overlapping."""
    if not np.may_share_memory(a, b):
        return False
    try:
        return bool(np.shares_memory(a, b, max_work=1 << 16))  # type: ignore[arg-type]
    except np.exceptions.TooHardError:
        return True


def relation(outer: TensorDesc, inner: TensorDesc, max_bytes: int = 1 << 26) -> str:
    """How the elements of view ``inner`` of a buffer lie against those of view ``outer`` of the same buffer:
    ``"apart"`` (no byte in common: interleaved columns too), ``"within"`` (every byte of ``inner`` is one of
    ``outer``'s) or ``"straddles"``. Exact, by marking ``outer``'s bytes, up to spans of ``max_bytes``; past
    that a view inside a row-major ``outer``'s span is within and any other meeting pair straddles."""
    (olo, ohi), (ilo, ihi) = outer.byte_span(), inner.byte_span()
    if apart((olo, ohi), (ilo, ihi)) or inner.numel == 0 or outer.numel == 0:
        return "apart"
    if inner == outer:
        return "within"
    lo, hi = min(olo, ilo), max(ohi, ihi)
    if hi - lo > max_bytes:
        return "within" if outer.is_contiguous and olo <= ilo and ihi <= ohi else "straddles"
    marks = np.zeros(hi - lo, np.bool_)
    bytes_of(marks, outer, lo)[...] = True
    covered = bytes_of(marks, inner, lo)
    return "within" if covered.all() else "straddles" if covered.any() else "apart"


def bytes_of(marks: np.ndarray[Any, Any], desc: TensorDesc, lo: int = 0) -> np.ndarray[Any, Any]:
    """The bytes of ``desc`` as a writable view of ``marks`` (one bool per byte of the buffer from ``lo``); a
    0-element desc is an empty view."""
    item = desc.dtype.itemsize
    return np.lib.stride_tricks.as_strided(
        marks[desc.offset * item - lo :],
        (*desc.shape, item),
        (*(s * item for s in desc.strides), 1),
    )


def self_overlapping(a: Any) -> bool:
    """Whether two elements of the array ``a`` may share memory (a zero or too small stride: a broadcast view).
    Sufficient test, as torch's: sorted by stride, each dim must step past everything the smaller ones cover."""
    if 0 in a.shape:
        return False  # no elements, none to share (numpy gives 0-size arrays zero strides)
    dims = sorted((abs(s), n) for n, s in zip(a.shape, a.strides) if n > 1)
    covered = a.itemsize
    for stride, n in dims:
        if stride < covered:
            return True
        covered = stride * (n - 1) + covered
    return False
