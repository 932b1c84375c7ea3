"""Lease-less keyed calls on ``/proxy`` (issue 28): a ``client`` principal sends only a bearer
token and an ``Idempotency-Key`` and gets at-most-once, on every store.

Executions are counted at the downstream (``tests/downstream.py``), never taken from the
gateway's record. The gateway runs in-process with the store's clock and the forward clock
standing still (as tests/test_proxy.py), so a loaded machine cannot run a deadline out.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs

from fencegate.gateway.app import create_app
from fencegate.gateway.auth import principal_from_config, role_warnings, token_sha256
from fencegate.gateway.config import Config, ConfigError, PrincipalConfig
from fencegate.gateway.proxy import parse_client_key
from fencegate.gateway.state import STORE
from fencegate.ledger.effects import ABORT_REASON, EffectState, keyed_effect_id
from fencegate.ledger.errors import StoreUnavailable
from tests.api import until
from tests.clocks import freeze_store_clock, still
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.test_proxy import Sent

TIMEOUT_MS = 400
#: Outlives "brief"'s read timeout (as tests/test_proxy.py's TIMED_OUT): the call arrives,
#: the downstream acts, the gateway's read timer fires first.
TIMED_OUT = f"/proxy/brief/slow/{TIMEOUT_MS + 100}/charge"

TOKENS = {
    "alice": ("tok-alice-0123456789", ["client"]),
    "bob": ("tok-bob-0123456789", ["client"]),
    "w": ("tok-worker-0123456789", ["scheduler", "worker"]),
    "ops": ("tok-ops-0123456789", ["operator"]),
}


def _downstreams(url: str) -> list[dict[str, Any]]:
    return [
        {"name": "pay", "url": url, "client_idempotency_keys": "optional"},
        {"name": "must", "url": url, "client_idempotency_keys": "required"},
        {"name": "closed", "url": url},
        # The downstream's own key header differs from the client's.
        {"name": "other", "url": url, "client_idempotency_keys": "optional",
         "idempotency_key_header": "X-Idem"},
        {"name": "brief", "url": url, "client_idempotency_keys": "optional",
         "read_timeout_ms": TIMEOUT_MS, "connect_timeout_ms": 10_000},
    ]  # fmt: skip


class Gateway:
    """One in-process gateway and its callers, by principal name (None: no credential)."""

    def __init__(self, client: TestClient[Any, Any]) -> None:
        self.client = client

    async def send(
        self,
        who: str | None,
        method: str,
        path: str,
        *,
        key: str | list[str] | None = None,
        headers: dict[str, str] | None = None,
        body: Any = None,
    ) -> Sent:
        sent: list[tuple[str, str]] = list((headers or {}).items())
        if who is not None:
            sent.append(("Fence-Authorization", f"Bearer {TOKENS[who][0]}"))
        for value in [key] if isinstance(key, str) else key or []:
            sent.append(("Idempotency-Key", value))
        data = None if body is None else json.dumps(body).encode()
        if data is not None:
            sent.append(("Content-Type", "application/json"))
        async with self.client.request(method, path, data=data, headers=sent) as resp:
            return Sent(resp.status, resp.headers, await resp.read())

    async def lease(self, task_id: str) -> dict[str, str]:
        """A worker's lease on a new task: its ``Fence-*`` headers (slot ``s1``)."""
        put = await self.send("w", "PUT", f"/v1/tasks/{task_id}", body={"inputDigest": "i"})
        assert put.status in (200, 201), put.body
        epoch = (await self.send("w", "GET", "/v1/epoch")).json["schedulerEpoch"]
        claim_body = {"owner": "w", "ttlMs": 30_000, "schedulerEpoch": epoch}
        claim = await self.send("w", "POST", f"/v1/tasks/{task_id}/claim", body=claim_body)
        assert claim.status == 200, claim.body
        c = claim.json
        return {
            "Fence-Task": task_id,
            "Fence-Attempt": c["attemptId"],
            "Fence-Generation": str(c["claimGeneration"]),
            "Fence-Epoch": str(c["schedulerEpoch"]),
            "Fence-Cancel": str(c["cancelGeneration"]),
            "Fence-Slot": "s1",
        }


