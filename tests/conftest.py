"""Fixtures: our own redis-server and PostgreSQL servers, the stores, and the gateway over HTTP.

``store`` is parametrized over ``sqlite``, ``redis``, ``postgres`` and ``cluster`` (Redis
Cluster), so every test that takes it (or ``client``) runs once per store and a store cannot
quietly differ.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.config import Config
from fencegate.ledger.registry import open_store
from fencegate.ledger.store import Store
from fencegate.ledger.tasks import LeasePolicy
from tests.clocks import freeze_store_clock
from tests.cluster_servers import ClusterServers
from tests.downstream import Downstream
from tests.postgres_server import PostgresServer, Setting
from tests.servers import Gateways, RedisServer

#: Lease bounds the tests are written against (see the ``config`` fixture).
MAX_TTL_MS = 60_000
DEFAULT_MAX_RUNTIME_MS = 600_000
#: Only bounds a hang: a loaded CI machine can stall a healthy store's answer past a second.
#: Tests about a store that stops answering pause their own server with their own timeout.
STORE_TIMEOUT_MS = 10_000


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the session; tests that kill or pause Redis make their own."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterServers]:
    """One Redis Cluster (three primaries, three replicas) for the session. A test that fails
    a node over or moves a slot leaves it whole (``wait_ok``); one that would not makes its
    own ``ClusterServers``."""
    cluster = ClusterServers(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def make_redis_server(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """A private redis-server a test may kill, pause and restart."""
    started: list[RedisServer] = []

    def make(**kwargs: bool) -> RedisServer:
        server = RedisServer(tmp_path / f"redis-{len(started)}", **kwargs).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


#: The session PostgreSQL is durable as the gateway checks it (fsync and synchronous_commit
#: on, so ``/readyz`` with ``store.require_durable`` passes; on /dev/shm an fsync costs
#: nothing) but skips full-page images. WAL is capped because every ``CREATE DATABASE`` writes
#: a copy of template1 (7 MB) into it.
FAST_POSTGRES_SETTINGS: dict[str, Setting] = {
    "full_page_writes": False,
    "max_wal_size": "256MB",
}


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL for the session, fast and not durable; each test takes a database of its
    own (``postgres_test_url``). Tests that kill, pause or restart it make their own."""
    server = PostgresServer(FAST_POSTGRES_SETTINGS, name="session").start()
    yield server
    server.close()


@pytest.fixture
def make_postgres_server() -> Iterator[Callable[..., PostgresServer]]:
    """Private PostgreSQL servers a test may kill, pause, restart or fail over (``make_standby``,
    ``promote``). Durable unless ``settings`` say otherwise, so a kill -9 loses no commit; all
    are closed with their standbys, and their directories removed, when the test ends."""
    started: list[PostgresServer] = []

    def make(
        settings: Mapping[str, Setting] | None = None, *, name: str = "postgres"
    ) -> PostgresServer:
        server = PostgresServer(settings, name=name)
        started.append(server)  # before start: a server that failed to start is removed too
        return server.start()

    yield make
    for server in started:
        server.close()


def postgres_test_url(server: PostgresServer, request: pytest.FixtureRequest | None = None) -> str:
    """The URL of a new, uniquely named database on ``server``: tests sharing the session server
    do not see each other's rows. With ``request`` it is dropped when the test ends, which the
    session server needs (each is a 7 MB copy of template1, in memory when under /dev/shm)."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    url = server.create_database(name)
    if request is not None:

        def drop() -> None:
            if server.running:  # a private server the test killed goes away whole
                server.drop_database(name)

        request.addfinalizer(drop)
    return url


#: Every store: each test that takes a store URL runs once per store (docs/stores.md), unless
#: it is marked ``one_store``.
STORES = ["sqlite", "redis", "postgres", "cluster"]
#: ``store.cluster_buckets`` of the tests' cluster stores (``make_config``): each test opens a
#: store of its own, and opening reads every bucket once. Gateway processes started from a
#: config file (``any_store_url``, ``Gateways``) run the default (256);
#: ``FENCEGATE_TEST_CLUSTER_BUCKETS=256`` runs every cluster test so.
TEST_CLUSTER_BUCKETS = int(os.environ.get("FENCEGATE_TEST_CLUSTER_BUCKETS", "16"))
#: Where a ``one_store`` test runs: the default store, the one a new user starts on.
ONE_STORE = ["sqlite"]


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A ``one_store`` test (a protocol-layer rule: framing, headers, request hygiene, roles,
    console, CLI rendering) holds the same on every store, so it runs on SQLite only; the
    store-contract tests (conformance, the model test, faults, retention) stay on every store.
    The mark narrows the store fixtures' params before pytest expands them."""
    if metafunc.definition.get_closest_marker("one_store") is None:
        return
    for name in ("store_url", "any_store_url"):
        if name in metafunc.fixturenames:
            metafunc.definition.add_marker(pytest.mark.parametrize(name, ONE_STORE, indirect=True))


