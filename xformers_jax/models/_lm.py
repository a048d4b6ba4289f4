"""The decoder-only language model: :class:`CausalLM`, teacher-forced, with cached decoding
(``prefill``, ``decode_step``, ``generate``) and, with a block memory
(``block=dict(memory=...)``, ``nn.XLMemory`` / ``nn.CompressiveMemory``), segment-level
recurrence over contiguous streams (see :mod:`._memory_lm` for decoding across segments)."""

from __future__ import annotations

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import axes as X
from ..axes import constrain
from ..nn import (AUX_WEIGHTS, Carry, ConvPositions, Embedder, LayerNorm, LayerStack,
                  NoPositions, SinusoidalPositions, check_segments, document_positions,
                  memory_aux_loss, sample_tokens, transformer_stack)
from ._registry import SLOTS, TRUNK, block_kwargs, register_model
from ._serving import decode_compiler_options
from ._trunk import finish, run_with_aux


def _gather_rows(h, at):
    """``h[b, at[b]]``: ``[B, K, D]`` of ``h: [B, L, D]`` at ``at: int[B, K]``."""
    at = jnp.asarray(at)
    if at.ndim != 2 or at.shape[0] != h.shape[0] or not jnp.issubdtype(at.dtype, jnp.integer):
        raise ValueError(f"CausalLM: logits_at must be int [B, K] with B = {h.shape[0]} "
                         f"(the tokens' rows), got {at.dtype} {list(at.shape)}")
    return jnp.take_along_axis(h, at[..., None], axis=1)


