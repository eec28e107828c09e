"""torch.compile and compiled autograd: same gradients and statistics as eager, no graph break from fusedhooks.

Under compiled autograd a hook calls one operator, `torch.ops.fusedhooks.fire` (fusedhooks/firing/ops.py), whose
real implementation is the eager firing; on CPU it runs the Triton kernels in the interpreter (backend
"triton") or the eager backend. torch.compile itself breaks the graph at `loss.backward()`: every test
compares the graph breaks of a step with hooks with those of the same step without.
"""

import subprocess
import sys
import weakref

import pytest
import torch
from torch._dynamo import compiled_autograd
from torch._dynamo.utils import counters

import fusedhooks as fh
from fusedhooks.testing import python_calls

from helpers import REDUCTION_RTOL, assert_close_to, assert_same, assert_same_stats, mlp, torch_fp32_norm_rtol

STATS = ("norm", "max", "nan", "std")


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture(params=["triton", "eager"])
def fh_backend(request):
    return request.param


def make_model():
    return mlp((8, 16, 4), torch.nn.ReLU)


def make_hook(backend):
    return fh.grad_hook(lambda g: g.clamp(-0.01, 0.01) * 0.5, stats=STATS, backend=backend)


def batches(n=2):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(5, 8, generator=g) for _ in range(n)]


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def train(backend, mode, compile_backend, hooked=True, bucket_mb=None, steps=2, torch_hook=False, make=make_hook):
    """Run `steps` SGD steps; the second backward accumulates into the first's .grad (zeroed in place,
    not set to None), so both AccumulateGrad branches (new .grad, existing .grad) run. Returns the
    gradients and statistics after each backward, and the graph breaks counted."""
    torch._dynamo.reset()
    counters.clear()
    model = make_model()
    hook = make(backend)
    if hooked:
        if torch_hook:
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(hook)
        else:
            hook.register(model, bucket_mb=bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fwd = torch.compile(model, backend=compile_backend) if mode == "compiled_model" else model

    def step(x):
        loss = fwd(x).square().sum()
        loss.backward()
        return loss

    out = []
    for x in batches(steps):
        if mode == "compiled_autograd":
            with compiled_autograd._enable(torch.compile(backend=compile_backend)):
                torch.compile(step, backend=compile_backend)(x)
        elif mode == "compiled_step":
            torch.compile(step, backend=compile_backend)(x)
        else:
            step(x)
        out.append(({n: p.grad.clone() for n, p in model.named_parameters()}, hook.stats.read()))
        opt.step()
        opt.zero_grad(set_to_none=False)
    return out, graph_breaks()


@pytest.mark.parametrize("mode", ["compiled_model", "compiled_step", "compiled_autograd"])
def test_compiled_training_matches_eager(fh_backend, mode):
    expected, _ = train(fh_backend, "eager", None)
    unhooked, breaks_without = train(fh_backend, mode, "aot_eager", hooked=False)
    got, breaks = train(fh_backend, mode, "aot_eager")
    assert_same(got, expected)
    assert breaks == breaks_without
    # the hooks did something: without them the gradients differ
    assert not torch.equal(unhooked[0][0]["0.weight"], expected[0][0]["0.weight"])


def test_compiled_autograd_eager_backend_and_torch_registered_hook():
    """Compile with backend="eager" (no functionalization: the op gets the real tensors), and a hook
    registered through torch directly (hook(param) -> None) rather than register()."""
    expected, _ = train("triton", "eager", None, torch_hook=True)
    _, breaks_without = train("triton", "compiled_autograd", "eager", hooked=False)
    got, breaks = train("triton", "compiled_autograd", "eager", torch_hook=True)
    assert_same(got, expected)
    assert breaks == breaks_without


def make_agc_hook(backend):
    return fh.agc(0.01, stats=STATS, backend=backend)


#: The compiled-autograd scenarios: train() options
SCENARIOS = {
    "register": {},
    # a hook registered with bucket_mb=: under compiled autograd each gradient is processed at its own firing, with
    # the same gradients and statistics as the eager end-of-backward buckets
    "buckets": {"bucket_mb": 1},
    # a body that reduces over dimensions (planned per shape; one kernel over units)
    "agc": {"make": make_agc_hook},
    # a hook registered through torch directly: its first firing registers the tensor through fusedhooks::fire, and
    # the graph, recompiled once for the new row, fires through fusedhooks::firing from then on
    "torch_registered": {"torch_hook": True},
}


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_compiled_autograd_scenarios_fire_through_the_traced_op(scenario, compile_backend):
    """Each scenario over 3 steps under compiled autograd with aot_eager and inductor: the same gradients and
    statistics as eager, no graph break of fusedhooks' making, and the backward graphs of the last step fire through
    fusedhooks::firing (the firing as a function of tensors), never the opaque fusedhooks::fire."""
    graphs = []
    inner = torch._dynamo.backends.registry.lookup_backend(compile_backend)

    def backend(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)

    options = SCENARIOS[scenario]
    expected, _ = train("triton", "eager", None, steps=3, **options)
    unhooked, breaks_without = train("triton", "compiled_autograd", compile_backend, hooked=False, steps=3)
    graphs.clear()
    got, breaks = train("triton", "compiled_autograd", backend, steps=3, **options)
    # AGC's norms round as torch's ops round them, not as the Triton kernel's reduction does
    if scenario == "torch_registered":
        # tensors registered at their first firing are named in firing order, which compiled autograd may change:
        # the rows are compared by the gradient each describes
        got, expected = ([(grads, _rows_by_norm(stats)) for grads, stats in run] for run in (got, expected))
    assert_same(got, expected, grads_rtol=REDUCTION_RTOL[torch.float32] if scenario == "agc" else 0.0)
    assert breaks == breaks_without
    assert not torch.equal(unhooked[0][0]["0.weight"], expected[0][0]["0.weight"])  # the hook did something
    ops = [{n.target for n in gm.graph.nodes} for gm in graphs]
    firing = [bool(targets & {torch.ops.fusedhooks.firing, torch.ops.fusedhooks.firing.default}) for targets in ops]
    opaque = [bool(targets & {torch.ops.fusedhooks.fire, torch.ops.fusedhooks.fire.default}) for targets in ops]
    assert any(firing) and not any(f and o for f, o in zip(firing, opaque))
    assert any(opaque) == (scenario == "torch_registered")


def _rows_by_norm(stats):
    """`stats` (a read()) with its rows named by their rank in norm order."""
    out = type(stats)()
    for i, (_, row) in enumerate(sorted(stats.items(), key=lambda item: item[1]["norm"])):
        out[f"row{i}"] = row
    return out


def test_compiled_autograd_inductor():
    """The whole step and its backward through inductor (one backend: inductor compiles take seconds here)."""
    expected, _ = train("eager", "eager", None, steps=1)
    _, breaks_without = train("eager", "compiled_autograd", "inductor", hooked=False, steps=1)
    got, breaks = train("eager", "compiled_autograd", "inductor", steps=1)
    assert_same(got, expected)
    assert breaks == breaks_without


def test_create_graph_under_compile_runs_the_body_as_autograd_ops():
    """backward(create_graph=True) in a compiled step: the firing leaves the graph (a graph break of its own,
    documented) and runs the body as eager ops autograd records, as without compile."""
    def run(compiled):
        torch._dynamo.reset()
        model = make_model()
        hook = fh.grad_hook(lambda g: g * 2.0, stats=("norm",))
        hook.register(model)
        x = batches(1)[0]

        def step(x):
            model(x).square().sum().backward(create_graph=True)

        if compiled:
            # backend="eager": compiled autograd through aot_autograd refuses higher-order gradients itself
            with compiled_autograd._enable(torch.compile(backend="eager")):
                torch.compile(step, backend="eager")(x)
        else:
            step(x)
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert all(g.requires_grad for g in grads.values())
        out = ({n: g.detach().clone() for n, g in grads.items()}, hook.stats.read())
        for p in model.parameters():
            p.grad = None  # break the parameter <-> gradient cycle create_graph makes
        return out

    counters.clear()
    compiled = run(True)
    # the firing left the graph through torch.compiler.disable (the documented break)
    assert any("disable" in reason for reason in counters["graph_break"])
    assert_same([compiled], [run(False)])


def test_amp_under_compiled_autograd():
    """scaler=: the traced firings unscale and find NaN/Inf on the device, and GradScaler.step takes what they found
    as the eager firings' books would give it: the same scales, parameters (an overflow step skipped) and statistics
    as eager."""
    def train_amp(compiled, steps=4, inf_step=2):
        torch._dynamo.reset()
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
        hook = fh.grad_hook(lambda g: g.clamp(-0.05, 0.05), stats=("norm", "inf"), scaler=scaler, optimizer=opt)
        hook.register(model)
        out = []
        for i, x in enumerate(batches(steps)):
            opt.zero_grad(set_to_none=i % 2 == 0)

            def backward(x, s):
                scaler.scale(model(x).square().mean() * s).backward()

            s = float("inf") if i == inf_step else 1.0
            if compiled:
                with compiled_autograd._enable(torch.compile(backend="aot_eager")):
                    torch.compile(backward, backend="aot_eager")(x, s)
            else:
                backward(x, s)
            scaler.step(opt)
            scaler.update()
            out.append((scaler.get_scale(), [p.detach().clone() for p in model.parameters()], hook.stats.read()))
        return out

    expected = train_amp(False)
    for (scale, params, stats), (escale, eparams, estats) in zip(train_amp(True), expected):
        assert scale == escale
        assert_same_stats(stats, estats)
        assert all(torch.equal(p, e) for p, e in zip(params, eparams))
    assert expected[2][0] == expected[1][0] / 2  # the overflow step backed off


def test_fire_op_declares_what_it_writes():
    schema = torch.ops.fusedhooks.fire.default._schema if hasattr(torch.ops.fusedhooks, "fire") else None
    if schema is None:
        from fusedhooks.firing import ops  # noqa: F401  (registered when first needed)

        schema = torch.ops.fusedhooks.fire.default._schema
    mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert mutated == {"grad", "stats", "found_inf"}
    assert not schema.returns


def test_ops_keeping_python_books_stay_out_of_cuda_graphs():
    """fusedhooks::fire and fusedhooks::clip_grad_norm_ update Python books at every call: they carry
    torch.Tag.cudagraph_unsafe, so torch.compile(mode="reduce-overhead") runs them at every step instead of replaying
    their kernels without their Python (on a GPU: tests/test_gpu.py would replay them; CPU runs no CUDA graph)."""
    from fusedhooks.firing import ops  # noqa: F401  (registered when first needed)

    for op in (torch.ops.fusedhooks.fire.default, torch.ops.fusedhooks.clip_grad_norm_.default):
        assert torch.Tag.cudagraph_unsafe in op.tags, op


def test_paused_hook_under_compiled_autograd():
    model = make_model()
    hook = make_hook("triton")
    hook.register(model)
    x = batches(1)[0]
    expected = make_model()
    expected(x).square().sum().backward()
    with hook.paused(), compiled_autograd._enable(torch.compile(backend="aot_eager")):
        torch.compile(lambda x: model(x).square().sum().backward(), backend="aot_eager")(x)
    for p, e in zip(model.parameters(), expected.parameters()):
        assert torch.equal(p.grad, e.grad)
    assert hook.stats.read() == {}


def test_import_loads_neither_triton_nor_the_ops():
    code = ("import sys, fusedhooks; bad = [m for m in ('triton', 'fusedhooks.firing.ops') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reduce_overhead_steps_with_hooks_match_eager_cuda():
    """torch.compile(mode="reduce-overhead") with compiled autograd, over several steps with new inputs: each firing
    is traced (fusedhooks::firing, no Python books) and replayed in the CUDA graph with the device books it writes;
    gradients within inductor's rounding of eager, statistics fresh at each step. Written before a GPU ran it (see
    also tests/firing/test_compile_cuda.py)."""
    def run(compiled: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).cuda()
        hook = fh.grad_hook(lambda g: g.clamp(-0.01, 0.01) * 0.5, stats=STATS)
        hook.register(model)
        generator = torch.Generator("cuda").manual_seed(1)

        def step(x):
            model(x).square().sum().backward()

        compiled_step = torch.compile(step, mode="reduce-overhead")
        out = []
        for _ in range(4):
            x = torch.randn(32, 64, device="cuda", generator=generator)
            for p in model.parameters():
                p.grad = None
            if compiled:
                with compiled_autograd._enable(torch.compile(mode="reduce-overhead")):
                    compiled_step(x)
            else:
                step(x)
            torch.cuda.synchronize()
            reading = hook.stats.read()
            assert not reading.stale
            out.append(({n: p.grad.clone() for n, p in model.named_parameters()}, reading))
        return out

    for (grads, stats), (egrads, estats) in zip(run(True), run(False)):
        for name in grads:
            torch.testing.assert_close(grads[name], egrads[name])
        assert stats.keys() == estats.keys() and stats
        for name in stats:
            assert stats[name]["nan"] == estats[name]["nan"] == 0
            assert stats[name]["norm"] == pytest.approx(estats[name]["norm"], rel=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["compiled_model", "compiled_autograd"])
def test_compiled_training_matches_eager_cuda(mode):
    """On CUDA, through inductor: the op's implementation launches the generated kernels on the device.
    (It goes through the opaque fusedhooks::fire op; kernels visible to inductor through triton_op are
    not implemented yet, see docs/compile.md.)"""
    def run(compile_mode, hooked):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).cuda()
        hook = fh.grad_hook(lambda g: g.clamp(-0.01, 0.01) * 0.5, stats=STATS)
        if hooked:
            hook.register(model)
        fwd = torch.compile(model) if compile_mode == "compiled_model" else model
        x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(1))

        def step(x):
            fwd(x).square().sum().backward()

        if compile_mode == "compiled_autograd":
            with compiled_autograd._enable(torch.compile()):
                torch.compile(step)(x)
        else:
            step(x)
        torch.cuda.synchronize()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, hook.stats.read(), graph_breaks()

    grads_e, stats_e, _ = run("eager", True)
    _, _, breaks_without = run(mode, False)
    grads, stats, breaks = run(mode, True)
    for name in grads:
        # inductor's forward/backward may round differently from eager's: compare within fp32 tolerance
        torch.testing.assert_close(grads[name], grads_e[name])
    assert stats.keys() == stats_e.keys()
    for name in stats:
        for s, v in stats[name].items():
            assert v == pytest.approx(stats_e[name][s], rel=1e-5, abs=1e-7), (name, s)
    assert breaks == breaks_without


