"""Byte-level language modelling on the Python standard library's source (or enwik8).

  python -m xformers_jax_experiments.train \
      --config=xformers_jax_experiments/configs/lm/stdlib_bytes.py:VARIANT[,packed][,runlocal] \
      --workdir=/tmp/lm

A causal ``models.CausalLM`` predicts each next byte; train / validation / test are disjoint sets
of files (``xformers_jax.data.stdlib_bytes_lm``). ``--config.data.source=enwik8
--config.data.data_dir=DIR`` trains on enwik8 instead (the unzipped file in DIR; 90M / 5M / 5M
bytes). Reported loss is nats per byte (bits per byte = loss / ln 2); accuracy is next-byte
top-1. VARIANT must be able to run causally: ``transformer`` (dense), ``flash``, ``local``,
``performer``, ``linear``, ``reformer``. Sizes: a small character-level model in the style of
the Transformer-XL / Sparse Transformer enwik8 baselines scaled down (our choice, no paper
setting): 6 layers, 8 heads, dim 512, MLP 2048, 1024-byte windows, batch 32, 50K steps,
learning rate 2.5e-4 cosine. ``runlocal``: 128-byte windows, a dim-64 2-layer model,
200 steps.

``packed`` (``data.pack=True``): each file is a document and rows are packed with whole files
(or pieces of long ones, ``xformers_jax.data.PackedDocuments``) instead of windows of the
concatenated files, so no byte is predicted from another file; positions restart at each
file, and the loss is the mean over the real bytes. VARIANT must honour segment ids:
``transformer``, ``flash``, ``local``, ``performer`` or ``linear``.
"""

from xformers_jax import train
from xformers_jax_experiments.configs.lra import _common

CAUSAL_VARIANTS = ("transformer", "flash", "local", "performer", "linear", "reformer")
# The variants whose attention kind honours segment ids (packed rows).
PACKED_VARIANTS = ("transformer", "flash", "local", "performer", "linear")


def get_config(arg=None):
    parts = (arg or "").split(",")
    packed = "packed" in parts
    variant, size = _common.parse(",".join(p for p in parts if p != "packed"))
    if packed and variant not in PACKED_VARIANTS:
        raise ValueError(f"packed rows need an attention kind that honours segment ids, one of "
                         f"{PACKED_VARIANTS}; got {variant!r}")
    if variant not in CAUSAL_VARIANTS:
        raise ValueError(f"the LM needs a causal attention, one of {CAUSAL_VARIANTS}; got "
                         f"{variant!r}")
    c = train.base_config("lm")
    c.data.update(dict(source="stdlib", seq_len=1024, num_eval=512, num_test=1024,
                       pack=packed))
    c.model.update(dict(dim=512, num_layers=6, num_heads=8, hidden=2048))
    _common.set_attention(c, variant, small=size is not None)
    if variant == "local":
        c.model.attention.update(dict(right=0))
    c.optim.update(dict(learning_rate=2.5e-4, schedule="cosine", warmup_steps=2000,
                        weight_decay=0.01))
    c.update(dict(batch_size=32, num_train_steps=50_000, eval_every=2000,
                  checkpoint_every=2000))
    if size == "runlocal":
        c.data.update(dict(seq_len=128, num_eval=64, num_test=64))
        c.model.update(dict(dim=64, num_layers=2, num_heads=4, hidden=256))
        c.optim.update(dict(learning_rate=2e-3, warmup_steps=20))
        c.update(dict(batch_size=16, num_train_steps=200, log_every=20, eval_every=100,
                      checkpoint_every=100))
    c.lock()
    return c
