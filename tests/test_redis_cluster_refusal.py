"""A ``redis://`` URL that reaches a Redis Cluster node is refused at start-up, naming
``redis+cluster://`` (issue 30): a plain client follows no ``MOVED``, so a store on it would
fail on every key of another node's slots. The store, ``fencegate serve``, ``serve --check``
and ``store migrate`` all refuse it before writing a key, on the real cluster of
tests.cluster_servers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fencegate.ledger.errors import StoreIncompatible
from fencegate.ledger.redis_store import RedisStore
from fencegate.ledger.tasks import LeasePolicy
from tests.cluster_servers import ClusterNode, ClusterServers
from tests.servers import write_gateway_config


def refusal(node: ClusterNode) -> str:
    return (
        f"the Redis at 127.0.0.1:{node.port} is a cluster node (cluster_enabled:1): "
        "use a redis+cluster:// URL"
    )


def untouched(cluster: ClusterServers, key_prefix: str) -> bool:
    for node in cluster.primaries():
        with node.client() as plain:
            if plain.keys(f"{key_prefix}*"):
                return False
    return True


@pytest.mark.parametrize("role", ["primary", "replica"])
async def test_the_store_refuses_a_cluster_node_behind_redis_url(
    redis_cluster: ClusterServers, key_prefix: str, role: str
) -> None:
    primary = redis_cluster.primaries()[0]
    node = primary if role == "primary" else redis_cluster.replica_of(primary)
    store = RedisStore(
        f"redis://127.0.0.1:{node.port}/0",
        LeasePolicy(max_ttl_ms=60_000, default_max_runtime_ms=600_000),
        key_prefix=key_prefix,
    )
    try:
        with pytest.raises(StoreIncompatible) as refused:
            await store.open()
        assert refusal(node) in refused.value.detail
        with pytest.raises(StoreIncompatible, match="redis\\+cluster://"):
            await store.migrate()
    finally:
        await store.close()
    assert untouched(redis_cluster, key_prefix)


def test_serve_check_and_store_migrate_refuse_it(
    redis_cluster: ClusterServers, key_prefix: str, tmp_path: Path
) -> None:
    node = redis_cluster.primaries()[1]
    config = tmp_path / "fencegate.toml"
    config.write_text(
        f"[store]\nurl = {json.dumps(f'redis://127.0.0.1:{node.port}/0')}\n"
        f"redis_key_prefix = {json.dumps(key_prefix)}\n"
    )
    for command in (["serve", "--check"], ["store", "migrate"]):
        run = subprocess.run(
            [sys.executable, "-m", "fencegate.gateway.cli", *command, "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 1, (command, run.stdout, run.stderr)
        assert refusal(node) in run.stderr, (command, run.stderr)
    assert untouched(redis_cluster, key_prefix)


def test_the_gateway_does_not_start_on_it(
    redis_cluster: ClusterServers, key_prefix: str, tmp_path: Path
) -> None:
    """Unlike a store that is down (the gateway starts and /readyz waits for it), waiting
    would not help: ``fencegate serve`` exits, and its log says why."""
    node = redis_cluster.primaries()[2]
    gateway = write_gateway_config(
        tmp_path / "gw", f"redis://127.0.0.1:{node.port}/0", key_prefix=key_prefix
    )
    with pytest.raises(RuntimeError, match="gateway did not start") as failed:
        gateway.start()
    assert refusal(node) in str(failed.value)
    assert gateway.proc is not None and gateway.proc.wait(timeout=30) != 0
