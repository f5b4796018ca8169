"""max_pool2d, avg_pool2d (ceil_mode, count_include_pad) and adaptive_avg_pool2d, NCHW or NHWC; workspace 0."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ParamError
from ..kernels.cpu.pool import build_pool
from ..op import Attr, OpDef, Plan, register
from ..tensor import DType, Format, TensorDesc
from .checks import as_bool, check_dtype, need, optional
from .conv import as_pair, logical, nchw
from .selection import Candidate, choose

DTYPES = (DType.float32, DType.float64)


def pool_out(n: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    """PyTorch's pooling output size (a ceil-mode window must start inside the input or its left padding)."""
    o = (n + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil else 0)) // s + 1
    if ceil and (o - 1) * s >= n + p:
        o -= 1
    return o


def _x(op: str, ins: tuple[TensorDesc | None, ...]) -> TensorDesc:
    x = need(op, "x", ins[0])
    check_dtype(op, "x", x, DTYPES)
    if x.ndim != 4:
        raise ParamError(op=op, arg="x", expected="4 dims (NCHW, or NHWC with Format.NHWC)", got=x.shape)
    return x


def _out_desc(x: TensorDesc, oh: int, ow: int) -> TensorDesc:
    (n, c, _, _), _ = nchw(x)
    if x.format is Format.NHWC:
        return TensorDesc((n, oh, ow, c), x.dtype, format=Format.NHWC)
    return TensorDesc((n, c, oh, ow), x.dtype, format=x.format)


def _geometry(op: str, x: TensorDesc, attrs: dict[str, Any]) -> tuple[int, ...]:
    (_, _, h, w), _ = nchw(x)
    (kh, kw) = attrs["kernel_size"]
    (sh, sw) = attrs["stride"] if attrs["stride"] is not None else (kh, kw)
    (ph, pw) = attrs["padding"]
    (dh, dw) = attrs.get("dilation", (1, 1))
    for name, v in (("kernel_size", (kh, kw)), ("stride", (sh, sw)), ("dilation", (dh, dw))):
        if min(v) < 1:
            raise ParamError(op=op, arg=name, expected="values >= 1", got=v)
    if min(ph, pw) < 0 or ph > kh // 2 or pw > kw // 2:
        raise ParamError(
            op=op, arg="padding", expected=f"values in [0, kernel_size // 2] = [0, {(kh // 2, kw // 2)}]", got=(ph, pw)
        )
    oh, ow = pool_out(h, kh, sh, ph, dh, attrs["ceil_mode"]), pool_out(w, kw, sw, pw, dw, attrs["ceil_mode"])
    if oh < 1 or ow < 1:
        raise ParamError(op=op, arg="x", expected=f"spatial size at least the window {(kh, kw)}", got=x.shape)
    return kh, kw, sh, sw, ph, pw, dh, dw, oh, ow


def _select(op: str) -> Any:
    def select(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
        geo = _geometry(op, ins[0], attrs)[:8] if "kernel_size" in attrs else ()
        return choose(op, [Candidate("direct", (geo, ins[0].format is Format.NHWC), 0)], limit)

    return select


def _builder(kind: str) -> Any:
    def build(plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]) -> Callable[[Any], None]:
        geo, nhwc = plan.tiling
        return build_pool(
            kind, logical(ins[0], nhwc), logical(outs[0], nhwc), geo, bool(attrs.get("count_include_pad", True))
        )

    return build


def _windows(x: Any, geo: tuple[int, ...], fill: float) -> Any:
    """float64 (N, C, OH, OW, KH*KW) windows of a padded NCHW array, ``fill`` outside the input."""
    kh, kw, sh, sw, ph, pw, dh, dw, oh, ow = geo
    n, c, h, w = x.shape
    big = np.full((n, c, h + 2 * ph + sh * oh + dh * kh, w + 2 * pw + sw * ow + dw * kw), fill)
    big[:, :, ph : ph + h, pw : pw + w] = x
    out = np.empty((n, c, oh, ow, kh * kw))
    for i in range(kh):
        for j in range(kw):
            out[..., i * kw + j] = big[:, :, i * dh : i * dh + sh * oh : sh, j * dw : j * dw + sw * ow : sw][
                :, :, :oh, :ow
            ]
    return out


def _ref_max(
    x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1, ceil_mode: bool = False
) -> Any:
    x = np.asarray(x, np.float64)
    (kh, kw), (ph, pw), (dh, dw) = as_pair(kernel_size), as_pair(padding), as_pair(dilation)
    sh, sw = as_pair(stride) if stride is not None else (kh, kw)
    oh, ow = pool_out(x.shape[2], kh, sh, ph, dh, ceil_mode), pool_out(x.shape[3], kw, sw, pw, dw, ceil_mode)
    win = _windows(x, (kh, kw, sh, sw, ph, pw, dh, dw, oh, ow), -np.inf)
    return np.where(np.isnan(win).any(-1), np.nan, win.max(-1))


