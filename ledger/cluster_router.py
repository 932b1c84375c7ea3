"""The Redis Cluster store's connection layer: which primary serves a key, and one send per call.

Pure I/O, no fencegate decision: commands in (each with the key that routes it), replies or
errors out, every one of them saying whether the command ran.

Why not redis-py's ``RedisCluster``: it re-sends a script whose reply was lost (its retries
cover ``ConnectionError`` and ``TimeoutError``, and its pipeline re-sends every failed
command), sends ``ASKING`` and the command on two pool checkouts (once two idle connections
to the importing node exist, the command goes on one without ``ASKING``, is answered
``MOVED`` back, and a script on a key being migrated never runs), and closes every node's
connections under the other callers on every fifth ``MOVED``
(docs/decisions.md, "Issue 30: Redis Cluster, the design"). So this module routes itself:

- a **slot map** (16,384 entries, each the address of the slot's primary) read with
  ``CLUSTER SLOTS`` from the first node that answers (the map's primaries, then the URL's
  nodes), refreshed once when a call finds it stale, and in the background after ``MOVED``;
  concurrent refreshes share one read;
- one ``redis.asyncio.Redis`` per node, built as ``RedisStore`` builds its one client: a
  ``BlockingConnectionPool`` of ``max_connections`` (a caller waits up to the timeout for a
  free connection, which also bounds the concurrency per node), the store timeout on
  connect, read and pool wait, no health checks, and ``retry=Retry(NoBackoff(), 0)``: a
  command whose reply was lost is never sent again by the driver. Two differences: a
  connection that cannot be made raises ``ConnectFailed`` (nothing was sent, so the
  router may route the command again), and redis-py 8's maintenance notifications are
  off, since with them on ("auto") the pool hands out a connection the server has closed
  without looking, and the first call after a node died would fail "may have run".

What each answer means (``call``; ``pipeline`` gives the same per command, as values):

==================================  ===================================================
the node answered                   the router
==================================  ===================================================
a reply, or any other error reply   returns it
``NOSCRIPT`` to an ``EVALSHA`` of   sends ``SCRIPT LOAD`` and the command to the node
a script ``register_script`` knows  that answered, as one pipeline (did not run); of
                                    another script: returned, for the caller to load
``MOVED slot addr``                 points the slot at ``addr``, refreshes the map in the
                                    background, sends again (the command did not run)
``ASK slot addr``                   sends ``ASKING`` and the command to ``addr`` as one
                                    pipeline, so on one connection (did not run)
``TRYAGAIN``                        (a multi-key command whose keys a migration split)
                                    backs off and sends again, within the timeout; then
                                    ``ClusterUnavailable`` (did not run)
``CLUSTERDOWN``, ``LOADING``,       ``ClusterUnavailable`` (did not run)
``MASTERDOWN``, no primary for the
slot, more than 16 redirections
no connection could be made         refreshes the map; if the slot has another primary
(``ConnectFailed``: nothing sent)   now, sends there, else ``ClusterUnavailable``
lost connection, timeout            marks the map stale and raises the driver's
                                    ``ConnectionError`` / ``TimeoutError``: the command
                                    may or may not have run
==================================  ===================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import redis.asyncio as aioredis
from redis.asyncio.connection import BlockingConnectionPool, Connection, SSLConnection
from redis.backoff import NoBackoff
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import (
    AskError,
    AuthenticationError,
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    MovedError,
    NoScriptError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry

__all__ = [
    "CLUSTER_FORM",
    "CLUSTER_SCHEMES",
    "ClusterOptions",
    "ClusterRouter",
    "ClusterUnavailable",
    "ConnectFailed",
    "Replies",
    "Routed",
    "RouterStats",
    "parse_authority",
    "parse_cluster_url",
    "slot_of",
]

#: ``redis+cluster://`` plain, ``rediss+cluster://`` over TLS (as ``redis://`` and
#: ``rediss://`` are for one Redis).
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
CLUSTER_FORM = "redis+cluster://[USER@]HOST1:PORT1,HOST2:PORT2,...[?pipeline=0|1]"
_DEFAULT_PORT = 6379
_HOST = re.compile(r"\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+")
_USER = re.compile(r"[A-Za-z0-9._~-]{1,128}")
_PIPELINE_VALUES = {"0": False, "1": True}
#: The TLS settings a ``rediss+cluster://`` URL may carry: redis-py's names, as a
#: ``rediss://`` URL carries them, each with a check of its value.
_SSL_PARAMS = {
    "ssl_cert_reqs": ("none", "optional", "required"),
    "ssl_check_hostname": ("true", "false"),
    "ssl_ca_certs": None,
    "ssl_certfile": None,
    "ssl_keyfile": None,
}
#: Redirections (MOVED, ASK) one call follows before it gives up: a slot keeps moving, or two
#: nodes disagree about it. redis-py's ``RedisClusterRequestTTL`` is the same.
MAX_REDIRECTS = 16
#: TRYAGAIN backoff: first wait and cap, in seconds.
_TRYAGAIN_FIRST_S = 0.005
_TRYAGAIN_CAP_S = 0.1
#: The share of the router's timeout a call waits out TRYAGAIN before it answers
#: ``ClusterUnavailable`` (it did not run). Less than all of it: the store bounds each step
#: by the same timeout, and a step cut off by that bound is told "may or may not have been
#: applied", which a command Redis refused to run never was.
_TRYAGAIN_SHARE = 0.5

Address = tuple[str, int]


class ClusterUnavailable(RedisError):
    """The cluster could not take the command, and **it did not run**: CLUSTERDOWN, a node
    loading or without its primary, no primary for the slot, no node reachable for the map,
    a primary that refuses connections (its failover not done yet), redirections without
    end, TRYAGAIN past the timeout. A ``RedisError``, so a caller that treats every store
    error alike still catches it."""


class ConnectFailed(RedisConnectionError):
    """No connection to the node could be made (refused, unreachable, connect timeout): no
    byte of the command was sent on it."""


def slot_of(key: str | bytes) -> int:
    """The hash slot of ``key`` (its hash tag ``{...}`` if it has one), as Redis computes it."""
    return key_slot(key.encode() if isinstance(key, str) else key)


# --- the URL ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClusterOptions:
    """What a cluster URL says besides its nodes and user: TLS (``rediss+cluster://``, with
    redis-py's ``ssl_*`` settings) and the store's ``pipeline`` switch (None: absent)."""

    tls: bool = False
    ssl: dict[str, str] = field(default_factory=dict)
    pipeline: bool | None = None

    def connection_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for redis-py's SSL connection (empty without TLS)."""
        if not self.tls:
            return {}
        kwargs: dict[str, Any] = dict(self.ssl)
        if "ssl_check_hostname" in kwargs:
            kwargs["ssl_check_hostname"] = kwargs["ssl_check_hostname"] == "true"
        return kwargs


def parse_cluster_url(url: str) -> tuple[list[Address], str | None, ClusterOptions]:
    """``redis+cluster://[USER@]HOST1:PORT1,HOST2:PORT2,...[?options]`` (``rediss+cluster``:
    TLS): the nodes to read the slot map from (a port left out is 6379; ``[::1]:7000`` for
    IPv6), the ACL user, the options (``pipeline=0|1`` as for ``redis://``; with TLS
    ``ssl_cert_reqs``, ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
    ``ssl_check_hostname`` as a ``rediss://`` URL takes them). ValueError saying what is
    wrong and the right form. No password (it comes from ``store.password_env``, as for
    ``redis://``) and no database: a cluster has only database 0."""

    def bad(why: str) -> ValueError:
        return ValueError(f"{why}; expected {CLUSTER_FORM}")

    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in CLUSTER_SCHEMES:
        raise bad("not a redis+cluster:// url")
    tls = scheme.lower() == "rediss+cluster"
    if "#" in rest:
        raise bad("a fragment (#...) is not part of the form")
    rest, _, query = rest.partition("?")
    options = _options(query, tls, bad)
    authority, slash, path = rest.partition("/")
    if slash and path not in ("", "0"):
        raise bad(
            f"redis+cluster:// takes no database ({'/' + path!r}): a Redis Cluster has only "
            "database 0"
        )
    nodes, username = parse_authority(authority, _DEFAULT_PORT, "redis+cluster", "node", bad)
    if len(set(nodes)) != len(nodes):
        raise bad("a node is listed twice")
    return nodes, username, options


def parse_authority(
    authority: str, default_port: int, what: str, item: str, bad: Callable[[str], ValueError]
) -> tuple[list[Address], str | None]:
    """The ``[USER@]H1:P1,H2:P2,...`` of a ``redis+cluster://`` or ``redis+sentinel://`` URL
    (``what`` names the URL, ``item`` one address in the refusals; IPv6 in brackets; a
    missing port is ``default_port``): the addresses and the ACL user. A password is refused:
    it comes from ``store.password_env``, never from a URL that lands in configs and logs."""
    userinfo, at, hosts = authority.rpartition("@")
    username = None
    if at:
        if ":" in userinfo:
            raise bad(
                f"a password in the {what} url is refused: set store.password_env to the "
                "name of an environment variable holding it"
            )
        if not _USER.fullmatch(userinfo):
            raise bad(f"{userinfo!r} is not a user name")
        username = userinfo
    if not hosts:
        raise bad(f"no {item} is named")
    return [_address(one, default_port, item, bad) for one in hosts.split(",")], username


def _address(one: str, default_port: int, item: str, bad: Callable[[str], ValueError]) -> Address:
    host, port = one, str(default_port)
    if one.startswith("["):
        end = one.find("]")
        if end < 0:
            raise bad(f"{item} address {one!r} is not HOST:PORT")
        host, tail = one[: end + 1], one[end + 1 :]
        if tail:
            if not tail.startswith(":"):
                raise bad(f"{item} address {one!r} is not HOST:PORT")
            port = tail[1:]
    elif ":" in one:
        host, _, port = one.rpartition(":")
    if not host or not _HOST.fullmatch(host):
        raise bad(f"{item} address {one!r} is not HOST:PORT")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise bad(f"{item} address {one!r} has no valid port")
    return host.strip("[]"), int(port)


def _options(query: str, tls: bool, bad: Any) -> ClusterOptions:
    pipeline: bool | None = None
    ssl: dict[str, str] = {}
    seen: set[str] = set()
    for pair in query.split("&") if query else []:
        name, eq, value = pair.partition("=")
        if not eq:
            raise bad(f"query parameter {pair!r} has no value")
        if name in seen:
            raise bad(f"query parameter {name!r} is given twice")
        seen.add(name)
        if name == "pipeline":
            if value not in _PIPELINE_VALUES:
                raise bad(f"pipeline is 0 or 1, not {value!r}")
            pipeline = _PIPELINE_VALUES[value]
        elif name in _SSL_PARAMS:
            if not tls:
                raise bad(f"{name} is a TLS setting: use rediss+cluster:// for TLS")
            allowed = _SSL_PARAMS[name]
            if allowed is not None and value.lower() not in allowed:
                raise bad(f"{name} is one of {', '.join(allowed)}, not {value!r}")
            if not value:
                raise bad(f"{name} is empty")
            ssl[name] = value.lower() if allowed is not None else value
        else:
            known = ["pipeline", *(_SSL_PARAMS if tls else ())]
            raise bad(f"unknown query parameter {name!r} (known: {', '.join(known)})")
    return ClusterOptions(tls=tls, ssl=ssl, pipeline=pipeline)


# --- connections that say whether anything was sent -----------------------------------------


def _connect_failed(exc: Exception, host: str, port: int) -> ConnectFailed:
    return ConnectFailed(f"cannot connect to {host}:{port} ({type(exc).__name__}: {exc})")


class _Connection(Connection):
    """redis-py's connection, raising ``ConnectFailed`` when connecting fails (the pool
    connects before it hands a connection out, so nothing of the command was sent)."""

    async def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        try:
            await super().connect_check_health(check_health, retry_socket_connect)
        except AuthenticationError:
            raise  # a configuration error, said as the driver says it
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise _connect_failed(exc, self.host, self.port) from exc


class _SSLConnection(SSLConnection):
    """``_Connection`` over TLS."""

    async def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        try:
            await super().connect_check_health(check_health, retry_socket_connect)
        except AuthenticationError:
            raise
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise _connect_failed(exc, self.host, self.port) from exc


# --- the router ---------------------------------------------------------------------------


class Routed(NamedTuple):
    """One command of a ``pipeline``: the key that routes it, the command, whether it may
    write (then, with ``wait``, a ``WAIT`` follows it on its connection), and redis-py's
    parse options for its reply (``withscores=True``, ...: what a redis-py command method
    passes to ``execute_command``; None: none)."""

    slot_key: str
    command: tuple[Any, ...]
    writes: bool = False
    options: Mapping[str, Any] | None = None


@dataclass(slots=True)
class Replies:
    """A ``pipeline``'s answers, in the order of its commands. ``results``: each command's
    reply, or its error as a value (an error reply such as ``NoScriptError``;
    ``ClusterUnavailable``: it did not run; ``ConnectionError`` / ``TimeoutError``: it may
    have run). ``acked``: with ``wait``, for each write the reply of the ``WAIT`` that
    followed it on its connection (replicas that acknowledged, or the error); None for the
    other commands, and for a write that got no answer."""

    results: list[Any]
    acked: list[Any]


@dataclass(slots=True)
class RouterStats:
    """What the router has followed since it was built (for metrics and tests)."""

    moved: int = 0
    asked: int = 0
    tryagain: int = 0
    noscript: int = 0
    refreshes: int = 0
    unavailable: int = 0


class ClusterRouter:
    """Sends each command to the primary of its key's slot, following the cluster as it
    moves (module docstring). ``nodes``: where to read the slot map first; ``timeout_ms``:
    connect, read and pool-wait timeout of every connection, and the bound on TRYAGAIN
    re-sends; ``max_connections``: per node (a caller waits for a free one)."""

    def __init__(
        self,
        nodes: Sequence[Address],
        *,
        timeout_ms: int = 2000,
        max_connections: int = 200,
        username: str | None = None,
        password: str | None = None,
        options: ClusterOptions | None = None,
    ) -> None:
        if not nodes:
            raise ValueError("a cluster router needs at least one node to start from")
        self._seeds = [(host, int(port)) for host, port in nodes]
        self._timeout_s = timeout_ms / 1000
        options = options or ClusterOptions()
        self._common: dict[str, Any] = {
            "max_connections": max_connections,
            "timeout": self._timeout_s,
            "username": username,
            "password": password,
            "decode_responses": True,
            "socket_timeout": self._timeout_s,
            "socket_connect_timeout": self._timeout_s,
            "health_check_interval": 0,
            "retry": Retry(NoBackoff(), 0),
            "connection_class": _SSLConnection if options.tls else _Connection,
            **options.connection_kwargs(),
        }
        self._clients: dict[Address, aioredis.Redis] = {}
        #: slot -> its primary's address; None until the first read of the map.
        self._slots: list[Address | None] | None = None
        #: A call failed in a way the map may explain: the next call reads it first.
        self._stale = False
        self._refreshing: asyncio.Task[None] | None = None
        self._closed = False
        #: Scripts by SHA-1 (``register_script``): loaded where NOSCRIPT says they lack.
        self._scripts: dict[str, str] = {}
        self.stats = RouterStats()

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        timeout_ms: int = 2000,
        max_connections: int = 200,
        password: str | None = None,
    ) -> ClusterRouter:
        nodes, username, options = parse_cluster_url(url)
        return cls(
            nodes,
            timeout_ms=timeout_ms,
            max_connections=max_connections,
            username=username,
            password=password,
            options=options,
        )

    @staticmethod
    def slot_of(key: str | bytes) -> int:
        return slot_of(key)

    # --- the map --------------------------------------------------------------------------

    def primary_of(self, slot: int) -> Address | None:
        """The address the map gives for ``slot`` now (None: not read yet, or no primary)."""
        return None if self._slots is None else self._slots[slot]

    def primaries(self) -> list[Address]:
        """The distinct primaries of the map, in slot order."""
        return list(dict.fromkeys(a for a in self._slots or () if a is not None))

    def client(self, address: Address) -> aioredis.Redis:
        """The client of the node at ``address`` (made on first use, kept until ``aclose``:
        a node that stops being a primary may be one again after the next failover)."""
        client = self._clients.get(address)
        if client is None:
            if self._closed:
                raise ClusterUnavailable("the cluster router is closed")
            host, port = address
            pool = BlockingConnectionPool(
                host=host,
                port=port,
                # Off, not redis-py 8's "auto": with it on, the pool hands out a pooled
                # connection without checking that the server has not closed it, so the
                # first call after a node died failed "may have run" instead of "not sent".
                maint_notifications_config=MaintNotificationsConfig(enabled=False),
                **self._common,
            )
            client = self._clients[address] = aioredis.Redis.from_pool(pool)
        return client

    async def refresh(self) -> None:
        """Read the slot map again (one read shared by every caller asking meanwhile)."""
        task = self._refreshing
        if task is None or task.done():
            task = self._refreshing = asyncio.get_running_loop().create_task(self._read_map())
        await asyncio.shield(task)

    def _refresh_soon(self) -> None:
        """Read the map in the background (after MOVED: the caller has what it needs)."""
        if self._closed or (self._refreshing is not None and not self._refreshing.done()):
            return
        task = self._refreshing = asyncio.get_running_loop().create_task(self._read_map())
        # Nobody awaits it: take its error, if any, so it is not reported as lost. The next
        # call that needs the map reads it again (the map stays stale).
        task.add_done_callback(lambda t: None if t.cancelled() else t.exception())

    async def _read_map(self) -> None:
        self._stale = False  # a failure seen while reading marks it again
        candidates = list(dict.fromkeys([*self.primaries(), *self._seeds]))
        errors: list[str] = []
        for address in candidates:
            try:
                async with asyncio.timeout(self._timeout_s):
                    client = self.client(address)
                    reply = await client.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
            except (RedisError, OSError, TimeoutError) as exc:
                errors.append(f"{address[0]}:{address[1]}: {type(exc).__name__}: {exc}")
                continue
            self._slots = _slot_table(reply, address[0])
            self.stats.refreshes += 1
            return
        self._stale = True
        raise ClusterUnavailable(
            "no node of the cluster answered CLUSTER SLOTS (" + "; ".join(errors) + ")"
        )

    async def _primary(self, slot: int) -> Address:
        if self._slots is None or self._stale:
            await self.refresh()
        assert self._slots is not None
        address = self._slots[slot]
        if address is None:
            raise self._unavailable(f"no primary serves slot {slot} (the cluster is not whole)")
        return address

    def _unavailable(self, why: str) -> ClusterUnavailable:
        self.stats.unavailable += 1
        return ClusterUnavailable(f"{why}; the command did not run")

    # --- one command ----------------------------------------------------------------------

    async def call(self, slot_key: str, *command: Any, **options: Any) -> Any:
        """Send ``command`` to the primary of ``slot_key``'s slot and return its reply,
        parsed by the node's redis-py client as its command method would (``options``: that
        method's parse options, e.g. ``withscores=True``); an error reply is raised (the
        module docstring's table says which are followed)."""
        reply, _ = await self._route(slot_of(slot_key), command, None, options=options)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def tryagain_deadline(self) -> float:
        """When a call (or a pipeline) sent now stops waiting out TRYAGAIN (loop time)."""
        return asyncio.get_running_loop().time() + self._timeout_s * _TRYAGAIN_SHARE

    async def _route(
        self,
        slot: int,
        command: tuple[Any, ...],
        wait: tuple[int, int] | None,
        error: ResponseError | None = None,
        at: Address | None = None,
        options: Mapping[str, Any] | None = None,
        deadline: float | None = None,
    ) -> tuple[Any, Any]:
        """The reply (an error reply as a value) and, with ``wait``, the reply of the WAIT
        sent after it on its connection. ``error``: what a pipeline got for this command on
        the node ``at``, to follow first. ``deadline`` (loop time): when TRYAGAIN stops being
        waited out; a pipeline passes one for all the commands it sends again, so their
        waits together stay within the share of the timeout."""
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = self.tryagain_deadline()
        backoff = _TRYAGAIN_FIRST_S
        redirects = reloads = 0
        #: Where to send next (None: the slot's primary), with ASKING, with SCRIPT LOAD.
        target: Address | None = None
        asking = False
        load: str | None = None
        address, sent_asking = at, False
        while True:
            if error is None:
                address = target or await self._primary(slot)
                try:
                    replies = await self._send(
                        address,
                        [command],
                        asking=asking,
                        wait=wait,
                        load=load,
                        options=[options or {}],
                    )
                except ConnectFailed as exc:
                    # Nothing was sent: the node may be dead and its slots taken over.
                    self._stale = True
                    if target is None:
                        await self.refresh()
                        if (
                            self.primary_of(slot) not in (None, address)
                            and redirects < MAX_REDIRECTS
                        ):
                            redirects += 1
                            continue
                    raise self._unavailable(str(exc)) from exc
                except BusyLoadingError as exc:
                    raise self._unavailable(f"{address[0]}:{address[1]} is loading") from exc
                except (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError):
                    self._stale = True
                    raise
                sent_asking, target, asking, load = asking, None, False, None
                reply = replies[0]
                acked = replies[1] if wait is not None else None
                if not isinstance(reply, ResponseError):
                    return reply, acked
                error = reply
            if isinstance(error, MovedError):
                self.stats.moved += 1
                if self._slots is not None:
                    self._slots[error.slot_id] = error.node_addr
                self._refresh_soon()
            elif isinstance(error, AskError):
                self.stats.asked += 1
                target, asking = error.node_addr, True
            elif isinstance(error, TryAgainError):
                self.stats.tryagain += 1
                if loop.time() + backoff > deadline:
                    raise self._unavailable(
                        f"slot {slot} is being migrated and the command's keys are split "
                        f"between two nodes (TRYAGAIN for {self._timeout_s * _TRYAGAIN_SHARE:g} s)"
                    ) from error
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _TRYAGAIN_CAP_S)
                error = None
                continue
            elif isinstance(error, (ClusterDownError, MasterDownError)):
                self._stale = True
                raise self._unavailable(f"the cluster refused: {error}") from error
            elif (
                isinstance(error, NoScriptError)
                and address is not None
                and reloads < 2
                and (source := self._source_of(command)) is not None
            ):
                # The node that answered (a promoted replica, a restarted or flushed node)
                # lacks the script and ran nothing: load it there, on the connection of the
                # command, and send it again (as it was sent: after ASKING if it was).
                self.stats.noscript += 1
                reloads += 1
                target, asking, load = address, sent_asking, source
                error = None
                continue
            else:
                return error, None  # the command's own error reply (a script's, NOSCRIPT)
            redirects += 1
            if redirects > MAX_REDIRECTS:
                raise self._unavailable(
                    f"slot {slot} was redirected {MAX_REDIRECTS} times (last: {error})"
                ) from error
            error = None

    def _source_of(self, command: tuple[Any, ...]) -> str | None:
        """The registered source of an ``EVALSHA``'s script (None: not one)."""
        if len(command) < 2 or str(command[0]).upper() != "EVALSHA":
            return None
        return self._scripts.get(str(command[1]))

    def register_script(self, source: str) -> str:
        """Remember ``source`` by its SHA-1 (returned): an ``EVALSHA`` of it answered
        ``NOSCRIPT`` is loaded on the node that answered and sent again, in one round trip
        on one connection. (Not loaded anywhere yet: ``each_primary("SCRIPT", "LOAD", ...)``
        saves the first NOSCRIPT round trip per node.) An unregistered script's NOSCRIPT is
        the caller's to handle; a ``SCRIPT LOAD`` it sends has no key to be redirected by,
        so while the map is stale it may reach the slot's former primary."""
        sha = hashlib.sha1(source.encode()).hexdigest()
        self._scripts[sha] = source
        return sha

    async def _send(
        self,
        address: Address,
        commands: Sequence[tuple[Any, ...]],
        *,
        asking: bool = False,
        wait: tuple[int, int] | None = None,
        load: str | None = None,
        options: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[Any]:
        """Send ``commands`` to ``address`` on one connection (``SCRIPT LOAD load`` first,
        then ``ASKING``, when asked; ``WAIT`` last when asked), error replies as values;
        the commands' replies, then WAIT's. ``options``: each command's parse options."""
        client = self.client(address)
        parse = options or [{}] * len(commands)
        if len(commands) == 1 and not asking and wait is None and load is None:
            try:
                return [await client.execute_command(*commands[0], **parse[0])]  # type: ignore[no-untyped-call]
            except ResponseError as exc:
                return [exc]
        pipe = client.pipeline(transaction=False)
        if load is not None:
            pipe.execute_command("SCRIPT", "LOAD", load)
        if asking:
            pipe.execute_command("ASKING")
        for command, opts in zip(commands, parse, strict=True):
            pipe.execute_command(*command, **opts)
        if wait is not None:
            pipe.execute_command("WAIT", *wait)
        replies = await pipe.execute(raise_on_error=False)
        return replies[(load is not None) + asking :]

    # --- many commands --------------------------------------------------------------------

    async def pipeline(
        self,
        commands: Sequence[Routed | tuple[str, tuple[Any, ...]]],
        *,
        wait: tuple[int, int] | None = None,
    ) -> Replies:
        """Send ``commands`` grouped by node, one pipeline per node, the nodes in parallel;
        each command's answer in ``Replies``, in the order given (its errors as values).
        A command answered MOVED, ASK, TRYAGAIN or (a registered script) NOSCRIPT did not
        run: it is sent again on its own as ``call`` would, after the others; those of one
        slot one after another, in order.
        ``wait`` (``(replicas, timeout_ms)``): each node's group holding a write ends with
        ``WAIT replicas timeout_ms``, and a write sent again carries its own WAIT."""
        routed = [Routed(*item) for item in commands]
        results: list[Any] = [None] * len(routed)
        acked: list[Any] = [None] * len(routed)
        if not routed:
            return Replies(results, acked)
        deadline = self.tryagain_deadline()
        slots = [slot_of(item.slot_key) for item in routed]
        groups: dict[Address, list[int]] = {}
        #: (index, what it got, from which node): sent again one by one after the groups.
        again: list[tuple[int, ResponseError | None, Address | None]] = []
        try:
            for i, slot in enumerate(slots):
                groups.setdefault(await self._primary(slot), []).append(i)
        except ClusterUnavailable:  # each command finds its own way, or fails on its own
            again = [(i, None, None) for i in range(len(routed))]
            groups = {}

        async def group(address: Address, indexes: list[int]) -> None:
            waits = wait if wait is not None and any(routed[i].writes for i in indexes) else None
            try:
                replies = await self._send(
                    address,
                    [routed[i].command for i in indexes],
                    wait=waits,
                    options=[routed[i].options or {} for i in indexes],
                )
            except ConnectFailed:
                self._stale = True
                again.extend((i, None, None) for i in indexes)  # nothing sent: route again
                return
            except BusyLoadingError:
                for i in indexes:
                    results[i] = self._unavailable(f"{address[0]}:{address[1]} is loading")
                return
            except (RedisError, OSError, TimeoutError) as exc:
                self._stale = True
                for i in indexes:
                    results[i] = exc
                return
            for n, i in enumerate(indexes):
                reply = replies[n]
                if isinstance(reply, (AskError, TryAgainError)) or (
                    isinstance(reply, NoScriptError) and self._source_of(routed[i].command)
                ):
                    again.append((i, reply, address))
                    continue
                if isinstance(reply, (ClusterDownError, MasterDownError)):
                    self._stale = True
                    reply = self._unavailable(f"the cluster refused: {reply}")
                results[i] = reply
                if waits is not None and routed[i].writes:
                    acked[i] = replies[-1]

        await asyncio.gather(*(group(address, indexes) for address, indexes in groups.items()))
        if again:
            by_slot: dict[int, list[tuple[int, ResponseError | None, Address | None]]] = {}
            for entry in sorted(again, key=lambda entry: entry[0]):
                by_slot.setdefault(slots[entry[0]], []).append(entry)

            async def one_slot(
                pending: list[tuple[int, ResponseError | None, Address | None]],
            ) -> None:
                for i, error, at in pending:
                    item = routed[i]
                    waits = wait if item.writes else None
                    try:
                        results[i], acked[i] = await self._route(
                            slots[i], item.command, waits, error, at, item.options, deadline
                        )
                    except (RedisError, OSError, TimeoutError) as exc:
                        results[i] = exc

            await asyncio.gather(*(one_slot(pending) for pending in by_slot.values()))
        return Replies(results, acked)

    # --- every primary --------------------------------------------------------------------

    async def each_primary(self, *command: Any, return_exceptions: bool = False) -> dict[str, Any]:
        """Send ``command`` (no key: ``INFO commandstats``, ``SCRIPT LOAD``, ``FUNCTION
        LOAD``, ``CONFIG RESETSTAT``) to every primary of the map, in parallel; each
        primary's reply by ``host:port``. An error is raised (the first, once all have
        answered) unless ``return_exceptions``: then it is that node's value."""
        if self._slots is None or self._stale:
            await self.refresh()
        primaries = self.primaries()

        async def one(address: Address) -> Any:
            try:
                return (await self._send(address, [command]))[0]
            except ConnectFailed as exc:
                self._stale = True
                return self._unavailable(str(exc))
            except (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError) as exc:
                self._stale = True
                return exc

        replies = await asyncio.gather(*(one(address) for address in primaries))
        answers = {
            f"{host}:{port}": reply for (host, port), reply in zip(primaries, replies, strict=True)
        }
        if not return_exceptions:
            for reply in replies:
                if isinstance(reply, BaseException):
                    raise reply
        return answers

    async def aclose(self) -> None:
        """Stop the map refresh and close every node's connections."""
        self._closed = True
        task = self._refreshing
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()


def _slot_table(reply: Any, asked_host: str) -> list[Address | None]:
    """``CLUSTER SLOTS`` as slot -> primary address. An empty host means "the host you
    asked" (Redis 7, a node that does not know its own address)."""
    table: list[Address | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
    for entry in reply:
        low, high, primary = int(entry[0]), int(entry[1]), entry[2]
        host = str(primary[0]) or asked_host
        if host == "?":
            host = asked_host
        address = (host, int(primary[1]))
        table[low : high + 1] = [address] * (high - low + 1)
    return table
