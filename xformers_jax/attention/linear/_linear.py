"""Kernelized linear attention: ``linear_attention``, ``performer_attention`` and O(1) decoding.

``out_i = phi(q_i) S / phi(q_i) z`` with ``S = sum_j phi(k_j) v_j^T``, ``z = sum_j phi(k_j)``
(Katharopoulos et al., 2020, "Transformers are RNNs"; Choromanski et al., 2021, Performer).
Under ``causal=True`` the sums run over ``j <= i`` and may be gated or decayed (the gated
update of RFA, Peng et al., 2021); all of that is one recurrence, computed by ``_scan``
(chunkwise parallel or per-step scan).

Stabilising exponential features (FAVOR+, hyperbolic) without leaking the future: the feature
maps hand over ``log phi``. A query row is shifted by its own maximum, which cancels between
numerator and denominator. A per-key shift would not cancel (it reweights keys), and a maximum
over all keys, used non-causally, would make position i depend on later keys under
``causal=True`` (through under/overflow). Causally, the keys are shifted by the running maximum
``m_t = max_{j<=t} max_f log phi(k_j)_f``: the state is kept scaled by ``exp(-m_t)``, and
raising ``m`` is a decay ``exp(m_{t-1} - m_t) <= 1`` of the state, the same online rescaling as
flash attention's softmax. It uses only positions ``<= t``, and every exponent is ``<= 0``.

Packed rows (``segment_ids``, several documents in one sequence): the causal state restarts at
each document's first token (the one scan's document reset, ``_scan``), and so does the running
maximum of the key stabiliser, so a document's keys are never scaled by an earlier document's
(which could underflow them); each document's outputs are those of the document alone.
Without ``causal``, each position reads the sum over its own document: the causal sums run
forwards and backwards, the diagonal counted once.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from .. import _contract as C
from ._feature_maps import FeatureMap, resolve_feature_map
from ._scan import causal_chunked, causal_recurrent, documents

IMPLEMENTATIONS = ("chunked", "recurrent")


def check_implementation(name: str, implementation: str, chunk_size) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{name}: implementation must be one of {IMPLEMENTATIONS} but got {implementation!r}"
        )
    C.check_positive_int(name, "chunk_size", chunk_size)


def check_per_position(name: str, arg: str, x, lk: int) -> jax.Array:
    """Checks a per-key float array ``[Lk]`` (a scalar is broadcast) and returns it in f32."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}: {arg} must be floating point but has dtype {x.dtype}")
    if x.shape not in ((), (lk,)):
        raise ValueError(f"{name}: {arg} must be a scalar or have shape ({lk},) but got {x.shape}")
    return jnp.broadcast_to(x.astype(C.STATS_DTYPE), (lk,))


def _gates(name, lk, gate_logits, log_decay, kv_mask):
    """Per-position log-decays of the state and log-weights of the new key (RFA gate:
    ``S_t = g_t S_{t-1} + (1 - g_t) phi(k_t) v_t^T`` with ``g_t = sigmoid(gate_logits_t)``)."""
    ld = jnp.zeros((lk,), C.STATS_DTYPE)
    key_log_weight = None
    if gate_logits is not None:
        g = check_per_position(name, "gate_logits", gate_logits, lk)
        ld = ld + jax.nn.log_sigmoid(g)
        key_log_weight = jax.nn.log_sigmoid(-g)
    if log_decay is not None:
        d = check_per_position(name, "log_decay", log_decay, lk)
        d = eqx.error_if(d, jnp.any(d > 0), f"{name}: log_decay must be <= 0 (a decay in (0, 1])")
        ld = ld + d
    if kv_mask is not None:
        # A padded position must not even decay the state: it has no influence at all.
        ld = jnp.where(kv_mask, ld, 0.0)
    return ld, key_log_weight


def _query_features(fm: FeatureMap, q, arrays, root_scale):
    phi = fm.fn(q.astype(C.STATS_DTYPE) * root_scale, *arrays)
    if fm.log_space:
        phi = jnp.exp(phi - lax.stop_gradient(jnp.max(phi, axis=-1, keepdims=True)))
    return phi


def _guard(den, positive: bool, eps: float):
    """A denominator that is never 0: rows with no visible key (den == 0, numerator 0) give 0;
    features that can be negative also keep ``|den| >= eps`` so the ratio cannot blow up."""
    if positive:
        return jnp.where(den == 0, 1.0, den)
    return jnp.where(den >= 0, jnp.maximum(den, eps), jnp.minimum(den, -eps))


