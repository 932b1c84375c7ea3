"""What an approval covers (issue 25): the method, the path, the body, and the headers that
change what a request does.

An approval used to name the payload digest only (method, path, body), so an approved call
could go out with ``X-HTTP-Method-Override: DELETE`` (the downstream deletes) or with another
``Content-Type`` or precondition than the operator saw. Now, on a downstream that requires
approval, a mutation carrying a method override is refused, and the record's
``approvalDigest`` (``ledger.effects.approval_digest``: the payload digest plus
``Content-Type``, ``Content-Encoding`` and the preconditions) is what an operator approves; a
forward whose approval digest is another one is not sent (409 ``APPROVAL_REQUIRED``, the
record rebound to it). Trace context is never digested. Executions are counted at the
downstream; the gateway runs in-process on every store.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.cli import main
from fencegate.ledger.effects import APPROVAL_HEADERS, approval_digest
from tests.api import Api, Lease
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream

BODY = b'{"to":"a@example.com","text":"hello"}'
JSON = {"Content-Type": "application/json"}


@dataclass
class Env:
    api: Api
    url: str
    downstream: Downstream

    async def lease(self, task_id: str = "t1") -> Lease:
        await self.api.put(task_id)
        return await self.api.claim(task_id, ttl_ms=30_000)

    async def send(
        self,
        lease: Lease,
        headers: dict[str, str] | None = None,
        *,
        target: str = "mailer/ok/mail",
        slot: str = "mail-1",
        body: bytes = BODY,
    ) -> tuple[int, dict[str, Any]]:
        """A worker's POST with exactly ``headers`` (no Content-Type unless given)."""
        fence = {
            "Fence-Task": lease.task_id,
            "Fence-Attempt": lease.attempt_id,
            "Fence-Generation": str(lease.claim_generation),
            "Fence-Epoch": str(lease.scheduler_epoch),
            "Fence-Cancel": str(lease.cancel_generation),
            "Fence-Slot": slot,
        }
        async with self.api.client.post(
            f"/proxy/{target}",
            data=body,
            headers={**fence, **(headers or {})},
            skip_auto_headers=("Content-Type",),
        ) as resp:
            return resp.status, await resp.json(content_type=None)

    async def record(self, effect_id: str) -> dict[str, Any]:
        answer = await self.api.call("GET", f"/v1/effects/{effect_id}")
        assert answer.status == 200, answer.body
        record: dict[str, Any] = answer.body
        return record

    async def approve(self, effect_id: str, **body: str) -> tuple[int, dict[str, Any]]:
        answer = await self.api.call("POST", f"/v1/effects/{effect_id}/approve", body)
        return answer.status, answer.body


@pytest.fixture
async def env(store_url: str, key_prefix: str) -> AsyncIterator[Env]:
    downstream = await Downstream().start()
    config = make_config(
        store_url,
        key_prefix,
        reconciler={"enabled": False},
        downstreams=[
            {"name": "mailer", "url": downstream.url, "adapter": "manual",
             "require_approval": True, "approval_ttl_ms": 600_000},
            {"name": "api", "url": downstream.url},
        ],
    )  # fmt: skip
    app = create_app(config, store=build_test_store(config))
    try:
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            yield Env(Api(client), str(client.make_url("")).rstrip("/"), downstream)
    finally:
        await downstream.stop()


