"""The ledger API: operators read the idempotency ledger and settle UNKNOWN effects.

``GET /v1/effects`` (filters and cursor; or ``?idempotencyKey=K&principal=P``: a keyed effect
by its client's key, the one form a ``client`` may use, for its own keys only),
``GET /v1/effects/{effectId}`` and ``POST /v1/effects/{effectId}/resolve``. The operator
recorded on the effect (with the time and the note) is the authenticated principal's name
when ``[auth]`` is on; without it, the free-text ``Fence-Operator`` header. An operator may
not approve an effect requested under their own principal (``ledger.effects.approve``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import structlog
from aiohttp import web
from pydantic import Field, StrictBool, StrictInt, StrictStr

from fencegate.gateway import answers
from fencegate.gateway.answers import reply
from fencegate.gateway.api_models import TASK_ID_PATTERN, ApiBody, parse_body
from fencegate.gateway.auth import sees_stored_bodies
from fencegate.gateway.forward import look_up
from fencegate.gateway.principals import Principal, acting_operator, caller_name, principal_of
from fencegate.gateway.reconcile import reconcile
from fencegate.gateway.state import ADAPTERS, CONFIG, STORE
from fencegate.ledger import effects, responses
from fencegate.ledger.effects import DEFAULT_SETTLE_MS, Effect, EffectState
from fencegate.ledger.errors import BadRequest, Forbidden, NoSuchEffect
from fencegate.ledger.queries import EFFECT_ID_OR_PREFIX, EFFECT_ID_RULE
from fencegate.ledger.store import Store

__all__ = [
    "ApproveBody",
    "ResolveBody",
    "approve_as",
    "check_effect_id",
    "find_effect",
    "preview_resolve",
    "reconcile_as",
    "resolve_as",
    "routes",
    "settle_ms_of",
    "shown",
    "shown_record",
]

log = structlog.get_logger("fencegate.ledger")
routes = web.RouteTableDef()

_EFFECT_ID = re.compile(r"[0-9a-f]{64}")
#: Most effect ids an ambiguous prefix's refusal names (``find_effect``).
MAX_MATCHES_SHOWN = 10
MAX_PAGE = 500
#: ``str.isdigit`` also takes "²" and other digits ``int`` refuses: ASCII only.
_ASCII_DIGITS = re.compile(r"[0-9]{1,6}")
#: The roles that read the whole ledger (the role matrix's readers of ``/v1/effects``).
_LEDGER_READERS = frozenset({"operator", "observer"})


#: What a replay can send: an HTTP token, and a value with no line break or NUL (aiohttp
#: refuses to write either, so a stored one would turn every retry into a 500).
HeaderName = Annotated[str, Field(pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,200}$")]
HeaderValue = Annotated[str, Field(max_length=8192, pattern=r"^[^\r\n\x00]*$")]


class ResolveResponse(ApiBody):
    status: Annotated[StrictInt, Field(ge=100, le=599)]
    headers: dict[HeaderName, HeaderValue] = Field(default_factory=dict, max_length=100)
    body: Annotated[StrictStr, Field(max_length=1024 * 1024)] = ""


class ApproveBody(ApiBody):
    #: Guards against approving a request that changed since the operator looked: its
    #: approval digest (the payload and the effect-changing headers) ...
    approvalDigest: Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
    #: ... or its payload digest, alone only when no effect-changing header was sent.
    payloadDigest: Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
    note: Annotated[StrictStr, Field(max_length=2000)] = ""


class ResolveBody(ApiBody):
    outcome: Literal["COMMITTED", "NOT_APPLIED"]
    note: Annotated[StrictStr, Field(min_length=1, max_length=2000)]
    response: ResolveResponse | None = None
    #: NOT_APPLIED although an earlier forward may still land (before ``landingUntil``);
    #: recorded on the action.
    force: StrictBool = False


def shown(principal: Principal | None, effect: Effect, app: web.Application) -> answers.Effect:
    """The record as this reader may see it: observers get the stored answer and the kept
    request without their bodies (``bodyWithheld: true``); operators, and everyone without
    ``[auth]``, all of it. The JSON API and the console both show records through this, so
    they withhold alike. From the downstream's config (``app``): the idempotency key in the
    kept request's headers and, when UNKNOWN, what to look up (``lookUp``)."""
    downstream = app[CONFIG].downstream(effect.downstream)
    key_header = downstream.idempotency_key_header if downstream is not None else None
    look = look_up(downstream, effect)
    return answers.Effect.of(
        effect,
        withhold_body=not sees_stored_bodies(principal),
        key_header=key_header,
        look_up=look,
    )


