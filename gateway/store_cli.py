"""The commands that work straight against the store of a config file (no gateway needed):
``fencegate store migrate``, ``fencegate failover ack`` and ``fencegate failover lost``.

``store migrate`` brings a store written by an older fencegate to this version's format.

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

__all__ = ["failover_ack", "failover_lost", "migrate"]

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
