"""The adapter seam: what differs between downstreams, behind one small protocol.

The proxy asks an adapter three things: which headers carry the effect's identity, how a
response status maps to an outcome, and whether an UNKNOWN effect may go again by itself.
Everything else (fencing, the ledger, forwarding) is the same for every downstream.
"""

from __future__ import annotations

from typing import Protocol

from ledger.effects import EffectState

__all__ = ["Adapter"]


class Adapter(Protocol):
    @property
    def kind(self) -> str:
        """The ``adapter`` config value that selects this kind."""
        ...

    @property
    def resend_unknown(self) -> bool:
        """May an UNKNOWN effect with the same payload be forwarded again under its original
        idempotency key? Only where the downstream deduplicates on that key."""
        ...

    def classify(self, status: int) -> EffectState:
        """The outcome a response status means for this downstream."""
        ...

    def identity_headers(self, effect_id: str, fencing_token: str) -> dict[str, str]:
        """Headers that carry the effect's identity and the fencing token downstream."""
        ...
