"""Auto-pipelining of the Redis store, measured at the store (no HTTP around it).

``--concurrency`` callers share one ``RedisStore`` and each runs a fenced call's two store steps
(``prepare_effect``, ``complete_effect``) in a loop, on a private redis-server (AOF on); each
round runs pipelining off (``pipeline=False``, one round trip per call) then on. Per phase it
prints fenced calls/s, this process's CPU per call (where the store runs: a gateway's share)
and redis-server's CPU per call, read from ``/proc``; with ``--paced RATE``, the p50/p99 latency
of calls started at a fixed rate instead.

    .venv/bin/python -m bench.redis_pipelining --concurrency 16 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence

import redis

from bench._procs import free_port
from fencegate.ledger.effects import EffectRequest, EffectState, Fence
from fencegate.ledger.redis_store import RedisStore
from fencegate.ledger.tasks import ClaimRequest, LeasePolicy, Task

POLICY = LeasePolicy(max_ttl_ms=600_000, default_max_runtime_ms=6_000_000)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _paced(
    store: RedisStore, tasks: list[Task], pipeline: bool, rate: float, calls: int
) -> str:
    """Open loop: a fenced call every 1/rate s (round robin over the tasks), each timed from
    its scheduled start; p50/p99 of the two store steps together."""
    took: list[float] = []

    async def one(task: Task, k: int, due: float) -> None:
        assert task.attempt_id is not None
        fence = Fence(task.task_id, task.attempt_id, task.claim_generation, 1, 0)
        request = EffectRequest(fence, "n", f"p-{k}", "d", "POST", "/p", "d" * 64)
        out = await store.prepare_effect(request, 30_000)
        await store.complete_effect(
            task.task_id, out.effect.effect_id, out.seq, task.attempt_id,
            EffectState.COMMITTED, "200", '{"status":200}',
        )  # fmt: skip
        took.append(time.perf_counter() - due)

    start = time.perf_counter()  # uvloop's loop.time() counts whole milliseconds
    running = []
    for k in range(calls):
        due = start + k / rate
        await asyncio.sleep(max(due - time.perf_counter(), 0))
        running.append(asyncio.ensure_future(one(tasks[k % len(tasks)], k, due)))
    await asyncio.gather(*running)
    took.sort()
    p50, p99 = took[len(took) // 2] * 1000, took[int(len(took) * 0.99)] * 1000
    mode = "on " if pipeline else "off"
    return f"pipeline {mode}  {calls:6d}  @{rate:.0f}/s  p50 {p50:.2f} ms  p99 {p99:.2f} ms"


async def _phase(
    url: str,
    pipeline: bool,
    concurrency: int,
    calls: int,
    redis_pid: int,
    prefix: str,
    rate: float = 0,
) -> str:
    store = RedisStore(url, POLICY, pipeline=pipeline, key_prefix=prefix)
    await store.open()
    tasks: list[Task] = []
    for i in range(concurrency):
        await store.put_task(f"t{i}", "in", None)
        tasks.append(await store.claim(f"t{i}", ClaimRequest("w", 600_000, 1)))

    async def caller(task: Task, count: int, tag: str) -> None:
        assert task.attempt_id is not None
        fence = Fence(task.task_id, task.attempt_id, task.claim_generation, 1, 0)
        for k in range(count):
            request = EffectRequest(fence, "n", f"{tag}-{k}", "d", "POST", "/p", "d" * 64)
            out = await store.prepare_effect(request, 30_000)
            await store.complete_effect(
                task.task_id, out.effect.effect_id, out.seq, task.attempt_id,
                EffectState.COMMITTED, "200", '{"status":200}',
            )  # fmt: skip

    try:
        await asyncio.gather(*(caller(t, 20, "warm") for t in tasks))
        if rate:
            return await _paced(store, tasks, pipeline, rate, calls)
        each = max(calls // concurrency, 1)
        cpu, server, wall = time.process_time(), _cpu_s(redis_pid), time.monotonic()
        await asyncio.gather(*(caller(t, each, "m") for t in tasks))
        cpu, server = time.process_time() - cpu, _cpu_s(redis_pid) - server
        wall = time.monotonic() - wall
    finally:
        await store.close()
    n = each * concurrency
    return (
        f"pipeline {'on ' if pipeline else 'off'}  {n:6d}  {n / wall:8.0f}  "
        f"{cpu * 1000 / n:14.3f}  {server * 1000 / n:16.3f}"
    )


async def _run(args: argparse.Namespace) -> None:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH")
    port = free_port()
    with tempfile.TemporaryDirectory() as work:
        server = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", work, "--save", "",
             "--appendonly", "yes", "--appendfsync", args.appendfsync],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            client = redis.Redis(port=port)
            for _ in range(100):
                try:
                    client.ping()
                    break
                except redis.exceptions.ConnectionError:
                    time.sleep(0.05)
            client.close()
            url = f"redis://127.0.0.1:{port}/0"
            print(
                f"fenced calls at the store (concurrency {args.concurrency}, appendfsync "
                f"{args.appendfsync}, {os.cpu_count()} CPUs)\n"
                "phase         calls   calls/s  CPU ms/call  Redis CPU ms/call"
            )
            for r in range(args.rounds):
                for pipeline in (False, True):
                    line = await _phase(
                        url, pipeline, args.concurrency, args.calls, server.pid,
                        f"b{r}{pipeline:d}", args.paced,
                    )  # fmt: skip
                    print(line, flush=True)
        finally:
            server.terminate()
            server.wait()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.redis_pipelining", description=__doc__)
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent callers")
    parser.add_argument("--calls", type=int, default=1600, help="measured fenced calls per phase")
    parser.add_argument("--rounds", type=int, default=3, help="off/on pairs")
    parser.add_argument(
        "--paced", type=float, default=0, metavar="RATE",
        help="open loop at RATE fenced calls/s instead (latency from each scheduled start)",
    )  # fmt: skip
    parser.add_argument("--appendfsync", choices=("always", "everysec"), default="always")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - a dependency on Linux
        asyncio.run(_run(args))
    else:
        uvloop.run(_run(args))


if __name__ == "__main__":
    main()
