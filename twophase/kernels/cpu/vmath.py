"""Vectorizable math for numba kernels (numba has no SVML here, so ``math.exp`` in a loop stays scalar).

Every function takes a float (float16/32/64), computes in float64 with branch-free range reduction and
polynomials, and returns float64: rounded to float32 the result is within 0.5 ulp + 1e-12 relative;
float64 results are within a few 1e-15 relative (``tests/test_vmath.py`` measures both). ``rsqrt`` is the
exception: a division of the hardware square root, within 1 float32 ulp on float32 data. NaN propagates,
±inf and float32 / float64 denormals give the limits of the exact function.

The ``*_f32`` functions take and return float32 and compute in float32 (16 lanes per AVX-512 register instead
of 8, no conversions), for float32 / float16 data: within 8 float32 ulp where the result and its intermediates are
normal floats (``tests/test_vmath.py`` bounds them); results near the float32 underflow lose bits gradually.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from llvmlite.binding import llvm_version_info
from numba.core import types
from numba.extending import intrinsic, overload
from numpy.polynomial import Chebyshev, Polynomial
from numpy.polynomial import chebyshev as cheb

from . import jit as jit_module
from .jit import FAST, REDUCE

jit = numba.njit(nogil=True, cache=True, fastmath=FAST, inline="always")  # inlined into the calling kernel

__all__ = [
    "exp",
    "log",
    "tanh",
    "erf",
    "erfc",
    "sigmoid",
    "silu",
    "gelu_erf",
    "gelu_tanh",
    "rsqrt",
    "exp_f32",
    "exp_nonpos_f32",
    "exp_nonpos_zeroing_f32",
    "sigmoid_f32",
    "silu_f32",
    "gelu_erf_f32",
    "maximum",
    "maximum_stored",
    "minimum",
    "fsum",
    "deviation_sums",
    "corrected_moments",
    "exp_shifted",
    "exp_shifted_masked",
]


def __as_f64_typer(typingctx: Any, bits: Any) -> Any:
    """Reinterpret int64 bits as a float64."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(args[0], context.get_value_type(types.float64))

    return types.float64(types.int64), codegen


_as_f64: Any = intrinsic(__as_f64_typer)  # numba's intrinsic wrapper; Any: called with the value args only


def __as_i64_typer(typingctx: Any, x: Any) -> Any:
    """Reinterpret float64 bits as an int64."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(args[0], context.get_value_type(types.int64))

    return types.int64(types.float64), codegen


_as_i64: Any = intrinsic(__as_i64_typer)  # numba's intrinsic wrapper; Any: called with the value args only


def __as_f32_typer(typingctx: Any, bits: Any) -> Any:
    """Reinterpret the low 32 bits of an int64 as a float32."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        low = builder.trunc(args[0], context.get_value_type(types.int32))
        return builder.bitcast(low, context.get_value_type(types.float32))

    return types.float32(types.int64), codegen


_as_f32: Any = intrinsic(__as_f32_typer)  # numba's intrinsic wrapper; Any: called with the value args only


