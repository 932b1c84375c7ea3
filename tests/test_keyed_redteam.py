"""Red-team pass at lease-less keyed calls (issue 28): hostile ``client`` principals against a
real in-process gateway with ``[auth]`` on.

The threat model (docs/security.md): an agent is not trusted. A prompt-injected or buggy
client, or any process that reaches the gateway, must not do more than its own credential
allows: not replay, read, probe, wait on, settle or approve another principal's keyed effect,
not pass a worker's fence off as its own (nor a worker drop its fence for a key), not smuggle
a key, a fencing token or the gateway's ``_meta`` names to the downstream, not escape its
``downstreams`` scope or its rate limit. Everything that ran is counted at the downstream
(``tests/downstream.py`` for HTTP, ``CountingMcp`` here for MCP), never taken from the
gateway's own record.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.auth import token_sha256
from fencegate.gateway.state import EVENTS
from fencegate.ledger.effects import keyed_effect_id
from tests.api import HANG_S, serve_app, until
from tests.clocks import freeze_store_clock, still
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.test_proxy import Sent

#: name -> (token, roles, scope and limits).
PRINCIPALS: dict[str, tuple[str, list[str], dict[str, Any]]] = {
    "alice": ("tok-alice-redteam-0123456789", ["client"], {}),
    "bob": ("tok-bob-redteam-0123456789", ["client"], {}),
    # Scoped to one downstream, and rate-limited: a burst of 3, then 1 a minute.
    "carol": ("tok-carol-redteam-0123456789", ["client"], {"downstreams": ["pay"]}),
    "slow": (
        "tok-slow-redteam-0123456789",
        ["client"],
        {"rate_per_second": 1 / 60, "burst": 3},
    ),
    "w": ("tok-worker-redteam-0123456789", ["scheduler", "worker"], {}),
    "ops": ("tok-ops-redteam-0123456789", ["operator"], {}),
    # An operator that is also a client: may not approve its own keyed effect.
    "oc": ("tok-oc-redteam-0123456789", ["client", "operator"], {}),
    "obs": ("tok-obs-redteam-0123456789", ["observer"], {}),
}
#: The MCP downstream's read-only tool (an unrecorded lease-less call) and an effect.
READ_TOOL, PAY_TOOL = "lookup", "pay"
KEY_META, OLD_KEY_META = "dev.fencegate/idempotencyKey", "fencegate/idempotencyKey"


@dataclass
class CountingMcp:
    """An MCP server that keeps every message it was sent (its headers too) and answers
    ``tools/call`` with how many calls it ran; anything else gets an empty result."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    #: When set, a ``tools/call`` waits for it (the first call is "in flight").
    gate: asyncio.Event | None = None
    #: ``POST /held`` calls received (an HTTP downstream that holds its answers too).
    held: int = 0
    runner: web.AppRunner | None = None
    base: str = ""
    url: str = ""

    def calls(self) -> list[dict[str, Any]]:
        return [m for m in self.messages if m.get("method") == "tools/call"]

    async def _post(self, request: web.Request) -> web.Response:
        message = json.loads(await request.read())
        self.messages.append(message)
        self.headers.append(dict(request.headers))
        if "id" not in message:
            return web.Response(status=202)
        result: dict[str, Any] = {}
        if message.get("method") == "tools/call":
            if self.gate is not None:
                await self.gate.wait()
            text = f"ran {len(self.calls())}"
            result = {"content": [{"type": "text", "text": text}], "isError": False}
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})

    async def _held(self, request: web.Request) -> web.Response:
        """``POST /held``: an HTTP call held while ``gate`` is set and not yet released."""
        await request.read()
        self.held += 1
        if self.gate is not None:
            await self.gate.wait()
        return web.json_response({"held": self.held})

    async def start(self) -> CountingMcp:
        app = web.Application()
        app.router.add_post("/mcp", self._post)
        app.router.add_post("/held", self._held)
        self.runner, self.base = await serve_app(app)
        self.url = f"{self.base}/mcp"
        return self


