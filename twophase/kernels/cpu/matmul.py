"""Matmul launches: BLAS (through ``np.matmul(out=)``) on operand views as they are, folded over broadcast
batches, or on operands packed densely into the workspace first."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ...layout import align, matrix2d
from ...runtime.fanout import bound, launcher, workspace_launcher
from . import gemm
from .blas import fused_gemm
from .elementwise import activation_in_place, activation_kernel

Launch = Callable[[Any], None]


def strided_view(x: Any, shape: tuple[int, ...], strides: tuple[int, ...]) -> Any:
    """A view of ``x``'s memory (from its first element) with ``shape`` and element ``strides``."""
    item = x.itemsize
    return as_strided(x, shape, tuple(s * item for s in strides))


def _fold_blocks(t: Any, a: Any, b: Any, out: Any) -> list[tuple[Any, Any, Any]]:
    """(a, b, out) 2-D views, one per index of the looped batch dims; folded dims merged into the rows."""
    g = t.fold
    loop_shape = t.out.shape[:g]
    blocks = []
    for idx in np.ndindex(*loop_shape):
        views = []
        for arr, spec, rows in ((a, t.a, True), (b, t.b, False), (out, t.out, True)):
            sub = arr[idx] if g else arr
            if rows and spec.rows_stride is not None:
                m, k = spec.folded_rows, spec.shape[-1]
                sub = as_strided(sub, (m, k), (spec.rows_stride * arr.itemsize, spec.strides[-1] * arr.itemsize))
            else:
                sub = sub[(0,) * (sub.ndim - 2)]
            views.append(sub)
        blocks.append((views[0], views[1], views[2]))
    return blocks


def build_matmul(
    t: Any,
    impl: str,
    a: Any,
    b: Any,
    out: Any,
    addend: tuple[Any, float, float] | None = None,
    activation: str = "none",
) -> Launch:
    """Launch computing ``out = act(alpha * (a @ b) + beta * c)`` (``addend = (c, alpha, beta)``; None: ``a @ b``;
    ``activation``: one of ``elementwise.ACTIVATIONS``) for tiling ``t`` of implementation ``impl``.

    ``a``, ``b``, ``out`` are the arrays as bound; their promoted views come from the tiling's specs. A single
    2-D GEMM with an addend runs as one BLAS call with ``beta`` (``blas.fused_gemm``) where numpy's BLAS allows,
    else as ``np.matmul`` followed by the epilogue. The microkernel applies the activation to each part's block
    right after computing it (in cache); the others in one pass over ``out`` after the GEMM.
    """
    if activation != "none" and impl != "microkernel":
        return _then_activate(build_matmul(t, impl, a, b, out, addend), activation, out)
    av = strided_view(a, t.a.shape, t.a.strides)
    bv = strided_view(b, t.b.shape, t.b.strides)
    ov = strided_view(out, t.out.shape, t.out.strides)
    if impl == "packed":
        return _build_packed(t, av, bv, ov, _epilogue_or_nothing(out, addend))
    if impl == "blas":
        blocks = [(av, bv, ov)]
    else:  # microkernel (one block), gemm_folded, batch_loop
        full = [strided_view(x, s.bshape, s.bstrides) for x, s in ((a, t.a), (b, t.b), (out, t.out))]
        blocks = _fold_blocks(t, full[0], full[1], full[2])
    if impl == "microkernel":
        return _build_micro(t, *blocks[0], out, addend, activation)
    if addend is not None and len(blocks) == 1:
        fused = fused_gemm(*blocks[0], out, *addend)  # None unless one 2-D GEMM BLAS can take as it is
        if fused is not None:
            return fused
    post = _epilogue_or_nothing(out, addend)
    if len(blocks) == 1:
        a2, b2, o2 = blocks[0]

        def gemm(ws: Any) -> None:
            np.matmul(a2, b2, out=o2)
            post(ws)

        return gemm

    def gemms(ws: Any) -> None:
        for a2, b2, o2 in blocks:
            np.matmul(a2, b2, out=o2)
        post(ws)

    return gemms


