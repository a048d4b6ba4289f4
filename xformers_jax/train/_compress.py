"""The trainer's switches for lighter models (``xformers_jax.compress``).

* ``quantize``: ``"none"``, ``"int8"`` / ``"int4"`` (post-training: after training the best
  model is quantized, activations calibrated on ``calibration.num_batches`` training batches
  by ``calibration.method`` ``"max"``, ``"percentile"`` or ``"dynamic"`` (per token at run
  time), evaluated on the test split and saved to ``<workdir>/quantized``) or ``"qat"``
  (trained with fake quantization, then quantized to int8 as above). Quantization-aware
  training usually fine-tunes a trained float model for a fraction of its steps (Jacob et al.,
  2018; Krishnamoorthi, 2018): ``init_from`` names that model.
* ``init_from``: a trainer workdir (its best, else latest, step) or a checkpoint's ``state``
  directory whose model, restored with orbax into this config's model, replaces the initial
  weights (fine-tuning: QAT from a float checkpoint). The optimizer starts afresh.
* ``prune``: ``sparsity > 0`` prunes the matmul weights by magnitude (``scope`` "layer" or
  "global") on Zhu & Gupta's schedule from ``begin_step`` to ``end_step`` (0: 3/4 of the
  run) every ``frequency`` steps; the masks are in the optimizer state (checkpointed, so pruned
  weights stay zero across a resume). ``rewind_step >= 0``: a lottery ticket instead (Frankle
  et al., 2020): one-shot magnitude pruning to ``sparsity`` at ``end_step`` (0: half the run),
  the weights rewound to those after ``rewind_step`` updates (kept in the optimizer state)
  under the new masks, and trained on with the masks fixed. ``heads > 0``: after training,
  that fraction of heads is pruned by Michel et al.'s importance and the test split evaluated
  again. ``layerdrop > 0`` trains with LayerDrop (Fan et al., 2020) at that rate; ``layers >
  0`` then keeps that many evenly spaced layers (every other for half) and evaluates the test
  split again. While pruning is still under way (before the final sparsity) no best
  checkpoint is kept, so the model evaluated at the end has the final sparsity.
* ``distill``: ``teacher`` (a trainer workdir or a checkpoint's ``state`` directory) is
  restored with orbax into the model of this config (``num_layers`` etc. override the
  teacher's sizes when non-zero) and frozen; the loss is ``(1 - alpha) * CE + alpha * KD(T)``
  (Hinton et al.) plus ``cosine`` times DistilBERT's cosine loss on the last hidden states.
  ``init="every_other"`` initialises the student from every other teacher layer (DistilBERT).
  ``tinybert_attention`` and ``tinybert_hidden`` add TinyBERT's losses (Jiao et al., 2020) with
  these weights: the MSE between attention score maps of mapped layers (equal head counts)
  and between hidden states (embeddings and mapped layers) after learned projections
  ``[dim, teacher dim]``, trained with the student (:class:`Student`) and dropped after.
"""

from __future__ import annotations

import functools
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from .. import compress as C
from .. import data as D
from .. import models, parallel
from ._objective import forward
from ._tasks import build_model

QUANTIZE = ("none", "int8", "int4", "qat")
CALIBRATION = ("max", "percentile", "dynamic")
DISTILL_INIT = ("none", "every_other")


def add_defaults(c: ml_collections.ConfigDict) -> None:
    """The compression keys of ``base_config`` (all off by default)."""
    c.quantize = "none"
    c.init_from = ""
    c.calibration = ml_collections.ConfigDict(dict(method="max", percentile=99.99,
                                                   num_batches=4))
    c.prune = ml_collections.ConfigDict(dict(sparsity=0.0, scope="layer", begin_step=0,
                                             end_step=0, frequency=100, heads=0.0,
                                             rewind_step=-1, layerdrop=0.0, layers=0))
    c.distill = ml_collections.ConfigDict(dict(
        teacher="", temperature=2.0, alpha=0.5, cosine=0.0, init="none",
        tinybert_attention=0.0, tinybert_hidden=0.0,
        num_layers=0, dim=0, num_heads=0, hidden=0))


