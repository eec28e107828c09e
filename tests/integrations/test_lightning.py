"""fusedhooks.integrations.lightning.FusedHooksCallback inside a real Lightning Trainer (CPU): the same losses and
parameters as Lightning's own gradient_clip_val, statistics in the logged metrics, one firing per optimizer step."""

import math

import lightning.pytorch as pl
import pytest
import torch

import fusedhooks as fh
from fusedhooks.integrations.lightning import FusedHooksCallback

from helpers import assert_close_after_steps, coef_rtol, record_processing, torch_fp32_norm_rtol

#: every test fits with a real lightning.pytorch.Trainer (about 40 s for the module on 2 busy CPU cores)
pytestmark = pytest.mark.slow


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        self.losses = []
        self.grads_at_step = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer):  # runs after the callbacks' hook of the same name
        self.grads_at_step.append({n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _loader(batches: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batches * 4, 6, generator=g) * 4
    y = torch.randn(batches * 4, 2, generator=g) * 4
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def _fit(tmp_path, callbacks=(), batches=5, epochs=1, module=None, **trainer_args):
    module = Regression() if module is None else module
    trainer = pl.Trainer(default_root_dir=str(tmp_path), max_epochs=epochs, accelerator="cpu", devices=1,
                         callbacks=list(callbacks), enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, logger=False, **trainer_args)
    trainer.fit(module, _loader(batches))
    return trainer, module


@pytest.mark.parametrize("accumulate, precision", [(1, "32-true"), (2, "32-true"), (2, "bf16-mixed"), (2, "bf16-true")])
def test_clipping_equals_gradient_clip_val(tmp_path, accumulate, precision):
    """5 batches: with accumulate_grad_batches=2 the epoch's last step has one batch (Lightning steps on it).
    Bit-identical whenever the recorded norms round to torch's fp32 norms; one of them can differ by an ulp."""
    _, reference = _fit(tmp_path / "ref", gradient_clip_val=1.0, accumulate_grad_batches=accumulate,
                        precision=precision)
    hook = fh.grad_hook(stats=("norm", "absmax", "nan"))
    callback = FusedHooksCallback(hook, max_grad_norm=1.0, params="*")
    trainer, module = _fit(tmp_path / "fh", [callback], accumulate_grad_batches=accumulate, log_every_n_steps=1,
                           precision=precision)
    assert len(module.grads_at_step) == len(reference.grads_at_step) == (5 if accumulate == 1 else 3)
    assert module.losses == pytest.approx(reference.losses, rel=1e-6, abs=0)
    for p, q in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
    # the module's on_before_optimizer_step runs after ours (clipped) and before Lightning's own clipping
    clipped = 0
    for ours, theirs in zip(module.grads_at_step, reference.grads_at_step):
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in theirs.values()]))
        coef = torch.clamp(1.0 / (total + 1e-6), max=1.0)
        clipped += bool(coef < 1)
        for name in ours:
            torch.testing.assert_close(ours[name], theirs[name] * coef, rtol=1e-5, atol=1e-7)
    assert clipped >= 2  # clipping shows
    metrics = trainer.callback_metrics  # the last step's statistics: of the accumulated gradient, before clipping
    for name, grad in reference.grads_at_step[-1].items():
        assert metrics[f"grad/{name}/absmax"].item() == pytest.approx(grad.abs().max().item(), rel=1e-6)
        assert metrics[f"grad/{name}/norm"].item() == pytest.approx(grad.double().norm().item(), rel=1e-5)
    recorded = hook.stats.read()
    for name, row in recorded.items():
        for stat, value in row.items():  # logged exactly (float64)
            assert metrics[f"grad/{name}/{stat}"].item() == value
    assert set(metrics) >= {f"grad/{name}/{stat}" for name, _ in module.named_parameters()
                            for stat in ("norm", "absmax", "nan")}
    assert metrics["grad/total_norm"].item() == callback.total_norm.item()
    assert callback._handle is None and len(hook.registry) == 0  # removed at the end of fit()


class FusedAdamW(Regression):
    """Regression stepped by a fused AdamW; records the optimizer's grad_scale in on_before_optimizer_step (after
    the callbacks', inside the step: Lightning runs backward in the closure optimizer.step calls)."""

    def __init__(self):
        super().__init__()
        self.grad_scales = []

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)
        self.grad_scales.append(vars(optimizer).get("grad_scale"))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, fused=True)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("clipper", ["max_grad_norm", "spike_guard"])
