"""``conditional`` re-sends an UNKNOWN effect only under a precondition that fails once the
request was applied, as it reaches the downstream (issue 25).

A strong ``If-Match`` entity-tag list (every member strong) or ``If-None-Match: *`` does; but
``If-Match: *`` matches whatever the first delivery left behind, ``If-None-Match: "x"`` still
passes (the new tag is another one), a weak tag is compared in the downstream's own way, and
a precondition the agent's own ``Connection`` nominates is stripped before the forward (hop by
hop). Without this, a spec-following downstream applied such a re-send a second time. The pure
rule is ``adapters/preconditions.py``; the story counts writes at a downstream that evaluates
preconditions as RFC 9110 13.2.2 says.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fencegate.adapters import ConditionalAdapter, HttpAdapter
from fencegate.adapters.base import Outgoing
from fencegate.adapters.kinds import ALWAYS_MS
from fencegate.adapters.preconditions import connection_listed, makes_resend_safe, reaching
from fencegate.gateway.app import create_app
from fencegate.gateway.http_rules import downstream_request_headers
from tests.api import Api, serve_app
from tests.clocks import still
from tests.conftest import build_test_store, make_config
from tests.test_adapters import call, record

#: Protocol-layer rules, the same on every store: SQLite only (docs/stores.md).
pytestmark = pytest.mark.one_store

# --- the pure rule ----------------------------------------------------------------------------

SAFE: list[tuple[list[tuple[str, str]], bool]] = [
    ([], False),
    ([("If-Match", '"abc"')], True),
    ([("if-match", '"abc"')], True),
    ([("If-Match", '"a", "b"')], True),  # a list of strong tags: every one is strong
    ([("If-Match", ' "a" ,"b" ')], True),
    ([("If-Match", '"a,b"')], True),  # a comma inside a tag is part of it
    ([("If-Match", '""')], True),
    ([("If-Match", '"a"'), ("If-Match", '"b"')], True),  # two field lines, both strong
    ([("If-Match", "*")], False),  # matches what the first delivery left behind
    ([("If-Match", 'W/"abc"')], False),  # weak: compared in the downstream's own way
    ([("If-Match", '"a", W/"b"')], False),
    ([("If-Match", '"a", *')], False),
    ([("If-Match", '"a"'), ("If-Match", "*")], False),
    ([("If-Match", "abc")], False),  # not an entity-tag
    ([("If-Match", "")], False),
    ([("If-Match", '"a",')], False),
    ([("If-Match", '"a" "b"')], False),
    ([("If-Match", '"a\x7fb"')], False),
    ([("If-None-Match", "*")], True),
    ([("If-None-Match", " * ")], True),
    ([("If-None-Match", '"x"')], False),  # passes again after the first delivery
    ([("If-None-Match", 'W/"x"')], False),
    ([("If-None-Match", '*, "x"')], False),
    ([("If-None-Match", "*"), ("If-None-Match", "*")], False),
    ([("If-Match", "*"), ("If-None-Match", "*")], True),  # If-None-Match: * is enough
    ([("If-Match", '"a"'), ("If-None-Match", '"x"')], True),  # the strong If-Match is enough
]


@pytest.mark.parametrize(("preconditions", "safe"), SAFE)
def test_which_preconditions_make_a_resend_safe(
    preconditions: list[tuple[str, str]], safe: bool
) -> None:
    assert makes_resend_safe(preconditions) is safe
    window = ConditionalAdapter().resend_window_ms(preconditions)
    assert window == (ALWAYS_MS if safe else None)


def test_a_precondition_counts_only_if_it_reaches_the_downstream() -> None:
    pairs = [("If-Match", '"v1"'), ("If-None-Match", "*")]
    assert reaching(pairs, [("Connection", "keep-alive")]) == tuple(pairs)
    assert reaching(pairs, [("Connection", "keep-alive, IF-MATCH")]) == (("If-None-Match", "*"),)
    two_lines = [("Connection", "close"), ("connection", " if-none-match ,if-match")]
    assert reaching(pairs, two_lines) == ()
    assert connection_listed(two_lines) == {"close", "if-none-match", "if-match"}
    # Nominated in another spelling (a red-team pass): the proxy drops If-Match for it, so
    # it does not reach the downstream, and must not count as a precondition that does.
    for spelling in ("If_Match", "if.match", "IF~MATCH"):
        assert reaching(pairs, [("Connection", spelling)]) == (("If-None-Match", "*"),)
    # A name the gateway sets itself replaces the agent's value.
    assert reaching(pairs, [], replaced=("if-match",)) == (("If-None-Match", "*"),)


def _put(*headers: tuple[str, str]) -> Outgoing:
    return Outgoing("PUT", "docs", "/docs/d", headers, b"v2", "s1")


def test_the_conditional_adapter_asks_what_reaches_the_downstream() -> None:
    adapter = ConditionalAdapter()
    strong = adapter.effect_of(_put(("If-Match", '"v1"')))
    assert strong.preconditions == (("If-Match", '"v1"'),)
    assert adapter.resend_window_ms(strong.preconditions) == ALWAYS_MS
    stripped = adapter.effect_of(_put(("If-Match", '"v1"'), ("Connection", "If-Match")))
    assert stripped.preconditions == ()
    assert adapter.resend_window_ms(stripped.preconditions) is None
    # The payload digest is the one it always was: all preconditions the agent sent.
    assert stripped.payload_digest == strong.payload_digest
    # What the proxy sends agrees: the nominated field does not go out.
    out = downstream_request_headers(
        [("If-Match", '"v1"'), ("Connection", "If-Match")], {},
        forward_authorization=False, reserved=(), peer="127.0.0.1",
    )  # fmt: skip
    assert "If-Match" not in out and "Connection" not in out
    # A gateway-set header of the same name (absurd, but then the agent's value is gone).
    odd = ConditionalAdapter(idempotency_key_header="If-Match")
    assert odd.effect_of(_put(("If-Match", '"v1"'))).preconditions == ()
    assert HttpAdapter().effect_of(_put(("If-Match", '"v1"'))).preconditions == ()


# --- the story: a spec-following downstream, writes counted --------------------------------------

#: Only bounds a hang: the lost answer is a connection closed at once, not a timeout.
TIMEOUT_MS = 10_000


class Documents:
    """``PATCH /docs/{name}``: preconditions evaluated as RFC 9110 13.2.2 says (``If-Match``
    strong comparison, ``*`` = any current representation; ``If-None-Match`` weak comparison,
    ``*`` = any), every passing request a write with a new ETag. With ``lose_answers`` a
    write's connection closes before its answer leaves: the gateway certainly delivered it and
    gets no answer (UNKNOWN) at once, however loaded the machine. Every answer closes its
    connection, so no pooled connection is reused under a later call."""

    def __init__(self) -> None:
        self.docs: dict[str, tuple[bytes, str]] = {"d": (b"v1", '"v1"')}
        self.received = 0
        self.writes = 0
        self.lose_answers = False
        self.runner: web.AppRunner | None = None
        self.url = ""

    @staticmethod
    def _tags(request: web.Request, name: str) -> list[str] | None:
        lines = request.headers.getall(name, [])
        if not lines:
            return None
        return [tag.strip() for line in lines for tag in line.split(",") if tag.strip()]

    def _passes(self, request: web.Request, current: tuple[bytes, str] | None) -> bool:
        if_match = self._tags(request, "If-Match")
        if if_match is not None:
            if current is None:
                return False
            if "*" not in if_match and current[1] not in if_match:  # W/ never equals
                return False
        if_none_match = self._tags(request, "If-None-Match")
        if if_none_match is not None and current is not None:
            if "*" in if_none_match:
                return False
            if current[1] in [t.removeprefix("W/") for t in if_none_match]:
                return False
        return True

    async def _write(self, request: web.Request) -> web.Response:
        self.received += 1
        body = await request.read()
        name = request.match_info["name"]
        if not self._passes(request, self.docs.get(name)):
            answer = web.Response(status=412, text="precondition failed")
        else:
            self.writes += 1
            etag = f'"v{self.writes + 1}"'
            self.docs[name] = (body, etag)
            answer = web.Response(status=200, headers={"ETag": etag})
            if self.lose_answers:
                assert request.transport is not None
                request.transport.close()  # written; aiohttp refuses to send the answer
        answer.force_close()
        return answer

    async def start(self) -> Documents:
        app = web.Application()
        app.router.add_patch("/docs/{name}", self._write)
        self.runner, self.url = await serve_app(app, shutdown_timeout=0.5)
        return self


@pytest.fixture
async def documents() -> AsyncIterator[Documents]:
    server = await Documents().start()
    yield server
    assert server.runner is not None
    await server.runner.cleanup()


@pytest.fixture
async def api(store_url: str, key_prefix: str, documents: Documents) -> AsyncIterator[Api]:
    config = make_config(
        store_url,
        key_prefix,
        downstreams=[
            {
                "name": "docs",
                "adapter": "conditional",
                "url": documents.url,
                "timeout_ms": TIMEOUT_MS,
            }
        ],
        # Not about the start limit: wide, and the forward clock stands still.
        proxy={"prepared_margin_ms": 20_000, "forward_start_limit_ms": 10_000},
        reconciler={"enabled": False},
    )
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


@pytest.mark.parametrize(
    "headers",
    [
        {"If-Match": "*"},
        {"If-None-Match": '"v0"'},
        {"If-Match": '"v1"', "Connection": "If-Match"},
        {"If-Match": '"v1"', "Connection": "If_Match"},
    ],
    ids=[
        "if-match-star",
        "if-none-match-tag",
        "if-match-stripped-by-connection",
        "if-match-stripped-by-connection-spelled-with-underscore",
    ],
)
async def test_a_precondition_that_passes_again_is_never_resent(
    api: Api, documents: Documents, headers: dict[str, str]
) -> None:
    await api.put("t1")
    lease = await api.claim("t1", ttl_ms=30_000)
    documents.lose_answers = True
    lost = await call(api, lease, "PATCH", "docs/docs/d", data=b"v2", headers=headers)
    documents.lose_answers = False
    assert lost.status == 504 and lost.headers["Fence-Effect-State"] == "UNKNOWN"
    assert documents.received == 1 and documents.writes == 1
    retry = await call(api, lease, "PATCH", "docs/docs/d", data=b"v2", headers=headers)
    # Before: re-sent, and the downstream, following the spec, wrote it a second time.
    assert retry.status == 409 and retry.headers["Fence-Effect-State"] == "UNKNOWN", retry.body
    assert documents.received == 1 and documents.writes == 1
    rec = await record(api, lost.headers["Fence-Effect-Id"])
    assert rec["state"] == "UNKNOWN" and len(rec["attempts"]) == 1


@pytest.mark.parametrize("headers", [{"If-Match": '"v1"'}, {"If-Match": '"v0", "v1"'}])
async def test_a_strong_if_match_is_resent_and_refused_once_applied(
    api: Api, documents: Documents, headers: dict[str, str]
) -> None:
    await api.put("t1")
    lease = await api.claim("t1", ttl_ms=30_000)
    documents.lose_answers = True
    lost = await call(api, lease, "PATCH", "docs/docs/d", data=b"v2", headers=headers)
    documents.lose_answers = False
    assert lost.status == 504 and lost.headers["Fence-Effect-State"] == "UNKNOWN"
    assert documents.received == 1 and documents.writes == 1
    retry = await call(api, lease, "PATCH", "docs/docs/d", data=b"v2", headers=headers)
    assert retry.status == 412 and retry.headers["Fence-Effect-State"] == "COMMITTED"
    assert documents.received == 2 and documents.writes == 1
