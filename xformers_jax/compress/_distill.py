"""Knowledge distillation losses and the hidden states / attention maps they compare.

* Logit distillation (Hinton et al., 2015, "Distilling the Knowledge in a Neural Network"):
  ``T^2 * KL(softmax(t / T) || softmax(s / T))``, mixed with the task loss.
* DistilBERT (Sanh et al., 2019, "DistilBERT, a distilled version of BERT"): the student is
  initialised from every other teacher layer (:func:`distilbert_init`) and a cosine loss
  ``1 - cos(h_s, h_t)`` aligns the last hidden states.
* TinyBERT (Jiao et al., 2020, "TinyBERT: Distilling BERT for Natural Language
  Understanding"): mean squared error between the student's and the teacher's (unnormalised)
  attention scores of mapped layers, and between the student's hidden states projected by a
  learned matrix ``W_h`` (different widths) and the teacher's; student layer ``m`` learns from
  teacher layer ``m * N_t / N_s`` (layer 0: the embeddings).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from ._prune import drop_layers


def _masked_mean(x, mask):
    if mask is None:
        return jnp.mean(x)
    m = jnp.broadcast_to(mask, x.shape).astype(x.dtype)
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1)


def kd_loss(student_logits, teacher_logits, temperature: float = 2.0, mask=None):
    """``T^2 * KL(softmax(teacher / T) || softmax(student / T))`` over the last axis, averaged
    over the leading axes (over ``mask``'s True positions when given). The teacher is a
    constant (no gradient)."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"kd_loss: student logits {student_logits.shape} and teacher logits "
                         f"{teacher_logits.shape} differ")
    t = float(temperature)
    if t <= 0:
        raise ValueError(f"kd_loss: temperature must be positive, got {temperature}")
    log_p = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits).astype(jnp.float32) / t)
    log_q = jax.nn.log_softmax(student_logits.astype(jnp.float32) / t)
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    return t * t * _masked_mean(kl, mask)


def cosine_hidden_loss(student_hidden, teacher_hidden, mask=None):
    """``mean(1 - cos(h_s, h_t))`` over positions (``[..., dim]``; real positions of ``mask``)."""
    if student_hidden.shape != teacher_hidden.shape:
        raise ValueError(f"cosine_hidden_loss: hidden states {student_hidden.shape} and "
                         f"{teacher_hidden.shape} differ (use a projection for other widths)")
    s = student_hidden.astype(jnp.float32)
    t = jax.lax.stop_gradient(teacher_hidden).astype(jnp.float32)
    cos = jnp.sum(s * t, -1) / jnp.maximum(
        jnp.linalg.norm(s, axis=-1) * jnp.linalg.norm(t, axis=-1), 1e-8)
    return _masked_mean(1.0 - cos, mask)


def hidden_mse_loss(student_hidden, teacher_hidden, proj=None, mask=None):
    """TinyBERT's ``MSE(h_s W_h, h_t)`` (``proj``: ``[d_s, d_t]``, None when widths match),
    averaged over real positions and features."""
    s = student_hidden.astype(jnp.float32)
    if proj is not None:
        s = s @ proj.astype(jnp.float32)
    t = jax.lax.stop_gradient(teacher_hidden).astype(jnp.float32)
    if s.shape != t.shape:
        raise ValueError(f"hidden_mse_loss: projected student {s.shape} and teacher {t.shape} "
                         "differ")
    err = jnp.mean((s - t) ** 2, axis=-1)
    return _masked_mean(err, mask)


def attention_map_loss(student_scores, teacher_scores, mask=None):
    """TinyBERT's MSE between attention score maps ``[B, H, Lq, Lk]`` over real query and key
    positions (``mask``: ``bool[B, L]``)."""
    if student_scores.shape != teacher_scores.shape:
        raise ValueError(f"attention_map_loss: score maps {student_scores.shape} and "
                         f"{teacher_scores.shape} differ (TinyBERT needs equal head counts)")
    err = (student_scores.astype(jnp.float32)
           - jax.lax.stop_gradient(teacher_scores).astype(jnp.float32)) ** 2
    pair = None if mask is None else (mask[:, None, :, None] & mask[:, None, None, :])
    return _masked_mean(err, pair)


