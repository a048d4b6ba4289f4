"""LRA Image: CIFAR-10 as a sequence of 1024 grey-scale pixels, 10 classes.

  python -m xformers_jax_experiments.train \
      --config=xformers_jax_experiments/configs/lra/image.py:VARIANT[,runlocal] \
      --workdir=/tmp/image --config.data.data_dir=/path/to/cifar-10-batches-py

The CIFAR-10 python batches must be in ``data.data_dir`` (nothing is downloaded). VARIANT: see
``_common.VARIANTS``. Sizes from the LRA code base (``image/configs/cifar10/
base_cifar10_config.py``): 1 layer, 1 head, dim 32, MLP 64, CLS pooling, batch 256,
learning rate 5e-4 with one epoch of warmup then cosine decay over 200 epochs (35K steps),
no weight decay and no clipping (LRA's dropout 0.3 is not modelled: the models here have no
dropout). ``runlocal``: 200 steps of batch 32 (still needs the CIFAR-10 files).
"""

from xformers_jax import train
from xformers_jax_experiments.configs.lra import _common

TRAIN_EXAMPLES = 45_000


def get_config(arg=None):
    variant, size = _common.parse(arg)
    c = train.base_config("image")
    c.model.update(dict(dim=32, num_layers=1, num_heads=1, hidden=64, pooling="cls"))
    _common.set_attention(c, variant, small=size is not None)
    steps_per_epoch = TRAIN_EXAMPLES // 256
    c.optim.update(dict(learning_rate=5e-4, schedule="cosine", warmup_steps=steps_per_epoch,
                        weight_decay=0.0, grad_clip_norm=0.0))
    c.update(dict(batch_size=256, num_train_steps=200 * steps_per_epoch,
                  eval_every=steps_per_epoch, checkpoint_every=steps_per_epoch))
    if size == "runlocal":
        c.optim.update(dict(learning_rate=1e-3, warmup_steps=20))
        c.update(dict(batch_size=32, num_train_steps=200, log_every=20, eval_every=100,
                      checkpoint_every=100))
    c.lock()
    return c
