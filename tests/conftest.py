"""Test set-up: every Triton kernel runs in the CPU interpreter unless a CUDA device is present.

TRITON_INTERPRET must be set before anything imports Triton, so it is set here, at collection.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FUSEDHOOKS_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache",
                                                           "fusedhooks_kernels"))
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    # torch 2.13's inductor cache does not key its C++ kernels on ATEN_CPU_CAPABILITY: a kernel cached by a run under
    # avx512 and reused under avx2 crashes (segmentation fault). One cache per capability (subprocesses inherit it).
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}_{os.environ['ATEN_CPU_CAPABILITY']}"

import pytest  # noqa: E402

import fusedhooks  # noqa: E402, F401

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def pytest_collection_modifyitems(config, items):
    """On a CUDA machine without TRITON_INTERPRET=1, the CPU-tensor tests cannot run their Triton kernels
    (they need the interpreter, which would also take over the GPU tests): run them in a second session
    with TRITON_INTERPRET=1 -m "not gpu" (benchmarks/gpu_check.sh does both)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return
    skip = pytest.mark.skip(reason="CPU-interpreter test: run with TRITON_INTERPRET=1 -m 'not gpu' on a GPU machine")
    for item in items:
        if "gpu" not in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["triton", "eager", "reference"])
def backend(request):
    """Every numeric test runs on every backend: the Triton kernels, the eager CPU backend and the float64
    reference (the oracle)."""
    if request.param == "eager" and torch.cuda.is_available():
        pytest.skip("the eager backend runs on CPU tensors; the tests' device is CUDA here")
    return request.param


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def fresh_dynamo():
    """dynamo's caches and counters cleared before and after the test (the compile tests count graphs)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()
