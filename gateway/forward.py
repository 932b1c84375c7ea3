"""The one forward path: every request the gateway sends to a downstream, and what it means
when one gets no answer.

Every call to a downstream goes through ``send``: ``/proxy``'s forwards (recorded, plain,
shadow), ``/mcp``'s tool calls and relays (POST messages, GET streams, DELETE), the gateway's
own MCP ``tools/list`` and the reconciler's probes. One pooled client (``HTTP_CLIENT``), one
guard against re-sends below the ledger (``send_once``), pool waits traced (``PoolWait``), no
redirects followed, time bounds that name the config key they come from (``Limits``).

A client failure becomes a ``Failure`` through ONE table, ``failure_of`` (pure, in the style
of httpx's one transport and one exception map): NOT_APPLIED when the call certainly left
nothing at the downstream (no pooled connection in time: ``busy``; the connect failed or
timed out), UNKNOWN when the downstream may have acted (a timeout after the connection, a
reset before or after the request was written, a refused re-send, a body that broke off).
What the agent then gets (which error, with which effect state, in which words) is decided
by ``failure_answer`` (pure); ``/proxy`` answers it as problem+json, ``/mcp`` as a JSON-RPC
error. The agent's words name the downstream by its configured name, the agent's own method
and path and the limit that fired, never the downstream's address: that is in the log
(``forward.failed``) and the ledger's reason is for operators.

The prepare around a recorded forward is shared here too: ``prepare_effect`` cleans up a
prepare whose store answer was lost (``abort_later``), ``resend_window`` is the one rule for
how long an UNKNOWN effect may be re-sent, and ``ForwardWindow`` bounds a prepared forward
in time (docs/decisions.md, "At most once").
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from aiohttp.typedefs import LooseHeaders
from yarl import URL

from fencegate.gateway import tracing
from fencegate.gateway.config import DownstreamConfig
from fencegate.gateway.http_client import PoolWait, ResendRefused, send_once
from fencegate.gateway.state import CONFIG, FORWARD_CLOCK, HTTP_CLIENT, PENDING_ABORTS, STORE
from fencegate.ledger import effects
from fencegate.ledger.effects import Effect, EffectRequest, EffectState, PrepareOutcome
from fencegate.ledger.errors import (
    DownstreamBusy,
    DownstreamTimeout,
    DownstreamUnreachable,
    FencegateError,
    NoSuchEffect,
    StoreUnavailable,
)
from fencegate.ledger.requests import REDACTED, request_json

__all__ = [
    "BUSY_RETRY_MS",
    "Bound",
    "Failure",
    "FailureKind",
    "ForwardFailed",
    "ForwardWindow",
    "Limits",
    "Target",
    "abort_later",
    "downstream_limits",
    "failure_answer",
    "failure_of",
    "forward_window",
    "kept_request",
    "look_up",
    "prepare_effect",
    "read_up_to",
    "resend_window",
    "send",
]

log = structlog.get_logger("fencegate.forward")

#: Retry-After of a DOWNSTREAM_BUSY answer: the pool frees up as forwards end.
BUSY_RETRY_MS = 1_000
#: A ceil_threshold no timeout reaches: aiohttp then never rounds a deadline up.
_NEVER_ROUND = float(2**31)


# --- time bounds -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Bound:
    """One time bound of a send, and how the agent's error names it
    (``downstreams.payments.timeout_ms = 10000``): the config key it comes from and its
    configured value."""

    ms: float
    named: str

    @classmethod
    def of(cls, key: str, ms: float) -> Bound:
        return cls(ms, f"{key} = {round(ms)}")


@dataclass(frozen=True, slots=True)
class Limits:
    """The time bounds of one send (None: unbounded): ``total`` from the send to the last
    byte read, ``connect`` the pool wait plus the connect, ``sock_connect`` the connect
    alone, ``read`` the longest wait for the next bytes of the answer."""

    total: Bound | None
    connect: Bound | None = None
    sock_connect: Bound | None = None
    read: Bound | None = None

    def client_timeout(self) -> aiohttp.ClientTimeout:
        def seconds(bound: Bound | None) -> float | None:
            return bound.ms / 1000 if bound is not None else None

        return aiohttp.ClientTimeout(
            total=seconds(self.total),
            connect=seconds(self.connect),
            sock_connect=seconds(self.sock_connect),
            sock_read=seconds(self.read),
            # aiohttp rounds timeouts of 5 s and more up to a whole second; these are bounds.
            ceil_threshold=_NEVER_ROUND,
        )


def downstream_limits(downstream: DownstreamConfig, *, streaming: bool = False) -> Limits:
    """An unrecorded send's bounds: the pool wait plus connect within ``connect_timeout_ms``
    (a wait past it is DOWNSTREAM_BUSY), the whole within ``timeout_ms``. A stream (an MCP
    ``GET``) runs for as long as it is open."""
    key = f"downstreams.{downstream.name}."
    connect = Bound.of(key + "connect_timeout_ms", downstream.connect_timeout)
    if streaming:
        return Limits(None, connect, connect)
    read_key = "read_timeout_ms" if downstream.read_timeout_ms is not None else "timeout_ms"
    return Limits(
        Bound.of(key + "timeout_ms", downstream.timeout_ms),
        connect,
        connect,
        Bound.of(key + read_key, downstream.read_timeout),
    )


@dataclass(frozen=True, slots=True)
class ForwardWindow:
    """When a prepared forward may still start, and how long it may run (docs/decisions.md,
    "At most once"): its first byte must leave within ``start_limit_ms`` of ``sent_at`` and
    it must end by ``sent_at + deadline_ms``, which is never later than the PREPARED
    deadline the store recorded (its clock read the prepare after ``sent_at``).

    ``clock`` is the one ``sent_at`` was read on (seconds, never stepping back): the
    gateway's monotonic clock, or one a test moves by hand, as ``limits.TokenBucket`` takes."""

    sent_at: float
    start_limit_ms: int
    deadline_ms: int
    clock: Callable[[], float] = field(default=time.monotonic, compare=False, repr=False)

    def elapsed_ms(self) -> float:
        return (self.clock() - self.sent_at) * 1000

    def start_left_ms(self) -> float:
        return self.start_limit_ms - self.elapsed_ms()

    def limits(self, downstream: DownstreamConfig) -> Limits:
        """The downstream's bounds, cut to what the window leaves: ``connect`` (pool wait
        plus connect) to the start limit, ``total`` to the deadline."""
        elapsed = self.elapsed_ms()
        start_left = max(self.start_limit_ms - elapsed, 1.0)
        run_left = max(self.deadline_ms - elapsed, 1.0)
        plain = downstream_limits(downstream)
        connect = plain.connect
        if connect is None or start_left < connect.ms:
            connect = Bound(start_left, f"proxy.forward_start_limit_ms = {self.start_limit_ms}")
        total = plain.total
        if total is None or run_left < total.ms:
            total = Bound(run_left, f"the PREPARED deadline ({round(run_left)} ms left)")
        return Limits(total, connect, plain.sock_connect, plain.read)


