"""Every bad input is refused early (at decoration or at registration) with a message naming the problem."""

import pytest
import torch

import fusedhooks as fh

from helpers import leaf


def test_compile_error_is_a_type_error():
    assert issubclass(fh.CompileError, TypeError)


# --- decoration time: what cannot be traced ---------------------------------------------------------

def test_if_on_traced_value_rejected():
    def body(grad):
        if grad > 0:
            return grad
        return grad * 2

    with pytest.raises(fh.CompileError, match=r"control flow.*torch\.where"):
        fh.grad_hook(body)


def test_while_on_traced_value_rejected():
    def body(grad):
        while grad > 0:
            grad = grad - 1
        return grad

    with pytest.raises(fh.CompileError, match="control flow"):
        fh.grad_hook(body)


def test_iteration_over_traced_value_rejected():
    def body(grad):
        for _ in grad:
            pass
        return grad

    with pytest.raises(fh.CompileError, match="control flow"):
        fh.grad_hook(body)


def test_item_rejected():
    def body(grad):
        return grad * grad.item()

    with pytest.raises(fh.CompileError, match=r"`\.item\(\)`.*host sync"):
        fh.grad_hook(body)


def test_tolist_rejected():
    def body(grad):
        grad.tolist()

    with pytest.raises(fh.CompileError, match=r"`\.tolist\(\)`.*host sync"):
        fh.grad_hook(body)


def test_print_of_traced_value_rejected():
    def body(grad):
        print(grad)

    with pytest.raises(fh.CompileError, match="`print`.*host sync") as info:
        fh.grad_hook(body)
    assert str(info.value).count("cannot compile body") == 1, str(info.value)


def test_print_of_plain_values_still_works(capsys):
    def body(grad):
        print("tracing")
        return grad * 2

    fh.grad_hook(body)
    assert "tracing" in capsys.readouterr().out


@pytest.mark.parametrize("builtin", [float, int])
def test_python_number_conversion_rejected(builtin):
    def body(grad):
        return grad * builtin(grad)

    # The message must name the builtin the user called (`float(...)`), not the supported `.float()` cast.
    name = builtin.__name__
    with pytest.raises(fh.CompileError, match="host sync") as info:
        fh.grad_hook(body)
    message = str(info.value)
    assert f"`.{name}()`" not in message, message
    assert f"`{name}()`" in message or f"{name}(grad)" in message, message


@pytest.mark.parametrize("body, op", [
    (lambda grad: torch.nn.functional.relu(grad), "relu"),
    (lambda grad: torch.relu(grad), "relu"),
    (lambda grad: grad.matmul(grad), "matmul"),
    (lambda grad: grad @ grad, "matmul"),
    (lambda grad: grad.cumsum(0), "cumsum"),
    (lambda grad: torch.sin(grad), "sin"),
], ids=["F.relu", "torch.relu", "Tensor.matmul", "@", "cumsum", "sin"])
def test_unsupported_op_named_with_pointer_to_supported_ops(body, op):
    with pytest.raises(fh.CompileError, match=rf"{op}.*not supported.*supported_ops\(\)"):
        fh.grad_hook(body)


def test_indexing_rejected():
    with pytest.raises(fh.CompileError, match="indexing.*elementwise"):
        fh.grad_hook(lambda grad: grad[0])


def test_shape_access_rejected():
    with pytest.raises(fh.CompileError, match=r"`\.shape`"):
        fh.grad_hook(lambda grad: grad * grad.shape[0])


def test_rounding_division_rejected():
    with pytest.raises(fh.CompileError, match="rounding_mode"):
        fh.grad_hook(lambda grad: torch.div(grad, 2, rounding_mode="floor"))


def test_tensor_exponent_rejected():
    with pytest.raises(fh.CompileError, match="pow"):
        fh.grad_hook(lambda grad: grad ** grad)


def test_complex_literal_rejected():
    with pytest.raises(fh.CompileError, match="complex") as info:
        fh.grad_hook(lambda grad: grad * 1j)
    assert "cannot compile <lambda>" in str(info.value), str(info.value)


# --- decoration time: signature, options, closures, results -----------------------------------------

