"""What an operator can see of an UNKNOWN call (issue 27 item 1): the request as forwarded,
kept per downstream (``keep_request_bodies``), and what to look up at the downstream.

* Operators get ``request: {headers, body, truncated}`` on the effect (the API, ``fencegate
  effects show``, the console page); observers get it with ``bodyWithheld: true``; a worker
  reads no effect, and its own answers never carry it.
* Never kept: ``Fence-*``, Authorization, Proxy-Authorization, Cookie, the ``headers_from_env``
  and ``never_store_headers`` names; ``redact_headers`` and the values at
  ``redact_json_fields`` (JSON pointers, applied before the cut) are ``"<redacted>"``.
* Off (the default), nothing is kept and the record is what it was.
* Every UNKNOWN effect says which key it went out with and on which call (``lookUp``).

The gateway runs in process over real HTTP against a real downstream (protocol layer: SQLite
only); what each store keeps with the prepare, and its expiry, runs on every store (below).
The stored bytes are checked by tests/test_secrets_at_rest.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway import ops_render
from fencegate.gateway.app import create_app
from fencegate.gateway.cli import main
from fencegate.gateway.config import ConfigError, HttpDownstream, load_config
from fencegate.ledger import requests as kept
from fencegate.ledger.effects import Action, EffectRequest, EffectState, effect_id
from fencegate.ledger.errors import EffectExpired
from fencegate.ledger.store import Store
from tests.api import Api, Lease
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.test_auth import PRINCIPALS, auth_section, bearer
from tests.test_retention import SETTLED_MS, claim_as, commit, fence_of, sweep

CREDENTIAL_ENV = "FG_TEST_KEPT_CREDENTIAL"
CREDENTIAL = "credential-from-env-0123456789"
CARD = "4111111111111111"
SECRET_HEADER = "trace-secret-0123456789"
COOKIE = "session=cookie-secret-0123456789"
AGENT_AUTH = "Bearer agent-secret-0123456789"
INTERNAL = "internal-secret-0123456789"


def downstreams(url: str) -> list[dict[str, Any]]:
    keep = {
        "keep_request_bodies": True,
        "headers_from_env": {"X-Api-Key": CREDENTIAL_ENV},
        "never_store_headers": ["X-Internal"],
        "redact_headers": ["X-Trace-Secret"],
        "redact_json_fields": ["/card/number", "/items/1/cvv", "/a~1b"],
    }
    return [
        {"name": "api", "url": url, "timeout_ms": 5000, **keep},
        {"name": "keyed", "url": url, "timeout_ms": 5000, **keep,
         "idempotency_key_header": "X-Request-Key", "forward_authorization": True},
        {"name": "small", "url": url, "timeout_ms": 5000, "keep_request_bodies": True,
         "keep_request_max_bytes": 16},
        {"name": "plain", "url": url, "timeout_ms": 5000},
    ]  # fmt: skip


@dataclass
class Env:
    client: TestClient[Any, Any]
    downstream: Downstream

    def api(self, who: str) -> Api:
        return Api(_As(self.client, who))  # type: ignore[arg-type]

    @property
    def store(self) -> Store:
        return self.api("operator").store

    async def lease(self, task_id: str) -> Lease:
        put = await self.api("scheduler").put(task_id)
        assert put.status in (200, 201), put.body
        return await self.api("worker-a").claim(task_id, owner="worker-a", ttl_ms=30_000)

    async def send(
        self,
        lease: Lease,
        path: str,
        *,
        slot: str = "s1",
        json_body: Any = None,
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], Any]:
        """A worker's proxied POST: (status, headers, JSON body or None)."""
        sent = {**bearer("worker-a"), **lease.fence_headers(), "Fence-Slot": slot}
        async with self.client.post(
            path, json=json_body, data=data, headers={**sent, **(headers or {})}
        ) as resp:
            raw = await resp.read()
            body = json.loads(raw) if raw and resp.content_type.endswith("json") else None
            return resp.status, dict(resp.headers), body

    async def effect(self, who: str, eid: str) -> tuple[int, Any]:
        async with self.client.get(f"/v1/effects/{eid}", headers=bearer(who)) as resp:
            return resp.status, await resp.json(content_type=None)

    async def page(self, who: str, eid: str) -> str:
        async with self.client.get(f"/console/effects/{eid}", headers=bearer(who)) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.text()


