"""The softmax kinds published since the surveys as :class:`~xformers_jax.kinds.Kind` records,
with their adapters: differential attention, forgetting attention (``fox``, and ``fox_pro``
with the Pro block's token shift, QK-norm, output norm and output gate), multi-head latent
attention, MoBA, native sparse attention, DeepSeek sparse attention and PaTH attention.

Each decodes over a growing cache (``KVDecoding``) with its own attention over it (its
``attend`` hook): two softmax maps (differential), the latent with ``W_UK`` and ``W_UV``
absorbed (MLA, whose cache holds the latent and the rotary key, not per-head keys and
values), the forget-gate decay (forgetting attention, whose cache also holds each token's log
forget gate per query head; FoX Pro's holds the keys and values before the shift, with each
token's shift weights, and shifts and normalises them again at each step), the blocks or
tokens one query chooses (MoBA, NSA, DSA: the forward pass's choice at that position,
computed over the cache; DSA's cache also holds each token's indexer key). PaTH decodes over
plain softmax, its cached keys rewritten by each new token's Householder transform
(``update``), its cache holding beside each key the token's direction before the short
convolution (the next steps' convolutions read it).

Forgetting attention's gates (and FoX Pro's shifts and output gates), NSA's gates, DSA's
indexer and PaTH's transforms are computed from the block input (``takes_input``), so these
run in self-attention only. PaTH's transforms, like FoX Pro's shifts, are per key/value head:
with grouped-query attention a group's query heads share them with the keys.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ...kinds import AttentionAdapter, Kind, KVDecoding, Paper
from .._adapters import IMPLEMENTATION, TILES, lifted, real_only
from .._dense import dot_product_attention
from .._exact import flash_attention
from .._flex import document_offsets
from .._multihead import multihead
from .._short_conv import causal_depthwise_conv, causal_depthwise_step
from ._differential import differential_attention, differential_lambda, lambda_init_for
from ._dsa import (deepseek_sparse_attention, deepseek_sparse_tiled, indexer_alignment_loss,
                   lightning_indexer)
from ._fox import forgetting_attention, forgetting_decode_step
from ._fox_pro import head_rms_norm, token_shift
from ._mla import multi_head_latent_attention, rotary
from ._moba import moba_attention, moba_reference
from ._nsa import native_sparse_attention, native_sparse_reference
from ._path import path_attention, path_update_keys

_DIFF_PAPER = Paper("Ye et al.", 2024, "Differential Transformer")
_FOX_PAPER = Paper("Lin et al.", 2025, "Forgetting Transformer: Softmax Attention with a Forget "
                   "Gate")
_MLA_PAPER = Paper("DeepSeek-AI", 2024, "DeepSeek-V2: A Strong, Economical, and Efficient "
                   "Mixture-of-Experts Language Model")
_MOBA_PAPER = Paper("Lu et al.", 2025, "MoBA: Mixture of Block Attention for Long-Context LLMs")
_NSA_PAPER = Paper("Yuan et al.", 2025, "Native Sparse Attention: Hardware-Aligned and Natively "
                   "Trainable Sparse Attention")
_DSA_PAPER = Paper("DeepSeek-AI", 2025, "DeepSeek-V3.2-Exp: Boosting Long-Context Efficiency "
                   "with DeepSeek Sparse Attention")

_PATH_PAPER = Paper("Yang et al.", 2025, "PaTH Attention: Position Encoding via Accumulating "
                    "Householder Transformations")

_TILES = {**TILES, **IMPLEMENTATION}


# -- differential attention -----------------------------------------------------------------------

def _diff_init(key, hp, *, num_heads, head_dim, max_len):
    if head_dim % 2:
        raise ValueError(f"attention kind 'differential': head_dim={head_dim} must be even (the "
                         "query and key split into two halves)")
    keys = jax.random.split(key, 4)
    # The paper's initialisation of the four lambda vectors: N(0, 0.1^2), shared by the heads.
    return {n: 0.1 * jax.random.normal(k, (head_dim // 2,))
            for n, k in zip(("lq1", "lk1", "lq2", "lk2"), keys)}


def _diff_attend(q, k, v, params, *, causal, kv_mask, bias, key, q_mask=None, segment_ids=None,
                 layer_index=1, block_q=None, block_k=None, implementation=None):
    lambda_init = lambda_init_for(layer_index)
    lam = differential_lambda(params["lq1"], params["lk1"], params["lq2"], params["lk2"],
                              lambda_init)
    fn = functools.partial(differential_attention, lambda_init=lambda_init, block_q=block_q,
                           block_k=block_k, implementation=implementation)
    return multihead(fn, arg_axes=(None,))(q, k, v, lam, causal=causal, kv_mask=kv_mask,
                                           segment_ids=segment_ids)


def _diff_decode(q, k, v, params, *, valid, index, **hp):
    return _diff_attend(q, k, v, params, causal=False, kv_mask=valid, bias=None, key=None, **hp)


# -- forgetting attention ------------------------------------------------------------------------

def _fox_init(key, hp, *, num_heads, head_dim, max_len, dim, num_kv_heads):
    # f_t = sigmoid(w_f^T x_t + b_f), one gate per head (the paper's Eq. 5).
    return {"w_f": _normal(key, (dim, num_heads), dim),
            "b_f": jnp.full((num_heads,), hp["gate_bias_init"], jnp.float32)}


def _fox_log_gates(inputs, params):
    """``log f [B, L, H]`` in float32 from the block input ``[B, L, dim]``."""
    g = inputs @ params["w_f"].astype(inputs.dtype)
    return jax.nn.log_sigmoid(g.astype(jnp.float32) + params["b_f"].astype(jnp.float32))


def _fox_attend(q, k, v, params, *, causal, kv_mask, bias, key, inputs, q_mask=None,
                segment_ids=None, block_q=None, block_k=None, implementation=None):
    log_f = jnp.moveaxis(_fox_log_gates(real_only(kv_mask, inputs), params), -1, 1)
    fn = functools.partial(forgetting_attention, block_q=block_q, block_k=block_k,
                           implementation=implementation)
    return multihead(fn, arg_axes=("batch_heads",))(q, k, v, log_f, causal=causal,
                                                    kv_mask=kv_mask, segment_ids=segment_ids)


def _fox_entry(inputs, k, v, params, *, position, block_q=None, block_k=None,
               implementation=None):
    # Beside its value, each key/value head keeps the token's log gate of every query head of
    # its group (heads h = g G .. g G + G - 1 read kv head g).
    log_f = _fox_log_gates(inputs, params)
    log_f = log_f.reshape(*v.shape[:3], -1)
    return k, jnp.concatenate([v, log_f.astype(v.dtype)], -1)


def _fox_widths(hp, *, num_heads, num_kv_heads, head_dim):
    return num_kv_heads, head_dim, head_dim + num_heads // num_kv_heads


def _fox_decode(q, k, v_g, params, *, valid, index, inputs, block_q=None, block_k=None,
                implementation=None):
    b, c, hkv, _ = k.shape
    groups = q.shape[2] // hkv
    v, log_f = v_g[..., :-groups], v_g[..., -groups:].reshape(b, c, hkv * groups)
    return multihead(forgetting_decode_step, arg_axes=("batch_heads",),
                     kwarg_axes={"valid": "batch"})(q, k, v, jnp.moveaxis(log_f, -1, 1),
                                                    valid=valid)


# -- forgetting attention with the Pro block's components ----------------------------------------

_FOX_PRO_PARTS = ("kv_shift", "qk_norm", "output_norm", "output_gate")


def _fox_pro_init(key, hp, *, num_heads, head_dim, max_len, dim, num_kv_heads):
    kf, ks, kg = jax.random.split(key, 3)
    params = _fox_init(kf, hp, num_heads=num_heads, head_dim=head_dim, max_len=max_len,
                       dim=dim, num_kv_heads=num_kv_heads)
    if hp["kv_shift"]:  # alpha_t = sigmoid(w^T x_t) per key/value head, keys' and values'
        params["w_shift"] = _normal(ks, (dim, num_kv_heads, 2), dim)
    if hp["qk_norm"]:
        params["q_scale"] = jnp.ones((num_heads, head_dim))
        params["k_scale"] = jnp.ones((num_kv_heads, head_dim))
    if hp["output_norm"]:
        params["o_scale"] = jnp.ones((num_heads, head_dim))
    if hp["output_gate"]:
        params["w_gate"] = _normal(kg, (dim, num_heads, head_dim), dim)
    return params


def _fox_pro_shifts(inputs, params):
    """``alpha [B, L, Hkv, 2]`` float32: the token shift's weights of keys and values."""
    a = jnp.einsum("bld,dhs->blhs", inputs, params["w_shift"].astype(inputs.dtype))
    return jax.nn.sigmoid(a.astype(jnp.float32))


