"""What one task, one effect and one tombstone cost in each store: the sizing rule of
docs/operations.md ("Retention and the store's size").

For each store (a private, durable server, as the other benchmarks start them), through the
store interface the gateway uses:

1. ``--tasks`` tasks put, claimed and committed with no effect: bytes per task;
2. as many again with ``--effects`` effects each (PREPARED, then COMMITTED with a stored
   response of ~60 bytes, as a small JSON API answers): bytes per effect (the difference,
   per effect);
3. the retention sweep expires them all (``settled_ms`` passed on the test clock): what the
   tombstones left behind cost, per task with its effects.

Sizes are the stores' own ``store_stats().bytes`` (SQLite: used pages; Redis: used_memory;
PostgreSQL: fencegate's tables and indexes), so the rule is in the unit operators watch.
Deltas over thousands of records: page and allocator granularity average out.

    python -m bench.store_size [--stores sqlite,redis,postgres] [--tasks 2000] [--effects 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench._args import ALL_STORES, parse_stores
from bench._procs import align, progress, start_postgres, start_redis
from fencegate.ledger.effects import EffectRequest, EffectState, Fence
from fencegate.ledger.registry import open_store
from fencegate.ledger.store import Store
from fencegate.ledger.tasks import ClaimRequest, CommitRequest, LeasePolicy

RESPONSE = json.dumps(
    {"status": 200, "headers": {"Content-Type": "application/json"}, "body": '{"id":"ch_1","ok":1}'}
)
SETTLED_MS = 1_000
TOMBSTONE_MS = 86_400_000


async def _fill(store: Store, prefix: str, tasks: int, effects: int) -> None:
    """``tasks`` committed tasks with ``effects`` COMMITTED effects each, 16 at a time."""

    async def one(i: int) -> None:
        task_id = f"{prefix}-{i:06d}"
        await store.put_task(task_id, f"input-{task_id}", None)
        task = await store.claim(task_id, ClaimRequest("worker", 60_000, 1))
        assert task.attempt_id is not None
        fence = Fence(task_id, task.attempt_id, task.claim_generation, 1, 0)
        for slot in range(effects):
            request = EffectRequest(
                fence, "main", f"s{slot}", "payments", "POST", "/v1/charges", f"d{slot:063d}"
            )
            prepared = await store.prepare_effect(request, 30_000)
            await store.complete_effect(
                task_id, prepared.effect.effect_id, 0, task.attempt_id,
                EffectState.COMMITTED, "200", RESPONSE,
            )  # fmt: skip
        await store.commit(
            task_id,
            CommitRequest(task.attempt_id, task.claim_generation, 1, 0, f"input-{task_id}", "r"),
        )

    for start in range(0, tasks, 16):
        await asyncio.gather(*(one(i) for i in range(start, min(start + 16, tasks))))


async def _size(store: Store) -> int:
    stats = await store.store_stats(SETTLED_MS)
    if stats.bytes is None:
        raise SystemExit(f"{store.kind}: the store does not report its size")
    return stats.bytes


async def measure(url: str, tasks: int, effects: int) -> dict[str, Any]:
    store = open_store(
        url, LeasePolicy(max_ttl_ms=600_000, default_max_runtime_ms=3_600_000), timeout_ms=10_000
    )
    await store.open()
    try:
        empty = await _size(store)
        await _fill(store, "bare", tasks, 0)
        bare = await _size(store)
        await _fill(store, "full", tasks, effects)
        full = await _size(store)
        store.clock_offset_ms += 2 * SETTLED_MS
        while (await store.expire_settled(SETTLED_MS, TOMBSTONE_MS, 500)).examined:
            pass
        swept = await _size(store)
        stats = await store.store_stats(SETTLED_MS)
    finally:
        await store.close()
    per_task = (bare - empty) / tasks
    per_effect = (full - bare - (bare - empty)) / (tasks * effects) if effects else 0.0
    return {
        "store": store.kind,
        "tasks": tasks,
        "effects_per_task": effects,
        "bytes_empty": empty,
        "bytes_per_task": round(per_task),
        "bytes_per_effect": round(per_effect),
        "bytes_after_expiry": swept,
        "tombstones": {"tasks": stats.task_tombstones, "effects": stats.effect_tombstones},
        "tasks_left": stats.tasks,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.store_size", description=__doc__)
    parser.add_argument("--stores", default=",".join(ALL_STORES))
    parser.add_argument("--tasks", type=int, default=2_000)
    parser.add_argument("--effects", type=int, default=2)
    parser.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    stores = parse_stores(parser, args.stores, ",".join(ALL_STORES))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fg-store-size-") as tmp:
        top = Path(tmp)
        for kind in stores:
            progress(f"{kind}: {args.tasks} tasks, then {args.tasks} with {args.effects} effects")
            if kind == "sqlite":
                rows.append(
                    asyncio.run(measure(f"sqlite:///{top}/size.db", args.tasks, args.effects))
                )
            elif kind == "redis":
                proc, url, _ = start_redis(args.redis_server, top / "redis", "always")
                try:
                    rows.append(asyncio.run(measure(url, args.tasks, args.effects)))
                finally:
                    proc.stop()
            else:
                pg, urls, _ = start_postgres(top / "pg", top, ["size"])
                try:
                    rows.append(asyncio.run(measure(urls[0], args.tasks, args.effects)))
                finally:
                    pg.stop()
    header = ["store", "bytes/task", "bytes/effect", "left after expiry (tombstones)"]
    table = [header] + [
        [
            r["store"],
            str(r["bytes_per_task"]),
            str(r["bytes_per_effect"]),
            f"{r['bytes_after_expiry'] - r['bytes_empty']} bytes "
            f"({r['tombstones']['tasks']} task, {r['tombstones']['effects']} effect tombstones)",
        ]
        for r in rows
    ]
    print(align(table))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
