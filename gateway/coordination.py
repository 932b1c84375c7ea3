"""The coordination API: tasks, claims, leases, commits, the scheduler epoch.

Each handler parses and bounds its input, makes one store call (one atomic step), logs one
decision event and answers. Refusals travel as ``FencegateError`` to the problem middleware;
the handler logs them first so every decision, granted or not, leaves exactly one event.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog
from aiohttp import web
from multidict import MultiMapping

from fencegate.gateway import answers
from fencegate.gateway.answers import reply
from fencegate.gateway.api_models import (
    ClaimBody,
    CommitBody,
    IdentityBody,
    PutTaskBody,
    QueueClaimBody,
    ReleaseBody,
    RenewBody,
    check_queue,
    check_task_id,
    parse_body,
)
from fencegate.gateway.principals import (
    Principal,
    acting_operator,
    principal_of,
    scope_refusal,
)
from fencegate.gateway.state import CONFIG, EVENTS, METRICS, STORE
from fencegate.ledger.errors import (
    BadRequest,
    FencegateError,
    Forbidden,
    PayloadTooLarge,
    StoreUnavailable,
)
from fencegate.ledger.queries import TaskFilter
from fencegate.ledger.store import Store, decode_task_cursor, encode_task_cursor
from fencegate.ledger.tasks import (
    ClaimRequest,
    CommitRequest,
    Identity,
    PutOutcome,
    RenewRequest,
    Scheduler,
    Task,
    TaskState,
)

__all__ = [
    "FENCED_COST_CODES",
    "MAX_TASK_PAGE",
    "bump_epoch_now",
    "routes",
    "set_claims_paused",
    "task_filter",
]

log = structlog.get_logger("fencegate.coordination")
#: One stable event name per put outcome, spelled out so tests/test_log_events.py can read them.
_PUT_EVENTS = {
    PutOutcome.CREATED: "task.created",
    PutOutcome.REVISED: "task.revised",
    PutOutcome.UNCHANGED: "task.unchanged",
}
T = TypeVar("T")
#: A renew, release or commit refused with one of these ends its attempt's work: the cost the
#: call reported counts as discarded (reason ``fenced``). Each is decided after the call's
#: identity matched the current attempt (``tasks.check_holder``), so only the attempt's
#: holder can add to it. Not ``FENCED``: a forged attemptId is refused with it too, and an
#: attempt another claim took over had its tally counted by that claim (docs/decisions.md).
FENCED_COST_CODES = frozenset(
    {"STALE_EPOCH", "CANCELLED", "STALE_INPUT", "LEASE_EXPIRED", "RUNTIME_EXCEEDED"}
)
Cost = tuple[tuple[str, float], ...]

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
    _count_discards(request, result)
    return result


def _count_discards(request: web.Request, result: object) -> None:
    """Every attempt a store step threw away (``Task.discarded``), with the cost it had
    reported, into ``fencegate_discarded_*``."""
    task = result[0] if isinstance(result, tuple) and result else result
    if isinstance(task, Task):
        metrics = request.app[METRICS]
        for discard in task.discarded:
            metrics.discard(discard.reason, discard.cost)


def _cost(request: web.Request, given: dict[str, float] | None) -> Cost:
    """A body's ``cost``, checked against ``tasks.cost_units`` (counted by ``_holding`` once
    the store decided)."""
    if not given:
        return ()
    units = request.app[CONFIG].tasks.cost_units
    unknown = sorted(set(given) - set(units))
    if unknown:
        listed = ", ".join(units) or "none"
        raise BadRequest(
            "; ".join(
                f"cost.{unit}: not a unit of tasks.cost_units ({listed})" for unit in unknown
            ),
            fields=[f"cost.{unit}" for unit in unknown],
        )
    return tuple(sorted(given.items()))


async def _holding(
    request: web.Request,
    event: str,
    fields: dict[str, Any],
    step: Callable[[], Awaitable[T]],
    cost: Cost,
    point: str | None = None,
    granted: Callable[[T], str] = lambda result: "granted",
) -> T:
    """``_decide`` for a call of the attempt holding the lease (renew, release, commit): the
    cost it reported counts as reported once the store accepted the call; a refusal made
    after the identity matched that ends the attempt's work (``FENCED_COST_CODES``) counts
    it as discarded; any other refusal counts it nowhere (anyone may send a body)."""
    try:
        result = await _decide(request, event, fields, step, point, granted)
    except FencegateError as exc:
        if exc.code in FENCED_COST_CODES:
            request.app[METRICS].discard(None, cost)
        raise
    request.app[METRICS].report_cost(cost)
    return result


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
    return _claim_answer(request, task)


def _claim_answer(request: web.Request, task: Task, queue: str | None = None) -> web.Response:
    """The answer of a granted claim, by id or from a queue (the same JSON)."""
    assert task.lease_expires_at is not None and task.attempt_started_at is not None
    if task.previous_lease_expires_at is not None:
        waited = max(task.attempt_started_at - task.previous_lease_expires_at, 0) / 1000
        request.app[METRICS].reclaim_latency.observe(waited)
    log.info(
        "claim.granted",
        task=task.task_id,
        queue=queue,
        attempt=task.attempt_id,
        generation=task.claim_generation,
        epoch=task.claim_epoch,
        owner=task.owner,
        lease_expires_at=task.lease_expires_at,
    )
    return reply(answers.ClaimGranted.of(task))


def client_gone(request: web.Request) -> bool:
    """The client closed its connection (read as the transport stands now: the event loop
    marks it when the close arrives, whatever the handler is doing)."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def _for_nobody(
    request: web.Request, task: Task | None, claim: ClaimRequest, fields: dict[str, Any]
) -> web.Response:
    """A queue claim whose client is gone: no claim is made (``task`` None), or the one made
    meanwhile is released at once (a release the store refuses leaves the lease to expire,
    as before). One ``claim.client_gone`` event; the 204 goes nowhere."""
    if task is None:
        log.info("claim.client_gone", claimed=False, **fields)
        return web.Response(status=204)
    assert task.attempt_id is not None and task.claim_epoch is not None
    identity = Identity(
        attempt_id=task.attempt_id,
        claim_generation=task.claim_generation,
        owner=claim.owner,
        scheduler_epoch=task.claim_epoch,
        cancel_generation=task.cancel_generation,
        principal=claim.principal,
    )
    try:
        await request.app[STORE].release(task.task_id, identity)
    except FencegateError as exc:
        log.warning("claim.client_gone", claimed=True, released=False, task=task.task_id,
                    code=exc.code, reason=exc.detail, **fields)  # fmt: skip
    else:
        log.info("claim.client_gone", claimed=True, released=True, task=task.task_id, **fields)
    return web.Response(status=204)


