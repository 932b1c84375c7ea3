"""The commands that work straight against the store of a config file (no gateway needed):
``fencegate store migrate``, ``fencegate store copy``, ``fencegate store move-slot``,
``fencegate failover ack`` and ``fencegate failover lost``.

``store migrate`` brings a store written by an older fencegate to this version's format.
``store copy`` copies a drained single Redis store into a Redis Cluster's bucket layout
(``ledger.cluster_copy``; docs/stores.md, "Moving to a cluster").

Every store records its format (SQL: the schema-version row; Redis: ``{prefix}:meta``
``format``). A newer format than this code knows is refused (exit 1, naming both); an older
one is migrated in steps that are each idempotent, so the command may be run again after an
interruption, or to be sure. What may run beside it is the store's to say
(``Store.migrate``'s report, printed): docs/operations.md, "Upgrades".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from fencegate.gateway.config import Config, ConfigError, load_config, public_url
from fencegate.ledger.errors import StoreRegressed, StoreUnavailable

if TYPE_CHECKING:
    from fencegate.ledger.store import Store

__all__ = ["copy", "failover_ack", "failover_lost", "migrate", "move_slot"]

_T = TypeVar("_T")


def _config(command: str, args: argparse.Namespace) -> Config | None:
    """The config of ``--config``, or None after saying on stderr why it cannot be used.
    Also sends the store's own warnings (durability, format) to stderr as JSON lines, so
    stdout is the command's report alone."""
    from fencegate.gateway.logs import configure_logging

    configure_logging("warning")
    try:
        return load_config(args.config)
    except (ConfigError, ValueError) as exc:
        print(f"{command}: config error: {exc}", file=sys.stderr)
        return None


def _on_store(command: str, config: Config, use: Callable[[Store], Awaitable[_T]]) -> _T | None:
    """``use`` on the store of ``config``, straight (no gateway), closed after; None after
    saying on stderr why the store could not be reached. The store is opened even when it
    reports lost writes (``StoreRegressed``): these commands are what an operator runs then,
    and a write the flag refuses still fails in ``use``."""
    from fencegate.gateway.app import build_store  # the server's imports, only when used

    async def run() -> _T:
        store = build_store(config)
        with contextlib.suppress(StoreRegressed):
            await store.open()
        try:
            return await use(store)
        finally:
            await store.close()

    try:
        return asyncio.run(run())
    except (StoreUnavailable, OSError) as exc:
        reason = exc.detail if isinstance(exc, StoreUnavailable) else str(exc)
        print(f"{command}: {public_url(config.store.url)}: {reason}", file=sys.stderr)
        return None


def migrate(args: argparse.Namespace) -> int:
    """Exit 0 when the store is in the current format (migrated now or already), 2 for a
    config that cannot be used, 1 when the store cannot be reached or is newer."""
    config = _config("fencegate store migrate", args)
    if config is None:
        return 2
    where = public_url(config.store.url)

    async def migrated(store: Store) -> list[str]:
        return list((await store.migrate()).lines())

    lines = _on_store("fencegate store migrate", config, migrated)
    if lines is None:
        return 1
    print(f"store: {where}")
    for line in lines:
        print(line)
    return 0


#: The stores ``store copy`` reads: one Redis (``ledger.redis_store``'s schemes).
_SINGLE_REDIS = ("redis", "rediss", "unix", "redis+sentinel")


