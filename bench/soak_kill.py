"""A bounded ``kill -9`` soak: effects go through the fenced proxy while the gateway is killed
and restarted at random moments; duplicate executions are counted AT THE DOWNSTREAM.

Run from the repository root::

    .venv/bin/python -m bench.soak_kill                         # both stores, defaults
    .venv/bin/python -m bench.soak_kill --store sqlite --effects 60 --kills 4 --max-seconds 60

Per store (``--store sqlite|redis|both``) it starts, on loopback and in a temporary directory:

* ``downstream``: this module with ``--serve-downstream``, an aiohttp server with real
  semantics. ``POST /pay`` deduplicates on ``Idempotency-Key`` (a repeat inside the window
  gets the first answer, waiting for it if the first is still running) and executes once per
  new key; ``POST /orders`` creates an order per call WITHOUT deduplication, and
  ``GET /orders/by-key/{key}`` says whether it exists (200 / 404). Answers are slow on
  purpose: 0-300 ms, and a few slower than the gateway's ``timeout_ms``. The work runs to its
  end even when the caller hangs up (a killed gateway does not undo a payment).
  ``GET /_stats`` returns the executions per key of each endpoint: the truth.
* ``fencegate serve``: a temporary config with ``pay`` (``adapter = "idempotent"``) and
  ``orders`` (``adapter = "probe"``, probing ``/orders/by-key/{effectId}``), on a new SQLite
  file or a private ``redis-server`` (AOF, ``appendfsync always``, ``noeviction``).

The driver (this process) creates ``--effects`` tasks, one effect (one slot) each, and pushes
every effect until it is settled (a 2xx answer or replay), ``--concurrency`` at a time:
connection errors and 503 wait for the gateway to come back, ``EFFECT_IN_FLIGHT`` waits,
``EFFECT_UNKNOWN`` on ``orders`` asks ``POST /v1/effects/{id}/reconcile``, a persistent
``EFFECT_UNKNOWN`` on ``pay`` is settled "by an operator" from the downstream's own truth
(``POST /v1/effects/{id}/resolve``), ``FENCED`` / ``LEASE_EXPIRED`` re-claim the task (a new
attempt, the same slot, so the same effectId). Meanwhile the killer sends ``SIGKILL`` to the
gateway ``--kills`` times at random intervals and restarts it on the same config and store.

At the end the downstream's ``/_stats`` is compared with the effects: executions beyond one
per effect are duplicates. The exit status is 1 when any effect was executed twice, was left
unsettled, or was answered as settled but never executed. ``bench/README.md`` describes the
output.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
from aiohttp import web

from bench._args import STORES, add_run_options, check_run_options
from bench._procs import (
    HOST,
    Proc,
    align,
    cli_module,
    filesystem_of,
    gateway_env,
    gateway_origin,
    progress,
    scan_gateway_log,
    spawn,
    start_gateway,
    start_module_server,
    start_redis,
    terminable,
    wait_for_port,
    wait_ready,
)

__all__ = ["main"]

#: The two downstreams (gateway names) and the path each effect is sent to.
PAY = "pay"
ORDERS = "orders"
ENDPOINTS = (PAY, ORDERS)
PROBE_PATH = "/orders/by-key/{effectId}"
#: The config's lease ceilings (claims ask for --ttl-ms, far below them).
MAX_TTL_MS = 3_600_000
#: Per-request client timeout: a gateway that stops answering shows up as an error, not a hang.
REQUEST_TIMEOUT_S = 20.0
#: How long one restart of the gateway may take before the run is given up.
RESTART_TIMEOUT_S = 30.0
#: Most proxied requests per effect (a safety net on top of --max-seconds).
MAX_REQUESTS_PER_EFFECT = 2_000
#: Answers that mean "this claim is not current": re-claim (new attempt), same slot.
RECLAIM_CODES = frozenset({"FENCED", "LEASE_EXPIRED", "STALE_EPOCH", "CANCELLED"})
#: Pause after an EFFECT_UNKNOWN of a probe downstream, doubling up to the maximum.
UNKNOWN_PAUSE_S = 0.3
UNKNOWN_PAUSE_MAX_S = 5.0
#: Log lines kept per duplicated (or unsettled) effect in the report.
LOG_LINES_PER_EFFECT = 40
#: The effects that took longest to settle, kept in the JSON (and summed up in the report).
SLOWEST = 3
OPERATOR = "soak-kill"


def effect_id(task_id: str, revision: int, node: str, slot: str) -> str:
    raw = json.dumps([task_id, revision, node, slot], separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()


# --- the downstream (its own process) --------------------------------------------------------


@dataclass
class _Truth:
    """The downstream's state: what it really did, per idempotency key."""

    rng: random.Random
    timeout_ms: int
    slow_fraction: float
    execute_at: str
    window_s: float
    executions: dict[str, Counter[str]] = field(
        default_factory=lambda: {PAY: Counter(), ORDERS: Counter()}
    )
    deliveries: dict[str, Counter[str]] = field(
        default_factory=lambda: {PAY: Counter(), ORDERS: Counter()}
    )
    #: /pay: the first request of each key (its start and its work), for deduplication.
    pay_first: dict[str, tuple[float, asyncio.Task[tuple[int, dict[str, Any]]]]] = field(
        default_factory=dict
    )
    orders: dict[str, dict[str, Any]] = field(default_factory=dict)
    in_flight: Counter[str] = field(default_factory=Counter)
    slow: int = 0
    serial: int = 0
    work: set[asyncio.Task[tuple[int, dict[str, Any]]]] = field(default_factory=set)

    def timing(self) -> tuple[float, float]:
        """(seconds before the effect executes, seconds after it until the answer)."""
        if self.rng.random() < self.slow_fraction:
            self.slow += 1
            total = self.rng.uniform(1.05, 1.5) * self.timeout_ms / 1000
        else:
            total = self.rng.uniform(0.0, 0.3)
        if self.execute_at == "arrival":
            share = 0.0
        elif self.execute_at == "end":
            share = 1.0
        else:
            share = self.rng.random()
        return total * share, total * (1 - share)

    def start(self, endpoint: str, key: str) -> asyncio.Task[tuple[int, dict[str, Any]]]:
        """The work of one request, as a task that runs to its end even if the caller leaves."""
        before, after = self.timing()

        async def run() -> tuple[int, dict[str, Any]]:
            self.in_flight[key] += 1
            try:
                await asyncio.sleep(before)
                self.executions[endpoint][key] += 1
                self.serial += 1
                record: dict[str, Any] = {"id": f"{endpoint}_{self.serial}", "key": key}
                if endpoint == ORDERS:
                    record["status"] = "created"
                    self.orders[key] = record
                else:
                    record["status"] = "succeeded"
                await asyncio.sleep(after)
                return 201, record
            finally:
                self.in_flight[key] -= 1
                if self.in_flight[key] <= 0:
                    del self.in_flight[key]

        task = asyncio.get_running_loop().create_task(run())
        self.work.add(task)
        task.add_done_callback(self.work.discard)
        return task


