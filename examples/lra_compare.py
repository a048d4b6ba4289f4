"""Train and compare attention kinds on a Long Range Arena task (ListOps), with the trainer.

The configs under ``xformers_jax_experiments/configs/lra/`` are functions of one argument,
``VARIANT[,SIZE]``: the variant picks the attention kind, ``runlocal`` shrinks the task to run
on a CPU. Here each variant's config is shrunk further, trained with
``train.train_and_evaluate`` in its own workdir (checkpoints, ``metrics.jsonl``, TensorBoard
events), and the test accuracies are printed beside the majority-class baseline.

  python examples/lra_compare.py --steps=400 --workdir=/tmp/lra_compare

The defaults train each kind for 400 steps on 16-64-token expressions (about a minute per kind
on 2 CPU cores); at that size the kinds are close to one another and only a few points above
the baseline: compare kinds on the full ``main`` or LRA sizes for conclusions.
"""

import argparse
import os
import tempfile

from xformers_jax import train
from xformers_jax_experiments.configs.lra import listops

KINDS = ("transformer", "performer", "nystrom", "local")


def config_for(variant: str, steps: int):
    """The ListOps ``runlocal`` config for ``variant``, trained for ``steps`` steps."""
    c = listops.get_config(f"{variant},runlocal")
    with c.unlocked():
        every = max(steps // 2, 1)
        c.update(dict(num_train_steps=steps, eval_every=every, checkpoint_every=every,
                      log_every=every))
        c.optim.warmup_steps = min(c.optim.warmup_steps, max(steps // 4, 1))
        if steps < 100:  # a smoke test: a smaller data set and model
            c.data.update(dict(num_train=256, num_eval=64, num_test=64, max_length=32))
            c.model.update(dict(dim=32, num_layers=1, hidden=64))
            c.batch_size = 16
    return c


def main(steps: int = 400, workdir: str | None = None, kinds=KINDS) -> dict:
    workdir = workdir or tempfile.mkdtemp(prefix="lra_compare_")
    results = {}
    for variant in kinds:
        results[variant] = train.train_and_evaluate(config_for(variant, steps),
                                                    os.path.join(workdir, variant))
    print(f"ListOps, {steps} steps (majority-class baseline "
          f"{next(iter(results.values()))['test_majority_accuracy']:.3f})")
    print(f"{'kind':12s} {'test accuracy':>13s} {'test loss':>9s}")
    for variant, r in results.items():
        print(f"{variant:12s} {r['test_accuracy']:13.3f} {r['test_loss']:9.3f}")
    print(f"runs in {workdir} (metrics.jsonl, TensorBoard events, checkpoints)")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    main(args.steps, args.workdir)
