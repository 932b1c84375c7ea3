"""Effect ids by a unique prefix (issue 27, item 7): ``Store.find_effects`` on every store,
from each store's own index (a primary-key range in SQL, ``effect_prefix.lua`` over the
effect ids index in Redis), held to ``ledger.queries.effects_with_prefix``; and
``GET /v1/effects/{prefix}``: one record for a unique prefix, ``400`` naming up to 10 ids for
an ambiguous one, ``400`` naming the rule for a malformed one, the usual ``404`` for none,
and the same role refusal, whatever the prefix matches, as for a full id."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway import ledger_api
from fencegate.gateway.app import create_app
from fencegate.gateway.state import STORE
from fencegate.ledger import queries
from fencegate.ledger.effects import EffectState, effect_id
from fencegate.ledger.keys import Keys
from fencegate.ledger.store import Store
from tests.api import Api
from tests.conftest import build_test_store, make_config
from tests.test_auth import Env, auth_section
from tests.test_retention import (
    SETTLED_MS,
    claim_as,
    commit,
    effect_done,
    sweep,
)


def colliding_slots(task_id: str, count: int = 2, width: int = 6) -> list[str]:
    """``count`` slots of ``task_id`` (revision 1, node main) whose effect ids share their
    first ``width`` characters."""
    seen: dict[str, list[str]] = {}
    for i in range(2_000_000):
        slot = f"s{i}"
        bucket = seen.setdefault(effect_id(task_id, 1, "main", slot)[:width], [])
        bucket.append(slot)
        if len(bucket) == count:
            return bucket
    raise AssertionError("no collision")


async def effects_of(store: Store, task_id: str, slots: list[str]) -> list[str]:
    """One committed effect per slot under a fresh claim of a new task; their ids."""
    await store.put_task(task_id, "in", None)
    task = await store.claim(task_id, claim_as("w"))
    return [await effect_done(store, task, slot, EffectState.COMMITTED) for slot in slots]


async def test_a_prefix_finds_the_live_effects_that_start_with_it(store: Store) -> None:
    pair = colliding_slots("t1")
    ids = await effects_of(store, "t1", [*pair, "other-1", "other-2"])
    assert ids[0][:6] == ids[1][:6]
    for prefix in (ids[0][:6], ids[0][:7], ids[1][:12], ids[2][:6], ids[3], "abcdef", "0"):
        found = await store.find_effects(prefix, 11)
        assert found == queries.effects_with_prefix(ids, prefix, 11), prefix
    assert await store.find_effects(ids[0][:6], 11) == sorted(ids[:2])
    assert await store.find_effects(ids[0][:6], 1) == [min(ids[:2])]
    assert await store.find_effects(ids[2], 11) == [ids[2]]
    with pytest.raises(ValueError, match="lowercase hex"):
        await store.find_effects(ids[0][:6].upper(), 11)
    with pytest.raises(ValueError, match="lowercase hex"):
        await store.find_effects("%", 11)


async def test_an_expired_effect_is_no_longer_found_by_a_prefix(store: Store) -> None:
    ids = await effects_of(store, "gone", ["s1"])
    await commit(store, await store.get_task("gone"), "in")
    store.clock_offset_ms += SETTLED_MS
    tasks, _, _ = await sweep(store)
    assert tasks == 1
    # Its full id answers EFFECT_EXPIRED (tests/test_retention.py); a prefix finds nothing.
    assert await store.find_effects(ids[0][:8], 11) == []


async def test_redis_retention_takes_an_expired_effect_out_of_the_ids_index(
    redis_server: Any, key_prefix: str
) -> None:
    config = make_config(redis_server.url, key_prefix, reconciler={"enabled": False})
    store = build_test_store(config)
    await store.open()
    raw = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        kept = await effects_of(store, "kept", ["s1"])
        gone = await effects_of(store, "gone", ["s1"])
        await commit(store, await store.get_task("gone"), "in")
        store.clock_offset_ms += SETTLED_MS
        assert (await sweep(store))[0] == 1
        ids_index = Keys(key_prefix).effect_ids
        assert await raw.zrange(ids_index, 0, -1) == kept and gone[0] not in kept
    finally:
        await store.close()
        await raw.aclose()


async def test_redis_effects_created_before_the_index_are_found(
    redis_server: Any, key_prefix: str
) -> None:
    config = make_config(redis_server.url, key_prefix, reconciler={"enabled": False})
    store = build_test_store(config)
    await store.open()
    try:
        ids = await effects_of(store, "old", ["s1", "s2"])
    finally:
        await store.close()
    # As an older fencegate left them: the effectId -> taskId hash, no ids index.
    keys = Keys(key_prefix)
    raw = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    await raw.delete(keys.effect_ids, keys.effect_ids_indexed)
    # ... and an entry whose record an older gateway's retention removed.
    await raw.zadd(keys.effect_ids, {"ab" * 32: 0})
    store = build_test_store(config)
    await store.open()
    try:
        for eid in ids:
            assert await store.find_effects(eid[:10], 11) == [eid]
        assert await raw.exists(keys.effect_ids_indexed)
        assert await store.find_effects("abab", 11) == []
    finally:
        await store.close()
        await raw.aclose()


# --- GET /v1/effects/{prefix} (the protocol: SQLite) ----------------------------------------


@pytest.fixture
async def api(tmp_path: Any, key_prefix: str) -> AsyncIterator[Api]:
    config = make_config(f"sqlite:///{tmp_path / 'fg.db'}", key_prefix,
                         reconciler={"enabled": False})  # fmt: skip
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


async def test_get_by_a_unique_prefix_is_the_record(api: Api) -> None:
    (eid,) = await effects_of(api.store, "t1", ["s1"])
    full = await api.call("GET", f"/v1/effects/{eid}")
    assert full.status == 200
    for width in (6, 12, 63):
        short = await api.call("GET", f"/v1/effects/{eid[:width]}")
        assert (short.status, short.body) == (200, full.body), width


async def test_an_ambiguous_prefix_is_400_naming_the_matches(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    slots = colliding_slots("t1", count=3)
    ids = sorted(await effects_of(api.store, "t1", slots))
    answer = await api.call("GET", f"/v1/effects/{ids[0][:6]}")
    assert (answer.status, answer.code) == (400, "BAD_REQUEST")
    assert answer.body["matches"] == ids
    detail = answer.body["detail"]
    assert detail.startswith(f"effect id prefix {ids[0][:6]!r} is ambiguous: 3 effect ids")
    assert all(eid in detail for eid in ids) and "give more characters" in detail
    # At most MAX_MATCHES_SHOWN are named, and the refusal says there are more.
    monkeypatch.setattr(ledger_api, "MAX_MATCHES_SHOWN", 2)
    capped = await api.call("GET", f"/v1/effects/{ids[0][:6]}")
    assert capped.body["matches"] == ids[:2]
    assert "more than 2 effect ids" in capped.body["detail"]
    assert ids[2] not in capped.body["detail"]


@pytest.mark.parametrize("text", ["abcde", "ABCDEF", "abcdefg", "not-an-id", "g" * 64, "a" * 65])
async def test_a_malformed_id_is_404_naming_the_rule(api: Api, text: str) -> None:
    """404 as it was before prefixes were accepted (clients may rely on it), naming the rule."""
    answer = await api.call("GET", f"/v1/effects/{text}")
    assert (answer.status, answer.code) == (404, "NO_SUCH_EFFECT")
    assert answer.body["detail"] == (
        f"no effect {text!r}: an effect id is 64 lowercase hex characters, or a unique prefix "
        "of at least 6"
    )


async def test_no_match_is_404(api: Api) -> None:
    await effects_of(api.store, "t1", ["s1"])
    for text in ("abcdef12", "0" * 64):
        answer = await api.call("GET", f"/v1/effects/{text}")
        assert (answer.status, answer.code) == (404, "NO_SUCH_EFFECT"), text
    assert (await api.call("GET", "/v1/effects/abcdef12")).body["detail"] == (
        "no effect id starts with 'abcdef12'"
    )


async def test_a_prefix_reaches_exactly_what_the_full_id_does(
    tmp_path: Any, key_prefix: str
) -> None:
    """With ``[auth]``: whoever may not read an effect by its full id gets the same refusal
    for any prefix, before the store is asked, so neither the status, the code nor the body
    tells whether (or how many) effects match; whoever may read it by its full id reads it by
    a prefix (the ledger is not scoped by task_prefixes: docs/security.md)."""
    section = auth_section()
    for principal in section["principals"]:
        if principal["name"] == "observer":
            principal["task_prefixes"] = ["team-a/"]
    config = make_config(f"sqlite:///{tmp_path / 'fg.db'}", key_prefix, auth=section,
                         reconciler={"enabled": False})  # fmt: skip
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        env = Env(client, None)  # type: ignore[arg-type]
        store = client.app[STORE]
        pair = colliding_slots("team-b/1")
        ids = sorted(await effects_of(store, "team-b/1", pair))
        unique = ids[0][:7] if ids[0][:7] != ids[1][:7] else ids[0]
        texts = [ids[0], unique, ids[0][:6], "abcdef12", "abcde", "zzzzzz"]
        for who in ("scheduler", "worker-a", None):
            seen = set()
            for text in texts:
                answer = await env.call("GET", f"/v1/effects/{text}", who)
                body = json.loads(answer.body)
                # (The detail names the request's path: the same words around it.)
                seen.add((answer.status, body["code"], body["detail"].replace(text, "<id>")))
            assert len(seen) == 1, (who, seen)
            ((status, _, _),) = seen
            assert status == (401 if who is None else 403)
        for who in ("operator", "observer"):
            full = await env.call("GET", f"/v1/effects/{ids[0]}", who)
            short = await env.call("GET", f"/v1/effects/{unique}", who)
            assert full.status == short.status == 200
            assert json.loads(full.body) == json.loads(short.body)
            ambiguous = await env.call("GET", f"/v1/effects/{ids[0][:6]}", who)
            assert ambiguous.status == 400 and json.loads(ambiguous.body)["matches"] == ids
