"""Real processes for tests: a redis-server we own, and gateway processes.

The suite never touches a Redis it did not start: each ``RedisServer`` runs on a free loopback
port in its own directory, with AOF on and ``appendfsync always`` (the production advice), so
tests can kill it, pause it with SIGSTOP and restart it on the same data.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import redis

__all__ = [
    "GatewayProcess",
    "Gateways",
    "RedisServer",
    "free_port",
    "wait_for_port",
    "write_gateway_config",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for_port(
    port: int, timeout: float = 10.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


class _Child:
    """A child process a test can SIGKILL, freeze (SIGSTOP), thaw and stop."""

    proc: subprocess.Popen[bytes] | None = None
    #: How long ``stop`` waits for a clean exit before SIGKILL.
    stop_timeout_s: float = 10.0

    def kill(self) -> None:
        """SIGKILL (after SIGCONT, so a frozen process dies too): no shutdown at all."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


class RedisServer(_Child):
    def __init__(self, directory: Path, *, appendonly: bool = True) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not installed; .ci/run installs it (apt-get install -y "
                "redis-server)"
            )
        self.binary = binary
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "always",
            "--maxmemory-policy", "noeviction",
            "--logfile", str(self.directory / "redis.log"),
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, proc=self.proc)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:  # the port opens before an AOF is fully loaded
            try:
                client.ping()
                break
            except redis.exceptions.BusyLoadingError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()
        return self

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, decode_responses=True)


class GatewayProcess(_Child):
    """``fencegate serve`` as a real process, as an operator would run it."""

    def __init__(
        self,
        config_path: Path,
        port: int,
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.config_path = config_path
        self.port = port
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd or config_path.parent
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = config_path.parent / f"gateway-{port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> GatewayProcess:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fencegate.gateway.cli",
                "serve",
                "--config",
                str(self.config_path),
                "--listen",
                f"127.0.0.1:{self.port}",
            ],
            stdout=log,
            stderr=log,
            cwd=self.cwd,
            env=self.env,
        )
        log.close()
        try:
            wait_for_port(self.port, timeout=20, proc=self.proc)
        except Exception:
            raise RuntimeError(
                f"gateway did not start: {self.log_path.read_text()[-2000:]}"
            ) from None
        return self

    def log_events(self) -> list[dict[str, object]]:
        import json

        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


def write_gateway_config(
    directory: Path,
    store_url: str,
    *,
    timeout_ms: int = 1000,
    key_prefix: str = "fg",
    max_ttl_ms: int = 60_000,
    downstreams: Sequence[Mapping[str, object]] = (),
    proxy: Mapping[str, object] | None = None,
    env: dict[str, str] | None = None,
) -> GatewayProcess:
    """Write ``directory/fencegate.toml`` for ``store_url`` and return its (unstarted) gateway.

    The port is chosen here and written to ``server.listen``, so the file alone is enough to
    run the gateway the way an operator would. ``downstreams`` become ``[[downstreams]]``
    tables and ``proxy`` the ``[proxy]`` section (keys as in ``config.example.toml``);
    ``env`` is added to the gateway's environment (e.g. ``FENCEGATE_FAILPOINTS``).
    """
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config_path = directory / "fencegate.toml"
    text = (
        "[server]\n"
        f'listen = "127.0.0.1:{port}"\n'
        "\n[store]\n"
        f"url = {json.dumps(store_url)}\n"
        f"timeout_ms = {timeout_ms}\n"
        f"redis_key_prefix = {json.dumps(key_prefix)}\n"
        "\n[leases]\n"
        f"max_ttl_ms = {max_ttl_ms}\n"
    )
    if proxy is not None:
        text += "\n[proxy]\n" + _toml_pairs(proxy)
    for downstream in downstreams:
        text += "\n[[downstreams]]\n" + _toml_pairs(downstream)
    config_path.write_text(text)
    return GatewayProcess(config_path, port, env=env)


def _toml_pairs(values: Mapping[str, object]) -> str:
    """``key = value`` lines for strings, integers and booleans (JSON spells them as TOML)."""
    lines = []
    for key, value in values.items():
        if not isinstance(value, str | int | bool):
            raise TypeError(f"{key}: only strings, integers and booleans are written")
        lines.append(f"{key} = {json.dumps(value)}\n")
    return "".join(lines)


class Gateways:
    """Gateway processes a test starts; ``stop_all`` (from a fixture) ends every one of them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[GatewayProcess] = []

    def start(
        self,
        name: str,
        store_url: str,
        *,
        timeout_ms: int = 1000,
        key_prefix: str = "fg",
        max_ttl_ms: int = 60_000,
        downstreams: Sequence[Mapping[str, object]] = (),
        proxy: Mapping[str, object] | None = None,
        env: dict[str, str] | None = None,
    ) -> GatewayProcess:
        """Configure and start ``fencegate serve`` in ``root/name``; it is listening on return."""
        gateway = write_gateway_config(
            self.root / name,
            store_url,
            timeout_ms=timeout_ms,
            key_prefix=key_prefix,
            max_ttl_ms=max_ttl_ms,
            downstreams=downstreams,
            proxy=proxy,
            env=env,
        )
        self.started.append(gateway)
        return gateway.start()

    def stop_all(self) -> None:
        for gateway in self.started:
            gateway.stop()