def test_traced_backward_holds_one_op_per_gradient():
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model, hook = make_model(), make_hook("triton")
    hook.register(model)
    loss = model(batches(1)[0]).pow(2).sum()
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend=backend)):
        loss.backward()
    ops = (torch.ops.fusedhooks.firing, torch.ops.fusedhooks.firing.default)
    calls = [n for gm in graphs for n in gm.graph.nodes if n.target in ops]
    assert len(calls) == 4
    assert [n.args[-1] if len(n.args) > 8 else n.kwargs["bump"] for n in calls] == [True, False, False, False]


def test_accumulation_steps_under_compiled_autograd_equal_eager():
    """The gate of accumulation_steps= runs outside the graph (a graph break) and keeps eager's results."""
    def run(compiled):
        torch._dynamo.reset()
        model, hook = make_model(), make_hook("triton")
        hook.register(model, accumulation_steps=2)
        for x in batches(3):
            loss = model(x).pow(2).sum()
            if compiled:
                with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
                    loss.backward()
            else:
                loss.backward()
        return [p.grad.clone() for p in model.parameters()], hook.stats.read()

    grads, stats = run(False)
    grads_c, stats_c = run(True)
    for g, h in zip(grads, grads_c):
        torch.testing.assert_close(g, h, rtol=1e-6, atol=1e-8)
    assert sorted(stats_c) == sorted(stats)
    for name in stats:
        assert stats_c[name] == pytest.approx(stats[name], rel=1e-6)


