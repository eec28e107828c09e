"""What each rank runs in tests/registration/test_distributed.py (a module of its own: spawned processes import it).

Each worker checks its rank's results against a plain-torch reference built on the same rank (an unwrapped
copy of the model, gradients averaged with `dist.all_reduce`) and raises AssertionError on any difference.
"""

import contextlib
import copy
import datetime
import functools
import math
import os
import warnings

import torch
import torch.distributed as dist

from helpers import check_stats, timm_agc_

STATS = ("count", "sum", "mean", "sumsq", "norm", "var", "std", "min", "max", "absmax", "nan", "inf", "zeros")
INPUT_STATS = ("count", "mean", "norm", "var", "std", "min", "max", "absmax")
CLAMP = 0.01


def init_and_run(rank: int, fn, world: int, port: int, backend: str, args: tuple) -> None:
    """The entry point of every spawned rank: join the process group, run `fn`, leave."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    try:
        fn(rank, world, device, *args)
    finally:
        dist.destroy_process_group()
    # gloo with a communication hook can abort at interpreter exit ("terminate called without an active
    # exception", also without fusedhooks): a rank that passed leaves without running C++ destructors
    os._exit(0)


def _mlp(device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 8),
                               torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(device)


def _batch(rank: int, step: int, micro: int, features: int, device) -> torch.Tensor:
    """Different data on every rank, step and micro-batch."""
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return (torch.randn(6, features, generator=g) * 3).to(device)


def _loss(model, x) -> torch.Tensor:
    return model(x).square().sum() * 10


def _averaged(grad: torch.Tensor, world: int) -> torch.Tensor:
    """The mean of the ranks' `grad`, as DDP computes it (divide, then sum)."""
    out = grad / world
    dist.all_reduce(out)
    return out


def _hist_of(x: torch.Tensor, hist_range) -> list[int]:
    from fusedhooks.runtime.reference import histogram

    return [int(v) for v in histogram(x, hist_range).tolist()]


def _check_clip(hook, params, grads_before, norm_type, max_norm=0.02) -> None:
    """fh.clip_grad_norm_ == torch's clip_grad_norm_ on the same gradients (torch's on copies)."""
    import fusedhooks as fh

    copies = []
    for g in grads_before:
        t = torch.zeros_like(g, requires_grad=True)
        t.grad = g.clone()
        copies.append(t)
    expected = torch.nn.utils.clip_grad_norm_(copies, max_norm, norm_type)
    total = fh.clip_grad_norm_(hook, max_norm, norm_type)
    assert torch.allclose(total, expected, rtol=1e-6, atol=0), (norm_type, total, expected)
    for p, c in zip(params, copies):
        assert torch.allclose(p.grad, c.grad, rtol=1e-6, atol=1e-12), norm_type


# --- DDP -----------------------------------------------------------------------------------------------

def ddp_averaged(rank: int, world: int, device) -> None:
    """register(ddp_model): clamp + all statistics of the averaged gradient, several buckets, both
    gradient_as_bucket_view settings, a no_sync() micro-batch; then fh.clip_grad_norm_ against torch's."""
    import fusedhooks as fh
    from fusedhooks.runtime import launcher as runtime

    launches = []
    fire_bucket = runtime.fire_bucket

    def counting(plan, *args, **kwargs):
        launches.append(plan)
        return fire_bucket(plan, *args, **kwargs)

    runtime.fire_bucket = counting
    # several buckets: per-bucket caps (DDP rebuilds its buckets after the first iteration), or
    # find_unused_parameters (which keeps them)
    configs = ((False, {"bucket_cap_mb_list": [0.001] * 8}), (True, {"bucket_cap_mb": 0.001,
                                                                       "find_unused_parameters": True}))
    for view, options in configs:
        model = _mlp(device)
        ref = copy.deepcopy(model)
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=view, **options)
        hook = fh.grad_hook(lambda g: g.clamp(-CLAMP, CLAMP), stats=STATS + ("hist",), input_stats=INPUT_STATS)
        handle = hook.register(ddp)
        names = [n for n, _ in model.named_parameters()]
        buckets = []
        for step in range(3):
            launches.clear()
            xs = [_batch(rank, step, k, 16, device) for k in range(2)]
            with ddp.no_sync():
                _loss(ddp, xs[0]).backward()
            assert not launches, "a no_sync() micro-batch must not process anything"
            _loss(ddp, xs[1]).backward()
            for x in xs:
                _loss(ref, x).backward()
            reading = hook.stats.read()
            assert sorted(reading) == sorted(names) and not reading.stale
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                averaged = _averaged(q.grad, world)
                assert torch.equal(p.grad, averaged.clamp(-CLAMP, CLAMP)), (view, step, name)
                check_stats(reading[name], p.grad, STATS)
                check_stats(reading[name], averaged, INPUT_STATS, prefix="input.")
                assert reading[name]["hist"] == _hist_of(p.grad, hook.hist_range)
            gathered = [None] * world
            dist.all_gather_object(gathered, reading)
            assert all(r == gathered[0] for r in gathered), "statistics differ between ranks"
            buckets.append(len(launches))
            params = list(model.parameters())
            before = [p.grad.clone() for p in params]
            _check_clip(hook, params, before, 2.0)
            for p, g in zip(params, before):
                p.grad.copy_(g)
            _check_clip(hook, params, before, math.inf)
            ddp.zero_grad()
            ref.zero_grad()
        assert max(buckets) > 1, f"expected several DDP buckets (one launch each), got {buckets}"
        handle.remove()
        _loss(ddp, _batch(rank, 9, 0, 16, device)).backward()  # after remove(): DDP's plain average
        _loss(ref, _batch(rank, 9, 0, 16, device)).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, _averaged(q.grad, world))
    runtime.fire_bucket = fire_bucket


