"""Model-based test: random claim.v1 histories against the pure model and each real store.

Every step runs on ``ledger.tasks`` (the model) and on a real store (SQLite file or our own
redis-server running the Lua scripts); both must refuse with the same code or succeed with
the same record. The read-side queries (gauges, the reconciler's work list, listing by state,
listing tasks by state and expired lease, effect ids by prefix, finding a forward) are held
to their pure definitions in ``ledger.queries`` and
``ledger.effects``, which is what keeps the SQL and Lua mirrors of those rules honest.

Task flow: tasks may name the queue ``q`` (claimed with ``claim_next``) and depend on one
another; the steps that touch several tasks (a commit releasing its dependents, a revision
sending them back to WAITING, a cancel cascading) are walked over the model's tasks by their
one owner, ``ledger.task_graph``, which the SQL steps and the Lua scripts mirror, and every
task is compared after every step.

Redis Cluster: the same machine, with task ids in ``<group>::<name>`` form so that tasks share
a group (and a bucket) often enough for dependencies to be exercised there; a dependency
across groups is refused on both sides (``ledger.task_graph.check_same_group`` with
``ledger.buckets.task_group``).

Timing: no real time at all. The SQLite store reads a fake host clock (``ClockSources``) and
the Redis scripts a pinned instant (``RedisStore.clock_pinned_ms``); both move only when the
``advance_time`` rule moves them, together with the model's clock. So every instant matches
exactly, every history replays identically (hypothesis can shrink a failure), and the run
does not depend on how fast the machine is.

Budget: the default suite runs ``QUICK_EXAMPLES`` (20) histories per store
(``CLUSTER_QUICK_EXAMPLES`` on the cluster, each of whose steps reads every bucket), so every
store is held to the model on every run; the slow set (``-m slow``, run by ``.ci/run`` after
it) runs ``FULL_EXAMPLES`` (60) more per store. ``FENCEGATE_STATEFUL_EXAMPLES`` sets both:
run it deep (``FENCEGATE_STATEFUL_EXAMPLES=2000``) after any change to a transition
(docs/stores.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from fencegate.ledger import effects, queries, task_graph, tasks
from fencegate.ledger.buckets import task_group
from fencegate.ledger.clock import ClockSources
from fencegate.ledger.cluster_store import ClusterStore
from fencegate.ledger.effects import Effect, EffectRequest, EffectState, Fence
from fencegate.ledger.errors import FencegateError
from fencegate.ledger.postgres_store import PostgresStore
from fencegate.ledger.redis_store import RedisStore
from fencegate.ledger.registry import open_store
from fencegate.ledger.sqlite_store import SQLiteStore
from fencegate.ledger.store import Store
from fencegate.ledger.tasks import (
    ClaimRequest,
    CommitRequest,
    Identity,
    LeasePolicy,
    RenewRequest,
    Scheduler,
    Task,
)
from tests.cluster_servers import ClusterServers
from tests.conftest import STORE_TIMEOUT_MS, TEST_CLUSTER_BUCKETS
from tests.postgres_server import PostgresServer
from tests.servers import RedisServer

STEP_MS = 10_000
#: Store time when an example starts (any fixed instant: nothing reads the real clock).
START_MS = 1_800_000_000_000
POLICY = LeasePolicy(max_ttl_ms=6 * STEP_MS, default_max_runtime_ms=20 * STEP_MS)
TASKS = ("alpha", "beta/1", "gamma")
QUEUE = "q"
#: What an attempt reports spending with a renew or a commit.
COSTS = st.sampled_from([(), (), (("tokens", 5.0),), (("seconds", 1.5), ("tokens", 2.0))])
#: How an example's task ids are grouped (only the cluster machine reads it: ``task_ids``):
#: all in one group, "gamma" in a group of its own, or every task its own group.
LAYOUTS = st.sampled_from(["one", "one", "split", "apart"])
#: Dependencies a put asks for (None: keep the task's), by name; "ghost" never exists.
DEPENDS = st.sampled_from(
    [None, None, None, (), ("alpha",), ("beta/1",), ("alpha", "beta/1"), ("gamma",), ("ghost",)]
)
#: Claims mostly target real tasks; "ghost" is never created (NO_SUCH_TASK on both sides).
CLAIM_TARGETS = st.sampled_from(["alpha", "alpha", "beta/1", "beta/1", "ghost"])
DIGESTS = ("in-a", "in-b", "in-c")
TTLS = st.sampled_from([STEP_MS, 3 * STEP_MS, 6 * STEP_MS, 100 * STEP_MS])
#: Authenticated principals of claims (None: no [auth]); a lease is bound to its claim's.
PRINCIPALS = st.sampled_from([None, "alice", "bob", "alice"])
#: A step under a claim comes from the claim's principal, or is tampered: "principal" is
#: another principal (FENCED when the claim recorded one), "no_principal" none at all.
PRINCIPAL_TAMPERS = ["principal", "no_principal"]


@dataclass
class Handle:
    """One attempt as both sides know it: the model's attempt id and the store's."""

    task: str
    model_attempt: str
    store_attempt: str
    generation: int
    owner: str
    epoch: int
    cancel_generation: int
    principal: str | None = None


def outcome(fn: Any) -> tuple[str, Any]:
    """("ok", the value) or (the problem code, the error)."""
    try:
        return "ok", fn()
    except FencegateError as exc:
        return exc.code, exc


def _masked(detail: str) -> str:
    """A problem's detail with attempt ids (the model's ``m1``, the store's random hex)
    masked: the only words in which model and store may differ."""
    return re.sub(r"\b(m[0-9]+|[0-9a-f]{32})\b", "<attempt>", detail)


async def aoutcome(coro: Any) -> tuple[str, Any]:
    try:
        return "ok", await coro
    except FencegateError as exc:
        return exc.code, exc


class LeaseMachine(RuleBasedStateMachine):
    """Subclasses say how to build the store and how to move its (fake) clock."""

    #: Which group a task is in, for the put's ``task_graph.check_same_group``: one group on
    #: every store but Redis Cluster (``ledger.buckets.task_group`` there).
    group_of = staticmethod(task_graph.one_group)

    def make_store(self) -> Store:
        raise NotImplementedError

    def advance_store_clock(self, ms: int) -> None:
        raise NotImplementedError

    def task_ids(self, layout: str) -> dict[str, str]:
        """Each task's id (and the never-created "ghost"'s) for one example. Fresh ids per
        example: the store (SQLite file, Redis prefix) is fresh too, but this keeps any
        accidental sharing visible. Only a store with task groups reads ``layout``."""
        return {name: f"{name}-{uuid.uuid4().hex[:8]}" for name in (*TASKS, "ghost")}

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.store: Store = self.make_store()
        self.run(self.store.open())
        self.model_tasks: dict[str, Task | None] = dict.fromkeys(TASKS)
        self.scheduler = Scheduler()
        self.base = self.run(self.store.now_ms())
        assert self.base == START_MS
        self.offset = 0
        self.handles: list[Handle] = []
        self.model_effects: dict[str, Effect] = {}
        #: Forwards that were prepared and not yet completed: (effectId, seq, handle; None
        #: for a keyed forward).
        self.pending: list[tuple[str, int, Handle | None]] = []
        #: The test's own account of every forward, independent of the model: per effect,
        #: each attempt's [deadline, outcome or None], and how many an operator settled.
        self.history: dict[str, list[list[Any]]] = {}
        self.settled: dict[str, int] = {}
        self.forwards = 0
        #: The model's commit ids -> the store's (provenance names them).
        self.commit_ids: dict[str, str] = {}
        self.attempts = 0
        self.commits = 0

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        self.run(self.store.close())
        self.loop.close()

    @property
    def now(self) -> int:
        return self.base + self.offset

    def both(
        self, model_fn: Any, store_coro: Any, about: str | None = None
    ) -> tuple[str, Any, Any]:
        """``about``: what a store names its refusal by (``task <id>``, ``effect <id>``), as
        ``FencegateError.about`` at its one refinement point; the model's words are the rest."""
        model_code, model_value = outcome(model_fn)
        store_code, store_value = self.run(aoutcome(store_coro))
        assert model_code == store_code, f"model said {model_code}, store said {store_code}"
        if model_code != "ok":
            if about is not None:
                model_value.about(about)
            # The same words and the same problem members (the gateway composes ISO times
            # from them): a Lua mirror may not drift from the model's text.
            said = (_masked(model_value.detail), model_value.extra)
            stored = (_masked(store_value.detail), store_value.extra)
            assert said == stored, (said, stored)
            return model_code, None, None
        return model_code, model_value, store_value

    def same_task(self, model: Task | None, stored: Task | None) -> None:
        if model is None or stored is None:
            assert model is None and stored is None
            return
        for name in Task.__dataclass_fields__:
            m, s = getattr(model, name), getattr(stored, name)
            if name == "attempt_id":
                assert (m is None) == (s is None)
            elif name == "discarded":
                # Dependents are walked in an order each store chooses.
                by_store = {h.store_attempt: h.model_attempt for h in self.handles}
                assert sorted((d.task_id, d.attempt_id, d.reason, d.cost) for d in m) == sorted(
                    (d.task_id, str(by_store.get(d.attempt_id)), d.reason, d.cost) for d in s
                ), (m, s)
            elif name == "dep_commits":
                # Commit ids differ between the sides: each commit maps the model's to the store's.
                assert [(c.task_id, self.commit_ids[c.commit_id], c.result_digest) for c in m] == [
                    (c.task_id, c.commit_id, c.result_digest) for c in s
                ]
            elif name == "commit":
                assert (m is None) == (s is None)
                if m is not None:
                    assert (m.claim_generation, m.result_digest, m.result_json) == (
                        s.claim_generation,
                        s.result_digest,
                        s.result_json,
                    )
                    assert s.committed_at == m.committed_at
            else:
                assert m == s, (name, m, s)

    # --- rules -----------------------------------------------------------------------------

    @initialize(digest=st.sampled_from(DIGESTS), layout=LAYOUTS)
    def create_tasks(self, digest: str, layout: str) -> None:
        # The ids (and so the effectIds) differ between replays, so no draw may depend on
        # their order: effects are drawn in creation order.
        self.ids = self.task_ids(layout)
        self.model_tasks["ghost"] = None
        for name in TASKS:
            self.put(name, digest, None)
        # Start with live claims, so effect steps have a current attempt to work under.
        self._claim(TASKS[0], "w1", 6 * STEP_MS, 0, None, "alice")

    @rule(
        name=st.sampled_from(TASKS),
        digest=st.sampled_from(DIGESTS),
        runtime=st.sampled_from([None, 2 * STEP_MS, 8 * STEP_MS]),
        queue=st.sampled_from([None, QUEUE, QUEUE]),
        priority=st.sampled_from([None, 0, 5, -3]),
        depends=DEPENDS,
    )
    def put(
        self,
        name: str,
        digest: str,
        runtime: int | None,
        queue: str | None = None,
        priority: int | None = None,
        depends: tuple[str, ...] | None = None,
    ) -> None:
        task_id = self.ids[name]
        depends_on = None if depends is None else tuple(self.ids[d] for d in depends)
        found = self.model_tasks[name]
        code, model, stored = self.both(
            lambda: self.model_put(found, task_id, digest, runtime, queue, priority, depends_on),
            self.store.put_task(
                task_id,
                digest,
                runtime,
                queue=queue,
                priority=priority,
                depends_on=depends_on,
            ),
        )
        event(f"put {code}")
        if code != "ok":
            return
        assert model[1] == stored[1]
        self.same_task(model[0], stored[0])
        self.keep(name, model[0])

    def keep(self, name: str, task: Task) -> None:
        """What the store keeps of a step's answer (``discarded`` is never stored)."""
        self.model_tasks[name] = replace(task, discarded=())

    def by_id(self, task_id: str) -> str:
        return next(name for name, tid in self.ids.items() if tid == task_id)

    def graph(self) -> dict[str, Task | None]:
        """The model's records by task id: what ``ledger.task_graph`` walks."""
        return {t.task_id: t for t in self.model_tasks.values() if t is not None}

    def keep_changed(self, changed: dict[str, Task]) -> None:
        for task_id, task in changed.items():
            self.keep(self.by_id(task_id), task)

    def model_put(
        self,
        found: Task | None,
        task_id: str,
        digest: str,
        runtime: int | None,
        queue: str | None,
        priority: int | None,
        depends_on: tuple[str, ...] | None,
    ) -> tuple[Task, tasks.PutOutcome]:
        """The put step of every store: the dependencies' records, the cycle walk for new
        dependencies of an existing task, the put, then a committed task's dependents (the
        walks: ``ledger.task_graph``, which the stores' SQL and Lua mirror)."""
        if found is not None and found.input_digest == digest:
            return found, tasks.PutOutcome.UNCHANGED
        before = found.depends_on if found is not None else ()
        deps_now = tuple(dict.fromkeys(depends_on)) if depends_on is not None else before
        deps = {d: None if d == task_id else self.model_tasks[self.by_id(d)] for d in deps_now}
        task_graph.check_same_group(task_id, deps_now, self.group_of)
        tasks.check_dependencies(task_id, deps_now, deps)
        added = [d for d in deps_now if d not in before]
        if added and found is not None:
            task_graph.check_no_cycle(self.graph(), task_id, added)
        task, put_outcome = tasks.put(
            found,
            task_id,
            digest,
            runtime,
            self.now,
            queue=queue,
            priority=priority,
            depends_on=depends_on,
            deps=deps,
        )
        if found is not None and found.state is tasks.TaskState.COMMITTED:
            self.keep(self.by_id(task_id), task)
            changed = task_graph.revise_dependents(self.graph(), task_id, self.now)
            self.keep_changed(changed)
            revised = (d for t in changed.values() for d in t.discarded)
            task = replace(task, discarded=(*task.discarded, *revised))
        return task, put_outcome

    @rule(
        name=CLAIM_TARGETS,
        owner=st.sampled_from(["w1", "w2"]),
        ttl=TTLS,
        epoch_delta=st.sampled_from([0, 0, 0, 0, 0, 0, 0, -1]),
        revision_delta=st.sampled_from([None, None, 0, 1]),
        paused=st.sampled_from([False] * 7 + [True]),
        principal=PRINCIPALS,
    )
    def claim(
        self,
        name: str,
        owner: str,
        ttl: int,
        epoch_delta: int,
        revision_delta: int | None,
        paused: bool,
        principal: str | None,
    ) -> None:
        """A claim; with ``paused`` the claims are paused around it (and resumed after)."""
        if paused:
            self.set_paused(True)
        try:
            self._claim(name, owner, ttl, epoch_delta, revision_delta, principal)
        finally:
            if paused:
                self.set_paused(False)

    @rule(
        owner=st.sampled_from(["w1", "w2"]),
        ttl=TTLS,
        epoch_delta=st.sampled_from([0, 0, 0, 0, 0, -1]),
        principal=PRINCIPALS,
    )
    def claim_next(self, owner: str, ttl: int, epoch_delta: int, principal: str | None) -> None:
        """The best claimable task of the queue, or none: the model picks among all tasks."""
        request = ClaimRequest(owner, ttl, self.scheduler.epoch + epoch_delta, principal=principal)
        self.attempts += 1
        model_attempt = f"m{self.attempts}"
        everything = [t for t in self.model_tasks.values() if t is not None]
        code, model, stored = self.both(
            lambda: tasks.claim_next(
                QUEUE, everything, self.scheduler, request, POLICY, self.now, model_attempt
            ),
            self.store.claim_next(QUEUE, request),
        )
        event(f"claim_next {code} {'none' if code == 'ok' and model is None else ''}")
        if code != "ok" or model is None:
            assert code != "ok" or stored is None
            return
        assert stored is not None and stored.task_id == model.task_id
        self.granted(self.by_id(model.task_id), model, stored, model_attempt, owner, principal)

    def granted(
        self,
        name: str,
        model: Task,
        stored: Task,
        model_attempt: str,
        owner: str,
        principal: str | None,
    ) -> None:
        """A claim both sides granted: the records agree, and the attempt joins the handles."""
        self.same_task(model, stored)
        self.keep(name, model)
        self.handles.append(
            Handle(
                name,
                model_attempt,
                stored.attempt_id,
                model.claim_generation,
                owner,
                model.claim_epoch,
                model.cancel_generation,
                principal,
            )
        )

    def set_paused(self, paused: bool) -> None:
        stored = self.run(self.store.set_claims_paused(paused))
        self.scheduler = tasks.set_claims_paused(self.scheduler, paused)
        assert stored == self.scheduler

    def _claim(
        self,
        name: str,
        owner: str,
        ttl: int,
        epoch_delta: int,
        revision_delta: int | None,
        principal: str | None,
    ) -> None:
        task = self.model_tasks[name]
        expected = None
        if revision_delta is not None:
            expected = (task.revision if task else 1) + revision_delta
        request = ClaimRequest(
            owner, ttl, self.scheduler.epoch + epoch_delta, expected, principal=principal
        )
        self.attempts += 1
        model_attempt = f"m{self.attempts}"
        code, model, stored = self.both(
            lambda: tasks.claim(task, self.scheduler, request, POLICY, self.now, model_attempt),
            self.store.claim(self.ids[name], request),
            about=f"task {self.ids[name]}",
        )
        event(f"claim {code}")
        if code == "ok":
            self.granted(name, model, stored, model_attempt, owner, principal)

    @staticmethod
    def _caller(handle: Handle, tamper: str) -> str | None:
        """The principal a step under ``handle`` comes from."""
        if tamper == "principal":
            return "bob" if handle.principal == "alice" else "alice"
        if tamper == "no_principal":
            return None
        return handle.principal

    def _identity(self, handle: Handle, side: str, tamper: str) -> Identity:
        return Identity(
            attempt_id=handle.model_attempt if side == "model" else handle.store_attempt,
            claim_generation=handle.generation + (1 if tamper == "generation" else 0),
            owner=handle.owner + ("x" if tamper == "owner" else ""),
            scheduler_epoch=self.scheduler.epoch if tamper == "current_epoch" else handle.epoch,
            cancel_generation=handle.cancel_generation + (1 if tamper == "cancel" else 0),
            principal=self._caller(handle, tamper),
        )

    @precondition(lambda self: self.handles)
    @rule(
        data=st.data(),
        ttl=TTLS,
        tamper=st.sampled_from(
            ["none", "none", "generation", "owner", "current_epoch", "cancel", *PRINCIPAL_TAMPERS]
        ),
        on_request=st.booleans(),
        cost=COSTS,
    )
    def renew(
        self,
        data: st.DataObject,
        ttl: int,
        tamper: str,
        on_request: bool,
        cost: tasks.Cost = (),
    ) -> None:
        """``on_request``: the caller's principal travels on the RenewRequest, not the
        identity (both are read: ``RenewRequest.caller``)."""
        handle = data.draw(st.sampled_from(self.handles))
        name = handle.task

        def request(side: str) -> RenewRequest:
            ident = self._identity(handle, side, tamper)
            if on_request and ident.principal is not None:
                return RenewRequest(replace(ident, principal=None), ttl, ident.principal, cost=cost)
            return RenewRequest(ident, ttl, cost=cost)

        code, model, stored = self.both(
            lambda: tasks.renew(
                self.model_tasks[name], self.scheduler, request("model"), POLICY, self.now
            ),
            self.store.renew(self.ids[name], request("store")),
            about=f"task {self.ids[name]}",
        )
        event(f"renew {code} {tamper}")
        if code == "ok":
            self.same_task(model, stored)
            self.keep(name, model)

    @precondition(lambda self: self.handles)
    @rule(
        data=st.data(),
        tamper=st.sampled_from(["none", "none", "generation", "cancel", *PRINCIPAL_TAMPERS]),
    )
    def release(self, data: st.DataObject, tamper: str) -> None:
        handle = data.draw(st.sampled_from(self.handles))
        name = handle.task
        code, model, stored = self.both(
            lambda: tasks.release(
                self.model_tasks[name], self._identity(handle, "model", tamper), self.now
            ),
            self.store.release(self.ids[name], self._identity(handle, "store", tamper)),
            about=f"task {self.ids[name]}",
        )
        if code == "ok":
            self.same_task(model, stored)
            self.keep(name, model)

    @precondition(lambda self: self.handles)
    @rule(
        data=st.data(),
        result=st.sampled_from(["r1", "r2"]),
        stale_input=st.booleans(),
        with_result=st.booleans(),
        tamper=st.sampled_from(
            ["none", "none", "none", "current_epoch", "cancel", *PRINCIPAL_TAMPERS]
        ),
        cost=COSTS,
    )
    def commit(
        self,
        data: st.DataObject,
        result: str,
        stale_input: bool,
        with_result: bool,
        tamper: str,
        cost: tasks.Cost = (),
    ) -> None:
        handle = data.draw(st.sampled_from(self.handles))
        name = handle.task
        task = self.model_tasks[name]
        assert task is not None
        before = task.commit

        def request(side: str) -> CommitRequest:
            ident = self._identity(handle, side, tamper)
            return CommitRequest(
                attempt_id=ident.attempt_id,
                claim_generation=ident.claim_generation,
                scheduler_epoch=ident.scheduler_epoch,
                cancel_generation=ident.cancel_generation,
                input_digest="stale" if stale_input else task.input_digest,
                result_digest=result,
                result_json=f'{{"r":"{result}"}}' if with_result else None,
                principal=ident.principal,
                cost=cost,
            )

        self.commits += 1
        code, model, stored = self.both(
            lambda: tasks.commit(
                task, self.scheduler, request("model"), self.now, f"c{self.commits}"
            ),
            self.store.commit(self.ids[name], request("store")),
            about=f"task {self.ids[name]}",
        )
        event(f"commit {code}")
        if code == "ok":
            assert model[1] == stored[1], "replay flag differs"
            if before is not None:  # one canonical commit per revision, never replaced
                assert model[1] and model[0].commit == before
            assert model[0].commit is not None and stored[0].commit is not None
            self.commit_ids[model[0].commit.commit_id] = stored[0].commit.commit_id
            self.same_task(model[0], stored[0])
            self.keep(name, model[0])
            if not model[1]:  # the first commit releases its dependents
                self.keep_changed(task_graph.release_dependents(self.graph(), model[0], self.now))

    @rule(kind=st.sampled_from(["cancel", "bump_epoch"]), name=st.sampled_from(TASKS))
    def disrupt(self, kind: str, name: str) -> None:
        """The operator's levers, as one rule so they do not crowd out the workers' steps."""
        if kind == "cancel":
            self.cancel(name)
        else:
            self.bump_epoch()

    def cancel(self, name: str) -> None:
        code, model, stored = self.both(
            lambda: self.model_cancel(name),
            self.store.cancel(self.ids[name]),
            about=f"task {self.ids[name]}",
        )
        if code == "ok":
            self.same_task(model, stored)
            self.keep(name, model)

    def model_cancel(self, name: str) -> Task:
        """Cancel, then the open dependents, transitively (``task_graph.cancel_cascade``,
        up to the store's ``max_cascade``: more than the model's tasks, so none is left)."""
        found = self.model_tasks[name]
        task = tasks.cancel(found, self.now)
        if found is None or found.state is tasks.TaskState.CANCELLED:
            return task
        self.keep(name, task)
        limit = self.store.max_cascade
        cascade = task_graph.cancel_cascade(self.graph(), [task.task_id], self.now, limit)
        assert not cascade.pending
        self.keep_changed(cascade.changed)
        return replace(task, discarded=(*task.discarded, *cascade.discarded))

    def bump_epoch(self) -> None:
        stored = self.run(self.store.bump_epoch())
        self.scheduler = tasks.bump_epoch(self.scheduler)
        assert stored == self.scheduler

    @rule(steps=st.sampled_from([1, 1, 2, 3, 8]))
    def advance_time(self, steps: int) -> None:
        self.offset += steps * STEP_MS
        self.advance_store_clock(steps * STEP_MS)
        assert self.run(self.store.now_ms()) == self.now

    # --- the idempotency ledger ----------------------------------------------------------

    def same_effect(self, model: Effect, stored: Effect) -> None:
        attempts_by_store = {h.store_attempt: h.model_attempt for h in self.handles}
        for name in Effect.__dataclass_fields__:
            m, s = getattr(model, name), getattr(stored, name)
            if name == "attempts":
                assert len(m) == len(s)
                for ma, sa in zip(m, s, strict=True):
                    # A keyed forward's attempt id is its forward id, the same on both sides.
                    assert attempts_by_store.get(sa.attempt_id, sa.attempt_id) == ma.attempt_id
                    assert (ma.claim_generation, ma.outcome, ma.reason, ma.approved_by) == (
                        sa.claim_generation,
                        sa.outcome,
                        sa.reason,
                        sa.approved_by,
                    )
                    assert (ma.started_at, ma.ended_at, ma.forward_id) == (
                        sa.started_at,
                        sa.ended_at,
                        sa.forward_id,
                    )
            elif name == "actions_json" and m is not None:
                assert json.loads(m) == json.loads(s), (m, s)
            else:
                assert m == s, (name, m, s)

    @precondition(lambda self: self.handles)
    @rule(
        data=st.data(),
        slot=st.sampled_from(["s1", "s2"]),
        payload=st.sampled_from(["p1", "p2"]),
        deadline=st.sampled_from([STEP_MS, 3 * STEP_MS]),
        resend=st.sampled_from([None, 2 * STEP_MS, 2 * STEP_MS]),
        approval=st.sampled_from([False, False, True]),
        tamper=st.sampled_from(["none"] * 8 + ["generation", "cancel", *PRINCIPAL_TAMPERS]),
        # The request's approval digest: none (the payload digest), or one of its headers'.
        headers=st.sampled_from([None, None, "h1", "h2"]),
    )
    def prepare(
        self,
        data: st.DataObject,
        slot: str,
        payload: str,
        deadline: int,
        resend: int | None,
        approval: bool,
        tamper: str,
        headers: str | None,
    ) -> None:
        # Mostly a claim that is still current (only those can produce effects), sometimes any.
        current = [
            h
            for h in self.handles
            if (task := self.model_tasks[h.task]) is not None and task.attempt_id == h.model_attempt
        ]
        handle = data.draw(st.sampled_from(current * 6 + self.handles))
        name = handle.task

        def request(side: str) -> EffectRequest:
            ident = self._identity(handle, side, tamper)
            fence = Fence(
                self.ids[name],
                ident.attempt_id,
                ident.claim_generation,
                ident.scheduler_epoch,
                ident.cancel_generation,
                ident.principal,
            )
            return EffectRequest(
                fence,
                "main",
                slot,
                "api",
                "POST",
                "/pay",
                payload,
                f"fwd-{self.forwards}",
                None if headers is None else f"{payload}+{headers}",
            )

        task = self.model_tasks[name]
        existing = None
        if task is not None:
            existing = self.model_effects.get(
                effects.effect_id(task.task_id, task.revision, "main", slot)
            )
        code, model, stored = self.both(
            lambda: effects.prepare(
                task,
                self.scheduler,
                existing,
                request("model"),
                self.now,
                deadline,
                resend_window_ms=resend,
                require_approval=approval,
            ),
            self.store.prepare_effect(
                request("store"), deadline, resend_window_ms=resend, require_approval=approval
            ),
            about=f"task {self.ids[name]}",
        )
        event(
            f"prepare {code}"
            if code != "ok"
            else f"prepare {model.action.value} {model.error.code if model.error else ''}"
        )
        if code != "ok":
            return
        assert model.action == stored.action
        if model.error is not None or stored.error is not None:
            assert model.error is not None and stored.error is not None
            assert model.error.code == stored.error.code
            assert model.error.extra == stored.error.extra
            # The same words too, naming the effect (prepare.lua mirrors the model's).
            assert _masked(model.error.detail) == _masked(stored.error.detail)
            assert f"effect {model.effect.effect_id}" in stored.error.detail
        self.model_effects[model.effect.effect_id] = model.effect
        self.same_effect(model.effect, stored.effect)
        if model.action is effects.Action.FORWARD:
            self.pending.append((model.effect.effect_id, model.seq, handle))
            self.history.setdefault(model.effect.effect_id, []).append([self.now + deadline, None])
            assert len(self.history[model.effect.effect_id]) == model.seq + 1
        self.forwards += 1

    @rule(
        principal=st.sampled_from(["alice", "bob"]),
        key=st.sampled_from(["k1", "k2"]),
        payload=st.sampled_from(["p1", "p2"]),
        deadline=st.sampled_from([STEP_MS, 3 * STEP_MS]),
        resend=st.sampled_from([None, 2 * STEP_MS]),
        approval=st.sampled_from([False, False, True]),
    )
    def prepare_keyed(
        self,
        principal: str,
        key: str,
        payload: str,
        deadline: int,
        resend: int | None,
        approval: bool,
    ) -> None:
        """A lease-less client's call by idempotency key: no task, no fence; the same
        ledger rules. Two principals' equal keys are two effects."""
        request = EffectRequest(
            None,
            "main",
            "",
            "api",
            "POST",
            "/pay",
            payload,
            f"fwd-{self.forwards}",
            client_key=effects.ClientKey(principal, key),
        )
        assert request.effect_id is not None
        existing = self.model_effects.get(request.effect_id)
        code, model, stored = self.both(
            lambda: effects.prepare(
                None,
                self.scheduler,
                existing,
                request,
                self.now,
                deadline,
                resend_window_ms=resend,
                require_approval=approval,
            ),
            self.store.prepare_effect(
                request, deadline, resend_window_ms=resend, require_approval=approval
            ),
        )
        event(
            f"prepare_keyed {code}"
            if code != "ok"
            else f"prepare_keyed {model.action.value} {model.error.code if model.error else ''}"
        )
        if code != "ok":
            return
        assert model.action == stored.action
        assert model.effect.kind == stored.effect.kind == "keyed"
        if model.error is not None or stored.error is not None:
            assert model.error is not None and stored.error is not None
            assert model.error.code == stored.error.code
            assert model.error.extra == stored.error.extra
            assert _masked(model.error.detail) == _masked(stored.error.detail)
        self.model_effects[model.effect.effect_id] = model.effect
        self.same_effect(model.effect, stored.effect)
        if model.action is effects.Action.FORWARD:
            self.pending.append((model.effect.effect_id, model.seq, None))
            self.history.setdefault(model.effect.effect_id, []).append([self.now + deadline, None])
            assert len(self.history[model.effect.effect_id]) == model.seq + 1
        self.forwards += 1

    @precondition(lambda self: self.pending)
    @rule(
        data=st.data(),
        outcome=st.sampled_from(
            [EffectState.COMMITTED, EffectState.NOT_APPLIED, EffectState.UNKNOWN]
        ),
        response=st.sampled_from([None, '{"status":200}']),
        # A forward that certainly sent nothing keeps its approval (``effects.sent_nothing``).
        reason=st.sampled_from(["r", "r", "connect failed: X", "never sent: pool"]),
    )
    def complete(
        self, data: st.DataObject, outcome: EffectState, response: str | None, reason: str
    ) -> None:
        index = data.draw(st.integers(0, len(self.pending) - 1))
        eid, seq, handle = self.pending.pop(index)
        if handle is None:  # a keyed forward: its attempt id is its forward id
            forward_id = self.model_effects[eid].attempts[seq].forward_id
            assert forward_id is not None
            task_id, model_attempt, store_attempt = None, forward_id, forward_id
        else:
            task_id = self.ids[handle.task]
            model_attempt, store_attempt = handle.model_attempt, handle.store_attempt
        model, applied = effects.complete(
            self.model_effects[eid], seq, model_attempt, outcome, reason, response, self.now
        )
        stored, stored_applied = self.run(
            self.store.complete_effect(task_id, eid, seq, store_attempt, outcome, reason, response)
        )
        assert applied == stored_applied
        event(f"complete {outcome.value} applied={applied}")
        if applied:
            self.history[eid][seq][1] = outcome.value
        self.model_effects[eid] = model
        self.same_effect(model, stored)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        """The gateway lost the store's answer to a prepare and aborts that forward."""
        index = data.draw(st.integers(0, len(self.pending) - 1))
        eid, seq, _ = self.pending.pop(index)
        forward_id = self.model_effects[eid].attempts[seq].forward_id
        assert forward_id is not None
        code, model, stored = self.both(
            lambda: effects.abort(self.model_effects[eid], forward_id, self.now),
            self.store.update_effect(eid, lambda e, now: effects.abort(e, forward_id, now)),
            about=f"effect {eid}",
        )
        event(f"abort {code}")
        if code == "ok":
            self.history[eid][seq][1] = EffectState.NOT_APPLIED.value
            self.model_effects[eid] = model
            self.same_effect(model, stored)

    @precondition(lambda self: self.model_effects)
    @rule(data=st.data(), outcome=st.sampled_from([EffectState.COMMITTED, EffectState.NOT_APPLIED]))
    def resolve(self, data: st.DataObject, outcome: EffectState) -> None:
        eid = data.draw(st.sampled_from(list(self.model_effects)))
        code, model, stored = self.both(
            lambda: effects.resolve(self.model_effects[eid], outcome, "note", "op", None, self.now),
            self.store.update_effect(
                eid, lambda e, now: effects.resolve(e, outcome, "note", "op", None, now)
            ),
            about=f"effect {eid}",
        )
        if code == "ok":
            if outcome is EffectState.NOT_APPLIED:
                self.settled[eid] = len(self.history.get(eid, []))
            self.model_effects[eid] = model
            self.same_effect(model, stored)

    @precondition(lambda self: self.model_effects)
    @rule(
        data=st.data(),
        ttl=st.sampled_from([STEP_MS, 4 * STEP_MS]),
        guard=st.booleans(),
        principal=PRINCIPALS,
    )
    def approve(self, data: st.DataObject, ttl: int, guard: bool, principal: str | None) -> None:
        """An operator approves; with [auth] (``principal``) the operator's name is the
        principal's, and approving what one's own principal requested is FORBIDDEN. Mostly
        an effect that can be approved (NOT_APPLIED), sometimes any."""
        approvable = [
            eid
            for eid, e in self.model_effects.items()
            if effects.effective(e, self.now).state is EffectState.NOT_APPLIED
        ]
        eid = data.draw(st.sampled_from(approvable * 4 + list(self.model_effects)))
        if data.draw(st.booleans()):  # the principal it was requested under, if any
            principal = self.model_effects[eid].requested_by
        expected = data.draw(st.sampled_from(["p1", "p2"])) if guard else None
        # The approval digest the operator names, or none (then, with ``expected``, the
        # payload digest alone: refused when the request sent effect-changing headers).
        named = data.draw(st.sampled_from([None, None, "p1", "p1+h1", "p2+h2"]))
        operator = principal or "op"
        code, model, stored = self.both(
            lambda: effects.approve(
                self.model_effects[eid],
                operator,
                "ok",
                expected,
                ttl,
                self.now,
                principal,
                expected_approval=named,
            ),
            self.store.update_effect(
                eid,
                lambda e, now: effects.approve(
                    e, operator, "ok", expected, ttl, now, principal, expected_approval=named
                ),
            ),
            about=f"effect {eid}",
        )
        event(f"approve {code}")
        if code == "FORBIDDEN":
            assert principal is not None and self.model_effects[eid].requested_by == principal
        if code == "ok":
            self.model_effects[eid] = model
            self.same_effect(model, stored)

    # --- invariants ------------------------------------------------------------------------

    @invariant()
    def queries_agree(self) -> None:
        """Each store's read-side answers, from its own indexes and queries (SQL, Lua), are
        the pure definitions' (``ledger.queries``) over the model's records."""
        now = self.now
        records = list(self.model_effects.values())
        model_tasks = [t for t in self.model_tasks.values() if t is not None]
        assert self.run(self.store.gauges()) == queries.gauges(model_tasks, records, now)
        probes = frozenset({"api"})
        unsettled = self.run(self.store.unsettled_effects(1000, probes))
        expected = queries.unsettled_effects(records, now, 1000, probes)
        assert sorted(e.effect_id for e in unsettled) == sorted(e.effect_id for e in expected)
        for stored in unsettled:
            self.same_effect(effects.effective(self.model_effects[stored.effect_id], now), stored)
        # The operator's approval queue (SQL condition, Redis set): oldest first.
        waiting = self.run(self.store.awaiting_approval(1000))
        expected_waiting = sorted(
            (e for e in records if effects.is_awaiting_approval(effects.effective(e, now))),
            key=lambda e: (e.created_at, e.effect_id),
        )
        assert [e.effect_id for e in waiting] == [e.effect_id for e in expected_waiting]

    @invariant()
    def listing_by_state_agrees(self) -> None:
        """``list_effects(state=...)`` (a SQL condition on SQLite) reads each record as
        ``effects.effective`` does: a PREPARED past its deadline is listed as UNKNOWN."""
        views = [effects.effective(e, self.now) for e in self.model_effects.values()]
        for state in EffectState:
            listed, cursor = self.run(
                self.store.list_effects(
                    state=state, task_id=None, downstream=None, limit=500, cursor=None
                )
            )
            assert cursor is None
            assert sorted(e.effect_id for e in listed) == sorted(
                e.effect_id for e in views if e.state is state
            ), state

    @invariant()
    def task_listing_agrees(self) -> None:
        """``list_tasks`` by state and ``lease_expired`` (judged by the store's clock, which
        moves with the model's) lists what ``queries.TaskFilter`` admits of the model's
        tasks (``queries.page_tasks``), in task id order."""
        model = sorted((t.task_id, t) for t in self.model_tasks.values() if t is not None)
        for state, lease_expired in (
            (None, None),
            (None, True),
            (None, False),
            (tasks.TaskState.CLAIMED, False),
        ):
            wanted = queries.TaskFilter(state, lease_expired=lease_expired)
            listed, last = self.run(self.store.list_tasks(wanted, 500, None))
            expected, _ = queries.page_tasks(model, False, wanted, 500, self.now)
            assert last is None
            assert [t.task_id for t in listed] == [t.task_id for t in expected], wanted
            if lease_expired and listed:
                event("list_tasks leaseExpired found some")

    @invariant()
    def effect_prefixes_agree(self) -> None:
        """``find_effects`` (a key range in SQL, ``effect_prefix.lua`` in Redis) is
        ``queries.effects_with_prefix`` over the model's effect ids."""
        ids = list(self.model_effects)
        for prefix in {*(eid[:6] for eid in ids), *(eid[:1] for eid in ids), "0"}:
            found = self.run(self.store.find_effects(prefix, 3))
            assert found == queries.effects_with_prefix(ids, prefix, 3), prefix

    @precondition(lambda self: self.forwards)
    @rule(data=st.data(), name=st.sampled_from(TASKS))
    def find_forward(self, data: st.DataObject, name: str) -> None:
        """The store finds a forward by its id as ``queries.find_forward`` does over the
        task's records (only a record's last forward counts)."""
        forward = data.draw(st.integers(0, self.forwards))  # the last one was never issued
        forward_id = f"fwd-{forward}"
        task_id = self.ids[name]
        records = [e for e in self.model_effects.values() if e.task_id == task_id]
        found = self.run(self.store.find_forward(task_id, forward_id))
        assert found == queries.find_forward(records, forward_id)
        event(f"find_forward {'found' if found else 'none'}")

    @invariant()
    def unknown_is_never_erased(self) -> None:
        """The at-most-once rule, judged from the test's own history of forwards: once an
        attempt may have executed (it ended UNKNOWN, or its deadline passed with no outcome),
        the effect is never NOT_APPLIED again until an operator settles it."""
        for eid, attempts in self.history.items():
            since = attempts[self.settled.get(eid, 0) :]
            risky = any(
                outcome == EffectState.UNKNOWN.value or (outcome is None and self.now >= deadline)
                for deadline, outcome in since
            )
            if risky:
                stored = self.run(self.store.get_effect(eid))
                assert stored.state is not EffectState.NOT_APPLIED, (eid, attempts, stored)

    @invariant()
    def an_approval_is_used_by_a_forward_that_may_have_sent(self) -> None:
        """An approval stays on a record only while no forward under it may have been sent:
        an effect that is (or reads) UNKNOWN or COMMITTED holds none."""
        for model in self.model_effects.values():
            view = effects.effective(model, self.now)
            if view.state in (EffectState.UNKNOWN, EffectState.COMMITTED):
                assert view.approval_digest is None, view

    @invariant()
    def ledgers_agree(self) -> None:
        for eid, model in self.model_effects.items():
            stored = self.run(self.store.get_effect(eid))
            self.same_effect(effects.effective(model, self.now), stored)

    @invariant()
    def stores_agree(self) -> None:
        for name in (*TASKS, "ghost"):
            code, stored = self.run(aoutcome(self.store.get_task(self.ids[name])))
            self.same_task(self.model_tasks[name], stored if code == "ok" else None)
        assert self.run(self.store.get_scheduler()) == self.scheduler

    @invariant()
    def generations_only_grow(self) -> None:
        for name in TASKS:
            gens = [h.generation for h in self.handles if h.task == name]
            assert gens == sorted(gens) and len(gens) == len(set(gens))


