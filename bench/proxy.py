"""Fenced mutations per second through the gateway's proxy, per store, against a bare aiohttp
passthrough proxy in front of the same downstream.

Run from the repository root::

    .venv/bin/python -m bench.proxy                         # defaults: ~2-3 minutes on 2 cores
    .venv/bin/python -m bench.proxy --stores redis --rounds 3 --json -

Every call is ``POST /proxy/bench/pay`` with the ``Fence-*`` headers of a claimed task, a new
``Fence-Slot`` (so a NEW effect: PREPARED -> forward -> COMMITTED, never a replay) and a small
JSON body. The benchmark starts its own processes on loopback, each in its own process so the
measuring client does not share an event loop with any of them:

* ``downstream``: a trivial aiohttp server (this module, ``--serve-downstream``) answering
  200 JSON and counting the calls it gets per ``Idempotency-Key``;
* ``passthrough``: a minimal aiohttp proxy (``--serve-passthrough``) that forwards the same
  request through one pooled ``ClientSession`` to the same downstream: the baseline;
* ``fencegate serve`` on a fresh SQLite file, on a private ``redis-server`` (AOF,
  ``appendfsync always``) and on a private PostgreSQL cluster (``fsync=on``,
  ``synchronous_commit=on``, a new database per gateway), with ``[logging] level = "warning"``
  (and once more with ``"info"``, the default, to show what the per-decision logs cost);
  ``--stores cluster`` (not in the default list) runs it on a private Redis Cluster of three
  primaries and three replicas (``tests.cluster_servers``), URL ``redis+cluster://``.

On Redis, each peak phase reports the Redis time per fenced call from ``INFO commandstats``
(``redis_call_stats``; summed over a cluster's primaries): every script run (EVALSHA, FCALL),
the commands it ran included, plus every command the gateway sent outside a script (the write
mark's INCR, WAIT, pipelined reads), over the phase's calls, with the split per script from the
SLOWLOG.

With ``--auth`` every gateway runs with an ``[auth]`` section: one principal (roles scheduler,
worker, operator, observer) whose random token the benchmark generates (only its SHA-256 goes
into the config), and every request the client sends to a proxy (gateway or passthrough) carries
``Fence-Authorization: Bearer <token>``. Run with and without it to see what authentication costs.

Two kinds of phases, baseline and fenced alternately (passthrough, redis, passthrough, sqlite,
passthrough, ...):

* **peak** (closed loop): ``--concurrency`` workers send ``--requests`` calls back to back;
* **paced** (open loop): calls leave on a fixed schedule at ``--paced-fraction`` (0.5) of the
  store's measured fenced peak (or at ``--paced-rate`` calls/s), for ``--paced-seconds``; a
  call's latency runs from its scheduled start, so a proxy that falls behind is charged for
  the wait. The passthrough runs
  at the same rate around it, and the difference of the p99s is the latency fencing adds.

After every phase the downstream's counts are checked: for a fenced phase, exactly one call per
effect (by ``Idempotency-Key``), the key equal to the ``Fence-Effect-Id`` answered (and to the
effectId the client computes), every answer ``200`` ``COMMITTED``, not replayed.

Where a fenced call's time goes: the client reads the gateway's ``Server-Timing`` answer
header on every measured call (``parse_server_timing``) and reports, per fenced phase, p50
and p99 of each step (prepare, forward, complete, total), ``other`` (the gateway's total less
its steps: parsing, digest, decisions, logs, building the answer) and ``outside`` (the
client's latency from the moment it sent the call, less the gateway's total: the event-loop
wait and queueing on both sides, HTTP parsing outside the handler, loopback), and for the
slowest 1% of calls the mean of each part (``timing_breakdown``).
``bench/README.md`` describes the output.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import platform
import re
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
from aiohttp import web
from multidict import CIMultiDict

from bench._args import (
    ALL_STORES,
    add_run_options,
    add_store_options,
    check_run_options,
    parse_stores,
)
from bench._procs import (
    HOST,
    Proc,
    align,
    filesystem_of,
    fmt,
    gateway_origin,
    percentile,
    progress,
    redis_script_names,
    redis_stats_reset,
    scan_gateway_log,
    start_gateway,
    start_module_server,
    start_postgres,
    start_redis,
    terminable,
)

__all__ = ["main"]

#: The downstream's name in the gateway config, and the proxied path every call uses.
DOWNSTREAM = "bench"
CALL_PATH = f"/proxy/{DOWNSTREAM}/pay"
#: Lease asked for by every claim, and the config's ceilings (the gateway clamps to them).
TTL_MS = 600_000
MAX_TTL_MS = 3_600_000
#: The header that carries the gateway's bearer token (docs/security.md), and the principal
#: ``--auth`` configures: every role, so one token does the set-up, the calls and the read-back.
AUTH_HEADER = "Fence-Authorization"
AUTH_PRINCIPAL = "bench"
AUTH_ROLES = ("scheduler", "worker", "operator", "observer")
#: Per-request client timeout; a proxy that stops answering shows up as errors, not a hang.
REQUEST_TIMEOUT_S = 30.0
#: How many distinct error answers are kept verbatim per phase.
ERROR_SAMPLES = 5
#: Effects read back through GET /v1/effects/{id} after each fenced phase.
READ_BACK = 20
#: Targets of the brief: fenced/passthrough throughput per store, added p99 at half load
#: (none was set for PostgreSQL).
RATIO_TARGETS: dict[str, float | None] = {
    "redis": 0.6,
    "sqlite": 0.4,
    "postgres": None,
    "cluster": None,
}
#: The names of the store server processes (their CPU is reported per call).
STORE_SERVERS = ("redis-server", "postgres")
ADDED_P99_TARGET_MS = 2.0
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
     "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade"}
)  # fmt: skip


# --- the downstream and the passthrough (each runs in its own process) -----------------------


def _run(app: web.Application, listen: str) -> int:
    host, _, port = listen.rpartition(":")
    if host not in (HOST, "localhost"):
        print("bench servers listen on loopback only", file=sys.stderr)
        return 2
    # The same run_app options as ``fencegate serve``; SO_REUSEPORT: with --workers N the
    # passthrough is N such processes on one port, as the gateway is N workers.
    web.run_app(app, host=host, port=int(port), print=None, access_log=None, reuse_port=True)
    return 0


def downstream_app() -> web.Application:
    """Answers every call 200 JSON and counts calls per Idempotency-Key until asked."""
    by_key: Counter[str] = Counter()
    totals: Counter[str] = Counter()

    async def call(request: web.Request) -> web.Response:
        await request.read()
        key = request.headers.get("Idempotency-Key")
        totals["calls"] += 1
        if key is None:
            totals["noKey"] += 1
        else:
            by_key[key] += 1
        if "Fencing-Token" in request.headers:
            totals["withToken"] += 1
        return web.json_response({"ok": True, "paymentId": key or "-"})

    async def stats(request: web.Request) -> web.Response:
        """The counts since the last reset; ``?reset=1`` starts again from zero."""
        answer = {
            "calls": totals["calls"],
            "noKey": totals["noKey"],
            "withToken": totals["withToken"],
            "byKey": dict(by_key),
        }
        if request.query.get("reset") == "1":
            by_key.clear()
            totals.clear()
        return web.json_response(answer)

    async def ready(request: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    app = web.Application()
    app.router.add_get("/_stats", stats)
    app.router.add_get("/readyz", ready)
    app.router.add_route("*", "/{tail:.*}", call)
    return app


def passthrough_app(downstream_url: str) -> web.Application:
    """``/proxy/{name}/{path}`` forwarded as is to ``downstream_url/{path}``: no store, no
    checks, no logging; one pooled ClientSession with the gateway's options."""
    client_key = web.AppKey("client", aiohttp.ClientSession)

    async def forward(request: web.Request) -> web.Response:
        _, _, rest = request.raw_path.partition("/proxy/")
        _, slash, tail = rest.partition("/")
        body = await request.read()
        headers = CIMultiDict(
            (k, v)
            for k, v in request.headers.items()
            if k.lower() not in HOP_BY_HOP and k.lower() not in ("host", "content-length")
        )
        async with request.app[client_key].request(
            request.method,
            downstream_url + slash + tail,
            headers=headers,
            data=body,
            allow_redirects=False,
        ) as resp:
            answer = await resp.read()
            out = CIMultiDict(
                (k, v)
                for k, v in resp.headers.items()
                if k.lower() not in HOP_BY_HOP and k.lower() != "content-length"
            )
            return web.Response(status=resp.status, body=answer, headers=out)

    async def ready(request: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    async def client_ctx(app: web.Application) -> AsyncIterator[None]:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=200),  # the gateway's proxy.max_connections
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            trust_env=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        app[client_key] = session
        yield
        await session.close()

    app = web.Application()
    app.cleanup_ctx.append(client_ctx)
    app.router.add_get("/readyz", ready)
    app.router.add_route("*", "/proxy/{tail:.*}", forward)
    return app