class Gateway:
    """One in-process gateway; requests by principal name (None: no credential). Headers are
    a list of pairs, so a test can send one field twice or in any casing."""

    def __init__(self, client: TestClient[Any, Any]) -> None:
        self.client = client

    async def send(
        self,
        who: str | None,
        method: str,
        path: str,
        *,
        headers: list[tuple[str, str]] | None = None,
        body: Any = None,
        raw: bytes | None = None,
    ) -> Sent:
        sent = list(headers or [])
        if who is not None:
            sent.append(("Fence-Authorization", f"Bearer {PRINCIPALS[who][0]}"))
        data = raw
        if body is not None:
            data = json.dumps(body).encode()
        if data is not None and not any(n.lower() == "content-type" for n, _ in sent):
            sent.append(("Content-Type", "application/json"))
        async with asyncio.timeout(HANG_S):
            async with self.client.request(method, path, data=data, headers=sent) as resp:
                return Sent(resp.status, resp.headers, await resp.read())

    async def keyed(self, who: str, path: str, key: str, body: Any = None, **more: Any) -> Sent:
        headers = [("Idempotency-Key", key), *more.pop("headers", [])]
        return await self.send(who, "POST", path, headers=headers,
                               body={"n": 1} if body is None else body, **more)  # fmt: skip

    async def lease(self, task_id: str) -> list[tuple[str, str]]:
        """A worker's lease on a new task: its ``Fence-*`` headers (slot ``s1``)."""
        put = await self.send("w", "PUT", f"/v1/tasks/{task_id}", body={"inputDigest": "i"})
        assert put.status in (200, 201), put.body
        epoch = (await self.send("w", "GET", "/v1/epoch")).json["schedulerEpoch"]
        claim_body = {"owner": "w", "ttlMs": 30_000, "schedulerEpoch": epoch}
        claim = await self.send("w", "POST", f"/v1/tasks/{task_id}/claim", body=claim_body)
        assert claim.status == 200, claim.body
        c = claim.json
        return [
            ("Fence-Task", task_id),
            ("Fence-Attempt", c["attemptId"]),
            ("Fence-Generation", str(c["claimGeneration"])),
            ("Fence-Epoch", str(c["schedulerEpoch"])),
            ("Fence-Cancel", str(c["cancelGeneration"])),
            ("Fence-Slot", "s1"),
        ]

    async def mcp(
        self,
        who: str,
        downstream: str,
        message: dict[str, Any],
        headers: list[tuple[str, str]] | None = None,
    ) -> Sent:
        return await self.send(who, "POST", f"/mcp/{downstream}", body=message,
                               headers=headers)  # fmt: skip

    async def effects(self, **query: str) -> list[dict[str, Any]]:
        """The ledger as an operator lists it."""
        listed = await self.client.get(
            "/v1/effects",
            params=query,
            headers={"Fence-Authorization": f"Bearer {PRINCIPALS['ops'][0]}"},
        )
        assert listed.status == 200, await listed.text()
        found: list[dict[str, Any]] = (await listed.json())["effects"]
        return found


def tool_call(name: str, meta: dict[str, Any] | None = None, call_id: int = 1) -> dict[str, Any]:
    params: dict[str, Any] = {"name": name, "arguments": {"amount": 5}}
    if meta is not None:
        params["_meta"] = meta
    return {"jsonrpc": "2.0", "id": call_id, "method": "tools/call", "params": params}


def _principals() -> list[dict[str, Any]]:
    return [
        {"name": name, "roles": roles, "token_sha256": token_sha256(token), **more}
        for name, (token, roles, more) in PRINCIPALS.items()
    ]


@pytest.fixture
async def mcp_server() -> AsyncIterator[CountingMcp]:
    server = await CountingMcp().start()
    yield server
    if server.gate is not None:
        server.gate.set()
    assert server.runner is not None
    await server.runner.cleanup()


