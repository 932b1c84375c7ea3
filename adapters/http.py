"""The plain ``http`` adapter: the contract's default behaviour.

Every forward carries the effectId as its idempotency key and the fencing token; a response
is COMMITTED, except 500, 502 and 504, which say nothing certain about whether the effect
happened and so are UNKNOWN. An UNKNOWN effect is never re-sent by this adapter: only an
operator (or a downstream-specific adapter) can settle it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ledger.effects import EffectState

__all__ = ["UNKNOWN_STATUSES", "HttpAdapter"]

#: Statuses after which the effect may or may not have happened.
UNKNOWN_STATUSES = frozenset({500, 502, 504})


@dataclass(frozen=True, slots=True)
class HttpAdapter:
    idempotency_key_header: str = "Idempotency-Key"
    fencing_token_header: str = "Fencing-Token"
    kind: str = "http"

    @property
    def resend_unknown(self) -> bool:
        return False

    def classify(self, status: int) -> EffectState:
        return EffectState.UNKNOWN if status in UNKNOWN_STATUSES else EffectState.COMMITTED

    def identity_headers(self, effect_id: str, fencing_token: str) -> dict[str, str]:
        return {
            self.idempotency_key_header: effect_id,
            self.fencing_token_header: fencing_token,
        }
