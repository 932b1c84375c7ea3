"""``fencegate failover lost``: the gateways' logs as the journal of what was answered, checked
against a store that lost writes (issue 18).

The pure part (gateway/failover_journal.py) on log lines; then the command end to end on a
real gateway's log and an older copy of its SQLite file restored under it (what a failover
to a lagging replica does to a Redis store; tests/test_redis_sentinel.py runs that on a real
Sentinel failover).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fencegate.gateway.failover_journal import (
    LoggedClaim,
    LoggedCommit,
    LoggedEffect,
    claim_finding,
    commit_finding,
    effect_finding,
    read_journal,
)
from fencegate.ledger.effects import effect_id
from tests.api import claim_fence
from tests.downstream import Downstream
from tests.servers import GatewayProcess, Gateways, write_gateway_config


def line(event: str, ts: str, **fields: object) -> str:
    return json.dumps({"event": event, "level": "info", "ts": ts, **fields})


def test_the_last_step_of_an_effect_wins_across_gateways_by_time() -> None:
    """One gateway forwarded it and died before the answer; another settled it later."""
    gw1 = [
        line("effect.prepared", "2026-12-01T10:00:01.000Z", task="t", effect_id="e", slot="s"),
        '{"event": "effect.commi',  # the last line a kill -9 cut off
    ]
    gw2 = [
        line("effect.unknown", "2026-12-01T10:00:09.000Z", task="t", effect_id="e", slot="s"),
        line("effect.prepared", "2026-12-01T10:00:00.500Z", task="u", effect_id="f"),
        "not json",
    ]
    journal = read_journal([("gw2", gw2), ("gw1", gw1)])
    assert journal.effects["e"].state == "UNKNOWN"
    assert journal.effects["e"].where == "gw2:1"
    assert journal.effects["f"].state == "PREPARED"
    assert (journal.lines, journal.skipped) == (5, 2)


def test_the_highest_claim_and_the_last_commit_of_a_task_are_kept() -> None:
    lines = [
        line("claim.granted", "2026-12-01T10:00:02Z", task="t", attempt="b", generation=2),
        line("claim.granted", "2026-12-01T10:00:01Z", task="t", attempt="a", generation=1),
        line(
            "commit.committed",
            "2026-12-01T10:00:03Z",
            task="t",
            attempt="b",
            generation=2,
            commit_id="c",
        ),
        # fields of the wrong type are not ours: ignored, never a crash
        line("claim.granted", "2026-12-01T10:00:04Z", task="t", attempt="x", generation="9"),
        line("effect.committed", "2026-12-01T10:00:04Z", task=7, effect_id="g"),
    ]
    journal = read_journal([("gw", lines)])
    assert journal.claims["t"].attempt == "b" and journal.claims["t"].generation == 2
    assert journal.commits["t"].commit_id == "c"
    assert "g" not in journal.effects


EFFECT = LoggedEffect("e", "t", "s1", "api", "COMMITTED", "ts", "gw:1")


@pytest.mark.parametrize(
    ("logged", "stored", "lost"),
    [
        ("COMMITTED", None, "was sent through api"),
        ("UNKNOWN", None, "may have been sent"),
        ("PREPARED", None, "may have been sent"),
        ("NOT_APPLIED", None, None),  # nothing happened: it may go again
        ("COMMITTED", "PREPARED", "Its outcome was lost"),
        ("UNKNOWN", "PREPARED", "Its outcome was lost"),
        ("PREPARED", "PREPARED", None),
        ("COMMITTED", "COMMITTED", None),
        ("COMMITTED", "UNKNOWN", None),  # behind, but listed as UNKNOWN anyway
        ("COMMITTED", "EXPIRED", None),  # settled and swept: nothing lost
    ],
)
def test_an_effect_is_lost_when_the_store_lacks_it_or_lost_its_outcome(
    logged: str, stored: str | None, lost: str | None
) -> None:
    effect = LoggedEffect("e", "t", "s1", "api", logged, "ts", "gw:1")
    finding = effect_finding(effect, stored)
    if lost is None:
        assert finding is None
    else:
        assert finding is not None and lost in finding.advice, finding


@pytest.mark.parametrize(
    ("stored", "lost"), [(None, "no task"), (0, "generation 0"), (1, "generation 1"), (2, None)]
)
def test_a_claim_is_lost_when_the_task_is_behind_its_generation(
    stored: int | None, lost: str | None
) -> None:
    finding = claim_finding(LoggedClaim("t", "a", 2, "ts", "gw:1"), stored)
    assert (finding.stored if finding else None) == lost
    assert claim_finding(LoggedClaim("t", "a", 2, "ts", "gw:1"), -1) is None  # swept


def test_a_commit_is_lost_unless_the_store_holds_that_one() -> None:
    commit = LoggedCommit("t", "a", 1, "c1", "ts", "gw:1")
    assert commit_finding(commit, "c1", gone=False) is None
    assert commit_finding(commit, "EXPIRED", gone=False) is None
    lost = [commit_finding(commit, None, gone=False), commit_finding(commit, None, gone=True)]
    assert [f.stored if f else None for f in lost] == ["not committed", "no task"]


# --- the command, on a real gateway's log and a restored older copy of its store -------------


async def _call(
    session: aiohttp.ClientSession,
    gateway: GatewayProcess,
    method: str,
    path: str,
    body: object = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    async with session.request(method, gateway.url + path, json=body, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


LOST = [sys.executable, "-m", "fencegate.gateway.cli", "failover", "lost"]


def _lost(config: Path, *logs: Path) -> subprocess.CompletedProcess[str]:
    args = [arg for log in logs for arg in ("--log", str(log))]
    return subprocess.run(
        [*LOST, "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_the_command_lists_what_a_restored_older_store_lost(
    gateways: Gateways, downstream: Downstream, tmp_path: Path
) -> None:
    db = tmp_path / "store" / "fencegate.db"
    db.parent.mkdir()
    gateway = write_gateway_config(
        gateways.root / "gw",
        f"sqlite:///{db}",
        downstreams=[{"name": "api", "url": downstream.url}],
    )
    gateways.started.append(gateway)
    session = aiohttp.ClientSession()
    try:
        await asyncio.to_thread(gateway.start)
        assert (await _call(session, gateway, "PUT", "/v1/tasks/t1", {"inputDigest": "a"}))[
            0
        ] == 201
        claim = {"owner": "w", "ttlMs": 60_000, "schedulerEpoch": 1}
        status, lease = await _call(session, gateway, "POST", "/v1/tasks/t1/claim", claim)
        assert status == 200, lease

        async def pay(slot: str) -> int:
            headers = claim_fence(lease, slot)
            return (await _call(session, gateway, "POST", "/proxy/api/pay", {}, headers))[0]

        assert await pay("s1") == 200
        await asyncio.to_thread(gateway.stop)
        nothing = await asyncio.to_thread(_lost, gateway.config_path, gateway.log_path)
        assert nothing.returncode == 0, nothing.stdout + nothing.stderr
        assert "lost: 0 effects, 0 claims, 0 commits" in nothing.stdout
        older = tmp_path / "older"
        shutil.copytree(db.parent, older)

        await asyncio.to_thread(gateway.start)
        assert await pay("s2") == 200
        body = {
            "attemptId": lease["attemptId"],
            "claimGeneration": lease["claimGeneration"],
            "schedulerEpoch": lease["schedulerEpoch"],
            "cancelGeneration": lease["cancelGeneration"],
            "inputDigest": "a",
            "resultDigest": "r",
        }
        status, committed = await _call(session, gateway, "POST", "/v1/tasks/t1/commit", body)
        assert status == 200, committed
        await asyncio.to_thread(gateway.stop)
    finally:
        await session.close()
    shutil.rmtree(db.parent)
    shutil.copytree(older, db.parent)

    found = await asyncio.to_thread(_lost, gateway.config_path, gateway.log_path)
    assert found.returncode == 3, found.stdout + found.stderr
    assert "lost: 1 effect, 0 claims, 1 commit" in found.stdout, found.stdout
    assert f"effect {effect_id('t1', 1, 'main', 's2')} (task t1): logged COMMITTED" in found.stdout
    assert effect_id("t1", 1, "main", "s1") not in found.stdout
    assert "commit t1 (task t1)" in found.stdout and "store: not committed" in found.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--log", "/nonexistent/gw.log"], "--log /nonexistent/gw.log: No such file"),
        ([], "the following arguments are required: --log"),
    ],
)
def test_a_log_that_cannot_be_read_is_named(tmp_path: Path, args: list[str], message: str) -> None:
    config = tmp_path / "fencegate.toml"
    config.write_text(f'[store]\nurl = "sqlite:///{tmp_path / "f.db"}"\n')
    done = subprocess.run(
        [*LOST, "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "command", [["store", "migrate"], ["failover", "ack"], ["failover", "lost", "--log", "x"]]
)
def test_a_config_that_cannot_be_used_is_named_by_every_store_command(
    tmp_path: Path, command: list[str]
) -> None:
    config = tmp_path / "fencegate.toml"
    config.write_text("[store]\nbogus = 1\n")
    done = subprocess.run(
        [sys.executable, "-m", "fencegate.gateway.cli", *command, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    name = " ".join(command[:2])
    assert f"fencegate {name}: config error: " in done.stderr and "store.bogus" in done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr
