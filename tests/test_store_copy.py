"""``fencegate store copy``: a drained single Redis store moved into a Redis Cluster's buckets.

A real source redis-server and the real cluster (``redis_cluster``). The store is written
through ``RedisStore`` (queued tasks, a dependency in one group, committed tasks with effects,
a keyed effect, an expired task's tombstones, paused claims at epoch 3), copied by the
command line in a subprocess, and then checked on the cluster: every key is in its bucket's
slot and in the bucket its task (or effect) belongs to; every key of the source is there,
whole or split by member, with the same contents; and bucket views (``RedisStore`` under
``P:{P.b<n>}`` through ``RoutedRedis``) read back what the source store answers. A second run
copies nothing; a store that is not drained is refused with what holds it, and nothing is
written. A task CLAIMED past its lease (the workers died, the gateways were stopped) is
copied as it is, and on the cluster store a claim takes it over while its old attempt is
refused, as on the source.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fencegate.gateway.config import Config
from fencegate.ledger import cluster_store, keys, registry
from fencegate.ledger.buckets import bucket_of_keyed, bucket_of_task, bucket_tag, slot_of
from fencegate.ledger.cluster_copy import (
    BUCKETS_FIELD,
    PLACEMENT,
    Layout,
    Place,
    classify,
    scan_pattern,
)
from fencegate.ledger.cluster_router import CLUSTER_SCHEMES, ClusterRouter
from fencegate.ledger.effects import (
    Action,
    ClientKey,
    EffectRequest,
    EffectState,
    Fence,
    keyed_effect_id,
)
from fencegate.ledger.errors import EffectExpired, Fenced, LeaseExpired, TaskExpired
from fencegate.ledger.queries import TaskFilter
from fencegate.ledger.redis_store import RedisStore
from fencegate.ledger.tasks import (
    ClaimRequest,
    CommitRequest,
    Identity,
    LeasePolicy,
    RenewRequest,
    Scheduler,
    Task,
    TaskState,
)
from tests.cluster_servers import ClusterServers
from tests.conftest import STORE_TIMEOUT_MS
from tests.servers import RedisServer

POLICY = LeasePolicy(max_ttl_ms=600_000, default_max_runtime_ms=6_000_000)
SETTLED_MS = 60_000
TOMBSTONE_MS = 3_600_000
#: Few enough that buckets are shared by several tasks, enough that they spread.
BUCKETS = 16


# --- the pure part ------------------------------------------------------------------------


def test_every_key_of_the_layout_has_a_placement() -> None:
    """A key added to ``ledger/keys.py`` needs a decision here before a copy runs."""
    assert set(PLACEMENT) == set(keys.key_names())


@pytest.mark.parametrize("name", keys.key_names())
def test_every_key_is_recognised_and_lands_in_its_bucket(name: str) -> None:
    prefix, layout = "f*g", Layout("f*g", BUCKETS)
    source = keys.Keys(prefix)
    member = vars(keys.Keys)[name]
    arg = None if isinstance(member, property) else "order-17::charge"
    key = getattr(source, name) if arg is None else getattr(source, name)(arg)
    found = classify(key, prefix)
    assert found is not None and (found.name, found.arg) == (name, arg)
    for n in range(BUCKETS):
        target = layout.target(found, n)
        assert target.startswith(f"{prefix}:{{{bucket_tag(prefix, n)}}}:")
        assert slot_of(bucket_tag(prefix, n)) == ClusterRouter.slot_of(target)
    assert classify(key.replace(prefix, "other", 1), prefix) is None


def test_the_copy_and_the_cluster_store_agree_on_the_layout() -> None:
    layout = Layout("fg", BUCKETS)
    assert layout.bucket_prefix(7) == cluster_store.bucket_prefix("fg", 7)
    assert BUCKETS_FIELD == cluster_store._BUCKETS_FIELD
    assert scan_pattern("a*b") == "a\\*b:*"


def test_the_cluster_schemes_are_registered_and_the_bucket_count_checked() -> None:
    assert set(CLUSTER_SCHEMES) <= set(registry.schemes())
    config = Config.model_validate(
        {"store": {"url": "redis+cluster://127.0.0.1:7000,127.0.0.1:7001", "cluster_buckets": 64}}
    )
    assert config.store.cluster_buckets == 64
    assert Config.model_validate({}).store.cluster_buckets == 256
    for wrong in (0, 16_385):
        with pytest.raises(ValueError, match=r"store\.cluster_buckets must be between 1 and"):
            Config.model_validate({"store": {"cluster_buckets": wrong}})
    with pytest.raises(ValueError, match="password in the redis\\+cluster url is refused"):
        Config.model_validate({"store": {"url": "redis+cluster://u:secret@127.0.0.1:7000"}})


# --- the source store ----------------------------------------------------------------------


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def source(redis_server: RedisServer, prefix: str) -> AsyncIterator[RedisStore]:
    store = RedisStore(redis_server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS, key_prefix=prefix)
    await store.open()
    yield store
    await store.close()


def _fence(task: Task) -> Fence:
    assert task.attempt_id is not None
    return Fence(task.task_id, task.attempt_id, task.claim_generation, 1, task.cancel_generation)


async def _settled(store: RedisStore, task_id: str, effects: int, queue: str) -> list[str]:
    """A task committed with ``effects`` COMMITTED effects; their ids."""
    await store.put_task(task_id, f"in-{task_id}", None, queue=queue)
    task = await store.claim(task_id, ClaimRequest("w", 60_000, 1))
    ids = []
    for i in range(effects):
        request = EffectRequest(_fence(task), "node", f"s{i}", "pay", "POST", "/pay", "d" * 64)
        outcome = await store.prepare_effect(request, 30_000)
        assert outcome.action is Action.FORWARD and task.attempt_id is not None
        await store.complete_effect(
            task_id, outcome.effect.effect_id, outcome.seq, task.attempt_id, EffectState.COMMITTED,
            "200", None,
        )  # fmt: skip
        ids.append(outcome.effect.effect_id)
    assert task.attempt_id is not None
    commit = CommitRequest(
        task.attempt_id, task.claim_generation, 1, task.cancel_generation, task.input_digest,
        "r" * 64,
    )  # fmt: skip
    await store.commit(task_id, commit)
    return ids


def _keyed(key: str) -> EffectRequest:
    return EffectRequest(
        None, "", "", "pay", "POST", "/charges", "d1", forward_id=uuid.uuid4().hex,
        client_key=ClientKey("agent", key),
    )  # fmt: skip


class Written:
    """What ``_write_store`` put in the source, to look for on the cluster."""

    def __init__(self) -> None:
        self.tasks: list[str] = []
        self.effects: list[str] = []
        self.keyed: list[str] = []
        self.expired_task = ""
        self.expired_effects: list[str] = []


async def _write_store(store: RedisStore) -> Written:
    written = Written()
    # An expired task: its tombstone, its effect's tombstone, their indexes.
    written.expired_effects = await _settled(store, "old-report", 1, "reports")
    written.expired_task = "old-report"
    store.clock_offset_ms = SETTLED_MS
    report = await store.expire_settled(SETTLED_MS, TOMBSTONE_MS, 100)
    assert report.expired_tasks == 1
    # Committed tasks with effects (in the settled index, the effect directories).
    for task_id, count in (("invoice-3", 2), ("invoice-4", 1), ("order-9::charge", 1)):
        written.effects += await _settled(store, task_id, count, "billing")
        written.tasks.append(task_id)
    # Tasks in queues, and a dependency inside one group (the dependent WAITING).
    await store.put_task("order-1::charge", "in-a", None, queue="payments", priority=5)
    await store.put_task("report-7", "in-b", None, queue="payments")
    await store.put_task("mail-2", "in-c", None, queue="mail")
    await store.put_task(
        "order-1::email", "in-d", None, queue="mail", depends_on=("order-1::charge",)
    )
    written.tasks += ["order-1::charge", "report-7", "mail-2", "order-1::email"]
    # A keyed effect, completed.
    prepared = await store.prepare_effect(_keyed("k-1"), 30_000)
    assert prepared.action is Action.FORWARD
    attempt = prepared.effect.attempts[-1]
    await store.complete_effect(
        None, prepared.effect.effect_id, prepared.seq, attempt.attempt_id, EffectState.COMMITTED,
        "201", '{"status":201,"headers":[],"body":"paid"}',
    )  # fmt: skip
    written.keyed.append(prepared.effect.effect_id)
    assert prepared.effect.effect_id == keyed_effect_id("agent", "pay", "k-1")
    await store.list_tasks(TaskFilter(), 100, None)  # the index's flag, as a gateway leaves it
    # Claims paused, then the epoch bumped to 3 (the runbook: pause, let the store drain).
    await store.set_claims_paused(True)
    await store.bump_epoch()
    assert await store.bump_epoch() == Scheduler(epoch=3, claims_paused=True)
    return written


# --- the command line ------------------------------------------------------------------------


def _config(tmp_path: Path, url: str, prefix: str, buckets: int = BUCKETS) -> Path:
    path = tmp_path / f"fencegate-{buckets}.toml"
    path.write_text(
        "[store]\n"
        f'url = "{url}"\n'
        f'redis_key_prefix = "{prefix}"\n'
        f"cluster_buckets = {buckets}\n"
        f"timeout_ms = {STORE_TIMEOUT_MS}\n"
    )
    return path


def copy(config: Path, to: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable, "-m", "fencegate.gateway.cli", "store", "copy",
            "--config", str(config), "--to", to, *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip


# --- reading both sides key by key -----------------------------------------------------------


def _content(client: Any, key: str) -> Any:
    kind = client.type(key)
    if kind == "hash":
        return client.hgetall(key)
    if kind == "set":
        return set(client.smembers(key))
    if kind == "zset":
        return dict(client.zrange(key, 0, -1, withscores=True))
    if kind == "string":
        return client.get(key)
    if kind == "stream":
        return client.xlen(key)
    return None if kind == "none" else kind


def _cluster_keys(cluster: ClusterServers, prefix: str) -> dict[str, Any]:
    """Every key under ``prefix`` on the cluster's primaries, with its contents; each key is
    checked to be on the primary of its slot."""
    found: dict[str, Any] = {}
    for node in cluster.primaries():
        client = node.client()
        try:
            for key in client.scan_iter(match=scan_pattern(prefix), count=1000):
                text = key.decode() if isinstance(key, bytes) else key
                assert cluster.primary_of(ClusterRouter.slot_of(text)).port == node.port
                found[text] = _content(client, text)
        finally:
            client.close()
    return found


def _bucket_of(key: str, prefix: str) -> int:
    head = f"{prefix}:{{{prefix}.b"
    assert key.startswith(head), key
    return int(key[len(head) : key.index("}")])


def _expected_bucket(item: Any, layout: Layout, admin: Any, prefix: str) -> int | None:
    """The bucket a whole key must be in (None: every bucket)."""
    if item.place is Place.TASK:
        return layout.task_bucket(item.arg)
    if item.place is Place.KEYED:
        return layout.keyed_bucket(item.arg)
    if item.place is Place.EFFECT_TOMBSTONE:
        task_id = admin.hget(item.key, "task_id")
        return layout.task_bucket(task_id) if task_id else layout.keyed_bucket(item.arg)
    return None


def _member_task(item: Any, member: str, admin: Any, prefix: str, layout: Layout) -> int:
    """The bucket of one member of a split key, computed from the source."""
    src = keys.Keys(prefix)
    if item.place is Place.BY_TASK:
        return layout.task_bucket(member)
    if item.place is Place.BY_QUEUE_ENTRY:
        return layout.task_bucket(member.split(":", 2)[2])
    if item.place is Place.BY_INDEX_ENTRY:
        _, effect_id, task_id = member.split(":", 2)
        return layout.task_bucket(task_id) if task_id else layout.keyed_bucket(effect_id)
    if item.place is Place.BY_KEYED:
        return layout.keyed_bucket(member)
    if item.place is Place.BY_DIRECTORY_ENTRY:
        return layout.task_bucket(admin.hget(src.effect_tasks, member))
    if item.place is Place.BY_EFFECT_TOMBSTONE:
        task_id = admin.hget(src.effect_tombstone(member), "task_id")
        return layout.task_bucket(task_id) if task_id else layout.keyed_bucket(member)
    task_id = admin.hget(src.effect_tasks, member)
    return layout.task_bucket(task_id) if task_id else layout.keyed_bucket(member)


def _check_key_by_key(admin: Any, copied: dict[str, Any], prefix: str, layout: Layout) -> None:
    """Every key of the source is on the cluster where the layout says, with its contents
    (whole, or split by member: the bucket copies' union is the source's, each member in its
    bucket); nothing else is there but each bucket's meta."""
    expected: dict[str, Any] = {}
    for key in admin.scan_iter(match=scan_pattern(prefix), count=1000):
        item = classify(key, prefix)
        assert item is not None, key
        content = _content(admin, key)
        if item.place is Place.NOT_COPIED:
            continue
        if item.place is Place.META:
            continue
        bucket = _expected_bucket(item, layout, admin, prefix)
        if item.place in (Place.TASK, Place.KEYED, Place.EFFECT_TOMBSTONE, Place.EVERY):
            for n in range(layout.buckets) if bucket is None else [bucket]:
                expected[layout.target(item, n)] = content
            continue
        split: dict[int, Any] = {}
        members = content.items() if isinstance(content, dict) else ((m, None) for m in content)
        for member, value in members:
            n = _member_task(item, member, admin, prefix, layout)
            if isinstance(content, dict):
                split.setdefault(n, {})[member] = value
            else:
                split.setdefault(n, set()).add(member)
        for n, part in split.items():
            expected[layout.target(item, n)] = part
    for n in range(layout.buckets):
        meta = layout.keys(n).meta
        expected[meta] = {"format": admin.hget(keys.Keys(prefix).meta, "format")} | (
            {BUCKETS_FIELD: str(layout.buckets)} if n == 0 else {}
        )
    assert copied == expected
    for key in copied:
        assert ClusterRouter.slot_of(key) == slot_of(bucket_tag(prefix, _bucket_of(key, prefix)))


