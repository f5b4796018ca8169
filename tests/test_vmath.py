"""The vectorizable math functions against numpy / libm over dense samples of their whole domain."""

from __future__ import annotations

import math
import re
from typing import Any

import numba
import numpy as np
import pytest

from twophase.kernels.cpu import jit as jit_module
from twophase.kernels.cpu import vmath as vm
from twophase.kernels.cpu.elementwise import span_loops

_k = numba.njit(nogil=True, cache=True, error_model="numpy", fastmath={"contract", "arcp", "nsz"})


# one kernel per function, which its span loop picks by the literal code (elementwise.span_loops, as the library's
# unary kernels do): an if-chain over all of them made numba type every body, ~10-14 s per dtype
_FUNCTIONS = (
    vm.exp,
    vm.log,
    vm.tanh,
    vm.erf,
    vm.erfc,
    vm.sigmoid,  # 0-5
    vm.exp_f32,
    vm.sigmoid_f32,
    vm.silu_f32,
    vm.gelu_erf_f32,
    vm.exp_nonpos_f32,  # 6-11: float32 only
    vm.exp_nonpos_zeroing_f32,
)
_span = span_loops(_FUNCTIONS)[0]


def _kernel(code: int) -> Any:
    @_k
    def apply(x: Any, out: Any) -> None:
        _span(code, x, out)

    return apply


_KERNELS = tuple(_kernel(code) for code in range(len(_FUNCTIONS)))


def _apply(code: int, x: Any, out: Any) -> None:
    """vmath function ``code`` of each element of ``x`` into ``out``; the float32 ones (6-11) take x as float32."""
    _KERNELS[code](x.astype(np.float32, copy=False) if code >= 6 else x, out)


_erf = np.vectorize(math.erf, otypes=[np.float64])
_erfc = np.vectorize(math.erfc, otypes=[np.float64])
FUNCS: dict[str, tuple[int, Any]] = {
    "exp": (0, np.exp),
    "log": (1, np.log),
    "tanh": (2, np.tanh),
    "erf": (3, _erf),
    "erfc": (4, _erfc),
    "sigmoid": (5, lambda x: 1.0 / (1.0 + np.exp(-x))),
}
F32_TINY = float(np.finfo(np.float32).tiny)


def all_float32(step: int) -> np.ndarray[Any, Any]:
    """Every ``step``-th float32 bit pattern (both signs, denormals, inf, NaN) plus edge values."""
    bits = np.arange(0, 1 << 32, step, dtype=np.uint64).astype(np.uint32)
    edges = np.array(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            1.0,
            -1.0,
            F32_TINY,
            1e-45,
            -1e-45,
            88.72,
            88.73,
            -87.33,
            -103.97,
            -104.0,
            0.3,
            -0.3,
            6.0,
            9.0,
            10.5,
            3.4e38,
        ],
        np.float32,
    )
    return np.concatenate([bits.view(np.float32), edges])


def run(name: str, x: np.ndarray[Any, Any], out_dtype: Any) -> np.ndarray[Any, Any]:
    out = np.empty(x.shape, out_dtype)
    _apply(FUNCS[name][0], x, out)
    return out


def rel_error_f32(got: np.ndarray[Any, Any], ref: np.ndarray[Any, Any], denormal_ulps: int = 1) -> float:
    """Max relative error where the exact value is a normal float32; denormal results must be within
    ``denormal_ulps`` units of 2^-149."""
    with np.errstate(all="ignore"):
        ref32 = ref.astype(np.float32)
    both_nan = np.isnan(got) & np.isnan(ref)
    assert np.array_equal(np.isnan(got), np.isnan(ref)), "NaN where the reference has none (or vice versa)"
    inf = np.isinf(ref32)
    assert np.array_equal(got[inf], ref32[inf]), "infinities differ"
    normal = ~both_nan & ~inf & (np.abs(ref) >= F32_TINY)
    sub = ~both_nan & ~inf & ~normal
    sub_err = np.abs(got[sub].astype(np.float64) - ref[sub])
    assert np.all(sub_err <= denormal_ulps * 2.0**-149), f"denormal results off by {np.max(sub_err) / 2.0**-149} ulp"
    return float(np.max(np.abs(got[normal] - ref[normal]) / np.abs(ref[normal])))