def validate(config) -> None:
    if config.quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, got {config.quantize!r}")
    if config.calibration.method not in CALIBRATION:
        raise ValueError(f"calibration.method must be one of {CALIBRATION}, got "
                         f"{config.calibration.method!r}")
    p = config.prune
    if not 0 <= p.sparsity < 1 or not 0 <= p.heads < 1:
        raise ValueError(f"prune.sparsity and prune.heads must be in [0, 1), got "
                         f"{p.sparsity}, {p.heads}")
    if p.scope not in ("layer", "global"):
        raise ValueError(f"prune.scope must be 'layer' or 'global', got {p.scope!r}")
    if p.rewind_step >= 0 and not p.sparsity:
        raise ValueError("prune.rewind_step (a lottery ticket) needs prune.sparsity > 0")
    if p.rewind_step >= _prune_end(config):
        raise ValueError(f"prune.rewind_step={p.rewind_step} must come before the pruning step "
                         f"{_prune_end(config)} (prune.end_step)")
    layers = config.model.get("num_layers", 0)
    if not 0 <= p.layerdrop < 1 or p.layers < 0 or p.layers > layers:
        raise ValueError(f"prune.layerdrop must be in [0, 1) and prune.layers in [0, "
                         f"model.num_layers={layers}], got {p.layerdrop}, {p.layers}")
    d = config.distill
    if d.init not in DISTILL_INIT:
        raise ValueError(f"distill.init must be one of {DISTILL_INIT}, got {d.init!r}")
    if config.init_from and d.init != "none":
        raise ValueError("init_from and distill.init both set the initial weights: use one")
    if d.init != "none" and not d.teacher:
        raise ValueError("distill.init needs distill.teacher")
    if not 0 <= d.alpha <= 1 or d.temperature <= 0:
        raise ValueError(f"distill.alpha must be in [0, 1] and temperature > 0, got "
                         f"{d.alpha}, {d.temperature}")
    if (d.tinybert_attention or d.tinybert_hidden or d.cosine) and not d.teacher:
        raise ValueError("distill.tinybert_* and distill.cosine need distill.teacher")
    if min(d.tinybert_attention, d.tinybert_hidden, d.cosine) < 0:
        raise ValueError("distill.tinybert_attention, tinybert_hidden and cosine must be >= 0")


