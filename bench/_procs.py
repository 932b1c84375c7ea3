"""What the benchmarks share: child processes on loopback, a private redis-server, a private
PostgreSQL cluster, a gateway with a temporary config, CPU accounting, percentiles and
plain-text tables.

Every process is started by the benchmark itself, on ``127.0.0.1`` and a free port, in its own
session (so Ctrl-C reaches the benchmark only, which then stops its children). Nothing here ever
connects to a Redis or a gateway that it did not start: after start-up it checks that what
answers on the port is the process it started.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

__all__ = [
    "HOST",
    "POSTGRES_SETTINGS",
    "REPO_ROOT",
    "PortTaken",
    "PostgresProc",
    "Proc",
    "align",
    "cli_module",
    "cpu_seconds",
    "filesystem_of",
    "fmt",
    "free_port",
    "gateway_env",
    "gateway_origin",
    "on_free_port",
    "percentile",
    "progress",
    "redis_script_names",
    "redis_script_stats",
    "redis_stats_reset",
    "render_redis_scripts",
    "scan_gateway_log",
    "spawn",
    "start_gateway",
    "start_module_server",
    "start_postgres",
    "start_redis",
    "terminable",
    "wait_for_port",
    "wait_ready",
]

T = TypeVar("T")

HOST = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parents[1]


# --- processes -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


class PortTaken(RuntimeError):
    """A server could not bind its port: another process took it after it was picked."""


def on_free_port(start: Callable[[int], T], attempts: int = 5) -> T:
    """``start(port)`` on a port that was free a moment ago (redis-server, and gateways of
    older trees, cannot bind port 0 and say which they got); when it raises ``PortTaken``
    (another process took the port meanwhile), again on another port."""
    for _ in range(attempts - 1):
        try:
            return start(free_port())
        except PortTaken:
            continue
    return start(free_port())


def _port_taken(proc: Proc, log: Path | None = None) -> bool:
    """Whether ``proc`` exited because its port was taken (its log says so: ``log``, else
    its output)."""
    if proc.alive():
        return False
    try:
        text = log.read_text(errors="replace")[-20_000:] if log else proc.log_tail(20_000)
    except OSError:
        return False
    return "address already in use" in text.lower()


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((HOST, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listening on {HOST}:{port} after {timeout}s")


def cpu_seconds(pid: int) -> float | None:
    """User+system CPU of a live process (all its threads) and of its children, live or
    reaped (``fencegate serve --workers N`` serves from its children), from /proc; None off
    Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state) of proc(5): utime, stime, cutime, cstime are fields 14-17.
    total = sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    for child in children:
        total += cpu_seconds(int(child)) or 0.0
    return total


@dataclass
class Proc:
    """A child process we started, with its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def cpu(self) -> float | None:
        return cpu_seconds(self.popen.pid)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 10 s; the exit code (None if it had to be killed)."""
        if self.popen.poll() is not None:
            return self.popen.returncode
        self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            return None

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def spawn(
    name: str, args: Sequence[str], log_path: Path, cwd: Path, env: dict[str, str] | None = None
) -> Proc:
    with log_path.open("ab") as log:
        popen = subprocess.Popen(
            list(args),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            cwd=cwd,
            env=env,
            start_new_session=True,  # Ctrl-C reaches us only; we stop the children ourselves
        )
    return Proc(name, popen, log_path)


def start_redis(binary: str, directory: Path, appendfsync: str) -> tuple[Proc, str, str]:
    """A private redis-server on a free loopback port: (process, url, version)."""
    directory.mkdir(parents=True)
    return on_free_port(lambda port: _start_redis(binary, directory, appendfsync, port))


