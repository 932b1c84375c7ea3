"""The embedded store's clock: never backwards, and blind to steps of the wall clock.

Leases, PREPARED deadlines, re-send windows and approvals are all measured in store time. If
that were the host's wall clock, a step back (NTP, an operator, a VM resumed from a snapshot)
would re-open an idempotent re-send window that had closed (a second charge at the
downstream) and lengthen leases; a step forward would turn forwards still running UNKNOWN
early, and let a probe's "absent" count too soon.

So store time is an anchor plus the time elapsed on the host's monotonic boot clock
(``CLOCK_BOOTTIME``: it never steps, and it keeps counting through a suspend). The store
persists a mark (the boot id, a boot-clock reading and the store time at it) and a ceiling
``AHEAD_MS`` beyond it, before it hands out any instant past ``ceiling - HEADROOM_MS``, so no
answered instant (a refusal's included) ever reaches the persisted ceiling:

* restarted on the same boot: time resumes at the mark plus the boot-clock time since it was
  written, whatever the wall clock did meanwhile;
* after a reboot (another boot id): time resumes at ``max(wall clock, ceiling)``, so it never
  runs backwards; it may jump forward (by up to ``AHEAD_MS``, or with a wall clock that
  jumped while the host was down), once, while no forward of this gateway can be running.
  When the wall clock reads earlier than the ceiling, the downtime cannot be counted, so
  effects created before the reboot lose their re-send windows (``windows_from``).

The wall clock is read once, at open, and only after a reboot.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ClockMark", "ClockSources", "StoreClock", "iso_utc"]


def iso_utc(ms: int) -> str:
    """Store time (ms since the Unix epoch) as ISO 8601 UTC with milliseconds, e.g.
    ``2026-11-30T16:07:22.452Z``: what a person reading a problem detail at 3 a.m. can use
    without a converter (the number stays beside it for programs)."""
    seconds, millis = divmod(ms, 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _boot_ms() -> int:
    clock = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)
    return time.clock_gettime_ns(clock) // 1_000_000


@dataclass(frozen=True, slots=True)
class ClockSources:
    """Where the clock reads time; tests pass their own."""

    wall_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000
    boot_ms: Callable[[], int] = _boot_ms
    #: Identifies one boot of the host; None where unknown (then every open is a "reboot").
    boot_id: Callable[[], str | None] = _boot_id


#: How far ahead of the time it hands out the clock's persisted ceiling runs: after a reboot
#: store time resumes no earlier than the ceiling, so it may jump forward by up to this.
AHEAD_MS = 120_000
#: A new ceiling is persisted once time comes this close to the old one; more than the
#: longest a transition can wait for SQLite's lock (store.timeout_ms is at most a minute).
HEADROOM_MS = 70_000


@dataclass(frozen=True, slots=True)
class ClockMark:
    """The persisted state: store time ``now_ms`` was handed out when the boot clock of boot
    ``boot_id`` read ``boot_ms``; no instant at or past ``ceiling_ms`` has been handed out;
    effects created before ``windows_from`` get no re-send window (see ``StoreClock``)."""

    now_ms: int
    boot_id: str | None
    boot_ms: int
    ceiling_ms: int
    windows_from: int = 0


class StoreClock:
    def __init__(self, mark: ClockMark | None, sources: ClockSources | None = None) -> None:
        self._sources = sources or ClockSources()
        self._boot_id = self._sources.boot_id()
        boot = self._sources.boot_ms()
        self.windows_from = mark.windows_from if mark is not None else 0
        if mark is not None and mark.boot_id is not None and mark.boot_id == self._boot_id:
            start = mark.now_ms + max(boot - mark.boot_ms, 0)
        elif mark is not None:
            wall = self._sources.wall_ms()
            start = max(wall, mark.ceiling_ms)
            if wall < mark.ceiling_ms:
                # The wall clock reads earlier than time already handed out: how long the
                # host was down is unknown, so store time cannot count it. A downstream's
                # dedupe window counts it, so an effect created before now must not be
                # re-sent inside a window this clock would think still open.
                self.windows_from = start
        else:
            start = self._sources.wall_ms()
        self._start = start
        self._boot_at_start = boot
        self._last = start
        self._ceiling = mark.ceiling_ms if mark is not None else start

    def _read(self) -> tuple[int, int]:
        boot = self._sources.boot_ms()
        self._last = max(self._last, self._start + boot - self._boot_at_start)
        return self._last, boot

    def now_ms(self) -> int:
        """Store time now; never less than any earlier answer."""
        return self._read()[0]

    def needs_mark(self, now: int) -> bool:
        """Must a new ceiling be persisted before ``now`` may be handed out?"""
        return now >= self._ceiling - HEADROOM_MS

    def mark(self) -> ClockMark:
        """What to persist so that a restart resumes from here (raises the ceiling)."""
        now, boot = self._read()
        self._ceiling = now + AHEAD_MS
        return ClockMark(now, self._boot_id, boot, self._ceiling, self.windows_from)
