"""The operator commands: arguments -> calls of the SDK's ``Client`` -> rendered answers.

Every command is one or a few calls of ``fencegate.Client`` (the same HTTP client and problem
decoding workers use) to a running gateway, never the store, so it works the same against
SQLite and Redis and goes through the gateway's own checks and logs. ``ops_render`` turns the
answers into text; ``ops_cli`` registers the commands with ``fencegate``'s parser.

Exit codes: 0 done; 1 the gateway refused (its problem code and detail on stderr, as
``fencegate: CODE: detail``) or answered something unexpected; 2 bad usage; 3 the gateway
could not be reached or did not answer in time; 4 ``rollout status``: not safe yet. See
``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import json
import os
import re
import socket
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp

from fencegate._http import RawAnswer, gateway_problem
from fencegate.client import TOKEN_ENV, Client
from fencegate.errors import EffectUnknown, GatewayUnreachable, ProblemError
from fencegate.gateway import ops_render as render
from fencegate.gateway.config import ConfigError, load_config, parse_listen

__all__ = [
    "DEFAULT_URL",
    "EXIT_REFUSED",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "CliError",
    "Command",
    "OperatorClient",
    "gateway_token",
    "gateway_url",
    "operator_name",
    "run",
]

#: Where ``fencegate serve`` listens without a config.
DEFAULT_URL = "http://127.0.0.1:8700"
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_NOT_SAFE = 4

#: Largest page the ledger API serves; ``effects list`` asks for at most this many per call.
_PAGE = 500
#: Most ledger records an effect-id prefix is looked up among.
_PREFIX_SCAN = 50_000
_EFFECT_ID = re.compile(r"[0-9a-f]{64}")
_EFFECT_PREFIX = re.compile(r"[0-9a-f]{6,63}")
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


def gateway_url(args: argparse.Namespace) -> str:
    """``--url``, else ``--config``'s ``server.listen``, else ``$FENCEGATE_URL``, else the
    default listen address of ``fencegate serve``."""
    if args.url:
        url = str(args.url)
    elif args.config:
        try:
            config = load_config(args.config)
        except ConfigError as exc:
            raise CliError(f"config error: {exc}", EXIT_USAGE) from None
        host, port = parse_listen(config.server.listen)
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    else:
        url = os.environ.get("FENCEGATE_URL") or DEFAULT_URL
    url = url.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query:
        raise CliError(f"--url: expected http://HOST:PORT, got {url!r}", EXIT_USAGE)
    return url


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
    """

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


async def _effect_id(client: OperatorClient, text: str) -> str:
    """A full effectId, or the one effect whose id starts with ``text`` (as the list shows)."""
    wanted = text.strip().lower()
    if _EFFECT_ID.fullmatch(wanted):
        return wanted
    if not _EFFECT_PREFIX.fullmatch(wanted):
        raise CliError(
            f"{text!r} is not an effect id: 64 hex characters, or a unique prefix of at "
            "least 6 (as `fencegate effects list` shows)",
            EXIT_USAGE,
        )
    matches: list[str] = []
    records = client.iter_effects(page_size=_PAGE, limit=_PREFIX_SCAN)
    async with contextlib.aclosing(records):
        async for record in records:
            if str(record.get("effectId", "")).startswith(wanted):
                matches.append(record["effectId"])
                if len(matches) > 1:
                    raise CliError(
                        f"effect id prefix {wanted!r} is ambiguous ({', '.join(matches)}...); "
                        "give more characters",
                        EXIT_USAGE,
                    )
    if not matches:
        raise CliError(f"NO_SUCH_EFFECT: no effect id starts with {wanted!r}", EXIT_REFUSED)
    return matches[0]