def forward_window(request: web.Request, sent_at: float, deadline_ms: int) -> ForwardWindow:
    """The window a forward prepared at ``sent_at`` (read from the app's ``FORWARD_CLOCK``)
    runs in."""
    start_limit_ms = request.app[CONFIG].proxy.start_limit_ms
    return ForwardWindow(sent_at, start_limit_ms, deadline_ms, clock=request.app[FORWARD_CLOCK])


def resend_window(window_ms: int | None, start_limit_ms: int) -> int | None:
    """An adapter's (or an MCP tool's) re-send window as the prepare applies it: a re-send
    admitted now may reach the downstream up to the start limit later, and must still reach
    it inside its window (counted from its first sight of the key). ``/proxy`` and ``/mcp``
    both ask this."""
    if window_ms is None:
        return None
    return max(window_ms - start_limit_ms, 0)


# --- the one table: client failure -> outcome --------------------------------------------------


class FailureKind(StrEnum):
    """How a send failed. ``busy`` and ``connect`` certainly delivered nothing."""

    #: Still waiting for a pooled connection when a bound fired: never sent.
    BUSY = "busy"
    #: The connect failed (refused, no route, name not resolved, TLS) or timed out.
    CONNECT = "connect"
    #: A bound fired once the connection was there: the request may have arrived.
    TIMEOUT = "timeout"
    #: The connection broke (reset or closed) before or after the request was written.
    RESET = "reset"
    #: The connection broke and aiohttp tried to send the request again: refused
    #: (``send_once``); the first send may have arrived.
    RESEND_REFUSED = "resend_refused"
    #: The answer's status came, then its body broke off or timed out.
    BROKE_OFF = "broke_off"


