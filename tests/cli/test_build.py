"""Ahead-of-time builds for GPU targets, without a GPU (`python -m fusedhooks build`, fusedhooks/cli/build.py).

Every kernel family compiles for cuda:80, cuda:90 and hip:gfx942, and none spills registers on any of them at the
runtime's BLOCK and warps (every dtype); on cuda:90 the other gates hold: at most 128 registers per thread, and 128-bit
loads and stores of an aligned, divisible gradient (fp32, bf16, fp16). The build runs once, in a subprocess without
TRITON_INTERPRET (with it, triton.jit makes interpreter functions, which compile for no target).
"""

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from fusedhooks.cli import build
from fusedhooks.codegen import generate as codegen
from fusedhooks.compiler import dims
from fusedhooks.compiler.plan import make_plan

TARGETS = ("cuda:80", "cuda:90", "hip:gfx942")
GATED_DTYPES = ("fp32", "bf16", "fp16")
#: the kernels over a launch table of whole tensors (the global clip's scale, the optimizer steps), written by hand
MULTI_TENSOR_KERNELS = ("scale_kernel", "adamw_kernel", "sgd_kernel")


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("build") / "reports.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "fusedhooks", "build", "--target", "all", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def _of(reports, target, dtypes=None):
    return [r for r in reports if r["target"] == target and (dtypes is None or r["dtype"] in dtypes)]


@pytest.mark.slow       # the tests of `reports`: about 10 minutes with a cold Triton cache
@pytest.mark.parametrize("target", TARGETS)
def test_every_kernel_family_builds(reports, target):
    built = _of(reports, target)
    assert [r for r in built if r["error"]] == []
    kernels = {r["kernel"] for r in built}
    assert {"fused_hook", "fused_hook_multi", "fused_hook_single", "reduce_level1", "reduce_level1_multi",
            "scale_kernel", "adamw_kernel", "sgd_kernel", "fused_hook_units", "fused_hook_units_multi",
            "reduce_units1_0", "reduce_units1_0_multi",
            "reduce_whole2_0", "reduce_whole2_0_multi"} <= kernels
    families = {r["family"] for r in built}
    assert {"clip+scale+stats+hist", "clip+scale+stats+hist+amp", "clip+scale+stats+hist+shard", "stats-only",
            "normalise-by-norm", "standardise", "weight-decay(param)", "global-clip-scale", "agc(rows, one pass)",
            "column-norm(two passes)", "factored(rows+columns+whole)", "pow+selects",
            "broadcast-result", "clip+moments", "clip+moments+shard", "optimizer-step", "optimizer-step+amsgrad",
            "optimizer-step+master", "optimizer-step+stochastic"} <= families
    assert {r["dtype"] for r in built} == {"fp32", "bf16", "fp16", "fp64"}
    general = [r for r in _of(reports, "cuda:90") if not r["family"].endswith("+full")]
    assert len([r for r in built if not r["family"].endswith("+full")]) == len(general), "every target builds them"
    full = {(r["family"].removesuffix("+full"), r["dtype"], r["kernel"]) for r in _of(reports, "cuda:90")
            if r["family"].endswith("+full")}
    assert full and full <= {(r["family"], r["dtype"], r["kernel"]) for r in general}, "cuda:90: FULL_BLOCKS too"
    assert all(r["registers"] for r in built), "the report names every kernel's registers"


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_no_kernel_spills(reports, target):
    built = _of(reports, target)
    assert built and all(r["spills"] is not None for r in built), "the report names every kernel's spills"
    spilling = [(r["family"], r["dtype"], r["kernel"], r["spills"]) for r in built if r["spills"]]
    assert spilling == []


@pytest.mark.slow
def test_cuda90_registers_at_most_128(reports):
    heavy = [(r["family"], r["dtype"], r["kernel"], r["registers"])
             for r in _of(reports, "cuda:90") if r["registers"] > 128]
    assert heavy == []


@pytest.mark.slow
def test_cuda90_gradient_accesses_are_128_bit_vectors(reports):
    """For an aligned gradient whose size is a multiple of 16 bytes: the widest global load of every kernel, and
    the widest store of every kernel that writes the gradient, is 128 bits; for fp16/bf16 (where only the gradient
    is 16 bits wide) no scalar gradient access is left in the generated kernels."""
    bad = []
    for r in _of(reports, "cuda:90", GATED_DTYPES):
        writes_gradient = not (r["kernel"].startswith("reduce_") or r["family"].startswith("stats-only"))
        if r["load_bits"][1] != 128 or (writes_gradient and r["store_bits"][1] != 128):
            bad.append((r["family"], r["dtype"], r["kernel"], r["load_bits"], r["store_bits"]))
        generated = r["kernel"] not in MULTI_TENSOR_KERNELS  # their masked tails are scalar by design
        if generated and r["dtype"] in ("fp16", "bf16") and r["scalar_element_accesses"]:
            bad.append((r["family"], r["dtype"], r["kernel"], "scalar", r["scalar_element_accesses"]))
    assert bad == []


def test_build_refuses_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = argparse.Namespace(target="cuda:90", dtypes="fp32", num_warps=None, json=None)
    with pytest.raises(argparse.ArgumentTypeError, match="unset TRITON_INTERPRET"):
        build.main(args)


@pytest.mark.parametrize("family", list(build.families()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_generated_signatures_match_the_kernels(family, dtype):
    """SIGNATURES (what ahead-of-time builds compile with) lists every kernel's arguments, in order, and the launch
    spec (what the runtime binds arguments from) names the same arguments in the same order, and every kernel."""
    hook = build.families()[family]
    graph = hook.graph(dtype, build.DIMS_SHAPE if hook.reduces_over_dims else None)
    plan = make_plan(graph, hook.stat_names, hook.input_stat_names, hist_range=hook.hist_range)
    module = codegen.load(*codegen.generate_with_spec(plan, "cpu"))
    spec = module.SPEC
    assert module.SIGNATURES
    for name, signature in module.SIGNATURES.items():
        assert list(signature) == list(getattr(module, name).arg_names), name
        assert all(t == "constexpr" or t == "i32" or t.startswith("*") for t in signature.values())
        roles = spec.multi_args if name.endswith("_multi") else spec.args
        assert [_argument(role) for role in roles] == list(signature), name
    launched = set(spec.kernels) | set(spec.single_kernels) | set(spec.multi_kernels)
    assert launched == set(module.SIGNATURES)
    whole = [n for n in plan.graph.reductions() if not dims.is_dim_reduction(n)]  # (over dims: see spec.units_values)
    assert spec.n_slots == len(plan.slots) and spec.n_reductions == len(whole)


def _argument(role: str) -> str:
    """The kernel argument of a LaunchSpec role (pointers end in _ptr)."""
    return role if role in ("numel", "n_tensors", "n_units", "unit_numel", "ALIGNED", "BLOCK", "RBLOCK", "UNITS",
                            "ELEMENTS", "FULL_BLOCKS") else role + "_ptr"


def test_partials_row_width_is_the_kernels():
    from fusedhooks.kernels.stats import N_PARTIALS

    assert codegen.PARTIAL_WIDTH == N_PARTIALS.value


def test_aligned_hint_follows_alignment_and_size():
    from fusedhooks.runtime.launcher import aligned

    x = torch.zeros(64)
    assert aligned(x) and aligned(x, None)
    assert not aligned(x[1:])           # 4 bytes past an aligned address
    assert not aligned(x[:63])          # 252 bytes: not a multiple of 16
    assert aligned(torch.zeros(8, dtype=torch.bfloat16)) and not aligned(torch.zeros(7, dtype=torch.bfloat16))
