"""Moving a bucket's slot to another primary of a Redis Cluster, under load, losing nothing.

What an operator runs (``fencegate store move-slot SLOT --to HOST:PORT``) and the chaos run
does to rebalance a cluster store: the slot of one or more buckets (``ledger.buckets``) goes
from the primary that holds it to ``target``, as ``redis-cli --cluster reshard`` moves a slot,
with one step before and one after (docs/decisions.md, "Moving a slot"):

1. **freeze** the slot's buckets (``freeze(True)``): a field of each bucket's scheduler hash
   that every task script checks first, refusing with ``FROZEN`` before it touches anything
   (the effect steps declare every key they touch, so Redis itself answers them ``ASK`` or
   ``TRYAGAIN`` before they run, and they go on).
   Why: while a slot migrates, a key already moved answers ``ASK`` and one not yet moved is
   served by the source, so a script that touches a key it did not declare (a dependent's
   record, an effect of the task) can find that key gone in the middle of its run and fail
   there, keeping the writes it made before. A frozen bucket runs no script, so none can be
   cut in half; a refused step did not run and is retried by its caller;
2. ``CLUSTER SETSLOT slot IMPORTING source`` on the target, ``MIGRATING target`` on the
   source;
3. ``CLUSTER GETKEYSINSLOT`` and ``MIGRATE ... REPLACE KEYS`` in batches until the source
   holds none of the slot's keys (``REPLACE``: a batch cut short by a crash may have left
   copies on the target; the source's is the newer, since the source serves every key it
   still holds, so every write since went there);
4. ``CLUSTER SETSLOT slot NODE target`` on the target, the source, then every other
   primary, and until every primary places the slot on the target;
5. **unfreeze** (``freeze(False)``).

**Idempotent and resumable.** Each run first reads where the slot is (every primary's own
``CLUSTER NODES`` line) and goes on from there: a run after a crash finds the migration half
done and finishes it, one after a finished move only unfreezes. The freeze stays until the
move completes: a crash between 1 and 5 leaves the slot's buckets refusing their task steps
(answered "unavailable, did not run") until the move is run again to its end.

``freeze`` is a callable, so this module does not depend on how a store spells it:
``store_freeze`` makes it for a ``ClusterStore`` (every bucket of the store in the slot,
``RedisStore.freeze_bucket`` / ``thaw_bucket``).
Pure I/O on the router's per-node clients; no fencegate decision.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redis.exceptions import ResponseError

from fencegate.ledger.buckets import CLUSTER_SLOTS, bucket_tag, slot_of

if TYPE_CHECKING:
    from fencegate.ledger.cluster_router import Address, ClusterRouter
    from fencegate.ledger.cluster_store import ClusterStore

__all__ = [
    "MIGRATE_BATCH",
    "Freeze",
    "MoveFailed",
    "MoveRefused",
    "MoveReport",
    "buckets_in_slot",
    "move_bucket_slot",
    "move_store_slot",
    "parse_node",
    "store_freeze",
]

#: Keys per ``MIGRATE`` (what ``redis-cli --cluster reshard`` moves per step).
MIGRATE_BATCH = 100
#: ``MIGRATE``'s own timeout (ms): the longest one batch may take between the two nodes.
MIGRATE_TIMEOUT_MS = 10_000
#: How long the primaries may take to agree on the slot's new owner after ``SETSLOT NODE``.
SETTLE_S = 30.0

#: ``freeze(True)`` freezes the slot's buckets, ``freeze(False)`` unfreezes them; both
#: idempotent.
Freeze = Callable[[bool], Awaitable[object]]


class MoveFailed(Exception):
    """The move stopped half way (a node that refuses, the cluster unreachable): run it again
    (it goes on from where it is)."""


class MoveRefused(MoveFailed):
    """The move cannot be made as asked (not a slot, the target not a primary, a slot claimed
    by several primaries), found before anything was frozen: running it again as it is will
    not help."""


@dataclass(slots=True)
class MoveReport:
    """What a run did: the slot, from which primary to which, the keys it moved (this
    run), and whether it found the move begun (``resumed``) or already done (``already``)."""

    slot: int
    source: str | None
    target: str
    keys_moved: int = 0
    batches: int = 0
    resumed: bool = False
    already: bool = False
    steps: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        if self.already:
            return [f"slot {self.slot} is on {self.target} (nothing to move); unfrozen"]
        how = "resumed" if self.resumed else "moved"
        return [
            f"slot {self.slot} {how} from {self.source} to {self.target}: "
            f"{self.keys_moved} keys in {self.batches} batches; unfrozen"
        ]


def parse_node(text: str) -> Address:
    """``HOST:PORT`` (``[::1]:7000`` for IPv6) as an address; ValueError saying the form."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def buckets_in_slot(prefix: str, buckets: int, slot: int) -> list[int]:
    """The buckets of a store (key prefix, bucket count) whose keys hash to ``slot``."""
    return [n for n in range(buckets) if slot_of(bucket_tag(prefix, n)) == slot]