def shown_record(
    principal: Principal | None, effect: Effect, app: web.Application
) -> dict[str, Any]:
    """``shown`` as JSON-ready data (what the console renders)."""
    return shown(principal, effect, app).wire()


def _shown(request: web.Request, effect: Effect) -> answers.Effect:
    return shown(principal_of(request), effect, request.app)


def check_effect_id(effect_id: str) -> str:
    """``effect_id`` if it is one (64 lowercase hex), else ``NoSuchEffect``."""
    if not _EFFECT_ID.fullmatch(effect_id):
        raise NoSuchEffect(f"no effect {effect_id[:80]!r}: an effectId is 64 lowercase hex")
    return effect_id


def _effect_id(request: web.Request) -> str:
    return check_effect_id(request.match_info["effect_id"])


async def find_effect(store: Store, text: str) -> Effect:
    """The record ``text`` names: a full effectId, or a prefix of at least
    ``MIN_EFFECT_PREFIX`` lowercase hex characters that starts exactly one live effect id
    (the store's own index: ``Store.find_effects``). ``GET /v1/effects/{effectId}`` and the
    console's effect page both look up through this, with the same role check and no
    ``task_prefixes`` scope (as for a full id: the ledger is not scoped, docs/security.md).

    Anything else is ``404 NO_SUCH_EFFECT`` naming the rule (as before prefixes); an
    ambiguous prefix is ``400`` naming up to ``MAX_MATCHES_SHOWN`` of the ids
    (``matches``); no match is ``404 NO_SUCH_EFFECT`` (an expired effect is found by its
    full id only: ``410 EFFECT_EXPIRED``)."""
    if _EFFECT_ID.fullmatch(text):
        return await store.get_effect(text)
    if not EFFECT_ID_OR_PREFIX.fullmatch(text):
        # 404 as before prefixes were accepted (a client may rely on it), naming the rule.
        raise NoSuchEffect(f"no effect {text[:80]!r}: {EFFECT_ID_RULE}")
    found = await store.find_effects(text, MAX_MATCHES_SHOWN + 1)
    if not found:
        raise NoSuchEffect(f"no effect id starts with {text!r}")
    if len(found) > 1:
        named = found[:MAX_MATCHES_SHOWN]
        count = f"more than {MAX_MATCHES_SHOWN}" if len(found) > len(named) else str(len(found))
        raise BadRequest(
            f"effect id prefix {text!r} is ambiguous: {count} effect ids start with it "
            f"({', '.join(named)}{', ...' if len(found) > len(named) else ''}); give more "
            "characters",
            matches=named,
        )
    return await store.get_effect(found[0])


#: A principal name as a query names it (``[[auth.principals]] name``, or ``anonymous``).
_PRINCIPAL = re.compile(r"[^\x00-\x1f\x7f]{1,200}")
#: A downstream name (``downstreams.name``): a removed downstream's effects are found too.
_DOWNSTREAM = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: A decoded idempotency key (``proxy.parse_client_key``): printable ASCII.
_CLIENT_KEY = re.compile(r"[\x20-\x7e]{1,255}")
_LOOKUP_PARAMS = frozenset({"idempotencyKey", "principal", "downstream"})


async def _keyed_lookup(request: web.Request) -> web.Response:
    """``GET /v1/effects?idempotencyKey=K[&principal=P][&downstream=D]``: the keyed effects
    of P's key K (P: the caller's own principal when not given), one per downstream that has
    one, from their ids (``effects.keyed_effect_id`` for each configured downstream, or for
    D): no scan. The ledger's readers may look up anyone's; a ``client`` only its own (403
    otherwise, naming no effect). An expired one is not listed (its id still answers 410)."""
    query = request.query
    others = sorted(set(query) - _LOOKUP_PARAMS)
    if others:
        raise BadRequest(
            f"idempotencyKey takes only principal and downstream, not {', '.join(others)}"
        )
    key = query["idempotencyKey"]
    if not _CLIENT_KEY.fullmatch(key):
        raise BadRequest("idempotencyKey: 1 to 255 printable ASCII characters")
    caller = principal_of(request)
    owner = query.get("principal", caller_name(caller))
    if not _PRINCIPAL.fullmatch(owner):
        raise BadRequest("principal: 1 to 200 characters, no control character")
    if _client_only(caller) and caller is not None and owner != caller.name:
        raise Forbidden(
            f"{caller.name!r} may look up only its own keyed effects (principal={caller.name})"
        )
    named = query.get("downstream")
    if named is not None and not _DOWNSTREAM.fullmatch(named):
        raise BadRequest("downstream: not a downstream name")
    names = [named] if named is not None else [d.name for d in request.app[CONFIG].downstreams]
    store = request.app[STORE]
    found: list[Effect] = []
    for name in names:
        try:
            found.append(await store.get_keyed_effect(effects.keyed_effect_id(owner, name, key)))
        except NoSuchEffect:  # none, or expired (EffectExpired)
            continue
    page = answers.EffectPage.model_construct(
        effects=[_shown(request, e) for e in found], nextCursor=None
    )
    return reply(page)


