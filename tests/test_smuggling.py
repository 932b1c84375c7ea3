"""Request smuggling and path escapes against a real gateway (issue 11, item 7): a raw-socket
corpus, each case either a 4xx with nothing at the downstream, or exactly one well-formed
request at the downstream per request the client legitimately sent.

The gateway is ``fencegate serve`` (SQLite, no ``[auth]``). The downstream is a raw TCP server
written here with its own strict HTTP/1.1 parser (h11 is not a dependency): request line,
header syntax (no obs-fold, no bare LF, no control characters, no space before the colon),
one ``Host``, at most one ``Content-Length`` of digits, ``Transfer-Encoding`` only
``chunked`` and never with ``Content-Length``. It records every complete request and every
byte it could not parse; a smuggled request would show up as an extra record or as garbage.

Each case is sent as raw bytes over one socket. "Legitimately sent" is what a strict
RFC 9112 parser reads from those bytes; every such request carries valid ``Fence-*`` headers
(a task is claimed through the API), so the gateway has no fencing reason to refuse it.
For every answer: a 4xx means that request reached nothing; a 200 means the downstream got
exactly that request once, under its base path ``/base``, with exactly the intended body.
No more answers than requests, and nothing at the downstream that no request asked for.

Parser-level refusals (aiohttp's ``HttpRequestParser``) are problem+json too under
``fencegate serve`` (``GuardedSite``, docs/decisions.md); so is every refusal here.
"""

from __future__ import annotations

import json
import re
import socket
import socketserver
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.servers import Gateways

BASE = "/base"
TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
REQUEST_LINE = re.compile(rb"(" + TOKEN + rb") ([\x21-\x7e]+) HTTP/1\.1")
_VCHAR = rb"[\x21-\x7e\x80-\xff]"
#: ``name: value`` with a token name, no space before the colon, a value of VCHAR, SP, HTAB
HEADER_LINE = re.compile(
    rb"("
    + TOKEN
    + rb"):[ \t]*((?:"
    + _VCHAR
    + rb"(?:[ \t\x21-\x7e\x80-\xff]*"
    + _VCHAR
    + rb")?)?)[ \t]*"
)
#: After the last expected answer, how long to wait for one that should not come.
EXTRA_WAIT_S = 0.25


# --- the strict downstream ----------------------------------------------------------------


@dataclass
class Received:
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes


class Malformed(Exception):
    pass


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _more(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def line(self, limit: int = 16_384) -> bytes | None:
        """One CRLF-terminated line without its CRLF; None at a clean EOF before any byte."""
        while b"\n" not in self.buf:
            if len(self.buf) > limit:
                raise Malformed("line too long")
            if not self._more():
                if self.buf:
                    raise Malformed(f"EOF inside a line: {self.buf[:80]!r}")
                return None
        raw, _, self.buf = self.buf.partition(b"\n")
        if not raw.endswith(b"\r") or b"\r" in raw[:-1]:
            raise Malformed(f"bare LF or stray CR: {raw[:80]!r}")
        return raw[:-1]

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._more():
                raise Malformed("EOF inside a body")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


def read_request(reader: _Reader) -> Received | None:
    first = reader.line()
    if first is None:
        return None
    match = REQUEST_LINE.fullmatch(first)
    if match is None or not match[2].startswith(b"/") or b"#" in match[2]:
        raise Malformed(f"request line: {first[:120]!r}")
    headers: list[tuple[str, str]] = []
    while (line := reader.line()) != b"":
        if line is None:
            raise Malformed("EOF in headers")
        if line[:1] in (b" ", b"\t"):
            raise Malformed("obs-fold")
        header = HEADER_LINE.fullmatch(line)
        if header is None:
            raise Malformed(f"header line: {line[:120]!r}")
        headers.append((header[1].decode().lower(), header[2].decode("latin-1")))
    names = [name for name, _ in headers]
    lengths = [value for name, value in headers if name == "content-length"]
    codings = [value for name, value in headers if name == "transfer-encoding"]
    if names.count("host") != 1:
        raise Malformed("Host must be sent exactly once")
    if len(lengths) > 1 or (lengths and not lengths[0].isdigit()) or (lengths and codings):
        raise Malformed(f"framing: {lengths} {codings}")
    if codings:
        if codings != ["chunked"]:
            raise Malformed(f"transfer-encoding: {codings}")
        body = b""
        while True:
            size_line = reader.line()
            if size_line is None or not re.fullmatch(rb"[0-9A-Fa-f]{1,8}", size_line):
                raise Malformed(f"chunk size: {size_line!r}")
            size = int(size_line, 16)
            if size == 0:
                if reader.line() != b"":
                    raise Malformed("trailers")
                break
            body += reader.exactly(size)
            if reader.exactly(2) != b"\r\n":
                raise Malformed("chunk not followed by CRLF")
    else:
        body = reader.exactly(int(lengths[0])) if lengths else b""
    return Received(match[1].decode(), match[2].decode(), headers, body)


@dataclass
class StrictDownstream:
    received: list[Received] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def serve(self, sock: socket.socket) -> None:
        reader = _Reader(sock)
        while True:
            try:
                request = read_request(reader)
            except Malformed as exc:
                with self.lock:
                    self.malformed.append(str(exc))
                sock.sendall(
                    b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                )
                return
            except OSError:
                return
            if request is None:
                return
            with self.lock:
                self.received.append(request)
            sock.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
            )

    def take(self) -> tuple[list[Received], list[str]]:
        with self.lock:
            out = (self.received[:], self.malformed[:])
            self.received.clear()
            self.malformed.clear()
            return out


