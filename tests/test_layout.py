"""The layout holds: imports run one way (cli -> loop -> components -> core), no module imports one of a layer
above it, there is no import cycle, no file passes 400 code lines, and every name the README's walk-through
("Follow one sample") mentions exists."""

from __future__ import annotations

import ast
import importlib
import re
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MOLT = ROOT / "molt"

# module -> layer; a module may import its own layer and those below. README "Layout" explains each.
LAYERS = {
    "core": ["plan", "trace", "estimators", "losses", "routing"],
    "components": ["data", "placement", "tiny", "agent", "agents", "generator", "refit", "chat_server",
                   "chat_protocols", "models", "ranks", "trainer", "critic", "checkpoint", "tracking", "records", "console"],
    "loop": ["pool", "step", "loop", "validate"],
    "cli": ["cli"],
}
RANK = {module: rank for rank, modules in enumerate(LAYERS.values()) for module in modules}
MAX_CODE_LINES = 400


def molt_modules() -> dict[str, Path]:
    """molt's modules by their name under molt/ (a package such as molt/agents/ counts as one module)."""
    return {p.relative_to(MOLT).parts[0].removesuffix(".py"): p for p in MOLT.rglob("*.py")
            if p.name != "__init__.py" or p.parent != MOLT}


def imports_of(path: Path) -> set[str]:
    """The molt modules `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "molt":
            parts = node.module.split(".")
            found |= {parts[1]} if len(parts) > 1 else {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("molt.")}
    return found


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in molt_modules().items():
        graph.setdefault(name, set()).update(imports_of(path) - {name})
    return graph


def test_every_module_has_a_layer():
    assert set(import_graph()) <= set(RANK), f"add to LAYERS: {sorted(set(import_graph()) - set(RANK))}"


def test_imports_run_one_way_without_cycles():
    graph = import_graph()
    upward = [f"{module} ({layer(module)}) imports {target} ({layer(target)})"
              for module, targets in graph.items() for target in targets if RANK[target] > RANK[module]]
    assert not upward, "\n".join(upward)
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as e:
        pytest.fail(f"import cycle: {' -> '.join(e.args[1])}")


def layer(module: str) -> str:
    return list(LAYERS)[RANK[module]]


def test_no_file_over_400_code_lines():
    code_lines = {str(p.relative_to(ROOT)): sum(1 for line in p.read_text().splitlines()
                                                if line.strip() and not line.strip().startswith("#"))
                  for p in MOLT.rglob("*.py")}
    assert {p: n for p, n in code_lines.items() if n > MAX_CODE_LINES} == {}


def walkthrough_names() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Follow one sample", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"`(molt\.[\w.]+)`", section)


def resolve(name: str) -> bool:
    """Whether the dotted `name` is a module or an attribute path inside one."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def test_walkthrough_names_exist():
    names = walkthrough_names()
    assert len(names) >= 15, "the walk-through should name each stop's module and function"
    assert [name for name in names if not resolve(name)] == []
