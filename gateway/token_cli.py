"""``fencegate token new``: a fresh bearer token and the config lines that admit it.

The config holds only the token's SHA-256, so the lines on stdout are safe to paste or append
to the config file (``>> fencegate.toml``); the token itself goes to stderr, shown once, for
the principal (as ``FENCEGATE_TOKEN`` or a ``--token-file``). See docs/security.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, TypeAlias

from pydantic import ValidationError

from fencegate.gateway.auth import new_token, token_sha256
from fencegate.gateway.config import ROLES, PrincipalConfig

__all__ = ["register"]

if TYPE_CHECKING:
    SubParsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]


def _new(args: argparse.Namespace) -> int:
    token = new_token()
    roles = list(dict.fromkeys(args.role))
    try:
        principal = PrincipalConfig(name=args.name, roles=tuple(roles),
                                    token_sha256=token_sha256(token))  # fmt: skip
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        print(f"fencegate: token new: {problems}", file=sys.stderr)
        return 2
    print(f"token for {principal.name!r} (shown once, never stored; give it to the principal "
          f"as FENCEGATE_TOKEN or a --token-file):\n{token}", file=sys.stderr)  # fmt: skip
    print("[[auth.principals]]")
    print(f'name = "{principal.name}"')
    print("roles = [" + ", ".join(f'"{role}"' for role in principal.roles) + "]")
    print(f'token_sha256 = "{principal.token_sha256}"')
    return 0


def register(sub: SubParsers) -> None:
    """Add ``token new`` to ``fencegate``'s parser."""
    token = sub.add_parser("token", help="bearer tokens for [auth]")
    actions = token.add_subparsers(dest="action", required=True, metavar="ACTION")
    new = actions.add_parser(
        "new",
        help="print a new random token (stderr) and the [[auth.principals]] lines (stdout)",
        description="Print a new random token on stderr and the config lines that admit it "
        "(its SHA-256, never the token) on stdout.",
    )
    new.add_argument("--name", required=True, help="the principal's unique name")
    new.add_argument(
        "--role", required=True, action="append", choices=ROLES, help="repeat for more roles"
    )
    new.set_defaults(func=_new)
