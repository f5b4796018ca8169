"""scaled_dot_product_attention on (B, H, L, D) operands: fused query tiles (one compiled loop per helper thread),
materialized scores, tiles of whole score rows, or an online softmax over key tiles."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import ParamError
from ..kernels.cpu import attention_fused as fused
from ..kernels.cpu.attention import FANOUT_MIN, build_online, build_rows
from ..layout import align, broadcast_shape
from ..op import Attr, OpDef, Plan, register
from ..runtime.fanout import fanout_parts
from ..tensor import DType, TensorDesc
from .checks import as_bool, as_finite, check_dtype, need, optional
from .linalg import matrix_ok
from .selection import Candidate, choose, effective_limit

OP = "scaled_dot_product_attention"
DTYPES = (DType.float32, DType.float64)
MATERIALIZE_MAX = 32 << 20  # score bytes up to which the materialized implementation ranks first
TILE_TARGET = 4 << 20  # workspace bytes per tile of the tiled implementation when no limit binds
TILES = ((128, 1024), (64, 256), (16, 64), (4, 16), (1, 4), (1, 1))  # online: (queries, keys), largest first


@dataclass(frozen=True)
class AttentionTiling:
    """Score tiles of ``block_b`` batch entries x ``block_h`` heads x ``block_q`` queries x ``block_k`` keys.

    materialized / tiled (whole key rows): ``offsets`` of the workspace areas (scores, k^T, q, v, out), -1 for
    an operand used in place (k^T is packed unless the limit leaves no room: BLAS runs the plain layout faster). online:
    ``offsets`` of scores, pv, m, m_new, alpha, l, rowsum (unused areas of size 0). fused: tiles of ``block_q``
    queries against key blocks of ``block_k`` (every key the tiles see, or fewer: an online softmax), ``parts`` areas of
    ``area`` bytes (``kernels.cpu.attention_fused``)."""

    block_q: int
    block_k: int
    online: bool
    offsets: tuple[int, ...]
    workspace: int
    block_b: int = 1
    block_h: int = 1
    parts: int = 1  # fused: parts (helper threads), each with an area of ``area`` bytes
    area: int = 0
    mask_t: int = -1  # fused: offset of the mask's transposed copy (a mask shared by every head), -1 for none


@dataclass(frozen=True)
class Dims:
    """Problem sizes (``lk``: the keys any query sees, min(Lk, Lq) when ``causal``), which of q, v, out BLAS
    cannot take as they are (packed per tile) and whether it can take k^T in place."""

    b: int
    h: int
    lq: int
    lk: int
    d: int
    dv: int
    item: int
    pack_q: bool = False
    pack_v: bool = False
    pack_o: bool = False
    k_ok: bool = True
    causal: bool = False
    fused_ok: bool = False  # float32, v / out rows as ``attention_fused.available`` takes them
    general_mask: bool = False  # a mask whose rows differ between queries (not key padding)
    shared_mask: bool = False  # ... and the same for every batch entry and head


def tile_scores(p: Dims, tq: int) -> int:
    """Scores of the largest tile of ``tq`` query rows (of one head): tq * lk, except causal tiles of fewer than
    Lq rows, where the rows [q0, q0 + sq) see min(lk, q0 + sq) keys; the largest is then the last full tile or the
    partial one after it, which sees every key."""
    if not p.causal or tq >= p.lq:
        return tq * p.lk
    full = p.lq - p.lq % tq
    return max(tq * min(p.lk, full), (p.lq - full) * p.lk)


def rows_layout(p: Dims, tb: int, th: int, tq: int, pack_k: bool = True) -> AttentionTiling:
    """A tile of whole key rows and its workspace: align64(tb*th*tile_scores(tq)*item) scores, align64(tb*th*D*Lk*item)
    for k^T when ``pack_k``, then align64(rows*D*item) for q, align64(tb*th*Lk*Dv*item) for v and
    align64(rows*Dv*item) for out when those are packed (rows = tb*th*tq); 0 when Lk == 0."""
    heads, rows = tb * th, tb * th * tq
    sizes = [
        align(heads * tile_scores(p, tq) * p.item),
        align(heads * p.d * p.lk * p.item) if pack_k else -1,
        align(rows * p.d * p.item) if p.pack_q else -1,
        align(heads * p.lk * p.dv * p.item) if p.pack_v else -1,
        align(rows * p.dv * p.item) if p.pack_o else -1,
    ]
    offsets, off = [], 0
    for size in sizes:
        offsets.append(off if size >= 0 else -1)
        off += max(size, 0)
    return AttentionTiling(tq, p.lk, False, tuple(offsets), off if p.lk else 0, tb, th)


def materialized_workspace(p: Dims) -> int:
    """The materialized form's workspace: the whole problem as one tile (see ``rows_layout``)."""
    return rows_layout(p, p.b, p.h, p.lq).workspace


