"""The coordination API: tasks, claims, leases, commits, the scheduler epoch.

Each handler parses and bounds its input, makes one store call (one atomic step), logs one
decision event and answers. Refusals travel as ``FencegateError`` to the problem middleware;
the handler logs them first so every decision, granted or not, leaves exactly one event.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog
from aiohttp import web

from fencegate.gateway.api_models import (
    ClaimBody,
    CommitBody,
    IdentityBody,
    PutTaskBody,
    RenewBody,
    check_task_id,
    parse_body,
)
from fencegate.gateway.principals import principal_of
from fencegate.gateway.state import CONFIG, METRICS, STORE
from fencegate.ledger.errors import BadRequest, FencegateError, PayloadTooLarge, StoreUnavailable
from fencegate.ledger.queries import TaskFilter
from fencegate.ledger.store import decode_task_cursor, encode_task_cursor
from fencegate.ledger.tasks import (
    ClaimRequest,
    CommitRequest,
    Identity,
    PutOutcome,
    RenewRequest,
    Scheduler,
    TaskState,
    task_to_json,
)

__all__ = ["MAX_TASK_PAGE", "routes"]

log = structlog.get_logger("fencegate.coordination")
#: One stable event name per put outcome, spelled out so tests/test_log_events.py can read them.
_PUT_EVENTS = {
    PutOutcome.CREATED: "task.created",
    PutOutcome.REVISED: "task.revised",
    PutOutcome.UNCHANGED: "task.unchanged",
}
T = TypeVar("T")

routes = web.RouteTableDef()


async def _decide(
    request: web.Request,
    event: str,
    fields: dict[str, Any],
    step: Callable[[], Awaitable[T]],
    point: str | None = None,
    granted: Callable[[T], str] = lambda result: "granted",
) -> T:
    """Run one store step, logging ``<event>.rejected`` with the code when it is refused, and
    counting the acceptance point's decision (``point``: claim, renew or commit; a granted
    one under ``granted(result)``)."""
    try:
        result = await step()
    except FencegateError as exc:
        log.info(f"{event}.rejected", code=exc.code, reason=exc.detail, **fields)
        if point is not None:
            request.app[METRICS].decision(
                point, exc.code, validated=not isinstance(exc, StoreUnavailable)
            )
        raise
    if point is not None:
        request.app[METRICS].decision(point, None, validated=True, granted=granted(result))
    return result


def _scheduler_json(scheduler: Scheduler) -> dict[str, Any]:
    return {"schedulerEpoch": scheduler.epoch, "claimsPaused": scheduler.claims_paused}


def _principal(request: web.Request) -> str | None:
    """The caller's principal name, bound to the claims it makes (None without ``[auth]``)."""
    principal = principal_of(request)
    return principal.name if principal is not None else None


def _identity(request: web.Request, body: IdentityBody) -> Identity:
    return Identity(
        attempt_id=body.attemptId,
        claim_generation=body.claimGeneration,
        owner=body.owner,
        scheduler_epoch=body.schedulerEpoch,
        cancel_generation=body.cancelGeneration,
        principal=_principal(request),
    )


@routes.post(r"/v1/tasks/{task_id:.+}/claim")
async def claim(request: web.Request) -> web.Response:
    task_id = check_task_id(request.match_info["task_id"])
    body = parse_body(await request.read(), ClaimBody)
    req = ClaimRequest(
        owner=body.owner,
        ttl_ms=body.ttlMs,
        scheduler_epoch=body.schedulerEpoch,
        expected_revision=body.expectedRevision,
        principal=_principal(request),
    )
    fields = {"task": task_id, "owner": body.owner, "epoch": body.schedulerEpoch}
    task = await _decide(
        request, "claim", fields, lambda: request.app[STORE].claim(task_id, req), "claim"
    )
    assert task.lease_expires_at is not None and task.attempt_started_at is not None
    if task.previous_lease_expires_at is not None:
        waited = max(task.attempt_started_at - task.previous_lease_expires_at, 0) / 1000
        request.app[METRICS].reclaim_latency.observe(waited)
    log.info(
        "claim.granted",
        task=task_id,
        attempt=task.attempt_id,
        generation=task.claim_generation,
        epoch=task.claim_epoch,
        owner=task.owner,
        lease_expires_at=task.lease_expires_at,
    )
    return web.json_response(
        {
            "taskId": task.task_id,
            "attemptId": task.attempt_id,
            "claimGeneration": task.claim_generation,
            "schedulerEpoch": task.claim_epoch,
            "cancelGeneration": task.cancel_generation,
            "leaseExpiresAt": task.lease_expires_at,
            "grantedTtlMs": task.lease_expires_at - task.attempt_started_at,
            "revision": task.revision,
            "inputDigest": task.input_digest,
        }
    )


