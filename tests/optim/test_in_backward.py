"""The optimizer step inside the backward (`hook.register(model, optimizer=opt)`): each parameter stepped right after
its firing, its gradient freed. Against the same optimizer stepping after the backward (the same kernel on the same
gradients: bit for bit) and against torch's recipe (eager per-tensor clip hooks, then torch's fused step); the live
gradients during the backward; accumulation, a backward that raises, a parameter fired twice, the refusals."""

import logging

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import fusedhooks as fh

from helpers import (
    FORMS,
    REDUCTION_RTOL,
    RaisingBackward,
    RecompileLimitLog,
    assert_close_to,
    assert_same_steps,
    context,
    mlp,
)

CLIP = 0.02
OPTIMIZERS = {
    "adamw": lambda params: fh.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd": lambda params: fh.SGD(params, lr=1e-1, momentum=0.9, nesterov=True),
}


def clip_hook():
    """A per-tensor clip (elementwise: fusedhooks' equals torch's bit for bit) that also records statistics."""

    @fh.grad_hook(stats=("norm", "absmax"))
    def clip(g):
        return g.clamp(-CLIP, CLIP)

    return clip


def batches(dtype, n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=gen).to(dtype), torch.randn(16, 5, generator=gen).to(dtype))
            for _ in range(n)]


