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

import re
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
    "EFFECT_ID_OR_PREFIX",
    "EFFECT_ID_RULE",
    "MIN_EFFECT_PREFIX",
    "Blocker",
    "Gauges",
    "TaskFilter",
    "effect_prefix_bounds",
    "effects_with_prefix",
    "find_forward",
    "gauges",
    "is_lease_active",
    "is_lease_expired",
    "is_probe_due",
    "page_tasks",
    "switch_blockers",
    "unsettled_effects",
]


@dataclass(frozen=True, slots=True)
class Gauges:
    """What is in flight right now, across every gateway sharing the store (``gauges``)."""

    active_leases: int
    prepared_effects: int
    #: Every UNKNOWN effect, leased and keyed: the rollback checklist's gauge.
    unknown_effects: int
    awaiting_approval: int
    #: The keyed ones among ``unknown_effects`` (a lease-less client's, ``Effect.kind``
    #: ``keyed``), so the metric can say whose calls wait for an operator or a probe; the
    #: leased ones are the difference. Last, with a default, so that every existing
    #: positional construction keeps its meaning.
    unknown_keyed_effects: int = 0

    @property
    def settled(self) -> bool:
        """Nothing held, nothing in flight, nothing unknown, nothing waiting: safe to switch
        worker pools (``switch_blockers`` is empty)."""
        return not switch_blockers(self)


@dataclass(frozen=True, slots=True)
class Blocker:
    """One reason it is not yet safe to switch worker pools: a gauge that is not zero."""

    #: The ``Gauges`` field that is not zero.
    gauge: str
    count: int
    #: In words, with the count: ``2 leases held``, ``1 effect UNKNOWN``.
    reason: str


#: The rollback checklist, in order: each gauge that must be zero, and its words (one, many).
_SWITCH_RULES: tuple[tuple[str, str, str], ...] = (
    ("active_leases", "lease held", "leases held"),
    ("prepared_effects", "effect in flight (PREPARED)", "effects in flight (PREPARED)"),
    ("unknown_effects", "effect UNKNOWN", "effects UNKNOWN"),
    ("awaiting_approval", "effect awaiting approval", "effects awaiting approval"),
)


def switch_blockers(gauges: Gauges) -> tuple[Blocker, ...]:
    """Why it is not safe to switch worker pools, by how much: every gauge of the rollback
    checklist that is not zero, in checklist order (empty: safe). The one rule the API's
    ``GET /v1/rollout``, ``fencegate rollout status`` and the console's Fleet page say."""
    found: list[Blocker] = []
    for gauge, one, many in _SWITCH_RULES:
        count: int = getattr(gauges, gauge)
        if count:
            found.append(Blocker(gauge, count, f"{count} {one if count == 1 else many}"))
    return tuple(found)


def is_lease_active(task: Task, now: int) -> bool:
    """Does a worker hold this task right now (CLAIMED, lease not yet expired)?

    Mirrors: the leases index (``index_lease`` in ``lua/common.lua``, scored by the expiry)
    counted by ``lua/gauges.lua``, and the SQL stores' ``Dialect.active_lease`` condition."""
    return (
        task.state is TaskState.CLAIMED
        and task.lease_expires_at is not None
        and now < task.lease_expires_at
    )


def is_lease_expired(task: Task, now: int) -> bool:
    """Is this task CLAIMED by a lease that has run out (``leaseExpiresAt`` reached, nobody
    has claimed or released it since)? The negation of ``is_lease_active`` within CLAIMED:
    what ``GET /v1/tasks?leaseExpired=true`` lists (``TaskFilter``)."""
    return task.state is TaskState.CLAIMED and not is_lease_active(task, now)


