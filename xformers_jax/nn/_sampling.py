"""The decoding loop shared by every causal model's ``generate`` (``CausalLM``, the memory
models): a ``lax.scan`` that picks a token, greedily or by temperature/top-k sampling, and
feeds it back through the model's one-token step."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_tokens(decode_step, logits, caches, start, num: int, *, key=None,
                  temperature: float = 1.0, top_k: int | None = None, dtype=jnp.int32):
    """The decoding loop: ``num`` tokens ``int[B, num]`` chosen one after another from
    ``logits [B, vocab]`` (the next token's, after the prompt), each fed back through
    ``decode_step(token int[B], caches, position) -> (logits, caches)`` at positions
    ``start, start + 1, ...``. Greedy when ``key`` is None; otherwise samples from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens."""
    keys = (jax.random.split(key, num) if key is not None else jnp.zeros((num,), jnp.int32))

    def choose(logits, k):
        return pick_token(logits, None if key is None else k, temperature=temperature,
                          top_k=top_k)

    def step(carry, inputs):
        last, caches = carry
        k, t = inputs
        tok = choose(last, k).astype(dtype)
        last, caches = decode_step(tok, caches, t)
        return (last, caches), tok

    _, new = jax.lax.scan(step, (logits, caches), (keys, start + jnp.arange(num)))
    return new.T


def pick_token(logits, key=None, *, temperature: float = 1.0, top_k: int | None = None):
    """One token per row of ``logits [B, vocab]``: the argmax when ``key`` is None, otherwise
    a sample from ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely
    tokens (the rule :func:`sample_tokens` and ``models.Server`` share, so that a request served
    in a batch draws what it draws decoded alone)."""
    if key is None:
        return jnp.argmax(logits, -1)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)
