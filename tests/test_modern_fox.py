"""Forgetting attention (``attention.modern._fox``, Lin et al., 2025): the score function on
the tiled kernel against the paper's ``L x L`` form (outputs and gradients, the gates
included), its reduction to softmax attention when no gate forgets, and decoding over its own
cache against the forward pass of the layer. The registry-wide tests (``test_kinds*.py -k
fox``) run the kind in models."""

import functools

import jax
import jax.numpy as jnp
import pytest

from tests.fast_jit import build, jit0
from tests.tolerances import EXACT_GRAD, assert_close
from xformers_jax import attention as A
from xformers_jax import nn
from xformers_jax.attention.modern import _fox as F

L, DK, DV = 37, 16, 8  # a length that is no multiple of any block
MASK = (jnp.arange(L) < 30) & (jnp.arange(L) != 12)  # padding at the end and one in the middle


def _arrays(seed):
    kq, kk, kv, kf = jax.random.split(jax.random.PRNGKey(seed), 4)
    q, k = jax.random.normal(kq, (L, DK)), jax.random.normal(kk, (L, DK))
    log_f = jax.nn.log_sigmoid(1.5 + 2 * jax.random.normal(kf, (L,)))
    return q, k, jax.random.normal(kv, (L, DV)), log_f


def _grads(f, args):
    out = f(*args)
    w = jax.random.normal(jax.random.PRNGKey(9), out.shape)
    return jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=tuple(range(len(args))))(*args)


@pytest.mark.parametrize("causal", [True, False])
def test_tiled_equals_the_papers_form_outputs_and_gradients(causal):
    args = _arrays(0)
    fast = functools.partial(F.forgetting_attention, causal=causal, kv_mask=MASK, block_q=8,
                             block_k=8)
    ref = functools.partial(F.forgetting_attention_reference, causal=causal, kv_mask=MASK)
    out, want = jit0(fast)(*args), jit0(ref)(*args)
    assert_close(out, want)
    g, r = jit0(functools.partial(_grads, fast))(args), jit0(functools.partial(_grads, ref))(args)
    assert float(jnp.max(jnp.abs(r[3]))) > 1e-3  # the gates' gradient is not trivially zero
    assert_close(g, r, table=EXACT_GRAD)


def test_gates_that_never_forget_give_softmax_attention():
    q, k, v, _ = _arrays(1)
    out, want = jit0(lambda q, k, v: (
        F.forgetting_attention(q, k, v, jnp.zeros(L), causal=True, kv_mask=MASK, block_q=8,
                               block_k=8),
        A.dot_product_attention(q, k, v, causal=True, kv_mask=MASK)))(q, k, v)
    assert_close(out, want)


def test_a_large_gate_bias_in_the_layer_gives_causal_softmax_attention():
    # f = sigmoid(40) = 1 in float32: the layer is multi-head causal softmax attention.
    spec = nn.AttentionSpec("fox", {"gate_bias_init": 40.0, "block_q": 8, "block_k": 8})
    layer = build(functools.partial(nn.MultiHeadAttention, 16, 2, spec=spec, max_len=L), 0)
    x = jax.random.normal(jax.random.PRNGKey(3), (2, L, 16))

    def both(layer, x):
        q, k, v = layer.project(x, None)
        out = layer.adapter.attend(q, k, v, layer.params, causal=True, kv_mask=None, bias=None,
                                   key=None, inputs=x, **layer._call_hyperparameters())
        return out, A.multihead(A.dot_product_attention)(q, k, v, causal=True)

    assert_close(*jit0(both)(layer, x))


def test_the_decoding_step_reads_the_gates_of_its_cache():
    # The last query over a cache of L slots, the last 5 empty (their gates must not count).
    q, k, v, log_f = _arrays(2)
    valid = jnp.arange(L) < L - 5
    t = L - 6
    out = F.forgetting_decode_step(q[t:t + 1], k, v, log_f.at[t + 1:].set(-3.0), valid=valid)
    want = F.forgetting_attention_reference(q[: t + 1], k[: t + 1], v[: t + 1], log_f[: t + 1],
                                            causal=True)[t:]
    assert_close(out, want)


def test_bad_gates_are_named():
    q, k, v, _ = _arrays(3)
    with pytest.raises(ValueError, match=r"log_f must be float\[L\].*float32\(36,\)"):
        F.forgetting_attention(q, k, v, jnp.zeros(L - 1))
    with pytest.raises(ValueError, match="self-attention"):
        F.forgetting_attention(q[:5], k, v, jnp.zeros(L))


def test_decoding_with_grouped_query_heads_equals_the_forward_pass():
    # 4 query heads over 2 key/value heads: each cached key keeps the gates of its group's
    # query heads, which must be read back by the right heads.
    spec = nn.AttentionSpec("fox", {"block_q": 8, "block_k": 8})
    layer = build(functools.partial(nn.MultiHeadAttention, 16, 4, num_kv_heads=2, spec=spec,
                                    causal=True, max_len=12), 0)
    x = jax.random.normal(jax.random.PRNGKey(4), (2, 12, 16))

    def both(layer, x):
        def step(cache, x_t):
            out, cache = layer.decode(x_t[:, None], cache)
            return cache, out[:, 0]

        steps = jax.lax.scan(step, layer.init_cache(2, 12), jnp.moveaxis(x, 1, 0))[1]
        return layer(x), jnp.moveaxis(steps, 0, 1)

    full, decoded = jit0(both)(layer, x)
    assert_close(decoded, full)


def test_bf16_inputs_keep_the_gates_in_float32():
    q, k, v, log_f = _arrays(5)
    bf = [a.astype(jnp.bfloat16) for a in (q, k, v)]
    out, want = jit0(lambda *a: (
        F.forgetting_attention(*a[:3], log_f, kv_mask=MASK, block_q=8, block_k=8),
        F.forgetting_attention_reference(*a[3:], log_f, kv_mask=MASK)))(
            *bf, *[b.astype(jnp.float32) for b in bf])
    assert out.dtype == jnp.bfloat16
    assert_close(out, want, dtype=jnp.bfloat16)
