"""Log-linear attention (Guo et al., 2025) over Mamba-2 and linear attention: the Fenwick
levels partition every prefix as the paper's tree does; the chunked form (the paper's
chunkwise algorithm, on the one scan's chunk groups) and the token-by-token form (decoding's
``O(log L)`` states) equal the ``L x L`` masked reference, outputs and gradients; with every
level weight 1 each is its base (Mamba-2, the function and the layer; linear attention). The
registry-wide tests (``test_kinds*.py -k loglinear``) run both layers in models (decoding,
padding, prefix, rows)."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fast_jit import build, jit0
from tests.tolerances import EXACT, EXACT_GRAD, assert_close
from xformers_jax import mixers as M
from xformers_jax import nn
from xformers_jax.attention import linear as LA

L, N, P = 37, 4, 3  # a length that is no multiple of any chunk
MASK = jnp.arange(L) < 31


def _ssd_args(seed, levels=LA.num_levels(L)):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    x, b, c = (jax.random.normal(k, (L, d)) for k, d in zip(ks[:3], (P, N, N)))
    dt = jax.nn.softplus(jax.random.normal(ks[3], (L,)))
    lam = jax.nn.softplus(jax.random.normal(ks[4], (L, levels)))
    return x, dt, jnp.float32(-0.7), b, c, lam


def _grads(f, args):
    out = f(*args)
    w = jax.random.normal(jax.random.PRNGKey(9), out.shape)
    return jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=tuple(range(len(args))))(*args)


def test_the_levels_are_the_fenwick_partition_of_every_prefix():
    lev = LA.fenwick_levels(L)
    for t in range(L):
        row = lev[t, : t + 1]
        assert row[t] == 0 and (lev[t, t + 1:] == -1).all()
        for level in range(1, LA.num_levels(L)):
            where = np.flatnonzero(row == level)
            bit = 1 << (level - 1)
            # one bucket of 2^(l-1) contiguous keys where bit l-1 of t is set, none otherwise
            assert len(where) == (bit if t & bit else 0), (t, level)
            if len(where):
                assert where[-1] - where[0] == len(where) - 1
                assert where[0] % bit == 0  # aligned, as a Fenwick tree's nodes
        assert (np.diff(row) <= 0).all()  # farther keys sit in coarser levels


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_each_form_equals_the_masked_reference_outputs_and_gradients(form):
    args = _ssd_args(0)

    def run(implementation, *a):
        return M.loglinear_ssd(*a, kv_mask=MASK, implementation=implementation, chunk_size=4)

    fast, ref = functools.partial(run, form), functools.partial(run, "parallel")
    assert_close(jit0(fast)(*args), jit0(ref)(*args))
    g = jit0(functools.partial(_grads, fast))(args)
    r = jit0(functools.partial(_grads, ref))(args)
    assert float(jnp.max(jnp.abs(r[5]))) > 1e-3  # the level weights' gradient is not zero
    assert_close(g, r, table=EXACT_GRAD)


def test_chunks_carry_the_level_states_across_groups():
    # Chunks of 2 in groups of 8 positions: the chunk-level Fenwick states cross 5 groups.
    fq, fk, v = (jax.random.normal(k, (L, 3)) for k in jax.random.split(jax.random.PRNGKey(4), 3))
    ld = -jax.nn.softplus(jax.random.normal(jax.random.PRNGKey(5), (L,)))
    lam = jax.nn.softplus(jax.random.normal(jax.random.PRNGKey(6), (L, LA.num_levels(L))))
    run = jit0(lambda *a: [LA.loglinear_chunked(*a, chunk, group_positions=8)
                           for chunk in (1, 2, 64)] + [LA.loglinear_parallel(*a)])
    *outs, want = run(fq, fk, v, ld, lam)
    for out in outs:
        assert_close(out, want)


def test_with_every_level_weight_one_it_is_mamba2():
    x, dt, a, b, c, lam = _ssd_args(1)
    ones = jnp.ones_like(lam)
    run = jit0(lambda *a: [M.loglinear_ssd(*a, ones, kv_mask=MASK, implementation=form,
                                           chunk_size=8)
                           for form in ("chunked", "recurrent", "parallel")]
               + [M.ssd(*a, kv_mask=MASK, implementation="parallel")])
    *outs, want = run(x, dt, a, b, c)
    for out in outs:  # at the real positions
        assert_close(out[MASK], want[MASK])


def test_log_linear_attention_with_every_level_weight_one_is_linear_attention():
    q, k, v = (jax.random.normal(key, (L, 4))
               for key in jax.random.split(jax.random.PRNGKey(7), 3))
    lam = jax.nn.softplus(jax.random.normal(jax.random.PRNGKey(8), (L, LA.num_levels(L))))

    def run(q, k, v, lam):
        forms = ("chunked", "recurrent", "parallel")
        return ([M.loglinear_linear(q, k, v, jnp.ones_like(lam), kv_mask=MASK,
                                    implementation=f, chunk_size=8) for f in forms],
                [M.loglinear_linear(q, k, v, lam, kv_mask=MASK, implementation=f, chunk_size=8)
                 for f in forms],
                M.linear_recurrence(q, k * MASK[:, None], v, jnp.zeros(L),
                                    implementation="parallel"))

    ones, weighted, want = jit0(run)(q, k, v, lam)
    for out in ones:
        assert_close(out[MASK], want[MASK])
    for out in weighted[:2]:
        assert_close(out, weighted[2])
    assert float(jnp.max(jnp.abs(weighted[2] - ones[2]))) > 1e-2


def test_the_layer_with_level_weights_one_is_the_mamba2_layer():
    # Bidirectional: the forward pass and the reverse one (here, no padding: a flip) both.
    kw = dict(causal=False, max_len=32, state_size=8, chunk_size=8)
    ll = build(functools.partial(nn._mixer.LogLinearMamba2, 16, 2, **kw), 0)
    m2 = build(functools.partial(nn._mixer.Mamba2, 16, 2, **kw), 1)
    names = ("w_in", "conv_w", "conv_b", "a_log", "dt_bias", "skip", "norm_scale", "w_out")
    ll = eqx.tree_at(lambda m: [getattr(m, n) for n in names] + [m.w_lam], ll,
                     [getattr(m2, n) for n in names] + [jnp.zeros_like(ll.w_lam)])
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 29, 16))
    call = jit0(lambda m, x: m(x))
    assert_close(call(ll, x), call(m2, x))
    # and a trained-looking level projection changes it
    moved = eqx.tree_at(lambda m: m.w_lam, ll, jnp.ones_like(ll.w_lam))
    assert float(jnp.max(jnp.abs(call(moved, x) - call(m2, x)))) > 1e-2


def test_bf16_inputs():
    layer = build(functools.partial(nn._mixer.LogLinearMamba2, 16, 2, causal=True, max_len=32,
                                    state_size=8, chunk_size=8), 0)
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 29, 16))
    call = jit0(lambda m, x: m(x))
    y32, y16 = call(layer, x), call(layer, x.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    assert_close(y16, y32, EXACT, dtype=jnp.bfloat16)


def test_bad_arguments_are_named():
    x, dt, a, b, c, lam = _ssd_args(2)
    with pytest.raises(ValueError, match="power of two"):
        M.loglinear_ssd(x, dt, a, b, c, lam, chunk_size=6)
    with pytest.raises(ValueError, match=r"at least 7 level columns for L=37"):
        M.loglinear_ssd(x, dt, a, b, c, lam[:, :3])
    with pytest.raises(ValueError, match="power of two"):
        nn._mixer.LogLinearMamba2(16, 2, causal=True, max_len=16, chunk_size=12,
                                  key=jax.random.PRNGKey(0))
    layer = build(functools.partial(nn._mixer.LogLinearMamba2, 16, 2, causal=True, max_len=16,
                                    state_size=4), 0)
    with pytest.raises(ValueError, match="max_len=16 positions, got a sequence of 20"):
        layer(jnp.zeros((1, 20, 16)))
    with pytest.raises(ValueError, match="max_len=16 positions, so it cannot decode 32"):
        layer.init_cache(1, 32)
