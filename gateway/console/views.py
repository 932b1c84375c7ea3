"""The console's pages and actions.

Every action is a POST of a form that carries the session's CSRF token, from a page of this
gateway (``Origin``, else ``Referer``, must be one of its origins). Without ``confirm=yes``
an action answers a confirmation page that repeats the form; with it, it calls the JSON API's
own function and shows what happened. Input is checked with the JSON API's models and
limits (``parse_body``), so the console accepts exactly what the API accepts. A refusal is an
HTML page with the problem's status, never a traceback.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import hashlib
import hmac
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import Any, Final
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import jinja2
import structlog
from aiohttp import web
from multidict import MultiDict

from fencegate.adapters import ProbeAdapter
from fencegate.gateway import answers
from fencegate.gateway.api_models import check_task_id, parse_body
from fencegate.gateway.auth import auth_state
from fencegate.gateway.console import CONSOLE, ROUTES
from fencegate.gateway.console.session import (
    COOKIE,
    PREFIX,
    SESSION_KEY,
    Session,
    login_redirect,
)
from fencegate.gateway.coordination import bump_epoch_now, set_claims_paused, task_filter
from fencegate.gateway.ledger_api import (
    ApproveBody,
    ResolveBody,
    approve_as,
    check_effect_id,
    find_effect,
    preview_resolve,
    reconcile_as,
    resolve_as,
    settle_ms_of,
    shown_record,
)
from fencegate.gateway.oauth import profile_digest
from fencegate.gateway.operations import rollout_json
from fencegate.gateway.principals import (
    Principal,
    operator_label,
    principal_of,
    scope_refusal,
)
from fencegate.gateway.request_guard import origin_allowed
from fencegate.gateway.state import ADAPTERS, CONFIG, STORE
from fencegate.ledger.effects import (
    Effect,
    EffectState,
    Resolution,
    is_awaiting_approval,
    landing_until,
)
from fencegate.ledger.errors import (
    AuthUnavailable,
    BadRequest,
    FencegateError,
    Forbidden,
    Unauthenticated,
)
from fencegate.ledger.queries import is_lease_expired
from fencegate.ledger.store import Store, encode_task_cursor
from fencegate.ledger.tasks import TaskState

__all__ = ["refusal", "setup", "template_environment"]

log = structlog.get_logger("fencegate.console")

_OPERATOR: Final = "operator"
_READERS: Final = frozenset({"operator", "observer"})
#: Most records one queue page scans per state, and shows.
_SCAN_PAGES, _PAGE, _SHOWN = 4, 500, 200
_MAX_FORM_FIELDS = 20
_MAX_TOKEN = 4096
#: How often an open Needs attention page re-reads itself (``console.js``): a change made
#: elsewhere (the CLI, the API, another operator) shows within this and one page load.
REFRESH_MS: Final = 5_000
#: Most characters of a pasted answer's body the confirmation page shows (all of it is sent).
_SHOWN_BODY = 64 * 1024
_STATUS_DIGITS = re.compile(r"[0-9]{1,6}")
_NEXT = re.compile(r"/console(?:/[A-Za-z0-9._~/%:@-]*)?(?:\?[A-Za-z0-9._~/%:@&=+-]*)?")
_STATIC: Final = {
    "console.css": "text/css",
    "console.js": "text/javascript",
    "favicon.svg": "image/svg+xml",
}
#: The console's Content-Security-Policy: its own script and stylesheet, nothing inline,
#: nothing from elsewhere, never framed.
CSP: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


@dataclass(frozen=True, slots=True)
class Viewer:
    """Who is looking, and what the page may offer them."""

    name: str
    roles: tuple[str, ...]
    #: None without ``[auth]`` (every caller may do everything, as on the JSON API).
    principal: Principal | None
    can_act: bool
    session: Session | None


# --- rendering ---------------------------------------------------------------------------------


def _ts(ms: object) -> str:
    if not isinstance(ms, int):
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _clock(ms: object) -> str:
    if not isinstance(ms, int):
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%H:%M:%S UTC")


def _duration(ms: object) -> str:
    if not isinstance(ms, int):
        return "-"
    seconds = max(0, ms) // 1000
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    if seconds < 172800:
        return f"{seconds // 3600} h"
    return f"{seconds // 86400} d"


def template_environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("fencegate.gateway.console", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["ts"] = _ts
    env.filters["duration"] = _duration
    env.filters["clock"] = _clock
    return env


def _render(
    request: web.Request, template: str, viewer: Viewer | None, status: int = 200, **context: Any
) -> web.Response:
    env = request.app[CONSOLE].templates
    csrf = viewer.session.csrf if viewer is not None and viewer.session is not None else ""
    text = env.get_template(template).render(viewer=viewer, csrf=csrf, **context)
    return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")


def _error_page(request: web.Request, viewer: Viewer | None, error: FencegateError) -> web.Response:
    return _render(
        request, "error.html", viewer, status=error.status, code=error.code, detail=error.detail
    )


def refusal(request: web.Request, error: FencegateError) -> web.StreamResponse:
    """How the ``[auth]`` middleware refuses a console request: a page that needs a session
    goes to the login page; anything else is an HTML error page with the problem's status."""
    if isinstance(error, Unauthenticated) and request.method in ("GET", "HEAD"):
        return login_redirect(request, ended=COOKIE in request.cookies)
    response = _error_page(request, None, error)
    if isinstance(error, Unauthenticated):
        response.del_cookie(COOKIE, path=PREFIX)
    return response


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Every console answer, refusals included: the CSP, no framing, no sniffing, no caching
    of pages (static assets may be cached briefly)."""
    if not (request.path == PREFIX or request.path.startswith(PREFIX + "/")):
        return
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["Referrer-Policy"] = "same-origin"
    if not request.path.startswith(PREFIX + "/static/"):
        response.headers["Cache-Control"] = "no-store"


# --- who is looking, and may they act ---------------------------------------------------------


def _viewer(request: web.Request) -> Viewer | None:
    """The viewer, or None when there is no usable session. With ``[auth]`` the middleware has
    already checked the session (or a ``Fence-Authorization`` header) against the principals
    in force; without it the cookie alone says who the operator is (a label, as
    ``Fence-Operator`` is on the JSON API)."""
    session = request.get(SESSION_KEY)
    if not isinstance(session, Session):
        session = None
    if request.app[CONFIG].auth is not None:
        principal = principal_of(request)
        if principal is None:
            return None
        roles = tuple(sorted(principal.roles))
        return Viewer(principal.name, roles, principal, principal.has(_OPERATOR), session)
    session = request.app[CONSOLE].codec.read(request.cookies.get(COOKIE))
    if session is None or session.token_sha256 is not None:
        return None
    return Viewer(session.name, session.roles, None, True, session)


def _local_port(request: web.Request) -> int | None:
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if isinstance(sockname, tuple) and len(sockname) >= 2 and isinstance(sockname[1], int):
        return sockname[1]
    return None


def _origin_refusal(request: web.Request) -> FencegateError | None:
    """Why this POST is not from one of the gateway's own pages (None: it is). ``Origin``
    when the browser sends it (the request guard has already refused a foreign one), else
    the origin of ``Referer``. Neither: 400 (every browser sends ``Origin`` with a POST; a
    client that sends neither is not a console page), a foreign one: 403."""
    server = request.app[CONFIG].server
    origin = request.headers.get("Origin")
    if origin is None:
        referer = request.headers.get("Referer")
        if not referer:
            return BadRequest("a console form is sent with Origin or Referer")
        try:
            parts = urlsplit(referer)
        except ValueError:  # an unclosed "[", a netloc that NFKC changes...
            return Forbidden("the form was not sent from one of this gateway's pages")
        origin = f"{parts.scheme}://{parts.netloc}"
    if not origin_allowed(server, origin, _local_port(request)):
        return Forbidden("the form was not sent from one of this gateway's pages")
    return None


async def _form(request: web.Request) -> dict[str, str]:
    if request.content_type != "application/x-www-form-urlencoded":
        raise BadRequest("a console form is sent as application/x-www-form-urlencoded")
    raw = await request.read()
    try:
        pairs = parse_qsl(
            raw.decode("utf-8"),
            keep_blank_values=True,
            strict_parsing=False,
            max_num_fields=_MAX_FORM_FIELDS,
        )
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"the form cannot be read: {exc}") from None
    form: dict[str, str] = {}
    for name, value in pairs:
        if name in form:
            raise BadRequest(f"the form sends {name!r} twice")
        form[name] = value
    return form


Page = Callable[[web.Request, Viewer], Awaitable[web.StreamResponse]]
Action = Callable[[web.Request, Viewer, dict[str, str]], Awaitable[web.StreamResponse]]


def _page(handler: Page) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def serve(request: web.Request) -> web.StreamResponse:
        viewer = _viewer(request)
        if viewer is None:
            return login_redirect(request, ended=COOKIE in request.cookies)
        try:
            return await handler(request, viewer)
        except FencegateError as exc:
            return _error_page(request, viewer, exc)

    return serve


def _action(handler: Action) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An operator's action: a session, the operator role, a same-origin form with the
    session's CSRF token; then the handler, whose refusals become error pages."""

    async def act(request: web.Request) -> web.StreamResponse:
        viewer = _viewer(request)
        if viewer is None:
            return _error_page(request, None, Unauthenticated("no console session: log in"))
        try:
            if not viewer.can_act:
                raise Forbidden(f"{viewer.name!r} may look but not act (operator role needed)")
            refused = _origin_refusal(request)
            if refused is None:
                form = await _form(request)
                given = form.pop("csrf", "")
                if viewer.session is None:
                    # A Fence-Authorization header reached a console action: not a browser
                    # (nothing to forge), but the console acts only for a logged-in session.
                    raise BadRequest("console actions need a console session; scripts use /v1/")
                if not hmac.compare_digest(given.encode(), viewer.session.csrf.encode()):
                    refused = Forbidden("the form's CSRF token is missing or not this session's")
            if refused is not None:
                log.info("console.csrf_refused", principal=viewer.name, path=request.path,
                         reason=refused.detail)  # fmt: skip
                raise refused
            return await handler(request, viewer, form)
        except FencegateError as exc:
            return _error_page(request, viewer, exc)

    return act


