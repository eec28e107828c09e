"""A global clip coefficient folded into a fused optimizer's `grad_scale`, consumed by its next step.

torch's fused Adam, AdamW, SGD and Adagrad (`fused=True`) divide every gradient by `optimizer.grad_scale` (a
float32 device tensor) inside their step kernel, and write the divided gradient back into `.grad`; fh.AdamW and
fh.SGD divide it the same way and write nothing back. Setting `grad_scale = previous / coef` therefore clips
without a pass over the gradients. GradScaler.step keeps a `grad_scale` it finds when the optimizer is already
unscaled, multiplies its own scale in otherwise, and deletes the attribute (and `found_inf`) after the step: the
fold composes with it either way.

One fold per optimizer at a time, consumed by exactly one step: a step pre-hook marks it as taken, a step
post-hook puts back what `grad_scale` was before (registered once per optimizer). A fold made during a step (by the
closure the step runs, where Lightning's automatic optimization clips) is read by that step, which reads `grad_scale`
after its closure: the post-hook takes it as consumed too. A step that raises never reaches
the post-hook: its fold is undone by the next step's pre-hook or the next fold, before anything reads it again.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..firing import amp

#: torch's optimizers whose fused step honours `grad_scale` and `found_inf` (fh.AdamW and fh.SGD subclass two)
FUSED_TYPES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)

_MISSING = object()  # `optimizer.grad_scale` was not set


def folds_into(optimizer) -> bool:
    """Does `fh.clip_grad_norm_(..., optimizer=optimizer)` fold the coefficient into `optimizer.grad_scale`? For one
    of FUSED_TYPES whose step reads it (`_step_supports_amp_scaling`, GradScaler's flag: torch's with fused=True,
    fh.AdamW and fh.SGD)."""
    return isinstance(optimizer, FUSED_TYPES) and bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _writes_back(optimizer: torch.optim.Optimizer) -> bool:
    """Does the optimizer's step write the divided gradients back into `.grad` (torch's fused steps do)?"""
    return bool(optimizer.defaults.get("fused"))


def target(optimizer, option: str) -> torch.optim.Optimizer | None:
    """The optimizer a clip given `optimizer` folds into (see `folds_into`), or None when it scales the gradients in
    place; anything but None or an optimizer is refused (`option`: the argument as the caller names it)."""
    if optimizer is None:
        return None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{option} takes a torch.optim.Optimizer, not {type(optimizer).__name__}")
    return optimizer if folds_into(optimizer) else None


@dataclass
class _Fold:
    folded: torch.Tensor  # 0-dim float32: what optimizer.grad_scale was set to
    previous: object  # optimizer.grad_scale before the fold (a tensor), or _MISSING
    grads: list[tuple[weakref.ref, weakref.ref, int]]  # (parameter, its .grad, the .grad's version) when folded
    stepping: bool = False  # a step began with it (pre-hook) and has not ended (post-hook)

    def current(self) -> bool:
        """Are the gradients the fold was computed for still the parameters' gradients, unchanged?"""
        for param_ref, grad_ref, version in self.grads:
            param, grad = param_ref(), grad_ref()
            if param is None or grad is None or param.grad is not grad or grad._version != version:
                return False
        return True


#: optimizer -> its pending fold (None once consumed); an optimizer is in it once its step hooks are registered
_folds: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Fold | None] = weakref.WeakKeyDictionary()


