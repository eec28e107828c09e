"""The GPT-2 model of fusedhooks.testing: its size, its forward, that it trains, and that hooks fire on it."""

import math

import torch

import fusedhooks as fh
from fusedhooks.testing import GPT2Config, count_parameters, gpt2, synthetic_batch, train_step


def test_full_size_is_gpt2_small():
    model = gpt2(device="meta")  # no memory allocated: only shapes
    assert abs(count_parameters(model) - 124_000_000) <= 1_000_000
    assert count_parameters(model) == 124_439_808  # GPT-2 small with tied embeddings, exactly
    assert model.wte.weight.shape == (50257, 768) and len(model.blocks) == 12


def test_tiny_parameter_count():
    c = GPT2Config.tiny()
    per_block = 2 * 2 * c.d_model + 12 * c.d_model**2 + 9 * c.d_model  # 2 LayerNorms, qkv, proj, fc, proj + biases
    expected = (c.vocab_size + c.context) * c.d_model + c.n_layer * per_block + 2 * c.d_model
    assert count_parameters(gpt2(c)) == expected == 136_960


def test_forward_shape_and_tied_output():
    c = GPT2Config.tiny()
    model = gpt2(c)
    inputs, targets = synthetic_batch(c, batch=3, seq=17, generator=torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (3, 17) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    logits = model(inputs)
    assert logits.shape == (3, 17, c.vocab_size)
    assert sum(1 for p in model.parameters() if p is model.wte.weight) == 1  # the output layer shares it


def test_synthetic_batch_is_reproducible_and_bounded():
    c = GPT2Config.tiny()
    a = synthetic_batch(c, 4, 8, torch.Generator().manual_seed(1))
    b = synthetic_batch(c, 4, 8, torch.Generator().manual_seed(1))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert int(a[0].min()) >= 0 and int(a[0].max()) < c.vocab_size


def test_tiny_model_trains():
    torch.manual_seed(0)
    c = GPT2Config.tiny()
    model = gpt2(c)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = synthetic_batch(c, batch=8, seq=32, generator=torch.Generator().manual_seed(0))
    losses = [train_step(model, batch, optimizer).item() for _ in range(3)]
    assert all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(c.vocab_size)) < 0.5  # starts near chance
    assert losses[-1] < losses[0]


def test_fusedhooks_hook_fires_on_every_parameter():
    torch.manual_seed(0)
    c = GPT2Config.tiny()
    model = gpt2(c)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    hook = fh.grad_hook(lambda grad: grad.clamp(-1e-3, 1e-3), stats=("absmax", "nan"), backend="reference")
    with hook.register(model):
        train_step(model, synthetic_batch(c, 2, 8, torch.Generator().manual_seed(0)), optimizer)
    stats = hook.stats.read()
    assert set(stats) == {name for name, _ in model.named_parameters()}
    bound = torch.tensor(1e-3).item()  # the clamp bound as the fp32 gradients hold it
    assert all(s["absmax"] <= bound and s["nan"] == 0 for s in stats.values())
