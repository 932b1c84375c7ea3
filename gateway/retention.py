"""Retention in the gateway: the sweep loop, the store's size as metrics, and
``GET /v1/store/stats`` (what ``fencegate store stats`` prints).

The rules (what may go, what stays behind) are ``ledger.retention``'s; each sweep step is one
atomic store step (``Store.expire_settled``), so every gateway on a store sweeps and none
needs to be elected. The loop goes on at once while a step finds work and sleeps
``retention.interval_ms`` otherwise, so a backlog drains without a burst: one bounded step at
a time, each a short transaction or script.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import structlog
from aiohttp import web

from fencegate.gateway import answers
from fencegate.gateway.answers import reply
from fencegate.gateway.state import CONFIG, METRICS, STORE
from fencegate.ledger.errors import FencegateError

__all__ = ["retention_loop", "routes"]

log = structlog.get_logger("fencegate.retention")
routes = web.RouteTableDef()

#: Most steps one pass runs before it sleeps (a pass that found this much work carries on
#: after the interval): bounds how long one gateway keeps the store busy in a row.
MAX_STEPS_PER_PASS = 1_000


@routes.get("/v1/store/stats")
async def store_stats(request: web.Request) -> web.Response:
    config = request.app[CONFIG].retention
    stats = await request.app[STORE].store_stats(config.settled_ms)
    request.app[METRICS].set_store_stats(stats)
    return reply(answers.StoreStats.of(stats, config.settled_ms, config.enabled))


async def retention_loop(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``: every ``retention.interval_ms``, sweep (when enabled) until a step
    finds nothing, then refresh the store-size metrics."""
    config = app[CONFIG].retention
    stopping = asyncio.Event()

    async def sweep() -> None:
        store, metrics = app[STORE], app[METRICS]
        tasks = effects = forgotten = 0
        kept: dict[str, int] = {}
        for _ in range(MAX_STEPS_PER_PASS):
            if stopping.is_set():
                break
            report = await store.expire_settled(
                config.settled_ms, config.tombstone_ms, config.batch
            )
            tasks += report.expired_tasks
            effects += report.expired_effects
            forgotten += report.forgotten
            for reason, n in report.kept.items():
                kept[reason] = kept.get(reason, 0) + n
            if report.examined < config.batch and report.forgotten < config.batch:
                break
        metrics.expired.labels("tasks").inc(tasks)
        metrics.expired.labels("effects").inc(effects)
        metrics.expired.labels("tombstones").inc(forgotten)
        if tasks or effects or forgotten or kept:
            log.info(
                "store.expired",
                tasks=tasks,
                effects=effects,
                tombstones_forgotten=forgotten,
                kept=kept,
                settled_ms=config.settled_ms,
            )

    async def run() -> None:
        failing = False
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(config.interval_ms / 1000):
                    await stopping.wait()
            if stopping.is_set():
                return
            try:
                if config.enabled:
                    await sweep()
                app[METRICS].set_store_stats(await app[STORE].store_stats(config.settled_ms))
            except FencegateError as exc:
                if not failing:
                    failing = True
                    log.warning("store.expire_failed", code=exc.code, reason=exc.detail)
                continue
            except Exception:
                log.exception("store.expire_crashed")
                continue
            failing = False

    task = asyncio.get_running_loop().create_task(run(), name="fencegate-retention")
    yield
    stopping.set()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, TimeoutError):
        async with asyncio.timeout(5):
            await task