@dataclass(frozen=True, slots=True)
class Failure:
    """What a client failure means: the ``outcome`` of the effect (NOT_APPLIED or UNKNOWN)
    and the ``reason`` the ledger records; ``cause`` names the client's exception (its type,
    or the connect's errno), ``limit`` the bound that fired, ``status`` the answer's status
    when its body broke off. None of them holds the downstream's address."""

    kind: FailureKind
    outcome: EffectState
    reason: str
    cause: str
    limit: str | None = None
    status: int | None = None

    @property
    def metric(self) -> str:
        """The ``fencegate_forward_seconds`` outcome of a forward that got no answer."""
        if self.outcome is EffectState.NOT_APPLIED:
            return "unreachable"
        return "timeout" if self.limit is not None else "unknown"


def _smallest(*bounds: Bound | None) -> Bound | None:
    present = [b for b in bounds if b is not None]
    return min(present, key=lambda b: b.ms) if present else None


def _named(bound: Bound | None) -> str | None:
    return bound.named if bound is not None else None


def _cause(exc: BaseException) -> str:
    """The exception's type, and the errno's symbolic name when it has one (never its text:
    aiohttp's holds the host and port)."""
    code = exc.errno if isinstance(exc, OSError) else None
    if isinstance(exc, aiohttp.ClientConnectorError):
        code = exc.os_error.errno
    name = errno.errorcode.get(code) if isinstance(code, int) else None
    return f"{type(exc).__name__} {name}" if name else type(exc).__name__


def failure_of(exc: BaseException, *, status: int | None, waiting: bool, limits: Limits) -> Failure:
    """THE table from a client failure to its outcome. ``status``: the answer's status when
    its head had arrived; ``waiting``: the send was still queued for a pooled connection
    (``PoolWait``). Pure: ``tests/test_forward_parity.py`` holds every row."""
    name = type(exc).__name__
    cause = _cause(exc)
    if waiting:
        # It never had a connection, so nothing was sent, whichever bound fired.
        limit = _named(_smallest(limits.connect, limits.total))
        reason = f"never sent: no pooled connection in time ({name})"
        return Failure(FailureKind.BUSY, EffectState.NOT_APPLIED, reason, cause, limit)
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
        limit = None
        if isinstance(exc, TimeoutError):
            limit = _named(_smallest(limits.connect, limits.sock_connect, limits.total))
        reason = f"connect failed: {name}"
        return Failure(FailureKind.CONNECT, EffectState.NOT_APPLIED, reason, cause, limit)
    timed_out = isinstance(exc, TimeoutError)
    limit = None
    if timed_out:  # aiohttp says SocketTimeoutError when the read bound fired
        bound = limits.read if isinstance(exc, aiohttp.SocketTimeoutError) else limits.total
        limit = _named(bound or _smallest(limits.read, limits.total))
    what = "timed out" if timed_out else "failed after sending"
    suffix = f" ({limit})" if limit is not None else ""
    if status is not None:
        reason = f"response {status}, then the body {what}: {name}{suffix}"
        return Failure(FailureKind.BROKE_OFF, EffectState.UNKNOWN, reason, cause, limit, status)
    if isinstance(exc, ResendRefused):
        reason = f"failed after sending: {name} (the connection broke; no second send)"
        return Failure(FailureKind.RESEND_REFUSED, EffectState.UNKNOWN, reason, cause)
    kind = FailureKind.TIMEOUT if timed_out else FailureKind.RESET
    return Failure(kind, EffectState.UNKNOWN, f"{what}: {name}{suffix}", cause, limit)


class ForwardFailed(Exception):
    """A send broke before its answer was read: ``failure`` says what that means
    (``failure_of``), ``cause`` is the client's exception."""

    def __init__(self, failure: Failure, cause: BaseException) -> None:
        super().__init__(failure.reason)
        self.failure = failure
        self.cause = cause


