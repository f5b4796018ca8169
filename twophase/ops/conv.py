"""conv2d, NCHW or NHWC (``Format.NHWC``: shape (N, H, W, C)); weight (OC, C/groups, KH, KW) as PyTorch.

Implementations, ranked: gemm_1x1 (1x1, stride 1, no padding: GEMM on the operands, workspace 0), implicit
(float32, one group, NCHW, strides 1-2, AVX-512 or AVX2: no unfold; per part, chunks of output rows' input copied
into zero-padded phase planes, and one register-blocked GEMM per output row reading its unfolded rows there by
offset; first for output rows of 48 pixels or more that fill the GEMM's panels and windows of two taps or more, on
AVX2 only for inputs of at most 32 channels; else after im2col, last on AVX2), im2col_tiles
(float32, one group, NCHW out, AVX-512: per part, tiles of a k block x a few output rows, or up to 4 whole images,
unfolded into the workspace and multiplied there by the register-blocked GEMM; ahead of im2col when its tiles fill
the GEMM's 16-column panels or a limit makes im2col tile output rows), im2col_parts (maps of 512 pixels or more:
runs of output rows unfolded and multiplied by each helper thread in its own workspace area), im2col (the unfolded
input of a tile of whole images or output rows in the workspace, then one GEMM per tile; the tile shrinks to fit
``workspace_limit``), winograd4 (F(4x4, 3x3), float32: 36 GEMMs on transformed 6x6 tiles; ranked first on maps of 7
tile columns or more and 32 tiles, else after winograd), winograd (F(2x2, 3x3) for 3x3 stride-1 undilated
single-group convolutions: 16 GEMMs on transformed tiles; ranked first from 64 output tiles with 256 channels or
more, from 196 with 128-255, just ahead of im2col from 32, after winograd4 on wider maps) and direct (a numba loop
nest, workspace 0; ranked first for depthwise convolutions).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..errors import ParamError
from ..kernels.cpu import conv_implicit, gemm, winograd4
from ..kernels.cpu.conv import (
    WINO_FUSED_MAX_TILES,
    WINO_FUSED_ROWS,
    build_direct,
    build_gemm_1x1,
    build_im2col,
    build_im2col_parts,
    build_winograd,
    kept_weights,
    parts_areas,
    parts_units,
    unfold_parts,
    winograd_parts,
)
from ..kernels.cpu.conv_phases import images_area_floats as images_phase_area
from ..kernels.cpu.conv_phases import plane_usable
from ..kernels.cpu.conv_phases import usable as phases_usable
from ..kernels.cpu.conv_tiles import available as tiles_available
from ..kernels.cpu.conv_tiles import (
    build_im2col_tiles,
    partial_parts,
    widest_tile,
)
from ..kernels.cpu.conv_tiles import workspace_bytes as tiles_workspace
from ..layout import align, merge_dims, spread_stride
from ..op import PRIVATE_STATE, Attr, OpDef, Plan, register
from ..runtime.fanout import fanout_parts, split_range
from ..tensor import DType, Format, TensorDesc
from .checks import as_bool, as_int, check_dtype, need
from .linalg import _micro_parts, matrix_ok
from .selection import Candidate, choose, effective_limit

OP = "conv2d"
DTYPES = (DType.float32, DType.float64)


def as_pair(v: Any) -> tuple[int, int]:
    """An int or a pair of ints, as a pair; each below 2**31 (the kernels' index arithmetic is int64)."""
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise ValueError(v)
        a, b = as_int(v[0]), as_int(v[1])
    else:
        a = b = as_int(v)
    if max(a, b) >= 1 << 31:
        raise ValueError(v)
    return a, b


as_pair.expects = "an int or a pair of ints below 2**31"  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ConvTiling:
    """Geometry (logical NCHW), GEMM orientation (``cm``: out = W @ cols, ``pm``: out = cols @ W^T, ``""``: none)
    and the im2col tile: ``tile_n`` whole images (then ``tile_rows`` = OH) or ``tile_rows`` output rows of one
    image; ``staged``: the GEMM result goes to the workspace at ``out_offset`` (0 when nothing is unfolded:
    C = 0), then is copied into out.
    winograd: ``chunk`` 2x2 output tiles per round, ``parts`` for helper threads (a scratch row set each).
    winograd4: ``chunk`` whole images per round, ``parts`` for helper threads (a scratch row set each), ``flat``:
    the input transform splits whole planes into phases (``winograd4.flat_phases``).
    im2col_parts: ``parts`` ranges of output rows, in runs of at most ``tile_rows``.
    im2col_tiles: tiles of ``kblock`` unfolded rows x ``chunk`` output rows, one per part (``tile_n`` > 1: up to
    that many whole images a tile, ``chunk`` = OH, its GEMM staged in the part's workspace); ``grid`` the parts'
    blocks of the output (first, past-last output row of all images stacked; first, past-last output channel;
    first, past-last unfolded row: a part whose range starts past 0 sums into a partial output, ``tiles_grid``);
    ``phases``: a stride-2 unfold reads the input split into its row and column phases, in an area per part;
    ``flat``: a stride-1 unfold reads the input planes as one flat run per unfolded row (im2col_tiles, im2col
    and im2col_parts channel-major).
    im2col: ``parts`` k ranges of the unfold on helper threads (with ``phases``, each one's phase area from
    ``phase_offset`` on); ``micro`` pairs (GEMM width in pixels, the float32 microkernel's parts: blocks of the
    result) for the tile widths it runs, where it runs, else () (BLAS for every tile). winograd, winograd4:
    ``micro`` pairs (round width in tiles, the block each of its 16 or 36 GEMMs computes on the microkernel, or ()
    for BLAS);
    ``own_weights`` (``constant_weight``): the transformed weights live in memory the binding owns, made by its
    first launch, instead of the workspace, made by every launch. winograd: ``fused_rows`` > 0 (one float32 round,
    weights not kept, the zmm kernels): each part transforms that many output channels' weights at a time into a
    scratch area of its own, just before their 16 GEMMs (``gemm.gemm_tile``; ``micro`` then ()), instead of all of
    U into the workspace first."""

    n: int
    c: int
    h: int
    w: int
    oc: int
    oh: int
    ow: int
    kh: int
    kw: int
    sh: int
    sw: int
    ph: int
    pw: int
    dh: int
    dw: int
    groups: int
    cg: int
    ocg: int
    kc: int
    w_kstride: int
    orient: str
    tile_rows: int
    nhwc: bool
    tile_n: int = 1
    staged: bool = False
    out_offset: int = 0
    chunk: int = 0
    parts: int = 1
    kblock: int = 0
    grid: tuple[tuple[int, int, int, int, int, int], ...] = ()
    flat: bool = False
    micro: tuple[tuple[int, tuple[tuple[int, int, int, int], ...]], ...] = ()
    own_weights: bool = False  # winograd, winograd4 with constant_weight: transformed weights kept by the binding
    fused_rows: int = 0  # winograd: output channels a part transforms at a time, just before their GEMMs
    phases: bool = False  # im2col_tiles, im2col: stride 2 unfolded through the input's phases (``conv_phases``)
    phase_offset: int = 0  # im2col with phases: where the parts' phase areas start in the workspace

    @property
    def private_launch(self) -> bool:
        """Whether each binding needs a launch of its own (``op._build_launch``): one that keeps transformed
        weights must not serve another executor, whose weight may be other data at the same address."""
        return self.own_weights

    @property
    def constant_inputs(self) -> tuple[int, ...]:
        """The inputs whose data the plan keeps while bound (the sanitizer checks they do not change): the
        weight, with ``own_weights``."""
        return (1,) if self.own_weights else ()


def nchw(d: TensorDesc, fmt: Format | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and strides of ``d`` in logical NCHW order: permuted if ``fmt`` (``d``'s own format by default) is
    NHWC. An output takes the input's: an untagged ``out=`` of an NHWC conv is NHWC all the same."""
    if (d.format if fmt is None else fmt) is Format.NHWC:
        p = (0, 3, 1, 2)
        return tuple(d.shape[i] for i in p), tuple(d.strides[i] for i in p)
    return d.shape, d.strides


def out_size(n: int, k: int, s: int, p: int, d: int) -> int:
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def _infer(ins: tuple[TensorDesc | None, ...], attrs: dict[str, Any]) -> tuple[TensorDesc, ...]:
    x, w, bias = need(OP, "x", ins[0]), need(OP, "weight", ins[1]), ins[2]
    check_dtype(OP, "x", x, DTYPES)
    check_dtype(OP, "weight", w, (x.dtype,))
    if x.ndim != 4:
        raise ParamError(op=OP, arg="x", expected="4 dims (NCHW, or NHWC with Format.NHWC)", got=x.shape)
    if w.ndim != 4:
        raise ParamError(op=OP, arg="weight", expected="4 dims (OC, C/groups, KH, KW)", got=w.shape)
    if w.format not in (Format.ND, Format.NCHW):  # an NHWC tag would mean (OC, KH, KW, C/groups): not read that way
        raise ParamError(
            op=OP,
            arg="weight",
            expected="(OC, C/groups, KH, KW), untagged (ND) or NCHW",
            got=f"{w.format.value} {w.shape}",
        )
    (n, c, h, wd), _ = nchw(x)
    oc, cg, kh, kw = w.shape
    if kh < 1 or kw < 1:
        raise ParamError(op=OP, arg="weight", expected="a kernel of at least 1 x 1 (dims 2 and 3)", got=w.shape)
    g = attrs["groups"]
    for name in ("stride", "dilation"):
        if min(attrs[name]) < 1:
            raise ParamError(op=OP, arg=name, expected="values >= 1", got=attrs[name])
    if min(attrs["padding"]) < 0:
        raise ParamError(op=OP, arg="padding", expected="values >= 0", got=attrs["padding"])
    if g < 1 or c % g or oc % g:
        raise ParamError(op=OP, arg="groups", expected=f"a divisor of channels {c} and out channels {oc}", got=g)
    if cg != c // g:
        raise ParamError(op=OP, arg="weight", expected=f"{c // g} input channels per group (dim 1)", got=w.shape)
    if bias is not None:
        check_dtype(OP, "bias", bias, (x.dtype,))
        if bias.shape != (oc,):
            raise ParamError(op=OP, arg="bias", expected=f"shape ({oc},)", got=bias.shape)
    (sh, sw), (ph, pw), (dh, dw) = attrs["stride"], attrs["padding"], attrs["dilation"]
    oh, ow = out_size(h, kh, sh, ph, dh), out_size(wd, kw, sw, pw, dw)
    if oh < 1 or ow < 1:
        raise ParamError(
            op=OP, arg="x", expected=f"an input at least as large as the dilated kernel {(kh, kw)}", got=x.shape
        )
    shape = (n, oh, ow, oc) if x.format is Format.NHWC else (n, oc, oh, ow)
    return (TensorDesc(shape, x.dtype, format=Format.NHWC if x.format is Format.NHWC else Format.NCHW),)


def _orientation(xs: tuple[int, ...], os_: tuple[int, ...], t: ConvTiling) -> str:
    """``cm`` when the output's (H, W) rows are unit-stride, ``pm`` when its channels are, else ``""``."""
    if os_[3] == 1 and os_[2] == t.ow and matrix_ok((t.ocg, t.oh * t.ow), (os_[1], 1), out=True):
        return "cm"
    if os_[1] == 1 and os_[2] == t.ow * os_[3] and matrix_ok((t.oh * t.ow, t.ocg), (os_[3], 1), out=True):
        return "pm"
    return ""


def plan_conv(x: TensorDesc, w: TensorDesc, out: TensorDesc, attrs: dict[str, Any], limit: Any) -> Plan:
    """Candidates ranked by expected speed; im2col's tile is the most whole images (else output rows of one
    image) whose unfolded input fits.

    Workspace: gemm_1x1 and direct 0; im2col align64(Cg*KH*KW * tile_n*tile_rows*OW * itemsize) [+
    align64(OC/groups * tile_n*OH*OW * itemsize) when tile_n > 1 and the output is not pixel-major with mergeable
    (N, H, W)].
    """
    (n, c, h, wd), xs = nchw(x)
    _, os_ = nchw(out, x.format)
    oc, cg, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw), g = attrs["stride"], attrs["padding"], attrs["dilation"], attrs["groups"]
    oh, ow = out_size(h, kh, sh, ph, dh), out_size(wd, kw, sw, pw, dw)
    kc = cg * kh * kw
    wm = merge_dims(w.shape[1:], w.strides[1:])
    if wm is not None and wm[0] <= 1:
        wm = (wm[0], 1)  # a single column: any stride walks it, give BLAS the unit one
    t = ConvTiling(
        n,
        c,
        h,
        wd,
        oc,
        oh,
        ow,
        kh,
        kw,
        sh,
        sw,
        ph,
        pw,
        dh,
        dw,
        g,
        cg,
        oc // g,
        kc,
        wm[1] if wm else 0,
        "",
        oh,
        x.format is Format.NHWC,
    )
    orient = _orientation(xs, os_, t)
    w_ok = wm is not None and (
        matrix_ok((oc // g, kc), (w.strides[0], wm[1]))
        if orient == "cm"
        else matrix_ok((kc, oc // g), (wm[1], w.strides[0]))
    )
    item = x.dtype.itemsize
    direct = Candidate("direct", t, 0)
    cands: list[Candidate] = []
    if orient and w_ok:
        t = replace(t, orient=orient)
        x_pix = merge_dims((n, h, wd), (xs[0], xs[2], xs[3])) if orient == "pm" else merge_dims((h, wd), (xs[2], xs[3]))
        x_ok = x_pix is not None and (
            matrix_ok((n * h * wd, cg), (xs[3], xs[1])) if orient == "pm" else matrix_ok((cg, h * wd), (xs[1], xs[3]))
        )
        if kh == kw == 1 and (sh, sw, ph, pw) == (1, 1, 0, 0) and x_ok:
            cands.append(Candidate("gemm_1x1", t, 0))
        dense = xs[3] == 1 or wd == 1
        tu = replace(t, flat=orient == "cm" and plane_usable(t, dense, xs[2]))  # the unfolding candidates' tiling
        whole = _im2col_candidate(tu, os_, item, limit, orient == "cm" and phases_usable(t, dense))
        tiled = _tiles_candidate(tu, x, dense, limit)
        in_parts = _parts_candidate(tu, item, limit)
        implicit = _implicit_candidate(t, x, dense, limit)
        cands.append(whole)
        if tiled is not None:
            cands.insert(len(cands) - 1 if tiles_first(tiled.tiling, whole.tiling) else len(cands), tiled)
        if in_parts is not None:
            cands.insert(cands.index(whole), in_parts)
        if implicit is not None:
            cands.insert(implicit_rank(implicit.tiling, cands, whole), implicit)
    if (kh, kw, sh, sw, dh, dw, g) == (3, 3, 1, 1, 1, 1, 1) and t.n and t.c and t.oc:  # not on an empty GEMM
        constant = bool(attrs.get("constant_weight", False))
        wino = _winograd_candidate(t, item, limit, constant)
        if wino is not None:
            tiles = t.n * ((oh + 1) // 2) * ((ow + 1) // 2)
            rank = _winograd_rank(tiles, min(t.c, t.oc), cands, constant, wino.tiling.fused_rows > 0)
            cands.insert(rank, wino)
        if x.dtype is DType.float32:
            th4, tw4, _ = winograd4.geometry(oh, ow)
            if tw4 >= WINOGRAD4_MIN_TILE_COLUMNS and t.n * th4 * tw4 >= WINOGRAD_MIN_TILES:
                at = 0
            else:
                at = cands.index(wino) + 1 if wino is not None else len(cands)
            cands.insert(at, _winograd4_candidate(t, xs[3] == 1, limit, constant))
    if cg == 1 and g > 1:
        cands.insert(0, direct)
    else:
        cands.append(direct)
    return choose(OP, cands, limit)


IM2COL_TARGET = 32 << 20  # workspace bytes up to which im2col unfolds several whole images when no limit binds
# output pixels of an NCHW image from which im2col takes one image per GEMM: a wider GEMM gains less than the
# staged result's copy into out costs (8 images, AVX2 EPYC, OpenBLAS; tile_n 1 against 8, /tmp/w/tn.py of the
# twelfth session: 784 pixels 1.08-1.26x faster, the 12544-pixel stem 1.22-1.30x; 196 pixels 0.76-0.90x, 49
# pixels 0.80-0.86x)
IM2COL_WIDE_IMAGE = 512


def _im2col_candidate(
    t: ConvTiling, os_: tuple[int, ...], item: int, limit: int | None, phased: bool = False
) -> Candidate:
    """The im2col tile: the most whole images whose unfolded input (plus, for several images whose outputs are
    not one BLAS matrix, the staged GEMM result) fits ``limit`` (else 32 MiB), at least one, and only one when
    that result would be staged for images of ``IM2COL_WIDE_IMAGE`` pixels or more; under a limit that one image
    exceeds, the most output rows of one image that fit. ``phased`` (``conv_phases.usable``, a channel-major
    unfold): the unfold's parts each get a phase area after the rest when it still fits."""
    per_img = t.kc * t.oh * t.ow * item
    merged = t.orient == "pm" and merge_dims((t.n, t.oh, t.ow), (os_[0], os_[2], os_[3])) is not None
    most = t.n if merged or t.oh * t.ow < IM2COL_WIDE_IMAGE else 1

    def ws(tn: int) -> tuple[int, int]:
        cols = align(per_img * tn)
        return cols + (align(t.ocg * t.oh * t.ow * tn * item) if stages(tn) else 0), cols if stages(tn) else 0

    def stages(tn: int) -> bool:
        return tn > 1 and not merged

    budget = IM2COL_TARGET if limit is None else limit
    if ws(1)[0] <= budget or limit is None:
        tn = 1
        while tn < most and ws(tn + 1)[0] <= budget:
            tn += 1
        size, off = ws(tn)
        tt = replace(t, tile_n=tn, staged=stages(tn), out_offset=off)
    else:
        per_row = t.kc * t.ow * item
        rows = max(1, min(t.oh, (limit // 64 * 64) // max(per_row, 1)))
        tt = replace(t, tile_rows=rows)
        size = align(per_row * rows)
    tt = replace(tt, micro=_im2col_micro(tt, os_, item), parts=unfold_parts(tt))
    if phased:  # the parts' phase areas after the rest, where they fit
        area = tt.parts * images_phase_area(tt, tt.tile_rows, tt.tile_n) * item
        if limit is None or size + area <= limit:
            return Candidate("im2col", replace(tt, phases=True, phase_offset=size), size + area)
    return Candidate("im2col", tt, size)


def _im2col_micro(
    t: ConvTiling, os_: tuple[int, ...], item: int
) -> tuple[tuple[int, tuple[tuple[int, int, int, int], ...]], ...]:
    """im2col's GEMMs (W @ cols, channel-major) by the float32 microkernel where matmul would take it
    (``linalg._micro_parts``): the parts for each tile width in pixels, () when none (BLAS). Its result needs
    unit column stride: out's pixels (or the staged area). Side by side on an AVX-512 EPYC (Zen 5; numpy's
    OpenBLAS on its Haswell kernels), the same plan with and without it, 8 calls per timing in rotating order:
    8 images of ResNet-18's 3x3 layers ran 1.4-1.8x faster, the stem 1.8x (/tmp/w39/ab.py of the thirty-ninth
    session; winograd's GEMMs 1.45-1.5x, winograd4's 1.2-1.3x: abw.py, ab4.py)."""
    if item != 4 or t.orient != "cm" or not (t.staged or os_[3] == 1):
        return ()
    images = {t.tile_n, t.n % t.tile_n or t.tile_n}
    rows = {t.tile_rows, t.oh % t.tile_rows or t.tile_rows}
    widths = sorted({nn * r * t.ow for nn in images for r in rows})
    plan = tuple((p, _micro_parts(t.ocg, t.kc, p, 1)) for p in widths)
    return plan if any(parts for _, parts in plan) else ()


# output pixels per im2col_parts unit at most (whole output rows, at least one). Against im2col (ResNet-18's
# stride-2 layers and stem, 2 cores, OpenBLAS; /tmp/w18/chunk2.py of the eighteenth session): 8 images
# 1.10-1.46x faster at 1024-4096 (the 1x1 layer 0.87-1.06x), one image mostly 1.03-1.16x from 392 to 6272
PARTS_PIXELS = 2048
# multiply-adds from which im2col_parts ranks ahead of im2col, in all and per unit (ratios torch / twophase,
# im2col against im2col_parts, /tmp/w18/ab.py): one image of 1x1 stride 2 64 -> 128 (6.4 M in all) 1.03-1.38
# against 0.85-0.95, the stem's one-row units under a 256 KiB limit (1.05 M each) 0.60-0.63 against 0.51-0.52,
# while units of 56 pixels of 64 -> 128 3x3 (4.1 M each) ran 1.13-2.1x faster than im2col
PARTS_MIN_MACS = 1 << 24
PARTS_MAX_UNITS = 1 << 16  # (64 images of 1024 output rows 2048 wide: 32768 units)
PARTS_MIN_UNIT_MACS = 1 << 21
PARTS_MIN_PIXELS = IM2COL_WIDE_IMAGE  # smaller maps gain more from im2col's whole-image tiles


def _parts_candidate(t: ConvTiling, item: int, limit: int | None) -> Candidate | None:
    """im2col_parts when there are helper threads, output maps of ``PARTS_MIN_PIXELS`` or more and enough work
    (``PARTS_MIN_MACS``): the most output rows per unit, up to ``PARTS_PIXELS`` pixels and a part's share of
    the rows, whose per-part unfold areas fit ``limit``, if such a unit still holds ``PARTS_MIN_UNIT_MACS``."""
    stacked = t.n * t.groups * t.oh
    parts = min(fanout_parts(), stacked)
    per_row = t.ocg * t.kc * t.ow  # multiply-adds per output row of one group
    if parts < 2 or t.oh * t.ow < PARTS_MIN_PIXELS or stacked * per_row < PARTS_MIN_MACS:
        return None
    rows = max(1, min(t.oh, PARTS_PIXELS // t.ow, -(-stacked // parts)))
    if -(-stacked // rows) > PARTS_MAX_UNITS:  # phase 1 lists every unit: time and memory grow with their count
        return None
    while True:
        units = parts_units(replace(t, tile_rows=rows, parts=parts))
        # the runs even out, often shorter than asked: the tiling says how long they are (the same runs again)
        rows = max(r for part in units for *_, r in part)
        size = parts_areas(t, units, item)[-1]
        if limit is None or size <= limit or rows == 1:
            break
        rows -= 1
    if (limit is not None and size > limit) or rows * per_row < PARTS_MIN_UNIT_MACS:
        return None
    return Candidate("im2col_parts", replace(t, tile_rows=rows, parts=parts), size)


# unfolded rows per tile at most (the GEMM's k block, as ``gemm.KC``). 512 against 256, forced im2col_tiles through
# the op, two threads, 9 interleaved rounds (AMD Zen 4, /tmp/w50/convab.py of the fiftieth session): n1 64->128 56^2
# s2 1.06x, 128->256 28^2 s2 1.03x, 256^2 14^2 1.03x, 256->512 14^2 s2 1.02x, 512^2 7^2 1.02x, n8 64->128 s2 1.02x,
# 128->256 s2 1.02x (the stem's 147 rows: 1.00x). 1024 measured the same; 512 with tiles of 2^18 floats 1.02-1.05x
TILE_K = 512
# unfolded rows a k block takes at most where the limit leaves its tiles as wide as ``tile_pixels`` makes them
# (``_tiles_fit``): 576 (64 channels x 9 taps) then runs whole, not in two blocks of 288, 1152 in two of 576, not
# three of 384. 640 against 512, unlimited, forced im2col_tiles, two threads, 15 interleaved rounds, three runs, AMD
# Zen 3 (/tmp/w65/tf.py, tfab.py of the sixty-fifth session): 8 x 64->128 56^2 s2 1.05 / 1.07 / 1.06x (1024: 1.06 /
# 1.07x), 8 x 128->256 28^2 s2 1.02 / 1.01 / 1.05x, 8 x 256->512 14^2 s2 1.01 / 1.02 / 0.99x (1024: 0.95 / 0.94x),
# 1 x 128->256 s2 1.04 / 1.02 / 1.05x, 256^2 14^2 1.02 / 1.03 / 1.05x, 256->512 s2 1.03 / 0.99 / 1.01x, 512^2 7^2
# 0.99 / 1.00 / 1.02x, 64->128 s2 1.02 / 0.99 / 0.95x. Under 256 KiB the deeper blocks left tiles of fewer output
# rows and ran 0.59-0.81x: there the blocks stay at TILE_K. On AMD Zen 4 (two threads, 9 interleaved rounds, one run,
# /tmp/w67/kab.py of the sixty-seventh session) 640 against 512: 8 x 64->128 s2 1.03x, 128->256 s2 1.00x, 256->512
# s2 1.03x, 1 x 256^2 14^2 1.03x, 1 x 128->256 s2 0.98x, 1 x 64->128 s2 0.91x; 1024 ran 0.93-1.04x against 640
TILE_K_WHOLE = 640
SPLIT_K_MIN = 256  # unfolded rows a part at least, where the parts split the input channels (``tiles_grid``)
# floats of an im2col tile at most (a k block's unfolded rows x its pixels, whole output rows; one row when wider):
# half an L2, whatever the block's depth. Against the 256 pixels it had (measured 5-10% faster than 128 on
# ResNet-18's stride-2 layers and stem, ninth session), forced im2col_tiles, 2 threads, AMD Zen 4, two runs,
# t(256) / t(new) (/tmp/w46/tf.py of the forty-sixth session): stem 3->64 224^2 k7 s2 (147-row blocks, 2 -> 7
# output rows per tile) n1 1.07 / 1.05x, n8 1.04 / 1.03x; 64->128 56^2 s2 (192 rows, 8 -> 24) n1 1.00 / 1.11x,
# n8 1.04 / 1.05x; 64->128 1x1 s2 (whole images) n1 1.00 / 1.02x, n8 1.05 / 1.06x; 64->64 56^2 (4 -> 12)
# 1.01-1.04x; 128->128 28^2 (8 -> 20) 1.02-1.05x. 2^16 floats gained less (0.96-1.07x), 3 x 2^16 no more
# (0.93-1.10x). On AMD Zen 3 (512 KiB of L2; sixty-sixth session, /tmp/w66/tf.py, unf.py, 11-15 interleaved rounds)
# 2^17 against tiles small enough that the tile and the weight's k block share the L2 (55000 floats: 3 output rows)
# ran 8 x 64->128 56^2 s2 1.12x and 8 x 128->256 28^2 s2 1.10x faster (medians); against 2^16 and 3 x 2^15
# 1.00-1.01x and 1.09x. The unfold alone (6 output channels, one thread) was no faster in smaller tiles: 2.94 ms at
# 2^17, 3.16 at 2^16, 4.10 at 2^15 for 8 images of 64 x 56^2, so its time is its copies', not a tile spilling from L2
TILE_FLOATS = 1 << 17


def tile_pixels(kblock: int) -> int:
    """Pixels per im2col tile at most for k blocks of ``kblock`` unfolded rows: ``TILE_FLOATS`` of them."""
    return max(1, TILE_FLOATS // max(kblock, 1))


def tile_rows(oh: int, ow: int, most: int) -> int:
    """Output rows per im2col tile: up to ``most`` pixels (at least one row, at most ``oh``), the count whose
    tiles over an image's ``oh`` rows (the last one shorter) waste the least of the GEMM's 16-column panels (the
    largest of equals)."""
    best, use = 1, 0.0
    for rows in range(1, min(oh, max(1, most // ow)) + 1):
        u = tiles_use(oh, ow, rows)
        if u >= use:
            best, use = rows, u
    return best


def tiles_use(oh: int, ow: int, rows: int, images: int = 1) -> float:
    """Pixels / GEMM columns computed (``gemm.columns_computed``), over an image's tiles of ``rows`` output rows,
    or over a tile of ``images`` whole images."""
    if images > 1:
        return images * oh * ow / gemm.columns_computed(images * oh * ow)
    rest = oh % rows
    computed = (oh // rows) * gemm.columns_computed(rows * ow) + (gemm.columns_computed(rest * ow) if rest else 0)
    return oh * ow / computed


def tiles_grid(
    n: int, oh: int, ow: int, oc: int, parts: int, kc: int, taps: int, split_k: bool = True
) -> tuple[tuple[int, int, int, int, int, int], ...]:
    """Blocks (first, past-last output row of all images stacked; first, past-last output channel; first,
    past-last unfolded row) for ``parts`` parts: ranges of output rows, or, when those would give a part fewer than
    128 pixels, ranges of the ``kc`` unfolded rows (whole input channels of ``taps`` rows, at least ``SPLIT_K_MIN``
    a part: each part unfolds its own channels, sums them into a partial output, and the launch adds the partials),
    else (or without ``split_k``) ranges of output channels (multiples of the GEMM's rows; every part then unfolds
    the same tiles).
    One image of 256 -> 256 14^2, 512 -> 512 7^2, 128 -> 256 28^2 s2 and 256 -> 512 14^2 s2 ran 1.02-1.08x faster
    split by input channels than by output channels (through the op, two threads, 15 interleaved rounds, two runs,
    /tmp/w48/convab.py of the forty-eighth session); on AMD Zen 4, 256 -> 256 14^2 1.00x and 128 -> 256 28^2 s2
    1.06x (11 rounds, /tmp/w67/kab.py of the sixty-seventh session)."""
    rows = n * oh
    if parts > 1 and rows * ow < parts * 128:
        channels = kc // taps
        if split_k and channels // parts * taps >= SPLIT_K_MIN:
            return tuple((0, rows, 0, oc, c0 * taps, c1 * taps) for c0, c1 in split_range(channels, parts))
        if oc >= parts * 2 * gemm.MR:
            return tuple((0, rows, i0, i1, 0, kc) for i0, i1 in gemm.row_ranges(oc, parts))
    return tuple((a, b, 0, oc, 0, kc) for a, b in split_range(rows, parts))


def grid_kblock(grid: tuple[tuple[int, int, int, int, int, int], ...], kc: int, deepest: int = 0) -> int:
    """Unfolded rows per k block: the k ranges of ``grid``'s parts (the longest one's; ``kc`` for no parts) in
    blocks of nearly equal depth, at most ``deepest`` (default ``TILE_K``)."""
    most = max((k1 - k0 for *_, k0, k1 in grid), default=kc)
    return -(-most // -(-most // (deepest or TILE_K)))


# pixels / GEMM columns computed (``gemm.columns_computed``) from which im2col_tiles ranks ahead of whole-image
# im2col. 7x7 maps (49 pixels: 64 columns' work, 0.77) rank im2col first: 8 images of 256 -> 512 14^2 s2 ran
# 1.11x and 1.6x faster by im2col + OpenBLAS than by the tiles in two runs, 512^2 7^2 1.35x; one image even
# (0.99-1.03x; Intel Xeon, 9-15 alternating rounds, /tmp/w24/rank7.py, rank_all.py of the twenty-fourth
# session). 14x14 maps (0.94) keep the tiles. Where a zmm FMA takes two passes (``gemm.half_width_fma``), 49
# pixels are 56 columns' work (0.875): there the tiles ran 1.05-1.53x faster than im2col on every 7x7-output
# shape measured, 256 -> 512 14^2 s2 at 1, 2, 4 and 8 images 1.30, 1.24, 1.08, 1.05x, 128 -> 256 s2 at 2 and 4
# 1.53, 1.21x, 512^2 7^2 at 2 and 4 1.33, 1.17x (AMD Zen 4, 2 threads, 11-13 alternating rounds, /tmp/w51/rk.py
# of the fifty-first session). A tile of several whole images (``tile_images``) counts their pixels together: 4 x
# 49 = 196 of 208 columns' work (0.94) on either host. With them, against im2col on Zen 4 (11 rounds, each order of
# building the two, /tmp/w52/rk2.py of the fifty-second session): 8 x 256->512 14^2 s2 1.09-1.13x, 4 x 512^2 7^2
# 1.15-1.17x, 8 x 128->256 14^2 s2 1.21-1.26x faster by the tiles. (Not measured on a host of full-width FMAs,
# where one-image tiles lost to im2col.)
TILES_MIN_USE = 0.85
# multiply-adds from which one image ranks im2col_tiles ahead of im2col whatever the tiles' use (one OpenBLAS GEMM
# a few dozen columns wide): 1 x 512 -> 512 7^2 ran 1.03-1.46x faster by the tiles in five runs, 1 x 256 -> 512
# 14^2 s2 1.06-1.10x, 1 x 64 -> 128 12^2 s2 (2.7 M) 1.14-1.43x, while 1 x 8 -> 16 5^2 s2 (10 K) ran 2-4.6x
# slower (Intel Xeon, 2 threads, 11 alternating rounds, /tmp/w26/small.py and s2.py of the twenty-sixth session)
TILES_ONE_IMAGE_MACS = 1 << 21


def tiles_first(tiles: ConvTiling, im2col: ConvTiling) -> bool:
    """Whether im2col_tiles ranks ahead of im2col: when a limit makes im2col unfold only some output rows of an
    image per GEMM, when the tiles' pixels fill the GEMM's panels well enough (``TILES_MIN_USE``), or for one
    image of ``TILES_ONE_IMAGE_MACS`` or more."""
    return (
        im2col.tile_rows < im2col.oh
        or tiles_use(tiles.oh, tiles.ow, tiles.chunk, tiles.tile_n) >= TILES_MIN_USE
        or (tiles.n == 1 and tiles.ocg * tiles.kc * tiles.oh * tiles.ow >= TILES_ONE_IMAGE_MACS)
    )


def _tiles_candidate(t: ConvTiling, x: TensorDesc, dense: bool, limit: int | None) -> Candidate | None:
    """im2col_tiles for float32, one group, a channel-major output, on a CPU with the register-blocked GEMM:
    the most output rows per tile (up to ``tile_pixels`` of its k blocks) whose per-part tiles fit ``limit`` (with
    the parts' phase areas where ``conv_phases.usable``, else, or when those do not fit, without; ``t.flat``: the
    unfold reads the input planes in place); parts split as ``tiles_grid``, or over output channels instead where
    the partial outputs of a split of the input channels leave too little of ``limit`` for tiles as large
    (``pixels_per_tile``). None without input channels (nothing to unfold: the others write the bias)."""
    if t.groups != 1 or t.orient != "cm" or t.kc == 0 or not tiles_available(x.dtype.np):
        return None
    shape = (t.n, t.oh, t.ow, t.oc, fanout_parts(), t.kc, t.kh * t.kw)
    grid = tiles_grid(*shape)
    found = _tiles_fit(t, x, dense, limit, grid)
    if partial_parts(grid) and limit is not None:
        by_channels = _tiles_fit(t, x, dense, limit, tiles_grid(*shape, split_k=False))
        if found is None or (by_channels is not None and pixels_per_tile(by_channels) > pixels_per_tile(found)):
            found = by_channels
    return found


# Under a workspace limit the partial outputs of a split of the input channels take room from the tiles. One image,
# two threads, 256 KiB, forced im2col_tiles, 11 interleaved rounds, AMD Zen 4 (/tmp/w54/tight.py of the
# fifty-fourth session), split by input channels / by output channels: 256->256 14^2 (tiles of 1 row / 4 rows)
# 1.29x, 128->256 28^2 s2 (1 / 4) 1.15x, 256->512 14^2 s2 (4 / 7) 1.05x, 512->512 7^2 (4 / 7) 1.08x faster split
# by output channels. With tiles as large, the input channels' split stays (1.02-1.08x faster: ``tiles_grid``).
def pixels_per_tile(c: Candidate) -> int:
    """Output pixels of a tiles candidate's tile: ``chunk`` rows of OW, times ``tile_n`` whole images."""
    t = c.tiling
    return int(t.chunk * t.ow * max(1, t.tile_n))


def _tiles_fit(
    t: ConvTiling, x: TensorDesc, dense: bool, limit: int | None, grid: tuple[tuple[int, int, int, int, int, int], ...]
) -> Candidate | None:
    """``_tiles_candidate`` on the parts of ``grid``: None when even tiles of one output row do not fit ``limit``.
    Tiles of whole images take as many images as ``tile_images`` allows that fit. k blocks of up to
    ``TILE_K_WHOLE`` rows where their tiles fit ``limit`` as they would unlimited, else of up to ``TILE_K``."""
    kblock = grid_kblock(grid, t.kc)
    deep = grid_kblock(grid, t.kc, TILE_K_WHOLE)
    if deep != kblock:
        whole = _tiles_at(t, x, dense, None, grid, deep)
        if whole is not None and (limit is None or whole.workspace <= limit):
            return whole
    return _tiles_at(t, x, dense, limit, grid, kblock)


def _tiles_at(
    t: ConvTiling,
    x: TensorDesc,
    dense: bool,
    limit: int | None,
    grid: tuple[tuple[int, int, int, int, int, int], ...],
    kblock: int,
) -> Candidate | None:
    """``_tiles_fit`` with k blocks of ``kblock`` rows."""
    item = x.dtype.itemsize
    phased = phases_usable(t, dense)
    most = tile_pixels(kblock)
    while True:
        rows = tile_rows(t.oh, t.ow, most)
        tt = replace(t, chunk=rows, kblock=kblock, parts=len(grid), grid=grid, phases=phased)
        for ti in _tile_choices(tt, most):
            size = tiles_workspace(ti, item)
            if limit is None or size <= limit:
                return Candidate("im2col_tiles", ti, size)
            if phased:  # the tiles may fit without the phases: unfold row by row
                plain = replace(ti, phases=False)
                size = tiles_workspace(plain, item)
                if size <= limit:
                    return Candidate("im2col_tiles", plain, size)
        if rows == 1:
            return None
        most = rows * t.ow - 1


def _tile_choices(tt: ConvTiling, most: int) -> list[ConvTiling]:
    """A tiling's tiles of up to ``most`` pixels, best first: tiles of several whole images (``tile_images``,
    from the most down to two), first when they fill the GEMM's panels at least as well as ``tt.chunk`` rows
    (``tile_rows``' count); then ``tt``'s own (when ``tt.chunk`` = OH, its whole images from the most down to one).
    Where a zmm FMA is two passes (``gemm.half_width_fma``), ``tile_rows`` cuts a 22^2 map into tiles of 21 rows
    and 1 row (488 columns' work for 484 pixels, against 496 for the whole image), which left 1x1 layers of 22^2
    outputs no tile of whole images: 4 of them are 1936 columns' work, none wasted. For one image of 14^2 (13 + 1
    rows), one tile of all 14 ran 0.98x as fast, at 256 -> 256 and 128 -> 256 s2 alike (AMD Zen 4, 11 rounds,
    /tmp/w67/kab.py of the sixty-seventh session)."""
    own = [replace(tt, tile_n=images) for images in range(tile_images(tt, most), 0, -1)]
    if tt.chunk == tt.oh:
        return own
    whole = replace(tt, chunk=tt.oh)
    most_images = tile_images(whole, most)
    if most_images < 2 or tiles_use(tt.oh, tt.ow, tt.oh, most_images) < tiles_use(tt.oh, tt.ow, tt.chunk):
        return own
    return [replace(whole, tile_n=images) for images in range(most_images, 1, -1)] + own


# floats of an implicit GEMM's planes per part at most (a chunk of output rows' input, a k block of whole
# channels): a quarter of an L2. The stem 3->64 224^2 k7 s2 ran the same at 2^16, 2^14 and 2^12 (within 1%)
IMPLICIT_FLOATS = 1 << 16
# output columns from which the implicit GEMM ranks ahead of im2col_tiles, when an output row fills the GEMM's
# panels (``IMPLICIT_MIN_USE``) and the window has more than one tap. Forced, through the op, two threads, 11
# interleaved rounds, AMD Zen 4 (/tmp/w53/rk3.py, rk4.py of the fifty-third session), tiles / implicit: 1 x 3->64
# 224^2 k7 s2 (OW 112) 1.07-1.18x, 8 x 1.12-1.17x; 3->32 224^2 k3 s2 1.26-1.38x; 16->32 112^2 s2 (OW 56) 1.13-1.18x;
# 8->16 64^2 k5 1.43x, 32->32 64^2 k5 1.23x, 2 x 64->64 64^2 k5 1.12x; 32->32 56^2 dilation 2 1.11x, 256->256 56^2
# dilation 2 1.05x; 64->64 224^2 s2 1.06x; 56-pixel rows of 32-256 channels, stride 2, were mixed: 64->128 112^2
# 1.03-1.11x, 256->256 112^2 1.01x, 128->128 112^2 0.93x, 8 x 32->64 112^2 0.94x. Narrower rows lost: 64->128 56^2 s2
# (OW 28, a masked 32-column panel per row) 0.85-0.93x, 128->256 28^2 s2 (OW 14) 0.63-0.81x; and 1x1 windows (one
# phase read of the four copied): 64->128 112^2 1x1 s2 0.79x. (3x3 stride-1 layers rank winograd4 first: 1.5-1.8x
# faster than either here.)
IMPLICIT_MIN_OW = 48
IMPLICIT_MIN_USE = 0.9
# input channels up to which the implicit GEMM ranks first on the 8-lane kernels (AVX2), where its rows are read
# by ``gemm.gemm_table_ymm``; with more it ranks last. Forced, through the op, two threads, 21 interleaved rounds,
# AMD Zen 3 (/tmp/w64/impab.py of the sixty-fourth session), tiles / implicit: 1 x 3->64 224^2 k7 s2 1.07-1.18x
# (four runs), 8 x 1.09x; 3->32 224^2 k3 s2 1.41x; 8->16 64^2 k5 1.22x; 32->32 64^2 k5 1.24x; but 2 x 64->64 64^2
# k5 1.03x, 64->64 224^2 k3 s2 (OW 112) 0.88x, and with 56-pixel rows or fewer 0.65-0.87x (64->128 and 128->128
# 112^2 s2, 8 x 32->64 112^2 s2, 64->128 56^2 s2)
IMPLICIT_YMM_MAX_C = 32


def implicit_first(t: ConvTiling) -> bool:
    """Whether the implicit GEMM ranks first: output rows of ``IMPLICIT_MIN_OW`` or more pixels filling
    ``IMPLICIT_MIN_USE`` of the GEMM columns computed for them, a window of two or more taps, and on the 8-lane
    kernels at most ``IMPLICIT_YMM_MAX_C`` input channels."""
    return (
        t.kh * t.kw > 1
        and t.ow >= IMPLICIT_MIN_OW
        and t.ow / gemm.columns_computed(t.ow) >= IMPLICIT_MIN_USE
        and (gemm.available() or t.c <= IMPLICIT_YMM_MAX_C)
    )


def implicit_rank(t: ConvTiling, cands: list[Candidate], whole: Candidate) -> int:
    """Where the implicit GEMM goes among the ranked candidates: first (``implicit_first``), else right after
    im2col with the zmm kernels (AVX-512) and last with the 8-lane ones, where it lost to im2col_tiles on most
    layers of 32-128 channels measured (``IMPLICIT_YMM_MAX_C``)."""
    if implicit_first(t):
        return 0
    return cands.index(whole) + 1 if gemm.available() else len(cands)


def _implicit_candidate(t: ConvTiling, x: TensorDesc, dense: bool, limit: int | None) -> Candidate | None:
    """implicit (``conv_implicit``) for float32 on a CPU with AVX-512 or AVX2 and FMA where ``usable``: parts over
    the output rows of all images stacked, k blocks of whole channels (up to ``TILE_K`` unfolded rows), chunks of
    the most output rows whose planes stay within ``IMPLICIT_FLOATS``; fewer rows, then fewer channels, to fit
    ``limit``. None when even one row of one channel does not fit."""
    if not (conv_implicit.available(x.dtype.np) and conv_implicit.usable(t, dense)):
        return None
    taps = t.kh * t.kw
    grid = tuple((r0, r1, 0, t.oc, 0, t.kc) for r0, r1 in split_range(t.n * t.oh, fanout_parts()))
    channels = min(t.c, max(1, TILE_K // taps))
    while True:
        rows = conv_implicit.most_rows(t, channels, IMPLICIT_FLOATS)
        while True:
            chunk = widest_tile(grid, rows, t.oh)
            ti = replace(t, chunk=chunk, kblock=channels * taps, parts=len(grid), grid=grid)
            size = conv_implicit.workspace_bytes(ti, x.dtype.itemsize)
            if limit is None or size <= limit:
                return Candidate("implicit", ti, size)
            if rows == 1:
                break
            rows //= 2
        if channels == 1:
            return None
        channels = (channels + 1) // 2


# whole images per im2col_tiles tile at most (``tile_images``). 4 against 1 (one image a tile, straight into out),
# forced im2col_tiles through the op, two threads, 13-15 interleaved rounds, each plan twice after a discarded first
# one (the first executor a process makes ran 3-15% slower in these scripts; AMD Zen 4, /tmp/w52/multi.py of the
# fifty-second session): 8 x 256->512 14^2 s2 1.05-1.07x, 4 x 1.06-1.07x; 8 x 128->256 14^2 s2 1.06-1.08x; 8 x
# 512^2 7^2 1.05-1.08x; 4 x 64^2 7^2 1.02-1.10x. The register-blocked GEMM of 512 x 2304 in k blocks of 461 ran
# 93.7 GFLOP/s on 49 columns, 103 on 196 (one thread, /tmp/w52/gw.py). 2 and 3 images against 4 on 8 x 256->512
# s2: 0.96-0.97x, 0.97-0.98x (/tmp/w52/tnab.py). Images of IM2COL_WIDE_IMAGE pixels or more take one a tile: their
# pixels fill the panels alone, and the GEMM writes out without the stage's copy. One image a tile against 2 to 4
# (AMD Zen 3, through the op, 15 interleaved rounds, in one process, /tmp/w58/e4.py of the fifty-eighth session):
# 8 x 64->128 56^2 1x1 s2 (784 pixels) 1.12x faster on one thread, 1.08-1.18x on two; 4 images 1.13x; 8 x 32->64
# 48^2 1x1 s2 (576 pixels) 1.09x
TILE_IMAGES = 4


def tile_images(t: ConvTiling, most: int) -> int:
    """Whole images per im2col tile: for tiles of whole images (``t.chunk`` = OH) of fewer than
    ``IM2COL_WIDE_IMAGE`` pixels, up to ``most`` pixels, the most whole images a part's output rows hold and
    ``TILE_IMAGES``; else 1. A tile of several images is one wider GEMM (its panels filled better, the weight's
    k block read once for them) into a stage, then copied: for wider images the copy costs more than that gains,
    as for im2col."""
    if t.chunk != t.oh or t.oh * t.ow == 0 or t.oh * t.ow >= IM2COL_WIDE_IMAGE:
        return 1
    held = max((r1 // t.oh + r0 // -t.oh for r0, r1, *_ in t.grid), default=1)  # whole images in [r0, r1)
    return max(1, min(held, most // (t.oh * t.ow), TILE_IMAGES))


# 2x2 output tiles from which winograd ranks ahead of im2col. Measured side by side (make-bench shapes and
# smaller, 2 cores; its 16 GEMMs fan out over helper threads on one BLAS thread each; t(winograd) / t(im2col)):
# 6272 tiles 0.51, 1568 0.57, 784 0.57, 392 0.51, 196 0.45-0.58, 128 0.71, 64 0.78, 49 0.47-0.74, 32 0.96, 16
# 1.03-1.57 (16 * OC * C transformed weights per launch outweigh the GEMM's savings on few tiles). Below
# WINOGRAD_FIRST_TILES it ranks just ahead of im2col (after im2col_tiles when those rank ahead of im2col): one
# image of 256 -> 256 14^2 (49 tiles) ran 1.03-1.23x faster by the tiles, while 8 images (392 tiles) ran
# 1.25-1.38x faster by winograd (Intel Xeon, 2 threads, 9 alternating rounds, three runs, /tmp/w26/small.py of
# the twenty-sixth session).
WINOGRAD_MIN_TILES = 32
WINOGRAD_FIRST_TILES = 64
# (channels, tiles): with at least that many input and output channels, winograd ranks first from that many tiles
# (the first pair that applies); with fewer than the last pair's channels, never first. Its input and output
# transforms cost per channel and tile what the GEMMs save over OC or C of them, so narrow layers lose: against
# im2col_tiles, through the op (AMD Zen 4, 2 threads, 9 alternating rounds, /tmp/w51/rk.py of the fifty-first
# session; t(tiles) / t(winograd), > 1: winograd faster), 3x3 on 14^2 maps of 64 channels 0.65-0.85 at 1-8
# images (49-392 tiles), 128 channels 0.59-0.70 at 1-2 images, 1.32-1.41 at 4-8 (196-392 tiles), 256 channels
# 1.10-1.63 at 1-8; on 7^2 maps (16 tiles an image) 64 and 128 channels 0.47-0.63 at 1-8 images, 256 and 512
# channels 0.95 at 2 images, 1.14-1.33 at 4-8 (64-128 tiles)
WINOGRAD_FIRST = ((256, WINOGRAD_FIRST_TILES), (128, 196))
# input and output channels at least from which a fused winograd (``_fused_rows``: the weight transform block by
# block before its GEMMs, on the register-blocked kernel) ranks first from WINOGRAD_MIN_TILES tiles. Against
# im2col_tiles, both forced, through the op, bench_ops2's timing (settled, then its repetitions), two threads, 9
# interleaved rounds, AMD Zen 4 (/tmp/w69/bo2.py of the sixty-ninth session), torch / ours winograd against
# tiles: 1 x 256^2 14^2 (49 tiles) 1.08-1.12 / 0.89-0.97 (four runs), 1 x 512^2 14^2 1.47 / 1.06, 1 x 384^2
# 14^2 1.35 / 0.97, 256->512 and 512->256 14^2 1.23 / 0.94-0.95, 2 x 512^2 7^2 (32) 1.04 / 0.99, 3 x (48) 1.05 /
# 0.92, 2 x 256^2 7^2 0.93 / 0.86, 3 x 0.89 / 0.83. With 128-192 channels the transforms outweigh the GEMMs'
# savings: 1 x 128^2 14^2 0.64 / 1.02, 2 x 0.62 / 0.93, 8 x 128^2 7^2 0.41 / 0.75, 1 x 192^2 14^2 0.74 / 0.92,
# 1 x 128->256 14^2 0.73 / 1.00. Only where a zmm FMA is two passes (``gemm.half_width_fma``): not measured where
# it is one, and the tiles' GEMMs then take half the time while the transforms do not
WINOGRAD_FUSED_FIRST = 256


def winograd_workspace(
    oc: int, c: int, chunk: int, item: int, ow: int, parts: int = 1, own_weights: bool = False, fused_rows: int = 0
) -> int:
    """16 * (U + spread(C*chunk*item) + spread(OC*chunk*item)) for the transformed weights, the transformed input
    and the GEMM result (16 matrices each, ``spread_stride`` apart) + P * (align64(8*(TW + 1)*item) +
    align64(8*TW*item)) scratch rows of the transforms (one set per part, on cache lines of their own), TW =
    ceil(OW/2), P = parts (helper threads: 1 below 2^20 elements moved, else the fan-out count capped by C and OC).
    U: spread(OC*C*item), all the weights; 0 with ``own_weights`` (the binding keeps them); with ``fused_rows``
    > 0, P * spread(fused_rows*C*item): each part's ``fused_rows`` output channels at a time."""
    tw = (ow + 1) // 2
    if fused_rows:
        weights = parts * spread_stride(fused_rows * c * item)
    else:
        weights = 0 if own_weights else spread_stride(oc * c * item)
    return 16 * (weights + spread_stride(c * chunk * item) + spread_stride(oc * chunk * item)) + parts * (
        align(8 * (tw + 1) * item) + align(8 * tw * item)
    )


def _winograd_candidate(t: ConvTiling, item: int, limit: int | None, constant: bool) -> Candidate | None:
    """Winograd F(2x2, 3x3) with the most 2x2 output tiles per round that fit ``limit`` (else 32 MiB, at least
    one tile); ``constant`` (``constant_weight``): the binding keeps the transformed weights. All tiles in one
    round, float32, weights not kept: the weight transform fused with the GEMMs (``_fused_rows``), where that
    fits."""
    tiles = t.n * ((t.oh + 1) // 2) * ((t.ow + 1) // 2)
    parts = winograd_parts(t.oc, t.c, tiles)

    def size(chunk: int, rows: int = 0) -> int:
        return winograd_workspace(t.oc, t.c, chunk, item, t.ow, parts, constant, rows)

    budget = limit if limit is not None else max(IM2COL_TARGET, size(1))
    rows = _fused_rows(t, tiles, parts, constant) if item == 4 else 0
    if rows and size(tiles, rows) <= budget:
        fused = replace(t, chunk=tiles, parts=parts, fused_rows=rows)
        return Candidate("winograd", fused, size(tiles, rows))
    chunk = tiles
    if size(chunk) > budget:
        lo, hi = 0, tiles
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if size(mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0:
            return None
        chunk = lo
    tw = replace(t, chunk=chunk, parts=parts, own_weights=constant)
    if item == 4:
        tw = replace(tw, micro=_winograd_micro(t, {chunk, tiles % chunk or chunk}, 1))
    return Candidate("winograd", tw, size(chunk))


def _fused_rows(t: ConvTiling, tiles: int, parts: int, constant: bool) -> int:
    """Output channels a part of a one-round float32 winograd transforms at a time, just before their GEMMs
    (``WINO_FUSED_ROWS``, at most its share of OC), or 0 where U is transformed whole first: kept weights
    (``constant``), more than ``WINO_FUSED_MAX_TILES`` tiles, or a CPU without the zmm kernels
    (``gemm.available``: ``wino_fused_gemms`` runs ``gemm.gemm_tile``)."""
    if constant or tiles > WINO_FUSED_MAX_TILES or not gemm.available():
        return 0
    return min(WINO_FUSED_ROWS, -(-t.oc // parts))


def _winograd_rank(
    tiles: int, channels: int, cands: list[Candidate], constant: bool = False, fused: bool = False
) -> int:
    """Where winograd (``tiles`` 2x2 output tiles, ``channels`` the lesser of C and OC) goes among the ranked
    candidates: first from the tiles ``WINOGRAD_FIRST`` gives its channels, or from ``WINOGRAD_MIN_TILES`` with
    ``constant`` (``constant_weight``: no weight transform per launch; one image of 256 -> 256 14^2, 49 tiles, ran
    0.67-0.71 ms against the tiles' 0.73-1.18, three side-by-side runs, /tmp/w40/rank2.py of the fortieth
    session) or, ``fused`` (``_fused_rows``) on a half-width-FMA host, with ``WINOGRAD_FUSED_FIRST`` channels;
    just ahead of im2col_parts / im2col from ``WINOGRAD_MIN_TILES``, else last."""
    first = next((need for least, need in WINOGRAD_FIRST if channels >= least), None)
    fused_first = fused and gemm.half_width_fma() and channels >= WINOGRAD_FUSED_FIRST
    if (first is not None and tiles >= first) or ((constant or fused_first) and tiles >= WINOGRAD_MIN_TILES):
        return 0
    if tiles >= WINOGRAD_MIN_TILES:
        return next((i for i, c in enumerate(cands) if c.implementation in ("im2col_parts", "im2col")), 0)
    return len(cands)


# tile columns (ceil(OW / 4)) from which winograd4 ranks first (with WINOGRAD_MIN_TILES 4x4 tiles in all), else
# right after winograd. F(4x4, 3x3) against F(2x2, 3x3), both through the op, side by side (Intel Xeon, 2 threads,
# 9 alternating rounds, /tmp/w26/impls.py and small.py of the twenty-sixth session): 8 x 64 -> 64 56^2 1.38x
# faster, 8 x 128 -> 128 28^2 1.55x, 1 x 64 -> 64 56^2 1.35x, 1 x 128 -> 128 28^2 (49 tiles) 1.19-1.32x; 14^2 maps
# (4 tile columns) 0.54-0.79x, 7^2 0.29-0.45x: the 36 * OC * C transformed weights and short tile rows outweigh
# the GEMMs' savings
WINOGRAD4_MIN_TILE_COLUMNS = 7


def _winograd4_candidate(t: ConvTiling, dense: bool, limit: int | None, constant: bool) -> Candidate:
    """Winograd F(4x4, 3x3) (float32) with the most whole images per round that fit ``limit`` (else 32 MiB), at
    least one (whose workspace ``choose`` then finds over a smaller limit); ``dense``: x's rows unit-stride;
    ``constant`` (``constant_weight``): the binding keeps the transformed weights."""
    th_n, tw_n, _ = winograd4.geometry(t.oh, t.ow)
    parts = winograd_parts(t.oc, t.c, t.n * th_n * (tw_n + 1), winograd4.MATS)
    flat = winograd4.flat_phases(t.w, t.ph, t.pw, tw_n, dense)

    def size(images: int) -> int:
        return winograd4.workspace(t.oc, t.c, t.oh, t.ow, images, parts, flat, constant)

    budget = limit if limit is not None else max(IM2COL_TARGET, size(1))
    images = t.n
    while images > 1 and size(images) > budget:
        images -= 1
    tt = replace(t, chunk=images, parts=parts, flat=flat, own_weights=constant)
    return Candidate(
        "winograd4",
        replace(tt, micro=_winograd_micro(t, {images, t.n % images or images}, th_n * (tw_n + 1))),
        size(images),
    )


def _winograd_micro(
    t: ConvTiling, rounds: set[int], per_round: int
) -> tuple[tuple[int, tuple[tuple[int, int, int, int], ...]], ...]:
    """Which winograd rounds' GEMMs ((OC x C) @ (C x width) each) take the float32 microkernel: for each width
    (``per_round`` columns per unit of ``rounds``), the block every GEMM computes, or () where matmul would keep
    BLAS (``linalg._micro_parts``); () when none does."""
    widths = sorted({r * per_round for r in rounds})
    plan = tuple((n, ((0, t.oc, 0, n),) if _micro_parts(t.oc, t.c, n, 1) else ()) for n in widths)
    return plan if any(blocks for _, blocks in plan) else ()


def _select(ins: Any, outs: Any, attrs: dict[str, Any], limit: int | None) -> Plan:
    return plan_conv(ins[0], ins[1], outs[0], attrs, effective_limit(OP, limit))


def logical(a: Any, fmt_nhwc: bool) -> Any:
    """The logical NCHW view of an array (NHWC arrays are transposed, no copy)."""
    return a.transpose(0, 3, 1, 2) if fmt_nhwc else a


def _build(plan: Plan, attrs: dict[str, Any], ins: tuple[Any, ...], outs: tuple[Any, ...]) -> Callable[[Any], None]:
    x, w, bias = ins
    t: ConvTiling = plan.tiling
    xv, ov = logical(x, t.nhwc), logical(outs[0], t.nhwc)
    if plan.implementation == "im2col_tiles":
        return build_im2col_tiles(t, xv, w, bias, ov)
    if plan.implementation == "implicit":
        return conv_implicit.build_implicit(t, xv, w, bias, ov)
    if plan.implementation in ("winograd", "winograd4"):
        store, blocks = attrs.get(PRIVATE_STATE, (None, (None, None)))  # set for own_weights (private launches)
        keep = functools.partial(kept_weights, store, blocks[1])
        build_w = build_winograd if plan.implementation == "winograd" else winograd4.build_winograd4
        return build_w(t, xv, w, bias, ov, keep)
    build = {
        "gemm_1x1": build_gemm_1x1,
        "im2col": build_im2col,
        "im2col_parts": build_im2col_parts,
        "direct": build_direct,
    }[plan.implementation]
    return build(t, xv, w, bias, ov)


def reference(
    x: Any,
    weight: Any,
    bias: Any = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
    nhwc: bool = False,
    constant_weight: bool = False,
) -> Any:
    """float64 convolution by summing shifted slices (NCHW; ``nhwc=True`` for NHWC arrays; ``constant_weight``
    changes no result)."""
    x = np.asarray(x, np.float64)
    x = x.transpose(0, 3, 1, 2) if nhwc else x
    w = np.asarray(weight, np.float64)
    (sh, sw), (ph, pw), (dh, dw) = as_pair(stride), as_pair(padding), as_pair(dilation)
    n, c, h, wd = x.shape
    oc, cg, kh, kw = w.shape
    oh, ow = out_size(h, kh, sh, ph, dh), out_size(wd, kw, sw, pw, dw)
    xp = np.zeros((n, c, h + 2 * ph, wd + 2 * pw))
    xp[:, :, ph : ph + h, pw : pw + wd] = x
    out = np.zeros((n, oc, oh, ow))
    ocg = oc // groups
    for g in range(groups):
        for i in range(kh):
            for j in range(kw):
                patch = xp[
                    :,
                    g * cg : (g + 1) * cg,
                    i * dh : i * dh + sh * (oh - 1) + 1 : sh,
                    j * dw : j * dw + sw * (ow - 1) + 1 : sw,
                ]
                out[:, g * ocg : (g + 1) * ocg] += np.einsum(
                    "nchw,oc->nohw", patch, w[g * ocg : (g + 1) * ocg, :, i, j]
                )
    if bias is not None:
        out += np.asarray(bias, np.float64)[None, :, None, None]
    return out.transpose(0, 2, 3, 1) if nhwc else out


conv2d = register(
    OpDef(
        name=OP,
        inputs=("x", "weight", "bias?"),
        attrs=(
            Attr("stride", as_pair, (1, 1)),
            Attr("padding", as_pair, (0, 0)),
            Attr("dilation", as_pair, (1, 1)),
            Attr("groups", as_int, 1),
            Attr(
                "constant_weight",
                as_bool,
                False,
                "the weight's data stay the same while the executor is bound to it: winograd and winograd4 "
                "transform it at the binding's first launch into memory the binding keeps (not the workspace)",
            ),
        ),
        dtypes=DTYPES,
        infer=_infer,
        select=_select,
        kernels={"cpu": _build},
        implementations=(
            "gemm_1x1",
            "winograd4",
            "winograd",
            "implicit",
            "im2col_tiles",
            "im2col_parts",
            "im2col",
            "direct",
        ),
        workspace_formula=(
            "gemm_1x1: 0; winograd4: 36*(spread36(OC*C*4) + spread36(C*NT*4) + spread36(OC*NT*4)) + "
            "P*(align64(24*(B*(TW4+1)+1)*4) + align64(28*B*(TW4+1)*4) + align64(27*C*4) [+ "
            "align64(16*(TH4+2)*(TW4+1)*4) when x's rows are dense, W % 4 == 0, padding <= 4 and "
            "ceil((W+pw)/4) <= TW4 + 1]), spread36(b) = "
            "the smallest multiple of 64 >= b at which 36 blocks start on distinct cache lines mod 4 KiB, "
            "NT = chunk*TH4*(TW4+1) tiles per round of chunk images, TH4 = ceil(OH/4), TW4 = "
            "ceil(OW/4), B = min(TH4, ceil(256/(TW4+1))) tile rows per band, P as winograd's with 36 "
            "matrices; winograd: 16*(spread(OC*C*itemsize) + spread(C*chunk*itemsize) + "
            "spread(OC*chunk*itemsize)) + P*(align64(8*(TW+1)*itemsize) + align64(8*TW*itemsize)), "
            "spread(b) = the smallest multiple of 64 >= b at which 16 blocks start on distinct cache "
            "lines mod 4 KiB, chunk = 2x2 output tiles per round, TW = ceil(OW/2), P = helper-thread "
            "parts (1 below 2^20 elements moved, else the fan-out count capped by C and OC); with "
            "constant_weight, winograd4 and winograd drop their first term (the transformed weights, which "
            "the binding keeps); "
            "im2col: align64(C/groups*KH*KW * tile_n*tile_rows*OW * itemsize) [+ "
            "align64(OC/groups * tile_n*OH*OW * itemsize) when tile_n > 1 and the output is not "
            "pixel-major with mergeable (N, H, W)] [+ U * tile_n * A' * itemsize with phases: channel-major, "
            "stride 2, dilation 1, KH and KW >= 2, dense input rows, ceil(W/2) <= OW, when it fits "
            "workspace_limit; U = the fan-out count from 2^20 unfolded elements per tile, else 1; A' = "
            "ceil16(32 + 4 * S * (tile_rows + (KH-1-PH)//2 - (-PH)//2) * OW), S = min(C/groups, max(1, "
            "64 // (KH*KW))) channels per step]; im2col_parts: the sum over parts of "
            "align64(C/groups*KH*KW * R*OW * itemsize), R = the part's longest run of output rows "
            "(at most tile_rows), parts = the fan-out count, at most N*groups*OH; "
            "im2col_tiles: (P * (KB * Q + A) + S) * itemsize + (P - 1) * align64(N*OC*OH*OW * itemsize) "
            "when the parts split the input channels (else no second term), "
            "Q = ceil16(T*OH*OW) for tiles of T > 1 whole images, else ceil16(R*OW), "
            "S = Q times the sum of the output channels each part computes for T > 1 (the stages of the parts' "
            "GEMMs), else 0, "
            "A = ceil16(32 + 4 * CB * (R + (KH-1-PH)//2 - (-PH)//2) * OW) (the phase planes of a tile of the "
            "CB input channels the widest k block reaches, and their guards; for T > 1, T * ceil16(32 + 4 * S' * "
            "(OH + (KH-1-PH)//2 - (-PH)//2) * OW), S' = min(C, max(1, 64 // (KH*KW))) channels a step) for "
            "stride 2, dilation 1, KH and KW >= 2, dense input rows and ceil(W/2) <= OW when it fits "
            "workspace_limit, else 0, "
            "P = parts (the fan-out count, fewer when N*OH is smaller), "
            "KB = ceil(L / ceil(L / 640)) unfolded rows per k block where those tiles fit workspace_limit as "
            "unlimited, else ceil(L / ceil(L / 512)), L = C*KH*KW (split input channels: the "
            "most unfolded rows a part takes, whole channels of ceil or floor(C / P) each), "
            "R = output rows per tile (up to 2^17 / KB pixels: a tile of 512 KiB of float32; the count filling "
            "the GEMM's panels best, or OH when tiles of T > 1 whole images fill them at least as well), "
            "T = whole images per tile when R = OH: as many as a part's output rows hold, "
            "up to 2^17 / KB pixels and 4, fewer to fit workspace_limit; "
            "implicit: P * ceil16(CB*SH*SW*(R + RH)*(OW + RW) + 16) * 4 (per part, the zero-padded phase planes "
            "of a chunk's input and 16 guard floats), CB = min(C, max(1, 512 // (KH*KW))) channels per k block, R "
            "= output rows per chunk (the most whose planes take at most 2^16 floats, at least 1, at most the "
            "longest run of output rows a part takes in one image), RH = max - min of (i*DH - PH) // SH over 0 <= "
            "i < KH (RW alike over KW), P = parts (the fan-out count, fewer when N*OH is smaller); lower limits "
            "take fewer rows (R halved), then fewer channels (CB halved, rounded up); "
            "direct: 0"
        ),
        doc=(
            "2-D convolution (cross-correlation, as PyTorch), float32 / float64, NCHW or NHWC (Format.NHWC, shape "
            "(N, H, W, C)), weight (OC, C/groups, KH, KW), optional bias (OC,). gemm_1x1 (1x1, stride 1, padding 0): "
            "GEMM per group on the operands, workspace 0. im2col: per tile and group, the unfolded input "
            "(C/groups*KH*KW, tile_n*tile_rows*OW) in the workspace and one GEMM (for several NCHW images into a "
            "second workspace area, then one copy into out that adds the bias); tiles of whole images (as many as "
            "fit workspace_limit, else 32 MiB; one at a time for NCHW outputs of 512 pixels or more) or, when one "
            "image does not fit, of tile_rows output rows; see "
            "workspace_formula. The GEMM is the register-blocked float32 microkernel's (AVX-512, NCHW output) for "
            "tile widths matmul would give it, else BLAS (tiling.micro lists them). "
            "im2col_parts (output maps of 512 pixels or more, with helper threads): the output rows of all (image, "
            "group) planes in P nearly equal ranges, one per helper thread, each unfolding runs of at most tile_rows "
            "rows (up to 2048 pixels, fewer to fit workspace_limit) into its own workspace area and multiplying "
            "them straight into out with a one-thread GEMM; ranked ahead of im2col from 2^24 multiply-adds in all "
            "and 2^21 per run. "
            "im2col_tiles (float32, groups 1, NCHW output, on CPUs with AVX-512): parts over output rows (or, when "
            "there are fewer than 128 pixels a part, over input channels, at least 256 unfolded rows each, whose "
            "partial sums the launch adds into out, unless under workspace_limit the partials leave room for "
            "smaller tiles than a split over output channels would have; else over output channels), each "
            "unfolding tiles of KB unfolded "
            "rows x R output rows into its own workspace slice and multiplying the weight's k block by them with the "
            "register-blocked GEMM into out (bias added per tile; tiles of whole images take up to 4 images, one "
            "GEMM into a stage of the workspace, then copied into out with the bias); ranked ahead of im2col when "
            "the tile's pixels fill at least "
            "0.85 of the GEMM columns computed (16-wide panels, the last one 8 wide when at most 8 columns are left; "
            "a last 17-24 columns count 24 where a zmm FMA takes two 256-bit passes, as on AMD Zen 4, else 32), "
            "for one image of 2^21 multiply-adds or more, or when a limit makes im2col tile output rows. "
            "implicit (float32, groups 1, NCHW input rows dense and output, strides 1 or 2, any padding and "
            "dilation, on CPUs with AVX-512 or AVX2 and FMA): parts over the output rows of all images stacked; per "
            "chunk of output "
            "rows and k block of whole channels, the input rows the chunk reads are copied into SH x SW zero-padded "
            "phase planes per channel in the part's workspace slice, and one register-blocked GEMM per output row "
            "reads each unfolded row (channel, kh, kw) as a run of OW floats at its offset in the planes (an "
            "implicit GEMM: nothing unfolded), straight into out; bias added per chunk; ranked first when OW >= 48 "
            "fills at least 0.9 of the GEMM columns computed for it and the window has two taps or more (ResNet's "
            "stem), on AVX2 only for inputs of 32 channels or fewer, else right after im2col (AVX-512) or last "
            "(AVX2). "
            "winograd4 F(4x4, 3x3) (float32, 3x3, stride 1, dilation 1, groups 1): weights, input tiles (6x6, 4 "
            "apart; each row of tiles one dummy tile longer, so the transforms run flat over bands of tile rows) and "
            "36 GEMMs of (OC, C) x (C, NT) in the workspace, rounds of whole images (as many as fit workspace_limit, "
            "else 32 MiB); 0.56x winograd's multiply-adds; ranked first from ceil(OW/4) >= 7 tile columns and "
            "N*ceil(OH/4)*ceil(OW/4) >= 32 tiles, else right after winograd. "
            "winograd F(2x2, 3x3) (3x3, stride 1, dilation 1, groups 1): weights, input tiles and 16 GEMMs of (OC, C) "
            "x (C, chunk) in the workspace (chunk: all tiles that fit workspace_limit, else 32 MiB), output transform "
            "adds the bias; transforms in channel ranges and the GEMMs in batch ranges (one BLAS thread each, or "
            "the float32 microkernel for round widths matmul would give it: tiling.micro) on "
            "helper threads; see workspace_formula; ranked first when N*ceil(OH/2)*ceil(OW/2) >= 64 tiles and "
            "min(C, OC) >= 256, or >= 196 tiles and min(C, OC) >= 128, just ahead of im2col_parts and im2col from "
            "32 tiles, else after im2col. "
            "direct: shifted row updates per kernel tap (3x3 undilated windows of one input channel: each output row "
            "written once with its nine taps; with stride 1 and padding 1 the inner rows of a dense plane as one "
            "flat loop, with column stride 2 dense rows read as element pairs), ranges of (N, OC) planes on helper "
            "threads, workspace 0, ranked first when depthwise (C/groups == 1). "
            "Non-finite values: winograd's and winograd4's transforms add and subtract the inputs of a tile (and the "
            "taps of a weight), so an inf input gives NaN rather than inf in the outputs of its tile, and inputs or "
            "weights beyond ~1e37 (float32; ~1e36 for winograd4, whose transforms scale by up to 8 and 25) can "
            "overflow to inf or NaN where the convolution itself is finite (as any "
            "Winograd convolution, cuDNN's included); direct skips the taps that fall on padding rather than "
            "multiplying them by 0, so an inf weight gives inf, not NaN, at the borders. im2col, im2col_tiles, "
            "implicit and gemm_1x1 follow the reference's inf / NaN."
        ),
        reference=reference,
    )
)
