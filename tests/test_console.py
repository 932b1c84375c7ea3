"""The operator console without a browser: sessions, CSRF, CSP, roles, and that its actions
are the JSON API's (same validation, same audit events, same actor on the trail).

A real gateway (aiohttp's test server, SQLite) with ``[auth]``, a real downstream on loopback
(tests/downstream.py) whose ``/slow/...`` path outlives the gateway's timeout, so an UNKNOWN
effect is made by a real timed-out forward; and a manual downstream that requires approval.
"""

from __future__ import annotations

import html
import io
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs

from fencegate.gateway.app import create_app
from fencegate.gateway.auth import auth_state, token_sha256
from fencegate.gateway.config import AuthConfig, Config
from fencegate.gateway.console import CONSOLE, new_console
from fencegate.gateway.console.session import COOKIE, SECRET_ENV, SessionCodec
from fencegate.gateway.console.views import CSP
from fencegate.gateway.state import METRICS, STORE
from fencegate.ledger.tasks import ClaimRequest
from tests.api import claim_fence
from tests.clocks import still
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.test_effect_prefix import colliding_slots, effects_of
from tests.test_retention import claim_as

TOKENS = {
    "scheduler": (["scheduler"], "tok-console-scheduler-0123456789"),
    "worker": (["worker"], "tok-console-worker-0123456789"),
    "alice": (["operator"], "tok-console-alice-0123456789"),
    "olive": (["observer"], "tok-console-olive-0123456789"),
}
#: The timeout of the downstreams an UNKNOWN is made on: a ``/slow/...`` call's answer is due
#: 100 ms after this timer (both on the loop's clock, the answer's set later), so the timer
#: always fires first; their connect bound is far off, so a slow connect under load is still
#: a timeout (UNKNOWN), never an unreachable downstream.
TIMEOUT_MS = 300
BRIEF = {"timeout_ms": TIMEOUT_MS, "connect_timeout_ms": 10_000}


def auth_section(names: tuple[str, ...] = tuple(TOKENS), **roles: list[str]) -> dict[str, Any]:
    return {
        "principals": [
            {
                "name": name,
                "roles": roles.get(name, TOKENS[name][0]),
                "token_sha256": token_sha256(TOKENS[name][1]),
            }
            for name in names
        ]
    }


def console_config(
    db: Path, downstream: Downstream, auth: bool = True, **more: dict[str, Any]
) -> Config:
    sections: dict[str, Any] = {
        **more,
        "reconciler": {"enabled": False},
        # The forward clock stands still (``create_app(..., forward_clock=still)``) and the
        # start limit (then a real-time bound on the pool wait and connect) is 10 s off: a
        # loaded machine cannot trip it.
        "proxy": {"prepared_margin_ms": 20_000, "forward_start_limit_ms": 10_000},
        "downstreams": [
            # settle_ms 0: these stories resolve NOT_APPLIED at once (no forward can land late);
            # "queue" keeps the default, for the landing rule's console story.
            # It also takes lease-less calls by Idempotency-Key (keyed effects).
            {
                "name": "api",
                "url": downstream.url,
                **BRIEF,
                "settle_ms": 0,
                "client_idempotency_keys": "optional",
            },
            {"name": "queue", "url": downstream.url, **BRIEF},
            # The default timeout_ms: an answered call does not race a timer.
            {"name": "plain", "url": downstream.url},
            {
                "name": "orders",
                "url": downstream.url,
                **BRIEF,
                "adapter": "probe",
                "probe": {"path": "/ok/probe/{effectId}", "settle_ms": 0},
            },
            {
                "name": "mail",
                "url": downstream.url,
                "adapter": "manual",
                "require_approval": True,
                "approval_ttl_ms": 600_000,
            },
        ],
    }
    if auth:
        sections["auth"] = auth_section()
    return make_config(f"sqlite:///{db}", **sections)


@dataclass
class Page:
    status: int
    headers: Any
    text: str

    @property
    def csrf(self) -> str:
        found = re.search(r'name="csrf" value="([^"]*)"', self.text)
        assert found, self.text[:2000]
        return html.unescape(found.group(1))


