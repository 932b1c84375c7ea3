"""The operator commands' place in ``fencegate``'s parser: ``effects``, ``tasks``, ``epoch``,
``claims`` and ``rollout``, their options, and which command each runs.

The commands themselves (SDK calls) are in ``fencegate.gateway.ops_commands``, what they
print in ``fencegate.gateway.ops_render``. See ``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import functools
from typing import TYPE_CHECKING, TypeAlias

from fencegate.gateway import ops_commands as commands
from fencegate.gateway.ops_commands import DEFAULT_URL, Command

__all__ = ["register"]

_STATES = ("PREPARED", "UNKNOWN", "COMMITTED", "NOT_APPLIED")
_EFFECT_HELP = "64 hex characters, or a unique prefix of at least 6"

if TYPE_CHECKING:
    SubParsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]


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
    group.add_argument(
        "--token-file",
        metavar="PATH",
        help="the gateway credential (a gateway with [auth]): a file holding the bearer token "
        "(default: $FENCEGATE_TOKEN)",
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
    command: Command,
) -> argparse.ArgumentParser:
    parser = parent.add_parser(name, help=help_text, description=help_text, parents=[common])
    parser.set_defaults(func=functools.partial(commands.run, command))
    return parser


def register(sub: SubParsers) -> None:
    """Add ``effects``, ``tasks``, ``epoch``, ``claims`` and ``rollout`` to ``fencegate``'s
    parser."""
    common = _common()

    effects = sub.add_parser("effects", help="read and settle the idempotency ledger")
    actions = effects.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = _leaf(actions, "list", "list ledger records", common, commands.effects_list)
    listing.add_argument("--state", type=str.upper, choices=_STATES)
    listing.add_argument("--task", metavar="TASK_ID")
    listing.add_argument("--downstream", metavar="NAME")
    listing.add_argument(
        "--limit", type=_positive_int, default=50, help="most records shown (default: 50)"
    )
    show = _leaf(actions, "show", "show one ledger record", common, commands.effects_show)
    show.add_argument("effect_id", metavar="EFFECT_ID", help=_EFFECT_HELP)
    resolve = _leaf(
        actions, "resolve", "settle an UNKNOWN effect by hand", common, commands.effects_resolve
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
    approve = _leaf(
        actions, "approve", "let a waiting effect go once", common, commands.effects_approve
    )
    approve.add_argument("effect_id", metavar="EFFECT_ID", help=_EFFECT_HELP)
    approve.add_argument(
        "--payload-digest", metavar="DIGEST", help="approve only if it still waits for this"
    )
    approve.add_argument("--note", help="recorded with your name")
    reconcile = _leaf(
        actions, "reconcile", "ask the downstream about an UNKNOWN effect", common,
        commands.effects_reconcile,
    )  # fmt: skip
    reconcile.add_argument("effect_id", metavar="EFFECT_ID", help=_EFFECT_HELP)

    tasks = sub.add_parser("tasks", help="read tasks")
    task_actions = tasks.add_subparsers(dest="action", required=True, metavar="ACTION")
    task_show = _leaf(task_actions, "show", "show one task", common, commands.tasks_show)
    task_show.add_argument("task_id", metavar="TASK_ID")

    epoch = sub.add_parser("epoch", help="the scheduler epoch")
    epoch_actions = epoch.add_subparsers(dest="action", required=True, metavar="ACTION")
    _leaf(epoch_actions, "show", "show the epoch and whether claims are paused", common,
          commands.epoch_show)  # fmt: skip
    _leaf(epoch_actions, "bump", "fence every claim granted so far", common, commands.epoch_bump)

    claims = sub.add_parser("claims", help="pause or resume new claims")
    claim_actions = claims.add_subparsers(dest="action", required=True, metavar="ACTION")
    _leaf(claim_actions, "pause", "refuse new claims (CLAIMS_PAUSED)", common,
          commands.claims_pause)  # fmt: skip
    _leaf(claim_actions, "resume", "accept new claims again", common, commands.claims_resume)

    rollout = sub.add_parser("rollout", help="is it safe to switch worker pools?")
    rollout_actions = rollout.add_subparsers(dest="action", required=True, metavar="ACTION")
    _leaf(
        rollout_actions,
        "status",
        "leases, PREPARED/UNKNOWN effects, approvals; exit 0 only when all are zero",
        common,
        commands.rollout_status,
    )
