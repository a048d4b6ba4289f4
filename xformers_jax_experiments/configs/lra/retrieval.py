"""LRA Retrieval: do two 4K-byte documents (ACL Anthology Network papers) cite each other?

  python -m xformers_jax_experiments.train \
      --config=xformers_jax_experiments/configs/lra/retrieval.py:VARIANT[,runlocal] \
      --workdir=/tmp/retrieval --config.data.data_dir=/path/to/lra_release/tsv_data

The AAN TSV files (``new_aan_pairs.{train,eval,test}.tsv``) must be in ``data.data_dir``;
nothing is downloaded (a missing file is an error naming the expected path). The model is a
dual encoder with a shared encoder and ``[u, v, u*v, u-v]`` features. VARIANT: see
``_common.VARIANTS``. Sizes from the LRA code base (``matching/configs/base_match_config.py``):
4 layers, 4 heads, dim 128, MLP 512, CLS pooling, batch 32, 5K steps, learning rate 0.05 with
8000 warmup steps then rsqrt decay, weight decay 0.1, 4000 bytes per document.
``runlocal``: 256-byte documents, a dim-32 model, 200 steps (still needs the TSV files).
"""

from xformers_jax import train
from xformers_jax_experiments.configs.lra import _common


def get_config(arg=None):
    variant, size = _common.parse(arg)
    c = train.base_config("retrieval")
    c.data.update(dict(data_dir="", seq_len=4000))
    c.model.update(dict(dim=128, num_layers=4, num_heads=4, hidden=512, pooling="cls"))
    _common.set_attention(c, variant, small=size is not None)
    c.optim.update(dict(learning_rate=0.05, schedule="rsqrt", warmup_steps=8000,
                        weight_decay=0.1))
    c.update(dict(batch_size=32, num_train_steps=5000, eval_every=500, checkpoint_every=500))
    if size == "runlocal":
        c.data.update(dict(seq_len=256))
        c.model.update(dict(dim=32, num_layers=2, num_heads=2, hidden=64, pooling="mean"))
        c.optim.update(dict(learning_rate=1e-3, warmup_steps=20, schedule="cosine"))
        c.update(dict(batch_size=8, num_train_steps=200, log_every=20, eval_every=100,
                      checkpoint_every=100))
    c.lock()
    return c