def ddp_local(rank: int, world: int, device) -> None:
    """A hook on the module DDP wraps (before or after wrapping, per gradient or bucketed): it processes each
    rank's local gradient before DDP averages it, as an eager hook would, and warns once."""
    import fusedhooks as fh

    for view in (False, True):
        for bucket_mb, before_wrap in ((None, False), (25, True)):
            model = _mlp(device)
            ref = copy.deepcopy(model)
            hook = fh.grad_hook(lambda g: g.clamp(-CLAMP, CLAMP), stats=("norm",))
            if before_wrap:
                hook.register(model, bucket_mb=bucket_mb)
            ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=view)
            if not before_wrap:
                hook.register(model, bucket_mb=bucket_mb)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for step in range(2):
                    x = _batch(rank, step, 0, 16, device)
                    _loss(ddp, x).backward()
                    _loss(ref, x).backward()
                    for p, q in zip(model.parameters(), ref.parameters()):
                        assert torch.equal(p.grad, _averaged(q.grad.clamp(-CLAMP, CLAMP), world)), (view, bucket_mb)
                        q.grad = None
                    ddp.zero_grad()
            local = [w for w in caught if issubclass(w.category, fh.LocalGradientWarning)]
            assert len(local) == 1, [str(w.message) for w in caught]
            assert "register(ddp_model)" in str(local[0].message)


def ddp_refusals(rank: int, world: int, device) -> None:
    """register(ddp_model) refuses what it cannot do, with what to do instead."""
    import fusedhooks as fh

    model = _mlp(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    hook = fh.grad_hook(lambda g: g * 2)
    _raises(ValueError, "bucket_cap_mb", lambda: hook.register(ddp, bucket_mb=25))
    _raises(ValueError, "does not take DDP", lambda: hook.register(ddp, optimizer=fh.AdamW(model.parameters())))
    ddp.register_comm_hook(None, lambda state, bucket: torch.futures.Future())
    _raises(RuntimeError, "communication hook", lambda: hook.register(ddp))
    assert len(hook.registry) == 0, "a refused register() must leave nothing registered"
    static = torch.nn.parallel.DistributedDataParallel(_mlp(device), static_graph=True)
    _raises(ValueError, "static_graph", lambda: hook.register(static))

    # a parameter no rank uses keeps no .grad under DDP, and no statistics (no eager hook would fire on it)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(16, 2), "unused": torch.nn.Linear(16, 2)}).to(device)
    model.forward = lambda x: model["used"](x)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    stats_hook = fh.grad_hook(stats=("norm",))
    stats_hook.register(ddp)
    _loss(ddp, _batch(rank, 0, 0, 16, device)).backward()
    assert model["unused"].weight.grad is None
    assert sorted(stats_hook.stats.read()) == ["used.bias", "used.weight"], stats_hook.stats.read()
    total = torch.nn.utils.get_total_norm([p.grad for p in model["used"].parameters()])
    assert torch.allclose(fh.clip_grad_norm_(stats_hook, 1e9), total, rtol=1e-6, atol=0)


def _raises(kind, match: str, call) -> None:
    """call() raises `kind` with `match` in its message (pytest.raises, in a spawned rank)."""
    try:
        call()
    except kind as e:
        assert match in str(e), e
    else:
        raise AssertionError(f"expected {kind.__name__} matching {match!r}")


def ddp_agc(rank: int, world: int, device) -> None:
    """register(ddp_model) with fh.agc (a body planned per shape: rows of each weight, the whole of each bias):
    AGC of the averaged gradient, as timm's formula on the reference's averaged gradient."""
    import fusedhooks as fh

    model = _mlp(device)
    ref = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
    hook = fh.agc(0.01, stats=("norm",))
    hook.register(ddp)
    clipped = 0
    for step in range(3):
        x = _batch(rank, step, 0, 16, device)
        _loss(ddp, x).backward()
        _loss(ref, x).backward()
        for q in ref.parameters():
            q.grad = _averaged(q.grad, world)
        before = [q.grad.clone() for q in ref.parameters()]
        timm_agc_(ref.parameters())
        clipped += sum(not torch.equal(b, q.grad) for b, q in zip(before, ref.parameters()))
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=f"step {step}: {name}")
        ddp.zero_grad()
        ref.zero_grad()
    assert clipped > 0
    assert sorted(hook.stats.read()) == sorted(n for n, _ in model.named_parameters())


def ddp_all(rank: int, world: int, device) -> None:
    """Every DDP check in one group of processes (start-up is the expensive part)."""
    ddp_averaged(rank, world, device)
    ddp_agc(rank, world, device)
    ddp_local(rank, world, device)
    ddp_refusals(rank, world, device)
    ddp_registrations(rank, world, device)


# --- FSDP2 -----------------------------------------------------------------------------------------------

def _fsdp_mlp(device) -> torch.nn.Module:
    """Two rows in the last layer: with 3 ranks one of them holds empty shards."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2)).to(device)


def _shard(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's FSDP2 shard of `full` (torch.chunk along dim 0; ranks past the last chunk hold none)."""
    chunks = torch.chunk(full, world, dim=0)
    return chunks[rank] if rank < len(chunks) else full.new_empty((0,) + full.shape[1:])


def _close_stats(got: dict, x: torch.Tensor, names, prefix: str = "") -> None:
    """Statistics of the reduced gradient before the body, whose bits depend on the reduction order: counts
    exact, values within 1e-5 of the magnitude."""
    from fusedhooks.runtime.reference import tensor_stats

    scale = x.double().abs().sum().item() + 1e-30
    for name, e in zip(names, (v.item() for v in tensor_stats(x, tuple(names)))):
        g = got[prefix + name]
        if name == "count":
            assert g == e, (name, g, e)
        else:
            bound = 1e-5 * (abs(e) + (scale / x.numel() if name in ("mean", "min", "max", "absmax") else 0)) + 1e-12
            if name in ("var", "std", "norm", "sum"):
                bound += 1e-5 * scale * (1 if name == "sum" else 0)
            assert abs(g - e) <= bound, (prefix + name, g, e)


