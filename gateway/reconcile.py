"""Settling UNKNOWN effects by asking the downstream, once or in the background.

``reconcile`` is the one path: it takes the effect's probe lease in the store (so two
gateways never probe one effect at once), sends the downstream's probe, and records what the
answer means (found -> COMMITTED with the probe's answer stored for replay; absent ->
NOT_APPLIED, so the same payload may go again under the same key, but only once no earlier
forward can still land: before the downstream's ``settle_ms`` has passed since the
gateway stopped waiting for it, "absent" counts as inconclusive; anything else -> still
UNKNOWN, probed again later with backoff). The API's ``/reconcile``, the proxy (when an agent
retries an UNKNOWN effect of a probe downstream) and the background ``Reconciler`` call it.

The ``Reconciler`` also writes down PREPARED records whose deadline passed as UNKNOWN, so
the ledger's stored state catches up with what reads already show.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import structlog
from aiohttp import web
from yarl import URL

from fencegate.adapters import ProbeAdapter
from fencegate.adapters.kinds import UnsafeProbePath
from fencegate.gateway import tracing
from fencegate.gateway.forward import Bound, ForwardFailed, Limits, read_up_to, send
from fencegate.gateway.http_rules import stored_response_headers
from fencegate.gateway.proxy_decisions import next_step
from fencegate.gateway.state import ADAPTERS, CONFIG, STORE
from fencegate.ledger import effects
from fencegate.ledger.effects import Effect, EffectState, ProbeVerdict
from fencegate.ledger.errors import EffectInFlight, EffectUnknown, FencegateError
from fencegate.ledger.responses import response_json
from fencegate.ledger.store import new_id

__all__ = ["Reconciler", "reconcile"]

log = structlog.get_logger("fencegate.reconcile")

#: The largest probe answer kept (and replayed when the probe finds the effect); a longer
#: one is judged by its status and stored without its body.
_PROBE_BODY_LIMIT = 64 * 1024
_PROBE_BODY_OMITTED = f"probe answer over {_PROBE_BODY_LIMIT} bytes"
#: Slack on top of the probe's timeout for the probe lease.
_LEASE_SLACK_MS = 5_000


async def _probe(app: web.Application, adapter: ProbeAdapter, effect: Effect
                 ) -> tuple[ProbeVerdict, str | None, str]:  # fmt: skip
    spec = adapter.probe
    assert spec is not None
    downstream = app[CONFIG].downstream(effect.downstream)
    assert downstream is not None
    try:
        url = URL(downstream.url + adapter.probe_path(effect), encoded=False)
    except UnsafeProbePath as exc:
        # Never sent: an "absent" from some other path would let the effect go out again.
        return ProbeVerdict.INCONCLUSIVE, None, f"probe not sent: {exc}"
    limits = Limits(Bound.of(f"downstreams.{downstream.name}.probe.timeout_ms", spec.timeout_ms))
    try:
        async with send(
            app,
            downstream.name,
            spec.method,
            url,
            limits,
            headers=adapter.outbound_headers(effect.effect_id, None),
            purpose="probe",
            effect_id=effect.effect_id,
        ) as resp:
            # Read to the end (an answer may come in many pieces), up to the bound.
            raw, whole = await read_up_to(resp.content, _PROBE_BODY_LIMIT)
            status = resp.status
            # The same rule as a forward's stored answer (credential names and values).
            headers = stored_response_headers(
                resp.headers.items(),
                downstream.unstored_headers,
                adapter.outbound_headers(None, None).values(),
            )
    except ForwardFailed as failed:
        return ProbeVerdict.INCONCLUSIVE, None, f"probe failed: {failed.failure.reason}"
    if not whole or len(raw) > _PROBE_BODY_LIMIT:
        # Too long to keep: judged by its status alone (a json_field cannot be read, so
        # that reads inconclusive) and stored without a body, never cut short.
        verdict = adapter.verdict(status, None)
        answer = response_json(
            status, headers, None, source="probe", omitted_reason=_PROBE_BODY_OMITTED
        )
        return verdict, answer, f"probe answered {status} (body over {_PROBE_BODY_LIMIT} bytes)"
    body: Any = None
    with contextlib.suppress(ValueError):
        body = json.loads(raw) if raw else None
    verdict = adapter.verdict(status, body)
    answer = response_json(status, headers, raw, source="probe")
    return verdict, answer, f"probe answered {status}"


async def reconcile(
    app: web.Application, effect_id: str, actor: str, *, only_if_due: bool = False
) -> Effect:
    """Probe one effect if it is UNKNOWN and its downstream can be asked; returns the record.
    ``only_if_due`` (an agent's retry) leaves an effect alone until its next probe is due, so
    a retrying agent cannot make the gateway hammer the downstream or grow the record.

    With ``[tracing]`` one span (``fencegate.reconcile``) holds its store steps and its
    probe's CLIENT span: the request's child inline, a trace of its own in the background."""
    with tracing.step(app, "fencegate.reconcile", **{"fencegate.effect_id": effect_id,
                                                     "fencegate.actor": actor}):  # fmt: skip
        return await _reconcile(app, effect_id, actor, only_if_due=only_if_due)


async def _reconcile(
    app: web.Application, effect_id: str, actor: str, *, only_if_due: bool
) -> Effect:
    store = app[STORE]
    effect = await store.get_effect(effect_id)
    if effect.state is not EffectState.UNKNOWN:
        return effect
    due_at = effect.next_probe_at
    if only_if_due and due_at is not None and await store.now_ms() < due_at:
        return effect
    adapter = app[ADAPTERS].get(effect.downstream)
    if not isinstance(adapter, ProbeAdapter) or adapter.probe is None:
        # A downstream no longer configured cannot be asked either: an operator settles it.
        step = next_step("EFFECT_UNKNOWN", effect_id, adapter.kind if adapter else "removed")
        raise EffectUnknown(
            f"downstream {effect.downstream!r} has no probe; an operator settles this effect "
            f"with POST /v1/effects/{effect_id}/resolve. Next: {step}",
            effectId=effect_id,
            effectState=effect.state.value,
        )
    holder = f"{actor}:{new_id()[:12]}"
    lease_ms = adapter.probe.timeout_ms + _LEASE_SLACK_MS
    settle_ms = adapter.settle_ms_for(effect.path)
    try:
        effect = await store.update_effect(
            effect_id, lambda record, now: effects.begin_probe(record, holder, lease_ms, now)
        )
    except EffectInFlight:
        if not only_if_due:
            raise
        # An agent's retry met another reconciler's probe (or a new forward): it is answered
        # from the record as it is, still UNKNOWN (retry later) or moved on, never "in
        # flight" for an effect whose outcome is simply not known yet.
        return await store.get_effect(effect_id)
    asked_at = effect.updated_at  # the store's instant when the probe lease was taken
    verdict, answer, reason = await _probe(app, adapter, effect)
    effect = await store.update_effect(
        effect_id,
        lambda record, now: effects.finish_probe(
            record,
            holder,
            verdict,
            answer,
            adapter.retry_in_ms(record.probe_count if record else 0),
            actor,
            now,
            settle_ms,
            asked_at,
        ),
    )
    tracing.note(**{"fencegate.outcome": effect.state.value.lower(),
                    "fencegate.probe_verdict": verdict.value})  # fmt: skip
    log.info(
        "effect.reconciled",
        effect_id=effect_id,
        task=effect.task_id,
        downstream=effect.downstream,
        payload_digest=effect.payload_digest,
        verdict=verdict.value,
        state=effect.state.value,
        by=actor,
        reason=reason,
    )
    return effect


class Reconciler:
    """The background loop: one sweep every ``reconciler.interval_ms``, bounded per sweep."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self.actor = f"reconciler:{new_id()[:8]}"

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop between sweeps, or cancel a sweep in progress; never hang the shutdown (a
        driver that swallows a cancellation must not keep the gateway from exiting)."""
        self._stopping.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                async with asyncio.timeout(5):
                    await self._task

    async def _run(self) -> None:
        interval = self.app[CONFIG].reconciler.interval_ms / 1000
        while not self._stopping.is_set():
            try:
                await self.sweep()
            except FencegateError as exc:
                log.warning("reconciler.sweep_failed", code=exc.code, reason=exc.detail)
            except Exception:
                log.exception("reconciler.sweep_crashed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._stopping.wait()

    async def sweep(self) -> int:
        """Expire overdue PREPARED records and probe the UNKNOWN effects that are due;
        returns how many records it changed."""
        store = self.app[STORE]
        budget = self.app[CONFIG].reconciler.max_effects_per_sweep
        now = await store.now_ms()
        changed = 0
        # The store's own indexes name the unsettled effects: the sweep's cost follows the
        # backlog, not the size of the ledger.
        probe_downstreams = frozenset(
            name for name, adapter in self.app[ADAPTERS].items()
            if isinstance(adapter, ProbeAdapter)
        )  # fmt: skip
        for effect in await store.unsettled_effects(budget, probe_downstreams):
            changed += await self._settle(effect, now)
        return changed

    async def _settle(self, effect: Effect, now: int) -> int:
        store = self.app[STORE]
        changed = 0
        last = effect.attempts[-1] if effect.attempts else None
        if last is not None and last.reason == effects.DEADLINE_REASON:
            try:
                await store.update_effect(effect.effect_id, effects.expire)
                log.info("effect.expired", effect_id=effect.effect_id, task=effect.task_id,
                         downstream=effect.downstream)  # fmt: skip
                changed += 1
            except FencegateError:
                pass  # already written down, or settled meanwhile
        adapter = self.app[ADAPTERS].get(effect.downstream)
        due = effect.next_probe_at is None or effect.next_probe_at <= now
        free = effect.probe_until is None or effect.probe_until <= now
        if isinstance(adapter, ProbeAdapter) and due and free:
            try:
                await reconcile(self.app, effect.effect_id, self.actor)
                changed += 1
            except FencegateError as exc:
                log.info("reconciler.skipped", effect_id=effect.effect_id, code=exc.code,
                         reason=exc.detail)  # fmt: skip
        return changed
