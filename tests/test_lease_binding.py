"""Leases bound to their holder, and two people for a non-replayable effect (issue 11, item 2),
through the HTTP app on both stores.

The authentication middleware is not what is tested here: a tiny test-only middleware takes
the principal from an ``X-Test-Principal`` header and sets it where ``gateway/auth.py``
does (``PRINCIPAL_KEY``), so these tests pin the rules that use the principal: a claim records
it, renew / release / commit / proxied calls from another principal are ``409 FENCED`` (the
downstream receives nothing), operators are named by their principal, and an operator may not
approve an effect requested under their own principal (``403 FORBIDDEN``). Without a
principal everything works as before.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.config import Config
from fencegate.gateway.principals import PRINCIPAL_KEY, Principal
from fencegate.ledger.errors import CLAIM_REFUSED_CODES
from tests.api import Answer, Api, Lease
from tests.clocks import still
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.test_proxy import Sent, fence_headers

TEST_PRINCIPAL = "X-Test-Principal"
#: "Could not start in time" is tests/test_forward_window.py's story: with the forward clock
#: standing still (``still``) and the start limit (a real-time bound on the pool wait and
#: connect) 10 s off, a loaded machine's slow prepare or connect cannot trip it.
FAR_START_LIMIT = {"prepared_margin_ms": 20_000, "forward_start_limit_ms": 10_000}
OTHER = "the lease belongs to another principal"


@web.middleware
async def principal_from_test_header(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Test only: the principal named by ``X-Test-Principal``, as the auth middleware would
    set it (every role: roles are not what these tests are about)."""
    name = request.headers.get(TEST_PRINCIPAL)
    if name:
        request[PRINCIPAL_KEY] = Principal(name, frozenset({"worker", "operator"}))
    return await handler(request)


@pytest.fixture
def binding_config(store_url: str, key_prefix: str, downstream: Downstream) -> Config:
    common = {"url": downstream.url}  # the default timeout_ms: no story here times out
    return make_config(
        store_url,
        key_prefix,
        downstreams=[  # type: ignore[arg-type]
            {"name": "api", **common},
            {
                "name": "mail",
                "adapter": "manual",
                "require_approval": True,
                "approval_ttl_ms": 60_000,
                **common,
            },
        ],
        proxy=FAR_START_LIMIT,
        reconciler={"enabled": False},
    )


@pytest.fixture
async def client(binding_config: Config) -> AsyncIterator[TestClient[Any, Any]]:
    app = create_app(binding_config, store=build_test_store(binding_config), forward_clock=still)
    app.middlewares.insert(0, principal_from_test_header)  # before the app starts (frozen)
    async with TestClient(TestServer(app, host="127.0.0.1")) as test_client:
        yield test_client


class As(Api):
    """The coordination and ledger APIs called as one principal (None: no principal)."""

    def __init__(self, client: TestClient[Any, Any], principal: str | None, **headers: str):
        super().__init__(client)
        self.headers = dict(headers)
        if principal is not None:
            self.headers[TEST_PRINCIPAL] = principal

    async def call(self, method: str, path: str, json: Any = None, data: Any = None) -> Answer:
        async with self.client.request(
            method, path, json=json, data=data, headers=self.headers
        ) as resp:
            body = await resp.json(content_type=None) if await resp.read() else None
            return Answer(resp.status, body, resp.content_type)

    async def send(
        self,
        lease: Lease,
        target: str = "api/ok/pay",
        *,
        method: str = "POST",
        body: Any = None,
        slot: str | None = "s1",
    ) -> Sent:
        headers = {**fence_headers(lease, slot if method != "GET" else None), **self.headers}
        async with self.client.request(
            method, f"/proxy/{target}", json=body, headers=headers
        ) as resp:
            return Sent(resp.status, resp.headers, await resp.read())


def fenced_by_principal(answer: Answer | Sent, holder: str) -> None:
    """409 FENCED saying the lease is another principal's, without naming that principal."""
    assert answer.status == 409, answer
    body = answer.body if isinstance(answer, Answer) else answer.json
    assert body["code"] == "FENCED" and body["code"] in CLAIM_REFUSED_CODES
    assert re.fullmatch(rf"task \S+: {OTHER}", body["detail"]), body  # names the task
    assert holder not in str(body)


# --- leases bound to their holder --------------------------------------------------------------


async def test_claim_records_the_principal_apart_from_the_owner_label(
    client: TestClient[Any, Any],
) -> None:
    alice, anonymous = As(client, "alice"), As(client, None)
    await alice.put("t1")
    assert (await alice.get("t1")).body["principal"] is None
    lease = await alice.claim("t1", owner="worker-label")
    record = (await anonymous.get("t1")).body
    assert record["principal"] == "alice" and record["owner"] == "worker-label"
    assert (await alice.release(lease)).status == 200
    record = (await anonymous.get("t1")).body
    assert record["principal"] is None and record["owner"] is None  # release clears the claim
    await anonymous.claim("t1")
    assert (await anonymous.get("t1")).body["principal"] is None


