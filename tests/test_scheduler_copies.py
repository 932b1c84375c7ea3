"""``ledger.scheduler_copies``: the scheduler as a copy per bucket, bumped behind a barrier.

The example tests name each rule. The model test (``CopiesMachine``) runs the protocol as the
cluster store will: several buckets, each with a task that workers claim, renew, prepare
under and commit through the unchanged ``ledger.tasks`` / ``ledger.effects`` functions fed
with their bucket's copy (``scheduler_of``); bump coordinators whose single-bucket steps
interleave arbitrarily with all of that and with each other; operators pausing and resuming;
coordinators that crash midway, after which a sweep (once the intent's deadline passed) or
the next bump finishes the intent; store time moving. Its invariants:

(a) once a bump has completed (all five phases), no acceptance point in any bucket passes
    under an epoch below its target;
(b) while the copies differ (a bump is between its EPOCH phase's first and last bucket), no
    claim is granted in any bucket, unless that bucket's barrier has passed its deadline (its
    coordinator is late or lost). Then, precisely: the bucket grants under its own copy's
    epoch (the old one or the target), never below a completed bump's target (a), every copy
    still carries the unfinished bump's barrier, and once a finisher re-arms it (a sweep, the
    next bump) no claim is granted again until every copy reached the target;
(c) a bump never changes any copy's ``paused``: after a pause is answered, every claim is
    answered CLAIMS_PAUSED (by ``ledger.tasks.claim``) until a resume numbered after it
    reaches the bucket, bumps or not;
(d) each copy's epoch only grows.

``test_the_model_catches_claims_that_ignore_the_barrier`` runs the same machine with a broken
admission (claims ignore the barrier) and expects (b) to fail: the invariant has teeth.

Deterministic: ``derandomize=True`` and no example database, so every run tries the same
histories (store time is the model's own; nothing reads a clock).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import Phase as Search
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from fencegate.ledger import buckets, effects, tasks
from fencegate.ledger import scheduler_copies as sc
from fencegate.ledger.errors import ClaimsPaused, FencegateError
from fencegate.ledger.scheduler_copies import (
    BARRIER_MS,
    Admission,
    Admit,
    Barrier,
    Copy,
    Intent,
    Paused,
    Phase,
)
from fencegate.ledger.tasks import ClaimRequest, CommitRequest, Identity, LeasePolicy, Task

NOW = 1_800_000_000_000
BUCKETS = 3
POLICY = LeasePolicy(max_ttl_ms=6 * BARRIER_MS, default_max_runtime_ms=10**12)


def _ids_in_distinct_buckets(count: int) -> tuple[str, ...]:
    """One task id per bucket (``group-<n>::job``), found with ``ledger.buckets``."""
    found: dict[int, str] = {}
    n = 0
    while len(found) < count:
        task_id = f"group-{n}::job"
        found.setdefault(buckets.bucket_of_task(task_id, count), task_id)
        n += 1
    return tuple(found[b] for b in range(count))


TASK_IDS = _ids_in_distinct_buckets(BUCKETS)


# --- example tests: one rule each ----------------------------------------------------------------


def test_a_claim_meets_the_operators_pause_first_then_a_live_barrier() -> None:
    plain = Copy(epoch=3)
    assert sc.claim_admission(plain, NOW) == Admit(tasks.Scheduler(epoch=3))
    barred = sc.with_barrier(plain, 4, NOW + 10)
    assert sc.claim_admission(barred, NOW) == Barrier(target=4, retry_after_ms=10)
    paused = sc.with_paused(barred, True, 1)
    assert isinstance(sc.claim_admission(paused, NOW), Paused)


def test_only_the_operators_pause_answers_claims_paused() -> None:
    """A barrier is retried inside the gateway; ``tasks.claim`` with the copy as its scheduler
    answers CLAIMS_PAUSED only for the operator's flag."""
    barred = sc.with_barrier(Copy(), 2, NOW + 10)
    assert not sc.scheduler_of(barred).claims_paused
    admission = sc.claim_admission(sc.with_paused(Copy(), True, 1), NOW)
    assert isinstance(admission, Paused)
    with pytest.raises(ClaimsPaused, match="claims are paused by an operator"):
        tasks.claim(None, admission.scheduler, ClaimRequest("w", 1000, 1), POLICY, NOW, "a1")


