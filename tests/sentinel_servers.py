"""A Redis Sentinel deployment of our own: one master, two replicas, three sentinels.

Every process listens on a free loopback port, has its own config file and data directory
under a temporary directory, and is stopped by ``SentinelCluster.stop`` (the fixture calls
it): no system Redis, and nothing on 6379, is ever touched. The replicas and the master run
with AOF and ``appendfsync always`` (as tests.servers.RedisServer does), so ``/readyz`` of a
gateway with ``store.require_durable`` passes on whichever is promoted.

The sentinels watch ``mymaster`` with quorum 2, ``down-after-milliseconds`` 1000 and
``failover-timeout`` 5000: after ``kill_master`` a replica is promoted in a few seconds.

``SentinelCluster(directory, relay=True)`` puts a ``MasterRelay`` in front of the first master:
everyone (replicas, sentinels, gateways) reaches it through the relay's port, and
``cut_replication`` stops the master's replication stream there, so the replicas fall behind
while the master goes on answering writes: a failover then loses them, as a slow or
partitioned replica link makes it lose them in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import threading
import time
from pathlib import Path

import redis

from tests.servers import (
    PortTaken,
    _Child,
    dies_with_us,
    free_port,
    redis_server_binary,
    wait_for_redis,
)

__all__ = ["MASTER_NAME", "MasterRelay", "SentinelCluster"]

MASTER_NAME = "mymaster"
DOWN_AFTER_MS = 1_000
FAILOVER_TIMEOUT_MS = 5_000


class _Node(_Child):
    """One redis-server process (data node or sentinel) started from its own config file."""

    def __init__(self, directory: Path, name: str, lines: list[str], *, sentinel: bool) -> None:
        self.directory = directory / name
        self.directory.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.sentinel = sentinel
        self.lines = lines
        self.config_path = self.directory / ("sentinel.conf" if sentinel else "redis.conf")
        self.log_path = self.directory / "log.txt"
        self._write_config(free_port())
        self.proc: subprocess.Popen[bytes] | None = None
        self._started = False

    def _write_config(self, port: int) -> None:
        self.port = port
        self.config_path.write_text(
            "\n".join(
                [
                    f"port {self.port}",
                    "bind 127.0.0.1",
                    f'dir "{self.directory}"',
                    f'logfile "{self.log_path}"',
                    *self.lines,
                ]
            )
            + "\n"
        )

    def start(self) -> _Node:
        """Start (or restart, on its port) and wait until it answers. The port was free when
        it was picked: taken meanwhile, the first start tries another one."""
        for _ in range(5):
            args = [redis_server_binary(), str(self.config_path)]
            if self.sentinel:
                args.append("--sentinel")
            log_from = self.log_path.stat().st_size if self.log_path.exists() else 0
            self.proc = subprocess.Popen(
                dies_with_us(args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            try:
                wait_for_redis(self.port, self.proc, self.log_path, log_from)
            except PortTaken:
                self.proc = None
                if self._started:
                    raise
                self._write_config(free_port())
                continue
            self._started = True
            return self
        raise RuntimeError(f"{self.name} found no free port in 5 tries")

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, decode_responses=True, socket_timeout=2)

    def log(self) -> str:
        path = self.directory / "log.txt"
        return path.read_text(errors="replace") if path.exists() else ""


class MasterRelay:
    """``127.0.0.1:port`` -> the master, on its own event loop in a thread (the cluster's
    helpers are synchronous). A connection that sends ``PSYNC``/``SYNC`` is a replica's
    replication link; once ``cut_replication`` is called, what the master sends on such links
    is dropped (the replica's link stays up and silent, the master's answers to everyone else
    pass). When the master dies, every connection through the relay is closed."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.cut = False
        #: Bytes of replication stream dropped since the cut: the writes the replicas miss.
        self.dropped = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> MasterRelay:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, "127.0.0.1", 0), self._loop
        ).result(timeout=10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def cut_replication(self) -> None:
        self.cut = True

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        replication = [False]

        async def upstream() -> None:
            while chunk := await reader.read(65_536):
                if b"\r\nPSYNC\r\n" in chunk or b"\r\nSYNC\r\n" in chunk:
                    replication[0] = True
                up_writer.write(chunk)
                await up_writer.drain()

        async def downstream() -> None:
            while chunk := await up_reader.read(65_536):
                if replication[0] and self.cut:
                    self.dropped += len(chunk)
                    continue
                writer.write(chunk)
                await writer.drain()

        pipes = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pipe in pipes:
                pipe.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            for end in (writer, up_writer):
                end.close()
                with contextlib.suppress(OSError, asyncio.CancelledError):
                    await end.wait_closed()

    def stop(self) -> None:
        if self._server is not None:
            server = self._server

            async def close() -> None:
                server.close()
                for task in asyncio.all_tasks():
                    if task is not asyncio.current_task():
                        task.cancel()

            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=5)
            self._server = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()


