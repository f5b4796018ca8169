"""Compile numba kernels in phase 1 and call their entry points directly (no dispatch in phase 2)."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, overload
from numba.np.numpy_support import as_dtype, carray

from ...errors import InternalError

__all__ = [
    "entry",
    "any_layout",
    "rows_only",
    "CHECK_LAYOUT",
    "jit",
    "jit_inline",
    "jit_reduce",
    "FAST",
    "REDUCE",
    "row_of",
    "rows_dense",
    "by_density",
    "span_of",
    "pairs_of",
    "variant_call",
    "wide_vectors",
    "copy_run",
    "copy_even",
    "copy_phases",
    "copy_where",
    "emit_prefetch",
    "prefetch_l2",
    "emit_splat",
    "emit_lanes_below",
    "masked_memory",
    "TYPED_POINTERS",
    "host_cpu_name",
    "host_has",
    "SLOW_MASKED_STORES",
]

FAST = {"contract", "arcp", "nsz"}  # no nnan/ninf: NaN and inf must propagate
REDUCE = FAST | {"reassoc"}  # reductions may reorder sums (accumulators are wider than the data)
# error_model="numpy": a division by zero gives inf/nan instead of a Python exception branch, so loops vectorize
jit = numba.njit(nogil=True, cache=True, error_model="numpy", fastmath=FAST)
jit_reduce = numba.njit(nogil=True, cache=True, error_model="numpy", fastmath=REDUCE)
jit_inline = numba.njit(nogil=True, cache=True, error_model="numpy", fastmath=FAST, inline="always")


@functools.cache
def host_cpu_name() -> str:
    """LLVM's name for this host's CPU (``znver4``, ``sapphirerapids``, ...), read once: what the per-host tunings
    (``packing_pays``, ``half_width_fma``) go by."""
    return str(llvm.get_host_cpu_name())


@functools.cache
def host_has(*features: str) -> bool:
    """Whether numba compiles for this host (``NUMBA_CPU_NAME`` unset or ``host``) and it has every one of
    ``features`` (LLVM's names: ``avx512f``, ``avx2``, ``fma``, ...)."""
    if getattr(numba.config, "CPU_NAME", None) not in (None, "host"):
        return False
    found = llvm.get_host_cpu_features()
    return all(found.get(f) for f in features)


# pointer types in intrinsic names: "p0" + the pointee in LLVMs with typed pointers (LLVM 15: llvmlite 0.44, under
# numba 0.61), "p0" alone in those with opaque pointers only (LLVM 17 on; llvmlite 0.45 on brings LLVM 20 and up)
TYPED_POINTERS = llvm.llvm_version_info < (17,)


def emit_prefetch(builder: Any, ptr: Any, write: bool, locality: int) -> None:
    """IR for ``llvm.prefetch`` of the line at pointer ``ptr`` (locality 3: L1, 2: L2)."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
        builder.module,
        ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
        "llvm.prefetch.p0i8" if TYPED_POINTERS else "llvm.prefetch",
    )
    builder.call(
        fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, int(write)), ir.Constant(i32, locality), ir.Constant(i32, 1)]
    )


def _prefetch_typing(typingctx: Any, addr: Any) -> Any:
    """Prefetch the line at address ``addr`` into L2 (``llvm.prefetch``, read, locality 2)."""
    sig = types.void(types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        emit_prefetch(builder, builder.inttoptr(args[0], ir.IntType(8).as_pointer()), write=False, locality=2)
        return context.get_dummy_value()

    return sig, codegen


prefetch_l2: Any = intrinsic(_prefetch_typing)


def emit_splat(builder: Any, value: Any, vec: Any) -> Any:
    """IR of ``value`` in every lane of a vector of type ``vec``."""
    i32 = ir.IntType(32)
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), value, ir.Constant(i32, 0))
    return builder.shuffle_vector(
        one, ir.Constant(vec, ir.Undefined), ir.Constant(ir.VectorType(i32, vec.count), [0] * vec.count)
    )


def emit_lanes_below(builder: Any, n: Any, lanes: int) -> Any:
    """IR of the ``lanes``-wide i1 mask of the lanes < ``n`` (an i64, signed: none when n <= 0)."""
    i64 = ir.IntType(64)
    wanted = emit_splat(builder, n, ir.VectorType(i64, lanes))
    return builder.icmp_signed("<", ir.Constant(ir.VectorType(i64, lanes), list(range(lanes))), wanted)


def masked_memory(builder: Any, vec: Any) -> tuple[Any, Any]:
    """The ``llvm.masked.load`` / ``llvm.masked.store`` declarations for vectors of type ``vec`` (float, double or
    integer lanes); called as load(ptr, align, mask, passthru) and store(value, ptr, align, mask)."""
    n = vec.count
    el = vec.element
    elem = f"i{el.width}" if isinstance(el, ir.IntType) else "f64" if isinstance(el, ir.DoubleType) else "f32"
    types_ = f"v{n}{elem}.p0" + (f"v{n}{elem}" if TYPED_POINTERS else "")
    vptr, i32 = vec.as_pointer(), ir.IntType(32)
    mask = ir.VectorType(ir.IntType(1), n)
    load = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
        builder.module, ir.FunctionType(vec, [vptr, i32, mask, vec]), f"llvm.masked.load.{types_}"
    )
    store = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
        builder.module, ir.FunctionType(ir.VoidType(), [vec, vptr, i32, mask]), f"llvm.masked.store.{types_}"
    )
    return load, store


def _pointer_intrinsic(name: str, pointee: Callable[[Any], Any]) -> Any:
    """An intrinsic ``(a, k, col)`` -> the address of ``a[k, col]`` (no bounds check: callers index valid
    elements) as a pointer to ``pointee(a.dtype)`` (None: a dtype it does not take)."""

    def typing(typingctx: Any, a: Any, k: Any, col: Any) -> Any:
        target = pointee(a.dtype)
        if target is None:
            return None  # numba reports the signature as unsupported
        sig = types.CPointer(target)(a, k, col)  # type: ignore[no-untyped-call]

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            arr = context.make_array(signature.args[0])(context, builder, args[0])
            strides = cgutils.unpack_tuple(builder, arr.strides)  # type: ignore[no-untyped-call]
            index = context.cast(builder, args[1], signature.args[1], types.intp)
            column = context.cast(builder, args[2], signature.args[2], types.intp)
            offset = builder.add(builder.mul(index, strides[0]), builder.mul(column, strides[1]))
            byte = builder.gep(builder.bitcast(arr.data, cgutils.voidptr_t), [offset])
            return builder.bitcast(byte, context.get_value_type(signature.return_type))

        return sig, codegen

    typing.__name__ = typing.__qualname__ = name  # numba names the intrinsic after its typing function
    return intrinsic(typing)


def _wide_vectors_typing(typingctx: Any) -> Any:
    """Let LLVM vectorize the calling function's loops with 512-bit vectors where the CPU has them."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        # a string attribute, which llvmlite's attribute set refuses by name: added to the underlying set
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return types.void(), codegen


# ``wide_vectors()`` as a kernel's first statement: LLVM's x86 tuning for Intel's AVX-512 CPUs prefers 256-bit
# vectors, so numba's loops run on ymm registers there. The function attribute lifts that for one function (numba
# has no per-function option; NUMBA_CPU_FEATURES would change every numba function in the process). Measured on an
# Intel Xeon (twenty-third session, one thread, same bits): gelu 1.2x, SDPA's row pass 1.2-1.3x, softmax and
# layer_norm on rows in cache 1.05-1.26x, max over rows 1.07-1.29x, argmax 1.08-1.25x; column sums and maxima and
# var's moments no faster (left narrow).
# Without AVX-512 it changes nothing.
wide_vectors: Any = intrinsic(_wide_vectors_typing)


def _copy_run_typing(typingctx: Any, dst: Any, d0: Any, src: Any, s0: Any, n: Any) -> Any:
    """``dst[d0:d0 + n] = src[s0:s0 + n]`` for 1-D arrays of one dtype whose elements are adjacent (dense rows:
    the caller checks), by ``llvm.memcpy``: a short run (an unfolded row of a 7x7 map, ~49 floats) is copied in a
    few vector moves, where numba's loop, too short for its vector body, copied it one element at a time."""
    if not (
        isinstance(dst, types.Array)
        and isinstance(src, types.Array)
        and dst.ndim == src.ndim == 1
        and dst.dtype == src.dtype
    ):
        return None
    sig = types.void(dst, d0, src, s0, n)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        item = as_dtype(signature.args[0].dtype).itemsize

        def address(k: int) -> Any:
            arr = context.make_array(signature.args[k])(context, builder, args[k])
            index = context.cast(builder, args[k + 1], signature.args[k + 1], types.intp)
            return builder.gep(
                builder.bitcast(arr.data, cgutils.voidptr_t),
                [builder.mul(index, context.get_constant(types.intp, item))],
            )

        count = context.cast(builder, args[4], signature.args[4], types.intp)
        cgutils.raw_memcpy(builder, address(0), address(2), count, item)  # type: ignore[no-untyped-call]
        return context.get_dummy_value()

    return sig, codegen


copy_run: Any = intrinsic(_copy_run_typing)


@dataclass(frozen=True)
class _Lines:
    """What a masked line-by-line copy's IR works with: the vector type of 64 bytes of the arrays' dtype, its lane
    count, the masked load and store, their alignment, a zero vector, and the element pointers ``dst + d0`` and
    ``src + s0``."""

    vec: Any
    lanes: int
    load: Any
    store: Any
    align: Any
    zero: Any
    dst: Any
    src: Any


def _by_lines(
    context: Any, builder: Any, signature: Any, args: Any, step: Callable[[_Lines, Any, Any, bool], None]
) -> Any:
    """IR running ``step(lines, u0, rest, full)`` for u0 = 0, lanes, 2*lanes, ... below ``n`` (args 0-4: ``dst, d0,
    src, s0, n``), rest = n - u0: the loop of ``copy_even`` and ``copy_where``. ``full``: more than ``lanes``
    elements are left, so the step may load and store whole lines unmasked (a masked store is a microcoded
    vmaskmovps on AMD's AVX2 CPUs: these copies ran 1.45-1.6 ns a float there, 15x a plain copy); the last step, of
    1 to ``lanes`` elements, loads masked and stores masked or in pieces (``SLOW_MASKED_STORES``)."""
    item = as_dtype(signature.args[0].dtype).itemsize
    lanes = 64 // item
    vec = ir.VectorType(context.get_value_type(signature.args[0].dtype), lanes)
    load, store = masked_memory(builder, vec)
    i64 = ir.IntType(64)

    def at(k: int) -> Any:
        arr = context.make_array(signature.args[k])(context, builder, args[k])
        return builder.gep(arr.data, [context.cast(builder, args[k + 1], signature.args[k + 1], types.int64)])

    lines = _Lines(
        vec, lanes, load, store, ir.Constant(ir.IntType(32), item), ir.Constant(vec, [0.0] * lanes), at(0), at(2)
    )
    count = context.cast(builder, args[4], signature.args[4], types.int64)
    width = ir.Constant(i64, lanes)
    with builder.if_then(builder.icmp_signed(">", count, ir.Constant(i64, 0))):
        whole = builder.udiv(builder.sub(count, ir.Constant(i64, 1)), width)  # steps with more than lanes left
        with cgutils.for_range(builder, whole) as loop:
            u0 = builder.mul(loop.index, width)
            step(lines, u0, builder.sub(count, u0), True)
        u0 = builder.mul(whole, width)
        step(lines, u0, builder.sub(count, u0), False)
    return context.get_dummy_value()


def _float_rows(*arrays: Any) -> bool:
    """Whether the numba types are 1-D arrays of one dtype, float32 or float64."""
    return (
        all(isinstance(a, types.Array) and a.ndim == 1 for a in arrays)
        and arrays[0].dtype
        in (
            types.float32,
            types.float64,
        )
        and all(a.dtype == arrays[0].dtype for a in arrays)
    )


def _pair_at(builder: Any, v: _Lines, u0: Any, reads: Any, full: bool) -> tuple[Any, Any]:
    """The two 64-byte loads from ``src + s0 + 2 u0`` that hold the next ``lanes`` even and odd elements, only the
    first ``reads`` elements loaded (the rest 0; ``full``: all of them, unmasked): what ``copy_even`` and
    ``copy_phases`` shuffle."""
    i64 = ir.IntType(64)
    sp = builder.gep(v.src, [builder.add(u0, u0)])
    hp = builder.gep(sp, [ir.Constant(i64, v.lanes)])
    if full:
        return tuple(builder.load(builder.bitcast(p, v.vec.as_pointer()), align=v.align.constant) for p in (sp, hp))
    low = emit_lanes_below(builder, reads, v.lanes)
    lo = builder.call(v.load, [builder.bitcast(sp, v.vec.as_pointer()), v.align, low, v.zero])
    high = emit_lanes_below(builder, builder.sub(reads, ir.Constant(i64, v.lanes)), v.lanes)
    hi = builder.call(v.load, [builder.bitcast(hp, v.vec.as_pointer()), v.align, high, v.zero])
    return lo, hi


def _store_picked(builder: Any, v: _Lines, lo: Any, hi: Any, first: int, at: Any, count: Any, full: bool) -> None:
    """Store lanes ``first``, ``first + 2``, ... of the pair ``lo, hi`` at element pointer ``at``, the first
    ``count`` of them (masked; ``full``: all of them)."""
    picks = ir.Constant(ir.VectorType(ir.IntType(32), v.lanes), list(range(first, 2 * v.lanes, 2)))
    _store_line(builder, v, builder.shuffle_vector(lo, hi, picks), at, count, full)


# Whether a masked vector store is slow here: on CPUs without AVX-512 it is a vmaskmovps, microcoded on AMD's AVX2
# CPUs (with AVX-512, a cheap k-masked store). Where it is, the kernels that would store masked take another form:
# the copies store their last, partial line in pieces (``_store_line``), and ``vmath.maximum_stored`` takes the select
# form LLVM does not fold into a masked store. One thread, AMD Zen 3 (/tmp/w57/cw.py, ns a float, masked -> pieces):
# copy_even of 14 / 28 / 49 floats 0.58 / 0.33 / 0.22 -> 0.14 / 0.12 / 0.09, copy_where 0.90 / 0.47 / 0.30 -> 0.42 /
# 0.27 / 0.16; the unfold of 8 images of 64 -> 128 56^2 1x1 s2 0.47 -> 0.19 ms (/tmp/w58/uf.py). Default conv plans
# (im2col_tiles), two threads, 3 alternating pairs of processes, t(masked) / t(pieces) (/tmp/w58/dp.py of the
# fifty-eighth session): 8 x 64->128 1x1 s2 1.11-1.39, 8 x 64->128 s2 1.08-1.23, the stem 1.10-1.13 (8 images
# 1.06-1.18), 1 x 64->128 s2 1.04-1.11
SLOW_MASKED_STORES = not host_has("avx512f")


def _store_line(builder: Any, v: _Lines, x: Any, at: Any, count: Any, full: bool) -> None:
    """Store the line ``x`` at element pointer ``at``: its first ``count`` lanes (masked, or in pieces where
    ``SLOW_MASKED_STORES``), or all (``full``)."""
    dp = builder.bitcast(at, v.vec.as_pointer())
    if full:
        builder.store(x, dp, align=v.align.constant)
    elif SLOW_MASKED_STORES:
        _store_pieces(builder, v, x, at, count)
    else:
        builder.call(v.store, [x, dp, v.align, emit_lanes_below(builder, count, v.lanes)])


def _store_pieces(builder: Any, v: _Lines, x: Any, at: Any, count: Any) -> None:
    """Store the first ``count`` (1 to ``lanes``) lanes of ``x`` at element pointer ``at`` by plain stores: the
    whole line when ``count`` is ``lanes``, else ``x`` to a stack slot and from there a piece of ``lanes / 2``,
    ``lanes / 4``, ..., 1 elements for each bit of ``count``, each after the pieces of its higher bits."""
    i64 = ir.IntType(64)
    with builder.if_else(builder.icmp_signed("==", count, ir.Constant(i64, v.lanes))) as (whole, part):
        with whole:
            builder.store(x, builder.bitcast(at, v.vec.as_pointer()), align=v.align.constant)
        with part:
            slot = cgutils.alloca_once(builder, v.vec)  # type: ignore[no-untyped-call]
            builder.store(x, slot)
            line = builder.bitcast(slot, v.vec.element.as_pointer())
            b = v.lanes // 2
            while b:
                with builder.if_then(
                    builder.icmp_signed("!=", builder.and_(count, ir.Constant(i64, b)), ir.Constant(i64, 0))
                ):
                    pos = builder.and_(count, ir.Constant(i64, -2 * b))  # the lanes the higher bits' pieces hold
                    piece = (ir.VectorType(v.vec.element, b) if b > 1 else v.vec.element).as_pointer()
                    val = builder.load(builder.bitcast(builder.gep(line, [pos]), piece), align=v.align.constant)
                    builder.store(val, builder.bitcast(builder.gep(at, [pos]), piece), align=v.align.constant)
                b //= 2


def _copy_even_typing(typingctx: Any, dst: Any, d0: Any, src: Any, s0: Any, n: Any) -> Any:
    """``dst[d0:d0 + n] = src[s0:s0 + 2n:2]`` for dense 1-D float32 / float64 arrays of one dtype, 64 bytes of
    ``dst`` a step: two vector loads of ``src`` (the last step's masked: only the elements read), a shuffle taking
    their even elements, a store (``_by_lines``). A column-stride-2 unfolded row of a 14-wide map is one step,
    where numba's loop, too short for its vector body, copied it one element at a time."""
    if not _float_rows(dst, src):
        return None
    sig = types.void(dst, d0, src, s0, n)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        def step(v: _Lines, u0: Any, rest: Any, full: bool) -> None:
            reads = builder.sub(builder.add(rest, rest), ir.Constant(ir.IntType(64), 1))  # up to the last read
            lo, hi = _pair_at(builder, v, u0, reads, full)
            _store_picked(builder, v, lo, hi, 0, builder.gep(v.dst, [u0]), rest, full)

        return _by_lines(context, builder, signature, args, step)

    return sig, codegen


copy_even: Any = intrinsic(_copy_even_typing)


def _copy_phases_typing(typingctx: Any, dst: Any, d0: Any, src: Any, s0: Any, n0: Any, d1: Any, n1: Any) -> Any:
    """``dst[d0:d0 + n0] = src[s0:s0 + 2 n0:2]`` and ``dst[d1:d1 + n1] = src[s0 + 1:s0 + 1 + 2 n1:2]``
    (n0 - 1 <= n1 <= n0) for dense 1-D float32 / float64 arrays of one dtype: a row's even and odd elements (its
    two column phases) in one pass, both stores of a step fed by ``copy_even``'s two masked loads, where two
    ``copy_even`` calls load the row twice."""
    if not _float_rows(dst, src):
        return None
    sig = types.void(dst, d0, src, s0, n0, d1, n1)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        d_odd = builder.gep(arr.data, [context.cast(builder, args[5], signature.args[5], types.int64)])
        behind = builder.sub(  # how many fewer odd elements there are: 0 or 1
            context.cast(builder, args[4], signature.args[4], types.int64),
            context.cast(builder, args[6], signature.args[6], types.int64),
        )

        def step(v: _Lines, u0: Any, rest: Any, full: bool) -> None:
            odd_rest = builder.sub(rest, behind)  # (full: more than lanes even elements, so lanes odd ones or more)
            lo, hi = _pair_at(builder, v, u0, builder.add(rest, odd_rest), full)
            _store_picked(builder, v, lo, hi, 0, builder.gep(v.dst, [u0]), rest, full)
            _store_picked(builder, v, lo, hi, 1, builder.gep(d_odd, [u0]), odd_rest, full)

        return _by_lines(context, builder, signature, args, step)

    return sig, codegen


copy_phases: Any = intrinsic(_copy_phases_typing)


def _copy_where_typing(typingctx: Any, dst: Any, d0: Any, src: Any, s0: Any, n: Any, keep: Any, k0: Any) -> Any:
    """``dst[d0 + u] = src[s0 + u] if keep[k0 + u] else 0`` for ``u < n``: dense 1-D float32 / float64 arrays of
    one dtype and a boolean ``keep``, 64 bytes of ``dst`` a step (masked loads and stores: no scalar tail, no alias
    check). ``src`` is read only where ``keep`` holds, so a run may start or end next to memory it must not touch
    (an unfolded row of a 7-wide map is one step, where numba's loop ran its vector body once and then scalar)."""
    if not (_float_rows(dst, src) and isinstance(keep, types.Array) and keep.ndim == 1 and keep.dtype == types.boolean):
        return None
    sig = types.void(dst, d0, src, s0, n, keep, k0)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i8, i32 = ir.IntType(8), ir.IntType(32)
        keep = context.make_array(signature.args[5])(context, builder, args[5])
        first = context.cast(builder, args[6], signature.args[6], types.int64)
        kptr = builder.gep(builder.bitcast(keep.data, i8.as_pointer()), [first])

        def step(v: _Lines, u0: Any, rest: Any, full: bool) -> None:
            flags_t = ir.VectorType(i8, v.lanes)
            none = ir.Constant(flags_t, [0] * v.lanes)
            fp = builder.bitcast(builder.gep(kptr, [u0]), flags_t.as_pointer())
            if full:
                kept = builder.icmp_unsigned("!=", builder.load(fp, align=1), none)
            else:
                inside = emit_lanes_below(builder, rest, v.lanes)
                flags = builder.call(masked_memory(builder, flags_t)[0], [fp, ir.Constant(i32, 1), inside, none])
                kept = builder.and_(inside, builder.icmp_unsigned("!=", flags, none))
            sp = builder.bitcast(builder.gep(v.src, [u0]), v.vec.as_pointer())
            x = builder.call(v.load, [sp, v.align, kept, v.zero])  # (src only where kept, even in a full step)
            _store_line(builder, v, x, builder.gep(v.dst, [u0]), rest, full)

        return _by_lines(context, builder, signature, args, step)

    return sig, codegen


copy_where: Any = intrinsic(_copy_where_typing)


_element_pointer: Any = _pointer_intrinsic("_element_pointer", lambda dt: dt)
# float32 rows as complex64 (even, odd) pairs, float64 as complex128
_pairs_pointer: Any = _pointer_intrinsic(
    "_pairs_pointer", lambda dt: {types.float32: types.complex64, types.float64: types.complex128}.get(dt)
)


@numba.njit(nogil=True, cache=True, inline="always")
def row_of(a: Any, k: int, dense: bool) -> Any:
    """Row k of the matrix ``a``, typed dense when ``dense``: a compile-time constant at the call (the other
    branch is pruned, so the row has one type), true only when ``rows_dense(a)``. The dense row is a bare view
    of a's memory (``numba.carray``: no contiguity check, copy path or reference count, which cost ~20 ns a row,
    more than a 56-element row's work); ``a`` outlives it, as it is the caller's argument."""
    if dense:
        return carray(_element_pointer(a, k, 0), (a.shape[1],))
    return a[k]


@numba.njit(nogil=True, cache=True, inline="always")
def pairs_of(a: Any, k: int, first: int, n: int) -> Any:
    """Row k of the float32 / float64 matrix ``a`` from column ``first`` on as n (even, odd) element pairs, one
    complex number each: a loop reading x[2u] and x[2u + 1] then loads whole vectors and shuffles them apart
    (LLVM turns the same reads from the float row into gathers). The row must be dense and hold 2n elements
    from ``first``, which the caller checks."""
    return carray(_pairs_pointer(a, k, first), (n,))


@numba.njit(nogil=True, cache=True, inline="always")
def span_of(a: Any, k: int, n: int) -> Any:
    """The n elements from ``a[k, 0]`` on as one dense 1-D view: valid only where a's rows lie back to back
    (dense rows, row stride = row length), which the caller checks."""
    return carray(_element_pointer(a, k, 0), (n,))


def rows_dense(*arrays: Any) -> bool:
    """Whether the rows (along the last dim) of every array have adjacent elements: their loops then vectorize
    taken through ``row_of``, also when an array is typed strided (the rows of a slice of a wider array, a crop
    of wider images). Phase 1 picks a ``by_density`` variant with it."""
    return all(a.strides[-1] == a.itemsize or a.shape[-1] <= 1 for a in arrays)


def by_density(make: Callable[[bool], Any]) -> dict[bool, Any]:
    """Both variants of a kernel made with ``dense`` as a closure constant (its row code typed one way only);
    phase 1 picks one with ``rows_dense``, so only that one is compiled (compiling both in one kernel, behind a
    run-time test, doubled the compile time of the group-norm kernels when they were numba ``prange`` loops)."""
    return {dense: make(dense) for dense in (True, False)}


def variant_call(variants: tuple[Any, ...]) -> Callable[..., Any]:
    """``call(i, *args)``, which runs ``variants[i](*args)``: for a kernel calling one of several kernels chosen by a
    closure constant ``i``. The variant is picked from the literal when the calling kernel is typed, and compiled
    and cached on its own, as a direct call would be. A kernel that closed over the variant itself would miss
    numba's cache in every process: the cache key holds a pickle of the closure, and a kernel pickles with a
    per-process id."""

    def call(i: int, *args: Any) -> Any:
        return variants[i](*args)

    @overload(call)
    def _typed(i: Any, *args: Any) -> Any:
        if not isinstance(i, types.IntegerLiteral):
            return None  # numba then retries with the literal type of the constant
        kernel = variants[i.literal_value]

        def impl(i: Any, *args: Any) -> Any:  # the stub's signature, annotations included (numba checks)
            return kernel(*args)

        return impl

    return call


def _numba_type(a: Any) -> Any:
    t = numba.typeof(a)  # type: ignore[no-untyped-call]
    if isinstance(a, np.ndarray):
        return t.copy(layout="C" if a.flags.c_contiguous else "A", readonly=False)
    return t


_entries: dict[Any, Callable[..., Any]] = {}


def _short_key(a: Any) -> Any:
    if isinstance(a, np.ndarray):
        return (a.dtype.num, a.ndim, a.flags.c_contiguous)
    return type(a)


def entry(kernel: Any, *args: Any) -> Callable[..., Any]:
    """Compile ``kernel`` for the types of ``args`` and return its entry point (arrays typed 'C' when
    C-contiguous, so inner loops vectorize, else 'A'). Memoised on a cheap type key.

    The entry point does not check its arguments: an array typed 'C' must be C-contiguous at every call, or the
    kernel indexes it with the wrong strides. Compile with an :func:`any_layout` sample where later calls may pass
    views; the parameters a kernel marks :func:`rows_only` are typed 'A' whatever the sample (one compile). With
    ``CHECK_LAYOUT`` on (``TWOPHASE_CHECK_KERNEL_LAYOUT=1``, as the test suite runs) every call is checked and a
    mismatch raises ``InternalError``."""
    free = getattr(kernel, "rows_only", ())
    if free:
        args = tuple(
            any_layout(a.dtype, a.ndim) if i in free and isinstance(a, np.ndarray) else a for i, a in enumerate(args)
        )
    key = (kernel, *map(_short_key, args))
    fn = _entries.get(key)
    if fn is None:
        fn = _entries[key] = kernel.compile(tuple(_numba_type(a) for a in args))
    if CHECK_LAYOUT:
        dense = tuple(i for i, a in enumerate(args) if isinstance(a, np.ndarray) and a.flags.c_contiguous)
        return _layout_checked(kernel, fn, dense)
    return fn


CHECK_LAYOUT = os.environ.get("TWOPHASE_CHECK_KERNEL_LAYOUT", "0") not in ("", "0")


def any_layout(dtype: Any, ndim: int) -> Any:
    """A sample array that ``entry`` types 'A' (any layout): for arguments that may be views."""
    sample = np.empty((2,) * (ndim - 1) + (4,), dtype)[..., ::2] if ndim else np.empty((), dtype)
    assert ndim == 0 or not sample.flags.c_contiguous
    return sample


def rows_only(*names: str) -> Callable[[Any], Any]:
    """Marks a kernel's array parameters ``names`` as read and written only by rows (``row_of``), spans
    (``span_of``), pointers and strides: code that is the same whatever their layout type, so :func:`entry` types
    them 'A' (an :func:`any_layout` sample of theirs) for every sample. A 'C' type there would change no loop and
    only cost one more compile (seconds to tens of seconds each) for contiguous operands next to views; this way
    one compile serves both. Marked where the kernel is defined: it is its indexing that makes the layout
    irrelevant."""

    def mark(kernel: Any) -> Any:
        params = list(inspect.signature(kernel.py_func).parameters)
        kernel.rows_only = frozenset(params.index(name) for name in names)  # ValueError for a name it lacks
        return kernel

    return mark


def _layout_checked(kernel: Any, fn: Callable[..., Any], dense: tuple[int, ...]) -> Callable[..., Any]:
    """``fn`` behind a check that the arguments compiled as 'C' arrays are C-contiguous at the call."""

    def checked(*args: Any) -> Any:
        for i in dense:
            if not args[i].flags.c_contiguous:
                raise InternalError(
                    f"kernel {kernel.__name__} was compiled for a C-contiguous argument {i} and "
                    f"called with strides {args[i].strides} for shape {args[i].shape}",
                    arg=f"argument {i}",
                    expected="a C-contiguous array",
                )
        return fn(*args)

    return checked
