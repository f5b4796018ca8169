"""Reductions of dense float32 / float64 spans written as LLVM IR: whole-vector loads and software prefetch.

numba's loop for ``acc += float64(v[i])`` over float32 widens 32-byte halves straight from memory (``vcvtps2pd
zmm, [mem]``): half as many bytes per load as a float32 loop, and on the Intel Xeon of the twenty-fifth session
it read a 64 MiB array 1.45-1.6x slower than ``np.max`` of its int32 view did, 1.1-1.3x in cache
(``/tmp/w25/acc2.py``). Here each step loads whole 64-byte vectors into several accumulators (independent
dependency chains) and prefetches the lines ``AHEAD`` bytes on, which the hardware prefetcher, stopping at every
4 KiB page, did not keep up with: the same 64 MiB then took 1.03-1.04x ``np.max``'s time, and a span in
cache 1.1x faster than numba's loop (``/tmp/w25/ir.py``). The max / min spans gain on short rows, where numba's
reduction of ``llvm.maximum`` ended each 64-float row with a long horizontal tail.

The span intrinsics cover the whole ``BULK``-element steps of a span; the caller's loop does the rest. The column
intrinsics reduce rows 1, 2, 4 or 8 vectors wide lying back to back (a reduction over a leading dim), one row a
step, into accumulators that stay in registers. A prefetch never faults, so the lines ahead of a span's end (a
dense matrix's next rows) are prefetched too. Each entry point is a numba ``overload`` that falls back (nothing
done) for other dtypes, strided spans or other widths, so the callers' numba loops stay the general path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

from .jit import emit_prefetch, emit_splat, jit_inline

__all__ = [
    "BULK",
    "AHEAD",
    "span_sum",
    "span_moments",
    "bulk_sum",
    "bulk_moments",
    "bulk_extremum",
    "bulk_first",
    "bulk_column_sums",
    "bulk_column_extrema",
    "COLUMN_VECTORS",
]

BULK = 32  # elements per step: two 16-float vectors, or four 8-double ones
AHEAD = 16384  # bytes between the step's first line and the lines it prefetches
_F64, _I64, _I32 = ir.DoubleType(), ir.IntType(64), ir.IntType(32)
_V8D = ir.VectorType(_F64, 8)

Combine = Callable[[Any, Any, Any], Any]  # (builder, a, b) -> IR of a (+) b


def _lanes(builder: Any, vec: Any, first: int, n: int) -> Any:
    """Lanes ``first .. first + n - 1`` of ``vec`` as a vector of n."""
    return builder.shuffle_vector(
        vec, ir.Constant(vec.type, ir.Undefined), ir.Constant(ir.VectorType(_I32, n), list(range(first, first + n)))
    )


def _horizontal(builder: Any, accs: list[Any], combine: Combine) -> Any:
    """All lanes of the accumulators combined: pairwise, then halving the vector."""
    while len(accs) > 1:
        accs = [combine(builder, accs[i], accs[i + 1]) for i in range(0, len(accs), 2)]
    v, n = accs[0], accs[0].type.count
    while n > 1:
        n //= 2
        v = combine(builder, _lanes(builder, v, 0, n), _lanes(builder, v, n, n))
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _emit_steps(
    builder: Any,
    data: Any,
    elem: Any,
    steps: Any,
    vectors: int,
    inits: list[Any],
    step: Callable[[list[Any], list[Any]], list[Any]],
) -> list[Any]:
    """IR of a loop over ``steps`` steps of ``vectors`` 64-byte vectors each, back to back from the element pointer
    ``data`` (float or double): the accumulator vectors start as ``inits``; each step prefetches the lines
    ``AHEAD`` bytes on, loads its vectors and maps (accumulators, vectors) to the next accumulators. Returns their
    final values."""
    size = 8 if elem == _F64 else 4
    per = 64 // size  # elements per 64-byte vector: 16 floats or 8 doubles
    vec = ir.VectorType(elem, per)
    pre = builder.block
    loop = builder.function.append_basic_block("span_steps")
    after = builder.function.append_basic_block("span_steps_done")
    builder.cbranch(builder.icmp_signed(">", steps, ir.Constant(_I64, 0)), loop, after)

    builder.position_at_end(loop)
    index = builder.phi(_I64)
    accs = [builder.phi(a.type) for a in inits]
    first = builder.gep(data, [builder.mul(index, ir.Constant(_I64, vectors * per))])
    ahead = builder.gep(first, [ir.Constant(_I64, AHEAD // size)])
    for line in range(vectors):
        emit_prefetch(builder, builder.gep(ahead, [ir.Constant(_I64, line * per)]), write=False, locality=3)
    loaded = [
        builder.load(builder.bitcast(builder.gep(first, [ir.Constant(_I64, line * per)]), vec.as_pointer()), align=size)
        for line in range(vectors)
    ]
    grown = step(accs, loaded)
    following = builder.add(index, ir.Constant(_I64, 1))
    end = builder.block
    builder.cbranch(builder.icmp_signed("<", following, steps), loop, after)
    index.add_incoming(ir.Constant(_I64, 0), pre)
    index.add_incoming(following, end)
    for acc, init, g in zip(accs, inits, grown):
        acc.add_incoming(init, pre)
        acc.add_incoming(g, end)

    builder.position_at_end(after)
    finals = [builder.phi(a.type) for a in inits]  # every phi ahead of the block's other code
    for f, init, g in zip(finals, inits, grown):
        f.add_incoming(init, pre)
        f.add_incoming(g, end)
    return finals


def _bulk_steps(builder: Any, elem: Any, n: Any) -> tuple[Any, int]:
    """(the number of whole ``BULK``-element steps in n, 64-byte vectors per step)."""
    return builder.sdiv(n, ir.Constant(_I64, BULK)), BULK * (8 if elem == _F64 else 4) // 64


def _widened(builder: Any, vectors: list[Any]) -> list[Any]:
    """The step's vectors as <8 x double>: float32 vectors widened half by half (four of them either way)."""
    if vectors[0].type.count == 8:
        return vectors
    return [builder.fpext(_lanes(builder, v, h * 8, 8), _V8D) for v in vectors for h in (0, 1)]


