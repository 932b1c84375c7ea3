"""Stores register by URL scheme (ledger/registry.py): the config validator and the app
factory ask the registry, so a new store touches its own module and one registration."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fencegate.gateway.app import build_store
from fencegate.gateway.config import ConfigError, load_config
from fencegate.ledger import registry
from fencegate.ledger.redis_store import RedisStore
from fencegate.ledger.sqlite_store import SQLiteStore
from fencegate.ledger.store import Store, StoreKind, StoreOptions
from fencegate.ledger.tasks import LeasePolicy

POLICY = LeasePolicy(max_ttl_ms=60_000, default_max_runtime_ms=600_000)


def _config(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "fencegate.toml"
    path.write_text(f'[store]\nurl = "{url}"\n')
    return path


def test_the_built_in_schemes_open_their_stores(tmp_path: Path) -> None:
    assert {"sqlite", "redis", "rediss", "unix"} <= set(registry.schemes())
    sqlite = registry.open_store(f"sqlite:///{tmp_path / 'a.db'}", POLICY, timeout_ms=100)
    assert isinstance(sqlite, SQLiteStore) and sqlite.path == str(tmp_path / "a.db")
    redis = registry.open_store("redis://127.0.0.1:1/0", POLICY, timeout_ms=100)
    assert isinstance(redis, RedisStore)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql://db/x", "store.url: expected sqlite:///PATH or redis://HOST:PORT/DB"),
        ("sqlite:///", "store.url: sqlite URL needs a path"),
    ],
)
def test_the_config_asks_the_registry(tmp_path: Path, url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(_config(tmp_path, url))
    with pytest.raises(ValueError, match=re.escape(message.removeprefix("store.url: "))):
        registry.open_store(url, POLICY, timeout_ms=100)


def test_a_registered_store_needs_no_change_to_the_config_or_the_app(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[tuple[str, StoreOptions]] = []

    def create(url: str, policy: LeasePolicy, options: StoreOptions) -> Store:
        built.append((url, options))
        return SQLiteStore(str(tmp_path / "mem.db"), policy)

    def check(url: str) -> None:
        if url == "mem://":
            raise ValueError("mem URL needs a name")

    monkeypatch.setattr(registry, "_KINDS", dict(registry._KINDS))
    registry.register(StoreKind(("mem",), "mem://NAME", check, create))
    config = load_config(_config(tmp_path, "mem://one"))
    assert config.store.url == "mem://one"
    with pytest.raises(ConfigError, match=r"store\.url: mem URL needs a name"):
        load_config(_config(tmp_path, "mem://"))
    with pytest.raises(ConfigError, match="or mem://NAME"):
        load_config(_config(tmp_path, "nope://x"))
    assert isinstance(build_store(config), SQLiteStore)
    assert built == [("mem://one", StoreOptions(timeout_ms=config.store.timeout_ms))]