@pytest.mark.parametrize("name", ["exp", "log", "tanh", "sigmoid"])
def test_float32_max_relative_error_within_2e7_over_whole_domain(name: str) -> None:
    x = all_float32(257)  # ~16.7M samples
    with np.errstate(all="ignore"):
        ref = FUNCS[name][1](x.astype(np.float64))
    err = rel_error_f32(run(name, x, np.float32), ref)
    assert err <= 2e-7, f"{name}: {err}"


def _gelu64(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return 0.5 * x * _erfc(-x / math.sqrt(2.0))  # type: ignore[no-any-return]


# code, float64 reference, bound in float32 ulp (2^-24 relative), |x| below which intermediates are normal floats
F32_FUNCS: dict[str, tuple[int, Any, float, float]] = {
    "exp_f32": (6, np.exp, 2.0, np.inf),
    "sigmoid_f32": (7, FUNCS["sigmoid"][1], 8.0, 87.0),
    "silu_f32": (8, lambda x: x / (1.0 + np.exp(-x)), 8.0, 87.0),
    "gelu_erf_f32": (9, _gelu64, 8.0, 13.0),
    "exp_nonpos_f32": (10, np.exp, 2.0, np.inf),
    "exp_nonpos_zeroing_f32": (11, np.exp, 2.0, np.inf),
}  # x <= 0 only


@pytest.mark.parametrize("name", list(F32_FUNCS))
def test_float32_arithmetic_functions_within_their_ulp_bound_over_whole_domain(name: str) -> None:
    """The ``*_f32`` kernels (float32 arithmetic) on every 257th float32: NaN, inf and the limits as the float64
    function; within the documented ulp bound where the result and its intermediates are normal floats; beyond,
    results near the underflow lose bits gradually (absolute error below the smallest normal float32)."""
    code, ref_fn, ulps, exact_below = F32_FUNCS[name]
    x = all_float32(257)
    if name.startswith("exp_nonpos"):
        x = x[~(x > 0)]
    out = np.empty_like(x)
    with np.errstate(all="ignore"):
        _apply(code, x, out)
        ref = ref_fn(x.astype(np.float64))
    exact = ~(np.abs(x) >= exact_below)  # NaN counts as exact
    err = rel_error_f32(out[exact], ref[exact], denormal_ulps=4)
    assert err <= ulps * 2.0**-24, f"{name}: {err / 2.0**-24:.2f} ulp"
    tail = ~exact & np.isfinite(ref)
    assert np.all(np.abs(out[tail] - ref[tail]) < F32_TINY), f"{name}: beyond |x| = {exact_below}"
    with np.errstate(all="ignore"):
        assert np.array_equal(
            out[~exact & ~np.isfinite(ref)], ref[~exact & ~np.isfinite(ref)].astype(np.float32), equal_nan=True
        )


@pytest.mark.parametrize("name", ["exp_nonpos_f32", "exp_nonpos_zeroing_f32"])
def test_exp_nonpos_is_zero_below_half_the_smallest_denormal_and_keeps_nan(name: str) -> None:
    """Below -104 (e^-104 < 2^-150) the result is 0 (the zeroing variant by a select, so masked scores skip the
    underflowing multiply); from -103.9 it still rounds to the denormals (2^-149 = e^-103.28); NaN propagates."""
    x = np.array([-np.inf, -1e30, -104.5, -104.01, -103.9, -103.5, -100.0, -87.5, -0.0, np.nan], np.float32)
    out = np.empty_like(x)
    _apply(F32_FUNCS[name][0], x, out)
    assert (out[:4] == 0).all() and (out[4:6] == np.float32(2.0**-149)).all()
    np.testing.assert_allclose(out[6:9], np.exp(x[6:9].astype(np.float64)), rtol=1e-6, atol=4 * 2.0**-149)
    assert np.isnan(out[9])


@pytest.mark.parametrize("name", ["erf", "erfc"])
def test_erf_erfc_float32_max_relative_error_within_2e7(name: str) -> None:
    x = all_float32(4099)
    with np.errstate(all="ignore"):
        ref = FUNCS[name][1](x.astype(np.float64))
    err = rel_error_f32(run(name, x, np.float32), ref)
    assert err <= 2e-7, f"{name}: {err}"


@pytest.mark.parametrize(
    "name,lo,hi,tol",
    [
        ("exp", -708.0, 709.0, 1e-15),
        ("log", -700.0, 700.0, 1e-15),
        ("tanh", -20.0, 20.0, 1e-15),
        ("erf", -6.0, 6.0, 1e-15),
        ("erfc", -6.0, 26.54, 1e-13),  # to the last normal result (the tail's fit ended at 26: 2e-5 at 26.5)
    ],
)
def test_float64_relative_error_near_double_precision(name: str, lo: float, hi: float, tol: float) -> None:
    x = np.linspace(lo, hi, 200_003)
    if name == "log":
        x = np.exp(x)
    ref = FUNCS[name][1](x)
    got = run(name, x, np.float64)
    nz = ref != 0
    assert np.max(np.abs(got[nz] - ref[nz]) / np.abs(ref[nz])) <= tol


def test_special_values_follow_ieee_limits() -> None:
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 5e-324, -1.0])
    with np.errstate(all="ignore"):
        got = {n: run(n, x, np.float64) for n in FUNCS}
    np.testing.assert_array_equal(got["exp"], [np.nan, np.inf, 0.0, 1.0, 1.0, 1.0, math.exp(-1.0)])
    np.testing.assert_array_equal(got["log"][:6], [np.nan, np.inf, np.nan, -np.inf, -np.inf, math.log(5e-324)])
    assert np.isnan(got["log"][6])
    np.testing.assert_array_equal(got["tanh"][:6], [np.nan, 1.0, -1.0, 0.0, -0.0, 5e-324])
    assert math.copysign(1.0, got["tanh"][4]) < 0 and math.copysign(1.0, got["erf"][4]) < 0
    np.testing.assert_array_equal(got["erf"][:5], [np.nan, 1.0, -1.0, 0.0, -0.0])
    np.testing.assert_array_equal(got["erfc"][:5], [np.nan, 0.0, 2.0, 1.0, 1.0])
    np.testing.assert_array_equal(got["sigmoid"][:4], [np.nan, 1.0, 0.0, 0.5])