def _segmented_cummax(x, doc):
    """``max_{s <= t, doc_s = doc_t} x_s``: the running maximum restarting at each document."""
    def combine(a, b):
        return b[0], jnp.where(a[0] == b[0], jnp.maximum(a[1], b[1]), b[1])

    return lax.associative_scan(combine, (doc, x))[1]


def _prepare(name, q, k, v, arrays, feature_map, causal, kv_mask, scale, gate_logits, log_decay,
             doc=None):
    x, kv_mask = C.check_qkv_mask(name, q, k, v, kv_mask)
    fm = resolve_feature_map(name, feature_map, arrays)
    if causal:
        C.check_same_length(name, x, "causal=True needs Lq == Lk")
    if not causal and (gate_logits is not None or log_decay is not None):
        raise ValueError(
            f"{name}: gate_logits and log_decay define a recurrence over positions and need "
            "causal=True"
        )
    root_scale = math.sqrt(C.resolve_scale(x.dk, scale))
    ld, key_log_weight = _gates(name, x.lk, gate_logits, log_decay, kv_mask)
    fq = _query_features(fm, x.q, arrays, root_scale)
    k_in = x.k.astype(C.STATS_DTYPE)
    if kv_mask is not None:
        # Zero padded keys before the map too: a feature that overflows on junk would turn the
        # zero cotangent of the masked-out branch below into NaN.
        k_in = jnp.where(kv_mask[:, None], k_in, 0.0)
    phi_k = fm.fn(k_in * root_scale, *arrays)
    if fm.log_space:
        if key_log_weight is not None:
            phi_k = phi_k + key_log_weight[:, None]
        if kv_mask is not None:
            phi_k = jnp.where(kv_mask[:, None], phi_k, -jnp.inf)
        row_max = lax.stop_gradient(jnp.max(phi_k, axis=-1))
        if doc is not None:
            # One shift per document (a running maximum restarting at each document): the
            # scaling cancels within a document, and no document is scaled by another's keys.
            m = _segmented_cummax(row_max, doc)
            if not causal:
                m = jnp.flip(_segmented_cummax(jnp.flip(m), jnp.flip(doc)))  # the doc's max
            m = jnp.where(jnp.isneginf(m), 0.0, m)
            if causal:
                m_prev = jnp.concatenate([m[:1], m[:-1]])
                ld = ld + jnp.minimum(m_prev - m, 0.0)
            fk = jnp.exp(phi_k - m[:, None])
        elif causal:
            m = lax.cummax(row_max)
            m = jnp.where(jnp.isneginf(m), 0.0, m)  # before the first real key: state is 0
            m_prev = jnp.concatenate([m[:1], m[:-1]])
            ld = ld + jnp.minimum(m_prev - m, 0.0)
            fk = jnp.exp(phi_k - m[:, None])
        else:
            m = jnp.max(row_max)
            fk = jnp.exp(phi_k - jnp.where(jnp.isneginf(m), 0.0, m))
    else:
        fk = phi_k if key_log_weight is None else phi_k * jnp.exp(key_log_weight)[:, None]
        if kv_mask is not None:
            fk = jnp.where(kv_mask[:, None], fk, 0.0)
    # A column of ones turns the value sum into (numerator, denominator) in one pass.
    v_aug = jnp.concatenate([x.v.astype(C.STATS_DTYPE), jnp.ones((x.lk, 1), C.STATS_DTYPE)], -1)
    if kv_mask is not None:
        v_aug = jnp.where(kv_mask[:, None], v_aug, 0.0)  # 0 * inf in a padded value is NaN
    return x, fm, fq, fk, v_aug, ld


