"""Operator commands over the gateway's HTTP API: ``effects``, ``tasks``, ``epoch``, ``claims``.

Every command is one or a few HTTP calls to a running gateway (never the store directly), so
it works the same against SQLite and Redis deployments and through the gateway's own checks.
People get tables and readable records; ``--json`` prints the gateway's JSON for scripts.

Exit codes: 0 done; 1 the gateway refused (its problem code and detail on stderr, as
``fencegate: CODE: detail``) or answered something unexpected; 2 bad usage; 3 the gateway
could not be reached or did not answer in time. See ``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import getpass
import http.client
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeAlias
from urllib.error import HTTPError, URLError
from urllib.parse import quote, urlencode, urlsplit
from urllib.request import ProxyHandler, Request, build_opener

from fencegate.gateway.config import ConfigError, load_config, parse_listen

__all__ = ["DEFAULT_URL", "register"]

DEFAULT_URL = "http://127.0.0.1:8700"
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

#: Largest page the ledger API serves; ``effects list`` asks for at most this many per call.
_PAGE = 500
#: Most ledger records an effect-id prefix is looked up among.
_PREFIX_SCAN = 50_000
_STATES = ("PREPARED", "UNKNOWN", "COMMITTED", "NOT_APPLIED")
_EFFECT_ID = re.compile(r"[0-9a-f]{64}")
_EFFECT_PREFIX = re.compile(r"[0-9a-f]{6,63}")
_OPERATOR = re.compile(r"[A-Za-z0-9._:@/ -]{1,200}")
_SHOW_BODY_BYTES = 400
_EFFECT_HELP = "64 hex characters, or a unique prefix of at least 6"

if TYPE_CHECKING:
    SubParsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]


class CliError(Exception):
    """Ends the command: ``message`` goes to stderr after ``fencegate: ``."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


# --- talking to the gateway ---------------------------------------------------------------------


class Gateway:
    """A blocking JSON client for one gateway; refusals and failures raise ``CliError``."""

    def __init__(self, url: str, operator: str | None, timeout: float) -> None:
        self.url = url
        self.operator = operator
        self.timeout = timeout
        # The operator talks to the gateway directly: no *_proxy variables from the
        # environment (the same as the gateway's own aiohttp client).
        self._opener = build_opener(ProxyHandler({}))

    def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        query: dict[str, str] | None = None,
    ) -> Any:
        url = self.url + path + (f"?{urlencode(query)}" if query else "")
        headers = {"Accept": "application/json"}
        if self.operator is not None:
            headers["Fence-Operator"] = self.operator
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        request = Request(url, data=data, headers=headers, method=method)
        try:
            with self._opener.open(request, timeout=self.timeout) as resp:
                raw: bytes = resp.read()
        except HTTPError as exc:
            raise _refusal(exc, self.url) from None
        except URLError as exc:
            # Raised before the request went out: connect refused, no such host, connect
            # timed out.
            raise self._unreachable(_reason(exc.reason)) from None
        except TimeoutError:
            raise self._no_answer(method) from None
        except (http.client.HTTPException, OSError) as exc:
            # The connection broke, or what answered does not speak HTTP.
            raise self._unreachable(_reason(exc)) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise CliError(
                f"the answer from {self.url} is not JSON; is --url a fencegate gateway?",
                EXIT_REFUSED,
            ) from None

    def _unreachable(self, reason: str) -> CliError:
        return CliError(
            f"cannot reach the gateway at {self.url} ({reason}): is it running? use --url",
            EXIT_UNREACHABLE,
        )

    def _no_answer(self, method: str) -> CliError:
        maybe = ""
        if method != "GET":
            maybe = "; the change may or may not have been made, look before repeating it"
        return CliError(
            f"no answer from the gateway at {self.url} within {self.timeout:g}s "
            f"(use --timeout){maybe}",
            EXIT_UNREACHABLE,
        )


def _reason(exc: object) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return text


