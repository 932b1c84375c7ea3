"""The gateway as an OAuth 2.1 resource server (``[auth.oauth]``, issue 29).

A local authorization server (``tests/oauth_server.py``: aiohttp, tokens signed by joserfc)
issues the tokens; the gateway (in this process, SQLite) verifies them with PyJWT against
the server's JWKS, found through its RFC 8414 metadata. Static principals sit beside it.

The issuer and every gateway here share one wall clock (``wall``) that stands still until a
test moves it: a token's life is what the test says, a test that needs a token to run out
moves the clock past its ``exp`` instead of waiting, and a slow machine changes nothing.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest
from aiohttp import encode_basic_auth, web
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs

from fencegate.gateway.app import create_app
from fencegate.gateway.auth import auth_state, token_sha256
from fencegate.gateway.cli import reload_auth
from fencegate.gateway.config import AuthConfig, Config
from fencegate.gateway.console.session import COOKIE
from fencegate.gateway.state import EVENTS
from fencegate.ledger.errors import AuthUnavailable
from tests.api import HANG_S, until
from tests.clocks import ManualClock, freeze_store_clock
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.oauth_server import AuthServer
from tests.test_auth import Answer

BASE = "https://gw.example"
MCP_RESOURCE = f"{BASE}/mcp/tools"
STATIC = {"scheduler": "tok-sched-1", "worker-a": "tok-worker-1", "ops": "tok-ops-1"}
ROLES = {"scheduler": ["scheduler"], "worker-a": ["worker"], "ops": ["operator"]}


def oauth_section(issuer: str, **extra: Any) -> dict[str, Any]:
    return {
        "issuer": issuer,
        "resource_base_url": BASE,
        "profiles": {
            "agents": {"scopes": ["fence:client"], "roles": ["client"],
                       "downstreams": ["api", "tools"]},
            "workers": {"scopes": ["fence:worker"], "roles": ["worker"]},
            "watchers": {"scopes": ["fence:read"], "roles": ["observer"]},
            "limited": {"scopes": ["fence:limited"], "roles": ["observer"],
                        "rate_per_second": 0.001, "burst": 2},
        },
        **extra,
    }  # fmt: skip


def auth_section(issuer: str, **extra: Any) -> dict[str, Any]:
    return {
        "principals": [
            {"name": name, "roles": ROLES[name], "token_sha256": token_sha256(token)}
            for name, token in STATIC.items()
        ],
        "oauth": oauth_section(issuer, **extra),
    }


@dataclass
class Env:
    client: TestClient[Any, Any]
    issuer: AuthServer
    downstream: Downstream
    wall: ManualClock

    async def call(
        self, method: str, path: str, headers: dict[str, str] | None = None, body: Any = None
    ) -> Answer:
        async with self.client.request(
            method, path, json=body, headers=headers or {}, allow_redirects=False
        ) as resp:
            return Answer(resp.status, resp.headers, await resp.read())

    async def lease(self, task_id: str) -> dict[str, str]:
        sched = {"Fence-Authorization": f"Bearer {STATIC['scheduler']}"}
        put = await self.call("PUT", f"/v1/tasks/{task_id}", sched, {"inputDigest": "in-1"})
        assert put.status in (200, 201), put.body
        return await self.claim(task_id, {"Fence-Authorization": f"Bearer {STATIC['worker-a']}"})

    async def claim(self, task_id: str, credential: dict[str, str]) -> dict[str, str]:
        epoch = (await self.call("GET", "/v1/epoch", credential)).json()["schedulerEpoch"]
        got = await self.call("POST", f"/v1/tasks/{task_id}/claim", credential,
                              {"owner": "w", "ttlMs": 30_000, "schedulerEpoch": epoch})  # fmt: skip
        assert got.status == 200, got.body
        claim = got.json()
        return {
            "Fence-Task": claim["taskId"],
            "Fence-Attempt": claim["attemptId"],
            "Fence-Generation": str(claim["claimGeneration"]),
            "Fence-Epoch": str(claim["schedulerEpoch"]),
            "Fence-Cancel": str(claim["cancelGeneration"]),
        }


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    """SQLite only: what is under test is the auth layer, the same for every store."""
    return f"sqlite:///{tmp_path / 'fg.db'}"


@pytest.fixture
def wall() -> ManualClock:
    """The issuer's and the gateway's wall clock (``create_app(..., wall_clock=)``): it stands
    still until the test moves it. It starts at the real time only for the console's session
    cookie, which the console reads on its own (real) clock."""
    return ManualClock(start=float(int(time.time())))


@pytest.fixture
async def issuer(wall: ManualClock) -> AsyncIterator[AuthServer]:
    server = await AuthServer(default_scope="fence:read", clock=wall.now).start()
    server.add_client("agent", "agent-secret")
    yield server
    await server.stop()


def gateway_config(store_url: str, key_prefix: str, issuer: AuthServer, downstream: Downstream,
                   **extra: Any) -> Config:  # fmt: skip
    return make_config(
        store_url,
        key_prefix,
        auth=auth_section(issuer.issuer, **extra),
        reconciler={"enabled": False},
        downstreams=[  # type: ignore[arg-type]
            {
                "name": "api",
                "url": downstream.url,
                "timeout_ms": 2000,
                "forward_authorization": True,
            },
            {"name": "tools", "url": downstream.url, "adapter": "mcp", "timeout_ms": 2000},
        ],
    )


def gateway_app(config: Config, wall: ManualClock) -> web.Application:
    """The gateway for ``config``, reading tokens' ``exp`` on ``wall``."""
    return create_app(config, store=build_test_store(config), wall_clock=wall)