def _fox_pro_heads(q, k, v, alpha, params, *, segment_ids=None, kv_shift, qk_norm):
    """The queries, keys and values forgetting attention takes: keys and values token-shifted
    (``alpha [B, L, Hkv, 2]``), then queries and keys RMS-normalised per head; in q's dtype."""
    dt = q.dtype
    if kv_shift:
        k = token_shift(k, alpha[..., 0], segment_ids)
        v = token_shift(v, alpha[..., 1], segment_ids)
    if qk_norm:
        q, k = head_rms_norm(q, params["q_scale"]), head_rms_norm(k, params["k_scale"])
    return q.astype(dt), k.astype(dt), v.astype(dt)


def _fox_pro_output(o, inputs, params, *, output_norm, output_gate):
    """Each head's output RMS-normalised, then gated by ``sigmoid(W_g x_t)``."""
    dt = o.dtype
    if output_norm:
        o = head_rms_norm(o, params["o_scale"])
    if output_gate:
        g = jnp.einsum("bld,dhe->blhe", inputs, params["w_gate"].astype(inputs.dtype))
        o = o * jax.nn.sigmoid(g.astype(jnp.float32))
    return o.astype(dt)


def _fox_pro_attend(q, k, v, params, *, causal, kv_mask, bias, key, inputs, q_mask=None,
                    segment_ids=None, kv_shift=True, qk_norm=True, output_norm=True,
                    output_gate=True, block_q=None, block_k=None, implementation=None):
    x = real_only(kv_mask, inputs)
    # Self-attention: a padded token is out of the shift, the norms and the gates alike.
    q, k, v = real_only(kv_mask, q, k, v)
    alpha = _fox_pro_shifts(x, params) if kv_shift else None
    q, k, v = _fox_pro_heads(q, k, v, alpha, params, segment_ids=segment_ids,
                             kv_shift=kv_shift, qk_norm=qk_norm)
    o = _fox_attend(q, k, v, params, causal=causal, kv_mask=kv_mask, bias=bias, key=key,
                    inputs=inputs, segment_ids=segment_ids, block_q=block_q, block_k=block_k,
                    implementation=implementation)
    return _fox_pro_output(o, x, params, output_norm=output_norm, output_gate=output_gate)