#: A durable data node's config (the cluster nodes of tests/cluster_servers.py add theirs).
DATA_NODE = [
    'save ""',
    "appendonly yes",
    "appendfsync always",
    "maxmemory-policy noeviction",
    "repl-diskless-sync no",
    "repl-diskless-sync-delay 0",
]


class SentinelCluster:
    """The master (``data[0]`` at first), two replicas and three sentinels."""

    def __init__(
        self, directory: Path, *, relay: bool = False, down_after_ms: int = DOWN_AFTER_MS
    ) -> None:
        self.directory = directory
        #: A loaded machine can leave a master unanswering this long: the chaos run asks
        #: for more, or a freshly promoted master is judged down and failed over again.
        self.down_after_ms = down_after_ms
        self.data: list[_Node] = []
        self.sentinels: list[_Node] = []
        self.with_relay = relay
        self.relay: MasterRelay | None = None

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{MASTER_NAME}/0"

    def start(self) -> SentinelCluster:
        master = _Node(self.directory, "master", list(DATA_NODE), sentinel=False)
        self.data.append(master.start())
        master_port = master.port
        if self.with_relay:
            self.relay = MasterRelay(master.port).start()
            master_port = self.relay.port
        for n in (1, 2):
            lines = [*DATA_NODE, f"replicaof 127.0.0.1 {master_port}"]
            self.data.append(_Node(self.directory, f"replica{n}", lines, sentinel=False).start())
        self._wait(lambda: self._replicas_online(master) == 2, "the replicas to sync")
        for n in (1, 2, 3):
            lines = [
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2",
                f"sentinel down-after-milliseconds {MASTER_NAME} {self.down_after_ms}",
                f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}",
                f"sentinel parallel-syncs {MASTER_NAME} 2",
            ]
            self.sentinels.append(
                _Node(self.directory, f"sentinel{n}", lines, sentinel=True).start()
            )
        self._wait(self._sentinels_agree, "the sentinels to see each other and the replicas")
        return self

    def master_port(self) -> int | None:
        """The master's port as the first sentinel that answers says."""
        for sentinel in self.sentinels:
            try:
                with sentinel.client() as client:
                    addr = client.sentinel_get_master_addr_by_name(MASTER_NAME)
            except redis.RedisError:
                continue
            if addr:
                return int(addr[1])
        return None

    def master(self) -> _Node:
        return self._node_at(self.master_port())

    def _node_at(self, port: int | None) -> _Node:
        if self.relay is not None and port == self.relay.port:
            return self.data[0]
        return next(node for node in self.data if node.port == port)

    def kill_master(self) -> int:
        """SIGKILL the current master; its port (as the sentinels name it)."""
        port = self.master_port()
        self._node_at(port).kill()
        assert port is not None
        return port

    def wait_promoted(self, old_port: int, timeout: float = 30.0) -> int:
        """Until every sentinel names a new master that says it is one; its port."""

        def promoted() -> bool:
            ports = set()
            for sentinel in self.sentinels:
                with sentinel.client() as client:
                    addr = client.sentinel_get_master_addr_by_name(MASTER_NAME)
                ports.add(int(addr[1]) if addr else None)
            if len(ports) != 1 or old_port in ports or None in ports:
                return False
            (port,) = ports
            with self._node_at(port).client() as client:
                return bool(client.info("replication")["role"] == "master")

        self._wait(promoted, "a replica to be promoted", timeout)
        port = self.master_port()
        assert port is not None
        return port

    def wait_replicas(self, count: int, timeout: float = 30.0) -> None:
        """Until the current master has ``count`` replicas online."""
        self._wait(lambda: self._replicas_online(self.master()) >= count, "replicas", timeout)

    @staticmethod
    def _replicas_online(master: _Node) -> int:
        with master.client() as client:
            info = client.info("replication")
        return sum(
            1
            for key, value in info.items()
            if key.startswith("slave") and isinstance(value, dict) and value["state"] == "online"
        )

    def _sentinels_agree(self) -> bool:
        for sentinel in self.sentinels:
            with sentinel.client() as client:
                state = client.sentinel_master(MASTER_NAME)
            if int(state["num-other-sentinels"]) < 2 or int(state["num-slaves"]) < 2:
                return False
        return True

    def _wait(self, ready: object, what: str, timeout: float = 30.0) -> None:
        assert callable(ready)
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            try:
                if ready():
                    return
            except (redis.RedisError, OSError, StopIteration) as exc:
                last = exc
            time.sleep(0.1)
        logs = "\n".join(f"--- {n.name}\n{n.log()[-1500:]}" for n in self.data + self.sentinels)
        raise TimeoutError(f"waited {timeout}s for {what} (last error: {last})\n{logs}")

    def stop(self) -> None:
        for node in [*self.sentinels, *self.data]:
            node.stop()
        if self.relay is not None:
            self.relay.stop()
