"""Every Redis key fencegate writes, in one place.

A task's keys carry its id as the hash tag (``{taskId}``) so one script can touch all of them
on one slot. Task ids cannot contain braces (the id grammar forbids them), so the tag is
exactly the id.

The Lua scripts get the same layout rendered from this module (``lua_key_helpers``), never a
copy: ``tests/test_lua_keys.py`` fails on a key the Lua lacks or builds by hand.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

__all__ = ["NOT_KEYS", "Keys", "key_names", "lua_key_helpers"]


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "fg"

    def task(self, task_id: str) -> str:
        return f"{self.prefix}:{{{task_id}}}:task"

    def dependents(self, task_id: str) -> str:
        """Set of the ids of the tasks whose ``depends_on`` names this one (put.lua keeps it;
        commit.lua and cancel.lua follow it)."""
        return f"{self.prefix}:{{{task_id}}}:dependents"

    def queue_ready(self, queue: str) -> str:
        """Sorted set (all scores 0) of the queue's READY tasks (and of CLAIMED ones that
        ``claim_next.lua`` found claimable), as ``%07d(1_000_000 - priority):%015d(readyAt):
        taskId``: lexical order is ``ledger.tasks.queue_order``. Queue names cannot contain
        braces (the API's grammar), so the three keys of a queue share the tag ``{queue}``."""
        return f"{self.prefix}:queue:{{{queue}}}:ready"

    def queue_held(self, queue: str) -> str:
        """Sorted set: the queue's CLAIMED task ids scored by leaseExpiresAt."""
        return f"{self.prefix}:queue:{{{queue}}}:held"

    def queue_epochs(self, queue: str) -> str:
        """Sorted set: the queue's CLAIMED task ids scored by the epoch of their claim."""
        return f"{self.prefix}:queue:{{{queue}}}:epochs"

    def queue_buckets(self, queue: str) -> str:
        """Hash, on a Redis Cluster only: the queue's *hint*, the buckets that may hold its
        claimable tasks (field: the bucket number, value ``1``) and ``scanned_at`` (store ms
        of the last full rescan). Kept in one bucket, the queue's own (``buckets.
        bucket_of_queue``), by ``ClusterStore`` (docs/decisions.md, "Queues: an index per
        bucket, a hint per queue"); a queue claim reads only the buckets it names. Expires
        ``HINT_TTL_MS`` after its last write (a missing hint is rebuilt)."""
        return f"{self.prefix}:queue:{{{queue}}}:buckets"

    @property
    def queue_owed(self) -> str:
        """Set, on a Redis Cluster bucket only: the queues a step made a task READY in since
        ``ClusterStore`` last put this bucket in their hints (``queue_buckets``).
        ``task_lib.lua``'s ``queue_add`` adds to it in the step; the store empties it after."""
        return f"{self.prefix}:queue:owed"

    @property
    def events(self) -> str:
        """Stream: the change feed (``ledger.events``), one entry (field ``e``: the event's
        JSON) per change of a task's state or revision and of an effect's state."""
        return f"{self.prefix}:events"

    def effects(self, task_id: str) -> str:
        """Hash: effectId -> the effect record (cjson-encoded flat fields)."""
        return f"{self.prefix}:{{{task_id}}}:effects"

    @property
    def scheduler(self) -> str:
        return f"{self.prefix}:scheduler"

    def keyed_effect(self, effect_id: str) -> str:
        """Hash: a keyed effect's record (a lease-less client's, ``effects.Effect.kind``
        ``keyed``), as ``effects`` holds a leased one: one field, effectId -> the record.
        One key per effect under its own hash tag (the effect id, 64 lowercase hex), so a
        keyed effect touches no task's keys; the ``:keyed-effect`` suffix keeps it apart
        from the keys of a task whose id happens to be the same hex string."""
        return f"{self.prefix}:{{{effect_id}}}:keyed-effect"

    @property
    def effects_index(self) -> str:
        """Sorted set (all scores 0) of ``<createdAt:%015d>:<effectId>:<taskId>``: lexical
        order is creation order, and a member names the record's key (a keyed effect's
        member ends in an empty task id: its record is ``keyed_effect``)."""
        return f"{self.prefix}:effects:index"

    @property
    def keyed_settled(self) -> str:
        """Sorted set: the id of every keyed effect ``effects.keyed_settled`` admits, scored
        by the ``updated_at`` at which it entered (``effect_lib.lua``'s ``index_effect``
        keeps it wherever a record is written); ``retention.lua`` reads the due ones, deletes
        those ``retention.why_kept_keyed`` lets go and moves the others to the back."""
        return f"{self.prefix}:effects:keyed-settled"

    @property
    def keyed_prepared(self) -> str:
        """Sorted set: the keyed effects of ``prepared`` (the same members' subset, scored by
        the deadline too), so ``gauges.lua`` counts the keyed UNKNOWN ones (an overdue
        PREPARED reads UNKNOWN) without reading a record. ``index_effect`` keeps it, and only
        for keyed records: the leased scripts never receive it."""
        return f"{self.prefix}:effects:keyed-prepared"

    @property
    def keyed_unknown(self) -> str:
        """Set: the keyed effects of ``unknown`` (as ``keyed_prepared``)."""
        return f"{self.prefix}:effects:keyed-unknown"

    @property
    def tasks_index(self) -> str:
        """Sorted set (all scores 0) of every task id: lexical order is task id order, so
        ``GET /v1/tasks`` pages with ZRANGEBYLEX. ``put.lua`` adds a task as it creates it."""
        return f"{self.prefix}:tasks:index"

    @property
    def tasks_indexed(self) -> str:
        """Set once every task created before the index existed has been added to it."""
        return f"{self.prefix}:tasks:indexed"

    def task_pattern(self) -> str:
        """SCAN pattern of every task hash (the prefix's glob characters escaped)."""
        escaped = "".join(f"\\{c}" if c in "*?[]\\" else c for c in self.prefix)
        return f"{escaped}:{{*}}:task"

    def task_id_of(self, key: str) -> str | None:
        """The task id of a task hash key (``task_pattern``'s matches), else None."""
        head, tail = f"{self.prefix}:{{", "}:task"
        if key.startswith(head) and key.endswith(tail) and len(key) > len(head) + len(tail):
            return key[len(head) : -len(tail)]
        return None

    def write_mark(self, gateway: str) -> str:
        """String: one gateway process's write mark, INCR'd after the writes of every batch
        it sends (``RedisStore``). Only that gateway writes it, so on one Redis it only
        grows: a reply at or below one it saw before sending means its acknowledged writes
        were lost. One small key per gateway start. ``meta`` ``regressed`` is the store-wide
        flag a gateway raises then (``fencegate failover ack`` takes it down)."""
        return f"{self.prefix}:write-mark:{gateway}"

    @property
    def meta(self) -> str:
        """Hash: ``format``, the format of everything written under this prefix
        (``redis_store.FORMAT_VERSION``); absent on a store written before formats were
        recorded (format 1)."""
        return f"{self.prefix}:meta"

    @property
    def settled(self) -> str:
        """Sorted set: the id of every COMMITTED or CANCELLED task scored by ``due_at``, when
        it settled (``ledger.retention``). ``task_lib.lua`` keeps it wherever a task's state
        is written; ``retention.lua`` reads the oldest few (never the whole store) and moves
        a task still needed to the back (score = now)."""
        return f"{self.prefix}:settled"

    @property
    def settled_indexed(self) -> str:
        """Set once every task settled before the settled index existed has been added to
        it (``RedisStore._index_settled``)."""
        return f"{self.prefix}:settled:indexed"

    def tombstone(self, task_id: str) -> str:
        """Hash: what is remembered of an expired task (every field of
        ``ledger.tasks.Tombstone``, named as its attributes). Under the task's hash tag, as
        its other keys. Redis expires it ``tombstone_ms`` after it was written (``forget_at``
        on the production clock; readers compare ``forget_at`` with the store's now, so
        Redis's expiry only frees the memory). Until then ``put.lua`` reads it (the same
        input is refused, a new one continues the numbers) and every refusal of a missing
        task becomes TASK_EXPIRED."""
        return f"{self.prefix}:{{{task_id}}}:tombstone"

    def effect_tombstone(self, effect_id: str) -> str:
        """Hash: what is remembered of an expired effect (every field of
        ``ledger.retention.EffectTombstone``; a keyed effect's ``task_id`` is empty, which
        a gateway of an older fencegate still reads); expires as ``tombstone`` does. Until
        then a refusal of a missing effect becomes EFFECT_EXPIRED, and a keyed prepare of
        its id answers that refusal (``prepare_keyed.lua``)."""
        return f"{self.prefix}:effect-tombstone:{effect_id}"

    @property
    def task_tombstones(self) -> str:
        """Sorted set: the task ids with a tombstone, scored by ``forget_at``, so that
        tombstones are counted (``store_stats``) and forgotten (the sweep drops the entries,
        and their keys, with score <= now) without a scan."""
        return f"{self.prefix}:tombstones:tasks"

    @property
    def effect_tombstones(self) -> str:
        """Sorted set: the effect ids with a tombstone, scored by ``forget_at`` (as
        ``task_tombstones``)."""
        return f"{self.prefix}:tombstones:effects"

    @property
    def cascades(self) -> str:
        """Set of cancelled task ids whose dependents a cascade has still to visit
        (``task_lib.lua``'s CASCADES; ``continue_cascades``)."""
        return f"{self.prefix}:cascades"

    @property
    def leases(self) -> str:
        """Sorted set: taskId scored by leaseExpiresAt, for every CLAIMED task."""
        return f"{self.prefix}:leases"

    @property
    def prepared(self) -> str:
        """Sorted set: effectId scored by its deadline, for every PREPARED effect."""
        return f"{self.prefix}:effects:prepared"

    @property
    def unknown(self) -> str:
        """Set of UNKNOWN effectIds."""
        return f"{self.prefix}:effects:unknown"

    @property
    def probe_due(self) -> str:
        """Sorted set: every UNKNOWN effectId scored by when it is next due for a probe (its
        ``next_probe_at``, 0 for never probed). The reconciler takes the due ones in that
        order and parks those of downstreams without a probe, so none starves another."""
        return f"{self.prefix}:effects:probe-due"

    @property
    def awaiting(self) -> str:
        """Set of effectIds waiting for an operator's approval."""
        return f"{self.prefix}:effects:awaiting"

    @property
    def effect_tasks(self) -> str:
        """Hash: effectId -> taskId, to find a leased record from its id alone (a keyed
        effect has no entry: its id names its key, ``keyed_effect``)."""
        return f"{self.prefix}:effects:task"

    @property
    def effect_ids(self) -> str:
        """Sorted set (all scores 0) of every live effectId: lexical order is id order, so
        an id prefix is one ZRANGEBYLEX (``effect_prefix.lua``). ``prepare.lua`` adds an
        effect as it creates it, ``retention.lua`` removes it with the record."""
        return f"{self.prefix}:effects:ids"

    @property
    def effects_created(self) -> str:
        """List: the creation-index entries (``effects_index`` members,
        ``<createdAt>:<effectId>:<taskId>``) of the effects ``prepare.lua``'s lean path
        created and ``index_catch_up.lua`` has not yet added to ``effects_index``,
        ``effect_tasks`` and ``effect_ids`` (it pops them as it adds them)."""
        return f"{self.prefix}:effects:created"

    @property
    def effect_ids_indexed(self) -> str:
        """Set once every effect created before ``effect_ids`` existed has been added."""
        return f"{self.prefix}:effects:ids:indexed"


#: Members of ``Keys`` that build no key: the prefix itself, a SCAN pattern and its parser.
NOT_KEYS = frozenset({"prefix", "task_pattern", "task_id_of"})
#: Stand-ins for the prefix and the argument while a key's layout is read off its method.
_PREFIX_MARK = "\x00prefix\x00"
_ARG_MARK = "\x00arg\x00"


def key_names() -> list[str]:
    """Every key of ``Keys``, in definition order: its public methods (a key of one id) and
    properties (one fixed key), ``NOT_KEYS`` aside."""
    return [
        name
        for name, member in vars(Keys).items()
        if not name.startswith("_")
        and name not in NOT_KEYS
        and (isinstance(member, property) or callable(member))
    ]


def _lua_concat(template: str) -> str:
    """A key read off ``Keys`` with the stand-ins, as a Lua expression of ``P`` and ``id``."""
    parts: list[str] = []
    for piece in re.split(f"({_PREFIX_MARK}|{_ARG_MARK})", template):
        if piece == _PREFIX_MARK:
            parts.append("P")
        elif piece == _ARG_MARK:
            parts.append("id")
        elif piece:
            if not piece.isprintable():
                raise ValueError(f"a key's literal part is not printable: {piece!r}")
            parts.append("'" + piece.replace("\\", "\\\\").replace("'", "\\'") + "'")
    if not template.startswith(_PREFIX_MARK):
        raise ValueError(f"every key starts with the prefix: {template!r}")
    return " .. ".join(parts)


@functools.cache
def lua_key_helpers() -> str:
    """The key layout for the Lua scripts, rendered from this module: the scripts that build
    keys of tasks they were not given in KEYS (``task_lib.lua`` and the scripts it serves)
    get it before ``task_lib.lua`` (``redis_store.load_script_source``), so no Lua file
    retypes a key and a change here reaches Lua with the next script load.

    ``P`` is the key prefix (ARGV[2] of those scripts); ``K.<name>(id)`` is ``Keys.<name>``
    for a key of one id, ``K.<name>`` the fixed key of a property."""
    keys = Keys(prefix=_PREFIX_MARK)
    lines = [
        "-- The key layout, rendered from ledger/keys.py at script load "
        "(ledger.keys.lua_key_helpers).",
        "local P = ARGV[2]",
        "local K = {}",
    ]
    for name in key_names():
        if isinstance(vars(Keys)[name], property):
            lines.append(f"K.{name} = {_lua_concat(getattr(keys, name))}")
        else:
            key = _lua_concat(getattr(keys, name)(_ARG_MARK))
            lines.append(f"function K.{name}(id) return {key} end")
    return "\n".join(lines) + "\n"
