"""Benchmarks and the architecture sweep (importable so tests can share _sweep_checks)."""
