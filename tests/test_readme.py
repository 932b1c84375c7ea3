"""The README's first screen shows what a new user sees: the version and the gateway's own
start-up lines. These tests keep those lines true to a real ``fencegate serve``."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.api import serve_app
from tests.servers import GatewayProcess

REPO = Path(__file__).resolve().parent.parent
#: What fits a terminal before a newcomer scrolls.
FIRST_SCREEN = 50


def _first_screen() -> list[str]:
    return (REPO / "README.md").read_text(encoding="utf-8").splitlines()[:FIRST_SCREEN]


def _project_version() -> str:
    with open(REPO / "pyproject.toml", "rb") as file:
        version: str = tomllib.load(file)["project"]["version"]
    return version


def _shown_events() -> dict[str, dict[str, Any]]:
    """The JSON log lines the README shows (``...`` stands for fields it leaves out)."""
    shown: dict[str, dict[str, Any]] = {}
    for line in _first_screen():
        if line.startswith('{"') and '"event"' in line:
            record = json.loads(line.replace(", ...}", "}"))
            shown[record["event"]] = record
    return shown


def test_first_screen_shows_the_installed_version() -> None:
    screen = _first_screen()
    at = screen.index("$ .venv/bin/fencegate --version")
    assert screen[at + 1] == f"fencegate {_project_version()}"
    assert f'{{"status": "ok", "version": "{_project_version()}"}}' in screen
    assert {"gateway.starting", "gateway.listening"} <= set(_shown_events())


def test_first_screen_lines_are_what_serve_logs(tmp_path: Path) -> None:
    """Run ``fencegate serve`` as the README does (no config, in an empty directory) and
    compare: same events in the same order, and each shown field with the value shown (the
    port aside: the test asks for port 0, a free one the system picks, and
    ``gateway.listening`` names the one it got)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "fencegate.gateway.cli", "serve", "--listen", "127.0.0.1:0"],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    logged: list[dict[str, Any]] = []
    try:
        assert process.stderr is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line:
                break
            logged.append(json.loads(line))
            if logged[-1]["event"] == "gateway.listening":
                break
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)
    shown = _shown_events()
    real = {record["event"]: record for record in logged}
    port = str(real["gateway.listening"]["listen"]).rsplit(":", 1)[1]
    assert port != "0", "gateway.listening names the port asked for, not the one bound"
    assert [r["event"] for r in logged if r["event"] in shown] == list(shown)
    for event, fields in shown.items():
        assert event in real, f"the README shows {event}, serve did not log it"
        for key, value in fields.items():
            assert key in real[event], f"{event}: the README shows {key}, serve logs no such field"
            # Where the README's gateway listens: configured (port 0) or bound (the port).
            expected = {str(value).replace("8700", p) for p in ("0", port)}
            assert str(real[event][key]) in expected, (event, key, real[event][key])


# --- the walk-throughs ------------------------------------------------------------------------

#: The README's sections a newcomer follows, in order, on one gateway.
CLAIM_WALK = "## Walk-through: claim, renew, commit"
TOOL_WALK = "## Walk-through: a fenced tool call"
#: Where the README's commands reach the gateway and its payments API; the test's are on ports
#: the system picked.
README_GATEWAY = "localhost:8700"
README_PAYMENTS = "http://127.0.0.1:9000"


@dataclass
class Step:
    """One command of a README ``sh`` block, with the comment before it (``said``) and the
    ``# ->`` lines after it (``shown``: what the README says the user sees)."""

    command: str
    said: str = ""
    shown: list[str] = field(default_factory=list)


def _section(title: str) -> str:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    body = readme[readme.index(f"\n{title}\n") :]
    return body[: body.index("\n## ", len(title) + 2)]


def _blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, re.DOTALL)


def _complete(command: str) -> bool:
    """A command ends at a line that neither continues (``\\``) nor leaves a quote open."""
    if command.endswith("\\"):
        return False
    try:
        shlex.split(command)
    except ValueError:
        return False
    return True


