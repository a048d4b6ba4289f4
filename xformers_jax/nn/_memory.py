"""Segment-level recurrence: memories a block attends to besides its segment.

A long document is cut into segments of ``L`` tokens processed one after another; each layer
keeps a memory of hidden states from earlier segments and its attention runs over
``[memory; segment]`` (keys and values), the memory under ``stop_gradient``.

* :class:`XLMemory`: Transformer-XL (Dai et al., 2019, "Transformer-XL: Attentive Language
  Models Beyond a Fixed-Length Context"): layer ``n``'s memory is the last ``mem_len`` inputs
  of layer ``n`` (the outputs of layer ``n - 1``) of the previous segments. Use it with
  :class:`~xformers_jax.nn.TransformerXLRelative` (relative positions with the paper's ``u, v``
  biases): keys in memory sit at positions ``-M .. -1`` before the segment, so the relative
  distance ``i - j`` counts the memory offset. ``eval_mem_len`` (longer) is the memory of
  evaluation, chosen by ``init(..., inference=True)``.
  With ``same_layer=True`` it is ERNIE-Doc's enhanced recurrence (Ding et al., 2021,
  "ERNIE-Doc: A Retrospective Long-Document Modeling Transformer"): layer ``n``'s memory is
  layer ``n``'s own output on the previous segment, so the effective context grows with every
  segment instead of with depth; ``models.retrospective_feed`` is its two-pass reading.
* :class:`CompressiveMemory`: the Compressive Transformer (Rae et al., 2020, "Compressive
  Transformers for Long-Range Sequence Modelling"): memories evicted from the XL memory are
  compressed at rate ``c`` into a second, compressed memory (:data:`COMPRESSIONS`), trained by
  the attention-reconstruction loss (:func:`reconstruction_loss`).

The memory is part of a model's carried state (:class:`MemoryState`, one per layer, stacked on a
leading layer axis by :class:`~xformers_jax.nn.LayerStack`): ``CausalLM(..., block=dict(
memory=XLMemory(...)))``, ``state = model.init_memory(B)``, ``logits, state = model(tokens,
memory=state)``. Queries attend causally: query ``i`` of the segment sees every valid memory
entry and segment keys ``j <= i`` (the band ``Local(M + L, M)`` over ``[memory; segment]``).
"""

from __future__ import annotations

import abc
import copy
import math
from typing import final

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import attention as A
from ._attention import MultiHeadAttention

COMPRESSIONS = ("max", "mean", "conv", "dilated_conv", "most_used")
# The attention kinds that take a memory: exact softmax over [memory; segment] with the causal
# band and relative positions at the memory offset (approximate kinds have no such form here).
MEMORY_ATTENTION_KINDS = _EXACT = ("dot_product", "flash")


class MemoryState(eqx.Module):
    """One layer's carried memory (arrays; a stack holds them on a leading layer axis).

    mem ``[B, M, D]`` with mask ``bool[B, M]`` (False for slots not yet filled), the compressed
    memory ``cmem [B, Mc, D]`` with ``cmask`` (None for Transformer-XL) and
    ``aux``: the reconstruction loss of the update that made this state (0 without
    compression; a training loss adds it, :func:`memory_aux_loss`).
    """

    mem: jax.Array
    mask: jax.Array
    cmem: jax.Array | None
    cmask: jax.Array | None
    aux: jax.Array

    def context(self):
        """``([cmem; mem] [B, Mc + M, D], mask bool[B, Mc + M])``, oldest first."""
        if self.cmem is None:
            return self.mem, self.mask
        return (jnp.concatenate([self.cmem, self.mem], 1),
                jnp.concatenate([self.cmask, self.mask], 1))

    def reset(self, reset) -> "MemoryState":
        """This state with the rows where ``reset bool[B]`` is True emptied."""
        keep = ~reset.astype(bool)
        b = keep.shape[0]
        lead = self.mask.ndim - 2  # stacked layer axes before [B, M]

        def cut(mask):
            return mask & keep.reshape((1,) * lead + (b, 1))

        return MemoryState(self.mem, cut(self.mask), self.cmem,
                           None if self.cmask is None else cut(self.cmask), self.aux)


def reset_memory(state, reset):
    """Empties the memory of the batch rows where ``reset bool[B]`` is True (a stream that
    starts a new document or epoch). Works on a single layer's or a stacked
    :class:`MemoryState`, and on any carried state with a ``reset`` method (the Feedback
    Transformer's)."""
    return state.reset(reset)


def with_eval_memory(model, eval_mem_len: int):
    """``model`` with every block memory's evaluation length set to ``eval_mem_len`` (the
    compressed memory keeps its own): evaluating one trained model at several memory lengths.
    The relative position table must cover the longest distance (its ``max_len``)."""
    if isinstance(eval_mem_len, bool) or not isinstance(eval_mem_len, int) or eval_mem_len < 0:
        raise ValueError(f"with_eval_memory: eval_mem_len must be an integer >= 0, got "
                         f"{eval_mem_len!r}")
    is_memory = lambda x: isinstance(x, Memory)  # noqa: E731

    def change(x):
        if not is_memory(x):
            return x
        new = copy.copy(x)
        object.__setattr__(new, "eval_mem_len", eval_mem_len)  # a static field
        return new

    return jax.tree_util.tree_map(change, model, is_leaf=is_memory)


def memory_aux_loss(state: MemoryState) -> jax.Array:
    """The summed auxiliary (reconstruction) loss over every layer of a (stacked) state."""
    return jnp.sum(state.aux)


def _shift_in(old, old_mask, new, new_mask, keep: int):
    """The last ``keep`` entries of ``[old; new]`` and what fell out, with masks."""
    both = jnp.concatenate([old, new.astype(old.dtype)], 1)
    mask = jnp.concatenate([old_mask, new_mask], 1)
    cut = both.shape[1] - keep
    return both[:, cut:], mask[:, cut:], both[:, :cut], mask[:, :cut]


def _attention_input(block, x):
    """What the block's attention sees of hidden states ``x``: its pre-norm, or ``x`` itself
    for post-LN/ReZero placements (where the attention reads the residual stream)."""
    if block.placement == "pre":
        # Frozen: the reconstruction loss reaches no weight of the network through the norm.
        return jax.lax.stop_gradient(block.norms[0])(x)
    return x


class Memory(eqx.Module):
    """Abstract: a block's memory. ``init`` makes an empty :class:`MemoryState`; ``update``
    shifts a segment in (the block's input ``x_in``, or its output ``x_out`` for the
    same-layer recurrence) after the block has run."""

    mem_len: int = eqx.field(static=True)
    eval_mem_len: int = eqx.field(static=True)
    same_layer: bool = eqx.field(static=True)

    def _check(self):
        for name in ("mem_len", "eval_mem_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{type(self).__name__}: {name} must be an integer >= 0, got "
                                 f"{value!r}")

    def length(self, inference: bool) -> int:
        return self.eval_mem_len if inference else self.mem_len

    def compressed_length(self, inference: bool) -> int:
        return 0

    def init(self, batch: int, dim: int, dtype=jnp.float32, *, inference=False) -> MemoryState:
        """An empty memory for ``batch`` streams (evaluation length when ``inference``)."""
        m, c = self.length(inference), self.compressed_length(inference)
        # No compressed memory is None rather than empty (orbax cannot save empty arrays).
        return MemoryState(jnp.zeros((batch, m, dim), dtype), jnp.zeros((batch, m), bool),
                           jnp.zeros((batch, c, dim), dtype) if c else None,
                           jnp.zeros((batch, c), bool) if c else None,
                           jnp.zeros((), jnp.float32))

    @abc.abstractmethod
    def update(self, block, state: MemoryState, x_in, x_out, kv_mask) -> MemoryState:
        raise NotImplementedError


@final
class XLMemory(Memory):
    """Transformer-XL's memory (``same_layer=False``) or ERNIE-Doc's enhanced recurrence
    (``same_layer=True``); see the module docstring. ``eval_mem_len`` defaults to
    ``mem_len``."""

    def __init__(self, mem_len: int, eval_mem_len: int | None = None, *,
                 same_layer: bool = False):
        self.mem_len = mem_len
        self.eval_mem_len = mem_len if eval_mem_len is None else eval_mem_len
        self.same_layer = same_layer
        self._check()

    def update(self, block, state, x_in, x_out, kv_mask):
        src = jax.lax.stop_gradient(x_out if self.same_layer else x_in)
        seg_mask = jnp.ones(src.shape[:2], bool) if kv_mask is None else kv_mask
        mem, mask, _, _ = _shift_in(state.mem, state.mask, src, seg_mask, state.mem.shape[1])
        return MemoryState(mem, mask, state.cmem, state.cmask, jnp.zeros((), jnp.float32))


# -- compression functions (Rae et al., 2020, section 3.1) ---------------------------------------


def _groups(x, rate):
    b, n, d = x.shape
    if n % rate:
        raise ValueError(f"compression: {n} evicted memories are not a multiple of the "
                         f"compression rate {rate} (segment length must be a multiple of it)")
    return x.reshape(b, n // rate, rate, d)


def compress(kind: str, x, mask, rate: int, weight=None, bias=None, usage=None):
    """Compresses ``x [B, n, D]`` (mask ``bool[B, n]``) at ``rate`` into ``[B, n / rate, D]``
    and its mask (a slot is valid when any memory it summarises was).

    * ``"max"`` / ``"mean"``: max / mean pooling over each group of ``rate`` consecutive
      memories (over the valid ones).
    * ``"conv"``: 1D convolution with kernel and stride ``rate``: ``c_i = b + sum_t
      x[i rate + t] W_t``, ``weight [rate, D, D]``.
    * ``"dilated_conv"``: a dilated convolution, dilation 2, ``rate`` taps, stride ``rate``,
      each output's last tap on its group's last memory: ``c_i = b + sum_t x[i rate + rate - 1
      - 2 (rate - 1 - t)] W_t`` (taps before the start read zeros), so each slot summarises a
      span of ``2 rate - 1`` memories.
    * ``"most_used"``: keeps the ``n / rate`` memories with the largest ``usage [B, n]`` (the
      attention they received), in their original order.
    """
    if kind not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {kind!r}")
    b, n, d = x.shape
    g_mask = _groups(mask[..., None], rate)[..., 0]  # [B, n/r, r]
    out_mask = g_mask.any(-1)
    xz = jnp.where(mask[..., None], x, jnp.zeros((), x.dtype))
    if kind == "mean":
        count = jnp.maximum(g_mask.sum(-1, keepdims=True), 1).astype(x.dtype)
        return _groups(xz, rate).sum(2) / count, out_mask
    if kind == "max":
        g = jnp.where(g_mask[..., None], _groups(x, rate), -jnp.inf)
        return jnp.where(out_mask[..., None], g.max(2), jnp.zeros((), x.dtype)), out_mask
    if kind == "conv":
        out = jnp.einsum("bgtd,tde->bge", _groups(xz, rate), weight.astype(x.dtype))
        return out + bias.astype(x.dtype), out_mask
    if kind == "dilated_conv":
        span = 2 * (rate - 1)
        padded = jnp.concatenate([jnp.zeros((b, span, d), x.dtype), xz], 1)
        ends = jnp.arange(n // rate) * rate + rate - 1 + span  # last tap, in padded indices
        taps = ends[:, None] - 2 * (rate - 1 - jnp.arange(rate))[None, :]  # [n/r, r]
        out = jnp.einsum("bgtd,tde->bge", padded[:, taps], weight.astype(x.dtype))
        return out + bias.astype(x.dtype), out_mask
    # most used: top n/rate by usage among valid memories, order preserved.
    if usage is None:
        raise ValueError("compression 'most_used' needs the memories' usage (attention weights)")
    k = n // rate
    score = jnp.where(mask, usage.astype(jnp.float32), -jnp.inf)
    idx = jnp.sort(jax.lax.top_k(score, k)[1], axis=-1)
    take = lambda a: jnp.take_along_axis(a, idx[..., None] if a.ndim == 3 else idx, 1)  # noqa: E731
    return take(x), take(mask)


def _content_attention(attn: MultiHeadAttention, h, mem, mem_mask, return_weights=False):
    """Content-only multi-head attention of queries ``h [B, L, D]`` over ``mem [B, n, D]``
    (no positions, no causal mask): the attention the reconstruction loss compares."""
    q, k, v = attn.project(h, mem)
    f = A.multihead(lambda q1, k1, v1, kv_mask: A.dot_product_attention(
        q1, k1, v1, kv_mask=kv_mask, return_weights=return_weights))
    return f(q, k, v, kv_mask=mem_mask)


def reconstruction_loss(attn: MultiHeadAttention, h, old, old_mask, new, new_mask):
    """Rae et al.'s attention-reconstruction loss ``|| attn(h, old) - attn(h, new) ||^2``
    (mean over elements): the compressed memories ``new`` must give the layer's (content)
    attention of the segment ``h`` the output the evicted memories ``old`` gave. The network
    (attention weights, ``h``, ``old``) is under ``stop_gradient``, so the loss trains the
    compression function and nothing else."""
    attn = jax.lax.stop_gradient(attn)
    h, old = jax.lax.stop_gradient(h), jax.lax.stop_gradient(old)
    want = _content_attention(attn, h, old, old_mask)
    got = _content_attention(attn, h, new, new_mask)
    return jnp.mean(jnp.square(want.astype(jnp.float32) - got.astype(jnp.float32)))


@final
class CompressiveMemory(Memory):
    """The Compressive Transformer's two memories: the XL memory of ``mem_len`` and a compressed
    memory of ``cmem_len`` slots, each summarising ``rate`` evicted memories with
    ``compression`` (one of :data:`COMPRESSIONS`; see :func:`compress`). ``update`` also
    returns the attention-reconstruction loss of what it compressed in ``MemoryState.aux``.

    Args:
      dim: model width (the convolutions' width). mem_len, cmem_len: memory sizes for
        training. rate: compression rate (the segment length must be a multiple).
      compression: the compression function. eval_mem_len, eval_cmem_len: evaluation sizes
        (default: the training ones). key: PRNG key (convolution weights).
    """

    cmem_len: int = eqx.field(static=True)
    eval_cmem_len: int = eqx.field(static=True)
    rate: int = eqx.field(static=True)
    compression: str = eqx.field(static=True)
    weight: jax.Array | None
    bias: jax.Array | None

    def __init__(self, dim: int, mem_len: int, cmem_len: int, rate: int, *,
                 compression: str = "conv", eval_mem_len: int | None = None,
                 eval_cmem_len: int | None = None, key):
        if compression not in COMPRESSIONS:
            raise ValueError(f"CompressiveMemory: compression must be one of {COMPRESSIONS}, "
                             f"got {compression!r}")
        if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
            raise ValueError(f"CompressiveMemory: rate must be an integer >= 1, got {rate!r}")
        self.mem_len, self.cmem_len, self.rate = mem_len, cmem_len, rate
        self.eval_mem_len = mem_len if eval_mem_len is None else eval_mem_len
        self.eval_cmem_len = cmem_len if eval_cmem_len is None else eval_cmem_len
        self.same_layer, self.compression = False, compression
        self._check()
        if compression in ("conv", "dilated_conv"):
            # Initialised as mean pooling plus a little noise.
            noise = jax.random.normal(key, (rate, dim, dim)) / math.sqrt(rate * dim)
            self.weight = jnp.eye(dim)[None] / rate + 0.1 * noise
            self.bias = jnp.zeros((dim,))
        else:
            self.weight = self.bias = None

    def compressed_length(self, inference: bool) -> int:
        return self.eval_cmem_len if inference else self.cmem_len

    def update(self, block, state, x_in, x_out, kv_mask):
        src = jax.lax.stop_gradient(x_in)
        seg_mask = jnp.ones(src.shape[:2], bool) if kv_mask is None else kv_mask
        mem, mask, old, old_mask = _shift_in(state.mem, state.mask, src, seg_mask,
                                             state.mem.shape[1])
        if old.shape[1] == 0 or state.cmem is None:
            return MemoryState(mem, mask, state.cmem, state.cmask, jnp.zeros((), jnp.float32))
        h = jax.lax.stop_gradient(_attention_input(block, x_in))
        old_in = jax.lax.stop_gradient(_attention_input(block, old))
        usage = None
        if self.compression == "most_used":
            _, w = _content_attention(jax.lax.stop_gradient(block.attn), h, old_in, old_mask,
                                      return_weights=True)
            usage = w.sum(axis=(1, 2))  # [B, H, L, n] -> summed over heads and queries
        new, new_mask = compress(self.compression, old, old_mask, self.rate, self.weight,
                                 self.bias, usage)
        loss = reconstruction_loss(block.attn, h, old_in, old_mask,
                                   _attention_input(block, new), new_mask)
        cmem, cmask, _, _ = _shift_in(state.cmem, state.cmask, new, new_mask,
                                      state.cmem.shape[1])
        # Only the reconstruction loss differentiates the compression: the carried compressed
        # memory is detached like the rest of the memory.
        return MemoryState(mem, mask, jax.lax.stop_gradient(cmem), cmask, loss)


# -- attention over [memory; segment] ----------------------------------------------------------


def memory_attention(attn: MultiHeadAttention, h, ctx, ctx_mask, *, kv_mask=None,
                     positions=None, key=None):
    """Causal self-attention of the segment ``h [B, L, D]`` over ``[ctx; h]`` where ``ctx
    [B, M, D]`` (mask ``bool[B, M]``) holds the memory, already in the attention's input space
    (normed like ``h``). Memory entry ``m`` sits at position ``p_0 - M + m`` (``p_0`` the
    segment's first position), so relative schemes see the memory offset; query ``i`` sees
    the valid memory and segment keys ``j <= i``. Returns ``[B, L, D]`` (zero at padded
    queries). Only exact softmax kinds (``dot_product``, ``flash``) take a memory."""
    if not attn.causal:
        raise ValueError("memory_attention: memory needs causal self-attention (a causal LM)")
    if attn.spec.kind not in _EXACT:
        raise ValueError(f"memory_attention: attention kind {attn.spec.kind!r} cannot attend "
                         f"to a memory; use one of {_EXACT}")
    b, l, _ = h.shape
    m = ctx.shape[1]
    if ctx.shape[0] != b or ctx.shape[2] != h.shape[2] or ctx_mask.shape != ctx.shape[:2]:
        raise ValueError(f"memory_attention: memory {ctx.shape} (mask {ctx_mask.shape}) does not "
                         f"match the segment {h.shape}")
    q, k, v = attn.project(h, jnp.concatenate([ctx.astype(h.dtype), h], 1))
    q_pos = (jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l)) if positions is None
             else positions.astype(jnp.int32))
    k_pos = jnp.concatenate([q_pos[:, :1] - jnp.arange(m, 0, -1, dtype=jnp.int32)[None],
                             q_pos], 1)
    seg_mask = jnp.ones((b, l), bool) if kv_mask is None else kv_mask
    full_mask = jnp.concatenate([ctx_mask, seg_mask], 1)
    # The causal band over [memory; segment]: query i (key index M + i) sees keys <= M + i.
    o = attn.exact_heads(q, k, v, q_pos, k_pos, full_mask, A.patterns.Local(m + l, m))
    if kv_mask is not None:
        o = jnp.where(kv_mask[:, :, None, None], o, jnp.zeros((), o.dtype))
    return attn.output(o)
