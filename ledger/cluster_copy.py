"""``fencegate store copy``: a drained single Redis store, copied into the cluster's buckets.

The Redis Cluster store keeps bucket n of key prefix ``P`` as an ordinary single-Redis layout
under the longer prefix ``P:{P.b<n>}`` (``ledger.buckets``; docs/decisions.md, "Issue 30:
Redis Cluster, the design"). So moving a store is a rename of every key, and a split of every
store-wide key by member:

- a key of one task (``P:{<id>}:task``, ``:dependents``, ``:effects``, ``:tombstone``) is
  copied whole (``DUMP`` on the source, ``RESTORE`` on the cluster, its time to live kept) to
  ``P:{P.b<n>}:{<id>}:...`` with n = ``bucket_of_task(id)``; a keyed effect's
  ``P:{<eid>}:keyed-effect`` to ``bucket_of_keyed(eid)``; an effect tombstone to its task's
  bucket (the tombstone's ``task_id``; a keyed effect's: by its id);
- a store-wide index is split by member (``PLACEMENT`` says how, for every key of
  ``ledger/keys.py``): each member goes to the copy of the index in its bucket, with its score
  (``ZADD NX``, ``SADD``, ``HSETNX``: a member already there is left alone);
- the scheduler record and the ``*:indexed`` flags go to every bucket, and so does ``meta``'s
  ``format`` (nothing else of ``meta``: the lost-writes flag and its acknowledgements are the
  old store's);
- the change feed and the write marks are **not** copied: the cluster's per-bucket streams
  start empty, and positions of the old store (``Last-Event-ID``) are not valid on the cluster
  (a subscriber starts again from the cluster's feed); a write mark belongs to one gateway
  process and one store.

The copy refuses a store that is not drained (a CLAIMED task whose lease has not run out
by the source's clock, a PREPARED effect: a claim or a forward the copy would freeze in the
middle), one with a task still waiting on a dependency of another task group (on the
cluster the dependency's commit could not release it), one in an older format (``fencegate
store migrate`` first) or flagged as having lost writes. It writes nothing before every
check passed. A CLAIMED task whose lease has run out is copied as it is (its lease expiry,
generation, attempt; its leases and queue index entries split with the rest): nothing on
the source would release it but a new claim, which needs the gateways the operator stopped
to copy, and on the cluster it behaves as it would have on the source (its old attempt's
renew and fenced calls refused as expired, a claim takes it over with the next generation).

The check that the source did not change (``_Snapshot``) is read before anything else, so
a claim, or any other step of a gateway still serving it, at any point of the run fails the
run, a claim taking over a lease that ran out included. A run past the checks saw every
lease run out, and a lease that ran out stays so (renew refuses it; only a claim gives the
task a new one), so no lease can start running again under the copy.

Idempotent: ``RESTORE`` without ``REPLACE`` (``BUSYKEY``: copied before, skipped) and member
adds that leave what is there, so a run cut short is run again and finishes; each run says
what it copied and what it found there. The source is read in bounded ``SCAN`` batches, each
written to the cluster as one routed pipeline (``ClusterRouter.pipeline``: one batch per node).

The pure part (which key is what, which bucket a member goes to) is ``classify``,
``PLACEMENT`` and ``Layout``; ``copy_store`` is the I/O.
"""

from __future__ import annotations

import functools
import re
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import ResponseError

from fencegate.ledger import keys
from fencegate.ledger.buckets import (
    bucket_of_keyed,
    bucket_of_task,
    check_buckets,
    task_group,
)
from fencegate.ledger.cluster_router import ClusterRouter, Routed
from fencegate.ledger.cluster_store import bucket_prefix
from fencegate.ledger.redis_store import (
    SENTINEL_SCHEME,
    catch_up_indexes,
    load_script_source,
    parse_sentinel_url,
    split_pipeline_option,
)

__all__ = [
    "BUCKETS_FIELD",
    "PLACEMENT",
    "CopyRefused",
    "CopyReport",
    "Layout",
    "Place",
    "SourceKey",
    "classify",
    "copy_store",
    "source_client",
]

#: The field of bucket 0's ``meta`` that records the store's bucket count (the cluster
#: store's, which refuses to start with another ``store.cluster_buckets``).
BUCKETS_FIELD = "cluster_buckets"
#: Most dependents' ids listed in a refusal (and keys named in a report line).
_SHOWN = 5


