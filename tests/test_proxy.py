"""The fenced proxy and the ledger API, through HTTP, on both stores.

Every row of the contract's state table, the lost-answer story, duplicates and concurrency,
header and path hygiene, and hostile input. The downstream is a real HTTP server on loopback
(``tests/downstream.py``) that counts calls per Idempotency-Key.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.config import Config
from fencegate.ledger.effects import EffectRequest, EffectState, Fence, effect_id, payload_digest
from fencegate.ledger.errors import FencegateError
from tests.api import Api, Lease
from tests.clocks import freeze_store_clock, still
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.servers import refused_port

TIMEOUT_MS = 400
# A call that outlives "brief"'s timeout: the timeout stories go through "brief"; every other
# story goes through "api", whose 10 s timeout a loaded CI machine does not reach. "brief"'s
# bound is its read timeout (read_timeout_ms), which starts once the connection is there and
# fires only after the request was handed to the socket: the call always arrives, however
# long the machine took to connect (a whole-forward timer of 400 ms could fire before it was
# sent). Its answer is due 100 ms after the gateway's timer (both on the loop's clock, the
# downstream's set later), so the timer always fires first, however slow the machine.
TIMED_OUT = f"/proxy/brief/slow/{TIMEOUT_MS + 100}/pay"
#: Bounds only a hang: a wait for something that happens whatever the machine's load.
HANG_S = 30


@pytest.fixture
def proxy_config(store_url: str, key_prefix: str, downstream: Downstream) -> Config:
    return make_config(
        store_url,
        key_prefix,
        downstreams=[  # type: ignore[arg-type]
            {"name": "api", "url": downstream.url, "timeout_ms": 10_000, "replay_max_bytes": 1024},
            # The connect bound far off: a slow connect under load is still a timeout
            # (UNKNOWN), never an unreachable downstream.
            {
                "name": "brief",
                "url": downstream.url,
                "timeout_ms": 10_000,
                "read_timeout_ms": TIMEOUT_MS,
                "connect_timeout_ms": 10_000,
            },
            # Refused at once: no timer of its own to race on a loaded machine.
            {"name": "dead", "url": f"http://127.0.0.1:{refused_port()}"},
            {"name": "small", "url": downstream.url, "max_body_bytes": 2048},
        ],
        # The fixture's forward clock stands still, so a loaded machine answering 50 racing
        # prepares late cannot spend the start limit; it is then a real-time bound on the pool
        # wait and connect, and 10 s off.
        proxy={"prepared_margin_ms": 20_000, "forward_start_limit_ms": 10_000},
    )


@pytest.fixture
async def api(proxy_config: Config) -> AsyncIterator[Api]:
    # "Could not start in time" is tests/test_forward_window.py's story, not this file's.
    # The store's clock stands still too: only api.advance runs a lease out.
    store = freeze_store_clock(build_test_store(proxy_config))
    app = create_app(proxy_config, store=store, forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


def fence_headers(lease: Lease, slot: str | None = "s1", **override: str) -> dict[str, str]:
    headers = {
        "Fence-Task": lease.task_id,
        "Fence-Attempt": lease.attempt_id,
        "Fence-Generation": str(lease.claim_generation),
        "Fence-Epoch": str(lease.scheduler_epoch),
        "Fence-Cancel": str(lease.cancel_generation),
    }
    if slot is not None:
        headers["Fence-Slot"] = slot
    headers.update(override)
    return headers


class Sent:
    """One answer as a test reads it (also tests/test_keyed_proxy.py, test_keyed_redteam.py)."""

    def __init__(self, status: int, headers: Any, body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def code(self) -> str | None:
        """The problem code, None for an answer that is not a problem object."""
        try:
            found = self.json.get("code")
        except (ValueError, AttributeError):
            return None
        return found if isinstance(found, str) else None


async def send(
    api: Api,
    lease: Lease,
    path: str = "/ok/pay",
    *,
    method: str = "POST",
    slot: str | None = "s1",
    body: Any = None,
    data: Any = None,
    headers: dict[str, str] | None = None,
) -> Sent:
    all_headers = {**fence_headers(lease, slot), **(headers or {})}
    async with api.client.request(
        method,
        f"/proxy/api{path}" if not path.startswith("/proxy/") else path,
        json=body,
        data=data,
        allow_redirects=False,
        headers=all_headers,
    ) as resp:
        return Sent(resp.status, resp.headers, await resp.read())


async def task_with_lease(api: Api, task_id: str = "t1", ttl_ms: int = 30_000) -> Lease:
    await api.put(task_id)
    return await api.claim(task_id, ttl_ms=ttl_ms)


# --- the state table --------------------------------------------------------------------------


async def test_new_effect_is_prepared_forwarded_and_committed(
    api: Api, downstream: Downstream
) -> None:
    lease = await task_with_lease(api)
    sent = await send(api, lease, body={"amount": 5})
    expected_id = effect_id("t1", 1, "main", "s1")
    assert sent.status == 200
    assert sent.headers["Fence-Effect-Id"] == expected_id
    assert sent.headers["Fence-Effect-State"] == "COMMITTED"
    assert sent.headers["Fence-Replayed"] == "false"
    (call,) = downstream.calls()
    assert call.headers["Idempotency-Key"] == expected_id
    assert call.headers["Fencing-Token"] == f"1.{lease.claim_generation}"
    assert json.loads(call.body) == {"amount": 5}
    record = (await api.call("GET", f"/v1/effects/{expected_id}")).body
    assert record["state"] == "COMMITTED"
    assert record["taskId"] == "t1" and record["slot"] == "s1" and record["node"] == "main"
    assert record["downstream"] == "api" and record["method"] == "POST"
    assert record["path"] == "/ok/pay"
    canonical = json.dumps({"amount": 5}, separators=(",", ":")).encode()
    assert record["payloadDigest"] == payload_digest("POST", "api", "/ok/pay", canonical)
    (attempt,) = record["attempts"]
    assert attempt["attemptId"] == lease.attempt_id and attempt["outcome"] == "COMMITTED"
    assert record["response"]["status"] == 200


async def test_duplicate_gets_stored_response_without_second_call(
    api: Api, downstream: Downstream
) -> None:
    lease = await task_with_lease(api)
    first = await send(
        api, lease, data=b'{"b": 1, "a": [1, 2]}', headers={"Content-Type": "application/json"}
    )
    # Same JSON, other key order and whitespace: the same payload.
    again = await send(
        api, lease, data=b'{"a":[1,2],"b":1}', headers={"Content-Type": "application/json"}
    )
    assert again.status == first.status == 200
    assert again.body == first.body
    assert again.headers["Fence-Replayed"] == "true"
    assert again.headers["Fence-Effect-State"] == "COMMITTED"
    assert len(downstream.calls()) == 1


async def test_different_payload_for_committed_slot_is_conflict(
    api: Api, downstream: Downstream
) -> None:
    lease = await task_with_lease(api)
    await send(api, lease, body={"amount": 5})
    other = await send(api, lease, body={"amount": 6})
    assert other.status == 422 and other.code == "PAYLOAD_CONFLICT"
    assert other.headers["Fence-Effect-State"] == "COMMITTED"
    other_path = await send(api, lease, "/ok/refund", body={"amount": 5})
    assert other_path.code == "PAYLOAD_CONFLICT"
    assert len(downstream.calls()) == 1


async def test_in_flight_duplicate_waits_and_conflict_is_refused(
    api: Api, downstream: Downstream
) -> None:
    lease = await task_with_lease(api)
    # Through "small" (10 s timeout): a loaded machine must not time the first call out while
    # the duplicate and the conflict are answered.
    path = "/proxy/small/slow/500/pay"
    first = asyncio.create_task(send(api, lease, path, body={"x": 1}))
    await downstream.arrived.wait()
    dup = await send(api, lease, path, body={"x": 1})
    assert dup.status == 409 and dup.code == "EFFECT_IN_FLIGHT"
    assert 1 <= int(dup.headers["Retry-After"]) <= 60
    assert dup.headers["Fence-Effect-State"] == "PREPARED"
    conflict = await send(api, lease, path, body={"x": 2})
    assert conflict.status == 422 and conflict.code == "PAYLOAD_CONFLICT"
    assert (await first).status == 200
    assert len(downstream.calls()) == 1


async def test_timeout_makes_effect_unknown_and_blocks_blind_retry(
    api: Api, downstream: Downstream
) -> None:
    lease = await task_with_lease(api)
    sent = await send(api, lease, TIMED_OUT, body={"x": 1})
    assert sent.status == 504 and sent.code == "DOWNSTREAM_TIMEOUT"
    assert sent.headers["Fence-Effect-State"] == "UNKNOWN"
    again = await send(api, lease, TIMED_OUT, body={"x": 1})
    assert again.status == 409 and again.code == "EFFECT_UNKNOWN"
    other = await send(api, lease, TIMED_OUT, body={"x": 2})
    assert other.status == 422 and other.code == "PAYLOAD_CONFLICT"
    await asyncio.wait_for(downstream.arrived.wait(), HANG_S)  # the timed-out call, once
    assert len(downstream.calls()) == 1
    record = (await api.call("GET", f"/v1/effects/{sent.headers['Fence-Effect-Id']}")).body
    assert record["state"] == "UNKNOWN"
    assert "timed out" in record["attempts"][0]["reason"]


@pytest.mark.one_store
async def test_a_timed_out_call_arrives_however_slow_the_connect(
    api: Api, downstream: Downstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loaded machine's connect takes longer than "brief"'s timeout: the call still arrives,
    once, and times out waiting for its answer (UNKNOWN), as the timeout stories above need.
    With a whole-forward timer of that length it never left (issue 26)."""
    connect = aiohttp.TCPConnector._create_connection

    async def slow_connect(self: aiohttp.TCPConnector, *args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep((TIMEOUT_MS + 200) / 1000)  # the machine, not the downstream
        return await connect(self, *args, **kwargs)

    lease = await task_with_lease(api)
    monkeypatch.setattr(aiohttp.TCPConnector, "_create_connection", slow_connect)
    sent = await send(api, lease, TIMED_OUT, body={"x": 1})
    assert sent.status == 504 and sent.code == "DOWNSTREAM_TIMEOUT", sent.body
    assert sent.headers["Fence-Effect-State"] == "UNKNOWN"
    await asyncio.wait_for(downstream.arrived.wait(), HANG_S)
    assert len(downstream.calls()) == 1


@pytest.mark.parametrize("status", [500, 502, 504])
async def test_ambiguous_statuses_are_unknown(
    api: Api, downstream: Downstream, status: int
) -> None:
    lease = await task_with_lease(api)
    sent = await send(api, lease, f"/status/{status}", body={})
    assert sent.status == status  # the agent sees what the downstream said
    assert sent.headers["Fence-Effect-State"] == "UNKNOWN"
    again = await send(api, lease, f"/status/{status}", body={})
    assert again.code == "EFFECT_UNKNOWN"
    assert len(downstream.calls()) == 1


@pytest.mark.parametrize("status", [201, 400, 404, 409])
async def test_other_statuses_are_committed_and_replayed(
    api: Api, downstream: Downstream, status: int
) -> None:
    lease = await task_with_lease(api)
    first = await send(api, lease, f"/status/{status}", body={})
    again = await send(api, lease, f"/status/{status}", body={})
    assert first.status == again.status == status
    assert again.headers["Fence-Replayed"] == "true"
    assert len(downstream.calls()) == 1


async def test_reset_after_send_is_unknown(api: Api, downstream: Downstream) -> None:
    lease = await task_with_lease(api)
    sent = await send(api, lease, "/reset", body={"x": 1})
    assert sent.status == 504 and sent.code == "DOWNSTREAM_TIMEOUT"
    assert sent.headers["Fence-Effect-State"] == "UNKNOWN"
    assert len(downstream.calls()) == 1


async def test_connect_failure_is_not_applied_and_may_go_again(
    api: Api, downstream: Downstream
) -> None:
    lease = await task_with_lease(api)
    dead = await send(api, lease, "/proxy/dead/pay", body={"x": 1})
    assert dead.status == 502 and dead.code == "DOWNSTREAM_UNREACHABLE"
    assert dead.headers["Fence-Effect-State"] == "NOT_APPLIED"
    # The same payload goes again (and fails again): NOT_APPLIED never blocks a retry.
    again = await send(api, lease, "/proxy/dead/pay", body={"x": 1})
    assert again.code == "DOWNSTREAM_UNREACHABLE"
    # A different payload for the slot is rebound to the new digest and forwarded.
    moved = await send(api, lease, "/proxy/api/ok/pay", body={"x": 1})
    assert moved.status == 200 and moved.headers["Fence-Effect-State"] == "COMMITTED"
    record = (await api.call("GET", f"/v1/effects/{moved.headers['Fence-Effect-Id']}")).body
    assert [a["outcome"] for a in record["attempts"]] == ["NOT_APPLIED", "NOT_APPLIED", "COMMITTED"]
    assert record["downstream"] == "api"
    assert len(downstream.calls()) == 1


async def test_prepared_past_deadline_reads_unknown(api: Api, downstream: Downstream) -> None:
    """A gateway that died mid-forward never leaves an effect stuck in flight."""
    lease = await task_with_lease(api)
    digest = payload_digest("POST", "api", "/ok/pay", b"{}")
    outcome = await api.store.prepare_effect(
        EffectRequest(
            Fence("t1", lease.attempt_id, lease.claim_generation, 1, 0),
            "main",
            "s1",
            "api",
            "POST",
            "/ok/pay",
            digest,
        ),
        1_000,
    )
    eid = outcome.effect.effect_id
    assert (await api.call("GET", f"/v1/effects/{eid}")).body["state"] == "PREPARED"
    api.advance(1_000)
    record = (await api.call("GET", f"/v1/effects/{eid}")).body
    assert record["state"] == "UNKNOWN"
    assert record["attempts"][0]["reason"] == "deadline passed"
    sent = await send(api, lease, body={})
    assert sent.status == 409 and sent.code == "EFFECT_UNKNOWN"
    unknown = await api.call("GET", "/v1/effects?state=UNKNOWN")
    assert [e["effectId"] for e in unknown.body["effects"]] == [eid]
    assert not downstream.calls()


async def test_late_completion_never_clobbers_a_newer_record(api: Api) -> None:
    lease = await task_with_lease(api)
    fence = Fence("t1", lease.attempt_id, lease.claim_generation, 1, 0)
    request = EffectRequest(fence, "main", "s1", "api", "POST", "/ok/pay", "d1")
    first = await api.store.prepare_effect(request, 1_000)
    api.advance(1_000)  # the first forward's gateway is presumed dead: UNKNOWN
    resolved = await api.call(
        "POST",
        f"/v1/effects/{first.effect.effect_id}/resolve",
        # force: within settle_ms of the presumed-dead forward (tests/test_resolve_landing.py)
        {"outcome": "NOT_APPLIED", "note": "checked the downstream: nothing there", "force": True},
    )
    assert resolved.status == 200
    second = await api.store.prepare_effect(request, 10_000)
    assert second.seq == 1
    done, applied = await api.store.complete_effect(
        "t1",
        second.effect.effect_id,
        1,
        lease.attempt_id,
        EffectState.COMMITTED,
        "status 200",
        '{"status": 200}',
    )
    assert applied and done.state is EffectState.COMMITTED
    # The first forward's answer arrives at last: it must not overwrite anything.
    late, applied = await api.store.complete_effect(
        "t1", first.effect.effect_id, 0, lease.attempt_id, EffectState.NOT_APPLIED, "late", None
    )
    assert not applied and late.state is EffectState.COMMITTED
    assert (await api.store.get_effect(first.effect.effect_id)).state is EffectState.COMMITTED


async def test_slow_forward_completion_fills_in_a_deadline_unknown(api: Api) -> None:
    lease = await task_with_lease(api)
    fence = Fence("t1", lease.attempt_id, lease.claim_generation, 1, 0)
    request = EffectRequest(fence, "main", "s1", "api", "POST", "/ok/pay", "d1")
    first = await api.store.prepare_effect(request, 1_000)
    api.advance(1_000)
    assert (await api.store.get_effect(first.effect.effect_id)).state is EffectState.UNKNOWN
    done, applied = await api.store.complete_effect(
        "t1",
        first.effect.effect_id,
        0,
        lease.attempt_id,
        EffectState.COMMITTED,
        "status 200",
        '{"status": 200}',
    )
    assert applied and done.state is EffectState.COMMITTED


# --- fencing --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "code"),
    [
        ({"Fence-Generation": "99"}, "FENCED"),
        ({"Fence-Attempt": "not-the-attempt"}, "FENCED"),
        ({"Fence-Epoch": "7"}, "STALE_EPOCH"),
        ({"Fence-Cancel": "3"}, "CANCELLED"),
        ({"Fence-Task": "no-such-task"}, "NO_SUCH_TASK"),
    ],
)
@pytest.mark.parametrize("method", ["POST", "GET"])
async def test_stale_claims_are_refused_before_any_byte_leaves(
    api: Api, downstream: Downstream, override: dict[str, str], code: str, method: str
) -> None:
    lease = await task_with_lease(api)
    async with api.client.request(
        method,
        "/proxy/api/ok/pay",
        json={} if method == "POST" else None,
        headers=fence_headers(lease, **override),
    ) as resp:
        body = await resp.json()
    assert body["code"] == code
    assert not downstream.calls()
    assert (await api.call("GET", "/v1/effects")).body["effects"] == []


