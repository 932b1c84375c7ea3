"""Operator resolves are honest, on both stores: an identical repeat is a 200 that changes
nothing (``unchanged: true``, no second action, ``operator.resolve_unchanged``), anything
else on a settled effect is ``409 EFFECT_SETTLED`` saying what the record holds, and a
COMMITTED without any response warns what duplicates will get, which is exactly what a
duplicate through the proxy then gets (docs/decisions.md, "Resolve")."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs

from fencegate.gateway.app import create_app
from tests.api import Answer, Api
from tests.clocks import still
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.test_proxy import Sent, send, task_with_lease


@pytest.fixture
async def api(store_url: str, key_prefix: str, downstream: Downstream) -> AsyncIterator[Api]:
    config = make_config(
        store_url,
        key_prefix,
        # timeout_ms only bounds a hang: the lost answer is a connection the downstream
        # closes (``/reset``), UNKNOWN at once however loaded the machine.
        downstreams=[{"name": "api", "url": downstream.url, "timeout_ms": 10_000}],
        proxy={"prepared_margin_ms": 20_000, "forward_start_limit_ms": 10_000},
        reconciler={"enabled": False},
    )
    # The forward clock stands still and the start limit is wide: a loaded machine's slow
    # prepare or connect does not miss it, which is not what these tests are about.
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


#: The downstream reads the request and closes the connection without an answer.
LOST = "/reset/pay"


async def unknown_effect(api: Api, task_id: str) -> tuple[Any, str]:
    """A lease and an effect whose forward got no answer (the downstream read it, then closed
    the connection): UNKNOWN, no response recorded."""
    lease = await task_with_lease(api, task_id)
    lost = await send(api, lease, LOST, body={"amount": 1})
    assert lost.code == "DOWNSTREAM_TIMEOUT" and lost.headers["Fence-Effect-State"] == "UNKNOWN"
    return lease, lost.headers["Fence-Effect-Id"]


async def resolve(api: Api, effect_id: str, outcome: str, **body: Any) -> Answer:
    return await api.call(
        "POST", f"/v1/effects/{effect_id}/resolve", {"outcome": outcome, "note": "n", **body}
    )


def resolves(record: dict[str, Any]) -> int:
    return sum(1 for a in record["actions"] if a["action"] == "resolve")


async def test_committed_without_a_response_warns_and_a_repeat_changes_nothing(
    api: Api, downstream: Downstream
) -> None:
    lease, effect_id = await unknown_effect(api, "t-none")
    with capture_logs() as first_logs:
        first = await resolve(api, effect_id, "COMMITTED")
    assert first.status == 200, first.body
    assert first.body["unchanged"] is False
    assert first.body["state"] == "COMMITTED" and first.body["response"] is None
    [warning] = first.body["warnings"]
    assert "204" in warning and "Fence-Replay-Body: none" in warning
    [event] = [e for e in first_logs if e["event"].startswith("operator.resolve")]
    assert event["event"] == "operator.resolve" and event["empty_replay"] is True

    # A CLI retried after a lost answer: 200, nothing recorded, a different event.
    with capture_logs() as again_logs:
        again = await resolve(api, effect_id, "COMMITTED")
    assert again.status == 200 and again.body["unchanged"] is True
    assert again.body["warnings"] == first.body["warnings"]
    assert resolves(again.body) == 1
    assert [e["event"] for e in again_logs if e["event"].startswith("operator.")] == [
        "operator.resolve_unchanged"
    ]

    # A response where the first resolve gave none: refused, saying what the record holds.
    late = await resolve(api, effect_id, "COMMITTED", response={"status": 201, "body": "ok"})
    assert late.status == 409 and late.code == "EFFECT_SETTLED"
    assert "without a response" in late.body["detail"]
    assert "Z (resolvedAt " in late.body["detail"]  # the time also in ISO 8601
    other = await resolve(api, effect_id, "NOT_APPLIED")
    assert other.code == "EFFECT_SETTLED"
    record = await api.call("GET", f"/v1/effects/{effect_id}")
    assert resolves(record.body) == 1 and record.body["response"] is None

    # What the warning said is what two duplicates get, and the downstream is not called.
    before = len(downstream.received)
    duplicates = [await send(api, lease, LOST, body={"amount": 1}) for _ in "ab"]
    for duplicate in duplicates:
        assert duplicate.status == 204 and duplicate.body == b""
        assert duplicate.headers["Fence-Replay-Body"] == "none"
        assert duplicate.headers["Fence-Replayed"] == "true"
    assert len(downstream.received) == before


async def test_a_given_response_is_final_and_every_duplicate_replays_it(
    api: Api, downstream: Downstream
) -> None:
    lease, effect_id = await unknown_effect(api, "t-given")
    given = {"status": 201, "headers": {"X-A": "1", "Content-Type": "text/plain"}, "body": "ok"}
    first = await resolve(api, effect_id, "COMMITTED", response=given)
    assert first.status == 200 and first.body["unchanged"] is False
    assert first.body["warnings"] == []
    [action] = first.body["actions"]
    assert isinstance(action["response"], str)  # what was supplied, so identity is decidable

    # The same response (header order and name case do not matter) is a no-op...
    same = {**given, "headers": {"content-type": "text/plain", "x-a": "1"}}
    again = await resolve(api, effect_id, "COMMITTED", response=same)
    assert again.status == 200 and again.body["unchanged"] is True
    # ...a different one, or none at all, is refused.
    changed = await resolve(api, effect_id, "COMMITTED", response={**given, "body": "other"})
    assert changed.code == "EFFECT_SETTLED"
    assert "with the operator's response" in changed.body["detail"]
    assert (await resolve(api, effect_id, "COMMITTED")).code == "EFFECT_SETTLED"
    assert resolves((await api.call("GET", f"/v1/effects/{effect_id}")).body) == 1

    before = len(downstream.received)
    replays: list[Sent] = [await send(api, lease, LOST, body={"amount": 1}) for _ in "ab"]
    assert [(r.status, r.body, r.headers["X-A"]) for r in replays] == [(201, b"ok", "1")] * 2
    assert len(downstream.received) == before


async def test_not_applied_repeats_are_no_ops_and_take_no_response(api: Api) -> None:
    _, effect_id = await unknown_effect(api, "t-not")
    refused = await resolve(api, effect_id, "NOT_APPLIED", response={"status": 200})
    assert refused.status == 400 and "only with outcome COMMITTED" in refused.body["detail"]
    # force: within settle_ms of the timeout (tests/test_resolve_landing.py); a repeat without
    # it is still the same resolution.
    first = await resolve(api, effect_id, "NOT_APPLIED", force=True)
    assert first.body["unchanged"] is False and first.body["warnings"] == []
    again = await resolve(api, effect_id, "NOT_APPLIED")
    assert again.status == 200 and again.body["unchanged"] is True
    assert (await resolve(api, effect_id, "COMMITTED")).code == "EFFECT_SETTLED"


async def test_keeping_the_forwards_answer_says_so(api: Api) -> None:
    lease = await task_with_lease(api, "t-500")
    answered = await send(api, lease, "/status/500", body={"amount": 1})
    assert answered.status == 500 and answered.headers["Fence-Effect-State"] == "UNKNOWN"
    effect_id = answered.headers["Fence-Effect-Id"]
    first = await resolve(api, effect_id, "COMMITTED")
    [warning] = first.body["warnings"]
    assert "status 500" in warning
    refused = await resolve(api, effect_id, "COMMITTED", response={"status": 200})
    assert "keeping the forward's recorded answer (status 500)" in refused.body["detail"]


@pytest.mark.parametrize(
    "headers",
    [{"X-A": "1\r\nSet-Cookie: s=1"}, {"Bad Name": "1"}, {"X-A\r\nX-B": "1"}, {"X-A": "a\x00b"}],
    ids=["crlf-in-value", "space-in-name", "crlf-in-name", "nul-in-value"],
)
async def test_an_answer_no_replay_could_send_is_refused_before_it_is_stored(
    api: Api, downstream: Downstream, headers: dict[str, str]
) -> None:
    """aiohttp will not write a header with a line break (nor a name that is no HTTP token):
    stored, such an answer would turn every retry of the call into a 500."""
    lease, effect_id = await unknown_effect(api, "t-hostile")
    given = {"status": 200, "headers": headers, "body": "ok"}
    refused = await resolve(api, effect_id, "COMMITTED", response=given)
    assert refused.status == 400 and refused.code == "BAD_REQUEST", refused.body
    assert "response.headers" in refused.body["detail"], refused.body
    record = (await api.call("GET", f"/v1/effects/{effect_id}")).body
    assert record["state"] == "UNKNOWN" and resolves(record) == 0
    # A good answer still settles it, and the retry gets it.
    settled = await resolve(api, effect_id, "COMMITTED", response={**given, "headers": {}})
    assert settled.status == 200
    replay = await send(api, lease, LOST, body={"amount": 1})
    assert (replay.status, replay.body) == (200, b"ok")