async def effects_list(client: OperatorClient, args: argparse.Namespace) -> int:
    # One record more than asked tells whether the list was cut short.
    found = client.iter_effects(
        state=args.state or None,
        task_id=args.task or None,
        downstream=args.downstream or None,
        page_size=_PAGE,
        limit=args.limit + 1,
    )
    records = [record async for record in found]
    more = len(records) > args.limit
    records = records[: args.limit]
    if args.json:
        print(render.json_text(records))
        return 0
    print(render.effects_table(records))
    if more:
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
    record = await client.get_effect(await _effect_id(client, args.effect_id))
    print(render.json_text(record) if args.json else render.effect(record))
    return 0


async def effects_resolve(client: OperatorClient, args: argparse.Namespace) -> int:
    response = _replay_response(args)
    outcome: Literal["COMMITTED", "NOT_APPLIED"] = (
        "COMMITTED" if args.outcome == "COMMITTED" else "NOT_APPLIED"
    )
    effect_id = await _effect_id(client, args.effect_id)
    record = await client.resolve_effect(effect_id, outcome, args.note, response=response)
    print(render.json_text(record) if args.json else render.resolved(effect_id, record))
    return 0


async def effects_approve(client: OperatorClient, args: argparse.Namespace) -> int:
    effect_id = await _effect_id(client, args.effect_id)
    record = await client.approve_effect(
        effect_id, args.note or "", payload_digest=args.payload_digest or None
    )
    print(render.json_text(record) if args.json else render.approved(effect_id, record))
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
    print(render.json_text(record) if args.json else render.reconciled(effect_id, record))
    return 0


# --- tasks, epoch, claims, rollout --------------------------------------------------------------


async def tasks_show(client: OperatorClient, args: argparse.Namespace) -> int:
    task = (await client.get_task(args.task_id)).raw
    print(render.json_text(task) if args.json else render.task(task))
    return 0


async def epoch_show(client: OperatorClient, args: argparse.Namespace) -> int:
    scheduler = (await client.get_epoch()).raw
    print(render.json_text(scheduler) if args.json else render.scheduler_line(scheduler))
    return 0


async def epoch_bump(client: OperatorClient, args: argparse.Namespace) -> int:
    scheduler = (await client.bump_epoch()).raw
    print(render.json_text(scheduler) if args.json else render.epoch_bumped(scheduler))
    return 0


async def claims_pause(client: OperatorClient, args: argparse.Namespace) -> int:
    scheduler = (await client.pause_claims()).raw
    print(render.json_text(scheduler) if args.json else render.claims_paused(scheduler))
    return 0


async def claims_resume(client: OperatorClient, args: argparse.Namespace) -> int:
    scheduler = (await client.resume_claims()).raw
    print(render.json_text(scheduler) if args.json else render.claims_resumed(scheduler))
    return 0


async def rollout_status(client: OperatorClient, args: argparse.Namespace) -> int:
    """The rollback checklist: exit 0 only when it is safe to switch worker pools."""
    status = await client.get_rollout()
    print(render.json_text(status) if args.json else render.rollout(status))
    return 0 if status.get("safeToSwitchPools") else EXIT_NOT_SAFE


# --- running one ----------------------------------------------------------------------------


async def _against(
    command: Command, args: argparse.Namespace, url: str, operator: str | None, token: str
) -> int:
    headers = {"Accept": "application/json"}
    async with OperatorClient(
        url, timeout=args.timeout, operator=operator, headers=headers, token=token
    ) as c:
        try:
            return await command(c, args)
        except ProblemError as exc:
            raise _problem(exc) from None


def run(command: Command, args: argparse.Namespace) -> int:
    """Run ``command`` against the gateway ``args`` name; failures go to stderr as
    ``fencegate: ...`` and become the exit code."""
    try:
        url, operator, token = gateway_url(args), operator_name(args), gateway_token(args)
        return asyncio.run(_against(command, args, url, operator, token))
    except CliError as exc:
        # The message may quote the gateway's detail, which may quote the store: escaped.
        lines = exc.message.split("\n")  # the CLI's own hints go on lines of their own
        print("fencegate: " + "\n".join(render.printable(line) for line in lines), file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # `fencegate effects list | head`: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
