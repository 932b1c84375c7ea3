"""A Redis Cluster of our own: three primaries and three replicas on loopback.

Every node is a ``redis-server --cluster-enabled yes`` with its own directory, config file and
``nodes.conf`` under a temporary directory, on a free loopback port with its cluster bus on
another free port (``cluster-port``: nothing depends on port + 10000 being free). The nodes run
with AOF and ``appendfsync always``, as tests.servers.RedisServer does, and are stopped by
``ClusterServers.stop`` (the fixture calls it): no system Redis, and nothing on 6379, is touched.

The cluster is made by hand, as ``redis-cli --cluster create`` makes it: a distinct config
epoch per node, the slots split in three ranges, ``CLUSTER MEET``, then ``CLUSTER REPLICATE``.
``cluster-node-timeout`` is ``NODE_TIMEOUT_MS``: a primary killed (or paused) longer than that
is failed over by its replica a few seconds later; ``cluster-replica-validity-factor 0`` lets a
replica take over however long its link has been down, so a failover never waits on luck.

What later tests and the chaos run need: ``kill``/``restart``/``pause``/``resume`` a node,
``kill_primary`` + ``wait_promoted``, ``failover`` (``CLUSTER FAILOVER`` on a replica), and a
slot migration (``migrate_slot``, or ``SlotMigration`` step by step, so a test can act while
the slot is half moved and clients get ``ASK``). Every wait polls the nodes until they say what
is waited for, with a deadline that only bounds a hang.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import redis

from tests.sentinel_servers import DATA_NODE
from tests.servers import (
    PortTaken,
    _Child,
    dies_with_us,
    free_port,
    redis_server_binary,
    wait_for_redis,
)

__all__ = ["NODE_TIMEOUT_MS", "SLOTS", "ClusterNode", "ClusterServers", "SlotMigration"]

#: How long a node may go unanswering before the others mark it failed (and its replica takes
#: over). A loaded machine can stall a healthy node for a second; this is twice that.
NODE_TIMEOUT_MS = 2_000
SLOTS = 16_384
#: Keys per ``MIGRATE`` of a slot migration, as ``redis-cli --cluster reshard`` moves them.
MIGRATE_BATCH = 100

_DATA = [
    *DATA_NODE,
    "cluster-enabled yes",
    "cluster-config-file nodes.conf",
    "cluster-replica-validity-factor 0",
    # A restarted or orphaned node stays where the test put it.
    "cluster-allow-replica-migration no",
]


class ClusterNode(_Child):
    """One cluster node: its client port and bus port, its config and ``nodes.conf``."""

    def __init__(
        self, directory: Path, name: str, node_timeout_ms: int, *, full_coverage: bool = True
    ) -> None:
        self.directory = directory / name
        self.directory.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.node_timeout_ms = node_timeout_ms
        self.full_coverage = full_coverage
        self.config_path = self.directory / "redis.conf"
        self.log_path = self.directory / "log.txt"
        self._write_config(free_port(), free_port())
        self.proc: subprocess.Popen[bytes] | None = None
        self._started = False
        #: The node's cluster id (``CLUSTER MYID``), kept across restarts by ``nodes.conf``.
        self.node_id = ""

    def _write_config(self, port: int, bus_port: int) -> None:
        self.port = port
        self.bus_port = bus_port
        self.config_path.write_text(
            "\n".join(
                [
                    f"port {self.port}",
                    f"cluster-port {self.bus_port}",
                    "bind 127.0.0.1",
                    f'dir "{self.directory}"',
                    f'logfile "{self.log_path}"',
                    f"cluster-node-timeout {self.node_timeout_ms}",
                    f"cluster-require-full-coverage {'yes' if self.full_coverage else 'no'}",
                    *_DATA,
                ]
            )
            + "\n"
        )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None

    def start(self) -> ClusterNode:
        """Start (or restart, on its ports and ``nodes.conf``) and wait until it answers. The
        ports were free when they were picked: either taken meanwhile, the first start tries
        two others (a restart keeps them: the other nodes hold its address)."""
        for _ in range(5):
            log_from = self.log_path.stat().st_size if self.log_path.exists() else 0
            self.proc = subprocess.Popen(
                dies_with_us([redis_server_binary(), str(self.config_path)]),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                wait_for_redis(self.port, self.proc, self.log_path, log_from)
            except PortTaken:
                self.proc = None
                if self._started:
                    raise
                self._write_config(free_port(), free_port())
                continue
            self._started = True
            with self.client() as client:
                self.node_id = str(client.execute_command("CLUSTER MYID"))
            return self
        raise RuntimeError(f"{self.name} found no free ports in 5 tries")

    def client(self) -> redis.Redis:
        """A plain (non-cluster) client of this node alone: it sees MOVED as an error."""
        return redis.Redis(port=self.port, decode_responses=True, socket_timeout=5)

    def info(self, section: str) -> dict[str, object]:
        with self.client() as client:
            return dict(client.info(section))

    def cluster_info(self) -> dict[str, str]:
        """``CLUSTER INFO`` (``cluster_state``, ``cluster_slots_ok``, ...)."""
        with self.client() as client:
            text = str(client.execute_command("CLUSTER", "INFO"))
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass(frozen=True)
class _View:
    """One node's ``CLUSTER NODES`` line about one node."""

    node_id: str
    port: int
    flags: frozenset[str]
    primary_id: str | None
    link_up: bool
    slots: tuple[tuple[int, int], ...]

    @property
    def is_primary(self) -> bool:
        return "master" in self.flags

    @property
    def failed(self) -> bool:
        return bool(self.flags & {"fail", "fail?", "handshake", "noaddr"})