# --- the decision: what the agent gets ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    """The call as the agent's error names it: the downstream's configured name, the agent's
    own method and path (no query string), and for ``/mcp`` the message (``tools/call
    charge``). ``max_connections``: ``proxy.max_connections``, named when the pool was busy.
    ``preliminary``: the failed send was the gateway's own, made before the call (the
    ``tools/list`` that learns a tool's annotations); the call itself was never sent."""

    downstream: str
    method: str
    path: str
    max_connections: int
    call: str | None = None
    preliminary: str | None = None

    def where(self) -> str:
        what = f" ({self.call})" if self.call else ""
        return f"downstream {self.downstream}: {self.method} {self.path}{what}"


def _what_happened(failure: Failure) -> str:
    """A failure in the agent's words: what happened and the limit that fired."""
    limit = f" ({failure.limit})" if failure.limit is not None else ""
    match failure.kind:
        case FailureKind.BUSY:
            return f"no pooled connection came free in time{limit}"
        case FailureKind.CONNECT:
            if failure.limit is not None:
                return f"the connect timed out{limit}"
            return f"the connect failed ({failure.cause})"
        case FailureKind.TIMEOUT:
            return f"no answer in time{limit}"
        case FailureKind.RESET:
            return f"the connection broke after it was opened ({failure.cause})"
        case FailureKind.RESEND_REFUSED:
            return "the connection broke and the gateway refused to send the call twice"
        case FailureKind.BROKE_OFF:
            how = failure.limit or failure.cause
            return f"the answer (status {failure.status}) broke off ({how})"
    raise AssertionError(failure.kind)  # pragma: no cover


def failure_answer(
    target: Target,
    failure: Failure,
    *,
    effect: Effect | None = None,
    recorded: EffectState | None = None,
) -> FencegateError:
    """What the agent gets for a send that got no answer: DOWNSTREAM_BUSY (never sent, retry
    after ``Retry-After``), DOWNSTREAM_UNREACHABLE (never sent) or DOWNSTREAM_TIMEOUT (the
    downstream may have acted). For a recorded forward (``effect``), with the effect's
    state: the ``recorded`` one after a call that left nothing (an earlier attempt's UNKNOWN
    sticks, and says so), UNKNOWN after one that may have landed. Pure."""
    where = target.where()
    happened = _what_happened(failure)
    error: FencegateError
    if target.preliminary is not None:
        return DownstreamUnreachable(
            f"{where}: {target.preliminary} failed: {happened}; the call itself was not sent"
        )
    if failure.kind is FailureKind.BUSY:
        error = DownstreamBusy(
            f"{where}: every pooled connection (proxy.max_connections = "
            f"{target.max_connections}) stayed busy while the call could wait: {happened}; "
            "nothing was sent, retry after Retry-After",
            retryAfterMs=BUSY_RETRY_MS,
        )
    elif failure.outcome is EffectState.NOT_APPLIED:
        error = DownstreamUnreachable(f"{where}: {happened}; nothing was sent")
    else:
        error = DownstreamTimeout(f"{where}: {happened}; the downstream may have acted")
    if effect is None:
        return error
    state = EffectState.UNKNOWN
    if failure.outcome is EffectState.NOT_APPLIED:
        state = recorded or EffectState.NOT_APPLIED
        if state is EffectState.UNKNOWN:
            error.detail += f"; the effect stays UNKNOWN: {effects.EARLIER_UNKNOWN}"
    error.extra.update(effectId=effect.effect_id, effectState=state.value)
    return error


# --- the send ----------------------------------------------------------------------------------


def _shown(url: URL) -> str:
    """The address as the log shows it: no user info, no query (an agent's query may hold
    its own secrets)."""
    return str(url.with_user(None).with_query(None).with_fragment(None))


