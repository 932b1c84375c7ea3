"""The gateway as an OAuth 2.1 resource server (``[auth.oauth]``, docs/security.md "OAuth").

A request may present a JWT access token of the configured ``issuer`` instead of a static
principal's token. It is accepted when:

- its header's ``alg`` is an asymmetric one (``ALGORITHMS``): ``none`` and every ``HS*`` are
  refused before any key is looked at, so the issuer's public key can never be used as an
  HMAC secret (key confusion);
- its signature verifies with the key its ``kid`` names in the issuer's JWKS (that key's own
  ``kty``/``crv`` and ``alg``, when the JWK has one, must fit the header's ``alg``);
- ``iss`` is the issuer, ``aud`` holds the resource of the route (``/mcp/{name}``:
  ``<resource_base_url>/mcp/{name}``; elsewhere ``resource_base_url``) or the configured
  ``audience``, and ``exp`` / ``nbf`` hold within ``leeway_ms``;
- it matches a profile (``[auth.oauth.profiles.NAME]``, the first in file order): that gives
  its roles, scope and limits. A valid token that matches none has no role: 403
  ``insufficient_scope``, decided by the middleware (``gateway/auth.py``).

Its principal is ``oauth:<iss>#<sub>`` (``principals.oauth_name``): never a static name.

Verification is PyJWT (``jwt``, with ``cryptography`` for the keys): a maintained JOSE
implementation (RFC 7515/7517/7519) whose decode requires the caller to name the allowed
algorithms and refuses HMAC with a PEM or JWK public key; nothing here touches a signature.

The JWKS (and, without ``jwks_url``, the issuer's RFC 8414 metadata naming it) is fetched
with aiohttp inside the event loop, one fetch at a time, each with its own short-lived
session bounded by ``jwks_timeout_ms`` and ``_MAX_DOCUMENT`` bytes. It is cached; a ``kid``
the cache lacks fetches it again, at most once per ``jwks_refresh_ms`` (a flood of made-up
``kid`` values costs one fetch per interval, never one per request). When the JWKS cannot be
fetched and the ``kid`` is unknown, the token can be neither accepted nor refused: 503
``AUTH_UNAVAILABLE`` with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

import aiohttp
import jwt
import structlog

from fencegate.gateway.config import OAuthConfig, OAuthProfileConfig, is_loopback
from fencegate.gateway.limits import Limits
from fencegate.gateway.principals import REAL_TIME, Principal, Scope, WallClock, oauth_name
from fencegate.ledger.errors import AuthUnavailable, Unauthenticated

__all__ = [
    "ALGORITHMS",
    "OAuthVerifier",
    "metadata_document",
    "metadata_path",
    "resource_of",
]

log = structlog.get_logger("fencegate.auth")

#: The only algorithms a token may use: asymmetric signatures. Never ``none``, never HS*.
ALGORITHMS: Final = (
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "EdDSA",
)  # fmt: skip
#: The largest metadata or JWKS document read (a JWKS of a few keys is a few KiB).
_MAX_DOCUMENT: Final = 256 * 1024
#: A cached JWKS older than this is fetched again on its next use (a key the issuer withdrew
#: stops verifying); if that fetch fails, the cached keys go on serving.
_MAX_AGE_S: Final = 15 * 60.0
_SUBJECT = re.compile(r"[\x21-\x7e]{1,255}")
_WELL_KNOWN = "/.well-known/oauth-protected-resource"
_MCP_PREFIX = "/mcp/"


def resource_of(config: OAuthConfig, path: str) -> str:
    """The resource (RFC 8707/9728) a request on ``path`` is for: an MCP downstream's own
    (``<resource_base_url>/mcp/{name}``) on ``/mcp/{name}``, else the gateway's."""
    if path.startswith(_MCP_PREFIX):
        name = path[len(_MCP_PREFIX) :].split("/", 1)[0]
        if name:
            return f"{config.resource_base_url}{_MCP_PREFIX}{name}"
    return config.resource_base_url


def metadata_path(path: str) -> str:
    """Where the RFC 9728 metadata of the resource of ``path`` is served: path-suffixed for
    ``/mcp/{name}``, the root document elsewhere."""
    if path.startswith(_MCP_PREFIX):
        name = path[len(_MCP_PREFIX) :].split("/", 1)[0]
        if name:
            return f"{_WELL_KNOWN}{_MCP_PREFIX}{name}"
    return _WELL_KNOWN


def metadata_document(config: OAuthConfig, resource: str) -> dict[str, Any]:
    """The RFC 9728 protected resource metadata of ``resource``: who issues its tokens and
    which scopes the profiles look for."""
    scopes = sorted({s for profile in config.profiles.values() for s in profile.scopes})
    document: dict[str, Any] = {
        "resource": resource,
        "authorization_servers": [config.issuer],
        "bearer_methods_supported": ["header"],
        "resource_signing_alg_values_supported": list(ALGORITHMS),
        "resource_documentation": "https://github.com/fencegate/fencegate/blob/main/docs/security.md#oauth",
    }
    if scopes:
        document["scopes_supported"] = scopes
    return document