@pytest.fixture
async def gw(
    store_url: str, key_prefix: str, downstream: Downstream, mcp_server: CountingMcp
) -> AsyncIterator[Gateway]:
    url = downstream.url
    config = make_config(
        store_url,
        key_prefix,
        downstreams=[
            {"name": "pay", "url": url, "client_idempotency_keys": "optional"},
            {"name": "other", "url": url, "client_idempotency_keys": "optional"},
            {
                "name": "custom",
                "url": url,
                "client_idempotency_keys": "optional",
                "idempotency_key_header": "X-Idem",
                "fencing_token_header": "X-Fence",
            },
            {
                "name": "tools",
                "url": mcp_server.url,
                "adapter": "mcp",
                "timeout_ms": 10_000,
                "client_idempotency_keys": "optional",
                "tools": {READ_TOOL: {"kind": "read_only"}},
            },
            {
                "name": "gated",
                "url": url,
                "adapter": "manual",
                "require_approval": True,
                "client_idempotency_keys": "optional",
            },
            {
                "name": "held",
                "url": mcp_server.base,
                "timeout_ms": 10_000,
                "client_idempotency_keys": "optional",
            },
        ],
        proxy={
            "prepared_margin_ms": 20_000,
            "forward_start_limit_ms": 10_000,
            "max_prefer_wait_ms": 600_000,
        },
        tasks={"max_waiters": 10, "max_waiters_per_principal": 2},
        reconciler={"enabled": False},
        auth={"principals": _principals()},
    )
    store = freeze_store_clock(build_test_store(config))
    app = create_app(config, store=store, forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Gateway(client)


def _eid(principal: str, downstream: str, key: str) -> str:
    return keyed_effect_id(principal, downstream, key)


# --- another principal's keyed effect: never reached -----------------------------------------


async def test_a_client_cannot_replay_read_probe_or_settle_another_clients_effect(
    gw: Gateway, downstream: Downstream
) -> None:
    """bob knows alice's key and computes her effectId (the formula is public): every way
    in is refused, and his own calls with that key, or with her id as a key, are his."""
    first = await gw.keyed("alice", "/proxy/pay/ok/charge", "order-1")
    assert first.status == 200, first.body
    theirs = _eid("alice", "pay", "order-1")
    assert first.headers["Fence-Effect-Id"] == theirs
    # Her key, and her effectId as a key: two fresh effects of his, each run once.
    for key in ("order-1", theirs):
        mine = await gw.keyed("bob", "/proxy/pay/ok/charge", key)
        assert mine.status == 200 and mine.headers["Fence-Replayed"] == "false", mine.body
        assert "Idempotent-Replayed" not in mine.headers
        assert mine.headers["Fence-Effect-Id"] == _eid("bob", "pay", key) != theirs
    assert len(downstream.calls("/ok/charge")) == 3
    refused = [
        ("GET", "/v1/effects?idempotencyKey=order-1&principal=alice", None),
        ("GET", "/v1/effects?idempotencyKey=order-1&principal=ALICE", None),
        ("GET", "/v1/effects?idempotencyKey=order-1&principal=alice%20", None),
        ("GET", "/v1/effects", None),
        ("GET", "/v1/effects?downstream=pay", None),
        ("GET", "/v1/effects?state=COMMITTED", None),
        ("GET", "/v1/effects?awaitingApproval=true", None),
        ("GET", f"/v1/effects/{theirs}", None),
        ("GET", f"/v1/effects/{theirs[:12]}", None),  # the prefix search
        ("POST", f"/v1/effects/{theirs}/reconcile", None),
        ("POST", f"/v1/effects/{theirs}/resolve", {"outcome": "NOT_APPLIED", "note": "x"}),
        ("POST", f"/v1/effects/{theirs}/approve", {}),
        ("GET", "/v1/events", None),
        ("GET", "/v1/tasks", None),
        ("GET", "/v1/epoch", None),
        ("GET", "/metrics", None),
        ("GET", "/console", None),
        ("GET", f"/console/effects/{theirs}", None),
    ]
    for method, path, body in refused:
        got = await gw.send("bob", method, path, body=body)
        assert got.status == 403, (method, path, got.status, got.body[:300])
        # The refusal names the request (its path, never its query): nothing more of hers.
        told = got.body.decode(errors="replace").replace(path.split("?")[0], "")
        assert theirs not in told and "order-1" not in told, (method, path, told)
    # His own look-up by that key finds his effect only; naming himself, the same.
    for query in ("idempotencyKey=order-1", "idempotencyKey=order-1&principal=bob"):
        own = await gw.send("bob", "GET", f"/v1/effects?{query}")
        assert own.status == 200, own.body
        assert [e["effectId"] for e in own.json["effects"]] == [_eid("bob", "pay", "order-1")]
        assert own.json["effects"][0]["principal"] == "bob"
    # A repeated principal: the first one is the one checked and the one looked up.
    twice = await gw.send("bob", "GET", "/v1/effects?idempotencyKey=order-1"
                          "&principal=bob&principal=alice")  # fmt: skip
    assert theirs not in twice.body.decode()
    twice = await gw.send("bob", "GET", "/v1/effects?idempotencyKey=order-1"
                          "&principal=alice&principal=bob")  # fmt: skip
    assert twice.status == 403 and theirs not in twice.body.decode()
    # alice's record is as she left it: committed, one attempt, nobody else's.
    (record,) = [e for e in await gw.effects() if e["effectId"] == theirs]
    assert record["state"] == "COMMITTED" and record["principal"] == "alice"
    assert len(record["attempts"]) == 1


@pytest.mark.one_store
async def test_a_client_cannot_log_in_to_the_console(gw: Gateway) -> None:
    origin = f"http://127.0.0.1:{gw.client.port}"
    async with gw.client.post(
        "/console/login",
        data={"token": PRINCIPALS["alice"][0]},
        headers={"Origin": origin},
        allow_redirects=False,
    ) as resp:
        assert resp.status == 403, await resp.text()
        assert "Set-Cookie" not in resp.headers


# --- the lease and the key: one kind of call each --------------------------------------------


@pytest.mark.one_store
@pytest.mark.parametrize(
    "lease",
    [
        [("fence-task", "t")],
        [("FENCE-SLOT", "s1")],
        [("Fence-Node", "main")],
        [("Fence-Epoch", "1"), ("Fence-Epoch", "2")],
        [("Fence-Operator", "me")],
        [("Fence-Authorization", "Bearer tok-bob-redteam-0123456789")],  # a second credential
    ],
)
async def test_a_client_sending_any_fence_header_is_refused_before_anything(
    gw: Gateway, downstream: Downstream, lease: list[tuple[str, str]]
) -> None:
    sent = await gw.keyed("alice", "/proxy/pay/ok/charge", "k-fence", headers=lease)
    assert sent.status in (401, 403), sent.body
    assert sent.headers["Fence-Effect-State"] == "NONE"
    assert not downstream.received
    assert await gw.effects() == []


@pytest.mark.one_store
async def test_a_client_cannot_ride_a_workers_lease(gw: Gateway, downstream: Downstream) -> None:
    """alice holds a copy of the worker's live lease headers: 403 with or without a key, and
    the worker's fence is untouched (its own call goes through after)."""
    lease = await gw.lease("t-victim")
    for key in ([("Idempotency-Key", "k")], []):
        for method in ("POST", "GET"):
            sent = await gw.send("alice", method, "/proxy/pay/ok/x", headers=lease + key,
                                 body={"n": 1} if method == "POST" else None)  # fmt: skip
            assert sent.status == 403 and sent.code == "FORBIDDEN", sent.body
    assert not downstream.received and await gw.effects() == []
    own = await gw.send("w", "POST", "/proxy/pay/ok/x", headers=lease, body={"n": 1})
    assert own.status == 200, own.body
    assert len(downstream.received) == 1


@pytest.mark.one_store
@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "GET"])
@pytest.mark.parametrize("key", ["k-w", "", '"k-w"', "a b"])
async def test_a_worker_dropping_its_fence_for_a_key_is_refused(
    gw: Gateway, downstream: Downstream, method: str, key: str
) -> None:
    """Whatever the key (malformed ones too) and the method: 403, nothing recorded or sent."""
    sent = await gw.send("w", method, "/proxy/pay/ok/x", headers=[("Idempotency-Key", key)],
                         body={"n": 1} if method != "GET" else None)  # fmt: skip
    assert sent.status == 403 and sent.code == "FORBIDDEN", sent.body
    assert not downstream.received
    assert await gw.effects() == []


