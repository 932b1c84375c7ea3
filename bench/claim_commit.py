"""Claim+commit cycles per second through a real gateway, per store, against a bare baseline.

Run from the repository root::

    .venv/bin/python -m bench.claim_commit                      # defaults: 2000 tasks, 16 workers
    .venv/bin/python -m bench.claim_commit --appendfsync everysec --json -
    .venv/bin/python -m bench.claim_commit --mode queue         # claims from a queue instead

For every phase the benchmark starts its own processes on loopback, in a temporary directory:

* ``baseline``: a bare aiohttp server (this module, ``--serve-baseline``) that answers the same
  requests with fixed JSON, no store, no validation, no logging;
* ``sqlite``: ``fencegate serve`` on the embedded store (a fresh database file);
* ``redis``: a private ``redis-server`` (AOF on, ``appendfsync always`` by default) and
  ``fencegate serve`` on it. It never talks to a Redis it did not start;
* ``postgres``: a private PostgreSQL cluster (``initdb`` in the temporary directory, a free
  loopback port, ``fsync=on``, ``synchronous_commit=on``; ``tests.postgres_server``) with a new
  database, and ``fencegate serve`` on it. It never talks to the machine's own PostgreSQL.

Each phase first PUTs every task (not measured), runs a few warm-up cycles (not measured), then
runs the measured part: ``--concurrency`` workers on one client session take task ids from one
list and, for each, POST ``claim`` then POST ``commit``. A cycle is timed from the claim request
to the commit answer. With ``--mode queue`` every task is PUT into one queue and a cycle is
POST ``/v1/queues/{queue}/claim`` (the best task of the queue, whichever it is) then its
commit. The baseline runs before and after every store phase with the very same
client code, so each store can be read as a ratio against the baselines around it (the absolute
figures move with the machine's load). ``bench/README.md`` says how to read the table.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
from aiohttp import web

from bench._args import add_run_options, add_store_options, check_run_options, parse_stores
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
    redis_script_stats,
    redis_stats_reset,
    render_redis_scripts,
    scan_gateway_log,
    start_gateway,
    start_module_server,
    start_postgres,
    start_redis,
    terminable,
)

__all__ = ["main"]

#: Lease asked for by every claim: long enough that no lease runs out during a run.
TTL_MS = 60_000
#: Per-request client timeout; a gateway that stops answering shows up as errors, not a hang.
REQUEST_TIMEOUT_S = 30.0
#: How many distinct error answers are kept verbatim per phase.
ERROR_SAMPLES = 5


# --- the baseline server ---------------------------------------------------------------------


def baseline_app() -> web.Application:
    """Answers the benchmark's requests with JSON of the gateway's shapes, and nothing more."""

    async def claim(request: web.Request) -> web.Response:
        return await answer_claim(request, request.match_info["task_id"])

    async def claim_next(request: web.Request) -> web.Response:
        return await answer_claim(request, uuid.uuid4().hex)

    async def answer_claim(request: web.Request, task_id: str) -> web.Response:
        body = json.loads(await request.read())
        now = time.time_ns() // 1_000_000
        return web.json_response(
            {
                "taskId": task_id,
                "attemptId": uuid.uuid4().hex,
                "claimGeneration": 1,
                "schedulerEpoch": body["schedulerEpoch"],
                "cancelGeneration": 0,
                "leaseExpiresAt": now + body["ttlMs"],
                "grantedTtlMs": body["ttlMs"],
                "revision": 1,
                "inputDigest": "0" * 64,
            }
        )

    async def commit(request: web.Request) -> web.Response:
        json.loads(await request.read())
        return web.json_response({"outcome": "COMMITTED", "commitId": uuid.uuid4().hex})

    async def put_task(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        return web.json_response(
            {"taskId": request.match_info["task_id"], "state": "READY", **body}, status=201
        )

    async def epoch(request: web.Request) -> web.Response:
        return web.json_response({"schedulerEpoch": 1, "claimsPaused": False})

    async def ready(request: web.Request) -> web.Response:
        return web.json_response({"status": "ready", "store": "none"})

    app = web.Application()
    app.router.add_post(r"/v1/queues/{queue}/claim", claim_next)
    app.router.add_post(r"/v1/tasks/{task_id:.+}/claim", claim)
    app.router.add_post(r"/v1/tasks/{task_id:.+}/commit", commit)
    app.router.add_put(r"/v1/tasks/{task_id:.+}", put_task)
    app.router.add_get("/v1/epoch", epoch)
    app.router.add_get("/readyz", ready)
    return app


def serve_baseline(listen: str) -> int:
    host, _, port = listen.rpartition(":")
    if host not in (HOST, "localhost"):
        print("the baseline server listens on loopback only", file=sys.stderr)
        return 2
    # The same run_app options as ``fencegate serve``.
    web.run_app(
        baseline_app(),
        host=host,
        port=int(port),
        print=None,
        access_log=None,
        handler_cancellation=True,
    )
    return 0


# --- the client ------------------------------------------------------------------------------


class StepFailed(Exception):
    """One request that did not get a 2xx answer (status 0: no answer at all)."""

    def __init__(self, step: str, status: int, body: bytes, code: str | None = None) -> None:
        self.step = step
        self.status = status
        self.body = body
        if code is None:
            try:
                code = str(json.loads(body).get("code", "-"))
            except (ValueError, AttributeError):
                code = "-"
        self.code = code
        super().__init__(f"{step}: {status} {self.code}")

    @property
    def key(self) -> str:
        return f"{self.step} {self.status} {self.code}"

    @property
    def sample(self) -> str:
        return f"{self.key}: {self.body[:300].decode(errors='replace')}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Outcome:
    """What the workers of one batch saw."""

    done: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    cycle_ms: list[float] = field(default_factory=list)
    claim_ms: list[float] = field(default_factory=list)
    commit_ms: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    samples: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    cut_by_time: bool = False

    def record_error(self, key: str, sample: str) -> None:
        self.errors[key] += 1
        if key not in self.samples and len(self.samples) < ERROR_SAMPLES:
            self.samples[key] = sample


class Client:
    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self.session = session
        self.base = base

    async def call(self, step: str, method: str, path: str, body: Any = None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        headers = None if body is None else {"Content-Type": "application/json"}
        try:
            async with self.session.request(
                method, self.base + path, data=data, headers=headers
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise StepFailed(step, 0, str(exc).encode(), type(exc).__name__) from exc
        if not 200 <= status < 300:
            raise StepFailed(step, status, raw)
        return raw


#: One unit of work: (client, task id, owner, outcome to record timings in).
Step = Callable[["Client", str, str, Outcome], Awaitable[None]]


async def _run_workers(
    client: Client,
    task_ids: Sequence[str],
    concurrency: int,
    deadline: float,
    one: Step,
) -> Outcome:
    """``concurrency`` workers take ids from one shared iterator until done or ``deadline``."""
    out = Outcome()
    ids: Iterator[str] = iter(task_ids)

    async def worker(n: int) -> None:
        owner = f"bench-worker-{n}"
        for task_id in ids:
            if time.perf_counter() >= deadline:
                out.cut_by_time = True
                return
            try:
                await one(client, task_id, owner, out)
            except StepFailed as exc:
                out.failed.append(task_id)
                out.record_error(exc.key, exc.sample)
            else:
                out.done.append(task_id)

    start = time.perf_counter()
    await asyncio.gather(*(worker(n) for n in range(concurrency)))
    out.seconds = time.perf_counter() - start
    return out


def _queue_of(task_id: str) -> str:
    """``--mode queue``: the queue a task goes into, its id without the last part (warm-up
    tasks get their own queue)."""
    return task_id.rsplit(".", 1)[0]


def _put_step(mode: str) -> Step:
    async def put(client: Client, task_id: str, owner: str, out: Outcome) -> None:
        body: dict[str, Any] = {"inputDigest": _digest(task_id)}
        if mode == "queue":
            body["queue"] = _queue_of(task_id)
        await client.call("put", "PUT", f"/v1/tasks/{task_id}", body)

    return put


def _cycle(epoch: int, mode: str = "id") -> Step:
    """Claim (by id, or the next of the task's queue), then commit what was claimed."""

    async def cycle(client: Client, task_id: str, owner: str, out: Outcome) -> None:
        t0 = time.perf_counter()
        path = (
            f"/v1/queues/{_queue_of(task_id)}/claim"
            if mode == "queue"
            else f"/v1/tasks/{task_id}/claim"
        )
        raw = await client.call(
            "claim", "POST", path, {"owner": owner, "ttlMs": TTL_MS, "schedulerEpoch": epoch}
        )
        if not raw:
            raise StepFailed("claim", 204, b"", "EMPTY_QUEUE")
        claim = json.loads(raw)
        task_id = claim["taskId"]
        t1 = time.perf_counter()
        await client.call(
            "commit",
            "POST",
            f"/v1/tasks/{task_id}/commit",
            {
                "attemptId": claim["attemptId"],
                "claimGeneration": claim["claimGeneration"],
                "schedulerEpoch": claim["schedulerEpoch"],
                "cancelGeneration": claim["cancelGeneration"],
                "inputDigest": _digest(task_id),
                "resultDigest": _digest(f"result:{task_id}"),
            },
        )
        t2 = time.perf_counter()
        out.claim_ms.append((t1 - t0) * 1000)
        out.commit_ms.append((t2 - t1) * 1000)
        out.cycle_ms.append((t2 - t0) * 1000)

    return cycle


async def _states(client: Client, task_ids: Sequence[str], concurrency: int) -> Counter[str]:
    """The state of every task after the run, read back through the gateway (not measured)."""
    states: Counter[str] = Counter()
    ids = iter(task_ids)

    async def read(task_id: str) -> str:
        for attempt in range(5):  # a 503 here says nothing about the task: ask again
            try:
                raw = await client.call("get", "GET", f"/v1/tasks/{task_id}")
                return str(json.loads(raw)["state"])
            except StepFailed as exc:
                if exc.status != 503 or attempt == 4:
                    return f"GET {exc.status} {exc.code}"
                await asyncio.sleep(0.1 * (attempt + 1))
        raise AssertionError("unreachable")

    async def reader() -> None:
        for task_id in ids:
            states[await read(task_id)] += 1

    await asyncio.gather(*(reader() for _ in range(concurrency)))
    return states


@dataclass
class ClientRun:
    put: Outcome
    warmup: Outcome
    measured: Outcome
    server_cpu_s: dict[str, float] | None
    client_cpu_s: float
    states_done: Counter[str] | None
    states_failed: Counter[str] | None
    redis_cpu: dict[str, Any] | None = None


async def drive(
    base: str,
    procs: Sequence[Proc],
    *,
    tasks: int,
    warmup: int,
    concurrency: int,
    max_seconds: float,
    verify: bool,
    redis_url: str | None = None,
    script_names: dict[str, str] | None = None,
    mode: str = "id",
) -> ClientRun:
    run_id = uuid.uuid4().hex[:8]
    warm_ids = [f"bench.{run_id}.warm.{i:05d}" for i in range(warmup)]
    task_ids = [f"bench.{run_id}.{i:06d}" for i in range(tasks)]
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        client = Client(session, base)
        epoch = int(json.loads(await client.call("epoch", "GET", "/v1/epoch"))["schedulerEpoch"])
        cycle = _cycle(epoch, mode)

        # Not measured: create every task, then warm the connections and the server up.
        put = await _run_workers(
            client,
            warm_ids + task_ids,
            concurrency,
            time.perf_counter() + max_seconds,
            _put_step(mode),
        )
        created = set(put.done)
        warm = await _run_workers(
            client,
            [t for t in warm_ids if t in created],
            concurrency,
            time.perf_counter() + max_seconds,
            cycle,
        )

        # Measured: claim -> commit for every created task, bounded by --max-seconds.
        if redis_url:
            redis_stats_reset(redis_url, 16 * tasks + 1000)
        cpu_before = [p.cpu() for p in procs]
        client_cpu_before = time.process_time()
        measured = await _run_workers(
            client,
            [t for t in task_ids if t in created],
            concurrency,
            time.perf_counter() + max_seconds,
            cycle,
        )
        client_cpu = time.process_time() - client_cpu_before
        cpu_after = [p.cpu() for p in procs]
        redis_cpu = None
        if redis_url:
            redis_cpu = redis_script_stats(redis_url, script_names or {}, len(measured.done))
        server_cpu: dict[str, float] | None = {}
        for proc, before, after in zip(procs, cpu_before, cpu_after, strict=True):
            if before is None or after is None or server_cpu is None:
                server_cpu = None
            else:
                server_cpu[proc.name] = after - before

        states_done = states_failed = None
        if verify:
            states_done = await _states(client, measured.done, concurrency)
            states_failed = await _states(client, measured.failed, concurrency)
    return ClientRun(
        put, warm, measured, server_cpu, client_cpu, states_done, states_failed, redis_cpu
    )


# --- phases ----------------------------------------------------------------------------------


@dataclass
class PhaseResult:
    name: str
    planned: int
    cycles: int
    failed: int
    seconds: float
    cut_by_time: bool
    cycle_ms: list[float]
    claim_ms: list[float]
    commit_ms: list[float]
    errors: dict[str, int]
    error_samples: list[str]
    setup_errors: dict[str, int]
    server_cpu_s: dict[str, float] | None
    client_cpu_s: float
    states_done: dict[str, int] | None
    states_failed: dict[str, int] | None
    log_events: dict[str, int]
    exit_codes: dict[str, int | None]
    notes: list[str]
    #: Redis CPU of the measured part, per script (``_procs.redis_script_stats``).
    redis_cpu: dict[str, Any] | None = None

    @property
    def rate(self) -> float:
        return self.cycles / self.seconds if self.seconds > 0 else 0.0

    def server_cpu_ms_per_cycle(self) -> float | None:
        if self.server_cpu_s is None or not self.cycles:
            return None
        return sum(self.server_cpu_s.values()) * 1000 / self.cycles

    def store_cpu_ms_per_cycle(self) -> float | None:
        """CPU of the store's own server processes (``redis-server``; ``postgres``: the
        postmaster and all its backends), per cycle; None for SQLite (in the gateway) and the
        baseline."""
        if self.server_cpu_s is None or not self.cycles:
            return None
        mine = [cpu for name, cpu in self.server_cpu_s.items() if name in STORE_SERVERS]
        return sum(mine) * 1000 / self.cycles if mine else None

    def summary(self, reference: PhaseResult | None) -> dict[str, Any]:
        p50 = percentile(self.cycle_ms, 50)
        ref_p50 = percentile(reference.cycle_ms, 50) if reference else None
        return {
            "phase": self.name,
            "plannedCycles": self.planned,
            "cycles": self.cycles,
            "failedCycles": self.failed,
            "seconds": round(self.seconds, 3),
            "cutByMaxSeconds": self.cut_by_time,
            "cyclesPerSecond": round(self.rate, 1),
            "cycleP50Ms": _round(p50),
            "cycleP99Ms": _round(percentile(self.cycle_ms, 99)),
            "cycleMaxMs": _round(max(self.cycle_ms, default=None)),
            "claimP50Ms": _round(percentile(self.claim_ms, 50)),
            "claimP99Ms": _round(percentile(self.claim_ms, 99)),
            "commitP50Ms": _round(percentile(self.commit_ms, 50)),
            "commitP99Ms": _round(percentile(self.commit_ms, 99)),
            "serverCpuMsPerCycle": _round(self.server_cpu_ms_per_cycle()),
            "storeCpuMsPerCycle": _round(self.store_cpu_ms_per_cycle(), 3),
            "serverCpuMsPerCycleByProcess": {
                name: _round(cpu * 1000 / self.cycles)
                for name, cpu in (self.server_cpu_s or {}).items()
                if self.cycles
            },
            "clientCpuMsPerCycle": _round(
                self.client_cpu_s * 1000 / self.cycles if self.cycles else None
            ),
            "rateVsBaseline": _round(self.rate / reference.rate, 3)
            if reference and reference.rate
            else None,
            "p50VsBaseline": _round(p50 / ref_p50, 2) if p50 and ref_p50 else None,
            "errors": self.errors,
            "errorSamples": self.error_samples,
            "setupErrors": self.setup_errors,
            "statesOfCommittedCycles": self.states_done,
            "statesOfFailedCycles": self.states_failed,
            "serverLogEvents": self.log_events,
            "exitCodes": self.exit_codes,
            "notes": self.notes,
            "redisCpu": self.redis_cpu,
        }


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def run_phase(
    name: str,
    base: str,
    procs: Sequence[Proc],
    args: argparse.Namespace,
    verify: bool,
    redis_url: str | None = None,
) -> PhaseResult:
    names = redis_script_names(args.gateway_src) if redis_url else None
    run = asyncio.run(
        terminable(
            drive(
                base,
                procs,
                tasks=args.tasks,
                warmup=args.warmup,
                concurrency=args.concurrency,
                max_seconds=args.max_seconds,
                verify=verify,
                redis_url=redis_url,
                script_names=names,
                mode=args.mode,
            )
        )
    )
    m = run.measured
    notes: list[str] = []
    if run.put.errors:
        notes.append(f"{len(run.put.failed)} PUTs failed: those tasks were not measured")
    if run.put.cut_by_time:
        notes.append("PUT setup hit --max-seconds: only the tasks created were measured")
    if run.warmup.errors:
        notes.append(f"warm-up errors: {dict(run.warmup.errors)}")
    if m.cut_by_time:
        notes.append(f"stopped by --max-seconds after {len(m.done) + len(m.failed)} cycles")
    if run.states_done is not None and run.states_done.get("COMMITTED", 0) != len(m.done):
        notes.append(f"answered COMMITTED but read back as {dict(run.states_done)}")
    for proc in procs:
        if not proc.alive():
            notes.append(f"{proc.name} died during the run (exit {proc.popen.returncode})")
    setup_errors = dict(run.put.errors)
    setup_errors.update({f"warm-up {k}": v for k, v in run.warmup.errors.items()})
    samples = list(m.samples.values())
    samples += [f"put: {s}" for s in run.put.samples.values()]
    samples += [f"warm-up: {s}" for s in run.warmup.samples.values()]
    return PhaseResult(
        name=name,
        planned=args.tasks,
        cycles=len(m.done),
        failed=len(m.failed),
        seconds=m.seconds,
        cut_by_time=m.cut_by_time,
        cycle_ms=m.cycle_ms,
        claim_ms=m.claim_ms,
        commit_ms=m.commit_ms,
        errors=dict(m.errors),
        error_samples=samples,
        setup_errors={
            **run.put.errors,
            **{f"warm-up {k}": v for k, v in run.warmup.errors.items()},
        },
        server_cpu_s=run.server_cpu_s,
        client_cpu_s=run.client_cpu_s,
        states_done=dict(run.states_done) if run.states_done is not None else None,
        states_failed=dict(run.states_failed) if run.states_failed is not None else None,
        log_events={},
        exit_codes={},
        notes=notes,
        redis_cpu=run.redis_cpu,
    )


def _finish(result: PhaseResult, procs: Sequence[Proc], gateway_log: Path | None) -> None:
    for proc in reversed(procs):  # the gateway before its store
        result.exit_codes[proc.name] = proc.stop()
    if gateway_log is not None:
        result.log_events, odd = scan_gateway_log(gateway_log)
        result.error_samples += [f"gateway log: {line}" for line in odd]


def phase_baseline(name: str, work: Path, args: argparse.Namespace) -> PhaseResult:
    proc, base = start_module_server(
        "baseline", "bench.claim_commit", "--serve-baseline", work / "baseline"
    )
    try:
        result = run_phase(name, base, [proc], args, verify=False)
    finally:
        exit_code = proc.stop()
    result.exit_codes[proc.name] = exit_code
    return result


def phase_sqlite(work: Path, args: argparse.Namespace) -> PhaseResult:
    directory = work / "sqlite"
    url = f"sqlite:///{directory / 'fencegate.db'}"  # absolute path: four slashes
    gateway, base = start_gateway(
        directory,
        url,
        log_level=args.log_level,
        sqlite_synchronous=args.sqlite_synchronous,
        source=args.gateway_src,
        store_timeout_ms=args.store_timeout_ms,
    )
    procs = [gateway]
    try:
        result = run_phase("sqlite", base, procs, args, verify=not args.no_verify)
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    _finish(result, procs, gateway.log_path)
    return result


def phase_postgres(work: Path, top: Path, args: argparse.Namespace) -> tuple[PhaseResult, str]:
    """A private PostgreSQL cluster with a new database, and a gateway on it."""
    server, urls, version = start_postgres(work / "postgres", top, ["fencegate"])
    procs: list[Proc] = [server]
    try:
        gateway, base = start_gateway(
            work / "postgres-gateway",
            urls[0],
            log_level=args.log_level,
            sqlite_synchronous=args.sqlite_synchronous,
            source=args.gateway_src,
            store_timeout_ms=args.store_timeout_ms,
            store_lines=postgres_store_lines(args),
        )
        procs.append(gateway)
        result = run_phase("postgres", base, procs, args, verify=not args.no_verify)
    except BaseException:
        for proc in reversed(procs):
            proc.stop()
        raise
    _finish(result, procs, gateway.log_path)
    return result, version


def postgres_store_lines(args: argparse.Namespace) -> list[str]:
    if args.postgres_max_connections is None:
        return []
    return [f"postgres_max_connections = {args.postgres_max_connections}"]


def phase_redis(work: Path, args: argparse.Namespace) -> tuple[PhaseResult, str]:
    server, url, version = start_redis(args.redis_server, work / "redis", args.appendfsync)
    procs = [server]
    try:
        gateway, base = start_gateway(
            work / "redis-gateway",
            url,
            log_level=args.log_level,
            sqlite_synchronous=args.sqlite_synchronous,
            source=args.gateway_src,
            store_timeout_ms=args.store_timeout_ms,
            durable=args.appendfsync == "always",
        )
        procs.append(gateway)
        result = run_phase("redis", base, procs, args, verify=not args.no_verify, redis_url=url)
    except BaseException:
        for proc in reversed(procs):
            proc.stop()
        raise
    _finish(result, procs, gateway.log_path)
    return result, version


# --- report ----------------------------------------------------------------------------------


def empty_result(name: str, planned: int, note: str) -> PhaseResult:
    return PhaseResult(
        name=name,
        planned=planned,
        cycles=0,
        failed=0,
        seconds=0.0,
        cut_by_time=False,
        cycle_ms=[],
        claim_ms=[],
        commit_ms=[],
        errors={},
        error_samples=[],
        setup_errors={},
        server_cpu_s=None,
        client_cpu_s=0.0,
        states_done=None,
        states_failed=None,
        log_events={},
        exit_codes={},
        notes=[note],
    )


def is_baseline(result: PhaseResult) -> bool:
    return result.name.startswith("baseline")


def reference_of(results: Sequence[PhaseResult]) -> PhaseResult | None:
    """One baseline made of the given baseline runs (their cycles pooled), or None."""
    baselines = [r for r in results if is_baseline(r) and r.cycles]
    if not baselines:
        return None
    pooled = empty_result("baseline (pooled)", sum(r.planned for r in baselines), "")
    pooled.notes = []
    pooled.cycles = sum(r.cycles for r in baselines)
    pooled.seconds = sum(r.seconds for r in baselines)
    pooled.cycle_ms = [x for r in baselines for x in r.cycle_ms]
    return pooled


def phase_plan(stores: Sequence[str], rounds: int) -> list[str]:
    """A baseline before and after every store phase: baseline 1, sqlite, baseline 2, ..."""
    plan = ["baseline 1"]
    for round_ in range(1, rounds + 1):
        for store in stores:
            plan.append(store if rounds == 1 else f"{store} #{round_}")
            plan.append(f"baseline {len(plan) // 2 + 1}")
    return plan


def neighbours(results: Sequence[PhaseResult], i: int) -> list[PhaseResult]:
    """The baselines to read ``results[i]`` against: its neighbours, or every baseline."""
    if is_baseline(results[i]):
        return [r for r in results if is_baseline(r)]
    return [r for r in results[max(0, i - 1) : i + 2] if is_baseline(r)]


def render_medians(summaries: Sequence[dict[str, Any]], stores: Sequence[str]) -> str:
    header = ("store", "rounds", "cycles/s", "p50 ms", "p99 ms", "rate / base", "p50 / base")
    keys = ("cyclesPerSecond", "cycleP50Ms", "cycleP99Ms", "rateVsBaseline", "p50VsBaseline")
    specs = (".0f", ".2f", ".2f", ".3f", ".2f")
    rows: list[tuple[str, ...]] = [header]
    for store in stores:
        mine = [s for s in summaries if s["phase"].split(" ")[0] == store and s["cycles"]]
        cells = [store, str(len(mine))]
        for key, spec in zip(keys, specs, strict=True):
            values = [s[key] for s in mine if s[key] is not None]
            cells.append(fmt(statistics.median(values) if values else None, spec))
        rows.append(tuple(cells))
    return align(rows)


def render_table(summaries: Sequence[dict[str, Any]]) -> str:
    header = (
        "phase",
        "cycles",
        "failed",
        "seconds",
        "cycles/s",
        "p50 ms",
        "p99 ms",
        "srv CPU ms/cycle",
        "store CPU ms/cycle",
        "rate / base",
        "p50 / base",
    )
    rows = [header]
    for s in summaries:
        rows.append(
            (
                s["phase"],
                str(s["cycles"]),
                str(s["failedCycles"]),
                fmt(s["seconds"], ".2f"),
                fmt(s["cyclesPerSecond"], ".0f"),
                fmt(s["cycleP50Ms"], ".2f"),
                fmt(s["cycleP99Ms"], ".2f"),
                fmt(s["serverCpuMsPerCycle"], ".2f"),
                fmt(s["storeCpuMsPerCycle"], ".3f"),
                fmt(s["rateVsBaseline"], ".3f"),
                fmt(s["p50VsBaseline"], ".2f"),
            )
        )
    return align(rows)


# --- main ------------------------------------------------------------------------------------


#: Stores measured by default, in phase order.
STORES_DEFAULT = "sqlite,redis,postgres"
#: The names of the store server processes among a phase's processes.
STORE_SERVERS = ("redis-server", "postgres")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.claim_commit",
        description="claim+commit cycles per second through a real gateway, per store, "
        "against a bare aiohttp baseline on loopback.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--tasks", type=int, default=2000, help="measured cycles per phase")
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent workers")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=60.0,
        help="time bound of each phase's measured part (and of its PUT set-up)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the store phases this many times (medians are printed too)",
    )
    parser.add_argument("--warmup", type=int, default=100, help="unmeasured cycles per phase")
    parser.add_argument(
        "--mode",
        choices=("id", "queue"),
        default="id",
        help="claim each task by id, or claim the next task of one queue (default: id)",
    )
    add_store_options(parser, stores=STORES_DEFAULT)
    parser.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="gateway logging.level (info, the default, logs one event per decision)",
    )
    parser.add_argument(
        "--store-timeout-ms",
        type=int,
        metavar="MS",
        help="gateway store.timeout_ms (unset: the gateway default, 2000)",
    )
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="skip reading every task back after the run",
    )
    add_run_options(parser, report="the table then goes")
    parser.add_argument("--serve-baseline", metavar="HOST:PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_baseline:
        return args
    args.stores = parse_stores(parser, args.stores, STORES_DEFAULT)
    if min(args.tasks, args.concurrency, args.rounds) < 1 or args.warmup < 0:
        parser.error("--tasks, --concurrency and --rounds must be >= 1, --warmup >= 0")
    if args.max_seconds <= 0:
        parser.error("--max-seconds must be > 0")
    check_run_options(parser, args, args.stores)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_baseline:
        return serve_baseline(args.serve_baseline)

    # SIGTERM unwinds like Ctrl-C, so the processes we started are stopped on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    origin = gateway_origin(args.gateway_src)
    progress(f"the gateway runs from {origin}")
    work = Path(tempfile.mkdtemp(prefix="fencegate-bench-", dir=args.temp_dir))
    fs = filesystem_of(work)
    progress(f"working in {work} on {fs}")
    results: list[PhaseResult] = []
    redis_version: str | None = None
    postgres_version: str | None = None
    started = time.monotonic()
    try:
        for n, name in enumerate(phase_plan(args.stores, args.rounds)):
            progress(f"{name}: {args.tasks} tasks, concurrency {args.concurrency} ...")
            try:
                if name.startswith("baseline"):
                    result = phase_baseline(name, work / f"{n:02d}", args)
                elif name.startswith("sqlite"):
                    result = phase_sqlite(work / f"{n:02d}", args)
                    result.name = name
                elif name.startswith("postgres"):
                    result, postgres_version = phase_postgres(work / f"{n:02d}", work, args)
                    result.name = name
                else:
                    result, redis_version = phase_redis(work / f"{n:02d}", args)
                    result.name = name
            except (RuntimeError, OSError, redis.exceptions.RedisError) as exc:
                progress(f"{name}: could not run: {exc}")
                result = empty_result(name, args.tasks, f"could not run: {exc}")
            results.append(result)
            progress(
                f"{name}: {result.cycles} cycles in {result.seconds:.2f}s "
                f"({result.rate:.0f}/s), {result.failed} failed"
            )
    except KeyboardInterrupt:
        progress("interrupted")
        return 130
    finally:
        troubled = any(r.errors or r.setup_errors or r.notes for r in results)
        if args.keep or troubled:
            progress(f"kept {work} (logs and data)")
        else:
            shutil.rmtree(work, ignore_errors=True)

    summaries = [r.summary(reference_of(neighbours(results, i))) for i, r in enumerate(results)]
    settings = (
        f"{args.tasks} tasks, claims by {args.mode}, concurrency {args.concurrency}, "
        "redis appendfsync "
        f"{args.appendfsync}, sqlite synchronous {args.sqlite_synchronous}, "
        + (
            f"postgres fsync=on synchronous_commit=on (pool "
            f"{args.postgres_max_connections or 'default'}), "
            if "postgres" in args.stores
            else ""
        )
        + f"gateway log level {args.log_level}, {os.cpu_count()} CPUs, temp dir (every "
        f"store's data) on {fs}, gateway from {origin}"
    )
    if args.store_timeout_ms is not None:
        settings += f", store.timeout_ms {args.store_timeout_ms}"
    table = render_table(summaries)
    out = sys.stderr if args.json == "-" else sys.stdout
    print(f"\nclaim+commit cycles ({settings})\n", file=out)
    print(table, file=out)
    rates = [r.rate for r in results if is_baseline(r) and r.cycles]
    if rates:
        print(
            "\nrate / base and p50 / base: a store against the baseline runs just before and "
            "after it (pooled); a baseline against all baseline runs. The baseline ranged "
            f"{min(rates):.0f}..{max(rates):.0f} cycles/s ({max(rates) / min(rates) - 1:+.0%}) "
            "during this run.",
            file=out,
        )
    if args.rounds > 1:
        print(f"\nmedians over {args.rounds} rounds\n", file=out)
        print(render_medians(summaries, args.stores), file=out)
    for s in summaries:
        if s["redisCpu"]:
            print("\n" + render_redis_scripts(s["phase"], s["redisCpu"], "cycle"), file=out)
    for s in summaries:
        for note in s["notes"]:
            print(f"note: {s['phase']}: {note}", file=out)
        if s["errors"] or s["setupErrors"]:
            print(f"errors: {s['phase']}: {s['errors'] or ''} {s['setupErrors'] or ''}", file=out)
            for sample in s["errorSamples"]:
                print(f"    {sample}", file=out)
        if s["statesOfFailedCycles"]:
            print(
                f"read back: {s['phase']}: tasks of the failed cycles are now "
                f"{s['statesOfFailedCycles']}",
                file=out,
            )
        loud = {k: v for k, v in s["serverLogEvents"].items() if not k.startswith("info ")}
        if loud:
            print(f"server log: {s['phase']}: {loud}", file=out)
    print(f"total wall time {time.monotonic() - started:.0f}s", file=out)

    if args.json:
        document = {
            "benchmark": "claim_commit",
            "settings": {
                "tasks": args.tasks,
                "mode": args.mode,
                "concurrency": args.concurrency,
                "warmup": args.warmup,
                "maxSeconds": args.max_seconds,
                "stores": args.stores,
                "rounds": args.rounds,
                "appendfsync": args.appendfsync,
                "sqliteSynchronous": args.sqlite_synchronous,
                "postgresMaxConnections": args.postgres_max_connections,
                "gatewayLogLevel": args.log_level,
                "storeTimeoutMs": args.store_timeout_ms,
            },
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "aiohttp": aiohttp.__version__,
                "redis": redis_version,
                "postgres": postgres_version,
                "tempFilesystem": fs,
                "gatewaySource": origin,
            },
            "phases": summaries,
        }
        text = json.dumps(document, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    failed = any(r.failed or r.setup_errors for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
