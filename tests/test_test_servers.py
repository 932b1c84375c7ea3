"""The suite's own servers go with the pytest that started them: a run killed with
``kill -9`` (CI's timeout, an impatient developer) must not leave a redis-server holding
its port and data directory for the next run to trip on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent

_STARTER = """
import sys
from pathlib import Path
from tests.servers import RedisServer
server = RedisServer(Path(sys.argv[1])).start()
print(server.proc.pid, flush=True)
sys.stdin.read()
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its (init) parent to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_killed_test_process_takes_its_redis_server_with_it(tmp_path: Path) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", _STARTER, str(tmp_path / "redis")],
        cwd=_REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    ) as starter:
        assert starter.stdout is not None
        redis_pid = int(starter.stdout.readline())
        starter.send_signal(signal.SIGKILL)
    try:
        deadline = time.monotonic() + 30  # bounds a hang only: the kernel acts at once
        while _running(redis_pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _running(redis_pid), "redis-server outlived the process that started it"
    finally:
        if _running(redis_pid):
            os.kill(redis_pid, signal.SIGKILL)