#: Histories per store in the default suite, and in the slow set (module docstring).
QUICK_EXAMPLES = 20
FULL_EXAMPLES = 60
BUDGETS = [
    pytest.param(QUICK_EXAMPLES, id="quick"),
    pytest.param(FULL_EXAMPLES, id="full", marks=pytest.mark.slow),
]


def run_settings(examples: int) -> settings:
    """``examples`` histories of 50 steps, unless ``FENCEGATE_STATEFUL_EXAMPLES`` says."""
    return settings(
        max_examples=int(os.environ.get("FENCEGATE_STATEFUL_EXAMPLES", str(examples))),
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


@pytest.mark.timeout(1800)  # deep runs, and shrinking a failure to a minimal history
@pytest.mark.parametrize("examples", BUDGETS)
def test_sqlite_store_matches_model(tmp_path: Path, examples: int) -> None:
    counter = iter(range(10**6))

    class Machine(LeaseMachine):
        def make_store(self) -> Store:
            # A host whose clocks move only when the test says so (ledger/clock.py).
            self.host = {"wall": START_MS, "boot": 1_000}
            sources = ClockSources(
                wall_ms=lambda: self.host["wall"],
                boot_ms=lambda: self.host["boot"],
                boot_id=lambda: "boot-1",
            )
            path = str(tmp_path / f"s{next(counter)}.db")
            return SQLiteStore(path, POLICY, clock_sources=sources, timeout_ms=STORE_TIMEOUT_MS)

        def advance_store_clock(self, ms: int) -> None:
            self.host["wall"] += ms
            self.host["boot"] += ms

    run_state_machine_as_test(Machine, settings=run_settings(examples))


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("examples", BUDGETS)
def test_redis_store_matches_model(redis_server: RedisServer, examples: int) -> None:
    class Machine(LeaseMachine):
        def make_store(self) -> Store:
            store = RedisStore(
                redis_server.url,
                POLICY,
                key_prefix=f"s{uuid.uuid4().hex[:10]}",
                timeout_ms=STORE_TIMEOUT_MS,
            )
            store.clock_pinned_ms = START_MS  # the scripts never read TIME
            self.redis_store = store
            return store

        def advance_store_clock(self, ms: int) -> None:
            assert self.redis_store.clock_pinned_ms is not None
            self.redis_store.clock_pinned_ms += ms

    run_state_machine_as_test(Machine, settings=run_settings(examples))


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("examples", BUDGETS)
def test_postgres_store_matches_model(postgres_server: PostgresServer, examples: int) -> None:
    class Machine(LeaseMachine):
        def make_store(self) -> Store:
            self.database = f"m_{uuid.uuid4().hex[:12]}"  # a database per example
            store = PostgresStore(
                postgres_server.create_database(self.database), POLICY, timeout_ms=STORE_TIMEOUT_MS
            )
            store.clock_pinned_ms = START_MS  # the database's clock is never read
            self.postgres_store = store
            return store

        def advance_store_clock(self, ms: int) -> None:
            assert self.postgres_store.clock_pinned_ms is not None
            self.postgres_store.clock_pinned_ms += ms

        def teardown(self) -> None:
            super().teardown()
            postgres_server.drop_database(self.database)

    run_state_machine_as_test(Machine, settings=run_settings(examples))


#: Histories on the cluster in the default suite: every invariant reads every bucket.
CLUSTER_QUICK_EXAMPLES = 5
#: And in the slow set: fewer than the other stores' (a history costs ~10-15 s here, every
#: invariant reading every bucket of six servers on two cores; the buckets run the single
#: Redis store's scripts, which FULL_EXAMPLES histories check on one Redis, and what spans
#: buckets in queue claims is held to one Redis on 60 more histories, on one server, by
#: tests/test_cluster_hints_redteam.py), so the whole CI run stays within its 30 minutes.
CLUSTER_FULL_EXAMPLES = 15


@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    "examples",
    [
        pytest.param(CLUSTER_QUICK_EXAMPLES, id="quick"),
        pytest.param(CLUSTER_FULL_EXAMPLES, id="full", marks=pytest.mark.slow),
    ],
)
def test_cluster_store_matches_model(redis_cluster: ClusterServers, examples: int) -> None:
    """The session's Redis Cluster, a fresh key prefix (so a fresh set of buckets) per
    example, opened through the registry's ``redis+cluster://``."""

    class Machine(LeaseMachine):
        group_of = staticmethod(task_group)

        def task_ids(self, layout: str) -> dict[str, str]:
            """``<group>::<name>`` ids: "one" puts every task in one group, "split" gives
            "gamma" a group of its own, "apart" makes each id its own group (no ``::``)."""
            if layout == "apart":
                return super().task_ids(layout)
            home, away = (f"g{uuid.uuid4().hex[:8]}" for _ in range(2))
            return {
                name: f"{away if layout == 'split' and name == 'gamma' else home}::{name}"
                for name in (*TASKS, "ghost")
            }

        def make_store(self) -> Store:
            store = open_store(
                redis_cluster.url,
                POLICY,
                timeout_ms=STORE_TIMEOUT_MS,
                redis_key_prefix=f"s{uuid.uuid4().hex[:10]}",
                cluster_buckets=TEST_CLUSTER_BUCKETS,
            )
            assert isinstance(store, ClusterStore)
            store.clock_pinned_ms = START_MS  # on every bucket view: no script reads TIME
            self.cluster_store = store
            return store

        def advance_store_clock(self, ms: int) -> None:
            assert self.cluster_store.clock_pinned_ms is not None
            self.cluster_store.clock_pinned_ms += ms

    run_state_machine_as_test(Machine, settings=run_settings(examples))
