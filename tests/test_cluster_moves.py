"""Moving a bucket's slot to another primary (``ledger.cluster_moves``), on the real cluster of
tests.cluster_servers, through a ``ClusterStore``: a move under 12 concurrent workers
(each task put, claimed, two fenced calls, committed) loses nothing and runs nothing twice
(each effect forwarded and recorded once, every acknowledged commit there, every event of the
feed once), the workers meet the freeze as a refusal that did not run and go on; a move cut
short stays frozen and is finished by running it again, and a third run finds nothing to do.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from fencegate.ledger.buckets import bucket_of_task, bucket_tag, slot_of
from fencegate.ledger.cluster_moves import (
    MoveRefused,
    buckets_in_slot,
    move_bucket_slot,
    parse_node,
    store_freeze,
)
from fencegate.ledger.cluster_router import ClusterRouter
from fencegate.ledger.cluster_store import ClusterStore, RoutedBackend, bucket_prefix
from fencegate.ledger.effects import Action, EffectState
from fencegate.ledger.errors import StoreUnavailable
from fencegate.ledger.tasks import LeasePolicy, TaskState
from tests.cluster_servers import ClusterNode, ClusterServers
from tests.conftest import DEFAULT_MAX_RUNTIME_MS, MAX_TTL_MS, STORE_TIMEOUT_MS
from tests.test_cluster_client import effect_request, keys_of_prefix
from tests.test_task_flow import claim_as, commit_of

POLICY = LeasePolicy(max_ttl_ms=MAX_TTL_MS, default_max_runtime_ms=DEFAULT_MAX_RUNTIME_MS)
BUCKETS = 16
BUCKET = 5
DEADLINE_MS = 60_000
T = TypeVar("T")


@pytest.fixture
async def router(redis_cluster: ClusterServers) -> AsyncIterator[ClusterRouter]:
    """The operator's router (the move's), apart from the store's."""
    the_router = ClusterRouter.from_url(redis_cluster.url, timeout_ms=STORE_TIMEOUT_MS)
    yield the_router
    await the_router.aclose()


@pytest.fixture
async def store(redis_cluster: ClusterServers, key_prefix: str) -> AsyncIterator[ClusterStore]:
    backend = RoutedBackend(
        redis_cluster.url, POLICY, key_prefix=key_prefix, timeout_ms=STORE_TIMEOUT_MS
    )
    the_store = ClusterStore(
        POLICY, backend, buckets=BUCKETS, key_prefix=key_prefix, timeout_ms=STORE_TIMEOUT_MS
    )
    await the_store.open()
    yield the_store
    await the_store.close()


def group_in(bucket: int, stem: str = "g") -> str:
    """A task group whose tasks live in ``bucket``."""
    return next(
        f"{stem}{i}" for i in range(10_000) if bucket_of_task(f"{stem}{i}::x", BUCKETS) == bucket
    )


def where(store: ClusterStore, cluster: ClusterServers) -> tuple[int, ClusterNode, ClusterNode]:
    """The slot of bucket ``BUCKET``, its primary, and another primary to move it to."""
    slot = slot_of(bucket_tag(store.key_prefix, BUCKET))
    source = cluster.primary_of(slot)
    return slot, source, next(n for n in cluster.primaries() if n is not source)


def bucket_keys(cluster: ClusterServers, store: ClusterStore) -> set[int]:
    """The ports of the primaries holding the keys of bucket ``BUCKET``."""
    prefix = bucket_prefix(store.key_prefix, BUCKET)
    found = keys_of_prefix(cluster, store.key_prefix)
    return {port for key, port in found.items() if key.startswith(prefix + ":")}