# --- Server-Timing ---------------------------------------------------------------------------

#: A metric or parameter name (a token), and a parameter's value (a token or a quoted string).
_ST_NAME = re.compile(r"[ \t]*([!#$%&'*+.^_`|~0-9A-Za-z-]+)[ \t]*")
_ST_VALUE = re.compile(r'[ \t]*("(?:[^"\\]|\\.)*"|[!#$%&\'*+.^_`|~0-9A-Za-z-]*)[ \t]*')
#: The gateway's steps in the order they run (docs/PROTOCOL.md), then the parts the bench
#: derives: ``other`` (total less the steps) and ``outside`` (the client's latency less total).
STEPS = ("fence", "prepare", "reconcile", "forward", "complete", "abort")
PARTS = (*STEPS, "other", "total", "outside")


def _skip_metric(value: str, i: int) -> int:
    """The index just past the comma that ends the metric at ``i`` (quoted strings skipped)."""
    quoted = False
    while i < len(value):
        char = value[i]
        if quoted:
            if char == "\\":
                i += 1
            elif char == '"':
                quoted = False
        elif char == '"':
            quoted = True
        elif char == ",":
            return i + 1
        i += 1
    return i


def parse_server_timing(value: str | None) -> dict[str, float]:
    """``{metric: dur}`` of a ``Server-Timing`` field value (https://www.w3.org/TR/server-timing/;
    several fields joined with ``", "``). A metric without a ``dur`` (or with one that is not a
    number) counts 0, as the spec says; of a metric or a parameter named twice the first
    counts; a malformed metric is skipped up to the next comma; names are case-sensitive."""
    timings: dict[str, float] = {}
    if not value:
        return timings
    i = 0
    while i < len(value):
        name = _ST_NAME.match(value, i)
        if name is None:
            i = _skip_metric(value, i)
            continue
        i = name.end()
        dur: float | None = None
        while i < len(value) and value[i] == ";":
            param = _ST_NAME.match(value, i + 1)
            if param is None:
                break
            i = param.end()
            raw = ""
            if i < len(value) and value[i] == "=":
                got = _ST_VALUE.match(value, i + 1)
                assert got is not None  # it matches the empty string
                raw, i = got.group(1), got.end()
            if param.group(1).lower() == "dur" and dur is None:
                if raw.startswith('"'):
                    raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
                try:
                    dur = float(raw)
                except ValueError:
                    dur = 0.0
        well_formed = i >= len(value) or value[i] == ","
        i = _skip_metric(value, i)
        if well_formed and name.group(1) not in timings:
            timings[name.group(1)] = dur if dur is not None and math.isfinite(dur) else 0.0
    return timings


def call_parts(timing: Mapping[str, float], sent_ms: float) -> dict[str, float]:
    """One call's parts: the gateway's steps and total as its header said, ``other`` (total
    less the steps it names) and ``outside`` (``sent_ms``, the client's latency from the moment
    it sent the call, less total). {} when the answer had no ``total``."""
    if "total" not in timing:
        return {}
    parts = {step: timing[step] for step in STEPS if step in timing}
    total = timing["total"]
    parts["other"] = max(total - sum(parts.values()), 0.0)
    parts["total"] = total
    parts["outside"] = max(sent_ms - total, 0.0)
    return parts


def timing_breakdown(
    latency_ms: Sequence[float], lag_ms: Sequence[float], parts: Sequence[Mapping[str, float]]
) -> dict[str, Any] | None:
    """Where a phase's time went: p50 and p99 of each part over the calls that had it, and,
    over the slowest 1% of the calls (at least one), the mean of each part and of the
    client's send lag (``lag``: paced calls count from their scheduled start), which with
    ``outside`` and ``total`` adds up to their latency.
    ``latency_ms``, ``lag_ms`` (empty for a closed-loop phase) and ``parts`` are per call, in
    one order. None when no call carried the gateway's header (a passthrough, an older
    gateway)."""
    if not any(parts):
        return None
    spread: dict[str, dict[str, float | None]] = {}
    for name in PARTS:
        values = [p[name] for p in parts if name in p]
        if values:
            spread[name] = {"p50": percentile(values, 50), "p99": percentile(values, 99)}
    by_latency = sorted(range(len(latency_ms)), key=latency_ms.__getitem__, reverse=True)
    slow = [n for n in by_latency[: max(1, math.ceil(len(latency_ms) / 100))] if parts[n]]
    tail: dict[str, float] = {}
    if slow:
        tail["latency"] = statistics.fmean(latency_ms[n] for n in slow)
        tail["lag"] = statistics.fmean(lag_ms[n] for n in slow) if lag_ms else 0.0
        for name in PARTS:
            tail[name] = statistics.fmean(parts[n].get(name, 0.0) for n in slow)
    return {
        "calls": sum(1 for p in parts if p),
        "parts": spread,
        "slowest": {"calls": len(slow), "meanMs": tail},
    }


# --- the client ------------------------------------------------------------------------------


class CallFailed(Exception):
    def __init__(self, what: str, status: int, body: bytes) -> None:
        self.status = status
        self.body = body
        try:
            code = str(json.loads(body).get("code", "-"))
        except (ValueError, AttributeError):
            code = "-"
        self.key = f"{what} {status} {code}"
        super().__init__(self.key)

    @property
    def sample(self) -> str:
        return f"{self.key}: {self.body[:300].decode(errors='replace')}"


