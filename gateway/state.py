"""Typed keys for what the app holds for its lifetime."""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp
from aiohttp import web

from adapters import Adapter
from gateway.config import Config
from gateway.metrics import Metrics
from ledger.store import Store

__all__ = ["ADAPTERS", "CONFIG", "HTTP_CLIENT", "METRICS", "STORE"]

CONFIG = web.AppKey("config", Config)
STORE = web.AppKey("store", Store)
#: downstream name -> its adapter, built once at start-up.
ADAPTERS = web.AppKey("adapters", Mapping[str, Adapter])
#: The one pooled client session every forward goes through.
HTTP_CLIENT = web.AppKey("http_client", aiohttp.ClientSession)
#: The app's Prometheus metrics.
METRICS = web.AppKey("metrics", Metrics)
