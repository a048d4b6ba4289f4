"""Disagreement regularisation of attention heads (Li et al., 2018, "Multi-Head Attention with
Disagreement Regularization").

Three disagreement terms (the paper's eqs. 5-7), each ``-(1/H^2) sum_{i,j} sim(head i, head
j)`` over all ordered head pairs (the diagonal included, as in the paper), averaged over the
real positions:

* subspace: ``sim`` is the cosine similarity of the heads' value vectors at a position;
* position: ``sim`` is ``sum_k A^i_{q,k} A^j_{q,k}``, the overlap of the heads' attention
  rows at query ``q``;
* output: ``sim`` is the cosine similarity of the heads' outputs at a position.

Training maximises ``likelihood + lambda * D`` (a loss adds ``-lambda * D``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp


class Disagreement(NamedTuple):
    """The three disagreement terms (scalars, each in ``[-1, 0]`` up to the diagonal's
    contribution): larger means more diverse heads."""

    subspace: jnp.ndarray
    position: jnp.ndarray
    output: jnp.ndarray


def _mean_cosine(x, mask):
    # x [L, H, D] -> mean over positions of (1/H^2) sum_ij cos(x_i, x_j)
    xf = x.astype(jnp.float32)
    u = xf / jnp.maximum(jnp.linalg.norm(xf, axis=-1, keepdims=True), 1e-12)
    per_pos = jnp.einsum("lhd,lgd->l", u, u) / (x.shape[1] ** 2)
    return jnp.sum(per_pos * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def disagreement(values, weights, outputs, *, mask=None) -> Disagreement:
    """The three disagreement terms of one sequence.

    Args:
      values: ``[L, H, Dv]``, the heads' values. weights: ``[H, Lq, Lk]``, the attention
        maps (rows of padded queries are ignored). outputs: ``[Lq, H, Dv]``.
      mask: ``bool[L]`` (self-attention), the real positions; None for all.

    Returns:
      a :class:`Disagreement`.
    """
    values, weights, outputs = (jnp.asarray(a) for a in (values, weights, outputs))
    if values.ndim != 3 or outputs.ndim != 3 or weights.ndim != 3 or \
            weights.shape[0] != values.shape[1] or outputs.shape[1] != values.shape[1]:
        raise ValueError("disagreement: values [L, H, Dv], weights [H, Lq, Lk], outputs "
                         f"[Lq, H, Dv] with one H expected; got values{values.shape}, "
                         f"weights{weights.shape}, outputs{outputs.shape}")
    lq, h = outputs.shape[0], outputs.shape[1]
    m = jnp.ones((lq,), jnp.float32) if mask is None else jnp.asarray(mask, jnp.float32)
    if m.shape != (lq,) or values.shape[0] != lq:
        raise ValueError(f"disagreement: mask must be bool[L] = [{lq}] for self-attention "
                         f"values{values.shape}; got mask{m.shape}")
    wf = weights.astype(jnp.float32)
    overlap = jnp.einsum("hqk,gqk->q", wf, wf) / h ** 2
    position = jnp.sum(overlap * m) / jnp.maximum(jnp.sum(m), 1.0)
    return Disagreement(-_mean_cosine(values, m), -position, -_mean_cosine(outputs, m))
