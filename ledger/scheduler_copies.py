"""The scheduler record on the Redis Cluster store: one copy per bucket, bumped behind a barrier.

On one Redis (and on SQL) the scheduler is one record (``ledger.tasks.Scheduler``) that every
acceptance point reads in its own atomic step. On a cluster a step touches one bucket
(``ledger.buckets``), so each bucket keeps its own **copy** (``Copy``) and every acceptance
point (claim, renew, prepare, commit) reads its bucket's copy in the same script, exactly as it
reads the one record on one Redis: ``scheduler_of(copy)`` is that copy as the record the
unchanged ``ledger.tasks`` / ``ledger.effects`` functions take, so the epoch check and the
pause check are theirs, not a second text. What is new is only what spans the copies, decided
here as pure functions over copies and a store time (docs/decisions.md, "Issue 30: Redis
Cluster, the design", "The scheduler: a copy per bucket"):

- **Pause / resume** set ``paused`` (the operator's flag) on every copy: first bucket 0,
  which numbers the step (``begin_pause``: the next ``pause_generation``), then every other
  copy with that number (``with_paused``), where a later-numbered step wins. A pause is
  answered once every copy has it, so no claim is granted after the answer until a resume
  numbered after it reaches the bucket. Without the number, a pause and a resume that overlap
  could leave some copies paused and others not, both answered. ``claims_paused`` reads
  true when any copy is: a half-done pause or resume shows as paused, the safe side.
- **Bump**, the one multi-copy step that must look atomic, runs in five phases (``Phase``);
  each starts only once the one before it was applied to every bucket:

  1. ``INTENT``: ``begin_bump`` writes the intent (target ``bump_target`` of the copies)
     into bucket 0, if no intent is there (set-if-absent);
  2. ``BARRIER``: ``with_barrier`` on every copy. A claim that meets a barrier is answered
     ``Barrier`` (``claim_admission``): the gateway retries it within the request's timeout,
     it is never answered CLAIMS_PAUSED. Renew, prepare and commit are untouched: they are
     checked against the copy's epoch, which has not moved yet;
  3. ``EPOCH``: ``bumped`` on every copy (``epoch = max(epoch, target)``);
  4. ``CLEAR``: ``without_barrier`` on every copy (only its own target's barrier);
  5. ``DONE``: ``end_bump`` clears the intent (only its own) and the bump is answered.

  Between 2 and 4 no claim is granted anywhere, so no worker holds a claim under the new epoch
  while another bucket still grants the old one; once answered, every copy is at the target,
  so no acceptance point anywhere passes under an epoch the bump retired. No phase reads or
  writes ``paused``: pause, bump, settle, resume (the rollback runbook) keeps claims paused.
- **A coordinator that dies midway** leaves its intent. Every step is idempotent (``max``,
  set-if-absent, clear-only-your-own), so any number of finishers may run the phases again, in
  order, concurrently with each other and with a stale coordinator that wakes up: the next
  bump (``bump_answers``: it finishes a leftover intent, then makes its own) or a sweep once
  the intent is past its deadline (``intent_abandoned``). A barrier past its deadline no longer
  holds claims (a lost coordinator cannot stop the fleet). **Then, and only then**, buckets
  may grant claims under different epochs: each under its own copy's, none under an epoch
  below a completed bump's target, until a finisher re-arms the barriers.

The Lua scripts mirror these functions (the claim's admission, the epoch check through the
``ledger.tasks`` functions); ``tests/test_scheduler_copies.py`` holds the protocol to its
invariants on random interleavings of coordinators, sweeps, crashes, claims, renews,
prepares, commits, pauses and store time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum

from fencegate.ledger.tasks import Scheduler

__all__ = [
    "BARRIER_MS",
    "Admission",
    "Admit",
    "Barrier",
    "Copy",
    "Intent",
    "Paused",
    "Phase",
    "barrier_holds",
    "begin_bump",
    "begin_pause",
    "bump_answers",
    "bump_target",
    "bumped",
    "claim_admission",
    "claims_paused",
    "current_epoch",
    "end_bump",
    "intent_abandoned",
    "scheduler_of",
    "with_barrier",
    "with_paused",
    "without_barrier",
]

#: How long a barrier holds claims back, in store time: long enough for a live coordinator to
#: walk every bucket, short enough that a lost one does not stop the fleet.
BARRIER_MS = 10_000


@dataclass(frozen=True, slots=True)
class Copy:
    """One bucket's copy of the scheduler record.

    ``paused`` is the operator's flag and nothing else's; ``pause_generation`` numbers the
    pause or resume that set it (``begin_pause``). ``barrier_target`` / ``barrier_until_ms``:
    a bump in progress toward that epoch holds claims back until that store time; both None
    when no bump is in progress (never one without the other)."""

    epoch: int = 1
    paused: bool = False
    barrier_target: int | None = None
    barrier_until_ms: int | None = None
    pause_generation: int = 0


@dataclass(frozen=True, slots=True)
class Intent:
    """A bump in progress, kept in bucket 0: the epoch it moves every copy to, and the store
    time after which a sweep may take it to its end (its coordinator is presumed lost)."""

    target: int
    deadline_ms: int


class Phase(StrEnum):
    """The bump's phases, in order; each applies to every bucket (``INTENT`` and ``DONE``:
    bucket 0 only) before the next starts. A finisher runs them again from ``BARRIER``."""

    INTENT = "INTENT"
    BARRIER = "BARRIER"
    EPOCH = "EPOCH"
    CLEAR = "CLEAR"
    DONE = "DONE"


# --- a claim meets its bucket's copy -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admit:
    """Go on with the claim: ``ledger.tasks.claim`` (or ``claim_next``) with ``scheduler``."""

    scheduler: Scheduler


@dataclass(frozen=True, slots=True)
class Barrier:
    """A bump is in progress: not an answer to the caller. The gateway retries the claim with
    backoff within the request's timeout; ``retry_after_ms`` is when the barrier stops
    holding claims at the latest."""

    target: int
    retry_after_ms: int


@dataclass(frozen=True, slots=True)
class Paused:
    """The operator paused claims: ``ledger.tasks.claim`` with ``scheduler`` answers
    CLAIMS_PAUSED (its words, not a copy of them)."""

    scheduler: Scheduler


Admission = Admit | Barrier | Paused


def scheduler_of(copy: Copy) -> Scheduler:
    """The copy as the one-record scheduler ``ledger.tasks`` and ``ledger.effects`` take: the
    epoch check of every acceptance point (``tasks.claim``, ``claim_next``, ``check_holder``
    for renew, release and commit, ``effects.check_fence`` for prepare) and the pause check of
    a claim are made against the bucket's own copy, by those functions, unchanged."""
    return Scheduler(epoch=copy.epoch, claims_paused=copy.paused)


