"""Typed keys for what the app holds for its lifetime."""

from __future__ import annotations

from aiohttp import web

from gateway.config import Config
from ledger.store import Store

__all__ = ["CONFIG", "STORE"]

CONFIG = web.AppKey("config", Config)
STORE = web.AppKey("store", Store)