class _As:
    def __init__(self, client: TestClient[Any, Any], who: str) -> None:
        self._client, self._who = client, who
        self.app = client.app

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        kwargs["headers"] = {**bearer(self._who), **(kwargs.get("headers") or {})}
        return self._client.request(method, path, **kwargs)


@pytest.fixture
async def env(
    tmp_path: Path, downstream: Downstream, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Env]:
    monkeypatch.setenv(CREDENTIAL_ENV, CREDENTIAL)
    config = make_config(
        f"sqlite:///{tmp_path / 'fencegate.db'}",
        auth=auth_section(),
        reconciler={"enabled": False},
        downstreams=downstreams(downstream.url),
    )
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Env(client, downstream)


AGENT_HEADERS = {
    "X-Trace-Secret": SECRET_HEADER,
    "Cookie": COOKIE,
    "Proxy-Authorization": AGENT_AUTH,
    "Authorization": AGENT_AUTH,
    "X-Internal": INTERNAL,
    "X-Api-Key": "the agent's own try",
    "X-Request-Key": "the agent's own key",
    "Idempotency-Key": "the agent's own key",
    "X-Order": "o-17",
}
PAYMENT = {
    "amount": 125,
    "to": "acct-9",
    "card": {"number": CARD, "expiry": "12/30"},
    "items": [{"sku": "a"}, {"sku": "b", "cvv": "cvv-secret-987"}],
    "a/b": "slash-secret",
}


def _names(headers: list[list[str]]) -> set[str]:
    return {name.lower() for name, _ in headers}


async def test_operators_see_the_request_as_forwarded_redacted(env: Env) -> None:
    lease = await env.lease("k1")
    status, answer_headers, _ = await env.send(
        lease, "/proxy/api/reset/pay?x=1", json_body=PAYMENT, headers=AGENT_HEADERS
    )
    assert status == 504 and answer_headers["Fence-Effect-State"] == "UNKNOWN"
    eid = effect_id("k1", 1, "main", "s1")
    (received,) = env.downstream.received
    assert received.headers["X-Api-Key"] == CREDENTIAL  # the test is real: it went out

    status, record = await env.effect("operator", eid)
    assert status == 200, record
    request = record["request"]
    headers = request["headers"]
    # As forwarded: the agent's headers the downstream got, the gateway's identity headers.
    got = dict(headers)
    assert got["X-Order"] == "o-17"
    assert got["Fencing-Token"] == received.headers["Fencing-Token"]
    assert got["Idempotency-Key"] == eid == received.headers["Idempotency-Key"]
    assert got["X-Trace-Secret"] == "<redacted>"
    assert not any(name.lower().startswith("fence-") for name in got)
    assert not _names(headers) & {"authorization", "proxy-authorization", "cookie",
                                  "x-api-key", "x-internal"}  # fmt: skip
    # Every header kept is one the downstream received (with the same value, or redacted).
    for name, value in headers:
        assert received.headers[name] == value or value == "<redacted>"
    body = json.loads(request["body"])
    assert body["card"] == {"number": "<redacted>", "expiry": "12/30"}
    assert body["items"] == [{"sku": "a"}, {"sku": "b", "cvv": "<redacted>"}]
    assert body["a/b"] == "<redacted>" and body["amount"] == 125 and body["to"] == "acct-9"
    assert request["truncated"] is False and request["bodySize"] == len(received.body)
    kept_text = json.dumps(record)
    for secret in (CARD, SECRET_HEADER, COOKIE, AGENT_AUTH, INTERNAL, CREDENTIAL, "cvv-secret-987"):
        assert secret not in kept_text, secret
    # What to look up at the downstream, in words.
    assert record["lookUp"] == (
        f"the downstream 'api' received Idempotency-Key: {eid} on POST /reset/pay?x=1: "
        "look the call up there by that key"
    )


async def test_observers_get_the_request_without_its_body_and_workers_nothing(env: Env) -> None:
    lease = await env.lease("k2")
    status, _, problem = await env.send(
        lease, "/proxy/api/reset/pay", json_body=PAYMENT, headers=AGENT_HEADERS
    )
    assert status == 504 and problem["code"] == "DOWNSTREAM_TIMEOUT"
    eid = effect_id("k2", 1, "main", "s1")
    _, full = await env.effect("operator", eid)
    status, seen = await env.effect("observer", eid)
    assert status == 200
    request = seen["request"]
    assert request["bodyWithheld"] is True
    assert "body" not in request and "bodyBase64" not in request
    assert request["headers"] == full["request"]["headers"]
    assert request["bodySize"] == full["request"]["bodySize"]
    assert seen["lookUp"] == full["lookUp"]
    assert "bodyWithheld" not in full["request"] and "body" in full["request"]
    # The agent: its own answers never carry the request, and it reads no effect.
    assert "request" not in problem and "lookUp" not in problem
    status, refused = await env.effect("worker-a", eid)
    assert status == 403, refused
    # A retry of the UNKNOWN call is refused without it too.
    status, _, again = await env.send(lease, "/proxy/api/reset/pay", json_body=PAYMENT)
    assert status == 409 and again["code"] == "EFFECT_UNKNOWN"
    assert "request" not in again and CARD not in json.dumps(again)


async def test_the_console_and_the_cli_show_it(env: Env) -> None:
    lease = await env.lease("k3")
    await env.send(lease, "/proxy/api/reset/pay", json_body=PAYMENT, headers=AGENT_HEADERS)
    eid = effect_id("k3", 1, "main", "s1")
    page = await env.page("operator", eid)
    assert 'id="look-up"' in page and f"Idempotency-Key: {eid}" in page
    assert 'id="request-body"' in page and "acct-9" in page and "&lt;redacted&gt;" in page
    assert CARD not in page and SECRET_HEADER not in page
    observer_page = await env.page("observer", eid)
    assert 'id="request-body-withheld"' in observer_page and "acct-9" not in observer_page
    assert f"Idempotency-Key: {eid}" in observer_page

    _, record = await env.effect("operator", eid)
    shown = ops_render.effect(record)
    assert f"look up         the downstream 'api' received Idempotency-Key: {eid}" in shown
    assert "request (as forwarded):" in shown and '"to":"acct-9"' in shown
    assert "header   X-Trace-Secret: <redacted>" in shown
    _, withheld = await env.effect("observer", eid)
    assert "body     withheld: kept requests are for operators" in ops_render.effect(withheld)


async def test_the_lookup_names_the_configured_key_header(env: Env) -> None:
    lease = await env.lease("k4")
    status, _, _ = await env.send(lease, "/proxy/keyed/reset/refund", json_body={"n": 1},
                                  headers=AGENT_HEADERS)  # fmt: skip
    assert status == 504
    eid = effect_id("k4", 1, "main", "s1")
    (received,) = env.downstream.received
    assert received.headers["X-Request-Key"] == eid
    assert received.headers["Authorization"] == AGENT_AUTH  # forward_authorization
    _, record = await env.effect("operator", eid)
    assert record["lookUp"] == (
        f"the downstream 'keyed' received X-Request-Key: {eid} on POST /reset/refund: "
        "look the call up there by that key"
    )
    got = dict(record["request"]["headers"])
    assert got["X-Request-Key"] == eid and "Idempotency-Key" in got  # the agent's own
    assert "Authorization" not in got  # forwarded, but never kept


async def test_a_long_body_is_cut_and_a_binary_one_is_base64(env: Env) -> None:
    lease = await env.lease("k5")
    text = "é" * 20  # 40 bytes of UTF-8; 16 of them cut no character in half
    await env.send(lease, "/proxy/small/ok/a", data=text.encode(), slot="s1",
                   headers={"Content-Type": "text/plain"})  # fmt: skip
    _, record = await env.effect("operator", effect_id("k5", 1, "main", "s1"))
    request = record["request"]
    assert request["truncated"] is True and request["bodySize"] == 40
    assert request["body"] == "é" * 8
    assert "lookUp" not in record  # COMMITTED: nothing to look up

    odd = "aaaaaaaaaaaaaaaé"  # the cut at 16 bytes splits the é: still text, one short
    await env.send(lease, "/proxy/small/ok/b", data=odd.encode(), slot="s2")
    _, record = await env.effect("operator", effect_id("k5", 1, "main", "s2"))
    assert record["request"]["body"] == "a" * 15 and record["request"]["truncated"] is True

    binary = bytes(range(256))[128:140]
    await env.send(lease, "/proxy/small/ok/c", data=binary, slot="s3",
                   headers={"Content-Type": "application/octet-stream"})  # fmt: skip
    _, record = await env.effect("operator", effect_id("k5", 1, "main", "s3"))
    request = record["request"]
    assert "body" not in request and base64.b64decode(request["bodyBase64"]) == binary
    assert request["truncated"] is False and request["bodySize"] == len(binary)


async def test_a_body_the_pointers_cannot_reach_is_not_kept(env: Env) -> None:
    lease = await env.lease("k6")
    form = f"card={CARD}".encode()
    await env.send(lease, "/proxy/api/ok/form", data=form,
                   headers={"Content-Type": "application/x-www-form-urlencoded"})  # fmt: skip
    _, record = await env.effect("operator", effect_id("k6", 1, "main", "s1"))
    request = record["request"]
    assert request["bodyOmittedReason"] == kept.NOT_JSON
    assert "body" not in request and "bodyBase64" not in request
    assert CARD not in json.dumps(record)


async def test_off_by_default_nothing_is_kept(env: Env) -> None:
    lease = await env.lease("k7")
    status, _, _ = await env.send(lease, "/proxy/plain/reset/x", json_body=PAYMENT,
                                  headers=AGENT_HEADERS)  # fmt: skip
    assert status == 504
    eid = effect_id("k7", 1, "main", "s1")
    effect = await env.store.get_effect(eid)
    assert effect.request_json is None
    _, record = await env.effect("operator", eid)
    assert "request" not in record
    # The look-up holds without a kept request: it is the record's own.
    assert record["lookUp"].startswith(f"the downstream 'plain' received Idempotency-Key: {eid}")
    page = await env.page("operator", eid)
    assert "The request body is not kept by the ledger" in page


async def test_the_next_forward_replaces_the_kept_request(env: Env) -> None:
    lease = await env.lease("k8")
    status, _, _ = await env.send(lease, "/proxy/api/status/429", json_body={"try": 1})
    assert status == 429  # NOT_APPLIED: the agent may send another payload in its slot
    eid = effect_id("k8", 1, "main", "s1")
    _, record = await env.effect("operator", eid)
    assert record["state"] == "NOT_APPLIED" and json.loads(record["request"]["body"]) == {"try": 1}
    await env.send(lease, "/proxy/api/ok/x", json_body={"try": 2})
    _, record = await env.effect("operator", eid)
    assert record["state"] == "COMMITTED" and json.loads(record["request"]["body"]) == {"try": 2}


# --- without [auth]: everything is shown; the CLI -------------------------------------------------


async def test_effects_show_prints_the_request_and_what_to_look_up(
    tmp_path: Path, downstream: Downstream, capsys: pytest.CaptureFixture[str]
) -> None:
    config = make_config(
        f"sqlite:///{tmp_path / 'fencegate.db'}",
        reconciler={"enabled": False},
        downstreams=[{"name": "api", "url": downstream.url, "keep_request_bodies": True,
                      "redact_json_fields": ["/card/number"]}],
    )  # fmt: skip
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        api = Api(client)
        await api.put("c1")
        lease = await api.claim("c1", ttl_ms=30_000)
        headers = {**lease.fence_headers(), "Fence-Slot": "s1"}
        async with client.post("/proxy/api/reset/pay", json=PAYMENT, headers=headers) as resp:
            assert resp.status == 504
        eid = effect_id("c1", 1, "main", "s1")
        url = str(client.make_url("")).rstrip("/")
        capsys.readouterr()
        code = await asyncio.to_thread(main, ["effects", "show", eid[:12], "--url", url])
        out = capsys.readouterr().out
    assert code == 0, out
    assert f"Idempotency-Key: {eid} on POST /reset/pay" in out
    assert '"number":"<redacted>"' in out and CARD not in out


# --- MCP: the JSON-RPC message --------------------------------------------------------------------

MODERN = "2026-07-28"


@pytest.fixture(scope="module")
def mcp_process() -> Iterator[Any]:
    from tests.mcp_server import McpServerProcess

    with McpServerProcess(json_response=True) as server:
        yield server


