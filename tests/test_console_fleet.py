"""The console's Fleet page (issue 27): the charts are sampled in the background from the
gateway's start, on an injected clock (``ManualClock``: the test moves time, nothing sleeps),
one store round trip per sample, in a bounded ring, their legends in words; a store that
fails is logged once and sampling goes on. The rollout verdict says which conditions fail.
And a console form over ``server.max_body_bytes`` is the console's own 413 page, where the
API answers problem+json.

A real gateway (aiohttp's test server, SQLite) with ``[auth]`` and a real downstream
(tests/downstream.py), as in tests/test_console.py.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs

from fencegate.gateway.app import create_app
from fencegate.gateway.console import CONSOLE
from fencegate.gateway.console.series import SAMPLE_MS, WINDOW_MS, Series, label
from fencegate.gateway.console.session import COOKIE
from fencegate.gateway.metrics import Metrics
from fencegate.gateway.state import STORE
from fencegate.ledger.errors import StoreUnavailable
from fencegate.ledger.queries import Gauges, switch_blockers
from fencegate.ledger.store import Store
from tests.api import until
from tests.clocks import ManualClock, still
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.test_console import TOKENS, Env, console_config
from tests.test_openapi import check_answer


@dataclass
class Fleet:
    env: Env
    clock: ManualClock
    series: Series
    store: Store
    #: Store.gauges calls so far (the sampling's only store round trip).
    calls: list[int]
    #: Set to an error: the next gauges calls raise it (the store is away).
    failure: list[Exception]

    async def step(self) -> None:
        """One sampling interval on the test's clock, and the sample's round trip done."""
        await until(lambda: self.clock.sleepers == 1, "the sampling loop waits for its clock")
        before = len(self.calls)
        self.clock.advance(SAMPLE_MS / 1000)
        await until(lambda: len(self.calls) > before, "the next sample asked the store")
        await until(lambda: self.clock.sleepers == 1, "the sample was taken")


@pytest.fixture
async def fleet(tmp_path: Path, downstream: Downstream) -> AsyncIterator[Fleet]:
    config = console_config(tmp_path / "fg.db", downstream)
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    clock = ManualClock(start=1_800_000_000.0)
    series = app[CONSOLE].series
    series.clock, series.sleep = clock.now, clock.sleep
    store = app[STORE]
    calls: list[int] = []
    failure: list[Exception] = []
    gauges = store.gauges

    async def counted() -> Gauges:
        calls.append(1)
        if failure:
            raise failure[0]
        return await gauges()

    store.gauges = counted  # type: ignore[method-assign]
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Fleet(Env(client, downstream), clock, series, store, calls, failure)


async def _series(env: Env, cookie: str) -> dict[str, Any]:
    async with env.client.get(
        "/console/fleet/series", headers={"Cookie": f"{COOKIE}={cookie}"}
    ) as resp:
        assert resp.status == 200
        answer: dict[str, Any] = await resp.json()
        return answer


async def test_the_charts_have_samples_before_anyone_opens_the_page(fleet: Fleet) -> None:
    env = fleet.env
    # Sampled at start-up, with nobody logged in, nobody on the Fleet page.
    await until(lambda: len(fleet.series.samples) == 1, "the first sample, at start-up")
    await env.unknown_effect()
    await fleet.step()
    await fleet.step()
    assert len(fleet.series.samples) == 3 and len(fleet.calls) == 3  # one round trip each
    alice = await env.login(TOKENS["alice"][1])
    answer = await _series(env, alice)
    samples = answer["samples"]
    assert [s["t"] for s in samples] == [1_800_000_000_000 + i * SAMPLE_MS for i in range(3)]
    last = samples[-1]
    assert last["unknown"] == 1 and last["activeLeases"] == 1 and last["prepared"] == 0
    assert last["awaitingApproval"] == 0 and last["effects"]["api/UNKNOWN"] == 1
    assert answer["everyMs"] == SAMPLE_MS
    # Reading the samples costs the store nothing: the background loop took them.
    await _series(env, alice)
    assert len(fleet.calls) == 3
    # Every series' legend in words, never an internal name.
    labels = answer["labels"]
    assert labels["activeLeases"] == "active leases"
    assert labels["prepared"] == "effects in flight (PREPARED)"
    assert labels["unknown"] == "effects UNKNOWN"
    assert labels["awaitingApproval"] == "effects awaiting approval"
    assert labels["fenced"] == "fenced refusals"
    assert labels["api/UNKNOWN"] == "api: outcome unknown"
    for key, words in labels.items():
        assert words != key and "/" not in words and not re.search(r"[a-z][A-Z]", words)
    # The page names each chart's series the same way (console.js draws their legends).
    page = await env.get("/console/fleet", alice)
    assert 'data-lines="prepared unknown awaitingApproval"' in page.text
    assert "whether or not anyone watches" in page.text


def test_legends_in_words() -> None:
    assert label("payments/COMMITTED") == "payments: committed"
    assert label("payments/NOT_APPLIED") == "payments: not applied"
    assert label("payments/replayed") == "payments: replayed to a retry"
    assert label("payments/conflict") == "payments: refused: another payload"
    assert label("mail/approval_required") == "mail: held for approval"
    assert label("mail/SOME_NEW_CODE") == "mail: some new code"


async def test_the_samples_are_a_bounded_ring_of_the_last_minutes(
    tmp_path: Path,
) -> None:
    config = make_config(f"sqlite:///{tmp_path / 'fg.db'}")
    store = build_test_store(config)
    await store.open()
    try:
        clock = ManualClock(start=1_800_000_000.0)
        series = Series(clock=clock.now, sleep=clock.sleep)
        metrics = Metrics()
        kept = WINDOW_MS // SAMPLE_MS
        for _ in range(kept + 10):
            assert await series.take(metrics, store)
            clock.advance(SAMPLE_MS / 1000)
        assert len(series.samples) == kept
        assert series.samples[0]["t"] == 1_800_000_000_000 + 10 * SAMPLE_MS
        # No sample for longer than the window (the store was away): none is shown.
        clock.advance(WINDOW_MS / 1000)
        assert series.recent() == [] and series.answer()["samples"] == []
    finally:
        await store.close()


async def test_a_store_failure_is_logged_once_and_sampling_goes_on(fleet: Fleet) -> None:
    await until(lambda: len(fleet.series.samples) == 1, "the first sample, at start-up")
    with capture_logs() as logs:
        fleet.failure.append(StoreUnavailable("redis: timeout (injected)"))
        for _ in range(3):
            await fleet.step()
        assert len(fleet.series.samples) == 1  # no sample while the store is away
        fleet.failure.clear()
        await fleet.step()
        await fleet.step()
    assert len(fleet.series.samples) == 3
    events = [e for e in logs if e["event"].startswith("console.sampling")]
    assert [e["event"] for e in events] == ["console.sampling_failed", "console.sampling_resumed"]
    assert events[0]["code"] == "STORE_UNAVAILABLE" and "injected" in events[0]["reason"]
    assert events[0]["log_level"] == "warning"


# --- safe to switch pools: which conditions fail, by how much -------------------------------


def test_switch_blockers_name_every_count_that_is_not_zero() -> None:
    assert switch_blockers(Gauges(0, 0, 0, 0)) == () and Gauges(0, 0, 0, 0).settled
    found = switch_blockers(Gauges(2, 1, 1, 3))
    assert [b.reason for b in found] == [
        "2 leases held",
        "1 effect in flight (PREPARED)",
        "1 effect UNKNOWN",
        "3 effects awaiting approval",
    ]
    assert [(b.gauge, b.count) for b in found] == [
        ("active_leases", 2), ("prepared_effects", 1),
        ("unknown_effects", 1), ("awaiting_approval", 3),
    ]  # fmt: skip
    for one in range(4):
        counts = [0, 0, 0, 0]
        counts[one] = 1
        gauges = Gauges(*counts)
        assert len(switch_blockers(gauges)) == 1 and not gauges.settled


async def test_the_rollout_verdict_says_which_conditions_fail(fleet: Fleet) -> None:
    env = fleet.env
    await env.unknown_effect()
    status, headers, rollout = await env.api("GET", "/v1/rollout", "olive")
    assert status == 200
    check_answer("GET", "/v1/rollout", 200, headers["Content-Type"].split(";")[0], rollout)
    assert rollout["safeToSwitchPools"] is False
    assert rollout["blockers"] == [
        {"member": "activeLeases", "count": 1, "reason": "1 lease held"},
        {"member": "unknownEffects", "count": 1, "reason": "1 effect UNKNOWN"},
    ]
    olive = await env.login(TOKENS["olive"][1])
    page = await env.get("/console/fleet", olive)
    assert re.search(
        r'<dd id="switch"><span class="badge unknown">no</span> '
        r'<span id="blockers">1 lease held, 1 effect UNKNOWN</span></dd>',
        page.text,
    ), page.text


# --- a form over server.max_body_bytes -------------------------------------------------------


async def _post(
    env: Env, path: str, body: bytes | Callable[[], AsyncIterator[bytes]], headers: dict[str, str]
) -> tuple[int, dict[str, str], str]:
    data: Any = body if isinstance(body, bytes) else body()
    async with env.client.post(path, data=data, headers=headers, allow_redirects=False) as resp:
        return resp.status, dict(resp.headers), await resp.text()


async def test_an_oversized_console_form_is_the_consoles_413_page_the_api_answers_json(
    tmp_path: Path, downstream: Downstream
) -> None:
    limit = 1024
    config = console_config(tmp_path / "fg.db", downstream, server={"max_body_bytes": limit})
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        env = Env(client, downstream)
        alice = await env.login(TOKENS["alice"][1])
        big = b"csrf=x&note=" + b"a" * (2 * limit)

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: read, then refused
            for _ in range(4):
                yield b"a" * limit

        form = {"Cookie": f"{COOKIE}={alice}", "Origin": env.origin,
                "Content-Type": "application/x-www-form-urlencoded"}  # fmt: skip
        sent: list[bytes | Callable[[], AsyncIterator[bytes]]] = [big, chunks]
        for body in sent:
            status, headers, text = await _post(env, "/console/fleet/pause", body, form)
            assert status == 413, text
            assert headers["Content-Type"].startswith("text/html")
            assert "<strong>PAYLOAD_TOO_LARGE</strong>" in text
            assert "server.max_body_bytes" in text and str(limit) in text
            assert headers["Content-Security-Policy"].startswith("default-src 'none'")
            # The JSON API, the same body: problem+json, as the contract says.
            api = {"Fence-Authorization": f"Bearer {TOKENS['alice'][1]}",
                   "Content-Type": "application/json"}  # fmt: skip
            status, headers, text = await _post(env, "/v1/claims/pause", body, api)
            assert status == 413 and headers["Content-Type"] == "application/problem+json"
            assert '"code": "PAYLOAD_TOO_LARGE"' in text
        assert not (await client.app[STORE].get_scheduler()).claims_paused