def _start_redis(
    binary: str, directory: Path, appendfsync: str, port: int
) -> tuple[Proc, str, str]:
    args = [
        binary,
        "--port", str(port),
        "--bind", HOST,
        "--dir", str(directory),
        "--save", "",
        "--appendonly", "yes",
        "--appendfsync", appendfsync,
        "--maxmemory-policy", "noeviction",
        "--logfile", str(directory / "redis.log"),
    ]  # fmt: skip
    proc = spawn("redis-server", args, directory / "redis.stdout", directory)
    try:
        wait_for_port(port, proc.popen)
        # One try, briefly: a server that took the port may accept and never answer.
        client = redis.Redis(
            host=HOST, port=port, decode_responses=True, socket_timeout=5,
            retry=Retry(NoBackoff(), 0),
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    info = client.info("server")
                    break
                except redis.exceptions.BusyLoadingError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        finally:
            client.close()
        # The port was free a moment ago; make sure what answers on it is the one we started.
        if int(info["process_id"]) != proc.popen.pid:
            proc.popen.wait(timeout=30)  # ours could not bind: it exits
            raise RuntimeError(f"{HOST}:{port} is answered by another redis-server")
    except BaseException:
        proc.stop()
        if _port_taken(proc, directory / "redis.log"):
            raise PortTaken(port) from None
        raise
    return proc, f"redis://{HOST}:{port}/0", str(info["redis_version"])


#: Settings of the benchmark's PostgreSQL (``postgres -c``), on top of ``PostgresServer``'s
#: own: durable, as Redis ``appendfsync always`` and SQLite ``FULL`` are (every answered
#: COMMIT is fsynced, WAL with full-page writes), and PostgreSQL's default shared_buffers
#: (the test servers use 32MB).
POSTGRES_SETTINGS: dict[str, str | int | bool] = {
    "fsync": True,
    "synchronous_commit": "on",
    "full_page_writes": True,
    "shared_buffers": "128MB",
}


@dataclass
class PostgresProc(Proc):
    """A private PostgreSQL cluster (``tests.postgres_server.PostgresServer``) as a ``Proc``:
    ``popen`` is its postmaster, so ``cpu()`` counts the postmaster and every backend and
    auxiliary process (all its children, see ``cpu_seconds``). ``stop`` shuts it down fast,
    copies its log to ``log_path`` and removes its data."""

    server: Any = None

    def stop(self) -> int | None:
        """Fast shutdown (SIGINT; SIGKILL of every server process after 10 s): the exit code
        of the postmaster (0: clean; -9: it had to be killed)."""
        if self.server is None or self.server.closed:
            return self.popen.returncode
        try:
            self.server.stop()
        finally:
            with contextlib.suppress(OSError):
                shutil.copyfile(self.server.log_path, self.log_path)
            self.server.close()
        return self.popen.returncode

    def log_tail(self, chars: int = 2000) -> str:
        path = self.log_path if self.server is None or self.server.closed else None
        try:
            text = (path or self.server.log_path).read_text(errors="replace")
        except OSError:
            return ""
        return text[-chars:]


def _let_server_user_in(directory: Path, top: Path) -> None:
    """``PostgresServer`` runs the server as the ``postgres`` user when we are root: that user
    must be able to reach ``directory``. Adds o+x to ``top`` (the benchmark's own temporary
    directory, a 0700 ``mkdtemp``) and to the directories between it and ``directory``; a
    directory above ``top`` that others cannot search is an error (choose ``--temp-dir``)."""
    if os.geteuid() != 0:
        return
    for above in top.resolve().parents:
        if not above.stat().st_mode & 0o001:
            raise RuntimeError(
                f"the postgres user cannot enter {above} (not searchable by others), so it "
                f"cannot reach {directory}: choose another --temp-dir"
            )
    path = directory.resolve()
    chain = [path, *path.parents]
    top = top.resolve()
    if top not in chain:
        raise ValueError(f"{directory} is not inside {top}")
    for item in chain[: chain.index(top) + 1]:
        mode = item.stat().st_mode & 0o7777
        if not mode & 0o001:
            item.chmod(mode | 0o011)


def start_postgres(
    directory: Path, top: Path, databases: Sequence[str]
) -> tuple[PostgresProc, list[str], str]:
    """A private PostgreSQL cluster (``tests.postgres_server.PostgresServer``: ``initdb``, a
    free loopback port, never the machine's own cluster) with its data under ``directory``
    (on the benchmark's disk, not /dev/shm: fsync must cost what it costs), durable
    (``POSTGRES_SETTINGS``), and one new database per name in ``databases``:
    (process, the databases' URLs in that order, server version). ``top`` is the benchmark's
    temporary directory (see ``_let_server_user_in``)."""
    from tests.postgres_server import PostgresServer  # run from the repository root

    directory.mkdir(parents=True)
    _let_server_user_in(directory, top)
    server = PostgresServer(POSTGRES_SETTINGS, name="bench", parent=directory)
    try:
        server.start()
    except BaseException:
        server.close()
        raise
    assert server.proc is not None
    proc = PostgresProc("postgres", server.proc, directory / "postgres.log", server)
    try:
        # The port was free a moment ago; make sure what answers on it is the one we started.
        answered = server.psql("SHOW data_directory")
        if Path(answered) != server.data_dir:
            raise RuntimeError(f"{HOST}:{server.port} is answered by another PostgreSQL")
        settings = server.psql(
            "SELECT string_agg(name || '=' || setting, ',' ORDER BY name) FROM pg_settings "
            "WHERE name IN ('fsync', 'synchronous_commit', 'full_page_writes')"
        )
        if settings != "fsync=on,full_page_writes=on,synchronous_commit=on":
            raise RuntimeError(f"PostgreSQL is not durable as asked: {settings}")
        urls = [server.create_database(name) for name in databases]
        version = server.psql("SHOW server_version")
        progress(
            f"postgres {version.split()[0]}: port {server.port}, data in {server.data_dir} "
            f"on {filesystem_of(server.data_dir)}"
        )
    except BaseException:
        proc.stop()
        raise
    return proc, urls, version


#: The repository's folders and where they sit in the one import package.
_LAYOUT = {"gateway": "gateway", "ledger": "ledger", "adapters": "adapters"}


@functools.cache
def stage_source(source: Path) -> Path:
    """A directory whose ``fencegate`` package is ``source``'s tree as it installs: the SDK
    folder with the layer folders linked in (package-dir, pyproject.toml), so a snapshot of
    another revision imports without being installed. Trees from before the one namespace
    (top-level ``gateway``...) are returned as they are. Made once per tree and run (every
    gateway of the run imports from it), and removed when the benchmark exits."""
    if not _uses_namespace(source):
        return source
    stage = Path(tempfile.mkdtemp(prefix="fencegate-src-"))
    atexit.register(shutil.rmtree, stage, ignore_errors=True)
    package = stage / "fencegate"
    package.mkdir()
    for item in (source / "fencegate").iterdir():
        (package / item.name).symlink_to(item.resolve())
    for name, folder in _LAYOUT.items():
        (package / name).symlink_to((source / folder).resolve())
    return stage


def _uses_namespace(source: Path) -> bool:
    pyproject = source / "pyproject.toml"
    return pyproject.exists() and '"fencegate.gateway" = "gateway"' in pyproject.read_text()


def cli_module(source: Path | None) -> str:
    """The gateway's CLI module in ``source`` (revisions from before the one namespace had a
    top-level ``gateway`` package)."""
    if source is None or _uses_namespace(source) or not (source / "gateway").exists():
        return "fencegate.gateway.cli"
    return "gateway.cli"


def gateway_env(source: Path | None) -> dict[str, str] | None:
    """The environment that makes ``python -m fencegate.gateway.cli`` import from ``source``.

    PYTHONPATH comes before the editable install's finder, so a snapshot of another revision
    (``git archive``) runs instead of the working tree.
    """
    if source is None:
        return None
    path = os.environ.get("PYTHONPATH")
    staged = str(stage_source(source))
    return {**os.environ, "PYTHONPATH": staged + (os.pathsep + path if path else "")}


def run_phase_in(source: Path | None, call: str) -> str:
    """Run ``call`` (Python: a call of a function of a ``bench`` module, e.g.
    ``bench.redis_steps._real(...)``) in a child process whose ``fencegate`` is ``source``'s
    (``gateway_env``; the working tree's when None) while ``bench`` stays this checkout's, so
    one benchmark measures two revisions' stores with the same driver. Its stdout."""
    here = str(Path(__file__).resolve().parent.parent)
    module = call.split("(", 1)[0].rsplit(".", 1)[0]
    code = f"import asyncio, sys; sys.path.append({here!r}); import {module}; asyncio.run({call})"
    env = gateway_env(source)
    cwd = env["PYTHONPATH"].split(os.pathsep)[0] if env is not None else tempfile.gettempdir()
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{call} failed (exit {done.returncode}):\n{done.stderr}")
    return done.stdout


def gateway_origin(source: Path | None) -> str:
    """Where the gateway subprocesses import ``gateway`` from (checked, not assumed)."""
    probe = f"import importlib.util as u; print(u.find_spec({cli_module(source)!r}).origin)"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env=gateway_env(source),
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        check=True,
    )
    return str(Path(done.stdout.strip()).parent.parent)


