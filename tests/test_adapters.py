"""Each adapter kind against a downstream that really has that behaviour, on both stores.

For every kind, the lost answer (the downstream applies the effect, the answer times out,
the lease lapses, another worker takes over and retries) must end with exactly one effect at
the downstream and the record COMMITTED or waiting for an operator, never two effects.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.config import Config
from fencegate.gateway.reconcile import Reconciler
from fencegate.ledger.effects import EffectRequest, Fence
from tests.api import Api, Lease
from tests.clocks import still
from tests.conftest import build_test_store, make_config
from tests.kind_servers import KindServers
from tests.servers import GatewayProcess
from tests.test_proxy import Sent, fence_headers

#: The kinds' timeout: a lost answer is held by the downstream (``SLOW``) after it applied
#: the effect, so only this timer ends the call, however loaded the machine; the test then
#: waits for the held call to arrive and lets it go (``answer_held``).
TIMEOUT_MS = 300
SLOW = "hold=1"
#: Bounds only a hang: a wait for something that happens whatever the machine's load.
HANG_S = 30


@pytest.fixture
async def kinds() -> AsyncIterator[KindServers]:
    server = await KindServers().start()
    yield server
    await server.stop()


def kinds_config(store_url: str, key_prefix: str, kinds: KindServers, **overrides: Any) -> Config:
    # The bound a held call runs into is the read timeout: it starts once the connection is
    # there and fires only after the request was handed to the socket, so a held call always
    # arrives (a whole-forward timer of 300 ms could fire before a slow connect sent it).
    common = {"url": kinds.url, "timeout_ms": 10_000, "read_timeout_ms": TIMEOUT_MS}
    downstreams: list[dict[str, Any]] = [
        {"name": "stripe", "adapter": "idempotent", "dedupe_window_ms": 60_000, **common},
        {"name": "stripe-short", "adapter": "idempotent", "dedupe_window_ms": 1_000, **common},
        {
            "name": "orders",
            "adapter": "probe",
            "probe": {
                "path": "/orders/by-key/{effectId}",
                "json_field": "status",
                "found_values": ["created"],
                "interval_ms": 50,
                "max_interval_ms": 200,
                # These stories are about what a probe's answer means; the settle time
                # (absent counts only once no forward can still land) has its own tests.
                "settle_ms": 0,
            },
            **common,
        },
        {"name": "s3", "adapter": "conditional", **common},
        {"name": "mail", "adapter": "manual", **common},
        # The default timeout_ms for these two: their answered calls (10 and 20 at once,
        # each answer delayed) do not race a timer.
        {
            "name": "mail-approved",
            "adapter": "manual",
            "require_approval": True,
            "approval_ttl_ms": 5_000,
            "url": kinds.url,
        },
        {"name": "mail-patient", "adapter": "manual", "url": kinds.url},
        {"name": "plain", "outcomes": {"not_applied": [503]}, **common},
    ]
    return make_config(
        store_url,
        key_prefix,
        downstreams=downstreams,
        # The forward clock stands still (``create_app(..., forward_clock=still)``) and the
        # start limit (then a real-time bound on the pool wait and connect) is 10 s off: a
        # loaded machine cannot trip it.
        proxy={
            "prepared_margin_ms": 20_000,
            "forward_start_limit_ms": 10_000,
            **overrides.pop("proxy", {}),
        },
        reconciler={"enabled": False},
        **overrides,
    )


@pytest.fixture
async def api(store_url: str, key_prefix: str, kinds: KindServers) -> AsyncIterator[Api]:
    config = kinds_config(store_url, key_prefix, kinds)
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


async def call(
    api: Api,
    lease: Lease,
    method: str,
    target: str,
    *,
    slot: str = "s1",
    body: Any = None,
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> Sent:
    all_headers = {**fence_headers(lease, slot), **(headers or {})}
    async with api.client.request(
        method, f"/proxy/{target}", json=body, data=data, headers=all_headers
    ) as resp:
        return Sent(resp.status, resp.headers, await resp.read())


async def lost_answer_then_takeover(
    api: Api, kinds: KindServers, method: str, target: str, **kwargs: Any
) -> tuple[Lease, Lease, Sent]:
    """A sends, the downstream applies but answers too late, A's lease lapses, B claims."""
    await api.put("t1")
    a = await api.claim("t1", "A", ttl_ms=2_000)
    lost = await call(api, a, method, target, **kwargs)
    assert lost.status == 504 and lost.headers["Fence-Effect-State"] == "UNKNOWN"
    await answer_held(kinds, 1)
    api.advance(2_000)
    b = await api.claim("t1", "B")
    return a, b, lost


