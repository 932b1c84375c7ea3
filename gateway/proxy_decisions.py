"""What the proxy does with a call, decided without I/O: the value ``gateway.proxy`` acts on.

The proxy asks the store first (``check_fence`` for a safe method, ``prepare_effect`` for a
mutation); what the store said, with the call's shadow setting, decides the rest::

    store said                         enforce                 shadow
    ---------------------------------  ----------------------  ------------------------------
    safe method, fence holds           PassThrough             PassThrough
    the claim is gone (ClaimRefused)   Refuse                  ShadowForward(code)
    any other error                    Refuse                  Refuse
    prepare: REJECT (conflict, ...)    Refuse                  ShadowForward(code, effect)
    prepare: REPLAY                    Replay                  ShadowForward("REPLAY", effect)
    prepare: FORWARD                   Forward(effect, seq)    Forward(effect, seq)

A lease-less client's call (``keyed_call_fields``, ``kind`` keyed) goes through the same table:
its prepare checks no fence, so no claim is ever gone, and it counts at no acceptance point
(``Validation``); its effects are counted with ``kind`` keyed.

A ``Decision`` also carries the log lines and metric increments that go with it, in the order
they are emitted, so a test can read the whole audit trail of a call from a value. The event
names, fields and labels are the ones operators' dashboards and alerts use: they are a
contract (tests/test_operations.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from fencegate.ledger.effects import Action, Effect, Fence, PrepareOutcome, wanted_approval
from fencegate.ledger.errors import ClaimRefused, FencegateError

__all__ = [
    "EFFECT_REFUSALS",
    "POINT",
    "Act",
    "Count",
    "Decision",
    "Forward",
    "LogRecord",
    "Metric",
    "PassThrough",
    "Refuse",
    "Replay",
    "ShadowForward",
    "Subject",
    "Validation",
    "call_fields",
    "decide_effect",
    "decide_safe",
    "keyed_call_fields",
    "next_step",
    "with_next_step",
]

#: The acceptance point the proxy's decisions are counted under.
POINT = "proxy"
#: Refusal codes as the effects counter names them.
EFFECT_REFUSALS = {
    "PAYLOAD_CONFLICT": "conflict",
    "EFFECT_IN_FLIGHT": "in_flight",
    "EFFECT_UNKNOWN": "unknown_refused",
    "APPROVAL_REQUIRED": "approval_required",
}


# --- what an operator does next ----------------------------------------------------------

#: The adapter kinds whose UNKNOWN effects the gateway can settle by asking the downstream
#: (``gateway.reconcile``); every other kind's reconcile refuses, and an operator resolves.
PROBING_KINDS = frozenset({"probe"})


def next_step(
    code: str,
    effect_id: str,
    kind: str,
    payload_digest: str | None = None,
    approval_digest: str | None = None,
) -> str | None:
    """What to do about a refusal on an effect of a downstream of adapter ``kind``, with the
    exact command; None when the code needs no operator. Pure: the stores' texts stay
    generic (and identical), and the gateway, which knows the kind, adds this."""
    if code == "EFFECT_UNKNOWN":
        if kind in PROBING_KINDS:
            return (
                f"the gateway probes the {kind} downstream again by itself; to ask it now: "
                f"fencegate effects reconcile {effect_id}"
            )
        return (
            f"a {kind} downstream cannot be asked (reconcile would refuse): check the "
            f"downstream's own records by hand, then: fencegate effects resolve {effect_id} "
            "--outcome COMMITTED|NOT_APPLIED --note '...'"
        )
    if code == "APPROVAL_REQUIRED":
        # The approval digest when the request carries effect-changing headers (the payload
        # digest alone does not approve those: ``ledger.effects.approve``).
        digest = f" --payload-digest {payload_digest}" if payload_digest else ""
        if approval_digest and approval_digest != payload_digest:
            digest = f" --approval-digest {approval_digest}"
        return (
            "another operator approves it once, then the call is sent again: "
            f"fencegate effects approve {effect_id}{digest} --note '...'"
        )
    return None


def with_next_step(
    error: FencegateError,
    kind: str,
    payload_digest: str | None = None,
    approval_digest: str | None = None,
) -> FencegateError:
    """``error`` with ``next_step`` appended to its detail (a copy: the store's error is
    left as it is); ``error`` itself when there is nothing to add."""
    effect_id = error.extra.get("effectId")
    if not isinstance(effect_id, str):
        return error
    step = next_step(error.code, effect_id, kind, payload_digest, approval_digest)
    if step is None or step in error.detail:
        return error
    return type(error)(f"{error.detail}. Next: {step}", **error.extra)


# --- what to do ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer with the error's problem; nothing is forwarded."""

    error: FencegateError