@contextlib.asynccontextmanager
async def send(
    app: web.Application,
    downstream: str,
    method: str,
    url: URL | str,
    limits: Limits,
    *,
    headers: LooseHeaders | None = None,
    data: bytes | None = None,
    purpose: str = "forward",
    effect_id: str | None = None,
    mcp_meta: bool = False,
) -> AsyncIterator[aiohttp.ClientResponse]:
    """Send one request to ``downstream`` and yield its response (read it inside the block):
    once (``send_once``), with the pool wait traced, no redirect followed, within
    ``limits``. A client failure, also while the block reads the body, raises
    ``ForwardFailed`` (``failure_of``) and is logged as ``forward.failed`` with the
    client's own words (the address included: the operator's detail, never the agent's).

    With ``[tracing]`` the send is a CLIENT span (``purpose``: forward, relay, probe,
    tools_list; ``effect_id`` when it has one) whose context goes out in the headers and,
    for an MCP message (``mcp_meta``), in its ``params._meta``: added here, to what is sent
    only, long after any digest was computed."""
    target = URL(url) if isinstance(url, str) else url
    pool = PoolWait()
    status: int | None = None
    span = None
    if tracing.enabled(app):  # else nothing of the span is computed
        span = tracing.start_client(
            app,
            downstream,
            method,
            _shown(target),
            purpose=purpose,
            effect_id=effect_id,
            address=(target.host, target.port),
        )
    if span is not None:
        headers, data = span.inject(headers, data, mcp_meta=mcp_meta)
    try:
        async with app[HTTP_CLIENT].request(
            method,
            target,
            headers=headers,
            data=data,
            allow_redirects=False,
            timeout=limits.client_timeout(),
            middlewares=send_once(),
            trace_request_ctx=pool,
        ) as resp:
            status = resp.status
            if span is not None:
                span.answered(status)
            yield resp
    except (TimeoutError, aiohttp.ClientError, ResendRefused) as exc:
        failure = failure_of(exc, status=status, waiting=pool.waiting, limits=limits)
        if span is not None:
            span.failed(failure.kind.value, failure.outcome.value)
        detail = str(exc).replace(str(target), _shown(target)) or type(exc).__name__
        log.warning(
            "forward.failed",
            downstream=downstream,
            method=method,
            target=_shown(target),
            kind=failure.kind.value,
            outcome=failure.outcome.value,
            limit=failure.limit,
            error=detail,
        )
        raise ForwardFailed(failure, exc) from exc
    finally:
        if span is not None:
            span.end()


async def read_up_to(stream: aiohttp.StreamReader, limit: int) -> tuple[bytes, bool]:
    """At most ``limit + 1`` bytes of a body, and whether that was all of it: read to the
    end, however many pieces it comes in."""
    buf = bytearray()
    while len(buf) <= limit:
        chunk = await stream.read(limit + 1 - len(buf))
        if not chunk:
            return bytes(buf), True
        buf += chunk
    return bytes(buf), stream.at_eof()


# --- what an operator can see of a forward ----------------------------------------------------

#: Request headers no kept request holds, whatever the config says: the credentials an agent
#: or the gateway may send (the downstream's ``headers_from_env`` and ``never_store_headers``
#: names are left out too).
_NEVER_KEPT = frozenset({"authorization", "proxy-authorization", "cookie"})


def kept_request(
    downstream: DownstreamConfig,
    headers: Iterable[tuple[str, str]],
    body: bytes,
    credentials: Iterable[str] = (),
) -> str | None:
    """The request a forward sends as its effect record keeps it (``ledger.requests``), for
    the prepare that opens it; None (and no work) unless the downstream has
    ``keep_request_bodies``. ``headers``: as forwarded, but for the idempotency key (the
    effectId is not known before the prepare: ``ledger_api`` shows it). Left out: the
    ``Fence-*`` headers, ``_NEVER_KEPT`` and the downstream's unstored names; shown as
    ``"<redacted>"``: its ``redact_headers`` and any value holding a ``credentials`` one."""
    if not downstream.keep_request_bodies:
        return None
    drop = _NEVER_KEPT | downstream.unstored_headers
    drop |= {downstream.idempotency_key_header.lower()}
    redacted = {name.lower() for name in downstream.redact_headers}
    secrets = [value for value in credentials if value]
    kept = []
    for name, value in headers:
        lower = name.lower()
        if lower in drop or lower.startswith("fence-"):
            continue
        if lower in redacted or any(secret in value for secret in secrets):
            value = REDACTED
        kept.append((name, value))
    return request_json(
        kept,
        body,
        max_bytes=downstream.keep_request_max_bytes,
        pointers=downstream.redact_pointers,
    )


#: Where an MCP tool call carries its effectId besides the idempotency key header.
_MCP_META_KEY = 'params._meta["dev.fencegate/effectId"]'
_MCP_CALL_PATH = "/tools/call/"