# --- method overrides ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "target"),
    [
        ({"X-HTTP-Method-Override": "DELETE"}, "mailer/ok/mail"),
        ({"x-http-method": "DELETE"}, "mailer/ok/mail"),
        ({"X-Method-Override": "delete"}, "mailer/ok/mail"),
        ({}, "mailer/ok/mail?_method=DELETE"),
        ({}, "mailer/ok/mail?a=1;%5Fmethod=DELETE"),
        # Spelled as a CGI, WSGI, PHP or Rack server reads it (a second red-team pass):
        ({"X_HTTP_Method_Override": "DELETE"}, "mailer/ok/mail"),
        ({}, "mailer/ok/mail?.method=DELETE"),
        ({}, "mailer/ok/mail?_method[]=DELETE"),
    ],
)
async def test_an_approved_call_cannot_go_out_as_another_method(
    env: Env, headers: dict[str, str], target: str
) -> None:
    """The operator approved a POST; the same payload with a method override is refused
    (400, nothing recorded or sent), whatever the approval says."""
    lease = await env.lease()
    status, body = await env.send(lease, JSON, target=target.split("?")[0])
    assert (status, body["code"]) == (409, "APPROVAL_REQUIRED")
    effect_id = body["effectId"]
    status, _ = await env.approve(effect_id, approvalDigest=body["approvalDigest"])
    assert status == 200

    status, refused = await env.send(lease, {**JSON, **headers}, target=target)
    assert (status, refused["code"]) == (400, "BAD_REQUEST"), refused
    assert "method override" in refused["detail"]
    assert env.downstream.calls() == []
    record = await env.record(effect_id)
    assert record["attempts"] == [] and record["approval"] is not None  # nothing used


async def test_an_approved_form_cannot_carry_a_method_override_in_its_body(env: Env) -> None:
    """The operator sees the path and query of what it approves, never the body: a form body
    with ``_method=DELETE`` (Rails, Laravel) is refused like the query parameter (a third
    red-team pass had it approved and forwarded)."""
    lease = await env.lease()
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    status, body = await env.send(lease, form, body=b"to=alice")
    assert (status, body["code"]) == (409, "APPROVAL_REQUIRED")
    status, _ = await env.approve(body["effectId"], approvalDigest=body["approvalDigest"])
    assert status == 200
    status, refused = await env.send(lease, form, body=b"to=alice&_method=DELETE")
    assert (status, refused["code"]) == (400, "BAD_REQUEST"), refused
    assert "body field _method" in refused["detail"]
    assert env.downstream.calls() == []
    status, sent = await env.send(lease, form, body=b"to=alice")
    assert status == 200, sent
    assert len(env.downstream.calls()) == 1


async def test_a_method_override_still_passes_where_no_approval_is_needed(env: Env) -> None:
    """A plain downstream records every mutation anyway: its overrides are the agent's."""
    lease = await env.lease()
    status, _ = await env.send(
        lease, {**JSON, "X-HTTP-Method-Override": "PATCH"}, target="api/ok/x"
    )
    assert status == 200
    assert len(env.downstream.calls("/ok/x")) == 1


# --- the approval digest -------------------------------------------------------------------------


async def test_an_approval_covers_the_effect_changing_headers(env: Env) -> None:
    lease = await env.lease()
    status, body = await env.send(lease, JSON)
    assert (status, body["code"]) == (409, "APPROVAL_REQUIRED")
    effect_id, digest = body["effectId"], body["approvalDigest"]
    record = await env.record(effect_id)
    assert record["approvalDigest"] == digest != record["payloadDigest"]
    assert "--approval-digest " + digest in body["detail"]

    # The payload digest alone would approve a Content-Type the operator never named.
    status, refused = await env.approve(effect_id, payloadDigest=record["payloadDigest"])
    assert (status, refused["code"]) == (400, "BAD_REQUEST"), refused
    assert digest in refused["detail"]
    status, stale = await env.approve(effect_id, approvalDigest="0" * 64)
    assert (status, stale["code"]) == (422, "PAYLOAD_CONFLICT")
    status, approved = await env.approve(
        effect_id, approvalDigest=digest, payloadDigest=record["payloadDigest"]
    )
    assert status == 200, approved
    assert approved["approval"]["approvalDigest"] == digest
    assert approved["approval"]["payloadDigest"] == record["payloadDigest"]

    # The same payload with a precondition the operator did not see: not sent, and the
    # record now waits for that request (its payloadDigest unchanged).
    status, other = await env.send(lease, {**JSON, "If-Match": '"v7"'})
    assert (status, other["code"]) == (409, "APPROVAL_REQUIRED"), other
    assert other["approvalDigest"] != digest
    rebound = await env.record(effect_id)
    assert rebound["approvalDigest"] == other["approvalDigest"]
    assert rebound["payloadDigest"] == record["payloadDigest"]
    assert env.downstream.calls() == []
    # Spelled as a CGI, WSGI, PHP or Rack server reads it (If_Match): the same precondition,
    # not a way around the approval (a second red-team pass).
    status, cgi = await env.send(lease, {**JSON, "If_Match": '"v7"'})
    assert (status, cgi["code"]) == (409, "APPROVAL_REQUIRED"), cgi
    assert cgi["approvalDigest"] == other["approvalDigest"]
    assert env.downstream.calls() == []

    # Trace context is never digested: the approved request, with a traceparent, goes once.
    trace = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    status, sent = await env.send(lease, {**JSON, **trace, "baggage": "k=v"})
    assert status == 200, sent
    status, again = await env.send(lease, JSON)
    assert status == 200 and again == sent  # replayed
    assert len(env.downstream.calls("/ok/mail")) == 1
    record = await env.record(effect_id)
    assert record["state"] == "COMMITTED" and record["approvalDigest"] == digest


