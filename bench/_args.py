"""Command-line options the benchmarks share, each defined once (name, default, help).

``add_store_options`` adds what selects and tunes the stores of a run (``--stores``,
``--appendfsync``, ``--sqlite-synchronous``, ``--postgres-max-connections``);
``add_run_options`` adds what every benchmark takes
about its processes and its output (``--json``, ``--temp-dir``, ``--keep``, ``--redis-server``,
``--gateway-src``). ``parse_stores`` and ``check_run_options`` are the checks that go with them,
run after ``parse_args``. Options whose meaning differs per benchmark (``--concurrency``,
``--max-seconds``, ``--warmup``, ``--log-level``...) stay in each benchmark.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "ALL_STORES",
    "STORES",
    "add_run_options",
    "add_store_options",
    "check_run_options",
    "parse_stores",
]

#: The stores every benchmark runs against (``soak_kill`` runs these only).
STORES = ("sqlite", "redis")
#: Every store ``--stores`` accepts (``claim_commit``, ``proxy``): PostgreSQL runs on a private
#: cluster the benchmark starts (``tests.postgres_server``), never the machine's own.
ALL_STORES = (*STORES, "postgres")


def add_store_options(parser: argparse.ArgumentParser, *, stores: str) -> None:
    """``--stores`` (default ``stores``, e.g. ``"sqlite,redis,postgres"``: also the order of
    the phases), ``--appendfsync``, ``--sqlite-synchronous`` and
    ``--postgres-max-connections``."""
    parser.add_argument(
        "--stores",
        default=stores,
        help=f"comma-separated subset of {','.join(ALL_STORES)} (also the order of the phases)",
    )
    parser.add_argument(
        "--appendfsync",
        choices=("always", "everysec"),
        default="always",
        help="redis-server's appendfsync (always is the production advice)",
    )
    parser.add_argument(
        "--sqlite-synchronous",
        choices=("FULL", "NORMAL"),
        default="FULL",
        help="store.sqlite_synchronous of the sqlite gateway",
    )
    parser.add_argument(
        "--postgres-max-connections",
        type=int,
        metavar="N",
        help="store.postgres_max_connections of the postgres gateway (unset: the gateway's "
        "default, 20); the private PostgreSQL always runs with fsync=on, "
        "synchronous_commit=on",
    )


def add_run_options(
    parser: argparse.ArgumentParser, *, report: str = "the table then goes"
) -> None:
    """``--json``, ``--temp-dir``, ``--keep``, ``--redis-server`` and ``--gateway-src``.
    ``report`` says what moves to stderr when the JSON goes to stdout."""
    parser.add_argument(
        "--json",
        metavar="FILE",
        help=f"also write the results as JSON to FILE ('-': stdout, {report} to stderr)",
    )
    parser.add_argument(
        "--temp-dir",
        metavar="DIR",
        help="where the temporary directory goes (default: the system's; avoid tmpfs)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the temporary directory (logs, data)"
    )
    parser.add_argument(
        "--redis-server",
        default=shutil.which("redis-server"),
        help="redis-server binary (default: from PATH)",
    )
    parser.add_argument(
        "--gateway-src",
        metavar="DIR",
        type=Path,
        help="run the gateway from this source tree (e.g. a `git archive` of a commit) "
        "instead of the installed checkout",
    )


def add_store_bench_options(parser: argparse.ArgumentParser) -> None:
    """The options of the benchmarks that drive a store in-process against its own
    redis-server (``redis_steps``, ``queue_claims``): ``--base-src`` (another revision's
    store, measured first in a child process: ``_procs.run_phase_in``) and
    ``--redis-server``."""
    parser.add_argument(
        "--base-src",
        metavar="DIR",
        type=Path,
        help="also measure this source tree's store (e.g. a `git archive` of a commit), first",
    )
    parser.add_argument(
        "--redis-server",
        default=shutil.which("redis-server") or "redis-server",
        help="redis-server binary (default: from PATH)",
    )


def parse_stores(
    parser: argparse.ArgumentParser,
    raw: str,
    default: str,
    allowed: Sequence[str] = ALL_STORES,
) -> list[str]:
    """The stores of ``--stores``, in the order given; each at most once."""
    stores = [s.strip() for s in raw.split(",") if s.strip()]
    if not stores or any(s not in allowed for s in stores) or len(set(stores)) != len(stores):
        parser.error(f"--stores: expected a comma-separated subset of {','.join(allowed)}")
    return stores


def check_run_options(
    parser: argparse.ArgumentParser, args: argparse.Namespace, stores: Sequence[str]
) -> None:
    """Refuse a run that needs Redis without a redis-server, or PostgreSQL without its server
    binaries (or from outside the repository root, where ``tests.postgres_server`` is); make
    ``--gateway-src`` absolute (the gateway runs in a temporary directory)."""
    if {"redis", "sentinel"} & set(stores) and not args.redis_server:
        parser.error("redis-server is not on PATH (apt-get install -y redis-server)")
    if "postgres" in stores:
        try:
            from tests.postgres_server import postgres_bindir
        except ImportError as exc:
            parser.error(f"--stores postgres: run from the repository root ({exc})")
        try:
            postgres_bindir()
        except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
            parser.error(f"--stores postgres: {exc}")
    if getattr(args, "postgres_max_connections", None) is not None and not (
        1 <= args.postgres_max_connections <= 1000
    ):
        parser.error("--postgres-max-connections must be in 1..1000")
    if args.gateway_src is not None:
        args.gateway_src = args.gateway_src.resolve()
