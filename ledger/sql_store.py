"""What the SQL stores share: every transition of ``Store`` as a shared step of
``ledger.sql_steps``, so a SQL store supplies only its dialect, how it runs a step (connection,
transaction, locking) and its clock.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TypeVar

from fencegate.ledger import sql_steps
from fencegate.ledger.effects import Effect, EffectRequest, EffectState, Fence, PrepareOutcome
from fencegate.ledger.events import Event
from fencegate.ledger.queries import Gauges, TaskFilter
from fencegate.ledger.store import EffectTransition, Store, decode_cursor, new_id
from fencegate.ledger.tasks import (
    ClaimRequest,
    CommitRequest,
    Identity,
    PutOutcome,
    RenewRequest,
    Scheduler,
    Task,
)

__all__ = ["SqlStore"]

T = TypeVar("T")


class SqlStore(Store):
    """A store whose transitions are ``ledger.sql_steps`` steps."""

    #: The store's SQL fragments (row locks, scheduler locks, JSON access).
    dialect: sql_steps.Dialect

    @abc.abstractmethod
    async def _steps(self, make: Callable[[], sql_steps.Step[T]], op: str) -> T:
        """Run the step ``make`` builds as one atomic transaction (``op`` names it for
        metrics). ``make`` is called where and when the step runs, once per attempt."""

    def _windows_from(self) -> int | None:
        """Records created before this store instant get no resend window (a store whose
        clock may lose downtime says when; None: it never does). Called inside ``make``."""
        return None

    # --- transitions ------------------------------------------------------------------------

    async def put_task(
        self,
        task_id: str,
        input_digest: str,
        max_runtime_ms: int | None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        depends_on: tuple[str, ...] | None = None,
    ) -> tuple[Task, PutOutcome]:
        return await self._steps(
            lambda: sql_steps.put_task(
                self.dialect,
                task_id,
                input_digest,
                max_runtime_ms,
                queue=queue,
                priority=priority,
                depends_on=depends_on,
                max_dependents=self.max_dependents,
            ),
            "put_task",
        )

    async def get_task(self, task_id: str) -> Task:
        return await self._steps(lambda: sql_steps.get_task(self.dialect, task_id), "get_task")

    async def list_tasks(
        self, wanted: TaskFilter, limit: int, after: str | None
    ) -> tuple[list[Task], str | None]:
        return await self._steps(
            lambda: sql_steps.list_tasks(self.dialect, wanted, limit, after), "list_tasks"
        )

    async def claim(self, task_id: str, request: ClaimRequest) -> Task:
        attempt_id = new_id()
        return await self._steps(
            lambda: sql_steps.claim(self.dialect, task_id, request, self.policy, attempt_id),
            "claim",
        )

    async def claim_next(self, queue: str, request: ClaimRequest) -> Task | None:
        attempt_id = new_id()
        return await self._steps(
            lambda: sql_steps.claim_next(self.dialect, queue, request, self.policy, attempt_id),
            "claim_next",
        )

    async def renew(self, task_id: str, request: RenewRequest) -> Task:
        return await self._steps(
            lambda: sql_steps.renew(self.dialect, task_id, request, self.policy), "renew"
        )

    async def release(self, task_id: str, identity: Identity) -> Task:
        return await self._steps(
            lambda: sql_steps.release(self.dialect, task_id, identity), "release"
        )

    async def commit(self, task_id: str, request: CommitRequest) -> tuple[Task, bool]:
        commit_id = new_id()
        return await self._steps(
            lambda: sql_steps.commit(self.dialect, task_id, request, commit_id), "commit"
        )

    async def cancel(self, task_id: str) -> Task:
        return await self._steps(
            lambda: sql_steps.cancel(self.dialect, task_id, self.max_cascade), "cancel"
        )

    async def continue_cascades(self, limit: int) -> int:
        return await self._steps(
            lambda: sql_steps.continue_cascades(self.dialect, limit), "continue_cascades"
        )

    async def get_scheduler(self) -> Scheduler:
        return await self._steps(lambda: sql_steps.get_scheduler(self.dialect), "get_scheduler")

    async def bump_epoch(self) -> Scheduler:
        return await self._steps(lambda: sql_steps.bump_epoch(self.dialect), "bump_epoch")

    async def set_claims_paused(self, paused: bool) -> Scheduler:
        return await self._steps(
            lambda: sql_steps.set_claims_paused(self.dialect, paused), "set_claims_paused"
        )

    # --- the change feed ------------------------------------------------------------------------

    async def read_events(self, after: str | None, limit: int) -> tuple[list[Event], str]:
        return await self._steps(
            lambda: sql_steps.read_events(self.dialect, after, limit), "read_events"
        )

    async def trim_events(self, keep: int) -> int:
        return await self._steps(lambda: sql_steps.trim_events(self.dialect, keep), "trim_events")

    # --- the idempotency ledger -------------------------------------------------------------

    async def check_fence(self, fence: Fence) -> Task:
        return await self._steps(lambda: sql_steps.check_fence(self.dialect, fence), "check_fence")

    async def prepare_effect(
        self,
        request: EffectRequest,
        forward_deadline_ms: int,
        *,
        resend_window_ms: int | None = None,
        require_approval: bool = False,
    ) -> PrepareOutcome:
        return await self._steps(
            lambda: sql_steps.prepare_effect(
                self.dialect,
                request,
                forward_deadline_ms,
                resend_window_ms=resend_window_ms,
                require_approval=require_approval,
                windows_from=self._windows_from(),
            ),
            "prepare_effect",
        )

    async def complete_effect(
        self,
        task_id: str,
        effect_id: str,
        seq: int,
        attempt_id: str,
        outcome: EffectState,
        reason: str,
        response_json: str | None,
    ) -> tuple[Effect, bool]:
        return await self._steps(
            lambda: sql_steps.complete_effect(
                self.dialect, effect_id, seq, attempt_id, outcome, reason, response_json
            ),
            "complete_effect",
        )

    async def get_effect(self, effect_id: str) -> Effect:
        return await self._steps(
            lambda: sql_steps.get_effect(self.dialect, effect_id), "get_effect"
        )

    async def list_effects(
        self,
        *,
        state: EffectState | None,
        task_id: str | None,
        downstream: str | None,
        limit: int,
        cursor: str | None,
    ) -> tuple[list[Effect], str | None]:
        after = decode_cursor(cursor) if cursor else (-1, "")
        return await self._steps(
            lambda: sql_steps.list_effects(
                self.dialect,
                state=state,
                task_id=task_id,
                downstream=downstream,
                limit=limit,
                after=after,
            ),
            "list_effects",
        )

    async def unsettled_effects(
        self, limit: int, probe_downstreams: frozenset[str]
    ) -> list[Effect]:
        return await self._steps(
            lambda: sql_steps.unsettled_effects(self.dialect, limit, probe_downstreams),
            "unsettled_effects",
        )

    async def find_forward(self, task_id: str, forward_id: str) -> str | None:
        return await self._steps(
            lambda: sql_steps.find_forward(self.dialect, task_id, forward_id), "find_forward"
        )

    async def gauges(self) -> Gauges:
        return await self._steps(lambda: sql_steps.gauges(self.dialect), "gauges")

    async def update_effect(self, effect_id: str, transition: EffectTransition) -> Effect:
        return await self._steps(
            lambda: sql_steps.update_effect(self.dialect, effect_id, transition), "update_effect"
        )