@dataclass(frozen=True, slots=True)
class Replay:
    """Answer with the response the effect recorded; nothing is forwarded."""

    effect: Effect


@dataclass(frozen=True, slots=True)
class PassThrough:
    """A safe method whose fence holds: forward without a ledger entry or an identity."""


@dataclass(frozen=True, slots=True)
class ShadowForward:
    """Shadow mode: what enforce mode would refuse (or replay) is forwarded anyway, without a
    ledger entry, with the effect's identity headers and ``Fence-Shadow-Rejected: code``."""

    code: str
    effect_id: str | None


@dataclass(frozen=True, slots=True)
class Forward:
    """Forward the prepared attempt ``seq`` of ``effect`` and record its outcome; ``fields``
    are what the forward's own log lines carry."""

    effect: Effect
    seq: int
    fields: Mapping[str, Any]


#: Answers without forwarding, and the three kinds of forward.
Act = Refuse | Replay | PassThrough | ShadowForward | Forward


# --- what to emit --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LogRecord:
    """One structlog event of the proxy's logger."""

    level: Literal["info", "warning"]
    event: str
    fields: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Validation:
    """One acceptance point's decision, as ``Metrics.decision`` counts it (``code`` None:
    granted; ``validated``: the claim's numbers were compared)."""

    point: str
    code: str | None
    validated: bool


@dataclass(frozen=True, slots=True)
class Count:
    """One increment of a labelled counter of ``Metrics`` (``effects``: downstream, outcome,
    kind; ``shadow_rejections``: point, code)."""

    counter: Literal["effects", "shadow_rejections"]
    labels: tuple[str, ...]


Metric = Validation | Count


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do, and what to log and count first (in this order)."""

    act: Act
    logs: tuple[LogRecord, ...] = ()
    metrics: tuple[Metric, ...] = ()


# --- the call as decisions see it ----------------------------------------------------------


def call_fields(fence: Fence, downstream: str, method: str, **extra: Any) -> dict[str, Any]:
    """The fields every log line about one proxied call under a lease carries (``extra``
    after them); ``kind`` says which of the two kinds of call it is (``leased``)."""
    return {
        "task": fence.task_id,
        "attempt": fence.attempt_id,
        "generation": fence.claim_generation,
        "epoch": fence.scheduler_epoch,
        "downstream": downstream,
        "method": method,
        "kind": "leased",
        **extra,
    }


def keyed_call_fields(
    principal: str, downstream: str, method: str, effect_id: str | None, **extra: Any
) -> dict[str, Any]:
    """``call_fields`` of a lease-less client's call (``kind`` ``keyed``): its principal and,
    when it sent an idempotency key, the keyed effect's id (a hash of the key: the key itself
    is the client's and is not logged; neither is any credential)."""
    fields: dict[str, Any] = {"principal": principal}
    if effect_id is not None:
        fields["effect_id"] = effect_id
    return {**fields, "downstream": downstream, "method": method, "kind": "keyed", **extra}