async def test_an_mcp_tool_call_keeps_its_json_rpc_message(
    tmp_path: Path, mcp_process: Any
) -> None:
    mcp_process.reset()
    config = make_config(
        f"sqlite:///{tmp_path / 'fencegate.db'}",
        reconciler={"enabled": False},
        downstreams=[{"name": "tools", "url": mcp_process.url, "adapter": "mcp",
                      "keep_request_bodies": True,
                      "redact_json_fields": ["/params/arguments/account"]}],
    )  # fmt: skip
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        api = Api(client)
        await api.put("m1")
        lease = await api.claim("m1", ttl_ms=30_000)
        message = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/call",
            "params": {
                "name": "counter",
                "arguments": {"label": "seen", "account": "acct-secret-77"},
                "_meta": {
                    "io.modelcontextprotocol/protocolVersion": MODERN,
                    "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "0"},
                    "io.modelcontextprotocol/clientCapabilities": {},
                },
            },
        }
        headers = {
            **lease.fence_headers(),
            "Accept": "application/json, text/event-stream",
            "Content-Type": "application/json",
            "MCP-Protocol-Version": MODERN,
            "Mcp-Method": "tools/call",
            "Mcp-Name": "counter",
        }
        async with client.post("/mcp/tools", data=json.dumps(message), headers=headers) as resp:
            assert resp.status == 200, await resp.text()
        listed = await api.call("GET", "/v1/effects?taskId=m1")
        (record,) = listed.body["effects"]
    request = record["request"]
    body = json.loads(request["body"])
    assert body["method"] == "tools/call"
    assert body["params"]["arguments"] == {"label": "seen", "account": "<redacted>"}
    got = dict(request["headers"])
    assert got["Content-Type"] == "application/json"
    assert got["Idempotency-Key"] == record["effectId"]
    assert not any(name.lower().startswith("fence-") for name in got)


# --- every store: kept with the prepare, replaced, gone with the record ---------------------------


def _request(task: Any, slot: str, kept_json: str | None, digest: str = "d1") -> EffectRequest:
    return EffectRequest(fence_of(task), "main", slot, "api", "POST", "/x", digest,
                         request_json=kept_json)  # fmt: skip


async def test_the_store_keeps_the_request_with_the_prepare(store: Store) -> None:
    await store.put_task("s1", "in-s1", None)
    task = await store.claim("s1", claim_as("w"))
    first = kept.request_json([("X-A", "1")], b'{"n":1}', max_bytes=100)
    prepared = await store.prepare_effect(_request(task, "a", first), 5_000)
    assert prepared.action is Action.FORWARD and prepared.effect.request_json == first
    eid = prepared.effect.effect_id
    assert (await store.get_effect(eid)).request_json == first
    # A refused prepare (the same effect is in flight) writes nothing of its request ...
    other = kept.request_json([("X-A", "other")], b"{}", max_bytes=100)
    refused = await store.prepare_effect(_request(task, "a", other), 5_000)
    assert refused.action is Action.REJECT and refused.effect.request_json == first
    assert (await store.get_effect(eid)).request_json == first
    assert task.attempt_id is not None
    await store.complete_effect("s1", eid, 0, task.attempt_id, EffectState.NOT_APPLIED,
                                "status 409", None)  # fmt: skip
    assert (await store.get_effect(eid)).request_json == first
    # ... the next forward's replaces it, and one of a downstream keeping none clears it.
    second = kept.request_json([("X-A", "2")], b'{"n":2}', max_bytes=100)
    again = await store.prepare_effect(_request(task, "a", second, "d2"), 5_000)
    assert again.action is Action.FORWARD and again.effect.request_json == second
    await store.complete_effect("s1", eid, 1, task.attempt_id, EffectState.NOT_APPLIED,
                                "status 409", None)  # fmt: skip
    third = await store.prepare_effect(_request(task, "a", None, "d3"), 5_000)
    assert third.action is Action.FORWARD and third.effect.request_json is None
    assert (await store.get_effect(eid)).request_json is None
    # Without one, the record is what it was before requests were kept.
    plain = await store.prepare_effect(_request(task, "b", None), 5_000)
    assert plain.effect.request_json is None


async def test_an_effect_awaiting_approval_shows_what_the_approver_decides_on(
    store: Store,
) -> None:
    """The approver sees the request before anything is forwarded: the waiting record keeps
    the request that bound its payload; a new payload's request replaces it."""
    await store.put_task("ap", "in-ap", None)
    task = await store.claim("ap", claim_as("w"))
    first = kept.request_json([("X-A", "1")], b'{"amount":125}', max_bytes=100)
    waiting = await store.prepare_effect(_request(task, "a", first), 5_000, require_approval=True)
    assert waiting.action is Action.REJECT and waiting.error is not None
    assert waiting.error.code == "APPROVAL_REQUIRED"
    eid = waiting.effect.effect_id
    assert (await store.get_effect(eid)).request_json == first
    other = kept.request_json([("X-A", "2")], b'{"amount":999}', max_bytes=100)
    rebound = await store.prepare_effect(
        _request(task, "a", other, "d2"), 5_000, require_approval=True
    )
    assert rebound.action is Action.REJECT
    assert (await store.get_effect(eid)).request_json == other


