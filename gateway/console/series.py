"""The Fleet page's live charts: the few numbers people watch, sampled over the last minutes.

Samples are taken when a browser asks (``GET /console/fleet/series``, every few seconds while
the Fleet page is open), at most one per ``MIN_STEP_MS``, and kept for ``WINDOW_MS`` in this
process: a gateway nobody watches does no extra work. Counters come from the gateway's own
``/metrics`` rendering (so with ``serve --workers`` they are every worker's sum, as Prometheus
would see them); the store-wide gauges from the store (one round trip).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from fencegate.gateway.metrics import Metrics
from fencegate.ledger.store import Store

__all__ = ["MIN_STEP_MS", "WINDOW_MS", "Series", "counters"]

WINDOW_MS = 15 * 60_000
MIN_STEP_MS = 2_000


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


@dataclass
class Series:
    """This process's samples, oldest first."""

    clock: Callable[[], float] = time.time
    samples: deque[dict[str, Any]] = field(default_factory=deque)

    async def sample(self, metrics: Metrics, store: Store) -> list[dict[str, Any]]:
        now = int(self.clock() * 1000)
        if not self.samples or now - self.samples[-1]["t"] >= MIN_STEP_MS:
            effects, fenced = counters(metrics)
            gauges = await store.gauges()
            self.samples.append(
                {
                    "t": now,
                    "effects": effects,
                    "fenced": fenced,
                    "activeLeases": gauges.active_leases,
                    "unknown": gauges.unknown_effects,
                }
            )
        while self.samples and now - self.samples[0]["t"] > WINDOW_MS:
            self.samples.popleft()
        return list(self.samples)
