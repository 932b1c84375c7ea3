"""The Redis Cluster store: a coordinator over ``B`` bucket views of the Redis store.

A bucket is a one-Redis store under a longer prefix (docs/decisions.md, "Issue 30: Redis
Cluster, the design"): bucket n of a store with key prefix ``P`` is an unchanged
``RedisStore`` with key prefix ``P:{P.b<n>}``, so every key it makes hashes to bucket n's slot
and every script it runs touches that one slot. ``ledger.buckets`` says which bucket serves a
task (its group's) and a keyed effect (its id's), computed from what the request carries.

So a step on one task or one keyed effect is its bucket view's step, unchanged (put, claim,
renew, release, commit, cancel, check_fence, prepare, complete, find_forward). What spans
buckets is the code here:

- **listings** (``list_tasks``, ``list_effects``, ``awaiting_approval``,
  ``unsettled_effects``, ``find_effects``): each view's page after the same cursor, merged in
  the listing's order (``merge_pages``); the cursor names the last item as on one Redis;
- **an effect by id alone** (``get_effect``, ``update_effect``): the keyed bucket first, then
  every bucket's directories in one pipelined read;
- **sums** (``gauges``, ``store_stats``, ``migrate``), and what is per primary
  (``durability``, memory) once per primary;
- **sweeps** (``expire_settled``, ``continue_cascades``): ``SWEEP_BUCKETS`` buckets per call,
  round-robin;
- **queue claims** (``claim_next``): the head of the claimable candidates of every bucket
  the queue's hint names (``Keys.queue_buckets``) in one pipelined read, the best claimed by
  its bucket's ``claim_next``; the steps that make a task READY move the queue into the
  hint after their step (``_owed_hints``), and a hint older than ``cluster_queue_rescan_ms`` is
  rebuilt from every bucket (``_rescan_hint``);
- **the change feed** (``read_events``, ``trim_events``): per-bucket pages merged by
  ``ledger.cluster_feed``;
- **the scheduler** (``get_scheduler``, ``set_claims_paused``, ``bump_epoch``): one copy per
  bucket, ``ledger.scheduler_copies``.

Where the views live is a ``BucketBackend``: the real one routes every view's commands to its
slot's primary (``ledger.cluster_client.RoutedRedis`` over ``ledger.cluster_router``); the
one over a single ordinary Redis (``SingleRedisBackend``) is the same store without the
routing, which is what the unit tests run on.
"""

from __future__ import annotations

import abc
import asyncio
import bisect
import functools
import heapq
import itertools
import math
import secrets
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from fencegate.ledger import cluster_feed, keys, redis_store, scheduler_copies, task_graph
from fencegate.ledger import store as store_module
from fencegate.ledger.buckets import (
    bucket_of_keyed,
    bucket_of_queue,
    bucket_of_task,
    bucket_tag,
    check_buckets,
    task_group,
)
from fencegate.ledger.cluster_client import RoutedRedis
from fencegate.ledger.cluster_router import (
    CLUSTER_FORM,
    CLUSTER_SCHEMES,
    ClusterRouter,
    parse_cluster_url,
)
from fencegate.ledger.effects import Effect, EffectRequest, EffectState, Fence, PrepareOutcome
from fencegate.ledger.errors import (
    BadRequest,
    BumpBarrier,
    EventsGone,
    FencegateError,
    NoSuchEffect,
    StoreIncompatible,
    StoreUnavailable,
)
from fencegate.ledger.events import Event
from fencegate.ledger.queries import Gauges, TaskFilter, effect_prefix_bounds
from fencegate.ledger.redis_store import (
    FORMAT_VERSION,
    RedisStore,
    durability_warnings,
    log,
)
from fencegate.ledger.retention import ExpiryReport, StoreStats
from fencegate.ledger.scheduler_copies import Copy
from fencegate.ledger.store import (
    EffectTransition,
    Migration,
    Store,
    StoreKind,
    StoreOptions,
    decode_cursor,
    encode_cursor,
)
from fencegate.ledger.tasks import (
    ClaimRequest,
    CommitRequest,
    Identity,
    LeasePolicy,
    PutOutcome,
    RenewRequest,
    Scheduler,
    Task,
    TaskState,
)

__all__ = [
    "DEFAULT_BUCKETS",
    "FANOUT",
    "HINT_RESCAN_MS",
    "HINT_TTL_MS",
    "STORE_KIND",
    "SWEEP_BUCKETS",
    "BucketBackend",
    "ClusterStore",
    "RoutedBackend",
    "SingleRedisBackend",
    "bucket_prefix",
    "merge_pages",
]

T = TypeVar("T")
K = TypeVar("K")
X = TypeVar("X")

#: ``store.cluster_buckets`` when not set (docs/decisions.md).
DEFAULT_BUCKETS = 256
#: Most bucket views one store-wide call has in flight at once (``asyncio.gather`` over the
#: views is bounded by it), so a listing over 256 buckets does not open 256 pipelines at once.
FANOUT = 32
#: Buckets one ``expire_settled`` or ``continue_cascades`` call visits (round-robin): each
#: visit is that view's own bounded atomic step, so one call does at most this many steps of
#: ``limit`` each, and every bucket is visited once every ``B / SWEEP_BUCKETS`` calls.
SWEEP_BUCKETS = 16
#: Rounds of one feed read (``read_events``): the first reads every bucket's share of
#: ``2 x limit``, the others top up only the buckets whose page came back full and holds the
#: merge back, within the same budget.
FEED_ROUNDS = 3
#: Rounds of the trim's search for its cut-off (``trim_events``), and the most ids one run of
#: events_ids.lua answers.
TRIM_ROUNDS = 4
_TRIM_IDS_BATCH = 10_000
#: Claimable candidates read from each of a bucket's ``held`` and ``epochs`` sets per queue
#: claim (the ``ready`` set's head is one member).
_MOVED_CANDIDATES = 4
#: How long (store ms) a queue claim trusts the queue's hint before it rescans every bucket
#: and rebuilds it (the default of ``[store] cluster_queue_rescan_ms``): the bound on how
#: long a READY task can go unseen by queue claims when its step's hint update was lost (its
#: gateway killed between the step and the update, the update failed, a gateway from before
#: the hints). Each queue costs one read per bucket per this interval, whatever the number
#: of gateways.
HINT_RESCAN_MS = 1_000
#: The hint's field holding the store time of its last rescan (the others are bucket numbers).
_SCANNED_AT = "scanned_at"
#: Every write of a hint sets its key to expire this long after (Redis time; ten times the
#: rescan interval): queue names are the clients' to choose, and a claim on a queue nobody
#: uses writes its hint, so hints of abandoned queues must not pile up. A hint that expired
#: is missing, which a claim treats as due for a rescan: expiry never hides a bucket, it only
#: costs the rescan it would make anyway.
HINT_TTL_MS = 10 * HINT_RESCAN_MS
#: Owed queues one hint update takes at once (``SPOP``), and how many times it goes on while
#: it finds that many (a bucket owes a hint to each queue a step made a task READY in).
_OWED_BATCH = 100
_OWED_ROUNDS = 10
#: The hint's two steps, sent whole with ``EVAL`` (Redis keeps each compiled by its digest).
_HINT_ADD = (resources.files("fencegate.ledger") / "lua" / "queue_hint_add.lua").read_text(
    encoding="utf-8"
)
_HINT_RESCAN = (resources.files("fencegate.ledger") / "lua" / "queue_hint_rescan.lua").read_text(
    encoding="utf-8"
)
#: The meta field of bucket 0 recording the bucket count the store was created with.
_BUCKETS_FIELD = "cluster_buckets"
#: The queue index's member: ``%07d(1_000_000 - priority):%015d(readyAt):taskId``.
_PRIORITY_BASE = 1_000_000


def _token() -> str:
    """A value no earlier write of a hint field held (``queue_hint_rescan.lua`` removes a
    field only while it holds the token the rescan read)."""
    return secrets.token_hex(8)


