"""What the SDK raises: one exception class per problem ``code`` of the wire contract.

The tree::

    FencegateError                       root of everything the SDK raises on purpose
    ├── GatewayUnreachable               no answer from the gateway (connect failed, timed
    │   │                                out, connection broke): the call may or may not
    │   │                                have been applied; every fencegate call is safe to
    │   │                                repeat as it was (the ledger and commit replay)
    │   └── ClientTimeout                the SDK's own timeout fired first (``timeout_s``,
    │                                    ``downstream``): keep it above the downstream's
    │                                    ``timeout_ms``
    ├── LeaseLost                        the lease is gone: a renewal or call was refused
    │                                    (``cause`` holds the refusal) or the lease would
    │                                    run out before a renewal got through (``cause`` None)
    └── ProblemError                     the gateway answered application/problem+json
        ├── BadRequest                   400 BAD_REQUEST
        │   └── IdempotencyKeyRequired   400: the downstream takes lease-less calls only
        │                                with an ``Idempotency-Key``
        ├── Unauthenticated, Forbidden   401 UNAUTHENTICATED, 403 FORBIDDEN
        ├── NotFound                     404 NOT_FOUND (no such route)
        │   └── NoSuchTask*, NoSuchEffect, NoSuchDownstream
        │       (410 TaskExpired*, EffectExpired: gone with retention)
        ├── MethodNotAllowed             405 METHOD_NOT_ALLOWED
        ├── Conflict                     409: the fence or the ledger says no
        │   ├── Fenced*, LeaseExpired*, StaleEpoch*, Cancelled*, StaleInput*,
        │   │   RuntimeExceeded*, AlreadyCommitted*
        │   ├── Claimed, DependenciesPending
        │   └── EffectInFlight (``retry_after``), EffectUnknown, EffectSettled,
        │       ApprovalRequired
        ├── ClaimRefused                 the claim is gone: every class marked * above
        │                                (404, 409 and 410 alike; ``LEASE_ENDING_CODES``)
        ├── EventsGone                   410 EVENTS_GONE: resume position past the history
        ├── PayloadTooLarge              413 PAYLOAD_TOO_LARGE
        ├── PayloadConflict              422 PAYLOAD_CONFLICT
        ├── RateLimited                  429 RATE_LIMITED (``retry_after``)
        ├── InternalError                500 INTERNAL
        ├── DownstreamUnreachable        502: certainly not delivered, nothing happened
        ├── Unavailable                  503
        │   └── ClaimsPaused, StoreUnavailable, AuthUnavailable (``retry_after``)
        └── DownstreamTimeout            504: the effect is now UNKNOWN

The table is the SDK's own copy of the server's (``fencegate.ledger.errors``: the SDK a
worker installs loads none of the server). ``tests/test_sdk_errors.py`` holds the two to
each other: the same codes, statuses and ``ClaimRefused`` family, drift either way fails.

A problem whose ``code`` this SDK does not know (a newer gateway) is a plain
``ProblemError`` (or the class of its status) carrying that ``code``: switch on ``code``,
never on ``title`` or ``detail``. A downstream's own error answer (say a 400 from the
payments API) is not an exception: ``Lease.request`` returns it as a response.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from multidict import CIMultiDict

__all__ = [
    "ERRORS_BY_CODE",
    "LEASE_ENDING_CODES",
    "AlreadyCommitted",
    "ApprovalRequired",
    "AuthUnavailable",
    "BadRequest",
    "Cancelled",
    "ClaimRefused",
    "Claimed",
    "ClaimsPaused",
    "ClientTimeout",
    "Conflict",
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
    "GatewayUnreachable",
    "HttpVersionNotSupported",
    "IdempotencyKeyRequired",
    "InternalError",
    "LeaseExpired",
    "LeaseLost",
    "MethodNotAllowed",
    "MisdirectedRequest",
    "NoSuchDownstream",
    "NoSuchEffect",
    "NoSuchTask",
    "NotFound",
    "PayloadConflict",
    "PayloadTooLarge",
    "ProblemError",
    "RateLimited",
    "RequestTimeout",
    "RuntimeExceeded",
    "StaleEpoch",
    "StaleInput",
    "StoreUnavailable",
    "TaskExpired",
    "TooManyConnections",
    "Unauthenticated",
    "Unavailable",
    "UnsupportedMediaType",
    "error_from_problem",
]

#: Problem ``type`` URIs of the gateway's own answers (a downstream's problem+json differs).
PROBLEM_TYPE_PREFIX = "urn:fencegate:problem:"


class FencegateError(Exception):
    """Root of every error the SDK raises on purpose."""


class GatewayUnreachable(FencegateError):
    """The gateway did not answer. The call may or may not have been applied."""


class ClientTimeout(GatewayUnreachable):
    """The SDK's own timeout fired before the gateway answered: nothing failed at the gateway
    yet, the SDK stopped waiting. A subclass of ``GatewayUnreachable`` so that handlers of "no
    answer" keep working; its own class so that the fix (a longer ``timeout_s``) is not lost
    in "unreachable".

    A proxied call legitimately waits up to its downstream's ``timeout_ms`` at the gateway,
    which the SDK cannot see, so the message names the knob on both sides.
    """

    def __init__(
        self, method: str, path: str, *, url: str, timeout_s: float, downstream: str | None
    ) -> None:
        self.method = method
        self.path = path
        self.url = url
        self.timeout_s = timeout_s
        #: The downstream of a proxied call (``/proxy/{downstream}/...``), else None.
        self.downstream = downstream
        if downstream is not None:
            why = (
                f"a call proxied to {downstream!r} waits at the gateway up to that "
                f"downstream's timeout_ms: set timeout_s above it. The call may have been "
                f"forwarded: retrying the same call is safe (same effect id: replayed, or "
                f"EffectInFlight / EffectUnknown)"
            )
        else:
            why = (
                "the gateway (or its store) answers slower than that: raise timeout_s or "
                "check the gateway's /readyz. The call may have been applied: every "
                "fencegate call is safe to repeat as it was"
            )
        super().__init__(
            f"{method} {path}: no answer from the gateway at {url} within the SDK's "
            f"timeout_s={timeout_s:g} (Client(timeout=...), or timeout_s= of this call); {why}"
        )


class LeaseLost(FencegateError):
    """The lease is gone; the worker must stop producing effects under it.

    ``cause`` is the gateway's refusal that ended it (``Fenced``, ``StaleEpoch``...), or
    ``None`` when the lease ran out before a renewal got through.
    """

    def __init__(self, task_id: str, reason: str, cause: ProblemError | None = None) -> None:
        self.task_id = task_id
        self.reason = reason
        self.cause = cause
        super().__init__(f"lease on {task_id!r} lost: {reason}")

    @property
    def code(self) -> str | None:
        """The problem code that ended the lease (``None``: it ran out locally)."""
        return self.cause.code if self.cause is not None else None


class ProblemError(FencegateError):
    """The gateway refused: an RFC 9457 problem with a stable ``code``."""

    code: str = "UNKNOWN_PROBLEM"
    status: int = 0

    def __init__(
        self,
        detail: str,
        *,
        status: int | None = None,
        code: str | None = None,
        title: str = "",
        problem: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        self.detail = detail
        self.title = title
        #: The whole problem body (extra members such as ``retryAfterMs`` included).
        self.problem: dict[str, Any] = dict(problem or {})
        #: The answer's headers (``Retry-After``, ``Fence-Effect-*`` on proxied calls).
        self.headers: CIMultiDict[str] = CIMultiDict(headers or {})
        super().__init__(f"{self.status} {self.code}: {detail}")

    @property
    def effect_id(self) -> str | None:
        """The effect the refusal concerns (proxied calls and the ledger API), if any."""
        value = self.headers.get("Fence-Effect-Id") or self.problem.get("effectId")
        return str(value) if value else None

    @property
    def effect_state(self) -> str | None:
        """``Fence-Effect-State`` of a proxied refusal (``UNKNOWN`` after a timeout...)."""
        value = self.headers.get("Fence-Effect-State") or self.problem.get("effectState")
        return str(value) if value else None


class BadRequest(ProblemError):
    code, status = "BAD_REQUEST", 400


class IdempotencyKeyRequired(BadRequest):
    """A call without a lease to a downstream with ``client_idempotency_keys = "required"``
    came without an ``Idempotency-Key`` (or, on MCP, ``_meta["dev.fencegate/idempotencyKey"]``):
    nothing was recorded or sent. Send it again with a key (``Client.request``)."""

    code = "IDEMPOTENCY_KEY_REQUIRED"


class Unauthenticated(ProblemError):
    code, status = "UNAUTHENTICATED", 401


class Forbidden(ProblemError):
    code, status = "FORBIDDEN", 403


class ClaimRefused(ProblemError):
    """The claim the call carried is not, or can no longer be, the task's current one: the
    task was claimed again, cancelled, committed, given a new input, or is gone. Whatever the
    attempt was doing under that claim must stop (the SDK ends the lease on any of them:
    ``LEASE_ENDING_CODES``). A family across statuses (404, 409, 410), as on the server, so
    each member is also the class of its status (``NoSuchTask`` a ``NotFound``, ``Fenced`` a
    ``Conflict``)."""


class NotFound(ProblemError):
    code, status = "NOT_FOUND", 404


class MethodNotAllowed(ProblemError):
    """The route exists, not with this method (the ``Allow`` header lists the ones it has)."""

    code, status = "METHOD_NOT_ALLOWED", 405


class NoSuchTask(NotFound, ClaimRefused):
    """No such task: never created, or (``TaskExpired``) gone with retention. A
    ``ClaimRefused`` too: a claim on a task that is gone is gone."""

    code = "NO_SUCH_TASK"


class NoSuchEffect(NotFound):
    code = "NO_SUCH_EFFECT"


class TaskExpired(NoSuchTask):
    """410: the task settled and its record went with retention; the same input is not run
    again (``expiredAt``, ``revision`` in ``problem``)."""

    code, status = "TASK_EXPIRED", 410


class EffectExpired(NoSuchEffect):
    """410: the effect settled and its record went with its task's retention."""

    code, status = "EFFECT_EXPIRED", 410


