"""The documentation runs as written: every ```python block of README.md and docs/*.md runs, each on its own, and
emits no warning a user would blame on fusedhooks (```python fragment blocks are shown, not run); the blocks whose
results matter are checked by name; every relative link points at a file and heading that exist."""

import logging
import re
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: warnings that third-party packages emit on their own, whoever calls them: (category, message pattern, why)
THIRD_PARTY_WARNINGS = [
    (DeprecationWarning, r"`torch\.jit\.script_method` is deprecated",
     "torch's inductor imports torch.utils.mkldnn, which uses it (only at the first import; Python hides it "
     "outside __main__)"),
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated",
     "lightning.pytorch.utilities._pytree on torch >= 2.10, in any Lightning fit"),
]


@dataclass(frozen=True)
class Snippet:
    """A fenced ```python block of a documentation page."""

    page: str        # path relative to the repository root
    heading: str     # the nearest heading above the block
    line: int        # 1-based line of the opening fence
    ordinal: int     # how many python blocks precede it under the same heading
    code: str
    runnable: bool   # False for ```python fragment

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def key(self) -> tuple[str, str, int]:
        return self.page, self.heading, self.ordinal


def page_snippets(page: Path) -> list[Snippet]:
    """The python blocks of one Markdown page, in order (fences may be indented, inside a list item)."""
    snippets, heading, fence, start, body = [], "", None, 0, []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        stripped = line.strip()
        if fence is None:
            if stripped.startswith("```"):
                fence, start, body = stripped[3:].strip(), number, []
            elif line.startswith("#"):
                heading = line.lstrip("#").strip()
        elif stripped == "```":
            if fence.split(" ")[0] == "python":
                ordinal = sum(s.heading == heading for s in snippets)
                snippets.append(Snippet(str(page.relative_to(ROOT)), heading, start, ordinal,
                                        textwrap.dedent("\n".join(body)) + "\n", fence == "python"))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"{page}: unclosed fence at line {start}"
    return snippets


SNIPPETS = [s for page in PAGES for s in page_snippets(page)]
RUNNABLE = [s for s in SNIPPETS if s.runnable]


def _is_slow(snippet: Snippet) -> bool:
    """A real Hugging Face Trainer or Lightning run, or torch.compile (inductor: 20-40 s on 2 cores)."""
    return bool(re.search(r"^from (transformers|lightning)|^import lightning|torch\.compile", snippet.code, re.M))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def run_snippet(snippet: Snippet) -> tuple[dict, list[warnings.WarningMessage], list[logging.LogRecord]]:
    """Runs the block in a fresh namespace; returns it with the warnings and the log records (WARNING and above)
    it emitted, from any logger (transformers' and lightning's do not propagate to the root)."""
    namespace = {"__name__": f"snippet_{snippet.line}"}
    handler = _Records()
    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in ("transformers", "lightning",
                                                                            "lightning.pytorch", "torch")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec(compile(snippet.code, snippet.id, "exec"), namespace)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        if dist.is_initialized():    # a distributed example that failed half-way
            dist.destroy_process_group()
    return namespace, caught, handler.records


def _ours(caught: warnings.WarningMessage) -> bool:
    return not any(isinstance(caught.message, category) and re.search(pattern, str(caught.message))
                   and "fusedhooks" not in Path(caught.filename).parts
                   for category, pattern, _ in THIRD_PARTY_WARNINGS)


def _check_quick_start(ns, out):
    assert ns["t"].grad.tolist() == [-2.0, 0.0, 2.0]
    assert ns["clip_and_scale"].plan(numel=1 << 20).passes == 1
    assert "passes=1" in out


def _check_clip_and_scale(ns, out):
    assert ns["model"][2].weight.grad.abs().max() <= 0.5
    assert "4,096 units of 1,024 elements" in out


def _check_monitor(ns, out):
    hook = ns["hook"]
    assert hook.stats.to_scalars()["grad/0.weight/norm"] == ns["scalars"]["grad/0.weight/norm"]
    assert ns["total"] > 0 and sorted(hook.stats.read()) == ["0.bias", "0.weight", "2.bias", "2.weight"]


def _check_global_clip(ns, out):
    grads = [p.grad for p in ns["model"].parameters()]
    total = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads]))
    assert ns["total_norm"] > 1.0 and abs(total.item() - 1.0) < 1e-5


def _check_amp(ns, out):
    assert ns["scaler"]._scale is not None and ns["clip"].stats.read()["0.weight"]["norm"] >= 0


def _check_ddp(ns, out):
    assert sorted(ns["hook"].stats.read()) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert not dist.is_initialized()


def _check_compile(ns, out):
    assert ns["hook"].stats.read()["0.weight"]["nan"] == 0