def __fma32_typer(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """a * b + c rounded once (float32)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.fma(*args)

    return types.float32(types.float32, types.float32, types.float32), codegen


_fma32: Any = intrinsic(__fma32_typer)  # numba's intrinsic wrapper; Any: called with the value args only


def __fma64_typer(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """a * b + c rounded once (float64)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.fma(*args)

    return types.float64(types.float64, types.float64, types.float64), codegen


_fma64: Any = intrinsic(__fma64_typer)  # numba's intrinsic wrapper; Any: called with the value args only


def __div_exact_typer(typingctx: Any, a: Any, b: Any) -> Any:
    """a / b as a true IEEE division (float64): the fdiv carries its own flags, so numba's fastmath pass leaves
    out ``arcp``, with which LLVM turns ``c / sqrt(x)`` on float32 vectors into the rsqrtps estimate (NaN at 0
    and inf, wrong on denormals)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.fdiv(*args, flags=("contract",))

    return types.float64(types.float64, types.float64), codegen


_div_exact: Any = intrinsic(__div_exact_typer)  # numba's intrinsic wrapper; Any: called with the value args only


# ---- coefficients (exact series, or Chebyshev fits of libm's erf / erfc made once at import)
_INV_FACT = tuple(1.0 / math.factorial(k) for k in range(13))[::-1]  # exp on |r| <= ln2/2: degree 12
_ATANH = tuple(1.0 / (2 * k + 1) for k in range(12))[::-1]  # log(m) = 2 atanh(s), |s| <= 0.1716


def _tanh_series(n_terms: int) -> tuple[float, ...]:
    """Odd Taylor coefficients of tanh (from tanh' = 1 - tanh^2), as a polynomial in x^2."""
    a: dict[int, Fraction] = {1: Fraction(1)}
    for n in range(2, 2 * n_terms, 2):  # (n+1) a_{n+1} = -sum_{i+j=n} a_i a_j
        s = sum((a.get(i, Fraction(0)) * a.get(n - i, Fraction(0)) for i in range(1, n)), Fraction(0))
        a[n + 1] = -s / (n + 1)
    return tuple(float(a[2 * k + 1]) for k in range(n_terms))[::-1]


_TANH = _tanh_series(12)  # |x| < 0.3


def _nodes(n: int = 2000) -> np.ndarray[Any, Any]:
    return np.cos(np.pi * (np.arange(n) + 0.5) / n)


def _erfcx_ref(t: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """erfcx(t) = exp(t^2) erfc(t): libm's erfc times exp(t^2) in long double below t = 26; from 26 on, where erfc(t)
    nears float64's underflow (0 from 27.23), the asymptotic series 1/(t sqrt pi) sum (-1)^n (2n-1)!! / (2t^2)^n
    (12 terms: within 1e-27 relative there)."""
    t = np.asarray(t, np.float64)
    big = t >= 26.0
    small_t = np.where(big, 1.0, t)
    erfc_t = np.array([math.erfc(v) for v in small_t], np.longdouble)
    direct = (erfc_t * np.exp(small_t.astype(np.longdouble) ** 2)).astype(np.float64)
    tb = np.where(big, t, 26.0).astype(np.longdouble)
    w = 1 / (2 * tb * tb)
    term, total = np.ones_like(tb), np.ones_like(tb)
    for n in range(1, 13):
        term = term * -(2 * n - 1) * w
        total = total + term
    series = (total / (tb * np.sqrt(np.longdouble(math.pi)))).astype(np.float64)
    return np.where(big, series, direct)


def _fit_erf_small() -> tuple[float, ...]:
    s = (_nodes() + 1) / 2  # erf(x) = x * P(x^2) on |x| < 1
    g = np.array([math.erf(math.sqrt(v)) / math.sqrt(v) for v in s])
    ch = Chebyshev(cheb.chebfit(_nodes(), g, 11), domain=[0, 1])
    return tuple(float(c) for c in ch.convert(kind=Polynomial, domain=[0, 1], window=[0, 1]).coef)[::-1]


_MID_A, _MID_B = 1.0, 6.0  # erfcx(t) = exp(t^2) erfc(t), Chebyshev in t on [1, 6]
# t * erfcx(t), Chebyshev in u = 1/t on [1/27.5, 1/6]: erfc rounds to 0 from t = 27.23, gelu from x = -38.58
# (t = 27.28); beyond 27.5 u is clamped, and the exp factor is 0 there (the fit ended at 26: x = -36.8 for gelu)
_TAIL_A, _TAIL_B = 1.0 / 27.5, 1.0 / 6.0


def _fit_erfc_mid() -> tuple[float, ...]:
    t = (_nodes() + 1) / 2 * (_MID_B - _MID_A) + _MID_A
    return (tuple(float(c) for c in cheb.chebfit(_nodes(), _erfcx_ref(t), 27)) + (0.0,) * 4)[::-1]  # padded to 32


def _fit_erfc_tail() -> tuple[float, ...]:
    u = (_nodes() + 1) / 2 * (_TAIL_B - _TAIL_A) + _TAIL_A
    return (tuple(float(c) for c in cheb.chebfit(_nodes(), _erfcx_ref(1 / u) / u, 14)) + (0.0,))[::-1]  # padded to 16


_ERF_SMALL = _fit_erf_small()
_ERFC_MID = _fit_erfc_mid()
_ERFC_TAIL = _fit_erfc_tail()

_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01  # fdlibm's split of ln 2 (the high part has trailing zero bits)
_LN2_LO = 1.90821492927058770002e-10
_SQRT1_2 = 0.7071067811865476
_SQRT_2_OVER_PI = 0.7978845608028654


@jit
def _horner(c: Any, x: float) -> float:
    p: float = c[0]  # not 0 * x + c[0]: without ninf LLVM must keep that multiply
    for v in c[1:]:
        p = p * x + v
    return p


@jit
def _clenshaw_steps(c: Any, u2: float, b1: float, b2: float) -> tuple[float, float]:
    for v in c:
        b0 = u2 * b1 - b2 + v
        b2 = b1
        b1 = b0
    return b1, b2


@jit
def _clenshaw16(c: Any, u: float) -> float:
    """Chebyshev series of 16 coefficients ``c`` (highest first) at ``u`` in [-1, 1], in chunks of 8 terms
    (LLVM fully unrolls short constant loops only, and only unrolled loops vectorize)."""
    u2 = 2.0 * u
    b1, b2 = _clenshaw_steps(c[:8], u2, 0.0, 0.0)
    b1, b2 = _clenshaw_steps(c[8:15], u2, b1, b2)
    return float(u * b1 - b2 + c[15])


@jit
def _clenshaw32(c: Any, u: float) -> float:
    u2 = 2.0 * u
    b1, b2 = _clenshaw_steps(c[:8], u2, 0.0, 0.0)
    b1, b2 = _clenshaw_steps(c[8:16], u2, b1, b2)
    b1, b2 = _clenshaw_steps(c[16:24], u2, b1, b2)
    b1, b2 = _clenshaw_steps(c[24:31], u2, b1, b2)
    return float(u * b1 - b2 + c[31])


@jit
def exp(x: float) -> float:
    """e**x; overflow to inf above 709.78, gradual underflow to 0 below -745.1."""
    x = float(x)
    xc = -746.0 if x < -746.0 else x
    xc = 710.0 if xc > 710.0 else xc
    n = math.floor(xc * _LOG2E + 0.5)
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    p = _horner(_INV_FACT, r)
    ni = np.int64(n)
    n1 = ni >> 1
    n2 = ni - n1
    y = p * _as_f64((n1 + 1023) << 52) * _as_f64((n2 + 1023) << 52)
    return y if x == x else x


@jit
def log(x: float) -> float:
    """Natural log; log(0) = -inf, log(x < 0) = NaN, log(inf) = inf."""
    x = float(x)
    tiny = x < 2.2250738585072014e-308
    xs = x * 18014398509481984.0 if tiny else x  # 2**54 lifts denormals to normal
    bits = _as_i64(xs)
    e = ((bits >> 52) & 0x7FF) - 1023 - (54 if tiny else 0)
    m = _as_f64((bits & 0xFFFFFFFFFFFFF) | 0x3FF0000000000000)
    big = m > 1.4142135623730951
    m = m * 0.5 if big else m
    ef = float(e + (1 if big else 0))
    s = (m - 1.0) / (m + 1.0)
    lm = 2.0 * s * _horner(_ATANH, s * s)
    y = ef * _LN2_HI + (ef * _LN2_LO + lm)
    if x == 0.0:
        y = -np.inf
    if x < 0.0:
        y = np.nan
    if x == np.inf or x != x:
        y = x
    return float(y)


@jit
def tanh(x: float) -> float:
    x = float(x)
    a = abs(x)
    small = x * _horner(_TANH, x * x)
    big = 1.0 - 2.0 / (exp(2.0 * a) + 1.0)
    return small if a < 0.3 else (big if x > 0.0 else -big)


@jit
def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + exp(-float(x)))


@jit
def silu(x: float) -> float:
    return float(x) / (1.0 + exp(-float(x)))


@jit
def _erfcx_big(t: float) -> float:
    """erfcx(t) = exp(t^2) erfc(t) for t >= 1 (above 27.5, that of 27.5: erfc(t) is 0 there)."""
    mid = _clenshaw32(_ERFC_MID, (2.0 * t - (_MID_A + _MID_B)) / (_MID_B - _MID_A))
    u = 1.0 / t
    u = _TAIL_A if u < _TAIL_A else u
    tail = _clenshaw16(_ERFC_TAIL, (2.0 * u - (_TAIL_A + _TAIL_B)) / (_TAIL_B - _TAIL_A)) * u
    return mid if t < _MID_B else tail


@jit
def _erfc_big(t: float) -> float:
    """erfc(t) for t >= 1 (0 above 27.3)."""
    tc = 30.0 if t > 30.0 else t
    return exp(-tc * tc) * _erfcx_big(t)


@jit
def erf(x: float) -> float:
    x = float(x)
    a = abs(x)
    small = x * _horner(_ERF_SMALL, x * x)
    big = 1.0 - _erfc_big(a if a > 1.0 else 1.0)
    return small if a < 1.0 else (big if x > 0.0 else (-big if x < 0.0 else x))


@jit
def erfc(x: float) -> float:
    x = float(x)
    a = abs(x)
    small = 1.0 - x * _horner(_ERF_SMALL, x * x)
    e = _erfc_big(a if a > 1.0 else 1.0)
    big = e if x > 0.0 else 2.0 - e
    return small if a < 1.0 else (big if x == x else x)


@jit
def gelu_erf(x: float) -> float:
    """x * Phi(x) = x/2 * erfc(z), z = -x/sqrt 2 (no cancellation for negative x). For |z| >= 1, erfc(|z|) =
    exp(-z^2) erfcx(|z|) with z^2 = x^2/2 taken exactly as hi + lo (an fma), exp(-z^2) = exp(-hi) (1 - lo): the
    rounding of z or z^2, amplified by an exponent up to 745, cost up to 1.5e-13 relative. For x < 0 the factors
    are multiplied before exp(-hi), so that a denormal result (x < -37.6) rounds once, at its last product:
    through erfc(|z|), |x|/2 times smaller, it lost more bits (-38.5 gave 9.4e-323 for 5.4e-323)."""
    x = float(x)
    z = -x * _SQRT1_2
    a = abs(z)
    small = 0.5 * x * (1.0 - z * _horner(_ERF_SMALL, z * z))
    xa = abs(x)
    xc = 40.0 if xa > 40.0 else xa  # exp(-800) = 0; an infinite x would make lo NaN
    sq = xc * xc
    hi = 0.5 * sq
    lo = 0.5 * _fma64(xc, xc, -sq)
    q = _erfcx_big(a if a > 1.0 else 1.0) * (1.0 - lo)
    e = exp(-hi)
    neg = (0.5 * x * q) * e  # x/2 erfc(|z|)
    pos = 0.5 * x * (2.0 - e * q)  # x/2 (2 - erfc(|z|))
    return small if a < 1.0 else (neg if x < 0.0 else pos)


@jit
def gelu_tanh(x: float) -> float:
    """x/2 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) written as x * sigmoid(2 u)."""
    x = float(x)
    u = _SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
    return x / (1.0 + exp(-2.0 * u))


@jit
def rsqrt(x: float) -> float:
    """1 / sqrt(x), a true division (``_div_exact``): the limits at ±0 and inf, denormals exact. Within 1 ulp (two
    roundings; on float32 data LLVM narrows both operations to float32)."""
    return float(_div_exact(1.0, math.sqrt(float(x))))


# ---- float32 arithmetic (for float32 / float16 data)
_F = np.float32


def _fit_f32(fn: Any, lo: float, hi: float, deg: int) -> tuple[np.float32, ...]:
    """Monomial coefficients (highest first, as float32) of a Chebyshev fit of ``fn`` on [lo, hi]."""
    ch = Chebyshev(cheb.chebfit(_nodes(), fn((_nodes() + 1) / 2 * (hi - lo) + lo), deg), domain=[lo, hi])
    return tuple(_F(c) for c in ch.convert(kind=Polynomial, domain=[lo, hi], window=[lo, hi]).coef)[::-1]


def _erfcx_over_t(t: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """erfcx(z) / t with z = 2 (1/t - 1) (the variable of ``gelu_erf_f32``'s tail); asymptotic series for z >= 25."""
    z = 2.0 * (1.0 / np.maximum(t, 1e-9) - 1.0)
    big = np.minimum(z, 1e300) >= 25.0
    zb = np.where(big, z, 25.0)
    series = (1 - 1 / (2 * zb**2) + 3 / (4 * zb**4) - 15 / (8 * zb**6) + 105 / (16 * zb**8)) / (zb * math.sqrt(math.pi))
    direct = _erfcx_ref(np.where(big, 1.0, z))
    return np.where(big, series, direct) / np.maximum(t, 1e-9)  # type: ignore[no-any-return]


_GELU_CLAMP = 14.5  # Phi(-14.5) = 5.8e-48 rounds to 0 in float32 (and gelu(-inf) = -inf * 0 = NaN, as x/2 erfc)
_GELU_TMIN = 1.0 / (1.0 + _GELU_CLAMP * 0.5 * _SQRT1_2)  # t = 1/(1 + z/2) on [_GELU_TMIN, 1], z = |x|/sqrt 2
# Phi(-|x|) = exp(-x^2/2) t H(t), H of degree 8 in t itself, its coefficients scaled by 2^-64 (which undoes the
# 2^64 of ``_exp_times_f32``, so no multiply is spent on it): 7.3 ulp on the test's grid, 7.7 on denser sweeps
# (the bound is 8; the first version, degree 9 in t - tmid: 6.3-6.8), 1.07-1.09x faster on one thread
# (/tmp/w25/gexp.py, gerr4.py)
_GELU_H = tuple(_F(0.5 * 2.0**-64 * float(c)) for c in _fit_f32(_erfcx_over_t, _GELU_TMIN, 1.0, 8))
_EXP_F32 = _fit_f32(np.exp, -math.log(2.0) / 2, math.log(2.0) / 2, 6)  # |r| <= ln2/2: 0.35 ulp (float32 coefs)
_F0, _F1, _FH = _F(0.0), _F(1.0), _F(0.5)
_F_LOG2E = _F(_LOG2E)
_F_LN2_HI = _F(0.693359375)  # 12 significant bits: n * hi is exact for |n| <= 2^12
_F_LN2_LO = _F(math.log(2.0) - 0.693359375)
_F_EXP_LO, _F_EXP_HI = _F(-104.0), _F(89.0)
_I1, _I23, _I127 = np.int32(1), np.int32(23), np.int32(127)  # int32 constants keep the arithmetic in int32
_F_SQRT1_2_HALF = _F(0.5 * _SQRT1_2)
_F_GELU_CLAMP = _F(_GELU_CLAMP)
_F_MH, _F_2M64, _I191 = _F(-0.5), _F(2.0**-64), np.int32(127 + 64)  # 2^(n + 64) stays normal down to n = -190
_F_NONPOS_LO = _F(-110.0)  # e^-110 = 1.7e-48 rounds to 0 in float32; n = -159 keeps 2^(n + 64) normal
# e^x rounds to 0 in float32 below -104 (e^-104 = 6.8e-46 < 2^-150, half the smallest denormal)
_F_NONPOS_ZERO = _F(-104.0)


@jit
def _horner32(c: Any, x: Any) -> Any:
    p = c[0]
    for v in c[1:]:
        p = p * x + v
    return p


@jit
def _exp_reduce_f32(y: Any, c: Any) -> Any:
    """n, r with y + c = n ln2 + r, |r| <= ln2/2, for a small correction c to y (0 folds away; a product c = a * b
    contracts into the fma adding it): n * ln2's high part is exact for |n| <= 2^12, and so is y minus it."""
    n = np.floor(y * _F_LOG2E + _FH)
    return n, ((y - n * _F_LN2_HI) + c) - n * _F_LN2_LO


@jit
def _pow2_64_f32(n: Any) -> Any:
    """2^(n + 64) for an integral float32 n in [-190, 63], built from its exponent bits."""
    return _as_f32((np.int32(n) + _I191) << _I23)


@jit
def _exp_times_f32(y: Any, c: Any, coefs: Any) -> Any:
    """e^(y + c) * 2^64 * k for y in [-110, 0] and a small correction c to y (0 folds away), its polynomial's
    coefficients ``coefs`` being ``_EXP_F32``'s times k, a power of two (each Horner step is then the original's
    times k, exactly, while it stays a normal float). With k = 1 the result is a normal float32 even where
    e^(y + c) itself underflows, so a caller rounds into the denormals once, at its last product."""
    n, r = _exp_reduce_f32(y, c)
    return _horner32(coefs, r) * _pow2_64_f32(n)


# e^x for x <= 0 as 2^-64 P(r) * 2^(n + 64): the coefficients times 2^-64 (normal floats: every Horner step exactly
# the original's times 2^-64), the one rounding at the product, so bitwise (P(r) * 2^(n + 64)) * 2^-64 with one
# multiply fewer (one thread, in L1: 15.7 -> 13.7 cycles per 16 lanes, /tmp/w47/ex.py of the forty-seventh session)
_EXP_F32_2M64 = tuple(c * _F_2M64 for c in _EXP_F32)


# e^(-a^2/2) * 2^64 in terms of r2 = -2 r: the same n (a^2 * (-log2e/2) is the product (-a^2/2) * log2e), each
# reduction step the original's times -2, the polynomial's coefficients times (-1/2)^k (gelu: 32.7 -> 30.9 cycles
# per 16 lanes, one thread, in L1; /tmp/w47/g3.py of the forty-seventh session). a^2 is never split into hi + lo:
# n * 2 ln2's high part is exact (|n| < 2^8, 10 significant bits), so fma(a, a, n * hi) rounds a^2 + n * hi once,
# as adding the split's lo to the exact hi + n * hi did: bitwise the same results (every 13th float32, 330 M of
# them) with one arithmetic instruction fewer (and, on AVX2, one constant reload: 47 against 49 instructions in
# the vector loop), 0.977x the time (one thread, 11 interleaved rounds, in L1 and from memory,
# /tmp/w62/gfma.py of the sixty-second session)
_F_MH_LOG2E = _F_MH * _F_LOG2E
_F_LN2_HI2, _F_LN2_LO2 = _F(2) * _F_LN2_HI, _F(2) * _F_LN2_LO
_EXP_F32_R2 = tuple(c * _F((-0.5) ** (len(_EXP_F32) - 1 - i)) for i, c in enumerate(_EXP_F32))


@jit
def _exp_half_neg_sq_2p64_f32(a: Any) -> Any:
    """e^(-a^2/2) * 2^64 for a in [0, 14.8]: bitwise ``_exp_times_f32(-hi/2, -lo/2, _EXP_F32)`` for a^2 split
    exactly into hi + lo (the comment above), in fewer instructions."""
    n = np.floor((a * a) * _F_MH_LOG2E + _FH)
    r2 = _fma32(a, a, n * _F_LN2_HI2) + n * _F_LN2_LO2
    return _horner32(_EXP_F32_R2, r2) * _pow2_64_f32(n)


@jit
def exp_nonpos_f32(x: Any) -> Any:
    """e**x for x <= 0 (or NaN) in float32, within 2 ulp: the exp of softmax's x - max. Half the range checks of
    ``exp_f32``: no overflow side, and one scale factor (``_exp_times_f32``); NaN propagates through the arithmetic."""
    return _exp_times_f32(_F_NONPOS_LO if x < _F_NONPOS_LO else x, _F0, _EXP_F32_2M64)


@jit
def exp_nonpos_zeroing_f32(x: Any) -> Any:
    """``exp_nonpos_f32`` for data with many very negative inputs (masked scores, -inf): below -104, where e**x
    rounds to 0, a lane computes e^0 and then selects 0, instead of taking the last multiply into the
    underflow, which cost ~1.3 ns a lane here (SDPA's row pass with 118 of 128 keys masked: 1.5-1.8x faster).
    The second select costs rows without such inputs 5-8%, so unmasked rows keep ``exp_nonpos_f32``."""
    y = _exp_times_f32(_F0 if x < _F_NONPOS_ZERO else x, _F0, _EXP_F32_2M64)
    return _F0 if x < _F_NONPOS_ZERO else y


@jit
def exp_f32(x: Any) -> Any:
    """e**x in float32 (within 2 ulp): overflow to inf above 88.72, gradual underflow to 0 below -103.3."""
    xc = _F_EXP_LO if x < _F_EXP_LO else x
    xc = _F_EXP_HI if xc > _F_EXP_HI else xc
    n, r = _exp_reduce_f32(xc, _F0)
    p = _horner32(_EXP_F32, r)
    ni = np.int32(n)  # int32 lanes: twice as many per vector as int64 (n is within [-150, 128])
    n1 = ni >> _I1
    n2 = ni - n1
    y = p * _as_f32((n1 + _I127) << _I23) * _as_f32((n2 + _I127) << _I23)
    return y if x == x else x


@jit
def _sigmoid_f32(x: Any) -> Any:
    """1 / (1 + e^-x) from e = e^-|x| (never overflows; results near 0 round into the denormals once)."""
    e = exp_nonpos_f32(-abs(x))  # NaN stays NaN through e
    return (_F1 if x >= _F0 else e) / (_F1 + e)


@jit
def sigmoid_f32(x: Any) -> Any:
    return _sigmoid_f32(x)


@jit
def silu_f32(x: Any) -> Any:
    return x * _sigmoid_f32(x)


@jit
def gelu_erf_f32(x: Any) -> Any:
    """x * Phi(x) in float32, one formula for every x: Phi(-|x|) = exp(-x^2/2) t H(t), t = 1/(1 + |x|/(2 sqrt 2)),
    and Phi(|x|) = 1 - Phi(-|x|) (no cancellation: Phi(-|x|) <= 1/2). x^2 enters the exp's reduction unrounded
    (``_exp_half_neg_sq_2p64_f32``; its rounded value only picks n), the exponent being large and its rounding
    not; the exp is scaled by 2^64 and H by 2^-64, so that intermediates stay normal down to Phi's underflow
    (|x| > 13.2). NaN propagates through the arithmetic."""
    a = abs(x)
    ac = _F_GELU_CLAMP if a > _F_GELU_CLAMP else a
    t = _F1 / (_F1 + ac * _F_SQRT1_2_HALF)
    tail = _exp_half_neg_sq_2p64_f32(ac) * (t * _horner32(_GELU_H, t))
    return x * (tail if x < _F0 else _F1 - tail)


# True where LLVM's x86 back end selects llvm.maximum / llvm.minimum. LLVM 15 (llvmlite 0.44, under numba 0.61)
# aborts the process with "Cannot select: fmaximum"; llvmlite 0.45 and later bring LLVM 20 and up.
NAN_MAX_INTRINSICS = llvm_version_info >= (17,)
# ``maximum_stored`` takes the select form where masked stores are slow (``jit.SLOW_MASKED_STORES``, read when a
# kernel compiles): LLVM expands llvm.maximum into a select that keeps a NaN first operand and folds ``a[i] =
# maximum(a[i], x)`` into a masked store (AMD Zen 3: fused SDPA's column maxima of 48 queries, one thread, (8, 12, 128,
# 32): 1.96 ms against 1.37 in the select form).


def _llvm_binary(float_name: str, int_name: str, stored: bool = False) -> Any:
    """An intrinsic calling ``float_name`` on floats, ``int_name`` on integers (both operands of one type). Where
    the back end cannot select ``float_name``, or for a result ``stored`` back where its first operand was loaded
    while ``jit.SLOW_MASKED_STORES``, floats get the same NaN-propagating result from ``maxnum`` / ``minnum`` and a
    select: NaN (``a + b``) where either operand is NaN. That form may order -0.0 and +0.0 either way, and a reduction
    through it does not vectorize (llvm.maximum's does)."""
    fallback = float_name.replace("imum", "num")  # llvm.maximum -> llvm.maxnum, llvm.minimum -> llvm.minnum

    @intrinsic
    def op(typingctx: Any, a: Any, b: Any) -> Any:
        if a != b:
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            ty = context.get_value_type(sig.return_type)
            fnty = ir.FunctionType(ty, [ty, ty])
            if not isinstance(sig.return_type, types.Float):
                return builder.call(builder.module.declare_intrinsic(int_name, [ty], fnty), args)
            if NAN_MAX_INTRINSICS and not (stored and jit_module.SLOW_MASKED_STORES):
                return builder.call(builder.module.declare_intrinsic(float_name, [ty], fnty), args)
            x, y = args
            num = builder.call(builder.module.declare_intrinsic(fallback, [ty], fnty), args)
            return builder.select(builder.fcmp_unordered("uno", x, y), builder.fadd(x, y), num)

        return a(a, a), codegen

    return op


# NaN-propagating float max / min (LLVM vectorizes their reductions; a compare-and-select loop stays scalar)
maximum: Any = _llvm_binary("llvm.maximum", "llvm.smax")
minimum: Any = _llvm_binary("llvm.minimum", "llvm.smin")
# the same for ``a[i] = maximum_stored(a[i], x)``: a running extremum kept in memory, never a masked store
maximum_stored: Any = _llvm_binary("llvm.maximum", "llvm.smax", stored=True)


@numba.njit(nogil=True, cache=True, error_model="numpy", fastmath=REDUCE)
def fsum(a: Any) -> float:
    """float64 sum of a 1-d view. Reassociated, so it vectorizes; not inlined, because an inlined body takes its
    caller's fastmath flags (and kernels calling exp must not reassociate)."""
    s = 0.0
    for i in range(a.shape[0]):
        s += a[i]
    return s


@numba.njit(nogil=True, cache=True, error_model="numpy", fastmath=REDUCE)
def deviation_sums(a: Any, mean: float) -> tuple[float, float]:
    """(sum(d), sum(d^2)) over a 1-d view, d = a - mean: the second pass of a two-pass variance, whose sum(d)
    corrects the first pass's rounding (``corrected_moments``). Reassociated and not inlined, as ``fsum``."""
    c = 0.0
    q = 0.0
    for i in range(a.shape[0]):
        d = a[i] - mean
        c += d
        q += d * d
    return c, q


@numba.njit(nogil=True, cache=True, error_model="numpy", fastmath=FAST, inline="always")
def corrected_moments(n: float, mean: float, c: float, q: float) -> tuple[float, float]:
    """(mean, M2) of ``n`` elements from a first-pass ``mean`` and ``deviation_sums`` (c, q), by the corrected
    two-pass formula (Chan, Golub and LeVeque): mean + c / n and q - c^2 / n. The correction takes out the first
    pass's rounding: a row of one large value gives its value and M2 = 0 (without it M2 > 0, and a norm of such
    a row gave +-1 instead of 0). Where the squares overflowed (q = inf on finite data) M2 is inf, as numpy's:
    c^2 / n may overflow too, and inf - inf gave NaN."""
    if n == 0:
        return mean, 0.0
    if q == np.inf:
        return mean + c / n, q
    return mean + c / n, max(q - c * c / n, 0.0)


def exp_shifted(v: Any, m: float) -> Any:
    """exp(v - m) for v <= m (m is a max over v, or NaN) in v's precision: float32 data in float32 arithmetic
    (``exp_nonpos_f32``, 16 lanes per zmm), float64 data with ``exp``."""
    raise NotImplementedError  # only called from numba kernels


def exp_shifted_masked(v: Any, m: float) -> Any:
    """``exp_shifted`` for rows that may hold masked (-inf) entries: float32 by ``exp_nonpos_zeroing_f32``."""
    raise NotImplementedError  # only called from numba kernels


def _shifted(exp32: Any) -> Any:
    """The numba implementation of an ``exp_shifted`` form whose float32 exp is ``exp32``."""

    def impl(v, m):  # type: ignore[no-untyped-def]  # unannotated, as the implementations (numba checks)
        if v == types.float32:
            return lambda v, m: exp32(v - np.float32(m))
        return lambda v, m: exp(v - m)

    return impl


overload(exp_shifted)(_shifted(exp_nonpos_f32))
overload(exp_shifted_masked)(_shifted(exp_nonpos_zeroing_f32))
