"""``fencegate demo`` as a user runs it: one command, no set-up, a real gateway and downstream.

It exits 0 only if every story ended as it should, so running it is a smoke test of the
gateway and the SDK together. It must also leave nothing behind on any store, not even when
interrupted, and touch nothing it did not write.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.servers import RedisServer

#: Lines the narration must contain (verdicts in plain words), with how often at least.
KEY_LINES = {
    "-> LEASE_EXPIRED: the lease ran out while A was frozen": 1,
    "-> FENCED: ": 4,
    "-> DOWNSTREAM_TIMEOUT: no answer in 400 ms: the refund is UNKNOWN": 1,
    "-> CLAIMED: ": 2,
    "-> PAYLOAD_CONFLICT: the slot is bound to X": 1,
    "-> EFFECT_UNKNOWN: X may have happened": 1,
    "-> EFFECT_IN_FLIGHT: ": 1,
    "-> REPLAYED: ": 4,
    "-> CLAIMS_PAUSED: ": 1,
    "-> LeaseLost (STALE_EPOCH): ": 3,
    "-> COMMITTED: ": 7,
    "every effect reached the shop exactly once": 1,
    # The MCP story: a lost answer, a stale agent, a replay, a read.
    "-> NO ANSWER: A gave up and closed its connection": 1,
    "-> FENCED: JSON-RPC error -32000 (HTTP 200), error.data.code FENCED": 1,
    "-> ok: none: the stale call was refused before a byte left the gateway": 1,
    "-> REPLAYED: A's call ran: B gets its recorded result": 1,
    "-> ok: the answer A never got, under B's own JSON-RPC id": 1,
    "-> OK: fence-checked and relayed, no ledger entry": 1,
    "; get_invoice has none": 1,
    "every effect reached the MCP server exactly once; the stale call never did": 1,
    # The pipeline: step two waits for step one's canonical commit.
    "-> DEPENDENCIES_PENDING: report-7/load is WAITING for report-7/extract": 1,
    "-> ok: none: 204, step two is not handed out before step one commits": 1,
    "-> ok: B got report-7/load, built on report-7/extract's commit": 1,
    # The chat agent: no task, no lease, an Idempotency-Key; a lost answer and retries.
    "-> DOWNSTREAM_TIMEOUT: the answer is lost: the charge is UNKNOWN": 1,
    "-> EFFECT_UNKNOWN: the shop's lookup does not show the charge yet": 1,
    "-> REPLAYED: the gateway's probe found the charge in the shop": 1,
    "-> ok: Idempotent-Replayed: true": 1,
    "-> PAYLOAD_CONFLICT: the key is bound to the first order": 1,
    "COMMITTED, kind keyed, principal anonymous, key chat-81:pay-order-17: no task": 1,
    "-> ok: exactly 1: the customer paid once": 1,
}
SUMMARY_ROW = re.compile(r"^\s+(\d+)\s+[0-9a-f]{12}\.\.\.\s+(\S+)/(\S+)\s", re.MULTILINE)
#: The narration's store line on Redis names the run's own key prefix.
PREFIX_LINE = re.compile(r'every key under the prefix "(demo[0-9a-f]{8}):"')
STORY_TITLES = 7
SHOP_SUMMARY = "== What the shop actually received =="
MCP_SUMMARY = "== What the MCP server actually ran =="
#: The MCP server's runs: (runs, effectId or "(none)", where, tool, arguments).
MCP_ROW = re.compile(
    r"^\s+(\d+)\s+([0-9a-f]{12}\.\.\.|\(none\))\s+(\S+(?: \S+)*?)\s{2,}(\w+) (\{.*\})$",
    re.MULTILINE,
)


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
    assert out.count(SHOP_SUMMARY) == 1 and out.count(MCP_SUMMARY) == 1, out
    shop_part, mcp_part = out.split(SHOP_SUMMARY)[1].split(MCP_SUMMARY)
    rows = SUMMARY_ROW.findall(shop_part)
    assert len(rows) == 20, out  # 2 + 1 + 1 + 3 reports x 5 pages + the chat agent's charge
    assert all(calls == "1" for calls, _, _ in rows)
    assert {task for _, task, _ in rows} == {
        "invoice-42", "refund-7", "email-9", "report-1", "report-2", "report-3", "anonymous"
    }  # fmt: skip
    # The keyed charge is listed by its principal and the agent's own key.
    assert ("1", "anonymous", "chat-81:pay-order-17") in rows, out
    check_mcp_server_ran(mcp_part)
    assert not list(tmp_path.glob("fencegate-demo-*")), "the demo left its temp dir behind"
    assert not list(tmp_path.glob("*.db*")), "the demo wrote a store outside its temp dir"
    check_stories_explain_themselves(out)


def check_mcp_server_ran(summary: str) -> None:
    """What the MCP server ran, by its own record: A's send_invoice once, under an effectId
    of invoice-77 (B's retry was replayed, A's stale corrected invoice never arrived), and
    B's get_invoice once, with no effectId and no ledger entry. Any other run (the stale
    invoice of 45.00 EUR, a second send) would be a row of its own."""
    rows = MCP_ROW.findall(summary)
    assert [(runs, tool, json.loads(args)) for runs, _, _, tool, args in rows] == [
        ("1", "send_invoice", {"amount": 4200, "customer": "ana"}),
        ("1", "get_invoice", {"invoice": "inv-1"}),
    ], summary
    (_, effect, where, _, _), (_, read, read_where, _, _) = rows
    assert effect != "(none)" and re.fullmatch(r"invoice-77/mcp:[0-9a-f]{8}\.\.\.", where), rows
    assert (read, read_where) == ("(none)", "(not in the ledger)"), rows


def check_stories_explain_themselves(out: str) -> None:
    """Each story says in its own words what failure it shows: no citation of notes a user
    cannot read (``(note "Multi-Agent Task Claims")``), and under each title a plain-words
    paragraph of one or two sentences before the first actor speaks."""
    assert not re.search(r'\bnote\s+"', out), out
    assert "(note" not in out, out
    blocks = re.findall(r"^== \d\. .+ ==\n((?:   \S.*\n)+)", out, re.MULTILINE)
    assert len(blocks) == STORY_TITLES, out
    for block in blocks:
        text = " ".join(line.strip() for line in block.splitlines())
        assert not text.startswith("("), text
        assert 1 <= len(re.findall(r"[.!?](?:\s|$)", text)) <= 2, text
        assert "gateway" in text, text


def demo_command() -> list[str]:
    """The console script a user runs (``python -m fencegate.gateway.cli`` where it is not
    installed)."""
    script = Path(sys.executable).with_name("fencegate")
    return [str(script)] if script.exists() else [sys.executable, "-m", "fencegate.gateway.cli"]


def test_demo_runs_with_no_set_up_and_exits_0(tmp_path: Path) -> None:
    done = run_demo([*demo_command(), "demo"], tmp_path)
    check_narration(done, tmp_path)
    assert "Store: the embedded SQLite store in " in done.stdout


#: The demo, its gateway stalled STALL_S (argv[1]) before it reads agent A's first call under
#: a lease on /mcp (its send_invoice), as a gateway on a loaded machine can be: the one
#: seam is the gateway's first middleware.
STALLED_DEMO = """
import asyncio, sys
from aiohttp import web
import fencegate.gateway.app as app
from fencegate.gateway.demo_stories import run_demo

