"""``Server-Timing`` on the proxy's answers (docs/PROTOCOL.md), on both stores, through a real
gateway app and a real loopback downstream; and the benchmark's reading of it
(``bench.proxy.parse_server_timing``, ``call_parts``, ``timing_breakdown``) on recorded
header values.

The header names only the steps that ran: a forward ``prepare, forward, complete, total``, a
replay ``prepare, total``, a refusal what ran before it, a safe method ``fence, forward,
total``. The downstream's own ``Server-Timing`` is dropped: never passed on, never stored, so
it cannot be read as the gateway's.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDictProxy

from bench.proxy import call_parts, parse_server_timing, timing_breakdown
from fencegate.gateway.app import create_app
from fencegate.gateway.config import Config
from tests.api import Api, Lease, serve_app
from tests.conftest import build_test_store, make_config

#: Protocol-layer rules, the same on every store: SQLite only (docs/stores.md).
pytestmark = pytest.mark.one_store

#: The gateway's form: metrics ``name;dur=ms`` (one decimal), ", " between them.
OURS = re.compile(r"[a-z]+;dur=\d+\.\d(, [a-z]+;dur=\d+\.\d)*")
#: What the downstream of these tests says about itself on every answer.
DOWNSTREAM_TIMING = ('total;dur=999.9, db;dur=500;desc="Downstream, DB"', "forward;dur=777")


@dataclass
class TimedDownstream:
    """A loopback downstream that sends its own ``Server-Timing`` on every answer.
    ``/slow/{ms}``: sleeps that long first; ``/big/{bytes}``: a body that large."""

    calls: list[str] = field(default_factory=list)
    runner: web.AppRunner | None = None
    url: str = ""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.calls.append(f"{request.method} {request.path}")
        parts = request.path.strip("/").split("/")
        headers = [("Server-Timing", value) for value in DOWNSTREAM_TIMING]
        if parts[0] == "slow":
            await asyncio.sleep(int(parts[1]) / 1000)
        if parts[0] == "big":
            return web.Response(body=b"x" * int(parts[1]), headers=headers)
        return web.json_response({"ok": True}, headers=headers)

    async def start(self) -> TimedDownstream:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner, self.url = await serve_app(app)
        return self


@pytest.fixture
async def timed() -> AsyncIterator[TimedDownstream]:
    server = await TimedDownstream().start()
    yield server
    assert server.runner is not None
    await server.runner.cleanup()


@pytest.fixture
def timing_config(store_url: str, key_prefix: str, timed: TimedDownstream) -> Config:
    downstream = {"name": "api", "url": timed.url, "timeout_ms": 5_000, "replay_max_bytes": 1024}
    return make_config(store_url, key_prefix, downstreams=[downstream])


@pytest.fixture
async def api(timing_config: Config) -> AsyncIterator[Api]:
    app = create_app(timing_config, store=build_test_store(timing_config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


def fence_headers(lease: Lease, slot: str | None = "s1", **override: str) -> dict[str, str]:
    headers = {
        "Fence-Task": lease.task_id,
        "Fence-Attempt": lease.attempt_id,
        "Fence-Generation": str(lease.claim_generation),
        "Fence-Epoch": str(lease.scheduler_epoch),
        "Fence-Cancel": str(lease.cancel_generation),
    }
    if slot is not None:
        headers["Fence-Slot"] = slot
    headers.update(override)
    return headers


@dataclass
class Answer:
    status: int
    headers: CIMultiDictProxy[str]
    body: bytes
    #: The client's latency of the call, in ms.
    elapsed_ms: float

    @property
    def timing(self) -> list[tuple[str, float]]:
        """The answer's one Server-Timing field, in the gateway's form, as (name, ms) pairs."""
        (value,) = self.headers.getall("Server-Timing")
        assert OURS.fullmatch(value), value
        pairs = [metric.split(";dur=") for metric in value.split(", ")]
        return [(name, float(ms)) for name, ms in pairs]

    @property
    def steps(self) -> list[str]:
        return [name for name, _ in self.timing]


async def send(
    api: Api, path: str, headers: dict[str, str], method: str = "POST", body: Any = None
) -> Answer:
    started = time.perf_counter()
    async with api.client.request(method, path, json=body, headers=headers) as resp:
        raw = await resp.read()
        elapsed_ms = (time.perf_counter() - started) * 1000
        return Answer(resp.status, resp.headers, raw, elapsed_ms)


async def lease_on(api: Api, task_id: str = "t1") -> Lease:
    await api.put(task_id)
    return await api.claim(task_id, ttl_ms=30_000)


def check_sums(answer: Answer) -> dict[str, float]:
    """Every step is a duration, the total holds them all (each rounded to 0.1 ms) and fits
    inside what the client waited."""
    timing = dict(answer.timing)
    assert len(timing) == len(answer.timing), "a step named twice"
    assert answer.steps[-1] == "total"
    assert all(ms >= 0 for ms in timing.values())
    steps = sum(ms for name, ms in timing.items() if name != "total")
    assert timing["total"] >= steps - 0.05 * len(timing)
    assert timing["total"] <= answer.elapsed_ms + 0.05
    return timing


async def test_a_forward_names_prepare_forward_complete_and_total(
    api: Api, timed: TimedDownstream
) -> None:
    lease = await lease_on(api)
    sent = await send(api, "/proxy/api/slow/60", fence_headers(lease), body={"amount": 1})
    assert sent.status == 200 and sent.headers["Fence-Effect-State"] == "COMMITTED"
    assert sent.steps == ["prepare", "forward", "complete", "total"]
    timing = check_sums(sent)
    assert timing["forward"] >= 59.9  # the downstream slept 60 ms inside the forward


async def test_a_replay_names_no_forward(api: Api, timed: TimedDownstream) -> None:
    lease = await lease_on(api)
    first = await send(api, "/proxy/api/slow/1", fence_headers(lease), body={"amount": 1})
    again = await send(api, "/proxy/api/slow/1", fence_headers(lease), body={"amount": 1})
    assert first.headers["Fence-Replayed"] == "false"
    assert again.status == 200 and again.headers["Fence-Replayed"] == "true"
    assert again.steps == ["prepare", "total"]
    check_sums(again)
    assert timed.calls == ["POST /slow/1"]


async def test_a_refusal_names_only_what_ran(api: Api, timed: TimedDownstream) -> None:
    lease = await lease_on(api)
    await api.call("POST", "/v1/epoch/bump")  # the lease's epoch is stale from now on
    fenced = await send(api, "/proxy/api/ok", fence_headers(lease), body={})
    assert fenced.status == 409
    assert fenced.steps == ["prepare", "total"]
    check_sums(fenced)
    fenced_read = await send(api, "/proxy/api/ok", fence_headers(lease, None), method="GET")
    assert fenced_read.status == 409 and fenced_read.steps == ["fence", "total"]
    # Refused before the store was asked: nothing but the total.
    malformed_headers = {**fence_headers(lease), "Fence-Generation": "x"}
    malformed = await send(api, "/proxy/api/ok", malformed_headers, body={})
    assert malformed.status == 400 and malformed.steps == ["total"]
    nowhere = await send(api, "/proxy/nowhere/ok", fence_headers(lease), body={})
    assert nowhere.status == 404 and nowhere.steps == ["total"]
    assert timed.calls == []


async def test_a_safe_method_names_fence_forward_and_total(
    api: Api, timed: TimedDownstream
) -> None:
    lease = await lease_on(api)
    sent = await send(api, "/proxy/api/slow/30", fence_headers(lease, None), method="GET")
    assert sent.status == 200
    assert sent.steps == ["fence", "forward", "total"]
    assert check_sums(sent)["forward"] >= 29.9


async def test_the_downstreams_own_server_timing_is_neither_passed_on_nor_stored(
    api: Api, timed: TimedDownstream
) -> None:
    lease = await lease_on(api)
    sent = await send(api, "/proxy/api/ok", fence_headers(lease), body={})
    # One field, the gateway's: not the downstream's db, total 999.9 or forward 777.
    assert sent.steps == ["prepare", "forward", "complete", "total"]
    assert dict(sent.timing)["total"] < 999 and dict(sent.timing)["forward"] < 777
    effect_id = sent.headers["Fence-Effect-Id"]
    record = (await api.call("GET", f"/v1/effects/{effect_id}")).body
    stored = [name.lower() for name, _ in record["response"]["headers"]]
    assert "server-timing" not in stored and "content-type" in stored
    again = await send(api, "/proxy/api/ok", fence_headers(lease), body={})
    assert again.headers["Fence-Replayed"] == "true" and again.steps == ["prepare", "total"]
    read = await send(api, "/proxy/api/ok", fence_headers(lease, None), method="GET")
    assert read.steps == ["fence", "forward", "total"]
    assert dict(read.timing)["total"] < 999


async def test_a_streamed_answer_carries_it_before_its_body(
    api: Api, timed: TimedDownstream
) -> None:
    lease = await lease_on(api)
    sent = await send(api, "/proxy/api/big/5000", fence_headers(lease), body={})
    assert sent.status == 200 and len(sent.body) == 5000  # over replay_max_bytes: streamed
    assert sent.steps == ["prepare", "forward", "complete", "total"]
    check_sums(sent)


# --- the benchmark's reading of the header (pure functions) -----------------------------------

#: Values as they were answered: by this gateway (a forward, a replay, a safe method), by
#: others (the spec's and MDN's examples), and broken ones.
RECORDED = [
    (
        "prepare;dur=1.9, forward;dur=3.2, complete;dur=1.1, total;dur=7.4",
        {"prepare": 1.9, "forward": 3.2, "complete": 1.1, "total": 7.4},
    ),
    ("prepare;dur=0.6, total;dur=0.9", {"prepare": 0.6, "total": 0.9}),
    ("fence;dur=0.4, forward;dur=1.0, total;dur=1.8", {"fence": 0.4, "forward": 1.0, "total": 1.8}),
    (
        'miss, db;dur=53, app;dur=47.2, cache;desc="Cache Read";dur=23.2',
        {"miss": 0.0, "db": 53.0, "app": 47.2, "cache": 23.2},
    ),
    ('total;desc="a, b; c=1";dur=123.4', {"total": 123.4}),
    ('db;dur="53.5" , app ; dur = 2', {"db": 53.5, "app": 2.0}),
    ("total;dur=1;dur=2, total;dur=3", {"total": 1.0}),  # the first of each counts
    ("a;dur=x, b;dur=, c;dur=NaN, d;dur=-inf", {"a": 0.0, "b": 0.0, "c": 0.0, "d": 0.0}),
    ("broken metric, ok;dur=1, ;dur=2, , ", {"ok": 1.0}),
    ("", {}),
]


@pytest.mark.parametrize(("value", "expected"), RECORDED)
def test_the_bench_reads_recorded_server_timing_values(
    value: str, expected: dict[str, float]
) -> None:
    assert parse_server_timing(value) == expected


def test_the_bench_splits_a_call_into_steps_other_and_outside() -> None:
    timing = parse_server_timing(
        "prepare;dur=2.0, forward;dur=3.0, complete;dur=1.0, total;dur=7.5"
    )
    parts = call_parts(timing, sent_ms=10.0)
    assert parts == pytest.approx(
        {
            "prepare": 2.0,
            "forward": 3.0,
            "complete": 1.0,
            "other": 1.5,
            "total": 7.5,
            "outside": 2.5,
        }
    )
    # A passthrough's answer (or an older gateway's, or the downstream's alone) has no total.
    assert call_parts(parse_server_timing("db;dur=5"), 10.0) == {}


def test_the_bench_breaks_the_slowest_calls_down() -> None:
    fast = call_parts({"prepare": 1.0, "forward": 1.0, "complete": 1.0, "total": 3.5}, 4.0)
    slow = call_parts({"prepare": 20.0, "forward": 1.0, "complete": 1.0, "total": 22.5}, 30.0)
    latency = [4.0 + 1.0] * 99 + [30.0 + 2.0]  # paced: each call also waited in the client
    lag = [1.0] * 99 + [2.0]
    got = timing_breakdown(latency, lag, [fast] * 99 + [slow])
    assert got is not None
    assert got["calls"] == 100
    assert got["parts"]["prepare"] == {"p50": 1.0, "p99": 1.0}
    assert got["parts"]["outside"] == {"p50": 0.5, "p99": 0.5}
    tail = got["slowest"]
    assert tail["calls"] == 1
    mean = tail["meanMs"]
    assert mean["prepare"] == 20.0 and mean["outside"] == 7.5 and mean["lag"] == 2.0
    assert mean["lag"] + mean["outside"] + mean["total"] == pytest.approx(mean["latency"])
    assert timing_breakdown([1.0, 2.0], [], [{}, {}]) is None  # no gateway header at all