def start_downstream() -> tuple[StrictDownstream, socketserver.ThreadingTCPServer]:
    downstream = StrictDownstream()

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            downstream.serve(self.request)

    socketserver.ThreadingTCPServer.daemon_threads = True
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return downstream, server


# --- the gateway and a lease ----------------------------------------------------------------


@dataclass
class Ctx:
    port: int
    fence: dict[str, str]
    downstream: StrictDownstream

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def head(self, slot: str | None) -> str:
        """Host and Fence-* header lines (CRLF-terminated); a Fence-Slot when ``slot``."""
        lines = [f"Host: {self.host}"] + [f"{k}: {v}" for k, v in self.fence.items()]
        if slot is not None:
            lines.append(f"Fence-Slot: {slot}")
        return "".join(line + "\r\n" for line in lines)


def _call(port: int, method: str, path: str, body: object = None) -> dict[str, object]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=10) as resp:
        answer: dict[str, object] = json.loads(resp.read())
        return answer


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ctx]:
    downstream, server = start_downstream()
    root: Path = tmp_path_factory.mktemp("smuggling")
    gateways = Gateways(root)
    try:
        gateway = gateways.start(
            "gw",
            f"sqlite:///{root / 'gw.db'}",
            downstreams=[
                {
                    "name": "api",
                    "url": f"http://127.0.0.1:{server.server_address[1]}{BASE}",
                    "timeout_ms": 3000,
                }
            ],
        )
        port = gateway.port
        _call(port, "PUT", "/v1/tasks/smuggle", {"inputDigest": "in-1"})
        epoch = _call(port, "GET", "/v1/epoch")["schedulerEpoch"]
        lease = _call(
            port,
            "POST",
            "/v1/tasks/smuggle/claim",
            {"owner": "w1", "ttlMs": 60_000, "schedulerEpoch": epoch},
        )
        fence = {
            "Fence-Task": "smuggle",
            "Fence-Attempt": str(lease["attemptId"]),
            "Fence-Generation": str(lease["claimGeneration"]),
            "Fence-Epoch": str(lease["schedulerEpoch"]),
            "Fence-Cancel": str(lease["cancelGeneration"]),
        }
        yield Ctx(port, fence, downstream)
    finally:
        gateways.stop_all()
        server.shutdown()
        server.server_close()


# --- reading the gateway's answers ----------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


def read_answers(sock: socket.socket, expected: int) -> list[Answer]:
    """Answers in order (1xx skipped) until the gateway closes, or ``expected`` have come and
    nothing more arrives within EXTRA_WAIT_S."""
    reader = _Reader(sock)
    answers: list[Answer] = []
    while True:
        sock.settimeout(EXTRA_WAIT_S if len(answers) >= expected else 5.0)
        try:
            status_line = reader.line()
        except (TimeoutError, ConnectionResetError):
            return answers
        except Malformed:
            raise
        if status_line is None:
            return answers
        sock.settimeout(5.0)
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while line := reader.line():
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if 100 <= status < 200:
            continue
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int(reader.line() or b"0", 16):
                body += reader.exactly(size)
                reader.exactly(2)
            reader.line()
        else:
            body = reader.exactly(int(headers.get("content-length", "0")))
        answers.append(Answer(status, headers, body))