guard, stalled = app.request_guard, []

@web.middleware
async def stalling_guard(request, handler):
    if request.path.startswith("/mcp/") and "Fence-Task" in request.headers and not stalled:
        stalled.append(request)
        await asyncio.sleep(float(sys.argv[1]))
    return await guard(request, handler)

app.request_guard = stalling_guard
sys.exit(asyncio.run(run_demo()))
"""


# Slow: the whole demo once more, with 0.3 s of A's 600 ms lease spent in the stall, so it
# runs alone (nothing else on the cores) as the other timed demo runs do.
@pytest.mark.slow
def test_demo_replays_the_lost_mcp_call_when_the_gateway_is_slow_to_read_it(
    tmp_path: Path,
) -> None:
    """A's lost answer is lost only once the server runs the tool, however long the gateway
    takes to get to the call. An agent that gave up after a set 250 ms had, under load,
    given up before the gateway read its call: nothing was recorded, B's retry was the first
    call and the story said "expected REPLAYED, got OK"."""
    done = run_demo([sys.executable, "-c", STALLED_DEMO, "0.3"], tmp_path)
    check_narration(done, tmp_path)
    assert "-> REPLAYED: A's call ran: B gets its recorded result" in done.stdout


@pytest.mark.slow
def test_demo_on_redis(tmp_path: Path, redis_server: RedisServer) -> None:
    done = run_demo([*demo_command(), "demo", "--store", redis_server.url], tmp_path)
    check_narration(done, tmp_path)
    assert f"Store: redis://127.0.0.1:{redis_server.port}/0," in done.stdout


def keys_under(server: RedisServer, prefix: str) -> list[str]:
    client = server.client()
    try:
        return sorted(client.scan_iter(match=f"{prefix}*", count=1000))
    finally:
        client.close()


def plant_other_keys(server: RedisServer) -> dict[str, str]:
    """Keys of other prefixes in the same Redis (a gateway's ``fg:``, a look-alike
    ``demo-...``): the demo must not touch them."""
    client = server.client()
    planted = {
        "fg:{invoice-42}:task": "another gateway's task",
        "fg:scheduler": "another gateway's epoch",
        "demo-not-the-demo:{x}:task": "someone else's",
        "demo:scheduler": "someone else's",
    }
    try:
        for key, value in planted.items():
            client.set(key, value)
    finally:
        client.close()
    return planted


def check_untouched(server: RedisServer, planted: dict[str, str]) -> None:
    client = server.client()
    try:
        assert {key: client.get(key) for key in planted} == planted
    finally:
        client.delete(*planted)
        client.close()


def test_demo_on_redis_deletes_its_keys_and_only_its_keys(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Against a Redis that holds other data, the demo prints the prefix it writes under and
    leaves no key under it, and every other key as it was."""
    planted = plant_other_keys(redis_server)
    done = run_demo([*demo_command(), "demo", "--store", redis_server.url], tmp_path)
    check_narration(done, tmp_path)
    found = PREFIX_LINE.search(done.stdout)
    assert found, done.stdout
    prefix = found.group(1)
    deleted = re.search(rf'Cleaning up: deleted the (\d+) keys under "{prefix}:"', done.stdout)
    assert deleted and int(deleted.group(1)) > 0, done.stdout  # it did write, then delete
    assert keys_under(redis_server, prefix) == []
    check_untouched(redis_server, planted)


