"""The chaos run: SDK workers run tasks through real gateways while a seeded fault schedule
kills and freezes processes; at the end an invariant checker compares what the downstream
received with the ledger and with what the workers were told.

Run from the repository root::

    .venv/bin/python -m bench.chaos --seconds 60 --seed 7      # redis, sentinel, postgres, sqlite
    .venv/bin/python -m bench.chaos --seconds 600 --seed 1                # the 10-minute run
    .venv/bin/python -m bench.chaos --seconds 30 --stores sqlite --workers 4 --json chaos.json
    .venv/bin/python -m bench.chaos --seconds 60 --stores cluster             # Redis Cluster

Per store, one after another (``--seconds`` is split evenly between them), on loopback and in
a temporary directory:

* the store: a private ``redis-server`` (``appendonly yes``, ``appendfsync always``) with TWO
  ``fencegate serve`` processes on it; Redis under Sentinel (``sentinel``: a master, two
  replicas and three sentinels of ``tests.sentinel_servers``, the gateways on a
  ``redis+sentinel://`` URL with ``redis_min_replicas = 2``) with TWO gateways; a private
  PostgreSQL cluster (``bench._procs``) with TWO gateways; a SQLite file with ONE gateway;
  or (``cluster``, not in the default list) a Redis Cluster of three primaries and three
  replicas (``tests.cluster_servers``, ``cluster-require-full-coverage no``) with TWO gateways
  on a ``redis+cluster://`` URL with ``redis_min_replicas = 1`` (each write answered once the
  shard's replica holds it, so a failover loses no answered write);
* a downstream in this process (aiohttp) that logs every call it receives: ``Idempotency-Key``
  (the effectId), ``Fencing-Token``, the task, the arrival time (``time.time()``). A fault can
  make it slow (it answers after longer than the downstream's ``timeout_ms``: the gateway
  records UNKNOWN) or make it reset connections (it reads the request, then closes the
  connection without answering: UNKNOWN too);
* ``--workers`` workers (the SDK's ``fencegate.Client``, one gateway drawn at random per task).
  Each loops: ``put_task`` a new task (the scheduler), claim it (a guarded lease with a short
  TTL, renewed by the SDK), three effects with distinct slots through the gateway to the
  downstream (``adapter = "http"``), commit. They handle refusals as a real worker would:
  a lost lease (``LeaseLost``, ``FENCED``...) gives the task up (the scheduler offers it again
  later); ``503`` and an unreachable gateway are retried with backoff; ``EFFECT_UNKNOWN`` (or a
  ``504`` timeout) leaves the task alone for an operator. Every acknowledged operation is
  recorded: claims granted (generation, store instant of the grant, ``leaseExpiresAt`` as
  last renewed), commits answered 200 (``commitId``), effects answered COMMITTED, effects seen
  UNKNOWN.
* the fault schedule (seeded by ``--seed``, printed at start; each fault is printed with its
  time as it is injected). One fault at a time, every one healing itself within seconds:
  ``gateway_kill`` (kill -9 a gateway, restart it on the same config and port),
  ``gateway_stop`` (SIGSTOP a gateway for 1-4 s, then SIGCONT), ``store_stop`` (SIGSTOP
  redis-server, or every process of the PostgreSQL cluster, for 0.5-3 s), ``store_kill``
  (Redis: kill -9, restart on the same AOF directory and port), ``sentinel_failover`` (kill -9
  the master; the sentinels promote a replica; the old master starts again on its AOF and
  becomes a replica of the new one), ``cluster_failover`` (kill -9 a cluster primary; its
  replica takes over; the old primary starts again on its AOF and rejoins as the new one's
  replica), ``slot_move`` (the slot of the bucket of a task just started is moved to another
  primary with ``fencegate store move-slot``: freeze, ``MIGRATE`` in small batches,
  ``SETSLOT NODE``, unfreeze; ``ledger.cluster_moves``), ``downstream_slow``,
  ``downstream_reset``, and ``worker_pause``: a worker claims a task with a bare lease, sends
  one effect, then stops past its lease; the task is offered to the other workers, and once
  one of them holds a newer claim the paused worker goes on with its stale lease. Its effect
  and its commit must be refused. The schedule first goes through every kind that applies to
  the store (shuffled), then draws at random. A kind is an entry of ``FAULTS`` (whether it
  applies to a phase, and the coroutine that injects and heals it).

At the end of a store's phase every fault is healed (SIGCONT, restarts), the workers finish
their tasks, and the checker waits until no forward can still be running (the downstream's
``timeout_ms`` + ``proxy.prepared_margin_ms``: a PREPARED record reads UNKNOWN after that).
Then it checks, through the gateway's API (``GET /v1/tasks/{id}``,
``GET /v1/effects?state=UNKNOWN``, ``GET /v1/effects/{id}``):

1. **No duplicate execution**: the downstream received each ``Idempotency-Key`` at most once.
   Every downstream here uses the plain ``http`` adapter, which never re-sends an UNKNOWN
   effect, so there is no re-send by design to set apart; the report prints that count
   (always 0 here) so that a run with a re-sending adapter would show it separately.
2. **No effect forwarded under a stale fence.** A forward of generation ``g`` passed the
   fence at a store instant ``p`` while ``g``'s lease was current: before that lease's end,
   hence before any claim of a higher generation was granted (the store grants one only once
   the lease expired or was released). The gateway sends its first byte no later than
   ``t0 + L`` (``L`` = the forward start limit, ``min(1000, prepared_margin_ms / 2)``, and
   ``t0 <= p``). So a call that carries ``Fencing-Token: e.g`` and arrives after BOTH
   ``grant(higher) + L + slack`` AND ``lastKnownExpiry(g) + L + slack`` broke the fence.
   ``grant(higher)`` is the store instant of the earliest known claim of task T with a higher
   (epoch, generation) pair (``leaseExpiresAt - grantedTtlMs`` of its answer);
   ``lastKnownExpiry(g)`` is the latest ``leaseExpiresAt`` any answer gave generation ``g``.
   The grant bound alone is sound (a renewal whose answer was lost can push ``g``'s true
   expiry past what the workers know, never past the next grant); the expiry term only
   narrows it. ``slack`` (``CLOCK_SLACK_MS``) covers loopback transit and the store's and
   this process's clocks (one machine, one clock). The stale worker's effect or commit
   accepted by the gateway is also a violation of this invariant.
3. **No acknowledged commit lost**: every commit answered 200 is the task's commit (the same
   ``commitId``) in the store afterwards.
4. **Every UNKNOWN effect is listed**: each effect a worker saw UNKNOWN, and each effect the
   downstream received whose record reads UNKNOWN, is in ``GET /v1/effects?state=UNKNOWN``.
   One exception, counted apart (``seenUnknownSettled``): the gateway answers ``503``/``500``
   with ``Fence-Effect-State: UNKNOWN`` when a store step got no answer ("may or may not
   have been applied"); when the store settled the effect truthfully after all (COMMITTED
   with exactly one call at the downstream, or NOT_APPLIED with none), nothing is hidden
   from an operator.

It also counts, as a violation, an effect the downstream received whose record says
NOT_APPLIED or does not exist (the gateway would let it go out again).

The report is three tables: operations by kind and outcome, faults injected by kind,
violations by invariant, one column per store. Exit status 1 on any violation (or a phase that
could not run), 0 otherwise. ``--json FILE`` writes the figures. ``bench/README.md``, section
"``chaos``", describes it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import redis
from aiohttp import web

from bench._args import add_run_options, check_run_options, parse_stores
from bench._procs import (
    HOST,
    Proc,
    align,
    free_port,
    gateway_origin,
    progress,
    scan_gateway_log,
    spawn,
    start_gateway,
    start_postgres,
    start_redis,
    terminable,
    wait_for_port,
)
from bench.soak_kill import Gateway, effect_id
from fencegate import (
    AlreadyCommitted,
    Claimed,
    ClaimRefused,
    Client,
    DownstreamTimeout,
    DownstreamUnreachable,
    EffectInFlight,
    EffectUnknown,
    GatewayUnreachable,
    LeaseLost,
    ProblemError,
    StaleEpoch,
    Unavailable,
)
from fencegate.lease import Lease
from fencegate.ledger.buckets import bucket_of_task, bucket_tag, slot_of
from tests.cluster_servers import ClusterServers
from tests.sentinel_servers import SentinelCluster

__all__ = ["FAULTS", "main"]

DEFAULT_STORES = "redis,sentinel,postgres,sqlite"
#: What ``--stores`` takes: ``sentinel`` is Redis under Sentinel (issue 18), ``cluster`` a
#: Redis Cluster (issue 30).
CHAOS_STORES = ("redis", "sentinel", "postgres", "sqlite", "cluster")
#: Gateways per store: the shared stores get two, SQLite (one file, one process) one.
GATEWAYS = {"redis": 2, "sentinel": 2, "postgres": 2, "sqlite": 1, "cluster": 2}
#: ``[store] redis_min_replicas`` of the cluster phase: each shard's one replica (a write is
#: answered once the replica of its shard holds it; while a shard has none, after a failover
#: until the old primary is back as its replica, that shard's writes answer 503).
CLUSTER_MIN_REPLICAS = 1
#: The gateways' bucket count on the cluster (the store's default) and key prefix.
CLUSTER_BUCKETS = 256
CLUSTER_PREFIX = "fg"
#: Keys per MIGRATE of a ``slot_move``: small, so the workers run between batches.
SLOT_MOVE_BATCH = 5
#: ``[store] redis_min_replicas`` of the Sentinel phase: both replicas. With fewer, a
#: failover can promote the replica that lacks the last answered writes (Sentinel's view of
#: the offsets may be a second old), the gateways then fail closed until an operator's
#: ``fencegate failover ack``, which a chaos run has no operator for. With both, a write is
#: answered only once every replica holds it; while the old master is down (one replica left)
#: writes answer 503 until it is back as a replica.
SENTINEL_MIN_REPLICAS = 2
SENTINEL_REPLICA_TIMEOUT_MS = 500
#: The sentinels' ``down-after-milliseconds``: with 1000 on this loaded 2-core machine a
#: freshly promoted master that stalled a second was failed over again (two failovers per
#: fault); 3000 makes each fault one failover.
SENTINEL_DOWN_AFTER_MS = 3000
DOWNSTREAM = "chaos"
SLOTS = ("reserve", "charge", "notify")
NODE = "main"
#: The workers' lease TTL (renewed by the SDK every third of it).
TTL_MS = 2000
#: The downstream's timeout_ms in the gateways' config, and the PREPARED margin.
DOWNSTREAM_TIMEOUT_MS = 1000
PREPARED_MARGIN_MS = 2000
#: The forward start limit the gateways run with (their default for this margin).
START_LIMIT_MS = min(1000, PREPARED_MARGIN_MS // 2)
#: How long a request waits for the store before the gateway answers 503.
STORE_TIMEOUT_MS = 1500
#: A slow downstream answers after this long (above DOWNSTREAM_TIMEOUT_MS: UNKNOWN).
SLOW_ANSWER_S = DOWNSTREAM_TIMEOUT_MS / 1000 + 0.8
#: The SDK's per-call timeout (above the downstream's timeout_ms, as docs/sdk.md asks).
CLIENT_TIMEOUT_S = 5.0
#: Loopback transit and clock reading slack of invariant 2.
CLOCK_SLACK_MS = 250
#: Give up one effect (and hand the task back) after retrying it this long.
EFFECT_PATIENCE_S = 20.0
#: A task is offered again at most this many times after a worker gave it up.
MAX_OFFERS = 6
#: After the phase's time is up, workers get this long to finish their tasks.
DRAIN_S = 30.0
#: Most faults per second of phase (a bound on top of the time).
MAX_FAULTS_PER_S = 1.0
#: Examples kept per violation kind in the report and JSON.
EXAMPLES = 5

INVARIANTS = (
    "1 duplicate execution",
    "2 forwarded under a stale fence",
    "3 acknowledged commit lost",
    "4 UNKNOWN effect not listed",
    "5 executed but recorded NOT_APPLIED/absent",
)


def _now_ms() -> float:
    return time.time() * 1000


# --- the downstream (in this process) --------------------------------------------------------


@dataclass
class Call:
    key: str
    token: str
    task: str
    slot: str
    arrival_ms: float
    mode: str


class ChaosDownstream:
    """An aiohttp server on loopback that logs every call (``calls``); until ``slow_until`` it
    answers late, until ``reset_until`` it closes each connection unanswered (monotonic)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.slow_until = 0.0
        self.reset_until = 0.0
        self.runner: web.AppRunner | None = None
        self.base = ""

    def mode(self) -> str:
        now = time.monotonic()
        if now < self.reset_until:
            return "reset"
        if now < self.slow_until:
            return "slow"
        return "ok"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        mode = self.mode()
        parts = request.path.strip("/").split("/")
        self.calls.append(
            Call(
                key=request.headers.get("Idempotency-Key", ""),
                token=request.headers.get("Fencing-Token", ""),
                task=parts[1] if len(parts) > 2 else "",
                slot=parts[2] if len(parts) > 2 else "",
                arrival_ms=_now_ms(),
                mode=mode,
            )
        )
        if mode == "reset":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(0.05)
            raise ConnectionResetError
        if mode == "slow":
            await asyncio.sleep(SLOW_ANSWER_S)
        return web.json_response({"ok": True}, status=201)

    async def start(self) -> None:
        # A reset on purpose is not an error worth a traceback.
        logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, HOST, port).start()
        self.base = f"http://{HOST}:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