def downstream_app(
    *, seed: int, timeout_ms: int, slow_fraction: float, execute_at: str, window_ms: int
) -> web.Application:
    truth = _Truth(random.Random(seed), timeout_ms, slow_fraction, execute_at, window_ms / 1000)

    def _key(request: web.Request) -> str | None:
        values = request.headers.getall("Idempotency-Key", [])
        return values[0] if len(values) == 1 and values[0] else None

    async def pay(request: web.Request) -> web.Response:
        await request.read()
        key = _key(request)
        if key is None:
            return web.json_response({"error": "one Idempotency-Key is required"}, status=400)
        truth.deliveries[PAY][key] += 1
        now = time.monotonic()
        first = truth.pay_first.get(key)
        if first is not None and now - first[0] < truth.window_s:
            # A repeat inside the window: the first answer (once the first is done), no effect.
            status, record = await asyncio.shield(first[1])
            return web.json_response(record, status=status, headers={"Idempotent-Replayed": "1"})
        work = truth.start(PAY, key)
        truth.pay_first[key] = (now, work)
        status, record = await asyncio.shield(work)
        return web.json_response(record, status=status)

    async def orders(request: web.Request) -> web.Response:
        await request.read()
        key = _key(request)
        if key is None:
            return web.json_response({"error": "one Idempotency-Key is required"}, status=400)
        truth.deliveries[ORDERS][key] += 1
        status, record = await asyncio.shield(truth.start(ORDERS, key))
        return web.json_response(record, status=status)

    async def order_by_key(request: web.Request) -> web.Response:
        record = truth.orders.get(request.match_info["key"])
        if record is None:
            return web.json_response({"error": "no such order"}, status=404)
        return web.json_response(record)

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "executions": {k: dict(v) for k, v in truth.executions.items()},
                "deliveries": {k: dict(v) for k, v in truth.deliveries.items()},
                "inFlight": dict(truth.in_flight),
                "slowAnswers": truth.slow,
            }
        )

    async def ready(request: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    app = web.Application()
    app.router.add_post("/pay", pay)
    app.router.add_post("/orders", orders)
    app.router.add_get("/orders/by-key/{key}", order_by_key)
    app.router.add_get("/_stats", stats)
    app.router.add_get("/readyz", ready)
    return app


def _serve(app: web.Application, listen: str) -> int:
    host, _, port = listen.rpartition(":")
    if host not in (HOST, "localhost"):
        print("bench servers listen on loopback only", file=sys.stderr)
        return 2
    web.run_app(app, host=host, port=int(port), print=None, access_log=None)
    return 0


# --- the gateway, killed and restarted -------------------------------------------------------


class Gateway:
    """One ``fencegate serve`` on a fixed config and port, killed and restarted in place."""

    def __init__(self, proc: Proc, base: str, source: Path | None) -> None:
        self.proc = proc
        self.base = base
        self.source = source
        self.directory = proc.log_path.parent
        self.port = int(base.rsplit(":", 1)[1])
        self.args = [sys.executable, "-m", cli_module(source), "serve", "--config",
                     str(self.directory / "fencegate.toml")]  # fmt: skip
        self.up = asyncio.Event()
        self.up.set()
        self.restarts: list[float] = []  # seconds from SIGKILL to /readyz 200

    def mark(self, event: str, **fields: Any) -> None:
        """A JSON line of our own in the gateway's log, so its lines can be read around it."""
        line = {"event": event, "level": "info", "logger": "bench.soak_kill",
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), **fields}  # fmt: skip
        with self.proc.log_path.open("a") as log:
            log.write(json.dumps(line) + "\n")

    async def kill(self) -> None:
        self.up.clear()
        pid = self.proc.pid
        self.proc.popen.send_signal(signal.SIGKILL)
        await asyncio.to_thread(self.proc.popen.wait)
        self.mark("soak.kill9", pid=pid)

    def _respawn(self) -> None:
        self.proc = spawn(
            "gateway", self.args, self.proc.log_path, self.directory, gateway_env(self.source)
        )
        wait_for_port(self.port, self.proc.popen, timeout=RESTART_TIMEOUT_S)
        wait_ready(self.base, self.proc)

    async def restart(self, killed_at: float) -> None:
        await asyncio.to_thread(self._respawn)
        self.restarts.append(time.monotonic() - killed_at)
        self.mark("soak.restarted", pid=self.proc.pid)
        self.up.set()


# --- the driver ------------------------------------------------------------------------------


@dataclass
class Claim:
    attempt_id: str
    generation: int
    epoch: int
    cancel: int