def row_tiling(p: Dims, budget: int, pack_k: bool = True) -> AttentionTiling | None:
    """The largest tile of whole key rows whose workspace fits ``budget`` bytes: whole batch entries, whole
    heads of one batch entry, or queries of one head; None when not even one row fits."""
    for tb in range(p.b, 1, -1):
        t = rows_layout(p, tb, p.h, p.lq, pack_k)
        if t.workspace <= budget:
            return t
    for th in range(p.h, 1, -1):
        t = rows_layout(p, 1, th, p.lq, pack_k)
        if t.workspace <= budget:
            return t
    lo, hi = 0, max(p.lq, 1)  # the workspace grows with the queries per tile: the largest that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if rows_layout(p, 1, 1, mid, pack_k).workspace <= budget:
            lo = mid
        else:
            hi = mid - 1
    return rows_layout(p, 1, 1, lo, pack_k) if lo else None


def tiled_layout(bq: int, bk: int, lk: int, dv: int, item: int) -> AttentionTiling:
    """Online tile workspace: align64(bq*bk*item) scores, then for the online form (bk < Lk)
    align64(bq*Dv*item) for P@V and 5 * align64(bq*item) vectors, else 5 vectors too (max, sum used)."""
    online = bk < lk
    sizes = [align(bq * bk * item), align(bq * dv * item) if online else 0] + [align(bq * item)] * 5
    offsets, off = [], 0
    for s in sizes:
        offsets.append(off)
        off += s
    return AttentionTiling(bq, bk, online, tuple(offsets), off if lk else 0)


