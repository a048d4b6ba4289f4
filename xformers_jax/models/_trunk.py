"""Models that compose any attention variant: an encoder classifier (CLS or mean pooling), a
dual encoder (retrieval), a causal language model with cached ``generate`` and an
encoder-decoder. Inputs are token ids ``int[B, L]`` or continuous features ``[B, L, F]``
(e.g. pixels).

Every model takes ``block`` (keyword arguments of :class:`TransformerBlock`: ``spec``,
``placement``, ``norm``, ``activation``, ``position`` for q/k or bias schemes, ...) and
``stack`` (keyword arguments of :class:`LayerStack`: ``remat``, ``sharing``, ``universal``,
``scan``, ``reversible``); ``positions`` is an input position scheme (sinusoidal by default).
"""

from __future__ import annotations

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import axes as X
from ..axes import constrain
from ._blocks import TransformerBlock
from ._cycle import cycle_blocks
from ._norms import LayerNorm
from ._sampling import sample_tokens as sample_tokens
from ._positions import ConvPositions, InputScheme, SinusoidalPositions
from ._stack import LayerStack


class Embedder(eqx.Module):
    """Token ids (a table) or continuous features (a linear map) to ``[B, L, dim]``, plus an
    input position scheme and an optional learned CLS token prepended to the sequence."""

    table: jax.Array | None = X.param(X.VOCAB, X.EMBED)
    proj: jax.Array | None = X.param(None, X.EMBED)
    cls: jax.Array | None = X.param(X.EMBED)
    positions: InputScheme

    def __init__(self, dim: int, *, vocab_size: int | None = None,
                 input_dim: int | None = None, cls_token: bool = False,
                 positions: InputScheme | None = None, key):
        if (vocab_size is None) == (input_dim is None):
            raise ValueError("Embedder: give exactly one of vocab_size (token ids) or input_dim "
                             "(continuous inputs)")
        k1, k2 = jax.random.split(key)
        self.table = (jax.random.normal(k1, (vocab_size, dim)) / math.sqrt(dim)
                      if vocab_size is not None else None)
        self.proj = (jax.random.normal(k1, (input_dim, dim)) / math.sqrt(input_dim)
                     if input_dim is not None else None)
        self.cls = 0.02 * jax.random.normal(k2, (dim,)) if cls_token else None
        self.positions = SinusoidalPositions() if positions is None else positions
        if not isinstance(self.positions, InputScheme):
            raise ValueError(f"Embedder: {type(self.positions).__name__} is not an input position "
                             "scheme; give it to the blocks (block=dict(position=...))")

    def __call__(self, inputs, *, mask=None, causal=False, offset=0):
        """inputs: ``int[B, L]`` or ``[B, L, F]``; mask ``bool[B, L]``. Returns ``(x, mask)``
        (with the CLS position added when ``cls``)."""
        if self.table is not None:
            if not jnp.issubdtype(inputs.dtype, jnp.integer):
                raise ValueError(f"Embedder: token ids must be integers, got {inputs.dtype}")
            x = self.table[inputs]
        else:
            if inputs.ndim != 3 or inputs.shape[-1] != self.proj.shape[0]:
                raise ValueError(f"Embedder: continuous inputs must be [B, L, "
                                 f"{self.proj.shape[0]}], got {inputs.shape}")
            x = inputs.astype(self.proj.dtype) @ self.proj
        b = x.shape[0]
        if self.cls is not None:
            x = jnp.concatenate([jnp.broadcast_to(self.cls, (b, 1, x.shape[-1])), x], axis=1)
            if mask is not None:
                mask = jnp.concatenate([jnp.ones((b, 1), bool), mask], axis=1)
        positions = jnp.broadcast_to(jnp.arange(x.shape[1]) + offset, x.shape[:2])
        x = self.positions.embed(x, positions, mask=mask, causal=causal)
        return constrain(x, X.TOKENS), mask


