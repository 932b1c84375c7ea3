"""The shared store: Redis 7, many gateway processes on many hosts.

Each transition is one Lua script (``ledger/lua/<name>.lua``, each prefixed with
``common.lua``), registered once per store with ``register_script`` so the store re-sends the
source on ``NOSCRIPT`` (after ``SCRIPT FLUSH`` or a failover). The effect steps
(``_FUNCTIONS``) run instead as functions of one Redis Functions library
(``library_source``, ``FCALL``), named by a digest of its text, loaded the same way when
Redis lacks it. A script reads ``TIME`` once, so the lease clock is Redis's, never a
gateway's. The gateway decides a new forward's record and its complete itself
(``_new_forward``, ``_completion``); the scripts write those only on the record the decision
was made on, and decide alone otherwise.

Keys (all built in ``ledger.keys``): a task lives in ``{prefix}:{<taskId>}:task``; its hash
tag is the task id, so everything a task owns hashes to one slot. The global scheduler record
``{prefix}:scheduler`` (epoch, paused) is the one key outside the task's slot: claim, renew
and commit read it inside the same script, which is what makes "the epoch is current" and "the
transition happened" one atomic fact. On a single Redis (or a primary with replicas) that is
free; Redis Cluster refuses scripts whose keys span slots (CROSSSLOT), so fencegate does not
support Cluster mode: see docs/stores.md for what supporting it would take.

Task flow (issue 16) keeps three more kinds of keys in step inside the same scripts
(``lua/task_lib.lua``): each queue's indexes (``ready``: READY tasks in ``queue_order`` as
lexically sorted members; ``held`` and ``epochs``: its CLAIMED tasks by lease expiry and by
claim epoch), from which ``claim_next.lua`` takes the best claimable task without scanning the
queue; each task's set of dependents, which commit, revision and cancel follow to other tasks;
and the change feed, a stream (``{prefix}:events``) every change of a task's state, revision or
claim generation and of an effect's state appends to. The task scripts build other tasks' keys
from the prefix (their ARGV[2]) with the layout rendered from ``ledger.keys``
(``lua_key_helpers``), which is one more reason this store is single-instance only.

Retention (issue 17, ``ledger.retention``): ``task_lib.lua`` keeps the settled index
(``{prefix}:settled``, COMMITTED and CANCELLED task ids by when they settled) wherever a task's
state is written; ``retention.lua`` expires the oldest due tasks a bounded batch at a time and
leaves tombstones (``{prefix}:{<taskId>}:tombstone``, ``{prefix}:effect-tombstone:<effectId>``,
each expiring by itself, and two sorted sets by ``forget_at`` to count and forget them).
``put.lua`` reads a task's tombstone as it creates it; every other refusal of a missing task or
effect is refined into ``TASK_EXPIRED`` / ``EFFECT_EXPIRED`` in one place (``_refusal``).

Keyed effects (issue 28, a lease-less client's, ``effects.Effect.kind`` ``keyed``): each
record is the one field of its own hash ``{prefix}:{<effectId>}:keyed-effect`` (hash tag: the
effect id), found from the id alone, so it has no effectId -> taskId entry and its
creation-order member ends in an empty task id. ``prepare_keyed.lua`` reads no task and no
scheduler (the decision is ``prepare_lib.lua``'s, shared with the leased ``prepare.lua``, which
does no keyed work); ``effect_lib.lua`` keeps ``{prefix}:effects:keyed-settled``
(``effects.keyed_settled``) wherever a keyed record is written, and ``retention.lua`` expires
from it; it keeps ``{prefix}:effects:keyed-prepared`` and ``{prefix}:effects:keyed-unknown``
too (the keyed members of the prepared and unknown indexes), which ``gauges.lua`` counts for
``Gauges.unknown_keyed_effects``. No leased step touches the three, and none needs a backfill:
no store holds a keyed record written before they existed (keyed effects and these indexes
come in the same release). The format stays 2: no leased record or key changed, and a gateway
of the previous version sharing the store finds no keyed record (an id lookup answers
NO_SUCH_EFFECT, a list skips the entry, a keyed tombstone reads with an empty task id) and
never writes one; its reconciler parks a due keyed UNKNOWN effect's probe for a minute at a
time, so such probes may wait until the last such gateway stopped.

At open, the store reads ``appendonly``, ``appendfsync`` and ``maxmemory-policy`` and logs
``store.durability_warning`` for each setting under which an answered transition can be lost.

Auto-pipelining (``_AutoPipeline``, on unless the URL says ``?pipeline=0``): the scripts and the
single commands issued in one event-loop turn go to Redis as one non-transactional pipeline
(one write, one read) instead of each paying redis-py's whole per-command path; every caller
gets its own reply or its own error, and every script stays atomic on its own.

High availability (issue 18): ``redis+sentinel://`` URLs (``parse_sentinel_url``) build the
client with redis-py's Sentinel, which asks the sentinels for the master's address whenever it
connects, so the gateway follows the master through a failover. ``min_replicas`` > 0 ends every
flushed batch that holds a write step with ``WAIT min_replicas replica_timeout_ms`` on the same
connection (``_AutoPipeline``); a shortfall answers every step of that batch StoreUnavailable
("may have been applied"). docs/stores.md says what WAIT promises and what it does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import hashlib
import json
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
import structlog
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.retry import Retry

from fencegate.ledger import effects, events, keys, queries
from fencegate.ledger.cluster_router import ClusterUnavailable, parse_authority, slot_of
from fencegate.ledger.effects import (
    Action,
    Effect,
    EffectRequest,
    EffectState,
    Fence,
    PrepareOutcome,
)
from fencegate.ledger.errors import (
    ERRORS_BY_CODE,
    BadRequest,
    BumpBarrier,
    FencegateError,
    NoSuchEffect,
    NoSuchTask,
    StoreIncompatible,
    StoreRegressed,
    StoreUnavailable,
)
from fencegate.ledger.events import Event
from fencegate.ledger.queries import Gauges, TaskFilter, effect_prefix_bounds, page_tasks
from fencegate.ledger.retention import (
    EffectTombstone,
    ExpiryReport,
    StoreStats,
    expired_effect,
)
from fencegate.ledger.scheduler_copies import Copy, Intent
from fencegate.ledger.store import (
    TASK_SCAN,
    EffectTransition,
    Migration,
    Store,
    StoreKind,
    StoreOptions,
    decode_cursor,
    encode_cursor,
    new_id,
)
from fencegate.ledger.tasks import (
    MAX_GRAPH_VISITS,
    ClaimRequest,
    CommitRequest,
    Cost,
    Identity,
    LeasePolicy,
    PutOutcome,
    RenewRequest,
    Scheduler,
    Task,
    TaskState,
    Tombstone,
    cost_to_json,
    expired_task,
    task_from_fields,
)

__all__ = [
    "STORE_KIND",
    "RedisStore",
    "SentinelSpec",
    "behind_refusal",
    "catch_up_indexes",
    "durability_warnings",
    "library_source",
    "load_script_source",
    "parse_sentinel_url",
]

log = structlog.get_logger("fencegate.store")
T = TypeVar("T")

#: script -> the library files prepended to it (after common.lua).
_SCRIPTS: dict[str, tuple[str, ...]] = {
    "put": ("task_lib",),
    "claim": ("task_lib",),
    "claim_next": ("task_lib",),
    "renew": ("task_lib",),
    "release": ("task_lib",),
    "commit": ("task_lib",),
    "cancel": ("task_lib",),
    "cascade": ("task_lib",),
    "scheduler": (),
    "fence": (),
    "prepare": ("sha256", "effect_lib", "prepare_lib"),
    "prepare_keyed": ("effect_lib", "prepare_lib"),
    "complete": ("effect_lib",),
    "cas_effect": ("effect_lib",),
    "gauges": (),
    "probe_due_init": (),
    "events_read": (),
    "events_trim": (),
    "events_ids": (),
    "retention": ("task_lib", "effect_lib"),
    "settled_index": ("task_lib",),
    "stats": (),
    "effect_prefix": ("keys",),
    "index_catch_up": ("keys",),
}
#: The effect steps, served as functions of one Redis Functions library (``library_source``,
#: FCALL) instead of one script each (EVALSHA): a script defines every helper it is prepended
#: with on every call, a library once per load. The other scripts stay scripts: most build
#: keys from a per-call prefix (``keys.lua_key_helpers``), and the read-only ones must keep
#: answering while Redis is out of memory (a function not flagged ``no-writes`` is refused).
_FUNCTIONS: tuple[str, ...] = ("prepare", "prepare_keyed", "complete", "cas_effect")
#: The scripts that never write: no WAIT follows them (every other script may write).
_READ_ONLY_SCRIPTS = frozenset(
    {"fence", "gauges", "events_read", "events_ids", "stats", "effect_prefix"}
)
#: The scripts a reader runs that are no step anyone acts on: the read-only ones, and
#: index_catch_up.lua, which only adds index entries for records the store holds now (lost
#: with a failover, its entries are back in the list with it). Neither refused while lost
#: writes are flagged (reads go on: they are how an operator finds what was lost) nor followed
#: by WAIT (a replica down must not turn a look-up or a listing into 503).
_UNFENCED_SCRIPTS = _READ_ONLY_SCRIPTS | {"index_catch_up"}
#: Bounds of ``[store] redis_min_replicas`` (gateway.config checks them too).
MAX_MIN_REPLICAS = 16
#: Rounds of read-decide-compare-and-set before update_effect gives up.
_CAS_ATTEMPTS = 8
#: Most index entries one list call scans before answering with what it found and a cursor.
_LIST_SCAN = 2000
_LIST_BATCH = 200
#: Most (taskId, claimGeneration) -> revision entries kept to compute effectIds (cleared when
#: full: a miss only costs one SHA-256 inside prepare.lua).
_REVISIONS_KEPT = 4096
#: Most forwarded records a store holds for their complete (``RedisStore._held``; cleared when
#: full: a miss only costs complete.lua the decode and re-encode of the record).
_HELD_KEPT = 4096
#: Most store calls one auto-pipelined flush sends; the calls past it go in the next flush.
PIPELINE_BATCH_MAX = 128
#: Most events one run of events_trim.lua drops (trim_events runs it until it drops fewer).
_TRIM_BATCH = 1000
#: Most waiting entries one run of index_catch_up.lua adds, and the most runs one catch-up
#: makes (``catch_up_indexes``; a reader then reads anyway, retention waits for the next sweep).
_CATCH_UP_BATCH = 1000
_CATCH_UP_RUNS = 100
#: The lag bound of the creation indexes behind the lean prepares of one gateway
#: (``RedisStore._created_unindexed``): a catch-up runs after this many, or this long after
#: the first one not yet indexed, whichever comes first.
_CATCH_UP_AFTER_EFFECTS = 256
_CATCH_UP_AFTER_S = 0.2
#: Tasks one run of settled_index.lua reads (the settled index's one-time backfill).
_SETTLED_BACKFILL_BATCH = 1000
#: The format of what this code writes under its key prefix (``{prefix}:meta`` ``format``).
#: 1: written before formats were recorded (no meta key; no settled index, no tombstones).
#: 2: retention (issue 17): the settled index and tombstones.
#: 3: a new leased effect's creation-index entries may wait in ``Keys.effects_created`` until
#: ``index_catch_up.lua`` adds them (issue 30): a gateway of format 2 reads those indexes
#: without catching up, so it could miss an effect for up to the catch-up lag.
#: A newer format is refused; an older one is served as it is (every record reads the same;
#: at 2, new effects are indexed in their step) and migrated by ``fencegate store migrate``
#: (``RedisStore.migrate``).
FORMAT_VERSION = 3
#: The format from which retention runs (the settled index and tombstones exist).
_RETENTION_FORMAT = 2
#: A position this store issues: a stream entry id.
_POSITION = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")
#: Each part of a stream entry id is an unsigned 64-bit number.
_MAX_STREAM_ID_PART = 2**64 - 1
#: The store URL query parameter that switches auto-pipelining: ``pipeline=0`` or ``1``.
_PIPELINE_PARAM = "pipeline"
_PIPELINE_VALUES = {"0": False, "1": True}
#: How long the reconciler parks an UNKNOWN effect of a downstream without a probe (it waits
#: for an operator) before looking at it again.
_PARK_MS = 60_000


def load_script_source(name: str) -> str:
    """``common.lua``, the script's libraries, then the script, as sent to Redis.
    ``task_lib.lua`` comes after the key layout rendered from ``ledger/keys.py``
    (``keys.lua_key_helpers``): its scripts build the keys of tasks they were not given in
    KEYS, and no Lua file retypes one. The library name ``keys`` is that layout alone, for a
    script that builds keys without ``task_lib.lua`` (its ARGV[2] is then the key prefix)."""
    folder = resources.files("fencegate.ledger") / "lua"
    texts = []
    for part in ["common", *_SCRIPTS[name], name]:
        if part in ("task_lib", "keys"):
            texts.append(keys.lua_key_helpers())
        if part != "keys":
            texts.append((folder / f"{part}.lua").read_text(encoding="utf-8"))
    return "\n".join(texts)


def _migration_notes(found: int | None) -> tuple[str, ...]:
    """What an operator should know after ``migrate`` from format ``found``."""
    notes: list[str] = []
    if found is not None and found < _RETENTION_FORMAT:
        notes.append(
            "older gateways may keep serving while this runs; tasks they settle afterwards "
            "are not in the settled index: run this again once the last one stopped"
        )
    if found is not None and found < FORMAT_VERSION:
        notes.append(
            "gateways of format 2 or older must be stopped now (they refuse this format when "
            "they start): they read the effect indexes without catching up, so they may not "
            "find an effect created moments before"
        )
    return tuple(notes)


async def catch_up_indexes(
    layout: keys.Keys, run: Callable[[list[str], list[Any]], Awaitable[Any]]
) -> bool:
    """index_catch_up.lua under ``layout``, through ``run`` (its keys and its arguments after
    the test clock), until no entry waits or it made ``_CATCH_UP_RUNS`` runs:
    ``RedisStore.catch_up_indexes``, and ``fencegate store copy`` on its source. True when
    nothing waits any more."""
    keys_ = [
        layout.effects_created,
        layout.effects_index,
        layout.effect_tasks,
        layout.effect_ids,
        layout.scheduler,
    ]
    for _ in range(_CATCH_UP_RUNS):
        reply = await run(keys_, [layout.prefix, _CATCH_UP_BATCH])
        if reply[0] == "ERR":
            raise StoreUnavailable(f"nothing was applied; {reply[2]}: retry")
        if not int(reply[2]):
            return True
    return False


def behind_refusal() -> StoreUnavailable:
    """A look-up by id that missed while more entries wait than one catch-up adds
    (``_CATCH_UP_RUNS``): the effect may be one of them, so not NO_SUCH_EFFECT."""
    return StoreUnavailable(
        "new effects are still being indexed (more wait than one catch-up adds); nothing "
        "was applied: retry"
    )


@dataclass(frozen=True, slots=True)
class FunctionLibrary:
    """A Redis Functions library as this code loads it (``library_source``)."""

    name: str
    source: str

    def function(self, script: str) -> str:
        """The name ``script`` is registered under: function names are global to a Redis,
        so each carries its library's (``fencegate_<digest>_<script>``)."""
        return f"{self.name}_{script}"


