"""GPU-only checks (skipped without CUDA): the compiled kernels against eager CUDA torch.

They never replace the interpreter tests; they add what only a GPU shows: fast-math division and square
root, FMA contraction, the last-program merge across SMs, and indexing past 2**31 elements.
"""

import pytest
import torch

import fusedhooks as fh
from fusedhooks import STAT_NAMES

from helpers import FLOAT_DTYPES, assert_same_bits, assert_same_steps, assert_same_values, check_stats
from test_ops import BODIES, CLAMP_BODIES, POW_ULPS, eager_expected, special_values

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name", [n for n in BODIES if n not in ("device_scalars", "bool_scalar")])
def test_op_matches_eager_cuda(name, dtype):
    fn, ulps = BODIES[name]
    ulps = POW_ULPS[dtype] if ulps == "pow" else max(ulps, 1 if name.startswith(("sqrt", "pow_half")) else ulps)
    grad = special_values(100_003, dtype).cuda()
    param = special_values(100_003, dtype, seed=1).cuda()
    expected = eager_expected(fn, grad, param)
    p = param.clone().requires_grad_(True)
    p.grad = grad
    fh.grad_hook(fn)(p)
    assert_same_values(grad.cpu(), expected.cpu(), ulps=ulps)


SIGNED_ZERO_BODIES = {**CLAMP_BODIES, "neg": lambda g: -g, "neg(-0.0 * g)": lambda g: -(g * -0.0),
                      "where(g < 0, -0.0, g)": lambda g: torch.where(g < 0, -0.0, g)}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name", list(SIGNED_ZERO_BODIES))
def test_signed_zeros_match_cuda_torch_bit_for_bit(name, dtype):
    """Triton 3.6 makes a scalar constant equal to 0 a +0.0 and computes -x as 0 - x: the kernels build -0.0 from its
    bits and negate by the sign bit (only the interpreter had shown it; written before a GPU ran them)."""
    body = SIGNED_ZERO_BODIES[name]
    values = torch.tensor([-0.0, 0.0, -1.0, 1.0, -float("inf"), float("inf"), float("nan")], dtype=dtype)
    grad = values.repeat(143)[:1000].cuda()
    expected = eager_expected(body, grad, grad)
    p = grad.clone().requires_grad_(True)
    p.grad = grad
    fh.grad_hook(body)(p)
    assert_same_bits(grad.cpu(), expected.cpu())


def bf16_rounding_cases() -> torch.Tensor:
    """fp32 values whose bf16 rounding is hard: ties to even both ways, values just above and below a tie, the
    largest bf16 and what rounds up to Inf, subnormals, signed zeros, Inf and NaN, and 64K random values."""
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x3F808001, 0x3F807FFF, 0x7F7F8000, 0x7F7F7FFF,
                         0x7F7FFFFF, 0x00008000, 0x00018000, 0x80008000, 0x00000001], dtype=torch.int64)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])
    random = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)) * 10.0 ** torch.randint(
        -40, 38, (1 << 16,), generator=torch.Generator().manual_seed(1))
    return torch.cat([ties.to(torch.int32).view(torch.float32), special, random])


def test_bf16_hardware_conversions_match_cuda_torch_bit_for_bit():
    """On a GPU the generated kernels and the multi-tensor scale round bf16 with the hardware's conversions (the bit
    arithmetic is the interpreter's): a hook computing in fp32 and storing bf16, and fh.clip_grad_norm_'s scale, give
    torch's CUDA values bit for bit (NaN stays NaN; its bits may differ)."""
    values = bf16_rounding_cases().cuda()
    grad = values.to(torch.bfloat16)
    p = torch.zeros_like(grad, requires_grad=True)
    p.grad = grad.clone()
    fh.grad_hook(lambda g: g * 1.0009765625, stats=("norm", "max"))(p)  # 1 + 2**-10: products round
    assert_same_bits(p.grad.cpu(), (grad * 1.0009765625).cpu())
    params = [torch.zeros_like(grad, requires_grad=True), torch.zeros(1000, device="cuda", requires_grad=True)]
    finite = torch.where(grad.isfinite(), grad, 0.0)
    params[0].grad, params[1].grad = finite.clone(), torch.ones(1000, device="cuda")
    hook = fh.grad_hook(None, stats=("norm",))
    for t in params:
        hook.register(t)
        hook(t)
    expected = finite.clone()
    total = fh.clip_grad_norm_(hook, 1e-3)
    torch._foreach_mul_([expected], torch.clamp(1e-3 / (total + 1e-6), max=1.0))  # torch's bf16 group
    assert_same_bits(params[0].grad.cpu(), expected.cpu())


