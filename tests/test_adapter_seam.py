"""The adapter seam (adapters/base.py): every kind says what a request's effect is, what its
forward carries, what an answer means, and how a duplicate is answered, behind one protocol.
HTTP kinds and MCP side by side, without a network; end to end they are tests/test_proxy.py,
tests/test_adapters.py and tests/test_mcp.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from fencegate.adapters import Adapter, ConditionalAdapter, HttpAdapter, ManualAdapter
from fencegate.adapters.base import Outgoing
from fencegate.adapters.mcp import META_EFFECT_ID, META_REPLAYED, McpAdapter, ToolOverride
from fencegate.ledger.effects import Effect, EffectState, payload_digest
from fencegate.ledger.errors import BadRequest
from fencegate.ledger.payloads import canonical_body
from fencegate.ledger.responses import response_json

JSON = (("Content-Type", "application/json"),)


def _effect(path: str, response: str | None) -> Effect:
    return Effect(
        effect_id="e" * 64,
        task_id="t1",
        revision=1,
        node="main",
        slot="s1",
        downstream="d",
        method="POST",
        path=path,
        payload_digest="0" * 64,
        state=EffectState.COMMITTED,
        created_at=1,
        updated_at=2,
        response_json=response,
    )


def test_every_kind_is_an_adapter() -> None:
    kinds: list[Adapter] = [HttpAdapter(), ConditionalAdapter(), ManualAdapter(), McpAdapter()]
    assert [k.kind for k in kinds] == ["http", "conditional", "manual", "mcp"]


def test_an_http_effect_is_the_request_and_its_preconditions() -> None:
    body = b'{"b": 1, "a": 2}'
    request = Outgoing("PUT", "s3", "/bucket/x?v=1", (*JSON, ("If-Match", '"e1"')), body, "s1")
    plain = HttpAdapter().effect_of(request)
    assert plain.slot == "s1" and (plain.method, plain.path) == ("PUT", "/bucket/x?v=1")
    canonical = canonical_body(body, "application/json")
    assert plain.payload_digest == payload_digest("PUT", "s3", "/bucket/x?v=1", canonical)
    conditional = ConditionalAdapter().effect_of(request)
    assert conditional.preconditions == (("If-Match", '"e1"'),)
    assert conditional.payload_digest != plain.payload_digest  # the precondition is payload
    with pytest.raises(BadRequest, match="Fence-Slot"):
        HttpAdapter().effect_of(replace(request, slot=None))


def _call(**params: object) -> bytes:
    message = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": params}
    return json.dumps(message).encode()


def test_an_mcp_effect_is_the_tool_and_its_arguments_not_the_message_id() -> None:
    adapter = McpAdapter()
    one = adapter.effect_of(Outgoing("POST", "d", "/", JSON, _call(name="t", arguments={"x": 1})))
    again = json.dumps(
        {"id": "other", "method": "tools/call", "params": {"arguments": {"x": 1}, "name": "t"}}
    ).encode()
    two = adapter.effect_of(Outgoing("POST", "d", "/", JSON, again))
    assert one == two and one.path == "/tools/call/t" and one.slot.startswith("mcp:")
    for bad, named in [
        (b"{not json", "not one JSON-RPC message"),
        (json.dumps({"id": 1, "method": "tools/list"}).encode(), "not a tools/call"),
        (_call(name="t", arguments={"x": 1})[:-1] + b', "z": 1e400}', "round trip"),
    ]:
        with pytest.raises(BadRequest, match=named):
            adapter.effect_of(Outgoing("POST", "d", "/", JSON, bad))


def test_what_goes_out_http_unchanged_mcp_with_its_identity_in_meta() -> None:
    body = b'{"z": 1, "a": 2}'
    assert HttpAdapter().outbound_body(body, "e" * 64, "1.2") == body
    sent = json.loads(McpAdapter().outbound_body(_call(name="t", arguments={"z": 1, "a": 2}),
                                                 "e" * 64, "1.2"))  # fmt: skip
    assert sent["params"]["_meta"][META_EFFECT_ID] == "e" * 64
    assert list(sent["params"]["arguments"]) == ["z", "a"]  # the agent's message, as it sent it


@pytest.mark.parametrize(
    ("status", "body", "state"),
    [
        (200, {"id": 7, "result": {"content": []}}, EffectState.COMMITTED),
        (400, {"id": 7, "error": {"code": -32602}}, EffectState.NOT_APPLIED),
        (200, {"id": 7, "error": {"code": -32603}}, EffectState.UNKNOWN),
        (404, None, EffectState.NOT_APPLIED),
        (502, None, EffectState.UNKNOWN),
        (200, None, EffectState.UNKNOWN),
    ],
)
def test_what_an_mcp_answer_means_comes_from_its_body_then_its_status(
    status: int, body: dict[str, object] | None, state: EffectState
) -> None:
    raw = json.dumps(body).encode() if body is not None else None
    assert McpAdapter().outcome(status, raw, _effect("/tools/call/t", None))[0] is state


def test_a_tool_may_say_which_errors_mean_it_did_not_run() -> None:
    careful = McpAdapter(tools={"pay": ToolOverride(not_applied_codes=frozenset())})
    answer = json.dumps({"id": 1, "error": {"code": -32602}}).encode()
    assert careful.outcome(200, answer, _effect("/tools/call/pay", None))[0] is EffectState.UNKNOWN
    assert careful.outcome(200, answer, _effect("/tools/call/other", None))[0] is (
        EffectState.NOT_APPLIED
    )
    # An HTTP answer's body never changes what its status means.
    assert HttpAdapter().outcome(200, b'{"error": 1}', _effect("/x", None))[0] is (
        EffectState.COMMITTED
    )


def test_a_duplicate_gets_the_stored_answer_as_its_kind_speaks() -> None:
    stored = response_json(201, [("Content-Type", "text/plain")], b"made", omitted_reason=None)
    http = HttpAdapter().replay(_effect("/x", stored), Outgoing("POST", "d", "/x", (), b""))
    assert (http.status, http.headers, http.body) == (201, (("Content-Type", "text/plain"),),
                                                      b"made")  # fmt: skip
    assert (
        HttpAdapter().replay(_effect("/x", None), Outgoing("POST", "d", "/x", (), b"")).body is None
    )

    answer = {"jsonrpc": "2.0", "id": 3, "result": {"content": [{"type": "text", "text": "1"}]}}
    stored = response_json(200, list(JSON), json.dumps(answer).encode(), omitted_reason=None)
    request = Outgoing("POST", "d", "/", JSON, _call(name="t"))
    mcp = McpAdapter().replay(_effect("/tools/call/t", stored), request)
    replayed = json.loads(mcp.body or b"")
    assert replayed["id"] == 7 and replayed["result"]["_meta"][META_REPLAYED] is True
    assert replayed["result"]["content"] == answer["result"]["content"]
    omitted = McpAdapter().replay(_effect("/tools/call/t", None), request)
    assert json.loads(omitted.body or b"")["result"]["_meta"]["fencegate/replayBody"] == "omitted"
