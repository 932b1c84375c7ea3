"""The operator CLI at the edges an operator meets first (issue 12): which gateway answered,
options before or after the command, ``--version``, ``--config`` with TLS, honest repeats of
``effects resolve``, ``tasks list`` and ``tasks claim --headers`` for curl users.

Everything runs against a real gateway on loopback (in-process, or ``fencegate serve`` as a
process for TLS) with a real downstream; ``fencegate.gateway.cli.main`` runs in a worker
thread so it speaks HTTP to the gateway as from a terminal. Where the store matters the tests
run on SQLite and on Redis.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import structlog
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway import ops_commands, ops_render
from fencegate.gateway.app import create_app
from fencegate.gateway.cli import main
from tests.api import Api
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream
from tests.servers import GatewayProcess, refused_port
from tests.test_mtls import Pki, _ca, _signed
from tests.test_ops_cli import Env, unknown_effect

#: Protocol-layer rules, the same on every store: SQLite only (docs/stores.md).
pytestmark = pytest.mark.one_store


class Cli:
    """``fencegate ARGV`` exactly as given (no ``--url`` added): exit code, stdout, stderr."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys

    async def __call__(self, *argv: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        code = await asyncio.to_thread(main, list(argv))
        out, err = self.capsys.readouterr()
        return code, out, err


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(capsys)


@pytest.fixture
async def env(
    store_url: str, key_prefix: str, capsys: pytest.CaptureFixture[str]
) -> AsyncIterator[Env]:
    """tests/test_ops_cli.py's gateway and downstream, on each store."""
    downstream = await Downstream().start()
    config = make_config(
        store_url,
        key_prefix,
        reconciler={"enabled": False},
        downstreams=[{"name": "api", "url": downstream.url, "timeout_ms": 2000}],
    )
    app = create_app(config, store=build_test_store(config))
    with structlog.testing.capture_logs() as logs:
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            url = str(client.make_url("")).rstrip("/")
            yield Env(Api(client), url, downstream, capsys, logs)
    await downstream.stop()


# --- options before or after the command, --version -------------------------------------------


async def test_gateway_options_before_or_after_the_command(env: Env, cli: Cli) -> None:
    dead = f"http://127.0.0.1:{refused_port()}"
    before = await cli("--url", env.url, "--json", "epoch", "show")
    after = await cli("epoch", "show", "--url", env.url, "--json")
    assert before == after
    assert before[0] == 0 and json.loads(before[1])["schedulerEpoch"] == 1
    # Given on both sides, the one after the command wins, whatever its default.
    assert (await cli("--url", dead, "epoch", "show", "--url", env.url))[0] == 0
    assert (await cli("--url", env.url, "epoch", "show", "--url", dead))[0] == 3
    assert (await cli("--timeout", "0.5", "--url", env.url, "effects", "list"))[0] == 0
    # Before a command that does not take it, an option is refused, not silently dropped
    # (`fencegate --config F serve` would otherwise serve the embedded store).
    for argv in (["--config", "x.toml", "serve"], ["--json", "token", "new", "--name", "a",
                                                    "--role", "worker"]):  # fmt: skip
        with pytest.raises(SystemExit) as exited:
            await cli(*argv)
        assert exited.value.code == 2
        assert "goes with the operator commands" in cli.capsys.readouterr().err


async def test_version(cli: Cli) -> None:
    expected = f"fencegate {importlib.metadata.version('fencegate')}\n"
    with pytest.raises(SystemExit) as exited:
        await cli("--version")
    assert exited.value.code == 0
    assert cli.capsys.readouterr().out == expected
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fencegate.gateway.cli", "--version",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await proc.communicate()
    assert proc.returncode == 0 and out.decode() == expected


# --- every answer names its gateway ------------------------------------------------------------


async def test_every_answer_names_the_gateway_and_why_that_one(
    env: Env, cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eid = await unknown_effect(env)
    port = env.url.rsplit(":", 1)[1]
    config = tmp_path / "fencegate-redis.toml"
    # The operator's host has the address, not the gateway's secrets: still usable.
    config.write_text(
        f'[server]\nlisten = "0.0.0.0:{port}"\nallowed_hosts = ["127.0.0.1"]\n'
        '[store]\nurl = "redis://127.0.0.1:1/0"\npassword_env = "NOT_SET_ON_THIS_HOST"\n'
    )
    monkeypatch.delenv("FENCEGATE_URL", raising=False)

    code, out, _ = await cli("effects", "list", "--url", env.url)
    assert code == 0
    first, header, row = out.splitlines()
    assert first == f"gateway {env.url} (from --url)"
    assert header.startswith("EFFECT") and row.startswith(eid[:12])

    code, out, err = await cli("effects", "list", "--config", str(config))
    assert code == 0, err
    assert out.splitlines()[0] == f"gateway http://127.0.0.1:{port} (from --config {config})"

    monkeypatch.setenv("FENCEGATE_URL", env.url)
    code, out, _ = await cli("epoch", "show")
    assert out == f"gateway {env.url} (from $FENCEGATE_URL)\nscheduler epoch 1, claims open\n"
    monkeypatch.delenv("FENCEGATE_URL")
    # No --url, --config or $FENCEGATE_URL: the default, and the line says so. (The default
    # address is pointed at this gateway: port 8700 may be another one on this machine.)
    monkeypatch.setattr(ops_commands, "DEFAULT_URL", env.url)
    code, out, _ = await cli("rollout", "status")
    assert out.splitlines()[0] == f"gateway {env.url} (default; pass --url or --config)"

    # --json: a top-level "gateway"; the list of effects is wrapped to carry it.
    code, out, _ = await cli("effects", "list", "--json", "--url", env.url)
    listed = json.loads(out)
    assert list(listed) == ["gateway", "effects"] and listed["gateway"] == env.url
    assert [r["effectId"] for r in listed["effects"]] == [eid]
    code, out, _ = await cli("effects", "show", eid, "--json", "--url", env.url)
    shown = json.loads(out)
    assert shown["gateway"] == env.url and shown["effectId"] == eid

    # A refusal says which gateway refused, on its last stderr line.
    code, out, err = await cli("effects", "show", "0" * 64, "--url", env.url)
    assert code == 1 and out == ""
    assert err.startswith("fencegate: NO_SUCH_EFFECT: ")
    assert err.splitlines()[-1] == f"fencegate: gateway {env.url} (from --url)"


async def test_a_config_that_cannot_be_used_is_named_with_what_is_wrong(
    cli: Cli, tmp_path: Path
) -> None:
    missing = tmp_path / "missing.toml"
    not_toml = tmp_path / "not.toml"
    not_toml.write_text("[server\n")
    bad_listen = tmp_path / "listen.toml"
    bad_listen.write_text('[server]\nlisten = "8700"\n')
    for path, what in (
        (missing, "cannot read: No such file or directory"),
        (not_toml, "not valid TOML"),
        (bad_listen, "server.listen: expected HOST:PORT, got '8700'"),
    ):
        code, out, err = await cli("effects", "list", "--config", str(path))
        assert code == 2 and out == "", err
        assert err.startswith(f"fencegate: config error: {path}: {what}"), err
    # What only `serve` needs (the store's password, a readable TLS key) is not asked of the
    # operator's host: the address is taken and tried (nothing listens there: exit 3).
    port = refused_port()
    secrets = tmp_path / "secrets.toml"
    secrets.write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\n'
        '[store]\nurl = "redis://127.0.0.1:1/0"\npassword_env = "NOT_SET_ON_THIS_HOST"\n'
    )
    code, out, err = await cli("epoch", "show", "--config", str(secrets))
    assert code == 3 and out == ""
    assert err.startswith(f"fencegate: cannot reach the gateway at http://127.0.0.1:{port} ")


# --- --config with TLS --------------------------------------------------------------------------


pytest_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@pytest_openssl
async def test_config_with_tls_and_client_certificates(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fencegate serve`` with TLS and client certificates; the CLI finds https in the
    config, verifies the gateway with --cacert (or $FENCEGATE_CACERT) and presents --cert."""
    pki = Pki(tmp_path)
    _ca(tmp_path, "ca")
    _ca(tmp_path, "other-ca")
    _signed(tmp_path, "server", "localhost", "ca",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth")  # fmt: skip
    _signed(tmp_path, "ops", "ops-1", "ca", "extendedKeyUsage=clientAuth")
    port = 0  # the gateway binds a free port; the CLI then finds it in the config
    config = tmp_path / "fencegate.toml"
    config.write_text(f"""
[server]
listen = "127.0.0.1:{port}"
tls_cert_file = "{pki.path("server.pem")}"
tls_key_file = "{pki.path("server.key")}"
tls_client_ca_file = "{pki.path("ca.pem")}"

[store]
url = "sqlite:///{tmp_path / "fg.db"}"

[auth]
[[auth.principals]]
name = "ops-1"
roles = ["operator"]
certificate_cn = "ops-1"
""")
    monkeypatch.delenv("FENCEGATE_CACERT", raising=False)
    monkeypatch.delenv("FENCEGATE_URL", raising=False)
    cert = ["--cert", pki.path("ops.pem"), "--key", pki.path("ops.key")]
    gateway = GatewayProcess(config, port).start()
    config.write_text(config.read_text().replace("127.0.0.1:0", f"127.0.0.1:{gateway.port}"))
    url = f"https://127.0.0.1:{gateway.port}"
    try:
        code, out, err = await cli(
            "--config", str(config), "--cacert", pki.path("ca.pem"), *cert, "rollout", "status"
        )
        assert code == 0, err
        assert out.splitlines()[0] == f"gateway {url} (from --config {config})"
        monkeypatch.setenv("FENCEGATE_CACERT", pki.path("ca.pem"))
        code, out, err = await cli("epoch", "show", "--config", str(config), *cert, "--json")
        assert code == 0, err
        assert json.loads(out) == {"gateway": url, "schedulerEpoch": 1, "claimsPaused": False}

        # The gateway asks every client for a certificate: said before trying.
        code, out, err = await cli("epoch", "show", "--config", str(config))
        assert code == 2 and out == ""
        assert "server.tls_client_ca_file is set" in err and "--cert FILE --key FILE" in err
        # Its certificate is not signed by the CA given: not trusted, and what to pass.
        code, out, err = await cli(
            "epoch", "show", "--config", str(config), "--cacert", pki.path("other-ca.pem"), *cert
        )
        assert code == 3 and out == ""
        assert err.startswith(f"fencegate: the gateway at {url} is not trusted (")
        assert "--cacert FILE or $FENCEGATE_CACERT" in err
        code, _, err = await cli("epoch", "show", "--url", url, "--cert", pki.path("ops.pem"))
        assert code == 2 and "--cert and --key go together" in err
    finally:
        gateway.stop()
    await asyncio.sleep(0.1)  # let the closed TLS transports finish (see tests/test_mtls.py)


# --- effects resolve: honest repeats ------------------------------------------------------------


def test_resolve_renders_an_identical_repeat_as_nothing_changed() -> None:
    eid = "ab" * 32
    assert ops_render.resolved(eid, {"state": "COMMITTED", "unchanged": True}) == (
        f"effect {eid} already resolved as COMMITTED; nothing changed"
    )
    # An older gateway sends no "unchanged": what it did is what it says.
    assert ops_render.resolved(eid, {"state": "COMMITTED"}) == (
        f"effect {eid} resolved as COMMITTED"
    )


async def test_resolve_repeats_are_honest(env: Env) -> None:
    """Needs the gateway's ``unchanged`` and ``warnings`` in the resolve answer."""
    eid = await unknown_effect(env)
    argv = ("effects", "resolve", eid, "--outcome", "COMMITTED", "--note", "saw it")
    first = await env.cli(*argv)
    assert first.code == 0, first.err
    assert first.out == f"effect {eid} resolved as COMMITTED\n"
    # COMMITTED without a response: the gateway warns what duplicates will get.
    (warning,) = first.err.splitlines()
    assert warning.startswith("fencegate: warning: ") and "duplicates" in warning

    # A retry after a lost answer: a no-op that says so, exit 0.
    again = await env.cli(*argv)
    assert again.code == 0, again.err
    assert again.out == f"effect {eid} already resolved as COMMITTED; nothing changed\n"
    as_json = await env.cli(*argv, "--json")
    assert as_json.json()["unchanged"] is True

    # The same outcome with a response it did not have: refused, or stored as it says; never
    # "resolved" with nothing stored.
    more = await env.cli(*argv, "--response-status", "201", "--response-body", "ok")
    record = (await env.cli("effects", "show", eid, "--json")).json()
    if more.code == 0:
        assert "already resolved" not in more.out
        assert record["response"]["status"] == 201
    else:
        assert more.code == 1 and more.err.startswith("fencegate: EFFECT_SETTLED: ")
        assert not isinstance(record.get("response"), dict) or record["response"]["status"] != 201
    other = await env.cli("effects", "resolve", eid, "--outcome", "NOT_APPLIED", "--note", "x")
    assert other.code == 1 and other.err.startswith("fencegate: EFFECT_SETTLED: ")


# --- tasks list, tasks claim --headers ----------------------------------------------------------


async def test_tasks_list_filters_and_pages(
    env: Env, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Needs the gateway's ``GET /v1/tasks``."""
    for task_id in ("c", "a", "b", "d"):
        assert (await env.api.put(task_id)).status == 201
    await env.api.claim("b", ttl_ms=30_000)

    listed = await env.cli("tasks", "list")
    assert listed.code == 0, listed.err
    header, *rows = listed.out.splitlines()
    assert header.split() == ["TASK", "STATE", "OWNER", "GEN", "REVISION", "LEASE", "EXPIRES"]
    assert [row.split()[:5] for row in rows] == [
        ["a", "READY", "-", "0", "1"],
        ["b", "CLAIMED", "w1", "1", "1"],
        ["c", "READY", "-", "0", "1"],
        ["d", "READY", "-", "0", "1"],
    ]
    assert rows[1].endswith("Z") and rows[0].endswith("-")

    claimed = await env.cli("tasks", "list", "--state", "claimed", "--json")
    assert [t["taskId"] for t in claimed.json()["tasks"]] == ["b"]
    assert [t["taskId"] for t in (await env.cli("tasks", "list", "--owner", "w1", "--json"))
            .json()["tasks"]] == ["b"]  # fmt: skip
    assert (await env.cli("tasks", "list", "--owner", "nobody")).out == "no tasks\n"

    # Pages of two: four tasks take two calls; --limit stops early and says more may match.
    monkeypatch.setattr(ops_commands, "_PAGE", 2)
    every = await env.cli("tasks", "list", "--json")
    assert [t["taskId"] for t in every.json()["tasks"]] == ["a", "b", "c", "d"]
    assert every.json()["tasks"][1] == (await env.api.get("b")).body
    some = await env.cli("tasks", "list", "--limit", "3")
    assert len(some.out.splitlines()) == 1 + 3 and "first 3 shown" in some.err
    code, out, _ = await cli("--url", env.url, "--json", "tasks", "list", "--limit", "1")
    assert code == 0 and json.loads(out)["gateway"] == env.url


async def test_tasks_claim_headers_drive_a_proxied_call_with_curl(env: Env, tmp_path: Path) -> None:
    """``fencegate tasks claim ... --headers > fence.txt; curl -H @fence.txt ...``: the
    downstream receives the call once, and a repeat is the ledger's replay."""
    await env.api.put("t1")
    run = await env.cli(
        "tasks", "claim", "t1", "--owner", "curl-user", "--ttl-ms", "60000", "--headers",
        "--slot", "s1",
    )  # fmt: skip
    assert run.code == 0, run.err
    task = (await env.api.get("t1")).body
    assert task["state"] == "CLAIMED" and task["owner"] == "curl-user"
    # Nothing but the claim's Fence-* headers on stdout, one "Name: value" a line.
    headers = dict(line.split(": ", 1) for line in run.out.splitlines())
    assert all(name.startswith("Fence-") for name in headers), headers
    assert headers["Fence-Task"] == "t1" and headers["Fence-Attempt"] == task["attemptId"]
    assert headers["Fence-Slot"] == "s1"
    assert f"gateway {env.url} (from --url)" in run.err

    fence = tmp_path / "fence.txt"
    fence.write_text(run.out)
    url = f"{env.url}/proxy/api/ok/charge"
    for _ in range(2):
        if shutil.which("curl"):
            proc = await asyncio.create_subprocess_exec(
                "curl", "-sS", "-i", "-H", f"@{fence}", "-H", "Content-Type: application/json",
                "--data", '{"amount": 5}', url,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            out, err = await proc.communicate()
            assert proc.returncode == 0, err
            assert out.startswith(b"HTTP/1.1 200"), out
        else:  # the same file, read as curl reads it
            async with env.api.client.post(url, json={"amount": 5}, headers=headers) as resp:
                assert resp.status == 200
    assert len(env.downstream.calls("/ok/charge")) == 1

    # Without --headers: the claim, and that nothing renews it.
    await env.api.put("t2")
    shown = await env.cli("tasks", "claim", "t2", "--owner", "w2", "--ttl-ms", "5000")
    assert shown.code == 0, shown.err
    assert "claimGeneration   1" in shown.out and "nothing renews this lease" in shown.out
    as_json = await env.cli("tasks", "claim", "t1", "--owner", "w3", "--ttl-ms", "5000", "--json")
    assert as_json.code == 1 and as_json.err.startswith("fencegate: CLAIMED: ")