@pytest.mark.one_store
async def test_a_keyed_forward_carries_the_effect_id_never_the_clients_key_or_a_token(
    gw: Gateway, downstream: Downstream
) -> None:
    """The client forges every identity header the downstream reads (its key header, its
    fencing-token header, both under their default and configured names, in odd casings):
    the downstream gets the effectId in its key header and no fencing token at all."""
    forged = [
        ("idempotency-key", "client-key"),
        ("X-IDEM", "forged-id"),
        ("fencing-token", "999.999"),
        ("x-fence", "999.999"),
    ]
    for name in ("pay", "custom"):
        sent = await gw.send("alice", "POST", f"/proxy/{name}/ok/x", headers=forged,
                             body={"n": 1})  # fmt: skip
        assert sent.status == 200, sent.body
    pay, custom = downstream.calls("/ok/x")
    assert pay.headers["Idempotency-Key"] == _eid("alice", "pay", "client-key")
    assert custom.headers["X-Idem"] == _eid("alice", "custom", "client-key")
    # Each downstream's own fencing-token header is gone (the other name means nothing to it).
    for call, token in ((pay, "fencing-token"), (custom, "x-fence")):
        names = {n.lower() for n in call.headers}
        assert token not in names, call.headers
        assert "client-key" not in json.dumps(call.headers)
        assert not [n for n in names if n.startswith("fence")]
    assert "idempotency-key" not in {n.lower() for n in custom.headers}


@pytest.mark.one_store
async def test_underscore_spellings_of_identity_headers_never_reach_the_downstream(
    gw: Gateway, downstream: Downstream
) -> None:
    """A keyed call sends ``Idempotency_Key: <bob's effectId>``, ``Fencing_Token`` and
    ``Fence_Task``: servers that map header names to ``HTTP_IDEMPOTENCY_KEY`` (CGI, WSGI, PHP,
    Rack) would see two values for the key header, one the client chose, and a fencing token
    on a call that has none. The gateway drops them as it drops the hyphenated names (a
    red-team pass found them passed on)."""
    bobs = _eid("bob", "pay", "order-1")
    forged = [("Idempotency_Key", bobs), ("Fencing_Token", "999.999"), ("fence_task", "t")]
    sent = await gw.keyed("alice", "/proxy/pay/ok/x", "mine", headers=forged)
    assert sent.status == 200, sent.body
    (call,) = downstream.received
    names = {n.lower().replace("_", "-") for n in call.headers}
    assert "fencing-token" not in names and "fence-task" not in names, call.headers
    assert bobs not in json.dumps(call.headers), call.headers
    assert [v for n, v in call.headers.items() if n.lower() == "idempotency-key"] == [
        _eid("alice", "pay", "mine")
    ]


# --- smuggling the key --------------------------------------------------------------------------


@pytest.mark.one_store
@pytest.mark.parametrize(
    "values",
    [
        ["a", "b"],  # two fields
        ["a", "a"],  # two equal fields: still two
        ["a, b"],  # a list in one field
        ['"a", "b"'],
        ['"a\\x"'],  # an escape RFC 8941 does not have
        ['"a\\'],
        ['"a"b"'],
        ['""'],
        [""],
        ["   "],
        ["x" * 256],
        [f'"{"x" * 256}"'],
        ['"' + "\\\\" * 128 + '"'],  # 256 characters, 128 once decoded: fine... see below
        ["k\u00e9"],  # non-ASCII, as Latin-1 on the wire
        ['"a";b=1'],  # sf parameters: not in the grammar
        ["tab\there"],
    ],
)
async def test_a_smuggled_key_is_400_and_nothing_is_recorded_or_sent(
    gw: Gateway, downstream: Downstream, values: list[str]
) -> None:
    headers = [("Idempotency-Key", v) for v in values]
    if values == ['"' + "\\\\" * 128 + '"']:  # 128 backslashes: a valid key
        sent = await gw.send("alice", "POST", "/proxy/pay/ok/x", headers=headers, body={})
        assert sent.status == 200, sent.body
        assert sent.headers["Fence-Effect-Id"] == _eid("alice", "pay", "\\" * 128)
        return
    try:
        sent = await gw.send("alice", "POST", "/proxy/pay/ok/x", headers=headers, body={})
    except ValueError:  # the client library will not send it: nor will anything else then
        return
    assert sent.status == 400 and sent.code == "BAD_REQUEST", (values, sent.status, sent.body)
    assert "Idempotency-Key" in sent.json["detail"]
    assert not downstream.received
    assert await gw.effects() == []


