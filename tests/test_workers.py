"""``fencegate serve --workers N``: one supervisor, N worker processes sharing the port and the
store.

Real processes only: ``python -m fencegate.gateway.cli serve`` on a real redis-server (a
private one where a test needs it, else the session's under a fresh key prefix), a real
downstream, plain HTTP clients. Which worker answered is read from the log: every line a worker
writes carries ``worker``, and ``[logging] level = "debug"`` logs each request
(``http.access``). Connections are closed after every request so the kernel spreads them over
the workers.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest

from fencegate import Client
from tests.conftest import postgres_test_url
from tests.downstream import Downstream
from tests.servers import GatewayProcess, RedisServer

TOKEN_A, TOKEN_B = "token-a-" + "a" * 32, "token-b-" + "b" * 32


def _principal(name: str, token: str) -> str:
    digest = hashlib.sha256(token.encode()).hexdigest()
    return (
        f'\n[[auth.principals]]\nname = "{name}"\nroles = ["scheduler", "worker", "observer"]\n'
        f'token_sha256 = "{digest}"\n'
    )


def write_config(
    directory: Path,
    store_url: str,
    *,
    workers: int = 2,
    key_prefix: str = "fg",
    downstream: str | None = None,
    auth: str = "",
    event_loop: str = "asyncio",
) -> GatewayProcess:
    directory.mkdir(parents=True, exist_ok=True)
    port = 0  # the system picks it when the gateway binds; GatewayProcess reads it back
    text = (
        f'[server]\nlisten = "127.0.0.1:{port}"\nworkers = {workers}\n'
        f'event_loop = "{event_loop}"\n'
        f"\n[store]\nurl = {json.dumps(store_url)}\ntimeout_ms = 2000\n"
        f"redis_key_prefix = {json.dumps(key_prefix)}\n"
        '\n[logging]\nlevel = "debug"\n'
    )
    if downstream is not None:
        text += f'\n[[downstreams]]\nname = "api"\nurl = "{downstream}"\ntimeout_ms = 5000\n'
    path = directory / "fencegate.toml"
    path.write_text(text + auth)
    return GatewayProcess(path, port)


@pytest.fixture
def started() -> Iterator[list[GatewayProcess]]:
    """Gateways a test starts; each is stopped (SIGTERM, then SIGKILL) when it ends."""
    gateways: list[GatewayProcess] = []
    yield gateways
    for gateway in gateways:
        gateway.stop()


def start(gateways: list[GatewayProcess], gateway: GatewayProcess) -> GatewayProcess:
    gateways.append(gateway)
    gateway.start()
    wait_for_events(gateway, lambda events: len(named(events, "gateway.listening")) >= 2)
    return gateway


def named(events: list[dict[str, object]], name: str) -> list[dict[str, object]]:
    return [e for e in events if e.get("event") == name]


def wait_for_events(
    gateway: GatewayProcess,
    done: Callable[[list[dict[str, object]]], bool],
    timeout: float = 20.0,
) -> list[dict[str, object]]:
    deadline = time.monotonic() + timeout
    while True:
        events = gateway.log_events()
        if done(events):
            return events
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not logged in {timeout}s: {gateway.log_path.read_text()[-3000:]}"
            )
        time.sleep(0.05)


def workers_that_served(events: list[dict[str, object]], path: str) -> set[object]:
    return {e.get("worker") for e in named(events, "http.access") if e.get("path") == path}


async def fresh(
    gateway: GatewayProcess, method: str, path: str, token: str | None = None, **kwargs: Any
) -> tuple[int, str]:
    """One request on a new connection, closed after it (the kernel picks the worker)."""
    headers = {"Fence-Authorization": f"Bearer {token}"} if token else {}
    connector = aiohttp.TCPConnector(force_close=True)
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.request(method, gateway.url + path, headers=headers, **kwargs) as resp,
    ):
        return resp.status, await resp.text()


def granted_claims(metrics: str) -> float:
    found = re.search(r'^fencegate_claims_total\{outcome="granted"\} (\S+)$', metrics, re.M)
    assert found is not None, metrics
    return float(found.group(1))


async def claim_tasks(gateway: GatewayProcess, prefix: str, count: int) -> None:
    for i in range(count):
        status, body = await fresh(
            gateway, "PUT", f"/v1/tasks/{prefix}-{i}", json={"inputDigest": "sha256:00"}
        )
        assert status == 201, body
        status, body = await fresh(
            gateway,
            "POST",
            f"/v1/tasks/{prefix}-{i}/claim",
            json={"owner": "w", "ttlMs": 30_000, "schedulerEpoch": 1},
        )
        assert status == 200, body


@pytest.mark.parametrize("shared", ["redis", "postgres"])
async def test_two_workers_share_the_port_and_the_store_and_each_answers_metrics_for_both(
    tmp_path: Path,
    request: pytest.FixtureRequest,
    shared: str,
    key_prefix: str,
    started: list[GatewayProcess],
) -> None:
    """Two processes (two PIDs) serve one port; a claim made through one is seen by the other
    (one store: Redis or PostgreSQL), and a scrape, whichever worker takes it, counts the
    claims of both."""
    if shared == "redis":
        store_url = cast(RedisServer, request.getfixturevalue("redis_server")).url
    else:
        store_url = postgres_test_url(request.getfixturevalue("postgres_server"), request)
    gateway = start(started, write_config(tmp_path / "g", store_url, key_prefix=key_prefix))
    await claim_tasks(gateway, "t", 12)
    events = gateway.log_events()
    pids = {e["worker"]: e["pid"] for e in named(events, "gateway.worker_started")}
    assert set(pids) == {0, 1} and len(set(pids.values())) == 2, pids
    assert gateway.proc is not None and gateway.proc.pid not in pids.values()
    for pid in pids.values():
        os.kill(int(str(pid)), 0)  # alive
    assert workers_that_served(events, "/v1/tasks/t-0/claim") | workers_that_served(
        events, "/v1/tasks/t-11/claim"
    ) <= {0, 1}
    served = {e.get("worker") for e in named(events, "http.access")}
    assert served == {0, 1}, served  # 24 fresh connections: both workers took some
    # Every line a worker writes names it; the supervisor's lines do not.
    assert {e["worker"] for e in named(events, "gateway.listening")} == {0, 1}
    starting = named(events, "gateway.starting")[0]
    assert "worker" not in starting and starting["workers"] == 2
    assert starting["loop"] == "asyncio"
    # A task claimed through either worker is one record: a second claim is refused by both.
    for _ in range(4):
        status, _body = await fresh(
            gateway,
            "POST",
            "/v1/tasks/t-0/claim",
            json={"owner": "x", "ttlMs": 30_000, "schedulerEpoch": 1},
        )
        assert status == 409
    scrapes = [await fresh(gateway, "GET", "/metrics") for _ in range(8)]
    assert {granted_claims(body) for _, body in scrapes} == {12.0}
    scraped_by = workers_that_served(gateway.log_events(), "/metrics")
    assert scraped_by == {0, 1}, scraped_by


async def test_a_worker_killed_with_sigkill_is_logged_and_restarted_and_its_counts_survive(
    tmp_path: Path, make_redis_server: Callable[..., RedisServer], started: list[GatewayProcess]
) -> None:
    redis = make_redis_server()
    gateway = start(started, write_config(tmp_path / "g", redis.url))
    await claim_tasks(gateway, "before", 8)
    first = {e["worker"]: e["pid"] for e in named(gateway.log_events(), "gateway.worker_started")}
    os.kill(int(str(first[0])), signal.SIGKILL)
    events = wait_for_events(gateway, lambda events: len(named(events, "gateway.listening")) >= 3)
    (exited,) = named(events, "gateway.worker_exited")
    assert exited["worker"] == 0 and exited["pid"] == first[0]
    assert exited["signal"] == "SIGKILL" and exited["exit_code"] is None
    assert exited["action"] == "restart" and exited["listened"] is True
    restarted = named(events, "gateway.worker_started")[-1]
    assert restarted["worker"] == 0 and restarted["pid"] != first[0]
    assert restarted["restarts"] == 1
    assert gateway.proc is not None and gateway.proc.poll() is None  # the gateway goes on
    # Both slots serve again, and the totals still hold the dead worker's calls.
    await claim_tasks(gateway, "after", 8)
    for _ in range(6):
        status, body = await fresh(gateway, "GET", "/metrics")
        assert status == 200 and granted_claims(body) == 16.0
    later = [e for e in gateway.log_events() if str(e.get("path")).startswith("/v1/tasks/after")]
    assert {e["worker"] for e in later} == {0, 1}


def test_a_crash_loop_stops_the_gateway_with_exit_1(
    tmp_path: Path, redis_server: RedisServer, key_prefix: str, started: list[GatewayProcess]
) -> None:
    """Five restarts within a minute are granted; the sixth death stops every worker and the
    supervisor exits 1, for the service manager to see, rather than flapping quietly."""
    gateway = start(started, write_config(tmp_path / "g", redis_server.url, key_prefix=key_prefix))
    for kill in range(1, 7):
        events = wait_for_events(
            gateway,
            lambda events, kill=kill: (
                len([e for e in named(events, "gateway.listening") if e["worker"] == 0]) >= kill
            ),
        )
        pid = [e["pid"] for e in named(events, "gateway.worker_started") if e["worker"] == 0][-1]
        os.kill(int(str(pid)), signal.SIGKILL)
    assert gateway.proc is not None
    assert gateway.proc.wait(timeout=20) == 1
    exits = named(gateway.log_events(), "gateway.worker_exited")
    assert [e["action"] for e in exits] == ["restart"] * 5 + ["stop"], exits
    assert gateway.log_events()[-1]["event"] == "gateway.stopped"


async def test_sigterm_drains_every_worker_then_the_supervisor_exits_0(
    tmp_path: Path,
    make_redis_server: Callable[..., RedisServer],
    downstream: Downstream,
    started: list[GatewayProcess],
) -> None:
    """Calls in flight on any worker get the downstream's answer; the supervisor's own
    ``gateway.stopped`` is the last line, after every worker's, and no worker outlives it."""
    redis = make_redis_server()
    config = write_config(tmp_path / "g", redis.url, downstream=downstream.url, event_loop="uvloop")
    gateway = start(started, config)
    pids = [int(str(e["pid"])) for e in named(gateway.log_events(), "gateway.worker_started")]
    async with Client(gateway.url, timeout=15) as client:
        await client.put_task("t1", "in-1")
        lease = await client.acquire("t1", owner="w1", ttl_ms=30_000)
        calls = [
            asyncio.create_task(
                lease.request("api", "POST", "/slow/1500/pay", slot=f"s{i}", json={"n": i})
            )
            for i in range(8)
        ]
        # Every call is in flight at the downstream (its 1.5 s sleep) before the signal.
        async with asyncio.timeout(10):
            while len(downstream.received) < len(calls):
                await asyncio.sleep(0.01)
        assert gateway.proc is not None
        gateway.proc.send_signal(signal.SIGTERM)
        answers = await asyncio.wait_for(asyncio.gather(*calls), timeout=15)
    assert all(a.status == 200 and not a.replayed for a in answers)
    assert await asyncio.to_thread(gateway.proc.wait, 20) == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    lines = [e for e in gateway.log_events() if str(e.get("event", "")).startswith("gateway.")]
    assert lines[-1]["event"] == "gateway.stopped" and "worker" not in lines[-1], lines[-1]
    assert int(str(lines[-1]["drain_ms"])) >= 500  # it waited for the slow calls
    stopped = [e["worker"] for e in lines if e["event"] == "gateway.stopped" and "worker" in e]
    assert sorted(map(str, stopped)) == ["0", "1"], lines
    stopping = [e for e in lines if e["event"] == "gateway.stopping"]
    assert {e.get("worker") for e in stopping} == {None, 0, 1}
    assert {e["signal"] for e in stopping} == {"SIGTERM"}
    assert named(gateway.log_events(), "gateway.starting")[0]["loop"] == "uvloop"
    assert not named(gateway.log_events(), "gateway.worker_exited")  # a stop is no crash


