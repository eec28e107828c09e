"""Elementwise helpers: rounding to half precision with the same bits on GPU and in the interpreter.

Values are carried in fp32 inside a kernel; a bf16/fp16 value is an fp32 holding a representable
half-precision number. The interpreter's fp32 -> bf16 cast truncates and its bf16 -> fp32 cast mangles subnormals,
so there bf16 goes through bits; a GPU rounds with its own round-to-nearest-even conversions (one `F2FP` per two
values against about 17 integer instructions per element for the bits: TRITON_NOTES.md), which give the same values
(a NaN may have other bits: NaN stays NaN).
"""

import triton
import triton.language as tl
from triton import knobs

#: the GPU's conversions (compiled kernels) or bit arithmetic (the interpreter), decided when this module is imported,
#: as triton.jit decides then whether it makes interpreted functions
HARDWARE_CASTS = tl.constexpr(not knobs.runtime.interpret)


@triton.jit
def round_to_bf16(x):
    """x: fp32 [BLOCK] -> fp32 [BLOCK] holding the nearest bf16 (ties to even); NaN stays NaN."""
    if HARDWARE_CASTS:
        return x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    rounded = tl.where(x != x, bits | 0x00400000, rounded)  # quiet NaN, never rounded into Inf
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def to_bf16(x):
    """x: fp32 [BLOCK] -> bf16 [BLOCK], rounded to nearest even (bit-identical to torch's cast)."""
    if HARDWARE_CASTS:
        return x.to(tl.bfloat16, fp_downcast_rounding="rtne")
    bits = round_to_bf16(x).to(tl.uint32, bitcast=True)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def to_bf16_stochastic(x, random):
    """x: fp32 [BLOCK] -> bf16 [BLOCK], rounded stochastically as torchao's `_fp32_to_bf16_sr`: away from zero with
    probability (the 16 bits bf16 drops) / 65536, else towards zero (unbiased: E[result] = x where no overflow);
    random: uint32 [BLOCK], uniform in [0, 65536). NaN stays NaN (rounded to nearest: its dropped bits are no
    fraction)."""
    bits = x.to(tl.uint32, bitcast=True)
    towards_zero = bits & 0xFFFF0000
    rounded = tl.where(random < (bits & 0xFFFF), towards_zero + 0x10000, towards_zero)
    y = (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.where(x != x, to_bf16(x), y)


@triton.jit
def bf16_to_fp32(x):
    """x: bf16 [BLOCK] -> fp32 [BLOCK], exactly (through bits: the interpreter's cast mangles subnormals)."""
    if HARDWARE_CASTS:
        return x.to(tl.float32)
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def round_to_fp16(x):
    """x: fp32 [BLOCK] -> fp32 [BLOCK] holding the nearest fp16 (ties to even)."""
    return x.to(tl.float16).to(tl.float32)


@triton.jit
def negate(x):
    """x: fp32/fp64 [BLOCK] -> -x by flipping the sign bit, as torch's neg: -(+0.0) is -0.0 (triton 3.6 compiles
    `-x` as 0 - x, which gives +0.0), and NaN changes sign too."""
    if x.dtype == tl.float64:
        return (x.to(tl.uint64, bitcast=True) ^ 0x8000000000000000).to(tl.float64, bitcast=True)
    else:
        return (x.to(tl.uint32, bitcast=True) ^ 0x80000000).to(tl.float32, bitcast=True)


@triton.jit
def _exp2_int(n):
    """2.0 ** n for an int64 n in [-1022, 1023], exactly (built from the exponent bits)."""
    return ((n + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _pow_finite(ax, exponent: tl.constexpr, EXPONENT_HI: tl.constexpr, EXPONENT_LO: tl.constexpr):
    """|x| ** exponent for a finite, nonzero fp64 ax = |x| and a finite exponent, within a few ulps.

    |x| = 2**k * m with m in [sqrt(1/2), sqrt(2)), so exponent * log2|x| = exponent * k + exponent * log2(m):
    the first term is exact (the exponent split on the host into two halves of at most 27 significant
    bits, each times an integer |k| <= 1075), the second is small (|log2 m| <= 1/2), so the rounding of
    log2 no longer scales with the magnitude of x. The result is exp2(r) * 2**n for the nearest integer n
    (r in [-1/2, 1/2], computed exactly but for one rounding), scaled in two exact steps so that
    subnormal results round once and overflow gives inf.
    """
    subnormal = ax < 2.2250738585072014e-308
    ax = tl.where(subnormal, ax * 18014398509481984.0, ax)  # * 2**54, exact
    bits = ax.to(tl.int64, bitcast=True)
    k = (bits >> 52) - 1023 - tl.where(subnormal, 54, 0)
    m = ((bits & 0xFFFFFFFFFFFFF) | 0x3FF0000000000000).to(tl.float64, bitcast=True)  # [1, 2)
    big = m > 1.4142135623730951
    m = tl.where(big, m * 0.5, m)
    kf = (k + tl.where(big, 1, 0)).to(tl.float64)
    hi = EXPONENT_HI * kf  # exact: 27 + 11 bits
    lo = EXPONENT_LO * kf + exponent * tl.log2(m)
    t = hi + lo
    n = tl.floor(t + 0.5)
    r = (hi - n) + lo  # hi - n is exact
    # |t| > 2040: 0 or inf whatever r is (and hi may be inf for a huge exponent), and n / 2 must stay in
    # _exp2_int's range; selects, not tl.minimum/maximum, whose NaN rules differ between interpreter and GPU
    r = tl.where((t > 2040.0) | (t < -2040.0), 0.0, r)
    n = tl.where(t > 2040.0, 2040.0, tl.where(t < -2040.0, -2040.0, n)).to(tl.int64)
    n1 = n >> 1
    return tl.exp2(r) * _exp2_int(n1) * _exp2_int(n - n1)


@triton.jit
def pow_scalar(x, exponent: tl.constexpr, EXPONENT_IS_INT: tl.constexpr, EXPONENT_IS_ODD: tl.constexpr,
               SPLIT: tl.constexpr, EXPONENT_HI: tl.constexpr, EXPONENT_LO: tl.constexpr):
    """x ** exponent for a general compile-time exponent, computed in fp64.

    x: fp32 or fp64 [BLOCK]; same dtype out. SPLIT (a finite exponent and fp64 x) takes `_pow_finite`'s path,
    within 2 + |exponent| / 2 ulps; otherwise exp2(exponent * log2|x|) in fp64, whose error (up to a few hundred
    fp64 ulps for huge or tiny x) is far below an fp32 ulp, in 60 fewer registers. EXPONENT_HI + EXPONENT_LO
    == exponent, each with at most 27 significant bits (codegen's `split_exponent`). Follows C `pow` (IEEE 754
    pow) at every special value: negative finite bases give NaN unless the exponent is an integer (the sign from
    its parity; +-inf counts as even); (-inf) ** y and (-0.0) ** y are +-inf / +-0.0, negative only for an odd
    integer y; zeros and infinities by the exponent's sign; NaN exponents give NaN, except 1 ** nan == 1.
    """
    x64 = x.to(tl.float64)
    ax = tl.abs(x64)
    # exact at zeros, infinities, NaN and for infinite or NaN exponents (C pow's limits)
    mag = tl.exp2(exponent * tl.log2(ax))
    if SPLIT:
        finite = (ax > 0) & (ax < float("inf"))
        mag = tl.where(finite, _pow_finite(tl.where(finite, ax, 1.0), exponent, EXPONENT_HI, EXPONENT_LO), mag)
    if EXPONENT_IS_INT:
        if EXPONENT_IS_ODD:
            negative = x64.to(tl.int64, bitcast=True) < 0  # the sign bit: (-0.0) ** -3 is -inf
            mag = tl.where(negative, negate(mag), mag)
    else:
        mag = tl.where((x64 < 0) & (x64 > float("-inf")), float("nan"), mag)  # (-inf) ** 1.5 is +inf
    mag = tl.where(x64 == 1.0, 1.0, mag)
    if EXPONENT_IS_INT:
        if not EXPONENT_IS_ODD:  # |x| == 1 and an infinite exponent: inf * log2(1) is NaN, C pow gives 1
            mag = tl.where(ax == 1.0, 1.0, mag)
    return mag.to(x.dtype)

