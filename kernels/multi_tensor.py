"""Multi-tensor kernels: scale many tensors of one dtype, on one device, in one launch.

`clip_grad_norm_` uses this to apply the global clip coefficient to every gradient a hook is registered on
with one launch per (device, dtype) group, however many parameters there are.

How a launch finds its tensors: a *table*, one int64 tensor on the tensors' device, laid out as

    [ address of tensor 0 .. n_tensors-1 | numel of tensor 0 .. n_tensors-1 |
      (tensor, first element) of program 0 .. n_programs-1 ]

Each program reads its row of the program part, turns the tensor's address (a `data_ptr()`) into a pointer,
and scales the elements [first, first + CHUNK) of that tensor, BLOCK at a time. A pointer table of
`data_ptr()`s works on GPU and, for CPU tensors, in the Triton interpreter (the interpreter's pointers are
host addresses). Tensors are processed as their flat storage span, so they must be non-overlapping and dense
(`build_table` leaves the others out and reports them).

The table depends only on the tensors' addresses and sizes: build it once and launch it many times while the
tensors stay where they are (a gradient freed by `zero_grad(set_to_none=True)` and allocated again usually
lands at the same address; compare `ScaleTable.addresses` to know).

Rounding, as eager torch (`g.mul_(coef)`, `torch._foreach_mul_(grads, coef)`):
- fp16/bf16/fp32 tensors are multiplied in fp32 and rounded once to their dtype (to nearest even; bf16 goes
  through bit arithmetic because the interpreter's fp32 -> bf16 cast truncates); fp64 tensors in fp64.
- The coefficient is read from a 0-dim device tensor of any float dtype and converted to fp32 (fp64 for fp64
  tensors), as torch's CPU kernels do. On CUDA, torch converts a coefficient of *another* dtype to the
  tensors' dtype first (`mul_` with a 0-dim CUDA tensor casts it to the common dtype): ROUND_COEF=True does
  the same, through fp32 as c10's conversions do.
- A coefficient >= 1 returns before touching the tensors (clip_grad_norm_ clamps it to at most 1, and x * 1
  is x); NaN compares false, so a NaN coefficient is multiplied in, as torch does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusedhooks.runtime.launcher import host_to_device
from fusedhooks.runtime.layout import flat_span

from .elementwise import bf16_to_fp32, round_to_bf16, round_to_fp16, to_bf16

#: Triton element type of each torch dtype the kernel scales.
TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
             torch.float64: tl.float64}
#: Elements per loop iteration of a program on a GPU (at most), and under the interpreter (whose cost is per
#: program, so a program there does one large block).
GPU_BLOCK = 4096
INTERPRET_MAX_BLOCK = 1 << 15
#: Elements per program on a GPU at most (the chunk is smaller when there is little work, to fill the device).
GPU_MAX_CHUNK = 1 << 16
#: Programs a GPU launch aims for at least, when the tensors are large enough.
GPU_TARGET_PROGRAMS = 1024


@triton.jit
def scale_kernel(
    table_ptr,  # *int64: the table (module docstring): addresses, numels, then (tensor, first element) per program
    coef_ptr,  # *fp16/bf16/fp32/fp64: a 0-dim tensor, the coefficient (read here, on the device: no host sync)
    n_tensors,  # int: tensors in the table (the address and numel parts are n_tensors long)
    DTYPE: tl.constexpr,  # element type of every tensor in the table (tl.float16, tl.bfloat16, tl.float32, tl.float64)
    ROUND_COEF: tl.constexpr,  # round the coefficient to DTYPE before multiplying (what CUDA torch does when the
                               # coefficient tensor has another dtype); ignored for fp32/fp64 tensors
    ALIGNED: tl.constexpr,  # every address is a multiple of 16 bytes (a vectorisation hint; must be true if set)
    CHUNK: tl.constexpr,  # elements per program: a multiple of BLOCK
    BLOCK: tl.constexpr,  # elements per loop iteration, a power of two
):
    # The coefficient, in the math type: fp64 for fp64 tensors, else fp32.
    if DTYPE == tl.float64:
        coef = tl.load(coef_ptr).to(tl.float64)
    else:
        coef = tl.load(coef_ptr).to(tl.float32)
        if ROUND_COEF:
            if DTYPE == tl.bfloat16:
                coef = round_to_bf16(coef)
            elif DTYPE == tl.float16:
                coef = round_to_fp16(coef)
    # Nothing to do: x * 1 == x. No program reads or writes its tensor. (NaN >= 1 is false: NaN is multiplied in.)
    if coef >= 1.0:
        return
    pid = tl.program_id(0).to(tl.int64)
    # This program's tensor and the first element of its chunk.
    tensor = tl.load(table_ptr + 2 * n_tensors + 2 * pid)
    first = tl.multiple_of(tl.load(table_ptr + 2 * n_tensors + 2 * pid + 1), BLOCK)
    numel = tl.load(table_ptr + n_tensors + tensor)
    ptr = tl.load(table_ptr + tensor).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    end = tl.minimum(first + CHUNK, numel)
    for i in range(0, tl.cdiv(end - first, BLOCK)):  # a runtime bound: a short tensor's program stops early
        start = first + i * BLOCK  # i * BLOCK keeps the divisibility hint of `first`
        offsets = start + tl.arange(0, BLOCK)
        if start + BLOCK <= end:  # a full block: no mask, so aligned tensors get vector loads and stores
            tl.store(ptr + offsets, _scaled(tl.load(ptr + offsets), coef, DTYPE))
        else:
            mask = offsets < end
            tl.store(ptr + offsets, _scaled(tl.load(ptr + offsets, mask=mask), coef, DTYPE), mask=mask)


@triton.jit
def _scaled(x, coef, DTYPE: tl.constexpr):
    """x * coef computed in coef's type (fp32, or fp64 for fp64 tensors), rounded to DTYPE (to nearest even)."""
    if DTYPE == tl.bfloat16:
        y = bf16_to_fp32(x) * coef  # exact in the interpreter too (its bf16 -> fp32 cast mangles subnormals)
    else:
        y = x.to(coef.dtype) * coef
    if DTYPE == tl.bfloat16:
        return to_bf16(y)  # the same bits on GPU and in the interpreter (whose fp32 -> bf16 cast truncates)
    else:
        return y.to(DTYPE)