def _fox_pro_widths(hp, *, num_heads, num_kv_heads, head_dim):
    # The cache holds the projected keys and values before the shift and the norm (each step
    # shifts and normalises them again: no cached entry changes), and beside each value its
    # token's two shift weights and the log gate of every query head of its group.
    shift = 2 if hp["kv_shift"] else 0
    return num_kv_heads, head_dim, head_dim + shift + num_heads // num_kv_heads


def _fox_pro_entry(inputs, k, v, params, *, position, kv_shift=True, **hp):
    k, v_g = _fox_entry(inputs, k, v, params, position=position)
    if not kv_shift:
        return k, v_g
    d = v.shape[-1]
    alpha = _fox_pro_shifts(inputs, params).astype(v.dtype)
    return k, jnp.concatenate([v_g[..., :d], alpha, v_g[..., d:]], -1)


def _fox_pro_decode(q, k, v_x, params, *, valid, index, inputs, kv_shift=True, qk_norm=True,
                    output_norm=True, output_gate=True, block_q=None, block_k=None,
                    implementation=None):
    # Slot s holds position s: the shift over the slots is the forward pass's (slot 0 mixes in
    # zeros), recomputed each step from the cached projections, O(C D) as the attention is.
    d = q.shape[-1]
    shift = 2 if kv_shift else 0
    v, alpha, log_f = v_x[..., :d], v_x[..., d:d + shift], v_x[..., d + shift:]
    q, k, v = _fox_pro_heads(q, k, v, alpha.astype(jnp.float32), params, kv_shift=kv_shift,
                             qk_norm=qk_norm)
    o = _fox_decode(q, k, jnp.concatenate([v, log_f.astype(v.dtype)], -1), params,
                    valid=valid, index=index, inputs=inputs)
    return _fox_pro_output(o, inputs, params, output_norm=output_norm,
                           output_gate=output_gate)


# -- multi-head latent attention -----------------------------------------------------------------

def _mla_sizes(name, head_dim, latent_dim, rope_dim):
    latent_dim = 4 * head_dim if latent_dim is None else latent_dim
    rope_dim = head_dim // 2 if rope_dim is None else rope_dim
    if not (0 < rope_dim < head_dim and rope_dim % 2 == 0) or latent_dim <= 0:
        raise ValueError(f"attention kind {name!r}: needs 0 < rope_dim < head_dim, rope_dim even "
                         f"and latent_dim > 0; got head_dim={head_dim}, rope_dim={rope_dim}, "
                         f"latent_dim={latent_dim}")
    return latent_dim, rope_dim


def _normal(key, shape, fan_in):
    return jax.random.normal(key, shape) / jnp.sqrt(fan_in)


def _mla_init(key, hp, *, num_heads, head_dim, max_len, dim, num_kv_heads):
    d_c, d_r = _mla_sizes("mla", head_dim, hp["latent_dim"], hp["rope_dim"])
    ks = jax.random.split(key, 6)
    params = {"w_dkv": _normal(ks[0], (dim, d_c), dim),
              "w_kr": _normal(ks[1], (dim, d_r), dim),
              "w_uk": _normal(ks[2], (num_heads, d_c, head_dim - d_r), d_c),
              "w_uv": _normal(ks[3], (num_heads, d_c, head_dim), d_c)}
    d_cq = hp["q_latent_dim"]
    if d_cq is not None:
        params["w_dq"] = _normal(ks[4], (dim, d_cq), dim)
        params["w_uq"] = _normal(ks[5], (d_cq, num_heads * head_dim), d_cq)
    return params


def _mla_query(inputs, q, params, positions, rope_base):
    """The heads' queries ``[B, L, H, d_nope + d_R]``, the rotary part rotated: the layer's
    ``q`` projection, or with query compression ``(x W_DQ) W_UQ``."""
    if "w_dq" in params:
        dt = inputs.dtype
        q = ((inputs @ params["w_dq"].astype(dt)) @ params["w_uq"].astype(dt)).reshape(q.shape)
    d_r = params["w_kr"].shape[1]
    return jnp.concatenate([q[..., :-d_r], rotary(q[..., -d_r:], positions[..., None],
                                                  rope_base)], -1)


def _mla_latent(inputs, params, positions, rope_base):
    """``(c_KV [B, L, 1, d_c], k_R [B, L, 1, d_R])``: what a token contributes to the cache."""
    dt = inputs.dtype
    c = inputs @ params["w_dkv"].astype(dt)
    kr = rotary(inputs @ params["w_kr"].astype(dt), positions, rope_base)
    return c[:, :, None], kr[:, :, None]


