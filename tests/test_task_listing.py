"""``GET /v1/tasks`` on every store: task id order, every record exactly as ``GET
/v1/tasks/{id}`` shows it, filters by state, owner and ``leaseExpired`` (by the store's
clock), opaque cursors across many pages, bounded work when a filter matches little, 400
naming a bad parameter, scoped principals see only their prefixes, and (Redis) tasks created
before the index existed are found."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.state import STORE
from fencegate.ledger import redis_store, sql_steps
from fencegate.ledger import store as store_module
from fencegate.ledger.cluster_store import ClusterStore
from fencegate.ledger.keys import Keys
from fencegate.ledger.queries import TaskFilter
from tests.api import Api
from tests.conftest import build_test_store, make_config
from tests.test_auth import Env, auth_section
from tests.test_cli_operability import env  # noqa: F401 (the CLI's gateway, on each store)
from tests.test_ops_cli import Env as CliEnv


@pytest.fixture
async def api(store_url: str, key_prefix: str) -> AsyncIterator[Api]:
    config = make_config(store_url, key_prefix, reconciler={"enabled": False})
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


async def every_page(api: Api, query: str, limit: int) -> tuple[list[dict[str, Any]], int]:
    """Follow ``nextCursor`` to the end: the tasks, and how many pages it took."""
    found: list[dict[str, Any]] = []
    cursor: str | None = None
    pages = 0
    while True:
        suffix = f"&cursor={cursor}" if cursor else ""
        page = await api.call("GET", f"/v1/tasks?limit={limit}{query}{suffix}")
        assert page.status == 200, page.body
        assert len(page.body["tasks"]) <= limit
        found += page.body["tasks"]
        pages += 1
        cursor = page.body["nextCursor"]
        if cursor is None:
            return found, pages


async def make_tasks(api: Api) -> dict[str, str]:
    """25 tasks in every state; returns taskId -> state."""
    states = {}
    for i in range(25):
        task_id = f"job-{i:02d}"
        assert (await api.put(task_id)).status == 201
        states[task_id] = "READY"
    for i in range(0, 25, 3):
        await api.claim(f"job-{i:02d}", owner="w2" if i % 2 else "w1")
        states[f"job-{i:02d}"] = "CLAIMED"
    done = await api.claim("job-01", owner="w1")
    assert (await api.commit(done)).status == 200
    states["job-01"] = "COMMITTED"
    assert (await api.cancel("job-02")).status == 200
    states["job-02"] = "CANCELLED"
    return states


async def test_pages_cover_every_task_once_in_order_as_get_shows_it(api: Api) -> None:
    states = await make_tasks(api)
    found, pages = await every_page(api, "", 7)
    assert [t["taskId"] for t in found] == sorted(states)
    assert pages == 4  # 7 + 7 + 7 + 4, and the last page says it is the last
    for task in found[:5]:
        assert task == (await api.get(task["taskId"])).body
    default = await api.call("GET", "/v1/tasks")
    assert len(default.body["tasks"]) == 25 and default.body["nextCursor"] is None


async def test_filters_by_state_and_owner(api: Api) -> None:
    states = await make_tasks(api)
    for state in ("READY", "CLAIMED", "COMMITTED", "CANCELLED"):
        found, _ = await every_page(api, f"&state={state}", 2)
        assert [t["taskId"] for t in found] == sorted(k for k, v in states.items() if v == state)
    by_w2, _ = await every_page(api, "&owner=w2&state=CLAIMED", 2)
    assert [t["taskId"] for t in by_w2] == ["job-03", "job-09", "job-15", "job-21"]
    assert all(t["owner"] == "w2" for t in by_w2)
    assert (await api.call("GET", "/v1/tasks?owner=nobody")).body == {
        "tasks": [],
        "nextCursor": None,
    }


@pytest.mark.one_store
@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("limit=0", "limit"),
        ("limit=501", "limit"),
        ("limit=%C2%B2", "limit"),
        ("state=DONE", "state"),
        ("cursor=garbage!", "cursor"),
        ("cursor=" + base64.urlsafe_b64encode(b"task:a b").decode(), "cursor"),
        ("owner=" + "x" * 201, "owner"),
        ("taskId=x", "unknown query parameter"),
        ("state=READY&state=CLAIMED", "state"),
        ("leaseExpired=yes", "leaseExpired: true or false"),
        ("leaseExpired=True", "leaseExpired: true or false"),
        ("leaseExpired=", "leaseExpired: true or false"),
        ("leaseExpired=true&leaseExpired=false", "leaseExpired"),
    ],
)
async def test_bad_parameters_are_400_naming_the_parameter(
    api: Api, query: str, named: str
) -> None:
    answer = await api.call("GET", f"/v1/tasks?{query}")
    assert answer.status == 400 and answer.code == "BAD_REQUEST"
    assert answer.body["detail"].startswith(named), answer.body


async def test_lease_expired_is_the_stores_clock_deciding(api: Api) -> None:
    """``leaseExpired=true``: CLAIMED with ``leaseExpiresAt`` reached by the store's clock;
    ``false``: every other task (WAITING, READY, settled, a lease still running)."""
    for task_id in ("list::a-short", "list::b-long", "list::c-ready", "list::d-done"):
        assert (await api.put(task_id)).status == 201
    assert (await api.put("list::e-waiting", dependsOn=["list::c-ready"])).status == 201
    await api.claim("list::a-short", owner="w1", ttl_ms=5_000)
    await api.claim("list::b-long", owner="w2", ttl_ms=60_000)
    done = await api.claim("list::d-done", owner="w1", ttl_ms=5_000)
    assert (await api.commit(done)).status == 200

    async def ids(query: str) -> list[str]:
        found, _ = await every_page(api, query, 2)
        return [t["taskId"] for t in found]

    everything = [
        "list::a-short",
        "list::b-long",
        "list::c-ready",
        "list::d-done",
        "list::e-waiting",
    ]
    assert await ids("&leaseExpired=true") == []
    assert await ids("&leaseExpired=false") == everything
    api.advance(5_000)  # a-short's lease ends exactly now (expired at leaseExpiresAt)
    assert await ids("&leaseExpired=true") == ["list::a-short"]
    assert await ids("&leaseExpired=false") == [
        "list::b-long",
        "list::c-ready",
        "list::d-done",
        "list::e-waiting",
    ]
    assert await ids("&leaseExpired=false&state=CLAIMED") == ["list::b-long"]
    assert await ids("&leaseExpired=true&owner=w2") == []
    assert await ids("&leaseExpired=false&state=WAITING") == ["list::e-waiting"]
    api.advance(55_000)
    assert await ids("&leaseExpired=true") == ["list::a-short", "list::b-long"]
    assert await ids("&leaseExpired=true&owner=w2&state=CLAIMED") == ["list::b-long"]
    # Listed as GET shows it: still CLAIMED, with the lease's end in the past.
    (listed,) = (await api.call("GET", "/v1/tasks?leaseExpired=true&owner=w1")).body["tasks"]
    assert listed == (await api.get("list::a-short")).body and listed["state"] == "CLAIMED"
    # Claimed again: a live lease again.
    await api.claim("list::a-short", owner="w3")
    assert await ids("&leaseExpired=true") == ["list::b-long"]


async def test_a_filter_that_matches_little_reads_a_bounded_number_per_page(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One task group: on Redis Cluster one bucket, which reads its share of TASK_SCAN
    # (at least limit + 1), then, being the one bucket with more, TASK_SCAN again.
    for i in range(30):
        await api.put(f"list::n-{i:02d}")
    await api.claim("list::n-29", owner="last")
    # Each call reads at most 8 records (the production bound is larger; the rule is the same).
    monkeypatch.setattr(sql_steps, "TASK_SCAN", 8)  # SQLite and PostgreSQL
    monkeypatch.setattr(redis_store, "TASK_SCAN", 8)
    monkeypatch.setattr(store_module, "TASK_SCAN", 8)  # the cluster's per-bucket shares
    first = await api.call("GET", "/v1/tasks?owner=last&limit=5")
    assert first.body["tasks"] == [] and first.body["nextCursor"] is not None
    found, pages = await every_page(api, "&owner=last", 5)
    assert [t["taskId"] for t in found] == ["list::n-29"]
    cluster = isinstance(api.store, ClusterStore)
    assert pages == (3 if cluster else 4)  # 8 + 8 + 8 + 6 records read; cluster: 6 + 8 a call


async def test_scoped_principals_see_only_their_prefixes(store_url: str, key_prefix: str) -> None:
    section = auth_section()
    for principal in section["principals"]:
        if principal["name"] == "observer":
            principal["task_prefixes"] = ["team-a/"]
    config = make_config(store_url, key_prefix, auth=section, reconciler={"enabled": False})
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        env = Env(client, None)  # type: ignore[arg-type]
        for task_id in ("team-a/1", "team-b/1", "team-a/2", "other"):
            put = await env.call("PUT", f"/v1/tasks/{task_id}", "scheduler", {"inputDigest": "i"})
            assert put.status == 201
        scoped = await env.call("GET", "/v1/tasks?limit=1", "observer")
        page = json.loads(scoped.body)
        assert [t["taskId"] for t in page["tasks"]] == ["team-a/1"]
        rest = await env.call("GET", f"/v1/tasks?cursor={page['nextCursor']}", "observer")
        assert [t["taskId"] for t in json.loads(rest.body)["tasks"]] == ["team-a/2"]
        everyone = await env.call("GET", "/v1/tasks", "operator")
        assert len(json.loads(everyone.body)["tasks"]) == 4
        assert (await env.call("GET", "/v1/tasks", "worker-a")).status == 403


async def test_redis_tasks_created_before_the_index_are_listed(
    redis_server: Any, key_prefix: str
) -> None:
    config = make_config(redis_server.url, key_prefix, reconciler={"enabled": False})
    store = build_test_store(config)
    await store.open()
    try:
        for task_id in ("old-1", "old-2", "old-3"):
            await store.put_task(task_id, "in", None)
    finally:
        await store.close()
    # As an older fencegate left them: task hashes, no index.
    keys = Keys(key_prefix)
    raw = aioredis.Redis.from_url(redis_server.url)
    await raw.delete(keys.tasks_index, keys.tasks_indexed)
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        api = Api(client)
        await api.put("new-1")
        found, _ = await every_page(api, "", 2)
        assert [t["taskId"] for t in found] == ["new-1", "old-1", "old-2", "old-3"]
        assert await raw.exists(keys.tasks_indexed)
        listed, _ = await client.app[STORE].list_tasks(TaskFilter(), 10, None)  # type: ignore[index]
        assert len(listed) == 4
    await raw.aclose()


@pytest.mark.one_store  # the CLI's rendering of the API: the store rule is tested above
async def test_the_cli_lists_tasks_whose_lease_expired(env: CliEnv) -> None:  # noqa: F811
    """``fencegate tasks list --lease-expired`` (and ``--no-lease-expired``): the same
    filter, through ``GET /v1/tasks?leaseExpired=``."""
    for task_id in ("a", "b", "c"):
        assert (await env.api.put(task_id)).status == 201
    await env.api.claim("a", ttl_ms=5_000)
    await env.api.claim("b", ttl_ms=60_000)
    env.api.advance(5_000)
    expired = await env.cli("tasks", "list", "--lease-expired", "--json")
    assert expired.code == 0, expired.err
    assert [t["taskId"] for t in expired.json()["tasks"]] == ["a"]
    others = await env.cli("tasks", "list", "--no-lease-expired", "--json")
    assert [t["taskId"] for t in others.json()["tasks"]] == ["b", "c"]
    table = await env.cli("tasks", "list", "--lease-expired", "--state", "claimed")
    assert [row.split()[:2] for row in table.out.splitlines()[1:]] == [["a", "CLAIMED"]]
