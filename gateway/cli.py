"""``fencegate``: the command line. ``serve`` runs the gateway."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from fencegate.gateway.config import ConfigError, load_config, parse_listen
from fencegate.gateway.demo import register as _add_demo
from fencegate.gateway.ops_cli import register as _add_ops

__all__ = ["main"]


def _serve(args: argparse.Namespace) -> int:
    # Imported here: the operator commands should not pay for the server's imports.
    import structlog
    from aiohttp import web

    from fencegate.gateway.app import create_app
    from fencegate.gateway.logs import configure_logging
    from fencegate.ledger.errors import StoreUnavailable

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"fencegate: config error: {exc}", file=sys.stderr)
        return 2
    listen = args.listen or config.server.listen
    try:
        host, port = parse_listen(listen)
    except ValueError as exc:
        print(f"fencegate: --listen: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.logging.level)
    log = structlog.get_logger("fencegate")
    log.info("gateway.starting", listen=listen, store=config.store.url.split("@")[-1])
    try:
        web.run_app(
            create_app(config),
            host=host,
            port=port,
            print=None,
            access_log=None,
        )
    except StoreUnavailable as exc:
        print(f"fencegate: store error: {exc.detail}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"fencegate: cannot listen on {listen}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", metavar="FILE", help="TOML config (default: embedded store)")
    serve.add_argument("--listen", metavar="HOST:PORT", help="override server.listen")
    serve.set_defaults(func=_serve)


#: Each entry adds its subcommands to the parser; a subcommand sets ``func(args) -> int``.
#: Operator commands and the demo live in their own modules and register here.
COMMANDS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    _add_serve,
    _add_ops,
    _add_demo,
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fencegate", description="A fencing gateway for autonomous workers."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