@routes.post(r"/v1/queues/{queue}/claim")
async def claim_next(request: web.Request) -> web.Response:
    """The best claimable task of the queue, claimed; 204 when there is none (after up to
    ``waitMs``, bounded by ``tasks.max_wait_ms``)."""
    queue = check_queue(request.match_info["queue"])
    body = parse_body(await request.read(), QueueClaimBody)
    principal = principal_of(request)
    if principal is not None and principal.scope.task_prefixes is not None:
        reason = "a principal limited to task_prefixes cannot claim from a queue"
        log.info("auth.out_of_scope", principal=principal.name, method=request.method,
                 path="/v1/queues/{queue}/claim", reason=reason)  # fmt: skip
        raise Forbidden(f"{principal.name!r}: {reason}; claim tasks by id")
    req = ClaimRequest(
        owner=body.owner,
        ttl_ms=body.ttlMs,
        scheduler_epoch=body.schedulerEpoch,
        principal=principal.name if principal is not None else None,
    )
    tasks_config = request.app[CONFIG].tasks
    wait_ms = min(body.waitMs or 0, tasks_config.max_wait_ms)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_ms / 1000
    metrics = request.app[METRICS]
    store = request.app[STORE]
    fields = {"queue": queue, "owner": body.owner, "epoch": body.schedulerEpoch}

    async def attempt() -> Task | None:
        try:
            return await store.claim_next(queue, req)
        except FencegateError as exc:
            if not isinstance(exc, StoreUnavailable):
                exc.about(f"queue {queue}")  # what it refused: a claim from this queue
            log.info("claim.rejected", code=exc.code, reason=exc.detail, **fields)
            metrics.decision("claim", exc.code, validated=not isinstance(exc, StoreUnavailable))
            raise

    task = await attempt()
    waited_ms = 0  # how long it really waited (for the log)
    if task is None and wait_ms:
        # Past tasks.max_waiters(_per_principal): 503 (logged wait.refused), never an early
        # 204 that a client would take for an empty queue and ask again at once.
        name = req.principal
        holder = principal_of(request)
        with request.app[EVENTS].waiting(principal=name, queue=queue, holder=holder) as waiter:
            started = loop.time()
            # Again, now that an event can wake it: a task put meanwhile is not missed.
            task = await attempt() if not waiter.closed else None
            while task is None and not waiter.closed:
                left = deadline - loop.time()
                if left <= 0:
                    break
                await waiter.wait(left)
                waiter.check()  # a reload removed or narrowed its principal: refused now
                if waiter.closed:
                    break  # the gateway is shutting down: 204 now
                if client_gone(request):
                    return await _for_nobody(request, None, req, fields)  # no claim made
                task = await attempt()
            if task is None:
                waiter.check()  # refused by a reload before it waited at all
            waited_ms = round((loop.time() - started) * 1000)
    if task is not None and client_gone(request):
        # The client left while the claim was made: give it back now, so that another
        # worker claims the task at once instead of after this lease ran out.
        return await _for_nobody(request, task, req, fields)
    if task is None:
        metrics.decision("claim", None, validated=True, granted="empty")
        log.info("claim.empty", waited_ms=waited_ms, **fields)
        return web.Response(status=204)
    metrics.decision("claim", None, validated=True)
    _count_discards(request, task)
    return _claim_answer(request, task, queue)


