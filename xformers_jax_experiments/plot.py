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


# The run's own curves: each panel's series (label, metric) and the test split's point.
_PANELS = (("loss", (("train", "train_loss"), ("validation", "validation_loss")), "test_loss"),
           ("accuracy", (("train", "train_accuracy"), ("validation", "validation_accuracy")),
            "test_accuracy"))


def learning_curves(workdir: str, out: str, *, baseline: float | None = None,
                    best_step: int | None = None) -> list[str]:
    """One run's ``curves.png``: loss and accuracy panels, each with the training curve
    (means over the logging interval), the validation curve, and the test split's value as a
    point at ``best_step`` (the checkpoint it was measured on; else the last step); the
    accuracy panel draws ``baseline`` (the majority-class accuracy) as a dashed line. Returns
    the metrics drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = run_lib.read_metrics(workdir)
    drawn = []
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(5.5 * len(_PANELS), 3.8))
    for ax, (title, lines, test) in zip(axes, _PANELS):
        for label, metric in lines:
            points = run_lib.series(rows, metric)
            if points:
                ax.plot(list(points), list(points.values()), label=label,
                        marker="o" if len(points) < 10 else None)
                drawn.append(metric)
        tested = run_lib.series(rows, test)
        if tested:
            value = list(tested.values())[-1]
            at = best_step if best_step is not None else list(tested)[-1]
            ax.plot([at], [value], "k*", markersize=11, label=f"test ({value:.3g})")
            drawn.append(test)
        if title == "accuracy" and baseline is not None:
            ax.axhline(baseline, color="gray", linestyle="--",
                       label=f"majority class ({baseline:.3g})")
            drawn.append("majority class")
        ax.set(title=f"{title}: {os.path.basename(os.path.normpath(workdir))}", xlabel="step")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return drawn


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    plot(_WORKDIRS.value, _METRICS.value, _OUT.value)


if __name__ == "__main__":
    flags.mark_flags_as_required(["workdirs"])
    app.run(main)