def _unit_axis(x: Any, row: bool) -> Any:
    """``x`` with a length-1 axis inserted before its last (``row``) or after it, strided as BLAS reads a matrix
    (numpy gives a new axis stride 0, which BLAS's leading dimension cannot be)."""
    if row:
        return as_strided(
            x, x.shape[:-1] + (1, x.shape[-1]), x.strides[:-1] + (x.strides[-1] * max(1, x.shape[-1]), x.strides[-1])
        )
    return as_strided(x, x.shape + (1,), x.strides + (x.itemsize,))


def _over_batch(x: Any, batch: tuple[int, ...]) -> Any:
    """The stack of matrices ``x`` broadcast over ``batch``, its matrices' strides kept (``np.broadcast_to`` zeroes
    a length-1 dim's stride, which BLAS cannot take as a leading dimension)."""
    lead = (0,) * (len(batch) - (x.ndim - 2)) + tuple(
        0 if n == 1 else st for n, st in zip(x.shape[:-2], x.strides[:-2])
    )
    return as_strided(x, batch + x.shape[-2:], lead + x.strides[-2:], writeable=False)


def build_in_place_addend(a: Any, b: Any, out: Any, alpha: float, beta: float) -> Launch | None:
    """``out = alpha * (a @ b) + beta * out`` (baddbmm with out the addend's own view): one BLAS call with
    ``beta`` per matrix of the batch, so no product overwrites the addend before it is read. None where BLAS
    cannot take an operand's layout or dtype, or ``alpha == 0`` (BLAS would skip the product)."""
    a2 = a if a.ndim >= 2 else _unit_axis(a, row=True)
    b2 = b if b.ndim >= 2 else _unit_axis(b, row=False)
    o = out if a.ndim >= 2 else _unit_axis(out, row=True)
    o = o if b.ndim >= 2 else _unit_axis(o, row=False)
    batch = o.shape[:-2]
    ab, bb = _over_batch(a2, batch), _over_batch(b2, batch)
    calls = []
    for idx in np.ndindex(*batch):
        oi = o[idx]  # one view object: fused_gemm takes c is out as in place
        call = fused_gemm(ab[idx], bb[idx], oi, oi, oi, alpha, beta)
        if call is None:
            return None
        calls.append(call)

    def launch(ws: Any) -> None:
        for call in calls:
            call(ws)

    return launch


def _epilogue_or_nothing(out: Any, addend: tuple[Any, float, float] | None) -> Launch:
    epilogue = None if addend is None else build_epilogue(out, *addend)
    return epilogue or (lambda _: None)


def _build_micro(
    t: Any, a2: Any, b2: Any, o2: Any, out: Any, addend: tuple[Any, float, float] | None, activation: str = "none"
) -> Launch:
    """The register-blocked float32 GEMM (``gemm.gemm_f32``), one call per part of ``t.parts``; a bias row
    (``addend`` a 1-D ``c`` over the columns, alpha = beta = 1, as linear passes it) is added by the kernel,
    any other addend by the epilogue after it. An activation runs in each part on the block it just computed,
    unless there is an epilogue (then once over ``out``, after it). With ``t.panels``, part i packs b's panels
    into the workspace's i-th ``align64(panel_bytes(K))``."""
    c, alpha, beta = (None, 1.0, 0.0) if addend is None else addend
    fused = (
        c is not None
        and (alpha, beta) == (1.0, 1.0)
        and c.ndim == 1
        and c.shape[0] == o2.shape[1]
        and c.strides[0] == c.itemsize
        and not np.shares_memory(c, out)
    )
    bias = c if fused else np.zeros(1, np.float32)
    if not fused and addend is not None and activation != "none":
        return _then_activate(_build_micro(t, a2, b2, o2, out, addend), activation, out)
    post: Launch = (lambda _: None) if fused else _epilogue_or_nothing(out, addend)
    no_pack = np.zeros(0, np.float32)
    fn = gemm.gemm_f32_entry()
    acts = [activation_in_place(activation, o2[p[0] : p[1], p[2] : p[3]]) for p in t.parts]

    def parts(packs: list[Any]) -> list[Callable[[], None]]:
        calls: list[Callable[[], None]] = []
        for p, act, pack in zip(t.parts, acts, packs):
            gemm_part = functools.partial(fn, a2, b2, o2, bias, fused, *p, pack)
            calls.append(gemm_part if act is None else functools.partial(_in_turn, gemm_part, act))
        return calls

    if t.panels:
        used = gemm.panel_bytes(b2.shape[0])
        area = align(used)

        def bind(ws: Any) -> Callable[[], None]:
            return bound(parts([ws[i * area : i * area + used].view(np.float32) for i in range(len(t.parts))]))

        run = workspace_launcher(bind)
    else:
        run = launcher(parts([no_pack] * len(t.parts)))

    def launch(ws: Any) -> None:
        run(ws)
        post(ws)

    return launch


