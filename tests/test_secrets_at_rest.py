"""Secrets at rest (issue 11 item 4), on both stores.

The downstream's credential comes from ``headers_from_env``; the gateway adds it to every
forward. The worst case is a downstream that ECHOES every request header it got back, as
response headers and as its JSON body. After a few effects (commit, replay, a timeout that
leaves the effect UNKNOWN, an operator's resolve, the replay of the resolved effect) the
secret is searched for everywhere the gateway writes or answers:

* the store: every effect record (``list_effects``) and the raw store: the SQLite file and
  its WAL, or every Redis key under the prefix (``DUMP`` and the value read by type);
* every log event (structlog's and the standard library's);
* every ledger API answer and every replayed answer (headers and body).

Decision (docs/security.md, "Secrets at rest"): a response header named in
``headers_from_env`` (and Set-Cookie, Authorization, Proxy-Authorization, and the
downstream's ``never_store_headers``) is never stored. The echoed BODY is the downstream's
answer: it is stored for replay unless ``store_response_body = false``, which is the setting
for such downstreams; with it the secret is nowhere in the store.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import redis
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from structlog.testing import capture_logs

from fencegate.gateway import answers
from fencegate.gateway.app import create_app
from fencegate.gateway.config import Config, HttpDownstream
from fencegate.gateway.http_rules import stored_response_headers
from fencegate.ledger.cluster_router import parse_cluster_url
from fencegate.ledger.effects import effect_id
from tests.api import Api
from tests.clocks import still
from tests.conftest import build_test_store, is_cluster, make_config
from tests.downstream import Downstream

#: The timeout of ``echo-brief``, the downstream of the timed-out call: that call is held
#: (``/hold/...``) until the test ends, so only this timer ends it, however loaded the machine.
TIMEOUT_MS = 300
SECRET_ENV = "FG_TEST_SECRET"
_NOT_ECHOED = frozenset(
    {"host", "content-length", "content-type", "transfer-encoding", "connection"}
)


@dataclass
class EchoDownstream:
    """Answers every call with the request's headers: as its own response headers (same
    names, plus ``X-Echo-Token`` holding the Authorization value and a ``Set-Cookie``) and
    as a JSON body. ``/hold/...`` answers only once ``release`` is set (at ``stop``)."""

    received: list[dict[str, str]] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    runner: web.AppRunner | None = None
    port: int = 0

    async def _handle(self, request: web.Request) -> web.Response:
        await request.read()
        got = dict(request.headers)
        self.received.append(got)
        if request.path.startswith("/hold/"):
            await self.release.wait()
        headers = {k: v for k, v in got.items() if k.lower() not in _NOT_ECHOED}
        headers["X-Echo-Token"] = got.get("Authorization", "")
        headers["Set-Cookie"] = f"session={got.get('Authorization', '')}"
        return web.json_response({"youSent": got}, headers=headers)

    async def start(self) -> EchoDownstream:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return self

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
def secret(monkeypatch: pytest.MonkeyPatch) -> str:
    value = f"Bearer fgsecret-{secrets.token_hex(16)}"
    monkeypatch.setenv(SECRET_ENV, value)
    return value


@pytest.fixture
async def echo() -> AsyncIterator[EchoDownstream]:
    server = await EchoDownstream().start()
    yield server
    await server.stop()


def needles(secret: str) -> list[bytes]:
    """The secret as it could appear in stored bytes: plain, and base64-encoded at each of
    the three alignments (the stable middle of each encoding)."""
    raw = secret.encode()
    found = [raw]
    for pad in range(3):
        encoded = base64.b64encode(b"\0" * pad + raw)
        found.append(encoded[4 : len(encoded) - 4])
    return found


def assert_absent(what: str, data: bytes | str, secret: str) -> None:
    blob = data.encode() if isinstance(data, str) else data
    for needle in needles(secret):
        assert needle not in blob, f"the secret appears in {what}"


def contains(data: bytes | str, secret: str) -> bool:
    blob = data.encode() if isinstance(data, str) else data
    return any(needle in blob for needle in needles(secret))


@dataclass
class Answer:
    what: str
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header_text(self) -> str:
        return json.dumps(self.headers)


@dataclass
class Run:
    live: list[Answer]
    answers: list[Answer]
    logs: str
    effect_ids: list[str]


async def _exchange(api: Api, what: str, method: str, path: str, **kwargs: Any) -> Answer:
    async with api.client.request(method, path, allow_redirects=False, **kwargs) as resp:
        return Answer(what, resp.status, list(resp.headers.items()), await resp.read())


async def _scenario(api: Api, caplog: pytest.LogCaptureFixture) -> Run:
    live: list[Answer] = []
    answers: list[Answer] = []
    caplog.set_level(logging.DEBUG)
    with capture_logs() as events:
        await api.put("t1")
        lease = await api.claim("t1", ttl_ms=30_000)

        def fence(slot: str) -> dict[str, str]:
            return {
                "Fence-Task": lease.task_id,
                "Fence-Attempt": lease.attempt_id,
                "Fence-Generation": str(lease.claim_generation),
                "Fence-Epoch": str(lease.scheduler_epoch),
                "Fence-Cancel": str(lease.cancel_generation),
                "Fence-Slot": slot,
            }

        body = {"amount": 5}
        first = await _exchange(api, "commit", "POST", "/proxy/echo/ok/pay",
                                json=body, headers=fence("s1"))  # fmt: skip
        assert first.status == 200, first.body
        live.append(first)
        replay = await _exchange(api, "replay", "POST", "/proxy/echo/ok/pay",
                                 json=body, headers=fence("s1"))  # fmt: skip
        assert dict(replay.headers)["Fence-Replayed"] == "true"
        answers.append(replay)

        timed_out = await _exchange(api, "timeout", "POST", "/proxy/echo-brief/hold/pay",
                                    json=body, headers=fence("s2"))  # fmt: skip
        assert dict(timed_out.headers)["Fence-Effect-State"] == "UNKNOWN", timed_out.body
        answers.append(timed_out)
        again = await _exchange(api, "unknown retry", "POST", "/proxy/echo-brief/hold/pay",
                                json=body, headers=fence("s2"))  # fmt: skip
        answers.append(again)

        ids = [effect_id("t1", 1, "main", slot) for slot in ("s1", "s2")]
        settle = {"outcome": "COMMITTED", "note": "seen in the console"}
        resolved = await _exchange(api, "resolve", "POST", f"/v1/effects/{ids[1]}/resolve",
                                   json=settle)  # fmt: skip
        assert resolved.status == 200, resolved.body
        answers.append(resolved)
        answers.append(await _exchange(api, "resolved replay", "POST",
                                       "/proxy/echo-brief/hold/pay", json=body,
                                       headers=fence("s2")))  # fmt: skip

        answers.append(await _exchange(api, "list", "GET", "/v1/effects"))
        for eid in ids:
            answers.append(await _exchange(api, f"show {eid}", "GET", f"/v1/effects/{eid}"))
        answers.append(await _exchange(api, "task", "GET", "/v1/tasks/t1"))
        answers.append(await _exchange(api, "metrics", "GET", "/metrics"))
    logs = json.dumps(events, default=repr) + "\n".join(
        f"{r.getMessage()} {r.exc_text or ''} {r.args!r}" for r in caplog.records
    )
    return Run(live, answers, logs, ids)


async def _raw_store(config: Config, tmp_path: Path) -> bytes:
    """Every byte the store holds, as the store holds it."""
    url = config.store.url
    if url.startswith("sqlite"):
        chunks = [p.read_bytes() for p in sorted(tmp_path.glob("fencegate.db*"))]
        assert chunks
        return b"".join(chunks)
    if url.startswith("postgresql"):
        return await _postgres_rows(url)
    if is_cluster(url):  # every primary's keys (a replica holds copies of them)
        nodes, _, _ = parse_cluster_url(url)
        clients = [redis.Redis(host=host, port=port) for host, port in nodes]
        primaries = [c for c in clients if c.info("replication")["role"] == "master"]
    else:
        clients = primaries = [redis.Redis.from_url(url)]
    try:
        chunks = []
        for client in primaries:
            chunks += _redis_keys(client, config.store.redis_key_prefix)
        assert chunks
        return b"\n".join(chunks)
    finally:
        for client in clients:
            client.close()


def _redis_keys(client: redis.Redis, prefix: str) -> list[bytes]:
    """Every key of one Redis server under ``prefix``: its name, its DUMP and its value."""
    chunks = []
    for key in client.scan_iter(match=f"{prefix}*"):
        chunks.append(key)
        chunks.append(client.dump(key) or b"")
        kind = client.type(key).decode()
        value: Any
        if kind == "string":
            value = client.get(key)
        elif kind == "hash":
            value = client.hgetall(key)
        elif kind == "list":
            value = client.lrange(key, 0, -1)
        elif kind == "set":
            value = client.smembers(key)
        elif kind == "zset":
            value = client.zrange(key, 0, -1, withscores=True)
        elif kind == "stream":
            value = client.xrange(key)
        else:
            raise AssertionError(f"unexpected Redis type {kind} for {key!r}")
        chunks.append(repr(value).encode())
    return chunks


async def _postgres_rows(url: str) -> bytes:
    """Every row of every table in the store's database (its own, created for this test)."""
    conn = await asyncpg.connect(url)
    try:
        tables = await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename"
        )
        assert tables
        chunks = []
        for (table,) in tables:
            rows = await conn.fetch(f'SELECT * FROM "{table}"')
            chunks.append(f"{table}: {[tuple(row) for row in rows]!r}".encode())
        return b"\n".join(chunks)
    finally:
        await conn.close()


