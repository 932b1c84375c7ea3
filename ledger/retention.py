"""Retention: which settled records may go, and what stays behind when they do.

Nothing a live decision needs may be deleted. A task goes only when it is settled
(COMMITTED or CANCELLED) for ``settled_ms``, none of its effects is PREPARED, UNKNOWN or
awaiting approval (an operator still has to look at those), and no task that depends on it
still exists (a dependent's new revision re-reads its dependencies). Its effects go with it:
an effect record lives and dies with its task.

What stays is a **tombstone** per task and per effect, for ``tombstone_ms``: without one, a
late PUT of the same task id would create it again at revision 1, its worker would derive the
same effectIds (``effects.effect_id`` of task, revision, node, slot) and the downstream would
get the old idempotency keys as new work. With one:

- a PUT of the same input is refused (``TaskExpired``): the work was done, it is not run again;
- a PUT of a new input creates the task at the tombstone's revision + 1, its claim and cancel
  generations continuing (``tasks.put``): new effectIds, and fencing tokens that never go
  backwards for that task id;
- every other call naming the task or one of its effects is answered ``TASK_EXPIRED`` /
  ``EFFECT_EXPIRED`` (410): a late duplicate of an expired effect is refused, never forwarded.

Stores keep the settled tasks in an index ordered by when they settled (``due_at``), so a
sweep reads the oldest few, never the whole store. A task found still needed is moved to the
back (``due_at`` = now): every sweep makes progress however many tasks are held.

No I/O here: records and ``now`` in, decisions out. The stores mirror ``why_kept``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from fencegate.ledger.effects import Effect, EffectState, effective, is_awaiting_approval
from fencegate.ledger.errors import EffectExpired
from fencegate.ledger.tasks import Task, TaskState, Tombstone, expired_task

__all__ = [
    "SETTLED_TASK_STATES",
    "EffectTombstone",
    "ExpiryReport",
    "StoreStats",
    "Tombstone",
    "effect_tombstones",
    "expired_effect",
    "expired_task",
    "tombstone",
    "why_kept",
    "why_kept_keyed",
]

#: The task states retention may delete (and the stores' settled index holds).
SETTLED_TASK_STATES = frozenset({TaskState.COMMITTED, TaskState.CANCELLED})


@dataclass(frozen=True, slots=True)
class EffectTombstone:
    """What is remembered of an expired effect until ``forget_at``."""

    effect_id: str
    #: None for a keyed effect (``effects.Effect.kind``), which has no task.
    task_id: str | None
    #: COMMITTED or NOT_APPLIED.
    state: EffectState
    expired_at: int
    forget_at: int


@dataclass(frozen=True, slots=True)
class ExpiryReport:
    """What one sweep step did."""

    #: Settled tasks and settled keyed effects read from their indexes.
    examined: int = 0
    expired_tasks: int = 0
    expired_effects: int = 0
    #: Examined tasks found still needed (moved to the back of the index), by reason.
    kept: dict[str, int] = field(default_factory=dict)
    #: Tombstones (task and effect) past ``forget_at`` that were removed.
    forgotten: int = 0

    @property
    def busy(self) -> bool:
        """Did the step find anything to look at (so the sweep should go on at once)?"""
        return bool(self.examined or self.forgotten)


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Sizes, from the store's own indexes and counters (no scan of the records)."""

    tasks: int
    #: CLAIMED tasks (live or with a lease run out).
    claimed_tasks: int
    #: COMMITTED or CANCELLED tasks (the settled index).
    settled_tasks: int
    #: Settled tasks whose ``settled_ms`` has passed: expired by the next sweeps unless still
    #: needed (``why_kept``).
    due_tasks: int
    effects: int
    prepared_effects: int
    unknown_effects: int
    awaiting_approval: int
    task_tombstones: int
    effect_tombstones: int
    events: int
    #: What the store occupies (SQLite: the database file's used pages; Redis: used_memory;
    #: PostgreSQL: the tables and indexes), or None where it cannot tell.
    bytes: int | None
    #: Per table or structure, where the store can tell.
    bytes_detail: dict[str, int] = field(default_factory=dict)


def why_kept(task: Task, effects: Iterable[Effect], has_dependents: bool, now: int) -> str | None:
    """None when ``task`` (settled for long enough: the index says so) and its effects may
    go now; otherwise why not: ``open`` (not settled any more), ``dependents`` (a task that
    depends on it still exists), ``unsettled_effect`` (PREPARED or UNKNOWN: its outcome is
    not known), ``awaiting_approval``.

    Mirrors: ``expire_one`` in ``lua/retention.lua``, the SQL stores' ``expire_settled``."""
    if task.state not in SETTLED_TASK_STATES:
        return "open"
    if has_dependents:
        return "dependents"
    current = [effective(effect, now) for effect in effects]
    if any(e.state in (EffectState.PREPARED, EffectState.UNKNOWN) for e in current):
        return "unsettled_effect"
    if any(is_awaiting_approval(e) for e in current):
        return "awaiting_approval"
    return None


def why_kept_keyed(effect: Effect, now: int) -> str | None:
    """None when a keyed effect the keyed index holds (``effects.keyed_settled``, due for
    ``settled_ms``) may go now; otherwise why not, in ``why_kept``'s words: it has no task,
    no dependents, and goes alone, never while its outcome is unknown or it waits for an
    operator. Its tombstone answers a late duplicate of its key ``EFFECT_EXPIRED`` until
    ``forget_at``; after that the key is new.

    Mirrors: the keyed part of ``lua/retention.lua``, the SQL stores' ``expire_settled``."""
    current = effective(effect, now)
    if current.state in (EffectState.PREPARED, EffectState.UNKNOWN):
        return "unsettled_effect"
    if is_awaiting_approval(current):
        return "awaiting_approval"
    return None


def tombstone(task: Task, effects: int, now: int, tombstone_ms: int) -> Tombstone:
    return Tombstone(
        task_id=task.task_id,
        revision=task.revision,
        claim_generation=task.claim_generation,
        cancel_generation=task.cancel_generation,
        input_digest=task.input_digest,
        state=task.state,
        expired_at=now,
        forget_at=now + tombstone_ms,
        effects=effects,
    )


def effect_tombstones(
    effects: Iterable[Effect], now: int, tombstone_ms: int
) -> list[EffectTombstone]:
    return [
        EffectTombstone(e.effect_id, e.task_id, e.state, now, now + tombstone_ms) for e in effects
    ]


def expired_effect(stone: EffectTombstone) -> EffectExpired:
    if stone.task_id is None:
        return EffectExpired(
            f"keyed effect {stone.effect_id} was {stone.state.value} and expired at expiredAt "
            f"{stone.expired_at}: nothing was done; its idempotency key is new again at "
            f"forgetAt {stone.forget_at}",
            expiredAt=stone.expired_at,
            effectState=stone.state.value,
            forgetAt=stone.forget_at,
        )
    return EffectExpired(
        f"effect {stone.effect_id} of task {stone.task_id} was {stone.state.value} and "
        f"expired at expiredAt {stone.expired_at} with its task: nothing was done",
        expiredAt=stone.expired_at,
        effectState=stone.state.value,
    )
