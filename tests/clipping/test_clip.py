"""fh.clip_grad_norm_: global-norm clipping fed by a hook's recorded norms, against torch.nn.utils.clip_grad_norm_.

The gradients are set through a backward of sum(p * g), so each parameter's accumulated gradient is exactly g
and the hook fires on it; torch's clip_grad_norm_ then runs on clones of the same gradients.
"""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fusedhooks as fh
from fusedhooks.kernels import multi_tensor

from helpers import assert_same_values

#: odd sizes: empty, one element, primes, a 2-D shape
SIZES = [(0,), (1,), (2,), (7,), (13,), (97,), (257,), (1031,), (4099,), (17, 19)]
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INF = float("inf")


def make_params(sizes, dtype=torch.float32):
    return [torch.randn(*s, dtype=torch.float32).to(dtype).requires_grad_() for s in sizes]


def random_grads(params, scale=1.0):
    return [(torch.randn(p.shape) * scale).to(device=p.device, dtype=p.dtype) for p in params]


def backward_with(params, grads):
    """One backward after which params[i].grad == grads[i] (None entries: that parameter gets no gradient)."""
    losses = [(p * g).sum() for p, g in zip(params, grads) if g is not None]
    torch.autograd.backward(losses)


def torch_clip(params, max_norm, norm_type=2.0, error_if_nonfinite=False):
    """torch's clip_grad_norm_ on clones of the gradients; returns (total norm, clipped grads, in param order).
    Empty gradients are left out: torch raises for the inf norm of one, fusedhooks counts it as 0 (for the
    2-norm they change nothing either way)."""
    clones = []
    for p in params:
        c = torch.zeros(p.shape, dtype=p.dtype, device=p.device, requires_grad=True)
        c.grad = None if p.grad is None else p.grad.clone()
        clones.append(c)
    counted = [c for c in clones if c.grad is not None and c.grad.numel() > 0]
    total = torch.nn.utils.clip_grad_norm_(counted, max_norm, norm_type, error_if_nonfinite)
    return total, [c.grad for c in clones]


def hooked(params, backend, stats=("norm", "absmax")):
    hook = fh.grad_hook(stats=stats, backend=backend)
    hook.register(params)
    return hook


def assert_matches_torch(total, expected_total, params, expected_grads, exact):
    """exact: the same total norm bit for bit, then the same gradients bit for bit; else (fp32/fp64 2-norm, whose
    per-parameter norms are summed in another order) both within 1e-6 relative."""
    assert total.dim() == 0 and total.dtype == expected_total.dtype
    if exact:
        assert_same_values(total, expected_total)
    else:
        assert math.isclose(total.item(), expected_total.item(), rel_tol=1e-6), (total.item(), expected_total.item())
    for p, e in zip(params, expected_grads):
        if e is None:
            assert p.grad is None
        elif exact or torch.equal(total, expected_total):
            assert_same_values(p.grad, e)  # the same coefficient: the same products
        elif p.grad.dtype in (torch.float16, torch.bfloat16):
            assert_same_values(p.grad, e, ulps=1)  # a coefficient 1e-7 off may round to the neighbouring value
        else:
            assert p.grad.dtype == e.dtype
            torch.testing.assert_close(p.grad, e, rtol=1e-6, atol=0, equal_nan=True)


def count_calls(monkeypatch, module, name):
    """Wrap module.name; returns the list of the arguments of every call."""
    calls = []
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


# --- results against torch -------------------------------------------------------------------------------------

