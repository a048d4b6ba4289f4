"""Benchmark suites for ``xformers_jax_experiments/benchmark.py``; see
``xformers_jax_experiments/bench_lib.py``."""
