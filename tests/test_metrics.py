"""``/metrics`` of a real gateway after real forwards: every forward is in
``fencegate_forward_seconds`` with its outcome (the slow ones that timed out and the ones
that never connected included), no ``*_created`` series, commits counted for what
happened (``committed``, ``replayed``, the code), and the store-wide UNKNOWN effects by kind."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from tests.api import Api, Lease
from tests.clocks import still
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.servers import refused_port
from tests.test_operations import metrics, value
from tests.test_proxy import Sent, fence_headers, task_with_lease


@pytest.fixture
async def api(store_url: str, key_prefix: str, downstream: Downstream) -> AsyncIterator[Api]:
    config = make_config(
        store_url,
        key_prefix,
        downstreams=[
            # The default timeout_ms: the answered calls do not race a timer.
            # Keyed calls too (no [auth]: the anonymous caller may send both kinds).
            {"name": "api", "url": downstream.url, "client_idempotency_keys": "optional"},
            # The timed-out call's downstream: its answer is due 100 ms after the 300 ms timer
            # (both on the loop's clock, the answer's set later), so the timer always fires
            # first; the connect bound is far off, so a slow connect under load is still a
            # timeout (UNKNOWN), never an unreachable downstream.
            {
                "name": "brief",
                "url": downstream.url,
                "timeout_ms": 300,
                "connect_timeout_ms": 10_000,
            },
            {"name": "down", "url": f"http://127.0.0.1:{refused_port()}"},
        ],
        proxy={"prepared_margin_ms": 20_000, "forward_start_limit_ms": 10_000},
        reconciler={"enabled": False},
    )
    # The forward clock stands still and the start limit (then a real-time bound on the pool
    # wait and connect) is 10 s off: a loaded machine cannot trip it, which is not what these
    # tests are about.
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


async def post(api: Api, lease: Lease, target: str, slot: str) -> Sent:
    async with api.client.post(
        f"/proxy/{target}", json={"n": 1}, headers=fence_headers(lease, slot)
    ) as resp:
        return Sent(resp.status, resp.headers, await resp.read())


async def test_every_forward_is_observed_with_its_outcome(api: Api) -> None:
    lease = await task_with_lease(api)
    assert (await post(api, lease, "api/ok/a", "a")).status == 200
    assert (await post(api, lease, "api/status/500", "b")).status == 500
    assert (await post(api, lease, "api/status/429", "c")).status == 429
    began = time.monotonic()
    assert (await post(api, lease, "brief/slow/400/d", "d")).code == "DOWNSTREAM_TIMEOUT"
    waited = time.monotonic() - began
    assert (await post(api, lease, "down/e", "e")).code == "DOWNSTREAM_UNREACHABLE"
    async with api.client.get("/proxy/api/ok/read", headers=fence_headers(lease, None)) as r:
        assert r.status == 200  # a safe method: forwarded unrecorded, observed all the same
    m = await metrics(api)
    count = "fencegate_forward_seconds_count"
    assert value(m, count, downstream="api", outcome="committed", kind="leased") == 2
    assert value(m, count, downstream="api", outcome="unknown", kind="leased") == 1
    assert value(m, count, downstream="api", outcome="not_applied", kind="leased") == 1
    assert value(m, count, downstream="brief", outcome="timeout", kind="leased") == 1
    assert value(m, count, downstream="down", outcome="unreachable", kind="leased") == 1
    # The timed-out forward is observed for as long as it ran: at least the downstream's
    # timeout, at most what the agent waited for the answer (however loaded the machine).
    timed = value(
        m, "fencegate_forward_seconds_sum", downstream="brief", outcome="timeout", kind="leased"
    )
    assert 0.25 <= timed <= waited


async def keyed_post(api: Api, target: str, key: str) -> Sent:
    """A lease-less call under an idempotency key (a keyed effect)."""
    async with api.client.post(
        f"/proxy/{target}", json={"n": 1}, headers={"Idempotency-Key": key}
    ) as resp:
        return Sent(resp.status, resp.headers, await resp.read())


async def test_unknown_effects_are_counted_by_kind(api: Api, downstream: Downstream) -> None:
    """``fencegate_unknown_effects{kind}``: both series from the first scrape (so a sum over
    kind is the total), each counting its own kind's UNKNOWN effects store-wide."""
    m = await metrics(api)
    assert value(m, "fencegate_unknown_effects", kind="leased") == 0
    assert ("fencegate_unknown_effects", (("kind", "keyed"),)) in m
    lease = await task_with_lease(api)
    assert (await post(api, lease, "api/status/500", "a")).status == 500
    for key in ("k1", "k2"):
        lost = await keyed_post(api, "api/status/500", key)
        assert lost.status == 500 and lost.headers["Fence-Effect-State"] == "UNKNOWN"
    assert len(downstream.calls("/status/500")) == 3
    m = await metrics(api)
    assert value(m, "fencegate_unknown_effects", kind="leased") == 1
    assert value(m, "fencegate_unknown_effects", kind="keyed") == 2
    assert value(
        m, "fencegate_effects_total", downstream="api", outcome="UNKNOWN", kind="keyed"
    ) == 2  # fmt: skip


async def test_no_created_series_and_commits_are_named_for_what_happened(api: Api) -> None:
    lease = await task_with_lease(api)
    assert (await api.commit(lease)).status == 200
    assert (await api.commit(lease)).status == 200  # the same commit again: a replay
    assert (await api.commit(lease, result_digest="other")).code == "ALREADY_COMMITTED"
    async with api.client.get("/metrics") as resp:
        text = await resp.text()
    assert "_created" not in text
    m = await metrics(api)
    assert value(m, "fencegate_commits_total", outcome="committed") == 1
    assert value(m, "fencegate_commits_total", outcome="replayed") == 1
    assert value(m, "fencegate_commits_total", outcome="ALREADY_COMMITTED") == 1
    assert value(m, "fencegate_commits_total", outcome="granted") == 0
    assert value(m, "fencegate_attempts_per_task_count") == 1  # a replay is not a new commit