@pytest.mark.parametrize("norm_type", [2.0, INF])
@pytest.mark.parametrize("dtype", FLOATS)
def test_matches_torch_when_clipping(backend, dtype, norm_type):
    torch.manual_seed(1)
    params = make_params(SIZES, dtype)
    hook = hooked(params, backend)
    backward_with(params, random_grads(params))
    expected_total, expected = torch_clip(params, 0.5, norm_type)
    assert expected_total.item() > 0.5  # the gradients are really scaled
    total = fh.clip_grad_norm_(hook, max_norm=0.5, norm_type=norm_type)
    # inf: absmax is exact, so is the coefficient; fp16/bf16 2-norm: the recorded fp64 norm rounds to torch's
    # value (checked: the same bits for these seeds); fp32/fp64 2-norm: summed in another order
    exact = norm_type == INF or dtype in (torch.float16, torch.bfloat16)
    assert_matches_torch(total, expected_total, params, expected, exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_max_norm_leaves_grads_bitwise_unchanged(backend, dtype, monkeypatch):
    calls = count_calls(monkeypatch, multi_tensor, "scale_")
    torch.manual_seed(2)
    params = make_params(SIZES, dtype)
    hook = hooked(params, backend)
    grads = random_grads(params)
    backward_with(params, grads)
    expected_total, expected = torch_clip(params, 1e6)
    total = fh.clip_grad_norm_(hook, max_norm=1e6)
    assert math.isclose(total.item(), expected_total.item(), rel_tol=1e-6)
    for p, g in zip(params, grads):
        assert_same_values(p.grad, g)
    # the Triton backend still launches (the decision is the kernel's, on the device: no sync); the kernel
    # returns before writing (test_kernel_writes_nothing_when_coefficient_is_one)
    assert len(calls) == (1 if backend == "triton" else 0)
    assert all(coef.item() == 1.0 for _, coef in calls)


def test_grads_after_the_hook_body_are_the_ones_clipped(backend):
    @fh.grad_hook(stats=("norm",), backend=backend)
    def clamp(grad):
        return grad.clamp(-0.5, 0.5)

    torch.manual_seed(3)
    params = make_params([(31,), (8, 9)])
    clamp.register(params)
    backward_with(params, random_grads(params))
    assert all(p.grad.abs().max() <= 0.5 for p in params)  # the body ran; the norms are of its result
    expected_total, expected = torch_clip(params, 0.25)
    total = fh.clip_grad_norm_(clamp, 0.25)
    assert_matches_torch(total, expected_total, params, expected, exact=False)


def test_sumsq_statistic_gives_the_2_norm(backend):
    torch.manual_seed(4)
    params = make_params(SIZES, torch.bfloat16)
    hook = hooked(params, backend, stats=("sumsq",))
    backward_with(params, random_grads(params))
    expected_total, expected = torch_clip(params, 0.5)
    total = fh.clip_grad_norm_(hook, 0.5)
    assert_matches_torch(total, expected_total, params, expected, exact=True)


def test_many_params_mixed_dtypes_one_launch_per_dtype(backend, monkeypatch):
    calls = count_calls(monkeypatch, multi_tensor, "scale_")
    torch.manual_seed(5)
    sizes = [(n,) for n in (0, 1, 3, 5, 11, 23, 47, 101, 211, 401)] * 4
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float32]
    params = [p for i, d in enumerate(dtypes) for p in make_params(sizes[i * 10:(i + 1) * 10], d)]
    hook = hooked(params, backend)
    backward_with(params, random_grads(params))
    expected_total, expected = torch_clip(params, 0.1)
    total = fh.clip_grad_norm_(hook, 0.1)
    assert total.dtype == torch.float32  # torch promotes the fp16, bf16 and fp32 norms
    assert_matches_torch(total, expected_total, params, expected, exact=False)
    if backend == "triton":
        # one launch per dtype, with every non-empty gradient of that dtype (the empty ones need no program)
        assert len(calls) == 3
        assert {t.dtype: t.n_tensors for t, *_ in calls} == {torch.float32: 18, torch.float16: 9, torch.bfloat16: 9}
    else:
        assert calls == []


@pytest.mark.parametrize("n_params", [1, 40])
def test_one_launch_regardless_of_the_number_of_params(n_params, monkeypatch):
    calls = count_calls(monkeypatch, multi_tensor, "scale_")
    torch.manual_seed(6)
    params = make_params([(7 + 2 * i,) for i in range(n_params)])
    hook = hooked(params, "triton")
    backward_with(params, random_grads(params))
    expected_total, expected = torch_clip(params, 0.1)
    total = fh.clip_grad_norm_(hook, 0.1)
    assert len(calls) == 1 and calls[0][0].n_tensors == n_params
    assert_matches_torch(total, expected_total, params, expected, exact=False)


# --- NaN, Inf, error_if_nonfinite --------------------------------------------------------------------------------

