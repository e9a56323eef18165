"""Benchmarks for zpipe; each module runs as a script and prints JSON lines."""
