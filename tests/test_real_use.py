"""Real-use training patterns, each against its yardstick: a plain eager `p.register_post_accumulate_grad_hook` on
every parameter whose body does what the compiled hook's body does, run on an identical copy of the model (same
seed) with the same inputs. Processed gradients must be bit-equal (the elementwise bodies here are exact on every
backend; the two that normalize by a norm over dimensions are compared within a bound derived from their arithmetic),
statistics match the final `.grad` (helpers.check_stats) and `read().stale` lists exactly the rows the latest backward
did not write."""

import math

import pytest
import torch
import torch.nn.utils.parametrizations as parametrizations

import fusedhooks as fh

from helpers import assert_same_bits, check_stats

BUCKETS = pytest.mark.parametrize("bucket_mb", [None, 25], ids=["per-firing", "buckets"])
STATS = ("norm", "absmax", "sum", "nan")


def clip_scale(grad):
    """Exact on every backend: a clamp, then a multiplication by a power of two."""
    return grad.clamp(-1.0, 1.0) * 0.5


def plus_param(grad, param):
    """Reads the parameter (one rounding of 0.01 * param, one of the sum: exact on every backend)."""
    return grad + 0.01 * param


def unit_normalize(grad):
    """Reduces over every dimension but the first (per output channel of a conv weight)."""
    return grad / torch.linalg.vector_norm(grad, dim=(1, 2, 3), keepdim=True).clamp_min(1e-6)


def normalize_rows(grad):
    """Reduces over the last dimension (planned per shape)."""
    return grad / grad.norm(dim=-1, keepdim=True).clamp_min(1e-6)


#: the bodies that reduce over dimensions: the number of elements in each norm they take of a gradient like `p`
REDUCED_NUMEL = {unit_normalize: lambda p: p[0].numel(), normalize_rows: lambda p: p.shape[-1]}


def normalize_rtol(unit_numel):
    """Relative bound of fusedhooks' grad / ||unit|| against torch's in float32: torch's norm of m elements, summed in
    any order, carries at most gamma_m (m roundings: m - 1 additions and the squares), halved by the square root,
    plus the root's rounding; then one rounding of the quotient. fusedhooks' norm is merged in float64 and rounded
    once (or computed in float64: at most one rounding), then its quotient rounded once."""
    u = torch.finfo(torch.float32).eps / 2
    gamma = unit_numel * u / (1 - unit_numel * u)
    return gamma / 2 + u + u + (u + u)


def register_eager(params, body):
    """The yardstick: an eager post-accumulate-grad hook on each tensor, writing `body`'s result into `.grad`."""
    takes_param = body.__code__.co_argcount == 2

    def hook(p):
        p.grad.copy_(body(p.grad, p) if takes_param else body(p.grad))

    return [p.register_post_accumulate_grad_hook(hook) for p in params]


def twins(make, seed=0):
    """Two identical models: `make()` under the same seed (and the same state dict, to be sure)."""
    torch.manual_seed(seed)
    model = make()
    torch.manual_seed(seed)
    plain = make()
    plain.load_state_dict(model.state_dict())
    return model, plain


def hooked_twins(make, backend, bucket_mb, body=clip_scale):
    """`twins(make)`: the first registered with a fusedhooks hook of `body` (its statistics STATS), the second with
    the eager yardstick of `body`. Returns (model, plain, hook)."""
    model, plain = twins(make)
    hook = fh.grad_hook(body, stats=STATS, backend=backend)
    hook.register(model, bucket_mb=bucket_mb)
    register_eager(plain.parameters(), body)
    return model, plain, hook


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def data(n=5, shape=(6,), seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g) * 3


def loss_of(model, x):
    return model(x).square().sum()