def _config(store_url: str, key_prefix: str, url: str, *, auth: bool = True) -> Config:
    principals = [
        {"name": name, "roles": roles, "token_sha256": token_sha256(token)}
        for name, (token, roles) in TOKENS.items()
    ]
    return make_config(
        store_url,
        key_prefix,
        downstreams=_downstreams(url),
        proxy={"prepared_margin_ms": 20_000, "forward_start_limit_ms": 10_000},
        reconciler={"enabled": False},
        **({"auth": {"principals": principals}} if auth else {}),
    )


@pytest.fixture
async def gw(store_url: str, key_prefix: str, downstream: Downstream) -> AsyncIterator[Gateway]:
    config = _config(store_url, key_prefix, downstream.url)
    store = freeze_store_clock(build_test_store(config))
    app = create_app(config, store=store, forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Gateway(client)


def _eid(principal: str, downstream: str, key: str) -> str:
    return keyed_effect_id(principal, downstream, key)


async def _metric(gw: Gateway, name: str, **labels: str) -> float:
    text = (await gw.send("ops", "GET", "/metrics")).body.decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# --- the keyed effect ------------------------------------------------------------------------


async def test_a_duplicate_key_replays_the_first_answer_and_runs_once(
    gw: Gateway, downstream: Downstream
) -> None:
    with capture_logs() as logs:
        first = await gw.send("alice", "POST", "/proxy/pay/ok/charge", key="order-1",
                              body={"amount": 42})  # fmt: skip
    assert first.status == 200, first.body
    effect_id = _eid("alice", "pay", "order-1")
    assert first.headers["Fence-Effect-Id"] == effect_id
    assert first.headers["Fence-Replayed"] == "false"
    assert "Idempotent-Replayed" not in first.headers
    (call,) = downstream.calls("/ok/charge")
    # The downstream gets the effectId as its key, and no fence of any kind.
    assert call.headers["Idempotency-Key"] == effect_id
    assert not [h for h in call.headers if h.lower().startswith(("fence", "fencing"))]
    # The same key, in its Structured-Field form, and the same payload: the stored answer.
    again = await gw.send("alice", "POST", "/proxy/pay/ok/charge", key='"order-1"',
                          body={"amount": 42})  # fmt: skip
    assert again.status == 200 and again.json == first.json
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["Fence-Replayed"] == "true"
    assert len(downstream.calls("/ok/charge")) == 1
    # One decision event per step, with its kind, principal and effect; never the key.
    prepared = next(e for e in logs if e["event"] == "effect.prepared")
    assert prepared["kind"] == "keyed" and prepared["principal"] == "alice"
    assert prepared["effect_id"] == effect_id and "task" not in prepared
    assert "order-1" not in json.dumps(logs, default=str)
    assert TOKENS["alice"][0] not in json.dumps(logs, default=str)
    assert await _metric(gw, "fencegate_effects_total", kind="keyed", outcome="COMMITTED") == 1
    assert await _metric(gw, "fencegate_effects_total", kind="keyed", outcome="replayed") == 1
    assert await _metric(gw, "fencegate_forward_seconds_count", kind="keyed") == 1


async def test_the_clients_own_key_header_is_never_forwarded_as_it_came(
    gw: Gateway, downstream: Downstream
) -> None:
    sent = await gw.send("alice", "POST", "/proxy/other/ok/x", key="k-other", body={})
    assert sent.status == 200, sent.body
    (call,) = downstream.calls("/ok/x")
    assert call.headers["X-Idem"] == _eid("alice", "other", "k-other")
    assert "Idempotency-Key" not in call.headers


async def test_concurrent_duplicates_forward_once(gw: Gateway, downstream: Downstream) -> None:
    answers = await asyncio.gather(
        *(
            gw.send("alice", "POST", "/proxy/pay/slow/200/charge", key="burst", body={"n": 1})
            for _ in range(12)
        )
    )
    assert len(downstream.calls("/slow/200/charge")) == 1
    statuses = sorted(a.status for a in answers)
    assert set(statuses) <= {200, 409} and statuses.count(200) >= 1, statuses
    for answer in answers:
        if answer.status == 409:
            assert answer.code == "EFFECT_IN_FLIGHT" and answer.headers["Retry-After"]
        elif answer.headers["Fence-Replayed"] == "true":
            assert answer.headers["Idempotent-Replayed"] == "true"


async def test_the_same_key_with_another_payload_is_422(
    gw: Gateway, downstream: Downstream
) -> None:
    first = await gw.send("alice", "POST", "/proxy/pay/ok/charge", key="k1", body={"n": 1})
    assert first.status == 200
    other = await gw.send("alice", "POST", "/proxy/pay/ok/charge", key="k1", body={"n": 2})
    assert other.status == 422 and other.code == "PAYLOAD_CONFLICT", other.body
    assert other.headers["Fence-Effect-Id"] == _eid("alice", "pay", "k1")
    assert len(downstream.calls("/ok/charge")) == 1


async def test_a_lost_answer_is_unknown_never_resent_then_settled_by_an_operator(
    gw: Gateway, downstream: Downstream
) -> None:
    lost = await gw.send("alice", "POST", TIMED_OUT, key="pay-7", body={"n": 7})
    assert lost.code == "DOWNSTREAM_TIMEOUT", lost.body
    assert lost.headers["Fence-Effect-State"] == "UNKNOWN"
    effect_id = lost.headers["Fence-Effect-Id"]
    assert effect_id == _eid("alice", "brief", "pay-7")
    retried = await gw.send("alice", "POST", TIMED_OUT, key="pay-7", body={"n": 7})
    assert retried.status == 409 and retried.code == "EFFECT_UNKNOWN", retried.body
    assert len(downstream.calls("/slow/")) == 1
    resolved = await gw.send(
        "ops", "POST", f"/v1/effects/{effect_id}/resolve",
        body={"outcome": "COMMITTED", "note": "the charge is there",
              "response": {"status": 201, "body": '{"charged": 7}'}},
    )  # fmt: skip
    assert resolved.status == 200, resolved.body
    replayed = await gw.send("alice", "POST", TIMED_OUT, key="pay-7", body={"n": 7})
    assert replayed.status == 201 and replayed.json == {"charged": 7}
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert len(downstream.calls("/slow/")) == 1


async def test_a_lost_prepare_answer_is_aborted_by_the_keyed_effects_id(
    gw: Gateway, downstream: Downstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store applies the prepare but its answer is lost (503): nothing was forwarded, so
    the gateway finds the record by its keyed id (no task to look a forward id up under) and
    makes it NOT_APPLIED in the background; the client's retry then forwards, once."""
    store = gw.client.app[STORE]
    applied = store.prepare_effect

    async def lost(*args: Any, **kwargs: Any) -> Any:
        await applied(*args, **kwargs)
        raise StoreUnavailable("the answer was lost")

    monkeypatch.setattr(store, "prepare_effect", lost)
    first = await gw.send("alice", "POST", "/proxy/pay/ok/charge", key="k-lost", body={"n": 1})
    monkeypatch.undo()
    assert first.status == 503 and first.code == "STORE_UNAVAILABLE", first.body
    effect_id = _eid("alice", "pay", "k-lost")

    async def aborted() -> bool:
        return (await store.get_effect(effect_id)).state is EffectState.NOT_APPLIED

    await until(aborted, "the lost prepare is aborted")
    assert (await store.get_effect(effect_id)).attempts[-1].reason == ABORT_REASON
    assert not downstream.received
    retried = await gw.send("alice", "POST", "/proxy/pay/ok/charge", key="k-lost", body={"n": 1})
    assert retried.status == 200 and retried.headers["Fence-Effect-State"] == "COMMITTED"
    assert len(downstream.calls("/ok/charge")) == 1


async def test_keys_are_scoped_to_their_principal(gw: Gateway, downstream: Downstream) -> None:
    a = await gw.send("alice", "POST", "/proxy/pay/ok/charge", key="same", body={"n": 1})
    b = await gw.send("bob", "POST", "/proxy/pay/ok/charge", key="same", body={"n": 1})
    assert a.status == b.status == 200
    assert b.headers["Fence-Replayed"] == "false"  # bob's own effect, not alice's replay
    assert a.headers["Fence-Effect-Id"] != b.headers["Fence-Effect-Id"]
    assert len(downstream.calls("/ok/charge")) == 2
    # bob can neither look alice's key up nor read her effect by its id, nor probe it.
    peek = await gw.send("bob", "GET", "/v1/effects?idempotencyKey=same&principal=alice")
    assert peek.status == 403 and peek.code == "FORBIDDEN"
    assert a.headers["Fence-Effect-Id"] not in peek.body.decode()
    for method, path in (("GET", ""), ("POST", "/reconcile")):
        by_id = await gw.send("bob", method, f"/v1/effects/{a.headers['Fence-Effect-Id']}{path}")
        assert by_id.status == 403, (method, path)


# --- who may send which kind of call -------------------------------------------------------


async def test_a_workers_keyed_call_and_a_clients_lease_are_refused_before_anything(
    gw: Gateway, downstream: Downstream
) -> None:
    lease = await gw.lease("t1")
    worker = await gw.send("w", "POST", "/proxy/pay/ok/charge", key="k-w", body={"n": 1})
    assert worker.status == 403 and worker.code == "FORBIDDEN", worker.body
    assert worker.headers["Fence-Effect-State"] == "NONE"
    for headers in (lease, {"Fence-Slot": "s1"}):
        client = await gw.send("alice", "POST", "/proxy/pay/ok/charge", key="k-a",
                               headers=headers, body={"n": 1})  # fmt: skip
        assert client.status == 403 and client.code == "FORBIDDEN", client.body
        assert "Fence-" in client.json["detail"]
    assert not downstream.received
    for principal, key in (("w", "k-w"), ("alice", "k-a")):
        found = await gw.send(
            "ops", "GET", f"/v1/effects?idempotencyKey={key}&principal={principal}"
        )
        assert found.status == 200 and found.json["effects"] == []
    listed = await gw.send("ops", "GET", "/v1/effects")
    assert listed.json["effects"] == []
    # The worker's lease still works as it did.
    leased = await gw.send("w", "POST", "/proxy/pay/ok/charge", headers=lease, body={"n": 1})
    assert leased.status == 200 and "Fencing-Token" in downstream.received[0].headers


async def test_required_off_and_optional_without_a_key(gw: Gateway, downstream: Downstream) -> None:
    required = await gw.send("alice", "POST", "/proxy/must/ok/charge", body={"n": 1})
    assert required.status == 400 and required.code == "IDEMPOTENCY_KEY_REQUIRED", required.body
    assert "client_idempotency_keys" in required.json["detail"]
    off = await gw.send("alice", "POST", "/proxy/closed/ok/charge", key="k", body={"n": 1})
    assert off.status == 400 and off.code == "BAD_REQUEST"
    assert 'client_idempotency_keys = "off"' in off.json["detail"]
    neither = await gw.send("alice", "POST", "/proxy/pay/ok/charge", body={"n": 1})
    assert neither.status == 400 and neither.code == "BAD_REQUEST"
    assert not downstream.received
    # A safe method without a key goes unrecorded, with no fence to check.
    read = await gw.send("alice", "GET", "/proxy/must/ok/balance")
    assert read.status == 200 and read.headers["Fence-Effect-State"] == "NONE"
    (call,) = downstream.received
    assert "Idempotency-Key" not in call.headers and "Fencing-Token" not in call.headers
    assert (await gw.send("ops", "GET", "/v1/effects")).json["effects"] == []


async def test_the_lookup_finds_a_keyed_effect_for_its_owner_and_the_ledgers_readers(
    gw: Gateway,
) -> None:
    sent = await gw.send("alice", "POST", "/proxy/pay/ok/charge", key="find-me", body={"n": 1})
    effect_id = sent.headers["Fence-Effect-Id"]
    own = await gw.send("alice", "GET", "/v1/effects?idempotencyKey=find-me")
    assert [e["effectId"] for e in own.json["effects"]] == [effect_id]
    query = "idempotencyKey=find-me&principal=alice&downstream=pay"
    named = await gw.send("alice", "GET", f"/v1/effects?{query}")
    assert [e["effectId"] for e in named.json["effects"]] == [effect_id]
    elsewhere = await gw.send("alice", "GET", "/v1/effects?idempotencyKey=find-me&downstream=must")
    assert elsewhere.json["effects"] == []
    by_ops = await gw.send("ops", "GET", "/v1/effects?idempotencyKey=find-me&principal=alice")
    assert [e["effectId"] for e in by_ops.json["effects"]] == [effect_id]
    # A client's only way into the ledger is that look-up of its own keys.
    assert (await gw.send("alice", "GET", "/v1/effects")).status == 403
    assert (await gw.send("alice", "GET", f"/v1/effects/{effect_id}")).status == 403
    bad = await gw.send("alice", "GET", "/v1/effects?idempotencyKey=find-me&state=COMMITTED")
    assert bad.status == 400


# --- the header's grammar (a protocol rule: one store) -------------------------------------


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ("abc", "abc"),
        ('"abc"', "abc"),
        ('"a b"', "a b"),
        (r'"say \"hi\" \\ bye"', 'say "hi" \\ bye'),
        ("x" * 255, "x" * 255),
        (f'"{"y" * 255}"', "y" * 255),
        ("", None),
        ('""', None),
        ("a b", None),
        ("x" * 256, None),
        (f'"{"y" * 256}"', None),
        ('"open', None),
        ('"bad \\n escape"', None),
        ('"tab\there"', None),
        ("caf\u00e9", None),
        ("ctl\x01", None),
    ],
)
def test_the_idempotency_key_grammar(value: str, key: str | None) -> None:
    assert parse_client_key(value) == key