@pytest.mark.parametrize("norm_type", [2.0, INF])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_gradients_behave_as_torch(backend, dtype, bad, norm_type):
    torch.manual_seed(7)
    params = make_params(SIZES, dtype)
    hook = hooked(params, backend)
    grads = random_grads(params)
    grads[5][3] = bad
    backward_with(params, grads)
    expected_total, expected = torch_clip(params, 1.0, norm_type)
    total = fh.clip_grad_norm_(hook, 1.0, norm_type)
    assert_same_values(total, expected_total)
    if bad != bad:
        assert all(p.grad.isnan().all() for p in params)  # NaN total norm: every gradient NaN, as torch
    else:
        assert total.item() == math.inf  # coefficient 0: zeros, and NaN where the gradient was inf
    for p, e in zip(params, expected):
        assert_same_values(p.grad, e)


def test_error_if_nonfinite_raises_before_scaling(backend):
    torch.manual_seed(8)
    params = make_params(SIZES)
    hook = hooked(params, backend)
    grads = random_grads(params)
    grads[2][0] = math.nan
    backward_with(params, grads)
    with pytest.raises(RuntimeError, match="non-finite"):
        torch_clip(params, 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match="non-finite, so it cannot be clipped"):
        fh.clip_grad_norm_(hook, 1.0, error_if_nonfinite=True)
    for p, g in zip(params, grads):
        assert_same_values(p.grad, g)


def test_error_if_nonfinite_passes_finite_norms(backend):
    torch.manual_seed(9)
    params = make_params(SIZES)
    hook = hooked(params, backend)
    backward_with(params, random_grads(params))
    expected_total, expected = torch_clip(params, 1.0, error_if_nonfinite=True)
    total = fh.clip_grad_norm_(hook, 1.0, error_if_nonfinite=True)
    assert_matches_torch(total, expected_total, params, expected, exact=False)


# --- which parameters count --------------------------------------------------------------------------------------

def test_params_without_grad_are_skipped(backend):
    torch.manual_seed(10)
    params = make_params(SIZES)
    hook = hooked(params, backend)
    grads = random_grads(params)
    grads[1] = grads[4] = grads[8] = None
    backward_with(params, grads)
    expected_total, expected = torch_clip(params, 0.5)
    total = fh.clip_grad_norm_(hook, 0.5)
    assert_matches_torch(total, expected_total, params, expected, exact=False)


def test_grads_set_to_none_after_an_earlier_step_are_skipped(backend):
    """A parameter that fired in step 1 but got no gradient in step 2 (zero_grad(set_to_none=True)) no
    longer counts, though its statistics row still holds step 1's norm."""
    torch.manual_seed(11)
    params = make_params(SIZES)
    hook = hooked(params, backend)
    backward_with(params, random_grads(params, scale=100.0))
    fh.clip_grad_norm_(hook, 1.0)
    for p in params:
        p.grad = None
    grads = random_grads(params)
    grads[6] = grads[8] = None  # the largest ones
    backward_with(params, grads)
    expected_total, expected = torch_clip(params, 0.5)
    total = fh.clip_grad_norm_(hook, 0.5)
    assert_matches_torch(total, expected_total, params, expected, exact=False)


def test_no_grads_returns_zero_and_launches_nothing(backend, monkeypatch):
    calls = count_calls(monkeypatch, multi_tensor, "scale_")
    params = make_params(SIZES)
    hook = hooked(params, backend)
    total = fh.clip_grad_norm_(hook, 1.0)
    assert total.dim() == 0 and total.item() == 0.0
    assert torch.nn.utils.clip_grad_norm_(params, 1.0).item() == 0.0  # torch agrees
    assert calls == []


@pytest.mark.parametrize("norm_type", [2.0, INF])
def test_grad_set_by_hand_is_measured_from_the_gradient(backend, norm_type):
    params = make_params([(5,), (3,)])
    hook = hooked(params, backend)
    params[0].grad = torch.full((5,), 3.0)  # set by hand: the hook never saw it
    params[1].grad = torch.tensor([1.0, -4.0, 2.0])
    expected_total, expected = torch_clip(params, 1.0, norm_type)
    total = fh.clip_grad_norm_(hook, 1.0, norm_type=norm_type)
    assert_matches_torch(total, expected_total, params, expected, exact=norm_type == INF)