def _fadd(builder: Any, a: Any, b: Any) -> Any:
    return builder.fadd(a, b)


def _emit_sums(builder: Any, data: Any, elem: Any, n: Any, shift: Any | None) -> list[Any]:
    """[the float64 sum] of the steps' elements, or with a ``shift`` (a double) [sum of y, sum of y * y] for
    y = x - shift: four <8 x double> accumulators per sum."""
    zero = ir.Constant(_V8D, [0.0] * 8)
    if shift is None:

        def add(accs: list[Any], vectors: list[Any]) -> list[Any]:
            return [builder.fadd(a, h) for a, h in zip(accs, _widened(builder, vectors))]

        return [
            _horizontal(
                builder, _emit_steps(builder, data, elem, *_bulk_steps(builder, elem, n), [zero] * 4, add), _fadd
            )
        ]
    centre = emit_splat(builder, shift, _V8D)

    def moments(accs: list[Any], vectors: list[Any]) -> list[Any]:
        ys = [builder.fsub(h, centre) for h in _widened(builder, vectors)]
        return [builder.fadd(a, y) for a, y in zip(accs[:4], ys)] + [
            builder.fadd(a, builder.fmul(y, y)) for a, y in zip(accs[4:], ys)
        ]

    finals = _emit_steps(builder, data, elem, *_bulk_steps(builder, elem, n), [zero] * 8, moments)
    return [_horizontal(builder, finals[:4], _fadd), _horizontal(builder, finals[4:], _fadd)]


def _dense_float(v: Any) -> bool:
    return isinstance(v, types.Array) and v.ndim == 1 and v.layout == "C" and v.dtype in (types.float32, types.float64)


def _start(context: Any, builder: Any, signature: Any, args: Any) -> tuple[Any, Any, Any]:
    """(pointer to v[lo], the element's IR type, n as i64) of an intrinsic's ``(v, lo, n, ...)``."""
    arr = context.make_array(signature.args[0])(context, builder, args[0])
    lo = context.cast(builder, args[1], signature.args[1], types.int64)
    n = context.cast(builder, args[2], signature.args[2], types.int64)
    elem = ir.FloatType() if signature.args[0].dtype == types.float32 else _F64
    return builder.gep(arr.data, [lo]), elem, n


def _sum_steps_typing(typingctx: Any, v: Any, lo: Any, n: Any) -> Any:
    """The float64 sum of v[lo : lo + n // BULK * BULK] (a dense float32 / float64 span)."""
    if not _dense_float(v):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data, elem, count = _start(context, builder, signature, args)
        return _emit_sums(builder, data, elem, count, None)[0]

    return types.float64(v, lo, n), codegen


