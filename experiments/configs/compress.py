"""Lighter models on the ListOps main job (and ELECTRA on byte-level text): quantization,
pruning, distillation.

  python -m experiments.train --config=experiments/configs/compress.py:METHOD[,runlocal] \
      --workdir=runs/METHOD

The model is the README's main job (``lra/listops.py:transformer,main``: 2 layers, dim 64,
800 steps) with dense attention; ``runlocal`` uses the smaller ListOps runlocal data and 400
steps. METHOD:

- ``teacher``: the float model, then after training int8 post-training quantization
  (activations calibrated by max on 4 training batches) and 25% of heads pruned by
  importance, each evaluated on the test split (``test_accuracy_int8``,
  ``test_accuracy_heads_pruned``, checkpoint and array bytes of both models).
- ``int4``: as ``teacher`` with weight-only int4 instead of int8.
- ``qat``: trained with fake quantization (straight-through estimator), then int8.
- ``prune``: 50% unstructured magnitude pruning per layer on Zhu & Gupta's schedule (pruning
  every 50 steps until 3/4 of the run).
- ``lottery``: a lottery ticket (Frankle et al., 2020): 50% magnitude pruning per layer at
  half the run, the weights rewound to those after 50 steps, trained on with fixed masks.
- ``layerdrop``: trained with LayerDrop 0.2 (Fan et al., 2020), then one of the two layers
  kept (``test_accuracy_layers_pruned``; also int8 PTQ as in ``teacher``).
- ``student``: a 1-layer student distilled from a 2-layer teacher
  (``--config.distill.teacher=runs/teacher``): alpha 0.5, T 2, DistilBERT init from every
  other teacher layer and its cosine loss. ``scratch``: the same student without a teacher.
  ``tinybert``: a 1-layer student of half the width (dim 32, 2 heads, MLP 64) distilled with
  KD and TinyBERT's attention-map and projected hidden-state losses (weight 1 each);
  ``tinybert_scratch``: the same student without a teacher.
- ``electra``: ELECTRA pre-training (``nn.Electra``, generator at a quarter width,
  discriminator weight 50) on the standard library's bytes, 128-byte windows;
  ``experiments/electra_finetune.py`` then fine-tunes its discriminator on the byte
  classification task against the same classifier from scratch.

Measured with ``runlocal`` (400 steps, 2048 training expressions of 16-64 tokens, 256 test
expressions: one example is 0.4 points, so differences of 1-2 points are within noise) on 2
CPU cores shared with other jobs (load average 11-17), one seed:

- ``teacher``: float32 24.6% test accuracy (majority class 11.3%); int8 post-training
  (max-calibrated activations) 23.8%; 25% of heads pruned by importance (the last layer's
  heads 2 and 3) 25.8%; parameter bytes 272,912 float32 against 75,244 int8 (3.6x; norms,
  biases and scales stay float32), orbax checkpoint directories 276,034 against 113,435 bytes
  (2.4x: per-array metadata weighs on a model this small).
- ``qat``: 22.3% (fake-quantized) and 22.3% after conversion to int8.
- ``prune``: 50% of every matmul weight per layer: 22.7%.
- ``student`` (1 layer, KD from ``teacher``, every-other-layer init, cosine loss): 24.2% test,
  27.3% validation; ``scratch`` (same 1-layer model, no teacher): 23.0% test, 23.4%
  validation.
- ``electra``: 200 steps (batch 16): the discriminator's accuracy 86.0% on the test windows,
  near the share of positions left original. Fine-tuned on the byte classification task
  (``electra_finetune.py``, 300 steps, batch 16, 128-byte windows, 512 test windows): 68.4%
  test accuracy against 72.7% for the same classifier from scratch: this short
  pre-training did not help (not the paper's result; longer pre-training not measured).

Re-measured on this code with ``runlocal`` and 1000 test expressions
(``--config.data.num_test=1000``: one example is 0.1 point), seeds 0, 1, 2 (``--config.seed``;
the seed also draws the data), one run at a time with ``nice -n 5`` on the shared 2-core
machine at load average 6-20 (62-230 s per run). Test accuracy in %, seeds 0 / 1 / 2, mean:

- float32 (``teacher``): 24.3 / 22.4 / 21.9, 22.87 (majority class 11.4 / 11.5 / 10.9).
- int8 PTQ of it (max-calibrated): 24.2 / 22.3 / 22.1, 22.87: within 1 point (met).
- ``qat`` after conversion to int8: 23.2 / 22.2 / 20.9, 22.10 (fake-quantized float 23.3 / 22.7 /
  21.3): 0.77 below float32 on the mean, so within 0.5 is **not met** (seeds -1.1, -0.2,
  -1.0).
- ``prune`` (50% per layer, gradual; best checkpoint from the final sparsity on): 23.3 / 23.4 /
  22.6, 23.10: within 1 point (met; each seed within 1.0).
- 25% of heads pruned by importance (in ``teacher``): 25.1 / 23.2 / 17.8, 22.03: a 0.83-point
  drop on the mean, 4.1 points on seed 2.
- Seed 0 only: weight-only int4 (``int4``) 23.2 (float32 24.3); ``lottery`` (50% one-shot at
  step 200, rewound to step 50) 24.3; ``layerdrop`` (LayerDrop 0.2) 22.2 with both layers,
  21.6 with one, 22.5 in int8; ``tinybert`` (dim 32, 1 layer, KD + TinyBERT from seed 0's
  teacher) 21.0 test / 25.4 validation against ``tinybert_scratch`` 22.6 / 23.4: the
  distilled student lost on the test split (its TinyBERT losses fell: attention 2.75 to 1.11,
  hidden 3.53 to 0.31 over the run).
- ``electra`` without ``runlocal`` (800 steps, batch 16; discriminator accuracy 85.9% on the
  test windows), then ``electra_finetune.py --runlocal=False`` (300 steps): 66.8% against
  72.7% from scratch: 4x longer pre-training still did not help (**not met**).

These models reach only 22-24% (majority 11%), so the compression effects are small against
seed-to-seed spread (float32 ranges 21.9-24.3).
"""

