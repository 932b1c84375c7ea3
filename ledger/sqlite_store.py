"""The embedded store: one SQLite file, one gateway process, zero set-up.

Every transition runs as ``BEGIN IMMEDIATE`` -> read -> pure function -> write -> ``COMMIT`` on
one connection owned by one worker thread, so transitions are serialised and a crash at any
point leaves either the old record or the new one. The journal is WAL with
``synchronous=FULL`` by default: a transition answered to a client survives power loss.
``NORMAL`` is offered for hosts that accept losing the last transactions on power loss (not on
a process crash) in exchange for fewer fsyncs; see docs/stores.md.

The store's clock is the gateway host's wall clock (there is one process, so one clock).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ledger import tasks
from ledger.errors import FencegateError, NoSuchTask, StoreUnavailable
from ledger.store import Store, new_id
from ledger.tasks import (
    ClaimRequest,
    CommitRequest,
    Identity,
    LeasePolicy,
    PutOutcome,
    RenewRequest,
    Scheduler,
    Task,
)

__all__ = ["SQLiteStore"]

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    task_id TEXT PRIMARY KEY,
    fields  TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS scheduler (
    id     INTEGER PRIMARY KEY CHECK (id = 1),
    epoch  INTEGER NOT NULL,
    paused INTEGER NOT NULL
);
INSERT OR IGNORE INTO scheduler (id, epoch, paused) VALUES (1, 1, 0);
"""


