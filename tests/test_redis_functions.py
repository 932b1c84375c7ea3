"""Issue 30, cheaper scripts: the effect steps run as Redis Functions, and the gateway decides
the common steps itself.

The effect steps (prepare, complete, their keyed and compare-and-set kin) are functions of one
library (``redis_store.library_source``), named by a digest of its text so gateways of
different versions sharing one Redis never replace each other's. A Redis that lost it
(``FUNCTION FLUSH``, a new empty primary) answers "Function not found", which ran nothing: the
store loads it and sends the calls again, in the pipeline or without it.

A new effect forwarded at once, and the complete of a forward this gateway prepared, are
decided in Python (``_new_forward``, ``_completion``) and only written by the scripts, which
check that the record is what the decision was made on. These steps must leave exactly what
the scripts' own path leaves: the same records, indexes, events and answers, compared here on
one pinned clock against a store whose fast paths are switched off.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import redis

from fencegate.ledger import redis_store
from fencegate.ledger.effects import Action, Effect, EffectRequest, EffectState, Fence
from fencegate.ledger.keys import Keys
from fencegate.ledger.redis_store import RedisStore, library_source
from fencegate.ledger.tasks import ClaimRequest, LeasePolicy, Task
from tests.conftest import STORE_TIMEOUT_MS
from tests.servers import RedisServer

POLICY = LeasePolicy(max_ttl_ms=600_000, default_max_runtime_ms=6_000_000)
AT_MS = 1_800_000_000_000
#: A request body with what JSON encoders write differently (``/``, non-ASCII).
REQUEST = '{"method":"POST","path":"/pay/é","headers":{},"body":"a/b \\u00e9 é"}'
RESPONSE = '{"status":200,"headers":{},"body":"ok/é"}'


def _fence(task: Task, principal: str | None = None) -> Fence:
    assert task.attempt_id is not None
    return Fence(
        task.task_id,
        task.attempt_id,
        task.claim_generation,
        task.claim_epoch or 1,
        task.cancel_generation,
        principal=principal,
    )


def _fcalls(client: redis.Redis) -> int:
    stats: dict[str, Any] = client.info("commandstats")
    return int(stats.get("cmdstat_fcall", {}).get("calls", 0))


def test_the_library_is_named_by_its_text_and_registers_every_effect_step() -> None:
    library = library_source()
    assert re.fullmatch(r"fencegate_[0-9a-f]{12}", library.name)
    assert library.source.startswith(f"#!lua name={library.name}\n")
    for name in redis_store._FUNCTIONS:
        assert f"redis.register_function('{library.function(name)}', step_{name})" in (
            library.source
        )


async def test_two_versions_libraries_live_side_by_side(
    make_redis_server: Callable[..., RedisServer],
) -> None:
    """Another version's library (another text, so another name) is loaded beside this one's,
    and each gateway keeps calling its own."""
    server = make_redis_server()
    admin = server.client()
    store = RedisStore(server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS)
    try:
        library = library_source()
        other_text = library.source.replace(library.name, "fencegate_0123456789ab").replace(
            "-- Helpers prepended", "-- (another version) Helpers prepended"
        )
        admin.execute_command("FUNCTION LOAD", other_text)
        await store.put_task("t", "in", None)
        task = await store.claim("t", ClaimRequest("w", 60_000, 1))
        outcome = await store.prepare_effect(
            EffectRequest(_fence(task), "n", "s", "pay", "POST", "/pay", "d" * 64), 30_000
        )
        assert outcome.action is Action.FORWARD
        names = {entry[1] for entry in admin.execute_command("FUNCTION LIST")}
        assert names == {library.name, "fencegate_0123456789ab"}
    finally:
        admin.close()
        await store.close()


@pytest.mark.parametrize("query", ["", "?pipeline=0"])
async def test_a_library_redis_lost_is_loaded_and_the_calls_sent_again(
    make_redis_server: Callable[..., RedisServer], query: str
) -> None:
    """After FUNCTION FLUSH (as on a new empty primary) the next effect steps are refused
    "Function not found" (nothing ran), loaded, and sent again: each runs once."""
    server = make_redis_server()
    admin = server.client()
    store = RedisStore(server.url + query, POLICY, timeout_ms=STORE_TIMEOUT_MS)
    try:
        await store.put_task("t", "in", None)
        task = await store.claim("t", ClaimRequest("w", 60_000, 1))
        admin.execute_command("FUNCTION FLUSH")
        assert admin.execute_command("FUNCTION LIST") == []
        admin.config_resetstat()
        outcome = await store.prepare_effect(
            EffectRequest(_fence(task), "n", "s", "pay", "POST", "/pay", "d" * 64), 30_000
        )
        assert outcome.action is Action.FORWARD
        assert _fcalls(admin) == 2  # refused, then run
        assert task.attempt_id is not None
        done, applied = await store.complete_effect(
            "t", outcome.effect.effect_id, 0, task.attempt_id, EffectState.COMMITTED, "", None
        )
        assert applied and done.state is EffectState.COMMITTED
        assert _fcalls(admin) == 3
        stored = admin.hget(Keys("fg").effects("t"), outcome.effect.effect_id)
        assert json.loads(str(stored))["a0_outcome"] == "COMMITTED"
    finally:
        admin.close()
        await store.close()


def _named(found: Any, attempt_id: str) -> str:
    """``found`` as text (maps in key order: JSON encoders order a record's fields
    differently), its claim's random attempt id named alike in both stores."""
    return json.dumps(found, sort_keys=True, default=repr).replace(attempt_id, "<attempt>")


