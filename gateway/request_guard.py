"""What the gateway refuses before any handler runs (docs/security.md, "Browser and network
defaults").

In the middleware (``request_guard``, every app, with or without ``[auth]``), in this order:

* an HTTP version other than 1.0 and 1.1 is 505 ``HTTP_VERSION_NOT_SUPPORTED``;
* a ``Host`` not in ``server.allowed_hosts`` is 421 ``MISDIRECTED_REQUEST`` (``/healthz`` and
  ``/readyz`` are exempt: probes address a pod by its IP, and they reveal nothing);
* an ``Origin`` not in ``server.allowed_origins`` is 403 ``FORBIDDEN`` (no ``Origin`` is fine:
  only browsers send one);
* ``CONNECT`` is 405;
* a ``Content-Length`` above ``server.max_body_bytes`` is 413 at once, before reading;
* the body is read here, within ``server.body_timeout_ms`` (408 past it); a client that goes
  away meanwhile is one ``http.client_gone`` info event;
* a non-empty body on ``/v1/*`` that is not ``application/json`` (or ``application/*+json``)
  is 415 ``UNSUPPORTED_MEDIA_TYPE``. ``/proxy`` bodies are the downstream's business.

Each refusal is problem+json, except on ``/console/*``: there it is the console's HTML error
page, with the same status and code (a form over ``server.max_body_bytes`` is a 413 page).

At the connection (``GuardedSite``, what ``fencegate serve`` listens with): at most
``server.max_connections`` open connections (one more is answered 503
``TOO_MANY_CONNECTIONS`` and closed), at most ``server.max_connections_per_peer`` from one
peer (``peer_group``) that have not yet carried an authenticated request
(``connection_vouch``; the same 503, naming that limit), at most
``server.max_connections_per_principal`` carrying one principal's requests (the same 503 to
its request on one more, then closed), and requests aiohttp's parser refuses (malformed
request line or headers) are answered problem+json and logged as one ``http.malformed_request``
info event, with no traceback and without the client's bytes (``parser_complaint``).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import re
import ssl
import time
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler

from fencegate.gateway.config import ServerConfig, parse_listen
from fencegate.gateway.console import CONSOLE
from fencegate.gateway.principals import principal_of
from fencegate.gateway.problems import problem_body, problem_response, requested
from fencegate.gateway.state import CONFIG
from fencegate.ledger.errors import (
    BadRequest,
    FencegateError,
    Forbidden,
    HttpVersionNotSupported,
    MisdirectedRequest,
    PayloadTooLarge,
    RequestTimeout,
    TooManyConnections,
    UnsupportedMediaType,
)

__all__ = [
    "ConnectionSlots",
    "GuardedSite",
    "connection_vouch",
    "handler_factory",
    "host_allowed",
    "origin_allowed",
    "parser_complaint",
    "request_guard",
]

log = structlog.get_logger("fencegate.http")

#: Served whatever the Host: liveness and readiness reveal nothing and stay open (as with
#: ``[auth]``), and orchestrators probe by address.
_ANY_HOST = frozenset({"/healthz", "/readyz"})
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
_VERSIONS = frozenset({(1, 0), (1, 1)})


# --- Host and Origin ------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _split_host(value: str) -> tuple[str, int | None] | None:
    """``name[:port]`` as (lowercase name, port or None); None when it is not one. Cached:
    every request names one of the same few hosts (and the result is immutable)."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[: end + 1], value[end + 1 :]
    else:
        name, sep, tail = value.partition(":")
        rest = sep + tail
    if not name:
        return None
    if not rest:
        return name, None
    digits = rest[1:]
    if not (rest[0] == ":" and 1 <= len(digits) <= 5 and digits.isascii() and digits.isdigit()):
        return None
    number = int(digits)
    return (name, number) if number < 65536 else None


@functools.lru_cache(maxsize=16)
def _listen_name(listen: str) -> tuple[str, int]:
    host, port = parse_listen(listen)
    return (f"[{host}]" if ":" in host else host).lower(), port


def _default_hosts(server: ServerConfig) -> tuple[str, ...]:
    name, _ = _listen_name(server.listen)
    return tuple(dict.fromkeys((name, *_LOOPBACK_NAMES)))


