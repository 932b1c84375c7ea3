"""Conformance: every rule of the claim.v1 contract, through HTTP, on both stores.

Each test runs twice (``client`` is parametrized over the SQLite and the Redis store).
Expiry is driven by the store's test clock offset (``api.advance``), never by sleeping, and
the store's clock stands still otherwise (``frozen_store_clock``): the real time a loaded
machine takes between two steps never counts.
"""

from __future__ import annotations

import io
import re
from importlib import metadata
from typing import Any

import pytest
import structlog.testing
from aiohttp.test_utils import TestClient

from fencegate.ledger.clock import iso_utc
from tests.api import Api
from tests.conftest import DEFAULT_MAX_RUNTIME_MS, MAX_TTL_MS

pytestmark = pytest.mark.frozen_store_clock


@pytest.fixture
def api(client: TestClient[Any, Any]) -> Api:
    return Api(client)


async def test_put_creates_then_same_digest_changes_nothing(api: Api) -> None:
    created = await api.put("t1", "in-1")
    assert created.status == 201
    assert created.body["state"] == "READY"
    assert created.body["revision"] == 1
    assert created.body["claimGeneration"] == 0
    again = await api.put("t1", "in-1")
    assert again.status == 200
    assert again.body == created.body


async def test_task_record_has_every_contract_field(api: Api) -> None:
    await api.put("team/job:42@v1.x_y-z")
    record = (await api.get("team/job:42@v1.x_y-z")).body
    for name in (
        "taskId",
        "state",
        "revision",
        "inputDigest",
        "claimGeneration",
        "attemptId",
        "owner",
        "leaseExpiresAt",
        "cancelGeneration",
        "schedulerEpoch",
        "commit",
    ):
        assert name in record
    assert record["taskId"] == "team/job:42@v1.x_y-z"


async def test_claim_from_ready_grants_generation_and_attempt(api: Api) -> None:
    await api.put("t1")
    now = await api.store.now_ms()
    answer = await api.try_claim("t1", ttl_ms=5_000)
    assert answer.status == 200
    body = answer.body
    assert body["claimGeneration"] == 1
    assert body["attemptId"]
    assert body["schedulerEpoch"] == 1
    assert body["cancelGeneration"] == 0
    assert body["revision"] == 1 and body["inputDigest"] == "in-1"
    assert now + 5_000 <= body["leaseExpiresAt"] < now + 5_000 + 2_000
    record = (await api.get("t1")).body
    assert record["state"] == "CLAIMED"
    assert record["owner"] == "w1"
    assert record["attemptId"] == body["attemptId"]


async def test_claim_of_held_task_is_refused(api: Api) -> None:
    await api.put("t1")
    await api.claim("t1", "w1")
    answer = await api.try_claim("t1", "w2")
    assert answer.status == 409 and answer.code == "CLAIMED"
    assert answer.content_type == "application/problem+json"


async def test_expired_claim_is_reclaimed_with_next_generation_and_new_attempt(api: Api) -> None:
    await api.put("t1")
    first = await api.claim("t1", "w1", ttl_ms=1_000)
    api.advance(1_000)
    second = await api.claim("t1", "w2")
    assert second.claim_generation == first.claim_generation + 1
    assert second.attempt_id != first.attempt_id
    # The first attempt is fenced everywhere.
    assert (await api.renew(first)).code == "FENCED"
    assert (await api.commit(first)).code == "FENCED"
    assert (await api.release(first)).code == "FENCED"


async def test_generations_strictly_increase_over_repeated_reclaims(api: Api) -> None:
    await api.put("t1")
    seen = []
    for _ in range(6):
        lease = await api.claim("t1", ttl_ms=1_000)
        seen.append(lease.claim_generation)
        api.advance(1_000)
    assert seen == list(range(1, 7))