def _fields(reply: Any) -> dict[str, str]:
    """A hash read with ``HGETALL`` as a dict of str, whether the backend's client parsed it
    (redis-py: a dict) or not (the cluster router: a flat list of fields and values)."""
    if isinstance(reply, dict):
        return {str(k): str(v) for k, v in reply.items()}
    flat = [str(x) for x in reply]
    return dict(zip(flat[::2], flat[1::2], strict=True))


def bucket_prefix(prefix: str, n: int) -> str:
    """Bucket ``n``'s key prefix: ``P:{P.b<n>}``. Redis hashes only the first ``{...}`` of a
    key and no task id holds a brace, so every key the view makes is in the bucket's slot."""
    return f"{prefix}:{{{bucket_tag(prefix, n)}}}"


# --- where the views live ------------------------------------------------------------------


class BucketBackend(abc.ABC):
    """What the cluster store is built on: the views, and plain reads across buckets.

    ``read`` sends each ``(bucket, command)`` to the node serving that bucket's slot, one
    pipelined batch per node, and answers every command's reply (parsed as redis-py parses
    it) or its error as a value, in the order given. The store uses it for what is not a
    view's step: the heads of the queues, an effect's directory entries, the bucket count."""

    @abc.abstractmethod
    def view(self, number: int, prefix: str) -> RedisStore:
        """Bucket ``number``'s view: a ``RedisStore`` with key prefix ``prefix`` that talks
        to the bucket's slot (not yet opened)."""

    @abc.abstractmethod
    async def read(self, commands: Sequence[tuple[int, tuple[Any, ...]]]) -> list[Any]: ...

    @abc.abstractmethod
    async def each_primary(self, *command: Any) -> dict[str, Any]:
        """``command`` (no key) on every primary once; each reply (or error) by address."""

    async def open(self) -> None:  # noqa: B027 - nothing to open by default
        """Connect (the real one reads the slot map)."""

    @abc.abstractmethod
    async def aclose(self) -> None: ...


class SingleRedisBackend(BucketBackend):
    """Every bucket on one ordinary Redis: the cluster store without the routing. A view is
    exactly a bucket view, minus MOVED/ASK; ``each_primary`` is that one server. For tests
    and for running the cluster layout on one Redis."""

    def __init__(
        self,
        url: str,
        policy: LeasePolicy,
        *,
        timeout_ms: int = 2000,
        **view_options: Any,
    ) -> None:
        self._url = url
        self._policy = policy
        self._timeout_ms = timeout_ms
        self._options = view_options
        self._redis = aioredis.Redis.from_url(
            url, decode_responses=True, socket_timeout=timeout_ms / 1000
        )

    def view(self, number: int, prefix: str) -> RedisStore:
        return RedisStore(
            self._url,
            self._policy,
            timeout_ms=self._timeout_ms,
            key_prefix=prefix,
            **self._options,
        )

    async def read(self, commands: Sequence[tuple[int, tuple[Any, ...]]]) -> list[Any]:
        pipe = self._redis.pipeline(transaction=False)
        for _, command in commands:
            pipe.execute_command(*command)
        return list(await pipe.execute(raise_on_error=False))

    async def each_primary(self, *command: Any) -> dict[str, Any]:
        where = self._redis.connection_pool.connection_kwargs
        address = f"{where.get('host', 'localhost')}:{where.get('port', 6379)}"
        try:
            reply: Any = await self._redis.execute_command(*command)  # type: ignore[no-untyped-call]
        except RedisError as exc:
            reply = exc
        return {address: reply}

    async def aclose(self) -> None:
        await self._redis.aclose()


class RoutedBackend(BucketBackend):
    """The real one: every bucket's commands go through one ``ClusterRouter`` to the primary
    of the bucket's slot; a view talks through a ``cluster_client.RoutedRedis`` for its
    slot key ``{P.b<n>}``, and the cross-bucket reads are one router pipeline (one batch
    per node). The router is the store's: closed with it."""

    def __init__(
        self,
        url: str,
        policy: LeasePolicy,
        *,
        key_prefix: str,
        timeout_ms: int = 2000,
        max_connections: int = 200,
        password: str | None = None,
        **view_options: Any,
    ) -> None:
        self._url = url
        self._policy = policy
        self._prefix = key_prefix
        self._timeout_ms = timeout_ms
        self._options = view_options
        self.router = ClusterRouter.from_url(
            url, timeout_ms=timeout_ms, max_connections=max_connections, password=password
        )

    def slot_key(self, number: int) -> str:
        return f"{{{bucket_tag(self._prefix, number)}}}"

    def view(self, number: int, prefix: str) -> RedisStore:
        slot_key = self.slot_key(number)
        return RedisStore(
            self._url,
            self._policy,
            timeout_ms=self._timeout_ms,
            key_prefix=prefix,
            client=RoutedRedis(self.router, slot_key),  # type: ignore[arg-type]
            cluster_slot_key=slot_key,
            **self._options,
        )

    async def read(self, commands: Sequence[tuple[int, tuple[Any, ...]]]) -> list[Any]:
        replies = await self.router.pipeline(
            [(self.slot_key(n), command) for n, command in commands]
        )
        return replies.results

    async def each_primary(self, *command: Any) -> dict[str, Any]:
        return await self.router.each_primary(*command, return_exceptions=True)

    async def open(self) -> None:
        await self.router.refresh()

    async def aclose(self) -> None:
        await self.router.aclose()


# --- the scheduler copies ------------------------------------------------------------------


# --- merging pages -------------------------------------------------------------------------


def merge_pages(
    pages: Iterable[tuple[Sequence[X], K | None]],
    key: Callable[[X], Any],
    limit: int,
) -> tuple[list[X], K | None]:
    """Merge per-bucket pages of one listing, each read after the same cursor: ``pages`` are
    (items in ``key`` order, the key to continue after or None when the bucket is done).

    Each bucket has shown everything it has up to its own continue-key, so the merged answer
    is exact up to the lowest of them (the frontier): the items up to it in ``key`` order, at
    most ``limit``. The key to continue after is the last item's when more than ``limit``
    were found, else the frontier (a short or empty page while buckets have more: keep
    following, as a single store says when its scan bound stops it), None when every
    bucket is done."""
    collected = list(pages)
    nexts: list[Any] = [nxt for _, nxt in collected if nxt is not None]
    frontier: Any = min(nexts, default=None)
    items = sorted((item for page, _ in collected for item in page), key=key)
    if frontier is not None:
        items = [item for item in items if key(item) <= frontier]
    if len(items) > limit:
        return items[:limit], key(items[limit - 1])
    return items, frontier


def _sum_reports(reports: Iterable[ExpiryReport]) -> ExpiryReport:
    kept: dict[str, int] = {}
    total = ExpiryReport()
    for r in reports:
        for reason, n in r.kept.items():
            kept[reason] = kept.get(reason, 0) + n
        total = ExpiryReport(
            examined=total.examined + r.examined,
            expired_tasks=total.expired_tasks + r.expired_tasks,
            expired_effects=total.expired_effects + r.expired_effects,
            forgotten=total.forgotten + r.forgotten,
        )
    return replace(total, kept=kept)