@pytest.mark.parametrize("stats", ["bogus", ("norm", "l1")])
def test_unknown_stat_name_rejected(stats):
    bad = stats if isinstance(stats, str) else stats[1]
    with pytest.raises(ValueError, match=rf"unknown statistic '{bad}' in stats=.*known: count"):
        fh.grad_hook(stats=stats)


def test_unknown_input_stat_name_rejected():
    with pytest.raises(ValueError, match=r"unknown statistic 'bad' in input_stats="):
        fh.grad_hook(lambda grad: grad, input_stats=("norm", "bad"))


def test_stats_of_wrong_type_rejected_with_message_naming_stats():
    with pytest.raises((TypeError, ValueError), match="stats"):
        fh.grad_hook(stats=3)


@pytest.mark.parametrize("backend", ["cuda", "torch", ""])
def test_bad_backend_rejected(backend):
    expected = rf"backend must be one of 'auto', 'triton', 'eager', 'reference', not '{backend}'"
    with pytest.raises(ValueError, match=expected):
        fh.grad_hook(lambda grad: grad, backend=backend)


def test_eager_backend_refuses_a_gpu_gradient_with_what_to_do():
    with pytest.raises(RuntimeError, match="the eager backend runs on CPU tensors .* use backend='auto' or 'triton'"):
        fh.runtime.launcher.choose_backend(torch.device("cuda"), "eager")  # decided before any CUDA call


def test_non_callable_rejected():
    with pytest.raises(TypeError, match="grad_hook takes a function, not int"):
        fh.grad_hook(42)


def test_function_without_arguments_rejected():
    def body():
        return None

    expected = r"`def body\(grad\)` or `def body\(grad, param\)`; got body\(\)"
    with pytest.raises(fh.CompileError, match=expected):
        fh.grad_hook(body)


def test_function_with_three_arguments_rejected():
    def body(grad, param, extra):
        return grad

    with pytest.raises(fh.CompileError, match=r"got body\(grad, param, extra\)"):
        fh.grad_hook(body)


def test_function_with_keyword_only_argument_rejected():
    def body(grad, *, scale):
        return grad * scale

    with pytest.raises(fh.CompileError, match=r"optionally, the parameter"):
        fh.grad_hook(body)


def test_inplace_write_to_param_rejected():
    def body(grad, param):
        param.add_(1)

    with pytest.raises(fh.CompileError, match="`add_` writes to the parameter.*read-only"):
        fh.grad_hook(body)


def test_inplace_write_to_closed_over_tensor_rejected():
    scale = torch.tensor(2.0)

    def body(grad):
        scale.mul_(2)
        return grad * scale

    with pytest.raises(fh.CompileError, match="closed-over"):
        fh.grad_hook(body)
    assert scale.item() == 2.0  # decorating must not run the body's side effects on real tensors


def test_closing_over_multi_element_tensor_rejected():
    weights = torch.ones(3)

    def body(grad):
        return grad * weights

    with pytest.raises(fh.CompileError, match=r"closes over a tensor of shape \(3,\).*0-dim"):
        fh.grad_hook(body)


def test_closing_over_complex_tensor_rejected():
    scale = torch.tensor(1 + 1j)

    def body(grad):
        return grad * scale

    with pytest.raises(fh.CompileError, match="complex64"):
        fh.grad_hook(body)


def test_returning_a_tuple_rejected():
    def body(grad):
        return grad, grad

    with pytest.raises(fh.CompileError, match="returns a tuple.*one tensor"):
        fh.grad_hook(body)


@pytest.mark.parametrize("make, kind", [
    (lambda grad: "x", "str"),
    (lambda grad: [grad], "list"),
    (lambda grad: {"grad": grad}, "dict"),
    (lambda grad: torch.float32, "dtype"),
], ids=["str", "list", "dict", "dtype"])
def test_returning_a_non_tensor_rejected(make, kind):
    with pytest.raises(fh.CompileError, match=rf"returns a \w*{kind}.*one tensor"):
        fh.grad_hook(make)


def test_calling_a_hook_with_a_non_tensor_rejected():
    hook = fh.grad_hook(lambda grad: grad * 2)
    with pytest.raises(TypeError, match="called with a parameter tensor.*not str"):
        hook("weight")


# --- registration ------------------------------------------------------------------------------------

