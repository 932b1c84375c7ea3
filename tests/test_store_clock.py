"""Item 6 of the at-most-once issue: the embedded store's time never runs backwards and does
not follow steps of the wall clock.

The clock's sources (wall clock, boot clock, boot id) are injected, so a "step" is exact and
the tests never wait for real time beyond a few milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from fencegate.ledger import effects
from fencegate.ledger.clock import AHEAD_MS, HEADROOM_MS, ClockSources, StoreClock
from fencegate.ledger.effects import EffectRequest, EffectState, Fence
from fencegate.ledger.errors import FencegateError
from fencegate.ledger.sqlite_store import SQLiteStore
from fencegate.ledger.tasks import ClaimRequest, LeasePolicy
from tests.conftest import STORE_TIMEOUT_MS

POLICY = LeasePolicy(max_ttl_ms=600_000, default_max_runtime_ms=6_000_000)
HOUR_MS = 3_600_000


@dataclass
class FakeHost:
    """A host's clocks: the wall clock may be stepped; the boot clock only runs forward."""

    wall: int = 1_800_000_000_000
    boot: int = 50_000
    boot_id: str | None = "boot-1"

    def sources(self) -> ClockSources:
        return ClockSources(
            wall_ms=lambda: self.wall, boot_ms=lambda: self.boot, boot_id=lambda: self.boot_id
        )

    def run(self, ms: int) -> None:
        self.wall += ms
        self.boot += ms


def test_steps_of_the_wall_clock_do_not_move_store_time() -> None:
    host = FakeHost()
    clock = StoreClock(None, host.sources())
    start = clock.now_ms()
    host.run(1_000)
    host.wall -= HOUR_MS  # stepped back
    assert clock.now_ms() == start + 1_000
    host.wall += 2 * HOUR_MS  # stepped forward
    host.run(500)
    assert clock.now_ms() == start + 1_500


def test_a_restart_on_the_same_boot_resumes_from_the_mark_plus_boot_time() -> None:
    host = FakeHost()
    clock = StoreClock(None, host.sources())
    host.run(2_000)
    mark = clock.mark()
    host.run(3_000)  # down for 3 s, during which the wall clock is stepped back an hour
    host.wall -= HOUR_MS
    again = StoreClock(mark, host.sources())
    assert again.now_ms() == mark.now_ms + 3_000


def test_after_a_reboot_time_resumes_from_the_later_of_wall_clock_and_ceiling() -> None:
    host = FakeHost()
    clock = StoreClock(None, host.sources())
    host.run(2_000)
    mark = clock.mark()
    assert mark.ceiling_ms == mark.now_ms + AHEAD_MS
    behind = FakeHost(wall=host.wall - HOUR_MS, boot=10, boot_id="boot-2")
    resumed = StoreClock(mark, behind.sources())
    assert resumed.now_ms() == mark.ceiling_ms
    # The downtime is unknown: effects created before now lose their re-send windows.
    assert resumed.windows_from == mark.ceiling_ms
    ahead = FakeHost(wall=host.wall + 5 * AHEAD_MS, boot=10, boot_id="boot-2")
    trusted = StoreClock(mark, ahead.sources())
    assert trusted.now_ms() == ahead.wall and trusted.windows_from == 0
    unknown_boot = FakeHost(wall=host.wall - HOUR_MS, boot=10, boot_id=None)
    assert StoreClock(mark, unknown_boot.sources()).now_ms() == mark.ceiling_ms


def test_a_new_ceiling_is_due_before_time_reaches_the_old_one() -> None:
    host = FakeHost()
    clock = StoreClock(None, host.sources())
    assert clock.needs_mark(clock.now_ms())  # nothing persisted yet
    mark = clock.mark()
    assert not clock.needs_mark(clock.now_ms())
    host.run(AHEAD_MS - HEADROOM_MS)
    assert clock.needs_mark(clock.now_ms())
    assert clock.now_ms() < mark.ceiling_ms


async def _claimed(store: SQLiteStore, task_id: str) -> Fence:
    await store.put_task(task_id, "in-1", None)
    task = await store.claim(task_id, ClaimRequest(owner="w", ttl_ms=600_000, scheduler_epoch=1))
    assert task.attempt_id is not None
    return Fence(task_id, task.attempt_id, task.claim_generation, 1, task.cancel_generation)


