"""Test-only fault points: ``FENCEGATE_FAILPOINTS=after_prepare,after_response``.

At a named point the process SIGKILLs itself, exactly like ``kill -9`` at that instant, so
tests can prove that no crash between PREPARED and the recorded outcome loses an effect or
repeats it. ``NAME=MS`` (e.g. ``after_prepare=1500``) stalls there for MS milliseconds
instead, the way a GC pause or an overloaded host stalls a gateway. Read once at import;
with the variable unset, ``hit`` is a dict lookup.
"""

from __future__ import annotations

import asyncio
import os
import signal

__all__ = ["POINTS", "hit"]

#: Every point the code can stop at.
POINTS = frozenset({"after_prepare", "after_response"})


def _parse(raw: str) -> dict[str, int | None]:
    armed: dict[str, int | None] = {}
    for item in raw.split(","):
        name, sep, ms = item.strip().partition("=")
        if not name:
            continue
        if name not in POINTS:
            raise RuntimeError(f"FENCEGATE_FAILPOINTS names an unknown point: {name!r}")
        if sep and not ms.isdigit():
            raise RuntimeError(f"FENCEGATE_FAILPOINTS: {item!r}: expected NAME or NAME=MS")
        armed[name] = int(ms) if sep else None
    return armed


_ARMED = _parse(os.environ.get("FENCEGATE_FAILPOINTS", ""))


async def hit(name: str) -> None:
    if name not in _ARMED:
        return
    stall_ms = _ARMED[name]
    if stall_ms is None:
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        await asyncio.sleep(stall_ms / 1000)
