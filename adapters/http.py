"""The plain ``http`` adapter: the contract's default behaviour, and the base of the others.

Every forward carries the effectId as its idempotency key and the fencing token. What a
response status means, unless the downstream's ``outcomes`` table says otherwise (it wins
over these defaults, per status):

* 500, 502, 503 and 504 are UNKNOWN: they say nothing certain about whether the effect
  happened (a 503 may come from a downstream that had already started on the request).
* 429 is NOT_APPLIED: the downstream refused the request before processing it (rate limit),
  so the same payload may go again.
* Every other status is COMMITTED and its response is replayed to duplicates.

An UNKNOWN effect is never re-sent by this adapter: only an operator (or a kind that can
prove it safe) settles it. A NOT_APPLIED answer after an earlier attempt that may have
executed leaves the effect UNKNOWN (the ledger's rule, not the adapter's).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fencegate.adapters.base import Answer, EffectShape, Outgoing
from fencegate.adapters.preconditions import reaching
from fencegate.ledger.effects import (
    DEFAULT_SETTLE_MS,
    Effect,
    EffectState,
    approval_digest,
    payload_digest,
)
from fencegate.ledger.errors import BadRequest
from fencegate.ledger.payloads import canonical_body

__all__ = ["NOT_APPLIED_STATUSES", "UNKNOWN_STATUSES", "HttpAdapter"]

#: Statuses after which the effect may or may not have happened.
UNKNOWN_STATUSES = frozenset({500, 502, 503, 504})
#: Statuses that refuse the request before it was processed: nothing happened.
NOT_APPLIED_STATUSES = frozenset({429})


@dataclass(frozen=True)
class HttpAdapter:
    idempotency_key_header: str = "Idempotency-Key"
    fencing_token_header: str = "Fencing-Token"
    #: Header -> value, resolved from the environment at start-up.
    credentials: Mapping[str, str] = field(default_factory=dict)
    #: Status -> outcome, from the downstream's ``outcomes`` table.
    overrides: Mapping[int, EffectState] = field(default_factory=dict)
    #: The downstream's ``settle_ms`` (``settle_ms_for``).
    settle_ms: int = DEFAULT_SETTLE_MS

    @property
    def kind(self) -> str:
        return "http"

    def resend_window_ms(self, preconditions: Sequence[tuple[str, str]]) -> int | None:
        return None

    @property
    def require_approval(self) -> bool:
        return False

    @property
    def digest_headers(self) -> tuple[str, ...]:
        return ()

    def approval_ttl(self, path: str) -> int | None:
        """How long an operator's approval of an effect at ``path`` stays usable; None when
        this downstream's effects take no approval (the approve endpoint refuses them)."""
        return None

    def settle_ms_for(self, path: str) -> int:
        """How long a forward may still land after the gateway stopped waiting for it: the
        downstream's ``settle_ms``, whatever the path."""
        return self.settle_ms

    def default_outcome(self, status: int, effect: Effect) -> tuple[EffectState, str]:
        if status in UNKNOWN_STATUSES:
            return EffectState.UNKNOWN, f"status {status}"
        if status in NOT_APPLIED_STATUSES:
            return EffectState.NOT_APPLIED, f"status {status}: refused before it was processed"
        return EffectState.COMMITTED, f"status {status}"

    def classify(self, status: int, effect: Effect) -> tuple[EffectState, str]:
        if status in self.overrides:
            return self.overrides[status], f"status {status} (configured outcome)"
        return self.default_outcome(status, effect)

    def outbound_headers(self, effect_id: str | None, fencing_token: str | None) -> dict[str, str]:
        headers = dict(self.credentials)
        if effect_id is not None:
            headers[self.idempotency_key_header] = effect_id
        if fencing_token is not None:
            headers[self.fencing_token_header] = fencing_token
        return headers

    def effect_of(self, request: Outgoing) -> EffectShape:
        """The request itself: method, path and query, the canonical body, and the values of
        ``digest_headers`` (preconditions are part of what a request does). The digest covers
        them as the agent sent them (unchanged since they were introduced); the shape's
        ``preconditions`` are those that reach the downstream (``preconditions.reaching``:
        not stripped as hop-by-hop by the agent's ``Connection``, not set by the gateway),
        the only ones a re-send may count on."""
        if request.slot is None:
            raise BadRequest("Fence-Slot: header is required")
        path = request.path or "/"
        preconditions: list[tuple[str, str]] | None = None
        if self.digest_headers:
            preconditions = [
                (name, value)
                for name in self.digest_headers
                for key, value in request.headers
                if key.lower() == name.lower()
            ]
        digest = payload_digest(
            request.method,
            request.downstream,
            path,
            canonical_body(request.body, request.header("Content-Type")),
            preconditions,
        )
        gateway_set = self.outbound_headers("", "")
        sent = reaching(preconditions or (), request.headers, gateway_set)
        # What an approval covers: the payload and the effect-changing headers that go out.
        approval = approval_digest(digest, reaching(request.headers, request.headers, gateway_set))
        return EffectShape(request.slot, request.method, path, digest, sent, approval)

    def outbound_body(self, body: bytes, effect_id: str, fencing_token: str) -> bytes:
        return body  # the identity goes in headers (``outbound_headers``)

    def outcome(self, status: int, body: bytes | None, effect: Effect) -> tuple[EffectState, str]:
        return self.classify(status, effect)  # an HTTP answer's status says it

    def replay(self, effect: Effect, request: Outgoing) -> Answer:
        """The stored status, headers and body; ``body`` None when none was stored (an
        operator settled it knowing no answer: status 204; over ``replay_max_bytes`` or
        ``store_response_body = false``: the stored status and headers)."""
        if effect.response_json is None:
            return Answer(204, (), None)
        stored = json.loads(effect.response_json)
        headers = tuple((str(k), str(v)) for k, v in stored.get("headers", []))
        body = base64.b64decode(stored["bodyBase64"]) if "bodyBase64" in stored else None
        return Answer(int(stored.get("status", 200)), headers, body)
