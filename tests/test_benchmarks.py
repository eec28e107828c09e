"""The benchmark suite runs on CPU and reports every figure it promises (benchmarks/README.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT

WORKLOADS = ("model", "clip_scale", "clip_stats", "normalize", "amp_clip")
PROVIDERS = ("fusedhooks", "fusedhooks buckets", "eager", "eager+item", "torch built-in", "torch.compile", "no hook")
FIELDS = ("workload", "provider", "dtype", "numel", "status", "reason", "median_us", "p20_us", "p80_us",
          "bytes_per_element", "gbps", "copy_gbps", "copy_ratio", "host_us_per_firing", "gradients", "launches",
          "launches_how", "fusedhooks_plan", "vs_fusedhooks", "added_pct")

#: every test runs benchmarks/run.py in a subprocess (about 2.5 minutes for the module on 2 CPU cores)
pytestmark = pytest.mark.slow


def run_bench(out: Path, *args: str, interpret: bool = False) -> tuple[dict, str]:
    """Run benchmarks/run.py --device cpu in a subprocess; returns (results.json, stdout)."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # conftest sets it for this process; the benchmark's backend is chosen here
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--device", "cpu", "--out", str(out),
                           *args], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), proc.stdout


def by_key(data: dict) -> dict:
    return {(r["workload"], r["provider"], r["dtype"], r["numel"]): r for r in data["results"]}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    return run_bench(tmp_path_factory.mktemp("bench"), "--quick")


def test_quick_run_records_environment(quick):
    data, _ = quick
    assert data["device"]["type"] == "cpu" and data["device"]["name"]
    assert data["device"]["representative"] is False and "NOT representative" in data["device"]["note"]
    assert all(data["versions"][k] for k in ("python", "torch", "triton", "fusedhooks"))
    assert "revision" in data["git"] and "dirty" in data["git"]  # None outside a git checkout
    if (ROOT / ".git").exists():
        assert len(data["git"]["revision"]) == 40
    assert "benchmarks/run.py" in data["command"] and "--quick" in data["command"]
    assert data["fusedhooks_backend"] == "eager"
    assert data["settings"]["timer"] and data["elapsed_s"] > 0


def test_quick_run_has_every_workload_and_provider(quick):
    data, _ = quick
    sizes, dtypes = data["settings"]["sizes"], data["settings"]["dtypes"]
    assert dtypes == ["fp32", "bf16"] and len(sizes) >= 2
    assert {(c["dtype"], c["numel"]) for c in data["copy"]} == {(d, n) for d in dtypes for n in sizes}
    assert all(c["gbps"] > 0 for c in data["copy"])
    results = by_key(data)
    for workload in WORKLOADS:
        for provider in PROVIDERS:
            for dtype in dtypes:
                for numel in [None] if workload == "model" else sizes:
                    r = results[(workload, provider, dtype, numel)]
                    assert set(FIELDS) <= set(r), (workload, provider)
                    assert r["status"] in ("ok", "n/a"), r
                    if r["status"] == "n/a":
                        assert r["reason"], r
    # --quick on CPU leaves torch.compile out, and says so
    assert results[("clip_scale", "torch.compile", "fp32", sizes[0])]["reason"].startswith("not run by --quick")


