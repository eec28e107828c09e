"""Many gradients per backward: buckets, end-of-backward flush, paused(), set-to-none grads, checkpointing."""

import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fusedhooks as fh
from fusedhooks.testing import GPT2Config, gpt2, synthetic_batch

from helpers import count_launches


def clip(grad):
    return grad.clamp(-0.01, 0.01) * 0.5


def tiny_pair():
    """Two identical tiny GPT-2 models and a batch."""
    config = GPT2Config.tiny()
    torch.manual_seed(0)
    a = gpt2(config)
    b = gpt2(config)
    b.load_state_dict(a.state_dict())
    batch = synthetic_batch(config, batch=2, seq=16, generator=torch.Generator().manual_seed(0))
    return a, b, batch


def loss_of(model, batch):
    tokens, targets = batch
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


BUCKET_MB = 0.05


def bucketed_and_alone(make_hook, monkeypatch):
    """Two identical tiny GPT-2 models, hooks from make_hook(): one registered with BUCKET_MB buckets, one processing
    each gradient at its firing; one backward each. Returns the models, the hooks, every launch (the bucketed model's
    first) and how many the bucketed backward made; each gradient is the same bits both ways."""
    a, b, batch = tiny_pair()
    hook_a, hook_b = make_hook(), make_hook()
    hook_a.register(a, bucket_mb=BUCKET_MB)
    hook_b.register(b, bucket_mb=0)
    launches = count_launches(monkeypatch)
    loss_of(a, batch).backward()
    bucketed = len(launches)
    loss_of(b, batch).backward()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad), name
    return a, b, hook_a, hook_b, launches, bucketed


def launch_bound(model, passes: int) -> int:
    """One launch per pass per bucket of BUCKET_MB, and two buckets of slack."""
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return (math.ceil(total_bytes / (BUCKET_MB * 2**20)) + 2) * passes


@pytest.mark.parametrize("body, stats", [(clip, "all"), (lambda grad: grad / (grad.norm() + 1e-6), ("norm", "max"))],
                         ids=["clip_all_stats", "normalize"])
def test_bucketed_equals_unbucketed_and_launch_count(body, stats, monkeypatch):
    a, _, hook_a, hook_b, launches, bucketed = bucketed_and_alone(
        lambda: fh.grad_hook(body, stats=stats, input_stats="all", backend="triton"), monkeypatch)
    assert hook_a.stats.read() == hook_b.stats.read()
    assert bucketed <= launch_bound(a, hook_a.plan(numel=1 << 20).levels + 1)
    assert bucketed < len(launches) - bucketed                 # far fewer than one per parameter
    assert all(name.endswith("_multi") for name, _ in launches[:bucketed])


def test_launch_bound_holds_with_an_agc_hook(monkeypatch):
    """AGC reduces each unit (a row; the whole of a 1-d tensor): one kernel over whole units serves every shape of
    the model, so a bucket is one launch, and the bound above holds."""
    a, b, hook_a, hook_b, launches, bucketed = bucketed_and_alone(
        lambda: fh.agc(0.01, stats="all", backend="triton"), monkeypatch)
    rows_a, rows_b = hook_a.stats.read(), hook_b.stats.read()
    # statistics: partials over other programs (UNITS differs), merged in fp64; each program's sum of squares is a
    # float32 sum (of values scaled by a power of two: exact), each value added at most 16 times in its thread and 8
    # times across the 256 threads: within 24 * 2**-24 of the exact sum on either side, the norm within half that
    norm_rtol = 24 * 2.0 ** -24
    for name, row in rows_a.items():
        assert row["max"] == rows_b[name]["max"] and row["count"] == rows_b[name]["count"]
        assert row["norm"] == pytest.approx(rows_b[name]["norm"], rel=norm_rtol)
    passes = max(hook_a.plan(shape=p.shape, device="cpu").passes for p in a.parameters())
    assert passes == 1
    assert bucketed <= launch_bound(a, passes)
    assert {name for name, _ in launches[:bucketed]} == {"fused_hook_units_multi"}
    assert len(launches) - bucketed == len(list(b.parameters()))


def test_grads_are_final_when_backward_returns_and_explain_counts_launches(monkeypatch):
    a, _, batch = tiny_pair()
    hook = fh.grad_hook(clip, stats=("absmax",), backend="triton")
    hook.register(a, bucket_mb=0.05)
    launches = count_launches(monkeypatch)
    loss_of(a, batch).backward()
    assert all(p.grad.abs().max() <= 0.005 for p in a.parameters())
    report = hook.explain()
    assert report.launches_per_backward >= len(launches)
    assert "bucket" in str(report)


