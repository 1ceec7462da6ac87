"""The speed layer's shape, read from the source: pure kernels import no model library or family, the speed
layer imports no family, and no choice is an ambient switch (a module-level boolean flipped by patching)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("diffusers", "transformers", "workers.families", "workers.speed", "workers.engine", "workers.loading")


def _imports(path: Path) -> list[str]:
    """Every module an import statement of ``path`` names (module level or inside functions)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_kernels_import_no_model_library_and_nothing_above_them():
    files = sorted((ROOT / "workers" / "kernels").glob("*.py"))
    assert files
    bad = {f.name: n for f in files for n in _imports(f)
           if any(n == p or n.startswith(p + ".") for p in FORBIDDEN)
           or (n.startswith("workers") and not n.startswith("workers.kernels"))}
    assert not bad, bad


def test_the_speed_layer_imports_no_family():
    """``workers/speed`` is generic: a family's own fast paths live in its folder and reach the speed layer
    through ``Family.speed_rewrites`` and the registries it fills (families may import the speed layer, not
    the other way round)."""
    files = sorted((ROOT / "workers" / "speed").glob("*.py"))
    assert files
    bad = {f.name: n for f in files for n in _imports(f)
           if n == "workers.families" or n.startswith("workers.families.")}
    assert not bad, bad


def test_the_speed_layer_and_kernels_hold_no_module_level_switch():
    """No ``NAME = True`` / ``False`` at module level in workers/speed or workers/kernels: a choice is a
    ``SpeedConfig`` field passed in."""
    found = []
    for path in sorted([*(ROOT / "workers" / "speed").glob("*.py"), *(ROOT / "workers" / "kernels").glob("*.py")]):
        for node in ast.parse(path.read_text()).body:
            value = getattr(node, "value", None)
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(value, ast.Constant) \
                    and isinstance(value.value, bool):
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found


def test_no_test_flips_a_module_constant_of_the_workers():
    """Tests patch functions and objects where they need a seam, never a module's upper-case constant (an
    ablation switch by another name)."""
    pattern = re.compile(r"""(?:monkeypatch|m|mock\.patch)\.(?:setattr|object)\(\s*(\w+)\s*,\s*["']([A-Z][A-Z0-9_]*)["']""")
    found = []
    for path in sorted((ROOT / "tests" / "workers").rglob("*.py")):
        if path == Path(__file__).resolve():
            continue
        for target, name in pattern.findall(path.read_text()):
            if target not in ("torch", "socket"):
                found.append(f"{path.relative_to(ROOT)}: {target}.{name}")
    # DECODE_PIXELS: a size bound a test shrinks to reach the chunked path
    allowed = {"DECODE_PIXELS"}
    assert [f for f in found if f.rsplit(".", 1)[1] not in allowed] == []
