"""The MCP adapter's pure rules (adapters/mcp.py): which effect a tools/call is, what the
server gets, what an answer means, how a duplicate and a refusal look. No network here; the
end-to-end behaviour with the official SDK on both sides is tests/test_mcp.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fencegate.adapters import mcp
from fencegate.adapters.mcp import ToolKind
from fencegate.ledger.effects import EffectState
from fencegate.ledger.errors import BadRequest, EffectUnknown, Fenced

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=10,
)  # fmt: skip


@given(st.dictionaries(st.text(max_size=6), _JSON, max_size=5))
def test_the_derived_slot_is_the_tool_and_its_arguments_whatever_their_key_order(
    arguments: dict[str, Any],
) -> None:
    shuffled = dict(reversed(list(arguments.items())))
    one = mcp.parse_tool_call({"name": "charge", "arguments": arguments})
    two = mcp.parse_tool_call(
        {"name": "charge", "arguments": shuffled, "_meta": {"progressToken": 7}}
    )
    assert one == two  # _meta (a progress token, the envelope) is not part of the effect
    assert one.slot.startswith("mcp:") and len(one.slot) == 36
    other = mcp.parse_tool_call({"name": "refund", "arguments": arguments})
    assert other.slot != one.slot and other.payload != one.payload


def test_an_explicit_slot_names_the_effect_and_the_payload_still_binds_the_arguments() -> None:
    a = mcp.parse_tool_call({"name": "t", "arguments": {"x": 1}, "_meta": {mcp.META_SLOT: "s1"}})
    b = mcp.parse_tool_call({"name": "t", "arguments": {"x": 2}, "_meta": {mcp.META_SLOT: "s1"}})
    assert a.slot == b.slot == "s1"
    assert a.payload != b.payload  # the ledger refuses the second: PAYLOAD_CONFLICT


@pytest.mark.parametrize(
    ("params", "named"),
    [
        (None, "params must be an object"),
        ({}, "params.name"),
        ({"name": ""}, "params.name"),
        ({"name": "t" * 201}, "params.name"),
        ({"name": "t", "arguments": [1]}, "params.arguments"),
        ({"name": "t", "_meta": "x"}, "params._meta"),
        ({"name": "t", "_meta": {mcp.META_SLOT: "a b"}}, "fencegate/slot"),
        ({"name": "t", "_meta": {mcp.META_SLOT: 7}}, "fencegate/slot"),
        ({"name": "t", "_meta": {"fencegate/slot": "a b"}}, "fencegate/slot"),  # the older name
    ],
)
def test_a_call_that_names_no_effect_is_refused_naming_the_field(params: Any, named: str) -> None:
    with pytest.raises(BadRequest, match=named):
        mcp.parse_tool_call(params)


def test_the_server_gets_the_identity_and_every_other_meta_key_unchanged() -> None:
    message = {
        "jsonrpc": "2.0",
        "id": 9,
        "method": "tools/call",
        "params": {
            "name": "charge",
            "arguments": {"amount": 5},
            "_meta": {
                "progressToken": 9,
                "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                mcp.META_SLOT: "s1",
                mcp.META_EFFECT_ID: "forged-by-the-agent",
                "fencegate/effectId": "forged-under-the-older-name",
                "dev.fencegate/anything": "the gateway's prefix is the gateway's",
            },
        },
    }
    sent = json.loads(mcp.with_identity(message, "e" * 64, "3.7"))
    # The identity under both spellings (the older one for at least one release).
    assert sent["params"]["_meta"] == {
        "progressToken": 9,
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "dev.fencegate/effectId": "e" * 64,
        "dev.fencegate/fencingToken": "3.7",
        "fencegate/effectId": "e" * 64,
        "fencegate/fencingToken": "3.7",
    }
    assert {k: v for k, v in sent.items() if k != "params"} == {
        "jsonrpc": "2.0",
        "id": 9,
        "method": "tools/call",
    }
    assert sent["params"]["name"] == "charge" and sent["params"]["arguments"] == {"amount": 5}
    assert message["params"]["_meta"][mcp.META_EFFECT_ID] == "forged-by-the-agent"  # a copy
    bare = json.loads(mcp.with_identity({"id": 1, "method": "tools/call"}, "f" * 64, "1.1"))
    assert bare["params"]["_meta"] == mcp.both_names(
        {mcp.META_EFFECT_ID: "f" * 64, mcp.META_FENCING_TOKEN: "1.1"}
    )
    # A keyed call has no lease: no fencing token under either name.
    keyed = json.loads(mcp.with_identity(message, "k" * 64, None))
    assert {k: v for k, v in keyed["params"]["_meta"].items() if "fencegate/" in k} == {
        "dev.fencegate/effectId": "k" * 64,
        "fencegate/effectId": "k" * 64,
    }


@pytest.mark.parametrize(
    ("answer", "state"),
    [
        ({"id": 1, "result": {"content": []}}, EffectState.COMMITTED),
        ({"id": 1, "result": {"content": [], "isError": True}}, EffectState.COMMITTED),
        ({"id": 1, "result": {"resultType": "complete"}}, EffectState.COMMITTED),
        ({"id": 1, "result": {"resultType": "task", "task": {}}}, EffectState.COMMITTED),
        (
            {"id": 1, "result": {"resultType": "input_required", "requestState": "s"}},
            EffectState.NOT_APPLIED,
        ),
        ({"id": 1, "error": {"code": -32601, "message": "no"}}, EffectState.NOT_APPLIED),
        ({"id": 1, "error": {"code": -32602, "message": "bad"}}, EffectState.NOT_APPLIED),
        ({"id": 1, "error": {"code": -32603, "message": "internal"}}, EffectState.UNKNOWN),
        ({"id": 1, "error": {"code": -32800, "message": "cancelled"}}, EffectState.UNKNOWN),
        ({"id": 1, "error": {"code": -32050}}, EffectState.UNKNOWN),
        ({"id": 1, "error": "garbled"}, EffectState.UNKNOWN),
    ],
)
def test_what_an_answer_means_for_the_effect(answer: dict[str, Any], state: EffectState) -> None:
    assert mcp.classify(answer)[0] is state


def test_a_duplicate_gets_the_stored_answer_under_its_own_id_marked_replayed() -> None:
    stored = {"jsonrpc": "2.0", "id": 3, "result": {"content": [1], "_meta": {"server": "x"}}}
    again = mcp.replay(stored, "req-9")
    assert again == {
        "jsonrpc": "2.0",
        "id": "req-9",
        "result": {
            "content": [1],
            "_meta": {"server": "x", "dev.fencegate/replayed": True, "fencegate/replayed": True},
        },
    }
    assert stored["id"] == 3 and mcp.META_REPLAYED not in stored["result"]["_meta"]  # type: ignore[index]


def test_a_refusal_is_a_jsonrpc_error_carrying_the_problem() -> None:
    refused = mcp.error_message(4, Fenced("attempt is stale", effectId="e1", effectState="NONE"))
    assert refused["id"] == 4 and refused["error"]["code"] == mcp.REFUSAL_CODE
    assert refused["error"]["data"] == {
        "code": "FENCED",
        "status": 409,
        "detail": "attempt is stale",
        "effectId": "e1",
        "effectState": "NONE",
    }
    assert mcp.error_message(5, BadRequest("x"))["error"]["code"] == -32602
    unknown = mcp.error_message(6, EffectUnknown("ran?", retryAfterMs=100))
    assert unknown["error"]["data"]["code"] == "EFFECT_UNKNOWN"
    assert unknown["error"]["data"]["retryAfterMs"] == 100


@pytest.mark.parametrize(
    ("hints", "kind", "window", "expected"),
    [
        ({"readOnlyHint": True}, None, 5_000, (ToolKind.READ_ONLY, None, "annotations")),
        ({"idempotentHint": True}, None, 5_000, (ToolKind.IDEMPOTENT, 5_000, "annotations")),
        ({"idempotentHint": True}, None, None, (ToolKind.IDEMPOTENT, None, "annotations")),
        ({"destructiveHint": True}, None, None, (ToolKind.EFFECT, None, "annotations")),
        (None, None, None, (ToolKind.EFFECT, None, "annotations")),
        # The table wins over the server's hints, both ways.
        ({"readOnlyHint": True}, "effect", None, (ToolKind.EFFECT, None, "config")),
        ({}, "idempotent", 9_000, (ToolKind.IDEMPOTENT, 9_000, "config")),
        ({"idempotentHint": True}, "read_only", None, (ToolKind.READ_ONLY, None, "config")),
        # A window only matters for an idempotent tool: never a re-send for anything else.
        ({}, "effect", None, (ToolKind.EFFECT, None, "config")),
        ({"readOnlyHint": True, "idempotentHint": True}, None, 1, (ToolKind.READ_ONLY, None,
                                                                   "annotations")),
    ],
)  # fmt: skip
def test_the_policy_of_a_tool(
    hints: dict[str, Any] | None,
    kind: str | None,
    window: int | None,
    expected: tuple[ToolKind, int | None, str],
) -> None:
    policy = mcp.policy_for(hints, kind, dedupe_window_ms=window, trust_annotations=True)
    assert (policy.kind, policy.resend_window_ms, policy.source) == expected


@pytest.mark.parametrize(
    ("hints", "kind", "trusted", "expected"),
    [
        # Untrusted (the default): the server's hints count for nothing, a tool is an effect.
        ({"readOnlyHint": True}, None, False, (ToolKind.EFFECT, None, "default")),
        ({"idempotentHint": True}, None, False, (ToolKind.EFFECT, None, "default")),
        ({}, "read_only", False, (ToolKind.READ_ONLY, None, "config")),
        ({}, "idempotent", False, (ToolKind.IDEMPOTENT, 5_000, "config")),
    ],
)  # fmt: skip
def test_annotations_of_an_untrusted_server_are_not_believed(
    hints: dict[str, Any], kind: str | None, trusted: bool, expected: tuple[Any, ...]
) -> None:
    policy = mcp.policy_for(hints, kind, dedupe_window_ms=5_000, trust_annotations=trusted)
    assert (policy.kind, policy.resend_window_ms, policy.source) == expected
    assert mcp.policy_for(hints, kind, dedupe_window_ms=5_000).kind is policy.kind  # default


@pytest.mark.parametrize("trusted", [True, False])
@pytest.mark.parametrize("kind", [None, "read_only", "effect"])
def test_require_approval_is_always_a_recorded_call(kind: str | None, trusted: bool) -> None:
    """A tool configured ``require_approval`` is recorded and approved whatever its kind or
    the server's ``readOnlyHint`` say: a read-only policy would relay it unrecorded."""
    policy = mcp.policy_for(
        {"readOnlyHint": True}, kind, require_approval=True, trust_annotations=trusted
    )
    assert policy.kind is ToolKind.EFFECT and policy.require_approval


