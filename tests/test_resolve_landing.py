"""An operator's NOT_APPLIED waits until no earlier forward can still land (issue 25).

A forward the gateway gave up on (a timeout, a lost answer, a gateway that died) may sit in
the downstream's queue and apply later. Until ``settle_ms`` after the gateway stopped waiting
for it (``ledger.effects.landing_until``, the probe's rule), "it did not happen" is not
believed from an operator either: ``resolve NOT_APPLIED`` is ``409 EFFECT_IN_FLIGHT`` with
``landingUntil`` and ``Retry-After``, unless forced (``{"force": true}``, recorded on the
action). COMMITTED is never refused. Time is the store's, moved by the test
(``clock_offset_ms``), never by sleeping; the late landing is a gate the test opens. A lost
answer is a connection the downstream closes once it has the request, so the forward is
UNKNOWN at once however loaded the machine (a timer could fire before the request arrived).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs

from fencegate.adapters.mcp import McpAdapter, ToolOverride
from fencegate.gateway.app import create_app
from fencegate.gateway.config import ConfigError, load_config
from fencegate.gateway.downstreams import build_adapter
from fencegate.gateway.ledger_api import settle_ms_of
from fencegate.ledger import effects
from fencegate.ledger.effects import Effect, EffectAttempt, EffectState
from fencegate.ledger.errors import EffectInFlight, EffectSettled
from fencegate.ledger.store import Store
from fencegate.ledger.tasks import ClaimRequest
from tests.api import Api, serve_app
from tests.clocks import still
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.test_proxy import Sent, send, task_with_lease

#: Only bounds a hang: the downstreams lose their answers by closing the connection at once.
TIMEOUT_MS = 10_000
#: ``api``'s settle_ms: far longer than any test runs in real time.
SETTLE_MS = 30_000
#: Not about the start limit: wide, and the forward clock stands still (``still``).
PROXY = {"prepared_margin_ms": 20_000, "forward_start_limit_ms": 10_000}

# --- the pure rule ----------------------------------------------------------------------------


def _attempt(started: int, ended: int | None, outcome: str | None) -> EffectAttempt:
    return EffectAttempt(
        f"att-{started}", 1, started, ended_at=ended, outcome=outcome,
        reason=None if outcome is None else "test", forward_id=f"f{started}",
    )  # fmt: skip


def _effect(*attempts: EffectAttempt, state: EffectState = EffectState.UNKNOWN,
            settled: int = 0) -> Effect:  # fmt: skip
    return Effect(
        effect_id="e" * 64, task_id="t1", revision=1, node="main", slot="s1",
        downstream="api", method="POST", path="/pay", payload_digest="d", state=state,
        created_at=1_000, updated_at=1_000,
        deadline_at=attempts[-1].started_at + 5_000 if state is EffectState.PREPARED else None,
        attempts=attempts, settled_attempts=settled,
    )  # fmt: skip


TIMED_OUT = _effect(_attempt(1_000, 1_300, "UNKNOWN"))


def _resolution(effect: Effect, outcome: EffectState, now: int, **kw: Any) -> effects.Resolution:
    return effects.resolution(effect, outcome, "checked", "op", None, now, **kw)


def test_not_applied_is_refused_until_no_forward_can_land() -> None:
    with pytest.raises(EffectInFlight) as refused:
        _resolution(TIMED_OUT, EffectState.NOT_APPLIED, 1_799, settle_ms=500)
    error = refused.value
    assert error.extra == {"landingUntil": 1_800, "retryAfterMs": 1, "effectId": "e" * 64,
                           "effectState": "UNKNOWN"}  # fmt: skip
    assert "landingUntil 1800" in error.detail and "force" in error.detail
    done = _resolution(TIMED_OUT, EffectState.NOT_APPLIED, 1_800, settle_ms=500)
    assert done.effect.state is EffectState.NOT_APPLIED and done.forced_until is None
    (action,) = json.loads(done.effect.actions_json or "[]")
    assert "force" not in action and "landingUntil" not in action


def test_force_overrides_and_is_recorded_with_the_note() -> None:
    done = _resolution(TIMED_OUT, EffectState.NOT_APPLIED, 1_400, settle_ms=500, force=True)
    assert done.effect.state is EffectState.NOT_APPLIED and done.forced_until == 1_800
    (action,) = json.loads(done.effect.actions_json or "[]")
    assert action == {**action, "action": "resolve", "note": "checked", "force": True,
                      "landingUntil": 1_800, "outcome": "NOT_APPLIED"}  # fmt: skip
    # A repeat (without force) is the same resolution: unchanged, nothing recorded.
    again = _resolution(done.effect, EffectState.NOT_APPLIED, 1_500, settle_ms=500)
    assert again.unchanged and again.effect.actions_json == done.effect.actions_json
    # force with nothing to override records nothing more than a plain resolve.
    late = _resolution(TIMED_OUT, EffectState.NOT_APPLIED, 1_800, settle_ms=500, force=True)
    assert late.forced_until is None
    assert "force" not in json.loads(late.effect.actions_json or "[]")[0]


def test_committed_is_never_refused() -> None:
    done = _resolution(TIMED_OUT, EffectState.COMMITTED, 1_301, settle_ms=10**6)
    assert done.effect.state is EffectState.COMMITTED


def test_which_attempts_can_still_land() -> None:
    # A forward whose gateway died (PREPARED past its deadline): from its deadline.
    dead = _effect(_attempt(1_000, None, None), state=EffectState.PREPARED)
    with pytest.raises(EffectInFlight) as refused:
        _resolution(dead, EffectState.NOT_APPLIED, 6_100, settle_ms=500)
    assert refused.value.extra["landingUntil"] == 6_500
    # Only attempts that may have executed count: a refused connect after a probe's
    # settlement cannot land.
    refused_only = _effect(_attempt(1_000, 1_300, "UNKNOWN"), _attempt(2_000, 2_010, "NOT_APPLIED"),
                           settled=1)  # fmt: skip
    assert _resolution(refused_only, EffectState.NOT_APPLIED, 2_020, settle_ms=500).effect
    # settle_ms 0: the downstream never applies after it answered or gave up.
    assert _resolution(TIMED_OUT, EffectState.NOT_APPLIED, 1_301, settle_ms=0).effect


def test_a_forward_in_flight_is_refused_even_when_forced() -> None:
    running = _effect(_attempt(1_000, None, None), state=EffectState.PREPARED)
    with pytest.raises(EffectInFlight) as refused:
        _resolution(running, EffectState.NOT_APPLIED, 1_100, settle_ms=500, force=True)
    assert "being forwarded right now" in refused.value.detail


# --- the three stores, their clocks moved by the test -----------------------------------------


async def test_every_store_applies_it_on_its_own_clock(store: Store) -> None:
    await store.put_task("t1", "in-1", None)
    task = await store.claim("t1", ClaimRequest(owner="w1", ttl_ms=60_000, scheduler_epoch=1))
    assert task.attempt_id is not None
    fence = effects.Fence("t1", task.attempt_id, task.claim_generation, 1, task.cancel_generation)
    request = effects.EffectRequest(
        fence, "main", "s1", "api", "POST", "/pay", "d", forward_id="f1"
    )
    first = await store.prepare_effect(request, 5_000)
    effect_id = first.effect.effect_id
    timed_out, _ = await store.complete_effect(
        "t1", effect_id, 0, task.attempt_id, EffectState.UNKNOWN, "timed out", None
    )
    ended = timed_out.attempts[0].ended_at
    assert ended is not None

    def not_applied(record: Effect | None, now: int) -> Effect:
        return effects.resolve(record, EffectState.NOT_APPLIED, "n", "op", None, now,
                               settle_ms=SETTLE_MS)  # fmt: skip

    with pytest.raises(EffectInFlight) as refused:
        await store.update_effect(effect_id, not_applied)
    assert refused.value.extra["landingUntil"] == ended + SETTLE_MS
    assert (await store.get_effect(effect_id)).state is EffectState.UNKNOWN
    store.clock_offset_ms += SETTLE_MS
    done = await store.update_effect(effect_id, not_applied)
    assert done.state is EffectState.NOT_APPLIED
    assert (await store.get_effect(effect_id)).state is EffectState.NOT_APPLIED


# --- the API, on every store ------------------------------------------------------------------


@pytest.fixture
async def api(store_url: str, key_prefix: str, downstream: Downstream) -> AsyncIterator[Api]:
    config = make_config(
        store_url,
        key_prefix,
        downstreams=[
            {"name": "api", "url": downstream.url, "timeout_ms": TIMEOUT_MS, "settle_ms": SETTLE_MS}
        ],
        proxy=PROXY,
        reconciler={"enabled": False},
    )
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


async def _timed_out(api: Api, task_id: str) -> tuple[str, int]:
    """An effect whose forward got no answer (the downstream read it, then closed the
    connection): UNKNOWN, and when the gateway stopped waiting."""
    lease = await task_with_lease(api, task_id, ttl_ms=50_000)
    sent = await send(api, lease, "/reset/pay", body={"amount": 1})
    assert sent.headers["Fence-Effect-State"] == "UNKNOWN", sent.status
    effect_id = sent.headers["Fence-Effect-Id"]
    ended = (await api.call("GET", f"/v1/effects/{effect_id}")).body["attempts"][0]["endedAt"]
    return effect_id, ended


async def _resolve(api: Api, effect_id: str, body: dict[str, Any]) -> tuple[int, Any, Any]:
    async with api.client.post(f"/v1/effects/{effect_id}/resolve", json=body) as resp:
        return resp.status, resp.headers, await resp.json()


async def test_the_api_refuses_with_landing_until_and_retry_after(api: Api) -> None:
    effect_id, ended = await _timed_out(api, "t1")
    with capture_logs() as logs:
        status, headers, problem = await _resolve(
            api, effect_id, {"outcome": "NOT_APPLIED", "note": "nothing at the bank"}
        )
    assert status == 409 and problem["code"] == "EFFECT_IN_FLIGHT", problem
    assert problem["landingUntil"] == ended + SETTLE_MS
    assert problem["effectId"] == effect_id and problem["effectState"] == "UNKNOWN"
    assert 0 < problem["retryAfterMs"] <= SETTLE_MS
    assert int(headers["Retry-After"]) == -(-problem["retryAfterMs"] // 1000)
    assert [e["event"] for e in logs if e["event"].startswith("operator.")] == [
        "operator.resolve_rejected"
    ]
    record = (await api.call("GET", f"/v1/effects/{effect_id}")).body
    assert record["state"] == "UNKNOWN" and record["actions"] == []
    # Once settle_ms has passed on the store's clock, the same resolve settles it.
    api.advance(SETTLE_MS)
    status, _, done = await _resolve(
        api, effect_id, {"outcome": "NOT_APPLIED", "note": "nothing at the bank"}
    )
    assert status == 200 and done["state"] == "NOT_APPLIED"
    assert "force" not in done["actions"][-1]


async def test_the_api_takes_force_and_committed_at_once(api: Api) -> None:
    forced_id, ended = await _timed_out(api, "t1")
    with capture_logs() as logs:
        status, _, done = await _resolve(
            api, forced_id, {"outcome": "NOT_APPLIED", "note": "the queue lost it", "force": True}
        )
    assert status == 200 and done["state"] == "NOT_APPLIED"
    action = done["actions"][-1]
    assert action["force"] is True and action["landingUntil"] == ended + SETTLE_MS
    assert action["note"] == "the queue lost it"
    (event,) = [e for e in logs if e["event"] == "operator.resolve"]
    assert event["force"] is True
    committed_id, _ = await _timed_out(api, "t2")
    status, _, done = await _resolve(api, committed_id, {"outcome": "COMMITTED", "note": "seen"})
    assert status == 200 and done["state"] == "COMMITTED"
    # force is a boolean, nothing else.
    status, _, problem = await _resolve(
        api, committed_id, {"outcome": "NOT_APPLIED", "note": "x", "force": "yes"}
    )
    assert status == 400 and problem["code"] == "BAD_REQUEST"


# --- the story: the timed-out request lands late ----------------------------------------------


class GatedDownstream:
    """Executes every call, counting, but holds the first one until ``gate`` opens: the
    request the gateway gave up on, sitting in the downstream's queue. Its answer is lost at
    once (the connection closes when it arrives), so the gateway gives up on a request that
    certainly arrived."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.arrived = 0
        self.executed = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _pay(self, request: web.Request) -> web.Response:
        await request.read()
        self.arrived += 1
        if self.arrived == 1:
            assert request.transport is not None
            request.transport.close()  # the answer is lost; the request waits in the queue
            await self.gate.wait()
        self.executed += 1
        answer = web.json_response({"paid": self.executed}, status=201)
        answer.force_close()
        return answer

    async def start(self) -> GatedDownstream:
        app = web.Application()
        app.router.add_post("/pay", self._pay)
        self.runner, self.url = await serve_app(app, shutdown_timeout=0.5)
        return self

    async def land(self) -> None:
        """Let the held request through and wait until it executed (the deadline only bounds
        a hang)."""
        before = self.executed
        self.gate.set()
        async with asyncio.timeout(30):
            while self.executed == before:
                await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.gate.set()
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.mark.parametrize("force", [False, True], ids=["waited", "forced"])
async def test_a_late_landing_runs_twice_only_when_forced(
    store_url: str, key_prefix: str, force: bool
) -> None:
    gated = await GatedDownstream().start()
    config = make_config(
        store_url,
        key_prefix,
        downstreams=[
            {"name": "api", "url": gated.url, "timeout_ms": TIMEOUT_MS, "settle_ms": SETTLE_MS}
        ],
        proxy=PROXY,
        reconciler={"enabled": False},
    )
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    try:
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            api = Api(client)
            lease = await task_with_lease(api, "t1", ttl_ms=50_000)
            lost = await send(api, lease, "/pay", body={"amount": 7})
            assert lost.status == 504 and lost.headers["Fence-Effect-State"] == "UNKNOWN"
            effect_id = lost.headers["Fence-Effect-Id"]
            assert gated.arrived == 1 and gated.executed == 0  # queued, not applied yet
            # The operator looks now, finds no payment, and resolves NOT_APPLIED.
            body = {"outcome": "NOT_APPLIED", "note": "no payment at the bank", "force": force}
            status, _, answer = await _resolve(api, effect_id, body)
            retry: Sent = await send(api, lease, "/pay", body={"amount": 7})
            if force:
                assert status == 200 and answer["actions"][-1]["force"] is True
                assert retry.status == 201 and retry.headers["Fence-Replayed"] == "false"
            else:
                assert status == 409 and answer["code"] == "EFFECT_IN_FLIGHT"
                assert retry.status == 409 and retry.headers["Fence-Effect-State"] == "UNKNOWN"
            await gated.land()  # the queued request applies after all
            if not force:
                # After landingUntil the operator looks again, finds the payment, and says so;
                # the retry is answered from the ledger.
                api.advance(SETTLE_MS)
                status, _, answer = await _resolve(
                    api, effect_id, {"outcome": "COMMITTED", "note": "paid after all"}
                )
                assert status == 200 and answer["state"] == "COMMITTED"
                again = await send(api, lease, "/pay", body={"amount": 7})
                assert again.status == 204 and again.headers["Fence-Replayed"] == "true"
            # Forced, the retry went out while the first was still queued: paid twice.
            assert gated.executed == (2 if force else 1)
            assert gated.arrived == (2 if force else 1)
    finally:
        await gated.stop()


