"""`fh.AdamW` and `fh.SGD`: torch's optimizers, stepped by fusedhooks' kernels.

They subclass `torch.optim.AdamW` and `torch.optim.SGD`: the same hyper-parameters and checks, `param_groups` (LR
schedulers change `lr` as usual) and `state_dict` layout (`step`, `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`;
`momentum_buffer`), which loads into torch's optimizers and from them. Only `step()` differs: for the parameters of
a group on one device with one dtype (fp32, bf16, fp16, fp64), one launch (`kernels.optim`) reads each gradient,
parameter and state once and writes the parameter and its states once, computing as torch's fused optimizers do (in
fp32 for 16-bit and fp32 tensors, rounded once per stored value). The learning rate, betas, eps, weight decay and
the step counts are read on the device at each launch: a schedule compiles nothing new. A step keeps `step` of
each parameter as a float32 tensor on the parameter's device, as torch's fused optimizers do. With
`stochastic_rounding=True` (off by default) the bf16 parameters' stores are rounded stochastically, seeded by `seed=`;
with `master_weights=True` 16-bit parameters are stepped through fp32 copies (`state["master_param"]`) with fp32
states (docs/optimizers.md).

Like torch's fused optimizers they read `grad_scale` and `found_inf` (float32 0-dim tensors) when set as attributes
(`_step_supports_amp_scaling`): `scaler.step(opt)` sets them (AMP's scale and whether a gradient overflowed), and
`fh.clip_grad_norm_(hook, max_norm, optimizer=opt)` and `fh.zclip(...).step(optimizer=opt)` fold their coefficient
into `grad_scale` (fusedhooks.clipping.fold). Each gradient is divided by `grad_scale` as torch's fused kernels
divide it, but the quotient is not written back: `.grad` keeps the gradient as the backward left it. A non-zero
`found_inf` leaves parameters and states as they were and takes the step count back, on the device.

Parameters the kernels do not take (not contiguous, or on a device with neither CUDA nor the Triton interpreter:
CPU without TRITON_INTERPRET=1) are stepped by torch's own single-tensor implementation, with the same state; with
`grad_scale` or `found_inf` set, their step reads found_inf on the host (one sync) and divides out of place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.optim.adam import adam as torch_adam
from torch.optim.sgd import sgd as torch_sgd

from ..firing import optable
from ..runtime import launcher
from ..runtime.layout import is_dtensor
from ..stats.backwards import GraphTask, same_backward, track

__all__ = ["AdamW", "SGD"]

#: the dtypes the kernels step (kernels.multi_tensor.TL_DTYPES; the kernels import triton, so they are imported at
#: the first step)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel reads for `t`: this rank's shard of a DTensor (FSDP2, tensor parallel), else `t`."""
    return t._local_tensor if is_dtensor(t) else t


def _takes(p: torch.Tensor, states: list[torch.Tensor]) -> bool:
    """Do the kernels step `p` (its gradient and its states `states`): a Triton device, a dtype they know, every
    tensor contiguous, the gradient of the parameter's dtype; a DTensor's shards, where its gradient and states are
    placed as it is (the step is elementwise: each rank steps its shard; a Partial gradient goes to torch's step)."""
    g = p.grad
    if is_dtensor(p) and not all(is_dtensor(t) and t.placements == p.placements for t in [g, *states]):
        return False
    return (p.dtype in KERNEL_DTYPES and g.dtype == p.dtype and _local(p).is_contiguous()
            and _local(g).is_contiguous() and all(_local(s).is_contiguous() for s in states)
            and launcher.choose_backend(p.device) == "triton")


def _addresses(tensors: list[torch.Tensor]) -> list[int]:
    """The data addresses of `tensors` (of a DTensor: this rank's shard's)."""
    return [_local(t).data_ptr() for t in tensors]


def _hyper(values: list, device: torch.device) -> torch.Tensor:
    """fp64 [len(values)] on `device`, without a host sync (a tensor value, as a tensor lr, is copied on the
    device)."""
    hyper = launcher.host_to_device([0.0 if isinstance(v, torch.Tensor) else float(v) for v in values],
                                    torch.float64, device)
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            hyper[i].copy_(v.reshape(()), non_blocking=True)
    return hyper


