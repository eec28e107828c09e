"""Lightning (`lightning.pytorch`): `FusedHooksCallback` registers a hook on the LightningModule, runs it once per
optimizer step (on the accumulated gradient), clips by the global norm from the norms it recorded, and logs its
statistics with `pl_module.log_dict`.

Needs `lightning` (`pip install fusedhooks[lightning]`).
"""

from __future__ import annotations

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_warn

from .common import StepCallbackBase


class FusedHooksCallback(StepCallbackBase, Callback):
    """Run `hook` inside a `lightning.pytorch.Trainer`.

    - At `fit()`'s start the hook is registered on the LightningModule (`register(pl_module)`: each gradient
      processed at its own firing), and removed at its end (also when it raises).
    - Gradient accumulation (`Trainer(accumulate_grad_batches=n)`): the hook runs only in the backward of the batch
      after which Lightning steps the optimizer (Lightning's own rule: every n-th batch and the epoch's last one),
      so clipping and statistics see the accumulated gradient once. With manual optimization
      (`automatic_optimization = False`) it runs at every backward: pause it yourself (`hook.paused()`); there
      `max_grad_norm` clips before each `opt.step()`, and is refused with several optimizers (one global norm over
      every registered gradient would clip the other optimizers' gradients too).
    - `max_grad_norm`: clips every gradient by their global norm with `fh.clip_grad_norm_` (from the norms the
      hook recorded: the hook must record `"norm"`) in `on_before_optimizer_step`, just before the point where
      Lightning clips for `gradient_clip_val`; the result equals `Trainer(gradient_clip_val=max_grad_norm)`
      (`gradient_clip_algorithm="norm"`). Leave Trainer's `gradient_clip_val` unset (refused: it would clip twice).
      The global norm counts every gradient the hook is registered on, Lightning's the optimizer's parameters: the
      same set unless some parameters that require grad are in no optimizer (warned at `fit()`'s start). With a
      fused optimizer (torch's Adam, AdamW, SGD or Adagrad with `fused=True`) the clip makes no pass over the
      gradients: the coefficient is folded into the optimizer's `grad_scale` and its step divides them (hooks that
      run before the step, the module's `on_before_optimizer_step` included, see them unclipped, as with
      gradient_clip_val, which clips after that hook).
    - Logging: `hook.stats.to_scalars(prefix, stats, params, top_k)` (`grad/<parameter>/<statistic>`: the gradient
      as the hook left it, before the global clip; the options select what, as in `to_scalars`; a `params` pattern
      matching no parameter is refused at `fit()`'s start), and `grad/total_norm` (before clipping) when it clips,
      through `pl_module.log_dict(on_step=True)` in `on_before_optimizer_step`: read on the steps where Lightning
      writes to its loggers (`log_every_n_steps`) when `log_every` is None, else every `log_every` optimizer steps
      (Lightning still writes its loggers at its own cadence, repeating the last values logged in between, as for
      any value logged on some steps only). Reading the statistics costs one device sync per logged step, none
      otherwise; the values are logged as float64 CPU tensors, so Lightning neither copies them to the device nor
      reads them back.
    - Precision: `32-true`, `64-true`, `bf16-mixed`, `bf16-true` and `16-true` (the same results as
      gradient_clip_val). `16-mixed` is refused: its GradScaler unscales the gradients only after backward, so the
      hook would see scaled gradients (use bf16-mixed, or a hook with scaler= in a plain loop). Strategies that
      accumulate gradients themselves (DeepSpeed) are refused. One process: under DDP the hook would see each
      rank's local gradient (fusedhooks warns).
    """

    default_cadence = "the Trainer's log_every_n_steps"

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.clips and trainer.gradient_clip_val:
            raise ValueError(f"FusedHooksCallback(max_grad_norm={self.max_grad_norm}, spike_guard="
                             f"{self.spike_guard is not None}) clips the gradients, and "
                             f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) would clip them again: leave "
                             "gradient_clip_val unset")
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise ValueError(f"FusedHooksCallback does not support precision={trainer.precision!r}: its GradScaler "
                             "unscales the gradients after backward, so the hook would process scaled gradients; "
                             "use precision='bf16-mixed' (no scaler) or 32-bit")
        if trainer.strategy.handles_gradient_accumulation:
            raise ValueError(f"FusedHooksCallback does not support strategy {type(trainer.strategy).__name__}: it "
                             "accumulates gradients itself, outside Lightning's loop, so the callback cannot tell "
                             "which backward completes an optimizer step")
        if self.clips:
            if not pl_module.automatic_optimization and len(trainer.optimizers) > 1:
                raise ValueError(f"FusedHooksCallback(max_grad_norm={self.max_grad_norm}) clips every gradient the "
                                 "hook is registered on by one global norm, at each optimizer step: with manual "
                                 f"optimization and {len(trainer.optimizers)} optimizers, each opt.step() would "
                                 "clip the other optimizers' gradients too, and by their norm (Lightning refuses "
                                 "gradient_clip_val with manual optimization): leave max_grad_norm unset and clip "
                                 "in training_step before each opt.step(), e.g. self.clip_gradients(opt, "
                                 "gradient_clip_val=..., gradient_clip_algorithm='norm')")
            _warn_unoptimized(trainer, pl_module)
        if self._handle is None:
            epoch_loop = trainer.fit_loop.epoch_loop
            steps = (lambda: not epoch_loop._should_accumulate()) if pl_module.automatic_optimization else None
            self.register(pl_module, steps)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.clips:
            self.clip(optimizer)
        if self.log_every is None:
            log = trainer._logger_connector.should_update_logs
        else:
            log = (trainer.global_step + 1) % self.log_every == 0
        if log:
            scalars = self.scalars()
            if scalars:
                values = torch.tensor(list(scalars.values()), dtype=torch.float64).unbind()
                pl_module.log_dict(dict(zip(scalars, values)), on_step=True, on_epoch=False)

    def on_fit_end(self, trainer, pl_module) -> None:
        self.remove()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.remove()  # a fit() that raises calls neither on_fit_end nor teardown

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.remove()


def _warn_unoptimized(trainer, pl_module) -> None:
    """Warn when parameters that require grad are in no optimizer: clipping counts their gradients in the global
    norm, Lightning's gradient_clip_val does not."""
    optimized = {id(p) for optimizer in trainer.optimizers for group in optimizer.param_groups for p in group["params"]}
    outside = [name for name, p in pl_module.named_parameters() if p.requires_grad and id(p) not in optimized]
    if outside:
        listed = ", ".join(outside[:5]) + (f" and {len(outside) - 5} more" if len(outside) > 5 else "")
        rank_zero_warn(f"FusedHooksCallback(max_grad_norm=...) counts the gradients of {listed} in the global norm, "
                       "but no optimizer updates them (Trainer's gradient_clip_val would leave them out): set "
                       "requires_grad=False on them for the same clipping")