async def test_expired_lease_epoch_bump_cancel_and_takeover_fence_effects(
    api: Api, downstream: Downstream
) -> None:
    lease = await task_with_lease(api, ttl_ms=1_000)
    api.advance(1_000)
    assert (await send(api, lease, body={})).code == "LEASE_EXPIRED"
    fresh = await api.claim("t1", "w2")
    assert (await send(api, lease, body={})).code == "FENCED"
    await api.call("POST", "/v1/epoch/bump")
    assert (await send(api, fresh, body={})).code == "STALE_EPOCH"
    newest = await api.claim("t1", "w3")
    await api.cancel("t1")
    assert (await send(api, newest, body={})).code == "CANCELLED"
    assert not downstream.calls()


async def test_safe_methods_are_fence_checked_and_not_recorded(
    api: Api, downstream: Downstream
) -> None:
    lease = await task_with_lease(api)
    for method in ("GET", "HEAD", "OPTIONS"):
        sent = await send(api, lease, "/ok/read", method=method, slot=None)
        assert sent.status == 200, method
        assert sent.headers["Fence-Effect-State"] == "NONE"
        assert sent.headers["Fence-Replayed"] == "false"
    assert len(downstream.calls()) == 3
    assert (await api.call("GET", "/v1/effects")).body["effects"] == []


