"""Every Redis key fencegate writes, in one place.

A task's keys carry its id as the hash tag (``{taskId}``) so one script can touch all of them
on one slot. Task ids cannot contain braces (the id grammar forbids them), so the tag is
exactly the id.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Keys"]


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "fg"

    def task(self, task_id: str) -> str:
        return f"{self.prefix}:{{{task_id}}}:task"

    @property
    def scheduler(self) -> str:
        return f"{self.prefix}:scheduler"
