"""The trainer's switches for lighter models (``xformers_jax.compress``) and ELECTRA's task.

* ``quantize``: ``"none"``, ``"int8"`` / ``"int4"`` (post-training: after training the best
  model is quantized, activations calibrated on ``calibration.num_batches`` training batches
  by ``calibration.method`` ``"max"``, ``"percentile"`` or ``"dynamic"`` (per token at run
  time), evaluated on the test split and saved to ``<workdir>/quantized``) or ``"qat"``
  (trained with fake quantization, then quantized to int8 as above).
* ``prune``: ``sparsity > 0`` prunes the matmul weights by magnitude (``scope`` "layer" or
  "global") on Zhu & Gupta's schedule from ``begin_step`` to ``end_step`` (0: 3/4 of the
  run) every ``frequency`` steps; the masks are in the optimizer state (checkpointed, so pruned
  weights stay zero across a resume). ``heads > 0``: after training, that fraction of heads is
  pruned by Michel et al.'s importance and the test split evaluated again.
* ``distill``: ``teacher`` (a trainer workdir or a checkpoint's ``state`` directory) is
  restored with orbax into the model of this config (``num_layers`` etc. override the
  teacher's sizes when non-zero) and frozen; the loss is ``(1 - alpha) * CE + alpha * KD(T)``
  (Hinton et al.) plus ``cosine`` times DistilBERT's cosine loss on the last hidden states.
  ``init="every_other"`` initialises the student from every other teacher layer (DistilBERT).
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
from .. import nn, parallel
from ._tasks import TaskSpec, _make_lm, _spec, build_model, register_task, spec_of

QUANTIZE = ("none", "int8", "int4", "qat")
CALIBRATION = ("max", "percentile", "dynamic")
DISTILL_INIT = ("none", "every_other")


def add_defaults(c: ml_collections.ConfigDict) -> None:
    """The compression keys of ``base_config`` (all off by default)."""
    c.quantize = "none"
    c.calibration = ml_collections.ConfigDict(dict(method="max", percentile=99.99,
                                                   num_batches=4))
    c.prune = ml_collections.ConfigDict(dict(sparsity=0.0, scope="layer", begin_step=0,
                                             end_step=0, frequency=100, heads=0.0))
    c.distill = ml_collections.ConfigDict(dict(
        teacher="", temperature=2.0, alpha=0.5, cosine=0.0, init="none",
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
    d = config.distill
    if d.init not in DISTILL_INIT:
        raise ValueError(f"distill.init must be one of {DISTILL_INIT}, got {d.init!r}")
    if d.init != "none" and not d.teacher:
        raise ValueError("distill.init needs distill.teacher")
    if not 0 <= d.alpha <= 1 or d.temperature <= 0:
        raise ValueError(f"distill.alpha must be in [0, 1] and temperature > 0, got "
                         f"{d.alpha}, {d.temperature}")


# -- before training ----------------------------------------------------------------------------

def _state_dir(path: str) -> str:
    """A checkpoint's ``state`` directory: a workdir's best (else latest) step, or ``path``."""
    for sub in ("best", "checkpoints"):
        root = os.path.join(path, sub)
        if os.path.isdir(root):
            steps = sorted(int(s) for s in os.listdir(root) if s.isdigit())
            if steps:
                return os.path.join(root, str(steps[-1]), "state")
    return path


def load_teacher(config, task, key):
    """The frozen teacher: this config's model with ``distill``'s size overrides, restored
    by path from ``distill.teacher``."""
    d = config.distill
    m = ml_collections.ConfigDict(config.model.to_dict())
    for name in ("num_layers", "dim", "num_heads", "hidden"):
        if d[name]:
            m[name] = d[name]
    like = eqx.filter_eval_shape(build_model, m, task, key)
    return parallel.restore_checkpoint(_state_dir(d.teacher), like, prefix="model")


def prepare_model(config, model, teacher):
    """The model to train: initialised from the teacher (DistilBERT) and/or fake-quantized."""
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
    return model


def wrap_optimizer(config, optimizer):
    p = config.prune
    if p.sparsity <= 0:
        return optimizer
    end = p.end_step or max(p.begin_step + 1, (3 * config.num_train_steps) // 4)
    schedule = functools.partial(C.gradual_sparsity, final=p.sparsity, begin=p.begin_step,
                                 end=end, frequency=p.frequency)
    return C.prune_transform(optimizer, schedule=schedule, scope=p.scope)


def _logits(model, batch, task, key):
    out = spec_of(task).logits(model, batch, task, key)
    return (out[0] if isinstance(out, tuple) else out).astype(jnp.float32)


def distill_loss_fn(config, task, teacher):
    """``(1 - alpha) * CE + alpha * T^2 KL`` (+ ``cosine`` * DistilBERT's hidden loss)."""
    d = config.distill
    teacher = jax.lax.stop_gradient(teacher)

    def loss_fn(model, batch, key):
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
    """Post-training compression results: per-layer sparsity, head pruning, int8/int4."""
    out = {}
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


# -- ELECTRA pre-training on byte-level text ----------------------------------------------------

def _electra(m, task, key):
    # The paper's generator: a quarter of the discriminator's width, heads and FFN.
    return nn.Electra(task.vocab_size, m.dim, m.num_layers, m.num_heads, m.hidden,
                      max_len=task.seq_len, block=dict(spec=_spec(m)), key=key)


def _electra_loss(model, batch, task, key):
    x = batch["inputs"]
    if key is None:  # evaluation: a fixed masking, so every evaluation sees the same one
        key = jax.random.PRNGKey(0)
    mask_key, dropout_key = jax.random.split(key)
    return model.loss(x, mask_key, mask=x != 0, dropout_key=None)


def _electra_logits(model, batch, task, key):
    return model.discriminator_logits(batch["inputs"], mask=batch["inputs"] != 0, key=key)


register_task(TaskSpec(
    "electra", dict(source="stdlib", data_dir="", seq_len=128, num_eval=256, num_test=512),
    _make_lm, _electra, _electra_logits, classification=False, loss=_electra_loss))