# --- the lost answer (background note 003) -----------------------------------------------------


async def test_lost_answer_takeover_cannot_repeat_or_change_the_effect(
    api: Api, downstream: Downstream
) -> None:
    await api.put("t1")
    a = await api.claim("t1", "A", ttl_ms=2_000)
    x = {"to": "alice", "amount": 10}
    lost = await send(api, a, TIMED_OUT, body=x)
    assert lost.status == 504 and lost.headers["Fence-Effect-State"] == "UNKNOWN"
    api.advance(2_000)  # A's lease lapses
    b = await api.claim("t1", "B")
    y = await send(api, b, TIMED_OUT, body={"to": "alice", "amount": 11})
    assert y.status == 422 and y.code == "PAYLOAD_CONFLICT"
    again = await send(api, b, TIMED_OUT, body=x)
    assert again.status == 409 and again.code == "EFFECT_UNKNOWN"
    await asyncio.wait_for(downstream.arrived.wait(), HANG_S)  # the lost call, once
    assert len(downstream.calls()) == 1
    assert (await send(api, a, TIMED_OUT, body=x)).code == "FENCED"


async def test_fifty_identical_concurrent_calls_forward_once(
    api: Api, downstream: Downstream
) -> None:
    lease = await task_with_lease(api)
    answers = await asyncio.gather(
        *(send(api, lease, "/slow/100/pay", body={"x": 1}) for _ in range(50))
    )
    statuses = sorted((a.status, a.code or a.headers["Fence-Replayed"]) for a in answers)
    assert len(downstream.calls()) == 1
    forwarded = [a for a in answers if a.status == 200 and a.headers["Fence-Replayed"] == "false"]
    assert len(forwarded) == 1, statuses
    for answer in answers:
        assert (answer.status == 200 and answer.headers["Fence-Replayed"] in ("true", "false")) or (
            answer.status == 409 and answer.code == "EFFECT_IN_FLIGHT"
        ), statuses


