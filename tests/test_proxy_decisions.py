"""The proxy's decisions as values, without a socket, a store or a clock.

``gateway.proxy_decisions`` says what the proxy does with a call once the store has answered
(refuse, replay, pass through, shadow-forward, forward) and which log lines and metric
increments go with it. The end-to-end tests (``test_operations.py``, ``test_proxy.py``) check
the same records as an operator sees them; these check every row of the decision table.
The stored response record (``ledger.responses``), which the proxy, the probe and the
operator's resolve all build, is pinned at the end.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import pytest

from fencegate.gateway.proxy_decisions import (
    Count,
    Decision,
    Forward,
    LogRecord,
    PassThrough,
    Refuse,
    Replay,
    ShadowForward,
    Subject,
    Validation,
    call_fields,
    decide_effect,
    decide_safe,
)
from fencegate.ledger.effects import (
    Action,
    Effect,
    EffectAttempt,
    EffectState,
    Fence,
    PrepareOutcome,
)
from fencegate.ledger.errors import (
    ApprovalRequired,
    BadRequest,
    EffectInFlight,
    EffectUnknown,
    Fenced,
    FencegateError,
    LeaseExpired,
    NoSuchTask,
    PayloadConflict,
    StoreUnavailable,
)
from fencegate.ledger.responses import response_json, response_record

FENCE = Fence("task-1", "attempt-1", claim_generation=3, scheduler_epoch=2, cancel_generation=0)
BASE = {
    "task": "task-1",
    "attempt": "attempt-1",
    "generation": 3,
    "epoch": 2,
    "downstream": "pay",
    "method": "POST",
    "kind": "leased",
}
MUTATION = {**BASE, "node": "main", "slot": "charge", "payload_digest": "d" * 64}
EFFECT_ID = "e" * 64


def subject(*, shadow: bool = False, fields: dict[str, Any] | None = None) -> Subject:
    return Subject("pay", MUTATION if fields is None else fields, shadow)


def effect(state: EffectState = EffectState.PREPARED, attempts: int = 1) -> Effect:
    return Effect(
        effect_id=EFFECT_ID,
        task_id="task-1",
        revision=1,
        node="main",
        slot="charge",
        downstream="pay",
        method="POST",
        path="/charges",
        payload_digest="d" * 64,
        state=state,
        created_at=1_000,
        updated_at=1_000,
        attempts=tuple(EffectAttempt("attempt-1", 3, 1_000) for _ in range(attempts)),
    )


def outcome(action: Action, error: FencegateError | None = None, **kw: Any) -> PrepareOutcome:
    return PrepareOutcome(action, effect(**kw), write=False, error=error)


def events(decision: Decision) -> list[str]:
    return [record.event for record in decision.logs]


# --- the call's log fields -----------------------------------------------------------------


def test_call_fields_name_the_claim_the_downstream_and_the_method_then_the_extras() -> None:
    assert call_fields(FENCE, "pay", "POST") == BASE
    fields = call_fields(FENCE, "pay", "POST", node="main", slot="charge", payload_digest="d" * 64)
    assert fields == MUTATION
    assert list(fields) == [*BASE, "node", "slot", "payload_digest"]


# --- safe methods: check_fence, then pass through --------------------------------------------


@pytest.mark.parametrize("shadow", [False, True])
def test_a_safe_method_whose_fence_holds_passes_through_unmarked(shadow: bool) -> None:
    decision = decide_safe(subject(shadow=shadow, fields=BASE), None)
    assert decision == Decision(PassThrough(), metrics=(Validation("proxy", None, True),))


@pytest.mark.parametrize("error", [Fenced("claim 4 holds the task"), LeaseExpired(), NoSuchTask()])
def test_a_gone_claim_is_refused_and_logged_as_fenced(error: FencegateError) -> None:
    decision = decide_safe(subject(fields=BASE), error)
    assert decision.act == Refuse(error)
    assert decision.logs == (
        LogRecord("info", "effect.fenced", {"code": error.code, "reason": error.detail, **BASE}),
    )
    assert decision.metrics == (Validation("proxy", error.code, True),)


def test_shadow_mode_forwards_a_gone_claim_marked_and_counts_it() -> None:
    error = Fenced("claim 4 holds the task")
    decision = decide_safe(subject(shadow=True, fields=BASE), error)
    assert decision.act == ShadowForward("FENCED", None)
    assert decision.logs[1] == LogRecord(
        "warning", "effect.shadow_rejected", {"code": "FENCED", **BASE}
    )
    assert events(decision) == ["effect.fenced", "effect.shadow_rejected"]
    assert decision.metrics == (
        Validation("proxy", "FENCED", True),
        Count("shadow_rejections", ("proxy", "FENCED")),
    )


@pytest.mark.parametrize("shadow", [False, True])
@pytest.mark.parametrize("error", [StoreUnavailable("redis: timeout"), BadRequest("no")])
def test_an_error_that_is_not_a_gone_claim_is_the_answer_even_in_shadow_mode(
    error: FencegateError, shadow: bool
) -> None:
    """The store could not decide: nothing was validated, nothing is let through, and the
    caller's own log line (if any) says why; the decision adds none."""
    for decision in (
        decide_safe(subject(shadow=shadow, fields=BASE), error),
        decide_effect(subject(shadow=shadow), error),
    ):
        assert decision == Decision(
            Refuse(error), metrics=(Validation("proxy", error.code, False),)
        )


def test_a_prepare_that_raised_a_gone_claim_logs_the_mutation_fields() -> None:
    error = LeaseExpired()
    decision = decide_effect(subject(), error)
    assert decision.act == Refuse(error)
    assert decision.logs[0].fields == {
        "code": "LEASE_EXPIRED",
        "reason": error.detail,
        **MUTATION,
    }
    assert "effect_id" not in decision.logs[0].fields