def _steps(block: str) -> list[Step]:
    steps: list[Step] = []
    said: list[str] = []
    pending: list[str] = []
    showing = False
    for line in block.splitlines():
        if pending:
            pending.append(line)
        elif line.startswith("# ->"):
            steps[-1].shown.append(line[len("# ->") :].strip())
            showing = True
            continue
        elif showing and re.match(r"#\s{3,}\S", line):
            steps[-1].shown.append(line[1:].strip())
            continue
        elif line.startswith("#") or not line.strip():
            said.append(line.lstrip("# "))
            showing = False
            continue
        else:
            pending = [line]
        showing = False
        if _complete("\n".join(pending)):
            steps.append(Step("\n".join(pending), said=" ".join(said)))
            pending, said = [], []
    assert not pending, f"a command never ends: {pending}"
    return steps


def _placeholder(value: object) -> bool:
    """``"5c0e..."``: an id the README shortens, a different one on every run."""
    return isinstance(value, str) and value.endswith("...") and len(value) > 3


class Shown:
    """Compares what the README shows with what came, binding each placeholder to the first
    value it stood for: the same placeholder later in the README must be that value again."""

    def __init__(self) -> None:
        self.bound: dict[str, str] = {}

    def same(self, shown: object, real: object, where: str) -> None:
        if _placeholder(shown):
            assert isinstance(shown, str) and isinstance(real, str) and real, (where, real)
            assert self.bound.setdefault(shown, real) == real, (where, shown, real)
        elif isinstance(shown, dict):
            assert isinstance(real, dict), (where, real)
            for key, value in shown.items():
                assert key in real, f"{where}: the README shows {key}, the answer has none"
                if key.endswith("At"):  # a time: the store's clock, not the README's
                    assert isinstance(real[key], int), (where, key, real[key])
                else:
                    self.same(value, real[key], f"{where}.{key}")
        else:
            assert shown == real, (where, shown, real)

    def substitute(self, command: str) -> str:
        for placeholder, value in self.bound.items():
            command = command.replace(placeholder, value)
        return command


def _shown_json(lines: list[str]) -> tuple[int | None, Any]:
    """``# -> 400 {"code": ..., ...}`` (the status optional, ``...`` for fields left out)."""
    text = " ".join(lines)
    status = None
    if match := re.match(r"(\d{3}) (\{.*)", text):
        status, text = int(match[1]), match[2]
    return status, json.loads(text.replace(", ...}", "}"))


@dataclass
class Ran:
    code: int
    out: str
    err: str


class Shell:
    """Runs the README's commands with bash, as a user would, in one directory: the gateway
    and the CLI where the test started them, the tokens in the variables the README names."""

    def __init__(self, directory: Path, env: dict[str, str], shown: Shown) -> None:
        self.directory = directory
        self.env = env
        self.shown = shown
        self.gateway = README_GATEWAY

    async def run(self, command: str) -> Ran:
        command = self.shown.substitute(command.replace(README_GATEWAY, self.gateway))
        process = await asyncio.create_subprocess_exec(
            "bash", "-c", command, cwd=self.directory, env=self.env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(process.communicate(), timeout=60)
        assert process.returncode is not None
        return Ran(process.returncode, out.decode(), err.decode())

    async def curl(self, command: str) -> tuple[int, str, Any]:
        """A ``curl -s`` of the README: its status, content type and JSON body (curl's
        ``-w`` added to read the status line it does not print)."""
        assert command.startswith("curl -s "), command
        ran = await self.run(command + r" -w '\n%{http_code} %{content_type}'")
        assert ran.code == 0, ran.err
        body, status_line = ran.out.rsplit("\n", 1)
        status, content_type = status_line.split(" ", 1)
        return int(status), content_type, json.loads(body) if body else None

    async def curl_i(self, command: str) -> tuple[int, dict[str, str], str]:
        """A ``curl -si`` of the README: its status, headers and body."""
        assert command.startswith("curl -si "), command
        ran = await self.run(command)
        assert ran.code == 0, ran.err
        head, _, body = ran.out.partition("\r\n\r\n")
        status_line, *lines = head.split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines)
        return int(status_line.split()[1]), headers, body


