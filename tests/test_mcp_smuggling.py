"""Smuggling through member names at ``/mcp`` (issue 25), and non-finite numbers there.

The gateway reads a JSON-RPC message's members by their exact spelling; a server whose JSON
decoder matches names case-insensitively (Go's ``encoding/json``, under mcp-go) reads others:
``{"name": "charge", "Arguments": {...}}`` was recorded (and approved) with no arguments and run
with the real ones. The rule (``adapters.mcp.member_collision``) refuses such a message before
anything is recorded or sent; ``-32600``, HTTP 200 when it has an id, 400 when it has none.

Three layers: the pure rule (with hypothesis); the gateway in process on every store, in front
of a counting server (nothing reaches it, nothing is recorded); and, in the slow set, a real
standard-library Go JSON-RPC server built with Debian's Go (``tests/fixtures/go_mcp``), which
shows that the smuggled arguments are what it runs when the rule is off, and that the fold
classes of ``adapters.mcp.fold`` cover Go's own (``tests/fixtures/go_fold``).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given
from hypothesis import strategies as st

from fencegate.adapters import mcp
from fencegate.adapters.base import Outgoing
from fencegate.adapters.mcp import McpAdapter
from fencegate.gateway.app import create_app
from fencegate.ledger.payloads import StrictJsonError, strict_loads
from tests.api import mcp_lease, mcp_post, task_effects
from tests.conftest import build_test_store, make_config

#: Protocol-layer rules, the same on every store: SQLite only (docs/stores.md).
pytestmark = pytest.mark.one_store

DOWNSTREAM = "tools"
KELVIN = "\u212a"  # folds to "k"
LONG_S = "\u017f"  # folds to "s"
#: What the agent means to run, smuggled past the gateway's reading in each case below (the
#: Go server's ``charge`` reads these three, into a struct).
REAL = {"account": "acme", "amount": 1000, "key": "k1"}


def call(params: Any, **top: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": params, **top}


#: (name, message): each is read by the gateway as something else than by a Go server.
SMUGGLED: list[tuple[str, Any]] = [
    ("Arguments", call({"name": "charge", "Arguments": REAL})),
    ("arguments-and-Arguments", call({"name": "charge", "arguments": {}, "Arguments": REAL})),
    ("ARGUMENTS", call({"name": "charge", "ARGUMENTS": REAL})),
    ("Name", call({"name": "lookup", "Name": "charge", "arguments": REAL})),
    ("Method", {"jsonrpc": "2.0", "id": 7, "method": "ping", "Method": "tools/call",
                "params": {"name": "charge", "arguments": REAL}}),
    ("long-s-params", {"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                       "params": {"name": "charge", "arguments": {}},
                       f"param{LONG_S}": {"name": "charge", "arguments": REAL}}),
    ("long-s-arguments", call({"name": "charge", f"argument{LONG_S}": REAL})),
    ("kelvin-in-arguments", call({"name": "charge",
                                  "arguments": {**REAL, f"{KELVIN}ey": "k2"}})),
    ("arguments-collide", call({"name": "charge",
                                "arguments": {"account": "acme", "amount": 1, "Amount": 1000}})),
    ("_META", call({"name": "charge", "arguments": REAL, "_META": {"progressToken": 1}})),
    ("meta-collide", call({"name": "charge", "arguments": REAL,
                           "_meta": {"progressToken": 1, "ProgressToken": 2}})),
    ("meta-fencegate-key", call({"name": "charge", "arguments": REAL,
                                 "_meta": {"FENCEGATE/effectId": "forged"}})),
    ("JSONRPC", {"JSONRPC": "1.0", "jsonrpc": "2.0", "id": 7, "method": "tools/call",
                 "params": {"name": "charge", "arguments": REAL}}),
    ("Cursor", {"jsonrpc": "2.0", "id": 7, "method": "tools/list", "params": {"Cursor": "x"}}),
]  # fmt: skip
#: The call those messages smuggle, sent honestly.
HONEST = json.dumps(call({"name": "charge", "arguments": REAL})).encode()
#: Exact duplicates, as raw bodies (a dict cannot hold them): Python keeps the last.
DUPLICATED: list[tuple[str, bytes]] = [
    ("arguments-twice",
     b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge",'
     b'"arguments":{},"arguments":{"account":"acme","amount":1000}}}'),
    ("name-twice",
     b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge",'
     b'"name":"lookup","arguments":{}}}'),
    ("deep-duplicate",
     b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge",'
     b'"arguments":{"items":[{"sku":"a","sku":"b"}]}}}'),
]  # fmt: skip


# --- the pure rule -------------------------------------------------------------------------------


@pytest.mark.parametrize(("case", "message"), SMUGGLED, ids=[c for c, _ in SMUGGLED])
def test_every_smuggled_message_is_refused_as_an_invalid_request(case: str, message: Any) -> None:
    parsed = mcp.read_message(json.dumps(message).encode())
    refused = mcp.refusal(parsed)
    assert refused is not None and refused[0] == -32600, case
    assert mcp.member_collision(message) == refused[1]


@pytest.mark.parametrize(("case", "body"), DUPLICATED, ids=[c for c, _ in DUPLICATED])
def test_an_exact_duplicate_is_refused_whatever_its_depth(case: str, body: bytes) -> None:
    refused = mcp.refusal(mcp.read_message(body))
    assert refused is not None and refused[0] == -32600, case
    assert "twice" in refused[1]


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        ("k", KELVIN, True),
        ("S", LONG_S, True),
        ("arguments", "ARGUMENTS", True),
        ("\u00df", "\u1e9e", True),  # sharp s, capital sharp s: a simple folding
        ("\u03c2", "\u03a3", True),  # final sigma, capital sigma
        ("\u00df", "ss", False),  # a full folding only: Go's EqualFold says no
        ("\u0131", "I", False),  # dotless i
        ("\u0130", "i", False),  # capital I with dot
        ("name", "name ", False),
    ],
)
def test_fold_is_gos_simple_folding(a: str, b: str, equal: bool) -> None:
    assert (mcp.fold(a) == mcp.fold(b)) is equal


def _variants(name: str) -> st.SearchStrategy[str]:
    """Spellings of ``name`` that Go's decoder matches to it: any letter in either case, ``s``
    as LONG S, ``k`` as KELVIN SIGN."""
    choices = []
    for char in name:
        options = {char, char.upper(), char.lower()}
        if char.lower() == "s":
            options.add(LONG_S)
        if char.lower() == "k":
            options.add(KELVIN)
        choices.append(st.sampled_from(sorted(options)))
    return st.tuples(*choices).map("".join)


_WHERE = st.sampled_from(["top", "params", "_meta"])


@given(st.sampled_from(sorted(mcp.READ_MEMBERS)).flatmap(lambda n: st.tuples(st.just(n),
                                                                             _variants(n))),
       _WHERE)  # fmt: skip
def test_a_spelling_of_a_read_member_is_refused_at_every_level_unless_exact(
    names: tuple[str, str], where: str
) -> None:
    name, spelling = names
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                               "params": {"name": "t", "arguments": {}, "_meta": {}}}  # fmt: skip
    target = {"top": message, "params": message["params"], "_meta": message["params"]["_meta"]}
    target[where].setdefault(spelling, "x")
    refused = mcp.member_collision(message)
    assert (refused is None) is (spelling == name), (spelling, refused)


_KEY = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)


@given(st.dictionaries(_KEY, st.integers(), max_size=8))
def test_arguments_are_refused_exactly_when_two_names_fold_equal(arguments: dict[str, int]) -> None:
    """No false alarm: any arguments whose names fold apart pass (names the gateway reads
    included: inside ``arguments`` only collisions count)."""
    message = call({"name": "t", "arguments": arguments})
    clash = len({mcp.fold(k) for k in arguments}) != len(arguments)
    refused = mcp.member_collision(message)
    assert (refused is not None) is clash, refused
    # read back from its bytes, as the gateway does: the same answer
    assert mcp.refusal(mcp.read_message(json.dumps(message).encode())) == (
        None if refused is None else (-32600, refused)
    )


@pytest.mark.parametrize(
    ("raw", "answerable"),
    [
        (b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":1e400}}', True),
        (b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":-1e400}}', True),
        (b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":[NaN]}}', True),
        (b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":Infinity}}', True),
        (b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":-Infinity}}', True),
        (b'{"jsonrpc":"2.0","id":1e400,"method":"ping"}', False),
        (b'{"jsonrpc":"2.0","id":NaN,"method":"ping"}', False),
        (b'{"jsonrpc":"2.0","id":[1,-Infinity],"method":"ping"}', False),
    ],
)
def test_a_non_finite_number_is_invalid_params_and_a_non_finite_id_no_id(
    raw: bytes, answerable: bool
) -> None:
    parsed = mcp.read_message(raw)
    refused = mcp.refusal(parsed)
    assert refused is not None and refused[0] == -32602
    assert mcp.answerable_id(parsed.message) is answerable


def test_finite_numbers_and_large_integers_pass() -> None:
    raw = b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":1e308,"y":' + b"9" * 400 + b"}}"
    assert mcp.refusal(mcp.read_message(raw)) is None


@pytest.mark.parametrize("raw", [b'{"a":1e400}', b'{"a":-1e999}', b'{"a":NaN}', b'[Infinity]',
                                 b'{"a":1,"a":2}'])  # fmt: skip
def test_the_strict_loader_refuses_what_json_would_serve_back_as_infinity(raw: bytes) -> None:
    with pytest.raises(StrictJsonError):
        strict_loads(raw)
    assert strict_loads(b'{"a":1e308,"b":-0.0}') == {"a": 1e308, "b": -0.0}


# --- the gateway in process, on every store ------------------------------------------------------


@dataclass
class CountingMcp:
    """An MCP server that answers every request and remembers every POST it got."""

    bodies: list[bytes] = field(default_factory=list)
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    async def _post(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.bodies.append(body)
        message = json.loads(body)
        if "id" not in message:
            return web.Response(status=202)
        result: dict[str, Any] = {"content": [{"type": "text", "text": "ok"}]}
        if message.get("method") == "tools/list":
            result = {"tools": [{"name": "charge", "inputSchema": {"type": "object"}}]}
        return web.json_response({"jsonrpc": "2.0", "id": message["id"], "result": result})

    async def start(self) -> CountingMcp:
        app = web.Application()
        app.router.add_post("/mcp", self._post)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self


@pytest.fixture
async def server() -> AsyncIterator[CountingMcp]:
    counting = await CountingMcp().start()
    yield counting
    assert counting.runner is not None
    await counting.runner.cleanup()


def _mcp_downstream(url: str) -> dict[str, Any]:
    # ``charge`` is configured an effect: what the server's annotations say plays no part.
    return {"name": DOWNSTREAM, "url": url, "adapter": "mcp", "timeout_ms": 5_000,
            "tools": {"charge": {"kind": "effect"}, "lookup": {"kind": "read_only"}}}  # fmt: skip


@pytest.fixture
async def gw(
    store_url: str, key_prefix: str, server: CountingMcp
) -> AsyncIterator[TestClient[Any, Any]]:
    config = make_config(store_url, key_prefix, downstreams=[_mcp_downstream(server.url)],
                         reconciler={"enabled": False})  # fmt: skip
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


async def post(
    client: TestClient[Any, Any], headers: Any, body: bytes
) -> tuple[int, dict[str, Any]]:
    return await mcp_post(client, DOWNSTREAM, headers, body)


async def test_an_honest_call_goes_through(gw: TestClient[Any, Any], server: CountingMcp) -> None:
    """The control: the counting server and the ledger see a call the rule lets through."""
    task, headers = await mcp_lease(gw)
    status, answer = await post(gw, headers, HONEST)
    assert (status, answer.get("result")) == (200, {"content": [{"type": "text", "text": "ok"}]})
    assert len(server.bodies) == 1
    assert [e["state"] for e in await task_effects(gw, task)] == ["COMMITTED"]


_ALL = [(c, json.dumps(m).encode()) for c, m in SMUGGLED] + DUPLICATED


@pytest.mark.parametrize(("case", "body"), _ALL, ids=[c for c, _ in _ALL])
async def test_a_smuggled_message_is_refused_and_nothing_is_recorded_or_sent(
    gw: TestClient[Any, Any], server: CountingMcp, case: str, body: bytes
) -> None:
    task, headers = await mcp_lease(gw)
    status, answer = await post(gw, headers, body)
    assert status == 200, answer
    assert answer["id"] == 7
    assert answer["error"]["code"] == -32600
    assert answer["error"]["data"]["code"] == "BAD_REQUEST"
    assert server.bodies == []
    assert await task_effects(gw, task) == []


async def test_a_smuggling_message_without_an_id_is_refused_with_400(
    gw: TestClient[Any, Any], server: CountingMcp
) -> None:
    """A notification to the gateway (no ``id``), a call to Go (``Id`` and ``Method``)."""
    task, headers = await mcp_lease(gw)
    message = {"jsonrpc": "2.0", "method": "notifications/initialized", "Id": 5,
               "Method": "tools/call", "params": {"name": "charge", "arguments": REAL}}  # fmt: skip
    status, answer = await post(gw, headers, json.dumps(message).encode())
    assert (status, answer["id"], answer["error"]["code"]) == (400, None, -32600), answer
    assert answer["error"]["data"]["code"] == "BAD_REQUEST"
    assert server.bodies == []
    assert await task_effects(gw, task) == []


@pytest.mark.parametrize(
    "raw",
    [
        b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge",'
        b'"arguments":{"amount":1e400}}}',
        b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge",'
        b'"arguments":{"amount":NaN}}}',
        b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"charge",'
        b'"arguments":{"amount":-Infinity}}}',
        b'{"jsonrpc":"2.0","id":7,"method":"ping","params":{"_meta":{"x":Infinity}}}',
        b'{"jsonrpc":"2.0","id":7,"method":"tools/list","params":{"cursor":1e999}}',
    ],
    ids=["call-1e400", "call-NaN", "call-minus-Infinity", "ping-meta-Infinity", "list-1e999"],
)
async def test_a_non_finite_number_is_invalid_params_and_nothing_is_sent(
    gw: TestClient[Any, Any], server: CountingMcp, raw: bytes
) -> None:
    task, headers = await mcp_lease(gw)
    status, answer = await post(gw, headers, raw)
    assert (status, answer["id"], answer["error"]["code"]) == (200, 7, -32602), answer
    assert answer["error"]["data"]["code"] == "BAD_REQUEST"
    assert server.bodies == []
    assert await task_effects(gw, task) == []


@pytest.mark.parametrize("raw_id", [b"1e400", b"NaN", b"-Infinity"])
async def test_a_non_finite_id_counts_as_no_id(
    gw: TestClient[Any, Any], server: CountingMcp, raw_id: bytes
) -> None:
    task, headers = await mcp_lease(gw)
    raw = b'{"jsonrpc":"2.0","id":' + raw_id + b',"method":"tools/call","params":{"name":"charge"}}'
    status, answer = await post(gw, headers, raw)
    assert (status, answer["id"], answer["error"]["code"]) == (400, None, -32602), answer
    assert answer["error"]["data"]["code"] == "BAD_REQUEST"
    assert server.bodies == []
    assert await task_effects(gw, task) == []


# --- a real Go server (slow set): what the rule prevents -----------------------------------------

FIXTURES = Path(__file__).parent / "fixtures"


def _go_build(source: Path, out: Path, work: Path) -> Path:
    """Build one standard-library Go program with Debian's Go: no module, no network."""
    env = {**os.environ, "GOCACHE": str(work / "cache"), "GOPATH": str(work / "gopath"),
           "GOPROXY": "off", "GOFLAGS": "", "CGO_ENABLED": "0", "GO111MODULE": "auto"}  # fmt: skip
    subprocess.run(["go", "build", "-o", str(out), str(source)], env=env, check=True,
                   cwd=work, capture_output=True, timeout=600)  # fmt: skip
    return out