def _max_min_kernels() -> tuple[Any, Any]:
    """Fresh (uncached) kernels: the lowering of vm.maximum / vm.minimum is chosen when they compile."""

    @numba.njit(nogil=True, fastmath={"contract", "arcp", "nsz"})
    def pairwise(a: Any, b: Any, hi: Any, lo: Any) -> None:
        for i in range(a.shape[0]):
            hi[i] = vm.maximum(a[i], b[i])
            lo[i] = vm.minimum(a[i], b[i])

    @numba.njit(nogil=True, fastmath={"contract", "arcp", "nsz"})
    def extremes(a: Any) -> tuple[Any, Any]:
        hi, lo = a[0], a[0]
        for i in range(1, a.shape[0]):  # the reduction form the softmax and pooling kernels vectorize
            hi = vm.maximum(hi, a[i])
            lo = vm.minimum(lo, a[i])
        return hi, lo

    return pairwise, extremes


@pytest.mark.parametrize("intrinsics", [True, False], ids=["llvm.maximum", "maxnum-and-select"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_propagating_max_and_min_in_both_lowerings(
    monkeypatch: pytest.MonkeyPatch, intrinsics: bool, dtype: Any
) -> None:
    """vm.maximum / vm.minimum propagate NaN like np.maximum / np.minimum, through ``llvm.maximum`` where the back
    end selects it and through ``maxnum`` plus a select where it does not (LLVM 15: ``NAN_MAX_INTRINSICS``)."""
    if intrinsics and not vm.NAN_MAX_INTRINSICS:
        pytest.skip("this LLVM cannot select llvm.maximum (the fallback is the other case)")
    monkeypatch.setattr(vm, "NAN_MAX_INTRINSICS", intrinsics)
    pairwise, extremes = _max_min_kernels()
    rng = np.random.default_rng(7)
    special = np.array(
        [
            np.nan,
            np.inf,
            -np.inf,
            0.0,
            -0.0,
            1.0,
            -1.0,
            np.finfo(dtype).max,
            np.finfo(dtype).tiny,
            np.finfo(dtype).smallest_subnormal,
        ],
        dtype,
    )
    a = np.concatenate([np.repeat(special, special.size), rng.standard_normal(1000).astype(dtype)])
    b = np.concatenate([np.tile(special, special.size), rng.standard_normal(1000).astype(dtype)])
    hi, lo = np.full_like(a, 42.0), np.full_like(a, 42.0)
    pairwise(a, b, hi, lo)
    zero = (a == 0) & (b == 0)  # the fallback may order -0.0 and +0.0 either way: compare those by value only
    for got, want in ((hi, np.maximum(a, b)), (lo, np.minimum(a, b))):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.signbit(got[~zero]), np.signbit(want[~zero]))
    finite = rng.standard_normal(4099).astype(dtype)
    assert extremes(finite) == (finite.max(), finite.min())
    for at in (0, 1, 2000, 4098):  # a NaN anywhere in the reduction, also in the vector loop's tail
        withnan = finite.copy()
        withnan[at] = np.nan
        assert all(np.isnan(v) for v in extremes(withnan)), at


def test_the_select_form_keeps_a_running_maximum_off_masked_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    """``a[i] = maximum_stored(a[i], x)`` (fused SDPA's column maxima) in the select form (``jit.SLOW_MASKED_STORES``,
    CPUs without AVX-512) compiles to plain vector stores: llvm.maximum's expansion let LLVM fold it into vmaskmovps,
    microcoded on AMD's AVX2 CPUs."""
    monkeypatch.setattr(jit_module, "SLOW_MASKED_STORES", True)

    @numba.njit(nogil=True, fastmath={"contract", "arcp", "nsz"})
    def running(hi: Any, x: Any) -> None:
        for i in range(hi.shape[0]):
            hi[i] = vm.maximum_stored(hi[i], x[i])

    rng = np.random.default_rng(3)
    hi, x = rng.standard_normal((2, 1000)).astype(np.float32)
    x[[5, 900]] = np.nan
    want = np.maximum(hi, x)
    running(hi, x)
    np.testing.assert_array_equal(hi, want)
    asm = "\n".join(running.inspect_asm().values())
    assert "maxps" in asm  # the loop is vectorized
    # no masked store: neither AVX's vmaskmov nor an AVX-512 store to memory under a mask (``(%rax) {%k1}``);
    # on AVX-512 the select itself is a masked move between registers, which is not a store
    assert "vmaskmov" not in asm
    assert not re.search(r"\)\s*\{%k", asm)


def _rsqrt_op(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    from twophase import ops
    from twophase.testing import run_checked

    got: np.ndarray[Any, Any] = run_checked(ops.rsqrt, x).outputs[0]
    return got


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_rsqrt_limits_and_denormals_match_numpy(dtype: Any) -> None:
    """rsqrt is a true division: LLVM's rsqrtps estimate (which ``arcp`` allows on float32 vectors) gave NaN at 0
    and inf and -inf on denormals. Exact at ±0, ±inf, NaN and negatives; denormals (and the largest finite) within
    an ulp of numpy."""
    fi = np.finfo(dtype)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -1.0, -fi.smallest_subnormal], dtype)
    finite = np.array(
        [
            fi.smallest_subnormal,
            fi.smallest_subnormal * 3,
            fi.tiny / 2,
            fi.tiny,
            1e-40,
            1e-310,
            0.25,
            4.0,
            2.0,
            3.0,
            fi.max,
        ],
        np.float64,
    ).astype(dtype)
    finite = finite[finite != 0]  # 1e-40 and 1e-310 where the dtype holds them
    x = np.concatenate([special, finite, (np.random.default_rng(3).random(997) * 100).astype(dtype)])
    got = _rsqrt_op(x)
    with np.errstate(all="ignore"):
        want = (1.0 / np.sqrt(x.astype(np.float64))).astype(dtype)
    k = special.size
    np.testing.assert_array_equal(got[:k], want[:k])
    np.testing.assert_array_equal(np.signbit(got[:k]), np.signbit(want[:k]))  # 1/sqrt(-0) = -inf
    assert np.all(np.isfinite(got[k:]))
    ulps = np.abs(got[k:].astype(np.float64) - want[k:]) / np.spacing(want[k:]).astype(np.float64)
    assert np.max(ulps) <= 1.0, np.max(ulps)


