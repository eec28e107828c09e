"""fh.adaptive_clip (AdaGC) against a plain torch implementation of the same equations, over many steps."""

import math

import pytest
import torch

import fusedhooks as fh


def adagc_reference(grads_per_step, beta, ratio, warmup_steps, max_norm):
    """Plain torch AdaGC, per tensor; returns the clipped gradients of every step and the final gammas."""
    n = len(grads_per_step[0])
    gamma = [math.inf] * n
    out = []
    for t, grads in enumerate(grads_per_step):
        clipped = []
        for i, g in enumerate(grads):
            norm = g.float().norm()
            limit = max_norm if t < warmup_steps else ratio * gamma[i]
            h = torch.clamp(limit / norm, max=1.0) if norm > 0 else torch.tensor(1.0)
            c = g * h
            cn = c.float().norm().item()
            gamma[i] = min(gamma[i], cn) if t < warmup_steps else beta * gamma[i] + (1 - beta) * cn
            clipped.append(c)
        out.append(clipped)
    return out, gamma


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_adaptive_clip_matches_torch_over_many_steps(dtype, backend, monkeypatch):
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", "64")     # the 300-element tensor takes two passes
    shapes = [(300,), (7, 3), (1,), (0,)]
    params = [torch.zeros(s, dtype=dtype, requires_grad=True) for s in shapes]
    gen = torch.Generator().manual_seed(0)
    steps = []
    for t in range(30):
        spike = 50.0 if t in (12, 20) else 1.0          # loss spikes: AdaGC must clip them
        steps.append([(torch.randn(s, generator=gen) * spike * (1 + i)).to(dtype) for i, s in enumerate(shapes)])
    expected, gammas = adagc_reference(steps, beta=0.9, ratio=1.05, warmup_steps=5, max_norm=2.0)
    clip = fh.adaptive_clip(beta=0.9, ratio=1.05, warmup_steps=5, max_norm=2.0, backend=backend)
    clip.register([(f"p{i}", p) for i, p in enumerate(params)])
    for t, grads in enumerate(steps):
        for p, g, e in zip(params, grads, expected[t]):
            p.grad = g.clone()
            for hook in p._post_accumulate_grad_hooks.values():
                hook(p)
            torch.testing.assert_close(p.grad, e, rtol=1e-5 if dtype == torch.float32 else 1.6e-2, atol=1e-6)
    state = clip.stats.read()
    for i, g in enumerate(gammas):
        if shapes[i] != (0,):
            assert state[f"p{i}"]["norm_ema"] == pytest.approx(g, rel=1e-5 if dtype == torch.float32 else 2e-2)
            assert state[f"p{i}"]["step"] == 30
            assert state[f"p{i}"]["norm"] == pytest.approx(expected[-1][i].double().norm().item(), rel=1e-5)


def test_adaptive_clip_in_a_training_loop_clips_spikes():
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    clip = fh.adaptive_clip(warmup_steps=3, max_norm=10.0)
    clip.register(model)
    x = torch.randn(64, 16)
    for step in range(8):
        model.zero_grad()
        scale = 1000.0 if step == 7 else 1.0
        (model(x).pow(2).sum() * scale).backward()
    stats = clip.stats.read()["weight"]
    assert stats["input.norm"] > 100 * stats["norm"]                      # the spike was clipped...
    assert stats["norm"] == pytest.approx(1.05 * stats["norm_ema"] / (0.98 + 0.02 * 1.05), rel=1e-4)  # ...to ratio*EMA


def test_adaptive_clip_refuses_bad_options():
    with pytest.raises(ValueError, match="beta"):
        fh.adaptive_clip(beta=1.0)
    with pytest.raises(ValueError, match="ratio"):
        fh.adaptive_clip(ratio=0)
    for option, bad in [("ratio", math.nan), ("max_norm", math.nan), ("max_norm", math.inf), ("ratio", True),
                        ("warmup_steps", 2.5), ("warmup_steps", True), ("warmup_steps", -1)]:
        with pytest.raises(ValueError, match=option):
            fh.adaptive_clip(**{option: bad})
    clip = fh.adaptive_clip()
    with pytest.raises(ValueError, match="require"):
        clip.register(torch.zeros(3))


def test_a_non_finite_gradient_leaves_the_state_as_it_was(backend):
    """An overflow (which GradScaler skips) clips to NaN; the EMA of the clipped norms must not become NaN."""
    p = torch.zeros(4, requires_grad=True)
    clip = fh.adaptive_clip(warmup_steps=1, max_norm=2.0, backend=backend)
    clip.register(p, name="p")
    (p * torch.tensor([1.0, 1.0, 0.0, 0.0])).sum().backward()   # warm-up: gamma = ||g|| = sqrt(2)
    gamma = clip.state("p")[0].item()
    p.grad = None
    (p * torch.tensor([math.inf, 1.0, 1.0, 1.0])).sum().backward()
    assert clip.state("p")[0].item() == gamma
    p.grad = None
    (p * torch.tensor([3.0, 0.0, 0.0, 0.0])).sum().backward()
    assert torch.isfinite(p.grad).all() and p.grad[0].item() == pytest.approx(1.05 * gamma, rel=1e-6)


