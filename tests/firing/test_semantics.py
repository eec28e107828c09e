"""Torch's hook semantics kept by compiled hooks: order, a backward that raises, threads, remove() during
backward, create_graph=True, dead registrations, stale rows; each also with explicit buckets."""

import gc
import threading
import warnings

import pytest
import torch

import fusedhooks as fh
from fusedhooks.runtime import launcher as runtime

#: registration forms: the default (each gradient at its own firing) and explicit end-of-backward buckets
MODES = {"default": {}, "buckets": {"bucket_mb": 25}}


def clip_body(grad):
    return grad.clamp(-0.125, 0.125)


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 6, generator=g) * 4, torch.randn(16, 3, generator=g)


def loss_of(model, data):
    x, y = data
    return ((model(x) - y) ** 2).sum() * 10


def serialize_launches(monkeypatch):
    """The Triton interpreter crashes when two threads launch at the same moment: one launch at a time."""
    lock = threading.Lock()
    launch = runtime.launch

    def locked(*args, **kwargs):
        with lock:
            launch(*args, **kwargs)

    monkeypatch.setattr(runtime, "launch", locked)


# --- order -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_optimizer_in_backward_steps_on_the_clipped_gradient(backend, mode):
    """The optimizer-in-backward recipe: a per-parameter Adam step in a post-accumulate hook registered after
    the clip hook. It must step on the clipped gradient, as the plain loop (clip, then Adam) does."""
    model, plain = mlp(), mlp()
    plain.load_state_dict(model.state_dict())
    hook = fh.grad_hook(clip_body, stats=("absmax",), backend=backend)
    hook.register(model, **MODES[mode])
    optims = {p: torch.optim.Adam([p], lr=1e-2) for p in model.parameters()}
    seen = []

    def step(p):
        seen.append(p.grad.abs().max().item())
        optims[p].step()
        optims[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    data = batch()
    for _ in range(5):
        loss_of(model, data).backward()
        loss_of(plain, data).backward()
        for p in plain.parameters():
            p.grad.clamp_(-0.125, 0.125)
        plain_opt.step()
        plain_opt.zero_grad()
    assert max(seen) <= 0.125
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p, q)
    assert len(hook.stats.read()) == 4


def test_explicit_buckets_still_process_a_tensor_with_a_later_hook_at_its_firing(monkeypatch):
    model = mlp()
    hook = fh.grad_hook(clip_body, backend="triton")
    hook.register(model, bucket_mb=25)
    weight = model[0].weight
    seen = {}

    def later(p):
        seen["max"] = p.grad.abs().max().item()

    weight.register_post_accumulate_grad_hook(later)
    loss_of(model, batch()).backward()
    assert seen["max"] <= 0.125                       # processed before the later hook ran
    assert all(p.grad.abs().max() <= 0.125 for p in model.parameters())


# --- a backward that raises ----------------------------------------------------------------------------

class NaNGuard(Exception):
    pass


@pytest.mark.parametrize("mode", MODES)
def test_a_backward_that_raises_leaves_nothing_behind(backend, mode):
    model, other = mlp(), torch.nn.Linear(6, 3)
    hook = fh.grad_hook(clip_body, stats=("absmax",), backend=backend)
    hook.register(model, **MODES[mode])
    raising = [True]

    def guard(p):   # a NaN guard on another module, raising during the first backward only
        if raising[0]:
            raise NaNGuard()

    other.weight.register_post_accumulate_grad_hook(guard)
    x, y = batch()
    with pytest.raises(NaNGuard):
        (loss_of(model, (x, y)) + other(x).sum()).backward()
    raising[0] = False
    for _ in range(3):
        model.zero_grad()
        (loss_of(model, (x, y)) + other(x).sum()).backward()
        assert all(p.grad.abs().max() <= 0.125 for p in model.parameters())
        assert all(row["absmax"] <= 0.125 and row.fresh for row in hook.stats.read().values())


