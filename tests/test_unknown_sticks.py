"""At most once (issue 9, items 2 and 4): once a forward may have executed, the effect stays
UNKNOWN until it commits, an operator resolves it, or a probe settles it.

Item 2: a later attempt that certainly did not execute (connection refused, a status the
downstream's ``outcomes.not_applied`` names, a prepare the gateway aborted) says nothing about
the EARLIER attempt, so it must not turn the effect NOT_APPLIED: that would let the same
effect go out again, after the downstream's deduplication window, as a second execution.

Item 4: a ``conditional`` downstream re-sends an UNKNOWN effect only when the request carries
a precondition (``If-Match`` / ``If-None-Match``); without one a second delivery is a second
write.

Every story counts executions AT THE DOWNSTREAM (``tests/late_servers.py``), which loses the
answer of the forward that executed (UNKNOWN however loaded the machine) and forgets
idempotency keys after a window on its own clock; the gateway's window is on the store's clock.
The test moves both clocks, never waits them out. Every store.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway import failpoints
from fencegate.gateway.app import create_app
from fencegate.gateway.config import Config
from fencegate.ledger import effects
from fencegate.ledger.effects import (
    Action,
    Effect,
    EffectAttempt,
    EffectRequest,
    EffectState,
    Fence,
)
from fencegate.ledger.store import Store
from fencegate.ledger.tasks import ClaimRequest
from tests.api import Api, Lease
from tests.clocks import ManualClock
from tests.conftest import build_test_store, make_config
from tests.late_servers import LateServers
from tests.test_adapters import call, record

#: Only bounds a hang: the downstream loses its answers by closing the connection at once.
TIMEOUT_MS = 10_000
#: The downstream's deduplication window, and the gateway's ``dedupe_window_ms`` (equal):
#: store time and the downstream's clock, both moved by the test.
WINDOW_MS = 20_000
MARGIN_MS = 10_000
#: Wide (a loaded machine may start a forward late); the forward clock stands still anyway,
#: until a test moves it past this limit.
START_LIMIT_MS = 5_000
#: The leases outlive every move of the store's clock.
TTL_MS = 60_000
CHARGE = {"amount": 100}


def late_config(store_url: str, key_prefix: str, late: LateServers) -> Config:
    common = {"url": late.url, "timeout_ms": TIMEOUT_MS}
    downstreams: list[dict[str, Any]] = [
        {"name": "charges", "adapter": "idempotent", "dedupe_window_ms": WINDOW_MS, **common},
        {
            "name": "charges-busy",
            "adapter": "idempotent",
            "dedupe_window_ms": WINDOW_MS,
            "outcomes": {"not_applied": [503]},
            **common,
        },
        {"name": "plain", **common},
        {"name": "docs", "adapter": "conditional", **common},
    ]
    return make_config(
        store_url,
        key_prefix,
        downstreams=downstreams,
        proxy={"prepared_margin_ms": MARGIN_MS, "forward_start_limit_ms": START_LIMIT_MS},
        reconciler={"enabled": False},
    )


@pytest.fixture
async def late() -> AsyncIterator[LateServers]:
    server = await LateServers(dedupe_window_ms=WINDOW_MS).listen()
    yield server
    await server.close()


@pytest.fixture
def forward_clock() -> ManualClock:
    """The gateway's forward window clock: it stands still unless a test stalls the gateway."""
    return ManualClock()


@pytest.fixture
async def api(
    store_url: str, key_prefix: str, late: LateServers, forward_clock: ManualClock
) -> AsyncIterator[Api]:
    config = late_config(store_url, key_prefix, late)
    app = create_app(config, store=build_test_store(config), forward_clock=forward_clock.now)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


async def take_over(api: Api, lease: Lease, owner: str = "B") -> Lease:
    """Another worker takes the task over (A hands it back)."""
    assert (await api.release(lease)).status == 200
    return await api.claim(lease.task_id, owner, ttl_ms=TTL_MS)


async def lost_charge(api: Api, late: LateServers, target: str) -> tuple[Lease, str]:
    """A's charge executes at the downstream, whose answer is lost."""
    await api.put("t1")
    a = await api.claim("t1", "A", ttl_ms=TTL_MS)
    late.lose_answers = True
    lost = await call(api, a, "POST", target, body=CHARGE)
    late.lose_answers = False
    assert lost.status == 504 and lost.headers["Fence-Effect-State"] == "UNKNOWN"
    effect_id = lost.headers["Fence-Effect-Id"]
    assert late.executed == [effect_id]  # executed before the connection closed
    return a, effect_id


