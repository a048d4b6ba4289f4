"""DeepSeek sparse attention's indexer training (DeepSeek-V3.2, Section 2.1.1): the KL
divergence from the main attention's distribution (summed over heads, L1-normalised) to the
lightning indexer's softmax, over every key (the dense warm-up) or over the selected tokens
(sparse training); the ``dsa`` layer reports it as its auxiliary loss ``indexer_kl`` and it
trains the indexer alone."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fast_jit import build, jit0
from tests.tolerances import EXACT, EXACT_GRAD, assert_close
from xformers_jax import nn, train
from xformers_jax.attention.modern import _dsa as S

L, H, HKV, D = 29, 4, 2, 8  # grouped heads; a length that is no multiple of the chunk
HI, DI = 2, 4
MASK = jnp.arange(L) < 24


def _arrays(seed, *shapes):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return [jax.random.normal(k, s) for k, s in zip(keys, shapes)]


def _keep_of(stage, qi, w, ki, top_k):
    """The keys each query's KL covers ``bool[L, L]`` (the sparse stage's from the index
    list) and the sparse stage's selection as bits."""
    if stage == "dense":
        causal = jnp.arange(L)[None, :] <= jnp.arange(L)[:, None]
        return causal & MASK[None, :], None
    idx, chosen, bits = S.lightning_indexer(qi, w, ki, top_k=top_k, causal=True, kv_mask=MASK,
                                            return_bits=True)
    keep = jnp.zeros((L, L), bool).at[jnp.arange(L)[:, None], idx].max(chosen)
    return keep, bits