def test_a_barrier_past_its_deadline_no_longer_holds_claims() -> None:
    barred = sc.with_barrier(Copy(), 2, NOW + 10)
    assert isinstance(sc.claim_admission(barred, NOW + 9), Barrier)
    assert sc.claim_admission(barred, NOW + 10) == Admit(tasks.Scheduler(epoch=1))


def test_every_acceptance_point_checks_its_own_copys_epoch_with_ledger_tasks() -> None:
    ready = Task("t", tasks.TaskState.READY, 1, "in", NOW, NOW)
    old, new = Copy(epoch=1), Copy(epoch=2)
    held = tasks.claim(ready, sc.scheduler_of(old), ClaimRequest("w", 60_000, 1), POLICY, NOW, "a")
    fence = effects.Fence("t", "a", 1, 1, 0)
    effects.check_fence(held, sc.scheduler_of(old), fence, NOW)
    with pytest.raises(FencegateError, match="current is 2") as refused:
        effects.check_fence(held, sc.scheduler_of(new), fence, NOW)
    assert refused.value.code == "STALE_EPOCH"


def test_a_bump_target_is_one_past_the_highest_copy() -> None:
    assert sc.bump_target([Copy(epoch=4), Copy(epoch=5), Copy(epoch=4)]) == 6
    with pytest.raises(ValueError):
        sc.bump_target([])


def test_begin_bump_is_set_if_absent_and_never_below_bucket_0() -> None:
    first = sc.begin_bump(None, Copy(epoch=4), 5, NOW)
    assert first == Intent(5, NOW)
    assert sc.begin_bump(first, Copy(epoch=4), 9, NOW + 1) is first  # an intent stays
    # A read of the copies older than a completed bump: bucket 0 says where the store is.
    assert sc.begin_bump(None, Copy(epoch=7), 5, NOW).target == 8


def test_a_barrier_is_its_own_bumps_and_re_arming_keeps_the_later_deadline() -> None:
    barred = sc.with_barrier(Copy(epoch=4), 5, NOW + 10)
    assert sc.with_barrier(barred, 5, NOW + 5) == barred  # idempotent, deadline kept
    assert sc.with_barrier(barred, 5, NOW + 20).barrier_until_ms == NOW + 20  # re-armed
    assert sc.with_barrier(barred, 4, NOW + 99) == barred  # an older bump's: ignored
    assert sc.with_barrier(barred, 6, NOW + 30).barrier_target == 6  # a later bump's: taken
    assert sc.with_barrier(Copy(epoch=6), 5, NOW + 10) == Copy(epoch=6)  # that bump is over
    assert sc.without_barrier(barred, 4) == barred  # clears only its own target
    assert sc.without_barrier(barred, 5) == Copy(epoch=4)
    assert sc.without_barrier(sc.without_barrier(barred, 5), 5) == Copy(epoch=4)


def test_bumped_is_a_max() -> None:
    assert sc.bumped(Copy(epoch=4), 5) == Copy(epoch=5)
    assert sc.bumped(sc.bumped(Copy(epoch=4), 5), 5) == Copy(epoch=5)
    assert sc.bumped(Copy(epoch=7), 5) == Copy(epoch=7)


def test_end_bump_clears_only_its_own_intent() -> None:
    assert sc.end_bump(Intent(5, NOW), 5) is None
    assert sc.end_bump(Intent(6, NOW), 5) == Intent(6, NOW)
    assert sc.end_bump(None, 5) is None


def test_a_bump_that_met_a_leftover_answers_only_once_past_what_it_read() -> None:
    assert sc.bump_answers(Intent(5, NOW), wanted=5)
    assert not sc.bump_answers(Intent(5, NOW), wanted=6)  # a leftover: finish it, then bump


def test_a_sweep_finishes_an_intent_only_past_its_deadline() -> None:
    assert not sc.intent_abandoned(None, NOW)
    assert not sc.intent_abandoned(Intent(5, NOW + 1), NOW)
    assert sc.intent_abandoned(Intent(5, NOW + 1), NOW + 1)


