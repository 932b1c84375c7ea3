"""The answer models (gateway/answers.py) send the bytes the handlers sent as dicts.

The records come from the ledger's own transitions (a probe that came too early, a forced
NOT_APPLIED, an approval, a probe that found the effect, a stored body too large to keep), so
the action trail and the stored responses have the shapes their writers give them; each
answer is compared, as ``json.dumps`` writes it, with ``task_to_json`` / ``effect_to_json``
below: the dicts the handlers built before the models, kept here, frozen, as the wire's
reference (the gateway and the console now build both records from the models only). A
stored record that does not fit the models (a newer gateway's, on a shared store) is sent as
it was stored, and every ``of`` sets every member its model declares (``model_construct``
would drop a misspelt one).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from pydantic import BaseModel

from fencegate.gateway import answers
from fencegate.ledger import effects, requests, responses
from fencegate.ledger.effects import Effect, EffectAttempt, EffectState, ProbeVerdict
from fencegate.ledger.events import effect_event, task_event
from fencegate.ledger.queries import Gauges
from fencegate.ledger.retention import StoreStats
from fencegate.ledger.tasks import Commit, DepCommit, Scheduler, Task, TaskState

SETTLE_MS = 60_000


# --- the dict forms the handlers sent before the models (the reference, not used by the gateway)


def task_to_json(task: Task) -> dict[str, Any]:
    """The task record of the wire contract (``GET /v1/tasks/{id}``).

    ``schedulerEpoch`` is the epoch the current claim was granted under (null before the
    first claim); the global epoch is ``GET /v1/epoch``.
    """
    done: dict[str, Any] | None = None
    if task.commit is not None:
        c = task.commit
        done = {
            "commitId": c.commit_id,
            "attemptId": c.attempt_id,
            "claimGeneration": c.claim_generation,
            "resultDigest": c.result_digest,
            "committedAt": c.committed_at,
        }
        if c.result_json is not None:
            done["result"] = json.loads(c.result_json)
    return {
        "taskId": task.task_id,
        "state": task.state.value,
        "revision": task.revision,
        "inputDigest": task.input_digest,
        "maxRuntimeMs": task.max_runtime_ms,
        "claimGeneration": task.claim_generation,
        "attemptId": task.attempt_id,
        "owner": task.owner,
        "principal": task.principal,
        "leaseExpiresAt": task.lease_expires_at,
        "attemptStartedAt": task.attempt_started_at,
        "cancelGeneration": task.cancel_generation,
        "schedulerEpoch": task.claim_epoch,
        "commit": done,
        "createdAt": task.created_at,
        "updatedAt": task.updated_at,
        "queue": task.queue,
        "priority": task.priority,
        "dependsOn": list(task.depends_on),
        "dependencies": [
            {"taskId": c.task_id, "commitId": c.commit_id, "resultDigest": c.result_digest}
            for c in task.dep_commits
        ],
        "cost": dict(task.attempt_cost),
    }


def effect_to_json(effect: Effect) -> dict[str, Any]:
    """The ledger record of the contract (``GET /v1/effects/{effectId}``), plus the approval
    waiting to be used, the probe state and the operator actions."""
    approval = None
    wanted = effects.wanted_approval(effect)
    if effect.approval_digest is not None:
        approval = {
            "approvalDigest": effect.approval_digest,
            # The payload it covers: the record's, while the approval is for its request
            # (a record rebound to another request keeps the approval, for that one only).
            "payloadDigest": effect.payload_digest if effect.approval_digest == wanted else None,
            "by": effect.approval_by,
            "at": effect.approval_at,
            "expiresAt": effect.approval_expires_at,
        }
    return {
        "effectId": effect.effect_id,
        "kind": effect.kind,
        "taskId": effect.task_id,
        "revision": effect.revision,
        "node": effect.node,
        "slot": effect.slot,
        "principal": effect.principal,
        "idempotencyKey": effect.idempotency_key,
        "downstream": effect.downstream,
        "method": effect.method,
        "path": effect.path,
        "payloadDigest": effect.payload_digest,
        "approvalDigest": wanted,
        "requestedBy": effect.requested_by,
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
                "approvedBy": a.approved_by,
            }
            for a in effect.attempts
        ],
        "response": json.loads(effect.response_json) if effect.response_json else None,
        "approval": approval,
        "probes": {"count": effect.probe_count, "nextAt": effect.next_probe_at},
        "actions": json.loads(effect.actions_json) if effect.actions_json else [],
        "createdAt": effect.created_at,
        "updatedAt": effect.updated_at,
    }


def _bytes(data: Any) -> bytes:
    """What ``web.json_response`` sends for ``data``."""
    return json.dumps(data).encode()


def _tasks() -> list[Task]:
    fresh = Task("t-new", TaskState.WAITING, 1, "in-1", created_at=10, updated_at=10)
    claimed = Task(
        "t/claimed:1",
        TaskState.CLAIMED,
        3,
        "in-3",
        created_at=10,
        updated_at=50,
        max_runtime_ms=9_000,
        claim_generation=4,
        cancel_generation=1,
        attempt_id="a-4",
        owner="w1",
        principal="worker-a",
        lease_expires_at=90,
        attempt_started_at=40,
        claim_epoch=2,
        queue="q.1",
        priority=-7,
        depends_on=("d1", "d2"),
        dep_commits=(DepCommit("d1", "c-d1", "r-d1"), DepCommit("d2", "c-d2", "r-d2")),
        attempt_cost=(("tokens", 12.5), ("usd", 0.25)),
    )
    committed = replace(
        claimed,
        task_id="t-done",
        state=TaskState.COMMITTED,
        commit=Commit("c-1", "a-4", 4, "out", 60, result_json='{"b":[1,2.5,null],"a":"\\u00e9"}'),
    )
    without_result = replace(committed, task_id="t-done-2", commit=Commit("c-2", "a-4", 4, "o", 61))
    null_result = replace(
        committed, task_id="t-null", commit=Commit("c-3", "a", 1, "o", 62, "null")
    )
    return [fresh, claimed, committed, without_result, null_result]


def _unknown_effect() -> Effect:
    response = responses.response_json(504, [("Content-Type", "text/plain")], b"gateway timeout")
    return Effect(
        effect_id="ab" * 32,
        task_id="t1",
        revision=1,
        node="main",
        slot="pay",
        downstream="api",
        method="POST",
        path="/pay",
        payload_digest="cd" * 32,
        state=EffectState.UNKNOWN,
        created_at=100,
        updated_at=200,
        attempts=(EffectAttempt("a-1", 1, 100, ended_at=200, outcome="UNKNOWN", reason="t/o"),),
        response_json=response,
        requested_by="worker-a",
    )


def _effects() -> list[Effect]:
    """Records whose action trail and responses the ledger's transitions wrote."""
    start = _unknown_effect()
    probing = effects.begin_probe(start, "r1", 5_000, 1_000)
    # "absent" before the settle time: inconclusive, with askedAt and waitUntil.
    early = effects.finish_probe(
        probing, "r1", ProbeVerdict.ABSENT, None, 500, "reconciler", 1_100, SETTLE_MS, 1_050
    )
    forced = effects.resolution(
        early, EffectState.NOT_APPLIED, "checked", "alice", None, 1_200,
        settle_ms=SETTLE_MS, force=True,
    ).effect  # fmt: skip
    approved = effects.approve(forced, "bob", "ok once", None, 60_000, 1_300, "bob-principal")
    found_response = responses.response_json(
        200, [("Content-Type", "application/json")], b'{"ok": true}', source="probe"
    )
    found = effects.finish_probe(
        effects.begin_probe(start, "r2", 5_000, 1_000),
        "r2", ProbeVerdict.FOUND, found_response, 500, "reconciler", 1_100,
    )  # fmt: skip
    omitted = replace(
        found,
        effect_id="ef" * 32,
        response_json=responses.response_json(
            200,
            [("Content-Type", "application/json")],
            None,
            omitted_reason=responses.OMITTED_TOO_LARGE,
            summary={"isError": False, "resultType": "text"},
        ),
    )
    committed = effects.resolution(
        start, EffectState.COMMITTED, "seen it", "alice",
        responses.response_json(201, [("X-A", "1")], b"made"), 1_400,
    ).effect  # fmt: skip
    prepared = replace(start, state=EffectState.PREPARED, deadline_at=300, response_json=None)
    keyed = replace(
        committed,
        effect_id=effects.keyed_effect_id("carol", committed.downstream, "order-7"),
        task_id=None,
        revision=None,
        node=None,
        slot=None,
        principal="carol",
        idempotency_key="order-7",
    )
    return [start, early, forced, approved, found, omitted, committed, prepared, keyed]


