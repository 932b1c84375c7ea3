"""PostgreSQL servers the tests start themselves, never the machine's own cluster.

Each ``PostgresServer`` is a fresh ``initdb`` cluster in a directory of its own (under
``/dev/shm`` or ``/tmp``, see ``default_parent``), listening on a free loopback port, so tests
can kill it (``kill -9`` of the whole server), freeze it with SIGSTOP, restart it on the same
data and port, and build a streaming standby of it for failover tests.

Why it looks the way it does:

* The binaries come from ``pg_config --bindir``: Debian keeps ``initdb``, ``postgres`` and
  ``pg_basebackup`` off PATH (``/usr/lib/postgresql/NN/bin``).
* PostgreSQL refuses to run as root and CI runs as root, so the server processes run as the
  ``postgres`` user through ``Popen(user=...)`` rather than a ``su``/``runuser`` wrapper: the
  PID we hold is the postmaster itself, and our signals reach it directly. Its directory is a
  ``mkdtemp`` owned by that user in a world-searchable place, because pytest's ``tmp_path``
  sits under a 0700 root directory the ``postgres`` user cannot enter.
* Every postmaster child calls ``setsid()`` (``InitPostmasterChild``), so neither the
  postmaster's process group nor its session contains the backends. A backend outlives a
  SIGKILL of the postmaster until it notices (a busy one may even commit), and while it
  holds the shared memory a new postmaster refuses to start; SIGSTOP of the postmaster
  alone freezes nothing that serves an open connection. ``kill``/``pause``/``resume``
  therefore signal the postmaster's descendants, found by parent PID in ``/proc``, as well
  as the postmaster (and its process group, for anything that stayed in it).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO
from urllib.parse import quote

from tests.servers import dies_with_us, free_port

__all__ = ["PostgresServer", "Setting", "default_parent", "postgres_bindir"]

#: The values ``postgres -c name=value`` takes; booleans are written ``on``/``off``.
Setting = str | int | float | bool

#: How long a start (including crash recovery), a promotion or a standby's catch-up may take.
READY_TIMEOUT_S = 30.0

#: Server processes run as this user when we are root (``postgres`` will not run as root).
SERVER_USER = "postgres"

#: ``shmctl`` command that removes a SysV shared memory segment (Linux ``<sys/ipc.h>``).
IPC_RMID = 0

#: ``/dev/shm`` is used for data only with this much free (see ``default_parent``).
SHM_MIN_FREE_BYTES = 2 * 1024**3

_live: set[PostgresServer] = set()


@functools.cache
def postgres_bindir() -> Path:
    """Where ``initdb``, ``postgres`` and friends are: ``pg_config --bindir``."""
    pg_config = shutil.which("pg_config")
    if pg_config is None:
        raise RuntimeError(
            "pg_config is not installed, so the PostgreSQL server binaries cannot be found; "
            ".ci/run installs them (apt-get install -y postgresql)"
        )
    done = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=True)
    bindir = Path(done.stdout.strip())
    if not (bindir / "initdb").exists() or not (bindir / "postgres").exists():
        raise RuntimeError(
            f"pg_config --bindir is {bindir}, which has no initdb/postgres: only the client "
            "is installed; .ci/run installs the server (apt-get install -y postgresql)"
        )
    return bindir


def default_parent() -> str:
    """Where servers' directories go: ``/dev/shm`` when it is a roomy tmpfs, else ``/tmp``.

    On a disk, ``initdb`` and ``CREATE DATABASE`` are dominated by creating hundreds of small
    files (measured on ext4 here: a start 1.0-1.3 s, a database 250 ms; on tmpfs 0.35 s and
    25 ms). Memory loses nothing a test can observe: a killed server's writes are in the page
    cache either way, and only an OS crash, which no test makes, needs the disk. Docker's
    default ``/dev/shm`` is 64 MB, smaller than a few clusters, hence the size check. Both are
    world-searchable, which the ``postgres`` user needs when we are root.
    """
    try:
        shm = os.statvfs("/dev/shm")
    except OSError:
        return "/tmp"
    if shm.f_bavail * shm.f_frsize >= SHM_MIN_FREE_BYTES and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return "/tmp"


def _format_setting(value: Setting) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _child_env() -> dict[str, str]:
    """Our environment without ``PG*`` variables, which would silently retarget the tools."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
    env["LC_ALL"] = "C"
    return env