def _stack(dim, num_layers, num_heads, hidden, *, causal, cross, max_len, block, stack, key):
    block = dict(block or {})
    make = functools.partial(TransformerBlock, dim, num_heads, hidden, causal=causal,
                             cross=cross, max_len=max_len, **block)
    # FFNSpec(every=n): units of n blocks, the FFN kind in the last (GLaM's every other layer).
    make, units = cycle_blocks(make, block.get("ffn"), num_layers)
    final = LayerNorm(dim) if block.get("placement", "pre") == "pre" else None
    return LayerStack(lambda k: make(key=k), units, key=key, **(stack or {})), final


def _finish(final, x):
    return x if final is None else final(x)


def _run_aux(layers, x, state, **kw):
    """The stack asked for its auxiliary outputs (``nn._ffns``): ``(y, state, aux)``."""
    out, aux = layers(x, state, return_aux=True, **kw)
    return (out, None, aux) if state is None else (*out, aux)


class Encoder(eqx.Module):
    """Embedder + bidirectional layer stack (+ final norm for pre-LN)."""

    embed: Embedder
    layers: LayerStack
    final_norm: LayerNorm | None

    def __init__(self, dim, num_layers, num_heads, hidden, *, vocab_size=None, input_dim=None,
                 cls_token=False, positions=None, max_len=512, block=None, stack=None, key):
        k1, k2 = jax.random.split(key)
        self.embed = Embedder(dim, vocab_size=vocab_size, input_dim=input_dim, cls_token=cls_token,
                              positions=positions, key=k1)
        self.layers, self.final_norm = _stack(dim, num_layers, num_heads, hidden, causal=False,
                                              cross=False, max_len=max_len, block=block,
                                              stack=stack, key=k2)

    def __call__(self, inputs, *, mask=None, key=None, state=None, inference=False,
                 return_aux=False):
        """Returns ``(hidden [B, L(+1), dim], mask)``, and the new ``state`` third when an
        ``eqx.nn.State`` is passed (stateful attention, e.g. routing); with ``return_aux`` the
        layers' auxiliary outputs (``nn._ffns``) come last."""
        x, mask = self.embed(inputs, mask=mask)
        h, new, aux = _run_aux(self.layers, x, state, kv_mask=mask, key=key,
                               inference=inference)
        h = _finish(self.final_norm, h)
        out = (h, mask) if state is None else (h, mask, new)
        return (*out, aux) if return_aux else out


def pool(x, mask, pooling: str):
    """``"cls"``: the first position; ``"mean"``: the mean over real (unmasked) positions."""
    if pooling == "cls":
        return x[:, 0]
    w = jnp.ones(x.shape[:2], x.dtype) if mask is None else mask.astype(x.dtype)
    return jnp.einsum("bl,bld->bd", w, x) / jnp.maximum(w.sum(1, keepdims=True), 1)


class EncoderClassifier(eqx.Module):
    """Encoder + CLS or mean pooling + a linear classifier (LRA ListOps, Text, Image, ...)."""

    encoder: Encoder
    head: jax.Array = X.param(X.EMBED, None)
    pooling: str = eqx.field(static=True)

    def __init__(self, num_classes, dim, num_layers, num_heads, hidden, *, pooling="cls",
                 key, **kwargs):
        if pooling not in ("cls", "mean"):
            raise ValueError(f"EncoderClassifier: pooling must be 'cls' or 'mean', got {pooling!r}")
        k1, k2 = jax.random.split(key)
        self.encoder = Encoder(dim, num_layers, num_heads, hidden, cls_token=pooling == "cls",
                               key=k1, **kwargs)
        self.head = jax.random.normal(k2, (dim, num_classes)) / math.sqrt(dim)
        self.pooling = pooling

    def __call__(self, inputs, *, mask=None, key=None, state=None, inference=False,
                 return_aux=False):
        """Returns logits ``[B, num_classes]`` (``(logits, state)`` when ``state`` is given;
        ``(that, aux)`` with ``return_aux``, see ``nn._ffns``)."""
        h, mask, *rest = self.encoder(inputs, mask=mask, key=key, state=state,
                                      inference=inference, return_aux=True)
        logits = pool(h, mask, self.pooling) @ self.head.astype(h.dtype)
        out = logits if state is None else (logits, rest[0])
        return (out, rest[-1]) if return_aux else out


