"""SparseBERT's differentiable attention mask (DAM): a learned, Gumbel-sigmoid gated mask.

Shi et al., "SparseBERT: Rethinking the Importance Analysis in Self-attention" (ICML 2021);
the equation number is that of Fournier et al. (2021, "A Practical Survey on Faster and
Lighter Transformers", Eq. 15).

``M_ij = sigmoid((a_ij + G1 - G2) / tau)`` with Gumbel noises G1, G2 (Eq 15), and a penalty
``lambda * ||M||_1`` on the loss. Options the paper uses to keep the pattern structured: the
first and last rows and columns always on, and one parameter per diagonal (``a_ij`` depends on
``j - i`` only). The gate multiplies the attention weights before renormalisation, that is,
softmax with the bias ``log M``, so a gate at 0 removes a key and at 1 leaves it untouched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from .._dense import dot_product_attention


def init_dam_logits(length: int, *, tied_diagonals: bool = True, value: float = 3.0):
    """Mask logits, all ``value`` (gates start mostly open): ``f32[2 * length - 1]`` (one per
    diagonal ``j - i``) when ``tied_diagonals``, else ``f32[length, length]``."""
    length = C.check_positive_int("init_dam_logits", "length", length)
    shape = (2 * length - 1,) if tied_diagonals else (length, length)
    return jnp.full(shape, value, jnp.float32)


def dam_mask(logits, length: int, *, temperature: float = 1.0, always_on_ends: bool = True,
             key=None):
    """The gates ``M f32[length, length]`` of Eq 15.

    ``logits`` is ``[2 * length - 1]`` (tied diagonals: entry ``j - i + length - 1``) or
    ``[length, length]``. With ``key`` Gumbel noise is added (training); without it the gates
    are the deterministic ``sigmoid(a / tau)``.
    """
    name = "dam_mask"
    if temperature <= 0:
        raise ValueError(f"{name}: temperature must be positive but got {temperature}")
    logits = jnp.asarray(logits, jnp.float32)
    if logits.shape == (2 * length - 1,):
        i = jnp.arange(length)
        a = logits[i[None, :] - i[:, None] + length - 1]
    elif logits.shape == (length, length):
        a = logits
    else:
        raise ValueError(
            f"{name}: logits must have shape ({2 * length - 1},) (tied diagonals) or "
            f"({length}, {length}) for length {length}, but got {tuple(logits.shape)}"
        )
    if key is not None:
        g1, g2 = jax.random.gumbel(key, (2, length, length), jnp.float32)
        a = a + g1 - g2
    m = jax.nn.sigmoid(a / temperature)
    if always_on_ends:
        edge = jnp.zeros((length,), bool).at[0].set(True).at[-1].set(True)
        m = jnp.where(edge[:, None] | edge[None, :], 1.0, m)
    return m


def dam_penalty(mask):
    """The L1 penalty ``||M||_1`` averaged over entries; multiply by lambda."""
    return jnp.mean(jnp.abs(mask))


def dam_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    logits,
    *,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    temperature: float = 1.0,
    always_on_ends: bool = True,
    key=None,
    return_mask: bool = False,
):
    """Self-attention gated by a learned differentiable mask, for one sequence and one head.

    Weights are ``M_ij exp(s_ij)`` renormalised, ``M = dam_mask(logits, L, ...)``. Dense,
    O(L^2): the learned pattern is unstructured. Self-attention with a fixed length L
    (the mask has one entry per position pair or per diagonal).

    Args:
      q: ``[L, Dk]``. k: ``[L, Dk]``. v: ``[L, Dv]``.
      logits: ``[2L - 1]`` (tied diagonals) or ``[L, L]``, from :func:`init_dam_logits`.
      causal: not supported (raises): the mask is learned over the whole sequence.
      kv_mask: ``bool[L]``, True for real keys.
      scale: score scale, ``1/sqrt(Dk)`` by default.
      temperature: tau of the Gumbel-sigmoid.
      always_on_ends: keep the first and last rows and columns of the mask on.
      key: PRNG key for the Gumbel noise (training); deterministic gates without it.
      return_mask: also return ``M`` (for :func:`dam_penalty`).

    Returns:
      ``[L, Dv]`` in q's dtype, or ``(out, M)``.
    """
    name = "dam_attention"
    if causal:
        C.causal_unsupported(name, "SparseBERT learns its mask over the whole sequence for an "
                             "encoder; it has no autoregressive form")
    x = C.check_qkv(name, q, k, v)
    C.check_same_length(name, x, "the mask is over positions of one sequence, so Lq must equal Lk")
    m = dam_mask(logits, x.lq, temperature=temperature, always_on_ends=always_on_ends, key=key)
    bias = jnp.where(m > 0, jnp.log(jnp.where(m > 0, m, 1.0)), -jnp.inf)
    out = dot_product_attention(q, k, v, kv_mask=kv_mask, bias=bias, scale=scale)
    return (out, m) if return_mask else out
