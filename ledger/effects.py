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
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from ledger.errors import (
    AlreadyCommitted,
    EffectInFlight,
    EffectSettled,
    EffectUnknown,
    FencegateError,
    LeaseExpired,
    NoSuchEffect,
    PayloadConflict,
)
from ledger.tasks import Scheduler, Task, TaskState, check_holder

__all__ = [
    "Action",
    "Effect",
    "EffectAttempt",
    "EffectRequest",
    "EffectState",
    "Fence",
    "PrepareOutcome",
    "check_fence",
    "complete",
    "effect_from_fields",
    "effect_id",
    "effect_to_fields",
    "effect_to_json",
    "effective",
    "payload_digest",
    "prepare",
    "resolve",
]

#: Reason recorded on an attempt whose PREPARED record outlived its deadline.
DEADLINE_REASON = "deadline passed"


class EffectState(StrEnum):
    PREPARED = "PREPARED"
    UNKNOWN = "UNKNOWN"
    COMMITTED = "COMMITTED"
    NOT_APPLIED = "NOT_APPLIED"


class Action(StrEnum):
    FORWARD = "FORWARD"
    REPLAY = "REPLAY"
    REJECT = "REJECT"


def effect_id(task_id: str, revision: int, node: str, slot: str) -> str:
    """Lowercase hex SHA-256 of the compact JSON array ``[taskId, revision, node, slot]``."""
    raw = json.dumps([task_id, revision, node, slot], separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()


def payload_digest(method: str, downstream: str, path_with_query: str, body: bytes) -> str:
    """SHA-256 over ``METHOD\\ndownstream\\npath?query\\n`` then the (canonical) body.

    The caller canonicalises JSON bodies (``canonical_body``) so key order and whitespace do
    not make two identical requests look different.
    """
    digest = hashlib.sha256()
    digest.update(f"{method}\n{downstream}\n{path_with_query}\n".encode())
    digest.update(body)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class Fence:
    """The claim a proxied call presents in its ``Fence-*`` headers."""

    task_id: str
    attempt_id: str
    claim_generation: int
    scheduler_epoch: int
    cancel_generation: int


@dataclass(frozen=True, slots=True)
class EffectRequest:
    fence: Fence
    node: str
    slot: str
    downstream: str
    method: str
    path: str
    payload_digest: str


@dataclass(frozen=True, slots=True)
class EffectAttempt:
    attempt_id: str
    claim_generation: int
    started_at: int
    ended_at: int | None = None
    outcome: str | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Effect:
    effect_id: str
    task_id: str
    revision: int
    node: str
    slot: str
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
    resolved_by: str | None = None
    resolved_at: int | None = None
    resolution_note: str | None = None


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
    )
    if task.state is TaskState.COMMITTED:
        raise AlreadyCommitted("the task is committed; its attempt may produce no more effects")
    assert task.lease_expires_at is not None
    if now >= task.lease_expires_at:
        raise LeaseExpired(f"lease expired at {task.lease_expires_at}")
    return task


def effective(effect: Effect, now: int) -> Effect:
    """The record as it must be read at ``now``: a PREPARED past its deadline is UNKNOWN."""
    if (
        effect.state is EffectState.PREPARED
        and effect.deadline_at is not None
        and now >= effect.deadline_at
    ):
        last = replace(
            effect.attempts[-1],
            ended_at=effect.deadline_at,
            outcome=EffectState.UNKNOWN.value,
            reason=DEADLINE_REASON,
        )
        return replace(
            effect,
            state=EffectState.UNKNOWN,
            deadline_at=None,
            attempts=(*effect.attempts[:-1], last),
            updated_at=now,
        )
    return effect


def _rejection(error: FencegateError, effect: Effect) -> FencegateError:
    error.extra.update(effectId=effect.effect_id, effectState=effect.state.value)
    return error