async def test_the_kept_request_expires_with_its_record(store: Store) -> None:
    await store.put_task("gone", "in-gone", None)
    task = await store.claim("gone", claim_as("w"))
    kept_json = kept.request_json([], b'{"marker":"kept-marker-1"}', max_bytes=100)
    prepared = await store.prepare_effect(_request(task, "a", kept_json), 5_000)
    eid = prepared.effect.effect_id
    assert task.attempt_id is not None
    await store.complete_effect("gone", eid, 0, task.attempt_id, EffectState.COMMITTED, "ok", None)
    await commit(store, task, "in-gone")
    store.clock_offset_ms += SETTLED_MS
    tasks, effs, _ = await sweep(store)
    assert (tasks, effs) == (1, 1)
    with pytest.raises(EffectExpired) as gone:
        await store.get_effect(eid)
    assert "kept-marker-1" not in json.dumps(gone.value.extra)
    listed, _ = await store.list_effects(
        state=None, task_id=None, downstream=None, limit=100, cursor=None
    )
    assert listed == []


# --- the pure record and the config ---------------------------------------------------------------


def test_pointers_follow_rfc_6901() -> None:
    assert kept.parse_pointer("/a/b~1c/~0d/0") == ("a", "b/c", "~d", "0")
    assert kept.parse_pointer("/") == ("",)
    for bad in ("", "a/b", "/a~2", "/a~"):
        with pytest.raises(ValueError, match="not a JSON pointer"):
            kept.parse_pointer(bad)
    doc = b'{"a":[{"x":1},{"x":2}],"":{"y":3},"n":null}'
    pointers = [kept.parse_pointer(p) for p in ("/a/1/x", "//y", "/a/01/x", "/a/9", "/n/z")]
    assert json.loads(kept.redact(doc, pointers) or b"") == {
        "a": [{"x": 1}, {"x": "<redacted>"}], "": {"y": "<redacted>"}, "n": None,
    }  # fmt: skip
    assert kept.redact(b"not json", pointers) is None
    assert kept.redact(b"\xff", pointers) is None


def test_redaction_comes_before_the_cut() -> None:
    body = json.dumps({"secret": "s" * 40, "z": 1}).encode()
    record = json.loads(
        kept.request_json([], body, max_bytes=20, pointers=[kept.parse_pointer("/secret")])
    )
    assert record["body"] == '{"secret":"<redacted'[:20] and record["truncated"] is True
    assert record["bodySize"] == len(body)


def test_the_config_keys_are_checked_naming_the_key(tmp_path: Path) -> None:
    base = {"name": "d", "url": "http://127.0.0.1:1"}
    config = HttpDownstream.model_validate(base)
    assert config.keep_request_bodies is False and config.keep_request_max_bytes == 8192
    assert config.redact_json_fields == () and config.redact_headers == ()
    with pytest.raises(ValueError, match="keep_request_max_bytes"):
        HttpDownstream.model_validate({**base, "keep_request_max_bytes": kept.MAX_KEEP_BYTES + 1})
    with pytest.raises(ValueError, match="redact_headers"):
        HttpDownstream.model_validate({**base, "redact_headers": ["not a name"]})
    path = tmp_path / "fencegate.toml"
    path.write_text(
        '[[downstreams]]\nname = "pay"\nurl = "http://127.0.0.1:1"\n'
        'keep_request_bodies = true\nredact_json_fields = ["/card/number", "card"]\n'
    )
    with pytest.raises(ConfigError) as bad:
        load_config(path)
    assert "downstreams[0] ('pay').redact_json_fields" in str(bad.value)
    assert "'card' is not a JSON pointer: it must start with /" in str(bad.value)
    path.write_text(
        '[[downstreams]]\nname = "pay"\nurl = "http://127.0.0.1:1"\n'
        f"keep_request_max_bytes = {kept.MAX_KEEP_BYTES + 1}\n"
    )
    with pytest.raises(ConfigError, match=r"downstreams\[0\] \('pay'\)\.keep_request_max_bytes"):
        load_config(path)


def test_principals_used_here_exist() -> None:
    assert {"scheduler", "worker-a", "operator", "observer"} <= set(PRINCIPALS)