def assert_same_grads(model, plain, body=clip_scale):
    """The same parameter names with the same `.grad` (None where None) and strides, bit for bit; within
    normalize_rtol for a body that reduces over dimensions."""
    got, expected = dict(model.named_parameters()), dict(plain.named_parameters())
    assert got.keys() == expected.keys()
    for name, p in got.items():
        q = expected[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert p.grad.stride() == q.grad.stride(), name
            if body in REDUCED_NUMEL:
                torch.testing.assert_close(p.grad, q.grad, rtol=normalize_rtol(REDUCED_NUMEL[body](p)), atol=0)
            else:
                assert_same_bits(p.grad, q.grad)


def align_grads(plain, model):
    """Copy `model`'s gradients into `plain`'s (in place: their layouts stay), so that the next backward accumulates
    onto the same values. A no-op after a bit-equal comparison; after a reduction body compared within its bound,
    it keeps cancellation in the next accumulation from magnifying those last-bit differences beyond the bound."""
    with torch.no_grad():
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            if q.grad is not None:
                q.grad.copy_(p.grad)


def assert_same_params(model, plain):
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert_same_bits(p.detach(), q.detach())


def check_all_stats(hook, named_grads, stale=()):
    """Every fresh row matches its final gradient; exactly `stale` are stale."""
    reading = hook.stats.read()
    assert sorted(reading.stale) == sorted(stale)
    for name, grad in named_grads.items():
        if name not in stale:
            check_stats(reading[name], grad, STATS)
    return reading


# --- 1. backward(inputs=...) -------------------------------------------------------------------------------------

@BUCKETS
def test_backward_with_inputs_fires_only_those_parameters(backend, bucket_mb):
    """loss.backward(inputs=[last layer]): only those fire; the first layer keeps its gradients and stale rows."""
    model, plain, hook = hooked_twins(mlp, backend, bucket_mb)
    x1, x2 = data(seed=1), data(seed=2)
    loss_of(model, x1).backward()
    loss_of(plain, x1).backward()
    assert_same_grads(model, plain)
    first = check_all_stats(hook, {n: p.grad for n, p in model.named_parameters()})
    loss_of(model, x2).backward(inputs=[model[2].weight, model[2].bias])   # accumulates onto the last layer only
    loss_of(plain, x2).backward(inputs=[plain[2].weight, plain[2].bias])
    assert_same_grads(model, plain)
    reading = check_all_stats(hook, {n: p.grad for n, p in model.named_parameters()},
                              stale=("0.weight", "0.bias"))
    assert reading["0.weight"] == first["0.weight"] and reading["0.bias"] == first["0.bias"]
    assert reading["2.weight"] != first["2.weight"]


# --- 2. retain_graph=True ----------------------------------------------------------------------------------------

@BUCKETS
def test_two_backwards_of_a_retained_graph_fire_on_the_running_total(backend, bucket_mb):
    """loss.backward(retain_graph=True) then loss.backward() without zero_grad: both fire, on the running total."""
    model, plain, hook = hooked_twins(mlp, backend, bucket_mb)
    x = data()
    loss, plain_loss = loss_of(model, x), loss_of(plain, x)
    loss.backward(retain_graph=True)
    plain_loss.backward(retain_graph=True)
    assert_same_grads(model, plain)
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    check_all_stats(hook, first)
    loss.backward()
    plain_loss.backward()
    assert_same_grads(model, plain)
    check_all_stats(hook, {n: p.grad for n, p in model.named_parameters()})
    # the second firing processed clip(first) + g, which is not what one firing on the sum would give
    assert any(not torch.equal(p.grad, first[n]) for n, p in model.named_parameters())


# --- 3. WGAN-GP gradient penalty ---------------------------------------------------------------------------------

def critic():
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


@BUCKETS
def test_wgan_gp_gradient_penalty_gives_eager_gradients(backend, bucket_mb):
    """autograd.grad(critic(x).sum(), x, create_graph=True), the penalty added to the loss, then backward()."""
    model, plain, hook = hooked_twins(critic, backend, bucket_mb)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain)]
    real, fake = data(seed=1), data(seed=2)
    for step in range(3):
        alpha = torch.rand(real.shape[0], 1, generator=torch.Generator().manual_seed(step))
        for m, opt in zip((model, plain), opts):
            opt.zero_grad()
            x = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
            (g,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)   # fires no parameter hook
            assert all(p.grad is None for p in m.parameters())
            penalty = ((g.norm(2, dim=1) - 1) ** 2).mean()
            (m(fake).mean() - m(real).mean() + 10 * penalty).backward()
        assert_same_grads(model, plain)
        check_all_stats(hook, {n: p.grad for n, p in model.named_parameters()})
        assert all(not p.grad.requires_grad for p in model.parameters())
        for opt in opts:
            opt.step()
        assert_same_params(model, plain)


# --- 4. tied embedding / LM head -------------------------------------------------------------------------------

