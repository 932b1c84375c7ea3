"""OpenTelemetry traces through the gateway (issue 29, "Traces"; gateway/tracing.py).

A local OTLP/HTTP receiver (``tests.otlp_receiver``) gets what a collector would: the
gateway's spans, decoded with the OpenTelemetry protobuf package. Each test runs its calls in
a gateway and then stops it: the shutdown flushes every span (``[tracing]`` flushes on
shutdown), so the assertions read a complete export without waiting on any clock.

Checked: one SERVER span per request with the HTTP semantic conventions and the call's
``fencegate.*`` attributes; a child span per store step; a CLIENT span per forward and per
probe; the downstream gets a ``traceparent`` in the agent's trace whose parent is the
forward span (a header on ``/proxy``, ``params._meta`` on ``/mcp``), and the trace context
never changes a payload digest (the same call with another ``traceparent`` is a replay);
log lines carry ``trace_id``; a refusal carries its problem code, a 5xx an error status.
And without ``[tracing]`` nothing of OpenTelemetry is imported, and ``serve`` refuses
``[tracing]`` where the extra is not installed, naming it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import structlog
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway import tracing
from fencegate.gateway.app import create_app
from fencegate.gateway.config import ConfigError, load_config
from tests.api import Api, Lease, mcp_lease, mcp_post
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.timeout(60)

#: The agent's own trace: its trace id and the span its call is made under (sampled).
AGENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
AGENT_SPAN = "b7ad6b7169203331"
AGENT_PARENT = f"00-{AGENT_TRACE}-{AGENT_SPAN}-01"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    otlp = OtlpReceiver().start()
    yield otlp
    otlp.stop()


@dataclass
class RecordingMcp:
    """An MCP server (one JSON answer per POST) that keeps every message it got."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    runner: web.AppRunner | None = None
    url: str = ""

    async def _post(self, request: web.Request) -> web.Response:
        message = json.loads(await request.read())
        self.messages.append(message)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if "id" not in message:
            return web.Response(status=202)
        result: dict[str, Any] = {"content": [{"type": "text", "text": "ok"}]}
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})

    async def start(self) -> RecordingMcp:
        app = web.Application()
        app.router.add_post("/mcp", self._post)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/mcp"
        return self


@pytest.fixture
async def mcp_server() -> AsyncIterator[RecordingMcp]:
    server = await RecordingMcp().start()
    yield server
    assert server.runner is not None
    await server.runner.cleanup()


def traced_config(
    tmp_path: Path,
    receiver: OtlpReceiver,
    downstreams: list[dict[str, Any]],
    store_url: str | None = None,
    key_prefix: str = "fg",
    **tracing_keys: Any,
) -> Any:
    return make_config(
        store_url or f"sqlite:///{tmp_path / 'fencegate.db'}",
        key_prefix,
        downstreams=downstreams,
        reconciler={"enabled": False},
        tracing={"otlp_endpoint": receiver.endpoint, "export_delay_ms": 20, **tracing_keys},
    )


@asynccontextmanager
async def gateway(config: Any) -> AsyncIterator[Api]:
    """The gateway in process; leaving the block stops it, which exports every span."""
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


async def proxied(
    api: Api, lease: Lease, target: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str]]:
    sent = {**lease.fence_headers(), "Fence-Slot": "s1", **(headers or {})}
    async with api.client.post(f"/proxy/{target}", json=body, headers=sent) as resp:
        await resp.read()
        return resp.status, dict(resp.headers)


def one(spans: list[ReceivedSpan], what: str) -> ReceivedSpan:
    assert len(spans) == 1, (what, spans)
    return spans[0]


def server_span(receiver: OtlpReceiver, route_prefix: str) -> ReceivedSpan:
    return one(
        [s for s in receiver.kind("server") if s.attributes["url.path"].startswith(route_prefix)],
        f"one server span under {route_prefix}",
    )


def parent_of(traceparent: str) -> tuple[str, str]:
    version, trace_id, parent_id, flags = traceparent.split("-")
    assert version == "00" and int(flags, 16) & 1, traceparent  # sampled
    return trace_id, parent_id


# --- /proxy ------------------------------------------------------------------------------------