def loss_of(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_in_backward_equals_the_step_after_the_backward(name, dtype):
    """Five steps: stepping each parameter at its firing gives the parameters, states and statistics that the same
    optimizer stepping after the backward gives (the same kernel on the same clipped gradients); the gradients are
    freed (None) when backward() returns."""
    models = [mlp((8, 16, 5), dtype=dtype) for _ in range(2)]
    opts = [OPTIMIZERS[name](m.parameters()) for m in models]
    hooks = [clip_hook() for _ in range(2)]
    hooks[0].register(models[0], optimizer=opts[0])
    hooks[1].register(models[1])
    for batch in batches(dtype, 5):
        losses = []
        for model, opt in zip(models, opts):
            opt.zero_grad()
            loss = loss_of(model, batch)
            loss.backward()
            opt.step()  # a no-op for the parameters stepped in the backward
            losses.append(loss.item())
        assert losses[0] == losses[1]
        assert all(p.grad is None for p in models[0].parameters())
        assert_same_steps(models, opts)
        first, second = hooks[0].stats.read(), hooks[1].stats.read()
        for key in second:
            assert first[key]["norm"] == second[key]["norm"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_trains_as_per_tensor_clip_hooks_then_torchs_fused_step(name):
    """20 steps against torch's recipe: eager per-tensor clip hooks, then torch's fused optimizer after the backward;
    the same losses and parameters within a few fp32 ulps per step (the kernels' roundings against torch's)."""
    models = [mlp((8, 16, 5)) for _ in range(2)]
    opt = OPTIMIZERS[name](models[0].parameters())
    if name == "adamw":
        ref = torch.optim.AdamW(models[1].parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    else:
        ref = torch.optim.SGD(models[1].parameters(), lr=1e-1, momentum=0.9, nesterov=True, fused=True)
    clip_hook().register(models[0], optimizer=opt)
    def torch_clip(p):
        p.grad.clamp_(-CLIP, CLIP)

    for p in models[1].parameters():
        p.register_post_accumulate_grad_hook(torch_clip)
    steps = 20
    for step, batch in enumerate(batches(torch.float32, steps)):
        loss = loss_of(models[0], batch)
        loss.backward()
        ref.zero_grad()
        expected = loss_of(models[1], batch)
        expected.backward()
        ref.step()
        rtol = (step + 1) * 8 * 2**-24
        torch.testing.assert_close(loss, expected, rtol=rtol, atol=0)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p, q, rtol=steps * 8 * 2**-24, atol=steps * 8 * 2**-24 * q.abs().max().item())


def live_gradients_during_backward(model, register):
    """The most `.grad` tensors of `model` alive at once during one backward, counted at each firing by a hook that
    runs after fusedhooks' (registered later)."""
    params = list(model.parameters())
    register(model)
    counts = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda _: counts.append(sum(q.grad is not None for q in params)))
    loss_of(model, batches(torch.float32, 1)[0]).backward()
    return max(counts)


def test_no_gradient_outlives_its_firing():
    """The peak of live gradients during the backward: every parameter's without optimizer= (they all live until the
    step), none with it (each freed at its firing, before the next is accumulated); with keep_grads=True all."""
    model = mlp((8, 16, 5))
    n = len(list(model.parameters()))
    assert live_gradients_during_backward(mlp((8, 16, 5)), lambda m: clip_hook().register(m)) == n
    opt = fh.AdamW(model.parameters())
    assert live_gradients_during_backward(model, lambda m: clip_hook().register(m, optimizer=opt)) == 0
    kept = mlp((8, 16, 5))
    opt = fh.AdamW(kept.parameters())
    assert live_gradients_during_backward(kept, lambda m: clip_hook().register(m, optimizer=opt,
                                                                              keep_grads=True)) == n
    assert all(p.grad is not None for p in kept.parameters())


def test_accumulation_steps_step_on_the_accumulated_gradient():
    """accumulation_steps=2: the first micro-batch's gradients stay (nothing stepped), the second's firing steps on
    their sum and frees it; bit for bit the optimizer stepping after two accumulated backwards."""
    models = [mlp((8, 16, 5)) for _ in range(2)]
    opts = [fh.AdamW(m.parameters(), lr=1e-2) for m in models]
    clip_hook().register(models[0], optimizer=opts[0], accumulation_steps=2)
    clip_hook().register(models[1], accumulation_steps=2)
    data = batches(torch.float32, 6)
    for i in range(0, 6, 2):
        for model in models:
            loss_of(model, data[i]).backward()
        assert all(p.grad is not None for p in models[0].parameters())
        assert all("step" not in opts[0].state[p] or opts[0].state[p]["step"].item() == i // 2
                   for p in models[0].parameters())
        for model in models:
            loss_of(model, data[i + 1]).backward()
        opts[1].step()
        opts[1].zero_grad()
        assert all(p.grad is None for p in models[0].parameters())
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(p, q) and opts[0].state[p]["step"].item() == i // 2 + 1


def test_a_backward_that_raises_steps_what_fired_once_and_nothing_else():
    """A backward that raises half-way: the layer behind the raise (fired) is stepped once and its gradient freed,
    the one before it never fired: no state, no gradient. The next backward steps each once more."""
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    opt = fh.AdamW(list(first.parameters()) + list(second.parameters()), lr=1e-2)
    clip_hook().register(torch.nn.ModuleList([first, second]), optimizer=opt)
    x = torch.randn(3, 4)
    with pytest.raises(FloatingPointError):
        second(RaisingBackward.apply(first(x))).sum().backward()
    assert all(opt.state[p]["step"].item() == 1 and p.grad is None for p in second.parameters())
    assert all(not opt.state[p] and p.grad is None for p in first.parameters())
    second(first(x)).sum().backward()
    assert all(opt.state[p]["step"].item() == 2 for p in second.parameters())
    assert all(opt.state[p]["step"].item() == 1 for p in first.parameters())


def test_a_parameter_fired_twice_in_one_backward_is_refused_not_stepped_twice():
    """A layer used inside a reentrant checkpoint and outside it fires twice in one backward: the second firing is
    refused (the first stepped from a partial gradient); with use_reentrant=False it fires once and steps once."""
    layer = torch.nn.Linear(4, 4)
    opt = fh.SGD(layer.parameters(), lr=0.1)
    clip_hook().register(layer, optimizer=opt)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="fired twice in one backward"):
        layer(checkpoint(layer, x, use_reentrant=True)).sum().backward()
    before = [p.detach().clone() for p in layer.parameters()]
    layer(checkpoint(layer, x, use_reentrant=False)).sum().backward()
    assert all(not torch.equal(b, p) for b, p in zip(before, layer.parameters()))


