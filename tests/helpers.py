"""Shared oracles and tolerances for the tests."""

import contextlib
import logging
import math
from pathlib import Path

import torch

from fusedhooks.runtime import launcher
from fusedhooks.runtime.reference import tensor_stats

#: the repository's root
ROOT = Path(__file__).resolve().parent.parent

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]

#: torch's optimizers with a fused (fused=True) CPU step, which divides each gradient by `optimizer.grad_scale`
#: and skips the step where `optimizer.found_inf` != 0
FUSED_OPTIMIZERS = {
    "Adam": lambda params: torch.optim.Adam(params, lr=0.01, fused=True),
    "AdamW": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, fused=True),
    "SGD": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True),
    "Adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1, fused=True),
}


def leaf(*shape, dtype=torch.float32) -> torch.Tensor:
    """A random leaf tensor that requires grad."""
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


def mlp(sizes: tuple[int, int, int], activation=torch.nn.Tanh, dtype=torch.float32) -> torch.nn.Sequential:
    """Linear(sizes[0], sizes[1]) -> activation -> Linear(sizes[1], sizes[2]), initialised after manual_seed(0)."""
    torch.manual_seed(0)
    first, hidden, out = sizes
    return torch.nn.Sequential(torch.nn.Linear(first, hidden), activation(), torch.nn.Linear(hidden, out)).to(dtype)


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of `optimizer`'s per-parameter state (exp_avg, momentum_buffer, step, ...), in a fixed order."""
    return [value for p in optimizer.state for _, value in sorted(optimizer.state[p].items())
            if isinstance(value, torch.Tensor)]


def assert_same_steps(models, opts) -> None:
    """models[0]'s parameters and opts[0]'s states equal models[1]'s and opts[1]'s bit for bit (the same keys)."""
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
        assert opts[0].state[p].keys() == opts[1].state[q].keys()
        for key, value in opts[1].state[q].items():
            assert torch.equal(opts[0].state[p][key], value), key


class RaisingBackward(torch.autograd.Function):
    """The identity, whose backward raises FloatingPointError (an OOM, a NaN guard): the layers behind it have
    fired by then, the ones before it never fire."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise FloatingPointError("a backward that raises")


def assert_same_values(actual: torch.Tensor, expected: torch.Tensor, ulps: int = 0) -> None:
    """Elementwise identity (NaN where NaN; -0.0 == 0.0), or within `ulps` units in the last place."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual.dtype, expected.dtype)
    a, e = actual.double(), expected.double()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), f"NaN positions differ at {torch.nonzero(nan_a != nan_e)[:5].tolist()}"
    a, e = a[~nan_a], e[~nan_e]
    if ulps == 0:
        bad = a != e
    else:
        info = torch.finfo(expected.dtype)
        spacing = info.eps * torch.maximum(e.abs(), torch.tensor(info.tiny))
        bad = ~((a == e) | ((a - e).abs() <= ulps * spacing))
    assert not bad.any(), (f"{int(bad.sum())} of {a.numel()} values differ; first: actual "
                           f"{a[bad][:5].tolist()} expected {e[bad][:5].tolist()}")


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-identical values, the sign of every zero included (NaN only where NaN; its payload is not compared)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual.dtype, expected.dtype)
    assert_same_values(actual, expected)
    actual, expected = actual.reshape(-1), expected.reshape(-1)  # flat indices in the message
    zeros = expected == 0
    sign_a, sign_e = torch.signbit(actual[zeros]), torch.signbit(expected[zeros])
    bad = torch.nonzero(zeros).flatten()[sign_a != sign_e]
    assert not bad.numel(), (f"{bad.numel()} zeros have the wrong sign, first at {bad[:5].tolist()}: actual "
                             f"{actual[bad[:5]].tolist()} expected {expected[bad[:5]].tolist()}")


