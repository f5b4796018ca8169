"""Kernels that write their output with non-temporal (streaming) stores: binary arithmetic (add, sub, mul, div),
the row write of layer / RMS norm (``store_normalized``, used by ``norm.py``) and the unary vector-math loops
(``put_streaming``, used by ``elementwise.py``).

A plain store to a line that is not cached reads that line first (read for ownership), so ``out = x + y`` over
arrays larger than the last-level cache moves four arrays' bytes through memory to write three. An aligned 32-byte
``vmovntps`` / ``vmovntpd`` writes whole lines past the cache without reading them. On this project's AMD EPYC
(AVX2, 2 vCPUs) a 4096 x 4096 float32 add ran 1.14-1.25x faster this way, layer / RMS norm 1.22-1.63x. On a Zen 5
EPYC (AVX-512) gelu and silu of 16 M float32 elements ran 1.04-1.30x faster (``/tmp/w40/unab.py``, the fortieth
session, side by side with the plain vector loop). Below the cache's size the result would have stayed cached for
the next op, which then reads it from memory instead: an add followed by a read of its 8 MiB output ran 0.85x as
fast (``/tmp/w20/ntsz.py`` of the twentieth session). So phase 1 ranks these implementations first only for outputs
of at least :func:`stream_threshold`: the last-level cache's size, at most ``STREAM_MAX_THRESHOLD``.

The binary arithmetic is plain IEEE (no fast-math flags), one rounding per element as numpy's: the results are
bitwise numpy's, NaN and inf included. x86 only (the ``sfence`` that orders the streaming stores before the part's
completion is an x86 instruction).
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ...layout import same_view
from ...runtime.fanout import launcher, split_range
from .jit import entry

__all__ = [
    "CODES",
    "apply_op",
    "KERNELS",
    "AVAILABLE",
    "LINE_BYTES",
    "VECTOR_BYTES",
    "aligned_head",
    "element_aligned",
    "flat_launch",
    "last_level_cache_bytes",
    "offered",
    "put_streaming",
    "ranked",
    "sfence",
    "takes",
    "store_normalized",
    "stream_threshold",
    "STREAM_MAX_THRESHOLD",
]

CODES = {"add": 0, "sub": 1, "mul": 2, "div": 3}
_INSTRUCTIONS = ("fadd", "fsub", "fmul", "fdiv")
VECTOR_BYTES = 32  # one ymm register: the widest store every x86-64 with AVX takes aligned
LINE_BYTES = 64  # a cache line, and the widest vector (zmm): ``put_streaming``'s claimed alignment
AVAILABLE = platform.machine().lower() in ("x86_64", "amd64")
DEFAULT_LLC = 32 << 20  # where the machine does not say (no sysfs)
# outputs from which streaming ranks first even where the last-level cache is larger: a server's L3 is shared by the
# socket's cores and tenants, and a process keeps a fraction of it. On an Intel Xeon reporting a 260 MiB L3 (2 vCPUs,
# the twenty-third session, /tmp/w23/add_stream.py and norm_stream.py, interleaved in one process) 64 MiB outputs ran
# faster streamed in every reading: add 1.17-1.34x, layer norm 1.12-1.34x, RMS norm 1.02-1.39x; 32 MiB ones were
# mixed (add 0.93x in one reading, 1.34x in another).
STREAM_MAX_THRESHOLD = 64 << 20


@functools.cache
def last_level_cache_bytes() -> int:
    """The size of the largest CPU cache Linux reports for cpu0 (``/sys/devices/system/cpu/cpu0/cache``), else
    ``DEFAULT_LLC``. Read once."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best or DEFAULT_LLC


def _code(code: Any) -> int | None:
    return code.literal_value if isinstance(code, types.IntegerLiteral) else None  # None: numba retries as literal


def _apply_typing(typingctx: Any, code: Any, x: Any, y: Any) -> Any:
    """``x op y`` for the op of literal ``code`` on two floats of one type, without fast-math flags."""
    c = _code(code)
    if c is None or not isinstance(x, types.Float) or x != y:
        return None
    sig = x(code, x, y)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return getattr(builder, _INSTRUCTIONS[c])(args[1], args[2])

    return sig, codegen


