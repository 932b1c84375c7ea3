"""``fencegate serve --workers N``: one supervisor process and N forked workers.

Why this shape (docs/decisions.md, "Issue 13: worker processes"): the supervisor binds every
listening socket itself, one ``SO_REUSEPORT`` socket per worker, before it forks, so

- the kernel spreads connections over the workers by their address (a shared accept queue
  lets whichever worker wakes first take a whole burst of connections, and they stay on it);
- a port taken by anyone (another gateway included) fails once, in the supervisor, before any
  worker starts: ``bind_sockets`` first binds without ``SO_REUSEPORT``, which no listener lets
  through, so a second ``--workers`` gateway cannot silently join the first's group;
- a worker that dies leaves its socket open in the supervisor: the connections the kernel
  queued on it wait for the restarted worker instead of being reset, and a restart never
  binds again.

Workers are forked, not spawned, so each starts from the config the supervisor validated (a
file edited since cannot give the workers different configs); each builds its own app, store
connections and HTTP client after the fork. The supervisor runs no event loop and no thread,
so the fork copies nothing half-done.

Signals: the supervisor keeps SIGINT, SIGTERM, SIGHUP and SIGCHLD blocked and takes them
with ``sigtimedwait``; a forked worker inherits them blocked and ``unblock_stop_signals``
(called once its event loop handles them) lets a signal that arrived meanwhile through, so
none is lost between the fork and the loop. SIGTERM/SIGINT are passed on to every worker
(each drains and exits) and the supervisor exits after the last; SIGHUP is passed on (each
worker reloads ``[auth]``). A worker that exits on its own after it listened is restarted, at
most ``_MAX_RESTARTS`` times per ``_RESTART_WINDOW_S`` (a crash loop stops the gateway with
exit 1, for the service manager to see); one that exits before it listened is a start-up
failure, which a restart would repeat: the supervisor stops the others and exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import select
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
from aiohttp import web

from fencegate.gateway.console.session import SECRET_ENV
from fencegate.gateway.mcp_sessions import SECRET_ENV as SESSION_SECRET_ENV
from fencegate.gateway.request_guard import GuardedSite

if TYPE_CHECKING:
    import ssl

__all__ = [
    "STOP_SIGNALS",
    "SocketSite",
    "Supervisor",
    "bind_sockets",
    "check_platform",
    "unblock_stop_signals",
]

#: What a worker handles in its event loop; blocked from the fork until then.
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
_SUPERVISED = STOP_SIGNALS | {signal.SIGCHLD}
#: More restarts than this within the window is a crash loop: the gateway stops (exit 1).
_MAX_RESTARTS = 5
_RESTART_WINDOW_S = 60.0
#: How often the supervisor looks at the workers' "listening" pipes between signals.
_TICK_S = 0.1
_PR_SET_PDEATHSIG = 1

#: What a worker runs in the forked process: its index, its sockets and the callback that
#: tells the supervisor it listens; returns the process's exit code.
WorkerMain = Callable[[int, Sequence[socket.socket], Callable[[], None]], int]


def check_platform(workers: int) -> str | None:
    """Why ``workers`` processes cannot run here (None: they can). Only Linux spreads the
    connections of one port over several ``SO_REUSEPORT`` listeners."""
    if workers > 1 and (sys.platform != "linux" or not hasattr(socket, "SO_REUSEPORT")):
        return f"server.workers = {workers} needs Linux (SO_REUSEPORT); this is {sys.platform}"
    return None


def bind_sockets(host: str, port: int, count: int, backlog: int = 128) -> list[list[socket.socket]]:
    """``count`` listening sockets per address ``host`` resolves to (``localhost`` may be two),
    all bound to ``port`` with ``SO_REUSEPORT``: ``result[i]`` are worker ``i``'s. Raises
    OSError (EADDRINUSE...) when anyone listens there already, before binding any of them.
    Port 0: the first socket gets a free port from the system and every other one binds
    that same port."""
    addresses = list(
        dict.fromkeys(
            (family, sockaddr[:2])
            for family, _, _, _, sockaddr in socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
            if family in (socket.AF_INET, socket.AF_INET6)
        )
    )
    for family, address in addresses if port else ():
        # No SO_REUSEPORT here: this bind fails if anything, even a reuseport group, listens.
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(address)
    slots: list[list[socket.socket]] = [[] for _ in range(count)]
    bound_port = port
    try:
        for family, address in addresses:
            for slot in slots:
                sock = socket.socket(family, socket.SOCK_STREAM)
                slot.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((address[0], bound_port))
                bound_port = sock.getsockname()[1]  # for port 0: the one the system picked
                sock.listen(backlog)
                sock.setblocking(False)
    except OSError:
        for slot in slots:
            for sock in slot:
                sock.close()
        raise
    return slots


def unblock_stop_signals() -> None:
    """Let SIGINT, SIGTERM and SIGHUP through again (a forked worker, once its event loop
    handles them; a no-op where they were never blocked)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@dataclass