@pytest.fixture
async def env(
    store_url: str, key_prefix: str, issuer: AuthServer, downstream: Downstream, wall: ManualClock
) -> AsyncIterator[Env]:
    config = gateway_config(store_url, key_prefix, issuer, downstream)
    async with TestClient(TestServer(gateway_app(config, wall), host="127.0.0.1")) as client:
        yield Env(client, issuer, downstream, wall)


def bearer(token: str, header: str = "Authorization") -> dict[str, str]:
    return {header: f"Bearer {token}"}


# --- config ------------------------------------------------------------------------------------


def test_a_static_name_can_never_be_an_oauth_principals() -> None:
    for name in ("oauth:https://as.example#agent-1", "oauth:x", "a#b"):
        section = {"principals": [{"name": name, "roles": ["worker"],
                                   "token_sha256": "0" * 64}]}  # fmt: skip
        with pytest.raises(ValueError, match="principals"):
            AuthConfig.model_validate(section)


def test_oauth_may_be_the_only_credential_source_and_its_bounds_hold() -> None:
    only = AuthConfig.model_validate({"oauth": oauth_section("https://as.example")})
    assert only.principals == () and only.oauth is not None
    assert only.oauth.leeway_ms == 60_000
    for bad in (
        {"leeway_ms": 300_001},
        {"issuer": "http://as.example"},  # http only to a loopback host
        {"profiles": {}},
        {"profiles": {"p": {"roles": ["worker"], "claims": {"aud": "x"}}}},
    ):
        with pytest.raises(ValueError):
            AuthConfig.model_validate({"oauth": {**oauth_section("https://as.example"), **bad}})
    with pytest.raises(ValueError, match="at least one"):
        AuthConfig.model_validate({})


# --- accepted --------------------------------------------------------------------------------


async def test_a_valid_token_is_its_profiles_principal(env: Env) -> None:
    token = env.issuer.mint(scope="fence:read", aud=BASE)
    for header in ("Authorization", "Fence-Authorization"):
        answer = await env.call("GET", "/v1/tasks", bearer(token, header))
        assert answer.status == 200, answer.body
    # observer: reads, never writes
    bump = await env.call("POST", "/v1/epoch/bump", bearer(token))
    assert bump.status == 403 and bump.code == "FORBIDDEN"
    challenge = bump.headers["WWW-Authenticate"]
    assert 'error="insufficient_scope"' in challenge
    assert f'resource_metadata="{BASE}/.well-known/oauth-protected-resource"' in challenge
    assert f"oauth:{env.issuer.issuer}#agent-1" in bump.json()["detail"]


async def test_the_configured_audience_is_accepted_too(
    store_url: str, key_prefix: str, issuer: AuthServer, downstream: Downstream, wall: ManualClock
) -> None:
    config = gateway_config(store_url, key_prefix, issuer, downstream, audience="fencegate")
    async with TestClient(TestServer(gateway_app(config, wall), host="127.0.0.1")) as client:
        env = Env(client, issuer, downstream, wall)
        token = issuer.mint(aud=["other", "fencegate"])
        assert (await env.call("GET", "/v1/tasks", bearer(token))).status == 200
        token = issuer.mint(aud="other")
        assert (await env.call("GET", "/v1/tasks", bearer(token))).status == 401


async def test_a_token_from_the_token_endpoint_works(env: Env) -> None:
    async with env.client.session.post(
        f"{env.issuer.issuer}/token",
        data={"grant_type": "client_credentials", "scope": "fence:read", "resource": BASE},
        headers={"Authorization": encode_basic_auth("agent", "agent-secret")},
    ) as resp:
        assert resp.status == 200
        token = (await resp.json())["access_token"]
    assert (await env.call("GET", "/v1/tasks", bearer(token))).status == 200


# --- refused -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "claims",
    [
        {"aud": "https://other.example"},
        {"aud": MCP_RESOURCE},  # an MCP server's resource is not the gateway API's
        {"iss": "https://evil.example"},
        {"exp": -1},  # relative: seconds from now (below)
        {"nbf": 120},  # not valid for another two minutes: beyond the 60 s leeway
        {"sub": None},
        {"sub": "has space"},
    ],
)
async def test_a_bad_token_is_401_with_the_metadata(env: Env, claims: dict[str, Any]) -> None:
    now = int(env.wall.now())
    if "exp" in claims:
        claims = {"exp": now - 61}
    if "nbf" in claims:
        claims = {"nbf": now + 120}
    token = env.issuer.mint(**{"aud": BASE, **claims})
    answer = await env.call("GET", "/v1/tasks", bearer(token))
    assert answer.status == 401 and answer.code == "UNAUTHENTICATED", (claims, answer.body)
    assert answer.headers["WWW-Authenticate"] == (
        'Bearer realm="fencegate", error="invalid_token", '
        f'resource_metadata="{BASE}/.well-known/oauth-protected-resource"'
    )


