"""Red-team tests for the operator console: hostile input that once made a 500 or slipped
past a rule, and regressions for the rules that held (CSRF binding, stored XSS, scopes).

Same harness as tests/test_console.py (a real gateway with ``[auth]``, aiohttp's client, no
browser). Requests that aiohttp's client would normalise are sent with ``encoded=True``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import yarl
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.auth import token_sha256
from fencegate.gateway.console.session import COOKIE
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.test_console import TOKENS, Env, auth_section, console_config

FORM = "application/x-www-form-urlencoded"


@pytest.fixture
async def env(tmp_path: Path, downstream: Downstream) -> AsyncIterator[Env]:
    config = console_config(tmp_path / "fg.db", downstream)
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Env(client, downstream)


async def send(
    env: Env,
    method: str,
    path: str,
    cookie: str | None = None,
    headers: dict[str, str] | None = None,
    data: bytes | None = None,
) -> tuple[int, Any, str]:
    """One request exactly as given (no path normalisation, no cookie jar)."""
    all_headers = dict(headers or {})
    if cookie:
        all_headers["Cookie"] = f"{COOKIE}={cookie}"
    url = yarl.URL(f"{env.origin}{path}", encoded=True)
    async with env.client.session.request(
        method, url, headers=all_headers, data=data, allow_redirects=False
    ) as resp:
        return resp.status, resp.headers, await resp.text()


# --- findings ------------------------------------------------------------------------------------


async def test_a_malformed_referer_is_a_refusal_never_a_500(env: Env) -> None:
    """Finding: ``urlsplit`` raises ValueError on ``http://[`` (an unclosed IPv6 bracket), so
    a POST with such a Referer and no Origin was a 500 with a traceback in the log, on the
    open login and logout routes too (anyone who reaches the gateway)."""
    alice = await env.login(TOKENS["alice"][1])
    for path, cookie in [
        ("/console/login", None),
        ("/console/logout", None),
        ("/console/fleet/pause", alice),
    ]:
        for referer in ("http://[", "http://[::1", "http://[x]:1/"):
            status, headers, text = await send(
                env, "POST", path, cookie, {"Referer": referer, "Content-Type": FORM}, b"a=b"
            )
            assert status == 403, (path, referer, status, text[:300])
            assert headers["Content-Type"].startswith("text/html"), (path, referer)
            assert COOKIE not in headers.get("Set-Cookie", "") or path == "/console/logout"


async def test_next_cannot_leave_the_console_by_percent_encoded_dots(env: Env) -> None:
    """Finding: ``next`` refused a literal ``..`` but let ``%2e%2e`` through; browsers treat
    ``%2e%2e`` (any case, ``.%2e``, ``%2e.``) as ``..``, so ``/console/%2e%2e/v1/epoch`` led
    out of the console after login (same origin: not an open redirect, but against the rule)."""
    for target in (
        "/console/%2e%2e/v1/epoch",
        "/console/.%2E/v1/epoch",
        "/console/%2E./%2e%2e/metrics",
        "/console/%2f%2fevil.example",
    ):
        form = {"token": TOKENS["alice"][1], "next": target}
        async with env.client.post(
            "/console/login", data=form, headers={"Origin": env.origin}, allow_redirects=False
        ) as resp:
            assert resp.status == 303
            assert resp.headers["Location"] == "/console", target
        page = await env.get(f"/console/login?next={quote(target, safe='')}")
        assert 'name="next" value="/console"' in page.text, target
    env.client.session.cookie_jar.clear()
    # Legitimate targets still come back.
    fine = await env.get(f"/console/login?next={quote('/console/tasks?id=team-a/x', safe='')}")
    assert 'value="/console/tasks?id=team-a/x"' in fine.text


async def test_a_long_text_body_is_shown_as_text_not_binary(env: Env) -> None:
    """Finding: the stored body was cut at 64 KiB *bytes* and then decoded, so a UTF-8 text
    body longer than that whose cut fell inside a multi-byte character was shown to the
    operator as "(binary, N bytes)"."""
    effect_id, _ = await env.unknown_effect("t-long")
    text = "x" * (64 * 1024 - 1) + "é and more"
    status, _, _ = await env.api(
        "POST",
        f"/v1/effects/{effect_id}/resolve",
        "alice",
        {"outcome": "COMMITTED", "note": "checked", "response": {"status": 200, "body": text}},
    )
    assert status == 200
    alice = await env.login(TOKENS["alice"][1])
    page = await env.get(f"/console/effects/{effect_id}", alice)
    assert page.status == 200
    assert 'id="stored-body"' in page.text
    assert "(binary" not in page.text and "xxxxxxxx" in page.text


async def test_a_rate_limited_console_request_is_an_html_page_with_retry_after(
    tmp_path: Path,
) -> None:
    """Finding: the ``[auth]`` hook turned every refusal on ``/console/*`` into the console's
    HTML page except the rate limits (429), which stayed problem+json in the browser."""
    section = {
        "principals": [
            {
                "name": "rita",
                "roles": ["observer"],
                "token_sha256": token_sha256(TOKENS["olive"][1]),
                "rate_per_second": 0.001,
                "burst": 1,
            }
        ]
    }
    config = make_config(f"sqlite:///{tmp_path / 'fg.db'}", reconciler={"enabled": False},
                         auth=section)  # fmt: skip
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        env = Env(client, Downstream())
        rita = await env.login(TOKENS["olive"][1])
        assert (await env.get("/console", rita)).status == 200
        limited = await env.get("/console/fleet", rita)
        assert limited.status == 429
        assert limited.headers["Content-Type"].startswith("text/html")
        assert "RATE_LIMITED" in limited.text and int(limited.headers["Retry-After"]) >= 1
        assert limited.headers["Cache-Control"] == "no-store"


# --- rules that held (regressions) ---------------------------------------------------------------


async def test_a_csrf_token_is_bound_to_its_own_session(env: Env) -> None:
    alice = await env.login(TOKENS["alice"][1])
    other = await env.login(TOKENS["alice"][1])  # the same principal, another session
    theirs = (await env.get("/console/fleet", other)).csrf
    refused = await env.post("/console/fleet/pause", {"csrf": theirs, "confirm": "yes"}, alice)
    assert refused.status == 403 and "CSRF" in refused.text


async def test_hostile_values_are_escaped_everywhere(env: Env) -> None:
    """Stored markup in an answer's body and headers, an agent's owner label, a note."""
    evil = "<script>alert(1)</script>"
    effect_id, _ = await env.unknown_effect("t-xss")
    response = {"status": 200, "headers": {"X-Evil": evil}, "body": f'"><img src=x>{evil}'}
    resolve = {"outcome": "COMMITTED", "note": evil, "response": response}
    status, _, _ = await env.api("POST", f"/v1/effects/{effect_id}/resolve", "alice", resolve)
    assert status == 200
    alice = await env.login(TOKENS["alice"][1])
    page = await env.get(f"/console/effects/{effect_id}", alice)
    assert 'id="stored-body"' in page.text and "&lt;img src=x&gt;&lt;script&gt;" in page.text
    # A note with markup, through the confirmation page and the result page.
    unknown, _ = await env.unknown_effect("t-xss-2")
    csrf = (await env.get(f"/console/effects/{unknown}", alice)).csrf
    form = {"outcome": "NOT_APPLIED", "note": f'"><img src=x>{evil}', "csrf": csrf}
    confirm = await env.post(f"/console/effects/{unknown}/resolve", form, alice)
    done = await env.post(f"/console/effects/{unknown}/resolve", {**form, "confirm": "yes"}, alice)
    trail = await env.get(f"/console/effects/{unknown}", alice)
    task = await env.get("/console/tasks?id=t-xss", alice)
    for shown in (page, confirm, done, trail, task):
        assert shown.status == 200
        assert "<img src=x>" not in shown.text and "<script>alert" not in shown.text


async def test_a_scoped_observer_cannot_look_up_other_tasks(
    tmp_path: Path, downstream: Downstream
) -> None:
    config = console_config(tmp_path / "fg.db", downstream)
    section = auth_section()
    section["principals"].append(
        {
            "name": "team-a-watch",
            "roles": ["observer"],
            "token_sha256": token_sha256("tok-console-team-a-0123456789"),
            "task_prefixes": ["team-a/"],
        }
    )
    config = make_config(config.store.url, reconciler={"enabled": False},
                         downstreams=[d.model_dump() for d in config.downstreams],
                         auth=section)  # fmt: skip
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        env = Env(client, downstream)
        await env.lease("team-b/secret")
        watcher = await env.login("tok-console-team-a-0123456789")
        refused = await env.get("/console/tasks?id=team-b/secret", watcher)
        assert refused.status == 403 and "outside its scope" in refused.text
        assert "CLAIMED" not in refused.text


async def test_workers_and_schedulers_cannot_reach_console_pages_by_header(env: Env) -> None:
    for who in ("worker", "scheduler"):
        for path in ("/console", "/console/fleet/series", "/console/tasks?id=t"):
            status, headers, _ = await send(
                env, "GET", path, None, {"Fence-Authorization": f"Bearer {TOKENS[who][1]}"}
            )
            assert status == 403, (who, path)
            assert headers["Content-Type"].startswith("text/html")
