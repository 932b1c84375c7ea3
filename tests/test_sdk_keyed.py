"""``Client.request``: a lease-less client's keyed calls, through a real gateway.

The gateway runs in-process on loopback (as in ``tests/test_sdk.py``) with ``[auth]``: a
``client`` principal, a ``worker`` and an ``operator``, in front of ``tests/downstream.py``,
which counts the calls it receives per ``Idempotency-Key`` (the effectId the gateway sends). So
"sent once" is counted at the downstream, never read from the gateway's record. No clock is
raced: the in-flight duplicate is held by the downstream's own ``/slow/`` delay, and the
settle rule is switched off with ``settle_ms = 0`` where a story needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

import fencegate
from fencegate import Client
from fencegate.client import idempotency_key_header
from fencegate.gateway.app import create_app
from fencegate.gateway.auth import token_sha256
from fencegate.gateway.config import Config
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream

#: Protocol-layer rules, the same on every store: SQLite only (docs/stores.md). The store
#: contract of keyed effects is held on every store by the ledger's own tests.
pytestmark = pytest.mark.one_store

#: Long enough that a loaded machine's first loopback connect is no timeout; ``/slow/`` asks
#: for more when a story needs a lost answer.
TIMEOUT_MS = 1000
TOKENS = {
    "chat-agent": ("client", "tok-keyed-client-0123456789"),
    "other-agent": ("client", "tok-keyed-other-0123456789"),
    "worker-1": ("worker", "tok-keyed-worker-0123456789"),
    "alice": ("operator", "tok-keyed-operator-0123456789"),
}


def keyed_config(store_url: str, key_prefix: str, downstream: Downstream) -> Config:
    return make_config(
        store_url,
        key_prefix,
        reconciler={"enabled": False},  # only the agent's retry and the operator probe
        proxy={"prepared_margin_ms": 2_000},
        auth={
            "principals": [
                {"name": name, "roles": [role], "token_sha256": token_sha256(token)}
                for name, (role, token) in TOKENS.items()
            ]
        },
        downstreams=[
            {
                "name": "pay",
                "url": downstream.url,
                "timeout_ms": TIMEOUT_MS,
                "client_idempotency_keys": "required",
            },
            {
                # Its timeout is far off: a first call held 1.5 s at the downstream is in
                # flight all that time, however loaded the machine.
                "name": "patient",
                "url": downstream.url,
                "timeout_ms": 10_000,
                "client_idempotency_keys": "required",
            },
            {
                "name": "maybe",
                "url": downstream.url,
                "timeout_ms": TIMEOUT_MS,
                "client_idempotency_keys": "optional",
            },
            {"name": "leased", "url": downstream.url, "timeout_ms": TIMEOUT_MS},
            {
                # A probe that finds every call the downstream answered (its /ok/ path):
                # settles an UNKNOWN keyed effect by looking it up by its effectId.
                "name": "probed",
                "url": downstream.url,
                "timeout_ms": TIMEOUT_MS,
                "adapter": "probe",
                "client_idempotency_keys": "required",
                "settle_ms": 0,
                "probe": {"path": "/ok/probe/{effectId}"},
            },
        ],
    )


@dataclass
class Env:
    url: str
    downstream: Downstream
    clients: dict[str, Client]

    def __getitem__(self, name: str) -> Client:
        return self.clients[name]

    def calls(self, effect_id: str) -> int:
        """Calls the downstream received under this effect's key, its probes left out."""
        return sum(
            1
            for r in self.downstream.received
            if r.headers.get("Idempotency-Key") == effect_id and "/probe/" not in r.path
        )