@routes.post(r"/v1/tasks/{task_id:.+}/renew")
async def renew(request: web.Request) -> web.Response:
    task_id = check_task_id(request.match_info["task_id"])
    body = parse_body(await request.read(), RenewBody)
    cost = _cost(request, body.cost)
    req = RenewRequest(identity=_identity(request, body), ttl_ms=body.ttlMs, cost=cost)
    fields = {
        "task": task_id,
        "attempt": body.attemptId,
        "generation": body.claimGeneration,
        "epoch": body.schedulerEpoch,
    }
    task = await _holding(
        request, "renew", fields, lambda: request.app[STORE].renew(task_id, req), cost, "renew"
    )
    log.info("renew.granted", lease_expires_at=task.lease_expires_at, **fields)
    return reply(answers.Renewed.model_construct(leaseExpiresAt=task.lease_expires_at))


@routes.post(r"/v1/tasks/{task_id:.+}/release")
async def release(request: web.Request) -> web.Response:
    task_id = check_task_id(request.match_info["task_id"])
    body = parse_body(await request.read(), ReleaseBody)
    cost = _cost(request, body.cost)
    ident = _identity(request, body)
    fields = {
        "task": task_id,
        "attempt": body.attemptId,
        "generation": body.claimGeneration,
        "epoch": body.schedulerEpoch,
    }
    task = await _holding(
        request,
        "release",
        fields,
        # The store keeps no cost for a release (nothing is discarded): only the metrics.
        lambda: request.app[STORE].release(task_id, ident),
        cost,
    )
    log.info("release.done", **fields)
    return reply(answers.Released.model_construct(taskId=task.task_id, state=task.state))


