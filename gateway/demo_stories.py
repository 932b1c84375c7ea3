"""The stories ``fencegate demo`` plays (see ``fencegate.gateway.demo``), kept apart so that
the command line registers ``demo`` without importing the gateway's server."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import shutil
import sys
import tempfile
import textwrap
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

import aiohttp
import structlog
from aiohttp import web

from fencegate.client import Client
from fencegate.errors import FencegateError, LeaseLost, ProblemError
from fencegate.gateway.app import create_app
from fencegate.gateway.config import Config
from fencegate.gateway.demo_mcp import (
    PROTOCOL_VERSION,
    McpAgent,
    McpAnswer,
    McpRun,
    McpToolServer,
)
from fencegate.lease import Commit, Lease, ProxyResponse

__all__ = ["run_demo"]

T = TypeVar("T")

#: Short leases, so they run out while you watch.
TTL_MS = 600
#: The gateway gives the shop this long to answer; ``/slow/`` takes longer.
SHOP_TIMEOUT_MS = 400
SLOW_S = 1.0
PAGES = 5
#: The MCP tool server behind ``/mcp/invoices``: ``send_invoice`` takes MCP_SEND_MS, the
#: gateway waits MCP_TIMEOUT_MS for it; the agent whose answer is lost gives up while the
#: server is running the tool (not after a set time: see ``_given_up_once``).
MCP_DOWNSTREAM = "invoices"
MCP_SEND_MS = 500
MCP_TIMEOUT_MS = 2000
#: The chat agent's payment API: the shop behind a ``probe`` downstream that takes keyed
#: calls (``client_idempotency_keys``) and looks a charge up by its effectId.
PAYMENTS = "payments"
#: The longest the shop holds a ``/held/`` call before it goes on by itself.
HELD_S = 5.0


# --- the shop: a small downstream that remembers what it received ---------------------------


@dataclass
class Received:
    seq: int
    at: float
    method: str
    path: str
    key: str
    token: str
    body: Any
    answer: dict[str, Any]


@dataclass
class Shop:
    received: list[Received] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    #: What the shop has booked, by Idempotency-Key: a call is booked once it is done (a slow
    #: one only after its delay), as a real shop's database would have it.
    booked: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Set whenever a call is booked.
    booked_event: asyncio.Event = field(default_factory=asyncio.Event)
    #: ``GET /lookup/{key}`` calls (the gateway's probe), kept apart from ``received``.
    lookups: list[tuple[str, int]] = field(default_factory=list)
    #: A ``/held/`` call is processed (and booked) only once this is set (5 s at most): a
    #: payment still being processed, for as long as the story needs, on any machine.
    release: asyncio.Event = field(default_factory=asyncio.Event)
    runner: web.AppRunner | None = None
    url: str = ""

    async def _handle(self, request: web.Request) -> web.Response:
        if request.path.startswith("/lookup/"):
            return self._look_up(request.path.removeprefix("/lookup/"))
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        seq = len(self.received) + 1
        kind = request.path.strip("/").split("/")[-1] or "call"
        answer = {"id": f"{kind}-{seq}", "received": body}
        self.received.append(
            Received(
                seq,
                time.monotonic(),
                request.method,
                request.path_qs,
                request.headers.get("Idempotency-Key", ""),
                request.headers.get("Fencing-Token", ""),
                body,
                answer,
            )
        )
        self.arrived.set()
        if request.path.startswith("/slow/"):
            await asyncio.sleep(SLOW_S)
        elif request.path.startswith("/held/"):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.release.wait(), HELD_S)
        elif request.path.startswith("/emails"):
            await asyncio.sleep(0.2)
        else:
            await asyncio.sleep(0.01)
        self.booked.setdefault(self.received[seq - 1].key, answer)
        self.booked_event.set()
        return web.json_response(answer, status=201)

    def _look_up(self, key: str) -> web.Response:
        """The shop's own lookup by idempotency key: 200 and the booking, or 404 while there
        is none (not received, or still being processed)."""
        found = self.booked.get(key)
        self.lookups.append((key, 200 if found is not None else 404))
        if found is None:
            return web.json_response({"key": key, "booked": False}, status=404)
        return web.json_response({**found, "booked": True})

    def calls_for(self, key: str) -> list[Received]:
        return [r for r in self.received if r.key == key]

    async def start(self) -> Shop:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{_port(site)}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def _port(site: web.TCPSite) -> int:
    server = site._server
    assert server is not None
    port: int = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    return port


# --- narration ----------------------------------------------------------------------------------


class Narrator:
    """Prints the stories and keeps score: every checked verdict must be the expected one."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.checked = 0
        self.mismatches: list[str] = []

    def line(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def story(self, number: int, title: str, why: str) -> None:
        """``why``: what goes wrong without the gateway, and why its answer is the right one,
        in the demo's own words (it must make sense to someone who read nothing else)."""
        self.line()
        self.line(f"== {number}. {title} ==")
        self.line(textwrap.fill(why, width=94, initial_indent="   ", subsequent_indent="   "))

    def say(self, who: str, text: str) -> None:
        self.line(f"  {who}: {text}")

    def result(self, verdict: str, meaning: str, ok: bool = True, expected: str = "") -> None:
        self.checked += 1
        if ok:
            self.line(f"     -> {verdict}: {meaning}")
        else:
            self.mismatches.append(f"expected {expected}, got {verdict}")
            self.line(f"     -> {verdict}  !! UNEXPECTED: the story needs {expected} here")

    def check(self, ok: bool, meaning: str, failure: str) -> None:
        self.checked += 1
        if ok:
            self.line(f"     -> ok: {meaning}")
        else:
            self.mismatches.append(failure)
            self.line(f"     -> !! UNEXPECTED: {failure}")


def verdict_of(value: object) -> str:
    if isinstance(value, ProxyResponse):
        return "REPLAYED" if value.replayed else f"{value.status} {value.effect_state}"
    if isinstance(value, Commit):
        return value.outcome
    if isinstance(value, Lease):
        return "GRANTED"
    if isinstance(value, McpAnswer):
        if value.error is not None:
            return value.problem or f"JSON-RPC error {value.error.get('code')}"
        return "REPLAYED" if value.replayed else "OK"
    return "OK"


async def step(
    n: Narrator,
    who: str,
    action: str,
    call: Awaitable[T],
    expect: str,
    meaning: str,
) -> T | None:
    """Run one call, print its verdict and check it is ``expect`` (a problem code, GRANTED,
    COMMITTED, REPLAYED, OK, or the start of "201 COMMITTED"...)."""
    n.say(who, action)
    try:
        value = await call
    except ProblemError as exc:
        n.result(exc.code, meaning, exc.code == expect, expect)
        return None
    except LeaseLost:
        n.result("LEASE_LOST", meaning, expect == "LEASE_LOST", expect)
        return None
    verdict = verdict_of(value)
    n.result(verdict, meaning, verdict.startswith(expect), expect)
    return value


def short(key: str) -> str:
    return key[:12] + "..." if len(key) > 12 else key or "(none)"


# --- the stories ---------------------------------------------------------------------------------


async def story_takeover(n: Narrator, client: Client, shop: Shop) -> None:
    n.story(
        1,
        "A worker pauses past its lease; another takes over",
        "A worker that stalls (a GC pause, a slow model call) cannot tell that its lease ran "
        "out, and wakes up still acting as the task's owner. The gateway compares every "
        "renewal, call and commit with the task's current claim, so the stale worker is "
        "refused and only the new owner's work counts.",
    )
    task = "invoice-42"
    await step(
        n, "scheduler", f"creates task {task}", client.put_task(task, "sha256:in-42"), "OK", "READY"
    )
    # A bare lease: a worker frozen mid-task renews nothing and checks nothing itself.
    a = await step(
        n,
        "A",
        f"claims {task} for {TTL_MS} ms",
        client.acquire(task, owner="worker-a", ttl_ms=TTL_MS),
        "GRANTED",
        "generation 1 is A's fencing token",
    )
    if a is None:
        return
    charge = {"amount": 4200, "currency": "eur"}
    await step(
        n,
        "A",
        'charges the customer 42.00 EUR (slot "charge")',
        a.request("shop", "POST", "/charges", slot="charge", json=charge),
        "201",
        "the shop charged; the ledger recorded the answer",
    )
    n.say(
        "A",
        f"freezes for {TTL_MS * 3 // 2} ms (a GC pause, a slow model call): "
        "nothing renews its lease",
    )
    await asyncio.sleep(TTL_MS * 1.5 / 1000)
    await step(
        n,
        "A",
        "wakes up and renews its lease",
        a.renew(),
        "LEASE_EXPIRED",
        "the lease ran out while A was frozen; the store refuses to extend it",
    )
    b = await step(
        n,
        "B",
        f"claims {task}",
        client.acquire(task, owner="worker-b", ttl_ms=5000),
        "GRANTED",
        "generation 2: B owns the task now",
    )
    if b is None:
        return
    await step(
        n, "A", "renews again", a.renew(), "FENCED", "generation 1 is no longer the task's claim"
    )
    await step(
        n,
        "A",
        'goes on and emails the receipt (slot "receipt")',
        a.request("shop", "POST", "/receipts", slot="receipt", json={"to": "ana"}),
        "FENCED",
        "refused before a byte left the gateway",
    )
    await step(
        n,
        "A",
        "commits its result",
        a.commit({"charged": 4200, "by": "A"}),
        "FENCED",
        "the store rejects the stale completion",
    )
    await step(
        n,
        "B",
        "charges the customer (same slot, same payload)",
        b.request("shop", "POST", "/charges", slot="charge", json=charge),
        "REPLAYED",
        "A's charge already happened: B gets its recorded answer, no second charge",
    )
    await step(
        n,
        "B",
        "emails the receipt",
        b.request("shop", "POST", "/receipts", slot="receipt", json={"to": "ana"}),
        "201",
        "forwarded once, under generation 2",
    )
    await step(
        n,
        "B",
        "commits its result",
        b.commit({"charged": 4200, "by": "B"}),
        "COMMITTED",
        "the one canonical commit of invoice-42",
    )
    record = await client.get_task(task)
    commit = record.commit or {}
    n.say("scheduler", f"reads {task}")
    n.check(
        record.state == "COMMITTED" and commit.get("claimGeneration") == 2,
        f"{record.state}, committed by generation {commit.get('claimGeneration')}",
        f"{task} should be COMMITTED by generation 2, is {record.state} {commit}",
    )


async def story_lost_answer(n: Narrator, client: Client, shop: Shop) -> None:
    n.story(
        2,
        "A lost answer: UNKNOWN, PAYLOAD_CONFLICT, EFFECT_UNKNOWN, then an operator",
        "A call times out, so nobody knows whether the refund happened: sending it again "
        "could pay twice, sending another one could pay the wrong amount. The gateway marks "
        "the effect UNKNOWN and refuses both until an operator who checked the shop settles "
        "it; from then on a retry gets the recorded answer.",
    )
    task = "refund-7"
    x, y = {"order": "o-7", "amount": 3000}, {"order": "o-7", "amount": 3500}
    await client.put_task(task, "sha256:in-7")
    n.say("scheduler", f"creates task {task}")
    # Long enough that A's lease outlives its timed-out call, so B has to wait for it.
    ttl_ms = SHOP_TIMEOUT_MS + 600
    a = await step(
        n,
        "A",
        f"claims {task} for {ttl_ms} ms",
        client.acquire(task, owner="worker-a", ttl_ms=ttl_ms),
        "GRANTED",
        "generation 1",
    )
    if a is None:
        return
    n.say("A", f"refunds 30.00 EUR (X) through the gateway; the shop takes {SLOW_S:.0f} s")
    failed = await _attempt(a.request("shop", "POST", "/slow/refunds", slot="refund", json=x))
    if isinstance(failed, ProblemError):
        n.result(
            failed.code,
            f"no answer in {SHOP_TIMEOUT_MS} ms: the refund is {failed.effect_state} "
            "(it may or may not have happened)",
            failed.code == "DOWNSTREAM_TIMEOUT" and failed.effect_state == "UNKNOWN",
            "DOWNSTREAM_TIMEOUT with effect UNKNOWN",
        )
        effect_id = failed.effect_id or ""
    else:
        n.result(verdict_of(failed), "", False, "DOWNSTREAM_TIMEOUT")
        return
    n.say("A", "crashes; nothing renews its lease")
    b = await _take_over(n, client, task)
    if b is None:
        return
    await step(
        n,
        "B",
        "regenerates the refund as 35.00 EUR (Y) for the same slot",
        b.request("shop", "POST", "/slow/refunds", slot="refund", json=y),
        "PAYLOAD_CONFLICT",
        "the slot is bound to X; Y is never sent",
    )
    await step(
        n,
        "B",
        "sends X again",
        b.request("shop", "POST", "/slow/refunds", slot="refund", json=x),
        "EFFECT_UNKNOWN",
        "X may have happened: nobody may blindly send it again",
    )
    unknown = await client.list_effects(state="UNKNOWN", task_id=task)
    n.say("operator", f"lists UNKNOWN effects of {task}")
    n.check(
        [e["effectId"] for e in unknown] == [effect_id],
        f"one: {short(effect_id)} (slot refund, {unknown[0]['method'] if unknown else '?'} "
        f"{unknown[0]['path'] if unknown else '?'})",
        f"expected exactly the refund effect {short(effect_id)}, got {unknown}",
    )
    seen = shop.calls_for(effect_id)
    n.say("operator", f"looks the refund up in the shop by its key {short(effect_id)}")
    n.check(
        len(seen) == 1,
        "the shop did receive X once: the refund happened",
        f"the shop has {len(seen)} calls for the refund",
    )
    if not seen:
        return
    await step(
        n,
        "operator",
        "resolves the effect as COMMITTED, with the shop's answer",
        client.resolve_effect(
            effect_id,
            "COMMITTED",
            "found in the shop: refund-2 happened",
            response={
                "status": 201,
                "headers": {"Content-Type": "application/json"},
                "body": json.dumps(seen[0].answer),
            },
            operator="ops-alice",
        ),
        "OK",
        "the ledger now knows X happened",
    )
    replay = await step(
        n,
        "B",
        "retries X",
        b.request("shop", "POST", "/slow/refunds", slot="refund", json=x),
        "REPLAYED",
        "the gateway answers from the ledger; the shop is not called again",
    )
    if replay is not None:
        n.say("B", f"reads the answer: {replay.text()}")
    await step(
        n,
        "B",
        "commits",
        b.commit({"refunded": 3000}),
        "COMMITTED",
        "one refund, settled and committed",
    )


async def _take_over(n: Narrator, client: Client, task: str) -> Lease | None:
    """B claims ``task`` while A's lease still runs: CLAIMED until it runs out, then GRANTED."""
    n.say("B", f"claims {task}")
    b: Lease | None = None
    refused: list[str] = []
    deadline = time.monotonic() + 5
    while b is None and time.monotonic() < deadline:
        got = await _attempt(client.acquire(task, owner="worker-b", ttl_ms=5000))
        if isinstance(got, Lease):
            b = got
        elif isinstance(got, ProblemError) and got.code == "CLAIMED":
            refused.append(got.code)
            await asyncio.sleep(0.1)
        else:
            break
    n.result(
        "CLAIMED" if refused else "(never refused)",
        "A's lease has not run out yet; B waits",
        bool(refused),
        "CLAIMED",
    )
    if b is None:
        n.result("NOT GRANTED", "", False, "GRANTED")
        return None
    n.result("GRANTED", f"generation {b.claim_generation}, once A's lease ran out")
    return b


async def story_duplicates(n: Narrator, client: Client, shop: Shop) -> None:
    n.story(
        3,
        "Duplicates are replayed, not repeated",
        "Retries and duplicate sends (a timeout, a retry storm, a restart) would each reach "
        "a downstream that does not deduplicate. The gateway forwards the effect once and "
        "answers every duplicate with the answer it recorded, so the customer gets one email.",
    )
    task = "email-9"
    await client.put_task(task, "sha256:in-9")
    n.say("scheduler", f"creates task {task}")
    email = {"to": "bo@example.com", "template": "welcome"}
    async with client.claim(task, owner="worker-c", ttl_ms=TTL_MS) as lease:
        n.say("C", f"claims {task} (guarded: renewed every ~{lease.renew_interval * 1000:.0f} ms)")
        shop.arrived.clear()
        before = len(shop.received)

        def send(wait: float = 0.0) -> Coroutine[Any, Any, ProxyResponse]:
            return lease.request(
                "shop", "POST", "/emails", slot="welcome", json=email, wait_in_flight=wait
            )

        first = _background(send())
        while len(shop.received) == before:
            await shop.arrived.wait()
            shop.arrived.clear()
        n.say("C", "sends the welcome email; the shop takes 200 ms to answer")
        await step(
            n,
            "C",
            "retries while the first is still in flight (a timeout, a retry storm)",
            send(),
            "EFFECT_IN_FLIGHT",
            "the same effect is being forwarded right now; try again shortly",
        )
        await step(
            n,
            "C",
            "retries, waiting out EFFECT_IN_FLIGHT with backoff",
            send(5.0),
            "REPLAYED",
            "once the first answer is in, duplicates get it",
        )
        original = await first
        n.say("C", "the first send returns")
        n.result(
            verdict_of(original),
            "forwarded once (Fence-Replayed: false)",
            not original.replayed and original.status == 201,
            "201 COMMITTED",
        )
        again = await asyncio.gather(send(5.0), send(5.0), send(5.0))
        n.say("C", "sends it three more times at once")
        n.check(
            all(r.replayed and r.body == original.body for r in again),
            "3 x REPLAYED, each the very same answer",
            f"expected three replays, got {[verdict_of(r) for r in again]}",
        )
        await step(
            n,
            "C",
            "commits",
            lease.commit({"sent": original.json()["id"]}),
            "COMMITTED",
            "one email, whatever the retries",
        )
    key = original.effect_id or ""
    n.say("shop", f"calls with key {short(key)}")
    n.check(len(shop.calls_for(key)) == 1, "exactly 1", f"{len(shop.calls_for(key))} calls")


@dataclass
class PageWorker:
    name: str
    task: str
    started: dict[int, float] = field(default_factory=dict)
    lost: LeaseLost | None = None
    lost_at: float = 0.0
    renew_interval: float = 0.0
    generation: int = 0


async def _write_pages(client: Client, worker: PageWorker, epoch: int) -> None:
    try:
        async with client.claim(
            worker.task, owner=worker.name, ttl_ms=TTL_MS, scheduler_epoch=epoch
        ) as lease:
            worker.renew_interval = lease.renew_interval
            worker.generation = lease.claim_generation
            for page in range(PAGES):
                worker.started[page] = time.monotonic()
                await lease.request(
                    "shop",
                    "POST",
                    f"/reports/{worker.task}/pages",
                    slot=f"page-{page}",
                    json={"page": page},
                )
                await asyncio.sleep(0.1)
            await asyncio.sleep(10)  # "thinking" about the summary, renewing meanwhile
            await lease.commit({"pages": PAGES})
    except LeaseLost as exc:
        worker.lost, worker.lost_at = exc, time.monotonic()


async def story_epoch_bump(n: Narrator, client: Client, shop: Shop) -> None:
    n.story(
        4,
        "An epoch bump fences every old claim at once",
        "A worker pool must be retired now (a bad deploy, a rollback), but its leases would "
        "be honoured until they run out. Once claims are paused and the scheduler epoch "
        "bumped, the gateway refuses every claim of the old epoch at its next check, so the "
        "old workers stop within one renewal and their successors need not wait.",
    )
    epoch = (await client.get_epoch()).scheduler_epoch
    tasks = [f"report-{i}" for i in (1, 2, 3)]
    for task in tasks:
        await client.put_task(task, f"sha256:in-{task}")
    n.say("scheduler", f"creates {', '.join(tasks)}; the scheduler epoch is {epoch}")
    old = [PageWorker(f"w{i}", task) for i, task in enumerate(tasks, 1)]
    running = [_background(_write_pages(client, w, epoch)) for w in old]
    await asyncio.sleep(0.35)
    n.say(
        "w1..w3",
        f"claim them (guarded leases) and write {PAGES} pages each, one per 100 ms",
    )
    await step(
        n, "operator", "pauses claims", client.pause_claims(), "OK", "no new claim may start"
    )
    await client.put_task("report-4", "sha256:in-report-4")
    await step(
        n,
        "x",
        "claims report-4",
        client.acquire("report-4", owner="x", ttl_ms=TTL_MS),
        "CLAIMS_PAUSED",
        "nobody gets a new claim while the operator works",
    )
    bumped = await step(
        n,
        "operator",
        "bumps the scheduler epoch",
        client.bump_epoch(),
        "OK",
        f"epoch {epoch + 1}: every claim of epoch {epoch} is fenced",
    )
    bumped_at = time.monotonic()
    await asyncio.wait(running, timeout=5)
    n.say("w1..w3", "keep working")
    for w in old:
        cause = w.lost.code if w.lost is not None else None
        after = w.lost_at - bumped_at
        how = "its next page" if w.lost and "renew" not in w.lost.reason else "its renewal"
        n.result(
            f"LeaseLost ({cause})" if w.lost else "still running",
            f"{w.name}: {how} refused {after * 1000:.0f} ms after the bump "
            f"(renews every {w.renew_interval * 1000:.0f} ms)",
            w.lost is not None and cause == "STALE_EPOCH" and after <= w.renew_interval + 0.5,
            "LeaseLost (STALE_EPOCH) within one renewal period",
        )
    for worker_task in running:
        worker_task.cancel()
    # A call started before the bump may still land (the gateway let it through before the
    # bump); one started after it must not.
    late = [(w, page) for w in old for page, at in w.started.items() if at > bumped_at]
    leaked = [
        r
        for w, page in late
        for r in shop.received
        if r.path == f"/reports/{w.task}/pages"
        and r.token == f"{epoch}.{w.generation}"
        and r.body == {"page": page}
    ]
    n.say("shop", f"calls the old workers tried after the bump ({len(late)})")
    n.check(not leaked, "none reached the shop", f"{len(leaked)} reached the shop")
    await step(n, "operator", "resumes claims", client.resume_claims(), "OK", "claims go again")
    new_epoch = bumped.scheduler_epoch if bumped is not None else epoch + 1
    for i, task in enumerate(tasks, 1):
        lease = await step(
            n,
            f"v{i}",
            f"claims {task} at once (w{i}'s lease has not run out)",
            client.acquire(task, owner=f"v{i}", ttl_ms=5000, scheduler_epoch=new_epoch),
            "GRANTED",
            f"epoch {new_epoch}: the old claim counts for nothing",
        )
        if lease is None:
            continue
        answers = [
            await lease.request(
                "shop", "POST", f"/reports/{task}/pages", slot=f"page-{page}", json={"page": page}
            )
            for page in range(PAGES)
        ]
        replayed = sum(a.replayed for a in answers)
        n.say(f"v{i}", f"writes the {PAGES} pages")
        n.check(
            all(a.status == 201 for a in answers),
            f"{replayed} replayed (w{i} had written them), {PAGES - replayed} forwarded",
            f"unexpected answers {[verdict_of(a) for a in answers]}",
        )
        await step(
            n, f"v{i}", "commits", lease.commit({"pages": PAGES}), "COMMITTED", f"{task} done once"
        )


async def mcp_step(
    n: Narrator,
    who: str,
    action: str,
    call: Awaitable[McpAnswer],
    expect: str,
    meaning: str | Callable[[McpAnswer], str],
) -> McpAnswer:
    """``step`` for an MCP request: the verdict is in the JSON-RPC answer (a refusal is an
    error answer, ``error.data.code`` its problem code), ``meaning`` may read the answer."""
    n.say(who, action)
    answer = await call
    verdict = verdict_of(answer)
    if verdict == expect:
        n.result(verdict, meaning(answer) if callable(meaning) else meaning)
    else:
        n.result(f"{verdict} {json.dumps(answer.message)[:200]}", "", False, expect)
    return answer


async def _call_waiting_out(agent: McpAgent, tool: str, arguments: dict[str, Any]) -> McpAnswer:
    """A ``tools/call`` retried while the gateway answers EFFECT_IN_FLIGHT (the first call of
    the same effect is still being forwarded), as ``wait_in_flight`` does for ``/proxy``."""
    deadline = time.monotonic() + 5
    while True:
        answer = await agent.call_tool(tool, arguments)
        if answer.problem != "EFFECT_IN_FLIGHT" or time.monotonic() > deadline:
            return answer
        data = (answer.error or {}).get("data") or {}
        await asyncio.sleep(min(max(int(data.get("retryAfterMs") or 50), 10), 500) / 1000)


async def _given_up_once(started: asyncio.Event, call: Coroutine[Any, Any, T]) -> T | None:
    """The call's value if it is answered first; None once ``started`` is set first (the
    server runs the tool), and the call is cancelled: a client that gives up closes its
    connection.

    Not after a set time: on a loaded machine a client that gave up after 250 ms had at
    times given up before the gateway read its call (or before the prepare, past its
    lease), so nothing was recorded, the retry was the first call and answered as such,
    not REPLAYED. The server runs a recorded call only after its prepare, so giving up then
    loses the answer and nothing else, which is the failure the story shows."""
    answer = asyncio.create_task(call)
    # Retrieved here too, for when the demo itself is cancelled (Ctrl-C) meanwhile.
    answer.add_done_callback(lambda done: done.cancelled() or done.exception())
    running = asyncio.create_task(started.wait())
    try:
        await asyncio.wait((answer, running), return_when=asyncio.FIRST_COMPLETED)
    finally:
        running.cancel()
        answer.cancel()  # nothing, once answered
        await asyncio.wait((answer,))  # its connection is closed before the story goes on
    return None if answer.cancelled() else answer.result()


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


async def story_mcp(
    n: Narrator, client: Client, shop: Shop, *, tools: McpToolServer, gateway: str
) -> None:
    n.story(
        5,
        "An MCP tool server behind the gateway: tools/call is an effect",
        "An agent's tools/call whose answer got lost is sent again by whoever retries the task, "
        "and an agent that stalled wakes up still calling tools as the task's owner: a plain "
        "MCP server runs the tool each time. The gateway records every call of a tool that is "
        "not read-only, forwards it once with its effectId in params._meta, answers a retry "
        "with the recorded result and refuses the stale agent before the server sees a byte.",
    )
    task = "invoice-77"
    endpoint = f"{gateway}/mcp/{MCP_DOWNSTREAM}"
    invoice = {"customer": "ana", "amount": 4200}
    await client.put_task(task, "sha256:in-77")
    n.say("scheduler", f"creates task {task}")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        a = McpAgent(http, endpoint)
        await mcp_step(
            n,
            "A",
            f"opens an MCP session through /mcp/{MCP_DOWNSTREAM}: initialize, then "
            "notifications/initialized; no lease yet",
            a.initialize(),
            "OK",
            lambda hello: (
                f"{hello.result.get('serverInfo', {}).get('name')} speaks "
                f"{a.protocol}, session {short(a.session or '')}; notifications/initialized: "
                f"{a.initialized}"
            ),
        )
        n.check(
            a.protocol == PROTOCOL_VERSION and a.session is not None and a.initialized == 202,
            f"A sends MCP-Protocol-Version: {a.protocol} and Mcp-Session-Id from now on",
            f"expected protocol {PROTOCOL_VERSION}, a session and 202, got {a.protocol}, "
            f"{a.session}, {a.initialized}",
        )
        listed = await mcp_step(
            n,
            "A",
            "lists the tools (tools/list, no lease either)",
            a.request("tools/list"),
            "OK",
            lambda answer: ", ".join(
                f"{t.get('name')} {_compact(t.get('annotations') or {})}"
                for t in answer.result.get("tools", [])
            ),
        )
        hints = {t.get("name"): t.get("annotations") for t in listed.result.get("tools", [])}
        n.check(
            hints == {"send_invoice": None, "get_invoice": {"readOnlyHint": True}},
            "send_invoice is an effect (no annotations), get_invoice a read (readOnlyHint)",
            f"unexpected tools {hints}",
        )
        lease = await step(
            n,
            "A",
            f"claims {task} for {TTL_MS} ms; its MCP requests now carry lease.mcp_headers()",
            client.acquire(task, owner="worker-a", ttl_ms=TTL_MS),
            "GRANTED",
            "generation 1",
        )
        if lease is None:
            return
        a.lease = lease
        n.say(
            "A",
            f"calls send_invoice(ana, 42.00 EUR); the server takes {MCP_SEND_MS} ms, "
            "and A's client gives up while it runs",
        )
        tools.started.clear()
        lost = await _given_up_once(tools.started, a.call_tool("send_invoice", invoice))
        n.result(
            "NO ANSWER" if lost is None else verdict_of(lost),
            "A gave up and closed its connection; the gateway still waits for the server, "
            "and records its answer",
            lost is None,
            "NO ANSWER (A's client gives up)",
        )
        if lost is not None:  # answered (refused): nothing of A's to replay to B
            return
        lost_id = a.last_id
        n.say("A", "crashes; nothing renews its lease")
        b_lease = await _take_over(n, client, task)
        if b_lease is None:
            return
        runs_before = len(tools.runs)
        await mcp_step(
            n,
            "A",
            "wakes up, still thinking it owns the task, and sends a corrected invoice (45.00 EUR)",
            a.call_tool("send_invoice", {"customer": "ana", "amount": 4500}),
            "FENCED",
            lambda refused: (
                f"JSON-RPC error {(refused.error or {}).get('code')} (HTTP "
                f"{refused.status}), error.data.code FENCED: generation 1 is not the task's claim"
            ),
        )
        n.say("server", "tool runs since")
        n.check(
            len(tools.runs) == runs_before,
            "none: the stale call was refused before a byte left the gateway",
            f"{len(tools.runs) - runs_before} reached the server",
        )
        b = McpAgent(http, endpoint)
        await mcp_step(n, "B", "opens its own MCP session", b.initialize(), "OK", "no lease needed")
        b.lease = b_lease
        replay = await mcp_step(
            n,
            "B",
            "redoes the task: send_invoice(ana, 42.00 EUR), the same arguments, so the same "
            "derived slot",
            _call_waiting_out(b, "send_invoice", invoice),
            "REPLAYED",
            "A's call ran: B gets its recorded result; the server is not called again",
        )
        n.say(
            "B",
            f"reads it: id {replay.id} (A's call was id {lost_id}), "
            f"result._meta {_compact(replay.result.get('_meta'))}, {_compact(replay.content)}",
        )
        n.check(
            replay.id == b.last_id and replay.content == tools.invoices.get("inv-1"),
            "the answer A never got, under B's own JSON-RPC id",
            f"expected invoice inv-1 under id {b.last_id}, got {replay.message}",
        )
        number = (replay.content or {}).get("invoice", "inv-1")
        await mcp_step(
            n,
            "B",
            f"checks it: get_invoice({number}), readOnlyHint",
            b.call_tool("get_invoice", {"invoice": number}),
            "OK",
            lambda looked: (
                f"fence-checked and relayed, no ledger entry: {_compact(looked.content)}"
            ),
        )
        await step(
            n,
            "B",
            "commits",
            b_lease.commit({"invoice": number}),
            "COMMITTED",
            "one invoice, sent once",
        )
    effects = await client.list_effects(task_id=task)
    n.say("operator", f"lists the ledger's effects of {task}")
    only = effects[0] if len(effects) == 1 else {}
    n.check(
        only.get("path") == "/tools/call/send_invoice" and only.get("state") == "COMMITTED",
        f"one: {short(only.get('effectId', ''))} (POST /tools/call/send_invoice, "
        "COMMITTED); get_invoice has none",
        f"expected one COMMITTED send_invoice effect, got "
        f"{[(e['path'], e['state']) for e in effects]}",
    )


#: Calls a story started in the background and may not have awaited (it stopped early, or
#: Ctrl-C): ``run_demo`` cancels them before it cleans up.
_BACKGROUND: set[asyncio.Task[Any]] = set()


def _background(call: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    task = asyncio.create_task(call)
    _BACKGROUND.add(task)
    # Retrieved here, so one that failed unawaited (the gateway stopped under it) is not
    # reported as "never retrieved" on the user's terminal.
    task.add_done_callback(lambda done: done.cancelled() or done.exception())
    task.add_done_callback(_BACKGROUND.discard)
    return task


async def _cancel_background() -> None:
    pending = [task for task in _BACKGROUND if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=5)


async def _attempt(call: Awaitable[T]) -> T | FencegateError:
    try:
        return await call
    except FencegateError as exc:
        return exc


async def story_pipeline(n: Narrator, client: Client, shop: Shop) -> None:
    n.story(
        6,
        "A two-step pipeline: the second step waits for the first's commit",
        "A queue of work where step two needs step one's result must not hand step two out "
        "early, nor build it on a result that a stale attempt produced. The gateway keeps step "
        "two WAITING until step one has its canonical commit, and hands it out from the queue "
        "with that commit's id, so every result says what it was built on.",
    )
    queue, first, second = "reports", "report-7/extract", "report-7/load"
    epoch = (await client.get_epoch()).scheduler_epoch
    await client.put_task(first, "in-1", queue=queue)
    await client.put_task(second, "in-1", queue=queue, depends_on=[first])
    n.say("scheduler", f"puts {first} and {second} (dependsOn {first}) in the queue {queue!r}")
    await step(
        n, "B", f"claims {second} by id", client.acquire(second, owner="B", ttl_ms=TTL_MS * 10,
                                                          scheduler_epoch=epoch),
        "DEPENDENCIES_PENDING", f"{second} is WAITING for {first}",
    )  # fmt: skip
    n.say("A", f"claims the next task of {queue!r}")
    lease_a = await client.claim_next(queue, owner="A", ttl_ms=TTL_MS * 10, scheduler_epoch=epoch)
    n.check(
        lease_a is not None and lease_a.task_id == first,
        f"A got {first}, the only claimable task",
        f"A should have got {first}, got {lease_a!r}",
    )
    if lease_a is None:
        return
    n.say("B", f"claims the next task of {queue!r}")
    none = await client.claim_next(queue, owner="B", ttl_ms=TTL_MS * 10, scheduler_epoch=epoch)
    n.check(none is None, "none: 204, step two is not handed out before step one commits",
            f"B should have got nothing, got {none!r}")  # fmt: skip
    ready = f"the canonical commit of {first}; {second} is READY in the same step"
    done = await step(n, "A", f"commits {first}", lease_a.commit({"rows": 120}), "COMMITTED", ready)
    lease_b = await client.claim_next(queue, owner="B", ttl_ms=TTL_MS * 10, scheduler_epoch=epoch)
    n.say("B", f"claims the next task of {queue!r} again")
    built_on = lease_b.dependencies if lease_b is not None else []
    n.check(
        lease_b is not None
        and done is not None
        and lease_b.task_id == second
        and [d["commitId"] for d in built_on] == [done.commit_id],
        f"B got {second}, built on {first}'s commit {short(done.commit_id if done else '')}",
        f"B should have got {second} with {first}'s commit, got {lease_b!r} {built_on}",
    )
    if lease_b is not None:
        await step(n, "B", f"commits {second}", lease_b.commit({"loaded": 120}), "COMMITTED",
                   "the pipeline is done, each step committed once")  # fmt: skip


async def story_chat_agent(n: Narrator, client: Client, shop: Shop) -> None:
    n.story(
        7,
        "A chat agent with no task queue pays once, despite a lost answer and a retry",
        "A chat agent that calls a payment API has no task and no lease, only a conversation, "
        "and when the answer is lost it (or its user) simply asks again, which would pay twice. "
        "The gateway records the call under the agent's own Idempotency-Key, refuses the retry "
        "while nobody knows whether the charge happened, and once the shop's lookup shows it "
        "did, answers every retry with that charge.",
    )
    key = "chat-81:pay-order-17"
    order = {"order": "o-17", "amount": 1999, "currency": "eur"}
    n.say(
        "agent",
        f"pays order o-17 (19.99 EUR) with Idempotency-Key {key!r}; the shop is still "
        f"processing it after the {SHOP_TIMEOUT_MS} ms the gateway gives it",
    )
    shop.release.clear()
    failed = await _attempt(
        client.request(PAYMENTS, "POST", "/held/charges", idempotency_key=key, json=order)
    )
    if not isinstance(failed, ProblemError):
        n.result(verdict_of(failed), "", False, "DOWNSTREAM_TIMEOUT")
        return
    n.result(
        failed.code,
        f"the answer is lost: the charge is {failed.effect_state} (it may or may not have "
        "happened)",
        failed.code == "DOWNSTREAM_TIMEOUT" and failed.effect_state == "UNKNOWN",
        "DOWNSTREAM_TIMEOUT with effect UNKNOWN",
    )
    effect_id = failed.effect_id or ""
    await step(
        n,
        "agent",
        "the user says 'pay again?': the agent retries at once, same key, same order",
        client.request(PAYMENTS, "POST", "/held/charges", idempotency_key=key, json=order),
        "EFFECT_UNKNOWN",
        "the shop's lookup does not show the charge yet, and it may still land: nothing is "
        "sent again",
    )
    n.say("shop", "finishes processing the charge and books it")
    shop.release.set()
    async with asyncio.timeout(5):
        while effect_id not in shop.booked:
            shop.booked_event.clear()
            await shop.booked_event.wait()
    n.say("agent", "retries again, as Retry-After says")
    replay = await _retry_while_unknown(
        lambda: client.request(PAYMENTS, "POST", "/held/charges", idempotency_key=key, json=order)
    )
    if isinstance(replay, ProblemError) or not replay.replayed:
        n.result(verdict_of(replay), "", False, "REPLAYED")
        return
    found = [status for looked, status in shop.lookups if looked == effect_id]
    n.result(
        "REPLAYED",
        f"the gateway's probe found the charge in the shop ({len(found)} lookups): the effect "
        "is COMMITTED and the retry gets the charge, not a second one",
    )
    n.check(
        replay.headers.get("Idempotent-Replayed") == "true",
        f"Idempotent-Replayed: true; the charge: {replay.text()}",
        f"a replay should say Idempotent-Replayed: true, got {dict(replay.headers)}",
    )
    await step(
        n,
        "agent",
        "a bug sends the same key with another amount (24.99 EUR)",
        client.request(
            PAYMENTS, "POST", "/held/charges", idempotency_key=key, json={**order, "amount": 2499}
        ),
        "PAYLOAD_CONFLICT",
        "the key is bound to the first order; the other one is never sent",
    )
    record = await client.get_effect(effect_id)
    n.say("operator", f"reads the effect {short(effect_id)}")
    n.check(
        record.get("kind") == "keyed"
        and record.get("idempotencyKey") == key
        and record.get("taskId") is None
        and record.get("state") == "COMMITTED",
        f"{record.get('state')}, kind {record.get('kind')}, principal "
        f"{record.get('principal')}, key {record.get('idempotencyKey')}: no task, no lease",
        f"expected a COMMITTED keyed effect for {key!r}, got {record}",
    )
    charges = shop.calls_for(effect_id)
    n.say("shop", f"charges received with key {short(effect_id)}")
    n.check(len(charges) == 1, "exactly 1: the customer paid once", f"{len(charges)} charges")


async def _retry_while_unknown(
    send: Callable[[], Awaitable[ProxyResponse]],
) -> ProxyResponse | ProblemError:
    """Send until the answer is not ``EFFECT_UNKNOWN``, waiting its ``Retry-After`` (when the
    gateway will ask the downstream again), for up to 5 s."""
    deadline = time.monotonic() + 5
    while True:
        got = await _attempt(send())
        if isinstance(got, ProxyResponse):
            return got
        if not isinstance(got, ProblemError):
            raise got
        if got.code != "EFFECT_UNKNOWN" or time.monotonic() > deadline:
            return got
        after = got.headers.get("Retry-After", "")
        await asyncio.sleep(min(float(after) if after.isdigit() else 0.1, 1.0) or 0.1)


async def summary(n: Narrator, client: Client, shop: Shop) -> None:
    n.line()
    n.line("== What the shop actually received ==")
    per_key: dict[str, list[Received]] = {}
    for r in shop.received:
        per_key.setdefault(r.key, []).append(r)
    n.line(f"  {'calls':>5}  {'Idempotency-Key':<15}  {'task/slot or who/key':<32}  request")
    for key, calls in per_key.items():
        where = "?"
        with contextlib.suppress(FencegateError):
            record = await client.get_effect(key)
            if record.get("kind") == "keyed":  # a client's: its principal and its own key
                where = f"{record['principal']}/{record['idempotencyKey']}"
            else:
                where = f"{record['taskId']}/{record['slot']}"
        first = calls[0]
        body = json.dumps(first.body, separators=(",", ":"))
        body = body if len(body) <= 40 else body[:37] + "..."
        n.line(
            f"  {len(calls):>5}  {short(key):<15}  {where:<32}  {first.method} {first.path} {body}"
        )
    expected_keys = 2 + 1 + 1 + 3 * PAGES + 1
    n.check(
        len(per_key) == expected_keys and all(len(c) == 1 for c in per_key.values()),
        f"{len(per_key)} effects, {len(shop.received)} calls: every effect reached the shop "
        "exactly once",
        f"expected {expected_keys} effects of one call each, got "
        f"{ {short(k): len(c) for k, c in per_key.items()} }",
    )


async def summary_mcp(n: Narrator, client: Client, shop: Shop, *, tools: McpToolServer) -> None:
    n.line()
    n.line("== What the MCP server actually ran ==")
    n.line(f"  {'runs':>5}  {'dev.fencegate/effectId':<22}  {'task/slot':<30}  tool call")
    rows: dict[object, list[McpRun]] = {}  # per effectId; each read a row of its own
    for run in tools.runs:
        rows.setdefault(run.effect_id or object(), []).append(run)
    for runs in rows.values():
        first = runs[0]
        key, where = "(none)", "(not in the ledger)"
        if first.effect_id is not None:
            key, where = short(first.effect_id), "?"
            with contextlib.suppress(FencegateError):
                record = await client.get_effect(first.effect_id)
                where = f"{record['taskId']}/{short(record['slot'])}"
        n.line(
            f"  {len(runs):>5}  {key:<22}  {where:<30}  {first.tool} {_compact(first.arguments)}"
        )
    seen = Counter(method for method, _ in tools.received)
    own = sum(
        1
        for method, request_id in tools.received
        if method == "tools/list" and str(request_id).startswith("fencegate-")
    )
    n.line(
        f"  It also answered {seen['initialize']} initialize, "
        f"{seen['notifications/initialized']} notifications/initialized and "
        f"{seen['tools/list']} tools/list"
    )
    n.line(f"  ({own} of those the gateway's own, to read the tools' annotations).")
    effects = [runs for runs in rows.values() if runs[0].effect_id is not None]
    sends = tools.runs_of("send_invoice")
    n.check(
        len(effects) == 1 and len(effects[0]) == 1 and len(sends) == 1,
        f"{len(effects)} effect, {len(sends)} send_invoice run: every effect reached the MCP "
        "server exactly once; the stale call never did",
        "expected one send_invoice run under one effectId, got "
        f"{[(r.tool, r.effect_id, r.arguments) for r in tools.runs]}",
    )


# --- running it -----------------------------------------------------------------------------

#: Store URL schemes whose keys the demo can find (by its key prefix) and delete.
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
#: Files SQLite may create next to a database.
_SQLITE_SIDECARS = ("", "-wal", "-shm", "-journal")


@dataclass
class DemoStore:
    """Where the demo keeps its state, and how it removes exactly that afterwards: a demo run
    against a shared Redis must leave nothing behind, and must touch nothing it did not write
    (hence a fresh key prefix per run, and a SQLite file only if it did not exist)."""

    url: str
    #: How the narration names it (no credentials).
    label: str
    #: Redis: every key the gateway writes starts with ``<key_prefix>:``.
    key_prefix: str
    workdir: Path
    #: The database file a ``--store sqlite:///FILE`` names (the default one lives in
    #: ``workdir``).
    sqlite_file: Path | None = None

    @classmethod
    def choose(cls, store: str | None, workdir: Path) -> DemoStore:
        prefix = f"demo{uuid.uuid4().hex[:8]}"
        if store is None:
            return cls(
                f"sqlite:///{workdir / 'fencegate.db'}",
                f"the embedded SQLite store in {workdir}",
                prefix,
                workdir,
            )
        named = Path(store[len("sqlite:///") :]) if store.startswith("sqlite:///") else None
        return cls(store, store.split("@")[-1], prefix, workdir, named)

    def describe(self, keep: bool) -> str:
        """The narration's store line: which store, and what of it the demo will delete."""
        fate = "kept: --keep" if keep else "deleted at the end"
        if self.is_redis:
            return f'Store: {self.label}, every key under the prefix "{self.key_prefix}:" ({fate}).'
        return f"Store: {self.label} ({fate})."

    @property
    def is_redis(self) -> bool:
        return _is_redis(self.url)

    def refusal(self) -> str | None:
        """Why the demo will not play on this store: an existing SQLite file holds someone's
        tasks (or an earlier demo's, which would make the stories fail), and deleting it at
        the end would delete them."""
        path = self.sqlite_file
        if path is not None and path.exists():
            return (
                f"{path} already exists: the demo needs a store of its own, which it deletes "
                "at the end. Name a file that does not exist, or leave out --store."
            )
        return None

    async def remove(self) -> str:
        """Delete what the demo wrote; says what it removed. The temporary directory is
        removed by the caller."""
        if self.is_redis:
            deleted = await _delete_keys(self.url, self.key_prefix)
            return f'deleted the {deleted} keys under "{self.key_prefix}:" from {self.label}'
        path = self.sqlite_file
        if path is not None:
            for suffix in _SQLITE_SIDECARS:
                path.with_name(path.name + suffix).unlink(missing_ok=True)
            return f"deleted {path}"
        if self.url.startswith("sqlite:///"):
            return f"deleted {self.workdir}"
        return f"left its data in {self.label}: the demo can only clean up SQLite and Redis"

    def kept(self) -> str:
        if self.is_redis:
            pattern = f"{self.key_prefix}:*"
            return (
                f'Kept the keys under "{self.key_prefix}:" in {self.label}; delete them with '
                f"redis-cli -u URL --scan --pattern '{pattern}' | xargs redis-cli -u URL del"
            )
        path = self.sqlite_file
        return f"Kept {path}." if path is not None else ""


def _is_redis(url: str) -> bool:
    return url.lower().startswith(_REDIS_SCHEMES)


async def _delete_keys(url: str, prefix: str) -> int:
    """SCAN and DEL every ``<prefix>:*`` key, in batches (never KEYS: it blocks a shared
    Redis). Bounded: an unreachable Redis must not hang the demo's exit."""
    from redis import asyncio as aioredis  # only when the demo ran on Redis

    client = aioredis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    deleted = 0
    try:
        async with asyncio.timeout(30):
            batch: list[bytes] = []
            async for key in client.scan_iter(match=f"{prefix}:*", count=500):
                batch.append(key)
                if len(batch) >= 500:
                    deleted += await client.delete(*batch)
                    batch = []
            if batch:
                deleted += await client.delete(*batch)
    finally:
        await client.aclose()
    return deleted


@contextlib.asynccontextmanager
async def _gateway(store: DemoStore, shop_url: str, mcp_url: str) -> AsyncIterator[str]:
    config = Config.model_validate(
        {
            "store": {"url": store.url, "redis_key_prefix": store.key_prefix},
            # A forward may start up to 900 ms after its prepare was sent (the default is half
            # the margin): a demo on a loaded machine must not refuse its own calls.
            "proxy": {"prepared_margin_ms": 1000, "forward_start_limit_ms": 900},
            "downstreams": [
                {"name": "shop", "url": shop_url, "timeout_ms": SHOP_TIMEOUT_MS},
                {
                    "name": PAYMENTS,
                    "url": shop_url,
                    "timeout_ms": SHOP_TIMEOUT_MS,
                    # A client with no lease may call it, with an Idempotency-Key only.
                    "client_idempotency_keys": "required",
                    # The shop books a charge when it is done: its lookup settles an UNKNOWN
                    # charge (found), soon after it lands.
                    "adapter": "probe",
                    "probe": {
                        "path": "/lookup/{effectId}",
                        "interval_ms": 100,
                        "max_interval_ms": 200,
                    },
                },
                {
                    "name": MCP_DOWNSTREAM,
                    "url": mcp_url,
                    "adapter": "mcp",
                    "timeout_ms": MCP_TIMEOUT_MS,
                    # The demo's own tool server: its annotations are believed (an untrusted
                    # server's would not be, and get_invoice would be a recorded effect).
                    "trust_annotations": True,
                },
            ],
        }
    )
    runner = web.AppRunner(create_app(config), access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{_port(site)}"
    finally:
        await runner.cleanup()


def _log_to(path: Path) -> IO[str]:
    """The gateway's decision log goes to a file, so the narration stays readable."""
    log_file = path.open("a", encoding="utf-8")
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.WriteLoggerFactory(file=log_file),
        cache_logger_on_first_use=False,
    )
    return log_file


async def run_demo(store: str | None = None, keep: bool = False, out: IO[str] | None = None) -> int:
    """Play every story; 0 if every verdict was the expected one, 1 if not, 2 if it would not
    start. Whatever happens (a failure, Ctrl-C), what it wrote is removed unless ``keep``."""
    n = Narrator(out or sys.stdout)
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="fencegate-demo-"))
    where = DemoStore.choose(store, workdir)
    refusal = where.refusal()
    if refusal is not None:
        shutil.rmtree(workdir, ignore_errors=True)
        n.line(f"fencegate demo: {refusal}")
        return 2
    log_file = _log_to(workdir / "gateway.log")
    shop = await Shop().start()
    tools = McpToolServer(send_delay_s=MCP_SEND_MS / 1000)
    try:
        await tools.start()
        # Bounded as a whole, start and shutdown included: a smoke test must not hang.
        async with (
            asyncio.timeout(45),
            _gateway(where, shop.url, tools.url) as url,
            Client(url, timeout=10) as client,
        ):
            n.line(f"fencegate demo: a real gateway on {url},")
            n.line(f'in front of a small "shop" API on {shop.url} that records every call,')
            n.line(f"and a small MCP tool server on {tools.url} that records every tool it runs.")
            n.line(where.describe(keep))
            n.line(
                f"Leases last {TTL_MS} ms, so they run out while you watch; the shop gets "
                f"{SHOP_TIMEOUT_MS} ms to answer."
            )
            stories: tuple[Callable[[Narrator, Client, Shop], Awaitable[None]], ...] = (
                story_takeover,
                story_lost_answer,
                story_duplicates,
                story_epoch_bump,
                functools.partial(story_mcp, tools=tools, gateway=url),
                story_pipeline,
                story_chat_agent,
                summary,
                functools.partial(summary_mcp, tools=tools),
            )
            try:
                for story in stories:
                    try:
                        await story(n, client, shop)
                    # The SDK's refusals, and the MCP story's own client failing (no answer,
                    # not JSON): the story stops, the next ones still play.
                    except (FencegateError, aiohttp.ClientError, ValueError) as exc:
                        n.check(False, "", f"the story stopped on {type(exc).__name__}: {exc}")
            finally:  # before the client closes: a call left running would open another
                await _cancel_background()
    except Exception as exc:  # the demo is a smoke test: say what broke, exit non-zero
        n.check(False, "", f"the demo broke: {type(exc).__name__}: {exc}")
    finally:
        # Also on Ctrl-C (asyncio.run cancels this task first): the gateway has stopped, so
        # nothing writes to the store any more.
        await shop.stop()
        await tools.stop()
        log_file.close()
        await _clean_up(n, where, keep)
    n.line()
    took = time.monotonic() - started
    if n.mismatches:
        n.line(
            f"FAILED: {len(n.mismatches)} of {n.checked} verdicts were not the expected ones "
            f"({took:.1f} s):"
        )
        for problem in n.mismatches:
            n.line(f"  - {problem}")
        return 1
    n.line(f"All {n.checked} verdicts as expected ({took:.1f} s). Every effect happened once.")
    return 0


async def _clean_up(n: Narrator, where: DemoStore, keep: bool) -> None:
    """Remove the store's data and the temporary directory, and say so; a failure to clean up
    fails the demo (it would otherwise leave a shared Redis dirty without a word)."""
    n.line()
    if keep:
        n.line(f"Kept {where.workdir}: the store, and the gateway's decisions in gateway.log.")
        kept = where.kept()
        if kept:
            n.line(kept)
        return
    try:
        removed = await where.remove()
    except Exception as exc:  # report it and go on to the temporary directory
        problem = f"could not clean up {where.label}: {type(exc).__name__}: {exc}"
        n.mismatches.append(problem)
        n.line(f"Cleaning up: !! {problem}")
        n.line(where.kept())
    else:
        n.line(f"Cleaning up: {removed}.")
    shutil.rmtree(where.workdir, ignore_errors=True)