async def answer_held(kinds: KindServers, count: int) -> None:
    """Once ``count`` held calls arrived (and applied their effect), let every held answer
    go and wait until it went (the gateway gave up on it long before)."""
    await asyncio.wait_for(kinds.holding(count), HANG_S)
    kinds.release.set()
    await kinds.settled()


async def record(api: Api, effect_id: str) -> Any:
    return (await api.call("GET", f"/v1/effects/{effect_id}")).body


# --- idempotent ------------------------------------------------------------------------------


async def test_idempotent_resends_unknown_under_the_original_key(
    api: Api, kinds: KindServers
) -> None:
    _, b, lost = await lost_answer_then_takeover(
        api, kinds, "POST", f"stripe/stripe/charges?{SLOW}", body={"amount": 100}
    )
    retry = await call(api, b, "POST", f"stripe/stripe/charges?{SLOW}", body={"amount": 100})
    # Stripe answers the first charge again instead of charging twice.
    assert retry.status == 200 and retry.headers["Idempotent-Replayed"] == "true"
    assert retry.headers["Fence-Effect-State"] == "COMMITTED"
    assert retry.headers["Fence-Effect-Id"] == lost.headers["Fence-Effect-Id"]
    assert sum(kinds.charges.values()) == 1
    assert list(kinds.charges) == [lost.headers["Fence-Effect-Id"]]
    rec = await record(api, lost.headers["Fence-Effect-Id"])
    assert [a["outcome"] for a in rec["attempts"]] == ["UNKNOWN", "COMMITTED"]
    # Later duplicates are answered from the ledger.
    again = await call(api, b, "POST", f"stripe/stripe/charges?{SLOW}", body={"amount": 100})
    assert again.headers["Fence-Replayed"] == "true"
    assert sum(kinds.charges.values()) == 1


async def test_idempotent_outside_the_window_stays_unknown(api: Api, kinds: KindServers) -> None:
    _, b, _ = await lost_answer_then_takeover(
        api, kinds, "POST", f"stripe-short/stripe/charges?{SLOW}", body={"amount": 1}
    )
    retry = await call(api, b, "POST", f"stripe-short/stripe/charges?{SLOW}", body={"amount": 1})
    assert retry.status == 409 and retry.code == "EFFECT_UNKNOWN"
    assert sum(kinds.charges.values()) == 1


async def test_idempotent_different_payload_is_still_a_conflict(
    api: Api, kinds: KindServers
) -> None:
    _, b, _ = await lost_answer_then_takeover(
        api, kinds, "POST", f"stripe/stripe/charges?{SLOW}", body={"amount": 100}
    )
    other = await call(api, b, "POST", f"stripe/stripe/charges?{SLOW}", body={"amount": 999})
    assert other.status == 422 and other.code == "PAYLOAD_CONFLICT"
    assert sum(kinds.charges.values()) == 1


# --- probe -----------------------------------------------------------------------------------


async def test_probe_finds_the_lost_effect_and_replays_its_answer(
    api: Api, kinds: KindServers
) -> None:
    _, b, lost = await lost_answer_then_takeover(
        api, kinds, "POST", f"orders/orders?{SLOW}", body={"item": "book"}
    )
    retry = await call(api, b, "POST", f"orders/orders?{SLOW}", body={"item": "book"})
    assert retry.status == 200 and retry.headers["Fence-Replayed"] == "true"
    assert json.loads(retry.body)["status"] == "created"
    assert kinds.order_creates == 1 and kinds.probes == 1
    rec = await record(api, lost.headers["Fence-Effect-Id"])
    assert rec["state"] == "COMMITTED"
    assert rec["actions"][-1]["action"] == "reconcile"
    assert rec["actions"][-1]["verdict"] == "found"