async def test_ttl_above_maximum_is_clamped_and_answer_shows_it(api: Api) -> None:
    await api.put("t1")
    answer = await api.try_claim("t1", ttl_ms=10**12)
    assert answer.status == 200
    assert answer.body["grantedTtlMs"] == MAX_TTL_MS
    lease = await api.claim("t2") if (await api.put("t2")).status == 201 else None
    assert lease is not None
    renewed = await api.renew(lease, ttl_ms=10**12)
    now = await api.store.now_ms()
    assert renewed.status == 200
    assert renewed.body["leaseExpiresAt"] <= now + MAX_TTL_MS


async def test_renew_extends_lease(api: Api) -> None:
    await api.put("t1")
    lease = await api.claim("t1", ttl_ms=2_000)
    api.advance(1_500)
    answer = await api.renew(lease, ttl_ms=2_000)
    assert answer.status == 200
    assert answer.body["leaseExpiresAt"] >= lease.lease_expires_at + 1_500
    api.advance(1_000)  # past the original lease, inside the renewed one
    assert (await api.try_claim("t1", "w2")).code == "CLAIMED"


async def test_renew_after_expiry_is_refused_even_if_nobody_claimed(api: Api) -> None:
    await api.put("t1")
    lease = await api.claim("t1", ttl_ms=1_000)
    api.advance(1_000)
    answer = await api.renew(lease)
    assert answer.status == 409 and answer.code == "LEASE_EXPIRED"


async def test_renewals_never_pass_attempt_start_plus_max_runtime(api: Api) -> None:
    await api.put("t1", maxRuntimeMs=5_000)
    lease = await api.claim("t1", ttl_ms=2_000)
    start = lease.lease_expires_at - 2_000
    api.advance(1_000)
    assert (await api.renew(lease, ttl_ms=2_000)).status == 200
    api.advance(1_500)
    capped = await api.renew(lease, ttl_ms=10_000)
    assert capped.status == 200
    assert capped.body["leaseExpiresAt"] == start + 5_000
    api.advance(1_000)
    refused = await api.renew(lease, ttl_ms=10_000)
    assert refused.status == 409 and refused.code == "RUNTIME_EXCEEDED"


