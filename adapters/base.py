"""The adapter seam: what differs between downstreams, behind one small protocol.

The gateway asks an adapter what the effect of a request is (its slot and the payload digest
the ledger binds it to), what goes out with the forward (headers: the effect's identity, the
gateway-held credentials; the body, which may carry the identity too), what an answer means
for the effect (from its status and its body), how a stored answer is replayed to a new
request, and three policies the atomic prepare step applies (may an UNKNOWN effect go again by
itself, for how long; does every forward need an operator's approval). Fencing, the ledger and
the I/O of forwarding are the same for every downstream (``gateway/proxy.py`` for HTTP kinds,
``gateway/mcp.py`` for MCP's transport); a kind that can tell whether an effect happened also
probes (``ProbeAdapter``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from fencegate.ledger.effects import Effect, EffectState

__all__ = ["Adapter", "Answer", "EffectShape", "Outgoing"]


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One request of an agent, as an adapter sees it (parsed and bounded by the gateway)."""

    method: str
    downstream: str
    #: The downstream-relative path with its query (``/v1/charges?x=1``).
    path: str
    headers: Sequence[tuple[str, str]]
    body: bytes
    #: ``Fence-Slot`` (None when the request carries none).
    slot: str | None = None

    def header(self, name: str) -> str:
        lower = name.lower()
        return next((v for k, v in self.headers if k.lower() == lower), "")


@dataclass(frozen=True, slots=True)
class EffectShape:
    """What the ledger binds an effect to: its slot, and what the payload digest covers."""

    slot: str
    method: str
    path: str
    payload_digest: str
    #: The request's values of ``digest_headers`` that reach the downstream (what a re-send
    #: may depend on; the digest covers all that were sent).
    preconditions: tuple[tuple[str, str], ...] = ()
    #: What an operator's approval names (``ledger.effects.approval_digest``: the payload
    #: digest and the effect-changing headers that reach the downstream); None: the payload
    #: digest itself (no such header, or a kind whose headers change nothing: ``mcp``).
    approval_digest: str | None = None


@dataclass(frozen=True, slots=True)
class Answer:
    """A replayed answer: status, headers and body (None: not stored, say so)."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes | None


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

    def approval_ttl(self, path: str) -> int | None:
        """How long an operator's approval of an effect at ``path`` stays usable; None when
        it takes none (``manual`` with ``require_approval``; an MCP tool configured so)."""
        ...

    def settle_ms_for(self, path: str) -> int:
        """How long after the gateway stopped waiting for a forward of an effect at ``path``
        the downstream may still apply it (``settle_ms``: its queue, its retries). Until
        then neither a probe's "absent" nor an operator's NOT_APPLIED is believed."""
        ...

    def classify(self, status: int, effect: Effect) -> tuple[EffectState, str]:
        """The outcome a response status means for this effect, and why."""
        ...

    def effect_of(self, request: Outgoing) -> EffectShape:
        """The effect a request asks for; ``BadRequest`` when it names none."""
        ...

    def outbound_body(self, body: bytes, effect_id: str, fencing_token: str) -> bytes:
        """The body a recorded forward sends (an MCP call carries its identity in it)."""
        ...

    def outcome(self, status: int, body: bytes | None, effect: Effect) -> tuple[EffectState, str]:
        """What an answer (its status, and its body when read whole) means for the effect."""
        ...

    def replay(self, effect: Effect, request: Outgoing) -> Answer:
        """The stored answer of a COMMITTED effect, as a duplicate ``request`` gets it."""
        ...

    def outbound_headers(self, effect_id: str | None, fencing_token: str | None) -> dict[str, str]:
        """Headers the gateway sets on a request to this downstream: credentials always, the
        effect's identity and the fencing token for recorded effects."""
        ...
