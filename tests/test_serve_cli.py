"""``fencegate serve`` as an operator runs it: ``--check`` and what start-up and shutdown log.

Real processes only (``python -m fencegate.gateway.cli serve ...``), real stores (the
``any_store_url`` fixture: a private redis-server or a SQLite file), a real downstream.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import pytest

from fencegate import Client
from tests.downstream import Downstream
from tests.servers import GatewayProcess, Gateways, RedisServer, refused_port, write_gateway_config

#: Protocol-layer rules, the same on every store: SQLite only (docs/stores.md).
pytestmark = pytest.mark.one_store


def serve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fencegate.gateway.cli", "serve", *args],
        cwd=cwd, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


# --- serve --check --------------------------------------------------------------------------------


def test_check_reaches_the_store_prints_the_summary_and_never_binds(
    tmp_path: Path, any_store_url: str
) -> None:
    """The listen port is taken by someone else (a running gateway, say): ``serve`` would
    fail on it, ``serve --check`` does not even try, and says what it would serve."""
    gateway = write_gateway_config(
        tmp_path,
        any_store_url,
        downstreams=[
            {"name": "payments", "url": "http://127.0.0.1:9000/v1?api_key=s3cret",
             "timeout_ms": 7000},
            {"name": "bank", "url": "http://127.0.0.1:9001", "adapter": "manual"},
        ],
    )  # fmt: skip
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        held = holder.getsockname()[1]
        config = gateway.config_path.read_text()
        gateway.config_path.write_text(config.replace("127.0.0.1:0", f"127.0.0.1:{held}"))
        done = serve("--check", "--config", str(gateway.config_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"config: {gateway.config_path}" in out, out
    assert f"listen: http://127.0.0.1:{held} (not bound by --check)" in out, out
    assert "payments: url=http://127.0.0.1:9000/v1 adapter=http timeout_ms=7000" in out, out
    assert "bank: url=http://127.0.0.1:9001 adapter=manual timeout_ms=10000" in out, out
    assert out.rstrip().endswith("ok (the config is valid and the store answers)"), out
    assert f"store: {any_store_url} (reached)" in out, out
    assert "s3cret" not in out + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    # The port was never ours: it is free again once the holder lets go.
    with socket.socket() as again:
        again.bind(("127.0.0.1", held))


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ("[store]\nurl = 'sqlite:///fg.db'\nbogus_key = 1\n", "store.bogus_key: unknown key"),
        # Readable files (the config's own check passes) that are no certificate and key:
        # only loading them into a TLS context, as serve does, finds out.
        ("[server]\ntls_cert_file = 'cert.pem'\ntls_key_file = 'key.pem'\n",
         "server.tls_cert_file / server.tls_key_file: cannot load"),
    ],
)  # fmt: skip
def test_check_of_a_bad_config_exits_2_naming_the_key(
    tmp_path: Path, section: str, key: str
) -> None:
    (tmp_path / "cert.pem").write_text("not a certificate\n")
    (tmp_path / "key.pem").write_text("not a key\n")
    path = tmp_path / "bad.toml"
    path.write_text(section)
    done = serve("--check", "--config", str(path), cwd=tmp_path)
    assert done.returncode == 2, done
    assert key in done.stderr, done.stderr
    assert "ok" not in done.stdout and "Traceback" not in done.stderr
    assert not (tmp_path / "fg.db").exists()  # refused before the store was opened


def test_a_console_secret_too_short_to_sign_with_is_refused_at_start_up(tmp_path: Path) -> None:
    """A guessable FENCEGATE_CONSOLE_SECRET would let anyone holding a console cookie (an
    observer's) find the key offline and sign an operator's session."""
    path = tmp_path / "fencegate.toml"
    path.write_text(f'[store]\nurl = "sqlite:///{tmp_path / "fg.db"}"\n')
    for check in (("--check",), ()):
        done = subprocess.run(
            [sys.executable, "-m", "fencegate.gateway.cli", "serve", *check, "--config", str(path)],
            cwd=tmp_path, capture_output=True, text=True, timeout=60,
            env={**os.environ, "FENCEGATE_CONSOLE_SECRET": "password"},
        )  # fmt: skip
        assert done.returncode == 2, done
        assert "FENCEGATE_CONSOLE_SECRET: at least 32 characters" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_check_exits_1_when_the_redis_store_cannot_be_reached(tmp_path: Path) -> None:
    path = tmp_path / "fencegate.toml"
    closed = refused_port()
    path.write_text(f"[store]\nurl = 'redis://:pw-secret@127.0.0.1:{closed}/0'\ntimeout_ms = 300\n")
    # It gives up by itself (exit 1, the store error), not a hang: serve's own bound (60 s)
    # only catches one.
    done = serve("--check", "--config", str(path), cwd=tmp_path)
    assert done.returncode == 1, done
    assert f"store error: redis://127.0.0.1:{closed}/0" in done.stderr, done.stderr
    assert "pw-secret" not in done.stderr + done.stdout
    assert "Traceback" not in done.stderr


def test_check_fails_on_a_redis_that_would_keep_readyz_failing(
    tmp_path: Path, make_redis_server: Callable[..., RedisServer]
) -> None:
    """``/readyz`` refuses a Redis that can lose answered records while
    ``store.require_durable`` is on: a check that passed would start a gateway that is
    never ready. Off, the same Redis passes with the warning printed."""
    redis = make_redis_server(appendonly=False)
    path = tmp_path / "fencegate.toml"
    path.write_text(f"[store]\nurl = '{redis.url}'\n")
    done = serve("--check", "--config", str(path), cwd=tmp_path)
    assert done.returncode == 1, done
    assert "appendonly is off" in done.stderr and "store.require_durable" in done.stderr
    path.write_text(f"[store]\nurl = '{redis.url}'\nrequire_durable = false\n")
    done = serve("--check", "--config", str(path), cwd=tmp_path)
    assert done.returncode == 0, done
    assert "warning: store: appendonly is off" in done.stdout, done.stdout


# --- start-up and shutdown logs ---------------------------------------------------------------


def events(gateway: GatewayProcess) -> list[dict[str, object]]:
    return [e for e in gateway.log_events() if str(e.get("event", "")).startswith("gateway.")]


async def test_start_up_and_shutdown_log_in_order_and_drain_in_flight_calls(
    any_store_url: str, downstream: Downstream, gateways: Gateways
) -> None:
    """starting (version, config) -> one downstream event each -> listening, and on SIGTERM
    stopping -> stopped, the latter only after a call in flight got its answer."""
    gateway = gateways.start(
        "g",
        any_store_url,
        downstreams=[
            {"name": "api", "url": downstream.url, "timeout_ms": 5000},
            {
                "name": "bank",
                "url": downstream.url + "/base?token=s3cret",
                "adapter": "manual",
                "timeout_ms": 3000,
            },
        ],
    )
    async with Client(gateway.url, timeout=10) as client:
        await client.put_task("t1", "in-1")
        lease = await client.acquire("t1", owner="w1", ttl_ms=30_000)
        call = asyncio.create_task(
            lease.request("api", "POST", "/slow/1500/pay", slot="s1", json={"n": 1})
        )
        await asyncio.wait_for(downstream.arrived.wait(), timeout=10)
        assert gateway.proc is not None
        gateway.proc.send_signal(signal.SIGTERM)
        answer = await asyncio.wait_for(call, timeout=10)
    assert answer.status == 200 and not answer.replayed  # drained, not cut off
    assert await asyncio.to_thread(gateway.proc.wait, 15) == 0

    logged = events(gateway)
    names = [e["event"] for e in logged]
    expected = ["gateway.starting", "gateway.downstream", "gateway.downstream",
                "gateway.listening", "gateway.stopping", "gateway.stopped"]  # fmt: skip
    assert [n for n in names if n != "gateway.unauthenticated"] == expected, names
    starting, api, bank = logged[0], logged[1], logged[2]
    assert starting["version"] == version("fencegate")
    assert starting["config"] == str(gateway.config_path)
    assert starting["store"] == any_store_url
    assert "s3cret" not in json.dumps(logged)
    assert {k: api[k] for k in ("name", "url", "adapter", "timeout_ms")} == {
        "name": "api", "url": downstream.url, "adapter": "http", "timeout_ms": 5000,
    }  # fmt: skip
    assert (bank["name"], bank["url"], bank["adapter"], bank["timeout_ms"]) == (
        "bank", downstream.url + "/base", "manual", 3000,
    )  # fmt: skip
    stopping = next(e for e in logged if e["event"] == "gateway.stopping")
    stopped = next(e for e in logged if e["event"] == "gateway.stopped")
    assert stopping["signal"] == "SIGTERM"
    assert isinstance(stopped["drain_ms"], int) and stopped["drain_ms"] >= 500, stopped


def test_sigint_stops_the_same_way_and_no_downstreams_means_no_downstream_events(
    tmp_path: Path, gateways: Gateways
) -> None:
    gateway = gateways.start("g", f"sqlite:///{tmp_path / 'fg.db'}")
    assert gateway.proc is not None
    gateway.proc.send_signal(signal.SIGINT)
    assert gateway.proc.wait(timeout=15) == 0
    names = [e["event"] for e in events(gateway) if e["event"] != "gateway.unauthenticated"]
    assert names == ["gateway.starting", "gateway.listening", "gateway.stopping",
                     "gateway.stopped"], names  # fmt: skip
    stopping = next(e for e in events(gateway) if e["event"] == "gateway.stopping")
    assert stopping["signal"] == "SIGINT"
