"""``tests/late_servers.py``: an outage of the listener refuses connections and keeps its port."""

from __future__ import annotations

import socket

import aiohttp
import pytest

from tests.late_servers import LateServers


async def test_an_outage_refuses_connections_and_keeps_the_port() -> None:
    late = await LateServers().listen()
    try:
        port = late.port
        await late.stop_listening()
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as http:
                await http.get(f"{late.url}/docs/a")
        taker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with taker, pytest.raises(OSError):
            taker.bind(("127.0.0.1", port))  # another process's server cannot take it
        await late.listen()
        assert late.port == port
        async with aiohttp.ClientSession() as http, http.get(f"{late.url}/docs/a") as resp:
            assert resp.status == 404
    finally:
        await late.close()
