"""fusedhooks.config: the one module that reads environment variables, what it reads and how it refuses."""

import ast
import re
from pathlib import Path

import pytest

from fusedhooks import config

from helpers import ROOT


def _sources() -> list[Path]:
    """Every module of the package, the hand-written kernels included (fusedhooks/kernels links to kernels/)."""
    return sorted((ROOT / "fusedhooks").rglob("*.py")) + sorted((ROOT / "kernels").glob("*.py"))


def _environment_reads(tree: ast.AST) -> list[int]:
    """Lines that read the environment: os.environ or os.getenv used other than to set a variable
    (`os.environ[name] = value`, `os.environ.setdefault(name, value)`), or imported by name from os."""
    allowed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            allowed.update(id(t.value) for t in node.targets if isinstance(t, ast.Subscript))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "setdefault"):
            allowed.add(id(node.func.value))
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
                and node.attr in ("environ", "environb", "getenv", "getenvb") and id(node) not in allowed):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "environb", "getenv", "getenvb") for a in node.names):
            lines.append(node.lineno)
    return sorted(lines)


def test_only_config_reads_the_environment():
    assert _environment_reads(ast.parse((ROOT / "fusedhooks" / "config.py").read_text()))  # the check sees reads
    reads = {str(path.relative_to(ROOT)): lines for path in _sources() if path.name != "config.py"
             and (lines := _environment_reads(ast.parse(path.read_text())))}
    assert reads == {}, "read environment variables through fusedhooks.config"


def test_the_check_tells_reads_from_writes():
    source = ("import os\nos.environ['A'] = '1'\nos.environ.setdefault('B', '1')\nos.environ.get('C')\n"
              "os.getenv('D')\n'E' in os.environ\nfrom os import environ\n")
    assert _environment_reads(ast.parse(source)) == [4, 5, 6, 7]


def _variables_read_by_config() -> set[str]:
    return set(re.findall(r'os\.environ\.get\("([A-Z_]+)"', (ROOT / "fusedhooks" / "config.py").read_text()))


def test_config_and_documented_tables_list_every_variable_read():
    read = _variables_read_by_config()
    assert {"TRITON_INTERPRET", "FUSEDHOOKS_BACKEND", "FUSEDHOOKS_BLOCK", "FUSEDHOOKS_FAST_LAUNCH",
            "FUSEDHOOKS_CACHE_DIR", "FUSEDHOOKS_TUNE_CACHE", "XDG_CACHE_HOME"} <= read
    assert set(re.findall(r"^\| `([A-Z_]+)` \|", config.__doc__, re.M)) == read
    page = (ROOT / "docs" / "environment.md").read_text()
    assert set(re.findall(r"^\| `([A-Z_]+)` \|", page, re.M)) == read - {"XDG_CACHE_HOME"}


@pytest.mark.parametrize(("value", "expected"), [(None, None), ("", None), ("16", 16), ("4096", 4096),
                                                 ("1048576", 1 << 20)])
def test_block_reads_a_power_of_two(value, expected, monkeypatch):
    if value is None:
        monkeypatch.delenv("FUSEDHOOKS_BLOCK", raising=False)
    else:
        monkeypatch.setenv("FUSEDHOOKS_BLOCK", value)
    assert config.block() == expected


@pytest.mark.parametrize("value", ["abc", "8", "0", "-16", "48", "4096.0", "0x100"])
def test_block_refuses_anything_else(value, monkeypatch):
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", value)
    with pytest.raises(ValueError, match=re.escape(f"FUSEDHOOKS_BLOCK must be a power of two >= 16, not {value!r}")):
        config.block()


def test_backend_is_none_when_unset_or_empty(monkeypatch):
    monkeypatch.delenv("FUSEDHOOKS_BACKEND", raising=False)
    assert config.backend() is None
    monkeypatch.setenv("FUSEDHOOKS_BACKEND", "")
    assert config.backend() is None
    monkeypatch.setenv("FUSEDHOOKS_BACKEND", "eager")
    assert config.backend() == "eager"


@pytest.mark.parametrize(("value", "on"), [(None, False), ("", False), ("0", False), ("1", True), ("true", True)])
def test_triton_interpret(value, on, monkeypatch):
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert config.triton_interpret() is on


def test_cache_locations(monkeypatch, tmp_path):
    monkeypatch.delenv("FUSEDHOOKS_CACHE_DIR", raising=False)
    monkeypatch.delenv("FUSEDHOOKS_TUNE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert config.cache_dir() == tmp_path / "xdg" / "fusedhooks"
    assert config.tune_cache() == tmp_path / "xdg" / "fusedhooks" / "tuning.json"
    monkeypatch.setenv("FUSEDHOOKS_CACHE_DIR", str(tmp_path / "kernels"))
    assert config.cache_dir() == tmp_path / "kernels"
    assert config.tune_cache() == tmp_path / "kernels" / "tuning.json"
    monkeypatch.setenv("FUSEDHOOKS_TUNE_CACHE", str(tmp_path / "t.json"))
    assert config.tune_cache() == tmp_path / "t.json"


def test_an_empty_xdg_cache_home_counts_as_unset(monkeypatch):
    """The XDG base directory specification: an empty XDG_CACHE_HOME means the default, ~/.cache (it used to give
    a directory `fusedhooks` relative to the working directory)."""
    monkeypatch.delenv("FUSEDHOOKS_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert config.cache_dir() == Path.home() / ".cache" / "fusedhooks"