def _refusal(exc: HTTPError, url: str) -> CliError:
    try:
        raw = exc.read()
    except (OSError, http.client.HTTPException):
        raw = b""
    finally:
        exc.close()
    try:
        problem = json.loads(raw)
    except ValueError:
        problem = None
    if isinstance(problem, dict) and isinstance(problem.get("code"), str):
        detail = problem.get("detail") or problem.get("title") or ""
        return CliError(f"{problem['code']}: {detail}", EXIT_REFUSED)
    text = raw.decode("utf-8", "replace").strip().splitlines()
    first = f" ({text[0][:200]})" if text else ""
    return CliError(
        f"HTTP {exc.code} {exc.reason}{first} is not a fencegate answer: is --url {url} "
        "the gateway?",
        EXIT_REFUSED,
    )


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


def _operator(args: argparse.Namespace) -> str | None:
    name: str | None = args.operator or os.environ.get("FENCEGATE_OPERATOR")
    if name is None:
        try:
            name = getpass.getuser()
        except (OSError, KeyError):
            return None  # the gateway records "anonymous"
        return name if _OPERATOR.fullmatch(name) else None
    if not _OPERATOR.fullmatch(name):
        raise CliError("--operator: 1 to 200 letters, digits, spaces or . _ : @ / -", EXIT_USAGE)
    return name


# --- formatting ---------------------------------------------------------------------------------


def _time(ms: object, *, precise: bool = False) -> str:
    if not isinstance(ms, int):
        return "-"
    moment = datetime.fromtimestamp(ms / 1000, UTC)
    if precise:
        return moment.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
    return moment.strftime("%Y-%m-%d %H:%M:%SZ")


def _cell(value: object, width: int = 0) -> str:
    text = "-" if value is None or value == "" else str(value)
    if width and len(text) > width:
        text = text[: width - 3] + "..."
    return text


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [headers, *rows]
    ]
    return "\n".join(lines)


def _fields(pairs: Sequence[tuple[str, object]]) -> str:
    width = max(len(name) for name, _ in pairs)
    return "\n".join(f"{name.ljust(width)}  {_cell(value)}" for name, value in pairs)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


# --- effects ------------------------------------------------------------------------------------


def _iter_effects(gateway: Gateway, filters: dict[str, str], limit: int) -> Iterator[Any]:
    """Records in creation order, following ``nextCursor``, at most ``limit`` of them."""
    cursor: str | None = None
    left = limit
    while left > 0:
        query = {**filters, "limit": str(min(left, _PAGE))}
        if cursor:
            query["cursor"] = cursor
        page = gateway.call("GET", "/v1/effects", query=query)
        found = page.get("effects", [])
        yield from found[:left]
        left -= len(found)
        cursor = page.get("nextCursor")
        if not cursor:
            return


def _effect_id(gateway: Gateway, text: str) -> str:
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
    for record in _iter_effects(gateway, {}, _PREFIX_SCAN):
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


def _effects_list(gateway: Gateway, args: argparse.Namespace) -> int:
    filters = {
        key: value
        for key, value in (
            ("state", args.state),
            ("taskId", args.task),
            ("downstream", args.downstream),
        )
        if value
    }
    # One record more than asked tells whether the list was cut short.
    records = list(_iter_effects(gateway, filters, args.limit + 1))
    more = len(records) > args.limit
    records = records[: args.limit]
    if args.json:
        _print_json(records)
        return 0
    if not records:
        print("no effects")
        return 0
    rows = [
        [
            _cell(r.get("effectId"))[:12],
            _cell(r.get("state")),
            _cell(r.get("taskId"), 32),
            _cell(r.get("downstream")),
            _cell(f"{r.get('method')} {r.get('path')}", 48),
            str(len(r.get("attempts") or [])),
            _time(r.get("updatedAt")),
        ]
        for r in records
    ]
    print(_table(["EFFECT", "STATE", "TASK", "DOWNSTREAM", "REQUEST", "ATTEMPTS", "UPDATED"], rows))
    if more:
        print(f"(first {args.limit} shown; more match: use --limit)", file=sys.stderr)
    return 0


