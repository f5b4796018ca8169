"""matmul / linear / baddbmm: every implementation vs float64 numpy, guarded workspace, exact sizes."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_layouts import compiles_nothing
from threads import num_threads

from twophase import device
from twophase.errors import ParamError
from twophase.kernels.cpu import gemm
from twophase.kernels.cpu.jit import any_layout, entry
from twophase.layout import align
from twophase.ops import baddbmm, linear, matmul
from twophase.ops.selection import forced
from twophase.testing import run_checked

IMPLS = ("microkernel", "gemm_folded", "batch_loop", "blas", "packed")


def _check(r: Any, ref: np.ndarray, rtol: float = 2e-5) -> None:
    assert r.guards_intact, "kernel wrote outside its workspace"
    assert r.unwritten == (0,)
    assert r.touched <= r.workspace_size and r.workspace_size - r.touched < 64 * 3 + 1 or r.workspace_size == 0
    out = r.outputs[0]
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol * max(1.0, float(np.abs(ref).max(initial=0))) * 4)


def _run_all(op: Any, *inputs: Any, ref: np.ndarray, **attrs: Any) -> set[str]:
    """Force each implementation in turn; return those the op offered for these operands."""
    ran = set()
    for impl in IMPLS:
        try:
            with forced(impl):
                r = run_checked(op, *inputs, **attrs)
        except ParamError as e:
            assert e.arg == "implementation"
            continue
        assert r.implementation == impl
        _check(r, ref)
        ran.add(impl)
    return ran


def _rand(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    return (rng.standard_normal(shape) + 0.25).astype(dtype)


batch_dims = st.lists(st.integers(1, 3), min_size=0, max_size=2)


@settings(max_examples=25, deadline=None)
@given(
    ba=batch_dims,
    bb=batch_dims,
    m=st.integers(1, 9),
    k=st.integers(1, 9),
    n=st.integers(1, 9),
    a1=st.booleans(),
    b1=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_matmul_matches_numpy_for_every_implementation(
    ba: list[int], bb: list[int], m: int, k: int, n: int, a1: bool, b1: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    bb = [1 if i < len(ba) and rng.random() < 0.5 else x for i, x in enumerate(bb)]  # broadcast some batch dims
    ba_ = [x if i >= len(ba) - len(bb) or rng.random() < 0.5 else 1 for i, x in enumerate(ba)]
    a = _rand(rng, (k,) if a1 else tuple(ba_) + (m, k))
    b = _rand(rng, (k,) if b1 else tuple(bb[-len(ba_) :] if len(bb) > len(ba_) else bb) + (k, n))
    try:
        ref = np.matmul(a.astype(np.float64), b.astype(np.float64))
    except ValueError:
        with pytest.raises(ParamError):
            matmul.get_workspace_size(device("cpu").tensor(a), device("cpu").tensor(b))
        return
    ran = _run_all(matmul, a, b, ref=ref)
    assert "packed" in ran and "blas" in ran


def test_matmul_folds_a_batch_that_shares_b_into_one_gemm(rng: np.random.Generator) -> None:
    a, b = _rand(rng, (3, 4, 5, 6)), _rand(rng, (6, 7))
    r = run_checked(matmul, a, b)
    assert (r.implementation, r.workspace_size) == ("gemm_folded", 0)
    _check(r, a.astype(np.float64) @ b)


def test_matmul_loops_over_batch_dims_b_varies_over_folding_the_rest(rng: np.random.Generator) -> None:
    a, b = _rand(rng, (2, 3, 4, 5)), _rand(rng, (2, 1, 5, 6))
    r = run_checked(matmul, a, b)
    assert (r.implementation, r.tiling.fold) == ("batch_loop", 1)
    _check(r, a.astype(np.float64) @ b)


def _strided(dev: Any, base: np.ndarray, shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> Any:
    t = dev.tensor(base)
    return t.strided(shape, strides, offset)


@pytest.mark.parametrize("layout", ["reversed_rows", "step2_cols", "transposed"])
def test_matmul_packs_operands_blas_cannot_take_into_the_workspace(
    dev: Any, rng: np.random.Generator, layout: str
) -> None:
    m, k, n = 5, 6, 7
    base = _rand(rng, (m * k * 2,))
    if layout == "reversed_rows":
        ta = _strided(dev, base, (m, k), (-k, 1), (m - 1) * k)
        av = np.lib.stride_tricks.as_strided(base[(m - 1) * k :], (m, k), (-k * 4, 4))
    elif layout == "step2_cols":
        ta = _strided(dev, base, (m, k), (2 * k, 2), 0)
        av = np.lib.stride_tricks.as_strided(base, (m, k), (2 * k * 4, 8))
    else:
        ta = _strided(dev, base, (m, k), (1, m), 0)
        av = np.lib.stride_tricks.as_strided(base, (m, k), (4, m * 4))
    b = _rand(rng, (k, n))
    r = run_checked(matmul, ta, b)
    ref = av.astype(np.float64) @ b
    if layout == "transposed":  # a column-major matrix is fine for BLAS as it is
        assert (r.implementation, r.workspace_size) == ("blas", 0)
    else:
        assert r.implementation == "packed" and r.tiling.pack == (True, False, False)
        assert r.workspace_size == align(m * k * 4)
        assert r.touched == m * k * 4
    _check(r, ref)


def test_matmul_writes_through_a_strided_output_via_the_workspace(dev: Any, rng: np.random.Generator) -> None:
    a, b = _rand(rng, (4, 3)), _rand(rng, (3, 5))
    out = dev.empty((8, 5), np.float32).strided((4, 5), (10, 2), 0)  # no unit stride: not BLAS-ready
    r = run_checked(matmul, a, b, out=out)
    assert r.implementation == "packed" and r.tiling.pack[2]
    np.testing.assert_allclose(out.numpy(), a.astype(np.float64) @ b, rtol=1e-5)


def test_matmul_tight_limit_on_unpackable_operands_names_the_smallest_workspace(
    dev: Any, rng: np.random.Generator
) -> None:
    ta = _strided(dev, _rand(rng, (40,)), (4, 5), (-5, 1), 15)
    with pytest.raises(ParamError) as e:
        matmul.get_workspace_size(ta, dev.tensor(_rand(rng, (5, 2))), workspace_limit=10)
    assert e.value.arg == "workspace_limit" and f"at least {align(80)} bytes" in e.value.expected


def test_matmul_float64_and_zero_inner_dim(rng: np.random.Generator) -> None:
    a, b = _rand(rng, (3, 4), np.float64), _rand(rng, (4, 2), np.float64)
    _check(run_checked(matmul, a, b), a @ b, rtol=1e-12)
    r = run_checked(matmul, np.ones((3, 0), np.float32), np.ones((0, 2), np.float32))
    assert np.array_equal(r.outputs[0], np.zeros((3, 2)))


@pytest.mark.parametrize("impl", [None, "packed"])
def test_matmul_of_empty_packed_operands_through_the_one_shot_api(dev: Any, impl: str | None) -> None:
    """A packed plan whose operands are empty needs no workspace: the launch gets empty bytes, not None."""
    import contextlib

    import twophase

    a = dev.tensor(np.ones((4, 6), np.float32)).strided((0, 3), (6, 2), 0)  # (0, 3), no unit stride
    b = dev.tensor(np.ones((3, 5), np.float32))
    with forced(impl) if impl else contextlib.nullcontext():
        assert matmul.get_workspace_size(a, b)[1].implementation == "packed"
        assert twophase.matmul(a, b).numpy().shape == (0, 5)
        k0 = twophase.matmul(np.ones((3, 0), np.float32), np.ones((0, 4), np.float32)).numpy()
    np.testing.assert_array_equal(k0, np.zeros((3, 4)))


@pytest.mark.parametrize("x_shape", [(7,), (5, 7), (2, 3, 7)])
def test_linear_matches_x_weight_transposed_plus_bias(rng: np.random.Generator, x_shape: tuple[int, ...]) -> None:
    x, w, bias = _rand(rng, x_shape), _rand(rng, (4, 7)), _rand(rng, (4,))
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + bias
    r = run_checked(linear, x, w, bias)
    if len(x_shape) == 3:
        assert r.implementation == "gemm_folded"
    _check(r, ref)
    assert _run_all(linear, x, w, None, ref=ref - bias)


@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (2.0, 1.0), (0.5, -3.0), (1.5, 0.0)])
def test_baddbmm_scales_product_and_addend(rng: np.random.Generator, alpha: float, beta: float) -> None:
    c, a, b = _rand(rng, (2, 1, 5)), _rand(rng, (2, 3, 4)), _rand(rng, (2, 4, 5))
    if beta == 0:
        c[0, 0, 0] = np.nan  # ignored when beta == 0, as in PyTorch
    ref = alpha * (a.astype(np.float64) @ b) + (beta * c if beta else 0)
    _check(run_checked(baddbmm, c, a, b, alpha=alpha, beta=beta), ref)


@pytest.mark.parametrize("alpha,beta", [(1.0, 1e-39), (1e20, 1e-20), (1e-30, 1.0), (3.0, 1e-7)])
def test_baddbmm_with_alpha_and_beta_far_apart(rng: np.random.Generator, alpha: float, beta: float) -> None:
    """The epilogue computed beta * ((alpha/beta)*P + c): alpha/beta overflowed float32 (inf, and NaN where a
    product is 0) or flushed the product to 0."""
    c, a, b = _rand(rng, (2, 3, 4)) + 1, _rand(rng, (2, 3, 5)), _rand(rng, (2, 5, 4))
    a[0, 0] = 0.0
    ref = alpha * (a.astype(np.float64) @ b) + beta * c.astype(np.float64)
    for impl in IMPLS:
        with contextlib.suppress(ParamError), forced(impl):
            r = run_checked(baddbmm, c, a, b, alpha=alpha, beta=beta)
            assert np.isfinite(r.outputs[0]).all(), impl
            np.testing.assert_allclose(r.outputs[0], ref, rtol=2e-5, atol=0)


@pytest.mark.parametrize(
    "a_shape,b_shape,b_dtype,arg",
    [
        ((3, 4), (5, 2), np.float32, "b"),
        ((2, 3, 4), (3, 4, 2), np.float32, "b"),
        ((3, 4), (4, 2), np.float64, "b"),
        ((), (4,), np.float32, "a"),
    ],
)
def test_matmul_rejects_bad_operands_with_param_error(
    dev: Any, a_shape: tuple[int, ...], b_shape: tuple[int, ...], b_dtype: Any, arg: str
) -> None:
    a, b = dev.tensor(np.ones(a_shape, np.float32)), dev.tensor(np.ones(b_shape, b_dtype))
    with pytest.raises(ParamError) as e:
        matmul.get_workspace_size(a, b)
    assert e.value.op == "matmul" and e.value.arg == arg


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_linear_activation_matches_the_reference_on_every_implementation(
    rng: np.random.Generator, activation: str
) -> None:
    """act(x @ w.T + b): on small operands every implementation, each applying it after its GEMM; on the
    microkernel's shapes (weight stored (in, out)) in three parts, each on its own block (without AVX-512, on
    BLAS); with a bias the kernel
    cannot take (strided), after the epilogue. Inputs are centred so the activations' negative side is hit."""
    from twophase.ops.linalg import _ref_linear

    x, w, b = rng.standard_normal((6, 9)).astype(np.float32), _rand(rng, (5, 9)), _rand(rng, (5,))
    assert {"blas", "packed"} <= _run_all(linear, x, w, b, activation=activation, ref=_ref_linear(x, w, b, activation))
    x = rng.standard_normal((2, 64, 96)).astype(np.float32)
    w_in_out = rng.standard_normal((96, 512)).astype(np.float32) / 8
    w = device("cpu").tensor(w_in_out).transpose()  # (out, in), stored (in, out) as MiniLM's weights
    wide = rng.standard_normal(1024).astype(np.float32)
    for bias in (wide[:512], wide[::2]):
        pre, ref = _ref_linear(x, w_in_out.T, bias), _ref_linear(x, w_in_out.T, bias, activation)
        assert (pre < -1).any() and (pre > 1).any()
        with num_threads(3):
            r = run_checked(linear, x, w, bias, activation=activation)
        if gemm.available():
            assert r.implementation == "microkernel" and len(r.tiling.parts) == 3
        else:  # no AVX-512: BLAS on the weight folded in place, the activation after it
            assert r.implementation == "gemm_folded"
        _check(r, ref, rtol=1e-4)


