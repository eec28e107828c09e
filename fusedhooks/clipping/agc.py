"""Unit-wise adaptive gradient clipping (AGC; Brock et al. 2021, "High-Performance Large-Scale Image Recognition
Without Normalization"), as timm's `adaptive_clip_grad` defines it, as a fusedhooks hook."""

from __future__ import annotations

import math

import torch

from ..api import GradHook
from ..compiler.trace import TracedBody, trace


def agc_body(rank: int, clip_factor: float, eps: float):
    """timm's AGC for a gradient of `rank` dimensions: each unit (output row: all dimensions but the first; the
    whole tensor for rank <= 1) is scaled down to at most `clip_factor` times its parameter's norm (at least eps).
    A 1-d tensor's norm is taken over dim 0 with keepdim (the same value): every rank >= 1 then has one unit kind,
    one span each, and the Triton backend runs them all with one kernel (a bucket of any shapes: one launch)."""
    dims = tuple(range(1, rank)) if rank > 1 else (0,) if rank == 1 else None

    def unitwise_norm(x):
        return x.norm(2.0) if dims is None else x.norm(2.0, dim=dims, keepdim=True)

    def agc(grad, param):
        p_norm = unitwise_norm(param).clamp(min=eps)
        g_norm = unitwise_norm(grad)
        max_norm = p_norm * clip_factor
        clipped = grad * (max_norm / g_norm.clamp(min=1e-6))
        return torch.where(g_norm < max_norm, grad, clipped)

    agc.__name__ = "agc"
    return agc


class UnitwiseClip(GradHook):
    """`fh.agc(...)`: a GradHook whose body (`agc_body`) depends on the gradient's rank."""

    body_per_shape = True  # lowered for each shape (the body differs by rank)

    def __init__(self, clip_factor: float = 0.01, eps: float = 1e-3, **options):
        for name, value in (("clip_factor", clip_factor), ("eps", eps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"agc: {name}= takes a finite number > 0, not {value!r}")
        self.clip_factor, self.eps = float(clip_factor), float(eps)
        self._bodies: dict[int, TracedBody] = {}
        super().__init__(agc_body(2, self.clip_factor, self.eps), **options)

    def _body_for(self, shape: tuple | None) -> TracedBody:
        rank = len(shape) if shape is not None else 2
        body = self._bodies.get(rank)
        if body is None:
            body = self._bodies[rank] = trace(agc_body(rank, self.clip_factor, self.eps))
        return body


def agc(clip_factor: float = 0.01, eps: float = 1e-3, **options) -> UnitwiseClip:
    """Unit-wise adaptive gradient clipping as timm defines it (`timm.utils.agc.adaptive_clip_grad`): for each
    parameter p with gradient g, and each unit u of it (an output row: all dimensions but the first; the whole
    tensor for 1-d and 0-d parameters), g_u is scaled to clip_factor * max(||p_u||, eps) / max(||g_u||, 1e-6) * g_u
    where ||g_u|| >= clip_factor * max(||p_u||, eps), and left as it is elsewhere.

    options: grad_hook's (stats=, input_stats=, backend=, hist_range=); register it like any hook
    (`fh.agc(0.01).register(model)`)."""
    return UnitwiseClip(clip_factor, eps, **options)