class NoSuchDownstream(NotFound):
    code = "NO_SUCH_DOWNSTREAM"


class Conflict(ProblemError):
    """409: well formed, but the fence or the ledger refuses it."""

    status = 409


class Fenced(Conflict, ClaimRefused):
    """Another attempt has claimed the task since (or the claim was released)."""

    code = "FENCED"


class LeaseExpired(Conflict, ClaimRefused):
    code = "LEASE_EXPIRED"


class StaleEpoch(Conflict, ClaimRefused):
    """The scheduler epoch was bumped: every claim of an older epoch is fenced."""

    code = "STALE_EPOCH"


class Cancelled(Conflict, ClaimRefused):
    code = "CANCELLED"


class StaleInput(Conflict, ClaimRefused):
    """The task has a newer input revision."""

    code = "STALE_INPUT"


class RuntimeExceeded(Conflict, ClaimRefused):
    """The attempt reached its maximum runtime: its lease cannot be extended."""

    code = "RUNTIME_EXCEEDED"


class Claimed(Conflict):
    """Another attempt holds an unexpired lease on the task."""

    code = "CLAIMED"


class AlreadyCommitted(Conflict, ClaimRefused):
    """The task already has its canonical commit: this attempt has nothing left to do."""

    code = "ALREADY_COMMITTED"


