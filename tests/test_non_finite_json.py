"""Non-finite numbers in the bodies the gateway parses itself (issue 25), on every store.

Python reads ``1e400`` as infinity, and writes it back as ``Infinity``: a commit ``result``
holding one was stored, and ``GET /v1/tasks`` stopped being JSON for every reader whose page
included that task. Every ``/v1`` body goes through one strict reader
(``ledger.payloads.strict_loads``), which refuses it (400 ``BAD_REQUEST``) before any model or
store sees it. (``/mcp`` answers the same numbers with -32602: tests/test_mcp_smuggling.py;
``/proxy`` bodies are not parsed: they are digested byte for byte, tests/test_http_rules.py.)
"""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from fencegate.ledger.payloads import strict_loads
from tests.api import Api, Lease

#: Protocol-layer rules, the same on every store: SQLite only (docs/stores.md).
pytestmark = pytest.mark.one_store

JSON = {"Content-Type": "application/json"}
NON_FINITE = [b"1e400", b"-1e400", b"1E999", b"NaN", b"Infinity", b"-Infinity"]
EFFECT = "0" * 64


async def send(client: TestClient[Any, Any], method: str, path: str, raw: bytes) -> Any:
    async with client.request(method, path, data=raw, headers=JSON) as resp:
        return resp.status, await resp.json(content_type=None)


async def read_strictly(client: TestClient[Any, Any], path: str) -> Any:
    """An answer that must be JSON to every parser: read with the strict reader (``json.loads``
    would take ``Infinity``)."""
    async with client.get(path) as resp:
        assert resp.status == 200
        return strict_loads(await resp.read())


def commit_body(lease: Lease, result: bytes) -> bytes:
    return (
        (
            f'{{"attemptId": "{lease.attempt_id}", "claimGeneration": {lease.claim_generation}, '
            f'"schedulerEpoch": {lease.scheduler_epoch}, "cancelGeneration": '
            f'{lease.cancel_generation}, "inputDigest": "{lease.input_digest}", '
            f'"resultDigest": "out", "result": '
        ).encode()
        + result
        + b"}"
    )


@pytest.mark.parametrize("number", NON_FINITE)
async def test_a_commit_result_with_a_non_finite_number_is_refused_and_listings_stay_json(
    client: TestClient[Any, Any], number: bytes
) -> None:
    api = Api(client)
    assert (await api.put("nf")).status == 201
    lease = await api.claim("nf")
    for result in (b'{"v": ' + number + b"}", b"[1, [" + number + b"]]", number):
        status, body = await send(client, "POST", "/v1/tasks/nf/commit", commit_body(lease, result))
        assert (status, body["code"]) == (400, "BAD_REQUEST"), body
    task = await read_strictly(client, "/v1/tasks/nf")
    assert task["state"] == "CLAIMED"
    # The honest commit goes through, and every listing stays JSON.
    status, body = await send(
        client, "POST", "/v1/tasks/nf/commit", commit_body(lease, b'{"v": 1e308}')
    )
    assert status == 200, body
    listed = await read_strictly(client, "/v1/tasks")
    assert [t["taskId"] for t in listed["tasks"]] == ["nf"]
    assert (await read_strictly(client, "/v1/tasks/nf"))["state"] == "COMMITTED"


def _routes(number: bytes) -> list[tuple[str, str, bytes]]:
    n = number
    return [
        ("PUT", "/v1/tasks/r", b'{"inputDigest": "x", "maxRuntimeMs": ' + n + b"}"),
        ("POST", "/v1/tasks/r/claim",
         b'{"owner": "w", "ttlMs": ' + n + b', "schedulerEpoch": 1}'),
        ("POST", "/v1/queues/q/claim",
         b'{"owner": "w", "ttlMs": 1000, "schedulerEpoch": 1, "waitMs": ' + n + b"}"),
        ("POST", "/v1/tasks/r/renew",
         b'{"attemptId": "a", "claimGeneration": 1, "owner": "w", "schedulerEpoch": 1, '
         b'"cancelGeneration": 0, "ttlMs": 1000, "cost": {"usd": ' + n + b"}}"),
        ("POST", "/v1/tasks/r/release",
         b'{"attemptId": "a", "claimGeneration": 1, "owner": "w", "schedulerEpoch": 1, '
         b'"cancelGeneration": 0, "cost": {"usd": ' + n + b"}}"),
        ("POST", f"/v1/effects/{EFFECT}/resolve",
         b'{"outcome": "NOT_APPLIED", "note": "n", "response": {"status": ' + n + b"}}"),
        ("POST", f"/v1/effects/{EFFECT}/approve",
         b'{"note": "n", "payloadDigest": "' + b"a" * 64 + b'", "x": [' + n + b"]}"),
    ]  # fmt: skip


@pytest.mark.parametrize("number", [b"1e400", b"NaN", b"-Infinity"])
async def test_every_v1_body_is_read_by_the_one_strict_reader(
    client: TestClient[Any, Any], number: bytes
) -> None:
    """The refusal comes from the reader (its message), before a model or the store: the same
    400 on every route, whatever the field."""
    for method, path, raw in _routes(number):
        status, body = await send(client, method, path, raw)
        assert (status, body["code"]) == (400, "BAD_REQUEST"), (path, body)
        assert "JSON number" in body["detail"], (path, body["detail"])
    status, _ = await send(client, "GET", "/v1/tasks/r", b"")
    assert status == 404  # nothing was created
