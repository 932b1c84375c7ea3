"""``fencegate demo``: the fencing stories, played for real, narrated in plain words.

One command, no set-up. It starts a real gateway (in this process, on a free loopback port,
with the embedded SQLite store in a temporary directory, or ``--store URL``) in front of a
small "shop" API that records every call it receives (and a small MCP tool server), then
plays seven stories with the SDK:

1. A worker pauses past its lease; another takes over. The paused one wakes: its renewal is
   LEASE_EXPIRED, then FENCED, its effect and its commit are FENCED; the new owner commits,
   and the charge the paused worker had made is replayed, not repeated.
2. A lost answer. A's refund times out (the shop is slower than the gateway's timeout): the
   effect is UNKNOWN. B takes over: a different refund for the same slot is PAYLOAD_CONFLICT,
   the same one EFFECT_UNKNOWN. An operator settles it; B's retry replays it.
3. Duplicates. The same email sent again while the first is in flight is EFFECT_IN_FLIGHT;
   waited out, every duplicate gets the replay (Fence-Replayed: true).
4. An epoch bump fences every old claim at once: their bodies are cancelled within one
   renewal period, and their successors claim at once under the new epoch.
5. An MCP tool server behind ``/mcp/invoices``: A's ``tools/call`` loses its answer; a stale A
   is refused (a JSON-RPC error, ``FENCED``) before the server sees anything; B's retry gets
   A's recorded result under its own JSON-RPC id; the read-only tool is not recorded.
6. A two-step pipeline: step two is WAITING until step one's canonical commit, then handed
   out from the queue with that commit's id.
7. A chat agent with no task queue and no lease pays through ``Client.request`` with its own
   Idempotency-Key: the answer is lost (UNKNOWN), the retry is EFFECT_UNKNOWN until the shop's
   lookup (the gateway's probe) finds the charge, then every retry is replayed
   (Idempotent-Replayed: true) and another amount under that key is PAYLOAD_CONFLICT.

It ends with what the shop actually received, per Idempotency-Key (exactly one call each),
and what the MCP server ran (each effect once),
and exits 0 only if every verdict was the expected one: it doubles as a smoke test. Each story
says in its own words what failure it shows and why the gateway's answer is the right one.

It cleans up after itself, also when a story fails or on Ctrl-C: the temporary directory (and
a ``--store sqlite:///FILE``, which must not exist beforehand) is deleted, and on Redis every
key under the run's own key prefix (printed at the start), nothing else. ``--keep`` keeps it
all and says where.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["register"]


def _run(args: argparse.Namespace) -> int:
    import asyncio

    # The gateway's server, its stores and the SDK: only when the demo runs.
    from fencegate.gateway.demo_stories import run_demo

    try:
        return asyncio.run(run_demo(store=args.store, keep=args.keep))
    except KeyboardInterrupt:  # run_demo has cleaned up and said so: no traceback
        print("fencegate demo: interrupted", file=sys.stderr)
        return 130


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``fencegate demo``: added to ``fencegate.gateway.cli.COMMANDS``."""
    demo = sub.add_parser(
        "demo",
        help="play the fencing stories against a real gateway (exits 0 if all went as they should)",
        description=(
            "Start a real gateway (embedded store in a temporary directory, or --store URL) "
            "in front of a small downstream, play the stories of a paused worker, a lost "
            "answer, duplicates, an epoch bump, an MCP tool server, a pipeline and a chat agent "
            "without a lease with the SDK, and narrate every verdict. "
            "Exits 0 only if every story ended as it should. Everything it wrote is deleted "
            "at the end, also on failure or Ctrl-C: its temporary directory, or on Redis "
            "every key under its own key prefix (printed at the start)."
        ),
    )
    demo.add_argument(
        "--store",
        metavar="URL",
        help="store URL, e.g. redis://127.0.0.1:6379/0, or sqlite:///FILE for a file that does "
        "not exist yet (default: embedded SQLite in a temp dir)",
    )
    demo.add_argument(
        "--keep",
        action="store_true",
        help="keep the temporary directory (store, gateway log) and, on Redis, the demo's keys",
    )
    demo.set_defaults(func=_run)
