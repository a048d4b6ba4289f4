"""Your attention idea in ten lines: three worked examples of flex attention.

Run: ``python examples/flex_attention.py`` (small sizes, a few seconds on a CPU). Each example
checks itself against the definition (the same function applied to a materialised score
matrix) and prints the largest difference. See docs/flex.md.
"""

import jax
import jax.numpy as jnp
import numpy as np

from xformers_jax.attention import flex_attention, multihead
from xformers_jax.attention.patterns import Causal, MaskMod, document_mask

B, L, H, D = 2, 96, 4, 16
kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
q, k, v = (jax.random.normal(x, (B, L, H, D)) for x in (kq, kk, kv))
i, j = jnp.arange(L)[:, None], jnp.arange(L)[None, :]


def definition(score, keep):
    """softmax(where(keep, score, -inf)) @ v over [B, H, L, L] scores."""
    s = jnp.where(keep, score, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def check(name, out, ref):
    err = float(jnp.abs(out - ref).max())
    print(f"{name}, max |flex - definition|: {err:.2e}")
    assert err < 1e-5, (name, err)


def scores():
    return jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)


# 1. A score function with a learned parameter: ALiBi-like slopes that are trained.
slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625])


def learned_alibi(slopes):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)
    out = multihead(flex_attention)(q, k, v, score_mod=score_mod, causal=True,
                                    head_index=jnp.arange(H), block_q=32, block_k=32)
    return out


ref = definition(scores() - slopes[:, None, None] * (i - j), j <= i)
check("1. learned ALiBi", learned_alibi(slopes), ref)
grad = jax.grad(lambda s: learned_alibi(s).sum())(slopes)
print("   gradient of the slopes:", np.round(np.asarray(grad), 4))


# 2. A mask function: a sliding window of 16 plus the first 4 tokens (attention sinks).
def window_and_sinks(b, h, q_idx, kv_idx):
    return (kv_idx < 4) | (q_idx - kv_idx <= 16)


mask = MaskMod(window_and_sinks) & Causal()
print("   its block layout at 32 x 32 tiles:", mask.layout(L, L, 32, 32))
out = multihead(flex_attention)(q, k, v, mask_mod=mask, block_q=32, block_k=32)
ref = definition(scores(), ((j < 4) | (i - j <= 16)) & (j <= i))
check("2. window + sinks", out, ref)


# 3. Soft-capped scores over packed documents (three documents in each row).
docs = np.repeat([0, 1, 2], [40, 24, 32])


def capped(score, b, h, q_idx, kv_idx):
    return 20.0 * jnp.tanh(score / 20.0)


out = multihead(flex_attention)(q, k, v, score_mod=capped,
                                mask_mod=document_mask(docs) & Causal(), block_q=32, block_k=32)
same_doc = jnp.asarray(docs)[:, None] == jnp.asarray(docs)[None, :]
ref = definition(20.0 * jnp.tanh(scores() / 20.0), same_doc & (j <= i))
check("3. soft-cap over documents", out, ref)
