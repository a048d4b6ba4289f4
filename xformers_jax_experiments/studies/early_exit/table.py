"""Early exit on the ListOps main job: test accuracy, expected layers and the FLOPs saved at
two DeeBERT entropy thresholds and PABEE patience, against full depth.

  python -m xformers_jax_experiments.studies.early_exit.table --workdir=runs/early_exit

Trains the README's main job (``listops.py:performer,main``) twice in this process, each in
``WORKDIR/NAME`` with ``run_lib.run_or_resume`` (a finished run is not trained again; an
interrupted one resumes): once as the model kind ``early_exit`` (an exit classifier after every
layer, PABEE's weighted loss) and once as it is (the full-depth model without exits). Then the
early-exit model's best checkpoint goes through :func:`xformers_jax.models.evaluate_exits`
(batches through ``models.EarlyExitClassifier.exit``) on the test split: at full depth (no example exits early),
at two entropy thresholds (DeeBERT), and at PABEE patience 1 and 2 where the depth allows
(patience p exits no earlier than layer p + 1). The two thresholds are not tuned on the test
split: they are the ``--quantiles`` of the validation split's entropies at the exits before the
last. ``--num_layers`` deepens both models (the main job has 2 layers: PABEE cannot exit
before its last layer there) and ``--nobaseline`` skips the model without exits. Writes
``OUT/early_exit.md`` and ``.json`` (``early_exit_L4.md`` for ``--num_layers=4``); ``OUT`` is
this study's folder by default.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from xformers_jax import models, train
from xformers_jax.data import DataIterator
from xformers_jax_experiments import run_lib
from xformers_jax_experiments.configs.lra import listops

_ARG = flags.DEFINE_string("config_arg", "performer,main", "listops.py's VARIANT,SIZE.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/early_exit", "Where the two runs go.")
_OUT = flags.DEFINE_string("out", os.path.dirname(os.path.abspath(__file__)),
                           "Where the table goes (default: this study's folder).")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 0, "Layers of both models (0: the config's).")
_QUANTILES = flags.DEFINE_string("quantiles", "0.25,0.5",
                                 "Validation entropy quantiles giving the two thresholds.")
_PATIENCE = flags.DEFINE_string("patience", "1,2", "PABEE patience values (those < depth).")
_BASELINE = flags.DEFINE_bool("baseline", True, "Also train the model without exits.")


def _config(kind: str):
    c = listops.get_config(_ARG.value)
    c.unlock()
    if kind == "early_exit":
        train.set_model_kind(c, "early_exit")
    if _NUM_LAYERS.value:
        c.model.num_layers = _NUM_LAYERS.value
    c.update(dict(plot=False, progress_bar=False, tensorboard=False))
    c.lock()
    return c


def _entropies(model, source, padded, batch_size):
    """Entropies of every exit but the last over a split, pooled (nats)."""
    ee = model.model
    fn = jax.jit(lambda m, x, mask: m(x, mask=mask))
    out = []
    for batch in DataIterator(source, batch_size=batch_size, shuffle=False, num_epochs=1,
                              drop_remainder=False):
        x = jnp.asarray(batch["inputs"])
        logp = jax.nn.log_softmax(fn(ee, x, (x != 0) if padded else None), -1)
        out.append(np.asarray(-(jnp.exp(logp) * logp).sum(-1))[:-1].ravel())
    return np.concatenate(out)


def main(argv):
    del argv
    configs = {"early_exit": _config("early_exit")}
    if _BASELINE.value:
        configs["full_depth"] = _config("fixed")
    trained = {name: run_lib.run_or_resume(c, os.path.join(_WORKDIR.value, name))
               for name, c in configs.items()}
    config = configs["early_exit"]
    task = train.make_task(config.data, config.seed)
    model = train.restore_model(os.path.join(_WORKDIR.value, "early_exit"), config.model, task,
                          jax.random.PRNGKey(config.seed))
    n, bs = config.model.num_layers, config.batch_size
    ent = _entropies(model, task.validation, task.padded, bs)
    quantiles = [float(q) for q in _QUANTILES.value.split(",")]
    settings = [("full depth (every layer)", "entropy", dict(threshold=-1.0))]
    for q in quantiles:
        t = float(np.quantile(ent, q))
        settings.append((f"DeeBERT entropy < {t:.3f} (validation {q:.0%} quantile)", "entropy",
                         dict(threshold=t)))
    for p in (int(p) for p in _PATIENCE.value.split(",")):
        if p < n:
            settings.append((f"PABEE patience {p}", "patience", dict(patience=p)))
    rows = []
    for label, criterion, kw in settings:
        r = models.evaluate_exits(model, task.test, bs, padded=task.padded,
                                  criterion=criterion, **kw)
        rows.append(dict(setting=label, criterion=criterion, **kw, **r,
                         load=run_lib.load_average()))
    last_exit = trained["early_exit"]["result"]["test_accuracy"]
    if abs(rows[0]["accuracy"] - last_exit) > 1e-6:
        raise AssertionError(f"full-depth exit accuracy {rows[0]['accuracy']} differs from the "
                             f"trainer's test accuracy of the last exit {last_exit}")
    plain = trained["full_depth"]["result"] if "full_depth" in trained else None
    majority = trained["early_exit"]["result"].get("test_majority_accuracy")
    summary = dict(config=f"listops.py:{_ARG.value}", num_layers=n,
                   test_examples=len(task.test), steps=config.num_train_steps,
                   majority=majority, rows=rows,
                   full_depth_model=plain and dict(accuracy=plain["test_accuracy"]),
                   runs={k: {kk: v.get(kk) for kk in ("seconds", "load_start", "load_end",
                                                          "resumed_from")}
                         for k, v in trained.items()})
    os.makedirs(_OUT.value, exist_ok=True)
    name = "early_exit" + (f"_L{n}" if _NUM_LAYERS.value else "")
    with open(os.path.join(_OUT.value, name + ".json"), "w") as f:
        json.dump(summary, f, indent=1)
    cmd = "python -m xformers_jax_experiments.studies.early_exit.table" + (
        f" --num_layers={n}" if _NUM_LAYERS.value else "") + (
        "" if _BASELINE.value else " --nobaseline")
    lines = [
        "# Early exit on the ListOps main job", "",
        f"Generated by `{cmd}`; do not edit. `{summary['config']}` "
        f"({n} layers, {config.num_train_steps} steps, {len(task.test)} test expressions), "
        "trained once with an exit classifier after every layer (PABEE's weighted loss; "
        "`model.kind='early_exit'`) and evaluated on the test split through "
        "`models.EarlyExitClassifier.exit` at batch size " f"{bs}. Entropy thresholds are "
        "quantiles of the validation split's entropies at the exits before the last. "
        "Expected layers: the mean exit layer (each example's cost, as DeeBERT and PABEE "
        "report it); FLOPs saved: 1 - expected layers / layers (the layers' share, embedding "
        "and exit heads not counted); batch layers: the layers each example's batch actually "
        f"ran (a batch stops when its last example exits). With {n} layers PABEE's patience p "
        "exits no earlier than layer p + 1.", "",
        "| setting | test accuracy | expected layers | FLOPs saved | batch layers | exits per "
        "layer |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {100 * r['accuracy']:.1f}% | "
                     f"{r['expected_layers']:.2f} | {100 * r['flops_saved']:.1f}% | "
                     f"{r['batch_layers']:.2f} | {'/'.join(map(str, r['exits']))} |")
    if plain is not None:
        lines.append(f"| full-depth model without exits (the main job as it is) | "
                     f"{100 * plain['test_accuracy']:.1f}% | {n} | 0% | {n} | |")
    if summary["majority"] is not None:
        lines.append(f"| majority class | {100 * summary['majority']:.1f}% | | | | |")

    def _how(v):
        if v.get("resumed_from") == config.num_train_steps:
            return ("trained before this script ran (resumed at its last step: the test split "
                    "re-evaluated on its best checkpoint, as the trainer does)")
        return f"{v['seconds']:.0f} s (load {v['load_start']:.1f}-{v['load_end']:.1f})"

    loads = "; ".join(f"{k}: {_how(v)}" for k, v in summary["runs"].items())
    lines += ["", f"Training: {loads}. Evaluation at load "
              f"{min(r['load'] for r in rows):.1f}-{max(r['load'] for r in rows):.1f} on the "
              "shared 2-core machine. One seed.", ""]
    with open(os.path.join(_OUT.value, name + ".md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    app.run(main)
