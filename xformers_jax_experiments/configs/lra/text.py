"""LRA Text: byte-level binary classification of 4K-byte documents.

  python -m xformers_jax_experiments.train \
      --config=xformers_jax_experiments/configs/lra/text.py:VARIANT[,runlocal] \
      --workdir=/tmp/text

The LRA data is IMDb reviews (``data.source="imdb"``, ``data.data_dir`` holding the
``aclImdb`` folder; nothing is downloaded). The default source is offline: the Python standard
library's source files, each snippet labelled test code (1) or library code (0)
(``xformers_jax.data.StdlibBytesClassification``). VARIANT: see ``_common.VARIANTS``.
Sizes from the LRA code base (``text_classification/configs/base_tc_config.py``): 4 layers,
4 heads, dim 256, MLP 1024, CLS pooling, batch 32, 20K steps, learning rate 0.05 with 8000
linear warmup steps then rsqrt decay, weight decay 0.1; the paper's length is 4K bytes.
``runlocal``: 256-byte snippets, a dim-64 2-layer model, 300 steps.
"""

from xformers_jax import train
from xformers_jax_experiments.configs.lra import _common


def get_config(arg=None):
    variant, size = _common.parse(arg)
    c = train.base_config("text")
    c.data.update(dict(source="stdlib", seq_len=4000, num_train=25_000, num_eval=2_500,
                       num_test=2_500))
    c.model.update(dict(dim=256, num_layers=4, num_heads=4, hidden=1024, pooling="cls"))
    _common.set_attention(c, variant, small=size is not None)
    c.optim.update(dict(learning_rate=0.05, schedule="rsqrt", warmup_steps=8000,
                        weight_decay=0.1))
    c.update(dict(batch_size=32, num_train_steps=20_000, eval_every=1000,
                  checkpoint_every=1000))
    if size == "runlocal":
        c.data.update(dict(seq_len=256, num_train=2048, num_eval=256, num_test=256))
        c.model.update(dict(dim=64, num_layers=2, num_heads=4, hidden=128, pooling="mean"))
        c.optim.update(dict(learning_rate=1e-3, warmup_steps=30, schedule="cosine"))
        c.update(dict(batch_size=16, num_train_steps=300, log_every=20, eval_every=100,
                      checkpoint_every=100))
    c.lock()
    return c