@pytest.mark.parametrize("mode", MODES)
def test_a_firing_that_raises_does_not_mark_its_row_written(backend, mode):
    """A body that raises at its firing writes no statistics: its row keeps its values and is stale, like that of
    a parameter the failed backward did not reach."""
    scale = torch.tensor(2.0)
    hook = fh.grad_hook(lambda grad: grad * scale, stats=("sum",), backend=backend)
    w, v = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    hook.register([("w", w), ("v", v)], **MODES[mode])
    (w.sum() + v.sum()).backward()
    w.grad = v.grad = None
    scale.data = torch.tensor([1.0, 2.0, 3.0, 4.0])  # the body cannot broadcast it: its firing raises
    with pytest.raises(Exception):  # noqa: B017  (the backend's own broadcasting error)
        (w.sum() * 5 + v.sum() * 5).backward()
    stats = hook.stats.read()
    assert stats["w"] == stats["v"] == {"sum": 6.0}  # the first backward's
    assert stats["w"].fresh == stats["v"].fresh


def test_paused_blocks_overlapping_in_two_threads_pause_until_the_last_ends():
    hook = fh.grad_hook(lambda grad: grad * 0.5)
    w = torch.ones(3, requires_grad=True)
    hook.register(w)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with hook.paused():
            a_in.set()
            assert b_in.wait(30)
        a_out.set()

    def b():
        assert a_in.wait(30)
        with hook.paused():
            b_in.set()
            assert a_out.wait(30)
            (w * 2).sum().backward()  # A's block has ended, B's has not: still paused
            seen["inside"] = w.grad.clone()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert torch.equal(seen["inside"], torch.full((3,), 2.0))
    w.grad = None
    (w * 2).sum().backward()  # every block has ended
    assert torch.equal(w.grad, torch.ones(3))


# --- threads ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_concurrent_backwards_in_two_threads_are_independent(backend, mode, monkeypatch):
    """One hook on two models; thread B runs its whole backward while thread A's backward is paused half-way
    (after its last layer's gradients fired). Each thread's gradients are final when its backward returns."""
    serialize_launches(monkeypatch)
    models = [mlp(0), mlp(1)]
    hook = fh.grad_hook(clip_body, stats=("absmax",), backend=backend)
    for i, m in enumerate(models):
        hook.register(m, name=f"m{i}", **MODES[mode])
    a_paused, b_done = threading.Event(), threading.Event()
    results, errors = {}, []

    def pause(grad):
        a_paused.set()
        assert b_done.wait(timeout=60)

    def run(i):
        try:
            x, y = batch(i)
            model = models[i]
            hidden = torch.tanh(model[0](x))
            if i == 0:   # runs after model[2]'s gradients fired, before model[0]'s: wait for thread B
                hidden.register_hook(pause)
            else:
                assert a_paused.wait(timeout=60)
            loss = ((model[2](hidden) - y) ** 2).sum() * 10
            loss.backward()
            results[i] = max(p.grad.abs().max().item() for p in model.parameters())
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
        finally:
            if i == 1:
                b_done.set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a backward hung"
    assert not errors, errors
    assert results[0] <= 0.125 and results[1] <= 0.125, results
    reading = hook.stats.read()
    assert len(reading) == 8
    assert reading.stale == []  # overlapping backwards count as one: each thread's rows are fresh


