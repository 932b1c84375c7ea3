"""The operator console in a real browser: Debian's Chromium driven by Playwright, against a
real ``fencegate serve`` (``bench.console_screenshot.ConsoleStage``: SQLite, ``[auth]``, a
payments downstream whose first answer outlives the gateway's timeout, a mail downstream
that requires approval).

One browser for the module; each test gets its own browser context (its own cookies) and
saves a screenshot of every page it visits under its ``tmp_path``. Without Chromium the
module fails when ``CI=true`` (CI installs it: ``.ci/run``) and is skipped elsewhere.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from bench.console_screenshot import CHROMIUM, ConsoleStage, console_stage
from tests.api import until

if not (Path(CHROMIUM).exists() or shutil.which("chromium")):
    if os.environ.get("CI") == "true":
        raise RuntimeError(f"no Chromium at {CHROMIUM}: CI must install it (.ci/run)")
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)

from playwright.async_api import Browser, Page, async_playwright, expect

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stage(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ConsoleStage]:
    async with console_stage(tmp_path_factory.mktemp("console")) as running:
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as p:
        launched = await p.chromium.launch(executable_path=CHROMIUM)
        yield launched
        await launched.close()


class Visit:
    """One browser context: its page, and a numbered screenshot of every page it shows."""

    def __init__(self, page: Page, shots: Path) -> None:
        self.page = page
        self.shots = shots
        self.count = 0
        self.csp_violations: list[str] = []
        page.on("console", self._console)

    def _console(self, message: Any) -> None:
        if "Content Security Policy" in message.text or message.type == "error":
            self.csp_violations.append(message.text)

    async def shot(self, name: str) -> None:
        self.count += 1
        await self.page.screenshot(path=str(self.shots / f"{self.count:02d}-{name}.png"),
                                   full_page=True)  # fmt: skip

    async def login(self, stage: ConsoleStage, who: str, start: str = "/console") -> None:
        await self.page.goto(stage.base + start)
        assert "/console/login" in self.page.url
        await self.shot("login")
        await self.page.fill("#token", stage.tokens[who])
        await self.page.click("button[type=submit]")
        await self.page.wait_for_url(lambda url: "/console/login" not in url)


async def _visit(browser: Browser, tmp_path: Path, **options: Any) -> Visit:
    context = await browser.new_context(**options)
    shots = tmp_path / "screenshots"
    shots.mkdir(exist_ok=True)
    return Visit(await context.new_page(), shots)


async def test_an_operator_resolves_an_unknown_effect_and_the_retry_goes_through(
    stage: ConsoleStage, browser: Browser, tmp_path: Path
) -> None:
    effect_id, fence = await stage.unknown_payment("browser/pay-1", "/pay/b1")
    # Until an operator settles it, the agent's retry is refused: nothing is sent again.
    status, _, body = await stage.pay(fence, "/pay/b1")
    assert status == 409 and body["code"] == "EFFECT_UNKNOWN"
    assert stage.downstream.calls["/pay/b1"] == 1
    visit = await _visit(browser, tmp_path)
    page = visit.page
    await visit.login(stage, "alice")
    assert "unknown" in await page.title()
    await visit.shot("queue")
    await page.click(f"a[href='/console/effects/{effect_id}']")
    await page.wait_for_selector("#resolve-form")
    await visit.shot("effect")
    # What the call was (the kept request) and where to look it up at the downstream.
    assert '"amount": 4200' in await page.inner_text("#request-body")
    look_up = await page.inner_text("#look-up")
    assert f"Idempotency-Key: {effect_id}" in look_up and "POST /pay/b1" in look_up
    await page.check("input[name=outcome][value=NOT_APPLIED]")
    await page.fill("#note", "bank statement shows no charge for invoice b1")
    await page.click("#resolve")
    await page.wait_for_selector("#confirm")
    assert "NOT_APPLIED" in await page.inner_text("main")
    await visit.shot("confirm")
    await page.click("#confirm")
    await page.wait_for_selector(".result")
    assert "Resolved NOT_APPLIED" in await page.inner_text("main")
    await visit.shot("result")
    await page.goto(f"{stage.base}/console/effects/{effect_id}")
    trail = await page.inner_text("main")
    assert "alice" in trail and "bank statement shows no charge" in trail
    await visit.shot("effect-after")
    # The agent's retry now goes through: a second call at the downstream, answered.
    status, headers, _ = await stage.pay(fence, "/pay/b1")
    assert status == 200 and headers["Fence-Effect-State"] == "COMMITTED"
    assert stage.downstream.calls["/pay/b1"] == 2
    assert not visit.csp_violations, visit.csp_violations


async def test_an_operator_pastes_the_downstreams_answer_and_retries_get_it(
    stage: ConsoleStage, browser: Browser, tmp_path: Path
) -> None:
    effect_id, fence = await stage.unknown_payment("browser/pay-4", "/pay/b4")
    visit = await _visit(browser, tmp_path)
    page = visit.page
    await visit.login(stage, "alice", f"/console/effects/{effect_id}")
    await page.wait_for_selector("#resolve-form")
    assert "204 with an empty body" in await page.inner_text("#answer")
    answer = '{"charge": "ch_b4",\n "status": "succeeded"}'
    await page.check("input[name=outcome][value=COMMITTED]")
    await page.fill("#response-status", "201")
    await page.fill("#response-headers", "Content-Type: application/json")
    await page.fill("#response-body", answer)
    await page.fill("#note", "the bank shows charge ch_b4 for invoice b4")
    await visit.shot("effect-answer")
    await page.click("#resolve")
    await page.wait_for_selector("#confirm")
    # Before confirming: what the agent's retries will receive.
    summary = await page.inner_text("#retry-summary")
    assert summary.startswith("the answer you pasted: status 201, 1 header(s)"), summary
    assert await page.inner_text("#retry-body") == answer
    await visit.shot("confirm-answer")
    await page.click("#confirm")
    await page.wait_for_selector(".result")
    assert "Retries of this call get the answer you gave (status 201)" in await page.inner_text(
        ".result"
    )
    await visit.shot("result-answer")
    status, headers, body = await stage.pay(fence, "/pay/b4")
    assert status == 201 and headers["Fence-Replayed"] == "true"
    assert headers["Content-Type"] == "application/json"
    assert body == {"charge": "ch_b4", "status": "succeeded"}
    assert stage.downstream.calls["/pay/b4"] == 1
    # No answer given: the confirmation says so before anything is recorded.
    effect_id, fence = await stage.unknown_payment("browser/pay-5", "/pay/b5")
    await page.goto(f"{stage.base}/console/effects/{effect_id}")
    await page.check("input[name=outcome][value=COMMITTED]")
    await page.fill("#note", "it happened; the bank's answer is lost")
    await page.click("#resolve")
    await page.wait_for_selector("#confirm")
    assert (await page.inner_text("#retry-summary")).startswith("204 with an empty body")
    await visit.shot("confirm-empty")
    await page.click("#confirm")
    await page.wait_for_selector(".result")
    status, headers, _ = await stage.pay(fence, "/pay/b5")
    assert status == 204 and headers["Fence-Replay-Body"] == "none"
    assert stage.downstream.calls["/pay/b5"] == 1
    assert not visit.csp_violations, visit.csp_violations


async def test_needs_attention_follows_a_resolve_made_elsewhere_without_a_reload(
    stage: ConsoleStage, browser: Browser, tmp_path: Path
) -> None:
    effect_id, _ = await stage.unknown_payment("browser/pay-6", "/pay/b6")
    visit = await _visit(browser, tmp_path)
    page = visit.page
    # The page's timers run on a clock the test moves: no waiting out the refresh interval.
    await page.clock.install()
    await visit.login(stage, "olive")  # an observer: reading the list needs no more
    row = page.locator(f"#attention a[href='/console/effects/{effect_id}']")
    await expect(row).to_have_count(1)
    every = int(await page.get_attribute("#attention", "data-refresh-ms") or "0")
    assert 0 < every <= 10_000
    count = int((await page.inner_text("#unknown-count")).split()[0])
    assert re.fullmatch(r"as of \d\d:\d\d:\d\d UTC", await page.inner_text("#as-of"))
    await page.evaluate("window.notReloaded = true")
    await page.clock.pause_at(await page.evaluate("Date.now()") / 1000 + 1)
    await visit.shot("queue-before")
    # Resolved elsewhere (the CLI's call), then one refresh interval on the page's clock.
    resolved = {"outcome": "NOT_APPLIED", "note": "done in the CLI"}
    status, _, _ = await stage.call("POST", f"/v1/effects/{effect_id}/resolve", "alice", resolved)
    assert status == 200
    await page.clock.run_for(every)
    # Generous bounds, for a hang only: the refresh was already asked for.
    await expect(row).to_have_count(0, timeout=30_000)
    await expect(page.locator("#unknown-count")).to_have_text(f"{count - 1} UNKNOWN")
    await expect(page).to_have_title(re.compile(rf"^\({count - 1} unknown, "))
    assert await page.evaluate("window.notReloaded === true")
    await visit.shot("queue-after")
    assert not visit.csp_violations, visit.csp_violations


async def test_an_operator_approves_an_email_and_it_is_sent_exactly_once(
    stage: ConsoleStage, browser: Browser, tmp_path: Path
) -> None:
    effect_id, fence = await stage.pending_email("browser/mail-1")
    _, _, record = await stage.call("GET", f"/v1/effects/{effect_id}", "alice")
    visit = await _visit(browser, tmp_path)
    page = visit.page
    await visit.login(stage, "alice", f"/console/effects/{effect_id}")
    await page.wait_for_selector("#approve-form")
    assert record["payloadDigest"] in await page.inner_text("#approve-form")
    # The approver reads what would be sent before anything is (the kept request).
    assert "customer@example.com" in await page.inner_text("#request-body")
    await visit.shot("effect")
    await page.fill("#approve-note", "refund confirmed with the customer")
    await page.click("#approve")
    await page.wait_for_selector("#confirm")
    text = await page.inner_text("main")
    assert record["payloadDigest"] in text and "expires 10 min after you confirm" in text
    await visit.shot("confirm")
    await page.click("#confirm")
    await page.wait_for_selector(".result")
    assert "The approval expires at" in await page.inner_text(".result")
    await visit.shot("result")
    assert stage.downstream.calls["/send"] == 0
    first = await stage.email(fence)
    again = await stage.email(fence)
    assert first[0] == 200 and first[1]["Fence-Effect-State"] == "COMMITTED"
    assert again[0] == 200 and again[1]["Fence-Replayed"] == "true"
    assert stage.downstream.calls["/send"] == 1
    assert not visit.csp_violations, visit.csp_violations


async def test_an_observer_sees_no_action_and_a_forged_post_is_refused(
    stage: ConsoleStage, browser: Browser, tmp_path: Path
) -> None:
    effect_id, _ = await stage.unknown_payment("browser/pay-2", "/pay/b2")
    visit = await _visit(browser, tmp_path)
    page = visit.page
    await visit.login(stage, "olive", f"/console/effects/{effect_id}")
    await page.wait_for_selector("h1")
    await visit.shot("effect")
    assert await page.query_selector("#actions") is None
    assert await page.query_selector("#resolve") is None
    assert "read-only" in await page.inner_text("header")
    await page.goto(f"{stage.base}/console/fleet")
    assert await page.query_selector("#bump") is None
    await visit.shot("fleet")
    # A forged POST from the observer's own session, with its CSRF token and same origin.
    status = await page.evaluate(
        """async (path) => {
            const csrf = document.querySelector("input[name=csrf]").value;
            const body = new URLSearchParams({csrf, outcome: "NOT_APPLIED", note: "forged",
                                              confirm: "yes"});
            const answer = await fetch(path, {method: "POST", body});
            return answer.status;
        }""",
        f"/console/effects/{effect_id}/resolve",
    )
    assert status == 403
    _, _, record = await stage.call("GET", f"/v1/effects/{effect_id}", "alice")
    assert record["state"] == "UNKNOWN" and record["actions"] == []


async def test_a_page_without_a_session_goes_to_login_and_a_revoked_token_ends_one(
    stage: ConsoleStage, browser: Browser, tmp_path: Path
) -> None:
    visit = await _visit(browser, tmp_path)
    page = visit.page
    await page.goto(f"{stage.base}/console/fleet")
    assert "/console/login?next=%2Fconsole%2Ffleet" in page.url
    await visit.shot("login")
    await page.fill("#token", stage.tokens["carol"])
    await page.click("button[type=submit]")
    await page.wait_for_url(f"{stage.base}/console/fleet")
    await page.wait_for_selector("svg.chart[data-series=activeLeases] path", state="attached")
    await visit.shot("fleet")
    await stage.revoke("carol")
    await page.goto(f"{stage.base}/console/tasks")
    assert "/console/login" in page.url
    assert "Your session ended" in await page.inner_text("main")
    await visit.shot("ended")
    assert not visit.csp_violations, visit.csp_violations


async def test_the_fleet_page_says_why_not_and_labels_its_charts_in_words(
    stage: ConsoleStage, browser: Browser, tmp_path: Path
) -> None:
    await stage.unknown_payment("browser/pay-7", "/pay/b7")
    visit = await _visit(browser, tmp_path)
    page = visit.page
    await visit.login(stage, "olive", "/console/fleet")
    await page.wait_for_selector("#switch")
    # Which conditions fail, by how much (the lease above is still held, its effect UNKNOWN).
    assert await page.inner_text("#switch .badge") == "no"
    blockers = await page.inner_text("#blockers")
    assert re.search(r"\b\d+ leases? held\b", blockers), blockers
    assert re.search(r"\b\d+ effects? UNKNOWN\b", blockers), blockers
    # The gateway sampled since it started: the charts draw at once, legends in words.
    await expect(page.locator("[data-legend=unsettled] li")).to_have_text(
        ["effects in flight (PREPARED)", "effects UNKNOWN", "effects awaiting approval"]
    )
    await expect(page.locator("[data-legend=activeLeases] li")).to_have_text(["active leases"])
    # The payment's outcome shows in the effects legend once a sample after it is drawn (the
    # gateway samples every 5 s, the page reads every 5 s: the bound is for a hang only).
    unknown = page.locator("[data-legend=effects] li", has_text="payments: outcome unknown")
    await expect(unknown).to_have_count(1, timeout=30_000)
    await visit.shot("fleet-legends")
    for text in await page.locator("ul.legend li").all_inner_texts():
        assert "/" not in text and not re.search(r"[a-z][A-Z]", text), text
    assert not visit.csp_violations, visit.csp_violations


async def test_the_queue_and_an_effect_fit_a_phone(
    stage: ConsoleStage, browser: Browser, tmp_path: Path
) -> None:
    effect_id, _ = await stage.unknown_payment("browser/pay-3", "/pay/b3")
    visit = await _visit(browser, tmp_path, viewport={"width": 390, "height": 844},
                         is_mobile=True, has_touch=True)  # fmt: skip
    page = visit.page
    await visit.login(stage, "alice")
    for path in ("/console", f"/console/effects/{effect_id}", "/console/fleet"):
        await page.goto(stage.base + path)
        await visit.shot(path.strip("/").replace("/", "-")[:30])
        overflow = await page.evaluate(
            "document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert overflow <= 0, (path, overflow)
    assert not visit.csp_violations, visit.csp_violations


async def test_an_operator_finds_the_tasks_whose_lease_expired(
    stage: ConsoleStage, browser: Browser, tmp_path: Path
) -> None:
    """The task list: filtered by owner and "lease expired" (the store's clock decides),
    paged, each task linked to its page; the 12 characters of an effect id work in a URL."""
    for task_id, ttl_ms in (("browser/lapsed-1", 1), ("browser/held-1", 600_000)):
        status, _, _ = await stage.call("PUT", f"/v1/tasks/{task_id}", "scheduler",
                                        {"inputDigest": "in-1"})  # fmt: skip
        assert status == 201
        status, _, claim = await stage.call(
            "POST", f"/v1/tasks/{task_id}/claim", "worker",
            {"owner": "agent-lapse", "ttlMs": ttl_ms, "schedulerEpoch": 1},
        )  # fmt: skip
        assert status == 200, claim

    async def lapsed() -> bool:  # a 1 ms lease: over once the store's clock moved on
        _, _, page = await stage.call(
            "GET", "/v1/tasks?owner=agent-lapse&leaseExpired=true", "alice"
        )
        return [t["taskId"] for t in page["tasks"]] == ["browser/lapsed-1"]

    await until(lapsed, "the 1 ms lease expired")
    visit = await _visit(browser, tmp_path)
    page = visit.page
    await visit.login(stage, "alice", "/console/tasks")
    await page.wait_for_selector("#task-filters")
    await page.fill("#filter-owner", "agent-lapse")
    await page.select_option("#filter-lease", "true")
    await page.click("#task-filters button[type=submit]")
    await page.wait_for_url(re.compile(r".*leaseExpired=true.*"))
    rows = page.locator("#task-list tbody tr")
    await expect(rows).to_have_count(1)
    await expect(rows.first).to_contain_text("browser/lapsed-1")
    await expect(rows.first).to_contain_text("expired")
    await visit.shot("tasks-expired")
    await page.select_option("#filter-lease", "false")
    await page.click("#task-filters button[type=submit]")
    await page.wait_for_url(re.compile(r".*leaseExpired=false.*"))
    await expect(rows).to_have_count(1)
    await expect(rows.first).to_contain_text("browser/held-1")
    await visit.shot("tasks-held")
    await page.click("#task-list a[href$='held-1']")
    await page.wait_for_url(re.compile(r".*id=browser(/|%2F)held-1$"))
    assert "CLAIMED" in await page.inner_text("main")
    await visit.shot("task")
    # An effect by the 12 characters the queue shows.
    effect_id, _ = await stage.unknown_payment("browser/pay-prefix", "/pay/bp")
    await page.goto(f"{stage.base}/console/effects/{effect_id[:12]}")
    await page.wait_for_selector("#resolve-form")
    assert effect_id in await page.inner_text("main")
    await visit.shot("effect-by-prefix")
    assert not visit.csp_violations, visit.csp_violations
