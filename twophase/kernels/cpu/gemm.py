"""Register-blocked float32 GEMM: ``c[i0:i1, j0:j1] = a @ b (+ bias)`` on operands read where they lie.

numba alone cannot keep a block of ``C`` in SIMD registers (LLVM turns scalar accumulators into scalar FMAs), so
the microkernel is written as LLVM IR through a numba intrinsic: ``MR`` x 2 accumulators of 16 floats (``MR`` x 4
in the 64-column panels of ``b`` read in place), per k two (four) vector loads of a ``b`` row, one broadcast of
each ``a`` element and ``2 * MR`` (``4 * MR``) vector FMAs; LLVM allocates them to zmm registers. Around it a plain
numba loop nest blocks k (``KC``) and the rows (``MC``) so the block of ``a`` stays in L2 while the panels of ``b``
stream past it. The operands are read where they lie (``b``'s 32-column panels are copied when enough rows reuse
them and its rows are not 64-byte aligned: ``packs_panels``), and a linear layer's weight is read in place on
every call (OpenBLAS packs both operands per call). The bias, when given, is added as the accumulators are
stored, so it costs no pass over ``c``.

Without AVX-512, ``gemm_f32_ymm`` runs the same IR with 8-float vectors (6 x 16 blocks in 12 of AVX2's 16 ymm
registers) for the small products of attention's heads, where it beats OpenBLAS's per-call cost, and
``gemm_tile_ymm`` for the fused attention tiles' and im2col_tiles' products (``host_gemm_tile``), ``gemm_table_ymm``
for conv2d's implicit GEMM (``host_gemm_table``); the linear layers and the other convolutions stay with OpenBLAS
there (the 8-lane kernel measured 0.55-0.97x OpenBLAS on them).
"""

from __future__ import annotations

import functools
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ...runtime.fanout import split_range
from .jit import (
    any_layout,
    emit_lanes_below,
    emit_prefetch,
    emit_splat,
    entry,
    host_cpu_name,
    host_has,
    masked_memory,
    prefetch_l2,
)

__all__ = [
    "available",
    "columns_computed",
    "columns_fit",
    "half_width_fma",
    "gemm_f32",
    "gemm_f32_entry",
    "gemm_f32_heads",
    "gemm_tile",
    "gemm_tile_ymm",
    "host_gemm_table",
    "host_gemm_tile",
    "blocked_available",
    "gemm_table",
    "gemm_table_ymm",
    "MIN_COLS",
    "MR",
    "NR",
    "KC",
    "MC",
    "LANES",
    "HALF",
    "panel_bytes",
    "PACK_MIN_ROWS",
    "packs_panels",
    "packing_pays",
    "row_ranges",
    "ymm_available",
    "gemm_f32_ymm",
    "gemm_f32_heads_ymm",
    "YMM",
]

MR = 6  # rows of the microkernel: 6 x 2 accumulators + 2 b vectors + 1 broadcast: 15 of the 32 zmm registers
LANES = 16
HALF = 8  # a last run of at most this many columns takes the 8-wide (ymm) masked panel
NR = 2 * LANES  # columns of a full panel (of a packed copy of b, and the last panels of a run)
# columns of a wide panel, where b is read in place: 6 x 4 accumulators (24 of the 32 zmm registers), so each
# broadcast of a feeds four FMAs instead of two. gemm_f32 unpacked against the 32-wide module, one thread,
# interleaved in one process (/tmp/w27/gab.py of the twenty-seventh session, two runs): attention's 512 x 512 x 64
# and 512 x 64 x 512 heads 1.08-1.13x, 512 x 4608 x 64 1.07-1.17x, 128 x 384 x 1536 1.05-1.11x, 0.91-1.02x on four
# other shapes in one run or the other. The packed path (``PACK_MIN_ROWS``) keeps 32-wide copies of b's panels.
WIDE = 4 * LANES
# k block. 256 kept a 32-column panel of b (32 KiB) in L1; the 64-column panels read in place are 64 KiB at 256
# rows and stream from L2 either way, and deeper blocks store and reload the accumulators less often. 512 against
# 256, through the matmul op, two threads, 15 interleaved rounds (AMD Zen 4, /tmp/w50/mmab.py of the fiftieth
# session): MiniLM's 128 x 384 x 384, x 1536, 128 x 1536 x 384 1.01-1.05x, 512 x 2304 x 392 1.01x, 512 x 1152 x
# 784 1.02x, 1024 x 384 x 1536 1.03x; b's rows not 64-byte aligned (then packed) 128 x 384 x 1000 1.09x, 256 x
# 2304 x 200 1.08x, 1.02-1.05x on three others. 768 and 1024 measured the same as 512 (0.99-1.11x against 256)
KC = 512
# row block: MC x KC floats of a (480 KiB) stay in L2 across the panels. 120 against 240, where a conv tile (up to
# 512 KiB) shares Zen 4's 1 MiB L2 with the block: forced im2col_tiles, one thread, 15 interleaved rounds
# (/tmp/w67/ab.py of the sixty-seventh session), t(240) / t(120) 8 x 64->128 56^2 s2 0.97, 128->256 28^2 s2 0.99,
# 256->512 14^2 s2 1.00, 1 x 256^2 14^2 0.995: kept. Prefetching the next row block's rows of a into L2 as each block
# starts (gemm_tile, a's unit step) ran 0.96-0.98x on the same and two more layers (two threads, 11 rounds)
MC = 240
# rows from which gemm_f32 packs b's panels when b's rows are not 64-byte aligned (``packs_panels``): the copy is
# read by every MR-row block after it, and rows in place would span an extra line per 64 columns (twenty-second
# session: 1.2-1.45x packed, /tmp/w22/packproto.py; 24 rows 0.8-1.1x). Aligned rows are read in place: with the
# 64-column panels the packed 32-wide copies lost (Intel Xeon, one thread, 64-byte-aligned operands, interleaved in
# one process, two runs, /tmp/w28/gab3.py: in place / packed 128 x 384 x 1152 1.05 / 1.09x, 128 x 1536 x 384
# 1.07 / 1.14x, 128 x 384 x 384 1.07 / 1.15x, 512^3 1.12 / 1.06x, 0.95-1.39x on eight others; rows 383 floats
# apart 0.88 / 0.87x). Copying 64-wide panels instead measured 0.89-1.28x the 32-wide ones: not taken.
PACK_MIN_ROWS = 32
TABLE_AHEAD = 8  # rows of b ahead whose lines the table's microkernels prefetch
UNIT_STEP_LOOP = True  # the microkernels' k loop specialised for a's unit step (False: one loop; to measure)