class _Worker:
    index: int
    pid: int
    #: Read end of the pipe the worker writes one byte to once it listens.
    ready_fd: int
    started: float
    ready: bool = False


class Supervisor:
    """Forks the workers, passes signals on, restarts the ones that die; ``run`` returns the
    exit code of ``fencegate serve``."""

    def __init__(self, slots: list[list[socket.socket]], worker_main: WorkerMain) -> None:
        self._slots = slots
        self._main = worker_main
        self._workers: dict[int, _Worker] = {}
        self._restarts: deque[float] = deque()
        self._restarted = 0
        self._log = structlog.get_logger("fencegate")
        self._parent = os.getpid()

    def run(self) -> int:
        # One console cookie key for every worker, restarted ones included: without
        # FENCEGATE_CONSOLE_SECRET each process would draw its own, and a console login would
        # hold only on the worker the kernel happened to pick (docs/console.md).
        os.environ.setdefault(SECRET_ENV, secrets.token_urlsafe(32))
        # The same for the key that binds MCP session ids to their principal: a session
        # opened on one worker must be accepted by the others (gateway/mcp_sessions.py).
        os.environ.setdefault(SESSION_SECRET_ENV, secrets.token_urlsafe(32))
        signal.pthread_sigmask(signal.SIG_BLOCK, _SUPERVISED)
        try:
            return self._supervise()
        finally:
            self._close_sockets()
            for worker in self._workers.values():
                with contextlib.suppress(OSError):
                    os.close(worker.ready_fd)

    def _supervise(self) -> int:
        for index in range(len(self._slots)):
            self._fork(index, restarts=0)
        stopping_since: float | None = None
        failed = False
        while self._workers:
            info = signal.sigtimedwait(_SUPERVISED, _TICK_S)
            while info is not None:
                signum = signal.Signals(info.si_signo)
                if signum in (signal.SIGINT, signal.SIGTERM):
                    if stopping_since is None:  # passed on once: a worker may be past its loop
                        self._log.info("gateway.stopping", signal=signum.name)
                        stopping_since = time.monotonic()
                        self._close_sockets()
                        self._signal_all(signum)
                elif signum == signal.SIGHUP:
                    self._signal_all(signum)
                info = signal.sigtimedwait(_SUPERVISED, 0)
            self._read_ready()
            for worker, status in self._reap():
                if stopping_since is not None:
                    failed = failed or status != 0
                    continue
                if self._may_restart(worker):
                    self._exited(worker, status, "restart")
                    self._restarted += 1
                    self._fork(worker.index, restarts=self._restarted)
                else:
                    self._exited(worker, status, "stop")
                    failed = True
                    stopping_since = time.monotonic()
                    self._close_sockets()
                    self._signal_all(signal.SIGTERM)
        assert stopping_since is not None
        self._log.info(
            "gateway.stopped", drain_ms=round((time.monotonic() - stopping_since) * 1000)
        )
        return 1 if failed else 0

    def _fork(self, index: int, restarts: int) -> None:
        read_fd, write_fd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the worker: never returns into the supervisor's code
            code = 1
            try:
                os.close(read_fd)
                code = self._worker(index, write_fd)
            except BaseException:
                self._log.exception("gateway.worker_crashed", worker=index)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(write_fd)
        self._workers[pid] = _Worker(index, pid, read_fd, time.monotonic())
        self._log.info("gateway.worker_started", worker=index, pid=pid, restarts=restarts)

    def _worker(self, index: int, ready_fd: int) -> int:
        for other, slot in enumerate(self._slots):
            if other != index:
                for sock in slot:
                    sock.close()
        for worker in self._workers.values():
            os.close(worker.ready_fd)
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        self._die_with_supervisor()
        structlog.contextvars.bind_contextvars(worker=index)

        def listening() -> None:
            with contextlib.suppress(OSError):
                os.write(ready_fd, b".")
                os.close(ready_fd)

        return self._main(index, self._slots[index], listening)

    def _die_with_supervisor(self) -> None:
        """A supervisor killed with SIGKILL cannot pass SIGTERM on: the kernel does (Linux),
        so no worker goes on serving unsupervised. It arrives blocked, and drains like any."""
        if sys.platform != "linux":
            return
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != self._parent:  # it died before the line above
            os.kill(os.getpid(), signal.SIGTERM)

    def _read_ready(self) -> None:
        pending = {w.ready_fd: w for w in self._workers.values() if not w.ready}
        if not pending:
            return
        readable, _, _ = select.select(list(pending), [], [], 0)
        for fd in readable:
            self._check_ready(pending[fd])

    @staticmethod
    def _check_ready(worker: _Worker) -> None:
        if worker.ready:
            return
        try:
            worker.ready = os.read(worker.ready_fd, 1) == b"."
        except BlockingIOError:
            return

    def _reap(self) -> list[tuple[_Worker, int]]:
        """Workers that exited since the last look, with their wait status."""
        out: list[tuple[_Worker, int]] = []
        while self._workers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            worker = self._workers.pop(pid, None)
            if worker is None:
                continue
            os.set_blocking(worker.ready_fd, False)
            self._check_ready(worker)  # it may have listened, then died before we looked
            os.close(worker.ready_fd)
            out.append((worker, status))
        return out

    def _may_restart(self, worker: _Worker) -> bool:
        if not worker.ready:
            return False
        now = time.monotonic()
        while self._restarts and self._restarts[0] < now - _RESTART_WINDOW_S:
            self._restarts.popleft()
        if len(self._restarts) >= _MAX_RESTARTS:
            return False
        self._restarts.append(now)
        return True

    def _exited(self, worker: _Worker, status: int, action: str) -> None:
        killed = os.WIFSIGNALED(status)
        self._log.warning(
            "gateway.worker_exited",
            worker=worker.index,
            pid=worker.pid,
            exit_code=None if killed else os.waitstatus_to_exitcode(status),
            signal=signal.Signals(os.WTERMSIG(status)).name if killed else None,
            listened=worker.ready,
            uptime_ms=round((time.monotonic() - worker.started) * 1000),
            action=action,
        )

    def _signal_all(self, signum: signal.Signals) -> None:
        for pid in self._workers:
            try:
                os.kill(pid, signum)
            except OSError as exc:  # exited, not yet reaped
                if exc.errno != errno.ESRCH:
                    raise

    def _close_sockets(self) -> None:
        """The supervisor's copies: once a worker closes its own, nothing accepts there."""
        for slot in self._slots:
            for sock in slot:
                sock.close()


class SocketSite(GuardedSite):
    """A ``GuardedSite`` on a socket the supervisor bound (``GuardedSite`` binds its own)."""

    __slots__ = ("_sock",)

    def __init__(
        self,
        runner: web.BaseRunner,
        sock: socket.socket,
        host: str,
        port: int,
        factory: Callable[[], web.RequestHandler],
        *,
        ssl_context: ssl.SSLContext | None = None,
        ssl_handshake_timeout: float | None = None,
    ) -> None:
        super().__init__(
            runner,
            host,
            port,
            factory,
            ssl_context=ssl_context,
            ssl_handshake_timeout=ssl_handshake_timeout,
        )
        self._sock = sock

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site; GuardedSite.start would bind
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._factory,
            sock=self._sock,
            backlog=self._backlog,
            ssl=self._ssl_context,
            ssl_handshake_timeout=self._handshake_timeout,
        )
