"""Benchmarks. Run them from the repository root: ``.venv/bin/python -m bench.claim_commit``."""