def store_freeze(store: ClusterStore, slot: int, why: str = "") -> Freeze:
    """``freeze`` for every bucket of ``store`` in ``slot`` (none: nothing to freeze; the
    slot holds other keys only): each bucket view's ``freeze_bucket`` (``why``, kept for an
    operator who finds the bucket frozen) and ``thaw_bucket``."""
    numbers = buckets_in_slot(store.key_prefix, store.buckets, slot)
    reason = why or f"slot {slot} is moving to another primary (fencegate store move-slot)"

    async def freeze(frozen: bool) -> None:
        for n in numbers:
            if frozen:
                await store.views[n].freeze_bucket(reason)
            else:
                await store.views[n].thaw_bucket()

    return freeze


# --- where the slot is ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Own:
    """A primary's own word about ``slot`` (its ``myself`` line of ``CLUSTER NODES``)."""

    node_id: str
    address: Address
    primary: bool
    owns: bool
    migrating_to: str | None
    importing_from: str | None


def _address(field_: str) -> Address:
    host, _, port = field_.split("@", 1)[0].rpartition(":")
    return host.strip("[]"), int(port)


def _own_line(text: str, slot: int, asked: Address) -> _Own:
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8 or "myself" not in fields[2].split(","):
            continue
        owns = False
        migrating = importing = None
        for item in fields[8:]:
            if item.startswith("["):  # [slot->-id] migrating, [slot-<-id] importing
                number, arrow, other = item.strip("[]").partition("-")
                if int(number) == slot and arrow:
                    if other.startswith(">-"):
                        migrating = other[2:]
                    elif other.startswith("<-"):
                        importing = other[2:]
                continue
            low, _, high = item.partition("-")
            if int(low) <= slot <= int(high or low):
                owns = True
        host, port = _address(fields[1])
        return _Own(
            node_id=fields[0],
            address=(host or asked[0], port or asked[1]),
            primary="master" in fields[2].split(","),
            owns=owns,
            migrating_to=migrating,
            importing_from=importing,
        )
    raise MoveFailed(f"{asked[0]}:{asked[1]} sent no line about itself in CLUSTER NODES")


async def _nodes(router: ClusterRouter, address: Address) -> str:
    reply = await router.client(address).execute_command("CLUSTER", "NODES")  # type: ignore[no-untyped-call]
    return reply.decode() if isinstance(reply, bytes) else str(reply)


async def _primaries(router: ClusterRouter, slot: int, target: Address) -> list[_Own]:
    """Every primary's own word about ``slot``, the target's included (read first, from the
    router's map, then the list one of them gives)."""
    await router.refresh()
    seeds = list(dict.fromkeys([*router.primaries(), target]))
    listed: list[Address] = []
    for address in seeds:
        try:
            text = await _nodes(router, address)
        except Exception:  # the next node, then
            continue
        for line in text.splitlines():
            fields = line.split()
            if len(fields) >= 8 and "master" in fields[2] and "fail" not in fields[2]:
                host, port = _address(fields[1])
                listed.append((host or address[0], port))
        break
    owns: list[_Own] = []
    for address in dict.fromkeys([*listed, target]):
        own = _own_line(await _nodes(router, address), slot, address)
        if own.primary:
            owns.append(own)
    return owns


# --- the move ------------------------------------------------------------------------------


async def move_bucket_slot(
    router: ClusterRouter,
    slot: int,
    target_node: Address | str,
    freeze: Freeze,
    *,
    batch: int = MIGRATE_BATCH,
    migrate_timeout_ms: int = MIGRATE_TIMEOUT_MS,
    auth: tuple[str | None, str] | None = None,
    settle_s: float = SETTLE_S,
    say: Callable[[str], object] | None = None,
    after_batch: Callable[[int], Awaitable[object]] | None = None,
) -> MoveReport:
    """Move ``slot`` to the primary at ``target_node`` (module docstring: freeze, IMPORTING
    and MIGRATING, MIGRATE in batches of ``batch`` keys, SETSLOT NODE on every primary,
    unfreeze). ``auth``: (user or None, password) for ``MIGRATE`` to log in to the target.
    ``after_batch(n)``: awaited after the n-th batch (tests stop a move half way with it).
    MoveFailed, or the driver's error, leaves the move where it stopped: run it again."""
    if not 0 <= slot < CLUSTER_SLOTS:
        raise MoveRefused(f"slot {slot} is not a slot (0..{CLUSTER_SLOTS - 1})")
    target = parse_node(target_node) if isinstance(target_node, str) else target_node
    name = f"{target[0]}:{target[1]}"

    def note(line: str) -> None:
        report.steps.append(line)
        if say is not None:
            say(line)

    report = MoveReport(slot=slot, source=None, target=name)
    try:
        owns = await _primaries(router, slot, target)
    except MoveFailed:
        raise
    except ResponseError as exc:  # a node that answers but refuses: running again won't help
        raise MoveRefused(f"{name} or a node of the cluster refused CLUSTER NODES ({exc})") from exc
    except Exception as exc:
        raise MoveFailed(f"the cluster did not answer ({type(exc).__name__}: {exc})") from exc
    to = next((own for own in owns if own.address == target), None)
    if to is None:
        raise MoveRefused(f"{name} is not a primary of the cluster (CLUSTER NODES)")
    sources = [own for own in owns if own.owns and own.node_id != to.node_id]
    pending = any(own.migrating_to or own.importing_from for own in owns)
    if not sources and to.owns and not pending:
        await freeze(False)  # a run that crashed after the last SETSLOT NODE
        report.already = True
        note(f"slot {slot} is on {name}")
        return report
    if len(sources) > 1:
        raise MoveRefused(
            f"slot {slot} is claimed by several primaries "
            f"({', '.join(f'{s.address[0]}:{s.address[1]}' for s in sources)}): "
            "let the cluster settle (CLUSTER NODES), then run the move again"
        )
    source = sources[0] if sources else None
    report.resumed = pending or (source is not None and to.owns)
    await freeze(True)
    note(f"slot {slot}: frozen")
    if source is not None:
        report.source = f"{source.address[0]}:{source.address[1]}"
        if not to.owns and to.importing_from != source.node_id:
            await _setslot(router, to.address, slot, "IMPORTING", source.node_id)
        if source.migrating_to != to.node_id:
            await _setslot(router, source.address, slot, "MIGRATING", to.node_id)
        note(f"slot {slot}: migrating from {report.source} to {name}")
        await _migrate_keys(
            router, source.address, target, slot, batch, migrate_timeout_ms, auth, report,
            after_batch,
        )  # fmt: skip
    # The target first (it must own the slot before the source lets it go), then the rest.
    order = [to, *([source] if source is not None else []), *owns]
    for own in dict.fromkeys(o.address for o in order):
        await _setslot(router, own, slot, "NODE", to.node_id)
    await _settled(router, slot, target, to.node_id, settle_s)
    await router.refresh()
    note(f"slot {slot}: every primary places it on {name}")
    await freeze(False)
    note(f"slot {slot}: unfrozen")
    return report