def clip_training(backend, compile_backend, clip="fusedhooks", steps=4, norm_type=2.0, max_norm=1.0):
    """`steps` SGD steps of a step that clips with fh.clip_grad_norm_ (or torch's, clip="torch") after backward; at
    odd steps the user first multiplies every gradient by 3 (the recorded norms no longer describe them: they
    are measured again). Compiled when compile_backend is not None. Returns the total norms, the parameters and
    the graph breaks counted."""
    torch._dynamo.reset()
    counters.clear()
    model = make_model()
    hook = fh.grad_hook(lambda g: g * 0.5, stats=("norm", "absmax"), backend=backend)
    hook.register(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, modify):
        model(x).square().sum().backward()
        if modify:
            for p in model.parameters():
                p.grad.mul_(3.0)
        if clip == "torch":
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        else:
            total = fh.clip_grad_norm_(hook, max_norm, norm_type)
        opt.step()
        opt.zero_grad()
        return total

    f = step if compile_backend is None else torch.compile(step, backend=compile_backend)
    totals = [f(x, i % 2 == 1) for i, x in enumerate(batches(steps))]
    return totals, [p.detach().clone() for p in model.parameters()], graph_breaks()


@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
def test_clip_grad_norm_in_compiled_step_matches_eager(fh_backend, compile_backend):
    """fh.clip_grad_norm_ in a compiled step is one fusedhooks::clip_grad_norm_ op (its implementation the eager
    call): the same total norms and parameters as the step run eagerly, gradients changed by hand after backward
    measured again (under aot_eager the op clips copies of the gradients, copied back after it), and no graph
    break but those of the same step with torch's clip_grad_norm_ (backward, the optimizer's)."""
    expected_totals, expected_params, _ = clip_training(fh_backend, None)
    totals, params, breaks = clip_training(fh_backend, compile_backend)
    if fh_backend == "triton" and compile_backend == "aot_eager":
        # aot_eager runs the hooks' fusedhooks::fire on copies of the gradients: the recorded norms describe the
        # copies, so clip_grad_norm_ reads the norms from the gradients (torch's norm, not the kernel's: they
        # may differ in the last bit, see clip_grad_norm_'s "Rounding")
        torch.testing.assert_close(totals, expected_totals, rtol=1e-6, atol=0)
        torch.testing.assert_close(params, expected_params, rtol=1e-6, atol=0)
    else:
        assert all(torch.equal(t, e) for t, e in zip(totals, expected_totals)), (totals, expected_totals)
        assert all(torch.equal(p, e) for p, e in zip(params, expected_params))
    _, _, torch_breaks = clip_training(fh_backend, compile_backend, clip="torch")
    assert breaks == torch_breaks
    assert expected_totals[1] > 1.0  # it clipped


