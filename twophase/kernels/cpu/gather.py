"""Row gather (embedding) with an index range check done inside the kernel."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import ParamError
from ...layout import as_matrix
from .elementwise import kern
from .jit import entry


@kern
def gather_rows(w: Any, idx: Any, out: Any) -> int:
    """out[i] = w[idx[i, 0]]; returns the first position whose index is out of range, or -1."""
    n_emb = w.shape[0]
    for i in range(idx.shape[0]):
        j = idx[i, 0]
        if j < 0 or j >= n_emb:
            return i
        for c in range(w.shape[1]):
            out[i, c] = w[j, c]
    return -1


def build_embedding(w: Any, idx: Any, out: Any) -> Callable[[Any], None]:
    """Launch of the gather; indices whose dims do not merge into one stride are first copied to the workspace."""
    n = idx.size
    if n == 0:
        return lambda _: None
    flat = as_matrix(idx, tuple(range(idx.ndim)), ())
    rows = as_matrix(out, tuple(range(out.ndim - 1)), (out.ndim - 1,))
    assert rows is not None, "embedding output is dense"
    fn = entry(gather_rows, w, flat if flat is not None else np.empty((1, 1), idx.dtype), rows)
    n_emb = w.shape[0]

    def launch(ws: Any) -> None:
        ix = flat
        if ix is None:
            ix = ws[: n * idx.itemsize].view(idx.dtype).reshape(n, 1)
            np.copyto(ix.reshape(idx.shape), idx)
        bad = fn(w, ix, rows)
        if bad >= 0:
            raise ParamError(
                op="embedding",
                arg="indices",
                expected=f"indices in [0, {n_emb})",
                got=f"{int(ix[bad, 0])} at flat position {bad}",
            )

    return launch
