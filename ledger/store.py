"""The one interface both stores implement, and the factory that picks one from a URL.

A store owns time (``now`` is read from the store, never from a worker) and atomicity: each
method is one atomic step that reads what it needs, applies a pure transition from
``ledger.tasks`` and writes the result, or writes nothing and raises a ``FencegateError``.
Any failure to reach the store surfaces as ``StoreUnavailable``, never as a driver exception.
"""

from __future__ import annotations

import abc
import uuid

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

__all__ = ["Store", "new_id", "open_store"]


def new_id() -> str:
    """Opaque ids for attempts and commits: random, so a restarted gateway never reuses one."""
    return uuid.uuid4().hex


class Store(abc.ABC):
    """Durable lease state. ``clock_offset_ms`` exists for tests only (see ``tests/``): it is
    added to the store's time source so expiry can be driven without sleeping, and no config
    key reaches it."""

    clock_offset_ms: int = 0

    def __init__(self, policy: LeasePolicy) -> None:
        self.policy = policy

    @property
    @abc.abstractmethod
    def kind(self) -> str:
        """``sqlite`` or ``redis``: a label for logs and metrics."""

    @abc.abstractmethod
    async def open(self) -> None:
        """Connect and prepare (schema, scripts, durability checks)."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def ping(self) -> None:
        """One round trip; raises StoreUnavailable when the store cannot answer."""

    @abc.abstractmethod
    async def now_ms(self) -> int:
        """The store's clock, the only clock leases are measured against."""

    @abc.abstractmethod
    async def put_task(
        self, task_id: str, input_digest: str, max_runtime_ms: int | None
    ) -> tuple[Task, PutOutcome]: ...

    @abc.abstractmethod
    async def get_task(self, task_id: str) -> Task: ...

    @abc.abstractmethod
    async def claim(self, task_id: str, request: ClaimRequest) -> Task: ...

    @abc.abstractmethod
    async def renew(self, task_id: str, request: RenewRequest) -> Task: ...

    @abc.abstractmethod
    async def release(self, task_id: str, identity: Identity) -> Task: ...

    @abc.abstractmethod
    async def commit(self, task_id: str, request: CommitRequest) -> tuple[Task, bool]:
        """Returns the task and True when this was a replay of an earlier identical commit."""

    @abc.abstractmethod
    async def cancel(self, task_id: str) -> Task: ...

    @abc.abstractmethod
    async def get_scheduler(self) -> Scheduler: ...

    @abc.abstractmethod
    async def bump_epoch(self) -> Scheduler: ...

    @abc.abstractmethod
    async def set_claims_paused(self, paused: bool) -> Scheduler: ...


def open_store(
    url: str,
    policy: LeasePolicy,
    *,
    timeout_ms: int,
    sqlite_synchronous: str = "FULL",
    redis_key_prefix: str = "fg",
    redis_password: str | None = None,
) -> Store:
    """Build (not yet open) the store a URL names: ``sqlite:///rel.db``,
    ``sqlite:////abs.db`` or ``redis://host:port/db`` (``rediss://`` for TLS)."""
    if url.startswith("sqlite:///"):
        from ledger.sqlite_store import SQLiteStore

        path = url[len("sqlite:///") :]  # relative to the working directory, or absolute
        return SQLiteStore(path, policy, timeout_ms=timeout_ms, synchronous=sqlite_synchronous)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from ledger.redis_store import RedisStore

        return RedisStore(
            url, policy, timeout_ms=timeout_ms, key_prefix=redis_key_prefix, password=redis_password
        )
    raise ValueError(f"unsupported store url {url!r}: use sqlite:///PATH or redis://HOST:PORT/DB")
