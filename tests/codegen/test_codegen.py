"""Generated source: cached on disk by content hash, compiled once per (graph, dtype), int64 indexing."""

import torch

import fusedhooks as fh
from fusedhooks.codegen import kernel_cache

from helpers import count_launches
from test_ops import fire


def clip(grad):
    return grad.clamp(-1.0, 1.0) * 0.5


def test_source_written_once_by_content_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEDHOOKS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_cache, "_loaded", {})
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
    assert sorted(str(k[0]) for k in hook.compilation.keys()) == ["torch.bfloat16", "torch.float32"]


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
    # the program's first tile, then the others
    assert "offs = pid * BLOCK + tl.arange(0, TILE)" in src and "offs = pid * BLOCK + start + tl.arange(0, TILE)" in src


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


def _cuda_body(fn, dtype, monkeypatch) -> str:
    """The computing lines of the source generated for CUDA (as compiled on a GPU: outside the interpreter), of the
    program's first tile (the loop over the others repeats them)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    src = fh.grad_hook(fn).source(dtype, "cuda")
    first_tile = src.split("def fused_hook(")[1].split("def fused_hook_multi(")[0].split("for start in range(")[0]
    return "\n".join(line.strip() for line in first_tile.splitlines() if line.strip().startswith("v"))


def test_cuda_source_follows_torchs_cuda_kernels(monkeypatch):
    """What the first GPU run showed (H200, torch 2.11), each written as torch's CUDA kernel computes it: a division by
    a Python number is a multiply by its reciprocal in every float dtype (fp64 too); exp, log, rsqrt and a general pow
    call CUDA's math library (libdevice), as torch's kernels do; a pow exponent is rounded to the tensor's dtype, and
    x**3, x**-2 of fp16/bf16 round after each multiply, the division in fp64. test_build compiles these for GPU
    targets; test_gpu compares them with CUDA torch."""
    assert _cuda_body(lambda g: g / 3, torch.float64, monkeypatch) == \
        f"v2 = grad * tl.full([], {1 / 3!r}, tl.float64)"
    assert _cuda_body(lambda g: g / 3, torch.float32, monkeypatch) == \
        f"v2 = grad * {(torch.tensor(1.0) / 3).item()!r}"
    for op, fn in (("exp", lambda g: g.exp()), ("log", lambda g: g.log()), ("rsqrt", lambda g: g.rsqrt())):
        assert f"libdevice.{op}(grad)" in _cuda_body(fn, torch.float32, monkeypatch)
    assert "libdevice.rsqrt(grad)" in _cuda_body(lambda g: g ** -0.5, torch.float32, monkeypatch)
    bf16_exponent = torch.tensor(1.7).to(torch.bfloat16).item()  # 1.703125
    assert f"libdevice.pow(grad, tl.full([], {bf16_exponent!r}, tl.float32))" in \
        _cuda_body(lambda g: g ** 1.7, torch.bfloat16, monkeypatch)
    assert "round_to_bf16(grad * grad) * grad" in _cuda_body(lambda g: g ** 3, torch.bfloat16, monkeypatch)
    assert "(1.0 / (round_to_fp16(grad * grad)).to(tl.float64)).to(tl.float32)" in \
        _cuda_body(lambda g: g ** -2, torch.float16, monkeypatch)
    assert _cuda_body(lambda g: g ** -2, torch.float64, monkeypatch).endswith("= 1.0 / (grad * grad)")
    # 2.001 rounds to 2.0 in bf16, computed as x * x then; 0.5 itself goes to the sqrt kernel
    for body in (lambda g: g ** 2, lambda g: g ** 2.001):
        assert _cuda_body(body, torch.bfloat16, monkeypatch).endswith("= round_to_bf16(grad * grad)")
    assert _cuda_body(lambda g: g ** 0.5, torch.bfloat16, monkeypatch).endswith(
        "= round_to_bf16(tl.math.sqrt_rn(grad))")


def test_interpreted_source_has_no_libdevice(monkeypatch):
    """The interpreter has no libdevice: kernels interpreted on CUDA tensors use tl's exp (the CPU source never
    calls it)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "libdevice." not in fh.grad_hook(lambda g: torch.exp(g)).source(torch.float32, "cuda").split("# body:")[1]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "libdevice." not in fh.grad_hook(lambda g: torch.exp(g)).source(torch.float32, "cpu").split("# body:")[1]
