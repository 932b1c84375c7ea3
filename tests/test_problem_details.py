"""Every problem's ``detail`` names what it is about (issue 27, item 6): the task, the effect,
the downstream by its configured name, the agent's method and path (never the query string),
the limit that fired with its config key and value; never a downstream's address.

The test walks the whole wire table (``ledger.errors.ERRORS_BY_CODE`` and
``gateway.problems.ROUTING_PROBLEMS``): each code is provoked through the real gateway and its
detail checked for what it must name; a code that cannot be provoked here must be listed in
``NOT_PROVOKED`` with the reason, and a code the table gains that is neither fails the test.

Protocol layer: SQLite only. That the stores say the same words for their own refusals
(NO_SUCH_TASK, FENCED, LEASE_EXPIRED, ...: Lua included) is held on every store by
``test_the_store_refusals_name_their_object_on_every_store`` below and, against the model,
by tests/test_stateful.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.auth import token_sha256
from fencegate.gateway.problems import ROUTING_PROBLEMS
from fencegate.ledger.errors import ERRORS_BY_CODE
from fencegate.ledger.store import Store
from fencegate.ledger.tasks import ClaimRequest, Identity, RenewRequest
from tests.api import HANG_S, Api, Lease, until
from tests.clocks import still
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.relay import Blackhole
from tests.servers import refused_port
from tests.test_proxy import fence_headers

#: Every code the gateway answers with.
TABLE = {*ERRORS_BY_CODE, *(code for code, _ in ROUTING_PROBLEMS.values())}

#: Codes this test does not provoke, each with the reason.
NOT_PROVOKED: dict[str, str] = {
    "AUTH_UNAVAILABLE": "needs an OAuth issuer whose JWKS is down: tests/test_oauth.py "
    "provokes it and checks its detail names the request",
}

EID = "ab" * 32
TOKENS = {"ops": "tok-ops-1", "watcher": "tok-watch-1", "slow": "tok-slow-1"}


@dataclass
class Env:
    """One gateway in-process (SQLite), the test downstream and what must never show."""

    api: Api
    downstream: Downstream
    #: Strings no detail may hold: the downstreams' addresses and a query's secret.
    secrets: tuple[str, ...]

    @property
    def store(self) -> Store:
        return self.api.store

    async def problem(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        async with self.api.client.request(
            method, path, json=body, data=data, headers=headers
        ) as resp:
            text = await resp.text()
        assert resp.content_type == "application/problem+json", (resp.status, text)
        self.never_said(text)
        problem: dict[str, Any] = json.loads(text)
        assert problem["status"] == resp.status, problem
        return problem

    def never_said(self, text: str) -> None:
        for secret in self.secrets:
            assert secret not in text, (secret, text)

    async def lease(self, task_id: str, ttl_ms: int = 30_000, **put: Any) -> Lease:
        answer = await self.api.put(task_id, **put)
        assert answer.status in (200, 201), answer.body
        return await self.api.claim(task_id, ttl_ms=ttl_ms)

    async def proxy(
        self, lease: Lease, target: str, slot: str | None = "s1", body: Any = None
    ) -> tuple[dict[str, Any], Any]:
        """A proxied call under ``lease``: its problem and its answer headers."""
        async with self.api.client.post(
            f"/proxy/{target}", json={"n": 1} if body is None else body,
            headers=fence_headers(lease, slot),
        ) as resp:  # fmt: skip
            text = await resp.text()
            headers = resp.headers
        assert resp.content_type == "application/problem+json", (resp.status, text)
        self.never_said(text)
        return json.loads(text), headers


@contextlib.asynccontextmanager
async def gateway(
    tmp_path: Any, downstream: Downstream, *, auth: bool = False, **sections: Any
) -> AsyncIterator[Env]:
    dead = f"http://127.0.0.1:{refused_port()}"  # held bound: nobody can take it meanwhile
    common = {"timeout_ms": 300, "connect_timeout_ms": 10_000}
    config = make_config(
        f"sqlite:///{tmp_path / f'fg-{len(list(tmp_path.iterdir()))}.db'}",
        downstreams=[
            {"name": "plain", "url": downstream.url, **common},
            {"name": "gated", "url": downstream.url, "adapter": "manual",
             "require_approval": True, **common},
            {"name": "small", "url": downstream.url, "max_body_bytes": 8, **common},
            {"name": "dead", "url": dead, **common},
            *sections.pop("extra_downstreams", []),
        ],
        reconciler={"enabled": False},
        **({"auth": _auth()} if auth else {}),
        **sections,
    )  # fmt: skip
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    secrets = tuple(
        s
        for d in config.downstreams
        for s in (d.url, d.url.removeprefix("http://"), f":{d.url.rsplit(':', 1)[1]}")
    )
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Env(Api(client), downstream, (*secrets, "s3cret"))


def _auth() -> dict[str, Any]:
    roles = {"ops": ["operator", "scheduler", "worker"], "watcher": ["observer"]}
    principals: list[dict[str, Any]] = [
        {"name": name, "roles": roles[name], "token_sha256": token_sha256(TOKENS[name])}
        for name in ("ops", "watcher")
    ]
    principals.append({"name": "slow", "roles": ["observer"], "rate_per_second": 0.001,
                       "burst": 1, "token_sha256": token_sha256(TOKENS["slow"])})  # fmt: skip
    return {"principals": principals}


def bearer(name: str) -> dict[str, str]:
    return {"Fence-Authorization": f"Bearer {TOKENS[name]}"}


async def raw(port: int, data: bytes) -> dict[str, Any]:
    """One raw exchange: the problem of the answer (its head, then Content-Length bytes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG_S)
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        problem: dict[str, Any] = json.loads(
            await asyncio.wait_for(reader.readexactly(length), HANG_S)
        )
        return problem
    finally:
        writer.close()