def test_the_step_after_the_backward_leaves_them_alone_until_remove():
    """keep_grads=True: opt.step() after the backward does not step the parameters stepped in it again; after the
    registration's remove() it does."""
    model = mlp((8, 16, 5))
    opt = fh.AdamW(model.parameters(), lr=1e-2)
    handle = clip_hook().register(model, optimizer=opt, keep_grads=True)
    loss_of(model, batches(torch.float32, 1)[0]).backward()
    opt.step()
    assert all(opt.state[p]["step"].item() == 1 for p in model.parameters())
    handle.remove()
    opt.step()
    assert all(opt.state[p]["step"].item() == 2 for p in model.parameters())


def test_a_schedule_sets_the_lr_of_the_next_firings():
    """LambdaLR between steps: each firing reads its group's lr then; the same as stepping after the backward."""
    models = [mlp((8, 16, 5)) for _ in range(2)]
    opts = [fh.SGD(m.parameters(), lr=0.1) for m in models]
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (1 + step)) for o in opts]
    clip_hook().register(models[0], optimizer=opts[0])
    clip_hook().register(models[1])
    for batch in batches(torch.float32, 3):
        for model, opt, schedule in zip(models, opts, schedules):
            opt.zero_grad()
            loss_of(model, batch).backward()
            opt.step()
            schedule.step()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)


def test_refusals():
    model = mlp((8, 16, 5))
    opt = fh.AdamW(model.parameters())
    with pytest.raises(TypeError, match="fh.AdamW or fh.SGD"):
        clip_hook().register(model, optimizer=torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="not parameters of this AdamW"):
        clip_hook().register(model, optimizer=fh.AdamW(model[0].parameters()))
    with pytest.raises(ValueError, match="bucket_mb"):
        clip_hook().register(model, optimizer=opt, bucket_mb=1)
    with pytest.raises(ValueError, match="goes with optimizer="):
        clip_hook().register(model, keep_grads=True)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="scaler="):
        fh.grad_hook(stats=("norm",), scaler=scaler, optimizer=opt).register(model, optimizer=opt)
    hook = clip_hook()
    hook.register(model, optimizer=opt)
    loss_of(model, batches(torch.float32, 1)[0]).backward()
    with pytest.raises(ValueError, match="before the later gradients exist"):
        fh.clip_grad_norm_(hook, 1.0)
    with pytest.raises(ValueError, match="would clip the step after a spike, not the spike"):
        fh.zclip(hook, warmup_steps=1).step()
    # nothing was left registered by the refusals: each parameter stepped once
    assert all(opt.state[p]["step"].item() == 1 for p in model.parameters())


COMPILED_OPTIMIZERS = {
    "adamw-amsgrad": lambda params: fh.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "sgd-dampening": lambda params: fh.SGD(params, lr=1e-1, momentum=0.9, dampening=0.1),
    "adamw-master-bf16": lambda params: fh.AdamW(params, lr=1e-2, master_weights=True),  # stepped outside the graph
}
#: (form, compile backend, optimizer) of the compiled training steps (helpers.FORMS): compiled autograd on, except in
#: the last; SGD's momentum buffer (unwritten when made in the graph) where the backward is functionalized
COMPILED = [(form, backend, "adamw-amsgrad") for form, backend in (
    ("config-flag", "eager"), ("config-flag", "aot_eager"), ("enable", "aot_eager"),
    ("helper-fullgraph-dynamic", "inductor"), ("compiled-step", "aot_eager"))]
COMPILED += [(form, backend, "sgd-dampening") for form, backend in (("config-flag", "aot_eager"),
                                                                    ("config-flag", "inductor"))]
COMPILED += [("config-flag", "aot_eager", "adamw-master-bf16")]


