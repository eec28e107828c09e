"""GPU-only checks (skipped without CUDA): the compiled kernels against eager CUDA torch.

They never replace the interpreter tests; they add what only a GPU shows: fast-math division and square
root, FMA contraction, the last-program merge across SMs, and indexing past 2**31 elements.
"""

import pytest
import torch

import fusedhooks as fh
from fusedhooks import STAT_NAMES

from helpers import FLOAT_DTYPES, assert_same_values, check_stats
from test_ops import BODIES, POW_ULPS, eager_expected, special_values

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name", [n for n in BODIES if n not in ("device_scalars", "bool_scalar")])
def test_op_matches_eager_cuda(name, dtype):
    fn, ulps = BODIES[name]
    ulps = POW_ULPS[dtype] if ulps == "pow" else max(ulps, 1 if name.startswith(("sqrt", "pow_half")) else ulps)
    grad = special_values(100_003, dtype).cuda()
    param = special_values(100_003, dtype, seed=1).cuda()
    expected = eager_expected(fn, grad, param)
    p = param.clone().requires_grad_(True)
    p.grad = grad
    fh.grad_hook(fn)(p)
    assert_same_values(grad.cpu(), expected.cpu(), ulps=ulps)


@pytest.mark.parametrize("n", [1, 4095, 4097, 1 << 20, 16_000_003])
def test_stats_cuda(n):
    grad = torch.randn(n, device="cuda") * 3
    before = grad.clone()
    hook = fh.grad_hook(lambda grad: grad.clamp(-2.0, 2.0) * 0.5, stats="all", input_stats="all")
    p = torch.zeros(n, device="cuda", requires_grad=True)
    p.grad = grad
    for _ in range(3):  # the counter resets: repeated launches stay correct
        p.grad.copy_(before)
        hook(p)
    got = hook.stats.read()["param0"]
    check_stats(got, grad.cpu(), STAT_NAMES)
    check_stats(got, before.cpu(), STAT_NAMES, prefix="input.")


def test_indexing_past_2_31_elements():
    n = (1 << 31) + 3000
    grad = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    grad[-5:] = 7.0
    hook = fh.grad_hook(lambda grad: grad * 2, stats=("max", "zeros", "sum"))
    p = torch.empty(n, dtype=torch.bfloat16, device="cuda").requires_grad_(True)
    p.grad = grad
    hook(p)
    assert grad[-5:].float().eq(14.0).all() and grad[:-5].float().abs().max().item() == 0
    got = hook.stats.read()["param0"]
    assert got["max"] == 14.0 and got["zeros"] == n - 5 and got["sum"] == 70.0
