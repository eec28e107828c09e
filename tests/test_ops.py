"""Every supported op, compiled, against eager torch on the same gradient: bit-identical results.

Ops that torch's CPU kernels do not round correctly (sqrt and rsqrt go through Sleef; exp, log and
pow through their math libraries) are compared within a stated ulp bound (the kernel's sqrt is
correctly rounded, as CUDA torch's is); everything else must be identical, NaN/Inf included.
"""

import pytest
import torch

import fusedhooks as fh

from helpers import FLOAT_DTYPES, assert_same_bits, assert_same_values

SCALE = torch.tensor(0.37)
LO = torch.tensor(-0.75)
FLAG = torch.tensor(True)


def special_values(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """n values: normal * 3, with 0, -0.0, NaN, +-Inf, huge and tiny values mixed in (deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=gen) * 3).to(dtype)
    specials = [0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1.0, -1.0, 0.5,
                torch.finfo(dtype).max / 2, torch.finfo(dtype).tiny, 1e-3, -2.5]
    for i, v in enumerate(specials[: n]):
        x[(i * 7919) % n] = v
    return x


# name -> (body, ulps allowed). Bodies are plain torch: the test runs them eagerly as the oracle.
def clamp_inplace(grad):
    grad.clamp_(-0.5, 0.5)


def clip_alias(grad):
    return torch.clip(grad, min=-1.0)


def scale_chain(grad):
    return (grad * 0.1 + 3) / 7 - 1.5


def reflected(grad):
    return 1 - 2 / grad


def augmented(grad):
    grad *= 0.5
    grad += 1
    grad -= 0.25
    grad /= 3


def program_order(grad):
    grad.clamp_(-1, 1)
    grad.mul_(grad)        # later reads see the clamped value
    return grad + 0.125


def unary(grad):
    return torch.neg(grad).abs() + grad.sign() + torch.square(grad)


def sqrt(grad):
    return grad.abs().sqrt()


def reciprocal(grad):
    return grad.reciprocal()


def rsqrt(grad):
    return torch.rsqrt(grad.abs() + 1)


def exp(grad):
    return torch.exp(grad.clamp(max=20))


def log(grad):
    return torch.log(grad.abs() + 1e-3)


def pow_2(grad):
    return grad ** 2


def pow_3(grad):
    return grad.pow(3)


def pow_minus_1(grad):
    return torch.pow(grad, -1)


def pow_minus_2(grad):
    return grad ** -2


def pow_half(grad):
    return grad ** 0.5


def pow_minus_half(grad):
    return grad ** -0.5


def pow_0(grad):
    return grad ** 0


def general_pow(grad):
    return grad.abs() ** 1.7


def general_pow_odd(grad):
    return grad.pow(-3)


def pow_inf(grad):
    return grad ** float("inf")


def pow_minus_inf(grad):
    return torch.pow(grad, float("-inf"))


def pow_nan(grad):
    return torch.pow(grad, float("nan"))


def minmax(grad):
    return torch.minimum(torch.maximum(grad, grad * 0.5), grad + 1)


def where_compare(grad):
    return torch.where((grad > 0) & (grad <= 2) | (grad == -1), grad, 0.0)


def logical(grad):
    keep = torch.logical_and(grad >= -1, torch.logical_not(grad > 1)) ^ (grad != grad)
    return torch.where(torch.logical_or(keep, grad < -5), grad, -grad)


def special_tests(grad):
    return torch.where(torch.isfinite(grad), grad, 0.0) + grad.isnan() * 2 + torch.isinf(grad) * 3


def nan_to_num_default(grad):
    return torch.nan_to_num(grad)


def nan_to_num_values(grad):
    grad.nan_to_num_(nan=0.0, posinf=1.0, neginf=-1.0)


def constructors(grad):
    return torch.zeros_like(grad) + torch.ones_like(grad) * 0.5 + torch.full_like(grad, 0.1) * grad


def fill_inplace(grad):
    grad.fill_(0.3)


def zero_inplace(grad):
    grad.zero_()


def copy_inplace(grad):
    grad.copy_(grad * 2 + 1)


def device_scalars(grad):
    return torch.clamp(grad, min=LO, max=1.5) * SCALE


def bool_scalar(grad):
    return torch.where(FLAG, grad * 2, grad)


def fp32_intermediates(grad):
    return (grad.float() * 0.1 + 3).double() / 3


def int_mask_arith(grad):
    return grad * ((grad > 0) * 2)


def add_alpha(grad):
    return torch.add(grad, grad * 0.5, alpha=2) - torch.sub(grad, 1.0, alpha=3)


def return_constant(grad):
    return 0.25


def uses_param(grad, param):
    return grad + 0.01 * param


def param_only(grad, param):
    return param


BODIES = {
    "clamp_inplace": (clamp_inplace, 0), "clip_alias": (clip_alias, 0), "scale_chain": (scale_chain, 0),
    "reflected": (reflected, 0), "augmented": (augmented, 0), "program_order": (program_order, 0),
    "unary": (unary, 0), "sqrt": (sqrt, 1), "reciprocal": (reciprocal, 0), "rsqrt": (rsqrt, 2),
    "exp": (exp, 2), "log": (log, 2), "pow_2": (pow_2, 0), "pow_3": (pow_3, 0),
    "pow_minus_1": (pow_minus_1, 0), "pow_minus_2": (pow_minus_2, 0), "pow_half": (pow_half, 1),
    "pow_minus_half": (pow_minus_half, 2), "pow_0": (pow_0, 0),
    "general_pow": (general_pow, "pow"), "general_pow_odd": (general_pow_odd, "pow"),
    "pow_inf": (pow_inf, 0), "pow_minus_inf": (pow_minus_inf, 0), "pow_nan": (pow_nan, 0),
    "minmax": (minmax, 0), "where_compare": (where_compare, 0),
    "logical": (logical, 0), "special_tests": (special_tests, 0), "nan_to_num_default": (nan_to_num_default, 0),
    "nan_to_num_values": (nan_to_num_values, 0), "constructors": (constructors, 0),
    "fill_inplace": (fill_inplace, 0), "zero_inplace": (zero_inplace, 0), "copy_inplace": (copy_inplace, 0),
    "device_scalars": (device_scalars, 0), "bool_scalar": (bool_scalar, 0),
    "fp32_intermediates": (fp32_intermediates, 0), "int_mask_arith": (int_mask_arith, 0),
    "add_alpha": (add_alpha, 1), "return_constant": (return_constant, 0),
    "uses_param": (uses_param, 0), "param_only": (param_only, 0),
}


#: ulps for pow with a non-special exponent: torch's CPU pow is off by up to ~5 fp32 ulps (measured
#: against float64); the kernel's fp64 pow is within 2 + |exponent| / 2 ulps of torch's (docs/supported-ops.md;
#: test_pow_fp64_within_its_bound_over_every_binade), here |exponent| <= 3
POW_ULPS = {torch.float32: 8, torch.float16: 1, torch.bfloat16: 1, torch.float64: 4}


def eager_expected(fn, grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """What eager torch leaves in .grad: the body on a copy, its returned value copied in."""
    g = grad.clone()
    with torch.no_grad():
        out = fn(g, param) if fn.__code__.co_argcount == 2 else fn(g)
    if out is not None:
        g.copy_(out)
    return g


def fire(hook, grad: torch.Tensor, param_values: torch.Tensor | None = None) -> torch.Tensor:
    """Fire `hook` on a parameter whose .grad is `grad` (the same storage); returns the parameter."""
    p = (param_values if param_values is not None else torch.zeros_like(grad)).clone().requires_grad_(True)
    p.grad = grad
    hook(p)
    return p


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name", list(BODIES))
def test_op_matches_eager(name, dtype, backend):
    fn, ulps = BODIES[name]
    ulps = POW_ULPS[dtype] if ulps == "pow" else ulps
    grad = special_values(257, dtype)
    param = special_values(257, dtype, seed=1)
    expected = eager_expected(fn, grad, param)
    hook = fh.grad_hook(fn, backend=backend)
    ptr = grad.data_ptr()
    fire(hook, grad, param)
    assert grad.data_ptr() == ptr
    assert_same_values(grad, expected, ulps=ulps)


@pytest.mark.parametrize("exponent", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_pow_with_a_nonfinite_exponent_matches_c_pow_at_every_special_base(exponent, dtype, backend):
    """C pow's rules for infinite and NaN exponents: |x| == 1 gives 1 (also -1 ** inf), |x| < 1 and |x| > 1
    give 0 or inf by the exponent's sign, NaN exponents give NaN except for x == 1."""
    grad = torch.tensor([-2.0, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 2.0, float("inf"), float("-inf"), float("nan")],
                        dtype=dtype)
    expected = eager_expected(lambda g: g ** exponent, grad, grad)
    fire(fh.grad_hook(lambda g: g ** exponent, backend=backend), grad)
    assert_same_values(grad, expected)


@pytest.mark.parametrize("n", [1, 2, 3, 127, 128, 129, 1021, 4096, 4099])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_sizes_and_blocks(n, dtype, backend, monkeypatch):
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", "128")  # several programs, a partial last block
    grad = special_values(n, dtype, seed=n)
    expected = eager_expected(scale_chain, grad, grad)
    fire(fh.grad_hook(scale_chain, backend=backend), grad)
    assert_same_values(grad, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_chain_rounds_each_op_like_eager(dtype, backend):
    """Eager torch rounds every fp16/bf16 intermediate; a kernel that kept fp32 would differ here."""
    def chain(grad):
        return ((grad * 1.01 + 0.003) * 0.99 - 0.001) / 1.007
    grad = (torch.linspace(-4, 4, 4099)).to(dtype)
    expected = eager_expected(chain, grad, grad)
    kept_fp32 = (((grad.float() * 1.01 + 0.003) * 0.99 - 0.001) / 1.007).to(dtype)
    assert not torch.equal(expected, kept_fp32), "the chain must be sensitive to intermediate rounding"
    fire(fh.grad_hook(chain, backend=backend), grad)
    assert_same_values(grad, expected)


def _store_fp32_scalar(s: torch.Tensor):
    def body(grad):
        return grad.float() * 0.0 + s      # an fp32 result, rounded to bf16 only by the store
    return body


def test_bf16_store_rounds_to_nearest_even(backend):
    """fp32 -> bf16 on the store: ties to even and overflow to Inf exactly as torch (not truncation)."""
    values = [1.00390625, 1.01171875, 3.3895e38, -3.3895e38, 1.0 + 2 ** -9, 2.0 ** -133, float("nan")]
    for v in values:
        s = torch.tensor(v, dtype=torch.float32)
        g = torch.zeros(1, dtype=torch.bfloat16)
        fire(fh.grad_hook(_store_fp32_scalar(s), backend=backend), g)
        assert_same_values(g, s.reshape(1).to(torch.bfloat16))


DTYPE_IDS = lambda d: str(d).removeprefix("torch.")  # noqa: E731
INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("exponent", [1.5, -1.5, 0.1, -0.1, 2.5, 5.0, -3.0, 4.0, -4.0, 0.0],
                         ids=lambda e: f"e={e:g}")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_pow_special_bases_match_torch_bit_for_bit(exponent, dtype, backend):
    """IEEE pow at its special bases: (-inf) ** y is +inf / +0.0 for y > 0 / y < 0 unless y is an odd integer
    (then -inf / -0.0), (-0.0) ** y likewise with 0 and inf swapped, negative finite bases give NaN for a
    non-integer y, nan ** 0 and 1 ** y are 1. Results exact in every dtype, so compared bit for bit (signed
    zeros included). The one ordinary value, 2.0 ** y for a non-integer y, is rounded by each side's own pow (torch's
    CPU pow differs between AVX2 and AVX-512 builds by an ulp): within POW_ULPS there."""
    grad = torch.tensor([-INF, -2.0, -1.0, -0.0, 0.0, 1.0, 2.0, INF, NAN], dtype=dtype)
    body = lambda g: g ** exponent  # noqa: E731
    expected = eager_expected(body, grad, grad)
    fire(fh.grad_hook(body, backend=backend), grad)
    rounded = 6 if exponent != int(exponent) else None  # 2.0 ** y
    exact = [i for i in range(grad.numel()) if i != rounded]
    assert_same_bits(grad[exact], expected[exact])
    if rounded is not None:
        assert_same_values(grad[rounded:rounded + 1], expected[rounded:rounded + 1], ulps=POW_ULPS[dtype])


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """fp64 bits as integers in the order of the values (so that a difference counts representable values)."""
    i = x.view(torch.int64)
    return torch.where(i < 0, -(i & 0x7FFFFFFFFFFFFFFF), i)


@pytest.mark.parametrize("exponent", [1.01, -1.7, 2.5, -3.0, 5.0, 10.5, -40.0], ids=lambda e: f"e={e:g}")
def test_pow_fp64_within_its_bound_over_every_binade(exponent, backend, monkeypatch):
    """fp64 pow of bases spread over every binade (random bit patterns, subnormals included): within
    2 + |exponent| / 2 ulps of torch's CPU pow where the result is finite and nonzero, and exactly torch's
    0 or inf where it under- or overflows (docs/supported-ops.md, Precision). The bound is measured (200 000 bases per
    exponent, exponents up to 100): the kernel's log2 of the base's mantissa, rounded, is scaled by |exponent|."""
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", "16384")
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(1, 0x7FF0000000000000, (20000,), generator=gen, dtype=torch.int64).view(torch.float64)
    if exponent.is_integer():
        x = torch.where(torch.rand(x.numel(), generator=gen) < 0.5, -x, x)
    body = lambda g: g ** exponent  # noqa: E731
    expected = eager_expected(body, x, x)
    grad = x.clone()
    fire(fh.grad_hook(body, backend=backend), grad)
    finite = torch.isfinite(expected) & (expected != 0)
    assert_same_bits(grad[~finite], expected[~finite])
    ulps = (_ordered(grad[finite]) - _ordered(expected[finite])).abs()
    assert ulps.max().item() <= 2 + abs(exponent) / 2, f"{ulps.max().item()} ulps"


#: number bounds: torch returns x itself where it equals the bound (-0.0 stays -0.0 under clamp(min=0.0)), in
#: its scalar and vectorised CPU loops and on CUDA alike; a NaN bound makes everything NaN
CLAMP_BODIES = {
    "clamp(min=0)": lambda g: g.clamp(min=0.0), "clamp(min=-0.0)": lambda g: g.clamp(min=-0.0),
    "clamp(max=0)": lambda g: g.clamp(max=0.0), "clamp(max=-0.0)": lambda g: g.clamp(max=-0.0),
    "clamp(-0.0,0)": lambda g: g.clamp(-0.0, 0.0), "clamp(0,0)": lambda g: g.clamp(0.0, 0.0),
    "clamp(-1,0)": lambda g: g.clamp(-1.0, 0.0), "clamp(1,-1)": lambda g: g.clamp(1.0, -1.0),
    "clamp_min(0)": lambda g: g.clamp_min(0.0), "clamp_max(-0.0)": lambda g: g.clamp_max(-0.0),
    "clamp_(min=0)": lambda g: g.clamp_(min=0.0), "clip(max=0)": lambda g: torch.clip(g, max=0.0),
    "clamp(min=nan)": lambda g: g.clamp(min=NAN), "clamp(max=nan)": lambda g: g.clamp(max=NAN),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(CLAMP_BODIES))
def test_clamp_with_number_bounds_keeps_signed_zeros_like_torch(name, dtype, backend):
    """Bit for bit, signed zeros included, at every size (1000 elements: torch's vectorised CPU loop; 7: its
    scalar loop)."""
    body = CLAMP_BODIES[name]
    values = torch.tensor([-0.0, 0.0, -1.0, 1.0, -INF, INF, NAN], dtype=dtype)
    for grad in (values.clone(), values.repeat(143)[:1000].clone()):
        expected = eager_expected(body, grad, grad)
        fire(fh.grad_hook(body, backend=backend), grad)
        assert_same_bits(grad, expected)


#: tensor operands: torch's scalar code returns the first operand (x) on a tie of zeros, as its CUDA kernels do
#: for clamp; its vectorised CPU loops return the other one (docs/supported-ops.md), so the oracle of the Triton
#: backend is torch one element at a time (the eager and reference backends run torch's loops themselves)
PAIR_BODIES = {
    "maximum(g,p)": lambda g, p: torch.maximum(g, p), "minimum(g,p)": lambda g, p: torch.minimum(g, p),
    "maximum(p,g)": lambda g, p: torch.maximum(p, g), "minimum(p,g)": lambda g, p: torch.minimum(p, g),
    "maximum(g,zeros)": lambda g, p: torch.maximum(g, torch.zeros_like(g)),
    "clamp(min=p)": lambda g, p: g.clamp(min=p), "clamp(max=p)": lambda g, p: g.clamp(max=p),
    "clamp(p,p)": lambda g, p: torch.clamp(g, p, p),
    "clamp(min=0-dim)": lambda g, p: g.clamp(min=ZERO), "clamp(max=-0-dim)": lambda g, p: g.clamp(max=NEG_ZERO),
}
ZERO, NEG_ZERO = torch.tensor(0.0), torch.tensor(-0.0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(PAIR_BODIES))
def test_minimum_maximum_and_tensor_bounds_keep_signed_zeros_like_torch(name, dtype, backend):
    """Every pair of -0.0, 0.0, -1, 1, NaN: bit for bit (signed zeros included) against torch element by
    element, NaN from either operand propagated."""
    body = PAIR_BODIES[name]
    values = [-0.0, 0.0, -1.0, 1.0, NAN]
    grad = torch.tensor([a for a in values for _ in values], dtype=dtype)
    param = torch.tensor([b for _ in values for b in values], dtype=dtype)
    if backend != "triton":  # they run torch's own loops on the whole tensor: so does their oracle
        expected = eager_expected(body, grad, param)
    else:
        expected = torch.cat([eager_expected(body, grad[i:i + 1], param[i:i + 1]) for i in range(grad.numel())])
    with torch.no_grad():  # as in a backward (fired by hand with grad mode on, the eager backend's out= fails)
        fire(fh.grad_hook(body, backend=backend), grad, param)
    assert_same_bits(grad, expected)


# --- aliases: torch returns the operand itself for `+x` and a cast to its own dtype ------------------------------

def pos_snapshot(grad):
    x = +grad          # x is grad: the mul_ below is seen through it
    grad.mul_(2)
    return x + grad


def pos_inplace(grad):
    (+grad).mul_(3)


def float_clamp_inplace(grad):
    grad.float().clamp_(-1.0, 1.0)      # clamps grad itself when it is float32, a copy otherwise


def float_then_update(grad):
    x = grad.float()
    grad.mul_(2)
    return x + grad


def to_then_inplace(grad):
    x = grad.to(torch.float32)
    x.add_(1)
    return grad * 2


def every_cast_inplace(grad):
    grad.double().mul_(3)
    grad.half().add_(1)
    grad.to(dtype=torch.bfloat16).neg_()


def intermediate_cast_inplace(grad):
    y = grad * 2
    y.float().add_(1)
    return y


ALIAS_BODIES = {"+x then mul_": pos_snapshot, "(+x).mul_": pos_inplace, "float().clamp_": float_clamp_inplace,
                "float() then mul_": float_then_update, "to(float32).add_": to_then_inplace,
                "double/half/bfloat16 in place": every_cast_inplace,
                "intermediate.float().add_": intermediate_cast_inplace}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", list(ALIAS_BODIES))
def test_pos_and_casts_to_the_same_dtype_alias_like_torch(name, dtype, backend):
    """In-place ops through `+x` or `x.float()` (on a float32 x) reach x, and in-place ops on x are seen through
    them, as in torch (where they return x itself); a cast to another dtype stays a copy."""
    body = ALIAS_BODIES[name]
    grad = special_values(257, dtype)
    expected = eager_expected(body, grad, grad)
    fire(fh.grad_hook(body, backend=backend), grad)
    assert_same_bits(grad, expected)


def param_cast_then_update(grad, param):
    q = param.float()  # a copy of a half parameter; the parameter itself when it is float32 (refused: read-only)
    q.mul_(1e-2)
    return grad.add_(q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=DTYPE_IDS)
def test_a_cast_of_the_parameter_to_another_dtype_is_a_copy_to_update(dtype, backend):
    """Whether `p.float()` is p itself depends on p's dtype: decided per dtype, not at decoration (where the
    body is lowered for float32)."""
    hook = fh.grad_hook(param_cast_then_update, backend=backend)  # decorating accepts it
    grad, param = special_values(257, dtype), special_values(257, dtype, seed=1)
    expected = eager_expected(param_cast_then_update, grad, param)
    fire(hook, grad, param)
    assert_same_bits(grad, expected)


def test_a_cast_of_a_float32_parameter_to_its_own_dtype_is_the_parameter():
    hook = fh.grad_hook(param_cast_then_update)
    with pytest.raises(fh.CompileError, match="parameter"):
        hook.register(torch.zeros(3, requires_grad=True))


# --- results broadcast into the gradient ----------------------------------------------------------------------

SCALE_1X1 = torch.tensor([[0.5]])
#: bodies whose result is not shaped like the gradient: torch refuses a gradient hook that changes the size
OTHER_SHAPE_BODIES = {
    "return 0-dim -0.0": lambda g: NEG_ZERO,
    "return -0.0 reduction": lambda g: -(g * 0.0).abs().sum(),
    "return -(0-dim 0.0)": lambda g: -ZERO,
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_a_result_broadcast_from_a_1x1_tensor_keeps_signed_zeros(dtype, backend):
    """`g * 1x1 tensor` (the gradient's shape, broadcast inside the body) is written bit for bit, -0.0 included."""
    body = lambda g: g * SCALE_1X1  # noqa: E731
    grad = torch.tensor([[1.0, -0.0, 3.0], [-0.0, 2.0, -4.0]], dtype=dtype)
    expected = eager_expected(body, grad, grad)
    fire(fh.grad_hook(body, backend=backend), grad)
    assert_same_bits(grad.flatten(), expected.flatten())


@pytest.mark.parametrize("name", list(OTHER_SHAPE_BODIES))
def test_a_result_of_another_shape_than_the_gradient_is_refused(name, backend):
    """A 0-dim result would be broadcast into every element of `.grad`, silently: refused at register, as torch
    refuses a hook that changes the size."""
    p = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(fh.CompileError, match=r"the body's result has shape \(\), the gradient of param0 has shape "
                                              r"\(2, 3\)"):
        fh.grad_hook(OTHER_SHAPE_BODIES[name], backend=backend).register(p)


# --- reflected operators with a closed-over tensor ------------------------------------------------------------

@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_reflected_operators_on_a_closed_over_tensor_match_torch(dtype, scale_dtype, backend):
    """`1 / s` and `3 / s` are torch's `s.reciprocal() * c` (rounded in between), `1 - s`, `2 * s`, `0.5 + s` its
    reflected ops: bit for bit on every backend."""
    s = torch.tensor(3.0, dtype=scale_dtype)

    def body(grad):
        return grad * (1 / s) + (3 / s) * (1 - s) - 2 * s + (0.5 + s)

    grad = special_values(257, dtype)
    expected = eager_expected(body, grad, grad)
    fire(fh.grad_hook(body, backend=backend), grad)
    assert_same_bits(grad, expected)


# --- Python numbers a dtype cannot hold, where torch accepts them ----------------------------------------------

ACCEPTED_NUMBERS = {  # dtype -> bodies torch computes (an overflowing product, a replacement, a where branch)
    torch.float32: [lambda g: g * 1e39, lambda g: torch.nan_to_num(g, posinf=1e39, neginf=-1e39)],
    torch.float16: [lambda g: torch.where(g > 0, g, 1e5), lambda g: g + 1e5],
    torch.bfloat16: [lambda g: g.clamp(-1e5, 1e5), lambda g: torch.where(g > 0, 1e39, g)],
    torch.float64: [lambda g: g.clamp(-1e39, 1e39), lambda g: torch.full_like(g, 1e39)],
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
def test_numbers_beyond_a_dtype_that_torch_accepts_compile_and_match(dtype, backend):
    for body in ACCEPTED_NUMBERS[dtype]:
        grad = special_values(257, dtype)
        expected = eager_expected(body, grad, grad)
        fire(fh.grad_hook(body, backend=backend), grad)
        assert_same_bits(grad, expected)


# --- Python ints beyond an int value's width -------------------------------------------------------------------

INT_WRAP_BODIES = {
    "int32 mask + 2**40": lambda g: g * ((g > 0).to(torch.int32) + 2 ** 40),
    "int32 mask * 3e9": lambda g: g * ((g > 0).to(torch.int32) * 3_000_000_000),
    "int32 mask == 2**32 + 1": lambda g: torch.where((g > 0).to(torch.int32) == 2 ** 32 + 1, g, -g),
    "int32 mask - (2**64 - 1)": lambda g: g * ((g > 0).to(torch.int32) - (2 ** 64 - 1)),
}


@pytest.mark.parametrize("name", list(INT_WRAP_BODIES))
def test_python_ints_wrap_to_an_int32_value_as_torch_converts_them(name, backend):
    """torch keeps an int32 value int32 against a Python int (a number does not promote) and converts the int to
    int32 by wrapping it (two's complement)."""
    body = INT_WRAP_BODIES[name]
    grad = special_values(67, torch.float32)
    expected = eager_expected(body, grad, grad)
    fire(fh.grad_hook(body, backend=backend), grad)
    assert_same_bits(grad, expected)
