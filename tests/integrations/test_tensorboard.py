"""fusedhooks.integrations.tensorboard: event files that TensorBoard's own reader parses back."""

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

import fusedhooks as fh
from fusedhooks.integrations.tensorboard import log_to_tensorboard


def _read_back(logdir):
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


@pytest.mark.parametrize("backend", ["triton", "eager"])
def test_scalars_and_histograms_round_trip(tmp_path, backend):
    hook = fh.grad_hook(lambda grad: grad.clamp(-1.0, 1.0), stats=("norm", "nan", "hist"), input_stats=("absmax",),
                        backend=backend, hist_range=(-4, 2))
    weight = torch.nn.Parameter(torch.zeros(6))
    hook.register([("fc.weight", weight)])
    writer = SummaryWriter(str(tmp_path))
    grads = [torch.tensor([0.0, 0.1, -0.3, 0.5, 3.0, -0.75]), torch.tensor([0.01, 0.2, 0.2, -2.0, 1e-9, 0.0])]
    # bins [2^k, 2^(k+1)) for k = -4 .. 1 of the clamped gradient; zeros and smaller values in the first
    expected_hist = [[2, 0, 1, 2, 1, 0], [3, 2, 0, 0, 1, 0]]
    for step, g in enumerate(grads):
        weight.grad = None
        (weight * g).sum().backward()
        scalars = log_to_tensorboard(writer, hook, step)
        assert scalars == {"grad/fc.weight/norm": pytest.approx(g.clamp(-1, 1).norm().item(), rel=1e-6),
                           "grad/fc.weight/nan": 0, "grad/fc.weight/input.absmax": g.abs().max().item()}
    writer.close()
    acc = _read_back(tmp_path)
    assert sorted(acc.Tags()["scalars"]) == ["grad/fc.weight/input.absmax", "grad/fc.weight/nan",
                                             "grad/fc.weight/norm"]
    assert acc.Tags()["histograms"] == ["grad/fc.weight/hist"]
    norms = acc.Scalars("grad/fc.weight/norm")
    assert [e.step for e in norms] == [0, 1]
    for event, g in zip(norms, grads):
        assert event.value == pytest.approx(g.clamp(-1, 1).norm().item(), rel=1e-6)  # stored as float32
    assert [e.value for e in acc.Scalars("grad/fc.weight/input.absmax")] == [3.0, 2.0]
    hists = acc.Histograms("grad/fc.weight/hist")
    assert [h.step for h in hists] == [0, 1]
    for h, counts in zip(hists, expected_hist):
        value = h.histogram_value
        assert list(value.bucket) == counts
        assert list(value.bucket_limit) == [2.0 ** (k + 1) for k in range(-4, 2)]
        assert value.num == 6
    for h in hists:  # the first bin holds a zero; the last non-empty bin is [1, 2)
        assert h.histogram_value.min == 0.0 and h.histogram_value.max == 2.0


def test_histograms_can_be_left_out_and_stale_rows_are(tmp_path):
    hook = fh.grad_hook(stats=("max", "hist"), backend="reference")
    used, frozen = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    hook.register([("used", used), ("frozen", frozen)])
    (used.sum() + frozen.sum()).backward()
    used.sum().backward()  # frozen's row is now stale
    writer = SummaryWriter(str(tmp_path))
    assert log_to_tensorboard(writer, hook, 7, prefix="g/", histograms=False) == {"g/used/max": 2.0}
    writer.close()
    acc = _read_back(tmp_path)
    assert acc.Tags()["scalars"] == ["g/used/max"] and acc.Tags()["histograms"] == []


def test_what_is_not_a_writer_or_a_hook_is_refused_by_name():
    hook = fh.grad_hook(stats=("norm",))
    with pytest.raises(TypeError, match="SummaryWriter"):
        log_to_tensorboard(None, hook, step=0)
    with pytest.raises(TypeError, match="takes a fusedhooks hook, not str"):
        log_to_tensorboard(object(), "hook", step=0)