@pytest.fixture
def hook():
    return fh.grad_hook(lambda grad: grad * 0.0, stats=("count",))


def fires(hook, t) -> bool:
    """Run a backward through `t` and report whether `hook` changed its gradient (it zeroes it)."""
    t.grad = None
    (t * 1.0).sum().backward()
    return bool((t.grad == 0).all())


def test_non_leaf_rejected(hook):
    with pytest.raises(ValueError, match="not a leaf tensor"):
        hook.register(leaf(3) * 2)


def test_requires_grad_false_rejected(hook):
    with pytest.raises(ValueError, match="doesn't require grad"):
        hook.register(torch.randn(3))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.complex64])
def test_non_float_dtype_rejected(hook, dtype):
    t = torch.zeros(3, dtype=dtype)
    if dtype.is_complex:
        t.requires_grad_()
    with pytest.raises(TypeError, match=rf"dtype {dtype} is not supported.*float32"):
        hook.register(t)


def test_sparse_tensor_rejected(hook):
    t = torch.eye(3).to_sparse().requires_grad_()
    with pytest.raises(TypeError, match="sparse_coo tensors are not supported.*dense"):
        hook.register(t)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_csr_tensor_rejected(hook):
    t = torch.eye(3).to_sparse_csr().requires_grad_()
    with pytest.raises(TypeError, match="sparse_csr tensors are not supported"):
        hook.register(t)


def test_same_tensor_twice_rejected(hook):
    t = leaf(3)
    hook.register(t)
    with pytest.raises(ValueError, match="already registered"):
        hook.register(t)
    assert fires(hook, t)
    assert len(hook.stats.names) == 1


def test_same_tensor_twice_message_names_its_registered_key(hook):
    t = leaf(3)
    hook.register(t, name="fc.weight")
    with pytest.raises(ValueError, match=r"fc\.weight.*already registered"):
        hook.register(t)


def test_same_tensor_twice_in_one_call_rejected(hook):
    t = leaf(3)
    with pytest.raises(ValueError, match="already registered"):
        hook.register([t, t])
    assert not fires(hook, t)


def test_duplicate_name_rejected(hook):
    alive = leaf(3)   # a registration lasts as long as its tensor
    hook.register(alive, name="w")
    with pytest.raises(ValueError, match="named 'w' is already registered.*name="):
        hook.register(leaf(3), name="w")


def test_duplicate_name_in_one_call_registers_nothing(hook):
    good, clash = leaf(3), leaf(3)
    with pytest.raises(ValueError, match="'w' is already registered"):
        hook.register([("w", good), ("w", clash)])
    assert not fires(hook, good)
    assert hook.stats.names == []


def test_unnamed_tensor_after_user_named_param1_registers(hook):
    # Automatic keys must not collide with a name the user chose.
    named = leaf(3)
    hook.register(named, name="param1")
    t = leaf(3)
    hook.register(t)
    assert fires(hook, t)
    assert len(set(hook.stats.names)) == 2


@pytest.mark.parametrize("target", [42, "weights", None, 1.5])
def test_non_tensor_target_rejected(hook, target):
    expected = rf"register\(\) takes a Tensor, an nn.Module.*not {type(target).__name__}"
    with pytest.raises(TypeError, match=expected):
        hook.register(target)


def test_iterable_with_non_tensor_rejected_and_nothing_registered(hook):
    good = leaf(3)
    with pytest.raises(TypeError, match=r"Tensors or \(name, Tensor\) pairs; got int"):
        hook.register([good, 3])
    assert not fires(hook, good)
    assert hook.stats.names == []


def test_pair_with_non_tensor_rejected(hook):
    with pytest.raises(TypeError, match="w: expected a Tensor, got int"):
        hook.register([("w", 3)])


def test_failed_register_leaves_nothing_registered(hook):
    good, bad = leaf(3), torch.randn(3)
    with pytest.raises(ValueError, match="param1: cannot register.*doesn't require grad"):
        hook.register([good, bad])
    assert not fires(hook, good)
    assert hook.stats.names == [] and hook.stats.read() == {}
    hook.register(good)  # and it can be registered afterwards
    assert fires(hook, good)


