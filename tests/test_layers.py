"""The code follows the firing, one way down (DESIGN.md, Architecture): the modules of fusedhooks/ (and
fusedhooks.kernels) import each other without a circle, and none reads another's private names.

Imports are read from the source (ast), at module level and inside functions alike: a function-level import that
runs back up is a circle too. Imports under `if TYPE_CHECKING:` are left out: they only name types for annotations
(every such module has `from __future__ import annotations`) and never run.
"""

from __future__ import annotations

import ast
import os
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fusedhooks"

#: Private attributes of other libraries' objects that fusedhooks reads on purpose, by attribute name (names read
#: through the torch and triton modules, `torch._C...`, are theirs and not listed).
FOREIGN_PRIVATE = {
    # torch tensors and autograd
    "_version",                      # a tensor's version counter: has a gradient changed since it was measured
    "_post_accumulate_grad_hooks",   # a tensor's hooks: is ours the last one (buckets may wait)
    "_local_tensor",                 # a DTensor's shard (FSDP2)
    "_execution_engine",             # autograd's engine: queue_callback, the end-of-backward callbacks
    # torch.amp.GradScaler's books (scaler= of grad_hook)
    "_per_optimizer_states", "_scale",
    # torch.distributed: DDP's communication hooks, FSDP2's parameters
    "_comm_hooks", "_get_fsdp_state", "_fsdp_param_groups", "_unsharded_param",
    # Lightning's loop and logger (integrations/lightning.py)
    "_should_accumulate", "_logger_connector",
}


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> source file, for fusedhooks/ and the kernels it links in (fusedhooks/kernels)."""
    modules = {}
    for root, _, files in os.walk(PACKAGE, followlinks=True):
        for f in files:
            if f.endswith(".py"):
                path = pathlib.Path(root) / f
                parts = (path.relative_to(PACKAGE.parent).with_suffix("")).parts
                modules[".".join(parts).removesuffix(".__init__")] = path
    return modules


MODULES = _modules()


def _type_checking_only(tree: ast.Module) -> set[int]:
    """id() of the nodes under `if TYPE_CHECKING:`."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for stmt in node.body:
                skipped.update(id(n) for n in ast.walk(stmt))
    return skipped


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, ast.ImportFrom | ast.Import]]:
    """(fusedhooks module imported, import statement) of module `name`, TYPE_CHECKING-only imports left out."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in node.names]
        else:
            continue
        found += [(t, node) for t in targets if t in MODULES and t != name]
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (module -> modules it imports), as a path back to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_modules_are_found():
    # the checks below must see the whole package, the kernels behind the link included
    assert {"fusedhooks.api", "fusedhooks.ops", "fusedhooks.gates", "fusedhooks.kernels.multi_tensor",
            "fusedhooks.integrations.lightning"} <= set(MODULES)
    assert any(t == "fusedhooks.api" for t, _ in _imports("fusedhooks.clip", MODULES["fusedhooks.clip"]))


def test_cycle_finder():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_imports_have_no_circles():
    graph = {name: {t for t, _ in _imports(name, path)} for name, path in MODULES.items()}
    graph["fusedhooks"].clear()  # the package's __init__ re-exports the public names: it sits above every module
    cycle = _cycle(graph)
    assert cycle is None, ("import circle (function-level imports included): " + " -> ".join(cycle)
                           + "; imports go down only: hand the lower module the object or callable it needs")


def _defined_private(tree: ast.Module) -> set[str]:
    """Private names a module defines: its functions, classes, module and class variables, and the attributes it
    assigns (on self or anything else)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):  # __slots__ entries
            names.add(node.value)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _root(node: ast.expr) -> str | None:
    """The name an attribute chain starts from (`torch` for torch._C._current_graph_task_id)."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _private_reads(path: pathlib.Path) -> list[str]:
    """`file:line: expression` of each read of another module's private name in the module at `path`."""
    tree = ast.parse(path.read_text())
    own = _defined_private(tree)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            attr = node.attr
            if (not attr.startswith("_") or attr.startswith("__") or attr in own or attr in FOREIGN_PRIVATE
                    or (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                    or _root(node) in ("torch", "triton")):
                continue
            bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fusedhooks")):
            bad += [f"{path.name}:{node.lineno}: from {'.' * node.level}{node.module or ''} import {a.name}"
                    for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return bad


def test_private_reads_are_detected():
    source = ("from .api import _check_param\nclass A:\n    def f(self, hook):\n        self._mine = 1\n"
              "        return hook._paused, self._mine, hook._mine, grad._version, torch._C._x\n")
    path = PACKAGE.parent / ".pytest_cache" / "layers_probe.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(source)
    assert _private_reads(path) == [
        "layers_probe.py:1: from .api import _check_param", "layers_probe.py:5: hook._paused"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_reads_of_other_modules(name):
    bad = _private_reads(MODULES[name])
    assert not bad, ("reads of private names defined in another module (give them a public name with a docstring, "
                     "or hand the value down):\n" + "\n".join(bad))
