"""Aggregating head outputs by routing-by-agreement (Li et al., 2019, "Information Aggregation
for Multi-Head Attention with Routing-by-Agreement"; dynamic routing of Sabour et al., 2017).

Instead of concatenating the heads, each head ``h`` (an input capsule, ``o_h [D]``) votes
for each output capsule ``n`` with ``V_hn = o_h W_hn``; over ``iterations`` rounds the
coupling ``C_hn = softmax_n(B_hn)`` weighs the votes, ``s_n = sum_h C_hn V_hn``,
``v_n = squash(s_n) = |s|^2 / (1 + |s|^2) s / |s|``, and the agreement ``B_hn += V_hn . v_n``
updates the logits. The output is the capsules ``v_n`` concatenated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def init_routing_votes(key, num_heads: int, head_dim: int, num_out: int, out_dim: int,
                       dtype=jnp.float32):
    """``W [H, N, D, Dout]``: the vote transforms."""
    return jax.random.normal(key, (num_heads, num_out, head_dim, out_dim), dtype) * \
        head_dim ** -0.5


def squash(s, axis=-1):
    """``|s|^2 / (1 + |s|^2) * s / |s|`` (zero stays zero)."""
    n2 = jnp.sum(s * s, axis=axis, keepdims=True)
    return s * (n2 / (1.0 + n2)) / jnp.sqrt(n2 + 1e-12)


def routing_aggregation(heads, votes, *, iterations: int = 3):
    """Routes head outputs into output capsules, per position.

    Args:
      heads: ``[L, H, D]``, the heads' outputs. votes: ``W [H, N, D, Dout]``.
      iterations: routing rounds (at least 1).

    Returns:
      ``[L, N * Dout]``.
    """
    heads, votes = jnp.asarray(heads), jnp.asarray(votes)
    if heads.ndim != 3 or votes.ndim != 4 or votes.shape[0] != heads.shape[1] or \
            votes.shape[2] != heads.shape[2]:
        raise ValueError(f"routing_aggregation: heads [L, H, D] and votes [H, N, D, Dout] with "
                         f"the same H and D expected; got heads{heads.shape}, "
                         f"votes{votes.shape}")
    if not (isinstance(iterations, int) and iterations >= 1):
        raise ValueError(f"routing_aggregation: iterations must be a positive int, got "
                         f"{iterations!r}")
    v_hat = jnp.einsum("lhd,hnde->lhne", heads.astype(jnp.float32), votes.astype(jnp.float32))
    logits = jnp.zeros(v_hat.shape[:3], jnp.float32)                 # [L, H, N]
    for i in range(iterations):
        c = jax.nn.softmax(logits, axis=-1)
        out = squash(jnp.einsum("lhn,lhne->lne", c, v_hat))
        if i + 1 < iterations:
            logits = logits + jnp.einsum("lhne,lne->lhn", v_hat, out)
    return out.reshape(out.shape[0], -1).astype(heads.dtype)
