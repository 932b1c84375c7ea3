"""Issue 13, the cheap Redis script: what a fenced call costs the one Redis every gateway shares.

Redis CPU is the fleet's ceiling, so the hot path's two scripts (prepare, complete) are held to
a budget of Redis commands, counted exactly by INFO commandstats (no timing): the task is read
by the fields prepare needs, and a step only writes the indexes whose membership it changes.
The effectId the gateway computes (instead of a pure-Lua SHA-256 in the script) must never be
trusted blindly: the script checks the revision it came from. And the benchmarks' per-script
report (``bench._procs``) is checked against a real Redis, since its figures go into the
notes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import redis

from bench._procs import redis_stats_reset
from bench.proxy import redis_call_stats, render_redis_time
from fencegate.ledger import effects
from fencegate.ledger.effects import Action, EffectRequest, EffectState, Fence
from fencegate.ledger.errors import StoreRegressed
from fencegate.ledger.redis_store import RedisStore, library_source
from fencegate.ledger.tasks import ClaimRequest, CommitRequest, LeasePolicy, Task
from tests.conftest import STORE_TIMEOUT_MS
from tests.servers import RedisServer

POLICY = LeasePolicy(max_ttl_ms=600_000, default_max_runtime_ms=6_000_000)
RESPONSE = '{"status":200,"headers":{},"body":"ok"}'


def _fence(task: Task) -> Fence:
    assert task.attempt_id is not None
    epoch = task.claim_epoch or 1
    return Fence(
        task.task_id, task.attempt_id, task.claim_generation, epoch, task.cancel_generation
    )


def _request(task: Task, slot: str) -> EffectRequest:
    return EffectRequest(_fence(task), "node", slot, "pay", "POST", "/pay", "d" * 64)


async def _fenced_call(store: RedisStore, task: Task, slot: str) -> None:
    """One proxied mutation as the gateway runs it: prepare, then complete COMMITTED."""
    outcome = await store.prepare_effect(_request(task, slot), 30_000)
    assert outcome.action is Action.FORWARD
    assert task.attempt_id is not None
    done, applied = await store.complete_effect(
        task.task_id,
        outcome.effect.effect_id,
        outcome.seq,
        task.attempt_id,
        EffectState.COMMITTED,
        "200",
        RESPONSE,
    )
    assert applied and done.state is EffectState.COMMITTED


def _commands(client: redis.Redis) -> dict[str, int]:
    """Calls per command since the last RESETSTAT, scripts' own commands included."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in stats.items()}


async def test_a_fenced_call_runs_few_redis_commands(
    make_redis_server: Callable[..., RedisServer],
) -> None:
    server = make_redis_server()
    store = RedisStore(server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS)
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        await store.open()  # as a gateway starts: the store's format (3) is read
        await store.put_task("t1", "in", None)
        task = await store.claim("t1", ClaimRequest("w", 60_000, 1))
        await _fenced_call(store, task, "warm")  # the durability check, script loading
        client.config_resetstat()
        await _fenced_call(store, task, "s1")
        ran = _commands(client)
    finally:
        client.close()
        await store.close()
    ran.pop("config|resetstat", None)
    ran.pop("info", None)
    assert ran.pop("fcall") == 2, ran  # the effect steps: functions of one library
    # prepare: TIME, HMGET scheduler, HMGET task, HSETNX record (the look-up and the write),
    # ZADD prepared, RPUSH (the creation indexes' entry, which index_catch_up.lua adds later,
    # for many effects at once: issue 30), XADD (the change feed: PREPARED);
    # complete: TIME, HGET, HSET, ZREM prepared, XADD (COMMITTED).
    # It used to be 19: HGETALL of the whole task, and every index written on every step;
    # then 15, with the three creation indexes written in the step.
    assert "hgetall" not in ran, ran
    assert ran.get("srem", 0) == 0 and ran.get("sadd", 0) == 0, ran
    assert ran.get("zrem", 0) == 1 and ran.get("zadd", 0) == 1, ran
    assert ran.get("hsetnx", 0) == 1 and ran.get("hset", 0) == 1, ran
    assert ran.get("rpush", 0) == 1, ran
    assert ran.get("xadd", 0) == 2, ran  # one event per effect state change, no more
    # Lost-writes detection: after each step's batch, the gateway's write mark (INCR) and the
    # store-wide flag (HGET), plain commands in the same pipeline (docs/stores.md).
    assert ran.pop("incr", 0) == 2, ran
    ran["hmget"] -= 2  # the lost-writes flag and acknowledgements, once per step
    assert sum(ran.values()) <= 12, ran


