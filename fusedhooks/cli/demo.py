"""The main job: train a small model on synthetic data with a compiled clip + statistics hook."""

from __future__ import annotations

import time

import torch

import fusedhooks as fh


def make_model(device: str) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.LayerNorm(128), torch.nn.GELU(),
        torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Linear(128, 10),
    ).to(device)


def run_demo(steps: int = 20, device: str = "cpu", backend: str = "auto") -> dict:
    """Train for `steps` steps; print per-parameter statistics and the hook's plan. Returns the statistics."""
    torch.manual_seed(0)
    model = make_model(device)
    clip_value = torch.tensor(0.01, device=device)  # read by the kernel at every firing: no recompile

    @fh.grad_hook(stats=("norm", "absmax", "mean", "std", "nan", "inf", "zeros"),
                  input_stats=("norm", "absmax", "hist"), hist_range=(-24, 0), backend=backend)
    def clip(grad):
        return grad.clamp(-clip_value, clip_value)

    handle = clip.register(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(512, 32, device=device)
    y = (x[:, :10] * 3).argmax(dim=1)
    start = time.perf_counter()
    print(f"fusedhooks demo: {sum(p.numel() for p in model.parameters()):,} parameters on {device}, "
          f"backend {clip.plan(numel=1, device=device).backend}, {steps} steps")
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()           # one fused kernel per parameter: clip in place + statistics, no sync
        opt.step()
        if step % 5 == 0 or step == steps - 1:
            print(f"  step {step:3d}  loss {loss.item():.4f}")
    stats = clip.stats.read()     # one device-to-host copy for every parameter
    elapsed = time.perf_counter() - start
    print(f"\nwhat the hook measured on the last step (clip at +-{clip_value.item():g}):")
    header = (f"  {'parameter':<10} {'shape':<11} {'in.norm':>9} {'in.absmax':>9} {'norm':>9} {'absmax':>8} "
              f"{'mean':>10} {'std':>9} {'nan':>4} {'inf':>4} {'zeros':>6}")
    print(header)
    print("  " + "-" * (len(header) - 2))
    for name, p in model.named_parameters():
        s = stats[name]
        print(f"  {name:<10} {str(tuple(p.shape)):<11} {s['input.norm']:9.4f} {s['input.absmax']:9.4f} "
              f"{s['norm']:9.4f} {s['absmax']:8.4f} {s['mean']:10.2e} {s['std']:9.2e} {s['nan']:4d} "
              f"{s['inf']:4d} {s['zeros']:6d}")
    largest_name, largest = max(model.named_parameters(), key=lambda kv: kv[1].numel())
    counts, edges = clip.stats.histogram(largest_name, input=True)
    print(f"\nhistogram of |grad| of {largest_name} before clipping (bins of floor(log2|g|)):")
    print_histogram(counts, edges)
    picture = save_histogram_png(counts, edges, largest_name)
    if picture:
        print(f"  (picture: {picture})")
    print("\n" + str(clip.plan(numel=largest.numel(), dtype=largest.dtype, device=device)))
    print(f"\ndone in {elapsed:.1f} s")
    handle.remove()
    return stats


def print_histogram(counts: torch.Tensor, edges: torch.Tensor, width: int = 40) -> None:
    """One text line per non-empty bin: the bin's range and a bar."""
    top = max(int(counts.max()), 1)
    for k, c in enumerate(counts.tolist()):
        if c:
            bar = "#" * max(1, round(width * c / top))
            print(f"  [2^{int(edges[k].log2())}, 2^{int(edges[k + 1].log2())})  {c:6d}  {bar}")


def save_histogram_png(counts: torch.Tensor, edges: torch.Tensor, name: str, path: str = "fusedhooks_hist.png"):
    """Save a bar chart of the histogram where matplotlib (the optional `plot` extra) is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 3))
    exponents = edges[:-1].log2().tolist()
    ax.bar(exponents, counts.tolist(), width=0.9, align="edge")
    ax.set_xlabel("floor(log2 |grad|)")
    ax.set_ylabel("elements")
    ax.set_title(f"fusedhooks: |grad| of {name}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