def _token_scopes(claims: Mapping[str, Any]) -> frozenset[str]:
    """The token's scopes: RFC 9068's space-separated ``scope``, or a ``scp`` list (some
    issuers use that instead)."""
    found: set[str] = set()
    scope = claims.get("scope")
    if isinstance(scope, str):
        found.update(scope.split())
    scp = claims.get("scp")
    if isinstance(scp, list):
        found.update(s for s in scp if isinstance(s, str))
    elif isinstance(scp, str):
        found.update(scp.split())
    return frozenset(found)


def _claim_matches(value: Any, wanted: str) -> bool:
    if isinstance(value, list):
        return wanted in value
    return isinstance(value, str) and value == wanted


def matching_profile(
    profiles: Mapping[str, OAuthProfileConfig], claims: Mapping[str, Any]
) -> tuple[str, OAuthProfileConfig] | None:
    """The first profile (in file order) whose scopes and claims the token carries."""
    scopes = _token_scopes(claims)
    for name, profile in profiles.items():
        if not set(profile.scopes) <= scopes:
            continue
        if all(_claim_matches(claims.get(k), v) for k, v in profile.claims.items()):
            return name, profile
    return None


def profiles_granting(profiles: Mapping[str, OAuthProfileConfig], roles: frozenset[str]) -> str:
    """The scopes a token needs for a role in ``roles`` (``WWW-Authenticate``'s ``scope``):
    those of the first profile that grants one."""
    for profile in profiles.values():
        if roles & set(profile.roles) and profile.scopes:
            return " ".join(profile.scopes)
    return ""


@dataclass(frozen=True, slots=True)
class Verified:
    """A token that passed: its principal (None when it matches no profile), its name and
    the name of the profile it matched."""

    name: str
    principal: Principal | None
    profile: str | None = None


def _principal(
    name: str, profile: OAuthProfileConfig, expires_at: float, clock: WallClock
) -> Principal:
    downstreams = frozenset(profile.downstreams) if profile.downstreams is not None else None
    return Principal(
        name,
        frozenset(profile.roles),
        Scope(downstreams, profile.task_prefixes),
        Limits(profile.rate_per_second, profile.burst, profile.max_open_requests),
        expires_at=expires_at,
        clock=clock,
    )


def profile_digest(profile: OAuthProfileConfig) -> str:
    """A short digest of a profile as configured: a console session made under it ends when
    a reload changes it (what matched at login may no longer)."""
    return hashlib.sha256(profile.model_dump_json().encode()).hexdigest()[:16]


def _fetchable(url: str) -> bool:
    parts = urlsplit(url)
    host = parts.hostname or ""
    return parts.scheme == "https" or (parts.scheme == "http" and is_loopback(host))


class _Unreachable(Exception):
    """A fetch of the metadata or the JWKS failed (said why)."""


