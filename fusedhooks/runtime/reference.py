"""The same plan as eager torch ops: the CPU backend and the oracle of the tests."""

from __future__ import annotations

import torch

from ..compiler.ir import Graph, Node, eager
from ..compiler.plan import Plan


def evaluate(graph: Graph, grad: torch.Tensor, param: torch.Tensor | None, scalars: list[torch.Tensor]):
    """The body's result as eager torch computes it (not yet written); grad/param keep their shapes."""
    values: dict[int, object] = {}

    def get(v):
        return values[v.index] if isinstance(v, Node) else v

    for n in graph.live_nodes():
        if n.kind == "grad":
            values[n.index] = grad
        elif n.kind == "param":
            values[n.index] = param
        elif n.kind == "const":
            values[n.index] = n.value
        elif n.kind == "scalar":
            values[n.index] = scalars[n.value]
        else:
            values[n.index] = eager(n.op, {k: get(v) for k, v in n.args.items()})
    return values[graph.result.index]


def tensor_stats(x: torch.Tensor, names: tuple[str, ...]) -> list[torch.Tensor]:
    """Statistics of `x` as float64 0-dim tensors on x's device, with torch's NaN/Inf behaviour.

    min, max and absmax of an empty tensor are NaN (torch raises); var/std of fewer than 2 elements NaN. skew and
    kurtosis: m3 / m2**1.5 and m4 / m2**2 - 3 of the central moments m_k = mean((x - mean)**k) (population, as
    scipy.stats.skew and scipy.stats.kurtosis by default), NaN when m2 is 0 or x is empty.
    """
    x64 = x.detach().reshape(-1).to(torch.float64)
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=x.device)
    empty = x64.numel() == 0

    def one(name):
        if name == "count":
            return torch.tensor(float(x64.numel()), dtype=torch.float64, device=x.device)
        if name == "sum":
            return x64.sum()
        if name == "mean":
            return x64.mean() if not empty else nan
        if name == "sumsq":
            return (x64 * x64).sum()
        if name == "norm":
            return torch.linalg.vector_norm(x64)
        if name in ("var", "std"):
            if x64.numel() < 2:
                return nan
            return getattr(torch, name)(x64)
        if name in ("min", "max"):
            return nan if empty else getattr(x64, name)()
        if name == "absmax":
            return nan if empty else x64.abs().max()
        if name == "nan":
            return torch.isnan(x64).sum().to(torch.float64)
        if name == "inf":
            return torch.isinf(x64).sum().to(torch.float64)
        if name == "zeros":
            return (x64 == 0).sum().to(torch.float64)
        if name in ("skew", "kurtosis"):
            if empty:
                return nan
            deviations = x64 - x64.mean()
            m2 = deviations.square().mean()
            if name == "skew":
                return deviations.pow(3).mean() / (m2 * m2.sqrt())
            return deviations.pow(4).mean() / m2.square() - 3.0
        raise KeyError(name)

    return [one(name) for name in names]


def histogram(x: torch.Tensor, hist_range: tuple[int, int], compute: torch.dtype = torch.float64) -> torch.Tensor:
    """Counts (float64 [hi - lo]) of floor(log2|x|) in bins lo .. hi-1: zeros and smaller values in the
    first bin, larger values and +-Inf in the last, NaN in none. compute: a float dtype that holds x's values
    exactly (frexp is exact in it)."""
    lo, hi = hist_range
    x = x.detach().reshape(-1).to(compute)
    _, exponent = torch.frexp(x.abs())            # |x| = m * 2**e, 0.5 <= m < 1: floor(log2|x|) = e - 1
    bins = (exponent.to(torch.int64) - 1 - lo).clamp(0, hi - lo - 1)
    bins = torch.where(torch.isinf(x), hi - lo - 1, torch.where(x == 0, 0, bins))
    bins = torch.where(torch.isnan(x), hi - lo, bins)  # counted in an extra bin, dropped: no data-dependent shape
    counts = torch.zeros(hi - lo + 1, dtype=torch.int64, device=x.device)  # (which torch.compile can trace)
    counts.index_add_(0, bins, torch.ones_like(bins))
    return counts[:hi - lo].to(torch.float64)


def _stats_values(x: torch.Tensor, names: tuple[str, ...], hist_range) -> list[torch.Tensor]:
    scalars = tensor_stats(x, tuple(n for n in names if n != "hist"))
    if "hist" in names:
        scalars += list(histogram(x, hist_range))
    return scalars


def run(plan: Plan, grad: torch.Tensor, param: torch.Tensor | None, scalars: list[torch.Tensor],
        stats_row: torch.Tensor | None, amp: tuple | None = None) -> None:
    """Apply `plan` to `grad` in place with eager torch ops and write the statistics into `stats_row`.

    amp: (scale, found_inf): unscale first, exactly as GradScaler.unscale_ does.
    """
    if plan.amp:
        scale, found_inf = amp
        torch._amp_foreach_non_finite_check_and_unscale_([grad], found_inf, scale.double().reciprocal().float())
    values = _stats_values(grad, plan.input_stats, plan.hist_range) if plan.input_stats else []
    if plan.graph.writes:
        # autograd may record the body (backward(create_graph=True)): it reads a copy, which copy_ leaves as the
        # body's backward saved it (on grad itself the second differentiation would find it overwritten)
        source = grad.clone() if torch.is_grad_enabled() else grad
        grad.copy_(evaluate(plan.graph, source, param, scalars))
    values = (_stats_values(grad, plan.stats, plan.hist_range) if plan.stats else []) + values
    if values and stats_row is not None:
        stats_row.copy_(torch.stack(values))
