"""Unary elementwise kernels: one specialised numba kernel per math function, made from one template.

``KERNELS[name]`` holds the kernels of ``vmath.<name>`` (or, for float32 data, of ``vmath.<name>_f32`` where that
exists). Each kernel's inner loop runs over a 1-D contiguous span (``x[k, lo:hi]``) with the function known at compile
time, so LLVM inlines it and vectorizes the loop (packed ``zmm``/``ymm`` math; ``tests/test_ops_elementwise.py``
checks the assembly). The op picks the kernel in phase 1 by the function's name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numba
import numpy as np

from ...layout import align, as_matrix
from ...runtime.fanout import fanout_parts, launcher, run_parts, split_range
from . import vmath as vm
from .jit import FAST, by_density, entry, row_of, rows_dense

# error_model="numpy": no ZeroDivisionError branch in divisions, so the loops vectorize
kern = numba.njit(nogil=True, cache=True, fastmath=FAST, error_model="numpy")

FUNCS = ("exp", "log", "tanh", "sigmoid", "silu", "gelu_erf", "gelu_tanh", "rsqrt",
         "sigmoid_f32", "silu_f32", "gelu_erf_f32", "exp_f32")
CODES = {name: i for i, name in enumerate(FUNCS)}
# functions with a float32-arithmetic variant: those whose exp argument is exact in float32 (gelu_tanh's 2u is not:
# its rounding, amplified by exp, would cost ~|2u| ulp, so it stays in float64)
F32 = frozenset(n[:-4] for n in FUNCS if n.endswith("_f32"))
FANOUT_MIN = 1 << 18  # elements from which a launch is cut into parts for helper threads (a hand-off costs ~50 us)
# single-thread ns per element of each function (/tmp/w/un2.py of the ninth session, 1 M elements, float32 data
# for the _f32 variants): a launch of the unary functions is cut into parts from FANOUT_NS of work, so a costly
# function fans out from fewer elements (gelu_erf_f32 on MiniLM's 128 x 1536: 130 us on one thread, 91-96 in two
# parts, /tmp/w/un3.py), a cheap one from more
COST_NS = {"exp": 0.84, "log": 1.13, "tanh": 1.5, "sigmoid": 1.0, "silu": 1.05, "gelu_erf": 6.6, "gelu_tanh": 1.4,
           "rsqrt": 0.9, "sigmoid_f32": 0.3, "silu_f32": 0.31, "gelu_erf_f32": 0.6, "exp_f32": 0.29}
FANOUT_NS = 75_000  # exp_f32 over FANOUT_MIN elements


def fanout_elements(fn: str) -> int:
    """Elements from which a launch of vmath function ``fn`` is cut into parts (``COST_NS``; half of it is the
    smallest part)."""
    return max(2, int(FANOUT_NS / COST_NS[fn]))


@numba.njit(nogil=True, cache=True, fastmath=FAST, error_model="numpy", inline="always")
def _apply(code: int, v: Any) -> Any:
    """vmath function number ``code`` of ``v``: ``code`` is a compile-time constant in every kernel, so only one
    branch survives (the kernels are specialised; nothing is selected per element)."""
    if code == 0:
        return vm.exp(v)
    if code == 1:
        return vm.log(v)
    if code == 2:
        return vm.tanh(v)
    if code == 3:
        return vm.sigmoid(v)
    if code == 4:
        return vm.silu(v)
    if code == 5:
        return vm.gelu_erf(v)
    if code == 6:
        return vm.gelu_tanh(v)
    if code == 7:
        return vm.rsqrt(v)
    if code == 8:
        return vm.sigmoid_f32(v)
    if code == 9:
        return vm.silu_f32(v)
    if code == 10:
        return vm.gelu_erf_f32(v)
    return vm.exp_f32(v)


def _specialise(code: int) -> tuple[Any, dict[bool, Any]]:
    """(span, rows) kernels of function ``code``: the one loop, written once; ``code`` is a closure constant
    (numba freezes it, and caches each specialisation under its value). ``rows`` by density
    (``jit.by_density``): dense rows taken through ``jit.row_of``, so the loop vectorizes."""

    @kern
    def span(x: Any, out: Any) -> None:
        for i in range(x.shape[0]):
            out[i] = _apply(code, x[i])

    def make_rows(dense: bool) -> Any:
        @kern
        def rows(x: Any, out: Any) -> None:
            for k in range(x.shape[0]):
                span(row_of(x, k, dense), row_of(out, k, dense))
        return rows

    return span, by_density(make_rows)


KERNELS: dict[str, tuple[Any, Any]] = {name: _specialise(CODES[name]) for name in FUNCS}


def _in_place(code: int) -> dict[bool, Any]:
    """In-place rows kernels (by density) of function ``code``: ``rows(x, x)`` would not vectorize, as LLVM's
    overlap check sends identical input and output to the scalar loop (6 ns against 0.6 per gelu element)."""
    def make(dense: bool) -> Any:
        @kern
        def rows_in_place(x: Any) -> None:
            for k in range(x.shape[0]):
                row = row_of(x, k, dense)
                for i in range(row.shape[0]):
                    row[i] = _apply(code, row[i])
        return rows_in_place
    return by_density(make)


IN_PLACE: dict[str, dict[bool, Any]] = {name: _in_place(CODES[name]) for name in FUNCS}


def function_for(name: str, compute: Any) -> str:
    """The vmath function used for ``name`` on data computed in ``compute`` (float32: the float32 variant)."""
    return name + "_f32" if np.dtype(compute) == np.float32 and name in F32 else name


ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")  # linear's fused activations (vmath names but relu)


def activation_kernel(name: str, sample: Any) -> Callable[[Any], None] | None:
    """``f(block)``: ``block = act(block)`` in place for activation ``name`` of ``ACTIVATIONS`` (None for "none")
    on 2-D float views typed as ``sample``: the vmath in-place rows kernel (one thread: it runs inside a GEMM part,
    on the part's block while it is in cache), or ``np.maximum`` for relu."""
    if name == "none":
        return None
    if name == "relu":
        zero = sample.dtype.type(0)
        return lambda block: np.maximum(block, zero, out=block)
    fn = function_for("gelu_erf" if name == "gelu" else name, sample.dtype)
    return entry(IN_PLACE[fn][rows_dense(sample)], sample)


def activation_in_place(name: str, block: Any) -> Callable[[], None] | None:
    """``activation_kernel`` bound to ``block``."""
    kernel = activation_kernel(name, block)
    return None if kernel is None else functools.partial(kernel, block)


def matrix2d(a: Any) -> Any:
    """``a`` as a (prod of leading dims, last dim) view, or None when the leading dims do not merge."""
    if a.ndim == 0:
        return a.reshape(1, 1)
    return as_matrix(a, tuple(range(a.ndim - 1)), (a.ndim - 1,))


def flat2d(a: Any) -> Any:
    """A C-contiguous array as one (1, size) row (the parallel kernel splits it into chunks), else ``matrix2d``."""
    return a.reshape(1, a.size) if a.flags.c_contiguous else matrix2d(a)


def pack_bytes(numel: int, itemsize: int, needs_pack: bool) -> int:
    return align(numel * itemsize) if needs_pack else 0


def pieces(out: Any, operands: tuple[Any, ...], parts: int, grain: int) -> list[tuple[Any, ...]]:
    """``(out piece, operand pieces...)`` cut along the first axis of ``out`` long enough for ``parts``
    ranges; an operand broadcast along that axis (missing, or of size 1) is passed whole. One piece, the arrays
    themselves, when ``out`` is small or an operand overlaps ``out`` other than as the same view (numpy buffers
    such overlaps within one call, and pieces would break that)."""
    whole = [(out, *operands)]
    if parts < 2 or out.size < 2 * grain:
        return whole
    for a in operands:
        if np.may_share_memory(a, out) and not (a.ctypes.data == out.ctypes.data and a.shape == out.shape
                                                 and a.strides == out.strides):
            return whole
    axis = next((i for i, n in enumerate(out.shape) if n >= parts), None)
    if axis is None:
        return whole
    inner = out.size // out.shape[axis]
    ranges = split_range(out.shape[axis], parts, max(1, grain // max(inner, 1)))

    def cut(a: Any, lo: int, hi: int) -> Any:
        ax = axis - (out.ndim - a.ndim)
        if ax < 0 or a.shape[ax] == 1:
            return a
        return a[(slice(None),) * ax + (slice(lo, hi),)]
    return [(cut(out, lo, hi), *(cut(a, lo, hi) for a in operands)) for lo, hi in ranges]


def build_unary(name: str, x: Any, out: Any, pack: bool, compute: Any) -> Callable[[Any], None]:
    """Launch for ``out = f(x)``: directly on (rows, cols) views, or through a dense ``compute``-dtype copy in the
    workspace when ``pack`` (float16, or dims that do not merge). The kernel is chosen and compiled here
    (phase 1), and from ``fanout_elements`` elements the views are cut into one piece per helper thread."""
    if x.size == 0:
        return lambda _: None
    fn_name = function_for(name, compute)
    fan = fanout_elements(fn_name)
    parts = fanout_parts() if x.size >= fan else 1
    grain = fan // 2
    if not pack:
        both = x.flags.c_contiguous and out.flags.c_contiguous
        xm, om = (flat2d(x), flat2d(out)) if both else (matrix2d(x), matrix2d(out))
        # compiled per piece: a column range of a C-contiguous matrix is not C-contiguous itself
        return launcher([_rows_call(fn_name, a, o) for o, a in pieces(om, (xm,), parts, grain)])
    sample = np.empty((1, 1), compute)
    fn = entry(IN_PLACE[fn_name][True], sample)
    n, nbytes = x.size, x.size * compute.itemsize
    spans = split_range(n, parts, grain)

    def launch(ws: Any) -> None:
        area = ws[:nbytes].view(compute)
        np.copyto(area.reshape(x.shape), x, casting="unsafe")
        m = area.reshape(1, n)
        run_parts([functools.partial(fn, m[:, lo:hi]) for lo, hi in spans])
        np.copyto(out, area.reshape(out.shape), casting="unsafe")
    return launch


def _rows_call(fn_name: str, a: Any, o: Any) -> Callable[[], None]:
    """``o = f(a)`` on (rows, cols) views, compiled for their types; the in-place kernel when they are one view."""
    dense = rows_dense(a, o)
    if a.ctypes.data == o.ctypes.data and a.shape == o.shape and a.strides == o.strides:
        return functools.partial(entry(IN_PLACE[fn_name][dense], o), o)
    return functools.partial(entry(KERNELS[fn_name][1][dense], a, o), a, o)
