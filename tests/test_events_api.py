"""``GET /v1/events`` on every store: server-sent events from now or from a position, a
reconnect with ``Last-Event-ID`` that misses nothing and repeats nothing, 410 past the retained
history and ahead of the newest event issued, heartbeats, the subscriber bound, and two
gateways on one store."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.auth import token_sha256
from fencegate.gateway.config import Config
from fencegate.gateway.state import EVENTS
from fencegate.ledger import cluster_feed
from fencegate.ledger.errors import EventsGone
from fencegate.ledger.keys import Keys
from tests.api import HANG_S, Api, until
from tests.conftest import TEST_CLUSTER_BUCKETS, build_test_store, is_cluster, make_config


def events_config(
    store_url: str, key_prefix: str, *, tasks: dict[str, Any] | None = None, **events: Any
) -> Config:
    return make_config(
        store_url,
        key_prefix,
        reconciler={"enabled": False},
        tasks=tasks or {},
        events={"poll_ms": 20, "heartbeat_ms": 200, **events},
    )


@pytest.fixture
async def api(store_url: str, key_prefix: str) -> AsyncIterator[Api]:
    config = events_config(store_url, key_prefix, max_subscribers=2)
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


@dataclass
class Frame:
    id: str | None
    event: str | None
    data: Any


class Stream:
    """One open ``GET /v1/events``, read frame by frame."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.last_id: str | None = None
        self.comments = 0

    async def _line(self) -> str:
        raw = await self.response.content.readline()
        if not raw:
            raise EOFError("the stream ended")
        return raw.decode().rstrip("\r\n")

    async def frame(self, seconds: float = HANG_S) -> Frame:
        """The next frame with data (id-only frames only move ``last_id``)."""
        async with asyncio.timeout(seconds):
            fields: dict[str, str] = {}
            while True:
                line = await self._line()
                if line.startswith(":"):
                    self.comments += 1
                    continue
                if line:
                    name, _, value = line.partition(": ")
                    fields[name] = value
                    continue
                if "id" in fields:
                    self.last_id = fields["id"]
                if "data" in fields:
                    return Frame(fields.get("id"), fields.get("event"), json.loads(fields["data"]))
                fields = {}

    async def keep_alive(self, seconds: float = HANG_S) -> None:
        """Read up to the next comment (a heartbeat); an event before it fails the test.
        ``seconds`` only bounds a hang: the heartbeat comes when the gateway's loop gets to
        it."""
        async with asyncio.timeout(seconds):
            while True:
                line = await self._line()
                if line.startswith(":"):
                    self.comments += 1
                    return
                assert not line.startswith(("event:", "data:")), f"while nothing happened: {line}"

    async def task_states(self, count: int) -> list[tuple[str, str]]:
        out = []
        while len(out) < count:
            frame = await self.frame()
            if frame.event == "task":
                out.append((frame.data["taskId"], frame.data["state"]))
        return out


async def open_stream(api: Api, *, after: str | None = None, query: str = "") -> Stream:
    headers = {"Last-Event-ID": after} if after is not None else {}
    response = await api.client.get(f"/v1/events{query}", headers=headers)
    assert response.status == 200, await response.text()
    assert response.headers["Content-Type"].startswith("text/event-stream")
    stream = Stream(response)
    return stream


async def test_a_stream_from_now_sees_changes_as_they_happen(api: Api) -> None:
    await api.put("before")
    stream = await open_stream(api)
    await api.put("t1")
    lease = await api.claim("t1")
    await api.commit(lease)
    assert await stream.task_states(3) == [
        ("t1", "READY"),
        ("t1", "CLAIMED"),
        ("t1", "COMMITTED"),
    ]
    assert stream.last_id is not None
    stream.response.close()