async def test_the_settled_index_costs_one_command_where_a_task_settles_or_reopens(
    make_redis_server: Callable[..., RedisServer],
) -> None:
    """Retention's settled index (issue 17) is kept inside the task scripts (task_lib.lua's
    ``index_settled``): one ZADD as a task commits or is cancelled, one ZREM as a new
    revision reopens it, nothing for the steps between open states (claim) or that leave a
    settled task settled (a commit replay, cancelling a cancelled task), and nothing on the
    fenced call (``test_a_fenced_call_runs_few_redis_commands`` holds prepare and complete
    to their budget). A create reads the task's tombstone: one HGETALL."""
    server = make_redis_server()
    store = RedisStore(server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS)
    client = redis.Redis.from_url(server.url, decode_responses=True)
    counted: dict[str, dict[str, int]] = {}

    async def count(name: str, step: Awaitable[object]) -> None:
        client.config_resetstat()
        await step
        ran = _commands(client)
        ran.pop("config|resetstat", None)
        ran.pop("info", None)
        # Every write batch ends with the write mark and the lost-writes flag (INCR, HGET):
        # counted by test_a_fenced_call_runs_few_redis_commands, left out here.
        assert ran.pop("incr") == 1, ran
        ran["hmget"] -= 1
        if not ran["hmget"]:
            del ran["hmget"]
        counted[name] = ran

    try:
        # Load every script first (a NOSCRIPT round trip would count twice).
        await store.put_task("warm", "in", None)
        warm = await store.claim("warm", ClaimRequest("w", 60_000, 1))
        assert warm.attempt_id is not None
        await store.commit("warm", CommitRequest(warm.attempt_id, 1, 1, 0, "in", "r"))
        await store.put_task("warm2", "in", None)
        await store.cancel("warm2")

        await count("create", store.put_task("t1", "in", None))
        task = await store.claim("t1", ClaimRequest("w", 60_000, 1))
        assert task.attempt_id is not None
        done = CommitRequest(task.attempt_id, 1, 1, 0, "in", "r")
        await count("commit", store.commit("t1", done))
        await count("replay", store.commit("t1", done))
        await count("revise", store.put_task("t1", "in-2", None))
        await count("claim", store.claim("t1", ClaimRequest("w", 60_000, 1)))
        await count("cancel", store.cancel("t1"))
        await count("cancel again", store.cancel("t1"))
    finally:
        client.close()
        await store.close()
    total = {name: sum(ran.values()) for name, ran in counted.items()}
    # create: EVALSHA, HGET scheduler (the freeze, task_lib.lua), TIME, HGETALL task, HGETALL
    # tombstone, DEL + HSET task (save_hash of a new hash), ZADD tasks index, ZREM leases, XADD.
    assert counted["create"].get("hgetall") == 2 and total["create"] == 10, counted
    # commit: EVALSHA, TIME, HMGET scheduler, HGETALL, HSET, ZREM leases, ZADD settled, XADD,
    # SMEMBERS dependents.
    assert counted["commit"].get("zadd") == 1 and total["commit"] == 9, counted
    assert "zadd" not in counted["replay"] and total["replay"] == 4, counted
    # revise: EVALSHA, HGET scheduler, TIME, HGETALL, HSET + HDEL, ZREM leases, ZREM settled,
    # XADD, SMEMBERS.
    assert counted["revise"].get("zrem") == 2 and total["revise"] == 10, counted
    # claim: EVALSHA, TIME, HMGET scheduler, HGETALL, HSET, ZADD leases, XADD: no settled index.
    assert counted["claim"].get("zadd") == 1 and total["claim"] == 7, counted
    # cancel: EVALSHA, HGET scheduler, TIME, HGETALL, HSET, ZREM leases, ZADD settled, XADD,
    # SMEMBERS (the cascade).
    assert counted["cancel"].get("zadd") == 1 and total["cancel"] == 9, counted
    assert total["cancel again"] == 4, counted