@dataclass
class Effect:
    index: int
    task_id: str
    endpoint: str
    effect_id: str
    body: dict[str, Any]
    settled: bool = False
    status: int | None = None
    state: str | None = None
    replayed: bool = False
    requests: int = 0
    claims: int = 0
    reconciles: int = 0
    operator: str | None = None  # the outcome an operator resolved it to
    connection_errors: int = 0  # proxied requests that ended in a connection error
    first_sent: float | None = None  # monotonic time of the first proxied request
    settled_at: float | None = None
    answers: Counter[str] = field(default_factory=Counter)
    error: str | None = None
    wrong_effect_id: str | None = None


class GiveUp(Exception):
    """An effect cannot go on (time is up, or the gateway answers something unexpected)."""


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def code(self) -> str | None:
        if "json" not in self.headers.get("Content-Type", ""):
            return None
        try:
            doc = json.loads(self.body)
        except ValueError:
            return None
        code = doc.get("code") if isinstance(doc, dict) else None
        return code if isinstance(code, str) else None

    def label(self) -> str:
        code = self.code
        return f"{self.status} {code}" if code else str(self.status)

    def retry_after(self) -> float:
        try:
            return float(self.headers.get("Retry-After", "1"))
        except ValueError:
            return 1.0


class Driver:
    """Pushes every effect through the gateway until it is settled (or time is up)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        gateway: Gateway,
        downstream: str,
        args: argparse.Namespace,
        deadline: float,
    ) -> None:
        self.session = session
        self.gateway = gateway
        self.downstream = downstream
        self.args = args
        self.deadline = deadline
        self.epoch = 1
        self.in_flight_proxied = 0
        self.notes: list[str] = []

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise GiveUp("--max-seconds ran out")
        return left

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        headers: dict[str, str] | None = None,
        base: str | None = None,
    ) -> Answer:
        async with self.session.request(
            method,
            (base or self.gateway.base) + path,
            json=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=min(REQUEST_TIMEOUT_S, self._left())),
        ) as resp:
            raw = await resp.read()
            return Answer(resp.status, dict(resp.headers), raw)

    async def _wait_up(self) -> None:
        """After a connection error: until the killer has the gateway back (bounded)."""
        try:
            await asyncio.wait_for(self.gateway.up.wait(), timeout=self._left())
        except TimeoutError:
            raise GiveUp("--max-seconds ran out waiting for the gateway") from None
        await asyncio.sleep(0.02)

    async def gateway_call(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> Answer:
        """A coordination or ledger call, retried through kills and 503s."""
        while True:
            self._left()
            try:
                answer = await self._request(method, path, body=body, headers=headers)
            except (aiohttp.ClientError, TimeoutError):
                await self._wait_up()
                continue
            if answer.status == 503:
                await asyncio.sleep(0.2)
                continue
            return answer

    async def downstream_stats(self) -> dict[str, Any]:
        answer = await self._request("GET", "/_stats", base=self.downstream)
        doc: dict[str, Any] = json.loads(answer.body)
        return doc

    async def create(self, effect: Effect) -> None:
        digest = "sha256:" + hashlib.sha256(effect.task_id.encode()).hexdigest()
        answer = await self.gateway_call(
            "PUT", f"/v1/tasks/{effect.task_id}", {"inputDigest": digest}
        )
        if answer.status not in (200, 201):
            raise GiveUp(f"PUT task: {answer.label()} {answer.body[:200]!r}")

    async def claim(self, effect: Effect) -> Claim:
        body = {"owner": f"soak-{effect.index}", "ttlMs": self.args.ttl_ms,
                "schedulerEpoch": self.epoch}  # fmt: skip
        while True:
            answer = await self.gateway_call("POST", f"/v1/tasks/{effect.task_id}/claim", body)
            effect.answers[f"claim {answer.label()}"] += 1
            if answer.status == 200:
                doc = json.loads(answer.body)
                effect.claims += 1
                return Claim(
                    doc["attemptId"],
                    doc["claimGeneration"],
                    doc["schedulerEpoch"],
                    doc["cancelGeneration"],
                )
            if answer.code == "CLAIMED":
                # Our own earlier claim (perhaps one whose answer a kill swallowed) still holds.
                await asyncio.sleep(min(0.5, self.args.ttl_ms / 4000))
                continue
            raise GiveUp(f"claim: {answer.label()} {answer.body[:200]!r}")

    async def send(self, effect: Effect, claim: Claim) -> Answer:
        headers = {
            "Fence-Task": effect.task_id,
            "Fence-Attempt": claim.attempt_id,
            "Fence-Generation": str(claim.generation),
            "Fence-Epoch": str(claim.epoch),
            "Fence-Cancel": str(claim.cancel),
            "Fence-Slot": "effect",
        }
        effect.requests += 1
        if effect.first_sent is None:
            effect.first_sent = time.monotonic()
        self.in_flight_proxied += 1
        try:
            return await self._request(
                "POST", f"/proxy/{effect.endpoint}/{effect.endpoint}", body=effect.body,
                headers=headers,
            )  # fmt: skip
        finally:
            self.in_flight_proxied -= 1

    async def reconcile(self, effect: Effect) -> None:
        effect.reconciles += 1
        answer = await self.gateway_call(
            "POST",
            f"/v1/effects/{effect.effect_id}/reconcile",
            headers={"Fence-Operator": OPERATOR},
        )
        effect.answers[f"reconcile {answer.label()}"] += 1

    async def operator_resolve(self, effect: Effect) -> None:
        """Settle a persistent UNKNOWN as an operator would: from the downstream's own records,
        once nothing for this key is running there."""
        while True:
            stats = await self.downstream_stats()
            if effect.effect_id not in stats["inFlight"]:
                break
            await asyncio.sleep(0.1)
            self._left()
        executed = stats["executions"][effect.endpoint].get(effect.effect_id, 0)
        outcome = "COMMITTED" if executed else "NOT_APPLIED"
        answer = await self.gateway_call(
            "POST",
            f"/v1/effects/{effect.effect_id}/resolve",
            # force: nothing for this key runs at the downstream any more (checked above), so
            # no earlier forward can land, whatever settle_ms says.
            {
                "outcome": outcome,
                "note": f"soak_kill: the downstream executed it {executed}x",
                "force": True,
            },
            {"Fence-Operator": OPERATOR},
        )
        effect.answers[f"resolve {answer.label()}"] += 1
        if answer.status == 200:
            effect.operator = outcome

    async def run(self, effect: Effect) -> None:
        try:
            await self._run(effect)
        except GiveUp as exc:
            effect.error = str(exc)

    async def _run(self, effect: Effect) -> None:
        await self.create(effect)
        claim = await self.claim(effect)
        unknown_since: float | None = None
        unknown_pause = UNKNOWN_PAUSE_S
        odd = 0
        while effect.requests < MAX_REQUESTS_PER_EFFECT:
            self._left()
            try:
                answer = await self.send(effect, claim)
            except (aiohttp.ClientError, TimeoutError) as exc:
                effect.connection_errors += 1
                effect.answers[f"connection {type(exc).__name__}"] += 1
                await self._wait_up()
                continue
            effect.answers[answer.label()] += 1
            answered_id = answer.headers.get("Fence-Effect-Id")
            if answered_id and answered_id != effect.effect_id:
                effect.wrong_effect_id = answered_id
            code = answer.code
            if code != "EFFECT_UNKNOWN":
                unknown_since = None
                unknown_pause = UNKNOWN_PAUSE_S
            if 200 <= answer.status < 300:
                effect.settled = True
                effect.settled_at = time.monotonic()
                effect.status = answer.status
                effect.state = answer.headers.get("Fence-Effect-State")
                effect.replayed = answer.headers.get("Fence-Replayed") == "true"
                return
            if code in RECLAIM_CODES:
                claim = await self.claim(effect)
            elif code == "EFFECT_IN_FLIGHT":
                await asyncio.sleep(min(answer.retry_after(), 0.5) * random.uniform(0.5, 1.0))
            elif code == "EFFECT_UNKNOWN":
                now = time.monotonic()
                unknown_since = unknown_since or now
                if effect.endpoint == ORDERS:
                    # Ask the probe, then back off: the gateway may hold "absent" back until
                    # an earlier forward can no longer land.
                    await self.reconcile(effect)
                    if "Retry-After" in answer.headers:
                        unknown_pause = max(unknown_pause, answer.retry_after())
                    await asyncio.sleep(min(unknown_pause, UNKNOWN_PAUSE_MAX_S))
                    unknown_pause *= 2
                elif now - unknown_since >= self.args.operator_after:
                    await self.operator_resolve(effect)
                    unknown_since = None
                else:
                    await asyncio.sleep(0.3)
            elif code in ("DOWNSTREAM_TIMEOUT", "DOWNSTREAM_UNREACHABLE"):
                await asyncio.sleep(0.02)  # the ledger knows; the next prepare decides
            elif answer.status == 503 or answer.status >= 500:
                await asyncio.sleep(0.2)
            else:
                odd += 1  # 400, 404, 422...: not expected; a few tries, then give up
                if odd >= 3:
                    raise GiveUp(f"unexpected answer {answer.label()}: {answer.body[:300]!r}")
                await asyncio.sleep(0.2)
        raise GiveUp(f"{MAX_REQUESTS_PER_EFFECT} requests and still not settled")


# --- one store -------------------------------------------------------------------------------


@dataclass
class Run:
    """Processes of one store's run (stopped in reverse order)."""

    work: Path
    procs: list[Proc] = field(default_factory=list)
    gateway: Gateway | None = None
    downstream_base: str = ""
    redis_version: str | None = None

    def stop(self) -> dict[str, int | None]:
        codes: dict[str, int | None] = {}
        if self.gateway is not None and self.gateway.proc not in self.procs:
            self.procs.append(self.gateway.proc)
        for proc in reversed(self.procs):
            codes[proc.name] = proc.stop()
        return codes


