"""Studies: one folder per question a set of runs answers (big_vision's ``configs/proj/``).

A study folder holds a ``README.md`` (what it compares, the command that reproduces it, what
was measured), the configs that are its own (general ones stay in ``configs/``), its script
(``python -m xformers_jax_experiments.studies.<name>.<script>``) and the result files that
script writes there. Studies train through :mod:`xformers_jax_experiments.run_lib`
(``run_or_resume``: a finished run is not trained again, an interrupted one resumes) and read
runs' ``metrics.jsonl`` with it; the trainer knows nothing of them.
"""