@functools.cache
def library_source() -> FunctionLibrary:
    """The library serving ``_FUNCTIONS``: ``common.lua`` and their libraries once each (the
    order ``load_script_source`` prepends them in), then each script's own text as the body
    of a function of (KEYS, ARGV), so the scripts run unchanged and ``load_script_source``
    still names what each one runs. The name carries a digest of that text
    (``fencegate_<sha12>``): gateways of different versions sharing one Redis each load
    their own library beside the others' (FUNCTION LOAD never replaces one), and a changed
    script is a new library."""
    folder = resources.files("fencegate.ledger") / "lua"
    parts: list[str] = []
    for name in _FUNCTIONS:
        for part in ("common", *_SCRIPTS[name]):
            if part not in parts:
                parts.append(part)
    texts = [(folder / f"{part}.lua").read_text(encoding="utf-8") for part in parts]
    for name in _FUNCTIONS:
        body = (folder / f"{name}.lua").read_text(encoding="utf-8")
        texts.append(f"local function step_{name}(KEYS, ARGV)\n{body}\nend")
    text = "\n".join(texts)
    library = f"fencegate_{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    registered = "\n".join(
        f"redis.register_function('{library}_{name}', step_{name})" for name in _FUNCTIONS
    )
    return FunctionLibrary(library, f"#!lua name={library}\n{text}\n{registered}\n")


def _not_loaded(reply: Any) -> bool:
    """Did Redis run nothing because the script or function is not loaded (NOSCRIPT after
    ``SCRIPT FLUSH``, a restart or a failover; "Function not found" after ``FUNCTION
    FLUSH`` or on a new empty primary)?"""
    if isinstance(reply, NoScriptError):
        return True
    return isinstance(reply, ResponseError) and str(reply).startswith("Function not found")


def durability_warnings(config: dict[str, str]) -> list[str]:
    """What this Redis can lose, worded for an operator. Pure, so it is tested without Redis."""
    out = []
    if config.get("appendonly") != "yes":
        out.append(
            "appendonly is off: a Redis restart loses every claim, commit and effect record "
            "since the last RDB snapshot; fencing tokens may then be reissued"
        )
    elif config.get("appendfsync") != "always":
        out.append(
            f"appendfsync is {config.get('appendfsync')!r}, not 'always': a crash of the Redis "
            "host can lose up to about a second of answered claims, commits and effect records"
        )
    if config.get("maxmemory-policy") != "noeviction":
        out.append(
            f"maxmemory-policy is {config.get('maxmemory-policy')!r}, not 'noeviction': under "
            "memory pressure Redis may evict task and effect records"
        )
    return out


def _pairs(flat: Sequence[str]) -> dict[str, str]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


def _parse(reply: Sequence[Any]) -> tuple[str, dict[str, str]]:
    status = reply[0]
    if status == "ERR":
        code, detail = reply[1], reply[2]
        extra = {name: int(value) for name, value in _pairs(reply[3:]).items()}
        raise ERRORS_BY_CODE[code](detail or None, **extra)
    return status, _pairs(reply[1:])


#: The steps of a bucket's scheduler copy as the cluster store calls them
#: (``RedisStore.scheduler_copy``) -> scheduler.lua's step, named after the function of
#: ``ledger.scheduler_copies`` it mirrors, and how many integer arguments it takes.
_COPY_STEPS: dict[str, tuple[str, int]] = {
    "read": ("read", 0),
    "begin_pause": ("begin_pause", 1),
    "paused": ("with_paused", 2),
    "begin_bump": ("begin_bump", 2),
    "barrier": ("with_barrier", 2),
    "bump": ("bumped", 1),
    "clear": ("without_barrier", 1),
    "end_bump": ("end_bump", 1),
}


def _copy_of(record: Sequence[str]) -> tuple[Copy, Intent | None]:
    """scheduler.lua's answer as the copy and the intent it holds ('' for an absent field)."""
    epoch, paused, target, until, generation, intent, deadline, _frozen = record
    copy = Copy(
        epoch=int(epoch),
        paused=paused == "1",
        barrier_target=int(target) if target else None,
        barrier_until_ms=int(until) if until else None,
        pause_generation=int(generation),
    )
    return copy, Intent(int(intent), int(deadline)) if intent else None


def _about(exc: FencegateError, task_id: str | None, effect_id: str | None) -> FencegateError:
    """A step's refusal named by its effect or task (``FencegateError.about``); the store's
    own failures (STORE_UNAVAILABLE) are left as they are, as in ``sql_steps``."""
    if isinstance(exc, StoreUnavailable):
        return exc
    if effect_id is not None:
        return exc.about_effect(effect_id)
    return exc.about_task(task_id) if task_id is not None else exc


def _json_list(items: list[str]) -> str:
    return json.dumps(items, separators=(",", ":"))


def _cost_arg(cost: Cost) -> str:
    """A request's cost for a script: a JSON object, '' for none."""
    return cost_to_json(cost) if cost else ""


def _record(raw: str) -> Effect:
    """An effect record as a script answers it: the stored cjson text, one bulk string."""
    return effects.effect_from_fields(json.loads(raw))


def _prepared(reply: Sequence[Any]) -> PrepareOutcome:
    """A prepare script's decision (prepare.lua, prepare_keyed.lua; prepare_lib.lua decides
    for both): FORWARD or REPLAY with the record, or REJECT with the model's refusal."""
    status = reply[0]
    if status != "REJECT":
        return PrepareOutcome(Action(status), _record(reply[1]), write=False)
    code, detail, retry = reply[1], reply[2], reply[3]
    effect = _record(reply[4])
    error = ERRORS_BY_CODE[code](detail or None)
    if retry:
        error.extra["retryAfterMs"] = int(retry)
    error.about_effect(effect.effect_id)  # as effects._rejection
    error.extra.update(effectId=effect.effect_id, effectState=effect.state.value)
    if code == "APPROVAL_REQUIRED":
        error.extra["approvalDigest"] = effects.wanted_approval(effect)
    return PrepareOutcome(Action.REJECT, effect, write=False, error=error)


@dataclass(frozen=True, slots=True)
class _Completion:
    """A complete step decided by the gateway on the record its prepare answered
    (``ledger.effects.complete``, which complete.lua mirrors): what complete.lua writes when
    the stored record is still exactly that one, and the record it then holds."""

    #: complete.lua's ARGV[8..15].
    args: tuple[str, ...]
    #: The completed record's fields but its two times (``a<seq>_ended_at``, ``updated_at``).
    fields: dict[str, str]
    ended: str

    def effect(self, now: str) -> Effect:
        """The record as complete.lua stored it at ``now`` (its answer)."""
        return effects.effect_from_fields(self.fields | {self.ended: now, "updated_at": now})


_APPROVAL_FIELDS = ("approval_digest", "approval_by", "approval_at", "approval_expires_at")


def _completion(
    held: tuple[int, str],
    seq: int,
    attempt_id: str,
    outcome: EffectState,
    reason: str,
    response_json: str | None,
) -> _Completion | None:
    """The complete step on the record a prepare answered (``held``: its forward's seq and the
    record as stored), as complete.lua would take it: the stored fields with complete.lua's
    changes (so fields this code does not model are kept), its state from the model. None
    when the model does not apply it (complete.lua then answers STALE on its own)."""
    held_seq, raw = held
    if held_seq != seq or outcome is EffectState.PREPARED:
        return None
    fields: dict[str, str] = json.loads(raw)
    done, applied = effects.complete(
        effects.effect_from_fields(fields), seq, attempt_id, outcome, reason, response_json, 0
    )
    if not applied:
        return None
    p = f"a{seq}_"
    fields[p + "outcome"] = outcome.value
    fields[p + "reason"] = reason
    fields["state"] = done.state.value
    if not (done.state is EffectState.NOT_APPLIED and effects.sent_nothing(reason)):
        for name in _APPROVAL_FIELDS:
            fields.pop(name, None)
    fields.pop("deadline_at", None)
    if response_json:
        fields["response"] = response_json
    fields.pop("updated_at", None)
    fields.pop(p + "ended_at", None)
    text = json.dumps(fields, separators=(",", ":"))
    head = f'{text[:-1]},"{p}ended_at":"'
    event = (
        f'{{"type":"effect","effectId":{json.dumps(fields["effect_id"])},"taskId":'
        f'{json.dumps(fields.get("task_id"))},"state":"{done.state.value}","downstream":'
        f'{json.dumps(fields["downstream"])},"at":'
    )
    args = (
        raw,
        head,
        done.state.value,
        fields["attempt_count"],
        fields.get("approval_digest", ""),
        fields.get("next_probe_at", ""),
        fields.get("idempotency_key", ""),
        event,
    )
    return _Completion(args, fields, p + "ended_at")


@dataclass(frozen=True, slots=True)
class _NewForward:
    """A new effect forwarded at once, as prepare.lua would store it (``_new_forward``)."""

    #: prepare.lua's ARGV[21..22].
    args: tuple[str, str]
    #: The record's fields but its times.
    fields: dict[str, str]
    head: str
    deadline_ms: int

    def outcome(self, now: str) -> tuple[PrepareOutcome, str]:
        """The FORWARD prepare.lua answers at ``now``, and the record as stored."""
        deadline = str(int(now) + self.deadline_ms)
        raw = (
            f'{self.head}{now}","updated_at":"{now}","a0_started_at":"{now}",'
            f'"deadline_at":"{deadline}"}}'
        )
        times = {"created_at": now, "updated_at": now, "a0_started_at": now}
        effect = effects.effect_from_fields(self.fields | times | {"deadline_at": deadline})
        return PrepareOutcome(Action.FORWARD, effect, write=False), raw


def _new_forward(
    request: EffectRequest, fence: Fence, revision: int, eid: str, deadline_ms: int
) -> _NewForward:
    """The record prepare.lua creates and forwards when the effect is new and no approval is
    required (the decision in prepare_lib.lua on a new record, and ``add_attempt``), but its
    times: the gateway sends it, so prepare.lua only adds them."""
    fields = {
        "effect_id": eid,
        "task_id": fence.task_id,
        "revision": str(revision),
        "node": request.node,
        "slot": request.slot,
        "downstream": request.downstream,
        "method": request.method,
        "path": request.path,
        "payload_digest": request.payload_digest,
        "state": EffectState.PREPARED.value,
        "attempt_count": "1",
        "probe_count": "0",
        "a0_attempt_id": fence.attempt_id,
        "a0_claim_generation": str(fence.claim_generation),
    }
    if fence.principal:
        fields["requested_by"] = fence.principal
    if request.approval_digest and request.approval_digest != request.payload_digest:
        fields["requested_digest"] = request.approval_digest
    if request.request_json:
        fields["request"] = request.request_json
    if request.forward_id:
        fields["a0_forward_id"] = request.forward_id
    text = json.dumps(fields, separators=(",", ":"))
    head = f'{text[:-1]},"created_at":"'
    event = (
        f'{{"type":"effect","effectId":{json.dumps(eid)},"taskId":'
        f'{json.dumps(fence.task_id)},"state":"PREPARED","downstream":'
        f'{json.dumps(request.downstream)},"at":'
    )
    return _NewForward((head, event), fields, head, deadline_ms)


def _task_tombstone(fields: dict[str, str]) -> Tombstone:
    """A task tombstone as ``retention.lua`` writes it (and ``put.lua`` answers it)."""
    return Tombstone(
        task_id=fields["task_id"],
        revision=int(fields["revision"]),
        claim_generation=int(fields["claim_generation"]),
        cancel_generation=int(fields["cancel_generation"]),
        input_digest=fields["input_digest"],
        state=TaskState(fields["state"]),
        expired_at=int(fields["expired_at"]),
        forget_at=int(fields["forget_at"]),
        effects=int(fields["effects"]),
    )


