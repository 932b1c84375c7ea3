"""The fenced proxy: ``{METHOD} /proxy/{downstream}/{path}?{query}``.

One mutation is two store round trips around one forward:

1. ``prepare_effect`` validates the claim and decides (forward / replay / refuse) in one
   atomic step; nothing leaves the gateway without a PREPARED record.
2. the forward, through one pooled ``ClientSession`` with the downstream's timeouts;
3. ``complete_effect`` records COMMITTED / NOT_APPLIED / UNKNOWN for that forward only.

A replay or a refusal is one round trip. Safe methods (GET, HEAD, OPTIONS) are fence-checked
in one round trip and forwarded without a ledger entry.

Two kinds of call share every step above. A worker's carries a lease (the ``Fence-*``
headers); a ``client``'s carries none, only its ``Idempotency-Key`` (``client_key``): its
effect is keyed (``effects.keyed_effect_id``: the principal, the downstream and the key), its
prepare checks no fence, the downstream gets no fencing token, and a replay also says
``Idempotent-Replayed: true``. Which kind a caller may send is its role's (``_caller``, before
anything is recorded), and whether a downstream takes keys at all is its
``client_idempotency_keys``. A lease-less client's safe method without a key is forwarded
unrecorded, with no fence to check. Every answer carries
``Fence-Effect-Id`` (when an effect is involved), ``Fence-Effect-State``,
``Fence-Replayed`` and ``Server-Timing`` (how long each step took: ``_Progress``).

What to do with the store's answer (refuse, replay, forward, shadow-forward, and the log
lines and metrics that go with it) is decided without I/O in ``gateway.proxy_decisions``;
here ``_handle`` asks the store, ``_carry_out`` acts on the decision, and every forward goes
through ``_forward``, which sends it through ``gateway.forward`` (the one forward path of
``/proxy``, ``/mcp`` and the probes: one table from a client failure to its outcome, one
decision of what the agent then gets).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from fencegate.adapters import Adapter, ProbeAdapter
from fencegate.adapters.base import Answer, Outgoing
from fencegate.adapters.http import NOT_APPLIED_STATUSES, UNKNOWN_STATUSES, HttpAdapter
from fencegate.gateway import effect_waiters, failpoints, tracing
from fencegate.gateway.config import DownstreamConfig
from fencegate.gateway.forward import (
    ForwardFailed,
    ForwardWindow,
    Limits,
    Target,
    abort_later,
    downstream_limits,
    failure_answer,
    forward_window,
    kept_request,
    prepare_effect,
    read_up_to,
    resend_window,
    send,
)
from fencegate.gateway.http_rules import (
    SAFE_METHODS,
    downstream_request_headers,
    refuse_method_override,
    split_proxy_path,
    stored_response_headers,
    upstream_response_headers,
    without_secret_values,
)
from fencegate.gateway.principals import (
    STRIP_AUTHORIZATION,
    caller_name,
    may_key,
    may_lease,
    principal_of,
)
from fencegate.gateway.problems import http_detail, problem_body, problem_response, requested
from fencegate.gateway.proxy_decisions import (
    Decision,
    Forward,
    PassThrough,
    Refuse,
    Replay,
    ShadowForward,
    Subject,
    Validation,
    call_fields,
    decide_effect,
    decide_safe,
    keyed_call_fields,
)
from fencegate.gateway.reconcile import reconcile
from fencegate.gateway.state import ADAPTERS, CONFIG, FORWARD_CLOCK, METRICS, STORE
from fencegate.ledger import effects
from fencegate.ledger.effects import (
    ClientKey,
    Effect,
    EffectRequest,
    EffectState,
    Fence,
    PrepareOutcome,
    keyed_effect_id,
)
from fencegate.ledger.errors import (
    BadRequest,
    FencegateError,
    Forbidden,
    IdempotencyKeyRequired,
    NoSuchDownstream,
    PayloadTooLarge,
    StoreUnavailable,
)
from fencegate.ledger.responses import OMITTED_BY_CONFIG, OMITTED_TOO_LARGE, response_json
from fencegate.ledger.store import new_id

__all__ = [
    "CLIENT_KEY_HEADER",
    "account",
    "client_key_header",
    "counter_header",
    "id_header",
    "proxy_answer_headers",
    "proxy_handler",
    "record_outcome",
    "start_too_late",
]

log = structlog.get_logger("fencegate.proxy")

_ID = re.compile(r"[A-Za-z0-9._:@/-]{1,200}")
_COUNTER = re.compile(r"0|[1-9][0-9]{0,15}")
_MAX_COUNTER = 2**53 - 1
_FORBIDDEN_METHODS = frozenset({"CONNECT", "TRACE"})
_ALLOWED_METHODS = ("GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE")
#: The header a lease-less client sends its idempotency key in (whatever header the
#: downstream receives: ``idempotency_key_header``, which carries the effectId).
CLIENT_KEY_HEADER = "Idempotency-Key"
#: Longest idempotency key, decoded (IETF httpapi-idempotency-key-header; Stripe's is 255).
_MAX_KEY = 255
#: A bare key: visible ASCII, no space, no control.
_BARE_KEY = re.compile(rf"[\x21-\x7e]{{1,{_MAX_KEY}}}")
#: An RFC 8941 sf-string: printable ASCII between quotes, only ``\"`` and ``\\`` escaped.
_SF_STRING = re.compile(r'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"')
_SF_ESCAPE = re.compile(r'\\(["\\])')
#: What a keyed call's ``Outgoing.slot`` says (``EffectRequest.slot``): not part of a keyed
#: effect's identity (its record has no slot), only what the adapters' ``effect_of`` reads.
_KEYED_SLOT = "key"
#: The node a keyed call's request names; likewise not part of its identity.
_KEYED_NODE = "main"


@dataclass(frozen=True, slots=True)
class _Call:
    """One proxied request, parsed and bounded."""

    downstream: DownstreamConfig
    adapter: Adapter
    method: str
    tail: str
    #: The lease of a worker's call; None for a lease-less client's.
    fence: Fence | None
    node: str
    slot: str | None
    body: bytes
    #: Where the handler records how long each step took (its ``Server-Timing``).
    progress: _Progress
    #: Shadow mode: refusals are recorded and let through.
    shadow: bool = False
    #: A lease-less client's principal and idempotency key (None: a leased call, or a
    #: lease-less safe method without a key, forwarded unrecorded).
    key: ClientKey | None = None
    #: Whose call it is (``principals.caller_name``).
    principal: str = ""

    @property
    def kind(self) -> str:
        """``leased`` or ``keyed`` (a lease-less client's call, with or without a key): the
        ``kind`` label of its metrics and log lines."""
        return "leased" if self.fence is not None else "keyed"


def _one_header(request: web.Request, name: str, required: bool) -> str | None:
    values = request.headers.getall(name, [])
    if len(values) > 1:
        raise BadRequest(f"{name}: sent more than once")
    if not values:
        if required:
            raise BadRequest(f"{name}: header is required")
        return None
    return values[0].strip()


def _id_header(request: web.Request, name: str, required: bool = True) -> str | None:
    value = _one_header(request, name, required)
    if value is not None and not _ID.fullmatch(value):
        raise BadRequest(f"{name}: must be 1 to 200 characters of A-Z a-z 0-9 . _ : @ / -")
    return value


def _counter_header(request: web.Request, name: str) -> int:
    value = _one_header(request, name, True)
    assert value is not None
    if not _COUNTER.fullmatch(value) or int(value) > _MAX_COUNTER:
        raise BadRequest(f"{name}: must be a non-negative decimal integer below 2^53")
    return int(value)


#: The ``Fence-*`` header readers, for ``/mcp`` too.
id_header = _id_header
counter_header = _counter_header


def parse_client_key(value: str) -> str | None:
    """An ``Idempotency-Key`` field value's key, None when it is not one: an RFC 8941
    sf-string when quoted (``"abc"`` is the key ``abc``), else a bare token of 1 to 255
    visible ASCII characters; either way 1 to 255 characters once decoded. Pure."""
    value = value.strip(" \t")
    if value.startswith('"'):
        quoted = _SF_STRING.fullmatch(value)
        if quoted is None:
            return None
        key = _SF_ESCAPE.sub(r"\1", quoted.group(1))
        return key if 1 <= len(key) <= _MAX_KEY else None
    return value if _BARE_KEY.fullmatch(value) else None


def client_key_header(request: web.Request) -> str | None:
    """The request's ``Idempotency-Key`` (``parse_client_key``), None when it sends none;
    400 naming the header for any other value, and when it is sent twice."""
    values = request.headers.getall(CLIENT_KEY_HEADER, [])
    if not values:
        return None
    if len(values) > 1:
        raise BadRequest(f"{CLIENT_KEY_HEADER}: sent more than once")
    key = parse_client_key(values[0])
    if key is None:
        raise BadRequest(
            f"{CLIENT_KEY_HEADER}: expected 1 to 255 visible ASCII characters (no space or "
            'control character), or a quoted string (RFC 8941: "...", printable ASCII, only '
            '\\" and \\\\ escaped) of 1 to 255 characters'
        )
    return key


def _lease_headers(request: web.Request) -> list[str]:
    """The ``Fence-*`` headers the request sends (its credential, ``Fence-Authorization``,
    is no part of a lease): any of them makes it a call under a lease."""
    return sorted(
        {name for name in request.headers if name.lower().startswith("fence-")}
        - {name for name in request.headers if name.lower() == "fence-authorization"}
    )


def _check_framing(request: web.Request) -> None:
    """Refuse requests whose body length is ambiguous; a proxy that guesses is smuggled."""
    lengths = request.headers.getall("Content-Length", [])
    encodings = request.headers.getall("Transfer-Encoding", [])
    if len(lengths) > 1 and len(set(lengths)) > 1:
        raise BadRequest("Content-Length: conflicting values")
    if lengths and encodings:
        raise BadRequest("Content-Length and Transfer-Encoding: both sent")


async def _parse(request: web.Request, progress: _Progress) -> _Call:
    config = request.app[CONFIG]
    method = request.method.upper()
    if method in _FORBIDDEN_METHODS:
        raise web.HTTPMethodNotAllowed(method, _ALLOWED_METHODS)
    name, tail = split_proxy_path(request.raw_path)
    downstream = config.downstream(name)
    if downstream is None:
        raise NoSuchDownstream(f"no downstream named {name!r} is configured")
    if downstream.adapter == "mcp":
        raise NoSuchDownstream(f"{name!r} is an MCP server: its calls go to /mcp/{name}")
    _check_framing(request)
    approval = request.app[ADAPTERS][name].require_approval  # an approval covers the method
    principal = principal_of(request)  # the lease's holder must be the caller (with [auth])
    fence, key, node, slot = _caller(request, downstream, method)
    limit = downstream.max_body_bytes
    body = await request.read()
    if limit is not None and len(body) > limit:
        raise PayloadTooLarge(
            f"{requested(request)}: a body of {len(body)} bytes is over "
            f"downstreams.{name}.max_body_bytes = {limit}"
        )
    refuse_method_override(method, request.headers.items(), tail, body, approval_required=approval)
    enforcement = downstream.enforcement or config.proxy.enforcement
    return _Call(
        downstream,
        request.app[ADAPTERS][name],
        method,
        tail,
        fence,
        node,
        slot,
        body,
        progress,
        shadow=enforcement == "shadow",
        key=key,
        principal=caller_name(principal),
    )


def _caller(
    request: web.Request, downstream: DownstreamConfig, method: str
) -> tuple[Fence | None, ClientKey | None, str, str | None]:
    """Which kind of call this is, and whether the caller may send it: (its lease, its
    client key, node, slot). Nothing is recorded before this has passed.

    With ``Fence-*`` headers: a call under a lease, a ``worker``'s (a ``client`` is 403).
    Without: a lease-less ``client``'s (a ``worker`` sending ``Idempotency-Key`` is 403),
    by the downstream's ``client_idempotency_keys``: ``off`` refuses it (400); with a key it
    is a keyed effect; without one a safe method is forwarded unrecorded, a mutation is 400
    (``required``: ``IDEMPOTENCY_KEY_REQUIRED``). Without ``[auth]`` the one caller
    (``anonymous``) may send either kind."""
    principal = principal_of(request)
    name = downstream.name
    lease = _lease_headers(request)
    if lease:
        if not may_lease(principal):
            assert principal is not None
            log.info("proxy.role_refused", principal=principal.name, downstream=name,
                     reason="lease_headers_from_client", headers=lease)  # fmt: skip
            raise Forbidden(
                f"{principal.name!r} has the role client: it calls without a lease, by "
                f"{CLIENT_KEY_HEADER}, and may not send {', '.join(lease)} (a worker's lease)"
            )
        return _fence(request, method, principal.name if principal is not None else None)
    sends_key = bool(request.headers.getall(CLIENT_KEY_HEADER, []))
    if sends_key and not may_key(principal):
        assert principal is not None
        log.info("proxy.role_refused", principal=principal.name, downstream=name,
                 reason="key_without_lease_from_worker")  # fmt: skip
        raise Forbidden(
            f"{principal.name!r} is a worker: its calls carry their lease (the Fence-* "
            f"headers); a call by {CLIENT_KEY_HEADER} without one is a client's (role client)"
        )
    setting = downstream.client_idempotency_keys
    if not may_key(principal) or (setting == "off" and not sends_key and may_lease(principal)):
        # As before keyed calls: a call without a lease names its missing lease.
        return _fence(request, method, principal.name if principal is not None else None)
    if setting == "off":
        raise BadRequest(
            f"{CLIENT_KEY_HEADER}: downstream {name!r} takes no calls without a lease "
            f'(downstreams.{name}.client_idempotency_keys = "off"); send it under a lease'
        )
    key = client_key_header(request)
    if key is not None:
        return None, ClientKey(caller_name(principal), key), _KEYED_NODE, _KEYED_SLOT
    if method in SAFE_METHODS:
        return None, None, _KEYED_NODE, None
    if setting == "required":
        raise IdempotencyKeyRequired(
            f"{CLIENT_KEY_HEADER}: header is required on a call without a lease to downstream "
            f'{name!r} (downstreams.{name}.client_idempotency_keys = "required"); nothing '
            "was recorded or sent"
        )
    raise BadRequest(
        f"{CLIENT_KEY_HEADER}: header is required on a {method} without a lease (or send it "
        "under a lease: the Fence-* headers)"
    )


def _fence(
    request: web.Request, method: str, principal: str | None
) -> tuple[Fence, None, str, str | None]:
    """A leased call's ``Fence-*`` headers."""
    task_id = _id_header(request, "Fence-Task")
    attempt_id = _id_header(request, "Fence-Attempt")
    assert task_id is not None and attempt_id is not None
    fence = Fence(
        task_id=task_id,
        attempt_id=attempt_id,
        claim_generation=_counter_header(request, "Fence-Generation"),
        scheduler_epoch=_counter_header(request, "Fence-Epoch"),
        cancel_generation=_counter_header(request, "Fence-Cancel"),
        principal=principal,
    )
    node = _id_header(request, "Fence-Node", required=False) or "main"
    slot = _id_header(request, "Fence-Slot", required=method not in SAFE_METHODS)
    return fence, None, node, slot


def _fence_headers(effect: Effect | None, state: str | None, replayed: bool) -> dict[str, str]:
    headers = {
        "Fence-Effect-State": state or (effect.state.value if effect else "NONE"),
        "Fence-Replayed": "true" if replayed else "false",
    }
    if effect is not None:
        headers["Fence-Effect-Id"] = effect.effect_id
    return headers


def _refusal(error: FencegateError) -> web.Response:
    tracing.refused(error)  # the problem code on the request's span
    headers = {
        "Fence-Effect-State": str(error.extra.get("effectState", "NONE")),
        "Fence-Replayed": "false",
    }
    if "effectId" in error.extra:
        headers["Fence-Effect-Id"] = str(error.extra["effectId"])
    retry_ms = error.extra.get("retryAfterMs")
    if isinstance(retry_ms, int):
        headers["Retry-After"] = str(max(1, min(-(-retry_ms // 1000), 60)))
    return problem_response(error, headers=headers)


def _subject(call: _Call, fields: dict[str, Any]) -> Subject:
    return Subject(call.downstream.name, fields, call.shadow, call.adapter.kind)


def _call_fields(call: _Call) -> dict[str, Any]:
    """``call_fields`` of a leased call, ``keyed_call_fields`` of a lease-less one."""
    if call.fence is not None:
        return call_fields(call.fence, call.downstream.name, call.method)
    effect_id = None
    if call.key is not None:
        effect_id = keyed_effect_id(call.key.principal, call.downstream.name, call.key.key)
    return keyed_call_fields(call.principal, call.downstream.name, call.method, effect_id)


async def proxy_answer_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``app.on_response_prepare`` hook: an answer under ``/proxy/`` that the proxy did not
    make (a middleware's refusal before the handler ran: 413 for a body over
    ``server.max_body_bytes``, 408, 421, 403, 505; an error outside the handler) still says
    ``Fence-Effect-State: NONE`` and ``Fence-Replayed: false``: nothing was prepared. A call
    that waited for an in-flight effect (``/mcp`` too) says so: ``effect_waiters``."""
    effect_waiters.applied_header(request, response)
    if request.path.startswith("/proxy/") and "Fence-Effect-State" not in response.headers:
        response.headers["Fence-Effect-State"] = "NONE"
        response.headers.setdefault("Fence-Replayed", "false")


@dataclass(slots=True)
class _Progress:
    """How far a call got, for an answer the gateway did not plan (a 500): once a prepare
    was sent, the effect's state is not known here.

    And how long its steps took, for the ``Server-Timing`` answer header
    (https://www.w3.org/TR/server-timing/): seconds of ``time.perf_counter``, ``None`` for a
    step that did not run. ``fence``: the fence check of a safe method; ``prepare``: the
    prepare round trip(s); ``reconcile``: an inline probe of an UNKNOWN effect; ``forward``:
    from sending the call until its answer (up to ``replay_max_bytes``) was read, or the
    forward failed; ``complete``: recording the outcome; ``abort``: aborting a forward that
    could not start in time; ``total``: from the handler's start until the header is
    written."""

    state: str = "NONE"
    effect_id: str | None = None
    started: float = 0.0
    fence: float | None = None
    prepare: float | None = None
    reconcile: float | None = None
    forward: float | None = None
    complete: float | None = None
    abort: float | None = None

    def server_timing(self) -> str:
        """The header's value: the steps that ran, in the order they run, then ``total``;
        milliseconds with one decimal."""
        parts = [
            f"{name};dur={seconds * 1000:.1f}"
            for name in _TIMED_STEPS
            if (seconds := getattr(self, name)) is not None
        ]
        parts.append(f"total;dur={(time.perf_counter() - self.started) * 1000:.1f}")
        return ", ".join(parts)


#: The ``_Progress`` fields ``Server-Timing`` names, in the order the steps run.
_TIMED_STEPS = ("fence", "prepare", "reconcile", "forward", "complete", "abort")


async def proxy_handler(request: web.Request) -> web.StreamResponse:
    """Every answer of the proxy, refusals included, carries the Fence-* answer headers:
    also aiohttp's own refusals (405, a body over ``server.max_body_bytes``: 413) and an
    unexpected failure (500, ``Fence-Effect-State: UNKNOWN`` once a prepare was sent).

    Every answer it makes carries ``Server-Timing`` (``_Progress``), the gateway's only: a
    downstream's own is not passed on (``_forward``). A streamed answer gets it before its
    headers leave (``_stream``): its ``total`` ends there."""
    progress = _Progress(started=time.perf_counter())
    response = await _answer(request, progress)
    if not response.prepared:
        response.headers["Server-Timing"] = progress.server_timing()
    return response


async def _answer(request: web.Request, progress: _Progress) -> web.StreamResponse:
    try:
        return await _handle(request, progress)
    except FencegateError as exc:
        if exc.about_request:  # a refusal of the request itself names it (a 403, a 413...)
            exc.about(requested(request))
        return _refusal(exc)
    except web.HTTPRequestEntityTooLarge as exc:
        return _refusal(
            PayloadTooLarge(f"{requested(request)}: body over server.max_body_bytes: {exc.text}")
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = "METHOD_NOT_ALLOWED" if exc.status == 405 else "BAD_REQUEST"
        body = problem_body(exc.status, code, exc.reason, http_detail(request, exc))
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        headers.update(_fence_headers(None, None, False))
        return web.Response(status=exc.status, body=json.dumps(body).encode(),
                            content_type="application/problem+json", headers=headers)  # fmt: skip
    except Exception:
        log.exception("http.internal_error", method=request.method, path=request.path,
                      effect_state=progress.state, effect_id=progress.effect_id)  # fmt: skip
        headers = {"Fence-Effect-State": progress.state, "Fence-Replayed": "false"}
        if progress.effect_id is not None:
            headers["Fence-Effect-Id"] = progress.effect_id
        body = problem_body(500, "INTERNAL", "Internal error",
                            f"{requested(request)} failed: see the gateway's log",
                            effectState=progress.state)  # fmt: skip
        return web.Response(status=500, body=json.dumps(body).encode(),
                            content_type="application/problem+json", headers=headers)  # fmt: skip


async def _handle(request: web.Request, progress: _Progress) -> web.StreamResponse:
    """Ask the store, let ``proxy_decisions`` decide, carry the decision out."""
    call = await _parse(request, progress)
    store = request.app[STORE]
    fields = _call_fields(call)
    if call.method in SAFE_METHODS:
        # Never recorded: under a lease, fence-checked; a lease-less client's has no fence
        # (with or without a key: nothing of a safe method is an effect to replay).
        refusal = None
        if call.fence is not None:
            began = time.perf_counter()
            try:
                await store.check_fence(call.fence)
            except FencegateError as exc:
                refusal = exc
            finally:
                progress.fence = time.perf_counter() - began
        return await _carry_out(request, call, decide_safe(_subject(call, fields), refusal))

    effect_request, resend_window_ms = _effect_request(request, call)
    if call.fence is not None:  # a keyed effect has no node or slot
        fields.update(node=call.node, slot=call.slot)
    fields.update(payload_digest=effect_request.payload_digest)
    proxy_config = request.app[CONFIG].proxy
    deadline_ms = call.downstream.timeout_ms + proxy_config.prepared_margin_ms
    #: The gateway's clock just before the prepare that opened the forward was sent: the
    #: store applied it later, so every bound measured from here is conservative.
    sent_at = 0.0
    clock = request.app[FORWARD_CLOCK]

    async def prepare() -> PrepareOutcome:
        nonlocal sent_at
        progress.state = EffectState.UNKNOWN.value  # from here on a 500 cannot say more
        sent_at = clock()
        began = time.perf_counter()
        try:
            # A lost answer (StoreUnavailable) is cleaned up by its forward id (forward.py).
            return await prepare_effect(
                request.app,
                effect_request,
                deadline_ms,
                resend_window_ms=resend_window_ms,
                require_approval=call.adapter.require_approval,
            )
        finally:
            progress.prepare = (progress.prepare or 0.0) + time.perf_counter() - began

    prepared: PrepareOutcome | FencegateError
    try:
        wait = None if call.shadow else effect_waiters.prefer_wait(request)
        prepared = outcome = await effect_waiters.wait_out(request, wait, await prepare(), prepare)
        if (
            outcome.error is not None
            and outcome.error.code == "EFFECT_UNKNOWN"
            and isinstance(call.adapter, ProbeAdapter)
        ):
            # The downstream can tell: ask it (when a probe is due), then decide again on
            # what it said; still unknown: say when the next probe is due.
            began = time.perf_counter()
            try:
                effect = await reconcile(
                    request.app, outcome.effect.effect_id, "gateway:inline", only_if_due=True
                )
            finally:
                progress.reconcile = time.perf_counter() - began
            if effect.state is not EffectState.UNKNOWN:
                prepared = await prepare()
            elif outcome.error is not None and effect.next_probe_at is not None:
                wait_ms = effect.next_probe_at - await store.now_ms()
                outcome.error.extra["retryAfterMs"] = max(wait_ms, 0)
    except FencegateError as exc:
        prepared = exc
    if isinstance(prepared, PrepareOutcome):
        progress.effect_id = prepared.effect.effect_id
    window = forward_window(request, sent_at, deadline_ms)
    decision = decide_effect(_subject(call, fields), prepared)
    return await _carry_out(request, call, decision, _Prepared(effect_request, window))


def _outgoing(request: web.Request, call: _Call) -> Outgoing:
    return Outgoing(
        call.method,
        call.downstream.name,
        call.tail or "/",
        tuple(request.headers.items()),
        call.body,
        call.slot,
    )


def _effect_request(request: web.Request, call: _Call) -> tuple[EffectRequest, int | None]:
    """What the prepare asks for (the adapter says what the effect is: ``effect_of``), and
    how long after its first forward an UNKNOWN effect may be re-sent."""
    shape = call.adapter.effect_of(_outgoing(request, call))
    effect_request = EffectRequest(
        fence=call.fence,
        client_key=call.key,
        node=call.node,
        slot=shape.slot,
        downstream=call.downstream.name,
        method=shape.method,
        path=shape.path,
        payload_digest=shape.payload_digest,
        forward_id=new_id(),
        approval_digest=shape.approval_digest,
        request_json=_kept(request, call),
    )
    return effect_request, resend_window(
        call.adapter.resend_window_ms(shape.preconditions),
        request.app[CONFIG].proxy.start_limit_ms,
    )


def _kept(request: web.Request, call: _Call) -> str | None:
    """The request as ``_forward_effect`` will send it (``_forward_headers``: the identity
    but the effectId, which the prepare decides), for the record (``forward.kept_request``);
    None, with no work done, unless the downstream keeps request bodies."""
    if not call.downstream.keep_request_bodies:
        return None
    headers = _forward_headers(request, call, call.adapter.outbound_headers(None, _token(call)))
    return kept_request(call.downstream, headers.items(), call.body, _credential_values(call))


@dataclass(frozen=True, slots=True)
class _Prepared:
    """What a recorded forward needs besides its decision: the request that prepared it and
    the window it must run in."""

    effect_request: EffectRequest
    window: ForwardWindow


async def _carry_out(
    request: web.Request, call: _Call, decision: Decision, prepared: _Prepared | None = None
) -> web.StreamResponse:
    """The decision's log lines and metrics, then its answer or its forward."""
    account(request, decision)
    match decision.act:
        case Refuse(error):
            return _refusal(error)
        case Replay(effect):
            return _replay(call.adapter.replay(effect, _outgoing(request, call)), effect)
        case PassThrough():
            return await _forward_plain(request, call, call.adapter.outbound_headers(None, None))
        case ShadowForward(code, effect_id):
            identity = call.adapter.outbound_headers(effect_id, _token(call))
            return await _forward_plain(request, call, identity, {"Fence-Shadow-Rejected": code})
        case Forward() as forward:
            assert prepared is not None
            await failpoints.hit("after_prepare")
            if prepared.window.start_left_ms() <= 0:
                return await _too_late(request, forward, prepared, call.progress)
            return await _forward_effect(request, call, forward, prepared.window)


def account(request: web.Request, decision: Decision) -> None:
    """A decision's log lines and metrics (``/proxy`` and ``/mcp`` alike)."""
    # What was decided, about which call, on the request's span.
    tracing.noted_decision(decision.act, decision.logs[0].fields if decision.logs else {})
    metrics = request.app[METRICS]
    counters = {"effects": metrics.effects, "shadow_rejections": metrics.shadow_rejections}
    for metric in decision.metrics:
        if isinstance(metric, Validation):
            metrics.decision(metric.point, metric.code, validated=metric.validated)
        else:
            counters[metric.counter].labels(*metric.labels).inc()
    for record in decision.logs:
        emit = log.warning if record.level == "warning" else log.info
        emit(record.event, **record.fields)


async def _too_late(
    request: web.Request, forward: Forward, prepared: _Prepared, progress: _Progress
) -> web.StreamResponse:
    error = await start_too_late(
        request, forward, prepared.effect_request, prepared.window, progress
    )
    return _refusal(error)


async def start_too_late(
    request: web.Request,
    forward: Forward,
    effect_request: EffectRequest,
    window: ForwardWindow,
    progress: _Progress | None = None,
) -> FencegateError:
    """The prepare was answered (or the gateway stalled) past the start limit: a bump or a
    cancel may have been acknowledged meanwhile, so nothing is sent. The forward is aborted
    by its id (certainly not sent), now or, when the store does not answer, in the
    background; the refusal to answer is returned."""
    effect, fields = forward.effect, forward.fields
    deadline_ms = window.deadline_ms
    elapsed = round(window.elapsed_ms())
    log.warning("effect.start_too_late", elapsed_ms=elapsed,
                limit_ms=window.start_limit_ms, **fields)  # fmt: skip
    assert effect_request.forward_id is not None
    forward_id = effect_request.forward_id
    state = EffectState.NOT_APPLIED
    began = time.perf_counter()
    try:
        aborted = await request.app[STORE].update_effect(
            effect.effect_id,
            lambda record, now: effects.abort(record, forward_id, now, effects.LATE_REASON),
        )
        state = aborted.state
        effect_waiters.settled(request.app, effect.effect_id, state)
        log.info("effect.aborted", state=state.value, **fields)
    except StoreUnavailable:
        abort_later(request.app, effect_request, deadline_ms)
        state = EffectState.PREPARED
    except FencegateError as exc:  # settled meanwhile (an operator): nothing to abort
        log.info("effect.abort_skipped", code=exc.code, reason=exc.detail, **fields)
    if progress is not None:
        progress.abort = time.perf_counter() - began
    error = StoreUnavailable(
        f"the forward could not start within proxy.forward_start_limit_ms "
        f"({window.start_limit_ms} ms; {elapsed} ms had passed since the prepare was sent); "
        "nothing was forwarded, retry the call"
    )
    return _with_effect(error, effect, state)


def _target(call: _Call) -> URL:
    return URL(call.downstream.url + (call.tail or "/"), encoded=True)


async def _stream(
    request: web.Request,
    resp: aiohttp.ClientResponse,
    headers: CIMultiDict[str],
    first: bytes,
    progress: _Progress,
) -> web.StreamResponse:
    """Pass a body too large to buffer through to the agent as it arrives (its
    ``Server-Timing`` says how long the gateway took until the streaming began)."""
    headers["Server-Timing"] = progress.server_timing()
    answer = web.StreamResponse(status=resp.status, headers=headers)
    await answer.prepare(request)
    await answer.write(first)
    async for chunk in resp.content.iter_any():
        await answer.write(chunk)
    await answer.write_eof()
    return answer


def _credential_values(call: _Call) -> list[str]:
    """The values of the credentials the gateway adds for this downstream."""
    return list(call.adapter.outbound_headers(None, None).values())


def _token(call: _Call) -> str | None:
    """The fencing token a leased call's forward carries; a keyed call has none to send."""
    if call.fence is None:
        return None
    return f"{call.fence.scheduler_epoch}.{call.fence.claim_generation}"


#: Called once the downstream's answer is read (up to ``replay_max_bytes``): the response,
#: that much of its body, whether that was all of it, and the headers the agent will get
#: (already filtered: ``upstream_response_headers`` less the credential values); returns the
#: Fence-* headers to add to the live answer.
_OnAnswer = Callable[
    [aiohttp.ClientResponse, bytes, bool, CIMultiDict[str]], Awaitable[Mapping[str, str]]
]


async def _forward(
    request: web.Request,
    call: _Call,
    identity: dict[str, str],
    data: bytes | None,
    limits: Limits,
    on_answer: _OnAnswer,
    outcome_of: Callable[[int], EffectState],
    effect_id: str | None = None,
) -> web.StreamResponse:
    """Send the call (``forward.send``: once, nothing below the ledger re-sends), read its
    answer up to ``replay_max_bytes``, let ``on_answer`` act on it, and pass it to the agent,
    streaming a larger body. A client failure raises ``ForwardFailed`` (its ``failure`` from
    the one table, ``forward.failure_of``).

    Every forward is observed in ``fencegate_forward_seconds``, answered or not: with
    ``outcome_of(status)`` (what the answer means for an effect), or how it failed."""
    headers = _forward_headers(request, call, identity)
    started = time.monotonic()
    began = time.perf_counter()
    observed = False
    progress = call.progress
    name = call.downstream.name
    try:
        async with send(
            request.app,
            name,
            call.method,
            _target(call),
            limits,
            headers=headers,
            data=data,
            effect_id=effect_id,
        ) as resp:
            body, whole = await read_up_to(resp.content, call.downstream.replay_max_bytes)
            progress.forward = time.perf_counter() - began
            seconds = time.monotonic() - started
            outcome = outcome_of(resp.status).value.lower()
            request.app[METRICS].forward_seconds.labels(name, outcome, call.kind).observe(seconds)
            observed = True
            live = without_secret_values(
                upstream_response_headers(resp.headers.items()), _credential_values(call)
            )
            # The downstream's own Server-Timing is not passed on, nor stored: the answer's
            # is the gateway's (its forward step holds the downstream's time).
            live.popall("Server-Timing", None)
            fence = await on_answer(resp, body, whole, live)
            live.update(fence)
            if not whole:
                return await _stream(request, resp, live, body, progress)
            return web.Response(status=resp.status, body=body, headers=live)
    except ForwardFailed as failed:
        if progress.forward is None:  # not a body that broke off while streaming
            progress.forward = time.perf_counter() - began
        if not observed:  # a body that broke off while streaming was observed already
            request.app[METRICS].forward_seconds.labels(
                name, failed.failure.metric, call.kind
            ).observe(time.monotonic() - started)
        raise


def _forward_headers(
    request: web.Request, call: _Call, identity: dict[str, str]
) -> CIMultiDict[str]:
    """The headers a forward of ``call`` sends, with the adapter's ``identity``. A lease-less
    client's own ``Idempotency-Key`` never goes on as it was sent: the downstream's key is
    the effectId (in the adapter's header), whatever that header's name. An ``Authorization``
    the auth middleware found to be a gateway credential never goes on either."""
    reserved = [call.downstream.idempotency_key_header, call.downstream.fencing_token_header]
    if call.fence is None:
        reserved.append(CLIENT_KEY_HEADER)
    gateway_token = bool(request.get(STRIP_AUTHORIZATION, False))
    return downstream_request_headers(
        request.headers.items(),
        identity,
        forward_authorization=call.downstream.forward_authorization and not gateway_token,
        reserved=reserved,
        peer=request.remote,
    )


def _where(request: web.Request, call: _Call) -> Target:
    """The call as the agent's error names it (``forward.failure_answer``): the downstream's
    name, the agent's method and path without the query, never the downstream's address."""
    return Target(
        call.downstream.name,
        call.method,
        request.rel_url.raw_path,
        request.app[CONFIG].proxy.max_connections,
    )


def _plain_outcome(adapter: Adapter, status: int) -> EffectState:
    """What an answer to an unrecorded forward (a safe method, shadow mode) would have meant
    for an effect: the adapter's configured outcome for the status, else the defaults every
    kind shares (adapters/http.py). No earlier attempt exists, so no kind's history rule
    applies."""
    if isinstance(adapter, HttpAdapter) and status in adapter.overrides:
        return adapter.overrides[status]
    if status in UNKNOWN_STATUSES:
        return EffectState.UNKNOWN
    if status in NOT_APPLIED_STATUSES:
        return EffectState.NOT_APPLIED
    return EffectState.COMMITTED


async def _forward_plain(
    request: web.Request,
    call: _Call,
    identity: dict[str, str],
    answer_headers: Mapping[str, str] | None = None,
) -> web.StreamResponse:
    """Forward without a ledger entry (safe methods, shadow mode); the answer passes through."""

    async def unrecorded(
        resp: aiohttp.ClientResponse, body: bytes, whole: bool, live: CIMultiDict[str]
    ) -> Mapping[str, str]:
        return {**_fence_headers(None, None, False), **(answer_headers or {})}

    limits = downstream_limits(call.downstream)
    try:
        return await _forward(request, call, identity, call.body or None, limits, unrecorded,
                              lambda status: _plain_outcome(call.adapter, status))  # fmt: skip
    except ForwardFailed as failed:
        raise failure_answer(_where(request, call), failed.failure) from failed.cause


async def _forward_effect(
    request: web.Request, call: _Call, forward: Forward, window: ForwardWindow
) -> web.StreamResponse:
    """Forward a prepared attempt inside its window and record its outcome (step two)."""
    effect, seq, fields = forward.effect, forward.seq, forward.fields
    replay_max = call.downstream.replay_max_bytes

    async def record(
        resp: aiohttp.ClientResponse, body: bytes, whole: bool, live: CIMultiDict[str]
    ) -> Mapping[str, str]:
        await failpoints.hit("after_response")
        outcome, reason = call.adapter.outcome(resp.status, body if whole else None, effect)
        kept: bytes | None = None
        omitted: str | None = None
        if not call.downstream.store_response_body:
            omitted = OMITTED_BY_CONFIG
        elif whole and len(body) <= replay_max:
            kept = body
        else:
            omitted = OMITTED_TOO_LARGE
        # The live headers (before the Fence-* ones are added) less what no record keeps.
        headers = stored_response_headers(live.items(), call.downstream.unstored_headers, live=True)
        answer = response_json(resp.status, headers, kept, omitted_reason=omitted)
        recorded = await _record(request, call, effect, seq, outcome, reason, answer, fields)
        return _fence_headers(recorded, None, False)

    identity = call.adapter.outbound_headers(effect.effect_id, _token(call))
    try:
        return await _forward(
            request,
            call,
            identity,
            call.body,
            window.limits(call.downstream),
            record,
            lambda status: call.adapter.classify(status, effect)[0],
            effect.effect_id,
        )
    except ForwardFailed as failed:
        failure = failed.failure
        recorded = await _record(
            request, call, effect, seq, failure.outcome, failure.reason, None, fields
        )
        raise failure_answer(
            _where(request, call), failure, effect=effect, recorded=recorded.state
        ) from failed.cause


#: Marks the replay of a keyed effect (IETF httpapi-idempotency-key-header, as Stripe's).
IDEMPOTENT_REPLAYED = "Idempotent-Replayed"


def _replay(answer: Answer, effect: Effect) -> web.Response:
    """A duplicate's answer (``Adapter.replay``), with the Fence-* headers, and for a keyed
    effect ``Idempotent-Replayed: true`` (the client sent an ``Idempotency-Key``, and this
    is what that header's clients look for). An effect settled COMMITTED by an operator who
    knew no response is 204 ``Fence-Replay-Body: none``: invent nothing; one whose body was
    not stored keeps its status and headers, ``Fence-Replay-Body: omitted``."""
    headers: CIMultiDict[str] = CIMultiDict()
    for name, value in answer.headers:
        headers.add(name, value)
    headers.update(_fence_headers(effect, None, True))
    if effect.kind == "keyed":
        headers[IDEMPOTENT_REPLAYED] = "true"  # one value, whatever the stored answer said
    if effect.response_json is None:
        headers["Fence-Replay-Body"] = "none"
        return web.Response(status=204, headers=headers)
    if answer.body is None:
        headers["Fence-Replay-Body"] = "omitted"
        headers.pop("Content-Encoding", None)
    return web.Response(status=answer.status, body=answer.body or b"", headers=headers)


def _with_effect(error: FencegateError, effect: Effect, state: EffectState) -> FencegateError:
    error.about_effect(effect.effect_id)
    error.extra.update(effectId=effect.effect_id, effectState=state.value)
    return error


async def _record(
    request: web.Request,
    call: _Call,
    effect: Effect,
    seq: int,
    outcome: EffectState,
    reason: str,
    response_json: str | None,
    fields: Mapping[str, Any],
) -> Effect:
    """Step two (``record_outcome``), timed for the call's ``Server-Timing``."""
    began = time.perf_counter()
    try:
        return await record_outcome(request, call.fence, call.downstream.name, effect, seq,
                                    outcome, reason, response_json, fields)  # fmt: skip
    finally:
        call.progress.complete = time.perf_counter() - began


async def record_outcome(
    request: web.Request,
    fence: Fence | None,
    downstream: str,
    effect: Effect,
    seq: int,
    outcome: EffectState,
    reason: str,
    response_json: str | None,
    fields: Mapping[str, Any],
) -> Effect:
    """Step two. A store failure here leaves the record PREPARED, which reads UNKNOWN once its
    deadline passes: never lost, never replayed as if it had not happened. ``fence`` None:
    a keyed effect's forward (no task; its attempt is named by its forward id, which the
    prepared record's attempt ``seq`` holds)."""
    if fence is not None:
        task_id: str | None = fence.task_id
        attempt_id = fence.attempt_id
    else:
        task_id, attempt_id = None, effect.attempts[seq].attempt_id
    try:
        recorded, applied = await request.app[STORE].complete_effect(
            task_id, effect.effect_id, seq, attempt_id, outcome, reason, response_json
        )
        effect_waiters.settled(request.app, effect.effect_id, recorded.state)
    except StoreUnavailable as exc:
        log.error("effect.unrecorded", outcome=outcome.value, reason=exc.detail, **fields)
        raise _with_effect(
            StoreUnavailable(
                f"the forward ended ({reason}) but its outcome could not be recorded; "
                "the effect will read UNKNOWN until reconciled"
            ),
            effect,
            EffectState.UNKNOWN,
        ) from exc
    if not applied:
        log.warning("effect.stale_completion", outcome=outcome.value, state=recorded.state.value,
                    reason=reason, **fields)  # fmt: skip
        return recorded
    request.app[METRICS].effects.labels(downstream, outcome.value, effect.kind).inc()
    tracing.note(**{"fencegate.outcome": outcome.value.lower()})
    event = {
        EffectState.COMMITTED: "effect.committed",
        EffectState.NOT_APPLIED: "effect.not_applied",
        EffectState.UNKNOWN: "effect.unknown",
    }[outcome]
    log.info(event, reason=reason, **fields)
    return recorded