def _mla_heads(q, c, kr, params, *, kv_mask, causal, absorb, block_q, block_k, implementation,
               segment_ids=None):
    fn = functools.partial(multi_head_latent_attention, absorb=absorb, block_q=block_q,
                           block_k=block_k, implementation=implementation)
    return multihead(fn, arg_axes=("heads", "heads"))(
        q, c.astype(q.dtype), kr.astype(q.dtype), params["w_uk"], params["w_uv"],
        causal=causal, kv_mask=kv_mask, segment_ids=segment_ids)


def _mla_attend(q, k, v, params, *, causal, kv_mask, bias, key, inputs, q_mask=None,
                segment_ids=None, latent_dim=None, rope_dim=None, q_latent_dim=None,
                decode_absorbed=True, rope_base=10000.0, block_q=None, block_k=None,
                implementation=None):
    # The layer's k and v projections are not MLA's: its keys and values come from the latent.
    x = real_only(kv_mask, inputs)
    # The decoupled rotary part restarts at each document of a packed row.
    pos = (jnp.arange(x.shape[1]) if segment_ids is None
           else jax.vmap(document_offsets)(segment_ids))
    c, kr = _mla_latent(x, params, pos, rope_base)
    return _mla_heads(_mla_query(x, q, params, pos, rope_base), c, kr, params, kv_mask=kv_mask,
                      causal=causal, absorb=False, block_q=block_q, block_k=block_k,
                      implementation=implementation, segment_ids=segment_ids)


def _mla_entry(inputs, k, v, params, *, position, rope_base=10000.0, **hp):
    return _mla_latent(inputs, params, jnp.reshape(position, (1,)), rope_base)


def _mla_widths(hp, *, num_heads, num_kv_heads, head_dim):
    d_c, d_r = _mla_sizes("mla", head_dim, hp["latent_dim"], hp["rope_dim"])
    return 1, d_c, d_r


def _mla_decode(q, c, kr, params, *, valid, index, inputs, decode_absorbed=True,
                rope_base=10000.0, block_q=None, block_k=None, implementation=None, **hp):
    pos = jnp.reshape(index - 1, (1,))
    return _mla_heads(_mla_query(inputs, q, params, pos, rope_base), c, kr, params,
                      kv_mask=valid, causal=False, absorb=decode_absorbed, block_q=block_q,
                      block_k=block_k, implementation=implementation)


# -- MoBA ------------------------------------------------------------------------------------------

def _moba_decode(q, k, v, params, *, valid, index, block_size=64, top_k=3, chunk=256,
                 implementation=None):
    fn = functools.partial(moba_reference, block_size=block_size, top_k=top_k, causal=True)
    return multihead(fn, kwarg_axes={"q_offset": None})(q, k, v, kv_mask=valid,
                                                        q_offset=index - 1)


# -- native sparse attention ------------------------------------------------------------------

def _nsa_init(key, hp, *, num_heads, head_dim, max_len, dim, num_kv_heads):
    # The gates' projection: sigmoid(x W_g + b_g), three gates per head (the paper's MLP, one
    # layer here).
    return {"w_g": _normal(key, (dim, num_heads, 3), dim), "b_g": jnp.zeros((num_heads, 3))}


def _nsa_gates(inputs, params):
    """``[B, H, L, 3]``: each head's branch gates (``batch_heads`` leading axes)."""
    g = jnp.einsum("bld,dhg->bhlg", inputs, params["w_g"].astype(inputs.dtype))
    return jax.nn.sigmoid(g + params["b_g"][:, None].astype(g.dtype))


def _nsa_attend(q, k, v, params, *, causal, kv_mask, bias, key, inputs, q_mask=None,
                block_size=64, num_selected=4, window=256, chunk=256, implementation=None):
    fn = functools.partial(native_sparse_attention, block_size=block_size,
                           num_selected=num_selected, window=window, chunk=chunk,
                           implementation=implementation)
    gates = _nsa_gates(real_only(kv_mask, inputs), params)
    return multihead(fn, arg_axes=("batch_heads",))(q, k, v, gates, causal=causal,
                                                    kv_mask=kv_mask)


def _nsa_decode(q, k, v, params, *, valid, index, inputs, block_size=64, num_selected=4,
                window=256, chunk=256, implementation=None):
    fn = functools.partial(native_sparse_reference, block_size=block_size,
                           num_selected=num_selected, window=window, causal=True)
    return multihead(fn, arg_axes=("batch_heads",), kwarg_axes={"q_offset": None})(
        q, k, v, _nsa_gates(inputs, params), kv_mask=valid, q_offset=index - 1)


# -- DeepSeek sparse attention ------------------------------------------------------------------

def _dsa_init(key, hp, *, num_heads, head_dim, max_len, dim, num_kv_heads):
    h, d = hp["index_heads"], hp["index_dim"]
    ks = jax.random.split(key, 3)
    return {"w_qi": _normal(ks[0], (dim, h * d), dim), "w_ki": _normal(ks[1], (dim, d), dim),
            "w_w": _normal(ks[2], (dim, h), dim)}