async def test_default_max_runtime_applies_when_task_sets_none(api: Api) -> None:
    await api.put("t1")
    lease = await api.claim("t1", ttl_ms=MAX_TTL_MS)
    start = lease.lease_expires_at - MAX_TTL_MS
    last = None
    for _ in range(2 * DEFAULT_MAX_RUNTIME_MS // MAX_TTL_MS + 2):
        api.advance(MAX_TTL_MS // 2)
        answer = await api.renew(lease, ttl_ms=MAX_TTL_MS)
        if answer.status != 200:
            last = answer
            break
        assert answer.body["leaseExpiresAt"] <= start + DEFAULT_MAX_RUNTIME_MS
    assert last is not None and last.code == "RUNTIME_EXCEEDED"


async def test_claim_ttl_is_capped_by_max_runtime(api: Api) -> None:
    await api.put("t1", maxRuntimeMs=1_000)
    answer = await api.try_claim("t1", ttl_ms=30_000)
    assert answer.body["grantedTtlMs"] == 1_000


async def test_commit_is_canonical_and_idempotent_for_the_same_attempt(api: Api) -> None:
    await api.put("t1")
    lease = await api.claim("t1")
    first = await api.commit(lease, "out-1")
    assert first.status == 200
    assert first.body["outcome"] == "COMMITTED" and first.body["commitId"]
    again = await api.commit(lease, "out-1")
    assert again.status == 200 and again.body == first.body
    other = await api.commit(lease, "out-2")
    assert other.status == 409 and other.code == "ALREADY_COMMITTED"
    record = (await api.get("t1")).body
    assert record["state"] == "COMMITTED"
    assert record["commit"]["commitId"] == first.body["commitId"]
    assert record["commit"]["resultDigest"] == "out-1"
    assert record["commit"]["attemptId"] == lease.attempt_id
    assert (await api.try_claim("t1", "w2")).code == "ALREADY_COMMITTED"
    assert (await api.renew(lease)).code == "ALREADY_COMMITTED"


async def test_commit_keeps_the_result(api: Api) -> None:
    await api.put("t1")
    lease = await api.claim("t1")
    answer = await api.commit(lease, "out-1", result={"b": [1, 2], "a": None})
    assert answer.status == 200
    assert (await api.get("t1")).body["commit"]["result"] == {"a": None, "b": [1, 2]}


async def test_commit_compares_identity_not_clock(api: Api) -> None:
    await api.put("t1")
    lease = await api.claim("t1", ttl_ms=1_000)
    api.advance(5_000)  # expired, but nobody claimed since
    answer = await api.commit(lease)
    assert answer.status == 200 and answer.body["outcome"] == "COMMITTED"


async def test_stale_worker_cannot_commit_after_takeover(api: Api) -> None:
    """The A/B example: A holds generation 1, pauses, B claims generation 2, A wakes up."""
    await api.put("t1")
    a = await api.claim("t1", "A", ttl_ms=1_000)
    api.advance(2_000)
    b = await api.claim("t1", "B")
    assert (await api.commit(a, "from-A")).code == "FENCED"
    assert (await api.commit(b, "from-B")).status == 200
    assert (await api.get("t1")).body["commit"]["resultDigest"] == "from-B"


async def test_commit_with_forged_generation_is_fenced(api: Api) -> None:
    await api.put("t1")
    lease = await api.claim("t1")
    answer = await api.commit(lease, claimGeneration=lease.claim_generation + 1)
    assert answer.code == "FENCED"
    answer = await api.commit(lease, attemptId="someone-else")
    assert answer.code == "FENCED"
    assert (await api.renew(lease, owner="impostor")).code == "FENCED"


async def test_new_revision_makes_running_commit_stale_then_fenced(api: Api) -> None:
    await api.put("t1", "in-1")
    lease = await api.claim("t1")
    revised = await api.put("t1", "in-2")
    assert revised.status == 200
    assert revised.body["revision"] == 2 and revised.body["state"] == "READY"
    assert (await api.commit(lease)).code == "STALE_INPUT"
    assert (await api.commit(lease, inputDigest="in-2")).code == "STALE_INPUT"
    assert (await api.renew(lease)).code == "STALE_INPUT"
    fresh = await api.claim("t1", "w2")
    assert fresh.claim_generation == lease.claim_generation + 1
    assert (await api.commit(lease)).code == "FENCED"
    assert (await api.commit(fresh)).status == 200


async def test_new_revision_reopens_a_committed_task(api: Api) -> None:
    await api.put("t1", "in-1")
    lease = await api.claim("t1")
    assert (await api.commit(lease)).status == 200
    revised = (await api.put("t1", "in-2")).body
    assert revised["state"] == "READY" and revised["commit"] is None
    second = await api.claim("t1")
    assert (await api.commit(second, "out-2")).status == 200
    assert (await api.get("t1")).body["commit"]["resultDigest"] == "out-2"


async def test_commit_with_wrong_input_digest_is_stale(api: Api) -> None:
    await api.put("t1", "in-1")
    lease = await api.claim("t1")
    assert (await api.commit(lease, inputDigest="in-9")).code == "STALE_INPUT"


async def test_claim_with_expected_revision(api: Api) -> None:
    await api.put("t1", "in-1")
    await api.put("t1", "in-2")
    assert (await api.try_claim("t1", expectedRevision=1)).code == "STALE_INPUT"
    assert (await api.try_claim("t1", expectedRevision=2)).status == 200


async def test_epoch_bump_fences_every_older_claim(api: Api) -> None:
    await api.put("t1")
    lease = await api.claim("t1", ttl_ms=30_000)
    bumped = await api.call("POST", "/v1/epoch/bump")
    assert bumped.status == 200 and bumped.body["schedulerEpoch"] == lease.scheduler_epoch + 1
    stale = await api.renew(lease)
    assert stale.code == "STALE_EPOCH"
    # The detail says what was sent, what the claim was made under and what is current
    # (the same words on every store).
    assert (
        stale.body["detail"] == "task t1: schedulerEpoch 1 sent, claim made under 1, current is 2"
    )
    assert (await api.renew(lease, schedulerEpoch=lease.scheduler_epoch + 1)).code == "STALE_EPOCH"
    assert (await api.commit(lease)).code == "STALE_EPOCH"
    assert (await api.commit(lease, schedulerEpoch=lease.scheduler_epoch + 1)).code == "STALE_EPOCH"
    # A claim under the old epoch is refused; under the new one the task is free at once.
    assert (await api.try_claim("t1", epoch=lease.scheduler_epoch)).code == "STALE_EPOCH"
    fresh = await api.claim("t1", "w2")
    assert fresh.scheduler_epoch == lease.scheduler_epoch + 1
    assert fresh.claim_generation == lease.claim_generation + 1


async def test_release_skips_epoch_check_so_old_workers_can_hand_back(api: Api) -> None:
    await api.put("t1")
    lease = await api.claim("t1")
    await api.call("POST", "/v1/epoch/bump")
    answer = await api.release(lease)
    assert answer.status == 200 and answer.body["state"] == "READY"


async def test_epoch_read(api: Api) -> None:
    answer = await api.call("GET", "/v1/epoch")
    assert answer.body == {"schedulerEpoch": 1, "claimsPaused": False}


async def test_cancel_fences_renew_commit_and_claim(api: Api) -> None:
    await api.put("t1")
    lease = await api.claim("t1")
    answer = await api.cancel("t1")
    assert answer.status == 200 and answer.body == {"cancelGeneration": 1}
    assert (await api.get("t1")).body["state"] == "CANCELLED"
    assert (await api.renew(lease)).code == "CANCELLED"
    assert (await api.commit(lease)).code == "CANCELLED"
    assert (await api.release(lease)).code == "CANCELLED"
    assert (await api.try_claim("t1", "w2")).code == "CANCELLED"
    # Cancelling again changes nothing.
    assert (await api.cancel("t1")).body == {"cancelGeneration": 1}


async def test_cancel_generation_is_compared_everywhere(api: Api) -> None:
    await api.put("t1")
    lease = await api.claim("t1")
    assert (await api.renew(lease, cancelGeneration=7)).code == "CANCELLED"
    assert (await api.commit(lease, cancelGeneration=7)).code == "CANCELLED"
    assert (await api.release(lease, cancelGeneration=7)).code == "CANCELLED"


async def test_new_revision_ends_a_cancellation(api: Api) -> None:
    await api.put("t1", "in-1")
    await api.cancel("t1")
    await api.put("t1", "in-2")
    lease = await api.claim("t1")
    assert lease.cancel_generation == 1
    assert (await api.commit(lease)).status == 200


async def test_cancel_of_committed_task_is_refused(api: Api) -> None:
    await api.put("t1")
    await api.commit(await api.claim("t1"))
    assert (await api.cancel("t1")).code == "ALREADY_COMMITTED"


async def test_release_makes_task_ready_again(api: Api) -> None:
    await api.put("t1")
    lease = await api.claim("t1")
    answer = await api.release(lease)
    assert answer.status == 200
    record = (await api.get("t1")).body
    assert record["state"] == "READY" and record["attemptId"] is None
    assert (await api.release(lease)).code == "FENCED"
    again = await api.claim("t1", "w2")
    assert again.claim_generation == 2


async def test_pause_and_resume_claims(api: Api) -> None:
    await api.put("t1")
    paused = await api.call("POST", "/v1/claims/pause")
    assert paused.body["claimsPaused"] is True
    answer = await api.try_claim("t1")
    assert answer.status == 503 and answer.code == "CLAIMS_PAUSED"
    assert (await api.call("GET", "/v1/epoch")).body["claimsPaused"] is True
    await api.call("POST", "/v1/claims/resume")
    assert (await api.try_claim("t1")).status == 200


async def test_unknown_task_is_404_everywhere(api: Api) -> None:
    assert (await api.get("nope")).code == "NO_SUCH_TASK"
    assert (await api.try_claim("nope")).code == "NO_SUCH_TASK"
    assert (await api.cancel("nope")).code == "NO_SUCH_TASK"
    ident = {
        "attemptId": "a",
        "claimGeneration": 1,
        "owner": "w",
        "schedulerEpoch": 1,
        "cancelGeneration": 0,
    }
    answer = await api.call("POST", "/v1/tasks/nope/renew", {**ident, "ttlMs": 1000})
    assert answer.status == 404 and answer.code == "NO_SUCH_TASK"


async def test_health_and_readiness(api: Api) -> None:
    assert (await api.call("GET", "/healthz")).status == 200
    ready = await api.call("GET", "/readyz")
    assert ready.status == 200 and ready.body["status"] == "ready"


# --- bad input -------------------------------------------------------------------------------

CLAIM_OK = {"owner": "w1", "ttlMs": 1000, "schedulerEpoch": 1}


@pytest.mark.one_store
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**CLAIM_OK, "ttlMs": "1000"}, "ttlMs"),
        ({**CLAIM_OK, "ttlMs": True}, "ttlMs"),
        ({**CLAIM_OK, "ttlMs": 0}, "ttlMs"),
        ({**CLAIM_OK, "ttlMs": 10**30}, "ttlMs"),
        ({**CLAIM_OK, "ttlMs": 1.5}, "ttlMs"),
        ({**CLAIM_OK, "schedulerEpoch": -1}, "schedulerEpoch"),
        ({**CLAIM_OK, "owner": ""}, "owner"),
        ({**CLAIM_OK, "owner": "x" * 201}, "owner"),
        ({**CLAIM_OK, "owner": None}, "owner"),
        ({**CLAIM_OK, "surprise": 1}, "surprise"),
        ({"ttlMs": 1000, "schedulerEpoch": 1}, "owner"),
        ({**CLAIM_OK, "expectedRevision": 0}, "expectedRevision"),
    ],
)
async def test_bad_claim_body_names_the_field(api: Api, body: dict[str, Any], field: str) -> None:
    await api.put("t1")
    answer = await api.call("POST", "/v1/tasks/t1/claim", body)
    assert answer.status == 400 and answer.code == "BAD_REQUEST"
    assert answer.content_type == "application/problem+json"
    assert field in answer.body["detail"]
    assert {"type", "title", "status", "detail", "code"} <= answer.body.keys()
    assert (await api.get("t1")).body["state"] == "READY"  # nothing reached the store