def test_quick_run_sweep_figures(quick):
    data, _ = quick
    for r in data["results"]:
        if r["workload"] == "model" or r["status"] != "ok":
            continue
        assert 0 < r["p20_us"] <= r["median_us"] <= r["p80_us"], r
        assert r["gbps"] > 0 and r["copy_gbps"] > 0 and r["copy_ratio"] == pytest.approx(r["gbps"] / r["copy_gbps"])
        assert r["host_us_per_firing"] > 0 and r["gradients"] == 1
        assert r["vs_fusedhooks"] > 0
        if r["provider"] in ("fusedhooks", "fusedhooks folded", "fusedhooks step", "fusedhooks in backward"):
            assert isinstance(r["launches"], int) and r["launches"] == r["fusedhooks_plan"]["launches"]
        else:
            assert r["launches"] is None and r["launches_how"].startswith("n/a")
    results = by_key(data)
    small, large = data["settings"]["sizes"][0], data["settings"]["sizes"][-1]

    def fused(workload, dtype, numel):
        return results[(workload, "fusedhooks", dtype, numel)]

    # Structural figures: one read and one write for clip + stats; a norm needs a second pass past one BLOCK.
    assert fused("clip_stats", "fp32", large)["bytes_per_element"] == 8
    assert fused("clip_stats", "bf16", large)["bytes_per_element"] == 4
    assert fused("clip_stats", "fp32", large)["fusedhooks_plan"] == {
        "passes": 1, "writes": 1, "launches": 1, "launches_from": "hook.plan(shape=, dtype=).launches"}
    assert fused("normalize", "fp32", small)["launches"] == 1
    assert fused("normalize", "fp32", large)["launches"] == 2
    assert fused("normalize", "fp32", large)["bytes_per_element"] == 12
    assert fused("amp_clip", "fp32", large)["bytes_per_element"] == 16  # hook r+w, then the clip's r+w
    assert fused("amp_clip", "fp32", large)["launches"] == 2
    # AGC on rows of 1024 elements: one pass over whole rows, reading the gradient and the parameter once
    assert fused("agc", "fp32", large)["fusedhooks_plan"]["passes"] == 1
    assert fused("agc", "fp32", large)["bytes_per_element"] == 12
    assert results[("agc", "eager", "fp32", large)]["bytes_per_element"] == 36
    # the others' bytes follow their known passes
    assert results[("clip_scale", "eager", "fp32", large)]["bytes_per_element"] == 16
    assert results[("clip_scale", "torch built-in", "bf16", large)]["bytes_per_element"] == 12
    assert results[("amp_clip", "torch built-in", "fp32", large)]["bytes_per_element"] == 20


def test_quick_run_model_figures(quick):
    data, _ = quick
    results = by_key(data)
    for dtype in data["settings"]["dtypes"]:
        base = results[("model", "no hook", dtype, None)]
        assert base["status"] == "ok" and base["added_pct"] == 0.0 and base["launches"] == 0
        for provider in ("fusedhooks", "eager", "eager+item", "fusedhooks in backward"):
            r = results[("model", provider, dtype, None)]
            assert r["status"] == "ok" and r["median_us"] > 0, r
            assert r["added_pct"] == pytest.approx(100 * (r["median_us"] - base["median_us"]) / base["median_us"])
            assert r["host_us_per_firing"] > 0 and r["gradients"] == 28
            assert r["gbps"] is None  # no bandwidth figure for a whole step
            assert r["step_peak_mb"] is None  # measured on CUDA only
        fused = results[("model", "fusedhooks", dtype, None)]
        assert 1 <= fused["launches"] <= 28 and fused["launches_how"].startswith("structural: hook.explain()")


def test_quick_run_prints_markdown(quick):
    _, stdout = quick
    assert "NOT representative" in stdout
    assert "| size | dtype | provider | median µs | p20–p80 µs | GB/s | × copy |" in stdout
    assert "| dtype | provider | step ms |" in stdout
    for title in ("clip + scale", "clip + all stats", "normalise by norm", "AMP unscale + global clip", "GPT-2"):
        assert f"## {title}" in stdout
    assert "results.json" in stdout


