"""The operator CLI (``fencegate effects|tasks|epoch|claims``) against a real gateway.

The gateway runs in-process on loopback (SQLite store, background reconciler off so only the
CLI settles effects) in front of a real downstream; every command is ``fencegate.gateway.cli.main``
run in a worker thread, so it speaks HTTP to the gateway exactly as from a terminal. One test
runs ``python -m fencegate.gateway.cli`` as a process for the entry point and the exit codes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from collections.abc import AsyncIterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway import ops_commands
from fencegate.gateway.app import create_app
from fencegate.gateway.cli import main
from fencegate.gateway.config import ServerConfig
from fencegate.ledger.effects import effect_id
from tests.api import Api, Lease
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.servers import refused_port

NO_EFFECT = "0" * 64


@dataclass
class Run:
    """What a command printed, without the gateway it names (every answer starts with
    ``gateway URL (...)``, has a ``"gateway"`` field in ``--json``, and a refusal ends with
    it on stderr): ``gateway`` holds that line, or the JSON's URL.
    tests/test_cli_operability.py checks those lines themselves."""

    code: int
    out: str
    err: str
    gateway: str = ""

    @classmethod
    def of(cls, code: int, out: str, err: str) -> Run:
        gateway = ""
        if out.startswith("gateway "):
            gateway, _, out = out.partition("\n")
        elif out.startswith("{"):
            answer = json.loads(out)
            gateway = answer.pop("gateway")
            # A list is wrapped as {"gateway": URL, "effects": [...]}.
            (data,) = answer.values() if list(answer) == ["effects"] else (answer,)
            out = json.dumps(data)
        lines = err.splitlines(keepends=True)
        if code == 1 and lines and lines[-1].startswith("fencegate: gateway "):
            gateway, err = lines[-1][len("fencegate: ") :].rstrip("\n"), "".join(lines[:-1])
        return cls(code, out, err, gateway)

    def json(self) -> Any:
        return json.loads(self.out)


@dataclass
class Env:
    api: Api
    url: str
    downstream: Downstream
    capsys: pytest.CaptureFixture[str]
    logs: list[MutableMapping[str, Any]]

    async def cli(self, *argv: str, url: bool = True) -> Run:
        """``fencegate ARGV --url <the gateway>`` in a thread; what it printed and returned."""
        self.capsys.readouterr()
        args = [*argv, "--url", self.url] if url else list(argv)
        code = await asyncio.to_thread(main, args)
        out, err = self.capsys.readouterr()
        run = Run.of(code, out, err)
        if url and run.gateway.startswith("gateway "):
            assert run.gateway == f"gateway {self.url} (from --url)"
        elif url and run.gateway:
            assert run.gateway == self.url
        return run

    async def lease(self, task_id: str = "t1") -> Lease:
        await self.api.put(task_id)
        return await self.api.claim(task_id, ttl_ms=30_000)

    async def send(
        self, lease: Lease, downstream: str, path: str, slot: str = "s1", body: Any = None
    ) -> tuple[int, str]:
        """A worker's proxied POST; answers (status, Fence-Effect-Id)."""
        headers = {
            "Fence-Task": lease.task_id,
            "Fence-Attempt": lease.attempt_id,
            "Fence-Generation": str(lease.claim_generation),
            "Fence-Epoch": str(lease.scheduler_epoch),
            "Fence-Cancel": str(lease.cancel_generation),
            "Fence-Slot": slot,
        }
        async with self.api.client.post(
            f"/proxy/{downstream}{path}", json=body or {"amount": 5}, headers=headers
        ) as resp:
            await resp.read()
            return resp.status, resp.headers.get("Fence-Effect-Id", "")