def _ref_avg(
    x: Any,
    kernel_size: Any,
    stride: Any = None,
    padding: Any = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
) -> Any:
    x = np.asarray(x, np.float64)
    (kh, kw), (ph, pw) = as_pair(kernel_size), as_pair(padding)
    sh, sw = as_pair(stride) if stride is not None else (kh, kw)
    h, w = x.shape[2:]
    oh, ow = pool_out(h, kh, sh, ph, 1, ceil_mode), pool_out(w, kw, sw, pw, 1, ceil_mode)
    out = np.empty(x.shape[:2] + (oh, ow))
    for i in range(oh):
        for j in range(ow):
            h0, w0 = i * sh - ph, j * sw - pw
            h1, w1 = min(h0 + kh, h + ph), min(w0 + kw, w + pw)
            div = (h1 - h0) * (w1 - w0)
            hs, ws_, he, we = max(h0, 0), max(w0, 0), min(h1, h), min(w1, w)
            if not count_include_pad:
                div = (he - hs) * (we - ws_)
            out[:, :, i, j] = x[:, :, hs:he, ws_:we].sum(axis=(2, 3)) / div
    return out


def _ref_adaptive(x: Any, output_size: Any) -> Any:
    x = np.asarray(x, np.float64)
    oh, ow = as_pair(output_size)
    h, w = x.shape[2:]
    out = np.empty(x.shape[:2] + (oh, ow))
    for i in range(oh):
        for j in range(ow):
            out[:, :, i, j] = x[:, :, i * h // oh : -(-(i + 1) * h // oh), j * w // ow : -(-(j + 1) * w // ow)].mean(
                (2, 3)
            )
    return out


def _infer_max(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
    x = _x("max_pool2d", ins)
    geo = _geometry("max_pool2d", x, attrs)
    return (_out_desc(x, geo[8], geo[9]),)


def _infer_avg(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
    x = _x("avg_pool2d", ins)
    geo = _geometry("avg_pool2d", x, attrs)
    return (_out_desc(x, geo[8], geo[9]),)


def _infer_adaptive(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
    x = _x("adaptive_avg_pool2d", ins)
    oh, ow = attrs["output_size"]
    (_, _, h, w), _ = nchw(x)
    if oh < 1 or ow < 1 or h < 1 or w < 1:
        raise ParamError(
            op="adaptive_avg_pool2d", arg="output_size", expected="sizes >= 1 (and a non-empty input)", got=(oh, ow)
        )
    return (_out_desc(x, oh, ow),)


_WINDOW = (
    Attr("kernel_size", as_pair),
    Attr("stride", optional(as_pair), None, "None means kernel_size"),
    Attr("padding", as_pair, (0, 0)),
)

max_pool2d = register(
    OpDef(
        name="max_pool2d",
        inputs=("x",),
        attrs=_WINDOW + (Attr("dilation", as_pair, (1, 1)), Attr("ceil_mode", as_bool, False)),
        dtypes=DTYPES,
        infer=_infer_max,
        select=_select("max_pool2d"),
        kernels={"cpu": _builder("max")},
        implementations=("direct",),
        workspace_formula="0",
        doc=(
            "2-D max pooling (NaN propagates), NCHW or NHWC, PyTorch's output size and ceil_mode; ranges of (N, C) "
            "planes on helper threads, a window tap per pass over an output row. Workspace: 0."
        ),
        reference=_ref_max,
    )
)

avg_pool2d = register(
    OpDef(
        name="avg_pool2d",
        inputs=("x",),
        attrs=_WINDOW + (Attr("ceil_mode", as_bool, False), Attr("count_include_pad", as_bool, True)),
        dtypes=DTYPES,
        infer=_infer_avg,
        select=_select("avg_pool2d"),
        kernels={"cpu": _builder("avg")},
        implementations=("direct",),
        workspace_formula="0",
        doc=(
            "2-D average pooling, NCHW or NHWC, with PyTorch's divisor: the window clipped to the padded input "
            "(count_include_pad) or to the input. Workspace: 0."
        ),
        reference=_ref_avg,
    )
)

adaptive_avg_pool2d = register(
    OpDef(
        name="adaptive_avg_pool2d",
        inputs=("x",),
        attrs=(Attr("output_size", as_pair),),
        dtypes=DTYPES,
        infer=_infer_adaptive,
        select=_select("adaptive_avg_pool2d"),
        kernels={"cpu": _builder("adaptive")},
        implementations=("direct",),
        workspace_formula="0",
        doc="Adaptive average pooling to output_size: rows [floor(i*H/OH), ceil((i+1)*H/OH)). Workspace: 0.",
        reference=_ref_adaptive,
    )
)
