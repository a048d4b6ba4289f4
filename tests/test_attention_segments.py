"""Packed rows (``segment_ids``) in the softmax kinds outside the exact family's own kernels:
each kind's function with segment ids against (1) its dense definition written here from the
paper's equations with a same-document mask, outputs and gradients in float32, and (2) the
same function run on each document alone. The documents of the row (6, 2, 5 tokens and 3
padding positions, tiles of 4) put one boundary inside a tile, one exactly on a tile edge,
and two documents longer than a tile; the padding holds NaN. Layer-level packing (a packed
row equals each document alone in a ``CausalLM``) is ``tests/test_kinds_packing.py``'s, for
every kind whose record claims segment ids. One compiled program per kind."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fast_jit import jit0
from tests.tolerances import EXACT, EXACT_GRAD, assert_close
from xformers_jax import attention as A
from xformers_jax import nn
from xformers_jax.attention._flex import streaming_documents
from xformers_jax.attention.modern._differential import differential_attention
from xformers_jax.attention.modern._dsa import deepseek_sparse_reference
from xformers_jax.attention.modern._fox import forgetting_attention

DOCS = (6, 2, 5)
L, D, TILE = 16, 8, 4
SEG = np.concatenate([np.full(n, i + 1) for i, n in enumerate(DOCS)]
                     + [np.zeros(L - sum(DOCS), int)]).astype(np.int32)
STARTS = np.cumsum((0,) + DOCS[:-1])
REAL = SEG > 0
_TILES = {"block_q": TILE, "block_k": TILE}


def _inputs(seed=0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q, k, v = (jax.random.normal(x, (L, D)) for x in (kq, kk, kv))
    # Padded keys and values hold NaN: they must reach no real output and no gradient. (A
    # padded query's own output is the caller's to discard; NaN there would still reach the
    # gradient of a parameter shared by all queries, such as differential's lambda.)
    nan = jnp.asarray(REAL)[:, None]
    return (q,) + tuple(jnp.where(nan, a, jnp.nan) for a in (k, v))


def _offsets():
    return np.concatenate([np.arange(n) for n in DOCS] + [np.arange(L - sum(DOCS))])


def _keep(causal=True):
    """The dense reference's mask: real keys of the query's own document (and j <= i)."""
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    keep = (SEG[:, None] == SEG[None, :]) & REAL[None, :]
    return keep & (j <= i) if causal else keep


def _softmax_rows(s, keep, sink=None):
    """``softmax(s)`` over the kept keys of each row, in float32 (a sink logit adds to the
    denominator); rows with no kept key are zero."""
    s = jnp.where(keep, s.astype(jnp.float32), -jnp.inf)
    m = jnp.max(s, -1, keepdims=True)
    if sink is not None:
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(keep, jnp.exp(s - m), 0.0)
    den = e.sum(-1, keepdims=True) + (0.0 if sink is None else jnp.exp(sink - m))
    return e / jnp.where(den > 0, den, 1.0)


def _scores(q, k, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return (q.astype(jnp.float32) @ k.astype(jnp.float32).T) * scale


def _clean(*arrays):
    """The reference's per-token inputs: padding replaced by zeros (the dense form would turn
    NaN into NaN rows otherwise; padding is out of every kept entry anyway)."""
    return tuple(jnp.where(jnp.asarray(REAL).reshape(-1, *[1] * (a.ndim - 1)), a, 0)
                 for a in arrays)


# -- each kind: (its function with segment ids, its dense definition, extra inputs) -----------

def _softcap_fn(q, k, v, seg, mask):
    return A.flex_attention(q, k, v, score_mod=A.soft_cap_score(1.0), causal=True,
                            kv_mask=mask, segment_ids=seg, **_TILES)


def _softcap_ref(q, k, v):
    return _softmax_rows(jnp.tanh(_scores(q, k)), _keep()) @ v


def _sinks_fn(q, k, v, seg, mask, sink):
    return A.flex_attention(q, k, v, sink=sink, mask_mod=A.patterns.Local(3, 0), causal=True,
                            kv_mask=mask, segment_ids=seg, **_TILES)


def _sinks_ref(q, k, v, sink):
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    return _softmax_rows(_scores(q, k), _keep() & (j >= i - 3), sink) @ v


def _streaming_fn(q, k, v, seg, mask):
    return A.flex_attention(q, k, v, mask_mod=A.streaming_mask(2, 2, seg), causal=True,
                            kv_mask=mask, segment_ids=seg, **_TILES)


def _streaming_ref(q, k, v):
    # The sinks are the first 2 tokens of each document; the window the query and 2 back.
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    keep = _keep() & ((j >= i - 2) | (_offsets()[None, :] < 2))
    return _softmax_rows(_scores(q, k), keep) @ v


def _streaming_kind_fn(q, k, v, seg, mask):
    # The kind's form: the window on the tiled kernel, each document's sinks gathered.
    if seg is None:
        return A.flex_attention(q, k, v, mask_mod=A.streaming_mask(2, 2), causal=True,
                                kv_mask=mask, **_TILES)
    return streaming_documents(q, k, v, window=2, sinks=2, segment_ids=seg, causal=True,
                               kv_mask=mask, **_TILES)


_LAMBDA_INIT = 0.6


def _differential_fn(q, k, v, seg, mask, lam):
    return differential_attention(q, k, v, lam, lambda_init=_LAMBDA_INIT, causal=True,
                                  kv_mask=mask, segment_ids=seg, **_TILES)


def _differential_ref(q, k, v, lam):
    # Ye et al., 2024, Eqs. 1 and 3: (1 - lambda_init) RMSNorm((A1 - lambda A2) V).
    h = D // 2
    scale = h ** -0.5
    a1 = _softmax_rows(_scores(q[:, :h], k[:, :h], scale), _keep())
    a2 = _softmax_rows(_scores(q[:, h:], k[:, h:], scale), _keep())
    o = (a1 - lam * a2) @ v
    return (1 - _LAMBDA_INIT) * o * jax.lax.rsqrt(jnp.mean(o * o, -1, keepdims=True) + 1e-5)


def _fox_fn(q, k, v, seg, mask, log_f):
    return forgetting_attention(q, k, v, log_f, causal=True, kv_mask=mask, segment_ids=seg,
                                **_TILES)


def _fox_ref(q, k, v, log_f):
    # Lin et al., 2025, Eq. 7: D_ij = sum_{l = j+1}^{i} log f_l, summed term by term (inside a
    # document every l in (j, i] belongs to it).
    i, j, l_ = np.arange(L)[:, None, None], np.arange(L)[None, :, None], np.arange(L)
    between = (l_ > j) & (l_ <= i)
    d = jnp.sum(jnp.where(between, log_f, 0.0), -1)
    return _softmax_rows(_scores(q, k) + d, _keep()) @ v


_STRIDED = A.patterns.PerHead.sparse_transformer(2, 3, "strided")


def _per_head_fn(q, k, v, seg, mask):
    # Two heads of width 4: the Sparse Transformer's local and strided halves (stride 3).
    def heads(x):
        return x.reshape(x.shape[0], 2, D // 2)

    out = A.per_head_block_sparse_attention(heads(q), heads(k), heads(v), _STRIDED,
                                            causal=True, kv_mask=mask, segment_ids=seg, **_TILES)
    return out.reshape(-1, D)


def _per_head_ref(q, k, v):
    # Child et al., 2019, Eq. 3 (causal): A1 = {j : i - j < s}, A2 = {j : (i - j) mod s = 0}.
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    h = D // 2
    outs = [_softmax_rows(_scores(q[:, a:a + h], k[:, a:a + h]), _keep() & part) @ v[:, a:a + h]
            for a, part in ((0, i - j < 3), (h, (i - j) % 3 == 0))]
    return jnp.concatenate(outs, -1)


def _gaussian_fn(q, k, v, seg, mask, w_p, u_p, u_d):
    return A.gaussian_prior_attention(q, k, v, (w_p, u_p, u_d), causal=True, kv_mask=mask,
                                      segment_ids=seg, **_TILES)


def _gaussian_ref(q, k, v, w_p, u_p, u_d):
    # Yang et al., 2018, Eqs. 5-9 over each document: I_i the document's keys up to i, the
    # centre p_i = I_i sigmoid(u_p^T tanh(W_p q_i)), sigma_i = I_i sigmoid(u_d^T ...) / 2,
    # G_ij = -(j - p_i)^2 / (2 sigma_i^2) with j, p_i positions in the document.
    pos = jnp.asarray(_offsets(), jnp.float32)
    h = jnp.tanh(q @ w_p)
    n = pos + 1.0
    centre, sigma = n * jax.nn.sigmoid(h @ u_p), n * jax.nn.sigmoid(h @ u_d) / 2
    g = -(pos[None, :] - centre[:, None]) ** 2 / (2 * jnp.maximum(sigma, 1e-3)[:, None] ** 2)
    return _softmax_rows(_scores(q, k) + g, _keep()) @ v


def _distance_fn(q, k, v, seg, mask, w, b):
    return A.distance_prior_attention(q, k, v, w, b, causal=True, kv_mask=mask,
                                      segment_ids=seg, **_TILES)


def _distance_ref(q, k, v, w, b):
    # Guo et al., 2019: the scores minus |w (i - j)^2 + b|.
    d = (np.arange(L)[:, None] - np.arange(L)[None, :]).astype(np.float32)
    return _softmax_rows(_scores(q, k) - jnp.abs(w * d * d + b), _keep()) @ v


def _hardcoded_fn(q, k, v, seg, mask):
    return A.hardcoded_gaussian_attention(q, k, v, offset=-1.0, std=1.5, causal=True,
                                          kv_mask=mask, segment_ids=seg, **_TILES)


def _hardcoded_ref(q, k, v):
    # You et al., 2020: fixed weights exp(-(j - (i + offset))^2 / (2 std^2)), renormalised.
    d = (np.arange(L)[None, :] - np.arange(L)[:, None] + 1.0).astype(np.float32)
    return _softmax_rows(jnp.asarray(-d * d / (2 * 1.5 ** 2)), _keep()) @ v


def _two_heads(x):
    return x.reshape(x.shape[0], 2, D // 2)


def _talking_fn(implementation):
    def fn(q, k, v, seg, mask, lm, wm):
        out = A.talking_heads_attention(_two_heads(q), _two_heads(k), _two_heads(v), lm, wm,
                                        causal=True, kv_mask=mask, segment_ids=seg,
                                        implementation=implementation, **_TILES)
        return out.reshape(-1, D)

    return fn


def _talking_ref(q, k, v, lm, wm):
    # Shazeer et al., 2020: J[h] = sum_hk P_l[hk, h] S[hk]; W[h] = softmax(J[h]);
    # W'[hv] = sum_h P_w[h, hv] W[h]; O[:, hv] = W'[hv] v[:, hv].
    h = D // 2
    s = jnp.stack([_scores(q[:, a:a + h], k[:, a:a + h]) for a in (0, h)])
    w = jnp.stack([_softmax_rows(j, _keep()) for j in jnp.einsum("kqs,kh->hqs", s, lm)])
    w2 = jnp.einsum("hqs,hv->vqs", w, wm)
    return jnp.concatenate([w2[i] @ v[:, a:a + h] for i, a in enumerate((0, h))], -1)


def _collaborative_fn(q, k, v, seg, mask, mixing):
    out = A.collaborative_attention(q, k, _two_heads(v), mixing, causal=True, kv_mask=mask,
                                    segment_ids=seg, **_TILES)
    return out.reshape(-1, D)


def _collaborative_ref(q, k, v, mixing):
    # Cordonnier et al., 2020, Eq. 6: head_h = softmax(q diag(m_h) k^T / sqrt(Dq / H)) v_h.
    h = D // 2
    return jnp.concatenate([_softmax_rows(_scores(q * m, k, h ** -0.5), _keep()) @ v[:, a:a + h]
                            for m, a in zip(mixing, (0, h))], -1)


def _multiscale_fn(q, k, v, seg, mask):
    out = A.multiscale_attention(_two_heads(q), _two_heads(k), _two_heads(v), spans=(2, None),
                                 causal=True, kv_mask=mask, segment_ids=seg, **_TILES)
    return out.reshape(-1, D)


def _multiscale_ref(q, k, v):
    # Guo et al., 2020: head 0 sees j in [i - 2, i], head 1 every earlier key.
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    h = D // 2
    return jnp.concatenate([_softmax_rows(_scores(q[:, a:a + h], k[:, a:a + h]), _keep() & part)
                            @ v[:, a:a + h] for a, part in ((0, j >= i - 2), (h, True))], -1)


def _average_fn(q, k, v, seg, mask, w, b):
    return A.average_attention(q, k, v, A.AverageGate(w, b), causal=True, kv_mask=mask,
                               segment_ids=seg)


def _average_ref(q, k, v, w, b):
    # Zhang et al., 2018, Eqs. 1-3 (the head's form): g_i the mean of the document's values
    # up to i, [i; f] = sigmoid([q_i; g_i] W + b), h_i = i * v_i + f * g_i.
    keep = _keep().astype(jnp.float32)
    g = (keep @ v) / jnp.maximum(keep.sum(-1, keepdims=True), 1.0)
    i_gate, f_gate = jnp.split(jax.nn.sigmoid(jnp.concatenate([q, g], -1) @ w + b), 2, -1)
    return i_gate * v + f_gate * g


# Scores passed between layers (He et al., 2021; Wang et al., 2021; Ying et al., 2021): two
# layers, the first's queries and keys as extra per-token inputs.

def _realformer_fn(q, k, v, seg, mask, q1, k1):
    _, s1 = A.realformer_attention(q1, k1, v, None, causal=True, kv_mask=mask, segment_ids=seg)
    return A.realformer_attention(q, k, v, s1, causal=True, kv_mask=mask, segment_ids=seg)[0]


def _realformer_tiled_fn(q, k, v, seg, mask, q1, k1):
    return A.realformer_flash_attention(jnp.stack([q1, q]), jnp.stack([k1, k]), v, causal=True,
                                        kv_mask=mask, segment_ids=seg, **_TILES)


def _realformer_ref(q, k, v, q1, k1):
    # The residual scores S_2 = q_2 k_2^T / sqrt(d) + S_1.
    return _softmax_rows(_scores(q, k) + _scores(q1, k1), _keep()) @ v


def _lazy_fn(q, k, v, seg, mask, q1, k1):
    _, w = A.lazy_attention(q1, k1, v, causal=True, kv_mask=mask, segment_ids=seg)
    return A.lazy_attention(q, k, v, w, recompute=False, causal=True, kv_mask=mask,
                            segment_ids=seg)[0]


def _lazy_ref(q, k, v, q1, k1):
    return _softmax_rows(_scores(q1, k1), _keep()) @ v


_CONV = 0.3 * jax.random.normal(jax.random.PRNGKey(4), (2, 2, 3, 3))


def _predictive_fn(q, k, v, seg, mask, q1, k1):
    heads = [_two_heads(x) for x in (q, k, v, q1, k1)]
    _, s1 = A.predictive_attention(heads[3], heads[4], heads[2], None, _CONV, 0.5,
                                   causal=True, kv_mask=mask, segment_ids=seg)
    out, _ = A.predictive_attention(*heads[:3], s1, _CONV, 0.5, causal=True, kv_mask=mask,
                                    segment_ids=seg)
    return out.reshape(-1, D)


def _predictive_ref(q, k, v, q1, k1):
    # Wang et al., 2021: S_2 = a S_own + (1 - a) Conv(S_1), the 3 x 3 taps over the previous
    # map (rows i-2..i, columns j-1..j+1), each document's map convolved on its own (zero
    # outside its visible entries).
    h = D // 2
    halves = (slice(0, h), slice(h, D))
    keep = _keep()
    s1 = jnp.stack([_scores(q1[:, c], k1[:, c]) for c in halves])
    conv = 0.0
    for doc in range(1, len(DOCS) + 1):
        mine = keep & (SEG[:, None] == doc)
        padded = jnp.pad(jnp.where(mine, s1, 0.0), ((0, 0), (2, 0), (1, 1)))
        taps = sum(_CONV[:, :, a, b] @ padded[:, a:a + L, b:b + L].reshape(2, -1)
                   for a in range(3) for b in range(3)).reshape(2, L, L)
        conv = conv + jnp.where(SEG[:, None] == doc, taps, 0.0)
    return jnp.concatenate([_softmax_rows(0.5 * _scores(q[:, c], k[:, c]) + 0.5 * conv[o],
                                          keep) @ v[:, c] for o, c in enumerate(halves)], -1)


def _sparsemax_fn(q, k, v, seg, mask):
    return A.entmax_attention(q, k, v, 2.0, causal=True, kv_mask=mask, segment_ids=seg)


def _sparsemax_ref(q, k, v):
    # Correia et al., 2019 at alpha = 2 (sparsemax, Martins & Astudillo, 2016): the Euclidean
    # projection of each row's visible scores onto the simplex, tau from the sorted scores.
    z = jnp.where(_keep(), _scores(q, k), -1e9)
    zs = -jnp.sort(-z, axis=-1)
    n = jnp.arange(1, L + 1)
    support = 1 + n * zs > jnp.cumsum(zs, -1)
    size = jnp.maximum(jnp.sum(support, -1, keepdims=True), 1)  # 1 in rows with no key
    tau = (jnp.take_along_axis(jnp.cumsum(zs, -1), size - 1, -1) - 1) / size
    return jnp.maximum(z - tau, 0.0) @ v


def _topk_fn(q, k, v, seg, mask):
    return A.topk_attention(q, k, v, top_k=3, causal=True, kv_mask=mask, segment_ids=seg)


def _topk_ref(q, k, v):
    # Gupta et al., 2021: softmax over each query's 3 best visible keys of its document.
    s = jnp.where(_keep(), _scores(q, k), -jnp.inf)
    kth = jax.lax.stop_gradient(-jnp.sort(-s, -1)[:, 2:3])
    return _softmax_rows(s, _keep() & (s >= kth)) @ v


def _span_fn(q, k, v, seg, mask, span):
    return A.adaptive_span_attention(q, k, v, span, max_span=4, ramp=2, causal=True,
                                     kv_mask=mask, segment_ids=seg, block_size=TILE)


def _span_ref(q, k, v, span):
    # Sukhbaatar et al., 2019, Eq. 2: weights m_z(i - j) exp(s_ij), renormalised, with
    # m_z(x) = clamp((R + z - x) / R, 0, 1).
    dist = (np.arange(L)[:, None] - np.arange(L)[None, :]).astype(np.float32)
    m = jnp.clip((2.0 + span - dist) / 2.0, 0.0, 1.0)
    e = jnp.where(_keep(), m * jnp.exp(_scores(q, k) - 4.0), 0.0)
    return e / jnp.maximum(e.sum(-1, keepdims=True), 1e-30) @ v


def _lowrank_band_fn(q, k, v, seg, mask, w_q, w_k, gate):
    return A.lowrank_band_attention(q, k, v, w_q, w_k, gate, window=2, causal=True,
                                    kv_mask=mask, segment_ids=seg)


def _lowrank_band_ref(q, k, v, w_q, w_k, gate):
    # Guo et al., 2019: (1 - g) softmax((q W_q)(k W_k)^T / sqrt(r)) v + g softmax_band(q k^T) v.
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    g = jax.nn.sigmoid(gate)
    far = _softmax_rows(_scores(q @ w_q, k @ w_k, w_q.shape[1] ** -0.5), _keep()) @ v
    band = _softmax_rows(_scores(q, k), _keep() & (j >= i - 2)) @ v
    return (1 - g) * far + g * band


def _dsa_fn(q, k, v, seg, mask, qi, w, ki):
    _, _, bits = A.lightning_indexer(qi, w, ki, top_k=3, causal=True, kv_mask=mask,
                                     segment_ids=seg, chunk=TILE, return_bits=True)
    return A.deepseek_sparse_tiled(q, k, v, bits, causal=True, kv_mask=mask, segment_ids=seg,
                                   **_TILES)


def _dsa_ref(q, k, v, qi, w, ki):
    # DeepSeek-AI, 2025, Eqs. 1-2 (the dense reference): each query's 3 best keys of its
    # document by the indexer, one softmax over them.
    return deepseek_sparse_reference(q, k, v, qi, w, ki, top_k=3, causal=True,
                                     kv_mask=jnp.asarray(REAL), segment_ids=jnp.asarray(SEG))


# The kinds whose extra inputs are per token (sliced per document, cleaned of padding).
_PER_TOKEN = {"fox", "realformer", "realformer_tiled", "lazy", "predictive", "dsa"}


def _extras(name):
    key = jax.random.PRNGKey(11)
    if name == "learned_sinks":
        return (jnp.float32(0.3),)
    if name == "differential":
        return (jnp.float32(0.4),)
    if name == "fox":
        log_f = jax.nn.log_sigmoid(jax.random.normal(key, (L,)) + 1.0)
        return (jnp.where(jnp.asarray(REAL), log_f, jnp.nan),)
    if name == "gaussian_prior":
        w_p, u_p, u_d = A.init_gaussian_window(key, D)
        return (w_p, 2.0 * u_p, u_d)
    if name == "distance_prior":
        return (jnp.float32(0.3), jnp.float32(-0.2))
    if name.startswith("talking_heads"):
        return (jnp.asarray([[1.0, 0.4], [-0.3, 0.8]]), jnp.asarray([[0.9, 0.2], [0.5, -0.7]]))
    if name in ("realformer", "realformer_tiled", "lazy", "predictive"):
        q1, k1 = jax.random.normal(key, (2, L, D))
        return (q1, jnp.where(jnp.asarray(REAL)[:, None], k1, jnp.nan))
    if name == "lowrank_band":
        w_q, w_k, _ = A.init_lowrank_band(key, D, 3)
        return (w_q, w_k, jnp.float32(0.4))
    if name == "dsa":
        k1, k2, k3 = jax.random.split(key, 3)
        return (jax.random.normal(k1, (L, 2, 4)), jax.random.normal(k2, (L, 2)),
                jax.random.normal(k3, (L, 4)))
    if name == "adaptive_span":
        return (jnp.float32(2.5),)
    if name == "average":
        w, b = A.init_average_gate(key, D, D)
        return (w, 0.1 + b)
    if name == "collaborative":
        return (1.0 + 0.5 * jax.random.normal(key, (2, D)),)
    return ()


KINDS = {
    "softcap": (_softcap_fn, _softcap_ref),
    "learned_sinks": (_sinks_fn, _sinks_ref),
    "streaming": (_streaming_fn, _streaming_ref),
    "streaming_kind": (_streaming_kind_fn, _streaming_ref),
    "differential": (_differential_fn, _differential_ref),
    "fox": (_fox_fn, _fox_ref),
    "per_head_block_sparse": (_per_head_fn, _per_head_ref),
    "gaussian_prior": (_gaussian_fn, _gaussian_ref),
    "distance_prior": (_distance_fn, _distance_ref),
    "hardcoded_gaussian": (_hardcoded_fn, _hardcoded_ref),
    "talking_heads": (_talking_fn("tiled"), _talking_ref),
    "talking_heads_dense": (_talking_fn("dense"), _talking_ref),
    "collaborative": (_collaborative_fn, _collaborative_ref),
    "multiscale": (_multiscale_fn, _multiscale_ref),
    "average": (_average_fn, _average_ref),
    "realformer": (_realformer_fn, _realformer_ref),
    "realformer_tiled": (_realformer_tiled_fn, _realformer_ref),
    "lazy": (_lazy_fn, _lazy_ref),
    "predictive": (_predictive_fn, _predictive_ref),
    "entmax": (_sparsemax_fn, _sparsemax_ref),
    "topk": (_topk_fn, _topk_ref),
    "adaptive_span": (_span_fn, _span_ref),
    "lowrank_band": (_lowrank_band_fn, _lowrank_band_ref),
    "dsa": (_dsa_fn, _dsa_ref),
}


def _weights():
    # A fixed projection of the real outputs: the loss whose gradients are compared.
    return jnp.where(jnp.asarray(REAL)[:, None], jax.random.normal(jax.random.PRNGKey(3),
                                                                   (L, D)), 0.0)


@functools.cache
def _run(name):
    fn, ref = KINDS[name]
    q, k, v = _inputs()
    extra = _extras(name)
    per_token = name in _PER_TOKEN
    seg, mask = jnp.asarray(SEG), jnp.asarray(REAL)

    def run(q, k, v, extra):
        w = _weights()

        def packed(q, k, v, extra):
            out = fn(q, k, v, seg, mask, *extra)
            return jnp.sum(jnp.where(mask[:, None], out, 0.0) * w), out

        def dense(q, k, v, extra):
            out = ref(*_clean(q, k, v), *(_clean(*extra) if per_token else extra))
            return jnp.sum(jnp.where(mask[:, None], out, 0.0) * w), out

        argnums = (0, 1, 2, 3)
        (_, out), grads = jax.value_and_grad(packed, argnums, has_aux=True)(q, k, v, extra)
        (_, want), want_grads = jax.value_and_grad(dense, argnums, has_aux=True)(q, k, v, extra)
        alone = [fn(q[s:s + n], k[s:s + n], v[s:s + n], None, None,
                    *(e[s:s + n] if per_token else e for e in extra))
                 for s, n in zip(STARTS, DOCS)]
        return out, grads, want, want_grads, alone

    return jax.tree.map(np.asarray, jit0(run)(q, k, v, extra))


def _real(x):
    return x[REAL] if np.ndim(x) and x.shape[0] == L else x


@pytest.mark.parametrize("name", sorted(KINDS))
def test_packed_rows_equal_the_dense_definition(name):
    out, grads, want, want_grads, _ = _run(name)
    assert_close(out[REAL], want[REAL], EXACT, jnp.float32,
                 err_msg=f"{name}: outputs with segment ids")
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(jax.tree.map(_real, grads))), \
        f"{name}: NaN padding reached a gradient of a real position"
    assert_close(jax.tree.map(_real, grads), jax.tree.map(_real, want_grads), EXACT_GRAD,
                 jnp.float32, err_msg=f"{name}: gradients with segment ids")


@pytest.mark.parametrize("name", sorted(KINDS))
def test_packed_rows_equal_each_document_alone(name):
    out, _, _, _, alone = _run(name)
    for (s, n), one in zip(zip(STARTS, DOCS), alone):
        assert_close(out[s:s + n], one, EXACT, jnp.float32,
                     err_msg=f"{name}: document at {s}..{s + n - 1}")


def test_document_offsets_restart_at_every_document():
    np.testing.assert_array_equal(np.asarray(A.document_offsets(jnp.asarray(SEG))), _offsets())
    with pytest.raises(ValueError, match=r"int\[L\].*float32\(16, 2\)"):
        A.document_offsets(jnp.zeros((L, 2)))


@pytest.mark.parametrize("hp,match", [
    ({"kind": "fixed"}, "'fixed' Sparse Transformer heads read absolute positions"),
    ({"heads": A.patterns.PerHead((A.patterns.Local(2, 0), A.patterns.BlockLocal(4)))},
     r"patterns \['BlockLocal'\] depend on absolute positions")])
def test_per_head_patterns_of_absolute_positions_refuse_packing(hp, match):
    kind = nn.get_kind("attention", "per_head_block_sparse")
    resolved = kind.resolve({"stride": 4, **hp})
    assert kind.segment_problem(resolved) is not None
    assert re.search(match, kind.segment_problem(resolved))
    assert kind.segment_problem(kind.resolve({"stride": 4})) is None


_P = A.patterns
OFFSET_PATTERNS = [_P.Full(), _P.Causal(), _P.Local(3, 1), _P.Strided(4), _P.Strided(3, "local"),
                   _P.Strided(3, "strided"), _P.Dilated(2, 1, 3), _P.Local(2, 0) | _P.Strided(5),
                   _P.Local(4, 4) & _P.Causal(), _P.LogSparse(), _P.LogSparse(2)]
ABSOLUTE_PATTERNS = [_P.BlockLocal(4), _P.Fixed(4, 1), _P.Global((0, 5)),
                     _P.Local(2, 0) | _P.Global((0,)), _P.LogSparse(subsequence=8)]


@pytest.mark.parametrize("pattern", OFFSET_PATTERNS + ABSOLUTE_PATTERNS, ids=repr)
def test_a_pattern_claims_offsets_only_exactly_when_its_mask_is_one_of_offsets(pattern):
    # mask(i, j) a function of i - j alone <=> the dense mask is constant along diagonals.
    n = 40
    m = np.asarray(pattern.dense(n, n))
    toeplitz = bool(np.all(m[1:, 1:] == m[:-1, :-1]))
    assert pattern.offsets_only == toeplitz, (pattern, toeplitz)


@pytest.mark.parametrize("name", ["dot_product", "flash", "block_sparse"])
def test_pattern_kinds_pack_with_patterns_of_offsets_only(name):
    kind = nn.get_kind("attention", name)
    assert kind.segment_problem(kind.resolve({"pattern": _P.Local(3, 0) | _P.Strided(4)})) is None
    problem = kind.segment_problem(kind.resolve({"pattern": _P.Local(2, 0) | _P.Global((0,))}))
    assert problem is not None and "its pattern Union depends on absolute positions" in problem


@pytest.mark.parametrize("stage", ["sparse", "dense"])
def test_the_indexer_loss_of_a_packed_row_is_each_documents_own(stage):
    # DeepSeek sparse attention's auxiliary loss, per query: KL from the main attention to the
    # indexer over the chosen keys (the dense warm-up: every key) of the query's own
    # document, as the document alone.
    q, k, _ = _inputs(1)
    qi, w, ki = _extras("dsa")
    seg, mask = jnp.asarray(SEG), jnp.asarray(REAL)

    def run(q, k, qi, w, ki):
        def kl(q, k, qi, w, ki, **rows):
            bits = None if stage == "dense" else A.lightning_indexer(
                qi, w, ki, top_k=3, causal=True, chunk=TILE, return_bits=True, **rows)[2]
            return A.indexer_alignment_loss(q[:, None], k[:, None], qi, w, ki, bits,
                                            causal=True, chunk=TILE, **rows)

        alone = [kl(*(a[s:s + n] for a in (q, k, qi, w, ki))) for s, n in zip(STARTS, DOCS)]
        return kl(q, k, qi, w, ki, kv_mask=mask, segment_ids=seg), alone

    packed, alone = jax.tree.map(np.asarray, jit0(run)(q, k, qi, w, ki))
    for (s, n), one in zip(zip(STARTS, DOCS), alone):
        assert_close(packed[s:s + n], one, EXACT, jnp.float32,
                     err_msg=f"indexer KL ({stage}): document at {s}..{s + n - 1}")


def test_forget_gates_restart_at_each_document():
    # The gates' sums restart per document: after a document that forgets hard (log f = -3000
    # per token, c near -18000, where float32 steps by 2e-3), the next document's decays
    # c_i - c_j are its own numbers, not differences of two large row-long sums.
    q, k, v = _inputs(2)
    log_f = jnp.where(jnp.asarray(SEG) == 1, -3000.0, _extras("fox")[0])
    seg, mask = jnp.asarray(SEG), jnp.asarray(REAL)

    def run(q, k, v, log_f):
        alone = [_fox_fn(*(a[s:s + n] for a in (q, k, v)), None, None, log_f[s:s + n])
                 for s, n in zip(STARTS, DOCS)]
        return _fox_fn(q, k, v, seg, mask, log_f), alone

    packed, alone = jax.tree.map(np.asarray, jit0(run)(q, k, v, log_f))
    for (s, n), one in zip(zip(STARTS, DOCS), alone):
        assert_close(packed[s:s + n], one, EXACT, jnp.float32,
                     err_msg=f"fox: document at {s}..{s + n - 1} after a hard-forgetting one")
