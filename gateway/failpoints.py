"""Test-only crash points: ``FENCEGATE_FAILPOINTS=after_prepare,after_response``.

At a named point the process SIGKILLs itself, exactly like ``kill -9`` at that instant, so
tests can prove that no crash between PREPARED and the recorded outcome loses an effect or
repeats it. Read once at import; with the variable unset, ``hit`` is a set lookup.
"""

from __future__ import annotations

import os
import signal

__all__ = ["POINTS", "hit"]

#: Every point the code can stop at.
POINTS = frozenset({"after_prepare", "after_response"})

_ARMED = frozenset(
    name.strip() for name in os.environ.get("FENCEGATE_FAILPOINTS", "").split(",") if name.strip()
)
if _ARMED - POINTS:
    raise RuntimeError(f"FENCEGATE_FAILPOINTS names unknown points: {sorted(_ARMED - POINTS)}")


def hit(name: str) -> None:
    if name in _ARMED:
        os.kill(os.getpid(), signal.SIGKILL)
