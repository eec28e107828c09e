"""Test set-up: every Triton kernel runs in the CPU interpreter unless a CUDA device is present.

TRITON_INTERPRET must be set before anything imports Triton, so it is set here, at collection.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FUSEDHOOKS_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache",
                                                           "fusedhooks_kernels"))

import pytest  # noqa: E402

import fusedhooks  # noqa: E402, F401

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(params=["triton", "reference"])
def backend(request):
    """Every numeric test runs on both backends: the Triton kernels and the eager reference."""
    return request.param


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"
