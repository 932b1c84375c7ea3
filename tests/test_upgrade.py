"""Upgrades: a store written by a previous fencegate is migrated and served by this one, on
every store, and during a rolling upgrade an old and a new gateway on one Redis never disagree
on an outcome.

"The previous fencegate" is real code, vendored as ``tests/fixtures/upgrade/fencegate-
<commit>.tar.xz``, each made with ``git archive <commit> ledger gateway adapters fencegate
pyproject.toml | xz -9`` (``Release`` below says what each is). It runs as its own
``fencegate serve`` process and writes the store through its own API, so the store under
migration is exactly what that version writes. This version is served in the test's process
(``tests.api.InProcessGateway``, from the same config file).
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import tarfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import pytest

from fencegate.ledger.keys import Keys
from fencegate.ledger.redis_store import FORMAT_VERSION
from tests.api import InProcessGateway, until
from tests.conftest import STORE_TIMEOUT_MS
from tests.downstream import Downstream
from tests.servers import GatewayProcess, dies_with_us

FIXTURES = Path(__file__).parent / "fixtures" / "upgrade"
#: The TTL of a claim held across the upgrade (two gateway starts and two migrations): past
#: the per-test timeout, so however slowly a loaded machine starts processes, it holds.
HELD_TTL_MS = 600_000
#: package folder -> repository folder (pyproject.toml's package-dir of both releases).
_LAYOUT = {"gateway": "gateway", "ledger": "ledger", "adapters": "adapters"}


@dataclass(frozen=True)
class Release:
    """A previous fencegate, vendored as ``fixtures/upgrade/fencegate-{commit}.tar.xz``."""

    commit: str
    #: The store format it writes (``{prefix}:meta`` ``format``; format 1 records none).
    format: int
    #: Whether it binds port 0 and logs the port it got. One that cannot is handed a socket
    #: the test bound to port 0 (``HandedSocket``): no port is picked before it is bound.
    binds_port_zero: bool

    @property
    def archive(self) -> Path:
        return FIXTURES / f"fencegate-{self.commit}.tar.xz"


#: The last commit before record formats were recorded and retention existed.
FORMAT_1 = Release("815bed5", format=1, binds_port_zero=False)
#: A release of format 2 (an effect record is JSON text in one field of its task's effects
#: hash), which this version still writes: the release before the effect steps ran as Redis
#: Functions and let the gateway decide a new forward's record and its completion.
FORMAT_2 = Release("5496a14", format=2, binds_port_zero=True)


def stage(release: Release, root: Path) -> str:
    """Unpack ``release`` under ``root``; a PYTHONPATH whose ``fencegate`` package is that
    release's, laid out as it installs."""
    with tarfile.open(release.archive) as archive:
        archive.extractall(root / "src", filter="data")
    package = root / "stage" / "fencegate"
    package.mkdir(parents=True)
    for item in (root / "src" / "fencegate").iterdir():
        (package / item.name).symlink_to(item)
    for name, folder in _LAYOUT.items():
        (package / name).symlink_to(root / "src" / folder)
    return str(root / "stage")


@pytest.fixture(scope="session")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Release], str]:
    """A release's PYTHONPATH (``stage``), each release unpacked once a session."""
    paths: dict[Release, str] = {}

    def pythonpath(release: Release) -> str:
        if release not in paths:
            root = tmp_path_factory.mktemp(f"fencegate-{release.commit}")
            paths[release] = stage(release, root)
        return paths[release]

    return pythonpath


#: ``fencegate serve`` of a release that refuses ``--listen`` port 0 (815bed5), on the socket
#: whose descriptor is its first argument: its own ``cli._serve_one`` takes bound sockets
#: (what its ``serve --workers`` supervisor hands each worker), so it is handed this one.
_SERVE_ON_HANDED_SOCKET = """
import socket, sys
from fencegate.gateway import cli
handed = socket.socket(fileno=int(sys.argv.pop(1)))
serve_one = cli._serve_one
def on_handed(config, config_path, ssl_context, loop_factory, sockets=None, listening=None):
    return serve_one(config, config_path, ssl_context, loop_factory, [handed], listening)
cli._serve_one = on_handed
sys.exit(cli.main(sys.argv[1:]))
"""