def test_clip_step_times_six_paths(quick, monkeypatch):
    """The optimizer step: torch's clip_grad_norm_ + fused AdamW, fh.clip_grad_norm_ (scale pass) + fused AdamW, the
    clip folded into the fused step, and folded into fh.AdamW's, fh.AdamW inside the backward (each firing's pass,
    then its step) and torch's step alone, each with its bytes: the step's 7 element sizes (grad, param, exp_avg,
    exp_avg_sq read; the last three written) plus the clip's 3 (norm R, scale R+W), 2 (scale R+W), 1 (the folded
    step writes the divided gradient back), 0, 2 (the firing's R+W) and 0."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from harness import human

    data, stdout = quick
    results = by_key(data)
    itemsize = {"fp32": 4, "bf16": 2}
    for dtype in data["settings"]["dtypes"]:
        for numel in data["settings"]["sizes"]:
            for provider, elements in {"torch built-in": 10, "fusedhooks": 9, "fusedhooks folded": 8,
                                       "fusedhooks step": 7, "fusedhooks in backward": 9, "torch step": 7}.items():
                r = results[("clip_step", provider, dtype, numel)]
                assert r["status"] == "ok" and r["median_us"] > 0, r
                assert r["bytes_per_element"] == elements * itemsize[dtype]
                assert f"| {human(numel)} | {dtype} | {provider} | " in stdout
            assert results[("clip_step", "fusedhooks", dtype, numel)]["fusedhooks_plan"]["passes"] == 1
            assert results[("clip_step", "fusedhooks folded", dtype, numel)]["launches"] == 0
            assert results[("clip_step", "fusedhooks step", dtype, numel)]["launches"] == 0
            assert results[("clip_step", "fusedhooks in backward", dtype, numel)]["fusedhooks_plan"]["passes"] == 1
            assert results[("clip_step", "eager", dtype, numel)]["status"] == "n/a"
    assert "## global clip + fused AdamW step (`clip_step`)" in stdout
    # the folded provider is clip_step's alone
    assert results[("clip_stats", "fusedhooks folded", "fp32", data["settings"]["sizes"][0])]["status"] == "n/a"
    for provider in ("fusedhooks step", "fusedhooks in backward", "torch step"):
        assert results[("clip_stats", provider, "fp32", data["settings"]["sizes"][0])]["status"] == "n/a"


@pytest.mark.parametrize("provider", ["torch built-in", "fusedhooks", "fusedhooks folded", "fusedhooks step",
                                      "torch step"])
def test_clip_step_providers_clip_and_step(provider, monkeypatch):
    """Each clip_step provider's timed call (after its untimed hooks) clips the gradient to max_norm and steps the
    fused AdamW; the folded ones through opt.grad_scale, consumed by the step (fh.AdamW's leaves .grad unclipped,
    its moments those of the clipped gradient)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from workloads import MAX_NORM, PROVIDERS, WORKLOADS, Env

    param = torch.zeros(3000, requires_grad=True)
    param.grad = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    grad = param.grad.clone()
    env = Env(torch.device("cpu"), torch.float32, [("w", param)], torch.optim.SGD([param], lr=0.0))
    impl = PROVIDERS[provider](WORKLOADS["clip_step"], env)
    impl.attach(env)
    scales = []
    stepped = []
    handle = register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: scales.append(vars(opt).get("grad_scale")) or stepped.append(opt))
    try:
        with torch.no_grad():
            for hook in impl.hooks:
                hook(param)
            impl.after()
    finally:
        handle.remove()
        impl.detach()
    coef = MAX_NORM / (grad.norm() + 1e-6)
    if provider == "torch step":  # the step alone: nothing clipped
        assert torch.equal(param.grad, grad) and scales == [None]
        torch.testing.assert_close(param, torch.zeros_like(param))
        return
    if provider == "fusedhooks step":
        assert torch.equal(param.grad, grad)
        (opt,) = stepped
        torch.testing.assert_close(opt.state[param]["exp_avg"], 0.1 * grad * coef, rtol=8 * 2.0 ** -24, atol=0)
    else:
        torch.testing.assert_close(param.grad, grad * coef, rtol=4 * 2.0 ** -24, atol=0)
    assert len(scales) == 1 and (scales[0] is not None) == provider.startswith("fusedhooks ")
    torch.testing.assert_close(param, torch.zeros_like(param))  # lr 0: the parameter stays


