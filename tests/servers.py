"""Real processes for tests: a redis-server we own, and gateway processes.

The suite never touches a Redis it did not start: each ``RedisServer`` runs on a free loopback
port in its own directory, with AOF on and ``appendfsync always`` (the production advice), so
tests can kill it, pause it with SIGSTOP and restart it on the same data.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

__all__ = [
    "GatewayProcess",
    "Gateways",
    "PortTaken",
    "RedisServer",
    "dies_with_us",
    "free_port",
    "refused_port",
    "wait_for_port",
    "wait_for_redis",
    "write_gateway_config",
]


def free_port() -> int:
    """A port that was free a moment ago. Only for a server that cannot bind port 0 and
    report the port it got (redis-server, PostgreSQL): it must start again on another port
    when this one was taken meanwhile (``RedisServer.start`` does). Anything that cannot fail
    over like that binds port 0 itself, or uses ``refused_port``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


_SETPRIV = shutil.which("setpriv")


def dies_with_us(args: Sequence[str]) -> list[str]:
    """``args`` run under ``setpriv --pdeathsig KILL``: a server left running by a killed
    pytest would hold its port, its data directory and a PostgreSQL's shared memory until
    someone finds it, so the kernel ends it with the process that started it. The signal
    follows the starting *thread*, so a child started from a worker thread (``to_thread``),
    which ends before the test does, goes without it and its test's clean-up stops it."""
    if _SETPRIV is None or threading.current_thread() is not threading.main_thread():
        return list(args)
    return [_SETPRIV, "--pdeathsig", "KILL", "--", *args]


_REFUSING: list[socket.socket] = []


def refused_port() -> int:
    """A loopback port where every connection is refused, for the life of the test process:
    a socket bound to it (so no other program can take it) that never listens. The address
    of a dead downstream, store or gateway."""
    if not _REFUSING:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        _REFUSING.append(sock)
    port: int = _REFUSING[0].getsockname()[1]
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


class PortTaken(RuntimeError):
    """A server could not bind its port: another process took it after it was picked."""


def wait_for_redis(port: int, proc: subprocess.Popen[bytes], log: Path, log_from: int) -> None:
    """Until the redis-server ``proc`` answers on ``port`` (not another server that holds the
    port: its ``process_id`` must be ``proc``'s), its AOF loaded. ``PortTaken`` when it exited
    because the port was taken (its ``log`` says so after ``log_from``)."""
    # One try per call, briefly: a server that took the port may accept and never answer.
    client = redis.Redis(port=port, socket_timeout=2, retry=Retry(NoBackoff(), 0))
    deadline = time.monotonic() + 30
    try:
        while True:  # the port opens before an AOF is fully loaded
            try:
                wait_for_port(port, timeout=30, proc=proc)
                pid = client.info("server")["process_id"]
            except (RuntimeError, redis.exceptions.RedisError) as exc:
                if proc.poll() is not None and _says_port_taken(log, log_from):
                    raise PortTaken(port) from exc
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
                continue
            if pid == proc.pid:
                return
            # Someone else's server answers on this port: ours exits, and is told above.
            if time.monotonic() > deadline:
                raise TimeoutError(f"another server answers on {port}")
            time.sleep(0.05)
    finally:
        client.close()


def _says_port_taken(log: Path, log_from: int) -> bool:
    if not log.exists():
        return False
    with log.open("rb") as file:
        file.seek(log_from)
        return b"address already in use" in file.read().lower()