@pytest.mark.one_store
async def test_an_obs_folded_or_latin1_key_on_the_wire_never_becomes_an_effect(
    gw: Gateway, downstream: Downstream
) -> None:
    """Raw bytes aiohttp's client would not send: an obs-fold continuation line (which some
    parsers join into ``a b``, others into ``ab``) and a Latin-1 octet."""
    host, port = "127.0.0.1", gw.client.port
    token = PRINCIPALS["alice"][0]
    for field_bytes in (b"Idempotency-Key: a\r\n b\r\n", b"Idempotency-Key: caf\xe9\r\n",
                        b"Idempotency-Key: a\x00b\r\n", b"Idempotency-Key : a\r\n"):  # fmt: skip
        reader, writer = await asyncio.open_connection(host, port)
        request = (
            b"POST /proxy/pay/ok/fold HTTP/1.1\r\nContent-Type: application/json\r\n"
            + f"Host: {host}:{port}\r\nFence-Authorization: Bearer {token}\r\n".encode()
            + field_bytes
            + b"Content-Length: 2\r\nConnection: close\r\n\r\n{}"
        )
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(HANG_S):
            answer = await reader.read()
        writer.close()
        status = int(answer.split(b" ", 2)[1])
        assert status == 400, (field_bytes, answer[:400])
    assert not downstream.calls("/ok/fold")
    assert await gw.effects() == []


@pytest.mark.one_store
async def test_equal_keys_in_both_forms_are_one_effect_and_the_quoted_form_is_no_other_key(
    gw: Gateway, downstream: Downstream
) -> None:
    """``abc`` and ``"abc"`` are one key; ``"\\"abc\\""`` (quotes inside) is another; a key
    with surrounding spaces is trimmed as the field value is (RFC 9110 5.5)."""
    for value in ("abc", '"abc"', " abc ", '\t"abc"'):
        sent = await gw.send("alice", "POST", "/proxy/pay/ok/k", body={"n": 1},
                             headers=[("Idempotency-Key", value)])  # fmt: skip
        assert sent.status == 200, (value, sent.body)
        assert sent.headers["Fence-Effect-Id"] == _eid("alice", "pay", "abc"), value
    quoted = await gw.send("alice", "POST", "/proxy/pay/ok/k", body={"n": 1},
                           headers=[("Idempotency-Key", '"\\"abc\\""')])  # fmt: skip
    assert quoted.headers["Fence-Effect-Id"] == _eid("alice", "pay", '"abc"')
    assert len(downstream.calls("/ok/k")) == 2


@pytest.mark.one_store
async def test_one_key_on_two_downstreams_is_two_effects(
    gw: Gateway, downstream: Downstream
) -> None:
    a = await gw.keyed("alice", "/proxy/pay/ok/d", "same")
    b = await gw.keyed("alice", "/proxy/other/ok/d", "same")
    assert a.status == b.status == 200
    assert b.headers["Fence-Replayed"] == "false"
    assert len(downstream.calls("/ok/d")) == 2


@pytest.mark.one_store
async def test_a_replay_never_serves_another_path_or_method_under_one_key(
    gw: Gateway, downstream: Downstream
) -> None:
    """The payload digest covers the method and the path: the same key sent to read another
    resource's stored answer (a GET with a key is unrecorded; a POST elsewhere is 422)."""
    first = await gw.keyed("alice", "/proxy/pay/ok/secret", "k-path", body={"n": 1})
    assert first.status == 200
    elsewhere = await gw.keyed("alice", "/proxy/pay/ok/other", "k-path", body={"n": 1})
    assert elsewhere.status == 422 and elsewhere.code == "PAYLOAD_CONFLICT", elsewhere.body
    put = await gw.send("alice", "PUT", "/proxy/pay/ok/secret", body={"n": 1},
                        headers=[("Idempotency-Key", "k-path")])  # fmt: skip
    assert put.status == 422, put.body
    read = await gw.send("alice", "GET", "/proxy/pay/ok/secret",
                         headers=[("Idempotency-Key", "k-path")])  # fmt: skip
    assert read.status == 200 and read.headers["Fence-Replayed"] == "false"
    assert "Idempotent-Replayed" not in read.headers
    assert len(downstream.calls("/ok/secret")) == 2  # the POST and the unrecorded GET
    assert not downstream.calls("/ok/other")


# --- scope and limits ---------------------------------------------------------------------------


@pytest.mark.one_store
async def test_a_scoped_client_cannot_key_a_call_outside_its_downstreams(
    gw: Gateway, downstream: Downstream, mcp_server: CountingMcp
) -> None:
    inside = await gw.keyed("carol", "/proxy/pay/ok/s", "k-scope")
    assert inside.status == 200, inside.body
    for path in ("/proxy/other/ok/s", "/proxy/%6fther/ok/s", "/proxy/Other/ok/s"):
        outside = await gw.keyed("carol", path, "k-scope")
        assert outside.status in (403, 404), (path, outside.body)
    mcp = await gw.mcp("carol", "tools", tool_call(PAY_TOOL, {KEY_META: "k-scope"}))
    assert mcp.status == 403, mcp.body
    assert len(downstream.calls("/ok/s")) == 1
    assert not mcp_server.messages
    assert [e["downstream"] for e in await gw.effects()] == ["pay"]