def test_grads_after_stats_reset_are_measured_from_the_gradients(backend):
    params = make_params(SIZES)
    hook = hooked(params, backend)
    backward_with(params, random_grads(params, scale=10.0))
    hook.stats.reset()  # the rows are NaN now; the gradients are still those the hook measured
    expected_total, expected = torch_clip(params, 1.0)
    total = fh.clip_grad_norm_(hook, 1.0)
    assert torch.isfinite(total)
    assert_matches_torch(total, expected_total, params, expected, exact=False)


def test_grad_of_a_micro_batch_the_gate_skipped_counts(backend):
    """accumulation_steps=2, a parameter reached in the first micro-batch only: the hook processes nothing of it
    (as an eager hook gated the same way), and the global norm is torch's, its gradient included."""
    torch.manual_seed(0)
    trunk, expert, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    modules = torch.nn.ModuleDict({"trunk": trunk, "expert": expert, "head": head})
    hook = fh.grad_hook(lambda g: g.clamp(-0.1, 0.1), stats=("norm",), backend=backend)
    hook.register(modules, accumulation_steps=2)
    x = torch.randn(3, 4) * 3
    (head(trunk(x)).sum() + expert(trunk(x)).sum()).backward()
    unprocessed = expert.weight.grad.clone()
    head(trunk(x)).sum().backward()
    assert torch.equal(expert.weight.grad, unprocessed)  # the gate left it alone
    params = list(modules.parameters())
    expected_total, expected = torch_clip(params, 1.0)
    total = fh.clip_grad_norm_(hook, 1.0)
    assert_matches_torch(total, expected_total, params, expected, exact=False)


def test_empty_gradient_counts_as_zero_for_the_inf_norm(backend):
    params = make_params([(0,), (3,)])
    hook = hooked(params, backend)
    backward_with(params, [torch.zeros(0), torch.tensor([1.0, -4.0, 2.0])])
    total = fh.clip_grad_norm_(hook, 2.0, norm_type=INF)
    assert total.item() == 4.0
    assert_same_values(params[1].grad, torch.tensor([1.0, -4.0, 2.0]) * torch.tensor(2.0 / (4.0 + 1e-6)))
    assert params[0].grad.shape == (0,)


# --- missing statistics and other norm types ---------------------------------------------------------------------

@pytest.mark.parametrize(("norm_type", "needed"), [(2.0, "norm"), (INF, "absmax"), ("inf", "absmax")])
def test_missing_statistic_names_the_one_to_add(norm_type, needed):
    params = make_params([(5,)])
    hook = hooked(params, "reference", stats=("mean",))
    backward_with(params, random_grads(params))
    with pytest.raises(ValueError, match=f"add '{needed}' to its stats="):
        fh.clip_grad_norm_(hook, 1.0, norm_type=norm_type)


def test_takes_a_hook_not_parameters():
    with pytest.raises(TypeError, match="fusedhooks hook"):
        fh.clip_grad_norm_(make_params([(5,)]), 1.0)


@pytest.mark.parametrize("norm_type", [1.0, 3.0, -INF])
def test_other_norm_types_read_the_gradients_as_torch(backend, norm_type, monkeypatch):
    calls = count_calls(monkeypatch, multi_tensor, "scale_")
    torch.manual_seed(12)
    params = make_params(SIZES[1:])
    hook = hooked(params, backend, stats=())  # needs no statistic
    backward_with(params, random_grads(params))
    expected_total, expected = torch_clip(params, 0.5, norm_type)
    total = fh.clip_grad_norm_(hook, 0.5, norm_type=norm_type)
    # the same per-parameter norms as torch (computed by torch), so the same bits everywhere
    assert_matches_torch(total, expected_total, params, expected, exact=True)
    assert len(calls) == (1 if backend == "triton" else 0)


# --- backends, fallbacks ---------------------------------------------------------------------------------------

def test_cpu_without_interpreter_uses_torch_foreach(monkeypatch):
    torch.manual_seed(13)
    params = make_params(SIZES)
    hook = hooked(params, None)  # "auto": Triton here, under TRITON_INTERPRET=1
    backward_with(params, random_grads(params))
    expected_total, expected = torch_clip(params, 0.5)
    scales = count_calls(monkeypatch, multi_tensor, "scale_")
    foreach = count_calls(monkeypatch, torch, "_foreach_mul_")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    total = fh.clip_grad_norm_(hook, 0.5)
    assert scales == [] and len(foreach) == 1
    assert_matches_torch(total, expected_total, params, expected, exact=False)


