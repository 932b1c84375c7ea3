"""An approved forward that certainly sent nothing keeps its approval (issue 25).

A forward the gateway could not even connect for (connect refused; no pooled connection in
time) ran nothing at the downstream. It used to use its approval up anyway and drop out of the
approval queue, so the agent's retry was refused ``APPROVAL_REQUIRED`` and an operator had to
approve the same payload again without the queue showing it. The approval now stays until it
expires (``ledger.effects.sent_nothing``), the effect stays in the queue, and the retry goes
out under it: the downstream runs it exactly once. On every store.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.ledger import effects
from fencegate.ledger.effects import (
    ABORT_REASON,
    LATE_REASON,
    Effect,
    EffectAttempt,
    EffectState,
    is_awaiting_approval,
)
from tests.api import Api, Lease
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream


@pytest.fixture
def refusing() -> Iterator[socket.socket]:
    """A loopback socket bound to a port of its own and not listening: a connect to it is
    refused, until the test makes it listen (no other process can take the port meanwhile)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield sock
    sock.close()


async def serve_on(downstream: Downstream, sock: socket.socket) -> web.AppRunner:
    """Start counting ``downstream`` on ``sock`` (it listens from now on)."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", downstream._handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock.listen()
    await web.SockSite(runner, sock).start()
    downstream.runner = runner
    return runner


@dataclass
class Env:
    api: Api
    port: int

    async def lease(self) -> Lease:
        await self.api.put("t1")
        return await self.api.claim("t1", ttl_ms=30_000)

    async def send(self, lease: Lease) -> tuple[int, dict[str, Any]]:
        headers = {
            "Fence-Task": lease.task_id,
            "Fence-Attempt": lease.attempt_id,
            "Fence-Generation": str(lease.claim_generation),
            "Fence-Epoch": str(lease.scheduler_epoch),
            "Fence-Cancel": str(lease.cancel_generation),
            "Fence-Slot": "mail-1",
        }
        async with self.api.client.post(
            "/proxy/mailer/ok/mail", json={"to": "a@example.com"}, headers=headers
        ) as resp:
            return resp.status, await resp.json(content_type=None)


@pytest.fixture
async def env(store_url: str, key_prefix: str, refusing: socket.socket) -> AsyncIterator[Env]:
    port = refusing.getsockname()[1]
    config = make_config(
        store_url,
        key_prefix,
        reconciler={"enabled": False},
        downstreams=[
            {
                "name": "mailer",
                "url": f"http://127.0.0.1:{port}",
                "adapter": "manual",
                "require_approval": True,
                "approval_ttl_ms": 600_000,
                "timeout_ms": 2_000,
            }
        ],
    )
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Env(Api(client), port)


async def test_a_refused_connection_keeps_the_approval_and_the_retry_goes_once(
    env: Env, refusing: socket.socket
) -> None:
    lease = await env.lease()
    status, body = await env.send(lease)
    assert (status, body["code"]) == (409, "APPROVAL_REQUIRED"), body
    effect_id = body["effectId"]
    approved = await env.api.call("POST", f"/v1/effects/{effect_id}/approve", {"note": "ok"})
    assert approved.status == 200, approved.body

    # The downstream refuses the connection: nothing was sent, nothing used up.
    status, body = await env.send(lease)
    assert (status, body["code"]) == (502, "DOWNSTREAM_UNREACHABLE"), body
    record = (await env.api.call("GET", f"/v1/effects/{effect_id}")).body
    assert record["state"] == "NOT_APPLIED"
    assert record["attempts"][-1]["reason"].startswith("connect failed"), record["attempts"]
    assert record["approval"] is not None and record["approval"]["by"] == "anonymous"
    queue = await env.api.call("GET", "/v1/effects?awaitingApproval=true")
    assert [e["effectId"] for e in queue.body["effects"]] == [effect_id]

    # The downstream is back: the agent's retry goes out under the same approval, once.
    downstream = Downstream()
    await serve_on(downstream, refusing)
    try:
        status, body = await env.send(lease)
        assert status == 200, body
        status, again = await env.send(lease)
        assert status == 200 and again == body  # replayed
        assert len(downstream.calls("/ok/mail")) == 1
    finally:
        await downstream.stop()
    record = (await env.api.call("GET", f"/v1/effects/{effect_id}")).body
    assert record["state"] == "COMMITTED" and record["approval"] is None
    assert [a["approvedBy"] for a in record["attempts"]] == ["anonymous", "anonymous"]
    queue = await env.api.call("GET", "/v1/effects?awaitingApproval=true")
    assert queue.body["effects"] == []


# --- the rule itself (pure) ------------------------------------------------------------------


def _approved_forward(now: int = 1_000) -> Effect:
    """An effect whose approved forward is running (PREPARED, the approval on the record)."""
    return Effect(
        effect_id="e",
        task_id="t",
        revision=1,
        node="main",
        slot="s",
        downstream="mailer",
        method="POST",
        path="/mail",
        payload_digest="d",
        state=EffectState.PREPARED,
        created_at=0,
        updated_at=now,
        deadline_at=now + 5_000,
        attempts=(EffectAttempt("a", 1, now, approved_by="carol", forward_id="f"),),
        approval_digest="d",
        approval_by="carol",
        approval_at=500,
        approval_expires_at=60_000,
    )


@pytest.mark.parametrize(
    ("outcome", "reason", "kept"),
    [
        (EffectState.NOT_APPLIED, "connect failed: ClientConnectorError", True),
        (EffectState.NOT_APPLIED, "never sent: no pooled connection in time (X)", True),
        (EffectState.NOT_APPLIED, "status 429: refused before it was processed", False),
        (EffectState.UNKNOWN, "timed out: TimeoutError", False),
        (EffectState.COMMITTED, "status 200", False),
    ],
)
def test_only_a_forward_that_sent_nothing_keeps_its_approval(
    outcome: EffectState, reason: str, kept: bool
) -> None:
    done, applied = effects.complete(_approved_forward(), 0, "a", outcome, reason, None, 2_000)
    assert applied
    assert (done.approval_digest is not None) is kept
    assert is_awaiting_approval(done) is kept
    if kept:  # the same approval, until it expires
        assert (done.approval_by, done.approval_expires_at) == ("carol", 60_000)


@pytest.mark.parametrize("reason", [ABORT_REASON, LATE_REASON])
def test_an_aborted_forward_keeps_its_approval(reason: str) -> None:
    done = effects.abort(_approved_forward(), "f", 2_000, reason)
    assert done.state is EffectState.NOT_APPLIED and done.approval_by == "carol"
    assert is_awaiting_approval(done)


def test_a_forward_past_its_deadline_used_its_approval() -> None:
    late = effects.effective(_approved_forward(), 10_000)
    assert late.state is EffectState.UNKNOWN and late.approval_digest is None