# --- headers and bodies ---------------------------------------------------------------------


@pytest.mark.one_store
async def test_forwarded_and_answered_headers_are_cleaned(api: Api, downstream: Downstream) -> None:
    lease = await task_with_lease(api)
    sent = await send(
        api,
        lease,
        "/cookie",
        body={},
        headers={
            "Authorization": "Bearer agent-token",
            "Idempotency-Key": "agent-chosen",
            "Fencing-Token": "9.9",
            "Connection": "X-Hop",
            "X-Hop": "drop me",
            "X-Custom": "keep me",
        },
    )
    (call,) = downstream.calls()
    assert "Authorization" not in call.headers
    assert "X-Hop" not in call.headers
    assert not any(name.lower().startswith("fence-") for name in call.headers)
    assert call.headers["X-Custom"] == "keep me"
    assert call.headers["Idempotency-Key"] == sent.headers["Fence-Effect-Id"]
    assert call.headers["Fencing-Token"] == f"1.{lease.claim_generation}"
    assert call.headers["Host"] == f"127.0.0.1:{downstream.port}"
    # The live answer keeps the cookie; hop-by-hop fields and a spoofed Fence-* do not pass.
    assert sent.headers["Set-Cookie"] == "session=secret"
    assert "X-Private" not in sent.headers
    assert sent.headers["X-Kept"] == "yes"
    assert sent.headers["Fence-Replayed"] == "false"
    replay = await send(api, lease, "/cookie", body={})
    assert replay.headers["Fence-Replayed"] == "true"
    assert "Set-Cookie" not in replay.headers
    assert replay.headers["X-Kept"] == "yes"


