"""``ledger.buckets``: which bucket (so which cluster slot) a task or a keyed effect lives in."""

from __future__ import annotations

from collections import Counter

import pytest
from redis.crc import key_slot

from fencegate.ledger import buckets
from fencegate.ledger.effects import keyed_effect_id


@pytest.mark.parametrize(
    ("task_id", "group"),
    [
        ("order-17::charge", "order-17"),
        ("order-17::email::retry", "order-17"),  # up to the *first* separator
        ("reports/2026-12-01", "reports/2026-12-01"),  # "/" does not group
        ("ns:job:7", "ns:job:7"),  # nor does a single ":"
        ("plain", "plain"),
        ("::orphan", ""),  # the empty group is a group like any other
    ],
)
def test_a_task_group_is_its_id_up_to_the_first_double_colon(task_id: str, group: str) -> None:
    assert buckets.task_group(task_id) == group


def test_tasks_of_one_group_share_a_bucket() -> None:
    for count in (1, 7, 256, 16_384):
        assert buckets.bucket_of_task("order-17::charge", count) == buckets.bucket_of_task(
            "order-17::email", count
        )
        assert buckets.bucket_of_task("order-17::charge", count) == buckets.bucket_of_task(
            "order-17", count
        )


def test_the_bucket_is_redis_clusters_crc16_of_the_group() -> None:
    # CRC16-XMODEM: Redis Cluster's own (the cluster spec's test vector: "123456789" -> 0x31C3).
    assert buckets.bucket_of_task("123456789::x", 16_384) == 0x31C3 % 16_384
    # So with 16,384 buckets a task's bucket is the slot Redis would give its group as a key.
    for task_id in ("order-17::charge", "reports/2026-12-01", "αβγ::unicode"):
        group = buckets.task_group(task_id).encode()
        assert buckets.bucket_of_task(task_id, 16_384) == key_slot(group)


def test_a_keyed_effect_is_placed_by_its_own_id() -> None:
    effect_id = keyed_effect_id("alice", "payments", "key-1")
    assert buckets.bucket_of_keyed(effect_id, 16_384) == key_slot(effect_id.encode())
    assert 0 <= buckets.bucket_of_keyed(effect_id, 256) < 256


def test_a_bucket_tag_is_prefix_dot_b_n_and_all_its_keys_share_one_slot() -> None:
    tag = buckets.bucket_tag("fg", 17)
    assert tag == "fg.b17"
    slot = buckets.slot_of(tag)
    # What redis-py computes for keys carrying the tag (the cluster client routes by it).
    for key in (f"fg:{{{tag}}}:task:order-17::charge", f"fg:{{{tag}}}:leases", f"{{{tag}}}"):
        assert key_slot(key.encode()) == slot


def test_two_stores_on_one_cluster_do_not_share_bucket_slots_by_construction() -> None:
    # Not a guarantee for every pair (slots collide), but the prefix is part of the tag.
    assert buckets.bucket_tag("fg", 0) != buckets.bucket_tag("other", 0)


def test_256_buckets_spread_evenly_over_slots() -> None:
    slots = {buckets.slot_of(buckets.bucket_tag("fg", n)) for n in range(256)}
    assert len(slots) >= 250  # a handful of CRC collisions at most, never a pile-up


def test_groups_spread_evenly_over_buckets() -> None:
    counts = Counter(buckets.bucket_of_task(f"order-{n}::step", 64) for n in range(64_000))
    assert len(counts) == 64
    assert max(counts.values()) < 1.2 * 1_000  # each bucket within 20 % of the mean


@pytest.mark.parametrize("bad", [0, -1, 16_385, 10**9])
def test_a_bucket_count_out_of_range_names_the_setting(bad: int) -> None:
    with pytest.raises(ValueError, match=r"store\.cluster_buckets must be between 1 and 16384"):
        buckets.check_buckets(bad)
    with pytest.raises(ValueError, match=r"store\.cluster_buckets"):
        buckets.bucket_of_task("t", bad)
    with pytest.raises(ValueError, match=r"store\.cluster_buckets"):
        buckets.bucket_of_keyed("e", bad)


@pytest.mark.parametrize("bad", [True, 2.0, "256"])
def test_a_bucket_count_that_is_not_an_integer_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match=r"store\.cluster_buckets must be an integer"):
        buckets.check_buckets(bad)  # type: ignore[arg-type]


def test_the_bounds_are_accepted() -> None:
    assert buckets.check_buckets(1) == 1
    assert buckets.check_buckets(16_384) == 16_384
    assert buckets.bucket_of_task("anything", 1) == 0


def test_a_negative_bucket_has_no_tag() -> None:
    with pytest.raises(ValueError, match="not negative"):
        buckets.bucket_tag("fg", -1)
