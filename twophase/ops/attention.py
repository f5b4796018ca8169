"""scaled_dot_product_attention on (B, H, L, D) operands: materialized scores or tiled online softmax."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ParamError
from ..kernels.cpu.attention import build_materialized, build_tiled
from ..layout import align, broadcast_shape
from ..op import Attr, OpDef, Plan, register
from ..tensor import DType, TensorDesc
from .checks import as_bool, as_float, check_dtype, need, optional
from .selection import Candidate, choose

OP = "scaled_dot_product_attention"
DTYPES = (DType.float32, DType.float64)
MATERIALIZE_MAX = 8 << 20  # score bytes up to which the materialized implementation ranks first
TILES = ((128, 1024), (64, 256), (16, 64), (4, 16), (1, 4), (1, 1))  # (queries, keys) per tile, largest first


@dataclass(frozen=True)
class AttentionTiling:
    """``block_q`` x ``block_k`` score tiles (the whole problem for materialized); ``offsets`` of the
    workspace areas: scores, pv, m, m_new, alpha, l, rowsum (unused areas have size 0)."""

    block_q: int
    block_k: int
    online: bool
    offsets: tuple[int, ...]
    workspace: int


def materialized_workspace(b: int, h: int, lq: int, lk: int, item: int) -> int:
    """align64(B*H*Lq*Lk*item) for the scores + 2 * align64(B*H*Lq*item) for row max and row sum."""
    if lk == 0:
        return 0
    return align(b * h * lq * lk * item) + 2 * align(b * h * lq * item)


def tiled_layout(bq: int, bk: int, lk: int, dv: int, item: int) -> AttentionTiling:
    """Workspace of one tile: align64(bq*bk*item) scores, then for the online form (bk < Lk)
    align64(bq*Dv*item) for P@V and 5 * align64(bq*item) vectors, else 5 vectors too (max, sum used)."""
    online = bk < lk
    sizes = [align(bq * bk * item), align(bq * dv * item) if online else 0] + [align(bq * item)] * 5
    offsets, off = [], 0
    for s in sizes:
        offsets.append(off)
        off += s
    return AttentionTiling(bq, bk, online, tuple(offsets), off if lk else 0)


def plan_attention(b: int, h: int, lq: int, lk: int, dv: int, item: int, limit: Any) -> Plan:
    """Candidates ranked by size: materialized first while its scores take <= 8 MiB, then tiles largest first."""
    mat_ws = materialized_workspace(b, h, lq, lk, item)
    mat = Candidate("materialized", AttentionTiling(lq, lk, False, (0, align(b * h * lq * lk * item)), mat_ws),
                    mat_ws)
    tiles: list[Candidate] = []
    seen = set()
    for bq, bk in TILES:
        bq, bk = max(min(bq, lq), 1), max(min(bk, lk), 1)
        if (bq, bk) not in seen:
            seen.add((bq, bk))
            t = tiled_layout(bq, bk, lk, dv, item)
            tiles.append(Candidate("tiled", t, t.workspace))
    cands = [mat] + tiles if b * h * lq * lk * item <= MATERIALIZE_MAX else tiles[:1] + [mat] + tiles[1:]
    return choose(OP, cands, limit)


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
        raise ParamError(op=OP, arg="k" if k.shape[:2] != q.shape[:2] else "v",
                         expected=f"batch and heads {q.shape[:2]} (as q)", got=(k.shape, v.shape))
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
            raise ParamError(op=OP, arg="is_causal", expected="False when attn_mask is given (as PyTorch)",
                             got=True)
    return (TensorDesc(q.shape[:3] + (v.shape[3],), q.dtype),)


def _select(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
    q, k, v = ins[0], ins[1], ins[2]
    b, h, lq, _ = q.shape
    return plan_attention(b, h, lq, k.shape[2], v.shape[3], q.dtype.itemsize, limit)


def _build(plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]) -> Callable[[Any], None]:
    q, k, v, mask = ins
    out = outs[0]
    scale = attrs["scale"] if attrs["scale"] is not None else 1.0 / math.sqrt(q.shape[3]) if q.shape[3] else 1.0
    kind = "none"
    if mask is not None:
        kind = "bool" if mask.dtype == np.bool_ else "additive"
        mask = np.broadcast_to(mask, q.shape[:3] + (k.shape[2],))
    build = build_materialized if plan.implementation == "materialized" else build_tiled
    if out.size == 0:
        return lambda _: None
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


scaled_dot_product_attention = register(OpDef(
    name=OP,
    inputs=("q", "k", "v", "attn_mask?"),
    attrs=(Attr("is_causal", as_bool, False, "mask keys after the query (top-left aligned)"),
           Attr("scale", optional(as_float), None, "score scale; None means 1/sqrt(D)")),
    dtypes=DTYPES,
    infer=_infer,
    select=_select,
    kernels={"cpu": _build},
    implementations=("materialized", "tiled"),
    workspace_formula=("materialized: align64(B*H*Lq*Lk*item) + 2*align64(B*H*Lq*item); tiled (bq x bk tile): "
                       "align64(bq*bk*item) + 5*align64(bq*item) [+ align64(bq*Dv*item) if bk < Lk]; 0 if Lk == 0"),
    doc=("softmax(scale * q @ k^T + mask) @ v for (B, H, L, D) operands, float32 / float64; attn_mask is boolean "
         "(True = attend) or additive, broadcast to (B, H, Lq, Lk); rows with no allowed key give 0. "
         "materialized: the whole score matrix in the workspace, align64(B*H*Lq*Lk*item) + "
         "2*align64(B*H*Lq*item) bytes. tiled: query tiles of bq rows against key tiles of bk keys with an online "
         "softmax, workspace per tile only: align64(bq*bk*item) + 5*align64(bq*item), + align64(bq*Dv*item) when "
         "the keys take more than one tile. Ranked: materialized first while its scores take <= 8 MiB, then tiles "
         "from (128, 1024) down to (1, 1); the first that fits workspace_limit wins."),
    reference=reference,
))
