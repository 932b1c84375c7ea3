"""Which adapter serves a downstream: built once at start-up from its config table."""

from __future__ import annotations

import os
from typing import Any

from fencegate.adapters import (
    Adapter,
    ConditionalAdapter,
    HttpAdapter,
    IdempotentAdapter,
    ManualAdapter,
    ProbeAdapter,
    ProbeSpec,
)
from fencegate.adapters.mcp import McpAdapter, ToolOverride
from fencegate.gateway.config import DownstreamConfig
from fencegate.ledger.effects import EffectState

__all__ = ["build_adapter"]


def build_adapter(downstream: DownstreamConfig) -> Adapter:
    """The adapter a downstream's config asks for, with its credentials read from the
    environment now (``load_config`` has already checked that each variable is set)."""
    overrides: dict[int, EffectState] = {}
    for name, state in (
        ("committed", EffectState.COMMITTED),
        ("not_applied", EffectState.NOT_APPLIED),
        ("unknown", EffectState.UNKNOWN),
    ):
        for status in getattr(downstream.outcomes, name):
            overrides[status] = state
    credentials = {h: os.environ[v] for h, v in downstream.headers_from_env.items()}

    def make(cls: type[HttpAdapter], **options: Any) -> HttpAdapter:
        return cls(
            idempotency_key_header=downstream.idempotency_key_header,
            fencing_token_header=downstream.fencing_token_header,
            credentials=credentials,
            overrides=overrides,
            settle_ms=downstream.settle_ms,
            **options,
        )

    if downstream.adapter == "http":
        return make(HttpAdapter)
    if downstream.adapter == "idempotent":
        assert downstream.dedupe_window_ms is not None
        return make(IdempotentAdapter, dedupe_window_ms=downstream.dedupe_window_ms)
    if downstream.adapter == "probe":
        p = downstream.probe
        assert p is not None
        spec = ProbeSpec(
            method=p.method,
            path=p.path,
            found_statuses=frozenset(p.found_statuses),
            absent_statuses=frozenset(p.absent_statuses),
            json_field=p.json_field,
            found_values=p.found_values,
            absent_values=p.absent_values,
            timeout_ms=p.timeout_ms,
            interval_ms=p.interval_ms,
            max_interval_ms=p.max_interval_ms,
        )
        return make(ProbeAdapter, probe=spec)
    if downstream.adapter == "conditional":
        return make(ConditionalAdapter)
    if downstream.adapter == "mcp":
        tools = {
            name: ToolOverride(
                t.kind,
                t.dedupe_window_ms,
                t.require_approval,
                t.timeout_ms,
                frozenset(t.not_applied_codes),
                t.approval_ttl_ms,
                settle_ms=t.settle_ms,
            )
            for name, t in downstream.tools.items()
        }
        return make(McpAdapter, tools=tools, trust_annotations=downstream.trust_annotations)
    return make(
        ManualAdapter,
        approval_required=downstream.require_approval,
        approval_ttl_ms=downstream.approval_ttl_ms,
    )
