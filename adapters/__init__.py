"""Per-downstream behaviour behind one small protocol (arrives with the proxy)."""
