"""The public API contract of DESIGN.md, on both backends."""

import math

import pytest
import torch

import fusedhooks as fh

from helpers import assert_same_values, check_stats, leaf

COUNTS = ("count", "nan", "inf", "zeros")


def backward_with(t, upstream):
    """Backward through `t` so that its accumulated gradient is `upstream`."""
    (t * upstream).sum().backward()


# --- the seed example and the decorator forms ---------------------------------------------------------

def test_seed_example_clamps_grad_in_place(backend):
    @fh.grad_hook(backend=backend)
    def clip(grad):
        grad.clamp_(-2.0, 2.0)

    t = torch.tensor([-5.0, 0.0, 5.0], requires_grad=True)
    t.register_post_accumulate_grad_hook(clip)
    (t ** 2).sum().backward()
    assert torch.equal(t.grad, torch.tensor([-2.0, 0.0, 2.0]))
    assert torch.equal(t.detach(), torch.tensor([-5.0, 0.0, 5.0]))


def test_bare_decorator_gives_a_grad_hook():
    @fh.grad_hook
    def double(grad):
        return grad * 2

    assert isinstance(double, fh.GradHook)
    assert double.__name__ == "double"
    t = leaf(5)
    double.register(t)
    g = torch.randn(5)
    backward_with(t, g)
    assert torch.equal(t.grad, g * 2)


def test_decorator_with_options(backend):
    @fh.grad_hook(stats=("norm", "max"), input_stats="nan", backend=backend)
    def half(grad):
        return grad * 0.5

    assert isinstance(half, fh.GradHook)
    t = leaf(7)
    half.register(t)
    g = torch.randn(7)
    backward_with(t, g)
    assert torch.equal(t.grad, g * 0.5)
    row = half.stats.read()["param0"]
    assert set(row) == {"norm", "max", "input.nan"}
    check_stats(row, g * 0.5, ("norm", "max"))
    assert row["input.nan"] == 0


def test_stats_only_hook_leaves_grad_bitwise_unchanged(backend):
    monitor = fh.grad_hook(stats="all", backend=backend)
    t = leaf(8)
    monitor.register(t)
    g = torch.tensor([1.5, -0.0, 0.0, math.nan, math.inf, -math.inf, 1e-45, -3.25])
    backward_with(t, g)
    assert torch.equal(t.grad.view(torch.int32), g.view(torch.int32))
    row = monitor.stats.read()["param0"]
    assert set(row) == set(fh.STAT_NAMES)
    assert (row["count"], row["nan"], row["inf"], row["zeros"]) == (8, 1, 2, 2)


def test_stats_only_hook_called_with_a_tensor_fires_on_its_grad(backend):
    monitor = fh.grad_hook(stats=("sum", "count"), backend=backend)
    t = leaf(4)
    t.grad = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert monitor(t) is None
    assert monitor.stats.read() == {"param0": {"count": 4, "sum": 10.0}}
    assert torch.equal(t.grad, torch.tensor([1.0, 2.0, 3.0, 4.0]))


def test_stats_only_hook_as_decorator_returns_a_new_hook(backend):
    monitor = fh.grad_hook(stats="all", input_stats=("norm",), backend=backend)

    @monitor
    def triple(grad):
        return grad * 3

    assert isinstance(triple, fh.GradHook) and triple is not monitor
    assert triple.__name__ == "triple"
    assert triple.stats.slot_names == monitor.stats.slot_names
    t = leaf(6)
    triple.register(t)
    g = torch.randn(6)
    backward_with(t, g)
    assert torch.equal(t.grad, g * 3)
    row = triple.stats.read()["param0"]
    check_stats(row, g * 3, fh.STAT_NAMES)
    check_stats(row, g, ("norm",), prefix="input.")
    assert monitor.stats.read() == {}  # the decorator hook itself registered nothing


def test_second_argument_receives_the_parameter(backend):
    @fh.grad_hook(backend=backend)
    def add_param(grad, param):
        return grad + param

    t = leaf(9)
    add_param.register(t)
    g = torch.randn(9)
    backward_with(t, g)
    assert torch.equal(t.grad, g + t.detach())