class DependenciesPending(Conflict):
    """The task is WAITING: a dependency has no canonical commit yet (the detail names
    them). Wait for them (``Client.wait_committed``) or claim from the queue instead."""

    code = "DEPENDENCIES_PENDING"


class EventsGone(ProblemError):
    """The event position to resume from is older than the history the store keeps: events
    were missed. Re-read the state you follow (``get_task``, ``list_tasks``) and subscribe
    again from now (``Client.events()`` without ``after``)."""

    code, status = "EVENTS_GONE", 410


class EffectInFlight(Conflict):
    """The same effect is being forwarded right now; ask again after ``retry_after`` s."""

    code = "EFFECT_IN_FLIGHT"

    @property
    def retry_after(self) -> float | None:
        """Seconds until the running forward must have ended (``retryAfterMs``, else the
        ``Retry-After`` header)."""
        ms = self.problem.get("retryAfterMs")
        if isinstance(ms, int | float) and not isinstance(ms, bool):
            return max(float(ms), 0.0) / 1000
        header = self.headers.get("Retry-After", "")
        return float(header) if header.isdigit() else None


class EffectUnknown(Conflict):
    """An earlier forward of this effect has an unknown outcome: an operator (or the
    downstream's reconciler) must settle it before anything is sent again."""

    code = "EFFECT_UNKNOWN"


class EffectSettled(Conflict):
    """An operator tried to resolve or approve an effect that already has an outcome."""

    code = "EFFECT_SETTLED"


class ApprovalRequired(Conflict):
    """A non-replayable effect waits for an operator's approval."""

    code = "APPROVAL_REQUIRED"


class PayloadTooLarge(ProblemError):
    code, status = "PAYLOAD_TOO_LARGE", 413


class PayloadConflict(ProblemError):
    """This effect (task, revision, node, slot) is bound to a different payload."""

    code, status = "PAYLOAD_CONFLICT", 422


class InternalError(ProblemError):
    code, status = "INTERNAL", 500


class DownstreamUnreachable(ProblemError):
    """The downstream could not be reached: nothing was delivered, it may go again."""

    code, status = "DOWNSTREAM_UNREACHABLE", 502


class Unavailable(ProblemError):
    status = 503