class Steps:
    """One store under a pinned clock, fast paths on or off, and what it leaves in Redis."""

    def __init__(self, server: RedisServer, prefix: str, fast: bool) -> None:
        self.store = RedisStore(server.url, POLICY, timeout_ms=STORE_TIMEOUT_MS, key_prefix=prefix)
        self.store.clock_pinned_ms = AT_MS
        self.keys = Keys(prefix)
        self.fast = fast
        self.client = server.client()

    async def prepare(self, request: EffectRequest, **options: Any) -> Any:
        if not self.fast:
            self.store._revisions.clear()  # no revision known: prepare.lua decides alone
        try:
            outcome = await self.store.prepare_effect(request, 30_000, **options)
        except Exception as exc:  # compared, whatever it is
            return type(exc).__name__, str(exc)
        if not self.fast:
            self.store._held.clear()  # nothing held: complete.lua decides alone
        return outcome.action, outcome.effect, outcome.error and outcome.error.code

    async def complete(self, task_id: str, effect: Effect, *args: Any) -> tuple[Effect, bool]:
        self.store.clock_offset_ms += 7
        return await self.store.complete_effect(
            task_id, effect.effect_id, len(effect.attempts) - 1, *args
        )

    def left(self, task_id: str) -> dict[str, Any]:
        """Records, indexes and events, with the key prefix taken out."""
        keys = self.keys
        events = [json.loads(fields["e"]) for _, fields in self.client.xrange(keys.events)]
        return {
            "records": {
                eid: json.loads(raw)
                for eid, raw in self.client.hgetall(keys.effects(task_id)).items()
            },
            "prepared": self.client.zrange(keys.prepared, 0, -1, withscores=True),
            "unknown": sorted(self.client.smembers(keys.unknown)),
            "awaiting": sorted(self.client.smembers(keys.awaiting)),
            "probe_due": self.client.zrange(keys.probe_due, 0, -1, withscores=True),
            "ids": self.client.zrange(keys.effect_ids, 0, -1),
            "order": self.client.zrange(keys.effects_index, 0, -1),
            "tasks": self.client.hgetall(keys.effect_tasks),
            "events": [event for event in events if event["type"] == "effect"],
        }


async def test_the_gateways_decisions_leave_what_the_scripts_would(
    make_redis_server: Callable[..., RedisServer],
) -> None:
    server = make_redis_server()
    fast, slow = Steps(server, "fast", True), Steps(server, "slow", False)
    answers: dict[bool, list[Any]] = {True: [], False: []}
    try:
        for steps in (fast, slow):
            store, said = steps.store, answers[steps.fast]
            await store.open()  # as a gateway starts: format 3, new effects indexed by feed
            await store.put_task("t", "in", None)
            task = await store.claim("t", ClaimRequest("w", 60_000, 1, principal="alice"))
            assert task.attempt_id is not None
            fence = _fence(task, "alice")
            # A plain effect, committed; then its duplicate (a replay).
            plain = EffectRequest(fence, "n", "plain", "pay", "POST", "/pay", "d" * 64)
            first = await steps.prepare(plain)
            said.append(first)
            said.append(
                await steps.complete(
                    "t", first[1], task.attempt_id, EffectState.COMMITTED, "200", RESPONSE
                )
            )
            said.append(await steps.prepare(plain))
            # Everything a new record may carry: a forward id, an approval digest of its
            # own, the request as forwarded (with / and non-ASCII text).
            rich = EffectRequest(
                fence, "n", "rich", "pay", "POST", "/pay/é", "e" * 64,
                forward_id="fwd-1", approval_digest="a" * 64, request_json=REQUEST,
            )  # fmt: skip
            sent = await steps.prepare(rich)
            said.append(sent)
            # It certainly sent nothing: NOT_APPLIED; forwarded again (the record exists:
            # prepare.lua's own path), then its outcome unknown.
            said.append(
                await steps.complete(
                    "t", sent[1], task.attempt_id, EffectState.NOT_APPLIED, "connect failed", None
                )
            )
            again = await steps.prepare(rich)
            said.append(again)
            said.append(
                await steps.complete(
                    "t", again[1], task.attempt_id, EffectState.UNKNOWN, "read timeout", None
                )
            )
            # A forward whose outcome is refused later (a stale attempt), and one that needs
            # an approval (not decided by the gateway).
            late = await steps.prepare(EffectRequest(fence, "n", "late", "pay", "POST", "/p",
                                                     "f" * 64))  # fmt: skip
            said.append(late)
            said.append(
                await steps.complete(
                    "t", late[1], "another-attempt", EffectState.COMMITTED, "200", None
                )
            )
            said.append(await steps.prepare(
                EffectRequest(fence, "n", "gated", "pay", "POST", "/p", "0" * 64),
                require_approval=True,
            ))  # fmt: skip
            # A forward slower than its deadline: another prepare finds it overdue (UNKNOWN,
            # the record changed since the gateway held it), then its real outcome lands.
            slow_call = EffectRequest(fence, "n", "slow", "pay", "POST", "/p", "1" * 64)
            held = await steps.prepare(slow_call)
            said.append(held)
            store.clock_offset_ms += 31_000
            said.append(await steps.prepare(slow_call))
            said.append(
                await steps.complete(
                    "t", held[1], task.attempt_id, EffectState.COMMITTED, "201", RESPONSE
                )
            )
            answers[steps.fast] = [_named(said, task.attempt_id)]
            # The lean path leaves the creation indexes to the feed: once caught up (as every
            # reader of them does first), nothing differs.
            await store.catch_up_indexes()
            answers[steps.fast].append(_named(steps.left("t"), task.attempt_id))
        assert answers[True] == answers[False]
    finally:
        for steps in (fast, slow):
            steps.client.close()
            await steps.store.close()
