"""The one trainer: ``python -m experiments.train --config=<config.py>[:arg] --workdir=DIR``.

Example (seconds on a CPU)::

  python -m experiments.train --config=experiments/configs/lra/listops.py:runlocal \
      --workdir=/tmp/listops

Configs are locked ``ml_collections.ConfigDict``s: ``--config.optim.learning_rate=1e-4``
overrides a value, a key that does not exist is an error. A run resumes from the latest
checkpoint in ``--workdir``; SIGTERM saves one before exiting.
"""

import json

from absl import app, flags
from ml_collections import config_flags

from xformers_jax import train

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    result = train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
