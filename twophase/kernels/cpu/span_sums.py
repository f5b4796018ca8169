"""Float64 sums over dense float32 / float64 spans, written as LLVM IR: whole-vector loads and software prefetch.

numba's loop for ``acc += float64(v[i])`` over float32 widens 32-byte halves straight from memory (``vcvtps2pd
zmm, [mem]``): half as many bytes per load as a float32 loop, and on the Intel Xeon of the twenty-fifth session
it read a 64 MiB array 1.45-1.6x slower than ``np.max`` of its int32 view did, 1.1-1.3x in cache
(``/tmp/w25/acc2.py``). Here each iteration loads whole 64-byte vectors, widens their halves into four
``<8 x double>`` accumulators (four dependency chains), and prefetches the lines ``AHEAD`` bytes on, which the
hardware prefetcher, stopping at every 4 KiB page, did not keep up with: the same 64 MiB then read as fast as
``np.max`` (0.98-1.04x), and a span in cache 1.1x faster than numba's loop (``/tmp/w25/ir.py``).

The intrinsics cover the whole ``BULK``-element steps of a span; the caller's loop adds the rest. A prefetch never
faults, so the lines ahead of a span's end (a dense matrix's next rows) are prefetched too.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic, overload

from .jit import emit_prefetch

__all__ = ["BULK", "AHEAD", "bulk_sum", "bulk_moments"]

BULK = 32  # elements per step: two 16-float vectors, or four 8-double ones
AHEAD = 16384  # bytes between the step's first line and the lines it prefetches
_ACCS = 4  # <8 x double> accumulators per sum
_F64, _I64, _I32 = ir.DoubleType(), ir.IntType(64), ir.IntType(32)
_V8D = ir.VectorType(_F64, 8)


def _lanes(builder: Any, vec: Any, first: int, n: int) -> Any:
    """Lanes ``first .. first + n - 1`` of ``vec`` as a vector of n."""
    return builder.shuffle_vector(vec, ir.Constant(vec.type, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, n), list(range(first, first + n))))


def _horizontal(builder: Any, accs: list[Any]) -> Any:
    """The sum of every lane of the accumulators: pairwise, then halving the vector."""
    while len(accs) > 1:
        accs = [builder.fadd(accs[i], accs[i + 1]) for i in range(0, len(accs), 2)]
    v, n = accs[0], 8
    while n > 1:
        n //= 2
        v = builder.fadd(_lanes(builder, v, 0, n), _lanes(builder, v, n, n))
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _emit_sums(builder: Any, data: Any, elem: Any, n: Any, shift: Any | None) -> list[Any]:
    """IR summing the ``n // BULK`` whole steps from the element pointer ``data`` (float or double): [sum] of the
    elements in float64, or with a ``shift`` (a double) [sum of y, sum of y * y] for y = x - shift."""
    size = 8 if elem == _F64 else 4
    per = 64 // size  # elements per 64-byte vector: 16 floats or 8 doubles
    vec = ir.VectorType(elem, per)
    lines = BULK // per  # vectors (and lines) per step
    fn = builder.function
    pre = builder.block
    loop, after = fn.append_basic_block("span_sum_loop"), fn.append_basic_block("span_sum_done")
    steps = builder.udiv(n, ir.Constant(_I64, BULK))
    zero = ir.Constant(_V8D, [0.0] * 8)
    chains = 2 if shift is not None else 1
    builder.cbranch(builder.icmp_signed(">", steps, ir.Constant(_I64, 0)), loop, after)

    builder.position_at_end(loop)
    step = builder.phi(_I64)
    accs = [[builder.phi(_V8D) for _ in range(_ACCS)] for _ in range(chains)]
    first = builder.gep(data, [builder.mul(step, ir.Constant(_I64, BULK))])
    ahead = builder.gep(first, [ir.Constant(_I64, AHEAD // size)])
    for line in range(lines):
        emit_prefetch(builder, builder.gep(ahead, [ir.Constant(_I64, line * per)]), write=False, locality=3)
    halves = []
    for line in range(lines):
        v = builder.load(builder.bitcast(builder.gep(first, [ir.Constant(_I64, line * per)]), vec.as_pointer()),
                         align=size)
        if per == 16:
            halves += [builder.fpext(_lanes(builder, v, 0, 8), _V8D), builder.fpext(_lanes(builder, v, 8, 8), _V8D)]
        else:
            halves.append(v)
    if shift is not None:
        centre = builder.insert_element(ir.Constant(_V8D, ir.Undefined), shift, ir.Constant(_I32, 0))
        centre = builder.shuffle_vector(centre, ir.Constant(_V8D, ir.Undefined), ir.Constant(ir.VectorType(_I32, 8),
                                                                                              [0] * 8))
        halves = [builder.fsub(h, centre) for h in halves]
    new = [[builder.fadd(accs[0][i], h) for i, h in enumerate(halves)]]
    if shift is not None:
        new.append([builder.fadd(accs[1][i], builder.fmul(h, h)) for i, h in enumerate(halves)])
    following = builder.add(step, ir.Constant(_I64, 1))
    end = builder.block
    builder.cbranch(builder.icmp_signed("<", following, steps), loop, after)
    step.add_incoming(ir.Constant(_I64, 0), pre)
    step.add_incoming(following, end)
    for chain, grown in zip(accs, new):
        for acc, g in zip(chain, grown):
            acc.add_incoming(zero, pre)
            acc.add_incoming(g, end)

    builder.position_at_end(after)
    finals = [[builder.phi(_V8D) for _ in grown] for grown in new]  # every phi ahead of the block's other code
    for chain, grown in zip(finals, new):
        for f, g in zip(chain, grown):
            f.add_incoming(zero, pre)
            f.add_incoming(g, end)
    return [_horizontal(builder, chain) for chain in finals]


def _dense_float(v: Any) -> bool:
    return isinstance(v, types.Array) and v.ndim == 1 and v.layout == "C" and v.dtype in (types.float32,
                                                                                          types.float64)


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


def bulk_sum(v: Any, lo: int, n: int, zero: Any) -> tuple[Any, int]:
    """(the sum of the first ``done`` elements of v[lo : lo + n] added to ``zero``, done): the whole steps of a
    dense float span when ``zero`` is a float64, else nothing (0 done). In jitted code only."""
    raise NotImplementedError("bulk_sum runs in jitted code")


def bulk_moments(v: Any, lo: int, n: int, shift: float) -> tuple[float, float, int]:
    """(sum of y, sum of y * y, done) over the first ``done`` elements of v[lo : lo + n], y = x - shift: the whole
    steps of a dense float span, else nothing (0 done). In jitted code only."""
    raise NotImplementedError("bulk_moments runs in jitted code")


@overload(bulk_sum, inline="always")
def _bulk_sum(v: Any, lo: int, n: int, zero: Any) -> Any:  # annotated as the implementations (numba checks)
    if _dense_float(v) and zero == types.float64:
        def fast(v: Any, lo: int, n: int, zero: Any) -> tuple[Any, int]:
            done = n - n % BULK
            return zero + _sum_steps(v, lo, n), done
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

