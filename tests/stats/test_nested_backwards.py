"""Nested backwards (reentrant activation checkpointing) count as part of the backward the user started, whatever
order they fire in: a grid of checkpoint placements x gates x (per firing, buckets) x backends against plain eager
post-accumulate hooks with the same body (torch's own behaviour, the yardstick)."""

import contextlib

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fusedhooks as fh
from fusedhooks.firing.amp import SAME_BACKWARD_MESSAGE
from fusedhooks.stats.backwards import NESTED_UNDER_COMPILED_AUTOGRAD, NestedCompiledBackwardError

from helpers import check_stats

STATS = ("norm", "absmax", "sum", "nan")
WIDTH = 6


def body(grad):
    """Clamped, then halved: applying it twice, or not at all, shows in the values."""
    return grad.clamp(-0.05, 0.05) * 0.5


class Lora(nn.Module):
    """A frozen base layer with a trainable low-rank adapter (PEFT's LoRA)."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.lora_a = nn.Linear(WIDTH, 2, bias=False)
        self.lora_b = nn.Linear(2, WIDTH, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


class Net(nn.Module):
    """Four tanh blocks; `placement` says which run under reentrant checkpointing: "first" (its nested backward
    fires last), "last" (fires before anything of the outer backward), "every", "shared" (the second of three layers
    used again last, each use checkpointed: its hook fires in both nested backwards), "peft" (frozen bases, adapters
    only inside checkpoints: no trainable parameter fires in the outer backward)."""

    def __init__(self, placement: str):
        super().__init__()
        torch.manual_seed(0)
        self.placement = placement
        blocks = 3 if placement == "shared" else 4
        self.blocks = nn.ModuleList(Lora() if placement == "peft" else nn.Linear(WIDTH, WIDTH) for _ in range(blocks))

    def forward(self, x):
        order = [0, 1, 2, 1] if self.placement == "shared" else [0, 1, 2, 3]
        checkpointed = {"first": {0}, "last": {3}, "every": {0, 1, 2, 3}, "shared": {1, 3},
                        "peft": {0, 1, 2, 3}}[self.placement]
        for i, index in enumerate(order):
            step = lambda h, block=self.blocks[index]: torch.tanh(block(h))  # noqa: E731
            x = checkpoint(step, x, use_reentrant=True) if i in checkpointed else step(x)
        return x


def trainable(model):
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def batch(step: int) -> torch.Tensor:
    # reentrant checkpointing needs an input that requires grad (PEFT's enable_input_require_grads)
    return torch.randn(5, WIDTH, generator=torch.Generator().manual_seed(step)).requires_grad_()


MODES = ["plain", "accumulation", "when", "paused", "scaler"]
PLACEMENTS = ["first", "last", "every", "shared", "peft"]
MICRO_BATCHES = {"plain": 1, "accumulation": 2, "when": 2, "paused": 2, "scaler": 2}
SCALE = 2.0 ** 10


def run_eager(placement: str, mode: str, steps: int):
    """The yardstick: a plain eager post-accumulate hook with the same body on every trainable parameter, run in the
    micro-batches that process (the last of each step); with a scaler, it unscales first, as scaler.unscale_ would,
    and each step ends with SGD's update. Returns the gradients after each step."""
    model = Net(placement)
    processing = [False]

    def hook(p):
        if processing[0]:
            grad = p.grad * (1.0 / SCALE) if mode == "scaler" else p.grad
            p.grad.copy_(body(grad))

    for _, p in trainable(model):
        p.register_post_accumulate_grad_hook(hook)
    out = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        for micro in range(MICRO_BATCHES[mode]):
            processing[0] = micro == MICRO_BATCHES[mode] - 1
            loss = model(batch(2 * step + micro)).sum() * 10
            (loss * SCALE if mode == "scaler" else loss).backward()
        out.append([p.grad.clone() for _, p in trainable(model)])
        if mode == "scaler":  # the step scaler.step(SGD(lr=0.1)) takes on the unscaled gradients
            with torch.no_grad():
                for _, p in trainable(model):
                    p.add_(p.grad, alpha=-0.1)
    return out


def run_fusedhooks(placement: str, mode: str, bucket_mb, backend: str, steps: int, check):
    """The same training with a fusedhooks hook registered as `mode` says; `check(model, hook, step)` after each
    step's last backward. Returns the gradients after each step, as run_eager."""
    model = Net(placement)
    params = trainable(model)
    scaler = optimizer = None
    if mode == "scaler":
        optimizer = torch.optim.SGD([p for _, p in params], lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000)
    hook = fh.grad_hook(body, stats=STATS, backend=backend, scaler=scaler, optimizer=optimizer)
    last = [False]
    options = {"accumulation": {"accumulation_steps": 2}, "scaler": {"accumulation_steps": 2},
               "when": {"when": lambda: last[0]}}.get(mode, {})
    hook.register(model, bucket_mb=bucket_mb, **options)
    out = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        for micro in range(MICRO_BATCHES[mode]):
            last[0] = micro == MICRO_BATCHES[mode] - 1
            paused = hook.paused() if mode == "paused" and not last[0] else contextlib.nullcontext()
            with paused:
                loss = model(batch(2 * step + micro)).sum() * 10
                (scaler.scale(loss) if scaler is not None else loss).backward()
            assert hook.stats.read().stale == [], f"step {step}, micro-batch {micro}"
        out.append([p.grad.clone() for _, p in params])
        check(model, hook, step)
        if scaler is not None:
            before = [p.detach().clone() for _, p in params]
            scaler.step(optimizer)  # the hook unscaled: steps on the gradients as they are, no second unscale
            scaler.update()
            for (_, p), p0, g in zip(params, before, out[-1]):
                assert torch.equal(p.detach(), p0.add(g, alpha=-0.1))
            assert scaler.get_scale() == SCALE
    return out


