"""Scaled dot-product attention launches: the full score matrix in the workspace, or query tiles with an
online softmax over key tiles (workspace per tile only). Fully masked rows give 0, never NaN."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...layout import align
from .jit import entry, jit

Launch = Callable[[Any], None]


@jit
def mask_bool(s: Any, keep: Any) -> None:
    """s[b, h, i, j] = -inf where not keep[b, h, i, j] (``keep`` broadcast to ``s``'s shape)."""
    nb, nh, nq, nk = s.shape
    for b in range(nb):
        for h in range(nh):
            for i in range(nq):
                for j in range(nk):
                    if not keep[b, h, i, j]:
                        s[b, h, i, j] = -np.inf


@jit
def mask_causal(s: Any, q0: int, k0: int) -> None:
    """s[..., i, j] = -inf where key k0 + j comes after query q0 + i (top-left aligned, as PyTorch)."""
    nb, nh, nq, nk = s.shape
    for b in range(nb):
        for h in range(nh):
            for i in range(nq):
                for j in range(max(q0 + i + 1 - k0, 0), nk):
                    s[b, h, i, j] = -np.inf


class _Masker:
    """Applies scale and the mask to a score block (4-D, C-contiguous) whose rows / cols start at q0 / k0."""

    def __init__(self, dtype: Any, scale: float, mask: Any, kind: str, causal: bool) -> None:
        self.scale, self.mask, self.kind, self.causal = scale, mask, kind, causal
        sample = np.empty((1, 1, 1, 1), dtype)
        self.k_causal = entry(mask_causal, sample, 0, 0) if causal else None
        self.k_bool = entry(mask_bool, sample, mask) if kind == "bool" else None

    def __call__(self, s: Any, b: Any, h: Any, q0: int, nq: int, k0: int, nk: int) -> None:
        np.multiply(s, self.scale, out=s)
        if self.kind == "additive":
            np.add(s, self.mask[b, h, q0:q0 + nq, k0:k0 + nk], out=s)
        elif self.kind == "bool":
            self.k_bool(s, self.mask[b, h, q0:q0 + nq, k0:k0 + nk])
        if self.causal and k0 + nk - 1 > q0:
            self.k_causal(s, q0, k0)


def _finfo(dtype: Any) -> tuple[float, float]:
    fi = np.finfo(dtype)
    return float(-fi.max), float(fi.tiny)


def build_materialized(q: Any, k: Any, v: Any, out: Any, mask: Any, kind: str, causal: bool, scale: float,
                       t: Any) -> Launch:
    """S = scale * q @ k^T (+ mask) over the whole batch in the workspace, softmax rows, out = P @ v."""
    nb, nh, nq, _ = q.shape
    nk = k.shape[2]
    dt = q.dtype
    masker = _Masker(dt, scale, mask, kind, causal)
    kt = k.swapaxes(-1, -2)
    lowest, tiny = _finfo(dt)
    s_bytes = nb * nh * nq * nk * dt.itemsize
    v_bytes = nb * nh * nq * dt.itemsize
    off_m, off_l = align(s_bytes), align(s_bytes) + align(v_bytes)
    if nk == 0:
        return lambda _: out.fill(0)  # type: ignore[no-any-return]

    def launch(ws: Any) -> None:
        s = ws[:s_bytes].view(dt).reshape(nb, nh, nq, nk)
        m = ws[off_m:off_m + v_bytes].view(dt).reshape(nb, nh, nq, 1)
        lsum = ws[off_l:off_l + v_bytes].view(dt).reshape(nb, nh, nq, 1)
        np.matmul(q, kt, out=s)
        masker(s, slice(None), slice(None), 0, nq, 0, nk)
        np.max(s, axis=-1, keepdims=True, out=m)
        np.maximum(m, lowest, out=m)  # a fully masked row keeps max -FLT_MAX: its exps are 0, not NaN
        np.subtract(s, m, out=s)
        np.exp(s, out=s)
        np.sum(s, axis=-1, keepdims=True, out=lsum)
        np.maximum(lsum, tiny, out=lsum)  # and its sum is tiny: 0 / tiny = 0
        np.matmul(s, v, out=out)
        np.divide(out, lsum, out=out)
    return launch


def build_tiled(q: Any, k: Any, v: Any, out: Any, mask: Any, kind: str, causal: bool, scale: float,
                t: Any) -> Launch:
    """Per (batch, head, query tile): scores of one key tile at a time, running max / sum (online softmax),
    the output tile accumulating in place."""
    nb, nh, nq, _ = q.shape
    nk, dv = k.shape[2], v.shape[3]
    dt = q.dtype
    bq, bk = t.block_q, t.block_k
    masker = _Masker(dt, scale, mask, kind, causal)
    lowest, tiny = _finfo(dt)
    item = dt.itemsize
    offs = t.offsets  # scores, pv, m, m_new, alpha, l, rowsum
    online = t.online
    if nk == 0:
        return lambda _: out.fill(0)  # type: ignore[no-any-return]

    def vec(ws: Any, i: int, n: int) -> Any:
        return ws[offs[i]:offs[i] + n * item].view(dt)

    def launch(ws: Any) -> None:
        for b in range(nb):
            for h in range(nh):
                for q0 in range(0, nq, bq):
                    n_q = min(bq, nq - q0)
                    kend = min(nk, q0 + n_q) if causal else nk
                    qt, ot = q[b, h, q0:q0 + n_q], out[b, h, q0:q0 + n_q]
                    m, msum = vec(ws, 2, n_q), vec(ws, 5, n_q)
                    m.fill(-np.inf)
                    msum.fill(0)
                    ot.fill(0)
                    for k0 in range(0, kend, bk):
                        n_k = min(bk, kend - k0)
                        s = ws[:n_q * n_k * item].view(dt).reshape(1, 1, n_q, n_k)
                        np.matmul(qt, k[b, h, k0:k0 + n_k].T, out=s[0, 0])
                        masker(s, slice(b, b + 1), slice(h, h + 1), q0, n_q, k0, n_k)
                        s2 = s[0, 0]
                        m_new, alpha, rs = vec(ws, 3, n_q), vec(ws, 4, n_q), vec(ws, 6, n_q)
                        if not online:  # the keys fit one tile: plain softmax, P @ V straight into out
                            np.max(s2, axis=1, out=m)
                            np.maximum(m, lowest, out=m)
                            np.subtract(s2, m[:, None], out=s2)
                            np.exp(s2, out=s2)
                            np.sum(s2, axis=1, out=msum)
                            np.matmul(s2, v[b, h, k0:k0 + n_k], out=ot)
                            continue
                        np.max(s2, axis=1, out=m_new)
                        np.maximum(m_new, m, out=m_new)
                        np.maximum(m_new, lowest, out=m_new)
                        np.subtract(m, m_new, out=alpha)
                        np.exp(alpha, out=alpha)
                        np.subtract(s2, m_new[:, None], out=s2)
                        np.exp(s2, out=s2)
                        np.sum(s2, axis=1, out=rs)
                        np.multiply(msum, alpha, out=msum)
                        np.add(msum, rs, out=msum)
                        pv = ws[offs[1]:offs[1] + n_q * dv * item].view(dt).reshape(n_q, dv)
                        np.matmul(s2, v[b, h, k0:k0 + n_k], out=pv)
                        np.multiply(ot, alpha[:, None], out=ot)
                        np.add(ot, pv, out=ot)
                        np.copyto(m, m_new)
                    np.maximum(msum, tiny, out=msum)
                    np.divide(ot, msum[:, None], out=ot)
    return launch