async def test_expiry_and_not_before_hold_within_the_leeway(env: Env) -> None:
    now = int(env.wall.now())
    # within the 60 s leeway, up to its last second; one second past it either way: refused
    cases: list[tuple[dict[str, Any], int]] = [
        ({"exp": now - 30}, 200), ({"nbf": now + 30}, 200),
        ({"exp": now - 60}, 200), ({"nbf": now + 60}, 200),
        ({"exp": now - 61}, 401), ({"nbf": now + 61}, 401),
    ]  # fmt: skip
    for claims, status in cases:
        token = env.issuer.mint(aud=BASE, **claims)
        assert (await env.call("GET", "/v1/tasks", bearer(token))).status == status, claims


@pytest.mark.parametrize("alg", ["none", "HS256"])
async def test_alg_none_and_key_confusion_are_refused(env: Env, alg: str) -> None:
    """HS256 keyed with the issuer's public key (PEM): a verifier that let the token pick
    its algorithm would take the public key as the HMAC secret and accept it."""
    token = env.issuer.forged(alg, aud=BASE, scope="fence:read")
    answer = await env.call("GET", "/v1/tasks", bearer(token))
    assert answer.status == 401 and answer.code == "UNAUTHENTICATED"
    assert "not allowed" in answer.json()["detail"]


async def test_a_token_signed_with_an_unpublished_key_is_401(env: Env) -> None:
    rogue = env.issuer.unpublished("k1")  # the published kid, another key
    token = env.issuer.mint(key=rogue, aud=BASE)
    assert (await env.call("GET", "/v1/tasks", bearer(token))).status == 401


async def test_no_credential_points_to_the_metadata_of_the_routes_resource(env: Env) -> None:
    for path, metadata in (
        ("/v1/tasks", "/.well-known/oauth-protected-resource"),
        ("/metrics", "/.well-known/oauth-protected-resource"),
        ("/mcp/tools", "/.well-known/oauth-protected-resource/mcp/tools"),
    ):
        answer = await env.call("GET", path)
        assert answer.status == 401, path
        assert answer.headers["WWW-Authenticate"] == (
            f'Bearer realm="fencegate", resource_metadata="{BASE}{metadata}"'
        )


async def test_the_metadata_documents(env: Env) -> None:
    root = await env.call("GET", "/.well-known/oauth-protected-resource")
    assert root.status == 200
    document = root.json()
    assert document["resource"] == BASE
    assert document["authorization_servers"] == [env.issuer.issuer]
    assert set(document["scopes_supported"]) == {
        "fence:client", "fence:worker", "fence:read", "fence:limited",
    }  # fmt: skip
    assert "HS256" not in document["resource_signing_alg_values_supported"]
    mcp = await env.call("GET", "/.well-known/oauth-protected-resource/mcp/tools")
    assert mcp.status == 200 and mcp.json()["resource"] == MCP_RESOURCE
    # only MCP downstreams have a resource of their own
    assert (await env.call("GET", "/.well-known/oauth-protected-resource/mcp/api")).status == 404


# --- the MCP resource ----------------------------------------------------------------------


async def test_on_mcp_the_token_is_for_that_servers_resource(env: Env) -> None:
    init = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    headers = {"Accept": "application/json, text/event-stream"}
    good = env.issuer.mint(scope="fence:client", aud=MCP_RESOURCE)
    answer = await env.call("POST", "/mcp/tools", {**headers, **bearer(good)}, init)
    assert answer.status not in (401, 403), answer.body
    api_token = env.issuer.mint(scope="fence:client", aud=BASE)
    refused = await env.call("POST", "/mcp/tools", {**headers, **bearer(api_token)}, init)
    assert refused.status == 401
    assert (
        f'resource_metadata="{BASE}/.well-known/oauth-protected-resource/mcp/tools"'
        in (refused.headers["WWW-Authenticate"])
    )
    # a profile that grants no role allowed on /mcp: 403 insufficient_scope, naming the scope
    reader = env.issuer.mint(scope="fence:read", aud=MCP_RESOURCE)
    forbidden = await env.call("POST", "/mcp/tools", {**headers, **bearer(reader)}, init)
    assert forbidden.status == 403
    assert (
        'error="insufficient_scope", scope="fence:client"'
        in (forbidden.headers["WWW-Authenticate"])
    )
    # a token that matches no profile at all
    nothing = env.issuer.mint(scope="email", aud=MCP_RESOURCE)
    none = await env.call("POST", "/mcp/tools", {**headers, **bearer(nothing)}, init)
    assert none.status == 403 and "insufficient_scope" in none.headers["WWW-Authenticate"]
    # static tokens ride on Authorization: Bearer on /mcp too
    static = await env.call("POST", "/mcp/tools", {**headers, **bearer(STATIC["ops"])}, init)
    assert static.status == 403 and static.code == "FORBIDDEN"  # operator: not on /mcp