def _parent_pids() -> dict[int, int]:
    """PID -> parent PID of every process (Linux ``/proc``); gone or unreadable ones skipped."""
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(entry.name)] = int(fields[1])
    return parents


def _descendants(pid: int) -> list[int]:
    parents = _parent_pids()
    found: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent]
        found.extend(children)
        frontier.extend(children)
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs; a zombie holds no port and no shared memory, so it is dead."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def _mapped_dsm_files(pids: Iterable[int]) -> set[str]:
    """The dynamic shared memory files (``/dev/shm/PostgreSQL.N``) these processes map."""
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    path = line.rstrip("\n").partition("/dev/shm/")[2]
                    if path.startswith("PostgreSQL.") and path[len("PostgreSQL.") :].isdigit():
                        found.add("/dev/shm/" + path)
        except OSError:
            continue
    return found


def _remove_sysv_segment(shmid: int) -> None:
    """``shmctl(IPC_RMID)``, as ``ipcrm -m`` does; an id that is gone already is fine."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmctl(ctypes.c_int(shmid), ctypes.c_int(IPC_RMID), None)


def _signal_all(pids: Iterable[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _close_all_at_exit() -> None:
    """A safety net for a script or a crashed fixture: no server outlives the interpreter."""
    for server in list(_live):
        if server.owner_pid == os.getpid():  # not in a forked child: the servers are not its
            server.close()


atexit.register(_close_all_at_exit)


class _PortTaken(RuntimeError):
    """PostgreSQL could not bind its port: another process took it after it was picked."""


class PostgresServer:
    """One PostgreSQL cluster of our own: ``start``, then kill, pause, restart or promote it.

    ``settings`` become ``postgres -c name=value`` options on top of the defaults below (so a
    caller can turn durability off for speed, or on for crash tests: nothing is hard-coded).
    ``stop`` shuts down cleanly and keeps the data for ``restart``; ``close`` also removes the
    directory (fixtures call it).
    """

    #: How long ``stop`` waits for a fast shutdown before killing the server.
    stop_timeout_s: float = 10.0

    def __init__(
        self,
        settings: Mapping[str, Setting] | None = None,
        *,
        name: str = "postgres",
        parent: str | Path | None = None,
    ) -> None:
        self.bindir = postgres_bindir()
        self.name = name
        self.settings: dict[str, Setting] = dict(settings or {})
        self.run_as: str | None = None
        if os.geteuid() == 0:
            try:
                pwd.getpwnam(SERVER_USER)
            except KeyError:
                raise RuntimeError(
                    f"running as root, and PostgreSQL will not: the {SERVER_USER!r} user to "
                    "run it as does not exist (apt-get install -y postgresql creates it)"
                ) from None
            self.run_as = SERVER_USER
        #: Made by us, owned by the server's user; holds ``data/`` and ``postgres.log``.
        self.base_dir = Path(
            tempfile.mkdtemp(prefix="fencegate-pg-", dir=parent or default_parent())
        )
        if self.run_as is not None:
            shutil.chown(self.base_dir, self.run_as, self.run_as)
        self.data_dir = self.base_dir / "data"
        self.log_path = self.base_dir / "postgres.log"
        self.port = free_port()
        self._started = False
        self.proc: subprocess.Popen[bytes] | None = None
        #: Standbys made with ``make_standby``; ``close`` closes them too.
        self.standbys: list[PostgresServer] = []
        self.owner_pid = os.getpid()
        self.closed = False
        _live.add(self)

    def __repr__(self) -> str:
        state = "running" if self.running else "down"
        return f"<PostgresServer {self.name} 127.0.0.1:{self.port} {state} {self.base_dir}>"

    # --- addresses ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.url_for("postgres")

    def url_for(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{quote(dbname, safe='')}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # --- processes ---------------------------------------------------------------------------

    def _popen(
        self,
        args: list[str],
        *,
        stdout: int | IO[bytes],
        stderr: int | IO[bytes],
        new_session: bool = False,
    ) -> subprocess.Popen[bytes]:
        """Start a server-side program (``initdb``, ``postgres``...) as the user that owns the
        data: ``Popen(user=...)`` execs it directly, so its PID is the one we signal."""
        if self.run_as is None:
            user = group = None
            extra_groups: list[str] | None = None
        else:
            user = group = self.run_as
            extra_groups = []  # not root's supplementary groups
        return subprocess.Popen(
            dies_with_us(args),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            cwd=self.base_dir,
            env=_child_env(),
            start_new_session=new_session,
            user=user,
            group=group,
            extra_groups=extra_groups,
        )

    def _run_server_tool(self, args: list[str], what: str, timeout: float = 120.0) -> None:
        proc = self._popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            raise RuntimeError(f"{what} timed out after {timeout}s: {output.decode()}") from None
        if proc.returncode != 0:
            raise RuntimeError(f"{what} failed ({proc.returncode}): {output.decode()}")

    def _initdb(self) -> None:
        self._run_server_tool(
            [
                str(self.bindir / "initdb"),
                "-D", str(self.data_dir),
                "--auth=trust",
                "--username=postgres",
                "--encoding=UTF8",
                "--no-locale",  # C collation: no dependency on the machine's locales
                "--no-sync",
            ],
            "initdb",
        )  # fmt: skip

    def start(self) -> PostgresServer:
        """Start the postmaster (after ``initdb`` the first time) and wait until it accepts
        connections, which after a crash includes recovery. Also how ``restart`` starts.

        The port was free when it was picked (PostgreSQL cannot bind port 0 and say which it
        got): when another process took it meanwhile, the first start tries another port (a
        restart keeps its port: clients and standbys hold its address)."""
        for _ in range(5):
            try:
                return self._start_once()
            except _PortTaken:
                if self._started:
                    raise RuntimeError(f"{self!r}: its port was taken\n{self.log_tail()}") from None
                self.port = free_port()
        raise RuntimeError(f"{self!r} found no free port in 5 tries")

    def _start_once(self) -> PostgresServer:
        if self.closed:
            raise RuntimeError(f"{self!r} is closed: its directory is gone")
        if self.running:
            raise RuntimeError(f"{self!r} is already running")
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb()
        options: dict[str, Setting] = {
            "listen_addresses": "127.0.0.1",
            "port": self.port,
            "unix_socket_directories": str(self.base_dir),
            "max_connections": 300,
            "shared_buffers": "32MB",
            "logging_collector": False,
            **self.settings,
        }
        args = [str(self.bindir / "postgres"), "-D", str(self.data_dir)]
        for key, value in options.items():
            args += ["-c", f"{key}={_format_setting(value)}"]
        with self.log_path.open("ab") as log:
            log.write(f"--- fencegate: starting {' '.join(args)}\n".encode())
            log.flush()
            log_from = log.tell()
            # Its own process group, apart from pytest's (a terminal's ^C is not for it).
            self.proc = self._popen(args, stdout=log, stderr=log, new_session=True)
        try:
            self._wait_ready()
        except Exception as exc:
            exited = self.proc is not None and self.proc.poll() is not None
            self.kill()
            with self.log_path.open("rb") as log:
                log.seek(log_from)
                if exited and b"Address already in use" in log.read():
                    raise _PortTaken(self.port) from None
            raise RuntimeError(f"PostgreSQL did not start: {exc}\n{self.log_tail()}") from None
        self._started = True
        return self

    def _wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        # Through its own unix socket: a server of someone else's that holds the TCP port
        # cannot answer for it.
        isready = [str(self.bindir / "pg_isready"), "-q", "-h", str(self.base_dir),
                   "-p", str(self.port), "-U", "postgres", "-d", "postgres"]  # fmt: skip
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.proc.returncode}")
            # 0 accepting; 1 rejecting (starting up, recovering); 2 no answer.
            if subprocess.run(isready, env=_child_env(), check=False).returncode == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"not accepting connections after {timeout}s")
            time.sleep(0.02)

    def restart(self) -> PostgresServer:
        """Start again on the same data and port, after ``kill`` or ``stop`` (or stop first
        if it runs): a start after ``kill`` is crash recovery."""
        if self.running:
            self.stop()
        return self.start()

    def _processes(self) -> list[int]:
        """The postmaster and all its descendants (each in a session of its own)."""
        if self.proc is None:
            return []
        return [self.proc.pid, *_descendants(self.proc.pid)]

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend at once, like a power cut for the server.

        The postmaster is frozen first so it forks nothing new while its children are listed.
        Returns once all of them are gone, so the port is free to restart. The shared memory
        they leave (a SysV segment, ``/dev/shm/PostgreSQL.*`` files) is removed, as a reboot
        would: a restart would clean it up, but a killed server that is only closed would
        leak it for as long as the machine runs.
        """
        if self.proc is None:
            return
        pid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        pids = self._processes()
        segments = _mapped_dsm_files(pids)
        _signal_all(reversed(pids), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None
        self._wait_gone(pids)
        for path in segments:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        shmid = self._sysv_shmid()
        if shmid is not None:
            _remove_sysv_segment(shmid)

    def _sysv_shmid(self) -> int | None:
        """The main shared memory segment's id: line 7 of ``postmaster.pid`` is ``key id``."""
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
            return int(lines[6].split()[1])
        except (OSError, IndexError, ValueError):
            return None

    @staticmethod
    def _wait_gone(pids: list[int], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while any(_alive(pid) for pid in pids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"postgres processes still alive: {pids}")
            time.sleep(0.01)

    def pause(self) -> None:
        """SIGSTOP the whole server: connections stay open and the port accepts, nothing
        answers (a hung server or a partition, not a crash)."""
        assert self.proc is not None, "not running"
        os.kill(self.proc.pid, signal.SIGSTOP)  # first, so the list below stays complete
        _signal_all(_descendants(self.proc.pid), signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None, "not running"
        _signal_all(_descendants(self.proc.pid), signal.SIGCONT)
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Fast shutdown (SIGINT: roll back sessions, checkpoint, exit), then SIGKILL if it
        hangs. The data stays for ``restart``."""
        if self.proc is None:
            return
        pids = self._processes()
        _signal_all(pids, signal.SIGCONT)  # a paused server cannot shut down
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return
        self.proc = None
        self._wait_gone(pids)

    def close(self) -> None:
        """Stop this server and the standbys made from it, and remove their directories."""
        for standby in self.standbys:
            standby.close()
        if self.proc is not None:
            if self.proc.poll() is None:
                self.stop()
            else:
                self.kill()  # the postmaster died on its own: its children may not have
        shutil.rmtree(self.base_dir, ignore_errors=True)
        self.closed = True
        _live.discard(self)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # --- SQL ---------------------------------------------------------------------------------

    def psql(self, sql: str, dbname: str = "postgres", *, timeout: float = 60.0) -> str:
        """Run ``sql`` with the ``psql`` client and return its unaligned, tuples-only output
        (``|`` between columns, one row per line), stripped; an error raises with psql's
        message. Several statements in one string run as one transaction."""
        args = [
            str(self.bindir / "psql"),
            "-X",  # no ~/.psqlrc
            "-q", "-A", "-t",
            "-v", "ON_ERROR_STOP=1",
            "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", dbname,
            "-c", sql,
        ]  # fmt: skip
        done = subprocess.run(
            args, capture_output=True, text=True, env=_child_env(), timeout=timeout, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"psql on {self.name} failed: {sql!r}: {done.stderr.strip()}")
        return done.stdout.strip()

    def create_database(self, name: str) -> str:
        """``CREATE DATABASE name`` (a copy of ``template1``); returns its URL."""
        self.psql(f"CREATE DATABASE {_quote_ident(name)}")
        return self.url_for(name)

    def drop_database(self, name: str) -> None:
        """Drop ``name`` even with sessions still connected (they are terminated)."""
        self.psql(f"DROP DATABASE IF EXISTS {_quote_ident(name)} WITH (FORCE)")

    def in_recovery(self) -> bool:
        return self.psql("SELECT pg_is_in_recovery()") == "t"

    # --- replication -------------------------------------------------------------------------

    def make_standby(
        self, name: str = "standby", settings: Mapping[str, Setting] | None = None
    ) -> PostgresServer:
        """A streaming hot standby of this (running) server, started on its own port, and
        streaming when this returns.

        ``pg_basebackup -R`` copies the data and writes ``standby.signal``; ``primary_conninfo``
        is rewritten with ``application_name=name``, so ``synchronous_standby_names = 'name'``
        on this server makes commits wait for it. The standby takes this server's settings
        (replication requires e.g. ``max_connections`` at least the primary's) except
        ``synchronous_standby_names`` (once promoted, it would wait for a standby it does not
        have), then ``settings``; its directory is beside this one's. This server's ``close``
        closes it too.
        """
        if not self.running:
            raise RuntimeError(f"{self!r} is not running: nothing to copy")
        if not name.isidentifier():
            raise ValueError(
                f"standby name {name!r}: use a plain identifier (it goes unquoted "
                "into primary_conninfo and synchronous_standby_names)"
            )
        inherited = {k: v for k, v in self.settings.items() if k != "synchronous_standby_names"}
        standby = PostgresServer(
            {**inherited, **(settings or {})}, name=name, parent=self.base_dir.parent
        )
        self.standbys.append(standby)
        standby._run_server_tool(
            [
                str(self.bindir / "pg_basebackup"),
                "-D", str(standby.data_dir),
                "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                "-X", "stream",
                "-R",
                "--checkpoint=fast",  # the default spread checkpoint can take minutes
                "--no-sync",
            ],
            "pg_basebackup",
        )  # fmt: skip
        conninfo = f"host=127.0.0.1 port={self.port} user=postgres application_name={name}"
        with (standby.data_dir / "postgresql.auto.conf").open("a") as auto_conf:
            # The last line for a name wins; -R's own line has no application_name.
            auto_conf.write(f"primary_conninfo = '{conninfo}'\n")
        standby.start()
        self.wait_for_standby(name)
        return standby

    def wait_for_standby(self, name: str, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait until the standby ``name`` streams from this server and, if this server lists
        it in ``synchronous_standby_names``, counts it (``sync``, ``quorum`` or ``potential``):
        from then on a commit here waits for it as configured."""
        literal = _quote_literal(name)
        query = (
            "SELECT state || ',' || sync_state FROM pg_stat_replication"
            f" WHERE application_name = {literal}"
        )
        deadline = time.monotonic() + timeout
        while True:
            state = self.psql(query)
            if state.startswith("streaming,"):
                wanted = self.psql("SHOW synchronous_standby_names")
                listed = re.search(rf"\b{re.escape(name)}\b", wanted) is not None
                if not listed or state.split(",")[1] != "async":
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"standby {name} not streaming after {timeout}s: {state!r}")
            time.sleep(0.05)

    def promote(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Promote this standby and return once it accepts writes (``pg_promote`` waits for
        the end of recovery; it needs no ``pg_ctl`` run as the server's user)."""
        wait_s = max(1, int(timeout))
        if self.psql(f"SELECT pg_promote(true, {wait_s})") != "t":
            raise RuntimeError(f"{self.name} was not promoted in {wait_s}s:\n{self.log_tail()}")
        deadline = time.monotonic() + timeout
        while self.in_recovery():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} still in recovery after {timeout}s")
            time.sleep(0.02)


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"