def test_rsqrt_float32_within_1ulp_over_whole_domain() -> None:
    x = all_float32(257)
    got = _rsqrt_op(x)
    with np.errstate(all="ignore"):
        want = (1.0 / np.sqrt(x.astype(np.float64))).astype(np.float32)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    num = ~np.isnan(want)
    exact = num & ((want == 0) | np.isinf(want))
    np.testing.assert_array_equal(got[exact], want[exact])
    rest = num & ~exact
    ulps = np.abs(got[rest].astype(np.float64) - want[rest]) / np.spacing(want[rest]).astype(np.float64)
    assert np.max(ulps) <= 1.0, np.max(ulps)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rsqrt_kernel_is_vectorized_without_the_rsqrt_estimate(dtype: Any) -> None:
    """The unary rsqrt rows kernel, recompiled uncached (cached code has no assembly) for any layout (as phase 1
    compiles it), divides packed square roots and has no rsqrtps / vrsqrt14ps estimate."""
    from twophase.kernels.cpu.elementwise import KERNELS
    from twophase.kernels.cpu.jit import FAST

    fresh = numba.njit(nogil=True, fastmath=FAST, error_model="numpy")(KERNELS["rsqrt"][True].py_func)
    arr = numba.types.Array(numba.from_dtype(np.dtype(dtype)), 2, "A")
    fresh.compile((arr, arr))
    asm = fresh.inspect_asm((arr, arr))
    assert re.search(r"vsqrtp[sd]\s+[^\n]*%[yz]mm", asm) and re.search(r"vdivp[sd]\s+[^\n]*%[yz]mm", asm)
    assert "rsqrt" not in asm


