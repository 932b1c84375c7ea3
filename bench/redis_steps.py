"""Where a fenced call's Redis time goes, at the store (issue 30): the real steps against the
floor of any layout that keeps the fenced call's guarantees.

On a private redis-server (AOF ``everysec``, so the disk does not dominate), ``--calls``
fenced calls run through a real ``RedisStore`` (prepare then complete, ``--concurrency``
callers, the store at format 3), and Redis's own accounting (``INFO commandstats``) gives
the µs per fenced call of the effect steps (``FCALL``) and of the creation indexes' catch-up
(``index_catch_up``, ``EVALSHA``), and the µs of each command the steps ran. Then the same
number of calls of a "floor" library: two functions with only the eleven commands a fenced
call needs atomically (prepare ``TIME``, ``HMGET`` scheduler, ``HMGET`` task, ``HSETNX``
record, ``ZADD`` prepared, ``XADD`` event; complete ``TIME``, ``HGET``, ``HSET``, ``ZREM``,
``XADD``), no index, no decision. The ratio floor / real is what no rewrite of the scripts
can beat without dropping a guarantee. ``--busy N`` runs N busy loops meanwhile (the
``bench.proxy`` peak phase loads the cores with the gateway and the client; an idle CPU makes
Redis slower per command, so idle figures are not comparable to loaded ones).

    .venv/bin/python -m bench.redis_steps --calls 4000 --busy 2

``--base-src DIR`` (a ``git archive`` of another revision, as ``bench.proxy --gateway-src``)
adds a first phase: the same fenced calls through that revision's ``RedisStore``, run in a
child process importing from ``DIR``, on the same redis-server. Then ``floor / base`` is
the least fraction of that revision's Redis time any layout keeping the guarantees can reach.

    .venv/bin/python -m bench.redis_steps --calls 4000 --busy 2 --base-src /tmp/fg-base
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from bench._args import add_store_bench_options
from bench._procs import align, run_phase_in, start_redis
from fencegate.ledger.effects import EffectRequest, EffectState, Fence
from fencegate.ledger.redis_store import RedisStore
from fencegate.ledger.tasks import ClaimRequest, LeasePolicy, Task

POLICY = LeasePolicy(max_ttl_ms=600_000, default_max_runtime_ms=6_000_000)
RESPONSE = '{"status":200,"headers":{},"body":"ok"}'
#: The floor: the commands a fenced call needs atomically, nothing else.
FLOOR = r"""#!lua name=fencegate_bench_floor
redis.register_function('floor_prepare', function(keys, args)
  redis.call('TIME')
  redis.call('HMGET', keys[1], 'epoch', 'claims_paused', 'frozen')
  redis.call('HMGET', keys[2], 'state', 'revision', 'attempt_id', 'claim_generation',
    'principal', 'claim_epoch', 'cancel_generation', 'lease_expires_at')
  redis.call('HSETNX', keys[3], args[1], args[2])
  redis.call('ZADD', keys[4], 1, args[1])
  redis.call('XADD', keys[5], '*', 'e', args[3])
  return {'NEW', '1'}
end)
redis.register_function('floor_complete', function(keys, args)
  redis.call('TIME')
  redis.call('HGET', keys[1], args[1])
  redis.call('HSET', keys[1], args[1], args[2])
  redis.call('ZREM', keys[2], args[1])
  redis.call('XADD', keys[3], '*', 'e', args[3])
  return {'DONE', '1'}
end)
"""


def _fence(task: Task) -> Fence:
    assert task.attempt_id is not None
    return Fence(task.task_id, task.attempt_id, task.claim_generation, task.claim_epoch or 1, 0)


async def _callers(
    calls: int, concurrency: int, fenced_call: Callable[[int, int], Awaitable[None]]
) -> None:
    """``calls`` fenced calls, ``fenced_call(caller, n)``, from ``concurrency`` callers."""
    numbers = iter(range(calls))

    async def caller(i: int) -> None:
        for n in numbers:
            await fenced_call(i, n)

    await asyncio.gather(*(caller(i) for i in range(concurrency)))


async def _real(url: str, calls: int, concurrency: int, prefix: str = "fg") -> None:
    store = RedisStore(url, POLICY, timeout_ms=10_000, key_prefix=prefix)
    if prefix != "fg":  # the base phase: say whose store this is
        print(f"base store: {sys.modules[RedisStore.__module__].__file__}", file=sys.stderr)
    await store.open()
    tasks = []
    for i in range(concurrency):
        await store.put_task(f"t{i}", "in", None)
        tasks.append(await store.claim(f"t{i}", ClaimRequest("w", 600_000, 1)))

    async def fenced_call(i: int, n: int) -> None:
        task = tasks[i]
        request = EffectRequest(_fence(task), "node", f"s{n}", "pay", "POST", "/p", "d" * 64)
        outcome = await store.prepare_effect(request, 30_000)
        assert task.attempt_id is not None
        await store.complete_effect(
            task.task_id, outcome.effect.effect_id, outcome.seq, task.attempt_id,
            EffectState.COMMITTED, "200", RESPONSE,
        )  # fmt: skip

    await _callers(calls, concurrency, fenced_call)
    await store.close()  # its last catch-up included


async def _floor(url: str, calls: int, concurrency: int) -> None:
    client = aioredis.Redis.from_url(url, decode_responses=True)
    record = '{"effect_id":"' + "e" * 64 + '","state":"PREPARED","pad":"' + "p" * 500 + '"}'
    event = '{"type":"effect","effectId":"' + "e" * 64 + '","state":"PREPARED","at":1}'

    async def fenced_call(i: int, n: int) -> None:
        eid = f"{n:064x}"
        effects = f"fb:{{t{i}}}:effects"
        await client.fcall(
            "floor_prepare", 5, "fb:scheduler", f"fb:{{t{i}}}:task", effects,
            "fb:prepared", "fb:events", eid, record, event,
        )  # fmt: skip
        await client.fcall(
            "floor_complete", 3, effects, "fb:prepared", "fb:events", eid, record, event
        )

    await _callers(calls, concurrency, fenced_call)
    await client.aclose()


def _stats(client: redis.Redis) -> dict[str, tuple[int, int]]:
    stats: dict[str, Any] = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in stats.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=4000, help="fenced calls per phase")
    parser.add_argument("--concurrency", type=int, default=16, help="callers at once")
    parser.add_argument("--busy", type=int, default=0, help="busy loops running meanwhile")
    add_store_bench_options(parser)
    args = parser.parse_args(argv)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    top = Path(tempfile.mkdtemp(prefix="fencegate-bench-steps-"))
    proc, url, version = start_redis(args.redis_server, top / "redis", "everysec")
    try:
        admin = redis.Redis.from_url(url, decode_responses=True)
        admin.function_load(FLOOR, replace=True)
        rows = [["phase", "µs per fenced call", "of which", "µs per command (per fenced call)"]]
        results: dict[str, float] = {}
        phases = ("base", "real", "floor") if args.base_src else ("real", "floor")
        for phase in phases:
            admin.config_resetstat()
            if phase == "base":
                print(
                    run_phase_in(
                        args.base_src,
                        f"bench.redis_steps._real({url!r}, {args.calls}, {args.concurrency}, "
                        "'fgbase')",
                    ),
                    end="",
                )
            elif phase == "real":
                asyncio.run(_real(url, args.calls, args.concurrency))
            else:
                asyncio.run(_floor(url, args.calls, args.concurrency))
            stats = _stats(admin)
            scripts = {k: v for k, v in stats.items() if k in ("fcall", "evalsha", "eval")}
            total = sum(usec for _, usec in scripts.values()) / args.calls
            results[phase] = total
            split = ", ".join(
                f"{k} {usec / args.calls:.1f}" for k, (_, usec) in sorted(scripts.items())
            )
            inner = ", ".join(
                f"{k} {usec / calls:.2f} ({calls / args.calls:.2f})"
                for k, (calls, usec) in sorted(stats.items())
                if k not in scripts and k != "incr" and calls >= args.calls // 4
            )
            rows.append([phase, f"{total:.1f}", split, inner])
        admin.close()
        print(
            f"redis {version}, {args.calls} fenced calls per phase, concurrency "
            f"{args.concurrency}, {args.busy} busy loops\n"
        )
        print(align(rows))
        print(f"\nfloor / real: {results['floor'] / results['real']:.2f}")
        if "base" in results:
            print(f"real / base: {results['real'] / results['base']:.2f}")
            print(f"floor / base: {results['floor'] / results['base']:.2f}")
    finally:
        proc.stop()
        for loop in busy:
            loop.kill()
        shutil.rmtree(top, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