def test_a_call_by_hand_with_grad_mode_on_reads_the_parameter_as_a_backward_does(backend):
    """hook(p) outside a backward, grad mode on, p requiring grad: the body's ops on the parameter record nothing
    (as in a backward without create_graph), so ops that write into an output still work."""
    hook = fh.grad_hook(lambda grad, param: torch.maximum(grad, param).clamp(min=param * 0.5), backend=backend)
    t = leaf(9)
    hook.register(t)
    t.grad = torch.randn(9)
    expected = torch.maximum(t.grad, t.detach()).clamp(min=t.detach() * 0.5)
    assert torch.is_grad_enabled()
    hook(t)
    assert torch.equal(t.grad, expected) and not t.grad.requires_grad


def test_hook_with_unused_param_argument(backend):
    @fh.grad_hook(backend=backend)
    def neg(grad, param):
        return -grad

    t = leaf(3)
    neg.register(t)
    g = torch.randn(3)
    backward_with(t, g)
    assert torch.equal(t.grad, -g)


def test_inplace_body_matches_returned_tensor(backend):
    @fh.grad_hook(backend=backend)
    def in_place(grad):
        grad.mul_(2.0)
        grad.add_(1.0)

    @fh.grad_hook(backend=backend)
    def returned(grad):
        return grad * 2.0 + 1.0

    a, b = leaf(10), leaf(10)
    in_place.register(a)
    returned.register(b)
    g = torch.randn(10)
    backward_with(a, g)
    backward_with(b, g)
    assert torch.equal(a.grad, g * 2.0 + 1.0)
    assert torch.equal(b.grad, a.grad)


def test_inplace_ops_take_effect_in_program_order(backend):
    @fh.grad_hook(backend=backend)
    def clip_then_scale(grad):
        grad.clamp_(-1.0, 1.0)
        return grad * 3.0

    t = leaf(5)
    clip_then_scale.register(t)
    g = torch.tensor([-4.0, -0.5, 0.0, 0.5, 4.0])
    backward_with(t, g)
    assert torch.equal(t.grad, torch.tensor([-3.0, -1.5, 0.0, 1.5, 3.0]))


def test_returning_a_number_fills_the_grad(backend):
    hook = fh.grad_hook(lambda grad: 0.25, backend=backend)
    t = leaf(4)
    hook.register(t)
    backward_with(t, torch.randn(4))
    assert torch.equal(t.grad, torch.full((4,), 0.25))


# --- registration ------------------------------------------------------------------------------------

def test_register_module_keys_are_parameter_names_and_skip_frozen(backend):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model[0].bias.requires_grad_(False)
    hook = fh.grad_hook(lambda grad: grad * 2, stats=("count",), backend=backend)
    handle = hook.register(model)
    assert len(handle) == 3
    model(torch.randn(5, 3)).sum().backward()
    assert set(hook.stats.read()) == {"0.weight", "2.weight", "2.bias"}
    counts = {n: r["count"] for n, r in hook.stats.read().items()}
    assert counts == {"0.weight": 12, "2.weight": 8, "2.bias": 2}
    assert model[0].bias.grad is None


def test_register_module_grads_are_transformed(backend):
    model = torch.nn.Linear(3, 2)
    eager = torch.nn.Linear(3, 2)
    eager.load_state_dict(model.state_dict())
    hook = fh.grad_hook(lambda grad: grad.clamp(-0.1, 0.1), backend=backend)
    hook.register(model)
    x = torch.randn(6, 3)
    model(x).pow(2).sum().backward()
    eager(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad.clamp(-0.1, 0.1))


def test_register_module_with_name_prefixes_keys(backend):
    hook = fh.grad_hook(stats=("count",), backend=backend)
    model = torch.nn.Linear(2, 3)
    hook.register(model, name="head")
    model(torch.randn(1, 2)).sum().backward()
    assert hook.stats.read() == {"head.weight": {"count": 6}, "head.bias": {"count": 3}}


def test_register_tensor_keys_default_to_param_i_in_order(backend):
    hook = fh.grad_hook(stats=("sum",), backend=backend)
    a, b = leaf(2), leaf(3)
    hook.register(a)
    hook.register(b)
    backward_with(a, torch.ones(2))
    backward_with(b, torch.ones(3))
    assert hook.stats.read() == {"param0": {"sum": 2.0}, "param1": {"sum": 3.0}}