@dataclass
class ScaleTable:
    """The table of one launch: tensors of one dtype on one device (build with `build_table`).

    table: the int64 device tensor the kernel reads. addresses: the tensors' data_ptr()s (host ints, in table
    order), to tell whether the tensors have moved. bytes: what one scaling pass reads plus writes (elements x
    element size x 2). Tensors that are not non-overlapping and dense are not in the table: their indices (in
    the list given to `build_table`) are in `left_out`.
    """

    table: torch.Tensor
    addresses: tuple[int, ...]
    numels: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    n_programs: int
    block: int
    chunk: int
    aligned: bool
    left_out: tuple[int, ...]

    @property
    def n_tensors(self) -> int:
        return len(self.addresses)

    @property
    def bytes(self) -> int:
        return 2 * sum(self.numels) * torch.empty((), dtype=self.dtype).element_size()


def launch_config(numels: list[int], device_type: str) -> tuple[int, int]:
    """(BLOCK, CHUNK) for tensors of these sizes: one large block per program in the interpreter; on a GPU,
    BLOCK elements per iteration and chunks small enough to give every SM work, at most GPU_MAX_CHUNK."""
    largest = max(numels, default=1)
    if device_type != "cuda":
        block = min(INTERPRET_MAX_BLOCK, max(16, triton.next_power_of_2(largest)))
        return block, block
    block = min(GPU_BLOCK, max(128, triton.next_power_of_2(largest)))
    per_program = sum(numels) // GPU_TARGET_PROGRAMS
    chunk = block
    while chunk * 2 <= min(per_program, GPU_MAX_CHUNK):
        chunk *= 2
    return block, chunk


