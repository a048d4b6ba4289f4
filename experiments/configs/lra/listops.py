"""LRA ListOps: 10-way classification of nested MIN / MAX / MED / SM expressions, 500-2000
tokens, generated offline (xformers_jax.data.ListOps).

  python -m experiments.train --config=experiments/configs/lra/listops.py:VARIANT[,runlocal] \
      --workdir=/tmp/listops

VARIANT picks the attention (``transformer`` by default; see ``VARIANTS``). ``runlocal``
shrinks the run to a CPU-sized one (short expressions, a small model, a few hundred steps).
Model sizes follow LRA (Tay et al. 2021, appendix): 4 layers, 8 heads, dim 512, MLP 1024,
batch 32, 5K steps, rsqrt schedule with 1000 warmup steps.
"""

from xformers_jax import train

# Per-variant attention settings (the nn registry checks the hyperparameters).
VARIANTS = {
    "transformer": dict(kind="dot_product"),
    "flash": dict(kind="flash"),
    "local": dict(kind="local", left=64, right=64),
}


def parse(arg: str | None):
    """``"VARIANT[,runlocal]"`` -> (variant, runlocal)."""
    parts = [p for p in (arg or "").split(",") if p]
    runlocal = "runlocal" in parts
    names = [p for p in parts if p != "runlocal"]
    if len(names) > 1 or (names and names[0] not in VARIANTS):
        raise ValueError(f"config arg must be 'VARIANT[,runlocal]' with VARIANT in "
                         f"{sorted(VARIANTS)}, got {arg!r}")
    return (names[0] if names else "transformer"), runlocal


def get_config(arg=None):
    variant, runlocal = parse(arg)
    c = train.base_config("listops")
    c.model.update(dict(dim=512, num_layers=4, num_heads=8, hidden=1024, pooling="cls"))
    c.model.attention = train.base_config("listops").model.attention
    c.model.attention.update(VARIANTS[variant])
    c.optim.update(dict(learning_rate=5e-2, schedule="rsqrt", warmup_steps=1000,
                        weight_decay=0.1))
    c.update(dict(batch_size=32, num_train_steps=5000, eval_every=500, checkpoint_every=500))
    if runlocal:
        c.data.update(dict(num_train=2048, num_eval=256, num_test=256, min_length=16,
                           max_length=64, max_depth=3, max_args=4))
        c.model.update(dict(dim=64, num_layers=2, num_heads=4, hidden=128, pooling="mean"))
        if variant == "local":
            c.model.attention.update(dict(left=8, right=8))
        c.optim.update(dict(learning_rate=1e-3, warmup_steps=50, schedule="cosine"))
        c.update(dict(batch_size=32, num_train_steps=400, log_every=20, eval_every=100,
                      checkpoint_every=100))
    c.lock()
    return c