def test_register_tensor_with_name(backend):
    hook = fh.grad_hook(stats=("sum",), backend=backend)
    t = leaf(3)
    hook.register(t, name="encoder.scale")
    backward_with(t, torch.ones(3))
    assert hook.stats.read() == {"encoder.scale": {"sum": 3.0}}


def test_register_iterable_of_name_tensor_pairs(backend):
    hook = fh.grad_hook(stats=("count",), backend=backend)
    a, b = leaf(2), leaf(5)
    handle = hook.register([("a", a), ("b", b)])
    assert len(handle) == 2 and handle.tensors[0] is a and handle.tensors[1] is b
    backward_with(a, torch.ones(2))
    backward_with(b, torch.ones(5))
    assert hook.stats.read() == {"a": {"count": 2}, "b": {"count": 5}}


def test_register_iterable_of_tensors(backend):
    hook = fh.grad_hook(stats=("count",), backend=backend)
    a, b = leaf(2), leaf(5)
    hook.register(iter([a, b]))
    (a.sum() + b.sum()).backward()
    assert hook.stats.read() == {"param0": {"count": 2}, "param1": {"count": 5}}


def test_handle_remove_stops_the_hook(backend):
    hook = fh.grad_hook(lambda grad: grad * 0.0, backend=backend)
    t = leaf(4)
    handle = hook.register(t)
    backward_with(t, torch.ones(4))
    assert torch.equal(t.grad, torch.zeros(4))
    handle.remove()
    t.grad = None
    backward_with(t, torch.ones(4))
    assert torch.equal(t.grad, torch.ones(4))


def test_removed_tensor_can_be_registered_again(backend):
    hook = fh.grad_hook(lambda grad: grad * 0.0, stats=("count",), backend=backend)
    t = leaf(4)
    hook.register(t, name="w").remove()
    hook.register(t, name="w")
    backward_with(t, torch.ones(4))
    assert torch.equal(t.grad, torch.zeros(4))
    assert hook.stats.read() == {"w": {"count": 4}}


def test_with_block_removes_the_hook_at_exit(backend):
    hook = fh.grad_hook(lambda grad: grad * 0.0, backend=backend)
    t = leaf(4)
    with hook.register(t) as handle:
        assert isinstance(handle, fh.RegistrationHandle)
        backward_with(t, torch.ones(4))
        assert torch.equal(t.grad, torch.zeros(4))
    t.grad = None
    backward_with(t, torch.ones(4))
    assert torch.equal(t.grad, torch.ones(4))


# --- statistics --------------------------------------------------------------------------------------

def test_stats_read_types_and_input_keys(backend):
    hook = fh.grad_hook(lambda grad: grad * 2.0, stats="all", input_stats=("norm", "nan"), backend=backend)
    t = leaf(2, 3)
    hook.register(t, name="w")
    g = torch.randn(2, 3)
    backward_with(t, g)
    row = hook.stats.read()["w"]
    assert list(row) == list(fh.STAT_NAMES) + ["input.norm", "input.nan"]
    for name, value in row.items():
        expected_type = int if name.removeprefix("input.") in COUNTS else float
        assert type(value) is expected_type, (name, value)
    check_stats(row, g * 2.0, fh.STAT_NAMES)
    check_stats(row, g, ("norm", "nan"), prefix="input.")


def test_stats_tensor_is_float64_params_by_slots(backend):
    hook = fh.grad_hook(stats=("norm", "max", "count"), input_stats="all", backend=backend)
    a, b, c = leaf(3), leaf(4), leaf(5)
    hook.register([a, b, c])
    (a.sum() + b.sum() + c.sum()).backward()
    buf = hook.stats.tensor
    assert buf.dtype == torch.float64
    assert buf.shape == (3, 3 + len(fh.STAT_NAMES))
    assert buf.device == a.device
    assert buf[1, hook.stats.slot_names.index("count")].item() == 4.0


def test_stats_reset_forgets_values(backend):
    hook = fh.grad_hook(stats=("sum", "count"), backend=backend)
    t = leaf(3)
    hook.register(t)
    backward_with(t, torch.ones(3))
    assert hook.stats.read() == {"param0": {"count": 3, "sum": 3.0}}
    hook.stats.reset()
    assert hook.stats.read() == {}
    assert torch.isnan(hook.stats.tensor).all()
    t.grad = None
    backward_with(t, torch.full((3,), 2.0))
    assert hook.stats.read() == {"param0": {"count": 3, "sum": 6.0}}


