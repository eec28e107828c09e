"""fh.AdamW / fh.SGD(master_weights=True): 16-bit parameters stepped through fp32 master weights
(`state["master_param"]`) with fp32 states, the parameter the master rounded once (to nearest, or stochastically).
The fp32 side is the same kernel arithmetic as an fp32 parameter's: bit for bit fh's fp32 optimizer on the master's
values; state_dict both ways; the refusals."""

import copy

import pytest
import torch

import fusedhooks as fh

HALF_DTYPES = [torch.bfloat16, torch.float16]
MAKE = {
    "adamw": lambda ps, **kw: fh.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, **kw),
    "sgd": lambda ps, **kw: fh.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01, **kw),
}
SHAPES = [(1,), (37,), (5, 7), (40_009,)]


def start(dtype):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", MAKE)
def test_the_master_steps_as_an_fp32_parameter_and_the_parameter_is_it_rounded(name, dtype):
    """Five steps: master_param and the states equal, bit for bit, those of the same optimizer stepping fp32
    parameters that start at the 16-bit values with the 16-bit gradients widened; the parameter is the master rounded
    to its dtype (to nearest even); the states are fp32."""
    halves = [torch.nn.Parameter(v) for v in start(dtype)]
    fp32 = [torch.nn.Parameter(v.float()) for v in start(dtype)]
    opt, ref = MAKE[name](halves, master_weights=True), MAKE[name](fp32)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p, q in zip(halves, fp32):
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            q.grad = p.grad.float()
        opt.step()
        ref.step()
    for p, q in zip(halves, fp32):
        state = opt.state[p]
        assert torch.equal(state["master_param"], q.detach())
        assert torch.equal(p.detach(), q.detach().to(dtype))
        for key, value in ref.state[q].items():
            assert state[key].dtype == value.dtype and torch.equal(state[key], value), key


def test_stochastic_rounding_rounds_the_master_to_a_neighbour():
    p = torch.nn.Parameter(torch.randn(4099, generator=torch.Generator().manual_seed(0)).bfloat16())
    opt = fh.AdamW([p], lr=1e-3, master_weights=True, stochastic_rounding=True, seed=2)
    for step in range(3):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)).bfloat16()
        opt.step()
    master = opt.state[p]["master_param"]
    bits = master.view(torch.int32)
    down = (bits & ~0xFFFF).view(torch.float32)
    up = ((bits & ~0xFFFF) + 0x10000).view(torch.float32)
    assert ((p.float() == down) | (p.float() == up)).all()
    assert not torch.equal(p.detach(), master.bfloat16())  # some rounded otherwise than to nearest


@pytest.mark.parametrize("name", MAKE)
def test_state_dict_keeps_fp32_and_loads_both_ways(name):
    """fh -> fh: master_param and the states come back in fp32, unrounded, and the next steps are the same bit for
    bit; fh -> torch: torch loads it (casting to the parameters' dtype, as it casts any state); torch -> fh: the
    master starts from the parameter, the states widened."""
    params = [torch.nn.Parameter(v) for v in start(torch.bfloat16)]
    opt = MAKE[name](params, master_weights=True)
    gen = torch.Generator().manual_seed(1)

    def grads(ps):
        g = torch.Generator().manual_seed(7)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)

    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    loaded = MAKE[name](twins, master_weights=True)
    loaded.load_state_dict(saved)
    for p, q in zip(params, twins):
        for key, value in opt.state[p].items():
            assert loaded.state[q][key].dtype == value.dtype and torch.equal(loaded.state[q][key], value), key
    grads(params)
    grads(twins)
    opt.step()
    loaded.step()
    assert all(torch.equal(p, q) for p, q in zip(params, twins))

    torch_twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_opt = (torch.optim.AdamW(torch_twins, lr=1e-2, weight_decay=0.1, amsgrad=True) if name == "adamw" else
                 torch.optim.SGD(torch_twins, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01))
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    grads(torch_twins)
    torch_opt.step()  # torch steps with its own (bf16) copies of the states

    back = [torch.nn.Parameter(p.detach().clone()) for p in torch_twins]
    fh_opt = MAKE[name](back, master_weights=True)
    fh_opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    grads(back)
    fh_opt.step()
    for p in back:
        state = fh_opt.state[p]
        assert state["master_param"].dtype == torch.float32
        assert all(v.dtype == torch.float32 for k, v in state.items())
        assert torch.equal(p.detach(), state["master_param"].bfloat16())


def test_fp32_parameters_keep_no_master_and_the_fallback_is_refused():
    p = torch.nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    opt = fh.AdamW([p], master_weights=True)
    opt.step()
    assert "master_param" not in opt.state[p] and opt.state[p]["exp_avg"].dtype == torch.float32
    q = torch.nn.Parameter(torch.randn(4, 3).bfloat16().t())  # not contiguous: torch's step would take it
    q.grad = torch.randn(3, 4).bfloat16()
    with pytest.raises(RuntimeError, match="master weights"):
        fh.SGD([q], lr=0.1, master_weights=True).step()


def test_a_parameter_written_between_steps_restarts_its_master():
    """A parameter written in place between steps (model.load_state_dict, an edit under no_grad: its version moves)
    wins over its master weights, which restart from it: the step goes on from the written values."""
    model = torch.nn.Linear(64, 64).bfloat16()
    opt = fh.AdamW(model.parameters(), lr=1e-2, master_weights=True)
    gen = torch.Generator().manual_seed(0)

    def step():
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        opt.step()

    step()
    master_bias = opt.state[model.bias]["master_param"].clone()
    assert not torch.equal(master_bias, model.bias.float())  # the master holds more than the bf16 parameter
    loaded = {"weight": torch.zeros(64, 64, dtype=torch.bfloat16), "bias": model.bias.detach().clone()}
    model.load_state_dict(loaded)  # both written: copy_ moves their versions
    with torch.no_grad():
        model.weight.add_(1.0)
    step()
    weight_state = opt.state[model.weight]
    assert torch.equal(model.weight.detach(), weight_state["master_param"].bfloat16())
    assert (weight_state["master_param"] - 1.0).abs().max() < 0.1  # stepped from the loaded ones, not the old master
