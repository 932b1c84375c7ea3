"""``fencegate store migrate``: bring a store written by an older fencegate to this version's
format, straight against the store of a config file (no gateway needed).

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

from fencegate.gateway.config import ConfigError, load_config, public_url
from fencegate.ledger.errors import StoreRegressed, StoreUnavailable

__all__ = ["failover_ack", "migrate"]


def migrate(args: argparse.Namespace) -> int:
    """Exit 0 when the store is in the current format (migrated now or already), 2 for a
    config that cannot be used, 1 when the store cannot be reached or is newer."""
    from fencegate.gateway.app import build_store  # the server's imports, only when used

    try:
        config = load_config(args.config)
    except (ConfigError, ValueError) as exc:
        print(f"fencegate store migrate: config error: {exc}", file=sys.stderr)
        return 2
    where = public_url(config.store.url)

    async def run() -> list[str]:
        store = build_store(config)
        await store.open()
        try:
            return list((await store.migrate()).lines())
        finally:
            await store.close()

    try:
        lines = asyncio.run(run())
    except (StoreUnavailable, OSError) as exc:
        reason = exc.detail if isinstance(exc, StoreUnavailable) else str(exc)
        print(f"fencegate store migrate: {where}: {reason}", file=sys.stderr)
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
    from fencegate.gateway.app import build_store  # the server's imports, only when used
    from fencegate.ledger.errors import BadRequest

    try:
        config = load_config(args.config)
    except (ConfigError, ValueError) as exc:
        print(f"fencegate failover ack: config error: {exc}", file=sys.stderr)
        return 2
    where = public_url(config.store.url)

    async def run() -> int:
        store = build_store(config)
        with contextlib.suppress(StoreRegressed):  # what this command is for
            await store.open()
        try:
            return (await store.acknowledge_failover()).epoch
        finally:
            await store.close()

    try:
        epoch = asyncio.run(run())
    except BadRequest as exc:
        print(f"fencegate failover ack: {where}: {exc.detail}", file=sys.stderr)
        return 2
    except (StoreUnavailable, OSError) as exc:
        reason = exc.detail if isinstance(exc, StoreUnavailable) else str(exc)
        print(f"fencegate failover ack: {where}: {reason}", file=sys.stderr)
        return 1
    print(f"store: {where}")
    print(
        f"failover acknowledged: scheduler epoch is now {epoch} (every claim granted before "
        "is fenced: its worker gets STALE_EPOCH and claims again); gateways write again within "
        "a second. Settle the UNKNOWN effects: fencegate effects list --state UNKNOWN"
    )
    return 0