async def test_fence_authorization_wins(env: Env) -> None:
    reader = env.issuer.mint(scope="fence:read", aud=BASE)
    both = {**bearer(reader, "Fence-Authorization"), **bearer("garbage")}
    assert (await env.call("GET", "/v1/tasks", both)).status == 200
    both = {**bearer("garbage", "Fence-Authorization"), **bearer(reader)}
    assert (await env.call("GET", "/v1/tasks", both)).status == 401
    # Fence-Authorization: a static operator wins over an OAuth reader in Authorization
    both = {**bearer(STATIC["ops"], "Fence-Authorization"), **bearer(reader)}
    assert (await env.call("POST", "/v1/epoch/bump", both)).status == 200


# --- keys ------------------------------------------------------------------------------------


def refresh_clock(env: Env) -> ManualClock:
    """The clock the JWKS refresh bound reads, moved by the test."""
    state = auth_state(env.client.app)
    assert state is not None and state.authenticator.oauth is not None
    clock = ManualClock()
    state.authenticator.oauth.monotonic = clock.now
    return clock


async def test_an_unknown_kid_refetches_the_jwks_once_per_interval(env: Env) -> None:
    clock = refresh_clock(env)
    assert (await env.call("GET", "/v1/tasks", bearer(env.issuer.mint(aud=BASE)))).status == 200
    fetches = env.issuer.jwks_fetches
    env.issuer.rotate("k2")  # a new key, published
    rotated = env.issuer.mint(aud=BASE)
    # inside the bound (jwks_refresh_ms, 30 s) the new kid is unknown and nothing is fetched
    assert (await env.call("GET", "/v1/tasks", bearer(rotated))).status == 401
    assert env.issuer.jwks_fetches == fetches
    clock.advance(30.0)  # past the bound: the first token with it fetches again
    assert (await env.call("GET", "/v1/tasks", bearer(rotated))).status == 200
    assert env.issuer.jwks_fetches == fetches + 1
    # a flood of unknown kids inside the interval costs no fetch
    for i in range(5):
        stranger = env.issuer.mint(key=env.issuer.unpublished(f"x{i}"), aud=BASE)
        answer = await env.call("GET", "/v1/tasks", bearer(stranger))
        assert answer.status == 401 and "not in the issuer's JWKS" in answer.json()["detail"]
    assert env.issuer.jwks_fetches == fetches + 1
    # another issuer's token (a downstream's own, say) costs no fetch, even past the bound
    clock.advance(30.0)
    foreign = env.issuer.mint(key=env.issuer.unpublished("y"), aud=BASE, iss="https://as.other")
    assert (await env.call("GET", "/v1/tasks", bearer(foreign))).status == 401
    assert env.issuer.jwks_fetches == fetches + 1


async def test_jwks_down_and_an_unknown_kid_is_503_auth_unavailable(env: Env) -> None:
    clock = refresh_clock(env)
    assert (await env.call("GET", "/v1/tasks", bearer(env.issuer.mint(aud=BASE)))).status == 200
    env.issuer.down = True
    # known keys go on working through the outage
    assert (await env.call("GET", "/v1/tasks", bearer(env.issuer.mint(aud=BASE)))).status == 200
    clock.advance(30.0)
    env.issuer.rotate("k3")
    answer = await env.call("GET", "/v1/tasks", bearer(env.issuer.mint(aud=BASE)))
    assert answer.status == 503 and answer.code == AuthUnavailable.code
    assert int(answer.headers["Retry-After"]) >= 1
    assert answer.json()["retryAfterMs"] >= 1000
    assert "GET /v1/tasks" in answer.json()["detail"]
    # inside the bound: still 503, nothing fetched
    fetches = env.issuer.jwks_fetches
    again = await env.call("GET", "/v1/tasks", bearer(env.issuer.mint(aud=BASE)))
    assert again.status == 503 and env.issuer.jwks_fetches == fetches
    # back up, and once the bound allows, the rotated key is fetched
    env.issuer.down = False
    clock.advance(30.0)
    assert (await env.call("GET", "/v1/tasks", bearer(env.issuer.mint(aud=BASE)))).status == 200


async def test_an_ec_key_works_and_cannot_sign_as_rsa(env: Env) -> None:
    env.issuer.rotate("e1", ec=True)
    token = env.issuer.mint(aud=BASE)
    assert (await env.call("GET", "/v1/tasks", bearer(token))).status == 200
    # the same EC key named with an RSA alg is refused: the key's type fixes the alg
    _, payload, sig = token.split(".")
    forged_header = (
        base64.urlsafe_b64encode(
            json.dumps({"alg": "RS256", "kid": "e1", "typ": "at+jwt"}).encode()
        )
        .rstrip(b"=")
        .decode()
    )
    answer = await env.call("GET", "/v1/tasks", bearer(f"{forged_header}.{payload}.{sig}"))
    assert answer.status == 401


