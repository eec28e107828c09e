"""Command lines given bad arguments: a one-line message and a non-zero exit, never a traceback or a silent run."""

import concurrent.futures
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from fusedhooks.__main__ import main

from helpers import ROOT


def _benchmark_args():
    spec = importlib.util.spec_from_file_location("benchmarks_run", ROOT / "benchmarks" / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module.parse_args


@pytest.mark.parametrize(("argv", "message"), [
    (["demo", "--steps", "0"], "argument --steps: takes a whole number of steps >= 1, not 0"),
    (["demo", "--steps", "abc"], "argument --steps: takes a whole number of steps >= 1, not 'abc'"),
    (["demo", "--steps", "2.5"], "argument --steps: takes a whole number of steps >= 1, not '2.5'"),
    (["demo", "--device", "tpu"], "demo --device"),
    (["demo", "--backend", "fast"], "argument --backend: invalid choice: 'fast'"),
    (["build", "--num-warps", "3"], "argument --num-warps: takes a power of two (1, 2, 4, 8, ...), not 3"),
    (["build", "--num-warps", "many"], "argument --num-warps: takes a power of two (1, 2, 4, 8, ...), not 'many'"),
    (["build", "--json", "{file}/x.json"], "not a writable directory"),
    (["tune", "--out", "{file}/x.json"], "not a writable directory"),
    (["tune", "--sizes", "abc", "--quick"], "--sizes"),
    (["tune", "--sizes", "0", "--quick"], ">= 1"),
    (["tune", "--dtypes", "fp8", "--quick"], "unknown fp8"),
    (["tune", "--hook", "no_such_module:hook", "--quick"], "cannot load"),
    (["tune", "--hook", "fusedhooks:no_such_hook", "--quick"], "cannot load"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_fusedhooks_command_refuses_bad_arguments(argv, message, capsys, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")  # a path under it cannot be written
    with pytest.raises(SystemExit) as exit_:
        main([arg.format(file=a_file) for arg in argv])
    text = str(exit_.value.code) if isinstance(exit_.value.code, str) else capsys.readouterr().err
    assert exit_.value.code != 0 and message in text, text
    assert "invalid _" not in text  # argparse names a type function it was not told about: never a private name


@pytest.mark.parametrize(("argv", "message"), [
    (["--sizes", "0"], ">= 1"),
    (["--sizes", "abc"], "--sizes"),
    (["--providers", ""], "--providers names none"),
    (["--workloads", ","], "--workloads names none"),
    (["--budget-s", "-5"], "--budget-s"),
])
def test_benchmark_command_refuses_bad_arguments(argv, message, capsys):
    parse_args = _benchmark_args()
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--device", "cpu", *argv])
    assert exit_.value.code != 0 and message in capsys.readouterr().err


MODULE = """
import torch
import fusedhooks as fh

clip = fh.grad_hook(lambda grad: grad.clamp(-1.0, 1.0))


def make_hook():
    return clip


def make_model():
    return torch.nn.Linear(3, 5)
"""


@pytest.fixture
def cli_module(tmp_path, monkeypatch):
    """The name of an importable module holding a hook `clip`, `make_hook()` and `make_model()`."""
    (tmp_path / "cli_objects.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "cli_objects"


def _usage_error(argv, capsys) -> str:
    """main(argv) as a usage error: exit 2, the last line of stderr `<prog>: error: ...` (no traceback); that line."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"python -m fusedhooks {argv[0]}: error: "), err
    return line


@pytest.mark.parametrize(("argv", "messages"), [
    (["tune", "--device", "tpu"], ["tune --device: cpu or cuda, not 'tpu'"]),
    (["tune", "--device", "cuda:x"], ["tune --device: cpu or cuda, not 'cuda:x'"]),
    (["tune", "--model", "{module}:clip"], ["is a fusedhooks GradHook: pass it with --hook"]),
    (["tune", "--model", "{module}:make_hook"], ["returns a fusedhooks GradHook: pass it with --hook"]),
    (["tune", "--model", "torch.nn:Linear"], ["takes arguments", "function of no arguments"]),
    (["tune", "--model", "math:pi"], ["gives a float", "nn.Module"]),
    (["tune", "--hook", "{module}:make_model"], ["--hook must name a fusedhooks GradHook"]),
    (["tune", "--device", "cpu", "--quick", "--dtypes", "fp32", "--sizes", "64"],
     ["no GPU to tune for", "Triton interpreter", "pass --force"]),
], ids=lambda v: " ".join(v) if isinstance(v, list) and v[0] == "tune" else None)
def test_tune_usage_errors_are_one_line_messages(argv, messages, cli_module, capsys, tmp_path):
    argv = [a.format(module=cli_module) for a in argv] + ["--out", str(tmp_path / "tuning.json")]
    line = _usage_error(argv, capsys)
    assert all(m in line for m in messages), line
    assert not (tmp_path / "tuning.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a CUDA device where there is none")
def test_tune_on_a_cuda_device_without_one_says_so(capsys):
    line = _usage_error(["tune", "--device", "cuda"], capsys)
    assert "tune --device cuda: " in line and "use --device cpu" in line, line


def test_tune_on_cpu_with_force_is_labelled_quick_and_reports_each_configuration(capsys, tmp_path):
    cache = tmp_path / "tuning.json"
    assert main(["tune", "--device", "cpu", "--force", "--dtypes", "fp32", "--sizes", "100,3000",
                 "--out", str(cache)]) == 0
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert "Triton interpreter on CPU (--force), in quick mode" in err[0] and "not of any GPU" in err[0], err
    configs = [{"block": b, "num_warps": 4, "num_stages": 1} for b in (2048, 4096)]  # tune.candidates(quick)
    expected = [f"fusedhooks tune [{i + 1}/4] float32 size {size:,} BLOCK={c['block']} warps=4 stages=1: "
                for i, (size, c) in enumerate((s, c) for s in (100, 3000) for c in configs)]
    assert [line[:len(e)] for line, e in zip(err[1:], expected)] == expected and len(err) == 5, err
    assert all(line.endswith(" ms") for line in err[1:])
    (key, kernels), = json.loads(cache.read_text()).items()
    assert key.startswith("cpu (triton interpreter)") and key in captured.err
    (entry,) = kernels.values()
    assert len(entry["tried"]) == 4 and "cpu (triton interpreter)" in captured.out


def test_help_says_what_each_command_does(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    for command, does in (("demo", "train a small model"), ("tune", "time launch configurations"),
                          ("build", "compile every kernel family for GPU targets")):
        assert any(line.split()[:1] == [command] and does in line for line in out.splitlines()), out
    assert "on CPU," in out and "only with --force" in out
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--force" in out and "whose timings say nothing about a GPU" in out


@pytest.mark.parametrize(("argv", "message", "interpreting"), [
    (["build"], "unset TRITON_INTERPRET", True),
    (["build", "--target", "cuda:70"], "--target: unknown 'cuda:70'; known: cuda:80, cuda:90, hip:gfx942, all", False),
    (["build", "--dtypes", "fp32,int8"], "--dtypes: unknown 'int8'", False),
])
def test_build_usage_errors_are_one_line_messages(argv, message, interpreting, capsys, monkeypatch):
    if not interpreting:
        monkeypatch.delenv("TRITON_INTERPRET")  # read by `build` alone: triton is imported already
    assert message in _usage_error(argv, capsys)


def test_build_prints_a_header_over_its_columns(capsys, monkeypatch):
    from fusedhooks.cli import build

    report = build.KernelReport("stats-only", "fp32", "single_kernel", "cuda:90", 8, registers=31, spills=0,
                                load_bits=(32, 128), store_bits=None, scalar_element_accesses=0)
    monkeypatch.setattr(build, "build",  # one build per family and target: one report in all
                        lambda target, dtypes, num_warps, bar, only: [report] if only == "stats-only" else [])
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor",  # the build above, in this process
                        lambda max_workers, mp_context: concurrent.futures.ThreadPoolExecutor(max_workers))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert main(["build", "--dtypes", "fp32"]) == 0
    header, legend, line, summary = capsys.readouterr().out.splitlines()
    names, values = header.split(), line.split()
    assert names == ["target", "family", "dtype", "kernel", "warps", "regs", "spills", "load-bits", "store-bits",
                     "scalar-elt"]
    assert values == ["cuda:90", "stats-only", "fp32", "single_kernel", "8", "31", "0", "32..128", "-", "0"]
    for name, value in zip(names, values):  # each value under its name: left-aligned text, right-aligned numbers
        left = name in ("target", "family", "dtype", "kernel")
        assert (header.index(name) == line.index(value)) if left else \
            (header.index(name) + len(name) == line.index(value, header.index(name)) + len(value)), (name, value)
    assert legend.startswith("# regs: ") and summary.startswith("# cuda:90: 1 kernels")


def test_benchmark_reports_a_line_per_case(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the eager backend: fast
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # this checkout's fusedhooks
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--device", "cpu", "--quick",
                           "--out", str(tmp_path), "--workloads", "clip_scale,overhead", "--providers",
                           "fusedhooks,eager", "--dtype", "fp32", "--sizes", "1K,3K"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("benchmarks [")]
    assert [line.split(":")[0] for line in lines] == [
        "benchmarks [1/5] clip_scale fusedhooks fp32 1K", "benchmarks [2/5] clip_scale eager fp32 1K",
        "benchmarks [3/5] clip_scale fusedhooks fp32 3K", "benchmarks [4/5] clip_scale eager fp32 3K",
        "benchmarks [5/5] overhead"], proc.stderr
    assert all(line.endswith(" us") for line in lines[:4]), lines


#: runs the command line in a Python where numpy cannot be imported (torch's CPU wheel does not depend on it; Triton's
#: interpreter does), without TRITON_INTERPRET, as after the README's library-only install
_WITHOUT_NUMPY = ("import sys; sys.modules['numpy'] = None; from fusedhooks.__main__ import main; "
                  "sys.exit(main(sys.argv[1:]))")


def _run_without_numpy(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", _WITHOUT_NUMPY, *argv], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


def test_the_demo_runs_without_numpy_on_the_eager_backend():
    """The library alone (no numpy): the demo runs on the eager CPU backend and says why in one line; asking for the
    Triton kernels on CPU is refused with what to install."""
    proc = _run_without_numpy("demo", "--steps", "2", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "numpy is not installed" in proc.stdout and "eager CPU backend" in proc.stdout
    assert "done in" in proc.stdout
    proc = _run_without_numpy("demo", "--steps", "2", "--device", "cpu", "--backend", "triton")
    assert proc.returncode == 2 and "needs numpy: pip install 'numpy<2.4'" in proc.stderr
