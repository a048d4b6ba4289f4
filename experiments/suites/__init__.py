"""Benchmark suites for ``experiments/benchmark.py``; see ``experiments/bench_lib.py``."""