@pytest.mark.parametrize("norm_type, max_norm", [(float("inf"), 1.0), (1.0, 1.0), (2.0, float("inf"))])
def test_clip_grad_norm_in_compiled_step_other_norms(norm_type, max_norm):
    """inf (recorded absmax), 1.0 (norms read from the gradients), and max_norm=inf (no write; the recorded norms
    kept as the gradients' description): as eager, under aot_eager's copies too."""
    expected_totals, expected_params, _ = clip_training("triton", None, norm_type=norm_type, max_norm=max_norm)
    totals, params, _ = clip_training("triton", "aot_eager", norm_type=norm_type, max_norm=max_norm)
    if norm_type == 2.0:
        # under aot_eager the 2-norms are read from the gradients by torch (float32 lanes), eagerly the kernel's
        # correctly rounded ones are kept: they agree within torch's rounding, not bit for bit
        rtol = torch_fp32_norm_rtol(p.numel() for p in make_model().parameters())
        torch.testing.assert_close(totals, expected_totals, rtol=rtol, atol=0)
    else:  # the inf-norm (absmax) is exact, and the 1-norm is torch's own on both sides
        assert all(torch.equal(t, e) for t, e in zip(totals, expected_totals)), (totals, expected_totals)
    assert all(torch.equal(p, e) for p, e in zip(params, expected_params))  # max_norm=inf or the same coefficient