def barrier_holds(copy: Copy, now_ms: int) -> bool:
    """Does the copy's barrier hold claims back at ``now_ms``? Not once past its deadline."""
    return copy.barrier_until_ms is not None and now_ms < copy.barrier_until_ms


def claim_admission(copy: Copy, now_ms: int) -> Admission:
    """What a claim (by id or from a queue) meets in its bucket, before the task is read.

    The operator's pause comes first: it is the answer the caller can act on, and only it is
    answered CLAIMS_PAUSED. Then a barrier that still holds (``Barrier``: retried inside the
    gateway). Otherwise the claim goes on against the copy."""
    if copy.paused:
        return Paused(scheduler_of(copy))
    if barrier_holds(copy, now_ms):
        assert copy.barrier_target is not None and copy.barrier_until_ms is not None
        return Barrier(copy.barrier_target, copy.barrier_until_ms - now_ms)
    return Admit(scheduler_of(copy))


# --- pause and resume --------------------------------------------------------------------------


def begin_pause(bucket0: Copy, paused: bool) -> Copy:
    """An operator's pause (or resume), first step, in bucket 0's script: bucket 0's copy with
    the next ``pause_generation`` and ``paused``. That generation is the step's number, with
    which it goes on to every other copy (``with_paused``)."""
    return replace(bucket0, paused=paused, pause_generation=bucket0.pause_generation + 1)


