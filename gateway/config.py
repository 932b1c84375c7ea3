"""Configuration: frozen pydantic models mirroring ``config.example.toml``, validated once.

Unknown keys are errors (a typo must not silently fall back to a default), and every error
names the key (``store.timeout_ms``, ``downstreams[1].url``). Secrets never live in the file:
a key ending in ``_env`` names the environment variable that holds the secret.
"""

from __future__ import annotations

import ipaddress
import os
import re
import string
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fencegate.ledger.buckets import check_buckets
from fencegate.ledger.effects import DEFAULT_SETTLE_MS
from fencegate.ledger.requests import MAX_KEEP_BYTES, Pointer, parse_pointer

__all__ = [
    "OAUTH_PREFIX",
    "ROLES",
    "AuthConfig",
    "AuthReloadError",
    "Config",
    "ConfigError",
    "ConsoleConfig",
    "DownstreamConfig",
    "EventsConfig",
    "LeasesConfig",
    "LoggingConfig",
    "OAuthConfig",
    "OAuthProfileConfig",
    "OutcomesConfig",
    "PrincipalConfig",
    "ProbeConfig",
    "ProxyConfig",
    "ReconcilerConfig",
    "RetentionConfig",
    "Role",
    "ServerConfig",
    "StoreConfig",
    "TasksConfig",
    "is_loopback",
    "load_auth",
    "load_config",
    "parse_listen",
    "public_url",
    "with_listen",
    "with_workers",
]

# Bounds on everything a config file controls, so a typo cannot make the gateway absurd.
_MINUTE_MS = 60_000
_DAY_MS = 24 * 60 * _MINUTE_MS


class ConfigError(Exception):
    """A config file that cannot be used; the message names the file and the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port). Port 0 asks the system for a free port when the
    gateway binds (``gateway.listening`` names the one it got): tests and anything else
    that must not pick a port and bind it later."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


def with_listen(config: Config, listen: str) -> Config:
    """``config`` listening on ``listen`` (``serve --listen``), validated again as a whole."""
    data = config.model_dump(exclude_unset=True)
    data["server"] = {**data.get("server", {}), "listen": listen}
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"--listen {listen}: {_describe(exc, data)}") from exc


def with_workers(config: Config, workers: int) -> Config:
    """``config`` with ``workers`` worker processes (``serve --workers``), validated again as a
    whole (a SQLite store refuses more than one)."""
    data = config.model_dump(exclude_unset=True)
    data["server"] = {**data.get("server", {}), "workers": workers}
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"--workers {workers}: {_describe(exc, data)}") from exc


def is_loopback(host: str) -> bool:
    """``host`` (as ``parse_listen`` returns it) only accepts connections from this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: ``name`` or ``name:port``; a name is a DNS name, an IPv4 address or a bracketed IPv6 one.
_HOST_ENTRY = re.compile(
    r"(\[[0-9a-f:.]{2,45}\]|[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?)(:[0-9]{1,5})?"
)
_ORIGIN_ENTRY = re.compile(r"https?://[^/?#@\s]+")