def check_stats(got: dict, x: torch.Tensor, names, prefix: str = "") -> None:
    """Compare recorded statistics with a float64 reference of `x`, with the tolerances of DESIGN.md."""
    expected = dict(zip(names, (v.item() for v in tensor_stats(x, tuple(names)))))
    x64 = x.double().reshape(-1)
    finite = x64[torch.isfinite(x64)]
    magnitude = finite.abs().sum().item() if finite.numel() else 0.0
    for name in names:
        g, e = got[prefix + name], expected[name]
        if e != e:  # NaN
            assert g != g, f"{name}: expected NaN, got {g}"
            continue
        if name in ("count", "nan", "inf", "zeros"):
            assert isinstance(g, int) and g == e, f"{name}: {g!r} != {e!r}"
        elif name in ("min", "max", "absmax"):
            assert g == e, f"{name}: {g!r} != {e!r}"
        elif abs(e) == float("inf"):
            assert g == e, f"{name}: {g} != {e}"
        elif name in ("sum", "mean"):
            scale = magnitude / (x64.numel() if name == "mean" else 1)
            assert abs(g - e) <= 1e-5 * scale + 1e-300, f"{name}: {g} vs {e} (scale {scale})"
        else:
            assert abs(g - e) <= 1e-5 * abs(e) + 1e-300, f"{name}: {g} vs {e}"