def test_set_to_none_grads_are_reallocated_every_step(monkeypatch):
    a, b, batch = tiny_pair()
    hook_a = fh.grad_hook(clip, stats=("norm",), backend="triton")
    hook_b = fh.grad_hook(clip, stats=("norm",), backend="triton")
    hook_a.register(a, bucket_mb=0.05)
    hook_b.register(b, bucket_mb=0)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    addresses = []
    for step in range(3):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad(set_to_none=True)
            spacers = [torch.empty(4096) for _ in range(step)]   # the new gradients land elsewhere
            loss_of(model, batch).backward()
            opt.step()
            del spacers
        addresses.append(tuple(p.grad.data_ptr() for p in a.parameters()))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert hook_a.stats.read() == hook_b.stats.read()
    assert len(set(addresses)) > 1, "the test must move the gradients"


def test_paused_accumulates_and_processes_the_last_micro_batch():
    a, b, batch = tiny_pair()
    hook_a = fh.grad_hook(clip, stats=("norm",), input_stats=("norm",), backend="triton")
    hook_a.register(a, bucket_mb=0.05)
    for micro in range(3):
        if micro < 2:
            with hook_a.paused():
                loss_of(a, batch).backward()
        else:
            loss_of(a, batch).backward()
    for _ in range(3):   # the same accumulation in eager torch, clipped once at the end
        loss_of(b, batch).backward()
    for p, q in zip(a.parameters(), b.parameters()):
        expected = q.grad.clamp(-0.01, 0.01) * 0.5
        assert torch.allclose(p.grad, expected, rtol=0, atol=1e-7)
    read = hook_a.stats.read()
    for name, q in b.named_parameters():   # recorded once, on the accumulated gradient
        assert read[name]["input.norm"] == pytest.approx(q.grad.double().norm().item(), rel=1e-5)


class _Segmented(torch.nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.shared = torch.nn.Linear(8, 8)
        self.reentrant = reentrant

    def forward(self, x):
        y = checkpoint(self.shared, x, use_reentrant=self.reentrant)
        return self.shared(y).sum()


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_fires_like_torch_and_buckets_process_once(reentrant):
    """Reentrant checkpointing fires a parameter's hook twice in one backward, the first time on a partial
    gradient (torch's behaviour, shown by a counting eager hook). Unbucketed, a compiled hook runs at both
    firings, as an eager hook would; bucketed, the gradient is processed once, at the end of backward."""
    torch.manual_seed(0)
    m = _Segmented(reentrant)
    x = torch.randn(4, 8, requires_grad=True)
    firings = []
    handle = m.shared.weight.register_post_accumulate_grad_hook(lambda p: firings.append(p.grad.clone()))
    m(x).backward()
    handle.remove()
    assert len(firings) == (2 if reentrant else 1)
    full = m.shared.weight.grad.clone()
    for bucket_mb, expected_scale in ((0, 0.5 ** len(firings)), (25, 0.5)):
        m.zero_grad()
        hook = fh.grad_hook(lambda grad: grad * 0.5, backend="triton")
        with hook.register(m, bucket_mb=bucket_mb):
            m(x).backward()
        if reentrant and bucket_mb == 0:
            # the first firing halved the partial gradient, then the rest accumulated onto it
            assert not torch.allclose(m.shared.weight.grad, full * expected_scale)
        else:
            assert torch.allclose(m.shared.weight.grad, full * expected_scale)


def test_hook_called_by_hand_outside_backward_still_fires():
    p = torch.zeros(5, requires_grad=True)
    hook = fh.grad_hook(lambda grad: grad * 2, backend="triton")
    hook.register([p], bucket_mb=25)
    p.grad = torch.ones(5)
    for torch_hook in p._post_accumulate_grad_hooks.values():   # as autograd would call it, but by hand
        torch_hook(p)
    assert torch.equal(p.grad, torch.full((5,), 2.0))


def test_bad_bucket_size_is_refused():
    with pytest.raises(ValueError, match="bucket_mb"):
        fh.grad_hook(clip).register(torch.nn.Linear(2, 2), bucket_mb=-1)


@pytest.mark.parametrize("bucket_mb", [0, BUCKET_MB])
def test_explain_bounds_the_launches_of_a_body_planned_per_shape(bucket_mb, monkeypatch):
    a, _, batch = tiny_pair()
    hook = fh.grad_hook(lambda g: g - g.mean(dim=0), backend="triton")  # columns: two passes for each matrix
    hook.register(a, bucket_mb=bucket_mb)
    report = hook.explain()
    launches = count_launches(monkeypatch)
    loss_of(a, batch).backward()
    assert 0 < len(launches) <= report.launches_per_backward
    assert ("planned per shape" in str(report)) == bool(bucket_mb)