def test_foreach_false_scales_one_tensor_at_a_time(monkeypatch):
    torch.manual_seed(14)
    params = make_params(SIZES)
    hook = hooked(params, "reference")
    backward_with(params, random_grads(params))
    expected_total, expected = torch_clip(params, 0.5)
    foreach = count_calls(monkeypatch, torch, "_foreach_mul_")
    total = fh.clip_grad_norm_(hook, 0.5, foreach=False)
    assert foreach == []
    assert_matches_torch(total, expected_total, params, expected, exact=False)


# --- caching of the launch tables --------------------------------------------------------------------------------

def test_tables_are_cached_and_rebuilt_when_grads_move(monkeypatch):
    """The multi-tensor table holds the gradients' addresses: rebuilt when they move. The clip's layout (which row of
    the statistics each norm comes from) does not depend on them: built once, also when zero_grad(set_to_none=True)
    gives new gradient tensors at every step (a rebuild copies it to the device and, on a GPU, used to sync)."""
    from fusedhooks.clipping import clip

    builds = count_calls(monkeypatch, multi_tensor, "build_table")
    layouts = count_calls(monkeypatch, clip, "_build_layout")
    torch.manual_seed(15)
    params = make_params(SIZES)
    hook = hooked(params, "triton")
    backward_with(params, random_grads(params))
    fh.clip_grad_norm_(hook, 0.5)
    backward_with(params, random_grads(params))  # accumulates into the same storage
    expected_total, expected = torch_clip(params, 0.5)
    total = fh.clip_grad_norm_(hook, 0.5)
    assert len(builds) == 1
    assert_matches_torch(total, expected_total, params, expected, exact=False)

    old = [p.grad for p in params]  # kept alive, so the new gradients land elsewhere
    snapshot = [g.clone() for g in old]
    for p in params:
        p.grad = None
    backward_with(params, random_grads(params))
    assert all(p.grad.data_ptr() != o.data_ptr() for p, o in zip(params, old) if o.numel())
    expected_total, expected = torch_clip(params, 0.5)
    total = fh.clip_grad_norm_(hook, 0.5)
    assert len(builds) == 2 and len(layouts) == 1
    assert_matches_torch(total, expected_total, params, expected, exact=False)
    for o, s in zip(old, snapshot):
        assert_same_values(o, s)  # the stale addresses were not written


# --- cost: the clip adds one read + write pass, nothing reads the gradients for their norms ------------------------

class GradAccesses(TorchDispatchMode):
    """Records every torch op (views aside) that has a tensor sharing storage with one of `grads`."""

    def __init__(self, grads):
        super().__init__()
        self.storages = {g.untyped_storage().data_ptr() for g in grads if g.numel()}
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        if not func.is_view and any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages
                                    for t in flat):
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **kwargs)


def test_clip_after_a_hook_costs_one_read_write_pass(backend, monkeypatch):
    calls = count_calls(monkeypatch, multi_tensor, "scale_")
    torch.manual_seed(16)
    params = make_params(SIZES + [(3, 0)], torch.bfloat16)
    hook = hooked(params, backend, stats=("norm",))
    assert hook.plan(numel=4099, dtype=torch.bfloat16).passes == 1  # the hook: one read, norms recorded
    backward_with(params, random_grads(params))
    grads = [p.grad for p in params]
    grad_bytes = sum(g.numel() * g.element_size() for g in grads)

    clones = [torch.zeros(p.shape, dtype=p.dtype, requires_grad=True) for p in params]
    for c, g in zip(clones, grads):
        c.grad = g.clone()
    with GradAccesses([c.grad for c in clones]) as seen:  # the instrument sees torch's own passes
        torch.nn.utils.clip_grad_norm_([c for c in clones if c.grad.numel()], 0.5)
    assert seen.ops == ["_foreach_norm", "_foreach_mul_"]  # torch: a read, then a read + write

    with GradAccesses(grads) as seen:
        fh.clip_grad_norm_(hook, 0.5)
    if backend == "triton":
        assert seen.ops == []  # no torch op touches a gradient: the norms come from the statistics buffer
        assert len(calls) == 1
        table = calls[0][0]
        assert table.bytes == 2 * grad_bytes  # the one kernel reads and writes every element once
        assert sorted(table.addresses) == sorted(g.data_ptr() for g in grads if g.numel())
    else:
        assert seen.ops == ["_foreach_mul_"]
    assert_same_values(params[8].grad, clones[8].grad)