async def test_a_proxied_call_is_a_server_span_with_store_steps_and_a_forward_in_the_agents_trace(
    tmp_path: Path, receiver: OtlpReceiver, downstream: Downstream, store_url: str, key_prefix: str
) -> None:
    config = traced_config(tmp_path, receiver, [{"name": "api", "url": downstream.url}],
                           store_url, key_prefix)  # fmt: skip
    async with gateway(config) as api:
        await api.put("t1")
        lease = await api.claim("t1")
        trace = {"traceparent": AGENT_PARENT, "tracestate": "agent=1"}
        status, answer = await proxied(api, lease, "api/ok/charge", {"amount": 5}, trace)
        assert status == 200, answer
    effect_id = answer["Fence-Effect-Id"]

    server = server_span(receiver, "/proxy/")
    assert (server.trace_id, server.parent_span_id) == (AGENT_TRACE, AGENT_SPAN)
    assert server.name == "POST /proxy/{tail}"
    assert server.resource["service.name"] == "fencegate"
    attributes = server.attributes
    assert attributes["http.request.method"] == "POST"
    assert attributes["http.route"] == "/proxy/{tail}"
    assert attributes["url.path"] == "/proxy/api/ok/charge"
    assert attributes["http.response.status_code"] == 200
    assert attributes["fencegate.effect_id"] == effect_id
    assert attributes["fencegate.task_id"] == "t1"
    assert attributes["fencegate.generation"] == lease.claim_generation
    assert attributes["fencegate.decision"] == "forward"
    assert attributes["fencegate.outcome"] == "committed"
    assert attributes["fencegate.downstream"] == "api"
    assert attributes["fencegate.kind"] == "leased"
    assert server.status == "unset"

    children = receiver.children(server)
    # Each store names its steps as its metrics do (prepare_effect on SQL, prepare on Redis).
    steps = sorted(s.name for s in children if s.name.startswith("store "))
    assert len(steps) == 2, children
    assert steps[0].startswith("store complete") and steps[1].startswith("store prepare")
    for step in (s for s in children if s.name.startswith("store ")):
        assert step.kind == "internal"
        assert server.start_ns <= step.start_ns <= step.end_ns <= server.end_ns
    forward = one([s for s in children if s.kind == "client"], "one forward")
    assert forward.name == "POST"
    assert forward.attributes["fencegate.send"] == "forward"
    assert forward.attributes["fencegate.effect_id"] == effect_id
    assert forward.attributes["fencegate.downstream"] == "api"
    assert forward.attributes["http.response.status_code"] == 200
    assert forward.attributes["url.full"] == f"{downstream.url}/ok/charge"

    # The downstream is in the agent's trace, its parent the forward span.
    received = downstream.calls("/ok/charge")[0].headers
    assert parent_of(received["traceparent"]) == (AGENT_TRACE, forward.span_id)
    assert received["tracestate"] == "agent=1"


async def test_the_trace_context_never_changes_the_payload_digest(
    tmp_path: Path, receiver: OtlpReceiver, downstream: Downstream
) -> None:
    """The same call sent again under another span of the agent (and with none) is a
    replay, not a conflict: trace headers are in no digest."""
    config = traced_config(tmp_path, receiver, [{"name": "api", "url": downstream.url}])
    async with gateway(config) as api:
        await api.put("t1")
        lease = await api.claim("t1")
        first = await proxied(api, lease, "api/ok/pay", {"amount": 5},
                              {"traceparent": AGENT_PARENT})  # fmt: skip
        other = f"00-{'1' * 32}-{'2' * 16}-01"
        again = await proxied(api, lease, "api/ok/pay", {"amount": 5},
                              {"traceparent": other, "tracestate": "x=y"})  # fmt: skip
        bare = await proxied(api, lease, "api/ok/pay", {"amount": 5})
        record = (await api.call("GET", f"/v1/effects/{first[1]['Fence-Effect-Id']}")).body
    assert first[0] == again[0] == bare[0] == 200
    assert [a[1]["Fence-Replayed"] for a in (first, again, bare)] == ["false", "true", "true"]
    assert len(downstream.calls("/ok/pay")) == 1
    assert record["state"] == "COMMITTED"
    decisions = [s.attributes["fencegate.decision"] for s in receiver.kind("server")
                 if s.attributes["url.path"] == "/proxy/api/ok/pay"]  # fmt: skip
    assert decisions == ["forward", "replay", "replay"]