@pytest.fixture(params=STORES)
def any_store_url(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    make_redis_server: Callable[..., RedisServer],
) -> str:
    """A store URL of each kind; the Redis, PostgreSQL and cluster ones are private servers
    nobody else writes to (a gateway process started on it uses the default key prefix)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fencegate.db'}"
    if request.param == "postgres":
        make: Callable[..., PostgresServer] = request.getfixturevalue("make_postgres_server")
        return make().url
    if request.param == "cluster":
        cluster = ClusterServers(tmp_path / "redis-cluster").start()
        request.addfinalizer(cluster.stop)
        return cluster.url
    return make_redis_server().url


@pytest.fixture
def gateways(tmp_path: Path) -> Iterator[Gateways]:
    """Gateway processes a test starts; all are stopped when it ends."""
    group = Gateways(tmp_path)
    try:
        yield group
    finally:
        group.stop_all()


@pytest.fixture
async def downstream() -> AsyncIterator[Downstream]:
    """A real HTTP downstream on loopback that counts calls per Idempotency-Key."""
    server = await Downstream().start()
    yield server
    await server.stop()


@pytest.fixture
def key_prefix() -> str:
    """A fresh key prefix per test: tests share the session Redis without seeing each other."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=STORES)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fencegate.db'}"
    if request.param == "postgres":
        return postgres_test_url(request.getfixturevalue("postgres_server"), request)
    if request.param == "cluster":  # the session cluster: each test its own key prefix
        cluster: ClusterServers = request.getfixturevalue("redis_cluster")
        return cluster.url
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.url


def is_cluster(store_url: str) -> bool:
    return store_url.partition("://")[0].lower() in ("redis+cluster", "rediss+cluster")


def make_config(store_url: str, key_prefix: str = "fg", **sections: object) -> Config:
    data: dict[str, object] = {
        "store": {
            "url": store_url,
            "timeout_ms": STORE_TIMEOUT_MS,
            "redis_key_prefix": key_prefix,
            **({"cluster_buckets": TEST_CLUSTER_BUCKETS} if is_cluster(store_url) else {}),
        },
        "leases": {"max_ttl_ms": MAX_TTL_MS, "default_max_runtime_ms": DEFAULT_MAX_RUNTIME_MS},
    }
    for name, values in sections.items():
        if isinstance(values, dict):
            merged = dict(data.get(name, {}))  # type: ignore[call-overload]
            merged.update(values)
            values = merged
        data[name] = values
    return Config.model_validate(data)


@pytest.fixture
def config(store_url: str, key_prefix: str) -> Config:
    return make_config(store_url, key_prefix)


def build_test_store(config: Config) -> Store:
    return open_store(
        config.store.url,
        LeasePolicy(
            max_ttl_ms=config.leases.max_ttl_ms,
            default_max_runtime_ms=config.leases.default_max_runtime_ms,
        ),
        timeout_ms=config.store.timeout_ms,
        redis_key_prefix=config.store.redis_key_prefix,
        max_dependents=config.tasks.max_dependents,
        max_cascade=config.tasks.max_cascade,
        cluster_buckets=config.store.cluster_buckets,
        cluster_queue_rescan_ms=config.store.cluster_queue_rescan_ms,
    )


@pytest.fixture
async def store(config: Config) -> AsyncIterator[Store]:
    the_store = build_test_store(config)
    await the_store.open()
    yield the_store
    await the_store.close()


@pytest.fixture
async def client(
    config: Config, request: pytest.FixtureRequest
) -> AsyncIterator[TestClient[object, object]]:
    """The whole gateway over real HTTP on loopback; ``client.app`` holds its store. Under
    the ``frozen_store_clock`` mark the store's clock stands still (``tests.clocks``)."""
    the_store = build_test_store(config)
    if request.node.get_closest_marker("frozen_store_clock") is not None:
        freeze_store_clock(the_store)
    app = create_app(config, store=the_store)
    async with TestClient(TestServer(app, host="127.0.0.1")) as test_client:
        yield test_client