def effect_id(task_id: str, revision: int, node: str, slot: str) -> str:
    """The contract's effectId, computed independently of the gateway."""
    raw = json.dumps([task_id, revision, node, slot], separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()


@dataclass(frozen=True)
class Claim:
    task_id: str
    attempt_id: str
    generation: int
    epoch: int
    cancel: int
    revision: int

    def headers(self) -> dict[str, str]:
        return {
            "Fence-Task": self.task_id,
            "Fence-Attempt": self.attempt_id,
            "Fence-Generation": str(self.generation),
            "Fence-Epoch": str(self.epoch),
            "Fence-Cancel": str(self.cancel),
            "Content-Type": "application/json",
        }


async def _json_call(
    session: aiohttp.ClientSession,
    what: str,
    method: str,
    url: str,
    body: Any = None,
    auth: dict[str, str] | None = None,
) -> Any:
    data = None if body is None else json.dumps(body).encode()
    headers = dict(auth or {})
    if body is not None:
        headers["Content-Type"] = "application/json"
    async with session.request(method, url, data=data, headers=headers) as resp:
        raw = await resp.read()
        if not 200 <= resp.status < 300:
            raise CallFailed(what, resp.status, raw)
    return json.loads(raw)


async def claim_tasks(
    session: aiohttp.ClientSession,
    base: str,
    prefix: str,
    count: int,
    auth: dict[str, str] | None = None,
) -> list[Claim]:
    got = await _json_call(session, "epoch", "GET", f"{base}/v1/epoch", auth=auth)
    epoch = int(got["schedulerEpoch"])
    claims = []
    for n in range(count):
        task_id = f"{prefix}.t{n}"
        url = f"{base}/v1/tasks/{task_id}"
        await _json_call(session, "put", "PUT", url, {"inputDigest": "x"}, auth=auth)
        got = await _json_call(
            session,
            "claim",
            "POST",
            f"{url}/claim",
            {"owner": "bench", "ttlMs": TTL_MS, "schedulerEpoch": epoch},
            auth=auth,
        )
        claims.append(
            Claim(
                task_id=task_id,
                attempt_id=str(got["attemptId"]),
                generation=int(got["claimGeneration"]),
                epoch=int(got["schedulerEpoch"]),
                cancel=int(got["cancelGeneration"]),
                revision=int(got["revision"]),
            )
        )
    return claims


def fake_claims(prefix: str, count: int) -> list[Claim]:
    """Headers of the same shape for the passthrough, which checks none of them."""
    return [Claim(f"{prefix}.t{n}", uuid.uuid4().hex, 1, 1, 0, 1) for n in range(count)]


@dataclass
class Calls:
    """What the client saw in one batch of calls."""

    latency_ms: list[float] = field(default_factory=list)
    lag_ms: list[float] = field(default_factory=list)
    #: Per answered call (in ``latency_ms``'s order): ``call_parts`` of its Server-Timing.
    parts: list[dict[str, float]] = field(default_factory=list)
    ok_effects: list[str] = field(default_factory=list)
    failed_effects: list[str] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    samples: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    cut_by_time: bool = False

    @property
    def ok(self) -> int:
        return len(self.latency_ms)

    def record_error(self, key: str, sample: str) -> None:
        self.errors[key] += 1
        if key not in self.samples and len(self.samples) < ERROR_SAMPLES:
            self.samples[key] = sample


class Caller:
    """Sends call ``i`` of a phase: claim ``i % len(claims)``, slot ``{tag}{i}``."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base: str,
        claims: Sequence[Claim],
        tag: str,
        fenced: bool,
        auth: dict[str, str] | None = None,
    ) -> None:
        self.session = session
        self.url = base + CALL_PATH
        self.claims = claims
        self.headers = [{**c.headers(), **(auth or {})} for c in claims]
        self.tag = tag
        self.fenced = fenced

    async def call(self, i: int, out: Calls, start: float | None = None) -> None:
        """One call; its latency counts from ``start`` (its scheduled time) when given."""
        n = i % len(self.claims)
        claim = self.claims[n]
        slot = f"{self.tag}{i}"
        expected = effect_id(claim.task_id, claim.revision, "main", slot)
        headers = {**self.headers[n], "Fence-Slot": slot}
        body = json.dumps({"amount": 100 + i % 900, "currency": "EUR", "ref": slot}).encode()
        t0 = time.perf_counter()
        if start is not None:
            out.lag_ms.append((t0 - start) * 1000)
        else:
            start = t0
        try:
            async with self.session.post(self.url, data=body, headers=headers) as resp:
                raw = await resp.read()
                sent_ms = (time.perf_counter() - t0) * 1000
                status = resp.status
                answer = resp.headers
                if status != 200:
                    raise CallFailed("call", status, raw)
                if self.fenced:
                    got = (
                        answer.get("Fence-Effect-Id"),
                        answer.get("Fence-Effect-State"),
                        answer.get("Fence-Replayed"),
                    )
                    if got != (expected, "COMMITTED", "false"):
                        raise CallFailed("call answer", status, repr(got).encode())
        except CallFailed as exc:
            out.failed_effects.append(expected)
            out.record_error(exc.key, exc.sample)
            return
        except (aiohttp.ClientError, TimeoutError) as exc:
            out.failed_effects.append(expected)
            out.record_error(f"call 0 {type(exc).__name__}", f"{type(exc).__name__}: {exc}")
            return
        out.latency_ms.append((time.perf_counter() - start) * 1000)
        timing = ", ".join(answer.getall("Server-Timing", ()))
        out.parts.append(call_parts(parse_server_timing(timing), sent_ms) if timing else {})
        out.ok_effects.append(expected)


async def closed_loop(
    caller: Caller, first: int, count: int, workers: int, deadline: float
) -> Calls:
    """``workers`` concurrent senders, each sending the next call as soon as its last answered."""
    out = Calls()
    ids: Iterator[int] = iter(range(first, first + count))

    async def worker() -> None:
        for i in ids:
            if time.perf_counter() >= deadline:
                out.cut_by_time = True
                return
            await caller.call(i, out)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    out.seconds = time.perf_counter() - start
    return out


async def open_loop(caller: Caller, first: int, count: int, rate: float, deadline: float) -> Calls:
    """Call ``k`` leaves at ``t0 + k / rate`` whatever happened to the calls before it."""
    out = Calls()
    pending: list[asyncio.Task[None]] = []
    t0 = time.perf_counter() + 0.05
    for k in range(count):
        at = t0 + k / rate
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if time.perf_counter() >= deadline:
            out.cut_by_time = True
            break
        pending.append(asyncio.create_task(caller.call(first + k, out, start=at)))
    await asyncio.gather(*pending)
    out.seconds = time.perf_counter() - t0
    return out


# --- phases ----------------------------------------------------------------------------------


@dataclass
class Target:
    """One proxy under test, and the processes whose CPU a phase on it counts."""

    name: str
    fenced: bool
    store: str | None
    log_level: str | None
    base: str
    procs: list[Proc]
    #: Headers every request to this proxy carries (``Fence-Authorization`` with ``--auth``).
    auth: dict[str, str] = field(default_factory=dict)
    #: The private Redis of a fenced target on Redis (the primaries of a cluster), whose time
    #: per fenced call a phase reports.
    redis_urls: tuple[str, ...] = ()


@dataclass
class PhaseSpec:
    name: str
    target: Target
    mode: str  # "peak" or "paced"
    rate: float | None = None  # paced only: calls per second


@dataclass
class PhaseResult:
    name: str
    target: str
    fenced: bool
    store: str | None
    log_level: str | None
    mode: str
    offered_rate: float | None
    planned: int
    calls: Calls
    cpu_s: dict[str, float] | None
    client_cpu_s: float
    checks: list[str]
    notes: list[str]
    warmup_calls: int = 0
    ledger_before: int = 0  # effects the gateway's store held before this phase
    #: Redis time of the measured part, per fenced call and per script (``redis_call_stats``).
    redis_cpu: dict[str, Any] | None = None

    @property
    def attempted(self) -> int:
        """Calls sent in the phase, warm-up included: each one a new effect when fenced."""
        return self.warmup_calls + self.calls.ok + self.failed

    @property
    def rate(self) -> float:
        return self.calls.ok / self.calls.seconds if self.calls.seconds > 0 else 0.0

    @property
    def failed(self) -> int:
        return sum(self.calls.errors.values())

    @property
    def verified(self) -> bool:
        return not self.checks and not self.failed

    def cpu_ms_per_call(self, process: str) -> float | None:
        if self.cpu_s is None or process not in self.cpu_s or not self.calls.ok:
            return None
        return self.cpu_s[process] * 1000 / self.calls.ok

    def store_cpu_ms_per_call(self) -> float | None:
        """CPU of the store's server processes per call; None for SQLite (in the gateway)."""
        mine = [self.cpu_ms_per_call(name) for name in STORE_SERVERS]
        present = [v for v in mine if v is not None]
        return sum(present) if present else None


async def downstream_stats(session: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    stats: dict[str, Any] = await _json_call(
        session, "downstream stats", "GET", f"{base}/_stats?reset=1"
    )
    return stats


def verify_downstream(
    stats: dict[str, Any], fenced: bool, ok: Sequence[str], failed: Sequence[str]
) -> list[str]:
    """What the downstream saw against what the client was answered; [] when all is well."""
    problems: list[str] = []
    by_key: dict[str, int] = stats["byKey"]
    if not fenced:
        if stats["calls"] != len(ok):
            problems.append(f"downstream saw {stats['calls']} calls for {len(ok)} answered 200")
        return problems
    dups = {k: c for k, c in by_key.items() if c != 1}
    if dups:
        problems.append(f"{len(dups)} effects reached the downstream more than once")
    missing = set(ok) - set(by_key)
    if missing:
        problems.append(f"{len(missing)} effects answered COMMITTED never reached the downstream")
    extra = set(by_key) - set(ok)
    if extra:
        unanswered = len(extra & set(failed))
        problems.append(
            f"{len(extra)} effects reached the downstream without a 200 COMMITTED answer "
            f"({unanswered} of them were calls that failed)"
        )
    if stats["noKey"]:
        problems.append(f"{stats['noKey']} downstream calls carried no Idempotency-Key")
    if stats["withToken"] != stats["calls"]:
        problems.append(f"{stats['calls'] - stats['withToken']} calls carried no Fencing-Token")
    return problems


async def read_back(
    session: aiohttp.ClientSession,
    base: str,
    effect_ids: Sequence[str],
    auth: dict[str, str] | None = None,
) -> list[str]:
    """A few effects through the ledger API: they must read COMMITTED with one attempt."""
    problems = []
    step = max(1, len(effect_ids) // READ_BACK)
    for eid in effect_ids[::step][:READ_BACK]:
        try:
            url = f"{base}/v1/effects/{eid}"
            record = await _json_call(session, "effect", "GET", url, auth=auth)
        except CallFailed as exc:
            problems.append(f"GET /v1/effects/{eid[:12]}...: {exc.key}")
            continue
        if record.get("state") != "COMMITTED" or len(record.get("attempts", [])) != 1:
            problems.append(
                f"effect {eid[:12]}... reads {record.get('state')} with "
                f"{len(record.get('attempts', []))} attempts"
            )
    return problems


#: What runs a script: its time in INFO commandstats includes every command the script ran.
_SCRIPT_RUNNERS = frozenset({"evalsha", "evalsha_ro", "eval", "eval_ro", "fcall", "fcall_ro"})
#: Commands the benchmark itself sends around a measured phase (INFO commandstats names).
_BENCH_OWN = ("config|", "slowlog|", "info", "client|", "hello", "ping", "function|", "script|")
_LUA_CALL = re.compile(r"""redis\.p?call\(\s*(['"]?)([A-Za-z_|]*)""")


def lua_commands(source: Path | None) -> frozenset[str] | None:
    """The commands the gateway's Lua (from ``source``, else this tree) can run, lower case
    as INFO commandstats names them; None when that cannot be told (no Lua found, or a call
    whose command is not a literal)."""
    root = source if source is not None else Path(__file__).resolve().parents[1]
    files = sorted((root / "ledger" / "lua").glob("*.lua"))
    names: set[str] = set()
    for path in files:
        for quote, name in _LUA_CALL.findall(path.read_text()):
            if not quote:
                return None
            names.add(name.lower())
    return frozenset(names) if files else None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def redis_call_stats(urls: Sequence[str], source: Path | None, calls: int) -> dict[str, Any]:
    """Redis time per fenced call of a measured phase, as issue 30 counts it: the usec of
    every script run (EVALSHA/EVAL/FCALL, the commands each ran included) plus that of every
    command the gateway sent outside a script (the write mark's INCR and HMGET, WAIT,
    pipelined reads...), over ``calls``; read right after the phase, before any read-back.
    Switches the SLOWLOG back to Redis's default.

    INFO commandstats counts a command a script ran under that command's name too, and Redis
    7.0 cannot tell which runs of a name were a script's. A name no Lua file of the gateway
    calls was sent outside scripts only: all its time counts (exact). A name the scripts also
    call counts with the runs the SLOWLOG saw outside scripts (those of at least
    ``_procs._SLOWLOG_USEC``; ``sharedMissed`` says so): logging every command to tell them
    apart would cost the scripts more than these commands weigh (``_procs._SLOWLOG_USEC``).
    Per script (an EVALSHA named by its SHA-1, an FCALL by its function), from the SLOWLOG
    scaled to commandstats' exact total, as ``_procs.redis_script_stats`` does."""
    stats: Counter[tuple[str, str]] = Counter()
    entries: list[Any] = []
    for url in urls:  # a cluster's primaries: their sums
        client = redis.Redis.from_url(url, decode_responses=True)
        try:
            for key, line in client.info("commandstats").items():
                stats[key, "usec"] += int(line.get("usec", 0))
                stats[key, "calls"] += int(line.get("calls", 0))
            entries += client.slowlog_get(-1)
            client.config_set("slowlog-log-slower-than", 10_000)
            client.slowlog_reset()
        finally:
            client.close()
    names = redis_script_names(source)
    inside = lua_commands(source)
    script_usec = plain_usec = 0
    plain: Counter[str] = Counter()
    shared: set[str] = set()
    for key in sorted({key for key, _ in stats}):
        name = key.removeprefix("cmdstat_")
        if name in _SCRIPT_RUNNERS:
            script_usec += stats[key, "usec"]
        elif name.startswith(_BENCH_OWN):
            continue
        elif inside is not None and name.split("|")[0] not in inside:
            plain_usec += stats[key, "usec"]
            plain[name] += stats[key, "calls"]
        else:
            shared.add(name.split("|")[0])
    scripts: dict[str, list[int]] = {}
    for entry in entries:
        # Bytes whatever decode_responses says (redis-py's SLOWLOG GET parser).
        argv = _text(entry["command"]).split(" ", 2)
        name = argv[0].lower()
        if _text(entry["client_address"]) == "?:0" or name.startswith(_BENCH_OWN):
            continue  # run by a script (in its time), or the benchmark's own
        if name in _SCRIPT_RUNNERS and len(argv) > 1:
            script = names.get(argv[1], argv[1][:12]) if name.startswith("evalsha") else argv[1]
            runs_usec = scripts.setdefault(script, [0, 0])
            runs_usec[0] += 1
            runs_usec[1] += int(entry["duration"])
        elif name in shared:
            plain_usec += int(entry["duration"])
            plain[f"{name} (>= slowlog threshold)"] += 1
    logged = sum(usec for _, usec in scripts.values())
    scale = script_usec / logged if logged else 1.0

    def per_call(usec: float) -> float | None:
        return round(usec / calls, 1) if calls else None

    total = script_usec + plain_usec
    return {
        "calls": calls,
        "fencedUsecPerCall": per_call(total),
        "fencedCallsPerSecondOneRedis": round(1e6 * calls / total) if calls and total else None,
        "scriptUsecPerCall": per_call(script_usec),
        "plainUsecPerCall": per_call(plain_usec),
        "plainCommands": dict(plain),
        "sharedMissed": inside is None or bool(shared),
        "slowlogCoverage": round(logged / script_usec, 3) if script_usec else None,
        "scripts": {
            name: {
                "runs": runs,
                "usecPerRun": round(usec / runs, 1) if runs else None,
                "usecPerCall": per_call(usec * scale),
            }
            for name, (runs, usec) in sorted(scripts.items())
        },
    }


def render_redis_time(phase: str, report: dict[str, Any]) -> str:
    """What the total holds, then the split by script."""
    plain = ", ".join(f"{name} x{n}" for name, n in sorted(report["plainCommands"].items()))
    head = (
        f"{phase}: Redis usec per call {fmt(report['fencedUsecPerCall'], '.1f')} = scripts "
        f"{fmt(report['scriptUsecPerCall'], '.1f')} (EVALSHA/FCALL) + commands outside scripts "
        f"{fmt(report['plainUsecPerCall'], '.1f')} ({plain or 'none'})"
        + (
            "; runs under the SLOWLOG threshold of commands the scripts also run are not seen"
            if report["sharedMissed"]
            else ""
        )
        + f"; one Redis serves at most ~{report['fencedCallsPerSecondOneRedis']} calls/s"
    )
    rows = [("script", "runs", "usec/run", "usec/call")]
    for name, line in report["scripts"].items():
        rows.append(
            (
                name,
                str(line["runs"]),
                fmt(line["usecPerRun"], ".1f"),
                fmt(line["usecPerCall"], ".1f"),
            )
        )
    coverage = f"split by script from the SLOWLOG (coverage {report['slowlogCoverage']})"
    return f"{head}\n{coverage}\n{align(rows)}"


def render_redis_summary(summaries: Sequence[dict[str, Any]]) -> str | None:
    """One line per measured Redis phase: the time per fenced call and the prepare/complete
    split (usec per run of each, from the SLOWLOG; keyed calls: ``prepare_keyed``)."""
    rows = [("phase", "Redis usec/call", "scripts", "outside", "prepare usec/run", "complete")]
    for s in summaries:
        report = s["redisCpu"]
        if not report:
            continue
        scripts = report["scripts"]

        def run(*names: str, scripts: dict[str, Any] = scripts) -> str:
            # A script by its Lua name, a function by ``<library>_<name>`` (FCALL).
            found = [
                entry["usecPerRun"]
                for name in names
                for script, entry in scripts.items()
                if script == name or script.endswith(f"_{name}")
            ]
            return fmt(found[0], ".1f") if found else "-"

        rows.append(
            (
                s["phase"],
                fmt(report["fencedUsecPerCall"], ".1f"),
                fmt(report["scriptUsecPerCall"], ".1f"),
                fmt(report["plainUsecPerCall"], ".1f"),
                run("prepare", "prepare_keyed"),
                run("complete"),
            )
        )
    if len(rows) == 1:
        return None
    return "Redis time per fenced call (INFO commandstats; the split from the SLOWLOG)\n\n" + align(
        rows
    )


async def run_phase(
    spec: PhaseSpec,
    n: int,
    downstream: str,
    downstream_procs: Sequence[Proc],
    args: argparse.Namespace,
) -> PhaseResult:
    target = spec.target
    paced = spec.mode == "paced"
    limit = args.max_in_flight if paced else args.concurrency
    connector = aiohttp.TCPConnector(limit=limit)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    notes: list[str] = []
    checks: list[str] = []
    prefix = f"bench.{uuid.uuid4().hex[:8]}.{n:02d}"
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        before = await downstream_stats(session, downstream)
        if before["calls"]:
            notes.append(f"the downstream saw {before['calls']} calls between phases")
        if target.fenced:
            claims = await claim_tasks(session, target.base, prefix, args.tasks, target.auth)
        else:
            claims = fake_claims(prefix, args.tasks)
        caller = Caller(session, target.base, claims, "s", target.fenced, target.auth)

        # Not measured: open the connections, load the scripts, warm the caches.
        warm = await closed_loop(
            caller, 0, args.warmup, args.concurrency, time.perf_counter() + args.max_seconds
        )
        if warm.errors:
            notes.append(f"warm-up errors: {dict(warm.errors)}")

        procs = [*target.procs, *downstream_procs]
        if not paced:
            for redis_url in target.redis_urls:
                redis_stats_reset(redis_url, 20 * args.requests + 1000)
        cpu_before = [p.cpu() for p in procs]
        client_before = time.process_time()
        deadline = time.perf_counter() + args.max_seconds
        if paced:
            assert spec.rate is not None
            count = max(1, round(spec.rate * args.paced_seconds))
            calls = await open_loop(caller, args.warmup, count, spec.rate, deadline)
        else:
            count = args.requests
            calls = await closed_loop(caller, args.warmup, count, args.concurrency, deadline)
        client_cpu = time.process_time() - client_before
        cpu_after = [p.cpu() for p in procs]
        redis_cpu = None
        if target.redis_urls and not paced:
            redis_cpu = redis_call_stats(target.redis_urls, args.gateway_src, calls.ok)
        cpu: dict[str, float] | None = {}
        for proc, a, b in zip(procs, cpu_before, cpu_after, strict=True):
            if a is None or b is None or cpu is None:
                cpu = None
            else:
                cpu[proc.name] = cpu.get(proc.name, 0.0) + b - a  # --workers: N passthroughs

        stats = await downstream_stats(session, downstream)
        checks += verify_downstream(
            stats,
            target.fenced,
            warm.ok_effects + calls.ok_effects,
            warm.failed_effects + calls.failed_effects,
        )
        if target.fenced:
            checks += await read_back(session, target.base, calls.ok_effects, target.auth)
    if calls.cut_by_time:
        sent = calls.ok + sum(calls.errors.values())
        notes.append(f"stopped by --max-seconds after {sent} calls")
    for proc in procs:
        if not proc.alive():
            notes.append(f"{proc.name} died during the run (exit {proc.popen.returncode})")
    return PhaseResult(
        name=spec.name,
        target=target.name,
        fenced=target.fenced,
        store=target.store,
        log_level=target.log_level,
        mode=spec.mode,
        offered_rate=spec.rate,
        planned=count,
        calls=calls,
        cpu_s=cpu,
        client_cpu_s=client_cpu,
        checks=checks,
        notes=notes,
        warmup_calls=warm.ok + sum(warm.errors.values()),
        redis_cpu=redis_cpu,
    )


# --- processes -------------------------------------------------------------------------------


@dataclass
class Setup:
    """Every process of a run, started once and stopped at the end."""

    work: Path
    downstream: Proc | None = None
    downstream_base: str = ""
    targets: dict[str, Target] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)  # in start order
    redis_version: str | None = None
    postgres_version: str | None = None
    ledger_sizes: dict[str, int] = field(default_factory=dict)  # target -> effects written

    def stop(self) -> dict[str, int | None]:
        codes: dict[str, int | None] = {}
        for proc in reversed(self.procs):  # gateways before their store
            codes[f"{proc.name} ({proc.log_path.parent.name})"] = proc.stop()
        return codes


def _auth_toml(token: str) -> str:
    """An ``[auth]`` section admitting ``token`` (its SHA-256 only, as `fencegate token new`
    prints it) for one principal with every role."""
    roles = ", ".join(f'"{role}"' for role in AUTH_ROLES)
    return (
        "[[auth.principals]]\n"
        f'name = "{AUTH_PRINCIPAL}"\n'
        f"roles = [{roles}]\n"
        f'token_sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"\n'
    )


def _gateway_toml(downstream_base: str) -> str:
    return (
        "[leases]\n"
        f"max_ttl_ms = {MAX_TTL_MS}\n"
        f"default_max_runtime_ms = {MAX_TTL_MS}\n"
        "[[downstreams]]\n"
        f'name = "{DOWNSTREAM}"\n'
        f'url = "{downstream_base}"\n'
        "timeout_ms = 10000\n"
    )


def start_cluster(directory: Path) -> tuple[str, tuple[str, ...], str, list[Proc]]:
    """A private Redis Cluster (``tests.cluster_servers``: three primaries and three replicas,
    AOF with ``appendfsync always``): its store URL, its primaries' URLs (where a phase reads
    the Redis time: a replica's commandstats count the replicated writes again), the Redis
    version and its nodes as processes (stopped with the others)."""
    from tests.cluster_servers import ClusterServers  # run from the repository root

    cluster = ClusterServers(directory).start()
    nodes = []
    for node in cluster.nodes:
        assert node.proc is not None
        nodes.append(Proc("redis-server", node.proc, node.log_path))
    primaries = tuple(f"redis://{node.address}" for node in cluster.primaries())
    version = str(cluster.nodes[0].info("server")["redis_version"])
    return cluster.url, primaries, version, nodes


def start_all(setup: Setup, args: argparse.Namespace) -> None:
    work = setup.work
    setup.downstream, setup.downstream_base = start_module_server(
        "downstream", "bench.proxy", "--serve-downstream", work / "downstream"
    )
    setup.procs.append(setup.downstream)
    proc, base = start_module_server(
        "passthrough",
        "bench.proxy",
        "--serve-passthrough",
        work / "passthrough",
        ["--downstream-url", setup.downstream_base],
    )
    setup.procs.append(proc)
    passthroughs = [proc]
    for n in range(1, args.workers):
        more, _ = start_module_server(
            "passthrough",
            "bench.proxy",
            "--serve-passthrough",
            work / f"passthrough-{n}",
            ["--downstream-url", setup.downstream_base],
            port=int(base.rpartition(":")[2]),
        )
        setup.procs.append(more)
        passthroughs.append(more)
    # With --auth the passthrough gets the same header too, so both proxies parse the same
    # requests (it forwards it like the other Fence-* headers; the gateway never does).
    auth: dict[str, str] = {}
    extra = _gateway_toml(setup.downstream_base)
    if args.auth:
        token = secrets.token_urlsafe(32)  # like `fencegate token new`; never written anywhere
        auth = {AUTH_HEADER: f"Bearer {token}"}
        extra += _auth_toml(token)
    extra += "".join(f"{t}\n" for t in args.gateway_toml)
    setup.targets["passthrough"] = Target(
        "passthrough", False, None, None, base, passthroughs, auth
    )
    levels = [args.log_level] + ([] if args.no_info or args.log_level == "info" else ["info"])
    for store in args.stores:
        store_procs: list[Proc] = []
        postgres_urls: list[str] = []
        primaries: tuple[str, ...] = ()
        if store == "cluster":
            url, primaries, setup.redis_version, nodes = start_cluster(work / "cluster")
            setup.procs.extend(nodes)
            store_procs.extend(nodes)
        elif store == "redis":
            server, url, setup.redis_version = start_redis(
                args.redis_server, work / "redis", args.appendfsync
            )
            setup.procs.append(server)
            store_procs.append(server)
        elif store == "postgres":
            # One cluster (like the one redis-server), a database of its own per gateway.
            pg, postgres_urls, setup.postgres_version = start_postgres(
                work / "postgres", work, [f"fencegate_{level}" for level in levels]
            )
            setup.procs.append(pg)
            store_procs.append(pg)
        store_lines: list[str] = []
        if store == "postgres" and args.postgres_max_connections is not None:
            store_lines = [f"postgres_max_connections = {args.postgres_max_connections}"]
        for n, level in enumerate(levels):
            name = store if level == args.log_level else f"{store} {level}"
            directory = work / f"gateway-{name.replace(' ', '-')}"
            if store == "sqlite":
                url = f"sqlite:///{directory / 'fencegate.db'}"  # absolute path: four slashes
            elif store == "postgres":
                url = postgres_urls[n]
            python_args: list[str] = []
            if args.cprofile:
                prof = Path(args.cprofile).resolve() / f"gateway-{name.replace(' ', '-')}.prof"
                python_args = ["-m", "cProfile", "-o", str(prof)]
            gateway, base = start_gateway(
                directory,
                url,
                log_level=level,
                sqlite_synchronous=args.sqlite_synchronous,
                source=args.gateway_src,
                store_timeout_ms=None,
                extra_toml=extra,
                python_args=python_args,
                workers=args.workers,
                event_loop=args.event_loop,
                durable=args.appendfsync == "always" or store == "postgres",
                store_lines=store_lines,
            )
            setup.procs.append(gateway)
            progress(f"gateway {name}: pid {gateway.pid}, {base}")
            redis_urls = (url,) if store == "redis" else primaries
            setup.targets[name] = Target(
                name, True, store, level, base, [gateway, *store_procs], auth, redis_urls
            )


def peak_plan(setup: Setup, args: argparse.Namespace) -> list[PhaseSpec]:
    """passthrough, redis, passthrough, [redis info, passthrough,] sqlite, passthrough, ..."""
    passthrough = setup.targets["passthrough"]
    plan = [PhaseSpec("passthrough", passthrough, "peak")]
    for round_ in range(1, args.rounds + 1):
        for store in args.stores:
            names = [store]
            info = f"{store} info"
            if round_ == 1 and info in setup.targets:
                names.append(info)
            for name in names:
                label = name if args.rounds == 1 or name == info else f"{name} #{round_}"
                plan.append(PhaseSpec(label, setup.targets[name], "peak"))
                plan.append(PhaseSpec("passthrough", passthrough, "peak"))
    return plan


def paced_plan(setup: Setup, args: argparse.Namespace, rates: dict[str, float]) -> list[PhaseSpec]:
    """Per store: passthrough, store, passthrough (, store, passthrough ...) at one rate."""
    passthrough = setup.targets["passthrough"]
    plan = []
    for store in args.stores:
        rate = rates.get(store)
        if not rate:
            continue
        label = f"@{rate:.0f}/s"
        plan.append(PhaseSpec(f"passthrough {label}", passthrough, "paced", rate))
        for round_ in range(1, args.paced_rounds + 1):
            suffix = "" if args.paced_rounds == 1 else f" #{round_}"
            plan.append(PhaseSpec(f"{store} {label}{suffix}", setup.targets[store], "paced", rate))
            plan.append(PhaseSpec(f"passthrough {label}", passthrough, "paced", rate))
    return plan


async def run_plan(
    setup: Setup, plan: Sequence[PhaseSpec], first: int, args: argparse.Namespace
) -> list[PhaseResult]:
    results = []
    assert setup.downstream is not None
    for n, spec in enumerate(plan, start=first):
        ledger = setup.ledger_sizes.get(spec.target.name, 0)
        what = f"{spec.rate:.0f}/s open loop" if spec.rate else f"concurrency {args.concurrency}"
        progress(f"{spec.name}: {what} ...")
        result = await run_phase(spec, n, setup.downstream_base, [setup.downstream], args)
        result.ledger_before = ledger
        if spec.target.fenced:
            setup.ledger_sizes[spec.target.name] = ledger + result.attempted
        results.append(result)
        state = "verified" if result.verified else "NOT VERIFIED"
        progress(
            f"{spec.name}: {result.calls.ok} calls in {result.calls.seconds:.2f}s "
            f"({result.rate:.0f}/s), p99 {fmt(percentile(result.calls.latency_ms, 99), '.2f')} "
            f"ms, {result.failed} failed, {state}"
        )
    return results


async def run_all(setup: Setup, args: argparse.Namespace) -> list[PhaseResult]:
    results = await run_plan(setup, peak_plan(setup, args), 0, args)
    rates = {}
    for store in args.stores:
        peaks = [r.rate for r in results if r.target == store and r.mode == "peak" and r.rate]
        if args.paced_rate:
            # A fixed rate: two runs (two gateway versions) are paced alike, whatever their peaks.
            rates[store] = args.paced_rate
        elif peaks:
            rates[store] = args.paced_fraction * statistics.median(peaks)
    results += await run_plan(setup, paced_plan(setup, args, rates), len(results), args)
    return results


# --- report ----------------------------------------------------------------------------------


def neighbours(results: Sequence[PhaseResult], i: int) -> list[PhaseResult]:
    """The passthrough phases just before and after ``results[i]`` (same mode and rate)."""
    me = results[i]
    return [
        r
        for r in (results[i - 1] if i else None, results[i + 1] if i + 1 < len(results) else None)
        if r is not None
        and not r.fenced
        and r.mode == me.mode
        and r.offered_rate == me.offered_rate
        and r.calls.ok
    ]


def pooled(phases: Sequence[PhaseResult]) -> tuple[float | None, list[float]]:
    """(calls per second, latencies) of phases taken together."""
    seconds = sum(p.calls.seconds for p in phases)
    calls = sum(p.calls.ok for p in phases)
    rate = calls / seconds if seconds > 0 else None
    return rate, [x for p in phases for x in p.calls.latency_ms]


def phase_summary(results: Sequence[PhaseResult], i: int) -> dict[str, Any]:
    r = results[i]
    lat = r.calls.latency_ms
    base_rate, base_lat = pooled(neighbours(results, i)) if r.fenced else (None, [])
    p99 = percentile(lat, 99)
    base_p99 = percentile(base_lat, 99)
    proxy = "gateway" if r.fenced else "passthrough"
    return {
        "phase": r.name,
        "target": r.target,
        "fenced": r.fenced,
        "store": r.store,
        "logLevel": r.log_level,
        "mode": r.mode,
        "offeredRate": _round(r.offered_rate, 1),
        "plannedCalls": r.planned,
        "calls": r.calls.ok,
        "failedCalls": r.failed,
        "seconds": round(r.calls.seconds, 3),
        "cutByMaxSeconds": r.calls.cut_by_time,
        "callsPerSecond": round(r.rate, 1),
        "p50Ms": _round(percentile(lat, 50)),
        "p90Ms": _round(percentile(lat, 90)),
        "p99Ms": _round(p99),
        "maxMs": _round(max(lat, default=None)),
        "clientLagP99Ms": _round(percentile(r.calls.lag_ms, 99)),
        "proxyCpuMsPerCall": _round(r.cpu_ms_per_call(proxy), 3),
        "cpuMsPerCallByProcess": {
            name: _round(cpu * 1000 / r.calls.ok, 3)
            for name, cpu in (r.cpu_s or {}).items()
            if r.calls.ok
        },
        "clientCpuMsPerCall": _round(r.client_cpu_s * 1000 / r.calls.ok if r.calls.ok else None, 3),
        "rateVsPassthrough": _round(r.rate / base_rate, 3) if base_rate else None,
        "passthroughP99Ms": _round(base_p99),
        "addedP99Ms": _round(p99 - base_p99) if p99 is not None and base_p99 is not None else None,
        "ledgerEffectsBefore": r.ledger_before if r.fenced else None,
        "redisCpu": r.redis_cpu,
        "serverTiming": timing_breakdown(lat, r.calls.lag_ms, r.calls.parts),
        "verified": r.verified,
        "checks": r.checks,
        "errors": dict(r.calls.errors),
        "errorSamples": list(r.calls.samples.values()),
        "notes": r.notes,
    }


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def render_phases(summaries: Sequence[dict[str, Any]]) -> str:
    header = ("phase", "calls", "failed", "seconds", "calls/s", "p50 ms", "p99 ms",
              "proxy CPU ms/call", "rate / pass", "added p99 ms", "ledger", "verified")  # fmt: skip
    rows: list[tuple[str, ...]] = [header]
    for s in summaries:
        rows.append(
            (
                s["phase"],
                str(s["calls"]),
                str(s["failedCalls"]),
                fmt(s["seconds"], ".2f"),
                fmt(s["callsPerSecond"], ".0f"),
                fmt(s["p50Ms"], ".2f"),
                fmt(s["p99Ms"], ".2f"),
                fmt(s["proxyCpuMsPerCall"], ".3f"),
                fmt(s["rateVsPassthrough"], ".3f"),
                fmt(s["addedP99Ms"], "+.2f") if s["mode"] == "paced" else "-",
                "-" if s["ledgerEffectsBefore"] is None else str(s["ledgerEffectsBefore"]),
                "yes" if s["verified"] else "NO",
            )
        )
    return align(rows)


def render_timing(summaries: Sequence[dict[str, Any]]) -> str | None:
    """Per phase with the gateway's Server-Timing: p50 / p99 of each part, then the mean of
    each part over its slowest 1% of calls."""
    phases = [s for s in summaries if s.get("serverTiming")]
    if not phases:
        return None
    names = [n for n in PARTS if any(n in s["serverTiming"]["parts"] for s in phases)]
    rows: list[tuple[str, ...]] = [("phase", "calls", *(f"{n} p50/p99" for n in names))]
    for s in phases:
        spread = s["serverTiming"]["parts"]
        cells = [
            f"{fmt(spread[n]['p50'], '.1f')} / {fmt(spread[n]['p99'], '.1f')}"
            if n in spread
            else "-"
            for n in names
        ]
        rows.append((s["phase"], str(s["serverTiming"]["calls"]), *cells))
    tail_names = ["latency", "lag", *names]
    tail_rows: list[tuple[str, ...]] = [("phase", "calls", *tail_names)]
    for s in phases:
        slowest = s["serverTiming"]["slowest"]
        mean = slowest["meanMs"]
        tail_rows.append(
            (s["phase"], str(slowest["calls"]), *(fmt(mean.get(n), ".1f") for n in tail_names))
        )
    return (
        "where a fenced call's time goes (ms, from the gateway's Server-Timing; other: its total "
        "less its steps; outside: the client's latency from sending less the gateway's total)\n\n"
        + align(rows)
        + "\n\nthe slowest 1% of calls (at least one): mean ms of each part "
        "(lag + outside + total = latency)\n\n" + align(tail_rows)
    )


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def store_figures(
    results: Sequence[PhaseResult], summaries: Sequence[dict[str, Any]], stores: Sequence[str]
) -> list[dict[str, Any]]:
    """Per store: the peak medians over rounds, the info-level phase, the paced comparison."""
    figures = []
    for store in stores:
        peak = [i for i, r in enumerate(results) if r.target == store and r.mode == "peak"]
        paced = [i for i, r in enumerate(results) if r.target == store and r.mode == "paced"]
        info = [i for i, r in enumerate(results) if r.target == f"{store} info"]
        if not peak:
            continue
        base = [p for i in peak for p in neighbours(results, i)]
        base_rate, base_lat = pooled(base)
        fenced_lat = [x for i in peak for x in results[i].calls.latency_ms]
        paced_base = [p for i in paced for p in neighbours(results, i)]
        paced_fenced = [x for i in paced for x in results[i].calls.latency_ms]
        paced_p99 = percentile(paced_fenced, 99)
        paced_base_p99 = percentile([x for p in paced_base for x in p.calls.latency_ms], 99)
        added = (
            paced_p99 - paced_base_p99
            if paced_p99 is not None and paced_base_p99 is not None
            else None
        )
        ratio = _median([summaries[i]["rateVsPassthrough"] for i in peak])
        figures.append(
            {
                "store": store,
                "rounds": len(peak),
                "passthroughCallsPerSecond": _round(base_rate, 1),
                "passthroughP50Ms": _round(percentile(base_lat, 50)),
                "passthroughP99Ms": _round(percentile(base_lat, 99)),
                "fencedCallsPerSecond": _round(_median([results[i].rate for i in peak]), 1),
                "fencedP50Ms": _round(percentile(fenced_lat, 50)),
                "fencedP99Ms": _round(percentile(fenced_lat, 99)),
                "ratio": ratio,
                "ratioTarget": RATIO_TARGETS[store],
                "gatewayCpuMsPerCall": _round(
                    _median([summaries[i]["proxyCpuMsPerCall"] for i in peak]), 3
                ),
                "passthroughCpuMsPerCall": _round(
                    _median([p.cpu_ms_per_call("passthrough") for p in base]), 3
                ),
                # redis-server, or the PostgreSQL postmaster with all its backends (/proc).
                "storeServerCpuMsPerCall": _round(
                    _median([results[i].store_cpu_ms_per_call() for i in peak]), 3
                ),
                "infoCallsPerSecond": _round(results[info[0]].rate, 1) if info else None,
                "infoRatio": summaries[info[0]]["rateVsPassthrough"] if info else None,
                "infoGatewayCpuMsPerCall": summaries[info[0]]["proxyCpuMsPerCall"]
                if info
                else None,
                "pacedRate": _round(results[paced[0]].offered_rate, 1) if paced else None,
                "pacedPassthroughP50Ms": _round(
                    percentile([x for p in paced_base for x in p.calls.latency_ms], 50)
                ),
                "pacedPassthroughP99Ms": _round(paced_base_p99),
                "pacedFencedP50Ms": _round(percentile(paced_fenced, 50)),
                "pacedFencedP99Ms": _round(paced_p99),
                "addedP99Ms": _round(added),
                "pacedClientLagP99Ms": _round(
                    percentile([x for i in paced for x in results[i].calls.lag_ms], 99)
                ),
                "addedP99TargetMs": ADDED_P99_TARGET_MS,
                "verified": all(results[i].verified for i in peak + paced + info),
            }
        )
    return figures


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "MISSED")


def render_figures(figures: Sequence[dict[str, Any]]) -> str:
    header = ("store", "pass calls/s", "pass p50/p99 ms", "fenced calls/s", "fenced p50/p99 ms",
              "ratio", "target", "info calls/s", "info ratio", "paced rate",
              "pass p99 ms", "fenced p99 ms", "added p99 ms", "target")  # fmt: skip
    rows: list[tuple[str, ...]] = [header]
    for f in figures:
        ratio, added = f["ratio"], f["addedP99Ms"]
        rows.append(
            (
                f["store"],
                fmt(f["passthroughCallsPerSecond"], ".0f"),
                f"{fmt(f['passthroughP50Ms'], '.2f')} / {fmt(f['passthroughP99Ms'], '.2f')}",
                fmt(f["fencedCallsPerSecond"], ".0f"),
                f"{fmt(f['fencedP50Ms'], '.2f')} / {fmt(f['fencedP99Ms'], '.2f')}",
                fmt(ratio, ".3f"),
                "-"
                if f["ratioTarget"] is None
                else f">={f['ratioTarget']} "
                + _verdict(None if ratio is None else ratio >= f["ratioTarget"]),
                fmt(f["infoCallsPerSecond"], ".0f"),
                fmt(f["infoRatio"], ".3f"),
                fmt(f["pacedRate"], ".0f"),
                fmt(f["pacedPassthroughP99Ms"], ".2f"),
                fmt(f["pacedFencedP99Ms"], ".2f"),
                fmt(added, "+.2f"),
                f"<={f['addedP99TargetMs']:g} "
                + _verdict(None if added is None else added <= f["addedP99TargetMs"]),
            )
        )
    return align(rows)


# --- main ------------------------------------------------------------------------------------


#: Stores measured by default, in phase order.
STORES_DEFAULT = "redis,sqlite,postgres"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.proxy",
        description="fenced mutations per second and latency through the gateway's proxy, per "
        "store, against a bare aiohttp passthrough proxy in front of the same downstream.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--requests", type=int, default=2000, help="measured calls per peak (closed-loop) phase"
    )
    parser.add_argument(
        "--concurrency", type=int, default=16, help="concurrent senders in peak phases"
    )
    parser.add_argument("--rounds", type=int, default=2, help="peak phases per store")
    parser.add_argument(
        "--tasks", type=int, default=4, help="claimed tasks per phase (calls spread over them)"
    )
    parser.add_argument("--warmup", type=int, default=200, help="unmeasured calls per phase")
    parser.add_argument(
        "--paced-fraction",
        type=float,
        default=0.5,
        help="paced (open-loop) rate, as a fraction of the store's median fenced peak",
    )
    parser.add_argument(
        "--paced-rate",
        type=float,
        default=None,
        metavar="CALLS_PER_S",
        help="paced (open-loop) rate in calls/s for every store, instead of --paced-fraction "
        "(to compare two runs at the same offered load)",
    )
    parser.add_argument(
        "--paced-seconds", type=float, default=8.0, help="length of each paced phase"
    )
    parser.add_argument("--paced-rounds", type=int, default=1, help="paced fenced phases per store")
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=512,
        help="client connection limit in paced phases (calls past it queue in the client)",
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=30.0,
        help="time bound of each phase's measured part (and of its warm-up)",
    )
    add_store_options(parser, stores=STORES_DEFAULT)
    parser.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="warning",
        help="gateway logging.level of the measured gateways",
    )
    parser.add_argument(
        "--no-info",
        action="store_true",
        help="skip the one peak phase per store with logging.level = info (the default level)",
    )
    parser.add_argument(
        "--gateway-toml",
        metavar="TOML",
        action="append",
        default=[],
        help="append this text to every gateway's config (repeatable), e.g. "
        "'[reconciler]' 'enabled = false'",
    )
    parser.add_argument(
        "--auth",
        action="store_true",
        help="run every gateway with [auth] (one principal with every role, a random token) "
        "and send Fence-Authorization: Bearer <token> on every request to a proxy",
    )
    parser.add_argument(
        "--cprofile",
        metavar="DIR",
        help="run every gateway under cProfile, writing DIR/gateway-NAME.prof when it stops "
        "(slows the gateway: use for where the time goes, not for the figures)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="gateway worker processes (server.workers; Redis only), and as many passthrough "
        "processes on one port (SO_REUSEPORT) for the baseline",
    )
    parser.add_argument(
        "--event-loop",
        choices=("auto", "uvloop", "asyncio"),
        help="server.event_loop of every gateway (default: the gateway's own default)",
    )
    add_run_options(parser, report="the tables then go")
    parser.add_argument("--serve-downstream", metavar="HOST:PORT", help=argparse.SUPPRESS)
    parser.add_argument("--serve-passthrough", metavar="HOST:PORT", help=argparse.SUPPRESS)
    parser.add_argument("--downstream-url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_downstream or args.serve_passthrough:
        return args
    args.stores = parse_stores(parser, args.stores, STORES_DEFAULT, (*ALL_STORES, "cluster"))
    if "cluster" in args.stores and not args.redis_server:
        parser.error("redis-server is not on PATH (apt-get install -y redis-server)")
    if min(args.requests, args.concurrency, args.rounds, args.tasks, args.paced_rounds) < 1:
        parser.error("--requests, --concurrency, --rounds, --tasks, --paced-rounds must be >= 1")
    if args.warmup < 0 or args.max_in_flight < 1:
        parser.error("--warmup must be >= 0, --max-in-flight >= 1")
    if not 0 < args.paced_fraction <= 1 or args.paced_seconds <= 0 or args.max_seconds <= 0:
        parser.error("--paced-fraction must be in (0, 1], --paced-seconds and --max-seconds > 0")
    if args.paced_rate is not None and not 0 < args.paced_rate <= 100_000:
        parser.error("--paced-rate must be in (0, 100000] calls/s")
    if args.workers < 1 or (args.workers > 1 and "sqlite" in args.stores):
        parser.error("--workers must be >= 1, and 1 with sqlite (one process): --stores redis")
    check_run_options(parser, args, args.stores)
    return args


def _print_report(
    args: argparse.Namespace,
    summaries: Sequence[dict[str, Any]],
    figures: Sequence[dict[str, Any]],
    settings: str,
    out: Any,
) -> None:
    print(f"\nfenced proxy calls ({settings})\n", file=out)
    print(render_phases(summaries), file=out)
    print(
        "\nrate / pass: a fenced peak phase against the passthrough phases just before and after "
        "it (pooled). added p99: a paced fenced phase's p99 minus the p99 of the passthrough "
        "phases around it at the same offered rate. Latency of a paced call counts from its "
        "scheduled start.",
        file=out,
    )
    pass_rates = [s["callsPerSecond"] for s in summaries if not s["fenced"] and s["mode"] == "peak"]
    if pass_rates:
        print(
            f"The passthrough peak ranged {min(pass_rates):.0f}..{max(pass_rates):.0f} calls/s "
            f"({max(pass_rates) / min(pass_rates) - 1:+.0%}) during this run.",
            file=out,
        )
    timing = render_timing(summaries)
    if timing is not None:
        print("\n" + timing, file=out)
    print("\nper store (peak: medians over rounds; paced: at the rate shown)\n", file=out)
    print(render_figures(figures), file=out)
    for f in figures:
        print(
            f"{f['store']}: CPU per call: gateway {fmt(f['gatewayCpuMsPerCall'], '.3f')} ms "
            f"(log level {args.log_level}), {fmt(f['infoGatewayCpuMsPerCall'], '.3f')} ms (info); "
            f"passthrough {fmt(f['passthroughCpuMsPerCall'], '.3f')} ms; "
            + (
                ""
                if f["storeServerCpuMsPerCall"] is None
                else f"store server {f['storeServerCpuMsPerCall']:.3f} ms; "
            )
            + f"paced: client send lag p99 {fmt(f['pacedClientLagP99Ms'], '.2f')} ms",
            file=out,
        )
    redis_summary = render_redis_summary(summaries)
    if redis_summary is not None:
        print("\n" + redis_summary, file=out)
    for s in summaries:
        if s["redisCpu"]:
            print("\n" + render_redis_time(s["phase"], s["redisCpu"]), file=out)
    for s in summaries:
        for note in s["notes"]:
            print(f"note: {s['phase']}: {note}", file=out)
        for check in s["checks"]:
            print(f"CHECK FAILED: {s['phase']}: {check}", file=out)
        if s["errors"]:
            print(f"errors: {s['phase']}: {s['errors']}", file=out)
            for sample in s["errorSamples"]:
                print(f"    {sample}", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_downstream:
        return _run(downstream_app(), args.serve_downstream)
    if args.serve_passthrough:
        return _run(passthrough_app(args.downstream_url), args.serve_passthrough)

    # SIGTERM unwinds like Ctrl-C, so the processes we started are stopped on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    origin = gateway_origin(args.gateway_src)
    progress(f"the gateway runs from {origin}")
    if args.cprofile:
        Path(args.cprofile).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="fencegate-bench-proxy-", dir=args.temp_dir))
    fs = filesystem_of(work)
    progress(f"working in {work} on {fs}")
    setup = Setup(work)
    results: list[PhaseResult] = []
    exit_codes: dict[str, int | None] = {}
    started = time.monotonic()
    troubled = False
    try:
        try:
            start_all(setup, args)
            results = asyncio.run(terminable(run_all(setup, args)))
        finally:
            exit_codes = setup.stop()
    except KeyboardInterrupt:
        progress("interrupted")
        return 130
    except (RuntimeError, OSError, CallFailed, redis.exceptions.RedisError) as exc:
        progress(f"could not run: {exc}")
        troubled = True
        return 1
    finally:
        troubled = troubled or any(not r.verified or r.notes for r in results)
        # A process that did not stop on SIGTERM within 10 s was killed: keep its log.
        troubled = troubled or any(code not in (0, -signal.SIGTERM) for code in exit_codes.values())
        if args.keep or troubled:
            progress(f"kept {work} (logs and data)")
        else:
            shutil.rmtree(work, ignore_errors=True)

    log_events: dict[str, dict[str, int]] = {}
    for name, target in setup.targets.items():
        if target.fenced:
            events, odd = scan_gateway_log(target.procs[0].log_path)
            loud = {k: v for k, v in events.items() if not k.startswith("info ")}
            if loud or odd:
                log_events[name] = loud
    summaries = [phase_summary(results, i) for i in range(len(results))]
    figures = store_figures(results, summaries, args.stores)
    settings = (
        f"{args.requests} calls per peak phase, concurrency {args.concurrency}, "
        f"{args.rounds} rounds, {args.tasks} tasks per phase, paced at "
        + (
            f"{args.paced_rate:g}/s"
            if args.paced_rate
            else f"{args.paced_fraction:g} x fenced peak"
        )
        + f" for {args.paced_seconds:g}s, redis appendfsync "
        f"{args.appendfsync}, sqlite synchronous {args.sqlite_synchronous}, "
        + (
            f"postgres fsync=on synchronous_commit=on (pool "
            f"{args.postgres_max_connections or 'default'}), "
            if "postgres" in args.stores
            else ""
        )
        + f"gateway log level {args.log_level}, {os.cpu_count()} CPUs shared by client, proxy, "
        f"downstream and store, temp dir (every store's data) on {fs}, gateway from {origin}"
    )
    if args.workers > 1:
        settings += (
            f", {args.workers} gateway workers against {args.workers} passthrough processes "
            "(each on one port, SO_REUSEPORT)"
        )
    if args.event_loop:
        settings += f", gateway event loop {args.event_loop}"
    if args.auth:
        settings += ", gateway [auth] on (1 principal, Fence-Authorization on every request)"
    if args.gateway_toml:
        settings += f", gateway config plus {args.gateway_toml!r}"
    if args.cprofile:
        settings += ", gateways under cProfile"
    out = sys.stderr if args.json == "-" else sys.stdout
    _print_report(args, summaries, figures, settings, out)
    for name, events in log_events.items():
        print(f"gateway log: {name}: {events}", file=out)
    bad_exits = {k: v for k, v in exit_codes.items() if v not in (0, -signal.SIGTERM)}
    if bad_exits:
        print(
            f"exit codes (None: did not stop within 10 s of SIGTERM and was killed): {bad_exits}",
            file=out,
        )
    print(f"total wall time {time.monotonic() - started:.0f}s", file=out)

    if args.json:
        document = {
            "benchmark": "proxy",
            "settings": {
                k: (str(v) if isinstance(v, Path) else v)
                for k, v in vars(args).items()
                if not k.startswith(("serve_", "downstream_"))
            },
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "aiohttp": aiohttp.__version__,
                "redis": setup.redis_version,
                "postgres": setup.postgres_version,
                "tempFilesystem": fs,
                "gatewaySource": origin,
            },
            "stores": figures,
            "phases": summaries,
            "gatewayLogEvents": log_events,
            "exitCodes": exit_codes,
        }
        text = json.dumps(document, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0 if all(r.verified for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
