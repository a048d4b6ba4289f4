"""Softmax attention changed since the surveys (``attention.modern``): each fast form against
its reference written from the paper's equations (outputs and gradients), the reductions the
papers state, and decoding (naive and absorbed MLA) against the forward pass. The registry-wide
tests (``test_kinds*.py``) run the kinds in models; here are the checks specific to each."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fast_jit import jit0
from tests.tolerances import EXACT_GRAD, assert_close
from xformers_jax import attention as A
from xformers_jax import nn
from xformers_jax.attention.modern import _differential as D
from xformers_jax.attention.modern import _mla as M
from xformers_jax.attention.modern import _dsa as S
from xformers_jax.attention.modern import _moba as MB
from xformers_jax.attention.modern import _nsa as N

L, DK, DV = 37, 16, 8  # a length that is no multiple of any block
MASK = jnp.arange(L) < 30


def _arrays(seed, *shapes):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return [jax.random.normal(k, s) for k, s in zip(keys, shapes)]


def _grads(f, args):
    """Gradients of a fixed random projection of ``f(*args)`` with respect to every arg."""
    out = f(*args)
    w = jax.random.normal(jax.random.PRNGKey(9), out.shape)
    return jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=tuple(range(len(args))))(*args)


# -- differential attention ------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_differential_matches_the_two_dense_maps(causal):
    q, k, v = _arrays(0, (L, DK), (L, DK), (L, DV))
    lam = jnp.float32(0.37)
    fast = functools.partial(D.differential_attention, lambda_init=0.35, causal=causal,
                             kv_mask=MASK, block_q=8, block_k=8)
    ref = functools.partial(D.differential_attention_reference, lambda_init=0.35,
                            causal=causal, kv_mask=MASK)
    f, r = jit0(fast), jit0(ref)
    assert_close(f(q, k, v, lam), r(q, k, v, lam))
    assert_close(jit0(functools.partial(_grads, fast))((q, k, v, lam)),
                 jit0(functools.partial(_grads, ref))((q, k, v, lam)), table=EXACT_GRAD)


def test_differential_with_lambda_zero_is_normalised_softmax_attention():
    q, k, v = _arrays(1, (L, DK), (L, DK), (L, DV))
    out = D.differential_attention(q, k, v, 0.0, lambda_init=0.2, causal=True, kv_mask=MASK)
    soft = A.dot_product_attention(q[:, : DK // 2], k[:, : DK // 2], v, causal=True,
                                   kv_mask=MASK, scale=1 / np.sqrt(DK // 2))
    rms = soft * jax.lax.rsqrt(jnp.mean(soft * soft, -1, keepdims=True) + 1e-5)
    assert_close(out, 0.8 * rms)
    # lambda != 0 subtracts the second map: the output moves.
    assert not np.allclose(D.differential_attention(q, k, v, 0.5, lambda_init=0.2, causal=True,
                                                    kv_mask=MASK), out, atol=1e-3)


def test_lambda_init_follows_the_layer_depth():
    assert D.lambda_init_for(1) == pytest.approx(0.2)
    assert D.lambda_init_for(2) == pytest.approx(0.8 - 0.6 * np.exp(-0.3))
    assert D.lambda_init_for(40) == pytest.approx(0.8, abs=1e-5)
    with pytest.raises(ValueError, match="1-based depth"):
        D.lambda_init_for(0)
    with pytest.raises(ValueError, match="must be even"):
        D.differential_attention(*_arrays(0, (4, 5), (4, 5), (4, 3)), 0.1)


# -- multi-head latent attention ---------------------------------------------------------------

D_C, D_R, D_NOPE = 12, 4, 12


def _mla_arrays(seed):
    return _arrays(seed, (L, D_NOPE + D_R), (L, D_C), (L, D_R), (D_C, D_NOPE), (D_C, DV))


@pytest.mark.parametrize("causal", [False, True])
def test_mla_naive_and_absorbed_forms_match_the_equations(causal):
    args = _mla_arrays(2)
    ref = functools.partial(M.multi_head_latent_attention_reference, causal=causal,
                            kv_mask=MASK)
    want, want_grads = jit0(ref)(*args), jit0(functools.partial(_grads, ref))(args)
    for absorb in (False, True):
        fast = functools.partial(M.multi_head_latent_attention, absorb=absorb, causal=causal,
                                 kv_mask=MASK, block_q=8, block_k=8)
        assert_close(jit0(fast)(*args), want, err_msg=f"absorb={absorb}")
        assert_close(jit0(functools.partial(_grads, fast))(args), want_grads,
                     table=EXACT_GRAD, err_msg=f"absorb={absorb}")


def test_mla_cache_is_the_latent_and_the_rotary_key():
    # DeepSeek-V2's Table 1 sizes: d_c = 4 d_h, d_R = d_h / 2, against 2 n_h d_h for MHA.
    heads, hd = 16, 128
    mla = A.mla_cache_bytes_per_token(4 * hd, hd // 2)
    mha = A.mha_cache_bytes_per_token(heads, hd)
    assert mla == (512 + 64) * 2 and mha == 2 * 16 * 128 * 2
    assert mla * 4 <= mha


def _mla_layer(hp, key=0):
    spec = nn.AttentionSpec("mla", {"block_q": 8, "block_k": 8, **hp})
    return jit0(lambda k: nn.MultiHeadAttention(32, 2, head_dim=16, spec=spec, causal=True,
                                                key=k))(jax.random.PRNGKey(key))


@pytest.mark.parametrize("hp", [{"latent_dim": 24, "rope_dim": 4},
                                {"latent_dim": 24, "rope_dim": 6, "q_latent_dim": 20}])
def test_mla_naive_and_absorbed_decoding_equal_the_forward_pass(hp):
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 13, 32))

    def run(layer):
        cache = layer.init_cache(2, 13)
        assert cache.k.shape == (2, 1, 13, hp["latent_dim"])  # the latent, not per-head keys
        assert cache.v.shape == (2, 1, 13, hp["rope_dim"])

        def step(c, xt):
            o, c = layer.decode(xt[:, None], c)
            return c, o[:, 0]

        _, outs = jax.lax.scan(step, cache, jnp.moveaxis(x, 1, 0))
        return jnp.moveaxis(outs, 0, 1)

    naive_layer = _mla_layer({**hp, "decode_absorbed": False})
    absorbed_layer = _mla_layer({**hp, "decode_absorbed": True})
    forward = jit0(lambda m: m(x))(naive_layer)
    naive = jit0(run)(naive_layer)
    absorbed = jit0(run)(absorbed_layer)
    assert_close(naive, forward, err_msg="naive decoding against the forward pass")
    assert_close(absorbed, forward, err_msg="absorbed decoding against the forward pass")


# -- MoBA ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal,top_k", [(False, 2), (True, 1), (True, 3)])
def test_moba_computes_the_reference_selection(causal, top_k):
    q, k, v = _arrays(4, (L, DK), (L, DK), (L, DV))
    q = 3 * q  # sharp gates: the choice is far from ties
    kw = dict(block_size=4, top_k=top_k, causal=causal, kv_mask=MASK)
    fast = functools.partial(MB.moba_attention, chunk=8, **kw)
    ref = functools.partial(MB.moba_reference, **kw)
    assert_close(jit0(fast)(q, k, v), jit0(ref)(q, k, v))
    assert_close(jit0(functools.partial(_grads, fast))((q, k, v)),
                 jit0(functools.partial(_grads, ref))((q, k, v)), table=EXACT_GRAD)


@pytest.mark.parametrize("causal", [False, True])
def test_moba_whole_blocks_without_a_mask_match_the_reference(causal):
    # No kv_mask and a length that is a multiple of the block: the tiles carry no mask, so a
    # tile's unused rows must read the appended zero query (zero cotangent); were they to read
    # a real query, dk and dv would gain its terms.
    n = 40
    q, k, v = _arrays(14, (n, DK), (n, DK), (n, DV))
    kw = dict(block_size=4, top_k=3, causal=causal)
    fast = functools.partial(MB.moba_attention, chunk=8, **kw)
    ref = functools.partial(MB.moba_reference, **kw)
    args = (3 * q, k, v)
    assert_close(jit0(fast)(*args), jit0(ref)(*args))
    assert_close(jit0(functools.partial(_grads, fast))(args),
                 jit0(functools.partial(_grads, ref))(args), table=EXACT_GRAD)


def test_moba_reductions():
    q, k, v = _arrays(5, (L, DK), (L, DK), (L, DV))
    # Every block chosen: full attention; causal with top_k = 1: the own block alone.
    everything = MB.moba_attention(q, k, v, block_size=4, top_k=10, kv_mask=MASK)
    assert_close(everything, A.dot_product_attention(q, k, v, kv_mask=MASK))
    own = MB.moba_attention(q, k, v, block_size=4, top_k=1, causal=True, kv_mask=MASK)
    assert_close(own, A.block_sparse_attention(q, k, v, A.patterns.BlockLocal(4), causal=True,
                                               kv_mask=MASK))
    # Causal with every past block chosen: causal attention.
    assert_close(MB.moba_attention(q, k, v, block_size=4, top_k=10, causal=True, kv_mask=MASK),
                 A.dot_product_attention(q, k, v, causal=True, kv_mask=MASK))


def test_moba_chooses_by_the_pooled_keys():
    # Two past blocks; the query matches the second's mean key: with top_k = 2 (own + one)
    # it must see block 1 and not block 0.
    bs = 4
    k = jnp.concatenate([-jnp.ones((bs, 4)), jnp.ones((bs, 4)), jnp.zeros((bs, 4))])
    v = jnp.concatenate([jnp.zeros((bs, 1)), jnp.ones((bs, 1)), 5 * jnp.ones((bs, 1))])
    q = jnp.zeros((3 * bs, 4)).at[2 * bs].set(1.0)
    out = MB.moba_attention(q, k, v, block_size=bs, top_k=2, causal=True)
    # softmax over block 1 (score 1/sqrt(4) * 4 = 2 each) and key 8 (score 0, value 5).
    w = np.exp(2.0) * 4 / (np.exp(2.0) * 4 + 1)
    assert float(out[2 * bs, 0]) == pytest.approx(w * 1 + (1 - w) * 5, rel=1e-5)


# -- native sparse attention -----------------------------------------------------------------------

def _gates(seed):
    return jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(seed), (L, 3)))


@pytest.mark.parametrize("causal", [False, True])
def test_nsa_computes_the_reference_branches(causal):
    q, k, v = _arrays(7, (L, DK), (L, DK), (L, DV))
    kw = dict(block_size=4, num_selected=3, window=5, causal=causal, kv_mask=MASK)
    fast = functools.partial(N.native_sparse_attention, chunk=8, **kw)
    ref = functools.partial(N.native_sparse_reference, **kw)
    args = (2 * q, k, v, _gates(8))
    assert_close(jit0(fast)(*args), jit0(ref)(*args))
    assert_close(jit0(functools.partial(_grads, fast))(args),
                 jit0(functools.partial(_grads, ref))(args), table=EXACT_GRAD)


def test_nsa_branches_are_moba_and_the_sliding_window():
    q, k, v = _arrays(9, (L, DK), (L, DK), (L, DV))
    kw = dict(block_size=4, num_selected=3, window=5, causal=True, kv_mask=MASK)
    one = lambda i: jnp.zeros((L, 3)).at[:, i].set(1.0)  # noqa: E731
    # Selected alone: MoBA's choice (by the pooled keys), the own block always kept.
    assert_close(N.native_sparse_attention(q, k, v, one(1), **kw),
                 MB.moba_attention(q, k, v, block_size=4, top_k=3, causal=True, kv_mask=MASK))
    # Sliding alone: the window of the last 5 keys.
    assert_close(N.native_sparse_attention(q, k, v, one(2), **kw),
                 A.block_sparse_attention(q, k, v, A.patterns.Local(4, 0), causal=True,
                                          kv_mask=MASK))
    # Compressed alone: softmax over the blocks already complete (none before position 3).
    cmp = N.native_sparse_attention(q, k, v, one(0), **kw)
    assert np.all(np.asarray(cmp[:3]) == 0) and np.all(np.abs(np.asarray(cmp[3:30])) > 0)


# -- DeepSeek sparse attention ------------------------------------------------------------------

def _indexer_arrays(seed):
    return _arrays(seed, (L, 2, 4), (L, 2), (L, 4))


@pytest.mark.parametrize("causal,top_k", [(False, 5), (True, 5), (True, 1)])
def test_dsa_attends_the_indexers_tokens(causal, top_k):
    q, k, v = _arrays(10, (L, DK), (L, DK), (L, DV))
    qi, w, ki = _indexer_arrays(11)

    def fast(q, k, v):
        idx, chosen = S.lightning_indexer(qi, w, ki, top_k=top_k, causal=causal, kv_mask=MASK,
                                          chunk=8)
        return S.deepseek_sparse_attention(q, k, v, idx, chosen, causal=causal, kv_mask=MASK,
                                           chunk=8)

    ref = functools.partial(S.deepseek_sparse_reference, q_index=qi, weights=w, k_index=ki,
                            top_k=top_k, causal=causal, kv_mask=MASK)
    assert_close(jit0(fast)(q, k, v), jit0(ref)(q, k, v))
    assert_close(jit0(functools.partial(_grads, fast))((q, k, v)),
                 jit0(functools.partial(_grads, ref))((q, k, v)), table=EXACT_GRAD)


@pytest.mark.parametrize("causal,top_k", [(False, 5), (True, 5), (True, 40)])
def test_dsa_bits_are_the_indexers_choice_and_the_tiled_form_attends_it(causal, top_k):
    q, k, v = _arrays(16, (L, DK), (L, DK), (L, DV))
    qi, w, ki = _indexer_arrays(17)
    ki = ki.at[3:9].set(ki[2])  # tied scores: top_k takes the earliest tied keys
    idx, chosen, bits = S.lightning_indexer(qi, w, ki, top_k=top_k, causal=causal,
                                            kv_mask=MASK, chunk=8, return_bits=True)
    same = S.lightning_indexer(qi, w, ki, top_k=top_k, causal=causal, kv_mask=MASK, chunk=8)
    assert all(np.array_equal(a, b) for a, b in zip((idx, chosen), same))
    want = np.zeros((L, L), bool)
    for t in range(L):
        want[t, np.asarray(idx[t])[np.asarray(chosen[t])]] = True
    words = np.asarray(bits)
    got = (words[:, np.arange(L) // 32] >> (np.arange(L) % 32).astype(np.uint32)) & 1
    np.testing.assert_array_equal(got.astype(bool), want)

    def tiled(q, k, v):
        return S.deepseek_sparse_tiled(q, k, v, bits, causal=causal, kv_mask=MASK, block_q=8,
                                       block_k=8)

    ref = functools.partial(S.deepseek_sparse_reference, q_index=qi, weights=w, k_index=ki,
                            top_k=top_k, causal=causal, kv_mask=MASK)
    assert_close(jit0(tiled)(q, k, v), jit0(ref)(q, k, v))
    assert_close(jit0(functools.partial(_grads, tiled))((q, k, v)),
                 jit0(functools.partial(_grads, ref))((q, k, v)), table=EXACT_GRAD)


def test_dsa_reductions_and_choice():
    q, k, v = _arrays(12, (L, DK), (L, DK), (L, DV))
    qi, w, ki = _indexer_arrays(13)
    # top_k >= L: every earlier real token, i.e. causal attention.
    idx, chosen = S.lightning_indexer(qi, w, ki, top_k=L, causal=True, kv_mask=MASK)
    assert_close(S.deepseek_sparse_attention(q, k, v, idx, chosen, causal=True, kv_mask=MASK),
                 A.dot_product_attention(q, k, v, causal=True, kv_mask=MASK))
    # The choice is the top of sum_j w_j relu(q_j . k_s): one indexer head, w = 1, q = 1 and
    # k_s = s: the latest tokens (the largest scores) among the earlier ones.
    idx, chosen = S.lightning_indexer(jnp.ones((8, 1, 1)), jnp.ones((8, 1)),
                                      jnp.arange(8.0)[:, None], top_k=3, causal=True)
    assert sorted(np.asarray(idx[6]).tolist()) == [4, 5, 6]
    assert np.asarray(chosen[1]).tolist() == [True, True, False]  # only 2 keys at position 1


def test_selection_kinds_form_no_length_by_length_array():
    n = 1024  # beyond the tiled kernel's largest tile (512), so an [n, n] array is a dense map
    q, k, v = _arrays(14, (n, 16), (n, 16), (n, 16))
    qi, w, ki = _arrays(15, (n, 2, 4), (n, 2), (n, 4))
    g = jnp.full((n, 3), 0.5)

    def dsa(q):
        idx, chosen = S.lightning_indexer(qi, w, ki, top_k=32, causal=True, chunk=32)
        return S.deepseek_sparse_attention(q, k, v, idx, chosen, causal=True, chunk=32)

    for f in (lambda q: MB.moba_attention(q, k, v, block_size=16, top_k=2, causal=True,
                                          chunk=32),
              lambda q: N.native_sparse_attention(q, k, v, g, block_size=16, num_selected=2,
                                                  window=16, causal=True, chunk=32),
              dsa):
        shapes = _shapes(jax.make_jaxpr(jax.grad(lambda q: f(q).sum()))(q).jaxpr)
        assert not [s for s in shapes if s.count(n) >= 2], sorted(shapes)


def _shapes(jaxpr):
    """Every intermediate's shape in ``jaxpr`` and the jaxprs it calls."""
    found = set()
    for eqn in jaxpr.eqns:
        found |= {tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars}
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    found |= _shapes(getattr(inner, "jaxpr", inner))
    return found
