"""The Forgetting Transformer's "Pro" attention (the ``fox_pro`` kind, Lin et al., 2025):
the layer against the paper's equations written out position by position (the token shift of
keys and values, QK-norm, forgetting attention, the output norm and gate; outputs and every
parameter's gradient, grouped-query heads), every component off giving the plain ``fox``
layer, decoding with grouped-query heads against the forward pass, and the shift within a
document. The registry-wide tests (``test_kinds*.py -k fox_pro``) run the kind in models."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from tests.fast_jit import build, jit0
from tests.tolerances import EXACT_GRAD, assert_close
from xformers_jax import nn
from xformers_jax.attention.modern import _fox as F
from xformers_jax.attention.modern import _fox_pro as P

DIM, HEADS, KV_HEADS, L = 16, 4, 2, 12
TILES = {"block_q": 8, "block_k": 8}
PARTS = ("kv_shift", "qk_norm", "output_norm", "output_gate")


def _layer(seed, kind="fox_pro", **hp):
    spec = nn.AttentionSpec(kind, {**TILES, **hp})
    layer = build(functools.partial(nn.MultiHeadAttention, DIM, HEADS, num_kv_heads=KV_HEADS,
                                    spec=spec, causal=True, max_len=L), seed)
    # Scales away from their initial ones, so that each is seen to be applied per head and
    # channel.
    ks = jax.random.split(jax.random.PRNGKey(seed + 100), 3)
    params = dict(layer.variant_params)
    for k, name in zip(ks, ("q_scale", "k_scale", "o_scale")):
        if name in params:
            params[name] = 1 + 0.5 * jax.random.normal(k, params[name].shape)
    return eqx.tree_at(lambda m: m.variant_params, layer, params)


def _by_the_equations(layer, x):
    """The paper's layer, one position and one head at a time (float32): ``k~_t = a_t k_{t-1} +
    (1 - a_t) k_t`` with ``a_t = sigmoid(w^T x_t)`` per key/value head (values likewise with
    their own ``w``, ``k_{-1} = 0``), ``q^ = q / rms(q) * g_q`` and ``k^ = k~ / rms(k~) * g_k``,
    forgetting attention (the reference: the ``L x L`` sums of log gates) with query head ``h``
    on key/value head ``h // (H / H_kv)``, ``o^ = o / rms(o) * g_o``, times ``sigmoid(W_g
    x_t)``, then the output projection."""
    p = layer.params
    q, k, v = layer.project(x)
    alpha = jax.nn.sigmoid(jnp.einsum("bld,dhs->blhs", x, p["w_shift"]))
    shifted = []
    for a, s in ((k, 0), (v, 1)):
        rows = [(1 - alpha[:, 0, :, s, None]) * a[:, 0]]
        rows += [alpha[:, t, :, s, None] * a[:, t - 1] + (1 - alpha[:, t, :, s, None]) * a[:, t]
                 for t in range(1, L)]
        shifted.append(jnp.stack(rows, 1))
    k, v = shifted

    def rms(a, g):
        return a / jnp.sqrt(jnp.mean(a * a, -1, keepdims=True) + 1e-6) * g

    q, k = rms(q, p["q_scale"]), rms(k, p["k_scale"])
    log_f = jax.nn.log_sigmoid(x @ p["w_f"] + p["b_f"])  # [B, L, H]
    group = HEADS // KV_HEADS
    o = jnp.stack([jnp.stack([F.forgetting_attention_reference(
        q[b, :, h], k[b, :, h // group], v[b, :, h // group], log_f[b, :, h])
        for h in range(HEADS)], 1) for b in range(x.shape[0])])
    o = rms(o, p["o_scale"]) * jax.nn.sigmoid(jnp.einsum("bld,dhe->blhe", x, p["w_gate"]))
    return layer.output(o)


def test_the_layer_is_the_papers_pro_attention():
    layer = _layer(0)
    x = jax.random.normal(jax.random.PRNGKey(1), (1, L, DIM))
    proj = jax.random.normal(jax.random.PRNGKey(2), (1, L, DIM))

    @jit0
    def run(layer):
        def out_and_grad(f):
            return f(layer), eqx.filter_grad(lambda m: jnp.sum(f(m) * proj))(layer)

        return (out_and_grad(lambda m: m(x)), out_and_grad(lambda m: _by_the_equations(m, x)))

    (out, grads), (ref, ref_grads) = run(layer)
    assert_close(out, ref)
    assert_close(grads.variant_params, ref_grads.variant_params, table=EXACT_GRAD)
    assert_close((grads.wq, grads.wk, grads.wv, grads.wo),
                 (ref_grads.wq, ref_grads.wk, ref_grads.wv, ref_grads.wo), table=EXACT_GRAD)
    assert float(jnp.abs(grads.variant_params["w_shift"]).max()) > 1e-4


def test_every_component_off_is_the_plain_forgetting_layer():
    # The same projections and gates: fox_pro without its four components is fox.
    fox = _layer(3, kind="fox")
    pro = eqx.tree_at(lambda m: m.variant_params, _layer(3, **{p: False for p in PARTS}),
                      fox.variant_params)
    pro = eqx.tree_at(lambda m: (m.wq, m.wk, m.wv, m.wo), pro, (fox.wq, fox.wk, fox.wv, fox.wo))
    x = jax.random.normal(jax.random.PRNGKey(4), (2, L, DIM))
    mask = jnp.arange(L)[None] < jnp.asarray([[L], [9]])
    # And each component on its own moves the outputs.
    ones = []
    for part in PARTS:
        one = _layer(3, **{p: p == part for p in PARTS})
        one = eqx.tree_at(lambda m: (m.wq, m.wk, m.wv, m.wo), one,
                          (fox.wq, fox.wk, fox.wv, fox.wo))
        params = {**one.variant_params, "w_f": fox.params["w_f"], "b_f": fox.params["b_f"]}
        ones.append(eqx.tree_at(lambda m: m.variant_params, one, params))
    out, want, *moved = jit0(lambda layers: [m(x, kv_mask=mask) for m in layers])(
        [pro, fox, *ones])
    assert_close(out, want)
    for part, one in zip(PARTS, moved):
        assert not np.allclose(one[0], want[0], atol=1e-3), part


def test_decoding_with_grouped_query_heads_equals_the_forward_pass():
    # The cache keeps the keys and values before the shift, with each token's shift weights
    # and its group's log gates; each step shifts and normalises them again.
    layer = _layer(5)
    x = jax.random.normal(jax.random.PRNGKey(6), (2, L, DIM))

    @jit0
    def both(layer):
        def step(cache, x_t):
            out, cache = layer.decode(x_t[:, None], cache)
            return cache, out[:, 0]

        steps = jax.lax.scan(step, layer.init_cache(2, L), jnp.moveaxis(x, 1, 0))[1]
        return layer(x), jnp.moveaxis(steps, 0, 1)

    full, decoded = both(layer)
    assert_close(decoded, full)


def test_the_token_shift_stays_in_its_document():
    # alpha_t x_{t-1} + (1 - alpha_t) x_t, with x_{t-1} = 0 at the row's and at each
    # document's first token, written out.
    x = jax.random.normal(jax.random.PRNGKey(7), (1, 9, 2, 3))
    alpha = jax.random.uniform(jax.random.PRNGKey(8), (1, 9, 2))
    ids = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0, 0]])
    want = np.asarray(x) * (1 - np.asarray(alpha))[..., None]
    for t in range(1, 9):
        if ids[0, t] == ids[0, t - 1]:
            want[:, t] += np.asarray(alpha)[:, t, :, None] * np.asarray(x)[:, t - 1]
    assert_close(P.token_shift(x, alpha, ids), want)
