"""Stores by URL scheme: the factory that picks a store from ``store.url``.

Like limits' storage registry: a store module declares ``STORE_KIND`` (a
``ledger.store.StoreKind``: its schemes, its URL check, its factory) and is registered here
once, by module name, so adding a store touches its own module and one line of ``_BUILTIN``,
not the app factory nor the config validator (both ask this module). Built-in store modules
are imported on first use only, so a gateway on SQLite never imports the Redis driver, and
no store module imports this one (no import cycle: registry -> stores -> ``ledger.store``).
Code outside fencegate (a plug-in store, a test double) may call ``register`` instead.
"""

from __future__ import annotations

import importlib

from fencegate.ledger.store import Store, StoreKind, StoreOptions
from fencegate.ledger.tasks import LeasePolicy

__all__ = ["check_url", "kind_for", "open_store", "register", "schemes"]

#: The built-in stores: scheme -> the module whose ``STORE_KIND`` serves it.
_BUILTIN: dict[str, str] = {
    "sqlite": "fencegate.ledger.sqlite_store",
    "redis": "fencegate.ledger.redis_store",
    "rediss": "fencegate.ledger.redis_store",
    "unix": "fencegate.ledger.redis_store",
    "redis+sentinel": "fencegate.ledger.redis_store",
    # ledger.cluster_router.CLUSTER_SCHEMES (not imported: it would load the Redis driver)
    "redis+cluster": "fencegate.ledger.cluster_store",
    "rediss+cluster": "fencegate.ledger.cluster_store",
    "postgresql": "fencegate.ledger.postgres_store",
    "postgres": "fencegate.ledger.postgres_store",
}
_KINDS: dict[str, StoreKind] = {}


def register(kind: StoreKind) -> None:
    """Serve ``kind.schemes`` with ``kind`` (replacing any earlier registration)."""
    for scheme in kind.schemes:
        _KINDS[scheme] = kind


def schemes() -> tuple[str, ...]:
    """Every scheme a store URL may use, sorted."""
    return tuple(sorted({*_BUILTIN, *_KINDS}))


def _scheme(url: str) -> str:
    scheme, sep, _ = url.partition("://")
    return scheme.lower() if sep else ""


def _load(scheme: str) -> StoreKind | None:
    kind = _KINDS.get(scheme)
    if kind is None and scheme in _BUILTIN:
        module = importlib.import_module(_BUILTIN[scheme])
        declared: StoreKind = module.STORE_KIND
        if scheme not in declared.schemes:
            raise RuntimeError(f"{_BUILTIN[scheme]}.STORE_KIND does not serve {scheme}://")
        register(declared)
        kind = declared
    return kind


def _examples() -> str:
    seen: list[str] = []
    for scheme in dict.fromkeys([*_BUILTIN, *_KINDS]):  # registration order
        kind = _load(scheme)
        if kind is not None and kind.example not in seen:
            seen.append(kind.example)
    return " or ".join(seen)


def kind_for(url: str) -> StoreKind:
    """The store kind that serves ``url``; ValueError naming the known forms otherwise."""
    kind = _load(_scheme(url))
    if kind is None:
        raise ValueError(f"unsupported store url {url!r}: expected {_examples()}")
    return kind


def check_url(url: str) -> None:
    """Raise ValueError (saying what to write instead) unless some store can use ``url``.
    The config validator of ``store.url`` calls this, so a bad URL fails at start-up."""
    kind = _load(_scheme(url))
    if kind is None:
        raise ValueError(f"expected {_examples()}")
    kind.check_url(url)


def open_store(
    url: str,
    policy: LeasePolicy,
    *,
    timeout_ms: int,
    sqlite_synchronous: str = "FULL",
    redis_key_prefix: str = "fg",
    password: str | None = None,
    redis_max_connections: int = 200,
    postgres_max_connections: int = 20,
    max_dependents: int = 1_000,
    max_cascade: int = 1_000,
    redis_min_replicas: int = 0,
    redis_replica_timeout_ms: int = 500,
    cluster_buckets: int = 256,
    cluster_queue_rescan_ms: int = 1_000,
) -> Store:
    """Build (not yet open) the store a URL names: ``sqlite:///rel.db``,
    ``sqlite:////abs.db``, ``redis://host:port/db`` (``rediss://`` for TLS,
    ``redis+sentinel://h1:26379,h2:26379/mymaster/0`` through Sentinel),
    ``redis+cluster://h1:7000,h2:7001`` (``rediss+cluster://`` for TLS; ``cluster_buckets``
    buckets), ``postgresql://user@host:port/db``, or any scheme
    registered with ``register``."""
    kind = kind_for(url)
    kind.check_url(url)
    options = StoreOptions(
        timeout_ms=timeout_ms,
        sqlite_synchronous=sqlite_synchronous,
        redis_key_prefix=redis_key_prefix,
        password=password,
        redis_max_connections=redis_max_connections,
        postgres_max_connections=postgres_max_connections,
        max_dependents=max_dependents,
        max_cascade=max_cascade,
        redis_min_replicas=redis_min_replicas,
        redis_replica_timeout_ms=redis_replica_timeout_ms,
        cluster_buckets=cluster_buckets,
        cluster_queue_rescan_ms=cluster_queue_rescan_ms,
    )
    return kind.create(url, policy, options)
