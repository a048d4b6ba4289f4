"""The token-mixer table: LRA ListOps and LRA Image with a Transformer, S4D, Mamba-2, gMLP and
FNet, each task's runs after the same number of steps (the tasks' ``runlocal`` sizes and
settings; mixers as in ``_common.MIXERS`` / ``SMALL_MIXERS``). One sweep, one table::

  nice -n 5 python -m experiments.sweep --config=experiments/configs/lra/mixer_table.py \\
      --workdir=/tmp/mixer_table --num_processes=1 --set=data.data_dir=/path/to/data

The table (``WORKDIR/sweep.md``) has one row per ``TASK,VARIANT`` with its test accuracy.
LRA Image needs the CIFAR-10 python batches under ``data.data_dir`` (nothing is downloaded);
``get_config("TASK,VARIANT")`` builds one run alone.
"""

from experiments.configs.lra import image, listops

TASKS = {"listops": listops, "image": image}
VARIANTS = ("transformer", "s4d", "mamba2", "gmlp", "fnet")


def get_config(arg=None):
    parts = [p for p in (arg or "listops").split(",") if p]
    if not parts or parts[0] not in TASKS or len(parts) > 2:
        raise ValueError(f"mixer_table: config arg must be 'TASK[,VARIANT]' with TASK in "
                         f"{sorted(TASKS)}, got {arg!r}")
    variant = parts[1] if len(parts) == 2 else "transformer"
    return TASKS[parts[0]].get_config(f"{variant},runlocal")


def get_hyper(hyper):
    return hyper.args([f"{task},{variant}" for task in TASKS for variant in VARIANTS])
