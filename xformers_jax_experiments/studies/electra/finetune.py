"""ELECTRA's discriminator fine-tuned on the byte-level classification task, against the same
model trained from scratch with the same steps.

  python -m xformers_jax_experiments.train \
      --config=xformers_jax_experiments/configs/compress.py:electra,runlocal \
      --workdir=runs/electra
  python -m xformers_jax_experiments.studies.electra.finetune --electra=runs/electra --steps=300

Both classifiers are ``models.Electra(...).classifier(2)`` (the discriminator's embeddings, layers
and final norm with mean pooling and a new head): one from the pre-trained checkpoint (its
best step, restored by path with orbax), one freshly initialised. The task is ``text`` with
the standard library's bytes (``data.StdlibBytesClassification``) at the pre-training window
length, each fine-tuned once per ``--seeds`` entry (head initialisation and batch order),
the mean and every seed's accuracy reported. ``--pretrained_learning_rate`` sets the
pre-trained model's own peak learning rate (fine-tuning usually uses a lower one than
training from scratch; default: the same);
``--num_train`` the labelled training windows. Prints one JSON line with both test
accuracies and whether pre-training learned anything: the discriminator's last logged
binary cross-entropy against the entropy of its labels' base rate (a discriminator that
answers the base rate everywhere scores exactly that entropy), and appends it to ``--out``
(this study's ``compress_electra.jsonl`` by default).
"""

from __future__ import annotations

import json
import math
import os

import equinox as eqx
import jax
import numpy as np
from absl import app, flags

from xformers_jax import data as D
from xformers_jax import parallel, train
from xformers_jax_experiments import run_lib
from xformers_jax_experiments.configs import compress as configs

_ELECTRA = flags.DEFINE_string("electra", "runs/electra", "The ELECTRA pre-training workdir.")
_STEPS = flags.DEFINE_integer("steps", 300, "Fine-tuning steps (both models).")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Batch size.")
_LR = flags.DEFINE_float("learning_rate", 1e-3, "Peak learning rate (cosine, 30 warmup).")
_PRE_LR = flags.DEFINE_float("pretrained_learning_rate", None,
                             "The pre-trained model's peak learning rate (None: --learning_rate).")
_NUM_TRAIN = flags.DEFINE_integer("num_train", 4000, "Labelled training windows.")
_SEEDS = flags.DEFINE_string("seeds", "0,1,2",
                             "Fine-tuning seeds (the new head's initialisation and the batch "
                             "order); each model is fine-tuned once per seed.")
_RUNLOCAL = flags.DEFINE_bool("runlocal", True, "The pre-training used the runlocal config.")
_OUT = flags.DEFINE_string(
    "out", os.path.join(os.path.dirname(os.path.abspath(__file__)), "compress_electra.jsonl"),
    "Where the result line is appended ('' for nowhere).")


def pretraining_summary(workdir: str) -> dict:
    """The last logged discriminator loss against the base-rate entropy of its labels."""
    last = run_lib.last_row(run_lib.read_metrics(workdir), "train_disc")
    if last is None:
        return {}
    p = last["train_replaced"]
    entropy = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    return {"pretraining_steps": last["step"], "pretraining_disc_bce": last["train_disc"],
            "pretraining_base_rate_entropy": entropy,
            "pretraining_disc_accuracy": last["train_accuracy"],
            "pretraining_mlm": last["train_mlm"]}


def finetune(model, task, steps, batch_size, lr, seed):
    schedule = train.make_schedule("cosine", learning_rate=lr, warmup_steps=30,
                                   total_steps=steps)
    optimizer = train.make_optimizer(schedule, weight_decay=0.01, grad_clip_norm=1.0)
    state = train.create_train_state(model, optimizer, jax.random.PRNGKey(seed))
    step = train.make_train_step(train.make_loss_fn(task), optimizer)
    it = D.DataIterator(task.train, batch_size=batch_size, seed=seed)
    for _ in range(steps):
        state, _ = step(state, next(it))
    eval_step = train.make_eval_step(train.make_metrics_fn(task))
    return train.evaluate(eval_step, state.model, task.test, batch_size)


def main(argv):
    del argv
    ec = configs.get_config("electra,runlocal" if _RUNLOCAL.value else "electra")
    e_task = train.make_task(ec.data, ec.seed)
    key = jax.random.PRNGKey(ec.seed)
    like = eqx.filter_eval_shape(train.build_model, ec.model, e_task, key)
    pretrained = parallel.restore_checkpoint(train.state_dir(_ELECTRA.value), like, prefix="model")

    def fresh(seed):  # the same architecture, freshly initialised for each seed
        return train.build_model(ec.model, e_task, jax.random.PRNGKey(ec.seed + 1 + seed))

    tc = train.base_config("text")
    tc.data.update(dict(source="stdlib", seq_len=ec.data.seq_len, num_train=_NUM_TRAIN.value,
                        num_eval=256, num_test=512))
    task = train.make_task(tc.data, 0)
    pre_lr = _LR.value if _PRE_LR.value is None else _PRE_LR.value
    out = {"electra": _ELECTRA.value, "steps": _STEPS.value, "batch_size": _BATCH.value,
           "seq_len": ec.data.seq_len, "num_train": _NUM_TRAIN.value,
           "learning_rate": _LR.value, "pretrained_learning_rate": pre_lr,
           "load": os.getloadavg()[0]} | pretraining_summary(_ELECTRA.value)
    seeds = [int(s) for s in _SEEDS.value.split(",")]
    out["seeds"] = seeds

    def pretrained_copy(seed):  # the train step donates its state: a fresh copy per seed
        return jax.tree.map(lambda a: a.copy() if eqx.is_array(a) else a, pretrained)
    for name, electra, lr in (("electra", pretrained_copy, pre_lr),
                              ("scratch", fresh, _LR.value)):
        results = []
        for seed in seeds:
            clf = electra(seed).classifier(task.num_classes, key=jax.random.PRNGKey(7 + seed))
            results.append(finetune(clf, task, _STEPS.value, _BATCH.value, lr, seed))
        out[f"{name}_test_accuracies"] = [r["accuracy"] for r in results]
        out[f"{name}_test_accuracy"] = float(np.mean(out[f"{name}_test_accuracies"]))
        out[f"{name}_test_loss"] = float(np.mean([r["loss"] for r in results]))
    print(json.dumps(out))
    if _OUT.value:
        with open(_OUT.value, "a") as f:
            f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    app.run(main)
