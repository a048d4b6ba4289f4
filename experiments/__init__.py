"""Experiment scripts (absl) and their configs; run them as ``python -m experiments.<name>``."""