class ClaimsPaused(Unavailable):
    code = "CLAIMS_PAUSED"


class StoreUnavailable(Unavailable):
    code = "STORE_UNAVAILABLE"


class DownstreamTimeout(ProblemError):
    """Delivered or maybe delivered, no answer in time: the effect is now UNKNOWN."""

    code, status = "DOWNSTREAM_TIMEOUT", 504


class DownstreamBusy(Unavailable):
    """No pooled connection to the downstream in time: nothing was sent, it may go again
    (after ``Retry-After``)."""

    code = "DOWNSTREAM_BUSY"


class _AskLater(ProblemError):
    """A refusal that says when to ask again."""

    @property
    def retry_after(self) -> float | None:
        """Seconds to wait (``retryAfterMs``, else the ``Retry-After`` header)."""
        ms = self.problem.get("retryAfterMs")
        if isinstance(ms, int | float) and not isinstance(ms, bool):
            return max(float(ms), 0.0) / 1000
        header = self.headers.get("Retry-After", "")
        return float(header) if header.isdigit() else None


class TooManyConnections(_AskLater, Unavailable):
    """The gateway is at a bound of open connections, event streams or waiting long-polls
    (its own or this principal's); nothing was done. Ask again after ``retry_after`` s."""

    code = "TOO_MANY_CONNECTIONS"


class AuthUnavailable(_AskLater, Unavailable):
    """The gateway cannot fetch the OAuth issuer's signing keys now to check this token
    ([auth.oauth]); nothing was done. Ask again after ``retry_after`` seconds."""

    code = "AUTH_UNAVAILABLE"


class RateLimited(_AskLater):
    """The principal is over its rate or its requests in flight ([auth]); nothing was done.
    Ask again after ``retry_after`` seconds."""

    code, status = "RATE_LIMITED", 429


class RequestTimeout(ProblemError):
    """The request body did not arrive in time."""

    code, status = "REQUEST_TIMEOUT", 408


class UnsupportedMediaType(ProblemError):
    code, status = "UNSUPPORTED_MEDIA_TYPE", 415


class MisdirectedRequest(ProblemError):
    """The ``Host`` is not one this gateway answers for."""

    code, status = "MISDIRECTED_REQUEST", 421


class HttpVersionNotSupported(ProblemError):
    code, status = "HTTP_VERSION_NOT_SUPPORTED", 505


def _leaves() -> dict[str, type[ProblemError]]:
    found: dict[str, type[ProblemError]] = {}
    pending: list[type[ProblemError]] = [ProblemError]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if "code" in cls.__dict__ and cls is not ProblemError:
            found[cls.code] = cls
    return found


#: problem ``code`` -> the class raised for it.
ERRORS_BY_CODE: dict[str, type[ProblemError]] = _leaves()
#: Status -> the class for a code this SDK does not know.
_BY_STATUS: dict[int, type[ProblemError]] = {
    400: BadRequest,
    401: Unauthenticated,
    403: Forbidden,
    404: NotFound,
    405: MethodNotAllowed,
    409: Conflict,
    413: PayloadTooLarge,
    422: PayloadConflict,
    500: InternalError,
    502: DownstreamUnreachable,
    408: RequestTimeout,
    415: UnsupportedMediaType,
    421: MisdirectedRequest,
    429: RateLimited,
    503: Unavailable,
    504: DownstreamTimeout,
    505: HttpVersionNotSupported,
}
#: Refusals after which a lease can no longer act: the SDK stops using it. The codes of the
#: ``ClaimRefused`` family, one meaning of "the claim is gone" (the server's
#: ``CLAIM_REFUSED_CODES``, held to it by tests/test_sdk_errors.py).
LEASE_ENDING_CODES: frozenset[str] = frozenset(
    code for code, cls in ERRORS_BY_CODE.items() if issubclass(cls, ClaimRefused)
)


def error_from_problem(
    status: int, problem: Mapping[str, Any] | None, headers: Mapping[str, str] | None = None
) -> ProblemError:
    """The typed exception for one problem answer of the gateway."""
    problem = problem or {}
    code = problem.get("code")
    detail = str(problem.get("detail") or problem.get("title") or f"HTTP {status}")
    title = str(problem.get("title") or "")
    if isinstance(code, str) and code in ERRORS_BY_CODE:
        cls = ERRORS_BY_CODE[code]
        return cls(detail, status=status, title=title, problem=problem, headers=headers)
    cls = _BY_STATUS.get(status, ProblemError)
    return cls(
        detail,
        status=status,
        code=code if isinstance(code, str) else f"HTTP_{status}",
        title=title,
        problem=problem,
        headers=headers,
    )
