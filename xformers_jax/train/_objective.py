"""The loss and the evaluation sums of any model on any task, knowing no model family.

A model is called on a batch with ``return_aux=True`` (:func:`forward`: the inputs its task
type gives, ``train._tasks.model_inputs``) and returns ``(outputs, aux)``. The task scores the
outputs (:func:`task_terms`: the mean cross-entropy ``cross_entropy`` and ``accuracy`` of
classification and language modelling; nothing for a self-supervised task); the model's kind
(``models.ModelKind.terms``) turns ``aux`` into named scalar terms. The loss is the sum of
``weight[name] * term[name]`` over the weights in effect (the kind's defaults updated by the
config's ``loss`` section) and every term is a logged metric.

Packed rows (``data.pack=True``: several documents per row, ``batch["segment_ids"]``, 0 at
the padding that ends a row) are scored over their real tokens only: ``cross_entropy`` and
``accuracy`` are the means over every real token of the batch (each token weighs the same,
whichever document or row it is in, so a long document counts for its length), the value the
same documents unpacked give as the mean over their tokens; evaluation sums them and counts
the real tokens. Tasks that score chosen positions only (``batch["scored"]``, the synthetic
recall and copying tasks) are scored the same way over those positions. When such a task scores
the same number of positions in every example (``Task.num_scored``) and the model kind takes
``logits_at`` (``models.ModelKind.logits_at``), the model computes its output layer at those
positions only and the loss and accuracy are taken there (:func:`scored_view`): the same
values, without the output layer and softmax over the vocabulary at every position (MQAR at
L = 64 scores 4 positions of 64 over a vocabulary of 8192).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from .. import models, nn
from ._guard import INVALID_DATA, count_invalid
from ._tasks import Task, model_inputs, spec_of


def scored_view(task: Task, model_kind, batch):
    """``(logits_at, batch)``: where a task scores ``task.num_scored`` positions of every row
    (``batch["scored"]``) and ``model_kind`` takes ``logits_at``, the positions ``int[B, K]``
    (ascending) and the batch with ``targets`` and ``scored`` gathered there (``[B, K]``);
    else ``(None, batch)`` (the model's logits at every position, scored through the mask).
    Rows that mark fewer than ``K`` positions pad with position 0, left unscored by the
    gathered ``scored``; a row marking more than ``K`` would lose the later ones, so a task
    sets ``num_scored`` only when its data marks exactly that many in every row."""
    k = getattr(task, "num_scored", 0)
    if (not k or not getattr(model_kind, "logits_at", False) or "scored" not in batch
            or "carry" in batch or "segment_ids" in batch):
        return None, batch
    scored = batch["scored"]
    at = jax.vmap(lambda s: jnp.nonzero(s, size=k, fill_value=0)[0])(scored)
    gather = lambda x: jnp.take_along_axis(x, at, axis=1)  # noqa: E731
    return at, dict(batch, targets=gather(batch["targets"]), scored=gather(scored))


def forward(model, batch, task: Task, key, policy: nn.Policy | None = None, *,
            logits_at=None):
    """``(outputs, aux)`` of ``model`` on ``batch``: float32 logits (``(logits, new_carry)``
    when the batch carries a state) and the model's auxiliary outputs. ``policy`` runs the
    model in its compute dtype; ``logits_at`` (:func:`scored_view`) asks for the logits at
    those positions only."""
    args, kwargs = model_inputs(task, batch)
    if logits_at is not None:
        kwargs = dict(kwargs, logits_at=logits_at)

    def run(m):
        return m(*args, key=key, return_aux=True, **kwargs)

    out, aux = run(model) if policy is None else policy(run, model)
    if "carry" in batch:
        return (out[0].astype(jnp.float32), out[1]), aux
    return out.astype(jnp.float32), aux


def _split(out, batch):
    return out if "carry" in batch else (out, None)


def _real(batch):
    """The scored positions: those a task marks (``batch["scored"]``: the answers of the
    synthetic recall and copying tasks) among the real tokens of packed rows (segment id >
    0), else None (every position)."""
    seg, scored = batch.get("segment_ids"), batch.get("scored")
    real = None if seg is None else seg > 0
    if scored is not None:
        real = scored if real is None else real & scored
    return real


def _sums(logits, labels, real):
    """``(cross-entropy sum, correct sum, count)`` over the positions ``real`` marks (all when
    None)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = logits.argmax(-1) == labels
    if real is None:
        return ce.sum(), correct.sum(), jnp.asarray(labels.size)
    return (jnp.where(real, ce, 0.0).sum(), (correct & real).sum(), real.sum())


def task_terms(task: Task, logits, batch) -> dict:
    """The task's own terms of ``logits``: ``cross_entropy`` (the mean over examples, or
    over tokens for language modelling: over the real tokens of packed rows) and
    ``accuracy``; ``{}`` for a self-supervised task (its loss is the model's terms)."""
    if spec_of(task).type == "self_supervised":
        return {}
    labels, real = batch["targets"], _real(batch)
    if real is None:
        return {models.TASK_TERM: optax.softmax_cross_entropy_with_integer_labels(
                    logits, labels).mean(),
                "accuracy": (logits.argmax(-1) == labels).mean()}
    ce, correct, count = _sums(logits, labels, real)
    count = jnp.maximum(count, 1)
    return {models.TASK_TERM: ce / count, "accuracy": correct / count}


def _invalid(task: Task, batch):
    supervised = spec_of(task).type != "self_supervised"
    return count_invalid(batch, vocab_size=task.vocab_size,
                         num_classes=task.num_classes if supervised else None)


def make_loss_fn(task: Task, policy: nn.Policy | None = None, weights=None, *,
                 kind: str | None = None):
    """``loss_fn(model, batch, key) -> (loss, metrics)`` for a model of kind ``kind`` (default:
    the task's model kind) on ``task``: ``sum(weight[name] * term[name])`` over the task's
    terms and the model's (module docstring), with ``weights`` (a config's ``loss``
    section) over the kind's defaults; the metrics are every term (``accuracy`` among them),
    and the new carried state as ``carry`` when the batch carries one. ``policy``
    (``nn.Policy``) runs the model in its compute dtype; the loss is float32."""
    model_kind = models.get_model(kind or spec_of(task).model)
    w = model_kind.weights(dict(weights or {}))

    def loss_fn(model, batch, key):
        at, view = scored_view(task, model_kind, batch)
        out, aux = forward(model, batch, task, key, policy, logits_at=at)
        logits, carry = _split(out, batch)
        terms = task_terms(task, logits, view)
        terms.update(model_kind.terms(aux, view.get("targets")))
        loss = sum(w[name] * value for name, value in terms.items() if w.get(name))
        metrics = dict(terms)
        # Out-of-range ids would be clamped (embeddings) or wrapped (labels) silently: the
        # step refuses a batch holding any (_guard.py).
        metrics[INVALID_DATA] = _invalid(task, batch)
        if carry is not None:
            metrics["carry"] = carry
        return jnp.asarray(loss, jnp.float32), metrics

    return loss_fn


def make_metrics_fn(task: Task, policy: nn.Policy | None = None, *, kind: str | None = None,
                    weights=None):
    """``metrics_fn(model, batch) -> {"loss_sum", "correct", "count", "invalid_data"}`` (and
    ``carry``), sums
    for evaluation (no randomness): the cross-entropy and correct predictions summed over
    examples, or over tokens for language modelling (the real tokens of packed rows); for a self-supervised task the loss
    (:func:`make_loss_fn`'s) and accuracy times the batch's examples."""
    if spec_of(task).type == "self_supervised":
        loss_fn = make_loss_fn(task, policy, weights, kind=kind)

        def self_supervised(model, batch):
            loss, metrics = loss_fn(model, batch, None)
            n = jnp.asarray(batch["inputs"].shape[0])
            return {"loss_sum": loss * n, "correct": metrics["accuracy"] * n, "count": n,
                    INVALID_DATA: metrics[INVALID_DATA]}

        return self_supervised

    model_kind = models.get_model(kind or spec_of(task).model)

    def metrics_fn(model, batch):
        at, view = scored_view(task, model_kind, batch)
        logits, carry = _split(forward(model, batch, task, None, policy, logits_at=at)[0],
                               batch)
        loss_sum, correct, count = _sums(logits, view["targets"], _real(view))
        out = {"loss_sum": loss_sum, "correct": correct, "count": count,
               INVALID_DATA: _invalid(task, batch)}
        return out if carry is None else dict(out, carry=carry)

    return metrics_fn
