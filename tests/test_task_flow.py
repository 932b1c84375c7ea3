"""Task flow on every store: queues, dependencies, cancel cascades, revisions that unwind
provenance, discarded attempts, and the change feed (ledger.tasks, ledger.events).

Each test drives a real store (SQLite file, our own redis-server, our own PostgreSQL) through
``Store``; the model-based test (tests/test_stateful.py) explores the same rules at random,
these pin down the stories users rely on. Lease expiry is driven by the stores' test clock
(``clock_offset_ms``), never by sleeping. Tasks that depend on one another share a task group
(``flow::<name>`` ids): on Redis Cluster a dependency across groups is refused
(docs/decisions.md, "Dependencies: in one group, or refused"), on every other store the
group changes nothing.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from fencegate.ledger.errors import (
    BadRequest,
    DependenciesPending,
    EventsGone,
    Fenced,
    StaleInput,
)
from fencegate.ledger.store import Store
from fencegate.ledger.tasks import (
    ClaimRequest,
    CommitRequest,
    Identity,
    RenewRequest,
    Task,
    TaskState,
)
from tests.conftest import build_test_store, make_config

TTL = 10_000


def claim_as(owner: str, epoch: int = 1) -> ClaimRequest:
    return ClaimRequest(owner=owner, ttl_ms=TTL, scheduler_epoch=epoch)


def commit_of(task: Task, result: str, cost: tuple[tuple[str, float], ...] = ()) -> CommitRequest:
    assert task.attempt_id is not None and task.claim_epoch is not None
    return CommitRequest(
        attempt_id=task.attempt_id,
        claim_generation=task.claim_generation,
        scheduler_epoch=task.claim_epoch,
        cancel_generation=task.cancel_generation,
        input_digest=task.input_digest,
        result_digest=result,
        cost=cost,
    )


def identity_of(task: Task) -> Identity:
    assert task.attempt_id is not None and task.owner is not None
    assert task.claim_epoch is not None
    return Identity(
        task.attempt_id, task.claim_generation, task.owner, task.claim_epoch, task.cancel_generation
    )


@pytest.fixture
async def flow_store(store_url: str, key_prefix: str) -> AsyncIterator[Store]:
    store = build_test_store(make_config(store_url, key_prefix))
    await store.open()
    try:
        yield store
    finally:
        await store.close()


# --- queues ------------------------------------------------------------------------------------


async def test_a_queue_hands_out_the_highest_priority_then_the_oldest(flow_store: Store) -> None:
    store = flow_store
    for task_id, priority in [("low", 0), ("high-1", 5), ("high-2", 5), ("mid", 1)]:
        await store.put_task(task_id, "in", None, queue="work", priority=priority)
        store.clock_offset_ms += 1  # distinct READY instants: "oldest" is well defined
    await store.put_task("elsewhere", "in", None, queue="other", priority=100)
    await store.put_task("by-id-only", "in", None)
    order = []
    while (task := await store.claim_next("work", claim_as("w"))) is not None:
        assert task.state is TaskState.CLAIMED and task.owner == "w"
        order.append(task.task_id)
    assert order == ["high-1", "high-2", "mid", "low"]
    assert await store.claim_next("nothing-here", claim_as("w")) is None


async def test_an_expired_claim_and_an_old_epoch_claim_are_found_again(flow_store: Store) -> None:
    store = flow_store
    await store.put_task("a", "in", None, queue="q")
    await store.put_task("b", "in", None, queue="q")
    first = await store.claim_next("q", claim_as("w1"))
    second = await store.claim_next("q", claim_as("w1"))
    assert first is not None and second is not None
    assert await store.claim_next("q", claim_as("w2")) is None  # both held
    store.clock_offset_ms += TTL  # both leases run out
    again = await store.claim_next("q", claim_as("w2"))
    assert again is not None and again.task_id == first.task_id
    assert again.claim_generation == first.claim_generation + 1
    assert [(d.task_id, d.reason) for d in again.discarded] == [(first.task_id, "expired")]
    # A bump frees the other at once, though its new lease has not run out.
    renewed = await store.claim_next("q", claim_as("w2"))
    assert renewed is not None and renewed.task_id == second.task_id
    scheduler = await store.bump_epoch()
    taken = await store.claim_next("q", claim_as("w3", scheduler.epoch))
    assert taken is not None and taken.claim_epoch == scheduler.epoch
    assert [d.reason for d in taken.discarded] == ["epoch"]
    # The old holders are fenced.
    with pytest.raises(Fenced):
        await store.commit(first.task_id, commit_of(first, "r"))


async def test_waiting_tasks_are_not_handed_out(flow_store: Store) -> None:
    store = flow_store
    await store.put_task("flow::first", "in", None, queue="q")
    await store.put_task(
        "flow::second", "in", None, queue="q", priority=9, depends_on=("flow::first",)
    )
    got = await store.claim_next("q", claim_as("w"))
    assert got is not None and got.task_id == "flow::first"
    assert await store.claim_next("q", claim_as("w")) is None
    with pytest.raises(DependenciesPending, match="flow::first"):
        await store.claim("flow::second", claim_as("w"))


async def test_two_gateways_draining_one_queue_never_share_a_task(
    store_url: str, key_prefix: str
) -> None:
    """Two store instances (as two gateway processes have) on one store, 20 workers, 200
    tasks: each task is committed exactly once, by the attempt that holds it."""
    config = make_config(store_url, key_prefix)
    stores = [build_test_store(config) for _ in range(2)]
    for store in stores:
        await store.open()
    try:
        for i in range(200):
            await stores[i % 2].put_task(f"job-{i:03d}", "in", None, queue="jobs", priority=i % 3)
        claims: Counter[str] = Counter()
        commits: Counter[str] = Counter()

        async def worker(n: int) -> None:
            store = stores[n % 2]
            while (task := await store.claim_next("jobs", claim_as(f"w{n}"))) is not None:
                claims[task.task_id] += 1
                await asyncio.sleep(0)
                done, replay = await store.commit(task.task_id, commit_of(task, f"r-{n}"))
                assert not replay and done.state is TaskState.COMMITTED
                commits[task.task_id] += 1

        await asyncio.gather(*(worker(n) for n in range(20)))
        assert len(commits) == 200 and set(commits.values()) == {1}
        assert set(claims.values()) == {1}  # no lease expired here: nothing was handed out twice
    finally:
        for store in stores:
            await store.close()


# --- dependencies --------------------------------------------------------------------------


async def test_a_fenced_first_step_keeps_its_successor_waiting_until_the_takeover_commits(
    flow_store: Store,
) -> None:
    store = flow_store
    await store.put_task("flow::extract", "in", None, queue="etl")
    await store.put_task("flow::load", "in", None, queue="etl", depends_on=("flow::extract",))
    slow = await store.claim_next("etl", claim_as("slow"))
    assert slow is not None and slow.task_id == "flow::extract"
    await store.renew(
        "flow::extract", RenewRequest(identity_of(slow), TTL, cost=(("tokens", 700.0),))
    )
    store.clock_offset_ms += TTL  # the slow worker pauses past its lease
    takeover = await store.claim_next("etl", claim_as("fast"))
    assert takeover is not None and takeover.task_id == "flow::extract"
    assert [(d.reason, d.cost) for d in takeover.discarded] == [("expired", (("tokens", 700.0),))]
    assert (await store.get_task("flow::load")).state is TaskState.WAITING
    with pytest.raises(Fenced):  # the slow worker wakes up and tries to commit
        await store.commit("flow::extract", commit_of(slow, "stale-result"))
    assert (await store.get_task("flow::load")).state is TaskState.WAITING
    assert await store.claim_next("etl", claim_as("other")) is None
    done, _ = await store.commit("flow::extract", commit_of(takeover, "good-result"))
    assert done.commit is not None
    load = await store.claim_next("etl", claim_as("fast"))
    assert load is not None and load.task_id == "flow::load"
    assert [(c.task_id, c.commit_id, c.result_digest) for c in load.dep_commits] == [
        ("flow::extract", done.commit.commit_id, "good-result")
    ]


async def test_a_cancel_cascades_to_open_dependents_only(flow_store: Store) -> None:
    store = flow_store
    await store.put_task("flow::root", "in", None)
    await store.put_task("flow::done-dep", "in", None)
    done_claim = await store.claim("flow::done-dep", claim_as("w"))
    await store.commit("flow::done-dep", commit_of(done_claim, "r"))
    await store.put_task("flow::child", "in", None, depends_on=("flow::root", "flow::done-dep"))
    await store.put_task("flow::grandchild", "in", None, queue="q", depends_on=("flow::child",))
    await store.put_task("flow::sibling", "in", None, depends_on=("flow::done-dep",))
    cancelled = await store.cancel("flow::root")
    assert cancelled.state is TaskState.CANCELLED
    for task_id in ("flow::child", "flow::grandchild"):
        task = await store.get_task(task_id)
        assert task.state is TaskState.CANCELLED and task.cancel_generation == 1
    assert (await store.get_task("flow::sibling")).state is TaskState.READY
    assert (await store.get_task("flow::done-dep")).state is TaskState.COMMITTED
    # A running dependent is cancelled too, and its attempt counted as discarded.
    await store.put_task("flow::root2", "in", None)
    await store.put_task("flow::running", "in", None, depends_on=("flow::done-dep",))
    await store.put_task("flow::after", "in", None, depends_on=("flow::root2", "flow::running"))
    run = await store.claim("flow::running", claim_as("w"))
    await store.renew(
        "flow::running", RenewRequest(identity_of(run), TTL, cost=(("seconds", 3.0),))
    )
    gone = await store.cancel("flow::root2")
    assert [d.task_id for d in gone.discarded] == []  # "running" does not depend on root2
    assert (await store.get_task("flow::after")).state is TaskState.CANCELLED
    assert (await store.get_task("flow::running")).state is TaskState.CLAIMED


async def test_cancelling_a_running_chain_discards_each_attempt(flow_store: Store) -> None:
    store = flow_store
    await store.put_task("flow::a", "in", None)
    await store.put_task("flow::b", "in", None)
    claim_b = await store.claim("flow::b", claim_as("w"))
    await store.renew("flow::b", RenewRequest(identity_of(claim_b), TTL, cost=(("tokens", 9.0),)))
    await store.put_task("flow::c", "in", None, depends_on=("flow::a",))
    # b is running and then gets "a" as a dependency by a new revision: it waits now.
    revised, _ = await store.put_task("flow::b", "in-2", None, depends_on=("flow::a",))
    assert revised.state is TaskState.WAITING
    assert [(d.task_id, d.reason, d.cost) for d in revised.discarded] == [
        ("flow::b", "superseded", (("tokens", 9.0),))
    ]
    cancelled = await store.cancel("flow::a")
    assert {(await store.get_task(t)).state for t in ("flow::b", "flow::c")} == {
        TaskState.CANCELLED
    }
    assert cancelled.discarded == ()  # nothing was running any more


async def test_a_new_revision_of_a_dependency_sends_open_dependents_back_to_waiting(
    flow_store: Store,
) -> None:
    store = flow_store
    await store.put_task("flow::dep", "in-1", None)
    first = await store.claim("flow::dep", claim_as("w"))
    dep_done, _ = await store.commit("flow::dep", commit_of(first, "v1"))
    await store.put_task("flow::built", "in", None, depends_on=("flow::dep",))
    await store.put_task("flow::running", "in", None, depends_on=("flow::dep",))
    built_claim = await store.claim("flow::built", claim_as("w"))
    await store.commit("flow::built", commit_of(built_claim, "built-on-v1"))
    running = await store.claim("flow::running", claim_as("w"))
    revised, _ = await store.put_task("flow::dep", "in-2", None)
    assert [(d.task_id, d.reason) for d in revised.discarded] == [("flow::running", "superseded")]
    now_waiting = await store.get_task("flow::running")
    assert now_waiting.state is TaskState.WAITING and now_waiting.dep_commits == ()
    with pytest.raises(StaleInput, match="dependency"):
        await store.commit("flow::running", commit_of(running, "built-on-v1"))
    # The committed dependent keeps the provenance it was built on.
    kept = await store.get_task("flow::built")
    assert kept.state is TaskState.COMMITTED and dep_done.commit is not None
    assert [c.commit_id for c in kept.dep_commits] == [dep_done.commit.commit_id]
    # The new revision commits: the waiting dependent is READY again, on the new provenance,
    # and its old attempt stays fenced out.
    second = await store.claim("flow::dep", claim_as("w"))
    dep_v2, _ = await store.commit("flow::dep", commit_of(second, "v2"))
    ready = await store.get_task("flow::running")
    assert ready.state is TaskState.READY and dep_v2.commit is not None
    assert [c.result_digest for c in ready.dep_commits] == ["v2"]
    with pytest.raises(StaleInput):
        await store.commit("flow::running", commit_of(running, "built-on-v1"))
    fresh = await store.claim("flow::running", claim_as("w"))
    assert fresh.claim_generation == running.claim_generation + 1


async def test_bad_dependencies_are_refused(flow_store: Store) -> None:
    store = flow_store
    with pytest.raises(BadRequest, match="no task flow::ghost"):
        await store.put_task("flow::a", "in", None, depends_on=("flow::ghost",))
    with pytest.raises(BadRequest, match="is this task"):
        await store.put_task("flow::a", "in", None, depends_on=("flow::a",))
    await store.put_task("flow::a", "in", None)
    await store.put_task("flow::b", "in", None, depends_on=("flow::a",))
    await store.put_task("flow::c", "in", None, depends_on=("flow::b",))
    with pytest.raises(BadRequest, match="a cycle"):
        await store.put_task("flow::a", "in-2", None, depends_on=("flow::c",))
    assert (await store.get_task("flow::a")).revision == 1  # nothing was written
    # The same input with other dependencies changes nothing (as for every other field).
    same, outcome = await store.put_task("flow::c", "in", None, depends_on=("flow::a",), queue="x")
    assert outcome.value == "UNCHANGED" and same.depends_on == ("flow::b",) and same.queue is None


async def test_a_task_may_have_only_so_many_dependents(flow_store: Store) -> None:
    store = flow_store
    store.max_dependents = 2  # [tasks] max_dependents
    await store.put_task("flow::hub", "in", None)
    await store.put_task("flow::d1", "in", None, depends_on=("flow::hub",))
    await store.put_task("flow::d2", "in", None, depends_on=("flow::hub",))
    with pytest.raises(BadRequest, match="already has 2 dependents"):
        await store.put_task("flow::d3", "in", None, depends_on=("flow::hub",))
    # Re-revising a dependent keeps its link: no new dependent is counted.
    await store.put_task("flow::d2", "in-2", None, depends_on=("flow::hub",))


# --- the change feed -----------------------------------------------------------------------


async def test_the_feed_resumes_from_a_position_and_says_when_it_cannot(flow_store: Store) -> None:
    store = flow_store
    _, start = await store.read_events(None, 100)
    await store.put_task("t", "in", None)
    claimed = await store.claim("t", claim_as("w"))
    first_page, middle = await store.read_events(start, 1)
    assert [e.body["state"] for e in first_page] == ["READY"]
    await store.commit("t", commit_of(claimed, "r"))
    rest, end = await store.read_events(middle, 100)
    assert [(e.body["type"], e.body["taskId"], e.body["state"]) for e in rest] == [
        ("task", "t", "CLAIMED"),
        ("task", "t", "COMMITTED"),
    ]
    assert rest[-1].body["claimGeneration"] == 1 and rest[-1].body["revision"] == 1
    assert (await store.read_events(end, 100))[0] == []
    # Trimming keeps the newest; a position before them is gone, one after is fine.
    assert await store.trim_events(1) >= 2
    with pytest.raises(EventsGone):
        await store.read_events(start, 100)
    assert (await store.read_events(end, 100))[0] == []
    with pytest.raises(BadRequest):
        await store.read_events("not-a-position", 10)


async def test_a_large_cascade_finishes_in_bounded_steps(flow_store: Store) -> None:
    """A cancel cascades to at most ``max_cascade`` tasks in its own step; the rest is
    recorded and ``continue_cascades`` finishes it, step by step. Until then the dependents
    not reached are WAITING: nothing can claim them."""
    store = flow_store
    store.max_cascade = 3
    await store.put_task("flow::root", "in", None)
    for i in range(4):
        await store.put_task(f"flow::child-{i}", "in", None, queue="q", depends_on=("flow::root",))
        for j in range(2):
            await store.put_task(
                f"flow::leaf-{i}-{j}", "in", None, depends_on=(f"flow::child-{i}",)
            )
    everything = [f"flow::child-{i}" for i in range(4)] + [
        f"flow::leaf-{i}-{j}" for i in range(4) for j in range(2)
    ]
    await store.cancel("flow::root")
    states = {t: (await store.get_task(t)).state for t in everything}
    assert set(states.values()) == {TaskState.CANCELLED, TaskState.WAITING}
    assert 3 <= sum(s is TaskState.CANCELLED for s in states.values()) < len(everything)
    assert await store.claim_next("q", claim_as("w")) is None
    steps = 0
    while await store.continue_cascades(3):
        steps += 1
        assert steps < 20
    assert steps >= 2
    for task_id in everything:
        assert (await store.get_task(task_id)).state is TaskState.CANCELLED, task_id
    assert await store.continue_cascades(3) == 0


async def test_a_revision_before_the_background_cascade_stops_it_there(flow_store: Store) -> None:
    store = flow_store
    store.max_cascade = 1
    await store.put_task("flow::root", "in", None)
    await store.put_task("flow::mid", "in", None, depends_on=("flow::root",))
    await store.put_task("flow::leaf", "in", None, depends_on=("flow::mid",))
    await store.cancel("flow::root")  # cancels "flow::mid", records it for the rest
    assert (await store.get_task("flow::mid")).state is TaskState.CANCELLED
    assert (await store.get_task("flow::leaf")).state is TaskState.WAITING
    with pytest.raises(BadRequest, match="root is cancelled"):  # it would wait forever
        await store.put_task("flow::mid", "in-2", None)
    reopened, _ = await store.put_task("flow::mid", "in-2", None, depends_on=())
    assert reopened.state is TaskState.READY
    while await store.continue_cascades(10):
        pass
    assert (await store.get_task("flow::leaf")).state is TaskState.WAITING


async def test_a_cancelled_task_cannot_become_a_dependency(flow_store: Store) -> None:
    store = flow_store
    await store.put_task("flow::gone", "in", None)
    await store.cancel("flow::gone")
    with pytest.raises(BadRequest, match="gone is cancelled"):
        await store.put_task("flow::after", "in", None, depends_on=("flow::gone",))


async def test_task_events_name_the_queue(flow_store: Store) -> None:
    store = flow_store
    _, start = await store.read_events(None, 10)
    await store.put_task("in-q", "in", None, queue="q")
    await store.put_task("no-q", "in", None)
    events, _ = await store.read_events(start, 10)
    assert [(e.body["taskId"], e.body["queue"]) for e in events] == [
        ("in-q", "q"),
        ("no-q", None),
    ]


@pytest.mark.parametrize(
    "position", ["\u00b2-1", "1-\u0661", "9" * 30 + "-1", "99999999999999999999-1", "-1", "1-"]
)
async def test_a_position_no_store_issued_is_a_bad_request(
    flow_store: Store, position: str
) -> None:
    with pytest.raises(BadRequest):
        await flow_store.read_events(position, 10)