def test_first_firings_in_two_threads_register_each_tensor_once(monkeypatch):
    """A hook attached through torch directly (`p.register_post_accumulate_grad_hook(hook)`) registers each tensor at
    its first firing; two threads' first backwards at once give every tensor one row, holding its own norm."""
    serialize_launches(monkeypatch)
    hook = fh.grad_hook(stats=("norm",))
    models = [torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(12)]) for _ in range(2)]
    for m in models:
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(hook)
    start, errors = threading.Barrier(2), []

    def run(model):
        try:
            start.wait(timeout=60)
            model(torch.ones(2, 4)).sum().backward()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a backward hung"
    assert not errors, errors
    params = [p for m in models for p in m.parameters()]
    assert len(hook.stats.names) == len(set(hook.stats.names)) == len(params) == hook.stats.tensor.shape[0]
    reading = hook.stats.read()
    for p in params:
        torch.testing.assert_close(reading[hook.registry.get(p).name]["norm"],
                                   torch.linalg.vector_norm(p.grad.double()).item(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_a_registration_while_a_firing_writes_its_row_keeps_the_row(backend, mode, monkeypatch):
    """Another thread registering a tensor grows the statistics buffer (a new tensor); a firing that was writing its
    row into the old one at that moment still has its statistics in the new one (here the registration runs right
    before each launch, once the firing holds the row it writes)."""
    model = mlp()
    hook = fh.grad_hook(stats=("norm",), backend=backend)
    hook.register(model, **MODES[mode])
    extra = iter([torch.zeros(3, requires_grad=True) for _ in range(16)])

    def growing(launch):
        def launch_after_a_registration(*args, **kwargs):
            hook.register(next(extra))  # after the row to write was taken, before the kernel writes it
            launch(*args, **kwargs)
        return launch_after_a_registration

    monkeypatch.setattr(runtime, "fire", growing(runtime.fire))
    monkeypatch.setattr(runtime, "fire_bucket", growing(runtime.fire_bucket))
    loss_of(model, batch()).backward()
    monkeypatch.undo()
    assert len(hook.stats.names) > 4  # the buffer grew during backward
    reading = hook.stats.read()
    for name, p in model.named_parameters():
        torch.testing.assert_close(reading[name]["norm"], torch.linalg.vector_norm(p.grad.double()).item(),
                                   rtol=1e-6, atol=0)


@pytest.mark.parametrize("copy_of", ["deepcopy", "pickle"])
def test_a_copy_of_a_registered_model_is_not_registered(backend, copy_of):
    """torch does not copy a tensor's hooks (deepcopy, pickle, torch.save): the copy of a registered module is an
    unregistered module, and the original keeps its registration."""
    import copy
    import pickle

    model = mlp()
    hook = fh.grad_hook(clip_body, stats=("norm",), backend=backend)
    hook.register(model)
    clone = copy.deepcopy(model) if copy_of == "deepcopy" else pickle.loads(pickle.dumps(model))
    loss_of(clone, batch()).backward()
    assert hook.stats.read() == {}
    assert any(p.grad.abs().max() > 0.125 for p in clone.parameters())  # not clipped
    loss_of(model, batch()).backward()
    assert sorted(hook.stats.read()) == sorted(n for n, _ in model.named_parameters())
    assert all(p.grad.abs().max() <= 0.125 for p in model.parameters())


def test_remove_drops_every_reference_to_the_tensors_at_once(backend):
    """After handle.remove() fusedhooks holds no weak reference to the tensors (torch.utils.swap_tensors refuses a
    tensor that has one), without waiting for the garbage collector."""
    import weakref

    model = mlp()
    hook = fh.grad_hook(clip_body, stats=("norm",), backend=backend)
    handle = hook.register(model)
    loss_of(model, batch()).backward()
    assert all(weakref.getweakrefcount(p) for p in model.parameters())
    gc.disable()
    try:
        handle.remove()
        assert [weakref.getweakrefcount(p) for p in model.parameters()] == [0] * 4
    finally:
        gc.enable()


# --- remove() during backward ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_remove_during_backward_stops_later_firings_only(backend, mode):
    """model[2]'s gradients fire first; a hook on the hidden activation (run before model[0]'s gradients)
    removes the registration. Like an eager hook: model[2] clipped, model[0] not."""
    model = mlp()
    hook = fh.grad_hook(clip_body, backend=backend)
    handle = hook.register(model, **MODES[mode])
    x, y = batch()
    hidden = torch.tanh(model[0](x))
    hidden.register_hook(lambda g: handle.remove())
    (((model[2](hidden) - y) ** 2).sum() * 10).backward()
    assert model[2].weight.grad.abs().max() <= 0.125 and model[2].bias.grad.abs().max() <= 0.125
    assert model[0].weight.grad.abs().max() > 0.125
    model.zero_grad()
    loss_of(model, (x, y)).backward()
    assert model[2].weight.grad.abs().max() > 0.125       # removed for good


# --- create_graph=True -----------------------------------------------------------------------------------

@pytest.mark.parametrize("register", ["tensor", "module", "buckets"])
def test_create_graph_runs_the_body_as_autograd_visible_ops(backend, register):
    p = torch.tensor([1.0, 2.0, -3.0], requires_grad=True)
    eager = p.detach().clone().requires_grad_(True)
    hook = fh.grad_hook(lambda grad: grad * 2, stats=("norm",), backend=backend)
    if register == "tensor":
        hook.register(p)
    else:
        holder = torch.nn.Module()
        holder.p = torch.nn.Parameter(p.detach().clone())
        p = holder.p
        hook.register(holder, bucket_mb=25 if register == "buckets" else None)
    def eager_hook(t):
        t.grad.mul_(2)

    eager.register_post_accumulate_grad_hook(eager_hook)
    with warnings.catch_warnings():   # torch warns (once) that create_graph makes a reference cycle
        warnings.simplefilter("ignore")
        (p ** 3).sum().backward(create_graph=True)
        (eager ** 3).sum().backward(create_graph=True)
    assert torch.equal(p.grad.detach(), eager.grad.detach())
    (second,) = torch.autograd.grad(p.grad.sum(), p)
    (expected,) = torch.autograd.grad(eager.grad.sum(), eager)
    assert torch.equal(second, expected) and second.tolist() == [12.0, 24.0, -36.0]
    assert hook.stats.read()[next(iter(hook.stats.read()))]["norm"] == pytest.approx(eager.grad.norm().item())
    p.grad = eager.grad = None  # break the parameter <-> gradient cycle create_graph makes


@pytest.mark.parametrize("register", ["torch", "module", "buckets"])
@pytest.mark.parametrize("reads", ["param", "closure"])
def test_create_graph_records_a_body_reading_a_tensor_that_requires_grad(backend, register, reads):
    """The loss is linear in v, so v's accumulated gradient does not require grad; the body reads a tensor that
    does (the parameter, or a closed-over tensor), so an eager hook's result does, and second-order gradients
    flow through the body."""
    factor = torch.tensor(0.1, requires_grad=True)

    def body(grad, param):
        return grad + param * 0.1 if reads == "param" else grad + factor

    def run(use_fusedhooks):
        torch.manual_seed(0)
        holder = torch.nn.Module()
        holder.v = torch.nn.Parameter(torch.randn(3))
        x = torch.randn(3)
        if not use_fusedhooks:
            def eager_hook(p):
                p.grad.copy_(body(p.grad, p))

            holder.v.register_post_accumulate_grad_hook(eager_hook)
        else:
            hook = fh.grad_hook(body, stats=("norm",), backend=backend)
            if register == "torch":
                holder.v.register_post_accumulate_grad_hook(hook)
            else:
                hook.register(holder, bucket_mb=25 if register == "buckets" else None)
        with warnings.catch_warnings():   # torch warns (once) that create_graph makes a reference cycle
            warnings.simplefilter("ignore")
            (x * holder.v).sum().backward(create_graph=True)
        grad = holder.v.grad
        inputs = [holder.v] if reads == "param" else [factor]
        (second,) = torch.autograd.grad((grad ** 2).sum(), inputs)
        holder.v.grad = None
        return grad.detach(), second

    (expected_grad, expected_second), (grad, second) = run(False), run(True)
    assert torch.equal(grad, expected_grad)
    assert torch.equal(second, expected_second) and second.abs().sum() > 0


def clamp_in_place(grad):
    grad.clamp_(-5.0, 5.0)


def clamp_scaled(grad):
    return grad.clamp(-5.0, 5.0) * 2


def clamp_then_halve(grad):
    grad.clamp_(-5.0, 5.0).mul_(0.5)


def times_param_clamped(grad, param):
    grad.mul_(param).clamp_(-5.0, 5.0)


#: name -> (body, grad_hook options, whether it returns its result, |.grad| where it clamps); each body saves the
#: gradient it reads for its backward (clamp's mask, mul's other factor), which writing the result into .grad must
#: not overwrite
CREATE_GRAPH_BODIES = {
    "in_place": (clamp_in_place, {}, False, 5.0),
    "out_of_place": (clamp_scaled, {}, True, 10.0),
    "stats": (clamp_then_halve, {"stats": ("norm", "std", "nan"), "input_stats": ("absmax",)}, False, 2.5),
    "reads_param": (times_param_clamped, {}, False, 5.0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("body_name", CREATE_GRAPH_BODIES)
@pytest.mark.parametrize("register", ["module", "list", "tensor", "torch", "buckets"])
def test_create_graph_second_order_gradients_match_an_eager_hook(backend, register, body_name, dtype):
    """backward(create_graph=True), then a second differentiation through the processed `.grad`: the values of
    `.grad` and of the second-order gradients are those of per-parameter eager hooks. An in-place body is the eager
    hook `body(p.grad)`; a body returning its result is `p.grad = body(p.grad)` (copying it into p.grad, the
    README's equivalent, would overwrite the gradient clamp's backward saved: torch raises there)."""
    body, options, returns, clamped = CREATE_GRAPH_BODIES[body_name]
    reads_param = body is times_param_clamped

    def eager_hook(p):
        args = (p.grad, p) if reads_param else (p.grad,)
        if returns:
            p.grad = body(*args)
        else:
            body(*args)

    def run(use_fusedhooks):
        torch.manual_seed(0)
        a = torch.nn.Parameter((torch.randn(7) * 1.5).to(dtype))      # 3 a**2 beyond 5 for some entries
        b = torch.nn.Parameter((torch.randn(3, 5) * 1.5).to(dtype))
        accumulated = {}  # id(parameter) -> (data_ptr, a copy) of .grad as accumulated

        def note_accumulated(p):
            accumulated[id(p)] = p.grad.data_ptr(), p.grad.detach().clone()

        for p in (a, b):  # registered first: it runs before any hook processes .grad
            p.register_post_accumulate_grad_hook(note_accumulated)
        hook = None
        if not use_fusedhooks:
            for p in (a, b):
                p.register_post_accumulate_grad_hook(eager_hook)
        else:
            hook = fh.grad_hook(body, backend=backend, **options)
            if register in ("module", "buckets"):
                holder = torch.nn.Module()
                holder.a, holder.b = a, b
                hook.register(holder, bucket_mb=25 if register == "buckets" else None)
            elif register == "list":
                hook.register([a, b])
            elif register == "tensor":
                hook.register(a)
                hook.register(b)
            else:
                a.register_post_accumulate_grad_hook(hook)
                b.register_post_accumulate_grad_hook(hook)
        with warnings.catch_warnings():   # torch warns (once) that create_graph makes a reference cycle
            warnings.simplefilter("ignore")
            ((a ** 3).sum() + (b ** 3).sum()).backward(create_graph=True)
        assert a.grad.requires_grad and b.grad.requires_grad
        if use_fusedhooks and not returns:
            assert [accumulated[id(p)][0] for p in (a, b)] == [a.grad.data_ptr(), b.grad.data_ptr()]  # in place
        second = torch.autograd.grad((a.grad.float() ** 2).sum() + b.grad.sum(), [a, b])
        grads = (a.grad.detach(), b.grad.detach())
        a.grad = b.grad = None  # break the parameter <-> gradient cycle create_graph makes
        names = [hook.registry.get(p).name for p in (a, b)] if hook is not None else None
        return grads, second, hook, [accumulated[id(p)][1] for p in (a, b)], names

    (expected_grads, expected_second, *_), (grads, second, hook, inputs, names) = run(False), run(True)
    for got, expected in zip(grads + second, expected_grads + expected_second):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert all(s.abs().sum() > 0 for s in second)
    assert all((g.abs() == clamped).any() and (g.abs() < clamped).any() for g in expected_grads)  # clamp: both sides
    if options:
        assert not hook.stats.tensor.requires_grad
        read = hook.stats.read()
        for name, grad, accumulated_grad in zip(names, expected_grads, inputs):
            g64 = grad.double()
            want = {"norm": torch.linalg.vector_norm(g64), "std": g64.std(), "nan": 0,
                    "input.absmax": accumulated_grad.double().abs().max()}
            for stat, value in want.items():
                assert read[name][stat] == pytest.approx(float(value), rel=1e-12, abs=1e-12), (name, stat)


def test_create_graph_in_place_body_eager_autograd_refuses_gives_its_out_of_place_values(backend):
    """`grad.clamp_(-5, 5).add_(grad.square())`: square saves the gradient that add_ then overwrites, so a second
    differentiation through the eager hook raises; the compiled hook's body reads a copy of .grad and gives the
    values of the out-of-place form `c = grad.clamp(-5, 5); c + c.square()` (README, "create_graph")."""
    def body(grad):
        grad.clamp_(-5.0, 5.0).add_(grad.square())

    def run(make_hook):
        torch.manual_seed(0)
        a, b = torch.nn.Parameter(torch.randn(5) * 1.5), torch.nn.Parameter(torch.randn(2, 3) * 1.5)
        make_hook([a, b])
        with warnings.catch_warnings():   # torch warns (once) that create_graph makes a reference cycle
            warnings.simplefilter("ignore")
            ((a ** 3).sum() + (b ** 3).sum()).backward(create_graph=True)
        try:
            return (a.grad.detach(), b.grad.detach()) + torch.autograd.grad((a.grad ** 2).sum() + b.grad.sum(), [a, b])
        finally:
            a.grad = b.grad = None  # break the parameter <-> gradient cycle create_graph makes

    def eager_in_place(params):
        for p in params:
            p.register_post_accumulate_grad_hook(lambda p: body(p.grad))

    def eager_out_of_place(params):
        def hook(p):
            clamped = p.grad.clamp(-5.0, 5.0)
            p.grad = clamped + clamped.square()

        for p in params:
            p.register_post_accumulate_grad_hook(hook)

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(eager_in_place)
    expected = run(eager_out_of_place)
    got = run(fh.grad_hook(body, backend=backend).register)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    assert all(g.abs().sum() > 0 for g in got) and (got[0] == 30.0).any()  # (clamped to 5: 5 + 25)


# --- dead registrations ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_registrations_of_collected_models_are_released(backend, mode):
    hook = fh.grad_hook(clip_body, stats=("absmax",), backend=backend)
    model = mlp()
    hook.register(model, **MODES[mode])
    loss_of(model, batch()).backward()
    del model
    gc.collect()
    assert len(hook.registry) == 0
    fresh = mlp(3)
    handle = hook.register(fresh, **MODES[mode])
    assert len(handle) == 4
    assert hook.stats.read() == {}              # the names' old rows were cleared for the new tensors
    loss_of(fresh, batch()).backward()
    assert all(p.grad.abs().max() <= 0.125 for p in fresh.parameters())
    assert sorted(hook.stats.read()) == sorted(n for n, _ in fresh.named_parameters())


def test_failed_register_in_the_middle_registers_nothing():
    hook = fh.grad_hook(clip_body, stats=("absmax",))
    good = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="meta tensor"):
        hook.register([("good", good), ("bad", torch.zeros(3, device="meta", requires_grad=True))])
    assert len(hook.registry) == 0 and not good._post_accumulate_grad_hooks
    hook.register(good, name="good")


def test_adaptive_clip_registers_again_after_remove(backend):
    clip = fh.adaptive_clip(warmup_steps=1, backend=backend)
    model = mlp()
    handle = clip.register(model)
    loss_of(model, batch()).backward()
    assert set(clip.read()) == {n for n, _ in model.named_parameters()}
    handle.remove()
    assert clip.read() == {}
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    handle = clip.register(model)                  # the same module again
    model.zero_grad()
    loss_of(model, batch()).backward()
    assert all(row["step"] == 1 for row in clip.read().values())


# --- stale rows ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_read_tells_which_rows_the_last_backward_wrote(backend, mode):
    model = mlp()
    hook = fh.grad_hook(stats=("norm",), backend=backend)
    hook.register(model, **MODES[mode])
    x, y = batch()
    loss_of(model, (x, y)).backward()
    first = hook.stats.read()
    assert first.stale == [] and all(row.fresh for row in first.values())
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        hidden = torch.tanh(model[0](x))           # model[0] gets no gradient this step
    ((model[2](hidden) - y) ** 2).sum().backward()
    second = hook.stats.read()
    assert sorted(second.stale) == ["0.bias", "0.weight"]
    assert not second["0.weight"].fresh and second["2.weight"].fresh
    assert second["0.weight"] == first["0.weight"]   # still there, marked stale
    with hook.paused():                             # a backward in which the hook did not fire changes nothing
        loss_of(model, (x, y)).backward()
    assert sorted(hook.stats.read().stale) == ["0.bias", "0.weight"]


@pytest.mark.parametrize("mode", MODES)
def test_rows_written_in_a_reentrant_checkpoints_nested_backward_are_fresh(backend, mode):
    """The nested backward of reentrant activation checkpointing belongs to the outer one: after each backward,
    every row is fresh, so to_scalars() keeps the checkpointed layer's statistics."""
    from torch.utils.checkpoint import checkpoint

    model = mlp()
    hook = fh.grad_hook(stats=("norm",), backend=backend)
    hook.register(model, **MODES[mode])
    x, y = batch()
    x.requires_grad_()  # (a reentrant checkpoint whose inputs need no gradient gives its parameters none)
    for _ in range(2):
        model.zero_grad()
        hidden = checkpoint(lambda t: torch.tanh(model[0](t)), x, use_reentrant=True)
        ((model[2](hidden) - y) ** 2).sum().backward()
        reading = hook.stats.read()
        assert sorted(reading) == sorted(n for n, _ in model.named_parameters())
        assert reading.stale == []
        assert {k.split("/")[1] for k in hook.stats.to_scalars()} == set(reading)
    for name, p in model.named_parameters():
        torch.testing.assert_close(reading[name]["norm"], torch.linalg.vector_norm(p.grad.double()).item(),
                                   rtol=1e-6, atol=0)


def test_a_firing_in_another_thread_between_two_passes_does_not_disturb_them(monkeypatch):
    """(Triton backend: the reference has no passes.) A two-pass body (the norm, then the scale) in thread A is
    held between its passes while thread B fires the same hook on another gradient: each thread has its own
    workspace, so A's second pass reads A's norm."""
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", "128")     # 1000 elements: several programs, two passes
    hook = fh.grad_hook(lambda grad: grad / grad.norm(), stats=("norm",), backend="triton")
    assert hook.plan(numel=1000, device="cpu").passes == 2
    a, b = torch.zeros(1000, requires_grad=True), torch.zeros(1000, requires_grad=True)
    hook.register([("a", a), ("b", b)])
    a.grad, b.grad = torch.linspace(-1, 1, 1000), torch.linspace(0, 1000, 1000)
    expected_a, expected_b = a.grad / a.grad.norm(), b.grad / b.grad.norm()
    a_between, b_done = threading.Event(), threading.Event()
    launch = runtime.launch
    a_thread = []

    def holding_launch(*args, **kwargs):
        launch(*args, **kwargs)
        if threading.current_thread() in a_thread and not a_between.is_set():
            a_between.set()                       # A's first pass is done: let B fire, then go on
            assert b_done.wait(timeout=60)

    monkeypatch.setattr(runtime, "launch", holding_launch)
    errors = []

    def fire_b():
        try:
            assert a_between.wait(timeout=60)
            hook(b)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
        finally:
            b_done.set()

    thread_b = threading.Thread(target=fire_b)
    thread_a = threading.Thread(target=lambda: hook(a))
    a_thread.append(thread_a)
    thread_b.start()
    thread_a.start()
    thread_a.join(timeout=120)
    thread_b.join(timeout=120)
    assert not thread_a.is_alive() and not thread_b.is_alive(), "a firing hung"
    assert not errors, errors
    torch.testing.assert_close(a.grad, expected_a, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(b.grad, expected_b, rtol=1e-5, atol=1e-7)