def _config(reply: Any) -> dict[str, str]:
    """``CONFIG GET``'s reply as a dict (redis-py parses it so only when sent as one word)."""
    if isinstance(reply, dict):
        return {str(k): str(v) for k, v in reply.items()}
    flat = list(reply)
    return {str(flat[i]): str(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}


@dataclass(frozen=True, slots=True, order=True)
class _Candidate:
    """A bucket's best claimable task of a queue, in ``ledger.tasks.queue_order``: lower
    ``rank`` (1_000_000 - priority), then earlier ``ready_at``, then task id."""

    rank: int
    ready_at: int
    task_id: str
    bucket: int


class _Sweep:
    """Which buckets one kind of sweep visits per call: first those whose last step came
    back full (a busy bucket: up to half of the call's buckets, the longest waiting first),
    then the round-robin, which so still reaches every bucket within ``2 B / size`` calls.
    Per store object (per process): another gateway's sweep keeps its own."""

    def __init__(self, buckets: int) -> None:
        self.buckets = buckets
        self.next = 0
        self.busy: dict[int, None] = {}

    def round(self, size: int) -> list[int]:
        if self.buckets <= size:
            return list(range(self.buckets))
        chosen = list(itertools.islice(self.busy, size // 2))
        for n in chosen:
            del self.busy[n]
        while len(chosen) < size:
            n = self.next % self.buckets
            self.next += 1
            if n not in chosen:
                chosen.append(n)
        return chosen

    def done(self, numbers: Sequence[int], full: Sequence[bool]) -> None:
        """Record which of the buckets just visited came back full (visited first next)."""
        for n, was_full in zip(numbers, full, strict=True):
            self.busy.pop(n, None)
            if was_full:
                self.busy[n] = None


class ClusterStore(Store):
    """``Store`` over ``buckets`` bucket views (module docstring). ``backend``: where the
    views live and the cross-bucket reads go (``BucketBackend``)."""

    def __init__(
        self,
        policy: LeasePolicy,
        backend: BucketBackend,
        *,
        buckets: int = DEFAULT_BUCKETS,
        key_prefix: str = "fg",
        timeout_ms: int = 2000,
        max_dependents: int = 1_000,
        max_cascade: int = 1_000,
        queue_rescan_ms: int = HINT_RESCAN_MS,
    ) -> None:
        super().__init__(policy)
        #: ``HINT_RESCAN_MS`` unless ``[store] cluster_queue_rescan_ms`` says; hints expire
        #: ten times that after their last write (``HINT_TTL_MS`` for the default).
        self._rescan_ms = queue_rescan_ms
        self._hint_ttl_ms = 10 * queue_rescan_ms
        self.buckets = check_buckets(buckets)
        self._max_dependents = max_dependents
        self._max_cascade = max_cascade
        self.key_prefix = key_prefix
        self._timeout_s = timeout_ms / 1000
        self._backend = backend
        self._keys = [keys.Keys(bucket_prefix(key_prefix, n)) for n in range(buckets)]
        self.views: list[RedisStore] = []
        for n in range(buckets):
            view = backend.view(n, self._keys[n].prefix)
            view.max_dependents, view.max_cascade = max_dependents, max_cascade
            # Forwarded at call time, so a metrics hook set on this store sees every step.
            view.observe = lambda op, seconds: self.observe(op, seconds)
            # Durability is per primary, checked once per primary by this store (open,
            # ping), not once per view at its first script (B warnings for one setting).
            view._durability_checked = True
            self.views.append(view)
        self._offset = 0
        self._pinned: int | None = None
        self._sweep_next = _Sweep(buckets)
        self._cascade_next = _Sweep(buckets)
        self._checked = False

    # --- the task limits and the test clock, on every view ----------------------------------

    @property
    def max_dependents(self) -> int:
        """``[tasks] max_dependents``: each bucket's step enforces it, so a change (a test
        narrowing it) reaches every view."""
        return self._max_dependents

    @max_dependents.setter
    def max_dependents(self, value: int) -> None:
        self._max_dependents = value
        for view in self.views:
            view.max_dependents = value

    @property
    def max_cascade(self) -> int:
        """``[tasks] max_cascade``, on every view as ``max_dependents``."""
        return self._max_cascade

    @max_cascade.setter
    def max_cascade(self, value: int) -> None:
        self._max_cascade = value
        for view in self.views:
            view.max_cascade = value

    @property
    def clock_offset_ms(self) -> int:
        return self._offset

    @clock_offset_ms.setter
    def clock_offset_ms(self, value: int) -> None:
        self._offset = value
        for view in self.views:
            view.clock_offset_ms = value

    @property
    def clock_pinned_ms(self) -> int | None:
        """Tests only: ``RedisStore.clock_pinned_ms``, on every view."""
        return self._pinned

    @clock_pinned_ms.setter
    def clock_pinned_ms(self, value: int | None) -> None:
        self._pinned = value
        for view in self.views:
            view.clock_pinned_ms = value

    def _store_time(self, sec: Any, usec: Any) -> int:
        if self._pinned is not None:
            return self._pinned + self._offset
        return int(sec) * 1000 + int(usec) // 1000 + self._offset

    # --- routing --------------------------------------------------------------------------

    @property
    def kind(self) -> str:
        return "redis-cluster"

    def task_view(self, task_id: str) -> RedisStore:
        """The view of the task's bucket (its group's), which holds all of its keys."""
        return self.views[bucket_of_task(task_id, self.buckets)]

    def keyed_view(self, effect_id: str) -> RedisStore:
        return self.views[bucket_of_keyed(effect_id, self.buckets)]

    async def _each(
        self, fn: Callable[[RedisStore], Awaitable[T]], numbers: Iterable[int] | None = None
    ) -> list[T]:
        """``fn`` on the views (all, or ``numbers``), at most ``FANOUT`` at once; the
        answers in bucket order. The first error is raised once every call has ended."""
        gate = asyncio.Semaphore(FANOUT)

        async def one(view: RedisStore) -> T:
            async with gate:
                return await fn(view)

        chosen = self.views if numbers is None else [self.views[n] for n in numbers]
        return list(await asyncio.gather(*(one(view) for view in chosen)))

    async def _read(self, commands: Sequence[tuple[int, tuple[Any, ...]]]) -> list[Any]:
        """Plain commands across buckets (``BucketBackend.read``): reads, and writes of what
        no step decides on (the queues' hints, the bucket count); any error is the store not
        answering (no step was applied)."""
        try:
            async with asyncio.timeout(self._timeout_s):
                replies = await self._backend.read(commands)
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"Redis did not answer ({type(exc).__name__}: {exc})") from exc
        for reply in replies:
            if isinstance(reply, BaseException):
                raise StoreUnavailable(
                    f"Redis did not answer a read ({type(reply).__name__}: {reply})"
                ) from reply
        return replies

    # --- lifecycle ------------------------------------------------------------------------

    async def open(self) -> None:
        """Connect, then check what spans the views once (the bucket count, durability per
        primary); a cluster that is down now is checked at the first ``ping`` that answers."""
        await self._backend.open()
        try:
            await self._check()
        except StoreIncompatible:
            raise
        except StoreUnavailable:
            pass  # not answering yet: ``ping`` checks once it does

    async def _check(self) -> None:
        if self._checked:
            return
        meta = self._keys[0].meta
        _, recorded = await self._read(
            [
                (0, ("HSETNX", meta, _BUCKETS_FIELD, self.buckets)),
                (0, ("HGET", meta, _BUCKETS_FIELD)),
            ]
        )
        if recorded is not None and int(recorded) != self.buckets:
            raise StoreIncompatible(
                f"the store under prefix {self.key_prefix!r} was created with "
                f"store.cluster_buckets = {recorded}, not {self.buckets}: set it back "
                "(moving to another bucket count is `fencegate store copy`)"
            )
        for warning in await self.durability():
            log.warning("store.durability_warning", store=self.kind, reason=warning)
        # Each bucket's format, before its first step: a view checks its own at its first
        # script, after that script's writes, which would make a new bucket read as
        # written by an older fencegate (format 1) and switch its retention off.
        await self._each(lambda view: view._check_format())
        self._checked = True

    async def close(self) -> None:
        await self._each(lambda view: view.close())
        await self._backend.aclose()

    async def ping(self) -> None:
        """Every primary once (not every view); then the views that refuse writes look
        whether an operator acknowledged (``RedisStore.ping``)."""
        try:
            async with asyncio.timeout(self._timeout_s):
                replies = await self._backend.each_primary("PING")
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"Redis did not answer ({type(exc).__name__}: {exc})") from exc
        for address, reply in replies.items():
            if isinstance(reply, BaseException):
                raise StoreUnavailable(f"the primary at {address} did not answer: {reply}")
        await self._check()
        refusing = [n for n, view in enumerate(self.views) if view.regressed]
        if refusing:
            await self._each(lambda view: view.ping(), refusing)

    async def now_ms(self) -> int:
        return await self.views[0].now_ms()

    async def durability(self) -> list[str]:
        """Each primary's durability warnings, once per primary (named when there are
        several)."""
        try:
            async with asyncio.timeout(self._timeout_s):
                replies = await self._backend.each_primary(
                    "CONFIG", "GET", "appendonly", "appendfsync", "maxmemory-policy"
                )
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"Redis did not answer ({type(exc).__name__}: {exc})") from exc
        out: list[str] = []
        for address, reply in sorted(replies.items()):
            if isinstance(reply, ResponseError):
                raise StoreUnavailable(f"Redis refused the operation: {reply}") from reply
            if isinstance(reply, BaseException):
                raise StoreUnavailable(f"the primary at {address} did not answer: {reply}")
            for warning in durability_warnings(_config(reply)):
                out.append(f"{address}: {warning}" if len(replies) > 1 else warning)
        return out

    @property
    def regressed(self) -> bool:
        """Has any bucket's shard lost writes this gateway saw acknowledged?"""
        return any(view.regressed for view in self.views)

    async def acknowledge_failover(self) -> Scheduler:
        """Every view's acknowledgement (each bumps its own copy's epoch once and takes its
        flag down). Not behind the bump's barrier: claims are refused while regressed
        anyway, until this returns."""
        return _store_scheduler(await self._each(lambda view: view.acknowledge_failover()))

    # --- one task's steps: its bucket's view, unchanged --------------------------------------

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
        """Refuses a dependency of another task group first (its step could not read it),
        unless the put changes nothing: the same ``inputDigest`` as the record's is answered
        UNCHANGED whatever ``dependsOn`` says (docs/PROTOCOL.md, as every store answers it),
        read from the task's bucket with nothing written."""
        view = self.task_view(task_id)
        try:
            task_graph.check_same_group(task_id, depends_on or (), task_group)
        except BadRequest as refusal:
            try:
                found = await view.get_task(task_id)
            except FencegateError:
                raise refusal from None
            if found.input_digest == input_digest:
                return found, PutOutcome.UNCHANGED
            raise
        task, outcome = await view.put_task(
            task_id,
            input_digest,
            max_runtime_ms,
            queue=queue,
            priority=priority,
            depends_on=depends_on,
        )
        if task.queue is not None and task.state is TaskState.READY:
            await self._owed_hints(bucket_of_task(task_id, self.buckets))
        return task, outcome

    async def get_task(self, task_id: str) -> Task:
        return await self.task_view(task_id).get_task(task_id)

    async def claim(self, task_id: str, request: ClaimRequest) -> Task:
        view = self.task_view(task_id)
        return await self._past_barrier(lambda: view.claim(task_id, request))

    async def _past_barrier(self, step: Callable[[], Awaitable[T]]) -> T:
        """Run a claim step again while it meets an epoch bump's barrier (``BumpBarrier``:
        nothing was applied), with backoff up to the barrier's own deadline, within the
        store timeout; then a plain ``StoreUnavailable``. A claim that meets a bump in
        progress is delayed, never answered CLAIMS_PAUSED (docs/decisions.md, "The
        scheduler: a copy per bucket, bumped behind a barrier")."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        delay = 0.005
        while True:
            try:
                return await step()
            except BumpBarrier as held:
                left = deadline - loop.time()
                if left <= 0:
                    raise StoreUnavailable(
                        "an epoch bump is in progress in every bucket; nothing was applied: "
                        "retry the claim"
                    ) from held
                await asyncio.sleep(min(delay, left, max(held.retry_after_ms, 1) / 1000))
                delay = min(delay * 2, 0.1)

    async def renew(self, task_id: str, request: RenewRequest) -> Task:
        return await self.task_view(task_id).renew(task_id, request)

    async def release(self, task_id: str, identity: Identity) -> Task:
        task = await self.task_view(task_id).release(task_id, identity)
        if task.queue is not None:
            await self._owed_hints(bucket_of_task(task_id, self.buckets))
        return task

    async def commit(self, task_id: str, request: CommitRequest) -> tuple[Task, bool]:
        """A first commit may make dependents READY (in this bucket: ``dependsOn`` stays in
        one group), whose queues it cannot name: the bucket's owed hints are moved after."""
        task, replayed = await self.task_view(task_id).commit(task_id, request)
        if not replayed:
            await self._owed_hints(bucket_of_task(task_id, self.buckets))
        return task, replayed

    async def cancel(self, task_id: str) -> Task:
        return await self.task_view(task_id).cancel(task_id)

    async def check_fence(self, fence: Fence) -> Task:
        return await self.task_view(fence.task_id).check_fence(fence)

    async def find_forward(self, task_id: str, forward_id: str) -> str | None:
        return await self.task_view(task_id).find_forward(task_id, forward_id)

    async def prepare_effect(
        self,
        request: EffectRequest,
        forward_deadline_ms: int,
        *,
        resend_window_ms: int | None = None,
        require_approval: bool = False,
    ) -> PrepareOutcome:
        """A leased effect in its task's bucket; a keyed one in its id's bucket."""
        if request.fence is not None:
            view = self.task_view(request.fence.task_id)
        else:
            assert request.effect_id is not None
            view = self.keyed_view(request.effect_id)
        return await view.prepare_effect(
            request,
            forward_deadline_ms,
            resend_window_ms=resend_window_ms,
            require_approval=require_approval,
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
        view = self.keyed_view(effect_id) if task_id is None else self.task_view(task_id)
        return await view.complete_effect(
            task_id, effect_id, seq, attempt_id, outcome, reason, response_json
        )

    # --- queue claims -------------------------------------------------------------------------

    async def claim_next(self, queue: str, request: ClaimRequest) -> Task | None:
        """The queue's best claimable task over the buckets its hint names, claimed.

        One pipelined read of those buckets' candidates (one batch per node: 3 range reads
        per named bucket, plus the records of any claims found claimable again): the head of
        the queue's ``ready`` set (READY tasks, in ``queue_order``), and the first claims
        whose lease ran out (``held``) or that were granted under an older epoch
        (``epochs``), ranked by their records. The best bucket's own ``claim_next`` then
        claims (it re-checks inside its step, so a task another step took is never granted);
        a bucket found empty by then (a lost race) passes to the next best. With no
        candidate anywhere, bucket 0's ``claim_next`` answers, so a paused store or a stale
        epoch is refused even when the queue is empty, as on one Redis."""
        for candidate in await self._candidates(queue, request.scheduler_epoch):
            claim = functools.partial(self.views[candidate.bucket].claim_next, queue, request)
            task = await self._past_barrier(claim)
            if task is not None:
                return task
        return await self._past_barrier(lambda: self.views[0].claim_next(queue, request))

    async def _candidates(self, queue: str, epoch: int) -> list[_Candidate]:
        """Each hinted bucket's best claimable candidate of ``queue``, best first."""
        home = bucket_of_queue(queue, self.buckets)
        (sec, usec), hint = await self._read(
            [(0, ("TIME",)), (home, ("HGETALL", self._keys[home].queue_buckets(queue)))]
        )
        now = self._store_time(sec, usec)
        numbers = await self._hinted(queue, _fields(hint), now)
        if not numbers:
            return []
        # One batch: each bucket's ready head, then its first held and epochs candidates.
        reads: list[tuple[int, tuple[Any, ...]]] = []
        for n in numbers:
            k = self._keys[n]
            reads += [
                (n, ("ZRANGE", k.queue_ready(queue), 0, 0)),
                (n, ("ZRANGEBYSCORE", k.queue_held(queue), "-inf", now, "LIMIT", 0,
                     _MOVED_CANDIDATES)),
                (n, ("ZRANGEBYSCORE", k.queue_epochs(queue), "-inf", f"({epoch}", "LIMIT", 0,
                     _MOVED_CANDIDATES)),
            ]  # fmt: skip
        replies = await self._read(reads)
        best: dict[int, _Candidate] = {}
        records: list[tuple[int, str]] = []
        for i, n in enumerate(numbers):
            head, held, epochs = replies[3 * i : 3 * i + 3]
            if head:
                rank, ready_at, task_id = str(head[0]).split(":", 2)
                best[n] = _Candidate(int(rank), int(ready_at), task_id, n)
            records += [(n, str(task_id)) for task_id in (*held, *epochs)]
        records = list(dict.fromkeys(records))
        if records:
            fields = await self._read(
                [
                    (
                        n,
                        (
                            "HMGET",
                            self._keys[n].task(task_id),
                            "queue",
                            "priority",
                            "ready_at",
                            "created_at",
                        ),
                    )
                    for n, task_id in records
                ]
            )
            for (n, task_id), (q, priority, ready_at, created_at) in zip(
                records, fields, strict=True
            ):
                if q != queue or (ready_at is None and created_at is None):
                    continue  # gone or moved: the bucket's claim_next tidies it
                found = _Candidate(
                    _PRIORITY_BASE - int(priority or 0),
                    int(ready_at if ready_at is not None else created_at),
                    task_id,
                    n,
                )
                if n not in best or found < best[n]:
                    best[n] = found
        return sorted(best.values())

    # --- the queues' hints (docs/decisions.md, "Queues: an index per bucket, a hint per
    # queue") ----------------------------------------------------------------------------------

    async def _hinted(self, queue: str, hint: dict[str, str], now: int) -> list[int]:
        """The buckets a queue claim reads: the hint's, or, when its last rescan is older
        than ``[store] cluster_queue_rescan_ms`` (or it has none), every bucket that holds
        any of the queue's READY or CLAIMED tasks, found now."""
        scanned = hint.pop(_SCANNED_AT, None)
        if scanned is not None and 0 <= now - int(scanned) < self._rescan_ms:
            return sorted(int(n) for n in hint)
        return await self._rescan_hint(queue, hint, now)

    async def _rescan_hint(self, queue: str, read: dict[str, str], now: int) -> list[int]:
        """Rebuild the queue's hint from every bucket's queue sets (``read``: its bucket
        fields as the claim read them, before it looked at the buckets). One step writes it
        (``queue_hint_rescan.lua``): the buckets found full added, the ones found empty
        taken out only if their field still holds the token read, and the new stamp. A step
        that filled a bucket after the look writes a new token into the hint after its step
        (``_owed_hints``), before or after this write: either way its bucket stays named.
        A rescan that fails before the write changes nothing."""
        home = bucket_of_queue(queue, self.buckets)
        # One EXISTS of the queue's three sets per bucket (they share its slot): more than 0
        # when the bucket holds any of the queue's READY or CLAIMED tasks.
        counts = await self._read(
            [
                (n, ("EXISTS", k.queue_ready(queue), k.queue_held(queue), k.queue_epochs(queue)))
                for n, k in enumerate(self._keys)
            ]
        )
        live = {n for n, count in enumerate(counts) if int(count)}
        named = {int(n): token for n, token in read.items()}
        gone = sorted(set(named) - live)
        args: list[Any] = [now, self._hint_ttl_ms, _token(), len(gone)]
        for n in gone:
            args += [n, named[n]]
        args += sorted(live - set(named))
        key = self._keys[home].queue_buckets(queue)
        await self._read([(home, ("EVAL", _HINT_RESCAN, 1, key, *args))])
        return sorted(live)

    async def _owed_hints(self, bucket: int) -> None:
        """After a step that may have made tasks READY in ``bucket``: take the queues the
        bucket owes a hint (``Keys.queue_owed``, written by ``task_lib.lua`` in the step)
        and name the bucket in each one's hint with a fresh token (``queue_hint_add.lua``).
        Taking before writing makes every owed entry, whichever step added it (a step adding
        a queue already owed adds nothing), lead to one hint write after that step. The step
        is applied whatever happens here: a failure is logged, and the queue's next rescan
        (within ``cluster_queue_rescan_ms``) finds the bucket."""
        owed_key = self._keys[bucket].queue_owed
        try:
            for _ in range(_OWED_ROUNDS):
                (owed,) = await self._read([(bucket, ("SPOP", owed_key, _OWED_BATCH))])
                queues = sorted(str(q) for q in owed or ())
                writes: list[tuple[int, tuple[Any, ...]]] = []
                for q in queues:
                    home = bucket_of_queue(q, self.buckets)
                    key = self._keys[home].queue_buckets(q)
                    args = (bucket, _token(), self._hint_ttl_ms)
                    writes.append((home, ("EVAL", _HINT_ADD, 1, key, *args)))
                if writes:
                    await self._read(writes)
                if len(queues) < _OWED_BATCH:
                    return
        except StoreUnavailable as exc:
            log.warning("store.queue_hint_failed", store=self.kind, bucket=bucket, error=str(exc))

    # --- an effect by its id alone ------------------------------------------------------------

    async def _effect_view(self, effect_id: str) -> RedisStore:
        """The view holding the effect (or its tombstone): the keyed bucket first (one read),
        then every bucket's directory in one pipelined read. An id no bucket knows is
        NO_SUCH_EFFECT."""
        home = bucket_of_keyed(effect_id, self.buckets)

        def probe(n: int) -> list[tuple[int, tuple[Any, ...]]]:
            k = self._keys[n]
            return [
                # New effects whose directory entry still waits (index_catch_up.lua): read
                # before the directory, since another client's catch-up may run between two
                # commands of the pipeline. Read after it, a catch-up in between would show
                # the directory without the id and the list empty: an effect that existed
                # before this look-up, unknown. Read first, an empty list means every effect
                # created before it is in the directory read next.
                (n, ("LLEN", k.effects_created)),
                (n, ("HEXISTS", k.effect_tasks, effect_id)),
                (n, ("EXISTS", k.keyed_effect(effect_id))),
                (n, ("EXISTS", k.effect_tombstone(effect_id))),
            ]

        first = await self._read(probe(home))
        if first[1] or first[2]:
            return self.views[home]
        others = [n for n in range(self.buckets) if n != home]
        replies = [*first, *await self._read([c for n in others for c in probe(n)])]
        every = [home, *others]
        found = [n for i, n in enumerate(every) if replies[4 * i + 1] or replies[4 * i + 2]]
        waiting = [n for i, n in enumerate(every) if replies[4 * i]]
        refused: list[StoreUnavailable] = []
        if not found and waiting:  # it may be one of those (RedisStore._task_of)

            async def catch_up(view: RedisStore) -> None:
                # A bucket that cannot catch up now (its slot moving: FROZEN) must not hide
                # an effect another bucket holds; it only keeps "unknown" from being said.
                try:
                    if not await view.catch_up_indexes():
                        refused.append(redis_store.behind_refusal())
                except StoreUnavailable as exc:
                    refused.append(exc)

            await self._each(catch_up, waiting)
            again = await self._read([(n, ("HEXISTS", self._keys[n].effect_tasks, effect_id))
                                      for n in waiting])  # fmt: skip
            found = [n for n, known in zip(waiting, again, strict=True) if known]
        if found:
            return self.views[found[0]]
        tombstones = [n for i, n in enumerate(every) if replies[4 * i + 3]]
        if tombstones:
            return self.views[tombstones[0]]  # its view refuses EFFECT_EXPIRED (or as it finds)
        if refused:  # it may wait in a bucket that could not catch up: retry, not unknown
            raise refused[0]
        raise NoSuchEffect().about_effect(effect_id)

    async def get_effect(self, effect_id: str) -> Effect:
        view = await self._effect_view(effect_id)
        return await view.get_effect(effect_id)

    async def get_keyed_effect(self, effect_id: str) -> Effect:
        """Its own bucket only (``bucket_of_keyed``): a client's look-up by idempotency key
        costs one read, not one per bucket."""
        return await self.views[bucket_of_keyed(effect_id, self.buckets)].get_effect(effect_id)

    async def update_effect(self, effect_id: str, transition: EffectTransition) -> Effect:
        view = await self._effect_view(effect_id)
        return await view.update_effect(effect_id, transition)

    async def find_effects(self, prefix: str, limit: int) -> list[str]:
        """Each view's first ``limit`` ids with the prefix, merged in id order."""
        effect_prefix_bounds(prefix)  # refuses anything but lowercase hex, before any read
        pages = await self._each(lambda view: view.find_effects(prefix, limit))
        return sorted(itertools.chain.from_iterable(pages))[:limit]

    # --- listings -----------------------------------------------------------------------------

    async def list_tasks(
        self, wanted: TaskFilter, limit: int, after: str | None
    ) -> tuple[list[Task], str | None]:
        """Each view's page after ``after``, merged in task id order (``merge_pages``, exact
        up to the lowest bucket that has more). Each bucket reads at most its share of
        ``TASK_SCAN`` records, and at least ``limit + 1`` (so a full page can come from one
        bucket), then the buckets that have more read on once (``_listing``): at most about
        twice ``max(TASK_SCAN, B x (limit + 1))`` in all, not ``B`` x ``TASK_SCAN``. A page
        may be short while ``nextCursor`` is set (docs/PROTOCOL.md), as on one store."""

        async def page(n: int, since: str | None, scan: int) -> tuple[list[Task], str | None]:
            return await self.views[n].list_tasks(wanted, limit, since, scan=scan)

        return await self._listing(
            page, after, lambda task: task.task_id, lambda nxt: nxt, limit, store_module.TASK_SCAN
        )

    async def _listing(
        self,
        page: Callable[[int, str | None, int], Awaitable[tuple[list[X], str | None]]],
        after: str | None,
        key: Callable[[X], K],
        cursor_key: Callable[[str], K],
        limit: int,
        total_scan: int,
    ) -> tuple[list[X], K | None]:
        """A listing over every bucket (``page(n, cursor, scan)``: bucket n's page after the
        cursor, reading at most ``scan``), merged by ``merge_pages``. Each bucket first reads
        its share of ``total_scan`` (one store's bound per call), at least ``limit + 1``;
        when that gives a short page while buckets have more, those buckets read on from
        their own cursors, sharing ``total_scan`` again. Each bucket's items stay everything
        it has up to its own cursor, so the merge is as exact as in one round."""
        scan = max(math.ceil(total_scan / self.buckets), limit + 1)
        numbers = range(self.buckets)
        first = await self._each_bucket(lambda n: page(n, after, scan), numbers)
        found: dict[int, tuple[list[X], str | None]] = dict(enumerate(first))

        def merged() -> tuple[list[X], K | None]:
            pages = ((got, None if c is None else cursor_key(c)) for got, c in found.values())
            return merge_pages(pages, key, limit)

        items, nxt = merged()
        going = [n for n, (_, more) in found.items() if more is not None]
        if len(items) == limit or not going:
            return items, nxt
        scan = max(math.ceil(total_scan / len(going)), limit + 1)
        more = await self._each_bucket(lambda n: page(n, found[n][1], scan), going)
        for n, (items_more, nxt_more) in zip(going, more, strict=True):
            found[n] = (found[n][0] + items_more, nxt_more)
        return merged()

    async def list_effects(
        self,
        *,
        state: EffectState | None,
        task_id: str | None,
        downstream: str | None,
        limit: int,
        cursor: str | None,
    ) -> tuple[list[Effect], str | None]:
        """One task's effects from its bucket; all effects: each view's page after the same
        cursor, merged in creation order."""
        if task_id is not None:
            return await self.task_view(task_id).list_effects(
                state=state, task_id=task_id, downstream=downstream, limit=limit, cursor=cursor
            )
        if cursor:
            decode_cursor(cursor)  # 400 before any bucket is read

        async def page(n: int, since: str | None, scan: int) -> tuple[list[Effect], str | None]:
            return await self.views[n].list_effects(
                state=state,
                task_id=None,
                downstream=downstream,
                limit=limit,
                cursor=since,
                scan=scan,
            )

        # Each bucket reads its share of what one Redis reads per call (``_listing``).
        items, nxt = await self._listing(
            page,
            cursor,
            lambda e: (e.created_at, e.effect_id),
            decode_cursor,
            limit,
            redis_store._LIST_SCAN,
        )
        return items, encode_cursor(*nxt) if nxt is not None else None

    async def unsettled_effects(
        self, limit: int, probe_downstreams: frozenset[str]
    ) -> list[Effect]:
        """Each view's work list, merged: up to ``limit`` overdue PREPARED effects (each
        view lists them first; they read UNKNOWN with their deadline as the last attempt's
        end) by deadline, then up to ``limit`` probe-due ones by when they fall due."""
        lists = await self._each(lambda view: view.unsettled_effects(limit, probe_downstreams))
        overdue: list[Effect] = []
        due: list[Effect] = []
        for found in lists:
            for effect in found:
                last = effect.attempts[-1] if effect.attempts else None
                converted = (
                    effect.state is EffectState.UNKNOWN
                    and effect.next_probe_at is None
                    and last is not None
                    and last.ended_at is not None
                    and effect.updated_at > last.ended_at
                )
                (overdue if converted else due).append(effect)
        overdue.sort(key=lambda e: (e.attempts[-1].ended_at or 0, e.effect_id))
        due.sort(key=lambda e: (e.next_probe_at or 0, e.created_at, e.effect_id))
        return overdue[:limit] + due[:limit]

    async def awaiting_approval(self, limit: int) -> list[Effect]:
        lists = await self._each(lambda view: view.awaiting_approval(limit))
        merged = sorted(
            itertools.chain.from_iterable(lists), key=lambda e: (e.created_at, e.effect_id)
        )
        return merged[:limit]

    # --- sums -------------------------------------------------------------------------------

    async def gauges(self) -> Gauges:
        """Every bucket's gauges, summed (one gauges.lua per bucket)."""
        each = await self._each(lambda view: view.gauges())
        return Gauges(
            active_leases=sum(g.active_leases for g in each),
            prepared_effects=sum(g.prepared_effects for g in each),
            unknown_effects=sum(g.unknown_effects for g in each),
            awaiting_approval=sum(g.awaiting_approval for g in each),
            unknown_keyed_effects=sum(g.unknown_keyed_effects for g in each),
        )

    async def store_stats(self, settled_ms: int) -> StoreStats:
        """Every bucket's counts summed; ``bytes``: every primary's ``used_memory`` once."""
        each, memory = await asyncio.gather(
            self._each(lambda view: view.store_stats(settled_ms)),
            self._backend.each_primary("INFO", "memory"),
        )
        detail: dict[str, int] = {}
        for stats in each:
            for name, size in stats.bytes_detail.items():
                detail[name] = detail.get(name, 0) + size
        used = [
            int(info["used_memory"])
            for info in memory.values()
            if isinstance(info, dict) and "used_memory" in info
        ]
        return StoreStats(
            tasks=sum(s.tasks for s in each),
            claimed_tasks=sum(s.claimed_tasks for s in each),
            settled_tasks=sum(s.settled_tasks for s in each),
            due_tasks=sum(s.due_tasks for s in each),
            effects=sum(s.effects for s in each),
            prepared_effects=sum(s.prepared_effects for s in each),
            unknown_effects=sum(s.unknown_effects for s in each),
            awaiting_approval=sum(s.awaiting_approval for s in each),
            task_tombstones=sum(s.task_tombstones for s in each),
            effect_tombstones=sum(s.effect_tombstones for s in each),
            events=sum(s.events for s in each),
            bytes=sum(used) if used else None,
            bytes_detail=detail,
        )

    async def migrate(self) -> Migration:
        """Every view's migration (each idempotent), as one: the oldest format found, what
        each bucket did (named by bucket), the notes once."""
        each = await self._each(lambda view: view.migrate())
        founds = [m.found for m in each if m.found is not None]
        done = tuple(f"bucket {n}: {line}" for n, m in enumerate(each) for line in m.done)
        notes = tuple(dict.fromkeys(note for m in each for note in m.notes))
        return Migration(
            store=self.kind,
            found=min(founds) if founds else None,
            current=FORMAT_VERSION,
            done=done,
            notes=notes,
        )

    # --- sweeps: a bounded number of buckets per call ----------------------------------------

    async def expire_settled(self, settled_ms: int, tombstone_ms: int, limit: int) -> ExpiryReport:
        """One retention step in each of ``SWEEP_BUCKETS`` buckets: those whose last step
        was full first, then round-robin (``_Sweep``, per store object; several gateways
        sweeping overlap harmlessly). At most ``SWEEP_BUCKETS`` x ``limit`` tasks read per
        call, each bucket's step atomic and bounded by ``limit`` as on one Redis; summed. A
        busy bucket so gets a step every call while it has a full one to do, not one every
        ``B / SWEEP_BUCKETS`` calls."""
        numbers = self._sweep_next.round(SWEEP_BUCKETS)
        reports = await self._each(
            lambda view: view.expire_settled(settled_ms, tombstone_ms, limit), numbers
        )
        self._sweep_next.done(
            numbers, [r.examined >= limit or r.forgotten >= limit for r in reports]
        )
        return _sum_reports(reports)

    async def continue_cascades(self, limit: int) -> int:
        """The recorded cascades of ``SWEEP_BUCKETS`` buckets (those whose last step was full
        first, then round-robin: ``_Sweep``), one step of up to ``limit`` each. When those had
        none, every bucket's set of recorded cascades is counted (one pipelined read) and up
        to ``SWEEP_BUCKETS`` of the buckets that have some take their step: so 0 means no
        bucket had any, as ``Store.continue_cascades`` promises (the caller then waits
        longer). Also finishes a bump whose coordinator was lost (``finish_abandoned_bump``),
        this being the sweep every gateway runs."""
        numbers = self._cascade_next.round(SWEEP_BUCKETS)
        handled = await self._each(lambda view: view.continue_cascades(limit), numbers)
        self._cascade_next.done(numbers, [n >= limit for n in handled])
        if not any(handled) and self.buckets > len(numbers):
            counts = await self._read(
                [(n, ("SCARD", k.cascades)) for n, k in enumerate(self._keys)]
            )
            pending = [n for n, count in enumerate(counts) if int(count)][:SWEEP_BUCKETS]
            if pending:
                handled = await self._each(lambda view: view.continue_cascades(limit), pending)
                self._cascade_next.done(pending, [n >= limit for n in handled])
        await self.finish_abandoned_bump()
        return sum(handled)

    # --- the change feed ---------------------------------------------------------------------

    async def read_events(self, after: str | None, limit: int) -> tuple[list[Event], str]:
        """Per-bucket pages merged by ``ledger.cluster_feed``. ``after`` None: the position
        of every bucket's end (``start_vector``). Otherwise every bucket's events after its
        own place in the ``c1.`` vector, interleaved in stream id order, at most ``limit``; a
        bucket whose place was trimmed away or is ahead of its stream's last generated id is
        410 (``EventsGone``), naming the lowest such bucket.

        What is read is bounded by ``2 x limit + B`` events, not ``B x limit``: every bucket
        first gives its share, ``ceil(2 x limit / B)`` (at least one); a bucket whose page
        came back full may hold events before those of other buckets, so the merge delivers
        nothing past the earliest last id of such a bucket (``merge``'s ``truncated``). When
        that holds back the answer, the full buckets that hold it back are read further with
        what is left of the budget (at most ``FEED_ROUNDS`` rounds). Order and exactness are
        the merge's; at least one event is delivered when any bucket has one after its
        place."""
        if after is None:
            ends = await self._each(lambda view: view.read_events(None, 0))
            return [], cluster_feed.encode(cluster_feed.start_vector([pos for _, pos in ends]))
        vector = cluster_feed.decode(after, self.buckets)
        budget = 2 * limit + self.buckets
        asks = dict.fromkeys(range(self.buckets), max(1, math.ceil(2 * limit / self.buckets)))
        pages: dict[int, list[tuple[str, dict[str, Any]]]] = {}
        full: set[int] = set()
        spent = 0
        for round_ in range(FEED_ROUNDS):
            got = await self._feed_pages(vector, pages, asks)
            for n, found in got.items():
                spent += len(found)
                pages.setdefault(n, []).extend(found)
                if len(found) == asks[n]:
                    full.add(n)
                else:
                    full.discard(n)
            events, position = cluster_feed.merge(vector, pages, limit, truncated=full)
            left = budget - spent
            if len(events) == limit or not full or left <= 0 or round_ == FEED_ROUNDS - 1:
                break
            # The full buckets whose last id is below the limit-th event read so far (all
            # of them when fewer were read): their unread events may come before it.
            read = [(cluster_feed.parse_id(i), n) for n, page in pages.items() for i, _ in page]
            cut = heapq.nsmallest(limit, read)[-1] if len(read) >= limit else None
            last = {n: (cluster_feed.parse_id(pages[n][-1][0]), n) for n in full}
            behind = sorted((n for n in full if cut is None or last[n] < cut), key=last.__getitem__)
            behind = behind[:left]
            asks = dict.fromkeys(behind, max(1, left // max(1, len(behind))))
        return events, cluster_feed.encode(position)

    async def _feed_pages(
        self,
        vector: cluster_feed.Vector,
        pages: dict[int, list[tuple[str, dict[str, Any]]]],
        asks: dict[int, int],
    ) -> dict[int, list[tuple[str, dict[str, Any]]]]:
        """Up to ``asks[n]`` events of each asked bucket after what ``pages`` holds of it
        (after its place in ``vector`` at first). A bucket whose events there were trimmed
        away, or whose place is ahead of the newest id its stream issued (events lost), is 410
        for the subscriber too (``events.gone``, decided by the bucket's ``read_events``),
        named by the bucket."""
        gate = asyncio.Semaphore(FANOUT)

        async def page(n: int) -> list[Event] | EventsGone:
            done = pages.get(n)
            since = done[-1][0] if done else cluster_feed.format_id(vector[n])
            async with gate:
                try:
                    found, _ = await self.views[n].read_events(since, asks[n])
                except EventsGone as exc:
                    return exc
            return found

        numbers = sorted(asks)
        read = await asyncio.gather(*(page(n) for n in numbers))
        out: dict[int, list[tuple[str, dict[str, Any]]]] = {}
        for n, found in zip(numbers, read, strict=True):
            if isinstance(found, EventsGone):
                raise EventsGone(f"bucket {n}: {found.detail}")
            out[n] = [(e.position, e.body) for e in found]
        return out

    async def trim_events(self, keep: int) -> int:
        """Keep the newest ``keep`` events of the whole feed, as one Redis does: one cut-off
        id ``C`` over every bucket (the ``keep``-th newest id of all), and every bucket drops
        its events below it, so a busy bucket keeps as many as it holds of the newest
        ``keep``; answers how many went.

        The search, bounded: one ``XLEN`` per bucket (nothing more when the feed holds at
        most ``keep``); then each bucket's newest ids (ids only, events_ids.lua), first its
        share of ``keep`` by its length, then, for up to ``TRIM_ROUNDS`` rounds, more from
        the buckets whose oldest id read is above the cut-off found so far (they may hold
        unread ids above it): at most ``2 x keep + B`` ids read in all. The cut-off found is
        never above the true one (it is the ``keep``-th newest of a subset), so at least
        ``keep`` events are kept (ids equal across buckets are ordered by bucket, as the
        merge orders them); when the budget runs out, some buckets keep more. Each
        bucket then drops at most the events it held below the cut-off when counted
        (``RedisStore.trim_events`` with ``before``, which records the max deleted id that
        410 depends on), so an event appended meanwhile is never dropped."""
        if keep <= 0:
            return sum(await self._each(lambda view: view.trim_events(0)))
        lengths = [
            int(n)
            for n in await self._read([(n, ("XLEN", k.events)) for n, k in enumerate(self._keys)])
        ]
        total = sum(lengths)
        if total <= keep:
            return 0
        ids: list[list[cluster_feed.StreamId]] = [[] for _ in range(self.buckets)]
        asks = {
            n: min(length, math.ceil(keep * length / total))
            for n, length in enumerate(lengths)
            if length
        }
        budget, spent = 2 * keep + self.buckets, 0
        cut: tuple[cluster_feed.StreamId, int] | None = None
        for _ in range(TRIM_ROUNDS):
            got = await self._newest_ids(ids, asks)
            for n, found in got.items():
                spent += len(found)
                ids[n] += found
            union = heapq.nlargest(keep, ((i, n) for n in range(self.buckets) for i in ids[n]))
            if len(union) < keep:  # trimmed meanwhile by another gateway: nothing to do now
                return 0
            cut = union[-1]
            below = {
                n: ((ids[n][-1], n), len(ids[n]) < lengths[n])
                for n in range(self.buckets)
                if ids[n]
            }
            hidden = [n for n, (oldest, unread) in below.items() if unread and oldest > cut]
            left = budget - spent
            if not hidden or left < len(hidden):
                break
            union.reverse()  # oldest first: how many each hidden bucket's unread ids may pass
            asks = {
                n: max(1, min(bisect.bisect_left(union, below[n][0]), left // len(hidden)))
                for n in hidden
            }
        assert cut is not None
        # Kept: (id, bucket) at or above the cut (the merge's order), so a bucket below the
        # cut's drops its id equal to the cut's too: below the next id.
        (ms, seq), at = cut
        after_cut = (ms, seq + 1) if seq < cluster_feed.MAX_STREAM_ID_PART else (ms + 1, 0)
        bounds = {n: cut[0] if n >= at else after_cut for n in range(self.buckets)}
        caps = {
            n: lengths[n] - sum(1 for i in ids[n] if i >= bounds[n])
            for n in range(self.buckets)
            if lengths[n]
        }
        caps = {n: cap for n, cap in caps.items() if cap > 0}
        dropped = await self._each_bucket(
            lambda n: self.views[n].trim_events(
                0, before=cluster_feed.format_id(bounds[n]), most=caps[n]
            ),
            caps,
        )
        return sum(dropped)

    async def _newest_ids(
        self, ids: list[list[cluster_feed.StreamId]], asks: dict[int, int]
    ) -> dict[int, list[cluster_feed.StreamId]]:
        """Up to ``asks[n]`` more of each asked bucket's newest ids, below those in ``ids``."""

        async def more(n: int) -> list[cluster_feed.StreamId]:
            found: list[cluster_feed.StreamId] = []
            while len(found) < asks[n]:
                last = found[-1] if found else (ids[n][-1] if ids[n] else None)
                want = min(_TRIM_IDS_BATCH, asks[n] - len(found))
                got = await self.views[n].event_ids(
                    None if last is None else cluster_feed.format_id(last), want
                )
                found += [cluster_feed.parse_id(i) for i in got]
                if len(got) < want:
                    break
            return found

        numbers = sorted(asks)
        return dict(zip(numbers, await self._each_bucket(more, numbers), strict=True))

    async def _each_bucket(
        self, fn: Callable[[int], Awaitable[T]], numbers: Iterable[int]
    ) -> list[T]:
        """``fn`` on each bucket number, at most ``FANOUT`` at once; answers in that order."""
        gate = asyncio.Semaphore(FANOUT)

        async def one(n: int) -> T:
            async with gate:
                return await fn(n)

        return list(await asyncio.gather(*(one(n) for n in numbers)))

    # --- the scheduler: one copy per bucket --------------------------------------------------

    async def get_scheduler(self) -> Scheduler:
        """Every copy read: the highest epoch, paused when any copy is
        (``scheduler_copies.current_epoch``, ``claims_paused``)."""
        return _store_scheduler(await self._each(lambda view: view.get_scheduler()))

    async def set_claims_paused(self, paused: bool) -> Scheduler:
        """Numbered (``scheduler_copies.begin_pause`` in bucket 0, ``with_paused`` on every
        other copy), answered once every copy has it: no claim is granted after a pause's
        answer, and a pause and a resume that overlap end agreeing on the later one."""
        copy0, _ = await self.views[0].scheduler_copy("begin_pause", int(paused))
        generation = copy0.pause_generation

        async def apply(view: RedisStore) -> Copy:
            copy, _ = await view.scheduler_copy("paused", int(paused), generation)
            return copy

        rest = await self._each(apply, range(1, self.buckets))
        return _copies_scheduler([copy0, *rest])

    async def bump_epoch(self) -> Scheduler:
        """Move every copy to one new epoch: ``ledger.scheduler_copies``' five phases (intent
        in bucket 0, barrier on every copy, epoch on every copy, barrier off, intent
        cleared), each applied to every bucket before the next. A leftover intent of a lost
        coordinator is finished first, and answered only when it reaches this bump's
        target (``bump_answers``)."""
        wanted = scheduler_copies.bump_target(await self._copies())
        while True:
            now = await self.now_ms()
            bucket0, _ = await self.views[0].scheduler_copy("read")
            target = max(wanted, bucket0.epoch + 1)
            _, intent = await self.views[0].scheduler_copy(
                "begin_bump", target, now + scheduler_copies.BARRIER_MS
            )
            assert intent is not None
            await self._finish_bump(intent.target)
            if scheduler_copies.bump_answers(intent, wanted):
                return _copies_scheduler(await self._copies())

    async def _copies(self) -> list[Copy]:
        async def read(view: RedisStore) -> Copy:
            copy, _ = await view.scheduler_copy("read")
            return copy

        return await self._each(read)

    async def _finish_bump(self, target: int) -> None:
        """Phases 2 to 5 of the bump toward ``target``, each on every copy before the next
        (every step idempotent: a finisher beside a live coordinator is only needless)."""
        until = await self.now_ms() + scheduler_copies.BARRIER_MS

        async def on_every(op: str, *args: int) -> None:
            async def one(view: RedisStore) -> None:
                await view.scheduler_copy(op, *args)

            await self._each(one)

        await on_every("barrier", target, until)
        await on_every("bump", target)
        await on_every("clear", target)
        await self.views[0].scheduler_copy("end_bump", target)

    async def finish_abandoned_bump(self) -> bool:
        """Finish a bump whose intent is past its deadline (its coordinator presumed lost);
        whether there was one."""
        _, intent = await self.views[0].scheduler_copy("read")
        if not scheduler_copies.intent_abandoned(intent, await self.now_ms()):
            return False
        assert intent is not None
        await self._finish_bump(intent.target)
        return True


def _store_scheduler(copies: Sequence[Scheduler]) -> Scheduler:
    """The store-wide record from every copy's: the highest epoch, paused if any is."""
    return Scheduler(
        epoch=max(s.epoch for s in copies), claims_paused=any(s.claims_paused for s in copies)
    )


def _copies_scheduler(copies: Sequence[Copy]) -> Scheduler:
    return Scheduler(
        epoch=scheduler_copies.current_epoch(copies),
        claims_paused=scheduler_copies.claims_paused(copies),
    )


def _check_url(url: str) -> None:
    parse_cluster_url(url)


def _create(url: str, policy: LeasePolicy, options: StoreOptions) -> Store:
    """The cluster store a ``redis+cluster://`` URL names. The bucket count is the default
    (256) until ``StoreOptions`` carries ``store.cluster_buckets``."""
    backend = RoutedBackend(
        url,
        policy,
        key_prefix=options.redis_key_prefix,
        timeout_ms=options.timeout_ms,
        max_connections=options.redis_max_connections,
        password=options.password,
        min_replicas=options.redis_min_replicas,
        replica_timeout_ms=options.redis_replica_timeout_ms,
    )
    buckets = getattr(options, "cluster_buckets", DEFAULT_BUCKETS)
    return ClusterStore(
        policy,
        backend,
        buckets=buckets,
        key_prefix=options.redis_key_prefix,
        timeout_ms=options.timeout_ms,
        max_dependents=options.max_dependents,
        max_cascade=options.max_cascade,
        queue_rescan_ms=options.cluster_queue_rescan_ms,
    )


#: ``redis+cluster://HOST1:PORT1,...`` (``rediss+cluster://`` over TLS): for
#: ``ledger.registry`` (its ``_BUILTIN`` entry is not added here).
STORE_KIND = StoreKind(
    schemes=CLUSTER_SCHEMES,
    example=CLUSTER_FORM,
    check_url=_check_url,
    create=_create,
)