def test_the_effects_hold_every_action_kind_and_response_form() -> None:
    """The records below cover what they claim to (else the comparisons prove less)."""
    actions = [a for e in _effects() if e.actions_json for a in json.loads(e.actions_json)]
    assert {"askedAt", "waitUntil"} <= set(actions[0])
    assert {(a["action"], "force" in a, "outcome" in a) for a in actions} >= {
        ("reconcile", False, False),
        ("resolve", True, True),
        ("approve", False, False),
        ("reconcile", False, True),
    }
    stored = [json.loads(e.response_json) for e in _effects() if e.response_json]
    assert {("bodyBase64" in r, "summary" in r, "source" in r) for r in stored} >= {
        (True, False, False),
        (True, False, True),
        (False, True, False),
    }


@pytest.mark.parametrize("task", _tasks(), ids=lambda task: task.task_id)
def test_task_answer_is_the_bytes_of_task_to_json(task: Task) -> None:
    assert _bytes(answers.Task.of(task).wire()) == _bytes(task_to_json(task))


@pytest.mark.parametrize("index", range(len(_effects())))
def test_effect_answer_is_the_bytes_of_effect_to_json(index: int) -> None:
    effect = _effects()[index]
    record = effect_to_json(effect)
    assert _bytes(answers.Effect.of(effect).wire()) == _bytes(record)
    resolved = answers.Resolved.of(effect, unchanged=True, warnings=["w"])
    assert _bytes(resolved.wire()) == _bytes({**record, "unchanged": True, "warnings": ["w"]})
    # An observer's view: the stored answer without its body and digest, then bodyWithheld.
    if isinstance(record["response"], dict):
        record["response"].pop("bodyBase64", None)
        record["response"].pop("bodyDigest", None)
        record["response"]["bodyWithheld"] = True
    withheld = answers.Effect.of(effect, withhold_body=True)
    assert _bytes(withheld.wire()) == _bytes(record)