@pytest.mark.one_store
async def test_the_rate_limit_counts_keyed_calls_and_replays(
    gw: Gateway, downstream: Downstream
) -> None:
    """A burst of 3: a replay costs as much as a first call, and the 4th call is 429 with
    nothing recorded or sent (a client cannot hammer the store through replays)."""
    answers = [await gw.keyed("slow", "/proxy/pay/ok/r", "k-rate") for _ in range(3)]
    assert [a.status for a in answers] == [200, 200, 200]
    over = await gw.keyed("slow", "/proxy/pay/ok/r", "k-new")
    assert over.status == 429 and over.code == "RATE_LIMITED", over.body
    assert over.headers["Fence-Effect-State"] == "NONE"
    assert len(downstream.calls("/ok/r")) == 1
    assert [e["idempotencyKey"] for e in await gw.effects()] == ["k-rate"]


# --- Prefer: wait ---------------------------------------------------------------------------


@pytest.mark.one_store
async def test_waiting_is_bounded_per_principal_and_only_on_ones_own_effect(
    gw: Gateway, mcp_server: CountingMcp
) -> None:
    """alice's call is held at the downstream. bob sends her key with a huge wait and hits
    only his own effect: a fresh forward, never a wait on hers. alice's own duplicates wait
    (a huge N is bounded to ``max_prefer_wait_ms``), past 2 per principal 503, and no
    waiter is left once it is over."""
    mcp_server.gate = asyncio.Event()
    path = "/proxy/held/held"
    first = asyncio.create_task(gw.keyed("alice", path, "k-wait"))
    await until(lambda: mcp_server.held == 1, "alice's call in flight")
    huge = [("Prefer", "wait=999999999999999999999")]
    bobs = asyncio.create_task(gw.keyed("bob", path, "k-wait", headers=huge))
    await until(lambda: mcp_server.held == 2, "bob's own call in flight")
    assert gw.client.app[EVENTS].waiters == 0
    waiters = [asyncio.create_task(gw.keyed("alice", path, "k-wait", headers=huge))
               for _ in range(2)]  # fmt: skip
    await until(lambda: gw.client.app[EVENTS].waiters == 2, "two waiters")
    third = await gw.keyed("alice", path, "k-wait", headers=huge)
    assert third.status == 503 and third.code == "TOO_MANY_CONNECTIONS", third.body
    mcp_server.gate.set()
    one, two = await first, await bobs
    assert one.status == two.status == 200, (one.body, two.body)
    assert two.headers["Fence-Replayed"] == "false" and "Preference-Applied" not in two.headers
    for waited in await asyncio.gather(*waiters):
        assert waited.status == 200 and waited.headers["Idempotent-Replayed"] == "true"
        assert waited.headers["Preference-Applied"] == "wait=600"  # bounded, not 10^21
        assert waited.body == one.body
    assert mcp_server.held == 2  # alice's once, bob's once
    assert gw.client.app[EVENTS].waiters == 0


# --- MCP ----------------------------------------------------------------------------------------


@pytest.mark.one_store
async def test_mcp_a_client_cannot_replay_another_clients_call_or_forge_identity(
    gw: Gateway, mcp_server: CountingMcp
) -> None:
    """bob sends alice's key, her effectId under both prefixes, a fencing token and a slot:
    his own effect, and the server sees only the gateway's names (both spellings), the
    effectId his key gives, and no fencing token."""
    theirs = _eid("alice", "tools", "k-m")
    first = await gw.mcp("alice", "tools", tool_call(PAY_TOOL, {KEY_META: "k-m"}))
    assert first.status == 200 and "result" in first.json, first.body
    forged = {
        KEY_META: "k-m",
        "dev.fencegate/effectId": theirs,
        "fencegate/effectId": theirs,
        "dev.fencegate/fencingToken": "9.9",
        "fencegate/fencingToken": "9.9",
        "dev.fencegate/slot": "s",
        "dev.fencegate/replayed": True,
        "dev.fencegate/anythingElse": "x",
        "fencegate/other": "y",
        "vendor/kept": "z",
    }
    bobs = await gw.mcp("bob", "tools", tool_call(PAY_TOOL, forged, call_id=2))
    assert bobs.status == 200 and "result" in bobs.json, bobs.body
    assert not (bobs.json["result"].get("_meta") or {}).get("dev.fencegate/replayed")
    first_sent, bob_sent = mcp_server.calls()
    for sent, who in ((first_sent, "alice"), (bob_sent, "bob")):
        meta = sent["params"]["_meta"]
        ours = {k: v for k, v in meta.items() if k.startswith(("dev.fencegate/", "fencegate/"))}
        expected = _eid(who, "tools", "k-m")
        assert ours == {"dev.fencegate/effectId": expected, "fencegate/effectId": expected}
    assert bob_sent["params"]["_meta"]["vendor/kept"] == "z"
    assert len(mcp_server.calls()) == 2


