"""Traces `runtime.fire_traced` on fake CUDA tensors, without a GPU, for every kernel family of `fusedhooks build`
(tests/firing/test_traced_firing.py runs it in a process without TRITON_INTERPRET: with it, triton.jit makes interpreter
functions, which wrap_triton launches directly instead of tracing).

For each family, dtype and gradient size, `make_fx` records the firing; the graph must hold the kernels `fire`
launches (module.SPEC.kernels_for(grid), in order, on spec.grid_of's grids) as triton_kernel_wrapper nodes whose
arguments are the graph's own tensors (the gradient, the statistics row, the scalars) and workspace buffers the
graph allocates (no captured constant, counters and histograms zeroed), with ALIGNED False; and torch's TTIR
analysis (the one functionalization and inductor use, here against a cuda:90 target) must find that the kernels
write the gradient (when the body writes) and the statistics row, and never the parameter or a scalar. Prints one
line per case checked, then "checked N cases"; exits non-zero at the first failure.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
import triton
from torch._higher_order_ops.triton_kernel_wrap import (
    get_mutated_tensors,
    kernel_side_table,
    triton_kernel_wrapper_mutation,
)
from torch._subclasses import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from triton.backends.compiler import GPUTarget

from fusedhooks.cli import build
from fusedhooks.codegen import generate as codegen
from fusedhooks.compiler.plan import make_plan
from fusedhooks.runtime import launcher as runtime
from fusedhooks.runtime import tuning


class _Target:
    """Triton's active driver as torch's TTIR analysis asks it (no GPU here: the target is named, not found)."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cuda")


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