def fused_keys(p: Dims, tq: int, room: int) -> int:
    """Keys per block of the fused tiles of ``tq`` queries whose area fits ``room`` bytes: every key the tiles see
    while there are at most ``fused.keys_max()`` and they fit, else the fewest blocks of at most that many keys
    that fit, the keys shared evenly between them; 0 when neither every key nor blocks of 16 fit."""
    width = fused.row_width(tq)
    cap = fused.keys_max()
    if p.lk <= cap and align(fused.area_floats(p.lk, p.d, tq, p.lk) * p.item) <= room:
        return p.lk
    most = min(room // 64 * 64 // p.item // width - p.d - 3, cap, p.lk - 1)
    if most < 16:
        return 0
    return -(-p.lk // -(-p.lk // most))


def fused_tiling(p: Dims, budget: int) -> AttentionTiling | None:
    """The fused tiles: the most parts (up to the helper threads and the tiles; one below ``FANOUT_MIN`` scores in
    all, as the other implementations cut theirs), then of the tiles of 64, 48, 32, 16 or 8 queries (or Lq if
    fewer: whole vectors of the score GEMM), each with the largest key blocks (``fused_keys``) whose areas fit
    ``budget`` bytes, the one with the least 1/queries + 1/keys (both cost in proportion: a k row's load is shared
    by the tile's queries, a block's rescale of the sums and out by its keys); None when none fits. Causal tiles
    see min(Lk, Lq) keys at most (``p.lk``)."""
    sizes = sorted({min(p.lq, tq) for tq in (fused.TQ_MAX, 48, 32, 16, 8)}, reverse=True)
    most = fanout_parts() if p.b * p.h * p.lq * p.lk >= FANOUT_MIN else 1
    for parts in range(max(1, most), 0, -1):
        best: tuple[float, AttentionTiling] | None = None
        for tq in sizes:
            used = max(1, min(parts, p.b * p.h * -(-p.lq // tq)))
            bk = fused_keys(p, tq, budget // used)
            if bk:
                area = align(fused.area_floats(p.lk, p.d, tq, bk) * p.item)
                cost = 1 / tq + 1 / bk
                if best is None or cost < best[0]:
                    best = cost, AttentionTiling(tq, bk, False, (), used * area, parts=used, area=area)
        if best is not None:
            return best[1]
    return None


# On the 8-lane kernels (AVX2) the fused tiles rank ahead of the materialized form only causal, from ``FANOUT_MIN``
# scores (where they run in parts); below those the materialized form's batched GEMMs ran faster, and not causal the two
# ran within 11% of each other either way. Both forced, through the op, two threads, 11 interleaved rounds, AMD Zen 3
# (/tmp/w57/fc.py of the fifty-seventh session), t(materialized) / t(fused): causal (4, 4, 32, 32) 0.86, (1, 4, 64, 64)
# 0.90, (1, 12, 128, 32) 1.14, (32, 4, 64, 16) 1.19, (8, 12, 128, 32) 1.05-1.07, (8, 12, 128, 64) 1.13, (2, 12, 256, 64)
# 1.15, (1, 12, 512, 64) 1.21; not causal (8, 12, 128, 32) 0.94-0.98, (1, 12, 512, 64) 0.89-0.98, (2, 12, 256, 64) 1.01,
# (8, 12, 128, 64) 1.03, (1, 8, 1024, 64) 1.09


def plan_attention(p: Dims, limit: Any, lk_all: int | None = None) -> Plan:
    """Candidates: fused first where it runs (``fused_tiling``; on the 8-lane kernels after the materialized form
    where that is not too big, unless causal with ``FANOUT_MIN`` scores or more; a mask that differs
    between queries but not between heads copied transposed after the parts' areas where that leaves room for them,
    else such a mask ranks fused after the materialized form, and when that is too big after 4 MiB tiles too, unless
    the limit is below 4 MiB), then materialized (first while its scores take <= 32 MiB), tiled (whole key rows, the
    largest tile that fits the limit, at most 4 MiB of workspace when the materialized form is too big), then online
    tiles largest first (``lk_all``: every key, for the online layout; default ``p.lk``)."""
    lim = effective_limit(OP, limit)
    lk_all = p.lk if lk_all is None else lk_all
    full = rows_layout(p, p.b, p.h, p.lq)
    mat = Candidate("materialized", full, full.workspace)
    big = p.b * p.h * p.lq * p.lk * p.item > MATERIALIZE_MAX
    budget = TILE_TARGET if big else full.workspace
    if lim is not None:
        budget = min(budget, lim)
    rows = row_tiling(p, budget)
    tiled = [] if rows is None else [Candidate("tiled", rows, rows.workspace)]
    if rows is None and p.k_ok:  # k^T used in place (a slower GEMM layout) when no tile with its copy fits
        bare = row_tiling(p, budget, pack_k=False)
        if bare is not None:
            tiled.append(Candidate("tiled", bare, bare.workspace))
    if not tiled and p.lq:  # one row: it does not fit, but the error then names the smallest workspace
        one = rows_layout(p, 1, 1, 1, pack_k=not p.k_ok)
        tiled.append(Candidate("tiled", one, one.workspace))
    online: list[Candidate] = []
    seen = set()
    for bq, bk in TILES:
        bq, bk = max(min(bq, p.lq), 1), max(min(bk, lk_all), 1)
        if (bq, bk) not in seen:
            seen.add((bq, bk))
            t = tiled_layout(bq, bk, lk_all, p.dv, p.item)
            online.append(Candidate("online", t, t.workspace))
    cands = tiled + [mat] + online if big else [mat] + tiled + online
    if p.fused_ok and p.lq and p.lk:
        room = TILE_TARGET if lim is None else min(TILE_TARGET, lim)
        copy = align(p.lq * lk_all * 4) if p.shared_mask else 0
        ymm_later = not (fused.on_zmm() or (p.causal and p.b * p.h * p.lq * p.lk >= FANOUT_MIN))
        ahead = 1 if ymm_later and not big else 0
        ft = fused_tiling(p, room - copy) if copy and copy < room else None
        if ft is not None:  # the shared mask copied transposed: each score reads it from a dense row
            ft = replace(ft, workspace=ft.workspace + copy, mask_t=ft.workspace)
            cands.insert(ahead, Candidate("fused", ft, ft.workspace))
        elif (ft := fused_tiling(p, room)) is not None:
            if p.general_mask:  # read across the queries, one load per score: behind whole heads or 4 MiB tiles
                ahead = 1 if not big else len(tiled) + 1 if budget >= TILE_TARGET else 0
            cands.insert(ahead, Candidate("fused", ft, ft.workspace))
    return choose(OP, cands, lim)


def _infer(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
    q, k, v = (need(OP, n, d) for n, d in zip(("q", "k", "v"), ins[:3]))
    mask = ins[3]
    for name, d in (("q", q), ("k", k), ("v", v)):
        check_dtype(OP, name, d, DTYPES)
        if d.ndim != 4:
            raise ParamError(op=OP, arg=name, expected="4 dims (B, H, L, D)", got=d.shape)
        if d.dtype is not q.dtype:
            raise ParamError(op=OP, arg=name, expected=f"dtype {q.dtype.value} (as q)", got=d.dtype.value)
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        raise ParamError(
            op=OP,
            arg="k" if k.shape[:2] != q.shape[:2] else "v",
            expected=f"batch and heads {q.shape[:2]} (as q)",
            got=(k.shape, v.shape),
        )
    if k.shape[3] != q.shape[3]:
        raise ParamError(op=OP, arg="k", expected=f"head dim {q.shape[3]} (as q)", got=k.shape)
    if v.shape[2] != k.shape[2]:
        raise ParamError(op=OP, arg="v", expected=f"{k.shape[2]} keys (as k)", got=v.shape)
    scores = q.shape[:3] + (k.shape[2],)
    if mask is not None:
        check_dtype(OP, "attn_mask", mask, (DType.bool, q.dtype))
        if mask.ndim > 4 or broadcast_shape(mask.shape, scores) != scores:
            raise ParamError(op=OP, arg="attn_mask", expected=f"a shape that broadcasts to {scores}", got=mask.shape)
        if attrs["is_causal"]:
            raise ParamError(op=OP, arg="is_causal", expected="False when attn_mask is given (as PyTorch)", got=True)
    return (TensorDesc(q.shape[:3] + (v.shape[3],), q.dtype),)


def _select(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
    q, k, v, mask, out = ins[0], ins[1], ins[2], ins[3], outs[0]
    b, h, lq, d = q.shape
    general = mask is not None and not (lq == 1 or mask.ndim < 2 or mask.shape[-2] == 1 or mask.strides[-2] == 0)
    lk = min(k.shape[2], lq) if attrs["is_causal"] else k.shape[2]  # causal: no query sees a later key
    p = Dims(
        b,
        h,
        lq,
        lk,
        d,
        v.shape[3],
        q.dtype.itemsize,
        not matrix_ok(q.shape, q.strides),
        not matrix_ok(v.shape, v.strides),
        not matrix_ok(out.shape, out.strides, out=True),
        matrix_ok(k.shape, k.strides),
        attrs["is_causal"],
        fused.available(q.dtype.np, v.shape[3], v.strides, out.strides),
        general,
        general and all(n == 1 or st == 0 for n, st in zip(mask.shape[:-2], mask.strides[:-2])),
    )
    return plan_attention(p, limit, k.shape[2])


def _build(plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]) -> Callable[[Any], None]:
    q, k, v, mask = ins
    out = outs[0]
    scale = attrs["scale"] if attrs["scale"] is not None else 1.0 / math.sqrt(q.shape[3]) if q.shape[3] else 1.0
    kind = "none"
    if mask is not None:
        kind = "bool" if mask.dtype == np.bool_ else "additive"
        mask = np.broadcast_to(mask, q.shape[:3] + (k.shape[2],))
    if out.size == 0:
        return lambda _: None
    if plan.implementation == "fused":
        return fused.build_fused(q, k, v, out, mask, kind, attrs["is_causal"], scale, plan.tiling)
    build = build_online if plan.implementation == "online" else build_rows
    return build(q, k, v, out, mask, kind, attrs["is_causal"], scale, plan.tiling)


def reference(q: Any, k: Any, v: Any, attn_mask: Any = None, is_causal: bool = False, scale: Any = None) -> Any:
    """float64 attention; rows with no allowed key give 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    d = q.shape[-1]
    s = q @ np.swapaxes(k, -1, -2) * (scale if scale is not None else 1.0 / math.sqrt(d) if d else 1.0)
    lq, lk = s.shape[-2:]
    if is_causal:
        s = np.where(np.tril(np.ones((lq, lk), bool)), s, -np.inf)
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        s = np.where(m, s, -np.inf) if m.dtype == bool else s + m.astype(np.float64)
    if lk == 0:
        return np.zeros(q.shape[:-1] + (v.shape[-1],))
    mx = np.max(s, axis=-1, keepdims=True)
    mx = np.where(np.isneginf(mx), 0.0, mx)
    e = np.exp(s - mx)
    tot = np.sum(e, axis=-1, keepdims=True)
    return (e @ v) / np.where(tot == 0, 1.0, tot)


scaled_dot_product_attention = register(
    OpDef(
        name=OP,
        inputs=("q", "k", "v", "attn_mask?"),
        attrs=(
            Attr("is_causal", as_bool, False, "mask keys after the query (top-left aligned)"),
            Attr("scale", optional(as_finite), None, "score scale; None means 1/sqrt(D)"),
        ),
        dtypes=DTYPES,
        infer=_infer,
        select=_select,
        kernels={"cpu": _build},
        implementations=("fused", "materialized", "tiled", "online"),
        workspace_formula=(
            "fused (P parts, tq queries a tile): P*align64((K + D + 2)*W*item) with every key at once, "
            "P*align64((bk + D + 3)*W*item) with blocks of bk keys, K = Lk (causal: min(Lk, Lq)), "
            "W = 8 for tq <= 8, else tq rounded up to 16, + align64(Lq*Lk*4) for the transposed copy of a mask "
            "whose rows differ between queries but which every head shares, where it fits; "
            "materialized: the tiled formula with one tile (tb, th, tq) = (B, H, Lq); tiled (tb x th x tq "
            "rows): align64(tb*th*S*item), S = tq*Lk (causal: Lk = min(Lk, Lq), and for tiles of tq < Lq "
            "rows of one head S = max(tq*min(Lk, F), (Lq - F)*Lk), F = Lq - Lq % tq: the scores of the "
            "largest tile) [+ align64(tb*th*D*Lk*item) for k^T, unless no tile with "
            "it fits the limit] [+ align64(tb*th*tq*D*item) if q is packed] [+ align64(tb*th*Lk*Dv*item) "
            "if v is packed] [+ align64(tb*th*tq*Dv*item) if out is packed] (q, v, out are packed when "
            "BLAS cannot take their matrices); "
            "online (bq x bk tile): align64(bq*bk*item) + 5*align64(bq*item) [+ align64(bq*Dv*item) if "
            "bk < Lk]; 0 if Lk == 0"
        ),
        doc=(
            "softmax(scale * q @ k^T + mask) @ v for (B, H, L, D) operands, float32 / float64; attn_mask is boolean "
            "(True = attend) or additive, broadcast to (B, H, Lq, Lk); rows with no allowed key give 0. fused "
            "(float32, Dv a multiple of 16 with v and out rows dense, on CPUs with AVX-512, or AVX2 and FMA, where "
            "it ranks after materialized unless causal with 512 keys or more): each of P parts (helper threads; one "
            "below 2^16 scores) runs its share of the tiles of tq "
            "queries of one head (shares balanced by each tile's queries x keys) in one compiled loop: "
            "S^T = k @ (scale q)^T by the register-blocked GEMM, a softmax down S^T's columns, out = P @ v with P "
            "read from S^T, rows divided by their sums; causal tiles run only the keys up to their last query, tiles "
            "under a key-padding mask only those up to the last its head keeps (exactly). "
            "Past 512 keys, or where every key does not fit the limit, the keys run in even blocks of bk (16 at "
            "least) with an online softmax. Unlimited: tq = 64 and every key up to 512; under workspace_limit the "
            "tq of 64, 48, 32, 16, 8 and the largest bk whose P areas fit with the least 1/tq + 1/bk. "
            "materialized:"
            " the whole score matrix in the workspace, with k^T packed (and q, v, out when BLAS cannot take them): "
            "one batched GEMM for the scores, one fused pass over the rows (scale, mask, max, exp, sum, "
            "normalize), one batched GEMM into out; from 2^16 scores a tile is cut into parts (batch entries, heads "
            "or query rows), each with its own GEMMs and row pass, on helper threads; causal rows are multiplied in "
            "blocks of 64 queries (float32 with the AVX-512 kernel) or 32, each against the keys up to its last "
            "query only. tiled: the same per tile of "
            "whole key rows (queries of one head, "
            "whole heads, or whole batch entries; causal tiles skip the keys they cannot see), the largest tile that "
            "fits workspace_limit (see workspace_formula). online: query tiles of bq rows against key tiles of bk "
            "keys with an online softmax, align64(bq*bk*item) + 5*align64(bq*item), + align64(bq*Dv*item) when the "
            "keys take more than one tile, for limits below one row of scores. A key-padding mask (one mask row for "
            "every query, e.g. (B, 1, 1, Lk)) is read at each launch: every implementation runs only the keys up to "
            "the last one a tile (online: a head) keeps, rounded up to 16 (a bool mask whose rows in the tile all keep "
            "the same keys: exactly those, without the mask), and never reads k / v past them (a "
            "padded tile touches less of the workspace; NaN in a skipped key's k / v does not reach the output, "
            "unlike PyTorch). Ranked: fused first where it runs, its tiles taking at most 4 MiB (a mask whose rows "
            "differ between queries: copied transposed at each launch when every head shares it and the copy leaves "
            "room, else read one score at a time across the queries and ranked after materialized, and when that is "
            "too big after 4 MiB tiles unless the limit is below 4 MiB); then materialized first while its "
            "scores take <= 32 MiB (else after tiled, whose tiles then take at most 4 MiB), then online tiles from "
            "(128, 1024) down to (1, 1); the first that fits workspace_limit wins."
        ),
        reference=reference,
    )
)