@pytest.fixture(scope="session")
def go_work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("go")


@pytest.fixture(scope="session")
def go_server(go_work: Path) -> Iterator[str]:
    """The Go MCP server (``tests/fixtures/go_mcp``) on a port it chose; its ``/mcp`` URL."""
    binary = _go_build(FIXTURES / "go_mcp" / "main.go", go_work / "go_mcp", go_work)
    proc = subprocess.Popen([str(binary)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert line.startswith("PORT "), line
        yield f"http://127.0.0.1:{int(line.split()[1])}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


async def go_record(url: str, method: str = "GET") -> dict[str, Any]:
    """What the Go server ran (``DELETE``: and forget it)."""
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, url.removesuffix("/mcp") + "/executions") as resp,
    ):
        record: dict[str, Any] = await resp.json()
        return record


@pytest.fixture
async def go_gw(tmp_path: Path, go_server: str) -> AsyncIterator[TestClient[Any, Any]]:
    """The gateway on SQLite in front of the Go server (the rule runs before any store step)."""
    await go_record(go_server, "DELETE")
    config = make_config(
        f"sqlite:///{tmp_path / 'fg.db'}",
        downstreams=[_mcp_downstream(go_server)],
        reconciler={"enabled": False},
    )
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


def digest_of(message: Any) -> str:
    """The payload digest the gateway records for a ``tools/call`` (what an operator approves)."""
    outgoing = Outgoing("POST", DOWNSTREAM, "/", (), json.dumps(message).encode())
    return McpAdapter().effect_of(outgoing).payload_digest