@pytest.mark.one_store
async def test_redirects_are_not_followed(api: Api, downstream: Downstream) -> None:
    lease = await task_with_lease(api)
    sent = await send(api, lease, "/redirect", body={})
    assert sent.status == 302
    assert sent.headers["Location"] == "http://127.0.0.2:1/elsewhere"
    assert len(downstream.calls()) == 1


async def test_large_response_answered_once_then_replayed_without_body(
    api: Api, downstream: Downstream
) -> None:
    lease = await task_with_lease(api)
    first = await send(api, lease, "/big/5000", body={})
    assert first.status == 200 and len(first.body) == 5000
    again = await send(api, lease, "/big/5000", body={})
    assert again.status == 200 and again.body == b""
    assert again.headers["Fence-Replayed"] == "true"
    assert again.headers["Fence-Replay-Body"] == "omitted"
    assert len(downstream.calls()) == 1


@pytest.mark.one_store
async def test_query_string_is_forwarded_and_part_of_the_payload(
    api: Api, downstream: Downstream
) -> None:
    lease = await task_with_lease(api)
    await send(api, lease, "/ok/pay?currency=eur&x=a%20b", body={})
    assert downstream.calls()[0].path == "/ok/pay?currency=eur&x=a%20b"
    other = await send(api, lease, "/ok/pay?currency=usd&x=a%20b", body={})
    assert other.code == "PAYLOAD_CONFLICT"