# --- mutations: the prepare's outcome ------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "label"),
    [
        (PayloadConflict(), "conflict"),
        (EffectInFlight(retryAfterMs=1500), "in_flight"),
        (EffectUnknown(), "unknown_refused"),
        (ApprovalRequired(), "approval_required"),
        (FencegateError("a code the counter has no name for"), "INTERNAL"),
    ],
)
def test_a_rejected_prepare_is_refused_and_counted_under_its_refusal_name(
    error: FencegateError, label: str
) -> None:
    decision = decide_effect(subject(), outcome(Action.REJECT, error, state=EffectState.UNKNOWN))
    assert decision.act == Refuse(error)
    assert decision.logs == (
        LogRecord(
            "info",
            "effect.rejected",
            {
                "code": error.code,
                "reason": error.detail,
                "state": "UNKNOWN",
                **MUTATION,
                "effect_id": EFFECT_ID,
            },
        ),
    )
    assert decision.metrics == (
        Validation("proxy", error.code, True),
        Count("effects", ("pay", label, "leased")),
    )


def test_shadow_mode_forwards_a_rejected_prepare_with_the_effects_identity() -> None:
    error = PayloadConflict()
    decision = decide_effect(subject(shadow=True), outcome(Action.REJECT, error))
    assert decision.act == ShadowForward("PAYLOAD_CONFLICT", EFFECT_ID)
    assert events(decision) == ["effect.rejected", "effect.shadow_rejected"]
    assert decision.logs[1].fields == {
        "code": "PAYLOAD_CONFLICT",
        **MUTATION,
        "effect_id": EFFECT_ID,
    }
    assert decision.metrics[-1] == Count("shadow_rejections", ("proxy", "PAYLOAD_CONFLICT"))


def test_a_committed_effect_is_replayed() -> None:
    prepared = outcome(Action.REPLAY, state=EffectState.COMMITTED)
    decision = decide_effect(subject(), prepared)
    assert decision == Decision(
        Replay(prepared.effect),
        logs=(LogRecord("info", "effect.replayed", {**MUTATION, "effect_id": EFFECT_ID}),),
        metrics=(Validation("proxy", None, True), Count("effects", ("pay", "replayed", "leased"))),
    )


def test_shadow_mode_forwards_a_replay_as_a_shadow_rejection_named_replay() -> None:
    decision = decide_effect(
        subject(shadow=True), outcome(Action.REPLAY, state=EffectState.COMMITTED)
    )
    assert decision.act == ShadowForward("REPLAY", EFFECT_ID)
    assert events(decision) == ["effect.replayed", "effect.shadow_rejected"]
    assert decision.metrics == (
        Validation("proxy", None, True),
        Count("effects", ("pay", "replayed", "leased")),
        Count("shadow_rejections", ("proxy", "REPLAY")),
    )


@pytest.mark.parametrize("shadow", [False, True])
def test_a_prepared_effect_is_forwarded_and_recorded_in_both_modes(shadow: bool) -> None:
    """Shadow mode only lets through what enforce mode would refuse: a forward it would make
    is recorded exactly as in enforce mode."""
    prepared = outcome(Action.FORWARD, attempts=3)
    decision = decide_effect(subject(shadow=shadow), prepared)
    fields = {**MUTATION, "effect_id": EFFECT_ID}
    assert decision == Decision(
        Forward(prepared.effect, 2, fields),
        logs=(LogRecord("info", "effect.prepared", {"seq": 2, **fields}),),
        metrics=(Validation("proxy", None, True),),
    )


def test_deciding_leaves_the_callers_fields_alone() -> None:
    fields = dict(MUTATION)
    decide_effect(subject(shadow=True, fields=fields), outcome(Action.REPLAY))
    decide_effect(subject(fields=fields), outcome(Action.FORWARD))
    assert fields == MUTATION


@pytest.mark.parametrize("shadow", [False, True])
@pytest.mark.parametrize("action", list(Action))
def test_only_a_forward_or_a_shadow_forward_leaves_the_gateway(
    action: Action, shadow: bool
) -> None:
    error = PayloadConflict() if action is Action.REJECT else None
    act = decide_effect(subject(shadow=shadow), outcome(action, error)).act
    if action is Action.FORWARD:
        assert isinstance(act, Forward)
    elif shadow:
        assert isinstance(act, ShadowForward)
    else:
        assert isinstance(act, Refuse | Replay)


# --- the stored response record (ledger.responses) ----------------------------------------


def test_a_kept_body_is_stored_with_its_size_digest_and_bytes() -> None:
    body = b'{"id": "ch_1"}'
    record = response_record(201, [("Content-Type", "application/json")], body)
    assert record == {
        "status": 201,
        "headers": [["Content-Type", "application/json"]],
        "bodySize": len(body),
        "bodyDigest": hashlib.sha256(body).hexdigest(),
        "bodyBase64": base64.b64encode(body).decode(),
    }
    assert list(record) == ["status", "headers", "bodySize", "bodyDigest", "bodyBase64"]


def test_a_body_too_large_to_keep_is_marked_omitted() -> None:
    assert response_record(200, [["X-A", "1"]], None) == {
        "status": 200,
        "headers": [["X-A", "1"]],
        "bodyOmitted": True,
    }


def test_the_json_is_the_record_with_its_source_last() -> None:
    text = response_json(200, [], b"", source="probe")
    assert text == (
        '{"status": 200, "headers": [], "bodySize": 0, "bodyDigest": '
        f'"{hashlib.sha256(b"").hexdigest()}", "bodyBase64": "", "source": "probe"}}'
    )
    assert json.loads(text)["source"] == "probe"
