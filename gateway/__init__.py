"""HTTP: the app factory, the coordination and ledger APIs, the proxy path, config and CLI."""
