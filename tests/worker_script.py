"""A worker as its own process, for ``tests/test_faults.py``: stdlib only, so it starts fast.

    python tests/worker_script.py GATEWAY_URL TASK_ID OWNER TTL_MS HEARTBEAT_S

It claims the task, then heartbeats (renews every HEARTBEAT_S seconds) until a renew is
refused or a line (or EOF) arrives on stdin, and then commits its result, as a worker that
does not check its lease before committing would. Every answer is printed to stdout as one
JSON line: ``{"event": "claim"|"renew"|"commit", "status": int, "code": str|None,
"body": ...}``, so the test can follow the worker while it runs (and while it is stopped).
"""

from __future__ import annotations

import json
import select
import sys
import urllib.error
import urllib.request
from typing import Any

# No proxy from the environment: the gateway is on loopback.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def call(base: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        base + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with _OPENER.open(request, timeout=10) as response:
            return int(response.status), json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def emit(event: str, status: int, body: Any) -> None:
    code = body.get("code") if isinstance(body, dict) else None
    print(json.dumps({"event": event, "status": status, "code": code, "body": body}), flush=True)


def main(argv: list[str]) -> int:
    base, task_id, owner, ttl_ms, heartbeat_s = (
        argv[1],
        argv[2],
        argv[3],
        int(argv[4]),
        float(argv[5]),
    )
    _, scheduler = call(base, "GET", "/v1/epoch")
    status, lease = call(
        base,
        "POST",
        f"/v1/tasks/{task_id}/claim",
        {"owner": owner, "ttlMs": ttl_ms, "schedulerEpoch": scheduler["schedulerEpoch"]},
    )
    emit("claim", status, lease)
    if status != 200:
        return 1
    identity = {
        "attemptId": lease["attemptId"],
        "claimGeneration": lease["claimGeneration"],
        "schedulerEpoch": lease["schedulerEpoch"],
        "cancelGeneration": lease["cancelGeneration"],
    }
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], heartbeat_s)
        if readable:
            sys.stdin.readline()  # "finish now" (or EOF)
            break
        status, body = call(
            base,
            "POST",
            f"/v1/tasks/{task_id}/renew",
            {**identity, "owner": owner, "ttlMs": ttl_ms},
        )
        emit("renew", status, body)
        if status != 200:
            break
    status, body = call(
        base,
        "POST",
        f"/v1/tasks/{task_id}/commit",
        {
            **identity,
            "inputDigest": lease["inputDigest"],
            "resultDigest": f"result-of-{owner}",
        },
    )
    emit("commit", status, body)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