def _prune_end(config) -> int:
    """The end of the gradual schedule (``end_step``; 0: 3/4 of the run), or the step at which
    a lottery ticket is pruned (``end_step``; 0: half the run)."""
    p = config.prune
    if p.end_step:
        return p.end_step
    if p.rewind_step >= 0:
        return max(p.rewind_step + 1, config.num_train_steps // 2)
    return max(p.begin_step + 1, (3 * config.num_train_steps) // 4)


def best_from_step(config) -> int:
    """The first step whose model has the final sparsity (0 without pruning): the trainer keeps
    best checkpoints only from there, so the model evaluated at the end is the pruned one."""
    p = config.prune
    if p.sparsity <= 0:
        return 0
    end = _prune_end(config)
    if p.rewind_step >= 0:
        return end
    # The gradual schedule holds its value between pruning steps begin + k * frequency.
    return p.begin_step + -(-(end - p.begin_step) // p.frequency) * p.frequency


# -- before training ----------------------------------------------------------------------------

def state_dir(path: str) -> str:
    """The ``state`` directory of a trainer workdir's best (else latest) checkpoint, or
    ``path`` itself (a checkpoint's ``state`` directory): where ``parallel.restore_checkpoint``
    reads a trained model from."""
    for sub in ("best", "checkpoints"):
        root = os.path.join(path, sub)
        if os.path.isdir(root):
            steps = sorted(int(s) for s in os.listdir(root) if s.isdigit())
            if steps:
                return os.path.join(root, str(steps[-1]), "state")
    return path


def restore_model(path: str, model_config, task, key):
    """The model of ``model_config`` restored by path (orbax) from a trainer workdir's best
    (else latest) step, or from a checkpoint's ``state`` directory."""
    like = eqx.filter_eval_shape(build_model, model_config, task, key)
    return parallel.restore_checkpoint(state_dir(path), like, prefix="model")


def load_teacher(config, task, key):
    """The frozen teacher: this config's model with ``distill``'s size overrides, restored
    by path from ``distill.teacher``."""
    d = config.distill
    m = ml_collections.ConfigDict(config.model.to_dict())
    for name in ("num_layers", "dim", "num_heads", "hidden"):
        if d[name]:
            m[name] = d[name]
    return restore_model(d.teacher, m, task, key)


class Student(eqx.Module):
    """A student trained with TinyBERT's losses: the model and the learned projections of its
    hidden states to the teacher's width (``[num_layers + 1, dim, teacher dim]``). Calls go to
    the model, so the trainer evaluates it like the model itself."""

    model: eqx.Module
    projections: C.TinyBertProjections

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def student_of(model):
    """The model itself (without TinyBERT's projections)."""
    return model.model if isinstance(model, Student) else model


def prepare_model(config, model, teacher):
    """The model to train: restored from ``init_from`` or initialised from the teacher
    (DistilBERT), fake-quantized (QAT), with LayerDrop, and with TinyBERT's projections
    (:class:`Student`)."""
    if config.init_from:
        model = parallel.restore_checkpoint(state_dir(config.init_from), model, prefix="model")
    if config.distill.init == "every_other":
        student = C.distilbert_init(teacher)
        if jax.tree.structure(student) != jax.tree.structure(model) or any(
                a.shape != b.shape for a, b in zip(jax.tree.leaves(student),
                                                   jax.tree.leaves(model))):
            raise ValueError("distill.init='every_other': the student config must have half "
                             "the teacher's layers and its sizes")
        model = student
    if config.quantize == "qat":
        model = C.quantize_model(model, "fake")
    if config.prune.layerdrop > 0:
        model = C.with_layerdrop(model, config.prune.layerdrop)
    d = config.distill
    if d.tinybert_attention > 0 or d.tinybert_hidden > 0:
        if not isinstance(model, (models.EncoderClassifier, models.CausalLM)):
            raise ValueError(f"distill.tinybert_*: needs a classifier or causal LM, got "
                             f"{type(model).__name__}")
        proj = C.TinyBertProjections(
            _dim(model), _dim(teacher), _layers(model),
            key=jax.random.fold_in(jax.random.PRNGKey(config.seed), 1))
        model = Student(model, proj)
    return model


def _trunk(model):
    return getattr(model, "encoder", model)


def _dim(model) -> int:
    embed = _trunk(model).embed
    return int((embed.table if embed.table is not None else embed.proj).shape[-1])


def _layers(model) -> int:
    return _trunk(model).layers.num_layers


def _one_shot(step, *, sparsity, at):
    return jnp.where(step >= at, sparsity, 0.0).astype(jnp.float32)


def wrap_optimizer(config, optimizer):
    p = config.prune
    if p.sparsity <= 0:
        return optimizer
    end = _prune_end(config)
    if p.rewind_step >= 0:
        schedule = functools.partial(_one_shot, sparsity=p.sparsity, at=end)
        return C.prune_transform(optimizer, schedule=schedule, scope=p.scope,
                                 rewind_step=p.rewind_step)
    schedule = functools.partial(C.gradual_sparsity, final=p.sparsity, begin=p.begin_step,
                                 end=end, frequency=p.frequency)
    return C.prune_transform(optimizer, schedule=schedule, scope=p.scope)


def _logits(model, batch, task, key):
    return forward(model, batch, task, key)[0]


def distill_loss_fn(config, task, teacher):
    """``(1 - alpha) * CE + alpha * T^2 KL`` (+ ``cosine`` * DistilBERT's hidden loss, +
    TinyBERT's attention-map and projected hidden-state losses)."""
    d = config.distill
    teacher = jax.lax.stop_gradient(teacher)

    def loss_fn(wrapped, batch, key):
        model = student_of(wrapped)
        logits = _logits(model, batch, task, key)
        t_logits = _logits(teacher, batch, task, None)
        labels = batch["targets"]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        kd = C.kd_loss(logits, t_logits, d.temperature)
        loss = (1 - d.alpha) * ce + d.alpha * kd
        metrics = {"accuracy": (logits.argmax(-1) == labels).mean(), "ce": ce, "kd": kd}
        if d.cosine > 0:
            x = batch["inputs"]
            mask = (x != 0) if task.padded else None
            hs, _, real = C.hidden_states(model, x, mask=mask)
            ht, _, _ = C.hidden_states(teacher, x, mask=mask)
            cos = C.cosine_hidden_loss(hs[-1], ht[-1], real)
            loss = loss + d.cosine * cos
            metrics["cosine"] = cos
        if isinstance(wrapped, Student):
            x = batch["inputs"]
            tiny, parts = C.tinybert_loss(
                model, teacher, wrapped.projections, x,
                mask=(x != 0) if task.padded else None,
                attention_weight=d.tinybert_attention, hidden_weight=d.tinybert_hidden)
            loss = loss + tiny
            metrics.update({f"tinybert_{k}": v for k, v in parts.items()})
        return loss, metrics

    return loss_fn


# -- after training -----------------------------------------------------------------------------

def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _train_batches(task, batch_size, n):
    it = D.DataIterator(task.train, batch_size=batch_size, shuffle=False, num_epochs=1,
                        drop_remainder=True)
    out = []
    for batch in it:
        out.append(batch)
        if len(out) == n:
            break
    return out


def finish(config, task, model, run_eval, eval_step, workdir: str) -> dict:
    """Post-training compression results: per-layer sparsity, head pruning, layer pruning,
    int8/int4."""
    out = {}
    model = student_of(model)
    if config.prune.sparsity > 0:
        report = C.sparsity_report(model)
        out["sparsity"] = report.pop("total")
        out["sparsity_per_weight"] = report  # a list per layer for stacked weights
    need_batches = config.prune.heads > 0 or config.quantize != "none"
    batches = (_train_batches(task, config.batch_size, config.calibration.num_batches)
               if need_batches else [])
    if config.prune.heads > 0:
        float_model = C.dequantize_model(model)

        def one_loss(m, batch):
            return optax.softmax_cross_entropy_with_integer_labels(
                _logits(m, batch, task, None), batch["targets"]).mean()

        examples = jax.tree.map(lambda *a: np.concatenate(a), *batches)
        importance = C.head_importance(float_model, one_loss, examples)
        masks, kept = C.head_masks(float_model, importance, config.prune.heads)
        pruned = C.apply_masks(float_model, masks)
        test = run_eval(eval_step, pruned, task.test, config.batch_size)
        out["test_accuracy_heads_pruned"] = test["accuracy"]
        out["heads_kept"] = {k: np.asarray(v).astype(int).tolist() for k, v in kept.items()}
    if config.prune.layers > 0:
        n = _layers(model)
        keep = [i * n // config.prune.layers for i in range(config.prune.layers)]
        pruned = C.drop_layers(C.dequantize_model(model), keep)
        test = run_eval(eval_step, pruned, task.test, config.batch_size)
        out["test_accuracy_layers_pruned"] = test["accuracy"]
        out["layers_kept"] = keep
    if config.quantize != "none":
        mode = "int4" if config.quantize == "int4" else "int8"
        float_model = C.dequantize_model(model)
        scales = None
        if mode == "int8" and config.calibration.method != "dynamic":
            scales = C.calibrate(float_model, batches,
                                 lambda m, b: _logits(m, b, task, None),
                                 method=config.calibration.method,
                                 percentile=config.calibration.percentile)
        q = C.quantize_model(model, mode, act_scales=scales)
        test = run_eval(eval_step, q, task.test, config.batch_size)
        out[f"test_accuracy_{mode}"] = test["accuracy"]
        out[f"test_loss_{mode}"] = test["loss"]
        qdir = os.path.join(os.path.abspath(workdir), "quantized")
        fdir = os.path.join(os.path.abspath(workdir), "float_model")
        if jax.process_index() == 0:
            for d, m in ((qdir, q), (fdir, float_model)):
                if not os.path.exists(d):
                    parallel.save_checkpoint(d, m)
            out[f"checkpoint_bytes_{mode}"] = _dir_bytes(qdir)
            out["checkpoint_bytes_float"] = _dir_bytes(fdir)
        out[f"array_bytes_{mode}"] = C.model_bytes(q)
        out["array_bytes_float"] = C.model_bytes(float_model)
    return out


# -- the wrapper the trainer applies --------------------------------------------------------------

class Compression:
    """Everything the compression switches of a config (``quantize``, ``init_from``,
    ``prune``, ``distill``) change in a run, as one wrapper around it: :meth:`wrap` gives the
    model, optimizer and loss to train (restored or distilled initial weights, fake
    quantization, LayerDrop and TinyBERT's projections; the pruning masks inside the
    optimizer; the distillation loss in place of the task's), :attr:`best_from` the first step
    whose model may be kept as the best (pruning finished) and :meth:`finish` the results of
    compressing the best model after training. With every switch off it changes nothing."""

    def __init__(self, config, task, key):
        self.config, self.task = config, task
        self.teacher = load_teacher(config, task, key) if config.distill.teacher else None
        self.best_from = best_from_step(config)

    def wrap(self, model, optimizer, loss_fn):
        """``(model, optimizer, loss_fn)`` to train in place of the given ones."""
        model = prepare_model(self.config, model, self.teacher)
        optimizer = wrap_optimizer(self.config, optimizer)
        if self.teacher is not None:
            loss_fn = distill_loss_fn(self.config, self.task, self.teacher)
        return model, optimizer, loss_fn

    def finish(self, model, run_eval, eval_step, workdir: str) -> dict:
        """The compression results of the trained ``model`` (see :func:`finish`)."""
        return finish(self.config, self.task, model, run_eval, eval_step, workdir)