# --- principals ------------------------------------------------------------------------------


async def test_an_oauth_subject_named_like_a_static_principal_is_another_principal(
    env: Env,
) -> None:
    """``sub: worker-a`` is ``oauth:<iss>#worker-a``: it cannot use worker-a's lease."""
    lease = await env.lease("t1")
    twin = env.issuer.mint(sub="worker-a", scope="fence:worker", aud=BASE)
    renew = await env.call(
        "POST", "/v1/tasks/t1/renew", bearer(twin),
        {"attemptId": lease["Fence-Attempt"], "claimGeneration": int(lease["Fence-Generation"]),
         "owner": "w", "schedulerEpoch": int(lease["Fence-Epoch"]),
         "cancelGeneration": int(lease["Fence-Cancel"]), "ttlMs": 30_000},
    )  # fmt: skip
    assert renew.code == "FENCED", renew.body
    assert "belongs to another principal" in renew.json()["detail"]
    as_twin = {**bearer(twin, "Fence-Authorization"), **lease, "Fence-Slot": "s"}
    sent = await env.call("POST", "/proxy/api/x", as_twin, {"a": 1})
    assert sent.code == "FENCED" and not env.downstream.received, sent.body


async def test_an_oauth_worker_holds_its_own_lease(env: Env) -> None:
    sched = {"Fence-Authorization": f"Bearer {STATIC['scheduler']}"}
    await env.call("PUT", "/v1/tasks/t2", sched, {"inputDigest": "in-1"})
    worker = env.issuer.mint(sub="robot", scope="fence:worker", aud=BASE)
    fence = await env.claim("t2", bearer(worker))
    task = (await env.call("GET", "/v1/tasks/t2", bearer(worker))).json()
    assert task["principal"] == f"oauth:{env.issuer.issuer}#robot"
    as_robot = {**bearer(worker, "Fence-Authorization"), **fence, "Fence-Slot": "s"}
    sent = await env.call("POST", "/proxy/api/ok", as_robot, {"a": 1})
    assert sent.status == 200, sent.body


async def test_rate_buckets_are_per_oauth_principal_and_bounded(
    store_url: str, key_prefix: str, issuer: AuthServer, downstream: Downstream, wall: ManualClock
) -> None:
    config = gateway_config(store_url, key_prefix, issuer, downstream, max_principals=2)
    app = gateway_app(config, wall)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        env = Env(client, issuer, downstream, wall)
        one = issuer.mint(sub="one", aud=BASE, scope="fence:limited")
        codes = [(await env.call("GET", "/v1/tasks", bearer(one))).status for _ in range(3)]
        assert codes == [200, 200, 429]  # burst 2
        two = issuer.mint(sub="two", aud=BASE, scope="fence:limited")
        assert (await env.call("GET", "/v1/tasks", bearer(two))).status == 200
        state = auth_state(app)
        assert state is not None
        for sub in ("three", "four", "five"):
            await env.call("GET", "/v1/tasks", bearer(issuer.mint(sub=sub, aud=BASE)))
        assert len(state._oauth_meters) == 2


# --- /proxy --------------------------------------------------------------------------------


async def test_proxy_never_forwards_a_gateway_token(env: Env) -> None:
    """``api`` has forward_authorization: the agent's own Authorization goes on, but never a
    token that authenticates to the gateway (static or OAuth), and on /proxy Authorization
    is never the gateway's credential."""
    fence = await env.lease("p1")
    worker_fence = {"Fence-Authorization": f"Bearer {STATIC['worker-a']}", "Fence-Slot": "s"}
    downstream_token = env.issuer.mint(aud="https://payments.example")  # same IdP, not ours
    gateway_oauth = env.issuer.mint(aud=BASE, scope="fence:read")
    mcp_oauth = env.issuer.mint(aud=MCP_RESOURCE, scope="fence:client")
    sent: list[str] = []
    for i, authorization in enumerate(
        ["Bearer downstream-secret", f"Bearer {downstream_token}", f"Bearer {STATIC['ops']}",
         f"Bearer {gateway_oauth}", f"Bearer {mcp_oauth}"]
    ):  # fmt: skip
        headers = {**fence, **worker_fence, "Fence-Slot": f"s{i}", "Authorization": authorization}
        answer = await env.call("POST", f"/proxy/api/ok/{i}", headers, {"i": i})
        assert answer.status == 200, answer.body
        sent.append(authorization)
    received = [r.headers.get("Authorization") for r in env.downstream.received]
    assert received == [sent[0], sent[1], None, None, None]
    # Authorization alone is not a credential on /proxy
    only_authorization = {**fence, "Fence-Slot": "z", **bearer(gateway_oauth)}
    alone = await env.call("POST", "/proxy/api/ok/x", only_authorization)
    assert alone.status == 401 and len(env.downstream.received) == 5


# --- reload --------------------------------------------------------------------------------


