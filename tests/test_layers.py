"""The SDK stands on its own: importing it loads none of the server, and its modules import
each other one way only.

``tests/test_import_cycles.py`` checks the whole package's runtime imports; this holds the SDK
(``fencegate/*.py``, the package a worker installs fencegate for) to more: what importing it
really loads, and no cycle even through imports made only for the type checker.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

SDK = Path(__file__).resolve().parent.parent / "fencegate"
#: What a worker must not pay for: the gateway (and its adapters), the HTTP server side of
#: aiohttp, the stores' drivers and the server's libraries.
SERVER_ONLY = (
    "fencegate.gateway",
    "fencegate.adapters",
    "aiohttp.web",
    "redis",
    "sqlite3",
    "pydantic",
    "structlog",
    "prometheus_client",
)


def test_importing_the_sdk_loads_none_of_the_server() -> None:
    script = (
        "import json, sys\n"
        "import fencegate, fencegate.client, fencegate.lease, fencegate.errors, fencegate._http\n"
        "from fencegate import Client, Lease, LeaseLost, wait_out_in_flight\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = json.loads(done.stdout)
    assert "fencegate.client" in loaded and "aiohttp" in loaded
    wrong = [m for m in loaded if any(m == p or m.startswith(p + ".") for p in SERVER_ONLY)]
    assert not wrong, wrong


def _sdk_imports() -> dict[str, set[str]]:
    """Each SDK module -> the SDK modules it imports, type-checking-only imports included."""
    graph: dict[str, set[str]] = {}
    for path in SDK.glob("*.py"):
        name = "fencegate" if path.stem == "__init__" else f"fencegate.{path.stem}"
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
        graph[name] = found
    return graph


def _modules() -> set[str]:
    return {f"fencegate.{path.stem}" for path in SDK.glob("*.py") if path.stem != "__init__"}


def test_no_sdk_module_names_the_gateway() -> None:
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in _sdk_imports().items()
        for target in targets
        if target.startswith(("fencegate.gateway", "fencegate.adapters"))
    )
    assert not wrong, wrong


def test_sdk_modules_import_one_way() -> None:
    """No cycle among the SDK's modules (``fencegate/__init__.py`` re-exports them all, lazily,
    and is left out): the client imports the lease, the lease only what it uses of a client
    (``fencegate._http.Transport``)."""
    sdk = _modules()
    graph = {
        module: {t for t in targets if t in sdk}
        for module, targets in _sdk_imports().items()
        if module != "fencegate"
    }
    visiting: list[str] = []
    done: set[str] = set()
    cycles: list[str] = []

    def visit(module: str) -> None:
        if module in visiting:
            cycles.append(" -> ".join([*visiting[visiting.index(module) :], module]))
            return
        if module in done:
            return
        visiting.append(module)
        for target in sorted(graph.get(module, ())):
            visit(target)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    assert not cycles, cycles
    assert "fencegate.client" not in graph["fencegate.lease"]
    assert "fencegate.lease" in graph["fencegate.client"]
