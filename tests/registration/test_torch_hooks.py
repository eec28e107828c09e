"""PyTorch's own `test_post_accumulate_grad_hook_*` tests (test/test_autograd.py), ported to compiled hooks.

Where torch's hook mutates the parameter, the port does the same to the gradient (what a body can express);
each assertion is kept. Every test runs for the three ways to register: on a module, on a list, on a tensor.
"""

import gc
import weakref
from copy import deepcopy

import pytest
import torch

import fusedhooks as fh

REGISTRATIONS = ["module", "list", "tensor"]


def register(hook, tensor, how, name=None):
    """Register `hook` on `tensor` the `how` way (keyed by `name`, a prefix for a module); returns the handle."""
    if how == "module":
        holder = torch.nn.Module()
        holder.p = tensor                 # a Parameter: keeps the same object
        return hook.register(holder, name=name)
    if how == "list":
        return hook.register([tensor] if name is None else [(name, tensor)])
    return hook.register(tensor, name=name)


def leaf(*shape):
    return torch.nn.Parameter(torch.rand(*shape))


@pytest.mark.parametrize("how", ["list", "tensor"])
def test_post_accumulate_grad_hook_on_non_leaf(how):
    hook = fh.grad_hook(lambda grad: grad - 1.0)
    non_leaf = 2.0 * torch.rand(3, requires_grad=True)
    with pytest.raises(ValueError, match="not a leaf tensor"):   # torch: RuntimeError "...non-leaf tensors"
        register(hook, non_leaf, how)


@pytest.mark.parametrize("how", REGISTRATIONS)
def test_post_accumulate_grad_hook_multiple_hooks(how, backend):
    hook1 = fh.grad_hook(lambda grad: grad - 1.0, backend=backend)
    hook2 = fh.grad_hook(lambda grad: grad * 4.0, backend=backend)
    tensor = leaf(3)
    register(hook1, tensor, how)
    register(hook2, tensor, how)
    tensor.sum().backward()
    # both hooks should be called, in order
    assert torch.equal(tensor.grad, 4.0 * (torch.ones(3) - 1.0))


@pytest.mark.parametrize("how", REGISTRATIONS)
def test_post_accumulate_grad_hook_multiple_tensors(how, backend):
    hook = fh.grad_hook(lambda grad: grad - 1.0, backend=backend)
    tensor1, tensor2 = leaf(3), leaf(5)
    register(hook, tensor1, how, name="t1")
    register(hook, tensor2, how, name="t2")
    tensor1.sum().backward()
    tensor2.sum().backward()
    # both tensors should have been modified
    assert torch.equal(tensor1.grad, torch.zeros(3))
    assert torch.equal(tensor2.grad, torch.zeros(5))


@pytest.mark.parametrize("how", REGISTRATIONS)
def test_post_accumulate_grad_hook_returns_not_None(how):
    """torch refuses a hook that returns a value; a compiled hook always returns None to torch (the body's
    returned tensor is written into .grad), so the same backward succeeds."""
    hook = fh.grad_hook(lambda grad: grad * 1.0)
    tensor = leaf(2, 3)
    register(hook, tensor, how)
    tensor.sum().backward()
    assert hook(tensor) is None