def test_result_not_broadcasting_to_grad_rejected_at_register():
    s = torch.ones(1, 1, 1)

    def body(grad):
        return grad * s

    hook = fh.grad_hook(body)  # fine at decoration: shape is only known at registration
    p = leaf(3)
    expected = r"shape \(1, 1, 3\), the gradient of param0 has shape \(3,\).*does not broadcast to it either"
    with pytest.raises(fh.CompileError, match=expected):
        hook.register(p)
    (p * 1.0).sum().backward()
    assert torch.equal(p.grad, torch.ones(3))


def test_result_not_broadcasting_in_list_registers_nothing():
    s = torch.ones(1, 1, 1)

    def body(grad):
        return grad * s

    hook = fh.grad_hook(body)
    good, bad = leaf(2, 2, 2), leaf(3)
    with pytest.raises(fh.CompileError, match="does not broadcast"):
        hook.register([good, bad])
    (good * 3.0).sum().backward()
    assert torch.equal(good.grad, torch.full((2, 2, 2), 3.0))


def test_meta_tensor_rejected_at_register(hook):
    with pytest.raises(ValueError, match="meta tensor.*materialized"):
        hook.register(torch.zeros(3, device="meta", requires_grad=True))
    with torch.device("meta"):
        model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="weight: is a meta tensor"):
        hook.register(model)
    assert hook.stats.names == []


@pytest.mark.parametrize("module", [torch.nn.Embedding(6, 3, sparse=True), torch.nn.EmbeddingBag(6, 3, sparse=True)],
                         ids=["Embedding", "EmbeddingBag"])
def test_module_with_sparse_gradients_rejected_at_register(hook, module):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), module)
    with pytest.raises(TypeError, match=r"1\.weight: Embedding(Bag)?\(sparse=True\) gives it sparse gradients.*"
                                        r"sparse=False.*other parameters"):
        hook.register(model)
    assert hook.stats.names == []
    module.weight.requires_grad_(False)  # frozen: it gets no gradient, so nothing to refuse
    hook.register(model)


@pytest.mark.parametrize("bucket_mb", [None, 25])
def test_sparse_gradient_of_a_tensor_refused_at_its_firing(backend, bucket_mb):
    """A bare tensor cannot tell in advance that it will get a sparse gradient: refused when it comes."""
    hook = fh.grad_hook(lambda grad: grad * 0.5, stats=("norm",), backend=backend)
    weight = torch.randn(6, 3, requires_grad=True)
    hook.register([("emb", weight)], bucket_mb=bucket_mb)
    with pytest.raises(TypeError, match="emb: its gradient is a torch.sparse_coo tensor.*dense"):
        torch.nn.functional.embedding(torch.tensor([0, 2]), weight, sparse=True).sum().backward()


def test_register_warns_when_module_conversions_swap_parameters(hook):
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with pytest.warns(UserWarning, match=r"set_swap_module_params_on_conversion\(True\) is on.*Convert the "
                                             r"model first, then register"):
            hook.register(torch.nn.Linear(2, 2))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


@pytest.mark.parametrize("body", [lambda grad: torch.full_like(grad, 1e6), lambda grad: grad.fill_(-7e4)],
                         ids=["full_like", "fill_"])
def test_fill_value_a_half_gradient_cannot_hold_rejected_at_register(body):
    """torch raises when it fills a float16 tensor with a value out of its range; a kernel would write inf."""
    hook = fh.grad_hook(body)
    with pytest.raises(fh.CompileError, match=r"for torch.float16 gradients.*without overflow.*can hold"):
        hook.register(leaf(3, dtype=torch.float16))
    assert hook.stats.names == []
    hook.register(leaf(3, dtype=torch.bfloat16))  # in range