def _dsa_index_inputs(inputs, params, index_heads):
    """The indexer's ``(q^I [B, L, H_I, d_I], w [B, L, H_I], k^I [B, L, d_I])``."""
    dt = inputs.dtype
    qi = inputs @ params["w_qi"].astype(dt)
    qi = qi.reshape(*qi.shape[:2], index_heads, -1)
    return qi, inputs @ params["w_w"].astype(dt), inputs @ params["w_ki"].astype(dt)


def _dsa_choose(qi, w, ki, kv_mask, *, top_k, causal, chunk, q_offset=0, return_bits=False,
                segment_ids=None):
    fn = functools.partial(lightning_indexer, top_k=top_k, causal=causal, chunk=chunk,
                           q_offset=q_offset, return_bits=return_bits)
    rows = {"kv_mask": jnp.ones(ki.shape[:2], bool) if kv_mask is None else kv_mask}
    if segment_ids is not None:
        rows["segment_ids"] = segment_ids
    return jax.vmap(lambda a, b, c, r: fn(a, b, c, **r))(qi, w, ki, rows)


def _dsa_attend(q, k, v, params, *, causal, kv_mask, bias, key, inputs, q_mask=None,
                segment_ids=None, return_aux=False, top_k=2048, index_heads=4, index_dim=32,
                chunk=256, stage="sparse"):
    # The indexer reads the block input detached from the main model's graph (the paper trains
    # it by its own loss alone): no gradient reaches the input through it.
    x = jax.lax.stop_gradient(real_only(kv_mask, inputs))
    qi, w, ki = _dsa_index_inputs(x, params, index_heads)
    _dsa_stage(stage)
    if stage == "dense":  # the warm-up: dense attention, the indexer learning to match it
        bits = None
        out = multihead(functools.partial(flash_attention, causal=causal))(
            q, k, v, kv_mask=kv_mask, segment_ids=segment_ids)
    else:
        # The choice as a bit mask on the tiled kernel (deepseek_sparse_tiled says why).
        _, _, bits = _dsa_choose(qi, w, ki, kv_mask, top_k=top_k, causal=causal,
                                 chunk=chunk, return_bits=True, segment_ids=segment_ids)
        out = multihead(deepseek_sparse_tiled, arg_axes=("batch",))(
            q, k, v, bits, causal=causal, kv_mask=kv_mask, segment_ids=segment_ids)
    if not return_aux:
        return out
    loss = functools.partial(indexer_alignment_loss, causal=causal, chunk=chunk)
    real = jnp.ones(ki.shape[:2], bool) if kv_mask is None else kv_mask
    rows = {"kv_mask": real}
    if segment_ids is not None:
        rows["segment_ids"] = segment_ids
    if bits is None:
        kl = jax.vmap(lambda *a: loss(*a[:5], **a[5]))(q, k, qi, w, ki, rows)
    else:
        kl = jax.vmap(lambda *a: loss(*a[:6], **a[6]))(q, k, qi, w, ki, bits, rows)
    rows = real if q_mask is None else q_mask
    # The mean over the real queries of the batch (the paper sums over tokens; the mean keeps
    # the weight independent of the batch and length).
    mean = jnp.sum(jnp.where(rows, kl, 0.0)) / jnp.maximum(jnp.sum(rows), 1)
    return out, {"indexer_kl": mean}


def _dsa_stage(stage):
    if stage not in ("sparse", "dense"):
        raise ValueError(f"attention kind 'dsa': stage must be 'sparse' or 'dense' (the "
                         f"indexer's warm-up), got {stage!r}")


def _dsa_entry(inputs, k, v, params, *, position, top_k=2048, index_heads=4, index_dim=32,
               chunk=256, stage="sparse"):
    # The cache keeps each token's indexer key beside its values (per key/value head).
    _, _, ki = _dsa_index_inputs(inputs, params, index_heads)
    ki = jnp.broadcast_to(ki[:, :, None], (*v.shape[:3], ki.shape[-1]))
    return k, jnp.concatenate([v, ki.astype(v.dtype)], -1)


def _dsa_widths(hp, *, num_heads, num_kv_heads, head_dim):
    return num_kv_heads, head_dim, head_dim + hp["index_dim"]


def _dsa_decode(q, k, v_ki, params, *, valid, index, inputs, top_k=2048, index_heads=4,
                index_dim=32, chunk=256, stage="sparse"):
    v, ki = v_ki[..., :-index_dim], v_ki[:, :, 0, -index_dim:]
    _dsa_stage(stage)
    if stage == "dense":
        return multihead(dot_product_attention)(q, k, v, kv_mask=valid)
    qi, w, _ = _dsa_index_inputs(inputs, params, index_heads)
    idx, chosen = _dsa_choose(qi, w, ki.astype(qi.dtype), valid, top_k=top_k, causal=True,
                              chunk=chunk, q_offset=index - 1)
    return multihead(deepseek_sparse_attention, arg_axes=("batch", "batch"))(
        q, k, v, idx, chosen, causal=True, kv_mask=valid)


# -- PaTH attention ----------------------------------------------------------------------------

def _path_sizes(rank, width):
    if rank is not None and (not isinstance(rank, int) or rank <= 0):
        raise ValueError(f"attention kind 'path': w_rank must be a positive int (the low-rank "
                         f"projection's width) or None (a full linear map), got {rank!r}")
    if not isinstance(width, int) or width < 0:
        raise ValueError(f"attention kind 'path': conv_width must be an int >= 0 (the short "
                         f"convolution's taps; 0: none), got {width!r}")


