"""schemathesis against a live gateway (SQLite, in this process, on loopback) with a bounded
budget: every coordination, ledger and rollout operation of docs/openapi.json (not /proxy,
/metrics or the document itself), at most 30 examples each. No 5xx but the documented
502/503/504, and every answer (status, content type, headers, body) matches the document.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from aiohttp import web
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from fencegate.gateway.app import create_app
from fencegate.gateway.request_guard import ConnectionSlots, GuardedSite, handler_factory
from tests.conftest import build_test_store, make_config

pytestmark = pytest.mark.slow

DOC = json.loads((Path(__file__).resolve().parent.parent / "docs" / "openapi.json").read_text())
SCHEMA = schemathesis.openapi.from_dict(DOC).include(path_regex=r"^/v1/")
#: The event stream never ends on its own: each example reads it until the client's timeout,
#: so it gets fewer examples (and a short timeout) than the rest.
STREAMS = SCHEMA.include(path_regex=r"^/v1/events$")
SCHEMA = SCHEMA.exclude(path_regex=r"^/v1/events$")
CHECKS = [
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway serving on its own event loop in a thread (schemathesis calls synchronously)."""
    config = make_config(
        f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'fg.db'}",
        reconciler={"enabled": False},
        # Long-polls (waitFor, a queue claim's waitMs) answer within the client's timeout.
        tasks={"max_wait_ms": 200},
    )
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(create_app(config, store=build_test_store(config)))

    async def start() -> int:
        # The listener `fencegate serve` uses: its parser-level refusals (a request line
        # over aiohttp's 8190 bytes, which the fuzzer's long query strings reach) are
        # problem+json too, as the document says; a plain TCPSite answers them as text.
        await runner.setup()
        assert runner.server is not None
        factory = handler_factory(runner.server, ConnectionSlots(1000))
        site = GuardedSite(runner, "127.0.0.1", 0, factory)
        await site.start()
        return site.port  # the one the system picked

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@SCHEMA.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_matches_its_document(case: schemathesis.Case, base_url: str) -> None:
    response = case.call_and_validate(base_url=base_url, checks=CHECKS, timeout=10)
    assert response.status_code < 500 or response.status_code in (502, 503, 504), (
        case.method,
        case.formatted_path,
        response.status_code,
        response.text,
    )


@STREAMS.parametrize()
@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_event_stream_matches_its_document(case: schemathesis.Case, base_url: str) -> None:
    response = case.call_and_validate(base_url=base_url, checks=CHECKS, timeout=2)
    assert response.status_code < 500 or response.status_code == 503, response.text