class Place(StrEnum):
    """Where a key of the single-Redis layout goes in the cluster's buckets."""

    #: Whole, to its task's bucket (the key's argument is the task id).
    TASK = "the task's bucket"
    #: Whole, to the keyed effect's bucket (the argument is the effect id).
    KEYED = "the keyed effect's bucket"
    #: Whole, to the bucket of the task its ``task_id`` field names (empty: a keyed effect's,
    #: by the effect id, the argument).
    EFFECT_TOMBSTONE = "its effect's bucket (the tombstone's task_id; keyed: its id)"
    #: Whole, to every bucket.
    EVERY = "every bucket"
    #: ``format`` only, to every bucket.
    META = "its format, to every bucket"
    #: Split: each member is a task id.
    BY_TASK = "by member: task id"
    #: Split: each member is ``<prio>:<readyAt>:<taskId>`` (a queue's ready set).
    BY_QUEUE_ENTRY = "by member: the task id it ends in"
    #: Split: each member is ``<createdAt>:<effectId>:<taskId>`` (empty task id: keyed).
    BY_INDEX_ENTRY = "by member: its task id, or its effect id when keyed"
    #: Split: each member is an effect id, placed through the ``effects:task`` directory
    #: (a keyed effect has no entry there, and goes by its own id).
    BY_EFFECT = "by member: effect id, via the effects:task directory, keyed otherwise"
    #: Split: each member is a keyed effect's id.
    BY_KEYED = "by member: keyed effect id"
    #: Split: each member is an effect id with a tombstone (its ``task_id`` says the bucket).
    BY_EFFECT_TOMBSTONE = "by member: effect id, via its tombstone's task_id"
    #: Split: a hash of effect id -> task id (``effects:task``), each field by its value.
    BY_DIRECTORY_ENTRY = "by field: the task id it maps to"
    #: Not copied.
    NOT_COPIED = "not copied"


#: Every key of ``ledger/keys.py`` (``keys.key_names``) and where the copy puts it.
#: ``tests/test_store_copy.py`` fails on a key missing here: a new key needs a decision.
PLACEMENT: dict[str, Place] = {
    "task": Place.TASK,
    "dependents": Place.TASK,
    "queue_ready": Place.BY_QUEUE_ENTRY,
    "queue_held": Place.BY_TASK,
    "queue_epochs": Place.BY_TASK,
    # The queues' hints exist on a cluster only; a missing hint is rebuilt by the first
    # queue claim (a full rescan), so a copy leaves them to it.
    "queue_buckets": Place.NOT_COPIED,
    "queue_owed": Place.NOT_COPIED,
    # The change feed starts empty on the cluster: the old store's positions mean nothing
    # there, and its events describe changes the copy does not make.
    "events": Place.NOT_COPIED,
    "effects": Place.TASK,
    "scheduler": Place.EVERY,
    "keyed_effect": Place.KEYED,
    "effects_index": Place.BY_INDEX_ENTRY,
    "keyed_settled": Place.BY_KEYED,
    "keyed_prepared": Place.BY_KEYED,
    "keyed_unknown": Place.BY_KEYED,
    "tasks_index": Place.BY_TASK,
    "tasks_indexed": Place.EVERY,
    # One gateway process's mark on one store: the cluster's gateways make their own.
    "write_mark": Place.NOT_COPIED,
    "meta": Place.META,
    "settled": Place.BY_TASK,
    "settled_indexed": Place.EVERY,
    "tombstone": Place.TASK,
    "effect_tombstone": Place.EFFECT_TOMBSTONE,
    "task_tombstones": Place.BY_TASK,
    "effect_tombstones": Place.BY_EFFECT_TOMBSTONE,
    "cascades": Place.BY_TASK,
    "leases": Place.BY_TASK,
    "prepared": Place.BY_EFFECT,
    "unknown": Place.BY_EFFECT,
    "probe_due": Place.BY_EFFECT,
    "awaiting": Place.BY_EFFECT,
    "effect_tasks": Place.BY_DIRECTORY_ENTRY,
    "effect_ids": Place.BY_EFFECT,
    "effect_ids_indexed": Place.EVERY,
    # Empty once the copy caught the source's creation indexes up (it does so first): the
    # copy writes those indexes whole.
    "effects_created": Place.NOT_COPIED,
}
_WHOLE = {Place.TASK, Place.KEYED, Place.EFFECT_TOMBSTONE, Place.EVERY}


#: Most rounds of ``redis_store.catch_up_indexes`` (each up to 100,000 entries) before the
#: copy decides that something still adds new effects to the source.
_CATCH_UP_ROUNDS = 100


