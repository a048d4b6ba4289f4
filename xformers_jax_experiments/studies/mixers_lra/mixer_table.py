"""The token-mixer table: LRA ListOps and LRA's image tasks with a Transformer, S4D, Mamba-2,
gMLP and FNet, each task's runs after the same number of steps (ListOps at the README main
job's size and settings, the image tasks at their ``runlocal`` ones; mixers as in
``_common.MIXERS`` / ``SMALL_MIXERS``). One sweep, one table::

  nice -n 5 python -m xformers_jax_experiments.sweep \\
      --config=xformers_jax_experiments/studies/mixers_lra/mixer_table.py \\
      --workdir=/tmp/mixer_table --num_processes=1

The table (``WORKDIR/sweep.md``) has one row per ``TASK,VARIANT`` with its test accuracy.
Pathfinder runs ``TABLE_STEPS`` (100) steps rather than its runlocal 300; ``--resume``
continues an interrupted sweep.
The image tasks are Pathfinder (32 x 32, generated here: ``xformers_jax.data.Pathfinder``)
and, when the sweep's argument names a directory holding the CIFAR-10 python batches
(``--config=.../mixer_table.py:/path/to/data`` with ``/path/to/data/cifar-10-batches-py``),
LRA Image as well (its runs get ``data.data_dir``; nothing is downloaded, and without the
argument the Image rows are left out rather than failing). ``get_config("TASK,VARIANT")``
builds one run alone.
"""

import os

from xformers_jax_experiments.configs.lra import image, listops, pathfinder

TASKS = {"listops": listops, "pathfinder": pathfinder, "image": image}
# Tasks whose data are generated here; LRA Image needs CIFAR-10 files (see image_rows).
GENERATED_TASKS = ("listops", "pathfinder")
VARIANTS = ("transformer", "s4d", "mamba2", "gmlp", "fnet")
# Steps of the table's runs where they differ from the task's runlocal config: Pathfinder's
# 300 steps over 1024 pixels take about an hour per model on 2 shared CPU cores.
TABLE_STEPS = {"pathfinder": 100}
# ListOps at the README main job's size (32-128 tokens, depth 4, 6000 expressions, 800 steps);
# the image tasks at their runlocal sizes.
TABLE_SIZE = {"listops": "main"}


def get_config(arg=None):
    parts = [p for p in (arg or "listops").split(",") if p]
    if not parts or parts[0] not in TASKS or len(parts) > 2:
        raise ValueError(f"mixer_table: config arg must be 'TASK[,VARIANT]' with TASK in "
                         f"{sorted(TASKS)}, got {arg!r}")
    variant = parts[1] if len(parts) == 2 else "transformer"
    c = TASKS[parts[0]].get_config(f"{variant},{TABLE_SIZE.get(parts[0], 'runlocal')}")
    if parts[0] in TABLE_STEPS:
        with c.unlocked():
            steps = TABLE_STEPS[parts[0]]
            c.update(dict(num_train_steps=steps, eval_every=min(c.eval_every, steps),
                          checkpoint_every=min(c.checkpoint_every, steps)))
    return c


def image_rows(data_dir: str | None) -> bool:
    """Whether the sweep includes LRA Image: ``data_dir`` given and holding CIFAR-10 (a
    ``data_dir`` without the batches is an error naming the expected path)."""
    if not data_dir:
        return False
    expected = os.path.join(data_dir, "cifar-10-batches-py", "data_batch_1")
    if not os.path.exists(expected):
        raise FileNotFoundError(f"mixer_table: LRA Image needs the CIFAR-10 python batches, "
                                f"expected {expected!r} (nothing is downloaded)")
    return True


def get_hyper(hyper):
    runs = hyper.args([f"{task},{variant}" for task in GENERATED_TASKS for variant in VARIANTS])
    if image_rows(hyper.arg):
        runs += hyper.product([hyper.args([f"image,{variant}" for variant in VARIANTS]),
                               hyper.fixed("config.data.data_dir", hyper.arg)])
    return runs
