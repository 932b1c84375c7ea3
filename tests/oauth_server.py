"""A local OAuth 2.1 authorization server for the gateway's resource-server tests.

aiohttp serves it; joserfc (a JOSE library from PyPI, independent of the PyJWT the gateway
verifies with) signs its tokens, so a token the gateway accepts was not made by the code
that checks it. It serves:

- RFC 8414 metadata at ``/.well-known/oauth-authorization-server``;
- ``/jwks``: the public keys in force (``rotate`` adds a new one and may drop the old;
  ``down`` makes it answer 503, as an outage would);
- ``/token``: the ``client_credentials`` grant (HTTP Basic or ``client_id`` /
  ``client_secret`` in the form), ``scope`` and ``resource`` (RFC 8707: it becomes ``aud``);
- ``/register``: RFC 7591 dynamic registration (a public or a confidential client), and a
  minimal ``/authorize`` for the authorization code flow with PKCE (S256), which approves at
  once (no user to ask), for an MCP client's own flow.

``mint`` makes any token directly, including the bad ones a test needs (wrong ``aud``, an
expired one); ``forged`` makes the ``alg: none`` and HS256-with-the-public-key tokens no
honest library will sign.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer
from joserfc import jwt
from joserfc.jwk import ECKey, RSAKey

__all__ = ["AuthServer", "b64url"]


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class _Client:
    secret: str | None
    redirect_uris: list[str] = field(default_factory=list)


class AuthServer:
    """One authorization server on 127.0.0.1 (port 0). ``issuer`` once started. ``clock``:
    what its tokens' ``iat`` and ``exp`` are counted from: the gateway's wall clock under
    test (``create_app(..., wall_clock=)``), so a token's life is what the test says, however
    slow the machine."""

    def __init__(self, *, default_scope: str = "", clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.keys: list[RSAKey | ECKey] = [self._new_rsa("k1")]
        self.signing: RSAKey | ECKey = self.keys[0]
        self.down = False
        self.jwks_fetches = 0
        self.default_scope = default_scope
        self.clients: dict[str, _Client] = {}
        self._codes: dict[str, dict[str, Any]] = {}
        self._server: TestServer | None = None
        app = web.Application()
        app.router.add_get("/.well-known/oauth-authorization-server", self._metadata)
        app.router.add_get("/jwks", self._jwks)
        app.router.add_post("/token", self._token)
        app.router.add_post("/register", self._register)
        app.router.add_get("/authorize", self._authorize)
        self._app = app

    @staticmethod
    def _new_rsa(kid: str) -> RSAKey:
        return RSAKey.generate_key(2048, parameters={"kid": kid, "use": "sig"}, private=True)

    async def start(self) -> AuthServer:
        self._server = TestServer(self._app, host="127.0.0.1")
        await self._server.start_server()
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.close()

    @property
    def issuer(self) -> str:
        assert self._server is not None and self._server.port is not None
        return f"http://127.0.0.1:{self._server.port}"

    def add_client(self, client_id: str, secret: str | None) -> None:
        self.clients[client_id] = _Client(secret)

    # --- keys ----------------------------------------------------------------------------

    def rotate(self, kid: str, *, drop_old: bool = False, ec: bool = False) -> None:
        """A new signing key ``kid`` (RSA, or EC P-256), published from now on."""
        key: RSAKey | ECKey = (
            ECKey.generate_key("P-256", parameters={"kid": kid, "use": "sig"}, private=True)
            if ec
            else self._new_rsa(kid)
        )
        self.keys = [key] if drop_old else [*self.keys, key]
        self.signing = key

    def unpublished(self, kid: str) -> RSAKey:
        """A key the JWKS does not show (yet): sign with it to present an unknown ``kid``."""
        return self._new_rsa(kid)

    # --- tokens --------------------------------------------------------------------------

    def claims(self, **overrides: Any) -> dict[str, Any]:
        now = int(self.clock())
        claims: dict[str, Any] = {
            "iss": self.issuer,
            "sub": "agent-1",
            "aud": "https://gw.example",
            "iat": now,
            "exp": now + 300,
            "scope": self.default_scope,
            "client_id": "agent",
        }
        claims.update(overrides)
        return {k: v for k, v in claims.items() if v is not None}

    def mint(self, key: RSAKey | ECKey | None = None, alg: str | None = None, **claims: Any) -> str:
        key = key or self.signing
        alg = alg or ("ES256" if isinstance(key, ECKey) else "RS256")
        header = {"alg": alg, "kid": key.kid, "typ": "at+jwt"}
        return jwt.encode(header, self.claims(**claims), key)

    def forged(self, alg: str, **claims: Any) -> str:
        """``alg: none`` (no signature) or ``HS256`` keyed with the RSA public key's PEM (the
        key confusion attack). Built by hand: joserfc, rightly, makes neither."""
        header = {"alg": alg, "kid": self.signing.kid, "typ": "at+jwt"}
        signing_input = (
            b64url(json.dumps(header).encode())
            + "."
            + b64url(json.dumps(self.claims(**claims)).encode())
        )
        if alg == "none":
            return signing_input + "."
        secret = self.signing.as_pem(private=False)
        mac = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
        return signing_input + "." + b64url(mac)

    # --- routes --------------------------------------------------------------------------

    async def _metadata(self, request: web.Request) -> web.Response:
        base = self.issuer
        return web.json_response(
            {
                "issuer": base,
                "jwks_uri": f"{base}/jwks",
                "token_endpoint": f"{base}/token",
                "authorization_endpoint": f"{base}/authorize",
                "registration_endpoint": f"{base}/register",
                "grant_types_supported": ["client_credentials", "authorization_code"],
                "response_types_supported": ["code"],
                "code_challenge_methods_supported": ["S256"],
                "token_endpoint_auth_methods_supported": [
                    "client_secret_basic", "client_secret_post", "none",
                ],
            }
        )  # fmt: skip

    async def _jwks(self, request: web.Request) -> web.Response:
        self.jwks_fetches += 1
        if self.down:
            return web.json_response({"error": "down"}, status=503)
        return web.json_response({"keys": [k.as_dict(private=False) for k in self.keys]})

    async def _register(self, request: web.Request) -> web.Response:
        body = await request.json()
        client_id = "dyn-" + secrets.token_hex(4)
        public = body.get("token_endpoint_auth_method") == "none"
        secret = None if public else secrets.token_urlsafe(16)
        self.clients[client_id] = _Client(secret, list(body.get("redirect_uris") or []))
        answer = {**body, "client_id": client_id, "client_id_issued_at": int(self.clock())}
        if secret is not None:
            answer["client_secret"] = secret
        return web.json_response(answer, status=201)

    async def _authorize(self, request: web.Request) -> web.Response:
        q = request.query
        client = self.clients.get(q.get("client_id", ""))
        if client is None or q.get("code_challenge_method") != "S256":
            return web.json_response({"error": "invalid_request"}, status=400)
        code = secrets.token_urlsafe(16)
        self._codes[code] = {
            "client_id": q["client_id"],
            "challenge": q["code_challenge"],
            "scope": q.get("scope", self.default_scope),
            "resource": q.get("resource"),
            "redirect_uri": q.get("redirect_uri"),
        }
        sep = "&" if "?" in q["redirect_uri"] else "?"
        location = f"{q['redirect_uri']}{sep}code={code}&state={q.get('state', '')}"
        raise web.HTTPFound(location)

    def _client_of(self, request: web.Request, form: Any) -> str | None:
        header = request.headers.get("Authorization", "")
        if header.startswith("Basic "):
            from urllib.parse import unquote

            raw = base64.b64decode(header[6:]).decode()
            client_id, _, secret = raw.partition(":")
            client_id, secret = unquote(client_id), unquote(secret)
        else:
            client_id, secret = form.get("client_id", ""), form.get("client_secret")
        client = self.clients.get(client_id)
        if client is None or (client.secret is not None and client.secret != secret):
            return None
        return client_id

    async def _token(self, request: web.Request) -> web.Response:
        form = await request.post()
        client_id = self._client_of(request, form)
        if client_id is None:
            return web.json_response({"error": "invalid_client"}, status=401)
        grant = form.get("grant_type")
        if grant == "client_credentials":
            scope, resource = str(form.get("scope", self.default_scope)), form.get("resource")
        elif grant == "authorization_code":
            grant_of = self._codes.pop(str(form.get("code", "")), None)
            verifier = str(form.get("code_verifier", ""))
            digest = b64url(hashlib.sha256(verifier.encode()).digest())
            if (
                grant_of is None
                or grant_of["client_id"] != client_id
                or digest != grant_of["challenge"]
            ):
                return web.json_response({"error": "invalid_grant"}, status=400)
            scope, resource = grant_of["scope"], form.get("resource") or grant_of["resource"]
        else:
            return web.json_response({"error": "unsupported_grant_type"}, status=400)
        token = self.mint(sub=client_id, client_id=client_id, scope=scope,
                          aud=str(resource) if resource else "https://gw.example")  # fmt: skip
        return web.json_response(
            {"access_token": token, "token_type": "Bearer", "expires_in": 300, "scope": scope}
        )