def test_demo_refuses_an_existing_sqlite_file(tmp_path: Path) -> None:
    """A ``--store sqlite:///FILE`` that exists holds someone's tasks: the demo deletes its
    store at the end, so it must not play on that one (nor leave it changed)."""
    existing = tmp_path / "mine.db"
    existing.write_bytes(b"not the demo's")
    done = run_demo([*demo_command(), "demo", "--store", f"sqlite:///{existing}"], tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "already exists" in done.stdout, done.stdout
    assert existing.read_bytes() == b"not the demo's"
    assert not list(tmp_path.glob("fencegate-demo-*"))


def _lines(stream: object, into: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        into.put(line)
    into.put("")


def interruptible() -> None:
    """Give the demo a terminal's Ctrl-C: SIGINT at its default disposition, as an
    interactive shell starts a foreground command. A suite started in the background
    (``bash .ci/run &``) has SIGINT ignored, and a child inherits that through exec; the
    demo, like Python itself, keeps an ignored SIGINT ignored (what a user who starts it
    with ``&`` or ``nohup`` asked for), so the test must not hand it one."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("kind", ["sqlite", "sqlite-file", "redis"])
def test_demo_cleans_up_when_interrupted(
    kind: str, tmp_path: Path, redis_server: RedisServer
) -> None:
    """Ctrl-C in the middle of a story (the store holds tasks and effects by then): the demo
    still deletes what it wrote, says so, and exits 130 without a traceback."""
    argv = [*demo_command(), "demo"]
    named = tmp_path / "demo.db"
    planted: dict[str, str] = {}
    if kind == "sqlite-file":
        argv += ["--store", f"sqlite:///{named}"]
    elif kind == "redis":
        argv += ["--store", redis_server.url]
        planted = plant_other_keys(redis_server)
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        preexec_fn=interruptible,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + 60
    try:
        while not any(line.startswith("== 2.") for line in seen):
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            assert line, "the demo ended before story 2:\n" + "".join(seen)
            seen.append(line)
        if kind == "sqlite-file":
            assert named.exists(), "".join(seen)  # the store is in use: there is data to delete
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    while (line := lines.get(timeout=10)) != "":
        seen.append(line)
    out = "".join(seen)
    assert proc.stdout is not None and proc.stderr is not None
    stderr = proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    assert proc.returncode == 130, out + stderr
    assert "Traceback" not in stderr and "fencegate demo: interrupted" in stderr, stderr
    assert "Cleaning up: deleted" in out, out
    assert not list(tmp_path.glob("fencegate-demo-*")), "the demo left its temp dir behind"
    if kind == "sqlite-file":
        assert not list(tmp_path.glob("demo.db*")), out
    if kind == "redis":
        found = PREFIX_LINE.search(out)
        assert found, out
        assert keys_under(redis_server, found.group(1)) == []
        check_untouched(redis_server, planted)
