"""Screenshot the operator console's queue, from a real gateway, for the README.

```sh
.venv/bin/python -m bench.console_screenshot docs/console-queue.png
.venv/bin/python -m bench.console_screenshot /tmp/queue-phone.png --width 390 --height 844
```

It starts ``fencegate serve`` (embedded SQLite in a temporary directory, ``[auth]`` with a
scheduler, a worker and an operator) in front of a real downstream on loopback, then acts as
an agent through the real proxy: one payment whose answer outlives the downstream's timeout
(UNKNOWN) and one e-mail to a downstream that requires approval (awaiting approval). It logs
into the console in Debian's Chromium (``/usr/bin/chromium``, driven by Playwright; nothing is
downloaded) by pasting the operator's token, and screenshots the "Needs attention" page.

``ConsoleStage`` is also what ``tests/test_console_browser.py`` runs against.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import sys
import tempfile
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from bench._procs import HOST, Proc, free_port, spawn, wait_for_port, wait_ready
from fencegate.gateway.auth import token_sha256
from tests.api import claim_fence

__all__ = ["CHROMIUM", "ConsoleStage", "console_stage", "main"]

CHROMIUM = os.environ.get("FENCEGATE_CHROMIUM", "/usr/bin/chromium")
#: The payments downstream's timeout: its first answer comes later than this.
TIMEOUT_MS = 400
SLOW_MS = 1_500
ROLES = {
    "scheduler": "scheduler",
    "worker": "worker",
    "alice": "operator",
    "carol": "operator",
    "olive": "observer",
}


@dataclass
class Downstream:
    """Payments and mail on loopback. The first call of each payment path answers only after
    the gateway has stopped waiting (the effect happens, the gateway cannot know it); every
    later call answers at once. Every call is counted by path."""

    calls: Counter[str] = field(default_factory=Counter)
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def _handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.calls[request.path] += 1
        if request.path.startswith("/pay") and self.calls[request.path] == 1:
            await asyncio.sleep(SLOW_MS / 1000)
        return web.json_response({"ok": True, "call": self.calls[request.path]})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, HOST, 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@dataclass
class ConsoleStage:
    """A running gateway, its downstream, and the tokens of its principals."""

    directory: Path
    base: str
    tokens: dict[str, str]
    downstream: Downstream
    proc: Proc
    config_path: Path
    http: aiohttp.ClientSession

    async def call(
        self, method: str, path: str, who: str, body: Any = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], Any]:  # fmt: skip
        sent = {"Fence-Authorization": f"Bearer {self.tokens[who]}", **(headers or {})}
        async with self.http.request(method, self.base + path, json=body, headers=sent) as resp:
            raw = await resp.read()
            return resp.status, dict(resp.headers), json.loads(raw) if raw else None

    async def lease(self, task_id: str) -> dict[str, str]:
        """A scheduler puts the task, the worker claims it: the lease's Fence-* headers."""
        status, _, _ = await self.call("PUT", f"/v1/tasks/{task_id}", "scheduler",
                                       {"inputDigest": "in-1"})  # fmt: skip
        assert status in (200, 201), status
        status, _, claim = await self.call(
            "POST", f"/v1/tasks/{task_id}/claim", "worker",
            {"owner": "agent-1", "ttlMs": 60_000, "schedulerEpoch": 1},
        )  # fmt: skip
        assert status == 200, claim
        return claim_fence(claim, "step-1")

    async def pay(
        self, fence: dict[str, str], path: str = "/pay/invoice-7"
    ) -> tuple[int, dict[str, str], Any]:
        return await self.call("POST", f"/proxy/payments{path}", "worker",
                               {"amount": 4200, "currency": "EUR"}, fence)  # fmt: skip

    async def email(self, fence: dict[str, str]) -> tuple[int, dict[str, str], Any]:
        body = {"to": "customer@example.com", "template": "refund"}
        return await self.call("POST", "/proxy/mail/send", "worker", body, fence)

    async def unknown_payment(
        self, task_id: str, path: str = "/pay/invoice-7"
    ) -> tuple[str, dict[str, str]]:
        fence = await self.lease(task_id)
        status, headers, _ = await self.pay(fence, path)
        assert headers.get("Fence-Effect-State") == "UNKNOWN", (status, headers)
        return headers["Fence-Effect-Id"], fence

    async def pending_email(self, task_id: str) -> tuple[str, dict[str, str]]:
        fence = await self.lease(task_id)
        status, _, body = await self.email(fence)
        assert status == 409 and body["code"] == "APPROVAL_REQUIRED", body
        return str(body["effectId"]), fence

    async def revoke(self, name: str) -> None:
        """Remove ``name`` from ``[auth]`` and reload it (SIGHUP), as an operator would."""
        del self.tokens[name]
        self.config_path.write_text(_config(self.directory, self.base, self.downstream,
                                            self.tokens))  # fmt: skip
        self.proc.popen.send_signal(signal.SIGHUP)
        for _ in range(200):
            if "auth.reloaded" in self.proc.log_tail(20_000):
                return
            await asyncio.sleep(0.05)
        raise RuntimeError("the gateway did not reload [auth]:\n" + self.proc.log_tail())


