"""Optimizer steps over many tensors of one dtype on one device, one launch each: AdamW (decoupled weight decay,
amsgrad, maximize) and SGD (momentum, dampening, nesterov, weight decay, maximize), computed as torch's fused
optimizers compute them: in fp32 for fp32, bf16 and fp16 tensors (each loaded value widened, each stored value
rounded to nearest even once), in fp64 for fp64 tensors; the bias corrections in fp64.

How a launch finds its tensors: a table (int64, on the tensors' device) of the parts TABLE_PARTS, each n_tensors long
(addresses of the parameter, its gradient, its first state (exp_avg, or SGD's momentum buffer), its second state
(exp_avg_sq), amsgrad's max_exp_avg_sq, its step count (a float32 0-dim tensor, torch's `state["step"]`; AdamW), the
numel, SGD's first-step flag: the momentum buffer starts as the gradient, and the parameter's fp32 master copy, or 0),
then (tensor, first element) per program, as `multi_tensor`'s table. The tensors are contiguous (each one span of
storage, the same layout).

What changes between steps is read on the device, so a learning-rate schedule compiles nothing new: the
hyper-parameters (`hyper_ptr`, fp64: AdamW lr, beta1, beta2, eps, weight_decay; SGD lr, momentum, dampening,
weight_decay), the step counts, and torch's `grad_scale` and `found_inf` of its fused optimizers (float32 0-dim:
each gradient is divided by grad_scale, a folded clip coefficient's reciprocal times AMP's scale, as torch's fused
kernels divide it, without writing the quotient back; a non-zero found_inf skips the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusedhooks.runtime.launcher import host_to_device

from .elementwise import bf16_to_fp32, to_bf16, to_bf16_stochastic
from .multi_tensor import TL_DTYPES, launch_config

#: The table's per-tensor parts, in order, each n_tensors int64s; then (tensor, first element) per program.
TABLE_PARTS = ("param", "grad", "state1", "state2", "state3", "step", "numel", "first_step", "master")


@triton.jit
def _load(ptr, offsets, mask, DTYPE: tl.constexpr, MATH: tl.constexpr):
    """Elements of a DTYPE tensor, widened to MATH (fp32, or fp64 for fp64 tensors); mask None: a full block (no
    mask: vector loads for aligned tensors)."""
    if mask is None:
        x = tl.load(ptr + offsets)
    else:
        x = tl.load(ptr + offsets, mask=mask, other=0)
    if DTYPE == tl.bfloat16:
        return bf16_to_fp32(x)
    else:
        return x.to(MATH)


@triton.jit
def _put(ptr, offsets, y, mask):
    """Store y as it is; mask None: a full block (no mask: vector stores for aligned tensors)."""
    if mask is None:
        tl.store(ptr + offsets, y)
    else:
        tl.store(ptr + offsets, y, mask=mask)


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    """x rounded to DTYPE (to nearest even; bf16 by bits in the interpreter, whose cast truncates)."""
    if DTYPE == tl.bfloat16:
        return to_bf16(x)
    else:
        return x.to(DTYPE)


@triton.jit
def _store(ptr, offsets, x, mask, DTYPE: tl.constexpr):
    """Store x rounded to DTYPE (`_rounded`); mask None: a full block."""
    _put(ptr, offsets, _rounded(x, DTYPE), mask)


@triton.jit
def _store_param(ptr, offsets, x, mask, DTYPE: tl.constexpr, STOCHASTIC: tl.constexpr, seed, tensor):
    """Store the parameter x as `_store` does, or, for bf16 with STOCHASTIC, rounded stochastically (elementwise
    `to_bf16_stochastic`), its random bits Philox's of (seed; element, tensor): each element and tensor of a launch
    draws its own, each launch a new seed."""
    if STOCHASTIC:
        lo = offsets.to(tl.uint32)  # the element's index, low and high words
        hi = (offsets >> 32).to(tl.uint32)
        random, _, _, _ = tl.philox(seed, lo, hi, tl.zeros_like(lo) + tensor.to(tl.uint32), tl.zeros_like(lo))
        y = to_bf16_stochastic(x, random & 0xFFFF)
    else:
        y = _rounded(x, DTYPE)
    _put(ptr, offsets, y, mask)


@triton.jit
def _load_param(param_ptr, master_ptr, offsets, mask, DTYPE: tl.constexpr, MATH: tl.constexpr, MASTER: tl.constexpr):
    """The parameter's elements in MATH: its fp32 master copy's with MASTER, else its own."""
    if MASTER:
        return _load(master_ptr, offsets, mask, tl.float32, MATH)
    else:
        return _load(param_ptr, offsets, mask, DTYPE, MATH)


@triton.jit
def _store_params(param_ptr, master_ptr, offsets, x, mask, DTYPE: tl.constexpr, MASTER: tl.constexpr,
                  STOCHASTIC: tl.constexpr, seed, tensor):
    """Store the new parameter x: into the fp32 master copy with MASTER, and into the parameter (`_store_param`)."""
    if MASTER:
        _store(master_ptr, offsets, x, mask, tl.float32)
    _store_param(param_ptr, offsets, x, mask, DTYPE, STOCHASTIC, seed, tensor)


@triton.jit
def _div(x, y, MATH: tl.constexpr):
    """x / y correctly rounded, as torch's CUDA kernels divide (fp32 `/` is approximate on a GPU)."""
    if MATH == tl.float32:
        return tl.math.div_rn(x, y)
    else:
        return x / y