def test_compiled_clip_grad_norm_is_one_op():
    """Compiled alone, fh.clip_grad_norm_ is one graph holding one fusedhooks::clip_grad_norm_ call on the four
    gradients, and no graph break (as torch's clip_grad_norm_); the result is the eager call's."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def clipped(compiled):
        torch._dynamo.reset()
        counters.clear()
        model, hook = make_model(), make_hook("triton")
        hook.register(model)
        model(batches(1)[0]).square().sum().backward()
        clip = (lambda: fh.clip_grad_norm_(hook, 1e-3))
        total = torch.compile(clip, backend=backend)() if compiled else clip()
        return total, [p.grad.clone() for p in model.parameters()]

    total, grads = clipped(True)
    assert graph_breaks() == 0
    ops = (torch.ops.fusedhooks.clip_grad_norm_, torch.ops.fusedhooks.clip_grad_norm_.default)
    calls = [n for gm in graphs for n in gm.graph.nodes if n.target in ops]
    assert len(graphs) == 1 and len(calls) == 1 and len(calls[0].args[0]) == 4
    schema = torch.ops.fusedhooks.clip_grad_norm_.default._schema
    assert {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write} == {"grads"}
    expected_total, expected_grads = clipped(False)
    assert torch.equal(total, expected_total)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads))


def test_compiled_clip_grad_norm_with_a_tensor_max_norm():
    """A max_norm that is a tensor is an input of the op (read with float() when it runs, as eager reads it): no
    graph break, the eager result; anything but a hook is refused as in eager."""
    def run(compiled):
        torch._dynamo.reset()
        counters.clear()
        model, hook = make_model(), make_hook("eager")
        hook.register(model)
        model(batches(1)[0]).square().sum().backward()
        clip = (lambda m: fh.clip_grad_norm_(hook, m))
        total = (torch.compile(clip, backend="eager") if compiled else clip)(torch.tensor(1e-3))
        return total, [p.grad for p in model.parameters()], graph_breaks()

    total, grads, breaks = run(True)
    expected_total, expected_grads, _ = run(False)
    assert breaks == 0
    assert torch.equal(total, expected_total)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads))
    with pytest.raises(TypeError, match="fusedhooks hook"):
        torch.compile(lambda: fh.clip_grad_norm_(torch.nn.Linear(2, 2), 1.0), backend="eager")()


class MixedModel(torch.nn.Module):
    """A float32 layer, a bfloat16 scale and an empty float32 parameter (its gradient has no element): two of torch's
    (device, dtype) groups of gradients, one gradient that contributes 0 to the total norm."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 4)
        self.scale = torch.nn.Parameter(torch.rand(4, dtype=torch.bfloat16) + 0.5)
        self.empty = torch.nn.Parameter(torch.zeros(0))

    def forward(self, x):
        return self.linear(x) * self.scale.float() + self.empty.sum()


def halve_grad(p):
    p.grad.mul_(0.5)


def traced_clip_training(clip, norm_type, foreach, steps=5):
    """`steps` SGD steps of MixedModel under compiled autograd turned on by PyTorch's flag, the step compiled with
    aot_eager: a hook halving each gradient, the step clipping with fh.clip_grad_norm_ (clip="fusedhooks", a
    fusedhooks hook recording statistics) or torch's (clip="torch", a plain Python hook); at odd steps the user first
    multiplies every gradient by 3. Returns the total norms, the parameters, the fusedhooks Python calls of the warm
    steps and the targets of the ops in the compiled graphs."""
    model = MixedModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if clip == "fusedhooks":
        hook = fh.grad_hook(lambda g: g * 0.5, stats=("norm", "absmax"), backend="triton")
        hook.register(model)
    else:  # torch's yardstick: a plain post-accumulate hook with the same body
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(halve_grad)
    targets = set()

    def backend(gm, example_inputs):
        targets.update(n.target for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.backends.common.aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    def step(x, modify):
        (model(x) - x[:, :4]).square().sum().backward()
        if modify:
            for p in model.parameters():
                p.grad.mul_(3.0)
        if clip == "torch":
            # torch raises for the inf-norm of an empty gradient, where fh counts it as 0: left out here alike
            total = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.numel()], 0.05, norm_type,
                                                   foreach=foreach)
        else:
            total = fh.clip_grad_norm_(hook, 0.05, norm_type, foreach=foreach)
        return total

    torch._dynamo.config.compiled_autograd = True
    try:
        compiled = torch.compile(step, backend=backend)
        totals, calls = [], []
        for i, x in enumerate(batches(steps)):
            if i >= 2:
                calls.append(python_calls(lambda x=x, i=i: totals.append(compiled(x, i % 2 == 1))))
            else:
                totals.append(compiled(x, i % 2 == 1))
            opt.step()
            opt.zero_grad(set_to_none=False)
    finally:
        torch._dynamo.config.compiled_autograd = False
    return totals, [p.detach().clone() for p in model.parameters()], calls, targets


@pytest.mark.parametrize(("norm_type", "foreach"), [(2.0, None), (float("inf"), None), (1.0, False)],
                         ids=["norm2", "inf", "norm1-no-foreach"])
def test_clip_grad_norm_in_a_compiled_autograd_step_is_torchs_clip_traced(norm_type, foreach):
    """With compiled autograd on, the firings keep no record of what they measured, so fh.clip_grad_norm_ in the
    compiled step is traced as torch's own clip over the gradients (no fusedhooks operator in the graph, no Python of
    fusedhooks in a warm step): the total norms and parameters of the same step with torch.nn.utils.clip_grad_norm_,
    bit for bit, over float32, bfloat16 and empty gradients, gradients multiplied by hand after backward (odd steps)
    included."""
    totals, params, calls, targets = traced_clip_training("fusedhooks", norm_type, foreach)
    expected_totals, expected_params, _, _ = traced_clip_training("torch", norm_type, foreach)
    assert all(torch.equal(t, e) for t, e in zip(totals, expected_totals)), (totals, expected_totals)
    assert all(torch.equal(p, e) for p, e in zip(params, expected_params))
    assert calls == [0, 0, 0]
    assert not any("fusedhooks" in str(t) and "clip" in str(t) for t in targets)
    assert max(t.item() for t in expected_totals) > 0.05  # it clipped


