"""The proxy's pure rules, without a socket: paths, headers, payload digests, effect ids."""

from __future__ import annotations

import hashlib
import json
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import hypothesis.strategies as st
import pytest
from hypothesis import given

from fencegate.gateway.http_rules import (
    canonical_body,
    downstream_request_headers,
    refuse_method_override,
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


#: The proxy's call of ``downstream_request_headers`` for a downstream with default names.
RULES: dict[str, Any] = {
    "forward_authorization": False,
    "reserved": ("Idempotency-Key", "Fencing-Token"),
    "peer": "127.0.0.1",
}


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
    out = downstream_request_headers(agent, identity, **RULES)
    assert sorted(name for name, _ in out.items()) == sorted(
        ["Accept", "X-Many", "X-Many", "Idempotency-Key", "Fencing-Token", "X-Forwarded-For"]
    )
    assert out.getall("X-Many") == ["1", "2"]
    assert out["Idempotency-Key"] == "e" * 64
    kept = downstream_request_headers(agent, identity, **{**RULES, "forward_authorization": True})
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


# --- issue 11: strict JSON digests ---------------------------------------------------------

JSON = "application/json"


@pytest.mark.parametrize(
    "body",
    [
        b'{"amount":1,"amount":5000}',
        b'{"a":{"x":1,"x":1}}',  # even the same value twice
        b'[{"k":1,"\\u006b":2}]',  # the same key, escaped
        b'{"amount":NaN}',
        b"[Infinity]",
        b'{"a":-Infinity}',
        b'"\\ud800"',  # a lone surrogate: not Unicode
        b'{"\\udfff":1}',
    ],
)
def test_json_bodies_that_parsers_read_differently_are_refused(body: bytes) -> None:
    with pytest.raises(BadRequest):
        canonical_body(body, JSON)
    with pytest.raises(BadRequest):
        canonical_body(body, "application/merge-patch+json")
    assert canonical_body(body, "text/plain") == body  # other types: the bytes, as they are


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (b"100.000000000000000001", b"100.0"),
        (b'{"amount":100.000000000000000001}', b'{"amount":100.0}'),
        (b"[1e400]", b"[1e401]"),  # both read as infinity
        (b"[-0]", b"[0]"),
        (b"[1]", b"[1.0]"),  # int and float are different types in many parsers
        (b"[1e-400]", b"[0.0]"),  # underflow
        (b"[9007199254740993.0]", b"[9007199254740992.0]"),  # past a double's precision
    ],
)
def test_numbers_are_never_rounded_into_another_payload(one: bytes, other: bytes) -> None:
    assert canonical_body(one, JSON) != canonical_body(other, JSON)


def test_numbers_equal_in_value_keep_the_ordinary_canonical_form() -> None:
    """What the digest took before issue 11 is unchanged for ordinary bodies: an agent's
    retry across the upgrade still replays."""
    assert canonical_body(b'{"b": 1.50, "a": 1e2}', JSON) == b'{"a":100.0,"b":1.5}'
    assert canonical_body(b"[1.0, 1.00, 10E-1]", JSON) == b"[1.0,1.0,1.0]"
    assert canonical_body(b'{"n": 12345678901234567890123}', JSON) == (
        b'{"n":12345678901234567890123}'
    )


def test_a_lossy_number_makes_the_body_count_byte_for_byte() -> None:
    body = b'{"b": 100.000000000000000001, "a": 1}'
    assert canonical_body(body, JSON) == body
    assert canonical_body(b'{"a": 1, "b": 100.000000000000000001}', JSON) != body


LITERALS = (
    st.decimals(allow_nan=False, allow_infinity=False, places=None).map(str)
    | st.integers().map(str)
    | st.sampled_from(["-0", "0.0", "-0.0", "1e400", "1E-400", "0.1", "0.10", "1e1", "10.0"])
)


@given(LITERALS, LITERALS)
def test_two_numbers_share_a_digest_only_when_equal_in_value_and_kind(a: str, b: str) -> None:
    if canonical_body(f"[{a}]".encode(), JSON) == canonical_body(f"[{b}]".encode(), JSON):
        assert Decimal(a) == Decimal(b)
        assert any(c in a for c in ".eE") == any(c in b for c in ".eE")
        assert a.startswith("-") == b.startswith("-") or Decimal(a) != 0


# --- issue 11: safe methods and what the downstream sees ------------------------------------


def test_the_agents_own_identity_headers_never_cross_even_on_a_safe_method() -> None:
    agent = [("Idempotency-Key", "mine"), ("fencing-token", "9.9"), ("X-Key", "k")]
    # A safe method: no identity from the gateway, the configured names are still reserved.
    out = downstream_request_headers(agent, {}, **{**RULES, "reserved": ("X-Key", "Fencing-Token")})
    assert "X-Key" not in out and "Fencing-Token" not in out
    assert out["Idempotency-Key"] == "mine"  # not this downstream's name: an ordinary header
    out = downstream_request_headers(agent, {}, **RULES)
    assert "Idempotency-Key" not in out and "Fencing-Token" not in out and out["X-Key"] == "k"