def _client_only(principal: Principal | None) -> bool:
    """A caller whose only way into the ledger is the look-up of its own keyed effects."""
    return principal is not None and not principal.roles & _LEDGER_READERS


@routes.get("/v1/effects")
async def list_effects(request: web.Request) -> web.Response:
    query = request.query
    if "idempotencyKey" in query:
        return await _keyed_lookup(request)
    if _client_only(principal_of(request)):
        raise Forbidden(
            "a client reads only its own keyed effects: GET /v1/effects?idempotencyKey=..."
        )
    unknown = set(query) - {"state", "taskId", "downstream", "limit", "cursor", "awaitingApproval"}
    if unknown:
        raise BadRequest(f"unknown query parameter(s): {', '.join(sorted(unknown))}")
    awaiting = query.get("awaitingApproval")
    if awaiting not in (None, "true", "false"):
        raise BadRequest("awaitingApproval: true or false")
    state = query.get("state")
    if state is not None and state not in EffectState.__members__:
        raise BadRequest(f"state: one of {', '.join(EffectState.__members__)}")
    task_id = query.get("taskId")
    if task_id is not None and not TASK_ID_PATTERN.fullmatch(task_id):
        raise BadRequest("taskId: not a task id")
    raw_limit = query.get("limit", "100")
    if not _ASCII_DIGITS.fullmatch(raw_limit) or not 1 <= int(raw_limit) <= MAX_PAGE:
        raise BadRequest(f"limit: an integer from 1 to {MAX_PAGE}")
    cursor = query.get("cursor") or None
    if cursor is not None and len(cursor) > 200:
        raise BadRequest("cursor: not a cursor this gateway issued")
    if awaiting == "true":
        # From the store's own index, oldest first, one page: what waits for a person.
        others = sorted({"state", "taskId", "downstream", "cursor"} & set(query))
        if others:
            raise BadRequest(f"awaitingApproval=true takes only limit, not {', '.join(others)}")
        waiting = await request.app[STORE].awaiting_approval(int(raw_limit))
        page = answers.EffectPage.model_construct(
            effects=[_shown(request, e) for e in waiting], nextCursor=None
        )
        return reply(page)
    found, next_cursor = await request.app[STORE].list_effects(
        state=EffectState(state) if state else None,
        task_id=task_id,
        downstream=query.get("downstream"),
        limit=int(raw_limit),
        cursor=cursor,
    )
    page = answers.EffectPage.model_construct(
        effects=[_shown(request, e) for e in found], nextCursor=next_cursor
    )
    return reply(page)


@routes.get("/v1/effects/{effect_id}")
async def show_effect(request: web.Request) -> web.Response:
    """The record, by its full id or a unique prefix (``find_effect``)."""
    effect = await find_effect(request.app[STORE], request.match_info["effect_id"])
    return reply(_shown(request, effect))


@routes.post("/v1/effects/{effect_id}/resolve")
async def resolve_effect(request: web.Request) -> web.Response:
    effect_id = _effect_id(request)
    operator = acting_operator(request)
    body = parse_body(await request.read(), ResolveBody)
    effect, done = await resolve_as(request.app, effect_id, operator, body)
    return reply(
        answers.Resolved.of(effect, unchanged=done.unchanged, warnings=list(done.warnings))
    )


def _response_json(body: ResolveBody) -> str | None:
    """The operator's answer as the ledger stores it (None: none given)."""
    if body.response is None:
        return None
    given = body.response
    return responses.response_json(given.status, given.headers.items(), given.body.encode())


def _decide(
    app: web.Application,
    record: Effect | None,
    operator: str,
    body: ResolveBody,
    response_json: str | None,
    now: int,
) -> effects.Resolution:
    return effects.resolution(
        record,
        EffectState(body.outcome),
        body.note,
        operator,
        response_json,
        now,
        settle_ms=settle_ms_of(app, record),
        force=body.force,
    )


async def preview_resolve(
    app: web.Application, effect_id: str, operator: str, body: ResolveBody
) -> effects.Resolution:
    """What ``resolve_as`` would decide now, without writing it (its refusals included):
    the console's confirmation page says from it what duplicates will be answered, by the
    ledger's own rule rather than a copy of it."""
    store = app[STORE]
    record = await store.get_effect(effect_id)
    return _decide(app, record, operator, body, _response_json(body), await store.now_ms())