def _response_lines(response: dict[str, Any]) -> list[str]:
    lines = [f"  status   {_cell(response.get('status'))}"]
    if response.get("source"):
        lines.append(f"  source   {response['source']}")
    headers = response.get("headers") or []
    if headers:
        lines.append(f"  headers  {len(headers)} stored")
    if response.get("bodyOmitted"):
        lines.append("  body     not stored (larger than the downstream's replay_max_bytes)")
        return lines
    size, digest = response.get("bodySize"), response.get("bodyDigest")
    try:
        raw = base64.b64decode(str(response.get("bodyBase64", "")), validate=True)
        text = raw.decode("utf-8") if len(raw) <= _SHOW_BODY_BYTES else None
    except (binascii.Error, UnicodeDecodeError):
        text = None
    if text and text.isprintable():
        lines.append(f"  body     {text}")
    else:
        lines.append(f"  body     {_cell(size)} bytes, sha256 {_cell(digest)}")
    return lines


def _render_effect(r: dict[str, Any]) -> str:
    pairs: list[tuple[str, object]] = [
        ("effect", r.get("effectId")),
        ("state", r.get("state")),
        (
            "task",
            f"{r.get('taskId')} (revision {r.get('revision')}, node {r.get('node')}, "
            f"slot {r.get('slot')})",
        ),
        ("downstream", r.get("downstream")),
        ("request", f"{r.get('method')} {r.get('path')}"),
        ("payloadDigest", r.get("payloadDigest")),
        ("created", _time(r.get("createdAt"), precise=True)),
        ("updated", _time(r.get("updatedAt"), precise=True)),
    ]
    if r.get("state") == "PREPARED":
        pairs.append(("deadline", _time(r.get("deadlineAt"), precise=True)))
    approval = r.get("approval")
    if isinstance(approval, dict):
        pairs.append(
            (
                "approval",
                f"payloadDigest {approval.get('payloadDigest')} by {approval.get('by')}, "
                f"usable until {_time(approval.get('expiresAt'))}",
            )
        )
    probes = r.get("probes")
    if isinstance(probes, dict) and probes.get("count"):
        nxt = probes.get("nextAt")
        pairs.append(("probes", f"{probes['count']}" + (f", next at {_time(nxt)}" if nxt else "")))
    out = [_fields(pairs)]
    attempts = r.get("attempts") or []
    out.append(f"\nattempts ({len(attempts)}):")
    if attempts:
        rows = [
            [
                str(i),
                _cell(a.get("attemptId")),
                _cell(a.get("claimGeneration")),
                _time(a.get("startedAt"), precise=True),
                _time(a.get("endedAt"), precise=True),
                _cell(a.get("outcome")),
                _cell(a.get("reason"))
                + (f" (approved by {a['approvedBy']})" if a.get("approvedBy") else ""),
            ]
            for i, a in enumerate(attempts, 1)
        ]
        headers = ["#", "ATTEMPT", "GEN", "STARTED", "ENDED", "OUTCOME", "REASON"]
        out.append(_indent(_table(headers, rows)))
    actions = r.get("actions") or []
    if actions:
        out.append(f"\nactions ({len(actions)}):")
        rows = [
            [
                _time(a.get("at"), precise=True),
                _cell(a.get("action")),
                _cell(a.get("by")),
                _cell(a.get("outcome") or a.get("verdict")),
                _cell(a.get("note"), 60),
            ]
            for a in actions
        ]
        out.append(_indent(_table(["AT", "ACTION", "BY", "RESULT", "NOTE"], rows)))
    response = r.get("response")
    out.append("\nresponse:" if isinstance(response, dict) else "\nresponse: none stored")
    if isinstance(response, dict):
        out.extend(_response_lines(response))
    return "\n".join(out)


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


def _effects_show(gateway: Gateway, args: argparse.Namespace) -> int:
    effect_id = _effect_id(gateway, args.effect_id)
    record = gateway.call("GET", f"/v1/effects/{effect_id}")
    if args.json:
        _print_json(record)
    else:
        print(_render_effect(record))
    return 0


