"""A private Apache Tomcat for tests: Debian's ``tomcat10`` binaries (CATALINA_HOME
``/usr/share/tomcat10``) run as an instance of our own (CATALINA_BASE in a temporary directory,
its own ``conf/server.xml``, a loopback port, no shutdown port), serving static files only.

Tomcat drops a segment's path parameters (``;...``) and percent-decodes before it normalises
``..``, which is what the path-confinement tests need a real one for
(``tests/test_path_confinement.py``). Its access log (``logs/access.log``, unbuffered, one line
per request: the request line and the status) says what reached it.

Tomcat cannot bind port 0 and tell us the port simply, so a free port is picked, and another
one when the JVM says it could not bind (another process took it in between), as
``RedisServer`` picks one.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from xml.sax.saxutils import quoteattr

from tests.servers import _Child, free_port

__all__ = ["CATALINA_HOME", "TomcatServer", "tomcat_available"]

CATALINA_HOME = Path(os.environ.get("FENCEGATE_TEST_CATALINA_HOME", "/usr/share/tomcat10"))
#: Bounds on the JVM: a small heap, a quick JIT, and a finite wait for the port to serve.
JAVA_OPTS = "-Xmx128m -Xss512k -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Xshare:auto"
READY_TIMEOUT_S = 60.0
#: Ports tried before giving up (each a fresh free port).
BIND_ATTEMPTS = 3

_SERVER_XML = """<?xml version="1.0" encoding="UTF-8"?>
<Server port="-1" shutdown="SHUTDOWN">
  <Service name="Catalina">
    <Connector address="127.0.0.1" port={port} protocol="HTTP/1.1"
               connectionTimeout="20000" maxThreads="8" />
    <Engine name="Catalina" defaultHost="localhost">
      <Host name="localhost" appBase="webapps" unpackWARs="false" autoDeploy="false">
        <Valve className="org.apache.catalina.valves.AccessLogValve" directory="logs"
               prefix="access" suffix=".log" rotatable="false" buffered="false"
               pattern="%r %s" />
      </Host>
    </Engine>
  </Service>
</Server>
"""


def tomcat_available() -> bool:
    return (CATALINA_HOME / "bin" / "catalina.sh").is_file() and shutil.which("java") is not None


class TomcatServer(_Child):
    """``files`` (path under the ROOT webapp -> content) are served as static files."""

    stop_timeout_s = 20.0

    def __init__(self, directory: Path, files: dict[str, str]) -> None:
        if not tomcat_available():
            raise RuntimeError(
                f"no Tomcat under {CATALINA_HOME} (or no java); .ci/run installs it "
                "(apt-get install -y tomcat10)"
            )
        self.base = directory
        self.files = files
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._nonce = secrets.token_hex(8)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def access_log(self) -> Path:
        return self.base / "logs" / "access.log"

    @property
    def console_log(self) -> Path:
        return self.base / "logs" / "console.log"

    def requests(self) -> list[str]:
        """The access log's lines (``GET /path HTTP/1.1 200``), the readiness checks left out."""
        if not self.access_log.exists():
            return []
        lines = self.access_log.read_text().splitlines()
        return [line for line in lines if "/fencegate-ready.txt" not in line]

    def _lay_out(self) -> None:
        conf = self.base / "conf"
        for sub in ("conf", "logs", "temp", "work", "webapps/ROOT"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        for name in ("web.xml", "catalina.properties"):
            shutil.copyfile(CATALINA_HOME / "etc" / name, conf / name)
        root = self.base / "webapps" / "ROOT"
        for path, content in {**self.files, "fencegate-ready.txt": self._nonce}.items():
            target = root / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)

    def _write_server_xml(self) -> None:
        (self.base / "conf" / "server.xml").write_text(
            _SERVER_XML.format(port=quoteattr(str(self.port)))
        )

    def start(self) -> TomcatServer:
        self._lay_out()
        for attempt in range(BIND_ATTEMPTS):
            self.port = free_port()
            self._write_server_xml()
            if self._start_once():
                return self
            self.stop()
            if not self._bind_failed() or attempt == BIND_ATTEMPTS - 1:
                break
        raise RuntimeError(f"Tomcat did not start: {self._console_tail()}")

    def _start_once(self) -> bool:
        env = {
            **os.environ,
            "CATALINA_HOME": str(CATALINA_HOME),
            "CATALINA_BASE": str(self.base),
            "CATALINA_TMPDIR": str(self.base / "temp"),
            "CATALINA_PID": str(self.base / "temp" / "tomcat.pid"),
            "JAVA_OPTS": JAVA_OPTS,
        }
        self.console_log.write_bytes(b"")
        with self.console_log.open("ab") as log:
            # ``catalina.sh run`` execs the JVM in the foreground: its pid is ours to stop.
            self.proc = subprocess.Popen(
                [str(CATALINA_HOME / "bin" / "catalina.sh"), "run"],
                stdout=log,
                stderr=log,
                env=env,
                cwd=self.base,
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None or self._bind_failed():
                return False
            if self._serves_our_nonce():
                return True
            time.sleep(0.2)
        return False

    def _serves_our_nonce(self) -> bool:
        """Ours, not whatever else may have taken the port: it serves this run's nonce."""
        try:
            with urllib.request.urlopen(f"{self.url}/fencegate-ready.txt", timeout=2) as answer:
                return bool(answer.read().decode() == self._nonce)
        except (OSError, urllib.error.URLError):
            return False

    def _bind_failed(self) -> bool:
        text = self.console_log.read_text(errors="replace") if self.console_log.exists() else ""
        return "BindException" in text or "Address already in use" in text

    def _console_tail(self) -> str:
        if not self.console_log.exists():
            return "(no console log)"
        return self.console_log.read_text(errors="replace")[-3000:]
