"""Encoder and decoder blocks: attention, optional cross attention and a feed-forward network,
each a residual branch with a chosen normalisation placement (Xiong et al., 2020, "On Layer
Normalization in the Transformer Architecture"):

* ``"pre"``: ``x + f(norm(x))`` (pre-LN; the stack adds a final norm).
* ``"post"``: ``norm(omega * x + f(x))`` (post-LN; ``omega = 1`` unless Admin (Liu et al.,
  2020) sets it).
* ``"rezero"``: ``x + alpha * f(x)`` with ``alpha`` initialised to 0 (ReZero, Bachlechner et
  al., 2020).
* ``"none"``: ``x + f(x)`` (for T-Fixup initialisation, Huang et al., 2020).

Blocks take Equinox's optional-state convention with one carry (:class:`~xformers_jax.nn.Carry`):
``block(x) -> y``, or ``block(x, carry) -> (y, carry)`` when the block needs an ``eqx.nn.State``
(a stateful norm, PowerNorm, or stateful attention, routing), a memory, or the scores of the
previous layer, or when the caller wants its auxiliary outputs.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import axes as X
from ..axes import constrain
from ._attention import MultiHeadAttention
from ._cache import BlockCache
from ._carry import Carry
from ._ffns import call_ffn, decode_ffn, init_ffn_cache
from ._memory import Memory, MemoryState, memory_attention
from ._norms import StatefulNorm, make_norm
from ._positions import PositionScheme
from ._slots import AttentionSpec, FFNSpec, MixerSpec, make_mixer

PLACEMENTS = ("pre", "post", "rezero", "none")
_EMBED = X.TOKENS


class TransformerBlock(eqx.Module):
    """Self attention, optional cross attention (decoder blocks of an encoder-decoder), FFN.

    Args:
      dim, num_heads, hidden: widths. spec: the attention variant. causal: causal self
        attention. cross: add a cross-attention sublayer. placement: see module docstring.
      norm: ``"layer"``, ``"rms"``, ``"scaled_l2"``, ``"ada"`` or ``"power"``.
      activation, chunk_size: of the :class:`FeedForward`. num_kv_heads: GQA/MQA.
      ffn: an :class:`~xformers_jax.nn.FFNSpec` naming the feed-forward kind (default the
        dense :class:`FeedForward`; mixtures of experts, product-key memory, ...: see
        :mod:`._ffns` for the call contract and the auxiliary outputs a carried call
        returns).
      position: a ``"qk"`` or ``"bias"`` position scheme for self attention.
      memory: a :class:`~xformers_jax.nn.Memory` (Transformer-XL, ERNIE-Doc or compressive
        memory; see :mod:`._memory`), or a callable ``key -> Memory`` for one with parameters:
        the causal self attention then also attends to the memory carried into ``__call__``
        (``carry.memory``).
      mixer: a :class:`~xformers_jax.nn.MixerSpec` (S4D, Mamba, RetNet, FNet, gMLP, ...; see
        :mod:`xformers_jax.mixers`): the token mixer replaces the self-attention sublayer
        (``spec``, ``num_kv_heads`` and ``position`` then do not apply; ``attn`` holds it).
      key: PRNG key.
    """

    attn: MultiHeadAttention
    cross: MultiHeadAttention | None
    ffn: eqx.Module
    norms: tuple
    gains: jax.Array
    memory: Memory | None
    placement: str = eqx.field(static=True)
    # The kinds in the mixer and FFN slots, for what they promise (Kind.segments).
    mixer_spec: MixerSpec | None = eqx.field(static=True)
    ffn_spec: FFNSpec = eqx.field(static=True)

    def __init__(self, dim: int, num_heads: int, hidden: int, *,
                 spec: AttentionSpec = AttentionSpec(), causal: bool = False,
                 cross: bool = False, placement: str = "pre", norm: str = "layer",
                 activation: str = "gelu", chunk_size: int | None = None,
                 num_kv_heads: int | None = None, position: PositionScheme | None = None,
                 max_len: int = 512, memory=None, ffn: FFNSpec | None = None,
                 mixer: MixerSpec | None = None, key):
        if placement not in PLACEMENTS:
            raise ValueError(f"TransformerBlock: placement must be one of {PLACEMENTS}, got "
                             f"{placement!r}")
        ka, kc, kf = jax.random.split(key, 3)
        if mixer is not None:
            if spec != AttentionSpec() or position is not None or num_kv_heads is not None \
                    or memory is not None:
                raise ValueError("TransformerBlock: a mixer replaces the self-attention "
                                 "sublayer; do not also give spec, position, num_kv_heads or "
                                 "memory")
            self.attn = make_mixer(mixer, dim, num_heads, causal=causal, max_len=max_len, key=ka)
        else:
            self.attn = MultiHeadAttention(dim, num_heads, spec=spec, causal=causal,
                                           num_kv_heads=num_kv_heads, position=position,
                                           max_len=max_len, key=ka)
        self.cross = MultiHeadAttention(dim, num_heads, key=kc) if cross else None
        self.mixer_spec, self.ffn_spec = mixer, ffn or FFNSpec()
        self.ffn = self.ffn_spec.build(dim, hidden, activation=activation, causal=causal,
                                       chunk_size=chunk_size, key=kf)
        n = 3 if cross else 2
        self.norms = tuple(make_norm(norm, dim) for _ in range(n)) if placement in (
            "pre", "post") else ()
        # ReZero's alpha (zero) or post-LN's omega (one, Admin re-initialises it).
        self.gains = jnp.zeros((n,)) if placement == "rezero" else jnp.ones((n,))
        self.placement = placement
        # Its own fold of the key, so that adding a memory changes no other initialisation.
        if memory is not None and not isinstance(memory, Memory):
            memory = memory(key=jax.random.fold_in(key, 7))
        if memory is not None and (not causal or cross):
            raise ValueError("TransformerBlock: a memory needs causal self-attention without "
                             "cross attention (segment-level recurrence of a causal LM)")
        self.memory = memory

    def _norm(self, i, x, carry, mask, inference):
        norm = self.norms[i]
        if isinstance(norm, StatefulNorm):
            if carry.state is None:
                raise ValueError(f"TransformerBlock: {type(norm).__name__} keeps running "
                                 "statistics: build the model with eqx.nn.make_with_state and "
                                 "call it with carry=nn.Carry(state=state)")
            y, state = norm(x, carry.state, mask=mask, inference=inference)
            return y, carry.replace(state=state)
        return norm(x), carry

    def _residual(self, i, x, f, carry, mask, inference):
        """Sublayer ``i``'s residual branch around ``f(h, carry) -> (y, carry)`` with this
        block's norm placement."""
        if self.placement == "pre":
            h, carry = self._norm(i, x, carry, mask, inference)
            y, carry = f(h, carry)
            return x + y, carry
        y, carry = f(x, carry)
        if self.placement == "post":
            return self._norm(i, self.gains[i].astype(x.dtype) * x + y, carry, mask, inference)
        if self.placement == "rezero":
            return x + self.gains[i].astype(x.dtype) * y, carry
        return x + y, carry

    def residual(self, i: int, x, f):
        """``x`` through sublayer ``i``'s residual branch around ``f(h) -> y`` (its norm and
        placement, no state): for callers that run a sublayer their own way (decoding over a
        cache, the Feedback Transformer's memory attention)."""
        return self._residual(i, x, lambda h, c: (f(h), c), Carry(), None, True)[0]

    def segment_problem(self) -> str | None:
        """Why this block cannot run packed rows (several documents per row, ``segment_ids``,
        each as if alone), or None: every slot's kind must honour segment ids
        (``Kind.segments``), and a memory or cross attention would reach across documents."""
        if self.memory is not None:
            return ("a block memory carries hidden states from one segment to the next, "
                    "across documents")
        if self.cross is not None:
            return "cross attention takes a context, not packed rows"
        stateful = [type(n).__name__ for n in self.norms if isinstance(n, StatefulNorm)]
        if stateful:
            return (f"{stateful[0]} normalises with statistics over the batch's tokens, so "
                    "over the other documents")
        if isinstance(self.attn, MultiHeadAttention):
            problem = self.attn.segment_problem()
        else:
            problem = self.mixer_spec.record.segment_problem(self.mixer_spec.resolved)
        if problem is None:
            problem = self.ffn_spec.record.segment_problem(self.ffn_spec.resolved)
        return problem

    def _branches(self, *, kv_mask=None, context=None, context_mask=None, positions=None,
                  key=None, tokens=None, inference=False, segment_ids=None):
        """The residual branch functions ``(h, carry) -> (y, carry)`` in order (without
        norms): attention (over the carried memory when the block has one) or the mixer, cross
        attention, FFN (whose auxiliary outputs go to ``carry.aux``)."""
        def attn(h, carry):
            if carry.memory is not None:
                ctx, ctx_mask = carry.memory.context()
                ctx = ctx if self.placement != "pre" else self.norms[0](ctx)
                return memory_attention(self.attn, h, ctx, ctx_mask, kv_mask=kv_mask,
                                        positions=positions, key=key), carry
            if isinstance(self.attn, MultiHeadAttention):
                seg = {} if segment_ids is None else {"segment_ids": segment_ids}
                return self.attn(h, kv_mask=kv_mask, positions=positions, key=key,
                                 inference=inference, carry=carry, **seg)
            seg = {} if segment_ids is None else {"segment_ids": segment_ids}
            return self.attn(h, kv_mask=kv_mask, positions=positions, key=key, **seg), carry

        fs = [attn]
        if self.cross is not None:
            fs.append(lambda h, c: (self.cross(h, context, kv_mask=context_mask,
                                               q_mask=kv_mask), c))
        ffn_key = None if key is None else jax.random.fold_in(key, 1)

        def ffn(h, carry):
            y, aux = call_ffn(self.ffn, h, mask=kv_mask, tokens=tokens, key=ffn_key,
                              inference=inference)
            return y, carry.replace(aux={**carry.aux, **aux})

        fs.append(ffn)
        return fs

    def sublayers(self, *, kv_mask=None, context=None, context_mask=None, positions=None,
                  key=None, tokens=None, inference=False):
        """The residual branch functions ``x -> f(x)`` in order (without norms; no state,
        memory or auxiliary outputs)."""
        return [lambda h, f=f: f(h, Carry())[0] for f in self._branches(
            kv_mask=kv_mask, context=context, context_mask=context_mask, positions=positions,
            key=key, tokens=tokens, inference=inference)]

    def __call__(self, x, carry: Carry | None = None, *, kv_mask=None, context=None,
                 context_mask=None, positions=None, key=None, inference=False, tokens=None,
                 segment_ids=None):
        """x: ``[B, L, dim]``; kv_mask: ``bool[B, L]``; tokens: ``int[B, L]`` (the token ids,
        for hash-routed FFNs); context ``[B, Lc, dim]`` with context_mask ``bool[B, Lc]`` for
        cross attention; segment_ids: ``int[B, L]`` for packed rows (the document of each
        token, 0 for padding: no document sees another; ``kv_mask`` also drops those 0;
        every slot's kind must honour them, :meth:`segment_problem`). Returns ``y``, or
        ``(y, carry)`` when a :class:`~xformers_jax.nn.Carry` is given: its ``state`` updated
        (stateful norms and attention need one), its ``memory`` (this layer's :class:`~xformers_jax.nn.MemoryState`; blocks with a
        ``memory`` need one) the memory after this segment, its ``scores`` this layer's (for
        attention kinds that pass scores between layers, which need the previous layer's),
        and ``aux`` the FFN's auxiliary outputs (see :mod:`._ffns`)."""
        if (context is None) != (self.cross is None):
            raise ValueError("TransformerBlock: pass `context` exactly when the block has cross "
                             "attention (cross=True)")
        given = carry is not None
        carry = Carry() if carry is None else carry.replace(aux={})
        if (carry.memory is None) != (self.memory is None):
            raise ValueError("TransformerBlock: pass carry=nn.Carry(memory=...) exactly when "
                             "the block has a memory (memory=...)")
        if carry.memory is not None and (carry.state is not None or carry.scores is not None):
            raise ValueError("TransformerBlock: a block with a memory takes no eqx.nn.State "
                             "and passes no scores between layers")
        if segment_ids is not None:
            problem = self.segment_problem()
            if problem is not None:
                raise ValueError(f"TransformerBlock: packed rows (segment_ids): {problem}")
            real = segment_ids > 0
            kv_mask = real if kv_mask is None else kv_mask & real
        x_in = x = constrain(x, _EMBED)
        for i, f in enumerate(self._branches(kv_mask=kv_mask, context=context,
                                             context_mask=context_mask, positions=positions,
                                             key=key, tokens=tokens, inference=inference,
                                             segment_ids=segment_ids)):
            x, carry = self._residual(i, x, f, carry, kv_mask, inference)
            x = constrain(x, _EMBED)
        if carry.memory is not None:
            carry = carry.replace(memory=self.update_memory(carry.memory, x_in, x, kv_mask))
        return (x, carry) if given else x

    def update_memory(self, memory_state: MemoryState, x_in, x_out, kv_mask=None):
        """The memory after this block ran on a segment (input ``x_in``, output ``x_out``)."""
        return self.memory.update(self, memory_state, x_in, x_out, kv_mask)

    def branch_outputs(self, x, *, kv_mask=None, context=None, context_mask=None):
        """Runs the block, also returning each branch's output ``f(x)`` (Admin profiling)."""
        outs = []
        for i, f in enumerate(self.sublayers(kv_mask=kv_mask, context=context,
                                             context_mask=context_mask)):
            def record(h, c, f=f):
                y = f(h)
                outs.append(y)
                return y, c
            x, _ = self._residual(i, x, record, Carry(), kv_mask, True)
        return x, outs

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        """The decoding cache: the attention's (or mixer's), in a
        :class:`~xformers_jax.nn.BlockCache` with the FFN's when the FFN keeps a state
        (capacity routing's expert counts)."""
        attn = self.attn.init_cache(batch, max_len, dtype)
        ffn = init_ffn_cache(self.ffn, batch)
        return attn if ffn is None else BlockCache(attn, ffn)

    def decode(self, x, cache, *, tokens=None, context=None, context_mask=None):
        """One decoding step ``x: [B, 1, dim]`` (``tokens int[B, 1]``: the step's token ids,
        for hash-routed FFNs); returns ``(y, cache)``."""
        attn_cache, ffn_cache = (cache.attn, cache.ffn) if isinstance(cache, BlockCache) \
            else (cache, None)

        def attn(h):
            nonlocal attn_cache
            y, attn_cache = self.attn.decode(h, attn_cache)
            return y

        def ffn(h):
            nonlocal ffn_cache
            y, ffn_cache = decode_ffn(self.ffn, h, ffn_cache, tokens=tokens)
            return y

        fs = [attn]
        if self.cross is not None:
            fs.append(lambda h: self.cross(h, context, kv_mask=context_mask))
        fs.append(ffn)
        for i, f in enumerate(fs):
            x = self.residual(i, x, f)
        return x, attn_cache if ffn_cache is None else BlockCache(attn_cache, ffn_cache)


def check_segments(model) -> None:
    """Raises ``ValueError`` unless ``model`` can run packed rows (several documents per row,
    ``segment_ids``, each document's outputs as if it ran alone), naming every kind (and
    reason) that cannot: every block's slots must honour segment ids (``Kind.segments``), and
    no embedding may mix neighbouring tokens (CPE). A trainer calls it when the model is
    built, so a run with ``data.pack=True`` fails before its first step."""
    from ._embed import Embedder

    types = (TransformerBlock, Embedder)
    parts = [m for m in jax.tree_util.tree_leaves(model, is_leaf=lambda x: isinstance(x, types))
             if isinstance(m, types)]
    problems = sorted({p for p in (m.segment_problem() for m in parts) if p is not None})
    if problems:
        raise ValueError("this model cannot run packed rows (segment ids): " + "; ".join(problems))