def test_no_bump_step_reads_or_writes_paused() -> None:
    for paused in (False, True):
        copy = Copy(epoch=4, paused=paused, pause_generation=3)
        for step in (
            lambda c: sc.with_barrier(c, 5, NOW + 10),
            lambda c: sc.bumped(c, 5),
            lambda c: sc.without_barrier(c, 5),
        ):
            after = step(copy)
            assert (after.paused, after.pause_generation) == (paused, 3)
            copy = after


def test_pause_bump_resume_keeps_claims_paused_through_the_bump() -> None:
    """The rollback runbook: pause, bump, settle, check: still CLAIMS_PAUSED everywhere."""
    copies = [Copy() for _ in range(BUCKETS)]
    copies[0] = sc.begin_pause(copies[0], True)
    generation = copies[0].pause_generation
    copies = [sc.with_paused(c, True, generation) for c in copies]
    intent = sc.begin_bump(None, copies[0], sc.bump_target(copies), NOW + BARRIER_MS)
    copies = [sc.with_barrier(c, intent.target, NOW + BARRIER_MS) for c in copies]
    assert all(isinstance(sc.claim_admission(c, NOW), Paused) for c in copies)
    copies = [sc.without_barrier(sc.bumped(c, intent.target), intent.target) for c in copies]
    assert sc.end_bump(intent, intent.target) is None
    assert sc.claims_paused(copies) and sc.current_epoch(copies) == 2
    assert all(isinstance(sc.claim_admission(c, NOW), Paused) for c in copies)


def test_a_lost_coordinator_lets_buckets_grant_under_their_own_epochs_until_re_armed() -> None:
    """What holds when a bump's coordinator dies between its EPOCH phase's buckets: once the
    barriers pass their deadline each bucket grants under its own copy's epoch; a sweep
    re-arms the barriers (no claim anywhere), finishes, and the copies agree again."""
    copies = [Copy(epoch=4), Copy(epoch=4)]
    intent = sc.begin_bump(None, copies[0], sc.bump_target(copies), NOW + BARRIER_MS)
    copies = [sc.with_barrier(c, intent.target, NOW + BARRIER_MS) for c in copies]
    copies[0] = sc.bumped(copies[0], intent.target)  # ... and the coordinator is lost
    assert [type(sc.claim_admission(c, NOW)) for c in copies] == [Barrier, Barrier]
    later = NOW + BARRIER_MS
    assert [sc.claim_admission(c, later) for c in copies] == [
        Admit(tasks.Scheduler(epoch=5)),
        Admit(tasks.Scheduler(epoch=4)),
    ]
    assert sc.intent_abandoned(intent, later)  # the sweep takes it over
    copies = [sc.with_barrier(c, intent.target, later + BARRIER_MS) for c in copies]
    assert [type(sc.claim_admission(c, later)) for c in copies] == [Barrier, Barrier]
    copies = [sc.without_barrier(sc.bumped(c, intent.target), intent.target) for c in copies]
    assert sc.end_bump(intent, intent.target) is None
    assert copies == [Copy(epoch=5), Copy(epoch=5)]


def test_a_later_numbered_pause_or_resume_wins_on_every_copy() -> None:
    """A pause and a resume that overlap end the same on every copy: the later-numbered."""
    copies = [Copy() for _ in range(2)]
    copies[0] = sc.begin_pause(copies[0], True)  # the pause: generation 1
    copies[0] = sc.begin_pause(copies[0], False)  # the resume, numbered after it: 2
    copies[1] = sc.with_paused(copies[1], False, 2)
    copies[1] = sc.with_paused(copies[1], True, 1)  # the pause arrives late: too late
    assert [c.paused for c in copies] == [False, False]


def test_claims_paused_reads_any_copy_and_the_epoch_reads_the_highest() -> None:
    copies = [Copy(epoch=4), Copy(epoch=5, paused=True), Copy(epoch=4)]
    assert sc.claims_paused(copies)
    assert not sc.claims_paused([Copy(), Copy()])
    assert sc.current_epoch(copies) == 5


# --- the model test ----------------------------------------------------------------------------


AdmissionFn = Callable[[Copy, int], Admission]