async def test_a_refusal_carries_its_problem_code_and_a_5xx_an_error_status(
    tmp_path: Path, receiver: OtlpReceiver, downstream: Downstream
) -> None:
    # Nothing listens on port 9 of loopback: the connect is refused.
    gone = {"name": "gone", "url": "http://127.0.0.1:9", "connect_timeout_ms": 2000}
    downstreams = [{"name": "api", "url": downstream.url}, gone]
    config = traced_config(tmp_path, receiver, downstreams)
    async with gateway(config) as api:
        await api.put("t1")
        lease = await api.claim("t1")
        stale = Lease(**{**lease.__dict__, "claim_generation": lease.claim_generation + 1})
        fenced, _ = await proxied(api, stale, "api/ok/x", {"a": 1})
        unreachable, _ = await proxied(api, lease, "gone/x", {"a": 1})
    assert fenced == 409 and unreachable == 502

    refused = server_span(receiver, "/proxy/api/")
    assert refused.attributes["fencegate.decision"] == "refuse"
    assert refused.attributes["fencegate.problem"]  # the store's code for a stale generation
    assert refused.attributes["http.response.status_code"] == 409
    assert refused.status == "unset"
    failed = server_span(receiver, "/proxy/gone/")
    assert failed.attributes["fencegate.problem"] == "DOWNSTREAM_UNREACHABLE"
    assert failed.attributes["fencegate.outcome"] == "not_applied"
    assert failed.attributes["http.response.status_code"] == 502
    assert failed.status == "error"
    forward = one([s for s in receiver.children(failed) if s.kind == "client"], "the forward")
    assert forward.status == "error"
    assert forward.attributes["error.type"] == "connect"


async def test_a_probe_is_a_client_span_under_its_reconcile(
    tmp_path: Path, receiver: OtlpReceiver, downstream: Downstream
) -> None:
    probe = {"name": "orders", "url": downstream.url, "adapter": "probe",
             "probe": {"path": "/ok/lookup/{effectId}", "settle_ms": 0}}  # fmt: skip
    config = traced_config(tmp_path, receiver, [probe])
    async with gateway(config) as api:
        await api.put("t1")
        lease = await api.claim("t1")
        status, answer = await proxied(api, lease, "orders/status/500", {"item": 1})
        assert answer["Fence-Effect-State"] == "UNKNOWN", (status, answer)
        effect_id = answer["Fence-Effect-Id"]
        settled = await api.call("POST", f"/v1/effects/{effect_id}/reconcile")
        assert settled.status == 200 and settled.body["state"] == "COMMITTED", settled.body

    request = server_span(receiver, f"/v1/effects/{effect_id}/reconcile")
    reconcile = one(receiver.named("fencegate.reconcile"), "one reconcile")
    assert reconcile.parent_span_id == request.span_id
    assert reconcile.attributes["fencegate.effect_id"] == effect_id
    assert reconcile.attributes["fencegate.outcome"] == "committed"
    probe_span = one([s for s in receiver.children(reconcile) if s.kind == "client"], "a probe")
    assert probe_span.attributes["fencegate.send"] == "probe"
    assert probe_span.attributes["fencegate.effect_id"] == effect_id
    assert {s.name for s in receiver.children(reconcile)} >= {"store update_effect"}
    lookup = downstream.calls(f"/ok/lookup/{effect_id}")[0].headers
    assert parent_of(lookup["traceparent"]) == (request.trace_id, probe_span.span_id)


# --- /mcp ---------------------------------------------------------------------------------------