def test_a_stored_record_that_fits_no_model_is_sent_as_stored() -> None:
    """A newer gateway sharing the store may write an action kind or a response member this
    one does not know, or a value of another type: the reader still gets all of it."""
    trail = [
        {"action": "escalate", "by": "carol", "at": 5, "to": "oncall", "note": "n"},
        {"action": "resolve", "by": "dave", "at": "yesterday", "outcome": "COMMITTED"},
        {"action": "approve", "by": "erin", "at": 7, "note": "", "scope": ["a", "b"]},
    ]
    response = {"status": 200, "headers": [["A", "1", "extra"]], "bodyOmitted": True}
    effect = replace(
        _unknown_effect(), actions_json=json.dumps(trail), response_json=json.dumps(response)
    )
    wire = answers.Effect.of(effect).wire()
    assert wire["actions"] == trail
    assert [list(action) for action in wire["actions"]] == [list(action) for action in trail]
    assert wire["response"] == response
    assert _bytes(wire) == _bytes(effect_to_json(effect))


@pytest.mark.parametrize(
    "event",
    [
        task_event("t1", TaskState.READY.value, "q", 2, 3, 40),
        task_event("t1", TaskState.CLAIMED.value, None, 1, 1, 41),
        effect_event("ab" * 32, "t1", EffectState.UNKNOWN.value, "api", 42),
        effect_event("cd" * 32, None, EffectState.COMMITTED.value, "pay", 43),
    ],
)
def test_the_event_schema_is_the_shape_the_stores_write(event: dict[str, Any]) -> None:
    """The stream relays events as the stores wrote them (``ledger.events`` is their one
    shape): the models the schema comes from hold exactly those members, in that order."""
    model = answers.Event.model_validate(event).root
    assert list(type(model).model_fields) == list(event)
    assert _bytes(model.wire()) == _bytes(event)


def _set_everywhere(model: BaseModel, where: str) -> None:
    """Every member ``model`` declares was set, in it and in every model nested in it."""
    missing = set(type(model).model_fields) - model.model_fields_set
    assert not missing, f"{where}: {sorted(missing)} never set"
    for name in model.model_fields_set:
        value = getattr(model, name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, answers.Answer) and type(item).__name__ not in _PARTIAL:
                _set_everywhere(item, f"{where}.{name}")


#: Records whose members depend on what happened (the stored response and the action
#: trail, which the ledger writes and the comparisons above hold to their writers).
_PARTIAL = {"StoredResponse", "KeptRequest", "ResolveAction", "ApproveAction", "ReconcileAction"}


def test_every_builder_sets_every_member_it_declares() -> None:
    tasks = _tasks()
    claimed, committed = tasks[1], tasks[2]
    _set_everywhere(answers.Task.of(committed), "Task")
    _set_everywhere(answers.ClaimGranted.of(claimed), "ClaimGranted")
    # With a kept request and what to look up (keep_request_bodies, gateway.forward.look_up).
    kept = requests.request_json([("A", "1")], b"{}", max_bytes=10)
    approved = replace(_effects()[3], request_json=kept)
    assert approved.approval_digest is not None
    shown = {"key_header": "Idempotency-Key", "look_up": "look it up"}
    _set_everywhere(answers.Effect.of(approved, **shown), "Effect")
    _set_everywhere(
        answers.Resolved.of(approved, unchanged=False, warnings=[], **shown), "Resolved"
    )
    _set_everywhere(answers.Scheduler.of(Scheduler(3, True)), "Scheduler")
    gauges = Gauges(active_leases=1, prepared_effects=2, unknown_effects=3, awaiting_approval=4)
    _set_everywhere(answers.Rollout.of(Scheduler(), gauges), "Rollout")
    stats = StoreStats(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, None, {"tasks": 12})
    _set_everywhere(answers.StoreStats.of(stats, 1_000, True), "StoreStats")
