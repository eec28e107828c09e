"""GPU-only (skipped without CUDA): a hook's firings in compiled and captured training steps on CUDA, against eager.

- inductor with compiled autograd: each firing is fusedhooks::firing, whose CUDA branch (`runtime.fire_traced`)
  launches the generated Triton kernels through wrap_triton: the compiled graph runs them, no firing of fusedhooks'
  Python runs in a warm step;
- torch.compile(mode="reduce-overhead") with compiled autograd: the firings are captured in its CUDA graphs;
- torch.cuda.graph capture of a whole eager step (forward, backward with the hook firing, SGD step), replayed.

Each is compared with the same steps run eagerly: gradients within fp32 tolerance (inductor's forward and backward
may round differently from eager's), statistics within DESIGN's tolerances (norm, std: 1e-5 relative; NaN counts
exact), and the same fresh/stale rows of `hook.stats.read()`, with a step in which one layer is skipped (its
parameters get no gradient). Written before a GPU ran them (benchmarks/gpu_check.sh runs them: `-m gpu`).
"""

import pytest
import torch
from torch._dynamo import compiled_autograd
from torch._dynamo.utils import counters

import fusedhooks as fh
from fusedhooks.runtime import launcher as runtime

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STATS = ("norm", "max", "nan", "std")
STEPS = 12
SKIPPED = (4, 8)  # steps whose forward skips layer b (its parameters get no gradient: stale rows)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 256)
        self.b = torch.nn.Linear(256, 256)
        self.c = torch.nn.Linear(256, 8)

    def forward(self, x, skip: bool):
        h = torch.relu(self.a(x))
        if not skip:
            h = torch.relu(self.b(h))
        return self.c(h)


def make(hooked=True):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net().cuda()
    hook = fh.grad_hook(lambda g: g.clamp(-0.01, 0.01) * 0.5, stats=STATS)
    if hooked:
        hook.register(model)
    return model, hook, torch.optim.SGD(model.parameters(), lr=0.01)


def inputs(steps=STEPS):
    generator = torch.Generator("cuda").manual_seed(1)
    return [torch.randn(32, 64, device="cuda", generator=generator) for _ in range(steps)]


def assert_matches(got, expected):
    """Per step: (gradients by name, the reading of hook.stats) against eager's."""
    assert len(got) == len(expected)
    for i, ((grads, reading), (egrads, ereading)) in enumerate(zip(got, expected)):
        assert grads.keys() == egrads.keys(), i
        for name in grads:
            torch.testing.assert_close(grads[name], egrads[name], msg=lambda m, i=i, name=name: f"step {i} {name}: {m}")
        assert reading.keys() == ereading.keys() and reading, i
        assert reading.stale == ereading.stale, (i, reading.stale, ereading.stale)
        for name in reading:
            assert reading[name].fresh == ereading[name].fresh, (i, name)
            assert reading[name]["nan"] == ereading[name]["nan"] == 0, (i, name)
            for stat in ("norm", "std", "max"):
                assert reading[name][stat] == pytest.approx(ereading[name][stat], rel=1e-5, abs=1e-12), (i, name, stat)
    assert any(reading.stale for _, reading in expected), "a step left rows stale"


