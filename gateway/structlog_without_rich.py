"""Imported first by the ``fencegate`` command (gateway/cli.py), before anything imports structlog.

structlog's package imports ``structlog.dev`` and ``structlog.tracebacks``, and those import
rich (and pygments through it) whenever it is installed, for the console renderer's pretty
tracebacks: about a tenth of the command's start-up CPU. The gateway renders every line as
JSON (gateway/logs.py) and never uses them, so rich is hidden while structlog loads, which is
exactly what happens where rich is not installed (a production install: only the tests'
schemathesis pulls it in). Whatever imports rich later gets it as usual.
"""

from __future__ import annotations

import sys

__all__: list[str] = []


def _import_structlog_without_rich() -> None:
    if "structlog" in sys.modules or "rich" in sys.modules:
        return  # too late (or nothing to hide): structlog stays as it was loaded
    sys.modules["rich"] = None  # type: ignore[assignment]  # `import rich` raises ImportError
    try:
        import structlog  # noqa: F401
    finally:
        del sys.modules["rich"]


_import_structlog_without_rich()