async def test_a_reconnect_with_last_event_id_misses_nothing_and_repeats_nothing(
    api: Api,
) -> None:
    stream = await open_stream(api)
    await api.put("a")
    assert await stream.task_states(1) == [("a", "READY")]
    resume = stream.last_id
    stream.response.close()
    # Meanwhile: more changes than one read of the store takes.
    for n in range(3):
        await api.put(f"m{n}")
    await api.cancel("a")
    again = await open_stream(api, after=resume)
    seen = await again.task_states(4)
    assert seen == [("m0", "READY"), ("m1", "READY"), ("m2", "READY"), ("a", "CANCELLED")]
    await api.put("live")
    assert await again.task_states(1) == [("live", "READY")]
    again.response.close()
    by_query = await open_stream(api, query=f"?after={resume}")
    assert (await by_query.task_states(1)) == [("m0", "READY")]
    by_query.response.close()
    # Last-Event-ID (what a reconnecting EventSource sends) wins over the URL's after.
    both = await open_stream(api, after=again.last_id, query=f"?after={resume}")
    await api.put("next")
    assert await both.task_states(1) == [("next", "READY")]
    both.response.close()


async def test_effect_events_are_typed(api: Api) -> None:
    stream = await open_stream(api)
    await api.put("t1")
    frame = await stream.frame()
    assert frame.event == "task" and frame.data["type"] == "task"
    assert set(frame.data) >= {"taskId", "state", "revision", "claimGeneration", "at"}
    stream.response.close()


async def test_a_position_past_the_history_is_410(api: Api) -> None:
    _, old = await api.store.read_events(None, 1)
    for n in range(5):  # one task group: on Redis Cluster one bucket's stream, trimmed to 1
        await api.put(f"feed::t{n}")
    await api.store.trim_events(1)
    async with api.client.get("/v1/events", headers={"Last-Event-ID": old}) as resp:
        assert resp.status == 410
        body = await resp.json(content_type=None)
    assert body["code"] == "EVENTS_GONE"
    async with api.client.get("/v1/events", headers={"Last-Event-ID": "x" * 201}) as resp:
        assert resp.status == 400
    for query in ("?after=%01", "?from=1", "?after=a&after=b"):
        async with api.client.get(f"/v1/events{query}") as resp:
            assert resp.status == 400, query


def ahead_of(end: str, store_url: str) -> list[str]:
    """Well-formed positions past ``end``, the newest position the store has issued: just past
    it and far past it, as a subscriber holds after its store lost events (a failover that lost
    writes, a restore of an older copy)."""
    if is_cluster(store_url):
        vector = cluster_feed.decode(end, TEST_CLUSTER_BUCKETS)
        written = next(n for n, at in enumerate(vector) if at != (0, 0))
        blank = next(n for n, at in enumerate(vector) if at == (0, 0))

        def moved(bucket: int, stream_id: tuple[int, int]) -> str:
            return cluster_feed.encode(tuple(stream_id if n == bucket else at
                                             for n, at in enumerate(vector)))  # fmt: skip

        ms, seq = vector[written]
        return [moved(written, (ms, seq + 1)), moved(written, (99999999999999, 0)),
                moved(blank, (1, 0))]  # fmt: skip
    first, second = (int(part) for part in end.split("-"))
    if store_url.startswith("sqlite"):  # 0-<AUTOINCREMENT seq>
        return [f"0-{second + 1}", "0-99999999999"]
    if store_url.startswith("postgres"):  # <xid>-<seq>: ahead of the transaction id counter
        return [f"{first + 10**6}-0", f"{first + 10**6}-{second}"]
    return [f"{first}-{second + 1}", "99999999999999-0"]  # Redis: the stream id