def test_clipping_with_a_fused_optimizer_folds_into_its_step(tmp_path, accumulate, clipper):
    """A fused AdamW: the callback folds the coefficient into its grad_scale (no pass over the gradients; the step
    that runs the closure reads it) and trains as gradient_clip_val=1.0, to the fold's rounding (coef_rtol: dividing
    by fl(1 / coef) against multiplying by coef, and the norms' rounding) passed on by each AdamW step."""
    _, reference = _fit(tmp_path / "ref", gradient_clip_val=1.0, accumulate_grad_batches=accumulate,
                        module=FusedAdamW())
    hook = fh.grad_hook(stats=("norm",))
    guard = fh.zclip(hook, warmup_steps=10, max_grad_norm=1.0) if clipper == "spike_guard" else None  # warming up:
    callback = FusedHooksCallback(hook, max_grad_norm=None if guard else 1.0, spike_guard=guard)  # torch's clip
    _, module = _fit(tmp_path / "fh", [callback], accumulate_grad_batches=accumulate, module=FusedAdamW())
    steps, numels = 5 if accumulate == 1 else 3, [p.numel() for p in module.parameters()]
    if guard is not None:
        assert guard.count.item() == steps
    assert len(module.grad_scales) == steps and reference.grad_scales == [None] * steps
    # the folded path: grad_scale = 1 / coef = (total norm + 1e-6) / max_norm, consumed by each step
    totals = [torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item()
              for grads in module.grads_at_step]  # the gradients before the step divides them
    assert [s.item() for s in module.grad_scales] == [pytest.approx(t + 1e-6, rel=torch_fp32_norm_rtol(numels))
                                                      for t in totals]
    assert min(totals) > 1.0  # it clips at every step
    assert "grad_scale" not in vars(module.trainer.optimizers[0])  # nothing left behind
    delta = coef_rtol(torch.float32, 2.0, numels)
    for p, q, s in zip(module.parameters(), reference.parameters(), Regression().parameters()):
        assert_close_after_steps(p.detach(), q.detach(), s.detach(), delta, steps)
    # the losses of the first step's batches are of the same parameters; later ones move with them
    assert module.losses[:accumulate] == reference.losses[:accumulate]
    assert module.losses == pytest.approx(reference.losses, rel=1e-5, abs=0)


def test_hook_runs_once_per_optimizer_step(tmp_path):
    """Uneven accumulation (3 batches per epoch, accumulate 2, 2 epochs): 4 optimizer steps, 4 firings per
    parameter, each on the accumulated gradient (the clamp shows in the gradient the optimizer steps with)."""
    hook = fh.grad_hook(lambda grad: grad.clamp(-2.0 ** -6, 2.0 ** -6), stats=("max",))
    firings = record_processing(hook)
    _, module = _fit(tmp_path, [FusedHooksCallback(hook)], batches=3, epochs=2, accumulate_grad_batches=2)
    n_params = len(list(module.parameters()))
    assert len(module.grads_at_step) == 4
    assert len(firings) == 4 * n_params
    for grads in module.grads_at_step:
        assert all(g.abs().max() <= 2.0 ** -6 for g in grads.values())


class FailingRegression(Regression):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise RuntimeError("stop")
        return super().training_step(batch, batch_idx)


def test_registered_once_per_fit_and_removed_after(tmp_path):
    """Two fits of one Trainer: registered for each, once; a fit that raises leaves nothing registered either."""
    hook = fh.grad_hook(stats=("norm",))
    callback = FusedHooksCallback(hook)
    firings = record_processing(hook)
    trainer, module = _fit(tmp_path, [callback], batches=2)
    trainer.fit_loop.max_epochs = 2
    trainer.fit(module, _loader(2))
    assert len(module.grads_at_step) == 4 and len(firings) == 4 * len(list(module.parameters()))
    assert callback._handle is None and len(hook.registry) == 0
    with pytest.raises(RuntimeError, match="stop"):
        _fit(tmp_path, [callback], batches=2, module=FailingRegression())
    assert callback._handle is None and len(hook.registry) == 0