def copy(args: argparse.Namespace) -> int:
    """``fencegate store copy --to URL``: exit 0 copied (or found already there), 1 refused
    (not drained, another store or bucket count on the cluster, the source changed meanwhile)
    or a store unreachable, 2 a config or ``--to`` that cannot be used."""
    import os

    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    from fencegate.ledger import cluster_copy
    from fencegate.ledger.cluster_router import CLUSTER_SCHEMES, ClusterRouter, parse_cluster_url
    from fencegate.ledger.redis_store import FORMAT_VERSION

    command = "fencegate store copy"
    config = _config(command, args)
    if config is None:
        return 2
    source_url = config.store.url
    scheme = source_url.partition("://")[0].lower()
    if scheme not in _SINGLE_REDIS:
        print(
            f"{command}: [store] url is {public_url(source_url)}: the copy reads a single Redis "
            f"store ({', '.join(s + '://' for s in _SINGLE_REDIS)})",
            file=sys.stderr,
        )
        return 2
    if args.to.partition("://")[0].lower() not in CLUSTER_SCHEMES:
        print(
            f"{command}: --to {public_url(args.to)}: not a Redis Cluster url; expected "
            "redis+cluster://[USER@]HOST1:PORT1,HOST2:PORT2,... (rediss+cluster:// for TLS)",
            file=sys.stderr,
        )
        return 2
    try:
        parse_cluster_url(args.to)
    except ValueError as exc:
        print(f"{command}: --to: {exc}", file=sys.stderr)
        return 2
    password_env = args.to_password_env or config.store.password_env
    try:
        password = config.store.password()
        to_password = os.environ[password_env] if password_env else None
    except KeyError as exc:
        print(f"{command}: the environment variable {exc} is not set", file=sys.stderr)
        return 2
    layout = cluster_copy.Layout(config.store.redis_key_prefix, config.store.cluster_buckets)
    target = public_url(args.to)
    print(f"store: {public_url(source_url)} (key prefix {layout.prefix!r})")
    print(f"to: {target} ({layout.buckets} buckets)")

    def say(line: str) -> None:
        print(line, flush=True)

    async def run() -> cluster_copy.CopyReport:
        source: aioredis.Redis = cluster_copy.source_client(
            source_url, password=password, timeout_ms=config.store.timeout_ms
        )
        router = ClusterRouter.from_url(
            args.to, timeout_ms=config.store.timeout_ms, password=to_password
        )
        try:
            return await cluster_copy.copy_store(
                source,
                router,
                layout,
                format_version=FORMAT_VERSION,
                batch=args.batch,
                say=say,
            )
        finally:
            await router.aclose()
            await source.aclose()

    try:
        report = asyncio.run(run())
    except cluster_copy.CopyRefused as exc:
        print(f"{command}: refused: {exc}", file=sys.stderr)
        return 1
    except (RedisError, OSError) as exc:
        print(
            f"{command}: a store did not answer ({type(exc).__name__}: {exc}); run the copy "
            "again once both answer (it goes on from what is there)",
            file=sys.stderr,
        )
        return 1
    for line in report.lines():
        print(line)
    print(
        f"done. Next: set every gateway's [store] url to {target} (with cluster_buckets = "
        f"{layout.buckets} and the same redis_key_prefix) and start them; the scheduler was "
        "copied as it was, so if you paused claims, resume them there (fencegate claims resume)"
    )
    return 0


