"""The operator console: ``/console``, server-rendered HTML for the people on call.

Pages read the store; actions call the very functions the JSON API calls
(``ledger_api.resolve_as`` / ``approve_as`` / ``reconcile_as``, ``coordination.bump_epoch_now``
/ ``set_claims_paused``), so validation, audit events and the action trail are the same
whichever way an operator acts. The role matrix (``gateway/auth.py``) lists every route here;
with ``[auth]`` the console's cookie is the credential (``session.py``). docs/console.md.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final

import jinja2
from aiohttp import web

from fencegate.gateway.config import Config
from fencegate.gateway.console.series import Series
from fencegate.gateway.console.session import ConsoleSessions, SessionCodec, console_key
from fencegate.gateway.state import METRICS, STORE

__all__ = ["CONSOLE", "ROUTES", "Console", "new_console", "sampling"]

#: Every console route: (method, path, what it is). ``views.setup`` registers them, the
#: OpenAPI document lists them (as HTML pages, outside the JSON API).
ROUTES: Final[tuple[tuple[str, str, str], ...]] = (
    ("GET", "/console", "Needs attention: UNKNOWN effects and effects awaiting approval"),
    ("GET", "/console/login", "The login form: paste a bearer token"),
    ("POST", "/console/login", "Log in: the token becomes a signed, expiring session cookie"),
    ("POST", "/console/logout", "Log out: the session cookie is dropped"),
    ("GET", "/console/static/{name}", "The console's stylesheet and script"),
    ("GET", "/console/effects/{effect_id}", "One effect: request, attempts, answer, trail"),
    ("POST", "/console/effects/{effect_id}/resolve", "Resolve COMMITTED or NOT_APPLIED"),
    ("POST", "/console/effects/{effect_id}/approve", "Approve the exact payload digest"),
    ("POST", "/console/effects/{effect_id}/reconcile", "Probe the downstream now"),
    ("GET", "/console/tasks", "Find a task by id: state, claim, lease, commit, effects"),
    ("GET", "/console/fleet", "Epoch, claims, rollout status and live charts"),
    ("GET", "/console/fleet/series", "The Fleet page's chart samples and legends (JSON)"),
    ("POST", "/console/fleet/bump", "Bump the scheduler epoch (typed confirmation)"),
    ("POST", "/console/fleet/pause", "Pause claims everywhere"),
    ("POST", "/console/fleet/resume", "Resume claims"),
)


@dataclass
class Console:
    """What the console holds for the app's lifetime."""

    codec: SessionCodec
    #: False: the signing key is random, this process's only (no FENCEGATE_CONSOLE_SECRET).
    key_from_env: bool
    templates: jinja2.Environment
    series: Series
    sessions: ConsoleSessions


CONSOLE = web.AppKey("console", Console)


def new_console(config: Config, environ: dict[str, str] | None = None) -> Console:
    """The console for ``config``; the signing key from ``environ`` (default: the process's)."""
    from fencegate.gateway.console import views

    key, from_env = console_key(environ)
    codec = SessionCodec(key, config.console.session_ttl_ms)
    templates = views.template_environment()
    return Console(codec, from_env, templates, Series(), ConsoleSessions(codec, views.refusal))


async def sampling(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``: the Fleet page's samples, taken in the background from start-up
    (``Series.run``: one store round trip every ``series.SAMPLE_MS``), stopped before the
    store closes."""
    task = asyncio.get_running_loop().create_task(
        app[CONSOLE].series.run(app[METRICS], app[STORE]), name="console.sampling"
    )
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