@pytest.mark.one_store
@pytest.mark.parametrize(
    "raw", [b"{not json", b"[1,2]", b'"text"', b"", b"null", b"\xff\xfe", b"[" * 100_000]
)
async def test_malformed_body_is_400(api: Api, raw: bytes) -> None:
    await api.put("t1")
    json_type = {"Content-Type": "application/json"}  # any other type is 415 (test_request_guard)
    async with api.client.post("/v1/tasks/t1/claim", data=raw, headers=json_type) as resp:
        assert resp.status == 400 and (await resp.json())["code"] == "BAD_REQUEST"


@pytest.mark.one_store
@pytest.mark.parametrize(
    "body",
    [
        {},
        {"inputDigest": 5},
        {"inputDigest": "x", "maxRuntimeMs": 0},
        {"inputDigest": "x", "maxRuntimeMs": 10**15},
        {"inputDigest": "x", "extra": True},
    ],
)
async def test_bad_put_writes_nothing(api: Api, body: dict[str, Any]) -> None:
    answer = await api.call("PUT", "/v1/tasks/t1", body)
    assert answer.status == 400 and answer.code == "BAD_REQUEST"
    assert (await api.get("t1")).code == "NO_SUCH_TASK"


@pytest.mark.one_store
@pytest.mark.parametrize("task_id", ["x" * 201, "bad%20id", "semi;colon", "br{ace}"])
async def test_bad_task_id_is_400(api: Api, task_id: str) -> None:
    answer = await api.call("PUT", f"/v1/tasks/{task_id}", {"inputDigest": "x"})
    assert answer.status == 400 and "taskId" in answer.body["detail"]