def _parse_nodes(text: str) -> dict[str, _View]:
    views = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split()
        node_id, address, flags, primary = fields[0], fields[1], fields[2], fields[3]
        slots = []
        for item in fields[8:]:
            if item.startswith("["):  # a slot being imported or migrated
                continue
            low, _, high = item.partition("-")
            slots.append((int(low), int(high or low)))
        port = int(address.split("@")[0].rsplit(":", 1)[1] or 0)
        views[node_id] = _View(
            node_id=node_id,
            port=port,
            flags=frozenset(flags.replace("myself,", "").split(",")),
            primary_id=None if primary == "-" else primary,
            link_up=fields[7] == "connected",
            slots=tuple(slots),
        )
    return views


class ClusterServers:
    """Three primaries (``nodes[0..2]`` at first) and one replica each (``nodes[3..5]``,
    ``nodes[3+i]`` replicating ``nodes[i]``). Roles change with failovers: ask ``primaries``,
    ``replica_of`` and ``primary_of`` rather than the list order. ``full_coverage=False``
    starts every node with ``cluster-require-full-coverage no``: while a primary is down
    the others keep serving their own slots (the default answers CLUSTERDOWN everywhere)."""

    def __init__(
        self,
        directory: Path,
        *,
        node_timeout_ms: int = NODE_TIMEOUT_MS,
        primaries: int = 3,
        full_coverage: bool = True,
    ) -> None:
        self.directory = directory
        self.node_timeout_ms = node_timeout_ms
        self.nodes = [
            ClusterNode(directory, f"node{n}", node_timeout_ms, full_coverage=full_coverage)
            for n in range(2 * primaries)
        ]
        self._primaries = primaries
        #: A killed primary's id -> (its replica, its slots), for ``wait_promoted``.
        self._heirs: dict[str, tuple[ClusterNode, tuple[tuple[int, int], ...]]] = {}

    @property
    def url(self) -> str:
        """The store URL of the cluster: every node as a start-up node."""
        return "redis+cluster://" + ",".join(node.address for node in self.nodes)

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """(host, port) of every node, as redis-py's ``ClusterNode`` list wants them."""
        return [("127.0.0.1", node.port) for node in self.nodes]

    # --- making the cluster ----------------------------------------------------------------

    def start(self) -> ClusterServers:
        for node in self.nodes:
            node.start()
        primaries = self.nodes[: self._primaries]
        for epoch, node in enumerate(self.nodes, start=1):
            with node.client() as client:  # distinct epochs: no collision to settle later
                client.execute_command("CLUSTER SET-CONFIG-EPOCH", epoch)
        step = SLOTS // len(primaries)
        for n, node in enumerate(primaries):
            high = SLOTS - 1 if n == len(primaries) - 1 else (n + 1) * step - 1
            with node.client() as client:
                client.execute_command("CLUSTER ADDSLOTSRANGE", n * step, high)
        first = self.nodes[0]
        with first.client() as client:
            for node in self.nodes[1:]:
                client.execute_command("CLUSTER MEET", "127.0.0.1", node.port, node.bus_port)
        self.wait_until(self._all_known, "every node to know every other")
        for primary, replica in zip(primaries, self.nodes[self._primaries :], strict=True):
            with replica.client() as client:
                client.execute_command("CLUSTER REPLICATE", primary.node_id)
        self.wait_ok()
        return self

    def _all_known(self) -> bool:
        ids = {node.node_id for node in self.nodes}
        for node in self.nodes:
            views = self._views(node)
            if set(views) != ids or any(v.failed or not v.link_up for v in views.values()):
                return False
        return True

    # --- reading the topology --------------------------------------------------------------

    @staticmethod
    def _views(node: ClusterNode) -> dict[str, _View]:
        with node.client() as client:
            # Split, so redis-py leaves the reply as text (it parses "CLUSTER NODES").
            return _parse_nodes(str(client.execute_command("CLUSTER", "NODES")))

    def live(self) -> list[ClusterNode]:
        return [node for node in self.nodes if node.running]

    def node(self, node_id: str) -> ClusterNode:
        return next(node for node in self.nodes if node.node_id == node_id)

    def _view(self) -> dict[str, _View]:
        """The topology as the first live, answering node sees it."""
        last: Exception | None = None
        for node in self.live():
            try:
                return self._views(node)
            except redis.RedisError as exc:
                last = exc
        raise RuntimeError(f"no node answers (last error: {last})")

    def primaries(self) -> list[ClusterNode]:
        """The primaries that hold slots, as the first answering node sees them."""
        held = {v.node_id for v in self._view().values() if v.is_primary and v.slots}
        return [node for node in self.nodes if node.node_id in held]

    def replicas(self) -> list[ClusterNode]:
        return [node for node in self.live() if node not in self.primaries()]

    def replica_of(self, primary: ClusterNode) -> ClusterNode:
        views = self._view()
        return next(
            self.node(v.node_id)
            for v in views.values()
            if v.primary_id == primary.node_id and not v.failed
        )

    def primary_of(self, slot: int) -> ClusterNode:
        for view in self._view().values():
            if view.is_primary and any(low <= slot <= high for low, high in view.slots):
                return self.node(view.node_id)
        raise LookupError(f"no primary holds slot {slot}")

    def keyslot(self, key: str) -> int:
        with self.live()[0].client() as client:
            return int(client.execute_command("CLUSTER KEYSLOT", key))

    def primary_for_key(self, key: str) -> ClusterNode:
        return self.primary_of(self.keyslot(key))

    # --- waiting for a healthy cluster -----------------------------------------------------

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Until every live node says ``cluster_state:ok`` and agrees on who holds every
        slot, every slot is held by a live primary, and every live primary has a replica
        whose link is up (a killed node that is not back leaves its new primary without)."""
        self.wait_until(self._ok, "cluster_state:ok on every node, every replica attached", timeout)

    def _ok(self) -> bool:
        live = self.live()
        ids = {node.node_id for node in live}
        topologies = set()
        for node in live:
            if node.cluster_info()["cluster_state"] != "ok":
                return False
            views = self._views(node)
            held = [v for v in views.values() if v.is_primary and v.slots]
            if sum(high - low + 1 for v in held for low, high in v.slots) != SLOTS:
                return False
            if any(v.node_id not in ids or v.failed for v in held):
                return False
            if any(views[node_id].failed for node_id in ids):
                return False
            topologies.add(
                tuple(
                    sorted(
                        (v.node_id, v.primary_id or "", v.slots)
                        for v in views.values()
                        if v.node_id in ids
                    )
                )
            )
        if len(topologies) != 1:
            return False
        for node in live:
            replication = node.info("replication")
            if replication["role"] == "slave" and replication["master_link_status"] != "up":
                return False
        return True

    def wait_until(self, ready: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
        """Poll ``ready`` until it says yes (a node that does not answer is a no); after
        ``timeout`` (which only bounds a hang) raise with every node's log tail."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            try:
                if ready():
                    return
            except (redis.RedisError, OSError, StopIteration, LookupError, RuntimeError) as exc:
                last = exc
            time.sleep(0.1)
        logs = "\n".join(f"--- {n.name}\n{n.log()[-1500:]}" for n in self.nodes)
        raise TimeoutError(f"waited {timeout}s for {what} (last error: {last!r})\n{logs}")

    # --- failures --------------------------------------------------------------------------

    def kill_primary(self, primary: ClusterNode | None = None) -> ClusterNode:
        """SIGKILL a primary (the first one by default); the node, to restart later and to
        pass to ``wait_promoted``."""
        node = primary or self.primaries()[0]
        view = self._view()
        heir = next(v.node_id for v in view.values() if v.primary_id == node.node_id)
        self._heirs[node.node_id] = (self.node(heir), view[node.node_id].slots)
        node.kill()
        return node

    def wait_promoted(self, old: ClusterNode, timeout: float = 60.0) -> ClusterNode:
        """Until the replica of ``old`` (killed by ``kill_primary``) holds ``old``'s slots,
        every live node agrees and says ``cluster_state:ok``; the new primary. ``old`` stays
        out until ``restart``."""
        replica, slots = self._heirs.pop(old.node_id)

        def promoted() -> bool:
            for node in self.live():
                view = self._views(node)[replica.node_id]
                if not view.is_primary or view.slots != slots:
                    return False
            return self._ok()

        self.wait_until(promoted, f"{replica.name} to take over from {old.name}", timeout)
        return replica

    def failover(self, replica: ClusterNode, timeout: float = 60.0) -> ClusterNode:
        """``CLUSTER FAILOVER`` on ``replica`` (its primary alive: no write is lost) and wait
        until it is the primary everywhere; the old primary, now its replica."""
        old = self.node(self._view()[replica.node_id].primary_id or "")
        with replica.client() as client:
            client.execute_command("CLUSTER FAILOVER")

        def swapped() -> bool:
            for node in self.live():
                views = self._views(node)
                if not views[replica.node_id].is_primary:
                    return False
                if views[old.node_id].primary_id != replica.node_id:
                    return False
            return self._ok()

        self.wait_until(swapped, f"{replica.name} to take over from {old.name}", timeout)
        return old

    def restart(self, node: ClusterNode, timeout: float = 60.0) -> ClusterNode:
        """Start ``node`` again (same ports, data and ``nodes.conf``) and wait until the
        cluster is whole: a primary that lost its slots meanwhile comes back as a replica."""
        node.start()
        self.wait_ok(timeout)
        return node

    # --- slot migration --------------------------------------------------------------------

    def migration(self, slot: int, target: ClusterNode) -> SlotMigration:
        """A migration of ``slot`` from its primary to ``target`` (a primary), not begun."""
        return SlotMigration(self, slot, self.primary_of(slot), target)

    def migrate_slot(self, slot: int, target: ClusterNode) -> int:
        """Move ``slot`` to ``target`` whole (as ``redis-cli --cluster reshard`` does); the
        number of keys moved."""
        migration = self.migration(slot, target).begin()
        moved = 0
        while batch := migration.move_keys():
            moved += batch
        migration.finish()
        return moved

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class SlotMigration:
    """One slot's move, step by step: ``begin`` (the target IMPORTING, the source
    MIGRATING: from then on a key already moved is answered with ``ASK``), ``move_keys``
    (one ``MIGRATE`` batch), ``finish`` (``SETSLOT NODE`` on the target, the source, then
    every other primary: clients now get ``MOVED``)."""

    def __init__(
        self, cluster: ClusterServers, slot: int, source: ClusterNode, target: ClusterNode
    ) -> None:
        if source is target:
            raise ValueError(f"slot {slot} is on {target.name} already")
        self.cluster = cluster
        self.slot = slot
        self.source = source
        self.target = target

    def begin(self) -> SlotMigration:
        with self.target.client() as client:
            client.execute_command("CLUSTER SETSLOT", self.slot, "IMPORTING", self.source.node_id)
        with self.source.client() as client:
            client.execute_command("CLUSTER SETSLOT", self.slot, "MIGRATING", self.target.node_id)
        return self

    def move_keys(self, batch: int = MIGRATE_BATCH) -> int:
        """``MIGRATE`` up to ``batch`` of the slot's keys still on the source; how many."""
        with self.source.client() as client:
            keys = client.execute_command("CLUSTER GETKEYSINSLOT", self.slot, batch)
            if keys:
                client.execute_command(
                    "MIGRATE", "127.0.0.1", self.target.port, "", 0, 10_000, "KEYS", *keys
                )
        return len(keys)

    def finish(self) -> None:
        """``SETSLOT NODE`` everywhere (target first, so the slot is never ownerless to it),
        then wait until every live node places the slot on the target."""
        others = [n for n in self.cluster.primaries() if n not in (self.source, self.target)]
        for node in [self.target, self.source, *others]:
            with node.client() as client:
                client.execute_command("CLUSTER SETSLOT", self.slot, "NODE", self.target.node_id)

        def placed() -> bool:
            return all(
                self.slot in _expand(self.cluster._views(node)[self.target.node_id].slots)
                for node in self.cluster.live()
            )

        self.cluster.wait_until(
            placed, f"every node to place slot {self.slot} on {self.target.name}"
        )


def _expand(ranges: Iterable[tuple[int, int]]) -> set[int]:
    return {slot for low, high in ranges for slot in range(low, high + 1)}
