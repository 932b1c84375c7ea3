"""Upgrades: a store written by the previous fencegate is migrated and served by this one,
on every store, and during a rolling upgrade an old and a new gateway on one Redis never
disagree on an outcome.

"The previous fencegate" is real code: ``tests/fixtures/upgrade/fencegate-815bed5.tar.xz`` is
the gateway of commit 815bed5 (the last one before record formats were recorded and retention
existed), made with ``git archive 815bed5 ledger gateway adapters fencegate pyproject.toml |
xz -9``. It runs as its own ``fencegate serve`` process and writes the fixture store through
its own API, so the store under migration is exactly what that version writes. This version
is served in the test's process (``tests.api.InProcessGateway``, from the same config file).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tarfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.api import InProcessGateway, until
from tests.conftest import STORE_TIMEOUT_MS
from tests.downstream import Downstream
from tests.servers import GatewayProcess, free_port

OLD = Path(__file__).parent / "fixtures" / "upgrade" / "fencegate-815bed5.tar.xz"
#: The TTL of a claim held across the upgrade (two gateway starts and two migrations): past
#: the per-test timeout, so however slowly a loaded machine starts processes, it holds.
HELD_TTL_MS = 600_000
#: package folder -> repository folder (pyproject.toml's package-dir of that version).
_LAYOUT = {"gateway": "gateway", "ledger": "ledger", "adapters": "adapters"}


@pytest.fixture(scope="session")
def old_pythonpath(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A directory whose ``fencegate`` package is the old version's, as it installs."""
    root = tmp_path_factory.mktemp("fencegate-815bed5")
    with tarfile.open(OLD) as archive:
        archive.extractall(root / "src", filter="data")
    package = root / "stage" / "fencegate"
    package.mkdir(parents=True)
    for item in (root / "src" / "fencegate").iterdir():
        (package / item.name).symlink_to(item)
    for name, folder in _LAYOUT.items():
        (package / name).symlink_to(root / "src" / folder)
    return str(root / "stage")


