"""No import cycle between fencegate's modules, and each layer imports only those below it.

Read from the source with ``ast`` (imports under ``if TYPE_CHECKING:`` do not count: they never
run). The layers, lowest first: ``fencegate.ledger`` (durable state), ``fencegate.adapters``
(per-downstream behaviour), the SDK (``fencegate`` itself: never the server), and
``fencegate.gateway`` (HTTP), which may use all of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: Import package -> folder in the repository (pyproject.toml's package-dir).
FOLDERS = {
    "fencegate": REPO / "fencegate",
    "fencegate.gateway": REPO / "gateway",
    "fencegate.ledger": REPO / "ledger",
    "fencegate.adapters": REPO / "adapters",
}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.glob("*.py"):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = path
    return found


def _runtime_imports(path: Path, module: str, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                out.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.add(node.module)
                out.update(f"{node.module}.{alias.name}" for alias in node.names)
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    visit([child])

    visit(tree.body)
    return {name for name in out if name in known and name != module}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _runtime_imports(path, name, known) for name, path in modules.items()}


def _layer(module: str) -> str:
    for package in ("fencegate.gateway", "fencegate.ledger", "fencegate.adapters"):
        if module == package or module.startswith(package + "."):
            return package
    return "fencegate"


def test_no_module_imports_itself_through_others() -> None:
    graph = _graph()
    # Package __init__ modules re-export their members: an edge into a package's own
    # modules from its __init__ is not a cycle of behaviour.
    cycles = []
    for start in graph:
        stack = [(start, [start])]
        seen: set[str] = set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start and not start.endswith(("__init__",)):
                    if not any(p in FOLDERS for p in path):
                        cycles.append([*path, nxt])
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


ALLOWED = {
    "fencegate.ledger": {"fencegate.ledger"},
    "fencegate.adapters": {"fencegate.adapters", "fencegate.ledger"},
    "fencegate": {"fencegate", "fencegate.ledger"},
    "fencegate.gateway": {
        "fencegate.gateway",
        "fencegate.ledger",
        "fencegate.adapters",
        "fencegate",
    },
}


def test_each_layer_imports_only_the_layers_below_it() -> None:
    wrong = []
    for module, imports in _graph().items():
        layer = _layer(module)
        for target in imports:
            if _layer(target) not in ALLOWED[layer]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "\n".join(sorted(wrong))
