"""Where a key lives on the Redis Cluster store: a fixed number of buckets, one hash slot each.

A script on a cluster may touch keys of one hash slot only. Tagging each task's keys with its
own id (as on one Redis) would spread tasks over all 16,384 slots, and every store-wide index,
stream and the scheduler record would then need a copy in every slot. So the cluster store
places keys by **bucket** (docs/decisions.md, "Issue 30: Redis Cluster, the design"): a fixed
number of buckets (``[store] cluster_buckets``, recorded in the store's meta when it is
created), each with its own hash tag ``{<prefix>.b<n>}`` and so exactly one slot. A bucket
holds its tasks' keys, their effects and its own copy of every store-wide index; a slot
migration moves a bucket whole.

Which bucket is computed from what every request carries (the task id, or a keyed effect's
id), never looked up, so no directory is read before a step:

- a task's bucket is CRC16 of its **group** modulo the bucket count, the group being its id up
  to the first ``::`` (``order-17::charge`` and ``order-17::email`` share a bucket, so one may
  depend on the other: ``ledger.task_graph.check_same_group``);
- a keyed effect (no task) is placed by its own id.

The CRC is Redis Cluster's own (CRC16-XMODEM, ``binascii.crc_hqx(data, 0)``), so the bucket
spread is as even as the slot spread, and ``slot_of`` tells which slot a bucket's tag maps to.

No I/O here: ids in, numbers and tags out. The Lua scripts never compute a bucket (the gateway
names the keys), so there is nothing to mirror.
"""

from __future__ import annotations

from binascii import crc_hqx

__all__ = [
    "CLUSTER_SLOTS",
    "GROUP_SEPARATOR",
    "MAX_BUCKETS",
    "bucket_of_keyed",
    "bucket_of_queue",
    "bucket_of_task",
    "bucket_tag",
    "check_buckets",
    "slot_of",
    "task_group",
]

#: Redis Cluster's key space: a key's slot is CRC16 of its hash tag modulo this.
CLUSTER_SLOTS = 16_384
#: More buckets than slots would put two buckets in one slot for nothing.
MAX_BUCKETS = CLUSTER_SLOTS
#: What ends a task id's group. Not ``/`` or ``:`` alone: ids like ``reports/2026-12-01`` are
#: common, and grouping by them would make one hot bucket of a whole namespace; ``::`` is
#: opt-in.
GROUP_SEPARATOR = "::"


def _crc16(text: str) -> int:
    """CRC16-XMODEM of the UTF-8 bytes: the CRC Redis Cluster computes a slot with."""
    return crc_hqx(text.encode(), 0)


def check_buckets(buckets: int) -> int:
    """``buckets`` if it is a valid bucket count (1 to 16,384), else a ValueError naming the
    setting: the count is chosen once, when the store is created, and a wrong one must stop
    the gateway at start-up, not place keys somewhere later."""
    if isinstance(buckets, bool) or not isinstance(buckets, int):
        raise ValueError(f"store.cluster_buckets must be an integer, got {type(buckets).__name__}")
    if not 1 <= buckets <= MAX_BUCKETS:
        raise ValueError(
            f"store.cluster_buckets must be between 1 and {MAX_BUCKETS} "
            f"(one hash slot per bucket), got {buckets}"
        )
    return buckets


def task_group(task_id: str) -> str:
    """The task's group: its id up to the first ``::``, the whole id when it has none.

    Tasks of one group share a bucket, so a step can touch all of them atomically (a
    dependency's commit releasing its dependent, a cancel's cascade). An id starting with
    ``::`` has the empty group, which is a group like any other."""
    group, sep, _ = task_id.partition(GROUP_SEPARATOR)
    return group if sep else task_id


def bucket_of_task(task_id: str, buckets: int) -> int:
    """The bucket of a task (and of its effects): CRC16 of its group modulo ``buckets``."""
    return _crc16(task_group(task_id)) % check_buckets(buckets)


def bucket_of_keyed(effect_id: str, buckets: int) -> int:
    """The bucket of a keyed effect, which has no task: CRC16 of its effect id (its own hash
    tag, ``ledger.effects.keyed_effect_id``) modulo ``buckets``. Every request for it carries
    the key it is derived from, so the bucket is known before the step."""
    return _crc16(effect_id) % check_buckets(buckets)


def bucket_of_queue(queue: str, buckets: int) -> int:
    """The bucket holding a queue's hint (``Keys.queue_buckets``): CRC16 of the queue name
    modulo ``buckets``, so every gateway finds it without a directory, and the hints of
    many queues spread over the primaries."""
    return _crc16(queue) % check_buckets(buckets)


def bucket_tag(prefix: str, n: int) -> str:
    """The hash tag of bucket ``n``: ``<prefix>.b<n>``. Every key of the bucket carries it in
    braces (``{fg.b17}``), so all of them are in one slot; the prefix in the tag keeps two
    stores sharing a cluster from piling their bucket ``n`` into one slot."""
    if n < 0:
        raise ValueError(f"a bucket number is not negative, got {n}")
    return f"{prefix}.b{n}"


def slot_of(tag: str) -> int:
    """The cluster slot of every key carrying ``{tag}``: CRC16 of the tag modulo 16,384, as
    Redis Cluster computes it (``redis.crc.key_slot`` agrees: ``tests/test_buckets.py``)."""
    return _crc16(tag) % CLUSTER_SLOTS