def check(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """Refuse a fold into `optimizer` of the coefficient of `params`' gradients `grads` (before anything is computed
    from them: a refusal leaves every state as it was)."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"] if p.grad is not None}
    if stepped != {id(p) for p in params}:
        raise ValueError(
            f"clip_grad_norm_(optimizer=...) folds the clip coefficient into the optimizer's grad_scale, which divides "
            f"every gradient it steps: the optimizer must step exactly the parameters the hook clips (it steps "
            f"{len(stepped)} with a .grad, the hook clips {len(params)}). Register the hook on the optimizer's "
            f"parameters, or pass optimizer=None to scale the gradients in place")
    if any(g.dtype == torch.float64 for g in grads):
        raise ValueError("clip_grad_norm_(optimizer=...) folds the clip coefficient into the optimizer's grad_scale, "
                         "which its step reads as float32: with float64 gradients pass optimizer=None to scale them "
                         "in place (in float64, as torch does)")


def fold(optimizer: torch.optim.Optimizer, coef: torch.Tensor, params: list[torch.Tensor],
         grads: list[torch.Tensor]) -> None:
    """Set `optimizer.grad_scale` to (its value so far, or 1) / coef for its next step (`coef`: the 0-dim clip
    coefficient; `params`, `grads`: the clipped parameters and their gradients, exactly those the optimizer steps,
    as `check` found them before the coefficient was computed). Device ops only: no host sync."""
    if optimizer not in _folds:
        optimizer.register_step_pre_hook(_before_step)
        optimizer.register_step_post_hook(_after_step)
    pending = _folds.get(optimizer)
    if pending is not None:
        if not pending.stepping and pending.current():
            raise RuntimeError("clip_grad_norm_(optimizer=...) has already folded a clip coefficient into the "
                               "optimizer's grad_scale for these gradients, and the next optimizer step applies it: "
                               "clip once per step")
        _undo(optimizer, pending)  # of a step that raised, or of gradients never stepped (the iteration was dropped)
    previous = optimizer.__dict__.get("grad_scale")  # None: what GradScaler.step leaves after a step that raised
    previous = _MISSING if previous is None else previous
    reciprocal = coef.to(torch.float32).reciprocal()
    folded = reciprocal if previous is _MISSING else previous.to(reciprocal.device) * reciprocal
    optimizer.grad_scale = folded
    _folds[optimizer] = _Fold(folded, previous, [(weakref.ref(p), weakref.ref(g), g._version)
                                                 for p, g in zip(params, grads)])


def _undo(optimizer: torch.optim.Optimizer, pending: _Fold) -> None:
    """Put back `optimizer.grad_scale` as it was before `pending` was folded in."""
    _folds[optimizer] = None
    if pending.previous is not _MISSING:
        optimizer.grad_scale = pending.previous
    elif "found_inf" in optimizer.__dict__:  # GradScaler.step is stepping: it deletes both attributes afterwards
        optimizer.grad_scale = None
    else:
        optimizer.__dict__.pop("grad_scale", None)


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    pending = _folds.get(optimizer)
    if pending is None:
        return
    if not pending.stepping and pending.current():
        pending.stepping = True
        return
    seen = optimizer.__dict__.get("grad_scale", _MISSING)
    _undo(optimizer, pending)
    if not pending.stepping:
        raise RuntimeError("the gradients changed between fh.clip_grad_norm_(..., optimizer=opt) and opt.step() (a "
                           "new backward, or an in-place edit): the clip coefficient folded into opt.grad_scale "
                           "was computed for the gradients as they were, so it was dropped and this step refused. "
                           "Clip right before the step, or pass optimizer=None to scale the gradients in place")
    if seen is not pending.folded and seen is not pending.previous and seen is not _MISSING:
        raise RuntimeError("the clip coefficient fh.clip_grad_norm_(..., optimizer=opt) folded into opt.grad_scale "
                           "for a step that raised was multiplied into the grad_scale of this step (by "
                           "GradScaler.step of scaled gradients): this step is refused. Call scaler.unscale_(opt) "
                           "or fh.clip_grad_norm_(..., optimizer=opt) again before stepping")


def _after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    pending = _folds.get(optimizer)
    if pending is None:  # a pending fold the pre-hook did not mark was made in this step's closure: read too
        return
    if _writes_back(optimizer):
        amp.bump_versions(optimizer)  # the fused step divided the gradients in place without bumping their versions
    _undo(optimizer, pending)