class DualEncoder(eqx.Module):
    """Two inputs through one shared encoder (LRA Retrieval): embeddings ``u, v`` are pooled
    and classified from ``[u, v, u * v, u - v]``."""

    encoder: Encoder
    mlp: tuple
    pooling: str = eqx.field(static=True)

    def __init__(self, num_classes, dim, num_layers, num_heads, hidden, *, pooling="mean",
                 key, **kwargs):
        k1, k2, k3 = jax.random.split(key, 3)
        self.encoder = Encoder(dim, num_layers, num_heads, hidden, cls_token=pooling == "cls",
                               key=k1, **kwargs)
        self.mlp = (jax.random.normal(k2, (4 * dim, dim)) / math.sqrt(4 * dim),
                    jax.random.normal(k3, (dim, num_classes)) / math.sqrt(dim))
        self.pooling = pooling

    def embed(self, inputs, *, mask=None, key=None):
        """The pooled embedding ``[B, dim]`` of one input."""
        h, mask = self.encoder(inputs, mask=mask, key=key)
        return pool(h, mask, self.pooling)

    def __call__(self, a, b, *, mask_a=None, mask_b=None, key=None):
        u, v = self.embed(a, mask=mask_a, key=key), self.embed(b, mask=mask_b, key=key)
        h = jax.nn.gelu(jnp.concatenate([u, v, u * v, u - v], -1) @ self.mlp[0].astype(u.dtype))
        return h @ self.mlp[1].astype(u.dtype)


