"""The one trainer:
``python -m xformers_jax_experiments.train --config=<config.py>[:arg] --workdir=DIR``.

The README's main job (a Performer on generated ListOps, a few minutes on a CPU)::

  python -m xformers_jax_experiments.train \
      --config=xformers_jax_experiments/configs/lra/listops.py:performer,main \
      --workdir=/tmp/listops_main

Configs are locked ``ml_collections.ConfigDict``s: ``--config.optim.learning_rate=1e-4``
overrides a value, a key that does not exist is an error. A run resumes from the latest
checkpoint in ``--workdir``. SIGTERM (a preemption) saves one and exits with status
``PREEMPTED`` (75, sysexits' EX_TEMPFAIL: not finished, rerun the same command to resume); on
several processes every process stops after the same step, whichever of them got the signal.
The workdir collects
``metrics.jsonl``, TensorBoard events, ``checkpoints/`` (the last N), ``best/`` and
``curves.png`` (when matplotlib is installed). ``--config.mesh='{"data": -1, "tensor": 2}'``
shards the run over a device mesh (BUILD.md, "Sharding and multi-host"). On several hosts (a
TPU pod, SLURM, or ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``
set) the JAX distributed runtime is initialised first (``--multihost`` forces it:
``xformers_jax_experiments/sweep.py`` uses it on TPU pods). Log lines below WARNING are hidden
unless ``--verbosity=0`` is given: the progress bar and the evaluations are shown on stderr.
"""

import json
import math
import os
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
flags.mark_flags_as_required(["config", "workdir"])

# The exit status of a preempted run: a checkpoint is saved, the run is resumable, not done.
PREEMPTED = 75


def summary(result: dict) -> str:
    """The final lines a person reads: test accuracy (and bits per byte for language models)."""
    if result.get("preempted"):
        return (f"preempted at step {result['step']}: checkpoint saved, rerun the same command "
                f"to resume (exit status {PREEMPTED})")
    line = (f"step {result['step']} (best checkpoint: step {result['best_step']}): "
            f"test accuracy {result['test_accuracy']:.4f}, test loss {result['test_loss']:.4f}")
    if "test_bits_per_byte" in result:
        line += f", {result['test_bits_per_byte']:.3f} bits per byte"
    if "test_majority_accuracy" in result:
        line += f" (majority class: {result['test_majority_accuracy']:.4f})"
    return line


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

    result = train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    if _CONFIG.value.data.task == "lm" and "test_loss" in result:
        result["test_bits_per_byte"] = result["test_loss"] / math.log(2)
    print(json.dumps(result))
    print(summary(result))
    if result.get("preempted"):
        sys.exit(PREEMPTED)
    if _CONFIG.value.plot and not result.get("preempted") and jax.process_index() == 0:
        curves = plot_curves(_WORKDIR.value)
        if curves:
            print(f"learning curves: {curves}")


def plot_curves(workdir: str) -> str | None:
    """``workdir/curves.png`` (train loss, validation accuracy); None without matplotlib."""
    try:
        import matplotlib  # noqa: F401  (optional: pip install '.[viz]')
    except ImportError:
        return None
    from xformers_jax_experiments import plot

    out = os.path.join(workdir, "curves.png")
    plot.plot([workdir], ["train_loss", "validation_accuracy"], out)
    return out


if __name__ == "__main__":
    app.run(main)