class SQLiteStore(Store):
    def __init__(
        self,
        path: str,
        policy: LeasePolicy,
        *,
        timeout_ms: int = 2000,
        synchronous: str = "FULL",
    ) -> None:
        super().__init__(policy)
        if synchronous not in ("FULL", "NORMAL"):
            raise ValueError("synchronous must be FULL or NORMAL")
        self.path = path
        self._timeout_s = timeout_ms / 1000
        self._synchronous = synchronous
        # One thread owns the connection: sqlite3 objects must not be shared across threads,
        # and one writer at a time is all SQLite offers anyway.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fencegate-sqlite")
        self._conn: sqlite3.Connection | None = None

    @property
    def kind(self) -> str:
        return "sqlite"

    # --- plumbing ---------------------------------------------------------------------------

    def _connect(self) -> None:
        conn = sqlite3.connect(
            self.path, timeout=self._timeout_s, isolation_level=None, check_same_thread=False
        )
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self._synchronous}")
        conn.executescript(_SCHEMA)
        self._conn = conn

    def _clock(self) -> int:
        return time.time_ns() // 1_000_000 + self.clock_offset_ms

    def _transaction(self, fn: Callable[[sqlite3.Connection, int], T]) -> T:
        conn = self._conn
        if conn is None:
            raise StoreUnavailable("the SQLite store is not open")
        conn.execute("BEGIN IMMEDIATE")
        try:
            result = fn(conn, self._clock())
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        return result

    async def _run(self, fn: Callable[[sqlite3.Connection, int], T]) -> T:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._timeout_s):
                return await loop.run_in_executor(self._executor, self._transaction, fn)
        except FencegateError:
            raise
        except (sqlite3.Error, OSError) as exc:
            raise StoreUnavailable(f"SQLite store failed: {exc}") from exc
        except TimeoutError as exc:
            raise StoreUnavailable("SQLite store did not answer within its timeout") from exc

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self._connect)
        except (sqlite3.Error, OSError) as exc:
            raise StoreUnavailable(f"cannot open SQLite store {self.path!r}: {exc}") from exc

    async def close(self) -> None:
        def _close() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        await asyncio.get_running_loop().run_in_executor(self._executor, _close)
        self._executor.shutdown(wait=True)

    async def ping(self) -> None:
        await self._run(lambda conn, now: conn.execute("SELECT 1").fetchone())

    async def now_ms(self) -> int:
        return self._clock()

    # --- rows -------------------------------------------------------------------------------

    @staticmethod
    def _load(conn: sqlite3.Connection, task_id: str) -> Task | None:
        row = conn.execute("SELECT fields FROM tasks WHERE task_id = ?", (task_id,)).fetchone()
        return tasks.task_from_fields(json.loads(row[0])) if row else None

    @staticmethod
    def _save(conn: sqlite3.Connection, task: Task) -> None:
        conn.execute(
            "INSERT INTO tasks (task_id, fields) VALUES (?, ?) "
            "ON CONFLICT (task_id) DO UPDATE SET fields = excluded.fields",
            (task.task_id, json.dumps(tasks.task_to_fields(task), separators=(",", ":"))),
        )

    @staticmethod
    def _scheduler(conn: sqlite3.Connection) -> Scheduler:
        epoch, paused = conn.execute("SELECT epoch, paused FROM scheduler WHERE id = 1").fetchone()
        return Scheduler(epoch=int(epoch), claims_paused=bool(paused))

    @staticmethod
    def _save_scheduler(conn: sqlite3.Connection, scheduler: Scheduler) -> None:
        conn.execute(
            "UPDATE scheduler SET epoch = ?, paused = ? WHERE id = 1",
            (scheduler.epoch, int(scheduler.claims_paused)),
        )

    # --- transitions ------------------------------------------------------------------------

    async def put_task(
        self, task_id: str, input_digest: str, max_runtime_ms: int | None
    ) -> tuple[Task, PutOutcome]:
        def step(conn: sqlite3.Connection, now: int) -> tuple[Task, PutOutcome]:
            task, outcome = tasks.put(
                self._load(conn, task_id), task_id, input_digest, max_runtime_ms, now
            )
            if outcome is not PutOutcome.UNCHANGED:
                self._save(conn, task)
            return task, outcome

        return await self._run(step)

    async def get_task(self, task_id: str) -> Task:
        def step(conn: sqlite3.Connection, now: int) -> Task:
            task = self._load(conn, task_id)
            if task is None:
                raise NoSuchTask()
            return task

        return await self._run(step)

    async def claim(self, task_id: str, request: ClaimRequest) -> Task:
        attempt_id = new_id()

        def step(conn: sqlite3.Connection, now: int) -> Task:
            task = tasks.claim(
                self._load(conn, task_id),
                self._scheduler(conn),
                request,
                self.policy,
                now,
                attempt_id,
            )
            self._save(conn, task)
            return task

        return await self._run(step)

    async def renew(self, task_id: str, request: RenewRequest) -> Task:
        def step(conn: sqlite3.Connection, now: int) -> Task:
            task = tasks.renew(
                self._load(conn, task_id), self._scheduler(conn), request, self.policy, now
            )
            self._save(conn, task)
            return task

        return await self._run(step)

    async def release(self, task_id: str, identity: Identity) -> Task:
        def step(conn: sqlite3.Connection, now: int) -> Task:
            task = tasks.release(self._load(conn, task_id), identity, now)
            self._save(conn, task)
            return task

        return await self._run(step)

    async def commit(self, task_id: str, request: CommitRequest) -> tuple[Task, bool]:
        commit_id = new_id()

        def step(conn: sqlite3.Connection, now: int) -> tuple[Task, bool]:
            task, replay = tasks.commit(
                self._load(conn, task_id), self._scheduler(conn), request, now, commit_id
            )
            if not replay:
                self._save(conn, task)
            return task, replay

        return await self._run(step)

    async def cancel(self, task_id: str) -> Task:
        def step(conn: sqlite3.Connection, now: int) -> Task:
            task = tasks.cancel(self._load(conn, task_id), now)
            self._save(conn, task)
            return task

        return await self._run(step)

    async def get_scheduler(self) -> Scheduler:
        return await self._run(lambda conn, now: self._scheduler(conn))

    async def bump_epoch(self) -> Scheduler:
        def step(conn: sqlite3.Connection, now: int) -> Scheduler:
            scheduler = tasks.bump_epoch(self._scheduler(conn))
            self._save_scheduler(conn, scheduler)
            return scheduler

        return await self._run(step)

    async def set_claims_paused(self, paused: bool) -> Scheduler:
        def step(conn: sqlite3.Connection, now: int) -> Scheduler:
            scheduler = tasks.set_claims_paused(self._scheduler(conn), paused)
            self._save_scheduler(conn, scheduler)
            return scheduler

        return await self._run(step)
