"""The change feed: one event per change of a task's state or revision and of an effect's
state, appended by the step that made the change (so a subscriber misses none, crash or not).

Each store keeps its own log (Redis: a stream; SQLite and PostgreSQL: an ``events`` table
filled by triggers on the tasks and effects tables) and answers ``Store.read_events`` from a
position: an opaque string, ordered within one store, never reused. Positions are the SSE
event ids of ``GET /v1/events``. Old events are dropped by ``Store.trim_events``; a position
older than what is kept is ``EventsGone`` (410), so a subscriber learns it missed some instead
of silently skipping them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_EVENT_PAGE", "Event", "effect_event", "task_event"]

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