def _gateway_toml(downstream: str, args: argparse.Namespace) -> str:
    lines = [
        "[leases]",
        f"max_ttl_ms = {MAX_TTL_MS}",
        f"default_max_runtime_ms = {MAX_TTL_MS}",
        "[reconciler]",
        f"interval_ms = {args.reconciler_interval_ms}",
        "[[downstreams]]",
        f'name = "{PAY}"',
        f'url = "{downstream}"',
        'adapter = "idempotent"',
        f"timeout_ms = {args.timeout_ms}",
        f"dedupe_window_ms = {args.window_ms}",
        "[[downstreams]]",
        f'name = "{ORDERS}"',
        f'url = "{downstream}"',
        'adapter = "probe"',
        f"timeout_ms = {args.timeout_ms}",
        "[downstreams.probe]",
        'method = "GET"',
        f'path = "{PROBE_PATH}"',
        "found_statuses = [200]",
        "absent_statuses = [404]",
        "timeout_ms = 2000",
        "interval_ms = 500",
        "max_interval_ms = 5000",
    ]
    # Extra lines land last, i.e. inside [downstreams.probe] unless they open a table.
    return "\n".join(lines + list(args.gateway_toml)) + "\n"


def kill_plan(rng: random.Random, kills: int) -> list[float]:
    return [rng.uniform(0.5, 3.0) for _ in range(kills)]