@pytest.mark.parametrize("how", ["accumulation_steps", "paused"])
def test_gradient_accumulation_clips_and_steps_once_per_accumulated_gradient(how, backend):
    def run():
        p = torch.zeros(3, requires_grad=True)
        clip = fh.adaptive_clip(warmup_steps=1, max_norm=1.0, backend=backend)
        clip.register(p, name="p", accumulation_steps=2 if how == "accumulation_steps" else None)
        for step in range(3):
            for micro in range(2):
                g = torch.tensor([1.0, 2.0, 2.0]) * (step + 1) * (micro + 1)
                if how == "paused" and micro == 0:
                    with clip.paused():
                        (p * g).sum().backward()
                else:
                    (p * g).sum().backward()
            yield p.grad.clone()
            p.grad = None
        yield clip.stats.read()["p"]["step"]

    expected = adagc_reference([[torch.tensor([1.0, 2.0, 2.0]) * (s + 1) * 3] for s in range(3)], beta=0.98,
                               ratio=1.05, warmup_steps=1, max_norm=1.0)[0]
    got = list(run())
    for step in range(3):
        torch.testing.assert_close(got[step], expected[step][0], rtol=1e-6, atol=0)
    assert got[3] == 3  # one step per accumulated gradient


def test_accumulation_steps_count_micro_batches_once_for_every_tensor(backend):
    """A parameter reached from the second micro-batch on (a conditional layer) is clipped on the accumulated
    gradient at the end of each window, as GradHook.register(model, accumulation_steps=) counts: one count per
    registration, not per tensor."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    clip = fh.adaptive_clip(warmup_steps=100, max_norm=1e-3, backend=backend)
    clip.register(torch.nn.ModuleDict({"a": a, "b": b}), accumulation_steps=2)
    x = torch.randn(8, 4)
    for i in range(4):  # two windows of two micro-batches
        y = a(x)
        if i > 0:
            y = b(y)
        y.pow(2).sum().mul(100).backward()
    assert b.weight.grad.norm().item() <= 1e-3 * (1 + 1e-5)  # clipped at micro-batch 4, the end of its window
    assert clip.stats.read()["b.weight"]["step"] == clip.stats.read()["a.weight"]["step"] == 2  # micro-batches 2, 4


def test_stats_read_like_a_grad_hooks(backend):
    """clip.stats: read() rows with fresh/stale, to_scalars with its selection, reset(); the EMA is "norm_ema"
    (read() keeps its former name "gamma" too)."""
    a, b = torch.zeros(5, requires_grad=True), torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    clip = fh.adaptive_clip(warmup_steps=1, max_norm=1.0, backend=backend)
    clip.register([("enc.a", a), ("dec.b", b)])
    assert clip.stats.names == ["enc.a", "dec.b"] and clip.stats.read() == {} and clip.stats.to_scalars() == {}
    ga, gb = torch.tensor([3.0, 4.0, 0.0, 0.0, 0.0]), torch.tensor([0.5, 0.0, 0.0])
    ((a * ga).sum() + (b * gb).sum().float()).backward()  # warm-up: a clipped to norm 1, b (norm 0.5) as it is
    reading = clip.stats.read()
    assert reading.stale == [] and reading["enc.a"]["step"] == 1
    assert reading["enc.a"]["input.norm"] == pytest.approx(5.0, rel=1e-6)
    assert reading["enc.a"]["norm"] == pytest.approx(1.0, rel=1e-6) == reading["enc.a"]["norm_ema"]
    assert reading["dec.b"]["norm"] == reading["dec.b"]["norm_ema"] == 0.5
    assert clip.read()["enc.a"]["gamma"] == reading["enc.a"]["norm_ema"]
    a.grad = None
    (a * ga).sum().backward()  # b gets no gradient: its row is stale, left out of to_scalars
    reading = clip.stats.read()
    assert reading.stale == ["dec.b"] and reading["dec.b"]["step"] == 1 and reading["enc.a"]["step"] == 2
    assert clip.stats.to_scalars(stats=("norm", "step")) == {"grad/enc.a/norm": reading["enc.a"]["norm"],
                                                             "grad/enc.a/step": 2}
    assert clip.stats.to_scalars(params="dec.*") == {}
    assert list(clip.stats.to_scalars(top_k=0, prefix="")) == ["total_norm"]
    with pytest.raises(ValueError, match="'gamma', which is no statistic: this hook records \\['norm', "
                                         "'input.norm', 'norm_ema', 'step'\\]"):
        clip.stats.to_scalars(stats="gamma")
    with pytest.raises(ValueError, match="params= pattern 'encoder.\\*' matches none"):
        clip.stats.to_scalars(params="encoder.*")
    clip.stats.reset()
    assert clip.stats.read() == {} and clip.state("enc.a")[1].item() == 2  # the clipping state is kept