class CausalLM(eqx.Module):
    """A decoder-only language model with cached decoding and ``generate``.

    ``tie_embeddings``: the output layer is the input embedding table transposed
    (``logits = h @ embed.table.T``; Press & Wolf 2017, "Using the Output Embedding to Improve
    Language Models"; Zoology's models, Arora et al. 2023, tie them), and ``head`` is None;
    otherwise ``head [dim, vocab]`` is its own parameter."""

    embed: Embedder
    layers: LayerStack
    final_norm: LayerNorm | None
    head: jax.Array | None = X.param(X.EMBED, X.VOCAB)

    def __init__(self, vocab_size, dim, num_layers, num_heads, hidden, *, positions=None,
                 max_len=512, block=None, stack=None, tie_embeddings=False,
                 scale_embeddings=False, embed_std=None, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = Embedder(dim, vocab_size=vocab_size, positions=positions,
                              scale_tokens=scale_embeddings, table_std=embed_std, key=k1)
        self.layers, self.final_norm = transformer_stack(
            dim, num_layers, num_heads, hidden, causal=True, max_len=max_len, block=block,
            stack=stack, key=k2)
        self.head = (None if tie_embeddings
                     else jax.random.normal(k3, (dim, vocab_size)) / math.sqrt(dim))

    def output_weights(self) -> jax.Array:
        """The output layer ``[dim, vocab]``: ``head``, or the embedding table transposed
        when the two are tied."""
        return self.embed.table.T if self.head is None else self.head

    def __call__(self, tokens, *, mask=None, key=None, state=None, inference=False,
                 memory=None, return_aux=False, segment_ids=None, logits_at=None):
        """Teacher-forced logits ``[B, L, vocab]`` for ``tokens: int[B, L]`` (``(logits,
        state)`` when an ``eqx.nn.State`` is given: stateful attention, e.g. routing; ``(that,
        aux)`` with ``return_aux``: the FFNs' auxiliary outputs per layer, ``nn.aux_terms``).

        With ``memory`` (blocks built with ``block=dict(memory=...)``, :meth:`init_memory`)
        ``tokens`` is the next segment of each stream and the result is ``(logits,
        new_memory)`` (segment-level recurrence, ``nn.XLMemory``); with ``return_aux`` it is
        ``(that, {"reconstruction_loss": ...})``, the compressive memory's reconstruction
        loss summed over layers (0 for other memories).

        Packed rows: ``segment_ids int[B, L]`` numbers the documents of each row (0 for
        padding, which ``mask`` then need not repeat): positions restart at every document
        (``nn.document_positions``) and no document sees another, so each document's logits
        equal those of the document run alone. Every kind of the model must honour segment
        ids (``nn.check_segments`` names any that does not).

        ``logits_at int[B, K]``: the logits at those positions of each row only, ``[B, K,
        vocab]`` (the same values as ``logits[b, logits_at[b]]`` of the full call): for tasks
        scored at a few positions (Zoology's MQAR scores ``kv`` of ``L``), where the output
        layer over the vocabulary at every position would dominate the step."""
        positions = None
        if segment_ids is not None:
            segment_ids = jnp.asarray(segment_ids)
            if memory is not None:
                raise ValueError("CausalLM: a memory carries one stream from segment to "
                                 "segment; packed rows (segment_ids) take none")
            if segment_ids.shape != tokens.shape:
                raise ValueError(f"CausalLM: segment_ids {list(segment_ids.shape)} must have "
                                 f"the tokens' shape {list(tokens.shape)}")
            check_segments(self)
            mask = segment_ids > 0 if mask is None else mask & (segment_ids > 0)
            positions = document_positions(segment_ids)
        x, _ = self.embed(tokens, mask=mask, causal=True, positions=positions)
        seg = {} if segment_ids is None else {"segment_ids": segment_ids, "positions": positions}
        if memory is not None:
            if state is not None:
                raise ValueError("CausalLM: stateful attention does not take a memory")
            if logits_at is not None:
                raise ValueError("CausalLM: logits_at is not supported with a memory")
            h, carry = self.layers(x, Carry(memory=memory), kv_mask=mask, key=key,
                                   inference=inference, tokens=tokens)
            h = finish(self.final_norm, h)
            out = constrain(h @ self.output_weights().astype(h.dtype), X.LOGITS), carry.memory
            if not return_aux:
                return out
            return out, {**carry.aux, "reconstruction_loss": memory_aux_loss(carry.memory)}
        h, new, aux = run_with_aux(self.layers, x, state, kv_mask=mask, key=key,
                                   inference=inference, tokens=tokens, **seg)
        if logits_at is not None:
            h = _gather_rows(h, logits_at)
        h = finish(self.final_norm, h)
        logits = constrain(h @ self.output_weights().astype(h.dtype), X.LOGITS)
        out = logits if state is None else (logits, new)
        return (out, aux) if return_aux else out

    def init_memory(self, batch: int, dtype=jnp.float32, *, inference=False):
        """Empty memories for ``batch`` streams (the evaluation lengths when ``inference``)."""
        return self.layers.init_memory(batch, self.embed.table.shape[1], dtype,
                                       inference=inference)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        """Empty decoding caches for ``batch`` rows of up to ``max_len`` tokens: a tuple with
        one cache per layer (``LayerStack.init_cache``; each layer's own buffers, not a slice
        of one ``[layers, ...]`` array), for :meth:`decode_step` and :meth:`prefill`."""
        if isinstance(self.embed.positions, ConvPositions):
            raise NotImplementedError("CausalLM: ConvPositions (CPE) has no decoding cache")
        return self.layers.init_cache(batch, max_len, dtype)

    def for_decoding(self) -> CausalLM:
        """This model laid out for decoding steps: its layer stack :meth:`unstacked
        <xformers_jax.nn.LayerStack.unstacked>`, each layer's parameters arrays of their own,
        so that a step reads them where they lie instead of slicing (copying) them out of the
        stacked ``[layers, ...]`` arrays. The same outputs from :meth:`decode_step`,
        :meth:`prefill` and ``__call__``; build it once, outside the decoding loop
        (:meth:`generate` and ``models.Server`` do). Not for training: its forward call
        stacks the layers again."""
        layers = self.layers.unstacked()
        return self if layers is self.layers else eqx.tree_at(lambda m: m.layers, self, layers)

    def decode_step(self, token, caches, position):
        """token ``int[B]`` at ``position`` -> ``(logits [B, vocab], caches)``."""
        x, _ = self.embed(token[:, None], causal=True, offset=position)
        h, caches = self.layers.decode(x, caches, tokens=token[:, None])
        h = finish(self.final_norm, h)
        return (h @ self.output_weights().astype(h.dtype))[:, 0], caches

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

        Compiled on its own (once per model structure and arguments' shapes) with
        ``models.decode_compiler_options()``, so that on CPU each step writes the caches in
        place rather than copying them; inside a caller's ``jax.jit`` it is traced into the
        caller's program, whose compiler options then apply.
        """
        args = (prompt, max_new_tokens, key, temperature, top_k, dtype)
        params, static = eqx.partition(self, eqx.is_array)
        if any(isinstance(a, jax.core.Tracer)
               for a in jax.tree_util.tree_leaves((params, prompt, key))):
            return self._generate(*args)  # traced by a caller: part of its program
        try:
            run = _generate_jit(static)
        except TypeError:  # a model whose static part is not hashable
            run = _generate_jit.__wrapped__(static)
        try:
            return run(params, prompt, key, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_k=top_k, dtype=dtype)
        except ValueError as e:
            # Under a caller's trace with no traced input (a model closed over), JAX refuses
            # compiler options on a nested jit before compiling anything.
            if "compiler_options" not in str(e):
                raise
            return self._generate(*args)

    def _generate(self, prompt, max_new_tokens, key, temperature, top_k, dtype):
        b, p = prompt.shape
        model = self.for_decoding()  # each layer's parameters split once, before the loops
        caches = model.init_cache(b, p + max_new_tokens, dtype)
        logits, caches = model.prefill(prompt, caches)
        new = sample_tokens(model.decode_step, logits[:, -1], caches, p, max_new_tokens,
                            key=key, temperature=temperature, top_k=top_k, dtype=prompt.dtype)
        return jnp.concatenate([prompt, new], axis=1)


@functools.lru_cache(maxsize=16)
def _generate_jit(static):
    def run(params, prompt, key, *, max_new_tokens, temperature, top_k, dtype):
        return eqx.combine(params, static)._generate(prompt, max_new_tokens, key, temperature,
                                                     top_k, dtype)

    return jax.jit(run, static_argnames=("max_new_tokens", "temperature", "top_k", "dtype"),
                   compiler_options=decode_compiler_options())


# The input position schemes a causal_lm config may name (``positions``).
INPUT_POSITIONS = {"sinusoidal": SinusoidalPositions, "none": NoPositions}


@register_model("causal_lm", serves=("language_model",),
                defaults=dict(TRUNK, **SLOTS, tie_embeddings=False, scan_layers=True,
                              positions="sinusoidal", scale_embeddings=False,
                              embed_std=0.0),
                loss_weights=AUX_WEIGHTS, packs=True, logits_at=True)
def causal_lm(config, task, key):
    """The decoder-only language model (:class:`CausalLM`; ``positions``: the input
    position scheme, ``"sinusoidal"`` (Vaswani et al. 2017) or ``"none"``: the recurrences
    and convolutions of the token-mixer slot carry order themselves, and their papers (Mamba,
    H3, Hyena; Zoology for every kind but softmax attention) add no positions to the tokens;
    ``scale_embeddings``: the token embeddings times ``sqrt(dim)`` before the positions are
    added (Vaswani et al. 2017, section 3.4; ``nn.Embedder``'s ``scale_tokens``);
    ``embed_std``: the embedding table's initial standard deviation (``nn.Embedder``'s
    ``table_std``; ``0.0``, the default: ``1 / sqrt(dim)``);
    ``tie_embeddings``: the output layer is the input embedding table, as in Zoology;
    ``scan_layers``: the layers run as one ``lax.scan`` (one compiled block, the default) or
    unrolled (``False``: for a few small layers on a CPU, where the scan's stacked residuals
    and the fusions it prevents cost more than the layers: the zoo's 2-layer models)."""
    name = config.get("positions", "sinusoidal")
    if name not in INPUT_POSITIONS:
        raise ValueError(f"causal_lm: positions must be one of {sorted(INPUT_POSITIONS)}, "
                         f"got {name!r}")
    return CausalLM(task.vocab_size, config.dim, config.num_layers, config.num_heads,
                    config.hidden, positions=INPUT_POSITIONS[name](),
                    max_len=task.seq_len, block=block_kwargs(config),
                    tie_embeddings=config.tie_embeddings,
                    scale_embeddings=config.get("scale_embeddings", False),
                    embed_std=config.get("embed_std") or None,
                    stack=dict(scan=config.get("scan_layers", True)), key=key)