class _Scaling:
    """`grad_scale` and `found_inf` of one step (None where not set), and their copies on each device."""

    def __init__(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None):
        self.grad_scale, self.found_inf = grad_scale, found_inf
        self._copies: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._skipped: bool | None = None

    def on(self, name: str, device: torch.device) -> torch.Tensor | None:
        """`grad_scale` or `found_inf` (`name`) as float32 on `device` (copied without a host sync)."""
        value = getattr(self, name)
        if value is None:
            return None
        copy = self._copies.get((name, device))
        if copy is None:
            copy = self._copies[(name, device)] = value.to(device=device, dtype=torch.float32, non_blocking=True)
        return copy

    def skipped_on_host(self) -> bool:
        """Is the step skipped (found_inf non-zero)? A host sync where found_inf is set: for the steps that cannot
        skip on the device."""
        if self._skipped is None:
            self._skipped = self.found_inf is not None and bool(self.found_inf.item())
        return self._skipped

    def divided(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """`grads` divided by grad_scale (out of place: .grad is left as it is), or `grads` when it is not set."""
        if self.grad_scale is None:
            return grads
        return [g / self.on("grad_scale", g.device) for g in grads]


@dataclass
class _Books:
    """What an optimizer keeps for its launches, of this process only (device tensors, addresses, ids: not pickled,
    made again at the next step)."""

    tables: dict = field(default_factory=dict)  # (group index, device, dtype, tag) -> kernels.optim.OptimTable
    zeros: dict = field(default_factory=dict)  # device -> a found_inf of 0.0
    hyper: dict = field(default_factory=dict)  # (group index, device) -> (the values, their fp64 device tensor)
    versions: dict = field(default_factory=dict)  # id(param) -> its version after the last step (master weights)
    in_backward: set = field(default_factory=set)  # ids of the parameters stepped inside the backward


class _KernelSteps:
    """The step both optimizers share: the books of their launches (`_Books`), grad_scale and found_inf, the
    precision options, state_dict with master weights, and the step inside the backward."""

    #: GradScaler.step sets `grad_scale` and `found_inf` on the optimizer and lets its step read them (module docstring)
    _step_supports_amp_scaling = True

    def _books(self) -> _Books:
        books = self.__dict__.get("_fh_books")
        if books is None:
            books = self.__dict__["_fh_books"] = _Books()
        return books

    def _table(self, key: tuple, parts: dict, device: torch.device):
        """The kernels.optim.OptimTable of `parts` for `key` (group index, device, dtype, tag), kept while `parts`
        stay."""
        from ..kernels import optim as kernels

        tables = self._books().tables
        table = tables.get(key)
        if table is None or table.key != kernels.table_key(parts):
            table = tables[key] = kernels.build_table(parts, device, key[2].itemsize)
        return table

    def _init_precision(self, stochastic_rounding: bool, seed: int, master_weights: bool) -> None:
        """Stochastic rounding of the bf16 parameters' stores (off by default): each launch draws its random bits
        from Philox keyed by (seed, launches so far) (`kernels.optim._store_param`). fp32 master weights of the 16-bit
        parameters (off by default): `state["master_param"]`, and their states in fp32."""
        self.master_weights = bool(master_weights)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**31:
            raise ValueError(f"seed= takes an integer in [0, 2**31), not {seed!r}")
        if stochastic_rounding and any(p.dtype == torch.float16 for g in self.param_groups for p in g["params"]):
            raise ValueError("stochastic_rounding=True rounds bfloat16 parameters (as torchao's "
                             "bf16_stochastic_round); float16 ones are rounded to nearest only: leave it off for "
                             "float16 parameters")
        self.stochastic_rounding, self.seed = bool(stochastic_rounding), seed
        self._fh_launches = 0

    def _rounding(self, dtype: torch.dtype) -> tuple[bool, list[int]]:
        """(round this launch's `dtype` parameters stochastically, the hyper-parameters that adds: its seed)."""
        if not (self.stochastic_rounding and dtype in (torch.bfloat16, torch.float16)):
            return False, []
        self._fh_launches += 1
        return True, [(self.seed * 1_000_003 + self._fh_launches) % 2**53]

    def _check_fallback(self, params: list[torch.Tensor]) -> None:
        """Refuse torch's single-tensor step (which rounds to nearest, and keeps no master weights) of bf16
        parameters to be rounded stochastically, and of parameters with master weights."""
        if self.stochastic_rounding and any(p.dtype == torch.bfloat16 for p in params):
            raise RuntimeError("stochastic_rounding=True: the bfloat16 parameters torch's single-tensor step would "
                               "take (not contiguous, or on CPU without TRITON_INTERPRET=1) would be rounded to "
                               "nearest: make them contiguous, or leave stochastic_rounding off")
        if any(self._keeps_master(p.dtype) for p in params):
            raise RuntimeError("master_weights=True: torch's single-tensor step, which would take some 16-bit "
                               "parameters here (not contiguous, or on CPU without TRITON_INTERPRET=1), keeps no fp32 "
                               "master weights: make them contiguous, or leave master_weights off")

    def _keeps_master(self, dtype: torch.dtype) -> bool:
        """Do parameters of `dtype` have fp32 master weights (master_weights=True, 16-bit)?"""
        return self.master_weights and dtype in (torch.float16, torch.bfloat16)

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype of p's states: fp32 with master weights, else p's (torch's layout)."""
        return torch.float32 if self._keeps_master(p.dtype) else p.dtype

    def _master_of(self, p: torch.Tensor, state: dict, keys: tuple[str, ...]) -> int:
        """The address of p's fp32 master weights, or 0 without master weights. Made from p (and its states `keys`
        widened to fp32) where a state came without them (torch's, or master_weights turned on), where they are not
        fp32 (torch's load_state_dict casts them), and where p was written since this optimizer's last step (its
        version moved: model.load_state_dict, an in-place edit): the parameter then wins over a stale master."""
        if not self._keeps_master(p.dtype):
            return 0
        master = state.get("master_param")
        versions = self._books().versions
        if (master is None or master.dtype != torch.float32 or master.shape != p.shape
                or versions.get(id(p), p._version) != p._version):
            state["master_param"] = p.detach().float().contiguous()
        versions[id(p)] = p._version  # the kernel writes p without moving its version
        for key in keys:
            if key in state and state[key].dtype != torch.float32:
                state[key] = state[key].float()
        return _local(state["master_param"]).data_ptr()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load_state_dict, which casts every state to its parameter's dtype; with master weights the fp32
        states saved (master_param, moments, momentum buffers) are put back in fp32, unrounded."""
        super().load_state_dict(state_dict)
        if not self.master_weights:
            return
        params = [p for group in self.param_groups for p in group["params"]]
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        for p, i in zip(params, saved_ids):
            saved = state_dict["state"].get(i, {})
            if not self._keeps_master(p.dtype):
                continue
            for key, value in saved.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                    self.state[p][key] = value.to(device=p.device, copy=True)

    def _states_of(self, params: list[torch.Tensor], state_dicts: list[dict] | None) -> dict[int, dict]:
        """id(p) -> the state a step of `params` reads and writes: `state_dicts` (in their order) when given, else
        the optimizer's `state[p]`."""
        if state_dicts is None:
            state_dicts = [self.state[p] for p in params]
        return {id(p): state for p, state in zip(params, state_dicts)}

    def _hyper_for(self, index: int, values: list, device: torch.device) -> torch.Tensor:
        """`_hyper(values, device)` for group `index`, the last one kept per (group, device) and reused while the
        values stay: the firings of one step inside the backward copy them to the device once."""
        if any(isinstance(v, torch.Tensor) for v in values):
            return _hyper(values, device)
        kept = self._books().hyper
        values = tuple(float(v) for v in values)
        entry = kept.get((index, device))
        if entry is None or entry[0] != values:
            entry = kept[(index, device)] = (values, _hyper(list(values), device))
        return entry[1]

    def _found_inf(self, scaling: _Scaling, device: torch.device) -> torch.Tensor:
        """The found_inf the kernels read on `device`: the step's, or a kept 0.0."""
        found_inf = scaling.on("found_inf", device)
        if found_inf is None:
            zeros = self._books().zeros
            found_inf = zeros.get(device)
            if found_inf is None:
                found_inf = zeros[device] = torch.zeros((), device=device)
        return found_inf

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every parameter with a gradient (`_step_group` of each group); returns what `closure`
        (re-evaluating the loss) returns."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scaling = _Scaling(getattr(self, "grad_scale", None), getattr(self, "found_inf", None))  # read after closure
        in_backward = self._books().in_backward
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None and id(p) not in in_backward]
            self._step_group(index, group, scaling, params, "group")
        return loss

    def step_in_backward(self, params, keep_grads: bool = False) -> BackwardSteps:
        """Step `params` (some of this optimizer's) inside the backward, each at its gradient's firing: returns a
        BackwardSteps, the post-accumulate hook that steps one parameter. `hook.register(model, optimizer=opt)`
        calls it and runs it right after the hook's own firing; `opt.step()` then leaves these parameters alone."""
        return BackwardSteps(self, list(params), keep_grads)

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_fh_books", None)  # this process's (`_Books`)
        return state


def _by_device_dtype(params: list[torch.Tensor]) -> dict[tuple, list[int]]:
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.device, p.dtype), []).append(i)
    return groups


