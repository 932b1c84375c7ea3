"""Per-principal limits: a token bucket on request rate and a cap on requests in flight.

Both are per gateway process (two gateways behind a balancer each allow the full rate) and
pure: the bucket reads time only from the clock it is given, so tests drive it by hand.
``gateway/auth.py`` applies them after authentication and the scope check; a refusal is 429
``RATE_LIMITED`` with ``Retry-After`` (docs/security.md, "Scopes and limits").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["NO_LIMITS", "Clock", "Limits", "OpenRequests", "TokenBucket", "retry_after_seconds"]

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Limits:
    """What ``[[auth.principals]]`` sets: None is unlimited."""

    rate_per_second: float | None = None
    burst: int | None = None
    max_open_requests: int | None = None


#: A principal without any limit.
NO_LIMITS = Limits()


class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` per second; each request takes one.

    ``take()`` answers 0.0 when the request may go (a token was taken), else the seconds until
    one token will be there (nothing taken).
    """

    def __init__(self, rate: float, burst: int, clock: Clock = time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()

    def _refill(self) -> None:
        now = self._clock()
        elapsed = max(now - self._at, 0.0)  # a clock that steps back adds nothing
        self._tokens = min(float(self.burst), self._tokens + elapsed * self.rate)
        self._at = now

    @property
    def tokens(self) -> float:
        self._refill()
        return self._tokens

    def take(self) -> float:
        self._refill()
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.rate


@dataclass(slots=True)
class OpenRequests:
    """Requests of one principal in flight now, against ``limit`` (None: no cap)."""

    limit: int | None
    count: int = field(default=0)

    def enter(self) -> bool:
        if self.limit is not None and self.count >= self.limit:
            return False
        self.count += 1
        return True

    def leave(self) -> None:
        self.count = max(self.count - 1, 0)


def retry_after_seconds(wait: float) -> int:
    """``Retry-After`` (whole seconds, at least 1) for a wait of ``wait`` seconds."""
    return max(1, math.ceil(wait))
