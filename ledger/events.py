"""The change feed: one event per change of a task's state or revision and of an effect's
state, appended by the step that made the change (so a subscriber misses none, crash or not).

Each store keeps its own log (Redis: a stream; SQLite and PostgreSQL: an ``events`` table
filled by triggers on the tasks and effects tables) and answers ``Store.read_events`` from a
position: an opaque string, ordered within one store, never reused. Positions are the SSE
event ids of ``GET /v1/events``. Old events are dropped by ``Store.trim_events``; a position
older than what is kept is ``EventsGone`` (410), so a subscriber learns it missed some instead
of silently skipping them. So is one ahead of the newest position the store has issued: the
store lost events it had issued (``gone`` is the rule of every store; each supplies only its
numbers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fencegate.ledger.errors import EventsGone

__all__ = ["MAX_EVENT_PAGE", "Event", "Position", "effect_event", "gone", "task_event"]

#: Most events one ``read_events`` call answers.
MAX_EVENT_PAGE = 1000


@dataclass(frozen=True, slots=True)
class Event:
    #: Where the feed stands after this event (resume after it with this position).
    position: str
    #: ``task_event`` or ``effect_event``.
    body: dict[str, Any]


def task_event(
    task_id: str, state: str, queue: str | None, revision: int, claim_generation: int, at: int
) -> dict[str, Any]:
    """The shape of a task event (each store writes exactly these members)."""
    return {
        "type": "task",
        "taskId": task_id,
        "state": state,
        "queue": queue,
        "revision": revision,
        "claimGeneration": claim_generation,
        "at": at,
    }


def effect_event(
    effect_id: str, task_id: str | None, state: str, downstream: str, at: int
) -> dict[str, Any]:
    return {
        "type": "effect",
        "effectId": effect_id,
        "taskId": task_id,
        "state": state,
        "downstream": downstream,
        "at": at,
    }


#: A position as a store compares it: two numbers, in lexicographic order. Redis: the stream
#: id's ms and seq; SQLite and PostgreSQL: the event row's xid and seq; the cluster store: one
#: such stream id per bucket, each judged on its own.
Position = tuple[int, int]


def _text(position: Position) -> str:
    return f"{position[0]}-{position[1]}"


def gone(after: Position, *, dropped: Position | None, newest: Position) -> EventsGone | None:
    """``EventsGone`` (410) when a subscriber reading after ``after`` would miss events; None
    when every event after it is still to come. Returned, not raised: the caller raises it.

    - ``dropped``: the newest event the store trimmed away (None: none yet). Below it, the
      events up to it were missed; at it, none (it was the subscriber's last).
    - ``newest``: the newest position the store has issued, an event's or its end's (it only
      grows while the store keeps what it issued, trims included). Above it, the position came
      from a store that had issued more than this one has: events were lost (a failover that
      lost writes, a restore of an older copy). The subscriber saw events the store no longer
      has, and would skip, silently, those the store writes next up to its position. At
      ``newest``: nothing after it yet."""
    if dropped is not None and after < dropped:
        return EventsGone(
            f"events up to position {_text(dropped)} were dropped (the store keeps the newest "
            "ones, [events] retain); read the current state again and follow from now"
        )
    if after > newest:
        return EventsGone(
            f"position {_text(after)} is ahead of the newest event this store has issued "
            f"(position {_text(newest)}): the store lost events it had issued (a failover that "
            "lost writes, or a restore of an older copy); read the current state again and "
            "follow from now"
        )
    return None
