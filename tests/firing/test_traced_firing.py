"""The CUDA branch of `runtime.fire_traced` (fusedhooks::firing under torch.compile), checked without a GPU: traced on
fake CUDA tensors for every kernel family (traced_firing_worker.py beside this file, in a process without
TRITON_INTERPRET), the graph holds `fire`'s kernels through wrap_triton with in-graph workspaces, and torch's TTIR
analysis finds what they write. Running them is left to the GPU tests (tests/firing/test_compile_cuda.py)."""

import os
import pathlib
import subprocess
import sys

WORKER = pathlib.Path(__file__).with_name("traced_firing_worker.py")


def test_traced_cuda_firing_holds_the_kernels_fire_launches():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"  # silences triton 3.9's warning; the kernels are only analysed here
    root = str(WORKER.parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else root
    proc = subprocess.run([sys.executable, str(WORKER)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "checked 68 cases", lines[-5:]
    # the families that launch several kernels, and the one-pass kernel over units, were among them
    assert any("reduce_units1_0 reduce_units1_1 reduce_whole2_0 fused_hook" in line for line in lines)
    assert any("reduce_level1 fused_hook, writes counter grad partials reduced stats" in line for line in lines)
    assert any(line.startswith("agc(rows, one pass)") and "fused_hook_units" in line for line in lines)
    assert any(line.startswith("clip+moments") for line in lines)
    assert any("(scaler=)" in line and "found_inf" in line.partition("writes")[2] for line in lines)