def test_each_firing_overwrites_the_row(backend):
    hook = fh.grad_hook(stats=("max",), backend=backend)
    t = leaf(3)
    hook.register(t)
    backward_with(t, torch.full((3,), 5.0))
    t.grad = None
    backward_with(t, torch.full((3,), 1.0))
    assert hook.stats.read() == {"param0": {"max": 1.0}}


# --- firing ------------------------------------------------------------------------------------------

def test_hook_fires_on_every_backward_with_accumulated_grad(backend):
    hook = fh.grad_hook(lambda grad: grad * 2.0, input_stats=("sum",), backend=backend)
    t = leaf(4)
    hook.register(t)
    g = torch.tensor([1.0, -2.0, 3.0, 0.5])
    backward_with(t, g)
    assert torch.equal(t.grad, g * 2)
    backward_with(t, g)  # accumulates into .grad: 2g + g, then the hook doubles it
    assert torch.equal(t.grad, g * 6)
    assert hook.stats.read()["param0"]["input.sum"] == pytest.approx(3 * g.sum().item())


def test_grad_storage_is_never_replaced(backend):
    hook = fh.grad_hook(lambda grad: grad.clamp(-1.0, 1.0) * 0.5, stats="all", backend=backend)
    t = leaf(6, 5, dtype=torch.bfloat16)
    hook.register(t)
    g = torch.randn(6, 5, dtype=torch.bfloat16) * 3
    backward_with(t, g)
    ptr, dtype, strides = t.grad.data_ptr(), t.grad.dtype, t.grad.stride()
    expected = g.clamp(-1.0, 1.0) * 0.5
    assert_same_values(t.grad, expected)
    backward_with(t, g)
    assert (t.grad.data_ptr(), t.grad.dtype, t.grad.stride()) == (ptr, dtype, strides)
    assert_same_values(t.grad, ((expected + g).float().clamp(-1.0, 1.0) * 0.5).bfloat16())


def test_grad_storage_kept_for_a_preset_strided_grad(backend):
    hook = fh.grad_hook(lambda grad: grad * 4.0, backend=backend)
    t = leaf(4, 6)
    t.grad = torch.randn(6, 4).t()  # dense, transposed
    before = t.grad.clone()
    ptr, strides = t.grad.data_ptr(), t.grad.stride()
    hook(t)
    assert (t.grad.data_ptr(), t.grad.stride(), t.grad.dtype) == (ptr, strides, torch.float32)
    assert torch.equal(t.grad, before * 4.0)


def test_closed_over_scalar_is_read_at_every_firing_without_recompiling(backend):
    scale = torch.tensor(2.0)

    @fh.grad_hook(backend=backend)
    def scaled(grad):
        return grad * scale

    t = leaf(5)
    scaled.register(t)
    g = torch.randn(5)
    backward_with(t, g)
    assert torch.equal(t.grad, g * 2.0)
    scale.fill_(3.0)
    t.grad = None
    backward_with(t, g)
    assert torch.equal(t.grad, g * 3.0)
    assert len(scaled.compilation.keys()) == 1


@pytest.mark.parametrize("bucket_mb", [None, 25])
def test_closed_over_scalar_given_new_storage_of_its_kind_is_read(backend, bucket_mb):
    scale = torch.tensor(2.0)
    hook = fh.grad_hook(lambda grad: grad * scale, backend=backend)
    t = leaf(5)
    hook.register(t, bucket_mb=bucket_mb)
    g = torch.randn(5)
    scale.data = torch.tensor(3.0)  # other storage, same dtype and shape: read there
    backward_with(t, g)
    assert torch.equal(t.grad, g * 3.0)


@pytest.mark.parametrize("bucket_mb", [None, 25])
@pytest.mark.parametrize("change", ["dtype", "shape", "resize_"])
def test_closed_over_scalar_changed_out_of_its_traced_kind_is_refused(backend, bucket_mb, change):
    """The plan is lowered for the traced dtype and shape: a kernel would read a float64 as float32 bits, or
    element 0 of what eager torch broadcasts (or refuses to)."""
    scale = torch.tensor(2.0)
    hook = fh.grad_hook(lambda grad: grad * scale, stats=("sum",), backend=backend)
    t = leaf(5)
    hook.register(t, bucket_mb=bucket_mb)
    backward_with(t, torch.ones(5))
    if change == "dtype":
        scale.data = torch.tensor(3.0, dtype=torch.float64)
    elif change == "shape":
        scale.data = torch.tensor([3.0])
    else:
        scale.resize_(5)
    t.grad = None
    with pytest.raises(RuntimeError, match="closed-over tensor 0 was traced as a torch.float32 tensor of shape"):
        backward_with(t, torch.ones(5))