async def killer(
    gateway: Gateway, driver: Driver, plan: Sequence[float], done: asyncio.Event
) -> dict[str, Any]:
    """SIGKILL the gateway after each interval of ``plan`` (counted from when it was last
    ready) and restart it, until the plan is through or every effect is done; restart it too
    if it dies by itself (counted apart)."""
    kills: list[dict[str, Any]] = []
    unexpected = 0

    async def watch(until: float) -> None:
        nonlocal unexpected
        while time.monotonic() < until and not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), timeout=min(0.1, until - time.monotonic()))
            if not gateway.proc.alive() and gateway.up.is_set():  # died by itself
                unexpected += 1
                gateway.up.clear()
                started = time.monotonic()
                gateway.mark("soak.found_dead", exit=gateway.proc.popen.returncode)
                await gateway.restart(started)

    for interval in plan:
        await watch(time.monotonic() + interval)
        if done.is_set() or time.monotonic() > driver.deadline:
            break
        in_flight = driver.in_flight_proxied
        killed_at = time.monotonic()
        await gateway.kill()
        await gateway.restart(killed_at)
        kills.append({"proxiedInFlight": in_flight, "downSeconds": round(gateway.restarts[-1], 3)})
    await watch(driver.deadline)
    return {"kills": kills, "unexpectedExits": unexpected}


