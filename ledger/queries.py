"""What the stores' read-side queries answer, defined once over plain records.

Each store answers these from its own indexes (SQL conditions, Redis sorted sets and sets kept
by the Lua scripts), for speed and atomicity; this module says what the right answer is. Every
mirror names the function it mirrors, and ``tests/test_stateful.py`` holds every store to
these functions on random histories. The per-record rules they build on live beside the
records: ``ledger.effects.is_overdue`` (a PREPARED past its deadline reads UNKNOWN),
``ledger.effects.is_awaiting_approval`` and ``is_lease_active`` below.

No I/O here: records and ``now`` in, answers out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fencegate.ledger.effects import (
    Effect,
    EffectState,
    effective,
    is_awaiting_approval,
    is_overdue,
)
from fencegate.ledger.tasks import Task, TaskState

__all__ = [
    "Gauges",
    "TaskFilter",
    "find_forward",
    "gauges",
    "is_lease_active",
    "is_probe_due",
    "page_tasks",
    "unsettled_effects",
]


@dataclass(frozen=True, slots=True)
class Gauges:
    """What is in flight right now, across every gateway sharing the store (``gauges``)."""

    active_leases: int
    prepared_effects: int
    unknown_effects: int
    awaiting_approval: int

    @property
    def settled(self) -> bool:
        """Nothing held, nothing in flight, nothing unknown, nothing waiting: safe to switch
        worker pools."""
        return not (
            self.active_leases
            or self.prepared_effects
            or self.unknown_effects
            or self.awaiting_approval
        )


def is_lease_active(task: Task, now: int) -> bool:
    """Does a worker hold this task right now (CLAIMED, lease not yet expired)?

    Mirrors: the leases index (``index_lease`` in ``lua/common.lua``, scored by the expiry)
    counted by ``lua/gauges.lua``, and the SQL stores' ``Dialect.active_lease`` condition."""
    return (
        task.state is TaskState.CLAIMED
        and task.lease_expires_at is not None
        and now < task.lease_expires_at
    )


def gauges(tasks: Iterable[Task], effects: Iterable[Effect], now: int) -> Gauges:
    """The gauges' definitions: active leases; PREPARED effects still running; UNKNOWN
    effects, counting a PREPARED past its deadline (it reads UNKNOWN); effects awaiting an
    operator's approval.

    Mirrors: ``lua/gauges.lua`` (Redis) and ``SQLiteStore.gauges``."""
    views = [effective(e, now) for e in effects]
    return Gauges(
        active_leases=sum(1 for t in tasks if is_lease_active(t, now)),
        prepared_effects=sum(1 for e in views if e.state is EffectState.PREPARED),
        unknown_effects=sum(1 for e in views if e.state is EffectState.UNKNOWN),
        awaiting_approval=sum(1 for e in views if is_awaiting_approval(e)),
    )


def find_forward(effects: Iterable[Effect], forward_id: str) -> str | None:
    """Of one task's effect records, the effectId whose last forward is ``forward_id``.

    Both stores read the task's records and call this (``Store.find_forward``)."""
    for effect in effects:
        if effect.attempts and effect.attempts[-1].forward_id == forward_id:
            return effect.effect_id
    return None


def is_probe_due(effect: Effect, now: int, probe_downstreams: frozenset[str]) -> bool:
    """Is this an UNKNOWN effect of a downstream with a probe whose next probe is due (never
    probed counts as due)? An overdue PREPARED is not: the reconciler writes its expiry first.

    Mirrors: the probe-due index (``index_effect`` in ``lua/effect_lib.lua``, read by
    ``RedisStore.unsettled_effects``) and the SQLite store's probe query."""
    return (
        effect.state is EffectState.UNKNOWN
        and effect.downstream in probe_downstreams
        and (effect.next_probe_at or 0) <= now
    )


def unsettled_effects(
    effects: Iterable[Effect], now: int, limit: int, probe_downstreams: frozenset[str]
) -> list[Effect]:
    """The reconciler's work list (``Store.unsettled_effects``), as of ``now``: up to
    ``limit`` PREPARED effects past their deadline, by deadline, then up to ``limit`` UNKNOWN
    effects of ``probe_downstreams`` whose next probe is due, in the order they fall due. Each
    is returned as it reads at ``now`` (``effective``).

    The stores keep this order up to ties (the same deadline, or the same due time); the model
    test compares which effects are listed."""
    records = list(effects)
    overdue = sorted(
        (e for e in records if is_overdue(e, now)),
        key=lambda e: (e.deadline_at or 0, e.effect_id),
    )[:limit]
    due = sorted(
        (e for e in records if is_probe_due(e, now, probe_downstreams)),
        key=lambda e: (e.next_probe_at or 0, e.created_at, e.effect_id),
    )[:limit]
    return [effective(e, now) for e in overdue + due]


@dataclass(frozen=True, slots=True)
class TaskFilter:
    """What ``GET /v1/tasks`` asks for: the stored state, the owner (the current or last
    claim's label), and the task id prefixes the caller's scope allows (None: any)."""

    state: TaskState | None = None
    owner: str | None = None
    prefixes: tuple[str, ...] | None = None

    def admits_id(self, task_id: str) -> bool:
        """Decidable from the id alone, before the record is read."""
        return self.prefixes is None or task_id.startswith(self.prefixes)

    def admits(self, task: Task) -> bool:
        return (
            self.admits_id(task.task_id)
            and (self.state is None or task.state is self.state)
            and (self.owner is None or task.owner == self.owner)
        )


def page_tasks(
    scanned: Sequence[tuple[str, Task | None]], more: bool, wanted: TaskFilter, limit: int
) -> tuple[list[Task], str | None]:
    """One page of ``GET /v1/tasks`` from the ids a store scanned after the cursor, in task
    id order, each with its record (None: not read, e.g. outside the caller's scope);
    ``more``: the store stopped scanning before the end. Returns the matching tasks (at
    most ``limit``) and the task id to continue after, None at the end.

    A store scans a bounded number of ids per request, so a filter that matches little
    answers a short (even empty) page with a cursor instead of reading the whole table.
    Both stores page through this function."""
    found: list[Task] = []
    for i, (task_id, task) in enumerate(scanned):
        if task is not None and wanted.admits(task):
            found.append(task)
            if len(found) == limit:
                rest = more or i < len(scanned) - 1
                return found, task_id if rest else None
    return found, scanned[-1][0] if more and scanned else None
