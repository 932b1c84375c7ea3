"""Wait instead of 409: a duplicate of an in-flight effect waits for the first call's outcome.

A call whose prepare is refused ``EFFECT_IN_FLIGHT`` (the same effect, leased or keyed, is being
forwarded right now) and that asked to wait (``Prefer: wait=N`` on ``/proxy``, RFC 7240, N
whole seconds; ``params._meta["dev.fencegate/wait"]`` on ``/mcp``, seconds) waits up to N,
bounded by ``proxy.max_prefer_wait_ms``, then prepares again through the usual path, which
decides as for any call: a COMMITTED effect replays, an UNKNOWN one is ``409 EFFECT_UNKNOWN``,
a NOT_APPLIED one goes on as a fresh attempt; still in flight when N is over: ``409
EFFECT_IN_FLIGHT``. Every answer of a call that waited says so: ``Preference-Applied: wait=N``,
N as applied (after the bound, whole seconds rounded up). A malformed preference is ignored, as
RFC 7240 says of preferences a server does not understand; so is one in shadow mode (the
duplicate is forwarded anyway: waiting would only change its timing).

Waiting costs the store nothing but one read per outcome: a waiter is a ``Waiter`` of the
process's ``EventHub`` (``gateway/events.py``), counted against ``tasks.max_waiters`` and
``tasks.max_waiters_per_principal`` (past them: 503 ``TOO_MANY_CONNECTIONS``), and it is woken,
never polls:

- by this process recording the effect's outcome (``settled``, called where ``/proxy`` and
  ``/mcp`` record one: ``proxy.record_outcome``, and an abort of a forward that started too
  late);
- by the store's change feed, which the hub reads while any waiter exists (from the feed's end
  when it starts), for an outcome another gateway process recorded; when the hub (re)starts
  from the end every waiter is woken once, since what came before that end was not seen;
- by its own timer at the record's ``deadline_at`` (a PREPARED record past its deadline reads
  UNKNOWN: a first gateway that died does not hold the waiter for all of N), and at N.

A wake-up reads the record once (``Store.get_effect``); only a record no longer PREPARED (or
past its deadline) is prepared again. The waiter also reads the record once as it starts
waiting: an outcome recorded between the refused prepare and the waiter's registration would
otherwise wake nobody.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from fencegate.adapters import mcp
from fencegate.gateway.principals import principal_of
from fencegate.gateway.state import CONFIG, EVENTS, STORE
from fencegate.ledger.effects import EffectState, PrepareOutcome

__all__ = [
    "PREFERENCE_APPLIED",
    "Wait",
    "applied_header",
    "mcp_wait",
    "prefer_wait",
    "settled",
    "wait_out",
]

log = structlog.get_logger("fencegate.effect_waiters")

#: Where a request that waited keeps its ``Preference-Applied`` value, for ``applied_header``
#: (an answer streamed from the downstream has its headers sent before the handler returns).
_REQUEST_KEY: Any = getattr(web, "RequestKey", None)  # aiohttp 3.14 on; a string before
PREFERENCE_APPLIED: Any = (
    _REQUEST_KEY("preference_applied", str) if _REQUEST_KEY else "fencegate.preference_applied"
)

#: One element of a ``Prefer`` list: up to the next comma that is not inside a quoted string.
_ELEMENT = re.compile(r'(?:[^,"]|"(?:[^"\\]|\\.)*")+')
#: ``wait`` BWS "=" BWS ( delta-seconds / quoted delta-seconds ), then parameters.
_WAIT = re.compile(r'wait\s*=\s*(?:([0-9]+)|"([0-9]+)")\s*(?:;.*)?', re.IGNORECASE | re.DOTALL)
_NAME = re.compile(r"([!#$%&'*+.^_`|~0-9A-Za-z-]+)")
#: Digits of a wait past which the number is only "very long" (``int`` refuses huge strings).
_MAX_DIGITS = 12


@dataclass(frozen=True, slots=True)
class Wait:
    """How long a duplicate waits for the first call's outcome: the asked wait, bounded."""

    ms: int

    @property
    def applied(self) -> str:
        """The ``Preference-Applied`` value: whole seconds, rounded up (never more than
        asked, since the bound only shortens a wait)."""
        return f"wait={math.ceil(self.ms / 1000)}"


def _bounded(app: web.Application, ms: int) -> Wait:
    return Wait(min(ms, app[CONFIG].proxy.max_prefer_wait_ms))