async def test_mcp_takes_the_context_from_meta_and_the_server_gets_the_forward_span_in_meta(
    tmp_path: Path, receiver: OtlpReceiver, mcp_server: RecordingMcp
) -> None:
    mcp_downstream = {"name": "tools", "url": mcp_server.url, "adapter": "mcp",
                      "tools": {"charge": {"kind": "effect"}}}  # fmt: skip
    config = traced_config(tmp_path, receiver, [mcp_downstream])

    def charge(request_id: int, traceparent: str) -> bytes:
        meta = {"traceparent": traceparent, "tracestate": "agent=mcp"}
        params = {"name": "charge", "arguments": {"amount": 3}, "_meta": meta}
        message = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params}
        return json.dumps(message).encode()

    async with gateway(config) as api:
        _, headers = await mcp_lease(api.client)
        headers["Fence-Slot"] = "s1"
        status, answer = await mcp_post(api.client, "tools", headers, charge(1, AGENT_PARENT))
        assert status == 200 and "result" in answer, answer
        # Another span of the agent: the same call, replayed (no digest holds _meta's trace).
        other = f"00-{'3' * 32}-{'4' * 16}-01"
        status, again = await mcp_post(api.client, "tools", headers, charge(2, other))
        assert status == 200 and "result" in again, again
    assert len(mcp_server.messages) == 1  # the duplicate was replayed, not sent

    server = [s for s in receiver.kind("server") if s.attributes["url.path"] == "/mcp/tools"]
    first = one([s for s in server if s.trace_id == AGENT_TRACE], "the agent's call")
    assert first.parent_span_id == AGENT_SPAN  # from params._meta: the header had none
    assert first.attributes["fencegate.decision"] == "forward"
    assert first.attributes["fencegate.outcome"] == "committed"
    forward = one([s for s in receiver.children(first) if s.kind == "client"], "the forward")
    meta = mcp_server.messages[0]["params"]["_meta"]
    assert parent_of(meta["traceparent"]) == (AGENT_TRACE, forward.span_id)
    assert meta["tracestate"] == "agent=mcp"
    assert parent_of(mcp_server.headers[0]["traceparent"]) == (AGENT_TRACE, forward.span_id)
    assert meta["dev.fencegate/effectId"] == first.attributes["fencegate.effect_id"]
    replayed = one([s for s in server if s.trace_id == "3" * 32], "the retry")
    assert replayed.attributes["fencegate.decision"] == "replay"


# --- logs ---------------------------------------------------------------------------------------


async def test_log_lines_carry_the_trace_and_span_ids_while_a_span_is_active(
    tmp_path: Path, receiver: OtlpReceiver, downstream: Downstream
) -> None:
    captured = structlog.testing.LogCapture()
    before = structlog.get_config()
    structlog.configure(processors=[tracing.log_ids, captured], cache_logger_on_first_use=False)
    try:
        config = traced_config(tmp_path, receiver, [{"name": "api", "url": downstream.url}])
        async with gateway(config) as api:
            await api.put("t1")
            lease = await api.claim("t1")
            await proxied(api, lease, "api/ok/logged", {"a": 1}, {"traceparent": AGENT_PARENT})
            structlog.get_logger("test").info("test.outside")
    finally:
        structlog.configure(**before)
    committed = [e for e in captured.entries if e["event"] == "effect.committed"]
    assert len(committed) == 1, captured.entries
    server = server_span(receiver, "/proxy/")
    assert committed[0]["trace_id"] == AGENT_TRACE
    assert committed[0]["span_id"] == server.span_id
    outside = [e for e in captured.entries if e["event"] == "test.outside"]
    assert "trace_id" not in outside[0]


# --- config, sampling and the collector's credential -------------------------------------------