@functools.lru_cache(maxsize=16)
def _host_entries(
    listen: str, allowed_hosts: tuple[str, ...] | None
) -> tuple[tuple[str, int | None], ...]:
    """The parsed ``server.allowed_hosts`` (or the defaults for ``listen``), once per config
    rather than once per request."""
    entries = allowed_hosts or tuple(dict.fromkeys((_listen_name(listen)[0], *_LOOPBACK_NAMES)))
    return tuple(parsed for parsed in map(_split_host, entries) if parsed is not None)


def host_allowed(server: ServerConfig, host: str | None) -> bool:
    """Whether ``host`` (the ``Host`` header) names this gateway. An entry without a port
    matches the name on any port (port forwarding and tunnels change the port, never the
    name a browser was told); ``name:port`` matches that port only."""
    if not host:
        return False
    parsed = _split_host(host)
    if parsed is None:
        return False
    allowed_hosts = tuple(server.allowed_hosts) if server.allowed_hosts else None
    for name, port in _host_entries(server.listen, allowed_hosts):
        if name == parsed[0] and port in (None, parsed[1]):
            return True
    return False


def _split_origin(origin: str) -> tuple[str, str, int] | None:
    scheme, sep, rest = origin.strip().lower().partition("://")
    if not sep or scheme not in ("http", "https") or not rest or any(c in rest for c in "/?#@"):
        return None
    parsed = _split_host(rest)
    if parsed is None:
        return None
    return scheme, parsed[0], parsed[1] if parsed[1] is not None else _DEFAULT_PORT[scheme]


_DEFAULT_PORT = {"http": 80, "https": 443}


def origin_allowed(server: ServerConfig, origin: str, local_port: int | None = None) -> bool:
    """Whether a browser page at ``origin`` may call the gateway. By default only the
    gateway's own origins: http (https when the listener speaks TLS) on the listen host,
    localhost, 127.0.0.1 or [::1], at the listen port or the port the connection arrived on.
    ``null`` is never allowed."""
    parsed = _split_origin(origin)
    if parsed is None:
        return False
    if server.allowed_origins is not None:
        return any(_split_origin(entry) == parsed for entry in server.allowed_origins)
    _, listen_port = _listen_name(server.listen)
    return (
        parsed[0] == ("https" if server.tls else "http")
        and parsed[1] in _default_hosts(server)
        and parsed[2] in (listen_port, local_port)
    )


# --- the middleware -------------------------------------------------------------------------


def _refuse(
    request: web.Request, error: FencegateError, *, close: bool = False
) -> web.StreamResponse:
    """The problem answer: problem+json, or on ``/console/*`` the console's own HTML error
    page with the same status and code (as every other refusal there: a browser shows a page,
    never JSON); ``close`` ends the connection after it (a body that was not read cannot be
    skipped reliably). aiohttp first reads and discards what the client still sends for up to
    its lingering time (10 s), so the client sees this answer, not a reset. The detail names
    the request (its method and path, never the query string)."""
    error.about(requested(request))
    console = request.app.get(CONSOLE)
    if console is not None and console.sessions.covers(request.path):
        response = console.sessions.refusal(request, error)
    else:
        response = problem_response(error)
    if close:
        response.force_close()
    return response


def _local_port(request: web.BaseRequest) -> int | None:
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if isinstance(sockname, tuple) and len(sockname) >= 2 and isinstance(sockname[1], int):
        return sockname[1]
    return None


def _is_json(content_type: str) -> bool:
    if content_type == "application/json":
        return True
    kind, _, subtype = content_type.partition("/")
    return kind == "application" and subtype.endswith("+json")


