"""Per-downstream behaviour behind one small protocol (``adapters.base.Adapter``).

The adapters know nothing of the gateway's config: ``fencegate.gateway.downstreams`` builds
one from a ``[[downstreams]]`` table."""

from __future__ import annotations

from fencegate.adapters.base import Adapter
from fencegate.adapters.http import HttpAdapter
from fencegate.adapters.kinds import (
    ConditionalAdapter,
    IdempotentAdapter,
    ManualAdapter,
    ProbeAdapter,
    ProbeSpec,
)

__all__ = [
    "Adapter",
    "ConditionalAdapter",
    "HttpAdapter",
    "IdempotentAdapter",
    "ManualAdapter",
    "ProbeAdapter",
    "ProbeSpec",
]