# --- login ----------------------------------------------------------------------------------


def _next(value: str | None) -> str:
    """Where a login goes on to: a console path of this gateway only (never off-site, never
    out of ``/console`` by ``..``, nor by ``%2e%2e``, which browsers read as ``..``)."""
    if value and _NEXT.fullmatch(value):
        plain = unquote(value)
        if "//" not in plain and ".." not in plain:
            return value
    return PREFIX


async def login_page(request: web.Request) -> web.StreamResponse:
    return _render(
        request,
        "login.html",
        None,
        next=_next(request.query.get("next")),
        ended=request.query.get("ended") == "1",
        with_auth=request.app[CONFIG].auth is not None,
        error=None,
    )


async def login(request: web.Request) -> web.StreamResponse:
    """Check the pasted token against the principals in force and set the session cookie."""
    with_auth = request.app[CONFIG].auth is not None

    def again(status: int, error: str, target: str = PREFIX) -> web.Response:
        return _render(request, "login.html", None, status=status, next=target, ended=False,
                       with_auth=with_auth, error=error)  # fmt: skip

    refused = _origin_refusal(request)
    if refused is not None:
        log.info("console.csrf_refused", principal=None, path=request.path,
                 reason=refused.detail)  # fmt: skip
        return again(refused.status, refused.detail)
    try:
        form = await _form(request)
    except BadRequest as exc:
        return again(400, exc.detail)
    target = _next(form.get("next"))
    codec = request.app[CONSOLE].codec
    state = auth_state(request.app)
    if with_auth and state is not None:
        token = form.get("token", "").strip()
        profile: str | None = None
        if not token or len(token) > _MAX_TOKEN or any(c.isspace() for c in token):
            principal = None
        else:
            principal = state.authenticator.principal(token)
        oauth = state.authenticator.oauth
        if principal is None and oauth is not None and oauth.looks_like_jwt(token):
            # An OAuth access token for the gateway (aud: resource_base_url or audience).
            try:
                verified = await oauth.verify(token, request.path)
            except AuthUnavailable as exc:
                log.warning("auth.unavailable", method=request.method, path=request.path,
                            reason=exc.detail)  # fmt: skip
                return again(503, "The token's signing keys cannot be fetched now.", target)
            except Unauthenticated as exc:
                log.info("auth.unauthenticated", method=request.method, path=request.path,
                         reason=f"console login: {exc.detail}")  # fmt: skip
                return again(401, "That token is not accepted here.", target)
            principal = verified.principal
            if principal is None or verified.profile is None:
                log.info("auth.insufficient_scope", principal=verified.name,
                         method=request.method, path=request.path)  # fmt: skip
                return again(403, "The console is for operators and observers.", target)
            digest = profile_digest(oauth.config.profiles[verified.profile])
            profile = f"{verified.profile}:{digest}"
        if principal is None:
            log.info("auth.unauthenticated", method=request.method, path=request.path,
                     reason="console login: the token matches no principal")  # fmt: skip
            return again(401, "That token matches no principal.", target)
        if not principal.roles & _READERS:
            log.info("auth.forbidden", principal=principal.name, roles=sorted(principal.roles),
                     method=request.method, path=request.path)  # fmt: skip
            return again(403, "The console is for operators and observers.", target)
        if profile is not None and principal.expires_at is not None:
            # an OAuth login: the session ends with the token
            value, session = codec.issue(
                principal.name, None, tuple(principal.roles), profile=profile,
                until_ms=int(principal.expires_at * 1000),
            )  # fmt: skip
        else:
            digest = hashlib.sha256(token.encode()).hexdigest()
            value, session = codec.issue(principal.name, digest, tuple(principal.roles))
    else:
        try:
            name = operator_label(form.get("name", "") or "anonymous", "name")
        except BadRequest as exc:
            return again(400, exc.detail, target)
        value, session = codec.issue(name, None, (_OPERATOR,))
    log.info("console.login", principal=session.name, roles=list(session.roles),
             expires_at=session.expires_at)  # fmt: skip
    response = web.Response(status=303, headers={"Location": target})
    response.set_cookie(
        COOKIE,
        value,
        max_age=codec.ttl_ms // 1000,
        path=PREFIX,
        httponly=True,
        samesite="Strict",
        secure=request.secure,
    )
    return response