def test_clip_grad_norm_in_a_compiled_autograd_step_refuses_a_hook_without_the_norm():
    """The traced clip keeps eager's check: a hook that records no norm is refused for norm_type 2.0."""
    model = MixedModel()
    hook = fh.grad_hook(lambda g: g * 0.5, stats=("max",), backend="triton")
    hook.register(model)

    def step(x):
        (model(x) - x[:, :4]).square().sum().backward()
        return fh.clip_grad_norm_(hook, 0.05)

    torch._dynamo.config.compiled_autograd = True
    try:
        with pytest.raises(Exception, match="add 'norm' to its stats="):
            torch.compile(step, backend="aot_eager")(batches(1)[0])
    finally:
        torch._dynamo.config.compiled_autograd = False


_STEP_STATE = {}  # a step reading its model and hook from a global: dynamo skips the frame after backward()


def _global_step(x):
    _STEP_STATE["model"](x).square().sum().backward()
    return fh.clip_grad_norm_(_STEP_STATE["hook"], 1e-3)


def test_compiled_step_whose_rest_dynamo_skips_runs_clip_grad_norm_eagerly():
    """After `loss.backward()` the rest of this step holds no tensor (its model and hook are globals), so dynamo
    skips that frame and fh.clip_grad_norm_ runs eagerly, still called while torch.compile is active: it must
    not let dynamo compile its host logic or the launch on its own (under the interpreter, dynamo traced into
    Triton's interpreter and failed). Same result as eager, with the Triton backend."""
    def run(compiled):
        torch._dynamo.reset()
        _STEP_STATE["model"], _STEP_STATE["hook"] = make_model(), make_hook("triton")
        _STEP_STATE["hook"].register(_STEP_STATE["model"])
        total = (torch.compile(_global_step, backend="eager") if compiled else _global_step)(batches(1)[0])
        return total, [p.grad for p in _STEP_STATE.pop("model").parameters()]

    try:
        total, grads = run(True)
        expected_total, expected_grads = run(False)
    finally:
        _STEP_STATE.clear()
    assert torch.equal(total, expected_total)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_clip_grad_norm_in_compiled_step_cuda():
    """On CUDA, a step compiled by inductor with fh.clip_grad_norm_ in it: the op launches the multi-tensor scale
    kernel; the same total norms and parameters as eager within fp32 tolerance (inductor's forward may round
    differently), and the graph breaks of the same step with torch's clip_grad_norm_."""
    def run(compiled, clip):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).cuda()
        hook = fh.grad_hook(lambda g: g * 0.5, stats=("norm",))
        hook.register(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x, modify):
            model(x).square().sum().backward()
            if modify:
                for p in model.parameters():
                    p.grad.mul_(3.0)
            total = (fh.clip_grad_norm_(hook, 1.0) if clip == "fusedhooks"
                     else torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            opt.step()
            opt.zero_grad()
            return total

        f = torch.compile(step) if compiled else step
        gen = torch.Generator("cuda").manual_seed(1)
        totals = [f(torch.randn(32, 64, device="cuda", generator=gen), i % 2 == 1) for i in range(2)]
        torch.cuda.synchronize()
        return totals, [p.detach().clone() for p in model.parameters()], graph_breaks()

    expected_totals, expected_params, _ = run(False, "fusedhooks")
    totals, params, breaks = run(True, "fusedhooks")
    _, _, torch_breaks = run(True, "torch")
    torch.testing.assert_close(totals, expected_totals)
    torch.testing.assert_close(params, expected_params)
    assert breaks == torch_breaks


class SkippingModel(torch.nn.Module):
    """Three layers; the middle one is left out of the forward when `skip` is set (its parameters get no gradient in
    that backward: their rows go stale)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.middle, self.last = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
        self.skip = False

    def forward(self, x):
        h = torch.relu(self.first(x))
        if not self.skip:
            h = h + torch.tanh(self.middle(h))
        return self.last(h)


def skipping_training(compile_backend, steps=12, eager_steps=()):
    """`steps` SGD steps of SkippingModel with a clip-scale-and-statistics hook, the middle layer skipped at every third
    step, inputs new at each; the backward under compiled autograd with `compile_backend` (None, and the steps in
    `eager_steps`: eager). Returns (gradients, read()) after each backward, the fusedhooks Python calls made by each
    warm compiled backward, and the graphs dynamo compiled after the first three steps (one of each kind)."""
    torch._dynamo.reset()
    counters.clear()
    model = SkippingModel()
    hook = make_hook("triton")
    hook.register(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    out, calls, graphs = [], [], None
    for i in range(steps):
        model.skip = i % 3 == 2
        loss = model(torch.randn(5, 8, generator=g)).square().sum()
        if compile_backend is None or i in eager_steps:
            loss.backward()
        else:
            with compiled_autograd._enable(torch.compile(backend=compile_backend)):
                made = python_calls(loss.backward)
            if i >= 3:
                calls.append(made)
        if i == 2:
            graphs = counters["stats"]["unique_graphs"]
        out.append(({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                    hook.stats.read()))
        opt.step()
        opt.zero_grad(set_to_none=False)
    return out, calls, counters["stats"]["unique_graphs"] - graphs


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_compiled_autograd_fires_without_python_over_many_steps(compile_backend):
    """Each firing is one fusedhooks::firing op traced into compiled autograd's graph: over 12 steps with new inputs
    and a layer skipped at every third (stale rows), the gradients, statistics and stale rows equal eager's; a warm
    backward runs no Python of fusedhooks (the issue's "0 Python calls per firing"), and after the first step of
    each graph nothing is compiled again."""
    expected, _, _ = skipping_training(None)
    got, calls, recompiled = skipping_training(compile_backend)
    # inductor fuses the model's own backward (tanh's derivative), rounding its gradients its own way
    assert_same(got, expected, grads_rtol=REDUCTION_RTOL[torch.float32] if compile_backend == "inductor" else 0.0)
    assert any(stats.stale for _, stats in expected)  # the skipped layer's rows went stale
    assert calls == [0] * len(calls) and len(calls) == 9
    assert recompiled == 0


def test_eager_and_compiled_backwards_of_one_hook_number_rows_alike():
    """A hook fired eagerly in some backwards and traced in others: stale rows are told by one numbering (the
    device's, once a firing was traced), so they equal those of an all-eager run."""
    expected, _, _ = skipping_training(None, steps=9)
    got, _, _ = skipping_training("aot_eager", steps=9, eager_steps=(0, 3, 4, 8))
    assert_same(got, expected)


def test_firing_op_declares_what_it_writes_and_may_be_replayed():
    """fusedhooks::firing writes the gradient, the statistics buffer and the device backward numbers, declared; it
    keeps no Python books, so a CUDA graph may replay it (no cudagraph_unsafe tag)."""
    from fusedhooks.firing import ops  # noqa: F401  (registered when first needed)

    op = torch.ops.fusedhooks.firing.default
    mutated = {a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert mutated == {"grad", "stats", "generations", "epoch", "found_inf", "unscaled_backwards"}
    assert not op._schema.returns
    assert torch.Tag.cudagraph_unsafe not in op.tags


def test_clip_grad_norm_after_a_traced_backward_measures_the_gradients():
    """A traced firing keeps no record of what it measured: fh.clip_grad_norm_ after it measures the gradients, as
    torch's clip_grad_norm_ does, and clips them alike."""
    torch._dynamo.reset()
    model, hook = make_model(), make_hook("triton")
    hook.register(model)
    reference = make_model()
    x = batches(1)[0]
    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
        model(x).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        q.grad = p.grad.clone()
    total = fh.clip_grad_norm_(hook, 0.01)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    n = [p.numel() for p in model.parameters()]
    assert abs(total.item() - expected.item()) <= torch_fp32_norm_rtol(n) * expected.item()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_close_to(p.grad, q.grad, torch_fp32_norm_rtol(n))


def amp_training(compiled, steps=12, inf_steps=(3, 8)):
    """`steps` GradScaler steps (the scale grows every 2 steps, backs off at each step in `inf_steps`, where the loss is
    multiplied by inf) of a model whose hook unscales (scaler=), clips and records statistics; the backward under
    compiled autograd (aot_eager) when `compiled`. Returns (scale, parameters, read()) after each step and the
    fusedhooks Python calls of each warm compiled backward."""
    torch._dynamo.reset()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    hook = fh.grad_hook(lambda g: g.clamp(-0.05, 0.05), stats=("norm", "inf", "max"), scaler=scaler, optimizer=opt)
    hook.register(model)
    g = torch.Generator().manual_seed(3)
    out, calls = [], []
    for i in range(steps):
        factor = torch.tensor(float("inf") if i in inf_steps else 1.0)
        loss = scaler.scale(model(torch.randn(5, 8, generator=g)).square().mean() * factor)
        if compiled:
            with compiled_autograd._enable(torch.compile(backend="aot_eager")):
                made = python_calls(loss.backward)
            if i >= 2:
                calls.append(made)
        else:
            loss.backward()
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), [p.detach().clone() for p in model.parameters()], hook.stats.read()))
        opt.zero_grad(set_to_none=False)
    return out, calls


def test_amp_traced_firings_over_many_steps_equal_eager():
    """scaler= under compiled autograd over 12 steps with changing scales and two overflow steps: each firing traced
    (no Python of fusedhooks in a warm backward), GradScaler.step takes what the device found, and the scales,
    parameters and statistics equal eager's."""
    expected, _ = amp_training(False)
    got, calls = amp_training(True)
    assert calls == [0] * 10
    scales = [scale for scale, _, _ in expected]
    assert len(set(scales)) >= 3 and scales[3] < scales[2]  # grew and backed off
    for (scale, params, stats), (escale, eparams, estats) in zip(got, expected):
        assert scale == escale
        assert all(torch.equal(p, e) for p, e in zip(params, eparams))
        assert_same_stats(stats, estats)


def test_amp_traced_refuses_a_gradient_unscaled_twice_and_unscale_by_hand():
    """The checks of the eager firing, made at GradScaler.step/unscale_ from the device books: two traced backwards
    accumulating into the gradients before one step are refused (the second unscaled a sum of unscaled and scaled
    values), and so is scaler.unscale_ after a traced backward (it would unscale again)."""
    torch._dynamo.reset()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    hook = fh.grad_hook(lambda g: g * 1.0, scaler=scaler, optimizer=opt)
    hook.register(model)
    x = batches(1)[0]
    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
        for _ in range(2):
            scaler.scale(model(x).square().mean()).backward()
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="already unscaled this gradient"):
        scaler.step(opt)
    scaler.step(opt)  # the books left skip the step
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 9
    opt.zero_grad()
    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
        scaler.scale(model(x).square().mean()).backward()
    with pytest.raises(RuntimeError, match="do not call scaler.unscale_"):
        scaler.unscale_(opt)
    scaler.step(opt)  # still takes what the backward found
    scaler.update()