def _effect_tombstone(fields: dict[str, str]) -> EffectTombstone:
    """An effect tombstone as ``retention.lua`` writes it (a keyed effect's with an empty
    ``task_id``, which an older gateway still reads)."""
    return EffectTombstone(
        effect_id=fields["effect_id"],
        task_id=fields.get("task_id") or None,
        state=EffectState(fields["state"]),
        expired_at=int(fields["expired_at"]),
        forget_at=int(fields["forget_at"]),
    )


def _index_member_parts(member: str) -> tuple[int, str, str | None]:
    """An effects index member: createdAt, effectId and the taskId (None: a keyed effect's
    member, which names no task)."""
    created, effect_id, task_id = member.split(":", 2)
    return int(created), effect_id, task_id or None


def split_pipeline_option(url: str) -> tuple[str, bool | None]:
    """``url`` without the ``pipeline`` query parameter (redis-py would hand an unknown one to
    its connections), and what that parameter said (None: absent). ValueError unless 0 or 1."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    said = [value for name, value in query if name == _PIPELINE_PARAM]
    if not said:
        return url, None
    if len(said) > 1 or said[0] not in _PIPELINE_VALUES:
        raise ValueError(
            f"the store url's {_PIPELINE_PARAM} parameter is 0 (one round trip per store "
            f"call) or 1 (auto-pipelining, the default), not {'&'.join(said)!r}"
        )
    rest = urlencode([(name, value) for name, value in query if name != _PIPELINE_PARAM])
    return urlunsplit(parts._replace(query=rest)), _PIPELINE_VALUES[said[0]]


#: The Sentinel URL scheme, and the form the errors show.
SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_FORM = "redis+sentinel://[USER@]HOST1:PORT1,HOST2:PORT2,.../MASTER_NAME[/DB]"
_SENTINEL_PORT = 26379
_MASTER_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


@dataclass(frozen=True, slots=True)
class SentinelSpec:
    """A ``redis+sentinel://`` URL, parsed: whom to ask, for which master, as whom."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int
    username: str | None


def parse_sentinel_url(url: str) -> SentinelSpec:
    """``redis+sentinel://[USER@]HOST1:PORT1,HOST2:PORT2,.../MASTER_NAME[/DB]`` (a port left
    out is 26379; ``?pipeline=0|1`` as for ``redis://``); ValueError saying what is wrong and
    the right form. A password in the URL is refused: it comes from ``store.password_env``."""
    url, _ = split_pipeline_option(url)

    def bad(why: str) -> ValueError:
        return ValueError(f"{why}; expected {SENTINEL_FORM}")

    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != SENTINEL_SCHEME:
        raise bad(f"not a {SENTINEL_SCHEME}:// url")
    rest, _, query = rest.partition("?")
    if query:
        raise bad(f"the only query parameter a {SENTINEL_SCHEME} url takes is pipeline=0|1")
    if "#" in rest:
        raise bad("a fragment (#...) is not part of the form")
    authority, _, path = rest.partition("/")
    sentinels, username = parse_authority(
        authority, _SENTINEL_PORT, "Redis Sentinel", "sentinel", bad
    )
    parts = path.split("/") if path else []
    if not parts or not parts[0]:
        raise bad("the master's name (as in the sentinels' `sentinel monitor`) is missing")
    if len(parts) > 2:
        raise bad(f"{path!r} is more than MASTER_NAME/DB")
    if not _MASTER_NAME.fullmatch(parts[0]):
        raise bad(f"{parts[0]!r} is not a master name")
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit() or int(parts[1]) > 10_000:
            raise bad(f"the database {parts[1]!r} is not a number")
        db = int(parts[1])
    if len(set(sentinels)) != len(sentinels):
        raise bad("a sentinel is listed twice")
    return SentinelSpec(tuple(sentinels), parts[0], db, username)


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """redis-py's Sentinel pool (each new connection asks the sentinels where the master is)
    that waits for a free connection like ``BlockingConnectionPool`` instead of failing."""


def regressed_error(regressed: tuple[int, int] | None) -> StoreRegressed:
    found = (
        f" (this gateway's write mark went back from {regressed[0]} to {regressed[1]})"
        if regressed
        else ""
    )
    return StoreRegressed(
        "the Redis store has lost writes a gateway saw acknowledged"
        f"{found}: a failover to a replica that lacked them, or an older copy restored; "
        "claims and effects are refused until an operator runs `fencegate failover ack` "
        "(docs/operations.md, 'Redis failover'); a call refused when its writes were found "
        "lost may have been applied to the store as it is now"
    )


def _shortfall(min_replicas: int, timeout_ms: int, acked: Any) -> StoreUnavailable:
    said = f"WAIT answered {acked}" if isinstance(acked, int) else f"WAIT failed: {acked}"
    return StoreUnavailable(
        f"the write was not confirmed by {min_replicas} Redis replica(s) within {timeout_ms} "
        f"ms ({said}); the step may have been applied"
    )


@dataclass(slots=True)
class _Queued:
    """One store call waiting for its turn's flush: the command as sent, the script (or
    library) to load if Redis answers that it is not loaded, and the future its caller awaits."""

    command: tuple[Any, ...]
    script: AsyncScript | FunctionLibrary | None
    future: asyncio.Future[Any]
    #: Whether the call may write (then, with min_replicas, its batch ends with WAIT).
    writes: bool = False


class _AutoPipeline:
    """The store calls issued in one event-loop turn, sent as one pipeline (like ioredis's
    auto-pipelining).

    The first call of a turn opens a batch and schedules its flush as a task (it starts on the
    next turn, so a lone caller waits one loop turn, no more); every call until then joins the
    batch, up to ``max_batch`` (a full batch is closed and the next call opens another). The
    flush sends every call in one non-transactional pipeline (no MULTI: each script is atomic
    on its own, and calls of different callers never needed to be atomic together), one write
    and one read on one pooled connection, then hands each caller its own reply or its own
    error reply (a Lua error goes to its caller only). A failure of the round trip itself
    (connection lost, timeout) goes to every caller of the batch, each of which turns it into
    the same ``StoreUnavailable`` as a single call ("may or may not have been applied").
    NOSCRIPT means Redis ran nothing for that call: the flush loads the missing scripts and
    sends those calls again, both in one more round trip. A caller that gave up (its timeout,
    a cancellation) before the flush starts is never sent; one that gives up while the batch
    is in flight is simply not answered, and the others are.

    With ``min_replicas`` > 0, a batch holding any call that may write ends with ``WAIT
    min_replicas replica_timeout_ms`` in the same pipeline, so on the same connection: WAIT
    waits for the replication offset of that connection's last write, so it covers every write
    of the batch. Fewer replicas than asked (or WAIT refused, e.g. by a demoted master) answers
    every call of the batch StoreUnavailable, "may have been applied": each may have run on the
    master, but nothing says it would survive a failover. A NOSCRIPT re-send carries its own
    WAIT. ``run`` does the same for one call (``?pipeline=0``)."""

    def __init__(
        self,
        client: aioredis.Redis,
        timeout_s: float,
        max_batch: int,
        *,
        min_replicas: int = 0,
        replica_timeout_ms: int = 0,
        write_mark: str | None = None,
        meta: str | None = None,
    ) -> None:
        self._redis = client
        self._timeout_s = timeout_s
        self._max_batch = max_batch
        self._min_replicas = min_replicas
        self._replica_timeout_ms = replica_timeout_ms
        #: The store-wide write mark's key (``Keys.write_mark``): a batch with writes INCRs it
        #: after them; None: not tracked.
        self._write_mark = write_mark
        self.mark_key = write_mark
        #: The hash holding the store-wide "writes were lost" flag (``regressed``), read
        #: after the writes of every batch that carries the mark.
        self._meta = meta
        #: Whether that flag was up in the last batch's answer.
        self.flag_up = False
        #: How many acknowledgements (``meta`` ``acks``) the store had counted at this
        #: gateway's last good write batch (None before the first).
        self.acks_seen: int | None = None
        #: ``acks`` when this gateway began refusing (found its loss, or read the flag): only
        #: an acknowledgement (``acks`` grown past it) ends the refusal, not the flag missing.
        self.acks_at_refusal = 0
        #: The highest mark a reply of this store has shown.
        self.highest_mark = 0
        #: (the highest mark seen before a batch was sent, the lower one its INCR answered)
        #: once writes were found lost; None while all is well (``RedisStore`` clears it when
        #: an operator acknowledged).
        self.regressed: tuple[int, int] | None = None
        self._open: list[_Queued] | None = None
        self._flushing: set[asyncio.Task[None]] = set()
        #: Pipelines sent (NOSCRIPT re-sends not counted) and the calls they carried.
        self.flushes = 0
        self.calls = 0

    def submit(
        self,
        command: tuple[Any, ...],
        script: AsyncScript | FunctionLibrary | None = None,
        *,
        writes: bool = False,
    ) -> Awaitable[Any]:
        """Queue ``command`` for this turn's flush; the returned future is its reply.
        ``writes``: the command may write (a WAIT follows its batch when min_replicas > 0)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        batch = self._open
        if batch is None:
            batch = self._open = []
            task = loop.create_task(self._flush(batch))
            self._flushing.add(task)
            task.add_done_callback(self._flushing.discard)
        batch.append(_Queued(command, script, future, writes))
        if len(batch) >= self._max_batch:
            self._open = None
        return future

    async def run(
        self,
        command: tuple[Any, ...],
        script: AsyncScript | FunctionLibrary | None = None,
        *,
        writes: bool = False,
    ) -> Any:
        """Send ``command`` now, alone (followed by WAIT if it writes and min_replicas > 0)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await self._flush([_Queued(command, script, future, writes)])
        return await future

    async def drain(self) -> None:
        """Wait for the flushes under way (before the connections close)."""
        while self._flushing:
            await asyncio.gather(*self._flushing, return_exceptions=True)

    async def _send(
        self,
        commands: Sequence[tuple[Any, ...]],
        wait: bool = False,
        mark: bool = False,
    ) -> tuple[list[Any], Any, Any]:
        """The replies, WAIT's (None unless ``wait``: then it ends the pipeline) and the write
        mark's (None unless ``mark``: its INCR follows the commands, before WAIT, which then
        covers it too)."""
        pipe = self._redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        if mark:
            pipe.execute_command("INCR", self._write_mark)
            pipe.execute_command("HMGET", self._meta, "regressed", "acks")
        if wait:
            pipe.execute_command("WAIT", self._min_replicas, self._replica_timeout_ms)
        replies = await pipe.execute(raise_on_error=False)
        acked = replies.pop() if wait else None
        marked: Any = None
        if mark:
            meta, marked = replies.pop(), replies.pop()
            if isinstance(meta, list) and len(meta) == 2:
                if meta[0] is not None and not self.flag_up:
                    self.acks_at_refusal = int(meta[1] or 0)
                self.flag_up = meta[0] is not None
                marked = (marked, int(meta[1] or 0))
        return replies, acked, marked

    def _mark_lost(self, floor: int, marks: Sequence[Any]) -> tuple[bool, int | None]:
        """Did an INCR of this batch answer at or below ``floor``, the highest mark seen
        before the batch was sent? Only this gateway writes its mark, and every mark it saw
        before sending was applied before each INCR of the batch ran: a reply at or below it
        means the server answering now lacks writes this gateway had acknowledged (a failover
        to a replica that had not received them, a restore). Every INCR counts: after NOSCRIPT
        (every first batch on a promoted replica, which has no scripts) the re-send INCRs
        again, one above the first, and that second INCR alone would hide one lost batch. A
        restart that loses nothing (AOF, fsync always) keeps the mark, so it never trips
        this. A loss that an operator's acknowledgement made after this gateway's last good
        write already covers (``acks`` grew since) is not raised again: that acknowledgement
        fenced every claim before it. Also the highest mark to keep if the batch is answered
        (None: keep the one held)."""
        answered = [m for m in marks if isinstance(m, tuple) and isinstance(m[0], int)]
        if not answered:
            return False, None  # the INCR itself failed: the batch's own errors say so
        lowest = min(mark for mark, _ in answered)
        highest = max(mark for mark, _ in answered)
        acks = max(acks for _, acks in answered)
        covered = self.acks_seen is not None and acks > self.acks_seen
        self.acks_seen = acks
        if lowest > floor or covered:
            return False, highest if covered else max(self.highest_mark, highest)
        if self.regressed is None:
            self.regressed = (floor, lowest)
            self.acks_at_refusal = acks
            log.error(
                "store.regressed",
                store="redis",
                highest_seen=floor,
                found=lowest,
                reason="the Redis store lacks writes this gateway saw acknowledged: claims "
                "and effect records may be lost; writes are refused until `fencegate "
                "failover ack` (docs/operations.md, 'Redis failover')",
            )
        return True, None

    def _confirmed(self, acked: Any) -> bool:
        return isinstance(acked, int) and acked >= self._min_replicas

    def _wants_wait(self, queued: Sequence[_Queued]) -> bool:
        return self._min_replicas > 0 and any(q.writes for q in queued)

    def _wants_mark(self, queued: Sequence[_Queued]) -> bool:
        return self._write_mark is not None and any(q.writes for q in queued)

    async def _flush(self, batch: list[_Queued]) -> None:
        if self._open is batch:
            self._open = None
        live = [queued for queued in batch if not queued.future.done()]
        if not live:
            return
        self.flushes += 1
        self.calls += len(live)
        wait = self._wants_wait(live)
        mark = self._wants_mark(live)
        floor = self.highest_mark
        try:
            async with asyncio.timeout(self._timeout_s):
                replies, acked, marked = await self._send(
                    [queued.command for queued in live],
                    wait,
                    mark,
                )
                marks = [marked]
                again = [
                    i
                    for i, reply in enumerate(replies)
                    if _not_loaded(reply) and live[i].script is not None
                ]
                if again and (not wait or self._confirmed(acked)):
                    replies, acked, resent_mark = await self._load_and_resend(
                        live, replies, again, acked
                    )
                    marks.append(resent_mark)
        except asyncio.CancelledError:  # the loop is shutting down
            self._fail(live, RedisConnectionError("the store call's pipeline was cancelled"))
            raise
        except Exception as exc:  # the round trip failed: nobody in the batch got an answer
            self._fail(live, exc)
            return
        lost, highest = self._mark_lost(floor, marks) if mark else (False, None)
        if lost:
            self._fail(live, regressed_error(self.regressed))
            return
        if wait and not self._confirmed(acked):
            # Not answered, so not acknowledged: its mark does not count as seen (a failover
            # may lose the batch, and that loses nothing anyone was told of).
            self._fail(live, _shortfall(self._min_replicas, self._replica_timeout_ms, acked))
            return
        if highest is not None:
            self.highest_mark = highest
        for queued, reply in zip(live, replies, strict=True):
            if queued.future.done():
                continue  # its caller gave up while the batch was in flight
            if isinstance(reply, BaseException):
                queued.future.set_exception(reply)
            else:
                queued.future.set_result(reply)

    @staticmethod
    def _fail(live: list[_Queued], exc: BaseException) -> None:
        for queued in live:
            if not queued.future.done():
                queued.future.set_exception(exc)

    async def _load_and_resend(
        self, live: list[_Queued], replies: list[Any], again: list[int], acked: Any
    ) -> tuple[list[Any], Any, Any]:
        """After NOSCRIPT or "Function not found" (a SCRIPT or FUNCTION FLUSH, a restart, a
        failover) Redis ran none of those calls: load each missing script or library and send
        them again, in one round trip (ending with its own WAIT when they may write: it may
        use another connection). A library another gateway loaded meanwhile answers its
        FUNCTION LOAD with an error, which changes nothing. Answers the replies and the WAIT
        reply that now stands for the batch."""
        loads_by: dict[str, tuple[str, Any]] = {}
        for i in again:
            script = live[i].script
            if isinstance(script, FunctionLibrary):
                loads_by[script.name] = ("FUNCTION LOAD", script.source)
            elif script is not None:
                loads_by[script.sha] = ("SCRIPT LOAD", script.script)
        loads = list(loads_by.values())
        wait = self._wants_wait([live[i] for i in again])
        mark = self._wants_mark([live[i] for i in again])
        resent, acked_again, marked = await self._send(
            [*loads, *(live[i].command for i in again)],
            wait,
            mark,
        )
        replies = list(replies)
        for i, reply in zip(again, resent[len(loads) :], strict=True):
            replies[i] = reply
        return replies, (acked_again if wait else acked), marked