class CausalLM(eqx.Module):
    """A decoder-only language model with cached decoding and ``generate``."""

    embed: Embedder
    layers: LayerStack
    final_norm: LayerNorm | None
    head: jax.Array = X.param(X.EMBED, X.VOCAB)

    def __init__(self, vocab_size, dim, num_layers, num_heads, hidden, *, positions=None,
                 max_len=512, block=None, stack=None, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = Embedder(dim, vocab_size=vocab_size, positions=positions, key=k1)
        self.layers, self.final_norm = _stack(dim, num_layers, num_heads, hidden, causal=True,
                                              cross=False, max_len=max_len, block=block,
                                              stack=stack, key=k2)
        self.head = jax.random.normal(k3, (dim, vocab_size)) / math.sqrt(dim)

    def __call__(self, tokens, *, mask=None, key=None, state=None, inference=False,
                 memory=None, return_aux=False):
        """Teacher-forced logits ``[B, L, vocab]`` for ``tokens: int[B, L]`` (``(logits,
        state)`` when an ``eqx.nn.State`` is given: stateful attention, e.g. routing; ``(that,
        aux)`` with ``return_aux``: the FFNs' auxiliary outputs per layer, ``nn._ffns``).

        With ``memory`` (blocks built with ``block=dict(memory=...)``, :meth:`init_memory`)
        ``tokens`` is the next segment of each stream and the result is ``(logits,
        new_memory)`` (segment-level recurrence, :mod:`xformers_jax.nn._memory`)."""
        x, _ = self.embed(tokens, mask=mask, causal=True)
        if memory is not None:
            if state is not None:
                raise ValueError("CausalLM: stateful attention does not take a memory")
            h, new = self.layers(x, kv_mask=mask, key=key, memory=memory)
            h = _finish(self.final_norm, h)
            return constrain(h @ self.head.astype(h.dtype), X.LOGITS), new
        h, new, aux = _run_aux(self.layers, x, state, kv_mask=mask, key=key,
                               inference=inference, tokens=tokens)
        h = _finish(self.final_norm, h)
        logits = constrain(h @ self.head.astype(h.dtype), X.LOGITS)
        out = logits if state is None else (logits, new)
        return (out, aux) if return_aux else out

    def init_memory(self, batch: int, dtype=jnp.float32, *, inference=False):
        """Empty memories for ``batch`` streams (the evaluation lengths when ``inference``)."""
        return self.layers.init_memory(batch, self.head.shape[0], dtype, inference=inference)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        if isinstance(self.embed.positions, ConvPositions):
            raise NotImplementedError("CausalLM: ConvPositions (CPE) has no decoding cache")
        return self.layers.init_cache(batch, max_len, dtype)

    def decode_step(self, token, caches, position):
        """token ``int[B]`` at ``position`` -> ``(logits [B, vocab], caches)``."""
        x, _ = self.embed(token[:, None], causal=True, offset=position)
        h, caches = self.layers.decode(x, caches)
        h = _finish(self.final_norm, h)
        return (h @ self.head.astype(h.dtype))[:, 0], caches

    def prefill(self, tokens, caches):
        """Feeds ``tokens int[B, L]`` one by one; returns ``(logits [B, L, vocab], caches)``:
        the cached equivalent of ``__call__``."""
        def step(caches, inputs):
            tok, t = inputs
            logits, caches = self.decode_step(tok, caches, t)
            return caches, logits

        caches, logits = jax.lax.scan(step, caches, (tokens.T, jnp.arange(tokens.shape[1])))
        return jnp.moveaxis(logits, 0, 1), caches

    def generate(self, prompt, max_new_tokens: int, *, key=None, temperature: float = 1.0,
                 top_k: int | None = None, dtype=jnp.float32):
        """Extends ``prompt int[B, P]`` by ``max_new_tokens`` tokens using the caches.

        Greedy when ``key`` is None; otherwise samples from ``softmax(logits / temperature)``
        restricted to the ``top_k`` most likely tokens. Returns ``int[B, P + max_new_tokens]``.
        """
        b, p = prompt.shape
        caches = self.init_cache(b, p + max_new_tokens, dtype)
        logits, caches = self.prefill(prompt, caches)
        new = sample_tokens(self.decode_step, logits[:, -1], caches, p, max_new_tokens,
                            key=key, temperature=temperature, top_k=top_k, dtype=prompt.dtype)
        return jnp.concatenate([prompt, new], axis=1)


class EncoderDecoder(eqx.Module):
    """A sequence-to-sequence Transformer: encoder, and a causal decoder with cross attention."""

    encoder: Encoder
    embed: Embedder
    decoder: LayerStack
    final_norm: LayerNorm | None
    head: jax.Array = X.param(X.EMBED, X.VOCAB)

    def __init__(self, target_vocab, dim, num_layers, num_heads, hidden, *, vocab_size=None,
                 input_dim=None, positions=None, max_len=512, block=None, stack=None, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.encoder = Encoder(dim, num_layers, num_heads, hidden, vocab_size=vocab_size,
                               input_dim=input_dim, positions=positions, max_len=max_len,
                               block=block, stack=stack, key=k1)
        self.embed = Embedder(dim, vocab_size=target_vocab, positions=positions, key=k2)
        dec_stack = dict(stack or {})
        if dec_stack.pop("reversible", False):
            raise ValueError("EncoderDecoder: reversible decoder blocks are not supported")
        self.decoder, self.final_norm = _stack(dim, num_layers, num_heads, hidden, causal=True,
                                               cross=True, max_len=max_len, block=block,
                                               stack=dec_stack, key=k3)
        self.head = jax.random.normal(k4, (dim, target_vocab)) / math.sqrt(dim)

    def __call__(self, source, target, *, source_mask=None, target_mask=None, key=None):
        """Teacher-forced logits ``[B, Lt, target_vocab]``."""
        memory, source_mask = self.encoder(source, mask=source_mask, key=key)
        y, _ = self.embed(target, mask=target_mask, causal=True)
        h = self.decoder(y, kv_mask=target_mask, context=memory, context_mask=source_mask)
        h = _finish(self.final_norm, h)
        return h @ self.head.astype(h.dtype)