# --- where settle_ms comes from -----------------------------------------------------------------


def _write(tmp_path: Path, downstream: str) -> Path:
    path = tmp_path / "fencegate.toml"
    path.write_text(f'[store]\nurl = "sqlite:///{tmp_path / "f.db"}"\n\n{downstream}')
    return path


def test_settle_ms_is_a_key_of_every_downstream_and_probe_settle_ms_its_alias(
    tmp_path: Path,
) -> None:
    plain = load_config(_write(tmp_path, '[[downstreams]]\nname = "a"\nurl = "http://x"\n'))
    assert plain.downstreams[0].settle_ms == effects.DEFAULT_SETTLE_MS == 60_000
    assert build_adapter(plain.downstreams[0]).settle_ms_for("/pay") == 60_000
    for kind in ("conditional", "manual"):
        text = f'[[downstreams]]\nname = "a"\nurl = "http://x"\nadapter = "{kind}"\nsettle_ms = 5\n'
        assert build_adapter(load_config(_write(tmp_path, text)).downstreams[0]).settle_ms == 5
    old = ('[[downstreams]]\nname = "p"\nurl = "http://x"\nadapter = "probe"\n'
           '[downstreams.probe]\npath = "/o/{effectId}"\nsettle_ms = 1500\n')  # fmt: skip
    probe = load_config(_write(tmp_path, old)).downstreams[0]
    assert probe.settle_ms == 1_500 and build_adapter(probe).settle_ms_for("/o") == 1_500
    both = old.replace('adapter = "probe"\n', 'adapter = "probe"\nsettle_ms = 10\n')
    with pytest.raises(ConfigError) as error:
        load_config(_write(tmp_path, both))
    assert "settle_ms and probe.settle_ms are both set" in str(error.value)
    assert "downstreams[0]" in str(error.value)