def test_client_claims_are_dropped_and_the_peer_is_appended() -> None:
    agent = [
        ("Forwarded", "for=10.0.0.1"),
        ("X-Real-IP", "10.0.0.1"),
        ("X-Forwarded-For", "10.0.0.2, 10.0.0.3"),
        ("x-forwarded-for", "10.0.0.4"),
    ]
    out = downstream_request_headers(agent, {}, **RULES)
    assert "Forwarded" not in out and "X-Real-IP" not in out
    assert out.getall("X-Forwarded-For") == ["10.0.0.2, 10.0.0.3, 10.0.0.4, 127.0.0.1"]
    alone = downstream_request_headers([], {}, **{**RULES, "peer": None})
    assert alone.getall("X-Forwarded-For") == ["unknown"]
    listed = [("Connection", "X-Forwarded-For"), ("X-Forwarded-For", "10.0.0.9")]
    assert downstream_request_headers(listed, {}, **RULES)["X-Forwarded-For"] == "127.0.0.1"


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS"])
@pytest.mark.parametrize(
    ("headers", "target"),
    [
        ([("X-HTTP-Method-Override", "DELETE")], "/items/1"),
        ([("x-http-method", "POST")], "/items"),
        ([("X-Method-Override", "PUT")], "/items/1"),
        ([], "/items/1?_method=DELETE"),
        ([], "/items/1?a=1&_METHOD=delete"),
        ([], "/items/1?a=1;_method=DELETE"),
        ([], "/items/1?%5Fmethod=DELETE"),
        ([], "/items/1?_method"),
        # As a CGI, WSGI, PHP or Rack server reads field names (HTTP_X_HTTP_METHOD_OVERRIDE):
        ([("X_HTTP_Method_Override", "DELETE")], "/items/1"),
        ([("x-http_method", "DELETE")], "/items/1"),
        ([("X-Method_Override", "DELETE")], "/items/1"),
        # Any other separator: lighttpd's CGI reads every non-alphanumeric as _, PHP a ".".
        ([("X.HTTP.Method.Override", "DELETE")], "/items/1"),
        ([("X~HTTP~Method~Override", "DELETE")], "/items/1"),
        ([("x!http*method", "DELETE")], "/items/1"),
        # As PHP reads query names into $_GET (where Laravel and Symfony look):
        ([], "/items/1?.method=DELETE"),
        ([], "/items/1?[method=DELETE"),
        ([], "/items/1?_method[]=DELETE"),
        ([], "/items/1?_method[x]=DELETE"),
        ([], "/items/1?_method%00=DELETE"),
        ([], "/items/1?%20_method=DELETE"),
        ([], "/items/1?_METHOD%5B%5D=DELETE"),
    ],
)
def test_a_method_override_on_a_safe_method_is_refused(
    method: str, headers: list[tuple[str, str]], target: str
) -> None:
    with pytest.raises(BadRequest, match="method override"):
        refuse_method_override(method, headers, target)
    refuse_method_override("POST", headers, target)  # a recorded effect either way


@pytest.mark.parametrize(
    "target",
    ["/items?method=x", "/items?x_method=1", "/_method?a=1", "/", "/items?_methods=1",
     "/items?_method_=1", "/items?a[_method]=1", "/items?x.method=1"],
)  # fmt: skip
def test_near_misses_are_not_overrides(target: str) -> None:
    refuse_method_override("GET", [("X-HTTP-Method-Overrides", "x")], target)


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("application/x-www-form-urlencoded", b"to=a&_method=DELETE"),
        ("application/x-www-form-urlencoded; charset=utf-8", b"to=a;%5Fmethod=DELETE"),
        ("Application/X-WWW-Form-Urlencoded", b"_METHOD[]=delete"),
        ("application/json", b'{"to": "a", "_method": "DELETE"}'),
        ("application/merge-patch+json", b'{"_Method": "DELETE"}'),
        ("text/json", b'{"_method": "DELETE"}'),
        ("", b"to=a&_method=DELETE"),  # Rack reads a POST without a media type as a form
        (
            "multipart/form-data; boundary=b",
            b"--b\r\nContent-Disposition: form-data; name=_method\r\n\r\nDELETE",
        ),
        (
            "multipart/form-data; boundary=b",
            b"--b\r\ncontent-disposition : form-data; NAME = '_method'\r\n",
        ),
        (
            "multipart/form-data; boundary=b",
            b"--b\r\nContent-Disposition: form-data; name*=utf-8''_method\r\n",
        ),
        (
            "multipart/form-data; boundary=b",
            b'--b\r\nContent-Disposition: form-data; name="_method"\r\n\r\nDELETE\r\n--b--\r\n',
        ),
    ],
)
def test_a_method_override_in_the_body_is_refused_where_overrides_are(
    content_type: str, body: bytes
) -> None:
    """Rails and Laravel read ``_method`` from a form (and Laravel from JSON); an operator
    approving a POST sees its query, never its body (a third red-team pass)."""
    headers = [("Content-Type", content_type)]
    with pytest.raises(BadRequest, match="body field _method"):
        refuse_method_override("POST", headers, "/send", body, approval_required=True)
    with pytest.raises(BadRequest, match="body field _method"):
        refuse_method_override("GET", headers, "/items", body)
    refuse_method_override("POST", headers, "/send", body)  # recorded as what it is anyway


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("application/x-www-form-urlencoded", b"method=DELETE&x_method=1"),
        ("text/plain", b"_method=DELETE"),
        ("application/octet-stream", b"_method=DELETE"),
        ("application/json", b'{"a": {"_method": "DELETE"}}'),
        ("application/json", b'["_method"]'),
        ("application/json", b"{not json"),
        ("application/json", b"[" * 100_000 + b"]" * 100_000),
        ("multipart/form-data; boundary=b", b'--b\r\nX: name="_method"\r\n\r\n1\r\n--b--'),
    ],
)
def test_body_near_misses_are_not_overrides(content_type: str, body: bytes) -> None:
    refuse_method_override(
        "POST", [("Content-Type", content_type)], "/send", body, approval_required=True
    )
