"""Operator views that span the whole store: ``GET /v1/rollout``.

The rollback procedure from the rollout notes: pause claims, bump the epoch, then wait until
no lease is held and no effect is PREPARED, UNKNOWN or waiting for approval before switching
worker pools. This answers exactly that question, from the store's own indexes.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from fencegate.gateway import answers
from fencegate.gateway.answers import reply
from fencegate.gateway.state import STORE
from fencegate.ledger.store import Store

__all__ = ["rollout", "rollout_json", "routes"]

routes = web.RouteTableDef()


@routes.get("/v1/rollout")
async def rollout_status(request: web.Request) -> web.Response:
    return reply(await rollout(request.app[STORE]))


async def rollout(store: Store) -> answers.Rollout:
    """The rollout checklist (the JSON API's answer, and the console's Fleet page)."""
    gauges = await store.gauges()
    scheduler = await store.get_scheduler()
    return answers.Rollout.of(scheduler, gauges)


async def rollout_json(store: Store) -> dict[str, Any]:
    """``rollout`` as JSON-ready data (what the console renders)."""
    return (await rollout(store)).wire()
