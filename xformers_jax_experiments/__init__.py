"""Experiment scripts (absl) and their configs; run them as
``python -m xformers_jax_experiments.<name>``. Studies (a question, its runs and its table) are
folders under ``studies/``, run as ``python -m xformers_jax_experiments.studies.<name>.<script>``.
"""