@web.middleware
async def request_guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    server = request.app[CONFIG].server
    if tuple(request.version) not in _VERSIONS:
        major, minor = request.version
        version = HttpVersionNotSupported(f"HTTP/{major}.{minor} is not served: use HTTP/1.1")
        return _refuse(request, version, close=True)
    if request.path not in _ANY_HOST:
        host = request.headers.get(hdrs.HOST)
        if not host_allowed(server, host):
            log.info("http.host_refused", host=host, method=request.method, path=request.path)
            return _refuse(
                request,
                MisdirectedRequest(
                    f"Host {host!r} is not one of this gateway's names (server.allowed_hosts)"
                    if host
                    else "a Host header is required"
                ),
                close=True,
            )
    origin = request.headers.get(hdrs.ORIGIN)
    if origin is not None and not origin_allowed(server, origin, _local_port(request)):
        log.info("http.origin_refused", origin=origin, method=request.method, path=request.path)
        return _refuse(
            request,
            Forbidden(f"Origin {origin!r} is not allowed (server.allowed_origins)"),
            close=True,
        )
    if request.method == hdrs.METH_CONNECT:
        problem = problem_body(405, "METHOD_NOT_ALLOWED", "Method not allowed",
                            "CONNECT is not served: this gateway is not a tunnel")  # fmt: skip
        response = web.Response(
            status=405, body=json.dumps(problem).encode(), content_type="application/problem+json"
        )
        response.force_close()
        return response
    if request.body_exists:
        refused = await _read_body(request, server)
        if refused is not None:
            return refused
        body = await request.read()  # from memory now
        if body and request.path.startswith("/v1/") and not _is_json(request.content_type):
            return _refuse(
                request,
                UnsupportedMediaType(
                    f"Content-Type {request.headers.get(hdrs.CONTENT_TYPE, '(none)')!r}: "
                    "a body on /v1 must be application/json"
                ),
            )
    return await handler(request)


