"""The operator commands' place in ``fencegate``'s parser: ``effects``, ``tasks``, ``epoch``,
``claims`` and ``rollout``, their options, and which command each runs.

The commands themselves (SDK calls) are in ``fencegate.gateway.ops_commands``, what they
print in ``fencegate.gateway.ops_render``. See ``docs/cli.md``.

The gateway options (``--url``, ``--config``, ``--json``...) are accepted before the command
(``fencegate --url U effects list``) and after it. argparse lets a subcommand's defaults
overwrite what the main parser read, so both copies default to "not given" and the ones before
the command live under their own names (``global_*``) until ``merge_global_options`` joins
them: after the command wins, then before it, then the default.
"""

from __future__ import annotations

import argparse
import functools
from typing import TYPE_CHECKING, Any, TypeAlias

from fencegate.gateway import ops_commands as commands
from fencegate.gateway import store_cli
from fencegate.gateway.ops_commands import DEFAULT_URL, Command
from fencegate.ledger.effects import RESOLVE_OUTCOMES, EffectState
from fencegate.ledger.tasks import TaskState

__all__ = ["add_global_options", "merge_global_options", "register"]

#: Every ``choices`` comes from its source, never retyped: what the API takes, the CLI takes
#: (tests/test_cli_choices.py walks the parser and holds each to its source).
_STATES = tuple(state.value for state in EffectState)
_TASK_STATES = tuple(state.value for state in TaskState)
_OUTCOMES = tuple(outcome.value for outcome in RESOLVE_OUTCOMES)
#: The gateway options and their values when given neither before nor after the command.
_DEFAULTS: dict[str, object] = {
    "url": None,
    "config": None,
    "operator": None,
    "token_file": None,
    "cacert": None,
    "cert": None,
    "key": None,
    "json": False,
    "timeout": 30.0,
}
_GLOBAL = "global_"
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


def _gateway_options(group: argparse._ActionsContainer, prefix: str = "") -> None:
    """The gateway options, every one defaulting to "not given" (see the module docstring)."""

    def add(flag: str, **options: Any) -> None:
        dest = prefix + flag.removeprefix("--").replace("-", "_")
        group.add_argument(flag, dest=dest, default=argparse.SUPPRESS, **options)

    add(
        "--url",
        metavar="URL",
        help="the gateway (default: --config's server.listen, else $FENCEGATE_URL, "
        f"else {DEFAULT_URL})",
    )
    add("--config", metavar="FILE", help="take the gateway's address and TLS from FILE")
    add(
        "--operator",
        metavar="NAME",
        help="recorded with every change (default: $FENCEGATE_OPERATOR, else the login user)",
    )
    add(
        "--token-file",
        metavar="PATH",
        help="the gateway credential (a gateway with [auth]): a file holding the bearer token "
        "(default: $FENCEGATE_TOKEN)",
    )
    add(
        "--cacert",
        metavar="FILE",
        help="PEM CA certificate(s) to verify an https gateway with (default: $FENCEGATE_CACERT, "
        "else the system's)",
    )
    add("--cert", metavar="FILE", help="PEM client certificate, for a gateway that asks for one")
    add("--key", metavar="FILE", help="the unencrypted PEM key of --cert")
    add("--json", action="store_true", help='print the gateway\'s JSON (with a "gateway" field)')
    add(
        "--timeout",
        metavar="SECONDS",
        type=_positive_float,
        help="longest wait for one answer (default: 30)",
    )


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    _gateway_options(common.add_argument_group("gateway"))
    return common


def add_global_options(parser: argparse.ArgumentParser) -> None:
    """The gateway options on ``fencegate`` itself, for ``fencegate --url U effects list``."""
    group = parser.add_argument_group(
        "gateway (operator commands; also accepted after the command)"
    )
    _gateway_options(group, _GLOBAL)


