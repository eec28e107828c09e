"""ZClip (arXiv 2504.02507): global-norm spike guard with EMA statistics kept on the device: `zclip`."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch.compiler import is_compiling

from ..api import GradHook
from . import clip, fold

MODES = ("zscore", "percentile")
CLIP_OPTIONS = ("adaptive_scaling", "mean")
ON_SPIKE = ("clip", "skip")
_MISSING = object()  # the optimizer had no `found_inf` attribute


class ZClip:
    """ZClip's rule (github.com/bluorion-com/ZClip, zclip/zclip.py) on the total 2-norm of the gradients `hook` is
    registered on, read from the norms it recorded during backward. With t the total norm at a step:

        warm-up (the first max(warmup_steps, 1) finite norms): t is recorded; when the last one is, mean = their
            mean and var = their population variance. The gradients are clipped as
            torch.nn.utils.clip_grad_norm_(max_grad_norm) would (not at all with max_grad_norm=None).
        afterwards:  std = sqrt(var)
            mode "zscore":      z = (t - mean) / (std + eps); a spike when z > z_thresh, clipped to
                                "adaptive_scaling": (mean + z_thresh * std / (z / z_thresh)) * clip_factor
                                "mean":             mean
            mode "percentile":  a spike when t > mean + z_thresh * std, clipped to that
            limit = min(the clip value on a spike, else t; max_grad_norm when given)
            coef = limit / (t + 1e-6) when t > limit, else 1          (every gradient is multiplied by coef)
            v = the clip value on a spike, else t
            mean = alpha * mean + (1 - alpha) * v;  var = alpha * var + (1 - alpha) * (v - mean)^2   (the new mean)
            (not on a spike with skip_update_on_spike=True)

    One deviation, so that one overflow (GradScaler's inf/NaN gradients) cannot disable the guard for good: a
    non-finite norm is not counted in the warm-up and a non-finite v leaves mean and var as they were (ZClip's code
    would make them NaN, after which it never clips again).

    on_spike="skip": a spike is not clipped; instead the optimizer's next step is skipped, through `found_inf` of
    torch's fused optimizers (Adam, AdamW, SGD, Adagrad with fused=True) or fh.AdamW / fh.SGD, which leave
    parameters and their state as they were where found_inf != 0. Skipping with any other optimizer would need a
    host sync: refused.

    The state (a device count, the warm-up norms, mean, var) is float64 tensors on the statistics' device, updated by
    torch ops: `step` makes no host sync. `spike`: a 0-dim bool tensor, was the last step a spike.
    """

    def __init__(self, hook: GradHook, alpha: float = 0.97, z_thresh: float = 2.5, warmup_steps: int = 25,
                 max_grad_norm: float | None = None, mode: str = "zscore", clip_option: str = "adaptive_scaling",
                 clip_factor: float = 1.0, skip_update_on_spike: bool = False, on_spike: str = "clip",
                 eps: float = 1e-6):
        if not isinstance(hook, GradHook):
            raise TypeError(f"fh.zclip takes the fusedhooks hook whose statistics give the norms (e.g. "
                            f"fh.grad_hook(stats=('norm',))), not {type(hook).__name__}")
        if "norm" not in hook.stats.slot_names and "sumsq" not in hook.stats.slot_names:
            raise ValueError(f"fh.zclip reads the per-parameter norms the hook records during backward, but "
                             f"{hook.__name__} records {list(hook.stats.slot_names) or 'no statistics'}: add 'norm' "
                             f"to its stats= (e.g. fh.grad_hook(stats=('norm',)))")
        _check_number("alpha", alpha, 0.0, 1.0)
        _check_number("z_thresh", z_thresh, 0.0, math.inf)
        _check_number("clip_factor", clip_factor, 0.0, math.inf)
        _check_number("eps", eps, 0.0, math.inf, low_ok=True)
        if max_grad_norm is not None:
            _check_number("max_grad_norm", max_grad_norm, 0.0, math.inf)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a whole number >= 0, got {warmup_steps!r}")
        for option, value, choices in (("mode", mode, MODES), ("clip_option", clip_option, CLIP_OPTIONS),
                                       ("on_spike", on_spike, ON_SPIKE)):
            if not isinstance(value, str) or value.lower() not in choices:
                raise ValueError(f"{option} must be one of {', '.join(map(repr, choices))}, got {value!r}")
        self.hook = hook
        self.alpha, self.z_thresh, self.eps = float(alpha), float(z_thresh), float(eps)
        self.warmup_steps = warmup_steps
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.mode, self.clip_option, self.on_spike = mode.lower(), clip_option.lower(), on_spike.lower()
        self.clip_factor = float(clip_factor)
        self.skip_update_on_spike = bool(skip_update_on_spike)
        device = hook.stats.device or "cpu"
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # finite warm-up norms recorded
        self.norms = torch.zeros(max(warmup_steps, 1), dtype=torch.float64, device=device)  # the warm-up norms
        self.mean = torch.full((), math.nan, dtype=torch.float64, device=device)  # NaN until the warm-up ends
        self.var = torch.full((), math.nan, dtype=torch.float64, device=device)
        self.spike = torch.zeros((), dtype=torch.bool, device=device)

    def step(self, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
        """Apply the rule to the gradients as they are now (after backward, before `optimizer.step()`); returns the
        total norm before clipping (0-dim, on the statistics' device, in the gradients' promoted dtype).

        optimizer: the optimizer that steps next. One of torch's fused optimizers (fused=True), fh.AdamW or fh.SGD gets
        the coefficient folded into its `grad_scale` (no pass over the gradients; fh.clip_grad_norm_(..., optimizer=opt)
        describes the conditions) and, with on_spike="skip", its `found_inf` set for that one step. Any other, or None:
        the gradients are scaled in place by one multi-tensor pass. No gradient at all: a float32 zero, state unchanged.
        """
        if is_compiling():
            raise RuntimeError("fh.zclip's guard.step() is not supported under torch.compile: call it outside the "
                               "compiled function (after backward, before optimizer.step())")
        fused = optimizer is not None and fold.folds_into(optimizer)
        if self.on_spike == "skip" and not fused:
            given = "no optimizer" if optimizer is None else f"{type(optimizer).__name__} without fused=True"
            raise ValueError(
                f"zclip(on_spike='skip') skips a spike's optimizer step on the device through the found_inf of torch's "
                f"fused optimizers; with {given} "
                f"skipping would need a host sync. Pass an optimizer built with fused=True (e.g. "
                f"torch.optim.AdamW(params, fused=True)) or fh.AdamW / fh.SGD to guard.step(optimizer=opt), or use "
                f"on_spike='clip'")
        stepped = False

        def coefficient(total_norm: torch.Tensor) -> torch.Tensor:
            nonlocal stepped
            stepped = True
            return self._update(total_norm)

        total_norm = clip.scale_by_total_norm_(self.hook, coefficient, optimizer=optimizer)
        if self.on_spike == "skip" and stepped:
            _arm_skip(optimizer, self.spike)
        return total_norm

    @torch.no_grad()
    def _update(self, total_norm: torch.Tensor) -> torch.Tensor:
        """Advance the state by one step with the total norm (0-dim); returns the coefficient (0-dim, float32, or
        float64 for a float64 total norm)."""
        if self.count.device != total_norm.device:
            self._to(total_norm.device)
        t = total_norm.to(torch.float64)
        finite = torch.isfinite(t)
        warm = self.count < self.norms.numel()

        # warm-up: record t; the step that records the last norm sets mean and var
        recorded = warm & finite
        slot = torch.arange(self.norms.numel(), device=t.device) == self.count
        self.norms.copy_(torch.where(slot & recorded, t, self.norms))
        self.count.add_(recorded.to(torch.int64))
        initialize = recorded & (self.count == self.norms.numel())
        warm_mean = self.norms.mean()
        warm_var = (self.norms - warm_mean).square().mean()

        # afterwards: ZClip's rule
        std = self.var.sqrt()
        if self.mode == "percentile":
            threshold = self.mean + self.z_thresh * std
            spike = t > threshold
        else:
            z = (t - self.mean) / (std + self.eps)
            spike = z > self.z_thresh
            if self.clip_option == "adaptive_scaling":
                threshold = (self.mean + self.z_thresh * std / (z / self.z_thresh)) * self.clip_factor
            else:
                threshold = self.mean
        spike = spike & ~warm
        clip_value = torch.where(spike, threshold, t)
        limit = t if self.on_spike == "skip" else clip_value  # a skipped step's gradients are left as they are
        if self.max_grad_norm is not None:
            limit = torch.clamp(limit, max=self.max_grad_norm)
        coef = torch.where(t > limit, limit / (t + 1e-6), 1.0)
        update = ~warm & torch.isfinite(clip_value)
        if self.skip_update_on_spike:
            update = update & ~spike
        mean = self.alpha * self.mean + (1 - self.alpha) * clip_value
        var = self.alpha * self.var + (1 - self.alpha) * (clip_value - mean).square()
        self.mean.copy_(torch.where(initialize, warm_mean, torch.where(update, mean, self.mean)))
        self.var.copy_(torch.where(initialize, warm_var, torch.where(update, var, self.var)))
        self.spike.copy_(spike)

        coef_dtype = torch.float64 if total_norm.dtype == torch.float64 else torch.float32
        if self.max_grad_norm is None:
            warm_coef = torch.ones((), dtype=coef_dtype, device=t.device)
        else:
            warm_coef = clip.clip_coefficient(total_norm, self.max_grad_norm).to(coef_dtype)
        return torch.where(warm, warm_coef, coef.to(coef_dtype))

    def _to(self, device: torch.device) -> None:
        for name in ("count", "norms", "mean", "var", "spike"):
            setattr(self, name, getattr(self, name).to(device))

    def state_dict(self) -> dict:
        """The state as tensors (copies, on their device) and warmup_steps, for `load_state_dict`."""
        return {"warmup_steps": self.warmup_steps, "count": self.count.clone(), "norms": self.norms.clone(),
                "mean": self.mean.clone(), "var": self.var.clone()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()` (onto this guard's device); its warmup_steps must be this guard's."""
        if state.get("warmup_steps") != self.warmup_steps:
            raise ValueError(f"this zclip state was saved with warmup_steps={state.get('warmup_steps')!r}, the "
                             f"guard has warmup_steps={self.warmup_steps}: build the guard with the same warmup_steps")
        for name in ("count", "norms", "mean", "var"):
            mine = getattr(self, name)
            setattr(self, name, state[name].detach().to(mine.device, mine.dtype).clone().reshape(mine.shape))

    def __repr__(self) -> str:
        return (f"ZClip(alpha={self.alpha}, z_thresh={self.z_thresh}, warmup_steps={self.warmup_steps}, "
                f"max_grad_norm={self.max_grad_norm}, mode={self.mode!r}, clip_option={self.clip_option!r}, "
                f"clip_factor={self.clip_factor}, skip_update_on_spike={self.skip_update_on_spike}, "
                f"on_spike={self.on_spike!r})")


def zclip(hook: GradHook, alpha: float = 0.97, z_thresh: float = 2.5, warmup_steps: int = 25,
          max_grad_norm: float | None = None, mode: str = "zscore", clip_option: str = "adaptive_scaling",
          clip_factor: float = 1.0, skip_update_on_spike: bool = False, on_spike: str = "clip",
          eps: float = 1e-6) -> ZClip:
    """A ZClip spike guard over the parameters `hook` is registered on (`hook` must record "norm"); call
    `guard.step(optimizer)` after each backward. See ZClip for the rule."""
    return ZClip(hook, alpha, z_thresh, warmup_steps, max_grad_norm, mode, clip_option, clip_factor,
                 skip_update_on_spike, on_spike, eps)


def _check_number(option: str, value, low: float, high: float, low_ok: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        low <= value if low_ok else low < value) and value < high  # NaN fails both
    if not ok:
        bounds = f"{'[' if low_ok else '('}{low:g}, {high:g})"
        raise ValueError(f"{option} must be a number in {bounds}, got {value!r}")


@dataclass
class _Skip:
    """A spike flag waiting for the optimizer's next step, and what that step's pre-hook replaced."""

    found_inf: torch.Tensor  # 0-dim float32: 1 on a spike
    installed: torch.Tensor | None = None  # what the pre-hook set optimizer.found_inf to
    previous: object = _MISSING  # optimizer.found_inf before that (GradScaler.step sets its own)


#: optimizer -> its pending skip flag (None once consumed); an optimizer is in it once its step hooks are registered
_skips: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Skip | None] = weakref.WeakKeyDictionary()