def _effects_resolve(gateway: Gateway, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"outcome": args.outcome, "note": args.note}
    given = args.response_body is not None or args.response_header
    if args.response_status is None and given:
        raise CliError("--response-body and --response-header need --response-status", EXIT_USAGE)
    if args.response_status is not None:
        if args.outcome != "COMMITTED":
            raise CliError("--response-* go with --outcome COMMITTED", EXIT_USAGE)
        headers: dict[str, str] = {}
        for line in args.response_header:
            name, sep, value = line.partition(":")
            if not sep or not name.strip():
                raise CliError(
                    f"--response-header: expected 'Name: value', got {line!r}", EXIT_USAGE
                )
            headers[name.strip()] = value.strip()
        body["response"] = {
            "status": args.response_status,
            "headers": headers,
            "body": args.response_body or "",
        }
    effect_id = _effect_id(gateway, args.effect_id)
    record = gateway.call("POST", f"/v1/effects/{effect_id}/resolve", body)
    if args.json:
        _print_json(record)
        return 0
    print(f"effect {effect_id} resolved as {record.get('state')}")
    if record.get("state") == "NOT_APPLIED":
        print("the same payload may now be sent again under the same key")
    return 0


def _effects_approve(gateway: Gateway, args: argparse.Namespace) -> int:
    effect_id = _effect_id(gateway, args.effect_id)
    body: dict[str, Any] = {}
    if args.payload_digest:
        body["payloadDigest"] = args.payload_digest
    if args.note:
        body["note"] = args.note
    record = gateway.call("POST", f"/v1/effects/{effect_id}/approve", body)
    if args.json:
        _print_json(record)
        return 0
    approval = record.get("approval") or {}
    print(
        f"effect {effect_id} approved: the next forward of payloadDigest "
        f"{approval.get('payloadDigest')} goes to {record.get('downstream')} once, "
        f"until {_time(approval.get('expiresAt'))}"
    )
    return 0


def _effects_reconcile(gateway: Gateway, args: argparse.Namespace) -> int:
    effect_id = _effect_id(gateway, args.effect_id)
    try:
        record = gateway.call("POST", f"/v1/effects/{effect_id}/reconcile")
    except CliError as exc:
        if exc.message.startswith("EFFECT_UNKNOWN:"):
            exc.message += (
                f"\nfencegate: settle it by hand: fencegate effects resolve {effect_id[:12]} "
                "--outcome COMMITTED|NOT_APPLIED --note '...'"
            )
        raise
    if args.json:
        _print_json(record)
        return 0
    line = f"effect {effect_id} is {record.get('state')}"
    actions = record.get("actions") or []
    last = actions[-1] if actions else {}
    if last.get("action") == "reconcile":
        line += f" (last probe: {last.get('verdict')}, {_time(last.get('at'))})"
    print(line)
    return 0


# --- tasks, epoch, claims -----------------------------------------------------------------------


def _tasks_show(gateway: Gateway, args: argparse.Namespace) -> int:
    task = gateway.call("GET", f"/v1/tasks/{quote(args.task_id, safe='/:@')}")
    if args.json:
        _print_json(task)
        return 0
    pairs: list[tuple[str, object]] = [
        ("task", task.get("taskId")),
        ("state", task.get("state")),
        ("revision", task.get("revision")),
        ("inputDigest", task.get("inputDigest")),
        ("claimGeneration", task.get("claimGeneration")),
        ("attempt", task.get("attemptId")),
        ("owner", task.get("owner")),
        ("attemptStarted", _time(task.get("attemptStartedAt"), precise=True)),
        ("leaseExpires", _time(task.get("leaseExpiresAt"), precise=True)),
        ("maxRuntimeMs", task.get("maxRuntimeMs")),
        ("cancelGeneration", task.get("cancelGeneration")),
        ("schedulerEpoch", task.get("schedulerEpoch")),
        ("created", _time(task.get("createdAt"), precise=True)),
        ("updated", _time(task.get("updatedAt"), precise=True)),
    ]
    commit = task.get("commit")
    if isinstance(commit, dict):
        pairs += [
            ("commit", commit.get("commitId")),
            ("  by attempt", f"{commit.get('attemptId')} (gen {commit.get('claimGeneration')})"),
            ("  resultDigest", commit.get("resultDigest")),
            ("  committed", _time(commit.get("committedAt"), precise=True)),
        ]
        if "result" in commit:
            pairs.append(("  result", _cell(json.dumps(commit["result"]), 200)))
    else:
        pairs.append(("commit", "none"))
    print(_fields(pairs))
    return 0