@numba.njit(nogil=True, fastmath={"contract", "arcp", "nsz"}, error_model="numpy")
def _half_neg_both(a: Any, hi: Any, lo: Any, new: Any, old: Any) -> None:
    for i in range(a.shape[0]):
        new[i] = vm._exp_half_neg_sq_2p64_f32(a[i])
        old[i] = vm._exp_times_f32(vm._F_MH * hi[i], vm._F_MH * lo[i], vm._EXP_F32)


def test_gelu_exp_in_r2_is_bitwise_the_exp_of_minus_half() -> None:
    """gelu's ``_exp_half_neg_sq_2p64_f32(a)`` computes ``_exp_times_f32(-hi/2, -lo/2, _EXP_F32)`` of a^2 split
    exactly into hi + lo, scaled by powers of two at every step: its coefficients are the originals times
    (-1/2)^k exactly, and its results the same bits on every float32 a of gelu's range [0, 14.5] (a 4099th of
    them, ~270 k), though it never forms lo: fma(a, a, n * hi) rounds once what the split's sum rounded once."""
    for q, c, k in zip(vm._EXP_F32_R2, vm._EXP_F32, range(len(vm._EXP_F32) - 1, -1, -1), strict=True):
        assert float(q) * (-2.0) ** k == float(c)
    a = all_float32(4099)
    a = a[np.isfinite(a) & (a >= 0) & (a <= 14.5)]
    hi = (a * a).astype(np.float32)
    lo = (a.astype(np.float64) ** 2 - hi).astype(np.float32)  # the exact error of a*a
    new, old = np.empty_like(hi), np.empty_like(hi)
    _half_neg_both(a, hi, lo, new, old)
    assert a.size > 200_000 and np.array_equal(new.view(np.uint32), old.view(np.uint32))


@numba.njit(nogil=True, fastmath={"contract", "arcp", "nsz"}, error_model="numpy")
def _nonpos_both(x: Any, out: Any) -> None:
    for i in range(x.shape[0]):
        xc = vm._F_NONPOS_LO if x[i] < vm._F_NONPOS_LO else x[i]
        out[0, i] = vm.exp_nonpos_f32(x[i])
        out[1, i] = vm._exp_times_f32(xc, vm._F0, vm._EXP_F32) * vm._F_2M64
        out[2, i] = vm.exp_nonpos_zeroing_f32(x[i])
        out[3, i] = vm._F0 if x[i] < vm._F_NONPOS_ZERO else out[1, i]


def test_exp_nonpos_with_prescaled_coefficients_is_bitwise_the_two_step_scaling() -> None:
    """``exp_nonpos_f32`` (and its zeroing form) take 2^-64 into the polynomial's coefficients: the same bits as
    e^x * 2^64 rounded and then scaled by 2^-64 (one rounding either way), normal results and denormals alike, on
    every 257th float32 x <= 0 (~8.4 M values) and NaN."""
    for q, c in zip(vm._EXP_F32_2M64, vm._EXP_F32, strict=True):
        assert float(q) == float(c) * 2.0**-64
    x = all_float32(257)
    x = x[~(x > 0)]
    out = np.empty((4, x.size), np.float32)
    _nonpos_both(x, out)
    bits = out.view(np.uint32)
    assert np.array_equal(bits[0], bits[1]) and np.array_equal(bits[2], bits[3])
    assert ((out[0] >= 2.0**-126) & (out[0] <= 1)).any() and ((out[0] > 0) & (out[0] < 2.0**-126)).any()  # both kinds
