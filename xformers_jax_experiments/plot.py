"""Learning curves from ``metrics.jsonl`` files to PNG.

  python -m xformers_jax_experiments.plot --workdirs=/tmp/listops,/tmp/listops_local \
      --out=curves.png

One panel per metric (default: train_loss, validation_accuracy); a restarted run's repeated
steps keep their last value.
"""

import os

from absl import app, flags

from xformers_jax_experiments import run_lib

_WORKDIRS = flags.DEFINE_list("workdirs", None, "Run directories holding metrics.jsonl.")
_METRICS = flags.DEFINE_list("metrics", ["train_loss", "validation_accuracy"], "Metrics.")
_OUT = flags.DEFINE_string("out", "curves.png", "Output PNG.")


def curves(workdir: str, metric: str):
    """``(steps, values)`` of one metric, one value per step (the last logged)."""
    points = run_lib.series(run_lib.read_metrics(workdir), metric)
    return list(points), list(points.values())


def plot(workdirs, metrics, out: str) -> None:
    """Draws ``metrics`` (one panel each) for every run in ``workdirs`` into ``out``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.5), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for workdir in workdirs:
            steps, values = curves(workdir, metric)
            ax.plot(steps, values, label=os.path.basename(os.path.normpath(workdir)))
        ax.set(title=metric, xlabel="step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    plot(_WORKDIRS.value, _METRICS.value, _OUT.value)


if __name__ == "__main__":
    flags.mark_flags_as_required(["workdirs"])
    app.run(main)