#: The most ids of the awaiting-approval set ``awaiting_approval`` reads.
_AWAITING_READ = 5_000


def _closed_transport(exc: RuntimeError) -> bool:
    """Is this uvloop saying the connection's transport closed under a write ("unable to
    perform operation on <TCPTransport closed=True ...>; the handler is closed")? redis-py
    lets it through while it reconnects to a Sentinel's new primary as the old one dies (seen
    in a failover test); it means the store did not answer, like a ConnectionError."""
    return str(exc).startswith("unable to perform operation on")


class RedisStore(Store):
    #: Tests only: when set, store time stands at this instant (plus ``clock_offset_ms``)
    #: instead of following Redis's ``TIME``, in the scripts and in Python alike, so a test
    #: controls the clock exactly. Production never sets it, and no config key reaches it.
    clock_pinned_ms: int | None = None

    def __init__(
        self,
        url: str,
        policy: LeasePolicy,
        *,
        timeout_ms: int = 2000,
        key_prefix: str = "fg",
        password: str | None = None,
        max_connections: int = 200,
        pipeline: bool | None = None,
        max_dependents: int = 1_000,
        max_cascade: int = 1_000,
        min_replicas: int = 0,
        replica_timeout_ms: int = 500,
        client: aioredis.Redis | None = None,
        cluster_slot_key: str | None = None,
    ) -> None:
        """``pipeline``: auto-pipeline the store calls (``_AutoPipeline``); None follows the
        URL's ``?pipeline=0|1``, on when absent. ``max_dependents``, ``max_cascade``: as
        ``Store`` says (``StoreOptions``). ``min_replicas``, ``replica_timeout_ms``: every
        write step is followed by ``WAIT min_replicas replica_timeout_ms`` (0: no WAIT).
        ``client``: talk through this client instead of one built from ``url`` (a bucket
        view's ``cluster_client.RoutedRedis``; the store closes it). ``cluster_slot_key``:
        this store is one bucket of a Redis Cluster store, every key in the slot of this hash
        tag (the key prefix must carry it), so a cluster node is what it expects to reach."""
        super().__init__(policy)
        self.max_dependents = max_dependents
        self.max_cascade = max_cascade
        self.url = url
        url, said = split_pipeline_option(url)
        self._timeout_s = timeout_ms / 1000
        self._keys = keys.Keys(key_prefix)
        self._durability_checked = False
        self._format_checked = False
        #: Whether the keys are in this code's format: until then retention does nothing
        #: (``expire_settled``), since gateways of the older format may still serve.
        self._format_current = False
        #: Whether the recorded format lets prepare.lua leave the creation indexes to
        #: index_catch_up.lua (format 3); until this store read it, new effects are indexed
        #: in their step.
        self._feed_indexed = False
        self._tasks_indexed = False
        self._settled_indexed = False
        self._effect_ids_indexed = False
        #: The lean prepares since the last catch-up, and the timer and the run that bound
        #: their lag (``_created_unindexed``).
        self._unindexed = 0
        self._catch_up_timer: asyncio.TimerHandle | None = None
        self._catch_up_run: asyncio.Task[None] | None = None
        self._closing = False
        self._effect_indexes = [
            self._keys.prepared,
            self._keys.unknown,
            self._keys.awaiting,
            self._keys.probe_due,
            self._keys.events,
        ]
        #: The keyed indexes (effect_lib.lua's effect_indexes, after ``_effect_indexes``):
        #: only the steps that may write a keyed record get them; the leased hot path
        #: (prepare.lua, complete.lua on a task's effects) never touches their keys.
        self._keyed_indexes = [
            self._keys.keyed_settled,
            self._keys.keyed_prepared,
            self._keys.keyed_unknown,
        ]
        if not 0 <= min_replicas <= MAX_MIN_REPLICAS:
            raise ValueError(f"min_replicas is 0..{MAX_MIN_REPLICAS}, not {min_replicas}")
        if min_replicas and not 0 < replica_timeout_ms < timeout_ms:
            raise ValueError("replica_timeout_ms must be above 0 and below timeout_ms")
        self.min_replicas = min_replicas
        self.replica_timeout_ms = replica_timeout_ms
        # A bounded pool that waits (up to the store timeout) for a free connection instead of
        # failing, and no client-side retries: a retried script after a lost reply would run
        # twice, and only the gateway knows whether that is safe.
        common: dict[str, Any] = {
            "max_connections": max_connections,
            "timeout": self._timeout_s,
            "password": password,
            "decode_responses": True,
            "socket_timeout": self._timeout_s,
            "socket_connect_timeout": self._timeout_s,
            "health_check_interval": 0,
            "retry": Retry(NoBackoff(), 0),
        }
        #: The sentinels' clients (redis+sentinel:// only); closed with the store.
        self._sentinel: Sentinel | None = None
        if cluster_slot_key is not None and slot_of(key_prefix) != slot_of(cluster_slot_key):
            raise ValueError(f"key prefix {key_prefix!r} is not in {cluster_slot_key!r}'s slot")
        self._cluster_slot_key = cluster_slot_key
        self._redis: aioredis.Redis
        if client is not None:
            self._redis = client
        elif url.lower().startswith(f"{SENTINEL_SCHEME}://"):
            spec = parse_sentinel_url(url)
            # Asking the sentinels where the master is happens on every new connection: each
            # sentinel gets the store timeout, and no retries (a dead one is skipped).
            self._sentinel = Sentinel(  # type: ignore[no-untyped-call]
                list(spec.sentinels),
                sentinel_kwargs={
                    "socket_timeout": self._timeout_s,
                    "socket_connect_timeout": self._timeout_s,
                    "retry": Retry(NoBackoff(), 0),
                    "health_check_interval": 0,
                },
            )
            self._redis = self._sentinel.master_for(
                spec.master,
                connection_pool_class=_BlockingSentinelPool,
                db=spec.db,
                username=spec.username,
                **common,
            )
        else:
            pool = aioredis.BlockingConnectionPool.from_url(url, **common)
            self._redis = aioredis.Redis.from_pool(pool)  # owns and closes it
        # (taskId, claimGeneration) -> the task revision that claim is for, learnt from claim
        # and prepare answers, so the gateway computes effectIds (prepare.lua checks the
        # revision). A generation is granted once with one revision, and any new revision sends
        # the task back to READY, so the pair keeps its revision for good.
        self._revisions: dict[tuple[str, int], int] = {}
        #: effectId -> (seq, record as stored) of the forwards this store's prepares let
        #: through, for their complete (``_completion``): complete.lua then writes the step
        #: decided here instead of decoding and re-encoding the record. Popped by the
        #: complete; a record changed meanwhile (another gateway, the reconciler) is not
        #: the one held, and complete.lua then decides itself.
        self._held: dict[str, tuple[int, str]] = {}
        self._scripts: dict[str, AsyncScript] = {
            name: self._redis.register_script(load_script_source(name))
            for name in _SCRIPTS
            if name not in _FUNCTIONS
        }
        #: The library the effect steps run from (``_FUNCTIONS``), loaded when Redis lacks it.
        self._library = library_source()
        wanted = (True if said is None else said) if pipeline is None else pipeline
        batcher = _AutoPipeline(
            self._redis,
            self._timeout_s,
            PIPELINE_BATCH_MAX,
            min_replicas=min_replicas,
            replica_timeout_ms=replica_timeout_ms,
            write_mark=self._keys.write_mark(new_id()[:16]),
            meta=self._keys.meta,
        )
        #: While refusing: when the flag was last read to see whether it came down.
        self._flag_checked_at = -1.0
        #: Whether this gateway has raised the flag for what it found itself.
        self._flag_raised = False
        #: The auto-pipeline of this store's calls; None when it is switched off.
        self.pipeline = batcher if wanted else None
        #: Without auto-pipelining, a write step with min_replicas > 0 goes through this one
        #: call at a time (the step and its WAIT on one connection).
        self._single = batcher

    @property
    def kind(self) -> str:
        return "redis"

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        try:
            async with asyncio.timeout(self._timeout_s):
                return await fn()
        except FencegateError:
            raise
        except ResponseError as exc:
            raise StoreUnavailable(f"Redis refused the operation: {exc}") from exc
        except ClusterUnavailable as exc:  # the router did not send it, or Redis refused it
            raise StoreUnavailable(
                f"the Redis Cluster did not take the step ({exc}); nothing was applied"
            ) from exc
        except (RedisError, OSError, TimeoutError, RuntimeError) as exc:
            if isinstance(exc, RuntimeError) and not _closed_transport(exc):
                raise  # a bug, not the store: the 500 with its traceback says so
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # The driver turned our cancellation into an error: give it back.
                raise asyncio.CancelledError from exc
            # A reply that never came may belong to a step Redis did apply: say so.
            raise StoreUnavailable(
                f"Redis did not answer ({type(exc).__name__}: {exc}); the step may or may "
                "not have been applied"
            ) from exc

    def _clock_arg(self) -> str:
        """Every timed script's ARGV[1] (``now_ms`` in common.lua): the test clock offset
        added to ``TIME``, or ``=<ms>``, the exact instant, while the clock is pinned."""
        if self.clock_pinned_ms is not None:
            return f"={self.clock_pinned_ms + self.clock_offset_ms}"
        return str(self.clock_offset_ms)

    def _store_time(self, sec: Any, usec: Any) -> int:
        """Store time from a ``TIME`` reply, as ``now_ms`` in common.lua computes it."""
        if self.clock_pinned_ms is not None:
            return self.clock_pinned_ms + self.clock_offset_ms
        return int(sec) * 1000 + int(usec) // 1000 + self.clock_offset_ms

    def _eval(
        self, name: str, keys_: list[str], args: list[Any], *, writes: bool | None = None
    ) -> Awaitable[Any]:
        """Run one registered script: queued for this turn's pipeline, or on its own.
        ``writes`` (default: unless it is in ``_UNFENCED_SCRIPTS``) makes its WAIT follow."""
        if writes is None:
            writes = name not in _UNFENCED_SCRIPTS
        if name in _FUNCTIONS:
            library = self._library
            call = ("FCALL", library.function(name), len(keys_), *keys_, *args)
            if self.pipeline is None:  # run loads the library when Redis lacks it
                return self._single.run(call, library, writes=writes)
            return self.pipeline.submit(call, library, writes=writes)
        script = self._scripts[name]
        command = ("EVALSHA", script.sha, len(keys_), *keys_, *args)
        if self.pipeline is None:
            if writes:  # with the write mark's INCR (and WAIT) on the same connection
                return self._single.run(command, script, writes=True)
            return script(keys=keys_, args=args)
        return self.pipeline.submit(command, script, writes=writes)

    def _command(self, direct: Callable[[], Awaitable[Any]], *command: Any) -> Awaitable[Any]:
        """One plain command: queued for this turn's pipeline (redis-py parses its reply as it
        would ``direct``'s), or ``direct``, the redis-py method, on its own."""
        if self.pipeline is None:
            return direct()
        return self.pipeline.submit(command)

    @property
    def regressed(self) -> bool:
        return self._single.flag_up or self._single.regressed is not None

    async def _refuse_while_regressed(self, *, look: bool = False) -> None:
        """Fail closed after lost writes. A gateway that finds its own writes lost (its write
        mark went back, ``_AutoPipeline``) raises the store-wide flag (``meta`` ``regressed``)
        at once; every gateway learns it from the answer to its next write batch (the flag is
        read after the writes, in the same pipeline), refuses that batch's answers
        (``_script``) and every write after (``StoreRegressed``) until
        ``acknowledge_failover`` takes it down, which a refusing gateway looks for at most
        once a second (``look``: now)."""
        batcher = self._single
        await self._raise_flag()
        now = time.monotonic()
        if (self.regressed and now >= self._flag_checked_at + 1.0) or look:
            self._flag_checked_at = now
            up, acks = await self._call(
                lambda: self._redis.hmget(self._keys.meta, ["regressed", "acks"])
            )
            acked = int(acks or 0) > batcher.acks_at_refusal
            if self.regressed and acked:
                log.warning("store.failover_acknowledged", store="redis")
                if batcher.regressed is not None:  # go on from what the store holds now
                    batcher.highest_mark, batcher.regressed = batcher.regressed[1], None
                batcher.flag_up = self._flag_raised = False
            elif self.regressed and up is None:
                # The flag is gone and nobody acknowledged: a resync or another failover
                # lost it. The loss is still there: raise it again.
                self._flag_raised = False
                await self._raise_flag(relayed=batcher.regressed is None)
            else:
                batcher.flag_up = up is not None
                if batcher.flag_up:
                    batcher.acks_at_refusal = int(acks or 0)
        if self.regressed:
            raise regressed_error(batcher.regressed)

    async def _raise_flag(self, *, relayed: bool = False) -> None:
        """Tell every gateway (``meta`` ``regressed``) that this one found its writes lost,
        once per finding, as soon as it is found (``relayed``: again, for a flag that went
        missing without an acknowledgement, by a gateway that had learned it from the flag)."""
        batcher = self._single
        if (batcher.regressed is not None or relayed) and not self._flag_raised:
            highest, found = batcher.regressed or (None, None)
            flag = json.dumps(
                {"highestSeen": highest, "found": found, "by": batcher.mark_key}
                | ({"relayed": True} if relayed else {})
            )
            await self._call(lambda: self._redis.hset(self._keys.meta, "regressed", flag))
            self._flag_raised = batcher.flag_up = True

    async def acknowledge_failover(self) -> Scheduler:
        """The operator's answer to lost writes: bump the scheduler epoch once (every claim
        the store holds, all granted before, now fails STALE_EPOCH; a claim the old master
        granted and lost is on no task record, so its holder is FENCED anyway), then take the
        flag down; gateways that refused writes resume within a second."""
        self._single.flag_up = False  # the flag is what this takes down: not a reason to stop
        scheduler = await self.bump_epoch()

        async def take_down() -> Any:
            pipe = self._redis.pipeline(transaction=True)
            pipe.hincrby(self._keys.meta, "acks", 1)
            pipe.hdel(self._keys.meta, "regressed")
            return await pipe.execute()

        await self._call(take_down)
        return scheduler

    async def _script(self, name: str, keys_: list[str], args: list[Any]) -> Sequence[Any]:
        if name not in _UNFENCED_SCRIPTS:
            await self._refuse_while_regressed()
        started = time.monotonic()
        clock = self._clock_arg()
        try:
            reply = await self._call(lambda: self._eval(name, keys_, [clock, *args]))
            if name not in _UNFENCED_SCRIPTS and self.regressed:
                # Checked again after the answer, before it goes out: the flag read after
                # this script in the same pipeline, or a loss another batch of this gateway
                # found while this one was in flight. The script ran on a store that lacks
                # acknowledged writes; a claim it granted or an effect it let through must
                # not be acted on (the refusal says it may have been applied).
                raise regressed_error(self._single.regressed)
        except StoreRegressed:
            with contextlib.suppress(StoreUnavailable):
                await self._raise_flag()  # the others should stop now, not at their next look
            raise
        self.observe(name, time.monotonic() - started)
        if not self._durability_checked:
            await self._check_durability()
        if not self._format_checked:
            await self._check_format()
        return reply  # type: ignore[no-any-return]

    async def open(self) -> None:
        """Connect and check durability; a Redis that is down now is checked once it answers
        (the first successful call does it), so a gateway started before its Redis still warns."""
        await self.ping()

    async def _check_durability(self) -> None:
        self._durability_checked = True
        try:
            warnings = await self.durability()
        except StoreUnavailable as exc:
            if not isinstance(exc.__cause__, ResponseError):
                self._durability_checked = False  # unreachable: try again on the next call
                return
            log.warning(
                "store.durability_unknown",
                reason=f"cannot read the Redis configuration ({exc.detail}); make sure "
                "appendonly=yes, appendfsync=always and maxmemory-policy=noeviction",
            )
            return
        for warning in warnings:
            log.warning("store.durability_warning", store="redis", reason=warning)
        if self._sentinel is not None and not self.min_replicas:
            # Logged, not part of ``durability`` (which /readyz refuses on): it is a choice.
            log.warning(
                "store.durability_warning",
                store="redis",
                reason="redis_min_replicas is 0: replication is asynchronous, so a Sentinel "
                "failover can lose the last claims, commits and effect records the old master "
                "answered (docs/stores.md, High availability)",
            )

    async def durability(self) -> list[str]:
        """The durability warnings for the server as it is configured right now."""
        config: Any = await self._call(
            lambda: self._redis.config_get("appendonly", "appendfsync", "maxmemory-policy")
        )
        return durability_warnings(config)

    async def close(self) -> None:
        self._closing = True  # no catch-up is scheduled from now on; the last one runs here
        if self._catch_up_timer is not None:
            self._catch_up_timer.cancel()
            self._catch_up_timer = None
        if self._catch_up_run is not None:
            await asyncio.gather(self._catch_up_run, return_exceptions=True)
        if self._unindexed:  # leave no lag behind a gateway that stops
            with contextlib.suppress(FencegateError, RedisError, OSError):
                await self.catch_up_indexes()
            self._unindexed = 0
        if self.pipeline is not None:
            await self.pipeline.drain()
        await self._redis.aclose()
        if self._sentinel is not None:
            await self._sentinel.aclose()

    async def ping(self) -> None:
        await self._call(lambda: self._command(self._redis.ping, "PING"))
        if not self._durability_checked:
            await self._check_durability()
        if not self._format_checked:
            await self._check_format()
        await self._refuse_while_regressed(look=True)  # /readyz: false while writes are refused

    async def _format(self) -> tuple[int | None, bool]:
        """(the format recorded under the prefix or None, whether anything was ever written
        under it)."""
        keys_ = self._keys

        async def read() -> Any:
            pipe = self._redis.pipeline(transaction=False)
            pipe.hget(keys_.meta, "format")
            pipe.exists(keys_.scheduler, keys_.tasks_index, keys_.tasks_indexed, keys_.events)
            return await pipe.execute()

        recorded, written = await self._call(read)
        return (int(recorded) if recorded is not None else None), bool(written)

    async def _refuse_cluster_node(self) -> None:
        """Refuse a cluster node reached through ``redis://`` (``INFO cluster`` says
        ``cluster_enabled:1``), before any key is read: a plain client follows no ``MOVED``,
        so every key in another node's slots would fail, and a script's keys span slots. A
        Redis that refuses ``INFO`` is not refused for it (the format read goes on). A bucket
        of the cluster store (``cluster_slot_key``) is on a cluster by design."""
        if self._cluster_slot_key is not None:
            return
        try:
            info: Any = await self._call(lambda: self._redis.info("cluster"))
        except StoreUnavailable as exc:
            if isinstance(exc.__cause__, ResponseError):
                return
            raise
        if str(info.get("cluster_enabled", "0")) == "1":
            where = self._redis.connection_pool.connection_kwargs
            address = f"{where['host']}:{where['port']}" if "host" in where else where.get("path")
            raise StoreIncompatible(
                f"the Redis at {address or 'the store URL'} is a cluster node "
                "(cluster_enabled:1): use a redis+cluster:// URL (a redis:// client follows "
                "no MOVED, and the store's keys span the cluster's slots)"
            )

    async def _check_format(self) -> None:
        """Refuse a newer format (its records could be misread); record ours on a new store;
        say so once when an older one waits for ``fencegate store migrate``. Checked at the
        first contact, like durability."""
        await self._refuse_cluster_node()
        recorded, written = await self._format()
        if recorded is not None and recorded > FORMAT_VERSION:
            raise StoreIncompatible(
                f"the Redis keys under prefix {self._keys.prefix!r} are in fencegate format "
                f"{recorded}, newer than this gateway's {FORMAT_VERSION}: run the fencegate "
                "version that wrote them (or newer)"
            )
        self._format_current = recorded == FORMAT_VERSION or (recorded is None and not written)
        if recorded is None and not written:
            await self._call(lambda: self._redis.hsetnx(self._keys.meta, "format", FORMAT_VERSION))
        if not self._format_current and (recorded or 1) < FORMAT_VERSION:
            log.warning(
                "store.migration_needed",
                store="redis",
                found=recorded or 1,
                current=FORMAT_VERSION,
                reason="written by an older fencegate: it is served as it is; run "
                "`fencegate store migrate` once the older gateways are stopped",
            )
        self._format_checked = True
        self._feed_indexed = self._format_current

    async def migrate(self) -> Migration:
        """Format 1 -> 2: the tasks index and the settled index completed from the records (both
        idempotent: ZADD NX of what each task's state says, in bounded steps). 2 -> 3: nothing
        to rewrite (every effect is indexed; from now on new ones may wait for
        index_catch_up.lua). Then the format recorded. Safe while older gateways serve,
        but a task they settle afterwards is not indexed (an older gateway does not know the
        index), and they may not find an effect created in the last moments: stop them first,
        or run it again once they stopped."""
        await self._refuse_cluster_node()
        recorded, written = await self._format()
        if recorded is not None and recorded > FORMAT_VERSION:
            await self._check_format()  # raises, with the words
        found = recorded if recorded is not None else (1 if written else None)
        done: list[str] = []
        if found is not None and found < FORMAT_VERSION:
            if found < _RETENTION_FORMAT:
                await self._index_old_tasks()
                added = await self._index_settled(again=True)
                done.append(
                    f"settled index: {added} settled task(s) added (retention can see them)"
                )
            await self._call(lambda: self._redis.hset(self._keys.meta, "format", FORMAT_VERSION))
            done.append(f"format {FORMAT_VERSION} recorded in {self._keys.meta}")
        elif found is None:
            await self._call(lambda: self._redis.hsetnx(self._keys.meta, "format", FORMAT_VERSION))
        self._format_checked = True
        self._format_current = self._feed_indexed = True
        return Migration(
            store="redis",
            found=found,
            current=FORMAT_VERSION,
            done=tuple(done),
            notes=_migration_notes(found),
        )

    async def now_ms(self) -> int:
        sec, usec = await self._call(lambda: self._command(self._redis.time, "TIME"))
        return self._store_time(sec, usec)

    # --- transitions ------------------------------------------------------------------------

    async def _task_script(self, name: str, keys_: list[str], args: list[Any]) -> Sequence[Any]:
        """A script with task_lib.lua: the key prefix goes after the clock (its ARGV[2]).

        Every such script declares its bucket's scheduler hash in KEYS and refuses, having
        done nothing, while the bucket is frozen (``freeze_bucket``: its slot is moving to
        another node) or, for a claim, while a bump's barrier holds (task_lib.lua,
        ``claim_admission``); both are the store's conditions, not the task's, and are
        raised here, for every script, before any caller reads the answer. Neither happens
        on one Redis."""
        assert self._keys.scheduler in keys_, f"{name}.lua must declare the scheduler hash"
        reply = await self._script(name, keys_, [self._keys.prefix, *args])
        if isinstance(reply, list) and len(reply) >= 3 and reply[0] == "ERR":
            if reply[1] == "FROZEN":
                raise StoreUnavailable(f"nothing was applied; {reply[2]}: retry")
            if reply[1] == "BARRIER":
                barrier = _pairs(reply[3:])
                raise BumpBarrier(int(barrier["target"]), int(barrier["retryAfterMs"]))
        return reply

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
        deps = "" if depends_on is None else _json_list(list(dict.fromkeys(depends_on)))
        reply = await self._task_script(
            "put",
            [
                self._keys.task(task_id),
                self._keys.leases,
                self._keys.tasks_index,
                self._keys.scheduler,
            ],
            [
                task_id,
                input_digest,
                "" if max_runtime_ms is None else max_runtime_ms,
                queue or "",
                "" if priority is None else priority,
                deps,
                self.max_dependents,
                MAX_GRAPH_VISITS,
            ],
        )
        status, fields = _parse(reply)
        if status == "EXPIRED":
            # The task expired and this is its input again: the model's refusal, composed
            # from the tombstone put.lua read in the same step.
            raise expired_task(_task_tombstone(fields))
        return task_from_fields(fields), PutOutcome(status)

    async def get_task(self, task_id: str) -> Task:
        key = self._keys.task(task_id)
        fields: Any = await self._call(
            lambda: self._command(functools.partial(self._redis.hgetall, key), "HGETALL", key)
        )
        if not fields:
            raise await self._refusal(NoSuchTask(), task_id=task_id)
        return task_from_fields(fields)

    async def _refusal(
        self,
        exc: FencegateError,
        *,
        task_id: str | None = None,
        effect_id: str | None = None,
    ) -> FencegateError:
        """The refusal to give for a step that found no task ``task_id`` (``exc`` a plain
        NoSuchTask) or no effect ``effect_id`` (a plain NoSuchEffect): ``TaskExpired`` /
        ``EffectExpired`` when a live tombstone remembers it, else ``exc`` itself.

        The one place this store refines those refusals (docs/dev/retention-spec.md): a second
        read, after the step answered, of the tombstone and the store's time. It only changes
        which refusal is given, never what a step did, so it need not be atomic with the step;
        a tombstone past its ``forget_at`` on the store's clock counts as absent, whether or
        not Redis has expired the key yet.

        Also the one place this store names any refusal of such a step by its task (effect):
        ``FencegateError.about``, as ``sql_steps.expired_refusal`` does."""
        if type(exc) is NoSuchTask and task_id is not None:
            key = self._keys.tombstone(task_id)
        elif type(exc) is NoSuchEffect and effect_id is not None:
            key = self._keys.effect_tombstone(effect_id)
        else:
            return _about(exc, task_id, effect_id)

        async def read() -> Any:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(key)
                pipe.time()
                return await pipe.execute()

        fields, (sec, usec) = await self._call(read)
        if not fields or int(fields["forget_at"]) <= self._store_time(sec, usec):
            return _about(exc, task_id, effect_id)
        if task_id is not None:
            return expired_task(_task_tombstone(fields))
        return expired_effect(_effect_tombstone(fields))

    async def _index_old_tasks(self) -> None:
        """Add the tasks created before the task index existed (an older fencegate) to it:
        one SCAN of the task hashes, once per store (a marker key remembers). Tasks created
        meanwhile are indexed by put.lua anyway; two gateways doing it at once is harmless."""

        async def page(cursor: Any) -> tuple[Any, list[Any]]:
            cursor, found = await self._call(
                functools.partial(
                    self._redis.scan, cursor, match=self._keys.task_pattern(), count=1000
                )
            )
            return cursor, [i for i in (self._keys.task_id_of(str(key)) for key in found) if i]

        if await self._backfill(page, self._keys.tasks_index, self._keys.tasks_indexed):
            log.info("store.tasks_indexed", store="redis")
        self._tasks_indexed = True

    async def _backfill(
        self,
        page: Callable[[Any], Awaitable[tuple[Any, list[Any]]]],
        index: str,
        marker: str,
    ) -> bool:
        """Add to the sorted set ``index`` every member a scan finds (``page``: the cursor
        in, the next cursor and a page of members out), unless ``marker`` says a gateway
        already did; then set ``marker``. For the indexes a newer fencegate added: the records
        an older one wrote are found once per store. Answers whether it scanned."""
        if await self._call(lambda: self._redis.exists(marker)):
            return False
        cursor: Any = 0
        while True:
            cursor, members = await page(cursor)
            if members:
                zadd = functools.partial(self._redis.zadd, index, dict.fromkeys(members, 0))
                await self._call(zadd)
            if int(cursor) == 0:
                break
        await self._call(lambda: self._redis.set(marker, "1"))
        return True

    async def list_tasks(
        self, wanted: TaskFilter, limit: int, after: str | None, *, scan: int | None = None
    ) -> tuple[list[Task], str | None]:
        """``Store.list_tasks``; ``scan``: the most records read (default ``TASK_SCAN``; the
        cluster store gives each bucket a share of it)."""
        scan = TASK_SCAN if scan is None else scan
        if not self._tasks_indexed:
            await self._index_old_tasks()
        started = time.monotonic()
        # The store's clock, read once: "lease expired" is its decision, not the gateway's.
        now = await self.now_ms() if wanted.lease_expired is not None else 0
        scanned: list[tuple[str, Task | None]] = []
        start = "-" if after is None else f"({after}"
        more = True
        while more and len(scanned) < scan:
            batch = min(max(limit + 1, 200), scan - len(scanned))
            ids: Any = await self._call(
                functools.partial(
                    self._redis.zrangebylex,
                    self._keys.tasks_index,
                    start,
                    "+",
                    start=0,
                    num=batch,
                )
            )
            more = len(ids) == batch
            if not ids:
                break
            start = f"({ids[-1]}"
            # Ids outside the caller's scope are never read; they still count as scanned.
            readable = [i for i in ids if wanted.admits_id(i)]

            async def read(readable: list[str] = readable) -> Any:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for task_id in readable:
                        pipe.hgetall(self._keys.task(task_id))
                    return await pipe.execute()

            records = dict(zip(readable, await self._call(read), strict=True))
            for task_id in ids:
                fields = records.get(task_id)
                scanned.append((task_id, task_from_fields(fields) if fields else None))
            page, _ = page_tasks(scanned, more, wanted, limit, now)
            if len(page) == limit:
                break
        self.observe("list_tasks", time.monotonic() - started)
        return page_tasks(scanned, more, wanted, limit, now)

    async def claim(self, task_id: str, request: ClaimRequest) -> Task:
        reply = await self._task_script(
            "claim",
            [self._keys.task(task_id), self._keys.scheduler, self._keys.leases],
            [
                request.owner,
                request.ttl_ms,
                request.scheduler_epoch,
                "" if request.expected_revision is None else request.expected_revision,
                new_id(),
                self.policy.max_ttl_ms,
                self.policy.default_max_runtime_ms,
                request.principal or "",
            ],
        )
        try:
            task = task_from_fields(_parse(reply)[1])
        except FencegateError as exc:
            raise await self._refusal(exc, task_id=task_id) from None
        self._remember_revision(task_id, task.claim_generation, task.revision)
        return task

    async def claim_next(self, queue: str, request: ClaimRequest) -> Task | None:
        """claim_next.lua: the queue's best claimable task from its indexes, claimed."""
        reply = await self._task_script(
            "claim_next",
            [
                self._keys.scheduler,
                self._keys.leases,
                self._keys.queue_ready(queue),
                self._keys.queue_held(queue),
                self._keys.queue_epochs(queue),
            ],
            [
                queue,
                request.owner,
                request.ttl_ms,
                request.scheduler_epoch,
                new_id(),
                self.policy.max_ttl_ms,
                self.policy.default_max_runtime_ms,
                request.principal or "",
            ],
        )
        if reply[0] == "NONE":
            return None
        task = task_from_fields(_parse(reply)[1])
        self._remember_revision(task.task_id, task.claim_generation, task.revision)
        return task

    def _remember_revision(self, task_id: str, generation: int, revision: int) -> None:
        if len(self._revisions) >= _REVISIONS_KEPT:
            self._revisions.clear()
        self._revisions[(task_id, generation)] = revision

    async def renew(self, task_id: str, request: RenewRequest) -> Task:
        ident = request.identity
        reply = await self._task_script(
            "renew",
            [self._keys.task(task_id), self._keys.scheduler, self._keys.leases],
            [
                ident.attempt_id,
                ident.claim_generation,
                ident.owner,
                ident.scheduler_epoch,
                ident.cancel_generation,
                request.ttl_ms,
                self.policy.max_ttl_ms,
                self.policy.default_max_runtime_ms,
                request.caller or "",
                _cost_arg(request.cost),
            ],
        )
        try:
            return task_from_fields(_parse(reply)[1])
        except FencegateError as exc:
            raise await self._refusal(exc, task_id=task_id) from None

    async def release(self, task_id: str, identity: Identity) -> Task:
        reply = await self._task_script(
            "release",
            [self._keys.task(task_id), self._keys.leases, self._keys.scheduler],
            [
                identity.attempt_id,
                identity.claim_generation,
                identity.owner,
                identity.cancel_generation,
                identity.principal or "",
            ],
        )
        try:
            return task_from_fields(_parse(reply)[1])
        except FencegateError as exc:
            raise await self._refusal(exc, task_id=task_id) from None

    async def commit(self, task_id: str, request: CommitRequest) -> tuple[Task, bool]:
        reply = await self._task_script(
            "commit",
            [self._keys.task(task_id), self._keys.scheduler, self._keys.leases],
            [
                request.attempt_id,
                request.claim_generation,
                request.scheduler_epoch,
                request.cancel_generation,
                request.input_digest,
                request.result_digest,
                new_id(),
                request.result_json or "",
                request.principal or "",
                _cost_arg(request.cost),
            ],
        )
        try:
            status, fields = _parse(reply)
        except FencegateError as exc:
            raise await self._refusal(exc, task_id=task_id) from None
        return task_from_fields(fields), status == "REPLAY"

    async def cancel(self, task_id: str) -> Task:
        reply = await self._task_script(
            "cancel",
            [self._keys.task(task_id), self._keys.leases, self._keys.scheduler],
            [self.max_cascade],
        )
        try:
            return task_from_fields(_parse(reply)[1])
        except FencegateError as exc:
            raise await self._refusal(exc, task_id=task_id) from None

    async def continue_cascades(self, limit: int) -> int:
        """cascade.lua: the recorded cascades (a set of cancelled task ids), one step."""
        handled: Any = await self._task_script(
            "cascade", [self._keys.leases, self._keys.scheduler], [limit]
        )
        return int(handled)

    # --- the change feed (ledger.events) ----------------------------------------------------

    async def read_events(self, after: str | None, limit: int) -> tuple[list[Event], str]:
        """events_read.lua: positions are the stream's entry ids. The script answers the
        stream's last generated id and max deleted id with the page; ``events.gone`` decides
        410 from them (a position trimmed away, or one ahead of the last generated id)."""
        # The largest id is refused too: XADD * never issues it, and Redis cannot read after
        # it (XRANGE "(" of it is an error), which would be a 503 for a client's mistake.
        if after is not None and (
            not (match := _POSITION.fullmatch(after))
            or max(int(match[1]), int(match[2])) > _MAX_STREAM_ID_PART
            or int(match[1]) == int(match[2]) == _MAX_STREAM_ID_PART
        ):
            raise BadRequest("Last-Event-ID: not an event position this store issued")
        reply = await self._script(
            "events_read", [self._keys.events], ["" if after is None else after, limit]
        )
        newest = str(reply[0])
        if after is None:
            return [], newest

        def numbers(stream_id: str) -> events.Position:
            ms, _, seq = stream_id.partition("-")
            return int(ms), int(seq)

        refused = events.gone(
            numbers(after), dropped=numbers(str(reply[1])), newest=numbers(newest)
        )
        if refused is not None:
            raise refused
        found = [
            Event(position=reply[i], body=json.loads(reply[i + 1])) for i in range(2, len(reply), 2)
        ]
        return found, (found[-1].position if found else after)

    async def trim_events(
        self, keep: int, *, before: str | None = None, most: int | None = None
    ) -> int:
        """events_trim.lua, a batch at a time (each run is one short atomic step). The
        cluster store's trim also passes ``before`` (drop only ids below it) and ``most`` (the
        most to drop in all)."""
        dropped = 0
        while most is None or dropped < most:
            batch = _TRIM_BATCH if most is None else min(_TRIM_BATCH, most - dropped)
            ran: Any = await self._script(
                "events_trim", [self._keys.events], [keep, batch, before or ""]
            )
            n = int(ran)
            dropped += n
            if n < batch:
                break
        return dropped

    async def event_ids(self, before: str | None, most: int) -> list[str]:
        """events_ids.lua: the ids of up to ``most`` newest events before ``before`` (None:
        the newest), newest first."""
        reply = await self._script("events_ids", [self._keys.events], [before or "", most])
        return [str(i) for i in reply]

    async def _scheduler_step(self, op: str, *args: str | int) -> list[str]:
        """One step of scheduler.lua: the record (this bucket's copy) after it, whole."""
        reply: Any = await self._call(
            lambda: self._eval(
                "scheduler", [self._keys.scheduler], [op, *args], writes=op != "read"
            )
        )
        if reply[0] == "ERR":
            raise ValueError(f"scheduler.lua: {reply[2]}")
        return [str(field) for field in reply]

    async def _scheduler_op(self, op: str) -> Scheduler:
        epoch, paused, *_ = await self._scheduler_step(op)
        return Scheduler(epoch=int(epoch), claims_paused=paused == "1")

    async def get_scheduler(self) -> Scheduler:
        return await self._scheduler_op("read")

    async def bump_epoch(self) -> Scheduler:
        return await self._scheduler_op("bump")

    async def set_claims_paused(self, paused: bool) -> Scheduler:
        return await self._scheduler_op("pause" if paused else "resume")

    # --- one bucket of a Redis Cluster store: the scheduler copy and the freeze ---------------

    async def scheduler_copy(self, op: str, *args: int) -> tuple[Copy, Intent | None]:
        """One step of this bucket's scheduler copy (``ledger.scheduler_copies``; ``_COPY_STEPS``
        names the steps and their arguments), applied atomically by
        scheduler.lua, which mirrors the function each step is named after; answers the copy
        after it and the bump's intent it holds (bucket 0's; None where there is none).
        Every step is idempotent. On one Redis nothing calls it: ``get_scheduler``,
        ``bump_epoch`` and ``set_claims_paused`` are the one record's steps."""
        step = _COPY_STEPS.get(op)
        if step is None or len(args) != step[1] or not all(type(a) is int for a in args):
            raise ValueError(f"no scheduler copy step {op}{args!r}")
        return _copy_of(await self._scheduler_step(step[0], *args))

    async def freeze_bucket(self, why: str) -> None:
        """Freeze this bucket before its slot moves to another node: until ``thaw_bucket``,
        every task script refuses (StoreUnavailable, "nothing was applied") before it
        touches any key, since a key it did not declare may move under it (task_lib.lua,
        ``frozen_refusal``). The effect steps declare every key they touch and go on.
        ``why`` (not empty) is kept for an operator who finds a bucket frozen."""
        if not why:
            raise ValueError("say why the bucket is frozen")
        await self._scheduler_step("freeze", why)

    async def thaw_bucket(self) -> None:
        """End ``freeze_bucket``: once the slot is the new node's, on that node."""
        await self._scheduler_step("thaw")

    async def bucket_frozen(self) -> str | None:
        """Why this bucket is frozen (``freeze_bucket``), or None when it is not."""
        frozen = (await self._scheduler_step("read"))[7]
        return frozen or None

    # --- the idempotency ledger -------------------------------------------------------------

    async def check_fence(self, fence: Fence) -> Task:
        reply = await self._script(
            "fence",
            [self._keys.task(fence.task_id), self._keys.scheduler],
            [
                fence.attempt_id,
                fence.claim_generation,
                fence.scheduler_epoch,
                fence.cancel_generation,
                fence.principal or "",
            ],
        )
        try:
            return task_from_fields(_parse(reply)[1])
        except FencegateError as exc:
            raise await self._refusal(exc, task_id=fence.task_id) from None

    async def prepare_effect(
        self,
        request: EffectRequest,
        forward_deadline_ms: int,
        *,
        resend_window_ms: int | None = None,
        require_approval: bool = False,
    ) -> PrepareOutcome:
        fence = request.fence
        if fence is None:
            return await self._prepare_keyed(
                request, forward_deadline_ms, resend_window_ms, require_approval
            )
        revision = self._revisions.get((fence.task_id, fence.claim_generation))
        eid = (
            ""
            if revision is None
            else effects.effect_id(fence.task_id, revision, request.node, request.slot)
        )
        new = None
        if revision is not None and not require_approval:
            if not self._format_checked:
                await self._check_format()
            new = _new_forward(request, fence, revision, eid, forward_deadline_ms)
        feed_indexed = self._feed_indexed  # what this step is told, and what it then owes
        reply = await self._script(
            "prepare",
            [
                self._keys.task(fence.task_id),
                self._keys.scheduler,
                self._keys.effects(fence.task_id),
                self._keys.effects_index,
                self._keys.effect_tasks,
                *self._effect_indexes,
                self._keys.effect_ids,
                self._keys.effects_created,
            ],
            [
                fence.attempt_id,
                fence.claim_generation,
                fence.scheduler_epoch,
                fence.cancel_generation,
                request.node,
                request.slot,
                request.downstream,
                request.method,
                request.path,
                request.payload_digest,
                forward_deadline_ms,
                "" if resend_window_ms is None else resend_window_ms,
                "1" if require_approval else "0",
                request.forward_id or "",
                fence.principal or "",
                "" if revision is None else revision,
                eid,
                request.approval_digest or "",
                request.request_json or "",
                *(new.args if new is not None else ("", "")),
                "1" if feed_indexed else "",
            ],
        )
        if reply[0] == "NEW":
            assert new is not None
            if feed_indexed:  # at format 2 the step indexed it: no catch-up owed
                self._created_unindexed()
            outcome, raw = new.outcome(reply[1])
            return self._hold([outcome.action.value, raw], outcome)
        if reply[0] == "ERR":
            try:
                _parse(reply)  # raises
            except FencegateError as exc:
                raise await self._refusal(exc, task_id=fence.task_id) from None
        outcome = self._hold(reply, _prepared(reply))
        learnt = outcome.effect.revision
        if revision is None and learnt is not None:
            self._remember_revision(fence.task_id, fence.claim_generation, learnt)
        return outcome

    async def _prepare_keyed(
        self,
        request: EffectRequest,
        forward_deadline_ms: int,
        resend_window_ms: int | None,
        require_approval: bool,
    ) -> PrepareOutcome:
        """prepare_keyed.lua: a lease-less client's effect, found by its id alone (no task,
        no claim: none of the leased step's reads). An id whose effect expired answers the
        model's EFFECT_EXPIRED, from its tombstone read in the same step, until the
        tombstone's ``forget_at``; after that the key is new."""
        key, eid = request.client_key, request.effect_id
        assert key is not None and eid is not None and request.forward_id is not None
        reply = await self._script(
            "prepare_keyed",
            [
                self._keys.keyed_effect(eid),
                self._keys.effects_index,
                self._keys.effect_ids,
                *self._effect_indexes,
                *self._keyed_indexes,
                self._keys.effect_tombstone(eid),
            ],
            [
                eid,
                key.principal,
                key.key,
                request.downstream,
                request.method,
                request.path,
                request.payload_digest,
                forward_deadline_ms,
                "" if resend_window_ms is None else resend_window_ms,
                "1" if require_approval else "0",
                request.forward_id,
                request.approval_digest or "",
                request.request_json or "",
            ],
        )
        if reply[0] == "EXPIRED":
            raise expired_effect(_effect_tombstone(_pairs(reply[1:])))
        return self._hold(reply, _prepared(reply))

    async def catch_up_indexes(self) -> bool:
        """index_catch_up.lua until the creation indexes hold every effect waiting for them
        (at most ``_CATCH_UP_RUNS`` runs, each one short atomic step): what a reader of those
        indexes runs first, or on a miss. True when none waits any more."""
        return await catch_up_indexes(
            self._keys, lambda keys_, args: self._script("index_catch_up", keys_, args)
        )

    def _created_unindexed(self) -> None:
        """A lean prepare created an effect the creation indexes do not hold yet: catch up
        after ``_CATCH_UP_AFTER_EFFECTS`` of them or ``_CATCH_UP_AFTER_S``, so the indexes
        lag this gateway's prepares by no more (a reader catches up anyway; the bound is for
        older gateways, which do not, and for the size of a reader's catch-up)."""
        self._unindexed += 1
        self._schedule_catch_up()

    def _schedule_catch_up(self) -> None:
        if self._catch_up_run is not None or not self._unindexed or self._closing:
            return
        if self._unindexed >= _CATCH_UP_AFTER_EFFECTS:
            self._start_catch_up()
        elif self._catch_up_timer is None:
            loop = asyncio.get_running_loop()
            # In a context of its own: not a child of the request (its trace, its log fields)
            # whose prepare happened to start the timer.
            self._catch_up_timer = loop.call_later(
                _CATCH_UP_AFTER_S, self._start_catch_up, context=contextvars.Context()
            )

    def _start_catch_up(self) -> None:
        if self._catch_up_timer is not None:
            self._catch_up_timer.cancel()
            self._catch_up_timer = None
        if self._catch_up_run is None:
            self._unindexed = 0
            self._catch_up_run = asyncio.get_running_loop().create_task(
                self._background_catch_up(), context=contextvars.Context()
            )

    async def _background_catch_up(self) -> None:
        try:
            await self.catch_up_indexes()
        except (FencegateError, RedisError, OSError) as exc:
            # The next lean prepare (or reader) tries again; nothing is lost meanwhile.
            log.warning("store.index_catch_up_failed", store="redis", error=str(exc))
        finally:
            self._catch_up_run = None
            self._schedule_catch_up()

    def _hold(self, reply: Sequence[Any], outcome: PrepareOutcome) -> PrepareOutcome:
        """Keep a FORWARD's record as stored for its complete (``_held``)."""
        if outcome.action is Action.FORWARD:
            if len(self._held) >= _HELD_KEPT:
                self._held.clear()
            self._held[outcome.effect.effect_id] = (outcome.seq, reply[1])
        return outcome

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
        """complete.lua on the record's hash: the task's effects hash, or (``task_id`` None)
        the keyed effect's own, whose step also keeps the keyed indexes."""
        if task_id is None:
            keys_ = [
                self._keys.keyed_effect(effect_id),
                *self._effect_indexes,
                *self._keyed_indexes,
            ]
        else:
            keys_ = [self._keys.effects(task_id), *self._effect_indexes]
        held = self._held.pop(effect_id, None)
        step = None
        if held is not None:
            step = _completion(held, seq, attempt_id, outcome, reason, response_json or None)
        reply = await self._script(
            "complete",
            keys_,
            [
                effect_id,
                seq,
                attempt_id,
                outcome.value,
                reason,
                response_json or "",
                *(step.args if step is not None else ()),
            ],
        )
        status = reply[0]
        if status == "DONE":
            assert step is not None
            return step.effect(reply[1]), True
        if status == "ERR":
            try:
                _parse(reply)  # raises
            except FencegateError as exc:
                raise await self._refusal(exc, effect_id=effect_id) from None
        return _record(reply[1]), status == "OK"

    def _record_key(self, task_id: str | None, effect_id: str) -> str:
        """The hash holding an effect's record: its task's effects hash, or (``task_id``
        None) a keyed effect's own."""
        if task_id is None:
            return self._keys.keyed_effect(effect_id)
        return self._keys.effects(task_id)

    async def _read_effects(self, refs: Sequence[tuple[str | None, str]]) -> list[Effect | None]:
        """Records for (taskId, effectId) pairs (taskId None: a keyed effect) as of the
        store's now (effective view), in one round trip; None where a record is missing."""

        async def read() -> Any:
            async with self._redis.pipeline(transaction=False) as pipe:
                for task_id, effect_id in refs:
                    pipe.hget(self._record_key(task_id, effect_id), effect_id)
                pipe.time()
                return await pipe.execute()

        *raws, (sec, usec) = await self._call(read)
        now = self._store_time(sec, usec)
        return [
            None
            if raw is None
            else effects.effective(effects.effect_from_fields(json.loads(raw)), now)
            for raw in raws
        ]

    async def _task_of(self, effect_id: str) -> str | None:
        """The effect's task id, or None for a keyed effect (its record has its own key and
        no effectId -> taskId entry); one round trip, two more when the directory does not
        hold the id yet (``catch_up_indexes``). Refuses an effect that is neither."""

        async def read() -> Any:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hget(self._keys.effect_tasks, effect_id)
                pipe.exists(self._keys.keyed_effect(effect_id))
                return await pipe.execute()

        task_id, keyed = await self._call(read)
        if task_id is None and not keyed:
            caught_up = await self.catch_up_indexes()
            task_id, keyed = await self._call(read)
            if task_id is None and not keyed and not caught_up:
                raise behind_refusal()  # it may wait past what one catch-up adds
        if task_id is not None:
            return str(task_id)
        if not keyed:
            raise await self._refusal(NoSuchEffect(), effect_id=effect_id)
        return None

    async def get_effect(self, effect_id: str) -> Effect:
        task_id = await self._task_of(effect_id)
        (effect,) = await self._read_effects([(task_id, effect_id)])
        if effect is None:
            raise await self._refusal(NoSuchEffect(), effect_id=effect_id)
        return effect

    async def _index_old_effects(self) -> None:
        """Add the effects created before the effect ids index existed (an older fencegate)
        to it: one HSCAN of the effectId -> taskId hash, once per store (a marker key
        remembers). Effects created meanwhile are indexed by prepare.lua anyway; two gateways
        doing it at once is harmless (ZADD of the same members)."""

        async def page(cursor: Any) -> tuple[Any, list[Any]]:
            cursor, found = await self._call(
                functools.partial(self._redis.hscan, self._keys.effect_tasks, cursor, count=1000)
            )
            return cursor, list(found)

        if await self._backfill(page, self._keys.effect_ids, self._keys.effect_ids_indexed):
            log.info("store.effect_ids_indexed", store="redis")
        self._effect_ids_indexed = True

    async def find_effects(self, prefix: str, limit: int) -> list[str]:
        effect_prefix_bounds(prefix)  # refuses anything but lowercase hex
        if not self._effect_ids_indexed:
            await self._index_old_effects()
        await self.catch_up_indexes()
        reply = await self._script(
            "effect_prefix",
            [self._keys.effect_ids, self._keys.effect_tasks, self._keys.scheduler],
            [self._keys.prefix, prefix, limit],
        )
        if len(reply) == 3 and reply[0] == "ERR" and reply[1] == "FROZEN":
            raise StoreUnavailable(f"nothing was read; {reply[2]}: retry")
        return [str(effect_id) for effect_id in reply]

    async def list_effects(
        self,
        *,
        state: EffectState | None,
        task_id: str | None,
        downstream: str | None,
        limit: int,
        cursor: str | None,
        scan: int | None = None,
    ) -> tuple[list[Effect], str | None]:
        """``Store.list_effects``; ``scan``: the most index entries read (default
        ``_LIST_SCAN``; the cluster store gives each bucket a share of it)."""
        scan = _LIST_SCAN if scan is None else scan
        after = decode_cursor(cursor) if cursor else None

        def wanted(effect: Effect | None) -> bool:
            return (
                effect is not None
                and (state is None or effect.state is state)
                and (downstream is None or effect.downstream == downstream)
            )

        if task_id is not None:
            return await self._list_task_effects(task_id, after, wanted, limit)
        await self.catch_up_indexes()
        found: list[Effect] = []
        start = "-" if after is None else f"[{after[0]:015d}:{after[1]};"
        scanned = 0
        while scanned < scan:
            batch = min(_LIST_BATCH, scan - scanned)
            members: Any = await self._call(
                functools.partial(
                    self._redis.zrangebylex,
                    self._keys.effects_index,
                    start,
                    "+",
                    start=0,
                    num=batch,
                )
            )
            parts = [_index_member_parts(member) for member in members]
            records = await self._read_effects([(tid, eid) for _, eid, tid in parts])
            for (created, eid, _), effect in zip(parts, records, strict=True):
                scanned += 1
                if effect is not None and wanted(effect):
                    found.append(effect)
                    if len(found) == limit:
                        return found, encode_cursor(created, eid)
                start = f"[{created:015d}:{eid};"
            if len(members) < batch:
                return found, None
        created, eid, _ = parts[-1]
        return found, encode_cursor(created, eid)

    async def _list_task_effects(
        self,
        task_id: str,
        after: tuple[int, str] | None,
        wanted: Callable[[Effect | None], bool],
        limit: int,
    ) -> tuple[list[Effect], str | None]:
        ids: Any = await self._call(lambda: self._redis.hkeys(self._keys.effects(task_id)))
        records = [e for e in await self._read_effects([(task_id, i) for i in ids]) if wanted(e)]
        matching = sorted(
            (e for e in records if e is not None), key=lambda e: (e.created_at, e.effect_id)
        )
        if after is not None:
            matching = [e for e in matching if (e.created_at, e.effect_id) > after]
        page = matching[:limit]
        more = len(matching) > limit
        return page, encode_cursor(page[-1].created_at, page[-1].effect_id) if more else None

    async def unsettled_effects(
        self, limit: int, probe_downstreams: frozenset[str]
    ) -> list[Effect]:
        await self._script("probe_due_init", [self._keys.unknown, self._keys.probe_due], [])

        # Mirrors ledger.queries.unsettled_effects. The prepared index is scored by the
        # deadline, so "score <= now" is ledger.effects.is_overdue; the probe-due index is
        # scored by next_probe_at (0 for never probed): "score <= now" is part of
        # ledger.queries.is_probe_due, whose state and downstream tests come below.
        now = await self.now_ms()
        overdue: Any = await self._call(
            functools.partial(
                self._redis.zrangebyscore, self._keys.prepared, "-inf", now, start=0, num=limit
            )
        )
        found = await self._records(list(overdue))
        # UNKNOWN effects in the order they fall due; those of downstreams without a probe
        # wait for an operator and are parked, so they cannot crowd out the probe effects.
        # (Anything else found there is parked too, never removed: only the scripts that
        # change a record remove it from the index, so no race can drop a live entry.)
        wanted: list[Effect] = []
        for _ in range(4):
            ids: Any = await self._call(
                functools.partial(
                    self._redis.zrangebyscore, self._keys.probe_due, "-inf", now, start=0,
                    num=limit,
                )
            )  # fmt: skip
            if not ids:
                break
            records = await self._records(list(ids))
            by_id = {e.effect_id: e for e in records}
            park = [
                i for i in ids
                if i not in by_id
                or by_id[i].state is not EffectState.UNKNOWN
                or by_id[i].downstream not in probe_downstreams
            ]  # fmt: skip
            if park:
                await self._call(
                    functools.partial(
                        self._redis.zadd,
                        self._keys.probe_due,
                        dict.fromkeys(park, now + _PARK_MS),
                        xx=True,
                    )
                )
            wanted += [by_id[i] for i in ids if i not in park]
            if len(wanted) >= limit or len(ids) < limit:
                break
        seen = {e.effect_id for e in found}
        return found + [e for e in wanted[:limit] if e.effect_id not in seen]

    async def awaiting_approval(self, limit: int) -> list[Effect]:
        # The awaiting set (kept by effect_lib.lua's index_effect) is unordered: read it in
        # bounded SSCAN steps, then order the records. It holds what waits for a person, so
        # it stays small; past _AWAITING_READ ids the oldest of those read are shown.
        ids: list[str] = []
        cursor: Any = 0
        while True:
            cursor, page = await self._call(
                functools.partial(self._redis.sscan, self._keys.awaiting, cursor, count=500)
            )
            ids.extend(str(i) for i in page)
            if int(cursor) == 0 or len(ids) >= _AWAITING_READ:
                break
        found = [e for e in await self._records(ids) if effects.is_awaiting_approval(e)]
        found.sort(key=lambda e: (e.created_at, e.effect_id))
        return found[:limit]

    async def _records(self, effect_ids: list[str]) -> list[Effect]:
        """The current records of these effects (those that still exist): an id with no
        effectId -> taskId entry is looked for as a keyed effect."""
        if not effect_ids:
            return []
        task_ids: Any = await self._call(
            lambda: self._redis.hmget(self._keys.effect_tasks, effect_ids)
        )
        if None in task_ids:  # keyed, or created since the last catch-up
            # Refused (FROZEN: a cluster bucket whose slot moves): the work lists this serves
            # (the reconciler's, the approvals') go on without what waits, seen on their next
            # pass, instead of failing for every bucket.
            with contextlib.suppress(StoreUnavailable):
                await self.catch_up_indexes()
            task_ids = await self._call(
                lambda: self._redis.hmget(self._keys.effect_tasks, effect_ids)
            )
        refs = list(zip(task_ids, effect_ids, strict=True))
        return [e for e in await self._read_effects(refs) if e is not None]

    async def find_forward(self, task_id: str, forward_id: str) -> str | None:
        raws: Any = await self._call(lambda: self._redis.hvals(self._keys.effects(task_id)))
        records = (effects.effect_from_fields(json.loads(raw)) for raw in raws)
        return queries.find_forward(records, forward_id)

    async def gauges(self) -> Gauges:
        # gauges.lua mirrors ledger.queries.gauges. The keyed companions of the prepared and
        # unknown indexes hold exactly the keyed records since keyed effects exist (this
        # release): a store has no keyed record from before them, so nothing to backfill.
        keys_ = [
            self._keys.leases,
            self._keys.prepared,
            self._keys.unknown,
            self._keys.awaiting,
            self._keys.keyed_prepared,
            self._keys.keyed_unknown,
        ]
        active, prepared, unknown, awaiting, keyed = await self._script("gauges", keys_, [])
        return Gauges(int(active), int(prepared), int(unknown), int(awaiting), int(keyed))

    # --- retention (ledger.retention) --------------------------------------------------------

    async def _index_settled(self, *, again: bool = False) -> int:
        """Add the tasks settled before the settled index existed (an older fencegate) to it,
        once per store (the marker key ``settled_indexed`` remembers): settled_index.lua over
        the tasks index, a batch per run, each task's state read in the step that indexes it.
        The tasks index is completed first (its own one-time SCAN), so this needs no SCAN.
        Tasks that settle meanwhile are indexed by task_lib.lua anyway; two gateways doing it
        at once is harmless (ZADD NX)."""
        indexed: int = await self._call(lambda: self._redis.exists(self._keys.settled_indexed))
        if indexed and not again:
            self._settled_indexed = True
            return 0
        if not self._tasks_indexed:
            await self._index_old_tasks()
        after, added = "", 0
        while True:
            last, read, new = await self._task_script(
                "settled_index",
                [self._keys.tasks_index, self._keys.settled, self._keys.scheduler],
                [after, _SETTLED_BACKFILL_BATCH],
            )
            added += int(new)
            if int(read) < _SETTLED_BACKFILL_BATCH:
                break
            after = str(last)
        await self._call(lambda: self._redis.set(self._keys.settled_indexed, "1"))
        log.info("store.settled_indexed", store="redis", added=added)
        self._settled_indexed = True
        return added

    async def expire_settled(self, settled_ms: int, tombstone_ms: int, limit: int) -> ExpiryReport:
        """retention.lua: one bounded, atomic sweep step (its comments say what it does).

        Nothing expires while the keys are in an older format (until ``fencegate store
        migrate`` recorded this one): a gateway of that format may still be serving, and it
        neither indexes what it settles nor checks tombstones, so a PUT it receives for an
        expired task would create it again at revision 1. Re-read each sweep (one HGET), so
        running gateways start once the migration is done."""
        if not self._format_current:
            recorded, _ = await self._format()
            self._format_current = self._feed_indexed = recorded == FORMAT_VERSION
            if (recorded or 1) < _RETENTION_FORMAT:
                return ExpiryReport()
        if not self._settled_indexed:
            await self._index_settled()
        if not await self.catch_up_indexes():
            return ExpiryReport()  # a backlog too long for one sweep: the next goes on
        reply = await self._task_script(
            "retention",
            [
                self._keys.settled,
                self._keys.leases,
                self._keys.tasks_index,
                self._keys.effects_index,
                self._keys.effect_tasks,
                self._keys.prepared,
                self._keys.unknown,
                self._keys.awaiting,
                self._keys.probe_due,
                self._keys.task_tombstones,
                self._keys.effect_tombstones,
                self._keys.keyed_settled,
                self._keys.effect_ids,
                self._keys.scheduler,
            ],
            [settled_ms, tombstone_ms, limit],
        )
        examined, tasks, effects_, forgotten, *kept = reply
        return ExpiryReport(
            examined=int(examined),
            expired_tasks=int(tasks),
            expired_effects=int(effects_),
            kept={str(kept[i]): int(kept[i + 1]) for i in range(0, len(kept), 2)},
            forgotten=int(forgotten),
        )

    async def store_stats(self, settled_ms: int) -> StoreStats:
        """stats.lua (every count, at one instant of the store's clock, plus MEMORY USAGE of
        the store's global structures) and ``INFO memory`` in one auto-pipelined round trip.
        ``bytes`` is the whole Redis's ``used_memory``: every key prefix and database on it."""
        if not self._settled_indexed:
            await self._index_settled()
        await self.catch_up_indexes()
        detail = {
            "events": self._keys.events,
            "tasks:index": self._keys.tasks_index,
            "effects:index": self._keys.effects_index,
            "effects:task": self._keys.effect_tasks,
            "settled": self._keys.settled,
            "effects:keyed-settled": self._keys.keyed_settled,
            "tombstones:tasks": self._keys.task_tombstones,
            "tombstones:effects": self._keys.effect_tombstones,
        }
        counts_keys = [
            self._keys.tasks_index,
            self._keys.leases,
            self._keys.settled,
            self._keys.effects_index,
            self._keys.prepared,
            self._keys.unknown,
            self._keys.awaiting,
            self._keys.task_tombstones,
            self._keys.effect_tombstones,
            self._keys.events,
            *detail.values(),
        ]
        counts, memory = await asyncio.gather(
            self._script("stats", counts_keys, [settled_ms]),
            self._call(
                lambda: self._command(
                    functools.partial(self._redis.info, "memory"), "INFO", "memory"
                )
            ),
        )
        n = [int(x) for x in counts]
        used = memory.get("used_memory") if isinstance(memory, dict) else None
        return StoreStats(
            tasks=n[0],
            claimed_tasks=n[1],
            settled_tasks=n[2],
            due_tasks=n[3],
            effects=n[4],
            prepared_effects=n[5],
            unknown_effects=n[6],
            awaiting_approval=n[7],
            task_tombstones=n[8],
            effect_tombstones=n[9],
            events=n[10],
            bytes=int(used) if used is not None else None,
            bytes_detail={name: size for name, size in zip(detail, n[11:], strict=True) if size},
        )

    async def update_effect(self, effect_id: str, transition: EffectTransition) -> Effect:
        """Read, decide in Python, compare-and-set; a concurrent writer makes it read again."""
        key = self._record_key(await self._task_of(effect_id), effect_id)
        for _ in range(_CAS_ATTEMPTS):

            async def read() -> Any:
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.hget(key, effect_id)
                    pipe.time()
                    return await pipe.execute()

            raw, (sec, usec) = await self._call(read)
            now = self._store_time(sec, usec)
            current = None if raw is None else effects.effect_from_fields(json.loads(raw))
            try:
                updated = transition(current, now)
            except FencegateError as exc:  # NO_SUCH_EFFECT: it went (expired) since _task_of
                raise await self._refusal(exc, effect_id=effect_id) from None
            new_raw = json.dumps(effects.effect_to_fields(updated), separators=(",", ":"))
            args = [effect_id, raw or "", new_raw]
            cas_keys = [key, *self._effect_indexes, *self._keyed_indexes]
            written = await self._call(functools.partial(self._eval, "cas_effect", cas_keys, args))
            if written:
                return updated
        raise StoreUnavailable(
            f"effect {effect_id} kept changing under {_CAS_ATTEMPTS} attempts; try again"
        )


def _check_url(url: str) -> None:
    """The ``pipeline`` parameter; redis-py parses the rest (host, port, db, TLS) when the
    store is built. A ``redis+sentinel://`` URL is parsed here whole."""
    if url.lower().startswith(f"{SENTINEL_SCHEME}://"):
        parse_sentinel_url(url)
    else:
        split_pipeline_option(url)


def _create(url: str, policy: LeasePolicy, options: StoreOptions) -> Store:
    return RedisStore(
        url,
        policy,
        timeout_ms=options.timeout_ms,
        key_prefix=options.redis_key_prefix,
        password=options.password,
        max_connections=options.redis_max_connections,
        max_dependents=options.max_dependents,
        max_cascade=options.max_cascade,
        min_replicas=options.redis_min_replicas,
        replica_timeout_ms=options.redis_replica_timeout_ms,
    )


#: ``redis://host:port/db``, ``rediss://`` for TLS, ``unix:///path.sock`` (ledger.registry).
#: ``redis+sentinel://HOST1:PORT1,HOST2:PORT2/MASTER_NAME/DB`` (``parse_sentinel_url``).
STORE_KIND = StoreKind(
    schemes=("redis", "rediss", "unix", SENTINEL_SCHEME),
    example=f"redis://HOST:PORT/DB or {SENTINEL_FORM}",
    check_url=_check_url,
    create=_create,
)