def python_state(obj, depth: int = 4, seen=None):
    """What `obj` holds in Python, walked through attributes, dicts, lists and tuples down to `depth`: tensors by
    identity (their values are device state), weak references by their referent, other leaves by repr."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        return ("tensor", id(obj))
    if isinstance(obj, weakref.ref):
        target = obj()
        return ("weakref", id(target) if target is not None else None)
    if obj is None or isinstance(obj, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        return repr(obj)
    if depth == 0 or id(obj) in seen or callable(obj) and not hasattr(obj, "__dict__"):
        return repr(type(obj))
    seen.add(id(obj))
    if isinstance(obj, dict):
        return {repr(k): python_state(v, depth - 1, seen) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [python_state(v, depth - 1, seen) for v in obj]
    attributes = getattr(obj, "__dict__", None)
    if attributes is None and hasattr(obj, "__slots__"):
        attributes = {name: getattr(obj, name, None) for name in obj.__slots__}
    if attributes is None:
        return repr(obj)
    return {name: python_state(v, depth - 1, seen) for name, v in attributes.items()}


@pytest.mark.parametrize("with_scaler", [False, True], ids=["stats", "stats-and-scaler"])
def test_a_traced_firing_changes_only_device_state(with_scaler):
    """No per-firing state lives only in Python: a warm traced backward leaves everything the hook holds in Python as it
    was (what CUDA graphs replay without Python), while the gradients, the statistics and the device books change."""
    torch._dynamo.reset()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0) if with_scaler else None
    hook = fh.grad_hook(lambda g: g.clamp(-0.01, 0.01) * 0.5, stats=STATS, scaler=scaler,
                        optimizer=opt if with_scaler else None)
    hook.register(model)
    g = torch.Generator().manual_seed(4)

    def backward():
        loss = model(torch.randn(5, 8, generator=g)).square().sum()
        with compiled_autograd._enable(torch.compile(backend="aot_eager")):
            (scaler.scale(loss) if with_scaler else loss).backward()

    for _ in range(2):  # compiled, then warm
        backward()
        opt.zero_grad(set_to_none=False)
    def device_state():
        return [hook.stats.tensor, *hook.stats.traced, *(hook.amp.traced[torch.device("cpu")] if hook.amp else ())]

    before = python_state(hook)
    device = [t.clone() for t in device_state()]
    backward()
    assert python_state(hook) == before
    after = device_state()
    assert not torch.equal(after[0], device[0])  # new statistics
    assert after[2].item() == device[2].item() + 1  # the epoch: one backward more
    if with_scaler:
        assert after[4].item() == device[4].item() + 1  # one more backward unscaled since the last step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_traced_firing_records_every_statistic(dtype):
    """Every statistic, the histogram and input statistics of a traced firing (the plan's torch ops, the histogram
    without a data-dependent shape), with non-finite gradients (an Inf input): equal to eager's over 3 steps."""
    def run(compiled):
        torch._dynamo.reset()
        model = make_model().to(dtype)
        hook = fh.grad_hook(lambda g: g.nan_to_num(0.0, 1.0, -1.0).clamp(-0.05, 0.05) * 0.5,
                            stats=("all", "hist"), input_stats=("norm", "nan", "inf", "hist"))
        hook.register(model)
        g = torch.Generator().manual_seed(5)
        out = []
        for i in range(3):
            x = torch.randn(5, 8, generator=g).to(dtype)
            if i == 1:
                x[0, 0] = float("inf")  # NaN and Inf in the first layer's gradients
            loss = model(x).square().sum()
            if compiled:
                with compiled_autograd._enable(torch.compile(backend="aot_eager")):
                    loss.backward()
            else:
                loss.backward()
            out.append(({n: p.grad.clone() for n, p in model.named_parameters()}, hook.stats.read()))
            model.zero_grad(set_to_none=False)
        return out

    expected, got = run(False), run(True)
    assert any(row["input.nan"] or row["input.inf"] for row in expected[1][1].values())
    assert_same(got, expected)


def test_amp_traced_firing_before_the_scaler_has_a_scale_is_refused():
    """As the eager firing refuses it: a hook with scaler= traced before scaler.scale(loss) made a scale."""
    torch._dynamo.reset()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    fh.grad_hook(lambda g: g * 1.0, scaler=scaler, optimizer=opt).register(model)
    loss = model(batches(1)[0]).square().mean()
    with pytest.raises(RuntimeError, match="no scale yet: call scaler.scale"):
        with compiled_autograd._enable(torch.compile(backend="aot_eager")):
            loss.backward()