@pytest.mark.one_store
async def test_oversized_body_is_413(api: Api) -> None:
    answer = await api.call("PUT", "/v1/tasks/t1", data=io.BytesIO(b"x" * (2 * 1024 * 1024)))
    assert answer.status == 413 and answer.code == "PAYLOAD_TOO_LARGE"


async def test_oversized_result_is_413_and_not_committed(api: Api) -> None:
    await api.put("t1")
    lease = await api.claim("t1")
    answer = await api.commit(lease, result="x" * (70 * 1024))
    assert answer.status == 413 and answer.code == "PAYLOAD_TOO_LARGE"
    assert (await api.get("t1")).body["state"] == "CLAIMED"


@pytest.mark.one_store
async def test_unknown_route_and_wrong_method_are_problems(api: Api) -> None:
    missing = await api.call("GET", "/v1/nothing")
    assert missing.status == 404 and missing.content_type == "application/problem+json"
    wrong = await api.call("DELETE", "/v1/epoch")
    assert wrong.status == 405 and wrong.content_type == "application/problem+json"


async def test_claimed_says_when_the_lease_ends_and_when_to_retry(api: Api) -> None:
    await api.put("t1")
    lease = await api.claim("t1", "w1", ttl_ms=30_000)
    async with api.client.post(
        "/v1/tasks/t1/claim", json={"owner": "w2", "ttlMs": 1000, "schedulerEpoch": 1}
    ) as resp:
        assert resp.status == 409
        retry_after = int(resp.headers["Retry-After"])
        problem = await resp.json(content_type=None)
    assert problem["code"] == "CLAIMED"
    assert problem["leaseExpiresAt"] == lease.lease_expires_at
    assert 29 <= retry_after <= 30 and 29_000 <= problem["retryAfterMs"] <= 30_000
    iso = iso_utc(lease.lease_expires_at)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", iso)
    assert (
        problem["detail"] == f"task t1: held until {iso} (leaseExpiresAt {lease.lease_expires_at})"
    )
    # A lease about to end (half a second left: real time passes too) still says 1 second.
    api.advance(29_500)
    async with api.client.post(
        "/v1/tasks/t1/claim", json={"owner": "w2", "ttlMs": 1000, "schedulerEpoch": 1}
    ) as resp:
        assert resp.headers["Retry-After"] == "1"