@pytest.fixture
async def env(store_url: str, key_prefix: str, downstream: Downstream) -> AsyncIterator[Env]:
    config = keyed_config(store_url, key_prefix, downstream)
    server = TestServer(create_app(config, store=build_test_store(config)), host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    async with contextlib.AsyncExitStack() as stack:
        clients = {
            name: await stack.enter_async_context(
                Client(url, token=token, timeout=10, operator=name)
            )
            for name, (_, token) in TOKENS.items()
        }
        try:
            yield Env(url, downstream, clients)
        finally:
            await server.close()


def keyed_id(principal: str, downstream: str, key: str) -> str:
    """docs/PROTOCOL.md's identity, written out here: SHA-256 of the compact JSON array."""
    text = json.dumps(["key", principal, downstream, key], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


CHARGE = {"order": "o-17", "amount": 1999}


async def test_a_keyed_call_is_sent_once_and_its_retry_replayed(env: Env) -> None:
    agent = env["chat-agent"]
    first = await agent.request("pay", "POST", "/ok/charges", idempotency_key="k-1", json=CHARGE)
    assert first.status == 200 and not first.replayed
    assert first.effect_id == keyed_id("chat-agent", "pay", "k-1")
    assert first.effect_state == "COMMITTED"
    again = await agent.request("pay", "POST", "/ok/charges", idempotency_key="k-1", json=CHARGE)
    assert again.replayed and again.body == first.body
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["Fence-Replayed"] == "true"
    assert env.calls(first.effect_id) == 1
    (received,) = env.downstream.received
    # The downstream gets the effectId as its key, and no fencing token: there is no lease.
    assert received.headers["Idempotency-Key"] == first.effect_id
    assert "Fencing-Token" not in received.headers
    # The record says whose it is; its task fields are null.
    record = await env["alice"].get_effect(first.effect_id)
    assert record["kind"] == "keyed"
    assert (record["principal"], record["idempotencyKey"]) == ("chat-agent", "k-1")
    assert [record[f] for f in ("taskId", "revision", "node", "slot")] == [None] * 4


async def test_another_payload_under_the_key_is_a_payload_conflict(env: Env) -> None:
    agent = env["chat-agent"]
    first = await agent.request("pay", "POST", "/ok/charges", idempotency_key="k-2", json=CHARGE)
    with pytest.raises(fencegate.PayloadConflict):
        await agent.request(
            "pay", "POST", "/ok/charges", idempotency_key="k-2", json={**CHARGE, "amount": 1}
        )
    assert env.calls(first.effect_id or "") == 1 and len(env.downstream.received) == 1


async def test_keys_are_scoped_to_their_principal(env: Env) -> None:
    """Two clients' equal keys are two effects: neither replays the other's answer."""
    mine = await env["chat-agent"].request(
        "pay", "POST", "/ok/charges", idempotency_key="shared", json=CHARGE
    )
    theirs = await env["other-agent"].request(
        "pay", "POST", "/ok/charges", idempotency_key="shared", json=CHARGE
    )
    assert not mine.replayed and not theirs.replayed
    assert mine.effect_id != theirs.effect_id
    assert theirs.effect_id == keyed_id("other-agent", "pay", "shared")
    assert env.calls(mine.effect_id or "") == 1 and env.calls(theirs.effect_id or "") == 1


async def test_the_header_is_the_quoted_form_of_any_key_the_gateway_takes(env: Env) -> None:
    """Quotes, backslashes and spaces survive the sf-string; both header forms of ``abc`` are
    one key."""
    assert idempotency_key_header('a "b" \\c') == '"a \\"b\\" \\\\c"'
    agent = env["chat-agent"]
    odd = 'a "b" \\c'
    answer = await agent.request("pay", "POST", "/ok/x", idempotency_key=odd, json=CHARGE)
    assert answer.effect_id == keyed_id("chat-agent", "pay", odd)
    quoted = await agent.request("pay", "POST", "/ok/x", idempotency_key="abc", json=CHARGE)
    # The bare token form, as a plain HTTP client may send it: the same key, so a replay.
    raw = await agent.send(
        "POST",
        "/proxy/pay/ok/x",
        body=fencegate.canonical_json(CHARGE),
        headers={"Idempotency-Key": "abc", "Content-Type": "application/json"},
    )
    assert raw.headers["Fence-Effect-Id"] == quoted.effect_id
    assert raw.headers["Fence-Replayed"] == "true"


@pytest.mark.parametrize("key", ["", "x" * 256, "café", "tab\there", "new\nline"])
async def test_a_key_the_gateway_would_refuse_never_leaves_the_sdk(env: Env, key: str) -> None:
    with pytest.raises(ValueError, match="idempotency_key"):
        await env["chat-agent"].request("pay", "POST", "/ok/x", idempotency_key=key, json={})
    with pytest.raises(ValueError, match="idempotency_key"):
        await env["chat-agent"].request("pay", "POST", "/ok/x", idempotency_key=None, json={})
    assert not env.downstream.received


async def test_refusals_before_anything_is_recorded(env: Env) -> None:
    agent = env["chat-agent"]
    # required, and no key: the SDK sends none only for a safe method; by hand it is refused.
    raw = await agent.send("POST", "/proxy/pay/ok/x", body=b"{}",
                           headers={"Content-Type": "application/json"})  # fmt: skip
    assert raw.status == 400 and raw.json()["code"] == "IDEMPOTENCY_KEY_REQUIRED"
    assert raw.headers["Fence-Effect-State"] == "NONE"
    error = fencegate.errors.error_from_problem(raw.status, raw.json(), raw.headers)
    assert isinstance(error, fencegate.IdempotencyKeyRequired)
    assert isinstance(error, fencegate.BadRequest)
    # A safe method without a key goes through, unrecorded.
    read = await agent.request("pay", "GET", "/ok/balance", idempotency_key=None)
    assert read.status == 200 and read.effect_state == "NONE" and read.effect_id is None
    # A downstream with keys off takes no lease-less call.
    with pytest.raises(fencegate.BadRequest) as off:
        await agent.request("leased", "POST", "/ok/x", idempotency_key="k-off", json={})
    assert type(off.value) is fencegate.BadRequest
    # A worker may not drop its lease and send a keyed call instead.
    with pytest.raises(fencegate.Forbidden):
        await env["worker-1"].request("pay", "POST", "/ok/x", idempotency_key="k-w", json={})
    # An operator sends no effects at all.
    with pytest.raises(fencegate.Forbidden):
        await env["alice"].request("pay", "POST", "/ok/x", idempotency_key="k-o", json={})
    assert [r.method for r in env.downstream.received] == ["GET"]


async def test_a_duplicate_in_flight_is_refused_or_waits_for_the_replay(env: Env) -> None:
    agent = env["chat-agent"]

    def send(wait: float | None = None) -> Any:
        return agent.request(
            "patient",
            "POST",
            "/slow/1500/charge",
            idempotency_key="k-slow",
            json=CHARGE,
            wait=wait,
        )

    env.downstream.arrived.clear()
    first = asyncio.create_task(send())
    await env.downstream.arrived.wait()  # the first call is at the downstream
    with pytest.raises(fencegate.EffectInFlight) as in_flight:
        await send()
    assert in_flight.value.retry_after is not None
    waited = await send(wait=5)
    assert waited.replayed and waited.headers["Preference-Applied"] == "wait=5"
    original = await first
    assert not original.replayed and waited.body == original.body
    assert env.calls(original.effect_id or "") == 1


async def test_a_lost_answer_is_unknown_then_settled_by_the_probe(env: Env) -> None:
    """The answer is lost (the downstream is slower than timeout_ms): UNKNOWN. The operator's
    probe finds the call, and the retry with the same key is replayed; the downstream was
    called once. (The retry refused while nobody knows is the next test's.)"""
    agent = env["chat-agent"]
    path = f"/slow/{TIMEOUT_MS + 500}/charge"
    with pytest.raises(fencegate.DownstreamTimeout) as lost:
        await agent.request("probed", "POST", path, idempotency_key="k-lost", json=CHARGE)
    effect_id = lost.value.effect_id
    assert effect_id == keyed_id("chat-agent", "probed", "k-lost")
    assert lost.value.effect_state == "UNKNOWN"
    # The operator settles it by the probe (settle_ms 0: a found call counts at once).
    record = await env["alice"].reconcile_effect(effect_id)
    assert record["state"] == "COMMITTED" and record["kind"] == "keyed"
    retry = await agent.request("probed", "POST", path, idempotency_key="k-lost", json=CHARGE)
    assert retry.replayed and retry.headers["Idempotent-Replayed"] == "true"
    assert env.calls(effect_id) == 1


async def test_a_lost_answer_settled_by_an_operator(env: Env) -> None:
    agent = env["chat-agent"]
    path = f"/slow/{TIMEOUT_MS + 500}/charge"
    with pytest.raises(fencegate.DownstreamTimeout) as lost:
        await agent.request("pay", "POST", path, idempotency_key="k-op", json=CHARGE)
    effect_id = lost.value.effect_id or ""
    with pytest.raises(fencegate.EffectUnknown):
        await agent.request("pay", "POST", path, idempotency_key="k-op", json=CHARGE)
    await env["alice"].resolve_effect(
        effect_id, "COMMITTED", "found it", response={"status": 201, "body": "charged"}
    )
    retry = await agent.request("pay", "POST", path, idempotency_key="k-op", json=CHARGE)
    assert retry.replayed and retry.status == 201 and retry.text() == "charged"
    assert env.calls(effect_id) == 1


async def test_an_operator_finds_a_clients_effect_by_its_key(env: Env) -> None:
    first = await env["chat-agent"].request(
        "maybe", "POST", "/ok/charges", idempotency_key="k-find", json=CHARGE
    )
    found = await env["alice"].list_effects(idempotency_key="k-find", principal="chat-agent")
    assert [r["effectId"] for r in found] == [first.effect_id]
    assert found[0]["kind"] == "keyed" and found[0]["idempotencyKey"] == "k-find"
    assert await env["alice"].list_effects(idempotency_key="k-find", principal="other") == []
    # A client finds its own key (its principal is the default), and no one else's.
    mine = await env["chat-agent"].list_effects(idempotency_key="k-find", downstream="maybe")
    assert [r["effectId"] for r in mine] == [first.effect_id]
    assert await env["other-agent"].list_effects(idempotency_key="k-find") == []
    with pytest.raises(fencegate.Forbidden):
        await env["other-agent"].list_effects(idempotency_key="k-find", principal="chat-agent")
    with pytest.raises(ValueError, match="idempotency_key"):
        await env["alice"].list_effects(idempotency_key="k-find", state="COMMITTED")
