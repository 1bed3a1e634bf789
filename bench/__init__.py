"""Benchmarks and paper reproductions (run as scripts; importable by the tests)."""