async def test_probe_absent_lets_the_same_payload_go_again_under_the_same_key(
    api: Api, kinds: KindServers
) -> None:
    _, b, lost = await lost_answer_then_takeover(
        api, kinds, "POST", f"orders/orders?apply=0&{SLOW}", body={"item": "book"}
    )
    assert kinds.order_creates == 0
    retry = await call(api, b, "POST", f"orders/orders?apply=0&{SLOW}", body={"item": "book"})
    # The probe said "absent": NOT_APPLIED, so this very call went again (and failed again,
    # this time with a definite 500 that the gateway cannot classify: UNKNOWN once more).
    assert kinds.probes == 1
    rec = await record(api, lost.headers["Fence-Effect-Id"])
    assert [a["outcome"] for a in rec["attempts"]][:1] == ["UNKNOWN"]
    assert len(rec["attempts"]) == 2
    assert retry.headers["Fence-Effect-Id"] == lost.headers["Fence-Effect-Id"]


async def test_reconcile_endpoint_and_background_reconciler(
    store_url: str, key_prefix: str, kinds: KindServers
) -> None:
    """Two gateways' reconcilers sweep the same ledger: each UNKNOWN effect is probed once."""
    config = kinds_config(store_url, key_prefix, kinds)
    store = build_test_store(config)
    app = create_app(config, store=store, forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        api = Api(client)
        await api.put("t1")
        lease = await api.claim("t1")
        lost = []
        for i in range(3):
            sent = await call(api, lease, "POST", f"orders/orders?{SLOW}", slot=f"s{i}",
                              body={"item": i})  # fmt: skip
            lost.append(sent.headers["Fence-Effect-Id"])
        await answer_held(kinds, 3)
        manual = await api.call("POST", f"/v1/effects/{lost[0]}/reconcile")
        assert manual.status == 200 and manual.body["state"] == "COMMITTED"
        assert manual.body["actions"][-1]["by"].startswith("operator:")
        # Two reconcilers (as in two gateway processes) sweep at the same time.
        first, second = Reconciler(app), Reconciler(app)
        await asyncio.gather(first.sweep(), second.sweep())
        for effect_id in lost:
            assert (await record(api, effect_id))["state"] == "COMMITTED"
        assert kinds.probes == 3  # one per effect, never two at once
        assert kinds.order_creates == 3


async def test_inconclusive_probes_back_off(api: Api, kinds: KindServers) -> None:
    await api.put("t1")
    lease = await api.claim("t1")
    sent = await call(api, lease, "POST", "orders/orders?apply=0", body={"item": 1})
    # A 500 answer is UNKNOWN, and nothing was created: the probe answers 404 -> NOT_APPLIED.
    effect_id = sent.headers["Fence-Effect-Id"]
    answer = await api.call("POST", f"/v1/effects/{effect_id}/reconcile")
    assert answer.body["state"] == "NOT_APPLIED"
    assert answer.body["probes"]["count"] == 1


async def test_reconcile_of_a_downstream_without_probe_says_what_to_do(
    api: Api, kinds: KindServers
) -> None:
    await api.put("t1")
    lease = await api.claim("t1")
    sent = await call(api, lease, "POST", f"mail/mail/send?{SLOW}", body={"to": "x"})
    answer = await api.call("POST", f"/v1/effects/{sent.headers['Fence-Effect-Id']}/reconcile")
    assert answer.status == 409 and answer.code == "EFFECT_UNKNOWN"
    assert "resolve" in answer.body["detail"]


async def test_reconciler_writes_down_overdue_prepared_records(api: Api) -> None:
    await api.put("t1")
    lease = await api.claim("t1")
    fence = Fence("t1", lease.attempt_id, lease.claim_generation, 1, 0)
    request = EffectRequest(fence, "main", "s1", "plain", "POST", "/x", "d")
    prepared = await api.store.prepare_effect(request, 1_000)
    api.advance(1_000)
    reconciler = Reconciler(api.client.app)  # type: ignore[arg-type]
    assert await reconciler.sweep() == 1
    assert await reconciler.sweep() == 0  # already written down
    stored = await api.store.get_effect(prepared.effect.effect_id)
    assert stored.state.value == "UNKNOWN"


# --- conditional -----------------------------------------------------------------------------


async def test_conditional_create_once_after_lost_answer_is_committed_by_412(
    api: Api, kinds: KindServers
) -> None:
    create = {"If-None-Match": "*"}
    _, b, lost = await lost_answer_then_takeover(
        api, kinds, "PUT", f"s3/s3/bucket/report.csv?{SLOW}", data=b"a,b\n", headers=create
    )
    retry = await call(api, b, "PUT", f"s3/s3/bucket/report.csv?{SLOW}", data=b"a,b\n",
                       headers=create)  # fmt: skip
    assert retry.status == 412
    assert retry.headers["Fence-Effect-State"] == "COMMITTED"
    assert kinds.object_writes == 1
    rec = await record(api, lost.headers["Fence-Effect-Id"])
    assert rec["attempts"][-1]["reason"].startswith("status 412 after an UNKNOWN attempt")


async def test_conditional_update_after_lost_answer(api: Api, kinds: KindServers) -> None:
    await api.put("t0")
    setup = await api.claim("t0")
    first = await call(api, setup, "PUT", "s3/s3/bucket/doc", data=b"v1",
                       headers={"If-None-Match": "*"})  # fmt: skip
    etag = first.headers["ETag"]
    update = {"If-Match": etag}
    _, b, _ = await lost_answer_then_takeover(
        api, kinds, "PUT", f"s3/s3/bucket/doc?{SLOW}", data=b"v2", headers=update
    )
    retry = await call(api, b, "PUT", f"s3/s3/bucket/doc?{SLOW}", data=b"v2", headers=update)
    assert retry.status == 412 and retry.headers["Fence-Effect-State"] == "COMMITTED"
    assert kinds.objects["doc"][0] == b"v2" and kinds.object_writes == 2


async def test_preconditions_are_part_of_the_payload(api: Api, kinds: KindServers) -> None:
    await api.put("t1")
    lease = await api.claim("t1")
    await call(api, lease, "PUT", "s3/s3/bucket/doc", data=b"v1", headers={"If-None-Match": "*"})
    other = await call(api, lease, "PUT", "s3/s3/bucket/doc", data=b"v1",
                       headers={"If-Match": '"abc"'})  # fmt: skip
    assert other.status == 422 and other.code == "PAYLOAD_CONFLICT"


async def test_first_412_is_the_real_answer_and_is_replayed(api: Api, kinds: KindServers) -> None:
    kinds.objects["taken"] = (b"x", '"e"')
    await api.put("t1")
    lease = await api.claim("t1")
    sent = await call(api, lease, "PUT", "s3/s3/bucket/taken", data=b"y",
                      headers={"If-None-Match": "*"})  # fmt: skip
    assert sent.status == 412 and sent.headers["Fence-Effect-State"] == "COMMITTED"
    rec = await record(api, sent.headers["Fence-Effect-Id"])
    assert rec["attempts"][-1]["reason"] == "status 412"
    again = await call(api, lease, "PUT", "s3/s3/bucket/taken", data=b"y",
                       headers={"If-None-Match": "*"})  # fmt: skip
    assert again.status == 412 and again.headers["Fence-Replayed"] == "true"
    assert kinds.object_writes == 0


# --- manual ----------------------------------------------------------------------------------


async def test_manual_unknown_waits_for_an_operator(api: Api, kinds: KindServers) -> None:
    _, b, lost = await lost_answer_then_takeover(
        api, kinds, "POST", f"mail/mail/send?{SLOW}", body={"to": "bob", "text": "hi"}
    )
    retry = await call(api, b, "POST", f"mail/mail/send?{SLOW}", body={"to": "bob", "text": "hi"})
    assert retry.status == 409 and retry.code == "EFFECT_UNKNOWN"
    assert len(kinds.sent) == 1
    effect_id = lost.headers["Fence-Effect-Id"]
    resolved = await api.call("POST", f"/v1/effects/{effect_id}/resolve",
                              {"outcome": "COMMITTED", "note": "bob got it"})  # fmt: skip
    assert resolved.status == 200
    replay = await call(api, b, "POST", f"mail/mail/send?{SLOW}", body={"to": "bob", "text": "hi"})
    assert replay.headers["Fence-Replayed"] == "true"
    assert len(kinds.sent) == 1


async def test_manual_one_effect_in_flight_per_slot(api: Api, kinds: KindServers) -> None:
    await api.put("t1")
    lease = await api.claim("t1")
    answers = await asyncio.gather(
        *(
            call(api, lease, "POST", "mail-patient/mail/send?delay_ms=100", body={"n": 1})
            for _ in range(10)
        )
    )
    assert len(kinds.sent) == 1
    assert (
        sum(1 for a in answers if a.status == 202 and a.headers["Fence-Replayed"] == "false") == 1
    )


async def test_approval_is_for_one_exact_payload_and_is_used_once(
    api: Api, kinds: KindServers
) -> None:
    await api.put("t1")
    lease = await api.claim("t1")
    x, y = {"to": "ceo", "text": "resign"}, {"to": "ceo", "text": "stay"}
    waiting = await call(api, lease, "POST", "mail-approved/mail/send", body=x)
    assert waiting.status == 409 and waiting.code == "APPROVAL_REQUIRED"
    assert not kinds.sent
    effect_id = waiting.headers["Fence-Effect-Id"]
    rec = await record(api, effect_id)
    x_digest = rec["payloadDigest"]
    wrong = await api.call("POST", f"/v1/effects/{effect_id}/approve",
                           {"payloadDigest": "0" * 64})  # fmt: skip
    assert wrong.status == 422 and wrong.code == "PAYLOAD_CONFLICT"
    approved = await api.client.post(
        f"/v1/effects/{effect_id}/approve",
        json={"approvalDigest": rec["approvalDigest"], "note": "checked with legal"},
        headers={"Fence-Operator": "carol"},
    )
    body = await approved.json()
    assert approved.status == 200 and body["approval"]["payloadDigest"] == x_digest
    assert body["approval"]["by"] == "carol" and body["actions"][-1]["action"] == "approve"
    # The approval for X does not let Y through.
    other = await call(api, lease, "POST", "mail-approved/mail/send", body=y)
    assert other.status == 409 and other.code == "APPROVAL_REQUIRED"
    assert not kinds.sent
    sent = await call(api, lease, "POST", "mail-approved/mail/send", body=x)
    assert sent.status == 202 and sent.headers["Fence-Effect-State"] == "COMMITTED"
    assert len(kinds.sent) == 1 and json.loads(kinds.sent[0]) == x
    rec = await record(api, effect_id)
    assert rec["attempts"][-1]["approvedBy"] == "carol" and rec["approval"] is None
    # The approval was used: another slot needs its own.
    again = await call(api, lease, "POST", "mail-approved/mail/send", slot="s2", body=x)
    assert again.code == "APPROVAL_REQUIRED"


async def test_expired_approval_does_not_count(api: Api, kinds: KindServers) -> None:
    await api.put("t1")
    lease = await api.claim("t1", ttl_ms=60_000)
    waiting = await call(api, lease, "POST", "mail-approved/mail/send", body={"n": 1})
    effect_id = waiting.headers["Fence-Effect-Id"]
    assert (await api.call("POST", f"/v1/effects/{effect_id}/approve")).status == 200
    api.advance(5_000)
    late = await call(api, lease, "POST", "mail-approved/mail/send", body={"n": 1})
    assert late.status == 409 and late.code == "APPROVAL_REQUIRED"
    assert not kinds.sent


async def test_approve_is_refused_where_no_approval_is_needed(api: Api, kinds: KindServers) -> None:
    await api.put("t1")
    lease = await api.claim("t1")
    sent = await call(api, lease, "POST", "mail/mail/send", body={"n": 1})
    answer = await api.call("POST", f"/v1/effects/{sent.headers['Fence-Effect-Id']}/approve")
    assert answer.status == 400 and "does not require approval" in answer.body["detail"]


async def test_two_gateways_do_not_both_forward_one_approval(
    store_url: str, key_prefix: str, kinds: KindServers
) -> None:
    # 20 concurrent calls through two gateways: a missed start limit (a loaded machine's
    # slow prepare) spends the approval without sending anything; the forward clock stands
    # still, so none is missed.
    config = kinds_config(store_url, key_prefix, kinds)
    apps = [create_app(config, store=build_test_store(config), forward_clock=still) for _ in "12"]
    async with (
        TestClient(TestServer(apps[0], host="127.0.0.1")) as one,
        TestClient(TestServer(apps[1], host="127.0.0.1")) as two,
    ):
        first, second = Api(one), Api(two)
        await first.put("t1")
        lease = await first.claim("t1", ttl_ms=60_000)
        target = "mail-approved/mail/send?delay_ms=50"
        waiting = await call(first, lease, "POST", target, body={"n": 1})
        effect_id = waiting.headers["Fence-Effect-Id"]
        assert (await second.call("POST", f"/v1/effects/{effect_id}/approve")).status == 200
        answers = await asyncio.gather(
            *(call(gw, lease, "POST", target, body={"n": 1}) for gw in (first, second) * 10)
        )
        assert len(kinds.sent) == 1, [(a.status, a.code) for a in answers]
        forwarded = [
            a for a in answers if a.status == 202 and a.headers["Fence-Replayed"] == "false"
        ]
        assert len(forwarded) == 1


# --- every downstream -----------------------------------------------------------------------


async def test_outcome_overrides_and_injected_credentials(
    store_url: str, key_prefix: str, kinds: KindServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FG_TEST_MAIL_TOKEN", "Bearer gateway-secret")
    config = make_config(
        store_url,
        key_prefix,
        downstreams=[{"name": "mail", "url": kinds.url, "adapter": "manual",
                      "outcomes": {"not_applied": [503]},
                      "headers_from_env": {"Authorization": "FG_TEST_MAIL_TOKEN"}}],
        reconciler={"enabled": False},
    )  # fmt: skip
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        api = Api(client)
        await api.put("t1")
        lease = await api.claim("t1")
        busy = await call(api, lease, "POST", "mail/mail/send?status=503", body={"n": 1},
                          headers={"Authorization": "Bearer agent-token"})  # fmt: skip
        assert busy.status == 503 and busy.headers["Fence-Effect-State"] == "NOT_APPLIED"
        assert kinds.headers_seen[-1]["Authorization"] == "Bearer gateway-secret"
        ok = await call(api, lease, "POST", "mail/mail/send", body={"n": 1})
        assert ok.status == 202 and ok.headers["Fence-Effect-State"] == "COMMITTED"


BAD_CONFIGS = [
    ('name = "d"\nurl = "http://127.0.0.1:1"\nadapter = "pigeon"', "downstreams[0] ('d').adapter"),
    ('name = "d"\nurl = "http://127.0.0.1:1"\nadapter = "idempotent"',
     "('d'): adapter 'idempotent' needs dedupe_window_ms"),
    ('name = "d"\nurl = "http://127.0.0.1:1"\nadapter = "probe"\n'
     'probe = { path = "/x/{effect_id}" }', "('d').probe.path: unknown placeholder"),
    ('name = "d"\nurl = "http://127.0.0.1:1"\n'
     'headers_from_env = { Authorization = "FG_SURELY_UNSET_VAR" }',
     "('d').headers_from_env.Authorization: environment variable 'FG_SURELY_UNSET_VAR'"),
    ('name = "d"\nurl = "http://127.0.0.1:1"\nrequire_approval = true',
     "require_approval is only for adapter = 'manual'"),
    ('name = "d"\nurl = "http://127.0.0.1:1"\nadapter = "probe"\ndedupe_window_ms = 5\n'
     'probe = { path = "/x/{effectId}" }',
     "('d'): dedupe_window_ms is only for adapter = 'idempotent'"),
    ('name = "d"\nurl = "http://127.0.0.1:1"\ntools = { t = { kind = "effect" } }',
     "('d'): tools is only for adapter = 'mcp'"),
    ('name = "d"\nurl = "http://127.0.0.1:1"\nadapter = "mcp"\nretries = 3',
     "downstreams[0] ('d').retries: unknown key"),
]  # fmt: skip


@pytest.mark.parametrize(("table", "message"), BAD_CONFIGS)
def test_config_errors_stop_start_up_naming_downstream_and_key(
    tmp_path: Path, table: str, message: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(f"[[downstreams]]\n{table}\n")
    done = subprocess.run(
        [sys.executable, "-m", "fencegate.gateway.cli", "serve", "--config", str(path)],
        capture_output=True, text=True, timeout=30, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2
    assert message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


async def test_example_config_starts_as_it_is(tmp_path: Path) -> None:
    """config.example.toml shows every kind, and a gateway serves on it unchanged."""
    from fencegate.gateway.config import load_config

    example = Path(__file__).resolve().parent.parent / "config.example.toml"
    kinds = {d.adapter for d in load_config(example).downstreams}
    assert kinds == {"http", "idempotent", "probe", "conditional", "manual", "mcp"}
    copy = tmp_path / "config.example.toml"
    copy.write_text(example.read_text())
    gateway = GatewayProcess(copy).start()
    try:
        async with aiohttp.ClientSession() as session, session.get(f"{gateway.url}/readyz") as resp:
            assert resp.status == 200
    finally:
        gateway.stop()
    assert (tmp_path / "fencegate.db").exists()
