"""PaTH attention (``attention.modern``, Yang et al. 2025): the reference against the paper's
definition written out with explicit Householder matrices, the blockwise UT-form algorithm
against the reference (outputs and gradients), the key-rewriting decoding form against the
forward pass, the reduction ``beta = 0`` to causal softmax attention, padding and bf16. The
registry-wide tests (``test_kinds*.py -k path``) run the kind in models."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fast_jit import jit0
from tests.tolerances import EXACT_GRAD, assert_close
from xformers_jax import attention as A
from xformers_jax import nn
from xformers_jax.attention.modern import _path as P

L, DK, DV = 37, 16, 8  # a length that is no multiple of any block
MASK = jnp.arange(L) < 30


def _inputs(seed, length=L):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q, k = (jax.random.normal(x, (length, DK)) for x in ks[:2])
    v = jax.random.normal(ks[2], (length, DV))
    w = jax.random.normal(ks[3], (length, DK))
    w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
    beta = 2 * jax.nn.sigmoid(2 * jax.random.normal(ks[4], (length,)))  # reflections included
    return q, k, v, w, beta


def _out_and_grads(f, args, rows=L):
    """``f(*args)`` and the gradients of a fixed random projection of its first ``rows`` rows
    with respect to every arg."""
    proj = jax.random.normal(jax.random.PRNGKey(9), (L, DV))[:rows]
    loss = lambda *a: jnp.sum(f(*a)[:rows] * proj)  # noqa: E731
    return f(*args), jax.grad(loss, argnums=tuple(range(len(args))))(*args)


def test_the_reference_is_the_papers_definition():
    # s_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j, H_t = I - beta_t w_t w_t^T, causal softmax:
    # written with explicit matrices, position by position, in float64.
    n = 6
    q, k, v, w, beta = (np.asarray(a, np.float64) for a in _inputs(3, n))
    scores = np.full((n, n), -np.inf)
    for i in range(n):
        for j in range(i + 1):
            prod = np.eye(DK)
            for t in range(i, j, -1):  # H_i first on the left, H_{j+1} last
                prod = prod @ (np.eye(DK) - beta[t] * np.outer(w[t], w[t]))
            scores[i, j] = q[i] @ prod @ k[j] / np.sqrt(DK)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    expected = p / p.sum(-1, keepdims=True) @ v
    assert_close(jit0(P.path_attention_reference)(*_inputs(3, n)), expected)


def test_the_blockwise_form_equals_the_reference():
    # Blocks of 4 in groups of 2 (ten blocks, five groups), of 8 in groups of 3 (five blocks,
    # the last group padded with a block of its own): outputs and gradients, one program.
    args = _inputs(0)

    @jit0
    def run(args):
        ref = _out_and_grads(functools.partial(P.path_attention_reference, kv_mask=MASK), args)
        fast = [_out_and_grads(functools.partial(P.path_attention, kv_mask=MASK, block_size=c,
                                                 group=g), args) for c, g in ((4, 2), (8, 3))]
        return ref, fast

    (ref_out, ref_grads), fast = run(args)
    for out, grads in fast:
        assert_close(out, ref_out)
        assert_close(grads, ref_grads, table=EXACT_GRAD)


def test_rewriting_the_cached_keys_step_by_step_equals_the_forward_pass():
    # The paper's inference form: each new token's H_t rewrites every cached key, then its own
    # key is appended and its query attends the cache by plain softmax.
    q, k, v, w, beta = _inputs(1)

    def decode():
        def step(cache, t):
            cache = P.path_update_keys(cache, w[t], beta[t]).at[t].set(k[t])
            visible = jnp.arange(L) <= t
            out = A.dot_product_attention(q[t][None], cache, v, kv_mask=visible)[0]
            return cache, out

        return jax.lax.scan(step, jnp.zeros((L, DK)), jnp.arange(L))[1]

    assert_close(jit0(decode)(), jit0(functools.partial(P.path_attention, block_size=8))(
        q, k, v, w, beta))


def test_beta_zero_is_causal_softmax_attention():
    q, k, v, w, beta = _inputs(2)
    f = jit0(functools.partial(P.path_attention, kv_mask=MASK, block_size=8))
    soft = A.dot_product_attention(q, k, v, causal=True, kv_mask=MASK)
    assert_close(f(q, k, v, w, jnp.zeros_like(beta)), soft)
    # Any transform moves the outputs.
    assert not np.allclose(f(q, k, v, w, beta)[:30], soft[:30], atol=1e-3)


def test_padded_tokens_are_absent_whatever_they_hold():
    # A padded token has no key and the identity transform: NaN there changes nothing, and the
    # real tokens alone (at their positions) give the same outputs and gradients.
    q, k, v, w, beta = _inputs(4)
    junk = [jnp.where(MASK.reshape(-1, *[1] * (a.ndim - 1)), a, jnp.nan) for a in (k, v, w, beta)]

    @jit0
    def run(padded, alone):
        f = functools.partial(P.path_attention, block_size=4)
        return (_out_and_grads(functools.partial(f, kv_mask=MASK), padded, rows=30),
                _out_and_grads(f, alone, rows=30))

    (out, grads), (ref, ref_grads) = run((q, *junk), tuple(a[:30] for a in (q, k, v, w, beta)))
    assert_close(out[:30], ref)
    for g, r in zip(grads, ref_grads):
        assert_close(g[:30], r, EXACT_GRAD)
        assert np.isfinite(np.asarray(g)).all()


def test_a_packed_row_equals_each_document_alone():
    # Documents of 13 and 17 tokens, then padding: no query sees another document's keys, and
    # every transform between a key and a query is their own document's.
    args = _inputs(7)
    ids = jnp.asarray([1] * 13 + [2] * 17 + [0] * 7)
    f = functools.partial(P.path_attention, block_size=4, group=2)

    @jit0
    def run(args):
        packed = f(*args, kv_mask=ids > 0, segment_ids=ids)
        ref = P.path_attention_reference(*args, kv_mask=ids > 0, segment_ids=ids)
        alone = [f(*(a[s:e] for a in args)) for s, e in ((0, 13), (13, 30))]
        return packed, ref, alone

    packed, ref, alone = run(args)
    assert_close(packed[:30], jnp.concatenate(alone))
    assert_close(packed[:30], ref[:30])


def test_bfloat16_inputs():
    args = _inputs(5)
    out = jit0(functools.partial(P.path_attention, kv_mask=MASK, block_size=8))(
        *(a.astype(jnp.bfloat16) for a in args))
    assert out.dtype == jnp.bfloat16
    ref = jit0(functools.partial(P.path_attention_reference, kv_mask=MASK))(
        *(a.astype(jnp.bfloat16).astype(jnp.float32) for a in args))
    assert_close(out, ref)


def test_errors_name_the_problem():
    q, k, v, w, beta = _inputs(6, 8)
    with pytest.raises(ValueError, match="only with causal=True"):
        P.path_attention(q, k, v, w, beta, causal=False)
    with pytest.raises(ValueError, match=r"w \[Lk, Dk\] = \[8, 16\].*w\(8, 15\)"):
        P.path_attention(q, k, v, w[:, :15], beta)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        P.path_attention(q, k, v, w, beta, block_size=0)
    with pytest.raises(ValueError, match="conv_width must be an int >= 0.*got -1"):
        nn.MultiHeadAttention(16, 2, spec=nn.AttentionSpec("path", {"conv_width": -1}),
                              causal=True, key=jax.random.PRNGKey(0))


def test_a_paged_cache_is_refused():
    # Each step rewrites every cached key, which a paged cache (read-only pages shared by the
    # sequences, written after the step) cannot hold.
    layer = jit0(lambda key: nn.MultiHeadAttention(16, 2, spec=nn.AttentionSpec("path"),
                                                   causal=True, key=key))(jax.random.PRNGKey(0))
    pages, new = jnp.zeros((2, 4, 2, 8)), jnp.zeros((1, 2, 8))
    cache = nn.PagedKVCache(pages, pages, jnp.zeros((2,), jnp.int32), jnp.asarray(0), new, new)
    with pytest.raises(NotImplementedError, match=r"KVDecoding.attend or .update"):
        jax.eval_shape(layer.decode, jnp.ones((1, 1, 16)), cache)


# -- the layer: the transforms from the token, grouped-query attention --------------------------

DIM, HEADS, KV_HEADS, LAYER_L = 16, 4, 2, 13
LAYER_HP = {"block_size": 4, "group": 2, "w_rank": 3}


def _layer(seed, **hp):
    return jit0(lambda key: nn.MultiHeadAttention(
        DIM, HEADS, num_kv_heads=KV_HEADS, spec=nn.AttentionSpec("path", {**LAYER_HP, **hp}),
        causal=True, key=key))(jax.random.PRNGKey(seed))


def _layer_by_the_equations(layer, x):
    """The paper's layer written out (float32, one position and one head at a time): ``u_t =
    x_t W_down W_up``, ``c_t = SiLU(sum_i W_conv[W-1-i] u_{t-i})`` (zeros before the first
    token), ``w_t = c_t / |c_t|`` and ``beta_t = 2 sigmoid(x_t w_beta + b_beta)`` per key/value
    head; query head ``h`` attends with key/value head ``h // (H / H_kv)``'s keys, values and
    transforms, by the reference (the definition with explicit products)."""
    p = layer.params
    q, k, v = layer.project(x)
    u = x @ p["w_down"] @ p["w_up"]  # [B, L, Hkv * D]
    width = p["w_conv"].shape[0]
    conv = jnp.stack([sum(p["w_conv"][width - 1 - i] * u[:, t - i]
                          for i in range(width) if t - i >= 0)
                      for t in range(x.shape[1])], 1)
    w = jax.nn.silu(conv).reshape(*x.shape[:2], KV_HEADS, -1)
    w = w / jnp.sqrt(jnp.sum(w * w, -1, keepdims=True) + 1e-6)
    beta = 2 * jax.nn.sigmoid(x @ p["w_beta"] + p["b_beta"])
    group = HEADS // KV_HEADS
    heads = [[P.path_attention_reference(q[b, :, h], k[b, :, h // group], v[b, :, h // group],
                                         w[b, :, h // group], beta[b, :, h // group])
              for h in range(HEADS)] for b in range(x.shape[0])]
    return layer.output(jnp.stack([jnp.stack(row, 1) for row in heads]))


def test_the_layer_is_the_papers_parameterisation_with_shared_transforms():
    # Outputs and the gradients of every parameter of the layer (the projection, the
    # convolution, the strengths, the attention's own), against the equations written out.
    layer = _layer(0)
    x = jax.random.normal(jax.random.PRNGKey(1), (1, LAYER_L, DIM))
    proj = jax.random.normal(jax.random.PRNGKey(2), (1, LAYER_L, DIM))

    @jit0
    def run(layer):
        def out_and_grad(f):
            return f(layer), eqx.filter_grad(lambda m: jnp.sum(f(m) * proj))(layer)

        return (out_and_grad(lambda m: m(x)),
                out_and_grad(lambda m: _layer_by_the_equations(m, x)))

    (out, grads), (ref, ref_grads) = run(layer)
    assert_close(out, ref)
    assert_close(grads.variant_params, ref_grads.variant_params, table=EXACT_GRAD)
    assert_close((grads.wq, grads.wk, grads.wv), (ref_grads.wq, ref_grads.wk, ref_grads.wv),
                 table=EXACT_GRAD)
    # One transform per key/value head, and the convolution reaches the outputs.
    assert layer.params["w_beta"].shape == (DIM, KV_HEADS)
    assert float(jnp.abs(grads.variant_params["w_conv"]).max()) > 1e-4


@pytest.mark.parametrize("conv_width", [3, 1, 0])
def test_grouped_query_decoding_with_the_convolutions_cache_equals_the_forward_pass(conv_width):
    # Each step convolves the cached directions of the last conv_width - 1 tokens with its own,
    # rewrites every cached key, and attends: the forward pass's outputs position by position.
    layer = _layer(3, conv_width=conv_width)
    x = jax.random.normal(jax.random.PRNGKey(4), (2, LAYER_L, DIM))

    @jit0
    def run(layer):
        def step(cache, x_t):
            out, cache = layer.decode(x_t[:, None], cache)
            return cache, out[:, 0]

        _, outs = jax.lax.scan(step, layer.init_cache(2, LAYER_L), jnp.swapaxes(x, 0, 1))
        return jnp.swapaxes(outs, 0, 1), layer(x)

    decoded, forward = run(layer)
    assert_close(decoded, forward)
    width = layer.init_cache(1, 4).k.shape[-1]
    assert width == (2 * DIM // HEADS if conv_width > 1 else DIM // HEADS)


def test_the_short_convolution_stays_in_its_document():
    # A packed row of two documents: the second's outputs are its own alone (the
    # convolution's first taps read no token of the first document).
    layer = _layer(5)
    x = jax.random.normal(jax.random.PRNGKey(6), (1, LAYER_L, DIM))
    ids = jnp.asarray([[1] * 5 + [2] * 8])

    @jit0
    def run(layer):
        return layer(x, segment_ids=ids), layer(x[:, 5:])

    packed, alone = run(layer)
    assert_close(packed[:, 5:], alone)
