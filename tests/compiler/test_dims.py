"""Reductions over dimensions in hook bodies (dim=, keepdim=, unsqueeze) and fh.agc, against eager torch.

The eager and reference backends run them as eager torch ops: their results equal eager torch's bit for bit. The
Triton kernels (backend "triton", and "auto" here: the interpreter) reduce each unit in fp64 and round once, as the
whole-tensor reductions do: within REDUCTION_RTOL of eager torch (which accumulates in fp32), exact for amax, amin,
all and any."""

import math
import warnings

import pytest
import torch

import fusedhooks as fh
from fusedhooks.compiler.trace import CompileError

from helpers import REDUCTION_RTOL, assert_close_to, assert_same_values, count_launches, timm_agc_

BACKENDS = ["eager", "reference", "triton", "auto"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def assert_matches(got, expected, backend, dtype):
    """Bit for bit for the backends that run eager torch ops; within REDUCTION_RTOL for the Triton kernels."""
    if backend in ("eager", "reference"):
        assert_same_values(got, expected)
    else:
        assert_close_to(got, expected, REDUCTION_RTOL[dtype])

#: name -> (body, the shapes it applies to); each body broadcasts its reduction back over the gradient. Shapes
#: include units of one element, rows longer than a program holds (5000 > 4096: two passes) and of exactly 4096,
#: columns (units side by side) over several programs, 1-d and 4-d tensors
BODIES = {
    "row_norm": (lambda g: g / (g.norm(dim=1, keepdim=True) + 1e-3),
                 [(1, 9), (9, 1), (5, 13), (3, 4, 5, 6), (3, 5000), (2, 4096)]),
    "last_vector_norm_inf": (lambda g: g / (torch.linalg.vector_norm(g, float("inf"), dim=-1, keepdim=True) + 1),
                             [(7,), (1, 9), (5, 13), (3, 4, 5, 6)]),
    "column_mean": (lambda g: g - g.mean(dim=0), [(7,), (1, 9), (9, 1), (5, 13), (3, 4, 5, 6), (4100, 3), (3, 200)]),
    "unit_sum_tuple": (lambda g: g * g.sum(dim=(1, 2), keepdim=True), [(3, 4, 5, 6), (2, 3, 1)]),
    "var_std": (lambda g: (g - g.mean(dim=-1, keepdim=True)) / (g.std(dim=-1, keepdim=True) + 1)
                + g.var(dim=-1, unbiased=False, keepdim=True), [(5, 13), (3, 4, 5, 6), (2, 5000)]),
    "var_correction": (lambda g: g * g.var(dim=0, correction=0), [(5, 13), (9, 1), (5000, 2)]),
    "middle_dims": (lambda g: g - g.amax(dim=(0, 2), keepdim=True) + g.sum(dim=(1, 3), keepdim=True),
                    [(3, 4, 5, 6), (2, 1, 7, 3)]),
    "row_vector_broadcast": (lambda g: g * g.mean(dim=1), [(5, 5), (1, 1)]),  # (n,) broadcasts along rows
    "amax_amin": (lambda g: g / (g.amax(dim=1, keepdim=True) - g.amin(dim=1, keepdim=True) + 1),
                  [(5, 13), (1, 9), (2, 6000)]),
    "all_any": (lambda g: torch.where(torch.isfinite(g).all(dim=1, keepdim=True), g, 0.0)
                + (g > 1).any(dim=-1, keepdim=True).float(), [(5, 13), (3, 4, 5, 6), (2, 5000)]),
    "unsqueeze": (lambda g: g / (g.norm(dim=1).unsqueeze(1) + 1e-3), [(5, 13), (4, 5, 6)]),
    "mixed_with_whole": (lambda g: g / (g.norm(dim=0) + g.norm() + 1e-3), [(7,), (5, 13)]),
    "nested": (lambda g: g / (g.abs().sum(dim=1, keepdim=True).amax() + 1), [(5, 13), (3, 4, 5, 6), (2, 5000)]),
    "factored": (lambda g: g * (g * g).mean(dim=1, keepdim=True) * (g * g).mean(dim=0, keepdim=True)
                 / ((g * g).mean(dim=1).mean() + 1), [(5, 13), (70, 3)]),  # Adafactor's row and column means
    "max_min_values": (lambda g: g / (g.max(dim=1).values.unsqueeze(1) - torch.min(g, 1, keepdim=True)[0] + 1),
                       [(5, 13), (1, 9), (9, 1)]),
    "max_min_positional_keepdim": (lambda g: g / (g.max(1, True)[0] - torch.min(g, 1, True).values + 1),
                                   [(5, 13), (9, 1)]),
}
CASES = [(name, shape) for name, (_, shapes) in BODIES.items() for shape in shapes]


def _gradient(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    if x.numel() > 3:
        x.view(-1)[2] = 0.0
    return x.to(dtype)


def _hook(fn, backend, **options):
    return fh.grad_hook(fn, backend=None if backend == "auto" else backend, **options)


def _fire(hook, grad):
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # auto's fallback warning: tested on its own
        hook.register(p)
        hook(p)
    return p.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name, shape", CASES, ids=[f"{n}-{'x'.join(map(str, s))}" for n, s in CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_reduction_over_dims_equals_eager_torch(name, shape, dtype, backend):
    fn = BODIES[name][0]
    grad = _gradient(shape, dtype)
    expected = fn(grad.clone()).to(dtype)
    hook = _hook(fn, backend, stats=("norm", "max"))
    got = _fire(hook, grad)
    assert_matches(got, expected, backend, dtype)
    if backend != "auto" or not torch.cuda.is_available():
        assert hook.compiled(dtype, grad.device, shape=shape).plan.backend == (
            "triton" if backend == "auto" else backend)  # auto: the interpreter compiles every body here


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name", BODIES)
def test_bucketed_every_shape_at_once(name, dtype, monkeypatch):
    """Every shape of a body in one bucket (plus an empty gradient): the same values as eager torch, one launch per
    pass for each set of kernels (the one-pass kernel: every shape it takes; the others: one shape each)."""
    fn, shapes = BODIES[name]
    grads = [_gradient(shape, dtype, seed=i) for i, shape in enumerate(shapes)]
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in shapes]
    empty = torch.nn.Parameter(torch.zeros(0, 5, dtype=dtype)) if name == "row_norm" else None
    hook = fh.grad_hook(fn, backend="triton", stats=("count", "max"))
    hook.register(params + ([empty] if empty is not None else []), bucket_mb=25)
    launches = count_launches(monkeypatch)
    loss = sum((p * g).sum() for p, g in zip(params, grads))
    if empty is not None:
        loss = loss + empty.sum()
    loss.backward()
    for p, g in zip(params, grads):
        assert_matches(p.grad, fn(g.clone()).to(dtype), "triton", dtype)
    modules = {hook.compiled(dtype, p.device, shape=p.shape).kernel for p in params}
    expected = sum(len(module.SPEC.multi_kernels) for module in modules)
    assert len(launches) == expected and all(n.endswith("_multi") for n, _ in launches)
    if empty is not None:
        assert empty.grad.shape == (0, 5) and hook.stats.read()["param" + str(len(params))]["count"] == 0


#: one reduction per body, read back where its units are: NaN and Inf in some units
NAN_INF_BODIES = {
    "sum": lambda g: g - g.sum(dim=1, keepdim=True),
    "mean_dim0": lambda g: g - g.mean(dim=0),
    "norm": lambda g: g / (g.norm(dim=1, keepdim=True) + 1),
    "vector_norm_1": lambda g: g / (torch.linalg.vector_norm(g, 1, dim=1, keepdim=True) + 1),
    "norm_minus_inf": lambda g: g - torch.linalg.vector_norm(g, -math.inf, dim=0),
    "var": lambda g: g * g.var(dim=1, keepdim=True),
    "std_dim0": lambda g: g * g.std(dim=0),
    "amax": lambda g: g - g.amax(dim=1, keepdim=True),
    "amin_dim0": lambda g: g - g.amin(dim=0),
    "all": lambda g: torch.where(torch.isfinite(g).all(dim=1, keepdim=True), g, 0.0),
    "any_dim0": lambda g: torch.where((g.abs() > 3).any(dim=0), g, -g),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name", NAN_INF_BODIES)
@pytest.mark.parametrize("shape", [(6, 7), (4500, 6)], ids=["small", "columns-split"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_nan_and_inf_propagate_per_unit(name, shape, dtype, backend):
    """(4500, 6): several programs share each column block's rows (and rows of 6 elements: one pass)."""
    fn = NAN_INF_BODIES[name]
    grad = _gradient(shape, torch.float32)
    grad[1, 2], grad[3, 0], grad[3, 4], grad[4, 5] = math.nan, math.inf, -math.inf, math.inf
    grad[-3, 1] = math.nan
    grad = grad.to(dtype)
    expected = fn(grad.clone()).to(dtype)
    assert_matches(_fire(_hook(fn, backend), grad), expected, backend, dtype)


def _exact_mean(x, dim, keepdim=False):
    return x.double().mean(dim, keepdim=keepdim).to(x.dtype)


def _exact_norm(x, dim, keepdim=False):
    return x.double().norm(dim=dim, keepdim=keepdim).to(x.dtype)


#: name -> (body of the gradient and the reduction it uses, torch's reduction, the same computed exactly (float64,
#: rounded once), the values); torch's float32 accumulator overflows on the first, underflows on the second
EXTREME_UNITS = {
    "column_mean_near_max": (lambda g, mean: g - mean(g, 0), torch.mean, _exact_mean,
                             lambda fi, shape: torch.where(torch.arange(math.prod(shape)).reshape(shape) % 7 == 0,
                                                           fi.max / 2, fi.max)),
    "row_norm_of_subnormals": (lambda g, norm: g / norm(g, dim=1, keepdim=True), torch.norm, _exact_norm,
                               lambda fi, shape: torch.full(shape, fi.smallest_normal / 8)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name, shape", [("column_mean_near_max", (3000, 3)), ("row_norm_of_subnormals", (2, 5000))],
                         ids=["columns", "long-rows"])
def test_units_accumulate_per_lane_across_chunks_in_float64(name, shape, dtype, monkeypatch):
    """Each lane of a reduction pass over units adds up its elements of every chunk of its program (one reduction per
    unit after the last chunk): still the float64 value rounded once where a float32 accumulator overflows or
    underflows. One program per block of units (TARGET_PROGRAMS 1), so that each lane holds several chunks."""
    from fusedhooks.compiler import dims

    monkeypatch.setattr(dims, "TARGET_PROGRAMS", 1)
    body, reduction, exact, values = EXTREME_UNITS[name]
    hook = _hook(lambda g: body(g, reduction), "triton")
    units = hook.plan(shape=shape, dtype=dtype).units
    (r,) = units.reductions
    assert units.reduce_splits(r) == (1, r.n_reduced) and r.n_reduced > 2 * units.reduce_tile(r).elements
    grad = values(torch.finfo(dtype), shape).to(dtype)
    expected = body(grad.clone(), exact)
    assert torch.isfinite(expected).all()
    assert_close_to(_fire(hook, grad), expected, REDUCTION_RTOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_statistics_of_the_result(backend):
    hook = _hook(lambda g: g / (g.norm(dim=1, keepdim=True) + 1e-3), backend, stats=("norm", "count", "max"),
                 input_stats=("sum",))
    grad = _gradient((6, 11), torch.float32)
    got = _fire(hook, grad)
    row = hook.stats.read()["param0"]
    assert row["count"] == 66 and row["max"] == got.max().item()
    assert row["norm"] == pytest.approx(got.double().norm().item(), rel=1e-6)
    assert row["input.sum"] == pytest.approx(grad.double().sum().item(), rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_shape_gets_its_own_plan_and_buckets_match(backend, monkeypatch):
    fn = BODIES["row_norm"][0]
    shapes = [(5, 13), (1, 9), (3, 4, 5, 6), (9, 1), (3, 5000)]
    grads = [_gradient(s, torch.float32, seed=i) for i, s in enumerate(shapes)]
    results = {}
    for bucket_mb in (None, 25):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        hook = _hook(fn, backend, stats=("norm", "max"))
        launches = count_launches(monkeypatch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hook.register(params, bucket_mb=bucket_mb)
            sum((p * g).sum() for p, g in zip(params, grads)).backward()
        for p, g in zip(params, grads):
            assert_matches(p.grad, fn(g.clone()), backend, torch.float32)
        results[bucket_mb] = [p.grad for p in params], hook.stats.read()
        assert len(hook.stats.read()) == 5
        if backend in ("triton", "auto") and bucket_mb:
            # (5, 13), (1, 9) and (9, 1) share the one-pass kernel over rows (their sizes are arguments): one launch;
            # dim 1 of (3, 4, 5, 6) (units strided) and rows of 5000 elements: a reduction pass and the elementwise
            # pass each, for their shape
            assert sorted(name for name, _ in launches) == ["fused_hook_multi"] * 2 + ["fused_hook_units_multi"] + [
                "reduce_units1_0_multi"] * 2
    for a, b in zip(results[None][0], results[25][0]):
        assert torch.equal(a, b)  # each unit is reduced alone: the same bits in a bucket
    for name, row in results[None][1].items():  # statistics: merged over other partitions of the elements
        assert row["max"] == results[25][1][name]["max"]
        assert row["norm"] == pytest.approx(results[25][1][name]["norm"], rel=1e-12)


@pytest.mark.parametrize("backend", ["eager", "reference", "triton"])
def test_empty_gradients(backend):
    hook = _hook(lambda g: g / (g.norm(dim=1, keepdim=True) + 1e-3), backend, stats=("count",))
    assert _fire(hook, torch.zeros(0, 5)).shape == (0, 5)
    assert hook.stats.read()["param0"]["count"] == 0
    with pytest.raises(CompileError, match=r"does not fit param0 \(shape \(5, 0\)\)"):  # torch: amax of no element
        _hook(lambda g: g / g.amax(dim=1, keepdim=True), backend).register(torch.nn.Parameter(torch.zeros(5, 0)))


def test_a_body_that_does_not_fit_a_parameter_is_refused_at_register_naming_it():
    hook = fh.grad_hook(lambda g: g / g.norm(dim=1, keepdim=True), backend="reference")
    model = torch.nn.Linear(4, 3)
    # then torch's own reason, in its words ("Dimension out of range" in torch 2.13, an IndexError in 2.11)
    with pytest.raises(CompileError, match=r"does not fit bias \(shape \(3,\)\).*`norm` failed on these arguments: \S"):
        hook.register(model)
    assert len(hook.registry) == 0  # all or nothing
    with pytest.raises(CompileError, match=r"does not fit w \(shape \(3, 4\)\)"):  # (3,) does not broadcast to (3, 4)
        fh.grad_hook(lambda g: g / g.norm(dim=1), backend="eager").register([("w", torch.nn.Parameter(
            torch.zeros(3, 4)))])

def test_auto_falls_back_to_eager_torch_with_one_warning_and_triton_is_refused(monkeypatch):
    """What the kernels do not compile: a reduction over dimensions of a value reduced over dimensions."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # auto picks triton here
    body = lambda g: g / (g.norm(dim=1, keepdim=True).amax(dim=1, keepdim=True) + 1)  # noqa: E731
    hook = fh.grad_hook(body)
    p = torch.nn.Parameter(torch.zeros(3, 4))
    p.grad = torch.ones(3, 4)
    message = ("`amax` over dimensions of a value that is not shaped like the gradient, which is not compiled into "
               "Triton kernels: it runs as eager torch ops")
    with pytest.warns(UserWarning, match=message) as record:
        hook.register(p)
        hook(p)
        hook(p)
    assert len(record) == 1
    assert_same_values(p.grad, body(body(torch.ones(3, 4))))
    with pytest.raises(CompileError, match="which the Triton backend does not compile; use backend='reference'"):
        fh.grad_hook(body, backend="triton").register(torch.nn.Parameter(torch.zeros(3, 4)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # what compiles is not warned about
        fh.grad_hook(lambda g: g / g.norm(dim=1, keepdim=True)).register(p)
        hook(p)


def test_refusals_at_decoration():
    with pytest.raises(CompileError, match=r"got the \(values, indices\) pair of max\(dim\)/min\(dim\); take its "
                                           r"\.values"):
        fh.grad_hook(lambda g: g / g.max(dim=1))
    with pytest.raises(CompileError, match="indices of max\\(dim\\)/min\\(dim\\) are not supported"):
        fh.grad_hook(lambda g: g * g.min(0).indices)
    with pytest.raises(CompileError, match="indices of max"):
        fh.grad_hook(lambda g: g * g.max(0)[1])
    with pytest.raises(CompileError, match=r"`max\(dim\)` takes one dimension, an int"):
        fh.grad_hook(lambda g: g / g.max(dim=(0, 1)).values)
    with pytest.raises(CompileError, match="dim= as an int or a non-empty tuple of ints"):
        fh.grad_hook(lambda g: g / g.sum(dim=1.5))


def test_a_result_that_does_not_broadcast_is_refused_at_register():
    with pytest.raises(CompileError, match=r"result has shape \(3,\), the gradient of w has shape \(3, 4\).*"
                                           "does not broadcast to it either"):
        fh.grad_hook(lambda g: g.norm(dim=1), backend="reference").register([("w", torch.nn.Parameter(
            torch.zeros(3, 4)))])


@pytest.mark.parametrize("body", [lambda g: g.mean(0), lambda g: g.mean(), lambda g: g.sum(1, keepdim=True)],
                         ids=["mean-rows", "mean", "row-sums"])
def test_a_result_of_another_shape_is_refused_not_broadcast(body, backend):
    """torch refuses a gradient hook that changes the size; writing the result into .grad would broadcast it into
    every row (or element), silently: refused at register, naming both shapes, on every backend."""
    layer = torch.nn.Linear(4, 3)
    hook = fh.grad_hook(body, backend=backend)
    with pytest.raises(CompileError, match=r"the gradient of weight has shape \(3, 4\): a gradient hook returns a "
                                           r"tensor of the gradient's shape.*would be broadcast into it, silently"):
        hook.register(layer)
    assert len(hook.registry) == 0
    ok = fh.grad_hook(lambda g: torch.zeros_like(g) + g.mean(), backend=backend)  # on purpose: the gradient's shape
    ok.register(layer)
    layer(torch.randn(2, 4)).sum().backward()
    torch.testing.assert_close(layer.bias.grad, torch.full((3,), 2.0))


def test_whole_tensor_var_with_a_positional_unbiased_is_still_var():
    hook = fh.grad_hook(lambda g: g * g.var(False), backend="reference")
    grad = _gradient((5, 4), torch.float32)
    assert_same_values(_fire(hook, grad), grad * grad.var(False))


# --- AGC ------------------------------------------------------------------------------------------------------------

def _conv_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 5))


@pytest.mark.parametrize("bucket_mb", [None, 25], ids=["per-firing", "buckets"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_agc_equals_timm_over_20_steps(backend, bucket_mb):
    """Parameters within 1e-6 after 20 steps on every backend (the kernels' norms are fp64, timm's fp32)."""
    model, reference = _conv_net(), _conv_net()
    hook = fh.agc(clip_factor=0.01, eps=1e-3, backend=None if backend == "auto" else backend, stats=("norm",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hook.register(model, bucket_mb=bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    clipped = 0
    for _ in range(20):
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 5, generator=g)
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
        before = [p.grad.clone() for p in reference.parameters()]
        timm_agc_(reference.parameters())
        clipped += sum(not torch.equal(b, p.grad) for b, p in zip(before, reference.parameters()))
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
        opt.step()
        ref_opt.step()
    assert clipped > 20  # AGC really clips in this run
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert sorted(hook.stats.read()) == sorted(n for n, _ in model.named_parameters())


def test_agc_options_are_checked():
    for bad in (0, -1.0, math.inf, "0.1", True):
        with pytest.raises(ValueError, match="clip_factor= takes a finite number > 0"):
            fh.agc(clip_factor=bad)
    with pytest.raises(ValueError, match="eps= takes"):
        fh.agc(eps=0)


def test_plan_takes_the_shape():
    hook = fh.grad_hook(lambda g: g / g.norm(dim=1, keepdim=True), backend="reference")
    plan = hook.plan(shape=(4096, 1024))
    assert plan.numel == 4096 * 1024 and plan.backend == "reference"
    assert "dim=1" in str(plan)
    with pytest.raises(ValueError, match="pass shape="):
        hook.plan(numel=1000)
    with pytest.raises(ValueError, match="pass shape="):
        hook.source()


def test_plan_keeps_one_pass_for_rows_and_two_for_columns():
    rows = fh.grad_hook(lambda g: g / g.norm(dim=1, keepdim=True), backend="triton")
    columns = fh.grad_hook(lambda g: g / g.norm(dim=0, keepdim=True), backend="triton")
    plan = rows.plan(shape=(4096, 1024), device="cpu")
    assert (plan.backend, plan.passes, plan.launches, plan.bytes_per_element) == ("triton", 1, 1, 8)
    assert "4,096 units of 1,024 elements" in str(plan) and "in one pass" in str(plan)
    plan = columns.plan(shape=(4096, 1024), device="cpu")
    assert (plan.passes, plan.launches, plan.bytes_per_element) == (2, 2, 12)
    assert "1,024 units of 4,096 elements" in str(plan) and "read by index" in str(plan)
    # rows longer than a program holds: a reduction pass
    assert rows.plan(shape=(16, 8192), device="cpu").passes == 2
    # a whole-tensor reduction beside them: its pass, the rows' pass, the elementwise pass (two reads)
    mixed = fh.grad_hook(lambda g: g / g.norm(dim=1, keepdim=True) / g.norm(), backend="triton")
    assert (lambda p: (p.passes, p.launches))(mixed.plan(shape=(64, 64), device="cpu")) == (2, 3)
    source = rows.source(shape=(4096, 1024))
    assert "def fused_hook_units(" in source and "def reduce_units" not in source
    assert "dim=1" not in source and "(4096" not in source  # the kernel takes the sizes: every shape shares it
    assert rows.source(shape=(7, 3)) == source
    assert "def reduce_units1_0(" in columns.source(shape=(4096, 1024))


AMP_BODIES = {"rows": lambda g: g / (g.norm(dim=-1, keepdim=True) + 1),       # one pass (biases: one unit)
              "columns": lambda g: g - 0.5 * g.mean(dim=0)}                     # a reduction pass, then elementwise


@pytest.mark.parametrize("name", AMP_BODIES)
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_amp_unscales_before_the_body_and_finds_inf(name, backend):
    """scaler=: every pass sees grad / scale; an Inf step is skipped and the scale backs off, as with unscale_()."""
    fn = AMP_BODIES[name]
    results = []
    for use_hook in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
        if use_hook:
            fh.grad_hook(fn, scaler=scaler, optimizer=opt, backend=backend).register(model)
        gen = torch.Generator().manual_seed(1)
        scales, skipped = [], []
        for step in range(8):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(torch.randn(32, 8, generator=gen)),
                                                torch.randn(32, 4, generator=gen))
            scaler.scale(loss * (math.inf if step == 4 else 1.0)).backward()
            if not use_hook:
                scaler.unscale_(opt)
                for p in model.parameters():
                    p.grad.copy_(fn(p.grad))
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            skipped.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
            scales.append(scaler.get_scale())
        results.append((scales, skipped, [p.detach().clone() for p in model.parameters()]))
    (ref_scales, ref_skipped, ref_params), (scales, skipped, params) = results
    assert skipped == ref_skipped and skipped[4] and not skipped[3]
    assert scales == ref_scales
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