class TinyLM(torch.nn.Module):
    def __init__(self, vocab=7, width=4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.mix = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight                      # tied: one Parameter used twice

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


@BUCKETS
def test_tied_embedding_and_lm_head_are_processed_once_per_firing(backend, bucket_mb):
    """A Parameter used as embedding and LM head: one firing, processed once, as eager."""
    model, plain, hook = hooked_twins(TinyLM, backend, bucket_mb)
    assert model.head.weight is model.embed.weight
    tokens = torch.randint(0, 7, (3, 5), generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 7, (3, 5), generator=torch.Generator().manual_seed(2))
    for _ in range(2):                                            # the second accumulates onto the first
        for m in (model, plain):
            torch.nn.functional.cross_entropy(m(tokens).flatten(0, 1), target.flatten()).mul(10).backward()
        assert_same_grads(model, plain)
        reading = check_all_stats(hook, {n: p.grad for n, p in model.named_parameters()})
        assert sorted(reading) == ["embed.weight", "mix.bias", "mix.weight"]
    # processed once per backward: twice would halve it again, and the bit-equality above would fail
    assert model.embed.weight.grad.abs().max() <= 0.5


# --- 5. channels_last conv weights ------------------------------------------------------------------------------

def convnet():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Tanh(), torch.nn.Conv2d(4, 4, 3, bias=False)
                               ).to(memory_format=torch.channels_last)


@BUCKETS
@pytest.mark.parametrize("body", [clip_scale, unit_normalize, plus_param], ids=["elementwise", "reduces-dims",
                                                                                 "reads-param"])
def test_channels_last_conv_weight_gradients(backend, bucket_mb, body):
    """Conv2d weights in channels_last: the gradient keeps its strides, values as eager (a reduction within bound)."""
    model, plain = twins(convnet)
    if body is unit_normalize:
        select = [(n, p) for n, p in model.named_parameters() if p.ndim == 4]
        plain_select = [p for p in plain.parameters() if p.ndim == 4]
    else:
        select, plain_select = list(model.named_parameters()), list(plain.parameters())
    hook = fh.grad_hook(body, stats=STATS, backend=backend)
    hook.register(select, bucket_mb=bucket_mb)
    register_eager(plain_select, body)
    weight = model[0].weight
    assert not weight.is_contiguous() and weight.is_contiguous(memory_format=torch.channels_last)
    for seed in (1, 2):                                           # the second backward accumulates onto the first
        x = data(2, (3, 7, 7), seed=seed).to(memory_format=torch.channels_last)
        loss_of(model, x).backward()
        loss_of(plain, x).backward()
        for name, p in select:
            assert p.grad.stride() == p.stride(), name
            if p.ndim == 4:
                assert not p.grad.is_contiguous() and p.grad.is_contiguous(memory_format=torch.channels_last)
        assert_same_grads(model, plain, body)
        align_grads(plain, model)
        check_all_stats(hook, {n: p.grad for n, p in select})
    if body is unit_normalize:
        for _, p in select:
            norms = p.grad.double().flatten(1).norm(dim=1)
            assert torch.allclose(norms, torch.ones_like(norms), rtol=1e-5, atol=0)


# --- 6. parametrized modules ------------------------------------------------------------------------------------

def parametrized_mlp():
    return torch.nn.Sequential(parametrizations.weight_norm(torch.nn.Linear(6, 8)), torch.nn.Tanh(),
                               parametrizations.orthogonal(torch.nn.Linear(8, 8)), torch.nn.Tanh(),
                               torch.nn.Linear(8, 4))


@BUCKETS
def test_weight_norm_and_orthogonal_parametrizations(backend, bucket_mb):
    """Registered on the module: the leaves original0/original1 and original are processed as eager, over steps."""
    model, plain, hook = hooked_twins(parametrized_mlp, backend, bucket_mb)
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (model, plain)]
    for step in range(3):
        x = data(seed=step)
        for m, opt in zip((model, plain), opts):
            opt.zero_grad()
            loss_of(m, x).backward()
        assert_same_grads(model, plain)
        reading = check_all_stats(hook, {n: p.grad for n, p in model.named_parameters()})
        assert sorted(reading) == ["0.bias", "0.parametrizations.weight.original0",
                                   "0.parametrizations.weight.original1", "2.bias",
                                   "2.parametrizations.weight.original", "4.bias", "4.weight"]
        for opt in opts:
            opt.step()
        assert_same_params(model, plain)


# --- 7. gradients that are views of one flat buffer ------------------------------------------------------------