@web.middleware
async def connection_vouch(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The last middleware (after ``request_guard`` read the body and the ``[auth]``
    middleware set the principal): a request that got this far with a principal, or
    complete when there is no ``[auth]``, vouches for its connection, which then no longer
    counts against ``server.max_connections_per_peer`` (``ConnectionSlots``)."""
    protocol = request.protocol
    principal = principal_of(request)
    if isinstance(protocol, _GuardedHandler):
        if principal is not None and not protocol.carry(principal.name):
            return _refuse(request, protocol.principal_busy(principal.name), close=True)
        if request.app[CONFIG].auth is None or principal is not None:
            protocol.vouch()
    return await handler(request)


async def _read_body(request: web.Request, server: ServerConfig) -> web.StreamResponse | None:
    """Read the whole body now, bounded in size and time; handlers then get it from memory
    (``request.read()`` keeps it). None when it arrived."""
    length = request.content_length
    if length is not None and length > server.max_body_bytes:
        return _refuse(
            request,
            PayloadTooLarge(
                f"Content-Length {length} is over server.max_body_bytes = {server.max_body_bytes}"
            ),
            close=True,
        )
    started = time.monotonic()
    try:
        if request.content.is_eof():  # all of it arrived with the head: nothing to wait for
            await request.read()
        else:
            async with asyncio.timeout(server.body_timeout_ms / 1000):
                await request.read()
    except TimeoutError:
        log.info("http.body_timeout", method=request.method, path=request.path,
                 peer=request.remote, timeout_ms=server.body_timeout_ms)  # fmt: skip
        # Answer and close now: aiohttp would otherwise linger (up to 10 s) reading the rest
        # of a body from a client that already stopped sending it.
        response = _refuse(
            request,
            RequestTimeout(
                f"the body did not arrive within server.body_timeout_ms = {server.body_timeout_ms}"
            ),
            close=True,
        )
        await response.prepare(request)
        await response.write_eof()
        request.protocol.force_close()  # after the answer is written; flushed before closing
        return response
    except web.HTTPRequestEntityTooLarge:
        return _refuse(
            request,
            PayloadTooLarge(f"body over server.max_body_bytes = {server.max_body_bytes}"),
            close=True,
        )
    except asyncio.CancelledError:  # aiohttp cancels on disconnect when handler_cancellation
        log.info("http.client_gone", method=request.method, path=request.path,
                 peer=request.remote, after_ms=round((time.monotonic() - started) * 1000),
                 reason="cancelled")  # fmt: skip
        raise
    except ConnectionError as exc:
        log.info("http.client_gone", method=request.method, path=request.path,
                 peer=request.remote, after_ms=round((time.monotonic() - started) * 1000),
                 reason=str(exc) or type(exc).__name__)  # fmt: skip
        return _refuse(
            request, BadRequest("the client went away before its body arrived"), close=True
        )
    except web.RequestPayloadError as exc:
        cause = exc.__cause__ or exc
        log.info("http.bad_body", method=request.method, path=request.path,
                 peer=request.remote, reason=str(cause))  # fmt: skip
        return _refuse(request, BadRequest(f"the body could not be read: {cause}"), close=True)
    return None


# --- the connection -------------------------------------------------------------------------


class ConnectionSlots:
    """Open connections against ``server.max_connections``, and per peer address those not
    yet vouched for against ``server.max_connections_per_peer`` (one event loop: no lock).

    A connection is vouched for once it carried an authenticated request (without ``[auth]``:
    a complete request; ``connection_vouch``). Until then it counts against its peer's
    bound, so one client cannot hold every slot with connections that never authenticate
    (idle ``GET /healthz`` keep-alives, or headers that never finish)."""

    def __init__(
        self,
        limit: int,
        per_peer: int = 50,
        *,
        authenticated: bool = False,
        per_principal: int | None = None,
    ) -> None:
        self.limit = limit
        self.per_peer = per_peer
        #: ``server.max_connections_per_principal`` (None: not bounded).
        self.per_principal = per_principal
        self.open = 0
        #: Peer address -> its open connections not yet vouched for.
        self.unvouched: dict[str, int] = {}
        #: Principal name -> the open connections whose last request was its.
        self.carried: dict[str, int] = {}
        self._principal_refused = 0
        self._last_principal_report = 0.0
        self._refused = 0
        self._last_report = 0.0
        self._peer_refused = 0
        self._last_peer_report = 0.0
        self.peer_busy = _busy_bytes(_peer_detail(per_peer, authenticated))
        self.busy = _busy_bytes(
            f"{limit} connections are open (server.max_connections = {limit}): try again shortly"
        )

    def admit(self, peer: str | None) -> bool:
        """Whether a new connection from ``peer`` may be served; counts it if so. A
        connection without an address (a Unix socket) is not bounded per peer."""
        if peer is None:
            return True
        held = self.unvouched.get(peer, 0)
        if held >= self.per_peer:
            return False
        self.unvouched[peer] = held + 1
        return True

    def carry(self, principal: str) -> bool:
        """Whether a connection may carry ``principal``'s requests; counts it if so."""
        held = self.carried.get(principal, 0)
        if self.per_principal is not None and held >= self.per_principal:
            self._principal_refused += 1
            now = time.monotonic()
            if now - self._last_principal_report >= 1.0:
                log.warning("http.principal_connections_refused", principal=principal,
                            refused=self._principal_refused, limit=self.per_principal)  # fmt: skip
                self._principal_refused = 0
                self._last_principal_report = now
            return False
        self.carried[principal] = held + 1
        return True

    def dropped(self, principal: str) -> None:
        """A connection that carried ``principal``'s requests closed or changed principal."""
        _count_down(self.carried, principal)

    def vouched(self, peer: str) -> None:
        """One of ``peer``'s counted connections carried what vouches for it, or closed."""
        _count_down(self.unvouched, peer)

    def refused(self) -> None:
        """Count a refused connection; report at most once a second (a flood must not flood
        the log too)."""
        self._refused += 1
        now = time.monotonic()
        if now - self._last_report >= 1.0:
            log.warning("http.connections_refused", refused=self._refused, open=self.open,
                        limit=self.limit)  # fmt: skip
            self._refused = 0
            self._last_report = now

    def peer_refused(self, peer: str) -> None:
        """Count a connection refused for its peer's bound; at most one line a second."""
        self._peer_refused += 1
        now = time.monotonic()
        if now - self._last_peer_report >= 1.0:
            log.warning("http.peer_connections_refused", refused=self._peer_refused, peer=peer,
                        limit=self.per_peer)  # fmt: skip
            self._peer_refused = 0
            self._last_peer_report = now


def _count_down(counts: dict[str, int], key: str) -> None:
    """One fewer for ``key``; gone at zero, so names that went away leave nothing behind."""
    held = counts.get(key, 0) - 1
    if held > 0:
        counts[key] = held
    else:
        counts.pop(key, None)


def _peer_detail(per_peer: int, authenticated: bool) -> str:
    carried = "an authenticated request" if authenticated else "a complete request"
    return (
        f"{per_peer} connections from this address have not yet carried {carried} "
        f"(server.max_connections_per_peer = {per_peer}): use one of them, or try again shortly"
    )


def _busy_bytes(detail: str) -> bytes:
    error = TooManyConnections(detail)
    body = json.dumps(problem_body(error.status, error.code, error.title, error.detail)).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/problem+json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Retry-After: 1\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


def _peer_host(transport: asyncio.BaseTransport) -> str | None:
    peername = transport.get_extra_info("peername")
    if isinstance(peername, tuple) and peername and isinstance(peername[0], str):
        return peer_group(peername[0])
    return None


def peer_group(host: str) -> str:
    """The peer ``server.max_connections_per_peer`` counts for a TCP peer address. Loopback
    is one peer: any local process may bind any of 127.0.0.0/8 as its source without
    privilege, so counted apart it would be millions of peers, and a same-host process
    could hold every slot (the default deployment listens on loopback). IPv6 counts per /64,
    a host's usual allocation from which it may pick addresses at will. Anything else (IPv4,
    a Unix socket's name) is itself."""
    try:
        address = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        return "loopback"
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def _refuse_connection(transport: asyncio.BaseTransport, answer: bytes) -> None:
    # uvloop's transports do not subclass asyncio.WriteTransport: ask for the method.
    write = getattr(transport, "write", None)
    if write is not None:
        write(answer)
    transport.close()


class _GuardedHandler(web.RequestHandler):
    """aiohttp's per-connection protocol, counted against the connection limit, with its
    parser-level refusals as problem+json."""

    def __init__(self, manager: web.Server, slots: ConnectionSlots, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._slots = slots
        self._over_limit = False
        #: The peer address while this connection counts against its per-peer bound.
        self._unvouched: str | None = None
        #: The principal whose request this connection last carried (counted against
        #: ``server.max_connections_per_principal``).
        self._principal: str | None = None
        #: The connection closed: aiohttp may still start a request it had buffered
        #: (pipelined before the close), which must not be counted for anyone any more.
        self._lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._slots.open >= self._slots.limit:
            self._over_limit = True
            self._slots.refused()
            _refuse_connection(transport, self._slots.busy)
            return
        peer = _peer_host(transport)
        if not self._slots.admit(peer):
            assert peer is not None
            self._over_limit = True
            self._slots.peer_refused(peer)
            _refuse_connection(transport, self._slots.peer_busy)
            return
        self._unvouched = peer
        self._slots.open += 1
        super().connection_made(transport)

    def vouch(self) -> None:
        """This connection carried what vouches for it: it no longer counts against its
        peer's bound (``connection_vouch``)."""
        if self._unvouched is not None:
            self._slots.vouched(self._unvouched)
            self._unvouched = None

    def carry(self, principal: str) -> bool:
        """This connection carries a request of ``principal``: counted as one of its
        connections (``connection_vouch``); False when it already has its bound of them."""
        if self._principal == principal or self._lost:
            return True  # a closed connection's request answers nobody: nothing to count
        if self._principal is not None:  # another principal's until now: not any more
            self._slots.dropped(self._principal)
            self._principal = None
        if not self._slots.carry(principal):
            return False
        self._principal = principal
        return True

    def principal_busy(self, principal: str) -> TooManyConnections:
        limit = self._slots.per_principal
        return TooManyConnections(
            f"{limit} connections are open carrying {principal}'s requests "
            f"(server.max_connections_per_principal = {limit}): use one of them, or close one",
            retryAfterMs=1000,
        )

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._over_limit:
            return
        self._lost = True
        self._slots.open -= 1
        self.vouch()  # closed before it was vouched for: its place is free again
        if self._principal is not None:
            self._slots.dropped(self._principal)
            self._principal = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._over_limit:
            super().data_received(data)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("the response is under way; cannot send another")
        error: FencegateError
        if isinstance(exc, HttpProcessingError) or status < 500:
            raw = message or (exc.message if isinstance(exc, HttpProcessingError) else "")
            detail, header = parser_complaint(raw or "")
            log.info("http.malformed_request", status=status, detail=detail, header=header,
                     peer=request.remote)  # fmt: skip
            if _names_unserved_version(raw or ""):
                named = ", ".join(sorted({f"HTTP/{a}.{b}" for a, b in _VERSION_TOKEN.findall(raw)}))
                error = HttpVersionNotSupported(f"{named} is not served: use HTTP/1.1")
            else:
                error = BadRequest(detail)
        else:
            log.error("http.internal_error", peer=request.remote, exc_info=exc)
            error = FencegateError("see the gateway's log")
        response = problem_response(error)
        response.force_close()
        return response


_VERSION_TOKEN = re.compile(r"HTTP/(\d+)\.(\d+)")
#: What is left of a parser's complaint once the client's bytes are cut out: words only.
_COMPLAINT = re.compile(r"[A-Za-z][A-Za-z0-9 ,-]*")
#: A quoted literal in a parser's message (``b'...'``, ``'...'``, ``"..."``).
_QUOTED = re.compile(r"b?'[^']*'" + r'|b?"[^"]*"')
#: llhttp quotes the offending header line after its reason: ``b'Name: value...'``.
_QUOTED_HEADER = re.compile(r"""\n\s*b['"]([!#$%&*+.^_`|~0-9A-Za-z-]{1,64}):""")


def parser_complaint(message: str) -> tuple[str, str | None]:
    """What may be said about a request aiohttp's parser refused: its reason (``Missing
    expected LF after header value``) and, when the C parser quoted a header line, that
    header's name; never a byte of a value. Both parsers quote the client's bytes in their
    messages (the whole offending line, or the value, or the request target), and a
    credential's line is the one that breaks when a token file has Windows line endings
    (``Authorization: Bearer abc\\r``): echoing the message put the token in the answer and
    in the log (issue 25). So only the reason before the first ``:`` survives, with quoted
    literals removed, and only if what is left is words with a space between them (a request
    target, the one unquoted thing a parser may name, has no space)."""
    first = message.strip().split("\n", 1)[0]
    reason = _QUOTED.sub("", first.split(":", 1)[0])
    reason = " ".join(reason.split()).rstrip(".,")
    if not (" " in reason and _COMPLAINT.fullmatch(reason)):
        reason = "malformed request line or header"
    named = _QUOTED_HEADER.search(message) if "header" in reason.lower() else None
    return reason[:200], named[1] if named else None


def _names_unserved_version(detail: str) -> bool:
    """505 only when the parser's message quotes a version we do not serve (``HTTP/3.0``);
    any other complaint that happens to mention "version" (a bare-LF line) is a 400."""
    versions = [(int(a), int(b)) for a, b in _VERSION_TOKEN.findall(detail)]
    return bool(versions) and all(v not in _VERSIONS for v in versions)


def handler_factory(
    server: web.Server, slots: ConnectionSlots, **kwargs: Any
) -> Callable[[], web.RequestHandler]:
    """What the listening socket builds per connection: ``kwargs`` are aiohttp's
    ``RequestHandler`` options (keepalive_timeout, access_log_class, ...)."""
    loop = asyncio.get_running_loop()

    def build() -> web.RequestHandler:
        return _GuardedHandler(server, slots, loop=loop, **kwargs)

    return build


class GuardedSite(web.BaseSite):
    """A TCP listener whose connections are built by ``handler_factory``."""

    __slots__ = ("_factory", "_handshake_timeout", "_host", "_port")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        factory: Callable[[], web.RequestHandler],
        *,
        backlog: int = 128,
        ssl_context: ssl.SSLContext | None = None,
        ssl_handshake_timeout: float | None = None,
    ) -> None:
        super().__init__(runner, backlog=backlog, ssl_context=ssl_context)
        self._host = host
        self._port = port
        self._factory = factory
        self._handshake_timeout = ssl_handshake_timeout if ssl_context is not None else None

    @property
    def name(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        scheme = "https" if self._ssl_context is not None else "http"
        return f"{scheme}://{host}:{self.port}"

    @property
    def port(self) -> int:
        """The bound port once the site started (the one the system picked for port 0),
        else the configured one: ``gateway.listening`` says where the gateway really is."""
        sockets = getattr(self._server, "sockets", None) or ()
        for sock in sockets:
            bound = sock.getsockname()
            if isinstance(bound, tuple) and len(bound) >= 2 and isinstance(bound[1], int):
                return bound[1]
        return self._port

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._factory,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
            ssl=self._ssl_context,
            ssl_handshake_timeout=self._handshake_timeout,
        )
