"""The operator commands: arguments -> calls of the SDK's ``Client`` -> rendered answers.

Every command is one or a few calls of ``fencegate.Client`` (the same HTTP client and problem
decoding workers use) to a running gateway, never the store, so it works the same against
SQLite and Redis and goes through the gateway's own checks and logs. ``ops_render`` turns the
answers into text; ``ops_cli`` registers the commands with ``fencegate``'s parser.

Every answer names the gateway it came from and why that one (``--url``, ``--config``,
``$FENCEGATE_URL`` or the default): a first line ``gateway URL (from ...)`` before text, a
``"gateway"`` field in ``--json``, a last stderr line after a refusal. An operator who reached
the wrong gateway must see it before acting on its ``no effects``.

Exit codes: 0 done; 1 the gateway refused (its problem code and detail on stderr, as
``fencegate: CODE: detail``) or answered something unexpected; 2 bad usage; 3 the gateway
could not be reached or did not answer in time; 4 ``rollout status``: not safe yet. See
``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import re
import socket
import ssl
import sys
import tomllib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp

from fencegate._http import RawAnswer, gateway_problem
from fencegate.client import TOKEN_ENV, Client
from fencegate.errors import EffectInFlight, EffectUnknown, GatewayUnreachable, ProblemError
from fencegate.gateway import ops_render as render
from fencegate.gateway.config import ServerConfig, parse_listen
from fencegate.ledger.queries import EFFECT_ID_OR_PREFIX, EFFECT_ID_RULE

__all__ = [
    "DEFAULT_URL",
    "EXIT_REFUSED",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "CliError",
    "Command",
    "Gateway",
    "OperatorClient",
    "gateway",
    "gateway_token",
    "gateway_url",
    "operator_name",
    "run",
]

#: Where ``fencegate serve`` listens without a config.
DEFAULT_URL = "http://127.0.0.1:8700"
#: Where the CA certificate(s) of an https gateway are found when ``--cacert`` is not given.
CACERT_ENV = "FENCEGATE_CACERT"
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_NOT_SAFE = 4

#: Largest page the ledger API serves; ``effects list`` asks for at most this many per call.
_PAGE = 500
_EFFECT_ID = re.compile(r"[0-9a-f]{64}")
_OPERATOR = re.compile(r"[A-Za-z0-9._:@/ -]{1,200}")

#: One command: the gateway's client and the parsed arguments in, the exit code out.
Command = Callable[["OperatorClient", argparse.Namespace], Awaitable[int]]


class CliError(Exception):
    """Ends the command: ``message`` goes to stderr after ``fencegate: ``."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


# --- which gateway, who is asking ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Gateway:
    """The gateway a command talks to, why that one (``origin``, as the answer's first line
    says it) and the TLS context of an https one."""

    url: str
    origin: str
    ssl: ssl.SSLContext | None = None


