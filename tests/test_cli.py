"""Command lines given bad arguments: a one-line message and a non-zero exit, never a traceback or a silent run."""

import importlib.util
import sys
from pathlib import Path

import pytest

from fusedhooks.__main__ import main

ROOT = Path(__file__).resolve().parent.parent


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
    (["demo", "--steps", "0"], "steps >= 1"),
    (["demo", "--device", "tpu"], "demo --device"),
    (["build", "--num-warps", "3"], "power of two"),
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
