"""The claim.v1 task transitions as pure functions: no clock, no I/O, no randomness.

Everything that decides who owns a task lives here. A store reads the task and the scheduler
record, calls one function with the store's ``now`` (and any fresh ids), and writes back what
it returns, all inside one atomic step. A refused transition raises a ``FencegateError`` and
the caller writes nothing, so an illegal step can never leave a half-changed record.

The Redis store's Lua scripts (``ledger/lua/*.lua``) mirror these functions line for line;
``tests/test_stateful.py`` holds both stores to this module.

Rules worth knowing (each has a test that tries to break it):

* A claim succeeds only from READY, from CLAIMED with an expired lease, or from CLAIMED under
  an older scheduler epoch (bumping the epoch fences every older claim, so its holder is
  already dead to every acceptance point and the task is free at once).
* Every claim adds one to ``claim_generation`` and carries a new ``attempt_id``.
* Renew and commit compare the attempt's identity, the request's epoch *and* the epoch the
  claim was granted under, and the cancel generation. Renew also needs an unexpired lease and
  never extends past ``attempt_started_at + max_runtime_ms``. Commit ignores the clock.
* Release gives authority back, so it skips the epoch check: an old-epoch worker may still hand
  its task back early instead of blocking it until the lease runs out.
* Check order, so a client sees the most useful code: identity (FENCED), epoch (STALE_EPOCH),
  cancel (CANCELLED), revision (STALE_INPUT), then state and clock.
* A lease is bound to its holder: a claim records the authenticated principal (``principal``,
  None without ``[auth]``), and renew, release, commit and every proxied call on that claim
  must come from the same principal when both the request and the claim name one
  (``check_principal``); a copied ``attemptId`` is worth nothing without the credential.

Task flow (queues, dependencies, discarded work; docs/PROTOCOL.md "Task flow"):

* A task may name a ``queue`` and a ``priority``; ``claim_next`` claims the best claimable task
  of a queue (``is_claimable``, ordered by ``queue_order``) exactly as a claim by id would.
* A task with ``depends_on`` is WAITING until every dependency is COMMITTED (``dep_commits``,
  the provenance: which commit of each it builds on). The store applies the dependency rules
  to a dependency's dependents in the same atomic step: ``dependency_committed`` (the last one
  makes it READY), ``dependency_revised`` (a new revision of a committed dependency sends every
  not-yet-committed dependent back to WAITING; committed ones keep their provenance) and
  ``cancel_dependent`` (a cancel cascades to every not-yet-committed dependent, transitively).
* A worker's attempt reports what it spent (``cost``, an increment per report); an attempt a
  step throws away (taken over after expiry or an epoch bump, cancelled, superseded by a new
  revision) comes back in the step's answer as ``Task.discarded`` (never stored), so the
  gateway that made the step counts it once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from fencegate.ledger.errors import (
    AlreadyCommitted,
    BadRequest,
    Cancelled,
    Claimed,
    ClaimsPaused,
    DependenciesPending,
    Fenced,
    LeaseExpired,
    NoSuchTask,
    RuntimeExceeded,
    StaleEpoch,
    StaleInput,
    TaskExpired,
)

__all__ = [
    "MAX_GRAPH_VISITS",
    "ClaimRequest",
    "Commit",
    "CommitRequest",
    "Cost",
    "DepCommit",
    "Discard",
    "Identity",
    "LeasePolicy",
    "PutOutcome",
    "RenewRequest",
    "Scheduler",
    "Task",
    "TaskState",
    "Tombstone",
    "add_cost",
    "bump_epoch",
    "cancel",
    "cancel_dependent",
    "check_dependencies",
    "check_holder",
    "check_principal",
    "claim",
    "claim_next",
    "commit",
    "cost_from_json",
    "cost_to_json",
    "cycle",
    "dependency_committed",
    "dependency_revised",
    "expired_task",
    "graph_too_large",
    "is_claimable",
    "put",
    "queue_order",
    "release",
    "renew",
    "set_claims_paused",
    "task_from_fields",
    "task_to_fields",
]


class TaskState(StrEnum):
    WAITING = "WAITING"
    READY = "READY"
    CLAIMED = "CLAIMED"
    COMMITTED = "COMMITTED"
    CANCELLED = "CANCELLED"


class PutOutcome(StrEnum):
    CREATED = "CREATED"
    REVISED = "REVISED"
    UNCHANGED = "UNCHANGED"


@dataclass(frozen=True, slots=True)
class LeasePolicy:
    """Server-side bounds a worker cannot talk its way past."""

    max_ttl_ms: int
    default_max_runtime_ms: int


@dataclass(frozen=True, slots=True)
class Scheduler:
    """The one global record: the current epoch and whether new claims are paused."""

    epoch: int = 1
    claims_paused: bool = False


@dataclass(frozen=True, slots=True)
class Commit:
    commit_id: str
    attempt_id: str
    claim_generation: int
    result_digest: str
    committed_at: int
    #: The committed result as canonical JSON text, or None when the commit carried none.
    result_json: str | None = None


#: What an attempt spent, per unit (sorted by unit): ``(("seconds", 1.5), ("tokens", 900.0))``.
Cost = tuple[tuple[str, float], ...]

#: Most task records a put walks to prove its new dependencies make no cycle.
MAX_GRAPH_VISITS = 10_000

#: States whose task still waits for (or runs on) its dependencies' results: the only ones the
#: dependency rules change. COMMITTED tasks keep what they were built on; CANCELLED ones are
#: recomputed by their next revision.
_OPEN = frozenset(("WAITING", "READY", "CLAIMED"))


@dataclass(frozen=True, slots=True)
class DepCommit:
    """Provenance: the commit of a dependency a task builds on."""

    task_id: str
    commit_id: str
    result_digest: str


@dataclass(frozen=True, slots=True)
class Discard:
    """An attempt a step threw away, with what it had reported spending. ``reason``:
    ``expired`` or ``epoch`` (a claim took the task over), ``cancelled``, ``superseded`` (a new
    revision of the task, or of a dependency it was running on)."""

    task_id: str
    attempt_id: str
    reason: str
    cost: Cost = ()


@dataclass(frozen=True, slots=True)
class Task:
    task_id: str
    state: TaskState
    revision: int
    input_digest: str
    created_at: int
    updated_at: int
    max_runtime_ms: int | None = None
    claim_generation: int = 0
    cancel_generation: int = 0
    #: The current (or last) claim. Kept after a revision or cancel so its holder learns why
    #: it lost (STALE_INPUT, CANCELLED); cleared by release.
    attempt_id: str | None = None
    owner: str | None = None
    #: The authenticated principal that made the current (or last) claim; None without
    #: ``[auth]``. Distinct from ``owner``, a free-text label the worker chooses.
    principal: str | None = None
    lease_expires_at: int | None = None
    attempt_started_at: int | None = None
    claim_epoch: int | None = None
    claim_revision: int | None = None
    commit: Commit | None = None
    #: When the current revision became READY (created or revised): READY-to-commit latency.
    ready_at: int | None = None
    #: The lease a claim took over from, if it took over an expired (or fenced) claim:
    #: lease-expiry-to-reclaim latency.
    previous_lease_expires_at: int | None = None
    #: The queue ``claim_next`` finds the task in (None: claimed by id only), and its rank.
    queue: str | None = None
    priority: int = 0
    #: Tasks whose canonical commits this one needs, in the order given.
    depends_on: tuple[str, ...] = ()
    #: The commits of those dependencies that are COMMITTED (in ``depends_on`` order): the
    #: provenance of the current revision. WAITING while shorter than ``depends_on``.
    dep_commits: tuple[DepCommit, ...] = ()
    #: What the current attempt reported spending so far (reset by every claim).
    attempt_cost: Cost = ()
    #: Attempts the step that produced this record threw away. Never stored: the gateway that
    #: made the step counts them (metrics), so each is counted once.
    discarded: tuple[Discard, ...] = ()


@dataclass(frozen=True, slots=True)
class Tombstone:
    """What is remembered of an expired task until ``forget_at``."""

    task_id: str
    revision: int
    claim_generation: int
    cancel_generation: int
    input_digest: str
    #: COMMITTED or CANCELLED.
    state: TaskState
    expired_at: int
    forget_at: int
    #: How many effect records went with it.
    effects: int


def expired_task(stone: Tombstone) -> TaskExpired:
    """The refusal of any call naming an expired task (the store raises it where it would
    have raised NoSuchTask; ``ledger.retention`` says when one is made)."""
    return TaskExpired(
        f"task {stone.task_id} was {stone.state.value} and expired at expiredAt "
        f"{stone.expired_at} with its {stone.effects} effect record(s): nothing was done. "
        f"PUT a new input to run it again (revision {stone.revision + 1})",
        expiredAt=stone.expired_at,
        revision=stone.revision,
    )


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    owner: str
    ttl_ms: int
    scheduler_epoch: int
    expected_revision: int | None = None
    #: The authenticated principal making the claim (None without ``[auth]``).
    principal: str | None = None


@dataclass(frozen=True, slots=True)
class Identity:
    """What a worker presents to prove it holds the current claim."""

    attempt_id: str
    claim_generation: int
    owner: str
    scheduler_epoch: int
    cancel_generation: int
    #: The authenticated principal presenting it (None without ``[auth]``).
    principal: str | None = None


@dataclass(frozen=True, slots=True)
class RenewRequest:
    identity: Identity
    ttl_ms: int
    #: The authenticated principal renewing; None means "take ``identity.principal``".
    principal: str | None = None
    #: What the attempt spent since its last report.
    cost: Cost = ()

    @property
    def caller(self) -> str | None:
        return self.principal if self.principal is not None else self.identity.principal


@dataclass(frozen=True, slots=True)
class CommitRequest:
    attempt_id: str
    claim_generation: int
    scheduler_epoch: int
    cancel_generation: int
    input_digest: str
    result_digest: str
    result_json: str | None = None
    #: The authenticated principal committing (None without ``[auth]``).
    principal: str | None = None
    #: What the attempt spent since its last report.
    cost: Cost = ()


def add_cost(total: Cost, more: Cost) -> Cost:
    """Per-unit sum, sorted by unit."""
    if not more:
        return total
    sums = dict(total)
    for unit, value in more:
        sums[unit] = sums.get(unit, 0.0) + value
    return tuple(sorted(sums.items()))


def cost_to_json(cost: Cost) -> str:
    return json.dumps(dict(cost), separators=(",", ":"), sort_keys=True)


def cost_from_json(text: str) -> Cost:
    """Inverse of ``cost_to_json``; numbers come back as floats (Lua writes ``3`` for 3.0)."""
    return tuple(sorted((str(k), float(v)) for k, v in json.loads(text).items()))


def _discard(task: Task, reason: str) -> Discard:
    assert task.attempt_id is not None
    return Discard(task.task_id, task.attempt_id, reason, task.attempt_cost)


def check_dependencies(
    task_id: str, depends_on: tuple[str, ...], deps: Mapping[str, Task | None]
) -> None:
    """Refuse a dependency list naming the task itself, a task that does not exist or a
    cancelled one (``deps``: the store's records of ``depends_on``). Cycles through other
    tasks are found by the walk (``ledger.task_graph.check_no_cycle``, which the stores
    mirror, at most ``MAX_GRAPH_VISITS``), which raises ``cycle``."""
    for dep in depends_on:
        if dep == task_id:
            raise BadRequest(f"dependsOn: {dep} is this task (a cycle)")
        found = deps.get(dep)
        if found is None:
            raise BadRequest(f"dependsOn: no task {dep}")
        if found.state is TaskState.CANCELLED:
            # It would wait for a commit that cannot come (a cancel's cascade has passed).
            raise BadRequest(f"dependsOn: {dep} is cancelled (revise it first)")


def cycle(task_id: str, through: str) -> BadRequest:
    return BadRequest(f"dependsOn: {through} depends on {task_id} (a cycle)")


def graph_too_large() -> BadRequest:
    return BadRequest(
        f"dependsOn: the dependency graph is too large to check (over {MAX_GRAPH_VISITS} tasks)"
    )


def _provenance(
    depends_on: tuple[str, ...], deps: Mapping[str, Task | None]
) -> tuple[DepCommit, ...]:
    out = []
    for dep in depends_on:
        found = deps.get(dep)
        if found is not None and found.state is TaskState.COMMITTED and found.commit is not None:
            out.append(DepCommit(dep, found.commit.commit_id, found.commit.result_digest))
    return tuple(out)


def _open_state(depends_on: tuple[str, ...], dep_commits: tuple[DepCommit, ...]) -> TaskState:
    return TaskState.READY if len(dep_commits) == len(depends_on) else TaskState.WAITING


def put(
    task: Task | None,
    task_id: str,
    input_digest: str,
    max_runtime_ms: int | None,
    now: int,
    *,
    queue: str | None = None,
    priority: int | None = None,
    depends_on: tuple[str, ...] | None = None,
    deps: Mapping[str, Task | None] | None = None,
    tombstone: Tombstone | None = None,
) -> tuple[Task, PutOutcome]:
    """Create a task, or open a new revision when its input changed.

    A new revision makes the task READY (or WAITING, for its dependencies) again even after a
    commit: the commit belonged to the old input. The running attempt keeps its identity in
    the record so that its commit answers STALE_INPUT (and FENCED once the new revision is
    claimed); it is discarded (superseded). ``queue``, ``priority``, ``depends_on`` None keep
    the task's (defaults on create); the same input changes nothing, whatever they say.
    ``deps``: the store's records of the dependencies the new revision will have (checked by
    ``check_dependencies``; the store has walked them for cycles). ``tombstone``: what is
    remembered of the task if it expired (``ledger.retention``): the same input is refused,
    a new one creates the task again at the next revision with its generations continuing.
    """
    if task is not None and task.input_digest == input_digest:
        return task, PutOutcome.UNCHANGED
    if task is None and tombstone is not None and tombstone.input_digest == input_digest:
        raise expired_task(tombstone)
    wanted = tuple(dict.fromkeys(depends_on)) if depends_on is not None else None
    if wanted is None:
        wanted = task.depends_on if task is not None else ()
    check_dependencies(task_id, wanted, deps or {})
    dep_commits = _provenance(wanted, deps or {})
    state = _open_state(wanted, dep_commits)
    if task is None:
        created = Task(
            task_id=task_id,
            state=state,
            revision=tombstone.revision + 1 if tombstone is not None else 1,
            claim_generation=tombstone.claim_generation if tombstone is not None else 0,
            cancel_generation=tombstone.cancel_generation if tombstone is not None else 0,
            input_digest=input_digest,
            max_runtime_ms=max_runtime_ms,
            created_at=now,
            updated_at=now,
            ready_at=now,
            queue=queue,
            priority=priority or 0,
            depends_on=wanted,
            dep_commits=dep_commits,
        )
        return created, PutOutcome.CREATED
    discarded = (_discard(task, "superseded"),) if task.state is TaskState.CLAIMED else ()
    revised = replace(
        task,
        state=state,
        revision=task.revision + 1,
        input_digest=input_digest,
        max_runtime_ms=max_runtime_ms if max_runtime_ms is not None else task.max_runtime_ms,
        commit=None,
        updated_at=now,
        ready_at=now,
        queue=queue if queue is not None else task.queue,
        priority=priority if priority is not None else task.priority,
        depends_on=wanted,
        dep_commits=dep_commits,
        attempt_cost=(),
        discarded=discarded,
    )
    return revised, PutOutcome.REVISED


def dependency_committed(dependent: Task, dep: Task, now: int) -> Task | None:
    """``dep`` just committed: record its commit in ``dependent``'s provenance; the last one
    makes a WAITING dependent READY. None when nothing changes."""
    if (
        dependent.state.value not in _OPEN
        or dep.commit is None
        or dep.task_id not in dependent.depends_on
        or any(c.task_id == dep.task_id for c in dependent.dep_commits)
    ):
        return None
    have = {c.task_id: c for c in dependent.dep_commits}
    have[dep.task_id] = DepCommit(dep.task_id, dep.commit.commit_id, dep.commit.result_digest)
    dep_commits = tuple(have[d] for d in dependent.depends_on if d in have)
    if dependent.state is TaskState.WAITING and len(dep_commits) == len(dependent.depends_on):
        return replace(
            dependent, state=TaskState.READY, dep_commits=dep_commits, ready_at=now, updated_at=now
        )
    return replace(dependent, dep_commits=dep_commits, updated_at=now)


def dependency_revised(dependent: Task, dep_id: str, now: int) -> Task | None:
    """A committed dependency has a new revision: a dependent that has not committed loses
    that provenance and waits again (a running attempt is discarded, superseded: it keeps its
    identity in the record and learns STALE_INPUT). None when nothing changes."""
    if dependent.state.value not in _OPEN or not any(
        c.task_id == dep_id for c in dependent.dep_commits
    ):
        return None
    discarded = (_discard(dependent, "superseded"),) if dependent.state is TaskState.CLAIMED else ()
    return replace(
        dependent,
        state=TaskState.WAITING,
        dep_commits=tuple(c for c in dependent.dep_commits if c.task_id != dep_id),
        attempt_cost=(),
        updated_at=now,
        discarded=discarded,
    )


def cancel_dependent(dependent: Task, now: int) -> Task | None:
    """A dependency was cancelled: a dependent that has not committed is cancelled too (and
    the store goes on to its dependents). None when nothing changes (committed, or already
    cancelled: the cascade stops there)."""
    if dependent.state.value not in _OPEN:
        return None
    return cancel(dependent, now)


def is_claimable(task: Task, scheduler: Scheduler, now: int) -> bool:
    """Would ``claim`` (without expectedRevision) grant this task now? READY, or CLAIMED under
    an older epoch or with its lease run out."""
    if task.state is TaskState.READY:
        return True
    return task.state is TaskState.CLAIMED and (
        task.claim_epoch != scheduler.epoch
        or task.lease_expires_at is None
        or now >= task.lease_expires_at
    )


def queue_order(task: Task) -> tuple[int, int, str]:
    """Highest priority first, then the longest READY, then task id."""
    return (-task.priority, task.ready_at if task.ready_at is not None else task.created_at,
            task.task_id)  # fmt: skip


def claim(
    task: Task | None,
    scheduler: Scheduler,
    request: ClaimRequest,
    policy: LeasePolicy,
    now: int,
    attempt_id: str,
) -> Task:
    if scheduler.claims_paused:
        raise ClaimsPaused("claims are paused by an operator; retry later")
    if task is None:
        raise NoSuchTask()
    if request.scheduler_epoch != scheduler.epoch:
        raise StaleEpoch(
            f"schedulerEpoch {request.scheduler_epoch} is not the current {scheduler.epoch}"
        )
    if request.expected_revision is not None and request.expected_revision != task.revision:
        raise StaleInput(
            f"expectedRevision {request.expected_revision} is not the current {task.revision}"
        )
    if task.state is TaskState.COMMITTED:
        raise AlreadyCommitted()
    if task.state is TaskState.CANCELLED:
        raise Cancelled()
    if task.state is TaskState.WAITING:
        done = {c.task_id for c in task.dep_commits}
        pending = [d for d in task.depends_on if d not in done]
        raise DependenciesPending(
            "waiting for dependencies: "
            + ", ".join(pending[:10])
            + (f" and {len(pending) - 10} more" if len(pending) > 10 else "")
        )
    if (
        task.state is TaskState.CLAIMED
        and task.claim_epoch == scheduler.epoch
        and task.lease_expires_at is not None
        and now < task.lease_expires_at
    ):
        raise Claimed(
            f"held until leaseExpiresAt {task.lease_expires_at}",
            leaseExpiresAt=task.lease_expires_at,
            retryAfterMs=task.lease_expires_at - now,
        )
    runtime = task.max_runtime_ms or policy.default_max_runtime_ms
    ttl = min(request.ttl_ms, policy.max_ttl_ms, runtime)
    taken_over = task.lease_expires_at if task.state is TaskState.CLAIMED else None
    discarded: tuple[Discard, ...] = ()
    if task.state is TaskState.CLAIMED:
        reason = "epoch" if task.claim_epoch != scheduler.epoch else "expired"
        discarded = (_discard(task, reason),)
    return replace(
        task,
        discarded=discarded,
        attempt_cost=(),
        previous_lease_expires_at=taken_over,
        state=TaskState.CLAIMED,
        claim_generation=task.claim_generation + 1,
        attempt_id=attempt_id,
        owner=request.owner,
        principal=request.principal or None,
        lease_expires_at=now + ttl,
        attempt_started_at=now,
        claim_epoch=scheduler.epoch,
        claim_revision=task.revision,
        updated_at=now,
    )


def claim_next(
    queue: str,
    candidates: Iterable[Task],
    scheduler: Scheduler,
    request: ClaimRequest,
    policy: LeasePolicy,
    now: int,
    attempt_id: str,
) -> Task | None:
    """Claim the best claimable task of ``queue`` among ``candidates`` (None when there is
    none). Paused claims and a stale epoch are refused even when the queue is empty, as a
    claim by id would refuse them."""
    if scheduler.claims_paused:
        raise ClaimsPaused("claims are paused by an operator; retry later")
    if request.scheduler_epoch != scheduler.epoch:
        raise StaleEpoch(
            f"schedulerEpoch {request.scheduler_epoch} is not the current {scheduler.epoch}"
        )
    open_ = [t for t in candidates if t.queue == queue and is_claimable(t, scheduler, now)]
    if not open_:
        return None
    best = min(open_, key=queue_order)
    return claim(best, scheduler, replace(request, expected_revision=None), policy, now, attempt_id)


def check_principal(task: Task, principal: str | None) -> None:
    """The lease is bound to its holder: when the caller is authenticated (``principal``) and
    the claim recorded the principal that made it, they must be the same, else ``FENCED``
    (the caller is not the claim's holder). The detail does not name the holder.

    Either side None (no ``[auth]``, or a claim made before it was turned on) checks nothing;
    an empty name counts as none, as in the Lua mirror (``check_holder`` in common.lua), where
    ``''`` is the absent principal.
    """
    if principal and task.principal and principal != task.principal:
        raise Fenced("the lease belongs to another principal")


def check_holder(
    task: Task | None,
    attempt_id: str,
    claim_generation: int,
    owner: str | None,
    cancel_generation: int,
    scheduler: Scheduler | None,
    scheduler_epoch: int,
    principal: str | None = None,
) -> Task:
    """The comparisons shared by renew, release and commit, in the documented order.

    ``scheduler`` None skips the epoch check (release); ``owner`` None skips the owner check
    (commit, whose contract carries no owner). ``principal`` is the caller's authenticated
    principal (``check_principal``), compared with the identity: a mismatch is ``FENCED``.
    """
    if task is None:
        raise NoSuchTask()
    if (
        task.attempt_id != attempt_id
        or task.claim_generation != claim_generation
        or (owner is not None and task.owner != owner)
    ):
        raise Fenced(
            f"attempt {attempt_id} generation {claim_generation} is not the current claim "
            f"(generation {task.claim_generation})"
        )
    check_principal(task, principal)
    if scheduler is not None and (
        scheduler_epoch != scheduler.epoch or task.claim_epoch != scheduler.epoch
    ):
        raise StaleEpoch(
            f"schedulerEpoch {scheduler_epoch} sent, claim made under {task.claim_epoch}, "
            f"current is {scheduler.epoch}"
        )
    if task.state is TaskState.CANCELLED or cancel_generation != task.cancel_generation:
        raise Cancelled(
            f"cancelGeneration {cancel_generation}, task has {task.cancel_generation}"
            + (" and is cancelled" if task.state is TaskState.CANCELLED else "")
        )
    if task.claim_revision != task.revision:
        raise StaleInput(
            f"claim was for revision {task.claim_revision}, the task is at {task.revision}"
        )
    if task.state in (TaskState.WAITING, TaskState.READY):
        # Only a dependency's new revision leaves a claim's identity on a WAITING (and later
        # READY) task: what the attempt built on is gone.
        raise StaleInput(
            "a dependency of this task has a new revision; claim it again when it is READY"
        )
    return task


def renew(
    task: Task | None,
    scheduler: Scheduler,
    request: RenewRequest,
    policy: LeasePolicy,
    now: int,
) -> Task:
    ident = request.identity
    task = check_holder(
        task,
        ident.attempt_id,
        ident.claim_generation,
        ident.owner,
        ident.cancel_generation,
        scheduler,
        ident.scheduler_epoch,
        request.caller,
    )
    if task.state is TaskState.COMMITTED:
        raise AlreadyCommitted()
    assert task.lease_expires_at is not None and task.attempt_started_at is not None
    if now >= task.lease_expires_at:
        raise LeaseExpired(
            f"lease expired at leaseExpiresAt {task.lease_expires_at}",
            leaseExpiresAt=task.lease_expires_at,
        )
    deadline = task.attempt_started_at + (task.max_runtime_ms or policy.default_max_runtime_ms)
    if task.lease_expires_at >= deadline:
        raise RuntimeExceeded(
            f"the attempt may not run past runtimeEndsAt {deadline}", runtimeEndsAt=deadline
        )
    expires = min(now + min(request.ttl_ms, policy.max_ttl_ms), deadline)
    return replace(
        task,
        lease_expires_at=expires,
        updated_at=now,
        attempt_cost=add_cost(task.attempt_cost, request.cost),
    )


def release(task: Task | None, identity: Identity, now: int) -> Task:
    task = check_holder(
        task,
        identity.attempt_id,
        identity.claim_generation,
        identity.owner,
        identity.cancel_generation,
        None,
        identity.scheduler_epoch,
        identity.principal,
    )
    if task.state is TaskState.COMMITTED:
        raise AlreadyCommitted()
    return replace(
        task,
        state=TaskState.READY,
        attempt_id=None,
        owner=None,
        principal=None,
        lease_expires_at=None,
        attempt_started_at=None,
        claim_epoch=None,
        claim_revision=None,
        attempt_cost=(),
        updated_at=now,
    )


def commit(
    task: Task | None,
    scheduler: Scheduler,
    request: CommitRequest,
    now: int,
    commit_id: str,
) -> tuple[Task, bool]:
    """Record the canonical result; returns the task and whether this was a replay.

    The same attempt committing the same resultDigest again gets the recorded commit back
    before any other check: the decision was already made, and a worker whose first answer was
    lost must be able to learn it even after an epoch bump. Only its holder learns it: the
    replay too is refused to another principal (``check_principal``; a committed task keeps
    the committing claim's principal).
    """
    previous = task.commit if task is not None else None
    if (
        task is not None
        and task.state is TaskState.COMMITTED
        and previous is not None
        and previous.attempt_id == request.attempt_id
        and previous.claim_generation == request.claim_generation
        and previous.result_digest == request.result_digest
    ):
        check_principal(task, request.principal)
        return task, True
    task = check_holder(
        task,
        request.attempt_id,
        request.claim_generation,
        None,
        request.cancel_generation,
        scheduler,
        request.scheduler_epoch,
        request.principal,
    )
    if request.input_digest != task.input_digest:
        raise StaleInput("inputDigest is not the task's current input")
    if task.state is TaskState.COMMITTED:
        raise AlreadyCommitted("this attempt already committed a different resultDigest")
    done = Commit(
        commit_id=commit_id,
        attempt_id=request.attempt_id,
        claim_generation=request.claim_generation,
        result_digest=request.result_digest,
        committed_at=now,
        result_json=request.result_json,
    )
    committed = replace(
        task,
        state=TaskState.COMMITTED,
        commit=done,
        updated_at=now,
        attempt_cost=add_cost(task.attempt_cost, request.cost),
    )
    return committed, False


def cancel(task: Task | None, now: int) -> Task:
    """Cancel until the next revision; cancelling a cancelled task changes nothing."""
    if task is None:
        raise NoSuchTask()
    if task.state is TaskState.COMMITTED:
        raise AlreadyCommitted("a committed task cannot be cancelled; revise it instead")
    if task.state is TaskState.CANCELLED:
        return task
    discarded = (_discard(task, "cancelled"),) if task.state is TaskState.CLAIMED else ()
    return replace(
        task,
        state=TaskState.CANCELLED,
        cancel_generation=task.cancel_generation + 1,
        updated_at=now,
        discarded=discarded,
    )


def bump_epoch(scheduler: Scheduler) -> Scheduler:
    return replace(scheduler, epoch=scheduler.epoch + 1)


def set_claims_paused(scheduler: Scheduler, paused: bool) -> Scheduler:
    return replace(scheduler, claims_paused=paused)


# --- representations -------------------------------------------------------------------------

_INT_FIELDS = (
    "ready_at",
    "previous_lease_expires_at",
    "revision",
    "created_at",
    "updated_at",
    "max_runtime_ms",
    "claim_generation",
    "cancel_generation",
    "lease_expires_at",
    "attempt_started_at",
    "claim_epoch",
    "claim_revision",
)
_STR_FIELDS = ("task_id", "input_digest", "attempt_id", "owner", "principal", "queue")


def task_to_fields(task: Task) -> dict[str, str]:
    """Flat string map, absent = None: the Redis hash and the SQLite row share it."""
    out: dict[str, str] = {"state": task.state.value}
    for name in _STR_FIELDS + _INT_FIELDS:
        value = getattr(task, name)
        if value is not None:
            out[name] = str(value)
    if task.commit is not None:
        c = task.commit
        out["commit_id"] = c.commit_id
        out["commit_attempt_id"] = c.attempt_id
        out["commit_generation"] = str(c.claim_generation)
        out["commit_result_digest"] = c.result_digest
        out["committed_at"] = str(c.committed_at)
        if c.result_json is not None:
            out["commit_result"] = c.result_json
    if task.priority:
        out["priority"] = str(task.priority)
    if task.depends_on:
        out["depends_on"] = json.dumps(list(task.depends_on), separators=(",", ":"))
    if task.dep_commits:
        out["dep_commits"] = json.dumps(
            [[c.task_id, c.commit_id, c.result_digest] for c in task.dep_commits],
            separators=(",", ":"),
        )
    if task.attempt_cost:
        out["attempt_cost"] = cost_to_json(task.attempt_cost)
    return out


def _discards_from(text: str) -> tuple[Discard, ...]:
    return tuple(
        Discard(str(t), str(a), str(r), tuple(sorted((str(k), float(v)) for k, v in c.items())))
        for t, a, r, c in json.loads(text)
    )


def task_from_fields(fields: dict[str, str]) -> Task:
    values: dict[str, Any] = {}
    for name in _STR_FIELDS:
        values[name] = fields.get(name)
    for name in _INT_FIELDS:
        raw = fields.get(name)
        values[name] = int(raw) if raw is not None else None
    for name in ("claim_generation", "cancel_generation"):
        values[name] = values[name] or 0
    done = None
    if "commit_id" in fields:
        done = Commit(
            commit_id=fields["commit_id"],
            attempt_id=fields["commit_attempt_id"],
            claim_generation=int(fields["commit_generation"]),
            result_digest=fields["commit_result_digest"],
            committed_at=int(fields["committed_at"]),
            result_json=fields.get("commit_result"),
        )
    return Task(
        state=TaskState(fields["state"]),
        commit=done,
        priority=int(fields.get("priority") or 0),
        depends_on=tuple(json.loads(fields["depends_on"])) if fields.get("depends_on") else (),
        dep_commits=tuple(
            DepCommit(str(t), str(c), str(r)) for t, c, r in json.loads(fields["dep_commits"])
        )
        if fields.get("dep_commits")
        else (),
        attempt_cost=cost_from_json(fields["attempt_cost"]) if fields.get("attempt_cost") else (),
        # Only in a Redis script's answer (never stored): the attempts that step discarded.
        discarded=_discards_from(fields["discarded"]) if fields.get("discarded") else (),
        **values,
    )