def _config_listen(path: str) -> tuple[str, bool]:
    """(url, asks for a client certificate) from the config file at ``path``.

    Only ``[server]``'s ``listen`` and TLS keys are read, not the whole config as ``serve``
    validates it: the operator's host need not have the gateway's secrets (the store's
    ``password_env``, the TLS private key), only its address."""

    def bad(what: str) -> CliError:
        return CliError(f"config error: {path}: {what}", EXIT_USAGE)

    try:
        with open(path, "rb") as file:
            data = tomllib.loads(file.read().decode("utf-8"))
    except OSError as exc:
        raise bad(f"cannot read: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise bad(f"not valid TOML: {exc}") from None
    server = data.get("server", {})
    if not isinstance(server, dict):
        raise bad("[server] must be a table")
    listen = server.get("listen", ServerConfig().listen)
    if not isinstance(listen, str):
        raise bad(f'server.listen: expected "HOST:PORT", got {listen!r}')
    try:
        host, port = parse_listen(listen)
    except ValueError as exc:
        raise bad(f"server.listen: {exc}") from None
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    scheme = "https" if server.get("tls_cert_file") is not None else "http"
    url = f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"
    return url, server.get("tls_client_ca_file") is not None


def _tls(args: argparse.Namespace, url: str, config_wants_cert: bool) -> ssl.SSLContext | None:
    """The client TLS context of an https ``url``: the system's CAs or ``--cacert``'s, and
    ``--cert``/``--key`` when given (required when the config has ``tls_client_ca_file``)."""
    cacert, cert, key = args.cacert, args.cert, args.key
    if (cert is None) != (key is None):
        raise CliError("--cert and --key go together (a PEM certificate and its key)", EXIT_USAGE)
    if not url.startswith("https://"):
        if cacert or cert:
            raise CliError(
                f"--cacert, --cert and --key need an https gateway, not {url}", EXIT_USAGE
            )
        return None
    if config_wants_cert and cert is None:
        raise CliError(
            f"{args.config}: server.tls_client_ca_file is set: the gateway asks every client "
            "for a certificate; pass --cert FILE --key FILE",
            EXIT_USAGE,
        )
    source = "--cacert" if cacert else f"${CACERT_ENV}"
    cacert = cacert or os.environ.get(CACERT_ENV) or None
    try:
        context = ssl.create_default_context(cafile=cacert)
    except (OSError, ssl.SSLError) as exc:
        raise CliError(f"{source}: cannot load {cacert}: {_ssl_reason(exc)}", EXIT_USAGE) from None
    if cert is not None:
        try:
            # An encrypted key is refused rather than prompted for.
            context.load_cert_chain(cert, key, password=b"")
        except (OSError, ssl.SSLError) as exc:
            raise CliError(
                f"--cert/--key: cannot load {cert}, {key} (an unencrypted PEM key matching the "
                f"certificate): {_ssl_reason(exc)}",
                EXIT_USAGE,
            ) from None
    return context


def _ssl_reason(exc: BaseException | None) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc)


def gateway(args: argparse.Namespace) -> Gateway:
    """``--url``, else ``--config``'s ``server.listen`` (https with its ``tls_cert_file``),
    else ``$FENCEGATE_URL``, else the default listen address of ``fencegate serve``."""
    wants_cert = False
    if args.url:
        url, origin = str(args.url), "from --url"
    elif args.config:
        url, wants_cert = _config_listen(str(args.config))
        origin = f"from --config {args.config}"
    elif os.environ.get("FENCEGATE_URL"):
        url, origin = os.environ["FENCEGATE_URL"], "from $FENCEGATE_URL"
    else:
        url, origin = DEFAULT_URL, "default; pass --url or --config"
    url = url.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query:
        raise CliError(f"--url: expected http://HOST:PORT, got {url!r}", EXIT_USAGE)
    return Gateway(url, origin, _tls(args, url, wants_cert))


def gateway_url(args: argparse.Namespace) -> str:
    """The URL of ``gateway(args)``."""
    return gateway(args).url


def gateway_token(args: argparse.Namespace) -> str:
    """The bearer token: ``--token-file``'s content, else ``$FENCEGATE_TOKEN``, else none
    (empty: a gateway without ``[auth]``)."""
    path = getattr(args, "token_file", None)
    if not path:
        return os.environ.get(TOKEN_ENV, "").strip()
    try:
        with open(path, encoding="utf-8") as file:
            token = file.read(8192).strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise CliError(f"--token-file: cannot read {path}: {reason}", EXIT_USAGE) from None
    if not token or any(ch.isspace() for ch in token):
        raise CliError(f"--token-file: {path} must hold one token, nothing else", EXIT_USAGE)
    return token


def operator_name(args: argparse.Namespace) -> str | None:
    """``--operator``, else ``$FENCEGATE_OPERATOR``, else the login user (if it is a valid
    name; else None, and the gateway records "anonymous")."""
    name: str | None = args.operator or os.environ.get("FENCEGATE_OPERATOR")
    if name is None:
        try:
            name = getpass.getuser()
        except (OSError, KeyError):
            return None
        return name if _OPERATOR.fullmatch(name) else None
    if not _OPERATOR.fullmatch(name):
        raise CliError("--operator: 1 to 200 letters, digits, spaces or . _ : @ / -", EXIT_USAGE)
    return name