from experiments.configs.lra import listops
from xformers_jax import train

METHODS = ("teacher", "int4", "qat", "prune", "lottery", "layerdrop", "student", "scratch",
           "tinybert", "tinybert_scratch", "electra")


def _electra(runlocal: bool):
    c = train.base_config("electra")
    c.data.update(dict(seq_len=128, num_eval=64, num_test=128))
    c.model.update(dict(dim=64, num_layers=2, num_heads=4, hidden=128))
    c.optim.update(dict(learning_rate=1e-3, warmup_steps=50, schedule="cosine",
                        weight_decay=0.01))
    c.update(dict(batch_size=16, num_train_steps=200 if runlocal else 800, log_every=20,
                  eval_every=100, checkpoint_every=100))
    c.lock()
    return c


def get_config(arg=None):
    parts = [p for p in (arg or "teacher").split(",") if p]
    method, sizes = parts[0], parts[1:]
    if method not in METHODS or set(sizes) - {"runlocal"}:
        raise ValueError(f"compress config: METHOD[,runlocal] with METHOD one of {METHODS}, "
                         f"got {arg!r}")
    runlocal = "runlocal" in sizes
    if method == "electra":
        return _electra(runlocal)
    c = listops.get_config("transformer," + ("runlocal" if runlocal else "main"))
    c.unlock()
    c.calibration.num_batches = 4
    if method in ("teacher", "int4"):
        c.quantize = "int8" if method == "teacher" else "int4"
        c.prune.heads = 0.25
    elif method == "qat":
        c.quantize = "qat"
    elif method == "prune":
        c.prune.update(dict(sparsity=0.5, scope="layer", frequency=50))
    elif method == "lottery":
        c.prune.update(dict(sparsity=0.5, scope="layer", rewind_step=50))
    elif method == "layerdrop":
        c.quantize = "int8"
        c.prune.update(dict(layerdrop=0.2, layers=c.model.num_layers // 2))
    elif method in ("student", "scratch"):
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