def start_gateway(
    directory: Path,
    store_url: str,
    *,
    log_level: str,
    sqlite_synchronous: str,
    source: Path | None,
    store_timeout_ms: int | None,
    extra_toml: str = "",
    python_args: Sequence[str] = (),
    workers: int = 1,
    event_loop: str | None = None,
    durable: bool = True,
    store_lines: Sequence[str] = (),
) -> tuple[Proc, str]:
    """``fencegate serve`` with a temporary config: (process, base URL).

    ``extra_toml`` is appended to the config (whole sections: ``[leases]``,
    ``[[downstreams]]``...); ``python_args`` go between the interpreter and
    ``-m fencegate.gateway.cli`` (e.g. ``-m cProfile -o FILE``); ``workers`` above 1 is
    ``server.workers`` and ``event_loop`` is ``server.event_loop`` (a tree from before them
    refuses the keys). ``durable=False`` (a Redis run with ``appendfsync everysec``) sets
    ``store.require_durable = false``, else /readyz would never let the gateway start.
    ``store_lines`` go into ``[store]`` (e.g. ``postgres_max_connections = 32``).
    """
    directory.mkdir(parents=True)
    lines_after_listen = [
        *([f"workers = {workers}"] if workers > 1 else []),
        *([f'event_loop = "{event_loop}"'] if event_loop else []),
        "[store]",
        f"url = {json.dumps(store_url)}",
        f'sqlite_synchronous = "{sqlite_synchronous}"',
        *([] if durable else ["require_durable = false"]),
        *store_lines,
    ]
    if store_timeout_ms is not None:
        lines_after_listen.append(f"timeout_ms = {store_timeout_ms}")
    lines_after_listen += ["[logging]", f'level = "{log_level}"']

    def start(port: int) -> tuple[Proc, str]:
        return _start_gateway(directory, port, lines_after_listen, extra_toml, python_args, source)

    return on_free_port(start)


