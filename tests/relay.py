"""Loopback TCP helpers that run in the test's event loop.

``DelayRelay`` sits between a gateway and its redis-server and, while ``delay_ms`` is above
zero, holds every chunk of the server's replies back that long (in order; requests pass at
once), the way an overloaded or distant store answers late. ``Blackhole`` is a downstream
that accepts connections, reads what arrives and never answers.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Self

__all__ = ["Blackhole", "DelayRelay"]


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError, asyncio.CancelledError):
        await writer.wait_closed()


class _Server:
    """An ``asyncio`` server on a free loopback port that can close every connection it has."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> Self:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._writers.add(writer)
        try:
            await self.serve(reader, writer)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            self._handlers.discard(task)
            await _close(writer)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for handler in list(self._handlers):
            handler.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        for writer in list(self._writers):
            await _close(writer)
        await self._server.wait_closed()
        self._server = None


class DelayRelay(_Server):
    """``127.0.0.1:port`` -> ``127.0.0.1:target_port``; replies held ``delay_ms`` when set.

    The delay a chunk gets is the one set when it arrived from the server, so switching the
    delay off does not reorder anything already held."""

    def __init__(self, target_port: int) -> None:
        super().__init__()
        self.target_port = target_port
        self.delay_ms = 0
        #: Reply chunks that were held back, for the test to see the delay took effect.
        self.delayed_chunks = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        try:
            # Whichever side ends first ends the connection (Redis clients never half-close).
            pipes = [
                asyncio.create_task(self._pipe(reader, up_writer, delayed=False)),
                asyncio.create_task(self._pipe(up_reader, writer, delayed=True)),
            ]
            try:
                await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pipe in pipes:
                    pipe.cancel()
                await asyncio.gather(*pipes, return_exceptions=True)
        finally:
            await _close(up_writer)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, delayed: bool
    ) -> None:
        loop = asyncio.get_running_loop()
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def pump() -> None:
            while True:
                due, chunk = await held.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not chunk:
                    return
                writer.write(chunk)
                await writer.drain()

        pumping = asyncio.create_task(pump())
        try:
            while True:
                chunk = await reader.read(65536)
                delay = self.delay_ms / 1000 if delayed else 0.0
                if delay and chunk:
                    self.delayed_chunks += 1
                held.put_nowait((loop.time() + delay, chunk))
                if not chunk:
                    break
            await pumping
        finally:
            pumping.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await pumping


class Blackhole(_Server):
    """A downstream that takes every request and never answers; counts connections and
    keeps what arrived on each."""

    def __init__(self) -> None:
        super().__init__()
        self.connections = 0
        self.received: list[bytes] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        index = len(self.received)
        self.received.append(b"")
        while chunk := await reader.read(65536):
            self.received[index] += chunk