def redis_server_binary() -> str:
    """The ``redis-server`` every test server runs (plain, Sentinel and cluster nodes)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            "redis-server is not installed; .ci/run installs it (apt-get install -y redis-server)"
        )
    return binary


class RedisServer(_Child):
    def __init__(self, directory: Path, *, appendonly: bool = True) -> None:
        self.binary = redis_server_binary()
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None
        self._started = False
        self._log_from = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start (or restart, on the same port and data) and wait until it answers. The port
        was free when it was picked: taken meanwhile, the first start tries another one (a
        restart keeps its port: clients hold its address)."""
        for _ in range(5):
            self._spawn()
            try:
                self._wait_until_answering()
                self._started = True
                return self
            except PortTaken:
                if self._started:
                    raise
                self.port = free_port()
        raise RuntimeError("redis-server found no free port in 5 tries")

    def _log_size(self) -> int:
        log = self.directory / "redis.log"
        return log.stat().st_size if log.exists() else 0

    def _spawn(self) -> None:
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
        self._log_from = self._log_size()
        self.proc = subprocess.Popen(
            dies_with_us(args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def _wait_until_answering(self) -> None:
        assert self.proc is not None
        try:
            wait_for_redis(self.port, self.proc, self.directory / "redis.log", self._log_from)
        except PortTaken:
            self.proc = None
            raise

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, decode_responses=True)


#: Numbers the gateways' log files (several gateways may share one config directory).
_GATEWAY_LOGS = itertools.count(1)


class GatewayProcess(_Child):
    """``fencegate serve`` as a real process, as an operator would run it.

    ``port`` 0 (the default): the gateway binds a port the system picks and ``start`` reads
    it from its ``gateway.listening`` line, so no port is picked first and bound later
    (another process may take it meanwhile). Started again, it binds the port it had.
    """

    def __init__(
        self,
        config_path: Path,
        port: int = 0,
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.config_path = config_path
        self.port = port
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd or config_path.parent
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = config_path.parent / f"gateway-{next(_GATEWAY_LOGS)}.log"
        self._started = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> GatewayProcess:
        """Start and wait for its ``gateway.listening`` line. A port given up front (an older
        release that cannot bind port 0 and say which it got) that was taken meanwhile: the
        first start tries another one (a restart keeps its port: clients hold its address)."""
        for _ in range(5):
            try:
                self._start_once()
            except PortTaken:
                if self._started:
                    raise
                self.port = free_port()
                continue
            self._started = True
            return self
        raise RuntimeError("the gateway found no free port in 5 tries")

    def _start_once(self) -> None:
        log = self.log_path.open("ab")
        logged_before = log.tell()
        self.proc = subprocess.Popen(
            dies_with_us(
                [
                    sys.executable,
                    "-m",
                    "fencegate.gateway.cli",
                    "serve",
                    "--config",
                    str(self.config_path),
                    "--listen",
                    f"127.0.0.1:{self.port}",
                ]
            ),
            stdout=log,
            stderr=log,
            cwd=self.cwd,
            env=self.env,
        )
        log.close()
        try:
            self.port = self._bound_port(logged_before, timeout=30)
        except Exception:
            if self.port and _says_port_taken(self.log_path, logged_before):
                self.proc = None
                raise PortTaken(self.port) from None
            raise RuntimeError(
                f"gateway did not start: {self.log_path.read_text()[-2000:]}"
            ) from None

    def _bound_port(self, offset: int, timeout: float) -> int:
        """The port of this start's first ``gateway.listening`` line (the gateway logs it once
        it has bound, with the port it got), read from ``offset`` of its log on."""
        deadline = time.monotonic() + timeout
        while True:
            with self.log_path.open("rb") as log:
                log.seek(offset)
                for line in log.read().splitlines():
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(event, dict) and event.get("event") == "gateway.listening":
                        return int(str(event["listen"]).rsplit(":", 1)[1])
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"the gateway exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no gateway.listening line after {timeout}s")
            time.sleep(0.02)

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

    ``server.listen`` is port 0: the gateway binds a port the system picks and ``start``
    reads it back (``GatewayProcess.port``). ``downstreams`` become ``[[downstreams]]``
    tables and ``proxy`` the ``[proxy]`` section (keys as in ``config.example.toml``);
    ``env`` is added to the gateway's environment (e.g. ``FENCEGATE_FAILPOINTS``).
    """
    directory.mkdir(parents=True, exist_ok=True)
    config_path = directory / "fencegate.toml"
    text = (
        "[server]\n"
        'listen = "127.0.0.1:0"\n'
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
    return GatewayProcess(config_path, env=env)


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
