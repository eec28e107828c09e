"""Hugging Face Trainer: `FusedHooksCallback` registers a hook on the trained model, runs it once per optimizer
step (on the accumulated gradient), clips by the global norm from the norms it recorded, and logs its statistics.

Needs `transformers` and `accelerate` (`pip install fusedhooks[transformers]`).
"""

from __future__ import annotations

from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import GradientState
from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper
from transformers import TrainerCallback

from .common import StepCallbackBase


class FusedHooksCallback(StepCallbackBase, TrainerCallback):
    """Run `hook` inside `transformers.Trainer`.

    - At `train()`'s start the hook is registered on the model Trainer trains (`register(model)`: each gradient
      processed at its own firing), and removed at its end. A `train()` that raises leaves it registered (Trainer
      calls no callback then) until the next `train()` or `callback.remove()`.
    - Gradient accumulation: the hook runs only in the backward of the micro-batch that completes an accumulation
      step (Trainer's own rule, which accelerate's `GradientState().sync_gradients` states for each micro-batch,
      the epoch's last, shorter step included), so clipping and statistics see the accumulated gradient once.
    - `max_grad_norm`: clips every gradient by their global norm with `fh.clip_grad_norm_` (from the norms the
      hook recorded: the hook must record `"norm"`), where Trainer would clip, just before `optimizer.step()`; the
      result equals Trainer's own clipping. With a fused optimizer (`optim="adamw_torch_fused"`, or torch's Adam,
      AdamW, SGD or Adagrad with `fused=True`) the clip makes no pass over the gradients: the coefficient is folded
      into the optimizer's `grad_scale` and its step divides them (callbacks' `on_pre_optimizer_step` after this one
      see them unclipped). Set Trainer's own `TrainingArguments(max_grad_norm=0)` (refused
      otherwise: it would clip twice). Trainer then still computes the total norm it logs as `grad_norm`: one more
      read of every gradient (accelerate's `clip_grad_norm_` with `max_norm=inf`). To save that read, override
      `Trainer._get_grad_norm` to return `callback.clip_grad_norm().item()` (it clips there, once per step;
      docs/integrations.md, "Hugging Face Trainer").
    - Logging: `hook.stats.to_scalars(prefix, stats, params, top_k)` (`grad/<parameter>/<statistic>`; the options
      select what, as in `to_scalars`; a `params` pattern matching no parameter is refused at `train()`'s start),
      and `grad/total_norm` (the global norm before clipping, as Trainer's `grad_norm`) when it clips, join Trainer's
      training logs (`trainer.state.log_history` and the `logs` passed to later callbacks' `on_log`): at every training
      log (Trainer's `logging_steps`) when `log_every` is None, else every `log_every` optimizer steps (Trainer then
      logs at those steps too). Trainer calls its `report_to` callbacks (TensorBoard, W&B, ...) before user callbacks,
      so to have them log the statistics as well, put this callback first: `trainer.callback_handler.callbacks.insert(0,
      callback)`.
    Reading the statistics costs one device sync per log, none otherwise.

    Precision: fp32, `bf16=True`, and `fp16=True` where accelerate creates no GradScaler (CPU). `fp16=True` with a
    GradScaler (on a GPU) is refused, since Trainer unscales the gradients only after backward and the hook would
    see scaled gradients; so is DeepSpeed, which keeps, scales and clips the gradients itself.

    Single process only; under DDP the hook would see each rank's local gradient (fusedhooks warns).
    """

    default_cadence = "Trainer's logging_steps"

    def __init__(self, hook, max_grad_norm: float | None = None, log_every: int | None = None,
                 prefix: str = "grad/", norm_type: float = 2.0, stats=None, params=None, top_k: int | None = None,
                 spike_guard=None):
        super().__init__(hook, max_grad_norm, log_every, prefix, norm_type, stats, params, top_k, spike_guard)
        self._clipped = False  # in this optimizer step
        self._gradient_state = None
        self._optimizer = None  # the torch optimizer Trainer steps (accelerate's wrapper taken off)

    def _steps(self) -> bool:
        """Does the running micro-batch complete an accumulation step? (called at each firing)"""
        return self._gradient_state.sync_gradients

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.clips and args.max_grad_norm and args.max_grad_norm > 0:
            raise ValueError(f"FusedHooksCallback(max_grad_norm={self.max_grad_norm}, spike_guard="
                             f"{self.spike_guard is not None}) clips the gradients, and "
                             f"TrainingArguments(max_grad_norm={args.max_grad_norm}) would clip them again: set "
                             "TrainingArguments(max_grad_norm=0)")
        if getattr(args, "deepspeed", None) or isinstance(optimizer, DeepSpeedOptimizerWrapper):
            raise ValueError("FusedHooksCallback does not support DeepSpeed: it accumulates, scales and clips the "
                             "gradients itself, outside the parameters' .grad, so the hook would not see the "
                             "gradients the optimizer steps with")
        if getattr(optimizer, "scaler", None) is not None:
            raise ValueError("FusedHooksCallback does not support fp16 mixed precision with a GradScaler "
                             "(TrainingArguments(fp16=True) on a GPU): Trainer unscales the gradients only after "
                             "backward, so the hook would process and measure scaled gradients; use bf16=True (no "
                             "scaler), fp32, or a hook with scaler= in a plain loop")
        self.remove()  # a train() that raised left its registration (Trainer calls no callback then)
        self._gradient_state = GradientState()
        self._optimizer = _torch_optimizer(optimizer)
        self.register(model, self._steps)

    def clip_grad_norm(self):
        """Clip by max_grad_norm now, unless done already in this optimizer step; the total norm (0-dim tensor)."""
        if not self.clips:
            raise ValueError("this FusedHooksCallback does not clip: pass max_grad_norm= or spike_guard=")
        if not self._clipped:
            self.clip(self._optimizer)
            self._clipped = True
        return self.total_norm

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None:
            self._optimizer = _torch_optimizer(optimizer)
        if self.clips:
            self.clip_grad_norm()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._clipped = False

    def on_step_end(self, args, state, control, **kwargs):
        if self.log_every is not None and state.global_step % self.log_every == 0:
            control.should_log = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        training = logs is not None and "loss" in logs
        if not training or (self.log_every is not None and state.global_step % self.log_every):
            return
        scalars = self.scalars()
        logs.update(scalars)
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step and "loss" in last:
            last.update(scalars)

    def on_train_end(self, args, state, control, **kwargs):
        self.remove()


def _torch_optimizer(optimizer):
    """The torch optimizer inside accelerate's AcceleratedOptimizer (whose step calls its step), or `optimizer`."""
    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
