"""Delta rules after Gated DeltaNet, each one head of one sequence on the delta-rule scans of
``attention.linear`` (the per-channel one, ``dplr_*``, and the scalar one, ``gated_delta_*``).

- Kimi Delta Attention (Kimi Team 2025, "Kimi Linear: An Expressive, Efficient Attention
  Architecture", Eq. 1): the gated delta rule with a per-channel (diagonal) decay,
  ``S_t = (I - beta_t k_t k_t^T) diag(alpha_t) S_{t-1} + beta_t k_t v_t^T``, ``o_t = q_t^T S_t``.
  With ``alpha_t`` the same in every channel it is Gated DeltaNet.
- RWKV-7 (Peng et al. 2025, "RWKV-7 "Goose" with Expressive Dynamic State Evolution"): the
  generalised delta rule ``S_t = (diag(w_t) - (a_t * kappa_t) kappa_t^T) S_{t-1} + k_t v_t^T``
  with a vector decay ``w_t``, a normalised removal key ``kappa_t`` and a vector in-context
  learning rate ``a_t``; the output ``o_t = r_t^T S_t + (r_t . (u * k_t)) v_t`` adds the
  paper's per-head bonus ``u`` for the current token.
- DeltaProduct (Siems et al. 2025, "DeltaProduct: Improving State-Tracking in Linear RNNs via
  Householder Products"): ``n_h`` delta steps per token, ``S_{t,i} = (I - beta_{t,i} k_{t,i}
  k_{t,i}^T) S_{t,i-1} + beta_{t,i} k_{t,i} v_{t,i}^T``, the token's transition a product of
  ``n_h`` generalised Householder matrices; the gated form decays once per token
  (``S_{t,0} = a_t S_{t-1}``). The chunked form runs the scalar delta rule over the
  ``L n_h`` sub-steps, reading the query at each token's last one.

``implementation``: ``"chunked"`` (the training form), ``"recurrent"`` (a scan over positions
of the paper's step, the reference) or ``"parallel"`` (the chunked form with one chunk).
``kv_mask`` makes padded positions write nothing and decay nothing. ``segment_ids`` (``int[L]``,
packed documents with contiguous ids) restarts the state from zero at each document's first
token, so each document's outputs and gradients are those of the document alone (in the
chunked forms by masks on each chunk's own matrices, see ``attention.linear``'s delta rules).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..attention.linear import (dplr_chunked, dplr_recurrent, dplr_step, gated_delta_chunked,
                                gated_delta_recurrent, gated_delta_step)
from ._recurrences import _check, _check_2d, _f32

# Chunks of the per-channel delta rules (attention.linear.dplr_chunked: decays applied pairwise
# within sub-chunks of 2, by matrix products across them). fwd+bwd of 4 heads of 64 at
# L=8192 on the shared 2-core machine, one process: chunks of 16 took 0.8-1.1 s, of 32
# 1.0-2.5 s, of 64 2.7-3.7 s, and without sub-chunks (pairwise [c, c, 64] decays) 3.5 s (with
# sub-chunks of 4); interleaved in one process (process CPU time, medians of 5-7 runs, three
# runs), KDA's chunks of 8 in sub-chunks of 2 took 0.92-0.95 of chunks of 16 in sub-chunks of
# 4 (the pairwise and the across-sub-chunk decay factors are 3/4 of the elements per
# position), RWKV-7's 0.92-0.99.
DPLR_CHUNK = 8
# Sub-steps per chunk of DeltaProduct's scalar delta rule over its L n_h sub-steps. fwd+bwd of
# 4 heads of 64 at L=8192, n_h=2, interleaved in one process on the shared 2-core machine
# (process CPU time, medians of 7, three runs, before the once-per-token reads): chunks of 16
# took 0.48-0.55 s, of 32 0.52-0.57 s, of 64 0.63 s, of 8 0.56 s: the [c, c] work and the
# log2 c levels of the chunk inverses grow with c, and at 16 the chunk-by-chunk state
# products do not yet dominate. Reading once per token (query_stride) then took 0.89 of that.
DELTA_PRODUCT_CHUNK = 16
# Positions per group of chunks (attention.linear's chunk_groups: a group's chunks are built at
# once and rebuilt in the backward pass) for these delta rules, rather than the 2048 of the
# linear recurrences: a DPLR chunk position materialises some thousands of floats (decays per
# channel for each sub-chunk, pairwise decays, scores, reads, the scan's saved states), so 2048
# positions of 4 heads are tens of MB, past the 32 MB L3 of the 2-core EPYC. fwd+bwd of 4
# heads of 64 at L=8192 on that (shared, loaded) machine, process CPU time, medians of 6, two
# runs: groups of 256 took 0.78-0.90 of 2048 for KDA, 0.85-0.86 for RWKV-7, 0.92-0.94 for
# DeltaProduct; groups of 128 were no better.
DELTA_GROUP_POSITIONS = 256


def _check_segments(name, segment_ids, length):
    if segment_ids is not None and (segment_ids.shape != (length,)
                                    or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        raise ValueError(f"{name}: segment_ids must be int[{length}] (one document id per "
                         f"position), got {segment_ids.dtype}{list(segment_ids.shape)}")


def _dplr(name, q, k, v, a, b, ld, kv_mask, implementation, chunk_size, segment_ids):
    length = q.shape[0]
    _check_segments(name, segment_ids, length)
    if kv_mask is not None:
        if kv_mask.shape != (length,):
            raise ValueError(f"{name}: kv_mask must be bool[{length}], got shape "
                             f"{kv_mask.shape}")
        m = kv_mask[:, None]
        k, v, b, ld = (jnp.where(m, x, 0) for x in (k, v, b, ld))
        a = None if a is None else jnp.where(m, a, 0)
    if implementation == "recurrent":
        return dplr_recurrent(q, k, v, a, b, ld, segment_ids=segment_ids)
    chunk = length if implementation == "parallel" else chunk_size
    return dplr_chunked(q, k, v, a, b, ld, chunk_size=chunk, segment_ids=segment_ids,
                        group_positions=DELTA_GROUP_POSITIONS)


def _check_gates(name, shapes, **gates):
    for arg, x in gates.items():
        if x.shape != shapes[arg]:
            raise ValueError(f"{name}: {arg} must have shape {shapes[arg]}, got {x.shape}")


def kda(q, k, v, beta, log_alpha, *, kv_mask=None, implementation: str = "chunked",
        chunk_size: int = DPLR_CHUNK, segment_ids=None):
    """Kimi Delta Attention of one head: ``S_t = (I - beta_t k_t k_t^T) diag(alpha_t) S_{t-1}
    + beta_t k_t v_t^T``, ``o_t = q_t^T S_t``.

    Args:
      q, k: ``[L, Dk]`` (the paper L2-normalises them). v: ``[L, Dv]``.
      beta: ``[L]`` write strengths in ``[0, 1]``.
      log_alpha: ``[L, Dk]`` per-channel log-decays ``<= 0``.
      kv_mask, implementation, chunk_size, segment_ids: see the module docstring.

    Returns:
      ``[L, Dv]`` float32.
    """
    name = "kda"
    _check(name, implementation, chunk_size)
    length = _check_2d(name, q=q, k=k, v=v, log_alpha=log_alpha)
    _check_gates(name, {"beta": (length,), "log_alpha": k.shape}, beta=beta, log_alpha=log_alpha)
    q, k, v, beta, ld = _f32(q, k, v, beta, log_alpha)
    if kv_mask is not None:
        # Selected before the products below, so padding's content reaches no gradient.
        k, v, ld = (jnp.where(kv_mask[:, None], x, 0) for x in (k, v, ld))
        beta = jnp.where(kv_mask, beta, 0)
    # a = -beta k: what is written along beta k is first removed along it (dplr's a = None).
    return _dplr(name, q, beta[:, None] * k, v, None, k * jnp.exp(ld), ld, kv_mask,
                 implementation, chunk_size, segment_ids)


def kda_step(s, q_t, k_t, v_t, beta_t, ld_t):
    """One step of :func:`kda` (``ld_t = log alpha_t: [Dk]``): ``(o_t [Dv], S_t)``."""
    bk = beta_t * k_t
    return dplr_step(s, q_t, bk, v_t, -bk, k_t * jnp.exp(ld_t), ld_t)


def rwkv7(r, k, v, log_w, kappa, a, u, *, kv_mask=None, implementation: str = "chunked",
          chunk_size: int = DPLR_CHUNK, segment_ids=None):
    """RWKV-7's time mixing of one head: ``S_t = (diag(w_t) - (a_t * kappa_t) kappa_t^T)
    S_{t-1} + k_t v_t^T``, ``o_t = r_t^T S_t + (r_t . (u * k_t)) v_t``.

    Args:
      r: ``[L, Dk]`` receptance (the query). k: ``[L, Dk]`` replacement keys. v: ``[L, Dv]``.
      log_w: ``[L, Dk]`` per-channel log-decays ``log w_t <= 0``.
      kappa: ``[L, Dk]`` removal keys (the paper normalises them to unit length).
      a: ``[L, Dk]`` in-context learning rates in ``[0, 1]``.
      u: ``[Dk]`` the head's bonus for the current token.
      kv_mask, implementation, chunk_size, segment_ids: see the module docstring (the bonus
        term reads only the current token).

    Returns:
      ``[L, Dv]`` float32.
    """
    name = "rwkv7"
    _check(name, implementation, chunk_size)
    _check_2d(name, r=r, k=k, v=v, log_w=log_w, kappa=kappa, a=a)
    _check_gates(name, {"log_w": k.shape, "kappa": k.shape, "a": k.shape, "u": k.shape[1:],
                        "r": k.shape}, log_w=log_w, kappa=kappa, a=a, u=u, r=r)
    r, k, v, ld, kappa, a, u = _f32(r, k, v, log_w, kappa, a, u)
    if kv_mask is not None:
        # Selected before the products below, so padding's content reaches no gradient.
        k, v, ld, kappa, a = (jnp.where(kv_mask[:, None], x, 0) for x in (k, v, ld, kappa, a))
    out = _dplr(name, r, k, v, -(a * kappa), kappa, ld, kv_mask, implementation, chunk_size,
                segment_ids)
    return out + jnp.sum(r * u * k, -1, keepdims=True) * v


def rwkv7_step(s, r_t, k_t, v_t, ld_t, kappa_t, a_t, u):
    """One step of :func:`rwkv7`: ``(o_t [Dv], S_t)``."""
    o, s = dplr_step(s, r_t, k_t, v_t, -(a_t * kappa_t), kappa_t, ld_t)
    return o + jnp.sum(r_t * u * k_t) * v_t, s


def _expand(q, k, v, beta, ld):
    """The ``L n_h`` sub-steps: keys, values and strengths in token order, the decay at each
    token's first sub-step and the query at its last."""
    length, nh, dk = k.shape
    first = jnp.zeros((length, nh), ld.dtype).at[:, 0].set(ld)
    last = jnp.zeros((length, nh, dk), q.dtype).at[:, -1].set(q)
    flat = lambda x: x.reshape(length * nh, *x.shape[2:])  # noqa: E731
    return flat(last), flat(k), flat(v), flat(beta), flat(first)