@dataclass
class Load:
    """What the workers were answered: each effect's FORWARD count, the commits answered,
    the refusals that did not run (retried), and any answer that may have run (none may)."""

    forwarded: Counter[str] = field(default_factory=Counter)
    committed: list[str] = field(default_factory=list)
    refused: int = 0
    unsure: list[StoreUnavailable] = field(default_factory=list)
    met_freeze: asyncio.Event = field(default_factory=asyncio.Event)

    async def step(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``fn(*args)``, again after each refusal that did not run (as the gateway's
        caller would); an answer that may have run is kept and raised."""
        while True:
            try:
                return await fn(*args)
            except StoreUnavailable as exc:
                if "may or may not" in exc.detail:
                    self.unsure.append(exc)
                    raise
                self.refused += 1
                self.met_freeze.set()
                await asyncio.sleep(0.005)


async def run_load(
    store: ClusterStore, load: Load, group: str, workers: int, rounds: int, done: asyncio.Event
) -> None:
    """``workers`` workers, each doing ``rounds`` tasks of ``group`` (and more until
    ``done``): put, claim, two fenced calls, commit."""

    async def work(n: int) -> None:
        r = 0
        while r < rounds or not done.is_set():
            task_id = f"{group}::{n}-{r}"
            r += 1
            await load.step(store.put_task, task_id, "in", None)
            task = await load.step(store.claim, task_id, claim_as(f"w{n}"))
            assert task.attempt_id is not None
            for k in range(2):
                request = effect_request(task, f"s{k}")
                prepared = await load.step(store.prepare_effect, request, DEADLINE_MS)
                assert prepared.action is Action.FORWARD
                effect_id = prepared.effect.effect_id
                load.forwarded[effect_id] += 1
                await load.step(
                    store.complete_effect, task_id, effect_id, prepared.seq, task.attempt_id,
                    EffectState.COMMITTED, "200", None,
                )  # fmt: skip
            await load.step(store.commit, task_id, commit_of(task, "r"))
            load.committed.append(task_id)

    await asyncio.gather(*(work(n) for n in range(workers)))


async def test_a_slot_moved_under_load_loses_nothing_and_runs_nothing_twice(
    store: ClusterStore, router: ClusterRouter, redis_cluster: ClusterServers
) -> None:
    slot, source, target = where(store, redis_cluster)
    assert buckets_in_slot(store.key_prefix, BUCKETS, slot) == [BUCKET]
    _, start = await store.read_events(None, 10)
    load, done = Load(), asyncio.Event()
    group = group_in(BUCKET)
    running = asyncio.create_task(run_load(store, load, group, 12, 2, done))
    while len(load.committed) < 12:
        await asyncio.sleep(0.01)

    async def between(batch: int) -> None:
        if batch == 1:  # the workers meet the freeze while the slot is half moved
            met = asyncio.ensure_future(load.met_freeze.wait())
            await asyncio.wait([met, running], timeout=60, return_when=asyncio.FIRST_COMPLETED)
            if running.done():
                running.result()  # the workers' failure (an answer that may have run), not a hang
            assert met.done(), "no worker met the freeze"

    report = await move_bucket_slot(
        router, slot, target.address, store_freeze(store, slot), batch=5, after_batch=between
    )
    done.set()
    await running
    assert load.unsure == [] and load.refused > 0
    assert report.source == source.address and report.target == target.address
    assert report.keys_moved > 0 and report.batches > 1 and not report.resumed
    assert redis_cluster.primary_of(slot) is target
    assert bucket_keys(redis_cluster, store) == {target.port}
    # Nothing lost: every effect recorded COMMITTED with its one attempt, every commit there.
    assert load.forwarded and set(load.forwarded.values()) == {1}
    for effect_id in load.forwarded:
        effect = await store.get_effect(effect_id)
        assert effect.state is EffectState.COMMITTED and len(effect.attempts) == 1
    assert len(load.committed) >= 24
    for task_id in load.committed:
        assert (await store.get_task(task_id)).state is TaskState.COMMITTED
    # Nothing twice: each change's event once in the feed.
    events, after = [], start
    while True:
        page, after = await store.read_events(after, 500)
        if not page:
            break
        events += page
    effect_events = Counter(
        (e.body["effectId"], e.body["state"]) for e in events if e.body["type"] == "effect"
    )
    task_events = Counter(
        (e.body["taskId"], e.body["revision"], e.body["state"])
        for e in events
        if e.body["type"] == "task"
    )
    assert {eid for eid, _ in effect_events} == set(load.forwarded)
    assert set(effect_events.values()) == {1} and set(task_events.values()) == {1}
    assert {(t, s) for t, _, s in task_events if s == "COMMITTED"} == {
        (t, "COMMITTED") for t in load.committed
    }


async def test_a_move_cut_short_stays_frozen_until_run_again_to_its_end(
    store: ClusterStore, router: ClusterRouter, redis_cluster: ClusterServers
) -> None:
    slot, source, target = where(store, redis_cluster)
    group = group_in(BUCKET)
    for n in range(15):
        await store.put_task(f"{group}::{n}", "in", None)
    elsewhere = next(
        f"o{i}::x" for i in range(1000) if bucket_of_task(f"o{i}::x", BUCKETS) != BUCKET
    )
    await store.put_task(elsewhere, "in", None)

    async def crash(batch: int) -> None:
        if batch == 2:
            raise RuntimeError("the operator's shell died")

    freeze = store_freeze(store, slot)
    with pytest.raises(RuntimeError, match="shell died"):
        await move_bucket_slot(router, slot, target.address, freeze, batch=3, after_batch=crash)
    assert bucket_keys(redis_cluster, store) == {source.port, target.port}  # half moved
    with pytest.raises(StoreUnavailable):  # frozen: the step did not run
        await store.claim(f"{group}::0", claim_as("w"))
    assert (await store.get_task(f"{group}::0")).state is TaskState.READY
    assert await store.views[BUCKET].bucket_frozen()
    assert (await store.claim(elsewhere, claim_as("w"))).state is TaskState.CLAIMED

    again = await move_bucket_slot(router, slot, f"{target.address}", freeze, batch=3)
    assert again.resumed and again.source == source.address and again.keys_moved > 0
    assert bucket_keys(redis_cluster, store) == {target.port}
    assert (await store.claim(f"{group}::0", claim_as("w"))).state is TaskState.CLAIMED
    assert await store.views[BUCKET].bucket_frozen() is None
    third = await move_bucket_slot(router, slot, target.address, freeze)
    assert third.already and third.keys_moved == 0
    assert redis_cluster.primary_of(slot) is target


async def test_a_move_to_a_replica_or_of_no_slot_is_refused_and_changes_nothing(
    store: ClusterStore, router: ClusterRouter, redis_cluster: ClusterServers
) -> None:
    slot, source, _ = where(store, redis_cluster)
    replica = redis_cluster.replica_of(source)
    calls: list[bool] = []

    async def freeze(frozen: bool) -> None:
        calls.append(frozen)

    with pytest.raises(MoveRefused, match="is not a primary"):
        await move_bucket_slot(router, slot, replica.address, freeze)
    with pytest.raises(MoveRefused, match="not a slot"):
        await move_bucket_slot(router, 16_384, source.address, freeze)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_node("nowhere")
    assert calls == [] and redis_cluster.primary_of(slot) is source


def move_slot(config: Path, slot: int, to: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable, "-m", "fencegate.gateway.cli", "store", "move-slot", str(slot),
            "--to", to, "--config", str(config), "--batch", "4",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip


async def test_the_command_moves_the_slot_and_a_second_run_finds_it_there(
    store: ClusterStore, redis_cluster: ClusterServers, tmp_path: Path
) -> None:
    slot, source, target = where(store, redis_cluster)
    group = group_in(BUCKET)
    for n in range(5):
        await store.put_task(f"{group}::{n}", "in", None)
    config = tmp_path / "fencegate.toml"
    config.write_text(
        "[store]\n"
        f'url = "{redis_cluster.url}"\n'
        f'redis_key_prefix = "{store.key_prefix}"\n'
        f"cluster_buckets = {BUCKETS}\n"
        f"timeout_ms = {STORE_TIMEOUT_MS}\n"
    )
    moved = await asyncio.to_thread(move_slot, config, slot, target.address)
    assert moved.returncode == 0, moved.stderr
    assert f"slot {slot} moved from {source.address} to {target.address}" in moved.stdout
    assert redis_cluster.primary_of(slot) is target
    assert bucket_keys(redis_cluster, store) == {target.port}
    assert await store.views[BUCKET].bucket_frozen() is None
    again = await asyncio.to_thread(move_slot, config, slot, target.address)
    assert again.returncode == 0 and "nothing to move" in again.stdout
    refused = await asyncio.to_thread(move_slot, config, slot, "nowhere")
    assert refused.returncode == 2 and "is not HOST:PORT" in refused.stderr
    sqlite = tmp_path / "sqlite.toml"
    sqlite.write_text(f'[store]\nurl = "sqlite:///{tmp_path / "x.db"}"\n')
    refused = await asyncio.to_thread(move_slot, sqlite, slot, target.address)
    assert refused.returncode == 2 and "not a redis+cluster:// store" in refused.stderr