async def resolve_as(
    app: web.Application, effect_id: str, operator: str, body: ResolveBody
) -> tuple[Effect, effects.Resolution]:
    """Settle an effect as ``operator``: the one path of the JSON API and the console, so
    both validate, log and record the action trail alike."""
    response_json = _response_json(body)
    decided: list[effects.Resolution] = []

    def settle(record: Effect | None, now: int) -> Effect:
        # The store may run this more than once (compare-and-set); the last run is written.
        decided.append(_decide(app, record, operator, body, response_json, now))
        return decided[-1].effect

    try:
        effect = await app[STORE].update_effect(effect_id, settle)
    except Exception as exc:
        log.info("operator.resolve_rejected", effect_id=effect_id, operator=operator,
                 reason=str(exc))  # fmt: skip
        raise
    done = decided[-1]
    fields = {
        "effect_id": effect_id,
        "task": effect.task_id,
        "operator": operator,
        "outcome": body.outcome,
        "note": body.note,
        "response_digest": effects.response_identity(response_json),
        "empty_replay": done.empty_replay,
        "force": body.force,
    }
    if done.unchanged:
        # A retry of the same resolve (a CLI whose answer was lost): nothing was recorded.
        log.info("operator.resolve_unchanged", **fields)
    else:
        log.warning("operator.resolve", **fields)
    return effect, done


def settle_ms_of(app: web.Application, record: Effect | None) -> int:
    """How long an earlier forward of ``record`` may still land: its downstream's (or tool's)
    ``settle_ms``; the default for a downstream no longer configured (nothing says less)."""
    if record is None:
        return 0
    adapter = app[ADAPTERS].get(record.downstream)
    return adapter.settle_ms_for(record.path) if adapter is not None else DEFAULT_SETTLE_MS


@routes.post("/v1/effects/{effect_id}/reconcile")
async def reconcile_effect(request: web.Request) -> web.Response:
    effect_id = _effect_id(request)
    operator = acting_operator(request)
    raw = await request.read()
    if raw.strip() not in (b"", b"{}"):
        raise BadRequest("reconcile takes no body (or an empty JSON object)")
    effect = await reconcile_as(request.app, effect_id, operator)
    return reply(_shown(request, effect))


async def reconcile_as(app: web.Application, effect_id: str, operator: str) -> Effect:
    """Probe an effect now, on ``operator``'s behalf (the JSON API's and the console's)."""
    return await reconcile(app, effect_id, f"operator:{operator}")


@routes.post("/v1/effects/{effect_id}/approve")
async def approve_effect(request: web.Request) -> web.Response:
    effect_id = _effect_id(request)
    operator = acting_operator(request)
    raw = await request.read()
    body = parse_body(raw, ApproveBody) if raw.strip() else ApproveBody()
    effect = await approve_as(request.app, effect_id, operator, principal_of(request), body)
    return reply(_shown(request, effect))


async def approve_as(
    app: web.Application,
    effect_id: str,
    operator: str,
    principal: Principal | None,
    body: ApproveBody,
) -> Effect:
    """Approve an effect's payload as ``operator`` (``principal``: who may not approve their
    own request): the one path of the JSON API and the console."""
    store = app[STORE]
    current = await store.get_effect(effect_id)
    adapter = app[ADAPTERS].get(current.downstream)
    ttl_ms = adapter.approval_ttl(current.path) if adapter is not None else None
    if ttl_ms is None:
        what = f"downstream {current.downstream!r}"
        if adapter is not None and adapter.kind == "mcp":
            what += f" (tool {current.path.removeprefix('/tools/call/')!r})"
        raise BadRequest(f"{what} does not require approval")
    approver = principal.name if principal is not None else None
    try:
        effect = await store.update_effect(
            effect_id,
            lambda record, now: effects.approve(
                record,
                operator,
                body.note,
                body.payloadDigest,
                ttl_ms,
                now,
                principal=approver,
                expected_approval=body.approvalDigest,
            ),
        )
    except Exception as exc:
        log.info("operator.approve_rejected", effect_id=effect_id, operator=operator,
                 reason=str(exc))  # fmt: skip
        raise
    log.warning(
        "operator.approve",
        effect_id=effect_id,
        task=effect.task_id,
        downstream=effect.downstream,
        payload_digest=effect.payload_digest,
        approval_digest=effect.approval_digest,
        operator=operator,
        expires_at=effect.approval_expires_at,
        note=body.note,
    )
    return effect