# --- hostile input --------------------------------------------------------------------------


async def raw_request(api: Api, request: bytes) -> tuple[int, bytes]:
    port = api.client.server.port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    data = await reader.read(65536)
    writer.close()
    await writer.wait_closed()
    status = int(data.split(b" ", 2)[1])
    return status, data


def raw(lease: Lease, target: str, extra: str = "", body: bytes = b"{}") -> bytes:
    headers = "".join(f"{k}: {v}\r\n" for k, v in fence_headers(lease).items())
    return (
        f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}{extra}"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


@pytest.mark.one_store
@pytest.mark.parametrize(
    "target",
    [
        "/proxy/api/../v1/epoch",
        "/proxy/api/ok/../../x",
        "/proxy/api/%2e%2e/x",
        "/proxy/api/ok/%2E%2e/x",
        "/proxy/api/a%2Fb",
        "/proxy/api/a%5cb",
        "/proxy/api/a\\b",
        "/proxy/api/./x",
        "http://127.0.0.1:1/proxy/api/ok",
        "/proxy/nope/ok",
        "/proxy/ap%69/ok",
    ],
)
async def test_paths_that_could_escape_are_refused(
    api: Api, downstream: Downstream, target: str
) -> None:
    lease = await task_with_lease(api)
    status, data = await raw_request(api, raw(lease, target))
    assert 400 <= status < 500, data
    assert not downstream.calls()


@pytest.mark.one_store
@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ("Content-Length: 2\r\n", b""),  # duplicate framing header (same value twice)
        ("Transfer-Encoding: chunked\r\n", b""),  # CL and TE together
        ("Fence-Task: other\r\n", b"Fence-Task"),  # duplicate Fence header
    ],
)
async def test_ambiguous_framing_and_duplicate_fence_headers_are_refused(
    api: Api, downstream: Downstream, extra: str, fragment: bytes
) -> None:
    lease = await task_with_lease(api)
    status, data = await raw_request(api, raw(lease, "/proxy/api/ok", extra))
    assert 400 <= status < 500, data
    assert fragment in data
    assert not downstream.calls()


@pytest.mark.one_store
@pytest.mark.parametrize(
    ("drop", "override", "needle"),
    [
        ("Fence-Task", {}, "Fence-Task"),
        ("Fence-Attempt", {}, "Fence-Attempt"),
        ("Fence-Generation", {}, "Fence-Generation"),
        ("Fence-Epoch", {}, "Fence-Epoch"),
        ("Fence-Cancel", {}, "Fence-Cancel"),
        ("Fence-Slot", {}, "Fence-Slot"),
        (None, {"Fence-Generation": "1.5"}, "Fence-Generation"),
        (None, {"Fence-Generation": "-1"}, "Fence-Generation"),
        (None, {"Fence-Generation": "01"}, "Fence-Generation"),
        (None, {"Fence-Epoch": "99999999999999999999"}, "Fence-Epoch"),
        (None, {"Fence-Task": "bad task"}, "Fence-Task"),
        (None, {"Fence-Slot": "x" * 201}, "Fence-Slot"),
        (None, {"Fence-Node": "a b"}, "Fence-Node"),
    ],
)
async def test_missing_or_malformed_fence_headers_are_400(
    api: Api, downstream: Downstream, drop: str | None, override: dict[str, str], needle: str
) -> None:
    lease = await task_with_lease(api)
    headers = fence_headers(lease, **override)
    if drop:
        headers.pop(drop)
    async with api.client.post("/proxy/api/ok", json={}, headers=headers) as resp:
        body = await resp.json()
        assert resp.status == 400
        assert resp.headers["Fence-Replayed"] == "false"
    assert body["code"] == "BAD_REQUEST" and needle in body["detail"]
    assert not downstream.calls()


@pytest.mark.one_store
async def test_unknown_downstream_is_404(api: Api, downstream: Downstream) -> None:
    lease = await task_with_lease(api)
    sent = await send(api, lease, "/proxy/nowhere/x", body={})
    assert sent.status == 404 and sent.code == "NO_SUCH_DOWNSTREAM"


@pytest.mark.one_store
async def test_oversized_bodies_are_413_and_not_forwarded(api: Api, downstream: Downstream) -> None:
    lease = await task_with_lease(api)
    small = await send(api, lease, "/proxy/small/ok", data=b"x" * 4096)
    assert small.status == 413 and small.code == "PAYLOAD_TOO_LARGE"
    huge = await send(api, lease, data=io.BytesIO(b"x" * (2 * 1024 * 1024)))
    assert huge.status == 413 and huge.code == "PAYLOAD_TOO_LARGE"
    assert not downstream.calls()


@pytest.mark.one_store
async def test_connect_and_trace_are_refused(api: Api, downstream: Downstream) -> None:
    lease = await task_with_lease(api)
    sent = await send(api, lease, "/ok", method="TRACE")
    assert sent.status == 405
    assert not downstream.calls()