async def test_a_reload_keeps_the_keys_and_applies_new_profiles(env: Env) -> None:
    token = env.issuer.mint(aud=BASE, scope="fence:read")
    assert (await env.call("GET", "/v1/tasks", bearer(token))).status == 200
    fetches = env.issuer.jwks_fetches
    state = auth_state(env.client.app)
    assert state is not None
    section = auth_section(env.issuer.issuer)
    section["oauth"]["profiles"]["watchers"]["roles"] = ["operator"]
    state.reload(AuthConfig.model_validate(section))
    assert state.oauth_changed
    assert (await env.call("POST", "/v1/epoch/bump", bearer(token))).status == 200
    assert env.issuer.jwks_fetches == fetches


# --- expiry ----------------------------------------------------------------------------------


@pytest.fixture
async def strict(
    store_url: str, key_prefix: str, issuer: AuthServer, downstream: Downstream, wall: ManualClock
) -> AsyncIterator[Env]:
    """A gateway with ``leeway_ms = 0``: a token is good until its ``exp`` exactly."""
    config = gateway_config(store_url, key_prefix, issuer, downstream, leeway_ms=0)
    async with TestClient(TestServer(gateway_app(config, wall), host="127.0.0.1")) as client:
        yield Env(client, issuer, downstream, wall)


#: A short-lived token's life on the test's clock: nothing waits for it in real time.
LIFE_S = 60


async def expiry_waits(wall: ManualClock) -> None:
    """Return once a stream or long-poll waits for its token's ``exp`` on ``wall``
    (``principals.at_expiry``), and show that it goes on waiting up to the last second."""
    await asyncio.wait_for(wall.someone_asleep(), HANG_S)
    wall.advance(LIFE_S - 1)
    assert wall.sleepers == 1  # a second before exp: still open


async def test_a_long_poll_answers_401_at_the_tokens_exp(strict: Env) -> None:
    sched = {"Fence-Authorization": f"Bearer {STATIC['scheduler']}"}
    await strict.call("PUT", "/v1/tasks/w1", sched, {"inputDigest": "in-1"})
    token = strict.issuer.mint(aud=BASE, scope="fence:read", exp=int(strict.wall.now()) + LIFE_S)
    path = "/v1/tasks/w1?waitFor=COMMITTED&waitMs=60000"
    poll = asyncio.ensure_future(strict.call("GET", path, bearer(token)))
    await expiry_waits(strict.wall)
    assert not poll.done()
    strict.wall.advance(1)  # exp
    answer = await asyncio.wait_for(poll, HANG_S)
    assert answer.status == 401 and answer.code == "UNAUTHENTICATED", answer.body
    assert "expired while waiting" in answer.json()["detail"]
    # the challenge of the middleware's own 401s: the same token, refused at the door now
    challenge = answer.headers["WWW-Authenticate"]
    assert challenge == (
        f'Bearer realm="fencegate", error="invalid_token", '
        f'resource_metadata="{BASE}/.well-known/oauth-protected-resource"'
    )
    strict.wall.advance(1)  # past exp
    again = await strict.call("GET", path, bearer(token))
    assert again.status == 401 and again.headers["WWW-Authenticate"] == challenge
    assert "expired" in again.json()["detail"] and "while waiting" not in again.json()["detail"]


async def test_a_claim_long_poll_answers_401_with_the_challenge_at_the_tokens_exp(
    strict: Env,
) -> None:
    exp = int(strict.wall.now()) + LIFE_S
    credential = bearer(strict.issuer.mint(aud=BASE, scope="fence:worker", exp=exp))
    epoch = (await strict.call("GET", "/v1/epoch", credential)).json()["schedulerEpoch"]
    poll = asyncio.ensure_future(
        strict.call("POST", "/v1/queues/empty/claim", credential,
                    {"owner": "w", "ttlMs": 30_000, "schedulerEpoch": epoch, "waitMs": 60_000})
    )  # fmt: skip
    await expiry_waits(strict.wall)
    assert not poll.done()
    strict.wall.advance(1)  # exp
    answer = await asyncio.wait_for(poll, HANG_S)
    assert answer.status == 401 and answer.code == "UNAUTHENTICATED", answer.body
    assert 'resource_metadata="' in answer.headers["WWW-Authenticate"]


async def test_an_event_stream_closes_at_the_tokens_exp(strict: Env) -> None:
    token = strict.issuer.mint(aud=BASE, scope="fence:read", exp=int(strict.wall.now()) + LIFE_S)
    async with strict.client.get("/v1/events", headers=bearer(token)) as resp:
        assert resp.status == 200
        await expiry_waits(strict.wall)
        assert not resp.content.at_eof()
        strict.wall.advance(1)  # exp
        async with asyncio.timeout(HANG_S):
            while await resp.content.readany():
                pass  # heartbeats until the gateway ends the stream
    # a static principal's stream has no such end
    state = auth_state(strict.client.app)
    assert state is not None
    assert state.authenticator.principal(STATIC["ops"]).expires_at is None  # type: ignore[union-attr]