def _config(store_url: str, key_prefix: str, echo: EchoDownstream, **options: Any) -> Config:
    common = {
        "url": f"http://127.0.0.1:{echo.port}",
        "headers_from_env": {"Authorization": SECRET_ENV},
        "never_store_headers": ["x-echo-token"],
        **options,
    }
    return make_config(
        store_url,
        key_prefix,
        downstreams=[  # type: ignore[arg-type]
            # The default timeout_ms: the answered calls do not race a timer.
            {"name": "echo", **common},
            # Only the total timeout may end the held call: a slow connect under load is then
            # still UNKNOWN (the connect bound is far off), never NOT_APPLIED.
            {
                "name": "echo-brief",
                "timeout_ms": TIMEOUT_MS,
                "connect_timeout_ms": 10_000,
                **common,
            },
        ],
        # The forward clock stands still (``make_api``) and the start limit (then a real-time
        # bound on the pool wait and connect) is 10 s off: a loaded machine cannot trip it.
        proxy={"prepared_margin_ms": 20_000, "forward_start_limit_ms": 10_000},
        reconciler={"enabled": False},
    )


@pytest.fixture
async def make_api(store_url: str, key_prefix: str, echo: EchoDownstream) -> AsyncIterator[Any]:
    clients: list[TestClient[Any, Any]] = []

    async def make(**options: Any) -> tuple[Api, Config]:
        config = _config(store_url, key_prefix, echo, **options)
        client: TestClient[Any, Any] = TestClient(
            TestServer(
                create_app(config, store=build_test_store(config), forward_clock=still),
                host="127.0.0.1",
            )
        )
        await client.start_server()
        clients.append(client)
        return Api(client), config

    yield make
    for client in clients:
        await client.close()