def _reference(q, k, qi, w, ki, keep):
    """The paper's loss from its equations, densely: per query KL(p || softmax(I))."""
    kk = jnp.repeat(k, H // HKV, axis=1)  # head h reads key head h // (H / H_kv)
    s = jnp.einsum("qhd,khd->hqk", q, kk) / np.sqrt(D)
    p = jax.nn.softmax(jnp.where(keep, s, -jnp.inf), -1)
    p = jnp.where(keep, p, 0.0).sum(0)
    p = p / p.sum(-1, keepdims=True)
    index = jnp.einsum("qj,qjk->qk", w, jax.nn.relu(jnp.einsum("qjd,kd->qjk", qi, ki)))
    log_q = jax.nn.log_softmax(jnp.where(keep, index, -jnp.inf), -1)
    terms = jnp.where(keep & (p > 0), p * (jnp.log(jnp.where(p > 0, p, 1.0))
                                           - jnp.where(keep, log_q, 0.0)), 0.0)
    return jnp.where(keep.any(-1), terms.sum(-1), 0.0)


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_indexer_loss_matches_the_equations(stage):
    q, k, qi, w, ki = _arrays(1, (L, H, D), (L, HKV, D), (L, HI, DI), (L, HI), (L, DI))
    keep, bits = _keep_of(stage, qi, w, ki, top_k=5)

    def fast(q, k, qi, w, ki):
        return S.indexer_alignment_loss(q, k, qi, w, ki, bits, causal=True, kv_mask=MASK,
                                        chunk=8)

    def ref(q, k, qi, w, ki):
        return _reference(q, k, qi, w, ki, keep)

    args = (q, k, qi, w, ki)
    kl = jit0(fast)(*args)
    assert_close(kl, jit0(ref)(*args))
    assert float(kl.min()) >= -1e-6 and float(kl.max()) > 1e-2  # a KL, and not trivially 0
    grad = functools.partial(jax.grad, argnums=(0, 1, 2, 3, 4))
    g_fast = jit0(grad(lambda *a: fast(*a).sum()))(*args)
    g_ref = jit0(grad(lambda *a: ref(*a).sum()))(*args)
    # Only the indexer learns: the main attention's q and k are the target.
    assert not np.any(np.asarray(g_fast[0])) and not np.any(np.asarray(g_fast[1]))
    assert_close(g_fast[2:], g_ref[2:], table=EXACT_GRAD)


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_indexer_loss_is_zero_when_the_indexer_is_the_attention(stage):
    # Two identical heads of positive queries and keys: the summed, L1-normalised map is each
    # head's softmax(q.k / sqrt(D)). One indexer head with q_I = q / sqrt(D), k_I = k, w = 1
    # scores I = relu(q.k / sqrt(D)) = q.k / sqrt(D), the same logits: KL = 0.
    q1, k1 = (jnp.abs(a) for a in _arrays(2, (L, 1, D), (L, 1, D)))
    q = jnp.concatenate([q1, q1], 1)
    qi, w = q1 / np.sqrt(D), jnp.ones((L, 1))
    _, bits = _keep_of(stage, qi, w, k1[:, 0], top_k=5)
    loss = jit0(functools.partial(S.indexer_alignment_loss, causal=True, kv_mask=MASK, chunk=8))
    assert_close(loss(q, k1, qi, w, k1[:, 0], bits), jnp.zeros((L,)), table=EXACT)
    off = loss(q, k1, 2.0 * qi, w, k1[:, 0], bits)  # sharper: no longer equal
    assert float(off[MASK].min()) >= 0 and float(off.max()) > 1e-3


def _layer(stage):
    spec = nn.AttentionSpec("dsa", {"top_k": 5, "index_heads": HI, "index_dim": DI,
                                    "chunk": 8, "stage": stage})
    return build(functools.partial(nn.MultiHeadAttention, 16, 4, num_kv_heads=2, spec=spec,
                                   causal=True), 3)


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_only_the_indexer_learns_from_its_kl(stage):
    layer = _layer(stage)
    x = jax.random.normal(jax.random.PRNGKey(4), (2, L, 16))
    mask = jnp.stack([MASK, jnp.ones((L,), bool)])
    c = jax.random.normal(jax.random.PRNGKey(5), (2, L, 16))

    def main(m, x):
        return jnp.sum(m(x, kv_mask=mask) * c)

    def with_kl(m, x):
        out, carry = m(x, kv_mask=mask, carry=nn.Carry())
        return jnp.sum(out * c) + carry.aux["indexer_kl"], carry.aux

    g_main = jit0(lambda m, x: eqx.filter_grad(main)(m, x))(layer, x)
    g_both, aux = jit0(lambda m, x: eqx.filter_grad(with_kl, has_aux=True)(m, x))(layer, x)
    assert set(aux) == {"indexer_kl"} and aux["indexer_kl"].shape == ()
    assert float(aux["indexer_kl"]) > 0
    # The main loss gives the indexer nothing (a discrete top-k); its KL gives it a gradient.
    for name in ("w_qi", "w_ki", "w_w"):
        assert not np.any(np.asarray(g_main.variant_params[name])), name
        assert np.any(np.asarray(g_both.variant_params[name])), name
    # Detached: the main path's gradients, the input's included, are unchanged by the KL.
    assert_close((g_both.wq, g_both.wk, g_both.wv, g_both.wo),
                 (g_main.wq, g_main.wk, g_main.wv, g_main.wo), table=EXACT_GRAD)
    assert_close(jit0(jax.grad(lambda x: with_kl(layer, x)[0]))(x),
                 jit0(jax.grad(lambda x: main(layer, x)))(x), table=EXACT_GRAD)
    # Not computed in inference, nor in a call that takes no auxiliary outputs.
    _, carry = jit0(lambda m: m(x, kv_mask=mask, carry=nn.Carry(), inference=True))(layer)
    assert "indexer_kl" not in carry.aux


def test_the_lm_sums_the_indexer_kl_over_layers_and_weighs_it():
    c = train.base_config("lm")
    c.model.update(dict(dim=16, num_layers=2, num_heads=2, hidden=32))
    c.model.attention.update(dict(kind="dsa", top_k=4, index_heads=HI, index_dim=DI, chunk=8))
    c.data.seq_len = 12
    task = train.Task(None, None, None, 32, 32, 12, False, train.TASKS["lm"])
    model = train.build_model(c.model, task, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 1, 32)
    _, aux = jit0(lambda m: m(tokens, return_aux=True))(model)
    assert aux["indexer_kl"].shape == (2,)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, 1)}
    lf = jit0(lambda m, w: train.make_loss_fn(task, None, w)(m, batch, None),
              static_argnums=1)
    off, metrics = lf(model, (("indexer_kl", 0.0),))
    on, _ = lf(model, (("indexer_kl", 0.5),))
    assert_close(metrics["indexer_kl"], aux["indexer_kl"].sum())
    assert_close(on - off, 0.5 * metrics["indexer_kl"])
