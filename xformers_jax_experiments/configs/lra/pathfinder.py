"""LRA Pathfinder: are the two marked dots connected by a path? 32x32 images, 1024 pixels.

  python -m xformers_jax_experiments.train \
      --config=xformers_jax_experiments/configs/lra/pathfinder.py:VARIANT[,runlocal] \
      --workdir=/tmp/pathfinder

Images are generated offline (``xformers_jax.data.Pathfinder``, difficulty ``hard`` as in
LRA). VARIANT: see ``_common.VARIANTS``. Sizes from the LRA code base (``image/configs/
pathfinder32/base_pathfinder32_config.py``): 1 layer, 2 heads, dim 32, MLP 32 (LRA's
``qkv_dim`` is half the embedding, 16; here q/k/v keep the model width), mean pooling,
batch 512, learning rate 1e-3, one epoch of warmup then cosine decay over 200 epochs,
no weight decay, no clipping; 160K / 20K / 20K examples. ``runlocal``: easy 32x32 images,
2048 examples, 300 steps.
"""

from xformers_jax import train
from xformers_jax_experiments.configs.lra import _common

TRAIN_EXAMPLES = 160_000


def get_config(arg=None):
    variant, size = _common.parse(arg)
    c = train.base_config("pathfinder")
    c.data.update(dict(num_train=TRAIN_EXAMPLES, num_eval=20_000, num_test=20_000, size=32,
                       difficulty="hard"))
    c.model.update(dict(dim=32, num_layers=1, num_heads=2, hidden=32, pooling="mean"))
    _common.set_attention(c, variant, small=size is not None)
    steps_per_epoch = TRAIN_EXAMPLES // 512
    c.optim.update(dict(learning_rate=1e-3, schedule="cosine", warmup_steps=steps_per_epoch,
                        weight_decay=0.0, grad_clip_norm=0.0))
    c.update(dict(batch_size=512, num_train_steps=200 * steps_per_epoch,
                  eval_every=steps_per_epoch, checkpoint_every=steps_per_epoch))
    if size == "runlocal":
        c.data.update(dict(num_train=2048, num_eval=256, num_test=256, size=32,
                           difficulty="easy"))
        c.model.update(dict(dim=32, num_layers=2, num_heads=2, hidden=64))
        c.optim.update(dict(warmup_steps=20))
        c.update(dict(batch_size=32, num_train_steps=300, log_every=20, eval_every=100,
                      checkpoint_every=100))
    c.lock()
    return c
