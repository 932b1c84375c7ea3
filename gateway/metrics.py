"""Prometheus metrics, with names and labels fixed so dashboards can be shared.

Counters and histograms are per gateway process (Prometheus sums them across processes);
the gauges (active leases, PREPARED and UNKNOWN effects, effects awaiting approval) are read
from the store at scrape time, from indexes the store keeps, so they are right across every
gateway sharing it and cost one store round trip per scrape.

With ``serve --workers N`` a scrape reaches whichever worker the kernel hands the connection
to, so every worker answers for all of them: ``share_between_processes`` (called by the
supervisor before it forks) puts each worker's values in files of a directory they share
(prometheus_client's multiprocess mode), and ``render`` reads them all. Counters and
histograms are summed over the workers, those that died and were restarted included (a total
never goes down when one is replaced); the store-wide gauges are the most recent scrape's.

``fencegate_validations_total{point}`` counts acceptance points that reached a decision
after comparing epoch, generation and cancel generation; ``fencegate_requests_total{point}``
counts well-formed requests that reached the point. Their ratio is the coverage the rollout
notes ask to watch: a fenced count of zero proves nothing, a coverage below 1 shows a path
that skips the checks (or a store that did not answer).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import prometheus_client
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from fencegate.ledger.retention import StoreStats
from fencegate.ledger.store import Gauges

__all__ = ["CONTENT_TYPE", "FORWARD_OUTCOMES", "Metrics", "share_between_processes"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
#: The ``StoreStats`` fields ``fencegate_store_records`` carries, as its ``kind`` label.
STORE_RECORD_KINDS = (
    "tasks",
    "claimed_tasks",
    "settled_tasks",
    "due_tasks",
    "effects",
    "task_tombstones",
    "effect_tombstones",
    "events",
)
_HUMAN = (0.1, 0.5, 1, 5, 15, 30, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)


#: ``fencegate_forward_seconds`` outcomes: what the ledger's outcome of the answer was, or
#: how the forward failed (no answer: the slowest forwards, so never left out).
FORWARD_OUTCOMES = ("committed", "not_applied", "unknown", "timeout", "unreachable")


#: The directory the workers of one ``serve --workers`` share (None: this process only).
_SHARED_DIRECTORY: str | None = None


def share_between_processes(directory: str) -> None:
    """Metrics created from now on (in this process and the ones it forks) keep their values
    in files under ``directory``, and every ``render`` answers for all of them. The directory
    must be new and empty: files left there by an earlier run would be counted again."""
    from prometheus_client import values

    global _SHARED_DIRECTORY
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory  # where the value files are written
    values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
    _SHARED_DIRECTORY = directory


class _Registry(CollectorRegistry):
    """A registry without the ``*_created`` series: one timestamp per counter and histogram
    label set is noise on a dashboard and in the scrape. prometheus_client can only turn
    them off process-wide (``disable_created_metrics``); this keeps it to our registry."""

    def collect(self) -> Iterator[Metric]:
        for family in super().collect():
            created = family.name + "_created"
            family.samples = [s for s in family.samples if s.name != created]
            yield family


_W = TypeVar("_W", bound="_Counter | _Histogram")


def _child(parent: _W, values: tuple[object, ...], make: Any) -> _W:
    """The labelled child for ``values``, built by prometheus_client once and then taken from
    a plain dict: its own ``labels`` validates, converts and locks on every call, which the
    proxy paid several times per call for the same few label sets."""
    cache: dict[tuple[object, ...], _W] = parent.__dict__.setdefault("_fg_children", {})
    child = cache.get(values)
    if child is None:
        child = cache[values] = make(*values)
    return child


class _Counter(prometheus_client.Counter):
    """A counter whose labelled children are cached (``_child``); none is ever removed."""

    def labels(self, *labelvalues: object, **labelkwargs: object) -> _Counter:
        if labelkwargs:
            return super().labels(*labelvalues, **labelkwargs)
        return _child(self, labelvalues, super().labels)


class _Histogram(prometheus_client.Histogram):
    """A histogram whose labelled children are cached (``_child``); none is ever removed."""

    def labels(self, *labelvalues: object, **labelkwargs: object) -> _Histogram:
        if labelkwargs:
            return super().labels(*labelvalues, **labelkwargs)
        return _child(self, labelvalues, super().labels)


Counter = _Counter
Histogram = _Histogram


class Metrics:
    """One registry per app, so several apps in one process (tests) do not collide."""

    def __init__(self) -> None:
        r = self.registry = _Registry(auto_describe=True)
        self.claims = Counter(
            "fencegate_claims",
            "Claims by outcome (granted or the problem code)",
            ["outcome"],
            registry=r,
        )
        self.renewals = Counter(
            "fencegate_renewals", "Renewals by outcome", ["outcome"], registry=r
        )
        self.commits = Counter(
            "fencegate_commits",
            "Commits by outcome (committed, replayed, or the problem code)",
            ["outcome"],
            registry=r,
        )
        self.rejections = Counter(
            "fencegate_rejections",
            "Refusals by acceptance point and code",
            ["point", "code"],
            registry=r,
        )
        self.validations = Counter(
            "fencegate_validations",
            "Acceptance points that compared epoch, generation and cancel generation",
            ["point"],
            registry=r,
        )
        self.requests = Counter(
            "fencegate_requests", "Well-formed requests per acceptance point", ["point"], registry=r
        )
        self.effects = Counter(
            "fencegate_effects",
            "Proxied effects by outcome (COMMITTED, NOT_APPLIED, UNKNOWN, replayed, conflict, "
            "in_flight...) and kind (leased: under a lease; keyed: a client's, by its "
            "idempotency key)",
            ["downstream", "outcome", "kind"],
            registry=r,
        )
        self.shadow_rejections = Counter(
            "fencegate_shadow_rejections",
            "Refusals that shadow mode recorded and let through",
            ["point", "code"],
            registry=r,
        )
        # By kind (Gauges.unknown_keyed_effects, which every store counts from its own
        # indexes): both series are always set, so a sum over kind is the store-wide total.
        self.unknown_effects = Gauge(
            "fencegate_unknown_effects",
            "UNKNOWN effects (store-wide, PREPARED past its deadline included) by kind (leased: "
            "under a lease; keyed: a client's, by its idempotency key)",
            ["kind"],
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.prepared_effects = Gauge(
            "fencegate_prepared_effects",
            "Effects being forwarded (store-wide)",
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.active_leases = Gauge(
            "fencegate_active_leases",
            "Unexpired leases (store-wide)",
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.awaiting_approval = Gauge(
            "fencegate_awaiting_approval_effects",
            "Effects waiting for an operator's approval",
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.reclaim_latency = Histogram(
            "fencegate_reclaim_latency_seconds",
            "From the expiry of a lease to the claim that took the task over",
            buckets=_HUMAN,
            registry=r,
        )
        self.attempts_per_task = Histogram(
            "fencegate_attempts_per_task",
            "Claims a task took until its canonical commit",
            buckets=(1, 2, 3, 4, 5, 8, 13, 21, 50, 100),
            registry=r,
        )
        self.ready_to_commit = Histogram(
            "fencegate_ready_to_commit_seconds",
            "From a revision becoming READY to its canonical commit",
            buckets=_HUMAN,
            registry=r,
        )
        self.forward_seconds = Histogram(
            "fencegate_forward_seconds",
            "Every forward to a downstream, by outcome (committed, not_applied, unknown: the "
            "answer's; timeout, unreachable: no answer) and kind of call (leased: under a "
            "lease; keyed: a lease-less client's)",
            ["downstream", "outcome", "kind"],
            buckets=_LATENCY,
            registry=r,
        )
        self.discarded_attempts = Counter(
            "fencegate_discarded_attempts",
            "Attempts whose work was thrown away, each counted once by the step that threw "
            "it away, by reason (expired or epoch: a claim took the task over; cancelled; "
            "superseded: a new revision of the task or of a dependency)",
            ["reason"],
            registry=r,
        )
        self.discarded_cost = Counter(
            "fencegate_discarded_cost",
            "Cost reported by attempts whose work was thrown away, per unit: their tally "
            "when the store threw them away, plus what a renew, release or commit refused "
            "with STALE_EPOCH, CANCELLED, STALE_INPUT, LEASE_EXPIRED or RUNTIME_EXCEEDED "
            "carried",
            ["unit"],
            registry=r,
        )
        self.reported_cost = Counter(
            "fencegate_reported_cost",
            "Cost reported by workers on renew, release and commit the store accepted, per unit",
            ["unit"],
            registry=r,
        )
        self.store_records = Gauge(
            "fencegate_store_records",
            "Records in the store (store-wide), by kind: tasks, claimed_tasks, settled_tasks, "
            "due_tasks (settled past retention.settled_ms), effects, task_tombstones, "
            "effect_tombstones, events; set by the retention loop",
            ["kind"],
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.store_bytes = Gauge(
            "fencegate_store_bytes",
            "What the store occupies (SQLite: used pages; Redis: used_memory; PostgreSQL: "
            "fencegate's tables and indexes); set by the retention loop",
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.store_regressed = Gauge(
            "fencegate_store_regressed",
            "1 while this gateway refuses writes because the store lost writes a gateway saw "
            "acknowledged (Redis failover or restore), until `fencegate failover ack`",
            registry=r,
            multiprocess_mode="max",
        )
        self.expired = Counter(
            "fencegate_expired",
            "Records this gateway's retention sweep deleted (tasks, effects) and tombstones "
            "it forgot (tombstones)",
            ["kind"],
            registry=r,
        )
        self.store_seconds = Histogram(
            "fencegate_store_seconds",
            "Store round trips by operation",
            ["op"],
            buckets=_LATENCY,
            registry=r,
        )

    def decision(
        self, point: str, code: str | None, *, validated: bool, granted: str = "granted"
    ) -> None:
        """One acceptance point's decision: ``code`` None means granted, counted as
        ``granted`` (a commit says what happened: ``committed`` or ``replayed``)."""
        self.requests.labels(point).inc()
        if validated:
            self.validations.labels(point).inc()
        outcome = code or granted
        counter = {"claim": self.claims, "renew": self.renewals, "commit": self.commits}.get(point)
        if counter is not None:
            counter.labels(outcome).inc()
        if code is not None and validated:
            self.rejections.labels(point, code).inc()

    def discard(self, reason: str | None, cost: Iterable[tuple[str, float]]) -> None:
        """One attempt's work thrown away (``reason``), with the cost it had reported; None:
        cost an already-lost attempt reported later (its attempt is counted by the step that
        threw it away, or not at all if no claim ever took its task over)."""
        if reason is not None:
            self.discarded_attempts.labels(reason).inc()
        for unit, amount in cost:
            if amount > 0:
                self.discarded_cost.labels(unit).inc(amount)

    def report_cost(self, cost: Iterable[tuple[str, float]]) -> None:
        """Cost a worker reported on a renew, release or commit the store accepted."""
        for unit, amount in cost:
            if amount > 0:
                self.reported_cost.labels(unit).inc(amount)

    def set_gauges(self, gauges: Gauges) -> None:
        keyed = gauges.unknown_keyed_effects
        self.unknown_effects.labels("leased").set(gauges.unknown_effects - keyed)
        self.unknown_effects.labels("keyed").set(keyed)
        self.prepared_effects.set(gauges.prepared_effects)
        self.active_leases.set(gauges.active_leases)
        self.awaiting_approval.set(gauges.awaiting_approval)

    def set_store_stats(self, stats: StoreStats) -> None:
        for kind in STORE_RECORD_KINDS:
            self.store_records.labels(kind).set(getattr(stats, kind))
        if stats.bytes is not None:
            self.store_bytes.set(stats.bytes)

    def render(self) -> bytes:
        if _SHARED_DIRECTORY is None:
            return generate_latest(self.registry)
        # Every worker's files, this one's included (its own registry holds this worker
        # alone); the store-wide gauges were just set here, so the most recent is this scrape's.
        shared = CollectorRegistry()
        MultiProcessCollector(shared, _SHARED_DIRECTORY)  # type: ignore[no-untyped-call]
        return generate_latest(shared)
