"""Failover of the PostgreSQL store under load: kill -9 of the primary, promotion of its
synchronous standby, two gateways on one multi-host URL.

What an operator is promised: with ``synchronous_commit = on`` and the standby named in
``synchronous_standby_names``, a transition the gateway answered is on the standby's disk
before the answer leaves, so promoting the standby after the primary dies loses none of them.
The gateways reach "whichever host is writable" through one URL listing both hosts with
``target_session_attrs=read-write``: while no host is writable they answer ``503
STORE_UNAVAILABLE`` (retryable), never an answer that contradicts what they said before.

The rig, all on this machine: a primary and a streaming standby (``pg_basebackup``, made
before anything is written: with the standby named, a commit waits for it), two ``fencegate
serve`` processes, a real downstream that counts executions per Idempotency-Key, and agents in
this event loop over both gateways. Each agent puts a task, then runs rounds of claim, a few
proxied POSTs (distinct slots, so distinct effects) and a release, the last round ending in a
commit; it remembers every answer. An agent told something that contradicts what it was told
before starts that task over, as a worker would (which is how a lost step becomes a second
execution at the downstream). Mid-load the primary is SIGKILLed (postmaster and backends at
once), the standby promoted a moment later, and the load goes on.

Two shapes of the failure: the primary dies while the standby keeps up (``kill``), or the
standby has received nothing for longer than ``store.timeout_ms`` when the primary dies
(``stalled``: the primary's walsender is SIGSTOPped first). The second is where synchronous
replication is subtle: a commit whose wait for the standby is *cancelled* (a cancel request;
``statement_timeout`` is off by then) stands on the primary alone, visible to later steps,
and a step that answered from it without waiting itself (a refusal rolls back, and a rollback
waits for nobody) would answer from state the failover throws away. The gateway gives up
first and closes the connection without a cancel, so the waiting commit stays invisible and
keeps its row locks (later steps on that task time out: 503); the run prints how many waits
PostgreSQL logged as cancelled, which says whether that path was taken at all.

Afterwards, through the gateways (on the new primary): every acknowledged put, claim, release,
commit and COMMITTED effect is there; a task's acknowledged claim generations only grew and no
generation was granted twice; the downstream ran every effect at most once (counted at the
downstream, not from the ledger); every answer that was not a success is one a client is told
to retry, or one its own earlier retryable answer explains. ``synchronous_commit = local`` is
the documented trade-off (the gateway's ``/readyz`` refuses it unless ``store.require_durable
= false``): the same load runs, and the test reports what was lost instead of asserting none.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from fencegate.ledger.effects import effect_id
from tests.downstream import Downstream
from tests.postgres_server import PostgresServer, Setting
from tests.servers import GatewayProcess, Gateways, write_gateway_config

#: About a minute on two cores: run after the default suite (`.ci/run` runs `-m slow` too).
pytestmark = pytest.mark.slow

#: Concurrent agents; each call goes to the gateways in turn.
AGENTS = 8
#: Claim rounds per task (claim, effects, release; the last one commits), and effects a round.
ROUNDS = 3
EFFECTS_PER_ROUND = 2
#: How often an agent starts a task over after an answer that contradicts what it was told.
MAX_REDOS = 2
#: The load runs this long before the trouble, the primary stays dead this long before the
#: promotion starts, and the load goes on this long after the promotion.
LOAD_BEFORE_S = 2.5
DEAD_BEFORE_PROMOTE_S = 0.75
LOAD_AFTER_PROMOTE_S = 3.0
#: ...and then on, at most this much longer, until what the verdict asks of the time after
#: the promotion has happened (``recovered_after_promotion``): a loaded machine may take
#: longer than LOAD_AFTER_PROMOTE_S to reconnect, which is no failure.
RECOVERY_BOUND_S = 30.0
#: store.timeout_ms: a request waits at most this long for the store before a 503.
STORE_TIMEOUT_MS = 1_500
#: ``stalled``: how long the standby receives nothing before the primary dies; longer than
#: STORE_TIMEOUT_MS, so the gateway gives up on commits that wait for it.
STALL_S = 2.0
#: The downstream's timeout and the PREPARED margin: an effect whose outcome could not be
#: recorded reads UNKNOWN after their sum, so an agent retrying it settles within seconds.
DOWNSTREAM_TIMEOUT_MS = 2_000
PREPARED_MARGIN_MS = 1_000
#: Leases outlive the whole run: no answer here depends on a lease running out.
LEASE_TTL_MS = 60_000
#: Pause before a retry of a retryable answer.
RETRY_PAUSE_S = 0.05
#: A gateway that does not answer within this is a hang (every store step is bounded by
#: STORE_TIMEOUT_MS, every forward by DOWNSTREAM_TIMEOUT_MS).
CLIENT_TIMEOUT_S = 10.0
#: The verdict's reads: how often one answered 503 is asked, and the pause between.
EXAMINE_READ_TRIES = 20
EXAMINE_READ_PAUSE_S = 0.25

#: The answers a client is told to retry while the store is away: nothing more, and the
#: only code docs/PROTOCOL.md gives for a store that does not answer.
RETRYABLE = {(503, "STORE_UNAVAILABLE")}

#: What PostgreSQL logs when a commit's wait for the standby is cancelled (a cancel request):
#: the commit then stands on the primary alone.
CANCELLED_SYNC_WAIT = "canceling wait for synchronous replication"

#: The two shapes of the failure (module docstring).
FAILURES = ["kill", "stalled"]


# --- what the agents saw ---------------------------------------------------------------------


@dataclass
class Reply:
    """One answer of a gateway, with when it was asked and answered (seconds since the load
    began) and whether an earlier retryable answer to the same request came before it."""

    op: str
    task_id: str
    gateway: int
    started: float
    ended: float
    status: int
    code: str | None
    effect_state: str | None
    replayed: str | None
    body: Any
    after_retryable: bool = False

    @property
    def retryable(self) -> bool:
        return (self.status, self.code) in RETRYABLE

    def brief(self) -> str:
        return (
            f"{self.op} {self.task_id} via gw{self.gateway} at {self.started:.2f}s: "
            f"{self.status} {self.code} {self.effect_state or ''} "
            f"(after a retryable answer: {self.after_retryable}) {self.body}"
        )


@dataclass(frozen=True)
class Claimed:
    task_id: str
    generation: int
    attempt_id: str
    at: float


@dataclass
class Record:
    """Everything the agents were told, and the instants of the failure (load-relative)."""

    replies: list[Reply] = field(default_factory=list)
    #: taskId -> when its put was acknowledged
    puts: dict[str, float] = field(default_factory=dict)
    claims: list[Claimed] = field(default_factory=list)
    #: effectId -> (taskId, when its COMMITTED answer arrived)
    effects: dict[str, tuple[str, float]] = field(default_factory=dict)
    #: effects whose retry met EFFECT_UNKNOWN after a 503 (the forward's outcome is unrecorded)
    unknown_effects: set[str] = field(default_factory=set)
    #: every effect an agent asked for -> its task (a duplicate may be of an unanswered one)
    sent_effects: dict[str, str] = field(default_factory=dict)
    releases: list[Claimed] = field(default_factory=list)
    #: (commitId, the committing claim), in the order acknowledged
    commits: list[tuple[str, Claimed]] = field(default_factory=list)
    #: acknowledged steps an agent found undone while it went on (a task created again, an
    #: effect forwarded afresh): (what, taskId, when it was first acknowledged)
    undone: list[tuple[str, str, float]] = field(default_factory=list)
    #: answers a client could not have expected, with why
    wrong: list[tuple[Reply, str]] = field(default_factory=list)
    tasks: set[str] = field(default_factory=set)
    #: the standby stopped receiving (``stalled`` only), the kill began (the postmaster is
    #: frozen first), every server process was gone, the promotion began and ended
    stall_at: float | None = None
    kill_at: float = 0.0
    killed_at: float = 0.0
    promote_started_at: float = 0.0
    promoted_at: float = 0.0

    @property
    def trouble_at(self) -> float:
        return self.kill_at if self.stall_at is None else self.stall_at


class Abandon(Exception):
    """The agent gives up on its current task (and starts a new one)."""


class Redo(Abandon):
    """The agent was told something that contradicts what it was told before: it starts the
    same task over (put, claim, the same effects), as a worker would."""


class Load:
    """Agents driving claims and proxied effects through both gateways."""

    def __init__(
        self, session: aiohttp.ClientSession, gateways: list[GatewayProcess], run: str
    ) -> None:
        self.session = session
        self.gateways = gateways
        self.run = run
        self.record = Record()
        self.stopping = False
        self.began = time.monotonic()
        self.turn = 0

    def now(self) -> float:
        return time.monotonic() - self.began

    async def send(
        self, op: str, task_id: str, method: str, path: str, *, json: Any, headers: Any = None
    ) -> Reply:
        index = self.turn % len(self.gateways)
        self.turn += 1
        started = self.now()
        state = replayed = None
        try:
            async with self.session.request(
                method,
                self.gateways[index].url + path,
                json=json,
                headers=headers,
                allow_redirects=False,
            ) as resp:
                raw = await resp.read()
                try:
                    body = await resp.json(content_type=None) if raw else None
                except ValueError:
                    body = raw[:200]
                status = resp.status
                state = resp.headers.get("Fence-Effect-State")
                replayed = resp.headers.get("Fence-Replayed")
        except (aiohttp.ClientError, TimeoutError) as exc:
            status, body = 0, f"no answer: {type(exc).__name__}: {exc}"
        code = body.get("code") if isinstance(body, dict) else None
        reply = Reply(op, task_id, index, started, self.now(), status, code, state, replayed, body)
        self.record.replies.append(reply)
        return reply

    async def retrying(
        self, call: Callable[[], Awaitable[Reply]], *, in_flight_too: bool = False
    ) -> Reply:
        """Send ``call`` again while the answer is retryable (and, for an effect after such an
        answer, while the ledger says its forward may still run: EFFECT_IN_FLIGHT)."""
        earlier = False
        while True:
            reply = await call()
            reply.after_retryable = earlier
            again = reply.retryable or (
                in_flight_too and earlier and reply.code == "EFFECT_IN_FLIGHT"
            )
            if not again:
                return reply
            earlier = True
            if self.stopping:
                raise Abandon
            await asyncio.sleep(RETRY_PAUSE_S)

    def wrong(self, reply: Reply, why: str) -> Redo:
        self.record.wrong.append((reply, why))
        return Redo()

    async def agent(self, index: int) -> None:
        for number in itertools.count():
            task_id = f"{self.run}-a{index}-t{number}"
            self.record.tasks.add(task_id)
            for _ in range(1 + MAX_REDOS):
                if self.stopping:
                    return
                try:
                    await self.task(task_id)
                except Redo:
                    continue
                except Abandon:
                    pass
                break

    async def task(self, task_id: str) -> None:
        put = await self.retrying(
            lambda: self.send(
                "put", task_id, "PUT", f"/v1/tasks/{task_id}", json={"inputDigest": "in-1"}
            )
        )
        if put.status == 201 and task_id in self.record.puts:
            self.record.undone.append(("put", task_id, self.record.puts[task_id]))
        elif put.status not in (200, 201):
            raise self.wrong(put, "put of a task")
        self.record.puts.setdefault(task_id, put.ended)
        for round_ in range(ROUNDS):
            if self.stopping:
                return
            lease = await self.claim(task_id)
            for k in range(EFFECTS_PER_ROUND):
                await self.effect(lease, f"r{round_}-s{k}")
            if round_ == ROUNDS - 1:
                await self.commit(lease)
            else:
                await self.release(lease)

    async def claim(self, task_id: str) -> dict[str, Any]:
        body = {"owner": "agent", "ttlMs": LEASE_TTL_MS, "schedulerEpoch": 1}
        reply = await self.send("claim", task_id, "POST", f"/v1/tasks/{task_id}/claim", json=body)
        if reply.retryable:
            # The claim may have been applied: the task may be held by an attempt this agent
            # never learned. A worker would read the task or wait for the lease; this one
            # moves on to a new task.
            raise Abandon
        if reply.status != 200:
            raise self.wrong(reply, "claim of a task this agent released (or just put)")
        lease: dict[str, Any] = reply.body
        self.record.claims.append(
            Claimed(task_id, lease["claimGeneration"], lease["attemptId"], reply.ended)
        )
        return lease

    async def effect(self, lease: dict[str, Any], slot: str) -> None:
        task_id = lease["taskId"]
        eid = effect_id(task_id, lease["revision"], "main", slot)
        self.record.sent_effects[eid] = task_id
        headers = {
            "Fence-Task": task_id,
            "Fence-Attempt": lease["attemptId"],
            "Fence-Generation": str(lease["claimGeneration"]),
            "Fence-Epoch": str(lease["schedulerEpoch"]),
            "Fence-Cancel": str(lease["cancelGeneration"]),
            "Fence-Slot": slot,
        }
        reply = await self.retrying(
            lambda: self.send(
                "effect",
                task_id,
                "POST",
                "/proxy/api/ok/pay",
                json={"task": task_id, "slot": slot},
                headers=headers,
            ),
            in_flight_too=True,
        )
        if reply.status == 200 and reply.effect_state == "COMMITTED":
            if eid in self.record.effects and reply.replayed == "false":
                self.record.undone.append(("effect", task_id, self.record.effects[eid][1]))
            self.record.effects.setdefault(eid, (task_id, reply.ended))
        elif reply.after_retryable and reply.code == "EFFECT_UNKNOWN":
            # A 503 said the forward's outcome could not be recorded: the ledger keeps it
            # UNKNOWN rather than forward it again. An operator would settle it.
            self.record.unknown_effects.add(eid)
        else:
            raise self.wrong(reply, "proxied call on a lease this agent holds")

    def identity(self, lease: dict[str, Any]) -> dict[str, Any]:
        return {
            "attemptId": lease["attemptId"],
            "claimGeneration": lease["claimGeneration"],
            "schedulerEpoch": lease["schedulerEpoch"],
            "cancelGeneration": lease["cancelGeneration"],
        }

    async def release(self, lease: dict[str, Any]) -> None:
        task_id = lease["taskId"]
        body = {**self.identity(lease), "owner": "agent"}
        reply = await self.retrying(
            lambda: self.send("release", task_id, "POST", f"/v1/tasks/{task_id}/release", json=body)
        )
        if reply.status == 200:
            self.record.releases.append(self.claimed(lease, reply))
        elif not (reply.after_retryable and reply.code == "FENCED"):
            # FENCED after a 503: the unanswered release was applied, the attempt is gone.
            raise self.wrong(reply, "release of a lease this agent holds")

    async def commit(self, lease: dict[str, Any]) -> None:
        task_id = lease["taskId"]
        body = {**self.identity(lease), "inputDigest": "in-1", "resultDigest": "out-1"}
        reply = await self.retrying(
            lambda: self.send("commit", task_id, "POST", f"/v1/tasks/{task_id}/commit", json=body)
        )
        if reply.status != 200:  # a retried commit that was applied answers the same 200
            raise self.wrong(reply, "commit of a lease this agent holds")
        self.record.commits.append((reply.body["commitId"], self.claimed(lease, reply)))

    @staticmethod
    def claimed(lease: dict[str, Any], reply: Reply) -> Claimed:
        return Claimed(lease["taskId"], lease["claimGeneration"], lease["attemptId"], reply.ended)


# --- the rig ---------------------------------------------------------------------------------


def start_gateway(
    gateways: Gateways, name: str, store_url: str, downstream: Downstream, durable: bool
) -> GatewayProcess:
    """``Gateways.start`` with ``store.require_durable`` as asked: that key is not among its
    parameters, so it is written into the ``[store]`` table of the generated file."""
    gateway = write_gateway_config(
        gateways.root / name,
        store_url,
        timeout_ms=STORE_TIMEOUT_MS,
        downstreams=[{"name": "api", "url": downstream.url, "timeout_ms": DOWNSTREAM_TIMEOUT_MS}],
        proxy={"prepared_margin_ms": PREPARED_MARGIN_MS},
    )
    if not durable:
        text = gateway.config_path.read_text()
        gateway.config_path.write_text(
            text.replace("[store]\n", "[store]\nrequire_durable = false\n", 1)
        )
    gateways.started.append(gateway)
    return gateway.start()


@dataclass
class Rig:
    primary: PostgresServer
    standby: PostgresServer
    gateways: list[GatewayProcess]


async def failover_rig(
    make_postgres_server: Callable[..., PostgresServer],
    gateways: Gateways,
    downstream: Downstream,
    synchronous_commit: str,
) -> Rig:
    """A primary naming its standby as synchronous, the standby (made before anything is
    written: every commit waits for it), and two gateways on the multi-host URL."""
    settings: dict[str, Setting] = {
        "synchronous_standby_names": "standby1",
        "synchronous_commit": synchronous_commit,
        "wal_level": "replica",
        "full_page_writes": False,  # nothing here survives an OS crash; speed
    }
    primary = await asyncio.to_thread(make_postgres_server, settings, name="primary")
    standby = await asyncio.to_thread(primary.make_standby, "standby1")
    url = (
        f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/postgres"
        "?target_session_attrs=read-write"
    )
    durable = synchronous_commit != "local"
    pair = await asyncio.gather(
        *(
            asyncio.to_thread(start_gateway, gateways, name, url, downstream, durable)
            for name in ("gw1", "gw2")
        )
    )
    return Rig(primary, standby, list(pair))


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    connector = aiohttp.TCPConnector(limit=4 * AGENTS)
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        yield client


async def wait_ready(session: aiohttp.ClientSession, gateway: GatewayProcess) -> None:
    """Until ``/readyz`` answers 200: the gateway reaches a writable store."""
    deadline = time.monotonic() + 20
    while True:
        async with session.get(gateway.url + "/readyz") as resp:
            if resp.status == 200:
                return
            body = await resp.text()
        assert time.monotonic() < deadline, f"{gateway.url} not ready: {body}"
        await asyncio.sleep(0.1)


def stall_standby(primary: PostgresServer) -> None:
    """SIGSTOP the primary's walsender: the standby receives nothing more (its connection
    stays open, so nothing notices), and ``kill`` takes the frozen walsender with the rest."""
    pid = int(
        primary.psql("SELECT pid FROM pg_stat_replication WHERE application_name = 'standby1'")
    )
    os.kill(pid, signal.SIGSTOP)


async def run_failover(rig: Rig, session: aiohttp.ClientSession, run: str, failure: str) -> Record:
    """The load, with the primary killed (after the standby stalled, if asked) and the standby
    promoted in its middle. Blocking steps run off the event loop, where the downstream and
    the agents run."""
    for gateway in rig.gateways:
        await wait_ready(session, gateway)
    load = Load(session, rig.gateways, run)
    record = load.record
    agents = [asyncio.create_task(load.agent(i)) for i in range(AGENTS)]
    await asyncio.sleep(LOAD_BEFORE_S)
    if failure == "stalled":
        record.stall_at = load.now()
        await asyncio.to_thread(stall_standby, rig.primary)
        await asyncio.sleep(STALL_S)
    record.kill_at = load.now()
    await asyncio.to_thread(rig.primary.kill)
    record.killed_at = load.now()
    await asyncio.sleep(DEAD_BEFORE_PROMOTE_S)
    record.promote_started_at = load.now()
    await asyncio.to_thread(rig.standby.promote)
    record.promoted_at = load.now()
    await load_after_promotion(load)
    load.stopping = True
    async with asyncio.timeout(2 * CLIENT_TIMEOUT_S):
        await asyncio.gather(*agents)
    assert not rig.standby.in_recovery()
    return record


def recovered_after_promotion(record: Record, gateways: int) -> bool:
    """Every gateway acknowledged a call asked after the promotion, a claim and an effect
    among them (what ``failover_run`` asserts of the time after it)."""
    after = [r for r in record.replies if r.started > record.promoted_at]
    return (
        {r.gateway for r in after if r.status in (200, 201)} == set(range(gateways))
        and any(r.op == "claim" and r.status == 200 for r in after)
        and any(r.op == "effect" and r.status == 200 for r in after)
    )


async def load_after_promotion(load: Load, for_s: float = LOAD_AFTER_PROMOTE_S) -> None:
    """The load goes on ``for_s`` after the promotion, then until the gateways
    have recovered (``recovered_after_promotion``; RECOVERY_BOUND_S bounds a hang only: the
    verdict's assertions then say what is missing)."""
    await asyncio.sleep(for_s)
    deadline = time.monotonic() + RECOVERY_BOUND_S
    while not recovered_after_promotion(load.record, len(load.gateways)):
        if time.monotonic() > deadline:
            return
        await asyncio.sleep(0.1)


# --- the verdict -----------------------------------------------------------------------------


@dataclass
class Findings:
    """What the new primary holds against what the agents were told."""

    lost_puts: list[str] = field(default_factory=list)
    lost_claims: list[str] = field(default_factory=list)
    #: a generation acknowledged twice, or not above the one acknowledged before it
    reused_generations: list[str] = field(default_factory=list)
    lost_releases: list[str] = field(default_factory=list)
    lost_commits: list[str] = field(default_factory=list)
    lost_effects: list[str] = field(default_factory=list)
    #: acknowledged steps the agents found undone during the run (``Record.undone``)
    undone: list[str] = field(default_factory=list)
    #: effectId -> executions at the downstream, where more than one
    duplicates: dict[str, int] = field(default_factory=dict)
    #: when the lost steps had been acknowledged (load-relative)
    lost_at: list[float] = field(default_factory=list)
    #: tasks touched by any of the above
    tasks_with_loss: set[str] = field(default_factory=set)
    #: reads of the verdict answered 503 and asked again (none of them a loss)
    reads_asked_again: int = 0

    def lost(self) -> int:
        return (
            len(self.lost_puts)
            + len(self.lost_claims)
            + len(self.reused_generations)
            + len(self.lost_releases)
            + len(self.lost_commits)
            + len(self.lost_effects)
            + len(self.undone)
        )

    def counts(self) -> str:
        kinds = {
            "puts": self.lost_puts,
            "claims": self.lost_claims,
            "generations granted again": self.reused_generations,
            "releases": self.lost_releases,
            "commits": self.lost_commits,
            "effects": self.lost_effects,
            "found undone during the run": self.undone,
        }
        return ", ".join(f"{name} {len(items)} (e.g. {items[:2]})" for name, items in kinds.items())


async def read_json(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as resp:
        return resp.status, await resp.json(content_type=None)


async def examine(
    record: Record, session: aiohttp.ClientSession, rig: Rig, downstream: Downstream
) -> Findings:
    found = Findings()
    base = rig.gateways[0].url
    limit = asyncio.Semaphore(16)

    async def get(path: str) -> tuple[int, Any]:
        """What the store holds now. A 503 says nothing of it (a read slower than
        store.timeout_ms on a loaded machine, a pooled connection still to the old primary):
        asked again, as a client would; one still 503 after ``EXAMINE_READ_TRIES`` counts
        against the run."""
        async with limit:
            for _ in range(EXAMINE_READ_TRIES - 1):
                status, body = await read_json(session, base + path)
                if status != 503:
                    return status, body
                found.reads_asked_again += 1
                await asyncio.sleep(EXAMINE_READ_PAUSE_S)
            return await read_json(session, base + path)

    def lose(kind: list[str], task_id: str, at: float, what: str) -> None:
        kind.append(what)
        found.lost_at.append(at)
        found.tasks_with_loss.add(task_id)

    task_ids = sorted(record.tasks)
    task_answers = await asyncio.gather(*(get(f"/v1/tasks/{t}") for t in task_ids))
    for status, body in task_answers:
        assert status in (200, 404), body
    tasks = {
        t: body for t, (status, body) in zip(task_ids, task_answers, strict=True) if status == 200
    }

    for what, task_id, at in record.undone:
        lose(found.undone, task_id, at, f"{what} of {task_id}")
    for task_id, at in record.puts.items():
        if task_id not in tasks:
            lose(found.lost_puts, task_id, at, task_id)
    by_task: defaultdict[str, list[Claimed]] = defaultdict(list)
    for claim in record.claims:
        by_task[claim.task_id].append(claim)
    for task_id, claims in by_task.items():
        current = tasks.get(task_id)
        for earlier, later in itertools.pairwise(claims):
            if later.generation <= earlier.generation:
                lose(
                    found.reused_generations,
                    task_id,
                    earlier.at,
                    f"{task_id}: generation {earlier.generation} then {later.generation}",
                )
        for claim in claims:
            generation = current["claimGeneration"] if current else 0
            if generation < claim.generation or (
                generation == claim.generation
                and current
                and current["attemptId"] not in (None, claim.attempt_id)
            ):
                lose(
                    found.lost_claims,
                    task_id,
                    claim.at,
                    f"{task_id}: acknowledged {claim.generation}, now {generation}",
                )
    for release in record.releases:
        current = tasks.get(release.task_id)
        if current and current["state"] == "CLAIMED" and current["attemptId"] == release.attempt_id:
            lose(found.lost_releases, release.task_id, release.at, f"{release.task_id}: held")
    for commit_id, claim in record.commits:
        current = tasks.get(claim.task_id)
        if not current or not current["commit"] or current["commit"]["commitId"] != commit_id:
            state = current and current["state"]
            lose(found.lost_commits, claim.task_id, claim.at, f"{claim.task_id}: {state}")

    eids = sorted(record.effects)
    effect_answers = await asyncio.gather(*(get(f"/v1/effects/{e}") for e in eids))
    for eid, (status, body) in zip(eids, effect_answers, strict=True):
        task_id, at = record.effects[eid]
        if status != 200 or body["state"] != "COMMITTED":
            state = body.get("state") if status == 200 else status
            lose(found.lost_effects, task_id, at, f"{task_id} {eid[:12]}: {state}")
        assert downstream.per_key[eid] >= 1, f"{eid} answered COMMITTED, never executed"
    for key, count in downstream.per_key.items():
        if count > 1:
            found.duplicates[key] = count
            found.tasks_with_loss.add(record.sent_effects.get(key, key))
    return found


@dataclass
class Figures:
    """A run in numbers; times in seconds from the start of the trouble (the stall, else the
    kill)."""

    acked_claims: int
    acked_effects: int
    acked_releases: int
    acked_commits: int
    #: effects a 503 left UNKNOWN (the forward ran or not, its outcome went unrecorded), and
    #: how many of them the downstream did run
    unknown_effects: int
    unknown_executed: int
    answers: int
    retryable: int
    #: 503s answered before the trouble began (a store slower than store.timeout_ms)
    retryable_before: int
    #: the first 503 asked and the last one answered
    first_503: float | None
    last_503: float | None
    #: the first acknowledged claim or effect asked once the primary was gone: when it was
    #: answered
    recovered_after: float | None
    killed_after: float
    promoted_after: float
    promotion_took: float
    acked_after_promotion: int
    #: every answer that was not 2xx, by (status, code, came after a retryable answer)
    refusals: dict[tuple[int, str | None, bool], int]
    lost: int
    #: the earliest and latest acknowledgement among the lost steps
    lost_from: float | None
    lost_to: float | None
    duplicates: int
    wrong: int

    def summary(self, run: str) -> str:
        def at(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}s"

        return (
            f"{run}: primary killed at {at(self.killed_after)}, the standby promoted at "
            f"{at(self.promoted_after)} (pg_promote took {self.promotion_took:.2f}s)\n"
            f"  acknowledged: {self.acked_claims} claims, {self.acked_effects} effects, "
            f"{self.acked_releases} releases, {self.acked_commits} commits; "
            f"{self.acked_after_promotion} 2xx answers to calls asked after the promotion\n"
            f"  503 STORE_UNAVAILABLE: {self.retryable} of {self.answers} answers "
            f"({self.retryable_before} before the trouble), asked from {at(self.first_503)} "
            f"to answered at {at(self.last_503)}; first acknowledged claim/effect asked after "
            f"the kill answered at {at(self.recovered_after)}\n"
            f"  refusals (status, code, after a 503): {self.refusals}\n"
            f"  effects left UNKNOWN by a 503: {self.unknown_effects} "
            f"({self.unknown_executed} ran at the downstream)\n"
            f"  lost: {self.lost} (acknowledged from {at(self.lost_from)} to "
            f"{at(self.lost_to)}); duplicated at the downstream: {self.duplicates}; "
            f"wrong answers: {self.wrong}"
        )


def figures(record: Record, found: Findings, downstream: Downstream) -> Figures:
    unavailable = [r for r in record.replies if r.retryable]
    zero = record.trouble_at
    recovered = [
        r.ended
        for r in record.replies
        if r.started > record.killed_at and r.status == 200 and r.op in ("claim", "effect")
    ]
    refusals = Counter(
        (r.status, r.code, r.after_retryable) for r in record.replies if r.status >= 300
    )
    return Figures(
        acked_claims=len(record.claims),
        acked_effects=len(record.effects),
        acked_releases=len(record.releases),
        acked_commits=len(record.commits),
        unknown_effects=len(record.unknown_effects),
        unknown_executed=sum(1 for e in record.unknown_effects if downstream.per_key[e]),
        answers=len(record.replies),
        retryable=len(unavailable),
        retryable_before=sum(1 for r in unavailable if r.ended < zero),
        first_503=min(r.started for r in unavailable) - zero if unavailable else None,
        last_503=max(r.ended for r in unavailable) - zero if unavailable else None,
        recovered_after=min(recovered) - zero if recovered else None,
        killed_after=record.killed_at - zero,
        promoted_after=record.promoted_at - zero,
        promotion_took=record.promoted_at - record.promote_started_at,
        acked_after_promotion=sum(
            1 for r in record.replies if r.started > record.promoted_at and r.status in (200, 201)
        ),
        refusals=dict(sorted(refusals.items(), key=str)),
        lost=found.lost(),
        lost_from=min(found.lost_at) - zero if found.lost_at else None,
        lost_to=max(found.lost_at) - zero if found.lost_at else None,
        duplicates=len(found.duplicates),
        wrong=len(record.wrong),
    )


async def failover_run(
    setting: str,
    failure: str,
    make_postgres_server: Callable[..., PostgresServer],
    gateways: Gateways,
    downstream: Downstream,
    session: aiohttp.ClientSession,
) -> tuple[Record, Findings, Figures]:
    """Rig, load and failure, then the verdict; the figures are printed (``pytest -s``)."""
    rig = await failover_rig(make_postgres_server, gateways, downstream, setting)
    record = await run_failover(rig, session, setting, failure)
    cancelled = rig.primary.log_path.read_text(errors="replace").count(CANCELLED_SYNC_WAIT)
    found = await examine(record, session, rig, downstream)
    fig = figures(record, found, downstream)
    print(f"\n{fig.summary(f'synchronous_commit={setting}, {failure}')}")
    print(f"  commit waits for the standby cancelled on the old primary: {cancelled}")
    print(f"  verdict reads answered 503 and asked again: {found.reads_asked_again}")
    if found.lost() or found.duplicates:
        print(f"  lost by kind: {found.counts()}")
    for reply, why in record.wrong[:20]:
        print(f"  wrong: {why}: {reply.brief()}")
    # Whatever was lost, the load went on: both gateways found the new primary by themselves.
    after = [r for r in record.replies if r.started > record.promoted_at]
    assert {r.gateway for r in after if r.status in (200, 201)} == {0, 1}, fig
    assert any(r.op == "claim" and r.status == 200 for r in after), fig
    assert any(r.op == "effect" and r.status == 200 for r in after), fig
    # The gateways never hung and never failed inside: no 5xx but the retryable one.
    broken = [
        r.brief() for r in record.replies if r.status == 0 or (r.status >= 500 and not r.retryable)
    ]
    assert not broken, broken
    assert fig.retryable > 0, "the failure went unnoticed: the load did not reach the store"
    return record, found, fig


@pytest.mark.parametrize("failure", FAILURES)
async def test_failover_to_a_synchronous_standby_loses_no_acknowledged_step(
    failure: str,
    make_postgres_server: Callable[..., PostgresServer],
    gateways: Gateways,
    downstream: Downstream,
    session: aiohttp.ClientSession,
) -> None:
    """synchronous_commit = on: what was answered survives, nothing ran twice, and while no
    host was writable (or the standby did not confirm) the gateways answered 503
    STORE_UNAVAILABLE, and nothing that contradicts an earlier answer."""
    record, found, _fig = await failover_run(
        "on", failure, make_postgres_server, gateways, downstream, session
    )
    assert not record.wrong, [f"{why}: {reply.brief()}" for reply, why in record.wrong]
    assert found.lost() == 0, found
    assert not found.duplicates, found.duplicates
    assert max(downstream.per_key.values()) == 1


@pytest.mark.parametrize("failure", FAILURES)
async def test_failover_with_synchronous_commit_local_reports_what_was_lost(
    failure: str,
    make_postgres_server: Callable[..., PostgresServer],
    gateways: Gateways,
    downstream: Downstream,
    session: aiohttp.ClientSession,
) -> None:
    """synchronous_commit = local: the primary answers before the standby has the WAL, so a
    failover may lose answered steps (the documented trade-off). Not asserted away: reported.
    What must still hold is that every wrong answer is one such a loss explains (it is about a
    task whose acknowledged state the new primary lacks). With the standby stalled, the loss
    is certain: the test then also checks that it is seen (this test's own detector works)."""
    record, found, _fig = await failover_run(
        "local", failure, make_postgres_server, gateways, downstream, session
    )
    unexplained = [
        f"{why}: {reply.brief()}"
        for reply, why in record.wrong
        if reply.task_id not in found.tasks_with_loss
    ]
    assert not unexplained, unexplained
    if failure == "stalled":
        assert found.lost() > 0, "steps acknowledged while the standby received nothing survived"


async def test_gateway_answers_503_while_every_host_it_reaches_is_read_only(
    make_postgres_server: Callable[..., PostgresServer],
    gateways: Gateways,
    downstream: Downstream,
    session: aiohttp.ClientSession,
) -> None:
    """The other shape of a switch: the old primary is up but no longer writable (fenced with
    default_transaction_read_only, or back as a standby) before the new one is promoted. No
    host refuses the connection, so asyncpg has no connection error to report; the gateway
    must still answer the retryable 503 rather than a 500 a client would not retry."""
    settings: dict[str, Setting] = {"synchronous_standby_names": "standby1"}
    primary = await asyncio.to_thread(make_postgres_server, settings, name="primary")
    standby = await asyncio.to_thread(primary.make_standby, "standby1")
    url = (
        f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/postgres"
        "?target_session_attrs=read-write"
    )
    gateway = await asyncio.to_thread(start_gateway, gateways, "gw", url, downstream, True)
    await wait_ready(session, gateway)

    async def put(task_id: str) -> tuple[int, Any]:
        async with session.put(
            f"{gateway.url}/v1/tasks/{task_id}", json={"inputDigest": "in-1"}
        ) as resp:
            return resp.status, await resp.json(content_type=None)

    assert (await put("before"))[0] == 201

    def fence_primary(read_only: bool) -> None:
        value = "on" if read_only else "off"
        primary.psql(f"ALTER SYSTEM SET default_transaction_read_only = {value}")
        primary.psql("SELECT pg_reload_conf()")
        # The pool's connections were chosen as writable; new ones are chosen now.
        primary.psql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'fencegate'"
        )

    await asyncio.to_thread(fence_primary, True)
    for n in range(3):
        status, body = await put(f"during-{n}")
        assert (status, body.get("code")) == (503, "STORE_UNAVAILABLE"), body
    await asyncio.to_thread(fence_primary, False)
    assert (await put("after"))[0] == 201
