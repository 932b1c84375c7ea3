"""Path confinement (issue 25): a proxied path may not leave its downstream's base path in
any spelling a server behind the gateway reads as ``..``.

``/proxy/reports/..;/admin/wipe`` (also ``%2e%2e;``, ``..;x=1``) reached ``/admin`` on a real
Tomcat, which drops ``;`` path parameters before it normalises: out of the downstream's base
path and, when ``/admin`` is another downstream, out of a worker's ``downstreams`` scope. The
rule (``adapters/paths.py``): cut a segment at its first ``;``, decode ``%XX`` and ``%uXXXX``
(and fold fullwidth forms) until nothing changes; a ``.`` or ``..`` (or a piece of one between
decoded separators) is refused with 400, and nothing is recorded or sent.

- the pure rule, by table and by hypothesis (dot segments spelled every way, against names
  that merely hold dots);
- the gateway on every store: 400 ``BAD_REQUEST``, ``Fence-Effect-State: NONE``, no record,
  nothing at the counting downstream;
- a real Tomcat (slow): without the rule the gateway takes a worker scoped to ``reports`` to
  ``/admin``; with it the gateway answers 400 and Tomcat's access log shows nothing.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import hypothesis.strategies as st
import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given
from yarl import URL

from fencegate.adapters.paths import escapes_base, segment_core
from fencegate.gateway import http_rules
from fencegate.gateway.app import create_app
from fencegate.gateway.auth import token_sha256
from fencegate.gateway.http_rules import split_proxy_path
from fencegate.ledger.errors import BadRequest
from tests.api import Api, Lease
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.test_proxy import fence_headers
from tests.tomcat_server import TomcatServer

#: Protocol-layer rules, the same on every store: SQLite only (docs/stores.md).
pytestmark = pytest.mark.one_store

#: Segments some server reads as ``.`` or ``..`` (Tomcat: the first five).
ESCAPING = [
    "..;",
    "%2e%2e;",
    "..;x=1",
    ".%2e;",
    "%2E%2e;jsessionid=1",
    ".;",
    "%252e%252e",
    "%25252e%25252e",
    "%u002e%u002e",
    "%U002E.",
    "%25u002e%25u002e",
    "\uff0e\uff0e",
    "%EF%BC%8E%EF%BC%8E",
    ".%ef%bc%8e;a",
    "\u2025",
    "%ef%bc%85%32%65%ef%bc%85%32%65",  # FULLWIDTH PERCENT SIGN, 2, e: twice
    "..%3bx",
    "..%253b",
    "..%2500",
    "a%252f..%252fadmin",
    "..",
    "%2e",
]
#: Segments that only hold dots (or decode to a name): forwarded as they are.
STAYING = ["a..b", "...", "..a", "a.", ".well-known", "v1.2", "x;..", ";", "a%252fb", "%2541",
           "caf%C3%A9", "%zz", "a;b=..", "%2e%2e%2e"]  # fmt: skip


@pytest.mark.parametrize("segment", ESCAPING)
def test_dot_segments_in_any_spelling_are_refused(segment: str) -> None:
    assert escapes_base(segment), segment_core(segment)
    with pytest.raises(BadRequest, match=r"\. or \.\. segments"):
        split_proxy_path(f"/proxy/reports/{segment}/admin/wipe")


@pytest.mark.parametrize("segment", STAYING)
def test_segments_that_only_hold_dots_pass_as_they_are(segment: str) -> None:
    assert not escapes_base(segment), segment_core(segment)
    assert split_proxy_path(f"/proxy/reports/{segment}/x?y=..;") == (
        "reports",
        f"/{segment}/x?y=..;",
    )


# --- hypothesis: spelled every way ---------------------------------------------------------

#: One ``.`` as a server may read it.
DOT = st.sampled_from([".", "%2e", "%2E", "%u002e", "%U002E", "\uff0e", "%EF%BC%8E", "%ef%bc%8e"])
PARAMS = st.text(alphabet="abc=.;,%", max_size=6)


def _percent_encode_percents(text: str, rounds: int) -> str:
    for _ in range(rounds):
        text = text.replace("%", "%25")
    return text


@st.composite
def escaping_segments(draw: st.DrawFn) -> str:
    dots = draw(st.lists(DOT, min_size=1, max_size=2))
    segment = _percent_encode_percents("".join(dots), draw(st.integers(0, 3)))
    if draw(st.booleans()):
        segment += ";" + draw(PARAMS)
    return segment


@st.composite
def staying_segments(draw: st.DrawFn) -> str:
    name = draw(st.text(alphabet="ab1-_~.", min_size=1, max_size=8).filter(lambda s: s.strip(".")))
    encoded = "".join(f"%{ord(c):02X}" if draw(st.booleans()) and c in ".-_~" else c for c in name)
    segment = _percent_encode_percents(encoded, draw(st.integers(0, 2)))
    if draw(st.booleans()):
        segment += ";" + draw(PARAMS)
    return segment


@given(escaping_segments(), st.sampled_from(["", "a/", "a/b/"]))
def test_a_dot_segment_spelled_any_way_is_refused(segment: str, before: str) -> None:
    with pytest.raises(BadRequest):
        split_proxy_path(f"/proxy/reports/{before}{segment}/admin")


@given(staying_segments())
def test_a_name_with_dots_spelled_any_way_passes_unchanged(segment: str) -> None:
    assert split_proxy_path(f"/proxy/reports/{segment}/x") == ("reports", f"/{segment}/x")


@given(st.text(max_size=12))
def test_a_refusal_is_always_some_reading_of_a_dot_segment(segment: str) -> None:
    """Whatever is refused, a lenient reading of it really is (or holds) a dot segment."""
    if not escapes_base(segment):
        return
    core = segment_core(segment)
    pieces = [] if core is None else core.replace("\\", "/").replace("\x00", "/").split("/")
    assert core is None or any(p in (".", "..") for p in pieces), (segment, core)


# --- the gateway, on every store -----------------------------------------------------------

#: Request targets the gateway refuses (raw: no client library normalises them first).
ATTACKS = [
    "/proxy/api/reports/..;/admin/wipe",
    "/proxy/api/reports/%2e%2e;/admin/wipe",
    "/proxy/api/reports/..;x=1/admin/wipe",
    "/proxy/api/reports/.%2e;/admin/wipe",
    "/proxy/api/reports/%252e%252e/admin/wipe",
    "/proxy/api/reports/%u002e%u002e/admin/wipe",
    "/proxy/api/reports/%EF%BC%8E%EF%BC%8E/admin/wipe",
    "/proxy/api/..;/ok/x",
]


@pytest.fixture
async def api(store_url: str, key_prefix: str, downstream: Downstream) -> AsyncIterator[Api]:
    config = make_config(
        store_url,
        key_prefix,
        reconciler={"enabled": False},
        downstreams=[{"name": "api", "url": downstream.url, "timeout_ms": 5000}],  # type: ignore[list-item]
    )
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


async def raw_request(
    client: TestClient[Any, Any], method: str, target: str, headers: dict[str, str]
) -> tuple[int, dict[str, str], bytes]:
    """``target`` exactly as written (``encoded=True``: yarl neither decodes nor resolves)."""
    url = URL(str(client.make_url("/")).rstrip("/") + target, encoded=True)
    async with client.session.request(
        method, url, headers=headers, data=b'{"wipe":true}' if method == "POST" else None
    ) as answer:
        return answer.status, dict(answer.headers), await answer.read()


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_the_gateway_refuses_and_nothing_is_recorded_or_sent(
    api: Api, downstream: Downstream, method: str
) -> None:
    await api.put("t1")
    lease = await api.claim("t1", ttl_ms=30_000)
    for i, target in enumerate(ATTACKS):
        status, headers, body = await raw_request(
            api.client, method, target, fence_headers(lease, f"s{i}")
        )
        assert status == 400, (target, body)
        assert b'"BAD_REQUEST"' in body and b"segments" in body, body
        assert headers["Fence-Effect-State"] == "NONE"
    assert downstream.received == []
    listed = await api.call("GET", "/v1/effects")
    assert listed.body["effects"] == []
    # ... while a name that merely holds dots goes out, once, as written.
    status, _, body = await raw_request(
        api.client, method, "/proxy/api/ok/a..b;v=1", fence_headers(lease, "fine")
    )
    assert status == 200, body
    assert [r.path for r in downstream.received] == ["/ok/a..b;v=1"]


# --- a real Tomcat (slow) ------------------------------------------------------------------

ADMIN_BODY = "ADMIN WIPE REACHED\n"
TOMCAT_ATTACKS = ["..;", "%2e%2e;", "..;x=1", ".%2e;"]
WORKER_TOKEN = "tok-path-worker-0123456789"
SCHEDULER_TOKEN = "tok-path-scheduler-0123456789"


@pytest.fixture(scope="module")
def tomcat(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TomcatServer]:
    server = TomcatServer(
        tmp_path_factory.mktemp("tomcat"),
        {"admin/wipe": ADMIN_BODY, "reports/index.txt": "reports\n"},
    ).start()
    yield server
    server.stop()


@pytest.fixture
async def scoped(tmp_path: Path, tomcat: TomcatServer) -> AsyncIterator[TestClient[Any, Any]]:
    """The gateway in front of the Tomcat: ``reports`` and ``admin`` are two downstreams (two
    apps of one server), and the worker may call ``reports`` only."""
    config = make_config(
        f"sqlite:///{tmp_path / 'gw.db'}",
        reconciler={"enabled": False},
        downstreams=[  # type: ignore[arg-type]
            {"name": "reports", "url": f"{tomcat.url}/reports", "timeout_ms": 5000},
            {"name": "admin", "url": f"{tomcat.url}/admin", "timeout_ms": 5000},
        ],
        auth={
            "principals": [
                {"name": "worker", "roles": ["worker"], "downstreams": ["reports"],
                 "token_sha256": token_sha256(WORKER_TOKEN)},
                {"name": "scheduler", "roles": ["scheduler"],
                 "token_sha256": token_sha256(SCHEDULER_TOKEN)},
            ]
        },
    )  # fmt: skip
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


async def _worker_lease(client: TestClient[Any, Any], task_id: str) -> Lease:
    scheduler = {"Fence-Authorization": f"Bearer {SCHEDULER_TOKEN}"}
    async with client.put(
        f"/v1/tasks/{task_id}", json={"inputDigest": "in-1"}, headers=scheduler
    ) as put:
        assert put.status == 201, await put.text()
    async with client.post(
        f"/v1/tasks/{task_id}/claim",
        json={"owner": "worker", "ttlMs": 30_000, "schedulerEpoch": 1},
        headers={"Fence-Authorization": f"Bearer {WORKER_TOKEN}"},
    ) as claimed:
        body = await claimed.json()
        assert claimed.status == 200, body
    return Lease(task_id, body["attemptId"], body["claimGeneration"], "worker",
                 body["schedulerEpoch"], body["cancelGeneration"], body["leaseExpiresAt"],
                 body["inputDigest"])  # fmt: skip


def _as_worker(lease: Lease, slot: str) -> dict[str, str]:
    return {"Fence-Authorization": f"Bearer {WORKER_TOKEN}", **fence_headers(lease, slot)}


def _seen_after(
    tomcat: TomcatServer, before: int, wanted: Callable[[list[str]], bool]
) -> list[str]:
    """Tomcat's access log lines after the first ``before``, once ``wanted`` holds (it writes
    a line after it answered), within a bounded wait."""
    deadline = time.monotonic() + 10
    while True:
        lines = tomcat.requests()[before:]
        if wanted(lines) or time.monotonic() > deadline:
            return lines


def _settled(tomcat: TomcatServer, before: int) -> list[str]:
    """Everything Tomcat logged after ``before``, up to a sentinel request sent straight to it
    now (so a line still being written for an earlier request is not missed)."""
    marker = f"/reports/index.txt?sentinel={time.monotonic_ns()}"
    with urllib.request.urlopen(tomcat.url + marker, timeout=10) as answer:
        assert answer.status == 200
    lines = _seen_after(tomcat, before, lambda seen: any(marker in line for line in seen))
    return [line for line in lines if "sentinel=" not in line]


@pytest.mark.slow
async def test_without_the_rule_a_worker_reaches_admin_on_tomcat(
    tomcat: TomcatServer, scoped: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hole, shown first (so the test below is not vacuous): with the old rule (a single
    unquote, no ``;``) the gateway forwards ``..;`` and Tomcat serves ``/admin``, to a worker
    whose scope holds only ``reports``."""
    monkeypatch.setattr(http_rules, "escapes_base", lambda s: unquote(s) in (".", ".."))
    lease = await _worker_lease(scoped, "hole")
    direct = await raw_request(scoped, "GET", "/proxy/admin/wipe", _as_worker(lease, "d"))
    assert direct[0] == 403  # the scope holds for the plain spelling ...
    for i, segment in enumerate(TOMCAT_ATTACKS):
        before = len(tomcat.requests())
        target = f"/proxy/reports/{segment}/admin/wipe"
        status, _, body = await raw_request(scoped, "GET", target, _as_worker(lease, f"h{i}"))
        assert (status, body.decode()) == (200, ADMIN_BODY), target  # ... not for this one
        seen = _seen_after(tomcat, before, bool)
        assert seen == [f"GET /reports/{segment}/admin/wipe HTTP/1.1 200"], seen


@pytest.mark.slow
@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_the_gateway_answers_400_and_tomcat_sees_nothing(
    tomcat: TomcatServer, scoped: TestClient[Any, Any], method: str
) -> None:
    lease = await _worker_lease(scoped, f"fixed-{method.lower()}")
    before = len(tomcat.requests())
    for i, segment in enumerate([*TOMCAT_ATTACKS, "%252e%252e", "%u002e%u002e"]):
        target = f"/proxy/reports/{segment}/admin/wipe"
        status, headers, body = await raw_request(
            scoped, method, target, _as_worker(lease, f"f{i}")
        )
        assert status == 400, (target, body)
        assert b'"BAD_REQUEST"' in body and ADMIN_BODY.encode() not in body
        assert headers["Fence-Effect-State"] == "NONE"
    assert _settled(tomcat, before) == []
    # The worker's own downstream still answers through the gateway.
    status, _, body = await raw_request(
        scoped, "GET", "/proxy/reports/index.txt", _as_worker(lease, "ok")
    )
    assert (status, body) == (200, b"reports\n")
