"""Lighter models on the ListOps main job (and ELECTRA on byte-level text): quantization,
pruning, distillation.

  python -m xformers_jax_experiments.train \
      --config=xformers_jax_experiments/configs/compress.py:METHOD[,SIZE] \
      --workdir=runs/METHOD

The model is the README's main job (``lra/listops.py:transformer,main``: 2 layers, dim 64,
800 steps) with dense attention. SIZE: ``runlocal`` (ListOps runlocal: 2048 training
expressions of 16-64 tokens, depth 3, 400 steps: the models reach only 22-24%, so seed-to-seed
spread is as large as the compression effects) or ``long`` (the same expressions, 8000 for
training, 500 validation, 1000 test, learning rate 2e-3, 3000 steps: two to four minutes a
run on 2 CPU cores; the models reach about 33-35%). METHOD:

- ``teacher``: the float model, then after training int8 post-training quantization
  (activations calibrated by max on 4 training batches) and 25% of heads pruned by
  importance, each evaluated on the test split (``test_accuracy_int8``,
  ``test_accuracy_heads_pruned``, checkpoint and array bytes of both models).
- ``int4``: as ``teacher`` with weight-only int4 instead of int8.
- ``qat``: quantization-aware fine-tuning of the float model (``init_from``, default
  ``runs/teacher``) with fake quantization (straight-through estimator) for a quarter of the
  teacher's steps at a tenth of its learning rate, then int8.
- ``prune``: 50% unstructured magnitude pruning per layer on Zhu & Gupta's schedule (pruning
  every 50 steps until 3/4 of the run).
- ``lottery``: a lottery ticket (Frankle et al., 2020): 50% magnitude pruning per layer at
  half the run, the weights rewound to those after 50 steps, trained on with fixed masks.
- ``layerdrop``: trained with LayerDrop 0.2 (Fan et al., 2020), then one of the two layers
  kept (``test_accuracy_layers_pruned``; also int8 PTQ as in ``teacher``).
- ``student``: a 1-layer student distilled from a 2-layer teacher
  (``--config.distill.teacher=runs/teacher``) for a third of the teacher's steps
  (``STUDENT_FRACTION``): alpha 0.5, T 2, DistilBERT init from every other teacher layer and
  its cosine loss. ``scratch``: the same student without a teacher, the same steps.
  ``tinybert``: a 1-layer student of half the width (dim 32, 2 heads, MLP 64) distilled with
  KD and TinyBERT's attention-map and projected hidden-state losses (weight 1 each);
  ``tinybert_scratch``: the same student without a teacher.
- ``electra``: ELECTRA pre-training (``models.Electra``, generator at a quarter width,
  discriminator weight 50, rotary positions) on the standard library's bytes, 128-byte
  windows, 5000 steps of batch 16 (about 8 minutes on 2 CPU cores; runlocal 200); the study
  ``xformers_jax_experiments/studies/electra/`` then fine-tunes its discriminator on the byte
  classification task against the same classifier from scratch.

The figures over seeds (teacher, int8, heads, qat, prune, student, scratch) are the study
``xformers_jax_experiments/studies/compress/``:
``python -m xformers_jax_experiments.studies.compress.figures --size=long --seeds=0,1,2`` writes
its ``compress_listops_long.md``.
"""

from xformers_jax import train
from xformers_jax_experiments.configs.lra import listops

# Students (distilled or from scratch) train for 1/STUDENT_FRACTION of the teacher's steps.
STUDENT_FRACTION = 3
METHODS = ("teacher", "int4", "qat", "prune", "lottery", "layerdrop", "student", "scratch",
           "tinybert", "tinybert_scratch", "electra")


def _electra(runlocal: bool):
    c = train.base_config("electra")
    c.data.update(dict(seq_len=128, num_eval=64, num_test=128))
    c.model.update(dict(dim=64, num_layers=2, num_heads=4, hidden=128))
    c.optim.update(dict(learning_rate=1e-3, warmup_steps=50, schedule="cosine",
                        weight_decay=0.01))
    c.update(dict(batch_size=16, num_train_steps=200 if runlocal else 5000, log_every=20,
                  eval_every=100 if runlocal else 1000,
                  checkpoint_every=100 if runlocal else 1000))
    c.lock()
    return c


def get_config(arg=None):
    parts = [p for p in (arg or "teacher").split(",") if p]
    method, sizes = parts[0], parts[1:]
    if method not in METHODS or set(sizes) - {"runlocal", "long"} or len(sizes) > 1:
        raise ValueError(f"compress config: METHOD[,runlocal|long] with METHOD one of "
                         f"{METHODS}, got {arg!r}")
    runlocal = "runlocal" in sizes
    if method == "electra":
        return _electra(runlocal)
    c = listops.get_config("transformer," + ("main" if not sizes else "runlocal"))
    c.unlock()
    if "long" in sizes:
        c.data.update(dict(num_train=8000, num_eval=500, num_test=1000))
        c.optim.update(dict(learning_rate=2e-3, warmup_steps=100))
        c.update(dict(num_train_steps=3000, log_every=50, eval_every=500,
                      checkpoint_every=500))
    c.calibration.num_batches = 4
    if method in ("teacher", "int4"):
        c.quantize = "int8" if method == "teacher" else "int4"
        c.prune.heads = 0.25
    elif method == "qat":
        # Fine-tuned from the float model (``runs/teacher``; the standard recipe) for a
        # quarter of its steps at a tenth of its learning rate, with fake quantization.
        c.quantize = "qat"
        c.init_from = "runs/teacher"
        c.num_train_steps //= 4
        c.eval_every = c.checkpoint_every = min(c.eval_every, c.num_train_steps)
        c.optim.update(dict(learning_rate=c.optim.learning_rate / 10,
                            warmup_steps=c.num_train_steps // 10))
    elif method == "prune":
        c.prune.update(dict(sparsity=0.5, scope="layer", frequency=50))
    elif method == "lottery":
        c.prune.update(dict(sparsity=0.5, scope="layer", rewind_step=50))
    elif method == "layerdrop":
        c.quantize = "int8"
        c.prune.update(dict(layerdrop=0.2, layers=c.model.num_layers // 2))
    if method in ("student", "scratch", "tinybert", "tinybert_scratch"):
        # A student's budget is a fraction of its teacher's: with equal steps the 1-layer
        # model reaches the 2-layer teacher's accuracy on this task, so the teacher has
        # nothing to teach (size long, 3000 steps, mean test accuracy over seeds 0-2:
        # teacher 35.1%, 1-layer from scratch 36.2%, distilled 35.5%).
        c.num_train_steps //= STUDENT_FRACTION
        c.eval_every = c.checkpoint_every = min(c.eval_every, c.num_train_steps)
    if method in ("student", "scratch"):
        c.distill.update(dict(num_layers=c.model.num_layers))
        c.model.num_layers = c.model.num_layers // 2
        if method == "student":
            c.distill.update(dict(teacher="runs/teacher", alpha=0.5, temperature=2.0,
                                  cosine=1.0, init="every_other"))
    elif method in ("tinybert", "tinybert_scratch"):
        m = c.model
        c.distill.update(dict(num_layers=m.num_layers, dim=m.dim, num_heads=m.num_heads,
                              hidden=m.hidden))
        c.model.update(dict(num_layers=m.num_layers // 2, dim=m.dim // 2, hidden=m.hidden // 2))
        if method == "tinybert":
            c.distill.update(dict(teacher="runs/teacher", alpha=0.5, temperature=2.0,
                                  tinybert_attention=1.0, tinybert_hidden=1.0))
    c.lock()
    return c
