"""Statistics recorded by the kernel against a float64 torch reference (tolerances of DESIGN.md)."""

import math

import pytest
import torch

import fusedhooks as fh
from fusedhooks import STAT_NAMES

from helpers import FLOAT_DTYPES, check_stats
from test_ops import fire, special_values

SIZES = [1, 2, 3, 97, 127, 128, 129, 256, 1021, 4099]


def clip_scale(grad):
    return grad.clamp(-2.0, 2.0) * 0.5


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_all_stats_match_float64_reference(n, dtype, backend, monkeypatch):
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", "128")  # several programs merge their partials
    grad = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3 + 0.5).to(dtype)
    before = grad.clone()
    hook = fh.grad_hook(clip_scale, stats="all", input_stats="all", backend=backend)
    fire(hook, grad)
    got = hook.stats.read()["param0"]
    check_stats(got, grad, STAT_NAMES)
    check_stats(got, before, STAT_NAMES, prefix="input.")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("specials", ["nan", "posinf", "neginf", "both_inf", "all"])
def test_nan_inf_follow_torch(specials, dtype, backend, monkeypatch):
    """NaN anywhere makes sum/mean/norm/var/std/min/max/absmax NaN; +Inf and -Inf together make sum NaN."""
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", "128")
    grad = special_values(1000, dtype)
    grad[torch.isnan(grad) | torch.isinf(grad)] = 1.0
    if specials in ("nan", "all"):
        grad[[5, 600]] = float("nan")
    if specials in ("posinf", "both_inf", "all"):
        grad[[7, 300]] = float("inf")
    if specials in ("neginf", "both_inf", "all"):
        grad[999] = float("-inf")
    hook = fh.grad_hook(stats="all", backend=backend)
    fire(hook, grad)
    check_stats(hook.stats.read()["param0"], grad, STAT_NAMES)


def test_statistics_only_hook_reads_once_and_leaves_grad(backend):
    grad = special_values(4099, torch.bfloat16)
    before = grad.clone()
    hook = fh.grad_hook(stats=("norm", "nan", "inf", "absmax"), backend=backend)
    assert hook.plan(numel=4099, dtype=torch.bfloat16).writes == 0
    fire(hook, grad)
    assert torch.equal(grad.view(torch.int16), before.view(torch.int16))
    check_stats(hook.stats.read()["param0"], grad, ("norm", "nan", "inf", "absmax"))