async def test_an_mcp_get_stream_ends_at_the_tokens_exp_plus_leeway(
    store_url: str, key_prefix: str, issuer: AuthServer, downstream: Downstream, wall: ManualClock
) -> None:
    """A leased session's server stream (``GET /mcp/tools``) opened with an OAuth token ends
    at its ``exp`` plus ``leeway_ms`` (``mcp_streams.hold``), logged ``token_expired``. The
    session and the lease come from long-lived tokens of the same subject; only the ``GET``
    carries the short one. The store's clock stands still too: the lease cannot run out
    first however slow the machine."""
    from tests.mcp_server import McpServerProcess
    from tests.test_mcp_sessions import ACCEPT, VERSION

    with McpServerProcess() as server:
        config = make_config(
            store_url, key_prefix, auth=auth_section(issuer.issuer, leeway_ms=500),
            reconciler={"enabled": False},
            downstreams=[{"name": "tools", "url": server.url, "adapter": "mcp",  # type: ignore[list-item]
                          "timeout_ms": 10_000}],
        )  # fmt: skip
        store = freeze_store_clock(build_test_store(config))
        app = create_app(config, store=store, wall_clock=wall)
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            env = Env(client, issuer, downstream, wall)
            on_api = bearer(issuer.mint(aud=BASE, scope="fence:worker", sub="streamer"))
            sched = {"Fence-Authorization": f"Bearer {STATIC['scheduler']}"}
            put = await env.call("PUT", "/v1/tasks/st1", sched, {"inputDigest": "in-1"})
            assert put.status in (200, 201), put.body
            fence = await env.claim("st1", on_api)
            on_mcp = bearer(issuer.mint(aud=MCP_RESOURCE, scope="fence:worker", sub="streamer"))
            init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": VERSION, "capabilities": {},
                "clientInfo": {"name": "streamer", "version": "0"}}}  # fmt: skip
            opened = await env.call("POST", "/mcp/tools", {**ACCEPT, **on_mcp}, init)
            assert opened.status == 200, opened.body
            session = {"Mcp-Session-Id": opened.headers["Mcp-Session-Id"],
                       "MCP-Protocol-Version": VERSION}  # fmt: skip
            note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
            noted = await env.call("POST", "/mcp/tools", {**ACCEPT, **on_mcp, **session}, note)
            assert noted.status == 202, noted.body
            short = bearer(issuer.mint(aud=MCP_RESOURCE, scope="fence:worker", sub="streamer",
                                       exp=int(wall.now()) + LIFE_S))  # fmt: skip
            with capture_logs() as logs:
                async with client.get(
                    "/mcp/tools", headers={**ACCEPT, **short, **session, **fence}
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    await expiry_waits(wall)
                    wall.advance(1)  # exp: the leeway still holds it
                    assert wall.sleepers == 1 and not resp.content.at_eof()
                    wall.advance(0.5)  # exp plus leeway_ms
                    async with asyncio.timeout(HANG_S):
                        await resp.content.read()  # until the gateway ends the stream
                    assert resp.content.at_eof()
    ended = [(e["principal"], e["reason"]) for e in logs if e["event"] == "mcp.stream_ended"]
    assert ended == [(f"oauth:{issuer.issuer}#streamer", "token_expired")]


# --- SIGHUP ----------------------------------------------------------------------------------


def toml_of(section: dict[str, Any]) -> str:
    """``[auth]`` as TOML (JSON strings and arrays are TOML's too)."""
    out = ["[auth]"]
    for p in section["principals"]:
        out += ["[[auth.principals]]"] + [f"{k} = {json.dumps(v)}" for k, v in p.items()]
    oauth = section["oauth"]
    out.append("[auth.oauth]")
    out += [f"{k} = {json.dumps(v)}" for k, v in oauth.items() if k != "profiles"]
    for name, profile in oauth["profiles"].items():
        out.append(f"[auth.oauth.profiles.{name}]")
        out += [f"{k} = {json.dumps(v)}" for k, v in profile.items()]
    return "\n".join(out) + "\n"


async def test_sighup_keeps_oauth_long_polls_unless_the_oauth_section_changed(
    env: Env, tmp_path: Path
) -> None:
    app = env.client.app
    path = tmp_path / "fencegate.toml"
    sched = {"Fence-Authorization": f"Bearer {STATIC['scheduler']}"}
    await env.call("PUT", "/v1/tasks/r1", sched, {"inputDigest": "in-1"})
    token = env.issuer.mint(aud=BASE, scope="fence:read", sub="poller")
    poll = asyncio.ensure_future(
        env.call("GET", "/v1/tasks/r1?waitFor=COMMITTED&waitMs=60000", bearer(token))
    )
    hub = app[EVENTS]
    await until(lambda: hub.waiters == 1, "the long-poll waits")
    section = auth_section(env.issuer.issuer)
    section["principals"] = section["principals"][:2]  # a static principal goes
    path.write_text(toml_of(section))
    assert reload_auth(app, str(path))
    await asyncio.sleep(0)
    assert not poll.done() and hub.waiters == 1  # [auth.oauth] unchanged: kept
    section["oauth"]["profiles"]["watchers"]["roles"] = ["operator", "observer"]
    path.write_text(toml_of(section))
    assert reload_auth(app, str(path))
    answer = await asyncio.wait_for(poll, HANG_S)
    assert answer.status == 401 and "removed" in answer.json()["detail"]


# --- the console -----------------------------------------------------------------------------


def login(env: Env, token: str) -> Any:
    """The console's login form, posted from the console's own origin."""
    origin = f"http://127.0.0.1:{env.client.port}"
    return env.client.post(
        "/console/login", data={"token": token}, headers={"Origin": origin}, allow_redirects=False
    )


async def test_console_login_with_an_oauth_token_ends_at_its_exp(env: Env) -> None:
    # An hour: the console reads the cookie's end on its own (real) clock, which the test's
    # timeout keeps far from it; the token check reads ``wall``.
    exp = int(env.wall.now()) + 3600
    token = env.issuer.mint(aud=BASE, scope="fence:read", sub="viewer", exp=exp)
    async with login(env, token) as resp:
        assert resp.status == 303, await resp.text()
        cookie = resp.cookies[COOKIE].value
    env.client.session.cookie_jar.clear()
    payload = json.loads(base64.urlsafe_b64decode(cookie.split(".")[0] + "=="))
    assert payload["n"] == f"oauth:{env.issuer.issuer}#viewer"
    assert payload["e"] == (exp + 60) * 1000  # exp plus leeway, before the console's own ttl
    page = await env.call("GET", "/console", {"Cookie": f"{COOKIE}={cookie}"})
    assert page.status == 200, page.body[:500]
    # a writer-only profile cannot log in; a bad token neither
    worker = env.issuer.mint(aud=BASE, scope="fence:worker")
    for bad, status in ((worker, 403), (env.issuer.forged("none", aud=BASE), 401)):
        async with login(env, bad) as resp:
            assert resp.status == status
    # a reload that changes the session's profile ends the session
    state = auth_state(env.client.app)
    assert state is not None
    section = auth_section(env.issuer.issuer)
    section["oauth"]["profiles"]["watchers"]["downstreams"] = ["api"]
    state.reload(AuthConfig.model_validate(section))
    page = await env.call("GET", "/console", {"Cookie": f"{COOKIE}={cookie}"})
    assert page.status == 303


# --- the mcp SDK's own OAuth flow ----------------------------------------------------------


class _Tokens:
    """The SDK's ``TokenStorage``, in memory."""

    def __init__(self) -> None:
        self.tokens: Any = None
        self.client: Any = None

    async def get_tokens(self) -> Any:
        return self.tokens

    async def set_tokens(self, tokens: Any) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> Any:
        return self.client

    async def set_client_info(self, client_info: Any) -> None:
        self.client = client_info


async def test_the_mcp_sdks_oauth_client_flow_through_mcp(
    store_url: str, key_prefix: str, issuer: AuthServer, wall: ManualClock
) -> None:
    """The official ``mcp`` client with its OAuth provider (client_credentials) and no token
    of its own: the gateway's 401 names the path-suffixed metadata, the SDK finds the
    authorization server there, gets a token for ``<gateway>/mcp/tools`` (RFC 8707
    ``resource``) and its MCP session goes through to a real MCP server."""
    from mcp.client.auth.extensions.client_credentials import ClientCredentialsOAuthProvider
    from mcp.client.client import Client
    from mcp.client.streamable_http import streamable_http_client

    from tests.mcp_server import McpServerProcess
    from tests.test_mcp import MCP_HTTP_TIMEOUT

    # The gateway's public URL is its resource: bind first (port 0), then build the config.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with McpServerProcess() as server:
        section = auth_section(issuer.issuer)
        section["oauth"]["resource_base_url"] = base
        config = make_config(
            store_url, key_prefix, auth=section, reconciler={"enabled": False},
            downstreams=[{"name": "tools", "url": server.url, "adapter": "mcp",  # type: ignore[list-item]
                          "timeout_ms": 10_000}],
        )  # fmt: skip
        runner = web.AppRunner(gateway_app(config, wall))
        await runner.setup()
        try:
            await web.SockSite(runner, sock).start()
            storage = _Tokens()
            provider = ClientCredentialsOAuthProvider(
                server_url=f"{base}/mcp/tools", storage=storage, client_id="agent",
                client_secret="agent-secret", scope="fence:client", issuer=issuer.issuer,
            )  # fmt: skip
            async with httpx2.AsyncClient(auth=provider, timeout=MCP_HTTP_TIMEOUT) as http:
                transport = streamable_http_client(f"{base}/mcp/tools", http_client=http)
                async with Client(transport) as client:
                    tools = await client.list_tools()
            assert "counter" in {tool.name for tool in tools.tools}
            # it went through OAuth: a token of the issuer for the MCP server's resource
            claims = json.loads(base64.urlsafe_b64decode(
                storage.tokens.access_token.split(".")[1] + "=="))  # fmt: skip
            assert claims["aud"] == f"{base}/mcp/tools" and claims["iss"] == issuer.issuer
        finally:
            await runner.cleanup()