def test_linear_activation_on_an_output_whose_leading_dims_do_not_merge(dev: Any, rng: np.random.Generator) -> None:
    """An ``out`` of rows 0-3 of a (2, 6, 5) tensor: the activation goes slab by slab after the GEMM."""
    from twophase.ops.linalg import _ref_linear

    x, w, b = rng.standard_normal((2, 4, 9)).astype(np.float32), _rand(rng, (5, 9)), _rand(rng, (5,))
    base = dev.tensor(np.full((2, 6, 5), np.nan, np.float32))
    out = base.strided((2, 4, 5), (30, 5, 1), 0)
    r = run_checked(linear, x, w, b, out=out, activation="silu")
    _check(r, _ref_linear(x, w, b, "silu"))
    assert np.isnan(base.numpy()[:, 4:]).all()  # the rows around it untouched


def test_linear_rejects_an_unknown_activation(dev: Any) -> None:
    with pytest.raises(ParamError) as e:
        linear.get_workspace_size(
            dev.tensor(np.ones((2, 3), np.float32)), dev.tensor(np.ones((4, 3), np.float32)), None, activation="tanh"
        )
    assert e.value.arg == "activation" and "gelu" in str(e.value)


def test_linear_rejects_bias_of_wrong_size(dev: Any) -> None:
    with pytest.raises(ParamError) as e:
        linear.get_workspace_size(
            dev.tensor(np.ones((2, 3), np.float32)),
            dev.tensor(np.ones((4, 3), np.float32)),
            dev.tensor(np.ones(3, np.float32)),
        )
    assert e.value.arg == "bias"


