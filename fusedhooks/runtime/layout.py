"""Memory layouts: which tensors a kernel can process as one flat span of storage, and which are sharded."""

from __future__ import annotations

import sys

import torch


def flat_span(t: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view of `t`'s storage span when `t` is non-overlapping and dense (any dim order), else None.

    Elementwise bodies and whole-tensor reductions do not depend on element order, so such a tensor is
    processed as its span: [data_ptr, data_ptr + numel) in elements.
    """
    if t.is_contiguous():
        return t.view(-1)
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def static(t: torch.Tensor) -> torch.Tensor:
    """`t`, marked for torch.compile as a tensor that keeps its address between calls (what a traced firing writes:
    CUDA graphs then write it in place rather than copying it in and out); on CPU as it is."""
    if t.is_cuda:
        torch._dynamo.mark_static_address(t)
    return t


def is_dtensor(t) -> bool:
    """Is `t` a DTensor (an FSDP2-sharded parameter or its gradient)? Imports nothing: no DTensor exists before
    torch.distributed.tensor is imported."""
    if type(t) is torch.Tensor:  # the common case, decided without a lookup
        return False
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)
