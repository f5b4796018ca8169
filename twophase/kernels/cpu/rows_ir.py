"""Constant linear maps between float32 rows and 4-way (de)interleaves of a row, written as LLVM IR.

A Winograd transform step reads a few rows and writes a few others, element by element (``out_j[k] = sum_i
M[j, i] * in_i[k]``), over rows of a few dozen to a few hundred elements. Here the rows are pointers and the loop
is explicit 16-float vectors (a masked last one), the map's constants folded into adds, subtracts and FMAs:
numba's loop over the same six rows took 1.9x as long at 60 elements, 1.36x at 224 and 1.09x at 2000 (one
thread, in cache, 11 alternating rounds, ``/tmp/w26/vecab.py`` of the twenty-sixth session): its per-call cost
counts on short rows. The interleaves move 16 groups of four floats a step through shuffles, for the column
phases of 4x4-output-tile transforms, over several rows a call: numba's stride-4 loop took 4x as long on 13
groups (18.6 against 4.7 ns) and 4.6x on 64 (98 against 21).

Each intrinsic takes its rows as an int64 array of addresses (outputs first), so one compiled intrinsic serves any
rows; the caller keeps the rows' memory alive and their lengths at least ``n`` (plus ``shift``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .jit import emit_lanes_below, emit_splat, masked_memory

__all__ = ["LANES", "linear_map", "deinterleave4", "interleave4"]

LANES = 16
_F32, _I64, _I32 = ir.FloatType(), ir.IntType(64), ir.IntType(32)
_VEC = ir.VectorType(_F32, LANES)


def _pointers(context: Any, builder: Any, sig_arg: Any, arg: Any, count: int) -> list[Any]:
    """The first ``count`` addresses of an int64 array argument, as float pointers."""
    arr = context.make_array(sig_arg)(context, builder, arg)
    return [
        builder.inttoptr(builder.load(builder.gep(arr.data, [ir.Constant(_I64, i)])), _F32.as_pointer())
        for i in range(count)
    ]


def _vec_at(builder: Any, p: Any, k: Any) -> Any:
    return builder.bitcast(builder.gep(p, [k]), _VEC.as_pointer())


def _combine(builder: Any, row: Sequence[float], xs: list[Any], addend: Any) -> Any:
    """IR of addend + sum_i row[i] * xs[i]: 1 and -1 as adds and subtracts, other constants as FMAs."""
    fma = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
        builder.module, ir.FunctionType(_VEC, [_VEC, _VEC, _VEC]), "llvm.fma.v16f32"
    )
    acc = addend
    for c, x in zip(row, xs):
        if c == 0:
            continue
        if acc is None:
            acc = x if c == 1 else builder.fneg(x) if c == -1 else builder.fmul(ir.Constant(_VEC, [c] * LANES), x)
        elif c == 1:
            acc = builder.fadd(acc, x)
        elif c == -1:
            acc = builder.fsub(acc, x)
        else:
            acc = builder.call(fma, [ir.Constant(_VEC, [c] * LANES), x, acc])
    return acc if acc is not None else ir.Constant(_VEC, [0.0] * LANES)


def _loop(builder: Any, count: Any, body: Any) -> None:
    """for k in range(count): body(k)."""
    with cgutils.for_range(builder, count) as loop:
        body(loop.index)


def linear_map(matrix: Sequence[Sequence[float]], shifts: Sequence[int] | None = None) -> Any:
    """An intrinsic ``(rows, n, addend)``: out_j[k] = addend + sum_i matrix[j][i] * in_i[k + shifts[i]] for
    k < n, ``rows`` the int64 addresses of the outputs then the inputs (float32), ``addend`` a float32 (0 for
    none). 16 floats a step, the last step masked: exactly n elements written."""
    outs, ins = len(matrix), len(matrix[0])
    shift = list(shifts) if shifts is not None else [0] * ins

    def typing(typingctx: Any, rows: Any, n: Any, addend: Any) -> Any:
        if not (isinstance(rows, types.Array) and rows.dtype == types.int64):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            ptrs = _pointers(context, builder, signature.args[0], args[0], outs + ins)
            out_p = ptrs[:outs]
            in_p = [builder.gep(p, [ir.Constant(_I64, s)]) for p, s in zip(ptrs[outs:], shift)]
            count = context.cast(builder, args[1], signature.args[1], types.int64)
            add = emit_splat(builder, context.cast(builder, args[2], signature.args[2], types.float32), _VEC)
            steps = builder.sdiv(count, ir.Constant(_I64, LANES))

            def step(k: Any) -> None:
                at = builder.mul(k, ir.Constant(_I64, LANES))
                xs = [builder.load(_vec_at(builder, p, at), align=4) for p in in_p]
                for j in range(outs):
                    builder.store(_combine(builder, matrix[j], xs, add), _vec_at(builder, out_p[j], at), align=4)

            _loop(builder, steps, step)
            at = builder.mul(steps, ir.Constant(_I64, LANES))
            rest = builder.sub(count, at)
            with builder.if_then(builder.icmp_signed(">", rest, ir.Constant(_I64, 0))):
                load, store = masked_memory(builder, _VEC)
                mask = emit_lanes_below(builder, rest, LANES)
                zero = ir.Constant(_VEC, [0.0] * LANES)
                xs = [builder.call(load, [_vec_at(builder, p, at), ir.Constant(_I32, 4), mask, zero]) for p in in_p]
                for j in range(outs):
                    builder.call(
                        store,
                        [
                            _combine(builder, matrix[j], xs, add),
                            _vec_at(builder, out_p[j], at),
                            ir.Constant(_I32, 4),
                            mask,
                        ],
                    )
            return context.get_dummy_value()

        return types.void(rows, n, addend), codegen

    typing.__name__ = typing.__qualname__ = f"linear_map_{outs}x{ins}"
    return intrinsic(typing)


def _interleave_mask(groups: int) -> list[int]:
    """Lane order that takes 4 concatenated 16-lane vectors (phase-major) to element order: lane 4g + r <- r*16 + g."""
    return [r * LANES + g for g in range(groups) for r in range(4)]


def _concat4(builder: Any, vs: list[Any]) -> Any:
    """The 64-lane concatenation of four 16-lane vectors."""
    i32v = ir.VectorType(_I32, 2 * LANES)
    a = builder.shuffle_vector(vs[0], vs[1], ir.Constant(i32v, list(range(2 * LANES))))
    b = builder.shuffle_vector(vs[2], vs[3], ir.Constant(i32v, list(range(2 * LANES))))
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 4 * LANES), list(range(4 * LANES))))


def _steps_and_rest(builder: Any, count: Any, step: Any) -> None:
    """step(first group, masks) for every 16 groups of ``count``, the last ones masked: ``masks`` None for a whole
    step, else the masks of the step's 4 vectors in element order (4 lanes a group) and in group order."""
    steps = builder.sdiv(count, ir.Constant(_I64, LANES))
    _loop(builder, steps, lambda k: step(builder.mul(k, ir.Constant(_I64, LANES)), None))
    at = builder.mul(steps, ir.Constant(_I64, LANES))
    rest = builder.sub(count, at)
    with builder.if_then(builder.icmp_signed(">", rest, ir.Constant(_I64, 0))):
        elems = builder.mul(rest, ir.Constant(_I64, 4))
        by_elem = [emit_lanes_below(builder, builder.sub(elems, ir.Constant(_I64, LANES * v)), LANES) for v in range(4)]
        step(at, (by_elem, emit_lanes_below(builder, rest, LANES)))


