"""What operators rely on: metrics, validation coverage, the audit log, shadow mode, rollout
status and readiness, on both stores, after real traffic through HTTP."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from fencegate.gateway.app import create_app
from tests.api import Api
from tests.clocks import freeze_store_clock, still
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.servers import RedisServer, write_gateway_config
from tests.test_proxy import send


async def gateway(store_url: str, key_prefix: str, downstream: Downstream, **proxy: Any) -> Any:
    config = make_config(
        store_url,
        key_prefix,
        downstreams=[
            # The default timeout_ms: no story here times out, so none races a timer.
            {"name": "api", "url": downstream.url},
            {"name": "shadowed", "url": downstream.url, "enforcement": "shadow"},
        ],
        proxy={"prepared_margin_ms": 20_000, "forward_start_limit_ms": 10_000, **proxy},
        reconciler={"enabled": False},
    )  # fmt: skip
    # The forward clock stands still and the start limit (then a real-time bound on the pool
    # wait and connect) is 10 s off: a loaded machine's slow prepare or connect cannot trip it.
    # The store's clock stands still too: only api.advance runs a lease out.
    app = create_app(config, store=freeze_store_clock(build_test_store(config)),
                     forward_clock=still)  # fmt: skip
    return TestClient(TestServer(app, host="127.0.0.1"))


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def metrics(api: Api) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with api.client.get("/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return scrape(await resp.text())


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def mixed_workload(api: Api) -> None:
    """Grants and every kind of refusal at every acceptance point."""
    await api.put("t1")
    await api.put("t2")
    a = await api.claim("t1", "A", ttl_ms=1_000)
    assert (await api.try_claim("t1", "B")).code == "CLAIMED"
    assert (await api.try_claim("t1", "B", epoch=99)).code == "STALE_EPOCH"
    assert (await api.renew(a, ttl_ms=1_000)).status == 200
    assert (await api.renew(a, claimGeneration=5)).code == "FENCED"
    await send(api, a, body={"x": 1})
    await send(api, a, body={"x": 1})  # replay
    assert (await send(api, a, body={"x": 2})).code == "PAYLOAD_CONFLICT"
    assert (await send(api, a, "/ok/read", method="GET", slot=None)).status == 200
    api.advance(1_000)
    assert (await send(api, a, body={"y": 1}, slot="s2")).code == "LEASE_EXPIRED"
    b = await api.claim("t1", "B")
    assert (await api.commit(a)).code == "FENCED"
    assert (await send(api, b, "/status/500", body={}, slot="s3")).status == 500
    assert (await api.commit(b)).status == 200
    c = await api.claim("t2", "C")
    await api.cancel("t2")
    assert (await api.commit(c)).code == "CANCELLED"


async def test_metric_families_move_and_validation_coverage_is_complete(
    store_url: str, key_prefix: str, downstream: Downstream
) -> None:
    async with await gateway(store_url, key_prefix, downstream) as client:
        api = Api(client)
        await mixed_workload(api)
        m = await metrics(api)
    for point in ("claim", "renew", "proxy", "commit"):
        requests = value(m, "fencegate_requests_total", point=point)
        assert requests > 0, point
        assert value(m, "fencegate_validations_total", point=point) == requests, point
    assert value(m, "fencegate_claims_total", outcome="granted") == 3
    assert value(m, "fencegate_claims_total", outcome="CLAIMED") == 1
    assert value(m, "fencegate_claims_total", outcome="STALE_EPOCH") == 1
    assert value(m, "fencegate_renewals_total", outcome="FENCED") == 1
    assert value(m, "fencegate_commits_total", outcome="committed") == 1
    assert value(m, "fencegate_commits_total", outcome="granted") == 0
    assert value(m, "fencegate_commits_total", outcome="CANCELLED") == 1
    assert value(m, "fencegate_rejections_total", point="proxy", code="LEASE_EXPIRED") == 1
    assert value(m, "fencegate_rejections_total", point="commit", code="FENCED") == 1
    assert (
        value(m, "fencegate_effects_total", downstream="api", outcome="COMMITTED", kind="leased")
        == 1
    )
    assert (
        value(m, "fencegate_effects_total", downstream="api", outcome="replayed", kind="leased")
        == 1
    )
    assert (
        value(m, "fencegate_effects_total", downstream="api", outcome="conflict", kind="leased")
        == 1
    )
    assert (
        value(m, "fencegate_effects_total", downstream="api", outcome="UNKNOWN", kind="leased") == 1
    )
    assert value(m, "fencegate_unknown_effects", kind="leased") == 1
    assert value(m, "fencegate_unknown_effects", kind="keyed") == 0
    assert value(m, "fencegate_prepared_effects") == 0
    assert value(m, "fencegate_active_leases") == 0  # t1 committed, t2 cancelled
    assert value(m, "fencegate_reclaim_latency_seconds_count") == 1
    assert value(m, "fencegate_attempts_per_task_count") == 1
    assert value(m, "fencegate_attempts_per_task_sum") == 2  # t1 took two claims
    assert value(m, "fencegate_ready_to_commit_seconds_count") == 1
    forwards = {
        labels: v for (name, labels), v in m.items() if name == "fencegate_forward_seconds_count"
    }
    assert sum(v for labels, v in forwards.items() if ("downstream", "api") in labels) >= 3
    assert any(name == "fencegate_store_seconds_count" and v > 0 for (name, _), v in m.items())


async def test_gauges_come_from_the_store_and_agree_across_gateways(
    store_url: str, key_prefix: str, downstream: Downstream
) -> None:
    async with (
        await gateway(store_url, key_prefix, downstream) as one,
        await gateway(store_url, key_prefix, downstream) as two,
    ):
        first, second = Api(one), Api(two)
        await first.put("t1")
        await first.claim("t1", ttl_ms=60_000)
        if not store_url.startswith("sqlite"):  # two gateways on one store see the same lease
            assert value(await metrics(second), "fencegate_active_leases") == 1
        assert value(await metrics(first), "fencegate_active_leases") == 1


async def test_shadow_mode_forwards_what_enforce_mode_refuses_and_counts_it(
    store_url: str, key_prefix: str, downstream: Downstream
) -> None:
    async with await gateway(store_url, key_prefix, downstream) as client:
        api = Api(client)
        await api.put("t1")
        stale = await api.claim("t1", ttl_ms=1_000)
        api.advance(1_000)
        await api.claim("t1", "B")
        enforced = await send(api, stale, body={"x": 1})
        assert enforced.code == "FENCED"
        assert not downstream.calls()
        with capture_logs() as logs:
            shadowed = await send(api, stale, "/proxy/shadowed/ok/pay", body={"x": 1})
        assert shadowed.status == 200  # the agent gets the downstream's answer
        assert shadowed.headers["Fence-Shadow-Rejected"] == "FENCED"
        assert len(downstream.calls()) == 1
        m = await metrics(api)
        assert value(m, "fencegate_shadow_rejections_total", point="proxy", code="FENCED") == 1
        assert value(m, "fencegate_validations_total", point="proxy") == value(
            m, "fencegate_requests_total", point="proxy"
        )
        events = [e for e in logs if e["event"] == "effect.shadow_rejected"]
        assert events and events[0]["code"] == "FENCED" and events[0]["task"] == "t1"


async def test_global_shadow_mode(store_url: str, key_prefix: str, downstream: Downstream) -> None:
    async with await gateway(store_url, key_prefix, downstream, enforcement="shadow") as client:
        api = Api(client)
        await api.put("t1")
        lease = await api.claim("t1")
        first = await send(api, lease, body={"x": 1})
        conflict = await send(api, lease, body={"x": 2})
        assert first.status == conflict.status == 200
        assert conflict.headers["Fence-Shadow-Rejected"] == "PAYLOAD_CONFLICT"
        assert len(downstream.calls()) == 2


async def test_rollout_status_is_safe_only_when_everything_settled(
    store_url: str, key_prefix: str, downstream: Downstream
) -> None:
    async with await gateway(store_url, key_prefix, downstream) as client:
        api = Api(client)
        await api.put("t1")
        lease = await api.claim("t1", ttl_ms=5_000)
        await api.call("POST", "/v1/claims/pause")
        await api.call("POST", "/v1/epoch/bump")
        status = (await api.call("GET", "/v1/rollout")).body
        assert status["claimsPaused"] and status["activeLeases"] == 1
        assert status["safeToSwitchPools"] is False
        assert status["blockers"] == [
            {"member": "activeLeases", "count": 1, "reason": "1 lease held"}
        ]
        # An effect whose answer never came keeps the pools from switching...
        api.advance(5_000)
        await api.call("POST", "/v1/claims/resume")
        fresh = await api.claim("t1", "B")
        unknown = await send(api, fresh, "/status/502", body={})
        status = (await api.call("GET", "/v1/rollout")).body
        assert status["unknownEffects"] == 1 and status["safeToSwitchPools"] is False
        assert [b["reason"] for b in status["blockers"]] == ["1 lease held", "1 effect UNKNOWN"]
        await api.call(
            "POST",
            f"/v1/effects/{unknown.headers['Fence-Effect-Id']}/resolve",
            {"outcome": "NOT_APPLIED", "note": "checked", "force": True},  # before settle_ms
        )
        assert (await api.call("GET", "/v1/rollout")).body["safeToSwitchPools"] is False
        # ...until the last lease is gone too.
        assert (await api.commit(fresh)).status == 200
        status = (await api.call("GET", "/v1/rollout")).body
        assert status == {**status, "activeLeases": 0, "preparedEffects": 0,
                          "unknownEffects": 0, "awaitingApproval": 0,
                          "safeToSwitchPools": True, "blockers": []}  # fmt: skip
        assert lease.claim_generation == 1


async def test_audit_events_carry_the_decision(
    store_url: str, key_prefix: str, downstream: Downstream
) -> None:
    async with await gateway(store_url, key_prefix, downstream) as client:
        api = Api(client)
        await api.put("t1")
        with capture_logs() as logs:
            lease = await api.claim("t1")
            await send(api, lease, body={"secret": "do-not-log"})
            await send(api, lease, body={"secret": "do-not-log"})
            await send(api, lease, headers={"Fence-Generation": "9"}, body={})
    by_event = {e["event"]: e for e in logs}
    granted = by_event["claim.granted"]
    assert granted["task"] == "t1" and granted["generation"] == 1 and granted["epoch"] == 1
    for name in ("effect.prepared", "effect.committed", "effect.replayed"):
        event = by_event[name]
        for key in ("task", "attempt", "generation", "epoch", "effect_id", "downstream",
                    "payload_digest"):  # fmt: skip
            assert event.get(key) is not None, (name, key)
    assert by_event["effect.committed"]["reason"] == "status 200"
    fenced = by_event["effect.fenced"]
    assert fenced["code"] == "FENCED" and fenced["reason"]
    assert "do-not-log" not in json.dumps(logs, default=str)


async def test_log_lines_cannot_be_forged_by_request_content(
    tmp_path: Path, downstream: Downstream
) -> None:
    gw = write_gateway_config(tmp_path, f"sqlite:///{tmp_path / 'g.db'}").start()
    try:
        async with aiohttp.ClientSession() as session:
            await session.put(f"{gw.url}/v1/tasks/t1", json={"inputDigest": "x"})
            forged = 'w1\n{"event": "claim.granted", "task": "t1", "owner": "mallory"}'
            async with session.post(
                f"{gw.url}/v1/tasks/t1/claim",
                json={"owner": forged, "ttlMs": 1000, "schedulerEpoch": 1},
            ) as resp:
                assert resp.status == 200
    finally:
        gw.stop()
    lines = gw.log_path.read_text().splitlines()
    events = [json.loads(line) for line in lines]  # every line is one JSON object
    granted = [e for e in events if e.get("event") == "claim.granted"]
    assert len(granted) == 1 and granted[0]["owner"] == forged


async def test_readyz_fails_on_a_redis_that_is_not_durable(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=False).start()
    try:
        config = make_config(server.url, "ready")
        async with TestClient(TestServer(create_app(config, store=build_test_store(config)),
                                         host="127.0.0.1")) as client:  # fmt: skip
            async with client.get("/readyz") as resp:
                body = await resp.json()
            assert resp.status == 503 and body["code"] == "STORE_UNAVAILABLE"
            assert "appendonly" in body["detail"]
            relaxed = make_config(server.url, "ready", store={"require_durable": False})
            app = create_app(relaxed, store=build_test_store(relaxed))
            async with (
                TestClient(TestServer(app, host="127.0.0.1")) as other,
                other.get("/readyz") as resp,
            ):
                assert resp.status == 200
    finally:
        server.stop()
