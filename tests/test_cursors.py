"""List cursors (``GET /v1/effects``, ``GET /v1/tasks``): a cursor the gateway did not issue
is ``400 BAD_REQUEST`` on every store, never a 500 (issue 25: a crafted effects cursor with a
creation time past a SQL integer made SQLite's driver raise OverflowError).

The pure decoders are held to "only what the encoders write round-trips"; then random strings
and near-misses go over real HTTP against each store (one gateway per store, many examples)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import hypothesis.strategies as st
import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from yarl import URL

from fencegate.gateway.app import create_app
from fencegate.gateway.config import Config
from fencegate.ledger.errors import BadRequest
from fencegate.ledger.store import (
    decode_cursor,
    decode_task_cursor,
    encode_cursor,
    encode_task_cursor,
)
from tests.conftest import build_test_store, make_config

HEX64 = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
TASK_IDS = st.text(
    alphabet="ABCXYZabcxyz0189._:@/-", min_size=1, max_size=200
)  # the task id alphabet


def b64(raw: str | bytes) -> str:
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


#: Strings a client could send as ``cursor``: anything printable, and near-misses of both
#: cursor forms (big, signed or non-ASCII numbers; ids of the wrong alphabet or length; stray
#: padding and characters the decoder would skip).
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=120)
_NUMBERS = st.integers(min_value=-(2**70), max_value=2**70).map(str) | st.sampled_from(
    ["", "١٢", "\uff11\uff12", "²", "+1", " 1", "1_000", "0x10", "9" * 40]
)
_IDS = HEX64 | st.text(max_size=70) | st.sampled_from(["\x00" * 64, "A" * 64, "é" * 64])
NEAR_EFFECT = st.builds(lambda n, i: b64(f"{n}:{i}"), _NUMBERS, _IDS)
NEAR_TASK = st.builds(lambda t: b64("task:" + t), st.text(max_size=210))
MANGLED = st.builds(
    lambda c, extra: c + extra,
    NEAR_EFFECT | NEAR_TASK | st.builds(b64, st.binary(max_size=90)),
    st.sampled_from(["", "=", "==", "\n", " ", "!", "%", "+", "/"]),
)
CURSORS = _TEXT | NEAR_EFFECT | NEAR_TASK | MANGLED


@given(st.integers(0, 10**15 - 1), HEX64)
def test_effect_cursors_round_trip(created: int, effect: str) -> None:
    assert decode_cursor(encode_cursor(created, effect)) == (created, effect)


@given(TASK_IDS)
def test_task_cursors_round_trip(task_id: str) -> None:
    assert decode_task_cursor(encode_task_cursor(task_id)) == task_id


@pytest.mark.parametrize(
    "cursor",
    [
        b64("9" * 30 + ":" + "a" * 64),  # past every SQL integer: SQLite raised OverflowError
        b64("99999999999999999999:" + "a" * 64),
        b64("\uff11\uff12:" + "a" * 64),  # str.isdigit takes other scripts' digits
        b64("1:" + "\x00" * 64),  # PostgreSQL text cannot hold a NUL
        b64("1:" + "A" * 64),
        b64("-1:" + "a" * 64),
        b64("1:" + "a" * 64) + "=",  # padding the encoder never writes
        b64("1:" + "a" * 64) + "\n",  # a character the decoder would skip
        b64("1:" + "a" * 64)[:-1] + "!" + b64("1:" + "a" * 64)[-1:],
        b64(b"\xff\xfe:" + b"a" * 64),
    ],
    ids=["huge", "20-digits", "fullwidth", "nul", "upper", "negative", "padded", "newline",
         "bang", "not-utf8"],
)  # fmt: skip
def test_effect_cursors_the_gateway_did_not_write_are_refused(cursor: str) -> None:
    with pytest.raises(BadRequest, match=r"^cursor: "):
        decode_cursor(cursor)


@given(CURSORS)
def test_a_decoded_cursor_is_one_the_encoder_writes(cursor: str) -> None:
    for decode, encode in (
        (decode_cursor, lambda found: encode_cursor(*found)),
        (decode_task_cursor, encode_task_cursor),
    ):
        try:
            found: Any = decode(cursor)
        except BadRequest:
            continue
        assert encode(found) == cursor


@pytest.fixture
def gateway(
    store_url: str, key_prefix: str
) -> Iterator[tuple[asyncio.Runner, TestClient[Any, Any]]]:
    """One gateway per store for a whole hypothesis run, on a loop of the test's own (a
    hypothesis-driven test is synchronous; each example runs one request on that loop)."""
    config = make_config(store_url, key_prefix, reconciler={"enabled": False})
    with asyncio.Runner() as runner:
        client = runner.run(_open(config))
        try:
            yield runner, client
        finally:
            runner.run(client.close())


async def _open(config: Config) -> TestClient[Any, Any]:
    client: TestClient[Any, Any] = TestClient(
        TestServer(create_app(config, store=build_test_store(config)), host="127.0.0.1")
    )
    await client.start_server()
    await _seed(client)
    return client


async def _seed(client: TestClient[Any, Any]) -> None:
    """A few tasks, so a cursor that decodes is compared with stored rows, not an empty
    table."""
    for i in range(3):
        answer = await client.put(f"/v1/tasks/seed-{i}", json={"inputDigest": "in-1"})
        assert answer.status == 201, await answer.text()


async def _listing_status(client: TestClient[Any, Any], path: str, cursor: str) -> tuple[int, str]:
    url = URL(f"{client.make_url(path)}?cursor={quote(cursor, safe='')}", encoded=True)
    async with client.session.get(url) as answer:
        return answer.status, await answer.text()


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(cursor=CURSORS)
def test_no_cursor_is_a_500_on_any_store(
    gateway: tuple[asyncio.Runner, TestClient[Any, Any]], cursor: str
) -> None:
    runner, client = gateway
    for path in ("/v1/effects", "/v1/tasks"):
        status, text = runner.run(_listing_status(client, path, cursor))
        assert status in (200, 400), (path, cursor, status, text)
        if status == 400:
            assert '"BAD_REQUEST"' in text and "cursor" in text, text


@pytest.mark.parametrize(
    ("path", "cursor"),
    [
        ("/v1/effects", b64("9" * 30 + ":" + "a" * 64)),
        ("/v1/effects", b64("1:" + "\x00" * 64)),
        ("/v1/effects", b64("1:" + "a" * 64) + "\n"),
        ("/v1/tasks", b64("task:seed-0") + "\n"),
    ],
    ids=["effects-huge", "effects-nul", "effects-newline", "tasks-newline"],
)
def test_crafted_cursors_are_400_on_every_store(
    gateway: tuple[asyncio.Runner, TestClient[Any, Any]], path: str, cursor: str
) -> None:
    runner, client = gateway
    status, text = runner.run(_listing_status(client, path, cursor))
    assert status == 400 and '"BAD_REQUEST"' in text, text
