"""What the SQL stores share: every transition of ``Store`` as a shared step of
``ledger.sql_steps``, so a SQL store supplies only its dialect, how it runs a step (connection,
transaction, locking) and its clock.

Every step that names one task or one effect runs through ``_named``, the one place a
NO_SUCH_TASK / NO_SUCH_EFFECT becomes TASK_EXPIRED / EFFECT_EXPIRED when a tombstone remembers
the id (``sql_steps.expired_refusal``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TypeVar

from fencegate.ledger import sql_steps
from fencegate.ledger.effects import Effect, EffectRequest, EffectState, Fence, PrepareOutcome
from fencegate.ledger.events import Event
from fencegate.ledger.queries import Gauges, TaskFilter
from fencegate.ledger.retention import ExpiryReport, StoreStats
from fencegate.ledger.store import EffectTransition, Migration, Store, decode_cursor, new_id
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
    #: The schema version the store was in when this process opened it, before the upgrade
    #: the opening made (None: a new store): what ``migrate`` reports.
    schema_found: int | None = None

    @abc.abstractmethod
    async def _steps(self, make: Callable[[], sql_steps.Step[T]], op: str) -> T:
        """Run the step ``make`` builds as one atomic transaction (``op`` names it for
        metrics). ``make`` is called where and when the step runs, once per attempt."""

    async def _named(
        self,
        make: Callable[[], sql_steps.Step[T]],
        op: str,
        *,
        task_id: str | None = None,
        effect_id: str | None = None,
    ) -> T:
        """``_steps`` for a step naming ``task_id`` or ``effect_id``: a refusal saying it does
        not exist says it expired when a live tombstone remembers it (same transaction)."""
        return await self._steps(
            lambda: sql_steps.expired_refusal(make(), task_id=task_id, effect_id=effect_id), op
        )

    async def migrate(self) -> Migration:
        """The upgrade itself happens when a store is opened (``open``: one transaction, every
        step idempotent, the version row last), so an interrupted one is simply done again;
        this reports what the opening found and did."""
        found, current = self.schema_found, sql_steps.SCHEMA_VERSION
        if found is None or found >= current:
            return Migration(self.kind, found, current)
        return Migration(
            self.kind,
            found,
            current,
            done=(
                f"schema upgraded from version {found} to {current} as the store was opened "
                "(new tables, indexes and triggers; the settled index filled from the tasks; "
                "the keyed effects' index)",
            ),
            notes=(
                f"gateways of schema version {found} that are running keep working (the "
                "upgrade only adds; its triggers index their writes too), but one restarted "
                "refuses the store: upgrade them all",
                "turn client_idempotency_keys on only once every gateway is upgraded: a "
                "gateway of version 3 or older cannot read a keyed effect's record (no task "
                "fields) and answers 500 where it meets one (reading, listing, reconciling)",
            ),
        )

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
        return await self._named(
            lambda: sql_steps.get_task(self.dialect, task_id), "get_task", task_id=task_id
        )

    async def list_tasks(
        self, wanted: TaskFilter, limit: int, after: str | None
    ) -> tuple[list[Task], str | None]:
        return await self._steps(
            lambda: sql_steps.list_tasks(self.dialect, wanted, limit, after), "list_tasks"
        )

    async def claim(self, task_id: str, request: ClaimRequest) -> Task:
        attempt_id = new_id()
        return await self._named(
            lambda: sql_steps.claim(self.dialect, task_id, request, self.policy, attempt_id),
            "claim",
            task_id=task_id,
        )

    async def claim_next(self, queue: str, request: ClaimRequest) -> Task | None:
        attempt_id = new_id()
        return await self._steps(
            lambda: sql_steps.claim_next(self.dialect, queue, request, self.policy, attempt_id),
            "claim_next",
        )

    async def renew(self, task_id: str, request: RenewRequest) -> Task:
        return await self._named(
            lambda: sql_steps.renew(self.dialect, task_id, request, self.policy),
            "renew",
            task_id=task_id,
        )

    async def release(self, task_id: str, identity: Identity) -> Task:
        return await self._named(
            lambda: sql_steps.release(self.dialect, task_id, identity), "release", task_id=task_id
        )

    async def commit(self, task_id: str, request: CommitRequest) -> tuple[Task, bool]:
        commit_id = new_id()
        return await self._named(
            lambda: sql_steps.commit(self.dialect, task_id, request, commit_id),
            "commit",
            task_id=task_id,
        )

    async def cancel(self, task_id: str) -> Task:
        return await self._named(
            lambda: sql_steps.cancel(self.dialect, task_id, self.max_cascade),
            "cancel",
            task_id=task_id,
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
        return await self._named(
            lambda: sql_steps.check_fence(self.dialect, fence), "check_fence", task_id=fence.task_id
        )

    async def prepare_effect(
        self,
        request: EffectRequest,
        forward_deadline_ms: int,
        *,
        resend_window_ms: int | None = None,
        require_approval: bool = False,
    ) -> PrepareOutcome:
        return await self._named(
            lambda: sql_steps.prepare_effect(
                self.dialect,
                request,
                forward_deadline_ms,
                resend_window_ms=resend_window_ms,
                require_approval=require_approval,
                windows_from=self._windows_from(),
            ),
            "prepare_effect",
            # A keyed request names no task: its refusals are about its effect.
            task_id=None if request.fence is None else request.fence.task_id,
            effect_id=request.effect_id,
        )

    async def complete_effect(
        self,
        task_id: str | None,
        effect_id: str,
        seq: int,
        attempt_id: str,
        outcome: EffectState,
        reason: str,
        response_json: str | None,
    ) -> tuple[Effect, bool]:
        return await self._named(
            lambda: sql_steps.complete_effect(
                self.dialect, effect_id, seq, attempt_id, outcome, reason, response_json
            ),
            "complete_effect",
            effect_id=effect_id,
        )

    async def get_effect(self, effect_id: str) -> Effect:
        return await self._named(
            lambda: sql_steps.get_effect(self.dialect, effect_id), "get_effect", effect_id=effect_id
        )

    async def find_effects(self, prefix: str, limit: int) -> list[str]:
        return await self._steps(lambda: sql_steps.find_effects(prefix, limit), "find_effects")

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

    async def awaiting_approval(self, limit: int) -> list[Effect]:
        return await self._steps(
            lambda: sql_steps.awaiting_approval(self.dialect, limit), "awaiting_approval"
        )

    async def find_forward(self, task_id: str, forward_id: str) -> str | None:
        return await self._steps(
            lambda: sql_steps.find_forward(self.dialect, task_id, forward_id), "find_forward"
        )

    async def gauges(self) -> Gauges:
        return await self._steps(lambda: sql_steps.gauges(self.dialect), "gauges")

    async def update_effect(self, effect_id: str, transition: EffectTransition) -> Effect:
        return await self._named(
            lambda: sql_steps.update_effect(self.dialect, effect_id, transition),
            "update_effect",
            effect_id=effect_id,
        )

    # --- retention --------------------------------------------------------------------------

    async def expire_settled(self, settled_ms: int, tombstone_ms: int, limit: int) -> ExpiryReport:
        return await self._steps(
            lambda: sql_steps.expire_settled(self.dialect, settled_ms, tombstone_ms, limit),
            "expire_settled",
        )

    async def store_stats(self, settled_ms: int) -> StoreStats:
        return await self._steps(
            lambda: sql_steps.store_stats(self.dialect, settled_ms), "store_stats"
        )
