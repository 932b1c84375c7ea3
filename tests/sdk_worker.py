"""A worker built on the SDK, as its own process, for the SIGSTOP test of ``tests/test_sdk.py``.

    python tests/sdk_worker.py GATEWAY_URL TASK_ID OWNER TTL_MS guarded|bare

It claims the task (``guarded``: ``async with client.claim(...)``, renewed in the background;
``bare``: ``client.acquire(...)``, never renewed), then obeys one command per line on stdin:
``send SLOT`` (POST /proxy/api/ok/pay under its lease, body ``{"slot": SLOT}``), ``commit``
and ``exit``. Every outcome is one JSON line on stdout: ``{"event": ..., "ok": bool,
"code": str | None, ...}``. A guarded lease that is lost prints ``{"event": "lost"}`` as soon
as the ``async with`` raises it; the worker then goes on obeying commands with that lease.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from fencegate import Client, FencegateError, Lease, LeaseLost, ProblemError


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def failure(exc: FencegateError) -> dict[str, Any]:
    if isinstance(exc, ProblemError):
        return {"ok": False, "code": exc.code, "error": type(exc).__name__}
    if isinstance(exc, LeaseLost):
        return {"ok": False, "code": "LEASE_LOST", "cause": exc.code, "error": "LeaseLost"}
    return {"ok": False, "code": None, "error": type(exc).__name__}


async def stdin_lines() -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


async def obey(lease: Lease, commands: asyncio.StreamReader) -> None:
    """Run commands until ``exit`` or EOF."""
    while True:
        line = (await commands.readline()).decode().split()
        if not line or line[0] == "exit":
            return
        try:
            if line[0] == "send":
                answer = await lease.request(
                    "api", "POST", "/ok/pay", slot=line[1], json={"slot": line[1]}
                )
                emit("send", ok=True, status=answer.status, replayed=answer.replayed, code=None)
            elif line[0] == "commit":
                done = await lease.commit({"by": lease.owner})
                emit("commit", ok=True, commitId=done.commit_id, code=None)
        except FencegateError as exc:
            emit(line[0], **failure(exc))


async def main(argv: list[str]) -> int:
    url, task_id, owner, ttl_ms, mode = argv[1], argv[2], argv[3], int(argv[4]), argv[5]
    commands = await stdin_lines()
    async with Client(url, timeout=10) as client:
        if mode == "bare":
            lease = await client.acquire(task_id, owner=owner, ttl_ms=ttl_ms)
            emit("claim", ok=True, generation=lease.claim_generation, code=None)
            await obey(lease, commands)
            return 0
        scope = client.claim(task_id, owner=owner, ttl_ms=ttl_ms)
        try:
            async with scope as lease:
                emit("claim", ok=True, generation=lease.claim_generation, code=None)
                await obey(lease, commands)
                return 0
        except LeaseLost as lost:
            emit("lost", ok=False, code="LEASE_LOST", cause=lost.code, reason=lost.reason)
        await obey(lease, commands)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv)))