@routes.post(r"/v1/tasks/{task_id:.+}/renew")
async def renew(request: web.Request) -> web.Response:
    task_id = check_task_id(request.match_info["task_id"])
    body = parse_body(await request.read(), RenewBody)
    req = RenewRequest(identity=_identity(request, body), ttl_ms=body.ttlMs)
    fields = {
        "task": task_id,
        "attempt": body.attemptId,
        "generation": body.claimGeneration,
        "epoch": body.schedulerEpoch,
    }
    task = await _decide(
        request, "renew", fields, lambda: request.app[STORE].renew(task_id, req), "renew"
    )
    log.info("renew.granted", lease_expires_at=task.lease_expires_at, **fields)
    return web.json_response({"leaseExpiresAt": task.lease_expires_at})


@routes.post(r"/v1/tasks/{task_id:.+}/release")
async def release(request: web.Request) -> web.Response:
    task_id = check_task_id(request.match_info["task_id"])
    body = parse_body(await request.read(), IdentityBody)
    ident = _identity(request, body)
    fields = {
        "task": task_id,
        "attempt": body.attemptId,
        "generation": body.claimGeneration,
        "epoch": body.schedulerEpoch,
    }
    task = await _decide(
        request, "release", fields, lambda: request.app[STORE].release(task_id, ident)
    )
    log.info("release.done", **fields)
    return web.json_response({"taskId": task.task_id, "state": task.state.value})


@routes.post(r"/v1/tasks/{task_id:.+}/commit")
async def commit(request: web.Request) -> web.Response:
    task_id = check_task_id(request.match_info["task_id"])
    body = parse_body(await request.read(), CommitBody)
    result_json = None
    if "result" in body.model_fields_set:
        result_json = json.dumps(body.result, sort_keys=True, separators=(",", ":"))
        limit = request.app[CONFIG].leases.max_result_bytes
        if len(result_json.encode()) > limit:
            raise PayloadTooLarge(f"result is over leases.max_result_bytes ({limit} bytes)")
    req = CommitRequest(
        attempt_id=body.attemptId,
        claim_generation=body.claimGeneration,
        scheduler_epoch=body.schedulerEpoch,
        cancel_generation=body.cancelGeneration,
        input_digest=body.inputDigest,
        result_digest=body.resultDigest,
        result_json=result_json,
        principal=_principal(request),
    )
    fields = {
        "task": task_id,
        "attempt": body.attemptId,
        "generation": body.claimGeneration,
        "epoch": body.schedulerEpoch,
    }
    task, replay = await _decide(
        request,
        "commit",
        fields,
        lambda: request.app[STORE].commit(task_id, req),
        "commit",
        lambda done: "replayed" if done[1] else "committed",
    )
    assert task.commit is not None
    if not replay:
        request.app[METRICS].attempts_per_task.observe(task.claim_generation)
        if task.ready_at is not None:
            ready = max(task.commit.committed_at - task.ready_at, 0) / 1000
            request.app[METRICS].ready_to_commit.observe(ready)
    log.info(
        "commit.replayed" if replay else "commit.committed",
        commit_id=task.commit.commit_id,
        result_digest=body.resultDigest,
        **fields,
    )
    return web.json_response({"outcome": "COMMITTED", "commitId": task.commit.commit_id})


@routes.post(r"/v1/tasks/{task_id:.+}/cancel")
async def cancel(request: web.Request) -> web.Response:
    task_id = check_task_id(request.match_info["task_id"])
    raw = await request.read()
    if raw.strip() not in (b"", b"{}"):
        raise BadRequest("cancel takes no body (or an empty JSON object)")
    task = await _decide(
        request, "cancel", {"task": task_id}, lambda: request.app[STORE].cancel(task_id)
    )
    log.info("task.cancelled", task=task_id, cancel_generation=task.cancel_generation)
    return web.json_response({"cancelGeneration": task.cancel_generation})


