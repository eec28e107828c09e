"""Elementwise helpers: rounding to half precision with the same bits on GPU and in the interpreter.

Values are carried in fp32 inside a kernel; a bf16/fp16 value is an fp32 holding a representable
half-precision number. The interpreter's fp32 -> bf16 cast truncates, so bf16 goes through bits.
"""

import triton
import triton.language as tl


@triton.jit
def round_to_bf16(x):
    """x: fp32 [BLOCK] -> fp32 [BLOCK] holding the nearest bf16 (ties to even); NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    rounded = tl.where(x != x, bits | 0x00400000, rounded)  # quiet NaN, never rounded into Inf
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def to_bf16(x):
    """x: fp32 [BLOCK] -> bf16 [BLOCK], rounded to nearest even (bit-identical to torch's cast)."""
    bits = round_to_bf16(x).to(tl.uint32, bitcast=True)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def bf16_to_fp32(x):
    """x: bf16 [BLOCK] -> fp32 [BLOCK], exactly (through bits: the interpreter's cast mangles subnormals)."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def round_to_fp16(x):
    """x: fp32 [BLOCK] -> fp32 [BLOCK] holding the nearest fp16 (ties to even)."""
    return x.to(tl.float16).to(tl.float32)


@triton.jit
def pow_scalar(x, exponent: tl.constexpr, EXPONENT_IS_INT: tl.constexpr, EXPONENT_IS_ODD: tl.constexpr):
    """x ** exponent for a general compile-time exponent, through fp64 exp2/log2.

    x: fp32 or fp64 [BLOCK]; same dtype out. Follows C `pow` for negative bases (NaN unless the
    exponent is an integer, the sign from its parity; +-inf counts as even), zeros and infinities, and
    NaN exponents (NaN, except 1 ** nan == 1).
    """
    x64 = x.to(tl.float64)
    mag = tl.exp2(exponent * tl.log2(tl.abs(x64)))
    if EXPONENT_IS_INT:
        if EXPONENT_IS_ODD:
            negative = x64.to(tl.int64, bitcast=True) < 0  # the sign bit: (-0.0) ** -3 is -inf
            mag = tl.where(negative, -mag, mag)
    else:
        mag = tl.where(x64 < 0, float("nan"), mag)
    mag = tl.where(x64 == 1.0, 1.0, mag)
    if EXPONENT_IS_INT:
        if not EXPONENT_IS_ODD:  # |x| == 1 and an infinite exponent: inf * log2(1) is NaN, C pow gives 1
            mag = tl.where(tl.abs(x64) == 1.0, 1.0, mag)
    return mag.to(x.dtype)
