"""The code follows the firing, one way down (DESIGN.md, Architecture): the folders of fusedhooks/ (and
fusedhooks.kernels) stand in floors, each module imports only from its own floor or those below, no modules import each
other in a circle, and none reads another's private names.

Imports are read from the source (ast), at module level, inside functions and under `if TYPE_CHECKING:` alike: a
function-level import that runs back up is a circle too, and so is a type named from above: what a lower module needs
is handed to it as an object or a callable, its type named where it is defined, below.
"""

from __future__ import annotations

import ast
import os
import pathlib
import weakref

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


def _imports(name: str, path: pathlib.Path, type_checking: bool = True
             ) -> list[tuple[str, ast.ImportFrom | ast.Import]]:
    """(fusedhooks module imported, import statement) of module `name`; those under `if TYPE_CHECKING:` only where
    `type_checking`."""
    tree = ast.parse(path.read_text())
    skipped = set() if type_checking else _type_checking_only(tree)
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
    # the checks below must see the whole package, its folders and the kernels behind the link included
    assert {"fusedhooks.api", "fusedhooks.firing.ops", "fusedhooks.registration.gates", "fusedhooks.runtime",
            "fusedhooks.kernels.multi_tensor", "fusedhooks.integrations.lightning"} <= set(MODULES)
    clip = "fusedhooks.clipping.clip"
    assert any(t == "fusedhooks.api" for t, _ in _imports(clip, MODULES[clip]))
    # TYPE_CHECKING imports are imports (a type from above is an import pointing up)
    dispatch = "fusedhooks.firing.dispatch"
    assert "fusedhooks.firing.shards" in {t for t, _ in _imports(dispatch, MODULES[dispatch])}
    assert "fusedhooks.firing.shards" not in {t for t, _ in _imports(dispatch, MODULES[dispatch], type_checking=False)}


def test_cycle_finder():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_imports_have_no_circles():
    graph = {name: {t for t, _ in _imports(name, path)} for name, path in MODULES.items()}
    cycle = _cycle(graph)
    assert cycle is None, ("import circle (function-level and TYPE_CHECKING imports included): " + " -> ".join(cycle)
                           + "; imports go down only: hand the lower module the object or callable it needs")


#: The floors of the house, top down (DESIGN.md, Architecture): a module imports from its own floor and those below
#: only. A floor is a list of folders (every module in them) and top-level modules.
FLOORS = [
    ["fusedhooks.__main__", "fusedhooks.cli"],          # the command line: build, tune, demo
    ["fusedhooks"],                                     # the package's face: the public names
    ["fusedhooks.integrations"],                        # HF Trainer, Lightning, TensorBoard
    ["fusedhooks.clipping", "fusedhooks.optim"],        # clipping across gradients; the owned optimizer steps
    ["fusedhooks.api"],                                 # the hook object, a facade over the floors below
    ["fusedhooks.registration"],                        # register(): tensors, modules, DDP, FSDP2; gates
    ["fusedhooks.firing"],                              # the one firing, dispatch, buckets, shards, traced op, AMP
    ["fusedhooks.kernels"],                             # hand-written Triton kernels (multi-tensor, statistics)
    ["fusedhooks.stats"],                               # the statistics buffer, backwards, merges
    ["fusedhooks.runtime"],                             # launching, backends, compiled kernels, layouts, groups
    ["fusedhooks.codegen"],                             # plans to Triton source and launch specs
    ["fusedhooks.compiler"],                            # tracing, the IR, plans, reductions over dimensions
    ["fusedhooks.config", "fusedhooks.testing"],        # environment variables; the test model and counters
]


def _floor(name: str) -> int | None:
    """The floor of module `name` (its own entry, or its folder's), None if it has none."""
    for i, floor in enumerate(FLOORS):
        if any(name == place or name.startswith(place + ".") for place in floor if place != "fusedhooks"):
            return i
        if name == "fusedhooks" and "fusedhooks" in floor:
            return i
    return None


