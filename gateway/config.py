"""Configuration: frozen pydantic models mirroring ``config.example.toml``, validated once.

Unknown keys are errors (a typo must not silently fall back to a default), and every error
names the key (``store.timeout_ms``, ``downstreams[1].url``). Secrets never live in the file:
a key ending in ``_env`` names the environment variable that holds the secret.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "Config",
    "ConfigError",
    "DownstreamConfig",
    "LeasesConfig",
    "LoggingConfig",
    "ProxyConfig",
    "ServerConfig",
    "StoreConfig",
    "load_config",
    "parse_listen",
]

# Bounds on everything a config file controls, so a typo cannot make the gateway absurd.
_MINUTE_MS = 60_000
_DAY_MS = 24 * 60 * _MINUTE_MS


class ConfigError(Exception):
    """A config file that cannot be used; the message names the file and the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


class ServerConfig(_Section):
    listen: str = "127.0.0.1:8700"
    #: Largest request body the gateway reads at all (coordination API and proxied calls).
    max_body_bytes: Annotated[int, Field(ge=1024, le=256 * 1024 * 1024)] = 1024 * 1024

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        parse_listen(value)
        return value


class StoreConfig(_Section):
    url: str = "sqlite:///fencegate.db"
    #: Longest a request waits for the store before answering 503 STORE_UNAVAILABLE.
    timeout_ms: Annotated[int, Field(ge=10, le=_MINUTE_MS)] = 2000
    #: SQLite only. FULL survives power loss; NORMAL may lose the last transactions on power
    #: loss (never on a process crash). See docs/stores.md.
    sqlite_synchronous: Literal["FULL", "NORMAL"] = "FULL"
    #: Redis only: prefix of every key fencegate writes.
    redis_key_prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")] = "fg"
    #: Redis only: connections per gateway process; a request waits (up to timeout_ms) for a
    #: free one rather than failing.
    redis_max_connections: Annotated[int, Field(ge=1, le=10_000)] = 200
    #: Redis only: name of the environment variable holding the Redis password.
    password_env: str | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if value.startswith("sqlite:///"):
            if len(value) == len("sqlite:///"):
                raise ValueError("sqlite URL needs a path, e.g. sqlite:///fencegate.db")
            return value
        if value.startswith(("redis://", "rediss://", "unix://")):
            return value
        raise ValueError("expected sqlite:///PATH or redis://HOST:PORT/DB")

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
    prepared_margin_ms: Annotated[int, Field(ge=0, le=10 * _MINUTE_MS)] = 5_000
    #: Most pooled connections to all downstreams together.
    max_connections: Annotated[int, Field(ge=1, le=10_000)] = 200


class LoggingConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"


_HEADER_NAME = r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$"


class DownstreamConfig(_Section):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    url: str
    adapter: Literal["http"] = "http"
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


class Config(_Section):
    server: ServerConfig = ServerConfig()
    store: StoreConfig = StoreConfig()
    leases: LeasesConfig = LeasesConfig()
    proxy: ProxyConfig = ProxyConfig()
    logging: LoggingConfig = LoggingConfig()
    downstreams: Annotated[tuple[DownstreamConfig, ...], Field(strict=False)] = ()

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

    def downstream(self, name: str) -> DownstreamConfig | None:
        return next((d for d in self.downstreams if d.name == name), None)


def _key(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out or "(top level)"


def _describe(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown key"
        lines.append(f"{_key(error['loc'])}: {message}")
    return "; ".join(lines)


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
        raise ConfigError(f"{path}: {_describe(exc)}") from exc
    if config.store.password_env is not None and config.store.password_env not in os.environ:
        raise ConfigError(
            f"{path}: store.password_env: environment variable "
            f"{config.store.password_env!r} is not set"
        )
    return config