_sum_steps: Any = intrinsic(_sum_steps_typing)


def _moment_steps_typing(typingctx: Any, v: Any, lo: Any, n: Any, shift: Any) -> Any:
    """(sum of y, sum of y * y) in float64 over v[lo : lo + n // BULK * BULK], y = x - shift."""
    if not _dense_float(v):
        return None
    pair = types.UniTuple(types.float64, 2)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data, elem, count = _start(context, builder, signature, args)
        centre = context.cast(builder, args[3], signature.args[3], types.float64)
        s, q = _emit_sums(builder, data, elem, count, centre)
        return context.make_tuple(builder, pair, (s, q))

    return pair(v, lo, n, shift), codegen


_moment_steps: Any = intrinsic(_moment_steps_typing)


def _pick(pred: str) -> Combine:
    """The plain compare-and-select extremum (one ``vmaxps`` / ``vminps``): "ogt" max, "olt" min; NaN loses."""

    def pick(builder: Any, a: Any, b: Any) -> Any:
        return builder.select(builder.fcmp_ordered(pred, a, b), a, b)

    return pick


def _extremum_step(builder: Any, pred: str) -> Callable[[list[Any], list[Any]], list[Any]]:
    """The step of NaN-propagating extrema: accumulators [values..., NaN masks...], one of each per vector; a
    vector's values are picked in, its NaNs added to its mask."""
    pick = _pick(pred)

    def step(accs: list[Any], vectors: list[Any]) -> list[Any]:
        k = len(vectors)
        return [pick(builder, x, a) for a, x in zip(accs[:k], vectors)] + [
            builder.or_(m, builder.fcmp_unordered("uno", x, x)) for m, x in zip(accs[k:], vectors)
        ]

    return step


def _with_masks(builder: Any, values: list[Any]) -> list[Any]:
    """Extremum accumulators starting at ``values``: the values and their NaN masks."""
    return values + [builder.fcmp_unordered("uno", v, v) for v in values]


def _extremum_steps(pred: str) -> Any:
    """An intrinsic ``(v, lo, n, m)``: the max (``pred`` "ogt") or min ("olt") of m and the elements of
    v[lo : lo + n // BULK * BULK], NaN if any of them is NaN. The accumulators keep the plain compare-and-select
    extremum and masks of the NaNs seen; ``llvm.maximum`` costs several instructions a vector on x86, and its
    horizontal tail ended a 64-float row with a long dependent chain. -0.0 and +0.0 may come out in either order."""

    def typing(typingctx: Any, v: Any, lo: Any, n: Any, m: Any) -> Any:
        if not _dense_float(v) or m != v.dtype:
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            data, elem, count = _start(context, builder, signature, args)
            steps, k = _bulk_steps(builder, elem, count)
            first = emit_splat(builder, args[3], ir.VectorType(elem, 8 if elem == _F64 else 16))
            finals = _emit_steps(
                builder, data, elem, steps, k, _with_masks(builder, [first] * k), _extremum_step(builder, pred)
            )
            seen = finals[k]
            for mask in finals[k + 1 :]:
                seen = builder.or_(seen, mask)
            bits = builder.bitcast(seen, ir.IntType(seen.type.count))
            return builder.select(
                builder.icmp_unsigned("!=", bits, ir.Constant(bits.type, 0)),
                ir.Constant(elem, float("nan")),
                _horizontal(builder, finals[:k], _pick(pred)),
            )

        return m(v, lo, n, m), codegen

    # numba names the intrinsic after its typing function
    typing.__name__ = typing.__qualname__ = f"_{pred}_steps"
    return intrinsic(typing)


_max_steps, _min_steps = _extremum_steps("ogt"), _extremum_steps("olt")