def test_every_module_has_a_floor():
    homeless = [name for name in MODULES if _floor(name) is None]
    assert not homeless, f"modules on no floor of FLOORS (put each in a folder, and the folder on a floor): {homeless}"
    top_level = sorted(n for n in MODULES if n.count(".") == 1 and MODULES[n].name != "__init__.py")
    assert top_level == ["fusedhooks.__main__", "fusedhooks.api", "fusedhooks.config", "fusedhooks.testing"], (
        f"modules outside the folders: {top_level}; a module belongs in the folder of its concern")


def test_floor_finder():
    assert _floor("fusedhooks") == 1 and _floor("fusedhooks.api") == 4
    assert _floor("fusedhooks.firing.amp") == _floor("fusedhooks.firing") == 6
    assert _floor("fusedhooks.firingx") is None


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_import_points_up(name):
    mine = _floor(name)
    up = [f"{MODULES[name].name}:{node.lineno}: imports {t} (floor {_floor(t)}: {FLOORS[_floor(t)]})"
          for t, node in _imports(name, MODULES[name]) if _floor(t) < mine]
    assert not up, (f"{name} (floor {mine}: {FLOORS[mine]}) imports from a floor above it; imports go down only: "
                    "hand the lower module the object or callable it needs, or move the name down:\n" + "\n".join(up))


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