def with_paused(copy: Copy, paused: bool, generation: int) -> Copy:
    """The pause (or resume) numbered ``generation`` on one copy: applied unless the copy
    already has a later one (which then wins, as it would on one record). Again with the same
    number it changes nothing."""
    if generation < copy.pause_generation:
        return copy
    return replace(copy, paused=paused, pause_generation=generation)


# --- the bump, step by step (every step idempotent) --------------------------------------------


def bump_target(copies: Iterable[Copy]) -> int:
    """The epoch a new bump moves every copy to: one past the highest copy. When no intent is
    left, every copy is at the same epoch (a bump clears its intent only once every copy has
    its target), so this is the one-Redis ``epoch + 1``; the max is what keeps it right
    after a coordinator was lost midway."""
    epochs = [c.epoch for c in copies]
    if not epochs:
        raise ValueError("a store has at least one bucket")
    return max(epochs) + 1


def begin_bump(intent: Intent | None, bucket0: Copy, target: int, deadline_ms: int) -> Intent:
    """Phase 1, in bucket 0's script: the intent there if there is one (set-if-absent), else a
    new one toward ``target`` (``bump_target`` of the copies the coordinator read), raised
    past bucket 0's own epoch in case a bump completed since that read."""
    if intent is not None:
        return intent
    return Intent(max(target, bucket0.epoch + 1), deadline_ms)


def with_barrier(copy: Copy, target: int, until_ms: int) -> Copy:
    """Phase 2 on one copy: hold claims back for the bump toward ``target`` until
    ``until_ms``. Again for the same target it keeps the later deadline (a finisher re-arms
    the barriers of a lost coordinator). A copy already past ``target`` (a later bump moved
    it) or holding a later bump's barrier is left as it is: a stale coordinator cannot hold
    claims back for a bump that is over."""
    if copy.epoch > target:
        return copy
    if copy.barrier_target is not None and copy.barrier_target > target:
        return copy
    if copy.barrier_target == target and copy.barrier_until_ms is not None:
        until_ms = max(until_ms, copy.barrier_until_ms)
    return replace(copy, barrier_target=target, barrier_until_ms=until_ms)


def bumped(copy: Copy, target: int) -> Copy:
    """Phase 3 on one copy: its epoch becomes at least ``target``; it never goes down."""
    return replace(copy, epoch=max(copy.epoch, target))


def without_barrier(copy: Copy, target: int) -> Copy:
    """Phase 4 on one copy: clear the barrier of the bump toward ``target``, and only that
    one: a stale coordinator never lifts a later bump's barrier."""
    if copy.barrier_target != target:
        return copy
    return replace(copy, barrier_target=None, barrier_until_ms=None)


def end_bump(intent: Intent | None, target: int) -> Intent | None:
    """Phase 5, in bucket 0's script: clear the intent toward ``target``, and only that one
    (a later bump's intent stays)."""
    if intent is not None and intent.target == target:
        return None
    return intent


def bump_answers(intent: Intent, wanted: int) -> bool:
    """Having finished ``intent``, may a bump that wanted ``wanted`` (its ``bump_target``)
    answer it? Yes when it reaches that far: it then retires every epoch a claim could have
    been granted under when the bump read the copies. No when it was a lost coordinator's
    leftover below that: the bump has only finished it, and now begins its own."""
    return intent.target >= wanted


def intent_abandoned(intent: Intent | None, now_ms: int) -> bool:
    """Is there an intent a sweep should finish? One past its deadline: its coordinator is
    presumed lost (finishing it beside a live one is safe, only needless)."""
    return intent is not None and now_ms >= intent.deadline_ms


# --- the store-wide reads ----------------------------------------------------------------------


def claims_paused(copies: Iterable[Copy]) -> bool:
    """``claimsPaused``: true when any copy is paused (a half-done pause or resume reads
    paused)."""
    return any(c.paused for c in copies)


def current_epoch(copies: Iterable[Copy]) -> int:
    """``GET /v1/epoch``: the highest copy's epoch. Copies differ only while a bump is in
    progress; its target is then the epoch every claim will need once it is answered, and
    no claim is granted under a lower one meanwhile unless its coordinator was lost."""
    epochs = [c.epoch for c in copies]
    if not epochs:
        raise ValueError("a store has at least one bucket")
    return max(epochs)