def _first_steps_typing(typingctx: Any, v: Any, lo: Any, n: Any, m: Any) -> Any:
    """The offset from lo of the first element of v[lo : lo + n // BULK * BULK] equal to m (the first NaN when m
    is NaN), or n // BULK * BULK when there is none: a search by 64-byte vectors that stops at the first hit."""
    if not _dense_float(v) or m != v.dtype:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data, elem, count = _start(context, builder, signature, args)
        per = 8 if elem == _F64 else 16
        vec, mask = ir.VectorType(elem, per), ir.IntType(per)
        target = emit_splat(builder, args[3], vec)
        want_nan = builder.fcmp_unordered("uno", target, target)  # all lanes alike
        vectors = builder.mul(builder.sdiv(count, ir.Constant(_I64, BULK)), ir.Constant(_I64, BULK // per))
        done = builder.mul(vectors, ir.Constant(_I64, per))
        pre = builder.block
        fn = builder.function
        loop, next_, hit, out = (fn.append_basic_block(f"span_first_{k}") for k in ("loop", "next", "hit", "out"))
        builder.cbranch(builder.icmp_signed(">", vectors, ir.Constant(_I64, 0)), loop, out)

        builder.position_at_end(loop)
        index = builder.phi(_I64)
        x = builder.load(
            builder.bitcast(builder.gep(data, [builder.mul(index, ir.Constant(_I64, per))]), vec.as_pointer()),
            align=8 if elem == _F64 else 4,
        )
        found = builder.or_(
            builder.fcmp_ordered("oeq", x, target), builder.and_(want_nan, builder.fcmp_unordered("uno", x, x))
        )
        bits = builder.bitcast(found, mask)
        builder.cbranch(builder.icmp_unsigned("!=", bits, ir.Constant(mask, 0)), hit, next_)

        builder.position_at_end(next_)
        following = builder.add(index, ir.Constant(_I64, 1))
        builder.cbranch(builder.icmp_signed("<", following, vectors), loop, out)
        index.add_incoming(ir.Constant(_I64, 0), pre)
        index.add_incoming(following, next_)

        builder.position_at_end(hit)
        cttz = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(mask, [mask, ir.IntType(1)]),  # type: ignore[no-untyped-call]
            f"llvm.cttz.i{per}",
        )
        lane = builder.zext(builder.call(cttz, [bits, ir.Constant(ir.IntType(1), 1)]), _I64)
        at = builder.add(builder.mul(index, ir.Constant(_I64, per)), lane)
        builder.branch(out)

        builder.position_at_end(out)
        result = builder.phi(_I64)
        result.add_incoming(done, pre)
        result.add_incoming(done, next_)
        result.add_incoming(at, hit)
        return result

    return types.int64(v, lo, n, m), codegen


_first_steps: Any = intrinsic(_first_steps_typing)


COLUMN_VECTORS = (1, 2, 4, 8)  # row widths, in 64-byte vectors, whose columns are reduced in registers


def _emit_columns(builder: Any, data: Any, elem: Any, rows: Any, out: Any, vectors: int, kind: str) -> None:
    """IR reducing the columns of ``rows`` rows of ``vectors`` 64-byte vectors each into the accumulator array at
    ``out`` (see ``_columns``)."""
    vec = _V8D if kind == "sum" else ir.VectorType(elem, 8 if elem == _F64 else 16)
    width = vectors * (8 if elem == _F64 else 16)
    slots = [
        builder.bitcast(builder.gep(out, [ir.Constant(_I64, vec.count * k)]), vec.as_pointer())
        for k in range(width // vec.count)
    ]
    align = 8 if vec.element == _F64 else 4
    starts = [builder.load(slot, align=align) for slot in slots]
    if kind == "sum":
        finals = _emit_steps(
            builder,
            data,
            elem,
            rows,
            vectors,
            starts,
            lambda accs, loaded: [builder.fadd(a, h) for a, h in zip(accs, _widened(builder, loaded))],
        )
    else:
        finals = _emit_steps(
            builder, data, elem, rows, vectors, _with_masks(builder, starts), _extremum_step(builder, kind)
        )
        nan = ir.Constant(vec, [float("nan")] * vec.count)
        finals = [builder.select(m, nan, f) for f, m in zip(finals[: len(slots)], finals[len(slots) :])]
    for slot, f in zip(slots, finals):
        builder.store(f, slot, align=align)


def _columns(kind: str) -> Any:
    """An intrinsic ``(v, lo, rows, width, acc) -> bool`` over rows of ``width`` elements lying back to back from
    v[lo]: ``kind`` "sum": acc[c] += the float64 sum of column c (acc float64); "ogt" / "olt": acc[c] = the max /
    min of acc[c] and column c, NaN winning (acc of the data's dtype). Rows of ``COLUMN_VECTORS`` 64-byte vectors
    only (one loop each, picked by a switch on the width; false for any other width, acc untouched): their
    accumulators stay in registers across the rows (numba's loop over a column block loaded and stored its
    accumulator array every few rows); the rows ``AHEAD`` bytes on are prefetched."""

    def typing(typingctx: Any, v: Any, lo: Any, rows: Any, width: Any, acc: Any) -> Any:
        want = types.float64 if kind == "sum" else getattr(v, "dtype", None)
        if not (
            _dense_float(v)
            and isinstance(acc, types.Array)
            and acc.dtype == want
            and acc.layout == "C"
            and acc.ndim == 1
        ):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            data, elem, count = _start(context, builder, signature, args)
            out = context.make_array(signature.args[4])(context, builder, args[4]).data
            per = 8 if elem == _F64 else 16
            fn = builder.function
            other, done = fn.append_basic_block("columns_other"), fn.append_basic_block("columns_done")
            switch = builder.switch(context.cast(builder, args[3], signature.args[3], types.int64), other)
            ends = []
            for vectors in COLUMN_VECTORS:
                case = fn.append_basic_block(f"columns_{vectors}")
                switch.add_case(ir.Constant(_I64, vectors * per), case)
                builder.position_at_end(case)
                _emit_columns(builder, data, elem, count, out, vectors, kind)
                ends.append(builder.block)
                builder.branch(done)
            builder.position_at_end(other)
            builder.branch(done)
            builder.position_at_end(done)
            took = builder.phi(ir.IntType(1))
            for end in ends:
                took.add_incoming(ir.Constant(ir.IntType(1), 1), end)
            took.add_incoming(ir.Constant(ir.IntType(1), 0), other)
            return took

        return types.boolean(v, lo, rows, width, acc), codegen

    typing.__name__ = typing.__qualname__ = f"_columns_{kind}"  # numba names the intrinsic after it
    return intrinsic(typing)


_column_sums, _column_maxima, _column_minima = _columns("sum"), _columns("ogt"), _columns("olt")


def bulk_sum(v: Any, lo: int, n: int, zero: Any) -> tuple[Any, int]:
    """(the sum of the first ``done`` elements of v[lo : lo + n] added to ``zero``, done): the whole steps of a
    dense float span when ``zero`` is a float64, else nothing (0 done). In jitted code only."""
    raise NotImplementedError("bulk_sum runs in jitted code")


def bulk_moments(v: Any, lo: int, n: int, shift: float) -> tuple[float, float, int]:
    """(sum of y, sum of y * y, done) over the first ``done`` elements of v[lo : lo + n], y = x - shift: the whole
    steps of a dense float span, else nothing (0 done). In jitted code only."""
    raise NotImplementedError("bulk_moments runs in jitted code")


def bulk_extremum(v: Any, lo: int, n: int, sign: Any, m: Any) -> tuple[Any, int]:
    """(the max (``sign`` > 0) or min of m and the first ``done`` elements of v[lo : lo + n], NaN winning, done):
    the whole steps of a dense float span, else (m, 0). In jitted code only."""
    raise NotImplementedError("bulk_extremum runs in jitted code")


def bulk_first(v: Any, lo: int, n: int, m: Any) -> tuple[int, int]:
    """(the offset from lo of the first element of v[lo : lo + done] equal to m, or of the first NaN when m is NaN;
    done when there is none, done): the whole steps of a dense float span, else (0, 0). In jitted code only."""
    raise NotImplementedError("bulk_first runs in jitted code")


def bulk_column_sums(v: Any, lo: int, rows: int, width: int, acc: Any) -> bool:
    """Whether acc[0:width] got the float64 column sums of the ``rows`` rows of ``width`` elements lying back to
    back in v from v[lo] on added: only for a dense float span of rows of 1, 2, 4 or 8 64-byte vectors (16 to 128
    float32, 8 to 64 float64), else acc is left as it is. In jitted code only."""
    raise NotImplementedError("bulk_column_sums runs in jitted code")


def bulk_column_extrema(v: Any, lo: int, rows: int, width: int, sign: Any, acc: Any) -> bool:
    """Whether acc[0:width] became the max (``sign`` > 0) or min of itself and the columns of the ``rows`` rows of
    ``width`` elements lying back to back in v from v[lo] on, NaN winning: for the rows ``bulk_column_sums``
    takes, with acc of v's dtype, else acc is left as it is. In jitted code only."""
    raise NotImplementedError("bulk_column_extrema runs in jitted code")


@overload(bulk_sum, inline="always")
def _bulk_sum(v: Any, lo: int, n: int, zero: Any) -> Any:  # annotated as the implementations (numba checks)
    if _dense_float(v) and zero == types.float64:

        def fast(v: Any, lo: int, n: int, zero: Any) -> tuple[Any, int]:
            return zero + _sum_steps(v, lo, n), n - n % BULK

        return fast

    def none(v: Any, lo: int, n: int, zero: Any) -> tuple[Any, int]:
        return zero, 0

    return none


@overload(bulk_moments, inline="always")
def _bulk_moments(v: Any, lo: int, n: int, shift: float) -> Any:
    if _dense_float(v):

        def fast(v: Any, lo: int, n: int, shift: float) -> tuple[float, float, int]:
            s, q = _moment_steps(v, lo, n, shift)
            return s, q, n - n % BULK

        return fast

    def none(v: Any, lo: int, n: int, shift: float) -> tuple[float, float, int]:
        return 0.0, 0.0, 0

    return none


@overload(bulk_extremum, inline="always")
def _bulk_extremum(v: Any, lo: int, n: int, sign: Any, m: Any) -> Any:
    if _dense_float(v) and m == v.dtype:

        def fast(v: Any, lo: int, n: int, sign: Any, m: Any) -> tuple[Any, int]:
            done = n - n % BULK
            if sign > 0:
                return _max_steps(v, lo, n, m), done
            return _min_steps(v, lo, n, m), done

        return fast

    def none(v: Any, lo: int, n: int, sign: Any, m: Any) -> tuple[Any, int]:
        return m, 0

    return none


@overload(bulk_first, inline="always")
def _bulk_first(v: Any, lo: int, n: int, m: Any) -> Any:
    if _dense_float(v) and m == v.dtype:

        def fast(v: Any, lo: int, n: int, m: Any) -> tuple[int, int]:
            return _first_steps(v, lo, n, m), n - n % BULK

        return fast

    def none(v: Any, lo: int, n: int, m: Any) -> tuple[int, int]:
        return 0, 0

    return none


@overload(bulk_column_sums, inline="always")
def _bulk_column_sums(v: Any, lo: int, rows: int, width: int, acc: Any) -> Any:
    if _dense_float(v) and isinstance(acc, types.Array) and acc.dtype == types.float64:

        def fast(v: Any, lo: int, rows: int, width: int, acc: Any) -> bool:
            return _column_sums(v, lo, rows, width, acc)  # type: ignore[no-any-return]

        return fast

    def none(v: Any, lo: int, rows: int, width: int, acc: Any) -> bool:
        return False

    return none


@overload(bulk_column_extrema, inline="always")
def _bulk_column_extrema(v: Any, lo: int, rows: int, width: int, sign: Any, acc: Any) -> Any:
    if _dense_float(v) and isinstance(acc, types.Array) and acc.dtype == v.dtype:

        def fast(v: Any, lo: int, rows: int, width: int, sign: Any, acc: Any) -> bool:
            if sign > 0:
                return _column_maxima(v, lo, rows, width, acc)  # type: ignore[no-any-return]
            return _column_minima(v, lo, rows, width, acc)  # type: ignore[no-any-return]

        return fast

    def none(v: Any, lo: int, rows: int, width: int, sign: Any, acc: Any) -> bool:
        return False

    return none


# Whole spans: the IR's steps, then the caller-side rest in a numba loop (unsigned indices: a signed one gets
# numba's negative-index wrap-around select, which turns vector loads into gathers). Inlined: they take the
# calling kernel's fast-math flags.
@jit_inline
def span_sum(v: Any, lo: int, n: int, zero: Any) -> Any:
    """``zero`` + the sum of v[lo : lo + n], accumulated in ``zero``'s type."""
    acc, done = bulk_sum(v, lo, n, zero)
    base = np.uint64(lo + done)
    for i in range(np.uint64(n - done)):
        acc += v[base + i]
    return acc


@jit_inline
def span_moments(v: Any, lo: int, n: int, shift: float) -> tuple[float, float]:
    """(sum of y, sum of y * y) in float64 over v[lo : lo + n], y = x - shift."""
    s, q, done = bulk_moments(v, lo, n, shift)
    base = np.uint64(lo + done)
    for i in range(np.uint64(n - done)):
        y = np.float64(v[base + i]) - shift
        s += y
        q += y * y
    return s, q