async def test_the_payload_digest_alone_approves_a_request_without_such_headers(env: Env) -> None:
    """No Content-Type, Content-Encoding or precondition sent: the approval digest is the
    payload digest, and approving by the payload digest works as before."""
    lease = await env.lease()
    status, body = await env.send(lease)
    assert status == 409
    record = await env.record(body["effectId"])
    assert record["approvalDigest"] == record["payloadDigest"] == body["approvalDigest"]
    status, _ = await env.approve(body["effectId"], payloadDigest=record["payloadDigest"])
    assert status == 200
    status, _ = await env.send(lease)
    assert status == 200
    assert len(env.downstream.calls("/ok/mail")) == 1


async def test_the_cli_approves_an_approval_digest(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    lease = await env.lease()
    _, body = await env.send(lease, JSON)
    effect_id, digest = body["effectId"], body["approvalDigest"]
    capsys.readouterr()
    shown = await asyncio.to_thread(main, ["effects", "show", effect_id, "--url", env.url])
    out, _ = capsys.readouterr()
    assert shown == 0 and f"approvalDigest  {digest}" in " ".join(out.split("\n"))
    argv = ["effects", "approve", effect_id, "--approval-digest", digest, "--url", env.url]
    code = await asyncio.to_thread(main, argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert digest in out
    status, _ = await env.send(lease, JSON)
    assert status == 200
    assert len(env.downstream.calls("/ok/mail")) == 1


# --- the digest itself (pure) --------------------------------------------------------------------


def test_the_approval_digest_covers_exactly_the_listed_headers() -> None:
    payload = "ab" * 32
    assert approval_digest(payload, []) == payload
    unlisted = [("traceparent", "00-x-y-01"), ("tracestate", "a=b"), ("baggage", "k=v"),
                ("Accept", "*/*"), ("X-Request-Id", "1")]  # fmt: skip
    assert approval_digest(payload, unlisted) == payload
    base = approval_digest(payload, [("Content-Type", "application/json")])
    assert base != payload and len(base) == 64
    # Names in any case, any order of different names: the same digest.
    assert approval_digest(payload, [("content-type", "application/json"), *unlisted]) == base
    for name in APPROVAL_HEADERS:
        more = approval_digest(payload, [("Content-Type", "application/json"), (name, "x")])
        assert more != base, name
        # The name as a CGI, WSGI, PHP or Rack server reads it (If_Match): the same field.
        cgi = name.replace("-", "_").title()
        dotted = name.replace("-", ".")
        assert (
            approval_digest(payload, [("Content.Type", "application/json"), (dotted, "x")]) == more
        )
        assert (
            cgi != name
            and approval_digest(payload, [("content_type", "application/json"), (cgi, "x")]) == more
        ), cgi
    assert approval_digest(payload, [("Content-Type", "text/plain")]) != base
    assert approval_digest("cd" * 32, [("Content-Type", "application/json")]) != base
    two = [("If-Match", '"a"'), ("If-Match", '"b"')]
    assert approval_digest(payload, two) != approval_digest(payload, two[::-1])
