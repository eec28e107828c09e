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
