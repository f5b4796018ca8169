"""Unary elementwise kernels: one specialised numba kernel per math function, made from one template.

``KERNELS[name]`` holds the kernels of ``vmath.<name>`` (or, for float32 data, of ``vmath.<name>_f32`` where that
exists). Each kernel's inner loop runs over a row (dense rows as bare contiguous views) with the function known at
compile time, so LLVM inlines it and vectorizes the loop (packed ``zmm``/``ymm`` math; ``tests/test_ops_elementwise.py``
checks the assembly). The op picks the kernel in phase 1 by the function's name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numba.core import types
from numba.extending import overload

from ...layout import align, flat2d, matrix2d, same_view
from ...runtime.fanout import fanout_parts, launcher, pieces, run_parts, split_range
from . import vmath as vm
from .half import cast_copy
from .jit import FAST, by_density, entry, jit_inline, row_of, rows_dense, rows_only, wide_vectors
from .streaming import LINE_BYTES, aligned_head, flat_launch, put_streaming, sfence, takes

# error_model="numpy": no ZeroDivisionError branch in divisions, so the loops vectorize
_LOOP_OPTIONS: Any = {"nogil": True, "fastmath": FAST, "error_model": "numpy"}  # also the span loops' (overloads)
kern: Callable[[Callable[..., Any]], Any] = numba.njit(cache=True, **_LOOP_OPTIONS)

FUNCS = (
    "exp",
    "log",
    "tanh",
    "sigmoid",
    "silu",
    "gelu_erf",
    "gelu_tanh",
    "rsqrt",
    "sigmoid_f32",
    "silu_f32",
    "gelu_erf_f32",
    "exp_f32",
)
CODES = {name: i for i, name in enumerate(FUNCS)}
# functions with a float32-arithmetic variant: those whose exp argument is exact in float32 (gelu_tanh's 2u is not:
# its rounding, amplified by exp, would cost ~|2u| ulp, so it stays in float64)
F32 = frozenset(n[:-4] for n in FUNCS if n.endswith("_f32"))
FANOUT_MIN = 1 << 18  # elements from which a launch is cut into parts for helper threads (a hand-off costs ~50 us)
# single-thread ns per element of each function (/tmp/w/un2.py of the ninth session, 1 M elements, float32 data
# for the _f32 variants): a launch of the unary functions is cut into parts from FANOUT_NS of work, so a costly
# function fans out from fewer elements (gelu_erf_f32 on MiniLM's 128 x 1536: 130 us on one thread, 91-96 in two
# parts, /tmp/w/un3.py), a cheap one from more
COST_NS = {
    "exp": 0.84,
    "log": 1.13,
    "tanh": 1.5,
    "sigmoid": 1.0,
    "silu": 1.05,
    "gelu_erf": 6.6,
    "gelu_tanh": 1.4,
    "rsqrt": 0.9,
    "sigmoid_f32": 0.3,
    "silu_f32": 0.31,
    "gelu_erf_f32": 0.6,
    "exp_f32": 0.29,
}
FANOUT_NS = 75_000  # exp_f32 over FANOUT_MIN elements


def fanout_elements(fn: str) -> int:
    """Elements from which a launch of vmath function ``fn`` is cut into parts (``COST_NS``; half of it is the
    smallest part)."""
    return max(2, int(FANOUT_NS / COST_NS[fn]))


HALVES_MIN = 1 << 16  # elements from which ``span_loops``' spans run as two halves (its docstring)


def span_loops(functions: tuple[Any, ...]) -> tuple[Callable[..., None], ...]:
    """``(span, span_in_place, span_staged, span_streaming)`` for kernels: ``span(code, x, out)`` runs ``out[i] =
    functions[code](x[i])`` over 1-D spans, ``span_in_place(code, x)`` runs ``x[i] = functions[code](x[i])`` (a loop
    of its own: ``span(code, x, x)`` fails LLVM's overlap check, which sends identical input and output to the
    scalar loop, 6 ns against 0.6 per gelu element), ``span_staged(code, x, out, buf)`` the same as ``span`` for
    spans of any stride (``out`` may be ``x``), through the dense 1-D ``buf`` a chunk at a time: copied in, computed
    there by the vector loop, copied out (a strided span's own loop stays scalar: gelu on every other column of a
    1024 x 1024 matrix 4.9 against 1.6 ns an element staged, on a transposed one 9.3 against 3.1, /tmp/w28/tr.py),
    ``span_streaming(code, x, out)`` the same as ``span`` on dense spans with non-temporal stores
    (``streaming.put_streaming``; the caller ends with an ``sfence``). ``code`` must be a closure constant of the
    calling kernel: an overload picks the function from its literal when the kernel is typed, so only that function
    is compiled (an ``if code == ...`` chain of inlined calls had every body typed and lowered before the dead
    branches were pruned, ~8 s a kernel against ~1). The loops are functions of their own, not inlined: inlined into
    a row loop, AVX2 code reloaded the polynomial constants on every iteration (110 instructions against 61).

    A span of at least ``HALVES_MIN`` elements computes one element from each of its halves per iteration: two
    independent memory streams keep more lines in flight while the arithmetic runs (Intel Xeon, 16 M float32
    elements out of cache, one thread: gelu 15.7 against 17.2 ms, silu 12.0 against 13.8; two threads, through the
    op, gelu / torch 0.84-1.02 against 0.87-0.96, /tmp/w28/gq.py, opab.py; the same in cache; four streams were no
    better than two). A shorter span (a row) runs as one stream: halves a few KiB apart, row after row, ran gelu
    1.3-1.8x slower on a Zen 5 EPYC wherever the rows came from L3 or memory (rows of 256 to 4096 float32 elements,
    4 M and 16 M in all, one and two threads; equal in L2 and on spans of 2^16 elements and more,
    /tmp/w42/gelu_var2.py of the forty-second session)."""

    def span(code: int, x: Any, out: Any) -> None:
        for i in range(x.shape[0]):
            out[i] = functions[code](x[i])

    def span_in_place(code: int, x: Any) -> None:
        span(code, x, x)

    def span_staged(code: int, x: Any, out: Any, buf: Any) -> None:
        span(code, x, out)

    def span_streaming(code: int, x: Any, out: Any) -> None:
        span(code, x, out)

    def function(code: Any) -> Any:
        return functions[code.literal_value] if isinstance(code, types.IntegerLiteral) else None  # None: retry

    @overload(span, jit_options=_LOOP_OPTIONS)
    def _span_typed(code: Any, x: Any, out: Any) -> Any:
        f = function(code)
        if f is None:
            return None

        def impl(code: Any, x: Any, out: Any) -> None:  # the stub's signature, annotations included (numba checks)
            wide_vectors()
            n = x.shape[0]
            if n < HALVES_MIN:
                for i in range(n):
                    out[i] = f(x[i])
                return
            h = n // 2
            for i in range(h):
                out[i] = f(x[i])
                out[i + h] = f(x[i + h])
            if n % 2:
                out[n - 1] = f(x[n - 1])

        return impl

    @overload(span_in_place, jit_options=_LOOP_OPTIONS)
    def _span_in_place_typed(code: Any, x: Any) -> Any:
        f = function(code)
        if f is None:
            return None

        def impl(code: Any, x: Any) -> None:
            wide_vectors()
            n = x.shape[0]
            if n < HALVES_MIN:
                for i in range(n):
                    x[i] = f(x[i])
                return
            h = n // 2
            for i in range(h):
                x[i] = f(x[i])
                x[i + h] = f(x[i + h])
            if n % 2:
                x[n - 1] = f(x[n - 1])

        return impl

    @overload(span_staged, jit_options=_LOOP_OPTIONS)
    def _span_staged_typed(code: Any, x: Any, out: Any, buf: Any) -> Any:
        f = function(code)
        if f is None:
            return None

        def impl(code: Any, x: Any, out: Any, buf: Any) -> None:
            wide_vectors()
            n, step = x.shape[0], buf.shape[0]
            for j0 in range(0, n, step):
                m = min(step, n - j0)
                for j in range(m):
                    buf[j] = x[j0 + j]
                for j in range(m):
                    buf[j] = f(buf[j])
                for j in range(m):
                    out[j0 + j] = buf[j]

        return impl

    @overload(span_streaming, jit_options=_LOOP_OPTIONS)
    def _span_streaming_typed(code: Any, x: Any, out: Any) -> Any:
        f = function(code)
        if f is None:
            return None

        def impl(code: Any, x: Any, out: Any) -> None:
            # one stream, not span's two halves: two interleaved streams of non-temporal stores ran 2.3-2.6x
            # slower (16 M float32 elements, two threads, /tmp/w40/nt11.py)
            wide_vectors()
            n = x.shape[0]
            head = aligned_head(out, n, LINE_BYTES)
            for i in range(head):
                out[i] = f(x[i])
            xs, os = x[head:], out[head:]
            line = LINE_BYTES // out.itemsize  # elements a cache line holds
            body = (n - head) // line * line
            for i in range(body):
                put_streaming(os, i, f(xs[i]))
            for i in range(head + body, n):
                out[i] = f(x[i])

        return impl

    return span, span_in_place, span_staged, span_streaming


_span, _span_in_place, _span_staged, _span_streaming = span_loops(tuple(getattr(vm, name) for name in FUNCS))
STAGE = 512  # elements of a strided row staged at a time (two 2 KiB float32 chunks stay in L1)
# dense rows shorter than this are staged a batch at a time, as one span: a loop of a few elements a row runs
# scalar. Crops of 28672 rows (8 x 64 images) viewed in wider ones, gelu, two threads: rows of 14 ran 2.4x faster
# staged, of 28 1.3x; of 56 1.04x, of 112 and 256 slower (0.81x, 0.68x: the copies cost more than they save),
# /tmp/w42/short.py of the forty-second session
SHORT_ROW = 32


@jit_inline
def _short_rows(code: int, x: Any, out: Any) -> None:
    """``out[k] = f(x[k])`` over dense rows shorter than ``SHORT_ROW`` (``out`` may be ``x``): as many whole rows
    as ``STAGE`` elements hold are copied into one dense buffer, computed there as one span, and copied out."""
    k_all, n = x.shape
    per = max(1, STAGE // max(n, 1))
    buf = np.empty(per * n, out.dtype)
    for k0 in range(0, k_all, per):
        m = min(per, k_all - k0)
        for r in range(m):
            xr = row_of(x, k0 + r, True)
            for j in range(n):
                buf[r * n + j] = xr[j]
        _span_in_place(code, buf[: m * n])
        for r in range(m):
            orow = row_of(out, k0 + r, True)
            for j in range(n):
                orow[j] = buf[r * n + j]


def _rows(code: int) -> dict[bool, Any]:
    """Rows kernels (``jit.by_density``) of function ``code``: ``out[k] = f(x[k])`` row by row, dense rows taken
    through ``jit.row_of`` so the loop vectorizes (short ones staged in batches, ``_short_rows``). Only constants
    are closed over: numba keys a cached kernel on its closure's pickle, and a captured kernel pickles with a
    per-process id, so its caller would never load from the cache."""

    def make(dense: bool) -> Any:
        @rows_only("x", "out")
        @kern
        def rows(x: Any, out: Any) -> None:
            if not dense:
                buf = np.empty(max(1, min(STAGE, x.shape[1])), out.dtype)  # step 0 would not end
                for k in range(x.shape[0]):
                    _span_staged(code, x[k], out[k], buf)
                return
            if x.shape[1] < SHORT_ROW:
                _short_rows(code, x, out)
                return
            for k in range(x.shape[0]):
                _span(code, row_of(x, k, dense), row_of(out, k, dense))

        return rows

    return by_density(make)


KERNELS: dict[str, dict[bool, Any]] = {name: _rows(CODES[name]) for name in FUNCS}


def _in_place(code: int) -> dict[bool, Any]:
    """In-place rows kernels (by density) of function ``code`` (``_span_in_place``; short rows ``_short_rows``)."""

    def make(dense: bool) -> Any:
        @rows_only("x")
        @kern
        def rows_in_place(x: Any) -> None:
            if not dense:
                buf = np.empty(max(1, min(STAGE, x.shape[1])), x.dtype)
                for k in range(x.shape[0]):
                    _span_staged(code, x[k], x[k], buf)
                return
            if x.shape[1] < SHORT_ROW:
                _short_rows(code, x, x)
                return
            for k in range(x.shape[0]):
                _span_in_place(code, row_of(x, k, dense))

        return rows_in_place

    return by_density(make)


IN_PLACE: dict[str, dict[bool, Any]] = {name: _in_place(CODES[name]) for name in FUNCS}


def _streaming(code: int) -> Any:
    """``out = f(x)`` over dense 1-D views of one float dtype with non-temporal stores (``_span_streaming``); ``out``
    apart from ``x`` (one array twice fails LLVM's overlap check: the loop would run scalar)."""

    @kern
    def run(x: Any, out: Any) -> None:
        _span_streaming(code, x, out)
        sfence()

    return run


STREAMING: dict[str, Any] = {name: _streaming(CODES[name]) for name in FUNCS}


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


def pack_bytes(numel: int, itemsize: int, needs_pack: bool) -> int:
    return align(numel * itemsize) if needs_pack else 0


def build_unary(name: str, x: Any, out: Any, pack: bool, compute: Any, stream: bool = False) -> Callable[[Any], None]:
    """Launch for ``out = f(x)``: directly on (rows, cols) views, or through a dense ``compute``-dtype copy in the
    workspace when ``pack`` (float16, or dims that do not merge). The kernel is chosen and compiled here
    (phase 1), and from ``fanout_elements`` elements the views are cut into one piece per helper thread.
    ``stream``: non-temporal stores (``STREAMING``) where the bound memory takes them (``streaming.takes``; not in
    place: the vector loop would not run over one array twice, see ``span_loops``)."""
    if x.size == 0:
        return lambda _: None
    fn_name = function_for(name, compute)
    fan = fanout_elements(fn_name)
    parts = fanout_parts() if x.size >= fan else 1
    grain = fan // 2
    if stream and not pack and takes((x,), out, in_place=False):
        return flat_launch(STREAMING[fn_name], (x,), out, parts, grain)
    if not pack:
        both = x.flags.c_contiguous and out.flags.c_contiguous
        xm, om = (flat2d(x), flat2d(out)) if both else (matrix2d(x), matrix2d(out))
        # compiled per piece: a column range of a C-contiguous matrix is not C-contiguous itself
        return launcher([_rows_call(fn_name, a, o) for o, a in pieces(om, (xm,), parts, grain)])
    fn = entry(IN_PLACE[fn_name][True], np.empty((1, 1), compute))  # the in-place views' specialization
    n, nbytes = x.size, x.size * compute.itemsize
    spans = split_range(n, parts, grain)

    def launch(ws: Any) -> None:
        area = ws[:nbytes].view(compute)
        cast_copy(area.reshape(x.shape), x)
        m = area.reshape(1, n)
        run_parts([functools.partial(fn, m[:, lo:hi]) for lo, hi in spans])
        cast_copy(out, area.reshape(out.shape))

    return launch


def _rows_call(fn_name: str, a: Any, o: Any) -> Callable[[], None]:
    """``o = f(a)`` on (rows, cols) views (the rows kernels take rows through ``row_of`` only: one compile for
    any layout); the in-place kernel when they are one view."""
    dense = rows_dense(a, o)
    if same_view(a, o):
        return functools.partial(entry(IN_PLACE[fn_name][dense], o), o)
    return functools.partial(entry(KERNELS[fn_name][dense], a, o), a, o)
