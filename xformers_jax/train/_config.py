"""The trainer's config schema: every key is consumed, an unknown or missing key is an error.

``base_config(task)`` returns the full, defaulted ``ml_collections.ConfigDict`` for a task;
experiment configs (``experiments/configs/**.py``) change its values and lock it. The trainer
calls ``validate_config`` before anything else, so a misspelt key (the LRA code's silently
ignored settings, CATALOG.md) stops the run instead of training the wrong thing.
Only ``model.attention``, ``model.ffn`` and ``model.memory`` are open: ``kind`` plus that
variant's hyperparameters, which the attention and FFN registries (``xformers_jax.nn``) and the
memory builder (``_tasks``) check when the model is built. ``loss`` holds the coefficients of the
FFNs' auxiliary losses (mixtures of experts: ``load_balancing``, Switch's 1e-2, and
``router_z``, ST-MoE's 1e-3), summed over layers into the training loss.
"""

from __future__ import annotations

import ml_collections

from . import _compress
from ._optim import SCHEDULES
from . import _arch_models
from ._tasks import get_task

POOLINGS = ("cls", "mean")
PRECISIONS = ("float32", "bfloat16", "float16")


def base_config(task: str) -> ml_collections.ConfigDict:
    """Every key the trainer reads, with defaults, for ``task`` (a name in ``TASKS``, whose
    spec gives the data keys)."""
    schema = get_task(task).data
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.data = ml_collections.ConfigDict(dict(task=task, **schema))
    c.model = ml_collections.ConfigDict(dict(
        dim=512, num_layers=4, num_heads=8, hidden=1024, pooling="cls",
        # The block's token mixer (nn.MixerSpec), replacing self attention: kind "none" or a
        # registered mixer (s4d, mamba2, retnet, fnet, gmlp, ...) plus its hyperparameters
        # (open, like attention).
        mixer=ml_collections.ConfigDict(dict(kind="none")),
        attention=ml_collections.ConfigDict(dict(kind="dot_product")),
        # Segment-level recurrence (tasks fed by contiguous streams, e.g. lm_stream): kind
        # "none", "xl", "ernie" or "compressive" plus its lengths (open, like attention).
        memory=ml_collections.ConfigDict(dict(kind="none")),
        # The block's FFN (nn.FFNSpec): kind "dense" or a registered sparse/capacity kind
        # (switch, gshard, st_moe, hash, product_key, ...) plus its hyperparameters (open).
        ffn=ml_collections.ConfigDict(dict(kind="dense")),
        # Architecture and depth (train/_arch_models.py): arch "transformer" or "swin" (with
        # model.swin's patch, window, depths, heads); depth_mode "fixed", "act" (at most
        # num_layers steps of one block; act_threshold) or "early_exit" (an exit per layer).
        arch="transformer", depth_mode="fixed", act_threshold=0.99,
        swin=ml_collections.ConfigDict(dict(patch=1, window=4, depths=(2, 2), heads=(2, 4)))))
    # Coefficients of the FFNs' auxiliary losses, each summed over layers into the training
    # loss (mixtures of experts: load balancing, Switch's 1e-2; router z-loss, ST-MoE's 1e-3).
    # ponder: ACT's ponder cost (model.depth_mode="act").
    c.loss = ml_collections.ConfigDict(dict(load_balancing=1e-2, router_z=1e-3, ponder=1e-2))
    c.optim = ml_collections.ConfigDict(dict(
        learning_rate=1e-3, schedule="rsqrt", warmup_steps=1000, weight_decay=0.1,
        grad_clip_norm=1.0, b1=0.9, b2=0.98,
        # Peak learning rate of the state space parameters (nn.SSM_PARAMETERS; None: the
        # same as learning_rate); they are never weight-decayed.
        ssm_learning_rate=None))
    # Compute dtype of the model (parameters and the loss stay float32); float16 trains with
    # the dynamic loss scale below.
    c.precision = "float32"
    c.loss_scale = ml_collections.ConfigDict(dict(init_scale=2.0 ** 15, growth_interval=2000))
    # Mesh axis sizes (-1 fills; {"strategy": "data+tensor", "tensor": 2} names a strategy)
    # and the sharding rules (empty: the defaults). See _sharding.py.
    c.mesh = ml_collections.ConfigDict({"data": -1})
    c.sharding = ml_collections.ConfigDict(dict(param_rules=(), compute_rules=()))
    c.batch_size = 32
    # Grain worker processes producing the training batches (0: one read-ahead thread); a
    # run resumes with the worker count it was checkpointed with.
    c.data_workers = 0
    c.num_microbatches = 1
    c.num_train_steps = 10_000
    c.log_every = 50
    c.eval_every = 1000
    c.checkpoint_every = 1000
    c.keep_checkpoints = 3
    c.tensorboard = True
    c.progress_bar = True
    c.plot = True  # experiments/train.py draws workdir/curves.png at the end (matplotlib)
    _compress.add_defaults(c)  # quantize, calibration, prune, distill
    return c


def _compare(config, reference, path=""):
    got, want = set(config.keys()), set(reference.keys())
    if got - want:
        raise ValueError(f"unknown config keys: {sorted(path + k for k in got - want)}")
    if want - got:
        raise ValueError(f"missing config keys: {sorted(path + k for k in want - got)}")
    for k in want:
        if k == "mixer" and path == "model.":
            continue
        if (k in ("attention", "memory", "ffn") and path == "model.") or (
                k == "mesh" and not path):
            continue
        if isinstance(reference[k], ml_collections.ConfigDict):
            if not isinstance(config[k], ml_collections.ConfigDict):
                raise ValueError(f"config key {path + k} must be a section")
            _compare(config[k], reference[k], f"{path}{k}.")


def validate_config(config: ml_collections.ConfigDict) -> None:
    """ValueError naming the first unknown / missing key or bad value."""
    if "data" not in config or "task" not in config.data:
        raise ValueError("config needs data.task")
    _compare(config, base_config(config.data.task))
    if "kind" not in config.model.attention:
        raise ValueError("model.attention needs a 'kind'")
    if "kind" not in config.model.mixer:
        raise ValueError("model.mixer needs a 'kind' (\"none\" for attention)")
    if "kind" not in config.model.ffn:
        raise ValueError("model.ffn needs a 'kind'")
    if config.optim.schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule must be one of {SCHEDULES}, got "
                         f"{config.optim.schedule!r}")
    _compress.validate(config)
    if config.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {config.precision!r}")
    _arch_models.check(config.model)
    if config.model.pooling not in POOLINGS:
        raise ValueError(f"model.pooling must be one of {POOLINGS}, got {config.model.pooling!r}")
    if not isinstance(config.mesh, ml_collections.ConfigDict):
        raise ValueError(f"mesh must be a section of axis sizes, got {config.mesh!r}")
    if config.batch_size % config.num_microbatches:
        raise ValueError(f"batch_size={config.batch_size} is not divisible by "
                         f"num_microbatches={config.num_microbatches}")
    for name in ("num_train_steps", "log_every", "eval_every", "checkpoint_every",
                 "keep_checkpoints", "batch_size", "num_microbatches"):
        if config[name] < 1:
            raise ValueError(f"{name} must be >= 1, got {config[name]}")