def test_repeated_firings_launch_through_the_compiled_kernel(monkeypatch):
    """After the first firing, a hook's launches skip Triton's dispatch (`JITFunction.run`: tens of µs of Python per
    launch) and call the compiled kernel (fusedhooks/runtime/fastlaunch.py); written before a GPU ran it."""
    import triton

    hook = fh.grad_hook(lambda grad: grad * 2, stats=("norm",))
    p = torch.zeros(5000, device="cuda", requires_grad=True)
    p.grad = torch.ones(5000, device="cuda")
    hook(p)
    hook(p)

    def dispatch(*args, **kwargs):
        raise AssertionError("a repeated firing went through JITFunction.run")

    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", dispatch)
    hook(p)
    torch.cuda.synchronize()
    assert p.grad.eq(8.0).all()
    assert hook.stats.read()["param0"]["norm"] == pytest.approx(8.0 * 5000 ** 0.5)


@pytest.mark.parametrize("n", [1, 4095, 4097, 1 << 20, 16_000_003])
def test_stats_cuda(n):
    grad = torch.randn(n, device="cuda") * 3
    before = grad.clone()
    hook = fh.grad_hook(lambda grad: grad.clamp(-2.0, 2.0) * 0.5, stats="all", input_stats="all")
    p = torch.zeros(n, device="cuda", requires_grad=True)
    p.grad = grad
    for _ in range(3):  # the counter resets: repeated launches stay correct
        p.grad.copy_(before)
        hook(p)
    got = hook.stats.read()["param0"]
    check_stats(got, grad.cpu(), STAT_NAMES)
    check_stats(got, before.cpu(), STAT_NAMES, prefix="input.")


def test_indexing_past_2_31_elements():
    n = (1 << 31) + 3000
    grad = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    grad[-5:] = 7.0
    hook = fh.grad_hook(lambda grad: grad * 2, stats=("max", "zeros", "sum"))
    p = torch.empty(n, dtype=torch.bfloat16, device="cuda").requires_grad_(True)
    p.grad = grad
    hook(p)
    assert grad[-5:].float().eq(14.0).all() and grad[:-5].float().abs().max().item() == 0
    got = hook.stats.read()["param0"]
    assert got["max"] == 14.0 and got["zeros"] == n - 5 and got["sum"] == 70.0


