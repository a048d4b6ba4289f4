"""Gaussian locality priors added to the softmax scores, and attention with only a Gaussian.

* Yang et al. (2018), "Modeling Localness for Self-Attention Networks": each query predicts a
  centre ``p_i`` and a window ``D_i`` from itself, ``G_ij = -(j - p_i)^2 / (2 sigma_i^2)`` with
  ``sigma_i = D_i / 2`` is added to the scores (:func:`gaussian_prior_attention`,
  :func:`predict_gaussian_window`).
* Guo et al. (2019), "Gaussian Transformer: a Lightweight Approach for Natural Language
  Inference": the centre is the query's own position and a learned distance penalty
  ``G_ij = -|w (i - j)^2 + b|`` (``w >= 0``, ``b <= 0``) is added
  (:func:`distance_prior_attention`).
* You et al. (2020), "Hard-Coded Gaussian Attention for Neural Machine Translation": no
  queries or keys at all; the weights are a fixed Gaussian over positions centred at
  ``i + offset`` (:func:`hardcoded_gaussian_attention`).

All three run on the tiled kernel (:func:`~xformers_jax.attention.flash_attention`) with the
prior as a callable bias evaluated per tile, so no ``[Lq, Lk]`` array is built.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from .._exact import flash_attention
from .._flex import document_offsets, document_sum


def init_gaussian_window(key, dk: int, dtype=jnp.float32):
    """Parameters of Yang et al.'s centre/window predictor for queries of width ``dk``:
    ``(W_p [Dk, Dk], u_p [Dk], u_d [Dk])``."""
    k1, k2, k3 = jax.random.split(key, 3)
    s = dk ** -0.5
    return (jax.random.normal(k1, (dk, dk), dtype) * s, jax.random.normal(k2, (dk,), dtype) * s,
            jax.random.normal(k3, (dk,), dtype) * s)


def predict_gaussian_window(q, params, length):
    """Yang et al. (2018), eqs. 5-7: ``p_i = I * sigmoid(u_p^T tanh(W_p q_i))``,
    ``D_i = I * sigmoid(u_d^T tanh(W_p q_i))``, ``sigma_i = D_i / 2``.

    Args:
      q: ``[Lq, Dk]``. params: ``(W_p, u_p, u_d)`` from :func:`init_gaussian_window`.
      length: ``I``, the number of keys a query may see: a scalar (every real key; a padded
        sequence passes its real length, so the padding amount moves no centre) or ``[Lq]``,
        one per query (causal attention: the real keys up to the query, so no later token
        moves a centre and a prefix predicts what the longer sequence does).

    Returns:
      ``(center [Lq], sigma [Lq])`` in float32.
    """
    w_p, u_p, u_d = params
    h = jnp.tanh(q.astype(jnp.float32) @ w_p.astype(jnp.float32))
    n = jnp.asarray(length, jnp.float32)
    center = n * jax.nn.sigmoid(h @ u_p.astype(jnp.float32))
    sigma = n * jax.nn.sigmoid(h @ u_d.astype(jnp.float32)) / 2
    return center, sigma


def _real_length(kv_mask, lk, lq, causal):
    """Yang et al.'s ``I`` per query: the real keys, or with ``causal`` the real keys ``j <= i``
    (query ``i`` sees keys up to ``i``, the kernel's causal alignment; ``[Lq]``)."""
    real = jnp.ones((lk,), bool) if kv_mask is None else kv_mask
    if not causal:
        return jnp.sum(real, dtype=jnp.float32)
    seen = jnp.cumsum(real, dtype=jnp.float32)
    return seen[jnp.minimum(jnp.arange(lq), lk - 1)]


def _document_length(kv_mask, segment_ids, causal):
    """:func:`_real_length` within each query's document of packed rows (``[L]``)."""
    real = (jnp.ones(jnp.shape(segment_ids), jnp.float32) if kv_mask is None
            else kv_mask.astype(jnp.float32))
    seen = document_sum(segment_ids, real)
    return seen if causal else seen + document_sum(segment_ids, real, reverse=True) - real


def _with_prior(name, q, k, v, kv_mask, prior, *, causal, scale, block_q, block_k,
                segment_ids=None, scores=True):
    """The three kinds' one path: the contract's checks, then flash with the per-tile bias
    ``prior(x, kv_mask)`` (a function of query and key positions) returns. ``scores=False``
    (hard-coded Gaussian) runs on zero-width queries and keys, so the scores are the prior
    alone."""
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    bias = prior(x, kv_mask)
    qq, kk = (x.q, x.k) if scores else (jnp.zeros((x.lq, 1), x.v.dtype),
                                        jnp.zeros((x.lk, 1), x.v.dtype))
    return flash_attention(qq, kk, x.v, causal=causal, kv_mask=kv_mask, bias=bias,
                           segment_ids=segment_ids, scale=scale if scores else 1.0,
                           block_q=block_q, block_k=block_k)


def gaussian_prior_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    params=None,
    *,
    center=None,
    sigma=None,
    causal=False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    segment_ids=None,
    scale=None,
    key=None,
    block_q=None,
    block_k=None,
) -> Float[Array, "q_seq v_dim"]:
    """Softmax attention with Yang et al.'s (2018) Gaussian prior added to the scores:
    ``softmax(q k^T * scale + G) v``, ``G_ij = -(j - p_i)^2 / (2 sigma_i^2)``.

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``.
      params: the predictor ``(W_p, u_p, u_d)`` (:func:`init_gaussian_window`); the centre and
        window are predicted from each query with ``I`` = the number of real keys it may see
        (with ``causal``, those up to the query: the paper's ``I`` is the sequence length,
        which in a causal model would count the tokens that follow). Or pass
        ``center [Lq]`` and ``sigma [Lq]`` directly (then ``params`` is None).
      causal, kv_mask, scale, key, block_q, block_k: the contract and the tiles.
      segment_ids: packed-sequence ids ``int[L]`` (self-attention): a query sees its own
        document, whose positions start at 0 (the centres are positions in the document, and
        ``I`` counts the document's real keys).

    Returns:
      ``[Lq, Dv]``.
    """
    name = "gaussian_prior_attention"
    if (params is None) == (center is None or sigma is None):
        raise ValueError(f"{name}: give either the predictor params or both center [Lq] and "
                         f"sigma [Lq]; got params={'set' if params is not None else None}, "
                         f"center={None if center is None else jnp.shape(center)}, "
                         f"sigma={None if sigma is None else jnp.shape(sigma)}")

    if isinstance(segment_ids, (tuple, list)):
        raise ValueError(f"{name}: segment_ids must be one int[L] array (the prior's positions "
                         "are those of this self-attention's documents), got a (q, kv) pair")

    def prior(x, kv_mask):
        c, sg = center, sigma
        if params is not None:
            length = (_real_length(kv_mask, x.lk, x.lq, causal) if segment_ids is None
                      else _document_length(kv_mask, segment_ids, causal))
            c, sg = predict_gaussian_window(x.q, params, length)
        c, sg = jnp.asarray(c, jnp.float32), jnp.asarray(sg, jnp.float32)
        if c.shape != (x.lq,) or sg.shape != (x.lq,):
            raise ValueError(f"{name}: center and sigma must have shape (Lq,) = ({x.lq},) but "
                             f"got {c.shape} and {sg.shape}")
        # A floor keeps a vanishing predicted window finite (the prior then keeps only its
        # centre).
        inv = 1.0 / (2.0 * jnp.maximum(sg, 1e-3) ** 2)

        pos = None if segment_ids is None else document_offsets(segment_ids)

        def bias(qp, kp):
            kp = kp if pos is None else pos[kp]
            return -((kp - c[qp[:, 0]][:, None]) ** 2) * inv[qp[:, 0]][:, None]

        return bias

    return _with_prior(name, q, k, v, kv_mask, prior, causal=causal, scale=scale,
                       block_q=block_q, block_k=block_k, segment_ids=segment_ids)


