"""``fencegate demo`` as a user runs it: one command, no set-up, a real gateway and downstream.

It exits 0 only if every story ended as it should, so running it is a smoke test of the
gateway and the SDK together.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import RedisServer

#: Lines the narration must contain (verdicts in plain words), with how often at least.
KEY_LINES = {
    "-> LEASE_EXPIRED: the lease ran out while A was frozen": 1,
    "-> FENCED: ": 3,
    "-> DOWNSTREAM_TIMEOUT: no answer in 400 ms: the refund is UNKNOWN": 1,
    "-> CLAIMED: ": 1,
    "-> PAYLOAD_CONFLICT: the slot is bound to X": 1,
    "-> EFFECT_UNKNOWN: X may have happened": 1,
    "-> EFFECT_IN_FLIGHT: ": 1,
    "-> REPLAYED: ": 3,
    "-> CLAIMS_PAUSED: ": 1,
    "-> LeaseLost (STALE_EPOCH): ": 3,
    "-> COMMITTED: ": 6,
    "every effect reached the shop exactly once": 1,
}
SUMMARY_ROW = re.compile(r"^\s+(\d+)\s+[0-9a-f]{12}\.\.\.\s+(\S+)/(\S+)\s", re.MULTILINE)


def run_demo(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=90,
            cwd=tmp_path,
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )
    except subprocess.TimeoutExpired as exc:  # show where it stood
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout
        raise AssertionError(f"the demo hung; its narration so far:\n{out}") from exc


def check_narration(done: subprocess.CompletedProcess[str], tmp_path: Path) -> None:
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "UNEXPECTED" not in out and "FAILED" not in out
    for line, times in KEY_LINES.items():
        assert out.count(line) >= times, (line, out)
    assert re.search(r"All \d+ verdicts as expected \((\d+\.\d) s\)", out), out
    rows = SUMMARY_ROW.findall(out)
    assert len(rows) == 19, out  # 2 + 1 + 1 + 3 reports x 5 pages
    assert all(calls == "1" for calls, _, _ in rows)
    assert {task for _, task, _ in rows} == {
        "invoice-42", "refund-7", "email-9", "report-1", "report-2", "report-3"
    }  # fmt: skip
    assert not list(tmp_path.glob("fencegate-demo-*")), "the demo left its temp dir behind"
    assert not list(tmp_path.glob("*.db*")), "the demo wrote a store outside its temp dir"


def demo_command() -> list[str]:
    """The console script a user runs (``python -m fencegate.gateway.cli`` where it is not
    installed)."""
    script = Path(sys.executable).with_name("fencegate")
    return [str(script)] if script.exists() else [sys.executable, "-m", "fencegate.gateway.cli"]


def test_demo_runs_with_no_set_up_and_exits_0(tmp_path: Path) -> None:
    done = run_demo([*demo_command(), "demo"], tmp_path)
    check_narration(done, tmp_path)
    assert "on the embedded SQLite store" in done.stdout


@pytest.mark.slow
def test_demo_on_redis(tmp_path: Path, redis_server: RedisServer) -> None:
    done = run_demo([*demo_command(), "demo", "--store", redis_server.url], tmp_path)
    check_narration(done, tmp_path)
    assert f"on redis://127.0.0.1:{redis_server.port}/0," in done.stdout