# --- the ledger API -------------------------------------------------------------------------


async def test_list_filters_and_cursor(api: Api) -> None:
    lease = await task_with_lease(api)
    for i in range(5):
        await send(api, lease, f"/ok/{i}", slot=f"s{i}", body={})
    await send(api, lease, "/status/500", slot="bad", body={})
    await send(api, lease, "/proxy/dead/x", slot="dead", body={})
    every = (await api.call("GET", "/v1/effects?limit=500")).body
    assert len(every["effects"]) == 7 and every["nextCursor"] is None
    seen, cursor = [], None
    while True:
        page = (
            await api.call("GET", "/v1/effects?limit=2" + (f"&cursor={cursor}" if cursor else ""))
        ).body
        assert len(page["effects"]) <= 2
        seen += [e["effectId"] for e in page["effects"]]
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert seen == [e["effectId"] for e in every["effects"]]
    by_state = (await api.call("GET", "/v1/effects?state=UNKNOWN")).body["effects"]
    assert [e["slot"] for e in by_state] == ["bad"]
    by_downstream = (await api.call("GET", "/v1/effects?downstream=dead")).body["effects"]
    assert [e["state"] for e in by_downstream] == ["NOT_APPLIED"]
    by_task = (await api.call("GET", "/v1/effects?taskId=t1&state=COMMITTED")).body["effects"]
    assert len(by_task) == 5
    assert (await api.call("GET", "/v1/effects?taskId=other")).body["effects"] == []


@pytest.mark.one_store
@pytest.mark.parametrize(
    "query",
    ["state=DONE", "limit=0", "limit=501", "limit=x", "cursor=zzz", "taskId=a%20b", "color=red"],
)
async def test_bad_list_queries_are_400(api: Api, query: str) -> None:
    answer = await api.call("GET", f"/v1/effects?{query}")
    assert answer.status == 400 and answer.code == "BAD_REQUEST"


async def test_show_unknown_effect_is_404(api: Api) -> None:
    assert (await api.call("GET", f"/v1/effects/{'0' * 64}")).code == "NO_SUCH_EFFECT"
    assert (await api.call("GET", "/v1/effects/not-an-id")).code == "NO_SUCH_EFFECT"


async def test_resolve_unknown_as_committed_then_duplicates_replay_it(
    api: Api, downstream: Downstream
) -> None:
    lease = await task_with_lease(api)
    sent = await send(api, lease, "/status/502", body={"x": 1})
    eid = sent.headers["Fence-Effect-Id"]
    resolved = await api.client.post(
        f"/v1/effects/{eid}/resolve",
        json={
            "outcome": "COMMITTED",
            "note": "seen in the payments console",
            "response": {"status": 201, "headers": {"X-Ref": "p-1"}, "body": '{"id":1}'},
        },
        headers={"Fence-Operator": "alice"},
    )
    body = await resolved.json()
    assert resolved.status == 200 and body["state"] == "COMMITTED"
    (action,) = body["actions"]
    assert action["action"] == "resolve" and action["by"] == "alice"
    assert action["note"] == "seen in the payments console"
    assert action["outcome"] == "COMMITTED" and isinstance(action["at"], int)
    replay = await send(api, lease, "/status/502", body={"x": 1})
    assert replay.status == 201 and replay.body == b'{"id":1}'
    assert replay.headers["X-Ref"] == "p-1" and replay.headers["Fence-Replayed"] == "true"
    assert len(downstream.calls()) == 1
    settled = await api.call(
        "POST", f"/v1/effects/{eid}/resolve", {"outcome": "NOT_APPLIED", "note": "oops"}
    )
    assert settled.status == 409 and settled.code == "EFFECT_SETTLED"


async def test_resolve_unknown_as_not_applied_lets_the_effect_go_again(
    api: Api, downstream: Downstream
) -> None:
    lease = await task_with_lease(api)
    sent = await send(api, lease, "/status/500", body={"x": 1})
    eid = sent.headers["Fence-Effect-Id"]
    answer = await api.call(
        "POST",
        f"/v1/effects/{eid}/resolve",
        # force: within settle_ms of the 500 (tests/test_resolve_landing.py)
        {"outcome": "NOT_APPLIED", "note": "not in the downstream", "force": True},
    )
    assert answer.status == 200 and answer.body["state"] == "NOT_APPLIED"
    again = await send(api, lease, "/ok/pay", body={"x": 1})
    assert again.status == 200 and again.headers["Fence-Effect-State"] == "COMMITTED"
    assert len(downstream.calls()) == 2
    assert downstream.calls()[1].headers["Idempotency-Key"] == eid  # the original key