def packs_panels(rows: int, row_stride: int, offset: int) -> bool:
    """Whether ``gemm_f32`` runs faster over packed copies of b's panels (phase 1 asks): on a host where packing
    pays (``packing_pays``), every part has ``PACK_MIN_ROWS`` rows and b's rows, ``row_stride`` floats apart from
    float ``offset`` of a 64-byte-aligned allocation, do not all start on a 64-byte boundary."""
    return packing_pays() and rows >= PACK_MIN_ROWS and (row_stride % LANES != 0 or offset % LANES != 0)


@functools.cache
def packing_pays() -> bool:
    """Whether packed copies of b's unaligned rows beat reading them in place on this host: not on AMD Zen (LLVM's
    ``znver`` CPUs), where the 64-column panels in place ran 1.015-1.12x as fast as the packed 32-column copies
    (through the op, two threads, 11 interleaved rounds, AMD Zen 4, /tmp/w50/packab.py of the fiftieth session:
    128 x 384 x 1000 1.11x, 64 x 768 x 3000 1.12x, 256 x 2304 x 200 1.04x, 512 x 1000 x 777 1.02x, 1024 x 1000 x
    1000 1.015x; 1.05-1.13x with the k blocks of 256 of before), unlike the Intel Xeon above."""
    return not host_cpu_name().startswith("znver")


def panel_bytes(k: int) -> int:
    """The scratch ``gemm_f32`` packs a panel of b into, for ``k`` rows of b: one k block of 32 columns."""
    return min(KC, k) * NR * 4


def available() -> bool:
    """Whether numba compiles for a CPU with AVX-512: the 12 accumulators of 16 floats then sit in zmm registers
    (with AVX2's 16 ymm registers they would spill, and without FMA each one is a libm call); elsewhere the
    GEMMs stay with BLAS."""
    return host_has("avx512f", "fma")


def ymm_available() -> bool:
    """Whether numba compiles for a CPU with AVX2 and FMA: the 8-lane kernels (``gemm_f32_ymm``) then keep a 6 x 16
    block of ``c`` in 12 of the 16 ymm registers."""
    return host_has("avx2", "fma")


def blocked_available() -> bool:
    """Whether one of the register-blocked kernels runs here: the AVX-512 ones or the 8-lane ones."""
    return available() or ymm_available()


MIN_COLS = 32  # at least one full panel
MIN_USE = 0.9  # columns wanted / columns computed in 16-wide panels: at 49 of 64, OpenBLAS is faster