def test_cuda_graph_capture_replays_like_eager():
    """A training step with a bucketed hook (clip + statistics) captured in a CUDA graph: no host sync and
    no allocation in steady state, so replays give the same parameters and statistics as eager steps."""
    import copy

    from fusedhooks.testing import GPT2Config, gpt2, synthetic_batch

    config = GPT2Config.tiny()
    torch.manual_seed(0)
    eager = gpt2(config).cuda()
    graphed = copy.deepcopy(eager)
    batch = [t.cuda() for t in synthetic_batch(config, batch=4, seq=32, generator=torch.Generator().manual_seed(0))]

    def step(model, opt):
        logits = model(batch[0])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())
        loss.backward()
        opt.step()

    def clip(grad):
        return grad.clamp(-0.01, 0.01)

    hooks, opts = [], []
    for model in (eager, graphed):
        hook = fh.grad_hook(clip, stats=("norm", "nan"))
        hook.register(model, bucket_mb=0.05)
        hooks.append(hook)
        opts.append(torch.optim.SGD(model.parameters(), lr=0.1))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: compile kernels, size workspaces
        for _ in range(3):
            for model, opt in ((eager, opts[0]), (graphed, opts[1])):
                opt.zero_grad(set_to_none=True)
                step(model, opt)
    torch.cuda.current_stream().wait_stream(side)
    opts[1].zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graphed, opts[1])
    for _ in range(5):
        graph.replay()
        opts[0].zero_grad(set_to_none=True)
        step(eager, opts[0])
    torch.cuda.synchronize()
    for p, q in zip(eager.parameters(), graphed.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert hooks[0].stats.read().keys() == hooks[1].stats.read().keys()


def test_no_host_sync_in_a_firing():
    """torch's sync debug mode raises on any synchronizing call: a firing, a bucket flush and the global clip
    make none (statistics are read later, in one sync, by stats.read()), nor does a clip after one with
    max_norm=inf (the norms measured, rescaled by its coefficient on the device)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8)).cuda()
    hook = fh.grad_hook(lambda grad: grad / (grad.norm() + 1e-6), stats="all", input_stats=("hist",))
    hook.register(model, bucket_mb=0.01)
    clip_stats = fh.grad_hook(stats=("norm",))
    clip_stats.register(model, bucket_mb=0)
    x = torch.randn(32, 64, device="cuda")
    model(x).sum().backward()                     # warm up: compile, size the workspaces
    fh.clip_grad_norm_(clip_stats, 1.0)
    torch.cuda.synchronize()
    for p in model.parameters():
        p.grad = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(x).sum().backward()
        fh.clip_grad_norm_(clip_stats, 1.0)
        model(x).sum().backward()
        fh.clip_grad_norm_(clip_stats, float("inf"))  # the total norm alone (logging), then the clip
        fh.clip_grad_norm_(clip_stats, 1.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert hook.stats.read()["0.weight"]["count"] == 64 * 64


def test_no_host_sync_in_the_optimizer_steps():
    """fh.AdamW inside the backward (each gradient freed at its firing, so that the next backward's land elsewhere and
    the launch tables are made again) and after it with a tensor lr: no synchronizing call (a launch table or the
    hyper-parameters copied from pageable memory would be one)."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).cuda() for _ in range(2)]
    inside = fh.AdamW(models[0].parameters(), lr=1e-3)
    after = fh.AdamW(models[1].parameters(), lr=torch.tensor(1e-3, device="cuda"))
    hook = fh.grad_hook(lambda g: g.clamp(-1.0, 1.0), stats=("norm",))
    hook.register(models[0], optimizer=inside)
    x = torch.randn(32, 64, device="cuda")

    def step():
        models[0](x).sum().backward()
        models[1](x).sum().backward()
        after.step()
        after.zero_grad(set_to_none=True)

    step()  # warm up: compile
    torch.cuda.synchronize()
    spacers = [torch.empty(64 * 64, device="cuda") for _ in range(4)]  # the next gradients land elsewhere
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(p.grad is None for p in models[0].parameters()) and spacers
    assert set(hook.stats.read()) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert all(inside.state[p]["step"].item() == 2 for p in models[0].parameters())


def test_the_step_inside_the_backward_lowers_peak_memory_by_the_gradients():
    """register(model, optimizer=fh.AdamW) frees each gradient at its firing: the backward's peak of allocated memory
    (over what the forward left) is lower than with the step after the backward by the gradients' bytes, all but the
    largest one's (which lives until its own firing), less a tenth for what else a node's backward holds beside it
    (its layer's bias gradient, the activations' gradients)."""
    torch.manual_seed(0)
    peaks = {}
    for mode in ("after", "inside"):
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
        opt = fh.AdamW(model.parameters(), lr=1e-3)
        hook = fh.grad_hook(lambda g: g.clamp(-1.0, 1.0), stats=("norm",))
        hook.register(model, optimizer=opt if mode == "inside" else None)
        x = torch.randn(8, 1024, device="cuda")
        for _ in range(2):  # the first allocates the optimizer's states
            loss = model(x).sum()
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
            torch.cuda.synchronize()
            peaks[mode] = torch.cuda.max_memory_allocated() - start
            opt.step()
            opt.zero_grad(set_to_none=True)
        grad_bytes = sorted(p.numel() * p.element_size() for p in model.parameters())
        del model, opt, hook
    assert peaks["after"] - peaks["inside"] >= 0.9 * sum(grad_bytes[:-1]), (peaks, grad_bytes)


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_step_inside_a_compiled_backward_on_cuda():
    """Compiled autograd with inductor on CUDA (the flag): each firing and fh.AdamW step inside the backward is traced
    (fusedhooks::step_in_backward, launching the step's Triton kernel when the graph runs), no graph break leaving the
    graph; parameters and states equal those of the same compiled backward with the step after it, bit for bit."""
    from torch._dynamo.utils import counters

    from helpers import assert_same_steps

    models, opts = [], []
    for inside in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).cuda()
        opt = fh.AdamW(model.parameters(), lr=1e-3, amsgrad=True)
        fh.grad_hook(lambda g: g.clamp(-0.01, 0.01), stats=("norm",)).register(model, optimizer=opt if inside else None)
        torch._dynamo.config.compiled_autograd = True
        try:
            step = torch.compile(lambda x, model=model: model(x).square().mean().backward(), backend="inductor")
            for i in range(4):
                step(torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(i)))
                assert all(p.grad is None for p in model.parameters()) == inside
                opt.step()
                opt.zero_grad()
        finally:
            torch._dynamo.config.compiled_autograd = False
        models.append(model)
        opts.append(opt)
    assert not any("torch.compiler.disable" in reason for reason in counters["graph_break"])
    assert_same_steps(models, opts)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(4096, 1024), (1000, 5000), (3, 4097), (64, 3, 3, 3)], ids=str)
