"""fusedhooks.integrations.transformers.FusedHooksCallback inside a real Hugging Face Trainer (tiny GPT-2, CPU):
the same losses and parameters as Trainer's own clipping, statistics in Trainer's logs, one firing per step."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import fusedhooks as fh
from fusedhooks.integrations.transformers import FusedHooksCallback

from helpers import assert_close_after_steps, coef_rtol, record_processing, torch_fp32_norm_rtol

#: every test trains with a real Trainer (about 40 s for the module on 2 CPU cores)
pytestmark = pytest.mark.slow


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


def _train(tmp_path, max_grad_norm, accumulation, callbacks=(), samples=20, epochs=1, max_steps=5, log_every=1,
           optim="sgd", learning_rate=1.0, model=None, **extra):
    model = _model() if model is None else model
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=max_steps,
                             num_train_epochs=epochs, gradient_accumulation_steps=accumulation,
                             learning_rate=learning_rate, optim=optim, lr_scheduler_type="constant",
                             max_grad_norm=max_grad_norm, logging_steps=log_every, report_to=[], save_strategy="no",
                             use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0, **extra)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(samples), callbacks=list(callbacks))
    trainer.train()
    return trainer, model


def _losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


class CountFirings(TrainerCallback):
    """Counts the hook's firings per micro-batch (a hook registered after it, on the same tensors)."""

    def __init__(self, hook):
        self.hook, self.firings = hook, []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        param = next(model.parameters())
        param.register_post_accumulate_grad_hook(lambda p: self.firings.append(self.hook.stats.tensor.sum().item()))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_clipping_equals_trainers_own(tmp_path, accumulation):
    reference, reference_model = _train(tmp_path / "ref", 1.0, accumulation)
    hook = fh.grad_hook(stats=("norm", "max", "nan"))
    callback = FusedHooksCallback(hook, max_grad_norm=1.0, params="*")
    trainer, model = _train(tmp_path / "fh", 0.0, accumulation, [callback])
    # The total norm is Trainer's within Trainer's own rounding: fusedhooks' per-parameter norms are correctly
    # rounded from float64 sums, torch's foreach norms accumulate in float32 lanes (processor-dependent bits), so
    # the totals differ by torch's rounding at most; the coefficient, the parameters and the losses by as much.
    logged = [e for e in trainer.state.log_history if "loss" in e]
    reference_logged = [e for e in reference.state.log_history if "loss" in e]
    assert len(logged) == 5
    rtol = torch_fp32_norm_rtol(p.numel() for p in model.parameters())
    for entry, ref in zip(logged, reference_logged):
        assert entry["grad/total_norm"] == pytest.approx(ref["grad_norm"], rel=rtol, abs=0)
        assert entry["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=name)
    for entry in logged:
        assert entry["grad/transformer.h.0.attn.c_attn.weight/nan"] == 0
        assert set(k for k in entry if k.startswith("grad/")) == \
            {"grad/total_norm"} | {f"grad/{n}/{s}" for n, _ in model.named_parameters() for s in ("norm", "max", "nan")}
    assert callback._handle is None and len(hook.registry) == 0  # removed at the end of train()


class RecordGradScale(TrainerCallback):
    """Records the grad_scale of the torch optimizer inside accelerate's wrapper as each step begins (a step
    pre-hook): the clip coefficient's reciprocal when it was folded into the fused step, None when it was not."""

    def __init__(self):
        self.seen = []

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        optimizer.optimizer.register_step_pre_hook(lambda opt, a, k: self.seen.append(vars(opt).get("grad_scale")))


class RecordFirstStep(TrainerCallback):
    """The parameters after the first optimizer step."""

    def __init__(self):
        self.params = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:
            self.params = [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("clipper", ["max_grad_norm", "spike_guard"])
def test_clipping_with_a_fused_optimizer_folds_into_its_step(tmp_path, clipper):
    """optim="adamw_torch_fused": the callback folds the coefficient into the fused AdamW's grad_scale (no pass over
    the gradients) and trains as Trainer's own max_grad_norm=1.0 does, to the fold's rounding (coef_rtol: dividing by
    fl(1 / coef) against multiplying by coef, and the norms' rounding) passed on by each AdamW step. A spike guard
    (fh.zclip) in its warm-up clips by its max_grad_norm as torch does: the same run, the guard stepped each step."""
    steps, lr = 4, 1e-2
    reference_first, first = RecordFirstStep(), RecordFirstStep()
    reference, reference_model = _train(tmp_path / "ref", 1.0, 1, [reference_first], max_steps=steps,
                                        optim="adamw_torch_fused", learning_rate=lr)
    recorder = RecordGradScale()
    hook = fh.grad_hook(stats=("norm",))
    guard = fh.zclip(hook, warmup_steps=10, max_grad_norm=1.0) if clipper == "spike_guard" else None
    callback = FusedHooksCallback(hook, max_grad_norm=None if guard else 1.0, spike_guard=guard)
    trainer, model = _train(tmp_path / "fh", 0.0, 1, [callback, recorder, first], max_steps=steps,
                            optim="adamw_torch_fused", learning_rate=lr)
    logged = [e for e in trainer.state.log_history if "loss" in e]
    totals = [e["grad/total_norm"] for e in logged]
    assert len(recorder.seen) == steps and all(s is not None for s in recorder.seen)  # the folded path, every step
    assert min(totals) > 1.0  # it clips: the folded grad_scale is 1 / coef = (total norm + 1e-6) / max_norm
    assert [s.item() for s in recorder.seen] == [pytest.approx(t + 1e-6, rel=2 ** -22) for t in totals]
    assert "grad_scale" not in vars(trainer.optimizer.optimizer)  # nothing left behind
    if guard is not None:
        assert guard.count.item() == steps  # in its warm-up: every step's norm recorded
    numels = [p.numel() for p in model.parameters()]
    rtol = torch_fp32_norm_rtol(numels)
    for entry, ref in zip(logged, [e for e in reference.state.log_history if "loss" in e]):
        assert entry["grad/total_norm"] == pytest.approx(ref["grad_norm"], rel=rtol, abs=0)  # before clipping
        # a parameter difference within the bound below moves the loss by ~ grad_norm * |dp|: under 1e-5 relative
        assert entry["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    # the first step's gradients are the same in both runs: its parameters differ by the fold's rounding alone. Later
    # gradients differ with the parameters, and AdamW divides each element by its own gradient's size, so an element
    # whose gradient is near zero by cancellation turns that into a large relative change (no per-step bound holds
    # there, and which elements it hits depends on the processor): the end of the run is held to 0.1% of the way
    # each parameter travelled, which a missing, doubled or wrong clip exceeds many times over
    start = _model()
    for p, q, s in zip(first.params, reference_first.params, start.parameters()):
        assert_close_after_steps(p, q, s.detach(), coef_rtol(torch.float32, 2.0, numels), 1)
    for p, q, s in zip(model.parameters(), reference_model.parameters(), start.parameters()):
        travelled = (q.detach() - s.detach()).abs().max()
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-3 * travelled.item())


def test_statistics_are_those_of_the_accumulated_gradient(tmp_path):
    """Logged statistics equal torch's of the final accumulated gradient, measured by a later eager hook."""
    hook = fh.grad_hook(stats=("norm", "sum"))
    seen = {}

    class Measure(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            seen[state.global_step + 1] = {n: (p.grad.double().norm().item(), p.grad.double().sum().item())
                                           for n, p in model.named_parameters()}

    trainer, model = _train(tmp_path, 0.0, 2, [FusedHooksCallback(hook, params="*"), Measure()], max_steps=3)
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in logged] == [1, 2, 3]
    for entry in logged:
        for name, (norm, total) in seen[entry["step"]].items():
            assert entry[f"grad/{name}/norm"] == pytest.approx(norm, rel=1e-5)
            assert entry[f"grad/{name}/sum"] == pytest.approx(total, rel=1e-4, abs=1e-6 * norm)


def test_hook_fires_once_per_optimizer_step_with_an_uneven_last_step(tmp_path):
    """3 micro-batches per epoch with accumulation 2: steps of 2 and 1 micro-batches; the hook processes the
    last micro-batch of each (clipping shows in the gradient: it records every firing's max)."""
    hook = fh.grad_hook(lambda grad: grad.clamp(-2.0 ** -10, 2.0 ** -10), stats=("max",))
    firings = record_processing(hook)
    grads_at_step = []

    class Check(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads_at_step.append(max(p.grad.abs().max().item() for p in model.parameters()))

    trainer, model = _train(tmp_path, 0.0, 2, [FusedHooksCallback(hook), Check()], samples=6, epochs=2, max_steps=-1)
    n_params = len(list(model.parameters()))
    assert trainer.state.global_step == 4
    assert len(firings) == 4 * n_params
    assert len(grads_at_step) == 4 and all(g <= 2.0 ** -10 for g in grads_at_step)


def test_log_every_logs_on_its_own_steps(tmp_path):
    hook = fh.grad_hook(stats=("norm",))
    trainer, _ = _train(tmp_path, 0.0, 1, [FusedHooksCallback(hook, log_every=2, params="*")], log_every=5)
    with_stats = [e["step"] for e in trainer.state.log_history if "grad/transformer.wte.weight/norm" in e]
    assert with_stats == [2, 4]
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [2, 4, 5]


def test_logged_statistics_are_selected(tmp_path):
    """params=/stats= log only those keys; top_k= the total norm (Trainer's own grad_norm, to torch's float32
    rounding) and the k largest per-parameter norms; the default logs every statistic of every parameter."""
    layer0, summary, everything = (fh.grad_hook(stats=("norm", "absmax")) for _ in range(3))
    callbacks = [FusedHooksCallback(layer0, stats="norm", params=["transformer.h.0.*", "*.wpe.*"], prefix="h0/"),
                 FusedHooksCallback(summary, stats="norm", top_k=2, prefix="top/"),
                 FusedHooksCallback(everything, params="*")]
    trainer, model = _train(tmp_path, 0.0, 1, callbacks, max_steps=2)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    rtol = torch_fp32_norm_rtol(p.numel() for p in model.parameters())
    for entry in [e for e in trainer.state.log_history if "loss" in e]:
        assert {k for k in entry if k.startswith("h0/")} == {
            f"h0/{n}/norm" for n in names if n.startswith("transformer.h.0.") or n == "transformer.wpe.weight"}
        top = [k for k in entry if k.startswith("top/")]
        norms = {n: entry[f"grad/{n}/norm"] for n in names}
        largest = sorted(norms, key=norms.get, reverse=True)[:2]
        assert top == ["top/total_norm"] + [f"top/{n}/norm" for n in largest]
        assert entry["top/total_norm"] == pytest.approx(entry["grad_norm"], rel=rtol + 1e-12, abs=0)
        every = {f"grad/{n}/{stat}" for n in names for stat in ("norm", "absmax")}
        assert {k for k in entry if k.startswith("grad/")} == every


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match='"norm" among its stats'):
        FusedHooksCallback(fh.grad_hook(stats=("max",)), max_grad_norm=1.0)
    with pytest.raises(ValueError, match="max_grad_norm= takes a finite number"):
        FusedHooksCallback(fh.grad_hook(stats=("norm",)), max_grad_norm=0)
    with pytest.raises(ValueError, match="log_every= takes"):
        FusedHooksCallback(fh.grad_hook(stats=("norm",)), log_every=0)
    with pytest.raises(TypeError, match="fusedhooks hook"):
        FusedHooksCallback(lambda g: g)
    with pytest.raises(ValueError, match="'std', which this hook does not record"):
        FusedHooksCallback(fh.grad_hook(stats=("norm",)), stats=("norm", "std"))
    with pytest.raises(ValueError, match="top_k= ranks the parameters by their gradient's norm"):
        FusedHooksCallback(fh.grad_hook(stats=("max",)), top_k=3)
    hook = fh.grad_hook(stats=("norm",))
    with pytest.raises(TypeError, match="spike_guard= takes a guard made by fh.zclip"):
        FusedHooksCallback(hook, spike_guard=object())
    with pytest.raises(ValueError, match="of the hook given to this callback"):
        FusedHooksCallback(hook, spike_guard=fh.zclip(fh.grad_hook(stats=("norm",))))
    with pytest.raises(ValueError, match="pass max_grad_norm= or spike_guard=, not both"):
        FusedHooksCallback(hook, max_grad_norm=1.0, spike_guard=fh.zclip(hook))
    unmatched = FusedHooksCallback(fh.grad_hook(stats=("norm",)), params="transformer.h.9.*")
    with pytest.raises(ValueError, match="params= pattern 'transformer.h.9.\\*' matches none of the hook's "
                                         "parameters \\(transformer.wte.weight, "):
        _train(tmp_path, 0.0, 1, [unmatched])
    assert unmatched._handle is None and len(unmatched.hook.registry) == 0
    with pytest.raises(ValueError, match="set TrainingArguments\\(max_grad_norm=0\\)"):
        _train(tmp_path, 1.0, 1, [FusedHooksCallback(fh.grad_hook(stats=("norm",)), max_grad_norm=1.0)])


def test_report_to_callbacks_see_the_statistics_when_it_runs_first(tmp_path, monkeypatch):
    """Trainer calls its report_to callbacks before user callbacks; inserted first, the callback's statistics
    reach them (here report_to=["tensorboard"], read back with TensorBoard's own event reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, learning_rate=1.0,
                             optim="sgd", max_grad_norm=0.0, logging_steps=1, report_to=["tensorboard"],
                             save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
    trainer = Trainer(model=_model(), args=args, train_dataset=TokenDataset(8))
    callback = FusedHooksCallback(fh.grad_hook(stats=("norm",)), max_grad_norm=1.0, params="*")
    trainer.callback_handler.callbacks.insert(0, callback)
    trainer.train()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "train/grad/transformer.wte.weight/norm" in tags and "train/grad/total_norm" in tags
    logged = [e["grad/total_norm"] for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 2
    assert [e.value for e in acc.Scalars("train/grad/total_norm")] == [pytest.approx(v, rel=1e-6) for v in logged]


def test_trainer_subclass_reads_no_gradient_for_its_grad_norm_log(tmp_path):
    """The recipe of docs/integrations.md: Trainer._get_grad_norm clips through the callback and returns its total
    norm, so Trainer's grad_norm log costs no extra read of the gradients (accelerate's clip_grad_norm_ is never
    called)."""
    callback = FusedHooksCallback(fh.grad_hook(stats=("norm",)), max_grad_norm=1.0)

    class FusedHooksTrainer(Trainer):
        def _get_grad_norm(self, model, grad_norm=None):
            return callback.clip_grad_norm().item()

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, learning_rate=1.0,
                             optim="sgd", max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no",
                             use_cpu=True, seed=0, disable_tqdm=True)
    trainer = FusedHooksTrainer(model=_model(), args=args, train_dataset=TokenDataset(20), callbacks=[callback])

    def no_read(*args, **kwargs):
        raise AssertionError("Trainer read the gradients again")

    trainer.accelerator.clip_grad_norm_ = no_read
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 2 and all(e["grad_norm"] == e["grad/total_norm"] for e in logged)
    reference, _ = _train(tmp_path / "ref", 1.0, 1, max_steps=2)
    assert [e["grad_norm"] for e in logged] == \
        [pytest.approx(e["grad_norm"], rel=1.2e-7) for e in reference.state.log_history if "loss" in e]
    with pytest.raises(ValueError, match="does not clip"):
        FusedHooksCallback(fh.grad_hook(stats=("norm",))).clip_grad_norm()


def test_a_failed_train_is_followed_by_a_clean_registration(tmp_path):
    """Trainer calls no callback when train() raises: the next train() registers the hook on its own model."""
    hook = fh.grad_hook(stats=("norm",))
    callback = FusedHooksCallback(hook, params="*")

    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _train(tmp_path / "a", 0.0, 1, [callback, Boom()], max_steps=2)
    assert callback._handle is not None  # left behind
    trainer, model = _train(tmp_path / "b", 0.0, 1, [callback], max_steps=2)
    logged = [e for e in trainer.state.log_history if "grad/transformer.wte.weight/norm" in e]
    assert len(logged) == 2 and callback._handle is None and len(hook.registry) == 0


def test_fp16_with_a_grad_scaler_is_refused(tmp_path):
    """TrainingArguments(fp16=True) on a GPU: accelerate scales the loss with a GradScaler and Trainer unscales the
    gradients only after backward, so the hook would clamp and measure scaled gradients. On CPU accelerate creates
    no scaler (fp16 runs as is, and the results equal Trainer's own); the GPU's is given to the CPU accelerator
    here, as accelerate gives it there."""
    callback = FusedHooksCallback(fh.grad_hook(lambda grad: grad.clamp(-0.01, 0.01), stats=("norm",)),
                                  max_grad_norm=1.0)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, max_grad_norm=0.0,
                             fp16=True, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=_model(), args=args, train_dataset=TokenDataset(4), callbacks=[callback])
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    trainer.accelerator.native_amp = True
    with pytest.raises(ValueError, match="fp16 mixed precision with a GradScaler"):
        trainer.train()
    assert len(callback.hook.registry) == 0
    # no scaler (CPU): fp16 is served, with Trainer's own results
    _, reference = _train(tmp_path / "ref", 1.0, 1, max_steps=2, fp16=True)
    callback = FusedHooksCallback(fh.grad_hook(stats=("norm",)), max_grad_norm=1.0)
    _, model = _train(tmp_path / "fh", 0.0, 1, [callback], max_steps=2, fp16=True)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)


def test_deepspeed_is_refused(tmp_path):
    """DeepSpeed keeps, scales and clips the gradients itself (not installed here: its TrainingArguments field)."""
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    args.deepspeed = {"zero_optimization": {"stage": 2}}
    callback = FusedHooksCallback(fh.grad_hook(stats=("norm",)))
    with pytest.raises(ValueError, match="does not support DeepSpeed"):
        callback.on_train_begin(args, None, None, model=_model())
    assert len(callback.hook.registry) == 0


def test_reentrant_checkpointing_with_accumulation_equals_trainers_own(tmp_path):
    """TrainingArguments(activation_checkpointing=True) with use_reentrant=True: each GPT2Block's parameters fire in
    a nested backward of its own, which counts as part of the micro-batch's backward. The final LayerNorm is frozen, so
    nothing of the outer backward fires before the last block's nested one (the head is tied to wte, which fires
    last): the nested backwards first, then the embeddings in the outer one. With accumulation 2, every logged step
    has every trainable parameter's statistics, those of the accumulated gradient (measured before the clip), and the
    run equals Trainer's own max_grad_norm=1.0 (as test_clipping_equals_trainers_own)."""

    def model():
        model = _model()
        model.transformer.ln_f.requires_grad_(False)
        return model

    checkpointing = {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": True}}
    steps = 3
    reference, reference_model = _train(tmp_path / "ref", 1.0, 2, max_steps=steps, model=model(), **checkpointing)
    seen = {}

    class Measure(TrainerCallback):  # before the callback's clip (callbacks run in order)
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            seen[state.global_step + 1] = {n: (p.grad.double().norm().item(), p.grad.double().sum().item())
                                           for n, p in model.named_parameters() if p.requires_grad}

    hook = fh.grad_hook(stats=("norm", "sum"))
    callback = FusedHooksCallback(hook, max_grad_norm=1.0, params="*")
    processed = record_processing(hook)
    trainer, trained = _train(tmp_path / "fh", 0.0, 2, [Measure(), callback], max_steps=steps, model=model(),
                              **checkpointing)
    assert trained.transformer.h[0].gradient_checkpointing  # the blocks ran under checkpoint
    names = [n for n, p in trained.named_parameters() if p.requires_grad]
    assert "transformer.ln_f.weight" not in names and len(names) == 26
    assert sorted(processed) == sorted(names * steps)  # once per optimizer step: the accumulated gradient
    logged = [e for e in trainer.state.log_history if "loss" in e]
    reference_logged = [e for e in reference.state.log_history if "loss" in e]
    assert [e["step"] for e in logged] == [e["step"] for e in reference_logged] == [1, 2, 3]
    rtol = torch_fp32_norm_rtol(p.numel() for p in trained.parameters() if p.requires_grad)
    for entry, ref in zip(logged, reference_logged):
        assert set(k for k in entry if k.startswith("grad/")) == \
            {"grad/total_norm"} | {f"grad/{n}/{s}" for n in names for s in ("norm", "sum")}
        assert entry["grad/total_norm"] == pytest.approx(ref["grad_norm"], rel=rtol, abs=0)
        assert entry["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        for name, (norm, total) in seen[entry["step"]].items():
            assert entry[f"grad/{name}/norm"] == pytest.approx(norm, rel=1e-5)
            assert entry[f"grad/{name}/sum"] == pytest.approx(total, rel=1e-4, abs=1e-6 * norm)
    for (name, p), q in zip(trained.named_parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=name)
    assert callback._handle is None and len(hook.registry) == 0


@pytest.mark.parametrize("layers", [1, 3], ids=["1-layer", "3-layers"])
def test_the_default_log_is_a_summary_of_as_many_keys_for_any_model(tmp_path, layers):
    """Without stats=, params= or top_k= the callback logs a summary whose size does not grow with the model: the
    global norm, the largest absmax and its parameter's index, NaN/Inf totals and how many gradients the body shrank
    (`params="*"` logs every parameter's statistics)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=layers, n_head=2))
    hook = fh.grad_hook(lambda grad: grad.clamp(-0.01, 0.01), stats=("norm", "absmax", "nan", "inf"),
                        input_stats=("absmax",))
    trainer, model = _train(tmp_path, 0.0, 1, [FusedHooksCallback(hook)], max_steps=2, model=model)
    names = {n for n, _ in model.named_parameters()}
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 2
    for entry in logged:
        keys = {k for k in entry if k.startswith("grad/")}
        assert keys == {"grad/total_norm", "grad/absmax", "grad/absmax_index", "grad/nan", "grad/inf", "grad/shrunk"}
        assert hook.stats.names[entry["grad/absmax_index"]] in names and 0 < entry["grad/absmax"] <= 0.01
        assert entry["grad/nan"] == entry["grad/inf"] == 0 and 0 < entry["grad/shrunk"] <= len(names)
        assert entry["grad/total_norm"] > 0
