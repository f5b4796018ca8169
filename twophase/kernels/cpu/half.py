"""float16 <-> float32 copies on the CPU's conversion instructions (F16C, AVX-512: ``vcvtph2ps``, ``vcvtps2ph``).

The ops compute float16 data in float32: they copy it into a float32 area of the workspace, work there and copy the
result back (the packed implementations). numpy converts float16 in software, element by element: 16 M elements
took 28-34 ms to float32 and 45 ms back, and 259 ms back when the values were float16 subnormals (softmax's outputs
over rows of 4096), against 3.3-3.9 ms either way here (one thread, AMD Zen 4, /tmp/w46/half.py of the forty-sixth
session). The results are numpy's, bit for bit, but for the payload of a NaN (it stays a NaN of the same sign):
LLVM's ``fpext`` / ``fptrunc`` round to nearest even, overflow to inf and keep subnormals, as numpy does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ...layout import flat2d, matrix2d
from ...runtime.fanout import bound, fanout_parts, pieces
from . import jit as _jit
from .jit import by_density, entry, host_has, row_of, rows_dense
from .streaming import CODES, apply_op, flat_launch

__all__ = ["available", "binary_launch", "cast_copy", "copier", "MIN_ELEMENTS", "FANOUT_ELEMENTS"]

MIN_ELEMENTS = 4096  # below this numpy's copy costs less than cutting the views here (~10 us)
FANOUT_ELEMENTS = 1 << 18  # elements from which the copy is cut into parts for helper threads
_UP, _DOWN = (np.dtype(np.float16), np.dtype(np.float32)), (np.dtype(np.float32), np.dtype(np.float16))


def available() -> bool:
    """Whether the conversions compile to instructions here (x86 with F16C; elsewhere LLVM would call a runtime
    routine that numba's JIT may not link)."""
    return host_has("f16c")


def _half_to_float_typing(typingctx: Any, bits: Any) -> Any:
    """The float32 value of the float16 whose bits are ``bits`` (a uint16): ``fpext``, exact."""
    if bits != types.uint16:
        return None
    sig = types.float32(types.uint16)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


def _float_to_half_typing(typingctx: Any, value: Any) -> Any:
    """The bits (a uint16) of the float16 nearest ``value`` (a float32; ties to even): ``fptrunc``."""
    if value != types.float32:
        return None
    sig = types.uint16(types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


half_to_float: Any = intrinsic(_half_to_float_typing)
float_to_half: Any = intrinsic(_float_to_half_typing)


BLOCK = 32  # columns at a time of a copy whose rows are strided (a transposed view)


def _kernel(up: bool, dense: bool) -> Any:
    """``dst[i, j] = convert(src[i, j])`` over 2-D arrays (float16 as their uint16 bits); ``dense``: rows with
    adjacent elements (``jit.rows_dense``), so the row loop vectorizes; else ``BLOCK`` columns at a time, so that
    the lines of a transposed view stay in L1 while consecutive rows use them (float16 4096 x 4096 transposed into
    float32, one thread: 62 ms row by row, 25 in blocks of 32 columns; blocks of 128 and 256: 27)."""

    @_jit.jit
    def convert(src: Any, dst: Any) -> None:
        rows, cols = src.shape
        step = cols if dense else BLOCK
        for j0 in range(0, cols, step):
            j1 = min(cols, j0 + step)
            for i in range(rows):
                s, d = row_of(src, i, dense), row_of(dst, i, dense)
                for j in range(j0, j1):
                    if up:
                        d[j] = half_to_float(s[j])
                    else:
                        d[j] = float_to_half(s[j])

    return convert


KERNELS = {up: by_density(functools.partial(_kernel, up)) for up in (True, False)}


def _binary_kernel(code: int) -> Any:
    """``out[i] = half(float(a[i]) op float(b[i]))`` over 1-D uint16 views of dense float16 arrays: numpy's float16
    arithmetic (its loops convert to float32, compute, round once to float16), bit for bit but for NaN payloads,
    in one pass instead of its element-by-element software conversions."""

    @numba.njit(nogil=True, cache=True, error_model="numpy")  # no fastmath: numpy's roundings
    def run(a: Any, b: Any, out: Any) -> None:
        for i in range(out.shape[0]):
            out[i] = float_to_half(apply_op(code, half_to_float(a[i]), half_to_float(b[i])))

    return run


BINARY = {name: _binary_kernel(code) for name, code in CODES.items()}


def binary_launch(name: str, x: Any, y: Any, out: Any, parts: int, grain: int) -> Callable[[Any], None]:
    """The launch of binary op ``name`` (add, sub, mul, div) on dense float16 arrays of one shape
    (``streaming.takes``), in ``parts`` ranges of at least ``grain`` elements."""
    return flat_launch(BINARY[name], (x.view(np.uint16), y.view(np.uint16)), out.view(np.uint16), parts, grain)


def _converts(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> bool:
    """Whether the conversion instructions do ``dst <- src``: float16 <-> float32 of one shape, from
    ``MIN_ELEMENTS`` elements, apart from each other. The cheapest test first: most calls on the hot path (a
    reduction's staged float64 result into a small float32 output) are small and leave at once."""
    return (
        dst.size >= MIN_ELEMENTS
        and (src.dtype, dst.dtype) in (_UP, _DOWN)
        and dst.shape == src.shape
        and available()
        and not np.may_share_memory(dst, src)
    )


def _converter(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> Callable[[], None]:
    """The conversion of ``src`` into ``dst`` (``_converts`` holds): views of any strides, in parts for helper
    threads from ``FANOUT_ELEMENTS`` (``fanout.pieces``)."""
    both = dst.flags.c_contiguous and src.flags.c_contiguous
    d2, s2 = (flat2d(dst), flat2d(src)) if both else (matrix2d(dst), matrix2d(src))
    if d2 is None or s2 is None:  # leading dims that do not merge (3-D and more): 2-D slices in turn
        slices = [copier(dst[index], src[index]) for index in np.ndindex(*dst.shape[:-2])]

        def each() -> None:
            for call in slices:
                call()

        return each
    up = (src.dtype, dst.dtype) == _UP
    bits_src, bits_dst = (s2.view(np.uint16), d2) if up else (s2, d2.view(np.uint16))
    fn = entry(KERNELS[up][rows_dense(bits_src, bits_dst)], bits_src, bits_dst)
    parts = pieces(bits_dst, (bits_src,), fanout_parts(), FANOUT_ELEMENTS // 2)
    return bound([functools.partial(fn, s, d) for d, s in parts])


def copier(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> Callable[[], None]:
    """The call that does ``np.copyto(dst, src, casting="unsafe")``, made once for arrays that stay bound (the
    ``cast`` op's operands): by the conversion instructions where ``_converts``, by numpy otherwise."""
    if _converts(dst, src):
        return _converter(dst, src)
    return functools.partial(np.copyto, dst, src, casting="unsafe")


def cast_copy(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
    """``np.copyto(dst, src, casting="unsafe")`` as :func:`copier` does it, for arrays made at the call (a
    workspace's pack areas); numpy's own copy is called directly, with no call object made."""
    if _converts(dst, src):
        _converter(dst, src)()
    else:
        np.copyto(dst, src, casting="unsafe")
