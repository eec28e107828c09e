"""What the training-framework callbacks share: their options, the global clip and the logged scalars."""

from __future__ import annotations

import math

import torch

from ..api import GradHook
from ..clipping.clip import clip_grad_norm_
from ..clipping.zclip import ZClip
from ..stats.buffer import ScalarSelection, scalars_of


class StepCallbackBase:
    """A hook run once per optimizer step by a framework's callback: `max_grad_norm` (clip by the global norm from
    the norms the hook recorded), `log_every` (optimizer steps between logs; None: `default_cadence`, the
    framework's own), `prefix` of the logged keys, `norm_type` of the clip; `stats`, `params`, `top_k`: what is
    logged, as in `hook.stats.to_scalars`; with none of them, a summary of as many keys for any model
    (`to_scalars(summary=True)`: the global norm, the largest absmax and its parameter, NaN/Inf totals, how many
    gradients the body shrank); `params="*"` logs every statistic of every parameter; `spike_guard`: an
    `fh.zclip(hook, ...)` guard that
    clips (or skips the step) at each optimizer step instead of `max_grad_norm` (its own max_grad_norm= caps it).
    Either way, a fused optimizer gets the coefficient folded into its step (no pass over the gradients)."""

    default_cadence = "the framework's logging steps"

    def __init__(self, hook: GradHook, max_grad_norm: float | None = None, log_every: int | None = None,
                 prefix: str = "grad/", norm_type: float = 2.0, stats=None, params=None, top_k: int | None = None,
                 spike_guard: ZClip | None = None):
        if not isinstance(hook, GradHook):
            raise TypeError(f"FusedHooksCallback takes a fusedhooks hook (fh.grad_hook(...)), "
                            f"not {type(hook).__name__}")
        if spike_guard is not None:
            if not isinstance(spike_guard, ZClip):
                raise TypeError(f"spike_guard= takes a guard made by fh.zclip(hook, ...), not "
                                f"{type(spike_guard).__name__}")
            if spike_guard.hook is not hook:
                raise ValueError("spike_guard= reads the norms of the callback's own hook: make it with "
                                 "fh.zclip(hook, ...) of the hook given to this callback")
            if max_grad_norm is not None:
                raise ValueError("pass max_grad_norm= or spike_guard=, not both: the guard clips itself (cap it "
                                 "with fh.zclip(hook, ..., max_grad_norm=...))")
        if max_grad_norm is not None:
            if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or \
                    not 0 < max_grad_norm < math.inf:
                raise ValueError(f"max_grad_norm= takes a finite number > 0 (None: no clipping), not {max_grad_norm!r}")
            if "norm" not in hook.stat_names:
                raise ValueError("max_grad_norm= clips from the norms the hook records: create the hook with "
                                 "\"norm\" among its stats (fh.grad_hook(..., stats=(\"norm\", ...)))")
        if log_every is not None and (isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1):
            raise ValueError(f"log_every= takes a number of optimizer steps >= 1 (None: {self.default_cadence}), "
                             f"not {log_every!r}")
        summary = stats is None and params is None and top_k is None
        self.selection = ScalarSelection(stats, params, top_k, summary=summary)
        self.selection.check_stats(hook.stats.slot_names)
        self.hook, self.max_grad_norm, self.log_every = hook, max_grad_norm, log_every
        self.spike_guard = spike_guard
        self.prefix, self.norm_type = prefix, norm_type
        self.total_norm = None  # the last global norm of fh.clip_grad_norm_ (0-dim tensor), before clipping
        self._handle = None  # the hook's registration while training

    @property
    def clips(self) -> bool:
        """Does the callback clip at each optimizer step (max_grad_norm= or spike_guard=)?"""
        return self.max_grad_norm is not None or self.spike_guard is not None

    def clip(self, optimizer=None):
        """fh.clip_grad_norm_ by max_grad_norm now, or the spike guard's step; the total norm before clipping (0-dim
        tensor). `optimizer`: the torch optimizer whose step comes next: a fused one (`fold.folds_into`) gets the
        coefficient folded into its grad_scale (no pass over the gradients: its step divides them); any other, or
        None: scaled in place."""
        if optimizer is not None and any(p.grad is not None and p.grad.dtype == torch.float64
                                         for group in optimizer.param_groups for p in group["params"]):
            optimizer = None  # a fused step reads grad_scale as float32: float64 gradients are scaled in place
        if self.spike_guard is not None:
            self.total_norm = self.spike_guard.step(optimizer)
        else:
            self.total_norm = clip_grad_norm_(self.hook, self.max_grad_norm, norm_type=self.norm_type,
                                              optimizer=optimizer)
        return self.total_norm

    def register(self, model, when) -> None:
        """Register the hook on `model` (at training's start) with `when=`; then refuse (unregistered again) a
        `params` pattern that matches none of the hook's parameters."""
        self._handle = self.hook.register(model, when=when)
        try:
            self.selection.check(self.hook.stats.slot_names, self.hook.stats.names)
        except ValueError:
            self.remove()
            raise

    def scalars(self) -> dict:
        """The statistics to log (one sync): `hook.stats.to_scalars(prefix, stats, params, top_k)`, and the total
        norm when it clips (the clip's, over every registered gradient, replaces top_k's `total_norm`)."""
        scalars = scalars_of(self.hook.stats.read(), self.prefix, self.selection)
        if self.total_norm is not None:
            scalars[f"{self.prefix}total_norm"] = self.total_norm.item()
        return scalars

    def remove(self) -> None:
        """Unregister the hook (at the end of training)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