class CopyRefused(Exception):
    """The copy cannot start (or cannot go on): what is wrong and what to do, for a person."""


@dataclass(frozen=True, slots=True)
class SourceKey:
    """A key of the source, recognised: its ``Keys`` member, its argument (a task, effect or
    queue id, a gateway's mark; None for a fixed key) and where it goes."""

    key: str
    name: str
    arg: str | None

    @property
    def place(self) -> Place:
        return PLACEMENT[self.name]


#: Stands for a key's argument while its layout is read off ``keys.Keys``.
_ARG = "\x00arg\x00"


@functools.cache
def _matchers(prefix: str) -> tuple[dict[str, str], tuple[tuple[re.Pattern[str], str], ...]]:
    """The keys of ``prefix``'s layout, read off ``keys.Keys`` (never retyped): the fixed keys
    by name, and a pattern per key of one id (its id the one group; inside braces it has none,
    as the id grammars say)."""
    layout = keys.Keys(prefix)
    fixed: dict[str, str] = {}
    patterns: list[tuple[re.Pattern[str], str]] = []
    for name in keys.key_names():
        if isinstance(vars(keys.Keys)[name], property):
            fixed[getattr(layout, name)] = name
            continue
        head, tail = getattr(layout, name)(_ARG).split(_ARG)
        arg = "[^{}]+" if head.endswith("{") and tail.startswith("}") else ".+"
        pattern = re.compile(re.escape(head) + f"({arg})" + re.escape(tail), re.DOTALL)
        patterns.append((pattern, name))
    return fixed, tuple(patterns)


def classify(key: str, prefix: str) -> SourceKey | None:
    """What ``key`` is in the single-Redis layout of ``prefix`` (None: no key of it)."""
    fixed, patterns = _matchers(prefix)
    if key in fixed:
        return SourceKey(key, fixed[key], None)
    for pattern, name in patterns:
        match = pattern.fullmatch(key)
        if match:
            return SourceKey(key, name, match[1])
    return None


def scan_pattern(prefix: str) -> str:
    """SCAN pattern of every key under ``prefix`` (its glob characters escaped, as
    ``Keys.task_pattern`` escapes them)."""
    return keys.Keys(prefix).task_pattern().removesuffix(":{*}:task") + ":*"