# --- the multi-tensor kernel itself -------------------------------------------------------------------------------

@pytest.mark.parametrize("coef_dtype", [None, torch.float32, torch.float64])
@pytest.mark.parametrize("dtype", FLOATS)
def test_kernel_matches_mul_(dtype, coef_dtype):
    """Several programs per tensor (chunk 64) and several iterations per program (block 16)."""
    def fresh():
        torch.manual_seed(17)
        tensors = [torch.randn(n).to(dtype) for n in (0, 1, 7, 97, 131)]
        tensors.append(torch.randn(9, 5).to(dtype).t())  # dense, not contiguous
        tensors.append(torch.randn(6, 6).to(dtype)[:, :3])  # not dense: left out of the table
        tensors.append(torch.randn(50).to(dtype)[3:46])  # at an odd address: no alignment hint
        return tensors

    tensors = fresh()
    coef = torch.tensor(0.3712345678, dtype=coef_dtype or dtype)
    for round_coef in (False, True):
        mine = fresh()
        table = multi_tensor.build_table(mine, block=16, chunk=64)
        assert table.left_out == (6,) and table.n_programs == 0 + 1 + 1 + 2 + 3 + 1 + 1
        assert not table.aligned
        multi_tensor.scale_(table, coef, round_coef=round_coef)
        # round_coef: CUDA torch rounds a coefficient of another dtype to the tensors' dtype first
        c = coef.to(dtype) if round_coef else coef
        mine[6].mul_(c)  # what the caller does with the tensors left out
        for m, t in zip(mine, tensors):
            assert_same_values(m, t.clone().mul_(c))
    if dtype in (torch.float16, torch.bfloat16) and coef_dtype is not None:
        assert not torch.equal(tensors[4].clone().mul_(coef), tensors[4].clone().mul_(coef.to(dtype)))


def test_kernel_writes_nothing_when_coefficient_is_one():
    """A signalling NaN is quieted by any multiplication: it survives only if nothing was written."""
    x = torch.tensor([1.0, 2.0, 3.0, -0.0])
    x.view(torch.int32)[1] = 0x7F800001
    table = multi_tensor.build_table([x])
    assert table.aligned  # CPU allocations are 64-byte aligned
    multi_tensor.scale_(table, torch.tensor(1.0))
    assert x.view(torch.int32)[1].item() == 0x7F800001
    multi_tensor.scale_(table, torch.tensor(0.5))  # the instrument works: a write quiets it
    assert x.view(torch.int32)[1].item() == 0x7FC00001
    assert x[[0, 2]].tolist() == [0.5, 1.5]
    multi_tensor.scale_(table, torch.tensor(math.nan))  # NaN >= 1 is false: multiplied in, as torch
    assert x.isnan().all()


def test_multi_tensor_scale_convenience():
    tensors = [torch.randn(n, dtype=torch.bfloat16) for n in (3, 0, 65)]
    tensors.append(torch.randn(4, 4, dtype=torch.bfloat16)[:, :2])
    expected = [t.clone().mul_(torch.tensor(0.3)) for t in tensors]
    multi_tensor.multi_tensor_scale_(tensors, torch.tensor(0.3))
    for t, e in zip(tensors, expected):
        assert_same_values(t, e)


def test_build_table_refuses_mixed_dtypes():
    with pytest.raises(ValueError, match="one dtype and device"):
        multi_tensor.build_table([torch.zeros(3), torch.zeros(3, dtype=torch.float16)])
    with pytest.raises(ValueError, match="0-dim float tensor"):
        multi_tensor.scale_(multi_tensor.build_table([torch.zeros(3)]), torch.tensor([0.5]))