#: relative tolerance for results that depend on a whole-tensor reduction: the kernel's fp64-merged
#: reduction differs from torch's in the last bits (and may round to the neighbouring fp16/bf16 value)
REDUCTION_RTOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_close_to(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """Same dtype and NaN positions; |a - e| <= rtol * (|e| + mean |e|) elsewhere (inf must match)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = actual.double().reshape(-1), expected.double().reshape(-1)
    assert torch.equal(torch.isnan(a), torch.isnan(e)), "NaN positions differ"
    keep = ~torch.isnan(e)
    a, e = a[keep], e[keep]
    inf = torch.isinf(e)
    assert torch.equal(a[inf], e[inf]), "infinities differ"
    a, e = a[~inf], e[~inf]
    if e.numel():
        bound = rtol * (e.abs() + e.abs().mean())
        bad = (a - e).abs() > bound
        assert not bad.any(), f"{int(bad.sum())} values differ: {a[bad][:4].tolist()} vs {e[bad][:4].tolist()}"


def torch_fp32_norm_rtol(numels) -> float:
    """Relative error bound of torch's float32 total 2-norm of tensors with these element counts, as
    `clip_grad_norm_` computes it on CPU, plus one rounding for a correctly rounded result to compare it with.

    Torch squares and sums each tensor in vector accumulators of at least 8 float32 lanes (256-bit `Vectorized`
    under every ATEN_CPU_CAPABILITY on x86, and on NEON): each lane adds ceil(n / 8) squares in sequence, then
    the lanes are added (3 levels), so a sum of squares carries at most m = ceil(n / 8) + 4 roundings (the squares
    included) and a relative error gamma_m = m u / (1 - m u); its square root halves that and adds one rounding.
    The k per-tensor norms are then squared and summed the same way (gamma of ceil(k / 8) + 4) and rooted again.
    Which lanes hold which elements, and so the last bits, depend on the processor (AVX2 or AVX-512) and on the
    thread count: two such results must be compared within this bound, never for equality."""
    u = torch.finfo(torch.float32).eps / 2

    def gamma(m):
        return m * u / (1 - m * u)

    numels = list(numels)
    per_tensor = max(gamma(-(-n // 8) + 4) for n in numels) / 2 + u
    combined = 2 * per_tensor + gamma(-(-len(numels) // 8) + 4)
    return combined / 2 + u + 2 * u  # + the root's rounding, + the other side's (correctly rounded, <= 1 ulp)


def record_processing(hook) -> list:
    """The names of the parameters `hook` processes from now on, one per processing (a firing that the hook does
    not skip), in order: through `process`, or through the lean firing `process` leaves behind for later firings
    of the same dtype and device (Dispatch.lean_firing; the hook's dispatch, `hook.dispatch`, is patched)."""
    dispatch = hook.dispatch
    processed, process, lean_firing = [], dispatch.process, dispatch.lean_firing

    def recorded(entry, grad, param, backward_key):
        processed.append(entry.name)
        process(entry, grad, param, backward_key)

    def recorded_lean_firing(compiled, grad):
        firing = lean_firing(compiled, grad)

        def recorded_firing(backward_key, entries, rows, grads, params):
            processed.append(entries[0].name)
            firing(backward_key, entries, rows, grads, params)
        recorded_firing.launches_only = firing.launches_only
        return recorded_firing

    dispatch.process = recorded
    dispatch.lean_firing = recorded_lean_firing
    return processed


def timm_agc_(parameters, clip_factor=0.01, eps=1e-3):
    """timm.utils.agc.adaptive_clip_grad, as timm writes it (timm itself is not installed: it pulls torchvision)."""
    def unitwise_norm(x):
        if x.ndim <= 1:
            return x.norm(2.0)
        return x.norm(2.0, dim=tuple(range(1, x.ndim)), keepdim=True)

    for p in parameters:
        if p.grad is None:
            continue
        p_data = p.detach()
        g_data = p.grad.detach()
        max_norm = unitwise_norm(p_data).clamp_(min=eps).mul_(clip_factor)
        grad_norm = unitwise_norm(g_data)
        clipped_grad = g_data * (max_norm / grad_norm.clamp(min=1e-6))
        new_grads = torch.where(grad_norm < max_norm, g_data, clipped_grad)
        p.grad.detach().copy_(new_grads)


#: unit roundoff
U = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -9}


def coef_rtol(dtype, norm_type, numels):
    """Relative difference of the gradient the step sees: torch's fl(g * coef) against the fused step's
    fl(g / fl(1 / coef)) (3 roundings of fp32 between them), plus the coefficient's own difference: for the
    2-norm torch's fp32 norm against the correctly rounded recorded one; for bf16 one bf16 ulp of the total norm
    (torch's bf16 norms against the recorded ones rounded to bf16) and torch's rounding of the clipped gradient
    to bf16, which the fused step (in fp32) does not do."""
    if dtype == torch.bfloat16:
        return 3 * 2.0 ** -24 + 4 * U[torch.bfloat16]
    return 3 * 2.0 ** -24 + (torch_fp32_norm_rtol(numels) if norm_type == 2.0 else 0.0)


def assert_close_after_steps(actual, expected, start, delta, steps):
    """|a - e| <= steps * (8 * delta * max|e - start| + 2 u |e|): each step perturbs the gradient by delta
    relative, which the optimizer's update passes on at most 8-fold (m / sqrt(v), a sum of squares, momentum),
    plus the rounding of each stored value to its dtype (2 ulps: either side may round the other way)."""
    a, e, s = actual.double(), expected.double(), start.double()
    bound = steps * (8 * delta * (e - s).abs().max() + 2 * U[expected.dtype] * e.abs())
    bad = (a - e).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} of {a.numel()} differ: {a[bad][:4].tolist()} vs {e[bad][:4].tolist()}"


#: Statistics a firing records exactly (counts, and values picked from the gradient)
EXACT_STATS = ("count", "nan", "inf", "zeros", "min", "max", "absmax")


def assert_same_stats(stats, estats, values_rtol: float = 0.0):
    """The same rows, fresh and stale alike, and the same statistics: exactly those picked or counted; the others
    within DESIGN's 1e-5 of the float64 value on each side (under compiled autograd the firing is traced as the plan's
    torch ops, which reduce in float64; the eager backends in the gradient's precision, merged in float64).
    values_rtol: how far apart the gradients the statistics describe may be (see assert_same)."""
    assert stats and stats.keys() == estats.keys()
    assert stats.stale == estats.stale
    for name, row in stats.items():
        erow = estats[name]
        assert row.keys() == erow.keys() and row.fresh == erow.fresh, name
        for stat, value in row.items():
            expected = erow[stat]
            if value != value and expected != expected:  # NaN, as in a step GradScaler skips
                continue
            if stat.removeprefix("input.") in ("min", "max", "absmax") and values_rtol:
                assert abs(value - expected) <= values_rtol * abs(expected), (name, stat, value, expected)
            elif stat.removeprefix("input.") in EXACT_STATS or stat.endswith("hist"):
                assert value == expected or (value != value and expected != expected), (name, stat, value, expected)
            else:
                scale = abs(expected) if stat.removeprefix("input.") not in ("sum", "mean") else row.get("norm", 1.0)
                assert abs(value - expected) <= (2e-5 + values_rtol) * scale, (name, stat, value, expected)