def _arm_skip(optimizer: torch.optim.Optimizer, spike: torch.Tensor) -> None:
    """Have the optimizer's next step skip where `spike` (0-dim bool) is true, through its found_inf."""
    if optimizer not in _skips:
        optimizer.register_step_pre_hook(_step_begins)
        optimizer.register_step_post_hook(_after_step)
    pending = _skips.get(optimizer)
    if pending is not None and pending.installed is not None:  # left by a step that raised
        _restore(optimizer, pending)
    _skips[optimizer] = _Skip(spike.to(torch.float32))
    if optimizer in _stepping:  # inside the step (its closure, as Lightning runs it): its pre-hook has run already
        _before_step(optimizer, (), {})


def _restore(optimizer: torch.optim.Optimizer, pending: _Skip) -> None:
    _skips[optimizer] = None
    if optimizer.__dict__.get("found_inf") is not pending.installed:
        return
    if pending.previous is _MISSING:
        del optimizer.found_inf
        if optimizer.__dict__.get("grad_scale", _MISSING) is None:
            # a step post-hook that ran before this one (fold's) took our found_inf for GradScaler.step's, which
            # deletes both attributes afterwards, and left grad_scale None for it; no GradScaler is stepping
            del optimizer.grad_scale
    else:
        optimizer.found_inf = pending.previous


#: optimizers whose step is running (between its pre- and post-hook): a guard stepped in its closure arms this step
_stepping: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def _step_begins(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    _stepping.add(optimizer)
    _before_step(optimizer, args, kwargs)


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    pending = _skips.get(optimizer)
    if pending is None:
        return
    if pending.installed is not None:  # armed for a step that raised: not for this one
        _restore(optimizer, pending)
        return
    present = optimizer.__dict__.get("found_inf")
    found_inf = pending.found_inf if present is None else torch.maximum(
        present.to(pending.found_inf.device, torch.float32), pending.found_inf).to(present.device)
    pending.previous = _MISSING if "found_inf" not in optimizer.__dict__ else present
    pending.installed = optimizer.found_inf = found_inf


def _after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    _stepping.discard(optimizer)
    pending = _skips.get(optimizer)
    if pending is not None and pending.installed is not None:
        _restore(optimizer, pending)