def _path_init(key, hp, *, num_heads, head_dim, max_len, dim, num_kv_heads):
    # One Householder transform per key/value head (its query group shares it with the keys):
    # the direction through a rank-r projection and the short convolution, the strength
    # through a linear map with a bias (the paper's parameterisation).
    rank, width = hp["w_rank"], hp["conv_width"]
    _path_sizes(rank, width)
    ks = jax.random.split(key, 4)
    channels = num_kv_heads * head_dim
    if rank is None:
        params = {"w_w": _normal(ks[0], (dim, channels), dim)}
    else:
        params = {"w_down": _normal(ks[0], (dim, rank), dim),
                  "w_up": _normal(ks[1], (rank, channels), rank)}
    if width:
        # PyTorch's Conv1d initialisation (uniform, bound 1/sqrt(fan_in)), as Mamba's.
        params["w_conv"] = jax.random.uniform(ks[2], (width, channels), minval=-1.0,
                                              maxval=1.0) / jnp.sqrt(width)
    return {**params, "w_beta": _normal(ks[3], (dim, num_kv_heads), dim),
            "b_beta": jnp.zeros((num_kv_heads,))}


def _path_directions_in(x, params):
    """The directions before the convolution, ``[B, L, Hkv * D]`` float32, from the block input
    ``x [B, L, dim]``: ``x W_down W_up`` (or ``x W`` without the low rank)."""
    x = x.astype(jnp.float32)
    if "w_w" in params:
        return x @ params["w_w"].astype(jnp.float32)
    return (x @ params["w_down"].astype(jnp.float32)) @ params["w_up"].astype(jnp.float32)


def _path_finish(u, x, params):
    """``(w [B, L, Hkv, D], beta [B, L, Hkv])`` float32 from the convolved directions ``u [B,
    L, Hkv * D]`` and the block input: each head's ``w_t`` L2-normalised, ``beta_t = 2
    sigmoid(.)`` in ``(0, 2)`` (the paper's range, reflections included)."""
    hkv = params["b_beta"].shape[0]
    w = u.reshape(*u.shape[:2], hkv, -1)
    w = w * jax.lax.rsqrt(jnp.sum(w * w, -1, keepdims=True) + 1e-6)
    logits = x.astype(jnp.float32) @ params["w_beta"].astype(jnp.float32)
    return w, 2.0 * jax.nn.sigmoid(logits + params["b_beta"].astype(jnp.float32))


def _path_transforms(x, params, segment_ids=None):
    """PaTH's transforms from the block input ``x [B, L, dim]`` (padding already zeroed):
    ``w_t = normalise(SiLU(conv(x W_down W_up)_t))`` per key/value head, the convolution short
    and causal (``causal_depthwise_conv``: with ``segment_ids``, no tap reads another
    document; a padded token's input is zero, so a token just after padding in the middle of
    a row reads zeros there), and ``beta_t`` (:func:`_path_finish`). The SiLU after the convolution is the
    authors' (flash-linear-attention's short convolution, which the paper's layer uses)."""
    u = _path_directions_in(x, params)
    if "w_conv" in params:
        zero = jnp.zeros((u.shape[-1],), jnp.float32)
        u = jax.nn.silu(causal_depthwise_conv(u, params["w_conv"].astype(jnp.float32), zero,
                                              segment_ids))
    return _path_finish(u, x, params)


def _path_attend(q, k, v, params, *, causal, kv_mask, bias, key, inputs, q_mask=None,
                 segment_ids=None, block_size=64, group=8, conv_width=3):
    w, beta = _path_transforms(real_only(kv_mask, inputs), params, segment_ids)
    fn = functools.partial(path_attention, block_size=block_size, group=group)
    # PaTH exists causally only (a key's transforms are those of the later tokens up to the
    # query): a layer runs it causally in any model, as the delta rule's recurrence. The
    # transforms are per key/value head, shared by its query group as the keys are
    # (grouped-query attention): the keys' side of the blockwise form is computed once a group.
    return multihead(fn, arg_axes=("batch_kv_heads", "batch_kv_heads"))(
        q, k, v, jnp.moveaxis(w, 2, 1), jnp.moveaxis(beta, 2, 1), causal=True,
        kv_mask=kv_mask, segment_ids=segment_ids)


def _path_keeps_directions(conv_width):
    """Whether the cache keeps each token's direction before the convolution (the next
    ``conv_width - 1`` steps read it)."""
    return conv_width > 1


def _path_widths(hp, *, num_heads, num_kv_heads, head_dim):
    # Beside its key, a token keeps its direction before the convolution.
    extra = head_dim if _path_keeps_directions(hp["conv_width"]) else 0
    return num_kv_heads, head_dim + extra, head_dim


def _path_entry(inputs, k, v, params, *, position, conv_width=3, **hp):
    if not _path_keeps_directions(conv_width):
        return k, v
    u = _path_directions_in(inputs, params).reshape(k.shape)
    return jnp.concatenate([k, u.astype(k.dtype)], -1), v


