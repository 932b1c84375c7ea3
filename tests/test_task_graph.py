"""``ledger.task_graph``: the order and the limits of the walks over several tasks.

The stores mirror these walks (SQL steps, Lua) and ``tests/test_stateful.py`` holds them to
this module on random histories of three tasks; what three tasks cannot show (the order of
a wider fan-out, the visit bound, a cascade past its limit) is pinned here.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from fencegate.ledger import buckets, task_graph, tasks
from fencegate.ledger.errors import BadRequest
from fencegate.ledger.tasks import Commit, Task, TaskState

NOW = 1_800_000_000_000


def task(task_id: str, *deps: str, state: TaskState = TaskState.WAITING) -> Task:
    return Task(
        task_id=task_id,
        state=state,
        revision=1,
        input_digest="in",
        created_at=NOW,
        updated_at=NOW,
        depends_on=deps,
        attempt_id="a-" + task_id if state is TaskState.CLAIMED else None,
    )


def graph(*records: Task) -> dict[str, Task | None]:
    return {t.task_id: t for t in records}


def test_dependents_are_walked_in_task_id_order() -> None:
    g = graph(task("root", state=TaskState.READY), task("c", "root"), task("a", "root"),
              task("b", "root"), task("x"))  # fmt: skip
    assert task_graph.dependents(g, "root") == ["a", "b", "c"]


def test_a_cycle_is_named_by_the_first_task_met_breadth_first() -> None:
    # t would depend on a and b; a -> m -> t and b -> t: b is met first (one step away).
    g = graph(task("t"), task("a", "m"), task("m", "t"), task("b", "t"))
    with pytest.raises(BadRequest, match="dependsOn: b depends on t"):
        task_graph.check_no_cycle(g, "t", ["a", "b"])
    task_graph.check_no_cycle(g, "m", ["b2"])  # no record: leads nowhere


def test_the_cycle_walk_refuses_past_its_bound_missing_tasks_counted() -> None:
    g = graph(task("t"), task("a", "ghost1", "ghost2"))
    task_graph.check_no_cycle(g, "t", ["a"], max_visits=3)
    with pytest.raises(BadRequest, match="too large"):
        task_graph.check_no_cycle(g, "t", ["a"], max_visits=2)


def test_a_first_commit_releases_the_dependents_its_commit_completes() -> None:
    committed = replace(
        task("d", state=TaskState.COMMITTED),
        commit=Commit("c1", "x", claim_generation=1, result_digest="r", committed_at=NOW),
    )
    g = graph(committed, task("both", "d", "other"), task("only", "d"), task("unrelated"))
    changed = task_graph.release_dependents(g, committed, NOW + 1)
    assert list(changed) == ["both", "only"]
    assert changed["only"].state is TaskState.READY
    assert changed["both"].state is TaskState.WAITING and len(changed["both"].dep_commits) == 1


def test_a_cancel_cascades_transitively_once_each_and_stops_at_a_commit() -> None:
    g = graph(
        task("root", state=TaskState.CANCELLED),
        task("a", "root", state=TaskState.CLAIMED),
        task("b", "root", "a"),  # reached through root and through a: cancelled once
        task("done", "root", state=TaskState.COMMITTED),
        task("after_done", "done"),  # the committed task stops the cascade
    )
    cascade = task_graph.cancel_cascade(g, ["root"], NOW, limit=100)
    assert list(cascade.changed) == ["a", "b"]
    assert all(t.state is TaskState.CANCELLED for t in cascade.changed.values())
    assert [d.task_id for d in cascade.discarded] == ["a"]
    assert cascade.pending == ()


def test_a_cascade_past_its_limit_leaves_the_frontier_pending() -> None:
    """The limit is checked before each next task of the frontier: root's dependents are
    all cancelled together (past a limit of 1), and theirs are left for later."""
    g = graph(task("root", state=TaskState.CANCELLED), task("a", "root"), task("b", "root"),
              task("c", "a"))  # fmt: skip
    cascade = task_graph.cancel_cascade(g, ["root"], NOW, limit=1)
    assert list(cascade.changed) == ["a", "b"]
    assert cascade.pending == ("a", "b")
    rest = task_graph.cancel_cascade({**g, **cascade.changed}, cascade.pending, NOW, limit=1)
    assert list(rest.changed) == ["c"] and rest.pending == ("b", "c")


def test_revising_a_committed_task_sends_its_dependents_back_to_waiting() -> None:
    dep = tasks.DepCommit("d", "c1", "r")
    g = graph(
        task("d", state=TaskState.READY),
        replace(task("run", "d", state=TaskState.CLAIMED), dep_commits=(dep,)),
        task("never", "d"),  # had no commit of d: unchanged
    )
    changed = task_graph.revise_dependents(g, "d", NOW)
    assert list(changed) == ["run"]
    assert changed["run"].state is TaskState.WAITING
    assert [d.reason for d in changed["run"].discarded] == ["superseded"]


_cluster = buckets.task_group  # the cluster store's group function


def test_a_dependency_of_another_group_is_refused_naming_both_groups() -> None:
    with pytest.raises(BadRequest) as refused:
        task_graph.check_same_group(
            "order-17::email", ["order-17::charge", "order-18::charge"], _cluster
        )
    assert refused.value.status == 400 and refused.value.code == "BAD_REQUEST"
    assert refused.value.detail == (
        "dependsOn: order-18::charge (task group order-18) is not in this task's group "
        "order-17; on redis+cluster:// a task may depend only on tasks of its own group: give "
        "them one group with <group>::<name> ids, e.g. order-17::charge"
    )
    # As the store words it: the task first (FencegateError.about).
    assert refused.value.about_task("order-17::email").detail.startswith(
        "task order-17::email: dependsOn: order-18::charge"
    )


def test_groups_that_share_a_bucket_are_still_refused() -> None:
    """What is accepted must not depend on the bucket count (a store copy may change it)."""
    home = buckets.bucket_of_task("order-17", 2)
    other = next(f"order-{n}" for n in range(18, 1000)
                 if buckets.bucket_of_task(f"order-{n}", 2) == home)  # fmt: skip
    with pytest.raises(BadRequest):
        task_graph.check_same_group("order-17::email", [f"{other}::charge"], _cluster)


def test_a_dependency_of_the_same_group_is_never_refused() -> None:
    task_graph.check_same_group(
        "order-17::email", ["order-17::charge", "order-17", "order-17::x::y"], _cluster
    )


def test_an_ungrouped_dependency_is_suggested_a_grouped_id() -> None:
    with pytest.raises(BadRequest, match=r"e\.g\. order-17::order-18$"):
        task_graph.check_same_group("order-17", ["order-18"], _cluster)


def test_stores_without_buckets_refuse_no_dependency_for_its_group() -> None:
    task_graph.check_same_group(
        "order-17", ["order-18", "reports/2026-12-01"], task_graph.one_group
    )
