"""Use an attention function in your own JAX code.

Every attention kind is a pure function on one sequence and one head
(``q [Lq, Dk], k [Lk, Dk], v [Lk, Dv] -> [Lq, Dv]``); ``multihead`` lifts it to
``[batch, length, heads, dim]`` with ``jax.vmap``. This script checks the memory-efficient
exact kernel against the dense reference, with causal masking and key padding, then runs a
sparse pattern and an approximate kind on the same inputs, under ``jit`` and ``grad``.

  python examples/attention_function.py [--length=1024]
"""

import argparse

import jax
import jax.numpy as jnp

from xformers_jax.attention import (dot_product_attention, flash_attention,
                                    init_random_projection, multihead, patterns,
                                    performer_attention)


def main(length: int = 1024, heads: int = 4, dim: int = 32) -> dict:
    key = jax.random.PRNGKey(0)
    q, k, v = jax.random.normal(key, (3, 2, length, heads, dim))  # [B, L, H, D] each
    # Key padding: the second sequence has only 3/4 of its tokens (True = real token).
    kv_mask = jnp.arange(length)[None, :] < jnp.array([[length], [3 * length // 4]])

    flash = jax.jit(multihead(flash_attention), static_argnames="causal")
    dense = jax.jit(multihead(dot_product_attention), static_argnames="causal")
    out = flash(q, k, v, causal=True, kv_mask=kv_mask)          # O(L) memory, exact
    ref = dense(q, k, v, causal=True, kv_mask=kv_mask)          # the [L, L] score matrix
    exact_error = float(jnp.max(jnp.abs(out - ref)))

    # A pattern is data: a causal sliding window of 64 keys; empty tiles are skipped.
    local = multihead(flash_attention)(q, k, v, pattern=patterns.Local(64, 0))
    local_ref = multihead(dot_product_attention)(q, k, v, pattern=patterns.Local(64, 0))
    local_error = float(jnp.max(jnp.abs(local - local_ref)))

    # An approximate kind has the same signature plus its own arrays: Performer's random
    # features are drawn once from an explicit key and passed in (shared by every head).
    projection = init_random_projection(jax.random.PRNGKey(1), 128, dim)
    approx = multihead(performer_attention)(q, k, v, projection)
    approx_error = float(jnp.mean(jnp.abs(approx - multihead(dot_product_attention)(q, k, v))))

    # Gradients flow through every kind; padded keys get none.
    grad_k = jax.grad(lambda k: flash(q, k, v, causal=True, kv_mask=kv_mask).sum())(k)
    padded_grad = float(jnp.abs(grad_k[1, 3 * length // 4:]).max())

    print(f"flash vs dense (causal, padded): max |diff| = {exact_error:.2e}")
    print(f"Local(64, 0) flash vs dense:     max |diff| = {local_error:.2e}")
    print(f"performer (128 features) vs exact: mean |diff| = {approx_error:.3f}")
    print(f"gradient reaching padded keys:   {padded_grad:.1f}")
    return dict(exact_error=exact_error, local_error=local_error, approx_error=approx_error,
                padded_grad=padded_grad)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1024)
    main(parser.parse_args().length)