@triton.jit
def _sqrt(x, MATH: tl.constexpr):
    """sqrt(x) correctly rounded (fp32 `tl.sqrt` is approximate on a GPU)."""
    if MATH == tl.float32:
        return tl.math.sqrt_rn(x)
    else:
        return tl.sqrt(x)


@triton.jit
def _grad_scale(grad_scale_ptr, GRAD_SCALE: tl.constexpr, MATH: tl.constexpr):
    """The divisor of the gradients (MATH 0-dim; 1.0 when not GRAD_SCALE: then not read)."""
    if GRAD_SCALE:
        return tl.load(grad_scale_ptr).to(MATH)
    else:
        return tl.full((), 1.0, MATH)


@triton.jit
def _load_grad(grad_ptr, offsets, mask, grad_scale, DTYPE: tl.constexpr, MATH: tl.constexpr,
               GRAD_SCALE: tl.constexpr):
    """The gradient's elements in MATH, divided by grad_scale when GRAD_SCALE (torch's fused kernels divide in
    fp64 and round to fp32: the correctly rounded fp32 quotient)."""
    grad = _load(grad_ptr, offsets, mask, DTYPE, MATH)
    if GRAD_SCALE:
        grad = _div(grad, grad_scale, MATH)
    return grad


@triton.jit
def _program(table_ptr, n_tensors, found_inf_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """(tensor, first element, end) of this program's chunk of its tensor, from the table; an empty chunk (end ==
    first) when found_inf is non-zero: no element is stepped."""
    pid = tl.program_id(0).to(tl.int64)
    tensor = tl.load(table_ptr + 9 * n_tensors + 2 * pid)  # after the 9 parts of TABLE_PARTS
    first = tl.multiple_of(tl.load(table_ptr + 9 * n_tensors + 2 * pid + 1), BLOCK)
    end = tl.minimum(first + CHUNK, tl.load(table_ptr + 6 * n_tensors + tensor))
    return tensor, first, tl.where(tl.load(found_inf_ptr) != 0, first, end)


@triton.jit
def _span(table_ptr, n_tensors, part, tensor, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The pointer of part `part` (an index of TABLE_PARTS) of tensor `tensor`."""
    ptr = tl.load(table_ptr + part * n_tensors + tensor).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def adamw_kernel(
    table_ptr,  # *int64: the table (module docstring)
    hyper_ptr,  # *fp64 [5 or 6]: lr, beta1, beta2, eps, weight_decay (, the stochastic rounding's seed)
    grad_scale_ptr,  # *fp32 0-dim: every gradient is divided by it (read when GRAD_SCALE)
    found_inf_ptr,  # *fp32 0-dim: non-zero: no tensor is stepped (the step counts are put back by the caller)
    n_tensors,  # tensors in the table
    DTYPE: tl.constexpr,  # element type of every parameter and gradient, and of the states unless MASTER
    AMSGRAD: tl.constexpr,  # keep the largest exp_avg_sq (state3) and divide by it
    MAXIMIZE: tl.constexpr,  # step along the gradient
    GRAD_SCALE: tl.constexpr,  # divide each gradient by *grad_scale_ptr
    STOCHASTIC: tl.constexpr,  # round the bf16 parameters stochastically (seed: the last hyper-parameter)
    MASTER: tl.constexpr,  # 16-bit parameters with fp32 master copies (part "master") and fp32 states
    ALIGNED: tl.constexpr,  # every address a multiple of 16 bytes (a vectorisation hint; true whenever set)
    CHUNK: tl.constexpr,  # elements per program, a multiple of BLOCK
    BLOCK: tl.constexpr,  # elements per loop iteration, a power of two
):
    tensor, first, end = _program(table_ptr, n_tensors, found_inf_ptr, CHUNK, BLOCK)
    MATH: tl.constexpr = tl.float64 if DTYPE == tl.float64 else tl.float32
    STATE: tl.constexpr = tl.float32 if MASTER else DTYPE
    grad_scale = _grad_scale(grad_scale_ptr, GRAD_SCALE, MATH)
    param_ptr = _span(table_ptr, n_tensors, 0, tensor, DTYPE, ALIGNED)
    grad_ptr = _span(table_ptr, n_tensors, 1, tensor, DTYPE, ALIGNED)
    exp_avg_ptr = _span(table_ptr, n_tensors, 2, tensor, STATE, ALIGNED)
    exp_avg_sq_ptr = _span(table_ptr, n_tensors, 3, tensor, STATE, ALIGNED)
    max_sq_ptr = _span(table_ptr, n_tensors, 4, tensor, STATE, ALIGNED)
    master_ptr = _span(table_ptr, n_tensors, 8, tensor, tl.float32, ALIGNED)
    step = tl.load(tl.load(table_ptr + 5 * n_tensors + tensor).to(tl.pointer_type(tl.float32))).to(tl.float64)
    lr, beta1, beta2 = tl.load(hyper_ptr), tl.load(hyper_ptr + 1), tl.load(hyper_ptr + 2)
    eps, weight_decay = tl.load(hyper_ptr + 3), tl.load(hyper_ptr + 4)
    seed = 0
    if STOCHASTIC:
        seed = tl.load(hyper_ptr + 5).to(tl.int64)
    # as torch's fused AdamW: the bias corrections in fp64 with pow (1 - beta2**step near 0 magnifies pow's rounding
    # by 1 / (1 - beta2**step): computed otherwise, it would differ from torch's by far more than an ulp), then every
    # factor in the math type
    bias_correction1 = 1.0 - tl.exp(step * tl.log(beta1))
    bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp(step * tl.log(beta2)))
    step_size = (lr / bias_correction1).to(MATH)
    bias_correction2_sqrt = bias_correction2_sqrt.to(MATH)
    decay = (lr * weight_decay).to(MATH)
    b1, b2, eps = beta1.to(MATH), beta2.to(MATH), eps.to(MATH)
    one_minus_b1, one_minus_b2 = (1.0 - beta1).to(MATH), (1.0 - beta2).to(MATH)
    for i in range(0, tl.cdiv(end - first, BLOCK)):  # a runtime bound: a short tensor's program stops early
        start = first + i * BLOCK  # i * BLOCK keeps the divisibility hint of `first`
        offsets = start + tl.arange(0, BLOCK)
        if start + BLOCK <= end:  # a full block: no mask
            _adamw_block(param_ptr, master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_sq_ptr, offsets, None,
                         grad_scale, decay, b1, b2, one_minus_b1, one_minus_b2, eps, step_size, bias_correction2_sqrt,
                         DTYPE, STATE, MATH, AMSGRAD, MAXIMIZE, GRAD_SCALE, seed, tensor, STOCHASTIC, MASTER)
        else:
            _adamw_block(param_ptr, master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_sq_ptr, offsets,
                         offsets < end, grad_scale, decay, b1, b2, one_minus_b1, one_minus_b2, eps, step_size,
                         bias_correction2_sqrt, DTYPE, STATE, MATH, AMSGRAD, MAXIMIZE, GRAD_SCALE, seed, tensor,
                         STOCHASTIC, MASTER)


@triton.jit
def _adamw_block(param_ptr, master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_sq_ptr, offsets, mask, grad_scale,
                 decay, b1, b2, one_minus_b1, one_minus_b2, eps, step_size, bias_correction2_sqrt, DTYPE: tl.constexpr,
                 STATE: tl.constexpr, MATH: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
                 GRAD_SCALE: tl.constexpr, seed, tensor, STOCHASTIC: tl.constexpr, MASTER: tl.constexpr):
    """AdamW on the elements `offsets` (within `mask`; None: all) of one tensor, the factors in MATH; the states of
    dtype STATE."""
    grad = _load_grad(grad_ptr, offsets, mask, grad_scale, DTYPE, MATH, GRAD_SCALE)
    if MAXIMIZE:
        grad = -grad
    param = _load_param(param_ptr, master_ptr, offsets, mask, DTYPE, MATH, MASTER)
    param = tl.where(decay != 0, param - decay * param, param)  # as torch: no decay term at 0 (an Inf stays Inf)
    exp_avg = b1 * _load(exp_avg_ptr, offsets, mask, STATE, MATH) + one_minus_b1 * grad
    exp_avg_sq = b2 * _load(exp_avg_sq_ptr, offsets, mask, STATE, MATH) + one_minus_b2 * grad * grad
    if AMSGRAD:
        max_sq = tl.maximum(_load(max_sq_ptr, offsets, mask, STATE, MATH), exp_avg_sq)
        _store(max_sq_ptr, offsets, max_sq, mask, STATE)
        denom = _div(_sqrt(max_sq, MATH), bias_correction2_sqrt, MATH) + eps
    else:
        denom = _div(_sqrt(exp_avg_sq, MATH), bias_correction2_sqrt, MATH) + eps
    _store(exp_avg_ptr, offsets, exp_avg, mask, STATE)
    _store(exp_avg_sq_ptr, offsets, exp_avg_sq, mask, STATE)
    _store_params(param_ptr, master_ptr, offsets, param - _div(step_size * exp_avg, denom, MATH), mask, DTYPE, MASTER,
                  STOCHASTIC, seed, tensor)


@triton.jit
def sgd_kernel(
    table_ptr,  # *int64: the table (module docstring)
    hyper_ptr,  # *fp64 [4 or 5]: lr, momentum, dampening, weight_decay (, the stochastic rounding's seed)
    grad_scale_ptr,  # *fp32 0-dim: every gradient is divided by it (read when GRAD_SCALE)
    found_inf_ptr,  # *fp32 0-dim: non-zero: no tensor is stepped
    n_tensors,  # tensors in the table
    DTYPE: tl.constexpr,  # element type of every parameter and gradient, and of the momentum buffers unless MASTER
    MOMENTUM: tl.constexpr,  # momentum != 0: keep the momentum buffer (state1)
    NESTEROV: tl.constexpr,  # Nesterov momentum
    MAXIMIZE: tl.constexpr,  # step along the gradient
    GRAD_SCALE: tl.constexpr,  # divide each gradient by *grad_scale_ptr
    STOCHASTIC: tl.constexpr,  # round the bf16 parameters stochastically (seed: the last hyper-parameter)
    MASTER: tl.constexpr,  # 16-bit parameters with fp32 master copies (part "master") and fp32 states
    ALIGNED: tl.constexpr,  # every address a multiple of 16 bytes (a vectorisation hint; true whenever set)
    CHUNK: tl.constexpr,  # elements per program, a multiple of BLOCK
    BLOCK: tl.constexpr,  # elements per loop iteration, a power of two
):
    MATH: tl.constexpr = tl.float64 if DTYPE == tl.float64 else tl.float32
    STATE: tl.constexpr = tl.float32 if MASTER else DTYPE
    tensor, first, end = _program(table_ptr, n_tensors, found_inf_ptr, CHUNK, BLOCK)
    first_step = tl.load(table_ptr + 7 * n_tensors + tensor)
    param_ptr = _span(table_ptr, n_tensors, 0, tensor, DTYPE, ALIGNED)
    grad_ptr = _span(table_ptr, n_tensors, 1, tensor, DTYPE, ALIGNED)
    buf_ptr = _span(table_ptr, n_tensors, 2, tensor, STATE, ALIGNED)
    master_ptr = _span(table_ptr, n_tensors, 8, tensor, tl.float32, ALIGNED)
    grad_scale = _grad_scale(grad_scale_ptr, GRAD_SCALE, MATH)
    lr, momentum = tl.load(hyper_ptr).to(MATH), tl.load(hyper_ptr + 1).to(MATH)
    one_minus_dampening = (1.0 - tl.load(hyper_ptr + 2)).to(MATH)
    weight_decay = tl.load(hyper_ptr + 3).to(MATH)
    seed = 0
    if STOCHASTIC:
        seed = tl.load(hyper_ptr + 4).to(tl.int64)
    for i in range(0, tl.cdiv(end - first, BLOCK)):  # a runtime bound: a short tensor's program stops early
        start = first + i * BLOCK  # i * BLOCK keeps the divisibility hint of `first`
        offsets = start + tl.arange(0, BLOCK)
        if start + BLOCK <= end:  # a full block: no mask
            _sgd_block(param_ptr, master_ptr, grad_ptr, buf_ptr, offsets, None, grad_scale, lr, momentum,
                       one_minus_dampening, weight_decay, first_step, DTYPE, STATE, MATH, MOMENTUM, NESTEROV, MAXIMIZE,
                       GRAD_SCALE, seed, tensor, STOCHASTIC, MASTER)
        else:
            _sgd_block(param_ptr, master_ptr, grad_ptr, buf_ptr, offsets, offsets < end, grad_scale, lr, momentum,
                       one_minus_dampening, weight_decay, first_step, DTYPE, STATE, MATH, MOMENTUM, NESTEROV, MAXIMIZE,
                       GRAD_SCALE, seed, tensor, STOCHASTIC, MASTER)


@triton.jit
def _sgd_block(param_ptr, master_ptr, grad_ptr, buf_ptr, offsets, mask, grad_scale, lr, momentum,
               one_minus_dampening, weight_decay, first_step, DTYPE: tl.constexpr, STATE: tl.constexpr,
               MATH: tl.constexpr, MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr,
               GRAD_SCALE: tl.constexpr, seed, tensor, STOCHASTIC: tl.constexpr, MASTER: tl.constexpr):
    """SGD on the elements `offsets` (within `mask`; None: all) of one tensor, the factors in MATH; the momentum
    buffer of dtype STATE."""
    grad = _load_grad(grad_ptr, offsets, mask, grad_scale, DTYPE, MATH, GRAD_SCALE)
    if MAXIMIZE:
        grad = -grad
    param = _load_param(param_ptr, master_ptr, offsets, mask, DTYPE, MATH, MASTER)
    grad = tl.where(weight_decay != 0, grad + weight_decay * param, grad)  # as torch: no term at 0 (Inf params)
    if MOMENTUM:
        if first_step != 0:
            buf = grad
        else:
            buf = momentum * _load(buf_ptr, offsets, mask, STATE, MATH) + one_minus_dampening * grad
        _store(buf_ptr, offsets, buf, mask, STATE)
        if NESTEROV:
            grad = grad + momentum * buf
        else:
            grad = buf
    _store_params(param_ptr, master_ptr, offsets, param - lr * grad, mask, DTYPE, MASTER, STOCHASTIC, seed, tensor)


@dataclass
class OptimTable:
    """The table of one launch (see the module docstring) and how it was built: `key` (the addresses, numels and
    first-step flags it holds: build a new one when they change), its programs, BLOCK and CHUNK, and whether every
    address is 16-byte aligned."""

    table: torch.Tensor
    key: tuple
    n_tensors: int
    n_programs: int
    block: int
    chunk: int
    aligned: bool


def table_key(parts: dict[str, list[int]]) -> tuple:
    """What a table of `parts` (TABLE_PARTS -> one int per tensor) is kept by."""
    return tuple(tuple(parts[name]) for name in TABLE_PARTS)


#: Elements per loop iteration on a GPU at most, by element size: a step holds five tensors' values per element (at
#: 4096 and 8 warps, amsgrad's fp32 step took 164 registers on sm_90; at 1024 and 4 warps 8 elements per thread)
GPU_BLOCK = {2: 1024, 4: 1024, 8: 512}


def build_table(parts: dict[str, list[int]], device: torch.device, element_size: int) -> OptimTable:
    """The table of tensors given by `parts` (TABLE_PARTS -> one int per tensor: addresses, 0 for a state the
    launch does not read; numels, all > 0; first-step flags) of `element_size`-byte elements on `device`."""
    numels = parts["numel"]
    block, chunk = launch_config(numels, device.type)
    if device.type == "cuda":
        block = min(block, GPU_BLOCK[element_size])
    programs = [v for t, n in enumerate(numels) for first in range(0, n, chunk) for v in (t, first)]
    table = host_to_device([v for name in TABLE_PARTS for v in parts[name]] + programs, torch.int64, device)
    addresses = [a for name in TABLE_PARTS[:5] + ("master",) for a in parts[name] if a]
    return OptimTable(table, table_key(parts), len(numels), len(programs) // 2, block, chunk,
                      all(a % 16 == 0 for a in addresses))


def _stochastic(stochastic: bool, dtype: torch.dtype) -> bool:
    """STOCHASTIC of a launch: asked for, of bf16 tensors (stochastic rounding of other dtypes is refused)."""
    if stochastic and dtype != torch.bfloat16:
        raise ValueError(f"stochastic rounding rounds bfloat16 parameters, not {dtype}")
    return stochastic


def _master(master: bool, dtype: torch.dtype) -> bool:
    """MASTER of a launch: asked for, of 16-bit tensors (fp32 and fp64 parameters are their own masters)."""
    if master and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"fp32 master weights are kept for 16-bit parameters, not {dtype}")
    return master


def _options(table: OptimTable) -> dict:
    options = {"enable_fp_fusion": False}  # torch's fused kernels round each operation
    if table.table.device.type == "cuda":
        options["num_warps"] = 8 if table.block >= 2048 else 4
    return options


def adamw_(table: OptimTable, hyper: torch.Tensor, grad_scale: torch.Tensor | None, found_inf: torch.Tensor,
           dtype: torch.dtype, amsgrad: bool, maximize: bool, launch, stochastic: bool = False,
           master: bool = False) -> None:
    """One AdamW step of the tensors of `table` (dtype `dtype`), their step counts already incremented; hyper: fp64
    [5] (lr, beta1, beta2, eps, weight_decay; with `stochastic` (bf16 only) a 6th, the rounding's seed, an integer
    below 2**53); grad_scale (None: 1), found_inf: float32 0-dim on the table's device; launch(kernel, grid, args,
    meta)."""
    meta = dict(DTYPE=TL_DTYPES[dtype], AMSGRAD=amsgrad, MAXIMIZE=maximize, GRAD_SCALE=grad_scale is not None,
                STOCHASTIC=_stochastic(stochastic, dtype), MASTER=_master(master, dtype), ALIGNED=table.aligned,
                CHUNK=table.chunk, BLOCK=table.block, **_options(table))
    args = (table.table, hyper, found_inf if grad_scale is None else grad_scale, found_inf, table.n_tensors)
    launch(adamw_kernel, (table.n_programs,), args, meta)


def sgd_(table: OptimTable, hyper: torch.Tensor, grad_scale: torch.Tensor | None, found_inf: torch.Tensor,
         dtype: torch.dtype, momentum: bool, nesterov: bool, maximize: bool, launch, stochastic: bool = False,
         master: bool = False) -> None:
    """One SGD step of the tensors of `table` (dtype `dtype`); hyper: fp64 [4] (lr, momentum, dampening,
    weight_decay; with `stochastic` (bf16 only) a 5th, the rounding's seed); grad_scale (None: 1), found_inf: float32
    0-dim on the table's device; launch(kernel, grid, args, meta)."""
    meta = dict(DTYPE=TL_DTYPES[dtype], MOMENTUM=momentum, NESTEROV=nesterov, MAXIMIZE=maximize,
                GRAD_SCALE=grad_scale is not None, STOCHASTIC=_stochastic(stochastic, dtype),
                MASTER=_master(master, dtype), ALIGNED=table.aligned, CHUNK=table.chunk, BLOCK=table.block,
                **_options(table))
    args = (table.table, hyper, found_inf if grad_scale is None else grad_scale, found_inf, table.n_tensors)
    launch(sgd_kernel, (table.n_programs,), args, meta)
