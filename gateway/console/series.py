"""The Fleet page's live charts: the few numbers people watch, sampled over the last minutes.

Each gateway process samples in the background every ``SAMPLE_MS`` from the moment it
starts (``Series.run``, started with the app by ``gateway.console.sampling``), whether or
not anyone watches: the charts have the last minutes the first time the page is opened. A
sample costs one store round trip (``Store.gauges``); the counters come from the gateway's
own ``/metrics`` rendering (so with ``serve --workers`` they are every worker's sum, as
Prometheus would see them). The last ``WINDOW_MS`` of samples are kept in a ring buffer of
this process (bounded: ``WINDOW_MS // SAMPLE_MS`` samples); ``GET /console/fleet/series``
reads them and touches no store. A store that fails is logged once
(``console.sampling_failed``, or ``console.sampling_crashed`` for a bug; then
``console.sampling_resumed``) and sampling goes on.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import structlog
from prometheus_client.parser import text_string_to_metric_families

from fencegate.gateway.metrics import Metrics
from fencegate.ledger.errors import FencegateError
from fencegate.ledger.store import Store

__all__ = ["GAUGE_LABELS", "SAMPLE_MS", "WINDOW_MS", "Series", "counters", "label"]

log = structlog.get_logger("fencegate.console")

WINDOW_MS: Final = 15 * 60_000
#: How often every gateway process samples (one store round trip each time).
SAMPLE_MS: Final = 5_000

#: The sampled numbers other than the effects counters, as the charts' legends say them.
GAUGE_LABELS: Final[dict[str, str]] = {
    "fenced": "fenced refusals",
    "activeLeases": "active leases",
    "prepared": "effects in flight (PREPARED)",
    "unknown": "effects UNKNOWN",
    "awaitingApproval": "effects awaiting approval",
}
#: ``fencegate_effects_total`` outcomes in words (anything else: lower case, spaces).
_OUTCOMES: Final[dict[str, str]] = {
    "COMMITTED": "committed",
    "NOT_APPLIED": "not applied",
    "UNKNOWN": "outcome unknown",
    "replayed": "replayed to a retry",
    "conflict": "refused: another payload",
    "in_flight": "refused: still in flight",
    "unknown_refused": "refused: effect UNKNOWN",
    "approval_required": "held for approval",
}


def label(key: str) -> str:
    """A series' legend in words: a gauge's (``activeLeases``: ``active leases``), or an
    effects counter's ``downstream/outcome`` as ``downstream: outcome in words``."""
    if key in GAUGE_LABELS:
        return GAUGE_LABELS[key]
    downstream, _, outcome = key.rpartition("/")
    words = _OUTCOMES.get(outcome, outcome.replace("_", " ").lower())
    return f"{downstream}: {words}" if downstream else words


def counters(metrics: Metrics) -> tuple[dict[str, float], float]:
    """(effects by ``downstream/outcome``, fenced refusals summed over acceptance points)."""
    effects: dict[str, float] = {}
    fenced = 0.0
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name == "fencegate_effects_total":
                key = f"{sample.labels.get('downstream', '')}/{sample.labels.get('outcome', '')}"
                effects[key] = effects.get(key, 0.0) + sample.value
            elif sample.name == "fencegate_rejections_total":
                fenced += sample.value
    return effects, fenced


def _ring() -> deque[dict[str, Any]]:
    return deque(maxlen=WINDOW_MS // SAMPLE_MS)


@dataclass
class Series:
    """This process's samples, oldest first. ``clock`` (seconds) stamps them and ``sleep``
    waits between them: a test passes a ``ManualClock``'s and moves time instead of waiting."""

    clock: Callable[[], float] = time.time
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    every_ms: int = SAMPLE_MS
    samples: deque[dict[str, Any]] = field(default_factory=_ring)
    #: The last sample failed (logged once until one succeeds again).
    failing: bool = False

    async def take(self, metrics: Metrics, store: Store) -> bool:
        """One sample (one store round trip); False when it failed (no sample: the charts
        show a longer step)."""
        try:
            gauges = await store.gauges()
            effects, fenced = counters(metrics)
        except FencegateError as exc:
            if not self.failing:
                log.warning("console.sampling_failed", code=exc.code, reason=exc.detail)
            self.failing = True
            return False
        except Exception:
            if not self.failing:
                log.exception("console.sampling_crashed")
            self.failing = True
            return False
        if self.failing:
            self.failing = False
            log.info("console.sampling_resumed")
        self.samples.append(
            {
                "t": int(self.clock() * 1000),
                "effects": effects,
                "fenced": fenced,
                "activeLeases": gauges.active_leases,
                "prepared": gauges.prepared_effects,
                "unknown": gauges.unknown_effects,
                "awaitingApproval": gauges.awaiting_approval,
            }
        )
        return True

    async def run(self, metrics: Metrics, store: Store) -> None:
        """Sample now, then every ``every_ms``, until cancelled."""
        while True:
            await self.take(metrics, store)
            await self.sleep(self.every_ms / 1000)

    def recent(self) -> list[dict[str, Any]]:
        """The samples of the last ``WINDOW_MS`` (none older, after a long store outage)."""
        now = int(self.clock() * 1000)
        return [s for s in self.samples if now - s["t"] <= WINDOW_MS]

    def answer(self) -> dict[str, Any]:
        """``GET /console/fleet/series``: the samples, every series' legend in words, and how
        often samples are taken."""
        samples = self.recent()
        keys = set(GAUGE_LABELS)
        for sample in samples:
            keys.update(sample["effects"])
        return {
            "samples": samples,
            "labels": {key: label(key) for key in sorted(keys)},
            "everyMs": self.every_ms,
        }