async def test_sampling_follows_the_agent_and_the_collector_gets_its_credential(
    tmp_path: Path,
    receiver: OtlpReceiver,
    downstream: Downstream,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``sample_ratio = 0`` records no trace of its own, but follows an agent whose trace is
    sampled (parent-based); the exports carry the header named by ``headers_from_env``."""
    monkeypatch.setenv("FG_TEST_OTLP_AUTH", "Bearer collector-secret")
    config = traced_config(tmp_path, receiver, [{"name": "api", "url": downstream.url}],
                           sample_ratio=0, service_name="gw-test",
                           headers_from_env={"Authorization": "FG_TEST_OTLP_AUTH"})  # fmt: skip
    async with gateway(config) as api:
        await api.put("t1")
        lease = await api.claim("t1")
        await proxied(api, lease, "api/ok/unsampled", {"a": 1})
        await proxied(api, lease, "api/ok/sampled", {"a": 1}, {"traceparent": AGENT_PARENT})
    paths = {s.attributes.get("url.path") for s in receiver.kind("server")}
    assert paths == {"/proxy/api/ok/sampled"}
    assert {s.trace_id for s in receiver.spans} == {AGENT_TRACE}
    assert {s.resource["service.name"] for s in receiver.spans} == {"gw-test"}
    assert receiver.exports and all(
        e.get("authorization") == "Bearer collector-secret" for e in receiver.exports
    )
    # The unsampled call still went out with a context (not sampled) for the downstream.
    unsampled = downstream.calls("/ok/unsampled")[0].headers["traceparent"]
    assert int(unsampled.rsplit("-", 1)[1], 16) & 1 == 0


def test_the_tracing_section_is_checked_and_its_secrets_come_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def load(body: str) -> Any:
        path = tmp_path / "fencegate.toml"
        path.write_text(textwrap.dedent(body))
        return load_config(path)

    assert load("").tracing is None  # off by default
    on = load('[tracing]\notlp_endpoint = "http://127.0.0.1:4318/"\n').tracing
    assert on is not None
    assert (on.otlp_endpoint, on.service_name, on.sample_ratio) == (
        "http://127.0.0.1:4318",
        "fencegate",
        1.0,
    )
    with pytest.raises(ConfigError, match=r"tracing\.otlp_endpoint"):
        load('[tracing]\notlp_endpoint = "grpc://127.0.0.1:4317"\n')
    with pytest.raises(ConfigError, match=r"tracing\.sample_ratio"):
        load('[tracing]\notlp_endpoint = "http://c:4318"\nsample_ratio = 1.5\n')
    monkeypatch.delenv("FG_TEST_UNSET", raising=False)
    with pytest.raises(
        ConfigError, match=r"tracing\.headers_from_env\.Authorization.*FG_TEST_UNSET"
    ):
        load('[tracing]\notlp_endpoint = "http://c:4318"\n'
             '[tracing.headers_from_env]\nAuthorization = "FG_TEST_UNSET"\n')  # fmt: skip


# --- off: nothing imported; on without the extra: refused --------------------------------------


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, **env},
    )


def test_without_tracing_a_gateway_imports_nothing_of_opentelemetry(tmp_path: Path) -> None:
    code = f"""
        import asyncio, sys
        from aiohttp.test_utils import TestClient, TestServer
        from fencegate.gateway.app import create_app
        from fencegate.gateway.config import Config
        from fencegate.gateway.logs import configure_logging

        async def main():
            configure_logging("info")
            config = Config.model_validate({{"store": {{"url": "sqlite:///{tmp_path}/fg.db"}}}})
            async with TestClient(TestServer(create_app(config))) as client:
                async with client.get("/healthz") as resp:
                    assert resp.status == 200
                async with client.post("/v1/tasks", json={{}}) as resp:
                    await resp.read()

        asyncio.run(main())
        loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
        print("loaded:", loaded)
        """
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "loaded: []", done.stdout


@pytest.mark.parametrize("check", [False, True], ids=["serve", "serve --check"])
def test_serve_refuses_tracing_without_the_extra_and_names_it(tmp_path: Path, check: bool) -> None:
    config = tmp_path / "fencegate.toml"
    config.write_text(
        f'[store]\nurl = "sqlite:///{tmp_path}/fg.db"\n'
        '[tracing]\notlp_endpoint = "http://127.0.0.1:4318"\n'
    )
    argv = ["serve", "--config", str(config), *(["--check"] if check else [])]
    code = f"""
        import sys
        sys.modules["opentelemetry"] = None  # as if the extra were not installed
        from fencegate.gateway.cli import main
        sys.exit(main({argv!r}))
        """
    done = _python(code)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "pip install 'fencegate[otel]'" in done.stderr, done.stderr
    assert "[tracing]" in done.stderr


def test_the_context_goes_into_meta_of_requests_and_notifications_only() -> None:
    """``_into_meta`` (what a traced send to an MCP server carries): the agent's own
    ``traceparent`` / ``tracestate`` replaced, other ``_meta`` keys kept, a message without
    ``params`` given one; a response or a body that is not JSON goes as it came."""
    carrier = {"traceparent": AGENT_PARENT}
    listed = json.loads(
        tracing._into_meta(b'{"jsonrpc":"2.0","id":1,"method":"tools/list"}', carrier)
    )
    assert listed["params"] == {"_meta": carrier}
    call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": "x", "_meta": {"traceparent": "00-old", "tracestate": "a=b",
                                              "progressToken": 7}}}  # fmt: skip
    sent = json.loads(tracing._into_meta(json.dumps(call).encode(), carrier))
    assert sent["params"] == {"name": "x", "_meta": {"progressToken": 7, **carrier}}
    response = b'{"jsonrpc":"2.0","id":3,"result":{}}'
    assert tracing._into_meta(response, carrier) is response
    assert tracing._into_meta(b"not json", carrier) == b"not json"
    odd = b'{"jsonrpc":"2.0","id":4,"method":"m","params":{"_meta":[1]}}'
    assert tracing._into_meta(odd, carrier) is odd