def test_an_mcp_tool_has_its_own_settle_ms(tmp_path: Path) -> None:
    text = ('[[downstreams]]\nname = "m"\nurl = "http://x"\nadapter = "mcp"\nsettle_ms = 9000\n'
            '[downstreams.tools.charge]\nsettle_ms = 120000\n'
            '[downstreams.tools.lookup]\nkind = "read_only"\n')  # fmt: skip
    config = load_config(_write(tmp_path, text))
    adapter = build_adapter(config.downstreams[0])
    assert isinstance(adapter, McpAdapter)
    assert adapter.settle_ms_for("/tools/call/charge") == 120_000
    assert adapter.settle_ms_for("/tools/call/lookup") == 9_000  # the downstream's
    assert adapter.settle_ms_for("/tools/call/other") == 9_000
    assert McpAdapter(tools={"x": ToolOverride(settle_ms=0)}).settle_ms_for("/tools/call/x") == 0
    # The resolve path asks the record's downstream; one no longer configured: the default.
    app = create_app(config)
    tool_effect = _effect(_attempt(1_000, 1_300, "UNKNOWN"))
    assert settle_ms_of(app, _with(tool_effect, "m", "/tools/call/charge")) == 120_000
    assert settle_ms_of(app, _with(tool_effect, "gone", "/pay")) == 60_000


def _with(effect: Effect, downstream: str, path: str) -> Effect:
    return replace(effect, downstream=downstream, path=path)


def test_a_settled_effect_is_still_settled_first() -> None:
    done = _resolution(TIMED_OUT, EffectState.COMMITTED, 1_400, settle_ms=500)
    with pytest.raises(EffectSettled):
        _resolution(done.effect, EffectState.NOT_APPLIED, 1_400, settle_ms=500, force=True)
