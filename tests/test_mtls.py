"""mTLS on the listener (docs/security.md, "mTLS"): a real ``fencegate serve`` with
``tls_cert_file``, ``tls_key_file`` and ``tls_client_ca_file``, principals found by their
client certificate's CN, and the config checks that name the key at fault.

Certificates come from the ``openssl`` command line (EC P-256, so generating them is quick):
a CA, a server certificate for 127.0.0.1 and localhost, client certificates ``worker-1`` and
``scheduler-1`` from that CA, and a ``worker-1`` from another CA (same CN: only the CA tells
it apart).
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import socket
import ssl
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import ValidationError

from fencegate.gateway.config import Config, ConfigError, load_config
from fencegate.gateway.request_guard import origin_allowed
from tests.servers import GatewayProcess

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")

SCHEDULER_TOKEN = "tok-scheduler-mtls-0123456789"


def _openssl(directory: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)


def _key(directory: Path, name: str) -> None:
    _openssl(directory, "ecparam", "-name", "prime256v1", "-genkey", "-noout",
             "-out", f"{name}.key")  # fmt: skip


def _ca(directory: Path, name: str) -> None:
    _key(directory, name)
    _openssl(directory, "req", "-x509", "-new", "-key", f"{name}.key", "-out", f"{name}.pem",
             "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip


def _signed(directory: Path, name: str, cn: str, ca: str, extensions: str) -> None:
    _key(directory, name)
    _openssl(directory, "req", "-new", "-key", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={cn}")  # fmt: skip
    (directory / f"{name}.ext").write_text(
        extensions + "\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
    )
    _openssl(directory, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem",
             "-CAkey", f"{ca}.key", "-CAcreateserial", "-out", f"{name}.pem", "-days", "2",
             "-extfile", f"{name}.ext")  # fmt: skip


@dataclass
class Pki:
    directory: Path

    def path(self, name: str) -> str:
        return str(self.directory / name)

    def client(self, cert: str | None) -> ssl.SSLContext:
        """A client trusting the gateway's CA, presenting ``cert`` (None: no certificate)."""
        context = ssl.create_default_context(cafile=self.path("ca.pem"))
        if cert is not None:
            context.load_cert_chain(self.path(f"{cert}.pem"), self.path(f"{cert}.key"))
        return context


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    _ca(directory, "ca")
    _ca(directory, "other-ca")
    _signed(directory, "server", "localhost", "ca",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth")  # fmt: skip
    for name, cn, ca in (
        ("worker", "worker-1", "ca"),
        ("scheduler", "scheduler-1", "ca"),
        ("stranger", "worker-1", "other-ca"),
    ):
        _signed(directory, name, cn, ca, "extendedKeyUsage=clientAuth")
    return Pki(directory)


def _config_text(pki: Pki, port: int, db: Path) -> str:
    digest = hashlib.sha256(SCHEDULER_TOKEN.encode()).hexdigest()
    return f"""
[server]
listen = "127.0.0.1:{port}"
tls_cert_file = "{pki.path("server.pem")}"
tls_key_file = "{pki.path("server.key")}"
tls_client_ca_file = "{pki.path("ca.pem")}"

[store]
url = "sqlite:///{db}"

[auth]
[[auth.principals]]
name = "worker-1"
roles = ["worker"]
certificate_cn = "worker-1"

[[auth.principals]]
name = "scheduler-1"
roles = ["scheduler"]
certificate_cn = "scheduler-1"
token_sha256 = "{digest}"
"""


@pytest.fixture(scope="module")
def gateway(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    directory = tmp_path_factory.mktemp("mtls-gateway")
    port = 0  # the system picks it when the gateway binds; GatewayProcess reads it back
    config_path = directory / "fencegate.toml"
    config_path.write_text(_config_text(pki, port, directory / "fg.db"))
    process = GatewayProcess(config_path, port).start()
    try:
        yield process
    finally:
        process.stop()


async def _call(
    gateway: GatewayProcess,
    context: ssl.SSLContext,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    url = f"https://127.0.0.1:{gateway.port}{path}"
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
        session.request(method, url, json=body, headers=headers, ssl=context) as resp,
    ):
        answer = resp.status, await resp.json(content_type=None) if await resp.read() else None
    # aiohttp's advice for TLS: give the closed connections' shutdown a moment to finish
    # (otherwise asyncio may report an unclosed transport at the end of the test).
    await asyncio.sleep(0.1)
    return answer


async def test_a_worker_certificate_claims_and_a_scheduler_certificate_may_not(
    gateway: GatewayProcess, pki: Pki
) -> None:
    worker, scheduler = pki.client("worker"), pki.client("scheduler")
    # Created by the scheduler's certificate; the task for the claim below is created with
    # the scheduler's bearer token sent over the worker's connection (the token counts).
    status, body = await _call(gateway, scheduler, "PUT", "/v1/tasks/mtls-0",
                               {"inputDigest": "in-0"})  # fmt: skip
    assert status in (200, 201), body
    status, body = await _call(gateway, worker, "PUT", "/v1/tasks/mtls-1", {"inputDigest": "in-1"},
                               {"Fence-Authorization": f"Bearer {SCHEDULER_TOKEN}"})  # fmt: skip
    assert status in (200, 201), body
    status, body = await _call(gateway, worker, "GET", "/v1/epoch")
    assert status == 200, body
    claim = {"owner": "w1", "ttlMs": 10_000, "schedulerEpoch": body["schedulerEpoch"]}

    status, body = await _call(gateway, scheduler, "POST", "/v1/tasks/mtls-1/claim", claim)
    assert (status, body["code"]) == (403, "FORBIDDEN"), body
    assert "'scheduler-1'" in body["detail"]

    status, body = await _call(gateway, worker, "POST", "/v1/tasks/mtls-1/claim", claim)
    assert status == 200, body
    assert body["attemptId"]

    # A presented bearer token that matches no one is 401 even with a good certificate.
    status, body = await _call(gateway, worker, "GET", "/v1/epoch", headers={
                               "Fence-Authorization": "Bearer nope"})  # fmt: skip
    assert (status, body["code"]) == (401, "UNAUTHENTICATED"), body


def _refused(port: int, context: ssl.SSLContext) -> None:
    """The TLS connection with ``context`` fails before any HTTP answer. In TLS 1.2 the server
    checks the client's certificate inside the handshake; TLS 1.3 finishes the client's side
    of it first, so the refusal (an alert, or a reset) surfaces on the first read. Blocking
    sockets: aiohttp and asyncio leave a transport open after such a failure on 3.11."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        try:
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                tls.sendall(b"GET /v1/epoch HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                got = tls.recv(100)
        except (ssl.SSLError, ConnectionResetError):
            return
    assert not got.startswith(b"HTTP/"), got
    assert got == b"", got  # a plain close without an alert is still no answer


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
@pytest.mark.parametrize("cert", [None, "stranger"], ids=["no-certificate", "other-ca"])
async def test_a_client_without_a_certificate_of_the_ca_fails_the_handshake(
    gateway: GatewayProcess, pki: Pki, cert: str | None, version: ssl.TLSVersion
) -> None:
    context = pki.client(cert)
    context.minimum_version = context.maximum_version = version
    _refused(gateway.port, context)
    # The gateway is still serving.
    assert (await _call(gateway, pki.client("worker"), "GET", "/v1/epoch"))[0] == 200


async def test_default_origins_are_https_when_the_listener_speaks_tls(
    gateway: GatewayProcess, pki: Pki
) -> None:
    worker = pki.client("worker")
    own = f"https://127.0.0.1:{gateway.port}"
    assert (await _call(gateway, worker, "GET", "/v1/epoch", headers={"Origin": own}))[0] == 200
    plain = {"Origin": f"http://127.0.0.1:{gateway.port}"}
    assert (await _call(gateway, worker, "GET", "/v1/epoch", headers=plain))[0] == 403


def test_config_names_the_tls_key_at_fault(pki: Pki, tmp_path: Path) -> None:
    cert, key, ca = pki.path("server.pem"), pki.path("server.key"), pki.path("ca.pem")
    server = Config.model_validate({"server": {"tls_cert_file": cert, "tls_key_file": key}}).server
    assert origin_allowed(server, "https://localhost:8700")
    assert not origin_allowed(server, "http://localhost:8700")

    def error(data: dict[str, Any]) -> str:
        path = tmp_path / "bad.toml"
        lines = []
        for section, values in data.items():
            lines.append(f"[{section}]")
            lines += [f'{k} = "{v}"' for k, v in values.items()]
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(ConfigError) as caught:
            load_config(path)
        return str(caught.value)

    missing = str(tmp_path / "missing.pem")
    assert "server.tls_cert_file: " in error({"server": {"tls_cert_file": missing,
                                                         "tls_key_file": key}})  # fmt: skip
    assert "tls_key_file needs tls_cert_file" in error({"server": {"tls_key_file": key}})
    assert "tls_client_ca_file needs tls_cert_file" in error({"server": {"tls_client_ca_file": ca}})
    with pytest.raises(ValidationError, match=r"certificate_cn needs server\.tls_client_ca_file"):
        Config.model_validate(
            {"auth": {"principals": [{"name": "w", "roles": ["worker"], "certificate_cn": "w"}]}}
        )
    with pytest.raises(ValidationError, match="needs token_sha256, certificate_cn or both"):
        Config.model_validate({"auth": {"principals": [{"name": "w", "roles": ["worker"]}]}})


def test_serve_refuses_a_key_that_does_not_match_the_certificate(pki: Pki) -> None:
    from fencegate.gateway.cli import server_ssl_context

    server = Config.model_validate(
        {"server": {"tls_cert_file": pki.path("server.pem"), "tls_key_file": pki.path("ca.key")}}
    ).server
    with pytest.raises(ConfigError, match=r"server\.tls_cert_file / server\.tls_key_file"):
        server_ssl_context(server)