def fsdp_dims(rank: int, world: int, device) -> None:
    """A body reducing over dims other than the sharded one (the rows of each weight, dim 1) runs on each rank's
    shard as on the whole gradient, with whole-parameter statistics; one reducing over the sharded dim (columns, or
    a 1-d bias) is refused at register."""
    from torch.distributed.fsdp import fully_shard

    import fusedhooks as fh

    base = _fsdp_mlp(device)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    fully_shard(model[0])
    fully_shard(model)
    weights = [(n, p) for n, p in model.named_parameters() if p.ndim == 2]
    rows = fh.grad_hook(lambda g: g / (g.norm(dim=-1, keepdim=True) + 1), stats=("norm", "max"))
    rows.register(weights)
    columns = fh.grad_hook(lambda g: g - g.mean(dim=0))
    _raises(fh.CompileError, "along dim 0: each rank holds a part of its gradient, and the body reduces over dim 0 "
            "(`mean`), whose units would be cut by the shards", lambda: columns.register(weights[:1]))
    bias = next((n, p) for n, p in model.named_parameters() if p.ndim == 1)
    _raises(fh.CompileError, "reduces over dim 0 (`norm`)", lambda: rows.register([bias]))
    for step in range(2):
        x = _batch(rank, step, 0, 5, device)
        _loss(model, x).backward()
        _loss(ref, x).backward()
        reading = rows.stats.read()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            expected = _averaged(q.grad, world)
            if p.ndim == 2:
                expected = expected / (expected.norm(dim=-1, keepdim=True) + 1)
                whole = p.grad.full_tensor()
                assert torch.allclose(whole, expected, rtol=1e-5, atol=1e-7), (step, name)
                check_stats(reading[name], whole, ("norm", "max"))
            assert torch.allclose(p.grad.to_local(), _shard(expected, rank, world), rtol=1e-5, atol=1e-7), name
        model.zero_grad()
        ref.zero_grad()


def fsdp(rank: int, world: int, device) -> None:
    with warnings.catch_warnings():
        # a deprecated torch.distributed call (all_gather_into_tensor in torch 2.13) warns on every rank
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        fsdp_dims(rank, world, device)
        fsdp_elementwise(rank, world, device)
        fsdp_registration_windows(rank, world, device)
        fsdp_step_in_backward(rank, world, device)


def fsdp_step_in_backward(rank: int, world: int, device) -> None:
    """register(sharded model, optimizer=fh.AdamW/fh.SGD): each rank steps its shard of each parameter at its firing
    (FSDP2 calls the hooks after its reduce-scatter) and frees the gradient. The parameters equal, bit for bit, those
    of the same FSDP2 model with eager clamp hooks and the same optimizer stepped after the backward (the same
    elementwise kernel on the same shards), and torch's optimizer's within fp32 rounding; the statistics are the
    whole parameters'. Registered with optimizer= before fully_shard, the next forward refuses it (the optimizer
    holds the parameters fully_shard replaced)."""
    from torch.distributed.fsdp import fully_shard

    import fusedhooks as fh

    adamw, sgd = {"lr": 1e-2, "weight_decay": 0.1}, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}
    for ours, theirs, options in ((fh.AdamW, torch.optim.AdamW, adamw), (fh.SGD, torch.optim.SGD, sgd)):
        base = _fsdp_mlp(device)
        model, after, plain = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
        for m in (model, after, plain):
            fully_shard(m[0])
            fully_shard(m)
        opt, after_opt = ours(model.parameters(), **options), ours(after.parameters(), **options)
        torch_opt = theirs(plain.parameters(), foreach=False, **options)
        hook = fh.grad_hook(lambda g: g.clamp(-CLAMP, CLAMP), stats=("norm", "absmax"))
        hook.register(model, optimizer=opt)
        _clamp_eagerly(after, plain)
        for step in range(3):
            x = _batch(rank, step, 0, 5, device)
            _loss(model, x).backward()
            assert all(p.grad is None for p in model.parameters()), "the gradients freed at their firing"
            opt.step()  # steps nothing: every parameter was stepped in the backward
            for m, o in ((after, after_opt), (plain, torch_opt)):
                _loss(m, x).backward()
                if m is after:
                    reading = hook.stats.read()
                    for name, q in after.named_parameters():
                        check_stats(reading[name], q.grad.full_tensor(), ("norm", "absmax"))
                o.step()
                o.zero_grad()
            for (name, p), q, r in zip(model.named_parameters(), after.parameters(), plain.parameters()):
                assert torch.equal(p.to_local(), q.to_local()), (ours.__name__, step, name)
                torch.testing.assert_close(p.to_local(), r.to_local(), msg=f"{ours.__name__} {step} {name}")
    model = _fsdp_mlp(device)
    fh.grad_hook(lambda g: g * 2).register(model, optimizer=fh.AdamW(model.parameters()))
    fully_shard(model)
    _raises(RuntimeError, "Build the optimizer on the sharded parameters and register after fully_shard",
            lambda: model(torch.randn(4, 5, device=device)))


