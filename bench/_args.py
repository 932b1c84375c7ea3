"""Command-line options the benchmarks share, each defined once (name, default, help).

``add_store_options`` adds what selects and tunes the stores of a run (``--stores``,
``--appendfsync``, ``--sqlite-synchronous``); ``add_run_options`` adds what every benchmark takes
about its processes and its output (``--json``, ``--temp-dir``, ``--keep``, ``--redis-server``,
``--gateway-src``). ``parse_stores`` and ``check_run_options`` are the checks that go with them,
run after ``parse_args``. Options whose meaning differs per benchmark (``--concurrency``,
``--max-seconds``, ``--warmup``, ``--log-level``...) stay in each benchmark.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Sequence
from pathlib import Path

__all__ = ["STORES", "add_run_options", "add_store_options", "check_run_options", "parse_stores"]

#: Every store a benchmark can run against.
STORES = ("sqlite", "redis")


def add_store_options(parser: argparse.ArgumentParser, *, stores: str) -> None:
    """``--stores`` (default ``stores``, e.g. ``"sqlite,redis"``: also the order of the
    phases), ``--appendfsync`` and ``--sqlite-synchronous``."""
    parser.add_argument(
        "--stores",
        default=stores,
        help=f"comma-separated subset of {stores}",
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


def parse_stores(parser: argparse.ArgumentParser, raw: str, default: str) -> list[str]:
    """The stores of ``--stores``, in the order given; each at most once."""
    stores = [s.strip() for s in raw.split(",") if s.strip()]
    if not stores or any(s not in STORES for s in stores) or len(set(stores)) != len(stores):
        parser.error(f"--stores: expected a comma-separated subset of {default}")
    return stores


def check_run_options(
    parser: argparse.ArgumentParser, args: argparse.Namespace, stores: Sequence[str]
) -> None:
    """Refuse a run that needs Redis without a redis-server; make ``--gateway-src`` absolute
    (the gateway runs in a temporary directory)."""
    if "redis" in stores and not args.redis_server:
        parser.error("redis-server is not on PATH (apt-get install -y redis-server)")
    if args.gateway_src is not None:
        args.gateway_src = args.gateway_src.resolve()
