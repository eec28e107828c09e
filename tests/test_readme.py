"""The README's quick start runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_quick_start_runs():
    code = re.search(r"## Quick start\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace = {}
    exec(compile(code, "README quick start", "exec"), namespace)
    assert namespace["t"].grad.tolist() == [-2.0, 0.0, 2.0]
    assert namespace["handle"] is not None


def _snippet(heading: str) -> str:
    return re.search(rf"{re.escape(heading)}\n.*?```python\n(.*?)```", README.read_text(), re.S).group(1)


def test_plain_loop_snippet_runs(capsys):
    namespace = {}
    exec(compile(_snippet("### Plain loops: gradient accumulation and loggers"), "README plain loops", "exec"),
         namespace)
    assert namespace["hook"].stats.to_scalars()["grad/0.weight/norm"] == namespace["scalars"]["grad/0.weight/norm"]
    assert namespace["total"] > 0 and sorted(namespace["hook"].stats.read()) == ["0.bias", "0.weight", "2.bias",
                                                                                "2.weight"]


def test_trainer_snippet_runs():
    namespace = {}
    exec(compile(_snippet("### Hugging Face Trainer"), "README Trainer", "exec"), namespace)
    first = namespace["first"]
    assert first["grad/total_norm"] > 0 and first["grad/transformer.wte.weight/nan"] == 0


def test_lightning_snippet_runs():
    namespace = {}
    exec(compile(_snippet("### Lightning"), "README Lightning", "exec"), namespace)
    metrics = namespace["trainer"].callback_metrics
    assert metrics["grad/total_norm"] > 0 and metrics["grad/net.0.weight/absmax"] <= 1.0


def test_compile_snippet_runs():
    namespace = {}
    exec(compile(_snippet("### torch.compile and compiled autograd"), "README compile", "exec"), namespace)
    assert namespace["hook"].stats.read()["0.weight"]["nan"] == 0


def test_reductions_over_dimensions_snippets_run(capsys):
    section = re.search(r"### Over dimensions, and unit-wise clipping \(AGC\)\n(.*?)\n## ", README.read_text(),
                        re.S).group(1)
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    namespace = {}
    exec(compile("import torch\nimport fusedhooks as fh\n" + blocks[0] + blocks[1], "README dims", "exec"), namespace)
    rows, columns = namespace["normalize_rows"], namespace["center_columns"]
    assert rows.plan(shape=(4096, 1024)).passes == 1 and columns.plan(shape=(4096, 1024)).passes == 2
    assert "4,096 units of 1,024 elements" in capsys.readouterr().out
