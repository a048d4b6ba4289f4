"""The one trainer:
``python -m xformers_jax_experiments.train --config=<config.py>[:arg] --workdir=DIR``.

The README's main job (a Performer on generated ListOps, a few minutes on a CPU)::

  python -m xformers_jax_experiments.train \
      --config=xformers_jax_experiments/configs/lra/listops.py:performer,main \
      --workdir=/tmp/listops_main

Configs are locked ``ml_collections.ConfigDict``s: ``--config.optim.learning_rate=1e-4``
overrides a value, a key that does not exist is an error naming the closest key. The chosen
slot kinds' hyperparameters may be set whether or not the config lists them
(``--config.model.attention.num_features=64`` for a Performer: the slot sections are open, and
the kind's registry checks the names). ``--print_config`` prints the resolved config and exits.

A run resumes from the latest intact checkpoint in ``--workdir``. SIGTERM (a preemption) saves
one and exits with status ``PREEMPTED`` (75, sysexits' EX_TEMPFAIL: not finished, rerun the
same command to resume); on several processes every process stops after the same step,
whichever of them got the signal. The workdir collects ``config.json`` and ``run.json`` (the
run record: code and package versions, finished or not), ``metrics.jsonl``, TensorBoard
events, ``checkpoints/`` (the last N, each array checksummed), ``best/`` and ``curves.png``
(when matplotlib is installed), and holds ``lock`` while a trainer runs in it: a second
trainer on the same workdir refuses. A resume with another config refuses, listing the
changed keys, unless ``--allow_config_change``; a finished run is not run again.
``--config.mesh='{"data": -1, "tensor": 2}'``
shards the run over a device mesh (BUILD.md, "Sharding and multi-host"). On several hosts (a
TPU pod, SLURM, or ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``
set) the JAX distributed runtime is initialised first (``--multihost`` forces it:
``xformers_jax_experiments/sweep.py`` uses it on TPU pods). Log lines below WARNING are hidden
unless ``--verbosity=0`` is given: the progress bar and the evaluations are shown on stderr.
A run whose loss, gradients or updates stop being finite, or whose data hold out-of-range ids,
exits with status 1 and a line naming the step and the cause (``config.on_nonfinite``).
"""

import difflib
import json
import math
import os
import re
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")
_MULTIHOST = flags.DEFINE_bool("multihost", False, "Call jax.distributed.initialize() (every "
                               "host of a TPU pod slice runs this command); without it the "
                               "environment decides (xformers_jax.parallel.initialize_from_env).")
_PRINT_CONFIG = flags.DEFINE_bool("print_config", False, "Print the resolved config (after the "
                                  "--config.* overrides) as JSON and exit.")
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
    "allow_config_change", False, "Resume a workdir with a config other than the one it was "
    "started with (the changed keys are recorded in its run.json).")
flags.mark_flags_as_required(["config"])

_OVERRIDE = re.compile(r"^--?config\.([\w.]+)=(.*)$", re.DOTALL)


def _parse_value(text: str):
    """A value for a key the config does not list (a slot kind's hyperparameter): a Python
    literal (``64``, ``0.5``, ``True``, ``None``, ``(2, 3)``) or else the string itself."""
    import ast

    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return {"true": True, "false": False}.get(text.lower(), text)


def _parse(argv: list[str]) -> list[str]:
    # config_flags reads its overrides from sys.argv, not from the arguments it is given.
    saved, sys.argv = sys.argv, argv
    try:
        return flags.FLAGS(argv)
    finally:
        sys.argv = saved


def parse_flags(argv: list[str]) -> list[str]:
    """``_parse_flags``, its errors printed as one line (as absl prints its own) and exit 1."""
    try:
        return _parse_flags(argv)
    except flags.Error as e:
        sys.stderr.write(f"FATAL Flags parsing error: {e}\n"
                         "Pass --helpshort or --helpfull to see help on flags.\n")
        sys.exit(1)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with ``--config.<key>=<value>`` overrides checked first.

    A key the config does not have is a flag error naming the closest key (config_flags
    would end in a bare ``AttributeError``), except a hyperparameter of a slot section
    (``model.attention``, ``model.mixer``, ...: open, ``kind`` plus that kind's
    hyperparameters), which is added to the section; ``validate_config`` then checks it
    against the kind's registered hyperparameters."""
    known, added = [], []
    for arg in argv[1:]:
        match = _OVERRIDE.match(arg)
        (added if match else known).append(match.groups() if match else arg)
    # The config file alone first: the keys it has decide where each override goes.
    rest = _parse([argv[0], *known])
    config = _CONFIG.value
    overrides, slot_values = [], []
    for path, text in added:
        parts, node = path.split("."), config
        for i, part in enumerate(parts):
            is_section = hasattr(node, "keys")
            if is_section and part in node:
                node = node[part]
                continue
            slot = (i == len(parts) - 1 and len(parts) == 3 and parts[0] == "model"
                    and hasattr(config.model.get(parts[1]), "keys"))
            if slot:
                slot_values.append((parts[1], part, _parse_value(text)))
                break
            where = ".".join(parts[:i]) or "the config"
            close = difflib.get_close_matches(part, list(node.keys()), n=1) if is_section else []
            hint = (f" (did you mean {close[0]!r}?)" if close else
                    f" (its keys: {', '.join(sorted(node.keys()))})" if is_section else
                    " (it is a value, not a section)")
            raise flags.IllegalFlagValueError(
                f"--config.{path}: {where} has no key {part!r}{hint}")
        else:
            overrides.append(f"--config.{path}={text}")
    if overrides:
        rest = _parse([argv[0], *known, *overrides])
    config = _CONFIG.value
    for section, key, value in slot_values:
        with config.unlocked():
            config.model[section][key] = value
    return rest