def _trunk(model):
    """The embedder + layer stack (+ final norm) of an ``nn`` model, and whether causal."""
    inner = getattr(model, "encoder", model)
    if not (hasattr(inner, "embed") and hasattr(inner, "layers")):
        raise ValueError(f"{type(model).__name__} has no embedder and layer stack")
    return inner


def hidden_states(model, inputs, *, mask=None, scores: bool = False):
    """Every layer's output of an ``nn`` encoder / classifier / causal LM (unrolled).

    Returns ``(hiddens, maps, mask)``: ``hiddens`` a list of ``[B, L, dim]``, the embedding output
    first then each layer's output (the last before the final norm); ``maps`` (when ``scores``)
    each layer's unnormalised dense attention scores ``q k^T / sqrt(d)`` ``[B, H, L, L]``, the
    scores the layer's attention kind computes or approximates (input position schemes only);
    ``mask`` the real positions ``bool[B, L]`` (with the CLS position when the model has one)
    or None.
    """
    trunk = _trunk(model)
    x, mask = trunk.embed(inputs, mask=mask)
    dynamic, static = trunk.layers.per_layer()
    hiddens, maps = [x], []
    for i in range(trunk.layers.num_layers):
        block = eqx.combine(jax.tree.map(lambda a: a[i], dynamic), static)
        if scores:
            attn = block.attn
            if attn.position is not None:
                raise ValueError("hidden_states: score maps need input position schemes; this "
                                 f"layer's attention has {type(attn.position).__name__}")
            h = block.norms[0](x) if block.placement == "pre" else x
            q, k, _ = attn.project(h, None)
            if attn.num_kv_heads != attn.num_heads:
                k = jnp.repeat(k, attn.num_heads // attn.num_kv_heads, axis=2)
            maps.append(jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(attn.head_dim))
        x = block(x, kv_mask=mask)
        hiddens.append(x)
    return hiddens, maps, mask


def layer_map(student_layers: int, teacher_layers: int) -> list[int]:
    """TinyBERT's uniform mapping: student layer ``m`` (1..N_s) to teacher layer
    ``m * N_t / N_s``; index 0 (the embeddings) to 0."""
    if teacher_layers % student_layers:
        raise ValueError(f"layer_map: {teacher_layers} teacher layers are not a multiple of "
                         f"{student_layers} student layers")
    step = teacher_layers // student_layers
    return [m * step for m in range(student_layers + 1)]


class TinyBertProjections(eqx.Module):
    """The learned ``W_h`` ``[d_s, d_t]`` of every student hidden state (embeddings + layers)."""

    w: jax.Array

    def __init__(self, student_dim: int, teacher_dim: int, student_layers: int, *, key):
        self.w = jax.random.normal(key, (student_layers + 1, student_dim, teacher_dim)) \
            / math.sqrt(student_dim)


def tinybert_loss(student, teacher, projections: TinyBertProjections, inputs, *, mask=None,
                  attention_weight: float = 1.0, hidden_weight: float = 1.0):
    """TinyBERT's intermediate-layer loss: attention-score MSE over mapped layers plus
    projected hidden-state MSE over the embeddings and mapped layers. Returns
    ``(loss, {"attention", "hidden"})``."""
    hs, ms, real = hidden_states(student, inputs, mask=mask, scores=attention_weight > 0)
    ht, mt, _ = hidden_states(teacher, inputs, mask=mask, scores=attention_weight > 0)
    mapping = layer_map(len(hs) - 1, len(ht) - 1)
    hid = sum(hidden_mse_loss(hs[m], ht[t], projections.w[m], real)
              for m, t in enumerate(mapping)) / len(mapping)
    att = jnp.zeros(())
    if attention_weight > 0:
        att = sum(attention_map_loss(ms[m - 1], mt[t - 1], real)
                  for m, t in zip(range(1, len(hs)), mapping[1:])) / (len(hs) - 1)
    return attention_weight * att + hidden_weight * hid, {"attention": att, "hidden": hid}


def distilbert_init(teacher, every: int = 2):
    """A student from the teacher's layers ``0, every, 2 * every, ...`` (DistilBERT: every
    other layer), keeping the teacher's embeddings, final norm and head."""
    trunk = _trunk(teacher)
    return drop_layers(teacher, range(0, trunk.layers.num_layers, every))