async def run_store(store: str, run: Run, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    work = run.work
    downstream_proc, run.downstream_base = start_module_server(
        "downstream",
        "bench.soak_kill",
        "--serve-downstream",
        work / "downstream",
        [
            "--seed", str(seed),
            "--timeout-ms", str(args.timeout_ms),
            "--slow-fraction", str(args.slow_fraction),
            "--execute-at", args.execute_at,
            "--window-ms", str(args.window_ms),
        ],
    )  # fmt: skip
    run.procs.append(downstream_proc)
    if store == "redis":
        server, url, run.redis_version = start_redis(args.redis_server, work / "redis", "always")
        run.procs.append(server)
    else:
        url = f"sqlite:///{work / 'gateway' / 'fencegate.db'}"
    proc, base = start_gateway(
        work / "gateway",
        url,
        log_level="info",
        sqlite_synchronous="FULL",
        source=args.gateway_src,
        store_timeout_ms=None,
        extra_toml=_gateway_toml(run.downstream_base, args),
    )
    gateway = Gateway(proc, base, args.gateway_src)
    run.gateway = gateway
    progress(f"{store}: gateway pid {proc.pid} at {base}, downstream {run.downstream_base}")

    prefix = f"soak-{store}-{uuid.uuid4().hex[:8]}"
    effects: list[Effect] = []
    for i in range(args.effects):
        endpoint = ORDERS if rng.random() < args.orders_fraction else PAY
        task_id = f"{prefix}-{i:05d}"
        body = {"n": i, "amount": rng.randint(100, 99_999), "currency": "eur"}
        effects.append(Effect(i, task_id, endpoint, effect_id(task_id, 1, "main", "effect"), body))
    plan = kill_plan(rng, args.kills)
    spread = args.spread_seconds
    if spread is None:
        spread = sum(plan) + args.kills * 1.0  # about the kill schedule, restarts included

    started = time.monotonic()
    deadline = started + args.max_seconds
    connector = aiohttp.TCPConnector(limit=args.concurrency * 2 + 8)
    async with aiohttp.ClientSession(connector=connector) as session:
        driver = Driver(session, gateway, run.downstream_base, args, deadline)
        epoch = await driver.gateway_call("GET", "/v1/epoch")
        driver.epoch = int(json.loads(epoch.body)["schedulerEpoch"])
        slots = asyncio.Semaphore(args.concurrency)
        done = asyncio.Event()

        async def one(effect: Effect) -> None:
            start_at = started + spread * effect.index / max(len(effects), 1)
            await asyncio.sleep(max(0.0, start_at - time.monotonic()))
            async with slots:
                await driver.run(effect)

        kill_task = asyncio.create_task(killer(gateway, driver, plan, done))
        drive = asyncio.gather(*(one(e) for e in effects))
        # A restart that fails ends the run (the drivers would only wait for it).
        kill_task.add_done_callback(
            lambda t: drive.cancel() if t.cancelled() or t.exception() else None
        )
        try:
            await drive
        except asyncio.CancelledError:
            if not kill_task.done():
                raise
        finally:
            done.set()
            killing = await kill_task
        driver_seconds = time.monotonic() - started
        progress(f"{store}: driver done in {driver_seconds:.1f}s; reading the downstream")

        # Let whatever the downstream is still working on finish, then read the truth.
        driver.deadline = time.monotonic() + 60
        quiet_by = time.monotonic() + 2 * args.timeout_ms / 1000 + 5
        stats = await driver.downstream_stats()
        while stats["inFlight"] and time.monotonic() < quiet_by:
            await asyncio.sleep(0.1)
            stats = await driver.downstream_stats()
        records = await read_records(driver, effects)
    figures = store_figures(store, effects, stats, records, killing, driver_seconds)
    figures["restartSeconds"] = [round(s, 3) for s in gateway.restarts]
    figures["killPlan"] = [round(s, 3) for s in plan]
    figures["spreadSeconds"] = round(spread, 2)
    figures["taskPrefix"] = prefix
    figures["gatewayLog"] = str(gateway.proc.log_path)
    events, odd = scan_gateway_log(gateway.proc.log_path)
    figures["gatewayLogEvents"] = events
    figures["gatewayLogOdd"] = odd
    attach_details(figures, effects, records, gateway.proc.log_path)
    return figures


async def read_records(driver: Driver, effects: Sequence[Effect]) -> dict[str, Any]:
    """The gateway's own record of every effect (read for the report, never trusted)."""
    slots = asyncio.Semaphore(8)
    records: dict[str, Any] = {}

    async def one(effect: Effect) -> None:
        async with slots:
            try:
                answer = await driver.gateway_call("GET", f"/v1/effects/{effect.effect_id}")
            except GiveUp as exc:
                records[effect.effect_id] = {"error": str(exc)}
                return
            if answer.status == 200:
                records[effect.effect_id] = json.loads(answer.body)
            else:
                records[effect.effect_id] = {"error": answer.label()}

    await asyncio.gather(*(one(e) for e in effects))
    return records


def store_figures(
    store: str,
    effects: Sequence[Effect],
    stats: dict[str, Any],
    records: dict[str, Any],
    killing: dict[str, Any],
    seconds: float,
) -> dict[str, Any]:
    executions: dict[str, dict[str, int]] = stats["executions"]
    deliveries: dict[str, dict[str, int]] = stats["deliveries"]
    ours = {e.effect_id for e in effects}
    per: dict[str, dict[str, int]] = {
        ep: {"effects": 0, "executions": 0, "duplicates": 0, "neverExecuted": 0, "deliveries": 0}
        for ep in ENDPOINTS
    }
    ledger_states: Counter[str] = Counter()
    mismatches: list[dict[str, Any]] = []
    lost: list[str] = []
    for e in effects:
        n = executions[e.endpoint].get(e.effect_id, 0)
        row = per[e.endpoint]
        row["effects"] += 1
        row["executions"] += n
        row["duplicates"] += max(0, n - 1)
        row["neverExecuted"] += n == 0
        row["deliveries"] += deliveries[e.endpoint].get(e.effect_id, 0)
        if e.settled and n == 0:
            lost.append(e.effect_id)
        state = str(records.get(e.effect_id, {}).get("state", "?"))
        ledger_states[state] += 1
        if (state == "COMMITTED" and n == 0) or (state == "NOT_APPLIED" and n > 0):
            mismatches.append({"effectId": e.effect_id, "ledger": state, "executions": n})
    stray = {ep: {k: v for k, v in executions[ep].items() if k not in ours} for ep in ENDPOINTS}
    answers: Counter[str] = Counter()
    for e in effects:
        answers.update(e.answers)
    settled = sum(e.settled for e in effects)
    settle_s = sorted(
        e.settled_at - e.first_sent
        for e in effects
        if e.settled_at is not None and e.first_sent is not None
    )
    return {
        "store": store,
        "effects": len(effects),
        "settled": settled,
        "unsettled": len(effects) - settled,
        "executions": sum(p["executions"] for p in per.values()),
        "duplicates": sum(p["duplicates"] for p in per.values()),
        "neverExecuted": sum(p["neverExecuted"] for p in per.values()),
        "settledButNeverExecuted": lost,
        "perEndpoint": per,
        "kills": len(killing["kills"]),
        "killDetails": killing["kills"],
        "unexpectedExits": killing["unexpectedExits"],
        "cutCalls": sum(k["proxiedInFlight"] for k in killing["kills"]),
        "connectionErrors": sum(e.connection_errors for e in effects),
        "operatorResolved": sum(e.operator is not None for e in effects),
        "operatorResolvedTo": dict(Counter(e.operator for e in effects if e.operator)),
        "reconcileCalls": sum(e.reconciles for e in effects),
        "claims": sum(e.claims for e in effects),
        "proxiedRequests": sum(e.requests for e in effects),
        "settledBy": dict(
            Counter(
                f"{e.endpoint} {e.status} {e.state}{' replayed' if e.replayed else ''}"
                for e in effects
                if e.settled
            )
        ),
        "answers": dict(sorted(answers.items())),
        "ledgerStates": dict(ledger_states),
        "ledgerMismatches": mismatches,
        "strayExecutions": stray,
        "duplicateKeys": {
            e.effect_id: executions[e.endpoint][e.effect_id]
            for e in effects
            if executions[e.endpoint].get(e.effect_id, 0) > 1
        },
        "wrongEffectIds": [e.effect_id for e in effects if e.wrong_effect_id],
        "downstreamSlowAnswers": stats.get("slowAnswers"),
        "downstreamStillInFlight": stats["inFlight"],
        "settleSeconds": {
            "p50": round(settle_s[len(settle_s) // 2], 3) if settle_s else None,
            "p99": round(settle_s[max(0, -(-99 * len(settle_s) // 100) - 1)], 3)
            if settle_s
            else None,
            "max": round(settle_s[-1], 3) if settle_s else None,
        },
        "seconds": round(seconds, 2),
    }


def attach_details(
    figures: dict[str, Any], effects: Sequence[Effect], records: dict[str, Any], log_path: Path
) -> None:
    """For every duplicated, lost or unsettled effect: what the driver saw, the gateway's
    record of it and the gateway's log lines that name it."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    duplicated: dict[str, int] = figures["duplicateKeys"]
    lost = set(figures["settledButNeverExecuted"])
    problems: list[dict[str, Any]] = []
    for e in effects:
        why = []
        if e.effect_id in duplicated:
            why.append(f"executed {duplicated[e.effect_id]} times")
        if not e.settled:
            why.append("unsettled")
        if e.effect_id in lost:
            why.append("answered as settled but never executed")
        if not why:
            continue
        mentions = [ln for ln in lines if e.effect_id in ln or e.task_id in ln]
        problems.append(
            {
                "why": why,
                "effectId": e.effect_id,
                "taskId": e.task_id,
                "endpoint": e.endpoint,
                "driver": {
                    "settled": e.settled,
                    "status": e.status,
                    "state": e.state,
                    "replayed": e.replayed,
                    "requests": e.requests,
                    "claims": e.claims,
                    "operator": e.operator,
                    "error": e.error,
                    "answers": dict(e.answers),
                },
                "record": records.get(e.effect_id),
                "logLines": mentions[:LOG_LINES_PER_EFFECT],
                "logLinesTotal": len(mentions),
            }
        )
    figures["problems"] = problems

    def took(e: Effect) -> float:
        end = e.settled_at if e.settled_at is not None else time.monotonic()
        return end - e.first_sent if e.first_sent is not None else 0.0

    slowest = sorted(effects, key=took, reverse=True)[:SLOWEST]
    figures["slowest"] = [
        {
            "effectId": e.effect_id,
            "taskId": e.task_id,
            "endpoint": e.endpoint,
            "seconds": round(took(e), 3),
            "settled": e.settled,
            "answers": dict(e.answers),
            "record": records.get(e.effect_id),
            "logLines": [ln for ln in lines if e.effect_id in ln][:LOG_LINES_PER_EFFECT],
        }
        for e in slowest
    ]


def failed(figures: dict[str, Any]) -> bool:
    return bool(figures["duplicates"] or figures["unsettled"] or figures["settledButNeverExecuted"])


# --- report ----------------------------------------------------------------------------------


def render_table(all_figures: Sequence[dict[str, Any]]) -> str:
    rows = [
        [
            "store", "effects", "settled", "executions", "dup pay", "dup orders",
            "never executed", "kills", "cut calls", "operator_resolved", "max settle s",
            "seconds",
        ]
    ]  # fmt: skip
    for f in all_figures:
        per = f["perEndpoint"]
        rows.append(
            [
                f["store"],
                str(f["effects"]),
                str(f["settled"]),
                str(f["executions"]),
                str(per[PAY]["duplicates"]),
                str(per[ORDERS]["duplicates"]),
                str(f["neverExecuted"]),
                str(f["kills"]),
                str(f["cutCalls"]),
                str(f["operatorResolved"]),
                "-" if f["settleSeconds"]["max"] is None else f"{f['settleSeconds']['max']:.1f}",
                f"{f['seconds']:.1f}",
            ]
        )
    return align(rows)


def _answers_brief(answers: dict[str, int]) -> str:
    return "(" + ", ".join(f"{k} x{v}" for k, v in answers.items()) + ")"


def _short(record: Any) -> Any:
    """An effect record without the stored response body (for the printed report)."""
    if not isinstance(record, dict):
        return record
    out = dict(record)
    response = out.get("response")
    if isinstance(response, dict):
        out["response"] = {k: v for k, v in response.items() if k not in ("bodyBase64", "headers")}
    return out


def print_report(
    all_figures: Sequence[dict[str, Any]], settings: str, out: Any, verbose: bool
) -> None:
    print(f"\nkill -9 soak ({settings})\n", file=out)
    print(render_table(all_figures), file=out)
    print(
        "\nexecutions, dup, never executed: counted at the downstream (/_stats), per "
        "idempotency key; dup = executions beyond one per effect. cut calls: proxied requests "
        "the driver had in flight at the moments of the kills. max settle s: the longest time "
        "from an effect's first proxied request to its settling answer.",
        file=out,
    )
    for f in all_figures:
        per = f["perEndpoint"]
        print(
            f"\n{f['store']}: pay {per[PAY]['effects']} effects, {per[PAY]['executions']} "
            f"executions, {per[PAY]['deliveries']} deliveries; orders {per[ORDERS]['effects']} "
            f"effects, {per[ORDERS]['executions']} executions, {per[ORDERS]['deliveries']} "
            f"deliveries; {f['proxiedRequests']} proxied requests, {f['claims']} claims, "
            f"{f['reconcileCalls']} reconcile calls, {f['downstreamSlowAnswers']} slow "
            f"downstream answers",
            file=out,
        )
        print(f"  settled by: {f['settledBy']}", file=out)
        print(f"  gateway ledger states: {f['ledgerStates']}", file=out)
        settle = f["settleSeconds"]
        print(
            f"  seconds to settle: p50 {settle['p50']}, p99 {settle['p99']}, max "
            f"{settle['max']}; slowest: "
            + "; ".join(
                f"{x['endpoint']} {x['effectId'][:12]} {x['seconds']:.1f}s "
                f"{_answers_brief(x['answers'])}"
                for x in f["slowest"]
            ),
            file=out,
        )
        restarts = f["restartSeconds"]
        if restarts:
            print(
                f"  restarts: {len(restarts)}, {min(restarts):.2f}..{max(restarts):.2f} s from "
                f"SIGKILL to /readyz; proxied calls in flight at each kill: "
                f"{[k['proxiedInFlight'] for k in f['killDetails']]}",
                file=out,
            )
        loud = {k: v for k, v in f["gatewayLogEvents"].items() if not k.startswith("info ")}
        if loud:
            print(f"  gateway log: {loud}", file=out)
        if f["unexpectedExits"]:
            print(f"  the gateway died by itself {f['unexpectedExits']} time(s)", file=out)
        if f["ledgerMismatches"]:
            print(f"  ledger disagrees with the downstream: {f['ledgerMismatches']}", file=out)
        if any(f["strayExecutions"].values()):
            print(f"  executions of keys no effect has: {f['strayExecutions']}", file=out)
        if f["wrongEffectIds"]:
            print(f"  answers with another Fence-Effect-Id: {f['wrongEffectIds']}", file=out)
        if f["downstreamStillInFlight"]:
            print(f"  still running at the downstream: {f['downstreamStillInFlight']}", file=out)
        for p in f["problems"]:
            print(
                f"  PROBLEM {p['endpoint']} {p['effectId']} (task {p['taskId']}): "
                f"{', '.join(p['why'])}",
                file=out,
            )
            print(f"    driver: {json.dumps(p['driver'])}", file=out)
            if verbose or any(w.startswith("executed") for w in p["why"]):
                print(f"    record: {json.dumps(_short(p['record']))}", file=out)
                for line in p["logLines"]:
                    print(f"    log: {line}", file=out)
                if p["logLinesTotal"] > len(p["logLines"]):
                    print(f"    log: ... {p['logLinesTotal'] - len(p['logLines'])} more", file=out)


# --- command line ----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak_kill",
        description="kill -9 the gateway while effects go through it; count duplicate "
        "executions at the downstream",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--store", choices=[*STORES, "both"], default="both")
    parser.add_argument("--effects", type=int, default=200, help="tasks, one effect each")
    parser.add_argument("--concurrency", type=int, default=16, help="effects in flight")
    parser.add_argument("--kills", type=int, default=8, help="SIGKILLs of the gateway per store")
    parser.add_argument("--seed", type=int, default=1, help="kill times, effects, latencies")
    parser.add_argument(
        "--max-seconds", type=float, default=120.0, help="bound on the driver, per store"
    )
    parser.add_argument(
        "--orders-fraction", type=float, default=0.5, help="share of effects sent to orders"
    )
    parser.add_argument(
        "--timeout-ms", type=int, default=1000, help="timeout_ms of both downstreams"
    )
    parser.add_argument(
        "--slow-fraction",
        type=float,
        default=0.05,
        help="downstream answers slower than --timeout-ms (1.05-1.5 x); the rest take 0-300 ms",
    )
    parser.add_argument(
        "--execute-at",
        choices=["arrival", "random", "end"],
        default="random",
        help="when, inside its answer time, the downstream executes the effect",
    )
    parser.add_argument(
        "--window-ms", type=int, default=600_000, help="dedupe window of pay (both sides)"
    )
    parser.add_argument("--ttl-ms", type=int, default=4000, help="lease of every claim")
    parser.add_argument(
        "--operator-after",
        type=float,
        default=3.0,
        help="seconds of EFFECT_UNKNOWN on pay before an operator resolves it",
    )
    parser.add_argument(
        "--spread-seconds",
        type=float,
        default=None,
        help="start the effects evenly over this long (default: about the kill schedule)",
    )
    parser.add_argument("--reconciler-interval-ms", type=int, default=500)
    parser.add_argument(
        "--gateway-toml",
        action="append",
        default=[],
        metavar="LINE",
        help="a line appended to the gateway config (it lands in [downstreams.probe] of "
        "orders unless it opens a table); repeatable",
    )
    add_run_options(parser, report="the report then goes")
    parser.add_argument(
        "--verbose", action="store_true", help="print records and logs of unsettled effects too"
    )
    parser.add_argument("--serve-downstream", metavar="HOST:PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_downstream:
        return args
    if min(args.effects, args.concurrency) < 1 or args.kills < 0:
        parser.error("--effects and --concurrency must be >= 1, --kills >= 0")
    if args.max_seconds <= 0 or not 0 <= args.orders_fraction <= 1:
        parser.error("--max-seconds must be > 0, --orders-fraction in [0, 1]")
    if not 0 <= args.slow_fraction <= 1 or args.ttl_ms < 100 or args.timeout_ms < 10:
        parser.error("--slow-fraction in [0, 1], --ttl-ms >= 100, --timeout-ms >= 10")
    args.stores = list(STORES) if args.store == "both" else [args.store]
    check_run_options(parser, args, args.stores)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_downstream:
        app = downstream_app(
            seed=args.seed,
            timeout_ms=args.timeout_ms,
            slow_fraction=args.slow_fraction,
            execute_at=args.execute_at,
            window_ms=args.window_ms,
        )
        return _serve(app, args.serve_downstream)

    # SIGTERM unwinds like Ctrl-C, so the processes we started are stopped on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    origin = gateway_origin(args.gateway_src)
    progress(f"the gateway runs from {origin}")
    work = Path(tempfile.mkdtemp(prefix="fencegate-soak-kill-", dir=args.temp_dir))
    fs = filesystem_of(work)
    progress(f"working in {work} on {fs}")
    started = time.monotonic()
    all_figures: list[dict[str, Any]] = []
    exit_codes: dict[str, dict[str, int | None]] = {}
    redis_version: str | None = None
    troubled = False
    try:
        for n, store in enumerate(args.stores):
            run = Run(work / store)
            run.work.mkdir()
            try:
                figures = asyncio.run(terminable(run_store(store, run, args, args.seed + n)))
                all_figures.append(figures)
                troubled = troubled or failed(figures)
            finally:
                exit_codes[store] = run.stop()
                redis_version = redis_version or run.redis_version
    except KeyboardInterrupt:
        progress("interrupted")
        troubled = True
        return 130
    except (RuntimeError, OSError, redis.exceptions.RedisError, aiohttp.ClientError) as exc:
        progress(f"could not run: {type(exc).__name__}: {exc}")
        troubled = True
        return 1
    finally:
        if args.keep or troubled:
            progress(f"kept {work} (logs and data)")
        else:
            shutil.rmtree(work, ignore_errors=True)

    settings = (
        f"{args.effects} effects per store, concurrency {args.concurrency}, {args.kills} kills, "
        f"seed {args.seed}, downstream timeout_ms {args.timeout_ms}, slow {args.slow_fraction:g}, "
        f"execute at {args.execute_at}, ttl {args.ttl_ms} ms, {os.cpu_count()} CPUs, temp dir on "
        f"{fs}, gateway from {origin}"
    )
    if args.gateway_toml:
        settings += f", gateway config plus {args.gateway_toml!r}"
    out = sys.stderr if args.json == "-" else sys.stdout
    print_report(all_figures, settings, out, args.verbose)
    print(f"total wall time {time.monotonic() - started:.0f}s", file=out)
    if args.json:
        document = {
            "benchmark": "soak_kill",
            "settings": {
                k: (str(v) if isinstance(v, Path) else v)
                for k, v in vars(args).items()
                if k != "serve_downstream"
            },
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "aiohttp": aiohttp.__version__,
                "redis": redis_version,
                "tempFilesystem": fs,
                "gatewaySource": origin,
            },
            "stores": all_figures,
            "exitCodes": exit_codes,
        }
        text = json.dumps(document, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 1 if any(failed(f) for f in all_figures) else 0


if __name__ == "__main__":
    sys.exit(main())