#: (body, the op and number the message names, a gradient dtype torch refuses them for, one it accepts them for)
NUMBERS_BEYOND_A_DTYPE = {
    "clamp(-1e5, 1e5)": (lambda grad: grad.clamp(-1e5, 1e5), r"`clamp` with min=-100000.0, max=100000.0",
                         torch.float16, torch.bfloat16),
    "clamp(max=1e39)": (lambda grad: grad.clamp(max=1e39), r"`clamp` with max=1e\+39", torch.float32, torch.float64),
    "clamp_min_(1e39)": (lambda grad: grad.clamp_min_(1e39), r"`clamp_min` with min=1e\+39", torch.bfloat16,
                         torch.float64),
    "clamp_max(-1e5)": (lambda grad: grad.clamp_max(-1e5), r"`clamp_max` with max=-100000.0", torch.float16,
                        torch.float32),
    "where(g > 0, g, 1e39)": (lambda grad: torch.where(grad > 0, grad, 1e39), r"`where` with other=1e\+39",
                              torch.float32, torch.float16),
    "add(alpha=1e39)": (lambda grad: grad.add(grad, alpha=1e39), r"`add` with alpha=1e\+39", torch.float32,
                        torch.float64),
    "full_like(1e6)": (lambda grad: torch.full_like(grad, 1e6), r"`full_like` with fill_value=1000000.0",
                       torch.float16, torch.bfloat16),
}


@pytest.mark.parametrize("name", list(NUMBERS_BEYOND_A_DTYPE))
def test_numbers_torch_refuses_for_a_dtype_are_refused_at_register_and_plan(name, backend):
    """torch raises "value cannot be converted to type ... without overflow" for these numbers on gradients of one
    dtype and computes with them on another: the body compiles, and is refused at register or plan() for that dtype
    only, naming the op, the number, the dtype and what to do (a kernel would have used inf, eager ops raised in
    backward)."""
    body, named, refused, accepted = NUMBERS_BEYOND_A_DTYPE[name]
    with pytest.raises(RuntimeError, match="without overflow"):
        body(torch.ones(3, dtype=refused))
    body(torch.ones(3, dtype=accepted))
    hook = fh.grad_hook(body, backend=backend)
    message = (rf"cannot compile <lambda> for {refused} gradients: {named} on a {refused} value: torch raises "
               rf"\(value cannot be converted to type .* without overflow\); use numbers a {refused} value can hold "
               r"\(at most .* in magnitude, or an infinity\)")
    with pytest.raises(fh.CompileError, match=message):
        hook.register(leaf(3, dtype=refused))
    assert hook.stats.names == []
    with pytest.raises(fh.CompileError, match=message):
        hook.plan(numel=8, dtype=refused)
    hook.register(leaf(3, dtype=accepted))
    assert hook.stats.names == ["param0"]


def test_numbers_an_int_value_cannot_hold_are_refused_like_torch():
    def body(grad):
        return grad * (grad > 0).to(torch.int32).clamp(max=2**40)
    with pytest.raises(RuntimeError, match="without overflow"):
        body(torch.ones(3))
    hook = fh.grad_hook(body)
    with pytest.raises(fh.CompileError, match=r"`clamp` with max=1099511627776 on a torch.int32 value.*can hold "
                                              r"\(-2147483648 to 2147483647\)"):
        hook.register(leaf(3))


S = torch.tensor(2.0)
TENSOR_WHERE_A_NUMBER_GOES = {
    "2 ** grad": (lambda grad: 2 ** grad, r"`pow` takes `exponent` only as a Python number .* not a tensor; a "
                                           r"tensor exponent \(`x \*\* s`, `2 \*\* x`\) is not supported"),
    "grad * (2 ** s)": (lambda grad: grad * (2 ** S), r"`pow` takes `exponent` only as a Python number"),
    "grad ** s": (lambda grad: grad ** S, r"`pow` takes `exponent` only as a Python number"),
    "grad.fill_(s)": (lambda grad: grad.fill_(S), r"`fill` takes `value` only as a Python number .* not a tensor; "
                                                  r"to fill with a tensor `s`, write `x.copy_\(s\)`"),
    "full_like(grad, s)": (lambda grad: torch.full_like(grad, S), r"write `torch.zeros_like\(x\).copy_\(s\)`"),
    "add(alpha=s)": (lambda grad: grad.add(grad, alpha=S), r"`add` takes `alpha` only .* write `x \+ y \* s`"),
}


@pytest.mark.parametrize("name", list(TENSOR_WHERE_A_NUMBER_GOES))
def test_a_tensor_where_only_a_number_compiles_is_refused_with_what_to_write(name):
    body, message = TENSOR_WHERE_A_NUMBER_GOES[name]
    with pytest.raises(fh.CompileError, match=message) as info:
        fh.grad_hook(body)
    assert "Node" not in str(info.value)