def _gateway_reading(message: dict[str, Any]) -> dict[str, Any] | None:
    """The ``charge`` call the gateway reads in ``message`` (exact names; None: none)."""
    params = message.get("params") or {}
    if message.get("method") != "tools/call" or params.get("name") != "charge":
        return None
    arguments = params.get("arguments") or {}
    return {"account": arguments.get("account", ""), "amount": arguments.get("amount", 0),
            "key": arguments.get("key", "")}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("case", "message"), SMUGGLED[:9], ids=[c for c, _ in SMUGGLED[:9]])
async def test_the_go_server_reads_what_the_gateway_does_not(
    go_server: str, case: str, message: Any
) -> None:
    """The premise, straight to Go: each message runs ``charge`` with other arguments than the
    gateway reads, or where the gateway reads no ``charge`` call at all (``Method``: a ping;
    ``Name``: ``lookup``, a read-only tool, so not even recorded)."""
    await go_record(go_server, "DELETE")
    async with aiohttp.ClientSession() as http, http.post(go_server, json=message) as resp:
        answer = await resp.json()
    assert "result" in answer, answer
    runs = (await go_record(go_server))["executions"]
    assert len(runs) == 1, runs
    assert runs[0]["charge"] != _gateway_reading(message), (case, runs[0])


@pytest.mark.slow
async def test_without_the_rule_the_ledger_records_one_call_and_go_runs_another(
    go_gw: TestClient[Any, Any], go_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hole as it was: with the rule switched off, ``Arguments`` is recorded as a call of
    ``charge`` with no arguments (the digest an operator would approve) and Go charges 1000."""
    monkeypatch.setattr(mcp, "refusal", lambda parsed: None)
    task, headers = await mcp_lease(go_gw)
    message = call({"name": "charge", "Arguments": REAL})
    status, answer = await post(go_gw, headers, json.dumps(message).encode())
    assert status == 200 and "result" in answer, answer
    [effect] = await task_effects(go_gw, task)
    assert effect["payloadDigest"] == digest_of(call({"name": "charge", "arguments": {}}))
    assert effect["payloadDigest"] != digest_of(call({"name": "charge", "arguments": REAL}))
    runs = (await go_record(go_server))["executions"]
    assert [r["charge"] for r in runs] == [REAL]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "body"), _ALL, ids=[c for c, _ in _ALL])
async def test_with_the_rule_go_runs_nothing_the_gateway_did_not_record(
    go_gw: TestClient[Any, Any], go_server: str, case: str, body: bytes
) -> None:
    task, headers = await mcp_lease(go_gw)
    status, answer = await post(go_gw, headers, body)
    assert (status, answer["error"]["code"]) == (200, -32600), answer
    assert await go_record(go_server) == {"posts": 0, "executions": []}
    assert await task_effects(go_gw, task) == []
    # and the honest call runs once, with exactly what was recorded
    status, answer = await post(go_gw, headers, HONEST)
    assert status == 200 and "result" in answer, answer
    [effect] = await task_effects(go_gw, task)
    assert effect["payloadDigest"] == digest_of(call({"name": "charge", "arguments": REAL}))
    assert [r["charge"] for r in (await go_record(go_server))["executions"]] == [REAL]


@pytest.mark.slow
def test_fold_puts_every_go_simple_fold_orbit_in_one_class(go_work: Path) -> None:
    """``adapters.mcp.fold`` against Go's own tables (``unicode.SimpleFold``, what
    ``EqualFold`` and ``encoding/json`` use): every orbit of Go's is one fold class here.
    Python's Unicode is newer, so it has a few classes Go 1.19 lacks (refused here, matched by
    a newer Go): a superset, never a gap."""
    binary = _go_build(FIXTURES / "go_fold" / "main.go", go_work / "go_fold", go_work)
    lines = subprocess.run([str(binary)], check=True, capture_output=True, timeout=120).stdout
    orbits: dict[int, list[int]] = {}
    for line in lines.decode().splitlines():
        rune, least = map(int, line.split())
        orbits.setdefault(least, []).append(rune)
    assert len(orbits) > 1000
    for members in orbits.values():
        assert len({mcp.fold(chr(r)) for r in members}) == 1, [hex(r) for r in members]
    # and two of Go's orbits are never one class here
    classes = {mcp.fold(chr(least)) for least in orbits}
    assert len(classes) == len(orbits)
