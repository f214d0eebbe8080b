"""The package's layout shows the flow: imports run down the layers (ingest -> split -> label / replay ->
learn -> the fidelity registry -> the pipeline -> use -> cli), no two modules import each other, and no
import is kept inside a function to dodge a cycle."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "hespas_ml"
LAYERS = [{"host", "units"}, {"ingest"}, {"costs"}, {"split"}, {"label", "replay"}, {"learn"}, {"fidelities"},
          {"pipeline", "pipeline_stages"}, {"use"}, {"cli"}]
FACADE = "hespas_ml"        # the package itself: re-exports simulate (imported on first use) and its version


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PROJECT_ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(module: str) -> list[tuple[str, bool]]:
    """(imported hespas_ml module, at the top level?) of every import in ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body} | {id(n) for b in tree.body if isinstance(b, (ast.If, ast.Try)) for n in b.body}
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            names = subs or [base]
        else:
            continue
        out += [(n, id(node) in top) for n in names if n in MODULES]
    return out


def _layer(module: str) -> int:
    name = module.split(".")[1] if "." in module else FACADE
    return next((i for i, layer in enumerate(LAYERS) if name in layer), -1)


def test_every_module_is_on_a_layer():
    assert [m for m in MODULES if m != FACADE and _layer(m) < 0] == []


def test_imports_run_down_the_layers():
    up = [f"{m} -> {t}" for m in MODULES if m != FACADE for t, _ in _imports(m)
          if t != FACADE and _layer(t) > _layer(m)]
    assert up == []


def test_no_cycles_and_no_import_kept_inside_a_function_to_dodge_one():
    top = {m: {t for t, at_top in _imports(m) if at_top and t != m} for m in MODULES}

    def reaches(start: str, goal: str) -> bool:
        seen, stack = set(), [start]
        while stack:
            m = stack.pop()
            if m == goal:
                return True
            if m not in seen:
                seen.add(m)
                stack.extend(top[m])
        return False

    cycles = [f"{m} <-> {t}" for m in MODULES for t in top[m] if reaches(t, m)]
    dodges = [f"{m} -> {t}" for m in MODULES for t, at_top in _imports(m)
              if not at_top and t != m and not m.startswith(t + ".") and reaches(t, m)]
    assert cycles == [] and dodges == []
