"""The house's import rules, read from the sources: the top packages import only downward
(codec ← protocol ← node ← miner / validator ← commands ← lab: the lab drives the product's
commands, and `commands.cli` names the lab's commands only as strings it imports on use), and no
module imports itself back through others (no import circle, type-checking imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# each package, and the packages it may import from
ALLOWED: dict[str, set[str]] = {
    "codec": set(),
    "protocol": {"codec"},
    "node": {"codec", "protocol"},
    "miner": {"codec", "protocol", "node"},
    "validator": {"codec", "protocol", "node"},
    "commands": {"codec", "protocol", "node", "miner", "validator"},
    "lab": {"codec", "protocol", "node", "miner", "validator", "commands"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in ALLOWED:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (a `from package import name` counts as the submodule
    when there is one)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [s for s in subs if s in modules] or [node.module]
        else:
            continue
        out.update(n for n in names if n.split(".")[0] in ALLOWED)
    return out


def test_top_packages_import_only_downward() -> None:
    modules = _modules()
    upward = [
        f"{name} imports {dep}"
        for name, path in modules.items()
        for dep in _imports(path, modules)
        if (top := name.split(".")[0]) != (dep_top := dep.split(".")[0])
        and dep_top not in ALLOWED[top]
    ]
    assert upward == []


def test_no_import_circle() -> None:
    modules = _modules()
    graph = {
        name: {d for d in _imports(path, modules) if d in modules and d != name}
        for name, path in modules.items()
    }
    # a package's __init__ re-exporting its own submodules is not a circle through other modules
    for name in graph:
        graph[name] = {d for d in graph[name] if not d.startswith(name + ".")}
    circles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                circles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == []
