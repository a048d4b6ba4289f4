"""Encoder and decoder blocks: attention, optional cross attention and a feed-forward network,
each a residual branch with a chosen normalisation placement (Xiong et al., 2020, "On Layer
Normalization in the Transformer Architecture"):

* ``"pre"``: ``x + f(norm(x))`` (pre-LN; the stack adds a final norm).
* ``"post"``: ``norm(omega * x + f(x))`` (post-LN; ``omega = 1`` unless Admin (Liu et al.,
  2020) sets it).
* ``"rezero"``: ``x + alpha * f(x)`` with ``alpha`` initialised to 0 (ReZero, Bachlechner et
  al., 2020).
* ``"none"``: ``x + f(x)`` (for T-Fixup initialisation, Huang et al., 2020).

Blocks take Equinox's optional state: ``block(x) -> y``, or ``block(x, state) -> (y, state)``
when a stateful norm (PowerNorm) or stateful attention (routing) needs an ``eqx.nn.State``.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import axes as X
from ..axes import constrain
from ._attention import MultiHeadAttention
from ._ffn import FeedForward
from ._ffns import call_ffn
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
        :mod:`._ffns` for the call contract and the auxiliary outputs ``return_aux=True``
        returns).
      position: a ``"qk"`` or ``"bias"`` position scheme for self attention.
      memory: a :class:`~xformers_jax.nn.Memory` (Transformer-XL, ERNIE-Doc or compressive
        memory; see :mod:`._memory`), or a callable ``key -> Memory`` for one with parameters:
        the causal self attention then also attends to the ``memory_state`` passed to
        ``__call__``.
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
        self.ffn = (ffn or FFNSpec()).build(dim, hidden, activation=activation, causal=causal,
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

    def _norm(self, i, x, state, mask, inference):
        norm = self.norms[i]
        if isinstance(norm, StatefulNorm):
            return norm(x, state, mask=mask, inference=inference)
        return norm(x), state

    def _residual(self, i, x, f, state, mask, inference, threads_state=False):
        # threads_state: f is ``(h, state) -> (y, state)`` (stateful attention), called after
        # the norm so that the one eqx.nn.State is passed along linearly.
        g = f if threads_state else (lambda h, s: (f(h), s))
        if self.placement == "pre":
            h, state = self._norm(i, x, state, mask, inference)
            y, state = g(h, state)
            return x + y, state
        y, state = g(x, state)
        if self.placement == "post":
            return self._norm(i, self.gains[i].astype(x.dtype) * x + y, state, mask, inference)
        if self.placement == "rezero":
            return x + self.gains[i].astype(x.dtype) * y, state
        return x + y, state

    def sublayers(self, *, kv_mask=None, context=None, context_mask=None, positions=None,
                  key=None, tokens=None, inference=False, aux=None):
        """The residual branch functions ``x -> f(x)`` in order (without norms); the FFN's
        auxiliary outputs (:mod:`._ffns`) are written into the dict ``aux`` when given."""
        fs = [lambda h: self.attn(h, kv_mask=kv_mask, positions=positions, key=key)]
        if self.cross is not None:
            fs.append(lambda h: self.cross(h, context, kv_mask=context_mask, q_mask=kv_mask))
        ffn_key = None if key is None else jax.random.fold_in(key, 1)

        def ffn(h):
            y, a = call_ffn(self.ffn, h, mask=kv_mask, tokens=tokens, key=ffn_key,
                            inference=inference)
            if aux is not None:
                aux.update(a)
            return y

        fs.append(ffn)
        return fs

    def __call__(self, x, state=None, *, kv_mask=None, context=None, context_mask=None,
                 positions=None, key=None, inference=False, memory_state=None, tokens=None,
                 return_aux=False, carry=None):
        """x: ``[B, L, dim]``; kv_mask: ``bool[B, L]``; tokens: ``int[B, L]`` (the token ids,
        for hash-routed FFNs); context ``[B, Lc, dim]`` with
        context_mask ``bool[B, Lc]`` for cross attention; memory_state: this layer's
        :class:`~xformers_jax.nn.MemoryState` (blocks with a ``memory``; the new one is
        :meth:`update_memory`'s). Returns ``y``, or ``(y, state)`` when an ``eqx.nn.State`` is
        passed (stateful norms or attention need one). With ``return_aux`` the result is
        ``(that, aux)``, ``aux`` the FFN's dict of auxiliary outputs (see :mod:`._ffns`).
        ``carry``: the previous layer's scores for attention kinds that pass them between
        layers (Realformer, ...; the stack gives it); the result is then ``(y, carry)``."""
        if (context is None) != (self.cross is None):
            raise ValueError("TransformerBlock: pass `context` exactly when the block has cross "
                             "attention (cross=True)")
        aux = {}
        fs = self.sublayers(kv_mask=kv_mask, context=context, context_mask=context_mask,
                            positions=positions, key=key, tokens=tokens, inference=inference,
                            aux=aux)
        if (memory_state is None) != (self.memory is None):
            raise ValueError("TransformerBlock: pass `memory_state` exactly when the block has a "
                             "memory (memory=...)")
        if memory_state is not None:
            ctx, ctx_mask = memory_state.context()
            ctx = ctx if self.placement != "pre" else self.norms[0](ctx)
            fs[0] = lambda h: memory_attention(self.attn, h, ctx, ctx_mask, kv_mask=kv_mask,
                                               positions=positions, key=key)
        if carry is not None:
            if state is not None or memory_state is not None:
                raise ValueError("TransformerBlock: attention that passes scores between layers "
                                 "takes no eqx.nn.State or memory")

            def carried(h):
                nonlocal carry
                y, carry = self.attn(h, kv_mask=kv_mask, positions=positions, key=key,
                                     carry=carry)
                return y

            fs[0] = carried
        x = constrain(x, _EMBED)
        stateful = self.attn.state_index is not None
        if stateful:
            fs[0] = lambda h, s: self.attn(h, kv_mask=kv_mask, positions=positions, key=key,
                                           state=s, inference=inference)
        for i, f in enumerate(fs):
            x, state = self._residual(i, x, f, state, kv_mask, inference,
                                      threads_state=stateful and i == 0)
            x = constrain(x, _EMBED)
        out = x if state is None else (x, state)
        out = out if carry is None else (x, carry)
        return (out, aux) if return_aux else out

    def update_memory(self, memory_state: MemoryState, x_in, x_out, kv_mask=None):
        """The memory after this block ran on a segment (input ``x_in``, output ``x_out``)."""
        return self.memory.update(self, memory_state, x_in, x_out, kv_mask)

    def branch_outputs(self, x, *, kv_mask=None, context=None, context_mask=None):
        """Runs the block, also returning each branch's output ``f(x)`` (Admin profiling)."""
        outs = []
        for i, f in enumerate(self.sublayers(kv_mask=kv_mask, context=context,
                                             context_mask=context_mask)):
            def record(h, f=f):
                y = f(h)
                outs.append(y)
                return y
            x, _ = self._residual(i, x, record, None, kv_mask, True)
        return x, outs

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        return self.attn.init_cache(batch, max_len, dtype)

    def decode(self, x, cache, *, context=None, context_mask=None):
        """One decoding step ``x: [B, 1, dim]``; returns ``(y, cache)``."""
        def attn(h):
            nonlocal cache
            y, cache = self.attn.decode(h, cache)
            return y

        fs = [attn]
        if self.cross is not None:
            fs.append(lambda h: self.cross(h, context, kv_mask=context_mask))
        fs.append(lambda h: call_ffn(self.ffn, h, inference=True)[0])
        for i, f in enumerate(fs):
            x, _ = self._residual(i, x, f, None, None, True)
        return x, cache
