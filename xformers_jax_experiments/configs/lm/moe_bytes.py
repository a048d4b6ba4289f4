"""Sparse-FFN variants of the byte-level language model (``stdlib_bytes.py``'s data, sizes and
schedule, dense attention):

  python -m xformers_jax_experiments.train \
      --config=xformers_jax_experiments/configs/lm/moe_bytes.py:VARIANT[,runlocal] \
      --workdir=/tmp/lm_moe

VARIANT (the block's ``model.ffn``; every layer gets it, except in ``glam``):

* ``dense``: the dense FFN (the baseline; ``stdlib_bytes.py:transformer``).
* ``switch``: Switch Transformer (Fedus et al., 2021): 8 experts, top-1, each expert the dense
  FFN's width (same active parameters), router jitter 1e-2, dropless dispatch.
* ``gshard``: GShard (Lepikhin et al., 2020): 8 experts, top-2 with the second expert kept with
  probability min(1, 2 g2) in training, experts of half the dense width (same active
  parameters).
* ``st_moe``: ST-MoE (Zoph et al., 2022): top-2, renormalised gates, half-width experts; the
  router z-loss at ST-MoE's coefficient 1e-3 (``config.loss.router_z``).
* ``glam``: GLaM's setting (Du et al., 2022): GShard's top-2 experts in every other layer
  (``model.ffn.every = 2``; layers 1, 3, ... MoE, the others dense), 8 experts of the dense
  FFN's width as in GLaM (so an MoE layer has twice a dense layer's active parameters).
* ``hash``: Hash layers (Roller et al., 2021): a fixed balanced hash of the byte to one of 8
  dense-width experts; no router, no auxiliary loss.
* ``product_key``: product-key memory (Lample et al., 2019) in place of the FFN: 4 heads,
  k=32, 256^2 = 65,536 value rows (runlocal: 2 heads, k=8, 16^2 rows).

BASE layers (kind ``base``) are not among the variants: their balanced assignment is over the
whole batch, so they are not causal-safe and a causal LM refuses them.

``stages=S`` (e.g. ``dense,runlocal,stages=2``) puts a ``stage`` axis of size S in the mesh:
every LayerStack then runs as a GPipe pipeline over it (``nn._pipeline``; layers divisible
by S). Under it an MoE layer routes, drops and computes its auxiliary losses per
micro-batch, averaged over the micro-batches (a micro-batch is a routing group).

Load balancing is added at Switch's 1e-2 (``config.loss.load_balancing``). ``runlocal``:
``stdlib_bytes.py``'s runlocal sizes (dim 64, 2 layers, MLP 256, 128-byte windows, 200 steps).
``cpu``: the Switch-vs-dense comparison on one CPU: 128-byte windows, batch 16, a dim-128
2-layer model (dense MLP 512; Switch 8 experts of 512), 1500 steps, learning rate 1e-3
(product_key uses the small table). Results: the study ``xformers_jax_experiments/studies/moe_lm/``
(``moe_lm.md``, written by ``python -m xformers_jax_experiments.studies.moe_lm.table``).
"""

import ml_collections

from xformers_jax_experiments.configs.lm import stdlib_bytes

VARIANTS = ("dense", "switch", "gshard", "st_moe", "glam", "hash", "product_key")
SIZES = ("runlocal", "cpu")
CPU_STEPS = 1500


def ffn_config(variant: str, hidden: int, small: bool) -> dict:
    """The ``model.ffn`` section of a variant for a dense MLP width ``hidden``."""
    if variant == "dense":
        return dict(kind="dense")
    if variant == "switch":
        return dict(kind="switch", num_experts=8, k=1, jitter=1e-2)
    if variant in ("gshard", "st_moe"):
        return dict(kind=variant, num_experts=8, k=2)
    if variant == "glam":
        return dict(kind="gshard", num_experts=8, k=2, every=2)
    if variant == "hash":
        return dict(kind="hash", num_experts=8, vocab_size=256)
    if variant == "product_key":
        return (dict(kind="product_key", n_keys=16, heads=2, k=8, key_dim=32) if small else
                dict(kind="product_key", n_keys=256, heads=4, k=32, key_dim=128))
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def get_config(arg=None):
    parts = [p for p in (arg or "switch").split(",") if p]
    sizes = [p for p in parts if p in SIZES]
    size = sizes[0] if sizes else None
    stages = [int(p.split("=")[1]) for p in parts if p.startswith("stages=")]
    names = [p for p in parts if p not in SIZES and not p.startswith("stages=")]
    variant = names[0] if names else "switch"
    if len(names) > 1 or len(sizes) > 1 or variant not in VARIANTS:
        raise ValueError(f"config arg must be 'VARIANT[,runlocal|,cpu][,stages=S]' with VARIANT "
                         f"in {VARIANTS}, got {arg!r}")
    c = stdlib_bytes.get_config("transformer" + (",runlocal" if size else ""))
    with c.unlocked():
        if size == "cpu":
            # The Switch-vs-dense comparison at a size one shared CPU trains in minutes:
            # runlocal's data and schedule, a dim-128 2-layer model, longer training.
            c.data.update(dict(seq_len=128, num_eval=128, num_test=128))
            c.model.update(dict(dim=128, num_layers=2, num_heads=4, hidden=512))
            c.optim.update(dict(learning_rate=1e-3, warmup_steps=100))
            c.update(dict(batch_size=16, num_train_steps=CPU_STEPS, log_every=100,
                          eval_every=250, checkpoint_every=500))
        hidden = c.model.hidden
        if variant in ("gshard", "st_moe"):
            # Two experts per token: half-width experts keep the active parameters.
            c.model.hidden = hidden // 2
        c.model.ffn = ml_collections.ConfigDict(ffn_config(variant, hidden, size is not None))
        if stages:
            # A GPipe pipeline: the layers split over a 'stage' mesh axis, data over the rest.
            c.mesh = ml_collections.ConfigDict({"stage": stages[0], "data": -1})
    c.lock()
    return c