async def test_another_principal_cannot_use_a_copied_attempt(
    client: TestClient[Any, Any], downstream: Downstream
) -> None:
    alice, bob = As(client, "alice"), As(client, "bob")
    await alice.put("t1")
    lease = await alice.claim("t1", ttl_ms=30_000)
    before = (await bob.get("t1")).body  # everything bob needs is readable...
    assert before["attemptId"] == lease.attempt_id

    # ...and worth nothing without alice's credential.
    fenced_by_principal(await bob.renew(lease, ttl_ms=60_000), "alice")
    fenced_by_principal(await bob.commit(lease, "bobs-result"), "alice")
    fenced_by_principal(await bob.send(lease, body={"amount": 5000}), "alice")
    fenced_by_principal(await bob.send(lease, "api/ok/read", method="GET"), "alice")
    fenced_by_principal(await bob.release(lease), "alice")
    assert downstream.received == []
    assert (await bob.call("GET", "/v1/effects?taskId=t1")).body["effects"] == []
    assert (await bob.get("t1")).body == before  # nothing changed: no renew, no release

    # The holder carries on.
    sent = await alice.send(lease, body={"amount": 10})
    assert sent.status == 200 and len(downstream.received) == 1
    assert (await alice.send(lease, "api/ok/read", method="GET")).status == 200
    record = (await alice.call("GET", f"/v1/effects/{sent.headers['Fence-Effect-Id']}")).body
    assert record["requestedBy"] == "alice"
    assert (await alice.renew(lease, ttl_ms=30_000)).status == 200
    committed = await alice.commit(lease, "alices-result")
    assert committed.status == 200

    # Even the commit replay (the same attempt and resultDigest) is the holder's alone.
    fenced_by_principal(await bob.commit(lease, "alices-result"), "alice")
    again = await alice.commit(lease, "alices-result")
    assert again.status == 200 and again.body["commitId"] == committed.body["commitId"]
    assert len(downstream.received) == 2


async def test_the_holder_releases_and_another_principal_claims_afresh(
    client: TestClient[Any, Any], downstream: Downstream
) -> None:
    alice, bob = As(client, "alice"), As(client, "bob")
    await alice.put("t1")
    lease = await alice.claim("t1")
    fenced_by_principal(await bob.release(lease), "alice")
    assert (await alice.release(lease)).status == 200
    taken = await bob.claim("t1")
    assert (await bob.get("t1")).body["principal"] == "bob"
    assert (await bob.send(taken, body={"n": 1})).status == 200
    fenced_by_principal(await alice.send(taken, body={"n": 2}), "bob")
    # alice's old attempt is simply not the current claim any more.
    old = await alice.send(lease, body={"n": 3})
    assert old.status == 409 and old.json["code"] == "FENCED" and OTHER not in old.json["detail"]
    assert len(downstream.received) == 1


async def test_without_principals_everything_works_as_before(
    client: TestClient[Any, Any], downstream: Downstream
) -> None:
    api = As(client, None)
    await api.put("t1")
    lease = await api.claim("t1")
    assert (await api.get("t1")).body["principal"] is None
    assert (await api.renew(lease)).status == 200
    sent = await api.send(lease, body={"n": 1})
    assert sent.status == 200
    assert (await api.send(lease, "api/ok/read", method="GET")).status == 200
    record = (await api.call("GET", f"/v1/effects/{sent.headers['Fence-Effect-Id']}")).body
    assert record["requestedBy"] is None
    assert (await api.commit(lease)).status == 200
    assert len(downstream.received) == 2


async def test_one_side_without_a_principal_checks_nothing(
    client: TestClient[Any, Any], downstream: Downstream
) -> None:
    """A claim made without [auth] stays usable by its attemptId (and a request without a
    principal, which only exists without [auth], is not compared): docs/decisions.md."""
    alice, anonymous = As(client, "alice"), As(client, None)
    await alice.put("t1")
    await alice.put("t2")
    unbound = await anonymous.claim("t1")
    assert (await alice.renew(unbound)).status == 200
    assert (await alice.send(unbound, body={"n": 1})).status == 200
    bound = await alice.claim("t2")
    assert (await anonymous.renew(bound)).status == 200
    assert (await anonymous.commit(bound)).status == 200


# --- operators: named by their principal, and never approving their own request ----------------


async def waiting_effect(worker: As, lease: Lease, body: Any) -> str:
    waiting = await worker.send(lease, "mail/send", body=body)
    assert waiting.status == 409 and waiting.code == "APPROVAL_REQUIRED", waiting.json
    return str(waiting.headers["Fence-Effect-Id"])