async def past_both_windows(api: Api, late: LateServers, effect_id: str) -> None:
    """Move the gateway's window (store time, from the effect's creation) and the
    downstream's (from its first sight of the key) past their end: from here on, a re-send
    of the key would execute the charge again."""
    created_at = (await record(api, effect_id))["createdAt"]
    api.advance(WINDOW_MS)
    late.clock.advance(WINDOW_MS / 1000)
    assert await api.store.now_ms() >= created_at + WINDOW_MS
    assert not late.remembers(effect_id)


async def after_the_window_nothing_goes_out(api: Api, late: LateServers, lease: Lease,
                                            target: str, effect_id: str) -> None:  # fmt: skip
    await past_both_windows(api, late, effect_id)
    b = await take_over(api, lease)
    received = late.received["charges"]
    retry = await call(api, b, "POST", target, body=CHARGE)
    assert retry.status == 409 and retry.code == "EFFECT_UNKNOWN", retry.body
    assert retry.headers["Fence-Effect-State"] == "UNKNOWN"
    other = await call(api, b, "POST", target, body={"amount": 999})
    assert other.status == 422 and other.code == "PAYLOAD_CONFLICT", other.body
    assert late.received["charges"] == received  # neither was forwarded
    assert late.executed == [effect_id]  # charged exactly once


# --- item 2: a later NOT_APPLIED does not undo an earlier UNKNOWN -------------------------------


async def test_refused_resend_inside_the_window_leaves_the_effect_unknown(
    api: Api, late: LateServers
) -> None:
    a, effect_id = await lost_charge(api, late, "charges/charges")
    await late.stop_listening()
    # Inside the window the idempotent adapter re-sends under the original key, and finds
    # the downstream down: this attempt certainly did nothing, the first one did.
    refused = await call(api, a, "POST", "charges/charges", body=CHARGE)
    assert refused.status == 502 and refused.code == "DOWNSTREAM_UNREACHABLE", refused.body
    assert refused.headers["Fence-Effect-State"] == "UNKNOWN"
    assert effects.EARLIER_UNKNOWN in refused.json["detail"]
    rec = await record(api, effect_id)
    assert rec["state"] == "UNKNOWN"
    assert [x["outcome"] for x in rec["attempts"]] == ["UNKNOWN", "NOT_APPLIED"]
    assert rec["attempts"][1]["reason"].startswith("connect failed")
    assert rec["attempts"][1]["startedAt"] < rec["createdAt"] + WINDOW_MS  # it was a re-send
    # The downstream comes back with its memory; its window then closes.
    await late.listen()
    await after_the_window_nothing_goes_out(api, late, a, "charges/charges", effect_id)
    assert late.received["charges"] == 1


async def test_not_applied_status_override_after_unknown_leaves_the_effect_unknown(
    api: Api, late: LateServers
) -> None:
    a, effect_id = await lost_charge(api, late, "charges-busy/charges")
    late.unavailable = True
    busy = await call(api, a, "POST", "charges-busy/charges", body=CHARGE)
    # The downstream's 503 is passed on; the configured outcome says this attempt did nothing.
    assert busy.status == 503 and busy.headers["Fence-Effect-State"] == "UNKNOWN"
    late.unavailable = False
    rec = await record(api, effect_id)
    assert rec["state"] == "UNKNOWN"
    assert [x["outcome"] for x in rec["attempts"]] == ["UNKNOWN", "NOT_APPLIED"]
    assert rec["attempts"][1]["reason"] == "status 503 (configured outcome)"
    await after_the_window_nothing_goes_out(api, late, a, "charges-busy/charges", effect_id)
    assert late.received["charges"] == 2  # the lost one and the 503