def _start_gateway(
    directory: Path,
    port: int,
    lines_after_listen: Sequence[str],
    extra_toml: str,
    python_args: Sequence[str],
    source: Path | None,
) -> tuple[Proc, str]:
    config = directory / "fencegate.toml"
    lines = ["[server]", f'listen = "{HOST}:{port}"', *lines_after_listen]
    config.write_text("\n".join(lines) + "\n" + extra_toml)
    args = [
        sys.executable,
        *python_args,
        "-m",
        cli_module(source),
        "serve",
        "--config",
        str(config),
    ]
    proc = spawn("gateway", args, directory / "gateway.log", directory, gateway_env(source))
    base = f"http://{HOST}:{port}"
    try:
        wait_for_port(port, proc.popen)
        wait_ready(base, proc)
    except BaseException as exc:
        proc.stop()
        if _port_taken(proc):
            raise PortTaken(port) from None
        raise RuntimeError(f"gateway did not start ({exc}):\n{proc.log_tail()}") from None
    return proc, base


def start_module_server(
    name: str,
    module: str,
    flag: str,
    directory: Path,
    extra_args: Sequence[str] = (),
    port: int | None = None,
) -> tuple[Proc, str]:
    """``python -m MODULE FLAG HOST:PORT [extra_args]`` from the repository root, in its own
    process, answering ``GET /readyz``: (process, base URL). ``port``: one more process on
    the port of another (both listen with SO_REUSEPORT); default a free one."""
    directory.mkdir(parents=True)
    if port is not None:  # a port someone already listens on: nothing to retry
        return _start_module_server(name, module, flag, directory, extra_args, port)
    return on_free_port(
        lambda free: _start_module_server(name, module, flag, directory, extra_args, free)
    )


