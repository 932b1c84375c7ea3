"""The steps that walk several tasks: one owner for the rules across the dependency graph.

``ledger.tasks`` decides for one task (``check_dependencies``, ``dependency_committed``,
``dependency_revised``, ``cancel_dependent``). What a step does with the graph around it is
here, as pure functions over a mapping task id -> record:

- a put refuses new dependencies that would close a cycle (``check_no_cycle``) and, on a
  store with buckets (Redis Cluster), a dependency of another task group
  (``check_same_group``);
- a first commit is offered to every dependent, the last one makes it READY
  (``release_dependents``); a committed task's new revision sends them back to WAITING
  (``revise_dependents``);
- a cancel cancels the open dependents, transitively (``cancel_cascade``).

The stores cannot hand their whole graph to Python inside one atomic step, so each walks it
itself, in the same order (dependents in task id order, breadth first, each task once) and
with the same limits; they mirror these functions:

- SQL (SQLite, PostgreSQL): ``ledger/sql_steps.py`` (``_walk_for_cycle``, ``put_task``,
  ``commit``, ``_cascade``);
- Redis: ``ledger/lua/put.lua`` (the cycle check) and ``ledger/lua/task_lib.lua``
  (``update_dependents``, ``cascade``).

``tests/test_stateful.py`` runs these functions as its model and holds all three stores to
them on random histories (``tests/test_task_graph.py`` pins the walks' order and limits).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from fencegate.ledger import tasks
from fencegate.ledger.buckets import GROUP_SEPARATOR, task_group
from fencegate.ledger.errors import BadRequest
from fencegate.ledger.tasks import Task

__all__ = [
    "Cascade",
    "Graph",
    "GroupOf",
    "cancel_cascade",
    "check_no_cycle",
    "check_same_group",
    "cross_group",
    "dependents",
    "one_group",
    "release_dependents",
    "revise_dependents",
]

#: The records a walk may read, by task id; a missing id (or None) is no such task.
Graph = Mapping[str, Task | None]

#: Which placement group a task id is in: ``ledger.buckets.task_group`` on Redis Cluster,
#: ``one_group`` on every other store.
GroupOf = Callable[[str], str]


def one_group(task_id: str) -> str:
    """The group function of a store without buckets (one Redis, SQLite, PostgreSQL): every
    task is in one group, so ``check_same_group`` refuses nothing there."""
    return ""


def check_same_group(task_id: str, depends_on: Iterable[str], group_of: GroupOf) -> None:
    """Refuse a dependency of another task group than ``task_id``'s.

    The last dependency's commit makes a dependent READY in the same atomic step, and on
    Redis Cluster a step touches one bucket (one hash slot), so dependent and dependency
    must share one (docs/decisions.md, "Dependencies: in one group, or refused"). The rule is
    the group, not the bucket: two groups that happen to share a bucket today would not after
    a ``store copy`` to another bucket count, so what is accepted must not depend on it. The
    refusal (400 BAD_REQUEST) names the first such dependency and both groups, and says how
    to share one: ``<group>::<name>`` ids. A put makes this check before it reads any
    dependency (on a cluster it cannot read another bucket's task in its step), so it comes
    before ``ledger.tasks.check_dependencies`` and the cycle walk."""
    home = group_of(task_id)
    for dep in depends_on:
        if group_of(dep) != home:
            raise cross_group(task_id, dep)


def _shown(group: str) -> str:
    """A group as a refusal names it: an id starting with ``::`` has the empty group, which
    printed bare would read as a word missing."""
    return group or "'' (the empty group of an id starting with ::)"


def cross_group(task_id: str, dep: str) -> BadRequest:
    """The refusal of ``check_same_group``: both groups, and the ids that would work."""
    group, dep_group = task_group(task_id), task_group(dep)
    _, sep, name = dep.partition(GROUP_SEPARATOR)
    suggestion = f"{group}{GROUP_SEPARATOR}{name if sep else dep}"
    return BadRequest(
        f"dependsOn: {dep} (task group {_shown(dep_group)}) is not in this task's group "
        f"{_shown(group)}; on "
        "redis+cluster:// a task may depend only on tasks of its own group: give them one "
        f"group with <group>::<name> ids, e.g. {suggestion}"
    )


def dependents(graph: Graph, task_id: str) -> list[str]:
    """The tasks that depend on ``task_id``, in task id order: the order every store walks
    them (SQL ``ORDER BY dependent_id``, Lua ``sorted_members``), which shows in the order
    of a step's ``discarded``."""
    return sorted(
        other for other, task in graph.items() if task is not None and task_id in task.depends_on
    )


def check_no_cycle(
    graph: Graph,
    task_id: str,
    added: Iterable[str],
    max_visits: int = tasks.MAX_GRAPH_VISITS,
) -> None:
    """Would ``task_id`` depending on ``added`` (its new dependencies) close a cycle?

    Follows ``depends_on`` from ``added``, breadth first, each task once; a task with no
    record is visited (and counted) but leads nowhere. Raises ``tasks.cycle`` naming the
    first task met that depends on ``task_id``, or ``tasks.graph_too_large`` once more than
    ``max_visits`` tasks were visited, before proving anything: a refusal, never a guess.
    Only an existing task's new dependencies need it (a new task has no dependents yet)."""
    seen: set[str] = set()
    frontier = list(added)
    head = 0
    while head < len(frontier):
        current = frontier[head]
        head += 1
        if current in seen:
            continue
        seen.add(current)
        if len(seen) > max_visits:
            raise tasks.graph_too_large()
        record = graph.get(current)
        for dep in record.depends_on if record is not None else ():
            if dep == task_id:
                raise tasks.cycle(task_id, current)
            frontier.append(dep)


def release_dependents(graph: Graph, committed: Task, now: int) -> dict[str, Task]:
    """``committed`` just got its first commit: each dependent records it
    (``tasks.dependency_committed``; the last dependency to commit makes a WAITING one
    READY). The dependents it changed, in walk order."""
    changed: dict[str, Task] = {}
    for dependent_id in dependents(graph, committed.task_id):
        record = graph.get(dependent_id)
        after = record and tasks.dependency_committed(record, committed, now)
        if after:
            changed[dependent_id] = after
    return changed


def revise_dependents(graph: Graph, task_id: str, now: int) -> dict[str, Task]:
    """A committed ``task_id`` got a new revision: each dependent built on its commit drops
    it and waits again (``tasks.dependency_revised``; a running attempt is discarded). The
    dependents it changed, in walk order (their ``discarded`` join the put's)."""
    changed: dict[str, Task] = {}
    for dependent_id in dependents(graph, task_id):
        record = graph.get(dependent_id)
        after = record and tasks.dependency_revised(record, task_id, now)
        if after:
            changed[dependent_id] = after
    return changed


@dataclass(frozen=True, slots=True)
class Cascade:
    """What one step of a cancel's cascade did."""

    #: The dependents it cancelled, in the order it cancelled them.
    changed: dict[str, Task]
    #: Cancelled tasks whose dependents are still to be visited once ``limit`` was reached
    #: (each once, in walk order): the stores record them for ``continue_cascades``.
    pending: tuple[str, ...]

    @property
    def discarded(self) -> tuple[tasks.Discard, ...]:
        """The attempts the cascade discarded, in the order it cancelled their tasks."""
        return tuple(d for task in self.changed.values() for d in task.discarded)


def cancel_cascade(graph: Graph, frontier: Iterable[str], now: int, limit: int) -> Cascade:
    """Cancel the open dependents of the (cancelled) tasks in ``frontier``, transitively,
    breadth first (``tasks.cancel_dependent``): a dependent it changed passes the cancel on
    to its own dependents, a committed or already cancelled one stops it, so each task is
    cancelled once. Before each next task of the frontier it checks ``limit``: once that
    many were cancelled it stops (a task's dependents are all visited together, so it may go
    past ``limit`` by one task's fan-out), and the frontier left is ``pending``."""
    records = dict(graph)
    changed: dict[str, Task] = {}
    queue = list(frontier)
    head = 0
    while head < len(queue) and len(changed) < limit:
        current = queue[head]
        head += 1
        for dependent_id in dependents(records, current):
            record = records.get(dependent_id)
            after = record and tasks.cancel_dependent(record, now)
            if after:
                records[dependent_id] = after
                changed[dependent_id] = after
                queue.append(dependent_id)
    return Cascade(changed, tuple(dict.fromkeys(queue[head:])))