async def _setslot(router: ClusterRouter, address: Address, slot: int, *how: str) -> None:
    try:
        await router.client(address).execute_command("CLUSTER", "SETSLOT", slot, *how)  # type: ignore[no-untyped-call]
    except Exception as exc:
        raise MoveFailed(
            f"CLUSTER SETSLOT {slot} {' '.join(how)} on {address[0]}:{address[1]}: {exc}"
        ) from exc


async def _migrate_keys(
    router: ClusterRouter,
    source: Address,
    target: Address,
    slot: int,
    batch: int,
    timeout_ms: int,
    auth: tuple[str | None, str] | None,
    report: MoveReport,
    after_batch: Callable[[int], Awaitable[object]] | None,
) -> None:
    client = router.client(source)
    login: Sequence[Any] = ()
    if auth is not None:
        user, password = auth
        login = ("AUTH2", user, password) if user else ("AUTH", password)
    while True:
        keys = await client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch)  # type: ignore[no-untyped-call]
        if not keys:
            return
        try:
            await client.execute_command(  # type: ignore[no-untyped-call]
                "MIGRATE", target[0], target[1], "", 0, timeout_ms, *login, "REPLACE",
                "KEYS", *keys,
            )  # fmt: skip
        except Exception as exc:
            raise MoveFailed(
                f"MIGRATE of {len(keys)} keys of slot {slot} to {target[0]}:{target[1]}: {exc}"
            ) from exc
        report.keys_moved += len(keys)
        report.batches += 1
        if after_batch is not None:
            await after_batch(report.batches)


async def _settled(
    router: ClusterRouter, slot: int, target: Address, target_id: str, settle_s: float
) -> None:
    """Until every primary's own line places ``slot`` on the target alone, with no
    migration state left (SETSLOT NODE clears it where it is sent)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settle_s
    while True:
        owns = await _primaries(router, slot, target)
        if all(
            own.owns == (own.node_id == target_id)
            and own.migrating_to is None
            and own.importing_from is None
            for own in owns
        ):
            return
        if loop.time() > deadline:
            raise MoveFailed(
                f"the primaries did not agree within {settle_s:g} s that slot {slot} is on "
                f"{target[0]}:{target[1]}: run the move again"
            )
        await asyncio.sleep(0.05)


async def move_store_slot(
    store: ClusterStore,
    url: str,
    slot: int,
    target: Address,
    *,
    password: str | None = None,
    timeout_ms: int = 2000,
    batch: int = MIGRATE_BATCH,
    say: Callable[[str], object] | None = None,
) -> MoveReport:
    """``move_bucket_slot`` for a cluster store opened from its ``redis+cluster://`` ``url``
    (``fencegate store move-slot``): the store's buckets in the slot frozen through its
    views, the move on a router of its own, ``MIGRATE`` logged in as the store is."""
    from fencegate.ledger.cluster_router import ClusterRouter, parse_cluster_url

    _, username, _ = parse_cluster_url(url)
    router = ClusterRouter.from_url(url, timeout_ms=timeout_ms, password=password)
    try:
        return await move_bucket_slot(
            router,
            slot,
            target,
            store_freeze(store, slot),
            batch=batch,
            auth=(username, password) if password else None,
            say=say,
        )
    finally:
        await router.aclose()