def linear_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    *feature_arrays,
    feature_map="elu",
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    gate_logits=None,
    log_decay=None,
    implementation: str = "chunked",
    chunk_size: int = 64,
    eps: float = 1e-6,
    segment_ids: Int[Array, "seq"] | None = None,
    key=None,
) -> Float[Array, "q_seq v_dim"]:
    """Kernelized attention ``phi(Q) (phi(K)^T V)``, normalised, in time linear in length.

    Linear Transformer (Katharopoulos et al., 2020), Performer (Choromanski et al., 2021) and
    RFA with its gating (Peng et al., 2021). q and k are multiplied by ``sqrt(scale)`` before
    the feature map, so softmax-approximating maps approximate ``exp(scale q . k)``.

    Args:
      q: ``[Lq, Dk]``.
      k: ``[Lk, Dk]``.
      v: ``[Lk, Dv]``.
      *feature_arrays: arrays the feature map takes (e.g. a projection ``[M, Dk]`` from
        :func:`init_random_projection`).
      feature_map: ``"elu"``, ``"relu"``, ``"favor_positive"``, ``"hyperbolic"``,
        ``"favor_trig"``, ``"rfa"``, ``"dpfp"`` or a callable ``phi(x [L, Dk], *arrays) ->
        [L, M]``.
      causal: position i sees keys ``j <= i`` only (needs ``Lq == Lk``).
      kv_mask: ``bool[Lk]``, True for real keys; padded keys add nothing to any sum and do not
        decay the causal state.
      scale: score scale; ``1/sqrt(Dk)`` by default.
      gate_logits: ``[Lk]`` (causal only): RFA gate ``g = sigmoid(gate_logits)``,
        ``S_t = g_t S_{t-1} + (1 - g_t) phi(k_t) v_t^T`` (and the same for the normaliser).
      log_decay: scalar or ``[Lk]``, ``<= 0`` (causal only): the state is multiplied by
        ``exp(log_decay_t)`` before position t is added.
      implementation: causal form, ``"chunked"`` (chunkwise parallel) or ``"recurrent"``
        (per-step scan with a two-scan custom VJP). Both compute the same function.
      chunk_size: positions per chunk for ``"chunked"``.
      eps: smallest denominator magnitude for feature maps that can be negative.
      segment_ids: ``int[L]`` (self attention, ``Lq == Lk``): packed documents, each a
        contiguous run of equal ids; each position sees only keys of its own document, and
        the causal state (and the exponential maps' key stabiliser) restarts at each
        document's first token.

    Returns:
      ``[Lq, Dv]`` in q's dtype (computed in float32).
    """
    name = "linear_attention"
    check_implementation(name, implementation, chunk_size)
    doc = None
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            raise ValueError(f"{name}: segment_ids must be one int[L] array (self attention); "
                             "a (q_ids, kv_ids) pair is not supported")
        doc = documents(C.check_segment_ids(name, segment_ids, q.shape[0], k.shape[0])[0])
    x, fm, fq, fk, v_aug, ld = _prepare(
        name, q, k, v, feature_arrays, feature_map, causal, kv_mask, scale, gate_logits, log_decay,
        doc,
    )
    if not causal and doc is not None:
        # Each position's own document, both ways: forwards and backwards causal sums
        # restarting at the boundaries, the position itself counted once.
        fwd = causal_chunked(fq, fk, v_aug, ld, chunk_size, segment_ids=doc)
        bwd = causal_chunked(fq[::-1], fk[::-1], v_aug[::-1], ld[::-1], chunk_size,
                             segment_ids=doc[::-1])[::-1]
        out = fwd + bwd - jnp.sum(fq * fk, -1, keepdims=True) * v_aug
    elif not causal:
        out = fq @ (fk.T @ v_aug)
    elif implementation == "chunked":
        out = causal_chunked(fq, fk, v_aug, ld, chunk_size, segment_ids=doc)
    else:
        out = causal_recurrent(fq, fk, v_aug, ld, segment_ids=doc)
    return (out[:, : x.dv] / _guard(out[:, x.dv], fm.positive, eps)[:, None]).astype(x.q.dtype)


def performer_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    projection: Float[Array, "features qk_dim"],
    *,
    kernel: str = "softmax",
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    implementation: str = "chunked",
    chunk_size: int = 64,
    segment_ids: Int[Array, "seq"] | None = None,
    key=None,
) -> Float[Array, "q_seq v_dim"]:
    """Performer attention with FAVOR+ (Choromanski et al. 2021).

    ``kernel="softmax"`` uses positive orthogonal random features, stabilised as described in
    this module (no future leak under ``causal=True``); ``kernel="relu"`` uses the ReLU kernel
    ``relu(W x) / sqrt(M)``.

    Args:
      q: ``[Lq, Dk]``.
      k: ``[Lk, Dk]``.
      v: ``[Lk, Dv]``.
      projection: ``[M, Dk]`` from :func:`init_random_projection` (redraw it with a new key
        when you want fresh features).
      kernel: ``"softmax"`` or ``"relu"``.
      causal, kv_mask, scale, implementation, chunk_size, segment_ids: as in
        :func:`linear_attention`.

    Returns:
      ``[Lq, Dv]`` in q's dtype.
    """
    kernels = {"softmax": "favor_positive", "relu": "relu"}
    if kernel not in kernels:
        raise ValueError(f"performer_attention: kernel must be one of {sorted(kernels)}, got {kernel!r}")
    return linear_attention(
        q, k, v, projection, feature_map=kernels[kernel], causal=causal, kv_mask=kv_mask,
        scale=scale, implementation=implementation, chunk_size=chunk_size,
        segment_ids=segment_ids,
    )