def columns_fit(n: int) -> bool:
    """Whether ``n`` columns suit the kernel: one 32-column panel or more, and the last, overlapping 16-column
    panel (``gemm_f32``) not recomputing over a tenth of them."""
    return n >= MIN_COLS and n >= MIN_USE * (-(-n // LANES) * LANES)


def row_ranges(m: int, parts: int) -> list[tuple[int, int]]:
    """``[0, m)`` cut into at most ``parts`` ranges of whole MR-row blocks (the last one shorter): the rows of the
    parts when a GEMM's output is split by rows."""
    return [(i0 * MR, min(i1 * MR, m)) for i0, i1 in split_range(-(-m // MR), parts)]


def columns_computed(n: int) -> int:
    """Columns' worth of work ``gemm_tile`` does for ``n``: whole panels (64 wide, ``panel_width``), then the rest
    as a masked 64 (49-63 left), 32 + 16 (33-48), a masked 32 (17-31) or 16 (1-16; the 8-wide ymm panel of 1-8
    costs a 16-wide one's time per row of ``b``: the same loads and FMAs, on half-width registers). The same
    counts as whole 32-wide panels and a last one of 32, 24 or 16, which the formula computes: 49-56 and 17-24
    take panels whose last vector is a ymm, 56 and 24 columns' work where a zmm FMA is two 256-bit passes
    (``half_width_fma``), 64 and 32 where it is one."""
    full = n // NR * NR
    rest = n - full
    if rest == 0:
        return full
    if rest <= LANES:
        return full + LANES
    return full + (LANES + HALF if rest <= LANES + HALF and half_width_fma() else NR)


@functools.cache
def half_width_fma() -> bool:
    """Whether this host runs a zmm FMA as two 256-bit passes (AMD Zen 4, LLVM's ``znver4``), so that a ymm FMA
    takes half its time: a panel whose last vector is a ymm then costs by its columns (``columns_computed``)."""
    return host_cpu_name() == "znver4"


_I64 = ir.IntType(64)
_F32 = ir.FloatType()


def _emit_block(
    builder: Any,
    rows: int,
    nv: int,
    c: Any,
    ldc: Any,
    a: Any,
    lda: Any,
    sak: Any,
    b: Any,
    ldb: Any,
    k: Any,
    accumulate: Any,
    bias: Any,
    ncols: Any = None,
    width: int = LANES,
    tail: int = 0,
    table: bool = False,
    fetch: bool = True,
) -> None:
    """IR for the block ``c = a[:, :k] @ b[:k, :]`` of ``rows`` rows and ``nv`` vectors of columns, plus, when
    ``accumulate``, the old ``c``, else plus the bias row at address ``bias`` when it is not 0 (addresses in bytes,
    strides in elements). With ``ncols``, only the first ``ncols`` columns of the last vector of ``c`` and the bias
    are read and written (masked), while ``b``'s rows are still read whole vectors wide. ``width``: floats per
    vector (16: zmm; 8: ymm, for a last panel of at most 8 columns, which then computes 8 lanes instead of 16);
    ``tail``: floats of the last vector when it is narrower (a ymm after zmm vectors: last panels of 49-56 and 17-24
    columns). With ``table``, ``ldb`` is the address of int64 offsets: row k of ``b`` starts ``table[k]`` floats
    past ``b`` (an implicit GEMM's rows, read where they lie in the input), and with ``fetch`` the lines of row
    k + ``TABLE_AHEAD`` are prefetched as row k is read."""
    widths = [width] * (nv - 1) + [tail or width]
    vecs = [ir.VectorType(_F32, w) for w in widths]
    fptr = _F32.as_pointer()
    i32 = ir.IntType(32)
    mask = None
    if ncols is not None:
        mask = emit_lanes_below(builder, ncols, widths[-1])
        mload, mstore = masked_memory(builder, vecs[-1])

    def load_c(p: Any, v: int) -> Any:
        if mask is None or v < nv - 1:
            return builder.load(p, align=4)
        return builder.call(mload, [p, ir.Constant(i32, 4), mask, ir.Constant(vecs[v], None)])

    def store_c(x: Any, p: Any, v: int) -> None:
        if mask is None or v < nv - 1:
            builder.store(x, p, align=4)
        else:
            builder.call(mstore, [x, p, ir.Constant(i32, 4), mask])

    fmas = [
        cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, ir.FunctionType(vt, [vt, vt, vt]), f"llvm.fma.v{w}f32"
        )
        for vt, w in zip(vecs, widths, strict=True)
    ]
    zeros = [ir.Constant(vt, None) for vt in vecs]

    def const(v: int) -> Any:
        return ir.Constant(_I64, v)

    def vec_at(base: Any, row: int, ld: Any, v: int) -> Any:
        # vector v starts at width * v: only the last one may be narrower
        p = builder.gep(base, [builder.add(builder.mul(const(row), ld), const(width * v))])
        return builder.bitcast(p, vecs[v].as_pointer())

    cp, ap, bp = (builder.inttoptr(x, fptr) for x in (c, a, b))
    offsets = builder.inttoptr(ldb, _I64.as_pointer()) if table else None
    # write-prefetch the block of c: its lines arrive while the k loop runs (c is cold when it is a
    # large output, or attention's scores of many heads: 8-10% there)
    for r in range(rows):
        for v in range(nv):
            emit_prefetch(builder, vec_at(cp, r, ldc, v), write=True, locality=3)
    acc = [[cgutils.alloca_once(builder, vecs[v]) for v in range(nv)] for _ in range(rows)]  # type: ignore[no-untyped-call]
    for row in acc:
        for v, slot in enumerate(row):
            builder.store(zeros[v], slot)
    a_rows = [builder.gep(ap, [builder.mul(const(r), lda)]) for r in range(rows)]

    def k_loop(step: Any) -> None:
        with cgutils.for_range(builder, k) as loop:
            kk = loop.index
            if offsets is None:
                b_row = builder.gep(bp, [builder.mul(kk, ldb)])
            else:
                b_row = builder.gep(bp, [builder.load(builder.gep(offsets, [kk]), align=8)])
            if offsets is not None and fetch:
                # the rows lie at irregular offsets, which the hardware prefetchers do not follow: fetch the
                # lines of row k + TABLE_AHEAD into L1 (the table holds TABLE_AHEAD more entries)
                ahead = builder.gep(
                    bp, [builder.load(builder.gep(offsets, [builder.add(kk, const(TABLE_AHEAD))]), align=8)]
                )
                for v in range(nv):
                    emit_prefetch(builder, builder.gep(ahead, [const(width * v)]), write=False, locality=3)
                emit_prefetch(
                    builder, builder.gep(ahead, [const(width * (nv - 1) + widths[-1] - 1)]), write=False, locality=3
                )
            bv = [builder.load(vec_at(b_row, 0, const(0), v), align=4) for v in range(nv)]
            ak = kk if step is None else builder.mul(kk, step)
            for r in range(rows):
                wide = emit_splat(builder, builder.load(builder.gep(a_rows[r], [ak]), align=4), vecs[0])
                # a narrower tail takes the wide splat's low lanes: the same register, no second broadcast
                splats = {widths[0]: wide, widths[-1]: _low_lanes(builder, wide, widths[-1])}
                for v in range(nv):
                    sv = splats[widths[v]]
                    builder.store(builder.call(fmas[v], [sv, bv[v], builder.load(acc[r][v])]), acc[r][v])

    if UNIT_STEP_LOOP and ncols is None:  # (the masked last panels keep one loop: less to compile)
        # a's elements 1 apart along k (every caller's usual case): the unrolled loop addresses a row's next
        # element by displacement instead of by 6 more offsets (6 x 32 block, two k per turn: 56 instructions
        # and 7 stack reloads against 61 and 13). One thread, same bits, against the one-loop build in one
        # process: 1.02-1.10x on 7 of 8 GEMM shapes (0.975x on one), /tmp/w24/unit_ab.py, twenty-fourth session
        with builder.if_else(builder.icmp_signed("==", sak, const(1))) as (unit, any_step):
            with unit:
                k_loop(None)
            with any_step:
                k_loop(sak)
    else:
        k_loop(sak)
    addend = [[cgutils.alloca_once(builder, vecs[v]) for v in range(nv)] for _ in range(rows)]  # type: ignore[no-untyped-call]
    with builder.if_else(builder.icmp_signed("!=", accumulate, const(0))) as (old_c, fresh):
        with old_c:
            for r in range(rows):
                for v in range(nv):
                    builder.store(load_c(vec_at(cp, r, ldc, v), v), addend[r][v])
        with fresh:
            with builder.if_else(builder.icmp_signed("!=", bias, const(0))) as (with_bias, without):
                with with_bias:
                    bias_p = builder.inttoptr(bias, fptr)
                    for v in range(nv):
                        x = load_c(vec_at(bias_p, 0, const(0), v), v)
                        for r in range(rows):
                            builder.store(x, addend[r][v])
                with without:
                    for r in range(rows):
                        for v in range(nv):
                            builder.store(zeros[v], addend[r][v])
    for r in range(rows):
        for v in range(nv):
            total = builder.fadd(builder.load(acc[r][v]), builder.load(addend[r][v]))
            store_c(total, vec_at(cp, r, ldc, v), v)


def _low_lanes(builder: Any, v: Any, lanes: int) -> Any:
    """The first ``lanes`` lanes of vector ``v`` (``v`` itself when it has that many)."""
    if v.type.count == lanes:
        return v
    return builder.shuffle_vector(
        v, ir.Constant(v.type, None), ir.Constant(ir.VectorType(ir.IntType(32), lanes), list(range(lanes)))
    )


def _microkernel(
    nv: int, masked: bool = False, width: int = LANES, tail: int = 0, table: bool = False, fetch: bool = True
) -> Any:
    """An intrinsic ``(rows, c, ldc, a, lda, sak, b, ldb, k, accumulate, bias[, ncols])``: ``_emit_block`` for 16 nv
    columns (``masked``: the last vector's first ``ncols``; ``tail``: floats of a narrower last vector; ``table``
    and ``fetch`` as there) and ``rows``
    (1..MR) rows, one specialised block per row count behind a switch (the accumulators must be known when
    compiling)."""
    nargs = 12 if masked else 11

    def codegen(context: Any, builder: Any, signature: Any, argv: Any) -> Any:
        done = builder.append_basic_block("rows_done")
        switch = builder.switch(argv[0], done)
        for r in range(1, MR + 1):
            block = builder.append_basic_block(f"rows_{r}")
            switch.add_case(ir.Constant(_I64, r), block)
            builder.position_at_end(block)
            c, ldc, a, lda, sak, b, ldb, k, accumulate, bias = argv[1:11]
            _emit_block(
                builder,
                r,
                nv,
                c,
                ldc,
                a,
                lda,
                sak,
                b,
                ldb,
                k,
                accumulate,
                bias,
                argv[11] if masked else None,
                width,
                tail,
                table,
                fetch,
            )
            builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    sig = types.void(*([types.int64] * nargs))

    def typing_masked(
        typingctx: Any,
        rows: Any,
        c: Any,
        ldc: Any,
        a: Any,
        lda: Any,
        sak: Any,
        b: Any,
        ldb: Any,
        k: Any,
        accumulate: Any,
        bias: Any,
        ncols: Any,
    ) -> Any:
        return sig, codegen

    def typing_plain(
        typingctx: Any,
        rows: Any,
        c: Any,
        ldc: Any,
        a: Any,
        lda: Any,
        sak: Any,
        b: Any,
        ldb: Any,
        k: Any,
        accumulate: Any,
        bias: Any,
    ) -> Any:
        return sig, codegen

    typing: Any = typing_masked if masked else typing_plain  # numba types the intrinsic by its parameters
    cols = (nv - 1) * width + (tail or width)
    typing.__name__ = typing.__qualname__ = (
        f"_microkernel_{cols}{'_masked' if masked else ''}{'_table' if table else ''}{'' if fetch else '_nofetch'}"
    )
    return intrinsic(typing)


YMM = 8  # floats per ymm vector: the 8-lane kernels' panels are 2 * YMM and YMM columns wide
_Y16, _Y8 = _microkernel(2, width=YMM), _microkernel(1, width=YMM)
_Y8M = _microkernel(1, masked=True, width=YMM)


def _copy_panel_typing(typingctx: Any, dst: Any, src: Any, ld: Any, rows: Any, nv: Any) -> Any:
    """Copy ``rows`` rows of ``16 * nv`` floats (nv 1 or 2), ``ld`` floats apart at address ``src``, to consecutive
    rows at address ``dst``: one panel of b packed, two (or one) vector loads and stores per row."""
    sig = types.void(types.int64, types.int64, types.int64, types.int64, types.int64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        d, src_, ld_, n, nv_ = args
        vec = ir.VectorType(_F32, LANES)
        fptr, vptr = _F32.as_pointer(), vec.as_pointer()
        dp, sp = builder.inttoptr(d, fptr), builder.inttoptr(src_, fptr)
        with builder.if_else(builder.icmp_signed("==", nv_, ir.Constant(_I64, 2))) as (wide, narrow):
            for block, nv in ((wide, 2), (narrow, 1)):
                with block, cgutils.for_range(builder, n) as loop:
                    s_row = builder.gep(sp, [builder.mul(loop.index, ld_)])
                    d_row = builder.gep(dp, [builder.mul(loop.index, ir.Constant(_I64, LANES * nv))])
                    for v in range(nv):
                        at = ir.Constant(_I64, LANES * v)
                        x = builder.load(builder.bitcast(builder.gep(s_row, [at]), vptr), align=4)
                        builder.store(x, builder.bitcast(builder.gep(d_row, [at]), vptr), align=4)
        return context.get_dummy_value()

    return sig, codegen


_copy_panel: Any = intrinsic(_copy_panel_typing)

_jit = numba.njit(nogil=True, cache=True, error_model="numpy", fastmath={"contract", "arcp", "nsz"})
_inline = numba.njit(nogil=True, cache=True, inline="always")


def _panels(k64: Any, k64m: Any, k56m: Any, k32: Any, k32m: Any, k24m: Any, k16: Any, k16m: Any, k8m: Any) -> Any:
    """``_panel`` over one family of microkernels (``b``'s rows by stride, or by a table of offsets). Not cached
    on its own: it closes over the intrinsics, and numba keys a cached function on a pickle of its closure; it is
    only ever inlined into the cached kernels that call it, whose keys do not include it."""

    @numba.njit(nogil=True, inline="always")
    def panel(
        rows: int,
        w: int,
        c: int,
        ldc: int,
        a: int,
        lda: int,
        sak: int,
        b: int,
        ldb: int,
        k: int,
        accumulate: int,
        bias: int,
    ) -> None:
        """The microkernel for ``rows`` (1..MR) rows and a panel of ``w`` (1..64) columns: 64, 32 or 16 whole,
        57-63 as 64 with the fourth vector masked, 49-56 as 56 (a masked ymm fourth vector), 25-31 as 32 with the
        second vector masked, 17-24 as 24 (a masked ymm second vector), 9-15 as a masked 16, 1-8 as a masked 8
        (ymm); masked panels read ``b``'s rows that wide (56 and 24 for the ymm-tailed ones). (33-48 are not one
        panel: ``panel_width``.)"""
        if w == WIDE:
            k64(rows, c, ldc, a, lda, sak, b, ldb, k, accumulate, bias)
        elif w > WIDE - HALF:
            k64m(rows, c, ldc, a, lda, sak, b, ldb, k, accumulate, bias, w - (WIDE - LANES))
        elif w > WIDE - LANES:
            k56m(rows, c, ldc, a, lda, sak, b, ldb, k, accumulate, bias, w - (WIDE - LANES))
        elif w == NR:
            k32(rows, c, ldc, a, lda, sak, b, ldb, k, accumulate, bias)
        elif w > LANES + HALF:
            k32m(rows, c, ldc, a, lda, sak, b, ldb, k, accumulate, bias, w - LANES)
        elif w > LANES:
            k24m(rows, c, ldc, a, lda, sak, b, ldb, k, accumulate, bias, w - LANES)
        elif w == LANES:
            k16(rows, c, ldc, a, lda, sak, b, ldb, k, accumulate, bias)
        elif w > HALF:
            k16m(rows, c, ldc, a, lda, sak, b, ldb, k, accumulate, bias, w)
        else:
            k8m(rows, c, ldc, a, lda, sak, b, ldb, k, accumulate, bias, w)

    return panel


def _family(table: bool) -> tuple[Any, ...]:
    """The nine microkernels ``_panel`` picks from (``_microkernel``; ``table``: b's rows by offsets)."""
    return (
        _microkernel(4, table=table),
        _microkernel(4, masked=True, table=table),
        # 49-56 columns: 3 zmm + a masked ymm. Where a zmm FMA takes two 256-bit passes (AMD Zen 4) this is 56
        # columns' work, not 64: 7^2 conv tiles (49 pixels)
        _microkernel(4, masked=True, tail=HALF, table=table),
        _microkernel(2, table=table),
        _microkernel(2, masked=True, table=table),
        _microkernel(2, masked=True, tail=HALF, table=table),  # 17-24 columns: a zmm + a masked ymm, likewise
        _microkernel(1, table=table),
        _microkernel(1, masked=True, table=table),
        _microkernel(1, masked=True, width=8, table=table),
    )


_panel = _panels(*_family(False))
_panel_table = _panels(*_family(True))


def _ymm_panels(k16: Any, k8: Any, k8m: Any) -> Any:
    """``_panels`` for one family of the 8-lane microkernels (``b``'s rows by stride, or by a table of offsets):
    a panel of ``w`` columns, 16 or 8 whole, 1-7 a masked 8 (``ymm_panel_width``). Not cached, as ``_panels``."""

    @numba.njit(nogil=True, inline="always")
    def panel(
        rows: int,
        w: int,
        c: int,
        ldc: int,
        a: int,
        lda: int,
        sak: int,
        b: int,
        ldb: int,
        k: int,
        accumulate: int,
        bias: int,
    ) -> None:
        if w == 2 * YMM:
            k16(rows, c, ldc, a, lda, sak, b, ldb, k, accumulate, bias)
        elif w == YMM:
            k8(rows, c, ldc, a, lda, sak, b, ldb, k, accumulate, bias)
        else:
            k8m(rows, c, ldc, a, lda, sak, b, ldb, k, accumulate, bias, w)

    return panel


_ymm_panel = _ymm_panels(_Y16, _Y8, _Y8M)
# the 8-lane table microkernels, without the zmm family's prefetch of row k + TABLE_AHEAD
_ymm_panel_table = _ymm_panels(
    _microkernel(2, width=YMM, table=True, fetch=False),
    _microkernel(1, width=YMM, table=True, fetch=False),
    _microkernel(1, masked=True, width=YMM, table=True, fetch=False),
)


@_inline
def ymm_panel_width(left: int) -> int:
    """Columns of the next 8-lane panel with ``left`` columns to go: 16, else 8, else the rest (masked)."""
    if left >= 2 * YMM:
        return 2 * YMM
    return YMM if left >= YMM else left


@_inline
def gemm_tile(
    pa: int,
    lda: int,
    sak: int,
    pb: int,
    ldb: int,
    pc: int,
    ldc: int,
    kl: int,
    m: int,
    n: int,
    accumulate: int,
    bias: int,
    pnext: int,
) -> None:
    """``c[:m, :n] = a[:m, :kl] @ b[:kl, :n]`` plus the old ``c`` when ``accumulate``, else plus the bias row at
    address ``bias`` when it is not 0, on float32 matrices given by address and element strides (``b``, ``c`` and
    the bias with unit column stride). Columns go in panels of ``panel_width``: 64 wide, then the last run of
    fewer as one panel (49-63, 32 or fewer) or two (33-48: 32, then the rest), each panel 16 whole, 32 or 64 whole,
    else masked, reading ``b``'s rows up to the next multiple of 16 columns: they must be readable that far (a
    padded tile). Writes exactly that block of ``c``.

    While a panel is multiplied, the next panel of ``b`` is prefetched into L2, a slice of its rows per row block
    (a linear layer's weight is read once per call, from memory: MiniLM's 24 linears 15.7-16.8 -> 14.6-15.0 ms);
    during the last panel, the first panel from address ``pnext`` (the next k block's; 0: none)."""
    item = 4
    for ic in range(0, m, MC):
        ie = min(ic + MC, m)
        j = 0
        step = -(-kl // -(-(ie - ic) // MR))  # rows of the next panel of b to prefetch per row block
        while j < n:
            w = panel_width(n - j)
            nxt = j + w
            target, tw = (pb + nxt * item, panel_width(n - nxt)) if nxt < n else (pnext, panel_width(n))
            for bi, i in enumerate(range(ic, ie, MR)):
                if target:
                    for kk in range(bi * step, min(kl, (bi + 1) * step)):
                        row = target + kk * ldb * item
                        prefetch_l2(row)
                        prefetch_l2(row + 64)
                        if tw > NR:
                            prefetch_l2(row + 128)
                            prefetch_l2(row + 192)
                        prefetch_l2(row + tw * item - item)  # the row's last line when it is not 64-byte aligned
                _panel(
                    min(MR, ie - i),
                    w,
                    pc + (i * ldc + j) * item,
                    ldc,
                    pa + i * lda * item,
                    lda,
                    sak,
                    pb + j * item,
                    ldb,
                    kl,
                    accumulate,
                    bias + j * item if bias else 0,
                )
            j = nxt


@_inline
def gemm_table(
    pa: int, lda: int, sak: int, pb: int, table: int, pc: int, ldc: int, kl: int, m: int, n: int, accumulate: int
) -> None:
    """``c[:m, :n] = a[:m, :kl] @ b[:kl, :n]`` (plus the old ``c`` when ``accumulate``) where row k of ``b`` starts
    ``offsets[k]`` floats past address ``pb``, the int64 offsets at address ``table``: an implicit GEMM, whose rows
    of ``b`` are runs of the input read where they lie. Panels as ``gemm_tile`` (each row of ``b`` readable up to
    the next multiple of 16 columns), without its prefetch of the next panel into L2 (the rows sit there, written
    just before); the microkernels fetch the lines of row k + ``TABLE_AHEAD`` into L1 as they go."""
    item = 4
    for ic in range(0, m, MC):
        ie = min(ic + MC, m)
        j = 0
        while j < n:
            w = panel_width(n - j)
            for i in range(ic, ie, MR):
                _panel_table(
                    min(MR, ie - i),
                    w,
                    pc + (i * ldc + j) * item,
                    ldc,
                    pa + i * lda * item,
                    lda,
                    sak,
                    pb + j * item,
                    table,
                    kl,
                    accumulate,
                    0,
                )
            j += w


@_inline
def panel_width(left: int) -> int:
    """Columns of the next panel of ``gemm_tile`` with ``left`` columns to go: 64 (``WIDE``), all of 49-63 (one
    masked wide panel), else up to 32."""
    if left >= WIDE:
        return WIDE
    if left > WIDE - LANES:
        return left
    return min(NR, left)


@_jit
def gemm_f32(a: Any, b: Any, c: Any, bias: Any, has_bias: bool, i0: int, i1: int, j0: int, j1: int, pack: Any) -> None:
    """``c[i0:i1, j0:j1] = a[i0:i1] @ b[:, j0:j1]`` (plus ``bias[j0:j1]`` on every row when ``has_bias``) for
    float32 matrices: ``b``, ``c`` and ``bias`` with unit column stride, ``a`` any strides. Writes exactly that
    block of ``c``. With ``pack`` not empty (float32, ``panel_bytes(k)`` at least), each k block's 16- and
    32-column panels of ``b`` are first copied there, contiguous, and all rows run over the copy.

    Columns go in 32- then 16-wide panels; a last run of fewer than 16 is computed by one more 16-wide panel
    ending at ``j1``, over the whole k at once, which overwrites up to 15 columns already done (with sums rounded
    in another order, never mixed: each element is stored whole by one of the two), so only blocks narrower
    than 16 columns take the scalar loop."""
    kdim = a.shape[1]
    item = 4
    lda, sak = a.strides[0] // item, a.strides[1] // item
    ldb, ldc = b.strides[0] // item, c.strides[0] // item
    pa, pb, pc, pz = a.ctypes.data, b.ctypes.data, c.ctypes.data, bias.ctypes.data
    vec_end = j0 + (j1 - j0) // LANES * LANES
    packed = pack.size > 0
    for k0 in range(0, kdim, KC):  # the whole 16-column panels, k block by k block (no masked panel: n % 16 == 0)
        kl = min(KC, kdim - k0)
        a_k, bias_k = pa + (i0 * lda + k0 * sak) * item, pz if has_bias and k0 == 0 else 0
        next_k = pb + ((k0 + KC) * ldb + j0) * item if k0 + KC < kdim else 0
        if not packed:
            gemm_tile(
                a_k,
                lda,
                sak,
                pb + (k0 * ldb + j0) * item,
                ldb,
                pc + (i0 * ldc + j0) * item,
                ldc,
                kl,
                i1 - i0,
                vec_end - j0,
                k0,
                bias_k + j0 * item if bias_k else 0,
                next_k,
            )
            continue
        j = j0
        while j < vec_end:  # panel by panel: copied, then every row over the copy (a's k block stays in L2)
            w = NR if j + NR <= vec_end else LANES
            _copy_panel(pack.ctypes.data, pb + (k0 * ldb + j) * item, ldb, kl, w // LANES)
            gemm_tile(
                a_k,
                lda,
                sak,
                pack.ctypes.data,
                w,
                pc + (i0 * ldc + j) * item,
                ldc,
                kl,
                i1 - i0,
                w,
                k0,
                bias_k + j * item if bias_k else 0,
                pb + (k0 * ldb + j + w) * item if j + w < vec_end else next_k,
            )
            j += w
    if vec_end == j1:
        return
    if j1 - j0 >= LANES:
        j = j1 - LANES
        zb = pz + j * item if has_bias else 0
        for i in range(i0, i1, MR):
            _panel(
                min(MR, i1 - i),
                LANES,
                pc + (i * ldc + j) * item,
                ldc,
                pa + i * lda * item,
                lda,
                sak,
                pb + j * item,
                ldb,
                kdim,
                0,
                zb,
            )
        return
    for i in range(i0, i1):
        for j in range(j0, j1):
            s = numba.float32(bias[j]) if has_bias else numba.float32(0.0)
            for kk in range(kdim):
                s += a[i, kk] * b[kk, j]
            c[i, j] = s


@functools.cache  # its samples made once: phase 1 of every matmul, linear and conv part asks for it
def gemm_f32_entry() -> Any:
    """``gemm_f32``'s entry point for every caller (matmul, linear, conv2d): its one specialization, for float32
    matrices typed any layout, as it reads them through pointers and strides (contiguous, transposed and padded
    operands share one compile, ~15 s; attention's ``gemm_f32_heads`` runs it too)."""
    matrix, vector = any_layout(np.float32, 2), np.zeros(1, np.float32)
    return entry(gemm_f32, matrix, matrix, matrix, vector, False, 0, 0, 0, 0, vector[:0])


@_jit
def gemm_f32_heads(a: Any, b: Any, c: Any) -> None:
    """``c[i, h] = a[i, h] @ b[i, h]`` for every (i, h) of 4-D float32 stacks (attention's heads), each product
    by :func:`gemm_f32` (same stride rules, per matrix)."""
    none = np.zeros(1, np.float32)
    m, n = c.shape[2], c.shape[3]
    # no bias and 0 typed bool and int64, not as literals: ``gemm_f32_entry``'s specialization then runs here too,
    # where the literals False and 0 compiled another (~15 s)
    no_bias, zero = m < 0, m - m
    for i in range(c.shape[0]):
        for h in range(c.shape[1]):
            gemm_f32(a[i, h], b[i, h], c[i, h], none, no_bias, zero, m, zero, n, none[:0])


@_jit
def gemm_f32_ymm(a: Any, b: Any, c: Any) -> None:
    """``c = a @ b`` for float32 matrices of at least ``YMM`` columns (``b`` and ``c`` with unit column stride,
    ``a`` any strides) by the 8-lane kernels: MR-row blocks of 16- then 8-column panels over the whole k (the
    small products of attention's heads: one k block keeps a panel of ``b`` in L1 up to k = 512). A last run of
    fewer than 8 columns is one more 8-column panel ending at the last column, which stores again up to 7
    columns already done (each element is stored whole, by one panel or the other)."""
    m, kdim = a.shape
    n = b.shape[1]
    if n < YMM and m > 0:  # the last panel would start before column 0
        raise ValueError("gemm_f32_ymm: fewer than 8 columns")
    item = 4
    lda, sak = a.strides[0] // item, a.strides[1] // item
    ldb, ldc = b.strides[0] // item, c.strides[0] // item
    pa, pb, pc = a.ctypes.data, b.ctypes.data, c.ctypes.data
    wide = n // (2 * YMM) * (2 * YMM)
    for i in range(0, m, MR):
        rows, ci, ai = min(MR, m - i), pc + i * ldc * item, pa + i * lda * item
        for j in range(0, wide, 2 * YMM):
            _Y16(rows, ci + j * item, ldc, ai, lda, sak, pb + j * item, ldb, kdim, 0, 0)
        j = wide
        if j + YMM <= n:
            _Y8(rows, ci + j * item, ldc, ai, lda, sak, pb + j * item, ldb, kdim, 0, 0)
            j += YMM
        if j < n:
            _Y8(rows, ci + (n - YMM) * item, ldc, ai, lda, sak, pb + (n - YMM) * item, ldb, kdim, 0, 0)


# floats of ``b`` (k x columns) up to which ``gemm_tile_ymm`` runs each MR-row block over all its columns (``b``
# stays in L2, the row block in L1); above, 16-column panels go outermost, over blocks of rows of ``a`` of up to
# YMM_MC_FLOATS (the panel stays in L1, the rows in L2). One thread, t(rows outer) / t(panels outer), AMD Zen 3,
# 7 interleaved rounds (/tmp/w58/gv.py of the fifty-eighth session): 128 x 288 x 392 (8 images of 64 -> 128 3x3 s2)
# 1.2-1.25x, 128 x 576 x 196 1.3x, 128 x 512 x 256 1.05-1.16x, 512 x 512 x 256 1.1-1.3x; with b small the rows
# outermost stay faster: 256 x 576 x 98 0.9x, 512 x 512 x 49 0.93x (56 K and 25 K floats of b). Two threads, each
# its own product as im2col_tiles' parts, 9 interleaved rounds (gv2.py), medians: 128 x 288 x 392 1.30x, 256 x 461 x
# 196 (one image of 256^2 14^2) 1.17x, 64 x 147 x 448 (the stem) 1.16x, 128 x 64 x 784 1.02x. Through the op the
# conv layers' times moved by more from process to process than that (/tmp/w58/ab.sh). With panels outermost,
# prefetching the next panel's rows into L2 a slice per row block (as ``gemm_tile`` does on zmm) was measured and
# left out: forced im2col_tiles, two threads, 15 interleaved rounds, AMD Zen 3 (/tmp/w66/pfab.py of the sixty-sixth
# session), t(plain) / t(prefetch) over nine ResNet-18 layers 0.95-1.02x
YMM_PANELS_OUTER_FLOATS = 1 << 16
YMM_MC_FLOATS = 1 << 16


@_inline
def _ymm_rows(
    pa: int,
    lda: int,
    sak: int,
    pb: int,
    ldb: int,
    pc: int,
    ldc: int,
    kl: int,
    i0: int,
    i1: int,
    j0: int,
    j1: int,
    accumulate: int,
    bias: int,
) -> None:
    """``gemm_tile_ymm`` on the block of rows [i0, i1) and columns [j0, j1): MR-row blocks, each over 16-column
    panels, then one of 8 and a masked one for the rest."""
    item = 4
    for i in range(i0, i1, MR):
        rows, ci, ai = min(MR, i1 - i), pc + i * ldc * item, pa + i * lda * item
        j = j0
        while j < j1:
            w = ymm_panel_width(j1 - j)
            bj = bias + j * item if bias else 0
            _ymm_panel(rows, w, ci + j * item, ldc, ai, lda, sak, pb + j * item, ldb, kl, accumulate, bj)
            j += w


@_inline
def gemm_tile_ymm(
    pa: int,
    lda: int,
    sak: int,
    pb: int,
    ldb: int,
    pc: int,
    ldc: int,
    kl: int,
    m: int,
    n: int,
    accumulate: int,
    bias: int,
    pnext: int,
) -> None:
    """``gemm_tile`` (same arguments and contract; ``pnext`` unused) on the 8-lane kernels, for AVX2 (the fused
    attention tiles' products, im2col_tiles' GEMMs): MR-row blocks of 16-column panels, then one of 8 and a masked
    one for the rest, over the whole k; the panels outermost when ``b`` is larger than
    ``YMM_PANELS_OUTER_FLOATS``. Reads ``b``'s rows up to the next multiple of 8 columns."""
    mc, panel = max(m, 1), max(n, 1)  # one block of all rows and columns: each row block runs over every column
    if kl * n > YMM_PANELS_OUTER_FLOATS:
        blocks = -(-m // max(MR, YMM_MC_FLOATS // kl // MR * MR))
        mc, panel = max(MR, -(-m // blocks // MR) * MR), 2 * YMM  # row blocks as even as whole MR rows make them
    for i0 in range(0, m, mc):  # (one call site: the microkernels' code is inlined once)
        for j0 in range(0, n, panel):
            _ymm_rows(pa, lda, sak, pb, ldb, pc, ldc, kl, i0, min(m, i0 + mc), j0, min(n, j0 + panel), accumulate, bias)


# ``gemm_tile`` on this CPU's kernels: zmm registers where it has AVX-512, else the 8-lane kernels (AVX2 and FMA);
# bound at import, so the callers' compiled loops (fused attention, im2col_tiles) call it directly
host_gemm_tile = gemm_tile if available() else gemm_tile_ymm


@_inline
def gemm_table_ymm(
    pa: int, lda: int, sak: int, pb: int, table: int, pc: int, ldc: int, kl: int, m: int, n: int, accumulate: int
) -> None:
    """``gemm_table`` (same arguments and contract) on the 8-lane kernels, for AVX2: each 16-column panel over every
    MR-row block (the block of ``a`` streams past the panel's rows, which stay in L1), then one of 8 and a masked
    one for the rest. Reads ``b``'s rows up to the next multiple of 8 columns. Its microkernels do not prefetch
    row k + ``TABLE_AHEAD`` as the zmm ones do: a prototype of this loop on the stem's implicit GEMM (AMD Zen 3,
    one thread, five loop orders, /tmp/w64/direct2.py of the sixty-fourth session) ran 1.03-1.16x as fast as
    im2col_tiles without the prefetches and 0.95-1.15x with them."""
    item = 4
    j = 0
    while j < n:
        w = ymm_panel_width(n - j)
        for i in range(0, m, MR):
            ci, ai = pc + (i * ldc + j) * item, pa + i * lda * item
            _ymm_panel_table(min(MR, m - i), w, ci, ldc, ai, lda, sak, pb + j * item, table, kl, accumulate, 0)
        j += w


# ``gemm_table`` on this CPU's kernels, bound at import as ``host_gemm_tile`` is (conv2d's implicit GEMM)
host_gemm_table = gemm_table if available() else gemm_table_ymm


@_jit
def gemm_f32_heads_ymm(a: Any, b: Any, c: Any) -> None:
    """``c[i, h] = a[i, h] @ b[i, h]`` for every (i, h) of 4-D float32 stacks, each by :func:`gemm_f32_ymm`."""
    for i in range(c.shape[0]):
        for h in range(c.shape[1]):
            gemm_f32_ymm(a[i, h], b[i, h], c[i, h])