@pytest.mark.parametrize("log_every, expected_steps, fresh", [(2, [1, 2, 3, 4, 5], [1, 3, 5]), (None, [2, 5], [2, 5])])
def test_statistics_reach_the_logger_on_their_steps(tmp_path, log_every, expected_steps, fresh):
    """None: read at the Trainer's log_every_n_steps (3: logger rows 2 and 5 of 6 optimizer steps, counted from
    0). log_every=2: read at optimizer steps 2, 4 and 6 (rows 1, 3 and 5); Lightning writes its loggers at its own
    cadence (every step here), repeating the last values logged in between."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    hook = fh.grad_hook(stats=("norm",))
    module = Regression()
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = pl.Trainer(default_root_dir=str(tmp_path), max_epochs=1, accelerator="cpu", devices=1,
                         callbacks=[FusedHooksCallback(hook, log_every=log_every, params="*")],
                         enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, logger=logger,
                         log_every_n_steps=1 if log_every else 3)
    trainer.fit(module, _loader(6))
    with open(f"{logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("grad/net.0.weight/norm")]
    assert [int(r["step"]) for r in rows] == expected_steps
    changed = [int(r["step"]) for i, r in enumerate(rows)
               if i == 0 or r["grad/net.0.weight/norm"] != rows[i - 1]["grad/net.0.weight/norm"]]
    assert changed == fresh
    assert set(rows[0]) >= {f"grad/{n}/norm" for n, _ in module.named_parameters()}


def test_logged_statistics_are_selected(tmp_path):
    """params=/stats= log only those keys, top_k= the total norm and the k largest per-parameter norms (what
    hook.stats.to_scalars gives); a pattern matching no parameter is refused at fit()'s start, unregistered."""
    hook = fh.grad_hook(stats=("norm", "absmax"))
    callback = FusedHooksCallback(hook, stats="norm", params="*.bias", top_k=1, log_every=1)
    trainer, module = _fit(tmp_path, [callback], batches=1)  # one step: callback_metrics hold its values only
    biases = {n: g.double().norm().item() for n, g in module.grads_at_step[0].items() if n.endswith(".bias")}
    largest = max(biases, key=biases.get)
    assert set(trainer.callback_metrics) == {"grad/total_norm", f"grad/{largest}/norm"}
    assert trainer.callback_metrics[f"grad/{largest}/norm"].item() == pytest.approx(biases[largest], rel=1e-5)
    expected = math.sqrt(sum(value ** 2 for value in biases.values()))
    assert trainer.callback_metrics["grad/total_norm"].item() == pytest.approx(expected, rel=1e-5)
    unmatched = FusedHooksCallback(fh.grad_hook(stats=("norm",)), params="encoder.*")
    with pytest.raises(ValueError, match="params= pattern 'encoder.\\*' matches none of the hook's parameters "
                                         "\\(net.0.weight, net.0.bias, net.2.weight, net.2.bias\\)"):
        _fit(tmp_path, [unmatched])
    assert unmatched._handle is None and len(unmatched.hook.registry) == 0


class AccumulatingStrategy(pl.strategies.SingleDeviceStrategy):
    """Stands for DeepSpeed: a strategy that accumulates gradients itself."""

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True


class WithUnoptimizedParameter(Regression):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.5)