def write_config(
    directory: Path, store_url: str, key_prefix: str, downstream: Downstream, extra: str = ""
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "fencegate.toml"
    # A placeholder: GatewayProcess's --listen replaces it (the old version refuses port 0).
    path.write_text(
        '[server]\nlisten = "127.0.0.1:8700"\n'
        f"[store]\nurl = {json.dumps(store_url)}\nredis_key_prefix = {json.dumps(key_prefix)}\n"
        # The suite's store timeout: it only bounds a hang (a 2 s one timed out a commit
        # while a fresh clone's suite loaded the machine).
        f"timeout_ms = {STORE_TIMEOUT_MS}\n"
        f"[leases]\nmax_ttl_ms = {HELD_TTL_MS}\n"
        "[reconciler]\nenabled = false\n"
        f'[[downstreams]]\nname = "api"\nurl = "{downstream.url}"\ntimeout_ms = 2000\n' + extra
    )
    return path


class Gateway:
    """One gateway (the old version's process, or this version in the test's process) and an
    HTTP client to it, speaking as a worker would."""

    def __init__(
        self, process: GatewayProcess | InProcessGateway, session: aiohttp.ClientSession
    ) -> None:
        self.process, self.session = process, session

    async def call(self, method: str, path: str, body: Any = None, **headers: str) -> Any:
        async with self.session.request(
            method, self.process.url + path, json=body, headers=headers
        ) as resp:
            raw = await resp.read()
            data = json.loads(raw) if raw and resp.content_type.endswith("json") else raw
            return resp.status, data

    async def put(self, task_id: str, digest: str = "in", **extra: Any) -> Any:
        return await self.call("PUT", f"/v1/tasks/{task_id}", {"inputDigest": digest, **extra})

    async def claim(self, task_id: str, ttl_ms: int = 30_000) -> dict[str, Any]:
        _, epoch = await self.call("GET", "/v1/epoch")
        status, lease = await self.call(
            "POST",
            f"/v1/tasks/{task_id}/claim",
            {"owner": "w", "ttlMs": ttl_ms, "schedulerEpoch": epoch["schedulerEpoch"]},
        )
        assert status == 200, lease
        return dict(lease)

    async def effect(self, lease: dict[str, Any], slot: str, amount: int = 1) -> Any:
        headers = {
            "Fence-Task": lease["taskId"],
            "Fence-Attempt": lease["attemptId"],
            "Fence-Generation": str(lease["claimGeneration"]),
            "Fence-Epoch": str(lease["schedulerEpoch"]),
            "Fence-Cancel": str(lease["cancelGeneration"]),
            "Fence-Slot": slot,
        }
        async with self.session.post(
            f"{self.process.url}/proxy/api/pay", json={"amount": amount}, headers=headers
        ) as resp:
            body = await resp.read()
            return resp.status, resp.headers.get("Fence-Effect-State"), body

    async def commit(self, lease: dict[str, Any], result: str = "out") -> Any:
        return await self.call(
            "POST",
            f"/v1/tasks/{lease['taskId']}/commit",
            {
                "attemptId": lease["attemptId"],
                "claimGeneration": lease["claimGeneration"],
                "schedulerEpoch": lease["schedulerEpoch"],
                "cancelGeneration": lease["cancelGeneration"],
                "inputDigest": lease["inputDigest"],
                "resultDigest": result,
            },
        )

    async def renew(self, lease: dict[str, Any]) -> Any:
        return await self.call(
            "POST",
            f"/v1/tasks/{lease['taskId']}/renew",
            {
                "attemptId": lease["attemptId"],
                "claimGeneration": lease["claimGeneration"],
                "owner": "w",
                "schedulerEpoch": lease["schedulerEpoch"],
                "cancelGeneration": lease["cancelGeneration"],
                "ttlMs": 30_000,
            },
        )


async def gone_from(gateway: Gateway, task_id: str) -> bool:
    """Has retention expired the task (410)?"""
    status, _ = await gateway.call("GET", f"/v1/tasks/{task_id}")
    return bool(status == 410)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


@pytest.fixture
def processes() -> Iterator[list[GatewayProcess]]:
    started: list[GatewayProcess] = []
    yield started
    for process in started:
        process.stop()


def start(
    processes: list[GatewayProcess], config: Path, pythonpath: str | None = None
) -> GatewayProcess:
    """The new version binds port 0 and says which port it got. The old one (815bed5) refuses
    port 0 and logs the address it was given: it gets a port that was free a moment ago, and
    ``GatewayProcess`` starts it again on another one if it finds that port taken."""
    env = {"PYTHONPATH": pythonpath} if pythonpath else None
    port = free_port() if pythonpath else 0
    process = GatewayProcess(config, port, env=env).start()
    processes.append(process)
    return process


@pytest.fixture
async def current() -> AsyncIterator[list[InProcessGateway]]:
    """This version's gateways, served in the test's process (only the old version needs a
    process of its own: it is other code); all are stopped when the test ends."""
    started: list[InProcessGateway] = []
    yield started
    for gateway in started:
        await gateway.stop()


async def start_current(current: list[InProcessGateway], config: Path) -> InProcessGateway:
    gateway = InProcessGateway(config)
    current.append(gateway)
    return await gateway.start()


def migrate(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "fencegate.gateway.cli",
            "store",
            "migrate",
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


async def test_a_store_written_by_the_previous_version_is_migrated_and_served(
    store_url: str,
    key_prefix: str,
    downstream: Downstream,
    old_pythonpath: str,
    tmp_path: Path,
    session: aiohttp.ClientSession,
    processes: list[GatewayProcess],
    current: list[InProcessGateway],
) -> None:
    config = write_config(tmp_path / "old", store_url, key_prefix, downstream)
    old = Gateway(start(processes, config, old_pythonpath), session)
    assert (await old.call("GET", "/healthz"))[0] == 200
    # What the old version leaves: a committed task with an effect, an open one, a held one,
    # one waiting on the open one.
    assert (await old.put("done"))[0] == 201
    done = await old.claim("done")
    status, state, _ = await old.effect(done, "pay")
    assert (status, state) == (200, "COMMITTED")
    assert (await old.commit(done))[0] == 200
    assert (await old.put("open"))[0] == 201
    assert (await old.put("held"))[0] == 201
    held = await old.claim("held", ttl_ms=HELD_TTL_MS)
    assert (await old.put("waiting", dependsOn=["open"]))[0] == 201
    old.process.stop()

    migrated = migrate(config)
    assert migrated.returncode == 0, migrated.stderr
    assert "migrated from format" in migrated.stdout, migrated.stdout
    again = migrate(config)
    assert again.returncode == 0, again.stderr
    assert "nothing to do" in again.stdout, again.stdout

    retention = "[retention]\nsettled_ms = 1000\ntombstone_ms = 60000\ninterval_ms = 100\n"
    config = write_config(tmp_path / "new", store_url, key_prefix, downstream, retention)
    new = Gateway(await start_current(current, config), session)
    # The held claim goes on under the new version; the duplicate of the old effect is
    # refused (its task is committed), never sent again.
    assert (await new.renew(held))[0] == 200
    status, _, _ = await new.effect(done, "pay")
    assert status in (409, 410)
    assert downstream.per_key and set(downstream.per_key.values()) == {1}
    # Retention sees what the old version settled: the committed task expires, nothing else.
    await until(lambda: gone_from(new, "done"), "retention expires the old version's task")
    status, gone = await new.call("GET", "/v1/tasks/done")
    assert (status, gone["code"]) == (410, "TASK_EXPIRED")
    for task_id, state in (("open", "READY"), ("held", "CLAIMED"), ("waiting", "WAITING")):
        status, record = await new.call("GET", f"/v1/tasks/{task_id}")
        assert (status, record["state"]) == (200, state)


async def test_old_and_new_gateways_on_one_redis_never_disagree(
    redis_server: Any,
    key_prefix: str,
    downstream: Downstream,
    old_pythonpath: str,
    tmp_path: Path,
    session: aiohttp.ClientSession,
    processes: list[GatewayProcess],
    current: list[InProcessGateway],
) -> None:
    """A rolling upgrade: each step of each task goes through one gateway and its duplicate
    through the other; both must answer the same, and the downstream runs each effect once."""
    url = redis_server.url
    config = write_config(tmp_path / "old", url, key_prefix, downstream)
    old = Gateway(start(processes, config, old_pythonpath), session)
    assert (await old.put("seed"))[0] == 201  # the store is the old version's before
    retention = "[retention]\nsettled_ms = 1000\ntombstone_ms = 60000\ninterval_ms = 100\n"
    new_config = write_config(tmp_path / "new", url, key_prefix, downstream, retention)
    new = Gateway(await start_current(current, new_config), session)
    pairs = [(old, new), (new, old)]
    for i in range(12):
        first, second = pairs[i % 2]
        task_id = f"roll-{i}"
        assert (await first.put(task_id))[0] == 201
        assert (await second.put(task_id))[0] == 200  # the same input: unchanged on both
        lease = await second.claim(task_id)
        # The other gateway sees the same claim: a second claim is CLAIMED.
        status, refused = await first.call(
            "POST",
            f"/v1/tasks/{task_id}/claim",
            {"owner": "x", "ttlMs": 1000, "schedulerEpoch": lease["schedulerEpoch"]},
        )
        assert (status, refused["code"]) == (409, "CLAIMED")
        sent = await first.effect(lease, "a", amount=i)
        replayed = await second.effect(lease, "a", amount=i)
        assert sent[0] == replayed[0] == 200 and sent[2] == replayed[2]
        assert (sent[1], replayed[1]) == ("COMMITTED", "COMMITTED")
        conflict = await second.effect(lease, "a", amount=i + 100)
        assert conflict[0] == 422
        committed = await first.commit(lease)
        again = await second.commit(lease)
        assert committed[0] == again[0] == 200
        assert committed[1]["commitId"] == again[1]["commitId"]
        for gateway in (old, new):
            status, record = await gateway.call("GET", f"/v1/tasks/{task_id}")
            assert (record["state"], record["claimGeneration"]) == ("COMMITTED", 1)
            late = await gateway.effect(lease, "b")
            assert late[0] == 409  # ALREADY_COMMITTED on both: nothing new goes out
    # A takeover across versions: the old gateway's claim runs out, the new one takes over,
    # and the stale lease is fenced by both.
    assert (await old.put("takeover"))[0] == 201
    stale = await old.claim("takeover", ttl_ms=200)
    # The worker pauses past its 200 ms lease (the scenario, in store time: the lease started
    # before this sleep did, and a sleep only ever runs long).
    await asyncio.sleep(0.4)
    fresh = await new.claim("takeover")
    assert fresh["claimGeneration"] == stale["claimGeneration"] + 1
    for gateway in (old, new):
        status, _, body = await gateway.effect(stale, "a")
        assert status == 409 and json.loads(body)["code"] == "FENCED"
    assert len(downstream.per_key) == 12 and set(downstream.per_key.values()) == {1}
    # Nothing expired while the old version served (its gateways do not check tombstones);
    # once the last one stopped, the migration lets retention start. The old version serves
    # on past settled_ms (the scenario: however long this sleep really takes, roll-0 must
    # still be there).
    await asyncio.sleep(1.5)
    for gateway in (old, new):
        status, record = await gateway.call("GET", "/v1/tasks/roll-0")
        assert (status, record["state"]) == (200, "COMMITTED")
    old.process.stop()
    migrated = migrate(new_config)
    assert migrated.returncode == 0 and "migrated from format 1 to format 2" in migrated.stdout
    await until(lambda: gone_from(new, "roll-0"), "retention starts after the migration")


def test_a_newer_format_is_refused_by_serve_and_by_migrate(
    redis_server: Any, key_prefix: str, tmp_path: Path
) -> None:
    """Keys written by a newer fencegate could be misread: neither the gateway nor the
    migration touches them, and both say which versions met."""
    redis_server.client().hset(f"{key_prefix}:meta", "format", 99)
    config = tmp_path / "fencegate.toml"
    config.write_text(
        f"[store]\nurl = {json.dumps(redis_server.url)}\n"
        f"redis_key_prefix = {json.dumps(key_prefix)}\n"
    )
    checked = subprocess.run(
        [
            sys.executable,
            "-m",
            "fencegate.gateway.cli",
            "serve",
            "--check",
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 1, checked.stderr
    assert "format 99, newer than this gateway's 2" in checked.stderr
    refused = migrate(config)
    assert refused.returncode == 1
    assert "format 99, newer than this gateway's 2" in refused.stderr
    assert redis_server.client().hget(f"{key_prefix}:meta", "format") == "99"