def test_reductions_over_dims_cuda(shape, dtype):
    """Rows in one pass (units across programs), rows longer than a program (a reduction pass), columns (units side by
    side, gathered by index), against eager CUDA torch, per firing and bucketed."""
    from helpers import REDUCTION_RTOL, assert_close_to

    bodies = [lambda g: g / (g.norm(dim=-1, keepdim=True) + 1e-3),
              lambda g: (g - g.mean(dim=0)) / (g.std(dim=0) + 1),
              lambda g: g * (g.amax(dim=1, keepdim=True) - g.amin(dim=1, keepdim=True))]
    grad = (torch.randn(shape, device="cuda") * 3).to(dtype)
    for fn in bodies:
        expected = fn(grad.clone())
        for bucket_mb in (0, 25):
            hook = fh.grad_hook(fn, stats=("norm", "max"), backend="triton")
            p = torch.zeros(shape, dtype=dtype, device="cuda", requires_grad=True)
            hook.register(p, bucket_mb=bucket_mb)
            (p * grad).sum().backward()
            assert_close_to(p.grad, expected, REDUCTION_RTOL[dtype])
            row = hook.stats.read()["param0"]
            assert row["max"] == p.grad.max().item()  # the statistics of what was written


def test_agc_cuda_matches_timm_formula():
    import copy

    from helpers import timm_agc_

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(16 * 30 * 30, 10)).cuda()
    reference = copy.deepcopy(model)
    fh.agc(0.01, backend="triton").register(model, bucket_mb=25)
    x = torch.randn(8, 3, 32, 32, device="cuda")
    for m in (model, reference):
        (m(x).square().mean() * 100).backward()
    timm_agc_(reference.parameters())
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_optimizer_step_matches_torch_fused_on_cuda(name, dtype):
    """fh.AdamW / fh.SGD launch their kernels on CUDA (compiled, 128-bit accesses, several programs per tensor):
    three steps against torch's fused optimizer within 8 ulps (fp32) or 2 ulps (bf16) of the largest parameter."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1,), (4099,), (1 << 20,)]
    ours = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen).to(dtype)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    if name == "adamw":
        opt, ref = fh.AdamW(ours, lr=1e-2, amsgrad=True), torch.optim.AdamW(theirs, lr=1e-2, amsgrad=True, fused=True)
    else:
        opt, ref = fh.SGD(ours, lr=1e-2, momentum=0.9), torch.optim.SGD(theirs, lr=1e-2, momentum=0.9, fused=True)
    for step in range(3):
        for p, q in zip(ours, theirs):
            g = torch.randn(p.shape, device="cuda", generator=gen).to(dtype)
            p.grad, q.grad = g.clone(), g.clone()
        if step == 2:  # a folded clip's grad_scale (not a power of two), divided as torch divides it
            for o in (opt, ref):
                o.grad_scale = torch.tensor(3.7, device="cuda")
                o.found_inf = torch.zeros((), device="cuda")
        opt.step()
        ref.step()
    for o in (opt, ref):
        del o.grad_scale, o.found_inf
    ulps = 8 if dtype == torch.float32 else 2
    for p, q in zip(ours, theirs):
        scale = torch.finfo(dtype).eps * q.detach().abs().max().item()
        assert (p - q).abs().max().item() <= 3 * ulps * scale


def test_optimizer_step_in_backward_on_cuda():
    """register(model, optimizer=fh.AdamW) on CUDA: the same parameters and states, bit for bit, as the same
    optimizer stepping after the backward, and no .grad left."""
    models = [torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8)).cuda()
              for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [fh.AdamW(m.parameters(), lr=1e-2) for m in models]
    hooks = [fh.grad_hook(lambda g: g.clamp(-0.01, 0.01)) for _ in range(2)]
    hooks[0].register(models[0], optimizer=opts[0])
    hooks[1].register(models[1])
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(3):
        x = torch.randn(32, 64, device="cuda", generator=gen)
        for model, opt in zip(models, opts):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    assert all(p.grad is None for p in models[0].parameters())
    assert_same_steps(models, opts)


def test_hundred_steps_of_a_nanogpt_sized_model_on_cuda():
    """nanoGPT's character-level Shakespeare model (6 layers, 6 heads, d_model 384: 10.7 M parameters), 100 steps of
    its gradients: at every step, from the same parameters and states, fh.AdamW is within 8 fp32 ulps of the
    magnitudes the update reads of torch's fused AdamW (then both go on from torch's values)."""
    from fusedhooks.testing import GPT2Config, gpt2, synthetic_batch

    config = GPT2Config(n_layer=6, n_head=6, d_model=384, vocab_size=65, context=256)
    ref_model = gpt2(config, device="cuda")
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref_model.parameters()]
    theirs = list(ref_model.parameters())
    lr, beta1, beta2, eps = 6e-4, 0.9, 0.95, 1e-8
    opt = fh.AdamW(ours, lr=lr, betas=(beta1, beta2), weight_decay=0.1)
    ref = torch.optim.AdamW(theirs, lr=lr, betas=(beta1, beta2), weight_decay=0.1, fused=True)
    u = torch.finfo(torch.float32).eps
    for step in range(100):
        inputs, targets = synthetic_batch(config, 8, 256, generator=torch.Generator().manual_seed(step), device="cuda")
        ref.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ref_model(inputs).flatten(0, 1), targets.flatten()).backward()
        before = [q.detach().clone() for q in theirs]
        old_m = [ref.state[q]["exp_avg"].clone() if q in ref.state else torch.zeros_like(q) for q in theirs]
        for p, q in zip(ours, theirs):
            p.grad = q.grad.clone()
        opt.step()
        ref.step()
        t = step + 1
        for p, q, b, m in zip(ours, theirs, before, old_m):
            denom = ref.state[q]["exp_avg_sq"].sqrt() / (1 - beta2**t) ** 0.5 + eps
            update = lr / (1 - beta1**t) * (beta1 * m.abs() + (1 - beta1) * q.grad.abs()) / denom
            bound = 8 * u * torch.maximum(b.abs(), update)
            assert ((p - q).abs() <= bound).all(), f"step {step}: {((p - q).abs() / bound).max().item():.2f} bounds"
            with torch.no_grad():
                p.copy_(q)
                for key in ("exp_avg", "exp_avg_sq"):
                    opt.state[p][key].copy_(ref.state[q][key])