def _config(directory: Path, base: str, downstream: Downstream, tokens: dict[str, str]) -> str:
    principals = "".join(
        f'[[auth.principals]]\nname = "{name}"\nroles = ["{ROLES[name]}"]\n'
        f'token_sha256 = "{token_sha256(token)}"\n\n'
        for name, token in tokens.items()
    )
    return f"""[server]
listen = "{base.removeprefix("http://")}"

[store]
url = "sqlite:///{directory / "fencegate.db"}"

[reconciler]
enabled = false

[logging]
level = "info"

[auth]
{principals}
[[downstreams]]
name = "payments"
url = "{downstream.url}"
timeout_ms = {TIMEOUT_MS}
# The story resolves NOT_APPLIED right after the timeout: no request of this stage lands late.
settle_ms = 0
keep_request_bodies = true

[[downstreams]]
name = "mail"
url = "{downstream.url}"
adapter = "manual"
require_approval = true
approval_ttl_ms = 600000
keep_request_bodies = true
"""


@asynccontextmanager
async def console_stage(directory: Path) -> AsyncIterator[ConsoleStage]:
    """``fencegate serve`` with ``[auth]`` and two downstreams, in ``directory``."""
    downstream = Downstream()
    await downstream.start()
    tokens = {name: secrets.token_urlsafe(24) for name in ROLES}
    base = f"http://{HOST}:{free_port()}"
    config_path = directory / "fencegate.toml"
    config_path.write_text(_config(directory, base, downstream, tokens))
    env = {**os.environ, "FENCEGATE_CONSOLE_SECRET": secrets.token_urlsafe(32)}
    args = [sys.executable, "-m", "fencegate.gateway.cli", "serve", "--config", str(config_path)]
    proc = spawn("gateway", args, directory / "gateway.log", directory, env)
    try:
        port = int(base.rsplit(":", 1)[1])
        await asyncio.to_thread(wait_for_port, port, proc.popen)
        await asyncio.to_thread(wait_ready, base, proc)
        async with aiohttp.ClientSession() as http:
            yield ConsoleStage(directory, base, tokens, downstream, proc, config_path, http)
    finally:
        await asyncio.to_thread(proc.stop)
        await downstream.stop()


async def _screenshot(output: Path, width: int, height: int, chromium: str) -> None:
    from playwright.async_api import async_playwright

    with tempfile.TemporaryDirectory(prefix="fencegate-console-") as temp:
        async with console_stage(Path(temp)) as stage:
            await stage.unknown_payment("invoice-7/charge")
            await stage.unknown_payment("invoice-9/charge", "/pay/invoice-9")
            await stage.pending_email("refund-3/notify")
            async with async_playwright() as p:
                browser = await p.chromium.launch(executable_path=chromium)
                page = await browser.new_page(viewport={"width": width, "height": height})
                await page.goto(f"{stage.base}/console/login")
                await page.fill("#token", stage.tokens["alice"])
                await page.click("button[type=submit]")
                await page.wait_for_selector("#queue")
                output.parent.mkdir(parents=True, exist_ok=True)
                await page.screenshot(path=str(output), full_page=True)
                await browser.close()
    print(f"console_screenshot: wrote {output}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.console_screenshot",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("output", type=Path, help="the PNG to write")
    parser.add_argument("--width", type=int, default=1100, help="viewport width (px)")
    parser.add_argument("--height", type=int, default=520, help="viewport height (px)")
    parser.add_argument("--chromium", default=CHROMIUM, help="the Chromium binary")
    args = parser.parse_args(argv)
    if not Path(args.chromium).exists():
        parser.error(f"no Chromium at {args.chromium} (apt-get install chromium)")
    asyncio.run(_screenshot(args.output, args.width, args.height, args.chromium))
    return 0


if __name__ == "__main__":
    sys.exit(main())