def test_pos_of_a_bool_value_refused_as_torch_refuses_it():
    with pytest.raises(RuntimeError, match="on a bool tensor is not supported"):
        +torch.tensor([True])
    with pytest.raises(fh.CompileError, match=r"the `\+` operator on a bool value is not supported"):
        fh.grad_hook(lambda grad: torch.where(+(grad > 0), grad, 0.0))


@pytest.mark.parametrize("bucket_mb", [float("inf"), float("nan"), -1, "25", True])
def test_bad_bucket_mb_is_refused_by_name(hook, bucket_mb):
    with pytest.raises(ValueError, match="bucket_mb"):
        hook.register(torch.nn.Linear(2, 2), bucket_mb=bucket_mb)


# --- plan() and source(): what a gradient cannot be ---------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64], ids=str)
def test_plan_and_source_refuse_a_dtype_no_gradient_can_have(hook, dtype):
    with pytest.raises(TypeError, match=f"plan\\(\\): dtype {dtype} is not supported"):
        hook.plan(numel=10, dtype=dtype)
    with pytest.raises(TypeError, match=f"source\\(\\): dtype {dtype} is not supported"):
        hook.source(dtype=dtype)


@pytest.mark.parametrize("numel", [-1, 2.5, True, "8"], ids=repr)
def test_plan_refuses_a_numel_that_is_not_a_count(hook, numel):
    with pytest.raises(ValueError, match="numel= takes a whole number of elements >= 0"):
        hook.plan(numel=numel)


@pytest.mark.parametrize("target", [torch.nn.ReLU(), torch.nn.Linear(2, 2).requires_grad_(False), []],
                         ids=["no-parameters", "frozen", "empty-list"])
def test_register_of_nothing_is_refused(target):
    with pytest.raises(ValueError, match="found no tensor to register"):
        fh.grad_hook(stats=("norm",)).register(target)


@pytest.mark.parametrize("name", [3, "", ("a", "b")])
def test_a_name_that_is_not_a_non_empty_string_is_refused(name):
    hook = fh.grad_hook(stats=("norm",))
    with pytest.raises(ValueError, match="non-empty string"):
        hook.register(torch.zeros(3, requires_grad=True), name=name)
    if name == "":  # (a pair whose name is not a string is no (name, Tensor) pair: refused as such)
        with pytest.raises(ValueError, match="non-empty string"):
            hook.register([(name, torch.zeros(3, requires_grad=True))])
    assert len(hook.registry) == 0


def test_hist_range_without_hist_is_refused():
    with pytest.raises(ValueError, match="add 'hist'"):
        fh.grad_hook(stats=("norm",), hist_range=(-4, 4))
    assert fh.grad_hook(input_stats=("hist",), hist_range=(-4, 4)).hist_range == (-4, 4)


def test_adaptive_clip_refuses_an_unknown_backend_at_once():
    with pytest.raises(ValueError, match="trition"):
        fh.adaptive_clip(backend="trition")


def test_a_decorated_hook_compiles_again_with_other_options():
    @fh.grad_hook
    def clip(grad):
        return grad.clamp(-1.0, 1.0)

    again = fh.grad_hook(clip, stats="all")
    assert again is not clip and again.fn is clip.fn and "norm" in again.stat_names
    t = torch.zeros(3, requires_grad=True)
    t.grad = torch.tensor([3.0, -0.5, -2.0])
    again(t)
    assert t.grad.tolist() == [1.0, -0.5, -1.0] and again.stats.read()["param0"]["count"] == 3


@pytest.mark.parametrize(("value", "on"), [("1", True), ("true", True), ("on", True), ("0", False), ("", False),
                                           ("false", False), ("off", False), ("no", False)])
def test_fast_launch_switch_reads_the_usual_spellings(value, on, monkeypatch):
    from fusedhooks import config

    monkeypatch.setenv("FUSEDHOOKS_FAST_LAUNCH", value)
    assert config.fast_launch() is on


def test_fast_launch_switch_refuses_anything_else(monkeypatch):
    from fusedhooks import config

    monkeypatch.setenv("FUSEDHOOKS_FAST_LAUNCH", "2")
    with pytest.raises(ValueError, match="FUSEDHOOKS_FAST_LAUNCH"):
        config.fast_launch()