def merge_global_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Give an operator command each gateway option from after it, else from before it, else
    its default. Before a command that takes none of them (``serve``...) they are a usage
    error rather than silently ignored: ``fencegate --config F serve`` must not serve the
    embedded store."""
    given = {name: vars(args).pop(_GLOBAL + name) for name in _DEFAULTS if _GLOBAL + name in args}
    if not getattr(args, "operator_command", False):
        if given:
            flag = "--" + next(iter(given)).replace("_", "-")
            parser.error(
                f"{flag} goes with the operator commands (effects, tasks, epoch, claims, "
                f"rollout, store), not with {args.command!r}"
            )
        return
    for name, default in _DEFAULTS.items():
        if name not in args:
            setattr(args, name, given.get(name, default))


def _leaf(
    parent: SubParsers,
    name: str,
    help_text: str,
    common: argparse.ArgumentParser,
    command: Command,
) -> argparse.ArgumentParser:
    parser = parent.add_parser(name, help=help_text, description=help_text, parents=[common])
    parser.set_defaults(func=functools.partial(commands.run, command), operator_command=True)
    return parser


def register(sub: SubParsers) -> None:
    """Add ``effects``, ``tasks``, ``epoch``, ``claims``, ``rollout`` and ``store`` to
    ``fencegate``'s parser."""
    common = _common()

    effects = sub.add_parser("effects", help="read and settle the idempotency ledger")
    actions = effects.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = _leaf(actions, "list", "list ledger records", common, commands.effects_list)
    listing.add_argument("--state", type=str.upper, choices=_STATES)
    listing.add_argument(
        "--awaiting-approval",
        action="store_true",
        help="the effects waiting for an operator's approval, oldest first (alone, or with "
        "--limit)",
    )
    listing.add_argument("--task", metavar="TASK_ID")
    listing.add_argument("--downstream", metavar="NAME")
    listing.add_argument(
        "--idempotency-key",
        metavar="KEY",
        help="a lease-less client's keyed effects by its own Idempotency-Key (with --principal; "
        "--downstream narrows it)",
    )
    listing.add_argument(
        "--principal",
        metavar="NAME",
        help="whose key --idempotency-key is (default: the principal of your token)",
    )
    listing.add_argument(
        "--limit", type=_positive_int, default=50, help="most records shown (default: 50)"
    )
    show = _leaf(actions, "show", "show one ledger record", common, commands.effects_show)
    show.add_argument("effect_id", metavar="EFFECT_ID", help=_EFFECT_HELP)
    resolve = _leaf(
        actions, "resolve", "settle an UNKNOWN effect by hand", common, commands.effects_resolve
    )
    resolve.add_argument("effect_id", metavar="EFFECT_ID", help=_EFFECT_HELP)
    resolve.add_argument("--outcome", required=True, type=str.upper, choices=_OUTCOMES)
    resolve.add_argument("--note", required=True, help="why (recorded with your name)")
    resolve.add_argument(
        "--force",
        action="store_true",
        help="NOT_APPLIED although an earlier forward may still land at the downstream "
        "(refused until then, EFFECT_IN_FLIGHT); recorded on the effect",
    )
    replay = resolve.add_argument_group(
        "what duplicates replay (COMMITTED only; give it now, a later resolve cannot add one; "
        "without it they get what the forward recorded, else 204 with Fence-Replay-Body: none)"
    )
    replay.add_argument("--response-status", metavar="STATUS", type=_status)
    replay.add_argument("--response-body", metavar="TEXT")
    replay.add_argument("--response-header", metavar="'NAME: VALUE'", action="append", default=[])
    approve = _leaf(
        actions, "approve", "let a waiting effect go once", common, commands.effects_approve
    )
    approve.add_argument("effect_id", metavar="EFFECT_ID", help=_EFFECT_HELP)
    approve.add_argument(
        "--approval-digest",
        metavar="DIGEST",
        help="approve only if it still waits for this request (its approvalDigest: the "
        "payload and its Content-Type, Content-Encoding and preconditions)",
    )
    approve.add_argument(
        "--payload-digest",
        metavar="DIGEST",
        help="approve only if it still waits for this payload (alone: only for a request "
        "without those headers)",
    )
    approve.add_argument("--note", help="recorded with your name")
    reconcile = _leaf(
        actions, "reconcile", "ask the downstream about an UNKNOWN effect", common,
        commands.effects_reconcile,
    )  # fmt: skip
    reconcile.add_argument("effect_id", metavar="EFFECT_ID", help=_EFFECT_HELP)

    tasks = sub.add_parser("tasks", help="read, list and claim tasks")
    task_actions = tasks.add_subparsers(dest="action", required=True, metavar="ACTION")
    task_show = _leaf(task_actions, "show", "show one task", common, commands.tasks_show)
    task_show.add_argument("task_id", metavar="TASK_ID")
    task_list = _leaf(task_actions, "list", "list tasks in taskId order", common,
                      commands.tasks_list)  # fmt: skip
    task_list.add_argument("--state", type=str.upper, choices=_TASK_STATES)
    task_list.add_argument("--owner", metavar="NAME", help="claimed by NAME")
    task_list.add_argument(
        "--lease-expired",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="only CLAIMED tasks whose lease has run out by the store's clock (--no-lease-"
        "expired: every other task)",
    )
    task_list.add_argument(
        "--limit", type=_positive_int, default=50, help="most tasks shown (default: 50)"
    )
    task_claim = _leaf(
        task_actions,
        "claim",
        "claim a task as a worker (a bare lease: nothing renews it)",
        common,
        commands.tasks_claim,
    )
    task_claim.add_argument("task_id", metavar="TASK_ID")
    task_claim.add_argument("--owner", required=True, metavar="NAME", help="the worker's name")
    task_claim.add_argument(
        "--ttl-ms", required=True, type=_positive_int, metavar="N", help="lease length asked for"
    )
    task_claim.add_argument(
        "--headers",
        action="store_true",
        help="print only the claim's Fence-* request headers, one 'Name: value' a line "
        "(for curl -H @FILE)",
    )
    task_claim.add_argument(
        "--slot", metavar="SLOT", help="add Fence-Slot (unsafe methods need one)"
    )
    task_claim.add_argument("--node", metavar="NODE", help="add Fence-Node (default node: main)")

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

    store = sub.add_parser("store", help="the store's sizes")
    store_actions = store.add_subparsers(dest="action", required=True, metavar="ACTION")
    _leaf(
        store_actions,
        "stats",
        "records by kind, what retention removes next, tombstones, bytes",
        common,
        commands.store_stats,
    )
    store_migrate = store_actions.add_parser(
        "migrate",
        help="bring a store written by an older fencegate to this version's format",
        description="Opens the store of --config directly (no gateway), migrates it in "
        "idempotent steps and says what it did; run it again after an interruption.",
    )
    store_migrate.add_argument(
        "--config", metavar="FILE", help="the gateway's TOML config (default: embedded store)"
    )
    store_migrate.set_defaults(func=store_cli.migrate, operator_command=False)
    store_copy = store_actions.add_parser(
        "copy",
        help="copy a drained single Redis store into a Redis Cluster (redis+cluster://)",
        description="Reads the single Redis store of --config ([store] url and "
        "redis_key_prefix) and writes it into the bucket layout of the Redis Cluster at --to "
        "(store.cluster_buckets buckets, the same key prefix). Refuses a store that is not "
        "drained (a CLAIMED task whose lease has not run out, a PREPARED effect) and writes "
        "nothing then; a task CLAIMED past its lease is copied as it is. Idempotent: run "
        "it again after an interruption; what is there is left. The change feed is not "
        "copied (docs/stores.md, 'Moving to a cluster').",
    )
    store_copy.add_argument(
        "--to",
        metavar="URL",
        required=True,
        help="the cluster: redis+cluster://[USER@]HOST1:PORT1,HOST2:PORT2,... "
        "(rediss+cluster:// for TLS)",
    )
    store_copy.add_argument(
        "--config", metavar="FILE", help="the gateway's TOML config (its [store] is the source)"
    )
    store_copy.add_argument(
        "--to-password-env",
        metavar="NAME",
        help="environment variable holding the cluster's password (default: store.password_env)",
    )
    store_copy.add_argument(
        "--batch",
        metavar="N",
        type=_positive_int,
        default=500,
        help="keys per SCAN step and members per index page (default 500)",
    )
    store_copy.set_defaults(func=store_cli.copy, operator_command=False)
    store_move = store_actions.add_parser(
        "move-slot",
        help="move a Redis Cluster slot (a bucket's) to another primary, under load",
        description="Freezes the store's buckets in SLOT, migrates the slot's keys to the "
        "primary at --to (CLUSTER SETSLOT, MIGRATE), points every primary at it, unfreezes. "
        "Idempotent: run it again after an interruption; the buckets stay frozen until it "
        "ends (docs/decisions.md, 'Moving a slot').",
    )
    store_move.add_argument("slot", metavar="SLOT", type=int, help="the hash slot (0..16383)")
    store_move.add_argument(
        "--to", metavar="HOST:PORT", required=True, help="the primary to move it to"
    )
    store_move.add_argument(
        "--config", metavar="FILE", help="the gateway's TOML config (a redis+cluster:// store)"
    )
    store_move.add_argument(
        "--batch", metavar="N", type=_positive_int, default=100, help="keys per MIGRATE"
    )
    store_move.set_defaults(func=store_cli.move_slot, operator_command=False)

    failover = sub.add_parser("failover", help="after a Redis failover that lost writes")
    failover_actions = failover.add_subparsers(dest="action", required=True, metavar="ACTION")
    failover_ack = failover_actions.add_parser(
        "ack",
        help="fence every earlier claim and let the gateways write again",
        description="After a failover (or restore) that lost writes the gateways refuse claims "
        "and effects (503). This bumps the scheduler epoch once and lets them go on. Opens the "
        "store of --config directly (docs/operations.md, 'Redis failover').",
    )
    failover_ack.add_argument(
        "--config", metavar="FILE", help="the gateway's TOML config (its [store] is used)"
    )
    failover_ack.set_defaults(func=store_cli.failover_ack, operator_command=False)
    failover_lost = failover_actions.add_parser(
        "lost",
        help="list what the gateways' logs say was answered and the store no longer holds",
        description="Reads the gateways' JSON logs (--log, one per gateway) and the store of "
        "--config, and lists the effect records, claims and commits the logs show answered "
        "that the store lacks or holds at an earlier step. Exit 0 nothing lost, 3 lost records "
        "listed, 1 store unreachable, 2 bad config or log (docs/operations.md, 'Redis "
        "failover').",
    )
    failover_lost.add_argument(
        "--config", metavar="FILE", help="the gateway's TOML config (its [store] is used)"
    )
    failover_lost.add_argument(
        "--log",
        metavar="FILE",
        action="append",
        required=True,
        help="a gateway's log (its stderr: one JSON event per line); repeat for each gateway",
    )
    failover_lost.set_defaults(func=store_cli.failover_lost, operator_command=False)

    rollout = sub.add_parser("rollout", help="is it safe to switch worker pools?")
    rollout_actions = rollout.add_subparsers(dest="action", required=True, metavar="ACTION")
    _leaf(
        rollout_actions,
        "status",
        "leases, PREPARED/UNKNOWN effects, approvals; exit 0 only when all are zero",
        common,
        commands.rollout_status,
    )
