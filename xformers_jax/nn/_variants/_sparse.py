"""Registry entries of the fixed-pattern sparse family (:mod:`xformers_jax.attention.sparse`).

These kinds need more than one per-head function of q, k, v:

* ``per_head_block_sparse``: a different block-sparse pattern per head (Sparse Transformer's
  factorised heads, T1 3.2.4; BlockBERT, P 4.1 Eq 14).
* ``axial``: attention along one axis of a ``shape``-d input flattened in raster order (Ho et
  al.; T1 3.2.5, L 4.1.1.3), e.g. pixels. With ``axis=None`` head ``h`` attends along axis
  ``h % len(shape)``, so one layer covers every axis (the Axial Transformer alternates axes
  over layers instead; a stack shares one spec, so the heads split the axes here).
* ``longformer`` (T1 3.2.6): sliding window plus global tokens whose rows use separate global
  projections ``Q_g, K_g, V_g`` of the block input (the variant's own parameters).
* ``etc`` (T1 3.2.7): the first ``num_global`` positions are ETC's global input (prepend them,
  e.g. one summary token per sentence); they get their own projections and attend to
  everything, while the long input attends to a ``radius`` window and every global token.
  Encoder only, as in the paper.

Longformer's and ETC's global projections see the block input, so they run in self-attention
only, and a ``"qk"`` position scheme (RoPE) rotates the ordinary projections, not the global
ones. None of these kinds decodes with a cache.

Padding: each query's output here depends on that query alone (its pattern, axis or global
role is fixed by position), so the adapters take ``q_mask`` and need nothing from it.

Grouped-query heads: every call goes through ``multihead``, whose query-head groups share
their key/value head without copying it. Where heads differ in a static setting (a pattern or
an axis), each set of heads runs as its own ``multihead`` call (:func:`_head_sets`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ... import attention as A
from ...attention import patterns as P
from ...attention.sparse._kinds import KINDS
from .._registry import Variant, register_variant

_KIND = {k.name: k for k in KINDS}


def _head_sets(query_heads, num_heads, num_kv_heads):
    """Splits the query heads ``query_heads`` into ``(q_idx, kv_idx)`` runs that ``multihead``
    can take without copying a key/value head: within a run every kv head in ``kv_idx`` serves
    the same number of the run's query heads, which are listed kv head by kv head."""
    groups = num_heads // num_kv_heads
    owner = {}
    for h in sorted(query_heads):
        owner.setdefault(h // groups, []).append(h)
    by_count: dict[int, list[int]] = {}
    for j, hs in owner.items():
        by_count.setdefault(len(hs), []).append(j)
    return [(np.asarray([h for j in js for h in owner[j]]), np.asarray(js))
            for js in by_count.values()]


def _per_head_sets(q, k, v, head_sets, run):
    """``run(s, q_s, k_s, v_s) -> [B, Lq, |q_idx|, Dv]`` for every set ``s`` of ``head_sets``
    (each a list of query heads), run on the key/value heads it needs (no copies); the outputs
    are put back in head order."""
    parts, order = [], []
    for s, heads in enumerate(head_sets):
        for q_idx, kv_idx in _head_sets(heads, q.shape[2], k.shape[2]):
            parts.append(run(s, q[:, :, q_idx], k[:, :, kv_idx], v[:, :, kv_idx]))
            order.extend(q_idx.tolist())
    return jnp.concatenate(parts, axis=2)[:, :, np.argsort(order)]


def _check_heads(kind, hp, num_heads, make):
    heads = hp["heads"] if "heads" in hp else make(num_heads)
    if heads.num_heads != num_heads:
        raise ValueError(
            f"attention kind {kind!r}: PerHead has {heads.num_heads} patterns but the module "
            f"has {num_heads} heads"
        )
    return heads


# --- per-head block-sparse patterns (T1 3.2.4; P 4.1) ----------------------------------------

def _sparse_transformer_heads(hp):
    return lambda n: P.PerHead.sparse_transformer(n, hp["stride"], hp.get("kind", "strided"),
                                                  hp.get("c", 1))


def _per_head_init(key, hp, *, num_heads, head_dim, max_len):
    if "heads" not in hp and "stride" not in hp:
        raise ValueError("attention kind 'per_head_block_sparse': give `heads` (a PerHead) or "
                         "`stride` (Sparse Transformer heads, with `kind` 'strided' or 'fixed')")
    _check_heads("per_head_block_sparse", hp, num_heads, _sparse_transformer_heads(hp))
    return None


def _per_head(q, k, v, params, *, causal, kv_mask, bias, key, heads=None, stride=None,
              kind="strided", c=1, q_mask=None, **kw):
    # The heads sharing a pattern run together, as in per_head_block_sparse_attention.
    hp = {"stride": stride, "kind": kind, "c": c} if heads is None else {"heads": heads}
    heads = _check_heads("per_head_block_sparse", hp, q.shape[2], _sparse_transformer_heads(hp))
    groups = list(heads.groups())

    def run(s, qs, ks, vs):
        f = A.multihead(lambda *a, **k_: A.block_sparse_attention(*a, groups[s][0], **k_))
        return f(qs, ks, vs, causal=causal, kv_mask=kv_mask, **kw)

    return _per_head_sets(q, k, v, [list(idx) for _, idx in groups], run)


register_variant(Variant.from_kind(
    _KIND["per_head_block_sparse"], _per_head, init=_per_head_init,
    hyperparameters={"heads", "stride", "kind", "c", "block_q", "block_k", "implementation"},
))


# --- axial (T1 3.2.5; L 4.1.1.3) --------------------------------------------------------------

def _axial_init(key, hp, *, num_heads, head_dim, max_len):
    if "shape" not in hp:
        raise ValueError("attention kind 'axial': give `shape`, the input's shape, e.g. "
                         "(height, width)")
    if hp.get("axis") is None and num_heads < len(hp["shape"]):
        raise ValueError(f"attention kind 'axial': axis=None spreads the {len(hp['shape'])} axes "
                         f"over the heads, but there are only {num_heads} heads")
    return None


def _axial(q, k, v, params, *, causal, kv_mask, bias, key, shape, axis=None, q_mask=None,
           **kw):
    axes = [axis] if axis is not None else sorted({h % len(shape) for h in range(q.shape[2])})
    sets = [list(range(q.shape[2])) if axis is not None else
            [h for h in range(q.shape[2]) if h % len(shape) == a] for a in axes]

    def run(s, qs, ks, vs):
        f = A.multihead(functools.partial(A.axial_attention, shape=shape, axis=axes[s]))
        return f(qs, ks, vs, causal=causal, kv_mask=kv_mask, **kw)

    return _per_head_sets(q, k, v, sets, run)


register_variant(Variant.from_kind(
    _KIND["axial"], _axial, init=_axial_init,
    hyperparameters={"shape", "axis", "block_q", "block_k", "implementation"},
))


# --- Longformer and ETC global projections (T1 3.2.6-3.2.7) ----------------------------------

def _global_projections(key, hp, *, num_heads, head_dim, max_len, dim):
    keys = jax.random.split(key, 3)
    return tuple(jax.random.normal(k, (dim, num_heads * head_dim)) / math.sqrt(dim)
                 for k in keys)


def _project(inputs, params, heads):
    """The global projections of ``inputs [B, L, dim]``, as ``[B, H, L, D]`` (laid out
    ``"batch_heads"`` for ``multihead``)."""
    b, length = inputs.shape[:2]
    return tuple(jnp.moveaxis((inputs @ w.astype(inputs.dtype)).reshape(b, length, heads, -1),
                              2, 1) for w in params)


def _longformer(q, k, v, params, *, causal, kv_mask, bias, key, inputs, window,
                global_tokens, dilation=1, q_mask=None, **kw):
    f = A.multihead(functools.partial(A.longformer_attention, window=window, dilation=dilation,
                                      global_tokens=global_tokens, **kw),
                    arg_axes=("batch_heads",) * 3)
    return f(q, k, v, *_project(inputs, params, q.shape[2]), causal=causal, kv_mask=kv_mask)


register_variant(Variant.from_kind(
    _KIND["longformer"], _longformer, init=_global_projections, takes_input=True,
    hyperparameters={"window", "global_tokens", "dilation", "block_q", "block_k"},
))


def _etc(q, k, v, params, *, causal, kv_mask, bias, key, inputs, num_global, radius,
         q_mask=None, **kw):
    g, length = num_global, q.shape[1]
    if not 0 < g < length:
        raise ValueError(f"attention kind 'etc': num_global={g} must be in [1, {length}) for a "
                         f"sequence of length {length}")
    masks = {} if kv_mask is None else {"kv_mask": kv_mask[:, g:],
                                        "global_kv_mask": kv_mask[:, :g]}
    f = A.multihead(functools.partial(A.etc_attention, radius=radius, **kw),
                    arg_axes=("batch_heads",) * 3, kwarg_axes={"global_kv_mask": "batch"})
    local, glob = f(q[:, g:], k[:, g:], v[:, g:],
                    *_project(inputs[:, :g], params, q.shape[2]), **masks)
    return jnp.concatenate([jnp.moveaxis(glob, 1, 2), local], axis=1)


register_variant(Variant.from_kind(
    _KIND["etc"], _etc, init=_global_projections, takes_input=True,
    hyperparameters={"num_global", "radius", "block_q", "block_k"},
))
