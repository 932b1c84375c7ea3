"""Problem details say what to do next for the downstream's kind, with the exact command:
``fencegate effects reconcile`` where the gateway can ask the downstream (``probe``),
``fencegate effects resolve`` where it cannot (``http``, ``manual``...), ``fencegate effects
approve`` for an effect waiting for approval. The words are composed by a pure function
(tested here without a network) and reach the agent and the operator on both stores."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.proxy_decisions import next_step, with_next_step
from fencegate.ledger.errors import ApprovalRequired, EffectUnknown, Fenced
from tests.api import Api, Lease
from tests.clocks import still
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.test_proxy import Sent, fence_headers, task_with_lease

#: Protocol-layer rules, the same on every store: SQLite only (docs/stores.md).
pytestmark = pytest.mark.one_store

EID = "ab" * 32
RESOLVE = f"fencegate effects resolve {EID} --outcome COMMITTED|NOT_APPLIED --note '...'"
RECONCILE = f"fencegate effects reconcile {EID}"


@pytest.mark.parametrize("kind", ["http", "manual", "idempotent", "conditional"])
def test_a_kind_that_cannot_be_asked_is_resolved_by_hand(kind: str) -> None:
    step = next_step("EFFECT_UNKNOWN", EID, kind)
    assert step is not None and step.endswith(RESOLVE)
    assert "reconcile would refuse" in step and RECONCILE not in step


def test_a_probe_kind_is_reconciled() -> None:
    step = next_step("EFFECT_UNKNOWN", EID, "probe")
    assert step is not None and step.endswith(RECONCILE) and "resolve" not in step


def test_approval_names_the_command_and_the_digest() -> None:
    step = next_step("APPROVAL_REQUIRED", EID, "manual", "cd" * 32)
    assert step is not None
    assert step.endswith(
        f"fencegate effects approve {EID} --payload-digest {'cd' * 32} --note '...'"
    )


def test_other_codes_need_no_operator_and_the_stores_error_is_left_alone() -> None:
    assert next_step("PAYLOAD_CONFLICT", EID, "http") is None
    fenced = Fenced("gone")
    assert with_next_step(fenced, "http") is fenced
    unknown = EffectUnknown("an earlier forward of this effect has an unknown outcome",
                            effectId=EID, effectState="UNKNOWN")  # fmt: skip
    hinted = with_next_step(unknown, "manual")
    assert hinted is not unknown and unknown.detail.endswith("unknown outcome")
    assert hinted.detail.endswith(RESOLVE) and hinted.extra == unknown.extra
    assert with_next_step(hinted, "manual").detail == hinted.detail  # never twice
    waiting = ApprovalRequired("wait", effectId=EID)
    assert "fencegate effects approve" in with_next_step(waiting, "manual", "cd" * 32).detail


@pytest.fixture
async def api(store_url: str, key_prefix: str, downstream: Downstream) -> AsyncIterator[Api]:
    # Every forward here is ``/slow/400/...``: its answer is due 100 ms after the 300 ms timer
    # (both on the loop's clock, the answer's set later), so the timer always fires first;
    # the connect bound is far off, so a slow connect under load is still a timeout
    # (UNKNOWN), never an unreachable downstream.
    common = {"url": downstream.url, "timeout_ms": 300, "connect_timeout_ms": 10_000}
    config = make_config(
        store_url,
        key_prefix,
        downstreams=[
            {"name": "plain", **common},
            {"name": "mail", "adapter": "manual", **common},
            {"name": "gated", "adapter": "manual", "require_approval": True, **common},
            {
                "name": "orders",
                "adapter": "probe",
                **common,
                # The probe's answer is a 500: inconclusive, the effect stays UNKNOWN.
                "probe": {
                    "path": "/status/500",
                    "timeout_ms": 1_000,
                    "interval_ms": 60_000,
                    "max_interval_ms": 60_000,
                },
            },
        ],
        proxy={"prepared_margin_ms": 20_000, "forward_start_limit_ms": 10_000},
        reconciler={"enabled": False},
    )
    # The forward clock stands still and the start limit (then a real-time bound on the pool
    # wait and connect) is 10 s off: a loaded machine cannot trip it, which is not what these
    # tests are about.
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


async def call(api: Api, lease: Lease, downstream: str, path: str, slot: str) -> Sent:
    async with api.client.post(
        f"/proxy/{downstream}{path}", json={"n": 1}, headers=fence_headers(lease, slot)
    ) as resp:
        return Sent(resp.status, resp.headers, await resp.read())


async def lost(api: Api, lease: Lease, downstream: str) -> str:
    """An effect of ``downstream`` whose forward timed out (UNKNOWN); its id."""
    timed_out = await call(api, lease, downstream, "/slow/400/x", downstream)
    assert timed_out.code == "DOWNSTREAM_TIMEOUT", timed_out.body
    return str(timed_out.headers["Fence-Effect-Id"])


def detail(answer: Any) -> str:
    return str(answer["detail"])


@pytest.mark.parametrize("name", ["plain", "mail"])
async def test_an_unknown_effect_that_cannot_be_asked_says_resolve(api: Api, name: str) -> None:
    lease = await task_with_lease(api, f"t-{name}")
    effect_id = await lost(api, lease, name)
    command = f"fencegate effects resolve {effect_id} --outcome COMMITTED|NOT_APPLIED"
    again = await call(api, lease, name, "/slow/400/x", name)
    assert again.code == "EFFECT_UNKNOWN"
    assert command in detail(again.json) and "reconcile it first" not in detail(again.json)
    # The operator who tries reconcile anyway is told the same.
    refused = await api.call("POST", f"/v1/effects/{effect_id}/reconcile")
    assert refused.code == "EFFECT_UNKNOWN" and command in detail(refused.body)


async def test_an_unknown_effect_of_a_probe_downstream_says_reconcile(api: Api) -> None:
    lease = await task_with_lease(api, "t-orders")
    effect_id = await lost(api, lease, "orders")
    again = await call(api, lease, "orders", "/slow/400/x", "orders")
    assert again.code == "EFFECT_UNKNOWN"
    assert f"fencegate effects reconcile {effect_id}" in detail(again.json)
    assert "effects resolve" not in detail(again.json)


async def test_approval_required_names_the_approve_command(api: Api) -> None:
    lease = await task_with_lease(api, "t-gated")
    waiting = await call(api, lease, "gated", "/ok/send", "mail-1")
    assert waiting.code == "APPROVAL_REQUIRED"
    effect_id = waiting.headers["Fence-Effect-Id"]
    # The request carries a Content-Type: the command names its approval digest.
    digest = (await api.call("GET", f"/v1/effects/{effect_id}")).body["approvalDigest"]
    assert f"fencegate effects approve {effect_id} --approval-digest {digest}" in detail(
        waiting.json
    )
