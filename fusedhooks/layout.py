"""Memory layouts: which tensors a kernel can process as one flat span of storage."""

from __future__ import annotations

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
