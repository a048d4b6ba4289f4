"""LRA ListOps: 10-way classification of nested MIN / MAX / MED / SM expressions, 500-2000
tokens, generated offline (xformers_jax.data.ListOps).

  python -m xformers_jax_experiments.train \
      --config=xformers_jax_experiments/configs/lra/listops.py:VARIANT[,SIZE] \
      --workdir=/tmp/listops

VARIANT picks the attention (``transformer`` by default; see ``_common.VARIANTS``). SIZE:

- (none): the LRA setting. Model sizes follow LRA (Tay et al. 2021, appendix): 4 layers,
  8 heads, dim 512, MLP 1024, batch 32, 5K steps, rsqrt schedule with 1000 warmup steps.
- ``main``: the README's CPU job (a few minutes on 2 cores): expressions of 32-128 tokens
  and depth <= 4, a 2-layer dim-64 model, 800 steps; with Performer attention (32 features)::

    python -m xformers_jax_experiments.train \
        --config=xformers_jax_experiments/configs/lra/listops.py:performer,main \
        --workdir=/tmp/listops_main

  Measured (2026-11-28, JAX 0.10.2, 2-core AMD EPYC): 24.1% test accuracy at the best
  checkpoint, step 400 by validation accuracy (chance 10%, always answering the most common
  training label 10.9%); 142 s of CPU time including data generation, 13.6 minutes of wall
  time on a machine shared with five test runs (an idle one takes a few minutes);
  ``curves.png``, ``checkpoints/`` and ``best/`` are left in the workdir.

- ``runlocal``: a smoke run (seconds to a minute): 16-64 tokens, depth 3, 400 steps.

``get_hyper`` sweeps the learning rate (three values) over two seeds, six runs of the chosen
variant and size, gathered into one table::

    python -m xformers_jax_experiments.sweep \
        --config=xformers_jax_experiments/configs/lra/listops.py:performer,runlocal \
        --workdir=/tmp/listops_sweep --num_processes=2
"""

from xformers_jax import train
from xformers_jax_experiments.configs.lra import _common


def get_config(arg=None):
    variant, size = _common.parse(arg, sizes=("runlocal", "main"))
    c = train.base_config("listops")
    c.model.update(dict(dim=512, num_layers=4, num_heads=8, hidden=1024, pooling="cls"))
    _common.set_attention(c, variant, small=size is not None)
    c.optim.update(dict(learning_rate=5e-2, schedule="rsqrt", warmup_steps=1000,
                        weight_decay=0.1))
    c.update(dict(batch_size=32, num_train_steps=5000, eval_every=500, checkpoint_every=500))
    if size == "main":
        c.data.update(dict(num_train=6000, num_eval=500, num_test=1000, min_length=32,
                           max_length=128, max_depth=4, max_args=5))
        c.model.update(dict(dim=64, num_layers=2, num_heads=4, hidden=128, pooling="mean"))
        c.optim.update(dict(learning_rate=2e-3, warmup_steps=100, schedule="cosine",
                            weight_decay=0.01))
        c.update(dict(batch_size=32, num_train_steps=800, log_every=50, eval_every=200,
                      checkpoint_every=200))
    elif size == "runlocal":
        c.data.update(dict(num_train=2048, num_eval=256, num_test=256, min_length=16,
                           max_length=64, max_depth=3, max_args=4))
        c.model.update(dict(dim=64, num_layers=2, num_heads=4, hidden=128, pooling="mean"))
        c.optim.update(dict(learning_rate=1e-3, warmup_steps=50, schedule="cosine"))
        c.update(dict(batch_size=32, num_train_steps=400, log_every=20, eval_every=100,
                      checkpoint_every=100))
    c.lock()
    return c


def get_hyper(hyper):
    """The sweep: learning rates around each size's default, two seeds each."""
    return hyper.product([hyper.sweep("config.optim.learning_rate", [5e-4, 1e-3, 2e-3]),
                          hyper.sweep("config.seed", [0, 1])])