async def test_a_position_ahead_of_the_newest_the_store_issued_is_410(
    api: Api, store_url: str
) -> None:
    """A position from before the store lost events it had issued: 410 at once, not a
    stream that silently skips what the store writes next up to that position. The newest
    position itself is a stream that waits for the next event, and a resume from an earlier
    one gets every event once."""
    _, start = await api.store.read_events(None, 1)
    for n in range(3):  # one task group: on Redis Cluster one bucket's stream
        await api.put(f"feed::t{n}")
    _, end = await api.store.read_events(None, 1)
    for ahead in ahead_of(end, store_url):
        with pytest.raises(EventsGone, match="ahead of the newest event this store has issued"):
            await api.store.read_events(ahead, 10)
        for given in ({"headers": {"Last-Event-ID": ahead}}, {"params": {"after": ahead}}):
            async with api.client.get("/v1/events", **given) as resp:
                assert resp.status == 410, (ahead, given)
                problem = await resp.json(content_type=None)
            assert problem["code"] == "EVENTS_GONE"
            assert "ahead of the newest event" in problem["detail"]
            assert "lost events" in problem["detail"]
    assert await api.store.read_events(end, 10) == ([], end)
    at_end = await open_stream(api, after=end)
    resumed = await open_stream(api, after=start)
    await api.put("feed::next")
    assert await at_end.task_states(1) == [("feed::next", "READY")]
    assert await resumed.task_states(4) == [
        *((f"feed::t{n}", "READY") for n in range(3)),
        ("feed::next", "READY"),
    ]
    for stream in (at_end, resumed):  # and nothing twice: the next frame is a heartbeat
        await stream.keep_alive()
        stream.response.close()


async def test_a_trim_of_every_event_keeps_the_newest_position(api: Api, store_url: str) -> None:
    """What the store issued survives a trim of everything (Redis: the stream's last generated
    id; SQLite: AUTOINCREMENT's high-water mark; PostgreSQL: the transaction id counter): the
    end stays where it was, a subscriber there is not refused, one past it still is."""
    _, start = await api.store.read_events(None, 1)
    for n in range(3):
        await api.put(f"feed::t{n}")
    _, end = await api.store.read_events(None, 1)
    await api.store.trim_events(0)
    if not store_url.startswith("postgres"):  # there the end is a horizon, moved by anything
        assert (await api.store.read_events(None, 1))[1] == end
    assert await api.store.read_events(end, 10) == ([], end)
    with pytest.raises(EventsGone, match="were dropped"):
        await api.store.read_events(start, 10)
    for ahead in ahead_of(end, store_url):
        with pytest.raises(EventsGone, match="ahead of the newest event"):
            await api.store.read_events(ahead, 10)
    stream = await open_stream(api, after=end)
    await api.put("feed::next")
    assert await stream.task_states(1) == [("feed::next", "READY")]
    stream.response.close()


# Restored here only on SQLite and a single Redis (a file backup, a stream DUMP/RESTORE).
@pytest.mark.parametrize("store_url", ["sqlite", "redis"], indirect=True)
async def test_a_subscriber_from_before_a_restore_of_an_older_copy_is_told_410(
    api: Api, store_url: str, key_prefix: str, tmp_path: Path
) -> None:
    """The case the 410 is for: the store goes back to an older copy of itself (here the
    SQLite file restored with the backup API; on Redis the event stream's older DUMP restored,
    as a failover to a replica that lacked the last writes leaves it). A subscriber that read
    an event of the lost part resumes ahead of everything the store now has: 410 naming the
    loss, and from now it follows again."""
    await api.put("a")
    if store_url.startswith("sqlite"):
        live = store_url.removeprefix("sqlite:///")
        with (
            contextlib.closing(sqlite3.connect(live)) as src,
            contextlib.closing(sqlite3.connect(tmp_path / "older.db")) as copy,
        ):
            src.backup(copy)

        def restore() -> None:
            with (
                contextlib.closing(sqlite3.connect(tmp_path / "older.db")) as copy,
                contextlib.closing(sqlite3.connect(live)) as dst,
            ):
                copy.backup(dst)
    else:
        admin = redis.Redis.from_url(store_url)
        stream_key = Keys(key_prefix).events
        older = admin.dump(stream_key)
        assert isinstance(older, bytes)

        def restore() -> None:
            admin.restore(stream_key, 0, older, replace=True)

    stream = await open_stream(api)
    await api.put("lost")
    assert await stream.task_states(1) == [("lost", "READY")]
    held = stream.last_id
    assert held is not None
    stream.response.close()
    # The gateway saw its subscriber leave before the loss: while anyone listens it reads the
    # feed from its own position, and a store that issues that position again before its next
    # read (SQLite counts on from the restored copy at once) leaves nothing to tell it by.
    await until(lambda: api.client.app[EVENTS].subscribers == 0, "the closed stream leaves")
    restore()
    async with api.client.get("/v1/events", headers={"Last-Event-ID": held}) as resp:
        assert resp.status == 410
        problem = await resp.json(content_type=None)
    assert problem["code"] == "EVENTS_GONE" and "lost events" in problem["detail"]
    again = await open_stream(api)
    await api.put("after")
    assert await again.task_states(1) == [("after", "READY")]
    again.response.close()