# --- the corpus -----------------------------------------------------------------------------


@dataclass
class Sent:
    """One request a strict parser reads from the case's bytes: where it lands downstream if
    forwarded (None: it cannot be forwarded anywhere under the base), its body, and the
    status the gateway gives it (pinned: a change is noticed)."""

    downstream_target: str | None
    body: bytes
    status: int


@dataclass
class Case:
    id: str
    raw: Callable[[Ctx], bytes]
    sent: list[Sent]
    #: when the gateway closes after a refusal, later requests get no answer at all
    answers: int | None = None


def post(c: Ctx, target: str, slot: str, extra: str, body: bytes) -> bytes:
    return f"POST {target} HTTP/1.1\r\n{c.head(slot)}{extra}\r\n".encode() + body


def get(c: Ctx, target: str, extra: str = "") -> bytes:
    return f"GET {target} HTTP/1.1\r\n{c.head(None)}{extra}\r\n".encode()


def _hidden(c: Ctx) -> str:
    """A complete request with valid fence headers, to hide inside another's body."""
    return f"GET /proxy/api/hidden HTTP/1.1\r\n{c.head(None)}\r\n"


CL = "Content-Length"
TE = "Transfer-Encoding"

CASES = [
    # --- framing: Content-Length and Transfer-Encoding
    Case(
        "cl-te",
        lambda c: post(
            c, "/proxy/api/clte", "clte", f"{CL}: 6\r\n{TE}: chunked\r\n", b"0\r\n\r\nG"
        ),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "te-cl",
        lambda c: post(
            c,
            "/proxy/api/tecl",
            "tecl",
            f"{TE}: chunked\r\n{CL}: 3\r\n",
            b"8\r\nSMUGGLED\r\n0\r\n\r\n",
        ),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "cl-te-hidden-request",
        lambda c: (
            post(c, "/proxy/api/clte2", "clte2", f"{CL}: 4\r\n{TE}: chunked\r\n", b"0\r\n\r\n")
            + _hidden(c).encode()
        ),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "duplicate-cl-same",
        lambda c: post(c, "/proxy/api/dcl", "dcl", f"{CL}: 5\r\n{CL}: 5\r\n", b"hello"),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "duplicate-cl-different",
        lambda c: post(
            c,
            "/proxy/api/dcl2",
            "dcl2",
            f"{CL}: 5\r\n{CL}: 10\r\n",
            b"hello" + _hidden(c).encode()[:5],
        ),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "cl-list",
        lambda c: post(c, "/proxy/api/cll", "cll", f"{CL}: 5, 5\r\n", b"hello"),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "cl-plus-sign",
        lambda c: post(c, "/proxy/api/clp", "clp", f"{CL}: +5\r\n", b"hello"),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "te-chunked-identity",
        lambda c: post(
            c, "/proxy/api/tci", "tci", f"{TE}: chunked, identity\r\n", b"5\r\nhello\r\n0\r\n\r\n"
        ),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "te-identity-chunked",  # chunked last: aiohttp decodes it; one clean forward
        lambda c: post(
            c, "/proxy/api/tic", "tic", f"{TE}: identity, chunked\r\n", b"5\r\nhello\r\n0\r\n\r\n"
        ),
        [Sent(f"{BASE}/tic", b"hello", 200)],
    ),
    Case(
        "te-space-before-colon",
        lambda c: post(
            c, "/proxy/api/tsp", "tsp", f"{TE} : chunked\r\n{CL}: 3\r\n", b"5\r\nhello\r\n0\r\n\r\n"
        ),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "te-twice",
        lambda c: post(
            c,
            "/proxy/api/tt",
            "tt",
            f"{TE}: chunked\r\n{TE}: chunked\r\n",
            b"5\r\nhello\r\n0\r\n\r\n",
        ),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "te-unknown",
        lambda c: post(c, "/proxy/api/tx", "tx", f"{TE}: xchunked\r\n", b"5\r\nhello\r\n0\r\n\r\n"),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    # --- chunked bodies
    Case(
        "chunked-ok",
        lambda c: post(
            c,
            "/proxy/api/chk",
            "chk",
            f"{TE}: chunked\r\n",
            b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        ),
        [Sent(f"{BASE}/chk", b"hello world", 200)],
    ),
    Case(
        "chunk-size-0x",
        lambda c: post(
            c, "/proxy/api/c0x", "c0x", f"{TE}: chunked\r\n", b"0x5\r\nhello\r\n0\r\n\r\n"
        ),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "chunk-size-negative",
        lambda c: post(
            c, "/proxy/api/cneg", "cneg", f"{TE}: chunked\r\n", b"-5\r\nhello\r\n0\r\n\r\n"
        ),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "chunk-size-huge",
        lambda c: post(
            c,
            "/proxy/api/chuge",
            "chuge",
            f"{TE}: chunked\r\n",
            b"ffffffffffffffffff1\r\nhello\r\n0\r\n\r\n",
        ),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "chunk-extension",
        lambda c: post(
            c,
            "/proxy/api/cext",
            "cext",
            f"{TE}: chunked\r\n",
            b"5;name=value\r\nhello\r\n0\r\n\r\n",
        ),
        [Sent(f"{BASE}/cext", b"hello", 200)],
    ),
    Case(
        "chunk-without-crlf",
        lambda c: post(c, "/proxy/api/cnc", "cnc", f"{TE}: chunked\r\n", b"5\r\nhelloXX0\r\n\r\n"),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "request-after-chunked-body",  # pipelined: legitimately a second request
        lambda c: (
            post(c, "/proxy/api/after", "after", f"{TE}: chunked\r\n", b"5\r\nhello\r\n0\r\n\r\n")
            + _hidden(c).encode()
        ),
        [Sent(f"{BASE}/after", b"hello", 200), Sent(f"{BASE}/hidden", b"", 200)],
    ),
    Case(
        "request-inside-cl-body",  # the hidden request is body bytes, never a request
        lambda c: post(
            c, "/proxy/api/inside", "inside", f"{CL}: {len(_hidden(c))}\r\n", _hidden(c).encode()
        ),
        [Sent(f"{BASE}/inside", b"", 200)],
    ),
    # --- header syntax
    Case(
        "obs-fold",
        lambda c: get(c, "/proxy/api/fold", f"X-A: 1\r\n {TE}: chunked\r\n"),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "bare-lf",
        lambda c: get(c, "/proxy/api/lf").replace(b"\r\n", b"\n"),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "bare-lf-one-header",
        lambda c: get(c, "/proxy/api/lf1", f"X-A: 1\n{TE}: chunked\r\n"),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "nul-in-value",
        lambda c: get(c, "/proxy/api/nul", "X-A: a\x00b\r\n"),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "cr-in-value",
        lambda c: get(c, "/proxy/api/cr", f"X-A: a\rb{TE}: chunked\r\n"),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "overlong-header",
        lambda c: get(c, "/proxy/api/long", "X-A: " + "a" * 20_000 + "\r\n"),
        [Sent(None, b"", 400)],
        answers=1,
    ),
    Case(
        "two-hosts",
        lambda c: get(c, "/proxy/api/hosts", "Host: evil.example\r\n"),
        [Sent(None, b"", 400)],
    ),
    Case(
        "expect-100-continue",
        lambda c: post(
            c, "/proxy/api/expect", "expect", f"{CL}: 5\r\nExpect: 100-continue\r\n", b"hello"
        ),
        [Sent(f"{BASE}/expect", b"hello", 200)],
    ),
    Case(
        "pipelined",
        lambda c: (
            get(c, "/proxy/api/p1")
            + get(c, "/proxy/api/p2")
            + post(c, "/proxy/api/p3", "p3", f"{CL}: 3\r\n", b"abc")
        ),
        [
            Sent(f"{BASE}/p1", b"", 200),
            Sent(f"{BASE}/p2", b"", 200),
            Sent(f"{BASE}/p3", b"abc", 200),
        ],
    ),
    Case(
        "pipelined-after-refused-path",
        lambda c: get(c, "/proxy/api/../x") + get(c, "/proxy/api/p4"),
        [Sent(None, b"", 400), Sent(f"{BASE}/p4", b"", 200)],
    ),
    # --- request targets
    Case(
        "absolute-form", lambda c: get(c, f"http://{c.host}/proxy/api/abs"), [Sent(None, b"", 400)]
    ),
    Case(
        "absolute-form-other-host",
        lambda c: get(c, "http://evil.example/proxy/api/abs"),
        [Sent(None, b"", 400)],
    ),
    Case("authority-form", lambda c: get(c, f"{c.host}"), [Sent(None, b"", 400)], answers=1),
    Case("dot-dot", lambda c: get(c, "/proxy/api/a/../../admin"), [Sent(None, b"", 400)]),
    Case(
        "encoded-dot-dot",
        lambda c: get(c, "/proxy/api/a/%2e%2E/%2e%2e/admin"),
        [Sent(None, b"", 400)],
    ),
    Case(
        "encoded-slash", lambda c: get(c, "/proxy/api/a%2f..%2f..%2fadmin"), [Sent(None, b"", 400)]
    ),
    Case(
        "encoded-backslash", lambda c: get(c, "/proxy/api/a%5c..%5cadmin"), [Sent(None, b"", 400)]
    ),
    Case(
        "double-encoded",  # a downstream that decodes twice reads .. (issue 25)
        lambda c: get(c, "/proxy/api/a/%252e%252e/%252fadmin"),
        [Sent(None, b"", 400)],
    ),
    Case(
        "double-encoded-name",  # %252f decodes to a slash, but no piece is a dot segment
        lambda c: get(c, "/proxy/api/a/b%252fc"),
        [Sent(f"{BASE}/a/b%252fc", b"", 200)],
    ),
    Case(
        "path-parameter-dot-dot", lambda c: get(c, "/proxy/api/a/..;/admin"), [Sent(None, b"", 400)]
    ),
    Case(
        "path-parameter-encoded",
        lambda c: get(c, "/proxy/api/a/%2e%2e;x=1/admin"),
        [Sent(None, b"", 400)],
    ),
    Case(
        "percent-u-dot-dot",
        lambda c: get(c, "/proxy/api/a/%u002e%u002e/admin"),
        [Sent(None, b"", 400)],
    ),
    Case(
        "fullwidth-dot-dot",
        lambda c: get(c, "/proxy/api/a/%EF%BC%8E%EF%BC%8E/admin"),
        [Sent(None, b"", 400)],
    ),
    Case("fragment", lambda c: get(c, "/proxy/api/frag#/../../admin"), [Sent(None, b"", 400)]),
    Case(
        "fragment-plain", lambda c: get(c, "/proxy/api/frag2#x"), [Sent(f"{BASE}/frag2", b"", 200)]
    ),
    Case(
        "dot-dot-in-query",  # the query is not a path: it stays a query under the base
        lambda c: get(c, "/proxy/api/q?next=/../../admin"),
        [Sent(f"{BASE}/q?next=/../../admin", b"", 200)],
    ),
]
# the body of "request-inside-cl-body" depends on the context; it is the hidden request's bytes
_INSIDE = next(case for case in CASES if case.id == "request-inside-cl-body")


def _expected_body(case: Case, sent: Sent, c: Ctx) -> bytes:
    return _hidden(c).encode() if case is _INSIDE else sent.body


#: Cases that reveal a bug not fixed here (strict: fixing it turns the xfail into a failure).
KNOWN_BUGS: dict[str, str] = {}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            case,
            id=case.id,
            marks=[pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[case.id])]
            if case.id in KNOWN_BUGS
            else [],
        )
        for case in CASES
    ],
)
def test_smuggling_corpus(ctx: Ctx, case: Case) -> None:
    ctx.downstream.take()
    with socket.create_connection(("127.0.0.1", ctx.port), timeout=5) as sock:
        sock.sendall(case.raw(ctx))
        answers = read_answers(sock, len(case.sent))
    time.sleep(0.05)  # a forward answered is recorded; this only catches stragglers
    received, malformed = ctx.downstream.take()
    statuses = [answer.status for answer in answers]
    assert not malformed, malformed
    assert len(answers) == (case.answers if case.answers is not None else len(case.sent)), statuses
    assert statuses == [sent.status for sent in case.sent][: len(answers)], answers
    forwarded = []
    for answer, sent in zip(answers, case.sent, strict=False):
        if 400 <= answer.status < 500:
            assert answer.headers["content-type"] == "application/problem+json", answer
            assert json.loads(answer.body)["status"] == answer.status
        else:
            assert answer.status == 200 and answer.body == b"ok", answer
            forwarded.append(sent)
    assert len(received) == len(forwarded), [r.target for r in received]
    for got, sent in zip(received, forwarded, strict=True):
        assert got.target == sent.downstream_target
        assert got.body == _expected_body(case, sent, ctx)
        path = got.target.partition("?")[0]
        assert path.startswith(BASE + "/")
        assert ".." not in unquote(path).split("/")
        assert [name for name, _ in got.headers].count("host") == 1