def test_clip_step_in_backward_steps_at_each_firing_clipped_by_the_previous_steps_norm(monkeypatch):
    """clip_step's fusedhooks in backward: each timed call fires on the gradient (scaled by the coefficient of the
    call before: 1 at first) and steps fh.AdamW at once, never through opt.step(); then sets the next coefficient
    from the recorded norms. Two calls: the first leaves the gradient as it is, the second clips it to MAX_NORM."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from workloads import MAX_NORM, PROVIDERS, WORKLOADS, Env

    import fusedhooks as fh

    param = torch.zeros(3000, requires_grad=True)
    param.grad = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    grad = param.grad.clone()
    env = Env(torch.device("cpu"), torch.float32, [("w", param)], torch.optim.SGD([param], lr=0.0))
    made = []

    class Recorded(fh.AdamW):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(fh, "AdamW", Recorded)
    impl = PROVIDERS["fusedhooks in backward"](WORKLOADS["clip_step"], env)
    assert impl.hooks == [] and impl.bytes_per_element == 9 * 4
    impl.attach(env)
    stepped = []
    handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: stepped.append(opt))
    try:
        with torch.no_grad():
            impl.after()
            assert torch.equal(param.grad, grad)  # the first call's coefficient: 1
            impl.after()
    finally:
        handle.remove()
        impl.detach()
    coef = MAX_NORM / (grad.norm() + 1e-6)
    torch.testing.assert_close(param.grad, grad * coef, rtol=4 * 2.0 ** -24, atol=0)
    assert stepped == []  # stepped at the firings, not by opt.step()
    (opt,) = made
    assert opt.state[param]["step"].item() == 2
    torch.testing.assert_close(opt.state[param]["exp_avg"], 0.09 * grad + 0.1 * grad * coef, rtol=16 * 2.0 ** -24,
                               atol=0)
    torch.testing.assert_close(param, torch.zeros_like(param))  # lr 0: the parameter stays


def test_interpreter_counts_launches(tmp_path):
    """With TRITON_INTERPRET=1 the real kernels run, and launches are counted at fusedhooks.runtime.launcher.launch."""
    data, _ = run_bench(tmp_path, "--quick", "--workloads", "normalize,amp_clip", "--providers", "fusedhooks",
                        "--dtype", "fp32", "--sizes", "1K,64K", interpret=True)
    assert data["fusedhooks_backend"].startswith("triton (interpreter")
    results = by_key(data)
    # normalize: one program (a launch) up to BLOCK (32K) elements, else the norm's pass and the elementwise pass
    for (workload, numel), launches in {("normalize", 1024): 1, ("normalize", 65536): 2,
                                        ("amp_clip", 1024): 2, ("amp_clip", 65536): 2}.items():
        r = results[(workload, "fusedhooks", "fp32", numel)]
        assert r["status"] == "ok" and r["launches"] == launches == r["fusedhooks_plan"]["launches"], r
        assert r["launches_how"].startswith("counted")


def test_torch_compile_provider(tmp_path):
    """torch.compile of the eager hook works on CPU (gcc), including dynamic shapes and the model's hooks."""
    data, _ = run_bench(tmp_path, "--quick", "--workloads", "model,clip_stats", "--providers", "torch.compile",
                        "--dtype", "fp32", "--sizes", "1K,64K")
    compiled = [r for r in data["results"] if r["provider"] == "torch.compile"]
    assert len(compiled) == 3 and all(r["status"] == "ok" for r in compiled), compiled