def _regroup(split: bool) -> Any:
    """The intrinsic ``(rows, n, count, src_step, dst_step)``, rows = 5 addresses, over ``count`` rows, each
    ``src_step`` / ``dst_step`` floats on from the last, 16 groups a step (the last step masked: exactly those
    elements read and written). ``split``: rows (p0, p1, p2, p3, src), p_r[k] = src[4k + r] for k < n (dst_step
    for the p_r); else rows (q0, q1, q2, q3, dst), dst[4k + r] = q_r[k] (src_step for the q_r)."""
    order = _interleave_mask(LANES)  # element order from phase-major lanes
    if split:
        inverse = [0] * (4 * LANES)
        for lane, src in enumerate(order):
            inverse[src] = lane
        order = inverse

    def typing(typingctx: Any, rows: Any, n: Any, count: Any, src_step: Any, dst_step: Any) -> Any:
        if not (isinstance(rows, types.Array) and rows.dtype == types.int64):
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            first = _pointers(context, builder, signature.args[0], args[0], 5)
            n_, count_, s_step, d_step = (
                context.cast(builder, a, t, types.int64) for a, t in zip(args[1:], signature.args[1:])
            )
            four_step, one_step = (d_step, s_step) if split else (s_step, d_step)
            load, store = masked_memory(builder, _VEC)
            zero = ir.Constant(_VEC, [0.0] * LANES)

            def row(i: Any) -> None:
                four = [builder.gep(q, [builder.mul(i, four_step)]) for q in first[:4]]
                one = builder.gep(first[4], [builder.mul(i, one_step)])

                def step(at: Any, masks: Any) -> None:
                    wide = builder.gep(one, [builder.mul(at, ir.Constant(_I64, 4))])  # 4 floats a group
                    # (load pointer, store pointer, mask) per vector: 4 vectors of groups in element order on
                    # the ``one`` side, one vector of 16 groups per phase on the other
                    ins = (
                        [_vec_at(builder, wide, ir.Constant(_I64, LANES * v)) for v in range(4)]
                        if split
                        else [_vec_at(builder, q, at) for q in four]
                    )
                    outs = (
                        [_vec_at(builder, q, at) for q in four]
                        if split
                        else [_vec_at(builder, wide, ir.Constant(_I64, LANES * v)) for v in range(4)]
                    )
                    in_masks, out_masks = (
                        (None, None)
                        if masks is None
                        else ((masks[0], [masks[1]] * 4) if split else ([masks[1]] * 4, masks[0]))
                    )
                    vs = [
                        builder.load(q, align=4)
                        if in_masks is None
                        else builder.call(load, [q, ir.Constant(_I32, 4), in_masks[v], zero])
                        for v, q in enumerate(ins)
                    ]
                    whole = _concat4(builder, vs)
                    for v, q in enumerate(outs):
                        part = builder.shuffle_vector(
                            whole,
                            ir.Constant(whole.type, ir.Undefined),
                            ir.Constant(ir.VectorType(_I32, LANES), order[v * LANES : (v + 1) * LANES]),
                        )
                        if out_masks is None:
                            builder.store(part, q, align=4)
                        else:
                            builder.call(store, [part, q, ir.Constant(_I32, 4), out_masks[v]])

                _steps_and_rest(builder, n_, step)

            _loop(builder, count_, row)
            return context.get_dummy_value()

        return types.void(rows, n, count, src_step, dst_step), codegen

    typing.__name__ = typing.__qualname__ = "deinterleave4" if split else "interleave4"
    return intrinsic(typing)


deinterleave4: Any = _regroup(True)
interleave4: Any = _regroup(False)