# The exit status of a preempted run: a checkpoint is saved, the run is resumable, not done.
PREEMPTED = 75


def summary(result: dict) -> str:
    """The final lines a person reads: test accuracy (and bits per byte for language models)."""
    if result.get("preempted"):
        return (f"preempted at step {result['step']}: checkpoint saved, rerun the same command "
                f"to resume (exit status {PREEMPTED})")
    line = ""
    if result.get("already_finished"):
        line = f"run already finished at step {result['step']}; nothing to do. "
    line += (f"step {result['step']} (best checkpoint: step {result['best_step']}): "
            f"test accuracy {result['test_accuracy']:.4f}, test loss {result['test_loss']:.4f}")
    if "test_bits_per_byte" in result:
        line += f", {result['test_bits_per_byte']:.3f} bits per byte"
    if "test_majority_accuracy" in result:
        line += f" (majority class: {result['test_majority_accuracy']:.4f})"
    return line


def starting_line(config, workdir: str) -> str:
    """What the trainer does before its progress bar's first line (making the data and
    compiling the step take tens of seconds on a CPU): said at once, so a run is never silent."""
    attention, mixer = config.model.get("attention"), config.model.get("mixer")
    if mixer is not None and mixer.get("kind", "none") != "none":
        kind = f"{config.model.kind} with the {mixer.kind} token mixer"
    else:
        kind = f"{config.model.kind}" + (f" with {attention.kind} attention"
                                         if attention is not None and "kind" in attention
                                         else "")
    return (f"{config.data.task}: {kind}, {config.num_train_steps} steps, in {workdir}; "
            "making the data and compiling the train step (the progress bar starts after the "
            "first step)")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    # Before anything touches a device; on one host without the variables this does nothing.
    if _MULTIHOST.value:
        jax.distributed.initialize()
    else:
        from xformers_jax.parallel import initialize_from_env
        initialize_from_env()
    from xformers_jax import train

    try:
        train.validate_config(_CONFIG.value)
    except ValueError as e:
        sys.exit(f"config error: {e}")
    if _PRINT_CONFIG.value:
        print(json.dumps(train.config_json(_CONFIG.value), indent=1))
        return
    if _WORKDIR.value is None:
        sys.exit("--workdir is required (a directory for checkpoints and metrics)")
    if jax.process_index() == 0:
        print(starting_line(_CONFIG.value, _WORKDIR.value), file=sys.stderr, flush=True)
    try:
        result = train.train_and_evaluate(_CONFIG.value, _WORKDIR.value,
                                          allow_config_change=_ALLOW_CONFIG_CHANGE.value)
    except (train.ConfigChanged, train.WorkdirLocked, train.CheckpointCorrupt) as e:
        sys.exit(f"{type(e).__name__}: {e}")  # refused: nothing was trained or written
    except (train.NonFiniteError, train.InvalidDataError) as e:
        # A run that diverged or met bad data has no result to print: exit non-zero with
        # the cause (the checkpoints hold only steps before it).
        raise SystemExit(f"training stopped: {type(e).__name__}: {e}") from e
    if _CONFIG.value.data.task == "lm" and "test_loss" in result:
        result["test_bits_per_byte"] = result["test_loss"] / math.log(2)
    print(json.dumps(result))
    print(summary(result))
    if result.get("preempted"):
        sys.exit(PREEMPTED)
    if (_CONFIG.value.plot and not result.get("already_finished")
            and jax.process_index() == 0):
        curves = plot_curves(_WORKDIR.value, result)
        if curves:
            print(f"learning curves: {curves}")


def plot_curves(workdir: str, result: dict | None = None) -> str | None:
    """``workdir/curves.png``: train and validation loss and accuracy, the test split's
    values at the best checkpoint and the majority-class baseline from ``result`` (the
    trainer's); None without matplotlib."""
    try:
        import matplotlib  # noqa: F401  (optional: pip install '.[viz]')
    except ImportError:
        return None
    from xformers_jax_experiments import plot

    out = os.path.join(workdir, "curves.png")
    result = result or {}
    plot.learning_curves(workdir, out, baseline=result.get("test_majority_accuracy"),
                         best_step=result.get("best_step"))
    return out


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