def prefer_wait(request: web.Request) -> Wait | None:
    """The ``wait`` preference of the request's ``Prefer`` fields (all of them, as one list),
    bounded; None without one. Only the first ``wait`` counts (RFC 7240 section 2); one whose
    value is not delta-seconds is ignored."""
    for element in _ELEMENT.findall(",".join(request.headers.getall("Prefer", []))):
        name = _NAME.match(element.strip())
        if name is None or name.group(1).lower() != "wait":
            continue
        value = _WAIT.fullmatch(element.strip())
        if value is None:
            return None
        digits = value.group(1) or value.group(2)
        seconds = int(digits) if len(digits) <= _MAX_DIGITS else 10**_MAX_DIGITS
        return _bounded(request.app, seconds * 1000)
    return None


def mcp_wait(request: web.Request, meta: Mapping[str, Any]) -> Wait | None:
    """A ``tools/call``'s ``_meta["dev.fencegate/wait"]`` (either spelling: ``mcp.ours``):
    non-negative finite seconds, bounded; anything else is ignored as ``Prefer`` is."""
    seconds = mcp.ours(meta, mcp.META_WAIT)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        return None
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return _bounded(request.app, math.ceil(min(seconds, 10.0**_MAX_DIGITS) * 1000))


def applied_header(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """``on_response_prepare`` (through ``proxy.proxy_answer_headers``): the answer of a call
    that waited carries ``Preference-Applied``."""
    applied = request.get(PREFERENCE_APPLIED)
    if applied is not None:
        response.headers["Preference-Applied"] = applied


def settled(app: web.Application, effect_id: str, state: EffectState) -> None:
    """This process recorded ``effect_id``'s outcome (``state``): wake its waiters now."""
    if state is not EffectState.PREPARED:
        app[EVENTS].wake_effect(effect_id)


def _in_flight(outcome: PrepareOutcome) -> bool:
    return outcome.error is not None and outcome.error.code == "EFFECT_IN_FLIGHT"


def _deadline_s(outcome: PrepareOutcome) -> float:
    """Seconds until the in-flight record's deadline, as the store told it (``retryAfterMs``
    of the refusal); past it the record reads UNKNOWN."""
    assert outcome.error is not None
    retry_ms = outcome.error.extra.get("retryAfterMs")
    return max(retry_ms, 1) / 1000 if isinstance(retry_ms, int) else 0.001


async def wait_out(
    request: web.Request,
    wait: Wait | None,
    outcome: PrepareOutcome,
    prepare: Callable[[], Awaitable[PrepareOutcome]],
) -> PrepareOutcome:
    """``outcome`` (a prepare's), or, when it is ``EFFECT_IN_FLIGHT`` and the call asked to
    ``wait``, the outcome of ``prepare`` once the first call's outcome is known, its record's
    deadline passed, or ``wait`` is over (then still ``EFFECT_IN_FLIGHT``, with its
    ``Retry-After``). Raises ``TooManyConnections`` past the waiter limits, and what
    ``prepare`` or the store's read raises."""
    if wait is None or not _in_flight(outcome):
        return outcome
    if wait.ms == 0:
        request[PREFERENCE_APPLIED] = wait.applied
        return outcome
    loop = asyncio.get_running_loop()
    began = loop.time()
    end = began + wait.ms / 1000
    effect_id = outcome.effect.effect_id
    principal = principal_of(request)
    name = principal.name if principal is not None else None
    store = request.app[STORE]
    prepares = 0
    with request.app[EVENTS].waiting(principal=name, effect_id=effect_id) as waiter:
        request[PREFERENCE_APPLIED] = wait.applied  # not on a refusal of the waiter limits
        log.info("effect.wait_started", effect_id=effect_id, wait_ms=wait.ms)
        deadline = loop.time() + _deadline_s(outcome)
        woken = True  # read the record once as the wait starts (see the module's docstring)
        while not waiter.closed:
            if woken:  # an outcome, or a gap in the feed: read the record once
                record = await store.get_effect(effect_id)
                due = record.state is not EffectState.PREPARED  # past its deadline: UNKNOWN
            else:  # a timer: the record's deadline, or the end of the wait
                due = loop.time() >= deadline
            if due:
                prepares += 1
                outcome = await prepare()
                if not _in_flight(outcome):
                    break
                # Someone else's attempt is in flight now (after a NOT_APPLIED): its deadline.
                deadline = loop.time() + _deadline_s(outcome)
            left = min(end, deadline) - loop.time()
            if loop.time() >= end:
                break  # still in flight: the refusal as it stands, with its Retry-After
            woken = await waiter.wait(left)
        log.info(
            "effect.wait_ended",
            effect_id=effect_id,
            waited_ms=round((loop.time() - began) * 1000),
            prepares=prepares,
            outcome=outcome.error.code if outcome.error is not None else outcome.action.value,
        )
    return outcome