def build_table(tensors: list[torch.Tensor], block: int | None = None, chunk: int | None = None) -> ScaleTable:
    """The table for scaling `tensors` (one dtype, one device) in one launch.

    block, chunk: elements per iteration and per program (powers of two, chunk a multiple of block); default
    from `launch_config`. Empty tensors get no program. On CUDA the table is copied from pinned memory without
    blocking the host.
    """
    if not tensors:
        raise ValueError("build_table needs at least one tensor")
    dtype, device = tensors[0].dtype, tensors[0].device
    if dtype not in TL_DTYPES:
        raise TypeError(f"multi-tensor scale supports {', '.join(map(str, TL_DTYPES))}, not {dtype}")
    addresses, numels, left_out = [], [], []
    for i, t in enumerate(tensors):
        if t.dtype != dtype or t.device != device:
            raise ValueError(f"one launch scales tensors of one dtype and device: tensor {i} is {t.dtype} on "
                             f"{t.device}, tensor 0 is {dtype} on {device}")
        if t.numel() == 0:
            continue
        span = flat_span(t)
        if span is None:
            left_out.append(i)
            continue
        addresses.append(span.data_ptr())
        numels.append(span.numel())
    default_block, default_chunk = launch_config(numels, device.type)
    block = block or default_block
    chunk = chunk or max(block, default_chunk)
    if block & (block - 1) or chunk % block:
        raise ValueError(f"block must be a power of two and chunk a multiple of it; got block={block}, chunk={chunk}")
    programs = []
    for index, n in enumerate(numels):
        for first in range(0, n, chunk):
            programs += (index, first)
    table = host_to_device(addresses + numels + programs, torch.int64, device)
    return ScaleTable(table, tuple(addresses), tuple(numels), dtype, device, len(programs) // 2, block, chunk,
                      aligned=all(a % 16 == 0 for a in addresses), left_out=tuple(left_out))


def scale_(table: ScaleTable, coef: torch.Tensor, round_coef: bool = False, launch=None) -> None:
    """Multiply every tensor of `table` in place by the 0-dim tensor `coef`, in one launch; no host sync.

    table: from `build_table`; its tensors must still be alive and where they were when it was built.
    coef: a 0-dim float tensor on the table's device, read by the kernel (a coefficient >= 1 leaves the
    tensors untouched: no write). round_coef: round a coefficient of another dtype to the tensors' dtype
    first (CUDA torch's `mul_`; see the module docstring). Launches nothing when no tensor has elements.
    launch: launch(kernel, grid, args, meta) (fusedhooks passes runtime.launch); default kernel[grid](...).
    """
    if coef.dim() != 0 or coef.device != table.device or not coef.dtype.is_floating_point:
        raise ValueError(f"coef must be a 0-dim float tensor on {table.device}; got shape {tuple(coef.shape)}, "
                         f"{coef.dtype} on {coef.device}")
    if table.n_programs == 0:
        return
    options = {"enable_fp_fusion": False}  # nothing to fuse (one multiply); silences triton 3.9's warning
    if table.device.type == "cuda":
        options["num_warps"] = 8 if table.block >= 2048 else 4
    args = (table.table, coef, table.n_tensors)
    meta = dict(DTYPE=TL_DTYPES[table.dtype], ROUND_COEF=round_coef, ALIGNED=table.aligned, CHUNK=table.chunk,
                BLOCK=table.block, **options)
    if launch is None:
        scale_kernel[(table.n_programs,)](*args, **meta)
    else:
        launch(scale_kernel, (table.n_programs,), args, meta)


def multi_tensor_scale_(tensors: list[torch.Tensor], coef: torch.Tensor, round_coef: bool = False) -> None:
    """`tensors[i].mul_(coef)` for every tensor (one dtype, one device) in one launch (builds the table each
    call; cache `build_table`'s result to launch repeatedly). Tensors that are not dense are scaled by torch."""
    if not tensors:
        return
    table = build_table(tensors)
    scale_(table, coef, round_coef)
    for i in table.left_out:
        tensors[i].mul_(coef)
