"""Generated source: cached on disk by content hash, compiled once per (graph, dtype), int64 indexing."""

import torch

import fusedhooks as fh
from fusedhooks import codegen

from test_ops import fire


def clip(grad):
    return grad.clamp(-1.0, 1.0) * 0.5


def test_source_written_once_by_content_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEDHOOKS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(codegen, "_loaded", {})
    hook = fh.grad_hook(clip, stats=("norm",))
    fire(hook, torch.randn(100))
    files = sorted(tmp_path.glob("fh_*.py"))
    assert len(files) == 1
    assert files[0].read_text() == hook.source(torch.float32, "cpu")
    again = fh.grad_hook(clip, stats=("norm",))   # same body and options: same source, same file
    fire(again, torch.randn(100))
    assert sorted(tmp_path.glob("fh_*.py")) == files


def test_compiled_once_per_dtype():
    hook = fh.grad_hook(clip)
    for dtype in (torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16):
        fire(hook, torch.randn(64).to(dtype))
    assert sorted(str(k[0]) for k in hook._compiled) == ["torch.bfloat16", "torch.float32"]


def test_literals_are_constants_and_tensors_are_arguments():
    scale = torch.tensor(0.25)

    def body(grad):
        return grad * scale + 0.125

    src = fh.grad_hook(body).source(torch.float32)
    assert "0.125" in src and "scalar0_ptr" in src and "0.25" not in src


def test_offsets_are_int64():
    """Offsets are computed from an int64 program id, so gradients past 2**31 elements index correctly
    (exercised on a real >2**31-element gradient by tests/test_gpu.py)."""
    src = fh.grad_hook(clip, stats="all").source(torch.bfloat16)
    assert "pid = tl.program_id(0).to(tl.int64)" in src
    assert "offs = pid * BLOCK + tl.arange(0, BLOCK)" in src


def count_launches(monkeypatch) -> list:
    """Wrap the runtime's launcher; returns the list of (kernel name, grid) it is called with."""
    launches = []
    real_launch = fh.runtime.launch

    def counting_launch(kernel, grid, *args, **meta):
        launches.append((kernel.__name__ if hasattr(kernel, "__name__") else kernel.fn.__name__, grid))
        return real_launch(kernel, grid, *args, **meta)

    monkeypatch.setattr(fh.runtime, "launch", counting_launch)
    return launches


def test_one_launch_for_body_and_statistics(monkeypatch):
    launches = count_launches(monkeypatch)
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", "256")
    hook = fh.grad_hook(clip, stats="all", input_stats="all", backend="triton")
    assert hook.plan(numel=5000).launches == 1 and hook.plan(numel=5000).passes == 1
    fire(hook, torch.randn(5000))
    assert launches == [("fused_hook", (20,))]


def test_importing_fusedhooks_does_not_import_triton():
    """TRITON_INTERPRET is read when triton is imported: `python -m fusedhooks demo` sets it after import. Nor does
    it import an integration's framework (each is imported by its own `fusedhooks.integrations.<name>` module)."""
    import subprocess
    import sys

    code = ("import sys, fusedhooks, fusedhooks.integrations\n"
            "for name in ('triton', 'transformers', 'accelerate', 'lightning', 'tensorboard'):\n"
            "    assert name not in sys.modules, f'importing fusedhooks imported {name}'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sizes_are_never_specialized_into_constants():
    """On a GPU, Triton makes an integer argument equal to 1 a constexpr; `numel.to(tl.float64)` in the merge
    would then fail to compile for a 1-element gradient (triton-lang/triton#2939). The interpreter does not
    specialize, so the guard is checked in the source."""
    src = fh.grad_hook(lambda grad: grad / grad.norm(), stats="all").source(torch.float32)
    kernels = [line for line in src.splitlines() if line.startswith("@triton.jit")]
    assert len(kernels) == 5
    assert all("do_not_specialize=['numel']" in k or "do_not_specialize=['n_tensors']" in k for k in kernels)
