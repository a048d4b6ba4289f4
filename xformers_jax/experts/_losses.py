"""Auxiliary router losses and statistics (float32, over the real tokens).

* Load balancing (Fedus et al., 2021, "Switch Transformers", eq. 4; GShard's ``l_aux``):
  ``E * sum_i f_i * P_i`` per layer, where ``P_i`` is the mean over tokens of the FULL router
  softmax and ``f_i = (1/T) * #{(t, j): experts[t, j] == i}`` counts every top-k hit (before
  capacity dropping). Hence ``sum_i f_i = k`` and at perfect balance (``f_i = k/E``,
  ``P_i = 1/E``) the loss equals ``k`` (1 for Switch, 2 for top-2), its minimum under balanced
  routing. Layers' losses are summed (each layer's from its own softmax; never over logits
  concatenated across layers). Default coefficient 1e-2 (Switch).
* Router z-loss (Zoph et al., 2022, "ST-MoE", eq. 5): ``mean_t logsumexp(logits_t)^2`` in
  float32. Default coefficient 1e-3 (ST-MoE).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOAD_BALANCING_COEF = 1e-2
Z_LOSS_COEF = 1e-3


def _mean(v, mask):
    if mask is None:
        return v.mean(0)
    m = mask.astype(v.dtype).reshape(mask.shape + (1,) * (v.ndim - 1))
    return (v * m).sum(0) / jnp.maximum(m.sum(), 1.0)


def load_balancing_loss(probs, experts, *, mask=None):
    """``probs float[T, E]``, ``experts int[T, k]`` -> scalar (``k`` at perfect balance)."""
    if probs.ndim != 2 or experts.ndim != 2 or probs.shape[0] != experts.shape[0]:
        raise ValueError(f"load_balancing_loss: probs [T, E] and experts [T, k] must share T, "
                         f"got {probs.shape} and {experts.shape}")
    e = probs.shape[1]
    hits = jax.nn.one_hot(experts, e, dtype=jnp.float32).sum(1)  # [T, E]
    f = _mean(hits, mask)
    p = _mean(probs.astype(jnp.float32), mask)
    return e * jnp.sum(f * p)


def router_z_loss(logits, *, mask=None):
    """``mean_t logsumexp(logits_t)^2`` over real tokens, float32. ``logits [T, E]``."""
    z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    return _mean(z ** 2, mask)


def expert_load(experts, num_experts: int, *, mask=None, kept=None):
    """Fraction of the (token, slot) assignments that go to each expert: ``float32[E]`` summing
    to 1 (``kept [T, k]`` restricts to the assignments that survived capacity)."""
    hits = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32)  # [T, k, E]
    if kept is not None:
        hits = hits * kept[..., None]
    if mask is not None:
        hits = hits * mask[:, None, None]
    total = hits.sum((0, 1))
    return total / jnp.maximum(total.sum(), 1.0)