@dataclass(frozen=True)
class Layout:
    """The cluster's buckets of key prefix ``prefix``: bucket n is the single-Redis layout
    under ``<prefix>:{<prefix>.b<n>}``, every key of it in bucket n's slot."""

    prefix: str
    buckets: int
    _keys: tuple[keys.Keys, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_buckets(self.buckets)
        layouts = tuple(keys.Keys(self.bucket_prefix(n)) for n in range(self.buckets))
        object.__setattr__(self, "_keys", layouts)

    def bucket_prefix(self, n: int) -> str:
        return bucket_prefix(self.prefix, n)

    def keys(self, n: int) -> keys.Keys:
        """Bucket ``n``'s key layout."""
        return self._keys[n]

    def task_bucket(self, task_id: str) -> int:
        return bucket_of_task(task_id, self.buckets)

    def keyed_bucket(self, effect_id: str) -> int:
        return bucket_of_keyed(effect_id, self.buckets)

    def target(self, source: SourceKey, n: int) -> str:
        """``source``'s key in bucket ``n``: the same ``Keys`` member under the bucket's
        prefix."""
        layout = self.keys(n)
        if source.arg is None:
            return str(getattr(layout, source.name))
        return str(getattr(layout, source.name)(source.arg))


@dataclass
class CopyReport:
    """What a run found and did, for a person (``lines``)."""

    buckets: int = 0
    #: Keys copied whole (a key written to every bucket counts once per bucket).
    keys_copied: int = 0
    #: Keys already on the cluster (an earlier run's): left as they are.
    keys_there: int = 0
    #: Members (and directory fields) of the store-wide keys added to their bucket's copy.
    members_added: int = 0
    #: Members already in their bucket's copy.
    members_there: int = 0
    #: Keys gone before they could be read (a tombstone expiring), or a tombstone index's
    #: member whose tombstone is gone: nothing to copy.
    gone: int = 0
    #: Keys not copied by design, by ``Keys`` member (the change feed, write marks).
    not_copied: dict[str, int] = field(default_factory=dict)
    #: Keys under the prefix that are no key of this layout (another store's?): not copied.
    unknown: list[str] = field(default_factory=list)
    #: CLAIMED tasks whose lease had run out on the source's clock (copied as they are), and
    #: the first ``_SHOWN`` of their ids.
    ran_out: int = 0
    ran_out_ids: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        lines = [
            f"copied {self.keys_copied} key(s) into {self.buckets} bucket(s); "
            f"{self.keys_there} already there (left as they are)",
            f"index members added: {self.members_added}; already there: {self.members_there}",
        ]
        if self.ran_out:
            lines.append(
                f"CLAIMED with their lease run out: {self.ran_out} task(s) "
                f"({_listed(self.ran_out_ids, self.ran_out)}), copied as they are: on the "
                "cluster a claim takes each over (the next claimGeneration), and the old "
                "attempt is refused there as it was on the old store"
            )
        if self.gone:
            lines.append(f"gone before they were read (expired tombstones): {self.gone}")
        for name, count in sorted(self.not_copied.items()):
            why = (
                "the change feed starts empty on the cluster: positions (Last-Event-ID) of the "
                "old store are not valid there, subscribers start again"
                if name == "events"
                else "one gateway process's write mark: the cluster's gateways make their own"
            )
            lines.append(f"not copied: {count} {name} key(s) ({why})")
        if self.unknown:
            shown = ", ".join(self.unknown[:_SHOWN])
            more = f" and {len(self.unknown) - _SHOWN} more" if len(self.unknown) > _SHOWN else ""
            lines.append(
                f"not copied: {len(self.unknown)} key(s) under the prefix that are no key of "
                f"fencegate's layout: {shown}{more}"
            )
        return lines


# --- the I/O -----------------------------------------------------------------------------


def source_client(url: str, *, password: str | None, timeout_ms: int) -> aioredis.Redis:
    """A plain client of the single Redis store at ``url`` (``redis://``, ``rediss://``,
    ``unix://``, or the master a ``redis+sentinel://`` URL names), replies decoded. Its own,
    not a ``RedisStore``'s: the copy reads keys the store has no command for (``DUMP``,
    ``SCAN``), and must not write the format or a write mark into the store it reads."""
    common: dict[str, Any] = {
        "password": password,
        "decode_responses": True,
        "socket_timeout": timeout_ms / 1000,
        "socket_connect_timeout": timeout_ms / 1000,
    }
    if url.lower().startswith(f"{SENTINEL_SCHEME}://"):
        spec = parse_sentinel_url(url)
        sentinel = Sentinel(  # type: ignore[no-untyped-call]
            list(spec.sentinels), sentinel_kwargs={"socket_timeout": timeout_ms / 1000}
        )
        client: aioredis.Redis = sentinel.master_for(
            spec.master, db=spec.db, username=spec.username, **common
        )
        return client
    return aioredis.Redis.from_url(split_pipeline_option(url)[0], **common)


#: Task states in which a dependency may still change the task (release it, revise it,
#: cascade a cancel to it): a dependency of another group would do that from another bucket.
_OPEN_STATES = ("WAITING", "READY", "CLAIMED")


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """What says the source did not change while it was copied: the change feed's last id
    (every change appends an event) and the scheduler record (a bump or pause appends none)."""

    last_event: str | None
    scheduler: tuple[tuple[str, str], ...]


def _listed(ids: Sequence[str], total: int) -> str:
    more = f" and {total - len(ids)} more" if total > len(ids) else ""
    return ", ".join(ids) + more


async def _snapshot(source: aioredis.Redis, layout: keys.Keys) -> _Snapshot:
    try:
        info: Any = await source.xinfo_stream(layout.events)
        last: str | None = str(info["last-generated-id"])
    except ResponseError:  # no stream: nothing has ever changed
        last = None
    scheduler: Any = await source.hgetall(layout.scheduler)
    return _Snapshot(last, tuple(sorted(scheduler.items())))


@dataclass(frozen=True, slots=True)
class _Source:
    """What ``_check_source`` found in a source the copy takes: its format, its scheduler
    record, and the CLAIMED tasks whose lease had run out (how many, the first ids)."""

    fmt: str
    scheduler: dict[str, str]
    ran_out: int
    ran_out_ids: list[str]


async def _check_source(
    source: aioredis.Redis, prefix: str, format_version: int, batch: int
) -> _Source:
    """Refuse (``CopyRefused``) a source the copy cannot take as it is; else what it found.

    A lease is live while its expiry (its leases index score) is above the source's ``TIME``
    (``queries.is_lease_active``, as the scripts read it with the production clock): ``TIME``
    is read first, so a lease counted as run out had run out before any of it was read, and
    stays so: renew refuses a lease that ran out, and only a claim, which appends to the
    change feed (``_Snapshot``), gives the task a new one."""
    layout = keys.Keys(prefix)
    sec, usec = await source.time()
    now = int(sec) * 1000 + int(usec) // 1000
    pipe = source.pipeline(transaction=False)
    pipe.hgetall(layout.meta)
    pipe.exists(layout.scheduler, layout.tasks_index, layout.events, layout.effect_ids)
    pipe.zcount(layout.leases, f"({now}", "+inf")
    pipe.zrangebyscore(layout.leases, f"({now}", "+inf", start=0, num=_SHOWN)
    pipe.zrange(layout.leases, -1, -1, withscores=True)
    pipe.zcount(layout.leases, "-inf", now)
    pipe.zrangebyscore(layout.leases, "-inf", now, start=0, num=_SHOWN)
    pipe.zcard(layout.prepared)
    pipe.zrange(layout.prepared, 0, _SHOWN - 1)
    pipe.hgetall(layout.scheduler)
    (
        meta,
        written,
        live,
        holders,
        last,
        ran_out,
        ran_out_ids,
        prepared,
        preparing,
        scheduler,
    ) = await pipe.execute()
    recorded = meta.get("format")
    if recorded is None and not written:
        raise CopyRefused(
            f"no fencegate store under key prefix {prefix!r} here (no meta, scheduler, task "
            "index or change feed): check [store] url and redis_key_prefix"
        )
    found = int(recorded) if recorded is not None else 1
    if found < format_version:
        raise CopyRefused(
            f"the store is in format {found}, this fencegate writes format {format_version}: "
            "run `fencegate store migrate` first (the cluster's buckets are written in the "
            "current format only)"
        )
    if found > format_version:
        raise CopyRefused(
            f"the store is in format {found}, newer than this fencegate's {format_version}: "
            "copy it with the fencegate version that wrote it (or newer)"
        )
    if meta.get("regressed") is not None:
        raise CopyRefused(
            "the store is flagged as having lost acknowledged writes (meta regressed): run "
            "`fencegate failover ack` and settle what `fencegate failover lost` lists first"
        )
    problems: list[str] = []
    if live:
        expires = int(last[0][1])
        problems.append(
            f"{live} task(s) CLAIMED with a lease still running (the leases index "
            f"{layout.leases}: {_listed(holders, live)}; the last runs out at leaseExpiresAt "
            f"{expires}, in {-(-(expires - now) // 1000)} s unless renewed; their workers "
            "may still be acting): pause claims (`fencegate claims pause`), then let their "
            "workers commit or release them, or let the leases run out (a task CLAIMED past "
            "its lease is copied as it is, and a claim on the cluster takes it over)"
        )
    if prepared:
        problems.append(
            f"{prepared} effect(s) PREPARED ({layout.prepared}: "
            f"{_listed(preparing, prepared)}): wait for their forwards to complete (or their "
            "deadlines to pass and the reconciler to settle them)"
        )
    problems.extend(await _cross_group_waits(source, layout, batch))
    if problems:
        raise CopyRefused(
            "the store is not drained, so a copy would freeze a step in the middle: "
            + "; ".join(problems)
            + ". Then run the copy again; nothing was written"
        )
    return _Source(str(found), scheduler, int(ran_out), [str(i) for i in ran_out_ids])


async def _cross_group_waits(source: aioredis.Redis, layout: keys.Keys, batch: int) -> list[str]:
    """Tasks still open (WAITING, READY) with a dependency of another task group: on the
    cluster the dependency's steps run in its own bucket and cannot reach them (a single
    Redis store accepts such edges; ``task_graph.check_same_group`` refuses them on a
    cluster)."""
    pattern = layout.task_pattern().removesuffix(":task") + ":dependents"
    edges: list[tuple[str, str]] = []
    async for key in source.scan_iter(match=pattern, count=batch):
        dependency = layout.task_id_of(str(key).removesuffix(":dependents") + ":task")
        if dependency is None:
            continue
        for member in await source.smembers(key):  # at most max_dependents
            dependent = str(member)
            if task_group(dependent) != task_group(dependency):
                edges.append((dependency, dependent))
    if not edges:
        return []
    pipe = source.pipeline(transaction=False)
    for _, dependent in edges:
        pipe.hget(layout.task(dependent), "state")
    states = await pipe.execute()
    open_edges = sorted(
        f"{dependent} ({state}) on {dependency}"
        for (dependency, dependent), state in zip(edges, states, strict=True)
        if state in _OPEN_STATES
    )
    if not open_edges:
        return []
    return [
        f"{len(open_edges)} open task(s) depend on a task of another task group "
        f"({_listed(open_edges[:_SHOWN], len(open_edges))}): on redis+cluster:// a task may "
        "depend only on tasks of its own group; let them settle (or cancel them) first"
    ]


async def _check_target(
    router: ClusterRouter, layout: Layout, fmt: str, scheduler: dict[str, str]
) -> None:
    """Refuse a cluster whose buckets were laid out for another bucket count, or that holds
    another store under this prefix (a meta or scheduler copy unlike the source's)."""
    commands: list[Routed] = [
        Routed(layout.keys(0).meta, ("HGET", layout.keys(0).meta, BUCKETS_FIELD))
    ]
    for n in range(layout.buckets):
        meta, copy = layout.keys(n).meta, layout.keys(n).scheduler
        commands.append(Routed(meta, ("HGET", meta, "format")))
        commands.append(Routed(copy, ("HMGET", copy, "epoch", "paused")))
    replies = (await router.pipeline(commands)).results
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply
    recorded = replies[0]
    if recorded is not None and int(recorded) != layout.buckets:
        raise CopyRefused(
            f"the cluster's store under prefix {layout.prefix!r} was created with "
            f"{recorded} buckets and store.cluster_buckets is {layout.buckets}: set "
            f"cluster_buckets = {recorded}, or copy to another prefix"
        )
    want = (scheduler.get("epoch"), scheduler.get("paused"))
    for n in range(layout.buckets):
        fmt_there, copy = replies[1 + 2 * n], replies[2 + 2 * n]
        if fmt_there is not None and fmt_there != fmt:
            raise CopyRefused(
                f"bucket {n} of the cluster's store is in format {fmt_there}, the source in "
                f"format {fmt}: another store is there; copy to an unused prefix"
            )
        if any(v is not None for v in copy) and tuple(copy) != want:
            raise CopyRefused(
                f"bucket {n}'s scheduler copy on the cluster is at epoch {copy[0]} "
                f"(paused: {copy[1]}), the source's at epoch {want[0]} (paused: {want[1]}): "
                "the cluster's store is in use (or another store was copied there); copy "
                "into an unused prefix, or an empty cluster"
            )


class _Writer:
    """Routed writes of one batch, and the report's counts of what they did."""

    def __init__(self, router: ClusterRouter, report: CopyReport) -> None:
        self.router = router
        self.report = report

    async def restore(self, items: Iterable[tuple[str, int, bytes]]) -> None:
        """``RESTORE key ttl payload`` for each (no ``REPLACE``: a key there is left)."""
        commands = [Routed(key, ("RESTORE", key, ttl, payload)) for key, ttl, payload in items]
        for reply in (await self.router.pipeline(commands)).results:
            if isinstance(reply, ResponseError) and str(reply).startswith("BUSYKEY"):
                self.report.keys_there += 1
            elif isinstance(reply, BaseException):
                raise reply
            else:
                self.report.keys_copied += 1

    async def add(self, commands: list[tuple[Routed, int]]) -> None:
        """Member adds, each with how many members it carries; each reply is how many it
        added (``ZADD NX``, ``SADD``, ``HSETNX``)."""
        replies = (await self.router.pipeline([c for c, _ in commands])).results
        for (_, carried), reply in zip(commands, replies, strict=True):
            if isinstance(reply, BaseException):
                raise reply
            self.report.members_added += int(reply)
            self.report.members_there += carried - int(reply)


async def _copy_whole(
    source: aioredis.Redis, layout: Layout, found: list[SourceKey], writer: _Writer
) -> None:
    """``DUMP`` each key (with its time to live and, for an effect tombstone, its task) and
    ``RESTORE`` it as its bucket's key (every bucket's, for ``Place.EVERY``)."""
    pipe = source.pipeline(transaction=False)
    for item in found:
        pipe.dump(item.key)
        pipe.pttl(item.key)
        if item.place is Place.EFFECT_TOMBSTONE:
            pipe.hget(item.key, "task_id")
    replies = iter(await pipe.execute())
    restores: list[tuple[str, int, bytes]] = []
    for item in found:
        payload, ttl = next(replies), int(next(replies))
        task_id = next(replies) if item.place is Place.EFFECT_TOMBSTONE else None
        if payload is None or ttl == -2:  # expired since the scan
            writer.report.gone += 1
            continue
        assert item.arg is not None or item.place is Place.EVERY
        if item.place is Place.EVERY:
            buckets: Iterable[int] = range(layout.buckets)
        elif item.place is Place.TASK:
            buckets = [layout.task_bucket(str(item.arg))]
        elif item.place is Place.KEYED or not task_id:
            buckets = [layout.keyed_bucket(str(item.arg))]
        else:
            buckets = [layout.task_bucket(str(task_id))]
        for n in buckets:
            restores.append((layout.target(item, n), max(ttl, 0), payload))
    await writer.restore(restores)


async def _members(
    source: aioredis.Redis, key: str, kind: str, batch: int
) -> AsyncIterator[list[tuple[str, str]]]:
    """The members of a sorted set (with their scores, as Redis prints them), a set
    (with "") or a hash (fields with their values), a page of about ``batch`` at a time."""
    cursor: Any = 0
    while True:
        if kind == "zset":
            cursor, page = await source.zscan(key, cursor, count=batch, score_cast_func=str)
            yield [(str(m), str(s)) for m, s in page]
        elif kind == "set":
            cursor, members = await source.sscan(key, cursor, count=batch)
            yield [(str(m), "") for m in members]
        else:
            fields: Any
            cursor, fields = await source.hscan(key, cursor, count=batch)
            yield [(str(f), str(v)) for f, v in fields.items()]
        if int(cursor) == 0:
            return


async def _buckets_of(
    source: aioredis.Redis, layout: Layout, item: SourceKey, page: list[tuple[str, str]]
) -> list[int | None]:
    """The bucket of each member of ``page`` (None: its effect tombstone is gone)."""
    src = keys.Keys(layout.prefix)
    place = item.place
    if place is Place.BY_TASK:
        return [layout.task_bucket(m) for m, _ in page]
    if place is Place.BY_QUEUE_ENTRY:
        return [layout.task_bucket(m.split(":", 2)[2]) for m, _ in page]
    if place is Place.BY_INDEX_ENTRY:
        out: list[int | None] = []
        for member, _ in page:
            _, effect_id, task_id = member.split(":", 2)
            out.append(layout.task_bucket(task_id) if task_id else layout.keyed_bucket(effect_id))
        return out
    if place is Place.BY_KEYED:
        return [layout.keyed_bucket(m) for m, _ in page]
    if place is Place.BY_DIRECTORY_ENTRY:
        return [layout.task_bucket(task_id) for _, task_id in page]
    ids = [m for m, _ in page]
    if place is Place.BY_EFFECT:
        tasks: list[Any] = await source.hmget(src.effect_tasks, ids) if ids else []
        return [
            layout.task_bucket(t) if t else layout.keyed_bucket(e)
            for e, t in zip(ids, tasks, strict=True)
        ]
    assert place is Place.BY_EFFECT_TOMBSTONE, place
    pipe = source.pipeline(transaction=False)
    for effect_id in ids:
        pipe.hmget(src.effect_tombstone(effect_id), ["task_id", "forget_at"])
    found = await pipe.execute()
    return [
        None
        if forget is None
        else layout.task_bucket(task_id)
        if task_id
        else layout.keyed_bucket(effect_id)
        for effect_id, (task_id, forget) in zip(ids, found, strict=True)
    ]


async def _copy_split(
    source: aioredis.Redis, layout: Layout, item: SourceKey, batch: int, writer: _Writer
) -> None:
    """Each member of a store-wide key added to its bucket's copy of the key."""
    kind = str(await source.type(item.key))
    if kind == "none":
        return
    if kind not in ("zset", "set", "hash"):
        raise CopyRefused(f"{item.key} is a {kind}, not what fencegate writes there")
    async for page in _members(source, item.key, kind, batch):
        by_bucket: dict[int, list[tuple[str, str]]] = {}
        for member, n in zip(page, await _buckets_of(source, layout, item, page), strict=True):
            if n is None:
                writer.report.gone += 1
            else:
                by_bucket.setdefault(n, []).append(member)
        commands: list[tuple[Routed, int]] = []
        for n, members in sorted(by_bucket.items()):
            target = layout.target(item, n)
            if kind == "zset":
                flat = [x for member, score in members for x in (score, member)]
                commands.append((Routed(target, ("ZADD", target, "NX", *flat)), len(members)))
            elif kind == "set":
                flat = [member for member, _ in members]
                commands.append((Routed(target, ("SADD", target, *flat)), len(members)))
            else:
                for name, value in members:
                    commands.append((Routed(target, ("HSETNX", target, name, value)), 1))
        if commands:
            await writer.add(commands)


async def _write_meta(router: ClusterRouter, layout: Layout, fmt: str) -> None:
    """The bucket count in bucket 0's meta (first, so that a gateway started with another
    count refuses to place keys meanwhile), then the format in every bucket's; both kept
    where already recorded (``_check_target`` refused a different one)."""
    zero = layout.keys(0).meta
    commands = [Routed(zero, ("HSETNX", zero, BUCKETS_FIELD, layout.buckets))]
    commands += [
        Routed(meta, ("HSETNX", meta, "format", fmt))
        for meta in (layout.keys(n).meta for n in range(layout.buckets))
    ]
    for reply in (await router.pipeline(commands[:1])).results + (
        await router.pipeline(commands[1:])
    ).results:
        if isinstance(reply, BaseException):
            raise reply


async def copy_store(
    source: aioredis.Redis,
    router: ClusterRouter,
    layout: Layout,
    *,
    format_version: int,
    batch: int = 500,
    say: Callable[[str], None] = print,
) -> CopyReport:
    """Copy the store under ``layout.prefix`` on ``source`` (a client with
    ``decode_responses``) into ``layout``'s buckets through ``router`` (module docstring).
    ``format_version``: the format this fencegate writes (the source must be in it).
    ``batch``: keys per SCAN step and members per index page. ``say``: progress lines.
    ``CopyRefused`` before anything is written when the source or the cluster cannot take
    it; afterwards, when the source changed while it was copied."""
    prefix = layout.prefix
    source_keys = keys.Keys(prefix)
    # First, before the checks read anything: a step after it (a claim of a task the check
    # saw READY, or one taking over a lease it saw run out) moves the feed, and the run fails.
    before = await _snapshot(source, source_keys)
    checked = await _check_source(source, prefix, format_version, batch)
    fmt, scheduler = checked.fmt, checked.scheduler
    # The creation indexes the copy splits may lack new effects whose entries still wait (a
    # gateway killed before its catch-up ran): add them all first (no event: the snapshot
    # stays). The list is not copied, so nothing may be left in it.
    script = load_script_source("index_catch_up")
    for _ in range(_CATCH_UP_ROUNDS):
        if await catch_up_indexes(
            source_keys, lambda keys_, args: source.eval(script, len(keys_), *keys_, "0", *args)
        ):
            break
    else:
        raise CopyRefused(
            f"new effects still wait to be indexed in {source_keys.effects_created} after "
            f"{_CATCH_UP_ROUNDS} catch-ups: a gateway still serves the store; stop it and run "
            "the copy again"
        )
    await _check_target(router, layout, fmt, scheduler)
    report = CopyReport(
        buckets=layout.buckets, ran_out=checked.ran_out, ran_out_ids=checked.ran_out_ids
    )
    writer = _Writer(router, report)
    await _write_meta(router, layout, fmt)
    split: dict[str, SourceKey] = {}
    scanned = 0
    next_say = 10 * batch
    cursor: Any = 0
    while True:
        cursor, found = await source.scan(cursor, match=scan_pattern(prefix), count=batch)
        whole: list[SourceKey] = []
        for key in found:
            item = classify(str(key), prefix)
            if item is None:
                report.unknown.append(str(key))
            elif item.place in _WHOLE:
                whole.append(item)
            elif item.place is Place.NOT_COPIED:
                report.not_copied[item.name] = report.not_copied.get(item.name, 0) + 1
            elif item.place is not Place.META:
                split[item.key] = item
        if whole:
            await _copy_whole(source, layout, whole, writer)
        scanned += len(found)
        if scanned >= next_say:
            next_say += 10 * batch
            say(
                f"... {scanned} source key(s) read: {report.keys_copied} key(s) copied, "
                f"{report.keys_there} already there"
            )
        if int(cursor) == 0:
            break
    say(
        f"keys: {scanned} read, {report.keys_copied} copied, {report.keys_there} already "
        f"there; now the store-wide indexes ({len(split)} key(s)), split by member"
    )
    for key in sorted(split):
        await _copy_split(source, layout, split[key], batch, writer)
    if await _snapshot(source, source_keys) != before:
        raise CopyRefused(
            "the source store changed while it was copied (its change feed or scheduler "
            "moved): a gateway still serves it. Stop every gateway using it, then run the "
            "copy again (what is on the cluster stays; records copied before they changed "
            "are not copied again, so copy into an emptied prefix if tasks changed)"
        )
    return report