# ---------------------------------------------------------------- the bias / addend fused into one BLAS call
def test_numpy_blas_binding_is_found_and_agrees() -> None:
    """The ILP64 cblas_?gemm of numpy's wheel OpenBLAS (checked against numpy when it is bound)."""
    from twophase.kernels.cpu.blas import gemm_for

    if gemm_for(np.float32) is None:
        pytest.skip("numpy's BLAS is not the bundled OpenBLAS: linear keeps matmul + a separate bias pass")
    assert gemm_for(np.float64) is not None
    assert gemm_for(np.int64) is None and gemm_for(np.float16) is None


@pytest.mark.parametrize("layout", ["dense", "x transposed", "weight transposed", "out strided"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_linear_bias_fused_into_the_gemm_matches_every_layout(
    dev: Any, rng: np.random.Generator, layout: str, dtype: Any
) -> None:
    from twophase.kernels.cpu.blas import fused_gemm, gemm_for

    x, w, bias = _rand(rng, (6, 9), dtype), _rand(rng, (5, 9), dtype), _rand(rng, (5,), dtype)
    if layout == "x transposed":
        x = np.ascontiguousarray(x.T).T
    if layout == "weight transposed":
        w = np.ascontiguousarray(w.T).T
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + bias
    out = None
    if layout == "out strided":
        out = dev.tensor(np.zeros((6, 16), dtype)).strided((6, 5), (16, 1), 0)
    r = run_checked(linear, x, w, bias, out=out) if out is not None else run_checked(linear, x, w, bias)
    _check(r, ref)
    assert _run_all(linear, x, w, bias, ref=ref)
    # the fused launch itself, where it applies, equals the reference too (and declines an aliasing addend)
    if gemm_for(dtype) is not None:
        o = np.full((6, 5), np.nan, dtype)
        launch = fused_gemm(x, w.T, o, o, bias, 1.0, 1.0)
        assert launch is not None
        launch(None)
        np.testing.assert_allclose(o, ref, rtol=2e-5, atol=1e-4)
        assert fused_gemm(x, w.T, o, o, o[0], 1.0, 1.0) is None  # c inside out: not fused
        assert fused_gemm(x, w.T, o, o, bias, 0.0, 1.0) is None  # alpha 0: the product's NaN must propagate


def test_baddbmm_alpha_zero_still_propagates_the_products_nan(rng: np.random.Generator) -> None:
    c, a, b = _rand(rng, (3, 5)), _rand(rng, (3, 4)), _rand(rng, (4, 5))
    a[1, 2] = np.inf
    with np.errstate(invalid="ignore"):
        ref = 0.0 * (a.astype(np.float64) @ b) + 2.0 * c
    r = run_checked(baddbmm, c, a, b, alpha=0.0, beta=2.0)
    out = r.outputs[0]
    assert np.isnan(out[1]).all() and np.isnan(ref[1]).all()
    np.testing.assert_allclose(np.delete(out, 1, 0), np.delete(ref, 1, 0), rtol=1e-6)


# ---------------------------------------------------------------- the register-blocked float32 microkernel
needs_micro = pytest.mark.usefixtures("microkernel")  # on with AVX-512, forced with AVX2 (conftest)
# column counts phase 1 gives the microkernel (at most a tenth recomputed by the last 16-wide panel)
MICRO_COLS = [n for n in range(32, 200) if n >= 0.9 * (-(-n // 16) * 16)]


@needs_micro
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("k", [37, 300])
def test_gemm_kernel_writes_exactly_its_block_for_every_column_tail(
    rng: np.random.Generator, has_bias: bool, packed: bool, k: int
) -> None:
    """The kernel itself on blocks of a larger poisoned matrix: 32- and 16-wide panels, the last overlapping
    16-wide panel (every remainder 1-15), blocks narrower than 16 (scalar loop), row blocks off the 6-row
    kernel, with and without a bias row, b's panels read in place or packed (a NaN-poisoned scratch), one k
    block or two (the second adds to the first); nothing outside the block is touched. The specialization is the
    one phase 1 compiles (matrices typed any layout)."""
    a, b = _rand(rng, (30, k)), _rand(rng, (k, 90))
    bias = _rand(rng, (90,))
    pack = np.full(gemm.panel_bytes(k) // 4 if packed else 0, np.nan, np.float32)
    kernel = gemm.gemm_f32_entry()
    for i0, i1, j0, j1 in [
        (0, 30, 0, 90),
        (3, 20, 5, 21),
        (1, 2, 0, 17),
        (7, 30, 40, 55),
        (0, 13, 60, 63),
        (5, 11, 0, 48),
        (0, 30, 33, 90),
    ]:
        c = np.full((30, 90), np.nan, np.float32)
        kernel(a, b, c, bias, has_bias, i0, i1, j0, j1, pack)
        ref = a[i0:i1].astype(np.float64) @ b[:, j0:j1].astype(np.float64) + (bias[j0:j1] if has_bias else 0.0)
        np.testing.assert_allclose(c[i0:i1, j0:j1], ref, rtol=2e-5, atol=1e-4)
        c[i0:i1, j0:j1] = np.nan
        assert np.isnan(c).all(), "the kernel wrote outside its block"


@pytest.mark.skipif(not gemm.ymm_available(), reason="the 8-lane GEMM kernels need AVX2 and FMA")
@pytest.mark.parametrize("k", [1, 21, 300])
def test_8_lane_gemm_writes_exactly_its_block_for_every_column_count(rng: np.random.Generator, k: int) -> None:
    """``gemm_f32_ymm`` (SDPA's head products without AVX-512) for every column count 8-41 (16- and 8-column
    panels, the last 8-column panel overlapping for the remainders 1-7), rows off the 6-row block, a strided
    ``a`` and ``b``'s rows padded with NaN that must never be read into ``c``; the block of a poisoned ``c`` is
    written exactly, nothing around it; the stacked form agrees head by head."""
    for n in range(8, 42):
        for m in (1, 6, 13):
            a = _rand(rng, (m, 2 * k))[:, ::2]
            b_mem = np.full((k, n + 5), np.nan, np.float32)
            b_mem[:, :n] = _rand(rng, (k, n))
            b = b_mem[:, :n]
            c = np.full((m + 2, n + 19), -7.0, np.float32)
            gemm.gemm_f32_ymm(a, b, c[1 : m + 1, 3 : 3 + n])
            ref = a.astype(np.float64) @ b.astype(np.float64)
            np.testing.assert_allclose(c[1 : m + 1, 3 : 3 + n], ref, rtol=2e-5, atol=1e-4)
            c[1 : m + 1, 3 : 3 + n] = -7.0
            assert (c == -7.0).all(), f"wrote outside the block at {n} columns"
    a, b = _rand(rng, (2, 3, 11, k)), _rand(rng, (2, 3, k, 29))
    c = np.full((2, 3, 11, 29), np.nan, np.float32)
    gemm.gemm_f32_heads_ymm(a, b, c)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b.astype(np.float64), rtol=2e-5, atol=1e-4)
    c = np.full((3, 7), -7.0, np.float32)
    with pytest.raises(ValueError, match="fewer than 8 columns"):  # its last panel would start before column 0
        gemm.gemm_f32_ymm(_rand(rng, (3, k)), _rand(rng, (k, 7)), c)
    assert (c == -7.0).all()


def _tile_caller(tile: Any) -> Any:
    """A jitted ``(a, b, c, kl, m, n, accumulate, bias)`` calling ``tile`` (``gemm.gemm_tile`` or ``gemm_tile_ymm``,
    which take addresses and element strides) on arrays; an empty ``bias`` passes no bias."""

    @numba.njit(nogil=True)
    def call(a: Any, b: Any, c: Any, kl: int, m: int, n: int, accumulate: int, bias: Any) -> None:
        tile(
            a.ctypes.data,
            a.strides[0] // 4,
            a.strides[1] // 4,
            b.ctypes.data,
            b.strides[0] // 4,
            c.ctypes.data,
            c.strides[0] // 4,
            kl,
            m,
            n,
            accumulate,
            bias.ctypes.data if bias.shape[0] else 0,
            0,
        )

    return call


_tile_gemm, _tile_gemm_ymm = _tile_caller(gemm.gemm_tile), _tile_caller(gemm.gemm_tile_ymm)
_NO_BIAS = np.zeros(0, np.float32)


@needs_micro
@pytest.mark.parametrize("accumulate", [0, 1])
def test_gemm_tile_masked_last_panel_for_every_column_count(rng: np.random.Generator, accumulate: int) -> None:
    """``gemm_tile`` (conv2d's tiles, attention's heads): every column count 1-140, so each remainder takes the
    8-wide (1-8 left), the 16-wide (9-15), the 24-wide (17-24: a ymm second vector), the 32-wide (25-31: second
    vector), the 56-wide (49-56: a ymm fourth vector) or the 64-wide (57-63: fourth vector) masked panel, or a
    32-wide one then the rest (33-48), alone or after whole 64-column panels, on rows off the 6-row kernel and a
    strided ``a``; the block of a poisoned ``c`` is written (or added to) exactly, nothing around it."""
    k = 21
    for n in range(1, 141):
        for m in (1, 4, 6, 13):  # b's rows padded past a multiple of 16, as a tile's
            _check_tile(_tile_gemm, rng, k, m, n, "accumulate" if accumulate else "plain", -(-n // 16) * 16 + 16)


@pytest.mark.skipif(not gemm.ymm_available(), reason="the 8-lane GEMM kernels need AVX2 and FMA")
@pytest.mark.parametrize("mode", ["plain", "accumulate", "bias"])
def test_gemm_tile_ymm_for_every_column_count(rng: np.random.Generator, mode: str) -> None:
    """``gemm_tile_ymm`` (the fused attention tiles' GEMMs without AVX-512): every column count 1-80, so each
    remainder takes the 8-column panel, the masked one (1-7 left) or both, alone or after 16-column panels, on rows
    off the 6-row kernel, a strided ``a`` and k of 1 to 300; the block of a NaN-poisoned ``c`` is written (added to,
    or with the bias row added) exactly, nothing around it."""
    for k in (1, 21, 300):
        for n in range(1, 81):
            for m in (1, 4, 6, 13):
                _check_tile(_tile_gemm_ymm, rng, k, m, n, mode, -(-n // 8) * 8)


def _check_tile(call: Any, rng: np.random.Generator, k: int, m: int, n: int, mode: str, b_cols: int) -> None:
    """``call`` (``_tile_caller``) on an (m, k) strided ``a`` and a (k, n) ``b`` whose rows are readable to
    ``b_cols`` columns, into the block of a NaN-poisoned ``c``: written (added to, or with the bias row added)
    exactly, nothing around it."""
    a = _rand(rng, (m, 2 * k))[:, ::2]
    b = _rand(rng, (k, b_cols))
    old = _rand(rng, (m, n))
    bias = _rand(rng, (n,)) if mode == "bias" else _NO_BIAS
    c = np.full((m + 2, n + 19), np.nan, np.float32)
    if mode == "accumulate":
        c[1 : m + 1, 3 : 3 + n] = old
    call(a, b, c[1 : m + 1, 3 : 3 + n], k, m, n, int(mode == "accumulate"), bias)
    ref = a.astype(np.float64) @ b[:, :n].astype(np.float64)
    ref += old if mode == "accumulate" else bias if mode == "bias" else 0.0
    np.testing.assert_allclose(c[1 : m + 1, 3 : 3 + n], ref, rtol=2e-5, atol=1e-4)
    c[1 : m + 1, 3 : 3 + n] = np.nan
    assert np.isnan(c).all(), f"wrote outside the block at {n} columns, {m} rows"


@pytest.mark.skipif(not gemm.ymm_available(), reason="the 8-lane GEMM kernels need AVX2 and FMA")
@pytest.mark.parametrize("mode", ["plain", "accumulate", "bias"])
def test_gemm_tile_ymm_panels_outermost_on_a_large_b(rng: np.random.Generator, mode: str) -> None:
    """``gemm_tile_ymm`` on a ``b`` above ``YMM_PANELS_OUTER_FLOATS`` (im2col_tiles' GEMMs), whose 16-column
    panels go outermost over blocks of rows: every column remainder of a panel, one block of rows or several (the
    last one shorter), a strided ``a``; the block of a NaN-poisoned ``c`` is written (added to, or with the bias
    row added) exactly, nothing around it."""
    k = 300
    rows_per_block = gemm.YMM_MC_FLOATS // k // gemm.MR * gemm.MR
    for n in range(gemm.YMM_PANELS_OUTER_FLOATS // k + 1, gemm.YMM_PANELS_OUTER_FLOATS // k + 18):
        assert k * n > gemm.YMM_PANELS_OUTER_FLOATS
        for m in (13, rows_per_block + 1, 2 * rows_per_block + 5):
            _check_tile(_tile_gemm_ymm, rng, k, m, n, mode, -(-n // 8) * 8)


@needs_micro
@pytest.mark.parametrize("accumulate", [0, 1])
@pytest.mark.parametrize("name", ["gemm_table", "gemm_table_ymm"])
def test_gemm_table_reads_b_rows_at_their_offsets(rng: np.random.Generator, accumulate: int, name: str) -> None:
    """``gemm_table`` (conv2d's implicit GEMM) and its 8-lane form: row k of b starts at ``table[k]`` floats, any
    alignment, in any order, rows overlapping; every column count 1-140 (each panel width, masked or whole) on rows
    off the 6-row kernel and a strided ``a``; the block of a poisoned ``c`` is written (or added to) exactly,
    nothing around it."""
    table_gemm = getattr(gemm, name)
    k = 19
    for n in range(1, 141):
        for m in (1, 5, 13):
            a = _rand(rng, (m, 2 * k))[:, ::2]
            pool = _rand(rng, (4 * n + 64,))
            table = np.zeros(k + gemm.TABLE_AHEAD, np.int64)  # (the microkernel reads TABLE_AHEAD entries ahead)
            table[:k] = rng.integers(0, pool.size - n - 16, k)  # (a masked panel reads up to 15 floats past a row)
            b = np.stack([pool[o : o + n] for o in table[:k]])
            old = _rand(rng, (m, n))
            c = np.full((m + 2, n + 19), np.nan, np.float32)
            if accumulate:
                c[1 : m + 1, 3 : 3 + n] = old
            block = c[1 : m + 1, 3 : 3 + n]
            lda, sak = a.strides[0] // 4, a.strides[1] // 4
            table_gemm(
                a.ctypes.data,
                lda,
                sak,
                pool.ctypes.data,
                table.ctypes.data,
                block.ctypes.data,
                c.strides[0] // 4,
                k,
                m,
                n,
                accumulate,
            )
            ref = a.astype(np.float64) @ b.astype(np.float64) + (old if accumulate else 0.0)
            np.testing.assert_allclose(block, ref, rtol=2e-5, atol=1e-4)
            c[1 : m + 1, 3 : 3 + n] = np.nan
            assert np.isnan(c).all(), f"wrote outside the block at {n} columns"


@pytest.mark.parametrize(
    ("half", "want"),
    [
        (False, [64, 64, 64, 48, 48, 48, 32, 32, 32, 16, 16, 128, 128]),
        (True, [56, 56, 64, 48, 48, 48, 32, 24, 24, 16, 16, 120, 128]),  # ymm-tailed panels cost by their columns
    ],
)
def test_columns_computed_counts_the_panels_work(monkeypatch: pytest.MonkeyPatch, half: bool, want: list[int]) -> None:
    """The columns' worth of work of ``gemm_tile``'s panels: 49-56 and 17-24 (a ymm last vector) count as 56 and 24
    where a zmm FMA is two 256-bit passes (``half_width_fma``), else as 64 and 32."""
    monkeypatch.setattr(gemm, "half_width_fma", lambda: half)
    cols = (49, 56, 57, 48, 40, 33, 32, 24, 17, 16, 8, 120, 121)
    assert [gemm.columns_computed(n) for n in cols] == want


@needs_micro
@settings(max_examples=30, deadline=None)
@given(
    batch=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    m=st.integers(3, 20),
    k=st.integers(1, 40),
    n=st.sampled_from(MICRO_COLS),
    a_t=st.booleans(),
    b_pad=st.integers(0, 5),
    threads=st.sampled_from([1, 2, 3, 5]),
    seed=st.integers(0, 2**31),
)
def test_microkernel_matches_numpy_over_tails_strides_and_parts(
    batch: list[int], m: int, k: int, n: int, a_t: Any, b_pad: int, threads: int, seed: int
) -> None:
    """Row counts off the 6-row block, columns off the 32- and 16-column panels (the last 16-column panel
    overlapping), a read through a transposed view, b's rows padded, 1-5 parts (columns or rows): every element
    of out written, none past."""
    rng = np.random.default_rng(seed)
    dev = device("cpu")
    a = _rand(rng, tuple(batch) + (m, k))
    b_mem = _rand(rng, (k, n + b_pad))
    b = b_mem[:, :n]
    ref = a.astype(np.float64) @ b.astype(np.float64)
    if a_t:  # transposed matrices of a batch would not merge into one GEMM's rows
        a = a.reshape(a.shape[-2:]) if math.prod(batch) == 1 else a[(0,) * len(batch)]
        ref = a.astype(np.float64) @ b.astype(np.float64)
    a_t = dev.tensor(np.ascontiguousarray(np.swapaxes(a, -1, -2))).transpose() if a_t else dev.tensor(a)
    b_t = dev.tensor(b_mem).strided((k, n), (n + b_pad, 1), 0)
    with num_threads(threads), forced("microkernel"):
        r = run_checked(matmul, a_t, b_t)
    _check(r, ref)


@needs_micro
def test_microkernel_is_compiled_once_for_any_layout(rng: np.random.Generator) -> None:
    """The microkernel reads its matrices through pointers and strides, so one specialization serves contiguous
    operands, a transposed a, b's rows padded and a strided out (each another compile of ~17 s before)."""
    m, k, n = 20, 40, 48
    a, b_mem = _rand(rng, (m, k)), _rand(rng, (k, n + 3))
    b = b_mem[:, :n]
    ref = a.astype(np.float64) @ b.astype(np.float64)
    dev = device("cpu")
    with forced("microkernel"):
        _check(run_checked(matmul, a, np.ascontiguousarray(b)), ref)
        with compiles_nothing():
            a_t = dev.tensor(np.ascontiguousarray(a.T)).transpose()
            b_t = dev.tensor(b_mem).strided((k, n), (n + 3, 1), 0)
            _check(run_checked(matmul, a_t, b_t), ref)
            out = dev.tensor(np.zeros((m, n + 5), np.float32)).strided((m, n), (n + 5, 1), 2)
            _check(run_checked(matmul, a, b_t, out=out), ref)


@needs_micro
def test_attention_heads_run_the_microkernel_specialization_of_matmul() -> None:
    """``gemm_f32_heads`` calls ``gemm_f32`` with no literal-typed argument, so it runs the specialization matmul
    and conv2d compile instead of compiling one of its own (~15 s)."""
    stack = any_layout(np.float32, 4)
    entry(gemm.gemm_f32_heads, stack, stack, stack)
    assert gemm.gemm_f32.signatures
    assert not [s for s in gemm.gemm_f32.signatures if any(isinstance(t, numba.types.Literal) for t in s)]


@needs_micro
@pytest.mark.parametrize("m,k,n", [(250, 300, 47), (7, 513, 110), (241, 257, 64), (128, 384, 1152)])
@pytest.mark.parametrize("threads", [1, 2])
def test_microkernel_blocks_k_and_rows_and_fuses_the_bias(
    rng: np.random.Generator, m: int, k: int, n: int, threads: int
) -> None:
    """k past one 256-deep block (later blocks add to what the first stored, the bias only once), rows past
    one 240-row block, linear's bias added by the kernel, a strided output."""
    x, w, bias = _rand(rng, (m, k)), _rand(rng, (k, n)), _rand(rng, (n,))
    ref = x.astype(np.float64) @ w.astype(np.float64) + bias
    wt = device("cpu").tensor(w).transpose()  # weight stored (in, out), as MiniLM's: weight.T has unit stride
    with num_threads(threads):
        r = run_checked(linear, x, wt, bias)
        assert r.implementation == "microkernel"
        _check(r, ref, rtol=1e-5)
        out = device("cpu").tensor(np.zeros((m, n + 7), np.float32)).strided((m, n), (n + 7, 1), 0)
        _check(run_checked(linear, x, wt, bias, out=out), ref, rtol=1e-5)
        # a read through a negative row stride, in place (BLAS would need it packed)
        rev = device("cpu").tensor(np.ascontiguousarray(x[::-1])).strided((m, k), (-k, 1), (m - 1) * k)
        r = run_checked(matmul, rev, w)
        assert r.implementation == "microkernel" and r.workspace_size == _panels_workspace(r.tiling.parts, k, n)
        _check(r, ref - bias, rtol=1e-5)
        # an addend that is not a bias row: the kernel, then the epilogue
        c = _rand(rng, (m, n))
        _check(run_checked(baddbmm, c, x, w, alpha=0.5, beta=2.0), 0.5 * (ref - bias) + 2.0 * c, rtol=1e-5)


def _panels_workspace(parts: tuple[tuple[int, int, int, int], ...], k: int, row_stride: int, offset: int = 0) -> int:
    """The microkernel's documented workspace: a packed panel of b per part when every part has enough rows and
    b's rows (``row_stride`` floats apart from float ``offset``) are not all 64-byte aligned."""
    rows = min(i1 - i0 for i0, i1, _, _ in parts)
    packs = gemm.packing_pays() and rows >= gemm.PACK_MIN_ROWS and (row_stride % 16 or offset % 16)
    return len(parts) * align(min(gemm.KC, k) * gemm.NR * 4) if packs else 0


@needs_micro
@pytest.mark.parametrize("m,k,n", [(31, 40, 64), (32, 40, 64), (64, 300, 200), (128, 384, 1152), (100, 600, 47)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("pays", [True, False])
def test_microkernel_packs_b_panels_from_enough_rows_and_without_room_reads_b_in_place(
    rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch, m: int, k: int, n: int, threads: int, pays: bool
) -> None:
    """From PACK_MIN_ROWS rows per part, when b's rows are not 64-byte aligned and the host is one where packing
    pays (``pays``: as on an Intel Xeon, not on AMD Zen), the microkernel asks for one packed panel of b per part
    (its documented workspace, touched to the last aligned byte); under a limit below that, with aligned rows, or
    where packing does not pay, it reads b in place with no workspace. Both sum in the same order: bit for bit
    the same result, against the float64 reference."""
    monkeypatch.setattr(gemm, "packing_pays", lambda: pays)
    x, w, bias = _rand(rng, (m, k)), _rand(rng, (k, n)), _rand(rng, (n,))
    ref = x.astype(np.float64) @ w.astype(np.float64) + bias
    wt = device("cpu").tensor(w).transpose()
    with num_threads(threads):
        packed = run_checked(linear, x, wt, bias)
        assert packed.implementation == "microkernel"
        want = _panels_workspace(packed.tiling.parts, k, n)
        assert packed.workspace_size == want and packed.tiling.panels == (want > 0)
        assert want == 0 or packed.touched > want - 64 * len(packed.tiling.parts)
        _check(packed, ref, rtol=1e-5)
        in_place = run_checked(linear, x, wt, bias, workspace_limit=0)
    assert in_place.implementation == "microkernel" and in_place.workspace_size == 0 and not in_place.tiling.panels
    np.testing.assert_array_equal(packed.outputs[0], in_place.outputs[0])
    if m >= gemm.PACK_MIN_ROWS * threads:
        assert packed.tiling.panels == (pays and n % 16 != 0)


@needs_micro
def test_microkernel_packs_b_panels_only_when_b_rows_are_not_64_byte_aligned(
    rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b read through views of one aligned (k, n + 16) block: its row stride is 64-byte aligned, so the panels are
    packed only where the view starts off a 64-byte boundary (offset 1), and the results match either way (on a
    host where packing pays: ``packing_pays``)."""
    monkeypatch.setattr(gemm, "packing_pays", lambda: True)
    m, k, n = 64, 96, 128
    x, w, bias = _rand(rng, (m, k)), _rand(rng, (k, n + 16)), _rand(rng, (n,))
    whole = device("cpu").tensor(w)
    with num_threads(1):
        for offset, packs in ((0, False), (16, False), (1, True), (5, True)):
            wt = whole.strided((n, k), (1, n + 16), offset)  # weight (out, in): weight.T is w[:, offset:offset + n]
            r = run_checked(linear, x, wt, bias)
            assert r.implementation == "microkernel" and r.tiling.panels == packs, offset
            assert r.workspace_size == _panels_workspace(r.tiling.parts, k, n + 16, offset)
            ref = x.astype(np.float64) @ w[:, offset : offset + n].astype(np.float64) + bias
            _check(r, ref, rtol=1e-5)


@needs_micro
def test_microkernel_parts_split_columns_at_panels_or_rows_whichever_evens_the_work() -> None:
    from twophase.ops.linalg import _micro_parts

    with num_threads(2):
        assert _micro_parts(128, 384, 1152, 1) == ((0, 128, 0, 576), (0, 128, 576, 1152))
        assert _micro_parts(128, 576, 6272, 1) == ((0, 128, 0, 3136), (0, 128, 3136, 6272))
        # the second column part would take the tail's panel too (208 columns' work against 192): rows
        assert _micro_parts(512, 2304, 392, 1) == ((0, 258, 0, 392), (258, 512, 0, 392))
        assert _micro_parts(128, 384, 110, 1) == ((0, 66, 0, 110), (66, 128, 0, 110))
        assert _micro_parts(4, 4, 47, 1) == ((0, 4, 0, 47),)  # too small to wake a helper
        assert _micro_parts(4, 384, 1536, 1) == ((0, 4, 0, 1536),)
    with num_threads(3):
        # 1 panel for 3 parts: rows instead, at 6-row blocks (50 of them: 16, 17, 17)
        assert _micro_parts(300, 300, 47, 1) == ((0, 96, 0, 47), (96, 198, 0, 47), (198, 300, 0, 47))
    assert _micro_parts(128, 384, 1152, 2) == ()  # b's columns strided
    assert _micro_parts(8193, 384, 1152, 1) == ()  # more rows than measured
    assert _micro_parts(8192, 1024, 1024, 1) != ()  # a large b as well
    assert _micro_parts(128, 384, 31, 1) == ()  # no full panel
    assert _micro_parts(512, 4608, 49, 1) == ()  # 64 columns computed for 49
    assert _micro_parts(2, 384, 1536, 1) == ()  # GEMV-like: BLAS


@needs_micro
def test_microkernel_propagates_inf_and_nan_and_is_not_used_for_float64(rng: np.random.Generator) -> None:
    a, b = _rand(rng, (9, 20)), _rand(rng, (20, 46))
    a[3, 5], b[7, 33] = np.inf, np.nan
    with np.errstate(invalid="ignore"):
        ref = a.astype(np.float64) @ b.astype(np.float64)
    r = run_checked(matmul, a, b)
    assert r.implementation == "microkernel"
    out = r.outputs[0]
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(out[fin], ref[fin], rtol=2e-5, atol=1e-4)
    assert run_checked(matmul, a.astype(np.float64), b.astype(np.float64)).implementation != "microkernel"


@pytest.mark.parametrize(
    "a_shape, b_shape",
    [
        ((3, 5), (5, 4)),
        ((2, 3, 5), (2, 5, 4)),
        ((3, 5), (2, 5, 4)),
        ((5,), (2, 5, 4)),
        ((2, 3, 5), (5,)),
        ((3, 0), (0, 4)),  # K = 0: beta * c (it was refused: BLAS gets no product)
        ((2, 3, 0), (2, 0, 4)),
    ],
)
@pytest.mark.parametrize("alpha, beta", [(1.0, 1.0), (-0.5, 2.0)])
def test_baddbmm_in_place_into_c(
    dev: Any, rng: np.random.Generator, a_shape: tuple[int, ...], b_shape: tuple[int, ...], alpha: float, beta: float
) -> None:
    """out = c (torch's baddbmm_): one BLAS call with beta per matrix, so no product overwrites c before it is
    read."""
    import twophase

    a, b = _rand(rng, a_shape), _rand(rng, b_shape)
    ref0 = a.astype(np.float64) @ b
    c0 = _rand(rng, ref0.shape)
    c = dev.tensor(c0)
    twophase.baddbmm(c, a, b, out=c, alpha=alpha, beta=beta)
    np.testing.assert_allclose(c.numpy(), alpha * ref0 + beta * c0, rtol=1e-5, atol=1e-5)


def test_baddbmm_in_place_where_blas_cannot_is_refused(dev: Any) -> None:
    import twophase

    c = dev.tensor(np.ones((3, 4), np.float32))
    with pytest.raises(ParamError, match="c itself") as e:
        twophase.baddbmm(c, np.ones((3, 2), np.float32), np.ones((2, 4), np.float32), out=c, alpha=0.0)
    assert e.value.arg == "out"
    np.testing.assert_array_equal(c.numpy(), np.ones((3, 4)))
    with pytest.raises(ParamError, match="overlapping a"):
        x = dev.tensor(np.ones((4, 4), np.float32))
        twophase.matmul(x, np.eye(4, dtype=np.float32), out=x)  # matmul has no in-place form