def _scheduler_line(scheduler: dict[str, Any]) -> str:
    paused = "paused" if scheduler.get("claimsPaused") else "open"
    return f"scheduler epoch {scheduler.get('schedulerEpoch')}, claims {paused}"


def _epoch_show(gateway: Gateway, args: argparse.Namespace) -> int:
    scheduler = gateway.call("GET", "/v1/epoch")
    if args.json:
        _print_json(scheduler)
    else:
        print(_scheduler_line(scheduler))
    return 0


def _epoch_bump(gateway: Gateway, args: argparse.Namespace) -> int:
    scheduler = gateway.call("POST", "/v1/epoch/bump")
    if args.json:
        _print_json(scheduler)
        return 0
    epoch = scheduler.get("schedulerEpoch")
    print(
        f"bumped the scheduler epoch to {epoch}: every claim granted under an earlier epoch "
        f"is fenced; schedulers must claim with schedulerEpoch {epoch}"
    )
    return 0


def _rollout_status(gateway: Gateway, args: argparse.Namespace) -> int:
    """The rollback checklist: exit 0 only when it is safe to switch worker pools."""
    status = gateway.call("GET", "/v1/rollout")
    if args.json:
        _print_json(status)
    else:
        print(
            _fields(
                [
                    ("scheduler epoch", status.get("schedulerEpoch")),
                    ("claims paused", status.get("claimsPaused")),
                    ("active leases", status.get("activeLeases")),
                    ("PREPARED effects", status.get("preparedEffects")),
                    ("UNKNOWN effects", status.get("unknownEffects")),
                    ("awaiting approval", status.get("awaitingApproval")),
                ]
            )
        )
        if status.get("safeToSwitchPools"):
            print("safe to switch pools")
        else:
            print("NOT safe to switch pools: wait for leases to expire and settle the effects")
    return 0 if status.get("safeToSwitchPools") else 4


def _claims(paused: bool) -> Callable[[Gateway, argparse.Namespace], int]:
    def run(gateway: Gateway, args: argparse.Namespace) -> int:
        scheduler = gateway.call("POST", f"/v1/claims/{'pause' if paused else 'resume'}")
        if args.json:
            _print_json(scheduler)
        elif paused:
            print(
                f"claims paused ({_scheduler_line(scheduler)}): new claims answer "
                "503 CLAIMS_PAUSED until `fencegate claims resume`"
            )
        else:
            print(f"claims resumed ({_scheduler_line(scheduler)})")
        return 0

    return run


# --- the parser ---------------------------------------------------------------------------------


def _run(handler: Callable[[Gateway, argparse.Namespace], int]) -> Callable[..., int]:
    def func(args: argparse.Namespace) -> int:
        try:
            gateway = Gateway(gateway_url(args), _operator(args), args.timeout)
            return handler(gateway, args)
        except CliError as exc:
            print(f"fencegate: {exc.message}", file=sys.stderr)
            return exc.exit_code
        except BrokenPipeError:  # `fencegate effects list | head`: not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0

    return func


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _status(text: str) -> int:
    if not text.isdigit() or not 100 <= int(text) <= 599:
        raise argparse.ArgumentTypeError(f"expected an HTTP status 100-599, got {text!r}")
    return int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("gateway")
    group.add_argument(
        "--url",
        metavar="URL",
        help="the gateway (default: --config's server.listen, else $FENCEGATE_URL, "
        f"else {DEFAULT_URL})",
    )
    group.add_argument("--config", metavar="FILE", help="take the gateway's address from FILE")
    group.add_argument(
        "--operator",
        metavar="NAME",
        help="recorded with every change (default: $FENCEGATE_OPERATOR, else the login user)",
    )
    group.add_argument("--json", action="store_true", help="print the gateway's JSON")
    group.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=_positive_float,
        default=30.0,
        help="longest wait for one answer (default: 30)",
    )
    return common


