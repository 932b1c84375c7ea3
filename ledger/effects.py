"""The idempotency ledger's transitions as pure functions: the proxy's decisions live here.

One proxied mutation is two atomic store steps, both decided here:

1. ``prepare``: validate the caller's claim (the same comparisons as a commit, plus an
   unexpired lease), then read the effect record for ``effectId = H(task, revision, node,
   slot)`` and decide, following the contract's state table:

   ======================  ===================  ======================
   record found            same payloadDigest   different payloadDigest
   ======================  ===================  ======================
   none                    PREPARE, forward     --
   PREPARED (running)      EFFECT_IN_FLIGHT     PAYLOAD_CONFLICT
   COMMITTED               replay               PAYLOAD_CONFLICT
   UNKNOWN                 adapter: resend or   PAYLOAD_CONFLICT
                           EFFECT_UNKNOWN
   NOT_APPLIED             PREPARE, forward     PREPARE, forward (rebound)
   ======================  ===================  ======================

   A PREPARED record past its deadline cannot still be forwarding (the gateway that held it
   died or stalled), so it reads as UNKNOWN; ``prepare`` writes that conversion down.

2. ``complete``: record the forward's outcome, only if the record is still waiting for *this*
   forward (same attempt, same sequence number). A late completion never clobbers a newer
   record.

The Redis store mirrors this in ``ledger/lua/prepare.lua`` and ``complete.lua``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from fencegate.ledger.clock import iso_utc
from fencegate.ledger.errors import (
    AlreadyCommitted,
    ApprovalRequired,
    BadRequest,
    EffectInFlight,
    EffectSettled,
    EffectUnknown,
    FencegateError,
    Forbidden,
    LeaseExpired,
    NoSuchEffect,
    PayloadConflict,
)
from fencegate.ledger.payloads import server_field_name
from fencegate.ledger.tasks import Scheduler, Task, TaskState, check_holder

__all__ = [
    "APPROVAL_HEADERS",
    "DEFAULT_SETTLE_MS",
    "RESOLVE_OUTCOMES",
    "Action",
    "ClientKey",
    "Effect",
    "EffectAttempt",
    "EffectRequest",
    "EffectState",
    "Fence",
    "PrepareOutcome",
    "ProbeVerdict",
    "Resolution",
    "abort",
    "approval_digest",
    "approve",
    "begin_probe",
    "check_fence",
    "complete",
    "effect_from_fields",
    "effect_id",
    "effect_to_fields",
    "effective",
    "expire",
    "finish_probe",
    "is_awaiting_approval",
    "is_overdue",
    "keyed_effect_id",
    "keyed_settled",
    "landing_until",
    "may_have_executed",
    "payload_digest",
    "prepare",
    "resolution",
    "resolve",
    "response_identity",
    "sent_nothing",
    "wanted_approval",
]

#: Reason recorded on an attempt whose PREPARED record outlived its deadline.
DEADLINE_REASON = "deadline passed"
#: Most operator actions kept on one record.
MAX_ACTIONS = 50
#: How long after the gateway stopped waiting for a forward the downstream may still apply it,
#: unless its config says (``settle_ms``): until then "it did not happen" is not believed.
DEFAULT_SETTLE_MS = 60_000


class EffectState(StrEnum):
    PREPARED = "PREPARED"
    UNKNOWN = "UNKNOWN"
    COMMITTED = "COMMITTED"
    NOT_APPLIED = "NOT_APPLIED"


#: What an operator may settle an effect to (``resolve``): a definite outcome. The one list
#: the resolve rule, the API's body and the CLI's ``--outcome`` take.
RESOLVE_OUTCOMES: tuple[EffectState, ...] = (EffectState.COMMITTED, EffectState.NOT_APPLIED)


class Action(StrEnum):
    FORWARD = "FORWARD"
    REPLAY = "REPLAY"
    REJECT = "REJECT"


def effect_id(task_id: str, revision: int, node: str, slot: str) -> str:
    """Lowercase hex SHA-256 of the compact JSON array ``[taskId, revision, node, slot]``."""
    raw = json.dumps([task_id, revision, node, slot], separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()


def keyed_effect_id(principal: str, downstream: str, key: str) -> str:
    """A keyed effect's id: lowercase hex SHA-256 of the compact JSON array
    ``["key", principal, downstream, key]``. The leading ``"key"`` keeps it apart from every
    leased effect's id (whose array starts with a task id string and has four members of
    other types), and the principal scopes it: two principals' equal keys are two effects."""
    raw = json.dumps(["key", principal, downstream, key], separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()


def payload_digest(
    method: str,
    downstream: str,
    path_with_query: str,
    body: bytes,
    preconditions: Sequence[tuple[str, str]] | None = None,
) -> str:
    """SHA-256 over ``METHOD\ndownstream\npath?query\n`` then the (canonical) body.

    The caller canonicalises JSON bodies (``canonical_body``) so key order and whitespace do
    not make two identical requests look different. Downstreams whose requests carry
    preconditions (``If-Match``...) pass them too: they are part of what the request does,
    so a line ``preconditions [[name, value], ...]`` (names lowercased, sorted) comes before
    the body. Every request to such a downstream has that line, so digests stay unambiguous.
    """
    digest = hashlib.sha256()
    digest.update(f"{method}\n{downstream}\n{path_with_query}\n".encode())
    if preconditions is not None:
        pairs = sorted([name.lower(), value] for name, value in preconditions)
        digest.update(f"preconditions {json.dumps(pairs, separators=(',', ':'))}\n".encode())
    digest.update(body)
    return digest.hexdigest()


#: Request headers that change what a request does beyond its method, path and body, so an
#: approval covers their names and values (``approval_digest``): how the body is to be read
#: (``Content-Type``, ``Content-Encoding``) and the preconditions (RFC 9110 13.1). Trace
#: context (``traceparent``, ``tracestate``, ``baggage``) and everything else is never in it.
APPROVAL_HEADERS = (
    "content-type",
    "content-encoding",
    "if-match",
    "if-none-match",
    "if-modified-since",
    "if-unmodified-since",
    "if-range",
)


def approval_digest(payload_digest: str, headers: Iterable[tuple[str, str]]) -> str:
    """What an operator's approval names: the payload digest, and the ``APPROVAL_HEADERS``
    of the request (as they reach the downstream: the caller leaves out the ones its
    ``Connection`` header removes). Lowercase hex SHA-256 of ``payloadDigest\n`` then the
    compact JSON list of ``[name, value]`` pairs (names as ``server_field_name`` reads them,
    so ``If_Match`` or ``If.Match`` is no way around an approval; sorted by name, the values
    of one name in the order sent); ``payload_digest`` itself when none of them was sent, so
    an approval of the payload digest alone still means exactly that request (and records
    bound before approval digests existed keep matching). The payload digest never changes."""
    pairs = [
        [folded, value]
        for name, value in headers
        if (folded := server_field_name(name)) in APPROVAL_HEADERS
    ]
    if not pairs:
        return payload_digest
    pairs.sort(key=lambda pair: pair[0])  # stable: one name's values keep their order
    listed = json.dumps(pairs, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(f"{payload_digest}\n{listed}".encode()).hexdigest()


def _naming(wanted: str, payload: str) -> str:
    """How a refusal names what an operator must approve (mirrored in ``lua/prepare.lua``)."""
    if wanted == payload:
        return f"payloadDigest {payload}"
    return f"approvalDigest {wanted} (payloadDigest {payload} and its effect-changing headers)"


def wanted_approval(effect: Effect) -> str:
    """The approval digest the record's bound request needs (``approval_digest``)."""
    return effect.requested_digest or effect.payload_digest


@dataclass(frozen=True, slots=True)
class Fence:
    """The claim a proxied call presents in its ``Fence-*`` headers."""

    task_id: str
    attempt_id: str
    claim_generation: int
    scheduler_epoch: int
    cancel_generation: int
    #: The authenticated principal making the call (None without ``[auth]``): it must be the
    #: claim's (``ledger.tasks.check_principal``).
    principal: str | None = None


@dataclass(frozen=True, slots=True)
class ClientKey:
    """A lease-less client's call (the ``client`` role): who sent it and the idempotency key
    it sent. The key is the client's; the effect is the principal's: ``keyed_effect_id``."""

    principal: str
    key: str


@dataclass(frozen=True, slots=True)
class EffectRequest:
    """One mutation to prepare: under a lease (``fence``) or, for a lease-less client, under
    its idempotency key (``client_key``); exactly one of the two."""

    fence: Fence | None
    node: str
    slot: str
    downstream: str
    method: str
    path: str
    payload_digest: str
    #: Names this one request's forward, so a gateway that lost the store's answer to its
    #: prepare can find the record and abort it (it knows it forwarded nothing).
    forward_id: str | None = None
    #: What an approval of this request must name (``approval_digest``); None: the same as
    #: ``payload_digest`` (no effect-changing header was sent).
    approval_digest: str | None = None
    #: The request as forwarded, for operators (``ledger.requests``: headers and body, less
    #: what no record keeps); None unless the downstream keeps request bodies.
    request_json: str | None = None
    #: A keyed call's principal and key (``fence`` is then None; ``node`` and ``slot`` are
    #: not part of its identity).
    client_key: ClientKey | None = None

    def __post_init__(self) -> None:
        if (self.fence is None) == (self.client_key is None):
            raise ValueError("an effect request has a fence or a client key, never both")

    @property
    def effect_id(self) -> str | None:
        """The keyed effect's id (None for a leased one: its id needs the task's revision,
        which only the store's step reads)."""
        if self.client_key is None:
            return None
        return keyed_effect_id(self.client_key.principal, self.downstream, self.client_key.key)


@dataclass(frozen=True, slots=True)
class EffectAttempt:
    #: The claim's attempt id; a keyed effect's forward has no claim: its forward id.
    attempt_id: str
    #: The claim's generation; 0 for a keyed effect's forward.
    claim_generation: int
    started_at: int
    ended_at: int | None = None
    outcome: str | None = None
    reason: str | None = None
    #: The operator whose approval this forward consumed (non-replayable downstreams).
    approved_by: str | None = None
    forward_id: str | None = None


@dataclass(frozen=True, slots=True)
class Effect:
    effect_id: str
    #: The task, its revision, node and slot of a leased effect; all None for a keyed one.
    task_id: str | None
    revision: int | None
    node: str | None
    slot: str | None
    downstream: str
    method: str
    path: str
    payload_digest: str
    state: EffectState
    created_at: int
    updated_at: int
    #: While PREPARED: the instant after which the forward cannot still be running.
    deadline_at: int | None = None
    attempts: tuple[EffectAttempt, ...] = ()
    #: The stored response (JSON text: status, headers, body or bodyDigest), if any.
    response_json: str | None = None
    #: An operator's unused approval to forward exactly this payload digest, until it expires.
    approval_digest: str | None = None
    approval_by: str | None = None
    approval_at: int | None = None
    approval_expires_at: int | None = None
    #: A reconciler holding the right to probe this UNKNOWN effect, until ``probe_until``.
    probe_holder: str | None = None
    probe_until: int | None = None
    probe_count: int = 0
    next_probe_at: int | None = None
    #: Attempts before this index were settled NOT_APPLIED by an operator or a probe; a
    #: later attempt's failure is judged only against the attempts after it.
    settled_attempts: int = 0
    #: Operator and reconciler actions, oldest first (JSON list; the last ``MAX_ACTIONS``).
    actions_json: str | None = None
    #: The authenticated principal whose call last bound the payload (the one a forward, or
    #: the approval it waits for, is for); None without ``[auth]``. No operator may approve
    #: an effect requested under their own principal (``approve``).
    requested_by: str | None = None
    #: The approval digest of the request the record is bound to (``approval_digest``: the
    #: payload digest and the effect-changing headers); None when it is ``payload_digest``
    #: (no such header was sent, or the record was bound before approval digests existed).
    requested_digest: str | None = None
    #: The last forward's request as ``ledger.requests`` keeps it (JSON text), written by the
    #: prepare that opened it; None when its downstream keeps no request bodies.
    request_json: str | None = None
    #: A keyed effect's owner and idempotency key (``ClientKey``); None for a leased effect.
    principal: str | None = None
    idempotency_key: str | None = None

    @property
    def kind(self) -> str:
        """``keyed`` (a lease-less client's, by idempotency key) or ``leased``."""
        return "leased" if self.idempotency_key is None else "keyed"


@dataclass(frozen=True, slots=True)
class PrepareOutcome:
    action: Action
    effect: Effect
    #: Whether ``effect`` differs from what the store holds and must be written.
    write: bool
    error: FencegateError | None = None

    @property
    def seq(self) -> int:
        """The forward's sequence number: its index in ``attempts``."""
        return len(self.effect.attempts) - 1


def check_fence(task: Task | None, scheduler: Scheduler, fence: Fence, now: int) -> Task:
    """Is this the task's current, unexpired claim? Every proxied call asks this first."""
    task = check_holder(
        task,
        fence.attempt_id,
        fence.claim_generation,
        None,
        fence.cancel_generation,
        scheduler,
        fence.scheduler_epoch,
        fence.principal,
    )
    if task.state is TaskState.COMMITTED:
        raise AlreadyCommitted("the task is committed; its attempt may produce no more effects")
    assert task.lease_expires_at is not None
    if now >= task.lease_expires_at:
        raise LeaseExpired(
            f"lease expired at leaseExpiresAt {task.lease_expires_at}",
            leaseExpiresAt=task.lease_expires_at,
        )
    return task


def is_overdue(effect: Effect, now: int) -> bool:
    """Is this a PREPARED record past its deadline (at or after ``deadline_at``)? Its forward
    cannot still be running, so it reads as UNKNOWN (``effective``).

    The one source of the rule. Mirrors: ``expire_effect`` in ``lua/effect_lib.lua`` (and the
    prepared index it keeps, scored by the deadline), ``lua/gauges.lua``, the Redis store's
    ``unsettled_effects``, and the SQL stores' ``Dialect.overdue``/``Dialect.running``;
    ``tests/test_stateful.py`` holds each to this function."""
    return (
        effect.state is EffectState.PREPARED
        and effect.deadline_at is not None
        and now >= effect.deadline_at
    )


def is_awaiting_approval(effect: Effect) -> bool:
    """Does this effect wait for an operator's approval, or for the agent to use the one it
    has? It is NOT_APPLIED and either no forward was ever admitted (``prepare`` with
    ``require_approval`` wrote it down and refused) or it holds an approval (given, or kept by
    a forward that certainly sent nothing: ``sent_nothing``), used or expired.

    The one source of the rule. Mirrors: the awaiting index of ``index_effect`` in
    ``lua/effect_lib.lua`` and the SQL stores' ``Dialect.awaiting`` condition."""
    return effect.state is EffectState.NOT_APPLIED and (
        not effect.attempts or effect.approval_digest is not None
    )


def keyed_settled(effect: Effect) -> bool:
    """Is this a keyed effect that retention may count down (``retention.why_kept_keyed``):
    COMMITTED, or NOT_APPLIED and not awaiting approval? Never while PREPARED or UNKNOWN. A
    keyed effect has no task to expire with, so the stores index exactly these, due from the
    ``updated_at`` at which they entered the set (a write that leaves one settled keeps its
    due time; one leaving the set, e.g. a retry forwarding again, loses its entry).

    The one source of the rule. Mirrors: ``index_effect`` in ``lua/effect_lib.lua`` and the
    SQL stores' keyed index upkeep (``sql_steps``)."""
    if effect.idempotency_key is None:
        return False
    if effect.state is EffectState.COMMITTED:
        return True
    return effect.state is EffectState.NOT_APPLIED and not is_awaiting_approval(effect)


#: How a forward's reason says it certainly sent nothing: the connection was refused or never
#: made (``connect failed``), no pooled connection came in time (``never sent``), the gateway
#: never started it (``never forwarded``: ``ABORT_REASON``, ``LATE_REASON``). The gateway's
#: one table of send failures writes these prefixes (``gateway/forward.py``).
SENT_NOTHING_PREFIXES = ("connect failed", "never sent", "never forwarded")


def sent_nothing(reason: str | None) -> bool:
    """Did the forward that ended with ``reason`` certainly send nothing? Such a forward keeps
    the approval it was admitted under (``complete``, ``abort``): it did not use it.

    The one source of the rule. Mirrors: ``sent_nothing`` in ``lua/effect_lib.lua``."""
    return reason is not None and reason.startswith(SENT_NOTHING_PREFIXES)


def _approval_after(effect: Effect, state: EffectState, reason: str | None) -> Effect:
    """The record's approval once a forward ended with ``reason`` and the effect is ``state``:
    kept while the effect is NOT_APPLIED and the forward certainly sent nothing (the agent's
    retry goes out under it, until it expires), else used up."""
    if state is EffectState.NOT_APPLIED and sent_nothing(reason):
        return effect
    return replace(
        effect, approval_digest=None, approval_by=None, approval_at=None, approval_expires_at=None
    )


def effective(effect: Effect, now: int) -> Effect:
    """The record as it must be read at ``now``: a PREPARED past its deadline is UNKNOWN."""
    if is_overdue(effect, now):
        last = replace(
            effect.attempts[-1],
            ended_at=effect.deadline_at,
            outcome=EffectState.UNKNOWN.value,
            reason=DEADLINE_REASON,
        )
        # The forward may have been sent: it used its approval up (``_approval_after``).
        return replace(
            effect,
            state=EffectState.UNKNOWN,
            deadline_at=None,
            attempts=(*effect.attempts[:-1], last),
            approval_digest=None,
            approval_by=None,
            approval_at=None,
            approval_expires_at=None,
            updated_at=now,
        )
    return effect


def _rejection(error: FencegateError, effect: Effect) -> FencegateError:
    """``error`` about ``effect``: named in its detail (mirrored in ``RedisStore``'s
    prepare) and in its members."""
    error.about_effect(effect.effect_id)
    error.extra.update(effectId=effect.effect_id, effectState=effect.state.value)
    return error


def _new_record(task: Task | None, request: EffectRequest, now: int) -> Effect:
    """The record a first prepare opens (NOT_APPLIED, no forward yet): a leased effect is
    named by its task's revision, node and slot, a keyed one by its principal and key."""
    key = request.client_key
    if key is None:
        assert task is not None
        eid = effect_id(task.task_id, task.revision, request.node, request.slot)
        task_id, revision, node, slot = task.task_id, task.revision, request.node, request.slot
    else:
        assert request.effect_id is not None
        eid, task_id, revision, node, slot = request.effect_id, None, None, None, None
    return Effect(
        effect_id=eid,
        task_id=task_id,
        revision=revision,
        node=node,
        slot=slot,
        downstream=request.downstream,
        method=request.method,
        path=request.path,
        payload_digest=request.payload_digest,
        state=EffectState.NOT_APPLIED,
        created_at=now,
        updated_at=now,
        principal=None if key is None else key.principal,
        idempotency_key=None if key is None else key.key,
    )


def prepare(
    task: Task | None,
    scheduler: Scheduler,
    effect: Effect | None,
    request: EffectRequest,
    now: int,
    forward_deadline_ms: int,
    *,
    resend_window_ms: int | None = None,
    require_approval: bool = False,
) -> PrepareOutcome:
    """Decide what one proxied mutation may do; raises when the claim itself is refused.

    ``resend_window_ms`` is the adapter's answer to "may an UNKNOWN effect with the same
    payload go again under its original key?": only for downstreams that deduplicate on the
    key, and only while the key is inside their deduplication window (counted from the
    effect's first forward). ``require_approval`` makes every forward wait for an operator's
    approval of its exact payload digest, used up by that one forward (unless it certainly
    sent nothing: ``sent_nothing``, then the agent's retry goes out under it until it expires),
    and never by a forward of the principal who gave it (two people for a non-replayable
    effect): the caller's principal is recorded as ``requested_by`` whenever its call binds
    the payload.
    """
    fence, key = request.fence, request.client_key
    if fence is not None:
        task = check_fence(task, scheduler, fence, now)
        attempt = EffectAttempt(
            fence.attempt_id, fence.claim_generation, now, forward_id=request.forward_id
        )
        requester = fence.principal or None
    else:
        # A keyed call has no lease to check: its key and principal are the whole identity.
        assert key is not None and request.forward_id is not None
        attempt = EffectAttempt(request.forward_id, 0, now, forward_id=request.forward_id)
        requester = key.principal
    if effect is None:
        effect = _new_record(task, request, now)
        current, changed = effect, True
    else:
        current = effective(effect, now)
        changed = current is not effect
    same = current.payload_digest == request.payload_digest
    state = current.state

    in_window = resend_window_ms is not None and now < current.created_at + resend_window_ms
    if state is EffectState.NOT_APPLIED or (state is EffectState.UNKNOWN and same and in_window):
        wanted = request.approval_digest or request.payload_digest
        requested = None if wanted == request.payload_digest else wanted
        moved = (
            changed
            or not same
            or requester != current.requested_by
            or requested != current.requested_digest
        )
        rebound = replace(
            current,
            downstream=request.downstream,
            method=request.method,
            path=request.path,
            payload_digest=request.payload_digest,
            requested_by=requester,
            requested_digest=requested,
            updated_at=now if moved else current.updated_at,
        )
        if require_approval:
            # An approval names the approval digest: the payload and the headers that change
            # what it does (``approval_digest``); another one is not approved.
            approved = (
                rebound.approval_digest == wanted
                and rebound.approval_expires_at is not None
                and now < rebound.approval_expires_at
                and not (requester is not None and rebound.approval_by == requester)
            )
            if not approved:
                if moved:
                    # What the approver decides on: the request this binding would forward.
                    rebound = replace(rebound, request_json=request.request_json)
                waiting: FencegateError = ApprovalRequired(
                    f"an operator must approve {_naming(wanted, request.payload_digest)}: "
                    f"POST /v1/effects/{rebound.effect_id}/approve"
                )
                waiting = _rejection(waiting, rebound)
                waiting.extra["approvalDigest"] = wanted
                return PrepareOutcome(Action.REJECT, rebound, write=moved, error=waiting)
            attempt = replace(attempt, approved_by=rebound.approval_by)
        else:
            rebound = _approval_after(rebound, EffectState.PREPARED, None)
        # An approval stays on the record while its forward runs: the forward's outcome says
        # whether it was used (``complete``, ``_approval_after``); no other forward can take
        # it meanwhile (a PREPARED record admits none).
        again = replace(
            rebound,
            state=EffectState.PREPARED,
            deadline_at=now + forward_deadline_ms,
            attempts=(*rebound.attempts, attempt),
            probe_holder=None,
            probe_until=None,
            updated_at=now,
            request_json=request.request_json,
        )
        return PrepareOutcome(Action.FORWARD, again, write=True)
    if not same:
        error: FencegateError = PayloadConflict(
            f"effect {current.effect_id} is bound to payloadDigest {current.payload_digest}"
        )
    elif state is EffectState.COMMITTED:
        return PrepareOutcome(Action.REPLAY, current, write=changed)
    elif state is EffectState.PREPARED:
        assert current.deadline_at is not None
        error = EffectInFlight(
            "the same effect is being forwarded right now",
            retryAfterMs=max(current.deadline_at - now, 0),
        )
    else:
        # What to do next depends on the downstream's kind: the gateway adds it
        # (``gateway.proxy_decisions.next_step``), so this text stays the Lua mirror's.
        error = EffectUnknown("an earlier forward of this effect has an unknown outcome")
    return PrepareOutcome(Action.REJECT, current, write=changed, error=_rejection(error, current))


#: Why an effect stays UNKNOWN although its last attempt certainly did not execute.
EARLIER_UNKNOWN = "an earlier attempt may have executed"


def may_have_executed(effect: Effect, before: int) -> bool:
    """Did any attempt before index ``before``, since the last operator or probe settled the
    effect NOT_APPLIED, end UNKNOWN (it may have executed at the downstream)?"""
    return any(
        a.outcome == EffectState.UNKNOWN.value
        for a in effect.attempts[effect.settled_attempts : before]
    )


def _state_after(effect: Effect, seq: int, outcome: EffectState) -> EffectState:
    """The effect's state once attempt ``seq`` ended with ``outcome``. The at-most-once rule:
    once any attempt may have executed, a later attempt's NOT_APPLIED cannot make the effect
    NOT_APPLIED (that would let the same effect go out again); it stays UNKNOWN until it
    commits, or an operator or a probe settles it."""
    if outcome is EffectState.NOT_APPLIED and may_have_executed(effect, seq):
        return EffectState.UNKNOWN
    return outcome


def complete(
    effect: Effect,
    seq: int,
    attempt_id: str,
    outcome: EffectState,
    reason: str,
    response_json: str | None,
    now: int,
) -> tuple[Effect, bool]:
    """Record forward ``seq``'s outcome; returns the record and whether it was applied.

    Applied only while the record still waits for this forward: its last attempt is ``seq``
    by ``attempt_id``, not ended, or ended only because its deadline passed (the forward was
    slower than its deadline, and its real outcome is better information than UNKNOWN).
    The approval the forward went under is used up, unless it certainly sent nothing and the
    effect is NOT_APPLIED (``_approval_after``).
    """
    if outcome is EffectState.PREPARED:
        raise ValueError("a forward's outcome cannot be PREPARED")
    if seq != len(effect.attempts) - 1:
        return effect, False
    last = effect.attempts[seq]
    waiting = effect.state is EffectState.PREPARED or (
        effect.state is EffectState.UNKNOWN and last.reason == DEADLINE_REASON
    )
    if last.attempt_id != attempt_id or not waiting:
        return effect, False
    ended = replace(last, ended_at=now, outcome=outcome.value, reason=reason)
    state = _state_after(effect, seq, outcome)
    done = replace(
        _approval_after(effect, state, reason),
        state=state,
        deadline_at=None,
        attempts=(*effect.attempts[:-1], ended),
        response_json=response_json if response_json is not None else effect.response_json,
        updated_at=now,
    )
    return done, True


def _with_action(effect: Effect, action: dict[str, Any]) -> str:
    actions = json.loads(effect.actions_json) if effect.actions_json else []
    actions.append(action)
    return json.dumps(actions[-MAX_ACTIONS:], separators=(",", ":"))


def _settled_error(effect: Effect, doing: str) -> FencegateError:
    if effect.state is EffectState.PREPARED:
        error: FencegateError = EffectInFlight(
            f"the effect is being forwarded right now; cannot {doing} it"
        )
    elif effect.state is EffectState.UNKNOWN:
        error = EffectUnknown(f"the effect's outcome is unknown; cannot {doing} it")
    else:
        error = EffectSettled(f"the effect is already {effect.state.value}; cannot {doing} it")
    return _rejection(error, effect)


#: Why a duplicate of a COMMITTED effect gets no answer of the downstream's: nothing stored.
EMPTY_REPLAY = (
    "no response is stored: duplicates of this call will be answered 204 with no body and "
    "Fence-Replay-Body: none (not the downstream's answer); a later resolve cannot add one"
)


@dataclass(frozen=True, slots=True)
class Resolution:
    """What an operator's resolve did: the record to write, whether it repeated the
    resolution that settled the effect (nothing to write, nothing recorded), and what
    duplicates of the call will be answered (``warnings``, for the operator)."""

    effect: Effect
    unchanged: bool
    warnings: tuple[str, ...] = ()
    #: ``force`` overrode the landing rule: until when an earlier forward could still land.
    forced_until: int | None = None

    @property
    def empty_replay(self) -> bool:
        """COMMITTED with no response at all: duplicates get an empty 204."""
        return self.effect.state is EffectState.COMMITTED and self.effect.response_json is None


def response_identity(response_json: str | None) -> str | None:
    """A digest of what an operator gave as the response (status, headers by lowercased
    name, body), so a repeated resolve can be told from a different one; None: none given.
    Header order and name case do not count: they change nothing a duplicate is answered."""
    if response_json is None:
        return None
    record = json.loads(response_json)
    headers = sorted([str(name).lower(), str(value)] for name, value in record["headers"])
    canonical = [record["status"], headers, record.get("bodyDigest")]
    return hashlib.sha256(json.dumps(canonical, separators=(",", ":")).encode()).hexdigest()


def _warnings(effect: Effect, given: str | None) -> tuple[str, ...]:
    """What the operator should know about what duplicates will now be answered."""
    if effect.state is not EffectState.COMMITTED:
        return ()
    if effect.response_json is None:
        return (EMPTY_REPLAY,)
    if given is None:
        status = json.loads(effect.response_json).get("status")
        return (
            f"no response given: duplicates of this call will replay the answer the forward "
            f"recorded (status {status})",
        )
    return ()


def _last_resolve(effect: Effect) -> dict[str, Any] | None:
    actions = json.loads(effect.actions_json) if effect.actions_json else []
    found = [a for a in actions if a.get("action") == "resolve"]
    return found[-1] if found else None


def _holds(effect: Effect, last: dict[str, Any] | None) -> str:
    """What a settled record holds, in words, for the refusal of a different resolve."""
    if last is None or last.get("outcome") != effect.state.value:
        return f"the effect is already {effect.state.value}, settled by a forward or a probe"
    how = f"the effect was resolved {effect.state.value} by {last.get('by')} at resolvedAt "
    how += f"{last.get('at')}"
    if effect.state is EffectState.COMMITTED:
        if last.get("response") is not None:
            how += " with the operator's response"
        elif effect.response_json is not None:
            status = json.loads(effect.response_json).get("status")
            how += f" keeping the forward's recorded answer (status {status})"
        else:
            how += " without a response (duplicates get 204, Fence-Replay-Body: none)"
    return how


def resolution(
    effect: Effect | None,
    outcome: EffectState,
    note: str,
    operator: str,
    response_json: str | None,
    now: int,
    *,
    settle_ms: int = 0,
    force: bool = False,
) -> Resolution:
    """An operator settles an UNKNOWN effect, once: the decision is final.

    Repeating exactly the resolution that settled it (the same outcome, and the same
    response or again none: a CLI retried after a lost answer) changes nothing and is
    ``unchanged``. Anything else on a settled effect (another outcome, a response where the
    first gave none, a different response) is ``EFFECT_SETTLED``: a duplicate may already
    have been answered what the record holds, and two duplicates must never get different
    answers (docs/decisions.md, "Resolve"). ``response_json`` goes with COMMITTED only.

    NOT_APPLIED lets the same payload go again, so it is refused (``EFFECT_IN_FLIGHT`` with
    ``landingUntil`` and ``retryAfterMs``) while an earlier forward may still land at the
    downstream (``landing_until`` with the downstream's ``settle_ms``, the probe's rule): what
    the operator checked at the downstream may not be the end of the story, and the retry would
    run twice. ``force`` overrides it (recorded on the action, with ``landingUntil``). COMMITTED
    is never refused: it lets nothing go again. ``settle_ms`` 0: no forward can still land."""
    if effect is None:
        raise NoSuchEffect()
    if outcome not in RESOLVE_OUTCOMES:
        raise ValueError(f"an operator resolves to one of {', '.join(RESOLVE_OUTCOMES)}")
    if response_json is not None and outcome is not EffectState.COMMITTED:
        raise BadRequest(
            "response: only with outcome COMMITTED (duplicates of a NOT_APPLIED effect are "
            "forwarded again, nothing is replayed)"
        )
    given = response_identity(response_json)
    current = effective(effect, now)
    if current.state is not EffectState.UNKNOWN:
        last = _last_resolve(current)
        if (
            current.state is outcome
            and last is not None
            and last.get("outcome") == outcome.value
            and last.get("response") == given
        ):
            return Resolution(current, unchanged=True, warnings=_warnings(current, given))
        if current.state in (EffectState.COMMITTED, EffectState.NOT_APPLIED):
            extra = {"resolvedAt": last["at"]} if last and "at" in last else {}
            raise _rejection(
                EffectSettled(
                    f"{_holds(current, last)}; a resolve cannot change it (asked: "
                    f"{outcome.value}, {'with' if given else 'without'} a response)",
                    **extra,
                ),
                current,
            )
        raise _settled_error(current, "resolve")
    action: dict[str, Any] = {"action": "resolve", "by": operator, "at": now, "note": note,
                              "outcome": outcome.value, "response": given}  # fmt: skip
    until = landing_until(current, settle_ms) if outcome is EffectState.NOT_APPLIED else None
    if until is not None and now < until:
        if not force:
            raise _rejection(
                EffectInFlight(
                    f"an earlier forward of this effect may still land at the downstream until "
                    f"landingUntil {until} ({iso_utc(until)}), {settle_ms} ms (settle_ms) after "
                    f"the gateway stopped waiting for it; NOT_APPLIED now would let a retry run "
                    f"it twice. Check the downstream after then (or resolve COMMITTED now), or "
                    f"resolve with force if you know it cannot land",
                    landingUntil=until,
                    retryAfterMs=until - now,
                ),
                current,
            )
        action.update(force=True, landingUntil=until)
    else:
        until = None
    if outcome is EffectState.COMMITTED:
        # Without a response from the operator, keep what the forward recorded (if anything).
        kept = response_json if response_json is not None else current.response_json
    else:
        kept = None
    settled = len(current.attempts) if outcome is EffectState.NOT_APPLIED else None
    done = replace(
        current,
        state=outcome,
        response_json=kept,
        settled_attempts=current.settled_attempts if settled is None else settled,
        probe_holder=None,
        probe_until=None,
        actions_json=_with_action(current, action),
        updated_at=now,
    )
    return Resolution(done, unchanged=False, warnings=_warnings(done, given), forced_until=until)


def resolve(
    effect: Effect | None,
    outcome: EffectState,
    note: str,
    operator: str,
    response_json: str | None,
    now: int,
    *,
    settle_ms: int = 0,
    force: bool = False,
) -> Effect:
    """``resolution``'s record: the store transition (``Store.update_effect``)."""
    return resolution(
        effect, outcome, note, operator, response_json, now, settle_ms=settle_ms, force=force
    ).effect


def approve(
    effect: Effect | None,
    operator: str,
    note: str,
    expected_digest: str | None,
    ttl_ms: int,
    now: int,
    principal: str | None = None,
    *,
    expected_approval: str | None = None,
) -> Effect:
    """Let the waiting request of a non-replayable effect go, once, until ``now + ttl_ms``.

    The approval names the request's approval digest (``approval_digest``: its payload and
    the headers that change what it does). ``expected_approval`` and ``expected_digest`` (the
    payload digest) guard it: each given must be the waiting request's (else
    PAYLOAD_CONFLICT), and the payload digest alone is enough only when that request sent no
    such header (else BAD_REQUEST: the operator would approve headers they did not name).

    ``principal`` is the approving operator's authenticated principal (None without
    ``[auth]``): it may not be the one the effect was requested under (``requested_by``),
    ``FORBIDDEN``: a non-replayable effect takes two people."""
    if effect is None:
        raise NoSuchEffect()
    current = effective(effect, now)
    if current.state is not EffectState.NOT_APPLIED:
        raise _settled_error(current, "approve")
    if principal and current.requested_by == principal:
        raise Forbidden("an operator may not approve an effect requested under their own principal")
    wanted = wanted_approval(current)
    if expected_digest is not None and expected_digest != current.payload_digest:
        raise _rejection(
            PayloadConflict(
                f"the effect now waits for payloadDigest {current.payload_digest}, "
                f"not {expected_digest}"
            ),
            current,
        )
    if expected_approval is not None and expected_approval != wanted:
        raise _rejection(
            PayloadConflict(
                f"the effect now waits for approvalDigest {wanted}, not {expected_approval}"
            ),
            current,
        )
    if expected_approval is None and expected_digest is not None and wanted != expected_digest:
        raise BadRequest(
            f"approvalDigest: required, the waiting request carries effect-changing headers "
            f"(Content-Type, Content-Encoding or preconditions) that payloadDigest does not "
            f"cover; approve its approvalDigest {wanted}"
        )
    return replace(
        current,
        approval_digest=wanted,
        approval_by=operator,
        approval_at=now,
        approval_expires_at=now + ttl_ms,
        actions_json=_with_action(
            current,
            {
                "action": "approve",
                "by": operator,
                "at": now,
                "note": note,
                "payloadDigest": current.payload_digest,
                "approvalDigest": wanted,
                "expiresAt": now + ttl_ms,
            },
        ),
        updated_at=now,
    )


#: Reason recorded when a gateway aborts a forward it never sent.
ABORT_REASON = "never forwarded: the gateway lost the store's answer to its prepare"
#: Reason recorded when a forward could not start within proxy.forward_start_limit_ms.
LATE_REASON = "never forwarded: it could not start within proxy.forward_start_limit_ms"


def abort(effect: Effect | None, forward_id: str, now: int, reason: str = ABORT_REASON) -> Effect:
    """NOT_APPLIED for a PREPARED whose gateway got no answer from the store and so never
    forwarded it (also after its deadline made it read UNKNOWN). Refuses (EFFECT_SETTLED) when
    the record's last forward is another one or already has an outcome of its own."""
    if effect is None:
        raise NoSuchEffect()
    current = effective(effect, now)
    last = current.attempts[-1] if current.attempts else None
    waiting = current.state is EffectState.PREPARED or (
        current.state is EffectState.UNKNOWN and last is not None and last.reason == DEADLINE_REASON
    )
    if last is None or last.forward_id != forward_id or not waiting:
        raise _rejection(EffectSettled("no forward of this request is waiting"), current)
    ended = replace(last, ended_at=now, outcome=EffectState.NOT_APPLIED.value, reason=reason)
    state = _state_after(current, len(current.attempts) - 1, EffectState.NOT_APPLIED)
    return replace(
        _approval_after(current, state, reason),
        state=state,
        deadline_at=None,
        attempts=(*current.attempts[:-1], ended),
        updated_at=now,
    )


def expire(effect: Effect | None, now: int) -> Effect:
    """Write down that a PREPARED past its deadline is UNKNOWN (the reconciler's sweep);
    refuses (EFFECT_SETTLED) when there is nothing to write down."""
    if effect is None:
        raise NoSuchEffect()
    current = effective(effect, now)
    if current is effect:
        raise _rejection(EffectSettled("nothing to expire"), current)
    return current


def begin_probe(effect: Effect | None, holder: str, lease_ms: int, now: int) -> Effect:
    """Take the right to probe an UNKNOWN effect, so two reconcilers never probe it at once."""
    if effect is None:
        raise NoSuchEffect()
    current = effective(effect, now)
    if current.state is not EffectState.UNKNOWN:
        raise _settled_error(current, "probe")
    if (
        current.probe_holder not in (None, holder)
        and current.probe_until is not None
        and now < current.probe_until
    ):
        raise _rejection(
            EffectInFlight(
                f"another reconciler is probing this effect until probeUntil {current.probe_until}",
                probeUntil=current.probe_until,
            ),
            current,
        )
    return replace(current, probe_holder=holder, probe_until=now + lease_ms, updated_at=now)


class ProbeVerdict(StrEnum):
    FOUND = "found"
    ABSENT = "absent"
    INCONCLUSIVE = "inconclusive"


def landing_until(effect: Effect, settle_ms: int) -> int | None:
    """Until when may an earlier forward of this effect still land at the downstream? Each
    attempt that may have executed (UNKNOWN since the last settlement) can, until
    ``settle_ms`` after the gateway stopped waiting for it; None when none may have."""
    ends = [
        (a.ended_at if a.ended_at is not None else a.started_at) + settle_ms
        for a in effect.attempts[effect.settled_attempts :]
        if a.outcome in (EffectState.UNKNOWN.value, None)
    ]
    return max(ends) if ends else None


def finish_probe(
    effect: Effect | None,
    holder: str,
    verdict: ProbeVerdict,
    response_json: str | None,
    retry_in_ms: int,
    actor: str,
    now: int,
    settle_ms: int = 0,
    asked_at: int | None = None,
) -> Effect:
    """Record what a probe found: COMMITTED (with the probe's answer), NOT_APPLIED, or, when
    the probe said nothing certain, UNKNOWN again with the next probe ``retry_in_ms`` away.

    "Absent" is only believed once no earlier forward can still land (``landing_until``): a
    forward that timed out may sit in the downstream's queue and apply later, so an absent
    answer before then is inconclusive (recorded with ``waitUntil``), and probing goes on with
    its usual backoff. It is judged by ``asked_at``, when the probe was sent (the lookup saw
    the downstream at some instant after it), not by when its answer is recorded."""
    if effect is None:
        raise NoSuchEffect()
    current = effective(effect, now)
    if current.state is not EffectState.UNKNOWN:
        raise _settled_error(current, "record a probe for")
    if current.probe_holder != holder:
        raise _rejection(EffectInFlight("the probe lease was lost to another reconciler"), current)
    released = replace(current, probe_holder=None, probe_until=None, updated_at=now)
    action: dict[str, Any] = {"action": "reconcile", "by": actor, "at": now,
                              "verdict": verdict.value}  # fmt: skip
    if asked_at is not None:
        action["askedAt"] = asked_at
    if verdict is ProbeVerdict.ABSENT:
        until = landing_until(current, settle_ms)
        if until is not None and (now if asked_at is None else asked_at) < until:
            # Probing goes on with its backoff: "found" may still come and counts at once.
            verdict = ProbeVerdict.INCONCLUSIVE
            action["waitUntil"] = until
    if verdict is ProbeVerdict.INCONCLUSIVE:
        return replace(
            released,
            probe_count=current.probe_count + 1,
            next_probe_at=now + retry_in_ms,
            actions_json=_with_action(current, action),
        )
    found = verdict is ProbeVerdict.FOUND
    outcome = EffectState.COMMITTED if found else EffectState.NOT_APPLIED
    return replace(
        released,
        state=outcome,
        response_json=response_json if found else None,
        probe_count=current.probe_count + 1,
        next_probe_at=None,
        settled_attempts=current.settled_attempts if found else len(current.attempts),
        actions_json=_with_action(current, {**action, "outcome": outcome.value}),
    )


# --- representations -------------------------------------------------------------------------

_STR = ("effect_id", "task_id", "node", "slot", "downstream", "method", "path",
        "payload_digest", "approval_digest", "approval_by", "probe_holder",
        "requested_by", "requested_digest", "principal", "idempotency_key")  # fmt: skip
_INT = ("revision", "created_at", "updated_at", "deadline_at", "approval_at",
        "approval_expires_at", "probe_until", "probe_count", "next_probe_at",
        "settled_attempts")  # fmt: skip
_ATTEMPT_STR = ("attempt_id", "outcome", "reason", "approved_by", "forward_id")
_ATTEMPT_INT = ("claim_generation", "started_at", "ended_at")


def effect_to_fields(effect: Effect) -> dict[str, str]:
    """Flat string map (absent = None), shared by the SQLite row and the Redis record."""
    out = {"state": effect.state.value, "attempt_count": str(len(effect.attempts))}
    for name in _STR + _INT:
        value = getattr(effect, name)
        if value is not None:
            out[name] = str(value)
    if effect.response_json is not None:
        out["response"] = effect.response_json
    if effect.actions_json is not None:
        out["actions"] = effect.actions_json
    if effect.request_json is not None:
        out["request"] = effect.request_json
    for i, attempt in enumerate(effect.attempts):
        for name in _ATTEMPT_STR + _ATTEMPT_INT:
            value = getattr(attempt, name)
            if value is not None:
                out[f"a{i}_{name}"] = str(value)
    return out


#: Each attempt's field names (``a<i>_<name>``, in EffectAttempt's order), built once: a
#: record is parsed on every proxied step, and formatting the names was most of its cost.
_ATTEMPT_FIELDS = ("attempt_id", "claim_generation", "started_at", "ended_at", "outcome",
                   "reason", "approved_by", "forward_id")  # fmt: skip
_ATTEMPT_KEYS: list[tuple[str, ...]] = [
    tuple(f"a{i}_{name}" for name in _ATTEMPT_FIELDS) for i in range(32)
]


def _attempt_keys(i: int) -> tuple[str, ...]:
    if i < len(_ATTEMPT_KEYS):
        return _ATTEMPT_KEYS[i]
    return tuple(f"a{i}_{name}" for name in _ATTEMPT_FIELDS)


def _int(raw: str | None) -> int | None:
    return None if raw is None else int(raw)


def effect_from_fields(fields: dict[str, str]) -> Effect:
    """The inverse of ``effect_to_fields``. Written out field by field (no per-name loops or
    keyword dicts): the gateway parses a record on every prepare and complete. The fields
    every record has since its prepare (ids, binding, times, each attempt's identity) are
    required."""
    get = fields.get
    attempts = []
    for i in range(int(fields["attempt_count"])):
        aid, gen, started, ended, outcome, reason, approved, forward = _attempt_keys(i)
        attempts.append(
            EffectAttempt(
                fields[aid],
                int(fields[gen]),
                int(fields[started]),
                _int(get(ended)),
                get(outcome),
                get(reason),
                get(approved),
                get(forward),
            )
        )
    return Effect(
        effect_id=fields["effect_id"],
        task_id=get("task_id"),
        revision=_int(get("revision")),
        node=get("node"),
        slot=get("slot"),
        downstream=fields["downstream"],
        method=fields["method"],
        path=fields["path"],
        payload_digest=fields["payload_digest"],
        state=EffectState(fields["state"]),
        created_at=int(fields["created_at"]),
        updated_at=int(fields["updated_at"]),
        deadline_at=_int(get("deadline_at")),
        attempts=tuple(attempts),
        response_json=get("response"),
        approval_digest=get("approval_digest"),
        approval_by=get("approval_by"),
        approval_at=_int(get("approval_at")),
        approval_expires_at=_int(get("approval_expires_at")),
        probe_holder=get("probe_holder"),
        probe_until=_int(get("probe_until")),
        probe_count=_int(get("probe_count")) or 0,
        next_probe_at=_int(get("next_probe_at")),
        settled_attempts=_int(get("settled_attempts")) or 0,
        actions_json=get("actions"),
        requested_by=get("requested_by"),
        requested_digest=get("requested_digest"),
        request_json=get("request"),
        principal=get("principal"),
        idempotency_key=get("idempotency_key"),
    )