def _path_update(k, params, *, inputs, valid, index, block_size=64, group=8, conv_width=3):
    # The paper's inference form: the new token's H_t rewrites every cached key, O(C D); its
    # direction convolves the cached directions of the last conv_width - 1 tokens with its own.
    b, _, _, width = k.shape
    d = width // 2 if _path_keeps_directions(conv_width) else width
    u = _path_directions_in(inputs, params)  # [B, 1, Hkv * D]
    if conv_width:
        history, channels = conv_width - 1, u.shape[-1]
        if history:
            past = jnp.reshape(k[..., d:], (b, k.shape[1], channels)).astype(jnp.float32)
            # Slots index - history .. index - 1 (zeros before the first token, as the
            # forward pass's convolution pads).
            past = jax.lax.dynamic_slice_in_dim(
                jnp.pad(past, ((0, 0), (history, 0), (0, 0))), index, history, axis=1)
        else:  # one tap: the token's own direction, scaled
            past = jnp.zeros((b, 0, channels), jnp.float32)
        zero = jnp.zeros((channels,), jnp.float32)
        u, _ = causal_depthwise_step(past, u[:, 0], params["w_conv"].astype(jnp.float32), zero)
        u = jax.nn.silu(u)[:, None]
    w, beta = _path_finish(u, inputs, params)
    per_head = jax.vmap(path_update_keys, in_axes=(1, 0, 0), out_axes=1)
    keys = jax.vmap(per_head)(k[..., :d], w[:, 0], beta[:, 0])
    return jnp.concatenate([keys, k[..., d:]], -1)


def _path_decode(q, k, v, params, *, valid, index, inputs, block_size=64, group=8,
                 conv_width=3):
    # The step's query over the rewritten keys by plain softmax (the directions kept beside
    # the keys are no part of them).
    return multihead(dot_product_attention)(q, k[..., :q.shape[-1]], v, kv_mask=valid)


