"""Tensor metadata (``DType``, ``Format``, ``TensorDesc``) and ``Tensor``, a desc bound to a device block."""

from __future__ import annotations

import builtins
import enum
import math
from operator import index as _index
from typing import TYPE_CHECKING, Any

import numpy as np

from .config import int_value
from .errors import InvalidStateError, ParamError

if TYPE_CHECKING:
    from .runtime.device import Device
    from .runtime.memory import Block
    from .runtime.stream import Stream

__all__ = ["DType", "Format", "TensorDesc", "Tensor", "contiguous_strides"]


class DType(enum.Enum):
    """Element types; ``.np`` is the numpy dtype and ``.itemsize`` its width in bytes."""

    float16 = "float16"
    float32 = "float32"
    float64 = "float64"
    int8 = "int8"
    int32 = "int32"
    int64 = "int64"
    uint8 = "uint8"
    bool = "bool"

    @classmethod
    def _missing_(cls, value: object) -> DType:
        """``DType(x)`` for anything but a member's name: what ``DType.of`` gives (a ParamError, a ValueError as
        the enum's own would be)."""
        return cls.of(value)

    @property
    def np(self) -> np.dtype[Any]:
        return _NP[self]

    @property
    def itemsize(self) -> int:
        return _NP[self].itemsize

    @property
    def is_float(self) -> builtins.bool:
        return self in (DType.float16, DType.float32, DType.float64)

    @classmethod
    def of(cls, value: Any) -> DType:
        """The DType of a DType, numpy dtype, type or name; ``ParamError`` for anything else."""
        if isinstance(value, DType):
            return value
        if value is None:  # np.dtype(None) is float64: never what a missing dtype meant
            raise ParamError(arg="dtype", expected=f"one of {[d.value for d in DType]}", got="None")
        try:
            return _FROM_NP[np.dtype(value)]
        except (TypeError, KeyError):
            raise ParamError(arg="dtype", expected=f"one of {[d.value for d in DType]}", got=value) from None


_NP = {d: np.dtype(d.value) for d in DType}
_FROM_NP = {v: k for k, v in _NP.items()}


class Format(enum.Enum):
    """Logical layout tag; kernels that care (conv, pooling) read it, others treat every format as ND."""

    ND = "ND"
    NCHW = "NCHW"
    NHWC = "NHWC"
    NCL = "NCL"
    NCDHW = "NCDHW"


