"""GradScaler's unscale made visible to version counters.

`GradScaler.unscale_(optimizer)` multiplies every gradient by 1/scale in place with
`torch._amp_foreach_non_finite_check_and_unscale_`, which does not bump the gradients' version counters. A
statistics row that measured the scaled gradient would then still look current to `fh.clip_grad_norm_`, which
would clip by a norm `scale` times too large. The first hook recording statistics (`install()`, from GradHook;
importing fusedhooks patches nothing in torch) wraps `_unscale_grads_` of GradScaler and of
its subclasses (FSDP's ShardedGradScaler, defined later) so that the gradients it unscaled have their versions
bumped afterwards, as any in-place op bumps them: nothing else changes.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.amp import GradScaler
from torch.autograd.graph import increment_version

_WRAPPED = "__fusedhooks_bumps_versions__"
_installed = False


def bump_versions(optimizer: torch.optim.Optimizer) -> None:
    """Bump the version of every dense gradient of `optimizer`'s parameters (of a DTensor's, its local shard's too)."""
    grads = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None or grad.layout != torch.strided:
                continue
            grads.append(grad)
            local = getattr(grad, "_local_tensor", None)
            if local is not None:
                grads.append(local)
    if grads:
        increment_version(grads)


def _wrap(cls: type) -> None:
    """Wrap `cls._unscale_grads_` (if `cls` defines it) so that it bumps the versions of what it unscaled."""
    unscale = cls.__dict__.get("_unscale_grads_")
    if unscale is None or getattr(unscale, _WRAPPED, False):
        return

    @functools.wraps(unscale)
    def _unscale_grads_(self, optimizer, *args, **kwargs):
        try:
            return unscale(self, optimizer, *args, **kwargs)
        finally:
            bump_versions(optimizer)

    setattr(_unscale_grads_, _WRAPPED, True)
    cls._unscale_grads_ = _unscale_grads_


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def install() -> None:
    """Wrap GradScaler, its subclasses defined so far and those defined from now on (once)."""
    global _installed
    if _installed:
        return
    _installed = True
    for cls in (GradScaler, *_subclasses(GradScaler)):
        _wrap(cls)

    def __init_subclass__(cls, **kwargs):
        super(GradScaler, cls).__init_subclass__(**kwargs)
        _wrap(cls)

    GradScaler.__init_subclass__ = classmethod(__init_subclass__)


class BackwardBooks:
    """What the firings of one backward found for a GradScaler: found_inf per device, written into the scaler's
    books (`_per_optimizer_states[id(optimizer)]`: stage UNSCALED, found_inf_per_device) only when the backward
    ends normally. Queued as that backward's end-of-backward callback, which holds it: a backward that raises drops
    it, and the books stay as they were, as torch's recipe never reaches `scaler.unscale_` in a failed iteration."""

    __slots__ = ("state", "found", "unscaled", "__weakref__")

    def __init__(self, state: dict):
        self.state = state
        self.found: dict[torch.device, torch.Tensor] = {}
        #: (hook key, statistics row) -> weak reference to the gradient tensor it unscaled
        self.unscaled: dict[tuple[int, int], weakref.ref] = {}

    def __call__(self) -> None:
        commit(self.state, self.found, self.unscaled)


def commit(state: dict, found: dict[torch.device, torch.Tensor], unscaled: dict[tuple[int, int], weakref.ref]) -> None:
    """Mark the optimizer of `state` as unscaled by fusedhooks, its found_inf per device summed with `found`'s, and
    the gradients `unscaled` ((hook key, row) -> the gradient tensor) as unscaled until scaler.update() (which
    replaces `state`)."""
    from torch.amp.grad_scaler import OptState

    state["stage"] = OptState.UNSCALED
    state["fusedhooks"] = True
    state.setdefault("fusedhooks_unscaled", {}).update(unscaled)
    books = state["found_inf_per_device"]
    for device, value in found.items():
        kept = books.get(device)
        if kept is None:
            books[device] = value
        elif kept is not value:
            kept.add_(value)