class LinearAttentionState(NamedTuple):
    """The O(1) decoding state of causal linear attention.

    ``kv: [M, Dv + 1]`` float32 holds ``sum_j w_j phi(k_j) [v_j, 1]^T`` (decayed, gated),
    scaled by ``exp(-log_scale)``; ``log_scale`` is the running key stabiliser of exponential
    feature maps (``-inf`` before the first token, unused by other maps).
    """

    kv: jax.Array
    log_scale: jax.Array


def linear_attention_init_state(dk: int, dv: int, *feature_arrays, feature_map="elu"):
    """An empty decoding state for :func:`linear_attention_step`.

    Args:
      dk: key dimension.
      dv: value dimension.
      *feature_arrays, feature_map: as in :func:`linear_attention`.

    Returns:
      A :class:`LinearAttentionState` with ``kv: [M, dv + 1]`` zeros.
    """
    name = "linear_attention_init_state"
    fm = resolve_feature_map(name, feature_map, feature_arrays)
    dk = C.check_positive_int(name, "dk", dk)
    dv = C.check_positive_int(name, "dv", dv)
    m = jax.eval_shape(lambda: fm.fn(jnp.zeros((1, dk), C.STATS_DTYPE), *feature_arrays)).shape[-1]
    return LinearAttentionState(
        jnp.zeros((m, dv + 1), C.STATS_DTYPE), jnp.array(-jnp.inf, C.STATS_DTYPE)
    )


def linear_attention_step(
    state: LinearAttentionState,
    q,
    k,
    v,
    *feature_arrays,
    feature_map="elu",
    scale: float | None = None,
    gate_logit=None,
    log_decay=None,
    eps: float = 1e-6,
):
    """One decoding step of causal :func:`linear_attention` in O(1) time and memory.

    Feeding a sequence token by token gives, position by position, what
    ``linear_attention(..., causal=True)`` gives for the whole sequence (the causal Linear
    Transformer is an RNN; Katharopoulos et al., 2020).

    Args:
      state: from :func:`linear_attention_init_state` or a previous step.
      q: ``[Dk]`` this token's query.
      k: ``[Dk]`` this token's key.
      v: ``[Dv]`` this token's value.
      *feature_arrays, feature_map, scale, eps: as in :func:`linear_attention`.
      gate_logit: scalar RFA gate logit of this token, or None.
      log_decay: scalar log-decay (``<= 0``) of this token, or None.

    Returns:
      ``(out [Dv] in q's dtype, new state)``.
    """
    name = "linear_attention_step"
    x = C.check_token(name, q, k, v)
    fm = resolve_feature_map(name, feature_map, feature_arrays)
    if state.kv.shape[1] != x.dv + 1:
        raise ValueError(f"{name}: state.kv{state.kv.shape} does not match v{tuple(x.v.shape[1:])}")
    root_scale = math.sqrt(C.resolve_scale(x.dk, scale))
    ld, key_log_weight = _gates(name, 1, gate_logit, log_decay, None)
    fq = _query_features(fm, x.q, feature_arrays, root_scale)[0]
    phi_k = fm.fn(x.k.astype(C.STATS_DTYPE) * root_scale, *feature_arrays)[0]
    log_scale = state.log_scale
    if fm.log_space:
        if key_log_weight is not None:
            phi_k = phi_k + key_log_weight[0]
        log_scale = jnp.maximum(state.log_scale, lax.stop_gradient(jnp.max(phi_k)))
        first = jnp.isneginf(state.log_scale)
        ld = ld + jnp.where(first, 0.0, state.log_scale - log_scale)
        fk = jnp.exp(phi_k - log_scale)
    else:
        fk = phi_k if key_log_weight is None else phi_k * jnp.exp(key_log_weight[0])
    v_aug = jnp.append(x.v[0].astype(C.STATS_DTYPE), 1.0)
    kv = jnp.exp(ld[0]) * state.kv + fk[:, None] * v_aug[None, :]
    out = fq @ kv
    out = (out[: x.dv] / _guard(out[x.dv], fm.positive, eps)).astype(x.q.dtype)
    return out, LinearAttentionState(kv, log_scale)
