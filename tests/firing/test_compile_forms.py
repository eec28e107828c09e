"""Every way training code compiles a step, on a model with more parameters (24) than dynamo's recompile limit (8):
no error, no recompile-limit warning, no graph compiled after warm-up, eager's gradients and statistics at every
step (a layer skipped every third step: stale rows), with fh.clip_grad_norm_ inside the step and with scaler=;
where compiled autograd is on, no Python of fusedhooks in a warm backward (docs/compile.md, "Compile forms")."""

import logging

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import fusedhooks as fh
from fusedhooks.testing import python_calls

from helpers import FORMS, HELPERS, REDUCTION_RTOL, RecompileLimitLog, assert_same, context

STATS = ("norm", "max", "nan", "std")
LAYERS = 12
STEPS = 6



class Deep(nn.Module):
    """LAYERS tanh layers of 8 features; the sixth is left out of the forward while `skip` is set (its rows go
    stale)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(LAYERS))
        self.skip = False

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if not (self.skip and i == 5):
                x = torch.tanh(layer(x))
        return x


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def train(form: str | None, compile_backend: str, clip: bool, scaler: bool):
    """STEPS SGD steps of Deep with a clip-scale-and-statistics hook (scaler=: unscaling for a GradScaler), the step
    compiled as `form` says (None: eager), fh.clip_grad_norm_ inside the step when `clip`. Returns the gradients and
    read() after each step, the fusedhooks Python calls of each warm step (after the first three: one of each graph),
    the graphs compiled after them, and dynamo's recompile-limit messages."""
    model = Deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000) if scaler else None
    # the eager CPU backend (the default off the Triton interpreter): the Triton kernels of these firings are tested
    # in test_compile.py; under compiled autograd every backend's firing is the traced plan
    hook = fh.grad_hook(lambda g: g.clamp(-0.01, 0.01) * 0.5, stats=STATS, backend="eager",
                        scaler=grad_scaler, optimizer=opt if scaler else None)
    hook.register(model)
    forward = torch.compile(model, backend=compile_backend) if form == "compiled-model" else model

    def step(x):
        loss = forward(x).square().sum()
        (grad_scaler.scale(loss) if scaler else loss).backward()
        if clip:
            fh.clip_grad_norm_(hook, 0.05)
        return loss

    if form == "config-flag":  # read when torch.compile wraps the step
        torch._dynamo.config.compiled_autograd = True
    run = step if form in (None, "compiled-model") else torch.compile(step, backend=compile_backend)
    log = RecompileLimitLog()
    logging.getLogger("torch._dynamo").addHandler(log)
    g = torch.Generator().manual_seed(2)
    out, calls, graphs = [], [], None
    try:
        for i in range(STEPS):
            model.skip = i % 3 == 2
            x = torch.randn(5, 8, generator=g)
            with context(form, compile_backend):
                if i >= 3:  # warm (counting calls slows the compiles of the first steps down many times)
                    calls.append(python_calls(lambda x=x: run(x)))
                else:
                    run(x)
            if i == 2:
                graphs = counters["stats"]["unique_graphs"]
            out.append(({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                        hook.stats.read()))
            if scaler:
                grad_scaler.step(opt)
                grad_scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=False)
    finally:
        torch._dynamo.config.compiled_autograd = False
        logging.getLogger("torch._dynamo").removeHandler(log)
    return out, calls, counters["stats"]["unique_graphs"] - graphs, log.hits


CASES = [(form, "inductor" if form in HELPERS else "aot_eager", variant) for form in FORMS
         for variant in ("plain", "scaler-clip")]
CASES += [(form, "inductor", "plain") for form in FORMS if form not in HELPERS]


@pytest.mark.parametrize(("form", "compile_backend", "variant"), CASES, ids=["-".join(c) for c in CASES])
def test_every_compile_form_matches_eager_without_recompiles(form, compile_backend, variant):
    clip = scaler = variant == "scaler-clip"
    expected, _, _, _ = train(None, compile_backend, clip, scaler)
    got, calls, recompiled, limit_hits = train(form, compile_backend, clip, scaler)
    # inductor fuses the model's own backward (tanh's derivative), rounding its gradients its own way; the clip's
    # coefficient comes from a total norm, which the traced firing's float64 plan and the eager backend round apart
    reduced = compile_backend == "inductor" or clip
    assert_same(got, expected, grads_rtol=REDUCTION_RTOL[torch.float32] if reduced else 0.0)
    assert any(stats.stale for _, stats in expected)  # the skipped layer's rows went stale
    assert limit_hits == []
    assert recompiled == 0, f"{recompiled} graphs compiled after warm-up"
    if FORMS[form]:
        assert calls == [0] * (STEPS - 3), f"fusedhooks Python ran in warm compiled-autograd steps: {calls}"
