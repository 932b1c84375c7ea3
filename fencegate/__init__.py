"""fencegate: the agent SDK of the fencing gateway (async, aiohttp).

    from fencegate import Client, LeaseLost

    async with Client("http://127.0.0.1:8700") as client:
        await client.put_task("invoice-42", input_digest="sha256:9f2c")
        try:
            async with client.claim("invoice-42", owner="worker-a", ttl_ms=3000) as lease:
                charge = await lease.request(
                    "payments", "POST", "/v1/charges", slot="charge", json={"amount": 4200}
                )
                await lease.commit({"charge": charge.json()})
        except LeaseLost as lost:
            ...  # someone else owns the task now; nothing more was sent under this lease

A client with no task queue (a chat agent) sends a call at most once by its idempotency key,
without any lease::

    charge = await client.request(
        "payments", "POST", "/v1/charges", idempotency_key="order-7", json={"amount": 4200}
    )

``Client`` is the connection to one gateway (scheduler, worker, client and operator calls);
``Lease`` is one claim (``fencegate.lease``); every refusal of the gateway is a typed
exception (``fencegate.errors``). An MCP client calls tools under a lease through
``/mcp/{downstream}`` with ``lease.mcp_headers()`` on its transport and ``mcp_meta(slot)`` on
a call. ``fencegate demo`` plays the whole story against a real gateway. See docs/sdk.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fencegate.client import Client, Epoch, StreamEvent, TaskRecord
    from fencegate.errors import (
        AlreadyCommitted,
        ApprovalRequired,
        AuthUnavailable,
        BadRequest,
        Cancelled,
        Claimed,
        ClaimRefused,
        ClaimsPaused,
        ClientTimeout,
        Conflict,
        DependenciesPending,
        DownstreamBusy,
        DownstreamTimeout,
        DownstreamUnreachable,
        EffectExpired,
        EffectInFlight,
        EffectSettled,
        EffectUnknown,
        EventsGone,
        Fenced,
        FencegateError,
        Forbidden,
        GatewayUnreachable,
        HttpVersionNotSupported,
        IdempotencyKeyRequired,
        InternalError,
        LeaseExpired,
        LeaseLost,
        MethodNotAllowed,
        MisdirectedRequest,
        NoSuchDownstream,
        NoSuchEffect,
        NoSuchTask,
        NotFound,
        PayloadConflict,
        PayloadTooLarge,
        ProblemError,
        RateLimited,
        RequestTimeout,
        RuntimeExceeded,
        StaleEpoch,
        StaleInput,
        StoreUnavailable,
        TaskExpired,
        TooManyConnections,
        Unauthenticated,
        Unavailable,
        UnsupportedMediaType,
    )
    from fencegate.lease import (
        ClaimScope,
        Commit,
        Lease,
        ProxyResponse,
        canonical_json,
        mcp_meta,
        result_digest,
        wait_out_in_flight,
    )

__all__ = [
    "AlreadyCommitted",
    "ApprovalRequired",
    "AuthUnavailable",
    "BadRequest",
    "Cancelled",
    "ClaimRefused",
    "ClaimScope",
    "Claimed",
    "ClaimsPaused",
    "Client",
    "ClientTimeout",
    "Commit",
    "Conflict",
    "DependenciesPending",
    "DownstreamBusy",
    "DownstreamTimeout",
    "DownstreamUnreachable",
    "EffectExpired",
    "EffectInFlight",
    "EffectSettled",
    "EffectUnknown",
    "Epoch",
    "EventsGone",
    "Fenced",
    "FencegateError",
    "Forbidden",
    "GatewayUnreachable",
    "HttpVersionNotSupported",
    "IdempotencyKeyRequired",
    "InternalError",
    "Lease",
    "LeaseExpired",
    "LeaseLost",
    "MethodNotAllowed",
    "MisdirectedRequest",
    "NoSuchDownstream",
    "NoSuchEffect",
    "NoSuchTask",
    "NotFound",
    "PayloadConflict",
    "PayloadTooLarge",
    "ProblemError",
    "ProxyResponse",
    "RateLimited",
    "RequestTimeout",
    "RuntimeExceeded",
    "StaleEpoch",
    "StaleInput",
    "StoreUnavailable",
    "StreamEvent",
    "TaskExpired",
    "TaskRecord",
    "TooManyConnections",
    "Unauthenticated",
    "Unavailable",
    "UnsupportedMediaType",
    "canonical_json",
    "mcp_meta",
    "result_digest",
    "wait_out_in_flight",
]

#: Where each export lives. Imported on first use (PEP 562), so that importing a subpackage
#: (``fencegate.ledger`` in the gateway) or ``fencegate.errors`` alone does not pay for aiohttp.
_MODULES = ("fencegate.errors", "fencegate.lease", "fencegate.client")


def __getattr__(name: str) -> Any:
    if name in __all__:
        for module_name in _MODULES:
            module = importlib.import_module(module_name)
            if name in getattr(module, "__all__", ()):
                value = getattr(module, name)
                globals()[name] = value
                return value
    raise AttributeError(f"module 'fencegate' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