def fsdp_elementwise(rank: int, world: int, device) -> None:
    """FSDP2, hooks registered before and after fully_shard: local shards processed in place (elementwise
    bodies, one reading the parameter), whole-parameter statistics identical on every rank, a
    set_requires_gradient_sync(False) micro-batch, global clipping against torch's (and, for norm inf with an
    empty shard, against the whole gradients), and bodies with whole-tensor reductions refused."""
    from torch.distributed.fsdp import fully_shard

    import fusedhooks as fh

    base = _fsdp_mlp(device)
    ref, model_a, model_b = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    hook_a = fh.grad_hook(lambda g: g.clamp(-CLAMP, CLAMP), stats=STATS + ("hist",),
                          input_stats=INPUT_STATS + ("hist",))
    hook_a.register(model_a)  # before fully_shard: follows the module to its sharded parameters
    for model in (model_a, model_b):
        fully_shard(model[0])
        fully_shard(model)
    hook_b = fh.grad_hook(lambda g, p: (g + 1e-3 * p).clamp(-CLAMP, CLAMP), stats=("norm", "absmax"))
    hook_b.register(model_b, bucket_mb=25)  # sharded gradients are processed at their firing all the same
    scaled = fh.grad_hook(lambda g: g * 2, scaler=torch.amp.GradScaler("cpu"), optimizer=torch.optim.SGD(
        model_b.parameters(), lr=0.1))
    _raises(ValueError, "scaler= is not supported on sharded", lambda: scaled.register(model_b))
    hook_c = fh.grad_hook(lambda g: g / g.norm())  # a whole-tensor reduction would be per shard: refused
    _raises(fh.CompileError, "would be computed per shard", lambda: hook_c.register(model_b))
    names = [n for n, _ in ref.named_parameters()]
    merges = []
    merge = type(hook_a._shards).merge

    def counting(shards, rows_by_group):
        merges.append(len(rows_by_group))  # one all-gather per process group
        return merge(shards, rows_by_group)

    type(hook_a._shards).merge = counting
    for step in range(2):
        merges.clear()
        xs = [_batch(rank, step, k, 5, device) for k in range(2)]
        for model in (model_a, model_b):
            model.set_requires_gradient_sync(False)
            _loss(model, xs[0]).backward()
            model.set_requires_gradient_sync(True)
            _loss(model, xs[1]).backward()
        for x in xs:
            _loss(ref, x).backward()
        assert merges == [1, 1], f"one collective per hook per backward, all parameters together: {merges}"
        reading = hook_a.stats.read()
        assert sorted(reading) == sorted(names) and not reading.stale, reading.keys()
        for (name, pa), pb, q in zip(model_a.named_parameters(), model_b.parameters(), ref.parameters()):
            averaged = _averaged(q.grad, world)
            expected_a = averaged.clamp(-CLAMP, CLAMP)
            expected_b = (averaged + 1e-3 * q.detach()).clamp(-CLAMP, CLAMP)
            local_a, local_b = pa.grad.to_local(), pb.grad.to_local()
            assert torch.allclose(local_a, _shard(expected_a, rank, world), rtol=1e-5, atol=1e-8), name
            assert torch.allclose(local_b, _shard(expected_b, rank, world), rtol=1e-5, atol=1e-8), name
            whole = pa.grad.full_tensor()
            check_stats(reading[name], whole, STATS)
            assert reading[name]["hist"] == _hist_of(whole, hook_a.hist_range), name
            _close_stats(reading[name], averaged, INPUT_STATS, prefix="input.")
            assert sum(reading[name]["input.hist"]) == averaged.numel()
            whole_b = pb.grad.full_tensor()
            check_stats(hook_b.stats.read()[name], whole_b, ("norm", "absmax"))
        gathered = [None] * world
        dist.all_gather_object(gathered, reading)
        assert all(r == gathered[0] for r in gathered), "statistics differ between ranks"

        params = list(model_a.parameters())
        before = [p.grad.to_local().clone() for p in params]
        total = fh.clip_grad_norm_(hook_a, 0.02)
        after = [p.grad.to_local().clone() for p in params]
        for p, g in zip(params, before):
            p.grad.to_local().copy_(g)
        expected = torch.nn.utils.clip_grad_norm_(params, 0.02).full_tensor()  # torch's: a replicated DTensor
        assert torch.allclose(total, expected, rtol=1e-6, atol=0), (total, expected)
        for p, a in zip(params, after):
            assert torch.allclose(p.grad.to_local(), a, rtol=1e-6, atol=1e-12)
        for p, g in zip(params, before):
            p.grad.to_local().copy_(g)
        # changed since measured (copy_ above): norms re-read from the gradients, of the whole parameters
        absmax = max(p.grad.full_tensor().abs().max() for p in params)
        total_inf = fh.clip_grad_norm_(hook_a, 0.02, math.inf)
        assert total_inf.item() == absmax.item(), (total_inf, absmax)
        if world == 2:  # with an empty shard (3 ranks) torch's own inf-norm clip raises on that rank
            for p, g in zip(params, before):
                p.grad.to_local().copy_(g)
            assert torch.equal(torch.nn.utils.clip_grad_norm_(params, 0.02, math.inf).full_tensor(), total_inf)
        for model in (model_a, model_b, ref):
            model.zero_grad()


def fsdp_registration_windows(rank: int, world: int, device) -> None:
    """FSDP2: a hook registered on the root between its forward and backward (it holds unsharded parameters then)
    goes on the sharded ones all the same (each rank's reduced shard, whole-parameter statistics); one registered
    on a submodule before fully_shard of the root (which replaces its parameters without changing its class) is
    refused at the next forward instead of never firing."""
    from torch.distributed.fsdp import fully_shard

    import fusedhooks as fh
    from fusedhooks.runtime.layout import is_dtensor

    base = _fsdp_mlp(device)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    fully_shard(model)
    x = _batch(rank, 0, 0, 5, device)
    loss = _loss(model, x)  # the root keeps its parameters unsharded until backward
    hook = fh.grad_hook(lambda g: g.clamp(-CLAMP, CLAMP), stats=("norm",))
    hook.register(model)
    assert len(hook.registry) == 4 and all(is_dtensor(e.tensor) for e in hook.registry)  # the sharded ones
    loss.backward()
    _loss(ref, x).backward()
    reading = hook.stats.read()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        expected = _averaged(q.grad, world).clamp(-CLAMP, CLAMP)
        assert torch.allclose(p.grad.to_local(), _shard(expected, rank, world), rtol=1e-5, atol=1e-8), name
        assert math.isclose(reading[name]["norm"], p.grad.full_tensor().double().norm().item(), rel_tol=1e-6), name
    gathered = [None] * world
    dist.all_gather_object(gathered, reading)
    assert all(r == gathered[0] for r in gathered), "statistics differ between ranks"

    inner = copy.deepcopy(base)
    before = fh.grad_hook(lambda g: g.clamp(-CLAMP, CLAMP))
    before.register(inner[2])  # a submodule, not itself fully_shard'ed
    fully_shard(inner)
    _raises(RuntimeError, "replaced since", lambda: _loss(inner, x))

    whole = copy.deepcopy(base)
    norm_hook = fh.grad_hook(lambda g: g / g.norm())  # a whole-tensor reduction: refused on sharded parameters
    norm_hook.register(whole)
    fully_shard(whole)
    for _ in range(2):  # at every forward, not only the first: a caught refusal never leaves the hook silent
        _raises(fh.CompileError, "would be computed per shard", lambda: _loss(whole, x))


