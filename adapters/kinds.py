"""The downstream kinds beyond plain ``http``: each changes one or two answers of the seam.

* ``idempotent`` (Stripe-style: the downstream deduplicates on the idempotency key within a
  window): an UNKNOWN effect with the same payload is re-sent under its ORIGINAL key, inside
  the window only, because the downstream then answers the first outcome instead of acting
  twice. Outside the window it stays EFFECT_UNKNOWN.
* ``probe``: UNKNOWN effects are settled by asking the downstream (``ProbeAdapter.verdict``);
  see ``gateway/reconcile.py``.
* ``conditional``: the request's preconditions (``If-Match``, ``If-None-Match``) are part of
  the payload, so re-sending the same payload after UNKNOWN cannot apply it twice, provided
  the precondition fails once the request was applied: only requests whose strong
  ``If-Match`` or ``If-None-Match: *`` reaches the downstream are ever re-sent
  (``adapters/preconditions.py``); any other is a plain ``http`` effect. A 412 to a
  forward that follows an UNKNOWN attempt means the earlier attempt landed, and is recorded as
  COMMITTED. A 412 to a first forward is the downstream's real answer (also COMMITTED, and
  replayed). See docs/adapters.md for exactly which 412s mean what.
* ``manual`` (NON_REPLAYABLE: email, SMS, third-party webhooks): never re-sent, settled only
  by an operator, and with ``require_approval`` every forward waits for an operator's
  approval of its exact payload digest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from fencegate.adapters.http import HttpAdapter
from fencegate.adapters.paths import escapes_base
from fencegate.adapters.preconditions import makes_resend_safe
from fencegate.ledger.effects import Effect, EffectState, ProbeVerdict

__all__ = [
    "ALWAYS_MS",
    "ConditionalAdapter",
    "IdempotentAdapter",
    "ManualAdapter",
    "ProbeAdapter",
    "ProbeSpec",
    "UnsafeProbePath",
    "expand_probe_path",
]

#: A re-send window that never closes (preconditions make every re-send safe).
ALWAYS_MS = 2**53 - 1


@dataclass(frozen=True)
class IdempotentAdapter(HttpAdapter):
    dedupe_window_ms: int = 24 * 3600 * 1000

    @property
    def kind(self) -> str:
        return "idempotent"

    def resend_window_ms(self, preconditions: Sequence[tuple[str, str]]) -> int | None:
        return self.dedupe_window_ms


@dataclass(frozen=True)
class ProbeSpec:
    method: str
    path: str
    found_statuses: frozenset[int]
    absent_statuses: frozenset[int]
    json_field: str | None
    found_values: tuple[str | int | bool, ...]
    absent_values: tuple[str | int | bool, ...]
    timeout_ms: int
    interval_ms: int
    max_interval_ms: int


class UnsafeProbePath(ValueError):
    """The expanded probe path would not stay under the downstream's base path (a ``.`` or
    ``..`` segment): no probe is sent, and the probe counts as inconclusive."""


def expand_probe_path(template: str, values: dict[str, str | int]) -> str:
    """RFC 6570 simple expansion of a probe path template: each placeholder's value is
    percent-encoded except unreserved characters (``A-Z a-z 0-9 - . _ ~``), so ``/``, ``?``,
    ``#`` and ``%`` in a slot, node or task id never become structure. The result must not
    hold a ``.`` or ``..`` path segment (plain or percent-encoded: servers normalise both),
    so a probe never leaves the downstream's base path; such a path raises
    ``UnsafeProbePath``. Pure: ``tests/test_probe_template.py``."""
    encoded = {name: quote(str(value), safe="") for name, value in values.items()}
    path = template.format(**encoded)
    for segment in path.split("?", 1)[0].split("#", 1)[0].split("/"):
        if escapes_base(segment):  # the proxy's rule (adapters/paths.py): ..; %252e %u002e
            raise UnsafeProbePath(f"probe path {path!r} has a {segment!r} segment")
    return path


def _field(body: Any, dotted: str) -> Any:
    node = body
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


@dataclass(frozen=True)
class ProbeAdapter(HttpAdapter):
    probe: ProbeSpec | None = None

    @property
    def kind(self) -> str:
        return "probe"

    def probe_path(self, effect: Effect) -> str:
        """The probe's path and query for ``effect``, still percent-encoded (see
        ``expand_probe_path``; raises ``UnsafeProbePath``). A keyed effect has no task,
        revision, node or slot, a leased one no ``idempotencyKey`` (the client's key): a
        template naming what the effect lacks sends no probe (``UnsafeProbePath``;
        the config refuses such templates where keys are on)."""
        assert self.probe is not None
        values = {
            "effectId": effect.effect_id,
            "taskId": effect.task_id,
            "slot": effect.slot,
            "node": effect.node,
            "revision": effect.revision,
            "idempotencyKey": effect.idempotency_key,
        }
        try:
            return expand_probe_path(
                self.probe.path, {k: v for k, v in values.items() if v is not None}
            )
        except KeyError as exc:
            raise UnsafeProbePath(
                f"probe path {self.probe.path!r} names {{{exc.args[0]}}}, which this "
                f"{effect.kind} effect has none of"
            ) from exc

    def verdict(self, status: int, body: Any) -> ProbeVerdict:
        """What one probe answer says. Pure, so every rule is tested without a socket."""
        spec = self.probe
        assert spec is not None
        if status in spec.absent_statuses:
            return ProbeVerdict.ABSENT
        if status not in spec.found_statuses:
            return ProbeVerdict.INCONCLUSIVE
        if spec.json_field is None:
            return ProbeVerdict.FOUND
        value = _field(body, spec.json_field)
        if value is None or isinstance(value, dict | list):
            return ProbeVerdict.INCONCLUSIVE
        if value in spec.found_values:
            return ProbeVerdict.FOUND
        if value in spec.absent_values:
            return ProbeVerdict.ABSENT
        return ProbeVerdict.INCONCLUSIVE

    def retry_in_ms(self, probes_so_far: int) -> int:
        assert self.probe is not None
        delay: int = self.probe.interval_ms * 2 ** min(probes_so_far, 30)
        return min(delay, self.probe.max_interval_ms)


@dataclass(frozen=True)
class ConditionalAdapter(HttpAdapter):
    @property
    def kind(self) -> str:
        return "conditional"

    def resend_window_ms(self, preconditions: Sequence[tuple[str, str]]) -> int | None:
        # Only a precondition that fails once the request was applied makes a second delivery
        # harmless (the downstream refuses it with 412): a strong If-Match or If-None-Match: *
        # that reaches the downstream (``makes_resend_safe``). Anything else: never re-sent.
        return ALWAYS_MS if makes_resend_safe(preconditions) else None

    @property
    def digest_headers(self) -> tuple[str, ...]:
        return ("If-Match", "If-None-Match")

    def default_outcome(self, status: int, effect: Effect) -> tuple[EffectState, str]:
        earlier = effect.attempts[:-1]
        if status == 412 and any(a.outcome == EffectState.UNKNOWN.value for a in earlier):
            return (
                EffectState.COMMITTED,
                "status 412 after an UNKNOWN attempt: the earlier attempt landed",
            )
        return super().default_outcome(status, effect)


@dataclass(frozen=True)
class ManualAdapter(HttpAdapter):
    approval_required: bool = False
    approval_ttl_ms: int = 3600 * 1000

    @property
    def kind(self) -> str:
        return "manual"

    @property
    def require_approval(self) -> bool:
        return self.approval_required

    def approval_ttl(self, path: str) -> int | None:
        return self.approval_ttl_ms if self.approval_required else None