def _then_activate(launch: Launch, name: str, out: Any) -> Launch:
    """``launch``, then the activation over all of ``out``: one 2-D view when its leading dims merge, else each
    2-D slab in turn (cut at launch, so phase 1 stays O(1) whatever the batch)."""
    if out.size == 0 or name == "none":
        return launch
    whole = matrix2d(out)
    sample = whole if whole is not None else out[(0,) * (out.ndim - 2)]
    kernel = activation_kernel(name, sample)
    assert kernel is not None
    lead = () if whole is not None else out.shape[:-2]

    def then(ws: Any) -> None:
        launch(ws)
        if whole is not None:
            kernel(whole)
            return
        for idx in np.ndindex(lead):
            kernel(out[idx])

    return then


def _in_turn(first: Callable[[], None], then: Callable[[], None]) -> None:
    first()
    then()


def _build_packed(t: Any, av: Any, bv: Any, ov: Any, post: Launch) -> Launch:
    dt = ov.dtype
    areas = []
    for view, is_packed, off in zip((av, bv, ov), t.pack, t.offsets):
        areas.append((view.shape, off, align(view.size * dt.itemsize) if is_packed else 0, is_packed))

    def launch(ws: Any) -> None:
        ops = []
        for (shape, off, nbytes, is_packed), view in zip(areas, (av, bv, ov)):
            ops.append(ws[off : off + nbytes].view(dt)[: view.size].reshape(shape) if is_packed else view)
        if areas[0][3]:
            np.copyto(ops[0], av)
        if areas[1][3]:
            np.copyto(ops[1], bv)
        np.matmul(ops[0], ops[1], out=ops[2])
        if areas[2][3]:
            np.copyto(ov, ops[2])
        post(ws)

    return launch


def build_epilogue(out: Any, c: Any, alpha: float, beta: float) -> Launch | None:
    """``out = alpha * out + beta * c`` in place (``c`` broadcast to ``out``; None and ``beta == 0`` skip it)."""
    if c is None or beta == 0:
        if alpha == 1:
            return None
        return lambda _: np.multiply(out, alpha, out=out)
    if beta == 1:
        if alpha == 1:
            return lambda _: np.add(out, c, out=out)

        def scale_add(_: Any) -> None:
            np.multiply(out, alpha, out=out)
            np.add(out, c, out=out)

        return scale_add
    ratio = alpha / beta
    if 2.0**-20 <= abs(ratio) <= 2.0**20:

        def general(_: Any) -> None:  # alpha*P + beta*c = beta * ((alpha/beta)*P + c), no scratch needed
            np.multiply(out, ratio, out=out)
            np.add(out, c, out=out)
            np.multiply(out, beta, out=out)

        return general

    def far_apart(_: Any) -> None:  # alpha/beta would overflow (or flush) (alpha/beta)*P: a temporary of c's size
        np.multiply(out, alpha, out=out)
        np.add(out, np.multiply(c, beta, dtype=out.dtype), out=out)

    return far_apart