async def test_an_operator_may_not_approve_their_own_request(
    client: TestClient[Any, Any], downstream: Downstream
) -> None:
    alice = As(client, "alice", **{"Fence-Operator": "someone-else"})
    bob = As(client, "bob", **{"Fence-Operator": "mallory"})
    await alice.put("t1")
    lease = await alice.claim("t1")
    effect_id = await waiting_effect(alice, lease, {"to": "x"})
    record = (await bob.call("GET", f"/v1/effects/{effect_id}")).body
    assert record["requestedBy"] == "alice" and record["attempts"] == []

    own = await alice.call("POST", f"/v1/effects/{effect_id}/approve", {"note": "me"})
    assert own.status == 403 and own.code == "FORBIDDEN"
    assert own.content_type == "application/problem+json"
    assert (await bob.call("GET", f"/v1/effects/{effect_id}")).body == record  # nothing written

    approved = await bob.call("POST", f"/v1/effects/{effect_id}/approve", {"note": "ok"})
    assert approved.status == 200
    # The operator is the credential's principal, not the free-text Fence-Operator.
    assert approved.body["approval"]["by"] == "bob"
    assert approved.body["actions"][-1]["by"] == "bob"
    assert downstream.received == []
    sent = await alice.send(lease, "mail/send", body={"to": "x"})
    assert sent.status == 200 and len(downstream.received) == 1
    record = (await bob.call("GET", f"/v1/effects/{effect_id}")).body
    assert record["attempts"][-1]["approvedBy"] == "bob" and record["requestedBy"] == "alice"


async def test_an_approval_is_never_consumed_by_its_own_giver(
    client: TestClient[Any, Any], downstream: Downstream
) -> None:
    """bob approves alice's email, then takes the task over himself: his own approval does
    not let his forward go; someone else must approve it."""
    alice, bob, carol = As(client, "alice"), As(client, "bob"), As(client, "carol")
    await alice.put("t1")
    first = await alice.claim("t1")
    effect_id = await waiting_effect(alice, first, {"to": "x"})
    assert (await bob.call("POST", f"/v1/effects/{effect_id}/approve")).status == 200
    assert (await alice.release(first)).status == 200
    second = await bob.claim("t1")
    assert await waiting_effect(bob, second, {"to": "x"}) == effect_id
    record = (await carol.call("GET", f"/v1/effects/{effect_id}")).body
    assert record["requestedBy"] == "bob" and record["approval"]["by"] == "bob"
    again = await bob.call("POST", f"/v1/effects/{effect_id}/approve")
    assert again.status == 403 and again.code == "FORBIDDEN"
    assert downstream.received == []
    assert (await carol.call("POST", f"/v1/effects/{effect_id}/approve")).status == 200
    sent = await bob.send(second, "mail/send", body={"to": "x"})
    assert sent.status == 200 and len(downstream.received) == 1
    record = (await carol.call("GET", f"/v1/effects/{effect_id}")).body
    assert record["attempts"][-1]["approvedBy"] == "carol"


async def test_without_principals_approval_works_as_before(
    client: TestClient[Any, Any], downstream: Downstream
) -> None:
    worker, operator = As(client, None), As(client, None, **{"Fence-Operator": "carol"})
    await worker.put("t1")
    lease = await worker.claim("t1")
    effect_id = await waiting_effect(worker, lease, {"to": "x"})
    approved = await operator.call("POST", f"/v1/effects/{effect_id}/approve")
    assert approved.status == 200 and approved.body["approval"]["by"] == "carol"
    assert approved.body["requestedBy"] is None
    assert (await worker.send(lease, "mail/send", body={"to": "x"})).status == 200
    assert len(downstream.received) == 1


async def test_resolve_records_the_principal_as_the_operator(
    client: TestClient[Any, Any], downstream: Downstream
) -> None:
    worker = As(client, "alice")
    await worker.put("t1")
    lease = await worker.claim("t1")
    ids = []
    for slot in ("s1", "s2"):
        sent = await worker.send(lease, "api/status/500", body={"n": slot}, slot=slot)
        assert sent.headers["Fence-Effect-State"] == "UNKNOWN"
        ids.append(sent.headers["Fence-Effect-Id"])
    resolve = {"outcome": "NOT_APPLIED", "note": "checked the downstream"}
    Api(client).advance(60_000)  # past settle_ms (default): no forward can still land
    olivia = As(client, "olivia", **{"Fence-Operator": "mallory"})
    answer = await olivia.call("POST", f"/v1/effects/{ids[0]}/resolve", resolve)
    assert answer.status == 200 and answer.body["actions"][-1]["by"] == "olivia"
    # Without a principal, Fence-Operator stays the free-text label it was.
    labelled = As(client, None, **{"Fence-Operator": "mallory"})
    answer = await labelled.call("POST", f"/v1/effects/{ids[1]}/resolve", resolve)
    assert answer.status == 200 and answer.body["actions"][-1]["by"] == "mallory"
