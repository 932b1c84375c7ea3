"""The adapter seam: what differs between downstreams, behind one small protocol.

The proxy asks an adapter: which headers go out (the effect's identity, the gateway-held
credentials), which request headers are part of the payload, how a response maps to an
outcome, and three policies the atomic prepare step applies (may an UNKNOWN effect go again
by itself, for how long; does every forward need an operator's approval). Everything else
(fencing, the ledger, forwarding) is the same for every downstream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from fencegate.ledger.effects import Effect, EffectState

__all__ = ["Adapter"]


class Adapter(Protocol):
    @property
    def kind(self) -> str:
        """The ``adapter`` config value that selects this kind."""
        ...

    def resend_window_ms(self, preconditions: Sequence[tuple[str, str]]) -> int | None:
        """How long after its first forward an UNKNOWN effect with the same payload may be
        forwarded again under its original key by itself (None: never). ``preconditions``
        are the request's values of ``digest_headers``: a re-send may depend on them."""
        ...

    @property
    def require_approval(self) -> bool:
        """Does every forward wait for an operator's approval of its exact payload digest?"""
        ...

    @property
    def digest_headers(self) -> tuple[str, ...]:
        """Request headers that are part of the payload (e.g. preconditions)."""
        ...

    def classify(self, status: int, effect: Effect) -> tuple[EffectState, str]:
        """The outcome a response status means for this effect, and why."""
        ...

    def outbound_headers(self, effect_id: str | None, fencing_token: str | None) -> dict[str, str]:
        """Headers the gateway sets on a request to this downstream: credentials always, the
        effect's identity and the fencing token for recorded effects."""
        ...