# --- on a GPU (skipped without CUDA): what only the compiled kernel and CUDA torch show ----------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("norm_type", [2.0, INF])
def test_matches_torch_on_cuda(norm_type, monkeypatch):
    """Mixed dtypes (CUDA torch rounds the fp32 coefficient to fp16/bf16 before multiplying those), sizes that
    take several chunks, an unaligned gradient (no vector hint), one launch per dtype."""
    calls = count_calls(monkeypatch, multi_tensor, "scale_")
    torch.manual_seed(18)
    sizes = [(0,), (1,), (97,), (4099,), (1 << 20,), (300, 301)]
    params = [torch.randn(*s).to(device="cuda", dtype=d).requires_grad_()
              for d in (torch.float32, torch.bfloat16, torch.float16) for s in sizes]
    storage = torch.zeros(4100, device="cuda")
    params[3].grad = storage[1:4100]  # accumulated into in place: a gradient at an address not 16-byte aligned
    hook = hooked(params, None)
    backward_with(params, random_grads(params))
    assert params[3].grad.data_ptr() % 16 != 0
    expected_total, expected = torch_clip(params, 0.5, norm_type)
    total = fh.clip_grad_norm_(hook, 0.5, norm_type)
    assert total.device.type == "cuda" and len(calls) == 3
    assert any(not t.aligned for t, *_ in calls) and any(t.aligned for t, *_ in calls)
    assert_matches_torch(total, expected_total, params, expected, exact=norm_type == INF)


def test_norms_of_gradients_changed_since_the_hook_measured_them_are_recomputed(backend):
    """zero_grad(set_to_none=False) zeroes every .grad; a parameter the next backward does not reach keeps a
    zero gradient while its statistics row still holds the old norm: that norm must not be used."""
    a = torch.zeros(100, requires_grad=True)
    b = torch.zeros(50, requires_grad=True)
    hook = fh.grad_hook(stats=("norm",), backend=backend)
    hook.register([a, b])
    ((a * torch.arange(100.0)).sum() + (b * 1000.0).sum()).backward()
    for p in (a, b):
        p.grad.zero_()                              # what zero_grad(set_to_none=False) does
    (a * torch.arange(100.0)).sum().backward()      # b is not reached: its row still says 1000 * sqrt(50)
    reference = []
    for p in (a, b):
        r = torch.nn.Parameter(torch.zeros_like(p))
        r.grad = p.grad.clone()
        reference.append(r)
    total_ref = torch.nn.utils.clip_grad_norm_(reference, 10.0)
    total = fh.clip_grad_norm_(hook, 10.0)
    torch.testing.assert_close(total, total_ref, rtol=1e-6, atol=0)
    for p, r in zip((a, b), reference):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)
    b.grad.add_(3.0)                                # edited by hand after the hook measured it
    total = fh.clip_grad_norm_(hook, 1e9)
    torch.testing.assert_close(total, torch.linalg.vector_norm(torch.cat([a.grad, b.grad])), rtol=1e-6, atol=0)