def _store_typing(typingctx: Any, code: Any, out: Any, a: Any, b: Any, i: Any) -> Any:
    """``out[i:i + lanes] = a[i:i + lanes] op b[i:i + lanes]``: two unaligned vector loads, the op, and one
    non-temporal vector store, which needs ``&out[i]`` aligned to ``VECTOR_BYTES`` (the caller's loop ensures it)."""
    c = _code(code)
    arrays = (out, a, b)
    if (
        c is None
        or not isinstance(i, types.Integer)
        or not all(isinstance(t, types.Array) and t.ndim == 1 and t.dtype == out.dtype for t in arrays)
        or not isinstance(out.dtype, types.Float)
    ):
        return None
    sig = types.void(code, out, a, b, i)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        size = context.get_abi_sizeof(context.get_value_type(out.dtype))
        vec = ir.VectorType(context.get_value_type(out.dtype), VECTOR_BYTES // size)
        index = context.cast(builder, args[4], signature.args[4], types.intp)

        def at(k: int) -> Any:
            arr = context.make_array(signature.args[k])(context, builder, args[k])
            return builder.bitcast(builder.gep(arr.data, [index]), vec.as_pointer())

        x = builder.load(at(2), align=size)
        y = builder.load(at(3), align=size)
        store = builder.store(getattr(builder, _INSTRUCTIONS[c])(x, y), at(1), align=VECTOR_BYTES)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return sig, codegen


def _normalized_typing(typingctx: Any, out: Any, x: Any, w: Any, b: Any, i: Any, mu: Any, r: Any, terms: Any) -> Any:
    """``out[i:i + lanes] = T(x - mu) * r * w + b`` over one vector, stored with a non-temporal store (``&out[i]``
    aligned to ``VECTOR_BYTES``): layer / RMS norm's write of a row (``norm._norm_row``), ``x - mu`` taken in
    float64 and rounded once to the data's type T, as the scalar loop does; ``r`` is a float64 rounded to T. All
    four arrays 1-D, of T, with unit stride. ``terms`` (``norm.WEIGHT`` | ``norm.BIAS``): which of ``* w`` and
    ``+ b`` apply; a constant in the calling kernel, so the loads of an absent one fold away."""
    arrays = (out, x, w, b)
    if (
        not all(isinstance(t, types.Array) and t.ndim == 1 and t.dtype == out.dtype for t in arrays)
        or not isinstance(out.dtype, types.Float)
        or not isinstance(i, types.Integer)
        or not isinstance(terms, types.Integer)
    ):
        return None
    sig = types.void(out, x, w, b, i, types.float64, types.float64, terms)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        elem = context.get_value_type(out.dtype)
        size = context.get_abi_sizeof(elem)
        lanes = VECTOR_BYTES // size
        vec = ir.VectorType(elem, lanes)
        wide = ir.VectorType(ir.DoubleType(), lanes)
        index = context.cast(builder, args[4], signature.args[4], types.intp)

        def at(k: int) -> Any:
            arr = context.make_array(signature.args[k])(context, builder, args[k])
            return builder.bitcast(builder.gep(arr.data, [index]), vec.as_pointer())

        def splat(value: Any, ty: Any) -> Any:
            v = builder.insert_element(ir.Constant(ty, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
            return builder.shuffle_vector(
                v, ir.Constant(ty, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
            )

        xs = builder.load(at(1), align=size)
        centred = builder.fsub(xs if size == 8 else builder.fpext(xs, wide), splat(args[5], wide))
        if size != 8:
            centred = builder.fptrunc(centred, vec)
        r = args[6] if size == 8 else builder.fptrunc(args[6], elem)
        y = builder.fmul(centred, splat(r, vec))
        terms = args[7]
        for bit, k, op in ((1, 2, builder.fmul), (2, 3, builder.fadd)):  # norm.WEIGHT, norm.BIAS
            bits = builder.and_(terms, ir.Constant(terms.type, bit))
            on = builder.icmp_unsigned("!=", bits, ir.Constant(terms.type, 0))
            y = builder.select(on, op(y, builder.load(at(k), align=size)), y)
        store = builder.store(y, at(0), align=VECTOR_BYTES)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return sig, codegen


def _sfence_typing(typingctx: Any) -> Any:
    """x86's ``sfence``: the streaming stores before it are visible to every thread before any store after it
    (the part's completion count)."""
    sig = types.void()

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        fn = builder.module.declare_intrinsic("llvm.x86.sse.sfence", fnty=ir.FunctionType(ir.VoidType(), []))
        builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


def _put_typing(typingctx: Any, out: Any, i: Any, v: Any) -> Any:
    """``out[i] = v`` as a non-temporal store that claims ``LINE_BYTES`` alignment, for a loop that LLVM widens: the
    loop vectorizer keeps the scalar store's metadata and alignment on its vector stores, which then become
    ``vmovntps`` / ``vmovntpd`` (it declines non-temporal stores it cannot prove aligned, and numba's arrays promise
    only their element size). The claim holds for each vector store, which is all the instruction needs, where
    ``out[0]`` is on a ``LINE_BYTES`` boundary and the loop's trip count a multiple of ``LINE_BYTES`` of elements
    (``aligned_head(out, n, LINE_BYTES)``): vectors of 16, 32 or 64 bytes then start on multiples of their own
    width. A scalar iteration left unwidened stores one element, non-temporally where the CPU has such a store."""
    if (
        not isinstance(out, types.Array)
        or out.ndim != 1
        or not isinstance(out.dtype, types.Float)
        or not isinstance(i, types.Integer)
    ):
        return None
    sig = types.void(out, i, v)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        index = context.cast(builder, args[1], signature.args[1], types.intp)
        value = context.cast(builder, args[2], signature.args[2], out.dtype)
        store = builder.store(value, builder.gep(arr.data, [index]), align=LINE_BYTES)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return sig, codegen


apply_op: Any = intrinsic(_apply_typing)
_store: Any = intrinsic(_store_typing)
sfence: Any = intrinsic(_sfence_typing)
store_normalized: Any = intrinsic(_normalized_typing)
put_streaming: Any = intrinsic(_put_typing)


@numba.njit(nogil=True, cache=True, inline="always")
def aligned_head(out: Any, n: int, width: int) -> int:
    """How many of the first ``n`` elements of ``out`` come before its first ``width``-byte-aligned one (the scalar
    head of a streaming loop: ``VECTOR_BYTES`` for the explicit vector stores, ``LINE_BYTES`` for
    ``put_streaming``'s; ``out`` must be aligned to its element size)."""
    head: int = ((-out.ctypes.data) & (width - 1)) // out.itemsize
    return min(head, n)


def offered(*descs: Any) -> bool:
    """Whether phase 1 may offer a streaming implementation for these operand descs (None: an absent optional
    operand): on x86, the first desc non-empty float32 / float64, and every desc contiguous."""
    first = descs[0]
    return (
        AVAILABLE
        and first.numel > 0
        and first.dtype.np in (np.float32, np.float64)
        and all(d is None or d.is_contiguous for d in descs)
    )


def element_aligned(out: Any) -> bool:
    """Whether ``out``'s memory starts on a multiple of its element size, from where the streaming loops reach a
    ``VECTOR_BYTES`` boundary (checked when a launch is bound: memory from outside the pool may not)."""
    return bool(out.ctypes.data % out.itemsize == 0)


def takes(operands: tuple[Any, ...], out: Any, in_place: bool) -> bool:
    """Whether bound memory takes a streaming kernel: ``out`` aligned to its element size, every array
    C-contiguous (which phase 1's contiguous descs rule out otherwise), and ``out`` apart from each operand, or
    that operand's own view when ``in_place`` (a stream of vector stores would read what it overwrote)."""
    return (
        element_aligned(out)
        and all(a.flags.c_contiguous for a in (*operands, out))
        and not any(np.may_share_memory(a, out) and not (in_place and same_view(a, out)) for a in operands)
    )


def flat_launch(kernel: Any, operands: tuple[Any, ...], out: Any, parts: int, grain: int) -> Callable[[Any], None]:
    """The launch of a streaming ``kernel(*operands, out)`` over the flat views of dense arrays (``takes``), cut
    into ``parts`` ranges of at least ``grain`` elements for helper threads."""
    flat = [a.reshape(-1) for a in (*operands, out)]
    fn = entry(kernel, *flat)
    ranges = split_range(out.size, parts, grain)
    return launcher([functools.partial(fn, *(a[lo:hi] for a in flat)) for lo, hi in ranges])


def stream_threshold() -> int:
    """Output bytes from which streaming stores rank first: the last-level cache's size (nothing of such an output
    could stay cached), at most ``STREAM_MAX_THRESHOLD``."""
    return min(last_level_cache_bytes(), STREAM_MAX_THRESHOLD)


def ranked(stream: Any, plain: Any, out_bytes: int) -> list[Any]:
    """Phase 1's order of a streaming implementation and its plain one: streaming first from outputs of
    ``stream_threshold()`` bytes, plain first below."""
    return [stream, plain] if out_bytes >= stream_threshold() else [plain, stream]


def _kernel(code: int) -> Any:
    """``run(a, b, out)`` over 1-D C-contiguous views of one float dtype: scalar elements up to the first
    ``VECTOR_BYTES``-aligned one of ``out``, whole vectors with streaming stores, then the scalar tail. ``out``
    may be ``a`` or ``b`` itself (each vector is loaded before it is stored), but no other overlap."""

    @numba.njit(nogil=True, cache=True, error_model="numpy")  # no fastmath: bitwise numpy's results
    def run(a: Any, b: Any, out: Any) -> None:
        n = out.shape[0]
        lanes = VECTOR_BYTES // out.itemsize
        head = aligned_head(out, n, VECTOR_BYTES)
        for i in range(head):
            out[i] = apply_op(code, a[i], b[i])
        i = head
        while i + lanes <= n:
            _store(code, out, a, b, i)
            i += lanes
        for j in range(i, n):
            out[j] = apply_op(code, a[j], b[j])
        sfence()

    return run


KERNELS = {name: _kernel(code) for name, code in CODES.items()}
