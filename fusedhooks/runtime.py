"""Running a plan on a gradient: backend choice, block sizes and grids, workspaces, layouts."""

from __future__ import annotations

import os

import torch

from . import reference
from .plan import Plan

#: Partial-statistics rows the last program merges at a time.
RBLOCK = 256
#: Elements per program on a GPU (largest) and under the interpreter (largest; its cost is per program).
GPU_MAX_BLOCK = 4096
INTERPRET_MAX_BLOCK = 1 << 15


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def choose_backend(device: torch.device, requested: str | None = None) -> str:
    """"triton" or "reference" for gradients on `device`.

    requested (or FUSEDHOOKS_BACKEND): "auto" (default: Triton on CUDA, and on CPU under TRITON_INTERPRET=1;
    the eager reference otherwise), "triton" or "reference".
    """
    requested = requested or os.environ.get("FUSEDHOOKS_BACKEND") or "auto"
    if requested not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', not {requested!r}")
    if requested == "reference":
        return "reference"
    triton_ok = device.type == "cuda" or (device.type == "cpu" and interpreting())
    if requested == "triton" and not triton_ok:
        raise RuntimeError(f"the triton backend runs on CUDA tensors, or on CPU tensors with TRITON_INTERPRET=1; "
                           f"got a {device.type} tensor")
    return "triton" if triton_ok else "reference"


def launch_config(numel: int, device_type: str) -> tuple[int, int]:
    """(BLOCK, grid) for a gradient of `numel` elements. FUSEDHOOKS_BLOCK (a power of two) overrides BLOCK."""
    override = os.environ.get("FUSEDHOOKS_BLOCK")
    if override:
        block = int(override)
        if block < 16 or block & (block - 1):
            raise ValueError(f"FUSEDHOOKS_BLOCK must be a power of two >= 16, not {override}")
    else:
        cap = GPU_MAX_BLOCK if device_type == "cuda" else INTERPRET_MAX_BLOCK
        block = min(cap, max(128, 1 << max(numel - 1, 1).bit_length()))
    return block, -(-numel // block)


def flat_span(t: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view of `t`'s storage span when `t` is non-overlapping and dense (any dim order), else None."""
    if t.is_contiguous():
        return t.view(-1)
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


class Workspace:
    """Per-device scratch of a hook, reused by every firing (stream-ordered, so no clashes):
    partial statistics, the programs-finished counter, body reduction results, histogram accumulators."""

    def __init__(self, device: torch.device):
        self.device = device
        self.partials = torch.empty(0, dtype=torch.float64, device=device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.reduced = torch.empty(0, dtype=torch.float64, device=device)
        self.hist = torch.zeros(0, dtype=torch.int32, device=device)

    def partials_for(self, rows: int) -> torch.Tensor:
        if self.partials.numel() < rows * 8:
            self.partials = torch.empty(rows * 8, dtype=torch.float64, device=self.device)
        return self.partials

    def reduced_for(self, n: int) -> torch.Tensor:
        if self.reduced.numel() < n:
            self.reduced = torch.empty(n, dtype=torch.float64, device=self.device)
        return self.reduced

    def hist_for(self, n: int) -> torch.Tensor:
        if self.hist.numel() < n:
            self.hist = torch.zeros(n, dtype=torch.int32, device=self.device)  # the kernels leave it zeroed
        return self.hist


def launch(kernel, grid: tuple, *args, **meta) -> None:
    """Every kernel launch of fusedhooks goes through here (tests count launches by wrapping it)."""
    kernel[grid](*args, **meta)


def kernels_for(plan: Plan, module, grid: int) -> list:
    """The kernels of `module` (generated for `plan`) to launch, in order, on a grid of `grid` programs."""
    if plan.levels == 0:
        return [module.fused_hook]
    if grid == 1:
        return [module.fused_hook_single]
    return [getattr(module, f"reduce_level{level}") for level in range(1, plan.levels + 1)] + [module.fused_hook]


def fire(plan: Plan, module, grad: torch.Tensor, param: torch.Tensor, scalars: list[torch.Tensor],
         stats_row: torch.Tensor | None, workspace: Workspace, amp: tuple | None = None) -> None:
    """Apply `plan` to `grad` in place and record its statistics into `stats_row`; no host sync.

    module: the generated kernels (None for the reference backend); amp: (scale, found_inf) tensors
    when the hook unscales for a GradScaler. An empty gradient launches no kernel: its statistics
    (count 0, sum 0, mean NaN, ...) are written by the reference backend.
    """
    numel = grad.numel()
    if plan.backend == "reference" or numel == 0:
        reference.run(plan, grad, param, scalars, stats_row, amp)
        return
    uses_param = plan.graph.uses_param
    span = flat_span(grad)
    work = span
    if span is None or (uses_param and param.stride() != grad.stride()):
        work = grad.contiguous().view(-1)
        pspan = param.contiguous().view(-1) if uses_param else None
    else:
        pspan = flat_span(param) if uses_param else None
    block, grid = launch_config(numel, grad.device.type)
    args = [work]
    if uses_param:
        args.append(pspan)
    args.extend(scalars)
    if plan.amp:
        args.extend(amp)
    n_reductions = len(plan.graph.reductions())
    if n_reductions:
        args.append(workspace.reduced_for(n_reductions))
    if plan.slots:
        args.append(stats_row)
    if n_reductions or plan.slots:
        args += [workspace.partials_for(grid * max(2, n_reductions)), workspace.counter]
    if plan.hist_range:
        args.append(workspace.hist_for(2 * (1 << plan.hist_bins.bit_length())))
    options = {"enable_fp_fusion": False}
    if grad.device.type == "cuda":
        options["num_warps"] = 8 if block >= 2048 else 4
    for kernel in kernels_for(plan, module, grid):
        launch(kernel, (grid,), *args, numel, BLOCK=block, RBLOCK=RBLOCK, **options)
    if (plan.graph.writes or plan.amp) and work is not span and work.data_ptr() != grad.data_ptr():
        grad.copy_(work.view(grad.shape))