async def test_lease_and_runtime_ends_are_also_in_iso(api: Api) -> None:
    await api.put("t1", maxRuntimeMs=20_000)
    lease = await api.claim("t1", "w1", ttl_ms=20_000)
    refused = await api.renew(lease, ttl_ms=10_000)
    assert refused.code == "RUNTIME_EXCEEDED"
    ends = refused.body["runtimeEndsAt"]
    assert refused.body["detail"].endswith(f"{iso_utc(ends)} (runtimeEndsAt {ends})")
    api.advance(20_000)
    expired = await api.renew(lease)
    assert expired.code == "LEASE_EXPIRED"
    assert f"{iso_utc(lease.lease_expires_at)} (leaseExpiresAt " in expired.body["detail"]


@pytest.mark.one_store
async def test_healthz_names_the_version(api: Api) -> None:
    health = await api.call("GET", "/healthz")
    assert health.body == {"status": "ok", "version": metadata.version("fencegate")}


async def test_who_bumped_the_epoch_or_paused_claims_is_logged(api: Api) -> None:
    """Without ``[auth]`` the ``Fence-Operator`` label names who did it (with ``[auth]``, the
    principal's name), as on the ledger's operator actions."""
    headers = {"Fence-Operator": "alice"}
    with structlog.testing.capture_logs() as logs:
        for path in ("/v1/epoch/bump", "/v1/claims/pause", "/v1/claims/resume"):
            async with api.client.post(path, headers=headers) as resp:
                assert resp.status == 200
        async with api.client.post("/v1/epoch/bump") as resp:
            assert resp.status == 200
        async with api.client.post("/v1/epoch/bump", headers={"Fence-Operator": "<b>x"}) as resp:
            assert resp.status == 400  # only plain labels are recorded
    said = [(e["event"], e.get("by")) for e in logs if "by" in e]
    assert said == [
        ("epoch.bumped", "alice"),
        ("claims.paused", "alice"),
        ("claims.resumed", "alice"),
        ("epoch.bumped", "anonymous"),
    ]