def move_slot(args: argparse.Namespace) -> int:
    """``fencegate store move-slot SLOT --to HOST:PORT`` (``ledger.cluster_moves``): exit 0
    moved (or found there), 1 a move that stopped or a cluster unreachable (run it again: it
    goes on, and the slot's buckets stay frozen until it ends), 2 a move refused before
    anything was frozen (``--to`` not a primary), a config, ``SLOT`` or
    ``--to`` that cannot be used."""
    from redis.exceptions import RedisError

    from fencegate.ledger import cluster_moves
    from fencegate.ledger.buckets import CLUSTER_SLOTS
    from fencegate.ledger.cluster_router import CLUSTER_SCHEMES
    from fencegate.ledger.cluster_store import ClusterStore

    command = "fencegate store move-slot"
    config = _config(command, args)
    if config is None:
        return 2
    url = config.store.url
    if url.partition("://")[0].lower() not in CLUSTER_SCHEMES:
        print(f"{command}: [store] url is {public_url(url)}: not a redis+cluster:// store",
              file=sys.stderr)  # fmt: skip
        return 2
    if not 0 <= args.slot < CLUSTER_SLOTS:
        # Refused before the store is opened: "run it again" would not help.
        print(f"{command}: slot {args.slot} is not a slot (0..{CLUSTER_SLOTS - 1})",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        target = cluster_moves.parse_node(args.to)
        password = config.store.password()
    except (ValueError, KeyError) as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 2

    async def move(store: Store) -> cluster_moves.MoveReport:
        assert isinstance(store, ClusterStore)
        return await cluster_moves.move_store_slot(
            store, url, args.slot, target, password=password,
            timeout_ms=config.store.timeout_ms, batch=args.batch,
            say=lambda line: print(line, flush=True),
        )  # fmt: skip

    try:
        report = _on_store(command, config, move)
    except cluster_moves.MoveRefused as exc:
        print(f"{command}: {exc}; nothing was frozen or moved", file=sys.stderr)
        return 2
    except (cluster_moves.MoveFailed, RedisError) as exc:
        print(f"{command}: {exc}; run it again (it goes on from where it stopped; the "
              "slot's buckets stay frozen until it ends)", file=sys.stderr)  # fmt: skip
        return 1
    if report is None:
        return 1
    for line in report.lines():
        print(line)
    return 0


def failover_ack(args: argparse.Namespace) -> int:
    """``fencegate failover ack``: after a Redis failover (or restore) that lost writes,
    fence every claim granted before (one epoch bump) and let the gateways write again. Exit 0
    done, 1 store unreachable, 2 a config that cannot be used or a store with nothing to
    acknowledge."""
    from fencegate.ledger.errors import BadRequest

    config = _config("fencegate failover ack", args)
    if config is None:
        return 2
    where = public_url(config.store.url)

    async def acknowledged(store: Store) -> int:
        return (await store.acknowledge_failover()).epoch

    try:
        epoch = _on_store("fencegate failover ack", config, acknowledged)
    except BadRequest as exc:
        print(f"fencegate failover ack: {where}: {exc.detail}", file=sys.stderr)
        return 2
    if epoch is None:
        return 1
    print(f"store: {where}")
    print(
        f"failover acknowledged: scheduler epoch is now {epoch} (every claim granted before "
        "is fenced: its worker gets STALE_EPOCH and claims again); gateways write again within "
        "a second. Settle the UNKNOWN effects: fencegate effects list --state UNKNOWN"
    )
    return 0


#: Store reads at once while checking the journal: bounded, so a long log does not open a
#: connection per record.
_LOST_READS = 32


def failover_lost(args: argparse.Namespace) -> int:
    """``fencegate failover lost``: what the gateways' logs say was answered that the store
    no longer holds (gateway/failover_journal.py). Exit 0 nothing lost, 3 lost records found
    (listed), 1 store unreachable, 2 a config or log file that cannot be used."""
    from fencegate.gateway import failover_journal as fj
    from fencegate.ledger.errors import EffectExpired, NoSuchEffect, NoSuchTask, TaskExpired

    config = _config("fencegate failover lost", args)
    if config is None:
        return 2
    where = public_url(config.store.url)
    logs: list[tuple[str, list[str]]] = []
    for path in args.log:
        try:
            with open(path, encoding="utf-8", errors="replace") as file:
                logs.append((path, file.read().splitlines()))
        except OSError as exc:
            print(f"fencegate failover lost: --log {path}: {exc.strerror}", file=sys.stderr)
            return 2
    journal = fj.read_journal(logs)

    async def effect(store: Store, logged: fj.LoggedEffect) -> fj.Finding | None:
        try:
            state: str | None = (await store.get_effect(logged.effect_id)).state
        except EffectExpired:
            state = "EXPIRED"
        except NoSuchEffect:
            state = None
        return fj.effect_finding(logged, state)

    async def task(store: Store, task_id: str) -> list[fj.Finding]:
        claim, commit = journal.claims.get(task_id), journal.commits.get(task_id)
        try:
            record = await store.get_task(task_id)
            generation: int | None = record.claim_generation
            commit_id = record.commit.commit_id if record.commit else None
        except TaskExpired:
            generation, commit_id = -1, "EXPIRED"
        except NoSuchTask:
            generation, commit_id = None, None
        found = [
            fj.claim_finding(claim, generation) if claim else None,
            fj.commit_finding(commit, commit_id, gone=generation is None) if commit else None,
        ]
        return [finding for finding in found if finding is not None]

    async def lost(store: Store) -> list[fj.Finding]:
        limit = asyncio.Semaphore(_LOST_READS)

        async def bounded(check: Awaitable[_T]) -> _T:
            async with limit:
                return await check

        effects = await asyncio.gather(
            *(bounded(effect(store, logged)) for logged in journal.effects.values())
        )
        tasks = await asyncio.gather(
            *(bounded(task(store, t)) for t in sorted({*journal.claims, *journal.commits}))
        )
        return [f for f in effects if f is not None] + [f for found in tasks for f in found]

    findings = _on_store("fencegate failover lost", config, lost)
    if findings is None:
        return 1
    print(f"store: {where}")
    print(
        f"read {len(logs)} log(s): {journal.lines} lines ({journal.skipped} not events), "
        f"{len(journal.effects)} effects, {len(journal.claims)} claimed tasks, "
        f"{len(journal.commits)} commits"
    )
    by_kind = {
        kind: [f for f in findings if f.kind == kind] for kind in ("effect", "claim", "commit")
    }
    print(
        "lost: "
        + ", ".join(
            f"{len(found)} {kind}{'s' if len(found) != 1 else ''}"
            for kind, found in by_kind.items()
        )
    )
    for finding in findings:
        print(finding.line())
    return 3 if findings else 0
