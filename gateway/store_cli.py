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
import sys

from fencegate.gateway.config import ConfigError, load_config, public_url
from fencegate.ledger.errors import StoreUnavailable

__all__ = ["migrate"]


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