def test_an_mcp_adapter_asks_for_annotations_only_when_it_believes_them() -> None:
    tools = {"set": mcp.ToolOverride(kind="effect"), "mail": mcp.ToolOverride(require_approval=True,
             approval_ttl_ms=5_000)}  # fmt: skip
    untrusted = mcp.McpAdapter(tools=tools)
    trusted = mcp.McpAdapter(tools=tools, trust_annotations=True)
    assert not untrusted.needs_annotations("other") and not untrusted.needs_annotations("mail")
    assert trusted.needs_annotations("other") and trusted.needs_annotations("mail")
    assert not trusted.needs_annotations("set")
    assert trusted.policy("mail", {"readOnlyHint": True}).kind is ToolKind.EFFECT
    assert untrusted.approval_ttl("/tools/call/mail") == 5_000
    assert untrusted.approval_ttl("/tools/call/set") is None
    assert untrusted.approval_ttl("/tools/call/other") is None


def test_the_annotation_cache_is_bounded() -> None:
    cache = mcp.McpToolCache(max_sessions=2)
    cache.put("d", "s1", {"a": {}})
    cache.put("d", "s2", {"b": {}})
    cache.put("d", "s3", {"c": {}})
    assert cache.get("d", "s1") is None and cache.get("d", "s3") == {"c": {}}
    cache.drop("d", "s3")
    assert cache.get("d", "s3") is None