@pytest.mark.one_store
@pytest.mark.parametrize("key", [["a b"], ["x" * 256], ['"open'], ["one", "two"], [""]])
async def test_a_malformed_key_is_400_naming_the_header(
    gw: Gateway, downstream: Downstream, key: list[str]
) -> None:
    sent = await gw.send("alice", "POST", "/proxy/pay/ok/charge", key=key, body={"n": 1})
    assert sent.status == 400 and sent.code == "BAD_REQUEST", sent.body
    assert "Idempotency-Key" in sent.json["detail"]
    assert not downstream.received


# --- without [auth]: the one principal may do both ------------------------------------------


@pytest.mark.one_store
async def test_without_auth_anonymous_sends_leased_and_keyed_calls(
    store_url: str, key_prefix: str, downstream: Downstream
) -> None:
    config = _config(store_url, key_prefix, downstream.url, auth=False)
    app = create_app(config, store=freeze_store_clock(build_test_store(config)),
                     forward_clock=still)  # fmt: skip
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        gw = Gateway(client)
        lease = await gw.lease("t1")
        leased = await gw.send(None, "POST", "/proxy/pay/ok/a", headers=lease, body={})
        keyed = await gw.send(None, "POST", "/proxy/pay/ok/b", key="k", body={})
        assert leased.status == keyed.status == 200
        assert keyed.headers["Fence-Effect-Id"] == _eid("anonymous", "pay", "k")
        assert "Fencing-Token" in downstream.calls("/ok/a")[0].headers
        assert "Fencing-Token" not in downstream.calls("/ok/b")[0].headers


