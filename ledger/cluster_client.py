"""One bucket of the Redis Cluster store, seen as one Redis: the client a bucket view's
``RedisStore`` talks through.

A bucket of a store with key prefix ``P`` is an ordinary ``RedisStore`` under the prefix
``P:{P.b<n>}`` (docs/decisions.md, "Issue 30: Redis Cluster, the design"): every key it makes
hashes to one slot. ``RoutedRedis`` is the part of ``redis.asyncio.Redis`` that store uses,
every command sent through ``ClusterRouter`` to the primary of that slot (``slot_key``,
``{P.b<n>}``), so ``MOVED``, ``ASK``, ``TRYAGAIN`` and a registered script's ``NOSCRIPT``
are followed by the router and never reach the store. A command without a key (``TIME``,
``PING``, ``INFO``, ``CONFIG GET``, ``SCRIPT LOAD``, ``FUNCTION LOAD``) goes to the same
primary: the node that runs the bucket's steps is the one whose clock, memory and loaded
scripts matter.

The command methods are redis-py's own (``AsyncCoreCommands``): each builds its command and
parse options exactly as ``redis.asyncio.Redis`` does, and the router's per-node client
(a ``redis.asyncio.Redis``) parses the reply with redis-py's callbacks for that command name
and those options (``HGETALL`` a dict, ``TIME`` a tuple, ``INFO`` a dict ...).

Errors reach the store as the classes it maps today: an error reply is a ``ResponseError``;
``ClusterUnavailable`` (a ``RedisError``) says the command did not run; the driver's
``ConnectionError`` / ``TimeoutError`` say it may have run (``RedisStore._call``).

``pipeline(transaction=False)`` queues commands and sends them with ``ClusterRouter.pipeline``:
all of them route by the bucket's slot, so they go to one node on one connection in order,
as ``_AutoPipeline`` needs for ``INCR`` of its write mark and ``HMGET`` of the meta after the
writes. A ``WAIT`` queued in it is not sent as a command: it becomes the router's ``wait=``,
every command before it counted as a write, so a command the router sent again (after a
redirect, maybe to another node) carries its own ``WAIT`` on its own connection; the
``WAIT``'s place in the results holds the lowest count any of them answered (or the first
``WAIT`` error), so "confirmed by n replicas" holds for every write of the batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any

from redis._parsers import Encoder
from redis._parsers.response_callbacks import get_response_callbacks
from redis.client import CaseInsensitiveDict
from redis.commands.core import AsyncCoreCommands, AsyncScript
from redis.event import EventDispatcher
from redis.exceptions import ResponseError
from redis.utils import safe_str

from fencegate.ledger.cluster_router import ClusterRouter, ClusterUnavailable, Routed, slot_of

__all__ = ["RoutedPipeline", "RoutedRedis"]

#: A queued command and its redis-py parse options.
_Command = tuple[tuple[Any, ...], dict[str, Any]]

#: ``scan`` cursors: the node's own cursor times this, plus the node's index.
_NODES_MAX = 4096

#: A transaction (``pipeline(transaction=True)``) as one script: ARGV is each command's
#: argument count then its arguments; every reply, an error as a value, as EXEC answers.
_TRANSACTION = """
local replies, i = {}, 1
while i <= #ARGV do
  local argc = tonumber(ARGV[i])
  replies[#replies + 1] = redis.pcall(unpack(ARGV, i + 1, i + argc))
  i = i + argc + 1
end
return replies
"""


class _ViewPool:
    """What redis-py and ``RedisStore`` read of a client's ``connection_pool``: the encoder
    (``AsyncScript`` hashes a script with it) and ``connection_kwargs`` (the node serving
    the view's slot now, for messages)."""

    def __init__(self, client: RoutedRedis) -> None:
        self._client = client
        self._encoder = Encoder("utf-8", "strict", True)  # type: ignore[no-untyped-call]

    def get_encoder(self) -> Encoder:
        return self._encoder

    @property
    def connection_kwargs(self) -> dict[str, Any]:
        address = self._client.router.primary_of(self._client.slot)
        return {} if address is None else {"host": address[0], "port": address[1]}


class RoutedRedis(AsyncCoreCommands):
    """The ``redis.asyncio.Redis`` surface ``RedisStore`` uses, over ``router``, every command
    for the slot of ``slot_key`` (module docstring). Does not own the router: ``aclose``
    leaves it open for the other buckets' views (its owner closes it)."""

    def __init__(self, router: ClusterRouter, slot_key: str) -> None:
        self.router = router
        self.slot_key = slot_key
        self.slot = slot_of(slot_key)
        self.connection_pool = _ViewPool(self)
        self._event_dispatcher = EventDispatcher()
        self._transaction_sha = router.register_script(_TRANSACTION)
        #: The primaries a ``scan`` walks, fixed when it starts (cursor 0).
        self._scan_nodes: list[tuple[str, int]] = []
        self._callbacks: Mapping[str, Any] | None = None

    def __repr__(self) -> str:
        return f"RoutedRedis(slot_key={self.slot_key!r}, slot={self.slot})"

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        """Send one command to the slot's primary; its reply parsed as redis-py parses it."""
        return await self.router.call(self.slot_key, *args, **options)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> RoutedPipeline:
        """A pipeline of this slot's commands (``transaction``: run them atomically, as one
        script; single-key commands only, their first argument the key)."""
        return RoutedPipeline(self, transaction)

    def register_script(self, script: Any) -> AsyncScript:  # type: ignore[override]
        """redis-py's ``AsyncScript`` over this client, its source registered with the
        router, which loads it where a node answers ``NOSCRIPT`` and sends again."""
        source = script.decode() if isinstance(script, bytes) else str(script)
        self.router.register_script(source)
        return AsyncScript(self, script)  # type: ignore[arg-type]

    def get_encoder(self) -> Encoder:
        return self.connection_pool.get_encoder()

    async def scan(  # type: ignore[override]
        self,
        cursor: int = 0,
        match: Any = None,
        count: int | None = None,
        _type: str | None = None,
        **kwargs: Any,
    ) -> tuple[int, list[Any]]:
        """``SCAN`` over the whole cluster, each primary in turn (a slot being migrated has
        keys on two nodes), keeping only keys of this view's slot. The cursor is the node's
        cursor times ``_NODES_MAX`` plus the node's place in the primaries as they were at
        cursor 0; 0 when every primary is done. A key a migration moves during the scan
        from a node not yet scanned to one already scanned is missed (this serves the
        index back-fills, whose records a cluster store, new in this format, never lacks)."""
        cursor = int(cursor)
        if cursor == 0 or not self._scan_nodes:
            await self.router.refresh()
            self._scan_nodes = sorted(self.router.primaries())
        nodes = self._scan_nodes
        place, node_cursor = cursor % _NODES_MAX, cursor // _NODES_MAX
        if place >= len(nodes):
            return 0, []
        client = self.router.client(nodes[place])
        node_cursor, found = await client.scan(
            node_cursor, match=match, count=count, _type=_type, **kwargs
        )
        keys = [key for key in found if slot_of(key) == self.slot]
        if int(node_cursor):
            return int(node_cursor) * _NODES_MAX + place, keys
        return (place + 1 if place + 1 < len(nodes) else 0), keys

    async def transaction(self, commands: list[_Command]) -> list[Any]:
        """``commands`` (each with its parse options) run atomically on the slot's primary
        (MULTI/EXEC cannot be routed as one: a redirected command would be sent again on
        its own, outside the transaction); each reply or error reply, as EXEC answers."""
        argv: list[Any] = []
        keys: list[Any] = []
        for command, _ in commands:
            argv.extend([len(command), *command])
            if len(command) > 1:
                keys.append(command[1])
        replies = await self.router.call(
            self.slot_key,
            "EVALSHA",
            self._transaction_sha,
            len(keys),
            *keys,
            *argv,
        )
        callbacks = self._response_callbacks()
        parsed: list[Any] = []
        for (command, options), reply in zip(commands, replies, strict=True):
            name = str(command[0])
            if isinstance(reply, ResponseError) or name not in callbacks:
                parsed.append(reply)
            else:
                parsed.append(callbacks[name](reply, **options))
        return parsed

    def _response_callbacks(self) -> Mapping[str, Any]:
        if self._callbacks is None:
            # A script's replies have RESP2's shapes (HGETALL a flat list): redis-py's
            # callbacks for RESP2 make them what the same command's reply parses to.
            callbacks: Any = get_response_callbacks(2, True)
            self._callbacks = CaseInsensitiveDict(callbacks)
        return self._callbacks

    async def aclose(self) -> None:
        """Nothing to close: the router is shared by every bucket's view."""


class RoutedPipeline(AsyncCoreCommands):
    """``RoutedRedis.pipeline``: commands queued by redis-py's methods, sent by ``execute``
    (module docstring), usable as an async context manager like redis-py's pipeline."""

    def __init__(self, client: RoutedRedis, transaction: bool) -> None:
        self._client = client
        self._transaction = transaction
        self._event_dispatcher = client._event_dispatcher
        self._queued: list[_Command] = []

    async def __aenter__(self) -> RoutedPipeline:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._queued = []

    def __len__(self) -> int:
        return len(self._queued)

    def execute_command(self, *args: Any, **options: Any) -> RoutedPipeline:
        """Queue one command (the redis-py methods come through here)."""
        options.pop("keys", None)  # redis-py's client-side cache hint, nothing to parse
        self._queued.append((args, options))
        return self

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        """Send the queued commands; their replies in order. A lost connection or an
        unavailable cluster for every command is raised, as redis-py's pipeline raises it;
        otherwise errors are values, or the first is raised (``raise_on_error``)."""
        queued, self._queued = self._queued, []
        if not queued:
            return []
        if self._transaction:
            results = await self._client.transaction(queued)
        else:
            results = await self._send(queued)
        if raise_on_error:
            for n, reply in enumerate(results):
                if isinstance(reply, ResponseError):
                    command = " ".join(map(safe_str, queued[n][0]))
                    reply.args = (
                        f"Command # {n + 1} ({command[:100]}) of pipeline caused error: "
                        f"{reply.args}",
                        *reply.args[1:],
                    )
                    raise reply
        return results

    async def _send(self, queued: list[_Command]) -> list[Any]:
        waits = [n for n, (command, _) in enumerate(queued) if _is_wait(command)]
        wait: tuple[int, int] | None = None
        if waits:
            command = queued[waits[-1]][0]
            wait = (int(command[1]), int(command[2]))
        slot_key = self._client.slot_key
        routed = [
            Routed(slot_key, command, bool(waits) and n < waits[-1], options or None)
            for n, (command, options) in enumerate(queued)
            if n not in waits
        ]
        replies = await self._client.router.pipeline(routed, wait=wait)
        failed = [r for r in replies.results if isinstance(r, Exception)]
        if len(failed) == len(replies.results) and not any(
            isinstance(r, ResponseError) for r in failed
        ):
            # Nothing answered: the round trip failed, as one Redis's pipeline raises it (one
            # that may have run first, so nobody is told "did not run" wrongly).
            raise next((r for r in failed if not isinstance(r, ClusterUnavailable)), failed[0])
        results = iter(replies.results)
        return [_lowest(replies.acked) if n in waits else next(results) for n in range(len(queued))]


def _is_wait(command: tuple[Any, ...]) -> bool:
    return len(command) == 3 and str(command[0]).upper() == "WAIT"


def _lowest(acked: list[Any]) -> Any:
    """The ``WAIT`` answer that stands for a batch whose writes may have been sent on several
    connections: the first error, else the lowest count (None: no write was answered)."""
    errors = [a for a in acked if isinstance(a, BaseException)]
    if errors:
        return errors[0]
    counts = [a for a in acked if isinstance(a, int)]
    return min(counts) if counts else None