async def logout(request: web.Request) -> web.StreamResponse:
    refused = _origin_refusal(request)
    if refused is not None:
        return _error_page(request, None, refused)
    response = web.Response(status=303, headers={"Location": f"{PREFIX}/login"})
    response.del_cookie(COOKIE, path=PREFIX)
    return response


async def static(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    content_type = _STATIC.get(name)
    if content_type is None:
        return _error_page(request, None, _NotFound(f"no console asset {name!r}"))
    data = resources.files(__package__).joinpath("static", name).read_bytes()
    return web.Response(
        body=data,
        content_type=content_type,
        charset="utf-8",
        headers={"Cache-Control": "max-age=300"},
    )


class _NotFound(FencegateError):
    code = "NOT_FOUND"
    status = 404
    title = "Not found"


# --- Needs attention --------------------------------------------------------------------------


async def _scan(store: Store, state: EffectState) -> tuple[list[Effect], bool]:
    """Effects in ``state``, oldest first, bounded; True when there may be more than shown."""
    found: list[Effect] = []
    cursor: str | None = None
    for _ in range(_SCAN_PAGES):
        page, cursor = await store.list_effects(
            state=state, task_id=None, downstream=None, limit=_PAGE, cursor=cursor
        )
        found.extend(page)
        if cursor is None or len(found) >= _SHOWN:
            return found[:_SHOWN], cursor is not None or len(found) > _SHOWN
    return found[:_SHOWN], True


def _last_seen(record: dict[str, Any]) -> str:
    """What the reconciler (or the forward) last saw, in a few words."""
    probes = [a for a in record["actions"] if a.get("action") == "reconcile"]
    if probes:
        last = probes[-1]
        return f"probe: {last.get('verdict', '?')} ({_ts(last.get('at'))})"
    attempts = record["attempts"]
    if attempts:
        last_attempt = attempts[-1]
        outcome = last_attempt.get("outcome") or "running"
        return f"forward: {outcome}: {last_attempt.get('reason') or '-'}"
    return "no forward yet"


@_page
async def queue(request: web.Request, viewer: Viewer) -> web.StreamResponse:
    store = request.app[STORE]
    now = await store.now_ms()
    unknown, more_unknown = await _scan(store, EffectState.UNKNOWN)
    awaiting = await store.awaiting_approval(_SHOWN + 1)
    awaiting, more_awaiting = awaiting[:_SHOWN], len(awaiting) > _SHOWN
    gauges = await store.gauges()
    rows = []
    for effect, why in sorted(
        [(e, "UNKNOWN") for e in unknown] + [(e, "awaiting approval") for e in awaiting],
        key=lambda pair: (pair[0].created_at, pair[0].effect_id),
    ):
        record = shown_record(viewer.principal, effect, request.app)
        rows.append(
            {
                "effect": record,
                "why": why,
                "age_ms": now - effect.created_at,
                "last_seen": _last_seen(record),
            }
        )
    return _render(
        request,
        "queue.html",
        viewer,
        rows=rows,
        unknown_count=gauges.unknown_effects,
        awaiting_count=gauges.awaiting_approval,
        more=more_unknown or more_awaiting,
        now=now,
        refresh_ms=REFRESH_MS,
    )


# --- one effect --------------------------------------------------------------------------------


def _body_text(response: dict[str, Any] | None) -> str | None:
    if not response or not isinstance(response.get("bodyBase64"), str):
        return None
    try:
        raw = base64.b64decode(response["bodyBase64"], validate=True)
    except (binascii.Error, ValueError):
        return None
    try:
        # Not final: the 64 KiB cut may split a character, which is not a sign of binary.
        return codecs.getincrementaldecoder("utf-8")().decode(raw[: 64 * 1024], final=False)
    except UnicodeDecodeError:
        return f"(binary, {len(raw)} bytes)"


def _whose(effect: Effect) -> str:
    """Whose call an effect is, for a confirmation: a worker's task, or a lease-less client's
    key (a keyed effect has no task)."""
    if effect.task_id is None:
        return f"client {effect.principal!r}, Idempotency-Key {effect.idempotency_key!r}"
    return f"task {effect.task_id}"


async def _effect_context(request: web.Request, viewer: Viewer, effect: Effect) -> dict[str, Any]:
    record = shown_record(viewer.principal, effect, request.app)
    adapter = request.app[ADAPTERS].get(effect.downstream)
    approval_ttl_ms = adapter.approval_ttl(effect.path) if adapter is not None else None
    return {
        "effect": record,
        "body_text": _body_text(record.get("response")),
        "probes": [a for a in record["actions"] if a.get("action") == "reconcile"],
        "trail": record["actions"],
        "awaiting": is_awaiting_approval(effect) and approval_ttl_ms is not None,
        "approval_ttl_ms": approval_ttl_ms,
        "can_probe": isinstance(adapter, ProbeAdapter) and adapter.probe is not None,
        "is_unknown": effect.state is EffectState.UNKNOWN,
        # Until then an earlier forward may still land: NOT_APPLIED only with force.
        "landing_until": landing_until(effect, settle_ms_of(request.app, effect)),
        "now": await request.app[STORE].now_ms(),
    }


@_page
async def effect_page(request: web.Request, viewer: Viewer) -> web.StreamResponse:
    """An effect by its full id or a unique prefix (the JSON API's ``find_effect``, so the
    12 characters the queue and the CLI show work in the URL); an ambiguous prefix is a
    page listing the matches, each linked."""
    text = request.match_info["effect_id"]
    store = request.app[STORE]
    try:
        effect = await find_effect(store, text)
    except BadRequest as exc:
        matches = exc.extra.get("matches")
        if not isinstance(matches, list):
            raise
        found = []
        for effect_id in matches:
            try:
                found.append(
                    shown_record(viewer.principal, await store.get_effect(effect_id), request.app)
                )
            except FencegateError:  # gone since (retention): not worth a page of its own
                continue
        return _render(request, "effects_ambiguous.html", viewer, status=exc.status,
                       prefix=text, effects=found, detail=exc.detail)  # fmt: skip
    context = await _effect_context(request, viewer, effect)
    return _render(request, "effect.html", viewer, **context)


def _confirm(
    request: web.Request,
    viewer: Viewer,
    title: str,
    what: str,
    fields: dict[str, str],
    back: str,
    retry: RetryGets | None = None,
) -> web.Response:
    return _render(request, "confirm.html", viewer, title=title, what=what, fields=fields,
                   action=request.path, back=back, retry=retry)  # fmt: skip


def _done(
    request: web.Request, viewer: Viewer, title: str, lines: list[str], back: str
) -> web.Response:
    return _render(request, "result.html", viewer, title=title, lines=lines, back=back)


def _pasted_answer(form: dict[str, str]) -> dict[str, Any] | None:
    """The downstream's answer pasted in the resolve form, as the JSON API's ``response``
    member; None when status, headers and body are all empty. Only the form's own syntax is
    read here (the status's digits, one ``Name: value`` header per line): what an answer may
    be (status range, sizes, how many headers) is ``ResolveBody``'s to say, through
    ``parse_body``, as for ``fencegate effects resolve --response-*``."""
    status = form.get("responseStatus", "").strip()
    lines = form.get("responseHeaders", "")
    # A browser sends a textarea's line breaks as CRLF whatever was pasted: keep them LF.
    body = form.get("responseBody", "").replace("\r\n", "\n")
    if not status:
        if lines.strip() or body:
            raise BadRequest(
                "response.status: the answer's status is required with its headers or body "
                "(leave all three empty to give no answer)"
            )
        return None
    headers: dict[str, str] = {}
    for at, line in enumerate(lines.splitlines(), start=1):
        if not line.strip():
            continue
        name, sep, value = line.partition(":")
        name = name.strip()
        if not sep or not name:
            raise BadRequest(f"response.headers, line {at}: expected 'Name: value', "
                             f"got {line[:100]!r}")  # fmt: skip
        if name.lower() in (known.lower() for known in headers):
            raise BadRequest(f"response.headers, line {at}: {name[:100]!r} is given twice")
        headers[name] = value.strip()
    # A few digits become the number the model checks; anything else (a letter, a digit
    # string long enough to be slow to convert) goes as text, which the model refuses with
    # its own words.
    number: int | str = int(status) if _STATUS_DIGITS.fullmatch(status) else status
    return {"status": number, "headers": headers, "body": body}


@dataclass(frozen=True, slots=True)
class RetryGets:
    """What the agent's retries of a call resolved COMMITTED will be answered."""

    summary: str
    #: The ledger's own words about it (``Resolution.warnings``).
    lines: tuple[str, ...]
    headers: tuple[tuple[str, str], ...] = ()
    #: The pasted body as shown (at most ``_SHOWN_BODY`` characters); None: no pasted body.
    body: str | None = None


def _retry_gets(body: ResolveBody, decided: Resolution) -> RetryGets | None:
    """From the ledger's decision (``preview_resolve``), never from a rule of its own:
    the pasted answer, the answer the forward recorded, or an empty 204."""
    if decided.effect.state is not EffectState.COMMITTED:
        return None
    given = body.response
    if given is not None:
        size = len(given.body.encode())
        summary = (f"the answer you pasted: status {given.status}, {len(given.headers)} "
                   f"header(s), a {size}-byte body")  # fmt: skip
        if len(given.body) > _SHOWN_BODY:
            summary += f" (its first {_SHOWN_BODY} characters are shown below)"
        return RetryGets(summary + ".", decided.warnings, tuple(given.headers.items()),
                         given.body[:_SHOWN_BODY])  # fmt: skip
    if decided.empty_replay:
        return RetryGets("204 with an empty body (Fence-Replay-Body: none), not the "
                         "downstream's answer.", decided.warnings)  # fmt: skip
    recorded = json.loads(decided.effect.response_json or "{}")
    return RetryGets(f"the answer the forward recorded (status {recorded.get('status')}).",
                     decided.warnings)  # fmt: skip


@_action
async def resolve(request: web.Request, viewer: Viewer, form: dict[str, str]) -> web.StreamResponse:
    effect_id = check_effect_id(request.match_info["effect_id"])
    fields = {"outcome": form.get("outcome", ""), "note": form.get("note", "")}
    if form.get("force") == "true":
        fields["force"] = "true"  # the checkbox; carried through the confirm page
    wire: dict[str, Any] = {**fields, "force": "force" in fields}
    answer = _pasted_answer(form)
    if answer is not None:
        wire["response"] = answer
        # Carried through the confirm page as read (headers one per line, body with LF).
        fields["responseStatus"] = str(answer["status"])
        fields["responseHeaders"] = "\n".join(f"{k}: {v}" for k, v in answer["headers"].items())
        fields["responseBody"] = answer["body"]
    # The JSON API's model and limits: a note is required, 1 to 2000 characters; an answer's
    # status 100 to 599, its body at most 1 MiB, at most 100 headers.
    body = parse_body(json.dumps(wire).encode(), ResolveBody)
    back = f"{PREFIX}/effects/{effect_id}"
    if form.get("confirm") != "yes":
        # The ledger's rule on the record as it is now: its refusals (an answer with
        # NOT_APPLIED, a forward that may still land, an effect settled meanwhile) come
        # before the confirmation, and what duplicates will get is said from its decision.
        decided = await preview_resolve(request.app, effect_id, viewer.name, body)
        effect = decided.effect
        meaning = (
            "the call did not happen: the agent's retry will be forwarded again"
            if body.outcome == "NOT_APPLIED"
            else "the call happened: it is never sent again"
        )
        if body.force and body.outcome == "NOT_APPLIED":
            meaning += (" (forced: even if an earlier forward may still land at the "
                        "downstream, which would then run it twice; recorded)")  # fmt: skip
        what = (f"Resolve effect {effect_id[:12]}... ({_whose(effect)}, "
                f"{effect.downstream} {effect.method} {effect.path}) as {body.outcome}: "
                f"{meaning}.")  # fmt: skip
        if decided.unchanged:
            what += " It is already resolved this way: nothing new would be recorded."
        retry = _retry_gets(body, decided)
        return _confirm(request, viewer, "Resolve this effect?", what, fields, back, retry)
    effect, done = await resolve_as(request.app, effect_id, viewer.name, body)
    lines = [f"Effect is now {effect.state.value}.", f"Recorded by {viewer.name}: {body.note}"]
    if done.unchanged:
        lines.append("It was already resolved this way: nothing new was recorded.")
    elif done.forced_until is not None:
        lines.append(f"Forced: an earlier forward could still land at the downstream until "
                     f"{_ts(done.forced_until)}.")  # fmt: skip
    if body.response is not None:
        lines.append(f"Retries of this call get the answer you gave (status "
                     f"{body.response.status}).")  # fmt: skip
    lines.extend(done.warnings)
    return _done(request, viewer, f"Resolved {body.outcome}", lines, back)


@_action
async def approve(request: web.Request, viewer: Viewer, form: dict[str, str]) -> web.StreamResponse:
    effect_id = check_effect_id(request.match_info["effect_id"])
    # The page sends the request's approvalDigest (its payload and effect-changing headers)
    # and its payloadDigest: the API checks both against what still waits.
    fields = {k: form[k] for k in ("approvalDigest", "payloadDigest") if form.get(k)}
    if not fields:
        raise BadRequest("approvalDigest: the console approves an exact digest")
    fields["note"] = form.get("note", "")
    body = parse_body(json.dumps(fields).encode(), ApproveBody)
    back = f"{PREFIX}/effects/{effect_id}"
    if form.get("confirm") != "yes":
        effect = await request.app[STORE].get_effect(effect_id)
        adapter = request.app[ADAPTERS].get(effect.downstream)
        ttl = adapter.approval_ttl(effect.path) if adapter is not None else None
        named = body.approvalDigest or body.payloadDigest
        what = (f"Approve request {named} (payload {body.payloadDigest or 'as it waits'}) of "
                f"effect {effect_id[:12]}... ({_whose(effect)}, {effect.downstream} "
                f"{effect.method} {effect.path}). The agent's next call with exactly this "
                f"payload and these headers is sent once; the approval expires "
                f"{_duration(ttl)} after you confirm.")  # fmt: skip
        return _confirm(request, viewer, "Approve this send?", what, fields, back)
    effect = await approve_as(request.app, effect_id, viewer.name, viewer.principal, body)
    lines = [
        f"Approved request {effect.approval_digest} (payload {effect.payload_digest}) as "
        f"{viewer.name}.",
        f"The approval expires at {_ts(effect.approval_expires_at)}.",
    ]
    return _done(request, viewer, "Approved", lines, back)


@_action
async def reconcile_now(
    request: web.Request, viewer: Viewer, form: dict[str, str]
) -> web.StreamResponse:
    effect_id = check_effect_id(request.match_info["effect_id"])
    back = f"{PREFIX}/effects/{effect_id}"
    if form.get("confirm") != "yes":
        what = (f"Ask the downstream now whether effect {effect_id[:12]}... happened "
                "(its probe). A clear answer settles the effect.")  # fmt: skip
        return _confirm(request, viewer, "Probe now?", what, {}, back)
    effect = await reconcile_as(request.app, effect_id, viewer.name)
    record = shown_record(viewer.principal, effect, request.app)
    return _done(request, viewer, "Probed", [f"Effect is {effect.state.value}.",
                 _last_seen(record)], back)  # fmt: skip


# --- tasks ---------------------------------------------------------------------------------------


#: Tasks one page of the console's task list shows unless ``limit`` says otherwise.
_TASK_PAGE = 50
_TASK_FILTERS = ("state", "owner", "leaseExpired", "limit")


async def _task_list(request: web.Request, viewer: Viewer) -> web.StreamResponse:
    """Tasks in task id order, filtered by state, owner and expired lease, a page at a time:
    the query of ``GET /v1/tasks`` (``task_filter``: the same checks, the same scope), with
    a form's empty fields left out."""
    given: MultiDict[str] = MultiDict(
        (name, value.strip()) for name, value in request.query.items() if value.strip()
    )
    # The filters as given (the links carry them on); the page size defaults to _TASK_PAGE.
    filters = {name: given[name] for name in _TASK_FILTERS if name in given}
    if "limit" not in given:
        given["limit"] = str(_TASK_PAGE)
    wanted, limit, after = task_filter(given, viewer.principal)
    store = request.app[STORE]
    found, last = await store.list_tasks(wanted, limit, after)
    now = await store.now_ms()
    rows = [
        {"task": answers.Task.of(task).wire(), "expired": is_lease_expired(task, now)}
        for task in found
    ]
    return _render(
        request,
        "tasks.html",
        viewer,
        query="",
        task=None,
        effects=[],
        now=now,
        rows=rows,
        filters=filters,
        states=list(TaskState.__members__),
        first=f"{PREFIX}/tasks?{urlencode(filters)}" if after is not None else None,
        next=(
            f"{PREFIX}/tasks?{urlencode({**filters, 'cursor': encode_task_cursor(last)})}"
            if last is not None
            else None
        ),
    )


@_page
async def tasks(request: web.Request, viewer: Viewer) -> web.StreamResponse:
    raw_id = request.query.get("id", "").strip()
    if not raw_id:
        return await _task_list(request, viewer)
    task_id = check_task_id(raw_id)
    if viewer.principal is not None:
        # The JSON API's scope rule for GET /v1/tasks/{id}.
        reason = scope_refusal(viewer.principal.scope, downstream=None, task_id=task_id)
        if reason is not None:
            raise Forbidden(f"{viewer.name!r}: {reason}")
    store = request.app[STORE]
    task = await store.get_task(task_id)
    found, _ = await store.list_effects(
        state=None, task_id=task_id, downstream=None, limit=100, cursor=None
    )
    return _render(
        request,
        "tasks.html",
        viewer,
        query=task_id,
        task=answers.Task.of(task).wire(),
        effects=[shown_record(viewer.principal, e, request.app) for e in found],
        now=await store.now_ms(),
    )


# --- fleet -------------------------------------------------------------------------------------


@_page
async def fleet(request: web.Request, viewer: Viewer) -> web.StreamResponse:
    rollout = await rollout_json(request.app[STORE])
    return _render(request, "fleet.html", viewer, rollout=rollout,
                   shared_key=request.app[CONSOLE].key_from_env)  # fmt: skip


@_page
async def series(request: web.Request, viewer: Viewer) -> web.StreamResponse:
    # What the background sampling kept (``series.Series.run``): no store round trip here.
    return web.json_response(request.app[CONSOLE].series.answer())


@_action
async def bump(request: web.Request, viewer: Viewer, form: dict[str, str]) -> web.StreamResponse:
    store = request.app[STORE]
    current = await store.get_scheduler()
    if form.get("typed", "").strip() != str(current.epoch):
        raise BadRequest(
            f"type the current epoch ({current.epoch}) to bump it; nothing was changed"
        )
    scheduler = await bump_epoch_now(store, viewer.name)
    lines = [f"The scheduler epoch is now {scheduler.epoch}: every older claim is fenced."]
    return _done(request, viewer, "Epoch bumped", lines, f"{PREFIX}/fleet")


def _claims(paused: bool) -> Action:
    async def switch(
        request: web.Request, viewer: Viewer, form: dict[str, str]
    ) -> web.StreamResponse:
        back = f"{PREFIX}/fleet"
        verb = "Pause" if paused else "Resume"
        if form.get("confirm") != "yes":
            what = ("No new claims anywhere until resumed; leases held now run on."
                    if paused else "Workers may claim tasks again.")  # fmt: skip
            return _confirm(request, viewer, f"{verb} claims?", what, {}, back)
        scheduler = await set_claims_paused(request.app[STORE], paused, viewer.name)
        state = "paused" if scheduler.claims_paused else "open"
        return _done(request, viewer, f"Claims {state}",
                     [f"Claims are {state} (epoch {scheduler.epoch})."], back)  # fmt: skip

    return switch


def setup(app: web.Application) -> None:
    """Register every route of ``ROUTES`` and the console's response headers."""
    handlers: dict[tuple[str, str], Callable[[web.Request], Awaitable[web.StreamResponse]]] = {
        ("GET", "/console"): queue,
        ("GET", "/console/login"): login_page,
        ("POST", "/console/login"): login,
        ("POST", "/console/logout"): logout,
        ("GET", "/console/static/{name}"): static,
        ("GET", "/console/effects/{effect_id}"): effect_page,
        ("POST", "/console/effects/{effect_id}/resolve"): resolve,
        ("POST", "/console/effects/{effect_id}/approve"): approve,
        ("POST", "/console/effects/{effect_id}/reconcile"): reconcile_now,
        ("GET", "/console/tasks"): tasks,
        ("GET", "/console/fleet"): fleet,
        ("GET", "/console/fleet/series"): series,
        ("POST", "/console/fleet/bump"): bump,
        ("POST", "/console/fleet/pause"): _action(_claims(True)),
        ("POST", "/console/fleet/resume"): _action(_claims(False)),
    }
    assert set(handlers) == {(method, path) for method, path, _ in ROUTES}
    for method, path, _ in ROUTES:
        app.router.add_route(method, path, handlers[(method, path)])
    app.on_response_prepare.append(_security_headers)