def gauges(tasks: Iterable[Task], effects: Iterable[Effect], now: int) -> Gauges:
    """The gauges' definitions: active leases; PREPARED effects still running; UNKNOWN
    effects, counting a PREPARED past its deadline (it reads UNKNOWN); effects awaiting an
    operator's approval; and of the UNKNOWN ones (by the same rule), the keyed ones.

    Mirrors: ``lua/gauges.lua`` (Redis) and ``sql_steps.gauges`` (SQLite, PostgreSQL)."""
    views = [effective(e, now) for e in effects]
    unknown = [e for e in views if e.state is EffectState.UNKNOWN]
    return Gauges(
        active_leases=sum(1 for t in tasks if is_lease_active(t, now)),
        prepared_effects=sum(1 for e in views if e.state is EffectState.PREPARED),
        unknown_effects=len(unknown),
        awaiting_approval=sum(1 for e in views if is_awaiting_approval(e)),
        unknown_keyed_effects=sum(1 for e in unknown if e.kind == "keyed"),
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
    claim's label), the task id prefixes the caller's scope allows (None: any), and whether
    the lease has run out (``is_lease_expired`` at the store's ``now``; None: either)."""

    state: TaskState | None = None
    owner: str | None = None
    prefixes: tuple[str, ...] | None = None
    lease_expired: bool | None = None

    def admits_id(self, task_id: str) -> bool:
        """Decidable from the id alone, before the record is read."""
        return self.prefixes is None or task_id.startswith(self.prefixes)

    def admits(self, task: Task, now: int) -> bool:
        """``now``: the store's clock (read only when ``lease_expired`` is set)."""
        return (
            self.admits_id(task.task_id)
            and (self.state is None or task.state is self.state)
            and (self.owner is None or task.owner == self.owner)
            and (self.lease_expired is None or is_lease_expired(task, now) is self.lease_expired)
        )


def page_tasks(
    scanned: Sequence[tuple[str, Task | None]],
    more: bool,
    wanted: TaskFilter,
    limit: int,
    now: int,
) -> tuple[list[Task], str | None]:
    """One page of ``GET /v1/tasks`` from the ids a store scanned after the cursor, in task
    id order, each with its record (None: not read, e.g. outside the caller's scope);
    ``more``: the store stopped scanning before the end; ``now``: the store's clock, for
    ``TaskFilter.lease_expired``. Returns the matching tasks (at most ``limit``) and the
    task id to continue after, None at the end.

    A store scans a bounded number of ids per request, so a filter that matches little
    answers a short (even empty) page with a cursor instead of reading the whole table.
    Both stores page through this function."""
    found: list[Task] = []
    for i, (task_id, task) in enumerate(scanned):
        if task is not None and wanted.admits(task, now):
            found.append(task)
            if len(found) == limit:
                rest = more or i < len(scanned) - 1
                return found, task_id if rest else None
    return found, scanned[-1][0] if more and scanned else None


#: Fewest characters of an effect id a prefix lookup takes (``effects_with_prefix``).
MIN_EFFECT_PREFIX = 6
#: An effect id (``ledger.effects.effect_id``: SHA-256, lowercase hex) or a prefix of one.
_EFFECT_HEX = frozenset("0123456789abcdef")
#: What the API, the console and the CLI take where an effect id goes, and the words for it.
EFFECT_ID_OR_PREFIX = re.compile(f"[0-9a-f]{{{MIN_EFFECT_PREFIX},64}}")
EFFECT_ID_RULE = (
    f"an effect id is 64 lowercase hex characters, or a unique prefix of at least "
    f"{MIN_EFFECT_PREFIX}"
)


def effect_prefix_bounds(prefix: str) -> tuple[str, str]:
    """The id range ``[low, high)`` holding exactly the effect ids that start with
    ``prefix`` (lowercase hex): ``high`` is ``prefix`` followed by ``g``, which sorts after
    every hex character. The SQL stores' range condition and ``lua/effect_prefix.lua`` use
    these bounds."""
    if not prefix or not set(prefix) <= _EFFECT_HEX:
        raise ValueError(f"an effect id prefix is lowercase hex: {prefix!r}")
    return prefix, prefix + "g"


def effects_with_prefix(effect_ids: Iterable[str], prefix: str, limit: int) -> list[str]:
    """The first ``limit`` of the (live) effect ids that start with ``prefix``, in id order:
    what ``Store.find_effects`` answers (``GET /v1/effects/{prefix}`` is one record when
    exactly one matches).

    Mirrors: the SQL stores' range query on the effects' primary key and
    ``lua/effect_prefix.lua`` over the effect ids index."""
    low, high = effect_prefix_bounds(prefix)
    return sorted(i for i in effect_ids if low <= i < high)[:limit]