def test_a_new_gradient_at_a_freed_gradient_address_is_not_taken_for_the_measured_one(backend):
    """zero_grad(set_to_none=True), then a backward with the hook paused: the allocator usually puts the new
    gradient where the freed one was, with version 0 again. Its recorded norm is not its norm."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    hook = fh.grad_hook(stats=("norm",), backend=backend)
    hook.register(model)
    x = torch.randn(8, 64)
    for step in range(20):
        model.zero_grad(set_to_none=True)
        (model(x) * (step + 1)).sum().backward()
        fh.clip_grad_norm_(hook, 1e9)
        model.zero_grad(set_to_none=True)
        with hook.paused():
            (model(x) * (step + 7) ** 2).sum().backward()
        reference = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        for r, p in zip(reference, model.parameters()):
            r.grad = p.grad.clone()
        expected = torch.nn.utils.clip_grad_norm_(reference, 1.0)
        total = fh.clip_grad_norm_(hook, 1.0)
        torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
        for r, p in zip(reference, model.parameters()):
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)


def test_another_gradient_tensor_at_the_measured_address_and_version_is_not_the_measured_one(backend):
    """The allocator's reuse made deterministic: a new gradient tensor over the same memory, at the version the
    measured one had, holding other values."""
    p = torch.zeros(100, requires_grad=True)
    hook = fh.grad_hook(lambda grad: grad * 1.0, stats=("norm",), backend=backend)
    hook.register([p])
    (p * 3.0).sum().backward()
    old = p.grad
    version = old._version
    with torch.no_grad():
        old.copy_(torch.arange(100.0))
    new = torch.empty(0).set_(old.untyped_storage(), old.storage_offset(), old.shape, old.stride())
    assert new.data_ptr() == old.data_ptr() and new._version == version
    p.grad = new
    total = fh.clip_grad_norm_(hook, 1e9)
    torch.testing.assert_close(total, torch.linalg.vector_norm(torch.arange(100.0)), rtol=1e-6, atol=0)


def test_max_norm_inf_bumps_versions_as_mul_and_a_second_call_reads_no_gradient(backend, monkeypatch):
    params = make_params([(97,), (13, 7)])
    hook = hooked(params, backend)
    backward_with(params, random_grads(params))
    values = [p.grad.clone() for p in params]
    versions = [p.grad._version for p in params]
    first = fh.clip_grad_norm_(hook, INF)
    assert [p.grad._version for p in params] == [v + 1 for v in versions]  # as torch's _foreach_mul_ bumps them
    for p, v in zip(params, values):
        assert_same_values(p.grad, v)  # the coefficient is 1
    reads = count_calls(monkeypatch, torch.linalg, "vector_norm")
    second = fh.clip_grad_norm_(hook, INF)
    assert torch.equal(first, second)
    assert not [args for args in reads if args[0].numel() > 2], "a gradient was read again"
    expected, _ = torch_clip(params, INF)
    torch.testing.assert_close(second, expected, rtol=1e-6, atol=0)


def test_another_hook_sharing_a_parameter_sees_the_nan_of_a_max_norm_inf_clip(backend):
    """One hook's clip with max_norm=inf and an infinite total norm makes every gradient NaN: a second hook
    registered on one of those parameters must not take its own recorded (finite) norm for it."""
    a, b = make_params([(5,), (3,)])
    whole = hooked([a, b], backend)
    part = hooked([b], backend)
    backward_with([a, b], [torch.tensor([1.0, INF, 0.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 3.0])])
    fh.clip_grad_norm_(whole, INF)
    assert torch.isnan(b.grad).all()
    expected_total, expected = torch_clip([b], 1.0)
    total = fh.clip_grad_norm_(part, 1.0)
    assert math.isnan(expected_total.item())
    assert_same_values(total, expected_total)
    assert_same_values(b.grad, expected[0])


def test_grad_given_other_storage_through_data_is_measured_again(backend):
    """`p.grad.data = t` keeps the gradient's tensor object and version counter: its new storage tells."""
    params = make_params([(5,), (3,)])
    hook = hooked(params, backend)
    backward_with(params, random_grads(params))
    version = params[0].grad._version
    params[0].grad.data = params[0].grad.data * 3.0
    assert params[0].grad._version == version
    expected_total, expected = torch_clip(params, 1.0)
    total = fh.clip_grad_norm_(hook, 1.0)
    assert_matches_torch(total, expected_total, params, expected, exact=False)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_max_norm_inf_with_a_nonfinite_norm_then_a_second_call_is_torch_s(backend):
    """torch: max_norm=inf with an infinite total norm multiplies every gradient by inf/inf = NaN; a second
    call then measures NaN gradients. Without a re-read, the recorded norms times that NaN give the same."""
    params = make_params([(97,), (13,)])
    hook = hooked(params, backend)
    grads = random_grads(params)
    grads[0][3] = INF
    backward_with(params, grads)
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(clones, params):
        c.grad = p.grad.clone()
    for _ in range(2):
        expected = torch.nn.utils.clip_grad_norm_(clones, INF)
        total = fh.clip_grad_norm_(hook, INF)
        assert_same_values(total, expected)
        for p, c in zip(params, clones):
            assert_same_values(p.grad, c.grad)
    assert math.isnan(total.item())


def test_clipping_twice_with_a_finite_max_norm_recomputes_the_scaled_norms(backend):
    params = make_params([(97,), (13,)])
    hook = hooked(params, backend)
    backward_with(params, random_grads(params, scale=10.0))
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(clones, params):
        c.grad = p.grad.clone()
    for _ in range(2):
        expected = torch.nn.utils.clip_grad_norm_(clones, 1.0)
        total = fh.clip_grad_norm_(hook, 1.0)
        torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
