"""Keys that gateways must share, from an environment variable or drawn per process.

The console's session cookies and the MCP session ids are both signed with a key every
gateway of a fleet must hold (``FENCEGATE_CONSOLE_SECRET``, ``FENCEGATE_SESSION_SECRET``).
One rule for both: a value of at least ``MIN_SECRET`` characters, hashed to the key (with a
context, so one secret set for both never gives one key for two purposes); unset, each
process draws a random key (``serve --workers`` workers share the supervisor's).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Mapping
from typing import Final

__all__ = ["MIN_SECRET", "env_key", "secret_problem"]

#: The shortest secret taken: anyone holding something signed with it (their own cookie or
#: session id) can try keys offline, so a guessable secret would let them forge another's.
MIN_SECRET: Final = 32


def secret_problem(name: str, purpose: str, environ: Mapping[str, str]) -> str | None:
    """Why the secret in ``name`` cannot be used, or None (unset is fine: random)."""
    value = environ.get(name, "")
    if value and len(value) < MIN_SECRET:
        return (
            f"{name}: at least {MIN_SECRET} characters ({purpose}; this one has "
            f"{len(value)}), e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    return None


def env_key(
    name: str, purpose: str, context: bytes = b"", environ: Mapping[str, str] | None = None
) -> tuple[bytes, bool]:
    """The key and whether it came from the environment (False: random, this process only).
    ValueError for a secret too short."""
    environ = environ if environ is not None else os.environ
    problem = secret_problem(name, purpose, environ)
    if problem is not None:
        raise ValueError(problem)
    value = environ.get(name, "")
    if value:
        return hashlib.sha256(context + value.encode()).digest(), True
    return secrets.token_bytes(32), False