def delta_product(q, k, v, beta, ld, *, kv_mask=None, implementation: str = "chunked",
                  chunk_size: int = DELTA_PRODUCT_CHUNK, segment_ids=None):
    """Gated DeltaProduct of one head: per token, ``S_{t,0} = a_t S_{t-1}`` then ``n_h`` delta
    steps ``S_{t,i} = (I - beta_{t,i} k_{t,i} k_{t,i}^T) S_{t,i-1} + beta_{t,i} k_{t,i}
    v_{t,i}^T``; ``o_t = q_t^T S_{t,n_h}``.

    Args:
      q: ``[L, Dk]``. k: ``[L, n_h, Dk]`` (the paper L2-normalises each). v: ``[L, n_h, Dv]``.
      beta: ``[L, n_h]`` in ``[0, 2]`` (2 allows negative eigenvalues, the paper's choice).
      ld: ``[L]`` log-decays ``log a_t <= 0`` (zeros: DeltaProduct without gates).
      chunk_size: sub-steps per chunk (default ``DELTA_PRODUCT_CHUNK``, 16).
      segment_ids: ``int[L]`` or None: see the module docstring (a token's ``n_h`` sub-steps
        share its document, so the state restarts before a document's first sub-step).

    Returns:
      ``[L, Dv]`` float32.
    """
    name = "delta_product"
    _check(name, implementation, chunk_size)
    if q.ndim != 2 or k.ndim != 3 or v.ndim != 3 or k.shape[:2] != v.shape[:2] or \
            k.shape[0] != q.shape[0] or k.shape[2] != q.shape[1]:
        raise ValueError(f"{name}: need q [L, Dk], k [L, n_h, Dk], v [L, n_h, Dv]; got q "
                         f"{q.shape}, k {k.shape}, v {v.shape}")
    length, nh = k.shape[:2]
    _check_gates(name, {"beta": (length, nh), "ld": (length,)}, beta=beta, ld=ld)
    q, k, v, beta, ld = _f32(q, k, v, beta, ld)
    if kv_mask is not None:
        if kv_mask.shape != (length,):
            raise ValueError(f"{name}: kv_mask must be bool[{length}], got shape "
                             f"{kv_mask.shape}")
        m = kv_mask[:, None]
        beta, ld = jnp.where(m, beta, 0), jnp.where(kv_mask, ld, 0)
        k, v = jnp.where(m[..., None], k, 0), jnp.where(m[..., None], v, 0)
    _check_segments(name, segment_ids, length)
    fq, fk, fv, fb, fld = _expand(q, k, v, beta, ld)
    seg = None if segment_ids is None else jnp.repeat(segment_ids, nh)
    if implementation == "recurrent":
        out = gated_delta_recurrent(fq, fk, fv, fb, fld, segment_ids=seg)
        return out[nh - 1::nh]
    # Whole tokens per chunk, so the state is read once per token, after its last sub-step.
    chunk = length * nh if implementation == "parallel" else max(chunk_size // nh, 1) * nh
    return gated_delta_chunked(fq, fk, fv, fb, fld, chunk_size=chunk, query_stride=nh,
                               segment_ids=seg, group_positions=DELTA_GROUP_POSITIONS)


def delta_product_step(s, q_t, k_t, v_t, beta_t, ld_t):
    """One token of :func:`delta_product` (``k_t [n_h, Dk]``, ``v_t [n_h, Dv]``, ``beta_t
    [n_h]``): ``(o_t [Dv], S_t)``."""
    s = jnp.exp(ld_t) * s
    for i in range(k_t.shape[0]):
        o, s = gated_delta_step(s, q_t, k_t[i], v_t[i], beta_t[i])
    return o, s