class HandedSocket(GatewayProcess):
    """A release that cannot bind port 0 and say which port it got: this process binds
    127.0.0.1 port 0 itself and hands the bound socket down (``pass_fds``); ``--listen``
    names that port (the release checks ``Host`` against it). Nothing else can take the port
    between the pick and the bind: they are one step. Started once (the socket goes with it).
    """

    def start(self) -> HandedSocket:
        if self.proc is not None or self.port:
            raise RuntimeError("a handed-socket gateway starts once")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))  # the release's asyncio server listens on it
            self.port = int(sock.getsockname()[1])
            with self.log_path.open("ab") as log:
                logged_before = log.tell()
                self.proc = subprocess.Popen(
                    dies_with_us([
                        sys.executable, "-c", _SERVE_ON_HANDED_SOCKET, str(sock.fileno()),
                        "serve", "--config", str(self.config_path),
                        "--listen", f"127.0.0.1:{self.port}",
                    ]),
                    stdout=log, stderr=log, cwd=self.cwd, env=self.env,
                    pass_fds=(sock.fileno(),),
                )  # fmt: skip
        # This process's copy is closed: the gateway holds the port alone.
        try:
            listening = self._bound_port(logged_before, timeout=30)
        except Exception:
            raise RuntimeError(
                f"gateway did not start: {self.log_path.read_text()[-2000:]}"
            ) from None
        assert listening == self.port, (listening, self.port)
        return self


class Previous:
    """Previous releases' gateways, each its own ``fencegate serve`` process."""

    def __init__(self, staged: Callable[[Release], str]) -> None:
        self.staged = staged
        self.started: list[GatewayProcess] = []

    def start(self, release: Release, config: Path) -> GatewayProcess:
        env = {"PYTHONPATH": self.staged(release)}
        kind = GatewayProcess if release.binds_port_zero else HandedSocket
        process = kind(config, env=env)
        self.started.append(process)  # stopped at the end even if its start failed half-way
        return process.start()


@pytest.fixture
def previous(staged: Callable[[Release], str]) -> Iterator[Previous]:
    """Starts previous releases' gateways; all are stopped when the test ends."""
    gateways = Previous(staged)
    yield gateways
    for process in gateways.started:
        process.stop()


