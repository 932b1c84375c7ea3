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
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from fencegate.ledger.errors import (
    AlreadyCommitted,
    Cancelled,
    Claimed,
    ClaimsPaused,
    Fenced,
    LeaseExpired,
    NoSuchTask,
    RuntimeExceeded,
    StaleEpoch,
    StaleInput,
)

__all__ = [
    "ClaimRequest",
    "Commit",
    "CommitRequest",
    "Identity",
    "LeasePolicy",
    "PutOutcome",
    "RenewRequest",
    "Scheduler",
    "Task",
    "TaskState",
    "bump_epoch",
    "cancel",
    "check_holder",
    "check_principal",
    "claim",
    "commit",
    "put",
    "release",
    "renew",
    "set_claims_paused",
    "task_from_fields",
    "task_to_fields",
    "task_to_json",
]


class TaskState(StrEnum):
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


def put(
    task: Task | None, task_id: str, input_digest: str, max_runtime_ms: int | None, now: int
) -> tuple[Task, PutOutcome]:
    """Create a task, or open a new revision when its input changed.

    A new revision makes the task READY again even after a commit: the commit belonged to the
    old input. The running attempt keeps its identity in the record so that its commit answers
    STALE_INPUT (and FENCED once the new revision is claimed).
    """
    if task is None:
        created = Task(
            task_id=task_id,
            state=TaskState.READY,
            revision=1,
            input_digest=input_digest,
            max_runtime_ms=max_runtime_ms,
            created_at=now,
            updated_at=now,
            ready_at=now,
        )
        return created, PutOutcome.CREATED
    if task.input_digest == input_digest:
        return task, PutOutcome.UNCHANGED
    revised = replace(
        task,
        state=TaskState.READY,
        revision=task.revision + 1,
        input_digest=input_digest,
        max_runtime_ms=max_runtime_ms if max_runtime_ms is not None else task.max_runtime_ms,
        commit=None,
        updated_at=now,
        ready_at=now,
    )
    return revised, PutOutcome.REVISED


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
    return replace(
        task,
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
            f"claim made under schedulerEpoch {task.claim_epoch}, current is {scheduler.epoch}"
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
    return replace(task, lease_expires_at=expires, updated_at=now)


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
    return replace(task, state=TaskState.COMMITTED, commit=done, updated_at=now), False


def cancel(task: Task | None, now: int) -> Task:
    """Cancel until the next revision; cancelling a cancelled task changes nothing."""
    if task is None:
        raise NoSuchTask()
    if task.state is TaskState.COMMITTED:
        raise AlreadyCommitted("a committed task cannot be cancelled; revise it instead")
    if task.state is TaskState.CANCELLED:
        return task
    return replace(
        task,
        state=TaskState.CANCELLED,
        cancel_generation=task.cancel_generation + 1,
        updated_at=now,
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
_STR_FIELDS = ("task_id", "input_digest", "attempt_id", "owner", "principal")


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
    return out


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
    return Task(state=TaskState(fields["state"]), commit=done, **values)


def task_to_json(task: Task) -> dict[str, Any]:
    """The task record of the wire contract (``GET /v1/tasks/{id}``).

    ``schedulerEpoch`` is the epoch the current claim was granted under (null before the
    first claim); the global epoch is ``GET /v1/epoch``.
    """
    done: dict[str, Any] | None = None
    if task.commit is not None:
        c = task.commit
        done = {
            "commitId": c.commit_id,
            "attemptId": c.attempt_id,
            "claimGeneration": c.claim_generation,
            "resultDigest": c.result_digest,
            "committedAt": c.committed_at,
        }
        if c.result_json is not None:
            done["result"] = json.loads(c.result_json)
    return {
        "taskId": task.task_id,
        "state": task.state.value,
        "revision": task.revision,
        "inputDigest": task.input_digest,
        "maxRuntimeMs": task.max_runtime_ms,
        "claimGeneration": task.claim_generation,
        "attemptId": task.attempt_id,
        "owner": task.owner,
        "principal": task.principal,
        "leaseExpiresAt": task.lease_expires_at,
        "attemptStartedAt": task.attempt_started_at,
        "cancelGeneration": task.cancel_generation,
        "schedulerEpoch": task.claim_epoch,
        "commit": done,
        "createdAt": task.created_at,
        "updatedAt": task.updated_at,
    }