@dataclass
class Payments:
    """The walk-through's payments API: ``/v1/charges`` answers 201 and remembers each call;
    ``/v1/unanswered`` reads the call and drops the connection (so the effect is UNKNOWN)."""

    charges: list[tuple[dict[str, str], bytes]] = field(default_factory=list)

    def app(self) -> web.Application:
        async def charge(request: web.Request) -> web.Response:
            self.charges.append((dict(request.headers), await request.read()))
            return web.json_response({"id": f"ch_{len(self.charges)}"}, status=201)

        async def unanswered(request: web.Request) -> web.Response:
            await request.read()
            assert request.transport is not None
            request.transport.close()
            raise ConnectionResetError

        app = web.Application()
        app.router.add_post("/v1/charges", charge)
        app.router.add_post("/v1/unanswered", unanswered)
        return app


@pytest.mark.parametrize("auth", [False, True], ids=["without-auth", "with-auth"])
async def test_the_walk_throughs_run_as_written(tmp_path: Path, auth: bool) -> None:
    """The README's two walk-throughs, their commands taken from README.md and run with bash
    against ``fencegate serve`` (a real process, SQLite, a port the system picks) and a real
    payments API: once without ``[auth]`` (the token variables unset, as the README says works)
    and once with the principals its ``fencegate token new`` lines make. Every answer is
    compared with what the README shows."""
    setup, calls, refusal = (_steps(block) for block in _blocks(_section(CLAIM_WALK), "sh"))
    (config,) = _blocks(_section(TOOL_WALK), "toml")
    tool_call, settle = (_steps(block) for block in _blocks(_section(TOOL_WALK), "sh"))

    payments = Payments()
    runner, payments_url = await serve_app(payments.app())
    assert f'url = "{README_PAYMENTS}"' in config
    (tmp_path / "fencegate.toml").write_text(config.replace(README_PAYMENTS, payments_url))

    *token_lines, serve = setup
    assert serve.command == "fencegate serve --config fencegate.toml"
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCEGATE_")}
    env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
    shown = Shown()
    shell = Shell(tmp_path, env, shown)
    tokens: dict[str, str] = {}
    for step in token_lines:
        (variable,) = re.findall(r"# export (\w+)=<", step.command)
        env.pop(variable, None)
        if auth:
            made = await shell.run(step.command)
            assert made.code == 0, made.err
            tokens[variable] = env[variable] = made.err.strip().splitlines()[-1]
    assert tokens.keys() == ({"SCHED_TOKEN", "WORKER_TOKEN", "OPS_TOKEN"} if auth else set())

    gateway = GatewayProcess(tmp_path / "fencegate.toml", env=env, cwd=tmp_path)
    try:
        gateway.start()
        shell.gateway = f"127.0.0.1:{gateway.port}"
        env["FENCEGATE_URL"] = gateway.url  # where the CLI finds a gateway not on 8700
        unauthenticated = [
            e for e in gateway.log_events() if e["event"] == "gateway.unauthenticated"
        ]
        assert bool(unauthenticated) is not auth

        # Claim, renew, commit: each answer is the one shown.
        for step in calls:
            status, _, body = await shell.curl(step.command)
            if said := re.search(r"\((\d{3});", step.said):
                assert status == int(said[1]), (step.command, status, body)
            else:
                assert status == 200, (step.command, status, body)
            if step.shown:
                shown.same(_shown_json(step.shown)[1], body, step.command.split()[3])
        (bad,) = refusal
        status, content_type, body = await shell.curl(bad.command)
        shown_status, shown_body = _shown_json(bad.shown)
        assert (status, content_type) == (shown_status, "application/problem+json")
        shown.same(shown_body, body, "refusal")

        # The fenced tool call: a second task, its claim's headers in fence.txt, the call.
        put, claim, cat, call = tool_call
        status, _, body = await shell.curl(put.command)
        assert status == 201, body
        claimed = await shell.run(claim.command)
        assert claimed.code == 0, claimed.err
        fence = (tmp_path / "fence.txt").read_text()
        assert all(line.startswith("Fence-") for line in fence.splitlines()), fence
        assert "Authorization" not in fence  # --headers never prints the credential
        assert not any(token in fence for token in tokens.values())
        printed = await shell.run(cat.command)
        assert printed.code == 0, printed.err
        assert len(printed.out.splitlines()) == len(cat.shown), printed.out
        for shown_line, line in zip(cat.shown, printed.out.splitlines(), strict=True):
            name, value = shown_line.split(": ", 1)
            shown.same(value, line.split(": ", 1)[1], name)
            assert line.startswith(f"{name}: "), (shown_line, line)

        if auth:  # fence.txt alone is no credential: refused, nothing sent
            bare = re.sub(
                r'-H "Fence-Authorization: Bearer \$WORKER_TOKEN" \\\n\s*', "", call.command
            )
            assert bare != call.command and "Authorization" not in bare
            status, _, _ = await shell.curl_i(bare)
            assert status == 401 and not payments.charges

        first, *header_lines = call.shown
        assert first.startswith("201 from the payments API")
        status, headers, _ = await shell.curl_i(call.command)
        assert status == 201, headers
        for line in header_lines:
            name, value = line.split(": ", 1)
            value, _, derived = value.partition("(sha256 of ")
            shown.same(value.strip(), headers[name], name)
            if derived:
                raw = json.dumps(json.loads(derived.rstrip(")")), separators=(",", ":"))
                assert headers[name] == hashlib.sha256(raw.encode()).hexdigest()
        received = re.search(
            r"# The payments API received Idempotency-Key: (\S+) and Fencing-Token: (\S+), "
            r"and no Fence-\*\.", _section(TOOL_WALK)
        )  # fmt: skip
        assert received is not None
        ((sent, body_sent),) = payments.charges
        shown.same(received[1], sent["Idempotency-Key"], "Idempotency-Key")
        assert sent["Fencing-Token"] == received[2]
        assert not [name for name in sent if name.lower().startswith("fence-")], sent
        assert json.loads(body_sent) == {"amount": 4200, "currency": "eur"}
        # "The same call again ... gets the stored answer ... the payments API is not called."
        status, headers, _ = await shell.curl_i(call.command)
        assert (status, headers["Fence-Replayed"]) == (201, "true")
        assert len(payments.charges) == 1

        # Settling an UNKNOWN effect: here another slot of the claim, whose answer never came,
        # stands for the README's charge (its 3f1c...) had that one gone unanswered.
        lost = await _unanswered_call(shell, fence, tokens.get("WORKER_TOKEN", ""))
        shown.bound["3f1c..."] = lost
        listed, resolve = settle
        status, _, body = await shell.curl(listed.command)
        assert status == 200, body
        assert [(e["effectId"], e["state"]) for e in body["effects"]] == [(lost, "UNKNOWN")]
        # As written, while the call may still land: refused, saying until when.
        status, _, body = await shell.curl(resolve.command)
        assert (status, body["code"], body["effectId"]) == (409, "EFFECT_IN_FLIGHT", lost), body
        assert isinstance(body["landingUntil"], int), body
        # With "force": true, as the README says an operator who knows it cannot land sends.
        note = '"outcome": "NOT_APPLIED"'
        assert resolve.command.count(note) == 1
        forced = resolve.command.replace(note, f'{note}, "force": true')
        status, _, body = await shell.curl(forced)
        assert (status, body["state"]) == (200, "NOT_APPLIED"), body
    finally:
        gateway.stop()
        await runner.cleanup()


async def _unanswered_call(shell: Shell, fence: str, worker_token: str) -> str:
    """A call under fence.txt's claim whose answer never comes: the UNKNOWN effect's id, once a
    second attempt at it is refused as the README says (``409 EFFECT_UNKNOWN``)."""
    headers = dict(line.split(": ", 1) for line in fence.splitlines())
    headers.update({"Fence-Slot": "refund", "Fence-Authorization": f"Bearer {worker_token}"})
    url = f"http://{shell.gateway}/proxy/payments/v1/unanswered"
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json={"amount": 4200}, headers=headers) as answer:
            assert answer.headers["Fence-Effect-State"] == "UNKNOWN", await answer.text()
            effect_id = answer.headers["Fence-Effect-Id"]
        async with session.post(url, json={"amount": 4200}, headers=headers) as again:
            assert again.status == 409 and (await again.json())["code"] == "EFFECT_UNKNOWN"
    return effect_id