def test_hook_registered_through_torch_directly_gets_param_key(backend):
    hook = fh.grad_hook(lambda grad: grad + 1.0, stats=("count",), backend=backend)
    t = leaf(3)
    t.register_post_accumulate_grad_hook(hook)
    backward_with(t, torch.zeros(3))
    assert torch.equal(t.grad, torch.ones(3))
    assert hook.stats.read() == {"param0": {"count": 3}}


def test_empty_parameter_fires_and_records_count_zero(backend):
    hook = fh.grad_hook(lambda grad: grad * 2.0, stats="all", backend=backend)
    t = leaf(0)
    hook.register(t)
    backward_with(t, torch.ones(0))
    assert t.grad.shape == (0,)
    row = hook.stats.read()["param0"]
    assert row["count"] == 0 and type(row["count"]) is int
    assert row["nan"] == 0 and row["inf"] == 0 and row["zeros"] == 0
    assert row["sum"] == 0.0 and math.isnan(row["mean"])


def _eager_body(grad, param):
    return grad.clamp(-1.0, 1.0) * 0.5 + param * 0.25


def _check_against_eager(hook, t, grad_value):
    expected = _eager_body(grad_value, t.detach())
    hook(t)
    assert_same_values(t.grad, expected)
    check_stats(hook.stats.read()["param0"], expected, fh.STAT_NAMES)
    check_stats(hook.stats.read()["param0"], grad_value, ("norm", "sum", "max"), prefix="input.")


def test_non_contiguous_dense_grad_matches_eager(backend):
    hook = fh.grad_hook(_eager_body, stats="all", input_stats=("norm", "sum", "max"), backend=backend)
    t = torch.randn(4, 6).t().contiguous().t().requires_grad_()
    assert t.stride() == (1, 4) and not t.is_contiguous()
    hook.register(t)
    g = torch.randn(4, 6) * 2
    expected = _eager_body(g, t.detach())
    backward_with(t, g)
    assert t.grad.stride() == (1, 4)
    assert_same_values(t.grad, expected)
    check_stats(hook.stats.read()["param0"], expected, fh.STAT_NAMES)
    check_stats(hook.stats.read()["param0"], g, ("norm", "sum", "max"), prefix="input.")


def test_non_dense_grad_matches_eager(backend):
    hook = fh.grad_hook(_eager_body, stats="all", input_stats=("norm", "sum", "max"), backend=backend)
    t = leaf(4, 6)
    hook.register(t)
    t.grad = (torch.randn(4, 12) * 2)[:, ::2]  # not dense: every other column of a larger buffer
    assert t.grad.stride() == (12, 2)
    ptr = t.grad.data_ptr()
    _check_against_eager(hook, t, t.grad.clone())
    assert t.grad.data_ptr() == ptr and t.grad.stride() == (12, 2)


def test_non_dense_param_with_dense_grad_matches_eager(backend):
    hook = fh.grad_hook(_eager_body, stats="all", input_stats=("norm", "sum", "max"), backend=backend)
    t = torch.randn(4, 12)[:, ::2].requires_grad_()
    assert t.is_leaf and t.stride() == (12, 2)
    hook.register(t)
    t.grad = torch.randn(4, 6)
    _check_against_eager(hook, t, t.grad.clone())


# --- plans -------------------------------------------------------------------------------------------