@pytest.mark.one_store
@pytest.mark.parametrize(
    "body",
    [
        {"outcome": "UNKNOWN", "note": "x"},
        {"outcome": "COMMITTED"},
        {"outcome": "COMMITTED", "note": ""},
        {"outcome": "COMMITTED", "note": "x", "response": {"status": 99}},
        {"outcome": "COMMITTED", "note": "x", "extra": 1},
    ],
)
async def test_bad_resolve_bodies_are_400(api: Api, body: dict[str, Any]) -> None:
    lease = await task_with_lease(api)
    sent = await send(api, lease, "/status/500", body={})
    answer = await api.call("POST", f"/v1/effects/{sent.headers['Fence-Effect-Id']}/resolve", body)
    assert answer.status == 400 and answer.code == "BAD_REQUEST"
    record = await api.call("GET", f"/v1/effects/{sent.headers['Fence-Effect-Id']}")
    assert record.body["state"] == "UNKNOWN"


async def test_resolve_in_flight_effect_is_refused(api: Api) -> None:
    lease = await task_with_lease(api)
    fence = Fence("t1", lease.attempt_id, lease.claim_generation, 1, 0)
    outcome = await api.store.prepare_effect(
        EffectRequest(fence, "main", "s1", "api", "POST", "/ok", "d"), 60_000
    )
    answer = await api.call(
        "POST",
        f"/v1/effects/{outcome.effect.effect_id}/resolve",
        {"outcome": "COMMITTED", "note": "guess"},
    )
    assert answer.status == 409 and answer.code == "EFFECT_IN_FLIGHT"


async def test_node_and_revision_make_distinct_effects(api: Api, downstream: Downstream) -> None:
    lease = await task_with_lease(api)
    a = await send(api, lease, body={}, headers={"Fence-Node": "step-1"})
    b = await send(api, lease, body={}, headers={"Fence-Node": "step-2"})
    assert a.headers["Fence-Effect-Id"] == effect_id("t1", 1, "step-1", "s1")
    assert b.headers["Fence-Effect-Id"] == effect_id("t1", 1, "step-2", "s1")
    await api.put("t1", "in-2")
    fresh = await api.claim("t1", "w2")
    c = await send(api, fresh, body={"other": True})
    assert c.status == 200
    assert c.headers["Fence-Effect-Id"] == effect_id("t1", 2, "main", "s1")
    assert len(downstream.calls()) == 3


async def test_resolve_without_response_replays_what_was_recorded_or_says_none(
    api: Api, downstream: Downstream
) -> None:
    lease = await task_with_lease(api)
    answered = await send(api, lease, "/status/500", body={"x": 1})
    silent = await send(api, lease, TIMED_OUT, slot="s2", body={"x": 1})
    for sent in (answered, silent):
        eid = sent.headers["Fence-Effect-Id"]
        ok = await api.call(
            "POST", f"/v1/effects/{eid}/resolve", {"outcome": "COMMITTED", "note": "it happened"}
        )
        assert ok.status == 200
    replay = await send(api, lease, "/status/500", body={"x": 1})
    assert replay.status == 500 and replay.headers["Fence-Replayed"] == "true"
    assert json.loads(replay.body)["calls"] == 1
    none = await send(api, lease, TIMED_OUT, slot="s2", body={"x": 1})
    assert none.status == 204 and none.headers["Fence-Replay-Body"] == "none"
    assert none.headers["Fence-Replayed"] == "true"


async def test_a_prepare_the_gateway_never_forwarded_is_aborted_by_its_forward_id(
    api: Api, downstream: Downstream
) -> None:
    """What the gateway does after a 503 at the first step (the store may have applied the
    prepare without answering): find the record by forward id and make it NOT_APPLIED."""
    from fencegate.ledger import effects

    lease = await task_with_lease(api)
    fence = Fence("t1", lease.attempt_id, lease.claim_generation, 1, 0)
    digest = payload_digest("POST", "api", "/ok/pay", b"{}")
    request = EffectRequest(fence, "main", "s1", "api", "POST", "/ok/pay", digest, "fwd-1")
    prepared = await api.store.prepare_effect(request, 60_000)
    assert await api.store.find_forward("t1", "fwd-2") is None
    found = await api.store.find_forward("t1", "fwd-1")
    assert found == prepared.effect.effect_id
    aborted = await api.store.update_effect(
        found, lambda record, now: effects.abort(record, "fwd-1", now)
    )
    assert aborted.state is EffectState.NOT_APPLIED
    assert aborted.attempts[-1].reason == effects.ABORT_REASON
    # Another forward's abort cannot touch it, and the same call now goes through.
    with pytest.raises(FencegateError):
        await api.store.update_effect(found, lambda r, now: effects.abort(r, "fwd-1", now))
    sent = await send(api, lease, body={})
    assert sent.status == 200 and sent.headers["Fence-Effect-State"] == "COMMITTED"
    assert len(downstream.calls()) == 1