# --- config ------------------------------------------------------------------------------------


def _with(downstream: dict[str, Any]) -> Config:
    return make_config("sqlite:///unused.db", downstreams=[downstream])


def test_client_idempotency_keys_is_validated_naming_the_key() -> None:
    with pytest.raises(Exception) as caught:
        _with({"name": "p", "url": "http://x", "client_idempotency_keys": "yes"})
    assert "client_idempotency_keys" in str(caught.value)
    assert _with({"name": "p", "url": "http://x"}).downstreams[0].client_idempotency_keys == "off"


@pytest.mark.parametrize(
    ("keys", "path", "refused"),
    [
        ("optional", "/c/{effectId}?key={idempotencyKey}", False),
        ("required", "/c/{taskId}/{slot}", True),
        ("off", "/c/{taskId}/{slot}", False),
        ("off", "/c/{idempotencyKey}", True),
    ],
)
def test_probe_templates_fit_keyed_effects(keys: str, path: str, refused: bool) -> None:
    table = {"name": "p", "url": "http://x", "adapter": "probe",
             "client_idempotency_keys": keys, "probe": {"path": path}}  # fmt: skip
    if not refused:
        _with(table)
        return
    with pytest.raises((ValueError, ConfigError)) as caught:
        _with(table)
    assert "probe.path" in str(caught.value) or "path" in str(caught.value)


def test_a_principal_with_worker_and_client_is_warned_about() -> None:
    both = PrincipalConfig.model_validate(
        {"name": "mixed", "roles": ["worker", "client"], "token_sha256": "a" * 64}
    )
    lines = role_warnings([principal_from_config(both)])
    assert len(lines) == 1 and "'mixed'" in lines[0]
    config = make_config(
        "sqlite:///unused.db",
        auth={"principals": [both.model_dump(exclude_none=True)]},
    )
    with capture_logs() as logs:
        create_app(config, store=build_test_store(config))
    assert [e["principal"] for e in logs if e["event"] == "auth.worker_and_client"] == ["mixed"]