# --- the store processes ---------------------------------------------------------------------


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc)."""
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    for child in children:
        pids += _tree(int(child))
    return pids


class StoreServer:
    """The store's own server process(es), frozen and killed in place (None for SQLite)."""

    def __init__(self, kind: str, proc: Proc, url: str) -> None:
        self.kind = kind
        self.proc = proc
        self.url = url
        self.stopped: list[int] = []

    def stop_signal(self) -> list[int]:
        pids = _tree(self.proc.pid) if self.kind == "postgres" else [self.proc.pid]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        self.stopped = pids
        return pids

    def cont_signal(self) -> None:
        for pid in reversed(self.stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.stopped = []

    async def kill_restart(self, down_s: float) -> int:
        """Redis only: kill -9, wait ``down_s``, start it again with the same arguments (the
        same port and AOF directory); the new pid."""
        assert self.kind == "redis"
        self.proc.popen.send_signal(signal.SIGKILL)
        await asyncio.to_thread(self.proc.popen.wait)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(self._respawn)
        return self.proc.pid

    def _respawn(self) -> None:
        args = [str(a) for a in self.proc.popen.args]  # type: ignore[union-attr]
        port = int(args[args.index("--port") + 1])
        directory = Path(args[args.index("--dir") + 1])
        self.proc = spawn("redis-server", args, self.proc.log_path, directory)
        wait_for_port(port, self.proc.popen, timeout=30)
        client = redis.Redis(host=HOST, port=port, decode_responses=True)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    info = client.info("server")
                    break
                except (redis.exceptions.BusyLoadingError, redis.exceptions.ConnectionError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        finally:
            client.close()
        if int(info["process_id"]) != self.proc.pid:
            raise RuntimeError(f"{HOST}:{port} is answered by another redis-server")

    def heal(self) -> None:
        self.cont_signal()


# --- what the workers were told --------------------------------------------------------------


@dataclass
class ClaimInfo:
    task: str
    epoch: int
    generation: int
    grant_ms: int
    expiry_ms: int
    owner: str


@dataclass
class Records:
    ops: Counter[str] = field(default_factory=Counter)
    claims: dict[str, list[ClaimInfo]] = field(default_factory=dict)
    commits: list[tuple[str, str]] = field(default_factory=list)
    committed_effects: set[str] = field(default_factory=set)
    unknown_seen: set[str] = field(default_factory=set)
    stale_accepted: list[dict[str, Any]] = field(default_factory=list)
    tasks_started: int = 0

    def op(self, kind: str, outcome: str) -> None:
        self.ops[f"{kind}\t{outcome}"] += 1


def _code(exc: BaseException) -> str:
    if isinstance(exc, ProblemError):
        return exc.code
    return type(exc).__name__


class GiveUp(Exception):
    """Hand the task back ("requeue") or leave it for an operator ("leave")."""

    def __init__(self, disposition: str) -> None:
        super().__init__(disposition)
        self.disposition = disposition


# --- one store's phase -----------------------------------------------------------------------


class Phase:
    def __init__(self, store: str, seed: int, seconds: float, workers: int, out: TextIO) -> None:
        self.store = store
        self.seed = seed
        self.seconds = seconds
        self.n_workers = workers
        self.out = out
        self.rng = random.Random(seed)
        self.records = Records()
        self.downstream = ChaosDownstream()
        self.gateways: list[Gateway] = []
        self.stopped_gateways: set[int] = set()
        self.store_server: StoreServer | None = None
        #: The Sentinel set-up of a ``sentinel`` phase (master, two replicas, three sentinels).
        self.sentinel: SentinelCluster | None = None
        #: The Redis Cluster of a ``cluster`` phase (three primaries, three replicas).
        self.cluster: ClusterServers | None = None
        self.clients: list[Client] = []
        self.epoch = 0
        self.prefix = f"chaos-{store}-{uuid.uuid4().hex[:6]}"
        self.task_seq = 0
        # (ready_at monotonic, task, offers)
        self.offers: list[tuple[float, str, int]] = []
        self.offered: Counter[str] = Counter()
        self.claim_waiters: dict[str, tuple[int, asyncio.Event]] = {}
        self.pause_requests: dict[int, float] = {}
        self.faults: Counter[str] = Counter()
        self.fault_log: list[dict[str, Any]] = []
        self.started = 0.0
        self.deadline = 0.0
        self.stopping = False
        self.hard_stop = False

    # output
    def say(self, message: str) -> None:
        at = time.monotonic() - self.started if self.started else 0.0
        print(f"[chaos] t=+{at:6.2f}s {self.store}: {message}", file=self.out, flush=True)

    def fault(self, kind: str, detail: str) -> None:
        self.faults[kind] += 1
        at = round(time.monotonic() - self.started, 3)
        self.fault_log.append({"t": at, "kind": kind, "detail": detail})
        self.say(f"fault {kind}: {detail}")

    # tasks
    def new_task(self) -> str:
        self.task_seq += 1
        return f"{self.prefix}-{self.task_seq:06d}"

    def offer(self, task: str, delay: float) -> None:
        """The scheduler offers ``task`` again (a worker gave it up), a bounded number of
        times."""
        if self.offered[task] >= MAX_OFFERS:
            self.records.op("task", "given up for good")
            return
        self.offered[task] += 1
        self.offers.append((time.monotonic() + delay, task, self.offered[task]))

    def take_offer(self) -> str | None:
        now = time.monotonic()
        for i, (ready_at, task, _) in enumerate(self.offers):
            if ready_at <= now:
                del self.offers[i]
                return task
        return None

    def note_claim(self, lease: Lease) -> ClaimInfo:
        info = ClaimInfo(
            task=lease.task_id,
            epoch=lease.scheduler_epoch,
            generation=lease.claim_generation,
            grant_ms=lease.lease_expires_at - lease.granted_ttl_ms,
            expiry_ms=lease.lease_expires_at,
            owner=lease.owner,
        )
        self.records.claims.setdefault(lease.task_id, []).append(info)
        self.records.op("claim", "granted")
        waiter = self.claim_waiters.get(lease.task_id)
        if waiter is not None and lease.claim_generation > waiter[0]:
            waiter[1].set()
        return info

    def client(self, rng: random.Random) -> Client:
        return rng.choice(self.clients)


async def _backoff(attempt: int, rng: random.Random) -> None:
    await asyncio.sleep(min(2.0, 0.1 * 2**attempt) * rng.uniform(0.5, 1.0))


async def put_task(phase: Phase, client: Client, task: str, rng: random.Random) -> bool:
    for attempt in range(12):
        if phase.hard_stop:
            return False
        try:
            await client.put_task(task, "sha256:" + task)
        except (Unavailable, GatewayUnreachable) as exc:
            phase.records.op("put", f"retry {_code(exc)}")
            await _backoff(attempt, rng)
            continue
        phase.records.op("put", "ok")
        return True
    phase.records.op("put", "failed")
    return False


async def send_effect(phase: Phase, lease: Lease, slot: str, rng: random.Random) -> None:
    """One effect through the gateway, retried as a worker would; raises ``GiveUp`` when the
    task should be handed back or left alone, and lets a lease refusal propagate."""
    records = phase.records
    eid = effect_id(lease.task_id, lease.revision, NODE, slot)
    body = {"task": lease.task_id, "slot": slot}
    patience = time.monotonic() + EFFECT_PATIENCE_S
    attempt = 0
    while True:
        if phase.hard_stop or time.monotonic() > patience:
            records.op("effect", "gave up (patience)")
            raise GiveUp("requeue")
        try:
            resp = await lease.request(
                DOWNSTREAM, "POST", f"/effect/{lease.task_id}/{slot}", slot=slot, json=body
            )
        except EffectInFlight as exc:
            records.op("effect", "in flight")
            await asyncio.sleep(min(1.0, max(0.1, exc.retry_after or 0.2)))
            continue
        except (EffectUnknown, DownstreamTimeout) as exc:
            records.op("effect", f"UNKNOWN ({exc.code})")
            records.unknown_seen.add(eid)
            raise GiveUp("leave") from exc
        except ClaimRefused as exc:
            records.op("effect", f"refused {exc.code}")
            raise
        except (Unavailable, DownstreamUnreachable, GatewayUnreachable) as exc:
            if getattr(exc, "effect_state", None) == "UNKNOWN":
                records.op("effect", f"UNKNOWN ({_code(exc)})")
                records.unknown_seen.add(eid)
                raise GiveUp("leave") from exc
            records.op("effect", f"retry {_code(exc)}")
            await _backoff(attempt, rng)
            attempt += 1
            continue
        except ProblemError as exc:
            if exc.effect_state == "UNKNOWN":
                records.op("effect", f"UNKNOWN ({exc.code})")
                records.unknown_seen.add(eid)
                raise GiveUp("leave") from exc
            records.op("effect", f"refused {exc.code}")
            raise GiveUp("requeue") from exc
        if resp.effect_state == "UNKNOWN":
            records.op("effect", f"UNKNOWN (status {resp.status})")
            records.unknown_seen.add(eid)
            raise GiveUp("leave")
        records.op("effect", "COMMITTED (replayed)" if resp.replayed else "COMMITTED")
        records.committed_effects.add(eid)
        return


async def run_task(
    phase: Phase, task: str, owner: str, rng: random.Random, *, offer: bool = True
) -> None:
    """Claim ``task``, send its effects, commit; a task given up is offered again (unless
    ``offer`` is false: the caller retries it itself)."""

    def again(delay: float) -> None:
        if offer:
            phase.offer(task, delay)

    records = phase.records
    client = phase.client(rng)
    stage = "claim"
    info: ClaimInfo | None = None
    try:
        async with client.claim(
            task, owner=owner, ttl_ms=TTL_MS, scheduler_epoch=phase.epoch
        ) as lease:
            info = phase.note_claim(lease)
            try:
                stage = "effect"
                for slot in SLOTS:
                    await send_effect(phase, lease, slot, rng)
                stage = "commit"
                try:
                    done = await lease.commit({"task": task})
                except (GatewayUnreachable, Unavailable) as exc:
                    records.op("commit", f"unanswered {_code(exc)}")
                    raise GiveUp("requeue") from exc
                records.op("commit", "200")
                records.commits.append((task, done.commit_id))
            finally:
                info.expiry_ms = max(info.expiry_ms, lease.lease_expires_at)
    except GiveUp as give:
        if give.disposition == "requeue":
            again(0.5)
        else:
            records.op("task", "left for an operator (UNKNOWN)")
    except LeaseLost as lost:
        records.op("lease", f"lost ({lost.code or 'ran out locally'})")
        again(TTL_MS / 1000)
    except AlreadyCommitted:
        records.op(stage, "AlreadyCommitted")
    except Claimed:
        records.op(stage, "Claimed")
        again(TTL_MS / 2000)
    except StaleEpoch as exc:
        records.op(stage, f"refused {exc.code}")
        with contextlib.suppress(ProblemError, GatewayUnreachable):
            phase.epoch = (await client.get_epoch()).scheduler_epoch
        again(0.1)
    except ClaimRefused as exc:
        records.op(stage, f"refused {exc.code}")
        again(TTL_MS / 1000)
    except (Unavailable, GatewayUnreachable) as exc:
        # A claim or a release (a body that ended without commit) got no answer.
        records.op(stage, f"unanswered {_code(exc)}")
        again(0.5)
    except ProblemError as exc:
        records.op(stage, f"refused {exc.code}")
        again(0.5)


async def stale_worker(phase: Phase, wid: int, owner: str, rng: random.Random) -> None:
    """The ``worker_pause`` fault, played by the worker itself: a bare lease, one effect, a
    pause past the lease while another worker claims the task, then the stale calls."""
    records = phase.records
    client = phase.client(rng)
    task = phase.new_task()
    records.tasks_started += 1
    if not await put_task(phase, client, task, rng):
        return
    try:
        lease = await client.acquire(task, owner=owner, ttl_ms=TTL_MS, scheduler_epoch=phase.epoch)
    except (ProblemError, GatewayUnreachable) as exc:
        records.op("claim", f"refused {_code(exc)}" if isinstance(exc, ProblemError) else
                   f"unanswered {_code(exc)}")  # fmt: skip
        phase.offer(task, 0.5)
        return
    info = phase.note_claim(lease)
    try:
        await send_effect(phase, lease, SLOTS[0], rng)
    except (GiveUp, ProblemError, GatewayUnreachable):
        phase.offer(task, TTL_MS / 1000)
        return
    waiter = asyncio.Event()
    phase.claim_waiters[task] = (lease.claim_generation, waiter)
    phase.fault(
        "worker_pause",
        f"worker {wid} pauses past its lease on {task} (generation {lease.claim_generation}, "
        f"TTL {TTL_MS} ms, not renewed)",
    )
    paused = time.monotonic()

    async def rival() -> None:
        """Another worker's claim of the task once the lease has run out (retried for a
        while: a fault may be in the way), and the rest of the task under it."""
        await asyncio.sleep(TTL_MS / 1000 + 0.1)
        until = time.monotonic() + 12
        while not waiter.is_set() and time.monotonic() < until:
            await run_task(phase, task, f"{owner}-rival", rng, offer=False)
            if not waiter.is_set():
                await asyncio.sleep(0.3)
        if not waiter.is_set():
            phase.offer(task, 0.5)

    rival_task = asyncio.create_task(rival())
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(waiter.wait(), timeout=15)
    await asyncio.sleep(max(0.0, paused + TTL_MS / 1000 + 0.2 - time.monotonic()))
    superseded = waiter.is_set()
    del phase.claim_waiters[task]
    seen = "a newer claim was granted" if superseded else "no newer claim seen: lease expired"
    phase.say(f"worker {wid} resumes on {task} after {time.monotonic() - paused:.1f}s ({seen})")
    # The stale effect: must be refused (FENCED, or LEASE_EXPIRED when nobody claimed).
    for attempt in range(6):
        try:
            resp = await lease.request(
                DOWNSTREAM, "POST", f"/effect/{task}/{SLOTS[1]}", slot=SLOTS[1],
                json={"task": task, "slot": SLOTS[1]},
            )  # fmt: skip
        except ClaimRefused as exc:
            records.op("stale effect", f"refused {exc.code}")
            break
        except (Unavailable, GatewayUnreachable, EffectInFlight) as exc:
            records.op("stale effect", f"retry {_code(exc)}")
            await _backoff(attempt, rng)
            continue
        except ProblemError as exc:
            records.op("stale effect", f"other {exc.code}")
            break
        records.op("stale effect", "ACCEPTED")
        records.stale_accepted.append(
            {"task": task, "generation": lease.claim_generation, "call": "effect",
             "status": resp.status, "replayed": resp.replayed, "superseded": superseded}
        )  # fmt: skip
        break
    if superseded:  # with a newer claim granted, the commit must be refused too
        try:
            done = await lease.commit({"task": task, "stale": True})
        except ClaimRefused as exc:
            records.op("stale commit", f"refused {exc.code}")
        except (ProblemError, GatewayUnreachable) as exc:
            records.op("stale commit", f"other {_code(exc)}")
        else:
            records.op("stale commit", "ACCEPTED")
            records.stale_accepted.append(
                {"task": task, "generation": lease.claim_generation, "call": "commit",
                 "commitId": done.commit_id}
            )  # fmt: skip
    info.expiry_ms = max(info.expiry_ms, lease.lease_expires_at)
    await rival_task


async def worker(phase: Phase, wid: int) -> None:
    rng = random.Random(phase.seed * 1009 + wid)
    owner = f"worker-{wid}"
    while not phase.stopping:
        try:
            await _one_round(phase, wid, owner, rng)
        except Exception as exc:  # reported, and the worker goes on as a real one would
            phase.records.op("worker", f"error {type(exc).__name__}")
            phase.say(f"worker {wid}: unexpected {exc!r}")
            await asyncio.sleep(0.5)


async def _one_round(phase: Phase, wid: int, owner: str, rng: random.Random) -> None:
    if wid in phase.pause_requests:
        del phase.pause_requests[wid]
        await stale_worker(phase, wid, owner, rng)
        return
    task = phase.take_offer()
    if task is None:
        task = phase.new_task()
        phase.records.tasks_started += 1
        if not await put_task(phase, phase.client(rng), task, rng):
            return
    await run_task(phase, task, owner, rng)


# --- faults ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """A kind of fault: whether it applies to a phase, and the coroutine that injects it and
    heals it (it returns once healed)."""

    applies: Callable[[Phase], bool]
    inject: Callable[[Phase, random.Random], Awaitable[None]]


def _pick_gateway(phase: Phase, rng: random.Random) -> tuple[int, Gateway]:
    index = rng.randrange(len(phase.gateways))
    return index, phase.gateways[index]


async def gateway_kill(phase: Phase, rng: random.Random) -> None:
    index, gateway = _pick_gateway(phase, rng)
    down = rng.uniform(0.3, 1.5)
    pid = gateway.proc.pid
    killed_at = time.monotonic()
    await gateway.kill()
    phase.fault("gateway_kill", f"kill -9 gateway {index} (pid {pid}), restart in {down:.1f}s")
    await asyncio.sleep(down)
    await gateway.restart(killed_at)
    phase.say(f"gateway {index} back (pid {gateway.proc.pid}, down {gateway.restarts[-1]:.1f}s)")


async def gateway_stop(phase: Phase, rng: random.Random) -> None:
    index, gateway = _pick_gateway(phase, rng)
    hold = rng.uniform(1.0, 4.0)
    gateway.proc.popen.send_signal(signal.SIGSTOP)
    phase.stopped_gateways.add(index)
    phase.fault("gateway_stop", f"SIGSTOP gateway {index} (pid {gateway.proc.pid}) for {hold:.1f}s")
    try:
        await asyncio.sleep(hold)
    finally:
        gateway.proc.popen.send_signal(signal.SIGCONT)
        phase.stopped_gateways.discard(index)


async def store_stop(phase: Phase, rng: random.Random) -> None:
    server = phase.store_server
    assert server is not None
    hold = rng.uniform(0.5, 3.0)
    pids = server.stop_signal()
    phase.fault("store_stop", f"SIGSTOP {server.kind} ({len(pids)} processes) for {hold:.1f}s")
    try:
        await asyncio.sleep(hold)
    finally:
        server.cont_signal()


async def store_kill(phase: Phase, rng: random.Random) -> None:
    server = phase.store_server
    assert server is not None
    down = rng.uniform(0.2, 1.0)
    phase.fault(
        "store_kill", f"kill -9 {server.kind} (pid {server.proc.pid}), restart in {down:.1f}s"
    )
    started = time.monotonic()
    pid = await server.kill_restart(down)
    phase.say(f"{server.kind} back on its AOF (pid {pid}, down {time.monotonic() - started:.1f}s)")


async def downstream_slow(phase: Phase, rng: random.Random) -> None:
    hold = rng.uniform(1.5, 4.0)
    phase.downstream.slow_until = time.monotonic() + hold
    phase.fault(
        "downstream_slow", f"the downstream answers after {SLOW_ANSWER_S:.1f}s for {hold:.1f}s"
    )
    await asyncio.sleep(hold)


async def downstream_reset(phase: Phase, rng: random.Random) -> None:
    hold = rng.uniform(0.5, 2.0)
    phase.downstream.reset_until = time.monotonic() + hold
    phase.fault("downstream_reset", f"the downstream resets every call for {hold:.1f}s")
    await asyncio.sleep(hold)


async def worker_pause(phase: Phase, rng: random.Random) -> None:
    # The worker plays it (stale_worker) and prints it when it actually pauses.
    phase.pause_requests[rng.randrange(phase.n_workers)] = TTL_MS / 1000
    await asyncio.sleep(0.5)


async def sentinel_failover(phase: Phase, rng: random.Random) -> None:
    """kill -9 the master; the sentinels promote a replica; the old master is started again
    on its own AOF after ``down`` and the sentinels make it a replica of the new one."""
    cluster = phase.sentinel
    assert cluster is not None
    down = rng.uniform(0.5, 2.0)
    node = cluster.master()
    phase.fault(
        "sentinel_failover",
        f"kill -9 the Redis master (port {node.port}), restart it as a replica in {down:.1f}s",
    )
    started = time.monotonic()
    old = await asyncio.to_thread(cluster.kill_master)
    new = await asyncio.to_thread(cluster.wait_promoted, old)
    phase.say(f"sentinels promoted port {new} after {time.monotonic() - started:.1f}s")
    await asyncio.sleep(down)
    await asyncio.to_thread(node.start)
    await asyncio.to_thread(cluster.wait_replicas, 2)
    phase.say(f"old master back as a replica; 2 replicas after {time.monotonic() - started:.1f}s")


async def cluster_failover(phase: Phase, rng: random.Random) -> None:
    """kill -9 a cluster primary; its replica takes over (the cluster's own failover); the
    old primary is started again on its AOF after ``down`` and rejoins as a replica."""
    cluster = phase.cluster
    assert cluster is not None
    down = rng.uniform(0.5, 2.0)
    primary = rng.choice(await asyncio.to_thread(cluster.primaries))
    phase.fault(
        "cluster_failover",
        f"kill -9 cluster primary {primary.name} (port {primary.port}), restart it as a "
        f"replica in {down:.1f}s after the promotion",
    )
    started = time.monotonic()
    old = await asyncio.to_thread(cluster.kill_primary, primary)
    new = await asyncio.to_thread(cluster.wait_promoted, old)
    phase.say(f"{new.name} (port {new.port}) promoted after {time.monotonic() - started:.1f}s")
    await asyncio.sleep(down)
    await asyncio.to_thread(cluster.restart, old)
    phase.say(f"{old.name} back as a replica; cluster ok after {time.monotonic() - started:.1f}s")


async def slot_move(phase: Phase, rng: random.Random) -> None:
    """Move the slot of the bucket of the task started last (one the workers are on) to
    another primary, with ``fencegate store move-slot`` on gateway 0's config (this tree's
    command: ``ledger.cluster_moves``), the workers running meanwhile."""
    cluster = phase.cluster
    assert cluster is not None
    task = f"{phase.prefix}-{max(phase.task_seq, 1):06d}"
    bucket = bucket_of_task(task, CLUSTER_BUCKETS)
    slot = slot_of(bucket_tag(CLUSTER_PREFIX, bucket))
    source = await asyncio.to_thread(cluster.primary_of, slot)
    target = rng.choice([n for n in await asyncio.to_thread(cluster.primaries) if n is not source])
    phase.fault(
        "slot_move",
        f"move slot {slot} (bucket {bucket}, task {task}) from {source.name} to {target.name}",
    )
    started = time.monotonic()
    config = phase.gateways[0].proc.log_path.parent / "fencegate.toml"
    command = [
        sys.executable, "-m", "fencegate.gateway.cli", "store", "move-slot", str(slot),
        "--to", target.address, "--config", str(config), "--batch", str(SLOT_MOVE_BATCH),
    ]  # fmt: skip
    for attempt in range(1, 6):  # a stop half way is finished by running it again
        proc = await asyncio.create_subprocess_exec(
            *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await proc.communicate()
        if proc.returncode == 0:
            last = out.decode().strip().splitlines()[-1:]
            phase.say(f"{' '.join(last)} ({time.monotonic() - started:.1f}s, run {attempt})")
            return
        phase.say(f"move-slot exited {proc.returncode}: {err.decode().strip()[-300:]}")
        await asyncio.sleep(1.0)
    raise RuntimeError(f"slot {slot} could not be moved in 5 runs")


#: Every kind of fault.
FAULTS: dict[str, Fault] = {
    "gateway_kill": Fault(lambda p: True, gateway_kill),
    "gateway_stop": Fault(lambda p: True, gateway_stop),
    "store_stop": Fault(lambda p: p.store_server is not None, store_stop),
    "store_kill": Fault(lambda p: p.store == "redis", store_kill),
    "downstream_slow": Fault(lambda p: True, downstream_slow),
    "downstream_reset": Fault(lambda p: True, downstream_reset),
    "worker_pause": Fault(lambda p: p.n_workers > 1, worker_pause),
    "sentinel_failover": Fault(lambda p: p.sentinel is not None, sentinel_failover),
    "cluster_failover": Fault(lambda p: p.cluster is not None, cluster_failover),
    "slot_move": Fault(lambda p: p.cluster is not None, slot_move),
}


def fault_kinds(phase: Phase) -> list[str]:
    return [name for name, fault in FAULTS.items() if fault.applies(phase)]


async def fault_schedule(phase: Phase) -> None:
    """One fault at a time until the phase's time is up: every kind that applies once (in a
    seeded order), then seeded draws; a seeded gap of 0.5-2.5 s after each has healed."""
    rng = random.Random(phase.seed)
    kinds = fault_kinds(phase)
    first = list(kinds)
    rng.shuffle(first)
    most = max(1, int(phase.seconds * MAX_FAULTS_PER_S))
    count = 0
    while count < most:
        gap = rng.uniform(0.5, 2.5)
        if time.monotonic() + gap >= phase.deadline - 1.0:
            break
        await asyncio.sleep(gap)
        kind = first[count] if count < len(first) else rng.choice(kinds)
        count += 1
        await FAULTS[kind].inject(phase, rng)


async def heal_all(phase: Phase) -> None:
    phase.downstream.slow_until = phase.downstream.reset_until = 0.0
    if phase.store_server is not None:
        phase.store_server.heal()
        if not phase.store_server.proc.alive():
            await asyncio.to_thread(phase.store_server._respawn)
    if phase.sentinel is not None:
        for node in phase.sentinel.data:
            if node.proc is None:  # killed by a failover fault that did not finish
                await asyncio.to_thread(node.start)
    if phase.cluster is not None:
        for cnode in phase.cluster.nodes:
            if not cnode.running:  # killed by a failover fault that did not finish
                await asyncio.to_thread(phase.cluster.restart, cnode)
    for gateway in phase.gateways:
        if gateway.proc.alive():
            gateway.proc.popen.send_signal(signal.SIGCONT)
        else:
            await gateway.restart(time.monotonic())
    phase.stopped_gateways.clear()


# --- the checker -----------------------------------------------------------------------------


def _token(raw: str) -> tuple[int, int] | None:
    epoch, _, generation = raw.partition(".")
    try:
        return int(epoch), int(generation)
    except ValueError:
        return None


async def _gateway_json(session: aiohttp.ClientSession, base: str, path: str) -> tuple[int, Any]:
    for attempt in range(20):
        try:
            async with session.get(base + path, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                body = await resp.read()
                if resp.status == 503:
                    raise aiohttp.ClientError("503")
                return resp.status, json.loads(body) if body else None
        except (aiohttp.ClientError, TimeoutError):
            await asyncio.sleep(min(2.0, 0.1 * 2**attempt))
    raise RuntimeError(f"GET {path}: the gateway never answered")


def duplicate_executions(calls: Sequence[Call]) -> list[dict[str, Any]]:
    """Invariant 1: every ``Idempotency-Key`` the downstream received more than once."""
    per_key = Counter(c.key for c in calls)
    return [{"effectId": k, "executions": n} for k, n in sorted(per_key.items()) if n > 1]


def stale_fence_calls(
    calls: Sequence[Call], claims: dict[str, list[ClaimInfo]]
) -> tuple[list[dict[str, Any]], int, int | None]:
    """Invariant 2 (the rule is in the module docstring): the calls forwarded under a stale
    fence; how many calls carried a generation that a known newer claim superseded; and how
    late the latest of those arrived after that newer grant (ms, None: there was none)."""
    bound = START_LIMIT_MS + CLOCK_SLACK_MS
    found: list[dict[str, Any]] = []
    superseded = 0
    latest: float | None = None
    for c in calls:
        token = _token(c.token)
        if token is None:
            found.append({"effectId": c.key, "task": c.task, "token": c.token,
                          "why": "no valid Fencing-Token"})  # fmt: skip
            continue
        known = claims.get(c.task, [])
        higher = [ci.grant_ms for ci in known if (ci.epoch, ci.generation) > token]
        if not higher:
            continue
        grant = min(higher)
        expiry = max((ci.expiry_ms for ci in known if (ci.epoch, ci.generation) == token),
                     default=None)  # fmt: skip
        superseded += 1
        latest = max(latest if latest is not None else -math.inf, c.arrival_ms - grant)
        if c.arrival_ms > grant + bound and (expiry is None or c.arrival_ms > expiry + bound):
            found.append(
                {"effectId": c.key, "task": c.task, "token": c.token,
                 "arrivalMs": round(c.arrival_ms), "higherGrantMs": grant,
                 "lastKnownExpiryMs": expiry,
                 "lateByMs": round(c.arrival_ms - max(grant, expiry or 0) - bound)}
            )  # fmt: skip
    return found, superseded, None if latest is None else round(latest)


async def check(phase: Phase, session: aiohttp.ClientSession) -> dict[str, Any]:
    records = phase.records
    calls = phase.downstream.calls
    base = phase.gateways[0].base
    found: dict[str, list[dict[str, Any]]] = {name: [] for name in INVARIANTS}
    dup, stale, lost, unlisted, wrong = INVARIANTS

    # 1. duplicates at the downstream
    per_key = Counter(c.key for c in calls)
    found[dup] = duplicate_executions(calls)

    # 2. stale fence
    found[stale], superseded, latest = stale_fence_calls(calls, records.claims)
    for accepted in records.stale_accepted:
        found[stale].append({"why": "a stale lease's call was accepted", **accepted})

    # 3. acknowledged commits
    sem = asyncio.Semaphore(8)

    async def task_commit(task: str, commit_id: str) -> None:
        async with sem:
            status, body = await _gateway_json(session, base, f"/v1/tasks/{task}")
        commit = (body or {}).get("commit") if status == 200 else None
        if not commit or commit.get("commitId") != commit_id:
            found[lost].append({"task": task, "commitId": commit_id, "status": status,
                                "stored": commit})  # fmt: skip

    await asyncio.gather(*(task_commit(t, cid) for t, cid in records.commits))

    # 4. UNKNOWN effects listed
    async def listing(state: str | None) -> dict[str, str]:
        found_states: dict[str, str] = {}
        cursor: str | None = None
        while True:
            query = f"limit=500{f'&state={state}' if state else ''}"
            path = f"/v1/effects?{query}" + (f"&cursor={cursor}" if cursor else "")
            status, body = await _gateway_json(session, base, path)
            if status != 200:
                raise RuntimeError(f"GET {path}: {status} {body}")
            found_states.update((r["effectId"], r["state"]) for r in body["effects"])
            cursor = body.get("nextCursor")
            if not cursor:
                return found_states

    listed = set(await listing("UNKNOWN"))
    states = await listing(None)

    async def effect_state(eid: str) -> None:
        async with sem:
            status, body = await _gateway_json(session, base, f"/v1/effects/{eid}")
        states[eid] = body["state"] if status == 200 else f"HTTP {status}"

    # One by one: what the listing did not have, and what a worker was told was UNKNOWN.
    wanted = (set(per_key) - set(states)) | records.unknown_seen
    await asyncio.gather(*(effect_state(e) for e in wanted))
    settled_since: Counter[str] = Counter()
    for eid in sorted(records.unknown_seen):
        if eid in listed:
            continue
        settled = states.get(eid)
        if (settled, per_key.get(eid, 0)) in (("COMMITTED", 1), ("NOT_APPLIED", 0)):
            # The gateway answered "may or may not have been applied" (a store step without
            # an answer) and the store settled the effect truthfully after all: COMMITTED
            # with the downstream's one call, or NOT_APPLIED with none. Nothing is hidden
            # from an operator; counted apart.
            settled_since[str(settled)] += 1
            continue
        found[unlisted].append(
            {"effectId": eid, "why": "a worker saw it UNKNOWN", "state": states.get(eid)}
        )
    for eid in sorted(per_key):
        state = states.get(eid)
        if state == "UNKNOWN" and eid not in listed and eid not in records.unknown_seen:
            found[unlisted].append({"effectId": eid, "why": "its record reads UNKNOWN"})
        if state == "NOT_APPLIED" or (state or "").startswith("HTTP"):
            found[wrong].append({"effectId": eid, "state": state, "executions": per_key[eid]})
    state_counts = Counter(states.get(eid, "?") for eid in per_key)
    return {
        "violations": {name: len(items) for name, items in found.items()},
        "examples": {name: items[:EXAMPLES] for name, items in found.items() if items},
        "downstream": {
            "calls": len(calls),
            "effects": len(per_key),
            "byMode": dict(Counter(c.mode for c in calls)),
            "recordStates": dict(state_counts),
            "adapterResendsByDesign": 0,
        },
        "unknownListed": len(listed),
        "seenUnknownSettled": dict(settled_since),
        "supersededCalls": superseded,
        "supersededLatestMs": latest,
    }


# --- running a phase -------------------------------------------------------------------------


def _gateway_toml(downstream: str) -> str:
    return (
        "\n".join(
            [
                "[leases]",
                "max_ttl_ms = 60000",
                "[proxy]",
                f"prepared_margin_ms = {PREPARED_MARGIN_MS}",
                "[[downstreams]]",
                f'name = "{DOWNSTREAM}"',
                f'url = "{downstream}"',
                'adapter = "http"',
                f"timeout_ms = {DOWNSTREAM_TIMEOUT_MS}",
            ]
        )
        + "\n"
    )


async def run_phase(
    phase: Phase, work: Path, top: Path, args: argparse.Namespace
) -> dict[str, Any]:
    procs: list[Proc] = []
    await phase.downstream.start()
    try:
        store = phase.store
        if store == "redis":
            proc, url, version = await asyncio.to_thread(
                start_redis, args.redis_server, work / "redis", "always"
            )
            procs.append(proc)
            phase.store_server = StoreServer("redis", proc, url)
            progress(f"redis {version} (pid {proc.pid}) at {url}")
        elif store == "postgres":
            pg, urls, version = await asyncio.to_thread(
                start_postgres, work / "postgres", top, ["fencegate"]
            )
            procs.append(pg)
            url = urls[0]
            phase.store_server = StoreServer("postgres", pg, url)
        elif store == "sentinel":
            phase.sentinel = SentinelCluster(
                work / "sentinel", down_after_ms=SENTINEL_DOWN_AFTER_MS
            )
            await asyncio.to_thread(phase.sentinel.start)
            url = phase.sentinel.url
            progress(f"sentinel: master {phase.sentinel.master_port()}, 2 replicas, 3 sentinels")
        elif store == "cluster":
            phase.cluster = ClusterServers(work / "cluster", full_coverage=False)
            await asyncio.to_thread(phase.cluster.start)
            url = phase.cluster.url
            progress(f"cluster: 3 primaries, 3 replicas at {url}")
        else:
            url = f"sqlite:///{work / 'gw0' / 'fencegate.db'}"
        store_lines = (
            [
                f"redis_min_replicas = {SENTINEL_MIN_REPLICAS}",
                f"redis_replica_timeout_ms = {SENTINEL_REPLICA_TIMEOUT_MS}",
            ]
            if store == "sentinel"
            else [
                f"redis_min_replicas = {CLUSTER_MIN_REPLICAS}",
                f"redis_replica_timeout_ms = {SENTINEL_REPLICA_TIMEOUT_MS}",
                f'redis_key_prefix = "{CLUSTER_PREFIX}"',
                f"cluster_buckets = {CLUSTER_BUCKETS}",
            ]
            if store == "cluster"
            else []
        )
        for i in range(GATEWAYS[store]):
            proc, base = await asyncio.to_thread(
                start_gateway,
                work / f"gw{i}",
                url,
                log_level="warning",
                sqlite_synchronous="FULL",
                source=args.gateway_src,
                store_timeout_ms=STORE_TIMEOUT_MS,
                extra_toml=_gateway_toml(phase.downstream.base),
                store_lines=store_lines,
            )
            phase.gateways.append(Gateway(proc, base, args.gateway_src))
            progress(f"{store}: gateway {i} pid {proc.pid} at {base}")
        return await drive(phase)
    finally:
        await phase.downstream.stop()
        for gateway in phase.gateways:
            with contextlib.suppress(OSError):
                gateway.proc.popen.send_signal(signal.SIGCONT)
            gateway.proc.stop()
        if phase.store_server is not None:
            phase.store_server.heal()
            if phase.store_server.proc not in procs:
                procs.append(phase.store_server.proc)
        for proc in reversed(procs):
            proc.stop()
        if phase.sentinel is not None:
            await asyncio.to_thread(phase.sentinel.stop)
        if phase.cluster is not None:
            await asyncio.to_thread(phase.cluster.stop)


async def drive(phase: Phase) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=phase.n_workers * 4 + 16)
    async with aiohttp.ClientSession(connector=connector) as session:
        phase.clients = [
            Client(g.base, session=session, timeout=CLIENT_TIMEOUT_S, token="")
            for g in phase.gateways
        ]
        phase.epoch = (await phase.clients[0].get_epoch()).scheduler_epoch
        phase.started = time.monotonic()
        phase.deadline = phase.started + phase.seconds
        phase.say(f"{phase.n_workers} workers, {len(phase.gateways)} gateway(s), "
                  f"fault kinds {', '.join(fault_kinds(phase))}")  # fmt: skip
        workers = [asyncio.create_task(worker(phase, w)) for w in range(phase.n_workers)]
        faults = asyncio.create_task(fault_schedule(phase))
        schedule_error: str | None = None
        try:
            await asyncio.sleep(max(0.0, phase.deadline - time.monotonic()))
            phase.stopping = True
            try:
                await faults  # the fault in progress heals itself
            except Exception as exc:
                phase.say(f"the fault schedule failed: {exc!r}")
                schedule_error = repr(exc)
        finally:
            phase.stopping = True
            if not faults.done():
                faults.cancel()
            await heal_all(phase)
        phase.say("time is up; faults healed; workers finish their tasks")
        _, pending = await asyncio.wait(workers, timeout=DRAIN_S)
        if pending:
            phase.hard_stop = True
            _, pending = await asyncio.wait(pending, timeout=DRAIN_S)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        errors = [t.exception() for t in workers if not t.cancelled() and t.exception()]
        for crash in errors:
            phase.say(f"worker crashed: {crash!r}")
        await heal_all(phase)
        settle = (DOWNSTREAM_TIMEOUT_MS + PREPARED_MARGIN_MS) / 1000 + 1.0
        phase.say(f"waiting {settle:.1f}s until no forward can still be running, then checking")
        await asyncio.sleep(settle)
        checked = await check(phase, session)
    events: dict[str, dict[str, int]] = {}
    odd: list[str] = []
    for i, gateway in enumerate(phase.gateways):
        counts, lines = scan_gateway_log(gateway.proc.log_path)
        events[f"gw{i}"] = counts
        odd += lines[:5]
    return {
        "store": phase.store,
        "seconds": phase.seconds,
        "workers": phase.n_workers,
        "gateways": len(phase.gateways),
        "tasksStarted": phase.records.tasks_started,
        "operations": dict(phase.records.ops),
        "faults": dict(phase.faults),
        "faultLog": phase.fault_log,
        "workerCrashes": [repr(e) for e in errors],
        "faultScheduleError": schedule_error,
        "gatewayLogEvents": events,
        "gatewayLogOdd": odd,
        **checked,
    }


# --- report ----------------------------------------------------------------------------------


def render(figures: list[dict[str, Any]]) -> str:
    stores = [f["store"] for f in figures]
    out: list[str] = []

    def table(title: str, keys: list[tuple[str, ...]], get: Callable[[dict[str, Any],
              tuple[str, ...]], int], head: list[str]) -> None:  # fmt: skip
        rows = [[*head, *stores, "total"]]
        for key in keys:
            values = [get(f, key) for f in figures]
            rows.append([*key, *(str(v) for v in values), str(sum(values))])
        out.append(title)
        out.append(align(rows))
        out.append("")

    ops = sorted({tuple(k.split("\t")) for f in figures for k in f["operations"]})
    table("operations by kind and outcome", ops,
          lambda f, k: int(f["operations"].get("\t".join(k), 0)), ["kind", "outcome"])  # fmt: skip
    kinds = sorted({k for f in figures for k in f["faults"]} | set(FAULTS))
    table("faults injected by kind", [(k,) for k in kinds],
          lambda f, k: int(f["faults"].get(k[0], 0)), ["fault"])  # fmt: skip
    table("violations by invariant", [(k,) for k in INVARIANTS],
          lambda f, k: int(f["violations"].get(k[0], 0)), ["invariant"])  # fmt: skip
    for f in figures:
        d = f["downstream"]
        out.append(
            f"{f['store']}: downstream got {d['calls']} calls for {d['effects']} effects "
            f"({d['byMode']}); record states of those effects {d['recordStates']}; "
            f"{f['unknownListed']} listed UNKNOWN (more seen UNKNOWN by a worker and settled "
            f"truthfully, a store step the gateway could not confirm: "
            f"{f['seenUnknownSettled'] or 0}); re-sends by design (adapters that may "
            f"re-send): {d['adapterResendsByDesign']}, every downstream uses the http adapter"
        )
        out.append(
            f"  calls of a generation a newer claim superseded: {f['supersededCalls']} (the "
            f"latest arrived {f['supersededLatestMs']} ms after the newer grant; the bound is "
            f"{START_LIMIT_MS} + {CLOCK_SLACK_MS} ms)"
        )
        for name, items in f.get("examples", {}).items():
            out.append(f"  {name}: {json.dumps(items[:EXAMPLES])}")
        for crash in f.get("workerCrashes", []):
            out.append(f"  worker crash: {crash}")
        if f.get("gatewayLogOdd"):
            out.append(f"  gateway log: {f['gatewayLogEvents']}")
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos",
        description="Seeded faults against workers, gateways, the store and the downstream; "
        "then an invariant checker. Exit 1 on any violation.",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=60.0,
        help="total fault time, split evenly between the stores (default 60)",
    )
    parser.add_argument("--seed", type=int, help="seed of the fault schedule (default: random)")
    parser.add_argument("--stores", default=DEFAULT_STORES,
                        help=f"comma-separated subset of {','.join(CHAOS_STORES)}, in the "
                        f"order they run (default {DEFAULT_STORES})")  # fmt: skip
    parser.add_argument("--workers", type=int, default=8, help="SDK workers (default 8)")
    add_run_options(parser)
    args = parser.parse_args(argv)
    args.store_list = parse_stores(parser, args.stores, DEFAULT_STORES, CHAOS_STORES)
    check_run_options(parser, args, args.store_list)
    if args.seconds <= 0 or args.workers < 1:
        parser.error("--seconds must be > 0 and --workers >= 1")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1, 1_000_000)
    return args


async def run(args: argparse.Namespace, out: TextIO) -> tuple[list[dict[str, Any]], list[str]]:
    top = Path(tempfile.mkdtemp(prefix="fencegate-chaos-", dir=args.temp_dir))
    figures: list[dict[str, Any]] = []
    failures: list[str] = []
    per_store = args.seconds / len(args.store_list)
    try:
        for n, store in enumerate(args.store_list):
            phase = Phase(store, args.seed * 31 + n, per_store, args.workers, out)
            try:
                figures.append(await run_phase(phase, top / store, top, args))
                if figures[-1]["faultScheduleError"]:  # a fault that did not heal, say
                    failures.append(f"{store}: fault schedule: {figures[-1]['faultScheduleError']}")
            except Exception as exc:  # a phase that cannot run is a failure, not a crash
                failures.append(f"{store}: {exc!r}")
                print(f"[chaos] {store}: phase failed: {exc!r}", file=out, flush=True)
    finally:
        bad = failures or any(sum(f["violations"].values()) for f in figures)
        if args.keep or bad:
            print(f"[chaos] logs and data kept in {top}", file=out, flush=True)
        else:
            shutil.rmtree(top, ignore_errors=True)
    return figures, failures


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = sys.stderr if args.json == "-" else sys.stdout
    print(
        f"[chaos] seed {args.seed}; {args.seconds:g}s over {','.join(args.store_list)}; "
        f"{args.workers} workers; lease TTL {TTL_MS} ms, downstream timeout_ms "
        f"{DOWNSTREAM_TIMEOUT_MS}, prepared_margin_ms {PREPARED_MARGIN_MS} (forward start "
        f"limit {START_LIMIT_MS} ms); gateway from {gateway_origin(args.gateway_src)}",
        file=out,
        flush=True,
    )
    started = time.monotonic()
    try:
        figures, failures = asyncio.run(terminable(run(args, out)))
    except KeyboardInterrupt:
        print("[chaos] interrupted", file=sys.stderr)
        return 130
    print("", file=out)
    if figures:
        print(render(figures), file=out)
    for failure in failures:
        print(f"phase failed: {failure}", file=out)
    violations = sum(sum(f["violations"].values()) for f in figures)
    print(f"total wall time {time.monotonic() - started:.0f}s; violations: {violations}",
          file=out, flush=True)  # fmt: skip
    if args.json:
        report = {
            "seed": args.seed,
            "seconds": args.seconds,
            "workers": args.workers,
            "stores": figures,
            "phaseFailures": failures,
            "totals": {
                "operations": dict(sum((Counter(f["operations"]) for f in figures), Counter())),
                "faults": dict(sum((Counter(f["faults"]) for f in figures), Counter())),
                "violations": {
                    k: sum(f["violations"].get(k, 0) for f in figures) for k in INVARIANTS
                },
            },
            "settings": {
                "ttlMs": TTL_MS,
                "downstreamTimeoutMs": DOWNSTREAM_TIMEOUT_MS,
                "preparedMarginMs": PREPARED_MARGIN_MS,
                "forwardStartLimitMs": START_LIMIT_MS,
                "clockSlackMs": CLOCK_SLACK_MS,
                "storeTimeoutMs": STORE_TIMEOUT_MS,
            },
        }
        text = json.dumps(report, indent=2, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 1 if failures or violations else 0


if __name__ == "__main__":
    sys.exit(main())