def _check_common(run: Run, echo: EchoDownstream, secret: str) -> None:
    # The test is real: the downstream got the credential and echoed it.
    assert echo.received and all(got["Authorization"] == secret for got in echo.received)
    assert contains(run.live[0].body, secret)
    assert_absent("a log line", run.logs, secret)
    for answer in run.answers:
        assert_absent(f"the headers of the {answer.what} answer", answer.header_text(), secret)


async def test_without_stored_bodies_the_secret_is_nowhere_in_store_logs_or_api(
    make_api: Any, echo: EchoDownstream, secret: str, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    api, config = await make_api(store_response_body=False)
    run = await _scenario(api, caplog)
    _check_common(run, echo, secret)
    for answer in run.answers:
        assert_absent(f"the body of the {answer.what} answer", answer.body, secret)
    replay = run.answers[0]
    assert dict(replay.headers)["Fence-Replay-Body"] == "omitted" and replay.body == b""
    found, _ = await api.store.list_effects(
        state=None, task_id=None, downstream=None, limit=100, cursor=None
    )
    assert {e.effect_id for e in found} == set(run.effect_ids)
    for effect in found:
        assert_absent("an effect record", json.dumps(answers.Effect.of(effect).wire()), secret)
    committed = next(e for e in found if e.effect_id == run.effect_ids[0])
    assert committed.response_json is not None
    stored = json.loads(committed.response_json)
    assert stored["bodyOmitted"] is True
    assert stored["bodyOmittedReason"] == "store_response_body = false"
    assert "bodyBase64" not in stored and "bodyDigest" not in stored
    names = {name.lower() for name, _ in stored["headers"]}
    assert not names & {"authorization", "x-echo-token", "set-cookie"}
    assert "fence-task" not in names  # only the gateway speaks Fence-*
    assert_absent("the raw store", await _raw_store(config, tmp_path), secret)


async def test_with_stored_bodies_no_echoed_header_is_stored(
    make_api: Any, echo: EchoDownstream, secret: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The default (bodies stored): the echoed headers are still never stored or replayed;
    the echoed body is, which is why such a downstream wants ``store_response_body = false``."""
    api, _ = await make_api()
    run = await _scenario(api, caplog)
    _check_common(run, echo, secret)
    found, _ = await api.store.list_effects(
        state=None, task_id=None, downstream=None, limit=100, cursor=None
    )
    for effect in found:
        record = answers.Effect.of(effect).wire()
        response = record.pop("response", None)
        assert_absent("an effect record", json.dumps(record), secret)
        if response is None:
            continue
        body = base64.b64decode(response.pop("bodyBase64", ""))
        assert_absent("a stored answer's headers", json.dumps(response), secret)
        assert contains(body, secret)  # the documented case: the body is the answer
    replay = run.answers[0]
    assert contains(replay.body, secret)
    assert "Fence-Replay-Body" not in dict(replay.headers)


async def test_the_live_answer_does_not_repeat_an_echoed_credential_header(
    make_api: Any, echo: EchoDownstream, secret: str, caplog: pytest.LogCaptureFixture
) -> None:
    api, _ = await make_api(store_response_body=False)
    run = await _scenario(api, caplog)
    assert_absent("the live answer's headers", run.live[0].header_text(), secret)


def test_stored_headers_never_keep_credentials_or_the_configured_names() -> None:
    answer = [
        ("Content-Type", "application/json"),
        ("Set-Cookie", "a=1"),
        ("set-cookie2", "b=2"),
        ("authorization", "Bearer x"),
        ("Proxy-Authorization", "Basic y"),
        ("X-Api-Key", "k"),
        ("X-Secret", "s"),
        ("ETag", '"v1"'),
    ]
    assert stored_response_headers(answer, {"x-api-key", "X-SECRET"}) == [
        ["Content-Type", "application/json"],
        ["ETag", '"v1"'],
    ]


def test_the_config_keys_are_validated_and_unstored_names_include_headers_from_env() -> None:
    base = {"name": "d", "url": "http://127.0.0.1:1"}
    config = HttpDownstream.model_validate(
        {**base, "headers_from_env": {"X-Api-Key": "K"}, "never_store_headers": ["X-Trace"]}
    )
    assert config.unstored_headers == {"x-api-key", "x-trace"}
    assert config.store_response_body is True
    with pytest.raises(ValueError, match="never_store_headers"):
        HttpDownstream.model_validate({**base, "never_store_headers": ["bad header"]})
    with pytest.raises(ValueError, match="store_response_body"):
        HttpDownstream.model_validate({**base, "store_response_body": "no"})


def test_a_config_file_error_names_the_key(tmp_path: Path) -> None:
    from fencegate.gateway.config import ConfigError, load_config

    path = tmp_path / "fencegate.toml"
    path.write_text(
        '[[downstreams]]\nname = "d"\nurl = "http://127.0.0.1:1"\n'
        'never_store_headers = ["no spaces allowed"]\n'
    )
    with pytest.raises(ConfigError, match=r"downstreams\[0\].*never_store_headers"):
        load_config(path)


@pytest.fixture
async def kept_api(
    store_url: str, key_prefix: str, downstream: Downstream, secret: str
) -> AsyncIterator[tuple[Api, Config]]:
    """A gateway whose downstream keeps request bodies. Its downstream does not echo (the
    echo's answers would store the request's headers as the answer's, which is what
    ``never_store_headers`` is for, not this)."""
    keep = {
        "url": downstream.url,
        "headers_from_env": {"Authorization": SECRET_ENV},
        "never_store_headers": ["X-Internal"],
        "keep_request_bodies": True,
        "redact_json_fields": ["/card/number"],
        "redact_headers": ["X-Trace"],
    }
    config = make_config(
        store_url,
        key_prefix,
        downstreams=[{"name": "echo", **keep}],  # type: ignore[arg-type]
        reconciler={"enabled": False},
    )
    app = create_app(config, store=build_test_store(config), forward_clock=still)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client), config


async def test_a_kept_request_holds_nothing_excluded_or_redacted(
    kept_api: tuple[Api, Config], downstream: Downstream, secret: str, tmp_path: Path
) -> None:
    """``keep_request_bodies`` (issue 27): the request an effect forwarded is kept for
    operators, with every value that must not be stored left out or ``"<redacted>"`` before
    it is written: the stored bytes hold none of them, and do hold the rest (the test is
    real). The call whose connection broke (UNKNOWN) is the one an operator needs it for."""
    card, trace, cookie = "4111-card-secret-77", "trace-secret-88", "cookie-secret-99"
    agent_auth, internal = "Bearer agent-secret-66", "internal-secret-55"
    api, config = kept_api
    await api.put("t1")
    lease = await api.claim("t1", ttl_ms=30_000)
    headers = {
        **lease.fence_headers(),
        "Cookie": f"s={cookie}",
        "Authorization": agent_auth,
        "Proxy-Authorization": agent_auth,
        "X-Trace": trace,
        "X-Internal": internal,
        "X-Copy": f"copied {secret}",  # an agent sending the credential's value itself
        "X-Kept": "kept-header-marker",
    }
    body = {"amount": 5, "to": "kept-body-marker", "card": {"number": card}}
    for slot, path in (("s1", "/proxy/echo/ok/pay"), ("s2", "/proxy/echo/reset/pay")):
        sent = await _exchange(api, slot, "POST", path, json=body,
                               headers={**headers, "Fence-Slot": slot})  # fmt: skip
        assert sent.status in (200, 504), sent.body
    got = downstream.received[0].headers  # the downstream got them all
    assert got["X-Trace"] == trace and got["Authorization"] == secret
    raw = await _raw_store(config, tmp_path)
    for value in (card, trace, cookie, agent_auth, internal):
        assert value.encode() not in raw, value
    assert_absent("the raw store", raw, secret)
    assert b"kept-body-marker" in raw and b"kept-header-marker" in raw
    found, _ = await api.store.list_effects(
        state=None, task_id=None, downstream=None, limit=100, cursor=None
    )
    assert {e.state.value for e in found} == {"COMMITTED", "UNKNOWN"}
    for effect in found:
        assert effect.request_json is not None
        kept = json.loads(effect.request_json)
        names = {name.lower(): value for name, value in kept["headers"]}
        assert names["x-trace"] == names["x-copy"] == "<redacted>"
        assert not set(names) & {"cookie", "authorization", "proxy-authorization",
                                 "x-internal", "x-echo-token"}  # fmt: skip
        assert not any(name.startswith("fence-") for name in names)
        assert json.loads(kept["body"])["card"] == {"number": "<redacted>"}