def train_compiled(form, compile_backend, optimizer, steps=5, in_backward=True, adagc=False):
    """`steps` backwards of a 14-parameter model (more than dynamo's recompile limit) with a clip hook (`adagc`:
    fh.adaptive_clip) stepping `optimizer` in the backward (not `in_backward`: after it) and a LambdaLR schedule,
    compiled as `form` says (None: eager). Returns the model, the optimizer, the graphs compiled after the third
    backward, dynamo's recompile-limit messages and the graph breaks' reasons."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if optimizer.endswith("bf16") else torch.float32
    model = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(8, 8), torch.nn.Tanh())],
                                torch.nn.Linear(8, 5)).to(dtype)
    opt = COMPILED_OPTIMIZERS[optimizer](model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    clip = fh.adaptive_clip(warmup_steps=2, max_norm=0.05) if adagc else clip_hook()
    clip.register(model, optimizer=opt if in_backward else None)

    def step(batch):
        loss_of(model, batch).backward()

    if form == "config-flag":  # read when torch.compile wraps the step
        torch._dynamo.config.compiled_autograd = True
    run = step if form is None else torch.compile(step, backend=compile_backend)
    log = RecompileLimitLog()
    logging.getLogger("torch._dynamo").addHandler(log)
    graphs = 0
    try:
        for i, batch in enumerate(batches(dtype, steps)):
            with context(form, compile_backend):
                run(batch)
            assert all(p.grad is None for p in model.parameters()) == in_backward
            opt.step()  # in_backward: steps nothing (as training code calls it)
            opt.zero_grad()
            schedule.step()
            if i == 2:
                graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.config.compiled_autograd = False
        logging.getLogger("torch._dynamo").removeHandler(log)
    return model, opt, counters["stats"]["unique_graphs"] - graphs, log.hits, list(counters["graph_break"])


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize(("form", "compile_backend", "optimizer"), COMPILED, ids=["-".join(c) for c in COMPILED])
def test_a_compiled_backward_traces_each_step(form, compile_backend, optimizer):
    """Where compiled autograd traces the backward, each parameter's firing and step are in its graph (the step one
    fusedhooks::step_in_backward call on the parameter, its gradient and its state, made in the graph at the first
    backward): no graph break but the compiled step's own at backward(), no graph compiled after the third
    backward while the schedule changes lr, no recompile-limit warning, and eager's parameters and states bit for bit
    (inductor: its backward rounds the model's gradients its own way). With compiled autograd off, and for
    parameters with fp32 master weights, the step runs outside the graph, with the same results."""
    model, opt, recompiled, limit_hits, breaks = train_compiled(form, compile_backend, optimizer)
    counters.clear()
    # inductor rounds the model's own backward its own way: against the same compiled backward stepping after it
    expected = train_compiled(form if compile_backend == "inductor" else None, compile_backend, optimizer,
                              in_backward=compile_backend != "inductor")
    assert_same_steps([model, expected[0]], [opt, expected[1]])
    assert limit_hits == []
    assert recompiled == 0, f"{recompiled} graphs compiled after warm-up"
    outside = [reason for reason in breaks if "torch.compiler.disable" in reason]
    assert (outside != []) == (not FORMS[form] or "master" in optimizer), breaks


@pytest.mark.usefixtures("fresh_dynamo")
def test_adagc_in_a_compiled_backward_steps_outside_the_graph():
    """fh.adaptive_clip(...).register(model, optimizer=opt) under compiled autograd: the firing's state update is
    Python, so the update and the step run outside the graph from the start (nothing traced per parameter before
    the break): no recompile-limit warning on 14 parameters, and eager's parameters within the rounding of the
    traced firing's norm (its plan as torch ops on the CPU, where eager runs the kernel)."""
    model, _, _, limit_hits, breaks = train_compiled("config-flag", "aot_eager", "sgd-dampening", adagc=True)
    counters.clear()
    expected = train_compiled(None, "aot_eager", "sgd-dampening", adagc=True)[0]
    for p, q in zip(model.parameters(), expected.parameters()):
        assert_close_to(p, q, REDUCTION_RTOL[torch.float32])
    assert limit_hits == []
    assert any("torch.compiler.disable" in reason for reason in breaks)


def test_adagc_clips_then_steps_each_parameter_in_the_backward():
    """fh.adaptive_clip(...).register(model, optimizer=opt): AdaGC's per-tensor clip, its state's update, then the
    step, at each firing: bit for bit AdaGC then the step after the backward (parameters, moments, AdaGC's state),
    with every gradient freed."""
    models = [mlp((8, 16, 5)) for _ in range(2)]
    opts = [fh.AdamW(m.parameters(), lr=1e-2) for m in models]
    clips = [fh.adaptive_clip(warmup_steps=2, max_norm=0.05) for _ in range(2)]
    clips[0].register(models[0], optimizer=opts[0])
    clips[1].register(models[1])
    for batch in batches(torch.float32, 5):
        for model, opt in zip(models, opts):
            opt.zero_grad()
            loss_of(model, batch).backward()
            opt.step()
        assert all(p.grad is None for p in models[0].parameters())
    assert_same_steps(models, opts)
    for name in clips[1].stats.names:
        assert torch.equal(clips[0].state(name), clips[1].state(name))
    with pytest.raises(TypeError, match="fh.AdamW or fh.SGD"):
        fh.adaptive_clip().register(mlp((8, 16, 5)), optimizer=object())


def test_the_firings_of_one_step_share_the_hyper_parameters_copy(monkeypatch):
    """The hyper-parameters go to the device once per step, not once per firing; again when a schedule changes lr."""
    from fusedhooks.runtime import launcher

    copies = []
    real = launcher.host_to_device
    monkeypatch.setattr(launcher, "host_to_device", lambda values, *rest: copies.append(values) or real(values, *rest))
    model = mlp((8, 16, 5))
    opt = fh.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    clip_hook().register(model, optimizer=opt)
    data = batches(torch.float32, 3)
    for batch in data[:2]:
        loss_of(model, batch).backward()
        opt.step()  # as training code calls it (steps nothing here; LR schedulers expect it)
    assert len(copies) == 1 and copies[0][0] == 0.1
    schedule.step()
    loss_of(model, data[2]).backward()
    assert len(copies) == 2 and copies[1][0] == 0.05


def test_clip_by_the_previous_steps_global_norm_inside_the_backward():
    """docs/optimizers.md's recipe: a body scaling by a device coefficient, set after each backward from that step's
    total input norm read on the device (`hook.stats.tensor`, no sync): each step clips by the previous step's global
    norm. Stepped inside the backward, the parameters equal the same hook then the same optimizer after the backward
    bit for bit; the coefficient is min(1, max_norm / the previous step's unclipped total norm)."""
    max_norm = 0.05
    models = [mlp((8, 16, 5)) for _ in range(2)]
    opts = [OPTIMIZERS["sgd"](m.parameters()) for m in models]
    coefs = [torch.ones(()) for _ in range(2)]

    def scaled_by(coef):
        return fh.grad_hook(lambda g: g * coef, input_stats=("norm",))

    hooks = [scaled_by(c) for c in coefs]
    hooks[0].register(models[0], optimizer=opts[0])
    hooks[1].register(models[1])
    clipped = 0
    for batch in batches(torch.float32, 4):
        for model, opt, hook, coef in zip(models, opts, hooks, coefs):
            opt.zero_grad()
            loss_of(model, batch).backward()
            if model is models[1]:
                unclipped = torch.linalg.vector_norm(torch.stack([
                    torch.linalg.vector_norm(p.grad.double() / coef.double()) for p in model.parameters()]))
            opt.step()
            norms = hook.stats.tensor[:, hook.stats.slot_names.index("input.norm")]
            total = torch.linalg.vector_norm(norms.nan_to_num(0.0))
            coef.copy_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        assert_same_steps(models, opts)
        assert torch.equal(coefs[0], coefs[1])
        torch.testing.assert_close(total, unclipped, rtol=1e-5, atol=0)
        clipped += int(coefs[0].item() < 1)
    assert clipped >= 2, "the recipe never clipped: max_norm is too large for the test to check anything"
