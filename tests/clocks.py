"""A clock a test moves by hand, for code that takes an injected clock (the SDK's leases,
``fencegate.lease.Clock``; the gateway's ``ForwardWindow`` and ``TokenBucket``, which read a
plain ``() -> float``: pass ``clock.now``).

Time stands still until the test calls ``advance``: a loaded machine can make the event loop
slow, never the clock, so "within one renewal period" is something a test sets up and then
checks, not a race it may lose.
"""

from __future__ import annotations

import asyncio
import time

from fencegate.ledger.clock import ClockSources
from fencegate.ledger.cluster_store import ClusterStore
from fencegate.ledger.postgres_store import PostgresStore
from fencegate.ledger.redis_store import RedisStore
from fencegate.ledger.sqlite_store import SQLiteStore
from fencegate.ledger.store import Store

__all__ = ["ManualClock", "freeze_store_clock", "still"]


def freeze_store_clock(store: Store) -> Store:
    """``store`` (not yet opened) with its clock standing at the instant of this call: only
    ``clock_offset_ms`` (``Api.advance``) moves it. For tests that drive expiry by hand, so
    that the real time a loaded machine takes between two steps never counts as lease time.
    """
    at_ms = time.time_ns() // 1_000_000
    if isinstance(store, SQLiteStore):
        # A host whose clocks never move (ledger/clock.py): store time stays at ``at_ms``.
        store._clock_sources = ClockSources(
            wall_ms=lambda: at_ms, boot_ms=lambda: 0, boot_id=lambda: "frozen"
        )
    elif isinstance(store, RedisStore | PostgresStore | ClusterStore):
        store.clock_pinned_ms = at_ms  # the cluster store pins every bucket view's clock
    else:
        raise TypeError(f"no frozen clock for {type(store).__name__}")
    return store


def still() -> float:
    """A clock that stands still: ``create_app(config, forward_clock=still)`` for a test whose
    point is not the forward start limit. No time passes between a prepare and its forward
    however slow the machine, so a loaded machine's slow prepare still starts its forward
    (the downstream's own timeouts still bound it, in real time)."""
    return 0.0


class ManualClock:
    """``now()`` in seconds, moved only by ``advance``; ``sleep(s)`` returns once the clock
    has been advanced ``s`` past the moment it was called (a sleep of 0 or less yields once).
    """

    def __init__(self, start: float = 1_000.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []
        self._asleep = asyncio.Event()

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        waker: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (self._now + seconds, waker)
        self._sleepers.append(entry)
        self._asleep.set()
        try:
            await waker
        finally:
            if entry in self._sleepers:
                self._sleepers.remove(entry)
            if not self._sleepers:
                self._asleep.clear()

    @property
    def sleepers(self) -> int:
        """How many ``sleep`` calls wait for the clock now."""
        return len(self._sleepers)

    async def someone_asleep(self) -> None:
        """Return once at least one ``sleep`` waits for the clock (a keeper that started)."""
        await self._asleep.wait()

    def advance(self, seconds: float) -> None:
        """Move the clock forward and wake every sleeper whose time has come."""
        if seconds < 0:
            raise ValueError("a monotonic clock does not step back")
        self._now += seconds
        due = [entry for entry in self._sleepers if entry[0] <= self._now]
        for entry in due:  # off the list now: ``someone_asleep`` then waits for a new sleep
            self._sleepers.remove(entry)
            if not entry[1].done():
                entry[1].set_result(None)
        if not self._sleepers:
            self._asleep.clear()
