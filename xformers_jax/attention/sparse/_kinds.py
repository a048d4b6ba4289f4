"""The fixed-pattern sparse kinds as :class:`~xformers_jax.kinds.Kind` records, with their
adapters. These kinds need more than one per-head function of q, k, v:

* ``per_head_block_sparse``: a different block-sparse pattern per head (Sparse Transformer's
  factorised heads, T1 3.2.4; BlockBERT, P 4.1 Eq 14).
* ``axial``: attention along one axis of a ``shape``-d input flattened in raster order (Ho et
  al.; T1 3.2.5, L 4.1.1.3), e.g. pixels. With ``axis=None`` head ``h`` attends along axis
  ``h % len(shape)``, so one layer covers every axis (the Axial Transformer alternates axes
  over layers instead; a stack shares one spec, so the heads split the axes here).
* ``longformer`` (T1 3.2.6): sliding window plus global tokens whose rows use separate global
  projections ``Q_g, K_g, V_g`` of the block input (the kind's own parameters).
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

from ...kinds import REQUIRED, AttentionAdapter, Kind, Paper
from .._adapters import IMPLEMENTATION, TILES, real_only
from .._exact import block_sparse_attention
from .._multihead import multihead
from ..patterns import PerHead
from ._axial import axial_attention
from ._global_tokens import etc_attention, longformer_attention
from ._per_head import per_head_block_sparse_attention


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


# --- per-head block-sparse patterns (T1 3.2.4; P 4.1) ----------------------------------------

def _heads(hp, num_heads):
    """The kind's ``PerHead``: ``heads`` if given, else Sparse Transformer heads of ``stride``;
    checked against the module's head count."""
    if hp["heads"] is None and hp["stride"] is None:
        raise ValueError("attention kind 'per_head_block_sparse': give `heads` (a PerHead) or "
                         "`stride` (Sparse Transformer heads, with `kind` 'strided' or 'fixed')")
    heads = hp["heads"]
    if heads is None:
        heads = PerHead.sparse_transformer(num_heads, hp["stride"], hp["kind"], hp["c"])
    if heads.num_heads != num_heads:
        raise ValueError(
            f"attention kind 'per_head_block_sparse': PerHead has {heads.num_heads} patterns but "
            f"the module has {num_heads} heads"
        )
    return heads


def _per_head_segments(hp):
    """Packed rows: the heads' patterns must see the same keys at every offset of the row
    (``Pattern.offsets_only``: a mask of ``i - j`` only), so that a document placed anywhere in
    a row sees, inside the segment mask, the pattern it sees alone."""
    if hp["heads"] is None:
        if hp["kind"] == "strided":
            return None
        return ("the 'fixed' Sparse Transformer heads read absolute positions (blocks and their "
                "summary columns start at multiples of the stride from the row's start, not the "
                "document's), so a packed document would not see its own pattern; use "
                "kind='strided' (offsets i - j only) or unpacked rows (data.pack=False)")
    absolute = sorted({type(p).__name__ for p in hp["heads"].patterns if not p.offsets_only})
    if absolute:
        return (f"its heads' patterns {absolute} depend on absolute positions of the row, "
                "so a packed document would not see its own pattern; heads of patterns of "
                "offsets i - j only (Local, Strided, Dilated, Causal) pack, or use unpacked rows "
                "(data.pack=False)")
    return None


def _per_head_init(key, hp, *, num_heads, head_dim, max_len):
    _heads(hp, num_heads)
    return None


def _per_head(q, k, v, params, *, causal, kv_mask, bias, key, heads=None, stride=None,
              kind="strided", c=1, q_mask=None, **kw):
    # The heads sharing a pattern run together, as in per_head_block_sparse_attention.
    hp = {"heads": heads, "stride": stride, "kind": kind, "c": c}
    groups = list(_heads(hp, q.shape[2]).groups())

    def run(s, qs, ks, vs):
        f = multihead(lambda *a, **k_: block_sparse_attention(*a, groups[s][0], **k_))
        return f(qs, ks, vs, causal=causal, kv_mask=kv_mask, **kw)

    return _per_head_sets(q, k, v, [list(idx) for _, idx in groups], run)


# --- axial (T1 3.2.5; L 4.1.1.3) --------------------------------------------------------------

def _axial_init(key, hp, *, num_heads, head_dim, max_len):
    if hp["axis"] is None and num_heads < len(hp["shape"]):
        raise ValueError(f"attention kind 'axial': axis=None spreads the {len(hp['shape'])} axes "
                         f"over the heads, but there are only {num_heads} heads")
    return None


def _axial(q, k, v, params, *, causal, kv_mask, bias, key, shape, axis=None, q_mask=None,
           **kw):
    axes = [axis] if axis is not None else sorted({h % len(shape) for h in range(q.shape[2])})
    sets = [list(range(q.shape[2])) if axis is not None else
            [h for h in range(q.shape[2]) if h % len(shape) == a] for a in axes]

    def run(s, qs, ks, vs):
        f = multihead(functools.partial(axial_attention, shape=shape, axis=axes[s]))
        return f(qs, ks, vs, causal=causal, kv_mask=kv_mask, **kw)

    return _per_head_sets(q, k, v, sets, run)