def flatten_into_views(model):
    """Parameters and gradients as views of one flat parameter buffer and one flat gradient buffer (apex, DeepSpeed):
    returns (flat parameters, flat gradients)."""
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    flat_grad = torch.zeros_like(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.data = flat[offset:offset + n].view_as(p)
        p.grad = flat_grad[offset:offset + n].view_as(p)
        offset += n
    return flat, flat_grad


@BUCKETS
def test_gradients_that_are_views_of_one_flat_buffer(backend, bucket_mb):
    """Preset .grad views of one flat buffer accumulate in place; the hook writes through them into the buffer."""
    model, plain = twins(mlp)
    flat, flat_grad = flatten_into_views(model)
    plain_flat, plain_flat_grad = flatten_into_views(plain)
    hook = fh.grad_hook(clip_scale, stats=STATS, backend=backend)
    hook.register(model, bucket_mb=bucket_mb)
    register_eager(plain.parameters(), clip_scale)
    ptrs = [p.grad.data_ptr() for p in model.parameters()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, plain)]
    for step in range(3):
        x = data(seed=step)
        for m, g in zip((model, plain), (flat_grad, plain_flat_grad)):
            g.zero_()                                             # DeepSpeed's zero_grad: the buffer, not None
            loss_of(m, x).backward()
        assert [p.grad.data_ptr() for p in model.parameters()] == ptrs
        assert all(p.grad.untyped_storage().data_ptr() == flat_grad.data_ptr() for p in model.parameters())
        assert_same_bits(flat_grad, plain_flat_grad)               # the flat buffer holds the processed gradients
        assert flat_grad.abs().max() <= 0.5
        assert_same_grads(model, plain)
        check_all_stats(hook, {n: p.grad for n, p in model.named_parameters()})
        for opt in opts:
            opt.step()
        assert_same_bits(flat, plain_flat)


# --- 8. a transposed gradient layout ----------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")
@BUCKETS
@pytest.mark.parametrize("body", [clip_scale, plus_param, normalize_rows], ids=["elementwise", "reads-param",
                                                                                "reduces-dims"])
def test_a_transposed_gradient_keeps_its_storage_and_strides(backend, bucket_mb, body):
    """.grad preset to a transposed (dense, non-contiguous) tensor: data_ptr and strides unchanged, values as eager
    (also for a body that reads the row-major parameter, or reduces over the gradient's strided last dimension)."""
    model, plain = twins(mlp)
    for m in (model, plain):
        for p in m.parameters():
            if p.ndim == 2:
                p.grad = torch.zeros(p.shape[::-1]).t()
    hook = fh.grad_hook(body, stats=STATS, backend=backend)
    hook.register(model, bucket_mb=bucket_mb)
    register_eager(plain.parameters(), body)
    layout = {n: (p.grad.data_ptr(), p.grad.stride()) for n, p in model.named_parameters() if p.grad is not None}
    assert layout["0.weight"][1] == (1, 8)
    for seed in (1, 2):                                           # the second backward accumulates onto the first
        x = data(seed=seed)
        loss_of(model, x).backward()
        loss_of(plain, x).backward()
        assert {n: (p.grad.data_ptr(), p.grad.stride()) for n, p in model.named_parameters() if p.ndim == 2} == layout
        assert not model[0].weight.grad.is_contiguous()
        assert_same_grads(model, plain, body)
        align_grads(plain, model)
        check_all_stats(hook, {n: p.grad for n, p in model.named_parameters()})


# --- 9. shapes changed through .data after register ------------------------------------------------------------

@BUCKETS
@pytest.mark.parametrize("body", [clip_scale, plus_param, normalize_rows], ids=["elementwise", "reads-param",
                                                                                "reduces-dims"])
def test_shapes_changed_through_data_after_register(backend, bucket_mb, body):
    """lin.weight.data = a tensor of a new shape after register: the next backward gives eager's values."""
    model, plain, hook = hooked_twins(lambda: torch.nn.Linear(6, 8), backend, bucket_mb, body)
    x = data()
    for shape in ((8,), (3,), (5,)):
        if shape != (8,):
            new_weight, new_bias = torch.randn(*shape, 6), torch.randn(*shape)
            for m in (model, plain):
                m.zero_grad(set_to_none=True)                     # the old gradients have the old shapes
                m.weight.data, m.bias.data = new_weight.clone(), new_bias.clone()
        loss_of(model, x).backward()
        loss_of(plain, x).backward()
        assert model.weight.grad.shape == (*shape, 6)
        assert_same_grads(model, plain, body)
        check_all_stats(hook, {n: p.grad for n, p in model.named_parameters()})