def assert_same(got, expected, grads_rtol: float = 0.0):
    """The same gradients (bit for bit; within `grads_rtol` for a body whose result depends on a reduction: the
    traced firing reduces with torch's ops, the Triton kernels in their own order) and statistics."""
    assert len(got) == len(expected)
    for (grads, stats), (egrads, estats) in zip(got, expected):
        assert grads.keys() == egrads.keys()
        for name in grads:
            if grads_rtol:
                assert_close_to(grads[name], egrads[name], grads_rtol)
            else:
                assert torch.equal(grads[name], egrads[name]), name
        assert_same_stats(stats, estats, grads_rtol)


def count_launches(monkeypatch) -> list:
    """Wrap the runtime's launcher; returns the list of (kernel name, grid) it is called with."""
    launches = []
    real_launch = launcher.launch

    def counting_launch(kernel, grid, *args, **meta):
        launches.append((kernel.__name__ if hasattr(kernel, "__name__") else kernel.fn.__name__, grid))
        return real_launch(kernel, grid, *args, **meta)

    monkeypatch.setattr(launcher, "launch", counting_launch)
    return launches


class PublishedZClip:
    """ZClip's rule as published (github.com/bluorion-com/ZClip, zclip/zclip.py at e42cdd1), line by line, in
    Python floats (float64), on a list of parameters instead of a model; the total norm is computed in float64. The
    one addition, fusedhooks' documented deviation, is marked: a non-finite norm is left out of the warm-up and a
    non-finite EMA input leaves the EMA alone."""

    def __init__(self, alpha=0.97, z_thresh=2.5, max_grad_norm=1.0, eps=1e-6, warmup_steps=25, mode="zscore",
                 clip_option="adaptive_scaling", clip_factor=1.0, skip_update_on_spike=False):
        self.alpha, self.z_thresh, self.max_grad_norm, self.eps = alpha, z_thresh, max_grad_norm, eps
        self.warmup_steps, self.mode, self.clip_factor = warmup_steps, mode, clip_factor
        self.skip_update_on_spike = skip_update_on_spike
        self.clip_option = clip_option if mode == "zscore" else None
        self.buffer, self.initialized, self.mean, self.var = [], False, None, None
        self.last_z = None  # for the test's conditioning check

    def _initialize_ema(self):
        self.mean = sum(self.buffer) / len(self.buffer)
        self.var = sum((x - self.mean) ** 2 for x in self.buffer) / len(self.buffer)
        self.initialized = True
        self.buffer = []

    def _update_ema(self, grad_norm):
        if not math.isfinite(grad_norm):  # fusedhooks' deviation
            return
        self.mean = self.alpha * self.mean + (1 - self.alpha) * grad_norm
        self.var = self.alpha * self.var + (1 - self.alpha) * (grad_norm - self.mean) ** 2

    def _compute_positive_zscore(self, grad_norm):
        std = self.var ** 0.5
        z = (grad_norm - self.mean) / (std + self.eps)
        return z, std

    @staticmethod
    def _compute_grad_norm(params):
        grad_norms = [p.grad.double().norm(2) for p in params if p.grad is not None]
        return torch.sqrt(torch.sum(torch.pow(torch.stack(grad_norms), 2))).item()

    def _compute_clip_val(self, grad_norm):
        std = self.var ** 0.5
        if self.mode == "percentile":
            threshold = self.mean + self.z_thresh * std
            self.last_z = (grad_norm - self.mean) / std
            if grad_norm > threshold:
                return threshold
        elif self.mode == "zscore":
            z, std = self._compute_positive_zscore(grad_norm)
            self.last_z = z
            if z > self.z_thresh:
                if self.clip_option == "adaptive_scaling":
                    eta = z / self.z_thresh
                    threshold = self.mean + (self.z_thresh * std) / eta
                    threshold = threshold * self.clip_factor
                elif self.clip_option == "mean":
                    threshold = self.mean
                return threshold
        return None

    @staticmethod
    def apply_in_place_clipping(params, global_norm, max_global_norm):
        clip_coef = (max_global_norm / (global_norm + 1e-6)) if global_norm > max_global_norm else 1.0
        if clip_coef < 1.0:
            for param in params:
                if param.grad is not None:
                    param.grad.data.mul_(clip_coef)

    def _apply_clipping(self, params, clip_val, total_norm):
        adaptive_clip = clip_val if clip_val is not None else total_norm
        if self.max_grad_norm is not None:
            effective_clip = min(adaptive_clip, self.max_grad_norm)
        else:
            effective_clip = adaptive_clip
        self.apply_in_place_clipping(params, total_norm, effective_clip)
        return effective_clip

    def step(self, params):
        """Returns (total norm, the clip value: None when no spike or in the warm-up)."""
        total_norm = self._compute_grad_norm(params)
        if not self.initialized:
            if math.isfinite(total_norm):  # fusedhooks' deviation
                self.buffer.append(total_norm)
            if len(self.buffer) >= max(self.warmup_steps, 1):  # ZClip: >= warmup_steps, after one append at least
                self._initialize_ema()
            if self.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            return total_norm, None
        clip_val = self._compute_clip_val(total_norm)
        self._apply_clipping(params, clip_val, total_norm)
        if clip_val is not None and self.skip_update_on_spike:
            return total_norm, clip_val
        self._update_ema(clip_val if clip_val is not None else total_norm)
        return total_norm, clip_val


