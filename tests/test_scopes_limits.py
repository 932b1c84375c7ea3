"""``[auth]`` scopes and limits (issue 11, item 6; docs/security.md "Scopes and limits").

- The scope decision (``principals.scope_refusal``) and the token bucket (``limits``) are pure
  and tested here on their own, the bucket with a hand-driven clock.
- Over HTTP on both stores: a call outside a principal's downstreams or task prefixes is 403
  before anything is recorded or forwarded; rate and requests in flight are 429 with
  ``Retry-After``.
- A real ``fencegate serve`` reloads its principals on SIGHUP: a new token works, a revoked one
  is 401, a bad file keeps the old principals and logs ``auth.reload_failed`` with the key.
"""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.auth import token_sha256
from fencegate.gateway.config import AuthReloadError, PrincipalConfig, load_auth
from fencegate.gateway.limits import OpenRequests, TokenBucket, retry_after_seconds
from fencegate.gateway.principals import Scope, scope_refusal
from tests.api import until
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.servers import GatewayProcess
from tests.test_auth import Env, auth_section

#: Protocol-layer rules, the same on every store: SQLite only (docs/stores.md).
pytestmark = pytest.mark.one_store

# --- the scope decision -------------------------------------------------------------------------


def test_an_unscoped_principal_reaches_everything() -> None:
    assert scope_refusal(Scope(), downstream="anything", task_id="any/task") is None


@pytest.mark.parametrize(
    ("downstream", "task_id", "refused"),
    [
        ("payments", "team-a/1", None),
        ("payments", None, None),
        (None, "team-a/x/y", None),
        (None, None, None),
        ("email", "team-a/1", "downstream 'email'"),
        ("payments", "team-b/1", "task 'team-b/1'"),
        ("payments", "team-a", "task 'team-a'"),  # the prefix is a string prefix, slash included
        (None, "xteam-a/1", "task 'xteam-a/1'"),
    ],
)
def test_scope_refusal(downstream: str | None, task_id: str | None, refused: str | None) -> None:
    scope = Scope(frozenset({"payments"}), ("team-a/", "shared-"))
    reason = scope_refusal(scope, downstream=downstream, task_id=task_id)
    if refused is None:
        assert reason is None
    else:
        assert reason is not None and reason.startswith(refused)


def test_only_the_limited_dimension_is_checked() -> None:
    only_downstreams = Scope(downstreams=frozenset({"payments"}))
    assert scope_refusal(only_downstreams, downstream="payments", task_id="anything") is None
    only_tasks = Scope(task_prefixes=("team-a/",))
    assert scope_refusal(only_tasks, downstream="anything", task_id="team-a/1") is None


# --- the token bucket ---------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_bucket_allows_a_burst_then_the_rate() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=2.0, burst=3, clock=clock)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() == pytest.approx(0.5)  # one token comes back in 1/rate seconds
    clock.now += 0.25
    assert bucket.take() == pytest.approx(0.25)  # a refusal takes nothing
    clock.now += 0.25
    assert bucket.take() == 0.0
    assert bucket.take() == pytest.approx(0.5)


def test_the_bucket_never_holds_more_than_burst() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=10.0, burst=2, clock=clock)
    clock.now += 3600
    assert bucket.tokens == 2.0
    assert [bucket.take() for _ in range(3)][2] > 0


def test_a_clock_stepping_back_adds_no_tokens() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=1.0, burst=1, clock=clock)
    assert bucket.take() == 0.0
    clock.now -= 100
    assert bucket.take() == pytest.approx(1.0)
    clock.now += 1
    assert bucket.take() == 0.0


def test_bucket_arguments_and_retry_after() -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate=0, burst=1)
    with pytest.raises(ValueError):
        TokenBucket(rate=1, burst=0)
    assert [retry_after_seconds(w) for w in (0.001, 1.0, 1.2, 59.9)] == [1, 1, 2, 60]


def test_open_requests() -> None:
    capped = OpenRequests(2)
    assert capped.enter() and capped.enter() and not capped.enter()
    capped.leave()
    assert capped.enter()
    uncapped = OpenRequests(None)
    assert all(uncapped.enter() for _ in range(1000))


# --- config -------------------------------------------------------------------------------------