# --- 10. optimizer in backward, added after the first step ------------------------------------------------------

@BUCKETS
def test_optimizer_in_backward_added_after_the_first_step(backend, bucket_mb):
    """Per-parameter Adam steps in post-accumulate hooks added after step 1, after ours: they step on the processed
    gradient, and the parameters equal the eager run's."""
    model, plain, hook = hooked_twins(mlp, backend, bucket_mb)
    opt_for = {p: torch.optim.Adam([p], lr=0.01) for m in (model, plain) for p in m.parameters()}
    names = {p: n for n, p in model.named_parameters()}
    seen = {}

    def step_in_backward(p):
        if p in names:
            seen[names[p]] = p.grad.clone()
        opt_for[p].step()
        opt_for[p].zero_grad()

    for step in range(4):
        if step == 1:                                             # the tutorial's hook, added once training runs
            for m in (model, plain):
                for p in m.parameters():
                    p.register_post_accumulate_grad_hook(step_in_backward)
        x = data(seed=step)
        loss_of(model, x).backward()
        loss_of(plain, x).backward()
        if step == 0:                                             # the first step: a plain loop
            assert_same_grads(model, plain)
            seen = {n: p.grad.clone() for n, p in model.named_parameters()}
            for p in [*model.parameters(), *plain.parameters()]:
                opt_for[p].step()
                opt_for[p].zero_grad()
        else:
            assert all(p.grad is None for p in [*model.parameters(), *plain.parameters()])
        assert sorted(seen) == sorted(names.values())
        assert all(g.abs().max() <= 0.5 for g in seen.values())  # the optimizer saw the processed gradient
        check_all_stats(hook, seen)
        assert_same_params(model, plain)
        seen = {}


# --- 11. GradScaler with a frozen base and an expert unused every other step ----------------------------------

class FrozenBaseMoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(6, 8).requires_grad_(False)
        self.expert = torch.nn.ModuleList([torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)])

    def forward(self, x, step):
        h = torch.tanh(self.base(x))
        out = self.expert[0](h)
        if step % 2 == 0:                                         # expert 1 is routed to every other step only
            out = out + self.expert[1](h)
        return out


@pytest.mark.parametrize("bucket_mb", [None, 25], ids=["per-firing", "buckets"])
def test_grad_scaler_with_a_frozen_base_and_an_expert_unused_every_other_step(backend, bucket_mb):
    """scaler=/optimizer= hook against torch's recipe (scale, backward, unscale_, eager body, step, update)."""
    model, plain = twins(FrozenBaseMoE)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
            for m in (model, plain)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2) for _ in range(2)]
    hook = fh.grad_hook(clip_scale, stats=STATS, scaler=scalers[0], optimizer=opts[0], backend=backend)
    hook.register(model, bucket_mb=bucket_mb)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    scales = []
    for step in range(7):
        x = data(seed=step)
        grads = []
        for i, (m, opt, scaler) in enumerate(zip((model, plain), opts, scalers)):
            opt.zero_grad(set_to_none=True)
            loss = m(x, step).square().mean()
            if step == 4:
                loss = loss * math.inf                            # overflow: step skipped, scale backs off
            scaler.scale(loss).backward()
            if i == 1:                                            # torch's recipe
                scaler.unscale_(opt)
                for p in m.parameters():
                    if p.grad is not None:
                        p.grad.copy_(clip_scale(p.grad))
            grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
            scaler.step(opt)
            scaler.update()
        unused = ("expert.1.weight", "expert.1.bias") if step % 2 else ()
        assert sorted(grads[0]) == sorted(grads[1]) == sorted(n for n in trained if n not in unused)
        for name, grad in grads[0].items():                      # what each optimizer stepped on
            assert_same_bits(grad, grads[1][name])
        reading = check_all_stats(hook, grads[0], stale=unused)
        assert sorted(reading) == sorted(trained)                # the frozen base is not registered
        assert scalers[0].get_scale() == scalers[1].get_scale()
        scales.append(scalers[0].get_scale())
        assert_same_params(model, plain)
        assert model.base.weight.grad is None and plain.base.weight.grad is None
    assert scales[4] == scales[3] / 2 and scales[3] > scales[0]   # grown, then backed off at the overflow