def _check_trainer(ns, out):
    first = ns["first"]
    assert first["grad/total_norm"] > 0 and first["grad/model.embed_tokens.weight/nan"] == 0


def _check_lightning(ns, out):
    metrics = ns["trainer"].callback_metrics  # the default summary
    assert {k for k in metrics if k.startswith("grad/")} == {"grad/total_norm", "grad/absmax", "grad/absmax_index"}
    assert metrics["grad/total_norm"] > 0 and metrics["grad/absmax"] <= 1.0


def _check_agc_adagc(ns, out):
    assert ns["agc"].stats.read()["weight"]["norm"] > 0 and ns["adagc"].stats.read()["weight"]["norm_ema"] > 0


def _check_optimizers(ns, out):
    assert ns["opt"].param_groups[0]["lr"] == 1e-3 / 4 and isinstance(ns["opt"], ns["torch"].optim.AdamW)
    assert ns["loaded"].state_dict()["state"][0]["step"].item() == 3


def _check_step_in_backward(ns, out):
    assert all(ns["opt"].state[p]["step"].item() == 3 for p in ns["model"].parameters())
    assert ns["clip"].stats.read()["0.weight"]["norm"] > 0


def _check_whole_tensor_plan(ns, out):
    assert out.split() == ["2", "1"]


def _check_reductions_over_dimensions(ns, out):
    assert ns["normalize_rows"].plan(shape=(4096, 1024)).passes == 1
    assert ns["center_columns"].plan(shape=(4096, 1024)).passes == 2
    assert "4,096 units of 1,024 elements" in out


#: (page, heading, ordinal) -> a check of the namespace and the printed output the block leaves
CHECKS = {
    ("README.md", "Quick start", 0): _check_quick_start,
    ("README.md", "Clip and scale each gradient", 0): _check_clip_and_scale,
    ("README.md", "Monitor gradients and log the statistics", 0): _check_monitor,
    ("README.md", "Clip by the global norm", 0): _check_global_clip,
    ("README.md", "AMP (GradScaler)", 0): _check_amp,
    ("README.md", "DDP and FSDP2", 0): _check_ddp,
    ("README.md", "torch.compile", 0): _check_compile,
    ("README.md", "Hugging Face Trainer", 0): _check_trainer,
    ("README.md", "Lightning", 0): _check_lightning,
    ("README.md", "Unit-wise (AGC) and adaptive (AdaGC) clipping", 0): _check_agc_adagc,
    ("docs/reductions.md", "Reductions in the body: normalisation and clipping by the tensor's own statistics", 1):
        _check_whole_tensor_plan,
    ("docs/reductions.md", "Over dimensions", 0): _check_reductions_over_dimensions,
    ("docs/optimizers.md", "Optimizers: fh.AdamW and fh.SGD", 0): _check_optimizers,
    ("docs/optimizers.md", "The step inside the backward", 0): _check_step_in_backward,
}


def test_every_check_names_a_runnable_block():
    runnable = {s.key for s in RUNNABLE}
    assert set(CHECKS) <= runnable, sorted(set(CHECKS) - runnable)
    unchecked = [s.id for s in RUNNABLE if s.page == "README.md" and s.key not in CHECKS]
    assert unchecked == [], "every README example has a check of what it computes"


def test_readme_shows_the_commands_ci_runs():
    """The install and the two commands of .ci/run appear in README as written there."""
    readme = (ROOT / "README.md").read_text()
    ci_commands = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                   if line.strip().startswith(("pip install", "python -m"))]
    for command in ci_commands:
        command = command.replace("pip install -q ", "pip install ").split(" --")[0]   # without demo's --steps 3
        assert command in readme


@pytest.mark.parametrize("snippet", [pytest.param(s, id=s.id, marks=[pytest.mark.slow] if _is_slow(s) else [])
                                     for s in RUNNABLE])
def test_snippet_runs_without_warnings(snippet, capsys):
    namespace, caught, records = run_snippet(snippet)
    out = capsys.readouterr().out
    check = CHECKS.get(snippet.key)
    if check is not None:
        check(namespace, out)
    ours = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught if _ours(w)]
    assert ours == [], f"{snippet.id} ({snippet.heading}) warns"
    logged = [f"{r.name}: {r.getMessage()}" for r in records]
    assert logged == [], f"{snippet.id} ({snippet.heading}) logs warnings"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    prose = re.sub(r"`[^`\n]*`", "", re.sub(r"^\s*```.*?^\s*```", "", page.read_text(), flags=re.S | re.M))
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md":
            headings = [line.lstrip("#") for line in file.read_text().splitlines() if re.match(r"#+ ", line)]
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert broken == []
