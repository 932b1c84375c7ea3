"""What a queue claim costs Redis on the cluster store (issue 30, the queues' hints).

On a private redis-server, a ``ClusterStore`` of ``--buckets`` buckets over it
(``SingleRedisBackend``: the cluster layout without the routing, so the Redis time of every
bucket is one server's ``INFO commandstats``) gets ``--tasks`` tasks in one queue, spread
over ``--groups`` task groups (so over at most that many buckets), and then claims and
commits them all from the queue, ``--concurrency`` workers at once. Reported per queue claim
and its commit (the commits are the same in both runs): the Redis server's CPU time
(``INFO cpu``, user + system: commands, scripts, and reading and answering them), the
µs of the scripts (``INFO commandstats``: the claim's and the commit's steps), and the
number of commands (a script's own commands included).

``--base-src DIR`` (a ``git archive`` of another revision, as ``bench.proxy --gateway-src``)
runs the same phase first through that revision's store, in a child process importing from
``DIR``, on the same redis-server, for a before/after in one session:

    mkdir -p /tmp/fg-head && git archive bbdfa81 | tar -x -C /tmp/fg-head
    .venv/bin/python -m bench.queue_claims --groups 8 --base-src /tmp/fg-head
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any

import redis

from bench._args import add_store_bench_options
from bench._procs import align, run_phase_in, start_redis
from fencegate.ledger.cluster_store import ClusterStore, SingleRedisBackend
from fencegate.ledger.tasks import ClaimRequest, CommitRequest, LeasePolicy

POLICY = LeasePolicy(max_ttl_ms=600_000, default_max_runtime_ms=6_000_000)


async def _phase(
    url: str, prefix: str, buckets: int, tasks: int, groups: int, workers: int
) -> None:
    backend = SingleRedisBackend(url, POLICY, timeout_ms=10_000)
    store = ClusterStore(POLICY, backend, buckets=buckets, key_prefix=prefix, timeout_ms=10_000)
    await store.open()
    for i in range(tasks):
        await store.put_task(f"g{i % groups}::t{i}", "in", None, queue="jobs")
    admin = redis.Redis.from_url(url)
    admin.config_resetstat()
    before: dict[str, Any] = admin.info("cpu")
    cpu_before = float(before["used_cpu_user"]) + float(before["used_cpu_sys"])
    claimed = 0

    async def worker() -> None:
        nonlocal claimed
        while True:
            task = await store.claim_next("jobs", ClaimRequest("w", 600_000, 1))
            if task is None:
                return
            assert task.attempt_id is not None
            await store.commit(
                task.task_id,
                CommitRequest(task.attempt_id, task.claim_generation, 1, 0, "in", "r"),
            )
            claimed += 1

    await asyncio.gather(*(worker() for _ in range(workers)))
    assert claimed == tasks, (claimed, tasks)
    stats: dict[str, Any] = admin.info("commandstats")
    cpu: dict[str, Any] = admin.info("cpu")
    used = (float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]) - cpu_before) * 1e6
    calls = sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_config")
    scripts = {"cmdstat_evalsha", "cmdstat_fcall"}
    script_usec = sum(int(v["usec"]) for k, v in stats.items() if k in scripts)
    print(f"RESULT {used / tasks:.1f} {script_usec / tasks:.1f} {calls / tasks:.1f}", flush=True)
    admin.close()
    await store.close()


def _run(source: Path | None, url: str, prefix: str, args: argparse.Namespace) -> str:
    out = run_phase_in(
        source,
        f"bench.queue_claims._phase({url!r}, {prefix!r}, {args.buckets}, {args.tasks}, "
        f"{args.groups}, {args.concurrency})",
    )
    return next(line for line in out.splitlines() if line.startswith("RESULT ")).split(" ", 1)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--buckets", type=int, default=256)
    parser.add_argument("--tasks", type=int, default=1000, help="tasks put and claimed per phase")
    parser.add_argument("--groups", type=int, default=8, help="task groups the tasks spread over")
    parser.add_argument("--concurrency", type=int, default=4, help="workers claiming at once")
    add_store_bench_options(parser)
    args = parser.parse_args(argv)
    top = Path(tempfile.mkdtemp(prefix="fencegate-bench-queue-"))
    proc, url, version = start_redis(args.redis_server, top / "redis", "everysec")
    try:
        rows = [["phase", "Redis CPU µs", "of which scripts µs", "commands"]]
        phases: list[tuple[str, Path | None]] = [("this tree", None)]
        if args.base_src is not None:
            phases.insert(0, ("base", args.base_src))
        for i, (name, source) in enumerate(phases):
            rows.append([name, *_run(source, url, f"q{i}", args).split()])
        print(
            f"redis {version}, {args.buckets} buckets, {args.tasks} tasks in {args.groups} "
            f"groups, {args.concurrency} workers\n"
        )
        print("(each per queue claim and its commit)\n")
        print(align(rows))
    finally:
        proc.stop()
        shutil.rmtree(top, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
