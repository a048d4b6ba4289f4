"""Experiment scripts (absl) and their configs; run them as
``python -m xformers_jax_experiments.<name>``."""