def _start_module_server(
    name: str, module: str, flag: str, directory: Path, extra_args: Sequence[str], port: int
) -> tuple[Proc, str]:
    args = [sys.executable, "-m", module, flag, f"{HOST}:{port}", *extra_args]
    proc = spawn(name, args, directory / f"{name}.log", REPO_ROOT)
    base = f"http://{HOST}:{port}"
    try:
        wait_for_port(port, proc.popen)
        wait_ready(base, proc)
    except BaseException as exc:
        proc.stop()
        if _port_taken(proc):
            raise PortTaken(port) from None
        raise RuntimeError(f"{name} server did not start ({exc}):\n{proc.log_tail()}") from None
    return proc, base


def wait_ready(base: str, proc: Proc) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"{base}/readyz", timeout=2) as resp:
                if resp.status == 200:
                    break
        except OSError:
            pass
        if not proc.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{base}/readyz never answered 200")
        time.sleep(0.05)
    if not proc.alive():  # someone else answered on our port
        raise RuntimeError(f"{proc.name} exited; {base} is answered by another process")


def filesystem_of(path: Path) -> str:
    """``fstype (device)`` of the mount holding ``path`` (tmpfs would make fsync free)."""
    best, found = "", "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return found
    resolved = str(path.resolve())
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        device, point, fstype = parts[0], parts[1], parts[2]
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, found = point, f"{fstype} ({device})"
    return found


def scan_gateway_log(path: Path) -> tuple[dict[str, int], list[str]]:
    """Counts of warning/error events (and of non-JSON lines, e.g. tracebacks) in a log."""
    counts: Counter[str] = Counter()
    odd: list[str] = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}, []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            counts["(non-JSON line)"] += 1
            if len(odd) < 5:
                odd.append(line[:300])
            continue
        if not isinstance(event, dict):
            continue
        level = str(event.get("level", "?"))
        name = str(event.get("event", "?"))
        if level not in ("debug", "info"):
            counts[f"{level} {name}"] += 1
            if len(odd) < 5 and level in ("error", "critical"):
                odd.append(line[:300])
        elif name.endswith(".rejected"):
            counts[f"{level} {name} {event.get('code', '?')}"] += 1
    return dict(counts), odd


async def terminable(work: Awaitable[T]) -> T:
    """Run ``work``; SIGTERM cancels it (and surfaces as KeyboardInterrupt, like Ctrl-C)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await work
    except asyncio.CancelledError:
        raise KeyboardInterrupt from None
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.default_int_handler)


# --- figures ---------------------------------------------------------------------------------


def percentile(values: Sequence[float], pct: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def align(rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: the first row is the header, the first column left-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])]
        cells += [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# --- Redis CPU per script --------------------------------------------------------------------

#: SLOWLOG entries kept while a phase is measured (~0.5-2 KB each).
_SLOWLOG_KEEP = 100_000
#: The SLOWLOG threshold while a phase is measured, in usec: low enough to log every script
#: run, high enough to skip most commands a script runs (each ~1-3 us). A logged entry costs
#: Redis time, and a nested one is paid inside its script's time, so logging every command
#: (threshold 0) would inflate the very figure measured (commit ~60 -> ~250 us here).
_SLOWLOG_USEC = 5
#: Commands the benchmark itself sends around a measured phase (not the gateway's).
_ADMIN = {"CONFIG", "SLOWLOG", "INFO", "CLIENT", "HELLO", "PING"}
#: The client address the SLOWLOG gives the commands a script runs.
_SCRIPT_CLIENT = "?:0"

_NAMES_PROBE = """
import hashlib, json
from fencegate.ledger import redis_store as r
print(json.dumps({hashlib.sha1(r.load_script_source(n).encode()).hexdigest(): n
                  for n in r._SCRIPTS}))