def distance_prior_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    w,
    b,
    *,
    causal=False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    segment_ids=None,
    scale=None,
    key=None,
    block_q=None,
    block_k=None,
) -> Float[Array, "q_seq v_dim"]:
    """Softmax attention with Guo et al.'s (2019) distance penalty:
    ``softmax(q k^T * scale - |w (i - j)^2 + b|) v``.

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``.
      w, b: scalars, ``w >= 0`` (how fast the prior decays) and ``b <= 0`` (lowers the
        query's own position). ``w = b = 0`` is vanilla attention. Modules keep them signed by
        construction (``softplus`` and ``-softplus`` of free parameters).
      causal, kv_mask, scale, key, block_q, block_k: the contract and the tiles.
      segment_ids: packed-sequence ids (the penalty reads ``i - j`` only, so each document
        gets its own).

    Returns:
      ``[Lq, Dv]``.
    """
    name = "distance_prior_attention"
    w, b = jnp.asarray(w, jnp.float32), jnp.asarray(b, jnp.float32)
    if w.shape != () or b.shape != ():
        raise ValueError(f"{name}: w and b must be scalars but got shapes {w.shape}, {b.shape}")

    def bias(qp, kp):
        d = (qp - kp).astype(jnp.float32)
        return -jnp.abs(w * d * d + b)

    return _with_prior(name, q, k, v, kv_mask, lambda x, m: bias, causal=causal, scale=scale,
                       block_q=block_q, block_k=block_k, segment_ids=segment_ids)


def hardcoded_gaussian_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    *,
    offset: float = 0.0,
    std: float = 1.0,
    causal=False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    segment_ids=None,
    scale=None,
    key=None,
    block_q=None,
    block_k=None,
) -> Float[Array, "q_seq v_dim"]:
    """You et al. (2020): ``out_i = sum_j w_ij v_j`` with fixed weights
    ``w_ij ∝ exp(-(j - (i + offset))^2 / (2 std^2))`` over the visible keys (renormalised
    after masking). ``q`` and ``k`` are only checked for shape: nothing is learned here.

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``.
      offset: the centre relative to the query's position (the paper's decoder uses -1, the
        previous word; the encoder 0 and +-1 heads). std: the Gaussian's standard deviation.
      causal, kv_mask, scale, key, block_q, block_k: the contract (``scale`` is unused).
      segment_ids: packed-sequence ids (the weights read ``j - i`` only, renormalised over
        the query's document).

    Returns:
      ``[Lq, Dv]``.
    """
    name = "hardcoded_gaussian_attention"
    if not float(std) > 0:
        raise ValueError(f"{name}: std must be positive but got {std}")
    inv, off = 1.0 / (2.0 * float(std) ** 2), float(offset)

    def bias(qp, kp):
        d = (kp - qp).astype(jnp.float32) - off
        return -d * d * inv

    return _with_prior(name, q, k, v, kv_mask, lambda x, m: bias, causal=causal, scale=scale,
                       block_q=block_q, block_k=block_k, segment_ids=segment_ids, scores=False)