def test_plan_clamp_scale_all_stats_is_one_pass(backend):
    @fh.grad_hook(stats="all", backend=backend)
    def clip_and_scale(grad):
        return grad.clamp(-1.0, 1.0) * 0.5

    plan = clip_and_scale.plan(numel=1 << 20, dtype=torch.bfloat16)
    assert isinstance(plan, fh.Plan)
    assert (plan.passes, plan.launches, plan.writes) == (1, 1, 1)
    assert plan.dtype == torch.bfloat16 and plan.numel == 1 << 20
    text = str(plan)
    assert "passes=1" in text and "bfloat16" in text and "clamp" in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_plan_of_the_eager_backend_describes_the_torch_ops_it_runs(dtype):
    clip_and_scale = fh.grad_hook(lambda grad: grad.clamp(-1.0, 1.0) * 0.5, stats=("norm", "mean"), backend="eager")
    plan = clip_and_scale.plan(numel=(1 << 20) + 3, dtype=dtype, device="cpu")
    assert (plan.backend, plan.passes, plan.launches, plan.writes) == ("eager", 1, 1, 1)  # the kernels' counts
    text = str(plan)
    assert "no Triton kernels: eager torch ops" in text and "statistics by torch reductions" in text
    assert "v0.clamp_(-1.0, 1.0)" in text and ".mul_(0.5)" in text  # in place, the bounds named by value
    for kernel_words in ("BLOCK", "programs", "no host sync", "launch:"):
        assert kernel_words not in text, text
    normalised = fh.grad_hook(lambda grad: grad / grad.norm(), backend="eager").plan(numel=1 << 20, device="cpu")
    text = str(normalised)
    assert "reduction pass" not in text and "on the device" not in text and "torch.norm(v0" in text, text


def test_plan_of_the_reference_backend_says_it_launches_no_kernel():
    text = str(fh.grad_hook(lambda grad: grad * 2.0, stats=("norm",), backend="reference").plan(numel=4099))
    assert "no Triton kernels: eager torch ops, out of place" in text and "float64 copy" in text
    assert "BLOCK" not in text and "programs" not in text


def test_plan_names_closed_over_tensors(backend):
    def make_hook():
        lo, hi = torch.tensor(-1.0), torch.tensor(1.0)
        return fh.grad_hook(lambda grad: grad.clamp(lo, hi) * SCALE, backend=backend)

    text = str(make_hook().plan(numel=1000, device="cpu"))
    assert "scalar[" not in text, text
    assert "v1 = lo : float32 (closed-over tensor 0" in text and "v2 = hi : float32 (closed-over tensor 1" in text
    assert "clamp(input=grad, min=v1, max=v2)" in text and "= SCALE : float32 (closed-over tensor 2" in text


SCALE = torch.tensor(0.5)  # a global a hook reads


def test_explain_of_the_eager_backend_says_no_kernel_is_launched():
    param = torch.nn.Parameter(torch.zeros(7))
    hook = fh.grad_hook(lambda grad: grad * 2.0, backend="eager")
    hook.register(param)
    assert "tensors" in str(hook.explain()) and "backend eager: eager torch ops, no kernel is launched" in \
        str(hook.explain())
    triton = fh.grad_hook(lambda grad: grad * 2.0, backend="triton")
    triton.register(param)
    assert "tensors" in str(triton.explain()) and "no kernel" not in str(triton.explain())


def test_plan_of_stats_only_hook_writes_nothing(backend):
    plan = fh.grad_hook(stats="all", backend=backend).plan(numel=4096)
    assert (plan.passes, plan.writes) == (1, 0)


def test_plan_of_empty_gradient_launches_nothing(backend):
    hook = fh.grad_hook(lambda grad: grad * 2.0, stats="all", backend=backend)
    plan = hook.plan(numel=0)
    assert (plan.launches, plan.passes, plan.writes) == (0, 0, 0)
    assert "passes=0" in str(plan)



def test_firing_bumps_the_version_counter_like_an_inplace_op(backend):
    """The kernels write .grad through raw pointers; autograd still learns of the in-place write."""
    p = torch.zeros(300, requires_grad=True)
    p.grad = torch.randn(300)
    before = p.grad._version
    fh.grad_hook(lambda grad: grad * 0.5, backend=backend)(p)
    assert p.grad._version > before
    stats_only = fh.grad_hook(stats=("norm",), backend=backend)
    before = p.grad._version
    stats_only(p)
    assert p.grad._version == before            # statistics only: nothing written


def test_bucketed_firing_bumps_the_version_counter():
    model = torch.nn.Linear(4, 3)
    fh.grad_hook(lambda grad: grad * 0.5, backend="triton").register(model, bucket_mb=1)
    model(torch.randn(2, 4)).sum().backward()
    assert all(p.grad._version > 0 for p in model.parameters())
