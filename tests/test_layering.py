"""The package's import graph: no circles, and every import points down the layers.

Every ``import`` and ``from ... import`` of the package's own modules is read from the source
(also those inside functions, which hide circles as well as top-level ones do). Two properties
are checked:

* **no circles**: no module reaches itself through the imports that run (strongly connected
  components of the module graph have one module each; imports under ``if TYPE_CHECKING:`` never
  run and are left out);
* **layers**: a module imports only modules of its own layer or below (:data:`LAYERS`, read top
  down as the data flows: config -> model -> parallel/checkpointing -> run resolution ->
  assembly -> training/inference/evaluation -> the commands) -- type-only imports included: a
  type a lower layer needs belongs in a lower layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LAYERS: list[tuple[str, ...]] = [
    # 0: no project imports but these; used everywhere (epas_megatron.hf: the transformers classes an
    #    EPAS export ships, which import only torch and transformers)
    ("epas_megatron.errors", "epas_megatron.runtime", "epas_megatron.compat", "epas_kernels", "epas_megatron",
     "epas_megatron.hf"),
    # 1: the config as data: schema, command line and YAML, presets, the generated reference
    ("epas_megatron.config",),
    # 1b: what an option that changes the build is (BuildOption: its hooks), read by the packages
    #    that define options (Random-LTD, the model)
    ("epas_megatron.build_option",),
    # 2: what the model is made of: the sharing schedule and region grammar, Random-LTD's schedule
    #    and token ops, the data pipeline
    ("epas_megatron.sharing", "epas_megatron.random_ltd", "epas_megatron.data"),
    # 3: the model (plans, specs, layers, the builder)
    ("epas_megatron.model",),
    # 4: what measures and places it: FLOPs / memory models, pipeline layouts and their balancer
    ("epas_megatron.metrics", "epas_megatron.parallel"),
    # 5: checkpoints and the training engine's components (optimizer, state, one step, the executor)
    ("epas_megatron.checkpointing", "epas_megatron.engine"),
    # 6: a run's config resolved against the world, its data and the checkpoint it resumes
    ("epas_megatron.validation",),
    # 7: one assembly from every source to a build plan
    ("epas_megatron.assembly",),
    # 8: what runs a model: training (and the training features' hooks), inference, evaluation
    ("epas_megatron.training", "epas_megatron.inference", "epas_megatron.evaluation"),
    # 9: the commands and what only they use
    ("epas_megatron.train", "epas_megatron.evaluate", "epas_megatron.generate", "epas_megatron.plan", "epas_megatron.bench",
     "epas_megatron.convert", "epas_megatron.experiments"),
]
"""Every entry is a package or a top-level module: a folder sits in one layer as a whole (no
module of a package is placed apart from it), so an import that runs upward between folders is
an import that runs upward."""


def _module_files() -> dict[str, Path]:
    modules = {}
    for folder, name in ((REPO / "epas_megatron", "epas_megatron"), (REPO / "kernels", "epas_kernels")):
        for path in folder.rglob("*.py"):
            parts = [name, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imports(path: Path, modules: dict[str, Path], type_only: bool = False) -> set[str]:
    """The package modules ``path`` imports (``type_only``: those under ``if TYPE_CHECKING:`` too)."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = set()
    for node in ast.walk(tree):
        if not type_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for inner in ast.walk(node))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # submodules imported by name
    return {name for name in found if name in modules}


def _graph(type_only: bool = False) -> dict[str, set[str]]:
    modules = _module_files()
    return {name: _imports(path, modules, type_only) - {name} for name, path in modules.items()}


def _layer(module: str) -> int:
    best, layer = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, layer = len(prefix), index
    assert layer is not None, f"{module} is in no layer of tests/test_layering.py: add it where it belongs"
    return layer


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter[0]
                    counter[0] += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_circle_finder_finds_a_planted_circle():
    # The detector itself, on a hand-made graph: a -> b -> c -> a is one circle, d hangs off it.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    circles = _circles(_graph())
    assert not circles, "modules that import each other (directly or around a loop): " + "; ".join(" <-> ".join(c) for c in circles)


def test_imports_point_down_the_layers():
    graph = _graph(type_only=True)
    upward = sorted(f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
                    for module, targets in graph.items() for target in targets if _layer(target) > _layer(module))
    assert not upward, "upward imports:\n  " + "\n  ".join(upward)


def test_layers_are_whole_folders():
    """Each layer entry is a package or a top-level module, and no entry lies inside another's
    package: a module that belongs elsewhere moves to a folder of its layer, instead of an
    exception that would let imports run upward between folders."""
    modules = _module_files()
    entries = [entry for layer in LAYERS for entry in layer]
    for entry in entries:
        assert entry in modules, f"{entry} is no module or package"
        depth = entry.count(".")
        assert depth <= 1, f"{entry}: a module of a package placed apart from its folder"
    nested = [(a, b) for a in entries for b in entries if a != b and b.startswith(a + ".") and a != "epas_megatron"]
    assert not nested, nested
