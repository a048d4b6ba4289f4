"""LRA Path-X: Pathfinder at 128x128 pixels, sequences of 16K.

  python -m xformers_jax_experiments.train \
      --config=xformers_jax_experiments/configs/lra/pathx.py:VARIANT[,runlocal] \
      --workdir=/tmp/pathx

Images are generated offline (``xformers_jax.data.Pathfinder`` at ``PATHX_SIZE``, ``hard``).
Every model in the LRA paper stayed at chance on Path-X. VARIANT: see ``_common.VARIANTS``
(the dense ``transformer`` needs 16K x 16K scores per head: use ``flash`` or an efficient
variant). Sizes from the LRA code base (``image/configs/pathfinder128/
base_pathfinder128_config.py``, which matches the 32x32 base): 1 layer, 2 heads, dim 32,
MLP 32, mean pooling, batch 512, learning rate 1e-3, cosine decay; 160K / 20K / 20K
examples. ``runlocal``: 32x32 images, 512 examples, 100 steps (the data path of Path-X at a
smoke-test size).
"""

from xformers_jax import data, train
from xformers_jax_experiments.configs.lra import _common

TRAIN_EXAMPLES = 160_000


def get_config(arg=None):
    variant, size = _common.parse(arg, default="flash")
    c = train.base_config("pathfinder")
    c.data.update(dict(num_train=TRAIN_EXAMPLES, num_eval=20_000, num_test=20_000,
                       size=data.PATHX_SIZE, difficulty="hard"))
    c.model.update(dict(dim=32, num_layers=1, num_heads=2, hidden=32, pooling="mean"))
    _common.set_attention(c, variant, small=size is not None)
    steps_per_epoch = TRAIN_EXAMPLES // 512
    c.optim.update(dict(learning_rate=1e-3, schedule="cosine", warmup_steps=steps_per_epoch,
                        weight_decay=0.0, grad_clip_norm=0.0))
    c.update(dict(batch_size=512, num_train_steps=200 * steps_per_epoch,
                  eval_every=steps_per_epoch, checkpoint_every=steps_per_epoch))
    if size == "runlocal":
        c.data.update(dict(num_train=512, num_eval=64, num_test=64, size=32))
        c.optim.update(dict(warmup_steps=10))
        c.update(dict(batch_size=16, num_train_steps=100, log_every=20, eval_every=50,
                      checkpoint_every=50))
    c.lock()
    return c