class _Recorder:
    """A stand-in for matplotlib's figures and axes: records every call as (name, args, kwargs)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def test_sweep_plots_time_and_speedup_over_the_eager_hook(tmp_path, monkeypatch):
    """The plots draw time and speedup over the eager hook, not each provider's own bytes per second (where the
    provider that moves the fewest bytes, fusedhooks, drew the lowest line however fast it was)."""
    import types

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from harness import Report

    grid = [[_Recorder(), _Recorder()], [_Recorder(), _Recorder()]]
    pyplot = types.SimpleNamespace(subplots=lambda rows, cols, **kw: (_Recorder(), [row[:cols] for row in grid[:rows]]),
                                   close=lambda fig: None)
    matplotlib = types.ModuleType("matplotlib")
    matplotlib.use, matplotlib.pyplot = lambda backend: None, pyplot
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    report = Report({"device": {"name": "test"}}, {})
    report.titles = {"clip_stats": "clip + stats"}
    medians = {"fusedhooks": (10.0, 50.0), "eager": (40.0, 230.0), "torch.compile": (20.0, 60.0)}
    for provider, times in medians.items():
        for numel, median in zip((1024, 65536), times):
            report.results.append({"workload": "clip_stats", "provider": provider, "dtype": "fp32", "numel": numel,
                                   "status": "ok", "median_us": median, "gbps": 1.0, "added_pct": None})
    assert report.plot(tmp_path) == [str(tmp_path / "clip_stats.png")]
    time_ax, speedup_ax = grid[0][0], grid[1][0]

    def lines(ax):
        return {kw["label"]: (list(args[0]), list(args[1])) for name, args, kw in ax.calls if name == "plot"}

    assert lines(time_ax) == {p: ([1024, 65536], list(t)) for p, t in medians.items()}
    assert lines(speedup_ax) == {"fusedhooks": ([1024, 65536], [4.0, 4.6]), "eager": ([1024, 65536], [1.0, 1.0]),
                                 "torch.compile": ([1024, 65536], [2.0, 230.0 / 60.0])}
    labels = [args[0] for ax in (time_ax, speedup_ax) for name, args, _ in ax.calls if name == "set_ylabel"]
    assert labels == ["median µs per call (lower is faster)", "speedup over the eager hook (×, higher is faster)"]


def test_stats_cost_times_each_statistics_subset(tmp_path):
    """benchmarks/stats_cost.py (the GPU run's breakdown of the fused pass) runs end to end: a copy and one kernel per
    statistics subset, per dtype, in its JSON and its table (CPU: the interpreter, a smoke run of the script)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = tmp_path / "stats_cost.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stats_cost.py"), "--device", "cpu", "--size",
                           "3000", "--dtypes", "fp32,bf16", "--out", str(out)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from stats_cost import SUBSETS
    for dtype in ("fp32", "bf16"):
        kernels = [r["kernel"] for r in rows if r["dtype"] == dtype]
        assert kernels == ["copy", *(name for name, _, _ in SUBSETS)]
        assert all(r["us"] > 0 for r in rows if r["dtype"] == dtype)
    assert proc.stdout.count("| fp32 |") == len(SUBSETS) + 1


