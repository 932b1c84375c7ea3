"""The proxy's pure rules, without a socket: paths, headers, payload digests, effect ids."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import hypothesis.strategies as st
import pytest
from hypothesis import given

from fencegate.gateway.http_rules import (
    canonical_body,
    downstream_request_headers,
    split_proxy_path,
    stored_response_headers,
    upstream_response_headers,
)
from fencegate.ledger.effects import effect_id, payload_digest
from fencegate.ledger.errors import BadRequest
from fencegate.ledger.redis_store import load_script_source
from tests.servers import RedisServer

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=3),
    max_leaves=10,
)  # fmt: skip


@given(JSON_VALUES, st.sampled_from([None, 2]), st.booleans())
def test_json_bodies_digest_the_same_whatever_the_key_order_or_spacing(
    value: Any, indent: int | None, sort: bool
) -> None:
    compact = json.dumps(value).encode()
    other = json.dumps(value, indent=indent, sort_keys=sort).encode()
    assert canonical_body(compact, "application/json") == canonical_body(other, "application/json")
    assert canonical_body(compact, "application/merge-patch+json; charset=utf-8") == (
        canonical_body(other, "application/json")
    )


def test_non_json_bodies_are_digested_byte_for_byte() -> None:
    assert canonical_body(b'{"b":1, "a":2}', "text/plain") == b'{"b":1, "a":2}'
    assert canonical_body(b"{not json", "application/json") == b"{not json"
    assert canonical_body(b"", "application/json") == b""


def test_payload_digest_binds_method_downstream_path_and_body() -> None:
    base = payload_digest("POST", "pay", "/charge?x=1", b"{}")
    assert len(base) == 64
    assert base != payload_digest("PUT", "pay", "/charge?x=1", b"{}")
    assert base != payload_digest("POST", "mail", "/charge?x=1", b"{}")
    assert base != payload_digest("POST", "pay", "/charge?x=2", b"{}")
    assert base != payload_digest("POST", "pay", "/charge?x=1", b"[]")


def test_effect_id_is_the_contract_hash() -> None:
    raw = json.dumps(["t/1", 3, "main", "email"], separators=(",", ":")).encode()
    assert effect_id("t/1", 3, "main", "email") == hashlib.sha256(raw).hexdigest()


IDS = st.text(alphabet="ABCXYZabcxyz0189._:@/-", min_size=1, max_size=200)


def test_lua_effect_id_matches_python(tmp_path: Path) -> None:
    """The Redis store computes effectId inside its script (pure-Lua SHA-256)."""
    server = RedisServer(tmp_path).start()
    client = server.client()
    try:
        source = load_script_source("prepare").split("-- Step one of a proxied")[0]
        script = client.register_script(
            source + "\nreturn effect_id(ARGV[1], ARGV[2], ARGV[3], ARGV[4])"
        )

        @given(IDS, st.integers(1, 2**31), IDS, IDS)
        def check(task: str, revision: int, node: str, slot: str) -> None:
            got = script(args=[task, revision, node, slot])
            assert got == effect_id(task, revision, node, slot)

        check()
    finally:
        client.close()
        server.stop()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("/proxy/pay/charges", ("pay", "/charges")),
        ("/proxy/pay", ("pay", "")),
        ("/proxy/pay/", ("pay", "/")),
        ("/proxy/pay/a%20b/c?x=%2F&y=..", ("pay", "/a%20b/c?x=%2F&y=..")),
        ("/proxy/pay/a..b/...", ("pay", "/a..b/...")),
    ],
)
def test_allowed_paths_pass_through_still_encoded(raw: str, expected: tuple[str, str]) -> None:
    assert split_proxy_path(raw) == expected


@given(st.text(alphabet="abc./%2eEfF5cC\\", max_size=20))
def test_no_path_that_passes_can_climb_out_of_the_base(tail: str) -> None:
    try:
        _, out = split_proxy_path("/proxy/pay/" + tail)
    except BadRequest:
        return
    path = out.split("?", 1)[0]
    for segment in path.split("/"):
        assert unquote(segment) not in (".", "..")
        assert "/" not in unquote(segment) and "\\" not in unquote(segment)


def test_request_headers_lose_hop_by_hop_fence_and_credentials() -> None:
    agent = [
        ("Host", "gateway"),
        ("Connection", "keep-alive, X-Secret"),
        ("X-Secret", "1"),
        ("Keep-Alive", "timeout=5"),
        ("TE", "trailers"),
        ("Transfer-Encoding", "chunked"),
        ("Content-Length", "10"),
        ("Fence-Task", "t"),
        ("fence-attempt", "a"),
        ("Authorization", "Bearer agent"),
        ("idempotency-key", "mine"),
        ("Accept", "application/json"),
        ("X-Many", "1"),
        ("X-Many", "2"),
    ]
    identity = {"Idempotency-Key": "e" * 64, "Fencing-Token": "1.2"}
    out = downstream_request_headers(agent, identity, forward_authorization=False)
    assert sorted(name for name, _ in out.items()) == sorted(
        ["Accept", "X-Many", "X-Many", "Idempotency-Key", "Fencing-Token"]
    )
    assert out.getall("X-Many") == ["1", "2"]
    assert out["Idempotency-Key"] == "e" * 64
    kept = downstream_request_headers(agent, identity, forward_authorization=True)
    assert kept["Authorization"] == "Bearer agent"


def test_response_headers_for_live_answers_and_for_replays() -> None:
    answer = [
        ("Content-Type", "application/json"),
        ("Content-Length", "2"),
        ("Connection", "close, X-Hop"),
        ("X-Hop", "1"),
        ("Set-Cookie", "a=1"),
        ("Fence-Replayed", "true"),
        ("ETag", '"v1"'),
    ]
    live = upstream_response_headers(answer)
    assert sorted(live.keys()) == ["Content-Type", "ETag", "Set-Cookie"]
    assert stored_response_headers(answer) == [
        ["Content-Type", "application/json"],
        ["ETag", '"v1"'],
    ]
