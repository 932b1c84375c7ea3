"""The installed fencegate's version: one source for ``--version``, ``/healthz`` and the
``gateway.starting`` event, so an operator quoting it in a bug report names the build that
answered. Kept import-light: ``fencegate --version`` must not load the server."""

from __future__ import annotations

from importlib import metadata

__all__ = ["gateway_version"]


def gateway_version() -> str:
    """``unknown`` when run from a tree that was never installed."""
    try:
        return metadata.version("fencegate")
    except metadata.PackageNotFoundError:
        return "unknown"