# --- the ways training code turns compiled autograd on (docs/compile.md, "Compile forms") ---

#: how the step is compiled -> whether compiled autograd traces its backward (the traced firing, no Python)
FORMS = {
    "compiled-model": False,         # model = torch.compile(model); loss.backward() outside (nanoGPT)
    "compiled-step": False,          # torch.compile(step), step runs forward and loss.backward()
    "config-patch": False,           # that step called under torch._dynamo.config.patch(compiled_autograd=True)
    "config-flag": True,             # torch._dynamo.config.compiled_autograd = True before the first compile
    "helper-fullgraph-dynamic": True,  # maybe_enable_compiled_autograd(True, fullgraph=True, dynamic=True)
    "helper": True,                  # maybe_enable_compiled_autograd(True, fullgraph=False, dynamic=False)
    "enable": True,                  # compiled_autograd._enable(torch.compile(...))
}
#: maybe_enable_compiled_autograd compiles the backward with inductor whatever the step is compiled with
HELPERS = ("helper-fullgraph-dynamic", "helper")


class RecompileLimitLog(logging.Handler):
    """The messages of dynamo's logger that say a recompile limit was hit."""

    def __init__(self):
        super().__init__()
        self.hits = []

    def emit(self, record):
        message = record.getMessage()
        if "recompile_limit" in message or "cache_size_limit" in message:
            self.hits.append(message)


def context(form: str | None, compile_backend: str):
    """The context a step compiled as `form` (a FORMS key; None: eager) runs in."""
    from torch._dynamo import compiled_autograd
    from torch._dynamo.utils import maybe_enable_compiled_autograd

    if form == "config-patch":
        return torch._dynamo.config.patch(compiled_autograd=True)
    if form == "helper-fullgraph-dynamic":
        return maybe_enable_compiled_autograd(True, fullgraph=True, dynamic=True)
    if form == "helper":
        return maybe_enable_compiled_autograd(True, fullgraph=False, dynamic=False)
    if form == "enable":
        return compiled_autograd._enable(torch.compile(backend=compile_backend))
    return contextlib.nullcontext()
