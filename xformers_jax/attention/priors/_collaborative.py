"""Collaborative multi-head attention (Cordonnier et al., 2020, "Multi-Head Attention:
Collaborate Instead of Concatenate").

The heads share one query and one key projection of width ``Dq`` and each head filters it with
a mixing vector ``m_h``: ``head_h = softmax((q diag(m_h)) k^T * scale) v_h`` (the paper's eq. 6;
the survey's eq. 24). Vanilla multi-head attention with ``H`` heads of width ``Dh`` is the case
``Dq = H Dh`` with ``m_h`` the indicator of head ``h``'s slice
(:func:`collaborative_mixing_from_heads` converts a trained model's layer exactly).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _contract as C
from .._exact import flash_attention


def collaborative_mixing_from_heads(num_heads: int, head_dim: int, dtype=jnp.float32):
    """``m [H, H * Dh]``: the mixing of a vanilla layer whose per-head query and key
    projections are concatenated into the shared ones (head ``h`` keeps its own slice)."""
    C.check_positive_int("collaborative_mixing_from_heads", "num_heads", num_heads)
    C.check_positive_int("collaborative_mixing_from_heads", "head_dim", head_dim)
    return jnp.asarray(np.kron(np.eye(num_heads), np.ones((1, head_dim))), dtype)


def collaborative_attention(q, k, v, mixing, *, causal=False, kv_mask=None, segment_ids=None,
                            scale=None, key=None, block_q=None, block_k=None):
    """Collaborative heads over one sequence.

    Args:
      q: ``[Lq, Dq]`` and k: ``[Lk, Dq]``, the shared projections. v: ``[Lk, H, Dv]``.
      mixing: ``m [H, Dq]``, one mixing vector per head.
      causal, kv_mask (``bool[Lk]``), key: the contract. segment_ids: packed-sequence ids
        (as ``flash_attention``'s). scale: ``1/sqrt(Dq / H)`` by default
        (vanilla's ``1/sqrt(Dh)`` for a converted layer).
      block_q, block_k: tiles (each head runs on the tiled kernel).

    Returns:
      ``[Lq, H, Dv]``.
    """
    name = "collaborative_attention"
    q, k, v, mixing = (jnp.asarray(a) for a in (q, k, v, mixing))
    if q.ndim != 2 or k.ndim != 2 or v.ndim != 3 or mixing.ndim != 2:
        raise ValueError(f"{name}: q [Lq, Dq], k [Lk, Dq], v [Lk, H, Dv], mixing [H, Dq] "
                         f"expected; got q{q.shape}, k{k.shape}, v{v.shape}, "
                         f"mixing{mixing.shape}")
    if mixing.shape != (v.shape[1], q.shape[1]):
        raise ValueError(f"{name}: mixing must be [H, Dq] = [{v.shape[1]}, {q.shape[1]}] (heads "
                         f"of v, width of q); got {mixing.shape}")
    x, kv_mask = C.check_qkv_mask(name, q, k, v[:, 0], kv_mask)
    scale = float((x.dk / v.shape[1]) ** -0.5) if scale is None else scale

    def one(m, vh):
        return flash_attention(x.q * m.astype(x.q.dtype), x.k, vh, causal=causal,
                               kv_mask=kv_mask, segment_ids=segment_ids, scale=scale,
                               block_q=block_q, block_k=block_k)

    return jax.vmap(one, in_axes=(0, 1), out_axes=1)(mixing, v)