def ignores_barrier(copy: Copy, now_ms: int) -> Admission:
    """A broken admission: claims ignore the barrier (what (b) must catch)."""
    view = sc.scheduler_of(copy)
    return Paused(view) if copy.paused else Admit(view)


@dataclass
class Actor:
    """One coordinator (``bump``, ``sweep``) or operator step (``pause``, ``resume``) in
    flight: which phase it is in and the buckets that phase has still to visit."""

    kind: str
    phase: str
    pending: list[int] = field(default_factory=list)
    #: bump: its ``bump_target`` read (0 before the read), and the highest epoch when asked.
    wanted: int = 0
    asked_at: int = 0
    #: bump, sweep: the intent it works on; pause, resume: its generation.
    intent: Intent | None = None
    generation: int = 0


@dataclass
class Holder:
    """A worker's claim: what it presents to renew, prepare and commit."""

    bucket: int
    attempt_id: str
    generation: int
    epoch: int
    cancel_generation: int


PER_BUCKET = (Phase.BARRIER, Phase.EPOCH, Phase.CLEAR)
NEXT_PHASE = {
    Phase.BARRIER: Phase.EPOCH,
    Phase.EPOCH: Phase.CLEAR,
    Phase.CLEAR: Phase.DONE,
}


class CopiesMachine(RuleBasedStateMachine):
    """The bucket copies under concurrent bumps, sweeps, crashes, pauses and workers."""

    admission: ClassVar[AdmissionFn] = staticmethod(sc.claim_admission)

    def __init__(self) -> None:
        super().__init__()
        self.now = NOW
        self.copies = [Copy() for _ in range(BUCKETS)]
        self.intent: Intent | None = None
        self.actors: list[Actor] = []
        self.tasks = [Task(t, tasks.TaskState.READY, 1, "in-1", NOW, NOW) for t in TASK_IDS]
        self.holders: list[Holder] = []
        #: The highest target of a bump that completed all five phases: (a)'s bar.
        self.completed = 0
        #: Generations of answered pauses.
        self.answered_pauses: list[int] = []
        self.seen_epochs = [c.epoch for c in self.copies]
        self.attempts = 0
        #: The test's own account of the barriers: per bucket, the latest bump that armed
        #: one there and the latest deadline any of its steps gave it.
        self.armed: dict[int, tuple[int, int]] = {}

    # --- coordinators and operators ----------------------------------------------------------

    @precondition(lambda self: sum(a.kind in ("bump", "sweep") for a in self.actors) < 3)
    @rule()
    def start_bump(self) -> None:
        self.actors.append(Actor("bump", "read", asked_at=sc.current_epoch(self.copies)))

    @precondition(lambda self: sc.intent_abandoned(self.intent, self.now))
    @rule()
    def start_sweep(self) -> None:
        assert self.intent is not None
        self.actors.append(Actor("sweep", Phase.BARRIER, list(range(BUCKETS)), intent=self.intent))

    @precondition(lambda self: len(self.actors) < 6)
    @rule(paused=st.sampled_from([True, False, False]))
    def start_pause(self, paused: bool) -> None:
        self.copies[0] = sc.begin_pause(self.copies[0], paused)
        generation = self.copies[0].pause_generation
        self.actors.append(
            Actor(
                "pause" if paused else "resume",
                "paused",
                list(range(1, BUCKETS)),
                generation=generation,
            )
        )
        self.finish_pause_if_done(self.actors[-1])

    @precondition(lambda self: self.actors)
    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        """An actor stops for good midway (its gateway was killed)."""
        lost = self.actors.pop(data.draw(st.integers(0, len(self.actors) - 1), label="actor"))
        event(f"crash {lost.kind} in {lost.phase}")

    @precondition(lambda self: self.actors)
    @rule(data=st.data(), steps=st.sampled_from([1, 1, 2, 3, 5, 12]))
    def run(self, data: st.DataObject, steps: int) -> None:
        """Actors take ``steps`` single-bucket steps (one script each), in any order among
        them; other rules (claims, time, crashes, ...) interleave between runs."""
        for _ in range(steps):
            if not self.actors:
                return
            self.step(data)
            self.check_copies()

    def step(self, data: st.DataObject) -> None:
        actor = self.actors[data.draw(st.integers(0, len(self.actors) - 1), label="actor")]
        bucket = 0
        if actor.pending:
            bucket = actor.pending.pop(data.draw(st.integers(0, len(actor.pending) - 1)))
        if actor.kind in ("pause", "resume"):
            before = self.copies[bucket]
            after = sc.with_paused(before, actor.kind == "pause", actor.generation)
            assert (after.epoch, after.barrier_target) == (before.epoch, before.barrier_target)
            self.copies[bucket] = after
            self.finish_pause_if_done(actor)
            return
        if actor.phase == "read":
            actor.wanted = sc.bump_target(self.copies)
            actor.phase = Phase.INTENT
        elif actor.phase == Phase.INTENT:
            self.intent = sc.begin_bump(
                self.intent, self.copies[0], actor.wanted, self.now + BARRIER_MS
            )
            actor.intent = self.intent
            actor.phase, actor.pending = Phase.BARRIER, list(range(BUCKETS))
        elif actor.phase in PER_BUCKET:
            self.bump_step(actor, bucket)
        else:
            self.done(actor)

    def bump_step(self, actor: Actor, bucket: int) -> None:
        assert actor.intent is not None
        target = actor.intent.target
        before = self.copies[bucket]
        if actor.phase == Phase.BARRIER:
            after = sc.with_barrier(before, target, self.now + BARRIER_MS)
            armed = self.armed.get(bucket)
            if armed is None or armed[0] < target:
                self.armed[bucket] = (target, self.now + BARRIER_MS)
            elif armed[0] == target:
                self.armed[bucket] = (target, max(armed[1], self.now + BARRIER_MS))
        elif actor.phase == Phase.EPOCH:
            after = sc.bumped(before, target)
        else:
            after = sc.without_barrier(before, target)
        # (c) a bump never reads or writes the operator's flag.
        same = (after.paused, after.pause_generation) == (before.paused, before.pause_generation)
        assert same, "(c) a bump step changed the operator's flag"
        self.copies[bucket] = after
        if not actor.pending:
            actor.phase = NEXT_PHASE[Phase(actor.phase)]
            actor.pending = list(range(BUCKETS)) if actor.phase in PER_BUCKET else []

    def done(self, actor: Actor) -> None:
        assert actor.intent is not None
        target = actor.intent.target
        self.intent = sc.end_bump(self.intent, target)
        # Its CLEAR phase followed its EPOCH phase on every bucket: all at the target.
        assert all(c.epoch >= target for c in self.copies), "(a) completed below its target"
        self.completed = max(self.completed, target)
        if actor.kind == "bump" and not sc.bump_answers(actor.intent, actor.wanted):
            event("bump finished a leftover first")
            actor.phase, actor.intent = "read", None
            return
        if actor.kind == "bump":
            # One Redis's contract: the answer retires every epoch current when it was asked.
            assert target > actor.asked_at, (
                "a bump answered an epoch of when it was asked",
                target,
                actor.asked_at,
            )
            event("bump answered")
        self.actors.remove(actor)

    def finish_pause_if_done(self, actor: Actor) -> None:
        if actor.pending:
            return
        self.actors.remove(actor)
        if actor.kind == "pause":
            self.answered_pauses.append(actor.generation)

    @rule(ms=st.sampled_from([1, 1_000, BARRIER_MS // 2, BARRIER_MS, 3 * BARRIER_MS]))
    def advance_time(self, ms: int) -> None:
        self.now += ms

    # --- workers ---------------------------------------------------------------------------

    @rule(
        bucket=st.integers(0, BUCKETS - 1),
        source=st.sampled_from(["api", "copy", "copy", "old"]),
        ttl=st.sampled_from([1, 1, 1_000, 3 * BARRIER_MS]),
    )
    def claim(self, bucket: int, source: str, ttl: int) -> None:
        copy = self.copies[bucket]
        epoch = {
            "api": sc.current_epoch(self.copies),  # GET /v1/epoch
            "copy": copy.epoch,
            "old": copy.epoch - 1,
        }[source]
        admission = type(self).admission(copy, self.now)
        if len({c.epoch for c in self.copies}) > 1:
            event(f"claim while the copies differ: {type(admission).__name__}")
        if isinstance(admission, Barrier):
            event("claim met a barrier (retried in the gateway)")
            return
        self.attempts += 1
        request = ClaimRequest("w", ttl, epoch)
        try:
            task = tasks.claim(
                self.tasks[bucket],
                admission.scheduler,
                request,
                POLICY,
                self.now,
                f"a{self.attempts}",
            )
        except ClaimsPaused:
            assert isinstance(admission, Paused)
            event("claim CLAIMS_PAUSED")
            return
        except FencegateError as refused:
            event(f"claim {refused.code}")
            return
        assert isinstance(admission, Admit), "only an admitted claim is granted"
        self.granted(bucket, task)

    def granted(self, bucket: int, task: Task) -> None:
        copy = self.copies[bucket]
        assert task.claim_epoch == copy.epoch
        # (a) never under an epoch a completed bump retired.
        assert copy.epoch >= self.completed, "(a) a claim under a retired epoch"
        # (b) while the copies differ, only a bucket whose barrier is past its deadline grants.
        if len({c.epoch for c in self.copies}) > 1:
            assert not sc.barrier_holds(copy, self.now), (
                "(b) a claim granted while the copies differ and its barrier still holds",
                self.copies,
            )
            # ... and the latest arming of it (a finisher's too) has passed its deadline.
            assert self.intent is not None and self.armed[bucket][0] == self.intent.target
            assert self.now >= self.armed[bucket][1], "(b) a claim granted past a re-arming"
            event("claim granted after a lost coordinator's barrier expired")
        # (c) after a pause is answered, only a resume numbered after it lets claims in.
        for generation in self.answered_pauses:
            assert copy.pause_generation > generation, "(c) a claim granted after a pause"
        self.tasks[bucket] = replace(task, discarded=())
        assert task.attempt_id is not None
        self.holders.append(
            Holder(
                bucket, task.attempt_id, task.claim_generation, copy.epoch, task.cancel_generation
            )
        )

    def holder(self, data: st.DataObject) -> Holder:
        return self.holders[data.draw(st.integers(0, len(self.holders) - 1), label="holder")]

    def passed(self, what: str, holder: Holder) -> None:
        """An acceptance point under ``holder``'s claim passed: (a)."""
        copy = self.copies[holder.bucket]
        assert holder.epoch == copy.epoch
        assert holder.epoch >= self.completed, f"(a) a {what} under a retired epoch"
        event(f"{what} passed")

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        h = self.holder(data)
        identity = Identity(h.attempt_id, h.generation, "w", h.epoch, h.cancel_generation)
        view = sc.scheduler_of(self.copies[h.bucket])
        try:
            request = tasks.RenewRequest(identity, 3 * BARRIER_MS)
            task = tasks.renew(self.tasks[h.bucket], view, request, POLICY, self.now)
        except FencegateError as refused:
            event(f"renew {refused.code}")
            return
        self.passed("renew", h)
        self.tasks[h.bucket] = task

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def prepare(self, data: st.DataObject) -> None:
        h = self.holder(data)
        fence = effects.Fence(
            TASK_IDS[h.bucket], h.attempt_id, h.generation, h.epoch, h.cancel_generation
        )
        view = sc.scheduler_of(self.copies[h.bucket])
        try:
            effects.check_fence(self.tasks[h.bucket], view, fence, self.now)
        except FencegateError as refused:
            event(f"prepare {refused.code}")
            return
        self.passed("prepare", h)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        h = self.holder(data)
        request = CommitRequest(
            h.attempt_id,
            h.generation,
            h.epoch,
            h.cancel_generation,
            self.tasks[h.bucket].input_digest,
            "r",
        )
        view = sc.scheduler_of(self.copies[h.bucket])
        try:
            task, replay = tasks.commit(self.tasks[h.bucket], view, request, self.now, "c")
        except FencegateError as refused:
            event(f"commit {refused.code}")
            return
        if not replay:  # a replay hands back a decision made before: no acceptance
            self.passed("commit", h)
        self.tasks[h.bucket] = task

    @rule(bucket=st.integers(0, BUCKETS - 1))
    def revise(self, bucket: int) -> None:
        """A new input, so the bucket's task can be claimed again after a commit."""
        found = self.tasks[bucket]
        digest = f"in-{found.revision + 1}"
        self.tasks[bucket] = tasks.put(found, found.task_id, digest, None, self.now)[0]

    # --- invariants --------------------------------------------------------------------------

    @invariant()
    def check_copies(self) -> None:
        """Every invariant over the copies, also checked after each step inside a run."""
        self.epochs_only_grow()
        self.no_copy_below_a_completed_bump()
        self.copies_differ_only_behind_the_unfinished_bumps_barrier()
        self.no_intent_means_one_epoch()
        self.a_barrier_comes_with_its_deadline()
        self.an_answered_pause_holds_until_a_later_resume()

    def epochs_only_grow(self) -> None:
        epochs = [c.epoch for c in self.copies]
        assert all(a >= b for a, b in zip(epochs, self.seen_epochs, strict=True)), "(d)"
        self.seen_epochs = epochs

    def no_copy_below_a_completed_bump(self) -> None:
        assert all(c.epoch >= self.completed for c in self.copies), "(a)"

    def copies_differ_only_behind_the_unfinished_bumps_barrier(self) -> None:
        """The structure behind (b): copies differ only while an intent is unfinished, every
        copy then holds its barrier (a finisher's re-arming blocks claims again), and the
        intent's target is the highest copy."""
        epochs = {c.epoch for c in self.copies}
        if len(epochs) == 1:
            return
        assert self.intent is not None, ("(b) copies differ with no bump in progress", self.copies)
        assert max(epochs) == self.intent.target, "(b)"
        assert all(c.barrier_target == self.intent.target for c in self.copies), (
            "(b) copies differ and a copy has no barrier",
            self.copies,
        )

    def no_intent_means_one_epoch(self) -> None:
        if self.intent is None:
            assert len({c.epoch for c in self.copies}) == 1

    def a_barrier_comes_with_its_deadline(self) -> None:
        for c in self.copies:
            assert (c.barrier_target is None) == (c.barrier_until_ms is None)

    def an_answered_pause_holds_until_a_later_resume(self) -> None:
        """(c): every copy has each answered pause, or a later-numbered step."""
        for generation in self.answered_pauses:
            for c in self.copies:
                assert c.pause_generation >= generation, "(c)"
                assert c.paused or c.pause_generation > generation, "(c)"
        if self.answered_pauses and all(
            c.pause_generation == max(self.answered_pauses) for c in self.copies
        ):
            assert sc.claims_paused(self.copies)
            assert all(isinstance(type(self).admission(c, self.now), Paused) for c in self.copies)


#: Histories per run: the default suite runs QUICK, the slow set (``-m slow``) FULL more;
#: ``FENCEGATE_STATEFUL_EXAMPLES`` sets both, as for ``tests/test_stateful.py``.
QUICK_EXAMPLES = 100
FULL_EXAMPLES = 2_000


def machine_settings(examples: int) -> settings:
    return settings(
        max_examples=int(os.environ.get("FENCEGATE_STATEFUL_EXAMPLES", str(examples))),
        stateful_step_count=100,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


@pytest.mark.timeout(1800)  # deep runs (FENCEGATE_STATEFUL_EXAMPLES), and shrinking a failure
@pytest.mark.parametrize(
    "examples",
    [
        pytest.param(QUICK_EXAMPLES, id="quick"),
        pytest.param(FULL_EXAMPLES, id="full", marks=pytest.mark.slow),
    ],
)
def test_the_scheduler_copies_keep_the_one_record_semantics(examples: int) -> None:
    run_state_machine_as_test(CopiesMachine, settings=machine_settings(examples))


def test_the_model_catches_claims_that_ignore_the_barrier() -> None:
    class Broken(CopiesMachine):
        admission: ClassVar[AdmissionFn] = staticmethod(ignores_barrier)

    # Found, not shrunk: the point is that it fails, and the search alone is quick.
    found = settings(
        max_examples=300,
        stateful_step_count=100,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Search.explicit, Search.generate],
    )
    with pytest.raises(AssertionError, match=r"\(b\) a claim granted while the copies differ"):
        run_state_machine_as_test(Broken, settings=found)