class ServerConfig(_Section):
    listen: str = "127.0.0.1:8700"
    #: Largest request body the gateway reads at all (coordination API and proxied calls).
    max_body_bytes: Annotated[int, Field(ge=1024, le=256 * 1024 * 1024)] = 1024 * 1024
    #: Start without ``[auth]`` on a non-loopback ``listen`` (refused otherwise).
    allow_unauthenticated: bool = False
    #: Browser origins whose requests are served (any other ``Origin`` is 403 FORBIDDEN).
    #: None: the gateway's own, http://{listen host, localhost, 127.0.0.1, [::1]}:{port}.
    allowed_origins: Annotated[tuple[str, ...], Field(strict=False, max_length=100)] | None = None
    #: ``Host`` values served (``name`` matches any port, ``name:port`` that port only); any
    #: other is 421 MISDIRECTED_REQUEST. None: the listen host, localhost, 127.0.0.1 and
    #: [::1]; required when ``listen`` is not a loopback address.
    allowed_hosts: Annotated[tuple[str, ...], Field(strict=False, max_length=100)] | None = None
    #: Longest time a request body may take to arrive, from the end of its headers: 408 past it.
    body_timeout_ms: Annotated[int, Field(ge=100, le=10 * _MINUTE_MS)] = 30_000
    #: A connection with no complete request for this long is closed (also one whose request
    #: line and headers never finish).
    idle_timeout_ms: Annotated[int, Field(ge=1_000, le=60 * _MINUTE_MS)] = 75_000
    #: Open client connections; past it a new connection is answered 503 and closed.
    max_connections: Annotated[int, Field(ge=1, le=100_000)] = 500
    #: Open connections from one peer address that have not yet carried an authenticated
    #: request (without ``[auth]``: a complete request); past it a new one from that address
    #: is answered 503 and closed. Behind a reverse proxy the peer is the proxy.
    max_connections_per_peer: Annotated[int, Field(ge=1, le=100_000)] = 50
    #: Open connections that last carried one principal's authenticated requests; past it
    #: that principal's request on another connection is answered 503 and the connection
    #: closed, so one token cannot hold every slot with idle keep-alives. Default: half of
    #: max_connections (at least 1). At most max_connections. Without [auth]: not applied.
    max_connections_per_principal: Annotated[int, Field(ge=1, le=100_000)] | None = None
    #: TLS (docs/security.md, "mTLS"): PEM certificate chain and private key; with both the
    #: listener speaks HTTPS only (TLS 1.2+). A relative path is from the working directory.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    #: PEM CA certificate(s): every client must present a certificate they signed
    #: (ssl.CERT_REQUIRED), and principals may be identified by its CN (``certificate_cn``).
    #: Needs tls_cert_file and tls_key_file. Only these CAs are trusted, never the system's.
    tls_client_ca_file: str | None = None
    #: Worker processes serving ``listen`` (``serve --workers``): one supervisor forks them,
    #: restarts one that dies, and drains them all on SIGTERM (docs/serve.md). More than one
    #: needs a store several processes share (Redis, PostgreSQL) and Linux (SO_REUSEPORT).
    workers: Annotated[int, Field(ge=1, le=64)] = 1
    #: The event loop of ``serve``: ``uvloop`` (less CPU per call; must be installed),
    #: ``asyncio`` (the standard library's), ``auto`` (uvloop where it is installed).
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        parse_listen(value)
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        out = tuple(entry.lower() for entry in value)
        for entry in out:
            if not _HOST_ENTRY.fullmatch(entry):
                raise ValueError(
                    f"{entry!r} is not a host name, address or [IPv6] (optionally :port)"
                )
        return out

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        out = tuple(entry.lower().rstrip("/") for entry in value)
        for entry in out:
            if not _ORIGIN_ENTRY.fullmatch(entry):
                raise ValueError(f"{entry!r} is not an origin (http[s]://host[:port], no path)")
        return out

    @field_validator("tls_cert_file", "tls_key_file", "tls_client_ca_file")
    @classmethod
    def _readable(cls, value: str | None) -> str | None:
        if value is not None and not (Path(value).is_file() and os.access(value, os.R_OK)):
            raise ValueError(f"{value!r} is not a readable file")
        return value

    @model_validator(mode="after")
    def _tls_pairs(self) -> ServerConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            given, needed = (
                ("tls_cert_file", "tls_key_file")
                if self.tls_key_file is None
                else ("tls_key_file", "tls_cert_file")
            )
            raise ValueError(f"{given} needs {needed} (both or neither)")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError(
                "tls_client_ca_file needs tls_cert_file and tls_key_file (client certificates "
                "are only asked for over TLS)"
            )
        if self.principal_connection_limit > self.max_connections:
            raise ValueError(
                f"max_connections_per_principal ({self.principal_connection_limit}) must be "
                f"at most max_connections ({self.max_connections})"
            )
        return self

    @property
    def principal_connection_limit(self) -> int:
        """``max_connections_per_principal``, or its default."""
        if self.max_connections_per_principal is not None:
            return self.max_connections_per_principal
        return max(1, self.max_connections // 2)

    @property
    def tls(self) -> bool:
        """The listener speaks HTTPS."""
        return self.tls_cert_file is not None

    @model_validator(mode="after")
    def _hosts_beyond_loopback(self) -> ServerConfig:
        if self.allowed_hosts is None and not is_loopback(parse_listen(self.listen)[0]):
            raise ValueError(
                f"allowed_hosts is required when listen ({self.listen}) is not a loopback "
                "address: list the names clients use to reach the gateway"
            )
        return self


class StoreConfig(_Section):
    url: str = "sqlite:///fencegate.db"
    #: Longest a request waits for the store before answering 503 STORE_UNAVAILABLE.
    timeout_ms: Annotated[int, Field(ge=10, le=_MINUTE_MS)] = 2000
    #: SQLite only. FULL survives power loss; NORMAL may lose the last transactions on power
    #: loss (never on a process crash). See docs/stores.md.
    sqlite_synchronous: Literal["FULL", "NORMAL"] = "FULL"
    #: Redis only: prefix of every key fencegate writes.
    redis_key_prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")] = "fg"
    #: Redis and PostgreSQL: /readyz fails while the store's settings could lose an answered
    #: claim or effect record (Redis: appendonly=yes, appendfsync=always,
    #: maxmemory-policy=noeviction; PostgreSQL: fsync, synchronous_commit; docs/stores.md).
    require_durable: bool = True
    #: Redis only: connections per gateway process; a request waits (up to timeout_ms) for a
    #: free one rather than failing.
    redis_max_connections: Annotated[int, Field(ge=1, le=10_000)] = 200
    #: PostgreSQL only: connections per gateway process (a bounded pool; a request waits up
    #: to timeout_ms for a free one). Keep gateways x this below the server's max_connections.
    postgres_max_connections: Annotated[int, Field(ge=1, le=1_000)] = 20
    #: Redis and PostgreSQL: name of the environment variable holding the store's password
    #: (a password written in a PostgreSQL or redis+sentinel URL is refused).
    password_env: str | None = None
    #: Redis only: replicas that must acknowledge each write step (``WAIT N``) before it is
    #: answered; fewer within redis_replica_timeout_ms answers 503 "may have been applied".
    #: 0: no WAIT (replication stays asynchronous). docs/stores.md, "High availability".
    redis_min_replicas: Annotated[int, Field(ge=0, le=16)] = 0
    #: Redis only: how long that WAIT waits for them; below timeout_ms.
    redis_replica_timeout_ms: Annotated[int, Field(ge=1, le=_MINUTE_MS)] = 500
    #: redis+cluster:// only: the number of buckets (one hash slot each) the keys are spread
    #: over. Recorded when the store is created; a different value later is a start-up error
    #: (changing it is a ``fencegate store copy``). docs/stores.md, "Redis Cluster".
    cluster_buckets: int = 256
    #: redis+cluster:// only: how old (store ms) a queue's hint of buckets may be before a
    #: queue claim rebuilds it from every bucket: the longest a task whose gateway died
    #: between its step and the hint's update stays unseen by queue claims (by id: never),
    #: and each queue claimed from costs one read per bucket this often. docs/decisions.md,
    #: "Queues: an index per bucket, a hint per queue".
    cluster_queue_rescan_ms: Annotated[int, Field(ge=100, le=_MINUTE_MS)] = 1_000

    @model_validator(mode="after")
    def _replica_timeout_within_timeout(self) -> StoreConfig:
        if self.redis_min_replicas and self.redis_replica_timeout_ms >= self.timeout_ms:
            raise ValueError(
                f"redis_replica_timeout_ms ({self.redis_replica_timeout_ms}) must be below "
                f"timeout_ms ({self.timeout_ms}): the WAIT after a write step is part of it"
            )
        return self

    @field_validator("cluster_buckets")
    @classmethod
    def _cluster_buckets(cls, value: int) -> int:
        return check_buckets(value)  # its errors name this key

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        # Each store checks its own URLs (ledger.registry): a new store needs no change here.
        from fencegate.ledger.registry import check_url

        check_url(value)
        return value

    def password(self) -> str | None:
        if self.password_env is None:
            return None
        return os.environ[self.password_env]


class LeasesConfig(_Section):
    #: A claim or renew asking for more is granted this much (the answer shows what it got).
    max_ttl_ms: Annotated[int, Field(ge=100, le=_DAY_MS)] = 5 * _MINUTE_MS
    #: Renewals never run past attempt start + this, unless the task sets maxRuntimeMs.
    default_max_runtime_ms: Annotated[int, Field(ge=100, le=30 * _DAY_MS)] = 60 * _MINUTE_MS
    #: The largest maxRuntimeMs a task may ask for.
    max_runtime_ms_limit: Annotated[int, Field(ge=100, le=365 * _DAY_MS)] = 7 * _DAY_MS
    #: The largest ``result`` a commit may store, as canonical JSON bytes.
    max_result_bytes: Annotated[int, Field(ge=0, le=16 * 1024 * 1024)] = 64 * 1024

    @model_validator(mode="after")
    def _runtime_within_limit(self) -> LeasesConfig:
        if self.default_max_runtime_ms > self.max_runtime_ms_limit:
            raise ValueError("default_max_runtime_ms must not exceed max_runtime_ms_limit")
        return self


class ProxyConfig(_Section):
    #: A PREPARED record's deadline is the downstream's timeout_ms plus this margin; past it
    #: the forward cannot still be running and the effect reads as UNKNOWN.
    prepared_margin_ms: Annotated[int, Field(ge=2, le=10 * _MINUTE_MS)] = 5_000
    #: The longest time from sending a prepare to the store to the forward's first byte
    #: (store answer, pool wait, connect). Past it nothing is sent: the prepare is aborted
    #: and the agent gets 503. It bounds how late a forward can start after a bump or cancel
    #: was acknowledged. Default: half the margin, at most 1000. Must be below the margin
    #: (docs/decisions.md, "At most once").
    forward_start_limit_ms: Annotated[int, Field(ge=1, le=_MINUTE_MS)] | None = None
    #: Most pooled connections to all downstreams together.
    max_connections: Annotated[int, Field(ge=1, le=10_000)] = 200
    #: Most of them that MCP ``GET`` streams may hold at once (one more is 503
    #: DOWNSTREAM_BUSY), so long-lived streams never take the forwards' connections. Default:
    #: half of max_connections (at least 1). At most max_connections.
    max_stream_connections: Annotated[int, Field(ge=1, le=10_000)] | None = None
    #: Most of those streams one principal may hold (one more is 503 DOWNSTREAM_BUSY), so one
    #: worker cannot take every place. Default: half of the stream places (at least 1). At
    #: most max_stream_connections. Without [auth] there are no principals: not applied.
    max_streams_per_principal: Annotated[int, Field(ge=1, le=10_000)] | None = None
    #: The longest a duplicate of an in-flight effect that sends ``Prefer: wait=N`` (on MCP
    #: ``_meta["dev.fencegate/wait"]``) waits for the first call's outcome: N is cut to it,
    #: and the answer says the wait applied (``Preference-Applied``). 0: never wait.
    max_prefer_wait_ms: Annotated[int, Field(ge=0, le=10 * _MINUTE_MS)] = 10_000
    #: enforce: refusals are answered. shadow: every check runs and is recorded (log and
    #: fencegate_shadow_rejections_total), but the call is forwarded anyway. Per downstream
    #: too (``enforcement`` in its table).
    enforcement: Literal["enforce", "shadow"] = "enforce"

    @property
    def stream_limit(self) -> int:
        """``max_stream_connections``, or its default."""
        if self.max_stream_connections is not None:
            return self.max_stream_connections
        return max(1, self.max_connections // 2)

    @property
    def principal_stream_limit(self) -> int:
        """``max_streams_per_principal``, or its default."""
        if self.max_streams_per_principal is not None:
            return self.max_streams_per_principal
        return max(1, self.stream_limit // 2)

    @model_validator(mode="after")
    def _streams_within_pool(self) -> ProxyConfig:
        if self.stream_limit > self.max_connections:
            raise ValueError(
                f"max_stream_connections ({self.stream_limit}) must be at most "
                f"max_connections ({self.max_connections}): streams hold pooled connections"
            )
        if self.principal_stream_limit > self.stream_limit:
            raise ValueError(
                f"max_streams_per_principal ({self.principal_stream_limit}) must be at most "
                f"max_stream_connections ({self.stream_limit})"
            )
        return self

    @property
    def start_limit_ms(self) -> int:
        if self.forward_start_limit_ms is not None:
            return self.forward_start_limit_ms
        return min(1_000, self.prepared_margin_ms // 2)

    @model_validator(mode="after")
    def _start_within_margin(self) -> ProxyConfig:
        if self.start_limit_ms >= self.prepared_margin_ms:
            raise ValueError(
                f"forward_start_limit_ms ({self.start_limit_ms}) must be below "
                f"prepared_margin_ms ({self.prepared_margin_ms}): a forward that starts later "
                "could outlive its PREPARED deadline"
            )
        return self


class ReconcilerConfig(_Section):
    #: Run the background reconciler in this gateway process (safe to run in several: probes
    #: are leased per effect in the store).
    enabled: bool = True
    #: Pause between sweeps.
    interval_ms: Annotated[int, Field(ge=50, le=_DAY_MS)] = 1_000
    #: Most UNKNOWN effects one sweep looks at.
    max_effects_per_sweep: Annotated[int, Field(ge=1, le=100_000)] = 500


#: A cost unit's name (``[tasks] cost_units``): what a worker's ``cost`` object may key on.
_COST_UNIT = r"^[a-z][a-z0-9_]{0,31}$"


class TasksConfig(_Section):
    """Task flow: dependencies, queue long-polls, cost reports (docs/PROTOCOL.md)."""

    #: Most ``dependsOn`` ids one task may list.
    max_dependencies: Annotated[int, Field(ge=0, le=1_000)] = 32
    #: Most tasks that may depend on one task (checked by the store). A commit rewrites up to
    #: that many dependents (their provenance, WAITING to READY) in its one atomic step.
    max_dependents: Annotated[int, Field(ge=1, le=1_000_000)] = 1_000
    #: Most dependents one cancel cancels in its own atomic step; a background loop of every
    #: gateway carries a larger cascade on, this many tasks per step.
    max_cascade: Annotated[int, Field(ge=1, le=1_000_000)] = 1_000
    #: The units a ``cost`` object (renew, commit, release) may name.
    cost_units: Annotated[
        tuple[Annotated[str, Field(pattern=_COST_UNIT)], ...],
        Field(strict=False, max_length=16),
    ] = ("tokens", "seconds")
    #: The longest ``waitMs`` of a queue claim or of ``GET /v1/tasks/{id}?waitFor=``.
    max_wait_ms: Annotated[int, Field(ge=0, le=10 * _MINUTE_MS)] = 30_000
    #: Most long-polls (queue claims and ``waitFor`` reads) waiting at once in this process;
    #: past it a long-poll that would have to wait is 503 TOO_MANY_CONNECTIONS.
    max_waiters: Annotated[int, Field(ge=0, le=100_000)] = 1_000
    #: Most of them one principal may have waiting at once in this process (all anonymous
    #: callers count as one principal); past it: 503 TOO_MANY_CONNECTIONS.
    max_waiters_per_principal: Annotated[int, Field(ge=0, le=100_000)] = 50

    @field_validator("cost_units")
    @classmethod
    def _unique_units(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError("a cost unit is listed twice")
        return value


class EventsConfig(_Section):
    """``GET /v1/events``, ``waitFor`` and queue long-polls: the store's event history."""

    #: How often this gateway reads new events from the store while anyone listens.
    poll_ms: Annotated[int, Field(ge=10, le=_MINUTE_MS)] = 100
    #: Most events one read takes.
    batch: Annotated[int, Field(ge=1, le=10_000)] = 500
    #: Events the store keeps (the newest); an older ``Last-Event-ID`` is 410 EVENTS_GONE.
    retain: Annotated[int, Field(ge=100, le=100_000_000)] = 100_000
    #: How often this gateway trims the history down to ``retain`` (0: never; another
    #: gateway on the same store may do it).
    trim_interval_ms: Annotated[int, Field(ge=0, le=_DAY_MS)] = 60_000
    #: Most ``GET /v1/events`` streams open at once in this process (more: 503).
    max_subscribers: Annotated[int, Field(ge=1, le=100_000)] = 100
    #: Most of them one principal may have open at once in this process (all anonymous
    #: callers count as one principal; more: 503).
    max_subscribers_per_principal: Annotated[int, Field(ge=1, le=100_000)] = 10
    #: A write to a stream that does not complete within this (its client stopped reading)
    #: ends the stream, so it does not hold its slot.
    write_timeout_ms: Annotated[int, Field(ge=10, le=10 * _MINUTE_MS)] = 10_000
    #: A comment line on an idle stream this often, so proxies do not close it.
    heartbeat_ms: Annotated[int, Field(ge=100, le=10 * _MINUTE_MS)] = 15_000


class RetentionConfig(_Section):
    """What the store keeps, and for how long (ledger.retention, docs/operations.md).

    Settled tasks (COMMITTED, CANCELLED) and their effects are deleted ``settled_ms`` after
    they settled, unless still needed (an effect PREPARED, UNKNOWN or awaiting approval, a
    task that depends on it); a tombstone per task and per effect stays ``tombstone_ms``.
    Every gateway sweeps; the steps are atomic, so several sweeping at once is safe."""

    #: False: nothing is ever deleted (the store grows; ``fencegate store stats`` shows it).
    enabled: bool = True
    #: How long a settled task and its effects stay readable (and replayable) after settling.
    settled_ms: Annotated[int, Field(ge=1_000, le=3_650 * _DAY_MS)] = 7 * _DAY_MS
    #: How long an expired task's and effect's tombstone refuses late calls naming them. Must
    #: be at least every downstream's ``dedupe_window_ms``: after it the task id is new again.
    tombstone_ms: Annotated[int, Field(ge=1_000, le=3_650 * _DAY_MS)] = 30 * _DAY_MS
    #: How often this gateway runs a sweep (it goes on at once while a step finds work).
    interval_ms: Annotated[int, Field(ge=100, le=_DAY_MS)] = 60_000
    #: Most settled tasks (and most tombstones) one atomic step looks at.
    batch: Annotated[int, Field(ge=1, le=10_000)] = 200


class ConsoleConfig(_Section):
    """The operator console at ``/console`` (gateway/console, docs/console.md). The cookie's
    signing key is never here: it comes from ``FENCEGATE_CONSOLE_SECRET`` (the file holds no
    secrets), or is random per process."""

    #: How long a console login lasts (its signed cookie expires then; the principal's token
    #: is still checked on every request). 1 minute to 7 days.
    session_ttl_ms: Annotated[int, Field(ge=_MINUTE_MS, le=7 * _DAY_MS)] = 8 * 60 * _MINUTE_MS


class LoggingConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"


_HEADER_NAME = r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$"
HeaderName = Annotated[str, Field(pattern=_HEADER_NAME)]
Status = Annotated[int, Field(ge=100, le=599)]
#: ``settle_ms`` (a downstream's, a tool's, or its former name ``probe.settle_ms``).
SettleMs = Annotated[int, Field(ge=0, le=7 * _DAY_MS)]
#: Placeholders a probe path may use.
PROBE_PLACEHOLDERS = frozenset({"effectId", "taskId", "slot", "node", "revision", "idempotencyKey"})
#: The ones a keyed effect has values for (it has no task, revision, node or slot): a
#: downstream that takes clients' idempotency keys may use only these.
KEYED_PROBE_PLACEHOLDERS = frozenset({"effectId", "idempotencyKey"})
EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
AdapterKind = Literal["http", "idempotent", "probe", "conditional", "manual", "mcp"]


class OutcomesConfig(_Section):
    """Which response statuses mean what, overriding the adapter's defaults."""

    committed: tuple[Status, ...] = Field(default=(), strict=False)
    not_applied: tuple[Status, ...] = Field(default=(), strict=False)
    unknown: tuple[Status, ...] = Field(default=(), strict=False)

    @model_validator(mode="after")
    def _disjoint(self) -> OutcomesConfig:
        seen: dict[int, str] = {}
        for name in ("committed", "not_applied", "unknown"):
            for status in getattr(self, name):
                if status in seen:
                    raise ValueError(f"status {status} is in both {seen[status]} and {name}")
                seen[status] = name
        return self


def _template_fields(template: str) -> list[str]:
    return [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]


def probe_placeholders(template: str) -> frozenset[str]:
    """The placeholders a (valid) probe path template names."""
    return frozenset(_template_fields(template))


class ProbeConfig(_Section):
    """How to ask the downstream whether an UNKNOWN effect happened."""

    method: Literal["GET", "HEAD", "POST"] = "GET"
    #: Path under the downstream's url, with {effectId} {taskId} {slot} {node} {revision};
    #: {idempotencyKey} (a keyed effect's client key) where client_idempotency_keys is on,
    #: which then allows only {effectId} and {idempotencyKey}.
    path: str
    #: Statuses that mean "the effect happened" / "it did not"; any other is inconclusive.
    found_statuses: tuple[Status, ...] = Field(default=(200,), strict=False)
    absent_statuses: tuple[Status, ...] = Field(default=(404,), strict=False)
    #: Optional: a dotted JSON field of a found-status answer, and the values that mean found
    #: or absent (a value in neither list, or a missing field, is inconclusive).
    json_field: str | None = None
    found_values: tuple[str | int | bool, ...] = Field(default=(), strict=False)
    absent_values: tuple[str | int | bool, ...] = Field(default=(), strict=False)
    timeout_ms: Annotated[int, Field(ge=1, le=10 * _MINUTE_MS)] = 5_000
    #: Backoff between background probes of one effect: doubles from interval to max.
    interval_ms: Annotated[int, Field(ge=10, le=_DAY_MS)] = 5_000
    max_interval_ms: Annotated[int, Field(ge=10, le=_DAY_MS)] = 5 * _MINUTE_MS
    # settle_ms here is the former name of the downstream's settle_ms: ProbeDownstream moves it.

    @field_validator("path")
    @classmethod
    def _template(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with /")
        try:
            fields = _template_fields(value)
        except ValueError as exc:
            raise ValueError(f"not a valid template: {exc}") from exc
        unknown = sorted(set(fields) - PROBE_PLACEHOLDERS)
        if unknown or "" in fields:
            raise ValueError(
                f"unknown placeholder(s) {unknown or ['{}']}; "
                f"use {', '.join('{' + p + '}' for p in sorted(PROBE_PLACEHOLDERS))}"
            )
        return value


class McpToolConfig(_Section):
    """``[downstreams.tools.NAME]`` (adapter = "mcp"): what a tool is, whatever its
    annotations in ``tools/list`` say (they are the server's hints)."""

    #: read_only: fence-checked, never recorded; idempotent: re-sent after UNKNOWN within
    #: dedupe_window_ms; effect: never re-sent. Unset: from the tool's annotations.
    kind: Literal["read_only", "idempotent", "effect"] | None = None
    #: How long the server deduplicates on the effectId it gets in params._meta.
    dedupe_window_ms: Annotated[int, Field(ge=1, le=365 * _DAY_MS)] | None = None
    #: Every call of this tool waits for an operator's approval of its exact payload (and is
    #: recorded, whatever kind or the annotations say).
    require_approval: bool = False
    #: How long an approval of a call of this tool stays usable (as the manual adapter's).
    approval_ttl_ms: Annotated[int, Field(ge=1000, le=30 * _DAY_MS)] = 60 * _MINUTE_MS
    #: This tool's forward timeout (default: the downstream's timeout_ms).
    timeout_ms: Annotated[int, Field(ge=1, le=10 * _MINUTE_MS)] | None = None
    #: How long a call of this tool may still run after the gateway stopped waiting for it
    #: (default: the downstream's settle_ms).
    settle_ms: SettleMs | None = None
    #: JSON-RPC error codes that mean the tool did not run (NOT_APPLIED: the call may go
    #: again); any other error is UNKNOWN. [] for a tool that may raise these after acting.
    not_applied_codes: Annotated[
        tuple[Annotated[int, Field(ge=-(2**31), le=2**31 - 1)], ...],
        Field(strict=False, max_length=100),
    ] = (-32601, -32602, -32020)

    @model_validator(mode="after")
    def _window_for_idempotent(self) -> McpToolConfig:
        if self.dedupe_window_ms is not None and self.kind not in (None, "idempotent"):
            raise ValueError("dedupe_window_ms is only for kind = 'idempotent' (or unset)")
        return self


class _DownstreamBase(_Section):
    """What every kind of downstream takes; each kind is its own model (below), so a key
    of another kind is refused at start-up, naming it."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    url: str
    #: Whole forward, from connect to the last response byte. Past it the effect is UNKNOWN.
    timeout_ms: Annotated[int, Field(ge=1, le=10 * _MINUTE_MS)] = 10_000
    #: Connecting only; a connect that fails or times out certainly delivered nothing.
    connect_timeout_ms: Annotated[int, Field(ge=1, le=10 * _MINUTE_MS)] | None = None
    #: Longest wait for the next bytes of the answer once the request is sent.
    read_timeout_ms: Annotated[int, Field(ge=1, le=10 * _MINUTE_MS)] | None = None
    #: Largest request body accepted for this downstream (413 above); at most
    #: server.max_body_bytes, which bounds every request.
    max_body_bytes: Annotated[int, Field(ge=0, le=256 * 1024 * 1024)] | None = None
    #: Largest response body stored for replay; a larger one is answered once and its
    #: duplicates get status and headers only (Fence-Replay-Body: omitted).
    replay_max_bytes: Annotated[int, Field(ge=0, le=16 * 1024 * 1024)] = 64 * 1024
    #: Header carrying the effectId (the downstream deduplicates on it).
    idempotency_key_header: Annotated[str, Field(pattern=_HEADER_NAME)] = "Idempotency-Key"
    #: Header carrying "{schedulerEpoch}.{claimGeneration}".
    fencing_token_header: Annotated[str, Field(pattern=_HEADER_NAME)] = "Fencing-Token"
    #: Forward the agent's Authorization header (off: credentials belong to the gateway).
    forward_authorization: bool = False
    #: Headers the gateway adds to every request to this downstream: header -> name of the
    #: environment variable holding its value (the downstream's credentials live here).
    headers_from_env: dict[
        HeaderName, Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
    ] = Field(default_factory=dict)
    #: Response headers never stored for replay, on top of those never stored anywhere:
    #: Set-Cookie, Authorization, Proxy-Authorization and every header named in
    #: headers_from_env (docs/security.md, "Secrets at rest").
    never_store_headers: Annotated[tuple[HeaderName, ...], Field(strict=False, max_length=100)] = ()
    #: false: no response body is stored (the record says bodyOmitted, with the reason), so
    #: duplicates get status and headers only (Fence-Replay-Body: omitted). For downstreams
    #: whose answers can carry secrets, e.g. one that echoes the request's headers.
    store_response_body: bool = True
    #: Keep each forwarded request (headers and body) on its effect record, for operators
    #: (docs/PROTOCOL.md, the effect's ``request``): what an UNKNOWN call was. Never kept:
    #: Authorization, Proxy-Authorization, Cookie, the headers_from_env and
    #: never_store_headers names; redact_headers and redact_json_fields are "<redacted>".
    keep_request_bodies: bool = False
    #: The most bytes of a request body kept (after redaction); a longer one is cut
    #: (``truncated: true``).
    keep_request_max_bytes: Annotated[int, Field(ge=0, le=MAX_KEEP_BYTES)] = 8192
    #: JSON pointers (RFC 6901, e.g. "/card/number") whose values a kept body never holds;
    #: a body that is not JSON is then not kept at all.
    redact_json_fields: Annotated[tuple[str, ...], Field(strict=False, max_length=100)] = ()
    #: Request headers a kept request shows as "<redacted>".
    redact_headers: Annotated[tuple[HeaderName, ...], Field(strict=False, max_length=100)] = ()
    #: Status -> outcome overrides.
    outcomes: OutcomesConfig = OutcomesConfig()
    #: Overrides proxy.enforcement for this downstream.
    enforcement: Literal["enforce", "shadow"] | None = None
    #: How long after the gateway stopped waiting for a forward (a timeout, a lost answer) the
    #: downstream may still apply it (its queue, its retries). Until then a probe's "absent"
    #: is inconclusive and an operator's resolve NOT_APPLIED is refused (EFFECT_IN_FLIGHT).
    settle_ms: SettleMs = DEFAULT_SETTLE_MS
    #: Lease-less calls of a ``client`` principal, by their ``Idempotency-Key`` (keyed
    #: effects, docs/PROTOCOL.md): off (the default: refused, 400), optional (a call with a
    #: key is a keyed effect), required (also a mutation without a key is refused, 400
    #: IDEMPOTENCY_KEY_REQUIRED). Not ``idempotency_key_header``, the header the downstream
    #: receives (the effectId, for keyed and leased effects alike).
    client_idempotency_keys: Literal["off", "optional", "required"] = "off"

    @model_validator(mode="before")
    @classmethod
    def _keys_of_this_kind(cls, data: Any) -> Any:
        """Say which kind a key belongs to, and what a kind needs, in words: pydantic would
        say "unknown key" and "field required"."""
        if isinstance(data, dict):
            kind = data.get("adapter", "http")
            for option, owner in _KIND_OF_KEY.items():
                if option in data and kind != owner:
                    raise ValueError(f"{option} is only for adapter = {owner!r}")
            required = _KIND_NEEDS.get(kind)
            if required is not None and data.get(required) is None:
                raise ValueError(f"adapter {kind!r} needs {required}")
        return data

    @field_validator("redact_json_fields")
    @classmethod
    def _pointers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for pointer in value:
            parse_pointer(pointer)  # ValueError in words
        return value

    @property
    def redact_pointers(self) -> tuple[Pointer, ...]:
        """``redact_json_fields``, parsed (checked at start-up)."""
        return tuple(parse_pointer(pointer) for pointer in self.redact_json_fields)

    @property
    def unstored_headers(self) -> frozenset[str]:
        """Lowercase names of the response headers this downstream's records never keep,
        beyond the ones no record keeps (``http_rules.NEVER_STORED``)."""
        names = (*self.never_store_headers, *self.headers_from_env)
        return frozenset(name.lower() for name in names)

    @property
    def connect_timeout(self) -> int:
        return self.connect_timeout_ms or min(self.timeout_ms, 5_000)

    @property
    def read_timeout(self) -> int:
        return self.read_timeout_ms or self.timeout_ms

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("expected an http:// or https:// base URL")
        return value.rstrip("/")


#: Keys that belong to one kind of downstream, and what a kind cannot do without.
_KIND_OF_KEY = {
    "dedupe_window_ms": "idempotent",
    "probe": "probe",
    "require_approval": "manual",
    "approval_ttl_ms": "manual",
    "tools": "mcp",
    "trust_annotations": "mcp",
}
_KIND_NEEDS = {"idempotent": "dedupe_window_ms", "probe": "probe"}


class HttpDownstream(_DownstreamBase):
    """``adapter = "http"`` (the default): the contract's defaults, nothing re-sent by itself."""

    adapter: Literal["http"] = "http"


class IdempotentDownstream(_DownstreamBase):
    adapter: Literal["idempotent"]
    #: How long the downstream deduplicates on a key (an UNKNOWN effect is re-sent under its
    #: original key only inside this window, counted from its first forward).
    dedupe_window_ms: Annotated[int, Field(ge=1, le=365 * _DAY_MS)]


class ProbeDownstream(_DownstreamBase):
    adapter: Literal["probe"]
    #: The lookup that settles UNKNOWN effects.
    probe: ProbeConfig

    @model_validator(mode="after")
    def _probe_fits_keyed_effects(self) -> ProbeDownstream:
        """A keyed effect has no task, revision, node or slot to put in a probe path, and a
        leased one no client key: the template must fit every effect the downstream takes."""
        used = probe_placeholders(self.probe.path)
        if self.client_idempotency_keys != "off":
            extra = sorted(used - KEYED_PROBE_PLACEHOLDERS)
            if extra:
                raise ValueError(
                    f"probe.path names {', '.join('{' + p + '}' for p in extra)}, which a keyed "
                    f"effect has none of: with client_idempotency_keys = "
                    f"{self.client_idempotency_keys!r} use only {{effectId}} and {{idempotencyKey}}"
                )
        elif "idempotencyKey" in used:
            raise ValueError(
                "probe.path names {idempotencyKey}, which only a keyed effect has: set "
                "client_idempotency_keys = 'optional' or 'required', or use {effectId}"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _settle_alias(cls, data: Any) -> Any:
        """``probe.settle_ms`` is ``settle_ms``'s former name: read as it (moved before the
        probe table is read), never both."""
        probe = data.get("probe") if isinstance(data, dict) else None
        if not isinstance(probe, dict) or probe.get("settle_ms") is None:
            return data
        if "settle_ms" in data:
            raise ValueError(
                "settle_ms and probe.settle_ms are both set; probe.settle_ms is the former name "
                "of settle_ms: keep settle_ms only"
            )
        moved = {k: v for k, v in probe.items() if k != "settle_ms"}
        return {**data, "settle_ms": probe["settle_ms"], "probe": moved}


class ConditionalDownstream(_DownstreamBase):
    adapter: Literal["conditional"]


class ManualDownstream(_DownstreamBase):
    adapter: Literal["manual"]
    #: Every forward waits for an operator's approval of its exact payload digest.
    require_approval: bool = False
    #: How long an approval stays usable.
    approval_ttl_ms: Annotated[int, Field(ge=1000, le=30 * _DAY_MS)] = 60 * _MINUTE_MS


class McpDownstream(_DownstreamBase):
    adapter: Literal["mcp"]
    #: Believe the server's tool annotations (readOnlyHint: no record; idempotentHint: re-sent
    #: within dedupe_window_ms) for tools without a kind. false (the default): the MCP
    #: specification says annotations of an untrusted server must not be trusted, so such a
    #: tool is an effect (recorded, never re-sent).
    trust_annotations: bool = False
    #: Per-tool policies, by tool name.
    tools: Annotated[
        dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9_./:-]{1,200}$")], McpToolConfig],
        Field(max_length=1000),
    ] = Field(default_factory=dict)


#: One ``[[downstreams]]`` table: its ``adapter`` (default ``http``) says which model reads it
#: (http | idempotent | probe | conditional | manual | mcp; see config.example.toml).
DownstreamConfig = Annotated[
    HttpDownstream
    | IdempotentDownstream
    | ProbeDownstream
    | ConditionalDownstream
    | ManualDownstream
    | McpDownstream,
    Field(discriminator="adapter"),
]


#: What a principal may do (the role matrix is ``gateway/auth.py``, docs/security.md).
#: ``client``: lease-less calls on ``/proxy`` and ``/mcp`` by idempotency key (never with a
#: lease; a ``worker`` never without one).
Role = Literal["scheduler", "worker", "operator", "observer", "client"]
ROLES: tuple[Role, ...] = ("scheduler", "worker", "operator", "observer", "client")


class PrincipalConfig(_Section):
    """One identity: a unique name, its roles, and its credentials: the SHA-256 of its bearer
    token, the CN of its client certificate (mTLS), or both (either works). The token itself
    is never in the file (``fencegate token new`` prints a token and these lines)."""

    name: str
    roles: Annotated[tuple[Role, ...], Field(min_length=1, strict=False)]
    token_sha256: str | None = None
    #: mTLS: a client certificate (signed by server.tls_client_ca_file) whose subject CN equals
    #: this, exactly, is this principal.
    certificate_cn: str | None = None
    # Scopes and limits (docs/security.md, "Scopes and limits"); absent: unlimited.
    #: The downstreams this principal may call through /proxy/{downstream}/...
    downstreams: Annotated[tuple[str, ...], Field(min_length=1, strict=False)] | None = None
    #: Task ids it may act on (/v1/tasks/{id}, a proxied call's Fence-Task) start with one.
    task_prefixes: Annotated[tuple[str, ...], Field(min_length=1, strict=False)] | None = None
    #: Requests per second (token bucket per gateway process), with ``burst`` at once.
    rate_per_second: Annotated[float, Field(gt=0, le=1_000_000)] | None = None
    burst: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    #: Requests of this principal in flight at once (long-lived ones included).
    max_open_requests: Annotated[int, Field(ge=1, le=1_000_000)] | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9._:@/-]{1,200}", value):
            raise ValueError("1 to 200 letters, digits or . _ : @ / - (no spaces)")
        return value

    @field_validator("downstreams")
    @classmethod
    def _downstreams(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for name in value or ():
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
                raise ValueError(f"{name!r}: a downstream name (1 to 64 of A-Z a-z 0-9 _ . -)")
        return value

    @field_validator("task_prefixes")
    @classmethod
    def _prefixes(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for prefix in value or ():
            if not re.fullmatch(r"[A-Za-z0-9._:@/-]{1,200}", prefix):
                raise ValueError(f"{prefix!r}: 1 to 200 characters of A-Z a-z 0-9 . _ : @ / -")
        return value

    @model_validator(mode="after")
    def _burst_needs_rate(self) -> PrincipalConfig:
        if self.burst is not None and self.rate_per_second is None:
            raise ValueError("burst: only with rate_per_second")
        return self

    @field_validator("certificate_cn")
    @classmethod
    def _cn(cls, value: str | None) -> str | None:
        if value is not None and (
            not 1 <= len(value) <= 200
            or value != value.strip()
            or any(not c.isprintable() for c in value)
        ):
            raise ValueError("1 to 200 printable characters, no leading or trailing spaces")
        return value

    @model_validator(mode="after")
    def _has_credential(self) -> PrincipalConfig:
        if self.token_sha256 is None and self.certificate_cn is None:
            raise ValueError("needs token_sha256, certificate_cn or both")
        return self

    @field_validator("token_sha256")
    @classmethod
    def _digest(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[0-9a-f]{64}", value):
            raise ValueError(
                "expected the token's SHA-256 as 64 lowercase hex characters (never the token "
                "itself; `fencegate token new` prints both)"
            )
        return value


#: The prefix of every OAuth principal's name (``oauth:<iss>#<sub>``, ``gateway/oauth.py``).
OAUTH_PREFIX = "oauth:"


def _https_url(value: str, *, path_ok: bool = True) -> str:
    """An ``https://`` URL without query or fragment; ``http://`` only to a loopback host
    (a local authorization server in a test or on the same machine)."""
    scheme, sep, rest = value.partition("://")
    host = rest.split("/", 1)[0].rsplit("@", 1)[-1]
    host = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    if not sep or scheme not in ("https", "http") or not host or any(c in value for c in "?# "):
        raise ValueError("expected an https:// URL without query or fragment")
    if scheme == "http" and not is_loopback(host.strip("[]")):
        raise ValueError("expected https:// (http:// only to a loopback host)")
    if not path_ok and "/" in rest.rstrip("/"):
        raise ValueError("expected a base URL without a path")
    return value


class OAuthProfileConfig(_Section):
    """``[auth.oauth.profiles.NAME]``: which tokens get which roles and scope. A token
    matches when it carries every one of ``scopes`` (its ``scope`` claim) and every claim of
    ``claims`` (equal, or contained in a list claim); the first profile in file order that
    it matches is its own. The scope keys are a static principal's (``[[auth.principals]]``)."""

    scopes: Annotated[tuple[str, ...], Field(strict=False)] = ()
    claims: dict[str, str] = {}
    roles: Annotated[tuple[Role, ...], Field(min_length=1, strict=False)]
    downstreams: Annotated[tuple[str, ...], Field(min_length=1, strict=False)] | None = None
    task_prefixes: Annotated[tuple[str, ...], Field(min_length=1, strict=False)] | None = None
    rate_per_second: Annotated[float, Field(gt=0, le=1_000_000)] | None = None
    burst: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    max_open_requests: Annotated[int, Field(ge=1, le=1_000_000)] | None = None

    @field_validator("downstreams")
    @classmethod
    def _downstreams(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return PrincipalConfig._downstreams(value)  # the same names as a static principal's

    @field_validator("task_prefixes")
    @classmethod
    def _prefixes(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return PrincipalConfig._prefixes(value)

    @model_validator(mode="after")
    def _burst_needs_rate(self) -> OAuthProfileConfig:
        if self.burst is not None and self.rate_per_second is None:
            raise ValueError("burst: only with rate_per_second")
        return self

    @field_validator("scopes")
    @classmethod
    def _scopes(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for scope in value:
            if not re.fullmatch(r"[\x21\x23-\x5b\x5d-\x7e]{1,200}", scope):
                raise ValueError(f"{scope!r}: a scope token (RFC 6749: no spaces, quotes or \\)")
        return value

    @field_validator("claims")
    @classmethod
    def _claims(cls, value: dict[str, str]) -> dict[str, str]:
        for claim in value:
            if claim in ("iss", "sub", "aud", "exp", "nbf", "iat", "scope"):
                raise ValueError(
                    f"{claim!r}: checked by the gateway itself (match scopes with `scopes`)"
                )
        return value


class OAuthConfig(_Section):
    """``[auth.oauth]``: the gateway as an OAuth 2.1 resource server (docs/security.md,
    "OAuth"). JWT access tokens of ``issuer``, signed with a key of its JWKS."""

    issuer: str
    #: Default: the ``jwks_uri`` of the issuer's RFC 8414 metadata.
    jwks_url: str | None = None
    #: The gateway's public URL: the resource of every route but ``/mcp/{name}``.
    resource_base_url: str
    #: Also accepted as ``aud`` (besides the route's resource).
    audience: str | None = None
    leeway_ms: Annotated[int, Field(ge=0, le=300_000)] = 60_000
    #: An unknown ``kid`` fetches the JWKS again at most this often.
    jwks_refresh_ms: Annotated[int, Field(ge=1_000, le=3_600_000)] = 30_000
    #: How long one fetch of the metadata or the JWKS may take.
    jwks_timeout_ms: Annotated[int, Field(ge=100, le=60_000)] = 5_000
    #: Rate buckets of OAuth principals kept (least recently used dropped first).
    max_principals: Annotated[int, Field(ge=1, le=1_000_000)] = 10_000
    profiles: dict[str, OAuthProfileConfig]

    @field_validator("issuer", "jwks_url")
    @classmethod
    def _urls(cls, value: str | None) -> str | None:
        return None if value is None else _https_url(value)

    @field_validator("resource_base_url")
    @classmethod
    def _base(cls, value: str) -> str:
        return _https_url(value).rstrip("/")

    @field_validator("profiles")
    @classmethod
    def _profiles(cls, value: dict[str, OAuthProfileConfig]) -> dict[str, OAuthProfileConfig]:
        if not value:
            raise ValueError("at least one [auth.oauth.profiles.NAME] is needed")
        for name in value:
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
                raise ValueError(f"{name!r}: a profile name (1 to 64 of A-Z a-z 0-9 _ . -)")
        return value


class AuthConfig(_Section):
    """``[auth]``: when present, every request but /healthz and /readyz needs a credential:
    a static principal's (``[[auth.principals]]``), an OAuth token (``[auth.oauth]``), or
    either when both are configured."""

    principals: Annotated[tuple[PrincipalConfig, ...], Field(strict=False)] = ()
    oauth: OAuthConfig | None = None

    @model_validator(mode="after")
    def _unique(self) -> AuthConfig:
        if not self.principals and self.oauth is None:
            raise ValueError(
                "principals: at least one [[auth.principals]] (or [auth.oauth]) is needed"
            )
        names: set[str] = set()
        digests: set[str] = set()
        cns: set[str] = set()
        for i, principal in enumerate(self.principals):
            if principal.name in names:
                raise ValueError(f"principals[{i}].name {principal.name!r} is used twice")
            if principal.token_sha256 in digests:
                raise ValueError(
                    f"principals[{i}] ({principal.name!r}).token_sha256 is another "
                    "principal's: every principal needs its own token"
                )
            if principal.certificate_cn in cns:
                raise ValueError(
                    f"principals[{i}] ({principal.name!r}).certificate_cn "
                    f"{principal.certificate_cn!r} is another principal's"
                )
            if principal.name.startswith(OAUTH_PREFIX) or "#" in principal.name:
                # Never the name of an OAuth principal (oauth:<iss>#<sub>): a token cannot
                # become a static principal, nor hold its leases.
                raise ValueError(
                    f"principals[{i}].name {principal.name!r}: {OAUTH_PREFIX!r} names OAuth "
                    "principals only"
                )
            names.add(principal.name)
            if principal.token_sha256 is not None:
                digests.add(principal.token_sha256)
            if principal.certificate_cn is not None:
                cns.add(principal.certificate_cn)
        return self


#: Store URL schemes whose store belongs to one process (``server.workers`` must be 1).
_ONE_PROCESS_SCHEMES = ("sqlite:",)


class TracingConfig(_Section):
    """OpenTelemetry traces (gateway/tracing.py, docs/operations.md "Tracing"): spans go by
    OTLP over HTTP to ``otlp_endpoint``/v1/traces. The section's presence turns tracing on;
    it needs the optional extra (``pip install fencegate[otel]``). The collector's credential
    is never here: ``headers_from_env`` names the environment variable of each header."""

    #: The collector's base URL (http:// or https://), e.g. http://127.0.0.1:4318.
    otlp_endpoint: str
    #: ``service.name`` of the gateway's spans.
    service_name: Annotated[str, Field(min_length=1, max_length=200)] = "fencegate"
    #: Share of new traces recorded (0 to 1); a request that comes with a trace context
    #: follows its caller's sampling decision (parent-based).
    sample_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0
    #: Headers sent to the collector: header -> name of the environment variable holding
    #: its value (e.g. Authorization = "OTLP_AUTHORIZATION").
    headers_from_env: dict[HeaderName, EnvName] = Field(default_factory=dict)
    #: Longest wait before a batch of finished spans is exported (spans are also exported
    #: when a batch fills, and all of them at shutdown).
    export_delay_ms: Annotated[int, Field(ge=1, le=_MINUTE_MS)] = 5_000
    #: Bound of one export to the collector.
    export_timeout_ms: Annotated[int, Field(ge=1, le=_MINUTE_MS)] = 10_000

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")) or len(value) > 2000:
            raise ValueError("expected an http:// or https:// base URL (OTLP over HTTP)")
        return value.rstrip("/")


class Config(_Section):
    server: ServerConfig = ServerConfig()
    store: StoreConfig = StoreConfig()
    leases: LeasesConfig = LeasesConfig()
    proxy: ProxyConfig = ProxyConfig()
    reconciler: ReconcilerConfig = ReconcilerConfig()
    tasks: TasksConfig = TasksConfig()
    events: EventsConfig = EventsConfig()
    retention: RetentionConfig = RetentionConfig()
    logging: LoggingConfig = LoggingConfig()
    console: ConsoleConfig = ConsoleConfig()
    downstreams: Annotated[tuple[DownstreamConfig, ...], Field(strict=False)] = ()
    #: None: no authentication (docs/security.md).
    auth: AuthConfig | None = None
    #: None: no traces (docs/operations.md, "Tracing").
    tracing: TracingConfig | None = None

    @field_validator("downstreams", mode="before")
    @classmethod
    def _default_adapter(cls, value: Any) -> Any:
        """A table without ``adapter`` is ``http`` (the union picks its model by the key)."""
        if isinstance(value, list | tuple):
            return [
                {"adapter": "http", **item} if isinstance(item, dict) else item for item in value
            ]
        return value

    @model_validator(mode="after")
    def _unique_downstreams(self) -> Config:
        seen: set[str] = set()
        for i, downstream in enumerate(self.downstreams):
            if downstream.name in seen:
                raise ValueError(f"downstreams[{i}].name {downstream.name!r} is used twice")
            seen.add(downstream.name)
            limit = downstream.max_body_bytes
            if limit is not None and limit > self.server.max_body_bytes:
                raise ValueError(
                    f"downstreams[{i}].max_body_bytes exceeds server.max_body_bytes "
                    f"({self.server.max_body_bytes})"
                )
        return self

    @model_validator(mode="after")
    def _tombstones_outlive_dedupe_windows(self) -> Config:
        # A tombstone is what keeps an expired effect's idempotency key from being sent as
        # new work; once it is gone only the downstream's own deduplication could.
        windows = [
            (f"downstreams[{i}].dedupe_window_ms", d.dedupe_window_ms)
            for i, d in enumerate(self.downstreams)
            if isinstance(d, IdempotentDownstream)
        ]
        for i, d in enumerate(self.downstreams):
            if isinstance(d, McpDownstream):
                windows += [
                    (f"downstreams[{i}].tools.{name}.dedupe_window_ms", tool.dedupe_window_ms)
                    for name, tool in d.tools.items()
                    if tool.dedupe_window_ms is not None
                ]
        for key, window in windows:
            if self.retention.enabled and window > self.retention.tombstone_ms:
                raise ValueError(
                    f"retention.tombstone_ms ({self.retention.tombstone_ms}) is shorter than "
                    f"{key} ({window}): an expired effect's key could be sent again as new "
                    "work after its tombstone went; raise retention.tombstone_ms"
                )
        return self

    @model_validator(mode="after")
    def _certificates_need_a_client_ca(self) -> Config:
        for i, principal in enumerate(self.auth.principals if self.auth else ()):
            if principal.certificate_cn is not None and self.server.tls_client_ca_file is None:
                raise ValueError(
                    f"auth.principals[{i}] ({principal.name!r}).certificate_cn needs "
                    "server.tls_client_ca_file (no client certificate is asked for without it)"
                )
        return self

    @model_validator(mode="after")
    def _safe_listen(self) -> Config:
        host = parse_listen(self.server.listen)[0]
        if self.auth is None and not self.server.allow_unauthenticated and not is_loopback(host):
            raise ValueError(
                f"server.listen ({self.server.listen}) is not a loopback address and there is "
                "no [auth] section: every client that reaches it could use every endpoint; "
                "add [auth], listen on loopback, or set server.allow_unauthenticated = true"
            )
        return self

    @model_validator(mode="after")
    def _workers_share_the_store(self) -> Config:
        # SQLite's store serialises transitions on one connection in one process and keeps
        # its clock's high-water mark there (docs/stores.md): several processes on one file
        # would queue on each other's write lock and fsync instead of adding capacity.
        if self.server.workers > 1 and self.store.url.lower().startswith(_ONE_PROCESS_SCHEMES):
            raise ValueError(
                f"server.workers = {self.server.workers} needs a store that several processes "
                f"share: the SQLite store ({self.store.url}) is opened by one gateway process; "
                "use workers = 1, or a Redis or PostgreSQL store (docs/serve.md, docs/stores.md)"
            )
        return self

    def downstream(self, name: str) -> DownstreamConfig | None:
        return next((d for d in self.downstreams if d.name == name), None)


def _key(loc: tuple[int | str, ...], data: object = None) -> str:
    """``downstreams[1] ('stripe').probe.path``: the key, and the downstream's name."""
    out = ""
    node = data
    after_index = False
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            node = node[part] if isinstance(node, list) and part < len(node) else None
            if isinstance(node, dict) and isinstance(node.get("name"), str):
                out += f" ({node['name']!r})"
            after_index = True
            continue
        if after_index and isinstance(node, dict) and part == node.get("adapter", "http"):
            after_index = False
            continue  # the union's tag (which kind's model read the table), not a key
        after_index = False
        out += ("." if out else "") + part
        node = node.get(part) if isinstance(node, dict) else None
    return out or "(top level)"


def _describe(exc: ValidationError, data: object = None) -> str:
    lines = []
    for error in exc.errors():
        message = error["msg"].removeprefix("Value error, ")
        loc = error["loc"]
        if error["type"] == "extra_forbidden":
            message = "unknown key"
        if error["type"] in ("union_tag_invalid", "union_tag_not_found"):
            loc = (*loc, "adapter")
            message = f"expected one of {', '.join(repr(k) for k in get_args(AdapterKind))}"
        lines.append(f"{_key(loc, data)}: {message}")
    return "; ".join(lines)


class AuthReloadError(ConfigError):
    """``load_auth`` could not use the file; ``key`` names the first bad key (``auth``...)."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


def public_url(url: str) -> str:
    """``url`` as it may be logged or printed: no password (a Redis password), no query or
    fragment (an API key passed as a parameter); a user name stays (PostgreSQL's, which
    says who connects). Split by hand: a multi-host PostgreSQL URL is no single URL."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url.split("?")[0].split("#")[0]
    rest = rest.split("#", 1)[0].split("?", 1)[0]
    authority, slash, path = rest.partition("/")
    userinfo, at, hosts = authority.rpartition("@")
    user = userinfo.split(":", 1)[0] if at else ""
    return f"{scheme}://{user + '@' if user else ''}{hosts}{slash}{path}"


def load_auth(path: str | Path) -> AuthConfig:
    """Only the ``[auth]`` section of the config file at ``path`` (``serve`` on SIGHUP): the
    rest of the file is not looked at beyond being valid TOML. A file without ``[auth]`` is an
    error (a reload never turns authentication off)."""
    try:
        data = tomllib.loads(Path(path).read_bytes().decode("utf-8"))
    except OSError as exc:
        raise AuthReloadError(f"{path}: cannot read: {exc.strerror}", "(file)") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise AuthReloadError(f"{path}: not valid TOML: {exc}", "(file)") from exc
    section = data.get("auth")
    if not isinstance(section, dict):
        raise AuthReloadError(f"{path}: auth: no [auth] section", "auth")
    try:
        return AuthConfig.model_validate(section)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = "auth." + _key(first["loc"], section) if first["loc"] else "auth"
        raise AuthReloadError(
            f"{path}: " + "; ".join("auth." + part for part in _describe(exc, section).split("; ")),
            key,
        ) from exc


def load_config(path: str | Path | None) -> Config:
    """The config in ``path``, or the defaults (embedded store on 127.0.0.1:8700) for None."""
    if path is None:
        return Config()
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {_describe(exc, data)}") from exc
    if config.store.password_env is not None and config.store.password_env not in os.environ:
        raise ConfigError(
            f"{path}: store.password_env: environment variable "
            f"{config.store.password_env!r} is not set"
        )
    for i, downstream in enumerate(config.downstreams):
        for header, variable in downstream.headers_from_env.items():
            if variable not in os.environ:
                raise ConfigError(
                    f"{path}: downstreams[{i}] ({downstream.name!r}).headers_from_env.{header}: "
                    f"environment variable {variable!r} is not set"
                )
    for header, variable in (config.tracing.headers_from_env if config.tracing else {}).items():
        if variable not in os.environ:
            raise ConfigError(
                f"{path}: tracing.headers_from_env.{header}: "
                f"environment variable {variable!r} is not set"
            )
    return config
