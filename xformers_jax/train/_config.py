"""The trainer's config schema: every key is consumed, an unknown or missing key is an error.

``base_config(task, model=None)`` returns the full, defaulted ``ml_collections.ConfigDict`` for
a task and a model kind (the task's own by default); experiment configs
(``xformers_jax_experiments/configs/**.py``) change its values and lock it. The trainer calls
``validate_config`` before anything else, so a misspelt key (the original LRA code ignored
unknown settings silently) stops the run instead of training the wrong thing.

``model`` is the section of the model kind ``model.kind`` names (``xformers_jax.models``): its
keys are the kind's declared ones; its slot sections (``attention``, ``mixer``, ``ffn``,
``memory``) are open: ``kind`` plus that kind's hyperparameters, which the registries check
when the model is built. ``loss`` holds the weight of each named term of the model's loss
(``cross_entropy``, a mixture of experts' ``load_balancing`` and ``router_z``, ACT's
``ponder``, ...): the kind's defaults, and no name the kind does not return.
"""

from __future__ import annotations

import difflib

import ml_collections

from .. import models, nn
from ..kinds import SLOTS
from . import _compress
from ._guard import check_config
from ._optim import SCHEDULES
from ._tasks import get_task

PRECISIONS = ("float32", "bfloat16", "float16")


def model_config(kind: str, **overrides) -> ml_collections.ConfigDict:
    """The ``model`` section of kind ``kind`` with its defaults, updated by ``overrides``
    (unknown keys raise)."""
    section = ml_collections.ConfigDict(models.model_defaults(kind))
    unknown = sorted(set(overrides) - set(section))
    if unknown:
        raise ValueError(f"model kind {kind!r} has no keys {unknown} (its keys: "
                         f"{sorted(section)})")
    section.update(overrides)
    return section


def set_model_kind(config: ml_collections.ConfigDict, kind: str, **overrides) -> None:
    """Makes ``config`` (unlocked) train the model kind ``kind``: the model section's keys the
    new kind shares keep their values, its other keys take their defaults, ``overrides`` are
    applied last, and the loss weights become the kind's defaults (e.g. an LRA config turned
    into the same-size early-exit model: ``set_model_kind(c, "early_exit")``)."""
    shared = {k: v for k, v in config.model.to_dict().items()
              if k != "kind" and k in models.get_model(kind).defaults}
    config.model = model_config(kind, **{**shared, **overrides})
    config.loss = ml_collections.ConfigDict(models.get_model(kind).weights())


def base_config(task: str, model: str | None = None) -> ml_collections.ConfigDict:
    """Every key the trainer reads, with defaults, for ``task`` (a name in ``TASKS``, whose
    spec gives the data keys) trained by the model kind ``model`` (default: the task's)."""
    spec = get_task(task)
    kind = models.get_model(model or spec.model)
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.data = ml_collections.ConfigDict(dict(task=task, **spec.data))
    c.model = model_config(kind.name)
    # The weight of each named term of the loss (the model kind's defaults).
    c.loss = ml_collections.ConfigDict(kind.weights())
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
    # A step with a non-finite loss, gradient or update: "stop" the run (naming the step) or
    # "skip" it (counted); more skipped steps in a row than this stop the run (_guard.py).
    c.on_nonfinite = "stop"
    c.max_consecutive_skips = 25
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
    # Stop after the first evaluation whose validation accuracy reaches this (Zoology's
    # early stop at 0.99); None: train every step.
    c.stop_at_accuracy = ml_collections.config_dict.placeholder(float)
    c.log_every = 50
    c.eval_every = 1000
    c.checkpoint_every = 1000
    c.keep_checkpoints = 3
    c.tensorboard = True
    c.progress_bar = True
    c.plot = True  # xformers_jax_experiments/train.py draws workdir/curves.png at the end (matplotlib)
    _compress.add_defaults(c)  # quantize, calibration, prune, distill
    return c


def _did_you_mean(name, known) -> str:
    close = difflib.get_close_matches(name, [str(k) for k in known], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _compare(config, reference, path="", open_sections=()):
    got, want = set(config.keys()), set(reference.keys())
    if got - want:
        name = sorted(got - want)[0]
        raise ValueError(f"unknown config keys: {sorted(path + k for k in got - want)}"
                         f"{_did_you_mean(name, want)}")
    if want - got:
        raise ValueError(f"missing config keys: {sorted(path + k for k in want - got)}")
    for k in want:
        if path + k in open_sections:
            if not isinstance(config[k], ml_collections.ConfigDict):
                raise ValueError(f"config key {path + k} must be a section")
            continue
        if isinstance(reference[k], ml_collections.ConfigDict):
            if not isinstance(config[k], ml_collections.ConfigDict):
                raise ValueError(f"config key {path + k} must be a section")
            _compare(config[k], reference[k], f"{path}{k}.", open_sections)


def _check_slot(name: str, section) -> None:
    """A slot section's hyperparameters against its kind's registered ones (with "did you
    mean"), so that a misspelt one set on the command line stops the run before anything is
    built. Sections of other registries (``memory``) and kinds the slot's registry does not
    hold (``none``) are checked when the model is built."""
    if name not in SLOTS or section.kind not in nn.registered_kinds(name):
        return
    try:
        nn.get_kind(name, section.kind).check_names(
            {k: v for k, v in section.items() if k != "kind"})
    except ValueError as e:
        raise ValueError(f"model.{name}: {e}") from None


def validate_config(config: ml_collections.ConfigDict) -> None:
    """ValueError naming the first unknown / missing key or bad value."""
    if "data" not in config or "task" not in config.data:
        raise ValueError("config needs data.task")
    if "model" not in config or "kind" not in config.model:
        raise ValueError("config needs model.kind (a model kind: "
                         f"{', '.join(models.registered_models())})")
    kind = models.get_model(config.model.kind)
    reference = base_config(config.data.task, kind.name)
    # The model's slot sections (kind plus hyperparameters), the mesh and the loss weights
    # are open: their own registries check them.
    slots = [k for k, v in kind.defaults.items() if isinstance(v, dict)]
    _compare(config, reference, open_sections=("mesh", "loss", *(f"model.{k}" for k in slots)))
    for name in slots:
        if "kind" not in config.model[name]:
            raise ValueError(f"model.{name} needs a 'kind'")
        _check_slot(name, config.model[name])
    kind.weights(dict(config.loss))  # names only terms the model returns
    task_type = get_task(config.data.task).type
    if task_type not in kind.serves:
        raise ValueError(f"model.kind={kind.name!r} trains {list(kind.serves)} tasks, not "
                         f"{task_type!r} ones (data.task={config.data.task!r})")
    if config.optim.schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule must be one of {SCHEDULES}, got "
                         f"{config.optim.schedule!r}")
    _compress.validate(config)
    check_config(config)  # optimizer, loss-scale and guard ranges
    if config.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {config.precision!r}")
    if not isinstance(config.mesh, ml_collections.ConfigDict):
        raise ValueError(f"mesh must be a section of axis sizes, got {config.mesh!r}")
    if config.batch_size % config.num_microbatches:
        raise ValueError(f"batch_size={config.batch_size} is not divisible by "
                         f"num_microbatches={config.num_microbatches}")
    for name in ("num_train_steps", "log_every", "eval_every", "checkpoint_every",
                 "keep_checkpoints", "batch_size", "num_microbatches"):
        if config[name] < 1:
            raise ValueError(f"{name} must be >= 1, got {config[name]}")
