"""`python -m fusedhooks tune`: end to end under the interpreter, and a later process using the cache."""

import json
import os
import subprocess
import sys

import pytest
import torch

import fusedhooks as fh
from fusedhooks.cli.tune import tune

USE_CACHE = """
import json, sys, torch
import fusedhooks as fh
from fusedhooks.runtime import launcher as runtime, tuning
from fusedhooks.cli.tune import default_hook
hook = default_hook()
entry = next(iter(tuning.load()[tuning.device_key(torch.device("cpu"))].values()))
plan = hook.plan(numel=100_000, dtype=torch.float32, device="cpu")
launches = []
real = runtime.launch
runtime.launch = lambda kernel, grid, args, meta, *a: (launches.append((grid, meta["BLOCK"])),
                                                     real(kernel, grid, args, meta, *a))
p = torch.zeros(100_000, requires_grad=True)
p.grad = torch.randn(100_000)
hook(p)
print(json.dumps({"plan_block": plan.block, "launches": launches}))
"""


def run(args, env, code=None):
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "fusedhooks", *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow       # tunes in the interpreter, then a second process: about a minute
def test_tune_writes_the_cache_and_a_later_process_uses_it(tmp_path):
    cache = tmp_path / "tuning.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "FUSEDHOOKS_CACHE_DIR": str(tmp_path / "kernels")}
    env.pop("FUSEDHOOKS_BLOCK", None)
    run(["tune", "--device", "cpu", "--force", "--quick", "--dtypes", "fp32", "--out", str(cache)], env)
    data = json.loads(cache.read_text())
    (device_key, kernels), = data.items()
    assert device_key.startswith("cpu (triton interpreter) | triton ")
    (digest, entry), = kernels.items()
    configs = {(t["block"], t["num_warps"], t["num_stages"]) for t in entry["tried"]}
    assert len(configs) >= 2 and {t["size"] for t in entry["tried"]} == {5000, 20000}
    assert entry["block"] in {c[0] for c in configs} and entry["sizes"]

    env["FUSEDHOOKS_TUNE_CACHE"] = str(cache)
    for block in (entry["block"], 1024):   # the tuned one, then one the runtime would never pick by itself
        entry["block"] = block
        cache.write_text(json.dumps({device_key: {digest: entry}}))
        used = json.loads(run([], env, USE_CACHE).strip().splitlines()[-1])
        assert used["plan_block"] == block
        assert used["launches"] == [[[-(-100_000 // block)], block]]


def test_tuning_a_body_planned_per_shape_is_refused():
    with pytest.raises(ValueError, match="reduces over dimensions: its kernels are planned per gradient shape"):
        tune(fh.agc(0.01), [4096], [torch.float32], torch.device("cpu"))


@pytest.mark.parametrize("contents", ['{"cpu": {"abc": ', "[1, 2]", '{"cpu": 3}'],
                         ids=["truncated", "list", "not-dicts"])
def test_an_unreadable_tuning_cache_is_left_out_with_a_warning(contents, tmp_path, monkeypatch):
    """The cache only holds launch configurations: a broken one must not break a backward."""
    from fusedhooks.runtime import tuning

    path = tmp_path / "tuning.json"
    path.write_text(contents)
    monkeypatch.setenv("FUSEDHOOKS_TUNE_CACHE", str(path))
    with pytest.warns(UserWarning, match="cannot be read"):
        assert tuning.load(reload=True) == {}
    hook = fh.grad_hook(lambda grad: grad * 2.0, backend="triton")
    p = torch.zeros(5, requires_grad=True)
    p.grad = torch.ones(5)
    hook(p)
    assert p.grad.tolist() == [2.0] * 5
    monkeypatch.delenv("FUSEDHOOKS_TUNE_CACHE")
    tuning.load(reload=True)


def test_environment_variables_with_bad_values_are_named(monkeypatch):
    from fusedhooks.runtime import launcher as runtime

    monkeypatch.setenv("FUSEDHOOKS_BLOCK", "abc")
    with pytest.raises(ValueError, match="FUSEDHOOKS_BLOCK must be a power of two >= 16, not 'abc'"):
        runtime.block_size()
    monkeypatch.delenv("FUSEDHOOKS_BLOCK")
    monkeypatch.setenv("FUSEDHOOKS_BACKEND", "trition")
    with pytest.raises(ValueError, match="FUSEDHOOKS_BACKEND"):
        runtime.choose_backend(torch.device("cpu"))