def ddp_registrations(rank: int, world: int, device) -> None:
    """register(ddp_model): a parameter DDP ignores is processed at its own firing (its gradient is each rank's
    own, which is all DDP gives it), with no LocalGradientWarning; after handle.remove() the model can be registered
    again (DDP keeps its communication hook, which the new registration takes over)."""
    import fusedhooks as fh

    model = _mlp(device)
    ref = copy.deepcopy(model)
    ignored = [n for n, _ in model.named_parameters()][-2:]
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    hook = fh.grad_hook(lambda g: g.clamp(-CLAMP, CLAMP), stats=("norm",))
    with warnings.catch_warnings():
        warnings.simplefilter("error", fh.LocalGradientWarning)
        handle = hook.register(ddp)
        x = _batch(rank, 0, 0, 16, device)
        _loss(ddp, x).backward()
    _loss(ref, x).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        local = q.grad if name in ignored else _averaged(q.grad, world)
        assert torch.allclose(p.grad, local.clamp(-CLAMP, CLAMP), rtol=1e-6, atol=1e-8), name
    assert sorted(hook.stats.read()) == sorted(n for n, _ in model.named_parameters())

    handle.remove()
    ddp.zero_grad()
    ref.zero_grad()
    again = fh.grad_hook(lambda g: g * 0.5)
    again.register(ddp)
    _loss(ddp, x).backward()
    _loss(ref, x).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        local = q.grad if name in ignored else _averaged(q.grad, world)
        assert torch.allclose(p.grad, local * 0.5, rtol=1e-6, atol=1e-8), name

    # accumulation under no_sync(): the ignored parameters too are processed in the synchronising backward only
    ddp.zero_grad()
    ref.zero_grad()
    x2 = _batch(rank, 1, 0, 16, device)
    with ddp.no_sync():
        _loss(ddp, x).backward()
    _loss(ddp, x2).backward()
    _loss(ref, x).backward()
    _loss(ref, x2).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        local = q.grad if name in ignored else _averaged(q.grad, world)
        assert torch.allclose(p.grad, local * 0.5, rtol=1e-6, atol=1e-8), f"no_sync: {name}"


def zclip_distributed(rank: int, world: int, device) -> None:
    """fh.zclip on a DDP and an FSDP2 model: the total norm is the whole model's (of the averaged gradients), spikes
    and the clipped gradients (this rank's shards) follow ZClip's published rule applied to the averaged gradients of
    an unwrapped copy, and the state is the same on every rank."""
    from torch.distributed.fsdp import fully_shard

    import fusedhooks as fh

    from helpers import PublishedZClip

    for kind in ("ddp", "fsdp2"):
        base = _fsdp_mlp(device)
        ref, model = copy.deepcopy(base), copy.deepcopy(base)
        if kind == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        else:
            fully_shard(model[0])
            fully_shard(model)
            wrapped = model
        hook = fh.grad_hook(stats=("norm",))
        hook.register(wrapped)
        guard = fh.zclip(hook, warmup_steps=3)
        published = PublishedZClip(warmup_steps=3, max_grad_norm=None)
        for step in range(7):
            x = _batch(rank, step, 0, 5, device)
            scale = 50.0 if step == 5 else 1.0
            (_loss(wrapped, x) * scale).backward()
            (_loss(ref, x) * scale).backward()
            ref_params = [q.detach().clone().requires_grad_() for q in ref.parameters()]
            for rp, q in zip(ref_params, ref.parameters()):
                rp.grad = _averaged(q.grad, world)
            ref_total, clip_val = published.step(ref_params)
            total = guard.step()
            assert abs(total.item() - ref_total) <= 1e-5 * ref_total, (kind, step, total, ref_total)
            assert guard.spike.item() == (clip_val is not None), (kind, step)
            assert step != 5 or clip_val is not None, "the injected spike is caught"
            for p, rp in zip(model.parameters(), ref_params):
                local = p.grad.to_local() if kind == "fsdp2" else p.grad
                expected = _shard(rp.grad, rank, world) if kind == "fsdp2" else rp.grad
                assert torch.allclose(local, expected, rtol=1e-4, atol=1e-7), (kind, step)
            state = torch.stack([guard.mean, guard.var, guard.count.double()])
            gathered = [torch.empty_like(state) for _ in range(world)]
            dist.all_gather(gathered, state)
            assert all(torch.equal(g, state) or (g.isnan() == state.isnan()).all() and
                       torch.equal(g.nan_to_num(), state.nan_to_num()) for g in gathered), "state differs by rank"
            wrapped.zero_grad()
            ref.zero_grad()


class _CheckpointedLast(torch.nn.Module):
    """Two layers, the last under reentrant activation checkpointing: its nested backward fires before anything of
    the outer one."""

    def __init__(self, device):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.last = torch.nn.Linear(5, 6).to(device), torch.nn.Linear(6, 3).to(device)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(lambda h: torch.tanh(self.last(h)), torch.tanh(self.first(x)), use_reentrant=True)