def test_a_tool_that_may_raise_invalid_params_after_acting_keeps_it_unknown() -> None:
    """The tools table's ``not_applied_codes`` (default -32601, -32602): a tool whose body may
    raise one of them after it acted is configured with none, so its error stays UNKNOWN and
    the call is never sent again by itself."""
    answer = {"id": 1, "error": {"code": -32602, "message": "bad amount"}}
    assert mcp.classify(answer)[0] is EffectState.NOT_APPLIED
    assert mcp.classify(answer, frozenset())[0] is EffectState.UNKNOWN
    assert mcp.classify({"id": 1, "error": {"code": -32050}}, frozenset({-32050}))[0] is (
        EffectState.NOT_APPLIED
    )


@pytest.mark.parametrize(
    ("message", "refused"),
    [
        ({"jsonrpc": "2.0", "id": 1, "method": "tools/call"}, False),
        ({"jsonrpc": "2.0", "method": "notifications/cancelled"}, False),
        ({"jsonrpc": "2.0", "id": 4, "result": {}}, False),
        ({"jsonrpc": "2.0", "id": 4, "error": {"code": 1}}, False),
        ({"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "t"}}, True),
        ({"jsonrpc": "2.0", "method": "ping"}, True),
        ({"jsonrpc": "2.0", "id": 1, "method": 7}, True),
        ({"jsonrpc": "2.0", "params": {"name": "t"}}, True),
        ({"jsonrpc": "2.0", "id": 1}, True),
    ],
)
def test_only_notifications_go_without_an_id(message: dict[str, Any], refused: bool) -> None:
    """A tools/call without an id would get no answer and so no ledger record: refused."""
    assert (mcp.message_shape(message) is not None) is refused


def test_routing_headers_that_disagree_with_the_body_are_refused_before_anything_is_sent() -> None:
    body = {
        "method": "tools/call",
        "params": {"name": "t", "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28"}},
    }
    good = {"mcp-method": ["tools/call"], "mcp-name": ["t"], "mcp-protocol-version": ["2026-07-28"]}
    assert mcp.routing_mismatch("2026-07-28", good, body) is None
    assert mcp.routing_mismatch("2025-11-25", {}, body) is None  # the handshake era has none
    for name, values in [
        ("mcp-name", ["u"]),
        ("mcp-name", []),
        ("mcp-method", ["tools/list"]),
        ("mcp-name", ["t", "t"]),
    ]:
        assert mcp.routing_mismatch("2026-07-28", {**good, name: values}, body), (name, values)
    other = {"method": "tools/call", "params": {"name": "t", "_meta": {}}}
    assert mcp.routing_mismatch("2026-07-28", good, other)


@pytest.mark.parametrize(
    ("result", "summary"),
    [
        ({"isError": True, "content": [{"type": "text", "text": "declined"}]}, {"isError": True}),
        ({"content": []}, {"isError": False}),
        ({"isError": "yes"}, {"isError": False}),  # only the JSON true is an error flag
        ({"resultType": "complete", "isError": True}, {"isError": True, "resultType": "complete"}),
    ],
)
def test_an_answer_not_stored_still_replays_its_error_flag(
    result: dict[str, Any], summary: dict[str, Any]
) -> None:
    """A failed call whose answer was too large to store must not replay as a success: the
    record keeps the summary, and the replay says what it says."""
    assert mcp.answer_summary({"jsonrpc": "2.0", "id": 1, "result": result}) == summary
    again = mcp.replay(mcp.omitted_answer(summary), "req-2")
    assert again["id"] == "req-2"
    assert again["result"]["content"] == []
    assert again["result"].get("isError", False) is summary["isError"]
    assert again["result"]["_meta"][mcp.META_REPLAY_BODY] == "omitted"
    assert again["result"]["_meta"][mcp.META_REPLAYED] is True


def test_an_error_answer_has_no_summary_and_a_record_without_one_replays_as_before() -> None:
    assert mcp.answer_summary({"id": 1, "error": {"code": -32603}}) == {}
    assert mcp.omitted_answer(None)["result"] == {
        "content": [],
        "_meta": {"dev.fencegate/replayBody": "omitted", "fencegate/replayBody": "omitted"},
    }