def _leaf(
    parent: SubParsers,
    name: str,
    help_text: str,
    common: argparse.ArgumentParser,
    handler: Callable[[Gateway, argparse.Namespace], int],
) -> argparse.ArgumentParser:
    parser = parent.add_parser(name, help=help_text, description=help_text, parents=[common])
    parser.set_defaults(func=_run(handler))
    return parser


def register(sub: SubParsers) -> None:
    """Add ``effects``, ``tasks``, ``epoch``, ``claims`` and ``rollout`` to ``fencegate``'s
    parser."""
    common = _common()

    effects = sub.add_parser("effects", help="read and settle the idempotency ledger")
    actions = effects.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = _leaf(actions, "list", "list ledger records", common, _effects_list)
    listing.add_argument("--state", type=str.upper, choices=_STATES)
    listing.add_argument("--task", metavar="TASK_ID")
    listing.add_argument("--downstream", metavar="NAME")
    listing.add_argument(
        "--limit", type=_positive_int, default=50, help="most records shown (default: 50)"
    )
    show = _leaf(actions, "show", "show one ledger record", common, _effects_show)
    show.add_argument("effect_id", metavar="EFFECT_ID", help=_EFFECT_HELP)
    resolve = _leaf(
        actions, "resolve", "settle an UNKNOWN effect by hand", common, _effects_resolve
    )
    resolve.add_argument("effect_id", metavar="EFFECT_ID", help=_EFFECT_HELP)
    resolve.add_argument(
        "--outcome", required=True, type=str.upper, choices=("COMMITTED", "NOT_APPLIED")
    )
    resolve.add_argument("--note", required=True, help="why (recorded with your name)")
    replay = resolve.add_argument_group(
        "what duplicates replay (COMMITTED only; without it they get an empty 200)"
    )
    replay.add_argument("--response-status", metavar="STATUS", type=_status)
    replay.add_argument("--response-body", metavar="TEXT")
    replay.add_argument("--response-header", metavar="'NAME: VALUE'", action="append", default=[])
    approve = _leaf(actions, "approve", "let a waiting effect go once", common, _effects_approve)
    approve.add_argument("effect_id", metavar="EFFECT_ID", help=_EFFECT_HELP)
    approve.add_argument(
        "--payload-digest", metavar="DIGEST", help="approve only if it still waits for this"
    )
    approve.add_argument("--note", help="recorded with your name")
    reconcile = _leaf(
        actions, "reconcile", "ask the downstream about an UNKNOWN effect", common,
        _effects_reconcile,
    )  # fmt: skip
    reconcile.add_argument("effect_id", metavar="EFFECT_ID", help=_EFFECT_HELP)

    tasks = sub.add_parser("tasks", help="read tasks")
    task_actions = tasks.add_subparsers(dest="action", required=True, metavar="ACTION")
    task_show = _leaf(task_actions, "show", "show one task", common, _tasks_show)
    task_show.add_argument("task_id", metavar="TASK_ID")

    epoch = sub.add_parser("epoch", help="the scheduler epoch")
    epoch_actions = epoch.add_subparsers(dest="action", required=True, metavar="ACTION")
    _leaf(epoch_actions, "show", "show the epoch and whether claims are paused", common,
          _epoch_show)  # fmt: skip
    _leaf(epoch_actions, "bump", "fence every claim granted so far", common, _epoch_bump)

    claims = sub.add_parser("claims", help="pause or resume new claims")
    claim_actions = claims.add_subparsers(dest="action", required=True, metavar="ACTION")
    _leaf(claim_actions, "pause", "refuse new claims (CLAIMS_PAUSED)", common, _claims(True))
    _leaf(claim_actions, "resume", "accept new claims again", common, _claims(False))

    rollout = sub.add_parser("rollout", help="is it safe to switch worker pools?")
    rollout_actions = rollout.add_subparsers(dest="action", required=True, metavar="ACTION")
    _leaf(
        rollout_actions,
        "status",
        "leases, PREPARED/UNKNOWN effects, approvals; exit 0 only when all are zero",
        common,
        _rollout_status,
    )