@routes.put(r"/v1/tasks/{task_id:.+}")
async def put_task(request: web.Request) -> web.Response:
    task_id = check_task_id(request.match_info["task_id"])
    body = parse_body(await request.read(), PutTaskBody)
    limit = request.app[CONFIG].leases.max_runtime_ms_limit
    if body.maxRuntimeMs is not None and body.maxRuntimeMs > limit:
        raise BadRequest(f"maxRuntimeMs: must be at most leases.max_runtime_ms_limit ({limit})")
    task, outcome = await _decide(
        request,
        "task",
        {"task": task_id},
        lambda: request.app[STORE].put_task(task_id, body.inputDigest, body.maxRuntimeMs),
    )
    log.info(
        _PUT_EVENTS[outcome],
        task=task_id,
        revision=task.revision,
        input_digest=task.input_digest,
    )
    status = 201 if outcome is PutOutcome.CREATED else 200
    return web.json_response(task_to_json(task), status=status)


#: Most tasks one page of ``GET /v1/tasks`` holds.
MAX_TASK_PAGE = 500
_TASK_QUERY = frozenset({"state", "owner", "cursor", "limit"})
_ASCII_DIGITS = re.compile(r"[0-9]{1,6}")


def _task_filter(request: web.Request) -> tuple[TaskFilter, int, str | None]:
    """``GET /v1/tasks``'s query: the filter (with the caller's scope), the page size and the
    task id to continue after; a bad parameter is 400 naming it."""
    query = request.query
    unknown = set(query) - _TASK_QUERY
    if unknown:
        raise BadRequest(f"unknown query parameter(s): {', '.join(sorted(unknown))}")
    for name in _TASK_QUERY:
        if len(query.getall(name, [])) > 1:
            raise BadRequest(f"{name}: given more than once")
    state = query.get("state")
    if state is not None and state not in TaskState.__members__:
        raise BadRequest(f"state: one of {', '.join(TaskState.__members__)}")
    owner = query.get("owner")
    if owner is not None and not 1 <= len(owner) <= 200:
        raise BadRequest("owner: 1 to 200 characters")
    raw_limit = query.get("limit", "100")
    if not _ASCII_DIGITS.fullmatch(raw_limit) or not 1 <= int(raw_limit) <= MAX_TASK_PAGE:
        raise BadRequest(f"limit: an integer from 1 to {MAX_TASK_PAGE}")
    cursor = query.get("cursor")
    if cursor is not None and (not cursor or len(cursor) > 400):
        raise BadRequest("cursor: not a cursor this gateway issued")
    after = decode_task_cursor(cursor) if cursor is not None else None
    principal = principal_of(request)
    prefixes = principal.scope.task_prefixes if principal is not None else None
    wanted = TaskFilter(TaskState(state) if state else None, owner, prefixes)
    return wanted, int(raw_limit), after


@routes.get("/v1/tasks")
async def list_tasks(request: web.Request) -> web.Response:
    """Tasks in task id order, filtered; a principal whose scope limits task prefixes sees
    only those tasks. A page may be short (even empty) while ``nextCursor`` is set: the
    store reads a bounded number of records per call."""
    wanted, limit, after = _task_filter(request)
    found, last = await request.app[STORE].list_tasks(wanted, limit, after)
    return web.json_response(
        {
            "tasks": [task_to_json(task) for task in found],
            "nextCursor": encode_task_cursor(last) if last is not None else None,
        }
    )


@routes.get(r"/v1/tasks/{task_id:.+}")
async def get_task(request: web.Request) -> web.Response:
    task_id = check_task_id(request.match_info["task_id"])
    task = await request.app[STORE].get_task(task_id)
    return web.json_response(task_to_json(task))


@routes.get("/v1/epoch")
async def get_epoch(request: web.Request) -> web.Response:
    return web.json_response(_scheduler_json(await request.app[STORE].get_scheduler()))


@routes.post("/v1/epoch/bump")
async def bump_epoch(request: web.Request) -> web.Response:
    scheduler = await request.app[STORE].bump_epoch()
    log.warning("epoch.bumped", epoch=scheduler.epoch)
    return web.json_response(_scheduler_json(scheduler))


@routes.post("/v1/claims/pause")
async def pause_claims(request: web.Request) -> web.Response:
    scheduler = await request.app[STORE].set_claims_paused(True)
    log.warning("claims.paused", epoch=scheduler.epoch)
    return web.json_response(_scheduler_json(scheduler))


@routes.post("/v1/claims/resume")
async def resume_claims(request: web.Request) -> web.Response:
    scheduler = await request.app[STORE].set_claims_paused(False)
    log.warning("claims.resumed", epoch=scheduler.epoch)
    return web.json_response(_scheduler_json(scheduler))