# --- the tests ---------------------------------------------------------------------------------


async def test_a_drained_store_is_copied_into_its_buckets_once(
    source: RedisStore,
    redis_server: RedisServer,
    redis_cluster: ClusterServers,
    prefix: str,
    tmp_path: Path,
) -> None:
    written = await _write_store(source)
    config = _config(tmp_path, redis_server.url, prefix)
    done = copy(config, redis_cluster.url, "--batch", "7")
    assert done.returncode == 0, done.stderr
    assert "not copied: 1 events key(s) (the change feed starts empty" in done.stdout
    assert "Last-Event-ID" in done.stdout
    layout = Layout(prefix, BUCKETS)
    admin = redis_server.client()
    try:
        copied = _cluster_keys(redis_cluster, prefix)
        _check_key_by_key(admin, copied, prefix, layout)
    finally:
        admin.close()
    assert not any(":events" in key or ":write-mark:" in key for key in copied)

    again = copy(config, redis_cluster.url)
    assert again.returncode == 0, again.stderr
    assert "copied 0 key(s)" in again.stdout
    assert "index members added: 0;" in again.stdout
    assert _cluster_keys(redis_cluster, prefix) == copied

    fewer = copy(_config(tmp_path, redis_server.url, prefix, BUCKETS // 2), redis_cluster.url)
    assert fewer.returncode == 1
    assert f"created with {BUCKETS} buckets and store.cluster_buckets is 8" in fewer.stderr
    assert _cluster_keys(redis_cluster, prefix) == copied

    await _read_back(source, redis_cluster, prefix, written)

    # A gateway pointed at the cluster (the runbook's last step) takes the copied store.
    gateway = tmp_path / "gateway.toml"
    gateway.write_text(
        '[server]\nlisten = "127.0.0.1:0"\n\n'
        + _config(tmp_path, redis_cluster.url, prefix).read_text()
    )
    checked = subprocess.run(
        [sys.executable, "-m", "fencegate.gateway.cli", "serve", "--check", "--config",
         str(gateway)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    assert f"store: {redis_cluster.url} (reached)" in checked.stdout


async def _read_back(
    source: RedisStore, cluster: ClusterServers, prefix: str, written: Written
) -> None:
    """Bucket views answer what the source store answers."""
    from fencegate.ledger.cluster_client import RoutedRedis

    router = ClusterRouter.from_url(cluster.url, timeout_ms=STORE_TIMEOUT_MS)
    views: dict[int, RedisStore] = {}

    def view(n: int) -> RedisStore:
        if n not in views:
            slot_key = "{" + bucket_tag(prefix, n) + "}"
            views[n] = RedisStore(
                cluster.url,
                POLICY,
                timeout_ms=STORE_TIMEOUT_MS,
                key_prefix=cluster_store.bucket_prefix(prefix, n),
                client=RoutedRedis(router, slot_key),  # type: ignore[arg-type]
                cluster_slot_key=slot_key,
            )
            views[n].clock_offset_ms = source.clock_offset_ms
        return views[n]

    try:
        for task_id in written.tasks:
            there = view(bucket_of_task(task_id, BUCKETS))
            assert await there.get_task(task_id) == await source.get_task(task_id)
        for effect_id in written.effects:
            task_id = (await source.get_effect(effect_id)).task_id
            assert task_id is not None
            there = view(bucket_of_task(task_id, BUCKETS))
            assert await there.get_effect(effect_id) == await source.get_effect(effect_id)
        for effect_id in written.keyed:
            there = view(bucket_of_keyed(effect_id, BUCKETS))
            assert await there.get_effect(effect_id) == await source.get_effect(effect_id)
        gone = view(bucket_of_task(written.expired_task, BUCKETS))
        with pytest.raises(TaskExpired):
            await gone.get_task(written.expired_task)
        for effect_id in written.expired_effects:
            with pytest.raises(EffectExpired):
                await gone.get_effect(effect_id)
        listed: list[Task] = []
        for n in range(BUCKETS):
            page, _ = await view(n).list_tasks(TaskFilter(), 100, None)
            listed += page
            assert await view(n).get_scheduler() == Scheduler(epoch=3, claims_paused=True)
        everything, _ = await source.list_tasks(TaskFilter(), 100, None)
        assert sorted(listed, key=lambda t: t.task_id) == everything
        waiting = await view(bucket_of_task("order-1::email", BUCKETS)).get_task("order-1::email")
        assert waiting.state is TaskState.WAITING
    finally:
        for one in views.values():
            await one.close()
        await router.aclose()


async def _claim_run_out(store: RedisStore, task_id: str, queue: str | None) -> Task:
    """``task_id`` put and claimed with a lease that ran out a minute ago on the store's
    clock (claimed on a test clock two minutes behind it, for one minute): a worker that
    died holding it."""
    await store.put_task(task_id, f"in-{task_id}", None, queue=queue)
    store.clock_offset_ms = -120_000
    try:
        return await store.claim(task_id, ClaimRequest("died", 60_000, 1))
    finally:
        store.clock_offset_ms = 0


async def test_a_store_that_is_not_drained_is_refused_and_nothing_written(
    source: RedisStore,
    redis_server: RedisServer,
    redis_cluster: ClusterServers,
    prefix: str,
    tmp_path: Path,
) -> None:
    await source.put_task("busy-1", "in", None, queue="q")
    task = await source.claim("busy-1", ClaimRequest("w", 60_000, 1))
    request = EffectRequest(_fence(task), "node", "s", "pay", "POST", "/pay", "d" * 64)
    prepared = await source.prepare_effect(request, 30_000)
    assert prepared.action is Action.FORWARD
    # Beside them, a claim whose lease ran out: not what holds the copy, not named.
    await _claim_run_out(source, "dead-1", "q")
    refused = copy(_config(tmp_path, redis_server.url, prefix), redis_cluster.url)
    assert refused.returncode == 1
    assert "the store is not drained" in refused.stderr
    assert "1 task(s) CLAIMED with a lease still running" in refused.stderr
    assert "busy-1" in refused.stderr and "dead-1" not in refused.stderr
    assert task.lease_expires_at is not None
    assert f"the last runs out at leaseExpiresAt {task.lease_expires_at}" in refused.stderr
    assert "pause claims (`fencegate claims pause`)" in refused.stderr
    assert "1 effect(s) PREPARED" in refused.stderr
    assert prepared.effect.effect_id in refused.stderr
    assert "wait for their forwards to complete" in refused.stderr
    assert "nothing was written" in refused.stderr
    assert _cluster_keys(redis_cluster, prefix) == {}


async def test_a_claim_whose_lease_ran_out_is_copied_and_taken_over_on_the_cluster(
    source: RedisStore,
    redis_server: RedisServer,
    redis_cluster: ClusterServers,
    prefix: str,
    tmp_path: Path,
) -> None:
    """The gateways stopped, the workers died holding claims: nothing could release those
    tasks but a new claim. The copy takes them as they are (CLAIMED, the same lease, attempt
    and generation, in their bucket's leases and queue indexes), and on the cluster store
    the old attempt is refused as on the source, and a claim takes each over."""
    from fencegate.ledger.cluster_store import ClusterStore, RoutedBackend

    queued = await _claim_run_out(source, "job-1", "jobs")
    by_id = await _claim_run_out(source, "order-5::ship", None)
    await source.put_task("job-2", "in-job-2", None, queue="jobs")
    # An attempt that did something: a completed effect under the claim.
    request = EffectRequest(_fence(queued), "node", "s0", "pay", "POST", "/pay", "d" * 64)
    source.clock_offset_ms = -90_000  # inside the lease, on the clock it was claimed on
    outcome = await source.prepare_effect(request, 30_000)
    assert queued.attempt_id is not None
    await source.complete_effect(
        "job-1", outcome.effect.effect_id, outcome.seq, queued.attempt_id,
        EffectState.COMMITTED, "200", None,
    )  # fmt: skip
    source.clock_offset_ms = 0
    await source.set_claims_paused(True)  # the runbook
    layout = Layout(prefix, BUCKETS)

    done = copy(_config(tmp_path, redis_server.url, prefix), redis_cluster.url)
    assert done.returncode == 0, done.stderr
    assert "CLAIMED with their lease run out: 2 task(s) (" in done.stdout
    assert "job-1" in done.stdout and "order-5::ship" in done.stdout
    admin = redis_server.client()
    try:
        copied = _cluster_keys(redis_cluster, prefix)
        _check_key_by_key(admin, copied, prefix, layout)
    finally:
        admin.close()
    # The indexes a CLAIMED task needs, in its bucket: leases (by expiry), the queue's held
    # (by expiry) and epochs (by claim epoch).
    for task in (queued, by_id):
        there = layout.keys(layout.task_bucket(task.task_id))
        assert copied[there.leases][task.task_id] == task.lease_expires_at
    jobs = layout.keys(layout.task_bucket("job-1"))
    assert copied[jobs.queue_held("jobs")]["job-1"] == queued.lease_expires_at
    assert copied[jobs.queue_epochs("jobs")]["job-1"] == 1

    backend = RoutedBackend(
        redis_cluster.url, POLICY, key_prefix=prefix, timeout_ms=STORE_TIMEOUT_MS
    )
    cluster = ClusterStore(
        POLICY, backend, buckets=BUCKETS, key_prefix=prefix, timeout_ms=STORE_TIMEOUT_MS
    )
    await cluster.open()
    try:
        for task in (queued, by_id):
            assert await cluster.get_task(task.task_id) == await source.get_task(task.task_id)
        await cluster.set_claims_paused(False)
        # Before any new claim: the old attempt's renew and fenced calls are refused as
        # expired, as on the source.
        for store in (source, cluster):
            with pytest.raises(LeaseExpired):
                await store.renew("job-1", RenewRequest(_identity(queued), 60_000))
            again = EffectRequest(_fence(queued), "node", "s1", "pay", "POST", "/pay", "e" * 64)
            with pytest.raises(LeaseExpired):
                await store.prepare_effect(again, 30_000)

        # A claim takes each over: the queue's (through its held index) and one by id.
        taken = await cluster.claim_next("jobs", ClaimRequest("w2", 60_000, 1))
        assert taken is not None and taken.task_id == "job-1"
        by_claim = await cluster.claim("order-5::ship", ClaimRequest("w2", 60_000, 1))
        for old, new in ((queued, taken), (by_id, by_claim)):
            assert new.state is TaskState.CLAIMED and new.owner == "w2"
            assert new.claim_generation == old.claim_generation + 1
            assert new.attempt_id != old.attempt_id
            assert [d.reason for d in new.discarded] == ["expired"]
            assert new.previous_lease_expires_at == old.lease_expires_at
            # The old attempt, fenced: renew, prepare and commit.
            with pytest.raises(Fenced):
                await cluster.renew(old.task_id, RenewRequest(_identity(old), 60_000))
            fenced = EffectRequest(_fence(old), "node", "s2", "pay", "POST", "/pay", "f" * 64)
            with pytest.raises(Fenced):
                await cluster.prepare_effect(fenced, 30_000)
            with pytest.raises(Fenced):
                await cluster.commit(old.task_id, _commit(old))
            committed, _ = await cluster.commit(new.task_id, _commit(new))
            assert committed.state is TaskState.COMMITTED
            assert committed.claim_generation == old.claim_generation + 1
        # The old attempt's completed effect came along as it was.
        record = await cluster.get_effect(outcome.effect.effect_id)
        assert record == await source.get_effect(outcome.effect.effect_id)
        # The other task of the queue is next.
        other = await cluster.claim_next("jobs", ClaimRequest("w3", 60_000, 1))
        assert other is not None and other.task_id == "job-2"
    finally:
        await cluster.close()
    # The old store is left as it was.
    assert (await source.get_task("job-1")).claim_generation == queued.claim_generation


def _identity(task: Task) -> Identity:
    assert task.attempt_id is not None
    return Identity(
        task.attempt_id, task.claim_generation, task.owner or "", 1, task.cancel_generation
    )


def _commit(task: Task) -> CommitRequest:
    assert task.attempt_id is not None
    return CommitRequest(
        task.attempt_id, task.claim_generation, 1, task.cancel_generation, task.input_digest,
        "r" * 64,
    )  # fmt: skip


@pytest.mark.parametrize("when", ["after-the-checks", "during-the-indexes"])
async def test_a_claim_taking_over_a_lease_that_ran_out_during_the_copy_is_reported(
    source: RedisStore,
    redis_server: RedisServer,
    redis_cluster: ClusterServers,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    when: str,
) -> None:
    """A gateway still serving the source takes over a lease the check saw run out: right
    after the checks (as the creation indexes' catch-up starts, which writes the source), or
    while the store-wide indexes are split. Either way its claim appends to the change feed
    after the run's first look at it, and the run fails."""
    from fencegate.ledger.cluster_copy import CopyRefused, copy_store, source_client
    from fencegate.ledger.redis_store import FORMAT_VERSION

    await _claim_run_out(source, "job-1", "jobs")
    client = source_client(redis_server.url, password=None, timeout_ms=STORE_TIMEOUT_MS)
    router = ClusterRouter.from_url(redis_cluster.url, timeout_ms=STORE_TIMEOUT_MS)
    method = "eval" if when == "after-the-checks" else "type"
    original = getattr(client, method)
    claims: list[Task] = []

    async def claim_first(*args: Any, **kwargs: Any) -> Any:
        if not claims:
            claims.append(await source.claim("job-1", ClaimRequest("gw", 60_000, 1)))
        return await original(*args, **kwargs)

    monkeypatch.setattr(client, method, claim_first)
    try:
        with pytest.raises(CopyRefused, match="changed while it was copied"):
            await copy_store(
                client, router, Layout(prefix, BUCKETS), format_version=FORMAT_VERSION,
                say=lambda line: None,
            )  # fmt: skip
        assert [c.claim_generation for c in claims] == [2]
    finally:
        await router.aclose()
        await client.aclose()


async def test_a_dependency_across_groups_still_open_is_refused(
    source: RedisStore,
    redis_server: RedisServer,
    redis_cluster: ClusterServers,
    prefix: str,
    tmp_path: Path,
) -> None:
    """One Redis accepts ``dependsOn`` across groups; on the cluster the dependency's commit
    could not release its dependent in another bucket."""
    await source.put_task("build", "in", None)
    await source.put_task("deploy", "in", None, depends_on=("build",))
    refused = copy(_config(tmp_path, redis_server.url, prefix), redis_cluster.url)
    assert refused.returncode == 1
    assert "1 open task(s) depend on a task of another task group" in refused.stderr
    assert "deploy (WAITING) on build" in refused.stderr
    assert _cluster_keys(redis_cluster, prefix) == {}


def test_the_target_must_be_a_cluster_url(tmp_path: Path, redis_server: RedisServer) -> None:
    config = _config(tmp_path, redis_server.url, "fg")
    refused = copy(config, redis_server.url)
    assert refused.returncode == 2
    assert "not a Redis Cluster url; expected redis+cluster://" in refused.stderr
    sqlite = _config(tmp_path, f"sqlite:///{tmp_path / 'x.db'}", "fg")
    refused = copy(sqlite, "redis+cluster://127.0.0.1:7000")
    assert refused.returncode == 2
    assert "the copy reads a single Redis store" in refused.stderr


async def test_a_source_that_changes_during_the_copy_is_reported(
    source: RedisStore,
    redis_server: RedisServer,
    redis_cluster: ClusterServers,
    prefix: str,
) -> None:
    """A gateway still serving the old store: a change it makes after the copy read the keys
    (a step's event in the change feed, or a bump, which appends none) must not let the run
    say it is done."""
    from fencegate.ledger.cluster_copy import CopyRefused, copy_store, source_client
    from fencegate.ledger.redis_store import FORMAT_VERSION

    await source.put_task("first", "in", None, queue="q")
    admin = redis_server.client()
    layout = keys.Keys(prefix)

    def bump(line: str) -> None:
        if line.startswith("keys:"):  # between the keys and the indexes, synchronously
            admin.hset(layout.scheduler, mapping={"epoch": "2", "paused": "0"})

    def event(line: str) -> None:
        if line.startswith("keys:"):
            admin.xadd(layout.events, {"e": "{}"})

    client = source_client(redis_server.url, password=None, timeout_ms=STORE_TIMEOUT_MS)
    router = ClusterRouter.from_url(redis_cluster.url, timeout_ms=STORE_TIMEOUT_MS)
    try:
        for change in (bump, event):
            with pytest.raises(CopyRefused, match="changed while it was copied"):
                await copy_store(
                    client,
                    router,
                    Layout(prefix, BUCKETS),
                    format_version=FORMAT_VERSION,
                    say=change,
                )
    finally:
        admin.close()
        await router.aclose()
        await client.aclose()