@pytest.mark.one_store
@pytest.mark.parametrize(
    "meta",
    [
        {KEY_META: "a", OLD_KEY_META: "b"},
        {"dev.fencegate/wait": 1, "fencegate/wait": 2},
        {"dev.fencegate/slot": "a", "fencegate/slot": "b"},
        {KEY_META: None},
        {KEY_META: 7},
        {KEY_META: ["a"]},
        {KEY_META: ""},
        {KEY_META: "a b"},
        {KEY_META: "x" * 256},
        {KEY_META: "caf\u00e9"},
        {OLD_KEY_META: None},
        {"Dev.Fencegate/idempotencyKey": "a"},  # folds into the gateway's prefix
        {"dev.fencegate/IdempotencyKey": "a"},
    ],
)
async def test_mcp_a_bad_or_conflicting_key_is_refused_before_anything(
    gw: Gateway, mcp_server: CountingMcp, meta: dict[str, Any]
) -> None:
    sent = await gw.mcp("alice", "tools", tool_call(PAY_TOOL, meta))
    error = sent.json.get("error")
    assert error is not None and error["code"] in (-32600, -32602, -32000), sent.body
    assert not mcp_server.calls()
    assert await gw.effects() == []


@pytest.mark.one_store
async def test_mcp_a_lease_less_session_reaches_only_what_a_client_may(
    gw: Gateway, mcp_server: CountingMcp
) -> None:
    """initialize and tools/list go through; resources, prompts, completions, a response to
    the server and the GET stream do not; a read-only tool's call carries none of the
    gateway's names, whatever the client forged."""
    forged_list = {"dev.fencegate/effectId": "e" * 64, "fencegate/fencingToken": "9.9"}
    ok = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": forged_list}}
    listed = await gw.mcp("alice", "tools", ok)
    assert listed.status == 200 and "result" in listed.json, listed.body
    assert mcp_server.messages[-1]["params"]["_meta"] == {}  # the forged names dropped
    relayed = len(mcp_server.messages)
    methods = ("resources/read", "resources/list", "prompts/get", "prompts/list",
               "completion/complete", "logging/setLevel", "sampling/createMessage")  # fmt: skip
    for method in methods:
        message = {"jsonrpc": "2.0", "id": 2, "method": method, "params": {"uri": "file:///x"}}
        refused = await gw.mcp("alice", "tools", message)
        assert "error" in refused.json, (method, refused.body)
    response = {"jsonrpc": "2.0", "id": 9, "result": {}}
    assert "error" in (await gw.mcp("alice", "tools", response)).json
    assert len(mcp_server.messages) == relayed
    stream = await gw.send("alice", "GET", "/mcp/tools",
                           headers=[("Accept", "text/event-stream")])  # fmt: skip
    assert stream.status == 405, stream.body
    forged = {"dev.fencegate/effectId": "f" * 64, "fencegate/fencingToken": "9.9", KEY_META: "k"}
    read = await gw.mcp("alice", "tools", tool_call(READ_TOOL, forged, call_id=3))
    assert read.status == 200 and "result" in read.json, read.body
    (sent,) = mcp_server.calls()
    meta = sent["params"].get("_meta") or {}
    assert not [k for k in meta if k.startswith(("dev.fencegate/", "fencegate/"))], meta
    assert await gw.effects() == []  # a read is unrecorded


@pytest.mark.one_store
async def test_mcp_a_client_cannot_send_a_lease_nor_a_worker_a_key(
    gw: Gateway, mcp_server: CountingMcp
) -> None:
    lease = await gw.lease("t-mcp")
    for who, headers, meta in (
        ("alice", lease, {KEY_META: "k"}),
        ("alice", lease, None),
        ("alice", [("fence-slot", "s1")], {KEY_META: "k"}),
        ("w", [], {KEY_META: "k"}),
        ("w", [], {OLD_KEY_META: "k"}),
    ):
        sent = await gw.mcp(who, "tools", tool_call(PAY_TOOL, meta), headers=headers)
        assert (
            sent.status == 403
            or sent.json.get("error", {}).get("data", {}).get("code") == "FORBIDDEN"
        ), (who, headers, meta, sent.body)
    assert not mcp_server.messages
    assert await gw.effects() == []


@pytest.mark.one_store
async def test_mcp_a_client_cannot_wait_on_another_clients_call(
    gw: Gateway, mcp_server: CountingMcp
) -> None:
    """alice's call is held at the server; bob names her key with ``wait``: his own call
    runs at once (no waiter), and hers is never answered with his result."""
    mcp_server.gate = asyncio.Event()
    first = asyncio.create_task(gw.mcp("alice", "tools", tool_call(PAY_TOOL, {KEY_META: "kw"})))
    await until(lambda: len(mcp_server.calls()) == 1, "alice's call at the server")
    bobs = asyncio.create_task(
        gw.mcp("bob", "tools", tool_call(PAY_TOOL, {KEY_META: "kw", "dev.fencegate/wait": 1e300}))
    )
    await until(lambda: len(mcp_server.calls()) == 2, "bob's own call at the server")
    assert gw.client.app[EVENTS].waiters == 0
    mcp_server.gate.set()
    one, two = await first, await bobs
    assert "result" in one.json and "result" in two.json, (one.body, two.body)
    assert len(mcp_server.calls()) == 2