KINDS = (
    Kind("differential", differential_attention, "modern", _DIFF_PAPER,
         time="O(L^2 D), two maps", memory="O(L D)", causal=True, decoding="kv", segments=True,
         test_hyperparameters={"block_q": 8, "block_k": 8, "layer_index": 2},
         hyperparameters={
             "layer_index": (1, ("the layer's 1-based depth l: lambda_init = 0.8 - 0.6 "
                                 "exp(-0.3 (l - 1))")),
             **_TILES},
         adapter=AttentionAdapter(_diff_attend, init=_diff_init,
                                  decoding=KVDecoding(attend=_diff_decode))),
    Kind("fox", forgetting_attention, "modern", _FOX_PAPER,
         time="O(L^2 D)", memory="O(L D)", causal=True, decoding="kv", segments=True,
         state_size="H_kv (D_k + D_v) + H per token (keys, values, a log gate per head)",
         test_hyperparameters={"block_q": 8, "block_k": 8},
         hyperparameters={
             "gate_bias_init": (0.0, ("b_f's initial value: f = sigmoid(b_f) before training "
                                      "(0: f = 1/2; larger: longer memory)")),
             **_TILES},
         adapter=AttentionAdapter(
             _fox_attend, init=_fox_init, takes_input=True, init_only={"gate_bias_init"},
             decoding=KVDecoding(attend=_fox_decode, entry=_fox_entry, widths=_fox_widths))),
    Kind("fox_pro", forgetting_attention, "modern", _FOX_PAPER,
         time="O(L^2 D)", memory="O(L D)", causal=True, decoding="kv", segments=True,
         state_size=("H_kv (D_k + D_v + 2) + H per token (the keys and values before the shift "
                     "and the norm, two shift weights and a log gate per head; each step "
                     "shifts and normalises the cache again, O(L H_kv D))"),
         test_hyperparameters={"block_q": 8, "block_k": 8},
         hyperparameters={
             "gate_bias_init": (0.0, ("b_f's initial value: f = sigmoid(b_f) before training "
                                      "(0: f = 1/2; larger: longer memory)")),
             "kv_shift": (True, ("the data-dependent token shift of keys and values, "
                                 "alpha_t k_{t-1} + (1 - alpha_t) k_t")),
             "qk_norm": (True, "RMSNorm of each head's queries and keys (learned scales)"),
             "output_norm": (True, "RMSNorm of each head's output (learned scales)"),
             "output_gate": (True, "the output gate sigmoid(W_g x_t), after the output norm"),
             **_TILES},
         adapter=AttentionAdapter(
             _fox_pro_attend, init=_fox_pro_init, takes_input=True,
             init_only={"gate_bias_init"},
             decoding=KVDecoding(attend=_fox_pro_decode, entry=_fox_pro_entry,
                                 widths=_fox_pro_widths))),
    Kind("mla", multi_head_latent_attention, "modern", _MLA_PAPER,
         time="O(L^2 D)", memory="O(L D); cache (d_c + d_R) per token",
         causal=True, decoding="kv", segments=True,
         test_hyperparameters={"latent_dim": 12, "rope_dim": 4, "block_q": 8, "block_k": 8},
         hyperparameters={
             "latent_dim": (None, ("d_c, the joint key/value latent per token (None: 4 * "
                                   "head_dim)")),
             "rope_dim": (None, ("d_R, the decoupled rotary width, taken from head_dim (None: "
                                 "head_dim // 2)")),
             "q_latent_dim": (None, ("d_c', the query latent (None: queries from the layer's "
                                     "projection, no compression)")),
             "decode_absorbed": (True, ("decode with W_UK absorbed into the query and W_UV into "
                                        "the output (False: materialise the cached keys)")),
             "rope_base": (10000.0, "base of the rotary frequencies"),
             **_TILES},
         adapter=AttentionAdapter(
             _mla_attend, init=_mla_init, takes_input=True,
             decoding=KVDecoding(attend=_mla_decode, entry=_mla_entry, widths=_mla_widths))),
    Kind("moba", moba_attention, "modern", _MOBA_PAPER,
         time="O(L k b D + L^2 D / b), k blocks of b", memory="O(L k D)",
         causal=True, decoding="kv",
         segments=lambda hp: (
             f"its key blocks are blocks of {hp['block_size']} positions of the row, gated by "
             "each block's mean-pooled key: a block straddling two documents pools both, and "
             "the block grid moves with a document's offset, so a document's block choice "
             "depends on its neighbours; train it on unpacked rows (data.pack=False)"),
         test_hyperparameters={"block_size": 4, "top_k": 2, "chunk": 8},
         hyperparameters={
             "block_size": (64, "keys per block"),
             "top_k": (3, "blocks each query attends (causal: its own and top_k - 1 chosen)"),
             "chunk": (256, "query rows per tile of one chosen key block"),
             **IMPLEMENTATION},
         adapter=AttentionAdapter(lifted(moba_attention),
                                  decoding=KVDecoding(attend=_moba_decode))),
    Kind("nsa", native_sparse_attention, "modern", _NSA_PAPER,
         time="O(L (n b + w) D + L^2 D / b), n blocks of b, window w",
         memory="O(L n D + L^2 / b)", causal=True, decoding="kv",
         segments=lambda hp: (
             f"its compressed and selected branches work on blocks of {hp['block_size']} "
             "positions of the row (compressed keys pool a block that may straddle two "
             "documents; the block grid moves with a document's offset), so a document's "
             "outputs depend on its neighbours; train it on unpacked rows (data.pack=False)"),
         test_hyperparameters={"block_size": 4, "num_selected": 2, "window": 3, "chunk": 8},
         hyperparameters={
             "block_size": (64, "tokens per compressed and selected block"),
             "num_selected": (4, ("blocks each query attends in full (causal: its own and "
                                  "num_selected - 1 chosen)")),
             "window": (256, "keys of the sliding branch"),
             "chunk": (256, "query rows per tile of one selected key block"),
             **IMPLEMENTATION},
         adapter=AttentionAdapter(_nsa_attend, init=_nsa_init, takes_input=True,
                                  decoding=KVDecoding(attend=_nsa_decode))),
    Kind("dsa", deepseek_sparse_attention, "modern", _DSA_PAPER,
         time="O(L^2 (D + H_I d_I)): the indexer, and the chosen tokens as a mask on the tiled "
              "kernel (decoding: O(L H_I d_I + k D))",
         memory="O(L k + L^2 / 8 bytes): the choice",
         causal=True, decoding="kv", segments=True,
         test_hyperparameters={"top_k": 5, "index_heads": 2, "index_dim": 4, "chunk": 8},
         hyperparameters={
             "top_k": (2048, "tokens each query attends, chosen by the lightning indexer"),
             "index_heads": (4, "H_I, the indexer's heads"),
             "index_dim": (32, "d_I, the indexer's query and key width"),
             "chunk": (256, "queries per step of the indexer and of its KL loss"),
             "stage": ("sparse", ("'sparse': attend the top_k tokens, the indexer's KL over "
                                  "them; 'dense': the warm-up, dense attention and the KL over "
                                  "every key (the paper also freezes the main model then)"))},
         adapter=AttentionAdapter(
             _dsa_attend, init=_dsa_init, takes_input=True, aux=("indexer_kl",),
             decoding=KVDecoding(attend=_dsa_decode, entry=_dsa_entry, widths=_dsa_widths))),
    Kind("path", path_attention, "modern", _PATH_PAPER,
         time="O(L^2 D + L c^2), blocks of c",
         memory="O(g L (D + c)), g query blocks at a time", causal=True, decoding="kv",
         segments=True,
         state_size="H_kv (2 D + D) per token (keys, their Householder directions before the "
                    "convolution, values; each step rewrites every cached key, O(L H_kv D))",
         test_hyperparameters={"block_size": 4, "group": 2, "w_rank": 4},
         hyperparameters={
             "block_size": (64, "positions per block (the UT form of its Householders)"),
             "group": (8, "query blocks computed together per step"),
             "w_rank": (32, ("r, the rank of the directions' projection x W_down W_up (None: "
                             "a full linear map)")),
             "conv_width": (3, ("taps of the short causal convolution over the directions "
                                "(0: none, w_t from the token alone)"))},
         adapter=AttentionAdapter(
             _path_attend, init=_path_init, takes_input=True, init_only={"w_rank"},
             decoding=KVDecoding(attend=_path_decode, entry=_path_entry, widths=_path_widths,
                                 update=_path_update))),
)