def test_private_reads_are_detected(tmp_path):
    source = ("from .api import _check_param\nclass A:\n    def f(self, hook):\n        self._mine = 1\n"
              "        return hook._paused, self._mine, hook._mine, grad._version, torch._C._x\n")
    path = tmp_path / "layers_probe.py"
    path.write_text(source)
    assert _private_reads(path) == [
        "layers_probe.py:1: from .api import _check_param", "layers_probe.py:5: hook._paused"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_reads_of_other_modules(name):
    bad = _private_reads(MODULES[name])
    assert not bad, ("reads of private names defined in another module (give them a public name with a docstring, "
                     "or hand the value down):\n" + "\n".join(bad))


# --- the facade: the rooms below api.py are handed the parts they need, never the hook --------------------------

#: The rooms below the hook object (api.py, the facade): the floors under it. Those above take a GradHook (clip
#: functions, hook subclasses, integrations, the CLI) or re-export it.
BELOW_THE_FACADE = sorted(n for n in MODULES if _floor(n) > _floor("fusedhooks.api"))

#: The path of a gradient, top down (DESIGN.md, Architecture): the facade, registration (DDP models, tensors and
#: modules, FSDP2), the firing while torch.compile traces a hook (traced), the eager firing's dispatch (one gradient
#: at a time), FSDP2 shards, buckets, the firing sequence, the registry and the statistics. A module imports none
#: above it.
LAYERS = ["fusedhooks.api", "fusedhooks.registration.ddp", "fusedhooks.registration.register",
          "fusedhooks.firing.traced", "fusedhooks.firing.dispatch", "fusedhooks.firing.shards",
          "fusedhooks.firing.buckets", "fusedhooks.firing.sequence", "fusedhooks.firing.registry",
          "fusedhooks.stats.buffer"]


def _names_the_hook(path: pathlib.Path) -> list[str]:
    """`file:line: what` of each import of fusedhooks.api (TYPE_CHECKING-only ones included) and each use of the name
    GradHook (annotations included) in the module at `path`."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module == "api" or module.endswith(".api") or any(a.name == "api" for a in node.names):
                bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Import) and any(a.name.endswith(".api") for a in node.names):
            bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Name) and node.id == "GradHook":
            bad.append(f"{path.name}:{node.lineno}: GradHook")
    return bad


@pytest.mark.parametrize("name", BELOW_THE_FACADE)
def test_rooms_below_the_facade_never_name_the_hook(name):
    bad = _names_the_hook(MODULES[name])
    assert not bad, (f"{name} is below the hook object (api.py): hand it the parts or callables it needs (see "
                     "buckets.FiringCalls, registration.Registration), never the GradHook:\n" + "\n".join(bad))


def test_layers_go_down():
    assert {"fusedhooks.registration.register", "fusedhooks.firing.dispatch", "fusedhooks.firing.buckets",
            "fusedhooks.registration.ddp", "fusedhooks.firing.shards"} <= set(BELOW_THE_FACADE)
    for i, name in enumerate(LAYERS):
        above = {t for t, _ in _imports(name, MODULES[name])} & set(LAYERS[:i])
        assert not above, f"{name} imports {sorted(above)}, above it in {LAYERS}"


def _holders_of(roots: dict[str, object], cls: type) -> list[str]:
    """Paths (from the names of `roots`) to each instance of `cls` that `roots` hold strongly: through attributes,
    containers, bound methods, partials and closures; not through weak references, modules, classes, a function's
    globals, or tensors (data)."""
    import functools
    import types

    import torch

    found, seen = [], set()
    stack = list(roots.items())
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.CodeType, str, bytes, int, float,
                                               torch.Tensor, weakref.ReferenceType)) or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, cls):
            found.append(path)
            continue
        if isinstance(obj, types.FunctionType):
            cells = [c.cell_contents for c in obj.__closure__ or () if c.cell_contents is not None]
            children = [(f"{path}.<closure>", c) for c in cells] + [(f"{path}.__defaults__", obj.__defaults__)]
        elif isinstance(obj, types.MethodType):
            children = [(f"{path}.__self__", obj.__self__)]
        elif isinstance(obj, functools.partial):
            children = [(f"{path}.func", obj.func), (f"{path}.args", obj.args), (f"{path}.keywords", obj.keywords)]
        elif isinstance(obj, dict):
            children = [(f"{path}[{k!r:.40}]", v) for k, v in obj.items()] + [(f"{path}<key>", k) for k in obj]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        else:
            attributes = dict(getattr(obj, "__dict__", {}))
            for klass in type(obj).__mro__:
                for slot in getattr(klass, "__slots__", ()):
                    if slot not in ("__weakref__", "__dict__") and hasattr(obj, slot):
                        attributes[slot] = getattr(obj, slot)
            children = [(f"{path}.{k}", v) for k, v in attributes.items()]
        stack.extend(children)
    return found


def test_holder_finder():
    class Hook:
        pass

    hook = Hook()
    part = type("Part", (), {})()
    part.callables = [lambda: hook]
    part.weak = weakref.ref(hook)
    assert _holders_of({"part": part}, Hook) == ["part.callables[0].<closure>"]


def test_the_rooms_below_hold_no_hook():
    """The hook's parts (its registration, dispatch, buckets, shard statistics and traced firing) hold no GradHook,
    not even after a backward through buckets, a torch hook at its own firing and a tensor registered through torch
    directly, and a call by hand: what torch holds (the torch hooks) keeps the hook alive instead, as it keeps an
    eager hook."""
    import gc

    import torch

    import fusedhooks as fh
    from fusedhooks.firing.buckets import FiringCalls

    for backend in ("reference", "eager"):  # the eager backend leaves lean firings behind (Dispatch.lean_firings)
        hook = fh.grad_hook(lambda g: g * 0.5, stats=("norm",), backend=backend)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        extra = torch.ones(3, requires_grad=True)
        direct = torch.ones(3, requires_grad=True)
        hook.register(model, bucket_mb=25)
        hook.register(extra)
        direct.register_post_accumulate_grad_hook(hook)
        (model(extra + direct).sum()).backward()
        hook(direct)
        assert len(hook.registry) == 6 and bool(hook.dispatch.lean_firings) == (backend == "eager")
        parts = {"hook.registration": hook.registration, "hook.dispatch": hook.dispatch,
                 "hook._buckets": hook._buckets, "hook._shards": hook._shards, "hook.traced": hook.traced}
        assert not _holders_of(parts, fh.GradHook)
        calls = hook.firing_calls()
        assert isinstance(calls, FiringCalls) and not any(isinstance(v, fh.GradHook) for v in vars(calls).values())

    # no reference cycle through the parts: a hook goes with its tensors, gc or not, before it fires and after (at
    # their own firings and in buckets, each backend's lean firings)
    for backend, fired in [("eager", False), ("eager", True), ("reference", True)]:
        gc.disable()
        try:
            hook = fh.grad_hook(lambda g: g * 0.5, stats=("norm",), backend=backend)
            model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
            hook.register(model[0], name="0", bucket_mb=25)
            hook.register(model[1], name="1")
            hook.register(torch.nn.Linear(2, 2), name="dropped")
            direct = torch.ones(3, requires_grad=True)
            direct.register_post_accumulate_grad_hook(hook)
            if fired:
                for _ in range(2):
                    model(direct).sum().backward()
                hook(direct)
            ref = weakref.ref(hook)
            del hook, direct
            assert ref() is not None  # the torch hooks register() put on model's parameters hold it
            del model
            assert ref() is None, f"a hook that {'fired' if fired else 'did not fire'} ({backend}) outlives its tensors"
        finally:
            gc.enable()

    # a registration of tensors alone (no module: no forward pre-hook holds its handle) keeps the hook alive through
    # the tensors' torch hooks
    for bucket_mb in (None, 25):
        gc.disable()
        try:
            hook = fh.grad_hook(lambda g: g * 0.5, stats=("norm",))
            tensors = [torch.ones(3, requires_grad=True) for _ in range(2)]
            hook.register(tensors, bucket_mb=bucket_mb)
            ref = weakref.ref(hook)
            del hook
            assert ref() is not None
            (tensors[0] * tensors[1]).sum().backward()
            assert torch.equal(tensors[0].grad, torch.full((3,), 0.5))
            del tensors
            assert ref() is None
        finally:
            gc.enable()


# --- one firing sequence -------------------------------------------------------------------------------------------

#: The calls that write a firing's books on the host: the backward numbered, the rows marked as written by it, the
#: gradients they describe recorded (stats.buffer.HookStats and firing.registry define them)
BOOK_WRITES = {"begin_firing", "mark_written", "record_all"}
#: The books of a traced firing, tensors written in the graph (stats.buffer.HookStats keeps them)
DEVICE_BOOKS = {"epoch", "generations"}


def _book_writes(path: pathlib.Path) -> list[str]:
    """What of BOOK_WRITES the module at `path` calls, and the writes to DEVICE_BOOKS tensors it makes (an in-place
    method on one, or an assignment into one)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name in BOOK_WRITES:
                found.append(name)
            elif (isinstance(func, ast.Attribute) and func.attr.endswith("_")
                  and _root(func.value) in DEVICE_BOOKS):
                found.append(f"{_root(func.value)}.{func.attr}")
        elif isinstance(node, ast.Assign):
            found += [f"{_root(t)}[...] =" for t in node.targets
                      if isinstance(t, ast.Subscript) and _root(t) in DEVICE_BOOKS]
    return found


def test_book_writes_are_found(tmp_path):
    source = ("def f(stats, generations, epoch, row):\n    stats.begin_firing(1)\n    epoch.add_(1)\n"
              "    generations[row].copy_(epoch)\n    generations[row] = 2\n    generations.sum()\n")
    path = tmp_path / "books_probe.py"
    path.write_text(source)
    assert sorted(_book_writes(path)) == ["begin_firing", "epoch.add_", "generations.copy_", "generations[...] ="]


def test_the_firing_sequence_alone_writes_the_books():
    """Eager firings, buckets, FSDP2 shards, DDP's buckets and the traced operator all write a firing's books through
    the one firing sequence (fusedhooks/firing/sequence.py); the books' own module (stats/buffer.py) keeps them."""
    writers = {name: _book_writes(path) for name, path in MODULES.items() if name != "fusedhooks.stats.buffer"}
    writers = {name: found for name, found in writers.items() if found}
    assert set(writers) == {"fusedhooks.firing.sequence"}, writers
    assert set(BOOK_WRITES) <= set(writers["fusedhooks.firing.sequence"])