_FORMAT_RANK = {Format.NCHW: 4, Format.NHWC: 4, Format.NCL: 3, Format.NCDHW: 5}


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides in elements."""
    strides = [1] * len(shape)
    acc = 1
    for i in range(len(shape) - 1, -1, -1):
        strides[i] = acc
        acc *= max(shape[i], 1)
    return tuple(strides)


class TensorDesc:
    """Immutable, hashable tensor metadata: shape, dtype, strides and offset in elements, format.

    Two descs are equal when every field is; the hash is computed once because descs are cache keys.
    """

    __slots__ = ("shape", "dtype", "strides", "offset", "format", "_hash", "numel", "ndim", "_contiguous")

    shape: tuple[int, ...]
    dtype: DType
    strides: tuple[int, ...]
    offset: int
    format: Format
    numel: int
    ndim: int
    _hash: int
    _contiguous: bool | None

    def __init__(
        self,
        shape: Any,
        dtype: Any = DType.float32,
        strides: Any = None,
        offset: int = 0,
        format: Format = Format.ND,
    ) -> None:
        try:  # operator.index: ints and numpy ints only (int() took 2.5 as 2, and "12" as the shape (1, 2))
            if isinstance(shape, (str, bytes)):
                raise TypeError(shape)
            shp = tuple(_index(s) for s in shape)
        except (TypeError, ValueError):
            raise ParamError(arg="shape", expected="a sequence of ints", got=shape) from None
        if any(s < 0 for s in shp):
            raise ParamError(arg="shape", expected="non-negative dims", got=shp)
        try:
            st = contiguous_strides(shp) if strides is None else tuple(_index(s) for s in strides)
        except TypeError:
            raise ParamError(arg="strides", expected="a sequence of ints", got=strides) from None
        if len(st) != len(shp):
            raise ParamError(arg="strides", expected=f"{len(shp)} strides for shape {shp}", got=st)
        if not isinstance(format, Format):
            raise ParamError(arg="format", expected="a twophase.Format", got=format)
        rank = _FORMAT_RANK.get(format)
        if rank is not None and rank != len(shp):
            raise ParamError(arg="format", expected=f"rank {rank} for {format.value}", got=f"shape {shp}")
        try:
            off = _index(offset) if not isinstance(offset, bool) else -1
        except TypeError:
            off = -1
        if off < 0:
            raise ParamError(arg="offset", expected="an int >= 0", got=offset)
        dt = DType.of(dtype)
        set_ = object.__setattr__
        set_(self, "shape", shp)
        set_(self, "dtype", dt)
        set_(self, "strides", st)
        set_(self, "offset", off)
        set_(self, "format", format)
        set_(self, "ndim", len(shp))
        set_(self, "numel", math.prod(shp))
        set_(self, "_hash", hash((shp, dt, st, off, format)))
        set_(self, "_contiguous", None if strides is not None else True)

    @classmethod
    def like(cls, array: np.ndarray[Any, Any], format: Format = Format.ND) -> TensorDesc:
        """The desc of a dense copy of ``array`` (its shape and dtype, contiguous strides)."""
        return cls(array.shape, array.dtype, None, 0, format)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("TensorDesc is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("TensorDesc is immutable")

    def __reduce__(self) -> Any:
        return (TensorDesc, (self.shape, self.dtype, self.strides, self.offset, self.format))

    def __copy__(self) -> TensorDesc:
        return self  # immutable: a copy would be equal in every field

    def __deepcopy__(self, memo: Any) -> TensorDesc:
        return self

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, TensorDesc):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.shape == other.shape
            and self.dtype is other.dtype
            and self.strides == other.strides
            and self.offset == other.offset
            and self.format is other.format
        )

    def __repr__(self) -> str:
        extra = "" if self.is_contiguous else f", strides={self.strides}"
        extra += f", offset={self.offset}" if self.offset else ""
        extra += "" if self.format is Format.ND else f", format={self.format.value}"
        return f"TensorDesc({self.shape}, {self.dtype.value}{extra})"

    @property
    def is_contiguous(self) -> bool:
        c = self._contiguous
        if c is None:
            c = all(s == k for s, k, n in zip(self.strides, contiguous_strides(self.shape), self.shape) if n > 1)
            object.__setattr__(self, "_contiguous", c)
        return bool(c)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def span(self) -> tuple[int, int]:
        """Lowest and one-past-highest element index the desc touches (relative to the buffer start)."""
        if self.numel == 0:
            return self.offset, self.offset
        lo = hi = self.offset
        for n, s in zip(self.shape, self.strides):
            if s < 0:
                lo += (n - 1) * s
            else:
                hi += (n - 1) * s
        return lo, hi + 1

    def byte_span(self) -> tuple[int, int]:
        """``span`` in bytes: the first and one-past-last byte the desc touches (relative to the buffer start)."""
        lo, hi = self.span()
        return lo * self.dtype.itemsize, hi * self.dtype.itemsize

    def with_(self, **changes: Any) -> TensorDesc:
        """A copy with some fields replaced (strides reset to contiguous when only the shape changes)."""
        fields: dict[str, Any] = {
            "shape": self.shape,
            "dtype": self.dtype,
            "strides": self.strides,
            "offset": self.offset,
            "format": self.format,
        }
        if "shape" in changes and "strides" not in changes:
            fields["strides"] = None
        fields.update(changes)
        return TensorDesc(**fields)


class Tensor:
    """A :class:`TensorDesc` bound to a device memory block; made by ``dev.tensor`` / ``dev.empty``.

    ``numpy()`` waits for pending work on the block and copies out; ``view()`` is the raw device view
    (no synchronization: use it only where the stream order already guarantees readiness).
    """

    __slots__ = ("desc", "block", "device", "_view", "__weakref__")

    desc: TensorDesc
    block: Block
    device: Device
    _view: np.ndarray[Any, Any] | None

    def __init__(self, *_: Any, **__: Any) -> None:
        raise TypeError("Tensors are made by a device: use dev.tensor(array) or dev.empty(shape, dtype)")

    @classmethod
    def _make(cls, desc: TensorDesc, block: Block, device: Device, checked: bool = True) -> Tensor:
        """Bind ``desc`` to ``block``; ``checked=False`` only for a dense desc on a block sized for it."""
        self = object.__new__(cls)
        if checked:
            if block.freed:
                raise InvalidStateError("tensor's block was freed", arg="tensor", got=desc)
            lo, hi = desc.span()
            if lo < 0 or hi * desc.dtype.itemsize > block.size:
                raise ParamError(arg="desc", expected=f"a desc inside a {block.size}-byte block", got=desc)
        self.desc = desc
        self.block = block
        self.device = device
        self._view = None
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        return self.desc.shape

    @property
    def dtype(self) -> DType:
        return self.desc.dtype

    @property
    def ndim(self) -> int:
        return self.desc.ndim

    def __repr__(self) -> str:
        return f"Tensor({self.desc!r}, device={self.device.name})"

    def __reduce__(self) -> Any:
        """Pickled as its data (after its pending work, like ``numpy()``), its format and its device's name: the
        receiving process copies it onto its own device of that name; a strided view arrives dense."""
        return _unpickle_tensor, (self.device.name, self.numpy(), self.desc.format)

    def view(self) -> np.ndarray[Any, Any]:
        """The numpy view of the device memory (CPU backends); no synchronization."""
        if self.block.freed:  # checked on every call: another view of the block may have freed it since
            raise InvalidStateError("tensor's block was freed", arg="tensor", got=self.desc)
        v = self._view
        if v is None:
            v = self.device._array_view(self.block, self.desc)
            self._view = v
        return v

    def synchronize(self) -> None:
        """Wait until every task enqueued on this tensor's memory has completed (raising its error if any)."""
        self.block.wait()

    def numpy(self) -> np.ndarray[Any, Any]:
        """Wait for pending work on the tensor, then return a host copy."""
        self.block.wait()
        return np.array(self.view(), copy=True)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray[Any, Any]:
        """A host copy (numpy's protocol: ``copy=False`` must raise when a copy cannot be avoided)."""
        if copy is False:
            raise ParamError(
                "a tensor converts to a host copy; for a view of its memory use np.from_dlpack(t)",
                op="Tensor.__array__",
                arg="copy",
                expected="None or True",
                got=copy,
            )
        out = self.numpy()
        return out if dtype is None else out.astype(dtype, copy=False)

    def __dlpack__(self, *, stream: Any = None, **kwargs: Any) -> Any:
        """DLPack export of the host memory; the block stays out of the pool until the consumer releases it.

        ``stream`` is the consumer's: None, or a twophase Stream of this device. A CPU tensor is made ready for
        any consumer by waiting for its pending work (the DLPack spec has no CPU stream, so ints are refused).
        """
        from .runtime.stream import Stream  # the runtime imports this module

        if stream is not None and not (isinstance(stream, Stream) and stream.device is self.device):
            raise ParamError(
                op="Tensor.__dlpack__",
                arg="stream",
                expected=f"None or a twophase Stream of device {self.device.name} (a CPU consumer "
                "has no DLPack stream)",
                got=stream,
            )
        self.block.wait()
        held = self.view().view()  # a fresh array per export: the consumer holds it until its deleter runs
        self.block.export(held)  # released when ``held`` is collected, also if numpy refuses the arguments
        try:
            return held.__dlpack__(**kwargs)
        except (TypeError, ValueError) as e:  # max_version / copy / an unknown keyword (BufferError: the spec's)
            raise ParamError(
                op="Tensor.__dlpack__",
                arg=", ".join(kwargs) or "arguments",
                expected="the DLPack keywords max_version=(major, minor), dl_device, copy=bool",
                got=f"{kwargs} ({e})",
            ) from None

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU

    def strided(self, shape: Any, strides: Any, offset: int = 0) -> Tensor:
        """A view of the same memory with another shape / strides / offset (in elements)."""
        desc = TensorDesc(shape, self.desc.dtype, strides, offset, Format.ND)
        return Tensor._make(desc, self.block, self.device)

    def transpose(self, a: int = -2, b: int = -1) -> Tensor:
        """A view with dims ``a`` and ``b`` swapped (no copy)."""
        n = self.desc.ndim
        for name, d in (("a", a), ("b", b)):
            if int_value(d) is None or not -n <= d < n:
                raise ParamError(
                    op="Tensor.transpose", arg=name, expected=f"a dim in [{-n}, {n}) of a {n}-d tensor", got=d
                )
        shape, strides = list(self.desc.shape), list(self.desc.strides)
        shape[a], shape[b] = shape[b], shape[a]
        strides[a], strides[b] = strides[b], strides[a]
        return self.strided(shape, strides, self.desc.offset)

    def free(self, stream: Stream | None = None) -> None:
        """Return the tensor's block to the pool in ``stream`` order (only for the tensor that owns it)."""
        self.block.free(stream)
        self._view = None


def _unpickle_tensor(device_name: str, array: np.ndarray[Any, Any], format: Format) -> Tensor:
    """A pickled :class:`Tensor` copied onto this process's device ``device_name`` (its default stream)."""
    from .runtime.device import device  # the runtime imports this module

    return device(device_name).tensor(array, format=format)