DIGEST = "a" * 64


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"burst": 3}, "burst: only with rate_per_second"),
        ({"downstreams": []}, "downstreams"),
        ({"downstreams": ["no spaces"]}, "downstream name"),
        ({"task_prefixes": ["bad prefix"]}, "task_prefixes"),
        ({"rate_per_second": 0}, "rate_per_second"),
        ({"max_open_requests": 0}, "max_open_requests"),
    ],
)
def test_bad_scopes_and_limits_are_refused(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PrincipalConfig.model_validate(
            {"name": "w", "roles": ["worker"], "token_sha256": DIGEST, **extra}
        )


def _principal_toml(name: str, token: str, roles: str = '["scheduler"]', extra: str = "") -> str:
    return (
        f'\n[[auth.principals]]\nname = "{name}"\nroles = {roles}\n'
        f'token_sha256 = "{token_sha256(token)}"\n{extra}'
    )


def test_load_auth_reads_only_the_auth_section_and_names_the_bad_key(tmp_path: Path) -> None:
    path = tmp_path / "f.toml"
    # An unknown key elsewhere does not matter to a reload: only [auth] is read.
    path.write_text("[server]\nnot_a_key = 1\n" + _principal_toml("s", "tok-s-0123456789"))
    assert [p.name for p in load_auth(path).principals] == ["s"]
    path.write_text(
        _principal_toml("s", "tok-s-0123456789") + _principal_toml("t", "tok-t", extra="x = 1\n")
    )
    with pytest.raises(AuthReloadError) as raised:
        load_auth(path)
    assert raised.value.key == "auth.principals[1] ('t').x"
    path.write_text("[server]\n")
    with pytest.raises(AuthReloadError) as raised:
        load_auth(path)
    assert raised.value.key == "auth"
    path.write_text("[auth\n")
    with pytest.raises(AuthReloadError, match="not valid TOML"):
        load_auth(path)


# --- over HTTP, both stores ---------------------------------------------------------------------

SCOPED = {
    # worker-a may call only "api", on tasks under team-a/
    "worker-a": {"downstreams": ["api"], "task_prefixes": ["team-a/"]},
    # the scheduler creates tasks under team-a/ only
    "scheduler": {"task_prefixes": ["team-a/"]},
    # worker-b: a burst of 3, then one request every 1000 s
    "worker-b": {"rate_per_second": 0.001, "burst": 3},
}


def _section(changes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    section = auth_section()
    for principal in section["principals"]:
        principal.update(changes.get(principal["name"], {}))
    return section


@pytest.fixture
async def env(store_url: str, key_prefix: str, downstream: Downstream) -> AsyncIterator[Env]:
    config = make_config(
        store_url,
        key_prefix,
        auth=_section(SCOPED),
        reconciler={"enabled": False},
        downstreams=[  # type: ignore[arg-type]
            {"name": "api", "url": downstream.url, "timeout_ms": 5000},
            {"name": "other", "url": downstream.url, "timeout_ms": 5000},
        ],
    )
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Env(client, downstream)


def _fence(task_id: str, attempt: str = "nope", generation: int = 1) -> dict[str, str]:
    return {
        "Fence-Task": task_id,
        "Fence-Attempt": attempt,
        "Fence-Generation": str(generation),
        "Fence-Epoch": "1",
        "Fence-Cancel": "0",
        "Fence-Slot": "s1",
    }


async def _effects(env: Env) -> list[Any]:
    answer = await env.call("GET", "/v1/effects", "operator")
    assert answer.status == 200, answer.body
    body = answer.json()
    items = body.get("effects", body.get("items", body)) if isinstance(body, dict) else body
    assert isinstance(items, list), body
    return items


async def test_out_of_scope_calls_are_403_and_nothing_happens(env: Env) -> None:
    # scheduler: team-a/ only
    refused = await env.call("PUT", "/v1/tasks/team-b/1", "scheduler", {"inputDigest": "in-1"})
    assert (refused.status, refused.code) == (403, "FORBIDDEN"), refused.body
    assert "team-a/" in refused.json()["detail"]
    missing = await env.call("GET", "/v1/tasks/team-b/1", "operator")
    assert missing.status == 404  # nothing was written
    encoded = await env.call("PUT", "/v1/tasks/team-b%2F1", "scheduler", {"inputDigest": "i"})
    assert encoded.status == 403
    lease = await env.lease("team-a/1")
    claim = await env.call(
        "POST",
        "/v1/tasks/team-b/1/claim",
        "worker-a",
        {"owner": "a", "ttlMs": 1000, "schedulerEpoch": 1},
    )
    assert (claim.status, claim.code) == (403, "FORBIDDEN")

    fence = _fence(lease.task_id, lease.attempt_id, lease.claim_generation)
    # a downstream outside its scope: 403 before the ledger or the downstream hears of it
    other = await env.call("POST", "/proxy/other/ok/x", "worker-a", {"a": 1}, fence)
    assert (other.status, other.code) == (403, "FORBIDDEN"), other.body
    assert other.headers["Fence-Effect-State"] == "NONE"
    assert "'other'" in other.json()["detail"]
    # a Fence-Task outside its prefixes (whatever the lease headers say)
    foreign = await env.call(
        "POST", "/proxy/api/ok/x", "worker-a", {"a": 1}, {**fence, "Fence-Task": "team-b/1"}
    )
    assert (foreign.status, foreign.code) == (403, "FORBIDDEN"), foreign.body
    assert env.downstream.received == []
    assert await _effects(env) == []
    # inside the scope, the same call goes through
    ok = await env.call("POST", "/proxy/api/ok/x", "worker-a", {"a": 1}, fence)
    assert ok.status == 200, ok.body
    assert len(env.downstream.received) == 1
    assert len(await _effects(env)) == 1
    # an unscoped worker reaches "other"
    lease_b = await env.lease("team-a/2", worker="worker-b")
    fence_b = _fence(lease_b.task_id, lease_b.attempt_id, lease_b.claim_generation)
    assert (
        await env.call("POST", "/proxy/other/ok/y", "worker-b", {"b": 1}, fence_b)
    ).status == 200


async def test_over_the_rate_is_429_with_retry_after(env: Env) -> None:
    statuses = [(await env.call("GET", "/v1/epoch", "worker-b")).status for _ in range(3)]
    assert statuses == [200, 200, 200]
    limited = await env.call("GET", "/v1/epoch", "worker-b")
    assert (limited.status, limited.code) == (429, "RATE_LIMITED"), limited.body
    assert int(limited.headers["Retry-After"]) >= 1
    assert limited.json()["retryAfterMs"] > 0
    # per principal: the others are not held back
    assert (await env.call("GET", "/v1/epoch", "worker-a")).status == 200


async def test_over_max_open_requests_is_429_retry_after_1(
    store_url: str, key_prefix: str, downstream: Downstream
) -> None:
    config = make_config(
        store_url,
        key_prefix,
        auth=_section({"worker-a": {"max_open_requests": 1}}),
        reconciler={"enabled": False},
        downstreams=[{"name": "api", "url": downstream.url, "timeout_ms": 30_000}],  # type: ignore[list-item]
    )
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        env = Env(client, downstream)
        lease = await env.lease("t-open")
        fence = _fence(lease.task_id, lease.attempt_id, lease.claim_generation)
        # Held at the downstream until released (not a sleep a loaded machine outlasts):
        # it is still open while the calls below are asked.
        slow = asyncio.create_task(
            env.call("POST", "/proxy/api/held/x", "worker-a", {"a": 1}, fence)
        )
        try:
            await until(lambda: bool(downstream.received), "the slow call reaches the downstream")
            limited = await env.call("GET", "/v1/epoch", "worker-a")
            assert (limited.status, limited.code) == (429, "RATE_LIMITED"), limited.body
            assert limited.headers["Retry-After"] == "1"
            assert (await env.call("GET", "/v1/epoch", "worker-b")).status == 200
        finally:
            downstream.release.set()
        assert (await slow).status == 200
        assert (await env.call("GET", "/v1/epoch", "worker-a")).status == 200


# --- SIGHUP on a real gateway -------------------------------------------------------------------


def _get(url: str, token: str) -> int:
    request = urllib.request.Request(url, headers={"Fence-Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _eventually(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def test_sighup_reloads_the_principals(tmp_path: Path) -> None:
    port = 0  # the system picks it when the gateway binds; GatewayProcess reads it back
    path = tmp_path / "fencegate.toml"
    head = (
        f'[server]\nlisten = "127.0.0.1:{port}"\n'
        f'[store]\nurl = "sqlite:///{tmp_path / "fg.db"}"\n'
        "[reconciler]\nenabled = false\n"
    )
    old, new = "tok-old-0123456789", "tok-new-0123456789"
    path.write_text(head + _principal_toml("old", old))
    gateway = GatewayProcess(path, port).start()
    url = f"{gateway.url}/v1/epoch"
    try:
        assert _get(url, old) == 200
        assert _get(url, new) == 401
        assert gateway.proc is not None
        # add a principal
        path.write_text(head + _principal_toml("old", old) + _principal_toml("new", new))
        gateway.proc.send_signal(signal.SIGHUP)
        assert _eventually(lambda: _get(url, new) == 200), gateway.log_path.read_text()[-2000:]
        assert _get(url, old) == 200
        # a bad file: the principals stay as they were, the log names the key
        path.write_text(head + _principal_toml("new", new, extra="rate_per_second = -1\n"))
        gateway.proc.send_signal(signal.SIGHUP)

        def failed() -> bool:
            return any(e.get("event") == "auth.reload_failed" for e in gateway.log_events())

        assert _eventually(failed)
        event = next(e for e in gateway.log_events() if e.get("event") == "auth.reload_failed")
        assert event["key"] == "auth.principals[0] ('new').rate_per_second", event
        assert _get(url, old) == 200 and _get(url, new) == 200
        # revoke "old"
        path.write_text(head + _principal_toml("new", new))
        gateway.proc.send_signal(signal.SIGHUP)
        assert _eventually(lambda: _get(url, old) == 401)
        assert _get(url, new) == 200
        reloaded = [e for e in gateway.log_events() if e.get("event") == "auth.reloaded"]
        assert reloaded[-1]["principals"] == ["new"]
        assert old not in gateway.log_path.read_text() and new not in gateway.log_path.read_text()
    finally:
        gateway.stop()