def prepare(
    task: Task | None,
    scheduler: Scheduler,
    effect: Effect | None,
    request: EffectRequest,
    now: int,
    forward_deadline_ms: int,
    *,
    resend_unknown: bool = False,
) -> PrepareOutcome:
    """Decide what one proxied mutation may do; raises when the claim itself is refused.

    ``resend_unknown`` is the adapter's answer to "may an UNKNOWN effect with the same payload
    go again under its original key?" (only for downstreams that deduplicate on the key).
    """
    task = check_fence(task, scheduler, request.fence, now)
    fence = request.fence
    attempt = EffectAttempt(fence.attempt_id, fence.claim_generation, now)
    if effect is None:
        created = Effect(
            effect_id=effect_id(task.task_id, task.revision, request.node, request.slot),
            task_id=task.task_id,
            revision=task.revision,
            node=request.node,
            slot=request.slot,
            downstream=request.downstream,
            method=request.method,
            path=request.path,
            payload_digest=request.payload_digest,
            state=EffectState.PREPARED,
            created_at=now,
            updated_at=now,
            deadline_at=now + forward_deadline_ms,
            attempts=(attempt,),
        )
        return PrepareOutcome(Action.FORWARD, created, write=True)

    current = effective(effect, now)
    changed = current is not effect
    same = current.payload_digest == request.payload_digest
    state = current.state

    if state is EffectState.NOT_APPLIED or (
        state is EffectState.UNKNOWN and same and resend_unknown
    ):
        again = replace(
            current,
            state=EffectState.PREPARED,
            downstream=request.downstream,
            method=request.method,
            path=request.path,
            payload_digest=request.payload_digest,
            deadline_at=now + forward_deadline_ms,
            attempts=(*current.attempts, attempt),
            updated_at=now,
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
        error = EffectUnknown(
            "an earlier forward of this effect has an unknown outcome; reconcile it first"
        )
    return PrepareOutcome(Action.REJECT, current, write=changed, error=_rejection(error, current))


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
    done = replace(
        effect,
        state=outcome,
        deadline_at=None,
        attempts=(*effect.attempts[:-1], ended),
        response_json=response_json if response_json is not None else effect.response_json,
        updated_at=now,
    )
    return done, True


def resolve(
    effect: Effect | None,
    outcome: EffectState,
    note: str,
    operator: str,
    response_json: str | None,
    now: int,
) -> Effect:
    """An operator settles an UNKNOWN effect. Resolving again to the same outcome is a no-op."""
    if effect is None:
        raise NoSuchEffect()
    if outcome not in (EffectState.COMMITTED, EffectState.NOT_APPLIED):
        raise ValueError("an operator resolves to COMMITTED or NOT_APPLIED")
    current = effective(effect, now)
    if current.state is EffectState.PREPARED:
        raise _rejection(
            EffectInFlight("the effect is being forwarded right now; wait for its outcome"),
            current,
        )
    if current.state is not EffectState.UNKNOWN:
        if current.state is outcome and current.resolved_by is not None:
            return current
        raise _rejection(EffectSettled(f"the effect is already {current.state.value}"), current)
    return replace(
        current,
        state=outcome,
        response_json=response_json if outcome is EffectState.COMMITTED else None,
        resolved_by=operator,
        resolved_at=now,
        resolution_note=note,
        updated_at=now,
    )


# --- representations -------------------------------------------------------------------------

_STR = ("effect_id", "task_id", "node", "slot", "downstream", "method", "path",
        "payload_digest", "resolved_by", "resolution_note")  # fmt: skip
_INT = ("revision", "created_at", "updated_at", "deadline_at", "resolved_at")
_ATTEMPT_STR = ("attempt_id", "outcome", "reason")
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
    for i, attempt in enumerate(effect.attempts):
        for name in _ATTEMPT_STR + _ATTEMPT_INT:
            value = getattr(attempt, name)
            if value is not None:
                out[f"a{i}_{name}"] = str(value)
    return out


def effect_from_fields(fields: dict[str, str]) -> Effect:
    values: dict[str, Any] = {name: fields.get(name) for name in _STR}
    for name in _INT:
        raw = fields.get(name)
        values[name] = int(raw) if raw is not None else None
    attempts = []
    for i in range(int(fields["attempt_count"])):
        item: dict[str, Any] = {name: fields.get(f"a{i}_{name}") for name in _ATTEMPT_STR}
        for name in _ATTEMPT_INT:
            raw = fields.get(f"a{i}_{name}")
            item[name] = int(raw) if raw is not None else None
        attempts.append(EffectAttempt(**item))
    return Effect(
        state=EffectState(fields["state"]),
        attempts=tuple(attempts),
        response_json=fields.get("response"),
        **values,
    )


def effect_to_json(effect: Effect) -> dict[str, Any]:
    """The ledger record of the contract (``GET /v1/effects/{effectId}``)."""
    resolution = None
    if effect.resolved_by is not None:
        resolution = {
            "by": effect.resolved_by,
            "at": effect.resolved_at,
            "note": effect.resolution_note,
        }
    return {
        "effectId": effect.effect_id,
        "taskId": effect.task_id,
        "revision": effect.revision,
        "node": effect.node,
        "slot": effect.slot,
        "downstream": effect.downstream,
        "method": effect.method,
        "path": effect.path,
        "payloadDigest": effect.payload_digest,
        "state": effect.state.value,
        "deadlineAt": effect.deadline_at,
        "attempts": [
            {
                "attemptId": a.attempt_id,
                "claimGeneration": a.claim_generation,
                "startedAt": a.started_at,
                "endedAt": a.ended_at,
                "outcome": a.outcome,
                "reason": a.reason,
            }
            for a in effect.attempts
        ],
        "response": json.loads(effect.response_json) if effect.response_json else None,
        "resolution": resolution,
        "createdAt": effect.created_at,
        "updatedAt": effect.updated_at,
    }