async def test_aborted_resend_through_the_proxy_leaves_the_effect_unknown(
    api: Api, late: LateServers, forward_clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway stalls between the re-send's prepare and its first byte, past the forward
    start limit: it aborts the re-send (``effects.abort``), which forwarded nothing."""
    a, effect_id = await lost_charge(api, late, "charges/charges")

    async def stall(point: str) -> None:
        if point == "after_prepare":  # the stall, on the forward window's clock
            forward_clock.advance((START_LIMIT_MS + 1) / 1000)

    monkeypatch.setattr(failpoints, "hit", stall)
    aborted = await call(api, a, "POST", "charges/charges", body=CHARGE)
    monkeypatch.undo()
    assert aborted.status == 503 and aborted.code == "STORE_UNAVAILABLE", aborted.body
    assert aborted.headers["Fence-Effect-State"] == "UNKNOWN"
    rec = await record(api, effect_id)
    assert rec["state"] == "UNKNOWN"
    assert [x["outcome"] for x in rec["attempts"]] == ["UNKNOWN", "NOT_APPLIED"]
    assert rec["attempts"][1]["reason"] == effects.LATE_REASON
    await after_the_window_nothing_goes_out(api, late, a, "charges/charges", effect_id)
    assert late.received["charges"] == 1


def _request(fence: Fence, forward_id: str) -> EffectRequest:
    return EffectRequest(
        fence, "main", "s1", "charges", "POST", "/charges", "digest-1", forward_id=forward_id
    )


@pytest.mark.parametrize("after_deadline", [False, True], ids=["prepared", "past-deadline"])
async def test_abort_after_an_unknown_attempt_through_the_store(
    store: Store, after_deadline: bool
) -> None:
    await store.put_task("t1", "in-1", None)
    task = await store.claim("t1", ClaimRequest(owner="w1", ttl_ms=60_000, scheduler_epoch=1))
    assert task.attempt_id is not None
    fence = Fence("t1", task.attempt_id, task.claim_generation, 1, task.cancel_generation)
    window, deadline = 5_000, TIMEOUT_MS + MARGIN_MS

    first = await store.prepare_effect(_request(fence, "f1"), deadline, resend_window_ms=window)
    assert first.action is Action.FORWARD
    effect_id = first.effect.effect_id
    done, applied = await store.complete_effect(
        "t1", effect_id, 0, task.attempt_id, EffectState.UNKNOWN, "timed out", None
    )
    assert applied and done.state is EffectState.UNKNOWN
    resend = await store.prepare_effect(_request(fence, "f2"), deadline, resend_window_ms=window)
    assert resend.action is Action.FORWARD and resend.seq == 1
    if after_deadline:  # the record now reads UNKNOWN ("deadline passed"); abort still applies
        store.clock_offset_ms += deadline
    aborted = await store.update_effect(
        effect_id, lambda record, now: effects.abort(record, "f2", now)
    )
    assert aborted.state is EffectState.UNKNOWN
    stored = await store.get_effect(effect_id)
    assert stored.state is EffectState.UNKNOWN
    assert [x.outcome for x in stored.attempts] == ["UNKNOWN", "NOT_APPLIED"]
    assert stored.attempts[1].reason == effects.ABORT_REASON
    assert (await store.gauges()).unknown_effects == 1
    # Past the re-send window the effect is refused, not forwarded again.
    store.clock_offset_ms += window
    later = await store.prepare_effect(_request(fence, "f3"), deadline, resend_window_ms=window)
    assert later.action is Action.REJECT
    assert later.error is not None and later.error.code == "EFFECT_UNKNOWN"


# --- the rule does not make effects stuck -----------------------------------------------------


async def test_operator_resolve_not_applied_resets_the_history(api: Api, late: LateServers) -> None:
    """The first create was lost before it applied (the queue dropped it) and its answer never
    came; an operator checks, resolves NOT_APPLIED, and from then on a refused connect leaves
    the effect NOT_APPLIED, so it can go again."""
    await api.put("t1")
    a = await api.claim("t1", "A", ttl_ms=TTL_MS)
    late.lose_answers, late.queue = True, "drop"
    lost = await call(api, a, "POST", "plain/orders", body={"item": "book"})
    assert lost.status == 504
    effect_id = lost.headers["Fence-Effect-Id"]
    late.lose_answers, late.queue = False, "apply"
    assert (await call(api, a, "POST", "plain/orders", body={"item": "book"})).status == 409
    # The operator knows the queue dropped it, so it cannot land later: force (settle_ms has
    # not passed yet, tests/test_resolve_landing.py).
    resolved = await api.call(
        "POST",
        f"/v1/effects/{effect_id}/resolve",
        {"outcome": "NOT_APPLIED", "note": "no order", "force": True},
    )
    assert resolved.status == 200 and resolved.body["state"] == "NOT_APPLIED"

    await late.stop_listening()
    refused = await call(api, a, "POST", "plain/orders", body={"item": "book"})
    assert refused.status == 502 and refused.headers["Fence-Effect-State"] == "NOT_APPLIED"
    rec = await record(api, effect_id)
    assert rec["state"] == "NOT_APPLIED"
    assert [x["outcome"] for x in rec["attempts"]] == ["UNKNOWN", "NOT_APPLIED"]

    await late.listen()
    sent = await call(api, a, "POST", "plain/orders", body={"item": "book"})
    assert sent.status == 202 and sent.headers["Fence-Effect-State"] == "COMMITTED"
    assert late.order_creates == 1
    again = await call(api, a, "POST", "plain/orders", body={"item": "book"})
    assert again.status == 202 and again.headers["Fence-Replayed"] == "true"
    assert late.order_creates == 1 and late.received["orders"] == 2


# --- item 4: conditional re-sends only with a precondition -------------------------------------


@pytest.mark.parametrize("method", ["PATCH", "PUT", "POST"])
async def test_conditional_without_a_precondition_is_never_resent(
    api: Api, late: LateServers, method: str
) -> None:
    late.docs["d"] = (b"v1", '"v1"')
    await api.put("t1")
    a = await api.claim("t1", "A")
    late.lose_answers = True
    lost = await call(api, a, method, "docs/docs/d", data=b"v2")
    late.lose_answers = False
    assert lost.status == 504 and lost.headers["Fence-Effect-State"] == "UNKNOWN"
    assert late.doc_writes == 1
    b = await take_over(api, a)
    retry = await call(api, b, method, "docs/docs/d", data=b"v2")
    assert retry.status == 409 and retry.code == "EFFECT_UNKNOWN", retry.body
    assert late.received["docs"] == 1 and late.doc_writes == 1
    rec = await record(api, lost.headers["Fence-Effect-Id"])
    assert rec["state"] == "UNKNOWN" and len(rec["attempts"]) == 1


@pytest.mark.parametrize("precondition", ["If-Match", "If-None-Match"])
async def test_conditional_with_a_precondition_is_resent_and_its_412_commits(
    api: Api, late: LateServers, precondition: str
) -> None:
    if precondition == "If-Match":
        late.docs["d"] = (b"v1", '"v1"')
        headers = {"If-Match": '"v1"'}
    else:
        headers = {"If-None-Match": "*"}
    await api.put("t1")
    a = await api.claim("t1", "A")
    late.lose_answers = True
    lost = await call(api, a, "PATCH", "docs/docs/d", data=b"v2", headers=headers)
    late.lose_answers = False
    assert lost.status == 504
    assert late.doc_writes == 1
    b = await take_over(api, a)
    retry = await call(api, b, "PATCH", "docs/docs/d", data=b"v2", headers=headers)
    # Re-sent; the downstream refuses the second write, which shows the first one landed.
    assert retry.status == 412 and retry.headers["Fence-Effect-State"] == "COMMITTED"
    assert late.received["docs"] == 2 and late.doc_writes == 1
    assert late.docs["d"][0] == b"v2"
    rec = await record(api, lost.headers["Fence-Effect-Id"])
    assert rec["attempts"][-1]["reason"].startswith("status 412 after an UNKNOWN attempt")
    again = await call(api, b, "PATCH", "docs/docs/d", data=b"v2", headers=headers)
    assert again.status == 412 and again.headers["Fence-Replayed"] == "true"
    assert late.received["docs"] == 2


# --- the pure model ---------------------------------------------------------------------------


def _attempt(i: int, outcome: str | None) -> EffectAttempt:
    started = 1_000 * (i + 1)
    return EffectAttempt(
        f"att-{i}",
        i + 1,
        started,
        ended_at=None if outcome is None else started + 300,
        outcome=outcome,
        reason=None if outcome is None else "test",
        forward_id=f"f{i}",
    )


def _effect(*outcomes: str | None, settled: int = 0) -> Effect:
    """A record whose attempts ended with ``outcomes``; a trailing None is a forward in
    flight (PREPARED)."""
    attempts = tuple(_attempt(i, o) for i, o in enumerate(outcomes))
    in_flight = bool(attempts) and attempts[-1].outcome is None
    state = EffectState.PREPARED if in_flight else EffectState(outcomes[-1] or "NOT_APPLIED")
    return Effect(
        effect_id="e" * 64,
        task_id="t1",
        revision=1,
        node="main",
        slot="s1",
        downstream="charges",
        method="POST",
        path="/charges",
        payload_digest="d",
        state=state,
        created_at=1_000,
        updated_at=1_000,
        deadline_at=attempts[-1].started_at + 10_000 if in_flight else None,
        attempts=attempts,
        settled_attempts=settled,
    )


def _complete(effect: Effect, outcome: EffectState) -> Effect:
    seq = len(effect.attempts) - 1
    done, applied = effects.complete(
        effect, seq, effect.attempts[seq].attempt_id, outcome, "test", None, 20_000
    )
    assert applied
    return done


@pytest.mark.parametrize(
    ("history", "outcome", "expected"),
    [
        (("UNKNOWN",), "NOT_APPLIED", "UNKNOWN"),
        (("UNKNOWN", "NOT_APPLIED"), "NOT_APPLIED", "UNKNOWN"),
        (("UNKNOWN",), "COMMITTED", "COMMITTED"),
        (("UNKNOWN",), "UNKNOWN", "UNKNOWN"),
        ((), "NOT_APPLIED", "NOT_APPLIED"),
        (("NOT_APPLIED",), "NOT_APPLIED", "NOT_APPLIED"),
    ],
)
def test_state_after_a_forward(history: tuple[str, ...], outcome: str, expected: str) -> None:
    effect = _effect(*history, None)
    assert _complete(effect, EffectState(outcome)).state.value == expected


def test_abort_pure() -> None:
    after_unknown = _effect("UNKNOWN", None)
    aborted = effects.abort(after_unknown, "f1", 2_100)
    assert aborted.state is EffectState.UNKNOWN
    assert aborted.attempts[-1].outcome == "NOT_APPLIED"
    assert aborted.attempts[-1].reason == effects.ABORT_REASON
    # Past its deadline the re-send reads UNKNOWN itself; the abort still leaves UNKNOWN.
    deadline = after_unknown.deadline_at
    assert deadline is not None
    assert effects.abort(after_unknown, "f1", deadline + 1).state is EffectState.UNKNOWN
    # The rule is about the history, not the abort: a first forward aborted is NOT_APPLIED,
    # and so is one after an operator settled the earlier attempt.
    assert effects.abort(_effect(None), "f0", 1_100).state is EffectState.NOT_APPLIED
    settled = _effect("UNKNOWN", None, settled=1)
    assert effects.abort(settled, "f1", 2_100).state is EffectState.NOT_APPLIED


def test_history_is_judged_anew_after_each_settlement() -> None:
    unknown = _effect("UNKNOWN")
    resolved = effects.resolve(unknown, EffectState.NOT_APPLIED, "checked", "op", None, 5_000)
    assert resolved.settled_attempts == 1
    # A refused connect after the resolve: NOT_APPLIED (may go again).
    refused = _complete(_with_forward(resolved, 1), EffectState.NOT_APPLIED)
    assert refused.state is EffectState.NOT_APPLIED
    # Then a forward that may have executed, then a refused one: UNKNOWN again.
    lost = _complete(_with_forward(refused, 2), EffectState.UNKNOWN)
    again = _complete(_with_forward(lost, 3), EffectState.NOT_APPLIED)
    assert again.state is EffectState.UNKNOWN
    # An operator resolving COMMITTED does not move the mark (nothing may go again anyway).
    committed = effects.resolve(again, EffectState.COMMITTED, "it did", "op", None, 9_000)
    assert committed.settled_attempts == 1
    # The mark survives the store's flat representation.
    fields = effects.effect_to_fields(resolved)
    assert effects.effect_from_fields(fields).settled_attempts == 1


def _with_forward(effect: Effect, i: int) -> Effect:
    attempt = replace(_attempt(i, None), started_at=6_000 + 1_000 * i)
    return replace(
        effect,
        state=EffectState.PREPARED,
        deadline_at=attempt.started_at + 10_000,
        attempts=(*effect.attempts, attempt),
    )