#: What a second step of one parameter in one backward is refused with
STEPPED_TWICE_MESSAGE = (
    "{name}: its gradient fired twice in one backward, and the optimizer stepped it at the first firing, from a "
    "partial gradient: the parameter is used in several reentrant activation checkpoints (or inside one and outside "
    "it, or in nested backwards), whose backwards each fire its hooks. Use checkpoint(..., use_reentrant=False), "
    "which fires each hook once per backward, or step after the backward (opt.step())")


class BackwardSteps:
    """The optimizer step inside the backward (`opt.step_in_backward(params)`, `hook.register(model,
    optimizer=opt)`): called on a parameter after its gradient is accumulated (and processed by the hook), it
    steps that parameter alone, as `opt.step()` would with the gradient as it is (its group's hyper-parameters
    and lr read now), then sets `.grad = None` unless `keep_grads`, so that no gradient outlives its firing.
    `opt.step()` leaves these parameters alone until `remove()`. A parameter fired twice in one backward is refused
    (STEPPED_TWICE_MESSAGE) rather than stepped twice; one whose firing never came (a backward that raised before
    it) is not stepped.

    Per parameter this is a firing's worth of host work: the step count's increment and one launch (its table kept
    while the gradient's address stays; the hyper-parameters' device copy shared by the step's firings).

    In a backward that compiled autograd traces, the step is one `fusedhooks::step_in_backward` call (optim/traced.py)
    on the parameter, its gradient and its state's tensors (made in the graph at a first step), and `.grad = None`
    is traced after it: no graph break. A parameter with fp32 master weights, or a DTensor, is stepped outside the
    graph, as in a hook frame dynamo compiles on its own (compiled autograd off)."""

    def __init__(self, optimizer: _KernelSteps, params: list[torch.Tensor], keep_grads: bool):
        groups = {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
        missing = [i for i, p in enumerate(params) if id(p) not in groups]
        if missing:
            raise ValueError(f"step_in_backward: {len(missing)} of the {len(params)} tensors (the first at position "
                             f"{missing[0]}) are not parameters of this {type(optimizer).__name__}: build the "
                             "optimizer on the parameters the hook is registered on")
        self.optimizer, self.keep_grads = optimizer, bool(keep_grads)
        self._groups = {id(p): groups[id(p)] for p in params}
        self._last: dict[int, GraphTask | None] = {}  # id(param) -> the backward of its last step
        in_backward = optimizer._books().in_backward
        self._ids = set(self._groups) - in_backward
        in_backward |= self._ids
        self._params = params
        self._group_of_slot = [groups[id(p)] for p in params]  # each parameter's group, by position in `params`
        #: the parameters this object steps -> their position in `params` (a dict keyed by the tensors: what the
        #: traced hook looks a parameter up in)
        self._slots = {p: k for k, p in enumerate(params) if id(p) in self._ids}
        self.key = optable.add(self)  # what fusedhooks::step_in_backward names it by

    def __call__(self, param: torch.Tensor) -> None:
        if torch.compiler.is_dynamo_compiling():
            self._trace(param)
        else:
            self._step(param)

    @torch.no_grad()
    def _step(self, param: torch.Tensor) -> None:
        """The step of `param` at its firing, eagerly."""
        if param.grad is None or id(param) not in self._ids:
            return
        self._count(param)
        index = self._groups[id(param)]
        self.optimizer._step_group(index, self.optimizer.param_groups[index], _Scaling(None, None), [param],
                                   id(param))
        if not self.keep_grads:
            param.grad = None

    def _count(self, param: torch.Tensor) -> None:
        """Refuse a second step of `param` in the backward of its first (STEPPED_TWICE_MESSAGE)."""
        task = track(torch._C._current_graph_task_id())
        if same_backward(self._last.get(id(param))):
            raise RuntimeError(STEPPED_TWICE_MESSAGE.format(name=f"a parameter of shape {tuple(param.shape)}"))
        self._last[id(param)] = task

    def leaves_graph(self, param: torch.Tensor) -> bool:
        """While dynamo traces the hook: is `param` stepped outside the graph? Outside a backward that compiled
        autograd traces (a hook frame dynamo compiles on its own), and for a parameter with fp32 master weights
        (kept by the parameter's identity and version, which a functionalized copy has not) or a DTensor. Asked
        before anything is traced that differs between parameters (a lookup by the parameter would guard its
        identity: a recompile each at the graph break), by `register`'s hook too (`stepping`)."""
        from ..firing.traced import compiled_autograd_traces

        return not compiled_autograd_traces() or self.optimizer._keeps_master(param.dtype) or is_dtensor(param)

    def _trace(self, param: torch.Tensor) -> None:
        """`__call__` while dynamo traces it: one fusedhooks::step_in_backward call, or the eager step outside the
        graph where it `leaves_graph`."""
        if self.leaves_graph(param):
            from ..firing import ops

            ops.outside_graph(self._step, param)
            return
        slot = self._slots.get(param)
        if param.grad is None or slot is None:
            return
        from . import traced

        states, first = self.optimizer.traced_states(self._group_of_slot[slot], param)
        traced.step_in_backward(param, param.grad, states, self.key, slot, first)
        if not self.keep_grads:
            param.grad = None

    @torch.no_grad()
    def step_given(self, param: torch.Tensor, grad: torch.Tensor, states: list[torch.Tensor], slot: int,
                   first: bool) -> None:
        """The implementation of fusedhooks::step_in_backward: the step of the parameter at position `slot` of
        `params`, on `param` (it, or aot_autograd's copy of it) from `grad` with `states` (its state's tensors in the
        order of `state_names`, or copies; `first`: made for this step, unwritten: SGD's momentum buffer, which the
        first step sets to the gradient). Only these tensors are written: the compiled graph copies them back."""
        real = self._params[slot]
        if id(real) not in self._ids:  # removed since the graph was compiled
            return
        self._count(real)
        index = self._group_of_slot[slot]
        names = self.optimizer.state_names(index)
        state = {} if first else dict(zip(names, states))
        kept = param.grad
        param.grad = grad
        try:
            self.optimizer._step_group(index, self.optimizer.param_groups[index], _Scaling(None, None), [param],
                                       ("traced", slot), [state])
        finally:
            param.grad = kept
        for name, handed in zip(names, states):
            if state[name] is not handed:
                handed.copy_(state[name])

    def remove(self) -> None:
        """`opt.step()` steps these parameters again; this object steps nothing more."""
        self.optimizer._books().in_backward.difference_update(self._ids)
        self._ids = set()


class AdamW(_KernelSteps, torch.optim.AdamW):
    """torch.optim.AdamW (lr, betas, eps, weight_decay, amsgrad, maximize), stepped by one kernel per device and
    dtype of each group (see the module docstring). `foreach`, `capturable`, `differentiable` and `fused` are not
    taken: the step is fusedhooks'."""

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 stochastic_rounding: bool = False, seed: int = 0, master_weights: bool = False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize)
        self._init_precision(stochastic_rounding, seed, master_weights)

    def _ready_state(self, state: dict, p: torch.Tensor, amsgrad: bool) -> None:
        """Make p's `state` (empty: zeros and a step count of 0, as torch's fused AdamW), its step count a float32
        tensor on p's device (torch's optimizers keep it on the CPU)."""
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            dtype = self._state_dtype(p)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        elif state["step"].device != p.device or state["step"].dtype != torch.float32:
            state["step"] = state["step"].to(device=p.device, dtype=torch.float32)  # from torch's CPU count

    def state_names(self, index: int) -> tuple[str, ...]:
        """The state of a parameter of group `index`, in the order a traced step in the backward is handed it."""
        amsgrad = self.param_groups[index]["amsgrad"]
        return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())

    def traced_states(self, index: int, p: torch.Tensor) -> tuple[list[torch.Tensor], bool]:
        """While compiled autograd traces a step of `p` (of group `index`) in the backward: the tensors of its state
        (`state_names`), made first where it has none (in the graph, stored after it runs), and False: AdamW's state
        starts as zeros, which the step reads as torch's does."""
        state = self.state[p]
        self._ready_state(state, p, self.param_groups[index]["amsgrad"])
        return [state[name] for name in self.state_names(index)], False

    def _step_group(self, index: int, group: dict, scaling: _Scaling, params: list, tag,
                    state_dicts: list[dict] | None = None) -> None:
        """Step `params` (of group `index`, each with a gradient); `tag`: which launch tables they keep ("group",
        or one parameter's id in the backward); `state_dicts`: their states (default: the optimizer's)."""
        amsgrad, (beta1, beta2) = group["amsgrad"], group["betas"]
        state_of = self._states_of(params, state_dicts)
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            self._ready_state(state_of[id(p)], p, amsgrad)
        kernel, torch_steps = [], []
        for p in params:
            state = state_of[id(p)]
            states = [state["exp_avg"], state["exp_avg_sq"]] + ([state["max_exp_avg_sq"]] if amsgrad else [])
            (kernel if _takes(p, states) else torch_steps).append(p)
        if kernel:
            from ..kernels.optim import adamw_
        for (device, dtype), members in _by_device_dtype(kernel).items():
            ps = [kernel[i] for i in members]
            steps = [state_of[id(p)]["step"] for p in ps]
            torch._foreach_add_(steps, 1)
            live = [p for p in ps if _local(p).numel()]
            if not live:
                continue
            masters = [self._master_of(p, state_of[id(p)], ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
                       for p in live]
            parts = {"param": _addresses(live), "grad": _addresses([p.grad for p in live]),
                     "state1": _addresses([state_of[id(p)]["exp_avg"] for p in live]),
                     "state2": _addresses([state_of[id(p)]["exp_avg_sq"] for p in live]),
                     "state3": _addresses([state_of[id(p)]["max_exp_avg_sq"] for p in live]) if amsgrad else
                     [0] * len(live),
                     "step": [state_of[id(p)]["step"].data_ptr() for p in live],
                     "numel": [_local(p).numel() for p in live], "first_step": [0] * len(live), "master": masters}
            table = self._table((index, device, dtype, tag), parts, device)
            stochastic, seed = self._rounding(dtype)
            hyper = self._hyper_for(index, [group["lr"], beta1, beta2, group["eps"], group["weight_decay"]] + seed,
                                    device)
            found_inf = self._found_inf(scaling, device)
            adamw_(table, hyper, scaling.on("grad_scale", device), found_inf, dtype, amsgrad, group["maximize"],
                   launcher.launch, stochastic, self._keeps_master(dtype))
            if scaling.found_inf is not None:  # as torch's fused step: a skipped step does not count
                torch._foreach_sub_(steps, [found_inf] * len(steps))
        if torch_steps and not scaling.skipped_on_host():
            self._check_fallback(torch_steps)
            states = [state_of[id(p)] for p in torch_steps]
            torch_adam(
                torch_steps, scaling.divided([p.grad for p in torch_steps]), [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states], [s["max_exp_avg_sq"] for s in states] if amsgrad else [],
                [s["step"] for s in states], foreach=False, capturable=False, differentiable=False, fused=False,
                has_complex=any(torch.is_complex(p) for p in torch_steps), decoupled_weight_decay=True,
                amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                eps=group["eps"], maximize=group["maximize"])


class SGD(_KernelSteps, torch.optim.SGD):
    """torch.optim.SGD (lr, momentum, dampening, weight_decay, nesterov, maximize), stepped by one kernel per device
    and dtype of each group (see the module docstring). `foreach`, `differentiable` and `fused` are not taken."""

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 stochastic_rounding: bool = False, seed: int = 0, master_weights: bool = False):
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov, maximize=maximize)
        self._init_precision(stochastic_rounding, seed, master_weights)

    def state_names(self, index: int) -> tuple[str, ...]:
        """The state of a parameter of group `index`, in the order a traced step in the backward is handed it."""
        return ("momentum_buffer",) if self.param_groups[index]["momentum"] != 0 else ()

    def traced_states(self, index: int, p: torch.Tensor) -> tuple[list[torch.Tensor], bool]:
        """While compiled autograd traces a step of `p` (of group `index`) in the backward: the tensors of its state
        (`state_names`), and whether they are made here (in the graph, stored after it runs): the momentum buffer
        of a first step, unwritten, which the step sets to the gradient as torch's first step does."""
        if not self.state_names(index):
            return [], False
        buf = self.state[p].get("momentum_buffer")
        if buf is not None:
            return [buf], False
        buf = self.state[p]["momentum_buffer"] = torch.empty_like(p, dtype=self._state_dtype(p))
        return [buf], True

    def _step_group(self, index: int, group: dict, scaling: _Scaling, params: list, tag,
                    state_dicts: list[dict] | None = None) -> None:
        """Step `params` (of group `index`, each with a gradient); `tag`: which launch tables they keep ("group",
        or one parameter's id in the backward); `state_dicts`: their states (default: the optimizer's)."""
        momentum = group["momentum"]
        state_of = self._states_of(params, state_dicts)
        kernel, torch_steps = [], []
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("fh.SGD steps dense gradients: use torch.optim.SGD for sparse ones")
            buf = state_of[id(p)].get("momentum_buffer")
            (kernel if _takes(p, [] if buf is None else [buf]) else torch_steps).append(p)
        if kernel:
            from ..kernels.optim import sgd_
        starts = momentum != 0 and any(state_of[id(p)].get("momentum_buffer") is None for p in kernel)
        if starts and scaling.skipped_on_host():
            # a momentum buffer starts as the first stepped gradient: whether this step is skipped decides whether it
            # starts now (one host sync, at the first step only)
            return
        for (device, dtype), members in _by_device_dtype(kernel).items():
            ps = [kernel[i] for i in members]
            first = [int(momentum != 0 and state_of[id(p)].get("momentum_buffer") is None) for p in ps]
            if momentum != 0:
                for p, is_first in zip(ps, first):
                    if is_first:  # the kernel writes it: the gradient (weight decay included), as torch's clone
                        state_of[id(p)]["momentum_buffer"] = torch.empty_like(p, dtype=self._state_dtype(p))
            first = [f for p, f in zip(ps, first) if _local(p).numel()]
            live = [p for p in ps if _local(p).numel()]
            if not live:
                continue
            masters = [self._master_of(p, state_of[id(p)], ("momentum_buffer",)) for p in live]
            parts = {"param": _addresses(live), "grad": _addresses([p.grad for p in live]),
                     "state1": _addresses([state_of[id(p)]["momentum_buffer"] for p in live]) if momentum != 0 else
                     [0] * len(live),
                     "state2": [0] * len(live), "state3": [0] * len(live), "step": [0] * len(live),
                     "numel": [_local(p).numel() for p in live], "first_step": first, "master": masters}
            table = self._table((index, device, dtype, tag), parts, device)
            stochastic, seed = self._rounding(dtype)
            hyper = self._hyper_for(index, [group["lr"], momentum, group["dampening"], group["weight_decay"]] + seed,
                                    device)
            sgd_(table, hyper, scaling.on("grad_scale", device), self._found_inf(scaling, device), dtype,
                 momentum != 0, group["nesterov"], group["maximize"], launcher.launch, stochastic,
                 self._keeps_master(dtype))
        if torch_steps and not scaling.skipped_on_host():
            self._check_fallback(torch_steps)
            bufs = [state_of[id(p)].get("momentum_buffer") for p in torch_steps]
            torch_sgd(torch_steps, scaling.divided([p.grad for p in torch_steps]), bufs, foreach=False, fused=False,
                      weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
                      dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"])
            if momentum != 0:
                for p, buf in zip(torch_steps, bufs):
                    state_of[id(p)]["momentum_buffer"] = buf