def test_parameters_outside_the_optimizer_are_warned(tmp_path):
    trainer = pl.Trainer(default_root_dir=str(tmp_path), max_epochs=1, accelerator="cpu", devices=1, logger=False,
                         callbacks=[FusedHooksCallback(fh.grad_hook(stats=("norm",)), max_grad_norm=1.0)],
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with pytest.warns(UserWarning, match="counts the gradients of scale in the global norm"):
        trainer.fit(WithUnoptimizedParameter(), _loader(1))


class TwoOptimizers(Regression):
    """Manual optimization, one optimizer per layer (a GAN's generator and discriminator)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        for opt in self.optimizers():
            opt.zero_grad()
            self.manual_backward(torch.nn.functional.mse_loss(self.net(x), y))
            opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.net[0].parameters(), lr=0.5), torch.optim.SGD(self.net[2].parameters(), lr=0.5)


def test_manual_optimization_with_several_optimizers_refuses_max_grad_norm(tmp_path):
    """Each opt.step() would clip every registered gradient by their global norm, the other optimizer's included
    (Lightning refuses gradient_clip_val with manual optimization); without max_grad_norm the hook runs."""
    hook = fh.grad_hook(stats=("norm",))
    with pytest.raises(ValueError, match="manual optimization and 2 optimizers"):
        _fit(tmp_path, [FusedHooksCallback(hook, max_grad_norm=1.0)], batches=2, module=TwoOptimizers())
    assert len(hook.registry) == 0
    firings = record_processing(hook)
    _fit(tmp_path, [FusedHooksCallback(hook)], batches=2, module=TwoOptimizers())
    assert len(firings) == 2 * 2 * 4  # every backward (2 per batch), every parameter


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match='"norm" among its stats'):
        FusedHooksCallback(fh.grad_hook(stats=("max",)), max_grad_norm=1.0)
    with pytest.raises(ValueError, match="max_grad_norm= takes a finite number"):
        FusedHooksCallback(fh.grad_hook(stats=("norm",)), max_grad_norm=float("inf"))
    with pytest.raises(ValueError, match="log_every= takes"):
        FusedHooksCallback(fh.grad_hook(stats=("norm",)), log_every=-1)
    with pytest.raises(TypeError, match="fusedhooks hook"):
        FusedHooksCallback(None)
    with pytest.raises(ValueError, match="'nrom', which is no statistic"):
        FusedHooksCallback(fh.grad_hook(stats=("norm",)), stats="nrom")
    with pytest.raises(ValueError, match="leave gradient_clip_val unset"):
        _fit(tmp_path, [FusedHooksCallback(fh.grad_hook(stats=("norm",)), max_grad_norm=1.0)], gradient_clip_val=1.0)
    scaler = pl.plugins.MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="use precision='bf16-mixed'"):
        _fit(tmp_path, [FusedHooksCallback(fh.grad_hook(stats=("norm",)))], plugins=[scaler])
    with pytest.raises(ValueError, match="does not support strategy AccumulatingStrategy"):
        _fit(tmp_path, [FusedHooksCallback(fh.grad_hook(stats=("norm",)))],
             strategy=AccumulatingStrategy(device=torch.device("cpu")))


def test_float64_with_a_fused_optimizer_is_scaled_in_place(tmp_path):
    """precision="64-true" with a fused AdamW: a fused step reads grad_scale as float32, so the callback scales the
    float64 gradients in place instead of folding (it raised before), and trains as gradient_clip_val=1.0: the same
    torch ops on the same float64 values but for the norms' rounding (float64 sums, 1e-12)."""
    _, reference = _fit(tmp_path / "ref", gradient_clip_val=1.0, precision="64-true", module=FusedAdamW())
    callback = FusedHooksCallback(fh.grad_hook(stats=("norm",)), max_grad_norm=1.0)
    _, module = _fit(tmp_path / "fh", [callback], precision="64-true", module=FusedAdamW())
    assert module.grad_scales == [None] * 5  # not folded
    for p, q in zip(module.parameters(), reference.parameters()):
        assert p.dtype == torch.float64
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


def test_the_default_log_is_a_summary_of_as_many_keys_for_any_model(tmp_path):
    """Without stats=, params= or top_k= the callback logs a summary whose size does not grow with the model (the
    global norm, the largest absmax and its parameter's index, NaN/Inf totals, how many gradients the body shrank)."""
    hook = fh.grad_hook(lambda grad: grad.clamp(-0.01, 0.01), stats=("norm", "absmax", "nan"), input_stats=("absmax",))
    trainer, module = _fit(tmp_path, [FusedHooksCallback(hook)], batches=2, log_every_n_steps=1)
    metrics = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("grad/")}
    assert set(metrics) == {"grad/total_norm", "grad/absmax", "grad/absmax_index", "grad/nan", "grad/shrunk"}
    recorded = hook.stats.read()
    assert metrics["grad/total_norm"].item() == pytest.approx(
        math.sqrt(math.fsum(row["norm"] ** 2 for row in recorded.values())), rel=1e-12)
    largest = hook.stats.names[int(metrics["grad/absmax_index"].item())]
    assert metrics["grad/absmax"].item() == recorded[largest]["absmax"] == max(r["absmax"] for r in recorded.values())
    assert metrics["grad/nan"].item() == 0 and metrics["grad/shrunk"].item() >= 1