@pytest.fixture
async def env(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> AsyncIterator[Env]:
    downstream = await Downstream().start()
    config = make_config(
        f"sqlite:///{tmp_path / 'fencegate.db'}",
        reconciler={"enabled": False},
        downstreams=[
            {"name": "api", "url": downstream.url, "timeout_ms": 2000},
            {
                "name": "probed",
                "url": downstream.url,
                "adapter": "probe",
                "timeout_ms": 2000,
                "probe": {"path": "/ok/{effectId}"},
            },
            {
                "name": "guarded",
                "url": downstream.url,
                "adapter": "manual",
                "require_approval": True,
            },
            # Lease-less calls by Idempotency-Key (without [auth] the caller is "anonymous").
            {
                "name": "keyed",
                "url": downstream.url,
                "timeout_ms": 2000,
                "client_idempotency_keys": "optional",
            },
        ],
    )
    app = create_app(config, store=build_test_store(config))
    # The gateway's log events go to ``env.logs``, not to the stdout the CLI is judged by.
    with structlog.testing.capture_logs() as logs:
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            url = str(client.make_url("")).rstrip("/")
            yield Env(Api(client), url, downstream, capsys, logs)
    await downstream.stop()


async def unknown_effect(env: Env, task_id: str = "t1") -> str:
    """A forward the downstream answered 500: its outcome is UNKNOWN."""
    lease = await env.lease(task_id)
    status, eid = await env.send(lease, "api", "/status/500")
    assert status == 500
    assert eid == effect_id(task_id, 1, "main", "s1")
    return eid


# --- effects ------------------------------------------------------------------------------------


async def test_list_show_and_resolve_an_unknown_effect(env: Env) -> None:
    eid = await unknown_effect(env)

    listed = await env.cli("effects", "list")
    assert listed.code == 0, listed.err
    header, row = listed.out.splitlines()
    assert header.split() == [
        "EFFECT", "STATE", "TASK/KEY", "DOWNSTREAM", "REQUEST", "ATTEMPTS", "UPDATED",
    ]  # fmt: skip
    assert row.split()[:7] == [eid[:12], "UNKNOWN", "t1", "api", "POST", "/status/500", "1"]
    assert row.endswith("Z")

    as_json = await env.cli("effects", "list", "--state", "unknown", "--json")
    assert as_json.code == 0
    (record,) = as_json.json()
    assert record["effectId"] == eid and record["state"] == "UNKNOWN"
    for filters in (["--task", "t1"], ["--downstream", "api"], ["--state", "UNKNOWN"]):
        assert len((await env.cli("effects", "list", "--json", *filters)).json()) == 1
    for filters in (["--task", "other"], ["--downstream", "probed"], ["--state", "COMMITTED"]):
        assert (await env.cli("effects", "list", "--json", *filters)).json() == []
    assert (await env.cli("effects", "list", "--task", "other")).out == "no effects\n"

    shown = await env.cli("effects", "show", eid)
    assert shown.code == 0, shown.err
    assert f"effect          {eid}" in shown.out
    assert "state           UNKNOWN" in shown.out
    assert "request         POST /status/500" in shown.out
    assert "attempts (1):" in shown.out
    # The attempt's outcome and the downstream's stored answer.
    assert "UNKNOWN" in shown.out.split("attempts (1):")[1]
    assert "response:\n  status   500" in shown.out
    # A prefix as the table shows it names the same effect.
    assert (await env.cli("effects", "show", eid[:12])).out == shown.out
    assert (await env.cli("effects", "show", eid, "--json")).json()["effectId"] == eid

    # The 500 came within settle_ms: the request may still land, so NOT_APPLIED is refused,
    # saying until when and how to force it.
    early = await env.cli(
        "effects", "resolve", eid[:12], "--outcome", "not_applied", "--note", "no charge",
        "--operator", "alice",
    )  # fmt: skip
    assert early.code == 1 and early.out == ""
    said = f"fencegate: EFFECT_IN_FLIGHT: effect {eid}: an earlier forward"
    assert early.err.startswith(said), early.err
    assert "check the downstream after " in early.err and "--force" in early.err
    resolved = await env.cli(
        "effects", "resolve", eid[:12], "--outcome", "not_applied", "--note", "no charge",
        "--operator", "alice", "--force",
    )  # fmt: skip
    assert resolved.code == 0, resolved.err
    assert f"effect {eid} resolved as NOT_APPLIED (forced: " in resolved.out
    (event,) = [e for e in env.logs if e["event"] == "operator.resolve"]
    assert event["operator"] == "alice" and event["effect_id"] == eid
    after = (await env.cli("effects", "show", eid, "--json")).json()
    assert after["state"] == "NOT_APPLIED"
    assert after["actions"][-1]["by"] == "alice"
    assert after["actions"][-1]["note"] == "no charge"
    assert after["actions"][-1]["force"] is True
    shown = await env.cli("effects", "show", eid)
    assert "resolve (forced)" in shown.out and "alice" in shown.out and "no charge" in shown.out

    # The same resolution again is a no-op; the other one is refused, clearly.
    again = await env.cli(
        "effects", "resolve", eid, "--outcome", "NOT_APPLIED", "--note", "no charge", "--json"
    )
    assert again.code == 0 and again.json()["state"] == "NOT_APPLIED"
    other = await env.cli("effects", "resolve", eid, "--outcome", "COMMITTED", "--note", "x")
    assert other.code == 1 and other.out == ""
    assert other.err.startswith("fencegate: EFFECT_SETTLED: ")
    assert "NOT_APPLIED" in other.err


async def test_keyed_effects_are_listed_shown_found_and_resolved(env: Env) -> None:
    """A lease-less client's effect has no task: the table names its principal and key, the
    record shows kind, principal and idempotencyKey, and the key finds it."""
    async with env.api.client.post(
        "/proxy/keyed/status/500", json={"amount": 5}, headers={"Idempotency-Key": "k-cli"}
    ) as resp:
        assert resp.status == 500
        eid = resp.headers["Fence-Effect-Id"]
    leased = await unknown_effect(env)

    listed = await env.cli("effects", "list")
    assert listed.code == 0, listed.err
    rows = {line.split()[0]: line.split() for line in listed.out.splitlines()[1:]}
    assert rows[eid[:12]][:4] == [eid[:12], "UNKNOWN", "key:anonymous/k-cli", "keyed"]
    assert rows[leased[:12]][2] == "t1"

    shown = await env.cli("effects", "show", eid[:12])
    assert shown.code == 0, shown.err
    assert "kind            keyed\n" in shown.out
    assert "principal       anonymous\n" in shown.out
    assert "idempotencyKey  k-cli\n" in shown.out
    assert "\ntask " not in shown.out and "None" not in shown.out
    assert "kind            leased\n" in (await env.cli("effects", "show", leased)).out

    found = await env.cli(
        "effects", "list", "--idempotency-key", "k-cli", "--principal", "anonymous", "--json"
    )
    assert found.code == 0, found.err
    (record,) = found.json()
    assert (record["effectId"], record["kind"], record["taskId"]) == (eid, "keyed", None)
    # Without --principal: the caller's own (anonymous, without [auth]).
    assert len((await env.cli("effects", "list", "--idempotency-key", "k-cli", "--json")).json())
    none = await env.cli("effects", "list", "--idempotency-key", "k-cli", "--principal", "bob")
    assert none.code == 0 and none.out == "no effects\n"
    for argv in (
        ["--principal", "anonymous"],
        ["--idempotency-key", "k-cli", "--state", "UNKNOWN"],
        ["--idempotency-key", "k-cli", "--awaiting-approval"],
    ):
        refused = await env.cli("effects", "list", *argv)
        assert refused.code == 2, (argv, refused)

    resolved = await env.cli(
        "effects", "resolve", eid[:12], "--outcome", "COMMITTED", "--note", "found it"
    )
    assert resolved.code == 0, resolved.err
    assert f"effect {eid} resolved as COMMITTED" in resolved.out


async def test_operator_name_from_the_environment(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    eid = await unknown_effect(env)
    monkeypatch.setenv("FENCEGATE_OPERATOR", "bob@ops")
    done = await env.cli("effects", "resolve", eid, "--outcome", "COMMITTED", "--note", "saw it")
    assert done.code == 0, done.err
    record = (await env.cli("effects", "show", eid, "--json")).json()
    assert record["state"] == "COMMITTED" and record["actions"][-1]["by"] == "bob@ops"


async def test_resolve_committed_with_the_response_duplicates_replay(env: Env) -> None:
    eid = await unknown_effect(env)
    done = await env.cli(
        "effects", "resolve", eid, "--outcome", "COMMITTED", "--note", "charged, ref 42",
        "--response-status", "201", "--response-body", '{"ref": 42}',
        "--response-header", "Content-Type: application/json",
    )  # fmt: skip
    assert done.code == 0, done.err
    shown = await env.cli("effects", "show", eid)
    assert "response:\n  status   201" in shown.out and '{"ref": 42}' in shown.out
    task = (await env.api.get("t1")).body
    lease = Lease("t1", task["attemptId"], task["claimGeneration"], "w1", 1, 0, 0, "in-1")
    async with env.api.client.post(
        "/proxy/api/status/500",
        json={"amount": 5},
        headers={
            "Fence-Task": "t1", "Fence-Attempt": lease.attempt_id, "Fence-Generation": "1",
            "Fence-Epoch": "1", "Fence-Cancel": "0", "Fence-Slot": "s1",
        },
    ) as resp:  # fmt: skip
        assert resp.status == 201 and resp.headers["Fence-Replayed"] == "true"
        assert await resp.json() == {"ref": 42}
    assert len(env.downstream.calls()) == 1
    # A response only goes with COMMITTED, and needs its status.
    for argv in (
        ["--outcome", "NOT_APPLIED", "--response-status", "200"],
        ["--outcome", "COMMITTED", "--response-body", "x"],
        ["--outcome", "COMMITTED", "--response-status", "200", "--response-header", "bad"],
    ):
        run = await env.cli("effects", "resolve", eid, "--note", "n", *argv)
        assert run.code == 2 and run.err.startswith("fencegate: --response"), run.err


async def test_list_follows_the_cursor_up_to_the_limit(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    lease = await env.lease()
    ids = []
    for slot in ("a", "b", "c", "d", "e"):
        status, eid = await env.send(lease, "api", f"/ok/{slot}", slot=slot)
        assert status == 200
        ids.append(eid)
    monkeypatch.setattr(ops_commands, "_PAGE", 2)  # pages of two: five records take three calls
    every = await env.cli("effects", "list", "--json")
    assert [r["effectId"] for r in every.json()] == ids
    some = await env.cli("effects", "list", "--json", "--limit", "3")
    assert [r["effectId"] for r in some.json()] == ids[:3]
    table = await env.cli("effects", "list", "--limit", "4", "--state", "COMMITTED")
    assert len(table.out.splitlines()) == 1 + 4
    assert "first 4 shown" in table.err
    exact = await env.cli("effects", "list", "--limit", "5")
    assert len(exact.out.splitlines()) == 1 + 5 and exact.err == ""


async def test_approve_lets_a_waiting_effect_go_once(env: Env) -> None:
    lease = await env.lease()
    status, eid = await env.send(lease, "guarded", "/ok/wire")
    assert status == 409  # APPROVAL_REQUIRED
    await unknown_effect(env, "t2")  # another record, not waiting for anyone
    waiting = await env.cli("effects", "list", "--awaiting-approval", "--json")
    assert [e["effectId"] for e in waiting.json()] == [eid]
    mixed = await env.cli("effects", "list", "--awaiting-approval", "--state", "UNKNOWN")
    assert mixed.code == 2 and "--awaiting-approval goes alone" in mixed.err
    record = (await env.cli("effects", "show", eid, "--json")).json()
    digest, approval = record["payloadDigest"], record["approvalDigest"]

    stale = await env.cli("effects", "approve", eid, "--payload-digest", "f" * 64)
    assert stale.code == 1
    assert stale.err.startswith("fencegate: PAYLOAD_CONFLICT: ") and digest in stale.err
    # The request carries a Content-Type: the payload digest alone does not approve it.
    alone = await env.cli("effects", "approve", eid, "--payload-digest", digest)
    assert alone.code == 1 and alone.err.startswith("fencegate: BAD_REQUEST: ")
    assert approval in alone.err

    approved = await env.cli(
        "effects", "approve", eid, "--approval-digest", approval, "--payload-digest", digest,
        "--note", "ticket 7", "--operator", "carol",
    )  # fmt: skip
    assert approved.code == 0, approved.err
    assert f"effect {eid} approved" in approved.out and digest in approved.out
    shown = await env.cli("effects", "show", eid)
    assert "approval" in shown.out and "carol" in shown.out

    status, _ = await env.send(lease, "guarded", "/ok/wire")
    assert status == 200
    assert len(env.downstream.calls("/ok/wire")) == 1
    # Settled now: approving again is refused with the reason.
    late = await env.cli("effects", "approve", eid)
    assert late.code == 1 and late.err.startswith("fencegate: EFFECT_SETTLED: ")
    as_json = await env.cli("effects", "show", eid, "--json")
    assert as_json.json()["attempts"][-1]["approvedBy"] == "carol"


async def test_approve_refused_where_no_approval_is_needed(env: Env) -> None:
    eid = await unknown_effect(env)
    refused = await env.cli("effects", "approve", eid)
    assert refused.code == 1
    assert refused.err == ("fencegate: BAD_REQUEST: downstream 'api' does not require approval\n")


async def test_reconcile_asks_the_probe(env: Env) -> None:
    lease = await env.lease()
    status, eid = await env.send(lease, "probed", "/status/500")
    assert status == 500
    done = await env.cli("effects", "reconcile", eid, "--operator", "dave")
    assert done.code == 0, done.err
    assert done.out.startswith(f"effect {eid} is COMMITTED (last probe: found, ")
    record = (await env.cli("effects", "show", eid, "--json")).json()
    assert record["state"] == "COMMITTED"
    assert record["actions"][-1]["by"] == "operator:dave"
    assert env.downstream.calls(f"/ok/{eid}")
    # Nothing left to reconcile: the record as it is.
    again = await env.cli("effects", "reconcile", eid, "--json")
    assert again.code == 0 and again.json()["state"] == "COMMITTED"


async def test_reconcile_without_a_probe_says_to_resolve(env: Env) -> None:
    eid = await unknown_effect(env)
    refused = await env.cli("effects", "reconcile", eid)
    assert refused.code == 1
    assert refused.err.startswith("fencegate: EFFECT_UNKNOWN: downstream 'api' has no probe")
    assert refused.err.endswith(
        f"\nfencegate: settle it by hand: fencegate effects resolve {eid[:12]} "
        "--outcome COMMITTED|NOT_APPLIED --note '...'\n"
    )


async def test_unknown_effect_is_a_problem_exit_1(env: Env) -> None:
    for argv in (
        ["effects", "resolve", NO_EFFECT, "--outcome", "COMMITTED", "--note", "n"],
        ["effects", "show", NO_EFFECT],
        ["effects", "approve", NO_EFFECT],
        ["effects", "reconcile", NO_EFFECT],
    ):
        run = await env.cli(*argv)
        assert run.code == 1, argv
        assert run.err.startswith("fencegate: NO_SUCH_EFFECT: "), run.err
        assert run.out == ""
    missing = await env.cli("effects", "show", "abcdef12")
    assert missing.code == 1
    assert missing.err == "fencegate: NO_SUCH_EFFECT: no effect id starts with 'abcdef12'\n"


def colliding_slots(task_id: str, width: int = 6) -> tuple[str, str]:
    """Two slots of ``task_id`` whose effect ids share their first ``width`` characters."""
    seen: dict[str, str] = {}
    for i in range(1_000_000):
        slot = f"s{i}"
        prefix = effect_id(task_id, 1, "main", slot)[:width]
        if prefix in seen:
            return seen[prefix], slot
        seen[prefix] = slot
    raise AssertionError("no collision")


async def test_ambiguous_or_malformed_effect_ids(env: Env) -> None:
    lease = await env.lease()
    first, second = colliding_slots("t1")
    for slot in (first, second):
        assert (await env.send(lease, "api", "/ok/x", slot=slot))[0] == 200
    one = effect_id("t1", 1, "main", first)
    other = effect_id("t1", 1, "main", second)
    ambiguous = await env.cli("effects", "show", one[:6])
    assert ambiguous.code == 2
    assert ambiguous.err.startswith(f"fencegate: effect id prefix {one[:6]!r} is ambiguous")
    # One more character may tell them apart; the full id always does.
    for eid in (one, other):
        assert (await env.cli("effects", "show", eid, "--json")).json()["effectId"] == eid
    for bad in ("abcde", "not-an-id", "g" * 64):
        run = await env.cli("effects", "show", bad)
        assert run.code == 2 and run.err.startswith(f"fencegate: {bad!r} is not an effect id")


# --- tasks, epoch, claims -----------------------------------------------------------------------


async def test_tasks_show(env: Env) -> None:
    lease = await env.lease("team/job-1")
    shown = await env.cli("tasks", "show", "team/job-1")
    assert shown.code == 0, shown.err
    lines = dict(line.split(None, 1) for line in shown.out.splitlines() if " " in line.strip())
    assert lines["task"] == "team/job-1"
    assert lines["state"] == "CLAIMED"
    assert lines["owner"] == "w1"
    assert lines["attempt"] == lease.attempt_id
    assert lines["commit"] == "none"
    as_json = (await env.cli("tasks", "show", "team/job-1", "--json")).json()
    assert as_json["taskId"] == "team/job-1" and as_json["claimGeneration"] == 1

    commit = await env.api.commit(lease)
    assert commit.status == 200
    done = await env.cli("tasks", "show", "team/job-1")
    assert "COMMITTED" in done.out and commit.body["commitId"] in done.out

    missing = await env.cli("tasks", "show", "nope")
    assert missing.code == 1 and missing.err.startswith("fencegate: NO_SUCH_TASK: ")


async def test_epoch_show_and_bump(env: Env) -> None:
    shown = await env.cli("epoch", "show")
    assert shown.code == 0 and shown.out == "scheduler epoch 1, claims open\n"
    lease = await env.lease()
    bumped = await env.cli("epoch", "bump")
    assert bumped.code == 0
    assert bumped.out.startswith("bumped the scheduler epoch to 2: ")
    assert (await env.cli("epoch", "show", "--json")).json() == {
        "schedulerEpoch": 2,
        "claimsPaused": False,
    }
    assert (await env.cli("epoch", "bump", "--json")).json()["schedulerEpoch"] == 3
    # The old claim is fenced, as the message said.
    assert (await env.api.renew(lease)).code == "STALE_EPOCH"


async def test_claims_pause_and_resume(env: Env) -> None:
    await env.api.put("t1")
    paused = await env.cli("claims", "pause")
    assert paused.code == 0 and paused.out.startswith("claims paused (")
    assert "CLAIMS_PAUSED" in paused.out
    assert (await env.api.try_claim("t1")).code == "CLAIMS_PAUSED"
    assert (await env.cli("epoch", "show")).out == "scheduler epoch 1, claims paused\n"
    resumed = await env.cli("claims", "resume", "--json")
    assert resumed.code == 0 and resumed.json() == {"schedulerEpoch": 1, "claimsPaused": False}
    assert (await env.api.try_claim("t1")).status == 200
    assert (await env.cli("claims", "resume")).out.startswith("claims resumed (")


async def test_rollout_status_exits_0_only_when_safe(env: Env) -> None:
    await env.api.put("t1")
    lease = await env.api.claim("t1")
    busy = await env.cli("rollout", "status")
    assert busy.code == 4 and "active leases" in busy.out
    assert "NOT safe to switch pools: 1 lease held; wait" in busy.out
    assert (await env.api.commit(lease)).status == 200
    safe = await env.cli("rollout", "status")
    assert safe.code == 0 and safe.out.rstrip().endswith("safe to switch pools")
    as_json = await env.cli("rollout", "status", "--json")
    assert as_json.json()["safeToSwitchPools"] is True


def test_rollout_status_prints_the_gateways_reasons() -> None:
    from fencegate.gateway.ops_render import rollout

    blockers = [
        {"member": "activeLeases", "count": 2, "reason": "2 leases held"},
        {"member": "unknownEffects", "count": 1, "reason": "1 effect UNKNOWN"},
    ]
    status = {"safeToSwitchPools": False, "activeLeases": 2, "blockers": blockers}
    assert rollout(status).endswith(
        "\nNOT safe to switch pools: 2 leases held, 1 effect UNKNOWN; wait for leases to expire "
        "and settle the effects"
    )
    # An older gateway sends no blockers: the verdict without reasons.
    older = {k: v for k, v in status.items() if k != "blockers"}
    assert rollout(older).endswith(
        "\nNOT safe to switch pools: wait for leases to expire and settle the effects"
    )


# --- where the gateway is, and when it is not there -------------------------------------------


async def test_url_from_config_file_and_environment(
    env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = env.url.rsplit(":", 1)[1]
    dead = f"http://127.0.0.1:{refused_port()}"
    config = tmp_path / "fencegate.toml"
    config.write_text(  # reached on loopback
        f'[server]\nlisten = "0.0.0.0:{port}"\nallowed_hosts = ["127.0.0.1"]\n'
        "allow_unauthenticated = true\n"
    )
    # Flags before the environment: --config's server.listen, then --url over everything.
    monkeypatch.setenv("FENCEGATE_URL", dead)
    from_file = await env.cli("epoch", "show", "--config", str(config), url=False)
    assert from_file.code == 0, from_file.err
    both = await env.cli("epoch", "show", "--config", str(config), "--url", dead, url=False)
    assert both.code == 3 and dead in both.err
    monkeypatch.setenv("FENCEGATE_URL", env.url + "/")
    from_env = await env.cli("epoch", "show", url=False)
    assert from_env.code == 0, from_env.err
    monkeypatch.delenv("FENCEGATE_URL")
    # None of them: the default, which is where `fencegate serve` listens by default. It is
    # pointed at a port that refuses (127.0.0.1:8700 may be any program on this machine).
    assert f"http://{ServerConfig().listen}" == ops_commands.DEFAULT_URL
    monkeypatch.setattr(ops_commands, "DEFAULT_URL", dead)
    default = await env.cli("epoch", "show", url=False)
    assert default.code == 3 and f"cannot reach the gateway at {dead} " in default.err
    broken = tmp_path / "broken.toml"
    broken.write_text("[server]\nlisten = 5\n")
    bad = await env.cli("epoch", "show", "--config", str(broken), url=False)
    assert bad.code == 2 and bad.err.startswith("fencegate: config error: ")


async def test_unreachable_gateway_exits_3(env: Env) -> None:
    dead = f"http://127.0.0.1:{refused_port()}"
    for argv in (
        ["effects", "list"],
        ["effects", "resolve", NO_EFFECT, "--outcome", "COMMITTED", "--note", "n"],
        ["tasks", "show", "t1"],
        ["epoch", "bump"],
        ["claims", "pause"],
    ):
        run = await env.cli(*argv, "--url", dead, url=False)
        assert run.code == 3, argv
        assert run.err == (
            f"fencegate: cannot reach the gateway at {dead} (connection refused): "
            "is it running? use --url\n"
        )
        assert run.out == ""


async def test_silent_gateway_times_out_with_exit_3(env: Env) -> None:
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        run = await env.cli("epoch", "bump", "--url", url, "--timeout", "0.3", url=False)
    assert run.code == 3
    assert run.err == (
        f"fencegate: no answer from the gateway at {url} within 0.3s (use --timeout); "
        "the change may or may not have been made, look before repeating it\n"
    )


async def test_bad_usage_exits_2(env: Env) -> None:
    eid = NO_EFFECT
    for argv in (
        ["effects"],
        ["effects", "resolve", eid, "--outcome", "COMMITTED"],  # no --note
        ["effects", "resolve", eid, "--outcome", "MAYBE", "--note", "n"],
        ["effects", "list", "--state", "DONE"],
        ["effects", "list", "--limit", "0"],
        ["epoch", "show", "--timeout", "-1"],
    ):
        with pytest.raises(SystemExit) as exited:
            await env.cli(*argv)
        assert exited.value.code == 2, argv
    for argv in (["--url", "ftp://example"], ["--operator", "bad\nname"]):
        run = await env.cli("epoch", "show", *argv, url=False)
        assert run.code == 2 and run.err.startswith("fencegate: --"), run.err


async def test_the_installed_command_as_a_process(env: Env) -> None:
    """``python -m fencegate.gateway.cli`` for real: stdout, stderr and exit codes as a shell
    sees them."""

    async def run(*argv: str) -> Run:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fencegate.gateway.cli", *argv,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await proc.communicate()
        assert proc.returncode is not None
        return Run.of(proc.returncode, out.decode(), err.decode())

    dead = f"http://127.0.0.1:{refused_port()}"
    ok, gone = await asyncio.gather(
        run("epoch", "show", "--json", "--url", env.url),
        run("effects", "list", "--url", dead),
    )
    assert ok.code == 0, ok.err
    assert ok.json() == {"schedulerEpoch": 1, "claimsPaused": False}
    assert gone.code == 3 and gone.out == ""
    assert gone.err == (
        f"fencegate: cannot reach the gateway at {dead} (connection refused): "
        "is it running? use --url\n"
    )