def nested_backwards(rank: int, world: int, device) -> None:
    """Reentrant activation checkpointing, a nested backward firing first, under DDP and FSDP2, two micro-batches per
    step: register(ddp_model) (the synchronising micro-batch, no_sync() before it), a hook on the module DDP wraps
    (static_graph=True, accumulation_steps=2: each rank's accumulated gradient, then DDP's average) and FSDP2
    (accumulation_steps=2; merged once per backward) give eager's gradients, whole-parameter statistics and no stale
    row; register(ddp_model) with static_graph=True is refused with the ways that work."""
    from torch.distributed.fsdp import fully_shard

    import fusedhooks as fh

    for case in ("ddp", "ddp-local", "fsdp2"):
        model, ref = _CheckpointedLast(device), _CheckpointedLast(device)
        hook = fh.grad_hook(lambda g: g.clamp(-CLAMP, CLAMP), stats=("norm", "absmax", "sum"))
        merges = []
        if case == "fsdp2":
            fully_shard(model.first)
            fully_shard(model.last)
            fully_shard(model)
            hook.register(model, accumulation_steps=2)
            run = model
            merge = type(hook._shards).merge
            hook._shards.merge = lambda rows, merge=merge, shards=hook._shards, merges=merges: (
                merges.append(len(rows)), merge(shards, rows))
        else:
            run = torch.nn.parallel.DistributedDataParallel(model, static_graph=case == "ddp-local")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", fh.LocalGradientWarning)
                if case == "ddp":
                    hook.register(run)
                else:
                    hook.register(model, accumulation_steps=2)
        names = [n for n, _ in ref.named_parameters()]
        ref_run, processed, last = ref, {}, [False]
        if case == "ddp-local":  # the yardstick: the same DDP, eager hooks clamping in the last micro-batch
            ref_run = torch.nn.parallel.DistributedDataParallel(ref, static_graph=True)
            for name, q in ref.named_parameters():
                def eager_hook(q, name=name, last=last, processed=processed):
                    if last[0]:
                        q.grad.clamp_(-CLAMP, CLAMP)
                        processed[name] = q.grad.clone()
                q.register_post_accumulate_grad_hook(eager_hook)
        for step in range(2):
            merges.clear()
            xs = [_batch(rank, step, k, 5, device).requires_grad_() for k in range(2)]
            for k, x in enumerate(xs):
                last[0] = k == 1
                sync = run.no_sync() if case == "ddp" and k == 0 else contextlib.nullcontext()
                with sync, warnings.catch_warnings():
                    warnings.simplefilter("ignore", fh.LocalGradientWarning)
                    _loss(run, x).backward()
                _loss(ref_run, x).backward()
            reading = hook.stats.read()
            assert sorted(reading) == sorted(names) and not reading.stale, (case, step, reading.stale)
            for (name, p), q in zip(model.named_parameters(), ref.named_parameters()):
                local = q[1].grad
                if case == "ddp-local":  # each rank's own accumulated gradient processed, before DDP reduces it
                    assert torch.equal(p.grad, local), (case, step, name)
                    check_stats(reading[name], processed[name], ("absmax", "norm", "sum"))
                else:  # processed on the average
                    expected = _averaged(local, world).clamp(-CLAMP, CLAMP)
                    got = p.grad.full_tensor() if case == "fsdp2" else p.grad
                    torch.testing.assert_close(got, expected, rtol=0, atol=1e-7, msg=f"{case} {step} {name}")
                    check_stats(reading[name], got, ("absmax",))
                    _close_stats(reading[name], got, ("norm", "sum"))
            if case == "fsdp2":
                assert merges == [1], f"one collective per backward that processes: {merges}"
            model.zero_grad()
            ref.zero_grad()
    static = torch.nn.parallel.DistributedDataParallel(_CheckpointedLast(device), static_graph=True)
    _raises(ValueError, "use_reentrant=False", lambda: fh.grad_hook(stats=("norm",)).register(static))


class _TPNet(torch.nn.ModuleDict):
    """norm, up, down by name, and a forward through them (what fully_shard of the root needs)."""

    def forward(self, x):
        return _tp_forward(self, x)


def _tp_model(device) -> torch.nn.Module:
    """torchtitan's layout in small: a LayerNorm under SequenceParallel (Replicate parameters, Partial(sum)
    gradients), then a Colwise and a Rowwise projection."""
    torch.manual_seed(0)
    return _TPNet({"norm": torch.nn.LayerNorm(8), "up": torch.nn.Linear(8, 12),
                   "down": torch.nn.Linear(12, 8)}).to(device)


def _tp_forward(model, x):
    return model["down"](torch.relu(model["up"](model["norm"](x))))


def _term_magnitudes(ref: torch.nn.Module) -> dict:
    """For each parameter of `_tp_model` `ref`, the sum of the magnitudes of the terms its gradient element sums over
    the batch and the sequence (|d|^T |h| for a weight, sum |d| for a bias, with d the gradient of the layer's output
    and h its input; the norm's normalized input for its weight), read from hooks on the last backward, float64:
    two fp32 computations of the gradient that sum those terms in other orders differ by at most 2 gamma of that."""
    seen = {}

    def keep_input(module, args, out):
        seen[module, "in"] = args[0].detach().double()

    def keep_grad(module, grad_in, grad_out):
        seen[module, "d"] = grad_out[0].detach().double()

    for module in ref.values():
        module.register_forward_hook(keep_input)
        module.register_full_backward_hook(keep_grad)

    def magnitudes() -> dict:
        out = {}
        for key, module in ref.items():
            h, d = seen[module, "in"].flatten(0, -2).abs(), seen[module, "d"].flatten(0, -2).abs()
            if key == "norm":
                h = torch.nn.functional.layer_norm(seen[module, "in"], (8,)).flatten(0, -2).abs()
                out[f"{key}.weight"] = (d * h).sum(0)
            else:
                out[f"{key}.weight"] = d.T @ h
            out[f"{key}.bias"] = d.sum(0)
        return out
    return magnitudes


def _clamp_eagerly(*models: torch.nn.Module) -> None:
    """The oracles' hooks: each gradient (a DTensor's shard) clamped in place by a plain post-accumulate hook."""
    def clamp(q):
        (q.grad.to_local() if hasattr(q.grad, "to_local") else q.grad).clamp_(-CLAMP, CLAMP)

    for model in models:
        for q in model.parameters():
            q.register_post_accumulate_grad_hook(clamp)


def _check_against_oracle(hook, model, ref, magnitudes, world: int, terms: int, what: tuple) -> None:
    """After a backward of a sharded `model` (DTensor parameters) and of its unsharded oracle `ref` (clamped eagerly):
    the statistics identical on every rank; each processed gradient (`full_tensor()`) within 2 gamma_terms of the
    magnitudes of the terms its elements sum (`magnitudes()`: two fp32 computations summing them in other orders
    differ by at most that); statistics within 1e-5 of the oracle's; fh.clip_grad_norm_ torch's total, the same on
    every rank, and the clipped gradients within one rounding more. `what` names the case in failures."""
    import fusedhooks as fh

    names = [n for n, _ in ref.named_parameters()]
    reading = hook.stats.read()
    assert sorted(reading) == sorted(names) and not reading.stale, what
    gathered = [None] * world
    dist.all_gather_object(gathered, reading)
    assert all(r == gathered[0] for r in gathered), f"statistics differ between ranks {what}"
    params = dict(model.named_parameters())
    u = torch.finfo(torch.float32).eps / 2
    bounds = {name: 2 * terms * u / (1 - terms * u) * m for name, m in magnitudes().items()}
    for name, q in ref.named_parameters():
        error = (params[name].grad.full_tensor().double() - q.grad.double()).abs()
        assert (error <= bounds[name]).all(), (what, name, (error - bounds[name]).max().item())
        _close_stats(reading[name], q.grad, STATS)
    grads = {n: p.grad.full_tensor().clone() for n, p in params.items()}
    total = fh.clip_grad_norm_(hook, 0.02)
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.02)
    torch.testing.assert_close(total.to(expected.dtype), expected, rtol=1e-5, atol=0)
    totals = [None] * world
    dist.all_gather_object(totals, total.item())
    assert all(t == totals[0] for t in totals), f"ranks clip by different totals: {totals} {what}"
    for name, q in ref.named_parameters():  # one more rounding each: the coefficient's product
        got = params[name].grad.full_tensor()
        error = (got.double() - q.grad.double()).abs()
        assert (error <= bounds[name] + 4 * u * q.grad.double().abs()).all(), ("clipped", what, name)
        assert not torch.equal(got, grads[name]) or not grads[name].any(), ("not clipped", what, name)