# --- the SDK's client, as the command line reports what happened -------------------------------


class OperatorClient(Client):
    """``fencegate.Client`` with the command line's reading of failures.

    The gateway's problems are the SDK's typed errors, as for any client. What differs: an
    answer that is not fencegate's (a load balancer's 502, a web server's HTML) is reported as
    such (exit 1) instead of being retried as ``GatewayUnreachable``; no answer at all is a
    ``CliError`` with exit 3 that says why (refused, no such host, or silent past
    ``--timeout``). ``timeout`` bounds connecting and each wait for data, not the whole call.
    ``origin`` says why this gateway (``Gateway.origin``).
    """

    def __init__(self, url: str, *, origin: str = "from --url", **options: Any) -> None:
        super().__init__(url, **options)
        self.origin = origin

    def gateway_line(self) -> str:
        """``gateway URL (ORIGIN)``: the first line of every answer."""
        return render.gateway_line(self.url, self.origin)

    def _timeout(self, seconds: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=seconds, sock_read=seconds
        )

    async def send(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> RawAnswer:
        try:
            return await super().send(method, path, body=body, headers=headers, timeout_s=timeout_s)
        except GatewayUnreachable as exc:
            raise self._unreachable(method, exc.__cause__) from exc

    def _unreachable(self, method: str, cause: BaseException | None) -> CliError:
        if isinstance(cause, aiohttp.ClientConnectorCertificateError):
            return CliError(
                f"the gateway at {self.url} is not trusted ({_ssl_reason(cause.certificate_error)}"
                f"): pass the CA that signed its certificate with --cacert FILE or ${CACERT_ENV}",
                EXIT_UNREACHABLE,
            )
        if isinstance(cause, aiohttp.ClientSSLError):
            return CliError(
                f"TLS with the gateway at {self.url} failed ({_ssl_reason(cause.os_error)}): "
                "does it ask for a client certificate (--cert FILE --key FILE)?",
                EXIT_UNREACHABLE,
            )
        if isinstance(cause, TimeoutError) and not isinstance(
            cause, aiohttp.ConnectionTimeoutError
        ):
            maybe = ""
            if method != "GET":
                maybe = "; the change may or may not have been made, look before repeating it"
            return CliError(
                f"no answer from the gateway at {self.url} within {self.timeout:g}s "
                f"(use --timeout){maybe}",
                EXIT_UNREACHABLE,
            )
        return CliError(
            f"cannot reach the gateway at {self.url} ({_reason(cause)}): is it running? use --url",
            EXIT_UNREACHABLE,
        )

    def _read_answer(self, method: str, path: str, answer: RawAnswer) -> Any:
        problem = gateway_problem(answer)
        if problem is not None:
            raise problem
        if answer.status >= 400:
            text = answer.body.decode("utf-8", "replace").strip().splitlines()
            first = f" ({text[0][:200]})" if text else ""
            raise CliError(
                f"HTTP {answer.status} {answer.reason}{first} is not a fencegate answer: "
                f"is --url {self.url} the gateway?",
                EXIT_REFUSED,
            )
        try:
            return json.loads(answer.body)
        except ValueError:
            raise CliError(
                f"the answer from {self.url} is not JSON; is --url a fencegate gateway?",
                EXIT_REFUSED,
            ) from None


def _reason(cause: BaseException | None) -> str:
    """Why no connection: ``connection refused``, ``name or service not known``..."""
    if isinstance(cause, aiohttp.ClientConnectorError):
        cause = cause.os_error
    if isinstance(cause, TimeoutError):
        return "timed out"
    if isinstance(cause, OSError):
        if cause.errno and cause.errno > 0 and not isinstance(cause, socket.gaierror):
            return os.strerror(cause.errno).lower()
        if cause.strerror:
            return cause.strerror.lower()
    if cause is None:
        return "no answer"
    return str(cause) or type(cause).__name__


def _problem(exc: ProblemError) -> CliError:
    detail = exc.problem.get("detail") or exc.problem.get("title") or ""
    if exc.code == "UNAUTHENTICATED":
        detail += f" (give the token with --token-file or ${TOKEN_ENV})"
    return CliError(f"{exc.code}: {detail}", EXIT_REFUSED)


# --- effects ------------------------------------------------------------------------------------


async def _effect_record(client: OperatorClient, text: str) -> dict[str, Any]:
    """The record ``text`` names: a full effectId, or a unique prefix of at least 6 (as the
    list shows). The gateway looks the prefix up in its store (``GET /v1/effects/{prefix}``,
    the console's path too); its refusal of a malformed or ambiguous one (400, naming the
    rule or the matches) is a usage error here, as is a malformed one (the gateway answers
    it 404, as before prefixes)."""
    wanted = text.strip().lower()
    if not EFFECT_ID_OR_PREFIX.fullmatch(wanted):
        raise CliError(f"{text!r} is not an effect id: {EFFECT_ID_RULE}", EXIT_USAGE)
    try:
        return await client.get_effect(wanted)
    except ProblemError as exc:
        if exc.code == "BAD_REQUEST":
            raise CliError(str(exc.problem.get("detail") or exc.code), EXIT_USAGE) from None
        raise


async def _effect_id(client: OperatorClient, text: str) -> str:
    """A full effectId as given, or the one a unique prefix names (``_effect_record``)."""
    wanted = text.strip().lower()
    if _EFFECT_ID.fullmatch(wanted):
        return wanted
    return str((await _effect_record(client, wanted))["effectId"])


async def effects_list(client: OperatorClient, args: argparse.Namespace) -> int:
    keyed = args.idempotency_key is not None
    if args.awaiting_approval and (args.state or args.task or args.downstream or keyed):
        raise CliError("--awaiting-approval goes alone (or with --limit)", EXIT_USAGE)
    if args.principal is not None and not keyed:
        # A key is scoped to its principal: the same key of two clients is two effects.
        raise CliError("--principal goes with --idempotency-key", EXIT_USAGE)
    if keyed and (args.state or args.task):
        raise CliError("--idempotency-key goes with --principal and --downstream only", EXIT_USAGE)
    # One record more than asked tells whether the list was cut short.
    found = client.iter_effects(
        state=args.state or None,
        task_id=args.task or None,
        downstream=args.downstream or None,
        page_size=_PAGE,
        limit=args.limit + 1,
        awaiting_approval=args.awaiting_approval,
        idempotency_key=args.idempotency_key,
        principal=args.principal,
    )
    records = [record async for record in found]
    more = len(records) > args.limit
    records = records[: args.limit]
    _answer(client, args, records, render.effects_table(records), key="effects")
    if more and not args.json:
        print(f"(first {args.limit} shown; more match: use --limit)", file=sys.stderr)
    return 0


def _replay_response(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--response-*``: what duplicates of a COMMITTED effect replay (None: not given)."""
    given = args.response_body is not None or args.response_header
    if args.response_status is None and given:
        raise CliError("--response-body and --response-header need --response-status", EXIT_USAGE)
    if args.response_status is None:
        return None
    if args.outcome != "COMMITTED":
        raise CliError("--response-* go with --outcome COMMITTED", EXIT_USAGE)
    headers: dict[str, str] = {}
    for line in args.response_header:
        name, sep, value = line.partition(":")
        if not sep or not name.strip():
            raise CliError(f"--response-header: expected 'Name: value', got {line!r}", EXIT_USAGE)
        headers[name.strip()] = value.strip()
    return {"status": args.response_status, "headers": headers, "body": args.response_body or ""}


async def effects_show(client: OperatorClient, args: argparse.Namespace) -> int:
    record = await _effect_record(client, args.effect_id)
    _answer(client, args, record, render.effect(record))
    return 0


async def effects_resolve(client: OperatorClient, args: argparse.Namespace) -> int:
    response = _replay_response(args)
    outcome: Literal["COMMITTED", "NOT_APPLIED"] = (
        "COMMITTED" if args.outcome == "COMMITTED" else "NOT_APPLIED"
    )
    effect_id = await _effect_id(client, args.effect_id)
    try:
        record = await client.resolve_effect(
            effect_id, outcome, args.note, response=response, force=args.force
        )
    except EffectInFlight as exc:
        refused = _problem(exc)
        until = exc.problem.get("landingUntil")
        if isinstance(until, int):
            refused.message += (
                f"\nfencegate: check the downstream after {render.time_text(until)}, then "
                f"resolve again; or, if you know it cannot land: fencegate effects resolve "
                f"{effect_id[:12]} --outcome NOT_APPLIED --force --note '...'"
            )
        raise refused from None
    _answer(client, args, record, render.resolved(effect_id, record))
    # The gateway's warnings (COMMITTED without a response: what duplicates will get); an
    # older gateway sends none.
    warnings = record.get("warnings")
    for warning in warnings if isinstance(warnings, list) else []:
        print(f"fencegate: warning: {render.printable(warning)}", file=sys.stderr)
    return 0


async def effects_approve(client: OperatorClient, args: argparse.Namespace) -> int:
    effect_id = await _effect_id(client, args.effect_id)
    record = await client.approve_effect(
        effect_id,
        args.note or "",
        payload_digest=args.payload_digest or None,
        approval_digest=args.approval_digest or None,
    )
    _answer(client, args, record, render.approved(effect_id, record))
    return 0


async def effects_reconcile(client: OperatorClient, args: argparse.Namespace) -> int:
    effect_id = await _effect_id(client, args.effect_id)
    try:
        record = await client.reconcile_effect(effect_id)
    except EffectUnknown as exc:
        refused = _problem(exc)
        refused.message += (
            f"\nfencegate: settle it by hand: fencegate effects resolve {effect_id[:12]} "
            "--outcome COMMITTED|NOT_APPLIED --note '...'"
        )
        raise refused from None
    _answer(client, args, record, render.reconciled(effect_id, record))
    return 0


# --- tasks, epoch, claims, rollout --------------------------------------------------------------


async def tasks_show(client: OperatorClient, args: argparse.Namespace) -> int:
    task = (await client.get_task(args.task_id)).raw
    _answer(client, args, task, render.task(task))
    return 0


async def tasks_list(client: OperatorClient, args: argparse.Namespace) -> int:
    """Pages of ``GET /v1/tasks`` until ``--limit`` tasks are shown or none are left."""
    tasks: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        page = await client.list_tasks(
            state=args.state or None,
            owner=args.owner or None,
            lease_expired=args.lease_expired,
            cursor=cursor,
            limit=min(_PAGE, args.limit - len(tasks)),
        )
        tasks.extend(page.get("tasks") or [])
        cursor = page.get("nextCursor") or None
        if cursor is None or len(tasks) >= args.limit:
            break
    tasks = tasks[: args.limit]
    _answer(client, args, tasks, render.tasks_table(tasks), key="tasks")
    if cursor is not None and not args.json:
        print(f"(first {args.limit} shown; more may match: use --limit)", file=sys.stderr)
    return 0


async def tasks_claim(client: OperatorClient, args: argparse.Namespace) -> int:
    """A bare lease through the SDK (``Client.acquire``), so the printed headers are the
    SDK's own ``Lease.fence_headers``: the CLI never lists header names of its own."""
    lease = await client.acquire(args.task_id, owner=args.owner, ttl_ms=args.ttl_ms)
    claim = {
        "taskId": lease.task_id,
        "attemptId": lease.attempt_id,
        "claimGeneration": lease.claim_generation,
        "schedulerEpoch": lease.scheduler_epoch,
        "cancelGeneration": lease.cancel_generation,
        "leaseExpiresAt": lease.lease_expires_at,
        "grantedTtlMs": lease.granted_ttl_ms,
        "revision": lease.revision,
        "inputDigest": lease.input_digest,
        "owner": lease.owner,
    }
    if not args.headers:
        _answer(client, args, claim, render.claimed(claim))
        return 0
    # stdout holds the headers and nothing else (curl -H @FILE); the rest goes to stderr.
    print(render.header_lines(lease.fence_headers(slot=args.slot, node=args.node)))
    print(f"fencegate: {render.claimed_line(claim)}; {client.gateway_line()}", file=sys.stderr)
    if args.slot is None:
        print(
            "fencegate: no --slot: POST, PUT, PATCH and DELETE also need -H 'Fence-Slot: NAME'",
            file=sys.stderr,
        )
    return 0


async def epoch_show(client: OperatorClient, args: argparse.Namespace) -> int:
    scheduler = (await client.get_epoch()).raw
    _answer(client, args, scheduler, render.scheduler_line(scheduler))
    return 0


async def epoch_bump(client: OperatorClient, args: argparse.Namespace) -> int:
    scheduler = (await client.bump_epoch()).raw
    _answer(client, args, scheduler, render.epoch_bumped(scheduler))
    return 0


async def claims_pause(client: OperatorClient, args: argparse.Namespace) -> int:
    scheduler = (await client.pause_claims()).raw
    _answer(client, args, scheduler, render.claims_paused(scheduler))
    return 0


async def claims_resume(client: OperatorClient, args: argparse.Namespace) -> int:
    scheduler = (await client.resume_claims()).raw
    _answer(client, args, scheduler, render.claims_resumed(scheduler))
    return 0


async def rollout_status(client: OperatorClient, args: argparse.Namespace) -> int:
    """The rollback checklist: exit 0 only when it is safe to switch worker pools."""
    status = await client.get_rollout()
    _answer(client, args, status, render.rollout(status))
    return 0 if status.get("safeToSwitchPools") else EXIT_NOT_SAFE


async def store_stats(client: OperatorClient, args: argparse.Namespace) -> int:
    """The store's sizes and what retention will remove next."""
    stats = await client.get_store_stats()
    _answer(client, args, stats, render.store_stats(stats))
    return 0


# --- running one ----------------------------------------------------------------------------


def _answer(
    client: OperatorClient, args: argparse.Namespace, data: Any, text: str, *, key: str = ""
) -> None:
    """Print an answer: the gateway line then ``text``, or with ``--json`` the gateway's JSON
    with a top-level ``"gateway"`` (a list is wrapped as ``{"gateway": ..., key: [...]}``)."""
    if args.json:
        print(render.json_text(render.with_gateway(data, client.url, key)))
    else:
        print(f"{client.gateway_line()}\n{text}")


async def _against(
    command: Command, args: argparse.Namespace, where: Gateway, operator: str | None, token: str
) -> int:
    headers = {"Accept": "application/json"}
    # Our own session only to carry the TLS context; without one the client makes its own.
    session = None
    if where.ssl is not None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=where.ssl))
    try:
        async with OperatorClient(
            where.url,
            origin=where.origin,
            session=session,
            timeout=args.timeout,
            operator=operator,
            headers=headers,
            token=token,
        ) as c:
            try:
                return await command(c, args)
            except ProblemError as exc:
                refused = _problem(exc)
            except CliError as exc:
                if exc.exit_code != EXIT_REFUSED:
                    raise
                refused = exc
            # A refusal names its gateway too: NO_SUCH_EFFECT from the wrong one misleads.
            refused.message += f"\nfencegate: {c.gateway_line()}"
            raise refused from None
    finally:
        if session is not None:
            await session.close()


def run(command: Command, args: argparse.Namespace) -> int:
    """Run ``command`` against the gateway ``args`` name; failures go to stderr as
    ``fencegate: ...`` and become the exit code."""
    try:
        where, operator, token = gateway(args), operator_name(args), gateway_token(args)
        return asyncio.run(_against(command, args, where, operator, token))
    except CliError as exc:
        # The message may quote the gateway's detail, which may quote the store: escaped.
        lines = exc.message.split("\n")  # the CLI's own hints go on lines of their own
        print("fencegate: " + "\n".join(render.printable(line) for line in lines), file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # `fencegate effects list | head`: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