def look_up(downstream: DownstreamConfig | None, effect: Effect) -> str | None:
    """What to look up at the downstream to settle an UNKNOWN effect, in words: the key it
    received (its ``idempotency_key_header`` and the effectId) and on which call; None for
    an effect in any other state. ``downstream``: its config, None when no longer
    configured."""
    if effect.state is not EffectState.UNKNOWN:
        return None
    name = effect.downstream
    if all(effects.sent_nothing(a.reason) for a in effect.attempts):
        return f"no forward of this effect reached {name!r}: it received no key"
    call = f"{effect.method} {effect.path}"
    if downstream is None:
        return (
            f"{name!r} is no longer configured: it received the effectId {effect.effect_id} "
            f"in its idempotency key header on {call}"
        )
    key = f"{downstream.idempotency_key_header}: {effect.effect_id}"
    if downstream.adapter == "mcp" and effect.path.startswith(_MCP_CALL_PATH):
        tool = effect.path.removeprefix(_MCP_CALL_PATH)
        return (
            f"the MCP server {name!r} received {key} and {_MCP_META_KEY} = "
            f"{effect.effect_id} on tools/call {tool}: look the call up there by that key"
        )
    return f"the downstream {name!r} received {key} on {call}: look the call up there by that key"


# --- the prepare a forward starts from ---------------------------------------------------------


async def prepare_effect(
    app: web.Application, request: EffectRequest, deadline_ms: int, **options: Any
) -> PrepareOutcome:
    """Step one, for ``/proxy`` and ``/mcp`` alike. A store that does not answer may still
    apply the prepare: nothing was forwarded, so the record it may have made is found by
    its forward id once the store answers again and made NOT_APPLIED (``abort_later``);
    the ``StoreUnavailable`` is raised on."""
    try:
        return await app[STORE].prepare_effect(request, deadline_ms, **options)
    except StoreUnavailable:
        abort_later(app, request, deadline_ms)
        raise


#: Pause between attempts to find and abort a prepare the store did not answer.
_ABORT_RETRY_S = 0.5


def abort_later(app: web.Application, request: EffectRequest, deadline_ms: int) -> None:
    """Find the forward's record (by its forward id) and abort it, in the background."""
    task = asyncio.get_running_loop().create_task(_abort(app, request, deadline_ms))
    pending = app[PENDING_ABORTS]
    pending.add(task)
    task.add_done_callback(pending.discard)


async def _abort(app: web.Application, request: EffectRequest, deadline_ms: int) -> None:
    """Bounded: keeps looking for the deadline plus a margin (the store may apply the prepare
    only when it recovers), then gives up; a record it never found is then one no gateway
    created, or one that reads UNKNOWN and an operator settles.

    A keyed request's record is known by its id (``request.effect_id``): no lookup by forward
    id; until the prepare lands there is no record (``NO_SUCH_EFFECT``), and looking goes on.
    Either way only the forward with this id is aborted (``effects.abort``)."""
    assert request.forward_id is not None
    store = app[STORE]
    give_up = time.monotonic() + deadline_ms / 1000 + 5
    fence = request.fence
    fields: dict[str, Any] = (
        {"task": fence.task_id, "attempt": fence.attempt_id, "slot": request.slot}
        if fence is not None
        else {"kind": "keyed"}
    )
    fields.update(downstream=request.downstream, forward_id=request.forward_id)
    forward_id = request.forward_id

    def abort(record: Effect | None, now: int) -> Effect:
        return effects.abort(record, forward_id, now)

    while time.monotonic() < give_up:
        try:
            if fence is not None:
                effect_id = await store.find_forward(fence.task_id, forward_id)
            else:
                effect_id = request.effect_id
            if effect_id is not None:
                effect = await store.update_effect(effect_id, abort)
                log.warning("effect.aborted", effect_id=effect.effect_id,
                            state=effect.state.value, **fields)  # fmt: skip
                return
        except StoreUnavailable:
            pass
        except FencegateError as exc:
            if not (fence is None and isinstance(exc, NoSuchEffect)):
                # settled meanwhile: nothing to abort
                log.info("effect.abort_skipped", code=exc.code, reason=exc.detail, **fields)
                return
            # else: the store has not applied the keyed prepare (yet)
        await asyncio.sleep(_ABORT_RETRY_S)
    log.info("effect.abort_gave_up", **fields)