def test_sass_model_counts_by_pipe_and_takes_the_largest_time():
    """benchmarks/sass_model.py's arithmetic on a hand-written SASS listing: opcodes by pipe (predicates, modifiers
    and NOPs aside), each pipe's clocks per program at its rate, the memory time at the copy's bandwidth."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sass_model

    sass = """
        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0010*/                   LOP3.LUT R6, R4, 0xffff0000, RZ, 0xc0, !PT ;
        /*0020*/              @!P0 FMNMX.NAN R7, R6, -1, !PT ;
        /*0030*/                   FMUL R8, R7, 0.5 ;
        /*0040*/                   DADD R10, R10, R12 ;
        /*0050*/                   F2FP.BF16.F32.PACK_AB R9, R8, R8 ;
        /*0060*/                   NOP ;
        /*0070*/                   STG.E.128 desc[UR4][R2.64], R4 ;
    """
    ops = sass_model.opcodes(sass)
    assert ops == ["LDG", "LOP3", "FMNMX", "FMUL", "DADD", "F2FP", "NOP", "STG"]
    counts = sass_model.pipe_counts(ops)
    assert counts == {"other": 2, "alu": 2, "fp32": 1, "fp64": 1, "conversion": 1, "issued": 7}
    gpu = sass_model.Gpu("test", 90, 1, 1.0, 4.0, "a unit GPU: one SM at 1 Hz, 4 bytes/s")
    # one warp of 32 threads, 32 elements a program: a pipe at rate R takes 32 * count / R clocks per program
    p = sass_model.predict(counts, gpu, block=32, warps=1, bytes_per_element=4)
    assert p["by"]["alu"] == 2 / 64 and p["by"]["fp64"] == 1 / 64 and p["by"]["conversion"] == 1 / 16
    assert p["by"]["issue"] == 7 / 4 / 32 and p["by"]["memory"] == 1.0
    assert p["bound"] == "memory" and p["copy_ratio"] == 1.0
    slow = sass_model.Gpu("test", 90, 1, 1.0, 400.0, "the same with 100 times the bandwidth")
    p = sass_model.predict(counts, slow, block=32, warps=1, bytes_per_element=4)
    assert p["bound"] == "conversion" and p["copy_ratio"] == (4 / 400) / (1 / 16)


def test_sass_model_counts_the_loop_over_tiles_once_per_tile():
    """A program's tiles: the instructions outside the loop once, the loop's (its backward branch's range) once per
    tile after the first, over the tiles unrolled into one of its runs (told by its global loads), the rare block a
    forward conditional branch skips inside it left out."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sass_model

    sass = """
        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0010*/                   FADD R8, R4, R5 ;
        /*0020*/              @!P0 BRA 0x90 ;
        /*0030*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0040*/                   FADD R8, R4, R8 ;
        /*0050*/               @P1 BRA 0x70 ;
        /*0060*/                   FMUL R8, R8, 0.5 ;
        /*0070*/                   IADD3 R2, R2, 0x10, RZ ;
        /*0080*/              @!P2 BRA 0x30 ;
        /*0090*/                   EXIT ;
    """
    ops = sass_model.executed_opcodes(sass, tiles=5)
    counts = sass_model.pipe_counts(ops)
    # outside: LDG, FADD, BRA, EXIT; 4 runs of the loop: LDG, FADD, BRA, IADD3, BRA (the FMUL it skips is rare)
    assert counts["fp32"] == 1 + 4 and "FMUL" not in ops and ops.count("LDG") == 5 and ops.count("IADD3") == 4
    assert sass_model.executed_opcodes(sass, tiles=1) == sass_model.opcodes(sass)
    unrolled = sass.replace("/*0040*/                   FADD",
                            "/*0040*/    LDG.E.128 R6, desc[UR4][R2.64] ;\n        /*0044*/    FADD")
    ops = sass_model.executed_opcodes(unrolled, tiles=5)
    assert ops.count("LDG") == 1 + 2 * 2 and ops.count("IADD3") == 2  # two tiles a run: two runs
    # a loop over every tile (a reduction pass over units): 8 tiles of 16 bytes a thread, two in a run of the loop
    ops = sass_model.executed_opcodes(unrolled, tiles=8, tile_load_bytes=16)
    assert ops.count("IADD3") == 4 and ops.count("LDG") == 1 + 4 * 2
    assert sass_model.executed_opcodes(unrolled, tiles=8, tile_load_bytes=8).count("IADD3") == 2  # 4 tiles a run


def test_sass_model_predicts_the_stats_cost_rows(tmp_path):
    """benchmarks/sass_model.py end to end, without a GPU: every stats_cost.py row compiled for sm_90, its SASS read and
    a time predicted, never faster than its bytes at the copy's bandwidth, statistics costing more instructions than
    none; the workloads that reduce, every kernel of their plan."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "model.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_model.py"), "--gpus", "H200", "--dtypes",
                           "bf16", "--json", str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from stats_cost import SUBSETS
    assert [r["kernel"] for r in rows] == [name for name, _, _ in SUBSETS]
    for r in rows:
        h200 = r["gpus"]["H200"]
        # never faster than its bytes at the copy's bandwidth: a copy's time for a read and a write, half for a read
        assert h200["time_over_copy"] >= r["bytes_per_element"] / (2 * 2) - 1e-9 and h200["counts"]["issued"] > 0, r
    issued = {r["kernel"]: r["gpus"]["H200"]["counts"]["issued"] for r in rows}  # per program
    assert issued["+ all, and input statistics"] > issued["+ all 13 statistics"] > issued["clip + scale, no statistics"]
    # the workloads that reduce: every kernel of the plan, each at least its bytes' time (three element accesses)
    kernels = {r["workload"]: list(r["gpus"]["H200"]["kernels"]) for r in json.loads(out.read_text())["workloads"]}
    assert kernels == {"normalize": ["reduce_level1", "fused_hook"], "agc": ["fused_hook_units"],
                       "center_columns": ["reduce_units1_0", "fused_hook"]}
    for r in json.loads(out.read_text())["workloads"]:
        assert r["gpus"]["H200"]["time_over_copy"] >= 1.5 - 1e-9 and r["h200_torch_compile_time_over_copy"] > 1, r