class OAuthVerifier:
    """``[auth.oauth]``'s token check with its JWKS cache. ``wall``: what ``exp``/``nbf`` are
    read against, and what a stream opened with the token waits on to end at its ``exp``
    (``principals.at_expiry``); ``monotonic``: what the refresh bound is measured on (tests
    move both)."""

    def __init__(
        self,
        config: OAuthConfig,
        *,
        wall: WallClock = REAL_TIME,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.wall = wall
        self.monotonic = monotonic
        self._jwks_url: str | None = config.jwks_url
        self._keys: dict[str, dict[str, Any]] = {}
        self._parsed: dict[tuple[str, str], jwt.PyJWK] = {}
        self._fetched_at: float | None = None  # last successful fetch
        self._tried_at: float | None = None  # last attempt, successful or not
        self._failure: str | None = None  # why the last attempt failed
        self._lock: asyncio.Lock | None = None

    def adopt_cache(self, other: OAuthVerifier) -> None:
        """Keep ``other``'s fetched keys across a reload that left the issuer and the JWKS
        location alone (a reload must not cost a fetch, nor lift the refresh bound)."""
        if (
            other.config.issuer == self.config.issuer
            and other.config.jwks_url == self.config.jwks_url
        ):
            self._jwks_url = other._jwks_url
            self._keys, self._parsed = other._keys, other._parsed
            self._fetched_at, self._tried_at = other._fetched_at, other._tried_at
            self._failure = other._failure

    @property
    def leeway_s(self) -> float:
        return self.config.leeway_ms / 1000

    # --- the JWKS ------------------------------------------------------------------------

    async def _get_json(self, session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
        if not _fetchable(url):
            raise _Unreachable(f"{url} is not https:// (http:// only to a loopback host)")
        try:
            async with session.get(url, allow_redirects=False) as resp:
                if resp.status != 200:
                    raise _Unreachable(f"{url} answered {resp.status}")
                body = await resp.content.read(_MAX_DOCUMENT + 1)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _Unreachable(f"{url}: {type(exc).__name__}") from exc
        if len(body) > _MAX_DOCUMENT:
            raise _Unreachable(f"{url}: over {_MAX_DOCUMENT} bytes")
        try:
            document = json.loads(body)
        except ValueError as exc:
            raise _Unreachable(f"{url}: not JSON") from exc
        if not isinstance(document, dict):
            raise _Unreachable(f"{url}: not a JSON object")
        return document

    async def _discover(self, session: aiohttp.ClientSession) -> str:
        """The issuer's ``jwks_uri`` from its RFC 8414 metadata (the well-known name goes
        between host and path), whose ``issuer`` must be the configured one (§3.3)."""
        issuer = self.config.issuer.rstrip("/")
        parts = urlsplit(issuer)
        url = f"{parts.scheme}://{parts.netloc}/.well-known/oauth-authorization-server{parts.path}"
        document = await self._get_json(session, url)
        if document.get("issuer") != self.config.issuer:
            raise _Unreachable(f"{url}: its issuer is not {self.config.issuer!r}")
        jwks_uri = document.get("jwks_uri")
        if not isinstance(jwks_uri, str) or not _fetchable(jwks_uri):
            raise _Unreachable(f"{url}: no usable jwks_uri")
        return jwks_uri

    async def _fetch(self) -> None:
        """Fetch the JWKS (discovering where first if need be) and replace the cache."""
        timeout = aiohttp.ClientTimeout(total=self.config.jwks_timeout_ms / 1000)
        connector = aiohttp.TCPConnector(limit=2)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            if self._jwks_url is None:
                self._jwks_url = await self._discover(session)
            document = await self._get_json(session, self._jwks_url)
        keys: dict[str, dict[str, Any]] = {}
        listed = document.get("keys")
        for jwk in listed if isinstance(listed, list) else ():
            if not isinstance(jwk, dict) or jwk.get("kty") not in ("RSA", "EC", "OKP"):
                continue  # "oct" (a shared secret) is never a signing key here
            if jwk.get("use", "sig") != "sig" or "d" in jwk:
                continue  # an encryption key, or a private key published by mistake
            kid = jwk.get("kid")
            keys[kid if isinstance(kid, str) else ""] = jwk
        self._keys, self._parsed = keys, {}
        self._fetched_at = self.monotonic()
        log.info("auth.oauth_keys_fetched", issuer=self.config.issuer, keys=len(keys))

    def _retry_after_ms(self) -> int:
        since = self.monotonic() - (self._tried_at or 0.0)
        return max(1000, math.ceil((self.config.jwks_refresh_ms / 1000 - since) * 1000))

    async def _refresh(self, kid: str, *, stale: bool) -> None:
        """Fetch again when the bound allows (one fetch at a time; a request that waited for
        another's fetch uses its result)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        tried = self._tried_at
        async with self._lock:
            if self._tried_at != tried:
                return  # another request fetched while this one waited
            if kid in self._keys and not stale:
                return
            interval = self.config.jwks_refresh_ms / 1000
            if tried is not None and self.monotonic() - tried < interval:
                return  # bounded: at most one fetch per jwks_refresh_ms
            self._tried_at = self.monotonic()
            try:
                await self._fetch()
                self._failure = None
            except _Unreachable as exc:
                self._failure = str(exc)
                log.warning("auth.oauth_keys_unavailable", issuer=self.config.issuer,
                            reason=str(exc))  # fmt: skip

    async def _key(self, kid: str, alg: str) -> jwt.PyJWK:
        fetched = self._fetched_at
        stale = fetched is None or self.monotonic() - fetched > _MAX_AGE_S
        if kid not in self._keys or stale:
            await self._refresh(kid, stale=stale)
        jwk = self._keys.get(kid)
        if jwk is None:
            if self._failure is not None:
                raise AuthUnavailable(
                    f"the token's key {kid!r} is not known and the issuer's JWKS cannot be "
                    "fetched now; retry later",
                    retryAfterMs=self._retry_after_ms(),
                )
            raise Unauthenticated(f"the token's key {kid!r} is not in the issuer's JWKS")
        if jwk.get("alg", alg) != alg:
            raise Unauthenticated(f"the token's alg {alg} is not its key's ({jwk.get('alg')})")
        parsed = self._parsed.get((kid, alg))
        if parsed is None:
            try:
                parsed = jwt.PyJWK(jwk, algorithm=alg)
            except jwt.PyJWTError as exc:
                raise Unauthenticated(f"the token's key {kid!r} does not fit alg {alg}") from exc
            self._parsed[(kid, alg)] = parsed
        return parsed

    # --- a token ---------------------------------------------------------------------------

    @staticmethod
    def looks_like_jwt(token: str) -> bool:
        return token.count(".") == 2

    def _audience_fits(self, aud: Any, wanted: list[str], any_resource: bool) -> bool:
        given = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
        mcp = f"{self.config.resource_base_url}{_MCP_PREFIX}"
        return any(
            isinstance(a, str)
            and (a in wanted or (any_resource and a.startswith(mcp) and "/" not in a[len(mcp) :]))
            for a in given
        )

    async def verify(self, token: str, path: str, *, any_resource: bool = False) -> Verified:
        """The principal of ``token`` on a request for ``path``; raise ``Unauthenticated``
        (a bad token) or ``AuthUnavailable`` (the keys cannot be fetched). ``any_resource``:
        an ``aud`` of any of the gateway's resources will do (is this a gateway token at
        all? ``/proxy`` withholds those from the downstream)."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as exc:
            raise Unauthenticated("the token is not a JWT") from exc
        alg = header.get("alg")
        if alg not in ALGORITHMS:
            raise Unauthenticated(
                f"the token's alg {alg!r} is not allowed ({', '.join(ALGORITHMS)})"
            )
        if header.get("typ", "at+jwt").lower() not in ("at+jwt", "application/at+jwt", "jwt"):
            raise Unauthenticated("the token is not an access token (typ)")
        kid = header.get("kid", "")
        if not isinstance(kid, str):
            raise Unauthenticated("the token's kid is not a string")
        try:
            # Read, unverified, only to spare the JWKS a fetch for another issuer's token
            # (a downstream's own, on /proxy): the verified decode below checks iss again.
            unverified = jwt.decode(token, options={"verify_signature": False})
        except jwt.PyJWTError as exc:
            raise Unauthenticated("the token is not a JWT") from exc
        if unverified.get("iss") != self.config.issuer:
            raise Unauthenticated(f"the token's iss is not {self.config.issuer}")
        key = await self._key(kid, alg)
        audiences = [resource_of(self.config, path)]
        if self.config.audience is not None:
            audiences.append(self.config.audience)
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key=key,
                algorithms=[alg],
                issuer=self.config.issuer,
                options={
                    "require": ["iss", "sub", "aud", "exp"],
                    # aud, exp and nbf are checked below (the clock is injected)
                    "verify_aud": False,
                    "verify_exp": False,
                    "verify_nbf": False,
                    "verify_iat": False,
                },
            )
        except jwt.InvalidIssuerError as exc:
            raise Unauthenticated(f"the token's iss is not {self.config.issuer}") from exc
        except jwt.PyJWTError as exc:
            raise Unauthenticated(f"the token does not verify: {exc}") from exc
        if not self._audience_fits(claims.get("aud"), audiences, any_resource):
            raise Unauthenticated(f"the token's aud is not {' or '.join(audiences)}")
        now, leeway = self.wall.now(), self.leeway_s
        exp, nbf = claims.get("exp"), claims.get("nbf")
        if not isinstance(exp, int | float) or isinstance(exp, bool):
            raise Unauthenticated("the token's exp is not a number")
        if now > exp + leeway:
            raise Unauthenticated("the token has expired")
        if nbf is not None:
            if not isinstance(nbf, int | float) or isinstance(nbf, bool):
                raise Unauthenticated("the token's nbf is not a number")
            if now + leeway < nbf:
                raise Unauthenticated("the token is not valid yet (nbf)")
        subject = claims.get("sub")
        if not isinstance(subject, str) or not _SUBJECT.fullmatch(subject):
            raise Unauthenticated("the token's sub must be 1 to 255 visible ASCII characters")
        name = oauth_name(self.config.issuer, subject)
        found = matching_profile(self.config.profiles, claims)
        if found is None:
            return Verified(name, None)
        profile_name, profile = found
        principal = _principal(name, profile, float(exp) + leeway, self.wall)
        return Verified(name, principal, profile_name)

    def session_principal(self, name: str, profile: str, expires_at: float) -> Principal | None:
        """The principal of a console session made with a token of this issuer under
        ``profile`` (``"<name>:<digest>"``): as that profile now stands, None when it is gone
        or changed since (the session ends) or the session's name is not of this issuer."""
        profile_name, _, digest = profile.rpartition(":")
        found = self.config.profiles.get(profile_name)
        if found is None or profile_digest(found) != digest:
            return None
        if not name.startswith(oauth_name(self.config.issuer, "")):
            return None
        return _principal(name, found, expires_at, self.wall)
