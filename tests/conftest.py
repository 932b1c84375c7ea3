"""Fixtures: our own redis-server, both stores, and the gateway over HTTP.

``store`` is parametrized over ``sqlite`` and ``redis``, so every test that takes it (or
``client``) runs once per store and a store cannot quietly differ.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.config import Config
from fencegate.ledger.registry import open_store
from fencegate.ledger.store import Store
from fencegate.ledger.tasks import LeasePolicy
from tests.downstream import Downstream
from tests.servers import Gateways, RedisServer

#: Lease bounds the tests are written against (see the ``config`` fixture).
MAX_TTL_MS = 60_000
DEFAULT_MAX_RUNTIME_MS = 600_000
STORE_TIMEOUT_MS = 1_000


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the session; tests that kill or pause Redis make their own."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


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


@pytest.fixture(params=["sqlite", "redis"])
def any_store_url(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    make_redis_server: Callable[..., RedisServer],
) -> str:
    """A store URL of each kind; the Redis one is a private server nobody else writes to."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fencegate.db'}"
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


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fencegate.db'}"
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.url


def make_config(store_url: str, key_prefix: str = "fg", **sections: object) -> Config:
    data: dict[str, object] = {
        "store": {
            "url": store_url,
            "timeout_ms": STORE_TIMEOUT_MS,
            "redis_key_prefix": key_prefix,
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
    )


@pytest.fixture
async def store(config: Config) -> AsyncIterator[Store]:
    the_store = build_test_store(config)
    await the_store.open()
    yield the_store
    await the_store.close()


@pytest.fixture
async def client(config: Config) -> AsyncIterator[TestClient[object, object]]:
    """The whole gateway over real HTTP on loopback; ``client.app`` holds its store."""
    the_store = build_test_store(config)
    app = create_app(config, store=the_store)
    async with TestClient(TestServer(app, host="127.0.0.1")) as test_client:
        yield test_client