@routes.post(r"/v1/tasks/{task_id:.+}/commit")
async def commit(request: web.Request) -> web.Response:
    task_id = check_task_id(request.match_info["task_id"])
    body = parse_body(await request.read(), CommitBody)
    cost = _cost(request, body.cost)
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
        cost=cost,
    )
    fields = {
        "task": task_id,
        "attempt": body.attemptId,
        "generation": body.claimGeneration,
        "epoch": body.schedulerEpoch,
    }
    task, replay = await _holding(
        request,
        "commit",
        fields,
        lambda: request.app[STORE].commit(task_id, req),
        cost,
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
    return reply(
        answers.Committed.model_construct(outcome="COMMITTED", commitId=task.commit.commit_id)
    )


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
    return reply(answers.Cancelled.model_construct(cancelGeneration=task.cancel_generation))


@routes.put(r"/v1/tasks/{task_id:.+}")
async def put_task(request: web.Request) -> web.Response:
    task_id = check_task_id(request.match_info["task_id"])
    body = parse_body(await request.read(), PutTaskBody)
    limit = request.app[CONFIG].leases.max_runtime_ms_limit
    if body.maxRuntimeMs is not None and body.maxRuntimeMs > limit:
        raise BadRequest(f"maxRuntimeMs: must be at most leases.max_runtime_ms_limit ({limit})")
    depends_on = None
    if body.dependsOn is not None:
        depends_on = tuple(dict.fromkeys(body.dependsOn))
        most = request.app[CONFIG].tasks.max_dependencies
        if len(depends_on) > most:
            raise BadRequest(
                f"dependsOn: at most tasks.max_dependencies ({most}) tasks, "
                f"{len(depends_on)} given",
                fields=["dependsOn"],
            )
        _check_dependency_scope(request, depends_on)
    task, outcome = await _decide(
        request,
        "task",
        {"task": task_id},
        lambda: request.app[STORE].put_task(
            task_id,
            body.inputDigest,
            body.maxRuntimeMs,
            queue=body.queue,
            priority=body.priority,
            depends_on=depends_on,
        ),
    )
    log.info(
        _PUT_EVENTS[outcome],
        task=task_id,
        revision=task.revision,
        input_digest=task.input_digest,
        state=task.state.value,
        queue=task.queue,
    )
    status = 201 if outcome is PutOutcome.CREATED else 200
    return reply(answers.Task.of(task), status=status)


def _check_dependency_scope(request: web.Request, depends_on: tuple[str, ...]) -> None:
    """``403`` when a ``dependsOn`` id is outside the caller's ``task_prefixes``, before the
    store is asked: a dependency reveals the other task's existence and its commit (the
    provenance), and it would tie that task's cancel and dependents bound to this one."""
    principal = principal_of(request)
    if principal is None:
        return
    outside = [
        dep
        for dep in depends_on
        if scope_refusal(principal.scope, downstream=None, task_id=dep) is not None
    ]
    if not outside:
        return
    reason = scope_refusal(principal.scope, downstream=None, task_id=outside[0])
    log.info("auth.out_of_scope", principal=principal.name, method=request.method,
             path="/v1/tasks/{task_id}", reason=f"dependsOn: {reason}")  # fmt: skip
    raise Forbidden(f"{principal.name!r}: dependsOn: {reason}", fields=["dependsOn"])


#: Most tasks one page of ``GET /v1/tasks`` holds.
MAX_TASK_PAGE = 500
_TASK_QUERY = frozenset({"state", "owner", "leaseExpired", "cursor", "limit"})
_ASCII_DIGITS = re.compile(r"[0-9]{1,6}")


def _query(request: web.Request, allowed: frozenset[str]) -> MultiMapping[str]:
    """The query string, refused (400 naming them) with parameters not in ``allowed`` or
    given more than once."""
    return _checked(request.query, allowed)


def _checked(query: MultiMapping[str], allowed: frozenset[str]) -> MultiMapping[str]:
    unknown = set(query) - allowed
    if unknown:
        raise BadRequest(f"unknown query parameter(s): {', '.join(sorted(unknown))}")
    for name in allowed:
        if len(query.getall(name, [])) > 1:
            raise BadRequest(f"{name}: given more than once")
    return query


def _task_filter(request: web.Request) -> tuple[TaskFilter, int, str | None]:
    return task_filter(request.query, principal_of(request))


def task_filter(
    given: MultiMapping[str], principal: Principal | None
) -> tuple[TaskFilter, int, str | None]:
    """``GET /v1/tasks``'s query (the console's task list reads the same): the filter (with
    ``principal``'s scope), the page size and the task id to continue after; a bad parameter
    is 400 naming it."""
    query = _checked(given, _TASK_QUERY)
    state = query.get("state")
    if state is not None and state not in TaskState.__members__:
        raise BadRequest(f"state: one of {', '.join(TaskState.__members__)}")
    owner = query.get("owner")
    if owner is not None and not 1 <= len(owner) <= 200:
        raise BadRequest("owner: 1 to 200 characters")
    raw_limit = query.get("limit", "100")
    if not _ASCII_DIGITS.fullmatch(raw_limit) or not 1 <= int(raw_limit) <= MAX_TASK_PAGE:
        raise BadRequest(f"limit: an integer from 1 to {MAX_TASK_PAGE}")
    lease_expired = query.get("leaseExpired")
    if lease_expired not in (None, "true", "false"):
        raise BadRequest("leaseExpired: true or false")
    cursor = query.get("cursor")
    if cursor is not None and (not cursor or len(cursor) > 400):
        raise BadRequest("cursor: not a cursor this gateway issued")
    after = decode_task_cursor(cursor) if cursor is not None else None
    prefixes = principal.scope.task_prefixes if principal is not None else None
    wanted = TaskFilter(
        TaskState(state) if state else None,
        owner,
        prefixes,
        lease_expired=None if lease_expired is None else lease_expired == "true",
    )
    return wanted, int(raw_limit), after


@routes.get("/v1/tasks")
async def list_tasks(request: web.Request) -> web.Response:
    """Tasks in task id order, filtered; a principal whose scope limits task prefixes sees
    only those tasks. A page may be short (even empty) while ``nextCursor`` is set: the
    store reads a bounded number of records per call."""
    wanted, limit, after = _task_filter(request)
    found, last = await request.app[STORE].list_tasks(wanted, limit, after)
    page = answers.TaskPage.model_construct(
        tasks=[answers.Task.of(task) for task in found],
        nextCursor=encode_task_cursor(last) if last is not None else None,
    )
    return reply(page)


_WAIT_QUERY = frozenset({"waitFor", "waitMs"})


def _wait_query(request: web.Request) -> tuple[TaskState | None, int]:
    """``GET /v1/tasks/{id}``'s ``waitFor`` (a state) and ``waitMs`` (clamped to
    ``tasks.max_wait_ms``; default that maximum)."""
    query = _query(request, _WAIT_QUERY)
    wanted = query.get("waitFor")
    raw_wait = query.get("waitMs")
    if wanted is None:
        if raw_wait is not None:
            raise BadRequest("waitMs: only with waitFor")
        return None, 0
    if wanted not in TaskState.__members__:
        raise BadRequest(f"waitFor: one of {', '.join(TaskState.__members__)}")
    most = request.app[CONFIG].tasks.max_wait_ms
    if raw_wait is None:
        return TaskState(wanted), most
    if not _ASCII_DIGITS.fullmatch(raw_wait):
        raise BadRequest("waitMs: an integer from 0 to 999999 (milliseconds)")
    return TaskState(wanted), min(int(raw_wait), most)


@routes.get(r"/v1/tasks/{task_id:.+}")
async def get_task(request: web.Request) -> web.Response:
    """The task record; with ``waitFor``, as soon as the task is in that state, or as it is
    when ``waitMs`` ran out (the answer's ``state`` says which)."""
    task_id = check_task_id(request.match_info["task_id"])
    wanted, wait_ms = _wait_query(request)
    store = request.app[STORE]
    task = await store.get_task(task_id)
    if wanted is None or task.state is wanted or wait_ms == 0:
        return reply(answers.Task.of(task))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_ms / 1000
    # Past tasks.max_waiters(_per_principal): 503 (logged wait.refused), never a record at
    # once that a client would take as "not yet" and ask again at once.
    name = _principal(request)
    holder = principal_of(request)
    with request.app[EVENTS].waiting(principal=name, task_id=task_id, holder=holder) as waiter:
        task = await store.get_task(task_id)  # it may have changed before the waiter was set
        # Closed: the gateway is shutting down; the record as it is now.
        while task.state is not wanted and not waiter.closed:
            left = deadline - loop.time()
            if left <= 0:
                break
            await waiter.wait(left)
            waiter.check()  # a reload removed or narrowed its principal: refused now
            task = await store.get_task(task_id)
        if task.state is not wanted:
            waiter.check()  # refused by a reload before it waited at all
    return reply(answers.Task.of(task))


@routes.get("/v1/epoch")
async def get_epoch(request: web.Request) -> web.Response:
    return reply(answers.Scheduler.of(await request.app[STORE].get_scheduler()))


@routes.post("/v1/epoch/bump")
async def bump_epoch(request: web.Request) -> web.Response:
    scheduler = await bump_epoch_now(request.app[STORE], acting_operator(request))
    return reply(answers.Scheduler.of(scheduler))


@routes.post("/v1/claims/pause")
async def pause_claims(request: web.Request) -> web.Response:
    scheduler = await set_claims_paused(request.app[STORE], True, acting_operator(request))
    return reply(answers.Scheduler.of(scheduler))


@routes.post("/v1/claims/resume")
async def resume_claims(request: web.Request) -> web.Response:
    scheduler = await set_claims_paused(request.app[STORE], False, acting_operator(request))
    return reply(answers.Scheduler.of(scheduler))


async def bump_epoch_now(store: Store, by: str) -> Scheduler:
    """Fence every claim of the current epoch: the JSON API's and the console's one path.
    ``by``: who asked (the principal, or the ``Fence-Operator`` label without ``[auth]``)."""
    scheduler = await store.bump_epoch()
    log.warning("epoch.bumped", epoch=scheduler.epoch, by=by)
    return scheduler


async def set_claims_paused(store: Store, paused: bool, by: str) -> Scheduler:
    """Pause or resume claims everywhere: the JSON API's and the console's one path."""
    scheduler = await store.set_claims_paused(paused)
    if paused:
        log.warning("claims.paused", epoch=scheduler.epoch, by=by)
    else:
        log.warning("claims.resumed", epoch=scheduler.epoch, by=by)
    return scheduler
