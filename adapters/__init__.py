"""Per-downstream behaviour behind one small protocol (``adapters.base.Adapter``)."""

from __future__ import annotations

from adapters.base import Adapter
from adapters.http import HttpAdapter
from gateway.config import DownstreamConfig

__all__ = ["Adapter", "build_adapter"]


def build_adapter(downstream: DownstreamConfig) -> Adapter:
    """The adapter a downstream's config asks for."""
    if downstream.adapter == "http":
        return HttpAdapter(
            idempotency_key_header=downstream.idempotency_key_header,
            fencing_token_header=downstream.fencing_token_header,
        )
    raise ValueError(f"downstream {downstream.name!r}: unknown adapter {downstream.adapter!r}")