def test_std_with_large_mean_is_stable(backend, monkeypatch):
    """|mean|/std = 1e3: a sumsq/n - mean^2 formula loses every digit here; Chan's merge keeps 1e-3."""
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", "1024")
    x = torch.randn(200_003, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grad = (1000.0 + (x - x.mean()) / x.std()).to(torch.float32)
    hook = fh.grad_hook(stats=("mean", "var", "std"), backend=backend)
    fire(hook, grad)
    got = hook.stats.read()["param0"]
    ref = grad.double()
    assert abs(got["std"] - ref.std().item()) <= 1e-3 * ref.std().item()
    assert abs(got["var"] - ref.var().item()) <= 2e-3 * ref.var().item()
    assert abs(got["mean"] - ref.mean().item()) <= 1e-5 * ref.abs().mean().item()


def test_million_elements_fp32(backend):
    """~1e6 elements at the interpreter's default block size: the merge covers dozens of programs."""
    grad = torch.randn(1_000_003, generator=torch.Generator().manual_seed(7)) * 1e-3
    before = grad.clone()
    hook = fh.grad_hook(clip_scale, stats="all", input_stats=("norm", "sum"), backend=backend)
    fire(hook, grad)
    got = hook.stats.read()["param0"]
    check_stats(got, grad, STAT_NAMES)
    check_stats(got, before, ("norm", "sum"), prefix="input.")


def test_empty_gradient_records_torch_values(backend):
    grad = torch.empty(0)
    hook = fh.grad_hook(clip_scale, stats="all", backend=backend)
    assert hook.plan(numel=0).launches == 0
    fire(hook, grad)
    got = hook.stats.read()["param0"]
    assert got["count"] == 0 and got["sum"] == 0.0 and got["norm"] == 0.0 and got["nan"] == 0
    for name in ("mean", "var", "std", "min", "max", "absmax"):
        assert got[name] != got[name], name


def test_single_element_var_is_nan_like_torch(backend):
    grad = torch.tensor([3.0])
    hook = fh.grad_hook(stats=("var", "std", "mean"), backend=backend)
    fire(hook, grad)
    got = hook.stats.read()["param0"]
    assert got["mean"] == 3.0 and got["var"] != got["var"] and got["std"] != got["std"]


def test_each_firing_overwrites_the_row(backend):
    hook = fh.grad_hook(stats=("max",), backend=backend)
    p = torch.zeros(5, requires_grad=True)
    p.grad = torch.full((5,), 4.0)
    hook(p)
    p.grad = torch.full((5,), -1.0)
    hook(p)
    assert hook.stats.read()["param0"]["max"] == -1.0


def test_statistics_are_deterministic(monkeypatch):
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", "256")
    values = []
    for _ in range(2):
        hook = fh.grad_hook(stats=("sum", "var"))
        fire(hook, torch.randn(5000, generator=torch.Generator().manual_seed(1)))
        values.append(hook.stats.read()["param0"])
    assert values[0] == values[1]


@pytest.mark.parametrize("dtype, magnitude", [(torch.float32, 3e38), (torch.bfloat16, 1e38), (torch.float16, 6e4),
                                              (torch.float32, 1e-30)], ids=["fp32_3e38", "bf16_1e38", "fp16_6e4",
                                                                            "fp32_1e-30"])
def test_var_std_of_huge_and_tiny_finite_gradients_are_finite_and_exact(dtype, magnitude, backend, monkeypatch):
    """Block sums and squared deviations are scaled by a power of two per block: plain fp32 sums of 3e38 values
    would overflow into a NaN variance (read as "the gradient has NaNs"), squares of 1e-30 underflow into 0."""
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", "128")
    signs = torch.where(torch.arange(1021) % 3 == 0, -1.0, 1.0)
    grad = (signs * magnitude * torch.linspace(0.5, 1.0, 1021)).to(dtype)
    assert torch.isfinite(grad).all()
    hook = fh.grad_hook(stats="all", backend=backend)
    fire(hook, grad)
    got = hook.stats.read()["param0"]
    check_stats(got, grad, STAT_NAMES)
    assert got["var"] > 0 and got["std"] > 0 and got["nan"] == 0


def test_to_scalars_is_read_flattened_without_histograms_or_stale_rows(backend):
    hook = fh.grad_hook(lambda grad: grad * 2.0, stats=("norm", "nan", "hist"), input_stats=("max",),
                        backend=backend)
    weight = torch.nn.Parameter(torch.tensor([3.0, -4.0]))
    frozen = torch.nn.Parameter(torch.tensor([1.0]))
    hook.register([("fc.weight", weight), ("frozen", frozen)])
    (weight.sum() * 1.0 + frozen.sum()).backward()
    weight.grad = None
    (weight * torch.tensor([1.5, -2.0])).sum().backward()  # frozen gets no gradient: its row is stale
    assert hook.stats.to_scalars() == {"grad/fc.weight/norm": 5.0, "grad/fc.weight/nan": 0,
                                       "grad/fc.weight/input.max": 1.5}
    scalars = hook.stats.to_scalars(prefix="")
    assert list(scalars) == ["fc.weight/norm", "fc.weight/nan", "fc.weight/input.max"]
    assert isinstance(scalars["fc.weight/nan"], int) and isinstance(scalars["fc.weight/norm"], float)
    hook.stats.reset()
    assert hook.stats.to_scalars() == {}


@pytest.mark.parametrize("zeros", [[0.0] * 5, [-0.0] * 5, [0.0, -0.0, 0.0]], ids=["pos", "neg", "mixed"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_absmax_of_zeros_is_positive_zero_like_torch(zeros, dtype, backend):
    """absmax is x.abs().max(): +0.0 for a gradient of zeros of either sign (the eager backend took max(-min, max),
    which is -0.0 when min is +0.0)."""
    grad = torch.tensor(zeros, dtype=dtype)
    expected = grad.abs().max().item()
    hook = fh.grad_hook(stats=("absmax",), backend=backend)
    fire(hook, grad)
    got = hook.stats.read()["param0"]["absmax"]
    assert got == expected and math.copysign(1.0, got) == math.copysign(1.0, expected), (got, expected)


# --- to_scalars' selection: stats=, params=, top_k= ----------------------------------------------------------

def _three_layer_hook(backend, stats=("norm", "absmax", "nan"), input_stats=("max",)):
    """A hook on parameters of odd sizes, one per float dtype, whose gradients' norms differ by about 10x
    (enc.weight < enc.bias < dec.weight); a fourth, frozen parameter has a stale row. Returns (hook, grads)."""
    hook = fh.grad_hook(stats=stats, input_stats=input_stats, backend=backend)
    sizes = {"enc.weight": (97, torch.float32, 0.01), "enc.bias": (3, torch.bfloat16, 1.0),
             "dec.weight": (129, torch.float16, 10.0)}
    params = {name: torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for name, (n, dtype, _) in sizes.items()}
    frozen = torch.nn.Parameter(torch.zeros(5))
    hook.register(list(params.items()) + [("frozen", frozen)])
    frozen.sum().backward()
    generator = torch.Generator().manual_seed(3)
    loss = sum((p * (torch.randn(p.shape, generator=generator) * scale).to(p.dtype)).float().sum()
               for p, (_, _, scale) in zip(params.values(), sizes.values()))
    loss.backward()
    return hook, {name: p.grad for name, p in params.items()}


def test_to_scalars_selects_statistics_and_parameters(backend):
    hook, grads = _three_layer_hook(backend)
    everything = hook.stats.to_scalars()
    assert "grad/frozen/norm" not in everything and len(everything) == 3 * 4
    assert hook.stats.to_scalars(stats=None, params=None, top_k=None) == everything
    assert hook.stats.to_scalars(stats=("norm", "input.max")) == {
        key: value for key, value in everything.items() if key.endswith(("/norm", "/input.max"))}
    assert hook.stats.to_scalars(stats="nan", params="enc.*") == {"grad/enc.weight/nan": 0, "grad/enc.bias/nan": 0}
    assert list(hook.stats.to_scalars(params=["dec.*", "*.bias"], stats="absmax", prefix="")) == [
        "enc.bias/absmax", "dec.weight/absmax"]  # read()'s order, whatever the patterns' order
    assert hook.stats.to_scalars(params="frozen") == {}  # registered, but stale
    check_stats({"norm": hook.stats.to_scalars(stats="norm", params="dec.weight")["grad/dec.weight/norm"]},
                grads["dec.weight"], ["norm"])


def test_to_scalars_top_k_summary(backend):
    hook, grads = _three_layer_hook(backend)
    whole = torch.cat([grad.double() for grad in grads.values()]).norm().item()
    summary = hook.stats.to_scalars(stats="norm", top_k=2)
    assert list(summary) == ["grad/total_norm", "grad/dec.weight/norm", "grad/enc.bias/norm"]
    assert summary["grad/total_norm"] == pytest.approx(whole, rel=1e-5)  # each recorded norm within 1e-5
    for name in ("dec.weight", "enc.bias"):
        check_stats({"norm": summary[f"grad/{name}/norm"]}, grads[name], ["norm"])
    assert hook.stats.to_scalars(top_k=0) == {"grad/total_norm": summary["grad/total_norm"]}
    enc = hook.stats.to_scalars(params="enc.*", top_k=1, prefix="")
    assert list(enc) == ["total_norm", "enc.bias/norm", "enc.bias/absmax", "enc.bias/nan", "enc.bias/input.max"]
    expected = torch.cat([grads["enc.weight"].double(), grads["enc.bias"].double()]).norm().item()
    assert enc["total_norm"] == pytest.approx(expected, rel=1e-5)
    assert hook.stats.to_scalars(top_k=5).keys() == {"grad/total_norm"} | hook.stats.to_scalars().keys()
    hook.stats.reset()
    assert hook.stats.to_scalars(top_k=2) == {}


def test_to_scalars_top_k_ranks_a_nan_norm_first(backend):
    hook = fh.grad_hook(stats=("norm",), backend=backend)
    big, bad = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    hook.register([("big", big), ("bad", bad)])
    ((big * 1e3).sum() + (bad * torch.tensor([float("nan"), 1.0])).sum()).backward()
    summary = hook.stats.to_scalars(top_k=1)
    assert list(summary) == ["grad/total_norm", "grad/bad/norm"]
    assert math.isnan(summary["grad/total_norm"]) and math.isnan(summary["grad/bad/norm"])


@pytest.mark.parametrize("selection, match", [
    ({"stats": "nrom"}, "'nrom', which is no statistic: this hook records \\['norm', 'absmax', 'nan', 'input.max'\\]"),
    ({"stats": ("norm", "std")}, "'std', which this hook does not record: .* add 'std' to the hook's stats="),
    ({"stats": "input.norm"}, "add 'norm' to the hook's input_stats="),
    ({"stats": "hist"}, "'hist' is a histogram: read it with hook.stats.histogram"),
    ({"stats": ()}, "stats= takes a name or a non-empty sequence of names"),
    ({"stats": 3}, "stats= takes a name or a non-empty sequence of names"),
    ({"params": "encoder.*"}, "params= pattern 'encoder.\\*' matches none of the hook's parameters \\(enc.weight, "
                              "enc.bias, dec.weight, frozen\\)"),
    ({"params": ["enc.*", None]}, "params= takes a name or a non-empty sequence of names"),
    ({"top_k": -1}, "top_k= takes a number of parameters >= 0"),
    ({"top_k": True}, "top_k= takes a number of parameters >= 0"),
    ({"top_k": 1.5}, "top_k= takes a number of parameters >= 0"),
])
def test_to_scalars_refuses_bad_selections(selection, match):
    hook, _ = _three_layer_hook("reference", stats=("norm", "absmax", "nan", "hist"))
    with pytest.raises(ValueError, match=match):
        hook.stats.to_scalars(**selection)


def test_to_scalars_top_k_needs_norm():
    hook, _ = _three_layer_hook("reference", stats=("absmax",), input_stats=("norm",))
    with pytest.raises(ValueError, match="top_k= ranks the parameters by their gradient's norm: create the hook "
                                         "with \"norm\" among its stats"):
        hook.stats.to_scalars(top_k=3)


@pytest.mark.parametrize("layers", [2, 5], ids=["2-layers", "5-layers"])
def test_to_scalars_summary_has_as_many_keys_for_any_model(layers, backend):
    """summary=True: the global norm, the largest absmax and its parameter's index, NaN/Inf totals and how many
    gradients the body shrank, whatever the number of parameters; each equal to what the per-parameter scalars give."""
    hook = fh.grad_hook(lambda g: g.clamp(-0.05, 0.05), stats=("norm", "absmax", "nan", "inf"),
                        input_stats=("absmax", "nan"), backend=backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(6, 6) for _ in range(layers)))
    hook.register(model)
    for p in model.parameters():
        p.grad = torch.randn(p.shape) * 0.04
    model[0].weight.grad[0, 0] = float("nan")  # a NaN: its absmax is NaN, the largest
    model[-1].bias.grad.fill_(0.01)            # inside the clamp: not shrunk
    for p in model.parameters():
        hook(p)
    full, summary = hook.stats.to_scalars(), hook.stats.to_scalars(summary=True)
    names = [n for n, _ in model.named_parameters()]
    assert set(summary) == {"grad/total_norm", "grad/absmax", "grad/absmax_index", "grad/nan", "grad/inf",
                            "grad/input.nan", "grad/shrunk"}
    assert math.isnan(summary["grad/total_norm"]) and math.isnan(summary["grad/absmax"])
    assert hook.stats.names[summary["grad/absmax_index"]] == "0.weight"  # a NaN counts as the largest
    assert summary["grad/nan"] == summary["grad/input.nan"] == 1 and summary["grad/inf"] == 0
    shrunk = sum(full[f"grad/{n}/absmax"] < full[f"grad/{n}/input.absmax"] for n in names)
    assert summary["grad/shrunk"] == shrunk and 0 < shrunk < len(names)
    model[0].weight.grad.nan_to_num_(0.0)
    hook(model[0].weight)
    for p in list(model.parameters())[1:]:
        hook(p)
    full, summary = hook.stats.to_scalars(), hook.stats.to_scalars(summary=True)
    norms = [full[f"grad/{n}/norm"] for n in names]
    assert summary["grad/total_norm"] == math.sqrt(math.fsum(x * x for x in norms))
    largest = max(names, key=lambda n: full[f"grad/{n}/absmax"])
    assert summary["grad/absmax"] == full[f"grad/{largest}/absmax"] and summary["grad/nan"] == 0
    assert hook.stats.names[summary["grad/absmax_index"]] == largest
    first = hook.stats.to_scalars(params="0.*", summary=True)  # the summary of the parameters params= selects
    assert len(first) == len(summary)
    assert first["grad/total_norm"] == math.sqrt(math.fsum(full[f"grad/0.{n}/norm"] ** 2 for n in ("weight", "bias")))
    with pytest.raises(ValueError, match="fixed set of scalars"):
        hook.stats.to_scalars(stats=("norm",), summary=True)
    with pytest.raises(ValueError, match="fixed set of scalars"):
        hook.stats.to_scalars(top_k=1, summary=True)