async def test_a_closed_resend_window_stays_closed_when_the_wall_clock_steps_back(
    tmp_path: Path,
) -> None:
    """The double charge of item 6: an idempotent effect went UNKNOWN, its downstream's
    dedupe window closed, then the host clock stepped back. A restarted store must still
    refuse to re-send it (EFFECT_UNKNOWN), on the same boot and after a reboot."""
    host = FakeHost()
    path = str(tmp_path / "clock.db")
    store = SQLiteStore(path, POLICY, clock_sources=host.sources(), timeout_ms=STORE_TIMEOUT_MS)
    await store.open()
    fence = await _claimed(store, "t1")
    request = EffectRequest(fence, "main", "s1", "pay", "POST", "/charge", "digest-1")
    window = 10_000
    prepared = await store.prepare_effect(request, 5_000, resend_window_ms=window)
    assert prepared.action is effects.Action.FORWARD
    _, applied = await store.complete_effect(
        "t1", prepared.effect.effect_id, 0, fence.attempt_id, EffectState.UNKNOWN, "timed out",
        None,
    )  # fmt: skip
    assert applied
    host.run(window + 1)
    closed = await store.prepare_effect(request, 5_000, resend_window_ms=window)
    assert closed.error is not None and closed.error.code == "EFFECT_UNKNOWN"
    last = await store.now_ms()
    await store.close()

    for boot_id in ("boot-1", "boot-2"):  # restarted on the same boot, then after a reboot
        host.wall -= HOUR_MS
        host.boot_id = boot_id
        host.run(10)
        again = SQLiteStore(path, POLICY, clock_sources=host.sources(), timeout_ms=STORE_TIMEOUT_MS)
        await again.open()
        assert await again.now_ms() >= last
        refused = await again.prepare_effect(request, 5_000, resend_window_ms=window)
        assert refused.action is effects.Action.REJECT
        assert refused.error is not None and refused.error.code == "EFFECT_UNKNOWN"
        last = await again.now_ms()
        await again.close()


async def test_a_forward_jump_of_the_wall_clock_does_not_expire_a_running_forward(
    tmp_path: Path,
) -> None:
    host = FakeHost()
    store = SQLiteStore(
        str(tmp_path / "jump.db"), POLICY, clock_sources=host.sources(), timeout_ms=STORE_TIMEOUT_MS
    )
    await store.open()
    fence = await _claimed(store, "t1")
    request = EffectRequest(fence, "main", "s1", "pay", "POST", "/charge", "digest-1")
    prepared = await store.prepare_effect(request, 5_000)
    host.wall += HOUR_MS
    host.run(100)
    record = await store.get_effect(prepared.effect.effect_id)
    assert record.state is EffectState.PREPARED
    # The lease is not cut short either.
    fenced = await store.check_fence(fence)
    assert fenced.lease_expires_at is not None
    assert fenced.lease_expires_at - await store.now_ms() > 500_000
    await store.close()


async def test_the_real_clock_sources_run_forward(tmp_path: Path) -> None:
    store = SQLiteStore(str(tmp_path / "real.db"), POLICY, timeout_ms=STORE_TIMEOUT_MS)
    await store.open()
    first = await store.now_ms()
    await store.put_task("t1", "in", None)  # a write persists the mark
    await store.close()
    again = SQLiteStore(str(tmp_path / "real.db"), POLICY, timeout_ms=STORE_TIMEOUT_MS)
    await again.open()
    assert await again.now_ms() >= first
    await again.close()


async def test_an_instant_a_refusal_answered_is_never_handed_out_again(tmp_path: Path) -> None:
    """A step that writes nothing (here a refusal) still hands out its instant; a kill -9 and
    a reboot with the wall clock behind must not bring store time back before it."""
    host = FakeHost()
    path = str(tmp_path / "refusal.db")
    store = SQLiteStore(path, POLICY, clock_sources=host.sources(), timeout_ms=STORE_TIMEOUT_MS)
    await store.open()
    host.run(AHEAD_MS)  # past the ceiling's headroom: the next step must persist a new one
    with pytest.raises(FencegateError):
        await store.check_fence(Fence("ghost", "a", 1, 1, 0))
    refused_at = await store.now_ms()
    # kill -9: no close. Reboot with the wall clock an hour behind.
    rebooted = FakeHost(wall=host.wall - HOUR_MS, boot=10, boot_id="boot-2")
    again = SQLiteStore(path, POLICY, clock_sources=rebooted.sources(), timeout_ms=STORE_TIMEOUT_MS)
    await again.open()
    assert await again.now_ms() >= refused_at
    await again.close()
    await store.close()