async def test_heartbeats_and_the_subscriber_bound(api: Api) -> None:
    first = await open_stream(api)
    second = await open_stream(api)
    async with api.client.get("/v1/events") as resp:
        assert resp.status == 503
        assert (await resp.json(content_type=None))["code"] == "TOO_MANY_CONNECTIONS"
        assert resp.headers["Retry-After"] == "1"
    await first.keep_alive()  # ": keep-alive" while nothing happened
    await api.put("t1")
    await first.frame()
    assert first.comments >= 1
    first.response.close()
    second.response.close()
    hub = api.client.app[EVENTS]
    await until(lambda: hub.subscribers == 0, "the closed streams leave")
    third = await open_stream(api)  # a closed stream frees its place
    third.response.close()


async def test_two_gateways_on_one_store_both_see_every_event(
    store_url: str, key_prefix: str
) -> None:
    # Long-polls may wait 10 min: far past what this test waits for an answer (below).
    config = events_config(store_url, key_prefix, tasks={"max_wait_ms": 600_000})
    apps = [create_app(config, store=build_test_store(config)) for _ in range(2)]
    async with (
        TestClient(TestServer(apps[0], host="127.0.0.1")) as one,
        TestClient(TestServer(apps[1], host="127.0.0.1")) as two,
    ):
        left, right = Api(one), Api(two)
        streams = [await open_stream(left), await open_stream(right)]
        await left.put("from-left")
        await right.put("from-right")
        for stream in streams:
            assert sorted(await stream.task_states(2)) == [
                ("from-left", "READY"),
                ("from-right", "READY"),
            ]
            stream.response.close()
        # A long-poll on one gateway is woken by a commit made through the other. It waits
        # (the other gateway's hub counts it) before the commit, and its deadline (10 min) is
        # far past what the test waits: an answer at all means the commit woke it.
        lease = await left.claim("from-left")
        waiting = asyncio.ensure_future(
            right.call("GET", "/v1/tasks/from-left?waitFor=COMMITTED&waitMs=600000")
        )
        await until(lambda: apps[1][EVENTS].waiters == 1, "the long-poll waits")
        assert not waiting.done()
        await left.commit(lease)
        answer = await asyncio.wait_for(waiting, HANG_S)
        assert answer.body["state"] == "COMMITTED"


#: Positions no store gives out; each is 400 naming where it came from, before any store
#: reads it (ASCII digits only: ``str.isdigit`` takes superscripts and other scripts' digits too).
MALFORMED = ["\u00b2-1", "1-\u0661", "9" * 21 + "-1", "1-" + "9" * 21, "-1", "1-", "1_0-1", "1.0-1"]
#: ... and the cluster store's vector shape gone wrong: no body, not base64url, past a header line.
MALFORMED += ["c1.", "c1.a+b", "c1.a/b", "c2.AAAA", "C1.AAAA", "c1." + "A" * 8001]