"""


@functools.cache
def redis_script_names(source: Path | None) -> dict[str, str]:
    """SHA-1 -> script name for the gateway that runs from ``source`` (its own Lua files, so
    an old tree's scripts are named too), computed the way redis-py's ``register_script``
    does; {} when that tree cannot say."""
    done = subprocess.run(
        [sys.executable, "-c", _NAMES_PROBE],
        env=gateway_env(source),
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return {}
    names: dict[str, str] = json.loads(done.stdout)
    return names


def redis_stats_reset(url: str, expected_entries: int, slowlog_usec: int = _SLOWLOG_USEC) -> None:
    """Start counting a measured phase: ``CONFIG RESETSTAT`` (INFO commandstats: the exact
    time of all EVALSHA runs together) and a SLOWLOG of every script run (which script each
    was: commandstats has one line for all of them). A script run faster than
    ``slowlog_usec`` is missed (``slowlogCoverage`` shows it); 0 logs every command."""
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        client.config_set("slowlog-log-slower-than", slowlog_usec)
        client.config_set("slowlog-max-len", max(128, min(expected_entries, _SLOWLOG_KEEP)))
        client.slowlog_reset()
        client.config_resetstat()
    finally:
        client.close()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def redis_script_stats(url: str, names: dict[str, str], calls: int) -> dict[str, Any]:
    """Redis CPU of a measured phase, read right after it (before any read-back).

    ``usecPerCall`` is INFO commandstats' EVALSHA time (every script run, the commands it ran
    included) over ``calls``, and ``callsPerSecondOneRedis`` what one Redis could serve at
    that cost. Per script, from the SLOWLOG: runs, usec per run, and usec per call, scaled so
    the scripts add up to commandstats' exact total (``slowlogCoverage`` says how much of it
    the SLOWLOG saw). Commands the gateway sent outside scripts are listed apart. Switches the
    SLOWLOG back to Redis's default."""
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        stats = client.info("commandstats")
        entries: Any = client.slowlog_get(-1)
        client.config_set("slowlog-log-slower-than", 10_000)
        client.slowlog_reset()
    finally:
        client.close()
    scripts: dict[str, list[int]] = {}
    other = [0, 0]
    for entry in entries:
        # redis-py joins the arguments with spaces; the command and the SHA-1 have none.
        argv = _text(entry["command"]).split(" ", 2)
        if argv[0].upper() in _ADMIN or _text(entry["client_address"]) == _SCRIPT_CLIENT:
            continue  # the benchmark's own, or run by a script (counted in the script's time)
        if argv[0].upper() == "EVALSHA" and len(argv) > 1:
            runs_usec = scripts.setdefault(names.get(argv[1], argv[1][:12]), [0, 0])
        else:
            runs_usec = other
        runs_usec[0] += 1
        runs_usec[1] += int(entry["duration"])
    evalsha = stats.get("cmdstat_evalsha", {})
    exact_usec = int(evalsha.get("usec", 0))
    logged_usec = sum(usec for _, usec in scripts.values())
    scale = exact_usec / logged_usec if logged_usec else 1.0
    per_call = exact_usec / calls if calls else None

    def line(runs: int, usec: int, factor: float) -> dict[str, float | int | None]:
        return {
            "runs": runs,
            "usecPerRun": round(usec / runs, 1) if runs else None,
            "usecPerCall": round(usec * factor / calls, 1) if calls else None,
        }

    split = {name: line(runs, usec, scale) for name, (runs, usec) in sorted(scripts.items())}
    if other[0]:
        split["(not in a script)"] = line(other[0], other[1], 1.0)
    return {
        "calls": calls,
        "usecPerCall": None if per_call is None else round(per_call, 1),
        "callsPerSecondOneRedis": round(1e6 / per_call) if per_call else None,
        "evalshaRuns": int(evalsha.get("calls", 0)),
        "evalshaUsecPerRun": float(evalsha.get("usec_per_call", 0.0)),
        "slowlogCoverage": round(logged_usec / exact_usec, 3) if exact_usec else None,
        "scripts": split,
    }


def render_redis_scripts(phase: str, report: dict[str, Any], unit: str) -> str:
    """The per-script lines a benchmark prints for one measured Redis phase."""
    rows = [("script", "runs", "usec/run", f"usec/{unit}")]
    for name, line in report["scripts"].items():
        rows.append(
            (
                name,
                str(line["runs"]),
                fmt(line["usecPerRun"], ".1f"),
                fmt(line["usecPerCall"], ".1f"),
            )
        )
    head = (
        f"{phase}: Redis CPU in scripts {fmt(report['usecPerCall'], '.1f')} usec per {unit} "
        f"(INFO commandstats), so one Redis serves at most ~{report['callsPerSecondOneRedis']} "
        f"{unit}s/s; split by script from the SLOWLOG (coverage {report['slowlogCoverage']})"
    )
    return head + "\n" + align(rows)
