"""The repository layout: the hand-written Triton kernels live in a top-level kernels/ folder, importable as
`fusedhooks.kernels` from the repository root, an editable install and a wheel, without shadowing another
package called `kernels` (Hugging Face's, which transformers imports) when the repository root is on sys.path.

kernels/ has no __init__.py, so from the root it is at most a namespace portion, and a regular package of the
same name anywhere on sys.path wins over it; fusedhooks/kernels is a symbolic link to it (git stores the link,
setuptools copies the files it points to into the wheel)."""

import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from helpers import ROOT

KERNEL_MODULES = ("elementwise", "multi_tensor", "optim", "stats", "units")


def test_the_repository_root_holds_no_package_but_fusedhooks():
    """`python -m pytest` (and python -c, a REPL) puts the repository root first on sys.path, where a regular
    package or a module would shadow an installed one of the same name: a top-level kernels/ with an __init__.py
    once hid Hugging Face's `kernels`, which transformers imports. A folder without __init__.py is only a
    namespace portion, which any regular package of that name on sys.path wins over."""
    importable = sorted(p.stem for p in ROOT.iterdir() if not p.name.startswith(".")
                        and (p.suffix == ".py" or (p / "__init__.py").exists()))
    assert importable == ["fusedhooks"]


def test_the_kernels_live_at_the_top_level_and_fusedhooks_kernels_links_to_them():
    assert sorted(p.stem for p in (ROOT / "kernels").glob("*.py")) == sorted(KERNEL_MODULES)
    assert not any(p.is_symlink() for p in (ROOT / "kernels").iterdir())
    link = ROOT / "fusedhooks" / "kernels"
    assert link.is_symlink() and os.readlink(link) == "../kernels"


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of the files git would check out (tracked and untracked, not ignored), links kept as links: what a
    `git clone` of this tree holds, without the build outputs an install leaves next to the sources."""
    assert shutil.which("git") is not None and (ROOT / ".git").exists(), \
        "tests/test_layout.py checks what a git clone holds: run it from a git checkout of the repository, with git"
    copy = tmp_path_factory.mktemp("layout") / "src"
    for name in _git("ls-files", "-co", "--exclude-standard", "-z").split("\0"):
        source = ROOT / name
        if not name or not os.path.lexists(source):
            continue  # deleted, not yet staged
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            os.symlink(os.readlink(source), copy / name)
        else:
            shutil.copy2(source, copy / name)
    return copy


def test_git_stores_fusedhooks_kernels_as_a_link(checkout):
    """Mode 120000 is a symbolic link, which `git clone` recreates (core.symlinks, true except on Windows without
    the privilege to make them)."""
    mode, blob, *_ = _git("ls-files", "-s", "fusedhooks/kernels").split()
    assert mode == "120000"
    assert _git("cat-file", "blob", blob) == "../kernels"


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args, "--no-deps",
                    "--no-build-isolation", "--quiet"], check=True, capture_output=True, timeout=300)


def _imports(cwd: Path, sys_path: list[Path], site_dir: Path | None, fake_hf_site: Path) -> dict[str, str]:
    """{module: the file it was imported from} for fusedhooks, its kernel modules and `kernels`, in a fresh
    interpreter started in `cwd` without site (so no installed fusedhooks is seen): sys.path is `sys_path`, then
    `site_dir` with its .pth files (an install with --target), then a stand-in for Hugging Face's installed
    `kernels`, then this interpreter's site-packages (torch, triton) without their .pth files."""
    packages = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    code = ("import importlib, json, site, sys\n"
            f"sys.path[1:1] = {[str(p) for p in sys_path]!r}\n"
            f"if {str(site_dir) if site_dir else ''!r}: site.addsitedir({str(site_dir)!r})\n"
            f"sys.path += [{str(fake_hf_site)!r}, *{packages!r}]\n"
            f"names = ['fusedhooks', *('fusedhooks.kernels.' + m for m in {KERNEL_MODULES!r}), 'kernels']\n"
            "print(json.dumps({n: importlib.import_module(n).__file__ for n in names}))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def fake_hf_site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("hf_site")
    (site / "kernels").mkdir()
    (site / "kernels" / "__init__.py").write_text("")
    return site


def _assert_imports(files: dict[str, str], fusedhooks_dir: Path, fake_hf_site: Path) -> None:
    assert Path(files["fusedhooks"]) == fusedhooks_dir / "__init__.py"
    for module in KERNEL_MODULES:
        assert Path(files[f"fusedhooks.kernels.{module}"]) == fusedhooks_dir / "kernels" / f"{module}.py"
    assert Path(files["kernels"]) == fake_hf_site / "kernels" / "__init__.py"


def test_imports_from_the_repository_root(checkout, fake_hf_site):
    """`python -c` in the repository root: sys.path[0] is the root, ahead of the installed `kernels`."""
    files = _imports(checkout, [], None, fake_hf_site)
    _assert_imports(files, checkout / "fusedhooks", fake_hf_site)


def test_imports_from_an_editable_install(checkout, fake_hf_site, tmp_path):
    _pip("install", "--editable", str(checkout), "--target", str(tmp_path / "site"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _assert_imports(_imports(elsewhere, [], tmp_path / "site", fake_hf_site), checkout / "fusedhooks", fake_hf_site)
    # and with the repository root on sys.path too (a script or a notebook started in it)
    _assert_imports(_imports(elsewhere, [checkout], tmp_path / "site", fake_hf_site), checkout / "fusedhooks",
                    fake_hf_site)


def test_the_wheel_holds_the_kernels_as_files_and_imports_them(checkout, fake_hf_site, tmp_path):
    _pip("wheel", "--wheel-dir", str(tmp_path / "dist"), str(checkout))
    (wheel,) = (tmp_path / "dist").glob("fusedhooks-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        infos = {info.filename: info for info in archive.infolist()}
    kernel_files = sorted(n for n in infos if "kernels/" in n)
    assert kernel_files == [f"fusedhooks/kernels/{m}.py" for m in KERNEL_MODULES]
    for name in kernel_files:
        assert not stat.S_ISLNK(infos[name].external_attr >> 16) and infos[name].file_size > 0
    _pip("install", str(wheel), "--target", str(tmp_path / "site"))
    installed = tmp_path / "site" / "fusedhooks"
    assert not any(p.is_symlink() for p in installed.rglob("*"))
    files = _imports(tmp_path, [tmp_path / "site", checkout], None, fake_hf_site)  # the repository root behind it
    _assert_imports(files, installed, fake_hf_site)
