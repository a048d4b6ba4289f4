"""Decode from a causal language model one token at a time, with each kind's own cache.

How a kind decodes is part of its record (CATALOGUE.md's *decoding* column): ``kv`` keeps a
growing key/value cache, ``window`` a ring buffer of the last keys (memory independent of the
length), ``recurrent`` a fixed-size state (linear attention's running sums). ``CausalLM``
builds the caches (``init_cache``), feeds a prompt (``prefill``), steps (``decode_step``) and
generates (``generate``: greedy, or sampled with temperature and top-k). The cached path
gives the same logits as the full forward pass; this script checks that for one kind of each
mode and prints the cache size of each.

  python examples/decode.py
"""

import equinox as eqx
import jax
import jax.numpy as jnp

from xformers_jax import models, nn

KINDS = {
    "dot_product (kv)": nn.AttentionSpec("dot_product"),
    "local (window)": nn.AttentionSpec("local", {"left": 8}),
    "linear (recurrent)": nn.AttentionSpec("linear", {"feature_map": "elu"}),
}


def cache_bytes(caches) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(caches)
               if isinstance(x, jax.Array))


def main(length: int = 32, new_tokens: int = 8) -> dict:
    prompt = jax.random.randint(jax.random.PRNGKey(1), (2, length), 0, 256)
    results = {}
    for label, spec in KINDS.items():
        lm = models.CausalLM(256, 32, 2, 4, 64, max_len=length + new_tokens,
                             block=dict(spec=spec), key=jax.random.PRNGKey(0))
        full = lm(prompt)                                      # [B, L, vocab], all at once
        caches = lm.init_cache(2, length + new_tokens)
        cached, caches = eqx.filter_jit(lm.prefill)(prompt, caches)  # token by token
        error = float(jnp.abs(full - cached).max())
        greedy = lm.generate(prompt, new_tokens)               # [B, L + new_tokens]
        sampled = lm.generate(prompt, new_tokens, key=jax.random.PRNGKey(3), temperature=0.8,
                              top_k=20)
        results[label] = dict(error=error, greedy=greedy, sampled=sampled,
                              cache_bytes=cache_bytes(caches))
        print(f"{label:20s} cached vs full logits: max |diff| {error:.1e}; cache "
              f"{cache_bytes(caches):6d} bytes; greedy continuation "
              f"{greedy[0, length:].tolist()}")
    return results


if __name__ == "__main__":
    main()