@dataclass(frozen=True, slots=True)
class Subject:
    """What a decision needs of the parsed call."""

    downstream: str
    #: ``call_fields`` of the call (for a mutation: with node, slot and payload_digest).
    fields: Mapping[str, Any]
    #: Shadow mode: refusals are recorded and let through.
    shadow: bool
    #: The downstream's adapter kind: what an operator does about a refusal depends on it.
    kind: str = field(default="http")

    @property
    def keyed(self) -> bool:
        """A lease-less client's call (``keyed_call_fields``): no fence is compared, so it
        is no acceptance point's decision (``Validation``)."""
        return self.fields.get("kind") == "keyed"


def _validation(subject: Subject, code: str | None, *, validated: bool) -> tuple[Metric, ...]:
    """The acceptance point's count of a leased call; none for a keyed one, which compares
    no fence (counting it would read as a path that skips the fence checks)."""
    return () if subject.keyed else (Validation(POINT, code, validated=validated),)


# --- the decisions -------------------------------------------------------------------------


def decide_safe(subject: Subject, refusal: FencegateError | None) -> Decision:
    """A safe method after ``check_fence``: ``refusal`` is what it raised, None if it passed."""
    if refusal is not None:
        return _refused(subject, refusal)
    return Decision(PassThrough(), metrics=_validation(subject, None, validated=True))


def decide_effect(subject: Subject, prepared: PrepareOutcome | FencegateError) -> Decision:
    """A mutation after ``prepare_effect``: its outcome, or the error it raised."""
    if isinstance(prepared, FencegateError):
        return _refused(subject, prepared)
    effect = prepared.effect
    fields = {**subject.fields, "effect_id": effect.effect_id}
    error = prepared.error
    validation = _validation(subject, error.code if error else None, validated=True)
    if prepared.action is Action.REJECT:
        assert error is not None
        error = with_next_step(error, subject.kind, effect.payload_digest, wanted_approval(effect))
        code = error.code
        rejected = LogRecord(
            "info",
            "effect.rejected",
            {"code": code, "reason": error.detail, "state": effect.state.value, **fields},
        )
        counted = Count(
            "effects", (subject.downstream, EFFECT_REFUSALS.get(code, code), effect.kind)
        )
        return _answer(subject, Refuse(error), code, effect, fields, rejected,
                       (*validation, counted))  # fmt: skip
    if prepared.action is Action.REPLAY:
        replayed = LogRecord("info", "effect.replayed", fields)
        counted = Count("effects", (subject.downstream, "replayed", effect.kind))
        return _answer(subject, Replay(effect), "REPLAY", effect, fields, replayed,
                       (*validation, counted))  # fmt: skip
    return Decision(
        Forward(effect, prepared.seq, fields),
        logs=(LogRecord("info", "effect.prepared", {"seq": prepared.seq, **fields}),),
        metrics=validation,
    )


def _refused(subject: Subject, error: FencegateError) -> Decision:
    """The store raised: the claim is gone (fenced, logged, shadowed when asked) or it could
    not decide (the error is the answer, with no log line here)."""
    claim_gone = isinstance(error, ClaimRefused)
    validation = _validation(subject, error.code, validated=claim_gone)
    if not claim_gone:
        return Decision(Refuse(error), metrics=validation)
    fenced = LogRecord(
        "info", "effect.fenced", {"code": error.code, "reason": error.detail, **subject.fields}
    )
    return _answer(subject, Refuse(error), error.code, None, subject.fields, fenced,
                   validation)  # fmt: skip


def _answer(
    subject: Subject,
    enforced: Refuse | Replay,
    code: str,
    effect: Effect | None,
    fields: Mapping[str, Any],
    logged: LogRecord,
    metrics: tuple[Metric, ...],
) -> Decision:
    """An answer without forwarding, or in shadow mode the forward it would have refused."""
    if not subject.shadow:
        return Decision(enforced, logs=(logged,), metrics=metrics)
    shadowed = LogRecord("warning", "effect.shadow_rejected", {"code": code, **fields})
    return Decision(
        ShadowForward(code, effect.effect_id if effect else None),
        logs=(logged, shadowed),
        metrics=(*metrics, Count("shadow_rejections", (POINT, code))),
    )
