"""Every refusal fencegate can make, one class per problem code of the wire contract.

The tree::

    FencegateError                 (500 INTERNAL, never raised on purpose)
    ├── BadRequest                 400 BAD_REQUEST
    │   └── IdempotencyKeyRequired IDEMPOTENCY_KEY_REQUIRED (a lease-less call without a key)
    ├── Unauthenticated            401 UNAUTHENTICATED (with [auth]: no or a bad credential)
    ├── Forbidden                  403 FORBIDDEN (with [auth]: the principal's roles may not)
    ├── NotFound                   404
    │   ├── NoSuchTask             NO_SUCH_TASK (also ClaimRefused)
    │   ├── NoSuchEffect           NO_SUCH_EFFECT
    │   └── NoSuchDownstream       NO_SUCH_DOWNSTREAM
    ├── Rejected                   409: the fence said no
    │   ├── Claimed, DependenciesPending
    │   ├── Fenced, LeaseExpired, StaleEpoch, Cancelled, StaleInput, AlreadyCommitted,
    │   │   RuntimeExceeded        (also ClaimRefused: the claim is gone)
    │   └── EffectInFlight, EffectUnknown, EffectSettled, ApprovalRequired
    ├── EventsGone                 410 EVENTS_GONE (a position trimmed past, or ahead of the newest)
    ├── PayloadConflict            422 PAYLOAD_CONFLICT
    ├── PayloadTooLarge            413 PAYLOAD_TOO_LARGE
    ├── DownstreamUnreachable      502 DOWNSTREAM_UNREACHABLE
    ├── DownstreamTimeout          504 DOWNSTREAM_TIMEOUT
    ├── ClaimsPaused               503 CLAIMS_PAUSED
    ├── StoreUnavailable           503 STORE_UNAVAILABLE
    ├── RequestTimeout             408 REQUEST_TIMEOUT (the body stopped arriving)
    ├── UnsupportedMediaType       415 UNSUPPORTED_MEDIA_TYPE (a /v1 body not JSON)
    ├── MisdirectedRequest         421 MISDIRECTED_REQUEST (Host not allowed)
    ├── HttpVersionNotSupported    505 HTTP_VERSION_NOT_SUPPORTED
    ├── TooManyConnections         503 TOO_MANY_CONNECTIONS
    ├── DownstreamBusy             503 DOWNSTREAM_BUSY (no pooled connection in time)
    ├── AuthUnavailable            503 AUTH_UNAVAILABLE ([auth.oauth]: the JWKS is unreachable)
    └── RateLimited                429 RATE_LIMITED (a principal over its [auth] limits)

The pure models raise these, the stores translate their own failures into them with
``raise ... from exc``, and ``gateway.problems`` renders any of them as problem+json. Codes are
the stable part: clients switch on ``code``, never on ``title`` or ``detail``. A detail names
what it is about (``FencegateError.about``): the task, the effect, the downstream by its
configured name, the agent's method and path, the limit that fired with its config key.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Self

__all__ = [
    "CLAIM_REFUSED_CODES",
    "ERRORS_BY_CODE",
    "AlreadyCommitted",
    "ApprovalRequired",
    "AuthUnavailable",
    "BadRequest",
    "BumpBarrier",
    "Cancelled",
    "ClaimRefused",
    "Claimed",
    "ClaimsPaused",
    "DependenciesPending",
    "DownstreamBusy",
    "DownstreamTimeout",
    "DownstreamUnreachable",
    "EffectExpired",
    "EffectInFlight",
    "EffectSettled",
    "EffectUnknown",
    "EventsGone",
    "Fenced",
    "FencegateError",
    "Forbidden",
    "HttpVersionNotSupported",
    "IdempotencyKeyRequired",
    "LeaseExpired",
    "MisdirectedRequest",
    "NoSuchDownstream",
    "NoSuchEffect",
    "NoSuchTask",
    "NotFound",
    "PayloadConflict",
    "PayloadTooLarge",
    "RateLimited",
    "Rejected",
    "RequestTimeout",
    "RuntimeExceeded",
    "StaleEpoch",
    "StaleInput",
    "StoreUnavailable",
    "TaskExpired",
    "TooManyConnections",
    "Unauthenticated",
    "UnsupportedMediaType",
]


class FencegateError(Exception):
    """Root of every error fencegate answers with; carries its problem code and HTTP status."""

    code: ClassVar[str] = "INTERNAL"
    status: ClassVar[int] = 500
    title: ClassVar[str] = "Internal error"
    #: A refusal of the HTTP request itself (its credential, body, headers): the gateway
    #: names the request (method and path, no query string) in its detail.
    about_request: ClassVar[bool] = False

    def __init__(self, detail: str | None = None, **extra: Any) -> None:
        self.detail = detail or self.title
        #: Extra members for the problem body (e.g. ``retryAfterMs``), camelCase keys.
        self.extra = extra
        super().__init__(self.detail)

    def about(self, subject: str) -> Self:
        """This problem, its detail naming what it is about (``task t-1``, ``effect 3fa2...``,
        ``POST /v1/tasks/t-1/claim``) at its head unless it names it already: ``task t-1: no
        such task``. The one rule by which a refusal names its object; each store applies it
        where it refines its refusals (``sql_steps.expired_refusal``, ``RedisStore._refusal``),
        so every store says the same words. Returns ``self``."""
        if not re.search(re.escape(subject) + r"(?![\w.-]|:\S)", self.detail):
            text = self.detail
            if text == self.title:
                text = text[:1].lower() + text[1:]
            self.detail = f"{subject}: {text}"
            self.args = (self.detail,)
        return self

    def about_task(self, task_id: str) -> Self:
        return self.about(f"task {task_id}")

    def about_effect(self, effect_id: str) -> Self:
        return self.about(f"effect {effect_id}")


class BadRequest(FencegateError):
    code = "BAD_REQUEST"
    status = 400
    title = "Bad request"


class IdempotencyKeyRequired(BadRequest):
    """A lease-less mutation on ``/proxy`` (or an MCP ``tools/call``) to a downstream with
    ``client_idempotency_keys = "required"`` that carries no idempotency key: nothing was
    recorded or sent. A BadRequest, so a client that handles 400 handles it; its own code so
    a client can tell "send a key" from every other 400."""

    code = "IDEMPOTENCY_KEY_REQUIRED"
    title = "This downstream requires an idempotency key"
    about_request = True


class Unauthenticated(FencegateError):
    """No credential, or one that matches no principal (``[auth]`` configured)."""

    code = "UNAUTHENTICATED"
    status = 401
    title = "A valid credential is required"
    about_request = True


class Forbidden(FencegateError):
    """An authenticated principal none of whose roles may do this (``[auth]`` configured)."""

    code = "FORBIDDEN"
    status = 403
    title = "Not allowed for this principal"
    about_request = True


class ClaimRefused(FencegateError):
    """The caller is not (or no longer) the task's current, live attempt: whatever it was
    doing under that claim must stop. A family across statuses (404, 409): the proxy logs
    these as ``effect.fenced``, and the SDK ends the lease on any of them."""


class NotFound(FencegateError):
    status = 404


class NoSuchTask(NotFound, ClaimRefused):
    code = "NO_SUCH_TASK"
    title = "No such task"


class NoSuchEffect(NotFound):
    code = "NO_SUCH_EFFECT"
    title = "No such effect"


class TaskExpired(NoSuchTask):
    """The task settled and its record went with retention (``ledger.retention``); a
    tombstone remembers it. A NoSuchTask (so every client and rule that handles a missing
    task handles it), answered 410 so that nobody mistakes it for a typo and retries."""

    code = "TASK_EXPIRED"
    status = 410
    title = "Task expired"


class EffectExpired(NoSuchEffect):
    """The effect settled and its record went with its task's retention; a tombstone
    remembers its id and final state."""

    code = "EFFECT_EXPIRED"
    status = 410
    title = "Effect expired"


class NoSuchDownstream(NotFound):
    code = "NO_SUCH_DOWNSTREAM"
    title = "No such downstream"


class Rejected(FencegateError):
    """The request is well formed but the fence or the ledger refuses it."""

    status = 409


class Claimed(Rejected):
    code = "CLAIMED"
    title = "Another attempt holds an unexpired lease"


class DependenciesPending(Rejected):
    """A WAITING task: some dependency has no canonical commit (for its current revision)."""

    code = "DEPENDENCIES_PENDING"
    title = "The task waits for its dependencies to commit"


class EventsGone(FencegateError):
    """A resume position the feed cannot go on from without a gap (``events.gone``): older
    than the retained history (events were dropped since), or ahead of the newest event the
    store issued (it lost events it had issued: a failover, a restore)."""

    code = "EVENTS_GONE"
    status = 410
    title = "That event position is outside the store's event history"
    about_request = True


class Fenced(Rejected, ClaimRefused):
    code = "FENCED"
    title = "Not the task's current claim"


class LeaseExpired(Rejected, ClaimRefused):
    code = "LEASE_EXPIRED"
    title = "The lease has expired"


class StaleEpoch(Rejected, ClaimRefused):
    code = "STALE_EPOCH"
    title = "The scheduler epoch is not the current one"


class Cancelled(Rejected, ClaimRefused):
    code = "CANCELLED"
    title = "The task was cancelled"


class StaleInput(Rejected, ClaimRefused):
    code = "STALE_INPUT"
    title = "The task's input has a newer revision"


class AlreadyCommitted(Rejected, ClaimRefused):
    code = "ALREADY_COMMITTED"
    title = "The task already has its canonical commit"


class RuntimeExceeded(Rejected, ClaimRefused):
    code = "RUNTIME_EXCEEDED"
    title = "The attempt reached its maximum runtime"


class EffectInFlight(Rejected):
    code = "EFFECT_IN_FLIGHT"
    title = "The same effect is being forwarded right now"


class EffectUnknown(Rejected):
    code = "EFFECT_UNKNOWN"
    title = "An earlier forward of this effect has an unknown outcome"


class EffectSettled(Rejected):
    """An operator tried to resolve an effect that already has a definite outcome."""

    code = "EFFECT_SETTLED"
    title = "The effect already has a definite outcome"


class ApprovalRequired(Rejected):
    code = "APPROVAL_REQUIRED"
    title = "This effect waits for an operator's approval"


class PayloadConflict(FencegateError):
    code = "PAYLOAD_CONFLICT"
    status = 422
    title = "This effect is bound to a different payload"


class PayloadTooLarge(FencegateError):
    code = "PAYLOAD_TOO_LARGE"
    status = 413
    title = "Body over the configured limit"
    about_request = True


class DownstreamUnreachable(FencegateError):
    code = "DOWNSTREAM_UNREACHABLE"
    status = 502
    title = "The downstream could not be reached; nothing was delivered"


class DownstreamTimeout(FencegateError):
    code = "DOWNSTREAM_TIMEOUT"
    status = 504
    title = "No answer from the downstream in time; the effect is UNKNOWN"


class ClaimsPaused(FencegateError):
    code = "CLAIMS_PAUSED"
    status = 503
    title = "Claims are paused"


class StoreUnavailable(FencegateError):
    code = "STORE_UNAVAILABLE"
    status = 503
    title = "The lease store is unavailable"


class BumpBarrier(StoreUnavailable):
    """A claim met a bump's barrier in its bucket (the Redis Cluster store only,
    ``ledger.scheduler_copies.claim_admission``): an epoch bump is moving every bucket's copy
    of the scheduler, and no claim is granted anywhere meanwhile. Nothing was applied.

    Internal: it never reaches a client. The cluster store retries the claim with backoff
    (``retry_after_ms``: when the barrier stops holding claims at the latest) within its
    timeout, then answers a plain ``StoreUnavailable`` saying nothing was applied; never
    CLAIMS_PAUSED, which is the operator's alone. Should one escape anyway it is a
    STORE_UNAVAILABLE (it adds no code of its own), retryable as it truly is."""

    def __init__(self, target: int, retry_after_ms: int) -> None:
        super().__init__(
            f"an epoch bump to {target} is in progress; nothing was applied: retry the claim"
        )
        #: The epoch the bump moves every copy to.
        self.target = target
        #: Store time until the barrier stops holding claims back, at the latest.
        self.retry_after_ms = retry_after_ms


class StoreRegressed(StoreUnavailable):
    """The store lost writes this gateway saw acknowledged (a failover to a replica that
    lacked them, a restore of an older copy): its claims and effect records may be gone, so
    writes are refused until an operator acknowledges (``fencegate failover ack``). Reads go
    on. Still STORE_UNAVAILABLE on the wire: retryable, and what a client already handles."""


class StoreIncompatible(StoreUnavailable):
    """The store answered, but its schema is newer than this gateway's, or it is not what the
    URL says (a Redis Cluster node behind ``redis://``): waiting will not help, so the gateway
    refuses to start (every store) instead of waiting for the store."""


# --- refused before any handler runs (gateway/request_guard.py, docs/security.md) ------------


class RequestTimeout(FencegateError):
    """The request body did not arrive within ``server.body_timeout_ms``."""

    code = "REQUEST_TIMEOUT"
    status = 408
    title = "The request body did not arrive in time"
    about_request = True


class UnsupportedMediaType(FencegateError):
    """A body on ``/v1/*`` that is not ``application/json`` (or ``application/*+json``)."""

    code = "UNSUPPORTED_MEDIA_TYPE"
    status = 415
    title = "The body must be application/json"
    about_request = True


class MisdirectedRequest(FencegateError):
    """A ``Host`` not in ``server.allowed_hosts`` (DNS rebinding, a wrong virtual host)."""

    code = "MISDIRECTED_REQUEST"
    status = 421
    title = "This gateway does not serve that host"
    about_request = True


class HttpVersionNotSupported(FencegateError):
    code = "HTTP_VERSION_NOT_SUPPORTED"
    status = 505
    title = "Only HTTP/1.0 and HTTP/1.1 are served"


class TooManyConnections(FencegateError):
    """``server.max_connections`` are open; the new connection is answered this and closed."""

    code = "TOO_MANY_CONNECTIONS"
    status = 503
    title = "Too many open connections"
    about_request = True


class DownstreamBusy(FencegateError):
    """Every pooled connection to downstreams (``proxy.max_connections``) stayed busy for as
    long as the call could wait: it was never sent (NOT_APPLIED), retry after a pause."""

    code = "DOWNSTREAM_BUSY"
    status = 503
    title = "No free connection to the downstream; nothing was sent"


class AuthUnavailable(FencegateError):
    """``[auth.oauth]``: a token names a signing key (``kid``) the gateway does not hold and
    the issuer's JWKS cannot be fetched now, so the token can be neither accepted nor refused.
    Nothing was done; retry after ``Retry-After`` (the token may well be good)."""

    code = "AUTH_UNAVAILABLE"
    status = 503
    title = "The token's signing keys cannot be fetched now"
    about_request = True


class RateLimited(FencegateError):
    """A principal over its ``rate_per_second`` / ``burst`` or ``max_open_requests``
    ([auth], docs/security.md): nothing was done; retry after ``Retry-After``."""

    code = "RATE_LIMITED"
    status = 429
    title = "Too many requests from this principal"
    about_request = True


def _codes() -> dict[str, type[FencegateError]]:
    found: dict[str, type[FencegateError]] = {}
    pending: list[type[FencegateError]] = [FencegateError]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if "code" in cls.__dict__:
            found[cls.code] = cls
    return found


#: code -> class, so a store (or a Lua script) can name an error by its code alone.
ERRORS_BY_CODE: dict[str, type[FencegateError]] = _codes()
#: The codes of the ClaimRefused family, for clients that only see a problem's code.
CLAIM_REFUSED_CODES: frozenset[str] = frozenset(
    code for code, cls in ERRORS_BY_CODE.items() if issubclass(cls, ClaimRefused)
)