def train(compile_mode=None, hooked=True, begin_step=None):
    """STEPS SGD steps with new inputs, gradients set to None before each; compile_mode None: eager, else the step
    (forward and backward) compiled with compiled autograd, in that mode ("default": inductor's default).
    begin_step: called before each step. Per step: (gradients by name, hook.stats.read())."""
    model, hook, opt = make(hooked)

    def step(x, skip):
        model(x, skip).square().sum().backward()

    compiled = torch.compile(step, mode=compile_mode) if compile_mode else None
    out = []
    for i, x in enumerate(inputs()):
        opt.zero_grad(set_to_none=True)
        if begin_step is not None:
            begin_step()
        if compiled is None:
            step(x, i in SKIPPED)
        else:
            with compiled_autograd._enable(torch.compile(mode=compile_mode)):
                compiled(x, i in SKIPPED)
        torch.cuda.synchronize()
        out.append(({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                    hook.stats.read()))
        opt.step()
    return out


@pytest.fixture
def launches(monkeypatch):
    """Per step (a dict appended by calling the result), the launches of fusedhooks' eager firing (runtime.launch)
    and the kernels traced by the compiled firing (runtime.launch_traced: called while torch.compile traces, never
    when the compiled graph runs)."""
    steps = []

    def counted(key, fn):
        def call(*args, **kwargs):
            if steps:
                steps[-1][key] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(runtime, "launch", counted("launch", runtime.launch))
    monkeypatch.setattr(runtime, "launch_traced", counted("traced", runtime.launch_traced))

    def begin_step():
        steps.append({"launch": 0, "traced": 0})

    begin_step.steps = steps
    return begin_step


def test_inductor_compiled_autograd_launches_the_kernels_from_the_graph(launches):
    """Under inductor with compiled autograd each firing is fusedhooks::firing traced into the backward graph, its
    CUDA branch launching the generated kernels through wrap_triton: kernels are traced when a graph compiles (the
    first step, and the first with the skipped layer), and no step launches anything from fusedhooks' Python (the
    eager firing through fusedhooks::fire would); warm steps trace nothing, and their statistics are fresh."""
    expected = train()
    got = train("default", begin_step=launches)
    assert_matches(got, expected)
    steps = launches.steps
    assert len(steps) == STEPS
    assert all(s["launch"] == 0 for s in steps), steps
    assert steps[0]["traced"] > 0 and steps[SKIPPED[0]]["traced"] > 0, steps
    assert all(s["traced"] == 0 for s in steps[SKIPPED[0] + 1:]), steps


def test_reduce_overhead_captures_the_firings_and_replays_equal_eager():
    """torch.compile(mode="reduce-overhead") with compiled autograd: fusedhooks::firing is not cudagraph_unsafe and
    writes only static tensors (the statistics buffer, the backward numbers) or tensors of the graph, so the hooks
    add no CUDA-graph skip to those of the same steps without them; every replayed step equals eager (statistics
    fresh, the skipped layer's rows stale)."""
    train("reduce-overhead", hooked=False)
    skips_without = counters["inductor"]["cudagraph_skips"]
    got = train("reduce-overhead")
    assert counters["inductor"]["cudagraph_skips"] == skips_without
    assert_matches(got, train())


def test_cuda_graph_capture_of_an_eager_step_replays_equal_eager():
    """A whole eager step (forward, backward with the hook firing through its Triton kernels, SGD step) captured with
    torch.cuda.graph after warm-up steps on a side stream (the firing's workspace, bound launches and compiled
    kernels are made there: the captured firing allocates nothing and does not sync), then replayed with new inputs
    copied into the static input: parameters and statistics after each replay equal eager's."""
    xs = inputs(3 + 6)
    warmup, replays = xs[:3], xs[3:]

    def eager_run():
        model, hook, opt = make()
        out = []
        for i, x in enumerate(xs):
            opt.zero_grad(set_to_none=True)
            model(x, False).square().sum().backward()
            opt.step()
            if i >= len(warmup):
                out.append(([p.detach().clone() for p in model.parameters()], hook.stats.read()))
        return out

    model, hook, opt = make()
    static_x = torch.zeros(32, 64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in warmup:
            static_x.copy_(x)
            opt.zero_grad(set_to_none=True)
            model(static_x, False).square().sum().backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    params_before = [p.detach().clone() for p in model.parameters()]
    static_x.copy_(replays[0])
    with torch.cuda.graph(graph):
        model(static_x, False).square().sum().backward()
        opt.step()
    # capturing runs nothing: the captured step has not happened yet
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params_before))
    got = []
    for x in replays:
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        got.append(([p.detach().clone() for p in model.parameters()], hook.stats.read()))
    expected = eager_run()
    assert len(got) == len(expected) == len(replays)
    for i, ((params, reading), (eparams, ereading)) in enumerate(zip(got, expected)):
        torch.testing.assert_close(params, eparams, msg=lambda m, i=i: f"replay {i}: {m}")
        assert reading.keys() == ereading.keys() and reading and not reading.stale
        for name in reading:
            assert reading[name]["nan"] == ereading[name]["nan"] == 0
            for stat in ("norm", "std", "max"):
                assert reading[name][stat] == pytest.approx(ereading[name][stat], rel=1e-5, abs=1e-12), (i, name)
    # the replays changed what the hook recorded (each replay's firing wrote its row)
    assert got[0][1]["a.weight"]["norm"] != got[-1][1]["a.weight"]["norm"]
