"""Flex attention: any score function and any mask function on the tiled kernel.

Dong, Feng, Guessous, Liang and He, 2024, "Flex Attention: A Programming Model for Generating
Optimized Attention Kernels" (PyTorch FlexAttention). A new attention idea is often a change
to the scores (a bias, a cap, a gate) or to which keys a query sees; here it is written as two
pure JAX functions and runs inside the same tiled online-softmax kernels as
:func:`~xformers_jax.attention.flash_attention` (``xformers_jax.kernels.attend_layout`` on
XLA, the Pallas block-sparse kernels on GPU and TPU), forward and recomputing backward,
without an ``L x L`` array:

- ``score_mod(score, b, h, q_idx, kv_idx) -> score``: applied to each ``[bq, bk]`` tile of
  scaled scores and differentiated there (its ``jax.vjp`` inside the backward's tile); arrays
  it captures (ALiBi slopes, a learned bias table) receive gradients when an enclosing
  transformation traces them.
- ``mask_mod(b, h, q_idx, kv_idx) -> bool``, or any ``Pattern``: its block layout (empty,
  partial, full tiles) is derived on the host once per shape and tile and cached
  (``patterns.MaskMod``); empty tiles are never computed, full tiles apply no mask. A mask
  function of traced arrays, or of ``b``/``h``, has no static layout and is evaluated in-tile
  as data (see ``patterns._mask_mod``).

The signatures are PyTorch's, argument for argument, so a score or mask function written for
FlexAttention ports unchanged, with one difference: ``q_idx`` and ``kv_idx`` arrive as
broadcastable int32 arrays (``[bq, 1]`` and ``[1, bk]``) rather than vmapped scalars, so a
function must be elementwise (``jnp`` operations, ``jnp`` indexing). ``b`` and ``h`` are int32
scalars: ``batch_index`` and ``head_index``, which :func:`~xformers_jax.attention.multihead`
maps over its batch and heads (``batch_index=jnp.arange(B), head_index=jnp.arange(H)``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import kernels
from . import _contract as C
from ._dense import combined_pattern
from ._exact import _block, _pattern_blocks, _run
from .patterns import Full, Intersection, KeyPadding, Local, MaskMod, Pattern, Union


def _split_mask(name: str, mask):
    """``(static pattern | None, [dynamic MaskMod, ...])`` of a ``mask_mod`` argument.

    The static part gives the block layout; the dynamic parts (traced captures, ``b``/``h``)
    are evaluated in-tile, ANDed. A dynamic part may only be intersected with the rest: inside
    a union its tiles could not be bounded by the layout of the others.
    """
    if mask is None:
        return None, []
    if not isinstance(mask, Pattern):
        if not callable(mask):
            raise ValueError(f"{name}: mask_mod must be a callable (b, h, q_idx, kv_idx) -> bool "
                             f"or a patterns.Pattern, got {type(mask).__name__}")
        mask = MaskMod(mask)
    if isinstance(mask, MaskMod):
        return (mask, []) if mask.is_static() else (None, [mask])
    if isinstance(mask, Intersection):
        statics, dynamic = [], []
        for part in mask.parts:
            s, d = _split_mask(name, part)
            statics += [] if s is None else [s]
            dynamic += d
        static = None if not statics else statics[0] if len(statics) == 1 else Intersection(
            tuple(statics))
        return static, dynamic
    if isinstance(mask, Union):
        for part in mask.parts:
            if _split_mask(name, part)[1]:
                raise ValueError(
                    f"{name}: {part!r} has no static layout (it captures traced arrays or reads "
                    "b or h), so it cannot be part of a union with patterns; write the other "
                    "parts as mask functions too (MaskMod | MaskMod is one function, evaluated "
                    "in-tile), or intersect it with the patterns instead")
    return mask, []


def _and_all(mods):
    if not mods:
        return None
    fns = [m.fn for m in mods]
    return lambda b, h, i, j: functools.reduce(jnp.logical_and, [f(b, h, i, j) for f in fns])


def flex_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    *,
    score_mod: Callable | None = None,
    mask_mod: Callable | Pattern | None = None,
    sink=None,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    segment_ids=None,
    batch_index=0,
    head_index=0,
    scale: float | None = None,
    key=None,
    block_q: int | None = None,
    block_k: int | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
) -> Float[Array, "q_seq v_dim"] | tuple[Float[Array, "q_seq v_dim"], Float[Array, "q_seq"]]:
    """Exact softmax attention with a score function and a mask function, in O(L) memory.

    Equal to materialising ``s = scale q k^T``, replacing it by
    ``score_mod(s, b, h, i, j)``, masking where ``mask_mod(b, h, i, j)`` is False, and taking
    the softmax (with the ``sink`` logit in each row's denominator) times ``v``; outputs and
    gradients (q, k, v, the sink and the arrays ``score_mod`` captures) up to float rounding.

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``.
      score_mod: ``score_mod(score f32[bq, bk], b, h, q_idx int32[bq, 1], kv_idx int32[1, bk])
        -> f32[bq, bk]``, or None. Returning -inf masks an entry, but a mask function lets
        whole tiles be skipped.
      mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``, a ``patterns.Pattern`` or a
        combination of both with ``|`` and ``&``, or None (every key).
      sink: a float scalar logit added to every row's softmax denominator with no value
        (GPT-OSS's learned per-head sinks; Xiao et al., 2024, "Efficient Streaming Language
        Models with Attention Sinks"), differentiable; None: no sink. The returned ``lse``
        includes it.
      causal: intersect the mask with the causal one.
      kv_mask, segment_ids: the contract's key padding and packed-sequence ids (as data).
        On the XLA path a tile whose query and key id ranges cannot meet is skipped, forward
        and backward (the trainer's packed rows: ids known only at run time).
      batch_index, head_index: ``b`` and ``h`` for the two functions (int, or a traced int32
        scalar: pass ``jnp.arange(B)``/``jnp.arange(H)`` through ``multihead``).
      scale: score scale, ``1/sqrt(Dk)`` by default (applied before ``score_mod``).
      key: unused (no dropout); accepted for the contract.
      block_q, block_k: tiles; by default those :func:`pattern_tile` finds cheapest for the
        static mask (the machine's default tile without one).
      return_lse: also return the float32 log-sum-exp of each row.
      implementation: ``None`` (the Pallas block-sparse kernel on a GPU or TPU where it can
        run the call, else the XLA path), ``"xla"``, ``"pallas"`` or a kernel's name. The
        Triton and TPU block-sparse kernels run both functions and the sink in their tiles;
        compiled, they refuse functions that index a captured array (``gather``,
        ``dynamic_slice``: ALiBi's ``slopes[h]``, traced document ids), which then run on
        the XLA path (``"pallas"`` raises naming why). The Hopper kernels apply elementwise
        score functions that capture no array and read neither ``b`` nor ``h``.

    Returns:
      ``[Lq, Dv]`` in q's dtype, or ``(out, lse)``.

    Example (ALiBi with the slopes of 4 heads, causal, lifted to ``[B, L, H, D]``):
      >>> import jax.numpy as jnp
      >>> from xformers_jax.attention import flex_attention, multihead
      >>> slopes = 2.0 ** -jnp.arange(1, 5.0)
      >>> def alibi(s, b, h, i, j):
      ...     return s - slopes[h] * (i - j)
      >>> q = k = v = jnp.ones((2, 16, 4, 8))
      >>> multihead(flex_attention)(q, k, v, score_mod=alibi, causal=True,
      ...                           head_index=jnp.arange(4)).shape
      (2, 16, 4, 8)
    """
    name = "flex_attention"
    del key
    x, kv_mask, segs, _, scale = C.check_softmax_args(
        name, q, k, v, kv_mask, segment_ids, None, 0.0, None, scale)
    if score_mod is not None and not callable(score_mod):
        raise ValueError(f"{name}: score_mod must be a callable (score, b, h, q_idx, kv_idx) -> "
                         f"score, got {type(score_mod).__name__}")
    if sink is not None:
        sink = jnp.asarray(sink)
        if sink.shape != () or not jnp.issubdtype(sink.dtype, jnp.floating):
            raise ValueError(f"{name}: sink must be a float scalar (one logit per head; lift "
                             f"per-head sinks with multihead), got {sink.dtype}{sink.shape}")
    static, dynamic = _split_mask(name, mask_mod)
    pattern = combined_pattern(name, static, causal)
    if pattern is None:
        pattern = Full()
        bq = _block(name, "block_q", block_q, x.lq, kernels.default_block())
        bk = _block(name, "block_k", block_k, x.lk, kernels.default_block())
    else:
        bq, bk = _pattern_blocks(name, pattern, x.lq, x.lk, block_q, block_k)
    layout = pattern.layout(x.lq, x.lk, bq, bk)
    flex = dict(score_mod=score_mod, mask_mod=_and_all(dynamic), sink=sink,
                index=(batch_index, head_index))
    return _run(name, x, layout, kv_mask=kv_mask, segs=segs, bias=None, scale=scale,
                dropout_rate=0.0, key=None, return_lse=return_lse,
                implementation=implementation, causal=causal, flex=flex,
                op="block_sparse_attention")


# -- score and mask functions of the methods in the catalogue ------------------------------------


def soft_cap_score(cap: float) -> Callable:
    """Gemma 2's logit soft-capping, ``cap * tanh(score / cap)`` (Gemma Team, 2024, "Gemma 2:
    Improving Open Language Models at a Practical Size"; 50.0 for attention there)."""
    cap = float(cap)
    if not cap > 0:
        raise ValueError(f"soft_cap_score: cap must be positive, got {cap!r}")

    def capped(score, b, h, q_idx, kv_idx):
        return cap * jnp.tanh(score / cap)

    return capped


def alibi_score(slopes) -> Callable:
    """ALiBi's linear biases ``score - m_h |i - j|`` (Press et al., 2022, "Train Short, Test
    Long"); ``slopes f32[H]`` indexed by ``h`` (a parameter if traced)."""

    def linear_bias(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * jnp.abs(q_idx - kv_idx).astype(score.dtype)

    return linear_bias


def relative_bias_score(table, bucket: Callable) -> Callable:
    """A learned scalar per head and relative-position bucket, ``score + table[h,
    bucket(kv_idx - q_idx)]`` (T5: Raffel et al., 2020, with ``bucket`` T5's buckets, e.g.
    ``functools.partial(nn.t5_bucket, bidirectional=True, num_buckets=32,
    max_distance=128)``); ``table f32[H, buckets]`` receives gradients."""

    def bucket_bias(score, b, h, q_idx, kv_idx):
        return score + table[h][bucket(kv_idx - q_idx)].astype(score.dtype)

    return bucket_bias


def prefix_lm_mask(prefix: int) -> MaskMod:
    """The prefix LM mask (Raffel et al., 2020): every query sees the first ``prefix`` keys
    (bidirectional over the prefix) and the keys up to itself."""
    prefix = C.check_positive_int("prefix_lm_mask", "prefix", prefix)

    def prefix_or_past(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (kv_idx <= q_idx)

    return MaskMod(prefix_or_past, ("prefix_lm_mask", prefix))


def document_offsets(segment_ids) -> jnp.ndarray:
    """``int32[L]``: each position's offset from the first position of its document, for
    packed-sequence ids ``segment_ids int[L]`` (a document starts wherever the id changes; the
    padding after the last document counts as one more). A score or mask function of packed
    rows reads positions through it, so each document sees the positions it would see alone
    (StreamingLLM's sinks are the first tokens of each document, not of the row)."""
    seg = jnp.asarray(segment_ids)
    if seg.ndim != 1 or not jnp.issubdtype(seg.dtype, jnp.integer):
        raise ValueError(f"document_offsets: segment_ids must be int[L] (one row; lift with "
                         f"multihead), got {seg.dtype}{tuple(seg.shape)}")
    idx = jnp.arange(seg.shape[0], dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones((1,), bool), seg[1:] != seg[:-1]])
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0))


def document_sum(segment_ids, x, *, reverse: bool = False) -> jnp.ndarray:
    """``x [L, ...]`` summed along its first axis within each document of packed-sequence
    ids ``segment_ids int[L]``, from the document's first position up to each position
    (``reverse``: from each position to the document's last): a cumulative sum that
    restarts at every document, in one associative scan."""
    seg, x = jnp.asarray(segment_ids), jnp.asarray(x)
    if reverse:
        return document_sum(seg[::-1], x[::-1])[::-1]
    starts = jnp.concatenate([jnp.ones((1,), bool), seg[1:] != seg[:-1]])

    def combine(a, b):
        restart = b[0].reshape(b[0].shape + (1,) * (b[1].ndim - 1))
        return a[0] | b[0], jnp.where(restart, b[1], a[1] + b[1])

    return jax.lax.associative_scan(combine, (starts, x))[1]


def streaming_mask(window: int, sinks: int, segment_ids=None) -> Pattern:
    """StreamingLLM's mask (Xiao et al., 2024, "Efficient Streaming Language Models with
    Attention Sinks"): the first ``sinks`` keys and a window of the ``window`` keys before each
    query (with ``causal=True``, the query itself and ``window`` keys back).

    With packed-sequence ids ``segment_ids int[L]`` the sinks are the first ``sinks`` keys of
    each document (:func:`document_offsets`), so a document sees what it would see alone once
    the kernel's segment mask (``flex_attention(segment_ids=)``) keeps it inside its document.
    The sinks then move with the data, so this is a mask function evaluated in-tile over the
    causal tiles the documents share, not a static layout."""
    window, sinks = int(window), int(sinks)
    if segment_ids is None:
        return Local(window, 0) | KeyPadding(sinks)
    offsets = document_offsets(segment_ids)

    def window_or_document_sink(b, h, q_idx, kv_idx):
        return (((kv_idx >= q_idx - window) & (kv_idx <= q_idx))
                | (offsets[kv_idx] < sinks))

    return MaskMod(window_or_document_sink)


def streaming_documents(q, k, v, *, window: int, sinks: int, segment_ids, causal=False,
                        kv_mask=None, scale=None, **tiles):
    """Flex attention with ``streaming_mask(window, sinks, segment_ids)`` (packed rows,
    self-attention, one head: ``q, k [L, Dk]``, ``v [L, Dv]`` -> ``[L, Dv]``), in O(L (w + n)
    D) as without segment ids: the mask function would be evaluated in every causal tile the
    documents share (its sinks move with the data, so no static layout skips a tile), about
    causal attention's work. Instead the window runs on the tiled kernel with the static
    ``Local(window, 0)`` layout and the segment mask, each query gathers the first ``sinks``
    keys of its document outside that window, and the two disjoint key sets merge into one
    softmax by their log-sum-exps (``kernels.merge_by_lse``). ``tiles``: ``block_q``,
    ``block_k``, ``implementation``, ``key`` (as ``flex_attention``'s)."""
    window, sinks = int(window), int(sinks)
    seg = jnp.asarray(segment_ids)
    near, lse_near = flex_attention(q, k, v, mask_mod=Local(window, 0), causal=causal,
                                    kv_mask=kv_mask, segment_ids=seg, scale=scale,
                                    return_lse=True, **tiles)
    length = k.shape[0]
    i = jnp.arange(length)[:, None]
    idx = (i[:, 0] - document_offsets(seg))[:, None] + jnp.arange(sinks)[None, :]  # [L, n]
    at = jnp.minimum(idx, length - 1)
    ok = (idx < length) & (seg[at] == seg[:, None]) & ((at < i - window) | (at > i))
    if causal:
        ok = ok & (at <= i)
    if kv_mask is not None:
        ok = ok & kv_mask[at]
    # Selects, not products: a gathered padding key may hold anything (NaN included).
    ks, vs = (jnp.where(ok[..., None], a[at], jnp.zeros((), a.dtype)).astype(C.STATS_DTYPE)
              for a in (k, v))
    s = jnp.einsum("ld,lnd->ln", q.astype(C.STATS_DTYPE), ks)
    s = jnp.where(ok, s * C.resolve_scale(q.shape[-1], scale), -jnp.inf)
    m = jax.lax.stop_gradient(kernels.safe_max(s.max(-1)))
    p = jnp.where(ok, jnp.exp(s - m[:, None]), 0.0)
    total = p.sum(-1)
    far = kernels.normalise(jnp.einsum("ln,lnd->ld", p, vs), total)
    out, _ = kernels.merge_by_lse(near, lse_near, far, kernels.log_sum_exp(m, total))
    return out.astype(q.dtype)