async def test_sighup_reloads_auth_in_every_worker(
    tmp_path: Path, redis_server: RedisServer, key_prefix: str, started: list[GatewayProcess]
) -> None:
    config = write_config(
        tmp_path / "g",
        redis_server.url,
        key_prefix=key_prefix,
        auth=_principal("a", TOKEN_A),
        event_loop="uvloop",
    )
    gateway = start(started, config)
    status, _ = await fresh(gateway, "GET", "/v1/epoch", TOKEN_B)
    assert status == 401
    text = config.config_path.read_text()
    config.config_path.write_text(text.replace(_principal("a", TOKEN_A), _principal("b", TOKEN_B)))
    assert gateway.proc is not None
    gateway.proc.send_signal(signal.SIGHUP)
    events = wait_for_events(gateway, lambda events: len(named(events, "auth.reloaded")) >= 2)
    assert {e["worker"] for e in named(events, "auth.reloaded")} == {0, 1}
    for _ in range(10):
        assert (await fresh(gateway, "GET", "/v1/epoch", TOKEN_B))[0] == 200
        assert (await fresh(gateway, "GET", "/v1/epoch", TOKEN_A))[0] == 401
    assert workers_that_served(gateway.log_events(), "/v1/epoch") == {0, 1}


async def test_a_second_gateway_cannot_join_the_port_of_a_running_one(
    tmp_path: Path, redis_server: RedisServer, key_prefix: str, started: list[GatewayProcess]
) -> None:
    """SO_REUSEPORT would let a second ``--workers`` gateway take half the connections: the
    supervisor binds without it first, so the second one fails to start instead."""
    first = start(started, write_config(tmp_path / "a", redis_server.url, key_prefix=key_prefix))
    second = write_config(tmp_path / "b", redis_server.url, key_prefix=key_prefix)
    done = subprocess.run(
        [sys.executable, "-m", "fencegate.gateway.cli", "serve", "--config",
         str(second.config_path), "--listen", f"127.0.0.1:{first.port}"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    last = json.loads(done.stderr.strip().splitlines()[-1])
    assert last["event"] == "gateway.cannot_listen" and last["listen"] == f"127.0.0.1:{first.port}"
    assert not [line for line in done.stderr.splitlines() if "worker_started" in line]


def serve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fencegate.gateway.cli", "serve", *args],
        cwd=cwd, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("how", ["file", "flag"])
def test_sqlite_refuses_more_than_one_worker_with_a_config_error(tmp_path: Path, how: str) -> None:
    path = tmp_path / "fencegate.toml"
    workers = "workers = 2\n" if how == "file" else ""
    path.write_text(f"[server]\n{workers}[store]\nurl = 'sqlite:///fg.db'\n")
    flag = ["--workers", "2"] if how == "flag" else []
    done = serve("--config", str(path), *flag, cwd=tmp_path)
    assert done.returncode == 2, done
    (line,) = done.stderr.strip().splitlines()
    error = json.loads(line)
    assert error["event"] == "gateway.config_error"
    assert "server.workers = 2" in error["error"] and "SQLite" in error["error"], error
    assert not (tmp_path / "fg.db").exists()
    checked = serve("--config", str(path), *flag, "--check", cwd=tmp_path)
    assert checked.returncode == 2 and "server.workers = 2" in checked.stderr, checked


def test_check_accepts_workers_and_says_how_many(tmp_path: Path, redis_server: RedisServer) -> None:
    path = tmp_path / "fencegate.toml"
    path.write_text(f"[store]\nurl = '{redis_server.url}'\n")
    done = serve("--config", str(path), "--workers", "3", "--check", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "workers: 3" in done.stdout.splitlines(), done.stdout
    done = serve("--config", str(path), "--workers", "0", "--check", cwd=tmp_path)
    assert done.returncode == 2 and "server.workers" in done.stderr, done.stderr


async def test_a_console_login_holds_on_every_worker_without_a_configured_key(
    tmp_path: Path, redis_server: RedisServer, key_prefix: str, started: list[GatewayProcess]
) -> None:
    """No FENCEGATE_CONSOLE_SECRET: the supervisor draws one key for all its workers, so the
    cookie one worker signed is a session on the other."""
    config = write_config(
        tmp_path / "g", redis_server.url, key_prefix=key_prefix, auth=_operator("op", TOKEN_A)
    )
    gateway = start(started, config)
    connector = aiohttp.TCPConnector(force_close=True)  # each request: a new connection
    async with aiohttp.ClientSession(connector=connector) as session:
        login = {"token": TOKEN_A}
        async with session.post(
            gateway.url + "/console/login",
            data=login,
            headers={"Origin": gateway.url},
            allow_redirects=False,
        ) as resp:
            assert resp.status == 303, await resp.text()
            cookie = resp.cookies["fencegate_console"].value
        session.cookie_jar.clear()
        for _ in range(12):
            async with session.get(
                gateway.url + "/console",
                headers={"Cookie": f"fencegate_console={cookie}"},
                allow_redirects=False,
            ) as resp:
                assert resp.status == 200, (await resp.text())[:300]
    assert workers_that_served(gateway.log_events(), "/console") == {0, 1}


def _operator(name: str, token: str) -> str:
    digest = hashlib.sha256(token.encode()).hexdigest()
    return (
        f'\n[[auth.principals]]\nname = "{name}"\nroles = ["operator"]\ntoken_sha256 = "{digest}"\n'
    )