def tensor_parallel(rank: int, world: int, device) -> None:
    """Tensor parallelism with a SequenceParallel norm on `world` ranks: the norm's Partial(sum) gradients are reduced
    before the body (never processed as the whole), the Colwise/Rowwise shards processed in place; processed
    gradients, whole-parameter statistics (identical on every rank) and fh.clip_grad_norm_ equal the unsharded eager
    oracle and torch's clip_grad_norm_, on the eager and triton backends. A Partial gradient other than a sum is
    refused, naming the placement."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    import fusedhooks as fh

    mesh = init_device_mesh(device.type, (world,))
    for backend in ("eager", "triton"):
        ref, model = _tp_model(device), _tp_model(device)
        parallelize_module(model, mesh, {"norm": SequenceParallel(),
                                         "up": ColwiseParallel(input_layouts=Shard(1)),
                                         "down": RowwiseParallel(output_layouts=Shard(1))})
        hook = fh.grad_hook(lambda g: g.clamp(-CLAMP, CLAMP), stats=STATS, backend=backend)
        hook.register(model)
        magnitudes = _term_magnitudes(ref)
        _clamp_eagerly(ref)
        for step in range(2):
            x = torch.randn(2, 4 * world, 8, generator=torch.Generator().manual_seed(step)).to(device)
            _tp_forward(model, x.chunk(world, dim=1)[rank]).square().sum().backward()  # this rank's sequence part
            _tp_forward(ref, x).square().sum().backward()
            assert isinstance(model["norm"].weight.grad, DTensor)
            assert any(isinstance(p, Partial) for p in model["norm"].weight.grad.placements)
            # each element sums 2 x 4 * world terms, in another order here (per rank, then across ranks), and a few
            # roundings more (silently wrong before: the norm's partial sums clamped and measured as if whole)
            _check_against_oracle(hook, model, ref, magnitudes, world, 8 * world + 4, (backend, step))
            model.zero_grad()
            ref.zero_grad()
    # the optimizer step inside the backward on the shards (the norm's Partial gradients reduced first, then stepped
    # by torch's single-tensor step): the same parameters as the same optimizer after the backward
    stepped, after = _tp_model(device), _tp_model(device)
    for m in (stepped, after):
        parallelize_module(m, mesh, {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                                     "down": RowwiseParallel(output_layouts=Shard(1))})
    opt, after_opt = fh.AdamW(stepped.parameters(), lr=1e-2), fh.AdamW(after.parameters(), lr=1e-2)
    fh.grad_hook(lambda g: g.clamp(-CLAMP, CLAMP)).register(stepped, optimizer=opt)
    fh.grad_hook(lambda g: g.clamp(-CLAMP, CLAMP)).register(after)
    for step in range(2):
        x = torch.randn(2, 4 * world, 8, generator=torch.Generator().manual_seed(step)).to(device)
        for m in (stepped, after):
            _tp_forward(m, x.chunk(world, dim=1)[rank]).square().sum().backward()
        assert all(p.grad is None for p in stepped.parameters())
        after_opt.step()
        after_opt.zero_grad()
        for (name, p), q in zip(stepped.named_parameters(), after.parameters()):
            assert torch.equal(p.full_tensor(), q.full_tensor()), ("stepped in the backward", step, name)
    early = _tp_model(device)["up"]
    fh.grad_hook(stats=("norm",)).register(early)  # before parallelize_module, which replaces the parameters
    parallelize_module(early, mesh, ColwiseParallel())
    _raises(RuntimeError, "replaced since (by tensor parallelism's parallelize_module",
            lambda: early(torch.randn(2, 8, device=device)))
    weight = model["norm"].weight
    weight.grad = DTensor.from_local(torch.ones(8, device=device), mesh, [Partial("avg")])
    _raises(ValueError, "placed as (Partial(avg),) and the parameter as (Replicate(),)", lambda: hook(weight))


def _fsdp_tp(rank: int, world: int, device, shape: tuple[int, int]) -> None:
    """FSDP2 + tensor parallelism as torchtitan lays them out, on a (dp, tp) mesh of `shape`: parallelize_module on the
    tp dimension (a SequenceParallel norm, Colwise, Rowwise), then fully_shard on the dp dimension, then register.
    The weights are sharded along both mesh dimensions (Shard on one tensor dim each, or _StridedShard and Shard on
    the same), the norm's along dp with Partial(sum) gradients along tp. Processed gradients, whole-parameter
    statistics (identical on every rank, one collective per backward) and fh.clip_grad_norm_ equal the unsharded eager
    oracle and torch's clip_grad_norm_, on the eager and triton backends; a body reducing over a sharded dim is
    refused at register. Then HSDP on the same mesh (dp replicas of a model sharded over tp)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    import fusedhooks as fh
    from fusedhooks.firing import shards
    from fusedhooks.runtime.process_groups import shard_spread

    dp, tp = shape
    covers_world = shards.covers_world
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    gathers = []
    all_gather = shards.all_gather_single

    def counting(dist_):
        gathers.append(1)
        return all_gather(dist_)

    shards.all_gather_single = counting
    for layout in ("fsdp+tp", "hsdp"):
        for backend in ("eager", "triton"):
            ref, model = _tp_model(device), _tp_model(device)
            if layout == "fsdp+tp":
                parallelize_module(model, mesh["tp"], {"norm": SequenceParallel(),
                                                       "up": ColwiseParallel(input_layouts=Shard(1)),
                                                       "down": RowwiseParallel(output_layouts=Shard(1))})
                for module in model.values():
                    fully_shard(module, mesh=mesh["dp"])
                fully_shard(model, mesh=mesh["dp"])
                batch, sequence = 2 * dp, 4 * tp
            else:  # replicated along dp, sharded along tp
                for module in model.values():
                    fully_shard(module, mesh=mesh)
                fully_shard(model, mesh=mesh)
                batch, sequence = 2 * dp * tp, 4
            hook = fh.grad_hook(lambda g: g.clamp(-CLAMP, CLAMP), stats=STATS, backend=backend)
            hook.register(model)
            if layout == "fsdp+tp":
                spread_of = {n: shard_spread(n, p) for n, p in model.named_parameters()}
                assert spread_of["up.weight"].dims == spread_of["down.weight"].dims == (0, 1), spread_of
                # FSDP2 on a tensor-parallel shard of the same dim (tp > 1)
                assert tp == 1 or "_StridedShard" in str(model["up"].weight.placements), model["up"].weight
                assert spread_of["norm.weight"].dims == (0,), spread_of
                columns = fh.grad_hook(lambda g: g - g.mean(dim=0))
                _raises(fh.CompileError, "reduces over dim 0 (`mean`), whose units would be cut by the shards",
                        functools.partial(columns.register, model["up"]))
            magnitudes = _term_magnitudes(ref)
            _clamp_eagerly(ref)
            for step in range(2):
                x = torch.randn(batch, sequence, 8, generator=torch.Generator().manual_seed(step)).to(device)
                if layout == "fsdp+tp":  # this dp rank's samples, this tp rank's part of their sequence
                    mine = x.chunk(dp, dim=0)[dp_rank].chunk(tp, dim=1)[tp_rank]
                else:
                    mine = x.chunk(world, dim=0)[rank]
                gathers.clear()
                # the second step as on a mesh that does not span the default group: a gather per sharded dimension
                shards.covers_world = covers_world if step == 0 else (lambda mesh: False)
                model(mine).square().sum().backward()  # the root's forward: FSDP2's hooks around the whole
                spreads = {shard_spread(n, p) for n, p in model.named_parameters()}
                expected = 1 if step == 0 else sum(len(spread.dims) for spread in spreads)
                assert len(gathers) == expected, f"{len(gathers)} collectives in a backward, not {expected}"
                # FSDP2 averages over the data-parallel ranks: the oracle's loss is the mean of theirs
                replicas = dp if layout == "fsdp+tp" else world
                (_tp_forward(ref, x).square().sum() / replicas).backward()
                # the terms of each element, the average, a few roundings
                _check_against_oracle(hook, model, ref, magnitudes, world, batch * sequence + 2 * replicas + 8,
                                      (layout, backend, step))
                model.zero_grad()
                ref.zero_grad()
    shards.all_gather_single, shards.covers_world = all_gather, covers_world
    partial = torch.nn.Parameter(DTensor.from_local(torch.ones(4, device=device), mesh, [Shard(0), Partial()]))
    _raises(ValueError, "a DTensor placed as (Shard(dim=0), Partial(sum)); fusedhooks merges the statistics of "
            "parameters sharded along mesh dimensions", functools.partial(fh.grad_hook(stats=("norm",)).register,
                                                                        [("partial", partial)]))


def fsdp_tp_1x2(rank: int, world: int, device) -> None:
    _fsdp_tp(rank, world, device, (1, 2))


def fsdp_tp_2x1(rank: int, world: int, device) -> None:
    _fsdp_tp(rank, world, device, (2, 1))


def fsdp_tp_2x2(rank: int, world: int, device) -> None:
    _fsdp_tp(rank, world, device, (2, 2))