def write_config(
    directory: Path, store_url: str, key_prefix: str, downstream: Downstream, extra: str = ""
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "fencegate.toml"
    # A placeholder: GatewayProcess's --listen replaces it (815bed5 refuses port 0).
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


class Sent(NamedTuple):
    """A proxied call's answer, as the worker sees it."""

    status: int
    #: ``Fence-Effect-State``: what the ledger holds for the effect now.
    state: str | None
    body: bytes
    effect_id: str | None
    replayed: bool

    @property
    def code(self) -> str | None:
        """The problem code of a refusal the gateway answered itself."""
        try:
            return str(json.loads(self.body)["code"])
        except (ValueError, KeyError, TypeError):
            return None


class Gateway:
    """One gateway (a previous release's process, or this version in the test's process) and
    an HTTP client to it, speaking as a worker (and, for ``resolve``, an operator) would."""

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

    async def try_claim(self, task_id: str, ttl_ms: int = 30_000, owner: str = "w") -> Any:
        _, epoch = await self.call("GET", "/v1/epoch")
        return await self.call(
            "POST",
            f"/v1/tasks/{task_id}/claim",
            {"owner": owner, "ttlMs": ttl_ms, "schedulerEpoch": epoch["schedulerEpoch"]},
        )

    async def claim(self, task_id: str, ttl_ms: int = 30_000) -> dict[str, Any]:
        status, lease = await self.try_claim(task_id, ttl_ms)
        assert status == 200, lease
        return dict(lease)

    async def effect(
        self,
        lease: dict[str, Any],
        slot: str,
        amount: int = 1,
        *,
        downstream: str = "api",
        path: str = "pay",
    ) -> Sent:
        headers = {
            "Fence-Task": lease["taskId"],
            "Fence-Attempt": lease["attemptId"],
            "Fence-Generation": str(lease["claimGeneration"]),
            "Fence-Epoch": str(lease["schedulerEpoch"]),
            "Fence-Cancel": str(lease["cancelGeneration"]),
            "Fence-Slot": slot,
        }
        async with self.session.post(
            f"{self.process.url}/proxy/{downstream}/{path}",
            json={"amount": amount},
            headers=headers,
        ) as resp:
            return Sent(
                resp.status,
                resp.headers.get("Fence-Effect-State"),
                await resp.read(),
                resp.headers.get("Fence-Effect-Id"),
                resp.headers.get("Fence-Replayed") == "true",
            )

    async def resolve(self, effect_id: str, response: dict[str, Any]) -> Any:
        return await self.call(
            "POST",
            f"/v1/effects/{effect_id}/resolve",
            {"outcome": "COMMITTED", "note": "found at the downstream", "response": response},
        )

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
async def current() -> AsyncIterator[list[InProcessGateway]]:
    """This version's gateways, served in the test's process (only a previous release needs
    a process of its own: it is other code); all are stopped when the test ends."""
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


# Not on Redis Cluster: no fencegate before issue 30 could open one.
@pytest.mark.parametrize("store_url", ["sqlite", "redis", "postgres"], indirect=True)
async def test_a_store_815bed5_wrote_is_migrated_and_served(
    store_url: str,
    key_prefix: str,
    downstream: Downstream,
    tmp_path: Path,
    session: aiohttp.ClientSession,
    previous: Previous,
    current: list[InProcessGateway],
) -> None:
    config = write_config(tmp_path / "old", store_url, key_prefix, downstream)
    old = Gateway(previous.start(FORMAT_1, config), session)
    assert (await old.call("GET", "/healthz"))[0] == 200
    # What the old version leaves: a committed task with an effect, an open one, a held one,
    # one waiting on the open one.
    assert (await old.put("done"))[0] == 201
    done = await old.claim("done")
    sent = await old.effect(done, "pay")
    assert (sent.status, sent.state) == (200, "COMMITTED")
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
    assert (await new.effect(done, "pay")).status in (409, 410)
    assert downstream.per_key and set(downstream.per_key.values()) == {1}
    # Retention sees what the old version settled: the committed task expires, nothing else.
    await until(lambda: gone_from(new, "done"), "retention expires the old version's task")
    status, gone = await new.call("GET", "/v1/tasks/done")
    assert (status, gone["code"]) == (410, "TASK_EXPIRED")
    for task_id, state in (("open", "READY"), ("held", "CLAIMED"), ("waiting", "WAITING")):
        status, record = await new.call("GET", f"/v1/tasks/{task_id}")
        assert (status, record["state"]) == (200, state)


async def test_815bed5_and_this_version_on_one_redis_never_disagree(
    redis_server: Any,
    key_prefix: str,
    downstream: Downstream,
    tmp_path: Path,
    session: aiohttp.ClientSession,
    previous: Previous,
    current: list[InProcessGateway],
) -> None:
    """A rolling upgrade: each step of each task goes through one gateway and its duplicate
    through the other; both must answer the same, and the downstream runs each effect once."""
    url = redis_server.url
    config = write_config(tmp_path / "old", url, key_prefix, downstream)
    old = Gateway(previous.start(FORMAT_1, config), session)
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
        assert sent.status == replayed.status == 200 and sent.body == replayed.body
        assert (sent.state, replayed.state) == ("COMMITTED", "COMMITTED")
        conflict = await second.effect(lease, "a", amount=i + 100)
        assert conflict.status == 422
        committed = await first.commit(lease)
        again = await second.commit(lease)
        assert committed[0] == again[0] == 200
        assert committed[1]["commitId"] == again[1]["commitId"]
        for gateway in (old, new):
            status, record = await gateway.call("GET", f"/v1/tasks/{task_id}")
            assert (record["state"], record["claimGeneration"]) == ("COMMITTED", 1)
            late = await gateway.effect(lease, "b")
            assert late.status == 409  # ALREADY_COMMITTED on both: nothing new goes out
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
        fenced = await gateway.effect(stale, "a")
        assert (fenced.status, fenced.code) == (409, "FENCED")
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
    assert migrated.returncode == 0, migrated.stderr
    assert f"migrated from format 1 to format {FORMAT_VERSION}" in migrated.stdout
    await until(lambda: gone_from(new, "roll-0"), "retention starts after the migration")


class Silent:
    """A downstream that reads a request and never answers: a forward to it stays in flight
    until its gateway dies (its connection closes, and so does the handler)."""

    def __init__(self) -> None:
        self.requests = 0
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> Silent:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        if await reader.read(65536):
            self.requests += 1
        await reader.read()  # until the other end closes
        writer.close()

    async def stop(self) -> None:
        for writer in self.writers:
            writer.close()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def silent() -> AsyncIterator[Silent]:
    server = await Silent().start()
    yield server
    await server.stop()


async def duplicated_steps(first: Gateway, second: Gateway, task_id: str, amount: int) -> None:
    """Each step of one task through ``first`` and its duplicate through ``second``: both
    answer the same. Sends two effects downstream, each once (the caller counts)."""
    assert (await first.put(task_id))[0] == 201
    assert (await second.put(task_id))[0] == 200  # the same input: unchanged
    lease = await second.claim(task_id)
    for gateway in (first, second):
        status, refused = await gateway.try_claim(task_id, owner="x")
        assert (status, refused["code"]) == (409, "CLAIMED")
    # An effect; its duplicate replays the stored response; another payload is refused.
    sent = await first.effect(lease, "pay", amount)
    replayed = await second.effect(lease, "pay", amount)
    assert (sent.status, sent.state, sent.replayed) == (200, "COMMITTED", False)
    assert (replayed.status, replayed.state, replayed.replayed) == (200, "COMMITTED", True)
    assert (replayed.body, replayed.effect_id) == (sent.body, sent.effect_id)
    for gateway in (first, second):
        conflict = await gateway.effect(lease, "pay", amount + 100)
        assert (conflict.status, conflict.code) == (422, "PAYLOAD_CONFLICT")
    # The connection broke after the call went out: UNKNOWN, refused by both, until an
    # operator settles it through one; then both replay the response the operator gave.
    lost = await second.effect(lease, "lost", amount, path="reset")
    assert lost.state == "UNKNOWN" and lost.effect_id is not None, lost
    for gateway in (first, second):
        refused_ = await gateway.effect(lease, "lost", amount, path="reset")
        assert (refused_.status, refused_.code) == (409, "EFFECT_UNKNOWN")
    body = json.dumps({"found": task_id})
    status, resolved = await first.resolve(lost.effect_id, {"status": 201, "body": body})
    assert (status, resolved["state"]) == (200, "COMMITTED"), resolved
    for gateway in (first, second):
        replay = await gateway.effect(lease, "lost", amount, path="reset")
        assert (replay.status, replay.state, replay.replayed) == (201, "COMMITTED", True)
        assert replay.body == body.encode()
    # The commit, and its duplicate: the same commit; then both see it and refuse alike.
    committed = await first.commit(lease)
    again = await second.commit(lease)
    assert committed[0] == again[0] == 200
    assert committed[1]["commitId"] == again[1]["commitId"]
    late = [await gateway.effect(lease, "late") for gateway in (first, second)]
    assert late[0].status == late[1].status == 409 and late[0].code == late[1].code
    for gateway in (first, second):
        _, record = await gateway.call("GET", f"/v1/tasks/{task_id}")
        assert (record["state"], record["claimGeneration"]) == ("COMMITTED", 1)


async def take_over(gateway: Gateway, stale: dict[str, Any]) -> dict[str, Any]:
    """Claim ``stale``'s task through ``gateway`` once its lease ran out (polled: the test
    waits for the store's clock, it never races it)."""
    taken: dict[str, Any] = {}

    async def claimed() -> bool:
        status, body = await gateway.try_claim(stale["taskId"])
        if status == 200:
            taken.update(body)
            return True
        assert body["code"] == "CLAIMED", body
        return False

    await until(claimed, f"the lease on {stale['taskId']} runs out and is taken over")
    return taken


async def fenced_after_takeovers(old: Gateway, new: Gateway) -> None:
    """A lease taken over across versions, each way: both fence the stale one, and the new
    holder's effect and commit go through. Sends two effects downstream, each once."""
    for i, (first, second) in enumerate([(old, new), (new, old)]):
        task_id = f"takeover-{i}"
        assert (await first.put(task_id))[0] == 201
        stale = await first.claim(task_id, ttl_ms=200)
        fresh = await take_over(second, stale)
        assert fresh["claimGeneration"] == stale["claimGeneration"] + 1
        for gateway in (old, new):
            fenced = await gateway.effect(stale, "pay")
            assert (fenced.status, fenced.code) == (409, "FENCED")
            status, refused = await gateway.commit(stale)
            assert (status, refused["code"]) == (409, "FENCED")
        assert (await first.effect(fresh, "pay")).state == "COMMITTED"
        assert (await first.commit(fresh))[0] == 200


async def test_5496a14_and_this_version_on_one_redis_at_format_2_never_disagree(
    redis_server: Any,
    key_prefix: str,
    downstream: Downstream,
    tmp_path: Path,
    session: aiohttp.ClientSession,
    previous: Previous,
    current: list[InProcessGateway],
) -> None:
    """A rolling upgrade from 5496a14, before the migration: the store is at format 2 and
    this version writes format-2 records, which 5496a14 reads. Each step of each task goes
    through one gateway and its duplicate through the other (claims, replays, payload
    conflicts, an UNKNOWN effect settled, commits, fencing after takeovers); both answer the
    same, and the downstream runs each effect once."""
    config = write_config(tmp_path, redis_server.url, key_prefix, downstream)
    old = Gateway(previous.start(FORMAT_2, config), session)
    assert (await old.put("seed"))[0] == 201  # 5496a14 recorded the store's format
    new = Gateway(await start_current(current, config), session)
    rolled = [f"roll-{i}" for i in range(4)]
    for task_id, (first, second) in zip(rolled, [(old, new), (new, old)] * 2, strict=True):
        await duplicated_steps(first, second, task_id, amount=len(task_id))
    await fenced_after_takeovers(old, new)
    assert len(downstream.per_key) == 2 * len(rolled) + 2
    assert set(downstream.per_key.values()) == {1}
    # Whichever gateway wrote it, every record is in format 2 (JSON in its task's hash).
    client = redis_server.client()
    assert client.hget(f"{key_prefix}:meta", "format") == str(FORMAT_2.format)
    for task_id in rolled:
        records = client.hvals(Keys(key_prefix).effects(task_id))
        assert len(records) == 2 and all(isinstance(json.loads(r), dict) for r in records)


#: 5496a14's leftovers, slot -> (downstream, path) of the call: a COMMITTED effect, an UNKNOWN
#: one (the connection broke after the call went out) and a PREPARED one (its gateway died
#: while the downstream held the call).
LEFTOVERS = {"paid": ("api", "pay"), "lost": ("api", "reset"), "held": ("silent", "pay")}
#: What a record says that a migration must keep.
KEPT = (
    *("effectId", "taskId", "revision", "node", "slot", "downstream", "method", "path"),
    *("payloadDigest", "state", "attempts", "response", "deadlineAt", "createdAt", "updatedAt"),
)


async def test_records_5496a14_wrote_need_no_rewrite_and_are_served_alike(
    redis_server: Any,
    key_prefix: str,
    downstream: Downstream,
    silent: Silent,
    tmp_path: Path,
    session: aiohttp.ClientSession,
    previous: Previous,
    current: list[InProcessGateway],
) -> None:
    """The end of a rolling upgrade from 5496a14: its last gateway stops (here: dies, with a
    forward in flight), ``fencegate store migrate`` records format 3 and rewrites nothing
    (format 3 only lets new effects reach the creation indexes through the feed), and this
    version answers a duplicate of each record
    5496a14 wrote as 5496a14 did, and renews its claim."""
    slow = f'[[downstreams]]\nname = "silent"\nurl = "{silent.url}"\ntimeout_ms = {HELD_TTL_MS}\n'
    config = write_config(tmp_path, redis_server.url, key_prefix, downstream, slow)
    process = previous.start(FORMAT_2, config)
    old = Gateway(process, session)
    assert (await old.put("task"))[0] == 201
    held = await old.claim("task", ttl_ms=HELD_TTL_MS)
    assert (await old.effect(held, "paid")).state == "COMMITTED"
    assert (await old.effect(held, "lost", path="reset")).state == "UNKNOWN"
    in_flight = asyncio.create_task(old.effect(held, "held", downstream="silent"))
    await until(lambda: silent.requests == 1, "the forward reaches the silent downstream")
    before = {
        slot: await old.effect(held, slot, downstream=name, path=path)
        for slot, (name, path) in LEFTOVERS.items()
    }
    assert [(sent.state, sent.code) for sent in before.values()] == [
        ("COMMITTED", None),
        ("UNKNOWN", "EFFECT_UNKNOWN"),
        ("PREPARED", "EFFECT_IN_FLIGHT"),
    ]
    records = {}
    for slot, sent in before.items():
        status, records[slot] = await old.call("GET", f"/v1/effects/{sent.effect_id}")
        assert status == 200, records[slot]
    process.kill()
    with pytest.raises(aiohttp.ClientError):
        await in_flight

    client = redis_server.client()
    stored = client.hgetall(Keys(key_prefix).effects("task"))
    assert set(stored) == {sent.effect_id for sent in before.values()}
    migrated = migrate(config)
    assert migrated.returncode == 0, migrated.stderr
    # Format 3 rewrites nothing: it only lets new effects wait for index_catch_up.lua.
    assert f"migrated from format 2 to format {FORMAT_VERSION}" in migrated.stdout
    assert "settled index" not in migrated.stdout
    assert client.hget(f"{key_prefix}:meta", "format") == str(FORMAT_VERSION) == "3"
    assert client.hgetall(Keys(key_prefix).effects("task")) == stored
    # An old gateway started now refuses the store: it would read the creation indexes
    # without catching up (docs/decisions.md, "Issue 30: cheaper scripts, and format 3").
    with pytest.raises(RuntimeError, match="newer than this gateway's 2"):
        previous.start(FORMAT_2, config)

    new = Gateway(await start_current(current, config), session)
    assert (await new.renew(held))[0] == 200
    for slot, (name, path) in LEFTOVERS.items():
        after = await new.effect(held, slot, downstream=name, path=path)
        was = before[slot]
        assert (after.status, after.code, after.state) == (was.status, was.code, was.state)
        assert (after.effect_id, after.replayed) == (was.effect_id, was.replayed)
        if after.status == 200:
            assert after.body == was.body  # the stored response, replayed
        status, record = await new.call("GET", f"/v1/effects/{after.effect_id}")
        assert status == 200
        assert {k: record.get(k) for k in KEPT} == {k: records[slot].get(k) for k in KEPT}
    assert sorted(downstream.per_key.values()) == [1, 1] and silent.requests == 1


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
    newer = f"format 99, newer than this gateway's {FORMAT_VERSION}"
    assert checked.returncode == 1, checked.stderr
    assert newer in checked.stderr
    refused = migrate(config)
    assert refused.returncode == 1
    assert newer in refused.stderr
    assert redis_server.client().hget(f"{key_prefix}:meta", "format") == "99"