async def test_a_wrong_revision_from_the_gateway_is_not_trusted(
    make_redis_server: Callable[..., RedisServer],
) -> None:
    """A generation names one revision for good, unless Redis loses data: then the same
    (task, generation) can come back for another revision. A gateway that remembers the old
    pair sends an effectId computed from the old revision; the script must see the revision
    differs and compute the id itself."""
    server = make_redis_server()
    proxy = RedisStore(
        server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS
    )  # the gateway serving the agent's calls
    other = RedisStore(
        server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS
    )  # another gateway, serving the claims
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        await other.put_task("t1", "in-1", None)
        old = await proxy.claim("t1", ClaimRequest("w", 60_000, 1))
        assert (old.revision, old.claim_generation) == (1, 1)
        await _fenced_call(proxy, old, "s1")

        client.flushall()  # Redis lost everything; the task comes back at revision 2
        # The gateway finds its writes lost and refuses writes until an operator's
        # acknowledgement (tests/test_redis_regression.py); here the point is what the
        # script does with the old revision the gateway remembers, after that.
        with pytest.raises(StoreRegressed):
            await proxy.prepare_effect(_request(old, "s2"), 30_000)
        operator = RedisStore(
            server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS
        )  # `fencegate failover ack`: a fresh store
        try:
            epoch = (await operator.acknowledge_failover()).epoch
        finally:
            await operator.close()
        await proxy.ping()
        await other.ping()
        await other.put_task("t1", "in-1", None)
        await other.put_task("t1", "in-2", None)
        new = await other.claim("t1", ClaimRequest("w", 60_000, epoch))
        assert (new.revision, new.claim_generation) == (2, 1)

        outcome = await proxy.prepare_effect(_request(new, "s1"), 30_000)
    finally:
        client.close()
        await proxy.close()
        await other.close()
    assert outcome.action is Action.FORWARD
    assert outcome.effect.revision == 2
    assert outcome.effect.effect_id == effects.effect_id("t1", 2, "node", "s1")
    assert outcome.effect.effect_id != effects.effect_id("t1", 1, "node", "s1")


async def test_the_benchmarks_split_redis_time_by_script(
    make_redis_server: Callable[..., RedisServer],
) -> None:
    """bench.proxy's figure (``redis_call_stats``): the effect steps run as functions of the
    store's library (FCALL), each named by its function, and the per-script split adds up to
    the scripts' exact total."""
    server = make_redis_server()
    store = RedisStore(server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS)
    try:
        await store.put_task("t1", "in", None)
        task = await store.claim("t1", ClaimRequest("w", 60_000, 1))
        await _fenced_call(store, task, "warm")
        redis_stats_reset(server.url, 1000, slowlog_usec=0)  # every run, however fast
        for i in range(3):
            await _fenced_call(store, task, f"s{i}")
        report = redis_call_stats([server.url], None, 3)
    finally:
        await store.close()
    library = library_source()
    scripts = report["scripts"]
    assert set(scripts) == {library.function("prepare"), library.function("complete")}, report
    for line in scripts.values():
        assert line["runs"] == 3
        assert line["usecPerRun"] > 0
    per_script = sum(line["usecPerCall"] for line in scripts.values())
    assert abs(per_script - report["scriptUsecPerCall"]) <= 0.2, report
    # Besides the scripts, each step's write mark (INCR) is a plain command.
    assert report["plainCommands"].get("incr") == 6, report
    table = render_redis_time("redis", report).splitlines()
    rows = sorted(line.split()[:2] for line in table[4:])
    assert rows == [[library.function("complete"), "3"], [library.function("prepare"), "3"]]
