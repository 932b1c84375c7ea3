"""The embedded store's clock: never backwards, and blind to steps of the wall clock.

Leases, PREPARED deadlines, re-send windows and approvals are all measured in store time. If
that were the host's wall clock, a step back (NTP, an operator, a VM resumed from a snapshot)
would re-open an idempotent re-send window that had closed (a second charge at the
downstream) and lengthen leases; a step forward would turn forwards still running UNKNOWN
early, and let a probe's "absent" count too soon.

So store time is an anchor plus the time elapsed on the host's monotonic boot clock
(``CLOCK_BOOTTIME``: it never steps, and it keeps counting through a suspend). The anchor is
persisted with every write (a high-water mark with the boot id and boot-clock reading it was
taken at):

* restarted on the same boot: time resumes at the mark plus the boot-clock time since it was
  written, whatever the wall clock did meanwhile;
* after a reboot (another boot id): time resumes at ``max(wall clock, mark)``, so it never
  runs backwards; a wall clock that jumped forward while the host was down makes time jump
  with it, once, while no forward of this gateway can be running.

The wall clock is read once, at open, and only after a reboot.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ClockMark", "ClockSources", "StoreClock"]


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


@dataclass(frozen=True, slots=True)
class ClockMark:
    """The persisted high-water mark: store time ``now_ms`` was handed out when the boot
    clock of boot ``boot_id`` read ``boot_ms``."""

    now_ms: int
    boot_id: str | None
    boot_ms: int


class StoreClock:
    def __init__(self, mark: ClockMark | None, sources: ClockSources | None = None) -> None:
        self._sources = sources or ClockSources()
        self._boot_id = self._sources.boot_id()
        boot = self._sources.boot_ms()
        if mark is not None and mark.boot_id is not None and mark.boot_id == self._boot_id:
            start = mark.now_ms + max(boot - mark.boot_ms, 0)
        elif mark is not None:
            start = max(self._sources.wall_ms(), mark.now_ms)
        else:
            start = self._sources.wall_ms()
        self._start = start
        self._boot_at_start = boot
        self._last = start

    def _read(self) -> tuple[int, int]:
        boot = self._sources.boot_ms()
        self._last = max(self._last, self._start + boot - self._boot_at_start)
        return self._last, boot

    def now_ms(self) -> int:
        """Store time now; never less than any earlier answer."""
        return self._read()[0]

    def mark(self) -> ClockMark:
        """What to persist so that a restart resumes from here."""
        now, boot = self._read()
        return ClockMark(now, self._boot_id, boot)