async def test_a_malformed_position_is_400_naming_the_parameter_or_header(api: Api) -> None:
    await api.put("t1")
    for bad in MALFORMED:
        async with api.client.get("/v1/events", params={"after": bad}) as resp:
            assert resp.status == 400, bad
            problem = await resp.json(content_type=None)
            assert problem["detail"].startswith("after:") and problem["fields"] == ["after"]
        if not bad.isascii():
            continue
        async with api.client.get("/v1/events", headers={"Last-Event-ID": bad}) as resp:
            assert resp.status == 400, bad
            problem = await resp.json(content_type=None)
            assert problem["detail"].startswith("Last-Event-ID:"), problem
    # Well formed but past what a store can have issued (or, for a store without buckets, a
    # cluster store's vector): the store refuses it, and the answer still names where it
    # came from.
    for name, too_big in [
        ("after", "99999999999999999999-99999999999999999999"),
        ("Last-Event-ID", "99999999999999999999-99999999999999999999"),
        ("after", "c1.AQA"),
        ("Last-Event-ID", "c1.AQA"),
    ]:
        given = {"params": {"after": too_big}} if name == "after" else {}
        headers = {"Last-Event-ID": too_big} if name != "after" else {}
        async with api.client.get("/v1/events", headers=headers, **given) as resp:
            assert resp.status == 400, name
            problem = await resp.json(content_type=None)
            assert problem["detail"].startswith(f"{name}:") and problem["fields"] == [name]


async def test_each_principal_has_its_own_streams_within_the_gateways(
    store_url: str, key_prefix: str
) -> None:
    tokens = {"obs-a": "tok-obs-a-0123456789", "obs-b": "tok-obs-b-0123456789"}
    auth = {
        "principals": [
            {"name": name, "roles": ["observer"], "token_sha256": token_sha256(token)}
            for name, token in tokens.items()
        ]
    }
    config = make_config(
        store_url,
        key_prefix,
        reconciler={"enabled": False},
        auth=auth,
        events={"poll_ms": 20, "max_subscribers": 3, "max_subscribers_per_principal": 1},
    )
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:

        def get(who: str) -> Any:
            return client.get("/v1/events", headers={"Authorization": f"Bearer {tokens[who]}"})

        first = await get("obs-a")
        assert first.status == 200
        async with get("obs-a") as refused:
            assert refused.status == 503 and refused.headers["Retry-After"] == "1"
            problem = await refused.json(content_type=None)
            assert problem["code"] == "TOO_MANY_CONNECTIONS"
            assert "events.max_subscribers_per_principal" in problem["detail"]
        other = await get("obs-b")
        assert other.status == 200
        first.close()
        await until(lambda: app[EVENTS].subscribers == 1, "a closed stream leaves")
        again = await get("obs-a")
        assert again.status == 200
        again.close()
        other.close()


async def test_a_stream_whose_client_stopped_reading_ends_and_frees_its_place(
    store_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that does not complete within events.write_timeout_ms (here: one that never
    does, as when the client's socket buffers are full) ends the stream."""
    config = events_config(
        store_url, key_prefix, write_timeout_ms=50, max_subscribers_per_principal=1
    )
    app = create_app(config, store=build_test_store(config))
    stalled = asyncio.Event()
    write = web.StreamResponse.write

    async def stalling(self: web.StreamResponse, data: bytes | bytearray | memoryview) -> None:
        if stalled.is_set() and self.content_type == "text/event-stream":
            await asyncio.Event().wait()  # the client never takes it
        await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", stalling)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        api = Api(client)
        stream = await open_stream(api)
        await api.put("t1")
        assert await stream.task_states(1) == [("t1", "READY")]
        stalled.set()
        await api.put("t2")
        await until(lambda: app[EVENTS].subscribers == 0, "the stalled stream ends")
        stalled.clear()
        with pytest.raises((EOFError, aiohttp.ClientError)):
            await stream.frame()
        resumed = await open_stream(api, after=stream.last_id)
        assert await resumed.task_states(1) == [("t2", "READY")]  # nothing lost
        resumed.response.close()


async def test_streams_end_when_the_gateway_shuts_down(api: Api) -> None:
    stream = await open_stream(api)
    await api.put("t1")
    assert await stream.task_states(1) == [("t1", "READY")]
    await api.client.app.shutdown()
    with pytest.raises(EOFError):
        await stream.frame(seconds=30)