def check(family, hook, dtype, shape, mode, warnings, amp=False) -> str:
    graph = hook.graph(dtype, shape if hook.reduces_over_dims else None)
    plan = make_plan(graph, hook.stat_names, hook.input_stat_names, backend="triton", hist_range=hook.hist_range,
                     amp=amp)
    module = codegen.load(*codegen.generate_with_spec(plan, "cuda"))
    spec = module.SPEC
    with mode:
        grad = torch.empty(shape, dtype=dtype, device="cuda")
        param = torch.empty(shape, dtype=dtype, device="cuda")
        row = torch.empty(len(plan.slots), dtype=torch.float64, device="cuda") if plan.slots else None
        scale = torch.empty((), dtype=torch.float32, device="cuda")
        found_inf = torch.empty((), dtype=torch.float32, device="cuda")
        scalars = [torch.empty(s.shape, dtype=s.dtype, device="cuda") for s in hook.scalars]

    def firing(grad, param, row, scale, found_inf, scalars):
        runtime.fire_traced(plan, module, grad, param, scalars, row, (scale, found_inf) if amp else None)

    with mode:
        gm = make_fx(firing)(grad, param, row, scale, found_inf, scalars)
    where = f"{family}{' (scaler=)' if amp else ''} {dtype} {tuple(shape)}"
    assert not [n for n in gm.graph.nodes if n.op == "get_attr"], f"{where}: a tensor captured as a constant"
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    grad_node, param_node, row_node, scale_node, found_inf_node = inputs[:5]
    scalar_nodes = set(inputs[5:])
    launches = [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_mutation]
    numel = grad.numel()
    block = runtime.block_size(module, torch.device("cuda"), dtype)
    units = runtime.units_launch(block, [plan.units.unit_sizes], dtype.itemsize)["UNITS"] if spec.one_pass else None
    blocks = -(-plan.units.unit_sizes[0] // units) if spec.one_pass else -(-numel // block)
    names = spec.kernels_for(blocks)
    assert len(launches) == len(names), f"{where}: {len(launches)} launches traced, {names} expected"
    written, allocated = set(), {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (torch.ops.aten.zeros.default, torch.ops.aten.empty.memory_format):
            allocated[n] = n.target is torch.ops.aten.zeros.default
    for node, name in zip(launches, names):
        kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        kernel = getattr(kernel, "fn", kernel)  # num_warps made it an Autotuner of one configuration
        assert kernel is getattr(module, name), f"{where}: {kernel} launched where {name} was expected"
        assert node.kwargs["grid"] == [(spec.grid_of(name, blocks), 1, 1)], f"{where}: grid {node.kwargs['grid']}"
        kwargs = {**node.kwargs["kwargs"], **kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"])}
        assert kwargs["ALIGNED"] is False and kwargs["BLOCK"] == block, (where, kwargs)
        for arg, role in zip(kernel.arg_names, spec.args):
            value = kwargs[arg]
            if role == "grad":
                assert value is grad_node, f"{where}: {arg} is {value}, not the gradient"
            elif role == "param":
                assert value is param_node, f"{where}: {arg} is {value}, not the parameter"
            elif role == "stats":
                assert value is row_node, f"{where}: {arg} is {value}, not the statistics row"
            elif role == "scale":
                assert value is scale_node, f"{where}: {arg} is {value}, not GradScaler's scale"
            elif role == "found_inf":
                assert value is found_inf_node, f"{where}: {arg} is {value}, not found_inf"
            elif role.startswith("scalar"):
                assert value in scalar_nodes, f"{where}: {arg} is {value}, not a scalar input"
            elif role in runtime.WORKSPACE_BUFFERS:
                zeroed = runtime.WORKSPACE_BUFFERS[role][1]
                assert allocated.get(value) == zeroed, f"{where}: {arg} ({role}) is {value}, not allocated " + \
                    ("zeroed" if zeroed else "") + " by the graph"
            elif role in ("numel", "n_units", "unit_numel"):
                expected = {"numel": numel, "n_units": plan.units.unit_sizes[0] if plan.units else None,
                            "unit_numel": plan.units.unit_sizes[1] if plan.units else None}[role]
                assert value == expected, f"{where}: {arg} = {value}, {expected} expected"
        before = len(warnings.records)
        values = {k: (v.meta["val"] if isinstance(v, torch.fx.Node) else v) for k, v in node.kwargs["kwargs"].items()}
        with mode:
            mutated = get_mutated_tensors(node.kwargs["kernel_idx"], node.kwargs["constant_args_idx"], values, {})
        assert len(warnings.records) == before, f"{where}: TTIR analysis failed: {warnings.records[before:]}"
        roles = dict(zip(kernel.arg_names, spec.args))
        written |= {roles[arg] for arg in mutated}
    read_only = {"param", "scale"} | {r for r in spec.args if r.startswith("scalar")}
    assert not written & read_only, f"{where}: the analysis finds {written & read_only} written"
    expected_written = ({"grad"} if plan.writes else set()) | ({"stats"} if plan.slots else set()) | \
        ({"found_inf"} if amp else set())
    assert expected_written <= written, f"{where}: {expected_written - written} not found written"
    return f"{where}: {' '.join(names)}, writes {' '.join(sorted(written))}"


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run without TRITON_INTERPRET"
    triton.runtime.driver.set_active(_Target())
    tuning.lookup = lambda module, device: None  # no tuned configuration: there is no GPU to name
    warnings = _Warnings()
    logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").addHandler(warnings)
    mode = FakeTensorMode()
    cases = 0
    for family, hook in build.families().items():
        shapes = [build.DIMS_SHAPE] if hook.reduces_over_dims else [(100,), (3 * 4096 + 5,), (64, 1000)]
        for dtype in (torch.float32, torch.bfloat16):
            for shape in shapes:
                print(check(family, hook, dtype, shape, mode, warnings), flush=True)
                cases += 1
            if family == "clip+scale+stats+hist":  # the AMP variant (scaler=): unscales first, writes found_inf
                print(check(family, hook, dtype, (3 * 4096 + 5,), mode, warnings, amp=True), flush=True)
                cases += 1
    print(f"checked {cases} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
