"""Kernelized / linear attention: feature maps, causal forms, gates, delta rule, decoding."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import EXACT, EXACT_GRAD, assert_close
from xformers_jax.attention import (
    delta_rule_attention,
    delta_rule_init_state,
    delta_rule_step,
    dot_product_attention,
    dpfp_features,
    elu_features,
    favor_positive_features,
    favor_trig_features,
    hyperbolic_features,
    init_random_projection,
    init_rfa_projection,
    linear_attention,
    linear_attention_init_state,
    linear_attention_step,
    multihead,
    performer_attention,
    relu_features,
    rfa_features,
    taylor_features,
)

L, D = 40, 8
CHUNK = 16  # does not divide L: the padded last chunk is exercised too


def _qkv(key, length=L, dim=D, scale=0.5):
    kq, kk, kv = jax.random.split(key, 3)
    return (
        scale * jax.random.normal(kq, (length, dim)),
        scale * jax.random.normal(kk, (length, dim)),
        jax.random.normal(kv, (length, dim)),
    )


PROJ = init_random_projection(jax.random.PRNGKey(7), 16, D)
# name -> (feature arrays, public feature function of x * sqrt(scale))
MAPS = {
    "elu": ((), elu_features),
    "relu": ((), relu_features),
    "relu_projected": ((PROJ,), lambda x: relu_features(x, PROJ)),
    "favor_positive": ((PROJ,), lambda x: favor_positive_features(x, PROJ)),
    "hyperbolic": ((PROJ,), lambda x: hyperbolic_features(x, PROJ)),
    "favor_trig": ((PROJ,), lambda x: favor_trig_features(x, PROJ)),
    "rfa": ((init_rfa_projection(jax.random.PRNGKey(8), 16, D),), None),
    "dpfp": ((), dpfp_features),
    "taylor": ((), taylor_features),
}


def _map_name(name):
    return "relu" if name == "relu_projected" else name


def _phi(name, x):
    arrays, fn = MAPS[name]
    if fn is None:
        return rfa_features(x, *arrays)
    return fn(x)


def naive_cumsum(name, q, k, v, gate_logits=None, log_decay=None, causal=True):
    """The literal formula: prefix sums of phi(k) v^T (and phi(k)), in float64-free float32,
    with decays applied as exp(C_i) cumsum(exp(-C_j) ...) (fine for mild decays)."""
    r = (1.0 / math.sqrt(q.shape[-1])) ** 0.5
    fq, fk = _phi(name, q * r), _phi(name, k * r)
    ld = jnp.zeros(k.shape[0])
    if gate_logits is not None:
        ld = ld + jax.nn.log_sigmoid(gate_logits)
        fk = fk * jax.nn.sigmoid(-gate_logits)[:, None]
    if log_decay is not None:
        ld = ld + log_decay
    if not causal:
        num, den = fq @ (fk.T @ v), fq @ fk.sum(0)
    else:
        c = jnp.cumsum(ld)
        s = jnp.exp(c)[:, None, None] * jnp.cumsum(
            jnp.exp(-c)[:, None, None] * fk[:, :, None] * v[:, None, :], axis=0
        )
        z = jnp.exp(c)[:, None] * jnp.cumsum(jnp.exp(-c)[:, None] * fk, axis=0)
        num, den = jnp.einsum("lm,lme->le", fq, s), jnp.sum(fq * z, -1)
    return num / jnp.where(den == 0, 1.0, den)[:, None]  # no visible key: 0, as the library


def _gates(key, variant):
    kg, kd = jax.random.split(key)
    if variant == "plain":
        return {}
    if variant == "gate":
        return {"gate_logits": 1.5 + jax.random.normal(kg, (L,))}
    return {"log_decay": -0.1 * jax.random.uniform(kd, (L,))}


# --- FAVOR+ approximates softmax attention -------------------------------------------------


def _favor_error(key, num_features, orthogonal, q, k, v, ref):
    w = init_random_projection(key, num_features, q.shape[-1], orthogonal=orthogonal)
    out = performer_attention(q, k, v, w)
    return jnp.mean(jnp.abs(out - ref)) / jnp.mean(jnp.abs(ref))


def test_favor_error_falls_with_features_and_orthogonal_beats_iid(key):
    # q, k with |q|^2 / sqrt(D) about 1 (scores of standard deviation 1/2): the regime where
    # the estimator's variance, exp(|q + k|^2 / sqrt(D)), is moderate.
    q, k, v = _qkv(key, 128, 16, scale=0.5)
    ref = dot_product_attention(q, k, v)
    seeds = jax.random.split(jax.random.PRNGKey(1), 8)
    err = jax.jit(
        jax.vmap(_favor_error, in_axes=(0, None, None, None, None, None, None)),
        static_argnums=(1, 2),
    )
    errors = {m: float(jnp.mean(err(seeds, m, True, q, k, v, ref))) for m in (64, 256, 1024)}
    # Monte Carlo: the error should roughly halve per 4x features.
    assert errors[1024] < 0.75 * errors[256] and errors[256] < 0.75 * errors[64], errors
    assert errors[1024] < 0.1, errors
    iid = float(jnp.mean(err(seeds, 64, False, q, k, v, ref)))
    assert errors[64] < iid, (errors[64], iid)


def test_projection_rows_and_scaling(key):
    w = init_random_projection(key, 40, 16, scaling="regular")
    np.testing.assert_allclose(np.linalg.norm(w, axis=1), 4.0, rtol=1e-5)
    block = np.asarray(w[:16]) / 4.0
    np.testing.assert_allclose(block @ block.T, np.eye(16), atol=1e-5)
    chi = init_random_projection(key, 40, 16, scaling="chi")
    assert np.std(np.linalg.norm(chi, axis=1)) > 0.1  # norms are drawn, not constant


# --- the forms agree -----------------------------------------------------------------------


# Every gate for one map of each kind (plain features, log-space features); the gate, which
# exercises both the decay and the key weight, for the others. The scan is shared, so this
# keeps the compile time of the suite down without leaving a path untested.
VARIANTS = {name: ("gate",) for name in MAPS}
VARIANTS.update(elu=("plain", "gate", "decay"), favor_positive=("plain", "gate", "decay"))


@pytest.mark.parametrize("name", list(MAPS))
def test_recurrent_chunked_naive_agree(key, name):
    """Outputs and gradients (q, k, v, gate/decay) of the three causal forms."""
    q, k, v = _qkv(key)
    if name == "dpfp":
        # Products of ReLUs vanish for many random rows; a shift keeps phi(q) . z away from 0,
        # where the normalised output is ill-conditioned and no two orders of summation agree.
        q, k = q + 0.5, k + 0.5
    arrays = MAPS[name][0]

    def loss(impl, q, k, v, gates):
        if impl == "naive":
            out = naive_cumsum(name, q, k, v, **gates)
        else:
            out = linear_attention(q, k, v, *arrays, feature_map=_map_name(name), causal=True,
                                   implementation=impl, chunk_size=CHUNK, **gates)
        return jnp.sum(jnp.sin(out)), out

    @jax.jit
    def everything(q, k, v):
        return {
            (variant, impl): jax.grad(functools.partial(loss, impl), (0, 1, 2, 3), has_aux=True)(
                q, k, v, _gates(jax.random.fold_in(key, 1), variant))
            for variant in VARIANTS[name]
            for impl in ("naive", "recurrent", "chunked")
        }

    res = everything(q, k, v)
    for variant in VARIANTS[name]:
        g_ref, out_ref = res[variant, "naive"]
        for impl in ("recurrent", "chunked"):
            g, out = res[variant, impl]
            msg = f"{impl}, {variant}"
            assert_close(out, out_ref, EXACT, err_msg=msg)
            for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref)):
                assert bool(jnp.all(jnp.isfinite(a)))
                assert_close(a, b, EXACT_GRAD, err_msg=msg)


@pytest.mark.parametrize("name", list(MAPS))
def test_non_causal_matches_naive(key, name):
    q, k, v = _qkv(key, 24, D)
    k, v = k[:20], v[:20]  # cross attention: Lq != Lk
    out = linear_attention(q, k, v, *MAPS[name][0], feature_map=_map_name(name))
    assert_close(out, naive_cumsum(name, q, k, v, causal=False), EXACT)


def test_delta_rule_forms_agree(key):
    q, k, v = _qkv(key)
    beta = jax.random.normal(jax.random.fold_in(key, 2), (L,))

    def loss(impl, fm, arrays, q, k, v, beta):
        out = delta_rule_attention(q, k, v, beta, *arrays, feature_map=fm, implementation=impl,
                                   chunk_size=CHUNK)
        return jnp.sum(jnp.sin(out)), out

    for fm, arrays in (("dpfp", ()), ("favor_positive", (PROJ,))):
        res = [
            jax.grad(functools.partial(loss, impl, fm, arrays), (0, 1, 2, 3), has_aux=True)(
                q, k, v, beta)
            for impl in ("recurrent", "chunked")
        ]
        assert_close(res[1][1], res[0][1], EXACT)
        for a, b in zip(res[1][0], res[0][0]):
            assert_close(a, b, EXACT_GRAD)


def test_delta_rule_retrieves_written_value():
    # One-hot (orthogonal) keys with beta -> 1 store values exactly; rewriting a key replaces
    # its value rather than adding to it: the "write-and-remove" property.
    eye = jnp.eye(4)
    k = jnp.concatenate([eye, eye[:1]])  # key 0 is written twice
    v = jnp.arange(5 * 3, dtype=jnp.float32).reshape(5, 3)
    out = delta_rule_attention(k, k, v, jnp.full((5,), 30.0), feature_map=lambda x: jax.nn.relu(x))
    assert_close(out[-1], v[-1], EXACT)


# --- decoding ------------------------------------------------------------------------------


@pytest.mark.parametrize("name,variant", [("elu", "decay"), ("favor_positive", "gate"),
                                          ("hyperbolic", "plain"), ("rfa", "gate")])
def test_decode_steps_equal_parallel(key, name, variant):
    q, k, v = _qkv(key)
    gates = _gates(jax.random.fold_in(key, 1), variant)
    arrays, fm = MAPS[name][0], _map_name(name)
    parallel = linear_attention(q, k, v, *arrays, feature_map=fm, causal=True, chunk_size=CHUNK,
                                **gates)
    g = gates.get("gate_logits", jnp.zeros(L))
    d = gates.get("log_decay", jnp.zeros(L))

    def step(state, x):
        out, state = linear_attention_step(state, *x[:3], *arrays, feature_map=fm,
                                           gate_logit=x[3] if "gate_logits" in gates else None,
                                           log_decay=x[4])
        return state, out

    state = linear_attention_init_state(D, D, *arrays, feature_map=fm)
    steps = jax.lax.scan(step, state, (q, k, v, g, d))[1]
    assert_close(steps, parallel, EXACT)


def test_delta_decode_steps_equal_parallel(key):
    q, k, v = _qkv(key)
    beta = jax.random.normal(jax.random.fold_in(key, 2), (L,))
    parallel = delta_rule_attention(q, k, v, beta, chunk_size=CHUNK)

    def step(state, x):
        out, state = delta_rule_step(state, *x)
        return state, out

    steps = jax.lax.scan(step, delta_rule_init_state(D, D), (q, k, v, beta))[1]
    assert_close(steps, parallel, EXACT)


# --- causality, padding, precision ---------------------------------------------------------

CASES = [
    ("favor_positive", "plain", "chunked"),
    ("favor_positive", "gate", "recurrent"),
    ("hyperbolic", "decay", "chunked"),
    ("elu", "gate", "chunked"),
]


def _attend(name, variant, impl, q, k, v, gates, **kw):
    return linear_attention(q, k, v, *MAPS[name][0], feature_map=_map_name(name), causal=True,
                            implementation=impl, chunk_size=CHUNK, **gates, **kw)


@pytest.mark.parametrize("name,variant,impl", CASES)
def test_causal_no_leak(key, name, variant, impl):
    q, k, v = _qkv(key)
    gates = _gates(jax.random.fold_in(key, 1), variant)
    t = 21  # mid-chunk
    # Huge future keys: a key stabiliser with a global maximum would underflow the past.
    k2 = k.at[t + 1:].mul(40.0)
    v2 = v.at[t + 1:].add(5.0)
    a = _attend(name, variant, impl, q, k, v, gates)
    b = _attend(name, variant, impl, q, k2, v2, gates)
    assert bool(jnp.all(jnp.isfinite(b)))
    assert_close(b[: t + 1], a[: t + 1], EXACT)

    def past(k, v):
        return jnp.sum(_attend(name, variant, impl, q, k, v, gates)[: t + 1] ** 2)

    gk, gv = jax.grad(past, (0, 1))(k2, v2)
    assert bool(jnp.all(gk[t + 1:] == 0)) and bool(jnp.all(gv[t + 1:] == 0))
    assert bool(jnp.any(gk[: t + 1] != 0))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["favor_positive", "elu", "favor_trig"])
def test_padding_invariance(key, name, causal):
    q, k, v = _qkv(key)
    mask = jnp.arange(L) % 7 != 3  # holes in the middle, not only a padded tail
    mask = mask.at[-5:].set(False)
    gates = _gates(jax.random.fold_in(key, 1), "gate") if causal else {}
    junk = jax.random.normal(jax.random.fold_in(key, 9), (L, D)) * 50.0
    k2 = jnp.where(mask[:, None], k, junk)
    v2 = jnp.where(mask[:, None], v, jnp.inf)
    if causal:
        gates2 = {"gate_logits": jnp.where(mask, gates["gate_logits"], -30.0)}
    else:
        gates2 = {}

    def f(k, v, gates):
        return linear_attention(q, k, v, *MAPS[name][0], feature_map=name, causal=causal,
                                kv_mask=mask, chunk_size=CHUNK, **gates)

    a, b = f(k, v, gates), f(k2, v2, gates2)
    assert bool(jnp.all(jnp.isfinite(b)))
    assert_close(b, a, EXACT)
    # Dropping the padded keys altogether gives the same result (non-causal).
    if not causal:
        assert_close(a, linear_attention(q, k[mask], v[mask], *MAPS[name][0], feature_map=name),
                     EXACT)
    gk, gv = jax.grad(lambda k, v: jnp.sum(f(k, v, gates2) ** 2), (0, 1))(k2, jnp.where(mask[:, None], v, 3.0))
    assert bool(jnp.all(gk[~mask] == 0)) and bool(jnp.all(gv[~mask] == 0))


def test_delta_padding_invariance(key):
    q, k, v = _qkv(key)
    beta = jax.random.normal(jax.random.fold_in(key, 2), (L,))
    mask = jnp.arange(L) % 5 != 2
    a = delta_rule_attention(q, k, v, beta, kv_mask=mask, chunk_size=CHUNK)
    b = delta_rule_attention(q, jnp.where(mask[:, None], k, 9.0), jnp.where(mask[:, None], v, -7.0),
                             jnp.where(mask, beta, 5.0), kv_mask=mask, chunk_size=CHUNK)
    assert_close(b, a, EXACT)


def test_all_keys_masked_gives_zeros(key):
    q, k, v = _qkv(key)
    mask = jnp.zeros((L,), bool)
    for causal in (False, True):
        out = performer_attention(q, k, v, PROJ, causal=causal, kv_mask=mask)
        assert bool(jnp.all(out == 0))


def test_fp32_finite_at_64k():
    # Long sequence, strong scores: the running key stabiliser keeps every exponent <= 0.
    n, d = 65536, 4
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(3), 3)
    q, k = (3.0 * jax.random.normal(x, (n, d)) for x in (kq, kk))
    v = jax.random.normal(kv, (n, d))
    w = init_random_projection(jax.random.PRNGKey(4), 8, d)
    out = jax.jit(lambda q, k, v: performer_attention(q, k, v, w, causal=True, chunk_size=256))(q, k, v)
    assert bool(jnp.all(jnp.isfinite(out)))
    # A convex combination of values stays inside their range.
    assert float(jnp.max(jnp.abs(out))) <= float(jnp.max(jnp.abs(v))) + 1e-3


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_inputs(key, causal):
    q, k, v = _qkv(key)
    ref = performer_attention(q, k, v, PROJ, causal=causal, chunk_size=CHUNK)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out = performer_attention(qb, kb, vb, PROJ, causal=causal, chunk_size=CHUNK)
    assert out.dtype == jnp.bfloat16
    assert_close(out, performer_attention(*(x.astype(jnp.float32) for x in (qb, kb, vb)), PROJ,
                                          causal=causal, chunk_size=CHUNK), EXACT, dtype=jnp.bfloat16)
    assert_close(out, ref, EXACT, dtype=jnp.bfloat16)
    g = jax.grad(lambda q: jnp.sum(performer_attention(q, kb, vb, PROJ, causal=causal)
                                   .astype(jnp.float32)))(qb)
    assert g.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(g.astype(jnp.float32))))


def test_jit_vmap_grad_multihead(key):
    b, h = 2, 3
    ks = jax.random.split(key, 4)
    q, k, v = (jax.random.normal(x, (b, L, h, D)) * 0.5 for x in ks[:3])
    mask = jnp.ones((b, L), bool).at[1, -6:].set(False)
    fn = multihead(functools.partial(linear_attention, feature_map="favor_positive"))
    f = jax.jit(lambda q, k, v: fn(q, k, v, PROJ, causal=True, kv_mask=mask))
    out = f(q, k, v)
    assert out.shape == (b, L, h, D)
    one = linear_attention(q[1, :, 2], k[1, :, 2], v[1, :, 2], PROJ, feature_map="favor_positive",
                           causal=True, kv_mask=mask[1])
    assert_close(out[1, :, 2], one, EXACT)
    grads = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), (0, 1, 2))(q, k, v)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
    assert bool(jnp.all(grads[1][1, -6:] == 0))


# --- bad input -----------------------------------------------------------------------------


def test_bad_input_errors(key):
    q, k, v = _qkv(key)
    with pytest.raises(ValueError, match="unknown feature_map 'softmax'"):
        linear_attention(q, k, v, feature_map="softmax")
    with pytest.raises(ValueError, match="takes 1 feature array"):
        linear_attention(q, k, v, feature_map="favor_positive")
    with pytest.raises(ValueError, match=r"projection must have shape \[num_features, D\] with D = 8"):
        performer_attention(q, k, v, jnp.ones((16, 5)))
    with pytest.raises(ValueError, match="need causal=True"):
        linear_attention(q, k, v, gate_logits=jnp.zeros(L))
    with pytest.raises(ValueError, match=r"causal=True needs Lq == Lk"):
        linear_attention(q[:5], k, v, causal=True)
    with pytest.raises(ValueError, match="implementation must be one of"):
        linear_attention(q, k, v, causal=True, implementation="fast")
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        linear_attention(q, k, v, causal=True, chunk_size=0)
    with pytest.raises(ValueError, match=r"gate_logits must be a scalar or have shape \(40,\)"):
        linear_attention(q, k, v, causal=True, gate_logits=jnp.zeros(3))
    with pytest.raises(ValueError, match="kv_mask must be boolean"):
        linear_attention(q, k, v, kv_mask=jnp.ones(L))
    with pytest.raises(ValueError, match="exists only with causal=True"):
        delta_rule_attention(q, k, v, jnp.zeros(L), causal=False)
    with pytest.raises(ValueError, match="kernel must be one of"):
        performer_attention(q, k, v, PROJ, kernel="gaussian")
    with pytest.raises(ValueError, match="scaling must be 'chi' or 'regular'"):
        init_random_projection(key, 8, 8, scaling="unit")
    with pytest.raises(ValueError, match="must have rank 2"):
        linear_attention(q[None], k[None], v[None])
    with pytest.raises(ValueError, match="single tokens"):
        linear_attention_step(linear_attention_init_state(D, D), q, k, v)
    with pytest.raises(Exception, match="log_decay must be <= 0"):
        linear_attention(q, k, v, causal=True, log_decay=jnp.full((L,), 0.1))


@pytest.mark.parametrize("length,chunk,group", [(50, 4, 8), (64, 8, 16), (37, 5, 5)])
def test_grouped_chunks_equal_the_recurrent_form(length, chunk, group):
    # causal_chunked scans over groups of chunks (group_positions), carrying the state; the
    # group count need not divide the chunks (padding adds nothing). Outputs and gradients,
    # with decays, must equal the per-step scan's.
    from xformers_jax.attention.linear._scan import causal_chunked, causal_recurrent

    ks = jax.random.split(jax.random.PRNGKey(5), 4)
    fq = jax.random.uniform(ks[0], (length, 6))
    fk = jax.random.uniform(ks[1], (length, 6))
    v = jax.random.normal(ks[2], (length, 5))
    ld = -jax.random.uniform(ks[3], (length,))

    def grouped(*a):
        return causal_chunked(*a, chunk, group_positions=group)

    ct = jax.random.normal(jax.random.PRNGKey(9), (length, 5))
    out, vjp = jax.vjp(jax.jit(grouped), fq, fk, v, ld)
    ref, vjp_ref = jax.vjp(causal_recurrent, fq, fk, v, ld)
    assert_close(out, ref)
    for g, g_ref in zip(vjp(ct), vjp_ref(ct)):
        assert_close(g, g_ref)


@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_gated_intra_chunk_vjp_equals_autodiff(scale):
    # Per-feature decays (GLA) take the hand-written VJP (dfq, dfk, dv, db = fq dfq - fk dfk);
    # it must equal autodiff of the [c, c, M] product, with strong decays too (scale 30:
    # within-chunk log-decay differences far below exp's range).
    from xformers_jax.attention.linear._scan import _intra_decay, _intra_gated

    ks = jax.random.split(jax.random.PRNGKey(11), 5)
    fq, fk = (jax.random.normal(k, (3, 6, 4)) for k in ks[:2])
    v = jax.random.normal(ks[2], (3, 6, 5))
    b = jnp.cumsum(-scale * jax.random.uniform(ks[3], (3, 6, 4)), axis=1)
    ct = jax.random.normal(ks[4], (3, 6, 5))

    def plain(fq, fk, v, b):
        return jnp.einsum("ncd,nde->nce",
                          jnp.einsum("ncm,ndm,ncdm->ncd", fq, fk, _intra_decay(b)), v)

    out, vjp = jax.vjp(_intra_gated, fq, fk, v, b)
    ref, vjp_ref = jax.vjp(plain, fq, fk, v, b)
    assert_close(out, ref, EXACT)
    for g, g_ref in zip(vjp(ct), vjp_ref(ct)):
        assert bool(jnp.all(jnp.isfinite(g)))
        assert_close(g, g_ref, EXACT_GRAD)


@pytest.mark.parametrize("length,chunk,stride", [(27, 6, 3), (40, 8, 2)])
def test_delta_rule_read_every_rth_position_equals_those_rows(length, chunk, stride):
    # gated_delta_chunked(query_stride=r) computes only the outputs at positions r-1, 2r-1,
    # ... (DeltaProduct's reads after each token's sub-steps): they must equal those rows of
    # the per-step scan, outputs and gradients, with a decay at every position (so the
    # rows' decay factors are checked) and a padded last chunk (27 in chunks of 6).
    from xformers_jax.attention.linear import gated_delta_chunked, gated_delta_recurrent

    ks = jax.random.split(jax.random.PRNGKey(7), 5)
    fq = jax.random.normal(ks[0], (length, 4))
    fk = jax.random.normal(ks[1], (length, 4)) * 0.5
    v = jax.random.normal(ks[2], (length, 3))
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (length,)))
    ld = -jax.random.uniform(ks[4], (length,))

    def strided(*a):
        return gated_delta_chunked(*a, chunk_size=chunk, query_stride=stride)

    def rows(*a):
        return gated_delta_recurrent(*a)[stride - 1::stride]

    ct = jax.random.normal(jax.random.PRNGKey(9), (length // stride, 3))
    out, vjp = jax.vjp(jax.jit(strided), fq, fk, v, beta, ld)
    ref, vjp_ref = jax.vjp(rows, fq, fk, v, beta, ld)
    assert out.shape == (length // stride, 3)
    assert_close(out, ref, EXACT)
    for g, g_ref in zip(vjp(ct), vjp_ref(ct)):
        assert_close(g, g_ref, EXACT_GRAD)
    with pytest.raises(ValueError, match="query_stride must be a positive int dividing"):
        gated_delta_chunked(fq, fk, v, beta, ld, chunk_size=chunk, query_stride=5)
