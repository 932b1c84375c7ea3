"""The README's first screen shows what a new user sees: the version and the gateway's own
start-up lines. These tests keep those lines true to a real ``fencegate serve``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
#: What fits a terminal before a newcomer scrolls.
FIRST_SCREEN = 50


def _first_screen() -> list[str]:
    return (REPO / "README.md").read_text(encoding="utf-8").splitlines()[:FIRST_SCREEN]


def _project_version() -> str:
    with open(REPO / "pyproject.toml", "rb") as file:
        version: str = tomllib.load(file)["project"]["version"]
    return version


def _shown_events() -> dict[str, dict[str, Any]]:
    """The JSON log lines the README shows (``...`` stands for fields it leaves out)."""
    shown: dict[str, dict[str, Any]] = {}
    for line in _first_screen():
        if line.startswith('{"') and '"event"' in line:
            record = json.loads(line.replace(", ...}", "}"))
            shown[record["event"]] = record
    return shown


def test_first_screen_shows_the_installed_version() -> None:
    screen = _first_screen()
    at = screen.index("$ .venv/bin/fencegate --version")
    assert screen[at + 1] == f"fencegate {_project_version()}"
    assert f'{{"status": "ok", "version": "{_project_version()}"}}' in screen
    assert {"gateway.starting", "gateway.listening"} <= set(_shown_events())


def test_first_screen_lines_are_what_serve_logs(tmp_path: Path) -> None:
    """Run ``fencegate serve`` as the README does (no config, in an empty directory) and
    compare: same events in the same order, and each shown field with the value shown (the
    port aside: the test asks for port 0, a free one the system picks, and
    ``gateway.listening`` names the one it got)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "fencegate.gateway.cli", "serve", "--listen", "127.0.0.1:0"],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    logged: list[dict[str, Any]] = []
    try:
        assert process.stderr is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line:
                break
            logged.append(json.loads(line))
            if logged[-1]["event"] == "gateway.listening":
                break
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)
    shown = _shown_events()
    real = {record["event"]: record for record in logged}
    port = str(real["gateway.listening"]["listen"]).rsplit(":", 1)[1]
    assert port != "0", "gateway.listening names the port asked for, not the one bound"
    assert [r["event"] for r in logged if r["event"] in shown] == list(shown)
    for event, fields in shown.items():
        assert event in real, f"the README shows {event}, serve did not log it"
        for key, value in fields.items():
            assert key in real[event], f"{event}: the README shows {key}, serve logs no such field"
            # Where the README's gateway listens: configured (port 0) or bound (the port).
            expected = {str(value).replace("8700", p) for p in ("0", port)}
            assert str(real[event][key]) in expected, (event, key, real[event][key])
