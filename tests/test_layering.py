"""The import graph of the project's packages: no cycles, and imports go one way.

Every ``import`` statement counts, module-level and function-local alike (a cycle hidden by a function-local
import is still a cycle). ``from package import name`` is an edge to ``package.name`` when that is a module
(importing a submodule runs its package's ``__init__`` first, but that is how packages work, not a cycle),
else to ``package``. The layering (docs/design.md, "Packages"):

    dit_serve.server -> {dit_serve, workers} ; workers -> {graphs, samplers} ; never back
    workers.kernels   imports none of workers.families, workers.speed, diffusers
    the SDK side (dit_serve outside dit_serve.server) imports the server side only lazily, to start it
    workers.speed     imports no family (a family's own fast paths live in its folder)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dit_serve", "workers", "graphs", "samplers")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            rel = f.relative_to(ROOT).with_suffix("")
            mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = f
    return mods


MODULES = _modules()


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The names an import statement reaches, absolute: ``a.b`` for ``import a.b``, and for ``from a import
    b`` ``a.b`` (a module) or ``a`` (a name in it)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative: from the module's package, up level - 1 packages
        parts = module.split(".")
        if MODULES[module].name != "__init__.py":
            parts = parts[:-1]
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    out = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
    return out if len(out) == len(node.names) else out + [base]


def _own(name: str) -> str | None:
    """The project module that ``name`` names (its longest prefix that is one), or None for a third party."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(lazy: bool = True) -> dict[str, set[str]]:
    """module -> the modules it imports (project modules and third-party top-level names); ``lazy``:
    function-local imports too."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        nodes = ast.walk(tree) if lazy else [n for n in tree.body] + [
            n for top in tree.body if isinstance(top, (ast.If, ast.Try)) for n in ast.walk(top)]
        out = set()
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _targets(module, node):
                    out.add(_own(name) or name.split(".")[0])
        out.discard(module)
        graph[module] = out
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start] & graph.keys())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w] & graph.keys()))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def _violations(graph, source: str, forbidden: tuple[str, ...], exempt: tuple[str, ...] = ()) -> list[str]:
    under = lambda m, p: m == p or m.startswith(p + ".")  # noqa: E731
    return sorted(f"{m} -> {t}" for m, ts in graph.items() if under(m, source)
                  and not any(under(m, e) for e in exempt)
                  for t in ts if any(under(t, f) for f in forbidden))


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(imports()) == []


def test_graphs_and_samplers_import_nothing_above_them():
    graph = imports()
    assert _violations(graph, "graphs", ("workers", "dit_serve", "samplers")) == []
    assert _violations(graph, "samplers", ("workers", "dit_serve", "graphs")) == []


def test_workers_import_nothing_of_the_service():
    assert _violations(imports(), "workers", ("dit_serve",)) == []


def test_the_speed_layer_imports_no_family():
    assert _violations(imports(), "workers.speed", ("workers.families", "workers.engine")) == []


def test_kernels_import_no_family_and_no_model_library():
    assert _violations(imports(), "workers.kernels", ("workers.families", "workers.speed", "workers.engine",
                                                      "diffusers", "transformers")) == []


def test_the_sdk_side_imports_the_server_side_only_to_start_it():
    """Module level: nothing of the server side, torch or ray (``pip install .`` has none of them); of the
    samplers only their rules, plain data (the CLI lists the samplers)."""
    eager = imports(lazy=False)
    found = _violations(eager, "dit_serve", ("dit_serve.server", "workers", "graphs", "samplers", "torch", "ray"),
                        exempt=("dit_serve.server",))
    assert [v for v in found if not v.endswith(" -> samplers.rules")] == []


def test_the_workers_package_keeps_a_short_top_level():
    """What a newcomer sees in ``workers/``: the engine, its decode and edits, the worker config and actor,
    loading's dispatch, and the packages (families, kernels, lora, models, request, speed); shared family code
    goes under ``workers/families/``."""
    entries = sorted(p.name for p in (ROOT / "workers").iterdir()
                     if p.name not in ("__init__.py", "__pycache__") and (p.suffix == ".py" or p.is_dir()))
    assert len(entries) <= 12, entries