@pytest.mark.parametrize("how", REGISTRATIONS)
def test_post_accumulate_grad_hook_e2e(how, backend):
    """Optimizer in backward, after a compiled clip hook registered first: the same parameters as the plain
    loop (clip, then Adam), and no more updates once the handles are removed."""
    def setup_optim_in_bwd(model):
        optims = {}
        handles = []

        def optim_step_hook(param):
            optims[param].step()
            optims[param].zero_grad()

        for p in model.parameters():
            optims[p] = torch.optim.Adam([p])
            handles.append(p.register_post_accumulate_grad_hook(optim_step_hook))
        return handles

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    input = torch.rand(2, 3)
    clip = fh.grad_hook(lambda grad: grad.clamp(-0.5, 0.5), backend=backend)
    if how == "module":
        clip_handles = [clip.register(model)]
    elif how == "list":
        clip_handles = [clip.register(list(model.parameters()))]
    else:
        clip_handles = [clip.register(p, name=n) for n, p in model.named_parameters()]
    handles = setup_optim_in_bwd(model)

    # make a copy for reference
    model_copy = deepcopy(model)
    optim_copy = torch.optim.Adam(model_copy.parameters())

    iters = 5
    for _ in range(iters):
        loss = model(input).sum()
        loss.backward()

        loss_copy = model_copy(input).sum()
        loss_copy.backward()
        for p in model_copy.parameters():
            p.grad.clamp_(-0.5, 0.5)
        optim_copy.step()
        optim_copy.zero_grad()

    params_copy = []  # freeze a copy of the params to compare later
    for p_reference, p in zip(model_copy.parameters(), model.parameters()):
        assert torch.equal(p_reference, p)
        params_copy.append(p_reference.detach().clone())

    # After removing the handle, the model should no longer update.
    for h in handles + clip_handles:
        h.remove()

    for _ in range(iters):
        loss = model(input).sum()
        loss.backward()

        loss_copy = model_copy(input).sum()
        loss_copy.backward()
        optim_copy.step()
        optim_copy.zero_grad()

    for p_static, p_reference, p in zip(params_copy, model_copy.parameters(), model.parameters()):
        assert torch.equal(p_static, p)
        assert not torch.equal(p_reference, p)


@pytest.mark.parametrize("how", REGISTRATIONS)
def test_post_accumulate_grad_hook_gets_cleaned_up(how):
    def fun_stuff_with_hook():
        thing_to_put_in_hook = torch.tensor(0.5)   # a closed-over 0-dim tensor, read by the kernel

        hook = fh.grad_hook(lambda grad: grad - grad + thing_to_put_in_hook)
        tensor = leaf(3)
        register(hook, tensor, how)
        tensor.sum().backward()
        assert torch.equal(tensor.grad, torch.full((3,), 0.5))
        ref = weakref.ref(thing_to_put_in_hook)
        gc.collect()
        return tensor, ref

    gc.disable()
    try:
        tensor, ref = fun_stuff_with_hook()
        assert ref() is not None  # thing_to_put_in_hook should be kept alive by tensor
        del tensor
        gc.collect()
        assert ref() is None  # thing_to_put_in_hook should be cleaned
    finally:
        gc.enable()


@pytest.mark.parametrize("bucket_mb", [None, 25], ids=["default", "buckets"])
@pytest.mark.parametrize("how", REGISTRATIONS)
def test_post_accumulate_grad_hook_ordering(how, bucket_mb, backend):
    tensor = leaf(3)

    def pre_hook(grad):
        return grad.sub(2.0)

    def acc_grad_node_pre_hook(grad_out):
        return (grad_out[0].div(5.0),)

    post_acc_grad_hook = fh.grad_hook(lambda grad: grad + 0.5, backend=backend)

    def acc_grad_node_post_hook(grad_in, grad_out):
        tensor.grad = grad_out[0].mul(10)

    acc_grad = tensor.view_as(tensor).grad_fn.next_functions[0][0]
    tensor.register_hook(pre_hook)
    acc_grad.register_prehook(acc_grad_node_pre_hook)
    if bucket_mb and how != "tensor":
        post_acc_grad_hook.register([tensor] if how == "list" else torch.nn.ParameterList([tensor]),
                                    bucket_mb=bucket_mb)
    else:
        register(post_acc_grad_hook, tensor, how)
    acc_grad.register_hook(acc_grad_node_post_hook)
    tensor.sum().backward()

    # the hooks should run in the order of:
    #   1. tensor prehook
    #   2. acc_grad prehook
    #   3. tensor post acc_grad hook
    #   4. acc_grad posthook
    # so that would be ((1 - 2) / 5 + 0.5) * 10 = 3
    expected = torch.tensor([3.0, 3.0, 3.0])
    if bucket_mb and how != "tensor":
        # explicit buckets process at the end of backward: the AccumulateGrad post hook (invisible from
        # Python) runs before, and its replacement .grad is what gets processed: (1 - 2) / 5 * 10 + 0.5
        expected = torch.tensor([-1.5, -1.5, -1.5])
    assert torch.allclose(tensor.grad, expected)
