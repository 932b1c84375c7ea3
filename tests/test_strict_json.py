"""Strict JSON on the gateway's own API: one meaning per body. The body is refused before any
store step, so it is a protocol-layer rule: SQLite only (``one_store``, docs/stores.md).

Python's parser takes the last of two duplicate keys and accepts NaN and Infinity; another
parser in front of or behind the gateway may read the same bytes otherwise. The API refuses
both with 400 rather than guess.
"""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

pytestmark = pytest.mark.one_store

JSON = {"Content-Type": "application/json"}


async def send(client: TestClient[Any, Any], method: str, path: str, raw: bytes) -> Any:
    async with client.request(method, path, data=raw, headers=JSON) as resp:
        return resp.status, await resp.json(content_type=None)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"inputDigest": "a", "inputDigest": "b"}',
        b'{"inputDigest": "a", "maxRuntimeMs": NaN}',
        b'{"inputDigest": "a", "maxRuntimeMs": Infinity}',
        b'{"inputDigest": "a", "maxRuntimeMs": -Infinity}',
    ],
)
async def test_put_refuses_duplicate_keys_and_non_numbers(
    client: TestClient[Any, Any], raw: bytes
) -> None:
    status, body = await send(client, "PUT", "/v1/tasks/strict", raw)
    assert (status, body["code"]) == (400, "BAD_REQUEST"), body
    status, _ = await send(client, "GET", "/v1/tasks/strict", b"")
    assert status == 404  # nothing was created


async def test_a_commit_result_with_nan_or_a_duplicate_key_is_refused(
    client: TestClient[Any, Any],
) -> None:
    status, _ = await send(client, "PUT", "/v1/tasks/r", b'{"inputDigest": "in"}')
    assert status == 201
    status, claim = await send(
        client, "POST", "/v1/tasks/r/claim", b'{"owner": "w", "ttlMs": 30000, "schedulerEpoch": 1}'
    )
    assert status == 200, claim
    ident = (
        f'"attemptId": "{claim["attemptId"]}", "claimGeneration": {claim["claimGeneration"]}, '
        f'"schedulerEpoch": 1, "cancelGeneration": 0, "inputDigest": "in", "resultDigest": "x"'
    )
    for result in (b'{"v": NaN}', b'{"v": 1, "v": 2}'):
        raw = b"{" + ident.encode() + b', "result": ' + result + b"}"
        status, body = await send(client, "POST", "/v1/tasks/r/commit", raw)
        assert (status, body["code"]) == (400, "BAD_REQUEST"), body
    status, task = await send(client, "GET", "/v1/tasks/r", b"")
    assert task["state"] == "CLAIMED"