@pytest.mark.one_store
@pytest.mark.parametrize("value", ["a,b", "a;b=1", "*", "../a"])
async def test_a_bare_key_with_separators_is_that_literal_key(
    gw: Gateway, downstream: Downstream, value: str
) -> None:
    """The grammar takes any visible ASCII bare (issue 28): ``a,b`` is one key ``a,b`` (not
    ``a`` nor ``b``, nor a list), ``a;b=1`` is no key ``a`` with a parameter; each is its own
    effect, and the downstream gets only its effectId."""
    for key in ("a", "b", value):
        sent = await gw.keyed("alice", "/proxy/pay/ok/lit", key)
        assert sent.status == 200, (key, sent.body)
        assert sent.headers["Fence-Replayed"] == "false", key
        assert sent.headers["Fence-Effect-Id"] == _eid("alice", "pay", key)
    assert len(downstream.calls("/ok/lit")) == 3
    assert downstream.calls("/ok/lit")[-1].headers["Idempotency-Key"] == _eid("alice", "pay", value)


@pytest.mark.one_store
async def test_a_keyed_effect_awaiting_approval_is_approved_by_another_operator_only(
    gw: Gateway, downstream: Downstream
) -> None:
    """``oc`` is client and operator: its keyed call waits for approval, and it may not
    approve it itself (the effect was requested under its principal); a plain client may
    not approve at all; another operator may, and the retry then runs once."""
    asked = await gw.keyed("oc", "/proxy/gated/ok/mail", "k-appr")
    assert asked.status == 409 and asked.code == "APPROVAL_REQUIRED", asked.body
    effect_id = asked.headers["Fence-Effect-Id"]
    assert effect_id == _eid("oc", "gated", "k-appr")
    (record,) = await gw.effects()
    digest = {"approvalDigest": record["approvalDigest"]}
    for who in ("oc", "alice"):
        refused = await gw.send(who, "POST", f"/v1/effects/{effect_id}/approve", body=digest)
        assert refused.status == 403, (who, refused.body)
    resolved = await gw.send("alice", "POST", f"/v1/effects/{effect_id}/resolve",
                             body={"outcome": "COMMITTED", "note": "x"})  # fmt: skip
    assert resolved.status == 403
    assert not downstream.received
    approved = await gw.send("ops", "POST", f"/v1/effects/{effect_id}/approve", body=digest)
    assert approved.status == 200, approved.body
    # bob, with the same key, is not let through by oc's approval.
    bobs = await gw.keyed("bob", "/proxy/gated/ok/mail", "k-appr")
    assert bobs.status == 409 and bobs.code == "APPROVAL_REQUIRED", bobs.body
    ran = await gw.keyed("oc", "/proxy/gated/ok/mail", "k-appr")
    assert ran.status == 200, ran.body
    again = await gw.keyed("oc", "/proxy/gated/ok/mail", "k-appr")
    assert again.status == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert len(downstream.calls("/ok/mail")) == 1


@pytest.mark.one_store
async def test_the_event_stream_names_a_keyed_effect_by_id_never_its_key(
    gw: Gateway, downstream: Downstream
) -> None:
    """A client cannot open ``/v1/events`` (403, above); a scheduler that can sees a keyed
    effect's id, state and downstream, never the client's key (which may name an order or a
    customer) nor the client's request."""
    headers = {"Fence-Authorization": f"Bearer {PRINCIPALS['w'][0]}"}
    async with asyncio.timeout(HANG_S):
        async with gw.client.get("/v1/events", headers=headers) as stream:
            assert stream.status == 200
            sent = await gw.keyed("alice", "/proxy/pay/ok/ev", "secret-order-77",
                                  body={"card": "4242"})  # fmt: skip
            effect_id = sent.headers["Fence-Effect-Id"]
            seen: list[dict[str, Any]] = []
            while not any(e.get("state") == "COMMITTED" for e in seen):
                line = (await stream.content.readline()).decode()
                if line.startswith("data: "):
                    seen.append(json.loads(line.removeprefix("data: ")))
    mine = [e for e in seen if e.get("effectId") == effect_id]
    assert mine and all(e["type"] == "effect" for e in mine)
    text = json.dumps(seen)
    assert "secret-order-77" not in text and "4242" not in text
    assert len(downstream.calls("/ok/ev")) == 1


@pytest.mark.one_store
@pytest.mark.parametrize(
    ("method", "path", "headers"),
    [
        ("GET", "/proxy/pay/ok/mo", [("X-HTTP-Method-Override", "POST")]),
        ("GET", "/proxy/pay/ok/mo?_method=DELETE", []),
        ("HEAD", "/proxy/pay/ok/mo", [("x-method-override", "PUT")]),
    ],
)
async def test_a_lease_less_read_cannot_become_an_unrecorded_mutation(
    gw: Gateway, downstream: Downstream, method: str, path: str, headers: list[tuple[str, str]]
) -> None:
    """A client's safe method goes unrecorded (no key needed): one that asks the downstream
    to run it as a mutation is refused, key or not, nothing sent."""
    for key in ([], [("Idempotency-Key", "k-mo")]):
        sent = await gw.send("alice", method, path, headers=headers + key)
        assert sent.status == 400, (key, sent.status, sent.body)
    assert not downstream.received
