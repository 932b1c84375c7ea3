"""``fencegate``: the command line. ``serve`` runs the gateway."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

# First: structlog loads without rich (its module docstring says why).
import fencegate.gateway.structlog_without_rich  # noqa: F401
from fencegate.gateway.config import (
    Config,
    ConfigError,
    ServerConfig,
    load_config,
    parse_listen,
    public_url,
)
from fencegate.gateway.demo import register as _add_demo
from fencegate.gateway.ops_cli import add_global_options, merge_global_options
from fencegate.gateway.ops_cli import register as _add_ops
from fencegate.gateway.token_cli import register as _add_token
from fencegate.gateway.version import gateway_version

__all__ = ["build_parser", "main", "reload_auth", "server_ssl_context"]

if TYPE_CHECKING:
    import asyncio
    import socket
    import ssl

    from aiohttp import web

#: What builds the event loop of ``serve`` (None: asyncio's own).
LoopFactory = Callable[[], "asyncio.AbstractEventLoop"] | None


def _event_loop(choice: str) -> tuple[str, LoopFactory]:
    """``server.event_loop``: uvloop (a dependency on Linux and macOS: less CPU per call in
    the loop itself) for ``uvloop``, and for ``auto`` where it is installed; asyncio's loop
    otherwise. The name goes into ``gateway.starting``. ConfigError for ``uvloop`` when it
    is not installed."""
    if choice == "asyncio":
        return "asyncio", None
    try:
        import uvloop
    except ImportError as exc:
        if choice == "uvloop":
            raise ConfigError(
                f"server.event_loop = 'uvloop': cannot import uvloop ({exc})"
            ) from exc
        return "asyncio", None
    return "uvloop", uvloop.new_event_loop


def server_ssl_context(server: ServerConfig) -> ssl.SSLContext | None:
    """The listener's TLS context (None without ``tls_cert_file``): TLS 1.2 or later, and
    with ``tls_client_ca_file`` a client certificate signed by those CAs, and only those
    (not the system's: any public CA could otherwise name a principal), is required.
    Raise ``ConfigError`` naming the key whose file cannot be used."""
    import ssl

    if server.tls_cert_file is None or server.tls_key_file is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        # An encrypted key is refused rather than prompted for on the terminal.
        context.load_cert_chain(server.tls_cert_file, server.tls_key_file, password=b"")
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"server.tls_cert_file / server.tls_key_file: cannot load ({server.tls_cert_file}, "
            f"{server.tls_key_file}; an unencrypted PEM key matching the certificate): {exc}"
        ) from exc
    if server.tls_client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=server.tls_client_ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"server.tls_client_ca_file: cannot load {server.tls_client_ca_file}: {exc}"
            ) from exc
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _serve(args: argparse.Namespace) -> int:
    """Every line this writes to stderr is one JSON object (gateway/logs.py), start-up errors
    included; exit 2 for a config that cannot be used, 1 for a store or listen failure.
    ``--check`` is for a person at a terminal (and a deploy script's exit code): plain lines,
    the summary on stdout and the one error on stderr."""
    # Imported here: the operator commands should not pay for the server's imports.
    import structlog

    from fencegate.gateway.config import with_listen, with_workers
    from fencegate.gateway.console.session import secret_problem
    from fencegate.gateway.logs import configure_logging
    from fencegate.gateway.mcp_sessions import secret_problem as session_secret_problem
    from fencegate.gateway.tracing import missing_extra
    from fencegate.gateway.workers import check_platform

    configure_logging("error" if args.check else "info")
    log = structlog.get_logger("fencegate")
    try:
        config = load_config(args.config)
        if args.listen:
            parse_listen(args.listen)
            config = with_listen(config, args.listen)
        if args.workers is not None:
            config = with_workers(config, args.workers)
        unsupported = check_platform(config.server.workers)
        if unsupported is not None:
            raise ConfigError(unsupported)
        console_secret = secret_problem(os.environ)
        if console_secret is not None:
            raise ConfigError(console_secret)
        session_secret = session_secret_problem(os.environ)
        if session_secret is not None:
            raise ConfigError(session_secret)
        if config.tracing is not None and (missing := missing_extra()) is not None:
            raise ConfigError(missing)  # names the extra: pip install 'fencegate[otel]'
        loop_name, loop_factory = _event_loop(config.server.event_loop)
        ssl_context = server_ssl_context(config.server)
    except (ConfigError, ValueError) as exc:
        if args.check:
            print(f"fencegate serve --check: config error: {exc}", file=sys.stderr)
        else:
            log.error("gateway.config_error", error=f"config error: {exc}")
        return 2
    if args.check:
        return _check(config, args.config, ssl_context is not None)
    listen = config.server.listen
    configure_logging(config.logging.level)
    log = structlog.get_logger("fencegate")
    log.info(
        "gateway.starting",
        version=gateway_version(),
        config=os.path.abspath(args.config) if args.config else None,
        listen=listen,
        store=public_url(config.store.url),
        workers=config.server.workers,
        loop=loop_name,
    )
    for downstream in config.downstreams:
        log.info(
            "gateway.downstream",
            name=downstream.name,
            url=public_url(downstream.url),
            adapter=downstream.adapter,
            timeout_ms=downstream.timeout_ms,
        )
    if config.auth is None:
        log.warning(
            "gateway.unauthenticated",
            listen=listen,
            detail="no [auth] section: any client that reaches this address may use every "
            "endpoint (docs/security.md)",
        )
    if config.server.workers == 1:
        return _serve_one(config, args.config, ssl_context, loop_factory)
    return _serve_workers(config, args.config, ssl_context, loop_factory)


def _serve_one(
    config: Config,
    config_path: str | None,
    ssl_context: ssl.SSLContext | None,
    loop_factory: LoopFactory,
    sockets: Sequence[socket.socket] | None = None,
    listening: Callable[[], None] | None = None,
) -> int:
    """One gateway process (or one worker of several: on the supervisor's ``sockets``) until
    SIGTERM or SIGINT; its exit code."""
    import asyncio

    import structlog

    from fencegate.gateway.app import create_app
    from fencegate.ledger.errors import StoreUnavailable

    log = structlog.get_logger("fencegate")
    host, port = parse_listen(config.server.listen)
    try:
        app = create_app(config)
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(
                _run(app, host, port, config.server, config_path, ssl_context, sockets, listening)
            )
    except StoreUnavailable as exc:
        log.error("gateway.store_error", error=exc.detail)
        return 1
    except OSError as exc:
        log.error(
            "gateway.cannot_listen", listen=config.server.listen, error=exc.strerror or str(exc)
        )
        return 1
    return 0


def _serve_workers(
    config: Config,
    config_path: str | None,
    ssl_context: ssl.SSLContext | None,
    loop_factory: LoopFactory,
) -> int:
    """``server.workers`` processes under one supervisor (gateway/workers.py says why this
    shape); the metrics of all of them are answered by each (gateway/metrics.py)."""
    import shutil
    import tempfile

    import structlog

    from fencegate.gateway.metrics import share_between_processes
    from fencegate.gateway.workers import Supervisor, bind_sockets

    host, port = parse_listen(config.server.listen)
    try:
        slots = bind_sockets(host, port, config.server.workers)
    except OSError as exc:
        structlog.get_logger("fencegate").error(
            "gateway.cannot_listen", listen=config.server.listen, error=exc.strerror or str(exc)
        )
        return 1
    metrics_directory = tempfile.mkdtemp(prefix="fencegate-metrics-")
    share_between_processes(metrics_directory)

    def worker(index: int, sockets: Sequence[socket.socket], listening: Callable[[], None]) -> int:
        return _serve_one(config, config_path, ssl_context, loop_factory, sockets, listening)

    try:
        return Supervisor(slots, worker).run()
    finally:  # only the supervisor gets here: a worker leaves through os._exit
        shutil.rmtree(metrics_directory, ignore_errors=True)


def _check(config: Config, config_path: str | None, tls: bool) -> int:
    """``serve --check``: everything ``serve`` does before it binds (the app is built, the
    store opened, pinged and closed), then a summary. Like ``nginx -t``, it answers "would
    this start?" without taking the port from a running gateway. A store that answers but
    would keep ``/readyz`` failing (``store.require_durable``) fails the check too."""
    import asyncio

    from fencegate.gateway.app import create_app
    from fencegate.gateway.state import STORE
    from fencegate.ledger.errors import StoreUnavailable
    from fencegate.ledger.store import Store

    async def reach(store: Store) -> list[str]:
        await store.open()
        try:
            await store.ping()
            return await store.durability()
        finally:
            await store.close()

    store_url = public_url(config.store.url)
    try:
        app = create_app(config)
        warnings = asyncio.run(reach(app[STORE]))
    except (StoreUnavailable, OSError) as exc:
        reason = exc.detail if isinstance(exc, StoreUnavailable) else str(exc)
        print(
            f"fencegate serve --check: store error: {store_url}: {reason or type(exc).__name__}",
            file=sys.stderr,
        )
        return 1
    if warnings and config.store.require_durable:
        print(
            f"fencegate serve --check: store error: {store_url}: " + "; ".join(warnings)
            + " (store.require_durable = true: /readyz would fail; fix Redis or set it false)",
            file=sys.stderr,
        )  # fmt: skip
        return 1
    scheme = "https" if tls else "http"
    lines = [
        f"config: {os.path.abspath(config_path) if config_path else '(built-in defaults)'}",
        f"store: {store_url} (reached)",
        *(f"warning: store: {w}" for w in warnings),
        f"listen: {scheme}://{config.server.listen} (not bound by --check)",
        f"workers: {config.server.workers}",
        "auth: "
        + (
            f"{len(config.auth.principals)} principal(s)"
            + (f", OAuth tokens of {config.auth.oauth.issuer}" if config.auth.oauth else "")
            if config.auth is not None
            else "none: any client that reaches the address may use every endpoint"
        ),
        *_session_warning(config),
        *_role_warnings(config),
        f"downstreams: {len(config.downstreams)}",
        *(
            f"  {d.name}: url={public_url(d.url)} adapter={d.adapter} timeout_ms={d.timeout_ms}"
            for d in config.downstreams
        ),
        "fencegate serve --check: ok (the config is valid and the store answers)",
    ]
    print("\n".join(lines))
    return 0


def _role_warnings(config: Config) -> list[str]:
    """``serve --check``'s lines for principals and ``[auth.oauth]`` profiles whose roles
    defeat a rule (``auth.role_warnings``: worker and client together); start-up logs the
    same as ``auth.worker_and_client``."""
    from fencegate.gateway.auth import principal_from_config, role_warnings

    if config.auth is None:
        return []
    principals = [principal_from_config(p) for p in config.auth.principals]
    return [f"warning: auth: {line}" for line in role_warnings(principals, config.auth.oauth)]


def _session_warning(config: Config) -> list[str]:
    """``serve --check``'s line when MCP session ids are bound under a key of this process
    only (``[auth]`` and an MCP downstream, no ``FENCEGATE_SESSION_SECRET``)."""
    from fencegate.gateway.mcp_sessions import SECRET_ENV

    if config.auth is None or os.environ.get(SECRET_ENV):
        return []
    if not any(d.adapter == "mcp" for d in config.downstreams):
        return []
    return [
        f"warning: {SECRET_ENV} is not set: MCP session ids are bound to their principal "
        "under a random key of this process, so MCP sessions will not survive a restart "
        "and will not be shared across gateways (serve --workers shares one)"
    ]


def reload_auth(app: web.Application, config_path: str | None) -> bool:
    """SIGHUP: read the ``[auth]`` section (only it) of ``config_path`` again and swap the
    principals at once. A file that cannot be used keeps the principals in force and logs
    ``auth.reload_failed`` with the key at fault. True when the new principals are in force."""
    import structlog

    from fencegate.gateway.auth import auth_state, principal_from_config
    from fencegate.gateway.config import AuthReloadError, load_auth
    from fencegate.gateway.mcp_streams import STREAMS
    from fencegate.gateway.state import EVENTS

    log = structlog.get_logger("fencegate")
    state = auth_state(app)
    if state is None or config_path is None:
        log.warning(
            "auth.reload_failed",
            key="auth",
            error="started without [auth] (or without --config): restart to turn it on",
        )
        return False
    try:
        auth = load_auth(config_path)
    except AuthReloadError as exc:
        log.error("auth.reload_failed", key=exc.key, error=str(exc))
        return False
    state.reload(auth)
    # Open event streams, long-polls and MCP streams are judged again under the new principals;
    # those of OAuth tokens are kept unless [auth.oauth] changed.
    principals = [principal_from_config(p) for p in auth.principals]
    keep_oauth = not state.oauth_changed
    app[EVENTS].reload(principals, keep_oauth=keep_oauth)
    app[STREAMS].reload(principals, keep_oauth=keep_oauth)
    log.info("auth.reloaded", principals=[p.name for p in auth.principals],
             oauth=auth.oauth is not None, oauth_changed=state.oauth_changed)  # fmt: skip
    return True


async def _run(
    app: web.Application,
    host: str,
    port: int,
    server: ServerConfig,
    config_path: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
    sockets: Sequence[socket.socket] | None = None,
    listening: Callable[[], None] | None = None,
) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, through the guarded listener (connection limit,
    parser errors as problem+json, JSON access log), then shut down gracefully. SIGHUP reloads
    the ``[auth]`` principals from ``config_path`` (``reload_auth``). A worker of several
    serves on the ``sockets`` its supervisor bound and calls ``listening`` once it takes
    calls and handles the signals."""
    import asyncio
    import logging
    import signal
    import time

    import structlog
    from aiohttp import web

    from fencegate.gateway.logs import AccessLog
    from fencegate.gateway.request_guard import ConnectionSlots, GuardedSite, handler_factory
    from fencegate.gateway.state import CONFIG
    from fencegate.gateway.workers import SocketSite, unblock_stop_signals

    options: dict[str, Any] = {
        "access_log_class": AccessLog,
        "access_log": logging.getLogger("aiohttp.access"),
        "keepalive_timeout": server.idle_timeout_ms / 1000,
    }
    runner = web.AppRunner(app, **options)
    await runner.setup()
    try:
        assert runner.server is not None
        slots = ConnectionSlots(
            server.max_connections,
            server.max_connections_per_peer,
            authenticated=app[CONFIG].auth is not None,
            per_principal=server.principal_connection_limit,
        )
        factory = handler_factory(runner.server, slots, **options)
        # A handshake is not yet a counted connection: bound how long one may take.
        handshake_timeout = min(server.idle_timeout_ms / 1000, 30.0)
        sites: list[GuardedSite] = (
            [GuardedSite(runner, host, port, factory, ssl_context=ssl_context,
                         ssl_handshake_timeout=handshake_timeout)]
            if sockets is None
            else [SocketSite(runner, sock, host, port, factory, ssl_context=ssl_context,
                             ssl_handshake_timeout=handshake_timeout) for sock in sockets]
        )  # fmt: skip
        stop = asyncio.Event()
        received: list[str] = []

        def on_signal(signum: signal.Signals) -> None:
            received.append(signum.name)
            stop.set()

        # Before the first site starts: a site may answer /readyz while it starts, and a
        # SIGINT sent on that answer must stop the gateway cleanly, not kill it.
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_signal, signum)
        loop.add_signal_handler(signal.SIGHUP, reload_auth, app, config_path)
        unblock_stop_signals()  # a worker's: blocked since the fork, so none was lost
        for site in sites:
            await site.start()
        log = structlog.get_logger("fencegate")
        log.info("gateway.listening", listen=sites[0].name, max_connections=server.max_connections)
        if listening is not None:
            listening()
        await stop.wait()
        log.info("gateway.stopping", signal=received[0])
        draining_since = time.monotonic()
    finally:
        # Closes the listener, waits for the requests in flight (aiohttp's shutdown timeout),
        # then runs the app's cleanup (reconciler, HTTP client, store).
        await runner.cleanup()
    structlog.get_logger("fencegate").info(
        "gateway.stopped", drain_ms=round((time.monotonic() - draining_since) * 1000)
    )


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", metavar="FILE", help="TOML config (default: embedded store)")
    serve.add_argument("--listen", metavar="HOST:PORT", help="override server.listen")
    serve.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="override server.workers: N processes share the port and the store (Redis or "
        "PostgreSQL; SQLite is refused: one process owns it)",
    )
    serve.add_argument(
        "--check",
        action="store_true",
        help="validate the config, reach the store, print a summary and exit (never binds)",
    )
    serve.set_defaults(func=_serve)


#: Each entry adds its subcommands to the parser; a subcommand sets ``func(args) -> int``.
#: Operator commands and the demo live in their own modules and register here.
COMMANDS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    _add_serve,
    _add_ops,
    _add_demo,
    _add_token,
]


def build_parser() -> argparse.ArgumentParser:
    """``fencegate``'s whole parser (tests walk it: every ``choices`` is held to its source)."""
    parser = argparse.ArgumentParser(
        prog="fencegate", description="A fencing gateway for autonomous workers."
    )
    parser.add_argument("--version", action="version", version=f"fencegate {gateway_version()}")
    # The operator commands' options may also come before the command (fencegate --url U ...).
    add_global_options(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    merge_global_options(parser, args)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