@dataclass
class Env:
    client: TestClient[Any, Any]
    downstream: Downstream

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.client.port}"

    async def login(self, token: str | None = None, name: str | None = None) -> str:
        """Log in; the session cookie's value (kept out of the client's jar)."""
        form = {"token": token} if token is not None else {"name": name or "anonymous"}
        async with self.client.post(
            "/console/login", data=form, headers={"Origin": self.origin}, allow_redirects=False
        ) as resp:
            assert resp.status == 303, await resp.text()
            value = resp.cookies[COOKIE].value
        self.client.session.cookie_jar.clear()
        return value

    async def get(self, path: str, cookie: str | None = None) -> Page:
        headers = {"Cookie": f"{COOKIE}={cookie}"} if cookie else {}
        async with self.client.get(path, headers=headers, allow_redirects=False) as resp:
            return Page(resp.status, resp.headers, await resp.text())

    async def post(
        self,
        path: str,
        form: dict[str, str],
        cookie: str | None = None,
        origin: str | None = "",
        referer: str | None = None,
    ) -> Page:
        headers: dict[str, str] = {}
        if cookie:
            headers["Cookie"] = f"{COOKIE}={cookie}"
        if origin is not None:
            headers["Origin"] = origin or self.origin
        if referer is not None:
            headers["Referer"] = referer
        async with self.client.post(
            path, data=form, headers=headers, allow_redirects=False
        ) as resp:
            return Page(resp.status, resp.headers, await resp.text())

    async def api(self, method: str, path: str, who: str, body: Any = None,
                  headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:  # fmt: skip
        all_headers = {"Fence-Authorization": f"Bearer {TOKENS[who][1]}", **(headers or {})}
        async with self.client.request(method, path, json=body, headers=all_headers) as resp:
            raw = await resp.read()
            return resp.status, resp.headers, json.loads(raw) if raw else None

    async def lease(self, task_id: str) -> dict[str, str]:
        status, _, _ = await self.api("PUT", f"/v1/tasks/{task_id}", "scheduler",
                                      {"inputDigest": "in-1"})  # fmt: skip
        assert status in (200, 201)
        status, _, claim = await self.api(
            "POST", f"/v1/tasks/{task_id}/claim", "worker",
            {"owner": "w", "ttlMs": 30_000, "schedulerEpoch": 1},
        )  # fmt: skip
        assert status == 200, claim
        return claim_fence(claim, "s1")

    async def unknown_effect(
        self, task_id: str = "t-unknown", downstream: str = "api"
    ) -> tuple[str, dict[str, str]]:
        """A forward that outlives the downstream timeout: UNKNOWN."""
        fence = await self.lease(task_id)
        status, headers, _ = await self.api(
            "POST",
            f"/proxy/{downstream}/slow/{TIMEOUT_MS + 100}/pay",
            "worker",
            {"amount": 5},
            fence,
        )
        assert headers["Fence-Effect-State"] == "UNKNOWN", (status, dict(headers))
        return headers["Fence-Effect-Id"], fence

    async def pending_email(self, task_id: str = "t-mail") -> tuple[str, dict[str, str]]:
        fence = await self.lease(task_id)
        status, _, body = await self.api(
            "POST", "/proxy/mail/send", "worker", {"to": "a@example.com"}, fence
        )
        assert status == 409 and body["code"] == "APPROVAL_REQUIRED", body
        return body["effectId"], fence


@pytest.fixture
async def env(tmp_path: Path, downstream: Downstream) -> AsyncIterator[Env]:
    config = console_config(tmp_path / "fg.db", downstream)
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Env(client, downstream)


def _without_age(page: str) -> str:
    """A page with its "(<duration> ago)" parts blanked: they are measured from the instant
    of each render."""
    return re.sub(r"\([^()<>]* ago\)", "(ago)", page)


def _no_inline_code(text: str) -> None:
    """CSP forbids inline script and style: the pages must not need them."""
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", text), "inline <script>"
    assert "<style" not in text
    assert not re.search(r"\sstyle=", text), "a style attribute"
    assert not re.search(r"\son[a-z]+=", text), "an inline event handler"
    assert "javascript:" not in text


# --- login and the session cookie --------------------------------------------------------------


async def test_login_sets_a_signed_httponly_strict_cookie(env: Env) -> None:
    async with env.client.post(
        "/console/login",
        data={"token": TOKENS["alice"][1], "next": "/console/fleet"},
        headers={"Origin": env.origin},
        allow_redirects=False,
    ) as resp:
        assert resp.status == 303
        assert resp.headers["Location"] == "/console/fleet"
        cookie = resp.headers["Set-Cookie"]
    assert cookie.startswith(f"{COOKIE}=")
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/console" in cookie
    assert "Max-Age=28800" in cookie
    assert "Secure" not in cookie  # plain HTTP here; Secure when served over TLS
    assert TOKENS["alice"][1] not in cookie


async def test_a_bad_token_or_a_worker_token_cannot_log_in(env: Env) -> None:
    bad = await env.post("/console/login", {"token": "nope"})
    assert bad.status == 401 and "matches no principal" in bad.text
    assert COOKIE not in bad.headers.get("Set-Cookie", "")
    worker = await env.post("/console/login", {"token": TOKENS["worker"][1]})
    assert worker.status == 403 and "operators and observers" in worker.text
    bare = await env.post("/console/login", {"token": TOKENS["alice"][1]}, origin=None)
    assert bare.status == 400 and COOKIE not in bare.headers.get("Set-Cookie", "")
    foreign = await env.post("/console/login", {"token": TOKENS["alice"][1]}, origin=None,
                             referer="http://evil.example/")  # fmt: skip
    assert foreign.status == 403 and COOKIE not in foreign.headers.get("Set-Cookie", "")


async def test_a_page_without_a_session_goes_to_the_login_page(env: Env) -> None:
    for path in (
        "/console",
        "/console/fleet",
        "/console/tasks?id=x",
        f"/console/effects/{'0' * 64}",
    ):
        page = await env.get(path)
        assert page.status == 303, path
        assert page.headers["Location"].startswith("/console/login?next=%2Fconsole")
    action = await env.post(f"/console/effects/{'0' * 64}/resolve", {"outcome": "NOT_APPLIED"})
    assert action.status == 401 and "UNAUTHENTICATED" in action.text
    # A cookie that is not this gateway's is no session either.
    forged = await env.get("/console", cookie="eyJuIjoiYWxpY2UifQ.AAAA")
    assert forged.status == 303 and "ended=1" in forged.headers["Location"]
    login = await env.get("/console/login?next=/console/fleet&ended=1")
    assert login.status == 200 and "Your session ended" in login.text
    assert 'value="/console/fleet"' in login.text
    # The login page never sends anyone off-site after logging in.
    for target in ("//evil.example/console", "/console/../v1/epoch", "https://evil.example/"):
        offsite = await env.get(f"/console/login?next={quote(target, safe='')}")
        assert 'name="next" value="/console"' in offsite.text, target


async def test_a_revoked_token_or_a_changed_role_ends_the_session_at_once(env: Env) -> None:
    alice = await env.login(TOKENS["alice"][1])
    olive = await env.login(TOKENS["olive"][1])
    assert (await env.get("/console", alice)).status == 200
    state = auth_state(env.client.app)
    assert state is not None
    # SIGHUP's reload: olive is now an operator, alice is gone.
    state.reload(AuthConfig.model_validate(
        auth_section(("scheduler", "worker", "olive"), olive=["operator"])
    ))  # fmt: skip
    for cookie in (alice, olive):
        page = await env.get("/console", cookie)
        assert page.status == 303 and "ended=1" in page.headers["Location"], page.text
    refused = await env.post("/console/fleet/pause", {"csrf": "x"}, alice)
    assert refused.status == 401


async def test_the_session_cookie_is_signed_and_expires() -> None:
    now = [1_000.0]
    codec = SessionCodec(b"k" * 32, 60_000, clock=lambda: now[0])
    value, session = codec.issue("alice", "a" * 64, ("operator",))
    assert codec.read(value) == session
    payload, mac = value.split(".")
    assert codec.read(f"{payload}.{mac[:-2]}AA") is None
    assert SessionCodec(b"x" * 32, 60_000, clock=lambda: now[0]).read(value) is None
    assert codec.read(value + "x") is None and codec.read("") is None
    assert codec.read("a.b.c") is None and codec.read("%%%.%%%") is None
    now[0] += 61
    assert codec.read(value) is None


def test_the_signing_key_comes_from_the_environment(tmp_path: Path) -> None:
    config = make_config(f"sqlite:///{tmp_path / 'fg.db'}")
    one = new_console(config, {SECRET_ENV: "shared-secret-for-two-gateways-0123456789"})
    two = new_console(config, {SECRET_ENV: "shared-secret-for-two-gateways-0123456789"})
    value, _ = one.codec.issue("alice", None, ("operator",))
    assert two.codec.read(value) is not None and one.key_from_env
    # Unset: a random key per process; another process's cookie is no session here.
    lone = new_console(config, {})
    assert not lone.key_from_env and lone.codec.read(value) is None


def test_session_ttl_is_bounded_and_named(tmp_path: Path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="session_ttl_ms"):
        make_config(f"sqlite:///{tmp_path / 'fg.db'}", console={"session_ttl_ms": 5})
    config = make_config(f"sqlite:///{tmp_path / 'fg.db'}", console={"session_ttl_ms": 120_000})
    assert config.console.session_ttl_ms == 120_000


# --- CSP, headers, no inline code ------------------------------------------------------------


async def test_every_console_answer_carries_the_strict_csp(env: Env) -> None:
    effect_id, _ = await env.unknown_effect()
    alice = await env.login(TOKENS["alice"][1])
    for path in (
        "/console",
        f"/console/effects/{effect_id}",
        "/console/tasks",
        "/console/tasks?id=t-unknown",
        "/console/fleet",
        "/console/login",
        "/console/tasks?id=bad%0Aid",
        f"/console/effects/{'f' * 64}",
    ):
        page = await env.get(path, alice)
        assert page.status in (200, 400, 404), (path, page.status)
        assert page.headers["Content-Security-Policy"] == CSP, path
        assert "script-src 'self'" in CSP and "unsafe-inline" not in CSP
        assert page.headers["X-Frame-Options"] == "DENY"
        assert page.headers["Cache-Control"] == "no-store"
        assert page.headers["Content-Type"].startswith("text/html")
        _no_inline_code(page.text)
        assert "Traceback" not in page.text
    for asset in ("console.css", "console.js"):
        page = await env.get(f"/console/static/{asset}")
        assert page.status == 200 and page.headers["Content-Security-Policy"] == CSP
    assert (await env.get("/console/static/views.py")).status == 404
    assert (await env.get("/console/static/nothing.js")).status == 404


def test_the_templates_hold_no_inline_code_and_no_external_url() -> None:
    root = Path(__file__).resolve().parent.parent / "gateway" / "console"
    for template in (root / "templates").glob("*.html"):
        text = template.read_text()
        _no_inline_code(text)
        assert not re.search(r"(src|href)=\"(https?:)?//", text), template.name
    for asset in (root / "static").iterdir():
        assert "http://" not in asset.read_text().replace('"http://www.w3.org/2000/svg"', "")
        assert "https://" not in asset.read_text()


# --- actions: CSRF, origin, roles ------------------------------------------------------------


async def test_an_action_needs_the_sessions_csrf_token_and_a_same_origin_form(env: Env) -> None:
    effect_id, _ = await env.unknown_effect()
    alice = await env.login(TOKENS["alice"][1])
    page = await env.get(f"/console/effects/{effect_id}", alice)
    csrf = page.csrf
    path = f"/console/effects/{effect_id}/resolve"
    form = {"outcome": "NOT_APPLIED", "note": "checked"}
    with capture_logs() as logs:
        assert (await env.post(path, form, alice)).status == 403  # no token
        assert (await env.post(path, {**form, "csrf": "x" * 32}, alice)).status == 403
        bob = await env.login(TOKENS["olive"][1])
        other = (await env.get("/console", bob)).csrf
        assert (await env.post(path, {**form, "csrf": other}, alice)).status == 403
        # Neither Origin nor Referer: refused; a foreign Origin: the request guard's 403.
        assert (await env.post(path, {**form, "csrf": csrf}, alice, origin=None)).status == 400
        foreign = await env.post(path, {**form, "csrf": csrf}, alice, origin="http://evil.example")
        assert foreign.status == 403
        cross = await env.post(path, {**form, "csrf": csrf}, alice, origin=None,
                               referer="http://evil.example/console")  # fmt: skip
        assert cross.status == 403
    assert [e["event"] for e in logs].count("console.csrf_refused") == 5
    _, _, record = await env.api("GET", f"/v1/effects/{effect_id}", "alice")
    assert record["state"] == "UNKNOWN" and record["actions"] == []
    # With Referer instead of Origin (some browsers), the token opens the confirmation.
    ok = await env.post(path, {**form, "csrf": csrf}, alice, origin=None,
                        referer=f"{env.origin}/console/effects/{effect_id}")  # fmt: skip
    assert ok.status == 200 and "Resolve this effect?" in ok.text


async def test_an_observer_sees_no_action_and_a_forged_post_is_refused(env: Env) -> None:
    effect_id, _ = await env.unknown_effect()
    olive = await env.login(TOKENS["olive"][1])
    page = await env.get(f"/console/effects/{effect_id}", olive)
    assert page.status == 200 and "read-only" in page.text
    assert 'id="actions"' not in page.text and '<button type="submit" id=' not in page.text
    assert 'name="responseStatus"' not in page.text
    fleet = await env.get("/console/fleet", olive)
    assert 'id="actions"' not in fleet.text
    csrf = page.csrf  # the logout form's token: an observer's session has one too
    for path, form in [
        (f"/console/effects/{effect_id}/resolve",
         {"outcome": "NOT_APPLIED", "note": "forged", "confirm": "yes"}),
        (f"/console/effects/{effect_id}/resolve",
         {"outcome": "COMMITTED", "note": "forged", "responseStatus": "200",
          "responseBody": "{}"}),
        (f"/console/effects/{effect_id}/resolve",
         {"outcome": "COMMITTED", "note": "forged", "responseStatus": "200",
          "responseBody": "{}", "confirm": "yes"}),
        (f"/console/effects/{effect_id}/reconcile", {"confirm": "yes"}),
        ("/console/fleet/bump", {"typed": "1"}),
        ("/console/fleet/pause", {"confirm": "yes"}),
    ]:  # fmt: skip
        refused = await env.post(path, {**form, "csrf": csrf}, olive)
        assert refused.status == 403 and "FORBIDDEN" in refused.text, path
    _, _, record = await env.api("GET", f"/v1/effects/{effect_id}", "alice")
    assert record["state"] == "UNKNOWN"
    _, _, epoch = await env.api("GET", "/v1/epoch", "alice")
    assert epoch == {"schedulerEpoch": 1, "claimsPaused": False}


async def test_observers_do_not_see_stored_bodies_operators_do(env: Env) -> None:
    fence = await env.lease("t-body")
    status, headers, _ = await env.api("POST", "/proxy/plain/ok/secret", "worker", {"a": 1}, fence)
    assert status == 200
    effect_id = headers["Fence-Effect-Id"]
    alice = await env.login(TOKENS["alice"][1])
    olive = await env.login(TOKENS["olive"][1])
    seen = await env.get(f"/console/effects/{effect_id}", alice)
    body = "&#34;calls&#34;: 1"  # the downstream's JSON answer, escaped in the page
    assert 'id="stored-body"' in seen.text and body in seen.text
    withheld = await env.get(f"/console/effects/{effect_id}", olive)
    assert 'id="body-withheld"' in withheld.text and body not in withheld.text
    assert 'id="stored-body"' not in withheld.text


# --- the actions are the JSON API's ----------------------------------------------------------


async def _confirmed(env: Env, cookie: str, path: str, form: dict[str, str]) -> Page:
    """Send the form, then the confirmation page's own form, as a browser would."""
    first = await env.post(path, form, cookie)
    return await env.post(path, _confirmation(first), cookie)


def _confirmation(page: Page) -> dict[str, str]:
    """The form a confirmation page sends."""
    assert page.status == 200 and 'name="confirm" value="yes"' in page.text, page.text
    fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', page.text))
    return {k: html.unescape(v) for k, v in fields.items()}


async def test_resolve_records_the_principal_and_logs_as_the_api_does(env: Env) -> None:
    effect_id, _ = await env.unknown_effect()
    alice = await env.login(TOKENS["alice"][1])
    csrf = (await env.get(f"/console/effects/{effect_id}", alice)).csrf
    path = f"/console/effects/{effect_id}/resolve"
    # The JSON API's limits: a note is required, at most 2000 characters.
    for note in ("", "x" * 2001):
        bad = await env.post(path, {"outcome": "NOT_APPLIED", "note": note, "csrf": csrf}, alice)
        assert bad.status == 400 and "note" in bad.text
    bad = await env.post(path, {"outcome": "MAYBE", "note": "n", "csrf": csrf}, alice)
    assert bad.status == 400
    with capture_logs() as logs:
        form = {"outcome": "NOT_APPLIED", "note": "no charge at the bank", "csrf": csrf}
        done = await _confirmed(env, alice, path, form)
    assert done.status == 200 and "Resolved NOT_APPLIED" in done.text
    resolves = [e for e in logs if e["event"] == "operator.resolve"]
    assert len(resolves) == 1
    assert resolves[0]["operator"] == "alice" and resolves[0]["note"] == "no charge at the bank"
    _, _, record = await env.api("GET", f"/v1/effects/{effect_id}", "alice")
    assert record["state"] == "NOT_APPLIED"
    assert record["actions"][-1]["by"] == "alice" and record["actions"][-1]["action"] == "resolve"
    # Resolving again is the API's EFFECT_SETTLED, as a page, before any confirmation.
    again = await env.post(path, {"outcome": "COMMITTED", "note": "n", "csrf": csrf}, alice)
    assert again.status == 409 and "EFFECT_SETTLED" in again.text


async def test_not_applied_waits_for_the_settle_time_unless_forced(env: Env) -> None:
    effect_id, _ = await env.unknown_effect("t-queue", downstream="queue")
    alice = await env.login(TOKENS["alice"][1])
    page = await env.get(f"/console/effects/{effect_id}", alice)
    assert 'id="landing-until"' in page.text and 'name="force"' in page.text
    path = f"/console/effects/{effect_id}/resolve"
    form = {"outcome": "NOT_APPLIED", "note": "nothing in the queue", "csrf": page.csrf}
    # The ledger's rule is asked before the confirmation: refused at once, nothing recorded.
    early = await env.post(path, form, alice)
    assert early.status == 409 and "EFFECT_IN_FLIGHT" in early.text and "landingUntil" in early.text
    _, _, record = await env.api("GET", f"/v1/effects/{effect_id}", "alice")
    assert record["state"] == "UNKNOWN" and record["actions"] == []
    # The checkbox: the confirmation says what it risks, the force goes through it, the trail
    # shows it.
    first = await env.post(path, {**form, "force": "true"}, alice)
    assert "forced: even if an earlier forward may still land" in first.text
    done = await _confirmed(env, alice, path, {**form, "force": "true"})
    assert done.status == 200 and "Resolved NOT_APPLIED" in done.text and "Forced:" in done.text
    _, _, record = await env.api("GET", f"/v1/effects/{effect_id}", "alice")
    assert record["state"] == "NOT_APPLIED" and record["actions"][-1]["force"] is True
    trail = await env.get(f"/console/effects/{effect_id}", alice)
    assert "resolve (forced: could still land until" in trail.text


# --- resolve COMMITTED with the downstream's answer -------------------------------------------


def _retry_summary(page: Page) -> str:
    found = re.search(r'<p id="retry-summary"><strong>(.*?)</strong></p>', page.text)
    assert found, page.text[:3000]
    return html.unescape(found.group(1))


async def test_resolve_committed_with_the_downstreams_answer_and_retries_get_it(env: Env) -> None:
    effect_id, fence = await env.unknown_effect("t-answer")
    alice = await env.login(TOKENS["alice"][1])
    page = await env.get(f"/console/effects/{effect_id}", alice)
    assert 'name="responseStatus"' in page.text and "204 with an empty body" in page.text
    path = f"/console/effects/{effect_id}/resolve"
    answer = '{"charge": "ch_42",\n "ok": true}'
    form = {
        "outcome": "COMMITTED",
        "note": "the bank shows charge ch_42",
        "csrf": page.csrf,
        "responseStatus": " 201 ",
        # As a browser sends textareas: CRLF line breaks.
        "responseHeaders": "Content-Type: application/json\r\n\r\nX-Charge:ch_42\r\n",
        "responseBody": answer.replace("\n", "\r\n"),
    }
    first = await env.post(path, form, alice)
    assert first.status == 200 and 'id="confirm"' in first.text
    size = len(answer.encode())
    assert _retry_summary(first) == (
        f"the answer you pasted: status 201, 2 header(s), a {size}-byte body."
    )
    shown = re.search(r'<pre class="body" id="retry-body">(.*?)</pre>', first.text, re.S)
    assert shown and html.unescape(shown.group(1)) == answer
    assert "<code>X-Charge: ch_42</code>" in first.text
    _, _, record = await env.api("GET", f"/v1/effects/{effect_id}", "alice")
    assert record["state"] == "UNKNOWN" and record["actions"] == []  # nothing before confirm
    with capture_logs() as logs:
        done = await _confirmed(env, alice, path, form)
    assert done.status == 200 and "Resolved COMMITTED" in done.text
    assert "Retries of this call get the answer you gave (status 201)." in done.text
    [resolved] = [e for e in logs if e["event"] == "operator.resolve"]
    assert resolved["operator"] == "alice" and resolved["empty_replay"] is False
    assert resolved["response_digest"]
    # The agent's retry: the pasted answer, and nothing is sent again.
    sent = len(env.downstream.calls("/slow/"))
    status, headers, body = await env.api(
        "POST", f"/proxy/api/slow/{TIMEOUT_MS + 100}/pay", "worker", {"amount": 5}, fence
    )
    assert status == 201 and headers["Fence-Replayed"] == "true"
    assert headers["X-Charge"] == "ch_42" and headers["Content-Type"] == "application/json"
    assert body == {"charge": "ch_42", "ok": True}
    assert len(env.downstream.calls("/slow/")) == sent


async def test_without_an_answer_the_confirmation_says_retries_get_an_empty_204(env: Env) -> None:
    effect_id, fence = await env.unknown_effect("t-no-answer")
    alice = await env.login(TOKENS["alice"][1])
    csrf = (await env.get(f"/console/effects/{effect_id}", alice)).csrf
    path = f"/console/effects/{effect_id}/resolve"
    form = {"outcome": "COMMITTED", "note": "it happened", "csrf": csrf,
            "responseStatus": "", "responseHeaders": " \r\n", "responseBody": ""}  # fmt: skip
    first = await env.post(path, form, alice)
    assert first.status == 200
    assert _retry_summary(first).startswith("204 with an empty body (Fence-Replay-Body: none)")
    assert "responseStatus" not in first.text  # nothing pasted, nothing carried
    done = await _confirmed(env, alice, path, form)
    assert done.status == 200 and "answered 204 with no body" in done.text
    status, headers, body = await env.api(
        "POST", f"/proxy/api/slow/{TIMEOUT_MS + 100}/pay", "worker", {"amount": 5}, fence
    )
    assert status == 204 and body is None and headers["Fence-Replay-Body"] == "none"


async def test_a_bad_pasted_answer_is_refused_by_the_apis_rule_with_nothing_recorded(
    env: Env,
) -> None:
    effect_id, _ = await env.unknown_effect("t-bad-answer")
    alice = await env.login(TOKENS["alice"][1])
    csrf = (await env.get(f"/console/effects/{effect_id}", alice)).csrf
    path = f"/console/effects/{effect_id}/resolve"
    base = {"outcome": "COMMITTED", "note": "checked", "csrf": csrf}
    cases: list[tuple[dict[str, str], str]] = [
        ({"responseStatus": "abc"}, "response.status: Input should be a valid integer"),
        ({"responseStatus": "2OO"}, "response.status: Input should be a valid integer"),
        ({"responseStatus": "99"}, "response.status: Input should be greater than or equal to 100"),
        ({"responseStatus": "600"}, "response.status: Input should be less than or equal to 599"),
        ({"responseStatus": "1234567"}, "response.status: Input should be a valid integer"),
        ({"responseBody": "{}"}, "response.status: the answer's status is required"),
        ({"responseHeaders": "X: 1"}, "response.status: the answer's status is required"),
        ({"responseStatus": "200", "responseHeaders": "no colon"},
         "response.headers, line 1: expected 'Name: value', got 'no colon'"),
        ({"responseStatus": "200", "responseHeaders": "X-A: 1\n: 2"},
         "response.headers, line 2: expected 'Name: value'"),
        ({"responseStatus": "200", "responseHeaders": "X-A: 1\nx-a: 2"},
         "response.headers, line 2: 'x-a' is given twice"),
        ({"responseStatus": "200", "responseHeaders": "X-A: " + "v" * 8193},
         "response.headers.X-A: String should have at most 8192 characters"),
        ({"responseStatus": "200",
          "responseHeaders": "\n".join(f"X-{i}: v" for i in range(101))},
         "response.headers: Dictionary should have at most 100 items"),
        # The ledger's rule: an answer goes with COMMITTED only.
        ({"outcome": "NOT_APPLIED", "responseStatus": "200"},
         "response: only with outcome COMMITTED"),
    ]  # fmt: skip
    for extra, words in cases:
        for confirm in ({}, {"confirm": "yes"}):
            page = await env.post(path, {**base, **extra, **confirm}, alice)
            assert page.status == 400 and "BAD_REQUEST" in page.text, (extra, page.status)
            assert words in html.unescape(page.text), (extra, page.text[-1500:])
            assert "Traceback" not in page.text
    _, _, record = await env.api("GET", f"/v1/effects/{effect_id}", "alice")
    assert record["state"] == "UNKNOWN" and record["actions"] == []
    # The confirmation is no promise: the ledger decides again when it is sent.
    good = {**base, "responseStatus": "200", "responseBody": "ok"}
    first = await env.post(path, good, alice)
    assert first.status == 200 and _retry_summary(first).startswith("the answer you pasted")
    status, _, _ = await env.api("POST", f"/v1/effects/{effect_id}/resolve", "alice",
                                 {"outcome": "NOT_APPLIED", "note": "meanwhile"})  # fmt: skip
    assert status == 200
    late = await env.post(path, _confirmation(first), alice)
    assert late.status == 409 and "EFFECT_SETTLED" in late.text


async def _post_big(env: Env, path: str, form: dict[str, str], cookie: str) -> Page:
    """``Env.post`` for a form of megabytes (aiohttp wants a stream for a body that big)."""
    headers = {"Cookie": f"{COOKIE}={cookie}", "Origin": env.origin,
               "Content-Type": "application/x-www-form-urlencoded"}  # fmt: skip
    data = io.BytesIO(urlencode(form).encode())
    async with env.client.post(path, data=data, headers=headers, allow_redirects=False) as resp:
        return Page(resp.status, resp.headers, await resp.text())


async def test_an_oversized_pasted_body_is_a_clear_refusal_never_a_500(
    env: Env, tmp_path: Path, downstream: Downstream
) -> None:
    one_mib = 1024 * 1024
    effect_id, _ = await env.unknown_effect("t-big-answer")
    alice = await env.login(TOKENS["alice"][1])
    csrf = (await env.get(f"/console/effects/{effect_id}", alice)).csrf
    form = {"outcome": "COMMITTED", "note": "n", "csrf": csrf, "responseStatus": "200",
            "responseBody": "a" * (one_mib + 1)}  # fmt: skip
    # Over server.max_body_bytes (1 MiB by default): the request guard refuses the form
    # before the console reads it, with the console's own page.
    guarded = await _post_big(env, f"/console/effects/{effect_id}/resolve", form, alice)
    assert guarded.status == 413 and "PAYLOAD_TOO_LARGE" in guarded.text
    assert guarded.headers["Content-Type"].startswith("text/html")
    assert "server.max_body_bytes" in guarded.text
    # Under a larger server.max_body_bytes, the API's own bound on the body (1 MiB) holds.
    config = console_config(tmp_path / "big.db", downstream,
                            server={"max_body_bytes": 4 * one_mib})  # fmt: skip
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        big = Env(client, downstream)
        effect_id, _ = await big.unknown_effect("t-big-answer")
        alice = await big.login(TOKENS["alice"][1])
        csrf = (await big.get(f"/console/effects/{effect_id}", alice)).csrf
        path = f"/console/effects/{effect_id}/resolve"
        for confirm in ({}, {"confirm": "yes"}):
            page = await _post_big(big, path, {**form, "csrf": csrf, **confirm}, alice)
            assert page.status == 400 and "text/html" in page.headers["Content-Type"]
            assert "response.body: String should have at most 1048576 characters" in page.text
        _, _, record = await big.api("GET", f"/v1/effects/{effect_id}", "alice")
        assert record["state"] == "UNKNOWN"


# --- Needs attention refreshes itself -------------------------------------------------------


async def test_needs_attention_is_one_element_the_script_can_swap_with_its_time(env: Env) -> None:
    effect_id, _ = await env.unknown_effect()
    olive = await env.login(TOKENS["olive"][1])
    page = await env.get("/console", olive)
    found = re.search(r'<div id="attention" data-refresh-ms="(\d+)">', page.text)
    assert found and 0 < int(found.group(1)) <= 10_000
    # Everything that changes lives inside it: the counts, the time, the rows.
    inside = page.text[found.start() : page.text.index("</main>")]
    assert 'id="unknown-count">1 UNKNOWN' in inside and effect_id in inside
    assert re.search(r'id="as-of"[^>]*>as of \d\d:\d\d:\d\d UTC<', inside)


async def test_approve_shows_the_digest_and_expiry_and_records_the_approver(env: Env) -> None:
    effect_id, fence = await env.pending_email()
    alice = await env.login(TOKENS["alice"][1])
    queue = await env.get("/console", alice)
    assert "(0 unknown, 1 awaiting)" in queue.text and effect_id in queue.text
    page = await env.get(f"/console/effects/{effect_id}", alice)
    _, _, record = await env.api("GET", f"/v1/effects/{effect_id}", "alice")
    digest, approval = record["payloadDigest"], record["approvalDigest"]
    assert f'name="payloadDigest" value="{digest}"' in page.text and "10 min" in page.text
    assert f'name="approvalDigest" value="{approval}"' in page.text
    path = f"/console/effects/{effect_id}/approve"
    bad = await env.post(path, {"payloadDigest": "ab" * 40, "csrf": page.csrf}, alice)
    assert bad.status == 400
    stale = await _confirmed(env, alice, path, {"payloadDigest": "0" * 64, "csrf": page.csrf})
    assert stale.status == 422 and "PAYLOAD_CONFLICT" in stale.text
    with capture_logs() as logs:
        done = await _confirmed(env, alice, path, {"payloadDigest": digest, "note": "ok",
                                                   "approvalDigest": approval,
                                                   "csrf": page.csrf})  # fmt: skip
    assert done.status == 200 and "expires at" in done.text and digest in done.text
    assert [e["operator"] for e in logs if e["event"] == "operator.approve"] == ["alice"]
    status, headers, _ = await env.api(
        "POST", "/proxy/mail/send", "worker", {"to": "a@example.com"}, fence
    )
    assert status == 200 and headers["Fence-Effect-State"] == "COMMITTED"
    assert len(env.downstream.calls("/send")) == 1


async def test_reconcile_fleet_actions_and_tasks(env: Env) -> None:
    effect_id, _ = await env.unknown_effect()
    alice = await env.login(TOKENS["alice"][1])
    csrf = (await env.get("/console/fleet", alice)).csrf
    # The api downstream has no probe: the API's EFFECT_UNKNOWN, as a page.
    probe = await _confirmed(env, alice, f"/console/effects/{effect_id}/reconcile", {"csrf": csrf})
    assert probe.status == 409 and "EFFECT_UNKNOWN" in probe.text
    # The epoch bump wants the current epoch typed.
    wrong = await env.post("/console/fleet/bump", {"typed": "2", "csrf": csrf}, alice)
    assert wrong.status == 400 and "type the current epoch (1)" in wrong.text
    with capture_logs() as logs:
        bumped = await env.post("/console/fleet/bump", {"typed": " 1 ", "csrf": csrf}, alice)
        paused = await _confirmed(env, alice, "/console/fleet/pause", {"csrf": csrf})
        fleet = await env.get("/console/fleet", alice)
        resumed = await _confirmed(env, alice, "/console/fleet/resume", {"csrf": csrf})
    assert bumped.status == 200 and "now 2" in bumped.text
    assert paused.status == 200 and "Claims paused" in paused.text
    assert 'id="claims">paused' in fleet.text and "Fleet (epoch 2, claims paused)" in fleet.text
    assert resumed.status == 200
    assert [e["event"] for e in logs if e["event"].split(".")[0] in ("epoch", "claims")] == [
        "epoch.bumped", "claims.paused", "claims.resumed",
    ]  # fmt: skip
    task = await env.get("/console/tasks?id=t-unknown", alice)
    assert task.status == 200 and effect_id in task.text and "CLAIMED" in task.text
    assert 'class="countdown"' in task.text
    assert (await env.get("/console/tasks?id=nope", alice)).status == 404
    assert (await env.get("/console/tasks?id=" + "x" * 300, alice)).status == 400
    # Not an id nor a prefix of one: 404 naming the rule, as on the JSON API.
    assert (await env.get("/console/effects/NOT-HEX", alice)).status == 404
    # One sample now (the background one comes every 5 s: tests/test_console_fleet.py).
    app = env.client.app
    assert await app[CONSOLE].series.take(app[METRICS], app[STORE])
    async with env.client.get(
        "/console/fleet/series", headers={"Cookie": f"{COOKIE}={alice}"}
    ) as resp:
        samples = (await resp.json())["samples"]
    assert samples[-1]["unknown"] == 1 and samples[-1]["effects"]["api/UNKNOWN"] == 1
    # A hostile form: not urlencoded, fields twice, too many fields.
    for data, ctype in [
        (b"{}", "application/json"),
        (b"csrf=a&csrf=b", "application/x-www-form-urlencoded"),
        (b"&".join(b"f%d=1" % i for i in range(50)), "application/x-www-form-urlencoded"),
        (b"csrf=%ff%fe", "application/x-www-form-urlencoded"),
    ]:
        async with env.client.post(
            "/console/fleet/pause",
            data=data,
            headers={"Content-Type": ctype, "Origin": env.origin,
                     "Cookie": f"{COOKIE}={alice}"},
        ) as resp:  # fmt: skip
            assert resp.status in (400, 403), (data, resp.status)
            assert "text/html" in resp.headers["Content-Type"]


async def test_without_auth_the_console_asks_a_name_and_records_it(
    tmp_path: Path, downstream: Downstream
) -> None:
    """Decision: without ``[auth]`` the JSON API trusts every client, and so does the console:
    the login asks for a name (recorded like ``Fence-Operator``), the CSRF and origin rules
    still hold."""
    config = console_config(tmp_path / "fg.db", downstream, auth=False)
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        env = Env(client, downstream)
        login = await env.get("/console/login")
        assert "Your name" in login.text and "without <code>[auth]</code>" in login.text
        assert (await env.get("/console")).status == 303
        bad = await env.post("/console/login", {"name": "bob\nevil"})
        assert bad.status == 400
        bob = await env.login(name="bob on call")
        async with client.put("/v1/tasks/t1", json={"inputDigest": "i"}) as resp:
            assert resp.status == 201
        page = await env.get("/console", bob)
        assert page.status == 200 and "bob on call (operator)" in page.text
        csrf = page.csrf
        done = await _confirmed(env, bob, "/console/fleet/pause", {"csrf": csrf})
        assert done.status == 200
        assert (await client.app[STORE].get_scheduler()).claims_paused
        # A cookie signed by another gateway process is no session here.
        elsewhere = new_console(config, {SECRET_ENV: "another-secret-of-at-least-32-characters"})
        other = elsewhere.codec.issue("x", None, ("operator",))
        assert (await env.get("/console", other[0])).status == 303
        assert client.app[CONSOLE].key_from_env is False


async def test_a_keyed_effect_shows_its_principal_and_key_and_no_task(
    tmp_path: Path, downstream: Downstream
) -> None:
    """A lease-less client's effect (without ``[auth]``: the principal ``anonymous``) has null
    task fields: the queue, the effect page and the resolve confirmation name its principal
    and its key instead, and none of them breaks on the missing task."""
    config = console_config(tmp_path / "fg.db", downstream, auth=False)
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        env = Env(client, downstream)
        async with client.post(
            f"/proxy/api/slow/{TIMEOUT_MS + 100}/pay",
            json={"amount": 5},
            headers={"Idempotency-Key": '"chat-1:<pay>"'},
        ) as resp:
            assert resp.headers["Fence-Effect-State"] == "UNKNOWN", await resp.text()
            effect_id = resp.headers["Fence-Effect-Id"]
        bob = await env.login(name="bob")
        queue = await env.get("/console", bob)
        assert queue.status == 200, queue.text
        assert "chat-1:&lt;pay&gt;" in queue.text and "client anonymous" in queue.text
        assert "/console/tasks?id=" not in queue.text
        page = await env.get(f"/console/effects/{effect_id}", bob)
        assert page.status == 200, page.text
        assert 'id="kind">keyed<' in page.text
        assert '<dd id="principal">anonymous</dd>' in page.text
        assert 'id="idempotency-key">chat-1:&lt;pay&gt;</code>' in page.text
        assert "/console/tasks?id=" not in page.text and "None" not in page.text
        asked = await env.post(
            f"/console/effects/{effect_id}/resolve",
            {"outcome": "COMMITTED", "note": "found it", "csrf": page.csrf},
            bob,
        )
        assert asked.status == 200, asked.text
        assert "client &#39;anonymous&#39;, Idempotency-Key &#39;chat-1:&lt;pay&gt;&#39;" in (
            asked.text
        )
        done = await env.post(f"/console/effects/{effect_id}/resolve", _confirmation(asked), bob)
        assert done.status == 200 and "Effect is now COMMITTED." in done.text


def test_an_ambiguous_prefix_page_lists_a_keyed_effect_by_its_key() -> None:
    """The matches of an ambiguous prefix may be keyed effects (no task to link): rendered by
    the console's own template environment (a real collision of keyed ids is out of reach)."""
    from fencegate.gateway.console.views import template_environment

    common = {"method": "POST", "path": "/pay", "state": "UNKNOWN", "downstream": "api",
              "updatedAt": 1_800_000_000_000}  # fmt: skip
    effects = [
        {**common, "effectId": "ab" * 32, "kind": "leased", "taskId": "t-1", "revision": 2},
        {
            **common,
            "effectId": "ab" * 31 + "cd",
            "kind": "keyed",
            "taskId": None,
            "revision": None,
            "principal": "chat-agent",
            "idempotencyKey": "k<1>",
        },
    ]
    text = (
        template_environment()
        .get_template("effects_ambiguous.html")
        .render(viewer=None, csrf="", prefix="ababab", effects=effects, detail="ambiguous")
    )
    assert text.count("/console/tasks?id=") == 1 and "t-1" in text
    assert "k&lt;1&gt;" in text and "client chat-agent" in text and "None" not in text


async def test_reconcile_now_probes_the_downstream_and_shows_what_it_found(env: Env) -> None:
    fence = await env.lease("t-order")
    _, headers, _ = await env.api(
        "POST", f"/proxy/orders/slow/{TIMEOUT_MS + 100}/create", "worker", {"sku": 1}, fence
    )
    assert headers["Fence-Effect-State"] == "UNKNOWN"
    effect_id = headers["Fence-Effect-Id"]
    alice = await env.login(TOKENS["alice"][1])
    page = await env.get(f"/console/effects/{effect_id}", alice)
    assert 'id="reconcile"' in page.text and "has no probe" not in page.text
    with capture_logs() as logs:
        done = await _confirmed(
            env, alice, f"/console/effects/{effect_id}/reconcile", {"csrf": page.csrf}
        )
    assert (
        done.status == 200 and "Effect is COMMITTED." in done.text and "probe: found" in done.text
    )
    assert [e["by"] for e in logs if e["event"] == "effect.reconciled"] == ["operator:alice"]
    assert len(env.downstream.calls("/ok/probe/")) == 1
    after = await env.get(f"/console/effects/{effect_id}", alice)
    assert "operator:alice" in after.text and 'id="stored-body"' in after.text


# --- the task list, effects by a prefix (issue 27, item 7) ------------------------------------


async def test_the_task_list_filters_by_state_owner_and_expired_lease_and_pages(
    env: Env,
) -> None:
    store = env.client.app[STORE]
    for task_id in ("t-a", "t-b", "t-c", "t-d"):
        await store.put_task(task_id, "in", None)
    await store.claim("t-a", claim_as("w1"))  # a 10 s lease
    await store.claim("t-b", ClaimRequest(owner="w2", ttl_ms=60_000, scheduler_epoch=1))
    store.clock_offset_ms += 10_000
    alice = await env.login(TOKENS["alice"][1])

    def listed(page: Page) -> list[str]:
        return re.findall(r'<a href="/console/tasks\?id=([^"]+)">', page.text)

    every = await env.get("/console/tasks", alice)
    assert every.status == 200 and listed(every) == ["t-a", "t-b", "t-c", "t-d"]
    _no_inline_code(every.text)
    expired = await env.get("/console/tasks?state=&owner=&leaseExpired=true", alice)
    assert listed(expired) == ["t-a"] and 'class="lease-expired"' in expired.text
    assert '<option value="true" selected>' in expired.text
    assert listed(await env.get("/console/tasks?leaseExpired=false&state=CLAIMED", alice)) == [
        "t-b"
    ]
    assert listed(await env.get("/console/tasks?owner=w2", alice)) == ["t-b"]
    assert listed(await env.get("/console/tasks?state=READY", alice)) == ["t-c", "t-d"]
    # Pages of two, the filters kept in the links.
    first = await env.get("/console/tasks?limit=2", alice)
    assert listed(first) == ["t-a", "t-b"] and "First page" not in first.text
    (following,) = re.findall(r'<a href="([^"]+)" rel="next">', first.text)
    second = await env.get(html.unescape(following), alice)
    assert listed(second) == ["t-c", "t-d"] and "First page" in second.text
    assert 'rel="next"' not in second.text
    bad_queries = [("leaseExpired=yes", "leaseExpired: true or false"),
                   ("state=DONE", "state: one of"), ("color=red", "unknown query")]  # fmt: skip
    for bad, named in bad_queries:
        refused = await env.get(f"/console/tasks?{bad}", alice)
        assert refused.status == 400 and named in html.unescape(refused.text), bad


async def test_an_effect_page_by_a_prefix_and_an_ambiguous_one(env: Env) -> None:
    store = env.client.app[STORE]
    ids = sorted(await effects_of(store, "t-pair", colliding_slots("t-pair")))
    olive = await env.login(TOKENS["olive"][1])
    full = await env.get(f"/console/effects/{ids[0]}", olive)
    assert full.status == 200
    unique = ids[0][:12] if ids[0][:12] != ids[1][:12] else ids[0]
    short = await env.get(f"/console/effects/{unique}", olive)
    # The same page, but for how long ago (store time at each render: a loaded machine may
    # render them seconds apart).
    assert (short.status, _without_age(short.text)) == (200, _without_age(full.text))
    ambiguous = await env.get(f"/console/effects/{ids[0][:6]}", olive)
    assert ambiguous.status == 400
    _no_inline_code(ambiguous.text)
    assert re.findall(r'<a href="/console/effects/([0-9a-f]{64})">', ambiguous.text) == ids
    assert "is ambiguous" in ambiguous.text
    nothing = await env.get("/console/effects/abcdef12", olive)
    assert nothing.status == 404 and "no effect id starts with" in html.unescape(nothing.text)
    # Roles as for the full id: the console is the ledger's readers'.
    refused = await env.get(f"/console/effects/{ids[0][:6]}", None)
    assert refused.status in (303, 302)