# --- the provocations: code -> (problem, what its detail must name) ------------------------

Provoked = tuple[dict[str, Any], list[str]]
Provoke = Callable[[Any, Downstream], Awaitable[Provoked]]
PROVOKE: dict[str, Provoke] = {}


def provokes(code: str) -> Callable[[Provoke], Provoke]:
    def register(fn: Provoke) -> Provoke:
        PROVOKE[code] = fn
        return fn

    return register


@provokes("BAD_REQUEST")
async def _bad_request(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        return await env.problem("PUT", "/v1/tasks/t1", body={}), ["inputDigest"]


@provokes("UNAUTHENTICATED")
async def _unauthenticated(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream, auth=True) as env:
        return await env.problem("GET", "/v1/tasks/t1?token=s3cret"), ["GET /v1/tasks/t1"]


@provokes("FORBIDDEN")
async def _forbidden(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream, auth=True) as env:
        problem = await env.problem(
            "PUT", "/v1/tasks/t1", body={"inputDigest": "i"}, headers=bearer("watcher")
        )
        return problem, ["PUT /v1/tasks/t1", "'watcher'"]


@provokes("RATE_LIMITED")
async def _rate_limited(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream, auth=True) as env:
        async with env.api.client.get("/v1/epoch", headers=bearer("slow")) as resp:
            assert resp.status == 200
        problem = await env.problem("GET", "/v1/epoch", headers=bearer("slow"))
        return problem, ["GET /v1/epoch", "'slow'", "rate_per_second = 0.001"]


@provokes("NOT_FOUND")
async def _not_found(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        return await env.problem("GET", "/v1/nowhere?token=s3cret"), ["GET /v1/nowhere"]


@provokes("METHOD_NOT_ALLOWED")
async def _method_not_allowed(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        return await env.problem("PATCH", "/v1/epoch"), ["PATCH /v1/epoch"]


@provokes("INTERNAL")
async def _internal(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:

        async def broken() -> Any:
            raise RuntimeError("a bug")

        env.store.get_scheduler = broken  # type: ignore[method-assign]
        return await env.problem("GET", "/v1/epoch?token=s3cret"), ["GET /v1/epoch"]


@provokes("STORE_UNAVAILABLE")
async def _store_unavailable(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        await env.store.close()
        return await env.problem("GET", "/v1/tasks/t1"), ["SQLite"]


@provokes("UNSUPPORTED_MEDIA_TYPE")
async def _media_type(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        problem = await env.problem(
            "PUT", "/v1/tasks/t1", data=b"x", headers={"Content-Type": "text/plain"}
        )
        return problem, ["PUT /v1/tasks/t1", "text/plain"]


@provokes("MISDIRECTED_REQUEST")
async def _misdirected(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        problem = await env.problem("POST", "/v1/epoch/bump", headers={"Host": "evil.example"})
        return problem, ["POST /v1/epoch/bump", "evil.example", "server.allowed_hosts"]


@provokes("HTTP_VERSION_NOT_SUPPORTED")
async def _http_version(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        port = env.api.client.server.port
        line = f"GET /v1/epoch HTTP/2.0\r\nHost: 127.0.0.1:{port}\r\n\r\n"
        return await raw(port, line.encode()), ["HTTP/2.0"]


@provokes("REQUEST_TIMEOUT")
async def _request_timeout(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream, server={"body_timeout_ms": 100}) as env:
        port = env.api.client.server.port
        head = (
            f"POST /v1/tasks/t1/claim?token=s3cret HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        )
        problem = await raw(port, head.encode() + b'{"owner": "w')
        return problem, ["POST /v1/tasks/t1/claim", "server.body_timeout_ms = 100"]


@provokes("TOO_MANY_CONNECTIONS")
async def _too_many(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream, events={"max_subscribers": 1}) as env:
        held = await env.api.client.get("/v1/events")
        try:
            assert held.status == 200
            problem = await env.problem("GET", "/v1/events")
        finally:
            held.close()
        return problem, ["GET /v1/events", "events.max_subscribers (1)"]


@provokes("EVENTS_GONE")
async def _events_gone(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        _, old = await env.store.read_events(None, 1)
        for n in range(5):
            await env.api.put(f"t{n}")
        await env.store.trim_events(1)
        problem = await env.problem("GET", "/v1/events", headers={"Last-Event-ID": old})
        return problem, ["GET /v1/events", "position"]


# --- the tasks ------------------------------------------------------------------------------


@provokes("NO_SUCH_TASK")
async def _no_such_task(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        return await env.problem("GET", "/v1/tasks/ghost-1"), ["task ghost-1"]


@provokes("TASK_EXPIRED")
async def _task_expired(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        await _expired(env)
        return await env.problem("GET", "/v1/tasks/old-1"), ["task old-1"]


@provokes("EFFECT_EXPIRED")
async def _effect_expired(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        effect_id = await _expired(env)
        return await env.problem("GET", f"/v1/effects/{effect_id}"), [f"effect {effect_id}"]


async def _expired(env: Env) -> str:
    """Task ``old-1``, committed with one committed effect, gone with retention: the id of
    its effect."""
    lease = await env.lease("old-1")
    async with env.api.client.post(
        "/proxy/plain/ok/x", json={"n": 1}, headers=fence_headers(lease, "s1")
    ) as resp:
        assert resp.status == 200
        effect_id = resp.headers["Fence-Effect-Id"]
    assert (await env.api.commit(lease)).status == 200
    env.api.advance(2_000)
    report = await env.store.expire_settled(1_000, 3_600_000, 100)
    assert report.expired_tasks == 1, report
    return effect_id


@provokes("CLAIMED")
async def _claimed(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        await env.lease("t1")
        return (await env.api.try_claim("t1", "w2")).body, ["task t1"]


@provokes("DEPENDENCIES_PENDING")
async def _dependencies(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        await env.api.put("dep-a")
        await env.api.put("t1", dependsOn=["dep-a"])
        return (await env.api.try_claim("t1")).body, ["task t1", "dep-a"]


@provokes("FENCED")
async def _fenced(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        lease = await env.lease("t1")
        return (await env.api.renew(lease, attemptId="0" * 32)).body, ["task t1"]


@provokes("LEASE_EXPIRED")
async def _lease_expired(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        lease = await env.lease("t1", ttl_ms=1_000)
        env.api.advance(2_000)
        return (await env.api.renew(lease)).body, ["task t1", "leaseExpiresAt"]


@provokes("STALE_EPOCH")
async def _stale_epoch(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        lease = await env.lease("t1")
        await env.api.call("POST", "/v1/epoch/bump")
        return (await env.api.renew(lease)).body, ["task t1", "schedulerEpoch"]


@provokes("CANCELLED")
async def _cancelled(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        lease = await env.lease("t1")
        await env.api.cancel("t1")
        return (await env.api.renew(lease)).body, ["task t1"]


@provokes("STALE_INPUT")
async def _stale_input(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        await env.api.put("t1")
        answer = await env.api.try_claim("t1", expectedRevision=5)
        return answer.body, ["task t1", "expectedRevision 5"]


@provokes("ALREADY_COMMITTED")
async def _already_committed(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        lease = await env.lease("t1")
        assert (await env.api.commit(lease)).status == 200
        return (await env.api.try_claim("t1")).body, ["task t1"]


@provokes("RUNTIME_EXCEEDED")
async def _runtime(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        lease = await env.lease("t1", maxRuntimeMs=1_000)  # the lease ends at the runtime
        return (await env.api.renew(lease)).body, ["task t1", "runtimeEndsAt"]


@provokes("CLAIMS_PAUSED")
async def _claims_paused(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        await env.api.put("t1")
        assert (await env.api.call("POST", "/v1/claims/pause")).status == 200
        by_queue = await env.api.call(
            "POST", "/v1/queues/q1/claim", {"owner": "w", "ttlMs": 1000, "schedulerEpoch": 1}
        )
        assert by_queue.code == "CLAIMS_PAUSED" and "queue q1" in by_queue.body["detail"]
        return (await env.api.try_claim("t1")).body, ["task t1"]


# --- the effects and the downstreams --------------------------------------------------------


@provokes("NO_SUCH_EFFECT")
async def _no_such_effect(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        return await env.problem("GET", f"/v1/effects/{EID}"), [f"effect {EID}"]


@provokes("IDEMPOTENCY_KEY_REQUIRED")
async def _key_required(tmp_path: Any, downstream: Downstream) -> Provoked:
    keyed = {"name": "keyed", "url": downstream.url, "client_idempotency_keys": "required"}
    async with gateway(tmp_path, downstream, extra_downstreams=[keyed]) as env:
        problem = await env.problem("POST", "/proxy/keyed/ok/pay?token=s3cret", body={"n": 1})
        return problem, ["POST /proxy/keyed/ok/pay", "downstreams.keyed.client_idempotency_keys"]


@provokes("NO_SUCH_DOWNSTREAM")
async def _no_such_downstream(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        lease = await env.lease("t1")
        return (await env.proxy(lease, "nope/x"))[0], ["'nope'"]


@provokes("PAYLOAD_TOO_LARGE")
async def _too_large(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        lease = await env.lease("t1")
        problem, _ = await env.proxy(lease, "small/ok/x?token=s3cret", body={"n": "x" * 20})
        return problem, ["POST /proxy/small/ok/x", "downstreams.small.max_body_bytes = 8"]


@provokes("DOWNSTREAM_UNREACHABLE")
async def _unreachable(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        lease = await env.lease("t1")
        problem, _ = await env.proxy(lease, "dead/pay?token=s3cret")
        return problem, ["downstream dead", "POST /proxy/dead/pay"]


async def _timed_out(env: Env) -> tuple[Lease, dict[str, Any], str]:
    """A forward to ``plain`` that timed out (its effect UNKNOWN): the lease, the problem and
    the effect id."""
    lease = await env.lease("t1")
    problem, headers = await env.proxy(lease, "plain/slow/400/x?token=s3cret")
    assert problem["code"] == "DOWNSTREAM_TIMEOUT", problem
    return lease, problem, headers["Fence-Effect-Id"]


@provokes("DOWNSTREAM_TIMEOUT")
async def _timeout(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        _, problem, _ = await _timed_out(env)
        names = ["downstream plain", "POST /proxy/plain/slow/400/x"]
        return problem, [*names, "downstreams.plain.timeout_ms = 300"]


@provokes("EFFECT_UNKNOWN")
async def _unknown(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        lease, _, effect_id = await _timed_out(env)
        return (await env.proxy(lease, "plain/slow/400/x?token=s3cret"))[0], [f"effect {effect_id}"]


@provokes("EFFECT_IN_FLIGHT")
async def _in_flight(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        _, _, effect_id = await _timed_out(env)  # it may still land for settle_ms
        problem = await env.problem(
            "POST", f"/v1/effects/{effect_id}/resolve",
            body={"outcome": "NOT_APPLIED", "note": "checked"},
        )  # fmt: skip
        return problem, [f"effect {effect_id}"]


@provokes("EFFECT_SETTLED")
async def _settled(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        lease = await env.lease("t1")
        async with env.api.client.post(
            "/proxy/plain/ok/x", json={"n": 1}, headers=fence_headers(lease, "s1")
        ) as resp:
            assert resp.status == 200
            effect_id = resp.headers["Fence-Effect-Id"]
        problem = await env.problem(
            "POST", f"/v1/effects/{effect_id}/resolve",
            body={"outcome": "NOT_APPLIED", "note": "checked"},
        )  # fmt: skip
        return problem, [f"effect {effect_id}"]


@provokes("PAYLOAD_CONFLICT")
async def _payload_conflict(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        lease = await env.lease("t1")
        async with env.api.client.post(
            "/proxy/plain/ok/x", json={"n": 1}, headers=fence_headers(lease, "s1")
        ) as resp:
            assert resp.status == 200
            effect_id = resp.headers["Fence-Effect-Id"]
        problem, _ = await env.proxy(lease, "plain/ok/x", body={"n": 2})
        return problem, [f"effect {effect_id}"]


@provokes("APPROVAL_REQUIRED")
async def _approval(tmp_path: Any, downstream: Downstream) -> Provoked:
    async with gateway(tmp_path, downstream) as env:
        lease = await env.lease("t1")
        problem, headers = await env.proxy(lease, "gated/ok/send")
        return problem, [f"effect {headers['Fence-Effect-Id']}"]


@provokes("DOWNSTREAM_BUSY")
async def _busy(tmp_path: Any, downstream: Downstream) -> Provoked:
    """The one pooled connection held by a forward that gets no answer (as in
    tests/test_forward_window.py): a second forward waits in the pool until the start limit
    and is never sent."""
    hole = await Blackhole().start()
    try:
        hold = {"name": "hole", "url": hole.url, "timeout_ms": 600_000}
        async with gateway(
            tmp_path, downstream, extra_downstreams=[hold],
            proxy={"forward_start_limit_ms": 500, "max_connections": 1,
                   "prepared_margin_ms": 20_000},
        ) as env:  # fmt: skip
            lease = await env.lease("t1")
            first = asyncio.create_task(env.proxy(lease, "hole/pay", slot="s1"))
            await until(lambda: hole.connections >= 1, "the first forward connects")
            problem, _ = await asyncio.wait_for(env.proxy(lease, "hole/pay", slot="s2"), HANG_S)
            await hole.stop()  # hangs up on the first
            await asyncio.wait_for(first, HANG_S)
            names = ["downstream hole", "POST /proxy/hole/pay", "proxy.max_connections = 1"]
            return problem, [*names, "proxy.forward_start_limit_ms = 500"]
    finally:
        await hole.stop()


# --- the rules ------------------------------------------------------------------------------


def test_every_code_of_the_table_is_provoked_or_listed_with_its_reason() -> None:
    assert not set(PROVOKE) & set(NOT_PROVOKED), "provoked and listed both"
    missing = TABLE - set(PROVOKE) - set(NOT_PROVOKED)
    assert not missing, f"codes neither provoked here nor listed in NOT_PROVOKED: {missing}"
    assert not (set(PROVOKE) | set(NOT_PROVOKED)) - TABLE, "codes the table no longer has"
    assert all(reason.strip() for reason in NOT_PROVOKED.values())


@pytest.mark.parametrize("code", sorted(PROVOKE))
async def test_the_detail_names_its_object(
    code: str, tmp_path: Any, downstream: Downstream
) -> None:
    problem, names = await PROVOKE[code](tmp_path, downstream)
    assert problem["code"] == code, problem
    detail = problem["detail"]
    for name in names:
        assert name in detail, (name, detail)
    # Never the downstream's address, nor the agent's query string, anywhere in the answer.
    port = downstream.url.rsplit(":", 1)[1]
    text = json.dumps(problem)
    for secret in ("127.0.0.1", f":{port}", downstream.url, "s3cret"):
        assert secret not in text, (secret, problem)


# --- the stores' own refusals, on every store -----------------------------------------------


async def test_the_store_refusals_name_their_object_on_every_store(store: Store) -> None:
    """What a store refuses names its task or effect, in the same words on every store (the
    Lua scripts return the model's words; ``FencegateError.about`` names the object)."""
    from fencegate.ledger.errors import FencegateError

    async def refused(coro: Awaitable[Any]) -> FencegateError:
        try:
            await coro
        except FencegateError as exc:
            return exc
        raise AssertionError("not refused")

    def claim(owner: str, ttl_ms: int = 10_000) -> ClaimRequest:
        return ClaimRequest(owner=owner, ttl_ms=ttl_ms, scheduler_epoch=1)

    said = {}
    said["NO_SUCH_TASK"] = await refused(store.get_task("ghost/1"))
    said["NO_SUCH_EFFECT"] = await refused(store.get_effect(EID))
    await store.put_task("t/1", "in", None)
    task = await store.claim("t/1", claim("w1", 1_000))
    said["CLAIMED"] = await refused(store.claim("t/1", claim("w2")))
    ident = Identity(
        attempt_id="0" * 32,
        claim_generation=task.claim_generation,
        owner="w1",
        scheduler_epoch=1,
        cancel_generation=task.cancel_generation,
    )
    said["FENCED"] = await refused(store.renew("t/1", RenewRequest(identity=ident, ttl_ms=1_000)))
    store.clock_offset_ms += 2_000
    mine = Identity(
        attempt_id=str(task.attempt_id),
        claim_generation=task.claim_generation,
        owner="w1",
        scheduler_epoch=1,
        cancel_generation=task.cancel_generation,
    )
    said["LEASE_EXPIRED"] = await refused(
        store.renew("t/1", RenewRequest(identity=mine, ttl_ms=1_000))
    )
    await store.cancel("t/1")
    said["CANCELLED"] = await refused(store.release("t/1", mine))
    expected = {
        "NO_SUCH_TASK": "task ghost/1: no such task",
        "NO_SUCH_EFFECT": f"effect {EID}: no such effect",
        "CLAIMED": "task t/1: held until leaseExpiresAt ",
        "FENCED": f"task t/1: attempt {'0' * 32} generation {task.claim_generation} is not ",
        "LEASE_EXPIRED": "task t/1: lease expired at leaseExpiresAt ",
        "CANCELLED": "task t/1: cancelGeneration ",
    }
    for code, error in said.items():
        assert error.code == code, (code, error.code, error.detail)
        assert error.detail.startswith(expected[code]), (code, error.detail)