@pytest.mark.parametrize("bucket_mb", [None, 25], ids=["per-firing", "buckets"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_nested_backwards_give_eager_hooks_gradients_and_statistics(placement, mode, bucket_mb, backend):
    def check(model, hook, step):
        reading = hook.stats.read()
        names = [name for name, _ in trainable(model)]
        assert sorted(reading) == sorted(names)
        assert reading.stale == []
        scalars = hook.stats.to_scalars()
        assert {key.split("/")[1] for key in scalars} == set(names)
        for name, p in trainable(model):
            check_stats(reading[name], p.grad, STATS)
        total = torch.stack([p.grad.double().norm() for _, p in trainable(model)]).norm().item()
        assert hook.stats.to_scalars(top_k=1)["grad/total_norm"] == pytest.approx(total, rel=1e-5)

    if mode == "scaler" and placement == "shared":
        # the shared layer's first firing unscales a partial gradient to which the second checkpoint's backward then
        # adds scaled values: refused, naming that cause
        with pytest.raises(RuntimeError, match="fired twice on one gradient in the same backward") as raised:
            run_fusedhooks(placement, mode, bucket_mb, backend, 1, check)
        assert SAME_BACKWARD_MESSAGE in str(raised.value)
        return
    expected = run_eager(placement, mode, steps=2)
    actual = run_fusedhooks(placement, mode, bucket_mb, backend, 2, check)
    for step, (got, want) in enumerate(zip(actual, expected)):
        for g, e in zip(got, want):
            assert torch.equal(g, e), f"step {step}: {(g - e).abs().max()}"


def test_the_issue_example_clips_the_checkpointed_layer_once_per_step(backend):
    """A plain layer, then a reentrant-checkpointed one, accumulation_steps=2: the checkpointed layer's nested
    backward fires before the plain layer's; both micro-batches are one count each, and the second processes both."""
    torch.manual_seed(0)
    lin0, lin1 = nn.Linear(4, 4), nn.Linear(4, 4)
    hook = fh.grad_hook(lambda g: g.clamp(-0.01, 0.01), stats=("norm",), backend=backend)
    handle = hook.register(nn.ModuleList([lin0, lin1]), accumulation_steps=2)
    for i in range(2):
        (checkpoint(lin1, torch.tanh(lin0(torch.randn(8, 4))), use_reentrant=True) * 100).sum().backward()
        assert handle.when.backwards == i + 1
    for p in [*lin0.parameters(), *lin1.parameters()]:
        assert p.grad.abs().max() <= 0.01
    assert hook.stats.read().stale == []


@pytest.mark.parametrize("hook_kind", ["stats", "accumulation", "plain", "non-reentrant"])
def test_under_compiled_autograd_a_nested_backward_is_refused_where_it_would_be_miscounted(hook_kind):
    """Compiled autograd compiles a reentrant checkpoint's nested backward as a graph of its own, run from inside the
    outer one: a hook that counts backwards (statistics, gates) is refused there, naming the way out; a hook that
    counts nothing gives eager's gradients, and use_reentrant=False (one graph) counts one backward."""
    from torch._dynamo import compiled_autograd

    def run(use_fusedhooks):
        torch.manual_seed(0)
        lin0, lin1 = nn.Linear(4, 4), nn.Linear(4, 4)
        params = [*lin0.parameters(), *lin1.parameters()]
        hook = None
        if use_fusedhooks:
            hook = fh.grad_hook(body, stats=() if hook_kind in ("plain", "accumulation") else ("norm",))
            hook.register(nn.ModuleList([lin0, lin1]), accumulation_steps=2 if hook_kind == "accumulation" else None)
        else:
            def eager_hook(p):
                p.grad.copy_(body(p.grad))

            for p in params:
                p.register_post_accumulate_grad_hook(eager_hook)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
        with compiled_autograd._enable(torch.compile(backend="aot_eager")):
            hidden = torch.tanh(lin0(x))
            out = checkpoint(lin1, hidden, use_reentrant=hook_kind != "non-reentrant")
            (out * 100).sum().backward()
        return [p.grad for p in params], hook

    if hook_kind in ("stats", "accumulation"):
        with pytest.raises(Exception, match="use_reentrant=False") as raised:  # dynamo wraps what tracing raised
            run(True)
        assert (isinstance(raised.value, NestedCompiledBackwardError)
                or NestedCompiledBackwardError.__name__ in str(raised.value))
        assert NESTED_UNDER_COMPILED_AUTOGRAD in str(raised.value)
        return
    grads, hook = run(True)
    expected, _ = run(False)
    for g, e in zip(grads, expected):
        assert torch.equal(g, e)
    if hook_kind == "non-reentrant":
        assert sorted(hook.stats.read()) == ["0.bias", "0.weight", "1.bias", "1.weight"]
        assert hook.stats.read().stale == []