# --- Longformer and ETC global projections (T1 3.2.6-3.2.7) ----------------------------------

def _global_projections(key, hp, *, num_heads, head_dim, max_len, dim, num_kv_heads):
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
    f = multihead(functools.partial(longformer_attention, window=window, dilation=dilation,
                                    global_tokens=global_tokens, **kw),
                  arg_axes=("batch_heads",) * 3)
    inputs = real_only(kv_mask, inputs)
    return f(q, k, v, *_project(inputs, params, q.shape[2]), causal=causal, kv_mask=kv_mask)


def _etc(q, k, v, params, *, causal, kv_mask, bias, key, inputs, num_global, radius,
         q_mask=None, **kw):
    g, length = num_global, q.shape[1]
    if not 0 < g < length:
        raise ValueError(f"attention kind 'etc': num_global={g} must be in [1, {length}) for a "
                         f"sequence of length {length}")
    inputs = real_only(kv_mask, inputs)
    masks = {} if kv_mask is None else {"kv_mask": kv_mask[:, g:],
                                        "global_kv_mask": kv_mask[:, :g]}
    f = multihead(functools.partial(etc_attention, radius=radius, **kw),
                  arg_axes=("batch_heads",) * 3, kwarg_axes={"global_kv_mask": "batch"})
    local, glob = f(q[:, g:], k[:, g:], v[:, g:],
                    *_project(inputs[:, :g], params, q.shape[2]), **masks)
    return jnp.concatenate([jnp.moveaxis(glob, 1, 2), local], axis=1)


KINDS = (
    Kind("per_head_block_sparse", per_head_block_sparse_attention, "sparse",
         Paper("Child et al.", 2019, "Generating Long Sequences with Sparse Transformers"),
         time="O(L sqrt(L) D) (strided heads)", memory="O(L D)", causal=True,
         segments=_per_head_segments,
         test_hyperparameters={"stride": 4, "block_q": 8, "block_k": 8},
         hyperparameters={
             "heads": (None, "one pattern per head (a patterns.PerHead); None: Sparse "
                             "Transformer heads of `stride`"),
             "stride": (None, "the Sparse Transformer heads' stride (when `heads` is None)"),
             "kind": ("strided", "the Sparse Transformer heads: 'strided' or 'fixed'"),
             "c": (1, "summary positions per block of the 'fixed' heads"),
             **TILES, **IMPLEMENTATION},
         adapter=AttentionAdapter(_per_head, init=_per_head_init)),
    Kind("axial", axial_attention, "sparse",
         Paper("Ho et al.", 2019, "Axial Attention in Multidimensional Transformers"),
         time="O(L s D), s the attended axis' size", memory="O(L D)", causal=True,
         fixed_length=True, test_hyperparameters={"shape": (4, 4)},
         segments=lambda hp: (
             "its axes are those of a fixed grid laid over the whole row (a position's row "
             "and column are absolute), so a document packed at an offset would attend along "
             "other axes than alone; train it on unpacked rows (data.pack=False)"),
         hyperparameters={
             "shape": (REQUIRED, "the input's shape, e.g. (height, width), flattened in raster "
                                 "order (its product is the length)"),
             "axis": (None, "the axis every head attends along; None: head h takes axis "
                            "h % len(shape)"),
             **TILES, **IMPLEMENTATION},
         adapter=AttentionAdapter(_axial, init=_axial_init)),
    Kind("longformer", longformer_attention, "sparse",
         Paper("Beltagy et al.", 2020, "Longformer: The Long-Document Transformer"),
         time="O(L (w + G) D)", memory="O(L D)", causal=True,
         segments=lambda hp: (
             f"its global tokens {tuple(hp['global_tokens'])} are positions of the row, not of "
             "each document (a packed document would have no global token of its own, or one "
             "in its middle); train it on unpacked rows (data.pack=False)"),
         test_hyperparameters={"window": 2, "global_tokens": (0,), "block_q": 8, "block_k": 8},
         hyperparameters={
             "window": (REQUIRED, "keys on each side of the query in its sliding window"),
             "global_tokens": (REQUIRED, "positions that attend to and are seen by every "
                                         "position, e.g. (0,) for [CLS]"),
             "dilation": (1, "gap between the window's keys (dilated sliding window)"),
             **TILES},
         adapter=AttentionAdapter(_longformer, init=_global_projections, takes_input=True)),
    Kind("etc", etc_attention, "sparse",
         Paper("Ainslie et al.", 2020,
               "ETC: Encoding Long and Structured Inputs in Transformers"),
         time="O(L (r + G) D)", memory="O(L D)", causal=False,
         segments=lambda hp: (
             "its global input is the first num_global positions of the row, not of "
             "each document; train it on unpacked rows (data.pack=False)"),
         test_hyperparameters={"num_global": 2, "radius": 2, "block_q": 8, "block_k": 8},
         hyperparameters={
             "num_global": (REQUIRED, "the first positions that form the global input"),
             "radius": (REQUIRED, "keys on each side of a long-input query it attends to"),
             **TILES},
         adapter=AttentionAdapter(_etc, init=_global_projections, takes_input=True)),
)
